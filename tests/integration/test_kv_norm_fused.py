"""kv_norm = fused end to end (SPEC §2.2): the daemon loads per-layer kv_norm weights from a safetensors
file and every record it writes equals the reference model's with those weights.

The weights file mixes the two accepted names (layers.L.attn.kv_norm.weight, layers.L.kv_norm.weight)
and dtypes (BF16, F32), with a 1-byte tensor first so the weights sit at odd offsets. q_out does not
depend on kv_norm; the cache does, so cache_digest is compared with the model's digest of records
normalised with the layer's own weights (and checked to differ from the prenormed records). Files the
daemon must refuse (a layer missing, a wrong shape or dtype, a non-finite or too large weight) make it
exit with status 2 before it listens.
"""

import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 8
BS = 64
LAYERS = (0, 1, 2, 3)


def weights_for(layer, rng):
    """Weights with a wide spread, some exact values and signs, all finite and < 2^32."""
    w = (rng.standard_normal(512) * 2.0).astype(np.float32)
    w[::17] = 1.0
    w[5] = 0.0
    w[6] = -3.5
    w[448 + layer] = 1e-3  # a RoPE dim too
    return w


def write_weights(path, entries):
    """entries: list of (name, dtype, shape, raw bytes); a 1-byte U8 tensor leads them."""
    tensors = [("lead", "U8", [1], b"\x07")] + entries
    with open(path, "wb") as f:
        f.write(h.st_encode(tensors, {"format": "pt"}))


def layer_entries(ws, skip=None):
    out = []
    for layer, w in ws.items():
        if layer == skip:
            continue
        if layer % 2 == 0:
            bits = h.f32_to_bf16(w)
            out.append(("layers.%d.attn.kv_norm.weight" % layer, "BF16", [512],
                        bits.astype("<u2").tobytes()))
        else:
            out.append(("layers.%d.kv_norm.weight" % layer, "F32", [512], w.astype("<f4").tobytes()))
    return out


def effective(ws):
    """The fp32 weights the daemon uses: BF16 entries are rounded to bf16."""
    return {l: (h.bf16_to_f32(h.f32_to_bf16(w)) if l % 2 == 0 else w) for l, w in ws.items()}


def expected_digest(batch, w):
    m = h.model()
    recs = m.mod.kv_records(batch.kv, m._rows(batch), w)
    return m.mod.records_digest(batch.positions(), recs)


def check_fused(res, batch, w, what):
    m = h.model()
    check(np.array_equal(res.q_out, m.q_out(batch)), "%s: q_out equals the model's" % what)
    want = expected_digest(batch, w)
    check_eq(res.cache_digest, want, "%s: cache_digest with the layer's kv_norm weights" % what)
    check(want != m.cache_digest(batch), "%s: the weights change the records" % what)
    h.check_slots(res.slots, batch, BS, what)


def test_fused_matches_model():
    rng = np.random.default_rng(21)
    ws = {l: weights_for(l, rng) for l in LAYERS}
    tmp = tempfile.mkdtemp(prefix="dsv4d-kvw-")
    path = os.path.join(tmp, "kv_norm.safetensors")
    write_weights(path, layer_entries(ws))
    eff = effective(ws)
    with Daemon(h.SMALL + ["--kv-norm", "fused", "--kv-norm-weights", path]) as d:
        for layer in LAYERS:
            # Prefill across a block boundary for two sequences, then two decode steps.
            b = Batch.random(rng, layer, [Seg("a", 0, 70, layer == 0), Seg("b", 3, 5, layer == 0)],
                             HEADS)
            check_fused(d.forward(b), b, eff[layer], "prefill, layer %d" % layer)
            for step in range(2):
                b = Batch.random(rng, layer, [Seg("a", 70 + step, 1), Seg("b", 8 + step, 1)], HEADS)
                check_fused(d.forward(b), b, eff[layer], "decode %d, layer %d" % (step, layer))
        # Values at the edges: a zero vector, -0.0, subnormals and values just below 2^59.
        b = Batch.random(rng, 1, [Seg("edge", 0, 4, True)], HEADS)
        b.kv[0, :] = 0
        b.kv[1, :] = 0x8000
        b.kv[2, :] = rng.integers(1, 0x80, size=512)
        b.kv[3, :] = h.BF16_BELOW_2_59
        res = d.forward(b)
        check(np.array_equal(res.q_out, h.model().q_out(b)), "edge values: q_out")
        check_eq(res.cache_digest, expected_digest(b, eff[1]), "edge values: cache_digest")


def run_refused(args, what):
    """The daemon must exit with status 2 before listening, saying why."""
    cmd = [h.DAEMON, "--host", "127.0.0.1", "--port", "0", "--admin-port", "0"] + h.SMALL + args
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=60)
    err = p.stderr.decode("utf-8", "replace")
    check_eq(p.returncode, 2, "%s: exit status (log %r)" % (what, err[-500:]))
    check("listening" not in err, "%s: the daemon must not listen" % what)
    check("kv_norm" in err, "%s: the log says why (%r)" % (what, err[-500:]))
    bad = [ln for ln in err.splitlines() if "runtime error:" in ln or "Sanitizer" in ln]
    check(not bad, "%s: sanitizer report: %s" % (what, bad[:3]))


def test_bad_weight_files():
    rng = np.random.default_rng(22)
    ws = {l: weights_for(l, rng) for l in LAYERS}
    tmp = tempfile.mkdtemp(prefix="dsv4d-kvw-")
    cases = []
    cases.append(("layer 2 missing", layer_entries(ws, skip=2)))
    e = layer_entries(ws)
    e[1] = ("layers.1.kv_norm.weight", "F32", [256], ws[1][:256].astype("<f4").tobytes())
    cases.append(("wrong shape", e))
    e = layer_entries(ws)
    e[0] = ("layers.0.attn.kv_norm.weight", "I32", [512], np.zeros(512, "<i4").tobytes())
    cases.append(("wrong dtype", e))
    for bad_value, name in ((np.float32("nan"), "NaN"), (np.float32("inf"), "Inf"),
                            (np.float32(2.0**32), "2^32")):
        w = ws[3].copy()
        w[500] = bad_value
        e = layer_entries(ws)
        e[3] = ("layers.3.kv_norm.weight", "F32", [512], w.astype("<f4").tobytes())
        cases.append(("weight %s" % name, e))
    for i, (what, entries) in enumerate(cases):
        path = os.path.join(tmp, "w%d.safetensors" % i)
        write_weights(path, entries)
        run_refused(["--kv-norm", "fused", "--kv-norm-weights", path], what)
    # Not a safetensors file at all.
    path = os.path.join(tmp, "garbage")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 1 << 40) + b"{}")
    run_refused(["--kv-norm", "fused", "--kv-norm-weights", path], "garbage file")
    # A directory (fopen succeeds on one; its "size" is not a file's).
    run_refused(["--kv-norm", "fused", "--kv-norm-weights", tmp], "a directory")


if __name__ == "__main__":
    h.main([test_fused_matches_model, test_bad_weight_files])
