"""Sequences that outlive the process (SPEC §6): PUT /admin/v1/sequences/{seq} recreates a sequence
from a dump, and with snapshot_dir a drain writes every live sequence to disk for the next start.

A restored sequence has the dump's digests at every layer and answers the next batch with exactly the
bytes a daemon that was never interrupted answers (q_out, attn, lse and cache_digest; only the slots
may differ, its blocks being fresh), replays included. Every refusal (an existing name, a digest
that does not match, a cut body, a tensor it does not know, another geometry, a full pool, a block
size that cannot hold the records) answers its JSON error and changes nothing. A snapshot restores
the same way at start-up; a torn or corrupt file is logged and skipped.

Backend-agnostic: every daemon runs on DSV4_TEST_BACKEND when set (the GPU suite sets cuda).
"""

import json
import os
import shutil
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8
MODEL_HEADS = 64
LAYERS = (0, 1, 2, 3)
P0 = 5



def write_weights(path):
    """Attention sinks for the four layers, so that the next batch can ask for attn and lse."""
    entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                (np.linspace(-2.0, 2.0, MODEL_HEADS) + 0.25 * l).astype("<f4").tobytes())
               for l in LAYERS]
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))


class Env:
    """A temporary directory with the weights file, and the daemons' arguments."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="dsv4d-restore-")
        self.weights = os.path.join(self.dir, "sinks.safetensors")
        write_weights(self.weights)

    def args(self, *extra, kv_blocks=64, block_size=64):
        # These daemons serve layers 2 and 3 without the compressed branch, so their dumps are
        # SWA-only; test_restore_compressed covers dumps that carry the branch's state.
        return ["--kv-blocks", str(kv_blocks), "--block-size", str(block_size), "--layers", "0-3",
                "--heads", str(HEADS), "--threads", "1", "--weights", self.weights,
                "--compressed-branch", "off"] + list(extra)

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def outputs(layer):
    """Attention where this daemon serves it (layers of compress ratio 0: 0 and 1; the compressed
    branch of ratio >= 2 layers, SPEC §8, is not served yet), q and the digest everywhere."""
    return "q,attn,lse,digest" if layer < 2 else "q,digest"


def fwd(rng, layer, seg):
    return Batch.random(rng, layer, [seg], HEADS, outputs(layer))


def history(rng, name, p0=P0):
    """Batches that leave a sequence with released blocks (its windows start at 128 at bs 64),
    layers at different positions (layer 3 lags and holds the release back) and a last segment
    per layer to replay."""
    b = [fwd(rng, 0, Seg(name, p0, 300, True)), fwd(rng, 1, Seg(name, p0, 200)),
         fwd(rng, 1, Seg(name, p0 + 200, 100)), fwd(rng, 2, Seg(name, p0, 300)),
         fwd(rng, 3, Seg(name, p0, 250)), fwd(rng, 3, Seg(name, p0 + 250, 20))]
    for k in range(3):
        for layer in (0, 1, 2):
            b.append(fwd(rng, layer, Seg(name, p0 + 300 + k, 1)))
    return b


def feed(d, batches):
    for b in batches:
        d.forward(b)


def last_per_layer(batches):
    out = {}
    for b in batches:
        out[b.layer] = b
    return [out[l] for l in sorted(out)]


def next_batches(rng, d, name):
    """One new batch per layer, from where the sequence is at that layer on daemon d."""
    nxt = d.seq(name)["next"]
    return [fwd(rng, l, Seg(name, nxt[str(l)], 3 if l != 3 else 2)) for l in LAYERS]


def answer(d, b):
    """A forward's answer without the slots: q_out, attn and lse bytes and the metadata."""
    r = d.forward_raw(b.body())
    check_eq(r.status, 200, "forward %r on %s: %r" % (b, d.name, r.body[:300]))
    meta, t = h.st_decode(r.body)
    want = {"q_out", "slots"} | ({"attn", "lse"} if b.layer < 2 else set())
    check_eq(set(t), want, "forward answer tensors")
    return (meta, {k: bytes(v[2]) for k, v in t.items() if k != "slots"})


def same_answers(d1, others, batches, what):
    """Each batch sent to d1 and then to every daemon of others: the same answers, slots aside."""
    others = others if isinstance(others, list) else [others]
    for b in batches:
        a1 = answer(d1, b)
        for d2 in others:
            a2 = answer(d2, b)
            check_eq(a2[0], a1[0], "%s: metadata of %r on %s" % (what, b, d2.name))
            for k in a1[1]:
                check(a1[1][k] == a2[1][k], "%s: %s of %r differs between %s and %s" %
                      (what, k, b, d1.name, d2.name))


def dump(d, name, query=""):
    r = d.admin("/admin/v1/dump?seq=%s%s" % (name, query))
    check_eq(r.status, 200, "dump of %s: %r" % (name, r.body[:300]))
    return r.body


def put(d, name, body, query="", token=None):
    hd = {"Authorization": "Bearer " + token} if token else {}
    return d.request("PUT", "/admin/v1/sequences/%s%s" % (name, query), body=body, headers=hd,
                     admin=True)


def digests(d, name):
    """{layer: digest} of a sequence from /admin/v1/checksums."""
    out = {}
    for l in LAYERS:
        j = d.admin_json("/admin/v1/checksums?layer=%d&seq=%s" % (l, name))
        out[l] = j["sequences"][name]["digest"]
    return out


def dump_digests(body):
    meta, _ = h.st_decode(body)
    return {l: meta["digest.%d" % l] for l in LAYERS}


def state(d):
    """Everything a refused restore must leave as it was: the sequences, their digests, the pool."""
    seqs = d.admin_json("/admin/v1/sequences")["sequences"]
    for s in seqs:
        s.pop("idle_ms", None)
    return (seqs, {s["seq"]: digests(d, s["seq"]) for s in seqs}, d.used_blocks())


def reencode(body, meta_edit=None, extra=()):
    """A dump rewritten with edited metadata and extra tensors (its own tensors kept in order)."""
    meta, t = h.st_decode(body)
    if meta_edit:
        meta_edit(meta)
    tensors = [(k, v[0], v[1], bytes(v[2])) for k, v in t.items()] + list(extra)
    return h.st_encode(tensors, meta)


def records_offset(body, layer):
    (n,) = struct.unpack_from("<Q", body, 0)
    hdr = json.loads(body[8:8 + n])
    return 8 + n + hdr["layers.%d.records" % layer]["data_offsets"][0]


# ---------------------------------------------------------------------------------------------------


def test_restore_answers_as_never_interrupted():
    env = Env()
    try:
        rng = np.random.default_rng(1)
        hist = history(rng, "a")
        with Daemon(env.args(), name="source") as a, Daemon(env.args(), name="restored") as b, \
                Daemon(env.args(block_size=16), name="restored-bs16") as c, \
                Daemon(env.args(block_size=16), name="never-interrupted-bs16") as r16:
            feed(a, hist)
            feed(r16, hist)
            body = dump(a, "a")
            want = dump_digests(body)
            check_eq(digests(a, "a"), want, "the dump's digests are the source's")
            for d in (b, c):
                r = put(d, "a", body)
                check_eq(r.status, 201, "restore on %s: %r" % (d.name, r.body[:300]))
                j = r.json()
                check_eq(j["replaced"], False, "replaced")
                check_eq(j["digests"], {str(l): want[l] for l in LAYERS}, "restore answer digests")
                check_eq(digests(d, "a"), want, "%s: checksums after the restore" % d.name)
                sa, sd = a.seq("a"), d.seq("a")
                check_eq((sd["p0"], sd["next"]), (sa["p0"], sa["next"]), "p0 and next")
            check_eq(len(b.seq("a")["blocks"]), len(a.seq("a")["blocks"]), "blocks held at bs 64")
            # The last segment of each layer replays on the restored daemons as on the source.
            for d in (b, c):
                for lb in last_per_layer(hist):
                    r = answer(d, lb)
                    check_eq(r[0].get("replayed"), "true", "%s: replay of %r" % (d.name, lb))
            same_answers(a, [b, c], last_per_layer(hist), "replays")
            # The next batches: byte for byte what the source answers, and the same digests after.
            same_answers(a, [b, c, r16], next_batches(np.random.default_rng(2), a, "a"),
                         "next batch")
            check_eq(digests(b, "a"), digests(a, "a"), "digests after the next batches (bs 64)")
            # The stored range follows the block size (SPEC §3.1): a bs-16 daemon releases 16
            # positions at a time, so the one to compare with is a bs-16 daemon never interrupted.
            check_eq(digests(c, "a"), digests(r16, "a"), "digests after the next batches (bs 16)")
    finally:
        env.close()


def test_restore_refusals_change_nothing():
    env = Env()
    try:
        rng = np.random.default_rng(3)
        with Daemon(env.args(), name="source") as a, Daemon(env.args(), name="target") as b:
            feed(a, history(rng, "a"))
            feed(a, history(rng, "b", p0=0))
            da, db = dump(a, "a"), dump(a, "b")
            check_eq(put(b, "a", da).status, 201, "first restore")
            feed(b, [Batch.random(rng, 0, [Seg("other", 0, 10, True)], HEADS)])
            s0 = state(b)

            def refused(body, status, code, query="", name="a"):
                e = expect_error(put(b, name, body, query), status, code)
                check_eq(state(b), s0, "state after a refused restore (%s)" % code)
                return e

            e = refused(da, 409, "sequence_exists")
            check_eq(e.get("seq"), "a", "seq in sequence_exists")
            bad = bytearray(da)
            bad[records_offset(da, 2) + 584 * 3 + 10] ^= 0x01
            e = refused(bytes(bad), 400, "digest_mismatch", "?replace=1")
            check_eq(e.get("layer"), 2, "layer of the digest mismatch")
            check_eq(e.get("expected"), dump_digests(da)[2], "expected digest")
            check(e.get("computed") != e.get("expected"), "computed digest differs")

            def other_digest(m):
                m["digest.1"] = "%016x" % (int(m["digest.1"], 16) ^ 1)
            e = refused(reencode(da, other_digest), 400, "digest_mismatch", "?replace=1")
            check_eq(e.get("layer"), 1, "layer of the edited digest")
            for cut in (len(da) // 2, len(da) - 1, 7):
                refused(da[:cut], 400, "bad_request", "?replace=1")
            extra = [("layers.2.c_records", "U8", [1, 584], bytes(584))]
            e = refused(reencode(da, extra=extra), 400, "bad_request", "?replace=1")
            check("c_records" in e["message"], "the unknown tensor is named: %r" % e["message"])
            e = refused(dump(a, "a", "&layers=0-1"), 409, "geometry_mismatch", "?replace=1")
            check_eq((e.get("field"), e.get("dump"), e.get("daemon")), ("layers", "0-1", "0-3"),
                     "layers mismatch details")
            for key, val in (("heads", "4"), ("head_offset", "8"), ("model", "0" * 16),
                             ("layout", "fp8_other"), ("record_bytes", "656")):
                e = refused(reencode(da, lambda m: m.__setitem__(key, val)), 409,
                            "geometry_mismatch", "?replace=1")
                check_eq((e.get("field"), e.get("dump")), (key, val), "%s mismatch" % key)
            refused(reencode(da, lambda m: m.pop("next.2")), 400, "bad_request", "?replace=1")
            refused(reencode(da, lambda m: m.__setitem__("next.2", "999")), 400, "bad_request",
                    "?replace=1")
            refused(b"", 400, "bad_request", "?replace=1")
            refused(da, 400, "bad_request", "?replace=2")
            refused(da, 400, "bad_request", name=".a")

            # replace=1: the other sequence's state under this name, the old blocks given back.
            r = put(b, "a", db, "?replace=1")
            check_eq(r.status, 200, "replace: %r" % r.body[:300])
            check_eq(r.json()["replaced"], True, "replaced")
            check_eq(digests(b, "a"), dump_digests(db), "digests after replace")
            check_eq(b.seq("a")["next"], a.seq("b")["next"], "next after replace")
            check_eq(b.used_blocks(), len(a.seq("b")["blocks"]) + len(b.seq("other")["blocks"]),
                     "blocks after replace")

            r = b.request("DELETE", "/admin/v1/sequences/a", admin=True)
            check_eq((r.status, r.headers.get("dsv4d-existed")), (204, "1"), "admin DELETE")
            r = b.request("DELETE", "/admin/v1/sequences/a", admin=True)
            check_eq((r.status, r.headers.get("dsv4d-existed")), (204, "0"), "second DELETE")
            check(b.seq("a") is None, "deleted")
    finally:
        env.close()


def test_restore_room_and_block_size():
    env = Env()
    try:
        rng = np.random.default_rng(4)
        with Daemon(env.args(), name="source") as a, \
                Daemon(env.args(kv_blocks=4), name="small") as s, \
                Daemon(env.args(block_size=256), name="bs256") as w:
            feed(a, history(rng, "a"))
            da = dump(a, "a")
            need = len(a.seq("a")["blocks"])
            check_eq(need, 3, "blocks of the sequence at bs 64")
            s.forward(Batch.random(rng, 0, [Seg("x", 0, 100, True)], HEADS))
            s0 = state(s)
            e = expect_error(put(s, "a", da), 503, "kv_pool_exhausted")
            check_eq((e.get("needed"), e.get("free")), (3, 2), "needed and free")
            check_eq(state(s), s0, "state after kv_pool_exhausted")
            # The records start at 128: a 256-token block would hold 0..127, which the dump lacks.
            w0 = state(w)
            e = expect_error(put(w, "a", da), 409, "geometry_mismatch")
            check_eq(e.get("field"), "block_size", "block size refusal field")
            check("128" in e["message"], "the message names the first position: %r" % e["message"])
            check_eq(state(w), w0, "state after the block size refusal")
            # A sequence whose records start at p0 fits any block size.
            feed(a, [Batch.random(rng, l, [Seg("short", 7, 40, l == 0)], HEADS) for l in LAYERS])
            ds = dump(a, "short")
            check_eq(put(w, "short", ds).status, 201, "restore at bs 256")
            check_eq(digests(w, "short"), dump_digests(ds), "digests at bs 256")
    finally:
        env.close()


def test_restore_needs_the_admin_token():
    env = Env()
    try:
        tok = "s3cret-restore"
        path = h.write_token_file(env.dir, tok)
        rng = np.random.default_rng(5)
        with Daemon(env.args("--admin-token-file", path), name="guarded") as d:
            feed(d, history(rng, "a")[:1])
            body = d.admin("/admin/v1/dump?seq=a", token=tok).body
            expect_error(put(d, "b", body), 401, "unauthorized")
            r = d.request("DELETE", "/admin/v1/sequences/a", admin=True)
            expect_error(r, 401, "unauthorized")
            r = put(d, "b", body, token=tok)
            check_eq(r.status, 201, "restore with the token: %r" % r.body[:300])
            check(d.seq("b") is not None, "restored under a new name")
    finally:
        env.close()


# ---- snapshots --------------------------------------------------------------------------------------


def log_msgs(d, msg, count=1):
    """The daemon's log records of this msg, once count of them have reached the harness (or 10 s
    have passed): a line comes through a pipe and a reader thread, a little after it is written."""
    d.wait_lines(lambda ln: '"%s"' % msg in ln, count)
    return [j for j in h.log_records("\n".join(d.lines)) if j.get("msg") == msg]


def test_snapshot_on_drain_and_restart():
    env = Env()
    snap = os.path.join(env.dir, "snap")
    os.mkdir(snap)
    try:
        rng = np.random.default_rng(6)
        ha, hb = history(rng, "a"), history(rng, "b", p0=0)
        with Daemon(env.args(), name="reference") as ref:
            feed(ref, ha + hb)
            first = Daemon(env.args("--snapshot-dir", snap), name="first").start()
            feed(first, ha + hb)
            want = {n: digests(first, n) for n in ("a", "b")}
            seqs = {n: first.seq(n) for n in ("a", "b")}
            check_eq(first.stop(), 0, "exit status after SIGTERM with snapshot_dir")
            first.check_log_clean()
            check_eq(len(log_msgs(first, "snapshot written")), 1, "snapshot written log line")
            with open(os.path.join(snap, "manifest.json")) as f:
                man = json.load(f)
            check_eq(sorted(r["seq"] for r in man["sequences"]), ["a", "b"], "manifest rows")
            check(os.path.exists(os.path.join(snap, "a.safetensors")), "a's file")
            check(not [n for n in os.listdir(snap) if n.endswith(".tmp")], "no temporary left")

            with Daemon(env.args("--snapshot-dir", snap), name="second") as second:
                h.wait_ready(second)
                for n in ("a", "b"):
                    check_eq(digests(second, n), want[n], "digests of %s after restart" % n)
                    got = second.seq(n)
                    check_eq((got["p0"], got["next"]), (seqs[n]["p0"], seqs[n]["next"]),
                             "p0 and next of %s" % n)
                rl = log_msgs(second, "snapshot restored")
                check(rl and rl[0]["restored"] == 2 and rl[0]["skipped"] == 0, "log %r" % rl)
                check(not os.path.exists(os.path.join(snap, "manifest.json")),
                      "the manifest is consumed")
                check(not os.path.exists(os.path.join(snap, "a.safetensors")),
                      "restored files are removed")
                same_answers(ref, second, last_per_layer(ha), "replays after restart")
                nb = next_batches(np.random.default_rng(7), ref, "a") + \
                    next_batches(np.random.default_rng(8), ref, "b")
                same_answers(ref, second, nb, "next batches after restart")
                for n in ("a", "b"):
                    check_eq(digests(second, n), digests(ref, n), "digests of %s after" % n)
    finally:
        env.close()


def test_snapshot_skips_torn_and_corrupt_files():
    env = Env()
    snap = os.path.join(env.dir, "snap")
    os.mkdir(snap)
    try:
        rng = np.random.default_rng(9)
        first = Daemon(env.args("--snapshot-dir", snap), name="first").start()
        for n in ("a", "b", "c"):
            feed(first, history(rng, n))
        want_a = digests(first, "a")
        check_eq(first.stop(), 0, "exit status after SIGTERM")
        first.check_log_clean()
        # b: one byte of a record flipped; c: cut in half, as a torn write would leave it.
        pb, pc = os.path.join(snap, "b.safetensors"), os.path.join(snap, "c.safetensors")
        with open(pb, "r+b") as f:
            body = f.read()
            f.seek(records_offset(body, 1) + 100)
            f.write(bytes([body[records_offset(body, 1) + 100] ^ 0x40]))
        with open(pc, "r+b") as f:
            f.truncate(os.path.getsize(pc) // 2)
        with Daemon(env.args("--snapshot-dir", snap), name="second") as second:
            h.wait_ready(second)
            check_eq(digests(second, "a"), want_a, "a restored whole")
            check(second.seq("b") is None and second.seq("c") is None, "b and c not restored")
            skipped = {j["file"]: j for j in log_msgs(second, "snapshot file skipped", 2)}
            check_eq(sorted(skipped), ["b.safetensors", "c.safetensors"], "skipped files logged")
            check("torn or corrupt" in skipped["c.safetensors"]["why"], "why %r" % skipped)
            check_eq(second.used_blocks(), len(second.seq("a")["blocks"]), "no block left behind")
            # A manifest that is not one: nothing restored, set aside, the daemon still starts.
        with open(os.path.join(snap, "manifest.json"), "w") as f:
            f.write("{not json")
        with Daemon(env.args("--snapshot-dir", snap), name="third") as third:
            h.wait_ready(third)
            check(third.seq("a") is None, "nothing restored from a bad manifest")
            check(os.path.exists(os.path.join(snap, "manifest.json.bad")), "bad manifest kept")
            check_eq(len(log_msgs(third, "snapshot manifest unusable; nothing restored")), 1,
                     "bad manifest logged")
    finally:
        env.close()


def test_snapshot_dir_must_be_writable():
    env = Env()
    try:
        d = Daemon(env.args("--snapshot-dir", os.path.join(env.dir, "missing")), name="bad")
        try:
            d.start()
            raise h.TestFailure("a daemon started with a snapshot_dir that does not exist")
        except h.TestFailure as e:
            check("exited with status 2" in str(e), "start refused with exit 2: %s" % e)
        check(any("snapshot_dir" in ln and "bad configuration" in ln for ln in d.lines),
              "the log names snapshot_dir: %s" % d.log_tail())
        d.kill()
    finally:
        env.close()


if __name__ == "__main__":
    h.main([test_restore_answers_as_never_interrupted, test_restore_refusals_change_nothing,
            test_restore_room_and_block_size, test_restore_needs_the_admin_token,
            test_snapshot_on_drain_and_restart, test_snapshot_skips_torn_and_corrupt_files,
            test_snapshot_dir_must_be_writable])
