"""A small decode batch run on the event loop's thread (inline_decode_tokens): a daemon that runs
each decode of at most two tokens there, when its executor is idle and its client alone, answers
every request with the bytes of a daemon that always queues it (--inline-decode-tokens 0): q_out,
slots, attn, lse, cache_digest, the whole body, and a refused step's error; both end with the same
cache and sequences; the first counts those decodes in dsv4d_inline_batches_total (a three-token
decode, a prefill, a decode while a second connection is open and the second daemon's batches are
never counted), and its stage metrics still see every decode."""

import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402
from test_prefill_chunks import same_state, write_weights  # noqa: E402

HEADS = 8
INLINE = 2  # the inline daemon's inline_decode_tokens
STEPS = 9
NAMES = ["i0", "i1", "i2"]


def inline_total(d):
    return h.metric(d.metrics(), "dsv4d_inline_batches_total")


def same_body(a, b, conn, batch, what):
    """The batch on both daemons, on b over conn (its one connection): 200 and byte-identical
    bodies. Returns b's ForwardResult."""
    ra = a.forward(batch)
    rb = b.forward(batch, conn=conn)
    check(ra.resp.body == rb.resp.body, "%s: the answers differ (%d and %d bytes)" %
          (what, len(ra.resp.body), len(rb.resp.body)))
    return rb


def test_inline_same_bytes():
    """Prefills of three sequences on layers 0 and 1, then decode steps of one, two and three of
    them in turn on both layers, with attention; a decode at a wrong position on both daemons."""
    rng = np.random.default_rng(91)
    work = tempfile.mkdtemp(prefix="dsv4d-it-inline-")
    try:
        w = os.path.join(work, "w.safetensors")
        write_weights(w)
        args = h.SMALL + ["--weights", w]
        with Daemon(args + ["--inline-decode-tokens", "0"], name="queued") as a, \
                Daemon(args + ["--inline-decode-tokens", str(INLINE)], name="inline") as b:
            c = b.conn()
            pos = {n: 40 for n in NAMES}
            for layer in (0, 1):
                segs = [Seg(n, 0, 40, layer == 0) for n in NAMES]
                p = Batch.random(rng, layer, segs, HEADS, outputs="q,attn,lse,digest")
                res = same_body(a, b, c, p, "prefill layer %d" % layer)
                h.check_result(res, p, "prefill", bs=64)
            check_eq(inline_total(b), 0.0, "inline batches after the prefills")
            small = 0
            for step in range(STEPS):
                k = 1 + step % 3  # one, two, three sequences: three is past INLINE
                for layer in (0, 1):
                    segs = [Seg(n, pos[n], 1) for n in NAMES[:k]]
                    d = Batch.random(rng, layer, segs, HEADS, outputs="q,attn,lse,digest")
                    res = same_body(a, b, c, d, "decode %d layer %d (%d tokens)" % (step, layer, k))
                    h.check_result(res, d, "inline decode", bs=64)
                    small += k <= INLINE
                for n in NAMES[:k]:
                    pos[n] += 1
            # Each small decode found the executor idle (the client waits for every answer), but
            # for one the once-a-second expiry sweep may have held.
            c.close()
            got = inline_total(b)
            check(small - 1 <= got <= small, "inline batches %r, expected %d (or one fewer)" %
                  (got, small))
            check_eq(inline_total(a), 0.0, "inline batches of the daemon that always queues")
            ms = b.metrics()
            queued = h.metric(ms, "dsv4d_forward_seconds_count", stage="queue",
                              **{"class": "decode"})
            check_eq(queued, float(2 * STEPS), "decode batches with a queue stage observed")
            # A second connection open: the decode is queued.
            other = b.conn()
            other.connect()
            time.sleep(0.2)  # the daemon has accepted it
            d = Batch.random(rng, 1, [Seg("i1", pos["i1"], 1)], HEADS, outputs="q,digest")
            h.check_result(same_body(a, b, None, d, "a decode beside a second connection"), d,
                           "queued decode", bs=64)
            check_eq(inline_total(b), got, "inline batches after a decode beside another client")
            other.close()
            time.sleep(0.2)  # the daemon has closed it
            got = inline_total(b)
            # A refused decode (the wrong position), run inline on one and queued on the other.
            bad = Batch.random(rng, 0, [Seg("i0", pos["i0"] + 3, 1)], HEADS, outputs="q,attn")
            ea = expect_error(a.forward_raw(bad.body()), 409, "position_mismatch")
            time.sleep(0.2)  # the metrics' connection closed: the client is alone again
            eb = expect_error(b.forward_raw(bad.body()), 409, "position_mismatch")
            check_eq(inline_total(b), got + 1, "the refused decode ran inline")
            check_eq(eb.get("segments"), ea.get("segments"), "the refusal's expected positions")
            check(pos["i0"] in h.find_values(eb, "expected"), "expected position in %r" % eb)
            same_state(a, b, NAMES)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    h.main([test_inline_same_bytes])
