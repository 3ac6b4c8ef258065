"""An independent numpy model of the dsv4d contract (SPEC.md sections 2 to 4).

It is written from SPEC.md alone, so that the C backends and this file check each other. Everything is
exact IEEE binary32 arithmetic: numpy float32 operations round once to nearest-even and never flush
subnormals, and the few operations numpy lacks (a fused multiply-add, correctly rounded cos/sin) are
built here with a proof of correct rounding next to them.

Only the standard library, numpy and xxhash are used (/usr/bin/python3).
"""

import decimal
import fractions
import math
import re as _re
import struct

import numpy as np
import xxhash

F32 = np.float32
F64 = np.float64

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_PAIRS = 32
TILE = 64
NTILES = 7
TOKEN_DATA_BYTES = 576
SCALE_BYTES = 8
RECORD_BYTES = 584
WINDOW = 128
MAX_POSITION = 1048576
EPS = F32(1e-6)  # 0x358637BD

# ---------------------------------------------------------------------------------------------
# bf16 <-> fp32


def bf16_to_f32(u16):
    """bf16 bit patterns (any integer array) -> float32: exact, the 16 bits shifted up."""
    u = np.asarray(u16).astype(np.uint32) << np.uint32(16)
    return u.view(F32)


def f32_to_bf16(x):
    """float32 -> bf16 bit patterns (uint16), round to nearest, ties to even. Inputs are finite here."""
    u = np.ascontiguousarray(np.asarray(x, dtype=F32)).view(np.uint32).astype(np.uint64)
    lsb = (u >> np.uint64(16)) & np.uint64(1)
    r = (u + np.uint64(0x7FFF) + lsb) >> np.uint64(16)
    return r.astype(np.uint16)


def f32_bits(x):
    return np.ascontiguousarray(np.asarray(x, dtype=F32)).view(np.uint32)


def f32_from_bits(u):
    return np.asarray(u, dtype=np.uint32).view(F32)


# ---------------------------------------------------------------------------------------------
# An exact binary32 fused multiply-add.
#
# For binary32 a, b the product a*b has at most 48 significant bits and an exponent in
# [-298, 256], so it is exact in binary64. The binary64 sum s = RN64(p + c) is then corrected to
# round-to-odd: the two-sum error t = (p + c) - s is exact (Knuth's TwoSum, no overflow at these
# magnitudes); when t != 0 and the last significand bit of s is even, the true value lies strictly
# between s and its neighbour towards t, and that neighbour has an odd last bit, so it is the
# round-to-odd result. Rounding a 53-bit round-to-odd value to 24 bits with nearest-even gives the
# correctly rounded result of the exact sum whenever 53 >= 24 + 2 (Boldo and Melquiond, "Emulation
# of FMA and correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008). The
# final float64 -> float32 conversion is IEEE round-to-nearest-even, including into the binary32
# subnormal range (binary64 has no subnormals there, so no earlier rounding interferes).


def fmaf(a, b, c):
    a = np.asarray(a, dtype=F32).astype(F64)
    b = np.asarray(b, dtype=F32).astype(F64)
    c = np.asarray(c, dtype=F32).astype(F64)
    p = a * b  # exact
    s = p + c
    bp = s - c
    t = (p - bp) + (c - (s - bp))  # TwoSum error, exact
    sb = np.ascontiguousarray(s).view(np.uint64)
    even = (sb & np.uint64(1)) == 0
    fix = (t != 0) & even
    if np.any(fix):
        s = np.where(fix, np.nextafter(s, np.where(t > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


# ---------------------------------------------------------------------------------------------
# Canonical reductions (SPEC §2)


def sum_squares(x):
    """Canonical sum of squares over the last axis (512): 32 fma chains of 16, then a tree fold."""
    x = np.asarray(x, dtype=F32)
    assert x.shape[-1] == HEAD_DIM
    xs = x.reshape(x.shape[:-1] + (32, 16))
    acc = np.zeros(x.shape[:-1] + (32,), dtype=F32)
    for k in range(16):
        v = xs[..., k]
        acc = fmaf(v, v, acc)
    for step in (16, 8, 4, 2, 1):
        acc = (acc[..., :step] + acc[..., step:2 * step]).astype(F32)
    return acc[..., 0]


def dot512(a, b):
    """The same canonical order for a 512-long dot product (used by attention, SPEC §7)."""
    a = np.asarray(a, dtype=F32)
    b = np.asarray(b, dtype=F32)
    a, b = np.broadcast_arrays(a, b)
    xa = a.reshape(a.shape[:-1] + (32, 16))
    xb = b.reshape(b.shape[:-1] + (32, 16))
    acc = np.zeros(a.shape[:-1] + (32,), dtype=F32)
    for k in range(16):
        acc = fmaf(xa[..., k], xb[..., k], acc)
    for step in (16, 8, 4, 2, 1):
        acc = (acc[..., :step] + acc[..., step:2 * step]).astype(F32)
    return acc[..., 0]


def rms_factor(ss, eps=EPS):
    """r = 1.0f / sqrtf(ss * 0x1p-9f + eps), each operation rounded once in binary32."""
    ss = np.asarray(ss, dtype=F32)
    t = (ss * F32(2.0 ** -9)).astype(F32)
    t = (t + F32(eps)).astype(F32)
    return (F32(1.0) / np.sqrt(t)).astype(F32)


# ---------------------------------------------------------------------------------------------
# fp8 E4M3FN and UE8M0 (SPEC §2.2)


def e4m3_decode_table():
    """The 256 E4M3FN byte values as float64 (0x7F and 0xFF are NaN)."""
    t = np.zeros(256, dtype=F64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 7
        if e == 15 and m == 7:
            t[b] = np.nan
        elif e == 0:
            t[b] = s * m * 2.0 ** -9
        else:
            t[b] = s * (1 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3_TABLE = e4m3_decode_table()


def e4m3_decode(b):
    return E4M3_TABLE[np.asarray(b, dtype=np.uint8)].astype(F32)


def e4m3_encode(v):
    """float32 -> E4M3FN byte: nearest-even on the e4m3 grid, saturating at 448 (0x7E), sign from v.

    The magnitude is placed on its binade's grid in float64, where |v| / step is exact, and rounded
    with np.rint (ties to even). Values below 2^-6 use the subnormal step 2^-9; a subnormal that
    rounds up to 8 * 2^-9 becomes the byte 0x08, which is exactly 2^-6, so no special case is needed,
    and likewise a mantissa that rounds up to 16 carries into the next exponent.
    """
    v = np.asarray(v, dtype=F32)
    sign = ((f32_bits(v) >> np.uint32(31)) & np.uint32(1)).astype(np.uint8)
    a = np.abs(v.astype(F64))
    sub = a < 2.0 ** -6
    _, ex = np.frexp(np.where(sub, 1.0, a))  # a = m * 2^ex, m in [0.5, 1)
    E = ex - 1  # a in [2^E, 2^(E+1))
    step = np.where(sub, 2.0 ** -9, np.ldexp(1.0, E - 3))
    q = np.rint(a / step)
    code = np.where(sub, q, (E + 7) * 8 + (q - 8))
    code = np.minimum(code, 0x7E).astype(np.uint8)
    return (code | (sign << np.uint8(7))).astype(np.uint8)


def ue8m0_exponent(amax):
    """The smallest integer e with amax <= 448 * 2^e (exact comparison), amax already >= 1e-4f."""
    amax = np.asarray(amax, dtype=F32).astype(F64)
    e = np.ceil(np.log2(amax / 448.0)).astype(np.int64)
    # Repair any rounding of the estimate with exact comparisons against 448 * 2^e (exact in
    # binary64 and in binary32 over the admissible range).
    for _ in range(3):
        e = np.where(amax > np.ldexp(448.0, e), e + 1, e)
        e = np.where(amax <= np.ldexp(448.0, e - 1), e - 1, e)
    return e


# ---------------------------------------------------------------------------------------------
# RoPE (SPEC §2.3)

PLAIN_INV_FREQ_BITS = [int(h, 16) for h in """
3f800000 3f3ff911 3f0ff59a 3ed7e89b 3ea1e89b 3e72d423 3e361887 3e088d77 3dcccccd
3d99940d 3d6655c2 3d2cba16 3d0186e3 3cc2434f 3c91ad39 3c5a7bf2 3c23d70a 3bf5b9b0 3bb8449c 3b8a2e77 3b4f3e38
3b1b690d 3ae91528 3aaec98e 3a83126f 3a44948d 3a136a16 39dd1725 39a5cb60 3978a815 393a7753 390bd472
""".split()]
YARN_INV_FREQ_BITS = [int(h, 16) for h in """
3f800000 3f300a3a 3ef21c1f
3ea67d01 3e64f92e 3e1d7475 3dd88cb4 3d94e963 3d4ccccd 3d0cd4fb 3cc1b019 3c8530ce 3c372dbf 3bfbed88 3bad3d5e
3b6e4237 3b147ae1 3ab714e0 3a5ebdb6 3a0530ce 399bb3af 39305978 38be904d 383e9b5f 37a3d70c 36b443d0 3677eba6
362a7be8 35ea77ff 35a13bdc 355dbf30 35187c4d
""".split()]
assert len(PLAIN_INV_FREQ_BITS) == 32 and len(YARN_INV_FREQ_BITS) == 32

PLAIN_DEFAULT = dict(theta=10000.0, yarn=False)
YARN_DEFAULT = dict(theta=160000.0, yarn=True, factor=16.0, original_max_position=65536.0,
                    beta_fast=32.0, beta_slow=1.0)

TABLE_SHA256 = {
    "plain": "82e5a402b27b92649a5f0220edfc83c7702a3f6fdc3e6c42e00c82d2a629a926",
    "yarn": "c40e5c33c4ec9b5c508c417ebb63854b8d1ab2e3342aa676d776dd3cf9121afc",
}


def inv_freq_recipe(theta, yarn=False, factor=1.0, original_max_position=4096.0, beta_fast=32.0,
                    beta_slow=1.0):
    """The SPEC recipe for other RoPE parameters (binary32 except where it says double)."""
    base = np.array([F32(math.pow(theta, float(F64(F32(2 * i) / F32(64.0))))) for i in range(32)],
                    dtype=F32)
    extrap = (F32(1.0) / base).astype(F32)
    if not yarn:
        return extrap
    interp = (F32(1.0) / (F32(factor) * base).astype(F32)).astype(F32)

    def corr(n):
        return 64.0 * math.log(original_max_position / (n * 2.0 * math.pi)) / (2.0 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), 63)
    high = float(high)
    if high == low:
        high += 0.001
    idx = np.arange(32, dtype=F32)
    ramp = ((idx - F32(low)).astype(F32) / F32(high - low)).astype(F32)
    ramp = np.clip(ramp, F32(0.0), F32(1.0)).astype(F32)
    mask = (F32(1.0) - ramp).astype(F32)
    a = (interp * (F32(1.0) - mask).astype(F32)).astype(F32)
    b = (extrap * mask).astype(F32)
    return (a + b).astype(F32)


def inv_freq(kind="plain", **params):
    """The 32 inverse frequencies: the SPEC lists for the built-in sets, the recipe otherwise."""
    if kind == "plain" and not params:
        return f32_from_bits(PLAIN_INV_FREQ_BITS)
    if kind == "yarn" and not params:
        return f32_from_bits(YARN_INV_FREQ_BITS)
    if kind == "plain":
        return inv_freq_recipe(**{"theta": 10000.0, **params})
    return inv_freq_recipe(**{**YARN_DEFAULT, **params})


# 120 digits of pi for the high-precision fallback below.
_PI_STR = ("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803482"
           "5342117067982148086513282306647")


def _dec_cos_sin(a_float, prec=60):
    """cos and sin of a binary64 value, as Decimals with about prec significant digits.

    Range reduction subtracts k * (pi/2) with pi known to 120 digits; |a| < 2^21, so the reduced
    argument keeps more than 100 correct digits. The Taylor series then converge in a few dozen
    terms for |r| <= pi/4.
    """
    ctx = decimal.Context(prec=prec + 30)
    a = ctx.create_decimal(a_float)  # exact: a binary64 value has a finite decimal expansion
    pi = ctx.create_decimal(_PI_STR)
    half_pi = ctx.divide(pi, 2)
    k = int(ctx.to_integral_value(ctx.divide(a, half_pi)))
    r = ctx.subtract(a, ctx.multiply(k, half_pi))

    def series(x, start):
        term = ctx.create_decimal(1) if start == 0 else x
        total = term
        n = start
        x2 = ctx.multiply(x, x)
        while True:
            term = ctx.divide(ctx.multiply(term, -x2), (n + 1) * (n + 2))
            n += 2
            if term == 0 or abs(term) < ctx.create_decimal("1e-%d" % (prec + 20)):
                break
            total = ctx.add(total, term)
        return total

    c = series(r, 0)
    s = series(r, 1)
    q = k % 4
    if q == 0:
        return c, s
    if q == 1:
        return -s, c
    if q == 2:
        return -c, -s
    return s, -c


def _round_decimal_to_f32(d):
    """Correctly round a Decimal (with enough digits) to binary32, with exact rational arithmetic."""
    fr = fractions.Fraction(d)
    if fr == 0:
        return F32(0.0)
    sign = -1 if fr < 0 else 1
    fr = abs(fr)
    E = math.floor(math.log2(float(fr)))
    while fractions.Fraction(2) ** E > fr:
        E -= 1
    while fractions.Fraction(2) ** (E + 1) <= fr:
        E += 1
    ulp_e = max(E, -126) - 23
    n = round(fr / fractions.Fraction(2) ** ulp_e)  # round() of a Fraction is half-to-even
    return F32(sign * math.ldexp(n, ulp_e))


def _cr_f32(vals64, angles, fn_index):
    """Round binary64 approximations of cos/sin to binary32, exactly.

    vals64 comes from a libm-quality evaluation (error far below 2^-40 relative). Converting it to
    binary32 is the correctly rounded result unless the true value is close to a binary32 rounding
    boundary (a midpoint between two binary32 values). Values within 2^-20 binary32 ulp (about 2^-43
    relative) of a midpoint, or near zero, are recomputed with Decimal arithmetic and rounded from
    there. The full built-in tables produced this way match SPEC §2.3's SHA-256 digests
    (test_model.py checks both).
    """
    f = vals64.astype(F32)
    f64 = f.astype(F64)
    # Distance to the nearest midpoint, in units of the binary32 ulp of f.
    up = np.nextafter(f, F32(np.inf)).astype(F64)
    dn = np.nextafter(f, F32(-np.inf)).astype(F64)
    mid_up = (f64 + up) / 2
    mid_dn = (f64 + dn) / 2
    ulp = (up - f64)
    dist = np.minimum(np.abs(vals64 - mid_up), np.abs(vals64 - mid_dn)) / ulp
    hard = (dist < 2.0 ** -20) | (np.abs(vals64) < 2.0 ** -60)
    if np.any(hard):
        idx = np.nonzero(hard)
        for j in zip(*idx):
            c, s = _dec_cos_sin(float(angles[j]))
            f[j] = _round_decimal_to_f32(c if fn_index == 0 else s)
    return f


def rope_rows(inv, positions):
    """Rows for positions: [n, 64] float32, cos[0..31] then sin[0..31] of (float)pos * inv_freq[i].

    The angle is the binary32 product; its cosine and sine are computed in binary64 by the C library
    (via numpy) and rounded to binary32 by _cr_f32, which falls back to 60-digit Decimal arithmetic
    whenever the binary64 value is too close to a rounding boundary for its own error to be excluded.
    """
    pos = np.asarray(positions, dtype=np.int64)
    inv = np.asarray(inv, dtype=F32)
    ang = (pos.astype(F32)[:, None] * inv[None, :]).astype(F32)
    a64 = ang.astype(F64)
    c = _cr_f32(np.cos(a64), a64, 0)
    s = _cr_f32(np.sin(a64), a64, 1)
    return np.concatenate([c, s], axis=1).astype(F32)


def rope_row_exact(inv, pos):
    """One row computed entirely with Decimal arithmetic (slow; a cross-check of rope_rows)."""
    inv = np.asarray(inv, dtype=F32)
    ang = (F32(pos) * inv).astype(F32)
    out = np.zeros(64, dtype=F32)
    for i in range(32):
        c, s = _dec_cos_sin(float(ang[i]))
        out[i] = _round_decimal_to_f32(c)
        out[32 + i] = _round_decimal_to_f32(s)
    return out


# ---------------------------------------------------------------------------------------------
# The Q and KV paths (SPEC §2.1, §2.2)


def _rope_apply(e, o, c, s):
    """Returns (fmaf(e, c, -(o*s)), fmaf(e, s, o*c)) in binary32."""
    os_ = (o * s).astype(F32)
    oc = (o * c).astype(F32)
    return fmaf(e, c, -os_), fmaf(e, s, oc)


def q_path(q, rows, eps=EPS):
    """q: [N, H, 512] bf16 bits; rows: [N, 64] float32 RoPE rows. Returns q_out [N, H, 512] uint16."""
    q = np.asarray(q, dtype=np.uint16)
    x = bf16_to_f32(q)
    r = rms_factor(sum_squares(x), eps)
    y = (x * r[..., None]).astype(F32)
    out = np.empty(q.shape, dtype=np.uint16)
    out[..., :NOPE_DIM] = f32_to_bf16(y[..., :NOPE_DIM])
    e = y[..., NOPE_DIM::2]
    o = y[..., NOPE_DIM + 1::2]
    c = rows[:, None, :32]
    s = rows[:, None, 32:]
    re, ro = _rope_apply(e, o, c, s)
    out[..., NOPE_DIM::2] = f32_to_bf16(re)
    out[..., NOPE_DIM + 1::2] = f32_to_bf16(ro)
    return out


def kv_records(kv, rows, kv_norm_weight=None, eps=EPS):
    """kv: [N, 512] bf16 bits; rows [N, 64]. Returns the [N, 584] uint8 logical records."""
    kv = np.asarray(kv, dtype=np.uint16)
    n = kv.shape[0]
    z = bf16_to_f32(kv)
    if kv_norm_weight is not None:
        w = np.asarray(kv_norm_weight, dtype=F32)
        r = rms_factor(sum_squares(z), eps)
        z = bf16_to_f32(f32_to_bf16(((z * r[:, None]).astype(F32) * w[None, :]).astype(F32)))
    rec = np.zeros((n, RECORD_BYTES), dtype=np.uint8)
    # RoPE dims.
    e = z[:, NOPE_DIM::2]
    o = z[:, NOPE_DIM + 1::2]
    re, ro = _rope_apply(e, o, rows[:, :32], rows[:, 32:])
    rope = np.empty((n, 64), dtype=np.uint16)
    rope[:, 0::2] = f32_to_bf16(re)
    rope[:, 1::2] = f32_to_bf16(ro)
    rec[:, NOPE_DIM:NOPE_DIM + 128] = rope.astype("<u2").view(np.uint8).reshape(n, 128)
    # NoPE tiles.
    nope = z[:, :NOPE_DIM].reshape(n, NTILES, TILE)
    amax = np.max(np.abs(nope), axis=2)
    amax = np.maximum(amax, F32(1e-4)).astype(F32)
    e = ue8m0_exponent(amax)
    code = e + 127
    assert np.all((code >= 105) & (code <= 247)), "inadmissible input (|x| >= 2^59?)"
    inv_scale = f32_from_bits(((127 - e).astype(np.uint32)) << np.uint32(23))
    v = (nope * inv_scale[:, :, None]).astype(F32)
    rec[:, :NOPE_DIM] = e4m3_encode(v).reshape(n, NOPE_DIM)
    rec[:, 576:583] = code.astype(np.uint8)
    rec[:, 583] = 0
    return rec


def dequantise_record(rec):
    """A logical record -> 512 float32 values (NoPE e4m3 * 2^(code-127), RoPE bf16), exact."""
    rec = np.asarray(rec, dtype=np.uint8)
    codes = rec[..., 576:583].astype(np.int64)
    nope = e4m3_decode(rec[..., :NOPE_DIM]).astype(F64).reshape(rec.shape[:-1] + (NTILES, TILE))
    nope = np.ldexp(nope, (codes - 127)[..., None]).astype(F32).reshape(rec.shape[:-1] + (NOPE_DIM,))
    rope = bf16_to_f32(np.ascontiguousarray(rec[..., NOPE_DIM:576]).view("<u2"))
    return np.concatenate([nope, rope], axis=-1)


# ---------------------------------------------------------------------------------------------
# The paged cache (SPEC §3)


def block_stride(bs):
    return -(-(bs * RECORD_BYTES) // TOKEN_DATA_BYTES) * TOKEN_DATA_BYTES


def write_records(cache, records, slots, bs):
    """Store records at slots (slot < 0: skipped) in a layer's cache buffer (uint8, modified)."""
    stride = block_stride(bs)
    for rec, slot in zip(records, slots):
        slot = int(slot)
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        base = b * stride
        cache[base + TOKEN_DATA_BYTES * o: base + TOKEN_DATA_BYTES * (o + 1)] = rec[:576]
        so = base + TOKEN_DATA_BYTES * bs + SCALE_BYTES * o
        cache[so:so + SCALE_BYTES] = rec[576:584]
    return cache


def read_record(cache, slot, bs):
    stride = block_stride(bs)
    b, o = divmod(int(slot), bs)
    base = b * stride
    so = base + TOKEN_DATA_BYTES * bs + SCALE_BYTES * o
    return np.concatenate([cache[base + TOKEN_DATA_BYTES * o: base + TOKEN_DATA_BYTES * (o + 1)],
                           cache[so:so + SCALE_BYTES]])


def qkv_insert(q, kv, positions, slots, cache, bs, rope="plain", kv_norm_weight=None, write_kv=True,
               eps=EPS, inv=None):
    """The whole insert step: returns (q_out, records); cache (uint8 buffer) is updated in place."""
    if inv is None:
        inv = inv_freq(rope)
    rows = rope_rows(inv, positions)
    q_out = q_path(q, rows, eps)
    records = kv_records(kv, rows, kv_norm_weight, eps)
    if write_kv:
        write_records(cache, records, slots, bs)
    return q_out, records


# ---------------------------------------------------------------------------------------------
# Attention, exact mode (SPEC §7), in binary64
#
# The daemon computes attention in binary32 in one canonical order. This model computes the same
# quantity in binary64 from the same inputs (the rotated queries and the stored records), so it
# checks the kernels' mathematics to within their roundings, whatever their order. It also returns
# the magnitudes that bound those roundings (a test turns them into tolerances).

SOFTMAX_SCALE = float(f32_from_bits(np.uint32(0x3D3504F3)))  # the SPEC's fp32 512^-0.5


def attention_candidates(pos, p0):
    """The positions a query at pos attends to: max(p0, pos - 127)..pos, in increasing order."""
    return np.arange(max(int(p0), int(pos) - (WINDOW - 1)), int(pos) + 1, dtype=np.int64)


def compressed_entries(pos, p0, ratio, sel=None):
    """The compressed entries a query at pos attends to after its window (SPEC §8.4, §8.6), in list
    order: with sel None every visible entry, floor(p0 / ratio) <= j < floor((pos + 1) / ratio);
    else the row sel up to its first -1, each entry checked to be visible and above the one before.
    """
    lo, hi = int(p0) // ratio, (int(pos) + 1) // ratio
    if sel is None:
        return np.arange(lo, max(lo, hi), dtype=np.int64)
    out = []
    for j in (int(x) for x in sel):
        if j == -1:
            break
        if not (lo <= j < hi and (not out or j > out[-1])):
            raise ValueError("entry %d is not visible at position %d or not increasing" % (j, pos))
        out.append(j)
    return np.array(out, dtype=np.int64)


def attention_keys(cache, bs, slots):
    """The candidates' 584-byte records read from the paged cache and decoded (SPEC §3): exact
    values as [n, 512] binary64."""
    recs = np.stack([read_record(cache, s, bs) for s in slots])
    return dequantise_record(recs).astype(F64)


def attention_token(q, keys, rope_row, sink=None):
    """One query token: q [H, 512] bf16 bits, keys [nc, 512] (in list order: the window's positions,
    then on a compressed layer the entries of compressed_entries, SPEC §8.6), rope_row the 64
    fp32 table values of the query's position (cos then sin), sink [H] or None.

    Returns (out, lse, mag): out [H, 512] binary64 after the inverse rotation (before any rounding
    to bf16), lse [H] = m + ln(sum of the weights), the sink excluded, and mag, a dict of the
    magnitudes the binary32 roundings scale with: 'dot' [H, nc] = sum |q_i k_i| times the scale
    (the logits' error scale), 'acc' [H, 512] = sum_s w_s |k_s[d]| / D (the outputs' error scale
    before the rotation), 'nc' the candidate count."""
    qf = bf16_to_f32(np.asarray(q, dtype=np.uint16)).astype(F64)
    keys = np.asarray(keys, dtype=F64)
    logits = (qf @ keys.T) * SOFTMAX_SCALE
    m = logits.max(axis=1)
    w = np.exp(logits - m[:, None])
    total = w.sum(axis=1)
    den = total.copy()
    if sink is not None:
        with np.errstate(over="ignore"):
            den = den + np.exp(np.asarray(sink, dtype=F64) - m)
    o = (w @ keys) / den[:, None]  # a sink of +inf: D = inf and every output 0
    acc = (w @ np.abs(keys)) / den[:, None]
    c = np.asarray(rope_row[:ROPE_PAIRS], dtype=F64)
    sn = np.asarray(rope_row[ROPE_PAIRS:], dtype=F64)
    e, od = o[:, NOPE_DIM::2], o[:, NOPE_DIM + 1::2]
    out = o.copy()
    out[:, NOPE_DIM::2] = e * c + od * sn
    out[:, NOPE_DIM + 1::2] = -e * sn + od * c
    mag = {"dot": (np.abs(qf) @ np.abs(keys).T) * SOFTMAX_SCALE, "acc": acc, "nc": keys.shape[0],
           "cos": c, "sin": sn}
    return out, m + np.log(total), mag


# ---------------------------------------------------------------------------------------------
# Digests (SPEC §3.1)


def xxh3_hex(data):
    return "%016x" % xxhash.xxh3_64_intdigest(bytes(data))


def records_digest(positions, records):
    """XXH3 over [LE int64 position | 584-byte record] in list order, as 16 hex digits."""
    h = xxhash.xxh3_64()
    for p, rec in zip(positions, records):
        h.update(struct.pack("<q", int(p)))
        h.update(np.asarray(rec, dtype=np.uint8).tobytes())
    return "%016x" % h.intdigest()


def block_digest(cache, block, bs):
    stride = block_stride(bs)
    return xxh3_hex(cache[block * stride:(block + 1) * stride])


def pool_digest(layer, cache, used_blocks, bs):
    """XOR over used blocks b of XXH3(LE32 layer | LE32 b | block bytes), as 16 hex digits."""
    stride = block_stride(bs)
    acc = 0
    for b in used_blocks:
        acc ^= xxhash.xxh3_64_intdigest(struct.pack("<II", layer, b) +
                                        bytes(cache[b * stride:(b + 1) * stride]))
    return "%016x" % acc


# ---------------------------------------------------------------------------------------------
# The sequence table and SWA slot mapper (SPEC §4)
#
# Physical block ids are the daemon's choice, so integration tests should compare counts (held,
# used, free), logical contents (records, digests of record lists) and errors, not ids. The model
# still hands out its own ids (lowest free first) so that it can produce a complete slot list and
# cache buffer for kernel-level tests; pass alloc= to follow another policy.

_SEQ_NAME = _re.compile(r"^[A-Za-z0-9_:\-][A-Za-z0-9._:\-]{0,127}$")


class SeqError(Exception):
    """A refused batch: code and HTTP status as in SPEC §6, with details (expected positions etc.)."""

    STATUS = {"bad_request": 400, "position_out_of_range": 400, "unknown_layer": 400,
              "duplicate_sequence": 400, "unknown_sequence": 404, "position_mismatch": 409,
              "sequence_exists": 409, "sequence_expired": 410, "kv_pool_exhausted": 503}

    def __init__(self, code, **details):
        super().__init__("%s %s" % (code, details))
        self.code = code
        self.status = self.STATUS[code]
        self.details = details


class Segment:
    """One segment of a batch. key identifies its q and kv bytes (the daemon hashes them with XXH3;
    any value that is equal exactly when the bytes are equal will do, e.g. segment_key(q, kv))."""

    def __init__(self, seq, start, length, new=False, key=None):
        self.seq, self.start, self.len, self.new, self.key = seq, int(start), int(length), bool(new), key


def segment_key(q, kv):
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(q).tobytes() +
                                    np.ascontiguousarray(kv).tobytes())


class _Seq:
    def __init__(self, p0, layers):
        self.p0 = p0
        self.next = {L: p0 for L in layers}         # next position per layer
        self.seg_start = {L: p0 for L in layers}    # s_L: start of the last applied segment
        self.last = {}                              # L -> (start, len, key)
        self.blocks = {}                            # logical block -> physical id
        self.records = {L: {} for L in layers}      # L -> {position: 584-byte record}


class SeqTableModel:
    def __init__(self, n_blocks, block_size=64, layers=(0,), max_position=MAX_POSITION,
                 implicit_create=False, alloc=None):
        self.n_blocks = n_blocks
        self.bs = block_size
        self.layers = list(layers)
        self.max_position = max_position
        self.implicit_create = implicit_create
        self.seqs = {}
        self.expired = set()
        self.free_ids = set(range(n_blocks))
        self.alloc = alloc or (lambda free: min(free))

    # -- queries -------------------------------------------------------------------------------
    def used_blocks(self):
        return self.n_blocks - len(self.free_ids)

    def free_blocks(self):
        return len(self.free_ids)

    def held_blocks(self, name):
        return len(self.seqs[name].blocks)

    def next_positions(self, name):
        return dict(self.seqs[name].next)

    def stored_range(self, name, layer):
        """Positions whose records the sequence digest covers at layer (SPEC §3.1)."""
        s = self.seqs[name]
        if not s.blocks or s.next[layer] == s.p0:
            return range(0)
        first = max(s.p0, min(s.blocks) * self.bs)
        return range(first, s.next[layer])

    def sequence_digest(self, name, layer):
        s = self.seqs[name]
        pos = list(self.stored_range(name, layer))
        return records_digest(pos, [s.records[layer][p] for p in pos])

    def max_blocks_bound(self, k):
        """SPEC §4: a batch adding k positions needs at most this many blocks of one sequence."""
        return -(-(126 + k) // self.bs) + 1

    # -- validation ------------------------------------------------------------------------------
    def _is_replay(self, layer, seg):
        s = self.seqs.get(seg.seq)
        if s is None or layer not in s.last:
            return False
        return s.last[layer] == (seg.start, seg.len, seg.key)

    def validate(self, layer, segments):
        """Raise SeqError as the daemon would, or return (replay, needed_new_blocks_per_segment).

        Precedence when several segments fail differently (the SPEC does not order them; tests
        should send one kind of error per batch): unknown_layer, bad_request,
        position_out_of_range, duplicate_sequence, sequence_expired, unknown_sequence,
        sequence_exists, position_mismatch, kv_pool_exhausted.
        """
        if layer not in self.layers:
            raise SeqError("unknown_layer", layer=layer)
        for seg in segments:
            if not isinstance(seg.seq, str) or not _SEQ_NAME.match(seg.seq) or seg.len < 1:
                raise SeqError("bad_request", seq=seg.seq)
        for seg in segments:
            if seg.start < 0 or seg.start + seg.len > self.max_position:
                raise SeqError("position_out_of_range", seq=seg.seq, start=seg.start, len=seg.len)
        names = [seg.seq for seg in segments]
        if len(set(names)) != len(names):
            raise SeqError("duplicate_sequence", seqs=sorted({n for n in names if names.count(n) > 1}))
        if all(self._is_replay(layer, seg) for seg in segments):
            return True, [0] * len(segments)
        errors = {}
        expected = {}
        for seg in segments:
            s = self.seqs.get(seg.seq)
            if s is None:
                # An expired name answers 410 for one more period, unless the segment recreates it.
                if seg.seq in self.expired and not seg.new:
                    errors.setdefault("sequence_expired", []).append(seg.seq)
                elif not seg.new and not self.implicit_create:
                    errors.setdefault("unknown_sequence", []).append(seg.seq)
                continue
            if seg.new:
                errors.setdefault("sequence_exists", []).append(seg.seq)
                expected[seg.seq] = s.next[layer]
            elif seg.start != s.next[layer]:
                errors.setdefault("position_mismatch", []).append(seg.seq)
                expected[seg.seq] = s.next[layer]
        for code in ("sequence_expired", "unknown_sequence", "sequence_exists", "position_mismatch"):
            if code in errors:
                raise SeqError(code, seqs=errors[code], expected=expected)
        needed = []
        for seg in segments:
            s = self.seqs.get(seg.seq)
            held = s.blocks if s else {}
            lbs = range(seg.start // self.bs, (seg.start + seg.len - 1) // self.bs + 1)
            needed.append(sum(1 for b in lbs if b not in held))
        if sum(needed) > len(self.free_ids):
            raise SeqError("kv_pool_exhausted", needed=sum(needed), free=len(self.free_ids))
        return False, needed

    # -- applying a batch -------------------------------------------------------------------------
    def forward(self, layer, segments, records=None):
        """Validate and apply one batch at layer (as if it then completed on the device).

        records: optional [N, 584] logical records of the batch's tokens in segment order (from
        kv_records), kept so that sequence_digest can be predicted.
        Returns a dict: replayed, slots (model ids; tokens in segment order), new_blocks, released.
        """
        replay, needed = self.validate(layer, segments)
        slots = []
        if replay:
            for seg in segments:
                s = self.seqs[seg.seq]
                for p in range(seg.start, seg.start + seg.len):
                    slots.append(s.blocks[p // self.bs] * self.bs + p % self.bs
                                 if p // self.bs in s.blocks else -1)
            return {"replayed": True, "slots": slots, "new_blocks": 0, "released": 0}
        released = 0
        t = 0
        for seg in segments:
            s = self.seqs.get(seg.seq)
            if s is None:
                # A new sequence (or an implicitly created one) starts where its first segment does.
                s = self.seqs[seg.seq] = _Seq(seg.start, self.layers)
                self.expired.discard(seg.seq)
            for p in range(seg.start, seg.start + seg.len):
                lb = p // self.bs
                if lb not in s.blocks:
                    b = self.alloc(self.free_ids)
                    self.free_ids.remove(b)
                    s.blocks[lb] = b
                slots.append(s.blocks[lb] * self.bs + p % self.bs)
                if records is not None:
                    s.records[layer][p] = np.asarray(records[t], dtype=np.uint8).copy()
                t += 1
            s.next[layer] = seg.start + seg.len
            s.seg_start[layer] = seg.start
            s.last[layer] = (seg.start, seg.len, seg.key)
        for seg in segments:
            released += self._release(self.seqs[seg.seq])
        return {"replayed": False, "slots": slots, "new_blocks": sum(needed), "released": released}

    def _release(self, s):
        """Release block b once max(p0, s_L - 127) > (b+1)*bs - 1 for every served layer."""
        horizon = min(max(s.p0, s.seg_start[L] - (WINDOW - 1)) for L in self.layers)
        gone = [lb for lb in s.blocks if (lb + 1) * self.bs - 1 < horizon]
        for lb in gone:
            self.free_ids.add(s.blocks.pop(lb))
        if gone:
            first = min(s.blocks) * self.bs if s.blocks else horizon
            for L in self.layers:
                for p in [p for p in s.records[L] if p < first]:
                    del s.records[L][p]
        return len(gone)

    def delete(self, name):
        """DELETE /v1/sequences/{name}: frees every block; returns whether it existed."""
        s = self.seqs.pop(name, None)
        if s is None:
            return False
        self.free_ids.update(s.blocks.values())
        return True

    def expire(self, name):
        """The idle timeout: the sequence is deleted and answers sequence_expired for a period."""
        if self.delete(name):
            self.expired.add(name)

    def forget_expired(self, name):
        self.expired.discard(name)
