"""Self-tests of the numpy model (dsv4_ref.py) against SPEC.md facts and exact arithmetic.

The model is the yardstick for the C backends, so its own building blocks are checked here against
independent evaluations: exact rationals (fractions) for the fused multiply-add and every rounding,
brute-force grids for fp8, 60-digit Decimal arithmetic and the SPEC's SHA-256 digests for the RoPE
tables, the SPEC test vector, and a property test of the sequence-table model.
"""

import hashlib
import math
import os
import struct
import sys
import time
from fractions import Fraction

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_ref as R  # noqa: E402

F32 = np.float32
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL " + what)


def exact_to_f32(fr):
    """Round a rational to binary32, nearest-even, with subnormals (no overflow in these tests)."""
    if fr == 0:
        return F32(0.0)
    sign = -1 if fr < 0 else 1
    fr = abs(fr)
    e = math.floor(math.log2(float(fr)))
    while Fraction(2) ** e > fr:
        e -= 1
    while Fraction(2) ** (e + 1) <= fr:
        e += 1
    ulp_e = max(e, -126) - 23
    return F32(sign * math.ldexp(round(fr / Fraction(2) ** ulp_e), ulp_e))


def bits(x):
    return int(np.asarray(x, dtype=F32).view(np.uint32))


def test_fmaf(rng):
    n = 6000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(F32)
    b = rng.standard_normal(n).astype(F32)
    c = (-(a.astype(np.float64) * b)).astype(F32)  # heavy cancellation
    c[::3] = rng.standard_normal(len(c[::3])).astype(F32)
    c[1::5] *= F32(2.0 ** -40)  # exact product plus a tiny addend: near-midpoint cases
    k = slice(2, None, 7)  # results in the binary32 subnormal range
    a[k] = (rng.standard_normal(len(a[k])) * 2.0 ** -70).astype(F32)
    b[k] = (rng.standard_normal(len(b[k])) * 2.0 ** -70).astype(F32)
    c[k] = (rng.standard_normal(len(c[k])) * 2.0 ** -140).astype(F32)
    got = R.fmaf(a, b, c)
    bad = 0
    for i in range(n):
        want = exact_to_f32(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
        if bits(want) != bits(got[i]) and not (want == 0 and got[i] == 0):
            bad += 1
    check(bad == 0, "fmaf differs from the exact rounding in %d of %d cases" % (bad, n))
    # Exact midpoints: (1+2^-12)^2 = 1 + 2^-11 + 2^-24 lies halfway between two binary32 values.
    x = F32(1 + 2 ** -12)
    one = bits(F32(1.0))
    check(bits(R.fmaf(x, x, F32(0.0))) - one == 4096, "fmaf midpoint ties to even")
    check(bits(R.fmaf(x, x, F32(2.0 ** -60))) - one == 4097, "fmaf midpoint plus tiny rounds up")
    check(bits(R.fmaf(x, x, F32(-2.0 ** -60))) - one == 4096, "fmaf midpoint minus tiny rounds down")
    # SPEC §2: as an unfused a*b+c this is +0; fused it is 2^-24.
    check(float(R.fmaf(x, x, F32(-(1 + 2 ** -11)))) == 2.0 ** -24, "fmaf of the SPEC contraction test")


def test_bf16(rng):
    u = rng.integers(0, 2 ** 32, size=4000, dtype=np.uint64).astype(np.uint32)
    u = u[(u & 0x7F800000) != 0x7F800000]  # finite only
    x = u.view(F32)
    got = R.f32_to_bf16(x)
    bad = 0
    for xi, g in zip(x, got):
        fr = Fraction(float(xi))
        # bf16 has 8 significant bits: round the rational on the bf16 grid.
        if fr == 0:
            want = bits(xi) >> 16
        else:
            e = math.floor(math.log2(abs(float(fr))))
            ulp_e = max(e, -126) - 7
            q = round(abs(fr) / Fraction(2) ** ulp_e)
            v = F32(math.ldexp(q, ulp_e))
            want = (bits(v) >> 16) | (0x8000 if fr < 0 else 0)
        bad += int(want != int(g))
    check(bad == 0, "f32_to_bf16 differs from exact nearest-even in %d cases" % bad)
    allb = np.arange(65536, dtype=np.uint16)
    fin = np.isfinite(R.bf16_to_f32(allb))
    check(np.array_equal(R.f32_to_bf16(R.bf16_to_f32(allb[fin])), allb[fin]), "bf16 round trip exact")


def test_e4m3():
    grid = np.unique(np.abs(R.E4M3_TABLE[np.isfinite(R.E4M3_TABLE)]))
    check(len(grid) == 127 and grid[-1] == 448.0 and grid[1] == 2.0 ** -9, "e4m3 grid")
    mids = (grid[:-1] + grid[1:]) / 2
    m32 = mids.astype(F32)
    tests = np.concatenate([grid, mids, np.nextafter(m32, F32(0)), np.nextafter(m32, F32(1000)),
                            [2.0 ** -149, 2.0 ** -12, 447.99, 448.0]]).astype(F32)
    tests = np.concatenate([tests, -tests, [F32(-0.0)]])
    enc = R.e4m3_encode(tests)
    bad = 0
    for v, e in zip(tests, enc):
        d = np.abs(grid - abs(float(v)))
        cand = np.nonzero(d == d.min())[0]
        codes = [int(np.nonzero(R.E4M3_TABLE == grid[k])[0][0]) for k in cand]
        code = [c for c in codes if c % 2 == 0][0] if len(codes) > 1 else codes[0]
        code |= (bits(v) >> 31) << 7
        bad += int(code != int(e))
    check(bad == 0, "e4m3_encode differs from brute-force nearest-even in %d of %d" % (bad, len(tests)))
    # The SPEC's own examples.
    ex = R.e4m3_encode(np.array([2.0 ** -10, 1.5 * 2.0 ** -9, -0.0, -2.0 ** -11, 448.0, -448.0],
                                dtype=F32))
    check(list(ex) == [0x00, 0x02, 0x80, 0x80, 0x7E, 0xFE], "SPEC §2.2 e4m3 examples: %s"
          % [hex(int(v)) for v in ex])
    allb = np.arange(256, dtype=np.uint8)
    fin = allb[(allb & 0x7F) != 0x7F]
    check(np.array_equal(R.e4m3_encode(R.e4m3_decode(fin)), fin), "e4m3 decode/encode round trip")


def test_ue8m0(rng):
    am = np.concatenate([rng.uniform(1e-4, 1, 3000), 2.0 ** rng.uniform(-13.3, 59, 30000)])
    pw = 448 * 2.0 ** np.arange(-22, 51)
    am = np.concatenate([am, pw, np.nextafter(pw.astype(F32), F32(1e30)),
                         np.nextafter(pw.astype(F32), F32(0))]).astype(F32)
    am = np.maximum(am, F32(1e-4))
    am = am[am < F32(2.0 ** 59)]
    e = R.ue8m0_exponent(am)
    a64 = am.astype(np.float64)
    check(bool(np.all((a64 <= np.ldexp(448.0, e)) & (a64 > np.ldexp(448.0, e - 1)))),
          "ue8m0: smallest e with amax <= 448*2^e")
    div = np.ceil(np.log2((am / F32(448.0)).astype(F32).astype(np.float64)))
    check(bool(np.all(div == e)), "ue8m0 equals ceil(log2(amax/448.0f)) (SPEC §2.2)")
    check(int(e.min()) + 127 >= 105 and int(R.ue8m0_exponent(F32(1e-4))) + 127 == 105,
          "ue8m0 code of the 1e-4 floor is 105")
    top = R.ue8m0_exponent(np.nextafter(F32(2.0 ** 59), F32(0)))
    check(int(top) + 127 <= 247, "ue8m0 code below 2^59 is at most 247")


def test_inv_freq():
    for kind, params in (("plain", R.PLAIN_DEFAULT), ("yarn", R.YARN_DEFAULT)):
        lst = R.f32_bits(R.inv_freq(kind)).astype(np.int64)
        rec = R.f32_bits(R.inv_freq_recipe(**params)).astype(np.int64)
        diff = np.nonzero(lst != rec)[0]
        if kind == "plain":
            # SPEC §2.3: entries 11 and 25 are one ulp above the correctly rounded value.
            check(list(diff) == [11, 25] and bool(np.all(lst[diff] - rec[diff] == 1)),
                  "plain list vs recipe differ exactly at 11 and 25 by one ulp: %s" % list(diff))
        else:
            check(len(diff) == 0, "yarn list equals the recipe: %s" % list(diff))
    check(R.f32_bits(R.inv_freq("plain", theta=10000.0)).tolist() ==
          R.f32_bits(R.inv_freq_recipe(10000.0)).tolist(), "custom parameters use the recipe")


def test_rope(rng, full):
    # Entire tables against the SPEC digests (about 4 s each).
    for kind in ("plain", "yarn") if full else ():
        inv = R.inv_freq(kind)
        h = hashlib.sha256()
        chunk = 1 << 16
        for s in range(0, R.MAX_POSITION, chunk):
            h.update(R.rope_rows(inv, np.arange(s, s + chunk)).astype("<f4").tobytes())
        check(h.hexdigest() == R.TABLE_SHA256[kind], "RoPE %s table SHA-256 %s" % (kind, h.hexdigest()))
    # Rows evaluated entirely in Decimal arithmetic.
    pos = np.concatenate([[0, 1, 5, 65535, 65536, R.MAX_POSITION - 1],
                          rng.integers(0, R.MAX_POSITION, 94)])
    bad = 0
    for kind in ("plain", "yarn"):
        inv = R.inv_freq(kind)
        fast = R.rope_rows(inv, pos)
        for k, p in enumerate(pos):
            bad += int(np.sum(R.f32_bits(R.rope_row_exact(inv, int(p))) != R.f32_bits(fast[k])))
    check(bad == 0, "RoPE rows differ from 60-digit Decimal evaluation in %d values" % bad)
    # The hard-case path itself: a value forced through the Decimal fallback.
    # The hard-case path: an approximation exactly on a rounding boundary must be recomputed.
    a = np.array([[1.0]])
    f = F32(math.cos(1.0))
    mid = np.array([[(float(f) + float(np.nextafter(f, F32(2)))) / 2]])
    check(bits(R._cr_f32(mid, a, 0)[0, 0]) == bits(f), "RoPE rounding-boundary fallback")


def scalar_sum_squares(x):
    """SPEC §2 sum of squares with exact-rational fma, one element at a time."""
    part = []
    for l in range(32):
        acc = F32(0.0)
        for k in range(16):
            v = Fraction(float(x[16 * l + k]))
            acc = exact_to_f32(v * v + Fraction(float(acc)))
        part.append(acc)
    for step in (16, 8, 4, 2, 1):
        for l in range(step):
            part[l] = F32(part[l] + part[l + step])
    return part[0]


def test_norm(rng):
    for i in range(20):
        x = R.bf16_to_f32(R.f32_to_bf16((rng.standard_normal(512) *
                                        2.0 ** rng.integers(-60, 58, 512)).astype(F32)))
        if i == 0:
            x = R.bf16_to_f32(np.arange(512) % 128)  # subnormal bf16 values only
        check(bits(R.sum_squares(x)) == bits(scalar_sum_squares(x)), "sum of squares order (%d)" % i)
    ss = F32(3.0)
    r = R.rms_factor(ss)
    t = exact_to_f32(Fraction(float(ss)) / 512 + Fraction(float(R.EPS)))
    check(bits(r) == bits(F32(1.0) / np.sqrt(t)), "rms factor")
    check(bits(R.EPS) == 0x358637BD, "eps bits")


def test_paths(rng):
    # SPEC §2 test vector.
    q = np.zeros((1, 1, 512), dtype=np.uint16)
    q[0, 0, :3] = [0x0001, 0x8001, 0x0080]
    out = R.q_path(q, R.rope_rows(R.inv_freq("plain"), [5]))
    check(out[0, 0, :3].tolist() == [0x01FA, 0x81FA, 0x057A], "SPEC §2 test vector: %s"
          % [hex(int(v)) for v in out[0, 0, :3]])
    # Position 0 has cos 1, sin 0: RoPE is the identity, so the record holds the input bf16 values.
    kv = R.f32_to_bf16((rng.standard_normal((4, 512))).astype(F32))
    rec = R.kv_records(kv, R.rope_rows(R.inv_freq("plain"), [0, 0, 0, 0]))
    check(np.array_equal(rec[:, 448:576].copy().view("<u2"), kv[:, 448:]), "RoPE at position 0")
    check(bool(np.all(rec[:, 583] == 0)), "scale pad byte is 0")
    # Dequantised NoPE values are within half an e4m3 step of the inputs.
    z = R.bf16_to_f32(kv[:, :448]).astype(np.float64)
    deq = R.dequantise_record(rec)[:, :448].astype(np.float64)
    codes = rec[:, 576:583].astype(np.int64).repeat(64, axis=1)
    step = np.maximum(np.ldexp(2.0 ** np.floor(np.log2(np.maximum(np.abs(z), 1e-300))), -3),
                      np.ldexp(2.0 ** -9, codes - 127))
    check(bool(np.all(np.abs(deq - z) <= step / 2 * (1 + 1e-12))), "dequantisation error <= half a step")
    # A tile of zeros gets the 1e-4 floor: code 105 and bytes 0x00.
    kv0 = np.zeros((1, 512), dtype=np.uint16)
    rec0 = R.kv_records(kv0, R.rope_rows(R.inv_freq("plain"), [7]))
    rope0 = rec0[0, 448:576].copy().view("<u2")
    check(rec0[0, 576:583].tolist() == [105] * 7 and not rec0[0, :448].any() and
          not np.any(rope0 & 0x7FFF), "zero record (RoPE values may be -0)")
    # Layout: stride and the placement of a record.
    check(R.block_stride(64) == 37440 and R.block_stride(16) == 9792 and R.block_stride(256) == 149760,
          "block strides")
    cache = np.zeros(3 * R.block_stride(16), dtype=np.uint8)
    R.write_records(cache, rec[:2], [16 + 5, -1], 16)
    check(np.array_equal(R.read_record(cache, 21, 16), rec[0]) and
          cache[R.block_stride(16) + 576 * 16 + 8 * 5 + 6] == rec[0, 582], "record placement")
    check(int(np.count_nonzero(cache)) == int(np.count_nonzero(rec[0])), "slot -1 writes nothing")


def test_digests():
    rec = np.arange(2 * 584, dtype=np.uint64).astype(np.uint8).reshape(2, 584)
    want = xxhash.xxh3_64_intdigest(struct.pack("<q", -3) + rec[0].tobytes() +
                                    struct.pack("<q", 1 << 40) + rec[1].tobytes())
    check(R.records_digest([-3, 1 << 40], rec) == "%016x" % want, "record-list digest")
    check(R.records_digest([], []) == "%016x" % xxhash.xxh3_64_intdigest(b""), "empty digest")
    bs = 16
    cache = np.random.default_rng(3).integers(0, 256, 4 * R.block_stride(bs), dtype=np.uint8)
    d1 = R.pool_digest(7, cache, [0, 2, 3], bs)
    d2 = R.pool_digest(7, cache, [3, 0, 2], bs)
    check(d1 == d2 and d1 != R.pool_digest(6, cache, [0, 2, 3], bs), "pool digest is order-free")
    check(R.block_digest(cache, 1, bs) ==
          "%016x" % xxhash.xxh3_64_intdigest(cache[R.block_stride(bs):2 * R.block_stride(bs)].tobytes()),
          "block digest")


def test_seqtable(rng):
    S = R.Segment
    # One layer, one-token steps: at most ceil(127/bs)+1 blocks held between steps.
    for bs in (16, 64, 256):
        m = R.SeqTableModel(64, bs, [0])
        m.forward(0, [S("a", 0, 1, new=True, key=0)])
        worst = 0
        for p in range(1, 1200):
            m.forward(0, [S("a", p, 1, key=p)])
            worst = max(worst, m.held_blocks("a"))
        check(worst == -(-127 // bs) + 1, "bs %d: one-token steps hold at most %d (got %d)"
              % (bs, -(-127 // bs) + 1, worst))
    # Errors and replays.
    m = R.SeqTableModel(8, 64, [0, 1])
    r = m.forward(0, [S("s", 10, 100, new=True, key="k1")])
    check(r["new_blocks"] == 2 and m.used_blocks() == 2, "first batch allocates blocks 0 and 1")
    for seg, code in ((S("s", 10, 5, new=True, key="x"), "sequence_exists"),
                      (S("t", 0, 5, key="x"), "unknown_sequence"),
                      (S("s", 111, 5, key="x"), "position_mismatch")):
        try:
            m.forward(0, [seg])
            check(False, "expected %s" % code)
        except R.SeqError as e:
            check(e.code == code, "expected %s, got %s" % (code, e.code))
            if code == "position_mismatch":
                check(e.details["expected"] == {"s": 110}, "expected position 110")
    try:
        m.forward(1, [S("s", 10, 1, key="a"), S("s", 11, 1, key="b")])
        check(False, "expected duplicate_sequence")
    except R.SeqError as e:
        check(e.code == "duplicate_sequence", "duplicate_sequence")
    r = m.forward(0, [S("s", 10, 100, new=True, key="k1")])
    check(r["replayed"] and m.next_positions("s") == {0: 110, 1: 10}, "replay moves nothing")
    # Layer 1 starts at p0; layer 0 runs ahead; nothing is released while layer 1 lags.
    m.forward(0, [S("s", 110, 300, key="k2")])
    check(m.held_blocks("s") == 7 and m.free_blocks() == 1, "layer 0 ahead holds 7 blocks")
    try:
        m.forward(0, [S("s", 410, 200, key="k3")])
        check(False, "expected kv_pool_exhausted")
    except R.SeqError as e:
        check(e.code == "kv_pool_exhausted" and e.details == {"needed": 3, "free": 1},
              "kv_pool_exhausted needed 3 free 1: %s" % e.details)
    check(m.next_positions("s")[0] == 410 and m.free_blocks() == 1, "a refused batch changes nothing")
    m.forward(1, [S("s", 10, 400, key="k4")])
    check(m.held_blocks("s") == 7, "release waits for the last segment start")
    m.forward(1, [S("s", 410, 1, key="k5")])
    m.forward(0, [S("s", 410, 1, key="k6")])
    # s_L = 410 on both layers: blocks with (b+1)*64-1 < 283 are released (0..3); 4, 5, 6 stay.
    check(m.held_blocks("s") == 3 and sorted(m.seqs["s"].blocks) == [4, 5, 6], "release rule")
    check(m.delete("s") and m.free_blocks() == 8 and not m.delete("s"), "delete frees everything")
    # Random property test: ids never owned twice, free + used = total, bound on needed blocks.
    m = R.SeqTableModel(40, 16, [0, 1, 2])
    names = ["q%d" % i for i in range(5)]
    for step in range(3000):
        name = names[rng.integers(0, 5)]
        L = int(rng.integers(0, 3))
        k = int(rng.integers(1, 40))
        s = m.seqs.get(name)
        try:
            if s is None:
                m.forward(L, [S(name, int(rng.integers(0, 100)), k, new=True, key=step)])
            elif rng.random() < 0.02:
                m.delete(name)
            else:
                start = s.next[L] if rng.random() < 0.9 else s.next[L] + 1
                r = m.forward(L, [S(name, start, k, key=step)])
        except R.SeqError as e:
            check(e.code in ("kv_pool_exhausted", "position_mismatch"), "unexpected " + e.code)
        owned = [b for q in m.seqs.values() for b in q.blocks.values()]
        if len(owned) != len(set(owned)) or len(owned) + m.free_blocks() != 40:
            check(False, "pool invariant broken at step %d" % step)
            break


def main():
    full = "--quick" not in sys.argv
    rng = np.random.default_rng(12345)
    t0 = time.time()
    for name, fn in (("fmaf", lambda: test_fmaf(rng)), ("bf16", lambda: test_bf16(rng)),
                     ("e4m3", test_e4m3), ("ue8m0", lambda: test_ue8m0(rng)),
                     ("inv_freq", test_inv_freq), ("rope", lambda: test_rope(rng, full)),
                     ("norm", lambda: test_norm(rng)), ("paths", lambda: test_paths(rng)),
                     ("digests", test_digests), ("seqtable", lambda: test_seqtable(rng))):
        t = time.time()
        n = len(failures)
        fn()
        print("%s %-9s %.1f s" % ("ok  " if len(failures) == n else "FAIL", name, time.time() - t))
    print("%d failures, %.1f s" % (len(failures), time.time() - t0))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
