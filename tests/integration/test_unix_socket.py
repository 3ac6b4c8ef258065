"""The data plane on a Unix domain socket (listen_unix): the same routes, answers, token and limits as
the TCP listener; the socket file's mode, its removal at exit, and the start-up refusals."""

import http.client
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix domain socket: only connect() differs."""

    def __init__(self, path, timeout=30.0):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


def unix_listening(d):
    """The "listening" lines the daemon logged for its Unix socket (waiting for the first)."""
    lines = d.wait_lines(lambda ln: '"listening"' in ln and '"unix"' in ln)
    return [j for j in h.log_records("\n".join(lines))
            if j.get("msg") == "listening" and j.get("listener") == "unix"]


def start_refused(args, name, what):
    """A daemon that must refuse to start: its exit status and its error lines."""
    d0 = Daemon(h.SMALL + args, name=name)
    try:
        try:
            d0.start()
            started = True
        except h.TestFailure:
            started = False
        check(not started, "the daemon started with %s" % what)
        rc = d0.wait(10)
        d0.check_log_clean()
        errors = [j for j in h.log_records("\n".join(d0.lines)) if j.get("level") == "error"]
        return rc, errors
    finally:
        d0.kill()


def test_unix_same_answers():
    """A forward batch over the socket answers as the same batch over TCP on another sequence; the
    public routes answer there too; the file is 0660 and gone after SIGTERM."""
    rng = np.random.default_rng(71)
    work = tempfile.mkdtemp(prefix="dsv4d-it-unix-")
    path = os.path.join(work, "d.sock")
    try:
        with Daemon(h.SMALL + ["--listen-unix", path]) as d:
            lines = unix_listening(d)
            check_eq(len(lines), 1, "one unix listening line")
            check_eq(lines[0].get("path"), path, "the path in the listening line")
            st = os.lstat(path)
            check(stat.S_ISSOCK(st.st_mode), "%s is not a socket" % path)
            check_eq(stat.S_IMODE(st.st_mode), 0o660, "the socket file's mode")
            for route in ("/healthz", "/readyz", "/metrics"):
                r = d.get(route, conn=UnixHTTPConnection(path))
                check_eq(r.status, 200, "GET %s over the Unix socket" % route)
                check_eq(r.headers.get("dsv4d-instance"), d.instance, "instance over unix")
            hz_unix = d.get("/healthz", conn=UnixHTTPConnection(path)).json()
            hz_tcp = d.get("/healthz").json()
            check_eq(sorted(hz_unix), sorted(hz_tcp), "the /healthz keys over both listeners")
            b = Batch.random(rng, 0, [Seg("u", 0, 5, True)], HEADS)
            t = Batch(b.layer, [Seg("t", 0, 5, True)], b.q.copy(), b.kv.copy(), b.outputs)
            c = UnixHTTPConnection(path)
            ru = d.forward(b, conn=c)
            ru2 = d.forward(Batch.random(rng, 0, [Seg("u", 5, 2)], HEADS), conn=c)  # keep-alive
            c.close()
            rt = d.forward(t)
            h.check_result(ru, b, "the batch over the Unix socket", bs=64)
            h.check_result(rt, t, "the batch over TCP", bs=64)
            check(ru.q_out.tobytes() == rt.q_out.tobytes(), "q_out differs between the listeners")
            check_eq(ru.tensors, rt.tensors, "the answer's tensors over both listeners")
            check_eq(ru.cache_digest, rt.cache_digest, "cache_digest over both listeners")
            check(not ru2.replayed, "the second batch on one Unix connection was a replay")
            check_eq(d.seq("u")["next"]["0"], 7, "the sequence served over the socket")
            bad_u = d.forward_raw(b"bad", conn=UnixHTTPConnection(path))
            bad_t = d.forward_raw(b"bad")
            check_eq(bad_u.status, 400, "a malformed batch over unix")
            check_eq(bad_u.json(), bad_t.json(), "the error answer over both listeners")
            ms = h.parse_metrics(d.get("/metrics", conn=UnixHTTPConnection(path)).body.decode())
            check(h.metric(ms, "dsv4d_requests_total", route="forward", code="200") >= 3,
                  "forward answers over unix counted in dsv4d_requests_total")
        check(not os.path.exists(path), "%s is still there after SIGTERM" % path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_unix_bearer_token():
    rng = np.random.default_rng(72)
    work = tempfile.mkdtemp(prefix="dsv4d-it-unix-")
    path = os.path.join(work, "d.sock")
    tok = h.write_token_file(work, "s3cret-token", 0o600, "api.token")
    try:
        with Daemon(h.SMALL + ["--listen-unix", path, "--api-token-file", tok]) as d:
            b = Batch.random(rng, 0, [Seg("a", 0, 2, True)], HEADS)
            for hdr in ({}, {"Authorization": "Bearer wrong"}):
                expect_error(d.forward_raw(b.body(), headers=hdr, conn=UnixHTTPConnection(path)),
                             401, "unauthorized")
            check_eq(d.get("/healthz", conn=UnixHTTPConnection(path)).status, 200,
                     "/healthz over unix without a token")
            ok = {"Authorization": "Bearer s3cret-token"}
            h.check_result(d.forward(b, headers=ok, conn=UnixHTTPConnection(path)), b,
                           "with a token over unix", bs=64)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_unix_max_connections():
    """Unix connections count toward max_connections with the TCP ones."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-unix-")
    path = os.path.join(work, "d.sock")
    try:
        with Daemon(h.SMALL + ["--listen-unix", path, "--max-connections", "2"]) as d:
            time.sleep(0.2)  # the start-up check's connection has gone
            held = [h.connect(d)]
            held[0].sendall(h.raw_request("GET", "/healthz"))
            r, _ = h.read_response(held[0])
            check_eq(r.status, 200, "a TCP connection within the limit")
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.settimeout(10)
            u.connect(path)
            u.sendall(h.raw_request("GET", "/healthz"))
            r, _ = h.read_response(u)
            check_eq(r.status, 200, "a Unix connection within the limit")
            held.append(u)
            extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            extra.settimeout(10)
            extra.connect(path)
            r, _ = h.read_response(extra)
            expect_error(r, 503, "too_many_connections")
            extra.close()
            extra = h.connect(d)  # and a TCP one past a limit the Unix connection helped reach
            r, _ = h.read_response(extra)
            expect_error(r, 503, "too_many_connections")
            extra.close()
            for s in held:
                s.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_unix_stale_and_bad_paths():
    """A stale socket file is replaced; a live one, a missing directory or a file that is not a
    socket stops the start-up with one error line naming the path, and the file is left alone."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-unix-")
    try:
        stale = os.path.join(work, "stale.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(stale)
        s.close()  # the file stays, nothing listens: what a killed daemon leaves
        with Daemon(h.SMALL + ["--listen-unix", stale], name="stale") as d:
            check_eq(d.get("/healthz", conn=UnixHTTPConnection(stale)).status, 200,
                     "/healthz over a socket that replaced a stale file")
            # A socket a running daemon listens on is not stale: a second daemon is refused.
            rc, errors = start_refused(["--listen-unix", stale], "second", "a live socket")
            check_eq(rc, 1, "exit status with a live socket's path")
            named = [j for j in errors if j.get("path") == stale]
            check_eq(len(named), 1, "one error line names %s: %r" % (stale, errors))
            check("another process listens" in named[0].get("error", ""),
                  "the refusal says why: %r" % named[0])
            check_eq(d.get("/healthz", conn=UnixHTTPConnection(stale)).status, 200,
                     "the first daemon's socket after the second one's refusal")
        check(not os.path.exists(stale), "the replaced socket is still there after SIGTERM")
        missing = os.path.join(work, "no-such-dir", "d.sock")
        regular = os.path.join(work, "file")
        with open(regular, "w") as f:
            f.write("keep me\n")
        for p, what in ((missing, "directory does not exist"), (regular, "not a socket")):
            rc, errors = start_refused(["--listen-unix", p], "bad-unix", p)
            check_eq(rc, 1, "exit status with listen_unix %s" % p)
            named = [j for j in errors if j.get("path") == p]
            check_eq(len(named), 1, "one error line names %s: %r" % (p, errors))
            check(what in named[0].get("error", ""), "the refusal says why: %r" % named[0])
        with open(regular) as f:
            check_eq(f.read(), "keep me\n", "the regular file after the refusal")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_unix_sigterm_drains():
    """SIGTERM removes the file while the daemon drains: no new client reaches it."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-unix-")
    path = os.path.join(work, "d.sock")
    try:
        d = Daemon(h.SMALL + ["--listen-unix", path]).start()
        try:
            d.signal(signal.SIGTERM)
            check_eq(d.wait(10), 0, "exit status after SIGTERM")
            check(not os.path.exists(path), "%s is still there after exit" % path)
            d.check_log_clean()
        finally:
            d.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    h.main([test_unix_same_answers, test_unix_bearer_token, test_unix_max_connections,
            test_unix_stale_and_bad_paths, test_unix_sigterm_drains])
