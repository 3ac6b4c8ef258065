#!/bin/sh
# Builds dsv4d and runs the whole test suite: unit, invariants, reference and integration tests in a
# normal build, the same suite again under AddressSanitizer + UndefinedBehaviorSanitizer
# (DSV4_ASAN=0 skips it), then a short libFuzzer run of each fuzzer in a clang build (DSV4_FUZZ=0
# skips it). DSV4_TSAN=1 adds the suite under ThreadSanitizer (about five minutes on two cores).
# Usage: tests/run.sh [build-dir] [extra cmake args...]
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
[ $# -gt 0 ] && shift
# Warnings are errors here (a developer's and CI's build), not in a user's plain cmake build.
set -- -DDSV4_WERROR=ON "$@"
jobs=$(nproc)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build "$build" -j"$jobs"
ctest --test-dir "$build" --output-on-failure -j"$jobs"

if [ "${DSV4_ASAN:-1}" != 0 ]; then
  asan="$build-asan"
  # The CUDA kernels build (and their GPU tests run or skip) in the normal tree only: nvcc does
  # not take the sanitizer flags, and a second fat binary would double the CUDA build time.
  cmake -S . -B "$asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_BENCH=OFF -DDSV4_CUDA=OFF \
    -DDSV4_SANITIZE=address,undefined "$@"
  cmake --build "$asan" -j"$jobs"
  ctest --test-dir "$asan" --output-on-failure -j"$jobs"
fi

if [ "${DSV4_TSAN:-0}" != 0 ]; then
  tsan="$build-tsan"
  cmake -S . -B "$tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_BENCH=OFF -DDSV4_CUDA=OFF \
    -DDSV4_LEVEL_ZERO=OFF -DDSV4_SANITIZE=thread "$@"
  cmake --build "$tsan" -j"$jobs"
  # The deliberately broken builds are left out: ThreadSanitizer stops some of them with its own
  # report (a race is what they contain) before they can print the invariant's message.
  ctest --test-dir "$tsan" --output-on-failure -j"$jobs" -E _broken_
fi

if [ "${DSV4_FUZZ:-1}" != 0 ] && command -v clang >/dev/null 2>&1; then
  fuzz="$build-fuzz"
  CC=clang cmake -S . -B "$fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_BENCH=OFF -DDSV4_CUDA=OFF \
    "$@"
  cmake --build "$fuzz" -j"$jobs" --target fuzz_safetensors fuzz_http fuzz_config fuzz_forward \
    fuzz_admin_query fuzz_dsv4ctl fuzz_restore fuzz_shm_msg
  ctest --test-dir "$fuzz" --output-on-failure -L fuzz
fi
