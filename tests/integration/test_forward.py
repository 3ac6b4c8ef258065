"""POST /v1/forward against the independent model: prefill, decode across block boundaries, interleaved
sequences, replays, extreme values and the SPEC's subnormal test vector."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8
BS = 64


def test_prefill_then_decode_across_blocks():
    """Two sequences, four layers (plain and YaRN): a prefill each, then one-token decode steps that
    cross the 64 and 128 block boundaries, sometimes in one batch, sometimes alone, in changing order."""
    rng = np.random.default_rng(11)
    with Daemon(h.SMALL) as d:
        nxt = {}
        for layer in range(4):
            for seq, p0, n in (("p", 0, 100), ("q", 3, 58)):
                b = Batch.random(rng, layer, [Seg(seq, p0, n, layer == 0)], HEADS)
                h.check_result(d.forward(b), b, "prefill %s layer %d" % (seq, layer), bs=BS)
                nxt[(seq, layer)] = p0 + n
        # q: a chunk of 10 that crosses the first block boundary (61..70).
        for layer in range(4):
            b = Batch.random(rng, layer, [Seg("q", 61, 10)], HEADS)
            h.check_result(d.forward(b), b, "chunk across a boundary, layer %d" % layer, bs=BS)
            nxt[("q", layer)] = 71
        slots_seen = {}
        for step in range(36):
            for layer in range(4):
                order = ["p", "q"] if step % 2 == 0 else ["q", "p"]
                groups = [order] if step % 3 else [[order[0]], [order[1]]]
                for g in groups:
                    segs = [Seg(s, nxt[(s, layer)], 1) for s in g]
                    b = Batch.random(rng, layer, segs, HEADS)
                    res = d.forward(b)
                    h.check_result(res, b, "decode step %d layer %d %s" % (step, layer, g), bs=BS)
                    for s, slot in zip(g, res.slots):
                        # Every layer maps a position to the same slot (shared block ids).
                        key = (s, nxt[(s, layer)])
                        if key in slots_seen:
                            check_eq(int(slot), slots_seen[key], "slot of %r on layer %d" % (key, layer))
                        slots_seen[key] = int(slot)
                        nxt[(s, layer)] += 1
        for s, p0 in (("p", 0), ("q", 3)):
            j = d.seq(s)
            check_eq(j["p0"], p0, "p0 of %s" % s)
            check_eq(j["next"], {str(L): nxt[(s, L)] for L in range(4)}, "next of %s" % s)
        check_eq(nxt[("p", 0)], 136, "p crossed position 128")


def test_spec_subnormal_vector():
    """SPEC §2: head (0x0001, 0x8001, 0x0080, 0, ...) at position 5 of a plain layer gives
    q_out[0..2] = 0x01FA, 0x81FA, 0x057A (subnormals honoured)."""
    with Daemon(h.SMALL) as d:
        q = np.zeros((1, HEADS, 512), np.uint16)
        q[0, :, :3] = [0x0001, 0x8001, 0x0080]
        kv = np.zeros((1, 512), np.uint16)
        kv[0, :3] = [0x0001, 0x8001, 0x0080]
        b = Batch(0, [Seg("sub", 5, 1, True)], q, kv)
        res = d.forward(b)
        check_eq([int(x) for x in res.q_out[0, 0, :3]], [0x01FA, 0x81FA, 0x057A],
                 "q_out[0..2] of the SPEC subnormal vector")
        h.check_result(res, b, "subnormal vector", bs=BS)


def test_extreme_values():
    """Values just below 2^59, subnormals, signed zeros and all-zero tiles are accepted and match."""
    rng = np.random.default_rng(5)
    with Daemon(h.SMALL) as d:
        n = 6
        b = Batch.random(rng, 2, [Seg("x", 0, n, True)], HEADS)
        b.q[0, 0, :] = h.BF16_BELOW_2_59
        b.q[0, 1, ::2] = h.BF16_BELOW_2_59 | 0x8000
        b.q[1, :, :] = 0x8000  # -0.0 everywhere
        b.q[2, :, 100:200] = rng.integers(1, 0x80, size=(HEADS, 100)) | (
            rng.integers(0, 2, size=(HEADS, 100)) << 15)  # subnormals of both signs
        b.kv[0, :] = h.BF16_BELOW_2_59
        b.kv[1, :] = 0x8000
        b.kv[2, :] = 0
        b.kv[3, :448] = rng.integers(1, 0x80, size=448)  # a tile of subnormals only
        b.kv[4, 0::3] = h.BF16_BELOW_2_59 | 0x8000
        b.kv[5, :] = h.f32_to_bf16(np.float32(448.0) * rng.standard_normal(512).astype(np.float32))
        res = d.forward(b)
        h.check_result(res, b, "extreme values", bs=BS)
        # The last admissible positions: max_position_embeddings - 1 on a YaRN and a plain layer.
        for layer in (3, 1):
            b = Batch.random(rng, layer, [Seg("end%d" % layer, h.MAX_POSITION - 70, 70, True)], HEADS)
            h.check_result(d.forward(b), b, "positions up to 2^20 - 1, layer %d" % layer, bs=BS)


def test_replay():
    rng = np.random.default_rng(3)
    with Daemon(h.SMALL) as d:
        b1 = Batch.random(rng, 0, [Seg("r", 0, 10, True)], HEADS)
        r1 = d.forward(b1)
        h.check_result(r1, b1, "first batch", bs=BS)
        used = d.wait_used_blocks(1)
        before = d.seq("r")
        for variant in ("same", "without new"):
            b = b1.copy()
            if variant == "without new":
                b.segs[0].new = False
            r = d.forward(b)
            check_eq(r.replayed, "true", "replayed (%s)" % variant)
            check(np.array_equal(r.q_out, r1.q_out), "replay q_out equals the first answer (%s)" % variant)
            check(np.array_equal(r.slots, r1.slots), "replay slots equal the first answer (%s)" % variant)
            check_eq(d.seq("r"), before, "sequence state after a replay (%s)" % variant)
            d.wait_used_blocks(used)
        # The next segment moves on; a replay of it is recognised; the older one is not a replay any more.
        b2 = Batch.random(rng, 0, [Seg("r", 10, 5)], HEADS)
        r2 = d.forward(b2)
        h.check_result(r2, b2, "second batch", bs=BS)
        check_eq(r2.replayed, None, "replayed on a fresh batch")
        r2b = d.forward(b2)
        check_eq(r2b.replayed, "true", "replay of the second batch")
        check(np.array_equal(r2b.q_out, r2.q_out), "replay of the second batch: q_out")
        e = expect_error(d.forward_raw(b1.body()), 409, "sequence_exists")  # it says "new"
        check(15 in h.find_values(e, "expected"), "expected position 15 in %r" % e)
        b1n = b1.copy()
        b1n.segs[0].new = False
        e = expect_error(d.forward_raw(b1n.body()), 409, "position_mismatch")
        check(15 in h.find_values(e, "expected"), "expected position 15 in %r" % e)
        # Same start and len, other bytes: not a replay.
        b2x = b2.copy()
        b2x.kv[0, 0] ^= 1
        e = expect_error(d.forward_raw(b2x.body()), 409, "position_mismatch")
        check(15 in h.find_values(e, "expected"), "expected position 15 in %r" % e)
        b2y = b2.copy()
        b2y.q[4, 7, 511] ^= 1
        expect_error(d.forward_raw(b2y.body()), 409, "position_mismatch")
        check_eq(d.seq("r")["next"]["0"], 15, "next after refused replays")
        # Replays are per layer: layer 1 starts at p0 and has its own last segment.
        b3 = Batch.random(rng, 1, [Seg("r", 0, 3)], HEADS)
        r3 = d.forward(b3)
        h.check_result(r3, b3, "layer 1", bs=BS)
        check_eq(d.forward(b3).replayed, "true", "replay on layer 1")
        check_eq(d.forward(b2).replayed, "true", "layer 0's last segment is still a replay")
        # A batch of two segments that are both replays is a replay; one fresh segment makes it not one.
        b4 = Batch.random(rng, 0, [Seg("r", 15, 2), Seg("s", 0, 2, True)], HEADS)
        r4 = d.forward(b4)
        h.check_result(r4, b4, "two segments", bs=BS)
        r4b = d.forward(b4)
        check_eq(r4b.replayed, "true", "replay of a two-segment batch")
        check(np.array_equal(r4b.q_out, r4.q_out) and np.array_equal(r4b.slots, r4.slots),
              "two-segment replay outputs")
        mixed = Batch(0, [Seg("r", 15, 2), Seg("s", 2, 1)],
                      np.concatenate([b4.q[:2], random_q(rng, 1)]),
                      np.concatenate([b4.kv[:2], h.random_bf16(rng, (1, 512))]))
        e = expect_error(d.forward_raw(mixed.body()), 409, "position_mismatch")
        check(17 in h.find_values(e, "expected"), "expected position 17 in %r" % e)
        check_eq(d.seq("s")["next"]["0"], 2, "s unchanged by the refused mixed batch")
        check_eq(d.seq("r")["next"]["0"], 17, "r unchanged by the refused mixed batch")


def random_q(rng, n):
    return h.random_bf16(rng, (n, HEADS, 512))


if __name__ == "__main__":
    h.main([test_prefill_then_decode_across_blocks, test_spec_subnormal_vector, test_extreme_values,
            test_replay])
