"""A bounded soak of the daemon, run by hand (not by ctest); its summary goes in tests/bench/NOTES.md.

Phase 1, mixed load for --minutes on loopback: two clients run sequences through layers 0-3 (the
SWA layers 0 and 1, the ratio-4 layer 2 and the ratio-128 layer 3 with their compressed branch),
prefills of 16..200 tokens and decode steps asking for attn, lse, topk and the digest, deleting a
sequence past 1,500 tokens; an admin client dumps a live sequence, restores it under another name
and deletes the copy, every two seconds. Every answer must be 200 (or 503 with Retry-After, counted
apart); the daemon's resident memory and open descriptors are sampled every 10 s.

Phase 2, --sigterms drains under load with snapshot_dir: each cycle starts the daemon on the same
snapshot directory, checks that every sequence the clients saw answered is back (its next position
at every layer, and its last batch of every layer answered as a replay with the same cache_digest),
loads it for two seconds and sends SIGTERM while the clients keep sending. Every request the daemon
accepted must be answered (a connection refused after the listener closed is not accepted).

Usage: /usr/bin/python3 tests/soak/soak.py <dsv4d> <dsv4_ref.py> [--minutes M] [--sigterms K]
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
        t_end = time.monotonic() + args.minutes * 60
        while time.monotonic() < t_end:
            samples.append(sample(d.proc.pid))
            time.sleep(min(10.0, max(0.0, t_end - time.monotonic())))
        samples.append(sample(d.proc.pid))
        for c in clients:
            c.stop.set()
        stop.set()
        for t in threads:
            t.join()
    rss = [s[0] for s in samples]
    fds = [s[1] for s in samples]
    print("mixed load: %.1f min, %s" % (args.minutes, dict(sorted(tally.counts.items()))))
    print("  RSS kB first %d, max %d, last %d; open fds first %d, max %d, last %d" %
          (rss[0], max(rss), rss[-1], fds[0], max(fds), fds[-1]))
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
