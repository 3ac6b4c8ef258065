"""HTTP behaviour: keep-alive, pipelining, limits checked before the body (413, 431), 411, client
disconnects mid-body, connection timeouts, folded headers and the bearer token."""

import os
import shutil
import socket
import struct
import sys
import select
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8


def fwd(body, headers=None):
    return h.raw_request("POST", "/v1/forward", body, headers)


def test_keep_alive():
    rng = np.random.default_rng(41)
    with Daemon(h.SMALL) as d:
        s = h.connect(d)
        buf = b""
        nxt = 0
        for i in range(12):
            b = Batch.random(rng, 0, [Seg("k", nxt, 3, nxt == 0)], HEADS)
            for req, want in ((h.raw_request("GET", "/healthz"), 200), (fwd(b.body()), 200),
                              (h.raw_request("GET", "/v1/sequences/k"), 200),
                              (fwd(b"bad"), 400), (h.raw_request("GET", "/metrics"), 200)):
                s.sendall(req)
                r, buf = h.read_response(s, buf)
                check_eq(r.status, want, "answer %d on one keep-alive connection" % i)
                check_eq(r.headers.get("dsv4d-instance"), d.instance, "instance")
                check(r.headers.get("connection", "").lower() != "close",
                      "the daemon asked to close a keep-alive connection after %d" % r.status)
                if req.startswith(b"POST") and r.status == 200:
                    h.check_result(h.ForwardResult(r, b), b, "keep-alive batch %d" % i, bs=64)
            nxt += 3
        s.close()
        check_eq(d.seq("k")["next"]["0"], 36, "next after 12 batches")


def test_pipelined_in_order():
    """Many requests written at once on one socket are answered in order, the sequence state showing
    that each was applied before the next was read."""
    rng = np.random.default_rng(42)
    with Daemon(h.SMALL) as d:
        b1 = Batch.random(rng, 0, [Seg("p", 0, 200, True)], HEADS)
        b2 = Batch.random(rng, 0, [Seg("p", 200, 2)], HEADS)
        b3 = Batch.random(rng, 1, [Seg("p", 0, 1)], HEADS)
        reqs = [
            (h.raw_request("GET", "/healthz"), 200, None),
            (fwd(b1.body()), 200, b1),
            (h.raw_request("GET", "/v1/sequences/p"), 200, {"0": 200, "1": 0, "2": 0, "3": 0}),
            (fwd(b"\x08\0\0\0\0\0\0\0{}      "), 400, None),
            (fwd(b2.body()), 200, b2),
            (fwd(b2.body()), 200, "replay"),
            (h.raw_request("GET", "/v1/sequences/p"), 200, {"0": 202, "1": 0, "2": 0, "3": 0}),
            (fwd(b3.body()), 200, b3),
            (h.raw_request("DELETE", "/v1/sequences/p"), 204, None),
            (h.raw_request("GET", "/v1/sequences/p"), 404, None),
            (h.raw_request("DELETE", "/v1/sequences/p"), 204, None),
            (h.raw_request("GET", "/readyz"), 200, None),
        ]
        s = h.connect(d)
        s.sendall(b"".join(r for r, _, _ in reqs))
        buf = b""
        for i, (req, want, extra) in enumerate(reqs):
            r, buf = h.read_response(s, buf, timeout=20)
            check_eq(r.status, want, "pipelined answer %d (%s)" % (i, req[:40]))
            check_eq(r.headers.get("dsv4d-instance"), d.instance, "instance")
            if isinstance(extra, Batch):
                h.check_result(h.ForwardResult(r, extra), extra, "pipelined batch %d" % i, bs=64)
            elif extra == "replay":
                check_eq(h.ForwardResult(r, b2).replayed, "true", "pipelined replay")
            elif isinstance(extra, dict):
                check_eq(r.json()["next"], extra, "pipelined GET %d" % i)
            if i == 8:
                check_eq(r.headers.get("dsv4d-existed"), "1", "first DELETE")
            if i == 10:
                check_eq(r.headers.get("dsv4d-existed"), "0", "second DELETE")
        check_eq(buf, b"", "nothing after the last answer")
        s.close()


def test_limits_before_body():
    """413 and 431 come back while the body is still unsent: only headers go out."""
    rng = np.random.default_rng(43)
    with Daemon(h.SMALL + ["--max-body-bytes", "100000", "--max-header-bytes", "4096"]) as d:
        ok = Batch.random(rng, 0, [Seg("l", 0, 2, True)], HEADS)
        before = d.metrics()
        for cl in (100001, 10 ** 12, 2 ** 63 - 1):
            s = h.connect(d)
            s.sendall(("POST /v1/forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream"
                       "\r\nContent-Length: %d\r\n\r\n" % cl).encode() + b"\0" * 100)
            r, _ = h.read_response(s, timeout=5)
            expect_error(r, 413, "payload_too_large")
            msg = r.json()["error"]["message"]
            check("%d" % cl in msg and "100000" in msg,
                  "the 413 names the body's size and the limit: %r" % msg)
            check_eq(r.headers.get("dsv4d-instance"), d.instance, "instance on 413")
            s.close()
        # 431: request headers over the limit, on a GET and on a POST whose body is never sent.
        for req in (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n",
                    b"POST /v1/forward HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n" +
                    b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 90) for i in range(60)) + b"\r\n",
                    b"GET /v1/sequences/" + b"s" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"):
            s = h.connect(d)
            s.sendall(req)
            r, _ = h.read_response(s, timeout=5)
            expect_error(r, 431, "headers_too_large")
            check_eq(r.headers.get("dsv4d-instance"), d.instance, "instance on 431")
            s.close()
        # Just under both limits: accepted.
        body = ok.body()
        check(len(body) < 100000, "test body size")
        r = d.forward_raw(body, headers={"X-Pad": "c" * 3000})
        check_eq(r.status, 200, "request under both limits")
        h.check_result(h.ForwardResult(r, ok), ok, "under the limits", bs=64)
        ms = d.metrics()
        check_eq(h.metric(ms, "dsv4d_kv_blocks", pool="swa", state="used"), 1.0, "used blocks")
        check_eq(h.metric(ms, "dsv4d_sequences"), 1.0, "sequences")
        check_eq(h.metric(ms, "dsv4d_batch_tokens_count") -
                 h.metric(before, "dsv4d_batch_tokens_count"), 1.0, "only one batch ran")
    # The default limit (derived from max_batch_tokens) also answers before the body.
    with Daemon(h.SMALL) as d:
        s = h.connect(d)
        s.sendall(b"POST /v1/forward HTTP/1.1\r\nHost: x\r\nContent-Length: 1099511627776\r\n\r\n")
        r, _ = h.read_response(s, timeout=5)
        expect_error(r, 413, "payload_too_large")
        s.close()
        s = h.connect(d)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n")
        r, _ = h.read_response(s, timeout=5)
        expect_error(r, 431, "headers_too_large")
        s.close()


def test_length_required():
    with Daemon(h.SMALL) as d:
        s = h.connect(d)
        s.sendall(b"POST /v1/forward HTTP/1.1\r\nHost: x\r\n\r\n")
        r, _ = h.read_response(s, timeout=5)
        expect_error(r, 411, "length_required")
        check_eq(r.headers.get("dsv4d-instance"), d.instance, "instance on 411")
        s.close()
        # A chunked body is refused with a message that says so.
        s = h.connect(d)
        s.sendall(b"POST /v1/forward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"5\r\nhello\r\n0\r\n\r\n")
        r, _ = h.read_response(s, timeout=5)
        expect_error(r, 411, "length_required")
        check("chunked" in r.json()["error"]["message"], "411 message %r" % r.json())
        s.close()


def test_disconnect_mid_body():
    """Clients that go away mid-body (FIN or RST) leave no trace: the next batch gives the bytes a fresh
    daemon gives, and the sequence is where it was."""
    rng = np.random.default_rng(44)
    b1 = Batch.random(rng, 0, [Seg("dc", 0, 40, True)], HEADS)
    b2 = Batch.random(rng, 0, [Seg("dc", 40, 30), Seg("dd", 0, 5, True)], HEADS)
    with Daemon(h.SMALL, name="A") as a, Daemon(h.SMALL, name="B") as b:
        ra1 = a.forward(b1)
        rb1 = b.forward(b1)
        before = a.seq("dc")
        used = a.used_blocks()
        body = b2.body()
        full = fwd(body)
        head = len(full) - len(body)
        # Mid-body, one byte short, inside the safetensors header, headers only, mid-headers.
        for n, rst in ((head + len(body) // 2, False), (len(full) - 1, True), (head + 20, False),
                       (head, True), (60, False)):
            s = h.connect(a)
            s.sendall(full[:n])
            time.sleep(0.05)
            if rst:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        time.sleep(0.2)
        check_eq(a.get("/healthz").status, 200, "healthz after the disconnects")
        check_eq(a.seq("dc"), before, "dc after the disconnects")
        check_eq(a.seq("dd"), None, "dd after the disconnects")
        check_eq(a.used_blocks(), used, "used blocks after the disconnects")
        ra2 = a.forward(b2)
        rb2 = b.forward(b2)
        for x, y, bt in ((ra1, rb1, b1), (ra2, rb2, b2)):
            check(np.array_equal(x.q_out, y.q_out) and np.array_equal(x.slots, y.slots),
                  "A and B differ on %r" % bt)
            check_eq(x.cache_digest, y.cache_digest, "cache_digest A vs B on %r" % bt)
            h.check_result(x, bt, "after disconnects", bs=64)
        sa, sb = a.seq("dc"), b.seq("dc")
        sa.pop("instance")
        sb.pop("instance")
        check_eq(sa, sb, "dc on A and B")


def test_connection_timeouts():
    """A request line that never completes, a body that stalls and an idle keep-alive connection are
    closed after their timeouts (an answer, if any, is 408 timeout)."""
    with Daemon(h.SMALL + ["--header-timeout-ms", "300", "--body-timeout-ms", "300",
                           "--idle-timeout-ms", "300"]) as d:
        cases = (("headers", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"),
                 ("body", b"POST /v1/forward HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc"),
                 ("idle", h.raw_request("GET", "/healthz")))
        for what, data in cases:
            s = h.connect(d)
            t0 = time.monotonic()
            s.sendall(data)
            closed, got = h.wait_closed(s, 3.0)
            dt = time.monotonic() - t0
            s.close()
            check(closed, "%s: connection still open after 3 s (got %r)" % (what, got[:200]))
            check(dt >= 0.25, "%s: closed after %.3f s, before the 300 ms timeout" % (what, dt))
            if what == "idle":
                check(got.startswith(b"HTTP/1.1 200"), "idle: the answer came first (%r)" % got[:50])
            elif got:
                check(got.startswith(b"HTTP/1.1 408"), "%s: answer before closing %r" % (what, got[:80]))
        # The body timeout is for the whole body: one dripped a byte every 100 ms is cut at 300 ms,
        # not kept alive by each byte.
        s = h.connect(d)
        s.sendall(b"POST /v1/forward HTTP/1.1\r\nHost: x\r\nContent-Length: 30\r\n\r\n")
        t0 = time.monotonic()
        got = b""
        for _ in range(30):
            try:
                s.sendall(b"x")
            except OSError:
                break
            r, _, _ = select.select([s], [], [], 0.1)
            if r:
                chunk = s.recv(4096)
                got += chunk
                if not chunk or got.startswith(b"HTTP/1.1 408"):
                    break
        dt = time.monotonic() - t0
        s.close()
        check(got.startswith(b"HTTP/1.1 408"), "dripped body: 408 expected, got %r after %.2f s"
              % (got[:80], dt))
        check(dt < 2.0, "dripped body answered after %.2f s (limit 300 ms)" % dt)
        check_eq(d.get("/healthz").status, 200, "healthz after the timeouts")


def test_obs_fold_refused():
    """Obsolete line folding is refused with 400 and the connection closes (RFC 9112 §5.2): the
    request a folded Content-Length would hide in its body is never answered."""
    with Daemon(h.SMALL) as d:
        hidden = h.raw_request("GET", "/healthz")
        cases = (("Content-Length folded onto ' 10'",
                  b"POST /v1/forward HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n 10\r\n\r\n"
                  b"0123456789" + hidden),
                 ("GET with Content-Length folded onto a tab and 0",
                  b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n\t0\r\n\r\n" + hidden),
                 ("an ordinary header folded",
                  b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n" + hidden))
        for what, data in cases:
            s = h.connect(d)
            s.sendall(data)
            closed, got = h.wait_closed(s, 3.0)
            s.close()
            check(closed, "%s: the connection stays open (got %r)" % (what, got[:200]))
            check(got.startswith(b"HTTP/1.1 400 "), "%s: answered %r" % (what, got[:80]))
            check_eq(got.count(b"HTTP/1.1 "), 1, "%s: answers on the connection (%r)" % (what, got))
            check(b"\r\nConnection: close\r\n" in got, "%s: no Connection: close" % what)
            check(b'"code":"bad_request"' in got, "%s: error code in %r" % (what, got))
        check_eq(d.get("/healthz").status, 200, "healthz after the folded requests")


def test_bearer_token():
    rng = np.random.default_rng(45)
    work = tempfile.mkdtemp(prefix="dsv4d-it-token-")
    tmp = h.write_token_file(work, "s3cret-token", 0o600, "api.token")
    try:
        with Daemon(h.SMALL + ["--api-token-file", tmp]) as d:
            b = Batch.random(rng, 0, [Seg("t", 0, 2, True)], HEADS)
            for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"},
                        {"Authorization": "Bearer s3cret-token-and-more"}):
                expect_error(d.forward_raw(b.body(), headers=hdr), 401, "unauthorized")
                expect_error(d.get("/v1/sequences/t", headers=hdr), 401, "unauthorized")
                expect_error(d.delete("/v1/sequences/t", headers=hdr), 401, "unauthorized")
            for path in ("/healthz", "/readyz", "/metrics"):
                check_eq(d.get(path).status, 200, "%s without a token" % path)
            ok = {"Authorization": "Bearer s3cret-token"}
            r = d.forward_raw(b.body(), headers=ok)
            check_eq(r.status, 200, "forward with the token")
            h.check_result(h.ForwardResult(r, b), b, "with a token", bs=64)
            r = d.get("/v1/sequences/t", headers=ok)
            check_eq(r.status, 200, "GET with the token")
            check_eq(r.json()["next"]["0"], 2, "next")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_api_token_file_mode():
    """An api_token_file that group or others may read or write stops the start-up (exit 2) with one
    line naming the file and its mode, as for admin_token_file; a 0600 file still works."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-token-")
    try:
        for mode in (0o644, 0o640, 0o604, 0o620):
            loose = h.write_token_file(work, "s3cret-token", mode, "loose-%o.token" % mode)
            d0 = Daemon(h.SMALL + ["--api-token-file", loose], name="loose-%o" % mode)
            try:
                d0.start()
                started = True
            except h.TestFailure:
                started = False
            try:
                check(not started, "an api_token_file of mode 0%o was accepted" % mode)
                check_eq(d0.wait(10), 2, "exit status with an api_token_file of mode 0%o" % mode)
                refusals = [j for j in h.log_records("\n".join(d0.lines))
                            if j.get("path") == loose and j.get("level") == "error"]
                check_eq(len(refusals), 1, "one log line names %s: %r" % (loose, d0.lines[-5:]))
                j = refusals[0]
                check_eq(j.get("mode"), "0%o" % mode, "the mode in the refusal")
                check("api_token_file" in j.get("msg", ""), "the refusal names the option: %r" % j)
            finally:
                d0.kill()
        good = h.write_token_file(work, "s3cret-token", 0o600, "good.token")
        with Daemon(h.SMALL + ["--api-token-file", good], name="private") as d:
            expect_error(d.get("/v1/sequences/t"), 401, "unauthorized")
            r = d.get("/v1/sequences/t", headers={"Authorization": "Bearer s3cret-token"})
            expect_error(r, 404, "unknown_sequence")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_pipelined_deadline():
    """A request pipelined behind a long one counts its Dsv4d-Deadline-Ms from the arrival of its
    first byte (README Decisions), not from when the daemon got round to parsing it: sent together
    with a batch that takes longer than its deadline, it is 504 deadline_exceeded and changes
    nothing."""
    rng = np.random.default_rng(47)
    with Daemon(["--kv-blocks", "64", "--layers", "0-0", "--threads", "1"]) as d:
        heads = 64
        # Long enough on a GPU too (there 1024 tokens were done before the third small came).
        big = Batch.random(rng, 0, [Seg("big", 0, 2048, True)], heads, outputs="q")
        late = Batch.random(rng, 0, [Seg("late", 0, 2, True)], heads)
        s = h.connect(d)
        t0 = time.monotonic()
        s.sendall(fwd(big.body()) + fwd(late.body(), {"Dsv4d-Deadline-Ms": "50"}))
        r0, buf = h.read_response(s, timeout=30)
        dt = time.monotonic() - t0
        r1, _ = h.read_response(s, buf, timeout=30)
        s.close()
        check_eq(r0.status, 200, "the long batch")
        check(dt > 0.1, "the long batch took only %.3f s: the test proves nothing" % dt)
        expect_error(r1, 504, "deadline_exceeded")
        check_eq(d.seq("late"), None, "no sequence from the late batch")
        print("long batch %.3f s; pipelined batch %d" % (dt, r1.status))


def test_deadline_and_queue_full():
    """Behind a long batch on the executor, a batch whose Dsv4d-Deadline-Ms passes while it waits is
    dropped (504 deadline_exceeded) and batches that find the queue full are refused (503 queue_full
    with Retry-After); none of them changes anything."""
    rng = np.random.default_rng(46)
    with Daemon(["--kv-blocks", "64", "--layers", "0-0", "--threads", "1", "--queue-depth", "2"]) as d:
        heads = 64
        # Long enough on a GPU too (there 1024 tokens were done before the third small came).
        big = Batch.random(rng, 0, [Seg("big", 0, 2048, True)], heads, outputs="q")
        smalls = [Batch.random(rng, 0, [Seg("s%d" % i, 0, 2, True)], heads) for i in range(3)]
        t0 = time.monotonic()
        s0 = h.connect(d)
        s0.sendall(fwd(big.body()))
        while h.metric(d.metrics(), "dsv4d_inflight_batches") < 1:
            check(time.monotonic() < t0 + 10, "the long batch never showed in flight")
            time.sleep(0.002)
        socks = []
        for i, b in enumerate(smalls):
            s = h.connect(d)
            s.sendall(fwd(b.body(), {"Dsv4d-Deadline-Ms": "1"} if i == 0 else None))
            socks.append(s)
            time.sleep(0.002)  # in this order
        answers = [h.read_response(s, timeout=30)[0] for s in socks]
        r0, _ = h.read_response(s0, timeout=30)
        dt = time.monotonic() - t0
        check_eq(r0.status, 200, "the long batch")
        check(dt > 0.1, "the long batch took only %.3f s: the test proves nothing" % dt)
        full = 0
        for i, (b, r) in enumerate(zip(smalls, answers)):
            if r.status == 503:
                expect_error(r, 503, "queue_full")
                full += 1
            elif i == 0:
                expect_error(r, 504, "deadline_exceeded")
            else:
                check_eq(r.status, 200, "queued batch %d (%r)" % (i, r))
                h.check_result(h.ForwardResult(r, b), b, "queued batch %d" % i, bs=64)
        check(full >= 1, "no batch met a full queue of depth 2: %r" % answers)
        for s in socks + [s0]:
            s.close()
        for i, (b, r) in enumerate(zip(smalls, answers)):
            if r.status != 200:
                check_eq(d.seq("s%d" % i), None, "s%d after %d" % (i, r.status))
                h.check_result(d.forward(b), b, "s%d after the refusal" % i, bs=64)
        print("long batch %.3f s; answers %s" % (dt, [r.status for r in answers]))


if __name__ == "__main__":
    h.main([test_keep_alive, test_pipelined_in_order, test_limits_before_body, test_length_required,
            test_disconnect_mid_body, test_connection_timeouts, test_obs_fold_refused,
            test_bearer_token, test_api_token_file_mode, test_pipelined_deadline,
            test_deadline_and_queue_full])
