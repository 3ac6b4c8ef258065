"""Dumps and restores of a daemon that runs the compressed branch (SPEC §8.7, §8.9): the dump carries
each compressed layer's entries (c_records, c_entries), at ratio 4 its index records (i_records), and
the sequence's ring rows (ring), with their digests; a restore writes them into fresh entry blocks
and a fresh state slot.

Checked: the dump's compressed tensors and digests; a restored sequence answers the next batches
(attn, lse, topk, cache_digest) byte for byte like the daemon it came from, including batches that
emit an entry from ring rows written before the dump, on a daemon of another block size too; a
snapshot on drain comes back at start-up the same way; refusals (a corrupt entry, index record or
ring digest, a missing ring, an SWA-only dump into a daemon that runs the branch and the reverse)
answer their JSON error and change nothing. On a backend that does not run the branch the SWA
dump is unchanged (test_restore covers it) and this test says so.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402
import xxhash  # noqa: E402 (the harness provides it where the module is missing)

HEADS = 8
MODEL_HEADS = 64
LAYERS = (0, 1, 2, 3)
C4, C128 = 2, 3
P0 = 5


class Env:
    """Weights with the attention sinks and the compressors of layers 2 and 3."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="dsv4d-crestore-")
        self.weights = os.path.join(self.dir, "w.safetensors")
        entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                    (np.linspace(-2.0, 2.0, MODEL_HEADS) + 0.25 * l).astype("<f4").tobytes())
                   for l in LAYERS]
        entries += [e for l in LAYERS for e in h.compressor_entries(l)]
        with open(self.weights, "wb") as f:
            f.write(h.st_encode(entries, {"format": "pt"}))

    def args(self, *extra, block_size=64, branch="on"):
        return ["--kv-blocks", "64", "--block-size", str(block_size), "--layers", "0-3",
                "--heads", str(HEADS), "--threads", "1", "--weights", self.weights,
                "--compressed-branch", branch] + list(extra)

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def runs_branch(d):
    layers = d.admin_json("/admin/v1/cache").get("compressed", {}).get("layers", {})
    return str(C4) in layers and str(C128) in layers


def fwd(rng, layer, seg, branch=True):
    r = h.flash_ratio(layer) if branch else 0
    outputs = "q,digest" if (layer >= 2 and not branch) else (
        "attn,lse,topk,digest" if r == 4 else "attn,lse,digest")
    return Batch.random(rng, layer, [seg], HEADS, outputs=outputs, ratio=r)


def history(rng, name, p0=P0, branch=True):
    """The C4 layer stops 3 rows into a window (next 307 = 4 * 76 + 3) and the C128 layer one row
    short of an emission (next 255), so the first next batch of each emits an entry from ring rows
    written before the dump."""
    return [fwd(rng, 0, Seg(name, p0, 300, True), branch), fwd(rng, 1, Seg(name, p0, 120), branch),
            fwd(rng, C4, Seg(name, p0, 299), branch), fwd(rng, C4, Seg(name, p0 + 299, 3), branch),
            fwd(rng, C128, Seg(name, p0, 200), branch),
            fwd(rng, C128, Seg(name, p0 + 200, 50), branch)]


def next_batches(rng, d, name, branch=True):
    nxt = d.seq(name)["next"]
    out = []
    for k in range(3):
        out += [fwd(rng, l, Seg(name, nxt[str(l)] + k * 2, 2), branch) for l in LAYERS]
    return out


def answer(d, b):
    r = d.forward_raw(b.body())
    check_eq(r.status, 200, "forward %r on %s: %r" % (b, d.name, r.body[:300]))
    meta, t = h.st_decode(r.body)
    return meta, {k: bytes(v[2]) for k, v in t.items() if k != "slots"}


def same_answers(d1, others, batches, what):
    for b in batches:
        a1 = answer(d1, b)
        for d2 in others:
            a2 = answer(d2, b)
            check_eq(a2[0], a1[0], "%s: metadata of %r on %s" % (what, b, d2.name))
            check_eq(sorted(a2[1]), sorted(a1[1]), "%s: tensors of %r" % (what, b))
            for k in a1[1]:
                check(a1[1][k] == a2[1][k], "%s: %s of %r differs between %s and %s" %
                      (what, k, b, d1.name, d2.name))


def dump(d, name):
    r = d.admin("/admin/v1/dump?seq=%s" % name)
    check_eq(r.status, 200, "dump of %s: %r" % (name, r.body[:300]))
    return r.body


def put(d, name, body, query=""):
    return d.request("PUT", "/admin/v1/sequences/%s%s" % (name, query), body=body, admin=True)


def digests(d, name):
    """{layer: (digest, compressed digests or None)} from /admin/v1/checksums."""
    out = {}
    for l in LAYERS:
        row = d.admin_json("/admin/v1/checksums?layer=%d&seq=%s" % (l, name))["sequences"][name]
        out[l] = (row["digest"], row.get("compressed"))
    return out


def state(d):
    seqs = d.admin_json("/admin/v1/sequences")["sequences"]
    for s in seqs:
        s.pop("idle_ms", None)
    cache = d.admin_json("/admin/v1/cache")
    return (seqs, {s["seq"]: digests(d, s["seq"]) for s in seqs}, d.used_blocks(),
            json.dumps(cache.get("compressed", {}).get("pools"), sort_keys=True))


def reencode(body, meta_edit=None, drop=(), edit=None):
    meta, t = h.st_decode(body)
    if meta_edit:
        meta_edit(meta)
    tensors = []
    for k, v in t.items():
        if k in drop:
            continue
        raw = bytes(v[2])
        if edit and k in edit:
            raw = edit[k](raw)
        tensors.append((k, v[0], v[1], raw))
    return h.st_encode(tensors, meta)


def flip(raw, at=None):
    b = bytearray(raw)
    i = len(b) // 2 if at is None else at
    b[i] ^= 0x01
    return bytes(b)


def check_dump(body, d, name):
    """The compressed tensors and their digests, recomputed here (SPEC §3.1 framing with j)."""
    meta, t = h.st_decode(body)
    p0 = d.seq(name)["p0"]
    for l, r in ((C4, 4), (C128, 128)):
        nxt = int(meta["next.%d" % l])
        j0, j1 = p0 // r, nxt // r
        ent = h.st_array(t, "layers.%d.c_entries" % l, "I64", (j1 - j0,))
        check_eq(list(ent), list(range(j0, j1)), "layer %d entries" % l)
        rec = h.st_array(t, "layers.%d.c_records" % l, "U8", (j1 - j0, 584))
        x = xxhash.xxh3_64()
        for k, j in enumerate(ent):
            x.update(int(j).to_bytes(8, "little", signed=True) + rec[k].tobytes())
        check_eq(meta["c_digest.%d" % l], x.hexdigest(), "layer %d c_digest" % l)
        ring = h.st_array(t, "layers.%d.ring" % l, "F32", (t["layers.%d.ring" % l][1][0],))
        check_eq(len(ring), 8 * 2048 + 8 * 512 if r == 4 else 128 * 1024, "ring floats")
        check(np.any(ring != 0), "layer %d ring rows are there" % l)
        if r == 4:
            ix = h.st_array(t, "layers.%d.i_records" % l, "U8", (j1 - j0, 68))
            x = xxhash.xxh3_64()
            for k, j in enumerate(ent):
                x.update(int(j).to_bytes(8, "little", signed=True) + ix[k].tobytes())
            check_eq(meta["i_digest.%d" % l], x.hexdigest(), "layer %d i_digest" % l)
        else:
            check("layers.%d.i_records" % l not in t, "no index records at ratio 128")
    for l in (0, 1):
        check("layers.%d.c_records" % l not in t, "no compressed state on layer %d" % l)


# ---------------------------------------------------------------------------------------------------


def test_restore_compressed_answers_as_never_interrupted():
    env = Env()
    try:
        hist = history(np.random.default_rng(1), "a")
        with Daemon(env.args(), name="source") as a, Daemon(env.args(), name="restored") as b, \
                Daemon(env.args(block_size=16), name="restored-bs16") as c, \
                Daemon(env.args("--max-sequences", "1"), name="one-slot") as m:
            if not runs_branch(a):
                print("backend %s does not run the compressed branch: nothing to dump" %
                      h.BACKEND_NAME)
                return
            for x in hist:
                answer(a, x)
            # A second sequence first, so that the restored one gets another slot than its own.
            answer(b, fwd(np.random.default_rng(9), C4, Seg("other", 0, 9, True)))
            body = dump(a, "a")
            check_dump(body, a, "a")
            want = digests(a, "a")
            meta, _ = h.st_decode(body)
            for l in LAYERS:
                cz = want[l][1]
                check_eq(cz is not None, l in (C4, C128), "checksums name compressed state at %d" % l)
                if cz is None:
                    continue
                check_eq((cz["c_digest"], cz["ring_digest"], cz.get("i_digest")),
                         (meta["c_digest.%d" % l], meta["ring_digest.%d" % l],
                          meta.get("i_digest.%d" % l)), "checksums vs the dump at layer %d" % l)
                check_eq(cz["entries"], int(meta["next.%d" % l]) // cz["ratio"] - P0 // cz["ratio"],
                         "entries at layer %d" % l)
            for d in (b, c):
                r = put(d, "a", body)
                check_eq(r.status, 201, "restore on %s: %r" % (d.name, r.body[:300]))
                check_eq(digests(d, "a"), want, "%s: SWA and compressed digests" % d.name)
                check_eq(d.seq("a")["next"], a.seq("a")["next"], "next")
            # A replace of the live sequence by the same dump (into a fresh slot, or its own when
            # none is free) leaves it as it was.
            r = put(b, "a", body, "?replace=1")
            check_eq(r.status, 200, "replace on %s: %r" % (b.name, r.body[:300]))
            check_eq(r.json()["replaced"], True, "replaced")
            check_eq(digests(b, "a"), want, "digests after the replace")
            # With one slot, held by the sequence itself, a replace reuses it.
            check_eq(put(m, "a", body).status, 201, "restore with one slot")
            r = put(m, "a", body, "?replace=1")
            check_eq(r.status, 200, "replace with one slot: %r" % (r.body[:300],))
            check_eq(digests(m, "a"), want, "digests after the replace with one slot")
            # The dump of the restored sequence is the source's (instance aside).
            meta_a, _ = h.st_decode(dump(a, "a"))
            meta_b, _ = h.st_decode(dump(b, "a"))
            for k in meta_a:
                if k.split(".")[0] in ("c_digest", "i_digest", "ring_digest", "digest", "next"):
                    check_eq(meta_b[k], meta_a[k], "restored dump's %s" % k)
            same_answers(a, [b, c, m], next_batches(np.random.default_rng(2), a, "a"),
                         "next batches")
            check_eq(digests(b, "a"), digests(a, "a"), "digests after the next batches")
    finally:
        env.close()


def test_restore_compressed_refusals_change_nothing():
    env = Env()
    try:
        with Daemon(env.args(), name="branch") as a, \
                Daemon(env.args(branch="off"), name="no-branch") as o:
            if not runs_branch(a):
                print("backend %s does not run the compressed branch" % h.BACKEND_NAME)
                return
            for x in history(np.random.default_rng(3), "a"):
                answer(a, x)
            for x in history(np.random.default_rng(4), "s", branch=False):
                answer(o, x)
            answer(a, fwd(np.random.default_rng(5), C4, Seg("keep", 0, 9, True)))
            body = dump(a, "a")
            swa_only = dump(o, "s")
            check(b"c_records" not in swa_only[:4096], "an SWA-only daemon's dump is as before")
            before = state(a)
            cases = [
                ("corrupt entry", reencode(body, edit={"layers.2.c_records": lambda r: flip(r, 40)}),
                 400, "digest_mismatch"),
                ("corrupt index record",
                 reencode(body, edit={"layers.2.i_records": flip}), 400, "digest_mismatch"),
                ("corrupt ring", reencode(body, edit={"layers.3.ring": flip}), 400,
                 "digest_mismatch"),
                ("missing ring", reencode(body, drop=("layers.3.ring",)), 400, "bad_request"),
                ("missing ring digest", reencode(body, lambda m: m.pop("ring_digest.2")), 400,
                 "bad_request"),
                ("SWA-only dump", swa_only, 400, "bad_request"),
            ]
            for what, b, status, code in cases:
                r = put(a, "new", b)
                e = expect_error(r, status, code)
                check(e.get("message"), "%s: a message" % what)
                check_eq(state(a), before, "%s changed nothing" % what)
            # The reverse: a dump with compressed state into a daemon without the branch.
            before_o = state(o)
            e = expect_error(put(o, "new", body), 400, "bad_request")
            check("compressed" in e["message"], "refusal names the compressed state: %r" % e)
            check_eq(state(o), before_o, "refused on the SWA-only daemon: nothing changed")
            # The digest check names the layer.
            e = expect_error(put(a, "new", cases[0][1]), 400, "digest_mismatch")
            check_eq(e.get("layer"), C4, "digest refusal names the layer: %r" % e)
            # And the untouched dump is restored afterwards.
            check_eq(put(a, "new", body).status, 201, "the good dump restores")
        # Entries 1..76 need two c4 blocks at bs 64: a pool of one refuses, naming it.
        with Daemon(env.args("--c4-blocks", "1"), name="small-c4") as s:
            answer(s, fwd(np.random.default_rng(5), C4, Seg("keep", 0, 9, True)))
            before = state(s)
            e = expect_error(put(s, "new", body), 503, "kv_pool_exhausted")
            check_eq(e.get("pool"), "c4", "the refusal names the pool: %r" % e)
            check_eq(state(s), before, "a full entry pool: nothing changed")
    finally:
        env.close()


def test_snapshot_compressed_on_drain_and_restart():
    env = Env()
    snap = os.path.join(env.dir, "snap")
    os.mkdir(snap)
    try:
        hist = history(np.random.default_rng(6), "a")
        with Daemon(env.args(), name="reference") as ref:
            if not runs_branch(ref):
                print("backend %s does not run the compressed branch" % h.BACKEND_NAME)
                return
            for x in hist:
                answer(ref, x)
            first = Daemon(env.args("--snapshot-dir", snap), name="first").start()
            for x in hist:
                answer(first, x)
            check_eq(first.stop(), 0, "exit status after SIGTERM with snapshot_dir")
            first.check_log_clean()
            check(os.path.exists(os.path.join(snap, "a.safetensors")), "a's snapshot file")
            with Daemon(env.args("--snapshot-dir", snap), name="second") as second:
                check_eq(digests(second, "a"), digests(ref, "a"), "digests after restart")
                same_answers(ref, [second], next_batches(np.random.default_rng(7), ref, "a"),
                             "next batches after restart")
    finally:
        env.close()


def ctl_verify(path):
    """dsv4ctl --json verify path (dsv4ctl beside the daemon or above it): exit code and document."""
    d = os.path.dirname(h.DAEMON)
    for _ in range(3):
        if os.access(os.path.join(d, "dsv4ctl"), os.X_OK):
            break
        d = os.path.dirname(d)
    p = subprocess.run([os.path.join(d, "dsv4ctl"), "--json", "verify", path],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                       universal_newlines=True)
    check("runtime error:" not in p.stderr and "Sanitizer" not in p.stderr,
          "sanitizer report from dsv4ctl: %r" % p.stderr[:500])
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None


def test_verify_compressed():
    """dsv4ctl verify recomputes the compressed digests: a dump verifies, a flipped ring byte or
    entry does not (exit 1, the layer not ok)."""
    env = Env()
    try:
        with Daemon(env.args(), name="source") as a:
            if not runs_branch(a):
                print("backend %s does not run the compressed branch" % h.BACKEND_NAME)
                return
            for x in history(np.random.default_rng(11), "a"):
                answer(a, x)
            body = dump(a, "a")
            meta, _ = h.st_decode(body)
            path = os.path.join(env.dir, "a.safetensors")
            with open(path, "wb") as f:
                f.write(body)
            rc, doc = ctl_verify(path)
            check_eq(rc, 0, "verify of a dump with compressed state: %r" % doc)
            layers = {x["layer"]: x for x in doc["layers"]}
            for l in (C4, C128):
                c = layers[l]["compressed"]
                check_eq(c["c_digest"], {"expected": meta["c_digest.%d" % l],
                                         "computed": meta["c_digest.%d" % l]}, "c_digest %d" % l)
                check_eq(c["ring_digest"]["computed"], meta["ring_digest.%d" % l], "ring %d" % l)
                check_eq(("i_digest" in c), l == C4, "i_digest only at ratio 4")
            check("compressed" not in layers[0], "no compressed state on layer 0")
            for name, what in (("layers.3.ring", "ring"), ("layers.2.c_records", "entry")):
                bad = os.path.join(env.dir, "bad.safetensors")
                with open(bad, "wb") as f:
                    f.write(reencode(body, edit={name: lambda r: flip(r, 40)}))
                rc, doc = ctl_verify(bad)
                check_eq(rc, 1, "verify of a flipped %s byte" % what)
                check_eq([x["layer"] for x in doc["layers"] if not x["ok"]],
                         [int(name.split(".")[1])], "the flipped layer is the one not ok")
    finally:
        env.close()


if __name__ == "__main__":
    h.main([test_restore_compressed_answers_as_never_interrupted,
            test_restore_compressed_refusals_change_nothing,
            test_snapshot_compressed_on_drain_and_restart, test_verify_compressed])
