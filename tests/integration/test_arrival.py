"""A forward body range-checked and hashed as it arrives (check_on_arrival): a daemon that checks on
the reading thread (the event loop, or the bulk thread for a body past bulk_io_bytes) answers every
batch with the bytes of one that leaves it all to the executor (--check-on-arrival=false), stores
the replay triples (SPEC §4: XXH3 of each segment's q, then its kv) computed here, and recognises a
replay; whatever order the body's tensors come in (kv first), however it is cut into reads. A value
out of range found on arrival refuses the batch as the executor would, with nothing changed, and so
does any body the watcher cannot follow; a client that leaves mid-body leaves nothing behind.
dsv4d_arrival_checked_bytes_total counts the bytes of q and kv checked as they came."""

import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402
from test_compressed import write_weights  # noqa: E402
import xxhash  # noqa: E402  (the harness provides a stand-in where the module is missing)

HEADS = 8


def spec_hash(batch, i):
    """SPEC §4's replay identity of segment i: XXH3 of its q bytes, then its kv bytes, then on a
    compressed layer its rows of ckv, ikv, iq and iw (§8.8), in that order."""
    t0 = sum(s.len for s in batch.segs[:i])
    t1 = t0 + batch.segs[i].len
    x = xxhash.xxh3_64()
    x.update(batch.q[t0:t1].astype("<u2").tobytes())
    x.update(batch.kv[t0:t1].astype("<u2").tobytes())
    for _name, _dtype, _shape, raw in batch.extra:
        row = len(raw) // batch.n
        x.update(bytes(raw[t0 * row:t1 * row]))
    return x.intdigest()


def entries(batch):
    return [("q", "BF16", batch.q.shape, batch.q.astype("<u2").tobytes()),
            ("kv", "BF16", batch.kv.shape, batch.kv.astype("<u2").tobytes())] + batch.extra


def kv_first_body(batch):
    """The batch's body with its tensors' data in reverse order, kv's before q's (safetensors' own
    writer puts kv first) and iw's before ckv's."""
    return h.st_encode(entries(batch)[::-1], batch.metadata())


def body_bytes(batch):
    return sum(len(e[3]) for e in entries(batch))


def send_in_pieces(d, body, piece, pause_s=0.001):
    """POST /v1/forward with the body sent piece bytes at a time (the head alone first), pausing
    between pieces so that the daemon reads it in many reads. Returns the Response."""
    s = socket.create_connection(("127.0.0.1", d.port), timeout=30)
    try:
        req = h.raw_request("POST", "/v1/forward", body)
        head = len(req) - len(body)
        s.sendall(req[:head])
        for off in range(0, len(body), piece):
            s.sendall(body[off:off + piece])
            time.sleep(pause_s)
        resp, _ = h.read_response(s, timeout=30)
        return resp
    finally:
        s.close()


def last_triple(d, seq, layer):
    r = d.admin("/admin/v1/dump?seq=%s" % seq)
    check_eq(r.status, 200, "dump of %s: %r" % (seq, r.body[:300]))
    meta, _ = h.st_decode(r.body)
    return meta["last.%d" % layer]


def arrival_bytes(d):
    return h.metric(d.metrics(), "dsv4d_arrival_checked_bytes_total")


def same_answers_and_hashes(args, layers, seed):
    """Three prefills and a decode step, each on both layers, sent whole, in reverse order, and in
    pieces of 3000 bytes, to a daemon checking on the loop, one checking on the bulk thread, and
    one leaving it to the executor: the same answers, the replay triples SPEC §4 gives, replays."""
    rng = np.random.default_rng(seed)
    with Daemon(args, name="loop") as a, \
            Daemon(args + ["--bulk-io-bytes", "65536"], name="bulk") as b, \
            Daemon(args + ["--check-on-arrival=false"], name="executor") as c:
        sent = 0
        steps = [[Seg("a", 0, 5, True), Seg("b", 0, 1, True), Seg("c", 0, 60, True)],
                 [Seg("a", 5, 1), Seg("b", 1, 1), Seg("c", 60, 1)]]
        for k, segs in enumerate(steps):
            for layer in layers:
                s = [Seg(x.seq, x.start, x.len, x.new and layer == layers[0]) for x in segs]
                batch = Batch.random(rng, layer, s, HEADS, ratio=h.flash_ratio(layer))
                bodies = [batch.body(), kv_first_body(batch)]
                form = (k + layer) % 3
                answers = []
                for d in (a, b, c):
                    if form == 2:
                        r = send_in_pieces(d, bodies[0], 3000)
                    else:
                        r = d.forward_raw(bodies[form])
                    check_eq(r.status, 200, "%s step %d layer %d form %d: %r" %
                             (d.name, k, layer, form, r))
                    answers.append(r.body)
                check(answers[0] == answers[1] == answers[2],
                      "step %d layer %d: the daemons' answers differ" % (k, layer))
                # Several segments past 2 MiB go to the executor's validation (test_arrival_spread).
                counted = body_bytes(batch) if len(s) == 1 or len(bodies[0]) <= 2 << 20 else 0
                sent += counted
                for i, sg in enumerate(s):
                    want = "%d,%d,%016x" % (sg.start, sg.len, spec_hash(batch, i))
                    for d in (a, b, c):
                        check_eq(last_triple(d, sg.seq, layer), want,
                                 "%s: last.%d of %s" % (d.name, layer, sg.seq))
                # The same batch again, as the other form: a replay on each daemon.
                for d in (a, b, c):
                    r = d.forward_raw(bodies[1 - form % 2])
                    check_eq(r.status, 200, "%s: the replay of step %d layer %d" % (d.name, k, layer))
                    meta, _ = h.st_decode(r.body)
                    check_eq(meta.get("replayed"), "true", "%s: replayed" % d.name)
                sent += counted
        check(sent > 0, "some batches were checked on arrival")
        check_eq(arrival_bytes(a), float(sent), "loop: bytes checked on arrival")
        check_eq(arrival_bytes(b), float(sent), "bulk: bytes checked on arrival")
        check_eq(arrival_bytes(c), 0.0, "executor: bytes checked on arrival")
        check(h.metric(b.metrics(), "dsv4d_bulk_bytes_total", direction="in") > 0,
              "bulk: bodies went through the bulk thread")
        for d in (a, b, c):
            d.check_log_clean()


def test_arrival_same_answers_and_hashes():
    """On layers 0 and 1 (q and kv)."""
    same_answers_and_hashes(list(h.SMALL), (0, 1), 23)


def test_arrival_compressed():
    """On layers 2 and 3 (ratio 4: ckv, ikv, iq and iw after q and kv; ratio 128: ckv), whose
    compressed branch the daemons run."""
    w = write_weights()
    same_answers_and_hashes(h.SMALL + ["--weights", w], (2, 3), 31)
    # A value out of iq's range (2^32) in the last token, and one out of ckv's (2^59) in the first:
    # refused alike, the tensor named, sent in pieces and in reverse order.
    rng = np.random.default_rng(37)
    with Daemon(h.SMALL + ["--weights", w], name="arrival") as a, \
            Daemon(h.SMALL + ["--weights", w, "--check-on-arrival=false"], name="executor") as c:
        segs = [Seg("x", 0, 9, True), Seg("y", 0, 40, True)]
        for name, at, bits, send in (("iq", -2, b"\x80\x4f", "pieces"),
                                     ("ckv", 0, b"\x00\x00\x00\x5d", "reverse")):
            bad = Batch.random(rng, 2, segs, HEADS, ratio=4)
            k = [e[0] for e in bad.extra].index(name)
            e = bad.extra[k]
            raw = bytearray(e[3])
            off = at % len(raw)
            raw[off:off + len(bits)] = bits
            bad.extra[k] = (e[0], e[1], e[2], bytes(raw))
            errs = []
            for d in (a, c):
                r = send_in_pieces(d, bad.body(), 5000) if send == "pieces" else \
                    d.forward_raw(kv_first_body(bad))
                errs.append(expect_error(r, 400, "value_out_of_range"))
            for err in errs:
                err.pop("instance", None)
            check_eq(errs[0], errs[1], "%s out of range: the same error" % name)
            check(name in str(errs[0]), "the error names %s: %r" % (name, errs[0]))
        for d in (a, c):
            check(d.seq("x") is None and d.seq("y") is None, "%s: no sequence made" % d.name)
            d.check_log_clean()


def test_arrival_spread():
    """A batch of several segments in a body of more than 2 MiB is left to the executor, whose
    validation spreads them over its threads; one of one segment is checked as it arrives."""
    rng = np.random.default_rng(41)
    with Daemon(h.SMALL, name="arrival") as a, \
            Daemon(h.SMALL + ["--check-on-arrival=false"], name="executor") as c:
        for segs, on_arrival in (([Seg("m", 0, 150, True), Seg("n", 0, 150, True)], False),
                                 ([Seg("o", 0, 300, True)], True),
                                 ([Seg("p", 0, 100, True), Seg("q", 0, 100, True)], True)):
            batch = Batch.random(rng, 0, segs, HEADS)
            before = arrival_bytes(a)
            check_eq(a.forward_raw(batch.body()).body, c.forward_raw(batch.body()).body,
                     "%r: the same answer" % segs)
            check_eq(arrival_bytes(a) - before, float(body_bytes(batch)) if on_arrival else 0.0,
                     "%r (%d bytes): checked on arrival" % (segs, len(batch.body())))


def test_arrival_refusals():
    """Values out of range late in q, sent in pieces, and in kv sent first; q as F32; segments that
    do not add up; an unknown tensor: each answered alike by a daemon checking on arrival and one
    that does not, and no sequence made. A body left half sent is dropped, the daemon serving on."""
    rng = np.random.default_rng(29)
    with Daemon(h.SMALL, name="arrival") as a, \
            Daemon(h.SMALL + ["--check-on-arrival=false"], name="executor") as c:
        segs = [Seg("x", 0, 3, True), Seg("y", 0, 30, True)]
        late_q = Batch.random(rng, 0, segs, HEADS)
        late_q.q[-1, -1, -7] = 0x5D00  # 2^59
        late_kv = Batch.random(rng, 0, segs, HEADS)
        late_kv.kv[2, 100] = 0xFF80  # -inf
        f32 = Batch.random(rng, 0, segs, HEADS)
        f32_body = h.st_encode(
            [("q", "F32", f32.q.shape, f32.q.astype("<u4").tobytes()),
             ("kv", "BF16", f32.kv.shape, f32.kv.astype("<u2").tobytes())], f32.metadata())
        short = Batch.random(rng, 0, segs, HEADS)
        short_meta = short.metadata()
        short_meta["segments"] = '[{"seq":"x","start":0,"len":3,"new":true}]'
        extra = Batch.random(rng, 0, segs, HEADS)
        extra_body = h.st_encode(
            [("q", "BF16", extra.q.shape, extra.q.astype("<u2").tobytes()),
             ("kv", "BF16", extra.kv.shape, extra.kv.astype("<u2").tobytes()),
             ("junk", "U8", [4], b"abcd")], extra.metadata())
        cases = [("q out of range", lambda d: send_in_pieces(d, late_q.body(), 4096), 400,
                  "value_out_of_range"),
                 ("kv out of range", lambda d: d.forward_raw(kv_first_body(late_kv)), 400,
                  "value_out_of_range"),
                 ("q as F32", lambda d: d.forward_raw(f32_body), 400, "bad_request"),
                 ("segments short", lambda d: d.forward_raw(short.body(short_meta)), 400,
                  "bad_request"),
                 ("unknown tensor", lambda d: d.forward_raw(extra_body), 400, "bad_request")]
        for what, send, status, code in cases:
            errs = [expect_error(send(d), status, code) for d in (a, c)]
            check_eq(errs[0].get("message"), errs[1].get("message"), what + ": the same message")
        for d in (a, c):
            check(d.seq("x") is None and d.seq("y") is None, "%s: no sequence made" % d.name)
        half = late_q.body()
        s = socket.create_connection(("127.0.0.1", a.port), timeout=10)
        req = h.raw_request("POST", "/v1/forward", half)
        s.sendall(req[:len(req) - len(half) // 2])
        time.sleep(0.05)
        s.close()
        good = Batch.random(rng, 0, segs, HEADS)
        check_eq(a.forward_raw(good.body()).body, c.forward_raw(good.body()).body,
                 "a batch after the half-sent body: the same answer")
        for d in (a, c):
            d.check_log_clean()


if __name__ == "__main__":
    h.main([test_arrival_same_answers_and_hashes, test_arrival_compressed, test_arrival_spread,
            test_arrival_refusals])
