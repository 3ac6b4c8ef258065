"""A dump pulled while another client streams forward batches (SPEC §6 admin dump, README "Admin
API"): the dump is a snapshot at one batch boundary, internally consistent (its bytes match its
digests), holds exactly the records the model says were written, and matches /checksums of a second
daemon that was sent the same batches up to that boundary. The pool is small and other sequences
come and go, so a block released during the dump would be reused and overwritten at once if the
dump did not hold it."""

import os
import socket
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 8
LAYERS = (0, 1, 2, 3)
ARGS = ["--kv-blocks", "16", "--layers", "0-3", "--heads", str(HEADS), "--threads", "1",
        "--admin-dump-chunk-bytes", "4096"]
PREFILL = 250


class Stream(threading.Thread):
    """Decode steps for "s" and "t" layer by layer, and a sequence "u<k>" created and deleted every
    step (block churn). Every request that changed the daemon is logged, in order."""

    def __init__(self, d, rng, s_start, t_start, s_on=True):
        super().__init__(daemon=True)
        self.d, self.rng = d, rng
        self.s_start, self.t_start = s_start, t_start
        self.s_on = threading.Event()  # "s" decodes only while set
        if s_on:
            self.s_on.set()
        self.s_steps = 0
        self.log = []  # ("fwd", Batch) or ("del", name)
        self.step = 0
        self.stop = threading.Event()
        self.error = None
        self.done_times = []  # monotonic time of each answered batch

    def fwd(self, conn, b):
        while True:
            r = self.d.forward_raw(b.body(), conn=conn)
            if r.status == 503:  # pool exhausted while a dump holds blocks: retry, as a gateway
                time.sleep(0.005)
                continue
            check_eq(r.status, 200, "forward %r: %r" % (b, r.body[:200]))
            self.log.append(("fwd", b))
            self.done_times.append(time.monotonic())
            return

    def run(self):
        try:
            conn = self.d.conn()
            while not self.stop.is_set():
                k = self.step
                segs = [Seg("t", self.t_start + k, 1)]
                s_on = self.s_on.is_set()
                if s_on:
                    segs.append(Seg("s", self.s_start + self.s_steps, 1))
                for layer in LAYERS:
                    self.fwd(conn, Batch.random(self.rng, layer, segs, HEADS, outputs="q"))
                self.s_steps += s_on
                # Churn every step: the pool's free list is LIFO, so a block "s" releases is the
                # next one "u<k>" gets, and its positions 0..99 overwrite it at every layer.
                u = "u%d" % k
                for layer in LAYERS:
                    self.fwd(conn, Batch.random(self.rng, layer, [Seg(u, 0, 100, layer == 0)],
                                                HEADS, outputs="q"))
                r = self.d.delete("/v1/sequences/" + u, conn=conn)
                check_eq(r.status, 204, "DELETE " + u)
                self.log.append(("del", u))
                self.step += 1
            conn.close()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            self.error = e


def pull_slow(d, path, on_head=None):
    """GET path on the admin port through a small receive buffer, reading in small pieces; on_head()
    runs once the response head has arrived (the snapshot and its digests are then done)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    s.connect(("127.0.0.1", d.admin_port))
    s.sendall(("GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path).encode())
    buf = bytearray()
    while True:
        c = s.recv(4096)
        if not c:
            break
        buf += c
        if on_head is not None and b"\r\n\r\n" in buf:
            on_head()
            on_head = None
        time.sleep(0.002)
    s.close()
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    check(head.startswith(b"HTTP/1.1 200"), "dump status: %r" % head[:100])
    n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(
        b"content-length")][0])
    check_eq(len(body), n, "dump body length = Content-Length")
    return body


def expected_records(log, seq, layer, first, last):
    """The model's records of seq at layer for positions first..last, from the logged batches."""
    rows = {}
    for kind, b in log:
        if kind != "fwd" or b.layer != layer:
            continue
        i = 0
        for sg in b.segs:
            if sg.seq == seq:
                for p in range(sg.start, sg.start + sg.len):
                    rows[p] = b.kv[i + p - sg.start]
            i += sg.len
    kv = np.stack([rows[p] for p in range(first, last + 1)])
    q = np.zeros((kv.shape[0], 1, 512), np.uint16)
    return h.model().records(Batch(layer, [Seg(seq, first, kv.shape[0])], q, kv))


def verify(d, args, body, log):
    """The dump against its own digests, the model, the batch boundary, and /checksums of a fresh
    daemon sent the same requests up to that boundary."""
    meta, layers = h.parse_dump(body)
    ends = {}
    for layer, (pos, recs) in layers.items():
        check(len(pos) > 0, "layer %d stored nothing" % layer)
        check_eq(h.model().mod.records_digest(pos, recs), meta["digest.%d" % layer],
                 "layer %d: the dump's bytes match its digest" % layer)
        want = expected_records(log, "s", layer, int(pos[0]), int(pos[-1]))
        bad = np.argwhere(np.any(recs != want, axis=1))
        check(len(bad) == 0, "layer %d: %d records differ from the model, first at position %d"
              % (layer, len(bad), int(pos[bad[0][0]]) if len(bad) else -1))
        ends[layer] = int(pos[-1]) + 1
    # A batch boundary: layers advance in order 0, 1, 2, 3 one step at a time.
    e = [ends[x] for x in LAYERS]
    check(e[0] >= e[1] >= e[2] >= e[3] >= e[0] - 1, "snapshot between batches: ends %r" % e)
    final = d.admin_json("/admin/v1/sequences/s")
    check(final["next"]["3"] > e[3], "batches continued after the snapshot")
    check(final["stored"]["0"][0] > int(layers[0][0][0]),
          "blocks of the snapshot were released while the dump held them (stored %r, dump "
          "from %d)" % (final["stored"], int(layers[0][0][0])))
    check_eq(d.admin_json("/admin/v1/cache")["blocks_pinned_released"], 0, "pins released")

    # The same batches, up to the snapshot's boundary, sent to a fresh daemon: its /checksums
    # agree with the dump, digest and range.
    cut = 0
    seen = {x: 0 for x in LAYERS}
    for i, (kind, b) in enumerate(log):
        if kind == "fwd":
            for sg in b.segs:
                if sg.seq == "s":
                    seen[b.layer] = sg.start + sg.len
        if all(seen[x] == ends[x] for x in LAYERS):
            cut = i + 1
            break
    check(cut > 0, "the snapshot's boundary %r is in the request log" % ends)
    with Daemon(args, name="replay") as r:
        conn = r.conn()
        for kind, b in log[:cut]:
            if kind == "fwd":
                res = r.forward_raw(b.body(), conn=conn)
                check_eq(res.status, 200, "replayed %r" % b)
            else:
                check_eq(r.delete("/v1/sequences/" + b, conn=conn).status, 204, "DELETE")
        conn.close()
        for layer, (pos, _) in layers.items():
            ck = r.admin_json("/admin/v1/checksums?layer=%d&seq=s" % layer)["sequences"]["s"]
            check_eq((ck["digest"], ck["first"], ck["last"]),
                     (meta["digest.%d" % layer], int(pos[0]), int(pos[-1])),
                     "layer %d: /checksums at the same boundary" % layer)


def run(args, prefill_s, s_on, start_step, name):
    """Prefill "s" and "t", stream decode steps, pull a slow dump of "s" from start_step on; with
    s_on False, "s" joins the stream only once the dump's head has arrived."""
    rng = np.random.default_rng(21)
    with Daemon(args, name=name) as d:
        prefill = []
        for layer in LAYERS:
            for seq, n in (("s", prefill_s), ("t", 40)):
                b = Batch.random(rng, layer, [Seg(seq, 0, n, layer == 0)], HEADS, outputs="q")
                d.forward(b)
                prefill.append(("fwd", b))
        st = Stream(d, rng, prefill_s, 40, s_on)
        st.start()
        while st.step < start_step and st.is_alive():
            time.sleep(0.005)
        t0 = time.monotonic()
        body = pull_slow(d, "/admin/v1/dump?seq=s", on_head=st.s_on.set)
        t1 = time.monotonic()
        target = st.step + 20
        while st.step < target and st.is_alive():
            time.sleep(0.005)
        st.stop.set()
        st.join(30)
        check(st.error is None, "forward stream failed: %r" % (st.error,))
        during = sum(1 for t in st.done_times if t0 <= t <= t1)
        check(during > 0, "no batch was answered while the dump streamed (%.3f s)" % (t1 - t0))
        verify(d, args, body, prefill + st.log)


def test_dump_mid_stream():
    """The snapshot falls at whatever batch boundary the stream has reached. At step 69 "s"
    releases the block of positions 128..191 (SPEC §4): the dump starts just before."""
    run(ARGS, PREFILL, True, 66, "mid-stream")


def test_dump_holds_released_blocks():
    """A 2000-token prefill is 4.7 MB of dump, far more than the socket buffers, so the slow reader
    holds the fill back; "s" starts decoding once the head (with the digests) has arrived, which
    releases 29 of its blocks at once, and the churn reuses the last ones freed at once. Unless the
    dump held them, the records it sends later differ from its digests and from the model."""
    args = list(ARGS)
    args[args.index("--kv-blocks") + 1] = "48"
    run(args, 2000, False, 3, "held-blocks")


if __name__ == "__main__":
    h.main([test_dump_mid_stream, test_dump_holds_released_blocks])
