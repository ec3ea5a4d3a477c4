#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU and no network (e.g. the H200 lent
# through the device tool):
#   here:   bash benchmarks/device_pack.sh              (writes .devcarry/, ~8 MiB)
#   there:  bash benchmarks/device_check.sh             (carry .devcarry; ~10 min budget)
# Builds the patched llama.cpp with CUDA (CUDA_ARCHS, default 90) in build/cuda, then runs
# benchmarks/device_check.py: scores and compaction on the GPU against the CPU, and their
# cost at 8k/32k tokens against a device copy of the bytes moved. Prints a table last;
# results also go to $OUT (or build/cuda) as device_check.json.
# DEVICE_CHECK_CPU=1 rehearses the whole script on a machine without a GPU (CPU build);
# DEVICE_CHECK_SANITIZE=1 also runs the correctness part under compute-sanitizer memcheck.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.devcarry
out=$(realpath -m "${OUT:-build/cuda}"); mkdir -p "$out"
t0=$(date +%s)
[ -f "$D/llama.cpp.tar.gz" ] || { echo "device_check: run benchmarks/device_pack.sh first (no $D/)" >&2; exit 2; }
[ "${DEVICE_CHECK_CPU:-}" = 1 ] || command -v nvcc >/dev/null || { echo "device_check: no nvcc on PATH" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# Python packages the machine lacks, and our package, into a folder of their own (a venv
# would not see the packages of the machine's own Python environment)
site=/tmp/ekv-site; rm -rf "$site"; mkdir -p "$site"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
if [ "${DEVICE_CHECK_CPU:-}" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --target "$site" "$D"/wheels/*.whl
fi
rm -rf /tmp/ekv-src; mkdir -p /tmp/ekv-src && tar xzf "$D/llama.cpp.tar.gz" -C /tmp/ekv-src
export ENTROKV_LLAMA_CPP_SOURCE=/tmp/ekv-src/llama.cpp
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)

if [ "${DEVICE_CHECK_CPU:-}" = 1 ]; then
    # a rehearsal of this script on a machine without a GPU: CPU build, graph path forced
    cmake_args="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"; bdir=build/devcheck-cpu; set -- --dry-run "$@"
else
    # cuBLAS: the toolkit's, else the nvidia-cublas wheel's
    cuda_root=$(dirname "$(dirname "$(command -v nvcc)")")
    if ! ls "$cuda_root"/lib64/libcublas.so* "$cuda_root"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
        export ENTROKV_CUBLAS_ROOT=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))")
        echo "device_check: cuBLAS from $ENTROKV_CUBLAS_ROOT"
    fi
    cmake_args="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90}"
    bdir=build/cuda
fi
CMAKE_ARGS="$cmake_args" python3 -m pip install --no-build-isolation --no-deps --target "$site" \
    -C build-dir="$bdir" . > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; echo "device_check: the build failed (log: $out/build.log)" >&2; exit 1; }
echo "device_check: build took $(( $(date +%s) - t0 )) s"

cd /tmp   # import the installed package, not the source tree's copy without libraries
if [ "${DEVICE_CHECK_SANITIZE:-}" = 1 ] && command -v compute-sanitizer >/dev/null; then
    # the correctness part once more under memcheck: out-of-bounds reads/writes of the
    # observation nodes or of the compaction graph show up here, not as wrong numbers
    compute-sanitizer --tool memcheck --error-exitcode 3 python3 "$OLDPWD/benchmarks/device_check.py" \
        --correctness-only "$@" > "$out/memcheck.log" 2>&1 && echo "device_check: memcheck clean" \
        || { tail -30 "$out/memcheck.log"; echo "device_check: memcheck reported errors (log: $out/memcheck.log)"; }
fi
PYTHONUNBUFFERED=1 python3 "$OLDPWD/benchmarks/device_check.py" --json "$out/device_check.json" "$@"
echo "device_check: $(( $(date +%s) - t0 )) s in all"
