"""What the Python binding (client/python/dsv4client.py) costs over the C library it calls: decode
batches through a shared region, one token for each of N sequences, timed three ways against one
daemon in the same run (a benchmark: it prints a table and asserts only that every answer is 200).

- ceiling: dsv4c_forward called through ctypes with its arguments built once and its result freed
  unread: what any Python caller of the library pays at least;
- prepare: Client.prepare's Forward, called with a layer; its segments are set once per position
  (at layer 0), as a gateway sets a step's segments once for all its layers;
- forward: Client.forward with every argument, its answer parsed into a dict.

Call k of a way runs layer k % L at position k / L (L = --layers, the daemon serving as many), as
shm_bench sends them; each way has sequences of its own. The ways take turns in rounds of --round
calls, so that a machine's drift falls on all three alike. The table gives p50 and p99 of each way
over --calls calls, and "over": its p50 minus the ceiling's p50 (the binding's own time).

    python3 tests/bench/py_client_bench.py <dsv4d> [--tokens 1,16,64] [--calls N] [--round R]
        [--layers L] [--spin-us S] [--threads T] [--backend B] [--kv-blocks K]
        [-- extra daemon arguments]

The library is found as dsv4client finds it ($DSV4CLIENT_LIB, or a build*/ beside the checkout).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
import dsv4client  # noqa: E402

HEAD_DIM = 512
ALIGN = 64


def align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def parse_args():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dsv4d")
    p.add_argument("--tokens", default="1,16,64", help="sequences a batch, one token each")
    p.add_argument("--calls", type=int, default=4000, help="timed calls a way and batch size")
    p.add_argument("--round", type=int, default=200, help="calls a way takes in turn")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--spin-us", type=int, default=100, help="the client polls (and the daemon's "
                   "busy_poll_us) this long for each answer")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--kv-blocks", type=int, default=4096, help="the daemon's pool (every way's "
                   "sequences of every size stay in it)")
    a = p.parse_args(argv)
    a.extra = extra
    a.tokens = [int(t) for t in a.tokens.split(",")]
    return a


def start_daemon(a, sock):
    cmd = [a.dsv4d, "--backend", a.backend, "--port", "0", "--admin-port", "0", "--threads",
           str(a.threads), "--layers", "0-%d" % (a.layers - 1), "--heads", str(a.heads),
           "--kv-blocks", str(a.kv_blocks), "--listen-shm", sock, "--busy-poll-us",
           str(a.spin_us)] + a.extra
    d = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if d.poll() is not None or time.monotonic() > deadline:
            d.kill()
            sys.exit("py_client_bench: the daemon did not open %s: %s" % (sock, " ".join(cmd)))
        time.sleep(0.02)
    return d


class Way:
    """One way of calling, over its own sequences (prefix) in the shared region."""

    def __init__(self, name, client, region, n, a, lay):
        self.name, self.c, self.r, self.n, self.a, self.lay = name, client, region, n, a, lay
        self.k, self.us = 0, []
        self.names = ["py%s%d.%d" % (name[0], n, i) for i in range(n)]
        self.segs = []
        if name == "ceiling":
            segs = dsv4client.segments([(s, 0, 1) for s in self.names])
            self.f = dsv4client._forward_args(0, segs, a.heads, lay["q"], lay["kv"], lay["out"],
                                              "q", None, None, None)
            self.res, self.fn = dsv4client.Result(), client._lib.dsv4c_forward
            self.free = client._lib.dsv4c_result_free
        elif name == "prepare":
            self.fw = client.prepare(region, a.heads, lay["q"], lay["kv"], lay["out"])

    def call(self, timed):
        layer, pos = self.k % self.a.layers, self.k // self.a.layers
        segs = None if self.name == "ceiling" else [(s, pos, 1, self.k == 0) for s in self.names]
        if self.name == "ceiling":
            arr = self.f.segs
            for i in range(self.n):
                arr[i].start, arr[i].is_new = pos, self.k == 0
            self.f.layer = layer
            t0 = time.perf_counter()
            rc = self.fn(self.c._c, self.r._h, self.f, self.res)
            t1 = time.perf_counter()
            status = self.res.status
            self.free(self.res)
        elif self.name == "prepare":
            t0 = time.perf_counter()
            if layer == 0 or self.k == 1:  # after the call that made them, not new
                self.fw.segments(segs)
            rc, status = 0, self.fw(layer).status
            t1 = time.perf_counter()
        else:
            lay = self.lay
            t0 = time.perf_counter()
            ans = self.c.forward(self.r, layer, segs, self.a.heads, lay["q"], lay["kv"],
                                 lay["out"])
            t1 = time.perf_counter()
            rc, status = 0, ans["status"]
        if rc or status != 200:
            sys.exit("py_client_bench: %s call %d answered rc %d status %d" % (self.name, self.k,
                                                                              rc, status))
        self.k += 1
        if timed:
            self.us.append((t1 - t0) * 1e6)


def pct(v, p):
    s = sorted(v)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


def run_size(a, client, n):
    heads = a.heads
    q = n * heads * HEAD_DIM * 2
    kv = n * HEAD_DIM * 2
    lay = {"q": 0, "kv": align(q)}
    q_out = align(lay["kv"] + kv)
    lay["out"] = {"q_out": q_out, "slots": align(q_out + q)}
    region = client.region(lay["out"]["slots"] + n * 8)
    try:
        buf = region.buffer
        pattern = bytes([0x80, 0x3f]) * ((lay["kv"] + kv) // 2 + 1)
        buf[:lay["kv"] + kv] = pattern[:lay["kv"] + kv]  # bf16 1.0 for q and kv
        ways = [Way(w, client, region, n, a, lay) for w in ("ceiling", "prepare", "forward")]
        for w in ways:  # the sequences' first position, and the code warm
            for _ in range(2 * a.layers):
                w.call(False)
        while len(ways[0].us) < a.calls:
            for w in ways:
                for _ in range(min(a.round, a.calls - len(w.us))):
                    w.call(True)
        return ways
    finally:
        region.destroy()


def main():
    a = parse_args()
    work = tempfile.mkdtemp(prefix="py-client-bench-")
    sock = os.path.join(work, "shm.sock")
    d = start_daemon(a, sock)
    try:
        lib = dsv4client.load_library()
        print("Python binding against its C library through ctypes: %s, backend %s, H = %d, "
              "%d layers, spin %d us (client and daemon), %d calls a way" %
              (sys.version.split()[0], a.backend, a.heads, a.layers, a.spin_us, a.calls))
        print("ceiling: dsv4c_forward with arguments built once, result unread (the least a "
              "Python caller pays)")
        print("%6s  %-8s %9s %9s %9s" % ("tokens", "way", "p50 us", "p99 us", "over us"))
        with dsv4client.Client(sock, lib=lib, spin_us=a.spin_us) as client:
            for n in a.tokens:
                ways = run_size(a, client, n)
                base = pct(ways[0].us, 50)
                for w in ways:
                    p50 = pct(w.us, 50)
                    print("%6d  %-8s %9.1f %9.1f %9.1f" % (n, w.name, p50, pct(w.us, 99),
                                                         p50 - base))
    finally:
        d.terminate()
        d.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
