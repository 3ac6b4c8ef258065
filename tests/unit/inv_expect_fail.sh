#!/bin/sh
# Runs a deliberately broken build of an ordering-invariant test (SPEC §5) and passes only when it
# fails the way the invariant's test fails: a non-zero exit status that is not a signal, the
# invariant's own message in the output, and no sanitizer report. A broken build that passes,
# crashes, or fails for another reason makes this wrapper fail, so every ctest run shows that the
# invariant's test can fail.
#
#   inv_expect_fail.sh <extended regular expression> <broken test binary> [args...]
if [ $# -lt 2 ]; then
  echo "usage: $0 <regex> <binary> [args...]" >&2
  exit 2
fi
expect=$1
shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
# 77: the test needs hardware this machine lacks (a GPU) and said "skipped"; ctest shows it so.
if [ "$rc" -eq 77 ]; then
  exit 77
fi
if [ "$rc" -eq 0 ]; then
  echo "FAIL: the broken build passed: its test did not catch the broken invariant" >&2
  exit 1
fi
if [ "$rc" -gt 128 ]; then
  echo "FAIL: the broken build died from signal $((rc - 128)) instead of failing its check" >&2
  exit 1
fi
if printf '%s\n' "$out" | grep -Eq 'Sanitizer|runtime error:'; then
  echo "FAIL: the broken build stopped on a sanitizer report, not on the invariant check" >&2
  exit 1
fi
caught=$(printf '%s\n' "$out" | grep -E -m 1 -e "$expect")
if [ -z "$caught" ]; then
  echo "FAIL: the broken build failed (exit $rc) without a line matching /$expect/" >&2
  exit 1
fi
echo "caught (exit $rc): $caught"
exit 0
