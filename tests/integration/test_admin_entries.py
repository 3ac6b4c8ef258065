"""The entry inspector (SPEC §6, §8.7): GET /admin/v1/sequences/{seq}/entries/{j}?layer=L decodes
compressed entry j of a layer that runs the compressed branch.

Checked, on a backend that runs the branch: every field of the decoded record against the dump's
c_records row of that entry (bytes, scale codes, scales, dequantised values from the independent
model tests/reference/dsv4_ref.py, the §3.1 digest with j in the position's place), at ratio 4 the
index record against the dump's i_records row and its values against the model's MXFP4 decode
(tests/reference/dsv4_ref_compress.py), its digest against the dump's i_digest framing; the
entry's block and offset; the refusals (an entry before the first or at or past the next, a
sequence that has emitted none, an SWA-only layer, a daemon with compressed_branch = off, bad
paths and queries, unknown sequences), each a JSON error; and that none of these reads changes
the cache or the compressed state. dsv4ctl's entry command prints the route's document. On a
backend that does not run the branch, the route refuses every layer with 400 unsupported.
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
BS = 16
P0 = 5


def load_models():
    R = h.model().mod
    sys.path.insert(0, os.path.dirname(os.path.abspath(h.REF_PATH)))
    import dsv4_ref_compress as C  # noqa: E402
    return R, C


class Env:
    """Weights with the attention sinks and the compressors of layers 2 and 3."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="dsv4d-entries-")
        self.weights = os.path.join(self.dir, "w.safetensors")
        entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                    np.linspace(-2.0, 2.0, MODEL_HEADS).astype("<f4").tobytes()) for l in LAYERS]
        entries += [e for l in LAYERS for e in h.compressor_entries(l)]
        with open(self.weights, "wb") as f:
            f.write(h.st_encode(entries, {"format": "pt"}))

    def args(self, branch="on"):
        return ["--kv-blocks", "64", "--block-size", str(BS), "--layers", "0-3", "--heads",
                str(HEADS), "--threads", "1", "--weights", self.weights, "--compressed-branch",
                branch]

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def runs_branch(d):
    layers = d.admin_json("/admin/v1/cache").get("compressed", {}).get("layers", {})
    return str(C4) in layers and str(C128) in layers


def send(d, rng, layer, seg, ratio):
    outputs = "attn,lse,topk,digest" if ratio == 4 else "attn,lse,digest" if ratio else "q,digest"
    b = Batch.random(rng, layer, [seg], HEADS, outputs=outputs, ratio=ratio)
    r = d.forward_raw(b.body())
    check_eq(r.status, 200, "forward %r: %r" % (b, r.body[:300]))


def entry(d, seq, j, layer):
    return d.admin_json("/admin/v1/sequences/%s/entries/%d?layer=%d" % (seq, j, layer))


def frame_digest(j, rec):
    return xxhash.xxh3_64_hexdigest(int(j).to_bytes(8, "little", signed=True) + bytes(rec))


def state(d):
    """Everything an admin read must leave alone: per layer the SWA and compressed digests of every
    sequence and the pool digest, the used blocks of every pool, the sequences' next positions."""
    out = []
    for l in LAYERS:
        ck = d.admin_json("/admin/v1/checksums?layer=%d" % l)
        out.append((ck["pool"], ck["sequences"]))
    cache = d.admin_json("/admin/v1/cache")
    seqs = d.admin_json("/admin/v1/sequences")["sequences"]
    return (out, cache["blocks_used"], cache["compressed"]["pools"],
            [(s["seq"], s["next"]) for s in seqs])


def check_entry(doc, R, C, layer, ratio, j, rec, irec, what):
    check_eq((doc["seq"], doc["layer"], doc["ratio"], doc["entry"], doc["window"]),
             ("a", layer, ratio, j, [ratio * j, ratio * j + ratio - 1]), what + ": address")
    check_eq((doc["offset"], doc["slot"]), (j % BS, doc["block"] * BS + j % BS),
             what + ": offset and slot")
    check_eq(doc["fp8"], rec[:448].tolist(), what + ": fp8 bytes")
    check_eq(doc["scale_codes"], rec[576:583].tolist(), what + ": scale codes")
    check_eq(doc["scales"], [2.0 ** (int(c) - 127) for c in rec[576:583]], what + ": scales")
    check_eq(doc["rope_bf16"], rec[448:576].view("<u2").tolist(), what + ": RoPE bits")
    deq = R.dequantise_record(rec)
    check_eq(doc["nope"], [float(x) for x in deq[:448]], what + ": dequantised NoPE")
    check_eq(doc["rope"], [float(x) for x in deq[448:]], what + ": RoPE values")
    check_eq(doc["record_digest"], R.records_digest([j], [rec]), what + ": record digest (model)")
    check_eq(doc["record_digest"], frame_digest(j, rec), what + ": record digest (framing)")
    if ratio != 4:
        check("index" not in doc, what + ": no index record at ratio %d" % ratio)
        return
    ix = doc["index"]
    nib, codes = C.unpack_index_record(irec)
    check_eq(ix["e2m1"], nib.tolist(), what + ": e2m1 nibbles")
    packed = [ix["e2m1"][2 * i] | (ix["e2m1"][2 * i + 1] << 4) for i in range(64)]
    check_eq(packed, irec[:64].tolist(), what + ": the nibbles pack to the stored value bytes")
    check_eq(ix["scale_codes"], codes.tolist(), what + ": index scale codes")
    check_eq(ix["scales"], [2.0 ** (int(c) - 127) for c in codes], what + ": index scales")
    want = C.dequantise_index_record(irec)
    check_eq(ix["values"], [float(x) for x in want], what + ": index values (model)")
    check(any(v != 0 for v in ix["values"]), what + ": the index record holds values")
    check_eq(ix["record_digest"], frame_digest(j, irec), what + ": index record digest")


def test_entries_decode_what_the_dump_holds():
    env = Env()
    try:
        with Daemon(env.args(), name="branch") as d:
            if not runs_branch(d):
                for l in LAYERS:
                    e = expect_error(d.admin("/admin/v1/sequences/a/entries/0?layer=%d" % l), 400,
                                     "unsupported")
                    check("no compressed entries" in e["message"], "why: %r" % e["message"])
                print("backend %s does not run the compressed branch: every layer refused" %
                      h.BACKEND_NAME)
                return
            R, C = load_models()
            rng = np.random.default_rng(7)
            # p0 = 5: the first C4 entry is 1, the first C128 entry 0. C4 reaches position 154
            # (entries 1..38, three entry blocks of 16), C128 position 304 (entries 0 and 1).
            send(d, rng, 0, Seg("a", P0, 20, True), 0)
            send(d, rng, C4, Seg("a", P0, 100), 4)
            send(d, rng, C4, Seg("a", P0 + 100, 50), 4)
            send(d, rng, C128, Seg("a", P0, 300), 128)
            send(d, rng, C4, Seg("b", 0, 3, True), 4)  # no entry emitted yet
            before = state(d)
            r = d.admin("/admin/v1/dump?seq=a")
            check_eq(r.status, 200, "dump: %r" % r.body[:300])
            meta, t = h.st_decode(r.body)
            for l, ratio in ((C4, 4), (C128, 128)):
                nxt = int(meta["next.%d" % l])
                j0, j1 = P0 // ratio, nxt // ratio
                ent = h.st_array(t, "layers.%d.c_entries" % l, "I64", (j1 - j0,))
                recs = h.st_array(t, "layers.%d.c_records" % l, "U8", (j1 - j0, 584))
                irecs = h.st_array(t, "layers.%d.i_records" % l, "U8", (j1 - j0, 68)) \
                    if ratio == 4 else None
                check_eq(list(ent), list(range(j0, j1)), "layer %d entries" % l)
                blocks = {}
                for k, j in enumerate(ent):
                    j = int(j)
                    doc = entry(d, "a", j, l)
                    what = "entry %d at layer %d" % (j, l)
                    check_entry(doc, R, C, l, ratio, j, recs[k], irecs[k] if irecs is not None
                                else None, what)
                    blocks.setdefault(j // BS, set()).add(doc["block"])
                # One entry block per logical block, each its own.
                check(all(len(b) == 1 for b in blocks.values()), "layer %d: %r" % (l, blocks))
                ids = [min(b) for b in blocks.values()]
                check_eq(len(set(ids)), len(ids), "layer %d: distinct entry blocks" % l)
                if ratio == 4:
                    check_eq(len(ids), 3, "C4 entries 1..38 span three blocks of 16")
                # The dump's whole-list digests agree with the per-entry ones.
                x = xxhash.xxh3_64()
                for k, j in enumerate(ent):
                    x.update(int(j).to_bytes(8, "little", signed=True) + recs[k].tobytes())
                check_eq(x.hexdigest(), meta["c_digest.%d" % l], "layer %d c_digest" % l)
            check_eq(state(d), before, "entry reads change nothing")
    finally:
        env.close()


def test_entries_refusals():
    env = Env()
    try:
        with Daemon(env.args(), name="branch") as d, \
                Daemon(env.args(branch="off"), name="no-branch") as o:
            if not runs_branch(d):
                print("backend %s does not run the compressed branch" % h.BACKEND_NAME)
                expect_error(d.admin("/admin/v1/sequences/a/entries/0?layer=2"), 400, "unsupported")
                return
            rng = np.random.default_rng(8)
            send(d, rng, 0, Seg("a", P0, 20, True), 0)
            send(d, rng, C4, Seg("a", P0, 40), 4)     # next 45: C4 entries 1..10
            send(d, rng, C128, Seg("a", P0, 130), 128)  # next 135: C128 entry 0
            send(d, rng, C4, Seg("b", 0, 3, True), 4)  # none emitted at C4 yet
            before = state(d)
            for path, j0, j1 in (("a/entries/0?layer=2", 1, 11), ("a/entries/11?layer=2", 1, 11),
                                 ("a/entries/1?layer=3", 0, 1),
                                 ("a/entries/999999999999999999?layer=2", 1, 11),
                                 ("b/entries/0?layer=2", 0, 0), ("b/entries/0?layer=3", 0, 0)):
                e = expect_error(d.admin("/admin/v1/sequences/" + path), 404, "entry_not_emitted")
                check_eq((e.get("first_entry"), e.get("next_entry")), (j0, j1),
                         "the emitted range in the 404 of %s" % path)
                check("not emitted" in e["message"], "%s: %r" % (path, e["message"]))
            e = expect_error(d.admin("/admin/v1/sequences/b/entries/0?layer=2"), 404,
                             "entry_not_emitted")
            check("none is yet" in e["message"], "no entry yet: %r" % e["message"])
            for l in (0, 1):
                e = expect_error(d.admin("/admin/v1/sequences/a/entries/0?layer=%d" % l), 400,
                                 "unsupported")
                check_eq((e.get("layer"), e.get("ratio")), (l, 0), "the layer and its ratio")
                check("compress ratio 0" in e["message"] and "/tokens/" in e["message"],
                      "why layer %d has no entries: %r" % (l, e["message"]))
            cases = [
                ("/admin/v1/sequences/a/entries/1", 400, "bad_request"),  # no layer
                ("/admin/v1/sequences/a/entries/x?layer=2", 400, "bad_request"),
                ("/admin/v1/sequences/a/entries/-1?layer=2", 400, "bad_request"),
                ("/admin/v1/sequences/a/entries/?layer=2", 400, "bad_request"),
                ("/admin/v1/sequences/a/entries/1?layer=9", 400, "unknown_layer"),
                ("/admin/v1/sequences/a/entries/1?layer=2&seq=a", 400, "bad_request"),
                ("/admin/v1/sequences/a/entry/1?layer=2", 404, "not_found"),
                ("/admin/v1/sequences/nope/entries/1?layer=2", 404, "unknown_sequence"),
            ]
            for path, status, code in cases:
                e = expect_error(d.admin(path), status, code)
                if code == "unknown_sequence":
                    check_eq(e.get("instance"), d.instance, "instance in the 404 of %s" % path)
            e = expect_error(d.admin("/admin/v1/sequences/a/entries/x?layer=2"), 400,
                             "bad_request")
            check("entry" in e["message"], "the bad entry is named: %r" % e["message"])
            check_eq(state(d), before, "refused entry reads change nothing")

            # A daemon that serves the compressed layers' SWA part only has no entries to show.
            send(o, rng, C4, Seg("a", 0, 8, True), 0)
            e = expect_error(o.admin("/admin/v1/sequences/a/entries/0?layer=2"), 400, "unsupported")
            check_eq(e.get("ratio"), 4, "the model's ratio in the refusal")
            check("SWA part only" in e["message"], "why: %r" % e["message"])
    finally:
        env.close()


def ctl_path():
    """dsv4ctl beside the daemon or above it, as test_dsv4ctl finds it."""
    if os.environ.get("DSV4CTL_BIN"):
        return os.environ["DSV4CTL_BIN"]
    d = os.path.dirname(h.DAEMON)
    for _ in range(3):
        p = os.path.join(d, "dsv4ctl")
        if os.access(p, os.X_OK):
            return p
        d = os.path.dirname(d)
    raise h.TestFailure("no dsv4ctl beside %s or above it (set DSV4CTL_BIN)" % h.DAEMON)


def ctl(d, *args):
    d.admin_conn().close()
    cmd = [ctl_path(), "--admin", "http://127.0.0.1:%d" % d.admin_port] + list(args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4CTL_")}
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, timeout=60, universal_newlines=True)


def test_dsv4ctl_entry():
    env = Env()
    try:
        with Daemon(env.args(), name="branch") as d:
            if not runs_branch(d):
                p = ctl(d, "entry", "a", "0", "--layer", "2")
                check_eq(p.returncode, 1, "entry on a backend without the branch: %r" % p.stderr)
                print("backend %s does not run the compressed branch" % h.BACKEND_NAME)
                return
            rng = np.random.default_rng(9)
            send(d, rng, 0, Seg("a", P0, 20, True), 0)
            send(d, rng, C4, Seg("a", P0, 40), 4)
            send(d, rng, C128, Seg("a", P0, 130), 128)
            for layer, j in ((C4, 3), (C128, 0)):
                p = ctl(d, "--json", "entry", "a", str(j), "--layer", str(layer))
                check_eq(p.returncode, 0, "dsv4ctl --json entry: %r" % p.stderr)
                route = entry(d, "a", j, layer)
                check_eq(json.loads(p.stdout), route, "dsv4ctl --json entry vs the route")
                p = ctl(d, "entry", "a", str(j), "--layer", str(layer))
                check_eq(p.returncode, 0, "dsv4ctl entry: %r" % p.stderr)
                head = "seq a  layer %d  entry %d  ratio %d  positions %d-%d  block %d" % (
                    layer, j, route["ratio"], route["window"][0], route["window"][1],
                    route["block"])
                check(p.stdout.startswith(head), "entry view head: %r" % p.stdout[:200])
                check("record_digest    %s\n" % route["record_digest"] in p.stdout,
                      "entry view digest: %r" % p.stdout[:300])
                check(("index record (MXFP4)" in p.stdout) == (layer == C4),
                      "the index record shown at ratio 4 only")
                if layer == C4:
                    check("record_digest    %s\n" % route["index"]["record_digest"] in p.stdout,
                          "index digest in the view")
            p = ctl(d, "entry", "a", "99", "--layer", "2")
            check_eq(p.returncode, 1, "entry not emitted: %r" % p.stderr)
            check("404 entry_not_emitted" in p.stderr, "the error shown: %r" % p.stderr)
    finally:
        env.close()


if __name__ == "__main__":
    h.main([test_entries_decode_what_the_dump_holds, test_entries_refusals, test_dsv4ctl_entry])
