#!/bin/sh
# Builds dsv4d and runs the whole test suite (unit, reference, integration).
# Usage: tests/run.sh [build-dir] [extra cmake args...]
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
[ $# -gt 0 ] && shift
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"
