"""Self-tests of the compressed-branch model (dsv4_ref_compress.py) against SPEC.md §8 facts.

Checked here: the MXFP4 rounding table and exponent rule against exact rationals, the index record
packing, the Hadamard transform against the Sylvester matrix (orthogonal, symmetric, an involution up
to the scale), emission counts and positions, pooling against a scalar transcription of §8.3 and
hand-made cases whose answers are exact, p0 > 0, the selection's tie rule, the union's candidate
order, the binary32 union attention against the binary64 model, and dsv4_expf / dsv4_logf.

Usage: test_compress_model.py [--expf-digest [--jobs N]]   (the flag adds the full 2^32-input digest
sweeps of dsv4_expf and dsv4_logf against tests/support/numerics_digests.h: about an hour of one core,
split over N processes)
"""

import math
import os
import re
import sys
import time
from fractions import Fraction

import numpy as np
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsv4_ref as R  # noqa: E402
import dsv4_ref_compress as C  # noqa: E402

F32 = np.float32
F64 = np.float64
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL " + what)


def bits(x):
    return np.asarray(x, dtype=F32).view(np.uint32)


def bf16_values(rng, shape, scale=1.0):
    return R.bf16_to_f32(R.f32_to_bf16((rng.standard_normal(shape) * scale).astype(F32)))


# ---------------------------------------------------------------------------------------------
# MXFP4 (SPEC §8.5)


def test_mxfp4_ties():
    # amax = 6 gives e = 0, so each value is its own scaled magnitude.
    table = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (6.0, 7),
             (0.2, 0), (0.3, 1), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6),
             (4.9, 6), (5.1, 7), (2.4, 4), (2.6, 5), (0.0, 0)]
    v = np.zeros(32, dtype=F32)
    v[0] = 6.0
    for i, (x, _) in enumerate(table):
        v[1 + i] = x
    v[30] = -0.0
    v[31] = -0.2  # a negative value that rounds to zero keeps its sign bit
    x = np.zeros(128, dtype=F32)
    x[:32] = v
    x[32:64] = -v  # the same magnitudes negated: sign bit 8 on every nibble except -(-0.0) = +0
    nib, codes, deq = C.mxfp4_quantise(x)
    for i, (val, code) in enumerate(table):
        check(nib[1 + i] == code, "e2m1 of %g: nibble %d, want %d" % (val, nib[1 + i], code))
        want_neg = code | 8 if val != 0.0 else 8
        check(nib[33 + i] == want_neg, "e2m1 of -%g: nibble %d" % (val, nib[33 + i]))
    check(nib[30] == 8 and nib[31] == 8, "-0.0 and -0.2 encode as 0x8")
    check(nib[62] == 0, "+0.0 (negated -0.0) encodes as 0x0")
    check(codes[0] == 127 and codes[1] == 127, "amax 6 gives UE8M0 code 127")
    check(codes[2] == 1 and codes[3] == 1, "all-zero blocks take the 6 * 2^-126 floor: code 1")
    check(np.all(deq[:32] == C.E2M1_GRID[nib[:32] & 7] * np.where(nib[:32] & 8, -1, 1)),
          "dequantised values at e = 0 are the grid values")


def test_mxfp4_exponent(rng):
    # amax exactly 6 * 2^e gives e; the next float above gives e + 1 (exact comparison, never log2).
    for e in (-126, -60, -1, 0, 1, 7, 60, 120):
        a = F32(math.ldexp(6.0, e))
        check(C.mx_exponent(a) == e, "mx exponent of 6*2^%d" % e)
        check(C.mx_exponent(np.nextafter(a, F32(np.inf))) == e + 1, "mx exponent just above 6*2^%d" % e)
        check(C.mx_exponent(np.nextafter(a, F32(0))) == e, "mx exponent just below 6*2^%d" % e)
    # Random blocks against exact rational rounding.
    x = (rng.standard_normal((200, 128)) * np.exp2(rng.integers(-30, 30, (200, 1)))).astype(F32)
    x = R.bf16_to_f32(R.f32_to_bf16(x))
    nib, codes, deq = C.mxfp4_quantise(x)
    grid = [Fraction(g).limit_denominator(2) for g in C.E2M1_GRID]
    bad = 0
    for r in range(0, 200, 7):
        for blk in range(4):
            vals = [Fraction(float(t)) for t in x[r, 32 * blk:32 * blk + 32]]
            amax = max(max(abs(t) for t in vals), Fraction(6) * Fraction(2) ** -126)
            e = -200
            while Fraction(6) * Fraction(2) ** e < amax:
                e += 1
            if codes[r, blk] != e + 127:
                bad += 1
            for i, t in enumerate(vals):
                s = abs(t) / Fraction(2) ** e
                dist = [abs(s - g) for g in grid]
                best = min(dist)
                cands = [k for k in range(8) if dist[k] == best]
                want = cands[0] if len(cands) == 1 else [k for k in cands if k % 2 == 0][0]
                if nib[r, 32 * blk + i] & 7 != want:
                    bad += 1
    check(bad == 0, "MXFP4 differs from exact rational rounding in %d places" % bad)
    check(np.array_equal(C.mxfp4_dequantise(nib, codes), deq), "dequantise(quantise) is the grid value")


def test_index_record_layout(rng):
    nib = rng.integers(0, 16, (5, 128)).astype(np.uint8)
    codes = rng.integers(1, 255, (5, 4)).astype(np.uint8)
    rec = C.pack_index_record(nib, codes)
    check(rec.shape == (5, 68), "index record is 68 bytes")
    check(rec[0, 0] == nib[0, 0] | (nib[0, 1] << 4), "element 0 in the low nibble of byte 0")
    check(rec[2, 63] == nib[2, 126] | (nib[2, 127] << 4), "element 127 in the high nibble of byte 63")
    check(np.array_equal(rec[:, 64:], codes), "codes in bytes 64..67")
    n2, c2 = C.unpack_index_record(rec)
    check(np.array_equal(n2, nib) and np.array_equal(c2, codes), "unpack(pack) is the identity")
    bs = 16
    cache = np.zeros(3 * C.INDEX_RECORD_BYTES * bs, dtype=np.uint8)
    table = {0: 2, 1: 0}
    js = [3, 15, 16, 17]
    C.write_index_records(cache, rec[:4], js, lambda lb: table[lb], bs)
    check(np.array_equal(cache[2 * 68 * bs + 64 * 3:2 * 68 * bs + 64 * 4], rec[0, :64]),
          "entry 3 values at 64 * 3 of block 2")
    check(np.array_equal(cache[2 * 68 * bs + 64 * bs + 4 * 3:2 * 68 * bs + 64 * bs + 16], rec[0, 64:]),
          "entry 3 codes at 64 * bs + 4 * 3 of block 2")
    for k, j in enumerate(js):
        got = C.read_index_record(cache, table[j // bs], j % bs, bs)
        check(np.array_equal(got, rec[k]), "index record %d reads back" % j)


# ---------------------------------------------------------------------------------------------
# Hadamard (SPEC §8.5)


def test_hadamard(rng):
    # The transform of unit vectors gives the signs of the matrix it applies.
    eye = np.eye(128, dtype=F32)
    cols = R.bf16_to_f32(C.hadamard128(eye))
    mag = R.bf16_to_f32(R.f32_to_bf16(C.HADAMARD_SCALE))
    check(np.all(np.abs(cols) == mag), "every entry of H e_k is +-bf16(128^-0.5)")
    S = np.sign(cols).astype(np.int64).T  # row k = H e_k, so S = H^T
    pop = np.array([[bin(i & k).count("1") for k in range(128)] for i in range(128)])
    check(np.array_equal(S, (-1) ** pop), "H[i][k] = (-1)^popcount(i & k) (Sylvester order)")
    check(np.array_equal(S, S.T), "H is symmetric")
    check(np.array_equal(S @ S.T, 128 * np.eye(128, dtype=np.int64)), "H H^T = 128 I (orthogonal)")
    check(np.array_equal(S @ S, 128 * np.eye(128, dtype=np.int64)), "H H = 128 I (an involution)")
    # Integer inputs keep every butterfly exact, so the output is bf16(fp32(H x) * scale).
    x = rng.integers(-256, 257, (20, 128)).astype(F32)
    want = R.f32_to_bf16((((x.astype(F64) @ S.T).astype(F32)) * C.HADAMARD_SCALE).astype(F32))
    check(np.array_equal(C.hadamard128(x), want), "butterflies equal the matrix product when exact")
    # Twice, up to the scale and the bf16 roundings: (H/sqrt(128))^2 = I.
    y = bf16_values(rng, (50, 128))
    back = R.bf16_to_f32(C.hadamard128(R.bf16_to_f32(C.hadamard128(y))))
    err = np.max(np.abs(back - y)) / np.max(np.abs(y))
    check(err < 2.0 ** -6, "H(H(x)) = x within the bf16 roundings (max rel err %.2e)" % err)
    # Rounding is exactly once, in binary32 butterflies: a non-integer input where the order matters.
    x2 = np.zeros(128, dtype=F32)
    x2[0], x2[1], x2[2] = F32(1.0), F32(2.0 ** -24), F32(2.0 ** -24)
    # h = 1: a0 = 1 + 2^-24 = 1 (ties to even); h = 2: a0 = 1 + 2^-24 = 1 again: result bf16(scale).
    check(C.hadamard128(x2)[0] == R.f32_to_bf16(C.HADAMARD_SCALE), "butterflies round in binary32")


# ---------------------------------------------------------------------------------------------
# The compressor (SPEC §8.3)


def test_emission(rng):
    check(np.array_equal(C.emitted_entries(4, np.arange(37)), np.arange(9)),
          "ratio 4: positions 0..36 emit entries 0..8")
    pos = np.arange(1000)
    e128 = C.emitted_entries(128, pos)
    check(np.array_equal(e128, np.arange(7)), "ratio 128: positions 0..999 emit entries 0..6")
    check(np.array_equal(pos[(pos + 1) % 128 == 0], 128 * e128 + 127), "entry j at position 128j+127")
    check(len(C.emitted_entries(4, np.arange(5, 7))) == 0, "positions 5, 6 emit nothing")
    # compress_sequence emits exactly these, and the records of a prefix are a prefix of records.
    n = 300
    ckv = rng.standard_normal((n, 1024)).astype(F32)
    ape = rng.standard_normal((128, 512)).astype(F32)
    w = bf16_values(rng, 512, 0.2) + F32(1)
    inv = R.inv_freq("yarn")
    full = C.compress_sequence(128, ckv, np.arange(n), 0, ape, w, inv)
    part = C.compress_sequence(128, ckv[:200], np.arange(200), 0, ape, w, inv)
    check(np.array_equal(full.js, [0, 1]) and np.array_equal(part.js, [0]), "C128 entries 0, 1")
    check(np.array_equal(full.records[:1], part.records), "an entry depends only on its rows")
    n4 = 45
    ckv4 = rng.standard_normal((n4, 2048)).astype(F32)
    ikv4 = rng.standard_normal((n4, 512)).astype(F32)
    c4 = C.compress_sequence(4, ckv4, np.arange(n4), 0, rng.standard_normal((4, 1024)).astype(F32),
                             w, inv, ikv4, rng.standard_normal((4, 256)).astype(F32),
                             bf16_values(rng, 128) + F32(1))
    check(np.array_equal(c4.js, np.arange(11)), "C4 entries 0..10 from 45 positions")
    check(c4.records.shape == (11, 584) and c4.irecs.shape == (11, 68), "C4 record shapes")
    check(np.all(c4.records[:, 583] == 0), "the scale padding byte is 0")


def scalar_pool(kv_rows, s_rows):
    """§8.3 for one channel, transcribed literally: rows in list order, scalars only."""
    m = max(s_rows)
    es = [C.dsv4_expf(np.array([F32(s) - F32(m)], dtype=F32))[0] for s in s_rows]
    S = F32(0.0)
    for e in es:
        S = F32(S + e)
    N = F32(0.0)
    for e, k in zip(es, kv_rows):
        N = R.fmaf(np.array([e]), np.array([k]), np.array([N]))[0]
    return F32(N / S)


def test_pooling(rng):
    inv = R.inv_freq("yarn")
    # Ratio 4: mark every row's halves; with the gates of one row at 0 and all others at -300
    # (dsv4_expf(-300) = 0 exactly), z is that row's kv exactly. Entry j = 2 uses positions 4..7 with
    # half A, then 8..11 with half B.
    n = 12
    ckv = np.zeros((n, 2048), dtype=F32)
    for p in range(n):
        ckv[p, :512] = p + 0.25          # half A of kv
        ckv[p, 512:1024] = p + 0.5       # half B of kv
        ckv[p, 1024:] = -300.0           # gates (both halves)
    ape = np.zeros((4, 1024), dtype=F32)
    kvp, sp = C.rows_with_ape(ckv, np.arange(n), ape, 4)
    for pick, half, want in ((5, "A", 5.25), (10, "B", 10.5)):
        s = sp.copy()
        if half == "A":
            s[pick, :512] = 0.0
        else:
            s[pick, 512:] = 0.0
        kv, ss = C.window_rows(4, 512, np.array([2]), 0, kvp, s)
        z = C.pool(kv, ss)
        check(np.all(z == F32(want)), "ratio 4: entry 2 takes %s of position %d" % (half, pick))
    # j = 0 at ratio 4: the previous window does not exist; equal gates average the own window's
    # half B: (0.5 + 1.5 + 2.5 + 3.5) / 4 = 2 exactly.
    s = np.zeros_like(sp)
    kv, ss = C.window_rows(4, 512, np.array([0]), 0, kvp, s)
    check(np.all(np.isneginf(ss[0, :4])) and np.all(kv[0, :4] == 0), "j = 0 pads the previous window")
    check(np.all(C.pool(kv, ss) == F32(2.0)), "j = 0 averages the own window's half B")
    # ape is added to the gate of position p at row p mod ratio.
    ape2 = np.full((4, 1024), -300.0, dtype=F32)
    ape2[3, 512:] = 300.0  # position 4j+3 wins half B
    kvp2, sp2 = C.rows_with_ape(np.where(np.arange(2048) < 1024, ckv, 0).astype(F32),
                                 np.arange(n), ape2, 4)
    kv, ss = C.window_rows(4, 512, np.array([1]), 0, kvp2, sp2)
    check(np.all(C.pool(kv, ss) == F32(7.5)), "ape[p mod 4] decides: position 7's half B")
    # Random rows against the scalar transcription, bit for bit (ratio 4 and 128).
    for ratio, d in ((4, 512), (128, 512), (4, 128)):
        L = 8 if ratio == 4 else ratio
        kv = rng.standard_normal((3, L, d)).astype(F32)
        s = (rng.standard_normal((3, L, d)) * 4).astype(F32)
        if ratio == 4:
            s[0, :4] = -np.inf
            kv[0, :4] = 0
        z = C.pool(kv, s)
        bad = 0
        for i in range(3):
            for c in range(0, d, 37):
                rows = [k for k in range(L) if np.isfinite(s[i, k, c])]
                want = scalar_pool([kv[i, k, c] for k in rows], [s[i, k, c] for k in rows])
                bad += bits(want) != bits(z[i, c])
        check(bad == 0, "pool differs from the scalar §8.3 order (ratio %d, d %d): %d" % (ratio, d, bad))
    # The record is §2.2's fused path on bf16(z) with the RoPE row of position r * j.
    n = 260
    ckv = rng.standard_normal((n, 1024)).astype(F32)
    ape = rng.standard_normal((128, 512)).astype(F32)
    wn = bf16_values(rng, 512, 0.1) + F32(1)
    comp = C.compress_sequence(128, ckv, np.arange(n), 0, ape, wn, inv)
    want = R.kv_records(R.f32_to_bf16(comp.trace["z"]), R.rope_rows(inv, [0, 128]), wn)
    check(np.array_equal(comp.records, want), "records use the RoPE rows of positions 0 and 128")
    wrong = R.kv_records(R.f32_to_bf16(comp.trace["z"]), R.rope_rows(inv, [127, 255]), wn)
    check(not np.array_equal(comp.records, wrong), "(the emitting position's row would differ)")


def test_p0(rng):
    # p0 = 6 at ratio 4: the first emission is entry 1 (p = 7), from positions 6 and 7 only.
    inv = R.inv_freq("yarn")
    n = 10
    ckv = rng.standard_normal((n, 2048)).astype(F32)
    ikv = rng.standard_normal((n, 512)).astype(F32)
    ape = rng.standard_normal((4, 1024)).astype(F32)
    iape = rng.standard_normal((4, 256)).astype(F32)
    w = np.ones(512, dtype=F32)
    comp = C.compress_sequence(4, ckv, np.arange(6, 6 + n), 6, ape, w, inv, ikv, iape,
                               np.ones(128, dtype=F32))
    check(np.array_equal(comp.js, [1, 2, 3]), "p0 = 6: entries 1, 2, 3 (positions 7, 11, 15)")
    kvp, sp = C.rows_with_ape(ckv, np.arange(6, 6 + n), ape, 4)
    kv, ss = C.window_rows(4, 512, np.array([1]), 6, kvp, sp)
    z = C.pool(kv, ss)
    b = 512 + np.arange(512)
    e6 = C.dsv4_expf((sp[0, b] - np.maximum(sp[0, b], sp[1, b])).astype(F32))
    e7 = C.dsv4_expf((sp[1, b] - np.maximum(sp[0, b], sp[1, b])).astype(F32))
    want = (R.fmaf(e7, kvp[1, b], R.fmaf(e6, kvp[0, b], F32(0))) / ((F32(0) + e6) + e7)).astype(F32)
    check(np.array_equal(bits(z[0]), bits(want)), "p0 = 6: entry 1 pools the half B of 6 and 7")
    check(np.array_equal(C.visible_range(4, 6, 7), (1, 2)), "p0 = 6, p = 7 sees entry 1 only")


# ---------------------------------------------------------------------------------------------
# The indexer (SPEC §8.5) and the union (§8.6)


def test_index_query(rng):
    inv = R.inv_freq("yarn")
    iq = R.f32_to_bf16(rng.standard_normal((3, 64, 128)).astype(F32))
    x = R.bf16_to_f32(iq)
    tr = {}
    q_hat = C.index_queries(iq, np.array([0, 0, 0]), inv, tr)
    # At position 0 every cosine is 1 and every sine 0: the rotation is the identity.
    check(np.array_equal(tr["roped"], x), "RoPE at position 0 leaves iq unchanged")
    _, _, want = C.mxfp4_quantise(R.bf16_to_f32(C.hadamard128(x)))
    check(np.array_equal(q_hat, want), "q_hat = MXFP4(Hadamard(iq)) at position 0")
    tr5 = {}
    C.index_queries(iq, np.array([5, 77, 1000]), inv, tr5)
    check(np.array_equal(tr5["roped"][..., :64], x[..., :64]), "dims 0..63 are never rotated")
    check(not np.array_equal(tr5["roped"][..., 64:], x[..., 64:]), "dims 64..127 are rotated")


def test_scores_and_selection(rng):
    # The exact-product fast path of the dot partials equals the fma chain.
    _, _, q = C.mxfp4_quantise(bf16_values(rng, (6, 128)))
    _, _, k = C.mxfp4_quantise(bf16_values(rng, (9, 128), 3.0))
    fast = C._dot128_partials(q[:, None, :], k[None, :, :])
    xq = np.broadcast_to(q[:, None, :], (6, 9, 128)).reshape(6, 9, 8, 16)
    xk = np.broadcast_to(k[None, :, :], (6, 9, 128)).reshape(6, 9, 8, 16)
    acc = np.zeros((6, 9, 8), dtype=F32)
    for i in range(16):
        acc = R.fmaf(xq[..., i], xk[..., i], acc)
    check(np.array_equal(bits(fast), bits(acc)), "dot partials: exact-product path = fma chain")
    g = rng.standard_normal((4, 128)).astype(F32)  # general values: the fma path
    slow = C._dot128_partials(g[:, None, :], g[None, :, :])
    acc = np.zeros((4, 4, 8), dtype=F32)
    xg = np.broadcast_to(g[:, None, :], (4, 4, 128)).reshape(4, 4, 8, 16)
    xh = np.broadcast_to(g[None, :, :], (4, 4, 128)).reshape(4, 4, 8, 16)
    for i in range(16):
        acc = R.fmaf(xg[..., i], xh[..., i], acc)
    check(np.array_equal(bits(slow), bits(acc)), "dot partials on general values: the fma chain")
    # Scores: fma over heads of w_h * max(d_hj, 0).
    w = rng.standard_normal(6).astype(F32)
    sc = C.index_scores(q, w, k)
    acc = C._dot128_partials(q[:, None, :], k[None, :, :])
    for step in (4, 2, 1):
        acc = (acc[..., :step] + acc[..., step:2 * step]).astype(F32)
    dd = np.maximum(acc[..., 0], F32(0))
    want = np.zeros(9, dtype=F32)
    for h in range(6):
        want = R.fmaf(np.full(9, w[h], dtype=F32), dd[h], want)
    check(np.array_equal(bits(sc), bits(want)), "index scores: fma over heads of relu(d) * w")
    # Ties go to the lower entry; the result is listed in increasing j.
    s = np.array([1, 3, 3, 2, 3, 0, 3], dtype=F32)
    check(np.array_equal(C.select_topk(s, 10, 3), [11, 12, 14]), "ties to the lower j")
    check(np.array_equal(C.select_topk(s, 0, 5), [1, 2, 3, 4, 6]), "top 5 in increasing j")
    check(np.array_equal(C.select_topk(np.array([-1, -1], dtype=F32), 0, 1), [0]), "negative ties")
    # indexer_select: all visible entries while they are at most topk, -1 padding, p0 bound.
    inv = R.inv_freq("yarn")
    n_e = 12
    irec = np.zeros((n_e, 68), dtype=np.uint8)
    nib, codes, _ = C.mxfp4_quantise(bf16_values(rng, (n_e, 128)))
    irec[:] = C.pack_index_record(nib, codes)
    pos = np.array([3, 10, 30, 47])
    iq = R.f32_to_bf16(rng.standard_normal((4, 64, 128)).astype(F32))
    iw = bf16_values(rng, (4, 64))
    sel, scores = C.indexer_select(iq, iw, pos, 0, irec, 4, inv, return_scores=True)
    check(np.array_equal(sel[0], [0, -1, -1, -1]), "p = 3 sees entry 0 only")
    check(np.array_equal(sel[1], [0, 1, -1, -1]), "p = 10 sees entries 0, 1")
    check(scores[1][1] is None and scores[2][1] is not None, "scores only past topk visible")
    lo, sc2 = scores[3]
    check(np.array_equal(sel[3], C.select_topk(sc2, lo, 4)), "p = 47: the top 4 of 12")
    sel_p0 = C.indexer_select(iq[2:], iw[2:], np.array([30, 47]), 21, irec, 4, inv)
    check(np.array_equal(sel_p0[0], [5, 6, -1, -1]), "p0 = 21, p = 30 sees entries 5, 6")
    check(np.all((sel_p0[1] >= 5) & (sel_p0[1] < 12)), "p0 = 21, p = 47 selects among 5..11")


def test_union(rng):
    sw, ent = C.union_candidates(128, 0, 300)
    check(np.array_equal(sw, np.arange(173, 301)) and np.array_equal(ent, [0, 1]),
          "C128 at p = 300: window 173..300, then entries 0, 1")
    sw, ent = C.union_candidates(128, 0, 255)
    check(np.array_equal(ent, [0, 1]), "entry 1 is visible to its emitting token p = 255")
    sw, ent = C.union_candidates(128, 200, 600)
    check(np.array_equal(ent, [1, 2, 3]), "p0 = 200: entries 1..3")
    sw, ent = C.union_candidates(4, 0, 40, np.array([2, 5, 9, -1, -1]))
    check(np.array_equal(ent, [2, 5, 9]), "C4: the selection up to the first -1")
    sw, ent = C.union_candidates(0, 0, 40)
    check(len(ent) == 0, "no compressed candidates on an SWA layer")
    # The binary32 union attention against the binary64 model.
    inv = R.inv_freq("yarn")
    n, H = 300, 4
    pos = np.arange(n)
    rows = R.rope_rows(inv, pos)
    q = R.q_path(R.f32_to_bf16(rng.standard_normal((n, H, 512)).astype(F32)), rows)
    swa = R.kv_records(R.f32_to_bf16(rng.standard_normal((n, 512)).astype(F32)), rows)
    zb = R.f32_to_bf16(rng.standard_normal((2, 512)).astype(F32))
    crec = R.kv_records(zb, R.rope_rows(inv, [0, 128]), np.ones(512, dtype=F32))
    sink = rng.standard_normal(H).astype(F32)
    sel_t = [250, 299]
    out, lse = C.attention_union(q[sel_t], pos[sel_t], 0, swa, crec, 128, inv, sink=sink)
    ref = C.attention_union_f64(q[sel_t], pos[sel_t], 0, swa, crec, 128, inv, sink=sink)
    got = R.bf16_to_f32(out).astype(F64)
    want = np.stack([r[0] for r in ref])
    ulp = np.ldexp(1.0, np.frexp(np.maximum(np.abs(want), 2.0 ** -100))[1] - 8)
    frac = np.mean(np.abs(got - want) <= ulp)
    check(frac >= 0.999, "binary32 union within 1 bf16 ulp of binary64 on %.4f" % frac)
    lse_err = np.max(np.abs(lse - np.stack([r[1] for r in ref])))
    check(lse_err < 1e-5, "lse within float error of binary64 (%.2e)" % lse_err)
    # Every candidate counts: dropping the compressed entries changes the result.
    out2, _ = C.attention_union(q[sel_t], pos[sel_t], 0, swa, crec, 0, inv, sink=sink)
    check(not np.array_equal(out, out2), "the compressed entries take part")
    # A sink of +inf gives zero outputs; -inf is no sink.
    o_inf, _ = C.attention_union(q[:1], pos[:1], 0, swa, crec, 128, inv, sink=np.full(H, np.inf, F32))
    check(np.all(R.bf16_to_f32(o_inf) == 0), "sink +inf: zero output")
    o_ninf, _ = C.attention_union(q[:2], pos[:2], 0, swa, crec, 128, inv,
                                  sink=np.full(H, -np.inf, F32))
    o_none, _ = C.attention_union(q[:2], pos[:2], 0, swa, crec, 128, inv)
    check(np.array_equal(o_ninf, o_none), "sink -inf: as no sink")


# ---------------------------------------------------------------------------------------------
# dsv4_expf and dsv4_logf (SPEC §7)


def test_expf_logf(rng):
    ex = C.dsv4_expf(np.array([0.0, -0.0, 89.5, -104.5, np.inf, -np.inf, 2.0 ** -26], dtype=F32))
    check(list(ex) == [1.0, 1.0, np.inf, 0.0, np.inf, 0.0, 1.0], "expf special values")
    nan_in = np.array([0x7FA00001, 0xFF800123], dtype=np.uint32).view(F32)
    check(np.array_equal(bits(C.dsv4_expf(nan_in)), [0x7FE00001, 0xFFC00123]),
          "expf returns a NaN input made quiet, payload and sign kept")
    lg = C.dsv4_logf(np.array([1.0, 0.0, -0.0, -1.0, np.inf], dtype=F32))
    check(lg[0] == 0 and lg[1] == -np.inf and lg[2] == -np.inf and bits(lg[3]) == 0x7FC00000
          and lg[4] == np.inf, "logf special values")
    # Faithful: within one ulp of the binary64 value over random inputs of the whole range.
    x = rng.uniform(-103.9, 88.7, 200000).astype(F32)
    y = C.dsv4_expf(x).astype(F64)
    t = np.exp(x.astype(F64))
    err = np.abs(y - t) / np.spacing(t.astype(F32)).astype(F64)
    check(np.max(err[t > 2.0 ** -126]) < 1.0, "expf faithful (max %.3f ulp)" % np.max(err))
    xl = np.exp2(rng.uniform(-149, 128, 200000)).astype(F32)
    xl = xl[(xl > 0) & np.isfinite(xl)]
    yl = C.dsv4_logf(xl).astype(F64)
    tl = np.log(xl.astype(F64))
    errl = np.abs(yl - tl) / np.spacing(np.abs(tl).astype(F32)).astype(F64)
    check(np.max(errl) < 1.0, "logf faithful (max %.3f ulp)" % np.max(errl))


def frozen_digests():
    path = os.path.join(HERE, "..", "support", "numerics_digests.h")
    with open(path) as f:
        text = f.read()
    return {name: int(v, 16) for name, v in
            re.findall(r"#define DSV4_(EXPF|LOGF)_DIGEST UINT64_C\(0x([0-9a-f]+)\)", text)}


def _sweep_block(args):
    """One block of 2^22 consecutive input bit patterns through dsv4_expf or dsv4_logf."""
    name, b = args
    block = 1 << 22
    x = np.arange(b * block, (b + 1) * block, dtype=np.uint64).astype(np.uint32).view(F32)
    with np.errstate(all="ignore"):
        return (C.dsv4_expf if name == "EXPF" else C.dsv4_logf)(x).astype("<f4").tobytes()


def test_expf_digest(jobs):
    """The output bits over all 2^32 inputs, hashed in input order, against the frozen digests;
    blocks are computed by jobs worker processes and hashed in order."""
    import multiprocessing
    frozen = frozen_digests()
    with multiprocessing.Pool(jobs) as pool:
        for name in ("EXPF", "LOGF"):
            h = xxhash.xxh3_64()
            t = time.time()
            for out in pool.imap(_sweep_block, [(name, b) for b in range(1 << 10)]):
                h.update(out)
            got = h.intdigest()
            print("dsv4_%s digest %016x (frozen %016x), %.0f s" % (name.lower(), got, frozen[name],
                                                                  time.time() - t))
            check(got == frozen[name], "dsv4_%s over all 2^32 inputs: the frozen digest" % name.lower())


def main():
    rng = np.random.default_rng(2024)
    tests = [("mxfp4_ties", test_mxfp4_ties), ("mxfp4_exp", lambda: test_mxfp4_exponent(rng)),
             ("irecord", lambda: test_index_record_layout(rng)),
             ("hadamard", lambda: test_hadamard(rng)), ("emission", lambda: test_emission(rng)),
             ("pooling", lambda: test_pooling(rng)), ("p0", lambda: test_p0(rng)),
             ("index_q", lambda: test_index_query(rng)),
             ("selection", lambda: test_scores_and_selection(rng)),
             ("union", lambda: test_union(rng)), ("expf_logf", lambda: test_expf_logf(rng))]
    if "--expf-digest" in sys.argv:
        jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else 1
        tests.append(("digests", lambda: test_expf_digest(jobs)))
    t0 = time.time()
    for name, fn in tests:
        t = time.time()
        n = len(failures)
        fn()
        print("%s %-11s %.1f s" % ("ok  " if len(failures) == n else "FAIL", name, time.time() - t))
    print("%d failures, %.1f s" % (len(failures), time.time() - t0))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
