"""The compressed branch end to end against the independent exact model (SPEC §8, exact mode).

The daemon serves layers 2 (ratio 4) and 3 (ratio 128) from a checkpoint with their compressors;
tests/reference/dsv4_ref.py and dsv4_ref_compress.py, written from the SPEC alone, compute what it
must answer. Every byte is compared: q_out, attn, lse and topk of a prefill (2,060 tokens at ratio
4, so that the last tokens score 515 entries for their 512) and of the chunks and decode steps after
it, including the steps that emit an entry, and the forward cache_digest (the SWA records, then the
batch's entries in j order, then their index records). Attention is compared on a sample of each
batch's tokens (the first, those around emissions and block edges, the last), the model being slow.
On a backend that does not run the branch the test says so and checks nothing else (test_compressed
covers that case).
"""

import os
import struct
import sys
import tempfile

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 8
MODEL_HEADS = 64
TOPK = 512


def load_models():
    R = h.model().mod
    sys.path.insert(0, os.path.dirname(os.path.abspath(h.REF_PATH)))
    import dsv4_ref_compress as C  # noqa: E402
    return R, C


def sinks(layer):
    return np.linspace(-2.0, 2.0, MODEL_HEADS).astype(np.float32) + np.float32(0.25 * layer)


def write_weights(layers):
    tmp = tempfile.mkdtemp(prefix="dsv4d-cm-")
    path = os.path.join(tmp, "w.safetensors")
    entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS], sinks(l).astype("<f4").tobytes())
               for l in layers]
    entries += [e for l in layers for e in h.compressor_entries(l)]
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))
    return path


def compressor_arrays(R, layer):
    """The layer's compressor weights as the daemon reads them (BF16 widened exactly)."""
    out = {}
    for name, dtype, shape, raw in h.compressor_entries(layer):
        key = name.split(".attn.")[1]
        if dtype == "F32":
            out[key] = np.frombuffer(raw, "<f4").reshape(shape).astype(np.float32)
        else:
            out[key] = R.bf16_to_f32(np.frombuffer(raw, "<u2")).reshape(shape)
    return out


class Sequence:
    """Everything one sequence was sent at one layer, in position order."""

    def __init__(self, layer, p0):
        self.layer, self.p0 = layer, p0
        self.ratio = h.flash_ratio(layer)
        self.pos, self.kv, self.ckv, self.ikv = [], [], [], []

    def add(self, b):
        ex = {n: (dt, sh, raw) for n, dt, sh, raw in b.extra}
        self.pos.append(b.positions())
        self.kv.append(b.kv)
        w = 2048 if self.ratio == 4 else 1024
        self.ckv.append(np.frombuffer(ex["ckv"][2], "<f4").reshape(b.n, w))
        if self.ratio == 4:
            self.ikv.append(np.frombuffer(ex["ikv"][2], "<f4").reshape(b.n, 512))

    def all(self, parts):
        return np.concatenate(parts)


def expected(R, C, seq, b, w, inv, sample):
    """q_out, attn, lse (on the sample), topk and the cache digest the model gives for batch b."""
    pos = b.positions()
    rows = R.rope_rows(inv, pos)
    q_out = R.q_path(b.q, rows)
    allpos = seq.all(seq.pos)
    swa = dict(zip(allpos.tolist(), R.kv_records(seq.all(seq.kv), R.rope_rows(inv, allpos))))
    comp = C.compress_sequence(seq.ratio, seq.all(seq.ckv), allpos, seq.p0, w["compressor.ape"],
                               w["compressor.norm.weight"], inv,
                               ikv=seq.all(seq.ikv) if seq.ratio == 4 else None,
                               i_ape=w.get("indexer.compressor.ape"),
                               i_norm_weight=w.get("indexer.compressor.norm.weight"))
    c_rec, i_rec = comp.by_j()
    ex = {n: (dt, sh, raw) for n, dt, sh, raw in b.extra}
    sel = None
    if seq.ratio == 4:
        iq = np.frombuffer(ex["iq"][2], "<u2").reshape(b.n, 64, 128)
        iw = np.frombuffer(ex["iw"][2], "<f4").reshape(b.n, 64)
        sel = C.indexer_select(iq[sample], iw[sample], pos[sample], seq.p0, i_rec, TOPK, inv)
    attn, lse = C.attention_union(q_out[sample], pos[sample], seq.p0, swa, c_rec, seq.ratio, inv,
                                  sel=sel, sink=sinks(seq.layer)[:HEADS])
    dig = xxhash.xxh3_64()
    for p in pos:
        dig.update(struct.pack("<q", int(p)) + swa[int(p)].tobytes())
    js = comp.emitted_by(pos, seq.ratio)[0]
    for j in js:
        dig.update(struct.pack("<q", int(j)) + c_rec[j].tobytes())
    if seq.ratio == 4:
        for j in js:
            dig.update(struct.pack("<q", int(j)) + i_rec[j].tobytes())
    return q_out, attn, lse, sel, "%016x" % dig.intdigest()


def sample_of(b, ratio):
    pos = b.positions()
    n = b.n
    want = {0, n - 1, n // 2}
    for t in range(n):
        p = int(pos[t])
        if (p + 1) % ratio == 0 or p % 64 in (0, 63) or t >= n - 6:
            want.add(t)
    pick = sorted(want)
    if len(pick) > 24:  # the model is slow: keep the edges and the end
        pick = sorted(set(pick[:8] + pick[-16:]))
    return np.array(pick, dtype=np.int64)


def run_layer(d, R, C, rng, layer, chunks):
    seq = Sequence(layer, 0)
    w = compressor_arrays(R, layer)
    inv = R.inv_freq("yarn")
    start = 0
    outputs = "q,attn,lse,digest" + (",topk" if seq.ratio == 4 else "")
    for i, n in enumerate(chunks):
        b = Batch.random(rng, layer, [Seg("m%d" % layer, start, n, i == 0)], HEADS, outputs=outputs,
                         ratio=seq.ratio)
        seq.add(b)
        r = d.forward_raw(b.body())
        check_eq(r.status, 200, "layer %d batch %d: %r" % (layer, i, r))
        meta, t = h.st_decode(r.body)
        sample = sample_of(b, seq.ratio)
        q_out, attn, lse, sel, digest = expected(R, C, seq, b, w, inv, sample)
        what = "layer %d batch %d (positions %d..%d)" % (layer, i, start, start + n - 1)
        got_q = h.st_array(t, "q_out", "BF16", (n, HEADS, 512))
        check(np.array_equal(got_q, q_out), "%s: q_out" % what)
        got_a = h.st_array(t, "attn", "BF16", (n, HEADS, 512))[sample]
        bad = np.argwhere(got_a != attn)
        check(len(bad) == 0, "%s: attn differs at %d values, first token %d head %d dim %d: "
              "0x%04x, want 0x%04x" % ((what, len(bad)) + tuple(
                  [int(sample[bad[0][0]]), int(bad[0][1]), int(bad[0][2]),
                   int(got_a[tuple(bad[0])]), int(attn[tuple(bad[0])])] if len(bad) else
                  [0, 0, 0, 0, 0])))
        got_l = h.st_array(t, "lse", "F32", (n, HEADS))[sample]
        check(np.array_equal(got_l.view(np.uint32), lse.view(np.uint32)), "%s: lse" % what)
        if sel is not None:
            got_k = h.st_array(t, "topk", "I32", (n, TOPK))[sample]
            check(np.array_equal(got_k, sel), "%s: topk" % what)
        check_eq(meta.get("cache_digest"), digest, "%s: cache_digest" % what)
        start += n
    return start


def test_against_the_model():
    R, C = load_models()
    rng = np.random.default_rng(77)
    with Daemon(h.SMALL + ["--weights", write_weights((0, 1, 2, 3)), "--kv-blocks", "96",
                           "--threads", "2"]) as d:
        layers = d.admin_json("/admin/v1/cache").get("compressed", {}).get("layers", {})
        if "2" not in layers or "3" not in layers:
            print("backend %s does not run the compressed branch: nothing to compare here" %
                  h.BACKEND_NAME)
            return
        # Ratio 4: a prefill past 2,048 positions (scored selections), then decodes to an emission.
        run_layer(d, R, C, rng, 2, [2060, 1, 1, 1, 1, 6])
        # Ratio 128: a prefill with two entries, a chunk emitting the third, and a decode.
        run_layer(d, R, C, rng, 3, [300, 84, 1])


if __name__ == "__main__":
    h.main([test_against_the_model])
