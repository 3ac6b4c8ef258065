"""Answers written by the executor's thread (direct_answer_bytes): a daemon that writes none of an
answer there (--direct-answer-bytes 0), one that writes its first 100 bytes there (the loop writes
the rest: the response head is split) and one with the default answer every request with the same
bytes: q_out, slots, attn, lse, cache_digest, the whole body, and a refused batch's error; the three
end with the same cache and sequences, and dsv4d_direct_answers_total counts each 200 answer of the
two that write (never a refusal). Then clients on several connections at once, whose batches the
executor overlaps on the staged backend: every answer is the model's and on its own connection."""

import os
import shutil
import sys
import tempfile
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402
from test_prefill_chunks import same_state, write_weights  # noqa: E402

HEADS = 8
NAMES = ["d0", "d1", "d2"]
OUTPUTS = ["q", "attn", "q,digest", "attn,lse", "q,attn,lse,digest"]


def direct_total(d):
    return h.metric(d.metrics(), "dsv4d_direct_answers_total")


def same_bodies(ds, batch, what):
    """The batch on every daemon: 200 and byte-identical bodies, the whole body against the head's
    Content-Length. Returns the first's result (a ForwardResult when q_out was asked for)."""
    rs = [d.forward_raw(batch.body()) for d in ds]
    for d, r in zip(ds, rs):
        check_eq(r.status, 200, "%s: %s's status (%r)" % (what, d.name, r.body[:200]))
        check_eq(int(r.headers.get("content-length")), len(r.body), "%s: length" % what)
        check_eq(r.headers.get("dsv4d-instance"), d.instance, "%s: instance" % what)
        check(r.body == rs[0].body, "%s: %s answers other bytes (%d against %d)" %
              (what, d.name, len(r.body), len(rs[0].body)))
    if "q" in batch.outputs.split(","):
        return h.ForwardResult(rs[0], batch)
    return None


def test_direct_same_bytes():
    """Prefills of three sequences on layers 0 and 1, decode steps of one to three of them with each
    mix of outputs, then a decode at a wrong position."""
    rng = np.random.default_rng(93)
    work = tempfile.mkdtemp(prefix="dsv4d-it-direct-")
    try:
        w = os.path.join(work, "w.safetensors")
        write_weights(w)
        # Every batch goes to the executor (the test's client is alone: inline would take decodes).
        args = h.SMALL + ["--weights", w, "--inline-decode-tokens", "0"]
        with Daemon(args + ["--direct-answer-bytes", "0"], name="loop") as a, \
                Daemon(args + ["--direct-answer-bytes", "100"], name="split") as b, \
                Daemon(args, name="direct") as c:
            ds = [a, b, c]
            ok = 0
            pos = {n: 40 for n in NAMES}
            for layer in (0, 1):
                segs = [Seg(n, 0, 40, layer == 0) for n in NAMES]
                p = Batch.random(rng, layer, segs, HEADS, outputs="q,attn,lse,digest")
                h.check_result(same_bodies(ds, p, "prefill layer %d" % layer), p, "prefill", bs=64)
                ok += 1
            for step in range(2 * len(OUTPUTS)):
                k = 1 + step % 3
                segs = [Seg(n, pos[n], 1) for n in NAMES[:k]]
                for layer in (0, 1):
                    d = Batch.random(rng, layer, segs, HEADS, outputs=OUTPUTS[step % len(OUTPUTS)])
                    res = same_bodies(ds, d, "decode %d layer %d" % (step, layer))
                    if res:  # the slots and q_out against the model
                        h.check_result(res, d, "decode", bs=64)
                    ok += 1
                for n in NAMES[:k]:
                    pos[n] += 1
            bad = Batch.random(rng, 0, [Seg("d0", pos["d0"] + 3, 1)], HEADS, outputs="q")
            errs = [expect_error(d.forward_raw(bad.body()), 409, "position_mismatch") for d in ds]
            for d, e in zip(ds[1:], errs[1:]):
                check_eq(e, errs[0], "%s's refusal" % d.name)
            check_eq(direct_total(a), 0.0, "answers written by the executor at 0 bytes")
            check_eq(direct_total(b), float(ok), "answers begun by the executor at 100 bytes")
            check_eq(direct_total(c), float(ok), "answers written by the executor by default")
            same_state(a, b, NAMES)
            same_state(a, c, NAMES)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def client(d, name, layer_steps, rng_seed, failures):
    """One connection: a prefill of its own sequence, then decode steps, each answer checked."""
    rng = np.random.default_rng(rng_seed)
    conn = d.conn()
    try:
        p = Batch.random(rng, 0, [Seg(name, 0, 30, True)], HEADS, outputs="q,digest")
        h.check_result(d.forward(p, conn=conn), p, "prefill of %s" % name, bs=64)
        for step in range(layer_steps):
            b = Batch.random(rng, 0, [Seg(name, 30 + step, 1)], HEADS,
                             outputs="q" if step % 2 else "q,digest")
            h.check_result(d.forward(b, conn=conn), b, "decode %d of %s" % (step, name), bs=64)
    except Exception as e:  # noqa: BLE001 (reported by the main thread)
        failures.append("%s: %r" % (name, e))
    finally:
        conn.close()


def test_direct_many_clients():
    """Four clients at once, each on its own connection and sequence."""
    d = Daemon(h.SMALL).start()
    try:
        failures = []
        ts = [threading.Thread(target=client, args=(d, "m%d" % i, 12, 200 + i, failures))
              for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        check(not failures, "clients failed: %s" % failures)
        got = direct_total(d)
        # Each client's prefill and decodes; a decode that found the others gone ran inline.
        check(0 < got <= 4 * 13, "answers written by the executor: %r of %d" % (got, 4 * 13))
    finally:
        d.stop()


def test_direct_counted_when_read():
    """A client that has read an answer the executor's thread sent, and then asks for the metrics
    on another connection, finds that batch counted: the metrics wait for the batch to come back
    to the loop (dsv4d_slow_back, whose executor hands each batch back 2 ms after its answer,
    makes the wait needed every time)."""
    rng = np.random.default_rng(95)
    with Daemon(h.SMALL + ["--inline-decode-tokens", "0"]) as d:
        conn = d.conn()
        p = Batch.random(rng, 0, [Seg("m", 0, 8, True)], HEADS, outputs="q")
        d.forward(p, conn=conn)
        for i in range(150):
            b = Batch.random(rng, 0, [Seg("m", 8 + i, 1)], HEADS, outputs="q")
            d.forward(b, conn=conn)
            ms = d.metrics()  # on a connection of its own: not queued behind the forward's
            check_eq(h.metric(ms, "dsv4d_inflight_batches"), 0.0, "in flight after %d" % i)
            check_eq(h.metric(ms, "dsv4d_batch_tokens_count"), float(i + 2),
                     "batches counted after answer %d" % i)
            check_eq(h.metric(ms, "dsv4d_direct_answers_total"), float(i + 2),
                     "direct answers after answer %d" % i)
            check_eq(h.metric(ms, "dsv4d_requests_total", route="forward", code="200"),
                     float(i + 2), "forward requests after answer %d" % i)
        conn.close()


if __name__ == "__main__":
    h.main([test_direct_same_bytes, test_direct_many_clients, test_direct_counted_when_read])
