"""Every bad input of SPEC §6 answered with its status and JSON error, and proven to change nothing.

Each scenario runs twice: on daemon A with every step, on a fresh daemon B with only the valid steps.
Most bad requests are the next valid batch with one fault in it; the valid batch follows. After every
bad request A's sequences (GET /v1/sequences) and used blocks must be as before; at the end every valid
step must have given A and B the same q_out, slots and cache_digest bytes, which also equal the
model's, and both daemons must report the same sequences.
"""

import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8


class Good:
    def __init__(self, batch, replay=False):
        self.batch, self.replay = batch, replay


class Bad:
    """A refused request: body bytes (or a Batch), the expected status and code, and an optional check
    of the error object."""

    def __init__(self, what, body, status, code, detail=None, codes=None):
        self.what, self.status, self.code, self.detail = what, status, code, detail
        self.codes = codes  # alternatives where the SPEC allows more than one code
        self.body = body.body() if isinstance(body, Batch) else body


class Delete:
    def __init__(self, seq):
        self.seq = seq


def state(d, names):
    return {n: d.seq(n) for n in names}


def run(d, steps, names, with_bad):
    """Runs the steps on d; returns the list of valid results."""
    out = []
    for st in steps:
        if isinstance(st, Good):
            r = d.forward(st.batch)
            check_eq(r.replayed, "true" if st.replay else None, "replayed of %r" % st.batch)
            out.append(r)
        elif isinstance(st, Delete):
            d.delete_seq(st.seq)
        elif with_bad:
            before = state(d, names)
            used = d.used_blocks()
            resp = d.forward_raw(st.body)
            try:
                if isinstance(st.status, tuple):
                    check(resp.status in st.status, "status %d not in %r (%r)" %
                          (resp.status, st.status, resp.body[:300]))
                    expect_error(resp, resp.status, resp.json()["error"].get("code"))
                    check(resp.json()["error"]["code"] in st.codes, "code %r not in %r" %
                          (resp.json()["error"]["code"], st.codes))
                elif st.codes:
                    check(resp.status == st.status, "status %d" % resp.status)
                    e = resp.json()["error"]
                    check(e.get("code") in st.codes, "code %r not in %r" % (e.get("code"), st.codes))
                    expect_error(resp, st.status, e["code"])
                else:
                    e = expect_error(resp, st.status, st.code)
                if st.detail:
                    st.detail(d, e)
            except h.TestFailure as ex:
                raise h.TestFailure("bad input %r: %s" % (st.what, ex))
            check_eq(state(d, names), before, "sequences after bad input %r" % st.what)
            check_eq(d.used_blocks(), used, "used blocks after bad input %r" % st.what)
    return out


def run_scenario(args, steps, names):
    with Daemon(args, name="A") as a:
        ra = run(a, steps, names, True)
        sa = state(a, names)
        ua = a.used_blocks()
        alloc_failures = h.metric(a.metrics(), "dsv4d_kv_alloc_failures_total")
        with Daemon(args, name="B") as b:
            rb = run(b, steps, names, False)
            sb = state(b, names)
            ub = b.used_blocks()
    goods = [s for s in steps if isinstance(s, Good)]
    for i, (g, x, y) in enumerate(zip(goods, ra, rb)):
        what = "valid step %d %r" % (i, g.batch)
        check(np.array_equal(x.q_out, y.q_out), "%s: q_out differs between A and B" % what)
        check(np.array_equal(x.slots, y.slots), "%s: slots differ between A (%r) and B (%r)" %
              (what, x.slots.tolist(), y.slots.tolist()))
        check_eq(x.cache_digest, y.cache_digest, "%s: cache_digest A vs B" % what)
        if not g.replay:
            h.check_result(x, g.batch, what, bs=64)
    for n in names:
        if sa[n] is not None:
            sa[n].pop("instance")
        if sb[n] is not None:
            sb[n].pop("instance")
    check_eq(sa, sb, "sequences of A and B at the end")
    check_eq(ua, ub, "used blocks of A and B at the end")
    return alloc_failures


def expected_is(pos):
    def chk(d, e):
        check(pos in h.find_values(e, "expected"), "expected position %d in %r" % (pos, e))
    return chk


def with_instance(d, e):
    check_eq(e.get("instance"), d.instance, "instance in the 404")


def tensors_of(b):
    return [("q", "BF16", b.q.shape, b.q.astype("<u2").tobytes()),
            ("kv", "BF16", b.kv.shape, b.kv.astype("<u2").tobytes())]


def header_of(b, meta=None):
    """The header object and data of a valid body for b, to be corrupted."""
    hdr = {"__metadata__": b.metadata() if meta is None else meta}
    ql = b.q.size * 2
    kl = b.kv.size * 2
    hdr["q"] = {"dtype": "BF16", "shape": list(b.q.shape), "data_offsets": [0, ql]}
    hdr["kv"] = {"dtype": "BF16", "shape": list(b.kv.shape), "data_offsets": [ql, ql + kl]}
    return hdr, b.q.astype("<u2").tobytes() + b.kv.astype("<u2").tobytes()


def codec_faults(b):
    """Malformed or inconsistent safetensors bodies built from the valid batch b."""
    good = b.body()
    ql, kl = b.q.size * 2, b.kv.size * 2
    out = []

    def bad(what, body, code="bad_request"):
        out.append(Bad(what, body, 400, code))

    def mod(what, f, data_f=None):
        hdr, data = header_of(b)
        f(hdr)
        bad(what, h.st_encode_raw(hdr, data_f(data) if data_f else data))

    bad("empty body", b"")
    bad("5 bytes", good[:5])
    bad("header cut short", good[:8 + 20])
    bad("data cut short", good[:-100])
    bad("one byte missing", good[:-1])
    bad("trailing bytes", good + b"\0\0")
    bad("header length beyond the body", struct.pack("<Q", len(good)) + good[8:])
    bad("header length 2^63", struct.pack("<Q", 1 << 63) + good[8:])
    bad("header not JSON", struct.pack("<Q", 9) + b"{not json" + good[8:])
    bad("header a JSON array", h.st_encode_raw([1, 2], b""))
    bad("header not UTF-8", struct.pack("<Q", 10) + b'{"\xff\xfe":1}' + good[8:])
    # A header over the 1 MiB limit (valid JSON, padded with spaces) is refused.
    hdr, data = header_of(b)
    hj = json.dumps(hdr).encode() + b" " * (1 << 20)
    bad("header over 1 MiB", struct.pack("<Q", len(hj)) + hj + data)

    def overlap(hdr):
        hdr["kv"]["data_offsets"] = [ql - 2, ql - 2 + kl]
    mod("overlapping data_offsets", overlap, lambda d: d[:-2])

    def out_of_range(hdr):
        hdr["kv"]["data_offsets"] = [ql, ql + kl + 2]
    mod("data_offsets past the end", out_of_range)

    def gap(hdr):
        hdr["kv"]["data_offsets"] = [ql + 2, ql + 2 + kl]
    mod("gap between tensors", gap, lambda d: d[:ql] + b"\0\0" + d[ql:])

    def reversed_(hdr):
        hdr["q"]["data_offsets"] = [ql, 0]
    mod("begin after end", reversed_)

    def same_span(hdr):
        hdr["kv"]["data_offsets"] = [0, kl]
    mod("two tensors on one span", same_span, lambda d: d[:ql])

    def huge_offsets(hdr):
        hdr["kv"]["data_offsets"] = [ql, (1 << 64) - 1]
    mod("offset 2^64-1", huge_offsets)

    def neg_offsets(hdr):
        hdr["kv"]["data_offsets"] = [-2, kl - 2]
    mod("negative offset", neg_offsets)

    def size_mismatch(hdr):
        hdr["q"]["shape"] = [b.n, HEADS, 256]
    mod("size != shape x dtype", size_mismatch)

    def overflow(hdr):
        hdr["q"]["shape"] = [1 << 62, 1 << 62, 512]
    mod("shape product overflows", overflow)

    def neg_dim(hdr):
        hdr["q"]["shape"] = [-b.n, HEADS, 512]
    mod("negative dimension", neg_dim)

    def str_dim(hdr):
        hdr["q"]["shape"] = [str(b.n), HEADS, 512]
    mod("dimension as a string", str_dim)

    def no_offsets(hdr):
        del hdr["kv"]["data_offsets"]
    mod("missing data_offsets", no_offsets)

    def unknown_dtype(hdr):
        hdr["q"]["dtype"] = "X99"
    mod("unknown dtype", unknown_dtype)

    def metadata_number(hdr):
        hdr["__metadata__"]["layer"] = b.layer
    mod("metadata value not a string", metadata_number)
    return out


def tensor_faults(b):
    """Well-formed safetensors with the wrong tensors."""
    meta = b.metadata()
    q = b.q.astype("<u2").tobytes()
    kv = b.kv.astype("<u2").tobytes()
    n = b.n
    out = []

    def bad(what, tensors, m=meta, code="bad_request"):
        out.append(Bad(what, h.st_encode(tensors, m), 400, code))

    qf = h.bf16_to_f32(b.q).astype("<f4").tobytes()
    kvf = h.bf16_to_f32(b.kv).astype("<f4").tobytes()
    bad("q as F32", [("q", "F32", b.q.shape, qf), ("kv", "BF16", b.kv.shape, kv)])
    bad("kv as F32", [("q", "BF16", b.q.shape, q), ("kv", "F32", b.kv.shape, kvf)])
    bad("q as I16", [("q", "I16", b.q.shape, q), ("kv", "BF16", b.kv.shape, kv)])
    bad("kv as U8", [("q", "BF16", b.q.shape, q), ("kv", "U8", (n, 1024), kv)])
    bad("q rank 2", [("q", "BF16", (n, HEADS * 512), q), ("kv", "BF16", b.kv.shape, kv)])
    bad("q rank 4", [("q", "BF16", (n, HEADS, 2, 256), q), ("kv", "BF16", b.kv.shape, kv)])
    bad("q head dim 256", [("q", "BF16", (n, 2 * HEADS, 256), q), ("kv", "BF16", b.kv.shape, kv)])
    bad("kv [N, 256, 2]", [("q", "BF16", b.q.shape, q), ("kv", "BF16", (n, 256, 2), kv)])
    bad("kv [2N, 256]", [("q", "BF16", b.q.shape, q), ("kv", "BF16", (2 * n, 256), kv)])
    bad("kv rows != q rows", [("q", "BF16", b.q.shape, q), ("kv", "BF16", (n - 1, 512), kv[:-1024])])
    half = np.ascontiguousarray(b.q[:, :HEADS // 2]).astype("<u2").tobytes()
    double = np.concatenate([b.q, b.q], axis=1).astype("<u2").tobytes()
    bad("H = heads/2", [("q", "BF16", (n, HEADS // 2, 512), half), ("kv", "BF16", b.kv.shape, kv)])
    bad("H = heads*2", [("q", "BF16", (n, HEADS * 2, 512), double), ("kv", "BF16", b.kv.shape, kv)])
    bad("q [2N, H/2, 512]", [("q", "BF16", (2 * n, HEADS // 2, 512), q),
                             ("kv", "BF16", b.kv.shape, kv)])
    bad("missing kv", [("q", "BF16", b.q.shape, q)])
    bad("missing q", [("kv", "BF16", b.kv.shape, kv)])
    bad("unknown tensor", [("q", "BF16", b.q.shape, q), ("kv", "BF16", b.kv.shape, kv),
                           ("extra", "U8", (4,), b"abcd")])
    bad("no tensors", [])
    bad("no __metadata__", tensors_of(b), m=None)
    return out


def meta_faults(b, served_layers):
    """Valid tensors, bad metadata or segments."""
    out = []
    segs = [s.to_json() for s in b.segs]

    def bad(what, meta, code="bad_request", codes=None, status=400):
        out.append(Bad(what, h.st_encode(tensors_of(b), meta), status, code, codes=codes))

    def m(**kw):
        d = b.metadata()
        for k, v in kw.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v
        return d

    def sj(x):
        return json.dumps(x)

    bad("no layer", m(layer=None))
    bad("layer not decimal", m(layer="zero"))
    bad("layer empty", m(layer=""))
    bad("layer 1.0", m(layer="1.0"))
    bad("layer -1", m(layer="-1"), codes=("bad_request", "unknown_layer"))
    bad("layer 2^64", m(layer="18446744073709551616"), codes=("bad_request", "unknown_layer"))
    bad("unserved layer", m(layer=str(max(served_layers) + 1)), code="unknown_layer")
    bad("layer past the model", m(layer="44"), code="unknown_layer")
    bad("no segments", m(segments=None))
    bad("segments not JSON", m(segments="[{"))
    bad("segments an object", m(segments=sj(segs[0])))
    bad("segments empty", m(segments="[]"))
    for k in ("seq", "start", "len"):
        bad("segment without %s" % k, m(segments=sj([{kk: v for kk, v in segs[0].items() if kk != k}]
                                                     + segs[1:])))
    bad("len as a string", m(segments=sj([dict(segs[0], len=str(segs[0]["len"]))] + segs[1:])))
    bad("start fractional", m(segments=sj([dict(segs[0], start=segs[0]["start"] + 0.5)] + segs[1:])))
    bad("new not a boolean", m(segments=sj([dict(segs[0], new="yes")] + segs[1:])))
    bad("seq a number", m(segments=sj([dict(segs[0], seq=5)] + segs[1:])))
    bad("segment a list", m(segments=sj([[1, 2, 3]] + segs[1:])))
    bad("len 0", m(segments=sj(segs + [{"seq": "zz0", "start": 0, "len": 0, "new": True}])))
    bad("len -1", m(segments=sj(segs[:-1] + [dict(segs[-1], len=-1)])))
    bad("sum len = N + 1", m(segments=sj(segs[:-1] + [dict(segs[-1], len=segs[-1]["len"] + 1)])))
    if segs[-1]["len"] > 1:
        bad("sum len = N - 1", m(segments=sj(segs[:-1] + [dict(segs[-1], len=segs[-1]["len"] - 1)])))
    bad("sum len = N - last", m(segments=sj(segs[:-1])) if len(segs) > 1 else
        m(segments=sj([dict(segs[0], len=1)])))
    for name in ("", ".hidden", "a/b", "a b", "x" * 129, "caf\u00e9"):
        bad("seq name %r" % name[:20], m(segments=sj([dict(segs[0], seq=name)] + segs[1:])))
    bad("outputs unknown item", m(outputs="q,nothing"))
    return out


def value_faults(b):
    """The valid batch with one element out of range (|x| >= 2^59, Inf, NaN)."""
    out = []
    for what, tensor, idx, val in (
            ("NaN in q", "q", (0, 3, 17), h.BF16_NAN),
            ("negative NaN in q", "q", (b.n - 1, HEADS - 1, 511), 0xFFC1),
            ("signalling NaN in kv", "kv", (0, 449), 0x7F81),
            ("+Inf in kv", "kv", (b.n - 1, 0), h.BF16_INF),
            ("-Inf in q", "q", (1, 0, 448), h.BF16_NEG_INF),
            ("2^59 in q", "q", (0, 0, 0), h.BF16_2_59),
            ("-2^59 in kv", "kv", (1, 300), h.BF16_2_59 | 0x8000),
            ("2^100 in kv RoPE dims", "kv", (0, 511), 0x7180),
            ("max finite in q", "q", (1, 5, 5), 0x7F7F)):
        x = b.copy()
        getattr(x, tensor)[idx] = val
        out.append(Bad(what, x, 400, "value_out_of_range"))
    return out


def shifted(b, seq, delta):
    x = b.copy()
    for s in x.segs:
        if s.seq == seq:
            s.start += delta
    return x


def test_malformed_and_invalid_requests():
    rng = np.random.default_rng(31)
    args = h.SMALL
    names = ["a", "b", "c"]
    g1 = Batch.random(rng, 0, [Seg("a", 0, 70, True)], HEADS)
    g2 = Batch.random(rng, 0, [Seg("b", 5, 3, True)], HEADS)
    g3 = Batch.random(rng, 0, [Seg("a", 70, 4), Seg("b", 8, 2)], HEADS)
    g4 = Batch.random(rng, 1, [Seg("b", 5, 3), Seg("a", 0, 6)], HEADS)
    g5 = Batch.random(rng, 0, [Seg("b", 10, 1), Seg("a", 74, 1)], HEADS)
    g6 = Batch.random(rng, 0, [Seg("a", 75, 1), Seg("c", 0, 2, True)], HEADS)
    steps = [Good(g1), Good(g2)]
    steps += codec_faults(g3)
    steps += tensor_faults(g3)
    steps += meta_faults(g3, [0, 1, 2, 3])
    steps += value_faults(g3)
    steps += [Good(g3)]
    # Sequence-state faults against g4 (layer 1 starts at p0 for both sequences).
    steps += [
        Bad("layer 1 not starting at p0", shifted(g4, "a", 1), 409, "position_mismatch",
            expected_is(0)),
        Bad("duplicate sequence", Batch(1, [Seg("b", 5, 3), Seg("b", 8, 6)], g4.q, g4.kv), 400,
            "duplicate_sequence"),
        Bad("unknown sequence", Batch(1, [Seg("b", 5, 3), Seg("nope", 0, 6)], g4.q, g4.kv), 404,
            "unknown_sequence", with_instance),
        Bad("new for an existing sequence off p0", Batch(1, [Seg("b", 5, 3), Seg("a", 1, 6, True)],
                                                         g4.q, g4.kv), 409, "sequence_exists"),
        Bad("new for an existing sequence at its p0", Batch(0, [Seg("b", 5, 3, True)], g4.q[:3],
                                                            g4.kv[:3]), 409, "sequence_exists"),
        Good(g4),
        Good(g4, replay=True),
        # Position faults against g5.
        Bad("position gap", shifted(g5, "a", 1), 409, "position_mismatch", expected_is(74)),
        Bad("position behind", shifted(g5, "b", -1), 409, "position_mismatch", expected_is(10)),
        Bad("position far behind", shifted(g5, "b", -4), 409, "position_mismatch", expected_is(10)),
        Bad("negative start", Batch(0, [Seg("b", -1, 1), Seg("a", 74, 1)], g5.q, g5.kv), 400,
            "position_out_of_range", codes=("position_out_of_range", "bad_request")),
        Bad("replay of an older segment", Batch(0, [Seg("a", 0, 70)], g1.q, g1.kv), 409,
            "position_mismatch", expected_is(74)),
        Bad("stale replay with other bytes", Batch(0, g3.segs, g3.q, g3.kv ^ np.uint16(1)), 409,
            "position_mismatch"),
        Good(g3, replay=True),
        Good(g5),
        # Faults in a batch whose other segment creates a sequence: "c" must not appear.
        Bad("new sequence beside a gap", shifted(g6, "a", 2), 409, "position_mismatch",
            expected_is(75)),
        Bad("new sequence beside NaN", value_faults(g6)[0].body, 400, "value_out_of_range"),
        Bad("new sequence past the last position",
            Batch(0, [Seg("a", 75, 1), Seg("c", h.MAX_POSITION - 1, 2, True)], g6.q, g6.kv), 400,
            "position_out_of_range"),
        Bad("new sequence at the last position + 1",
            Batch(0, [Seg("a", 75, 1), Seg("c", h.MAX_POSITION, 2, True)], g6.q, g6.kv), 400,
            "position_out_of_range"),
        Bad("new sequence on an unserved layer", Batch(7, g6.segs, g6.q, g6.kv), 400,
            "unknown_layer"),
        Bad("new sequence named twice", Batch(0, [Seg("c", 0, 1, True), Seg("c", 1, 2, True)],
                                              g6.q, g6.kv), 400,
            "duplicate_sequence"),
    ]
    # The valid batch: "c" is created only now.
    steps += [Good(g6)]
    g7 = Batch.random(rng, 0, [Seg("c", 2, 3)], HEADS)
    steps += [Bad("wrong H (heads + 1) on c", h.st_encode(
        [("q", "BF16", (3, HEADS + 1, 512), h.random_bf16(rng, (3, HEADS + 1, 512)).tobytes()),
         ("kv", "BF16", (3, 512), g7.kv.tobytes())], g7.metadata()), 400, "bad_request"),
        Good(g7), Delete("b"),
        Bad("deleted sequence", Batch.random(rng, 0, [Seg("b", 11, 1)], HEADS), 404,
            "unknown_sequence", with_instance),
        Good(Batch.random(rng, 0, [Seg("b", 0, 1, True)], HEADS))]
    unknown_meta = Batch.random(rng, 0, [Seg("c", 5, 2)], HEADS)
    body = h.st_encode(tensors_of(unknown_meta), dict(unknown_meta.metadata(), extra_key="x",
                                                      another="{}"))
    run_scenario(args, steps, names)
    # Unknown metadata keys are ignored: checked on its own daemon against the model.
    with Daemon(args) as d:
        d.forward(Batch.random(rng, 0, [Seg("c", 0, 5, True)], HEADS))
        r = d.forward_raw(body)
        check_eq(r.status, 200, "unknown __metadata__ keys are ignored (got %r)" % r)
        h.check_result(h.ForwardResult(r, unknown_meta), unknown_meta, "unknown metadata keys")


def test_new_for_an_existing_sequence_on_a_fresh_layer():
    """SPEC §4: "new": true for an existing sequence is 409 sequence_exists, also on a layer that has
    not written yet and at the sequence's p0 (only an exact replay of the last applied segment may
    carry "new" again)."""
    rng = np.random.default_rng(34)
    g1 = Batch.random(rng, 0, [Seg("a", 4, 10, True)], HEADS)
    g2 = Batch.random(rng, 1, [Seg("a", 4, 10)], HEADS)
    steps = [Good(g1),
             Bad("new at p0 on a layer not yet written", Batch(1, [Seg("a", 4, 10, True)], g2.q, g2.kv),
                 409, "sequence_exists", expected_is(4)),
             Good(g2)]
    run_scenario(h.SMALL, steps, ["a"])


def test_pool_exhausted():
    """--kv-blocks 4 at bs 64: batches needing more blocks than are free are refused whole (503 with
    Retry-After, needed and free) and change nothing."""
    rng = np.random.default_rng(32)
    args = ["--kv-blocks", "4", "--layers", "0-1", "--heads", str(HEADS)]
    names = ["a", "b"]

    def nf(needed, free):
        def chk(d, e):
            check_eq(h.find_values(e, "needed"), [needed], "needed blocks in %r" % e)
            check_eq(h.find_values(e, "free"), [free], "free blocks in %r" % e)
        return chk

    a1 = Batch.random(rng, 0, [Seg("a", 0, 100, True)], HEADS)
    a2 = Batch.random(rng, 0, [Seg("a", 100, 28)], HEADS)
    a2b = Batch.random(rng, 0, [Seg("a", 100, 31)], HEADS)
    b1 = Batch.random(rng, 0, [Seg("b", 0, 128, True)], HEADS)
    steps = [
        Good(a1),
        Bad("new sequence needing 4 of 2", Batch.random(rng, 0, [Seg("b", 0, 200, True)], HEADS),
            503, "kv_pool_exhausted", nf(4, 2)),
        Bad("growth needing 3 of 2", Batch.random(rng, 0, [Seg("a", 100, 200)], HEADS), 503,
            "kv_pool_exhausted", nf(3, 2)),
        Bad("fitting segment beside one needing 3",
            Batch(0, [Seg("a", 100, 28), Seg("b", 0, 150, True)],
                  np.concatenate([a2.q, h.random_bf16(rng, (150, HEADS, 512))]),
                  np.concatenate([a2.kv, h.random_bf16(rng, (150, 512))])), 503,
            "kv_pool_exhausted", nf(3, 2)),
        Good(b1),
        Bad("pool full", a2b, 503, "kv_pool_exhausted", nf(1, 0)),
        Good(a2),
        Good(Batch.random(rng, 1, [Seg("b", 0, 100)], HEADS)),
        Delete("b"),
        Good(Batch(0, [Seg("a", 128, 3)], a2b.q[:3], a2b.kv[:3])),
        Good(Batch.random(rng, 0, [Seg("b", 0, 64, True)], HEADS)),
    ]
    failures = run_scenario(args, steps, names)
    check_eq(failures, 4.0, "dsv4d_kv_alloc_failures_total after four refused batches")


def test_batch_limits():
    """max_batch_tokens 16 and max_segments 2: larger batches are refused whole (400, or 413 when the
    body limit derived from max_batch_tokens catches them first)."""
    rng = np.random.default_rng(33)
    args = h.SMALL + ["--max-batch-tokens", "16", "--max-segments", "2"]
    names = ["a", "b", "c"]
    limit_codes = ("bad_request", "payload_too_large")
    steps = [
        Good(Batch.random(rng, 0, [Seg("a", 0, 16, True)], HEADS)),
        Bad("17 tokens", Batch.random(rng, 0, [Seg("a", 16, 17)], HEADS), (400, 413), None,
            codes=limit_codes),
        Bad("17 tokens in two segments", Batch.random(rng, 0, [Seg("a", 16, 9), Seg("b", 0, 8, True)],
                                                      HEADS), (400, 413), None, codes=limit_codes),
        Bad("3 segments", Batch.random(rng, 0, [Seg("a", 16, 1), Seg("b", 0, 1, True),
                                                Seg("c", 0, 1, True)], HEADS), 400, "bad_request"),
        Good(Batch.random(rng, 0, [Seg("a", 16, 8), Seg("b", 0, 8, True)], HEADS)),
    ]
    run_scenario(args, steps, names)
    # With a body limit set high, the token limit itself answers.
    steps[1] = Bad("17 tokens", steps[1].body, 400, "bad_request")
    steps[2] = Bad("17 tokens in two segments", steps[2].body, 400, "bad_request")
    run_scenario(args + ["--max-body-bytes", "100000000"], steps, names)


if __name__ == "__main__":
    h.main([test_malformed_and_invalid_requests, test_new_for_an_existing_sequence_on_a_fresh_layer,
            test_pool_exhausted, test_batch_limits])
