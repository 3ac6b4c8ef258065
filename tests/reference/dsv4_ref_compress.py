"""The compressed branch (SPEC §8) of the independent numpy model, exact in IEEE binary32.

It extends dsv4_ref.py (SPEC §2-§4, §7) with the compressor (§8.3), the indexer and its MXFP4 index
records (§8.5) and attention over the SWA window and the compressed entries (§8.6). Like dsv4_ref.py
it is written from SPEC.md alone and rounds exactly where the SPEC rounds: float32 numpy operations
round once to nearest-even and keep subnormals, and dsv4_ref.fmaf is an exact fused multiply-add.

One piece is not in SPEC.md's text: dsv4_expf and dsv4_logf, which SPEC §7 defines as "one routine in
the shared numerics", their outputs frozen over all 2^32 inputs by a digest. Their operation sequence
is reproduced below from that routine's documented algorithm (kernels/dsv4-numerics.h); the frozen
digests of tests/support/numerics_digests.h check the transcription (test_compress_model.py
--expf-digest runs the full sweep, about an hour of one core).

Entry points take raw arrays in the backend's shapes and layouts (kernels/backend.h), so that a test
can feed the same bytes to kernel_run and compare byte for byte:

- compress_sequence(ratio, ckv, positions, p0, ape, norm_weight, inv, ikv=, i_ape=, i_norm_weight=)
  -> Compressed: js, records [n, 584] and (ratio 4) index records [n, 68] of the emitted entries
  (Compressed.emitted_by(batch positions) picks those a batch's tokens emit);
- emitted_entries(ratio, positions): the entries that the tokens at these positions emit;
- indexer_select(iq, iw, positions, p0, index_records, topk, inv) -> sel [N, topk] int32;
- attention_union(q_out, positions, p0, swa_records, c_records, ratio, inv, sel=, sink=)
  -> (out [N, H, 512] bf16 bits, lse [N, H]) in the exact binary32 order of §7 and §8.6
  (attention_exact is the same for given candidate keys);
- attention_union_f64(...): the same quantity in binary64 (dsv4_ref.attention_token), for tolerances;
- write_c_records / write_index_records / read_index_record: the paged layouts (§3, §8.7).
"""

import numpy as np

import dsv4_ref as R

F32 = np.float32
F64 = np.float64
U32 = np.uint32

INDEX_DIM = 128
INDEX_ROPE_FIRST = 64
INDEX_RECORD_BYTES = 68
MX_BLOCK = 32
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
HADAMARD_SCALE = R.f32_from_bits(np.uint32(0x3DB504F3))  # (float)128^-0.5
INDEX_W_SCALE = R.f32_from_bits(np.uint32(0x3C3504F3))  # (float)(128 * 64)^-0.5 = 2^-6.5
SOFTMAX_SCALE = R.f32_from_bits(np.uint32(0x3D3504F3))  # (float)512^-0.5


def _hexf(s):
    return F32(float.fromhex(s))


# ---------------------------------------------------------------------------------------------
# dsv4_expf and dsv4_logf (SPEC §7): one correctly rounded binary32 operation per step, so these
# are exact reproductions, not approximations of the routines.

_EXP_P = [_hexf(h) for h in ("0x1.9f0894p-13", "0x1.6d8d04p-10", "0x1.11127p-7", "0x1.55548ep-5",
                             "0x1.555554p-3", "0x1p-1")]
_LOG_P = [_hexf(h) for h in ("-0x1.eb0abcp-5", "0x1.b7614cp-4", "-0x1.bd41a6p-4", "0x1.c36c76p-4",
                             "-0x1.fc6bf8p-4", "0x1.249234p-3", "-0x1.556888p-3", "0x1.999a1cp-3",
                             "-0x1.ffffacp-3", "0x1.555554p-2", "-0x1p-1")]
_LOG2E = _hexf("0x1.715476p+0")
_LN2_HI = _hexf("0x1.62e4p-1")
_LN2_LO = _hexf("0x1.7f7d1cp-20")
_ROUNDER = F32(1.5 * 2.0 ** 23)


def _pow2i(e):
    """2^e as binary32 from exponent bits, -126 <= e <= 127."""
    return ((np.asarray(e, dtype=np.int64) + 127).astype(U32) << U32(23)).view(F32)


def _quiet(u):
    return (u | U32(0x00400000)).view(F32)


def dsv4_expf(x):
    """e^x, vectorised; the bits of the shared routine for every binary32 input."""
    x = np.ascontiguousarray(np.asarray(x, dtype=F32))
    shape = x.shape
    x = x.reshape(-1)
    u = x.view(U32)
    a = u & U32(0x7FFFFFFF)
    out = np.empty_like(x)
    nan = a > U32(0x7F800000)
    big = ~nan & (x > F32(89.0))
    small = ~nan & (x < F32(-104.0))
    tiny = ~nan & ~big & ~small & (a < U32(0x33000000))
    gen = ~(nan | big | small | tiny)
    out[nan] = _quiet(u[nan])
    out[big] = np.inf
    out[small] = 0.0
    out[tiny] = 1.0
    xg = x[gen]
    t = xg * _LOG2E
    k = (t + _ROUNDER) - _ROUNDER
    rh = R.fmaf(-k, _LN2_HI, xg)
    rl = -k * _LN2_LO
    r = rh + rl
    bv = r - rh
    re = (rh - (r - bv)) + (rl - bv)
    p = np.full_like(r, _EXP_P[0])
    for c in _EXP_P[1:]:
        p = R.fmaf(p, r, c)
    w = R.fmaf(r * r, p, re)
    hi = F32(1.0) + r
    lo = (F32(1.0) - hi) + r
    y = hi + (lo + w)
    q = k.astype(np.int64)
    q1 = np.sign(q) * (np.abs(q) // 2)  # C's q / 2 truncates towards zero
    with np.errstate(over="ignore"):  # e^x above 88.72 overflows to +inf, as it should
        out[gen] = (y * _pow2i(q1)) * _pow2i(q - q1)
    return out.reshape(shape)


def dsv4_logf(x):
    """ln x, vectorised; the bits of the shared routine for every binary32 input."""
    x = np.ascontiguousarray(np.asarray(x, dtype=F32))
    shape = x.shape
    x = x.reshape(-1)
    u = x.view(U32)
    a = u & U32(0x7FFFFFFF)
    out = np.empty_like(x)
    nan = a > U32(0x7F800000)
    zero = a == 0
    neg = ~nan & ~zero & ((u >> U32(31)) == 1)
    inf = u == U32(0x7F800000)
    gen = ~(nan | zero | neg | inf)
    out[nan] = _quiet(u[nan])
    out[zero] = -np.inf
    out[neg] = np.array([0x7FC00000], dtype=U32).view(F32)[0]
    out[inf] = np.inf
    ug = u[gen]
    xg = x[gen]
    sub = ug < U32(0x00800000)
    ug[sub] = (xg[sub] * F32(2.0 ** 23)).view(U32)  # a subnormal scaled exactly into the normals
    ebias = np.where(sub, 128 + 23, 128)
    b = (ug + U32(0x00CAFB0D)).astype(U32)
    fe = ((b >> U32(23)).astype(np.int64) - ebias).astype(F32)
    f = ((b & U32(0x007FFFFF)) + U32(0x3F3504F3)).astype(U32).view(F32) - F32(1.0)
    p = np.full_like(f, _LOG_P[0])
    for c in _LOG_P[1:]:
        p = R.fmaf(p, f, c)
    f2 = f * f
    f2e = R.fmaf(f, f, -f2)
    c = R.fmaf(f2, p, R.fmaf(f2e, p, fe * _LN2_LO))
    hi = fe * _LN2_HI
    s = hi + f
    se = (hi - s) + f
    out[gen] = s + (c + se)
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# MXFP4 and the Hadamard transform (SPEC §8.5)


def mx_exponent(amax):
    """The smallest integer e with amax <= 6 * 2^e (exact comparison), amax >= 6 * 2^-126."""
    amax = np.asarray(amax, dtype=F32).astype(F64)
    e = np.ceil(np.log2(amax / 6.0)).astype(np.int64)
    # Repair the estimate with exact comparisons: 6 * 2^e is exact in binary64.
    for _ in range(3):
        e = np.where(amax > np.ldexp(6.0, e), e + 1, e)
        e = np.where(amax <= np.ldexp(6.0, e - 1), e - 1, e)
    return e


def e2m1_code(mag):
    """Magnitudes in [0, 6] (binary64, exact) -> e2m1 codes 0..7, nearest with ties to the even code."""
    mag = np.asarray(mag, dtype=F64)
    assert np.all(mag <= 6.0)
    k = np.searchsorted(E2M1_MIDPOINTS, mag, side="left")  # midpoints strictly below mag
    kk = np.minimum(k, len(E2M1_MIDPOINTS) - 1)
    tie = (k < len(E2M1_MIDPOINTS)) & (mag == E2M1_MIDPOINTS[kk])
    return np.where(tie & (k % 2 == 1), k + 1, k).astype(np.uint8)


def mxfp4_quantise(v):
    """v [..., 128] float32 -> (nibbles [..., 128] uint8, codes [..., 4] uint8, dequantised float32).

    Per block of 32: amax = max(max |v|, 6 * 2^-126); e as in mx_exponent; each value becomes the e2m1
    nibble of v * 2^-e (sign bit from v's sign bit, so -0.0 and negatives that round to zero give 8).
    """
    v = np.asarray(v, dtype=F32)
    lead = v.shape[:-1]
    blocks = v.reshape(lead + (-1, MX_BLOCK))
    amax = np.maximum(np.max(np.abs(blocks), axis=-1), F32(6.0 * 2.0 ** -126)).astype(F32)
    e = mx_exponent(amax)
    scaled = np.ldexp(blocks.astype(F64), -e[..., None])  # exact in binary64
    code = e2m1_code(np.abs(scaled))
    sign = ((R.f32_bits(blocks) >> U32(31)) & U32(1)).astype(np.uint8)
    nib = (code | (sign << np.uint8(3))).astype(np.uint8)
    deq = np.ldexp(np.where(sign == 1, -1.0, 1.0) * E2M1_GRID[code], e[..., None]).astype(F32)
    ue8m0 = (e + 127).astype(np.int64)
    assert np.all((ue8m0 >= 1) & (ue8m0 <= 254))
    return nib.reshape(v.shape), ue8m0.astype(np.uint8), deq.reshape(v.shape)


def mxfp4_dequantise(nib, codes):
    nib = np.asarray(nib, dtype=np.uint8)
    codes = np.asarray(codes, dtype=np.int64)
    lead = nib.shape[:-1]
    mag = E2M1_GRID[nib & 7].reshape(lead + (-1, MX_BLOCK))
    sgn = np.where((nib >> 3) & 1, -1.0, 1.0).reshape(mag.shape)
    return np.ldexp(sgn * mag, (codes - 127)[..., None]).astype(F32).reshape(nib.shape)


def pack_index_record(nib, codes):
    """nibbles [..., 128] and codes [..., 4] -> [..., 68] bytes: element 2i low, 2i+1 high."""
    nib = np.asarray(nib, dtype=np.uint8)
    packed = (nib[..., 0::2] | (nib[..., 1::2] << np.uint8(4))).astype(np.uint8)
    return np.concatenate([packed, np.asarray(codes, dtype=np.uint8)], axis=-1)


def unpack_index_record(rec):
    rec = np.asarray(rec, dtype=np.uint8)
    nib = np.empty(rec.shape[:-1] + (INDEX_DIM,), dtype=np.uint8)
    nib[..., 0::2] = rec[..., :64] & 0xF
    nib[..., 1::2] = rec[..., :64] >> 4
    return nib, rec[..., 64:68]


def dequantise_index_record(rec):
    """An index record -> its 128 values, exact in float32."""
    nib, codes = unpack_index_record(rec)
    return mxfp4_dequantise(nib, codes)


def hadamard128(x):
    """x [..., 128] float32 (bf16 values) -> the bf16 bits of H x * 128^-0.5 (SPEC §8.5).

    Butterflies for h = 1, 2, ..., 64 in binary32: (a[i], a[i+h]) <- (a[i] + a[i+h], a[i] - a[i+h])
    for (i & h) == 0, then one product with the fp32 scale and one rounding to bf16.
    """
    a = np.array(x, dtype=F32, copy=True)
    lead = a.shape[:-1]
    h = 1
    while h < INDEX_DIM:
        v = a.reshape(lead + (INDEX_DIM // (2 * h), 2, h))
        lo, hi = v[..., 0, :].copy(), v[..., 1, :].copy()
        v[..., 0, :] = lo + hi
        v[..., 1, :] = lo - hi
        a = v.reshape(lead + (INDEX_DIM,))
        h *= 2
    return R.f32_to_bf16(a * HADAMARD_SCALE)


def _rope_pairs(x, first, rows):
    """§2.1 RoPE on the pairs (first+2i, first+1+2i) of x [..., d] float32 with rows [..., 64];
    returns the rotated pairs as bf16 bits (even, odd)."""
    e = x[..., first::2]
    o = x[..., first + 1::2]
    c = rows[..., :R.ROPE_PAIRS]
    s = rows[..., R.ROPE_PAIRS:]
    re, ro = R._rope_apply(e, o, c, s)
    return R.f32_to_bf16(re), R.f32_to_bf16(ro)


# ---------------------------------------------------------------------------------------------
# The compressor (SPEC §8.3) and the index keys (§8.5)


def emitted_entries(ratio, positions):
    """Entries emitted by tokens at positions: j = p // ratio for every p with (p + 1) % ratio == 0."""
    p = np.asarray(positions, dtype=np.int64)
    return p[(p + 1) % ratio == 0] // ratio


def pool(kv, s):
    """The §8.3 pooling of rows in list order: kv, s [n, L, C] float32 (a missing row has s = -inf
    and kv = 0, which adds exact zeros) -> z [n, C] float32 = N / S."""
    kv = np.asarray(kv, dtype=F32)
    s = np.asarray(s, dtype=F32)
    m = np.max(s, axis=1)
    e = dsv4_expf((s - m[:, None, :]).astype(F32))
    S = np.zeros(m.shape, dtype=F32)
    N = np.zeros(m.shape, dtype=F32)
    for k in range(s.shape[1]):
        S = (S + e[:, k]).astype(F32)
        N = R.fmaf(e[:, k], kv[:, k], N)
    return (N / S).astype(F32)


def window_rows(ratio, d, js, p0, kv_rows, s_rows):
    """The row list R of each entry j (§8.3) as kv, s [n, L, d] float32, L = 8 (ratio 4: positions
    4j-4..4j-1 with half A, then 4j..4j+3 with half B) or ratio. kv_rows, s_rows: [P, coff * d] of
    positions p0..p0+P-1 (kv, and s = gate + ape). A row below max(0, p0) is missing: s = -inf and
    kv = 0, which pooling turns into exact zeros."""
    spans = (lambda j: [(4 * j - 4, 0), (4 * j, d)]) if ratio == 4 else (lambda j: [(ratio * j, 0)])
    width = 4 if ratio == 4 else ratio
    kv = np.zeros((len(js), 2 * width if ratio == 4 else width, d), dtype=F32)
    s = np.full(kv.shape, -np.inf, dtype=F32)
    first = max(0, p0)
    for i, j in enumerate(js):
        slot = 0
        for p_start, off in spans(int(j)):
            for p in range(p_start, p_start + width):
                if p >= first:
                    kv[i, slot] = kv_rows[p - p0, off:off + d]
                    s[i, slot] = s_rows[p - p0, off:off + d]
                slot += 1
    return kv, s


def rows_with_ape(x, positions, ape, ratio):
    """Split wire rows x [N, 2W] into kv [N, W] and s = gate + ape[p mod ratio] [N, W] (one fp32
    add, rounded once)."""
    x = np.asarray(x, dtype=F32)
    w = x.shape[1] // 2
    ape = np.asarray(ape, dtype=F32)
    assert ape.shape == (ratio, w), "ape must be [ratio, %d]" % w
    p = np.asarray(positions, dtype=np.int64)
    return x[:, :w], (x[:, w:] + ape[p % ratio]).astype(F32)


def index_rms_factor(zb, eps=R.EPS):
    """The index keys' RMS factor of zb [n, 128]: 8 fma chains of 16, folded 4, 2, 1; then
    1.0f / sqrtf(ss * 2^-7 + eps), each operation rounded once."""
    xs = np.asarray(zb, dtype=F32).reshape(-1, 8, 16)
    acc = np.zeros((xs.shape[0], 8), dtype=F32)
    for k in range(16):
        acc = R.fmaf(xs[..., k], xs[..., k], acc)
    for step in (4, 2, 1):
        acc = (acc[:, :step] + acc[:, step:2 * step]).astype(F32)
    t = ((acc[:, 0] * F32(2.0 ** -7)).astype(F32) + F32(eps)).astype(F32)
    return (F32(1.0) / np.sqrt(t)).astype(F32)


def index_key_values(z, rows, norm_weight, eps=R.EPS, trace=None):
    """Pooled index z [n, 128] float32 and YaRN rows at 4j -> (bf16 bits after the Hadamard [n,
    128]): bf16(z), the 8x16 RMS, weight, RoPE on dims 64..127, Hadamard (SPEC §8.5)."""
    zb = R.bf16_to_f32(R.f32_to_bf16(z))
    r = index_rms_factor(zb, eps)
    w = np.asarray(norm_weight, dtype=F32)
    y_pre = ((zb * r[:, None]).astype(F32) * w[None, :]).astype(F32)
    y = R.bf16_to_f32(R.f32_to_bf16(y_pre))
    re, ro = _rope_pairs(y, INDEX_ROPE_FIRST, rows)
    yr = y.copy()
    yr[:, INDEX_ROPE_FIRST::2] = R.bf16_to_f32(re)
    yr[:, INDEX_ROPE_FIRST + 1::2] = R.bf16_to_f32(ro)
    hb = hadamard128(yr)
    if trace is not None:
        trace.update(z=z, zb=zb, r=r, y_pre=y_pre, y=y, roped=yr, had=R.bf16_to_f32(hb))
    return hb


class Compressed:
    """The entries a sequence's compressor emitted: js [n] (increasing), records [n, 584] uint8,
    irecs [n, 68] uint8 at ratio 4 (else None), and trace (intermediate values, for tests)."""

    def __init__(self, js, records, irecs, trace):
        self.js, self.records, self.irecs, self.trace = js, records, irecs, trace

    def emitted_by(self, positions, ratio):
        """(js, records, irecs) of the entries that the tokens at positions emit (one batch)."""
        keep = np.isin(self.js, emitted_entries(ratio, positions))
        return self.js[keep], self.records[keep], None if self.irecs is None else self.irecs[keep]

    def by_j(self, n_entries=None):
        """Records as arrays indexed by j (rows of entries not emitted are zero)."""
        n = n_entries if n_entries is not None else (int(self.js.max()) + 1 if len(self.js) else 0)
        rec = np.zeros((n, R.RECORD_BYTES), dtype=np.uint8)
        rec[self.js] = self.records
        if self.irecs is None:
            return rec, None
        irec = np.zeros((n, INDEX_RECORD_BYTES), dtype=np.uint8)
        irec[self.js] = self.irecs
        return rec, irec


def compress_sequence(ratio, ckv, positions, p0, ape, norm_weight, inv, ikv=None, i_ape=None,
                      i_norm_weight=None, eps=R.EPS):
    """Every entry the compressor of one sequence emits (SPEC §8.3, §8.5).

    ckv [N, 2*coff*512] float32 and (ratio 4) ikv [N, 512] float32 are the wire rows of the tokens at
    positions, which must be consecutive from p0 (the sequence so far); ape [ratio, coff*512],
    norm_weight [512], i_ape [4, 256], i_norm_weight [128] float32; inv the layer's YaRN inv_freq.
    Entries are the same however the tokens were split into batches: each depends only on its rows.
    """
    assert ratio in (4, 128)
    pos = np.asarray(positions, dtype=np.int64)
    assert len(pos) and pos[0] == p0 and np.all(np.diff(pos) == 1), "positions: p0, p0+1, ..."
    coff = 2 if ratio == 4 else 1
    ckv = np.asarray(ckv, dtype=F32)
    assert ckv.shape == (len(pos), 2 * coff * R.HEAD_DIM)
    js = emitted_entries(ratio, pos)
    kvp, sp = rows_with_ape(ckv, pos, ape, ratio)
    kv, s = window_rows(ratio, R.HEAD_DIM, js, p0, kvp, sp)
    z = pool(kv, s)
    zb = R.f32_to_bf16(z)
    rows = R.rope_rows(inv, js * ratio)
    records = R.kv_records(zb, rows, np.asarray(norm_weight, dtype=F32), eps)
    trace = {"z": z, "zb": R.bf16_to_f32(zb), "rows": rows}
    irecs = None
    if ratio == 4:
        ikv = np.asarray(ikv, dtype=F32)
        assert ikv.shape == (len(pos), 4 * INDEX_DIM)
        ikp, isp = rows_with_ape(ikv, pos, i_ape, 4)
        ik, isc = window_rows(4, INDEX_DIM, js, p0, ikp, isp)
        iz = pool(ik, isc)
        itrace = {}
        hb = index_key_values(iz, rows, i_norm_weight, eps, itrace)
        nib, codes, _ = mxfp4_quantise(R.bf16_to_f32(hb))
        irecs = pack_index_record(nib, codes)
        trace["index"] = itrace
    return Compressed(js, records, irecs, trace)


# ---------------------------------------------------------------------------------------------
# The indexer's queries, scores and selection (SPEC §8.4, §8.5)


def visible_range(ratio, p0, p):
    """Entries a query at position p may use: floor(p0 / r) <= j < floor((p + 1) / r)."""
    return int(p0) // ratio, (int(p) + 1) // ratio


def index_queries(iq, positions, inv, trace=None):
    """iq [N, H, 128] bf16 bits (before RoPE) -> q_hat [N, H, 128] float32 (dequantised MXFP4)."""
    x = R.bf16_to_f32(np.asarray(iq, dtype=np.uint16))
    rows = R.rope_rows(inv, positions)[:, None, :]
    re, ro = _rope_pairs(x, INDEX_ROPE_FIRST, rows)
    xr = x.copy()
    xr[..., INDEX_ROPE_FIRST::2] = R.bf16_to_f32(re)
    xr[..., INDEX_ROPE_FIRST + 1::2] = R.bf16_to_f32(ro)
    hb = hadamard128(xr)
    _, _, q_hat = mxfp4_quantise(R.bf16_to_f32(hb))
    if trace is not None:
        trace.update(roped=xr, had=R.bf16_to_f32(hb), q_hat=q_hat)
    return q_hat


def _products_exact(a, b):
    """True when every product of an element of a with one of b is exact in binary32: both hold bf16
    values (at most 8 significant bits, so a product has at most 16) with every nonzero magnitude in
    [2^-60, 2^60] (so no product leaves the normal range)."""
    for x in (a, b):
        x = np.ascontiguousarray(x, dtype=F32)
        if np.any(x.view(U32) & U32(0xFFFF)):
            return False
        ax = np.abs(x)
        if np.any((ax > 0) & ((ax < F32(2.0 ** -60)) | (ax > F32(2.0 ** 60)))):
            return False
    return True


def _dot_partials(q, k, parts):
    """The fma partials of q [..., n] . k [..., n] (broadcast), parts chains of n / parts dims each,
    as float32. When every product is exact in binary32 (_products_exact), fmaf(q_i, k_i, acc) =
    RN(q_i k_i + acc), so the chain is binary32 additions of binary32 products, computed that way;
    otherwise with the exact fmaf."""
    q = np.asarray(q, dtype=F32)
    k = np.asarray(k, dtype=F32)
    n = q.shape[-1]
    xq = q.reshape(q.shape[:-1] + (parts, n // parts))
    xk = k.reshape(k.shape[:-1] + (parts, n // parts))
    shape = np.broadcast_shapes(q.shape[:-1], k.shape[:-1]) + (parts,)
    acc = np.zeros(shape, dtype=F32)
    if _products_exact(q, k):
        for i in range(n // parts):
            acc += xq[..., i] * xk[..., i]
    else:
        xq, xk = np.broadcast_arrays(xq, xk)
        for i in range(n // parts):
            acc = R.fmaf(xq[..., i], xk[..., i], acc)
    return acc


def _dot128_partials(q, k):
    """The 8 fma partials of 16 dims of q [..., 128] . k [..., 128] (SPEC §8.5), as float32."""
    return _dot_partials(q, k, 8)


def index_scores(q_hat, w, k_hat):
    """Scores of entries k_hat [n, 128] for tokens q_hat [..., H, 128], w [..., H] (already scaled):
    [..., n]. d_hj: 8 fma partials of 16, folded 4, 2, 1; score_j = fmaf(w_h, max(d_hj, +0), acc)
    over h in order from +0."""
    q_hat = np.asarray(q_hat, dtype=F32)
    w = np.asarray(w, dtype=F32)
    acc = _dot128_partials(q_hat[..., :, None, :], k_hat)  # [..., H, n, 8]
    for step in (4, 2, 1):
        acc = (acc[..., :step] + acc[..., step:2 * step]).astype(F32)
    d = np.maximum(acc[..., 0], F32(0.0))  # [..., H, n]
    score = np.zeros(d.shape[:-2] + d.shape[-1:], dtype=F32)
    for h in range(q_hat.shape[-2]):
        score = R.fmaf(np.broadcast_to(w[..., h:h + 1], score.shape), d[..., h, :], score)
    return score


def select_topk(scores, j_first, topk):
    """The min(topk, n) entries first under (score descending, j ascending), in increasing j."""
    n = len(scores)
    k = min(topk, n)
    order = np.lexsort((np.arange(n), -scores.astype(F64)))
    return np.sort(order[:k]) + j_first


def indexer_select(iq, iw, positions, p0, index_records, topk, inv, w_scale=INDEX_W_SCALE,
                   return_scores=False, group=16):
    """The selection of every token (SPEC §8.5): sel [N, topk] int32 in increasing j, -1 padded.

    iq [N, H, 128] bf16 bits; iw [N, H] float32; index_records [n_entries, 68] indexed by j (at
    least every visible entry); positions of the tokens (one sequence starting at p0). With
    return_scores also a list of (j_first, scores) per token (scores of the visible entries, or
    None where every visible entry is selected without scoring). Tokens that need scores are scored
    group at a time over the entries below the group's largest bound; each token keeps its own.
    """
    pos = np.asarray(positions, dtype=np.int64)
    n_tok = len(pos)
    q_hat = index_queries(iq, pos, inv)
    w = (np.asarray(iw, dtype=F32) * F32(w_scale)).astype(F32)
    k_all = dequantise_index_record(np.asarray(index_records, dtype=np.uint8))
    sel = np.full((n_tok, topk), -1, dtype=np.int32)
    all_scores = [None] * n_tok
    ranges = [visible_range(4, p0, p) for p in pos]
    need = [t for t in range(n_tok) if ranges[t][1] - ranges[t][0] > topk]
    for t in range(n_tok):
        lo, hi = ranges[t]
        if hi - lo <= topk:
            sel[t, :hi - lo] = np.arange(lo, hi)
            all_scores[t] = (lo, None)
    for a in range(0, len(need), group):
        ts = need[a:a + group]
        top = max(ranges[t][1] for t in ts)
        sc = index_scores(q_hat[ts], w[ts], k_all[:top])
        for i, t in enumerate(ts):
            lo, hi = ranges[t]
            sel[t] = select_topk(sc[i, lo:hi], lo, topk)
            all_scores[t] = (lo, sc[i, lo:hi])
    return (sel, all_scores) if return_scores else sel


# ---------------------------------------------------------------------------------------------
# Attention over the union (SPEC §8.6), exact binary32


def union_candidates(ratio, p0, p, sel_row=None):
    """(SWA positions, compressed entries) of a query at p, each in increasing order (§8.4, §8.6)."""
    swa = R.attention_candidates(p, p0)
    if ratio == 4:
        ent = np.asarray(sel_row, dtype=np.int64)
        ent = ent[:np.argmax(ent < 0)] if np.any(ent < 0) else ent
    elif ratio == 128:
        lo, hi = visible_range(ratio, p0, p)
        ent = np.arange(lo, hi, dtype=np.int64)
    else:
        ent = np.zeros(0, dtype=np.int64)
    return swa, ent


def _dot512_exact(q, k):
    """§2's 512-long dot order for q [..., 512] . k [..., 512] (broadcast): 32 fma partials of 16,
    folded 16, 8, 4, 2, 1."""
    acc = _dot_partials(q, k, 32)
    for step in (16, 8, 4, 2, 1):
        acc = (acc[..., :step] + acc[..., step:2 * step]).astype(F32)
    return acc[..., 0]


def attention_exact(q, keys, rope_row, sink=None, valid=None):
    """Query tokens in §7's binary32 order over their candidates (in candidate order).

    q [G, H, 512] bf16 bits, keys [G, nc, 512] float32, rope_row [G, 64], sink [H] or None; valid
    [G, nc] marks real candidates (default all). Padding sits after a token's candidates with weight
    exactly 0: S + 0 = S, and fmaf(0, 0, N) = N because N is never -0 (it starts at +0, and a sum
    in round-to-nearest is -0 only when both addends are). Returns (out [G, H, 512] bf16 bits, lse
    [G, H] float32).
    """
    qf = R.bf16_to_f32(np.asarray(q, dtype=np.uint16))
    keys = np.asarray(keys, dtype=F32)
    g, nc = keys.shape[:2]
    if valid is None:
        valid = np.ones((g, nc), dtype=bool)
    d = _dot512_exact(qf[:, :, None, :], keys[:, None, :, :])  # [G, H, nc]
    logit = np.where(valid[:, None, :], (d * SOFTMAX_SCALE).astype(F32), F32(-np.inf))
    m = np.max(logit, axis=2)
    w = np.where(valid[:, None, :], dsv4_expf((logit - m[..., None]).astype(F32)), F32(0))
    S = np.zeros(m.shape, dtype=F32)
    N = np.zeros(qf.shape, dtype=F32)
    for s in range(nc):
        S = (S + w[..., s]).astype(F32)
        N = R.fmaf(w[..., s:s + 1], keys[:, None, s, :], N)
    D = S
    if sink is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            D = (S + dsv4_expf((np.asarray(sink, dtype=F32)[None, :] - m).astype(F32))).astype(F32)
    with np.errstate(invalid="ignore"):
        o = (N / D[..., None]).astype(F32)
    rope_row = np.asarray(rope_row, dtype=F32)
    c = rope_row[:, None, :R.ROPE_PAIRS]
    sn = rope_row[:, None, R.ROPE_PAIRS:]
    e, od = o[..., R.NOPE_DIM::2], o[..., R.NOPE_DIM + 1::2]
    out = o.copy()
    out[..., R.NOPE_DIM::2] = R.fmaf(e, c, (od * sn).astype(F32))
    out[..., R.NOPE_DIM + 1::2] = R.fmaf(-e, sn, (od * c).astype(F32))
    lse = (m + dsv4_logf(S)).astype(F32)
    return R.f32_to_bf16(out), lse


def _records_lookup(records, first, idx):
    """Rows idx - first of a record array, or records[p] of a {position: record} dict."""
    if isinstance(records, dict):
        return np.stack([records[int(i)] for i in idx]) if len(idx) else \
            np.zeros((0, R.RECORD_BYTES), dtype=np.uint8)
    return np.asarray(records)[np.asarray(idx, dtype=np.int64) - first]


def union_keys(ratio, p0, p, swa_records, c_records, sel_row=None, swa_first=None):
    """The dequantised candidates of a query at p: [nc, 512] float32, window then entries."""
    swa, ent = union_candidates(ratio, p0, p, sel_row)
    first = p0 if swa_first is None else swa_first
    recs = [_records_lookup(swa_records, first, swa)]
    if len(ent):
        recs.append(_records_lookup(c_records, 0, ent))
    return R.dequantise_record(np.concatenate(recs))


def attention_union(q_out, positions, p0, swa_records, c_records, ratio, inv, sel=None, sink=None,
                    swa_first=None, group=16):
    """Exact-mode attention over the window and the compressed entries (SPEC §8.6) of the tokens
    of one sequence: q_out [N, H, 512] bf16 bits (the insert's rotated queries); swa_records the
    records of positions swa_first.. (default p0) as an array, or a {position: record} dict;
    c_records [n_entries, 584] indexed by j; sel [N, topk] (ratio 4) as from indexer_select.
    Returns (out [N, H, 512] bf16 bits, lse [N, H] float32). Tokens are computed group at a time;
    each token's result is independent of its group."""
    pos = np.asarray(positions, dtype=np.int64)
    q_out = np.asarray(q_out, dtype=np.uint16)
    rows = R.rope_rows(inv, pos)
    out = np.empty(q_out.shape, dtype=np.uint16)
    lse = np.empty(out.shape[:2], dtype=F32)
    for a in range(0, len(pos), group):
        b = min(a + group, len(pos))
        keys = [union_keys(ratio, p0, pos[t], swa_records, c_records,
                           None if sel is None else sel[t], swa_first) for t in range(a, b)]
        nc = max(k.shape[0] for k in keys)
        kk = np.zeros((b - a, nc, R.HEAD_DIM), dtype=F32)
        valid = np.zeros((b - a, nc), dtype=bool)
        for i, k in enumerate(keys):
            kk[i, :len(k)] = k
            valid[i, :len(k)] = True
        out[a:b], lse[a:b] = attention_exact(q_out[a:b], kk, rows[a:b], sink, valid)
    return out, lse


def attention_union_f64(q_out, positions, p0, swa_records, c_records, ratio, inv, sel=None,
                        sink=None, swa_first=None):
    """The same attention in binary64 (dsv4_ref.attention_token): a list of (out [H, 512] binary64,
    lse [H], mag) per token, for tolerance checks of a binary32 result in any order."""
    pos = np.asarray(positions, dtype=np.int64)
    rows = R.rope_rows(inv, pos)
    res = []
    for t, p in enumerate(pos):
        keys = union_keys(ratio, p0, p, swa_records, c_records,
                          None if sel is None else sel[t], swa_first)
        res.append(R.attention_token(q_out[t], keys, rows[t], sink))
    return res


# ---------------------------------------------------------------------------------------------
# Paged layouts of the compressed caches (SPEC §8.7)


def write_c_records(c_cache, records, js, c_block_of, bs):
    """Store entry records in a compressed cache (the §3 layout): entry j goes to offset j % bs of
    physical block c_block_of(j // bs)."""
    slots = [c_block_of(int(j) // bs) * bs + int(j) % bs for j in js]
    return R.write_records(c_cache, records, slots, bs)


def write_index_records(i_cache, irecs, js, c_block_of, bs):
    """Store index records: values at 64 * o, codes at 64 * bs + 4 * o of the block's 68 * bs bytes."""
    blk = INDEX_RECORD_BYTES * bs
    for rec, j in zip(irecs, js):
        base = c_block_of(int(j) // bs) * blk
        o = int(j) % bs
        i_cache[base + 64 * o:base + 64 * o + 64] = rec[:64]
        i_cache[base + 64 * bs + 4 * o:base + 64 * bs + 4 * o + 4] = rec[64:68]
    return i_cache


def read_index_record(i_cache, block, o, bs):
    base = block * INDEX_RECORD_BYTES * bs
    return np.concatenate([i_cache[base + 64 * o:base + 64 * o + 64],
                           i_cache[base + 64 * bs + 4 * o:base + 64 * bs + 4 * o + 4]])
