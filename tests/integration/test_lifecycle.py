"""Process life cycle: start-up time, --help, option errors, configuration sources, SIGTERM/SIGINT
drain with a batch in flight and with keep-alive clients sending, and idle sequence expiry."""

import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

STARTUP_LIMIT_S = float(os.environ.get("DSV4_IT_STARTUP_LIMIT", "1.0"))
FLAGS = ("--host", "--port", "--backend", "--threads", "--block-size", "--kv-blocks", "--heads",
         "--layers", "--kv-norm", "--max-batch-tokens", "--max-segments", "--max-header-bytes",
         "--max-body-bytes", "--max-connections", "--queue-depth", "--sequence-idle-timeout-s",
         "--implicit-create", "--header-timeout-ms", "--body-timeout-ms", "--idle-timeout-ms", "--drain-timeout-ms",
         "--model-config", "--api-token-file", "--config")


def run_cli(args, env=None, timeout=5):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([h.DAEMON] + args, env=e, stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=timeout)


def test_startup_time_default_config():
    """Spawn to the listening line on the built-in configuration (64 heads, 43 layers)."""
    times = []
    for _ in range(2):
        d = Daemon([], name="default")
        d.start()
        times.append(d.startup_s)
        check_eq(d.get("/readyz").status, 200, "readyz on the default config")
        rc = d.stop()
        check_eq(rc, 0, "exit status after SIGTERM")
    print("start-up on the default config: %s s" % ", ".join("%.3f" % t for t in times))
    check(min(times) < STARTUP_LIMIT_S, "start-up took %.3f s (limit %.1f s)" % (min(times),
                                                                              STARTUP_LIMIT_S))


def test_help():
    r = run_cli(["--help"])
    check_eq(r.returncode, 0, "--help exit status")
    text = (r.stdout + r.stderr).decode()
    for f in FLAGS:
        check(f in text, "--help does not mention %s" % f)


def test_option_errors():
    """A bad value exits non-zero, naming the option, without serving."""
    cases = [(["--heads", "129"], "heads"), (["--heads", "-1"], "heads"),
             (["--block-size", "17"], "block"), (["--block-size", "512"], "block"),
             (["--block-size", "8"], "block"), (["--port", "70000"], "port"),
             (["--port", "-1"], "port"), (["--kv-blocks", "0"], "kv"),
             (["--kv-blocks", "many"], "kv"), (["--layers", "5-2"], "layers"),
             (["--layers", "0-99"], "layers"), (["--implicit-create=maybe"], "implicit"),
             (["--kv-norm", "sometimes"], "kv"), (["--backend", "abacus"], "backend"),
             (["--threads", "-3"], "threads"), (["--no-such-option", "1"], "no-such-option"),
             (["--heads"], "heads"), (["--admin-host", "localhost"], "admin_host"),
             (["--host", ""], "host"), (["--host", "127.0.0.1 "], "host"),
             (["--layers", "0\n{\"msg\":\"listening\",\"port\":1}"], "layers")]
    for args, name in cases:
        r = run_cli((["--port", "0"] if "--port" not in args else []) + args)
        err = (r.stdout + r.stderr).decode()
        check_eq(r.returncode, 2, "%s: exit status (output %r)" % (args, err[-300:]))
        lines = [ln for ln in err.splitlines() if ln.strip()]
        check(lines and all(ln.startswith("{") and json.loads(ln) for ln in lines),
              "%s: the error is JSON lines, and a value cannot forge one: %r" % (args, err[-400:]))
        check(name in err.replace("_", "-") or name in err,
              "%s: the error does not name %r: %r" % (args, name, err[-400:]))
    # The same range checks apply to the environment and the JSON file.
    r = run_cli(["--port", "0"], env={"DSV4D_HEADS": "129"})
    check(r.returncode != 0 and b"heads" in (r.stdout + r.stderr).lower(),
          "DSV4D_HEADS=129: exit %d %r" % (r.returncode, (r.stdout + r.stderr)[-300:]))
    cfg = os.path.join(os.environ.get("TMPDIR", "/tmp"), "dsv4d-it-cfg-%d.json" % os.getpid())
    try:
        with open(cfg, "w") as f:
            json.dump({"heads": 200}, f)
        r = run_cli(["--port", "0", "--config", cfg])
        check(r.returncode != 0 and b"heads" in (r.stdout + r.stderr).lower(),
              "config heads 200: exit %d %r" % (r.returncode, (r.stdout + r.stderr)[-300:]))
    finally:
        os.unlink(cfg)


def accepts_heads(d, heads, rng, seq):
    b = Batch.random(rng, 0, [Seg(seq, 0, 1, True)], heads)
    r = d.forward_raw(b.body())
    return r.status == 200


def test_port_in_use():
    """A port already taken: one log line saying so, exit status 1, nothing leaked (under the
    sanitizers a leak would change the status)."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for args in (["--port", str(port), "--admin-port", "0"],
                     ["--port", "0", "--admin-port", str(port)]):
            r = run_cli(h.SMALL + args, timeout=30)
            err = r.stderr.decode()
            check_eq(r.returncode, 1, "%s: exit status (log %r)" % (args, err[-400:]))
            lines = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
            bad = [ln for ln in lines if ln.get("msg") == "cannot listen"]
            check_eq(len(bad), 1, "%s: one cannot-listen line (%r)" % (args, err[-400:]))
            check_eq(bad[0].get("error"), "address already in use", "%s: the reason" % args)
            check("Sanitizer" not in err and "runtime error" not in err,
                  "%s: sanitizer report: %r" % (args, err[-400:]))
    finally:
        taken.close()


def test_config_sources():
    """file < environment < command line; implicit_create."""
    rng = np.random.default_rng(51)
    cfg = os.path.join(os.environ.get("TMPDIR", "/tmp"), "dsv4d-it-cfg2-%d.json" % os.getpid())
    base = ["--kv-blocks", "8", "--layers", "0-1"]
    try:
        with open(cfg, "w") as f:
            json.dump({"heads": 2, "kv_blocks": 8}, f)
        with Daemon(base + ["--config", cfg]) as d:
            check(accepts_heads(d, 2, rng, "f") and not accepts_heads(d, 4, rng, "g"),
                  "heads from the config file")
        with Daemon(base + ["--config", cfg], env={"DSV4D_HEADS": "3"}) as d:
            check(accepts_heads(d, 3, rng, "f") and not accepts_heads(d, 2, rng, "g"),
                  "the environment over the file")
        with Daemon(base + ["--config", cfg, "--heads", "5"], env={"DSV4D_HEADS": "3"}) as d:
            check(accepts_heads(d, 5, rng, "f") and not accepts_heads(d, 3, rng, "g"),
                  "the command line over the environment")
    finally:
        os.unlink(cfg)
    with Daemon(base + ["--heads", "2", "--implicit-create=true"]) as d:
        b = Batch.random(rng, 1, [Seg("imp", 7, 3)], 2)
        h.check_result(d.forward(b), b, "implicit create", bs=64)
        j = d.seq("imp")
        check_eq((j["p0"], j["next"]), (7, {"0": 7, "1": 10}), "implicitly created sequence")
    with Daemon(base + ["--heads", "2"]) as d:
        e = expect_error(d.forward_raw(Batch.random(rng, 1, [Seg("imp", 7, 3)], 2).body()), 404,
                         "unknown_sequence")
        check_eq(e.get("instance"), d.instance, "instance in the 404")


def test_bool_option_with_a_value():
    """Booleans take a separate value too (the form the operator documentation uses: --flag true)."""
    for args in (["--implicit-create", "true"], ["--implicit-create", "false"]):
        with Daemon(h.SMALL + args) as d:
            check_eq(d.get("/readyz").status, 200, "readyz with %s" % " ".join(args))


def test_sigterm_drains_inflight_batch():
    """SIGTERM while a large batch is on the executor: the batch is answered in full and correctly,
    and the process exits 0."""
    rng = np.random.default_rng(52)
    heads = 64
    for n in (512, 1024, 2048):
        d = Daemon(["--kv-blocks", "64", "--layers", "0-0", "--threads", "1",
                    "--drain-timeout-ms", "20000"], name="drain-%d" % n)
        d.start()
        b = Batch.random(rng, 0, [Seg("big", 0, n, True)], heads)
        body = b.body()
        out = {}

        def send():
            try:
                out["r"] = d.forward_raw(body)
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                out["e"] = e

        t = threading.Thread(target=send)
        t.start()
        seen = False
        deadline = time.monotonic() + 30
        while t.is_alive() and time.monotonic() < deadline:
            try:
                ms = d.metrics()
            except (OSError, h.TestFailure):
                break
            if h.metric(ms, "dsv4d_inflight_batches") >= 1:
                seen = True
                break
            time.sleep(0.002)
        if seen:
            d.signal(signal.SIGTERM)
        t.join(60)
        check(not t.is_alive(), "the in-flight batch got no answer")
        if not seen:
            check("e" not in out, "batch failed without a signal: %r" % out.get("e"))
            d.stop()
            print("N=%d finished before it was seen in flight; trying a larger batch" % n)
            continue
        check("e" not in out, "the in-flight batch failed: %r" % out.get("e"))
        r = out["r"]
        check_eq(r.status, 200, "status of the batch in flight at SIGTERM (%r)" % r)
        res = h.ForwardResult(r, b)
        check_eq(res.cache_digest, h.model().cache_digest(b), "cache_digest of the drained batch")
        h.check_slots(res.slots, b, 64, "drained batch")
        for lo in (0, n - 32):  # q_out of the first and last 32 tokens against the model
            part = Batch(0, [Seg("big", lo, 32)], b.q[lo:lo + 32], b.kv[lo:lo + 32])
            check(np.array_equal(res.q_out[lo:lo + 32], h.model().q_out(part)),
                  "q_out of tokens %d..%d of the drained batch" % (lo, lo + 31))
        rc = d.wait(20)
        check(rc is not None, "no exit within 20 s of SIGTERM")
        check_eq(rc, 0, "exit status after the drain")
        print("drained a batch of %d tokens x %d heads in flight at SIGTERM" % (n, heads))
        return
    raise h.TestFailure("no batch was ever seen in flight (dsv4d_inflight_batches stayed 0)")


def test_sigterm_answers_pipelined():
    """SIGTERM while a batch runs and a second one, pipelined behind it on the same connection, has
    fully arrived: the first is answered 200, the second 503 draining (never applied: a gateway
    knows to send it elsewhere), not dropped with the connection; the process exits 0."""
    rng = np.random.default_rng(53)
    heads = 64
    for n in (1024, 2048, 4096):
        d = Daemon(["--kv-blocks", "128", "--layers", "0-0", "--threads", "1",
                    "--drain-timeout-ms", "20000"], name="drain-pipe-%d" % n)
        d.start()
        big = Batch.random(rng, 0, [Seg("big", 0, n, True)], heads, outputs="q")
        second = Batch.random(rng, 0, [Seg("second", 0, 2, True)], heads)
        s = h.connect(d)
        s.sendall(h.raw_request("POST", "/v1/forward", big.body()) +
                  h.raw_request("POST", "/v1/forward", second.body()))
        seen = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if h.metric(d.metrics(), "dsv4d_inflight_batches") >= 1:
                seen = True
                break
            time.sleep(0.002)
        if seen:
            d.signal(signal.SIGTERM)
        r0, buf = h.read_response(s, timeout=60)
        r1, _ = h.read_response(s, buf, timeout=60)
        s.close()
        check_eq(r0.status, 200, "the batch in flight")
        if not seen or r1.status == 200:
            # The signal came too late to find the second batch waiting: try a larger first batch.
            check_eq(r1.status, 200, "the second batch without a drain")
            d.signal(signal.SIGTERM)
            d.wait(20)
            print("N=%d: no drain while the second batch waited; trying a larger batch" % n)
            continue
        expect_error(r1, 503, "draining")
        rc = d.wait(20)
        check_eq(rc, 0, "exit status after the drain")
        print("N=%d: in flight 200, pipelined 503 draining" % n)
        return
    raise h.TestFailure("the drain never found the pipelined batch waiting")


def test_sigint_and_idle_sigterm():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with Daemon(h.SMALL) as d:
            s = h.connect(d)  # an idle keep-alive connection must not hold the exit up
            t0 = time.monotonic()
            d.signal(sig)
            rc = d.wait(5)
            check(rc is not None, "%s: no exit within 5 s when idle" % sig.name)
            check_eq(rc, 0, "%s: exit status" % sig.name)
            check(any('"draining"' in ln and sig.name in ln for ln in d.lines),
                  "%s: a drain was logged" % sig.name)
            print("%s: exit after %.3f s" % (sig.name, time.monotonic() - t0))
            s.close()


class _Client:
    """One keep-alive client of test_sigterm_keep_alive_clients: GET /healthz, read the answer, send
    the next at once, until an answer says Connection: close or the daemon closes the connection."""

    REQ = h.raw_request("GET", "/healthz")

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.out = b""
        self.buf = b""
        self.answers = 0
        self.done = None  # "close" (an answer said so), "eof-idle", "eof-mid-request", "reset-sending"
        self.send_next()

    def send_next(self):
        self.out = self.REQ
        self.flush()

    def flush(self):
        try:
            while self.out:
                k = self.sock.send(self.out)
                self.out = self.out[k:]
        except BlockingIOError:
            pass
        except OSError:
            self.finish("reset-sending")  # the request's bytes were not all sent

    def readable(self):
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            # The request was sent whole (nothing left in self.out) and never answered.
            self.finish("eof-mid-request" if not self.out else "reset-sending")
            return
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            n = 0
            for ln in head.split(b"\r\n")[1:]:
                k, _, v = ln.partition(b":")
                if k.strip().lower() == b"content-length":
                    n = int(v)
            if len(rest) < n:
                return
            check(head.startswith(b"HTTP/1.1 200 "), "answer %r" % head[:40])
            self.buf = rest[n:]
            self.answers += 1
            if b"\r\nconnection: close" in head.lower() + b"\r\n":
                self.finish("close")
                return
            self.send_next()

    def finish(self, how):
        if self.done is None:
            self.done = how
            self.sock.close()


def test_sigterm_keep_alive_clients():
    """Many keep-alive clients send requests back to back while SIGTERM arrives: every request
    whose bytes were sent whole is answered in full (the answer after the drain starts says
    Connection: close); no client sees its connection end under a request it has sent."""
    n = 600
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 400), hard))
    with Daemon(h.SMALL + ["--drain-timeout-ms", "20000"]) as d:
        clients = [_Client(d.port) for _ in range(n)]
        sel = selectors.DefaultSelector()
        for c in clients:
            sel.register(c.sock, selectors.EVENT_READ, c)
        t0 = time.monotonic()
        signalled = None
        answered = 0
        live = list(clients)
        while live and time.monotonic() - t0 < 30:
            if signalled is None and time.monotonic() - t0 > 1.0:
                answered = sum(c.answers for c in clients)
                d.signal(signal.SIGTERM)
                signalled = time.monotonic()
            for key, _ in sel.select(0.1):
                c = key.data
                if c.done is None:
                    c.readable()
                if c.done is not None:
                    sel.unregister(key.fileobj)
            for c in live:
                if c.done is None and c.out:
                    c.flush()
            live = [c for c in live if c.done is None]
        sel.close()
        for c in live:
            c.finish("hung")
        rc = d.wait(20)
        outcomes = {}
        for c in clients:
            outcomes[c.done] = outcomes.get(c.done, 0) + 1
        total = sum(c.answers for c in clients)
        print("%d clients, %d answers (%d after SIGTERM), outcomes %r" %
              (n, total, total - answered, outcomes))
        check(signalled is not None, "SIGTERM was never sent")
        check_eq(outcomes.get("eof-mid-request", 0), 0, "clients whose sent request got no answer")
        check_eq(outcomes.get("hung", 0), 0, "clients still waiting after 30 s")
        check_eq(outcomes.get("close", 0), n, "clients told Connection: close")
        check_eq(rc, 0, "exit status after the drain")


def test_service_manager_notifications():
    """sd_notify: READY=1 once the daemon listens, STOPPING=1 when a drain starts."""
    import socket
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="dsv4d-notify-"), "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        with Daemon(h.SMALL, env={"NOTIFY_SOCKET": path}) as d:
            check_eq(sock.recv(256), b"READY=1", "first notification")
            d.signal(signal.SIGTERM)
            check_eq(sock.recv(256), b"STOPPING=1", "notification when draining")
            check_eq(d.wait(5), 0, "exit status after SIGTERM")
    finally:
        sock.close()
        os.unlink(path)


def test_sequence_idle_expiry():
    """sequence_idle_timeout_s 1: an idle sequence is deleted (blocks freed) and answers 410 for one
    more period, then 404."""
    rng = np.random.default_rng(53)
    with Daemon(h.SMALL + ["--sequence-idle-timeout-s", "1"]) as d:
        d.forward(Batch.random(rng, 0, [Seg("idle", 0, 100, True)], 8))
        d.wait_used_blocks(2)
        deadline = time.monotonic() + 4
        r = None
        while time.monotonic() < deadline:
            r = d.get("/v1/sequences/idle")
            if r.status != 200:
                break
            time.sleep(0.05)
        expect_error(r, 410, "sequence_expired")
        e = expect_error(d.forward_raw(Batch.random(rng, 0, [Seg("idle", 100, 1)], 8).body()), 410,
                         "sequence_expired")
        check(e is not None, "410 on forward")
        d.wait_used_blocks(0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            r = d.get("/v1/sequences/idle")
            if r.status != 410:
                break
            time.sleep(0.1)
        expect_error(r, 404, "unknown_sequence")


if __name__ == "__main__":
    h.main([test_startup_time_default_config, test_help, test_option_errors, test_port_in_use,
            test_config_sources,
            test_bool_option_with_a_value, test_sigterm_drains_inflight_batch,
            test_sigterm_answers_pipelined, test_sigterm_keep_alive_clients,
            test_sigint_and_idle_sigterm, test_sequence_idle_expiry,
            test_service_manager_notifications])
