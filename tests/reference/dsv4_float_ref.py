"""A float reference of DeepSeek V4's compressed-KV attention, written from the public model code.

This file does not derive from SPEC.md or from dsv4d's C: it re-expresses, in numpy, what the public
DeepSeek V4 inference code computes for one attention layer after the matmuls whose results the
gateway sends (SPEC §8.2). It shares no code with dsv4_ref.py, so that test_compress_models.py compares
two independent implementations. Each function names the public function it follows. Sources, read
for facts:

- Nicooo-Wang/DeepSeek-V4-Pro-code `inference/model.py` @ 0ec3a03c2fc34f29b2e72696ceaed9ae7a373aeb
  (a mirror of the reference): RMSNorm, precompute_freqs_cis, apply_rotary_emb, rotate_activation,
  get_window_topk_idxs, get_compress_topk_idxs, Compressor, Indexer, Attention.
- the same commit's `inference/kernel.py`: sparse_attn (fp32 scores, the sink in the denominator only)
  and the signatures of act_quant / fp4_act_quant. Its pure-torch bodies skip the cast onto the fp8
  and fp4 grids, so the rounding follows the tilelang kernels they stand in for (as found in a
  third-party copy of that kernel.py): scale = 2^ceil(log2(amax * (1/max))) from the exponent bits
  of the fp32 product (fast_round_scale), value = clamp(x / scale) cast to e4m3 or e2m1 with
  round-to-nearest-even, times scale, back to bf16.
- vllm-project/vllm `vllm/model_executor/layers/deepseek_compressor.py` @
  0de10a276eced6036e9752a223cba53c996d31cd: the wire order of `ckv`/`ikv` rows, kv first, then the
  gate (score).

Precision. A bf16 tensor of the model is a float32 array here holding bf16 values, rounded to nearest
even wherever torch converts to bf16; an fp32 tensor is a float32 array. Where the model leaves the
order of a reduction to the library (matmuls, einsums, sums, means, softmax), it is computed in
binary64 and rounded once to fp32 (or to bf16 where the model's output is bf16): the correctly
rounded value is the one representative of every order.

Where this reference knowingly differs from dsv4d's exact contract (SPEC §8.8 lists the first seven);
in each case this file does what the model does:
1. Pooling is softmax(s) (fp32) times kv, summed; the contract divides once (sum e kv / sum e).
2. Index scores are bf16: the q.k einsum output, the product with the weights and the sum over heads
   each round to bf16 (score="bf16", the default; score="f64" scores in binary64 for comparison).
   The model returns torch.topk's indices in score order, with its order among ties unspecified; here
   ties go to the lower entry, and the sets are returned in increasing j.
3. `iw` is rounded to bf16 first (weights_proj's output is bf16; a widened bf16 is unchanged), and the
   weights are bf16(iw * (float)2^-6.5).
4. The attention output rounds to bf16 in sparse_attn and again after the inverse rotation (dims
   448..511 are rounded twice): out_round="model", the default. out_round="contract" rotates the
   fp32 output and rounds once, as the contract does.
5. Norm weights are fp32 (the model keeps them so), passed in as given.
6. The main q normalisation is bf16 throughout (q.square(), the mean, + eps, rsqrt and the product each
   round to bf16): q_norm="model", the default. q_norm="contract" normalises in fp32 and rounds once,
   as SPEC §2.1, to isolate this difference in comparisons.
7. The model runs a prefill from position 0 or one token at a time; this file runs any chunk sizes
   (p0 = 0), with the decode path's state updates and the prefill's visibility masks (entry j is
   visible to token i when j < (i + 1) // ratio), which is the same computation.
Roundings of the same quantities in a different order (not in SPEC §8.8, all within float error):
8. The UE8M0 exponent comes from the bits of amax * (float)(1/448) (or 1/6) instead of an exact
   comparison with 448 * 2^e (6 * 2^e); both give the same exponent for every normal amax.
9. RoPE is the complex product in fp32 (e c - o s, e s + o c, rounded once here); the contract uses
   fmaf(e, c, -(o s)). The RoPE table is the model's precompute_freqs_cis in fp32 with cos and sin
   rounded from binary64; for YaRN it equals SPEC §2.3's frequencies bit for bit.
10. The Hadamard transform is H x (exact) times the fp32 scale, rounded; the contract uses fp32
    butterflies.
11. RMSNorm takes the mean of squares in any order and rsqrt; the contract fixes 32 (or 8) fma chains
    and 1.0f / sqrtf.
12. Attention uses exp, normalised weights and one weighted sum; the contract uses dsv4_expf, one fma
    chain and N / D.
Not modelled: the tilelang sparse_attn kernel (as found in the same third-party copy) rounds the
unnormalised weights to bf16 before the weighted sum, as FlashMLA does; the mirror's pure-torch
sparse_attn, followed here, keeps them in fp32.
"""

import math

import numpy as np

F32 = np.float32
F64 = np.float64

HEAD_DIM = 512
ROPE_DIM = 64
WINDOW = 128
INDEX_HEAD_DIM = 128
INDEX_HEADS = 64
FP8_MAX = 448.0
FP4_MAX = 6.0


# ---------------------------------------------------------------------------------------------
# bf16 as torch rounds it


def bf16(x):
    """Round to the nearest bf16 value (ties to even); returns float32 holding bf16 values."""
    u = np.ascontiguousarray(np.asarray(x, dtype=F64).astype(F32)).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return r.astype(np.uint32).view(F32)


def f32(x):
    return np.asarray(x, dtype=F64).astype(F32)


def from_bf16_bits(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(F32)


def to_bf16_bits(x):
    """bf16 values (float32 arrays) -> their bit patterns."""
    return (np.ascontiguousarray(np.asarray(x, dtype=F32)).view(np.uint32) >> 16).astype(np.uint16)


# ---------------------------------------------------------------------------------------------
# model.py: RMSNorm, precompute_freqs_cis, apply_rotary_emb, rotate_activation


def rms_norm(x, weight, eps, trace=None):
    """RMSNorm.forward: x.float() * rsqrt(mean(x^2) + eps), times the fp32 weight, back to bf16."""
    x = np.asarray(x, dtype=F32)
    var = f32(np.mean(x.astype(F64) ** 2, axis=-1, keepdims=True))
    r = f32(1.0 / np.sqrt(f32(var + F32(eps)).astype(F64)))
    y = f32(f32(x * r) * np.asarray(weight, dtype=F32))
    if trace is not None:
        trace.update(r=r[..., 0], y_pre=y)
    return bf16(y)


class Rope:
    """precompute_freqs_cis(dim=64, ...) and torch.polar: fp32 frequencies (YaRN when
    original_seq_len > 0), angle = (float)t * freq, and cos/sin rounded to fp32."""

    def __init__(self, base, factor=1.0, original_seq_len=0, beta_fast=32, beta_slow=1, dim=ROPE_DIM):
        expo = f32(np.arange(0, dim, 2, dtype=F32) / F32(dim))
        freqs = f32(F32(1.0) / np.array([F32(math.pow(base, float(e))) for e in expo], dtype=F32))
        if original_seq_len > 0:
            def corr(n):
                return dim * math.log(original_seq_len / (n * 2 * math.pi)) / (2 * math.log(base))
            low = max(math.floor(corr(beta_fast)), 0)
            high = min(math.ceil(corr(beta_slow)), dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip(f32((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low)), 0, 1)
            smooth = f32(F32(1.0) - ramp.astype(F32))
            freqs = f32(f32(f32(freqs / F32(factor)) * f32(F32(1.0) - smooth)) + f32(freqs * smooth))
        self.freqs = freqs

    def rows(self, positions):
        ang = f32(np.asarray(positions, dtype=np.int64).astype(F32)[:, None] * self.freqs[None, :])
        return f32(np.cos(ang.astype(F64))), f32(np.sin(ang.astype(F64)))


def apply_rotary_emb(x, cos, sin, inverse=False, trace=None):
    """apply_rotary_emb: pairs (2i, 2i+1) of x [..., 64] (bf16 values) times cos + i sin (its
    conjugate when inverse), in fp32, copied back into bf16. cos, sin broadcast to [..., 32]."""
    x = np.asarray(x, dtype=F32)
    e, o = x[..., 0::2].astype(F64), x[..., 1::2].astype(F64)
    c, s = np.asarray(cos, dtype=F64), np.asarray(sin, dtype=F64)
    if inverse:
        s = -s
    out = np.empty(x.shape, dtype=F32)
    out[..., 0::2] = f32(e * c - o * s)
    out[..., 1::2] = f32(e * s + o * c)
    if trace is not None:
        trace["rope_pre"] = out.copy()
    return bf16(out)


def _sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


_H128 = _sylvester(INDEX_HEAD_DIM)


def rotate_activation(x, trace=None):
    """rotate_activation: hadamard_transform(x, scale=128^-0.5) of bf16 x, computed in fp32 (the sum
    exact here), scaled by the fp32 scale, back to bf16."""
    y = f32(np.asarray(x, dtype=F64) @ _H128)
    y = f32(y * F32(INDEX_HEAD_DIM ** -0.5))
    if trace is not None:
        trace["had_pre"] = y.copy()
    return bf16(y)


# ---------------------------------------------------------------------------------------------
# kernel.py: act_quant and fp4_act_quant with inplace=True (quantise, dequantise, back to bf16)


def _pow2_ceil_bits(v):
    """fast_round_scale's 2^ceil(log2(v)) for normal fp32 v: exponent bits, +1 if any mantissa bit."""
    u = np.ascontiguousarray(np.asarray(v, dtype=F32)).view(np.uint32)
    e = ((u >> 23) & 0xFF).astype(np.int64) - 127 + ((u & 0x7FFFFF) != 0)
    return e


def _round_e4m3(v):
    """Nearest-even onto the E4M3FN grid (|v| <= 448 here): step 2^-9 below 2^-6, else 2^(E-3)."""
    a = np.abs(np.asarray(v, dtype=F64))
    _, ex = np.frexp(np.maximum(a, 2.0 ** -6))
    step = np.ldexp(1.0, ex - 4)
    return np.copysign(np.rint(a / step) * step, v)


def _round_e2m1(v):
    """Nearest-even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6} (|v| <= 6): steps 0.5, 1 and 2 by range."""
    a = np.abs(np.asarray(v, dtype=F64))
    step = np.where(a < 2.0, 0.5, np.where(a < 4.0, 1.0, 2.0))
    return np.copysign(np.rint(a / step) * step, v)


def act_quant(x, block=64, trace=None):
    """act_quant(x, block, "ue8m0", ..., inplace=True): per block, amax >= 1e-4, a power-of-two scale,
    x / scale clamped to +-448 and cast to e4m3, times scale, to bf16."""
    x = np.asarray(x, dtype=F32)
    b = x.reshape(x.shape[:-1] + (-1, block))
    amax = np.maximum(np.max(np.abs(b), axis=-1), F32(1e-4))
    e = _pow2_ceil_bits(f32(amax * F32(1.0 / FP8_MAX)))
    q = np.clip(np.ldexp(b.astype(F64), -e[..., None]), -FP8_MAX, FP8_MAX)
    if trace is not None:
        trace["exp"] = e
    return bf16(np.ldexp(_round_e4m3(q), e[..., None])).reshape(x.shape)


def fp4_act_quant(x, block=32, trace=None):
    """fp4_act_quant(x, 32, inplace=True): per block, amax >= 6 * 2^-126, a power-of-two scale,
    x / scale clamped to +-6 and cast to e2m1, times scale, to bf16."""
    x = np.asarray(x, dtype=F32)
    b = x.reshape(x.shape[:-1] + (-1, block))
    amax = np.maximum(np.max(np.abs(b), axis=-1), F32(FP4_MAX * 2.0 ** -126))
    e = _pow2_ceil_bits(f32(amax * F32(1.0 / FP4_MAX)))
    q = np.clip(np.ldexp(b.astype(F64), -e[..., None]), -FP4_MAX, FP4_MAX)
    if trace is not None:
        trace["exp"] = e
    return bf16(np.ldexp(_round_e2m1(q), e[..., None])).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# model.py: get_window_topk_idxs, get_compress_topk_idxs


def window_positions(p):
    """get_window_topk_idxs: the positions max(0, p - 127)..p a token at p attends to."""
    return np.arange(max(0, p - WINDOW + 1), p + 1)


def compress_positions(ratio, p):
    """get_compress_topk_idxs: every entry j < (p + 1) // ratio."""
    return np.arange((p + 1) // ratio)


# ---------------------------------------------------------------------------------------------
# model.py: Compressor


class Compressor:
    """Compressor(ratio, head_dim, rotate): learned gated pooling of ratio tokens (ratio 4: 2 * 4
    overlapping) into one entry, then RMSNorm, RoPE at the window's first position, and the fp8
    (act_quant of the NoPE dims) or, with rotate, Hadamard + fp4 simulation.

    The state is the model's decode-path kv_state / score_state: coff * ratio rows of coff * d, kv
    zero and score -inf at start; with overlap, rows 0..ratio-1 hold the previous window and rows
    ratio.. the current one. entries maps j to the stored entry (bf16 values [d]).
    """

    def __init__(self, ratio, head_dim, ape, norm_weight, rope, eps=1e-6, rotate=False):
        self.ratio, self.d, self.rope, self.eps, self.rotate = ratio, head_dim, rope, eps, rotate
        self.overlap = ratio == 4
        coff = 1 + self.overlap
        self.ape = np.asarray(ape, dtype=F32)
        assert self.ape.shape == (ratio, coff * head_dim)
        self.norm_weight = np.asarray(norm_weight, dtype=F32)
        self.kv_state = np.zeros((coff * ratio, coff * head_dim), dtype=F32)
        self.score_state = np.full((coff * ratio, coff * head_dim), -np.inf, dtype=F32)
        self.entries = {}
        self.trace = {}

    def forward(self, kv, score, positions):
        """kv, score [n, coff * d] fp32 (wkv(x), wgate(x)) of consecutive positions. Returns the
        entries emitted by these tokens as (js, values [m, d])."""
        r, d = self.ratio, self.d
        js, pooled = [], []
        for t, p in enumerate(np.asarray(positions, dtype=np.int64)):
            sc = f32(np.asarray(score[t], dtype=F32) + self.ape[p % r])
            row = (r if self.overlap else 0) + p % r
            self.kv_state[row] = kv[t]
            self.score_state[row] = sc
            if (p + 1) % r:
                continue
            if self.overlap:
                kvs = np.concatenate([self.kv_state[:r, :d], self.kv_state[r:, d:]])
                ss = np.concatenate([self.score_state[:r, :d], self.score_state[r:, d:]])
                self.kv_state[:r] = self.kv_state[r:]
                self.score_state[:r] = self.score_state[r:]
            else:
                kvs, ss = self.kv_state.copy(), self.score_state.copy()
            js.append(p // r)
            pooled.append(self._pool(kvs, ss))
        if not js:
            return np.zeros(0, dtype=np.int64), np.zeros((0, d), dtype=F32)
        js = np.array(js, dtype=np.int64)
        vals = self._finish(js, np.stack(pooled))
        for j, v in zip(js, vals):
            self.entries[int(j)] = v
        return js, vals

    @staticmethod
    def _pool(kv, score):
        """(kv * score.softmax(dim=rows)).sum(dim=rows) in fp32."""
        m = np.max(score, axis=0)
        e = np.exp(f32(score - m).astype(F64))
        w = f32(e / np.sum(e, axis=0))
        return f32(np.sum(kv.astype(F64) * w.astype(F64), axis=0))

    def _finish(self, js, z):
        """kv.to(bf16) -> norm -> RoPE on the last 64 dims at position j * ratio -> quantisation."""
        tr = {"js": js, "z": z}
        x = rms_norm(bf16(z), self.norm_weight, self.eps, tr)
        tr["zb"], tr["y"] = bf16(z), x.copy()
        cos, sin = self.rope.rows(js * self.ratio)
        x[:, -ROPE_DIM:] = apply_rotary_emb(x[:, -ROPE_DIM:], cos, sin, trace=tr)
        tr["roped"] = x.copy()
        if self.rotate:
            x = rotate_activation(x, tr)
            tr["had"] = x.copy()
            x = fp4_act_quant(x, 32, tr)
        else:
            x[:, :-ROPE_DIM] = act_quant(x[:, :-ROPE_DIM], 64, tr)
        tr["out"] = x
        for k, v in tr.items():
            self.trace[k] = np.concatenate([self.trace[k], v]) if k in self.trace else v
        return x


# ---------------------------------------------------------------------------------------------
# model.py: Indexer


class Indexer:
    """Indexer: fp4-simulated queries (RoPE on dims 64..127, Hadamard), its own rotate=True Compressor
    (d = 128, ratio 4), weights = weights_proj(x) * 128^-0.5 * 64^-0.5, scores sum_h relu(q.k) w_h,
    and topk(min(index_topk, visible))."""

    def __init__(self, topk, i_ape, i_norm_weight, rope, eps=1e-6, score="bf16"):
        self.topk, self.rope, self.score = topk, rope, score
        self.compressor = Compressor(4, INDEX_HEAD_DIM, i_ape, i_norm_weight, rope, eps, rotate=True)
        self.trace = []

    def queries(self, iq, positions):
        """q = wq_b(qr) as [H, 128] bf16 -> RoPE on q[..., -64:] -> rotate_activation -> fp4."""
        q = np.array(iq, dtype=F32)
        cos, sin = self.rope.rows(positions)
        tr = {}
        q[..., -ROPE_DIM:] = apply_rotary_emb(q[..., -ROPE_DIM:], cos[:, None], sin[:, None], trace=tr)
        roped = q.copy()
        q = rotate_activation(q, tr)
        had = q.copy()
        q = fp4_act_quant(q, 32)
        tr.update(roped=roped, had=had, q=q)
        return q, tr

    def scores(self, q, w, keys):
        """index_score for one token: q [H, 128], w [H] (bf16), keys [n, 128] -> [n]."""
        d = q.astype(F64) @ keys.astype(F64).T  # [H, n], exact: fp4 values with power-of-two scales
        if self.score == "f64":
            return np.sum(np.maximum(d, 0.0) * w.astype(F64)[:, None], axis=0)
        d = bf16(d)
        p = bf16(np.maximum(d, 0).astype(F64) * w.astype(F64)[:, None])
        return bf16(np.sum(p.astype(F64), axis=0))

    def forward(self, iq, iw, ikv, positions):
        """One chunk (p0 = 0): the compressor first (its entries are visible to the chunk's tokens),
        then each token's selection as a sorted array of entries."""
        pos = np.asarray(positions, dtype=np.int64)
        q, tr = self.queries(iq, pos)
        self.compressor.forward(ikv[:, :2 * INDEX_HEAD_DIM], ikv[:, 2 * INDEX_HEAD_DIM:], pos)
        w = bf16(f32(bf16(iw) * F32(INDEX_HEAD_DIM ** -0.5 * INDEX_HEADS ** -0.5)))
        sel, scores = [], []
        for t, p in enumerate(pos):
            n = (p + 1) // 4
            k = min(self.topk, n)
            if n == 0:
                sel.append(np.zeros(0, dtype=np.int64))
                scores.append(None)
                continue
            keys = np.stack([self.compressor.entries[j] for j in range(n)])
            sc = self.scores(q[t], w[t], keys)
            order = np.lexsort((np.arange(n), -sc.astype(F64)))
            sel.append(np.sort(order[:k]))
            scores.append(sc)
        self.trace.append(dict(tr, w=w, scores=scores))
        return sel


# ---------------------------------------------------------------------------------------------
# kernel.py: sparse_attn; model.py: Attention


def sparse_attn(q, kv, sink, scale, round_out=True):
    """sparse_attn for one token: q [H, 512] and kv [n, 512] bf16 values, sink [H] fp32 or None.
    fp32 scores, softmax with exp(sink - max) in the denominator only, weighted sum, bf16 out (fp32
    when not round_out)."""
    s = f32(f32(q.astype(F64) @ kv.astype(F64).T) * F32(scale))
    m = np.max(s, axis=1)
    e = f32(np.exp(f32(s - m[:, None]).astype(F64)))
    den = f32(np.sum(e.astype(F64), axis=1))
    if sink is not None:
        with np.errstate(over="ignore"):
            den = f32(den + f32(np.exp(f32(np.asarray(sink, dtype=F32) - m).astype(F64))))
    with np.errstate(invalid="ignore"):
        w = f32(e / den[:, None])
    o = f32(w.astype(F64) @ kv.astype(F64))
    return bf16(o) if round_out else o


class Attention:
    """Attention.forward for one sequence of one compressed layer (ratio 4 or 128), fed with the wire
    tensors of SPEC §2 and §8.2 chunk by chunk from position 0.

    q [n, H, 512] bf16 bits (wq_b output), kv [n, 512] bf16 bits (wkv output, already normalised
    unless kv_norm_weight is given), ckv [n, 2 * coff * 512] fp32, and at ratio 4 ikv [n, 512] fp32,
    iq [n, 64, 128] bf16 bits, iw [n, 64] fp32.
    """

    def __init__(self, ratio, heads, rope, ape, norm_weight, sink=None, kv_norm_weight=None,
                 eps=1e-6, topk=512, i_ape=None, i_norm_weight=None, q_norm="model", score="bf16",
                 out_round="model"):
        assert ratio in (4, 128) and q_norm in ("model", "contract")
        assert out_round in ("model", "contract")
        self.ratio, self.heads, self.rope, self.eps, self.q_norm = ratio, heads, rope, eps, q_norm
        self.out_round = out_round
        self.sink = None if sink is None else np.asarray(sink, dtype=F32)
        self.kv_norm_weight = kv_norm_weight
        self.compressor = Compressor(ratio, HEAD_DIM, ape, norm_weight, rope, eps)
        self.indexer = (Indexer(topk, i_ape, i_norm_weight, rope, eps, score)
                        if ratio == 4 else None)
        self.window = {}  # position -> the cached window kv (bf16 values, fp8-simulated NoPE)
        self.next = 0
        self.scale = HEAD_DIM ** -0.5

    def _q(self, q, cos, sin):
        """q *= rsqrt(q.square().mean(-1) + eps); RoPE on the last 64 dims."""
        q = from_bf16_bits(q)
        if self.q_norm == "model":
            ms = bf16(np.mean(bf16(q.astype(F64) ** 2).astype(F64), axis=-1, keepdims=True))
            r = bf16(1.0 / np.sqrt(bf16(ms + F32(self.eps)).astype(F64)))
            q = bf16(q * r)
            q[..., -ROPE_DIM:] = apply_rotary_emb(q[..., -ROPE_DIM:], cos[:, None], sin[:, None])
            return q
        ms = f32(np.mean(q.astype(F64) ** 2, axis=-1, keepdims=True))
        y = f32(q * f32(1.0 / np.sqrt(f32(ms + F32(self.eps)).astype(F64))))
        out = bf16(y)
        e, o = y[..., -ROPE_DIM::2].astype(F64), y[..., -ROPE_DIM + 1::2].astype(F64)
        c, s = cos[:, None].astype(F64), sin[:, None].astype(F64)
        out[..., -ROPE_DIM::2] = bf16(e * c - o * s)
        out[..., -ROPE_DIM + 1::2] = bf16(e * s + o * c)
        return out

    def _kv(self, kv, cos, sin):
        """kv_norm (when given), RoPE on the last 64 dims, act_quant of the NoPE dims."""
        kv = from_bf16_bits(kv)
        if self.kv_norm_weight is not None:
            kv = rms_norm(kv, self.kv_norm_weight, self.eps)
        kv[:, -ROPE_DIM:] = apply_rotary_emb(kv[:, -ROPE_DIM:], cos, sin)
        kv[:, :-ROPE_DIM] = act_quant(kv[:, :-ROPE_DIM], 64)
        return kv

    def forward(self, q, kv, ckv, ikv=None, iq=None, iw=None, sel=None):
        """One chunk of consecutive tokens from self.next on. sel (optional) overrides the indexer's
        selection (a list of entry arrays per token) to compare attention on the same candidates.
        Returns {"out": [n, H, 512] bf16 bits, "topk": list of sorted entry arrays (ratio 4),
        "entries": js emitted by the chunk, "q": the normalised, rotated queries as bf16 bits}."""
        n = np.asarray(q).shape[0]
        pos = np.arange(self.next, self.next + n)
        self.next += n
        cos, sin = self.rope.rows(pos)
        qb = self._q(q, cos, sin)
        kvc = self._kv(kv, cos, sin)
        for t, p in enumerate(pos):
            self.window[int(p)] = kvc[t]
        topk = None
        if self.indexer is not None:
            topk = self.indexer.forward(from_bf16_bits(iq), np.asarray(iw, dtype=F32),
                                        np.asarray(ikv, dtype=F32), pos)
        w = ckv.shape[1] // 2
        js, _ = self.compressor.forward(np.asarray(ckv[:, :w], dtype=F32),
                                        np.asarray(ckv[:, w:], dtype=F32), pos)
        out = np.empty((n, self.heads, HEAD_DIM), dtype=np.uint16)
        for t, p in enumerate(pos):
            if self.ratio == 4:
                ent = topk[t] if sel is None else np.asarray(sel[t], dtype=np.int64)
            else:
                ent = compress_positions(self.ratio, p)
            keys = [self.window[int(i)] for i in window_positions(p)]
            keys += [self.compressor.entries[int(j)] for j in ent]
            o = sparse_attn(qb[t], np.stack(keys), self.sink, self.scale,
                            round_out=self.out_round == "model")
            o[:, -ROPE_DIM:] = apply_rotary_emb(o[:, -ROPE_DIM:], cos[t], sin[t], inverse=True)
            out[t] = to_bf16_bits(bf16(o))
        return {"out": out, "topk": topk, "entries": js, "q": to_bf16_bits(qb)}
