"""Choosing the backend: backend = cuda without a CUDA device exits non-zero with one clear line;
backend = auto without one starts on the CPU and logs one line naming why CUDA was skipped; with a
device, both run on it.

Whether this build has the CUDA backend comes from DSV4_TEST_BUILD_CUDA (set by CMake); whether a
device is present, from DSV4_TEST_BACKEND=cuda (a run on a GPU machine) or /dev/nvidiactl."""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Daemon, check, check_eq, log_records  # noqa: E402

BUILD_CUDA = os.environ.get("DSV4_TEST_BUILD_CUDA", "0") not in ("", "0", "OFF", "FALSE", "false")
DEVICE = h.BACKEND == "cuda" or os.path.exists("/dev/nvidiactl")
SMALL = ["--kv-blocks", "8", "--layers", "0-0", "--heads", "2"]


def test_backend_cuda():
    if BUILD_CUDA and DEVICE:
        with Daemon(SMALL + ["--backend", "cuda"], name="cuda") as d:
            check_eq(d.get("/readyz").status, 200, "readyz on the cuda backend")
            started = [j for j in log_records("\n".join(d.lines)) if j.get("msg") == "started"]
            check_eq([j.get("backend") for j in started], ["cuda"], "backend in the started line")
        return
    try:
        r = subprocess.run([h.DAEMON, "--port", "0", "--admin-port", "0", "--backend", "cuda"] +
                           SMALL, stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        raise h.TestFailure("backend = cuda without a device kept running (no exit within 20 s)")
    out = (r.stdout + r.stderr).decode("utf-8", "replace")
    check(r.returncode != 0, "backend = cuda without a device: exit status 0 (%r)" % out[-400:])
    errors = [j for j in log_records(out) if j.get("level") == "error"]
    check_eq(len(errors), 1, "error lines when backend = cuda has no device (%r)" % out[-600:])
    why = errors[0].get("why", "")
    if BUILD_CUDA:
        check(why.startswith("no CUDA device (cudaGetDeviceCount: ") and why.endswith(")"),
              "the error line's why: %r" % why)
    else:
        check('unknown backend "cuda"' in why, "a build without CUDA says so: %r" % why)
    check_eq(errors[0].get("backend"), "cuda", "the error line names the backend asked for")


def test_backend_auto():
    with Daemon(SMALL + ["--backend", "auto"], name="auto") as d:
        check_eq(d.get("/readyz").status, 200, "readyz on backend = auto")
        recs = log_records("\n".join(d.lines))
        started = [j for j in recs if j.get("msg") == "started"]
        skipped = [j for j in recs if j.get("msg") == "backends skipped"]
        check_eq(len(started), 1, "started lines")
        if BUILD_CUDA and DEVICE:
            check_eq(started[0].get("backend"), "cuda", "backend = auto with a CUDA device")
            check(not any("cuda" in j.get("why", "") for j in skipped),
                  "CUDA named as skipped although it was used: %r" % skipped)
            return
        check_eq(started[0].get("backend"), "cpu", "backend = auto without a CUDA device")
        check(len(skipped) <= 1, "one skipped line at most: %r" % skipped)
        if BUILD_CUDA:
            check_eq(len(skipped), 1, "a skipped line when CUDA is built but has no device")
            check_eq(skipped[0].get("using"), "cpu", "the backend used, in the skipped line")
            why = skipped[0].get("why", "")
            check("cuda: no CUDA device (cudaGetDeviceCount: " in why,
                  "the skipped line names CUDA and why: %r" % why)
        else:
            check(not any("cuda" in j.get("why", "") for j in skipped),
                  "a build without CUDA names no CUDA backend: %r" % skipped)


if __name__ == "__main__":
    h.main([test_backend_cuda, test_backend_auto])
