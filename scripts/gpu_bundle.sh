#!/usr/bin/env bash
# What a GPU machine without network needs for scripts/gpu_check.sh that the clone does not carry, in one
# folder to carry there (docs/gpu.md): a static fio (built from Debian's fio source with --build-static: its
# io_uring engine needs no library) and the liburing wheel, fetched from the package registries.
#
#   scripts/gpu_bundle.sh OUTDIR [--fio-source TARBALL] [--no-fio] [--no-liburing]
#   scripts/gpu_check.sh RESULTS --bundle OUTDIR      # on the GPU machine
#
# OUTDIR then holds bin/fio, wheels/liburing-*.whl, python/ (the wheel installed there: PYTHONPATH), and
# MANIFEST.txt saying what each is. Needs: python3 with pip ($PYTHON), and for fio apt-get, tar, gcc, make
# (or --fio-source, a fio source tarball already here). Exit status 0 when everything asked for is in
# OUTDIR; 2 for a usage error or a missing tool (named); 3 when the network is unreachable (said in one line).
set -euo pipefail
PYTHON=${PYTHON:-python3}
usage="usage: scripts/gpu_bundle.sh OUTDIR [--fio-source TARBALL] [--no-fio] [--no-liburing]"
out="" fio_source="" want_fio=1 want_liburing=1
while [ $# -gt 0 ]; do
    case "$1" in
        --fio-source) [ $# -ge 2 ] || { echo "gpu_bundle: --fio-source needs a tarball; $usage" >&2; exit 2; }
                      fio_source=$2; shift 2 ;;
        --no-fio) want_fio=0; shift ;;
        --no-liburing) want_liburing=0; shift ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_bundle: unknown option $1; $usage" >&2; exit 2 ;;
        *) [ -z "$out" ] || { echo "gpu_bundle: one OUTDIR only (got $out and $1); $usage" >&2; exit 2; }
           out=$1; shift ;;
    esac
done
[ -n "$out" ] || { echo "gpu_bundle: OUTDIR is missing; $usage" >&2; exit 2; }
if [ -n "$fio_source" ] && [ ! -f "$fio_source" ]; then
    echo "gpu_bundle: --fio-source $fio_source: no such file" >&2; exit 2
fi

# 1. The tools, each missing one named with what it is for.
need=()
[ "$want_liburing" = 0 ] || "$PYTHON" -m pip --version >/dev/null 2>&1 || need+=("$PYTHON with pip (pip download of the liburing wheel; set PYTHON)")
if [ "$want_fio" = 1 ]; then
    for tool in tar gcc make; do
        command -v "$tool" >/dev/null 2>&1 || need+=("$tool (to build fio: apt-get install $tool)")
    done
    [ -n "$fio_source" ] || command -v apt-get >/dev/null 2>&1 || need+=("apt-get (fio's source from Debian; or --fio-source TARBALL)")
fi
if [ ${#need[@]} -gt 0 ]; then
    for line in "${need[@]}"; do echo "gpu_bundle: missing: $line" >&2; done
    exit 2
fi
mkdir -p "$out" || { echo "gpu_bundle: cannot create OUTDIR $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
manifest=()

# 2. The liburing wheel (abi3: any CPython >= 3.10 on x86_64 Linux), and installed into python/ for PYTHONPATH.
if [ "$want_liburing" = 1 ]; then
    mkdir -p "$out/wheels"
    if ! "$PYTHON" -m pip download --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 --timeout 15 \
            --retries 1 -d "$out/wheels" liburing >"$work/pip.log" 2>&1; then
        echo "gpu_bundle: no network: pip could not download liburing from the package index ($(grep -m1 -iE 'error|warning' "$work/pip.log" || tail -n1 "$work/pip.log"))" >&2
        exit 3
    fi
    wheel=$(ls "$out"/wheels/liburing-*.whl | tail -n1)
    rm -rf "$out/python"
    "$PYTHON" -m pip install --no-deps --no-index --target "$out/python" "$wheel" >"$work/pip-install.log" 2>&1 \
        || { echo "gpu_bundle: pip install --target $out/python $wheel failed: $(tail -n1 "$work/pip-install.log")" >&2; exit 1; }
    manifest+=("wheels/$(basename "$wheel"): the liburing wheel; python/: it installed (PYTHONPATH=$out/python)")
fi

# 3. A static fio: Debian's source (an apt source list of this machine's own, deb-src, in a temporary folder), or --fio-source.
if [ "$want_fio" = 1 ]; then
    if [ -z "$fio_source" ]; then
        mkdir -p "$work/apt/sources" "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/src"
        for f in /etc/apt/sources.list.d/*.sources; do
            [ -f "$f" ] && sed 's/^Types:.*/Types: deb-src/' "$f" >"$work/apt/sources/$(basename "$f")"
        done
        [ -f /etc/apt/sources.list ] && grep -E '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' \
            >"$work/apt/sources/main.list" || true
        apt=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$work/apt/sources"
             -o Dir::State::Lists="$work/apt/lists" -o Dir::Cache="$work/apt/cache" -o Acquire::Retries=1)
        if ! apt-get "${apt[@]}" -qq update >"$work/apt.log" 2>&1 || grep -qE '^(W|E): Failed to fetch' "$work/apt.log"; then
            echo "gpu_bundle: no network: apt-get could not read the Debian source lists ($(grep -m1 -E '^(W|E):' "$work/apt.log" || tail -n1 "$work/apt.log"))" >&2
            exit 3
        fi
        (cd "$work/src" && apt-get "${apt[@]}" -qq source --download-only fio >"$work/apt-source.log" 2>&1) \
            || { echo "gpu_bundle: apt-get source fio failed: $(tail -n1 "$work/apt-source.log")" >&2; exit 3; }
        fio_source=$(ls "$work"/src/fio_*.orig.tar.* | head -n1)
    fi
    mkdir -p "$work/fio"
    tar -xf "$fio_source" -C "$work/fio" --strip-components=1
    (cd "$work/fio" && ./configure --build-static --disable-rbd --disable-rados --disable-gfapi --disable-rdma \
        --disable-http --disable-numa --disable-pmem >"$work/configure.log" 2>&1 && make -j"$(nproc)" fio \
        >"$work/make.log" 2>&1) || { echo "gpu_bundle: building fio from $(basename "$fio_source") failed (see" \
        "the end of its log):" >&2; tail -n 15 "$work/make.log" "$work/configure.log" 2>/dev/null >&2; exit 1; }
    mkdir -p "$out/bin"
    install -m 0755 "$work/fio/fio" "$out/bin/fio"
    strip "$out/bin/fio" 2>/dev/null || true
    if ldd "$out/bin/fio" >/dev/null 2>&1; then
        echo "gpu_bundle: $out/bin/fio is linked dynamically; a static build is needed (is libc.a there? apt-get install libc6-dev)" >&2
        exit 1
    fi
    "$out/bin/fio" --enghelp 2>/dev/null | grep -q io_uring \
        || { echo "gpu_bundle: $out/bin/fio has no io_uring engine" >&2; exit 1; }
    manifest+=("bin/fio: $("$out/bin/fio" --version), static, from $(basename "$fio_source"), io_uring engine")
fi

{ echo "gpu bundle made $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -srm)"; printf '%s\n' "${manifest[@]}"; } >"$out/MANIFEST.txt"
cat "$out/MANIFEST.txt"
echo "carry $out to the GPU machine, then: scripts/gpu_check.sh RESULTS --bundle $out"
