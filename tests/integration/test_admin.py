"""The admin plane (SPEC §6 admin routes, README "Admin API"): every route against the independent
model, every error, the token, the audit log, one dump at a time, and identical logical checksums
from two daemons fed the same batches."""

import os
import shutil
import socket
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8
BS = 64
KV_BLOCKS = 64
LAYERS = (0, 1, 2, 3)


class Expected:
    """What the cache must hold, from the model: records by (layer, position) and, per layer, the
    cache buffer rebuilt from the slots the daemon answered (fresh blocks are zero-filled)."""

    def __init__(self, kv_blocks=KV_BLOCKS, bs=BS):
        self.bs = bs
        self.stride = h.model().mod.block_stride(bs)
        self.records = {}  # (seq, layer, pos) -> record bytes
        self.cache = {layer: np.zeros(kv_blocks * self.stride, np.uint8) for layer in LAYERS}

    def add(self, batch, res):
        recs = h.model().records(batch)
        h.model().mod.write_records(self.cache[batch.layer], recs, res.slots, self.bs)
        i = 0
        for s in batch.segs:
            for p in range(s.start, s.start + s.len):
                self.records[(s.seq, batch.layer, p)] = recs[i]
                i += 1

    def digest(self, seq, layer, first, last):
        pos = list(range(first, last + 1))
        return h.model().mod.records_digest(pos, [self.records[(seq, layer, p)] for p in pos])


def send(d, exp, rng, layer, segs):
    b = Batch.random(rng, layer, segs, HEADS)
    r = d.forward(b)
    exp.add(b, r)
    return r


def prefill(d, exp, rng, seq, n, start=0):
    for layer in LAYERS:
        send(d, exp, rng, layer, [Seg(seq, start, n, new=(layer == LAYERS[0]))])


def test_read_routes_against_model():
    with Daemon(h.SMALL, name="a") as d:
        rng = np.random.default_rng(11)
        exp = Expected()
        prefill(d, exp, rng, "a", 100)
        prefill(d, exp, rng, "b", 3, start=7)

        c = d.admin_json("/admin/v1/cache")
        for k, v in (("version", "0.1.0"), ("backend", h.BACKEND_NAME), ("layout", "fp8_ds_mla"),
                     ("fp8", "F8_E4M3FN"), ("scale", "UE8M0"), ("block_size", BS), ("window", 128),
                     ("record_bytes", 584), ("stride", 37440), ("heads", HEADS),
                     ("served_layers", list(LAYERS)), ("kv_blocks", KV_BLOCKS), ("blocks_used", 3),
                     ("blocks_free", KV_BLOCKS - 3), ("sequences", 2),
                     ("cache_bytes", 4 * KV_BLOCKS * 37440)):
            check_eq(c.get(k), v, "/admin/v1/cache %s" % k)
        check_eq(c["usage_ratio"], 3 / KV_BLOCKS, "usage_ratio")
        used = sorted(int(b) for b in d.admin_json("/admin/v1/checksums?layer=0")["blocks"])
        check_eq(len(used), 3, "used blocks listed by /checksums")
        for layer in LAYERS:
            want = h.model().mod.pool_digest(layer, exp.cache[layer], used, BS)
            check_eq(c["pool_digests"][str(layer)], want, "pool digest of layer %d" % layer)

        lst = d.admin_json("/admin/v1/sequences")
        check_eq(lst["count"], 2, "sequence count")
        check_eq([s["seq"] for s in lst["sequences"]], ["a", "b"], "sorted by name")
        a = lst["sequences"][0]
        check_eq((a["p0"], a["blocks"], a["next"]), (0, 2, {str(x): 100 for x in LAYERS}),
                 "sequence a in the list")
        check(isinstance(a["idle_ms"], int) and a["idle_ms"] >= 0, "idle_ms %r" % a["idle_ms"])

        s = d.admin_json("/admin/v1/sequences/b")
        check_eq(s["p0"], 7, "p0 of b")
        check_eq(s["next"], {str(x): 10 for x in LAYERS}, "next of b")
        check_eq(s["last_start"], {str(x): 7 for x in LAYERS}, "last_start of b")
        check_eq(s["stored"], {str(x): [7, 9] for x in LAYERS}, "stored of b")
        check_eq(s["release_held_by"], None, "release_held_by when all layers agree")
        check_eq(len(s["block_table"]), 1, "block table of b")
        bt = s["block_table"][0]
        check_eq((bt["logical"], bt["first"], bt["last"]), (0, 7, 63), "block table row of b")

        # Layer 0 moves ahead of the others: layers 1..3 hold the release back.
        send(d, exp, rng, 0, [Seg("a", 100, 200)])
        s = d.admin_json("/admin/v1/sequences/a")
        check_eq(s["release_held_by"], None, "s_0 - 127 < p0: every layer still at p0")
        send(d, exp, rng, 0, [Seg("a", 300, 1)])
        s = d.admin_json("/admin/v1/sequences/a")
        check_eq(s["release_held_by"], 1, "release_held_by names the lowest lagging layer")
        check_eq(s["stored"]["0"], [0, 300], "stored at layer 0")
        check_eq(s["stored"]["1"], [0, 99], "stored at layer 1")

        # One record decoded, at a plain-RoPE layer and a YaRN layer.
        for layer, pos in ((1, 5), (3, 99), (0, 250)):
            t = d.admin_json("/admin/v1/sequences/a/tokens/%d?layer=%d" % (pos, layer))
            rec = exp.records[("a", layer, pos)]
            check_eq(t["fp8"], rec[:448].tolist(), "fp8 bytes at %d/%d" % (layer, pos))
            check_eq(t["scale_codes"], rec[576:583].tolist(), "scale codes")
            check_eq(t["scales"], [2.0 ** (int(c) - 127) for c in rec[576:583]], "scales")
            rope = rec[448:576].view("<u2")
            check_eq(t["rope_bf16"], rope.tolist(), "rope bf16 bits")
            deq = h.model().mod.dequantise_record(rec)
            check_eq(t["nope"], [float(x) for x in deq[:448]], "dequantised NoPE")
            check_eq(t["rope"], [float(x) for x in deq[448:]], "RoPE values")
            check_eq(t["record_digest"], h.model().mod.records_digest([pos], [rec]),
                     "record digest")
            check_eq((t["position"], t["layer"], t["offset"], t["slot"] % BS, t["block"]),
                     (pos, layer, pos % BS, pos % BS, t["slot"] // BS), "record address")

        # Checksums: per sequence (logical, by position) and per block, against the model.
        for layer in LAYERS:
            ck = d.admin_json("/admin/v1/checksums?layer=%d" % layer)
            last = 300 if layer == 0 else 99
            check_eq(ck["sequences"]["a"], {"digest": exp.digest("a", layer, 0, last), "first": 0,
                                            "last": last, "records": last + 1},
                     "sequence digest of a at %d" % layer)
            check_eq(ck["sequences"]["b"]["digest"], exp.digest("b", layer, 7, 9), "digest of b")
            for blk, dig in ck["blocks"].items():
                check_eq(dig, h.model().mod.block_digest(exp.cache[layer], int(blk), BS),
                         "block %s digest at layer %d" % (blk, layer))
            one = d.admin_json("/admin/v1/checksums?layer=%d&seq=b" % layer)
            check_eq(list(one["sequences"]), ["b"], "checksums with seq: one sequence")
            check_eq(one["pool"], ck["pool"], "pool digest with and without seq")
            check_eq(len(one["blocks"]), 1, "checksums with seq: that sequence's blocks")

        cfg = d.admin_json("/admin/v1/config")
        check_eq(cfg["options"]["kv_blocks"], {"value": KV_BLOCKS, "source": "cli"}, "kv_blocks")
        check_eq(cfg["options"]["block_size"]["source"], "default", "block_size source")

        # The forward answer's cache_digest has the same definition: a batch that wrote everything
        # its sequence stores digests to the sequence's digest.
        r = send(d, exp, rng, 2, [Seg("c", 0, 5, new=True)])
        ck = d.admin_json("/admin/v1/checksums?layer=2&seq=c")["sequences"]["c"]
        check_eq(ck["digest"], r.cache_digest, "sequence digest = the batch's cache_digest")


def test_errors():
    args = h.SMALL + ["--sequence-idle-timeout-s", "1"]
    with Daemon(args) as d:
        rng = np.random.default_rng(12)
        exp = Expected()
        prefill(d, exp, rng, "a", 10)
        before = d.admin_json("/admin/v1/checksums?layer=0")
        cases = [
            ("/admin/v1/sequences/bad%20name", 400, "bad_request"),
            ("/admin/v1/sequences/.dot", 400, "bad_request"),
            ("/admin/v1/sequences/nope", 404, "unknown_sequence"),
            ("/admin/v1/sequences/a/tokens/1", 400, "bad_request"),  # no layer
            ("/admin/v1/sequences/a/tokens/x?layer=0", 400, "bad_request"),
            ("/admin/v1/sequences/a/tokens/-1?layer=0", 400, "bad_request"),
            ("/admin/v1/sequences/a/tokens/1?layer=9", 400, "unknown_layer"),
            ("/admin/v1/sequences/a/tokens/1?layer=zero", 400, "bad_request"),
            ("/admin/v1/sequences/a/tokens/10?layer=0", 404, "position_not_written"),
            ("/admin/v1/sequences/a/tokens/1?layer=0&layer=1", 400, "bad_request"),
            ("/admin/v1/sequences/a/other/1", 404, "not_found"),
            ("/admin/v1/sequences/nope/tokens/1?layer=0", 404, "unknown_sequence"),
            ("/admin/v1/checksums", 400, "bad_request"),
            ("/admin/v1/checksums?layer=4", 400, "unknown_layer"),
            ("/admin/v1/checksums?layer=0&seq=nope", 404, "unknown_sequence"),
            ("/admin/v1/checksums?layer=0&seq=b%20c", 400, "bad_request"),
            ("/admin/v1/checksums?layer=0&color=red", 400, "bad_request"),
            ("/admin/v1/cache?x=1", 400, "bad_request"),
            ("/admin/v1/dump", 400, "bad_request"),
            ("/admin/v1/dump?seq=a&layers=3-1", 400, "bad_request"),
            ("/admin/v1/dump?seq=a&layers=2-5", 400, "unknown_layer"),
            ("/admin/v1/dump?seq=a&layers=1-", 400, "bad_request"),
            ("/admin/v1/dump?seq=a&layer=1", 400, "bad_request"),
            ("/admin/v1/dump?seq=nope", 404, "unknown_sequence"),
            ("/admin/v1/nothing", 404, "not_found"),
        ]
        for path, status, code in cases:
            e = expect_error(d.admin(path), status, code)
            if code == "unknown_sequence":
                check_eq(e.get("instance"), d.instance, "instance in the 404 of %s" % path)
        e = expect_error(d.admin("/admin/v1/checksums?layer=0&color=red"), 400, "bad_request")
        check("color" in e["message"], "the unknown key is named: %r" % e["message"])
        expect_error(d.admin("/admin/v1/cache", method="POST"), 405, "method_not_allowed")
        # The admin routes are not on the data listener.
        check_eq(d.get("/admin/v1/cache").status, 404, "admin route on the data port")

        # Released positions: decode past the window so that block 0 goes back to the pool.
        for layer in LAYERS:
            send(d, exp, rng, layer, [Seg("a", 10, 200)])
        for layer in LAYERS:
            send(d, exp, rng, layer, [Seg("a", 210, 1)])
        s = d.admin_json("/admin/v1/sequences/a")
        check_eq(s["stored"]["0"], [64, 210], "stored range after the release")
        e = expect_error(d.admin("/admin/v1/sequences/a/tokens/63?layer=0"), 410,
                         "position_released")
        check_eq(e.get("first_stored"), 64, "first_stored in the 410")
        check_eq(d.admin_json("/admin/v1/sequences/a/tokens/64?layer=0")["position"], 64,
                 "the first stored position answers")
        # Nothing above changed the cache.
        after = d.admin_json("/admin/v1/checksums?layer=0")
        check(after["pool"] != before["pool"], "the batches did change the pool")
        check_eq(d.admin_json("/admin/v1/checksums?layer=0")["pool"], after["pool"],
                 "admin reads change nothing")

        # Expired: idle past the timeout answers 410 on every admin route that names it.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            r = d.admin("/admin/v1/sequences/a")
            if r.status == 410:
                break
            time.sleep(0.2)
        expect_error(r, 410, "sequence_expired")
        expect_error(d.admin("/admin/v1/dump?seq=a"), 410, "sequence_expired")
        expect_error(d.admin("/admin/v1/sequences/a/tokens/64?layer=0"), 410, "sequence_expired")


def test_token_and_audit():
    tok = "s3cret-admin-token"
    work = tempfile.mkdtemp(prefix="dsv4d-admin-")
    loose = h.write_token_file(work, tok, 0o640, "loose.token")
    d0 = Daemon(h.SMALL + ["--admin-token-file", loose], name="loose")
    try:
        d0.start()
        started = True
    except h.TestFailure:
        started = False
    check(not started, "a group-readable admin_token_file was accepted")
    check_eq(d0.wait(10), 2, "exit status with a group-readable token file")
    logged = "\n".join(d0.lines)
    check(loose in logged and "0640" in logged, "the refusal names the file and its mode: %s" %
          logged[-400:])
    d0.kill()

    # Token files that no client could send, or that a NUL would cut short, stop the start-up.
    for name, body, why in (("nul", "\0" + tok, "NUL at byte 0"), ("cut", "abc\0" + tok, "at byte 3"),
                            ("space", "s3cret admin", "at byte 6"), ("empty", " \t\n", "is empty")):
        bad = h.write_token_file(work, body, 0o600, name + ".token")
        d0 = Daemon(h.SMALL + ["--admin-token-file", bad], name=name)
        try:
            d0.start()
            started = True
        except h.TestFailure:
            started = False
        check(not started, "admin_token_file %r was accepted" % body)
        check_eq(d0.wait(10), 2, "exit status with admin_token_file %r" % body)
        logged = "\n".join(d0.lines)
        check(bad in logged and why in logged, "the refusal names the file and %r: %s"
              % (why, logged[-300:]))
        d0.kill()
    # A trailing tab is dropped, as dsv4ctl drops it from the same file.
    tabbed = h.write_token_file(work, tok + "\t", 0o600, "tab.token")
    with Daemon(h.SMALL + ["--admin-token-file", tabbed], name="tab") as d:
        check_eq(d.admin("/admin/v1/cache", token=tok).status, 200, "token from a file ending in a tab")

    good = h.write_token_file(work, tok, 0o600)
    with Daemon(h.SMALL + ["--admin-token-file", good]) as d:
        r = d.admin("/admin/v1/cache")
        expect_error(r, 401, "unauthorized")
        check_eq(r.headers.get("www-authenticate"), "Bearer", "WWW-Authenticate on the 401")
        expect_error(d.admin("/admin/v1/cache", token="wrong"), 401, "unauthorized")
        expect_error(d.admin("/admin/v1/cache", token=tok + "x"), 401, "unauthorized")
        expect_error(d.admin("/admin/v1/dump?seq=a"), 401, "unauthorized")
        check_eq(d.admin("/admin/v1/cache", token=tok).status, 200, "the right token")
        cfg = d.admin_json("/admin/v1/config", token=tok)
        check_eq(cfg["options"]["admin_token_file"]["value"], good, "token file path shown")
        check(tok not in d.admin("/admin/v1/config", token=tok).body.decode(),
              "the token never appears in /admin/v1/config")
        # The data plane has no token here.
        check_eq(d.get("/v1/sequences/x").status, 404, "data plane without a token")
        lines = d.admin_log(until=lambda ls: len(ls) >= 7)
        time.sleep(0.1)  # and no more than one line per call
        lines = d.admin_log()
        check_eq(len(lines), 7, "one audit line per admin call (%r)" % lines)
        for ln in lines:
            for k in ("peer", "auth", "method", "route", "status", "bytes", "duration_ms"):
                check(k in ln, "audit line lacks %s: %r" % (k, ln))
            check(ln["peer"].startswith("127.0.0.1:"), "peer %r" % ln["peer"])
            check_eq(ln["level"], "info", "audit level")
        check_eq([(ln["auth"], ln["status"]) for ln in lines],
                 [("none", 401), ("none", 401), ("none", 401), ("none", 401), ("token", 200),
                  ("token", 200), ("token", 200)], "auth and status per call")
        check_eq(lines[3]["route"], "/admin/v1/dump", "route logged")
        check(lines[4]["bytes"] > 200, "bytes logged: %r" % lines[4])
        check(all(tok not in ln for ln in d.lines), "the token never appears in the log")
    shutil.rmtree(work, ignore_errors=True)


def test_dump_refused_off_loopback_without_token():
    with Daemon(h.SMALL + ["--admin-host", "0.0.0.0"]) as d:
        rng = np.random.default_rng(13)
        prefill(d, Expected(), rng, "a", 5)
        expect_error(d.admin("/admin/v1/dump?seq=a"), 403, "forbidden")
        check_eq(d.admin("/admin/v1/cache").status, 200, "reads stay open")
        check(any("dumps are refused" in ln for ln in d.lines), "start-up warning logged")


def stall_prefill(d, exp, rng):
    """Sequence "big" with 3000 positions stored at layers 0 and 1: layers 2 and 3 never written hold
    back every release, so its dump (3.5 MB) is far more than a stalled reader's socket buffers
    take in, and stays in flight until the reader goes."""
    for layer in (0, 1):
        send(d, exp, rng, layer, [Seg("big", 0, 3000, new=(layer == 0))])


def raw_dump_request(d, path, rcvbuf=4096):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", d.admin_port))
    s.sendall(("GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path).encode())
    return s


def test_one_dump_at_a_time_and_disconnect():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(14)
        exp = Expected()
        stall_prefill(d, exp, rng)
        prefill(d, exp, rng, "small", 2)
        used = d.admin_json("/admin/v1/cache")["blocks_used"]
        slow = raw_dump_request(d, "/admin/v1/dump?seq=big")
        first = slow.recv(2048)
        check(first.startswith(b"HTTP/1.1 200"), "first dump answers 200: %r" % first[:80])
        r = d.admin("/admin/v1/dump?seq=small")
        e = expect_error(r, 429, "dump_in_progress")
        check_eq(r.headers.get("retry-after"), "1", "Retry-After on the 429")
        check_eq(e.get("seq"), "big", "the 429 names the dump in progress")
        # Reads and batches go on while the dump is stalled by its reader.
        send(d, exp, rng, 0, [Seg("small", 2, 1)])
        # DELETE during the dump: the blocks stay pinned (not free) until the dump ends.
        check(d.delete_seq("big"), "big existed")
        c = d.admin_json("/admin/v1/cache")
        check(c["blocks_pinned_released"] > 0, "pinned blocks held back: %r" % c)
        check_eq(c["blocks_used"], used, "pinned blocks still count as used")
        # The client goes away mid-dump: everything is unpinned and freed.
        slow.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            c = d.admin_json("/admin/v1/cache")
            if c["blocks_pinned_released"] == 0:
                break
            time.sleep(0.05)
        check_eq(c["blocks_pinned_released"], 0, "pins released after the client left")
        check_eq(c["blocks_used"], 1, "only small's block is used")
        # The next dump is accepted and complete.
        r = d.admin("/admin/v1/dump?seq=small&layers=0-1")
        check_eq(r.status, 200, "a dump after the abandoned one")
        meta, layers = h.parse_dump(r.body)
        check_eq(sorted(layers), [0, 1], "layers 0-1 in the dump")
        check_eq(meta["positions.0"], "0-2", "positions of small at layer 0")
        check_eq(meta["positions.1"], "0-1", "positions of small at layer 1")
        lines = d.admin_log(until=lambda ls: any(ln.get("client_gone") for ln in ls))
        lines = [ln for ln in lines if ln["route"] == "/admin/v1/dump"]
        check(any(ln.get("client_gone") for ln in lines), "the abandoned dump is in the audit log")


def test_sigterm_during_stalled_dump():
    """A dump whose reader stalls does not hold up shutdown past drain_timeout_ms, and everything
    it held is released (the sanitizer build reports leaks at exit)."""
    d = Daemon(h.SMALL + ["--drain-timeout-ms", "300"]).start()
    try:
        rng = np.random.default_rng(17)
        stall_prefill(d, Expected(), rng)
        slow = raw_dump_request(d, "/admin/v1/dump?seq=big")
        check(slow.recv(64).startswith(b"HTTP/1.1 200"), "dump answers 200")
        t0 = time.monotonic()
        rc = d.stop(10)
        check_eq(rc, 0, "exit status after SIGTERM during a dump")
        check(time.monotonic() - t0 < 5, "shutdown took %.1f s" % (time.monotonic() - t0))
        d.check_log_clean()
        slow.close()
    finally:
        d.kill()


def check_dump(d, exp, buf, seq, want_layers):
    """A dump file against its own metadata and the model."""
    meta, layers = h.parse_dump(buf)
    for k, v in (("layout", "fp8_ds_mla"), ("fp8", "F8_E4M3FN"), ("scale", "UE8M0"),
                 ("block_size", str(BS)), ("window", "128"), ("record_bytes", "584"),
                 ("seq", seq), ("version", "0.1.0"), ("instance", d.instance)):
        check_eq(meta.get(k), v, "dump metadata %s" % k)
    check_eq(sorted(layers), list(want_layers), "dump layers")
    for layer, (pos, recs) in layers.items():
        digest = h.model().mod.records_digest(pos, recs)
        check_eq(digest, meta["digest.%d" % layer], "layer %d: bytes match digest.%d" % (layer, layer))
        if len(pos):
            check_eq(meta["positions.%d" % layer], "%d-%d" % (pos[0], pos[-1]), "positions meta")
            check(bool(np.all(np.diff(pos) == 1)), "positions contiguous")
            check_eq(digest, exp.digest(seq, layer, int(pos[0]), int(pos[-1])),
                     "layer %d: records are the model's" % layer)
        else:
            check_eq(meta["positions.%d" % layer], "", "empty positions meta")
    return meta, layers


def test_dump_matches_checksums():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(15)
        exp = Expected()
        prefill(d, exp, rng, "a", 150, start=20)
        for layer in LAYERS[:2]:
            send(d, exp, rng, layer, [Seg("a", 170, 5)])
        r = d.admin("/admin/v1/dump?seq=a")
        check_eq(r.status, 200, "dump")
        check_eq(r.headers.get("content-type"), "application/octet-stream", "dump Content-Type")
        meta, layers = check_dump(d, exp, r.body, "a", LAYERS)
        check_eq(meta["p0"], "20", "p0")
        check_eq(meta["layers"], "0-3", "layers")
        for layer in LAYERS:
            ck = d.admin_json("/admin/v1/checksums?layer=%d&seq=a" % layer)["sequences"]["a"]
            check_eq(ck["digest"], meta["digest.%d" % layer], "dump digest = /checksums digest")
            check_eq(ck["records"], len(layers[layer][0]), "record count")
        r = d.admin("/admin/v1/dump?seq=a&layers=2")
        meta, layers = check_dump(d, exp, r.body, "a", [2])
        check_eq(meta["layers"], "2-2", "one layer")
        # A layer the sequence never wrote: no records, the digest of the empty list.
        send(d, exp, rng, 0, [Seg("z", 0, 3, new=True)])
        meta, layers = check_dump(d, exp, d.admin("/admin/v1/dump?seq=z&layers=0-1").body, "z",
                                  [0, 1])
        check_eq(len(layers[1][0]), 0, "no records at layer 1")
        check_eq(meta["digest.1"], h.model().mod.records_digest([], []), "empty digest")
        ck = d.admin_json("/admin/v1/checksums?layer=1&seq=z")["sequences"]["z"]
        check_eq(ck, {"digest": meta["digest.1"], "first": None, "last": None, "records": 0},
                 "checksums of a layer never written")


def test_two_daemons_same_checksums():
    rng_a, rng_b = np.random.default_rng(16), np.random.default_rng(16)
    with Daemon(h.SMALL, name="a") as a, Daemon(h.SMALL, name="b") as b:
        for d, rng in ((a, rng_a), (b, rng_b)):
            exp = Expected()
            prefill(d, exp, rng, "x", 70)
            prefill(d, exp, rng, "y", 130, start=5)
            for step in range(3):
                for layer in LAYERS:
                    send(d, exp, rng, layer, [Seg("x", 70 + step, 1), Seg("y", 135 + step, 1)])
        for layer in LAYERS:
            ca = a.admin_json("/admin/v1/checksums?layer=%d" % layer)
            cb = b.admin_json("/admin/v1/checksums?layer=%d" % layer)
            check_eq(ca["sequences"], cb["sequences"], "logical checksums at layer %d" % layer)
            check_eq(ca["pool"], cb["pool"], "pool digest at layer %d" % layer)
        check_eq(a.admin_json("/admin/v1/cache")["pool_digests"],
                 b.admin_json("/admin/v1/cache")["pool_digests"], "pool digests in /cache")
        da, db = a.admin("/admin/v1/dump?seq=y").body, b.admin("/admin/v1/dump?seq=y").body
        ma, la = h.parse_dump(da)
        mb, lb = h.parse_dump(db)
        check_eq({k: v for k, v in ma.items() if k != "instance"},
                 {k: v for k, v in mb.items() if k != "instance"}, "dump metadata")
        for layer in LAYERS:
            check(np.array_equal(la[layer][1], lb[layer][1]), "dump bytes at layer %d" % layer)


if __name__ == "__main__":
    h.main([test_read_routes_against_model, test_errors, test_token_and_audit,
            test_dump_refused_off_loopback_without_token, test_one_dump_at_a_time_and_disconnect,
            test_sigterm_during_stalled_dump,
            test_dump_matches_checksums, test_two_daemons_same_checksums])
