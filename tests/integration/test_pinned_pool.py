"""The page-locked pool for request bodies and answers (pinned_pool_mib, README "Configuration").

It is on where the backend registers host memory with the device (cuda, and the staged test backend,
which keeps the ranges registered as CUDA does), and off elsewhere or with 0: answers are the same
either way. A pool too small for a batch falls back to heap memory and counts it in
dsv4d_pinned_pool_fallbacks_total{use}; every block goes back when its answer has been sent. A value
out of range refuses the start."""

import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, metric  # noqa: E402

HEADS = 8
BS = 64
MIB = 1 << 20
# Backends with a host_register hook: the daemon registers its pool with them.
POOL_BACKENDS = ("cuda", "cpu_staged", "cpu_staged_overlap")


def pool_on():
    return h.BACKEND_NAME in POOL_BACKENDS


def pool_state(d):
    ms = d.metrics()
    return {"total": metric(ms, "dsv4d_pinned_pool_bytes_total"),
            "used": metric(ms, "dsv4d_pinned_pool_bytes", state="used"),
            "free": metric(ms, "dsv4d_pinned_pool_bytes", state="free"),
            "body": metric(ms, "dsv4d_pinned_pool_fallbacks_total", use="body"),
            "output": metric(ms, "dsv4d_pinned_pool_fallbacks_total", use="output")}


def wait_pool_idle(d, timeout=5.0):
    """Blocks go back once an answer has left the socket, a moment after the client read it."""
    deadline = time.monotonic() + timeout
    while True:
        st = pool_state(d)
        if st["used"] == 0 or time.monotonic() > deadline:
            check_eq(st["used"], 0, "dsv4d_pinned_pool_bytes{state=\"used\"} once idle")
            check_eq(st["free"], st["total"], "free bytes of an idle pool")
            return st


def thp_bytes():
    """The kernel's transparent huge page size (2 MiB on x86-64), or 2 MiB where it does not say."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read()) or 2 * MIB
    except (OSError, ValueError):
        return 2 * MIB


def log_msgs(d, msg):
    return [ln for ln in d.lines if '"msg":"%s"' % msg in ln]


def serve_and_check(d, rng, seq, n_prefill, n_decode):
    """A prefill of n_prefill tokens then n_decode one-token steps, each against the model."""
    b = Batch.random(rng, 0, [Seg(seq, 0, n_prefill, True)], HEADS)
    h.check_result(d.forward(b), b, "prefill of %s" % seq, bs=BS)
    for p in range(n_prefill, n_prefill + n_decode):
        b = Batch.random(rng, 0, [Seg(seq, p, 1)], HEADS)
        h.check_result(d.forward(b), b, "decode of %s at %d" % (seq, p), bs=BS)


def check_clean_exit(d):
    check_eq(d.stop(), 0, "exit status after SIGTERM")
    check_eq(log_msgs(d, "pinned pool blocks still allocated at exit"), [],
             "no pinned block left at exit")


def test_default_pool():
    """At the default (256 MiB) the pool is on exactly where the backend registers memory; batches
    are answered as the model says, nothing falls back, and every block comes back."""
    rng = np.random.default_rng(1)
    with Daemon(h.SMALL) as d:
        st = pool_state(d)
        check_eq(st["total"], 256 * MIB if pool_on() else 0, "pool bytes on %s" % h.BACKEND_NAME)
        lines = log_msgs(d, "pinned pool")
        check_eq(len(lines), 1 if pool_on() else 0, "the start-up line of the pool")
        for ln in lines:
            at = json.loads(ln)
            # Where the kernel placed the arena: a NUMA node (-1 without NUMA) and the bytes in
            # huge pages, whole huge pages of the arena.
            for k in ("numa_node", "numa_node_last"):
                check(isinstance(at.get(k), int) and at[k] >= -1, "%s in %s" % (k, ln))
            hb, page = at.get("huge_page_bytes"), thp_bytes()
            check(isinstance(hb, int) and 0 <= hb <= 256 * MIB and hb % page == 0,
                  "huge_page_bytes in %s" % ln)
        check_eq(log_msgs(d, "pinned pool off: bodies and answers in heap memory"), [],
                 "no failed registration")
        serve_and_check(d, rng, "a", 100, 30)
        st = wait_pool_idle(d)
        check_eq((st["body"], st["output"]), (0, 0), "fallbacks of a pool with room")
        check_clean_exit(d)


def test_pool_off():
    """pinned_pool_mib 0: no pool on any backend, the same answers, no fallback counted."""
    rng = np.random.default_rng(2)
    with Daemon(h.SMALL + ["--pinned-pool-mib", "0"]) as d:
        check_eq(log_msgs(d, "pinned pool"), [], "no pool line")
        serve_and_check(d, rng, "b", 70, 10)
        # A batch larger than any pool: with the pool off it is no fallback.
        b = Batch.random(rng, 0, [Seg("big", 0, 300, True)], HEADS)
        h.check_result(d.forward(b), b, "a large prefill", bs=BS)
        st = pool_state(d)
        check_eq((st["total"], st["used"], st["free"]), (0, 0, 0), "pool bytes when off")
        check_eq((st["body"], st["output"]), (0, 0), "fallbacks when off")
        check_clean_exit(d)


def test_small_pool_falls_back():
    """A 1 MiB pool: a small batch fits (no fallback); a 300-token batch (a 2.7 MiB body, a 2.4 MiB
    answer) falls back for both and is answered all the same; batches from several connections at
    once, some fitting and some not, all come back right and leave the pool empty."""
    rng = np.random.default_rng(3)
    with Daemon(h.SMALL + ["--pinned-pool-mib", "1"]) as d:
        check_eq(pool_state(d)["total"], MIB if pool_on() else 0, "pool bytes")
        serve_and_check(d, rng, "small", 10, 3)
        st = wait_pool_idle(d)
        check_eq((st["body"], st["output"]), (0, 0), "a small batch fits")
        b = Batch.random(rng, 0, [Seg("big", 0, 300, True)], HEADS)
        h.check_result(d.forward(b), b, "a prefill larger than the pool", bs=BS)
        st = wait_pool_idle(d)
        want = 1 if pool_on() else 0
        check_eq((st["body"], st["output"]), (want, want), "fallbacks of a batch past the pool")

        results, errors = {}, []

        def client(i):
            try:
                local = np.random.default_rng(100 + i)
                for k in range(3):
                    seq = "c%d" % i
                    n = 40 if k == 0 else 1
                    p0 = 0 if k == 0 else 40 + k - 1
                    bt = Batch.random(local, 0, [Seg(seq, p0, n, k == 0)], HEADS)
                    results[(i, k)] = (bt, d.forward(bt))
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        check(not errors, "concurrent clients: %r" % errors[:1])
        for (i, k), (bt, res) in sorted(results.items()):
            h.check_result(res, bt, "client %d batch %d" % (i, k), bs=BS)
        check_eq(len(results), 12, "answers of the concurrent clients")
        st = wait_pool_idle(d)
        check(st["body"] >= want and st["output"] >= want, "fallbacks counted: %r" % st)
        check_clean_exit(d)


def test_bad_values_refuse_start():
    """A negative, a too large or a non-numeric pinned_pool_mib stops the start with exit 2 and a
    bad-configuration line naming the option."""
    for args, env in ((["--pinned-pool-mib", "-1"], None),
                      (["--pinned-pool-mib", "65537"], None),
                      (["--pinned-pool-mib", "99999999999999999999"], None),
                      ([], {"DSV4D_PINNED_POOL_MIB": "lots"})):
        d = Daemon(h.SMALL + args, env=env, name="bad")
        try:
            d.start()
            raise h.TestFailure("a daemon started with %r %r" % (args, env))
        except h.TestFailure as e:
            check("exited with status 2" in str(e), "start refused with exit 2: %s" % e)
        bad = log_msgs(d, "bad configuration")
        check(len(bad) == 1 and "pinned_pool_mib" in bad[0],
              "the log names pinned_pool_mib: %s" % d.log_tail())
        d.kill()


if __name__ == "__main__":
    h.main([test_default_pool, test_pool_off, test_small_pool_falls_back,
            test_bad_values_refuse_start])
