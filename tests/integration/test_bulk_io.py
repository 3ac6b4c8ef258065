"""Bodies and answers moved by the bulk I/O thread (bulk_io_bytes): a daemon whose thread takes
every body's and answer's rest of 64 KiB or more (its executor writing the first 64 KiB of an
answer, direct_answer_bytes) answers each request with the bytes of a daemon whose loop moves them
all (--bulk-io-bytes 0): q_out, slots, attn, lse, cache_digest, the whole body, over TCP and over
the Unix socket, and a refused batch's error; both end with the same cache and sequences.
dsv4d_bulk_bytes_total counts the first daemon's bytes each way, and the second's stay 0; a daemon
at the default (2 MiB) sends these requests of under 2 MiB through its loop."""

import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402
from test_prefill_chunks import same_state, write_weights  # noqa: E402
from test_unix_socket import UnixHTTPConnection  # noqa: E402

HEADS = 8
NAMES = ["b0", "b1"]


def bulk_bytes(d, direction):
    return h.metric(d.metrics(), "dsv4d_bulk_bytes_total", direction=direction)


def same_answers(a, b, batch, what, conn=None):
    """The batch on both daemons (on b over conn when given): 200 and byte-identical bodies."""
    ra = a.forward(batch).resp.body
    rb = b.forward(batch, conn=conn).resp.body
    check(ra == rb, "%s: the answers differ (%d and %d bytes)" % (what, len(ra), len(rb)))


def test_bulk_same_bytes():
    """Prefills of 96 and 40 tokens (1.1 MiB of q and kv) on layers 0 and 1 with attention,
    decode steps of both over TCP and the Unix socket, and a prefill at a wrong position."""
    rng = np.random.default_rng(17)
    work = tempfile.mkdtemp(prefix="dsv4d-it-bulk-")
    try:
        w = os.path.join(work, "w.safetensors")
        write_weights(w)
        sock = os.path.join(work, "d.sock")
        args = h.SMALL + ["--weights", w]
        with Daemon(args + ["--bulk-io-bytes", "0"], name="loop") as a, \
                Daemon(args + ["--bulk-io-bytes", "65536", "--direct-answer-bytes", "65536",
                               "--listen-unix", sock], name="bulk") as b, \
                Daemon(args, name="default") as c:
            for layer in (0, 1):
                segs = [Seg("b0", 0, 96, layer == 0), Seg("b1", 0, 40, layer == 0)]
                p = Batch.random(rng, layer, segs, HEADS, outputs="q,attn,lse,digest")
                same_answers(a, b, p, "prefill layer %d" % layer)
                c.forward(p)
            moved_in, moved_out = bulk_bytes(b, "in"), bulk_bytes(b, "out")
            # Each prefill's body (136 tokens of q and kv) is over 1 MiB, its answer (q_out, attn)
            # over 2 MiB, of which the executor writes the first 64 KiB itself.
            check(moved_in > 2 * (1 << 20), "bytes in through the thread: %r" % moved_in)
            check(moved_out > 3 * (1 << 20), "bytes out through the thread: %r" % moved_out)
            for d in (a, c):
                for direction in ("in", "out"):
                    check_eq(bulk_bytes(d, direction), 0.0,
                             "%s's bulk bytes %s" % (d.name, direction))
            pos = {"b0": 96, "b1": 40}
            uc = UnixHTTPConnection(sock)
            for step in range(4):
                for layer in (0, 1):
                    segs = [Seg(n, pos[n], 8) for n in NAMES]
                    s = Batch.random(rng, layer, segs, HEADS, outputs="q,attn,lse,digest")
                    same_answers(a, b, s, "step %d layer %d" % (step, layer),
                                 conn=uc if step % 2 else None)
                    c.forward(s)
                for n in NAMES:
                    pos[n] += 8
            uc.close()
            check(bulk_bytes(b, "in") > moved_in, "the steps' bodies went through the thread")
            bad = Batch.random(rng, 0, [Seg("b0", pos["b0"] + 1, 64)], HEADS)
            for d in (a, b):
                expect_error(d.forward_raw(bad.body()), 409, "position_mismatch")
            same_state(a, b, NAMES)
            same_state(a, c, NAMES)
            for d in (a, b, c):
                d.check_log_clean()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    h.main([test_bulk_same_bytes])
