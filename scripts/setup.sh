#!/usr/bin/env bash
# Set up everything the project needs, inside the clone: a virtual environment in .venv with the
# CPU build of torch (where no torch is installed yet), the project in editable mode with its test
# extras, and the fio binary from the system package manager where it is missing and we may install.
# Idempotent: a second run with an unchanged pyproject.toml does nothing but check.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "setup: Python 3.10 or newer is needed (found: $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# pip warns once per index location a pip.conf names that does not exist on this machine ("WARNING:
# Location ... is ignored"): noise for a user, dropped from every install's output. pip's exit status,
# and every other line, pass through.
pip_install() {
    "${PIP[@]}" install "$@" 2> >(grep -v "^WARNING: Location" >&2)
}

# A bare `torch` requirement with nothing installed may pull a multi-GB CUDA build: install the CPU
# build first. TORCH_SPEC overrides it (e.g. a CUDA build on a machine with a GPU).
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
    pip_install "${TORCH_SPEC:-torch==2.13.0}"
fi

stamp=.venv/.tensorio-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing the project (editable, with the test and trainer-integration extras)"
    pip_install -e '.[test,lightning,accelerate]' || true  # the import check below says what is missing
    .venv/bin/python -c 'import tensorio, offload, bench, pytest, lightning, accelerate' # fails loudly if the install did not
    echo "$want" > "$stamp"
fi

if ! command -v fio >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing fio"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio) >/dev/null 2>&1 \
            || echo "setup: could not install fio; the comparisons with fio and the tests that need it will skip" >&2
    else
        echo "setup: fio is not installed and this user cannot install it (sudo apt-get install fio);" \
             "the comparisons with fio and the tests that need it will skip" >&2
    fi
fi
