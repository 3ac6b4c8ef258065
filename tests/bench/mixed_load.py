"""Decode latency under a stream of prefills, per backend: prints a table, asserts nothing beyond
correct answers (a benchmark, not a test).

For each backend named on the command line, a daemon serving one layer at 64 heads gets, from one
client, decode batches of 16 sequences (one token each, outputs q) back to back on one keep-alive
connection:

- phase A: the decodes alone for --seconds: the latency of each request (send to last byte of the
  answer) gives p50 and p99;
- phase P: --prefill-clients other clients (processes of their own, so that no Python lock stands
  between them and the decode client) stream prefills of --prefill-tokens tokens back to back,
  each a new sequence deleted after its answer so that the pool does not fill, for half of
  --seconds, with no decodes: the prefills' stages alone;
- phase B: the same decodes for --seconds while the prefills go on.

The issue's target (issue 15, "Decode first"): phase B's decode p99 at most 3 x phase A's decode
p50; the "ratio" column is each phase's p99 over phase A's p50. From the daemon's metrics over each
phase: the mean queue time per class (dsv4d_forward_seconds{stage="queue",class}), the mean kernel
stage of a decode, a prefill's `yield` stage (the decodes run between its chunks) and the growth of
dsv4d_prefill_chunks_total, both per prefill. On a machine with few cores the prefill clients' and
the daemon's handling of 64 MiB each way compete with the decode for the cores, so there the queue
times per class are the signal rather than the client's p99.

Per phase, the daemon's threads (by name: the executor, the host pool, the loop) from /proc: CPU
time, involuntary context switches, minor page faults. With --request-log the daemon logs every
request (log level debug) and the bench prints the daemon's own time of a decode from those lines.

Answers are checked: a decode answer against the reference model about every --check-s seconds
(outside the timed requests), the first and last 64 tokens of a warm-up prefill's q_out, and the
status and shape of every prefill answer.

    python3 tests/bench/mixed_load.py <dsv4d> <dsv4_ref.py> [backend...] [--seconds S]
        [--prefill-clients N] [--prefill-tokens T] [--seqs D] [--chunk C[,C...]] [--check-s S]
        [--request-log]

--chunk runs one daemon per value of prefill_chunk_tokens (0: never chunk); without it the daemon's
default. Default backend cpu.
"""

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import shlex
import socket
import struct
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import dsv4_harness as h  # noqa: E402

HEADS = 64
D = h.HEAD_DIM
TILE = 64  # a prefill's q and kv repeat a random block of this many tokens (generation is slow)
WARMUP_S = 1.0
# Phase B starts once every prefill client has had this many answers: a daemon's first large
# batches fault in their buffers and run several times slower than the later ones.
WARM_PREFILLS = 2
# The stages of dsv4d_forward_seconds printed per class (upload, launch and download are parts of
# kernel on a device backend; yield is a chunked prefill's), and "request", the whole of an HTTP
# forward's time in the daemon (dsv4d_forward_request_seconds).
STAGES = ("queue", "validate", "plan", "kernel", "upload", "launch", "download", "yield",
          "request")


# --------------------------------------------------------------------------------------------------
# A lean HTTP/1.1 client on one keep-alive socket: the body goes out without being joined into one
# buffer and the answer is read into one preallocated buffer, so that a 64 MiB prefill costs the
# client little and the timed decodes measure the daemon rather than Python's http.client.


class Conn:
    def __init__(self, port, timeout=120.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def close(self):
        self.sock.close()

    def request(self, method, path, parts=()):
        """Sends one request whose body is the concatenation of parts; returns (status, body)."""
        n = sum(len(p) for p in parts)
        head = "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n" % (method, path)
        if method == "POST":
            head += "Content-Type: application/octet-stream\r\nContent-Length: %d\r\n" % n
        head = (head + "\r\n").encode("latin-1")
        if n < (4 << 20):
            self.sock.sendall(b"".join([head] + list(parts)))
        else:
            self.sock.sendall(head)
            for p in parts:
                self.sock.sendall(p)
        return self._response()

    def _response(self):
        buf = self.buf
        while b"\r\n\r\n" not in buf:
            c = self.sock.recv(1 << 16)
            if not c:
                raise ConnectionError("the daemon closed the connection")
            buf += c
        hdr, rest = buf.split(b"\r\n\r\n", 1)
        lines = hdr.decode("latin-1").split("\r\n")
        m = re.match(r"HTTP/1\.1 (\d{3})", lines[0])
        h.check(m is not None, "bad status line %r" % lines[0])
        status = int(m.group(1))
        length = 0
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v)
            h.check(k.strip().lower() != "transfer-encoding", "a chunked answer: %r" % lines)
        body = bytearray(length)
        got = min(len(rest), length)
        body[:got] = rest[:got]
        self.buf = rest[got:]
        view = memoryview(body)
        while got < length:
            k = self.sock.recv_into(view[got:], length - got)
            if not k:
                raise ConnectionError("the daemon closed the connection in a body")
            got += k
        return status, body


def st_head(meta, tensors):
    """The length prefix and header of a safetensors body whose data section is the given tensors
    (name, dtype, shape, nbytes) back to back."""
    header = {"__metadata__": meta}
    off = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    return struct.pack("<Q", len(hb)) + hb


def forward_parts(segs, qb, kvb, n):
    meta = {"layer": "0", "outputs": "q",
            "segments": json.dumps([s.to_json() for s in segs], separators=(",", ":"))}
    head = st_head(meta, [("q", "BF16", (n, HEADS, D), len(qb)), ("kv", "BF16", (n, D), len(kvb))])
    return [head, qb, kvb]


def check_q_out(body, n, what):
    """An answer's q_out and slots have the batch's shape."""
    _, t = h.st_decode(body)
    h.st_array(t, "slots", "I64", (n,))
    dt, shape, _ = t["q_out"]
    h.check_eq((dt, list(shape)), ("BF16", [n, HEADS, D]), "%s: q_out dtype and shape" % what)


def prefill_data(seed, n):
    """A prefill's q and kv bytes: a random block of TILE tokens repeated to n tokens."""
    rng = np.random.default_rng(seed)
    q = np.tile(h.random_bf16(rng, (TILE, HEADS, D)), ((n + TILE - 1) // TILE, 1, 1))[:n]
    kv = np.tile(h.random_bf16(rng, (TILE, D)), ((n + TILE - 1) // TILE, 1))[:n]
    return q, kv


# --------------------------------------------------------------------------------------------------
# The prefill clients (processes).


def prefill_client(port, wid, n, go, stop, out):
    """Streams prefills of n tokens (a new sequence each, deleted after its answer) from go until
    stop. Puts on out ("ready", wid, None) before go, ("warm", wid, None) after WARM_PREFILLS
    answers, then ("done", wid, [(t_send, t_answered), ...]), or ("error", wid, text) at any time."""
    try:
        q, kv = prefill_data(100 + wid, n)
        qb, kvb = q.astype("<u2").tobytes(), kv.astype("<u2").tobytes()
        conn = Conn(port)
        out.put(("ready", wid, None))
        go.wait()
        spans = []
        k = 0
        while not stop.is_set():
            name = "pf%d-%d" % (wid, k)
            parts = forward_parts([h.Seg(name, 0, n, True)], qb, kvb, n)
            t0 = time.monotonic()
            status, body = conn.request("POST", "/v1/forward", parts)
            t1 = time.monotonic()
            h.check(status == 200, "prefill %s: status %d %r" % (name, status, bytes(body[:300])))
            check_q_out(body, n, "prefill %s" % name)
            status, _ = conn.request("DELETE", "/v1/sequences/" + name)
            h.check_eq(status, 204, "DELETE of %s" % name)
            spans.append((t0, t1))
            if k == WARM_PREFILLS - 1:
                out.put(("warm", wid, None))
            k += 1
        conn.close()
        out.put(("done", wid, spans))
    except Exception as e:  # noqa: BLE001 - reported to the main process, which fails the run
        out.put(("error", wid, "%s: %s" % (type(e).__name__, e)))


# --------------------------------------------------------------------------------------------------
# The decode client.


class Decoder:
    """seqs sequences decoded one token each per batch, on one connection, from position 0 on."""

    def __init__(self, d, seqs, rng, check_s):
        self.d, self.seqs, self.check_s = d, seqs, check_s
        self.conn = Conn(d.port)
        self.pos = 0
        self.checked = 0
        self.next_check = time.monotonic()
        # A few random batches' q and kv, used in turn: generating them per step would load the
        # client's core more than the daemon's work does.
        self.pool = []
        for _ in range(4):
            q = h.random_bf16(rng, (seqs, HEADS, D))
            kv = h.random_bf16(rng, (seqs, D))
            self.pool.append((q, kv, q.astype("<u2").tobytes(), kv.astype("<u2").tobytes()))

    def run(self, seconds):
        """Decode steps for about `seconds`: returns the latencies (seconds) of the timed ones."""
        lat = []
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            q, kv, qb, kvb = self.pool[self.pos % len(self.pool)]
            segs = [h.Seg("dec%d" % i, self.pos, 1, self.pos == 0) for i in range(self.seqs)]
            parts = forward_parts(segs, qb, kvb, self.seqs)
            t0 = time.perf_counter()
            status, body = self.conn.request("POST", "/v1/forward", parts)
            lat.append(time.perf_counter() - t0)
            h.check(status == 200, "decode at %d: status %d %r" % (self.pos, status,
                                                                   bytes(body[:300])))
            if time.monotonic() >= self.next_check:
                b = h.Batch(0, segs, q, kv, outputs="q")
                res = h.ForwardResult(h.Response(status, {}, bytes(body)), b)
                h.check_result(res, b, "decode at position %d" % self.pos, bs=64)
                self.checked += 1
                self.next_check = time.monotonic() + self.check_s
            self.pos += 1
        return lat


# --------------------------------------------------------------------------------------------------
# Metrics.


def stage_sums(d):
    """{(stage, class): (sum, count)} of dsv4d_forward_seconds (and of
    dsv4d_forward_request_seconds as stage "request"), its cumulative buckets under
    ("le", stage, class), and the prefill chunks."""
    ms = d.metrics()
    out = {}
    for (name, labels), v in ms.items():
        lab = dict(labels)
        if name == "dsv4d_forward_seconds_bucket":
            out.setdefault(("le", lab.get("stage"), lab.get("class")), {})[float(lab["le"])] = v
        elif name in ("dsv4d_forward_seconds_sum", "dsv4d_forward_seconds_count",
                      "dsv4d_forward_request_seconds_sum", "dsv4d_forward_request_seconds_count"):
            # The request's whole time in the daemon counts as the pseudo-stage "request".
            key = (lab.get("stage", "request"), lab.get("class"))
            s, c = out.get(key, (0.0, 0.0))
            out[key] = (s + v, c) if name.endswith("_sum") else (s, c + v)
    out["chunks"] = h.metric(ms, "dsv4d_prefill_chunks_total")
    return out


def stage_total(before, after, stage, cls):
    """Seconds spent in one stage of one class between two scrapes, and the number observed."""
    s0, c0 = before.get((stage, cls), (0.0, 0.0))
    s1, c1 = after.get((stage, cls), (0.0, 0.0))
    return s1 - s0, int(c1 - c0)


def stage_mean(before, after, stage, cls):
    """Mean seconds of one stage of one class between two scrapes, and the number observed."""
    s, n = stage_total(before, after, stage, cls)
    return (s / n if n else float("nan")), n


def stage_p99(before, after, stage, cls):
    """The histogram bound under which 99 % of one stage's observations between two scrapes fell
    (the buckets go 1, 2.5, 5 per decade, so this is an upper bound, not the quantile)."""
    b0 = before.get(("le", stage, cls), {})
    b1 = after.get(("le", stage, cls), {})
    bounds = sorted(b1)
    if not bounds:
        return float("nan")
    total = b1[bounds[-1]] - b0.get(bounds[-1], 0.0)
    for le in bounds:
        if total and b1[le] - b0.get(le, 0.0) >= 0.99 * total:
            return le
    return float("nan")


def summary(lat, before, after):
    a = np.array(lat) * 1e6
    row = {"n": len(a), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
           "max": float(a.max())}
    row["q_dec"], _ = stage_mean(before, after, "queue", "decode")
    row["q_pf"], row["n_pf"] = stage_mean(before, after, "queue", "prefill")
    row["k_dec"], _ = stage_mean(before, after, "kernel", "decode")
    row["q_dec99"] = stage_p99(before, after, "queue", "decode")
    for k in ("q_dec", "q_dec99", "q_pf", "k_dec"):
        row[k] *= 1e6
    row["stages"] = {(st, cls): stage_mean(before, after, st, cls)[0] * 1e6
                     for st in STAGES for cls in ("decode", "prefill")}
    # A prefill run in chunks has a yield stage; one that was not chunked has none (0 then).
    ys, _ = stage_total(before, after, "yield", "prefill")
    row["yield"] = ys * 1e6 / row["n_pf"] if row["n_pf"] else float("nan")
    row["chunks"] = (after["chunks"] - before["chunks"]) / row["n_pf"] if row["n_pf"] else \
        float("nan")
    return row


# --------------------------------------------------------------------------------------------------
# One daemon: warm-up, phase A, phase B.


def check_warmup_prefill(d, n):
    """A prefill of the prefill clients' shape, its first and last TILE tokens' q_out against the
    model (the whole of it would take the reference model minutes on a small machine)."""
    q, kv = prefill_data(99, n)
    conn = Conn(d.port)
    status, body = conn.request("POST", "/v1/forward", forward_parts(
        [h.Seg("warm", 0, n, True)], q.astype("<u2").tobytes(), kv.astype("<u2").tobytes(), n))
    h.check(status == 200, "warm-up prefill: status %d %r" % (status, bytes(body[:300])))
    _, t = h.st_decode(bytes(body))
    q_out = h.st_array(t, "q_out", "BF16", (n, HEADS, D))
    m = h.model()
    for start in sorted({0, n - min(TILE, n)}):
        part = h.Batch(0, [h.Seg("warm", start, min(TILE, n))], q[start:start + TILE],
                       kv[start:start + TILE])
        h.check(np.array_equal(q_out[start:start + TILE], m.q_out(part)),
                "warm-up prefill: q_out of tokens %d.. differs from the model" % start)
    status, _ = conn.request("DELETE", "/v1/sequences/warm")
    h.check_eq(status, 204, "DELETE of the warm-up prefill")
    conn.close()


def proc_sample(d):
    """The daemon's minor page faults and, per group of threads (the executor `dsv4d-exec`, the
    host pool's `dsv4d-host*`, the loop `dsv4d`, the bulk I/O threads `dsv4d-bulk`, the rest), CPU
    seconds and involuntary context switches, from /proc."""
    pid = d.proc.pid
    with open("/proc/%d/stat" % pid) as f:
        out = {"minflt": int(f.read().rsplit(")", 1)[1].split()[7])}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/%d/task" % pid):
        base = "/proc/%d/task/%s/" % (pid, tid)
        try:
            with open(base + "comm") as f:
                comm = f.read().strip()
            with open(base + "stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            with open(base + "status") as f:
                nv = int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", f.read()).group(1))
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended between the listing and the read
        g = ("exec" if comm == "dsv4d-exec" else "host" if comm.startswith("dsv4d-host") else
             "loop" if comm == "dsv4d" else "bulk" if comm == "dsv4d-bulk" else "other")
        cpu, sw = out.get(g, (0.0, 0))
        out[g] = (cpu + (int(st[11]) + int(st[12])) / tick, sw + nv)
    return out


def proc_rates(before, after, seconds):
    """Per second between two proc_sample()s: minor faults, and per group (CPU share of one core,
    involuntary switches)."""
    out = {"minflt": (after["minflt"] - before["minflt"]) / seconds}
    for g in ("exec", "host", "loop", "bulk"):
        c0, s0 = before.get(g, (0.0, 0))
        c1, s1 = after.get(g, (0.0, 0))
        out[g] = ((c1 - c0) / seconds, (s1 - s0) / seconds)
    return out


def decode_durations(d, first, last):
    """The daemon's own time (first byte of the request to its answer handed to the socket, in
    seconds) of the decodes in its request log lines first..last: with --request-log only."""
    out = []
    for ln in d.lines[first:last]:
        if '"msg":"request"' not in ln or '"route":"forward"' not in ln:
            continue
        j = json.loads(ln)
        if j.get("bytes", 1 << 30) < (4 << 20):  # a decode's answer; a prefill's is 64 MiB
            out.append(j["duration_ms"] * 1e-3)
    return out


def phase_b(d, dec, args):
    """The prefills alone (phase P), then the decodes while the prefill clients stream (phase B):
    a dict of the decode latencies, the prefill spans and throughput, and the scrapes of both
    phases."""
    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=prefill_client,
                         args=(d.port, w, args.prefill_tokens, go, stop, out))
             for w in range(args.prefill_clients)]
    for p in procs:
        p.start()
    spans, errors, finished = [], [], set()

    def take(timeout=300):
        """The next message of a client (queue.Empty after timeout seconds); returns its kind."""
        kind, wid, val = out.get(timeout=timeout)
        if kind == "done":
            spans.extend(val)
        elif kind == "error":
            errors.append("client %d: %s" % (wid, val))
        if kind in ("done", "error"):
            finished.add(wid)
        return kind

    def window(seconds, decode):
        """Scrapes around `seconds` of decodes (or of waiting, the prefills alone)."""
        m0, p0, t0, l0 = stage_sums(d), proc_sample(d), time.monotonic(), len(d.lines)
        lat = dec.run(seconds) if decode else time.sleep(seconds)
        m1, p1, t1, l1 = stage_sums(d), proc_sample(d), time.monotonic(), len(d.lines)
        return {"lat": lat, "m0": m0, "m1": m1, "t0": t0, "t1": t1,
                "proc": proc_rates(p0, p1, t1 - t0), "logged": decode_durations(d, l0, l1)}

    try:
        ready = 0
        while ready < len(procs):
            ready += take() == "ready"
            h.check(not errors, "prefill clients failed: %s" % "; ".join(errors))
        go.set()
        warm, deadline = 0, time.monotonic() + 300
        while warm < len(procs):
            h.check(time.monotonic() < deadline, "the prefill clients did not warm up in 300 s")
            try:
                warm += take(max(0.001, deadline - time.monotonic())) == "warm"
            except queue.Empty:
                pass  # the deadline's check above reports it
            h.check(not errors, "prefill clients failed: %s" % "; ".join(errors))
        pw = window(args.seconds / 2, False)
        bw = window(args.seconds, True)
    finally:
        stop.set()
        go.set()
        while len(finished) < len(procs):
            take()
        for p in procs:
            p.join(60)
    h.check(not errors, "prefill clients failed: %s" % "; ".join(errors))
    for w in (pw, bw):
        done = [s for s in spans if w["t0"] <= s[1] <= w["t1"]]
        w["pf_s"] = len(done) / (w["t1"] - w["t0"])
        w["pf_lat"] = [b - a for a, b in done]
    return pw, bw


def run(backend, chunk, threads, args, rng, rows):
    extra = [] if chunk is None else ["--prefill-chunk-tokens", str(chunk)]
    extra += [] if threads is None else ["--threads", str(threads)]
    # Decode sequences keep about three blocks each (one served layer, the window released);
    # each prefill in flight holds prefill_tokens / 64 until it is deleted.
    blocks = 3 * args.seqs + (args.prefill_clients + 1) * (args.prefill_tokens // 64 + 2) + 64
    dargs = ["--backend", backend, "--layers", "0-0", "--heads", str(HEADS),
             "--kv-blocks", str(blocks),
             "--max-batch-tokens", str(max(2048, args.prefill_tokens))] + extra
    if args.request_log:
        dargs += ["--log-level", "debug"]
    dargs += shlex.split(args.daemon_args)
    with h.Daemon(dargs, name=backend) as d:
        opts = d.admin_json("/admin/v1/config")["options"]
        cfg = {k: opts[k]["value"] for k in ("prefill_chunk_tokens", "prefill_chunk_tokens_alone",
                                             "threads")}
        cfg["args"] = " ".join(dargs)
        check_warmup_prefill(d, args.prefill_tokens)
        dec = Decoder(d, args.seqs, rng, args.check_s)
        dec.run(WARMUP_S)
        m0, p0 = stage_sums(d), proc_sample(d)
        l0 = len(d.lines)
        lat = dec.run(args.seconds)
        a = summary(lat, m0, stage_sums(d))
        a["logged"] = decode_durations(d, l0, len(d.lines))
        a.update(pf_s=float("nan"), pf_p50=float("nan"))
        a["proc"] = proc_rates(p0, proc_sample(d), args.seconds)
        pw, bw = phase_b(d, dec, args)
        p, b = summary([0.0], pw["m0"], pw["m1"]), summary(bw["lat"], bw["m0"], bw["m1"])
        for r, w in ((p, pw), (b, bw)):
            r.update(pf_s=w["pf_s"], proc=w["proc"], logged=w["logged"],
                     pf_p50=float(np.percentile(w["pf_lat"], 50)) * 1e3 if w["pf_lat"] else
                     float("nan"))
        dec.conn.close()
        rows.append((backend, cfg, a, p, b, dec.checked))


def print_threads(rows):
    """The prefills' stages alone (P) and beside the decodes (B), and the daemon's threads."""
    print("Prefills alone (P, half a phase) and with the decodes (B); the daemon's threads over each "
          "phase")
    print("%-7s %5s %-5s %5s %8s %8s %8s %8s %9s %9s %9s %9s %9s %9s" % (
        "backend", "chunk", "phase", "pf/s", "pf p50ms", "pval ms", "pker ms", "yield ms",
        "exec cpu", "exec sw/s", "host cpu", "loop cpu", "bulk cpu", "minflt/s"))
    for backend, cfg, a, p, b, _ in rows:
        for phase, r in (("A", a), ("P", p), ("B", b)):
            pr = r["proc"]
            print("%-7s %5d %-5s %5.2f %8.1f %8.2f %8.2f %8.2f %9.2f %9.0f %9.2f %9.2f %9.2f %9.0f" % (
                backend, cfg["prefill_chunk_tokens"], phase, r["pf_s"], r["pf_p50"],
                r["stages"][("validate", "prefill")] / 1e3,
                r["stages"][("kernel", "prefill")] / 1e3, r["yield"] / 1e3, pr["exec"][0],
                pr["exec"][1], pr["host"][0], pr["loop"][0], pr["bulk"][0], pr["minflt"]))
    print("pval, pker: a prefill's mean validate and kernel stages; yield: the time decodes ran\n"
          "inside one prefill. cpu: CPU seconds a second of the executor thread (dsv4d-exec), the\n"
          "host pool's workers together (dsv4d-host*), the loop thread and the bulk I/O threads\n"
          "(dsv4d-bulk, bulk_io_bytes); exec sw/s: the executor's involuntary context switches a\n"
          "second; minflt/s: the daemon's minor page faults a second.")


def print_table(rows, args):
    print("host: %d cores online, %d usable by this process; decode batches of %d sequences x 1 "
          "token, %d heads; %d prefill client(s) of %d tokens; %.0f s a phase" % (
              os.cpu_count(), len(os.sched_getaffinity(0)), args.seqs, HEADS,
              args.prefill_clients, args.prefill_tokens, args.seconds))
    for backend, cfg, _, _, _, _ in rows:
        print("daemon: dsv4d %s (prefill_chunk_tokens %d, alone %d, threads %d)" % (
            cfg["args"], cfg["prefill_chunk_tokens"], cfg["prefill_chunk_tokens_alone"],
            cfg["threads"]))
    print("%-7s %5s %7s %-5s %7s %8s %8s %8s %6s %5s %8s %7s %8s %9s %8s %8s %6s" % (
        "backend", "chunk", "threads", "phase", "decodes", "p50 us", "p99 us", "max us", "ratio",
        "pf/s", "pf p50ms", "kdec us", "qdec us", "qdec99 us", "qpf us", "yield us", "chunks"))
    for backend, cfg, a, _, b, checked in rows:
        for phase, r in (("A", a), ("B", b)):
            print("%-7s %5d %7d %-5s %7d %8.0f %8.0f %8.0f %6.2f %5.2f %8.1f %7.1f %8.1f %9.0f "
                  "%8.0f %8.0f %6.2f" % (backend, cfg["prefill_chunk_tokens"], cfg["threads"],
                                         phase, r["n"], r["p50"], r["p99"], r["max"],
                                         r["p99"] / a["p50"], r["pf_s"], r["pf_p50"], r["k_dec"],
                                         r["q_dec"], r["q_dec99"], r["q_pf"], r["yield"],
                                         r["chunks"]))
    print("A: decodes alone; B: while prefills stream. ratio: p99 over phase A's p50 (target in B:\n"
          "at most 3). pf/s, pf p50ms: prefills answered a second and their client latency. From\n"
          "the daemon's metrics over the phase: kdec, the mean kernel stage of a decode; qdec, qpf,\n"
          "the mean queue stage per class; qdec99, the histogram bound under which 99 % of the\n"
          "decodes' queue times fell; yield, the time decodes ran between a prefill's chunks, and\n"
          "chunks, kernel chunks, each per prefill.")
    print()
    print("Phase B, mean of each stage per batch (us; nan: not observed; request: the whole of the "
          "request in the daemon)")
    print("%-7s %5s %-8s" % ("backend", "chunk", "class") + "".join("%10s" % st for st in STAGES))
    for backend, cfg, _, _, b, _ in rows:
        for cls in ("decode", "prefill"):
            print("%-7s %5d %-8s" % (backend, cfg["prefill_chunk_tokens"], cls) +
                  "".join("%10.1f" % b["stages"][(st, cls)] for st in STAGES))
    print()
    print_threads(rows)
    if any(a["logged"] for _, _, a, _, _, _ in rows):
        print()
        print("The daemon's own time of a decode, from its request log (first byte to the answer "
              "handed to the socket)")
        print("%-7s %5s %-5s %8s %8s %8s %8s" % ("backend", "chunk", "phase", "n", "p50 us",
                                                 "p99 us", "max us"))
        for backend, cfg, a, _, b, _ in rows:
            for phase, r in (("A", a), ("B", b)):
                x = np.array(r["logged"] or [float("nan")]) * 1e6
                print("%-7s %5d %-5s %8d %8.0f %8.0f %8.0f" % (
                    backend, cfg["prefill_chunk_tokens"], phase, len(r["logged"]),
                    np.percentile(x, 50), np.percentile(x, 99), x.max()))
    print()
    for backend, cfg, a, _, b, checked in rows:
        print("%s, prefill_chunk_tokens %d: B p99 %.0f us against 3 x A p50 = %.0f us: %s "
              "(%d decode answers checked against the model)" % (
                  backend, cfg["prefill_chunk_tokens"], b["p99"], 3 * a["p50"],
                  "met" if b["p99"] <= 3 * a["p50"] else "NOT met", checked))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dsv4d")
    ap.add_argument("ref")
    ap.add_argument("backends", nargs="*", default=["cpu"])
    ap.add_argument("--seconds", type=float, default=25.0, help="length of each phase")
    ap.add_argument("--prefill-clients", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--seqs", type=int, default=16, help="decode sequences (tokens per batch)")
    ap.add_argument("--chunk", default=None,
                    help="prefill_chunk_tokens values, comma-separated (default: the daemon's)")
    ap.add_argument("--threads", default=None,
                    help="the daemon's host threads, comma-separated values (default: its own, a "
                    "thread a core)")
    ap.add_argument("--request-log", action="store_true",
                    help="run the daemon at log level debug and print its own time of a decode")
    ap.add_argument("--daemon-args", default="",
                    help="more options for every daemon, one string (\"--direct-answer-bytes 0\")")
    ap.add_argument("--check-s", type=float, default=2.0,
                    help="seconds between decode answers checked against the model")
    args = ap.parse_args()
    h.DAEMON, h.REF_PATH = os.path.abspath(args.dsv4d), os.path.abspath(args.ref)
    h.check(os.access(h.DAEMON, os.X_OK), "daemon binary %s not executable" % h.DAEMON)
    chunks = [None] if args.chunk is None else [int(c) for c in args.chunk.split(",")]
    threads = [None] if args.threads is None else [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(15)
    rows = []
    for backend in args.backends:
        for chunk in chunks:
            for n in threads:
                run(backend, chunk, n, args, rng, rows)
    print_table(rows, args)


if __name__ == "__main__":
    main()
