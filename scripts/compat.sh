#!/usr/bin/env bash
# The fast tier (pytest -m "not slow") on the versions pyproject.toml allows but .venv does not have:
#   oldest  the torch and transformers floors of pyproject.toml ("torch>=X" -> torch==X, ...)
#   tf5.17  transformers 5.17.0 (the version a GPU machine had) with setup.sh's torch
# Each in its own virtual environment in the clone (.venv-compat-NAME/, git-ignored), made on the first
# run (several GB: PyPI's torch builds before 2.13 bring their CUDA libraries) and reused while
# pyproject.toml is unchanged. Exits non-zero when a tier fails in either.
#
#   scripts/compat.sh                 # both
#   scripts/compat.sh oldest          # one of them
#   scripts/compat.sh tf5.17 -- -x tests/test_infer_kv.py   # arguments after -- go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
floor() {  # the version after "NAME>=" in pyproject.toml's dependencies
    sed -n "s/^ *\"$1>=\([0-9.]*\)\".*/\1/p" pyproject.toml | head -1
}
declare -A TORCH=([oldest]="$(floor torch)" [tf5.17]="${TORCH_VERSION:-2.13.0}")
declare -A TRANSFORMERS=([oldest]="$(floor transformers)" [tf5.17]="5.17.0")

names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    [ -n "${TORCH[$1]:-}" ] || { echo "compat: unknown environment '$1'; choose from: ${!TORCH[*]}" >&2; exit 2; }
    names+=("$1"); shift
done
[ "${1:-}" = "--" ] && shift
[ ${#names[@]} -gt 0 ] || names=(oldest tf5.17)

make_env() {  # make_env NAME: create or refresh .venv-compat-NAME
    local name=$1 venv=.venv-compat-$1
    local want; want="torch==${TORCH[$name]} transformers==${TRANSFORMERS[$name]} $(sha256sum pyproject.toml | cut -d' ' -f1)"
    if [ -f "$venv/.compat-stamp" ] && [ "$(cat "$venv/.compat-stamp")" = "$want" ]; then
        return
    fi
    echo "compat: making $venv (torch ${TORCH[$name]}, transformers ${TRANSFORMERS[$name]})"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    local pins="$venv/.compat-pins.txt"
    printf 'torch==%s\ntransformers==%s\n' "${TORCH[$name]}" "${TRANSFORMERS[$name]}" > "$pins"
    # The pins constrain the extras too: nothing may upgrade torch or transformers past them.
    "$venv/bin/python" -m pip --disable-pip-version-check -q install -c "$pins" \
        "torch==${TORCH[$name]}" "transformers==${TRANSFORMERS[$name]}" -e '.[test,lightning,accelerate]' 2>&1 \
        | grep -v "^WARNING: Location" || true
    "$venv/bin/python" -c 'import tensorio, offload, pytest, lightning, accelerate'  # fails loudly if the install did not
    echo "$want" > "$venv/.compat-stamp"
}

failed=()
for name in "${names[@]}"; do
    make_env "$name"
    versions=$(".venv-compat-$name/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')
    echo "compat: $name: $versions: pytest -m \"not slow\" $*"
    start=$SECONDS
    if ".venv-compat-$name/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider "$@"; then
        echo "compat: $name ($versions): passed in $((SECONDS - start)) s"
    else
        echo "compat: $name ($versions): FAILED (above)"
        failed+=("$name")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "compat: failed in: ${failed[*]}" >&2
    exit 1
fi
