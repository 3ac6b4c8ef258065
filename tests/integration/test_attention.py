"""Attention end to end (SPEC §7, exact mode): POST /v1/forward with outputs attn and lse.

Each answer is checked against the independent binary64 model (tests/reference/dsv4_ref.py), fed with
the records the model itself computes for every position the sequence has seen and the q_out the
daemon returned: attn within one bf16 ulp on at least 99.9 % of elements and every element within
two ulps or the binary32 rounding bound of its sum; lse within its rounding bound. A prefill chunk
attends to its own tokens (inserted by the same batch first), a decode token to itself and the 127
positions before it, never below p0. Also: outputs=attn alone answers without q_out, the metadata
says which mode ran, a replay answers the same bytes, and attn is deterministic across daemons.

Fast mode (on a backend that offers it: cuda on sm_90 and newer): two sequences fed the same bytes,
one in exact and one in fast mode, answer attn within FlashMLA's tolerances of each other (every
value within 1e-3 absolute or 2.01/128 relative, cosine distance at most 5e-6) and lse within the
same bounds; fast mode repeats its own bytes. The same holds on the compressed layers (2: ratio 4, the
window then the indexer's selection; 3: ratio 128, the window then every visible entry), where fast mode
runs over the union of SPEC §8.6. With attention_mode fast every layer runs, and says it ran, fast. A
backend without fast mode refuses it on every layer (test_weights).
"""

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 8
MODEL_HEADS = 64
LAYERS = (0, 1, 2, 3)
F32_EPS = 2.0 ** -24


def sinks_for(layer):
    s = (np.linspace(-3.0, 3.0, MODEL_HEADS) + 0.5 * layer).astype(np.float32)
    if layer == 1:
        s[0], s[1] = np.inf, -np.inf  # +inf zeroes head 0's output; -inf adds nothing to head 1
    return s


def write_weights(path):
    entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                sinks_for(l).astype("<f4").tobytes()) for l in LAYERS]
    entries += [e for l in LAYERS for e in h.compressor_entries(l)]
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))


class History:
    """The records the model computes for each (layer, sequence, position) the daemon was sent."""

    def __init__(self):
        self.recs = {}
        self.p0 = {}

    def add(self, batch):
        m = h.model()
        recs = m.records(batch)
        t = 0
        for s in batch.segs:
            self.p0.setdefault(s.seq, s.start)
            for i in range(s.len):
                self.recs[(batch.layer, s.seq, s.start + i)] = recs[t]
                t += 1


def bf16_ulp_diff(got_bits, ref):
    """|got - ref| in units of the bf16 spacing at ref (binary64 ref, bf16 bits got)."""
    got = h.bf16_to_f32(got_bits).astype(np.float64)
    mag = np.maximum(np.abs(ref), 2.0 ** -133)
    ulp = 2.0 ** (np.floor(np.log2(mag)) - 7)
    return np.abs(got - ref) / ulp


def check_attention(res, batch, hist, what):
    m = h.model()
    mod = m.mod
    _, tens = h.st_decode(res.resp.body)
    attn = h.st_array(tens, "attn", "BF16", (batch.n, HEADS, 512))
    lse = h.st_array(tens, "lse", "F32", (batch.n, HEADS))
    rows = m._rows(batch)
    sinks = sinks_for(batch.layer)[:HEADS]
    within1 = total = 0
    t = 0
    for s in batch.segs:
        for i in range(s.len):
            pos = s.start + i
            cands = mod.attention_candidates(pos, hist.p0[s.seq])
            keys = mod.dequantise_record(np.stack(
                [hist.recs[(batch.layer, s.seq, int(c))] for c in cands])).astype(np.float64)
            out, ref_lse, mag = mod.attention_token(res.q_out[t], keys, rows[t], sinks)
            d = bf16_ulp_diff(attn[t], out)
            # The binary32 sum's rounding bound: n steps of relative error 2^-24 on the magnitudes.
            bound = (mag["acc"] * (mag["nc"] + 8) * F32_EPS) * 4.0
            got = h.bf16_to_f32(attn[t]).astype(np.float64)
            ok = (d <= 2.0) | (np.abs(got - out) <= bound + np.abs(out) * 2.0 ** -8)
            check(ok.all(), "%s: token %d (position %d) head/dim %s: attn %r against %r" %
                  (what, t, pos, np.argwhere(~ok)[:3].tolist(), got[~ok][:3], out[~ok][:3]))
            within1 += int((d <= 1.0).sum())
            total += d.size
            lse_bound = (np.abs(ref_lse) + mag["nc"]) * 16 * F32_EPS
            check((np.abs(lse[t] - ref_lse) <= lse_bound).all(),
                  "%s: token %d lse %r against %r" % (what, t, lse[t][:4], ref_lse[:4]))
            if batch.layer == 1:
                check((attn[t, 0] & 0x7FFF).max() == 0, "%s: a sink of +inf gives zeros" % what)
            t += 1
    return within1, total


def forward_attn(d, batch, hist, what, outputs="q,attn,lse"):
    batch.outputs = outputs
    r = d.forward_raw(batch.body())
    check_eq(r.status, 200, "%s: status (body %r)" % (what, r.body[:300]))
    res = h.ForwardResult(r, batch)
    check_eq(res.meta.get("attention"), "exact", "%s: the mode that ran" % what)
    return res


def test_prefill_and_decode():
    rng = np.random.default_rng(31)
    tmp = tempfile.mkdtemp(prefix="dsv4d-attn-")
    path = os.path.join(tmp, "w.safetensors")
    write_weights(path)
    hist = History()
    within1 = total = 0
    with Daemon(h.SMALL + ["--weights", path]) as d:
        for layer in (0, 1):
            # A prefill longer than the window crossing blocks, and a sequence starting at p0 = 70.
            b = Batch.random(rng, layer, [Seg("a", 0, 150, layer == 0), Seg("b", 70, 9, layer == 0)],
                             HEADS)
            hist.add(b)
            res = forward_attn(d, b, hist, "prefill, layer %d" % layer)
            w, n = check_attention(res, b, hist, "prefill, layer %d" % layer)
            within1, total = within1 + w, total + n
            for step in range(3):
                b = Batch.random(rng, layer, [Seg("a", 150 + step, 1), Seg("b", 79 + step, 1)], HEADS)
                hist.add(b)
                res = forward_attn(d, b, hist, "decode %d, layer %d" % (step, layer))
                w, n = check_attention(res, b, hist, "decode %d, layer %d" % (step, layer))
                within1, total = within1 + w, total + n
            # A replay answers the same attn bytes and moves nothing.
            r2 = d.forward_raw(b.body())
            check_eq(r2.status, 200, "replay status")
            check_eq(h.st_decode(r2.body)[0].get("replayed"), "true", "replayed")
            check_eq(h.st_decode(r2.body)[1]["attn"], h.st_decode(res.resp.body)[1]["attn"],
                     "a replay's attn")
        # outputs=attn alone: no q_out in the answer.
        b = Batch.random(rng, 0, [Seg("c", 0, 2, True)], HEADS)
        b.outputs = "attn"
        r = d.forward_raw(b.body())
        check_eq(r.status, 200, "outputs=attn status")
        _, t = h.st_decode(r.body)
        check_eq(sorted(t), ["attn", "slots"], "outputs=attn answers attn and slots only")
    check(within1 >= 0.999 * total, "%d of %d outputs within one bf16 ulp" % (within1, total))
    print("attn: %d of %d outputs within one bf16 ulp (%.4f %%)" %
          (within1, total, 100.0 * within1 / total))


def test_deterministic_across_daemons():
    rng = np.random.default_rng(32)
    tmp = tempfile.mkdtemp(prefix="dsv4d-attn-")
    path = os.path.join(tmp, "w.safetensors")
    write_weights(path)
    batches = [Batch.random(rng, 0, [Seg("d", 0, 40, True)], HEADS, outputs="attn,lse"),
               Batch.random(rng, 0, [Seg("d", 40, 1)], HEADS, outputs="attn,lse")]
    answers = []
    for run in range(2):
        got = []
        with Daemon(h.SMALL + ["--weights", path, "--threads", str(1 + run)]) as d:
            for b in batches:
                r = d.forward_raw(b.body())
                check_eq(r.status, 200, "run %d status" % run)
                got.append(h.st_decode(r.body)[1])
        answers.append(got)
    for i in range(len(batches)):
        for name in ("attn", "lse"):
            check_eq(answers[0][i][name], answers[1][i][name],
                     "batch %d %s on 1 and 2 threads" % (i, name))


def flashmla_close(got, ref, what):
    """FlashMLA's acceptance test of an output against its reference."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    err = np.abs(got - ref)
    ok = (err <= 1e-3) | (err <= (2.01 / 128) * np.abs(ref))
    check(ok.all(), "%s: %d values out of tolerance, first %r vs %r" %
          (what, int((~ok).sum()), got[~ok][:3], ref[~ok][:3]))
    cos = 1.0 - 2.0 * float((got * ref).sum()) / max(float((got * got + ref * ref).sum()), 1e-300)
    check(cos <= 5e-6, "%s: cosine distance %.3g" % (what, cos))
    return cos


def attn_mode_run(d, b, mode, what):
    b = b.copy()
    b.outputs = "attn,lse"
    meta = b.metadata()
    meta["attention"] = mode
    r = d.forward_raw(b.body(meta))
    check_eq(r.status, 200, "%s: status (body %r)" % (what, r.body[:300]))
    m, t = h.st_decode(r.body)
    check_eq(m.get("attention"), mode, "%s: the mode that ran" % what)
    attn = h.bf16_to_f32(h.st_array(t, "attn", "BF16", (b.n, HEADS, h.HEAD_DIM)))
    return attn, h.st_array(t, "lse", "F32", (b.n, HEADS)).copy(), r.body


def renamed(b, name):
    c = b.copy()
    for s in c.segs:
        s.seq = name
    return c


def fast_vs_exact(d, rng, layer, prefill, worst):
    """A prefill and four decode steps of one layer, fed the same bytes to a sequence in exact and one
    in fast mode: fast within FlashMLA's tolerances of exact, and a replay of the last fast batch
    answering its bytes again. Returns the worst cosine distance met."""
    ratio = h.flash_ratio(layer)
    steps = [Batch.random(rng, layer, [Seg("x", 0, prefill, True)], HEADS, ratio=ratio)]
    steps += [Batch.random(rng, layer, [Seg("x", prefill + i, 1)], HEADS, ratio=ratio)
              for i in range(4)]
    for i, b in enumerate(steps):
        what = "layer %d (ratio %d) step %d" % (layer, ratio, i)
        ea, el, _ = attn_mode_run(d, renamed(b, "e%d" % layer), "exact", what + " exact")
        fa, fl, body = attn_mode_run(d, renamed(b, "f%d" % layer), "fast", what + " fast")
        worst = max(worst, flashmla_close(fa, ea, what + " attn"))
        flashmla_close(fl, el, what + " lse")
    _, _, again = attn_mode_run(d, renamed(steps[-1], "f%d" % layer), "fast", "fast replay")
    check_eq(h.st_decode(again)[1]["attn"], h.st_decode(body)[1]["attn"],
             "layer %d: a replay's attn" % layer)
    return worst


def test_fast_mode():
    if h.BACKEND != "cuda":
        print("fast mode on backend %s: not offered (its refusal: test_weights)" % (h.BACKEND or "cpu"))
        return
    rng = np.random.default_rng(47)
    tmp = tempfile.mkdtemp(prefix="dsv4d-fast-")
    path = os.path.join(tmp, "w.safetensors")
    write_weights(path)
    worst = 0.0
    with Daemon(h.SMALL + ["--weights", path]) as d:
        # SWA-only layers 0 and 1; layer 2 (ratio 4) with 150 positions sees 37 entries and more,
        # layer 3 (ratio 128) with 300 positions sees 2 (the window is 128 positions).
        for layer, prefill in ((0, 150), (1, 150), (2, 150), (3, 300)):
            worst = fast_vs_exact(d, rng, layer, prefill, worst)
    # attention_mode fast: every layer runs fast and says so; a request may still ask for exact.
    with Daemon(h.SMALL + ["--weights", path, "--attention-mode", "fast"]) as d:
        cache = d.admin_json("/admin/v1/cache")["attention"]
        check_eq(cache["mode"], "fast", "configured mode")
        check_eq(cache["ready_layers"], list(LAYERS), "every layer ready in its own mode")
        for layer in LAYERS:
            for asked, ran in ((None, "fast"), ("exact", "exact")):
                b = Batch.random(rng, layer, [Seg("m%d%s" % (layer, asked or "d"), 0, 8, True)], HEADS,
                                 ratio=h.flash_ratio(layer))
                b.outputs = "attn"
                meta = b.metadata()
                if asked:
                    meta["attention"] = asked
                r = d.forward_raw(b.body(meta))
                check_eq(r.status, 200, "layer %d under attention_mode fast, asked %s (body %r)" %
                         (layer, asked, r.body[:300]))
                check_eq(h.st_decode(r.body)[0].get("attention"), ran, "layer %d ran %s" % (layer, ran))
    print("fast mode: worst cosine distance to exact %.3g" % worst)


if __name__ == "__main__":
    h.main([test_prefill_and_decode, test_deterministic_across_daemons, test_fast_mode])
