#!/bin/bash
# The daemon's service benchmarks on two source trees, in turn, on one machine: the change's tree
# (this checkout) against an older one, so that both see the same machine's drift. For a device
# session whose time is short: one call builds both trees and runs every round.
#
#   tests/gpu/ab_daemon.sh OLD_SRC [backend]
#
# OLD_SRC: the older tree's sources (for instance `git archive <rev> | tar -x -C /tmp/old`);
# backend: cuda (default) or cpu. Per round, per tree: shm_bench (one token for each of T
# sequences, T in $TOKENS, $CALLS calls, no HTTP), then http_bench at N = 1 and 16 over TCP, then
# tests/gpu/forward_stages.py. The summary lines go to standard output, every log to $OUT
# (else ./ab-logs). Environment: ROUNDS (2), TOKENS ("1 16 64"), CALLS (3000), THREADS (the
# machine's cores), DAEMON_ARGS (added to every daemon's command line).
# The server's Debian packages in .debs/ are unpacked into .devroot/ (never into /), as
# run_quick.sh does; without .debs/ the system's are used.
set -euo pipefail
if [ $# -lt 1 ] || [ ! -d "$1" ]; then echo "usage: $0 OLD_SRC [cuda|cpu]" >&2; exit 2; fi
old_src=$(cd "$1" && pwd)
cd "$(dirname "$0")/../.."
backend=${2:-cuda}
rounds=${ROUNDS:-2}
tokens=${TOKENS:-1 16 64}
calls=${CALLS:-3000}
threads=${THREADS:-$(nproc)}
out=${OUT:-$PWD/ab-logs}
root=$PWD/.devroot
mkdir -p "$out"
prefix=()
if compgen -G ".debs/*.deb" >/dev/null; then
  mkdir -p "$root"
  for f in .debs/*.deb; do dpkg -x "$f" "$root"; done
  lib=$(dirname "$(find "$root/usr/lib" -name 'libuv.so.1' | head -n 1)")
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export DSV4_XXHASH_LIB="$lib/libxxhash.so.0"
  prefix=(-DCMAKE_PREFIX_PATH="$root/usr" -DLLHTTP_INCLUDE_DIR="$root/usr/share/include/llhttp"
    -DLLHTTP_SRC_DIR="$root/usr/share/llhttp")
fi
py=
for p in /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -x "$p" ] && "$p" -c 'import numpy' 2>/dev/null; then py=$p; break; fi
done
cuda=OFF
[ "$backend" = cuda ] && cuda=ON

# build NAME SRC: the daemon and the benchmarks of one tree into build-ab-NAME.
build() {
  local name=$1 src=$2 dir=$PWD/build-ab-$1
  # (an empty array under set -u: bash before 4.4 needs the ${a[@]+...} form)
  cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_BENCH=ON -DDSV4_CUDA=$cuda \
    -DDSV4_LEVEL_ZERO=OFF -DCMAKE_CUDA_ARCHITECTURES="${DSV4_CUDA_ARCH:-90}" \
    ${prefix[@]+"${prefix[@]}"} >"$out/configure-$name.log" 2>&1 || { tail -n 30 "$out/configure-$name.log"; exit 1; }
  cmake --build "$dir" -j"$(nproc)" --target dsv4d shm_bench http_bench bare_server \
    >"$out/build-$name.log" 2>&1 || { grep -E -A6 "error" "$out/build-$name.log" | head -n 40; exit 1; }
}

# run NAME ROUND: one tree's benchmarks; the summary lines to stdout.
run() {
  local name=$1 r=$2 dir=$PWD/build-ab-$1 t log
  # shellcheck disable=SC2206 # DAEMON_ARGS is a word list
  local daemon=("$dir/dsv4d" --backend "$backend" --port 0 --admin-port 0 --threads "$threads"
    --kv-blocks 512 --layers 0-3 ${DAEMON_ARGS:-})
  for t in $tokens; do
    log=$out/shm-$name-r$r-t$t.log
    "$dir/tests/bench/shm_bench" --tokens "$t" --cpu-threads "$threads" --calls "$calls" --no-http \
      -- "${daemon[@]}" >"$log" 2>&1 || { echo "$name: shm_bench T=$t failed (see $log)"; continue; }
    printf '%-4s round %d  T=%-3s %s\n' "$name" "$r" "$t" "$(grep -m1 '^shm:' "$log" | tr -s ' ')"
  done
  log=$out/http-$name-r$r.log
  "$dir/tests/bench/http_bench" --tokens 1,16 --cpu-threads "$threads" --seconds 1 --rounds 1 \
    --no-cpu -- "${daemon[@]}" >"$log" 2>&1 || echo "$name: http_bench failed (see $log)"
  grep -E '^ +(1|16) ' "$log" | sed "s/^/$name round $r http /" || true
  if [ -n "$py" ]; then
    log=$out/stages-$name-r$r.log
    DSV4_STAGES_DAEMON_ARGS="${DAEMON_ARGS:-}" "$py" tests/gpu/forward_stages.py "$dir/dsv4d" \
      tests/reference/dsv4_ref.py "$backend" >"$log" 2>&1 || echo "$name: forward_stages failed (see $log)"
    grep -E "^$backend " "$log" | sed "s/^/$name round $r stages /" || true
  fi
}

t0=$(date +%s)
build old "$old_src"
build new "$PWD"
echo "built both trees in $(($(date +%s) - t0)) s; backend $backend, $threads threads"
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then run old "$r"; run new "$r"; else run new "$r"; run old "$r"; fi
done
echo "total $(($(date +%s) - t0)) s; logs in $out"
