"""The Level Zero backend from the daemon's side. Without a Level Zero driver (zeInit fails, as on
the CI machines), backend = level_zero exits non-zero with one error line whose why is
"zeInit found no driver (ZE_RESULT_...)", and backend = auto starts on another backend and logs one
"backends skipped" line naming level_zero and that reason. With an Intel GPU and its driver
(DSV4_TEST_BACKEND=level_zero), backend = level_zero starts on it.

A build without the backend (DSV4_LEVEL_ZERO=OFF) answers backend = level_zero with
'unknown backend "level_zero"'; the test then checks that instead."""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Daemon, check, check_eq, log_records  # noqa: E402

DEVICE = h.BACKEND == "level_zero"
SMALL = ["--kv-blocks", "8", "--layers", "0-0", "--heads", "2"]


def run_level_zero():
    """Runs the daemon with backend = level_zero until it exits; returns (status, log records)."""
    try:
        r = subprocess.run([h.DAEMON, "--port", "0", "--admin-port", "0", "--backend", "level_zero"]
                           + SMALL, stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        raise h.TestFailure("backend = level_zero without a driver kept running (no exit in 20 s)")
    return r.returncode, log_records((r.stdout + r.stderr).decode("utf-8", "replace"))


def built_with_level_zero():
    status, recs = run_level_zero()
    errors = [j for j in recs if j.get("level") == "error"]
    return not any('unknown backend "level_zero"' in j.get("why", "") for j in errors)


def test_backend_level_zero():
    if DEVICE:
        with Daemon(SMALL + ["--backend", "level_zero"], name="level_zero") as d:
            check_eq(d.get("/readyz").status, 200, "readyz on the level_zero backend")
            started = [j for j in log_records("\n".join(d.lines)) if j.get("msg") == "started"]
            check_eq([j.get("backend") for j in started], ["level_zero"], "the started line")
        return
    status, recs = run_level_zero()
    check(status != 0, "backend = level_zero without a driver: exit status 0")
    errors = [j for j in recs if j.get("level") == "error"]
    check_eq(len(errors), 1, "error lines when backend = level_zero has no driver (%r)" % recs)
    check_eq(errors[0].get("backend"), "level_zero", "the error line names the backend asked for")
    why = errors[0].get("why", "")
    if 'unknown backend "level_zero"' in why:
        print("this build has no level_zero backend: %s" % why)
        return
    check(why.startswith("zeInit found no driver (ZE_RESULT_") and why.endswith(")"),
          "the error line's why: %r" % why)
    check(not any(j.get("msg") == "started" for j in recs), "a started line although it failed")


def test_backend_auto_skips_level_zero():
    if DEVICE:
        return
    with_lz = built_with_level_zero()
    with Daemon(SMALL + ["--backend", "auto"], name="auto") as d:
        check_eq(d.get("/readyz").status, 200, "readyz on backend = auto")
        recs = log_records("\n".join(d.lines))
        started = [j for j in recs if j.get("msg") == "started"]
        skipped = [j for j in recs if j.get("msg") == "backends skipped"]
        check_eq(len(started), 1, "started lines")
        check(started[0].get("backend") != "level_zero", "auto started on level_zero without one")
        if not with_lz:
            check(not any("level_zero" in j.get("why", "") for j in skipped),
                  "a build without level_zero names it as skipped: %r" % skipped)
            return
        if started[0].get("backend") == "cuda":
            return  # a CUDA device comes first; level_zero was not tried
        check_eq(len(skipped), 1, "one 'backends skipped' line: %r" % skipped)
        check_eq(skipped[0].get("using"), started[0].get("backend"), "the backend used")
        check("level_zero: zeInit found no driver (ZE_RESULT_" in skipped[0].get("why", ""),
              "the skipped line names level_zero and why: %r" % skipped[0])


if __name__ == "__main__":
    h.main([test_backend_level_zero, test_backend_auto_skips_level_zero])
