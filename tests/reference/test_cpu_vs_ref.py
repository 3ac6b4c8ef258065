"""Byte-for-byte comparison of a C backend's qkv_insert and map_slots with the numpy model.

Usage: test_cpu_vs_ref.py <path of kernel_run> [backend]

Each case writes random inputs to a temporary directory, runs kernel_run on them and compares the
whole q_out and the whole cache buffer with dsv4_ref.py. The first difference is reported with its
token, head and dimension (q_out) or its block, token offset and field (cache), with both values.
"""

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_ref as R  # noqa: E402

KERNEL_RUN = sys.argv[1] if len(sys.argv) > 1 else None
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "cpu"
# The CPU kernel level to check (scalar, avx2, avx512), or "best" for the one the backend picks.
ISA = sys.argv[3] if len(sys.argv) > 3 else "best"
MAXPOS = R.MAX_POSITION

# The largest bf16 below 2^59 (SPEC §6 admits |x| < 2^59): exponent 2^58, mantissa all ones.
BF16_MAX_ADMISSIBLE = 0x5CFF


def bf16_normal(rng, shape, scale_log2_lo=-8, scale_log2_hi=8):
    """bf16 bit patterns of normal samples, each row scaled by a random power of two."""
    x = rng.standard_normal(shape).astype(np.float32)
    sc = 2.0 ** rng.integers(scale_log2_lo, scale_log2_hi + 1, size=shape[:-1] + (1,))
    return R.f32_to_bf16((x * sc).astype(np.float32))


def bf16_extreme(rng, shape):
    """Admissible bf16 patterns over the whole range: random sign, exponent field 0..185 (so every
    value is below 2^59), random mantissa; with zeros, -0, subnormals and the largest admissible
    value sprinkled in."""
    sign = rng.integers(0, 2, size=shape).astype(np.uint16) << 15
    expo = rng.integers(0, 186, size=shape).astype(np.uint16) << 7
    mant = rng.integers(0, 128, size=shape).astype(np.uint16)
    u = sign | expo | mant
    pick = rng.random(shape)
    u = np.where(pick < 0.05, np.uint16(0), u)
    u = np.where((pick >= 0.05) & (pick < 0.08), np.uint16(0x8000), u)
    u = np.where((pick >= 0.08) & (pick < 0.14), sign | mant, u)  # subnormal (or zero)
    u = np.where((pick >= 0.14) & (pick < 0.16), sign | np.uint16(BF16_MAX_ADMISSIBLE), u)
    return u.astype(np.uint16)


def bf16_tiny(rng, shape):
    """Values far below 1e-4 (so the tile amax floor of SPEC §2.2 applies), subnormals among them."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-140, -15, size=shape)
    u = R.f32_to_bf16(x.astype(np.float32))
    pick = rng.random(shape)
    u = np.where(pick < 0.1, np.uint16(0), u)
    return u.astype(np.uint16)


def bf16_boundary(rng, shape):
    """Tiles whose amax sits exactly on 448 * 2^e or one bf16 step either side of it (the UE8M0
    comparison of SPEC §2.2), filled with values that land on e4m3 rounding ties after scaling:
    a bf16 mantissa ending in binary 1000 (or 0100) is halfway between two e4m3 values, and in the
    subnormal range 2^-10 and 1.5 * 2^-9 are the SPEC's own examples."""
    n = int(np.prod(shape)) // 64
    e = rng.integers(-22, 51, size=(n, 1))
    lead = R.f32_to_bf16((448.0 * 2.0 ** e).astype(np.float32)).astype(np.int64)
    lead = (lead + rng.integers(-1, 2, size=(n, 1))).astype(np.uint16)
    # Halfway mantissas relative to e4m3's 3 bits, at exponents spread below the lead.
    ex = (e + 8 + 127 - rng.integers(0, 12, size=(n, 64))).clip(1, 254).astype(np.uint16)
    mant = (rng.integers(0, 8, size=(n, 64)) << 4 | 8).astype(np.uint16)
    vals = (ex << 7) | mant
    # Values scaled into e4m3 subnormals: 2^-10, 1.5 * 2^-9 and 3 * 2^-10.
    tiny = R.f32_to_bf16((2.0 ** (e - 10) * rng.choice([1.0, 3.0, 1.5], size=(n, 64)))
                         .astype(np.float32))
    vals = np.where(rng.random((n, 64)) < 0.2, tiny, vals)
    vals[np.arange(n), rng.integers(0, 64, size=n)] = lead[:, 0]
    vals |= (rng.integers(0, 2, size=(n, 64)) << 15).astype(np.uint16)
    return vals.astype(np.uint16).reshape(shape)


def mixed_kv(rng, n):
    """Per token and per 64-wide tile a different regime: normal, tiny, extreme, all zero."""
    kv = bf16_normal(rng, (n, 512), -10, 10)
    for t in range(n):
        for j in range(8):
            sl = slice(64 * j, 64 * j + 64)
            m = rng.integers(0, 6)
            if m == 1:
                kv[t, sl] = bf16_tiny(rng, (64,))
            elif m == 2:
                kv[t, sl] = bf16_extreme(rng, (64,))
            elif m == 3:
                kv[t, sl] = 0
            elif m == 4:
                kv[t, sl] = bf16_normal(rng, (1, 64), -40, 40)[0]
            elif m == 5:
                kv[t, sl] = bf16_boundary(rng, (1, 64))[0]
    return kv


def positions_for(rng, n, where):
    if where == "low":
        return np.arange(n, dtype=np.int64)
    if where == "high":
        return np.arange(MAXPOS - n, MAXPOS, dtype=np.int64)
    if where == "mixed":
        p = rng.integers(0, MAXPOS, size=n).astype(np.int64)
        p[: n // 4] = rng.integers(0, 200, size=n // 4)
        p[n // 4: n // 2] = MAXPOS - 1 - rng.integers(0, 200, size=n // 2 - n // 4)
        return p
    return rng.integers(0, MAXPOS, size=n).astype(np.int64)


def write_params(d, **kw):
    kw.setdefault("isa", ISA)
    with open(os.path.join(d, "params.txt"), "w") as f:
        for k, v in kw.items():
            f.write("%s=%s\n" % (k, v))


class LevelMissing(Exception):
    pass


def run_kernel(d):
    r = subprocess.run([KERNEL_RUN, d], capture_output=True, text=True, timeout=300)
    if r.returncode == 77:
        # The level does not exist on this CPU: main() reports the test as skipped (ctest's
        # SKIP_RETURN_CODE) unless a case had already failed.
        raise LevelMissing(r.stderr.strip())
    if r.returncode != 0:
        raise RuntimeError("kernel_run failed (%d): %s%s" % (r.returncode, r.stdout, r.stderr))


def describe_cache_offset(off, bs, slot_of):
    """Block, token offset and field of a cache byte offset, and which batch token owns it."""
    stride = R.block_stride(bs)
    b, rem = divmod(off, stride)
    if rem < R.TOKEN_DATA_BYTES * bs:
        o, k = divmod(rem, R.TOKEN_DATA_BYTES)
        field = "nope dim %d" % k if k < 448 else "rope byte %d (dim %d)" % (k - 448, 448 + (k - 448) // 2)
    elif rem < R.RECORD_BYTES * bs:
        o, k = divmod(rem - R.TOKEN_DATA_BYTES * bs, R.SCALE_BYTES)
        field = "scale %d" % k if k < 7 else "scale pad byte"
    else:
        o, field = None, "block padding"
    tok = slot_of.get(b * bs + o) if o is not None else None
    return "block %d offset %s %s (batch token %s)" % (b, o, field, tok)


class Failure(Exception):
    pass


def compare(name, got_q, want_q, got_cache, want_cache, bs, slots):
    if got_q.shape != want_q.shape:
        raise Failure("%s: q_out shape %s != %s" % (name, got_q.shape, want_q.shape))
    diff = np.nonzero(got_q != want_q)
    if len(diff[0]):
        t, h, d = (int(a[0]) for a in diff)
        raise Failure("%s: q_out differs at %d places; first: token %d head %d dim %d: C 0x%04x, "
                      "model 0x%04x" % (name, len(diff[0]), t, h, d, got_q[t, h, d], want_q[t, h, d]))
    cdiff = np.nonzero(got_cache != want_cache)[0]
    if len(cdiff):
        off = int(cdiff[0])
        slot_of = {int(s): i for i, s in enumerate(slots) if s >= 0}
        raise Failure("%s: cache differs at %d bytes; first: byte %d = %s: C 0x%02x, model 0x%02x"
                      % (name, len(cdiff), off, describe_cache_offset(off, bs, slot_of),
                         got_cache[off], want_cache[off]))


def run_case(name, rng, heads, n, bs, n_blocks, rope, kv_norm, where, qgen, kvgen, minus_one=0.0,
             write_kv=1, cache_init="zero", threads=0, q=None, positions=None):
    if q is None:
        q = qgen(rng, (n, heads, 512))
    kv = kvgen(rng, (n, 512)) if kvgen is not mixed_kv else mixed_kv(rng, n)
    if positions is None:
        positions = positions_for(rng, n, where)
    total_slots = n_blocks * bs
    assert total_slots >= n
    slots = rng.choice(total_slots, size=n, replace=False).astype(np.int64)
    slots[rng.random(n) < minus_one] = -1
    weight = None
    if kv_norm == "fused":
        weight = (rng.standard_normal(512) * 2.0 ** rng.integers(-3, 4, size=512)).astype(np.float32)
        weight[:8] = [1.0, -1.0, 0.0, -0.0, 2.0 ** -20, 3.0, 1.0 + 2 ** -23, 7.5]
    cache_bytes = n_blocks * R.block_stride(bs)
    if cache_init == "random":
        cache_in = rng.integers(0, 256, size=cache_bytes, dtype=np.uint8)
    else:
        cache_in = np.zeros(cache_bytes, dtype=np.uint8)

    with tempfile.TemporaryDirectory(prefix="dsv4ref-") as d:
        write_params(d, mode="insert", backend=BACKEND, n_tokens=n, heads=heads, block_size=bs,
                     n_blocks=n_blocks, rope=rope, kv_norm=kv_norm, write_kv=write_kv,
                     threads=threads)
        q.astype("<u2").tofile(os.path.join(d, "q.bin"))
        kv.astype("<u2").tofile(os.path.join(d, "kv.bin"))
        positions.astype("<i8").tofile(os.path.join(d, "positions.bin"))
        slots.astype("<i8").tofile(os.path.join(d, "slots.bin"))
        if weight is not None:
            weight.astype("<f4").tofile(os.path.join(d, "kv_norm_weight.bin"))
        if cache_init != "zero":
            cache_in.tofile(os.path.join(d, "cache_in.bin"))
        t1 = time.time()
        run_kernel(d)
        t2 = time.time()
        got_q = np.fromfile(os.path.join(d, "q_out.bin"), dtype="<u2").reshape(n, heads, 512)
        got_cache = np.fromfile(os.path.join(d, "cache.bin"), dtype=np.uint8)

    want_cache = cache_in.copy()
    want_q, _ = R.qkv_insert(q, kv, positions, slots, want_cache, bs, rope=rope,
                             kv_norm_weight=weight, write_kv=bool(write_kv))
    t3 = time.time()
    compare(name, got_q, want_q, got_cache, want_cache, bs, slots)
    if write_kv and np.any(slots >= 0) and np.array_equal(want_cache, cache_in):
        raise Failure("%s: the case wrote nothing; it tests nothing" % name)
    print("ok   %-34s N=%-5d H=%-3d bs=%-3d %-5s %-9s kv=%d  kernel %.2fs, model %.2fs"
          % (name, n, heads, bs, rope, kv_norm, write_kv, t2 - t1, t3 - t2))
    return got_q, got_cache


def random_sweep(rng, count):
    """Random configurations over every axis the fixed cases cover one at a time."""
    gens = [bf16_normal, bf16_extreme, bf16_tiny, bf16_boundary]
    for i in range(count):
        heads = int(rng.choice([8, 64, 128]))
        bs = int(rng.choice([16, 64, 256]))
        n = int(rng.integers(1, {8: 400, 64: 64, 128: 32}[heads]))
        n_blocks = -(-n // bs) + int(rng.integers(0, 4))
        run_case("sweep_%02d" % i, rng, heads, n, bs, n_blocks, str(rng.choice(["plain", "yarn"])),
                 str(rng.choice(["prenormed", "fused"])),
                 str(rng.choice(["low", "high", "mixed", "random"])), gens[rng.integers(0, 4)],
                 [bf16_normal, bf16_extreme, bf16_tiny, mixed_kv][rng.integers(0, 4)],
                 minus_one=float(rng.choice([0.0, 0.1, 0.5])),
                 write_kv=int(rng.random() < 0.85),
                 cache_init=str(rng.choice(["zero", "random"])), threads=int(rng.integers(0, 3)))


def seqtable_batches(rng):
    """Several batches of two sequences through the sequence-table model: the slots it assigns, the
    cache carried from one kernel run to the next (released blocks are reused unscrubbed), and the
    sequence digest of SPEC §3.1 read back from the C cache against the model's own records."""
    bs, n_blocks, heads = 16, 24, 8
    m = R.SeqTableModel(n_blocks, bs, [0])
    cache = np.zeros(n_blocks * R.block_stride(bs), dtype=np.uint8)
    nxt = {"alpha": 0, "beta": 1000}
    lens = [(100, 37), (1, 1), (20, 3), (1, 1), (64, 1), (1, 90), (5, 5), (1, 1)]
    for step, (la, lb) in enumerate(lens):
        segs = []
        for name, k in (("alpha", la), ("beta", lb)):
            segs.append(R.Segment(name, nxt[name], k, new=step == 0, key=(name, step)))
            nxt[name] += k
        positions = np.concatenate([np.arange(sg.start, sg.start + sg.len) for sg in segs])
        n = len(positions)
        q = bf16_normal(rng, (n, heads, 512))
        kv = mixed_kv(rng, n)
        records = R.kv_records(kv, R.rope_rows(R.inv_freq("yarn"), positions))
        res = m.forward(0, segs, records=records)
        slots = np.array(res["slots"], dtype=np.int64)
        with tempfile.TemporaryDirectory(prefix="dsv4ref-") as d:
            write_params(d, mode="insert", backend=BACKEND, n_tokens=n, heads=heads, block_size=bs,
                         n_blocks=n_blocks, rope="yarn", kv_norm="prenormed", write_kv=1, threads=0)
            q.astype("<u2").tofile(os.path.join(d, "q.bin"))
            kv.astype("<u2").tofile(os.path.join(d, "kv.bin"))
            positions.astype("<i8").tofile(os.path.join(d, "positions.bin"))
            slots.astype("<i8").tofile(os.path.join(d, "slots.bin"))
            cache.tofile(os.path.join(d, "cache_in.bin"))
            run_kernel(d)
            got_q = np.fromfile(os.path.join(d, "q_out.bin"), dtype="<u2").reshape(n, heads, 512)
            got_cache = np.fromfile(os.path.join(d, "cache.bin"), dtype=np.uint8)
        want_q, _ = R.qkv_insert(q, kv, positions, slots, cache, bs, rope="yarn")
        compare("seqtable_batch_%d" % step, got_q, want_q, got_cache, cache, bs, slots)
        for name in ("alpha", "beta"):
            s = m.seqs[name]
            pos = list(m.stored_range(name, 0))
            got = R.records_digest(pos, [R.read_record(got_cache, s.blocks[p // bs] * bs + p % bs, bs)
                                         for p in pos])
            if got != m.sequence_digest(name, 0):
                raise Failure("seqtable_batch_%d: sequence digest of %s from the C cache %s, model %s"
                              % (step, name, got, m.sequence_digest(name, 0)))
            bound = m.max_blocks_bound(1) if (la if name == "alpha" else lb) == 1 else None
            if bound is not None and m.held_blocks(name) > bound:
                raise Failure("%s holds %d blocks after a one-token step" % (name, m.held_blocks(name)))
    print("ok   %-34s %d batches, %d blocks used at the end" % ("seqtable_batches", len(lens),
                                                            m.used_blocks()))


def spec_test_vector():
    """SPEC §2: head (0x0001, 0x8001, 0x0080, 0, ...) at position 5, plain -> 0x01FA 0x81FA 0x057A."""
    rng = np.random.default_rng(5)
    q = bf16_normal(rng, (1, 8, 512))
    q[0, 3, :] = 0
    q[0, 3, :3] = [0x0001, 0x8001, 0x0080]
    got_q, _ = run_case("spec_test_vector", rng, 8, 1, 64, 2, "plain", "prenormed", None,
                        None, bf16_normal, q=q, positions=np.array([5], dtype=np.int64))
    want = [0x01FA, 0x81FA, 0x057A]
    got = [int(v) for v in got_q[0, 3, :3]]
    if got != want:
        raise Failure("spec_test_vector: q_out[0..2] = %s, SPEC says %s"
                      % ([hex(v) for v in got], [hex(v) for v in want]))


def map_case(rng, name, bs, n_blocks, n_segments, holes=0.0):
    """map_slots: each segment maps its tokens through its slice of the block table."""
    positions, tok_seg, first_lb, bt_off, bt_len, table = [], [], [], [], [], []
    free = list(rng.permutation(n_blocks))
    for s in range(n_segments):
        start = int(rng.integers(0, MAXPOS - 600))
        length = int(rng.integers(1, 300))
        lb0 = start // bs
        nlb = (start + length - 1) // bs - lb0 + 1
        first_lb.append(lb0)
        bt_off.append(len(table))
        bt_len.append(nlb)
        for _ in range(nlb):
            table.append(int(free.pop()) if rng.random() >= holes else -1)
        positions.extend(range(start, start + length))
        tok_seg.extend([s] * length)
    positions = np.array(positions, dtype=np.int64)
    tok_seg = np.array(tok_seg, dtype=np.int32)
    table = np.array(table, dtype=np.int32)
    want = np.empty(len(positions), dtype=np.int64)
    for t, (p, s) in enumerate(zip(positions, tok_seg)):
        blk = table[bt_off[s] + p // bs - first_lb[s]]
        want[t] = blk * bs + p % bs if blk >= 0 else -1
    with tempfile.TemporaryDirectory(prefix="dsv4ref-") as d:
        write_params(d, mode="map", backend=BACKEND, n_tokens=len(positions), n_segments=n_segments,
                     n_block_table=len(table), block_size=bs, n_blocks=n_blocks)
        positions.astype("<i8").tofile(os.path.join(d, "positions.bin"))
        tok_seg.astype("<i4").tofile(os.path.join(d, "tok_seg.bin"))
        np.array(first_lb, dtype="<i8").tofile(os.path.join(d, "seg_first_lb.bin"))
        np.array(bt_off, dtype="<u4").tofile(os.path.join(d, "seg_bt_off.bin"))
        np.array(bt_len, dtype="<u4").tofile(os.path.join(d, "seg_bt_len.bin"))
        table.astype("<i4").tofile(os.path.join(d, "block_table.bin"))
        run_kernel(d)
        with open(os.path.join(d, "rc.txt")) as f:
            rc = int(f.read())
        if rc != 0:
            raise Failure("%s: map_slots returned %d" % (name, rc))
        got = np.fromfile(os.path.join(d, "slots_out.bin"), dtype="<i8")
    bad = np.nonzero(got != want)[0]
    if len(bad):
        t = int(bad[0])
        raise Failure("%s: slot of token %d (position %d, segment %d) is %d, expected %d"
                      % (name, t, positions[t], tok_seg[t], got[t], want[t]))
    print("ok   %-34s N=%-5d segments=%d bs=%d" % (name, len(positions), n_segments, bs))


def main():
    if not KERNEL_RUN:
        print("usage: test_cpu_vs_ref.py <kernel_run> [backend [isa]]", file=sys.stderr)
        return 2
    rng = np.random.default_rng(20240611)
    start = time.time()
    failures = []
    cases = [
        lambda: spec_test_vector(),
        lambda: run_case("h64_plain_prenormed_random", rng, 64, 64, 64, 4, "plain", "prenormed",
                         "random", bf16_normal, bf16_normal),
        lambda: run_case("h128_yarn_fused_high_extreme", rng, 128, 24, 16, 8, "yarn", "fused", "high",
                         bf16_extreme, bf16_extreme, minus_one=0.2, cache_init="random"),
        lambda: run_case("h8_plain_fused_low_mixed", rng, 8, 300, 256, 3, "plain", "fused", "low",
                         bf16_extreme, mixed_kv, minus_one=0.1),
        lambda: run_case("h8_yarn_prenormed_tiny", rng, 8, 200, 16, 32, "yarn", "prenormed", "mixed",
                         bf16_tiny, bf16_tiny, cache_init="random"),
        lambda: run_case("h64_yarn_mixed_replay_nowrite", rng, 64, 40, 64, 2, "yarn", "prenormed",
                         "mixed", bf16_normal, mixed_kv, write_kv=0, cache_init="random"),
        lambda: run_case("h128_plain_prenormed_low", rng, 128, 16, 256, 1, "plain", "prenormed", "low",
                         bf16_normal, mixed_kv, minus_one=0.3),
        lambda: run_case("h64_yarn_fused_mixed_1thread", rng, 64, 33, 64, 3, "yarn", "fused",
                         "mixed", bf16_extreme, mixed_kv, threads=1, cache_init="random"),
        lambda: run_case("h8_plain_fused_big_batch", rng, 8, 1500, 64, 40, "plain", "fused", "random",
                         bf16_normal, mixed_kv, minus_one=0.05, threads=2),
        lambda: run_case("h64_plain_all_minus_one", rng, 64, 8, 16, 2, "plain", "prenormed", "random",
                         bf16_normal, bf16_normal, minus_one=1.0, cache_init="random"),
        lambda: run_case("h64_plain_fused_boundaries", rng, 64, 48, 16, 4, "plain", "fused", "random",
                         bf16_boundary, bf16_boundary),
        lambda: run_case("h8_yarn_prenormed_boundaries", rng, 8, 256, 64, 5, "yarn", "prenormed",
                         "high", bf16_boundary, bf16_boundary, minus_one=0.1, cache_init="random"),
        lambda: seqtable_batches(rng),
        lambda: random_sweep(rng, 18),
        lambda: map_case(rng, "map_slots_bs64", 64, 400, 6),
        lambda: map_case(rng, "map_slots_bs16_holes", 16, 800, 9, holes=0.2),
        lambda: map_case(rng, "map_slots_bs256", 256, 50, 4),
    ]
    for case in cases:
        try:
            case()
        except (Failure, RuntimeError) as e:
            failures.append(str(e))
            print("FAIL " + str(e))
        except LevelMissing as e:
            if failures:
                print("%d cases failed before the kernel level was found missing: %s"
                      % (len(failures), e))
                return 1
            print("skipped: " + str(e))
            return 77
    print("%d cases, %d failed, %.1f s" % (len(cases), len(failures), time.time() - start))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
