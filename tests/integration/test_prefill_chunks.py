"""Prefills in chunks (prefill_chunk_tokens): a daemon that runs a prefill's kernels in chunks of 16
tokens answers every request with the bytes of a daemon that never chunks (q_out, slots, attn, lse,
cache_digest, the whole body) and ends with the same cache (pool digests, sequences); the replay of a
whole chunked request is recognised; a chunked request that is refused changes nothing and runs no
chunk; a decode sent while a long prefill runs is answered before that prefill; and a prefill runs
in the longer chunks of prefill_chunk_tokens_alone while no decode has begun since the last chunked
prefill began, and in prefill_chunk_tokens from the first decode that begins during it."""

import os
import shutil
import socket
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8
MODEL_HEADS = 64
CHUNK = 16


def write_weights(path):
    """Attention sinks for layers 0..3 (those SMALL serves); attention runs on 0 and 1."""
    entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                np.linspace(-2.0, 2.0 + l, MODEL_HEADS).astype("<f4").tobytes())
               for l in range(4)]
    entries += [e for l in range(4) for e in h.compressor_entries(l)]
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))


def daemons(work, chunk_b, extra=(), alone=None):
    """Two daemons alike but for prefill_chunk_tokens: 0 (never) and chunk_b, whose chunks without
    decodes are alone tokens long (None: chunk_b, the same chunks)."""
    w = os.path.join(work, "w.safetensors")
    if not os.path.exists(w):
        write_weights(w)
    args = h.SMALL + ["--weights", w] + list(extra)
    return (Daemon(args + ["--prefill-chunk-tokens", "0"], name="whole"),
            Daemon(args + ["--prefill-chunk-tokens", str(chunk_b), "--prefill-chunk-tokens-alone",
                           str(chunk_b if alone is None else alone)], name="chunked"))


def chunks_total(d):
    return h.metric(d.metrics(), "dsv4d_prefill_chunks_total")


def same_body(a, b, batch, what):
    """The batch on both daemons: 200 and byte-identical bodies. Returns b's ForwardResult."""
    ra = a.forward(batch)
    rb = b.forward(batch)
    check(ra.resp.body == rb.resp.body, "%s: the answers differ (%d and %d bytes)" %
          (what, len(ra.resp.body), len(rb.resp.body)))
    return rb


def tensors(res):
    _, t = h.st_decode(res.resp.body)
    return {k: bytes(v[2]) for k, v in t.items()}


def same_state(a, b, names):
    for n in names:
        check_eq(b.seq(n)["next"], a.seq(n)["next"], "next positions of %s" % n)
        check_eq(b.seq(n)["blocks"], a.seq(n)["blocks"], "block ids of %s" % n)
    ca, cb = a.admin_json("/admin/v1/cache"), b.admin_json("/admin/v1/cache")
    check_eq(cb["pool_digests"], ca["pool_digests"], "pool digests")
    check_eq(b.used_blocks(), a.used_blocks(), "used blocks")


def test_chunked_same_bytes():
    """Prefills of 190 tokens (two segments, across block boundaries) in 12 chunks on the attention
    layer 0 and the YaRN layer 2, their replays, and the decode steps after them."""
    rng = np.random.default_rng(81)
    work = tempfile.mkdtemp(prefix="dsv4d-it-chunks-")
    try:
        da, db = daemons(work, CHUNK)
        with da as a, db as b:
            segs = [Seg("a", 0, 150, True), Seg("b", 0, 40, True)]
            b0 = Batch.random(rng, 0, segs, HEADS, outputs="q,attn,lse,digest")
            r0 = same_body(a, b, b0, "layer 0 prefill")
            h.check_result(r0, b0, "the chunked layer 0 prefill", bs=64)
            check(r0.replayed is None, "a first application answered as a replay")
            check_eq(chunks_total(b), float((190 + CHUNK - 1) // CHUNK), "chunks after one prefill")
            check_eq(chunks_total(a), 0.0, "chunks on the daemon that never chunks")
            # Layer 2 with its compressed branch where the daemon runs it (attention and the
            # selection then too; the digest is the branch's, so only q_out is checked against the
            # SWA model here: test_compressed_vs_model checks the rest).
            r2 = h.flash_ratio(2) if "2" in a.admin_json("/admin/v1/cache").get(
                "compressed", {}).get("layers", {}) else 0
            b2 = Batch.random(rng, 2, [Seg("a", 0, 150), Seg("b", 0, 40)], HEADS, ratio=r2,
                              outputs="q,attn,lse,topk,digest" if r2 else "q,digest")
            res2 = same_body(a, b, b2, "layer 2 prefill")
            if r2:
                b2.outputs = "q"
            h.check_result(res2, b2, "layer 2 chunked", bs=64)
            # The whole layer 0 request again: a replay on both, the first answer's tensors.
            rr = same_body(a, b, b0, "layer 0 replay")
            check_eq(rr.replayed, "true", "the replay of a chunked request")
            check_eq(tensors(rr), tensors(r0), "the replay's tensors")
            check_eq(rr.cache_digest, r0.cache_digest, "the replay's cache_digest")
            check_eq(chunks_total(b), float(3 * ((190 + CHUNK - 1) // CHUNK)), "chunks")
            for step in range(3):
                for layer in (0, 2):
                    d = Batch.random(rng, layer, [Seg("a", 150 + step, 1), Seg("b", 40 + step, 1)],
                                     HEADS, outputs="q,attn,digest" if layer == 0 else "q,digest",
                                     ratio=r2 if layer == 2 else 0)
                    same_body(a, b, d, "decode step %d layer %d" % (step, layer))
            # A prefill that fits one chunk and one just past it.
            same_body(a, b, Batch.random(rng, 0, [Seg("c", 0, CHUNK, True)], HEADS), "one chunk")
            same_body(a, b, Batch.random(rng, 0, [Seg("e", 0, CHUNK + 1, True)], HEADS), "two")
            check_eq(chunks_total(b), float(3 * ((190 + CHUNK - 1) // CHUNK) + 2), "chunks")
            same_state(a, b, ["a", "b", "c", "e"])
            ms = b.metrics()
            check(h.metric(ms, "dsv4d_forward_seconds_count", stage="yield", **{"class": "prefill"})
                  == 4, "a yield stage observed per chunked prefill")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_chunked_refusal_changes_nothing():
    """Requests of several chunks refused by validation, by the plan or by the pool run no chunk and
    change nothing: the same valid request then answers the bytes of a daemon that saw no refusal."""
    rng = np.random.default_rng(82)
    work = tempfile.mkdtemp(prefix="dsv4d-it-chunks-")
    try:
        da, db = daemons(work, CHUNK)
        with da as a, db as b:
            first = Batch.random(rng, 0, [Seg("a", 0, 20, True)], HEADS)
            same_body(a, b, first, "the first prefill")
            used0, chunks0 = b.used_blocks(), chunks_total(b)
            good = Batch.random(rng, 0, [Seg("a", 20, 100), Seg("c", 0, 50, True)], HEADS,
                                outputs="q,attn,lse,digest")
            bad = good.copy()
            bad.kv[-1, -1] = h.BF16_2_59  # the last element of the last chunk
            expect_error(b.forward_raw(bad.body()), 400, "value_out_of_range")
            gap = good.copy()
            gap.segs[0].start = 25
            e = expect_error(b.forward_raw(gap.body()), 409, "position_mismatch")
            check_eq(e["segments"][0]["expected"], 20, "the expected position in the 409")
            # More blocks than the pool (64) has: 63 blocks for "big" besides what is held.
            big = Batch.random(rng, 0, [Seg("a", 20, 100), Seg("big", 0, 64 * 63, True)], HEADS)
            expect_error(b.forward_raw(big.body()), 503, "kv_pool_exhausted")
            check_eq(b.seq("a")["next"]["0"], 20, "sequence a after the refusals")
            check(b.seq("c") is None and b.seq("big") is None, "a refused request created a sequence")
            check_eq(b.used_blocks(), used0, "used blocks after the refusals")
            check_eq(chunks_total(b), chunks0, "chunks run by refused requests")
            r = same_body(a, b, good, "the valid request after the refusals")
            h.check_result(r, good, "the valid chunked request", bs=64)
            same_state(a, b, ["a", "c"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_decode_answered_before_prefill():
    """A decode sent while a long chunked prefill runs is answered before the prefill, which then
    answers the bytes of the daemon that never chunks."""
    rng = np.random.default_rng(83)
    work = tempfile.mkdtemp(prefix="dsv4d-it-chunks-")
    try:
        n, alone = 4000, 4 * CHUNK
        da, db = daemons(work, CHUNK, ["--kv-blocks", "160"], alone=alone)
        with da as a, db as b:
            same_body(a, b, Batch.random(rng, 0, [Seg("d", 0, 5, True)], HEADS), "decode's prefill")
            long = Batch.random(rng, 0, [Seg("long", 0, n, True)], HEADS,
                                outputs="q,attn,lse,digest")
            body = long.body()
            got = {}

            def send():
                # A raw socket, so that the moment the answer starts (the prefill's kernels are
                # done) is seen apart from the time its 40 MB take to arrive.
                sock = h.connect(b, timeout=120)
                sock.sendall(h.raw_request("POST", "/v1/forward", body))
                sock.recv(1, socket.MSG_PEEK)
                got["prefill_t"] = time.monotonic()
                got["prefill"], _ = h.read_response(sock, timeout=120)
                sock.close()

            t = threading.Thread(target=send)
            t.start()
            # Wait until the executor runs the prefill: accepted, and no prefill waiting.
            deadline = time.monotonic() + 60
            while True:
                ms = b.metrics()
                running = (h.metric(ms, "dsv4d_inflight_batches") == 1 and
                           h.metric(ms, "dsv4d_queued_batches", **{"class": "prefill"}) == 0)
                if running or "prefill" in got or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            check(running and "prefill" not in got, "the prefill was not seen running")
            dec = Batch.random(rng, 0, [Seg("d", 5, 1)], HEADS, outputs="q,attn,digest")
            rd = b.forward(dec)
            t_dec = time.monotonic()
            t.join(120)
            check("prefill" in got, "the prefill got no answer")
            check(t_dec < got["prefill_t"], "the decode was answered %.3f s after the prefill" %
                  (t_dec - got["prefill_t"]))
            print("the decode was answered %.3f s before the prefill" % (got["prefill_t"] - t_dec))
            check_eq(got["prefill"].status, 200, "the long prefill's status")
            ra = a.forward(long)
            check(got["prefill"].body == ra.resp.body, "the long prefill's answer differs")
            check(a.forward(dec).resp.body == rd.resp.body, "the decode's answer differs")
            # Long chunks until the decode began (during the validation: none), short ones after.
            got_chunks = chunks_total(b)
            check((n + alone - 1) // alone < got_chunks <= (n + CHUNK - 1) // CHUNK,
                  "%d chunks of a %d-token prefill in chunks of %d, then %d after a decode" % (
                      got_chunks, n, alone, CHUNK))
            same_state(a, b, ["d", "long"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_chunks_alone():
    """Prefills of 190 tokens: in chunks of prefill_chunk_tokens_alone (64) on a fresh daemon and
    after another prefill, in chunks of prefill_chunk_tokens (16) after a decode (through the
    executor, or inline on the loop thread for a lone client), the bytes of the daemon that never
    chunks every time."""
    rng = np.random.default_rng(84)
    work = tempfile.mkdtemp(prefix="dsv4d-it-chunks-")
    alone, n = 4 * CHUNK, 190
    long_chunks, short_chunks = (n + alone - 1) // alone, (n + CHUNK - 1) // CHUNK
    try:
        for inline in ("0", "64"):
            da, db = daemons(work, CHUNK, ["--inline-decode-tokens", inline], alone=alone)
            with da as a, db as b:
                def prefill(seq, want, what):
                    before = chunks_total(b)
                    same_body(a, b, Batch.random(rng, 0, [Seg(seq, 0, n, True)], HEADS,
                                                 outputs="q,attn,lse,digest"), what)
                    check_eq(chunks_total(b) - before, float(want),
                             "chunks of the %s (inline_decode_tokens %s)" % (what, inline))

                prefill("p1", long_chunks, "first prefill")
                prefill("p2", long_chunks, "prefill after a prefill")
                same_body(a, b, Batch.random(rng, 0, [Seg("p1", n, 1)], HEADS), "a decode")
                prefill("p3", short_chunks, "prefill after a decode")
                prefill("p4", long_chunks, "prefill after that prefill")
                # A decode the engine refuses began all the same: decode traffic is there.
                bad = Batch.random(rng, 0, [Seg("p1", n + 1, 1)], HEADS)
                bad.q[0, 0, 0] = 0x7F80  # +inf in bf16
                expect_error(b.forward_raw(bad.body()), 400, "value_out_of_range")
                prefill("p5", short_chunks, "prefill after a refused decode")
                same_state(a, b, ["p1", "p2", "p3", "p4", "p5"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_cache_flush():
    """cache_flush_bytes: where the engine stages batches into device memory (the staged test
    backend, cuda), a prefill with more q than the bound has its q and kv flushed from the host's caches
    once, in chunks or whole (with its q half or with attention), and
    dsv4d_cache_flushed_bytes_total grows by their bytes; a prefill at the bound adds nothing. The
    answers are those of a daemon that flushes nothing. On the CPU backend nothing is flushed."""
    rng = np.random.default_rng(84)
    work = tempfile.mkdtemp(prefix="dsv4d-it-flush-")
    try:
        w = os.path.join(work, "w.safetensors")
        write_weights(w)
        row = HEADS * 512 * 2 + 512 * 2  # q and kv bytes a token
        args = h.SMALL + ["--weights", w, "--prefill-chunk-tokens-alone", str(CHUNK)]
        bound = ["--cache-flush-bytes", str(CHUNK * HEADS * 512 * 2)]
        # The backends whose batches the engine stages into device memory (not level_zero's,
        # whose launches read the batch where it lies).
        staged = h.BACKEND_NAME.startswith("cpu_staged") or h.BACKEND_NAME == "cuda"
        with Daemon(args + ["--prefill-chunk-tokens", "0", "--cache-flush-bytes", "0"],
                    name="none") as a, \
                Daemon(args + ["--prefill-chunk-tokens", str(CHUNK)] + bound, name="chunks") as b, \
                Daemon(args + ["--prefill-chunk-tokens", "0"] + bound, name="whole") as c:
            flushed = lambda d: h.metric(d.metrics(), "dsv4d_cache_flushed_bytes_total")
            want = 0.0
            for name, n, outputs in (("f", 150, "q,attn,lse"), ("g", 40, "q"), ("k", CHUNK, "q")):
                batch = Batch.random(rng, 0, [Seg(name, 0, n, True)], HEADS, outputs=outputs)
                ra = a.forward(batch)
                for d in (b, c):
                    rd = d.forward(batch)
                    check(rd.resp.body == ra.resp.body, "%s: %s's answer differs" % (name, d.name))
                want += float(n * row) if staged and n > CHUNK else 0.0
                for d in (b, c):
                    check_eq(flushed(d), want, "bytes %s flushed after prefill %s" % (d.name, name))
            check_eq(flushed(a), 0.0, "bytes flushed with cache_flush_bytes 0")
            same_state(a, b, ["f", "g", "k"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    h.main([test_chunked_same_bytes, test_chunked_refusal_changes_nothing,
            test_decode_answered_before_prefill, test_chunks_alone, test_cache_flush])
