#!/bin/bash
# The daemon end to end on a CUDA machine, in one command:
#   1. unpacks the Debian packages of the server's dependencies (.debs: libuv, jansson, xxhash,
#      cmocka, node-llhttp) into .devroot, never into /;
#   2. builds dsv4d and the CUDA tests against them, for the local GPU's architecture;
#   3. runs the CUDA backend's host-glue test and the engine tests on backend cuda (every byte of
#      q_out, slots, digests and the cache against the CPU backend);
#   4. runs the integration suite with every daemon on backend = cuda (DSV4_TEST_BACKEND=cuda);
#   5. prints where a forward batch's time goes on cpu and cuda (tests/gpu/forward_stages.py).
# Logs go to $OUT when it is set, else into the build directory. Exit status 0 only if all passed.
# Usage: tests/gpu/run_daemon_suite.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
root=$PWD/.devroot
out=${OUT:-$build}
mkdir -p "$root" "$out"
t0=$(date +%s)
for f in .debs/*.deb; do
  # dpkg where there is one; else the data member of the ar archive (all of ours are .tar.xz).
  if command -v dpkg >/dev/null; then dpkg -x "$f" "$root"; else ar p "$f" data.tar.xz | tar -xJ -C "$root"; fi
done
lib=$(dirname "$(find "$root/usr/lib" -name 'libuv.so.1' | head -n 1)")
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The harness calls XXH3 here through ctypes if the interpreter has no xxhash module.
export DSV4_XXHASH_LIB="$lib/libxxhash.so.0"
py=
for p in /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -x "$p" ] && "$p" -c 'import numpy' 2>/dev/null; then py=$p; break; fi
done
[ -n "$py" ] || { echo "no python3 with numpy"; exit 1; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || true
  "$py" -c 'import sys, numpy; print("python", sys.version.split()[0], "numpy", numpy.__version__)'
  "$py" -c 'import xxhash' 2>/dev/null && echo "xxhash module" || echo "xxhash through ctypes"
  # Only when this directory is a checkout of its own (not an exported tree inside another).
  if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$PWD" ]; then
    git log --oneline -1
    git status --short --untracked-files=no | sed 's/^/uncommitted: /'
  fi
} | tee "$out/machine.txt"
cap=$( (nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true) |
  head -n 1 | tr -d '.')
arch=${DSV4_CUDA_ARCH:-${cap:-90}}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_BENCH=OFF -DDSV4_LEVEL_ZERO=OFF \
  -DCMAKE_PREFIX_PATH="$root/usr" -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DLLHTTP_INCLUDE_DIR="$root/usr/share/include/llhttp" -DLLHTTP_SRC_DIR="$root/usr/share/llhttp" \
  -DDSV4_IT_PYTHON="$py" >"$out/configure.log" 2>&1 || { tail -n 40 "$out/configure.log"; exit 1; }
# Only what the runs below use (the kernel tests of tests/gpu run on their own), dsv4ctl for the
# integration test that drives it, the client library and its C example for those of the shared
# region, and the test daemon whose executor waits before each answer (it_slow_back_test_direct).
targets="dsv4d engine_test engine_bounds_test cuda_backend_test"
# (The list is read whole first: grep -q would stop reading early, and pipefail would count cmake's
# broken pipe as the test failing.)
help=$(cmake --build "$build" --target help 2>/dev/null || true)
for t in dsv4ctl dsv4client dsv4client_example dsv4d_slow_back; do
  if grep -q "$t\$" <<<"$help"; then
    targets="$targets $t"
  fi
done
# shellcheck disable=SC2086 # one word per target
cmake --build "$build" -j"$(nproc)" --target $targets >"$out/build.log" 2>&1 ||
  { grep -E -B2 -A6 "error|Error" "$out/build.log" | head -n 80; exit 1; }
echo "unpack + configure + build: $(($(date +%s) - t0)) s"
rc=0
ctest --test-dir "$build" --output-on-failure \
  -R '^(cuda_backend_test|engine_test_cuda|engine_bounds_test_cuda)$' 2>&1 |
  tee "$out/ctest-engine.log" || rc=1
# A CUDA context takes longer than the CPU backend's 1 s start-up budget of test_lifecycle.
DSV4_TEST_BACKEND=cuda DSV4_IT_STARTUP_LIMIT=${DSV4_IT_STARTUP_LIMIT:-5} PYTHONUNBUFFERED=1 \
  ctest --test-dir "$build" --output-on-failure -L integration -LE staged -j8 2>&1 |
  tee "$out/ctest-integration.log" || rc=1
# Where a batch's time goes on each backend (a table; it fails only on a wrong answer).
PYTHONUNBUFFERED=1 "$py" tests/gpu/forward_stages.py "$build/dsv4d" tests/reference/dsv4_ref.py \
  cpu cuda 2>&1 | tee "$out/forward-stages.txt" || rc=1
echo "total: $(($(date +%s) - t0)) s, status $rc"
exit $rc
