#!/usr/bin/env bash
# One command for a GPU machine (docs/gpu.md): the gpu test tier and the GPU benchmarks, each under its
# own time limit (9 minutes in all on one GPU), their logs, top-20 tables and a one-page summary.md in OUTDIR.
# Installs nothing and reaches no network: it runs the interpreter that has torch ($PYTHON, else python3).
# --bundle DIR (or GPU_BUNDLE=DIR): the folder scripts/gpu_bundle.sh made: its bin/ (a static fio) goes
# first on PATH and its python/ (liburing) on PYTHONPATH, and the check says what it uses.
#
#   scripts/gpu_check.sh OUTDIR [--bundle DIR] [--dir /nvme/tmp] [--tiny] [...]   # python -m benchmarks.gpu check --help
#   scripts/gpu_check.sh OUTDIR --parts moe --dir /nvme/tmp   # issue 48: benchmarks.infer_moe --device cuda (moe.json)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
bundle=${GPU_BUNDLE:-}
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) [ $# -ge 2 ] || { echo "gpu_check: --bundle needs the folder scripts/gpu_bundle.sh made" >&2; exit 2; }
                  bundle=$2; shift 2 ;;
        --bundle=*) bundle=${1#--bundle=}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ ${#args[@]} -lt 1 ]; then
    echo "usage: scripts/gpu_check.sh OUTDIR [--bundle DIR] [--dir WORKDIR] [--tiny] (python -m benchmarks.gpu check --help)" >&2
    exit 2
fi
if [ -n "$bundle" ]; then
    if [ ! -d "$bundle" ]; then
        echo "gpu_check: bundle $bundle: no such folder (make it with scripts/gpu_bundle.sh DIR where there is network)" >&2
        exit 2
    fi
    bundle=$(cd "$bundle" && pwd)
    [ -d "$bundle/bin" ] && PATH="$bundle/bin:$PATH"
    [ -d "$bundle/python" ] && PYTHONPATH="$bundle/python${PYTHONPATH:+:$PYTHONPATH}"
    export PATH PYTHONPATH GPU_CHECK_BUNDLE="$bundle"
    echo "gpu_check: bundle $bundle: fio $([ -x "$bundle/bin/fio" ] && echo "$bundle/bin/fio" || echo "not in it")," \
         "liburing $(ls -d "$bundle"/python/liburing 2>/dev/null || echo "not in it")"
fi
missing=$("$PYTHON" -c '
import importlib.util
print(" ".join(m for m in ("torch", "transformers", "pytest", "numpy", "safetensors", "psutil")
               if importlib.util.find_spec(m) is None))' 2>/dev/null) || missing="python"
if [ -n "$missing" ]; then
    echo "gpu_check: $PYTHON lacks: $missing; set PYTHON to the interpreter that has torch and the project's" \
         "dependencies (PYTHON=/path/to/python scripts/gpu_check.sh OUTDIR); nothing is installed here" >&2
    exit 2
fi
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m benchmarks.gpu check "${args[@]}"
