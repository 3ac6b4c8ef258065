"""Exact-mode attention of a C backend (kernel_run mode=attn) against the binary64 model.

Usage: test_attn_vs_ref.py <path of kernel_run> [backend] [isa]

Each case builds sequences in a paged cache with the numpy model's own insert (dsv4_ref.qkv_insert:
records and rotated queries), runs the C attention on that cache, and compares its bf16 outputs and
fp32 lse with dsv4_ref.attention_token, which decodes the records and computes attention in binary64
from SPEC §7's definition. On a compressed layer (SPEC §8.6) a second paged cache holds entries
(records made by the model's KV path from random inputs), and each token's keys are its window's
records, then those of dsv4_ref.compressed_entries: every visible entry, or a selection padded with
-1. The C result carries binary32 roundings, so the comparison is:

- at least 99.9 % of all output elements within 1 bf16 ulp of the binary64 value;
- every element within 2 bf16 ulps, or within the rounding bound of its binary32 computation (the
  outputs that end near zero after cancellation, where a bf16 ulp is far smaller than the error
  that summing larger terms can leave);
- every lse within the rounding bound of its logits, weights and logarithm.

The bound is derived, not tuned: a logit's error is at most gamma * sum |q_i k_i| * scale (each
product passes through at most 21 roundings of the canonical order, plus the scale product), a
weight's relative error at most twice that plus the exponential's ulp, a sum of nc positive terms
at most nc roundings, and so on; see tolerance() below.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_ref as R  # noqa: E402

KERNEL_RUN = sys.argv[1] if len(sys.argv) > 1 else None
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "cpu"
ISA = sys.argv[3] if len(sys.argv) > 3 else "best"

U = 2.0 ** -24  # the unit roundoff of binary32
GAMMA = 24 * U  # 16 fma + 5 fold additions + the scale product, with room to spare
EINVAL = -1


class LevelMissing(Exception):
    pass


class Layer:
    """One layer's paged cache and its sequences, written by the model's insert; with a ratio, its
    compressed cache of c_blocks blocks as well."""

    def __init__(self, rng, bs, n_blocks, rope="plain", ratio=0, c_blocks=0):
        self.rng, self.bs, self.n_blocks, self.rope = rng, bs, n_blocks, rope
        self.cache = np.zeros(n_blocks * R.block_stride(bs), dtype=np.uint8)
        self.free = list(rng.permutation(n_blocks))
        self.seqs = {}
        self.inv = R.inv_freq(rope)
        self.ratio, self.c_n_blocks = ratio, c_blocks
        self.c_cache = np.zeros(c_blocks * R.block_stride(bs), dtype=np.uint8)
        self.c_free = list(rng.permutation(c_blocks))

    def add(self, name, p0, start=None):
        """A sequence from p0 whose first batch starts at start (default p0): the window positions
        below start are never written and read as zero records."""
        self.seqs[name] = {"p0": p0, "next": p0 if start is None else start, "blocks": {},
                           "c_blocks": {}, "c_next": p0 // self.ratio if self.ratio else 0}

    def compressed(self, b, s, last, kv_gen):
        """Segment s's compressed table (every entry its tokens see), and the records of the
        entries not yet emitted, made from kv_gen at RoPE rows r * j (SPEC §8.3)."""
        bs, r = self.bs, self.ratio
        j_lo, j_hi = s["p0"] // r, (last + 1) // r
        b["seg_c_first_lb"].append(j_lo // bs)
        b["seg_cbt_off"].append(len(b["c_block_table"]))
        for lb in range(j_lo // bs, (j_hi - 1) // bs + 1 if j_hi > j_lo else j_lo // bs):
            if lb not in s["c_blocks"]:
                s["c_blocks"][lb] = int(self.c_free.pop())
            b["c_block_table"].append(s["c_blocks"][lb])
        b["seg_cbt_len"].append(len(b["c_block_table"]) - b["seg_cbt_off"][-1])
        js = np.arange(s["c_next"], j_hi, dtype=np.int64)
        if len(js):
            recs = R.kv_records(kv_gen(len(js)), R.rope_rows(self.inv, r * js))
            slots = [s["c_blocks"][j // bs] * bs + j % bs for j in js]
            R.write_records(self.c_cache, recs, slots, bs)
            s["c_next"] = j_hi

    def select(self, b, stride, count):
        """Selection form: token t lists count(t, visible) of its visible entries, a uniform sample
        in increasing order, padded with -1 to stride."""
        sel = np.full((len(b["positions"]), stride), -1, dtype=np.int32)
        for t, pos in enumerate(b["positions"]):
            p0 = self.seqs[b["names"][b["tok_seg"][t]]]["p0"]
            vis = R.compressed_entries(pos, p0, self.ratio)
            k = min(count(t, len(vis)), len(vis), stride)
            sel[t, :k] = np.sort(self.rng.choice(vis, size=k, replace=False))
        b["c_sel"] = sel

    def batch(self, segs, heads, q_gen, kv_gen):
        """segs: [(name, len)]. Inserts the batch and returns the attention launch's arrays."""
        bs = self.bs
        b = {"positions": [], "tok_seg": [], "seg_p0": [], "seg_first_lb": [], "seg_bt_off": [],
             "seg_bt_len": [], "block_table": [], "seg_c_first_lb": [], "seg_cbt_off": [],
             "seg_cbt_len": [], "c_block_table": []}
        for i, (name, n) in enumerate(segs):
            s = self.seqs[name]
            start, last = s["next"], s["next"] + n - 1
            first_lb = max(s["p0"], start - (R.WINDOW - 1)) // bs
            b["seg_p0"].append(s["p0"])
            b["seg_first_lb"].append(first_lb)
            b["seg_bt_off"].append(len(b["block_table"]))
            for lb in range(first_lb, last // bs + 1):
                if lb not in s["blocks"]:
                    s["blocks"][lb] = int(self.free.pop())
                b["block_table"].append(s["blocks"][lb])
            b["seg_bt_len"].append(len(b["block_table"]) - b["seg_bt_off"][-1])
            b["positions"] += list(range(start, last + 1))
            b["tok_seg"] += [i] * n
            s["next"] = last + 1
            if self.ratio:
                self.compressed(b, s, last, kv_gen)
        pos = np.array(b["positions"], dtype=np.int64)
        slots = np.array([self.seqs[segs[t][0]]["blocks"][p // bs] * bs + p % bs
                          for t, p in zip(b["tok_seg"], pos)], dtype=np.int64)
        q = q_gen(len(pos), heads)
        kv = kv_gen(len(pos))
        q_out, _ = R.qkv_insert(q, kv, pos, slots, self.cache, bs, rope=self.rope, inv=self.inv)
        b["q"] = q_out
        b["heads"] = heads
        b["names"] = [name for name, _ in segs]
        return b


def write_inputs(d, layer, b, sink):
    arrays = {"q.bin": (b["q"], "<u2"), "positions.bin": (b["positions"], "<i8"),
              "tok_seg.bin": (b["tok_seg"], "<i4"), "seg_p0.bin": (b["seg_p0"], "<i8"),
              "seg_first_lb.bin": (b["seg_first_lb"], "<i8"),
              "seg_bt_off.bin": (b["seg_bt_off"], "<u4"), "seg_bt_len.bin": (b["seg_bt_len"], "<u4"),
              "block_table.bin": (b["block_table"], "<i4"), "cache_in.bin": (layer.cache, "u1")}
    if sink is not None:
        arrays["sink.bin"] = (sink, "<f4")
    if layer.ratio:
        arrays.update({"c_cache_in.bin": (layer.c_cache, "u1"),
                       "seg_c_first_lb.bin": (b["seg_c_first_lb"], "<i8"),
                       "seg_cbt_off.bin": (b["seg_cbt_off"], "<u4"),
                       "seg_cbt_len.bin": (b["seg_cbt_len"], "<u4"),
                       "c_block_table.bin": (b["c_block_table"], "<i4")})
        if "c_sel" in b:
            arrays["c_sel.bin"] = (b["c_sel"], "<i4")
    for name, (arr, dt) in arrays.items():
        np.ascontiguousarray(np.asarray(arr).astype(dt)).tofile(os.path.join(d, name))
    params = {"mode": "attn", "backend": BACKEND, "isa": ISA, "n_tokens": len(b["positions"]),
              "heads": b["heads"], "n_segments": len(b["seg_p0"]),
              "n_block_table": len(b["block_table"]), "block_size": layer.bs,
              "n_blocks": layer.n_blocks, "rope": layer.rope, "sink": int(sink is not None),
              "lse": 1}
    if layer.ratio:
        params.update({"ratio": layer.ratio, "c_n_blocks": layer.c_n_blocks,
                       "n_c_block_table": len(b["c_block_table"]),
                       "c_sel_stride": b["c_sel"].shape[1] if "c_sel" in b else 0})
    with open(os.path.join(d, "params.txt"), "w") as f:
        for k, v in params.items():
            f.write("%s=%s\n" % (k, v))


def run_c(layer, b, sink):
    """Returns (rc, out [N, H, 512] uint16, lse [N, H] float32) of the C launch."""
    with tempfile.TemporaryDirectory() as d:
        write_inputs(d, layer, b, sink)
        r = subprocess.run([KERNEL_RUN, d], capture_output=True, text=True, timeout=600)
        if r.returncode == 77:
            raise LevelMissing(r.stderr.strip())
        if r.returncode != 0:
            raise RuntimeError("kernel_run failed (%d): %s%s" % (r.returncode, r.stdout, r.stderr))
        with open(os.path.join(d, "rc.txt")) as f:
            rc = int(f.read())
        if rc != 0:
            return rc, None, None
        n, h = len(b["positions"]), b["heads"]
        out = np.fromfile(os.path.join(d, "out.bin"), dtype="<u2").reshape(n, h, 512)
        lse = np.fromfile(os.path.join(d, "lse.bin"), dtype="<f4").reshape(n, h)
        return rc, out, lse


def bf16_ulp(x):
    """The spacing of bf16 numbers at |x| (the subnormal spacing 2^-133 below 2^-126)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.where(a > 0, np.maximum(e, -126.0), -126.0)
    return np.ldexp(1.0, (e - 7).astype(np.int64))


def tolerance(mag, lse_ref):
    """The binary32 rounding bounds of one token's outputs ([H, 512]) and lse ([H])."""
    nc = mag["nc"]
    dl = GAMMA * mag["dot"]  # [H, nc]: error of each logit
    dl_max = dl.max(axis=1)
    # A weight w = e^(l - m): the errors of l and m, the subtraction (|l - m| <= 2 * dot) and the
    # exponential's ulp, as a relative error.
    eps_w = 2 * dl_max + 2 * U * mag["dot"].max(axis=1) + 2 * U
    # N: nc fma roundings and the weights' errors; D: nc additions and the weights'; the division.
    rel = 2 * nc * U + 2 * eps_w + 2 * U
    pre = rel[:, None] * mag["acc"]  # [H, 512] before the rotation
    bound = pre.copy()
    c, s = np.abs(mag["cos"]), np.abs(mag["sin"])
    be, bo = pre[:, R.NOPE_DIM::2], pre[:, R.NOPE_DIM + 1::2]
    ae, ao = mag["acc"][:, R.NOPE_DIM::2], mag["acc"][:, R.NOPE_DIM + 1::2]
    # The rotation: both inputs' errors, the inner product's rounding and the fma's.
    bound[:, R.NOPE_DIM::2] = be * c + bo * s + U * (ao * s + ae * c + ao * s)
    bound[:, R.NOPE_DIM + 1::2] = be * s + bo * c + U * (ao * c + ae * s + ao * c)
    lse_tol = 2 * dl_max + eps_w + (2 * nc + 4) * U + 2 * U * np.abs(lse_ref)
    return bound, lse_tol


class Stats:
    def __init__(self):
        self.elements = 0
        self.within1 = 0
        self.max_ulp = 0.0
        self.beyond2 = 0
        self.worst_bound_ratio = 0.0
        self.lse_worst_ratio = 0.0
        self.failures = []


def compare(layer, b, sink, stats, label):
    rc, out, lse = run_c(layer, b, sink)
    if rc != 0:
        stats.failures.append("%s: attention returned %d" % (label, rc))
        return
    rows = R.rope_rows(layer.inv, np.array(b["positions"], dtype=np.int64))
    for t, pos in enumerate(b["positions"]):
        s = b["tok_seg"][t]
        seq = layer.seqs[b["names"][s]]
        cand = R.attention_candidates(pos, seq["p0"])
        slots = [seq["blocks"][p // layer.bs] * layer.bs + p % layer.bs for p in cand]
        keys = R.attention_keys(layer.cache, layer.bs, slots)
        if layer.ratio:
            ents = R.compressed_entries(pos, seq["p0"], layer.ratio,
                                        b["c_sel"][t] if "c_sel" in b else None)
            c_slots = [seq["c_blocks"][j // layer.bs] * layer.bs + j % layer.bs for j in ents]
            if c_slots:
                keys = np.concatenate([keys, R.attention_keys(layer.c_cache, layer.bs, c_slots)])
        ref, lse_ref, mag = R.attention_token(b["q"][t], keys, rows[t], sink)
        got = R.bf16_to_f32(out[t]).astype(np.float64)
        err = np.abs(got - ref)
        ulps = err / bf16_ulp(ref)
        bound, lse_tol = tolerance(mag, lse_ref)
        # C's value was rounded once more, to bf16: half an ulp at the larger of the two.
        room = bound + 0.5 * bf16_ulp(np.maximum(np.abs(got), np.abs(ref)))
        stats.elements += ulps.size
        stats.within1 += int(np.count_nonzero(ulps <= 1.0))
        stats.max_ulp = max(stats.max_ulp, float(ulps.max()))
        far = ulps > 2.0
        stats.beyond2 += int(np.count_nonzero(far))
        if np.any(far):
            ratio = float((err[far] / room[far]).max())
            stats.worst_bound_ratio = max(stats.worst_bound_ratio, ratio)
            bad = np.argwhere(far & (err > room))
            if len(bad):
                h, d = bad[0]
                stats.failures.append(
                    "%s: token %d (position %d) head %d dim %d: C %r, binary64 %r (%.1f ulps, bound "
                    "%.3g)" % (label, t, pos, h, d, got[h, d], ref[h, d], ulps[h, d], room[h, d]))
        lerr = np.abs(lse[t].astype(np.float64) - lse_ref)
        stats.lse_worst_ratio = max(stats.lse_worst_ratio, float((lerr / lse_tol).max()))
        if np.any(lerr > lse_tol):
            h = int(np.argmax(lerr / lse_tol))
            stats.failures.append("%s: token %d head %d: lse C %r, binary64 %r (tolerance %.3g)"
                                  % (label, t, h, lse[t, h], lse_ref[h], lse_tol[h]))


# ---- inputs ----

def q_normal(rng):
    return lambda n, h: R.f32_to_bf16(rng.standard_normal((n, h, 512)).astype(np.float32))


def q_peaked(rng):
    """Queries along a few directions: sharp softmax distributions."""
    def gen(n, h):
        x = rng.standard_normal((n, h, 512)).astype(np.float32) * 0.05
        x[..., rng.integers(0, 512, size=4)] += 8.0
        return R.f32_to_bf16(x)
    return gen


def q_zero(n, h):
    return np.zeros((n, h, 512), dtype=np.uint16)


def kv_normal(rng, scale=1.0):
    return lambda n: R.f32_to_bf16((rng.standard_normal((n, 512)) * scale).astype(np.float32))


def kv_mixed(rng):
    """Per 64-wide tile a regime: normal at a random scale, tiny (below the 1e-4 amax floor), near
    the 2^59 input bound, or zero."""
    def gen(n):
        x = rng.standard_normal((n, 512))
        for t in range(n):
            for j in range(8):
                r = rng.integers(0, 4)
                sl = slice(64 * j, 64 * j + 64)
                if r == 0:
                    x[t, sl] *= 2.0 ** rng.integers(-20, 21)
                elif r == 1:
                    x[t, sl] *= 2.0 ** rng.integers(-140, -16)
                elif r == 2:
                    x[t, sl] = np.sign(x[t, sl]) * 2.0 ** 58 * (1 + rng.random(64) * 0.99)
                else:
                    x[t, sl] = 0.0
        return R.f32_to_bf16(x.astype(np.float32))
    return gen


def cases(rng):
    """(label, layer, list of (batch segments, heads, q, kv, sink))."""
    out = []
    # One sequence: a prefill longer than the window, then decode steps (block size 64).
    L = Layer(rng, 64, 16)
    L.add("a", 0)
    steps = [([("a", 200)], 8, q_normal(rng), kv_normal(rng), None)]
    steps += [([("a", 1)], 8, q_normal(rng), kv_normal(rng), None) for _ in range(3)]
    out.append(("prefill+decode bs64", L, steps))
    # p0 inside a block, block size 16 (nine blocks per window), finite sinks, peaked queries.
    L = Layer(rng, 16, 64)
    L.add("b", 1007)
    sink = (rng.standard_normal(8) * 4).astype(np.float32)
    steps = [([("b", 150)], 8, q_peaked(rng), kv_normal(rng, 3.0), sink),
             ([("b", 2)], 8, q_peaked(rng), kv_normal(rng, 3.0), sink)]
    out.append(("p0 > 0, bs16, sinks", L, steps))
    # Several sequences in one batch, 64 heads, sinks with +-inf, mixed-regime keys, YaRN table.
    L = Layer(rng, 32, 64, rope="yarn")
    for name, p0 in (("c", 0), ("d", 300), ("e", 5)):
        L.add(name, p0)
    sink = (rng.standard_normal(64) * 2).astype(np.float32)
    sink[3], sink[9] = np.inf, -np.inf
    steps = [([("c", 130), ("d", 20)], 64, q_normal(rng), kv_mixed(rng), sink),
             ([("c", 1), ("d", 40), ("e", 3)], 64, q_normal(rng), kv_mixed(rng), sink)]
    out.append(("mixed batch, 64 heads, yarn", L, steps))
    # Equal scores (zero queries) and 128 heads.
    L = Layer(rng, 64, 8)
    L.add("f", 0)
    steps = [([("f", 140)], 4, q_zero, kv_normal(rng), None),
             ([("f", 2)], 128, q_normal(rng), kv_normal(rng, 0.25), None)]
    out.append(("equal scores, 128 heads", L, steps))
    # Compressed entries (SPEC §8.6), ratio 128 in range form, block size 16 (entries across blocks):
    # a sequence from p0 = 1000 (entries from 7) whose prefill ends on an emission (position
    # 128 * 45 - 1 sees entry 44, which it emits), and one from 0; finite sinks.
    L = Layer(rng, 16, 64, rope="yarn", ratio=128, c_blocks=16)
    L.add("u", 1000, start=128 * 45 - 130)
    L.add("v", 0, start=128 * 20 - 1)
    sink = (rng.standard_normal(8) * 3).astype(np.float32)
    steps = [([("u", 130), ("v", 3)], 8, q_normal(rng), kv_normal(rng), sink),
             ([("u", 1), ("v", 1)], 8, q_peaked(rng), kv_normal(rng), sink)]
    out.append(("ratio 128 range, p0 > 0, bs16", L, steps))
    # Ratio 4 selections of stride 600 (longer than V4-Flash's 512): a full row, an empty one, one
    # entry, lists across tile boundaries; 16 heads, mixed-regime keys; then every visible entry.
    L = Layer(rng, 64, 32, rope="yarn", ratio=4, c_blocks=32)
    L.add("w", 0, start=2399)
    L.add("x", 37, start=900)
    counts = [600, 0, 1, 129, 256, 77, 500]
    sink = (rng.standard_normal(16) * 2).astype(np.float32)
    steps = [([("w", 5), ("x", 2)], 16, q_normal(rng), kv_mixed(rng), sink,
              {"sel": (600, lambda t, vis: counts[t % len(counts)])}),
             ([("w", 1), ("x", 1)], 16, q_normal(rng), kv_normal(rng), sink,
              {"sel": (600, lambda t, vis: vis)})]
    out.append(("ratio 4 selections, stride 600", L, steps))
    # The longest list: the 8192 entries a ratio-128 token sees at the largest position (a batch
    # that fills the window first, not compared).
    L = Layer(rng, 64, 8, rope="yarn", ratio=128, c_blocks=130)
    L.add("y", 0, start=R.MAX_POSITION - 128)
    steps = [([("y", 126)], 4, q_normal(rng), kv_normal(rng), None, {"check": False}),
             ([("y", 2)], 4, q_normal(rng), kv_normal(rng, 2.0), sink[:4])]
    out.append(("ratio 128, 8192 entries", L, steps))
    return out


def refusals(rng, stats):
    """Launches refused before anything is read or written: a window block missing from the table,
    a compressed block missing, a selected entry not yet visible."""
    layer = Layer(rng, 64, 8)
    layer.add("g", 0)
    b = layer.batch([("g", 70)], 8, q_normal(rng), kv_normal(rng))
    b["block_table"][0] = -1
    checks = [("missing block", layer, b)]
    layer = Layer(rng, 64, 8, ratio=4, c_blocks=4)
    layer.add("z", 0, start=100)
    b = layer.batch([("z", 2)], 8, q_normal(rng), kv_normal(rng))
    b["c_block_table"][0] = -1
    checks.append(("missing compressed block", layer, b))
    b = dict(b, c_block_table=list(b["c_block_table"]))
    b["c_block_table"][0] = layer.seqs["z"]["c_blocks"][0]
    layer.select(b, 8, lambda t, vis: 3)
    b["c_sel"][0, 2] = (b["positions"][0] + 1) // 4  # emitted by a later position
    checks.append(("entry not yet visible", layer, b))
    for label, layer, b in checks:
        rc, _, _ = run_c(layer, b, None)
        if rc != EINVAL:
            stats.failures.append("%s: attention returned %d, expected %d" % (label, rc, EINVAL))


def main():
    if not KERNEL_RUN:
        print(__doc__)
        return 2
    rng = np.random.default_rng(20240611)
    stats = Stats()
    try:
        for label, layer, steps in cases(rng):
            for k, step in enumerate(steps):
                segs, heads, qg, kvg, sink = step[:5]
                extra = step[5] if len(step) > 5 else {}
                b = layer.batch(segs, heads, qg, kvg)
                if "sel" in extra:
                    layer.select(b, *extra["sel"])
                if extra.get("check", True):
                    compare(layer, b, sink, stats, "%s, batch %d" % (label, k))
            print("ok   %s" % label if not stats.failures else "...  %s" % label)
        refusals(rng, stats)
    except LevelMissing as e:
        print("skipped: %s" % e)
        return 77
    frac = stats.within1 / stats.elements
    print("%d elements: %.4f %% within 1 bf16 ulp of binary64, max %.2f ulps, %d beyond 2 ulps "
          "(largest error / rounding bound among them %.3f); lse: largest error / tolerance %.3f"
          % (stats.elements, 100 * frac, stats.max_ulp, stats.beyond2, stats.worst_bound_ratio,
             stats.lse_worst_ratio))
    if frac < 0.999:
        stats.failures.append("only %.4f %% of the elements within 1 ulp (need 99.9 %%)"
                              % (100 * frac))
    for f in stats.failures[:20]:
        print("FAIL " + f)
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
