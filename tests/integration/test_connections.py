"""Connection limits: past max_connections a connection is answered 503 too_many_connections and
closed, the file descriptor limit is met with an answer, a count and a log line instead of silent
resets, idle keep-alive connections close after idle_timeout_ms and free their slots."""

import contextlib
import os
import select
import stat
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Daemon, check, check_eq, expect_error  # noqa: E402


@contextlib.contextmanager
def nofile_limit(n):
    """Daemons started inside run under prlimit with RLIMIT_NOFILE n (soft and hard)."""
    real = h.DAEMON
    fd, path = tempfile.mkstemp(prefix="dsv4d-prlimit-", suffix=".sh")
    with os.fdopen(fd, "w") as f:
        f.write('#!/bin/sh\nexec prlimit --nofile=%d:%d "%s" "$@"\n' % (n, n, real))
    os.chmod(path, stat.S_IRWXU)
    h.DAEMON = path
    try:
        yield
    finally:
        h.DAEMON = real
        os.unlink(path)


def metrics_on(sock):
    """/metrics through an open keep-alive connection (a new one might be refused)."""
    sock.sendall(h.raw_request("GET", "/metrics"))
    r, rest = h.read_response(sock)
    check_eq(r.status, 200, "GET /metrics")
    check_eq(rest, b"", "bytes after the metrics answer")
    return h.parse_metrics(r.body.decode("utf-8"))


def refusal_lines(d, reason, count=1, timeout=5.0):
    """The "refusing connections" lines for reason, once there are count of them (or timeout)."""
    return d.wait_lines(lambda ln: '"refusing connections"' in ln and '"%s"' % reason in ln,
                        count, timeout)


def expect_refused(s, what, reason_text):
    """The connection is answered 503 too_many_connections at once, without a request, and closed."""
    r, rest = h.read_response(s, timeout=5.0)
    e = expect_error(r, 503, "too_many_connections")
    check(reason_text in e["message"], "%s: message %r" % (what, e["message"]))
    check_eq(r.headers.get("connection"), "close", "%s: Connection" % what)
    check_eq(r.headers.get("retry-after"), "1", "%s: Retry-After" % what)
    closed, got = h.wait_closed(s, 3.0)
    check(closed and rest + got == b"", "%s: not closed after the 503 (got %r)" % (what, rest + got))


def served_healthz(s, what):
    s.sendall(h.raw_request("GET", "/healthz"))
    r, _ = h.read_response(s, timeout=5.0)
    check_eq(r.status, 200, "%s: /healthz" % what)


def test_max_connections():
    """max_connections 4: four keep-alive connections are served, three more are refused with 503
    too_many_connections (counted, one log line); once idle past idle_timeout_ms the four close and
    a new connection is served."""
    with Daemon(h.SMALL + ["--max-connections", "4", "--idle-timeout-ms", "2000"]) as d:
        time.sleep(0.2)  # the start-up check's connection has gone
        served = [h.connect(d) for _ in range(4)]
        for i, s in enumerate(served):
            served_healthz(s, "connection %d" % i)
        for i in range(3):
            s = h.connect(d)
            expect_refused(s, "connection %d past the limit" % (i + 4), "at most 4 connections")
            s.close()
        ms = metrics_on(served[0])
        check_eq(h.metric(ms, "dsv4d_connections_rejected_total", reason="max_connections"), 3,
                 "refusals counted")
        check_eq(h.metric(ms, "dsv4d_connections_rejected_total", reason="fd_limit"), 0,
                 "no fd_limit refusal")
        # The refused connections go once the daemon reads their EOF.
        t0 = time.monotonic()
        while h.metric(ms, "dsv4d_connections") != 4 and time.monotonic() - t0 < 1.5:
            time.sleep(0.05)
            ms = metrics_on(served[0])
        check_eq(h.metric(ms, "dsv4d_connections"), 4, "dsv4d_connections")
        check_eq(len(refusal_lines(d, "max_connections")), 1, "refusal log lines (one episode)")
        for i, s in enumerate(served):
            closed, got = h.wait_closed(s, 5.0)
            check(closed and got == b"", "connection %d not closed when idle (got %r)" % (i, got))
            s.close()
        check_eq(d.get("/healthz").status, 200, "a new connection once the idle ones closed")
        print("3 refused past 4; idle connections closed; a new one served")


# A device backend's runtime holds descriptors of its own (the CUDA runtime about 45, PoCL some):
# the descriptor limits below leave the daemon the same room on every backend.
DEVICE_FDS = 0 if h.BACKEND in (None, "cpu") else 64


def test_fd_limit_refused_with_log_and_count():
    """Under RLIMIT_NOFILE 24 (prlimit) with max_connections far above it, the connections that
    find no descriptor left are each answered 503 too_many_connections, counted as fd_limit and
    logged once; none is reset in silence, and the connections that were taken are served."""
    with nofile_limit(24 + DEVICE_FDS), Daemon(h.SMALL + ["--max-connections", "1000"]) as d:
        check(any('"max_connections is above what RLIMIT_NOFILE leaves' in ln for ln in d.lines),
              "no warning that max_connections exceeds the descriptor budget")
        time.sleep(0.2)
        socks = [h.connect(d) for _ in range(30 + DEVICE_FDS)]
        time.sleep(0.5)
        refused, served = [], []
        for s in socks:
            r, _, _ = select.select([s], [], [], 0)
            (refused if r else served).append(s)
        for i, s in enumerate(refused):
            expect_refused(s, "refused connection %d" % i, "no file descriptor")
            s.close()
        for i, s in enumerate(served):
            served_healthz(s, "served connection %d" % i)
        check(len(refused) > 0 and len(served) > 0,
              "%d refused, %d served of %d under RLIMIT_NOFILE %d" %
              (len(refused), len(served), 30 + DEVICE_FDS, 24 + DEVICE_FDS))
        ms = metrics_on(served[0])
        check_eq(h.metric(ms, "dsv4d_connections_rejected_total", reason="fd_limit"),
                 len(refused), "fd_limit refusals counted")
        check_eq(len(refusal_lines(d, "fd_limit")), 1, "refusal log lines (one episode)")
        for s in served:
            s.close()
        print("%d served, %d refused at the descriptor limit" % (len(served), len(refused)))


def test_default_max_connections_from_rlimit():
    """Without max_connections the limit is the soft RLIMIT_NOFILE less its reserve (64 -> 32):
    the connections past it are refused with 503 max_connections, not by running out of
    descriptors."""
    limit = 64 if not DEVICE_FDS else 256
    want = limit // 2 if limit < 128 else limit - 64
    with nofile_limit(limit), Daemon(h.SMALL) as d:
        time.sleep(0.2)
        socks = [h.connect(d) for _ in range(want + 8)]
        time.sleep(0.5)
        refused, served = [], []
        for s in socks:
            r, _, _ = select.select([s], [], [], 0)
            (refused if r else served).append(s)
        for i, s in enumerate(refused):
            expect_refused(s, "refused connection %d" % i, "at most %d connections" % want)
            s.close()
        check_eq(len(served), want, "connections served under RLIMIT_NOFILE %d" % limit)
        for i, s in enumerate(served):
            served_healthz(s, "served connection %d" % i)
        ms = metrics_on(served[0])
        check_eq(h.metric(ms, "dsv4d_connections_rejected_total", reason="max_connections"), 8,
                 "max_connections refusals")
        check_eq(h.metric(ms, "dsv4d_connections_rejected_total", reason="fd_limit"), 0,
                 "fd_limit refusals")
        for s in served:
            s.close()


if __name__ == "__main__":
    h.main([test_max_connections, test_fd_limit_refused_with_log_and_count,
            test_default_max_connections_from_rlimit])
