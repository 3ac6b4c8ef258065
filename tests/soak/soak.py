"""A bounded soak of the daemon, run by hand (not by ctest); its summary goes in tests/bench/NOTES.md.

Phase 1, mixed load for --minutes on loopback: two clients run sequences through layers 0-3 (the
SWA layers 0 and 1, the ratio-4 layer 2 and the ratio-128 layer 3 with their compressed branch),
prefills of 16..200 tokens and decode steps asking for attn, lse, topk and the digest, deleting a
sequence past 1,500 tokens; an admin client dumps a live sequence, restores it under another name
and deletes the copy, every two seconds. Every answer must be 200 (or 503 with Retry-After, counted
apart). The daemon's resident memory and open descriptors are sampled every --sample-s seconds
(default 10) and the whole series is printed, then a verdict on each: the second half's maximum
against the first half's, "flat" when it grew by at most --flat-mib MiB or --flat-pct percent of
the first half's maximum, whichever is larger (descriptors: 2 or that percentage), else "RISING".
Memory that rises while the load first touches the pools and then stays flat is warm-up; memory
still rising in the second half is what a leak looks like. The verdict is printed for the reader
(and NOTES.md), not counted in the pass/fail line: a run too short for the pools to fill rises
without leaking.

Phase 2, --sigterms drains under load with snapshot_dir: each cycle starts the daemon on the same
snapshot directory, checks that every sequence the clients saw answered is back (its next position
at every layer, and its last batch of every layer answered as a replay with the same cache_digest),
loads it for two seconds and sends SIGTERM while the clients keep sending. Every request the daemon
accepted must be answered (a connection refused after the listener closed is not accepted).

Usage: /usr/bin/python3 tests/soak/soak.py <dsv4d> <dsv4_ref.py> [--minutes M] [--sigterms K]
       [--sample-s S] [--flat-mib X] [--flat-pct P]
"""

import argparse
import http.client
import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg  # noqa: E402

HEADS = 8
MODEL_HEADS = 64
LAYERS = (0, 1, 2, 3)


def write_weights(work):
    path = os.path.join(work, "w.safetensors")
    entries = [("layers.%d.attn.attn_sink" % l, "F32", [MODEL_HEADS],
                np.linspace(-2.0, 2.0, MODEL_HEADS).astype("<f4").tobytes()) for l in LAYERS]
    entries += [e for l in LAYERS for e in h.compressor_entries(l)]
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))
    return path


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.errors = []

    def add(self, key, err=None):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if err and len(self.errors) < 20:
                self.errors.append(err)


class Client:
    """One gateway-like client: its own sequences, their next position per layer, and the last
    batch each layer answered (for the replay check after a restart)."""

    def __init__(self, name, seed, tally):
        self.name, self.rng, self.tally = name, np.random.default_rng(seed), tally
        self.next = {}  # (seq, layer) -> next position
        self.last = {}  # (seq, layer) -> (body, cache_digest)
        self.seqs = []
        self.made = 0
        self.stop = threading.Event()

    def send(self, d, layer, seq, start, n, new):
        ratio = h.flash_ratio(layer)
        outs = "attn,lse,digest" + (",topk" if ratio == 4 else "")
        b = Batch.random(self.rng, layer, [Seg(seq, start, n, new)], HEADS, outputs=outs,
                         ratio=ratio)
        body = b.body()
        try:
            r = d.forward_raw(body)
        except ConnectionRefusedError:
            self.tally.add("refused_connection")
            return None
        except (http.client.HTTPException, OSError) as e:
            self.tally.add("unanswered", "%s layer %d: %r" % (seq, layer, e))
            return None
        if r.status == 200:
            self.tally.add("ok")
            meta, _ = h.st_decode(r.body)
            self.next[(seq, layer)] = start + n
            self.last[(seq, layer)] = (body, meta.get("cache_digest"))
            return r
        if r.status == 503 and r.headers.get("retry-after"):
            self.tally.add("503 " + r.json()["error"]["code"])
            return None
        self.tally.add("error", "%s layer %d: %d %r" % (seq, layer, r.status, r.body[:200]))
        return None

    def step(self, d):
        if len(self.seqs) < 3:
            self.made += 1
            seq = "%s-%d" % (self.name, self.made)
            n = int(self.rng.integers(16, 200))
            if self.send(d, 0, seq, 0, n, True) is not None:
                self.seqs.append(seq)
                for layer in LAYERS[1:]:
                    self.send(d, layer, seq, 0, n, False)
            return
        seq = self.seqs[int(self.rng.integers(len(self.seqs)))]
        if self.next.get((seq, 0), 0) > 1500:
            try:
                d.delete("/v1/sequences/" + seq)
                self.tally.add("deleted")
            except OSError:
                return
            self.seqs.remove(seq)
            for layer in LAYERS:
                self.next.pop((seq, layer), None)
                self.last.pop((seq, layer), None)
            return
        n = 1 if self.rng.random() < 0.7 else int(self.rng.integers(16, 128))
        for layer in LAYERS:
            start = self.next.get((seq, layer))
            if start is None or self.send(d, layer, seq, start, n, False) is None:
                return

    def run(self, d):
        while not self.stop.is_set():
            self.step(d)


def admin_loop(d, clients, tally, stop):
    k = 0
    while not stop.wait(2.0):
        live = [s for c in clients for s in list(c.seqs)]
        if not live:
            continue
        k += 1
        try:
            r = d.admin("/admin/v1/dump?seq=" + live[k % len(live)])
            if r.status != 200:
                tally.add("admin error", "dump %d %r" % (r.status, r.body[:200]))
                continue
            copy = "copy-%d" % k
            p = d.request("PUT", "/admin/v1/sequences/" + copy, body=r.body, admin=True)
            good = p.status in (200, 201)
            tally.add("restore ok" if good else "admin error",
                      None if good else "restore %d %r" % (p.status, p.body[:200]))
            d.request("DELETE", "/admin/v1/sequences/" + copy, admin=True)
        except (http.client.HTTPException, OSError) as e:
            tally.add("admin error", repr(e))


def sample(pid):
    with open("/proc/%d/status" % pid) as f:
        rss = [int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")][0]
    return rss, len(os.listdir("/proc/%d/fd" % pid))


def print_series(label, values, width=100):
    """values on as many lines as they need, each at most width characters."""
    line = "  %s:" % label
    for v in values:
        if len(line) + 1 + len(v) > width:
            print(line)
            line = " " * 4
        line += " " + v
    print(line)


def plateau(what, series, fmt, abs_tol, pct):
    """The verdict on one sampled series [(seconds, value)]: the second half's maximum (samples past
    the middle of the run) against the first half's; fmt formats a value or a difference. Returns
    "flat", "RISING" or "too short"."""
    mid = series[-1][0] / 2.0
    first = [v for t, v in series if t <= mid]
    second = [v for t, v in series if t > mid]
    if len(first) < 2 or len(second) < 2:
        print("  %s: too few samples for a verdict (%d, %d)" % (what, len(first), len(second)))
        return "too short"
    m1, m2 = max(first), max(second)
    tol = max(abs_tol, m1 * pct / 100.0)
    verdict = "flat" if m2 - m1 <= tol else "RISING"
    print("  %s: max %s in the first half (%d samples), %s in the second (%d): %s%s (%+.1f %%), "
          "flat up to +%s: %s" %
          (what, fmt % m1, len(first), fmt % m2, len(second), "+" if m2 >= m1 else "",
           fmt % (m2 - m1), 100.0 * (m2 - m1) / m1 if m1 else 0.0, fmt % tol, verdict))
    return verdict


def mixed_load(args, work, weights):
    tally = Tally()
    clients = [Client("m%d" % i, 100 + i, tally) for i in range(2)]
    samples = []
    with Daemon(h.SMALL + ["--weights", weights, "--threads", "2", "--kv-blocks", "256"],
                name="soak") as d:
        stop = threading.Event()
        threads = [threading.Thread(target=c.run, args=(d,)) for c in clients]
        threads.append(threading.Thread(target=admin_loop, args=(d, clients, tally, stop)))
        for t in threads:
            t.start()
        t0 = time.monotonic()
        t_end = t0 + args.minutes * 60
        while time.monotonic() < t_end:
            samples.append((time.monotonic() - t0,) + sample(d.proc.pid))
            time.sleep(min(args.sample_s, max(0.0, t_end - time.monotonic())))
        samples.append((time.monotonic() - t0,) + sample(d.proc.pid))
        for c in clients:
            c.stop.set()
        stop.set()
        for t in threads:
            t.join()
    rss = [(t, r / 1024.0) for t, r, _ in samples]
    fds = [(t, f) for t, _, f in samples]
    print("mixed load: %.1f min, %s" % (args.minutes, dict(sorted(tally.counts.items()))))
    print("  RSS MiB first %.1f, max %.1f, last %.1f; open fds first %d, max %d, last %d" %
          (rss[0][1], max(v for _, v in rss), rss[-1][1], fds[0][1], max(v for _, v in fds),
           fds[-1][1]))
    print("  %d samples, every %g s (the last at %.0f s)" % (len(samples), args.sample_s,
                                                           samples[-1][0]))
    print_series("RSS MiB", ["%.1f" % v for _, v in rss])
    print_series("open fds", ["%d" % v for _, v in fds])
    plateau("RSS", rss, "%.1f MiB", args.flat_mib, args.flat_pct)
    plateau("open fds", fds, "%.0f", 2.0, args.flat_pct)
    for e in tally.errors:
        print("  error:", e)
    return not any(k in tally.counts for k in ("error", "unanswered", "admin error"))


def check_restored(d, clients, tally):
    """Every sequence the clients saw answered is back where it stood, and its last batch of each
    layer is answered as a replay with the cache_digest of its first answer."""
    bad = 0
    for c in clients:
        for (seq, layer), nxt in sorted(c.next.items()):
            s = d.seq(seq)
            if s is None or s["next"].get(str(layer)) != nxt:
                bad += 1
                tally.add("restore mismatch", "%s layer %d: next %r, want %d" %
                          (seq, layer, s and s["next"], nxt))
                continue
            body, digest = c.last[(seq, layer)]
            r = d.forward_raw(body)
            meta = h.st_decode(r.body)[0] if r.status == 200 else {}
            if meta.get("replayed") != "true" or meta.get("cache_digest") != digest:
                bad += 1
                tally.add("restore mismatch", "%s layer %d: replay %d %r" % (seq, layer, r.status,
                                                                              meta))
            else:
                tally.add("restored layer ok")
    return bad


def sigterms(args, work, weights):
    tally = Tally()
    clients = [Client("s%d" % i, 200 + i, tally) for i in range(2)]
    snap = os.path.join(work, "snapshots")
    os.makedirs(snap)
    dargs = h.SMALL + ["--weights", weights, "--threads", "2", "--kv-blocks", "256",
                       "--snapshot-dir", snap]
    mismatches = 0
    for cycle in range(args.sigterms + 1):
        d = Daemon(dargs, name="drain-%d" % cycle).start()
        mismatches += check_restored(d, clients, tally)
        if cycle == args.sigterms:
            d.stop(120)
            break
        for c in clients:
            c.stop.clear()
        threads = [threading.Thread(target=c.run, args=(d,)) for c in clients]
        for t in threads:
            t.start()
        time.sleep(2.0)
        d.signal(signal.SIGTERM)
        rc = d.wait(120)
        for c in clients:
            c.stop.set()
        for t in threads:
            t.join()
        if rc != 0:
            tally.add("exit status %r" % rc)
    print("SIGTERMs under load: %d cycles, %s" % (args.sigterms, dict(sorted(tally.counts.items()))))
    for e in tally.errors:
        print("  error:", e)
    return mismatches == 0 and not any(k in tally.counts for k in ("error", "unanswered"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("daemon")
    ap.add_argument("ref")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sigterms", type=int, default=20)
    ap.add_argument("--sample-s", type=float, default=10.0,
                    help="seconds between two samples of RSS and open descriptors (default 10)")
    ap.add_argument("--flat-mib", type=float, default=4.0,
                    help="RSS growth of the second half still called flat, in MiB (default 4)")
    ap.add_argument("--flat-pct", type=float, default=5.0,
                    help="or this percentage of the first half's maximum, if larger (default 5)")
    args = ap.parse_args()
    h.DAEMON, h.REF_PATH = os.path.abspath(args.daemon), os.path.abspath(args.ref)
    work = tempfile.mkdtemp(prefix="dsv4d-soak-")
    weights = write_weights(work)
    ok = mixed_load(args, work, weights)
    ok = sigterms(args, work, weights) and ok
    print("soak:", "pass" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
