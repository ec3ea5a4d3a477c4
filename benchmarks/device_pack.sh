#!/usr/bin/env bash
# Prepare .devcarry/ for benchmarks/device_check.sh, on a machine with PyPI access: the
# pristine llama.cpp parts of our pinned sdist (checked against the sha256 in
# cmake/LlamaSource.cmake) and wheels of the Python packages the GPU machine lacks
# (cffi, pycparser, gguf, diskcache, llama-cpp-python's bindings), for Python 3.12.
# About 8 MiB; nothing in it is committed (.gitignore).
set -euo pipefail
cd "$(dirname "$0")/.."
D=.devcarry
V=$(sed -n 's/^set(ENTROKV_LLAMA_PY_VERSION "\(.*\)")/\1/p' cmake/LlamaSource.cmake)
SHA=$(sed -n 's/^set(ENTROKV_LLAMA_SDIST_SHA256 "\(.*\)")/\1/p' cmake/LlamaSource.cmake)
sdist=${ENTROKV_LLAMA_CPP_SDIST:-${ENTROKV_CACHE_DIR:-$HOME/.cache/entrokv-edge}/sdist/llama_cpp_python-$V.tar.gz}
if [ ! -f "$sdist" ]; then
    python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$V" -d "$(dirname "$sdist")"
fi
echo "$SHA  $sdist" | sha256sum -c --quiet

rm -rf "$D"; mkdir -p "$D/wheels"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
src="llama_cpp_python-$V/vendor/llama.cpp"
tar xzf "$sdist" -C "$tmp" --wildcards $(for p in CMakeLists.txt cmake ggml include src vendor common licenses LICENSE; do echo "$src/$p"; done)
tar czf "$D/llama.cpp.tar.gz" -C "$tmp/llama_cpp_python-$V/vendor" llama.cpp

python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$D/wheels" cffi pycparser gguf diskcache
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" python3 -m pip wheel --quiet --no-deps "llama-cpp-python==$V" -w "$D/wheels"
du -sh "$D"
