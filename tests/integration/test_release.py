"""Block accounting (SPEC §4 release rule) seen through GET /v1/sequences and /metrics, and DELETE."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 4


class SeqModel:
    """The SPEC §4 block rule for one sequence, written out: blocks are allocated when a layer first
    writes into them and released once, for every served layer L, max(p0, s_L - 127) > (b+1)*bs - 1,
    where s_L is the first position of L's last applied segment (p0 before L's first batch)."""

    def __init__(self, p0, layers, bs):
        self.p0, self.bs = p0, bs
        self.next = {L: p0 for L in layers}
        self.s = {L: p0 for L in layers}

    def apply(self, layer, start, n):
        assert start == self.next[layer]
        self.s[layer] = start
        self.next[layer] = start + n

    def held(self):
        top = max(self.next.values())
        if top == self.p0:
            return 0
        last = (top - 1) // self.bs
        m = min(max(self.p0, s - 127) for s in self.s.values())
        first = max(self.p0 // self.bs, m // self.bs)
        return last - first + 1


def check_seq(d, name, sm, what):
    j = d.seq(name)
    check_eq(j["next"], {str(L): v for L, v in sm.next.items()}, "%s: next" % what)
    check_eq(h.held(j), sm.held(), "%s: blocks held" % what)
    return j


def decode(d, rng, name, sm, layers, steps, bs, limit=None, check_every=1):
    for i in range(steps):
        for L in layers:
            p = sm.next[L]
            d.forward(Batch.random(rng, L, [Seg(name, p, 1)], HEADS, outputs="q"))
            sm.apply(L, p, 1)
        if i % check_every == 0 or i == steps - 1:
            j = check_seq(d, name, sm, "%s after decode to %d" % (name, sm.next[layers[0]]))
            if limit is not None:
                check(h.held(j) <= limit, "%s holds %d blocks, more than %d between one-token steps"
                      % (name, h.held(j), limit))


def test_long_decode_holds_at_most_3_blocks():
    """bs 64: one-token steps from position 0 to 400 on one layer; after each step the sequence holds
    what the rule says, never more than ceil(127/64)+1 = 3, and /metrics counts the same blocks."""
    rng = np.random.default_rng(21)
    with Daemon(["--kv-blocks", "16", "--layers", "0-0", "--heads", str(HEADS)]) as d:
        sm = SeqModel(0, [0], 64)
        d.forward(Batch.random(rng, 0, [Seg("long", 0, 1, True)], HEADS))
        sm.apply(0, 0, 1)
        for i in range(40):
            decode(d, rng, "long", sm, [0], 10, 64, limit=3, check_every=3)
            d.wait_used_blocks(sm.held())
        check_eq(sm.next[0], 401, "decoded to 400")
        check_eq(sm.held(), 3, "model: 3 blocks at position 400")
        # A prefill chunk after the decode: k positions need at most ceil((126+k)/bs)+1 blocks.
        d.forward(Batch.random(rng, 0, [Seg("long", 401, 100)], HEADS))
        sm.apply(0, 401, 100)
        j = check_seq(d, "long", sm, "after a 100-token chunk")
        check(h.held(j) <= -(-(126 + 100) // 64) + 1, "chunk bound")
        d.wait_used_blocks(sm.held())
        check_eq(d.delete_seq("long"), True, "DELETE of the long sequence")
        d.wait_used_blocks(0)


def test_lagging_layer_holds_blocks():
    """Two layers: while layer 1 stays behind, layer 0's decode releases nothing; once layer 1 steps
    forward with one-token segments, the old blocks go."""
    rng = np.random.default_rng(22)
    with Daemon(["--kv-blocks", "16", "--layers", "0-1", "--heads", str(HEADS)]) as d:
        sm = SeqModel(0, [0, 1], 64)
        d.forward(Batch.random(rng, 0, [Seg("lag", 0, 200, True)], HEADS))
        sm.apply(0, 0, 200)
        check_seq(d, "lag", sm, "layer 0 prefilled")
        decode(d, rng, "lag", sm, [0], 100, 64, check_every=10)
        check_eq(sm.held(), 5, "model: 5 blocks while layer 1 lags")
        d.wait_used_blocks(5)
        # Layer 1 catches up in one segment starting at p0: its s_1 stays 0, so nothing is released.
        d.forward(Batch.random(rng, 1, [Seg("lag", 0, 300)], HEADS))
        sm.apply(1, 0, 300)
        check_seq(d, "lag", sm, "layer 1 caught up in one segment")
        d.wait_used_blocks(5)
        # One-token steps on both layers release down to the window.
        decode(d, rng, "lag", sm, [1, 0], 3, 64, limit=3)
        d.wait_used_blocks(3)


def test_block_size_16_and_two_sequences():
    """bs 16: between one-token steps at most ceil(127/16)+1 = 9 blocks per sequence; two interleaved
    sequences add up in /metrics; DELETE frees exactly one sequence's blocks."""
    rng = np.random.default_rng(23)
    with Daemon(["--kv-blocks", "40", "--layers", "2-3", "--heads", str(HEADS),
                 "--block-size", "16"]) as d:
        a = SeqModel(5, [2, 3], 16)
        b = SeqModel(40, [2, 3], 16)
        d.forward(Batch.random(rng, 2, [Seg("a", 5, 30, True), Seg("b", 40, 7, True)], HEADS))
        a.apply(2, 5, 30)
        b.apply(2, 40, 7)
        for L in (3,):
            d.forward(Batch.random(rng, L, [Seg("b", 40, 7), Seg("a", 5, 30)], HEADS))
            a.apply(L, 5, 30)
            b.apply(L, 40, 7)
        check_seq(d, "a", a, "a prefilled")
        check_seq(d, "b", b, "b prefilled")
        d.wait_used_blocks(a.held() + b.held())
        for i in range(200):
            for L in (2, 3):
                segs = [Seg("a", a.next[L], 1), Seg("b", b.next[L], 1)]
                d.forward(Batch.random(rng, L, segs if i % 2 else segs[::-1], HEADS, outputs="q"))
                a.apply(L, a.next[L], 1)
                b.apply(L, b.next[L], 1)
            if i % 20 == 19:
                ja = check_seq(d, "a", a, "a at step %d" % i)
                jb = check_seq(d, "b", b, "b at step %d" % i)
                check(h.held(ja) <= 9 and h.held(jb) <= 9, "at most 9 blocks per sequence at bs 16")
                d.wait_used_blocks(a.held() + b.held())
        check_eq(a.held(), 9, "model: a holds 9 blocks at bs 16")
        ms = d.metrics()
        check_eq(h.metric(ms, "dsv4d_sequences"), 2.0, "dsv4d_sequences")
        check_eq(h.metric(ms, "dsv4d_kv_blocks", pool="swa", state="free"), 40.0 - a.held() - b.held(),
                 "free blocks")
        check_eq(d.delete_seq("a"), True, "DELETE a")
        d.wait_used_blocks(b.held())
        check_eq(d.seq("a"), None, "a after DELETE")
        check_seq(d, "b", b, "b after a's DELETE")
        check_eq(h.metric(d.metrics(), "dsv4d_sequences"), 1.0, "dsv4d_sequences after DELETE")
        check_eq(d.delete_seq("b"), True, "DELETE b")
        d.wait_used_blocks(0)
        check_eq(d.delete_seq("b"), False, "DELETE b again")


if __name__ == "__main__":
    h.main([test_long_decode_holds_at_most_3_blocks, test_lagging_layer_holds_blocks,
            test_block_size_16_and_two_sequences])
