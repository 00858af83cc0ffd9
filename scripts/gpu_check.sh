#!/usr/bin/env bash
# One command for a GPU machine (docs/gpu.md): the gpu test tier and the GPU benchmarks, each under its
# own time limit (8 minutes in all on one H100), their logs and a one-page summary.md in OUTDIR.
# Installs nothing and reaches no network: it runs the interpreter that has torch ($PYTHON, else python3).
#
#   scripts/gpu_check.sh OUTDIR [--dir /nvme/tmp] [--tiny] [...]   # python -m benchmarks.gpu check --help
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
if [ $# -lt 1 ]; then
    echo "usage: scripts/gpu_check.sh OUTDIR [--dir WORKDIR] [--tiny] (python -m benchmarks.gpu check --help)" >&2
    exit 2
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
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m benchmarks.gpu check "$@"
