"""The compressed branch over HTTP (SPEC §8): layers 2 (ratio 4, with the indexer) and 3 (ratio 128)
of the built-in V4-Flash geometry, with a checkpoint holding their compressors.

Checked here, on a backend that runs the branch: the wire (ckv, ikv, iq, iw required and checked by
the layer's ratio, each refusal a 400 naming the tensor and the reason, out-of-range values named,
nothing changed by any refusal); outputs=topk; exactly-once (a replay answers the same bytes and
advances nothing, also when it straddles an emission); a prefill split into chunks not aligned to
the ratio answers the same bytes as in one batch; a batch mixing sequences at different phases of
their windows; the state slot limit (503 sequence_limit) and the entry pools (503
kv_pool_exhausted naming the pool). On a backend that does not run the branch, the same layers take
q and kv only and refuse the branch's tensors and attention. The numbers themselves are checked
against the independent models in tests/reference (test_compress_models, kernel_run).
"""

import json
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
C4, C128 = 2, 3


def write_weights():
    tmp = tempfile.mkdtemp(prefix="dsv4d-c-")
    path = os.path.join(tmp, "w.safetensors")
    entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                np.linspace(-2, 2, MODEL_HEADS).astype("<f4").tobytes()) for l in LAYERS]
    entries += [e for l in LAYERS for e in h.compressor_entries(l)]
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))
    return path


WEIGHTS = None


def daemon(extra=()):
    global WEIGHTS
    if WEIGHTS is None:
        WEIGHTS = write_weights()
    return Daemon(h.SMALL + ["--weights", WEIGHTS] + list(extra))


def runs_branch(d):
    layers = d.admin_json("/admin/v1/cache").get("compressed", {}).get("layers", {})
    return str(C4) in layers and str(C128) in layers


def batch(rng, layer, segs, outputs="attn,lse,digest"):
    return Batch.random(rng, layer, segs, HEADS, outputs=outputs, ratio=h.flash_ratio(layer))


def tensors(d, b):
    r = d.forward_raw(b.body())
    check_eq(r.status, 200, "%r answered: %r" % (b, r))
    meta, t = h.st_decode(r.body)
    return meta, t


def replace(b, name, entry):
    out = b.copy()
    out.extra = [entry if e[0] == name else e for e in out.extra]
    if entry is not None and all(e[0] != name for e in b.extra):
        out.extra.append(entry)
    out.extra = [e for e in out.extra if e is not None]
    return out


def without(b, name):
    out = b.copy()
    out.extra = [e for e in out.extra if e[0] != name]
    return out


def test_wire_refusals():
    rng = np.random.default_rng(1)
    with daemon() as d:
        if not runs_branch(d):
            return check_without_branch(d, rng)
        good = batch(rng, C4, [Seg("w", 0, 5, True)])
        n = 5
        cases = [
            (without(good, "ikv"), "ikv", "missing"),
            (without(batch(rng, C128, [Seg("w", 0, 5, True)]), "ckv"), "ckv", "missing"),
            (replace(batch(rng, C128, [Seg("w", 0, 5, True)]), "iq", good.extra[2]), "iq",
             "unexpected"),
            (replace(batch(rng, 0, [Seg("w", 0, 5, True)]), "ckv", good.extra[0]), "ckv",
             "unexpected"),
            (replace(good, "iq", ("iq", "F32", [n, 64, 128], bytes(n * 64 * 128 * 4))), "iq",
             "dtype"),
            (replace(good, "ckv", ("ckv", "F32", [n, 1024], bytes(n * 1024 * 4))), "ckv", "shape"),
            (replace(good, "iw", ("iw", "F32", [n, 32], bytes(n * 32 * 4))), "iw", "shape"),
        ]
        for b, tensor, reason in cases:
            e = h.expect_error(d.forward_raw(b.body()), 400, "bad_request")
            check_eq((e.get("tensor"), e.get("reason")), (tensor, reason),
                     "refusal names the tensor and the reason: %r" % (e,))
        # Values out of range (SPEC §8.8): |ckv|, |ikv| >= 2^59; |iq|, |iw| >= 2^32.
        big = [("ckv", np.float32(2.0 ** 59)), ("ikv", np.float32(-2.0 ** 60)),
               ("iw", np.float32(2.0 ** 32)), ("ckv", np.float32(np.nan))]
        for name, v in big:
            i = [e[0] for e in good.extra].index(name)
            arr = np.frombuffer(good.extra[i][3], "<f4").copy()
            arr[len(arr) // 2] = v
            b = replace(good, name, (name, "F32", good.extra[i][2], arr.tobytes()))
            e = h.expect_error(d.forward_raw(b.body()), 400, "value_out_of_range")
            check_eq(e.get("tensor"), name, "out-of-range refusal names %s: %r" % (name, e))
        iq = h.bf16_to_f32(np.frombuffer(good.extra[2][3], "<u2")).copy()
        iq[7] = 2.0 ** 32
        b = replace(good, "iq", ("iq", "BF16", good.extra[2][2], h.f32_to_bf16(iq).astype(
            "<u2").tobytes()))
        check_eq(h.expect_error(d.forward_raw(b.body()), 400, "value_out_of_range").get("tensor"),
                 "iq", "iq out of range named")
        # topk is a ratio-4 layer's output only.
        b = batch(rng, C128, [Seg("w", 0, 5, True)], outputs="topk")
        h.expect_error(d.forward_raw(b.body()), 400, "bad_request")
        check(d.seq("w") is None, "no refusal created the sequence")
        check_eq(d.used_blocks(), 0, "no refusal took a block")
        # The good batch is served afterwards.
        tensors(d, good)


def check_without_branch(d, rng):
    """A backend that does not run the branch: compressed layers take q and kv only."""
    print("backend %s does not run the compressed branch: checking that it says so" %
          h.BACKEND_NAME)
    b = batch(rng, C4, [Seg("x", 0, 5, True)])
    e = h.expect_error(d.forward_raw(b.body()), 400, "bad_request")
    check_eq(e.get("reason"), "unexpected", "branch tensors refused: %r" % (e,))
    b.extra = []
    e = h.expect_error(d.forward_raw(b.body()), 400, "unsupported")
    check("compressed branch" in e["message"], "attention refused naming the branch: %r" % (e,))
    b.outputs = "q,digest"
    d.forward(b)


def test_topk_and_visibility():
    """Few visible entries: all selected, in increasing j, -1 padded; the count follows SPEC §8.4."""
    rng = np.random.default_rng(2)
    with daemon() as d:
        if not runs_branch(d):
            return check_without_branch(d, rng)
        b = batch(rng, C4, [Seg("t", 0, 13, True)], outputs="topk,attn")
        meta, t = tensors(d, b)
        topk = h.st_array(t, "topk", "I32", (13, 512))
        for i in range(13):
            k = (i + 1) // 4
            check_eq(list(topk[i, :k]), list(range(k)), "token %d selects entries 0..%d" % (i, k))
            check(np.all(topk[i, k:] == -1), "token %d padded with -1" % i)
        # A second sequence starting at p0 = 10: it sees entries floor(10/4) = 2 on.
        b = batch(rng, C4, [Seg("u", 10, 6, True)], outputs="topk")
        meta, t = tensors(d, b)
        topk = h.st_array(t, "topk", "I32", (6, 512))
        for i in range(6):
            p = 10 + i
            want = list(range(2, (p + 1) // 4))
            check_eq(list(topk[i, :len(want)]), want, "p0 > 0: token at %d" % p)


def run_chunks(d, layer, seq, chunks, rng_seed, outputs="attn,lse,topk,digest"):
    """Feed one sequence's positions 0..sum(chunks)-1 in the given chunks, with inputs drawn once
    for the whole run so that any chunking sends the same rows. Returns the concatenated attn, lse
    and (ratio 4) topk, and the digests."""
    total = sum(chunks)
    rng = np.random.default_rng(rng_seed)
    whole = batch(rng, layer, [Seg(seq, 0, total, True)], outputs=outputs)
    if h.flash_ratio(layer) != 4:
        outputs = outputs.replace(",topk", "")
    attn, lse, topk, digests, start = [], [], [], [], 0
    for c in chunks:
        part = Batch(layer, [Seg(seq, start, c, start == 0)], whole.q[start:start + c],
                     whole.kv[start:start + c], outputs,
                     [(n, dt, [c] + sh[1:], np.frombuffer(raw, np.uint8).reshape(
                         sh[0], -1)[start:start + c].tobytes()) for n, dt, sh, raw in whole.extra])
        meta, t = tensors(d, part)
        attn.append(h.st_array(t, "attn", "BF16", (c, HEADS, 512)).copy())
        lse.append(h.st_array(t, "lse", "F32", (c, HEADS)).copy())
        if "topk" in outputs:
            topk.append(h.st_array(t, "topk", "I32", (c, t["topk"][1][1])).copy())
        digests.append(meta["cache_digest"])
        start += c
    return (np.concatenate(attn), np.concatenate(lse), np.concatenate(topk) if topk else None,
            digests)


def test_chunking_is_exact():
    """A prefill in chunks not aligned to the ratio answers the bytes of one batch (ring rows carry
    over between batches), and so does a decode run token by token over an emission."""
    with daemon(["--kv-blocks", "64"]) as d:
        if not runs_branch(d):
            return check_without_branch(d, np.random.default_rng(3))
        for layer in (C4, C128):
            n = 300 if layer == C128 else 70
            one = run_chunks(d, layer, "one%d" % layer, [n], 10 + layer)
            cut = [37, 1, 2, 23, 7] if layer == C4 else [37, 1, 2, 93, 167]
            for name, chunks in (("chunks", cut), ("decode", [n - 9] + [1] * 9)):
                got = run_chunks(d, layer, "%s%d" % (name, layer), chunks, 10 + layer)
                check(np.array_equal(got[0], one[0]), "layer %d %s: attn bytes" % (layer, name))
                check(np.array_equal(got[1].view(np.uint32), one[1].view(np.uint32)),
                      "layer %d %s: lse bytes" % (layer, name))
                if one[2] is not None:
                    check(np.array_equal(got[2], one[2]), "layer %d %s: topk" % (layer, name))
            for name in ("one", "chunks", "decode"):
                s = d.seq("%s%d" % (name, layer))
                check_eq(s["next"][str(layer)], n, "%s: next position" % name)


def small_topk_config(k):
    """A model config.json of the V4-Flash layers whose indexer keeps only k entries, so that a short
    sequence already has more visible entries than it selects (the scoring path, SPEC §8.5)."""
    tmp = tempfile.mkdtemp(prefix="dsv4d-c-")
    path = os.path.join(tmp, "config.json")
    ratios = [h.flash_ratio(l) for l in range(44)]
    with open(path, "w") as f:
        json.dump({"num_attention_heads": MODEL_HEADS, "num_hidden_layers": 43,
                   "num_nextn_predict_layers": 1, "compress_ratios": ratios, "index_topk": k,
                   "rope_scaling": {"type": "yarn", "factor": 16,
                                    "original_max_position_embeddings": 65536,
                                    "beta_fast": 32, "beta_slow": 1}}, f)
    return path


def test_scored_selection_chunking():
    """With index_topk 8, a 100-token sequence scores its entries: each token keeps 8 of up to 25,
    in increasing j, and chunking the prefill answers the same selection and the same bytes."""
    with daemon(["--model-config", small_topk_config(8)]) as d:
        if not runs_branch(d):
            return check_without_branch(d, np.random.default_rng(11))
        one = run_chunks(d, C4, "s-one", [100], 12, outputs="attn,lse,topk,digest")
        got = run_chunks(d, C4, "s-cut", [41, 3, 56], 12, outputs="attn,lse,topk,digest")
        topk = one[2]
        check_eq(topk.shape, (100, 8), "topk is [N, index_topk]")
        for i in range(100):
            vis = (i + 1) // 4
            row = [int(x) for x in topk[i] if x >= 0]
            check_eq(len(row), min(8, vis), "token %d keeps min(8, %d) entries" % (i, vis))
            check(row == sorted(set(row)) and all(0 <= j < vis for j in row),
                  "token %d: increasing visible entries %r" % (i, row))
        check(np.array_equal(got[2], topk), "chunked selection equals one batch's")
        check(np.array_equal(got[0], one[0]), "chunked attn equals one batch's")


def test_daemon_chunks_prefill():
    """A prefill the daemon runs in chunks of prefill_chunk_tokens (with decodes between them)
    answers the bytes of one launch on a compressed layer too: the rings carry over between the
    chunks, and the entries a chunk emits are visible to the next."""
    bodies = []
    for chunk in ("0", "16"):
        with daemon(["--prefill-chunk-tokens", chunk, "--prefill-chunk-tokens-alone", chunk,
                     "--model-config", small_topk_config(8)]) as d:
            if not runs_branch(d):
                return check_without_branch(d, np.random.default_rng(12))
            rng = np.random.default_rng(13)
            got = []
            for layer in (C4, C128):
                n = 150 if layer == C4 else 300
                b = batch(rng, layer, [Seg("k%d" % layer, 0, n, True), Seg("j%d" % layer, 7, 41,
                                                                            True)],
                          outputs="q,attn,lse,digest" + (",topk" if layer == C4 else ""))
                r = d.forward_raw(b.body())
                check_eq(r.status, 200, "chunk %s layer %d: %r" % (chunk, layer, r))
                got.append(r.body)
            if chunk != "0":
                ms = d.metrics()
                check(h.metric(ms, "dsv4d_prefill_chunks_total") > 2, "the prefills ran in chunks")
            bodies.append(got)
    check(bodies[0] == bodies[1], "chunked prefills answer the bytes of one launch")


def test_replay_exactly_once():
    """A replay answers the same bytes and changes nothing: the next batch then answers what it
    answers on a daemon that never saw the replay, also when the replay straddles an emission."""
    with daemon() as a, daemon() as b:
        if not runs_branch(a):
            return check_without_branch(a, np.random.default_rng(4))
        rng = np.random.default_rng(5)
        for layer in (C4, C128):
            first = batch(rng, layer, [Seg("r", 0, 130, True)])
            straddle = batch(rng, layer, [Seg("r", 130, 3, False)])  # emits entry 32 at ratio 4
            after = batch(rng, layer, [Seg("r", 133, 2, False)])
            for d in (a, b):
                tensors(d, first)
            m1, t1 = tensors(a, straddle)
            m2, t2 = tensors(a, straddle)
            check_eq(m2.get("replayed"), "true", "the second send is a replay")
            for k in ("attn", "lse") + (("topk",) if layer == C4 else ()):
                if k in t1:
                    check_eq(t1[k], t2[k], "replay answers the same %s" % k)
            check_eq(m1["cache_digest"], m2["cache_digest"], "replay digest")
            tensors(b, straddle)
            ma, ta = tensors(a, after)
            mb, tb = tensors(b, after)
            check_eq(ta, tb, "layer %d: after a replay the next batch answers the same" % layer)
            check_eq(ma["cache_digest"], mb["cache_digest"], "and writes the same records")
            # Overlapping applied positions with other bytes: 409, nothing changed.
            bad = batch(rng, layer, [Seg("r", 133, 2, False)])
            h.expect_error(a.forward_raw(bad.body()), 409, "position_mismatch")
            a.delete_seq("r")
            b.delete_seq("r")


def test_mixed_phases():
    """One batch of three sequences at different phases of their windows (one about to emit, one
    just after an emission, one new at p0 > 0) answers what each answers alone."""
    with daemon() as a, daemon() as b:
        if not runs_branch(a):
            return check_without_branch(a, np.random.default_rng(6))
        rng = np.random.default_rng(7)
        layer = C4
        pre = {"m0": (0, 7), "m1": (0, 8)}
        for name, (s, n) in pre.items():
            pb = batch(rng, layer, [Seg(name, s, n, True)])
            tensors(a, pb)
            tensors(b, pb)
        segs = [Seg("m0", 7, 1, False), Seg("m1", 8, 3, False), Seg("m2", 41, 6, True)]
        mixed = batch(rng, layer, segs, outputs="attn,lse,topk")
        _, tm = tensors(a, mixed)
        t0 = 0
        for s in segs:
            one = Batch(layer, [s], mixed.q[t0:t0 + s.len], mixed.kv[t0:t0 + s.len], mixed.outputs,
                        [(n, dt, [s.len] + sh[1:], np.frombuffer(raw, np.uint8).reshape(
                            sh[0], -1)[t0:t0 + s.len].tobytes())
                         for n, dt, sh, raw in mixed.extra])
            _, ts = tensors(b, one)
            for k in ("attn", "lse", "topk"):
                got = np.frombuffer(tm[k][2], np.uint8).reshape(mixed.n, -1)[t0:t0 + s.len]
                want = np.frombuffer(ts[k][2], np.uint8).reshape(s.len, -1)
                check(np.array_equal(got, want), "%s of %s in the mixed batch" % (k, s.seq))
            t0 += s.len


def test_restore_and_branch_off():
    """A dump carries the compressed branch's state (test_restore_compressed checks it whole): a
    daemon that runs the branch restores its own dump, and one with compressed_branch = off serves
    those layers' SWA part with no compressor read."""
    with daemon() as d:
        if not runs_branch(d):
            return check_without_branch(d, np.random.default_rng(14))
        rng = np.random.default_rng(15)
        tensors(d, batch(rng, 0, [Seg("z", 0, 5, True)], outputs="q"))
        tensors(d, batch(rng, C4, [Seg("z", 0, 9)], outputs="attn"))
        r = d.admin("/admin/v1/dump?seq=z")
        check_eq(r.status, 200, "the dump of a sequence: %r" % (r,))
        meta, t = h.st_decode(r.body)
        check("layers.%d.c_records" % C4 in t and "layers.%d.ring" % C128 in t,
              "the dump carries the compressed state: %r" % sorted(t))
        r = d.request("PUT", "/admin/v1/sequences/z2", body=r.body, admin=True)
        check_eq(r.status, 201, "the restore of a dump with compressed state: %r" % (r.body,))
        check_eq(d.seq("z2")["next"], d.seq("z")["next"], "the restored sequence's positions")
    with daemon(["--compressed-branch", "off"]) as d:
        check(not runs_branch(d), "compressed_branch = off runs no branch")
        b = batch(np.random.default_rng(16), C4, [Seg("o", 0, 5, True)], outputs="q")
        e = h.expect_error(d.forward_raw(b.body()), 400, "bad_request")
        check_eq(e.get("reason"), "unexpected", "branch tensors refused when off: %r" % (e,))


def test_limits():
    """max_sequences bounds the state slots (503 sequence_limit); a full entry pool refuses the batch
    naming the pool; neither refusal changes anything."""
    with daemon(["--max-sequences", "2", "--c4-blocks", "1", "--block-size", "16"]) as d:
        if not runs_branch(d):
            return check_without_branch(d, np.random.default_rng(8))
        rng = np.random.default_rng(9)
        for name in ("l0", "l1"):
            tensors(d, batch(rng, 0, [Seg(name, 0, 1, True)]))
        e = h.expect_error(d.forward_raw(batch(rng, 0, [Seg("l2", 0, 1, True)]).body()), 503,
                           "sequence_limit")
        check(d.seq("l2") is None, "sequence_limit created nothing: %r" % (e,))
        d.delete_seq("l1")
        # 4 * 16 entries fill the one c4 block; one more position past it needs a second block.
        tensors(d, batch(rng, C4, [Seg("l0", 0, 64, False)]))
        before = d.seq("l0")
        e = h.expect_error(d.forward_raw(batch(rng, C4, [Seg("l0", 64, 8, False)]).body()), 503,
                           "kv_pool_exhausted")
        check_eq(e.get("pool"), "c4", "the refusal names the pool: %r" % (e,))
        check_eq(d.seq("l0"), before, "the refused batch changed nothing")
        ms = d.metrics()
        check_eq(h.metric(ms, "dsv4d_kv_blocks", pool="c4", state="used"), 1.0, "c4 used")
        check_eq(h.metric(ms, "dsv4d_kv_blocks_total", pool="c128"), 64.0, "c128 pool size")


if __name__ == "__main__":
    h.main([test_wire_refusals, test_topk_and_visibility, test_chunking_is_exact,
            test_scored_selection_chunking, test_daemon_chunks_prefill, test_replay_exactly_once,
            test_mixed_phases, test_restore_and_branch_off, test_limits])
