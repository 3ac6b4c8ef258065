"""Shared regions (listen_shm, SPEC §6.1) through libdsv4client: its Python binding and its C example.

A daemon served through regions answers every batch with the bytes a daemon served over HTTP
answers (q_out, slots, attn, lse, cache_digest, replayed, the error objects) and ends with the same
cache; registrations without the seals, of the wrong kind or without the token are refused;
offsets out of range, misaligned or overlapping are refused with the JSON error and change nothing;
a region the client unmaps or tries to truncate never hurts the daemon; closing the connection
unmaps its regions; SIGTERM drains and removes the socket file."""

import contextlib
import fcntl
import io
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import dsv4client  # noqa: E402

HEADS = 8
MODEL_HEADS = 64
ALIGN = 64


def write_weights(path):
    entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                np.linspace(-2.0, 2.0 + l, MODEL_HEADS).astype("<f4").tobytes())
               for l in range(4)]
    entries += [e for l in range(4) for e in h.compressor_entries(l)]
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))


def up(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Layout:
    """Where a batch's tensors go in a region: q, kv, then q_out, slots, attn, lse, then a compressed
    layer's ckv, ikv, iq, iw and the topk output."""

    def __init__(self, batch, base=0):
        n, hh = batch.n, batch.q.shape[1]
        self.q_bytes, self.kv_bytes = n * hh * 1024, n * 1024
        self.q = base
        self.kv = up(self.q + self.q_bytes)
        self.out = {"q_out": up(self.kv + self.kv_bytes)}
        self.out["slots"] = up(self.out["q_out"] + self.q_bytes)
        self.out["attn"] = up(self.out["slots"] + n * 8)
        self.out["lse"] = up(self.out["attn"] + self.q_bytes)
        self.end = up(self.out["lse"] + n * hh * 4)
        self.extra = {}
        for name, _, _, raw in batch.extra:
            self.extra[name] = self.end
            self.end = up(self.end + len(raw))
        self.out["topk"] = self.end
        self.end = up(self.end + n * 512 * 4)


def shm_forward(client, region, batch, check_ok=False):
    """The batch through the region: inputs written in place, then the daemon's answer."""
    return client.forward(region, **shm_inputs(region, batch, check_ok))


def shm_inputs(region, batch, check_ok=False):
    """The batch's inputs written into the region; Client.forward's arguments for it."""
    lay = Layout(batch)
    region.buffer[lay.q:lay.q + lay.q_bytes] = batch.q.astype("<u2").tobytes()
    region.buffer[lay.kv:lay.kv + lay.kv_bytes] = batch.kv.astype("<u2").tobytes()
    comp = {}
    for name, _, shape, raw in batch.extra:
        region.buffer[lay.extra[name]:lay.extra[name] + len(raw)] = raw
        comp[name] = lay.extra[name]
        if name == "ckv":
            comp["ckv_width"] = shape[1]
        if name == "iw":
            comp["index_heads"] = shape[1]
    comp["index_topk"] = 512
    wanted = (batch.outputs or "q").split(",")
    names = {"q": "q_out", "attn": "attn", "lse": "lse", "topk": "topk"}
    out = {"slots": lay.out["slots"]}
    out.update({names[w]: lay.out[names[w]] for w in wanted if w in names})
    return dict(layer=batch.layer, segments=[(s.seq, s.start, s.len, s.new) for s in batch.segs],
                heads=HEADS, q_off=lay.q, kv_off=lay.kv, out=out, outputs=batch.outputs or "q",
                check=check_ok, compressed=comp)


def region_tensors(region, ans):
    return {k: bytes(region.buffer[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in ans["tensors"].items()}


def same_answer(a, client, region, batch, what, b=None):
    """The batch over HTTP to a and through the region (of daemon b): the same status and bytes;
    an error object's instance is each daemon's own."""
    ra = a.forward_raw(batch.body())
    ans = shm_forward(client, region, batch)
    check_eq(ans["status"], ra.status, "%s: status through the region (%r)" % (what, ans))
    check_eq(ans["instance"], b.instance if b else ans["instance"], "%s: instance" % what)
    if ra.status != 200:
        want, got = dict(ra.json()["error"]), dict(ans["error"])
        if "instance" in want:
            check_eq(want.pop("instance"), a.instance, "%s: instance in the HTTP error" % what)
            check_eq(got.pop("instance", None), ans["instance"], "%s: instance in the error" % what)
        check_eq(got, want, "%s: the error object" % what)
        return ans
    same_outputs(region, ans, ra.body, what)
    return ans


def same_outputs(region, ans, body, what):
    """A 200 answer through the region against the HTTP answer's body: the metadata, and each
    output's dtype, shape and bytes in the region. The HTTP metadata is returned."""
    meta, t = h.st_decode(body)
    check_eq(ans["metadata"], meta, "%s: the metadata" % what)
    got = region_tensors(region, ans)
    check_eq(sorted(got), sorted(t), "%s: the tensors" % what)
    for name, (dt, shape, raw) in t.items():
        check_eq(ans["tensors"][name]["dtype"], dt, "%s: dtype of %s" % (what, name))
        check_eq(ans["tensors"][name]["shape"], list(shape), "%s: shape of %s" % (what, name))
        check(got[name] == bytes(raw), "%s: %s differs from the HTTP answer" % (what, name))
    return meta


def daemons(work, extra_b=()):
    w = os.path.join(work, "w.safetensors")
    if not os.path.exists(w):
        write_weights(w)
    sock = os.path.join(work, "shm.sock")
    args = h.SMALL + ["--weights", w, "--prefill-chunk-tokens", "0"]
    return (Daemon(args, name="http"),
            Daemon(args + ["--listen-shm", sock] + list(extra_b), name="shm"), sock)


def same_state(a, b, names):
    for n in names:
        check_eq(b.seq(n)["next"], a.seq(n)["next"], "next positions of %s" % n)
        check_eq(b.seq(n)["blocks"], a.seq(n)["blocks"], "block ids of %s" % n)
    check_eq(b.admin_json("/admin/v1/cache")["pool_digests"],
             a.admin_json("/admin/v1/cache")["pool_digests"], "pool digests")


def test_shm_same_bytes():
    """Prefills across blocks with attention, a YaRN layer, replays, decodes and a conflict: every
    answer through the region equals the HTTP daemon's, and so does the cache."""
    same_bytes_run(())


def test_shm_direct_answers():
    """The same with every batch queued (inline_decode_tokens 0): answered by the executor's thread
    itself (direct_answer_bytes, on by default) or by the loop's (0), every answer the HTTP
    daemon's; dsv4d_direct_answers_total counts each 200 answer of the first, none of the second."""
    for extra, direct in ((["--inline-decode-tokens", "0"], True),
                          (["--inline-decode-tokens", "0", "--direct-answer-bytes", "0"], False)):
        ms = same_bytes_run(extra)
        ok = h.metric(ms, "dsv4d_shm_requests_total", op="forward", code="200")
        check_eq(h.metric(ms, "dsv4d_direct_answers_total"), ok if direct else 0.0,
                 "answers the executor's thread sent (%s)" % " ".join(extra))


def same_bytes_run(extra_b):
    """test_shm_same_bytes's batches with extra_b on the shm daemon's command line; returns that
    daemon's metrics at the end."""
    rng = np.random.default_rng(91)
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        da, db, sock = daemons(work, extra_b)
        with da as a, db as b:
            # The line reaches this process through a pipe, a little after the data listener's.
            lines = [j for j in h.log_records("\n".join(
                b.wait_lines(lambda ln: '"listening"' in ln and '"shm"' in ln)))
                     if j.get("msg") == "listening" and j.get("listener") == "shm"]
            check_eq([j.get("path") for j in lines], [sock], "the shm listening line")
            check_eq(os.stat(sock).st_mode & 0o777, 0o660, "the socket file's mode")
            # Layer 2 (ratio 4) takes its compressed branch's tensors where the daemon runs it.
            r2 = h.flash_ratio(2) if "2" in a.admin_json("/admin/v1/cache").get(
                "compressed", {}).get("layers", {}) else 0
            with dsv4client.Client(sock) as c:
                r = c.region(64 << 20)
                check(r.size >= 64 << 20 and r.id >= 1, "region %d of %d bytes" % (r.id, r.size))
                b0 = Batch.random(rng, 0, [Seg("a", 0, 150, True), Seg("b", 0, 40, True)], HEADS,
                                  outputs="q,attn,lse,digest")
                same_answer(a, c, r, b0, "layer 0 prefill")
                b2 = Batch.random(rng, 2, [Seg("a", 0, 150), Seg("b", 0, 40)], HEADS, ratio=r2,
                                  outputs="q,digest" + (",attn,lse,topk" if r2 else ""))
                same_answer(a, c, r, b2, "layer 2 prefill")
                rep = same_answer(a, c, r, b0, "layer 0 replay")
                check_eq(rep["metadata"].get("replayed"), "true", "the replay through the region")
                for step in range(3):
                    # Step 1 asks layer 0 for lse alone (attn is then the daemon's own scratch).
                    for layer, outs in ((0, "lse" if step == 1 else "q,attn,digest"),
                                        (2, "q,digest")):
                        d = Batch.random(rng, layer, [Seg("a", 150 + step, 1), Seg("b", 40 + step, 1)],
                                         HEADS, outputs=outs, ratio=r2 if layer == 2 else 0)
                        ans = same_answer(a, c, r, d, "decode %d layer %d %s" % (step, layer, outs))
                        check_eq(ans["status"], 200, "decode %d layer %d" % (step, layer))
                gap = Batch.random(rng, 0, [Seg("a", 160, 2)], HEADS)
                e = same_answer(a, c, r, gap, "a position gap")
                check_eq(e["error"]["code"], "position_mismatch", "the gap's error code")
                same_answer(a, c, r, Batch.random(rng, 0, [Seg("nobody", 0, 1)], HEADS), "unknown",
                            b=b)
                # A name the client cannot write plain (its request built by jansson, escaped).
                e = same_answer(a, c, r, Batch.random(rng, 0, [Seg('bad "name"', 0, 1, True)],
                                                      HEADS), "a name that needs escaping", b=b)
                check_eq(e["status"], 400, "the name that needs escaping")
                same_answer(a, c, r, Batch.random(rng, 2, [Seg("a", 153, 1)], HEADS, ratio=r2,
                                                  outputs="q,attn,topk"), "attn on a ratio-4 layer")
                if r2:
                    # The indexer's tensors missing: refused through the region as over HTTP.
                    bad = Batch.random(rng, 2, [Seg("a", 154, 1)], HEADS, ratio=r2)
                    bad.extra = [e for e in bad.extra if e[0] == "ckv"]
                    e = same_answer(a, c, r, bad, "ikv missing")
                    check_eq((e["error"].get("tensor"), e["error"].get("reason")),
                             ("ikv", "missing"), "the refusal names the tensor")
                r.destroy()
            same_state(a, b, ["a", "b"])
            ms = b.metrics()
            # Every decode, both prefills, the replay and the attention batch (the refusals are
            # counted under their own codes).
            check_eq(h.metric(ms, "dsv4d_shm_requests_total", op="forward", code="200"),
                     10.0 if r2 else 9.0,
                     "forwards counted in dsv4d_shm_requests_total")
            check_eq(h.metric(ms, "dsv4d_shm_regions"), 0.0, "regions after destroy")
            # Each forward answered 200 in its class (the two prefills and the replay are
            # prefills), its whole time at least its executor stages (the shm daemon serves
            # regions only, so every stage it recorded is theirs).
            ok = h.metric(ms, "dsv4d_shm_requests_total", op="forward", code="200")
            for c, want in (("prefill", 3.0), ("decode", ok - 3.0)):
                h.check_whole_time(ms, "dsv4d_shm_forward_seconds", c, want)
            return ms
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_shm_spin():
    """A client that polls for its answers (spin_us) gets the same bytes as the HTTP daemon,
    whether the answer comes while it polls (spin_us 10000, a daemon polling too: busy_poll_us) or
    after it has gone to sleep (spin_us 1); while it waits it uses the CPU, where a client that
    sleeps at once does not."""
    rng = np.random.default_rng(97)
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        da, db, sock = daemons(work, ["--busy-poll-us", "200"])
        with da as a, db as b:
            b.wait_lines(lambda ln: '"listening"' in ln and '"shm"' in ln)
            for i, spin in enumerate((10000, 1, 0)):
                with dsv4client.Client(sock, spin_us=spin) as c:
                    r = c.region(64 << 20)
                    seq = "s%d" % i
                    ans = same_answer(a, c, r, Batch.random(rng, 0, [Seg(seq, 0, 20, True)], HEADS,
                                                            outputs="q,attn,digest"),
                                      "spin %d" % spin)
                    check_eq(ans["status"], 200, "spin %d: %r" % (spin, ans))
                    for step in range(4):
                        same_answer(a, c, r, Batch.random(rng, 0, [Seg(seq, 20 + step, 1)], HEADS,
                                                          outputs="q,attn,digest"),
                                    "spin %d decode %d" % (spin, step))
                    # A prefill of 2048 tokens with attention: milliseconds, while the client
                    # waits polling (at most 10 ms) or asleep.
                    big = Batch.random(rng, 1, [Seg(seq, 0, 2048)], HEADS, outputs="attn")
                    lay = Layout(big)
                    if lay.end > r.size:
                        r.destroy()
                        r = c.region(lay.end)
                    ra = a.forward_raw(big.body())
                    check_eq(ra.status, 200, "the long batch over HTTP")
                    kw = shm_inputs(r, big)
                    t0, c0, w0 = time.monotonic(), time.thread_time(), thread_wanted_cpu()
                    ans = c.forward(r, **kw)
                    wall, cpu = time.monotonic() - t0, time.thread_time() - c0
                    wanted = thread_wanted_cpu() - w0
                    check_eq(ans["status"], 200, "the long batch, spin %d" % spin)
                    check(region_tensors(r, ans)["attn"] == bytes(h.st_decode(ra.body)[1]["attn"][2]),
                          "the long batch's attn, spin %d" % spin)
                    if spin == 10000:
                        # On a loaded machine a polling client waits for a core part of the time:
                        # that time counts, where sleeping would not.
                        check(wanted >= min(wall, 0.010) * 0.3,
                              "a polling client ran or waited for a core %.1f ms in %.1f ms (on "
                              "a core %.1f ms)" % (wanted * 1e3, wall * 1e3, cpu * 1e3))
                    else:
                        check(cpu <= 0.3 * wall, "a sleeping client used %.1f ms of CPU in %.1f "
                              "ms" % (cpu * 1e3, wall * 1e3))
                    r.destroy()
                    same_state(a, b, [seq])
                    a.delete_seq(seq)  # the pool's blocks for the next client's sequence
                    b.delete_seq(seq)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def thread_wanted_cpu():
    """Seconds this thread has run on a core or waited for one (ready to run, not sleeping): its
    CPU time, plus its time on the run queue from schedstat's second field (0 where the kernel
    keeps no schedstat). schedstat's first field, the run time, is brought up to date only at
    ticks and switches, so the CPU time comes from the clock that is always current."""
    try:
        with open("/proc/self/task/%d/schedstat" % threading.get_native_id()) as f:
            wait_ns = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        wait_ns = 0
    return time.thread_time() + wait_ns * 1e-9


def memfd(size, seals):
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def refused(ans, status, code, what, words=None):
    check_eq(ans["status"], status, "%s: status (%r)" % (what, ans))
    check_eq(ans["error"]["code"], code, "%s: code" % what)
    check(isinstance(ans["error"].get("message"), str) and ans["error"]["message"],
          "%s: a message" % what)
    if words:
        check(words in ans["error"]["message"], "%s: %r in %r" % (what, words,
                                                                  ans["error"]["message"]))


def prepared_call(fw, region, batch, check_ok=True):
    """The batch through a prepared Forward: its inputs written where fw reads them (the layout of
    its shape), its segments set (as a list, or on layer 1 as dsv4client.segments' array), then the
    call on its layer."""
    kw = shm_inputs(region, batch)
    segs = kw["segments"]
    fw.segments(dsv4client.segments(segs) if kw["layer"] == 1 else segs)
    return fw(kw["layer"], check=check_ok)


def same_reply(a, fw, region, batch, what, attention=None):
    """A prepared call's Reply against the HTTP daemon's answer to the same batch (attention: the
    mode fw was prepared with): status, replayed, cache_digest and attention read without the JSON,
    the answer parsed on demand, and the output bytes in the region."""
    meta = batch.metadata()
    if attention:
        meta["attention"] = attention
    ra = a.forward_raw(batch.body(meta))
    check_eq(ra.status, 200, "%s over HTTP" % what)
    rep = prepared_call(fw, region, batch)
    meta = same_outputs(region, rep.answer, ra.body, what)
    check_eq((rep.status, rep.replayed, rep.cache_digest, rep.attention),
             (200, meta.get("replayed") == "true", meta.get("cache_digest", ""),
              meta.get("attention", "")), "%s: the reply's fields" % what)
    return rep


def shared_client_threads(c, r, rng, threads=4, steps=30):
    """Threads sharing one client, each with a Forward of its own (its own offsets in r and its
    own sequence): every answer is 200 and names its own thread's offsets, so no thread read
    another's answer."""
    errors = []

    def worker(t):
        try:
            b = Batch.random(rng, 0, [Seg("t%d" % t, 0, 1, True)], HEADS)
            lay = Layout(b, base=(8 << 20) + t * (256 << 10))
            fw = c.prepare(r, HEADS, lay.q, lay.kv, {k: lay.out[k] for k in ("q_out", "slots")})
            for step in range(steps):
                fw.segments([("t%d" % t, step, 1, step == 0)])
                rep = fw(0)
                got = rep.answer["tensors"]["q_out"]["data_offsets"][0]
                if rep.status != 200 or got != lay.out["q_out"]:
                    errors.append("thread %d step %d: status %d, q_out at %d, not %d" % (
                        t, step, rep.status, got, lay.out["q_out"]))
        except Exception as e:  # noqa: BLE001 (reported below, in the test's thread)
            errors.append("thread %d: %r" % (t, e))

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(not errors, "threads sharing a client: %s" % errors[:3])


def test_shm_prepared():
    """Client.prepare: a decode step's segments set once and run through two layers, a replay and
    a refusal give what the HTTP daemon gives, and the cache ends the same."""
    rng = np.random.default_rng(98)
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        da, db, sock = daemons(work)
        with da as a, db as b, dsv4client.Client(sock) as c:
            b.wait_lines(lambda ln: '"listening"' in ln and '"shm"' in ln)
            r = c.region(16 << 20)
            pre = Batch.random(rng, 0, [Seg("u", 0, 30, True), Seg("v", 0, 7, True)], HEADS,
                               outputs="q,attn,digest")
            kw = shm_inputs(r, pre)
            fw = c.prepare(r, HEADS, kw["q_off"], kw["kv_off"], kw["out"], kw["outputs"])
            same_reply(a, fw, r, pre, "the prefill")
            rep = same_reply(a, fw, r, pre, "its replay")
            check(rep.replayed, "the replay's reply says so")
            pre1 = Batch.random(rng, 1, [Seg("u", 0, 30), Seg("v", 0, 7)], HEADS,
                                outputs="q,attn,digest")
            same_reply(a, fw, r, pre1, "the prefill on layer 1")
            # Decode steps: the same offsets for every step (a layout of 2 tokens), attention
            # named exact (every backend runs it).
            kw = shm_inputs(r, Batch.random(rng, 0, [Seg("u", 30, 1), Seg("v", 7, 1)], HEADS,
                                            outputs="q,attn,digest"))
            dec = c.prepare(r, HEADS, kw["q_off"], kw["kv_off"], kw["out"], "q,attn,digest",
                            attention="exact")
            for step in range(3):
                for layer in (0, 1):
                    d = Batch.random(rng, layer, [Seg("u", 30 + step, 1), Seg("v", 7 + step, 1)],
                                     HEADS, outputs="q,attn,digest")
                    rep = same_reply(a, dec, r, d, "decode %d layer %d" % (step, layer), "exact")
                    check_eq(rep.attention, "exact", "decode %d layer %d: attention" % (step,
                                                                                       layer))
            # A position gap: refused as over HTTP, with the answer's error; nothing changes.
            gap = Batch.random(rng, 0, [Seg("u", 40, 1), Seg("v", 10, 1)], HEADS)
            err = a.forward_raw(gap.body())
            check_eq(err.status, 409, "the gap over HTTP")
            try:
                prepared_call(dec, r, gap)
                check(False, "the gap through a prepared call was not refused")
            except dsv4client.Dsv4Error as e:
                check_eq((e.status, e.code), (409, err.json()["error"]["code"]), "the gap's error")
            rep = prepared_call(dec, r, gap, check_ok=False)
            check_eq((rep.status, rep.answer["error"]["code"]), (409, "position_mismatch"),
                     "the gap unchecked: its reply")
            same_state(a, b, ["u", "v"])
            # (the threads' sequences are b's alone: after the comparison)
            shared_client_threads(c, r, rng)
            # Region ids are each connection's own: another client's region is refused, in Python
            # and by the library itself (-EINVAL, nothing sent).
            with dsv4client.Client(sock) as c2:
                r2 = c2.region(1 << 20)
                try:
                    c2.forward(r, **kw)
                    check(False, "another client's region was not refused")
                except ValueError as e:
                    check("another client" in str(e), "the refusal says why: %s" % e)
                f = dsv4client._forward_args(0, dsv4client.segments([("u", 0, 1)]), HEADS,
                                             kw["q_off"], kw["kv_off"], kw["out"], "q", None, None,
                                             None)
                check_eq(c2._lib.dsv4c_forward(c2._c, r._h, f, dsv4client.Result()), -22,
                         "the library's answer to another client's region")
                check_eq(c2._lib.dsv4c_region_destroy(c2._c, r._h), -22,
                         "the library's destroy of another client's region")
                r2.destroy()
            # A negative offset is refused in Python (ctypes would wrap it to a huge size_t).
            neg = dict(kw, out=dict(kw["out"], q_out=-64))
            for call in (lambda: c.prepare(r, HEADS, -64, kw["kv_off"], kw["out"]),
                         lambda: c.forward(r, **neg)):
                try:
                    call()
                    check(False, "a negative offset was not refused")
                except ValueError as e:
                    check("negative" in str(e), "the refusal says why: %s" % e)
            r.destroy()
            # A destroyed region (its pages unmapped here) is refused before the library is
            # called, by a Forward and by forward alike.
            for call in (lambda: dec(0), lambda: c.forward(r, **kw)):
                try:
                    call()
                    check(False, "a call on a destroyed region was not refused")
                except ValueError as e:
                    check("destroyed" in str(e), "the refusal says why: %s" % e)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_shm_registration_refusals():
    """A region without both seals, one sealed against writing, a file that is not a memfd, no
    descriptor, two descriptors or no token are refused; a registered region cannot be truncated,
    and one the client has unmapped still serves."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        sock = os.path.join(work, "shm.sock")
        tok = h.write_token_file(work, "shm-token", 0o600, "api.token")
        with Daemon(h.SMALL + ["--listen-shm", sock, "--api-token-file", tok]) as d:
            with dsv4client.Client(sock) as c:
                try:
                    c.region(1 << 20)
                    check(False, "a region without the token was registered")
                except dsv4client.Dsv4Error as e:
                    check_eq((e.status, e.code), (401, "unauthorized"), "no token")
            c = dsv4client.Client(sock, token="shm-token")
            reg = {"op": "register", "token": "shm-token"}
            for seals, words in ((0, "F_SEAL_SHRINK"), (fcntl.F_SEAL_SHRINK, "F_SEAL_GROW"),
                                 (fcntl.F_SEAL_GROW, "F_SEAL_SHRINK"),
                                 (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
                                  "writing")):
                fd = memfd(1 << 20, seals)
                refused(c.request(reg, fd), 400, "bad_request", "seals 0x%x" % seals, words)
                os.close(fd)
            with open(os.path.join(work, "plain"), "wb+") as f:
                f.truncate(1 << 20)
                refused(c.request(reg, f.fileno()), 400, "bad_request", "a plain file",
                        "F_SEAL_SHRINK")
            refused(c.request(reg), 400, "bad_request", "no descriptor", "descriptor")
            refused(c.request({"op": "register", "token": "wrong"}, -1), 401, "unauthorized",
                    "a wrong token")
            fd = memfd(0, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            refused(c.request(reg, fd), 400, "bad_request", "an empty region", "bytes")
            os.close(fd)
            check_eq(h.metric(d.metrics(), "dsv4d_shm_regions"), 0.0, "regions after refusals")
            # A region registered by hand: sealed, so the client cannot truncate it; the client
            # unmaps its own view and the daemon still serves from its mapping.
            size = 4 << 20
            fd = memfd(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            ans = c.request(reg, fd)
            check_eq(ans["status"], 200, "a sealed region: %r" % ans)
            rid = ans["region"]
            check_eq(ans["bytes"], size, "the region's size")
            try:
                os.ftruncate(fd, 4096)
                check(False, "a sealed region was truncated")
            except PermissionError:
                pass
            rng = np.random.default_rng(92)
            b = Batch.random(rng, 0, [Seg("m", 0, 3, True)], HEADS, outputs="q,digest")
            lay = Layout(b)
            with mmap.mmap(fd, size) as m:
                m[lay.q:lay.q + lay.q_bytes] = b.q.astype("<u2").tobytes()
                m[lay.kv:lay.kv + lay.kv_bytes] = b.kv.astype("<u2").tobytes()
            header = {"__metadata__": b.metadata(),
                      "q": {"dtype": "BF16", "shape": [3, HEADS, 512],
                            "data_offsets": [lay.q, lay.q + lay.q_bytes]},
                      "kv": {"dtype": "BF16", "shape": [3, 512],
                             "data_offsets": [lay.kv, lay.kv + lay.kv_bytes]}}
            ans = c.request({"op": "forward", "region": rid, "header": header,
                             "out": {"q_out": lay.out["q_out"], "slots": lay.out["slots"]}})
            check_eq(ans["status"], 200, "a forward after the client unmapped: %r" % ans)
            with mmap.mmap(fd, size) as m:
                o = ans["tensors"]["q_out"]["data_offsets"]
                q_out = np.frombuffer(m[o[0]:o[1]], dtype="<u2").reshape(3, HEADS, 512)
            check(np.array_equal(q_out, h.model().q_out(b)), "q_out in the region vs the model")
            check_eq(ans["metadata"]["cache_digest"], h.model().cache_digest(b), "cache_digest")
            os.close(fd)
            check_eq(c.request({"op": "unregister", "region": rid})["status"], 200, "unregister")
            refused(c.request({"op": "unregister", "region": rid}), 404, "not_found",
                    "unregister twice")
            c.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_shm_bad_requests_change_nothing():
    """Offsets past the region, misaligned or overlapping, missing or unasked outputs, an unknown
    region, a bad header, bad JSON, the segments' text after the message of the wrong length, given
    twice, after another op or without "segments_bytes", an unknown op, an oversized message and a
    sequence name that needs escaping: each answered with a
    JSON error, none changing a sequence or a block; then the valid batch gives the bytes of a
    daemon that saw none of them."""
    rng = np.random.default_rng(93)
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        da, db, sock = daemons(work)
        with da as a, db as b:
            c = dsv4client.Client(sock)
            r = c.region(8 << 20)
            first = Batch.random(rng, 0, [Seg("x", 0, 10, True)], HEADS)
            same_answer(a, c, r, first, "the first prefill")
            used0 = b.used_blocks()
            good = Batch.random(rng, 0, [Seg("x", 10, 5), Seg("y", 0, 4, True)], HEADS,
                                outputs="q,attn,digest")
            lay = Layout(good)
            r.buffer[lay.q:lay.q + lay.q_bytes] = good.q.astype("<u2").tobytes()
            r.buffer[lay.kv:lay.kv + lay.kv_bytes] = good.kv.astype("<u2").tobytes()
            n = good.n

            def header(q=None, kv=None, meta=None):
                return {"__metadata__": meta or good.metadata(),
                        "q": {"dtype": "BF16", "shape": [n, HEADS, 512],
                              "data_offsets": q or [lay.q, lay.q + lay.q_bytes]},
                        "kv": {"dtype": "BF16", "shape": [n, 512],
                               "data_offsets": kv or [lay.kv, lay.kv + lay.kv_bytes]}}
            out = {"q_out": lay.out["q_out"], "slots": lay.out["slots"], "attn": lay.out["attn"]}

            def fwd(hdr=None, o=None, region=None):
                return c.request({"op": "forward", "region": r.id if region is None else region,
                                  "header": hdr or header(), "out": out if o is None else o})

            # The segments' text after the message (SPEC 6.1, "segments_bytes").
            segs = good.metadata()["segments"]
            bare = {k: v for k, v in good.metadata().items() if k != "segments"}

            def fwd_after(meta, declared, after, op="forward"):
                msg = {"op": op, "region": r.id, "header": header(meta=meta), "out": out,
                       "segments_bytes": declared}
                return c.request(json.dumps(msg, separators=(",", ":")) + after)
            big = r.size - lay.q_bytes + 2
            cases = [
                (fwd(header(q=[big, big + lay.q_bytes])), 400, "bad_request", "past the region"),
                (fwd(header(kv=[lay.kv + 1, lay.kv + 1 + lay.kv_bytes])), 400, "bad_request",
                 "multiple of"),
                (fwd(header(kv=[lay.q + 64, lay.q + 64 + lay.kv_bytes])), 400, "bad_request",
                 "overlaps"),
                (fwd(o=dict(out, q_out=r.size - 64)), 400, "bad_request", "outside"),
                (fwd(o=dict(out, slots=lay.out["slots"] + 4)), 400, "bad_request", "aligned"),
                (fwd(o=dict(out, attn=lay.kv)), 400, "bad_request", "overlaps input"),
                (fwd(o=dict(out, attn=lay.out["q_out"] + 64)), 400, "bad_request",
                 "overlaps output"),
                (fwd(o={"q_out": lay.out["q_out"], "attn": lay.out["attn"]}), 400, "bad_request",
                 "slots"),
                (fwd(o=dict(out, lse=lay.out["lse"])), 400, "bad_request", "lse"),
                (fwd(region=r.id + 7), 404, "not_found", "region"),
                (fwd(header(meta=dict(good.metadata(), layer="9"))), 400, "unknown_layer", None),
                (c.request({"op": "forward", "region": r.id, "header": 5, "out": out}), 400,
                 "bad_request", "malformed region header"),
                (c.request("not json"), 400, "bad_request", "JSON"),
                (fwd_after(bare, len(segs) + 1, segs), 400, "bad_request", "segments_bytes"),
                (fwd_after(bare, len(segs), ""), 400, "bad_request", "segments_bytes"),
                (fwd_after(good.metadata(), len(segs), segs), 400, "bad_request", "twice"),
                (fwd_after(bare, len(segs), segs, op="unregister"), 400, "bad_request", "JSON"),
                (c.request(json.dumps({"op": "forward", "region": r.id, "header": header(),
                                       "out": out}) + segs), 400, "bad_request", "JSON"),
                (c.request({"op": "dance"}), 400, "bad_request", "op"),
                (c.request({"op": "forward", "pad": "x" * (300 << 10)}), 413, "payload_too_large",
                 None),
                # A name the client library cannot write plainly (it escapes it through jansson).
                (c.forward(r, good.layer, [('y "2"', 0, 4, True), ("x", 10, 5)], HEADS, lay.q,
                           lay.kv, out, outputs="q,attn", check=False), 400, "bad_request",
                 "seq"),
            ]
            for i, (ans, status, code, words) in enumerate(cases):
                refused(ans, status, code, "case %d" % i, words)
            # |x| >= 2^59 in the last kv element: the same 400 as over HTTP.
            bad = good.copy()
            bad.kv[-1, -1] = h.BF16_2_59
            e = same_answer(a, c, r, bad, "a kv value out of range")
            check_eq(e["error"]["code"], "value_out_of_range", "the range refusal")
            check_eq(b.seq("x")["next"]["0"], 10, "sequence x after the refusals")
            check(b.seq("y") is None, "a refused request created sequence y")
            check_eq(b.used_blocks(), used0, "used blocks after the refusals")
            same_answer(a, c, r, good, "the valid batch after the refusals")
            same_state(a, b, ["x", "y"])
            c.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_shm_message_before_answer():
    """A client that sends its next message while its forward is in flight: the daemon reads it
    only after answering the forward, so the answers come in the order of the messages; then a
    forward of the next tokens is answered as usual."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        sock = os.path.join(work, "shm.sock")
        with Daemon(h.SMALL + ["--listen-shm", sock]):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(sock)
            size = 64 << 20
            fd = memfd(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            socket.send_fds(s, [b'{"op":"register"}'], [fd])
            ans = json.loads(s.recv(1 << 18))
            check_eq(ans["status"], 200, "registration: %r" % ans)
            rid = ans["region"]
            rng = np.random.default_rng(95)
            model = h.model()
            # A 2048-token prefill on one host thread: milliseconds in flight, while the next
            # message is already in the socket.
            for i, (start, n) in enumerate(((0, 2048), (2048, 3))):
                b = Batch.random(rng, 0, [Seg("p", start, n, start == 0)], HEADS)
                lay = Layout(b)
                with mmap.mmap(fd, size) as m:
                    m[lay.q:lay.q + lay.q_bytes] = b.q.astype("<u2").tobytes()
                    m[lay.kv:lay.kv + lay.kv_bytes] = b.kv.astype("<u2").tobytes()
                header = {"__metadata__": b.metadata(),
                          "q": {"dtype": "BF16", "shape": [n, HEADS, 512],
                                "data_offsets": [lay.q, lay.q + lay.q_bytes]},
                          "kv": {"dtype": "BF16", "shape": [n, 512],
                                 "data_offsets": [lay.kv, lay.kv + lay.kv_bytes]}}
                fwd = json.dumps({"op": "forward", "region": rid, "header": header,
                                  "out": {"q_out": lay.out["q_out"], "slots": lay.out["slots"]}})
                nxt = json.dumps({"op": "unregister", "region": rid + 9}).encode()
                s.send(fwd.encode())
                if i == 0:  # sent before the forward's answer
                    s.send(nxt)
                ans = json.loads(s.recv(1 << 18))
                check_eq(ans["status"], 200, "forward %d answered first: %r" % (i, ans))
                with mmap.mmap(fd, size) as m:
                    o = ans["tensors"]["q_out"]["data_offsets"]
                    q_out = np.frombuffer(m[o[0]:o[1]], dtype="<u2").reshape(n, HEADS, 512)
                check(np.array_equal(q_out, model.q_out(b)), "forward %d: q_out" % i)
                if i == 0:
                    refused(json.loads(s.recv(1 << 18)), 404, "not_found",
                            "the message sent before the answer")
            s.close()
            os.close(fd)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_shm_c_example():
    """The README's C example through libdsv4client: its prefill and decode answer what the same
    batches answer over HTTP."""
    exe = os.environ.get("DSV4CLIENT_EXAMPLE")
    check(exe and os.access(exe, os.X_OK), "DSV4CLIENT_EXAMPLE (the C example) not found: %r" % exe)
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        da, db, sock = daemons(work)
        with da as a, db as b:
            run = subprocess.run([exe, sock, str(HEADS), "ex"], capture_output=True, text=True,
                                 timeout=60)
            check_eq(run.returncode, 0, "the example's exit status (%s)" % run.stderr)
            lines = run.stdout.split("\n")[:2]

            def pattern(n):
                i = np.arange(n, dtype=np.uint64)
                return ((((i // 3) & 1) << 15) | (0x3F80 + (7 * i) % 128)).astype(np.uint16)
            for step, line in enumerate(lines):
                n = 1 if step else 4
                seg = Seg("ex", 4 if step else 0, n, not step)
                batch = Batch(0, [seg], pattern(n * HEADS * 512).reshape(n, HEADS, 512),
                              pattern(n * 512).reshape(n, 512), "q,digest")
                res = a.forward(batch)
                check_eq(line, "200 %s 0x%04x" % (res.cache_digest, res.q_out[0, 0, 0]),
                         "the example's step %d" % step)
            check_eq(h.metric(b.metrics(), "dsv4d_shm_regions"), 0.0, "the example's region")
            same_state(a, b, ["ex"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def readme_python_blocks():
    """The README's two Python blocks of the shared regions: the forward, and the prepared calls."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    first = [b for b in blocks if 'dsv4client.Client("/run/dsv4d/shm.sock")' in b]
    second = [b for b in blocks if "c.prepare(" in b]
    check(len(first) == 1 and len(second) == 1, "the README's two shared-region Python blocks")
    return first[0], second[0]


def test_shm_readme_python():
    """The README's Python blocks run as written against a daemon of 64 heads (its socket path and
    the binding's folder put in): every call answers 200, and the same batches over HTTP give the
    same digests and q_out, and the same cache."""
    first, second = readme_python_blocks()
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        w = os.path.join(work, "w.safetensors")
        write_weights(w)
        sock = os.path.join(work, "shm.sock")
        args = ["--kv-blocks", "64", "--layers", "0-3", "--heads", "64", "--threads", "1",
                "--weights", w, "--prefill-chunk-tokens", "0"]
        with Daemon(args, name="http") as a, Daemon(args + ["--listen-shm", sock],
                                                     name="shm") as b:
            b.wait_lines(lambda ln: '"listening"' in ln and '"shm"' in ln)
            code = (first + second).replace('"/run/dsv4d/shm.sock"', repr(sock)).replace(
                '"client/python"', repr(os.path.join(ROOT, "client", "python")))
            ns, printed = {}, io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 (the README's own code)
            lines = printed.getvalue().split("\n")

            def http(layer, start, n, new=False):
                ones = np.full((n, MODEL_HEADS, 512), 0x3F80, np.uint16)
                extra = [("ckv", "F32", [n, 1024], bytes(n * 4096))] if layer == 3 else []
                return a.forward(Batch(layer, [Seg("req-1", start, n, new)], ones,
                                       np.full((n, 512), 0x3F80, np.uint16), "q,digest", extra))
            check_eq(lines[0].split()[0], http(0, 0, 4, True).cache_digest,
                     "the first block's digest")
            http(1, 0, 4)
            http(3, 0, 4)
            want = []
            for pos in range(4, 7):
                for layer in (0, 1, 3):
                    res = http(layer, pos, 1)
                    want.append("%d %d 200 %s" % (pos, layer, res.cache_digest))
            check_eq(lines[1:10], want, "the prepared calls' lines")
            # The region's q_out (the first block's view) holds the last call's.
            check(ns["q_out"][:1].tobytes() == res.q_out.astype("<u2").tobytes(),
                  "the last call's q_out")
            ns["r"].destroy()
            ns["c"].close()
            same_state(a, b, ["req-1"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_shm_close_and_drain():
    """A connection that goes away has its regions unmapped; SIGTERM with a client connected
    drains, closes it and removes the socket file."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        sock = os.path.join(work, "shm.sock")
        d = Daemon(h.SMALL + ["--listen-shm", sock]).start()
        try:
            c = dsv4client.Client(sock)
            c.region(1 << 20)
            c.region(2 << 20)
            check_eq(h.metric(d.metrics(), "dsv4d_shm_regions"), 2.0, "two regions mapped")
            c.close()
            deadline = __import__("time").monotonic() + 5
            while h.metric(d.metrics(), "dsv4d_shm_regions") and \
                    __import__("time").monotonic() < deadline:
                __import__("time").sleep(0.02)
            check_eq(h.metric(d.metrics(), "dsv4d_shm_regions"), 0.0, "regions after close")
            idle = dsv4client.Client(sock)
            idle.region(1 << 20)
            d.signal(signal.SIGTERM)
            check_eq(d.wait(15), 0, "exit status after SIGTERM with a client connected")
            check(not os.path.exists(sock), "the socket file is still there")
            d.check_log_clean()
            idle.close()
        finally:
            d.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_shm_max_connections():
    """Past max_connections a client is told 503 too_many_connections and closed; the first one
    keeps working."""
    work = tempfile.mkdtemp(prefix="dsv4d-it-shm-")
    try:
        sock = os.path.join(work, "shm.sock")
        with Daemon(h.SMALL + ["--listen-shm", sock, "--max-connections", "1"]) as d:
            first = dsv4client.Client(sock)
            r = first.region(1 << 20)
            second = dsv4client.Client(sock)
            try:
                ans = second.request({"op": "register"}, -1)
                refused(ans, 503, "too_many_connections", "a second client")
            except OSError:
                check(False, "the second client got no answer before the close")
            second.close()
            check_eq(first.request({"op": "unregister", "region": r.id})["status"], 200,
                     "the first client after the refusal")
            first.close()
            check_eq(h.metric(d.metrics(), "dsv4d_shm_regions"), 0.0, "regions at the end")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    h.main([test_shm_same_bytes, test_shm_direct_answers, test_shm_spin, test_shm_prepared,
            test_shm_registration_refusals, test_shm_bad_requests_change_nothing, test_shm_message_before_answer,
            test_shm_c_example, test_shm_readme_python, test_shm_close_and_drain,
            test_shm_max_connections])
