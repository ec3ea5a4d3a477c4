#!/usr/bin/env bash
# The native code under AddressSanitizer + UndefinedBehaviorSanitizer: builds libllama, ggml and
# native/src with -DENTROKV_SANITIZE=ON into build/asan (its own build dir) and .venv-asan, then
# runs the native, C API, compaction, refusal, scoring, selector, session, thread, soak and fuzz
# tests with the sanitizer runtimes preloaded (Python itself is not instrumented). Any report
# ends the test process with an error, so the run fails; reports are also kept in
# build/asan/reports/. Before the tests, a deliberate heap overflow (benchmarks/sanitize_check.py)
# must be reported, or the run fails. Suppressions (none today): benchmarks/sanitize.supp.
#
#   benchmarks/sanitize.sh               # build (incremental) and the default tests
#   benchmarks/sanitize.sh tests/test_fuzz.py -k selector      # other pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=.venv-asan

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
. "$venv/bin/activate"

start=$(date +%s)
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DENTROKV_SANITIZE=ON" \
    pip install --quiet -C build-dir=build/asan -e ".[test]"
echo "sanitize: build took $(( $(date +%s) - start )) s"

reports="$root/build/asan/reports"
rm -rf "$reports"
mkdir -p "$reports"
cxx=${CXX:-c++}
# Python is not instrumented: the runtimes must be loaded first, before the sanitized libllama
export LD_PRELOAD="$($cxx -print-file-name=libasan.so) $($cxx -print-file-name=libubsan.so)"
# leaks: Python keeps much of what it allocates until exit, by design; no leak checking
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$reports/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$root/benchmarks/sanitize.supp:log_path=$reports/ubsan"

# the library this venv loads must be the sanitized one
lib=$(python -c "import entrokv_edge._paths as p; print(p.lib_dir() / p.LIBLLAMA)")
if ! readelf -d "$lib" | grep -q "NEEDED.*libasan"; then
    echo "sanitize: $lib is not built with AddressSanitizer" >&2
    exit 1
fi

# the run is only worth something if a bad write is reported: a deliberate one first
if (python benchmarks/sanitize_check.py) > /dev/null 2>&1 || ! grep -qs heap-buffer-overflow "$reports"/asan.*; then
    echo "sanitize: a deliberate heap overflow went unreported: the sanitizers are not active" >&2
    exit 1
fi
rm -f "$reports"/*
echo "sanitize: a deliberate heap overflow is reported: the sanitizers are active"

if [ $# -eq 0 ]; then
    set -- tests/test_c_api.py tests/test_compaction.py tests/test_refusals.py tests/test_scoring.py \
        tests/test_policies.py tests/test_controller.py tests/test_values.py tests/test_sessions.py \
        tests/test_threads.py tests/test_soak.py tests/test_fuzz.py tests/test_rows.py tests/test_recall.py \
        -k "not real_models and not follow_up"
fi
start=$(date +%s)
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
echo "sanitize: tests took $(( $(date +%s) - start )) s"
if compgen -G "$reports/*" > /dev/null; then
    echo "sanitize: sanitizer reports:" >&2
    head -c 20000 "$reports"/* >&2
    exit 1
fi
exit $rc
