#!/bin/bash
# A shorter GPU check than run_daemon_suite.sh, for a machine whose time is short: the same
# unpacked dependencies and build, but only the CUDA backend's byte-for-byte tests (host glue,
# engine, attention, the compressed branch) and the integration tests of the main paths on backend
# cuda. Logs go to $OUT when it is set, else into the build directory. Exit status 0 only if all
# passed.
# Usage: tests/gpu/run_quick.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-quick}
root=$PWD/.devroot
out=${OUT:-$build}
mkdir -p "$root" "$out"
t0=$(date +%s)
for f in .debs/*.deb; do
  if command -v dpkg >/dev/null; then dpkg -x "$f" "$root"; else ar p "$f" data.tar.xz | tar -xJ -C "$root"; fi
done
lib=$(dirname "$(find "$root/usr/lib" -name 'libuv.so.1' | head -n 1)")
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DSV4_XXHASH_LIB="$lib/libxxhash.so.0"
py=
for p in /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -x "$p" ] && "$p" -c 'import numpy' 2>/dev/null; then py=$p; break; fi
done
[ -n "$py" ] || { echo "no python3 with numpy"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | tee "$out/machine.txt" || true
cap=$( (nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true) |
  head -n 1 | tr -d '.')
arch=${DSV4_CUDA_ARCH:-${cap:-90}}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_BENCH=OFF -DDSV4_LEVEL_ZERO=OFF \
  -DCMAKE_PREFIX_PATH="$root/usr" -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DLLHTTP_INCLUDE_DIR="$root/usr/share/include/llhttp" -DLLHTTP_SRC_DIR="$root/usr/share/llhttp" \
  -DDSV4_IT_PYTHON="$py" >"$out/configure.log" 2>&1 || { tail -n 40 "$out/configure.log"; exit 1; }
help=$(cmake --build "$build" --target help 2>/dev/null || true)
targets="dsv4d engine_test cuda_backend_test"
for t in gpu_compress_test gpu_attn_test gpu_attn_fast_test gpu_attn_split_test gpu_attn_fused_test dsv4ctl dsv4client dsv4client_example; do
  if grep -q " $t\$" <<<"$help"; then targets="$targets $t"; fi
done
# shellcheck disable=SC2086 # one word per target
cmake --build "$build" -j"$(nproc)" --target $targets >"$out/build.log" 2>&1 ||
  { grep -E -B2 -A6 "error|Error" "$out/build.log" | head -n 80; exit 1; }
echo "unpack + configure + build: $(($(date +%s) - t0)) s"
rc=0
ctest --test-dir "$build" --output-on-failure \
  -R '^(cuda_backend_test|engine_test_cuda|gpu_compress_test|gpu_attn_test|gpu_attn_fast_test|gpu_attn_split_test|gpu_attn_fused_test)$' 2>&1 |
  tee "$out/ctest-kernels.log" || rc=1
DSV4_TEST_BACKEND=cuda DSV4_IT_STARTUP_LIMIT=${DSV4_IT_STARTUP_LIMIT:-5} PYTHONUNBUFFERED=1 \
  ctest --test-dir "$build" --output-on-failure -L integration -LE staged -j8 \
  -R 'it_test_(compressed|compressed_vs_model|attention|forward|weights|prefill_chunks|restore|shm|pinned_pool|admin_entries)$' \
  2>&1 | tee "$out/ctest-integration.log" || rc=1
echo "total: $(($(date +%s) - t0)) s, status $rc"
exit $rc
