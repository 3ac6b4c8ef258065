"""Harness for the dsv4d integration tests.

Starts the real daemon on 127.0.0.1 port 0 in a temporary directory, reads the bound port from its
"listening" log line, talks HTTP to it, and always kills it at the end. Also holds a small strict
safetensors codec, bf16 helpers, an adapter to the independent numpy model (tests/reference) and a tiny
test runner: each test file is one ctest, run as

    /usr/bin/python3 test_x.py <path to dsv4d> <path to tests/reference/dsv4_ref.py>

Only the standard library, numpy and xxhash are used (where the xxhash module is missing, XXH3 is
called in libxxhash through ctypes).

DSV4_TEST_BACKEND=<name> starts every daemon with --backend <name> (e.g. cuda); the daemon must then
report that backend, or DSV4_TEST_BACKEND_NAME when set (a test daemon that stands one backend in
for another).
"""

import http.client
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np


def _xxhash_fallback():
    """A stand-in for the xxhash module (the two calls the reference model makes), calling XXH3_64bits
    in libxxhash.so.0 through ctypes: for an interpreter without Debian's python3-xxhash. The library
    is $DSV4_XXHASH_LIB, the one the loader finds, or one unpacked under the checkout's .devroot."""
    import ctypes
    import ctypes.util
    import glob
    import types
    here = os.path.dirname(os.path.abspath(__file__))
    cands = [os.environ.get("DSV4_XXHASH_LIB"), ctypes.util.find_library("xxhash"),
             "libxxhash.so.0"] + sorted(glob.glob(os.path.join(
                 here, "..", "..", ".devroot", "usr", "lib", "*", "libxxhash.so.0")))
    lib = None
    for c in cands:
        if not c:
            continue
        try:
            lib = ctypes.CDLL(c)
            break
        except OSError:
            continue
    if lib is None:
        raise ImportError("no xxhash module and no libxxhash.so.0 (tried %r)" % [c for c in cands if c])
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

    def xxh3_64_intdigest(data):
        data = bytes(data)
        return int(lib.XXH3_64bits(data, len(data)))

    class xxh3_64:  # noqa: N801 - the name the xxhash module gives it
        def __init__(self, data=b""):
            self._buf = bytearray(data)

        def update(self, data):
            self._buf += bytes(data)

        def intdigest(self):
            return xxh3_64_intdigest(self._buf)

        def hexdigest(self):
            return "%016x" % self.intdigest()

    mod = types.ModuleType("xxhash")
    mod.xxh3_64_intdigest = xxh3_64_intdigest
    mod.xxh3_64 = xxh3_64
    mod.FALLBACK = lib
    return mod


try:
    import xxhash  # noqa: F401 - imported here so that the reference model finds it or the stand-in
except ImportError:
    sys.modules["xxhash"] = _xxhash_fallback()

HEAD_DIM = 512
RECORD_BYTES = 584
WINDOW = 128
MAX_POSITION = 1 << 20
INSTANCE_RE = re.compile(r"^[0-9a-f]{32}$")

# Where the daemon binary and the reference model live; set by main() from the command line.
DAEMON = None
REF_PATH = None
# Generous start-up limit: sanitizer builds start slower than the 1 s of the release build.
START_TIMEOUT_S = float(os.environ.get("DSV4_IT_START_TIMEOUT", "20"))

# The backend daemons are started with (None: the daemon's default, auto) and the name they report.
BACKEND = os.environ.get("DSV4_TEST_BACKEND") or None
BACKEND_NAME = os.environ.get("DSV4_TEST_BACKEND_NAME") or BACKEND or "cpu"

# Small defaults for speed: 4 served layers (two plain RoPE, two YaRN), 8 heads, a 64-block pool.
SMALL = ["--kv-blocks", "64", "--layers", "0-3", "--heads", "8", "--threads", "1"]


class TestFailure(AssertionError):
    pass


def log_records(text):
    """The JSON objects among the daemon's log lines in text (other lines are skipped)."""
    out = []
    for ln in text.splitlines():
        try:
            j = json.loads(ln)
        except ValueError:
            continue
        if isinstance(j, dict):
            out.append(j)
    return out


def check(cond, msg):
    if not cond:
        raise TestFailure(msg)


def check_eq(got, want, what):
    if got != want:
        raise TestFailure("%s: expected %r, got %r" % (what, want, got))


# ---------------------------------------------------------------------------------------------------
# bf16 helpers. Tensors are numpy uint16 arrays holding bf16 bit patterns.


def f32_to_bf16(x):
    """Round-to-nearest-even fp32 -> bf16 bits (finite inputs)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def bf16_to_f32(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def random_bf16(rng, shape, scale=1.0):
    """Random finite bf16 values, magnitudes spread over 2^-16..2^4 times scale (a power of two), both
    signs: built from random bit fields, which is fast enough for batches of millions of values."""
    e0 = 111 + int(np.log2(scale))
    sign = rng.integers(0, 2, size=shape, dtype=np.uint16) << 15
    exp = rng.integers(e0, e0 + 20, size=shape, dtype=np.uint16) << 7
    mant = rng.integers(0, 128, size=shape, dtype=np.uint16)
    return (sign | exp | mant).astype(np.uint16)


BF16_2_59 = 0x5D00  # 2^59: the smallest magnitude the daemon must refuse
BF16_BELOW_2_59 = 0x5CFF  # the largest bf16 below 2^59: accepted
BF16_NAN = 0x7FC0
BF16_INF = 0x7F80
BF16_NEG_INF = 0xFF80


# ---------------------------------------------------------------------------------------------------
# Safetensors: a small strict codec.

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
NP_DTYPE = {"BF16": np.uint16, "F32": np.float32, "I64": np.int64, "I32": np.int32, "U8": np.uint8}


def st_encode_raw(header, data, pad=True):
    """Serialise a header object (already holding data_offsets) and a data section."""
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def st_encode(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes); metadata: dict of str -> str."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    chunks = []
    off = 0
    for name, dtype, shape, raw in tensors:
        raw = bytes(raw)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    return st_encode_raw(header, b"".join(chunks))


def st_decode(buf):
    """Strict parse. Returns (metadata dict, {name: (dtype, shape, memoryview)})."""
    check(len(buf) >= 8, "safetensors: %d bytes, shorter than the length prefix" % len(buf))
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    check(8 + hlen <= len(buf), "safetensors: header length %d beyond %d bytes" % (hlen, len(buf)))
    header = json.loads(bytes(buf[8:8 + hlen]).decode("utf-8"))
    check(isinstance(header, dict), "safetensors: header is not an object")
    data = memoryview(buf)[8 + hlen:]
    meta = header.pop("__metadata__", {})
    check(isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()),
          "safetensors: __metadata__ must map strings to strings: %r" % (meta,))
    spans = []
    out = {}
    for name, t in header.items():
        check(isinstance(t, dict) and set(t) == {"dtype", "shape", "data_offsets"},
              "safetensors: tensor %r has fields %r" % (name, t))
        dtype, shape, (b, e) = t["dtype"], t["shape"], t["data_offsets"]
        check(dtype in DTYPE_SIZE, "safetensors: unknown dtype %r" % dtype)
        n = DTYPE_SIZE[dtype]
        for d in shape:
            check(isinstance(d, int) and d >= 0, "safetensors: bad dim in %r" % (shape,))
            n *= d
        check(0 <= b <= e <= len(data), "safetensors: %r offsets %r out of range" % (name, (b, e)))
        check(e - b == n, "safetensors: %r has %d bytes for shape %r %s" % (name, e - b, shape, dtype))
        spans.append((b, e, name))
        out[name] = (dtype, shape, data[b:e])
    spans.sort()
    pos = 0
    for b, e, name in spans:
        check(b == pos, "safetensors: gap or overlap before %r (%d != %d)" % (name, b, pos))
        pos = e
    check(pos == len(data), "safetensors: %d trailing bytes" % (len(data) - pos))
    return meta, out


def st_array(tensors, name, dtype, shape):
    check(name in tensors, "response lacks tensor %r (has %r)" % (name, sorted(tensors)))
    dt, sh, raw = tensors[name]
    check_eq(dt, dtype, "dtype of %s" % name)
    check_eq(list(sh), list(shape), "shape of %s" % name)
    return np.frombuffer(bytes(raw), dtype=np.dtype(NP_DTYPE[dtype]).newbyteorder("<")).reshape(shape)


# ---------------------------------------------------------------------------------------------------
# Batches.


class Seg:
    """One segment of a forward batch."""

    def __init__(self, seq, start, n, new=False):
        self.seq, self.start, self.len, self.new = seq, start, n, new

    def to_json(self):
        d = {"seq": self.seq, "start": self.start, "len": self.len}
        if self.new:
            d["new"] = True
        return d

    def __repr__(self):
        return "Seg(%r, %d, %d%s)" % (self.seq, self.start, self.len, ", new" if self.new else "")


def flash_ratio(layer):
    """The built-in V4-Flash compress ratio of a layer: 0 for 0, 1 and the MTP layer 43, 4 for the
    even layers 2..42, 128 for the odd layers 3..41 (SPEC §8.1)."""
    if layer < 2 or layer >= 43:
        return 0
    return 4 if layer % 2 == 0 else 128


INDEX_HEADS = 64  # V4-Flash's index_n_heads


def compressor_entries(layer, prefix=""):
    """A checkpoint's compressor tensors of one layer (SPEC §8.2), deterministic small values: ape
    F32, the norm weights BF16 as the published checkpoint stores them. [] for an SWA-only layer."""
    r = flash_ratio(layer)
    if r == 0:
        return []
    coff = 2 if r == 4 else 1
    rng = np.random.default_rng(1000 + layer)
    ape = (rng.standard_normal((r, coff * HEAD_DIM)) * 0.5).astype(np.float32)
    norm = f32_to_bf16((1.0 + 0.25 * rng.standard_normal(HEAD_DIM)).astype(np.float32))
    base = prefix + "layers.%d.attn." % layer
    out = [(base + "compressor.ape", "F32", [r, coff * HEAD_DIM], ape.astype("<f4").tobytes()),
           (base + "compressor.norm.weight", "BF16", [HEAD_DIM], norm.astype("<u2").tobytes())]
    if r == 4:
        iape = (rng.standard_normal((4, 256)) * 0.5).astype(np.float32)
        inorm = f32_to_bf16((1.0 + 0.25 * rng.standard_normal(128)).astype(np.float32))
        out += [(base + "indexer.compressor.ape", "F32", [4, 256], iape.astype("<f4").tobytes()),
                (base + "indexer.compressor.norm.weight", "BF16", [128],
                 inorm.astype("<u2").tobytes())]
    return out


def compressed_tensors(rng, ratio, n, scale=1.0, index_heads=INDEX_HEADS):
    """The wire tensors of a compressed layer's batch of n tokens (SPEC §8.2), as safetensors
    entries: ckv at ratio 4 and 128; ikv, iq and iw at ratio 4."""
    if ratio == 0:
        return []
    w = 2048 if ratio == 4 else 1024
    out = [("ckv", "F32", [n, w], (rng.standard_normal((n, w)) * scale).astype("<f4").tobytes())]
    if ratio == 4:
        out += [("ikv", "F32", [n, 512],
                 (rng.standard_normal((n, 512)) * scale).astype("<f4").tobytes()),
                ("iq", "BF16", [n, index_heads, 128],
                 random_bf16(rng, (n, index_heads, 128), scale).astype("<u2").tobytes()),
                ("iw", "F32", [n, index_heads],
                 rng.standard_normal((n, index_heads)).astype("<f4").tobytes())]
    return out


class Batch:
    """A forward batch: layer, segments, q [N,H,512] and kv [N,512] as bf16 bits, and on a layer
    whose compressed branch runs its tensors (extra: safetensors entries, SPEC §8.2)."""

    def __init__(self, layer, segs, q, kv, outputs="q,digest", extra=None):
        self.layer, self.segs, self.q, self.kv, self.outputs = layer, segs, q, kv, outputs
        self.extra = list(extra or [])

    @classmethod
    def random(cls, rng, layer, segs, heads, outputs="q,digest", scale=1.0, ratio=0):
        """ratio: the layer's compressed branch when the daemon runs it (0: q and kv only)."""
        n = sum(s.len for s in segs)
        q = random_bf16(rng, (n, heads, HEAD_DIM), scale)
        kv = random_bf16(rng, (n, HEAD_DIM), scale)
        return cls(layer, segs, q, kv, outputs, compressed_tensors(rng, ratio, n))

    @property
    def n(self):
        return self.q.shape[0]

    def positions(self):
        return np.concatenate([np.arange(s.start, s.start + s.len, dtype=np.int64)
                               for s in self.segs]) if self.segs else np.zeros(0, np.int64)

    def metadata(self):
        m = {"layer": str(self.layer),
             "segments": json.dumps([s.to_json() for s in self.segs], separators=(",", ":"))}
        if self.outputs is not None:
            m["outputs"] = self.outputs
        return m

    def body(self, metadata=None):
        return st_encode([("q", "BF16", self.q.shape, self.q.astype("<u2").tobytes()),
                          ("kv", "BF16", self.kv.shape, self.kv.astype("<u2").tobytes())] +
                         self.extra, self.metadata() if metadata is None else metadata)

    def copy(self):
        return Batch(self.layer, [Seg(s.seq, s.start, s.len, s.new) for s in self.segs],
                     self.q.copy(), self.kv.copy(), self.outputs, self.extra)

    def __repr__(self):
        return "Batch(layer=%d, %r, N=%d)" % (self.layer, self.segs, self.n)


class ForwardResult:
    def __init__(self, resp, batch):
        self.resp = resp
        meta, t = st_decode(resp.body)
        self.meta = meta
        h = batch.q.shape[1]
        self.q_out = st_array(t, "q_out", "BF16", (batch.n, h, HEAD_DIM)).copy()
        self.slots = st_array(t, "slots", "I64", (batch.n,)).copy()
        self.tensors = sorted(t)
        self.cache_digest = meta.get("cache_digest")
        self.replayed = meta.get("replayed")


# ---------------------------------------------------------------------------------------------------
# HTTP.


class Response:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # lower-case name -> value
        self.body = body

    def json(self):
        try:
            return json.loads(self.body.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - a test failure, with the body shown
            raise TestFailure("response %d is not JSON (%s): %r" % (self.status, e, self.body[:300]))

    def __repr__(self):
        b = self.body[:300] if self.headers.get("content-type", "").startswith(("application/json",
                                                                                 "text/")) else \
            ("<%d bytes>" % len(self.body))
        return "Response(%d, %r)" % (self.status, b)


def read_response(sock, buf=b"", timeout=10.0, head=False):
    """Read one HTTP/1.1 response from a raw socket. Returns (Response, remaining bytes)."""
    deadline = time.monotonic() + timeout
    buf = bytearray(buf)  # appended to in place: large bodies arrive in many chunks

    def more():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TestFailure("timed out reading a response (have %r)" % buf[:200])
        sock.settimeout(left)
        c = sock.recv(1 << 20)
        if not c:
            raise ConnectionError("connection closed by the daemon (have %r)" % buf[:200])
        return c

    while b"\r\n\r\n" not in buf:
        buf += more()
    hdr, rest = bytes(buf).split(b"\r\n\r\n", 1)
    buf = bytearray(rest)
    lines = hdr.decode("latin-1").split("\r\n")
    m = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
    check(m is not None, "bad status line %r" % lines[0])
    status = int(m.group(1))
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    if head or status in (204, 304) or 100 <= status < 200:
        return Response(status, headers, b""), bytes(buf)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            while b"\r\n" not in buf:
                buf += more()
            i = buf.index(b"\r\n")
            size = int(bytes(buf[:i]).split(b";")[0], 16)
            del buf[:i + 2]
            while len(buf) < size + 2:
                buf += more()
            body += bytes(buf[:size])
            del buf[:size + 2]
            if size == 0:
                break
        return Response(status, headers, body), bytes(buf)
    check("content-length" in headers, "response %d without Content-Length: %r" % (status, headers))
    n = int(headers["content-length"])
    while len(buf) < n:
        buf += more()
    return Response(status, headers, bytes(buf[:n])), bytes(buf[n:])


def raw_request(method, path, body=b"", headers=None):
    h = {"Host": "127.0.0.1"}
    if body or method == "POST":
        h["Content-Length"] = str(len(body))
        h["Content-Type"] = "application/octet-stream"
    h.update(headers or {})
    lines = ["%s %s HTTP/1.1" % (method, path)] + ["%s: %s" % kv for kv in h.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_metrics(text):
    """Prometheus text -> {(name, frozenset(labels.items())): value}."""
    out = {}
    for ln in text.splitlines():
        if not ln or ln.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\d+)?$', ln)
        check(m is not None, "bad metrics line %r" % ln)
        labels = {}
        if m.group(3):
            for lm in re.finditer(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3)):
                labels[lm.group(1)] = lm.group(2)
        v = m.group(4)
        out[(m.group(1), frozenset(labels.items()))] = float(v)
    return out


_warned = set()


def check_whole_time(ms, family, cls, count):
    """family{class=cls}, a histogram of forwards' whole time in the daemon: count observations,
    their sum at least the executor stages (queue, validate, plan, kernel) of the class's batches,
    which are parts of it on the same clock (the daemon must have run no other forwards)."""
    cl = {"class": cls}
    check_eq(metric(ms, family + "_count", **cl), count, "%s{class=%s} count" % (family, cls))
    whole = metric(ms, family + "_sum", **cl)
    parts = sum(metric(ms, "dsv4d_forward_seconds_sum", stage=x, **cl)
                for x in ("queue", "validate", "plan", "kernel"))
    check(0 < parts <= whole, "%s{class=%s} sum %g s holds its stages' %g s" % (family, cls, whole,
                                                                              parts))


def metric(ms, name, **labels):
    """One sample by its SPEC §6 name. test_routes pins the names; elsewhere a sample exported under
    the prefix dsv4_ instead of dsv4d_ is read (with a warning), so that the block and sequence
    accounting is still checked when only the names deviate."""
    key = (name, frozenset(labels.items()))
    if key not in ms and name.startswith("dsv4d_"):
        alt = ("dsv4_" + name[len("dsv4d_"):], key[1])
        if alt in ms:
            if name not in _warned:
                _warned.add(name)
                print("WARNING: metric %s is exported as %s (SPEC §6 names it %s)" %
                      (name, alt[0], name), flush=True)
            return ms[alt]
    check(key in ms, "metric %s%r missing" % (name, labels))
    return ms[key]


# ---------------------------------------------------------------------------------------------------
# The daemon.

_live = []  # every daemon started by the current test, for the failure report and the cleanup


class Daemon:
    def __init__(self, args=(), env=None, name="dsv4d"):
        self.args = list(args)
        self.env = env
        self.name = name
        self.proc = None
        self.port = None
        self.admin_port = None  # the admin listener's port, from its "listening" line
        self._admin_ready = threading.Event()
        self.instance = None
        self.lines = []
        self.startup_s = None
        self._ready = threading.Event()
        self.tmp = None

    # -- life cycle

    def start(self):
        self.tmp = tempfile.mkdtemp(prefix="dsv4d-it-")
        env = dict(os.environ)
        env.update(self.env or {})
        # The admin plane also gets an ephemeral port, so that daemons run side by side.
        cmd = [DAEMON, "--host", "127.0.0.1", "--port", "0", "--admin-port", "0"]
        if BACKEND:
            cmd += ["--backend", BACKEND]  # before the test's own arguments, which may override it
        cmd += self.args
        self.cmd = cmd
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=self.tmp, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _live.append(self)
        self._t0 = t0
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        self._out_reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._out_reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or self.port is None:
            rc = self.wait(1)
            if rc is not None:
                raise TestFailure("%s exited with status %d before listening: %s" %
                                  (self.name, rc, " ".join(cmd)))
            raise TestFailure("%s did not log its listening line within %.0f s: %s" %
                              (self.name, START_TIMEOUT_S, " ".join(cmd)))
        r = self.get("/healthz")
        check_eq(r.status, 200, "GET /healthz after start")
        self.instance = r.headers.get("dsv4d-instance")
        return self

    def _read_stderr(self):
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            if self.port is None or self.admin_port is None:
                try:
                    j = json.loads(line)
                except ValueError:
                    continue
                if isinstance(j, dict) and j.get("msg") == "listening" and \
                        j.get("listener", "data") == "data" and isinstance(j.get("port"), int):
                    self.startup_s = time.monotonic() - self._t0
                    self.port = j["port"]
                    self._ready.set()
                elif isinstance(j, dict) and j.get("msg") == "listening" and \
                        j.get("listener") == "admin" and isinstance(j.get("port"), int):
                    self.admin_port = j["port"]
                    self._admin_ready.set()
        self._ready.set()
        self._admin_ready.set()

    def _read_stdout(self):
        for raw in self.proc.stdout:
            self.lines.append("[stdout] " + raw.decode("utf-8", "replace").rstrip("\n"))

    def signal(self, sig):
        self.proc.send_signal(sig)

    def wait(self, timeout):
        """The exit status, or None after timeout seconds. Once the process has exited, the
        reader threads have taken in everything it wrote, so self.lines is complete."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in (getattr(self, "_reader", None), getattr(self, "_out_reader", None)):
            if t is not None:
                t.join(10)
        return rc

    def stop(self, timeout=10.0):
        """SIGTERM, wait for exit; returns the exit status (kills and fails on a hang)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.wait(timeout)
        if rc is None:
            self.kill()
            raise TestFailure("%s did not exit within %.0f s of SIGTERM" % (self.name, timeout))
        self._reader.join(2)
        return rc

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def log_tail(self, n=60):
        return "\n".join(self.lines[-n:])

    def __enter__(self):
        return self.start()

    def __exit__(self, etype, *exc):
        """After a passing block the daemon must shut down cleanly on SIGTERM: exit 0, and no
        sanitizer report (leaks are reported at exit) in its log."""
        if etype is not None or self.proc is None:
            self.kill()
            return False
        try:
            rc = self.stop()
            check_eq(rc, 0, "%s: exit status after SIGTERM" % self.name)
            self.check_log_clean()
        finally:
            self.kill()
        return False

    def check_log_clean(self):
        bad = [ln for ln in self.lines if "runtime error:" in ln or "Sanitizer" in ln]
        check(not bad, "%s: sanitizer report in the log: %s" % (self.name, "\n".join(bad[:5])))

    # -- requests

    def conn(self, timeout=30.0):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def _check_instance(self, headers, what):
        inst = headers.get("dsv4d-instance")
        check(inst is not None and INSTANCE_RE.match(inst),
              "%s: Dsv4d-Instance header %r is not 32 hex digits" % (what, inst))
        if self.instance is not None:
            check_eq(inst, self.instance, "%s: Dsv4d-Instance stable for one process" % what)

    def request(self, method, path, body=None, headers=None, conn=None, admin=False):
        """One request on the data listener (or the admin one), checking Dsv4d-Instance."""
        own = conn is None
        c = conn or (self.admin_conn() if admin else self.conn())
        h = dict(headers or {})
        if body is not None:
            h.setdefault("Content-Type", "application/octet-stream")
        try:
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            data = r.read()
            resp = Response(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
        finally:
            if own:
                c.close()
        self._check_instance(resp.headers, "%s %s" % (method, path))
        return resp

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    # -- the admin plane (its own listener)

    def admin_conn(self, timeout=30.0):
        self._admin_ready.wait(START_TIMEOUT_S)
        check(self.admin_port is not None, "%s logged no admin listening line" % self.name)
        return http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=timeout)

    def admin(self, path, token=None, method="GET", headers=None, conn=None):
        """One admin request (Authorization: Bearer token when given): the Response."""
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = "Bearer " + token
        return self.request(method, path, headers=h, conn=conn, admin=True)

    def admin_json(self, path, token=None):
        """An admin GET that must answer 200 JSON carrying this daemon's instance."""
        r = self.admin(path, token=token)
        check_eq(r.status, 200, "admin GET %s (body %r)" % (path, r.body[:300]))
        j = r.json()
        check_eq(j.get("instance"), self.instance, "instance in admin GET %s" % path)
        return j

    def admin_log(self, until=None, timeout=10.0):
        """The audit lines ({"msg": "admin", ...}) logged so far. With until (a predicate on that
        list), waits up to timeout seconds for it to hold: the daemon's log reaches this process
        through a pipe and a reader thread, a little after the answer it describes."""
        deadline = time.monotonic() + timeout
        while True:
            out = []
            for ln in list(self.lines):
                try:
                    j = json.loads(ln)
                except ValueError:
                    continue
                if isinstance(j, dict) and j.get("msg") == "admin":
                    out.append(j)
            if until is None or until(out) or time.monotonic() >= deadline:
                return out
            time.sleep(0.02)

    def wait_lines(self, select, count=1, timeout=10.0):
        """The log lines select(line) keeps, once there are at least count of them or timeout
        seconds have passed: a line reaches this process through a pipe and a reader thread, a
        little after what it describes."""
        deadline = time.monotonic() + timeout
        while True:
            out = [ln for ln in list(self.lines) if select(ln)]
            if len(out) >= count or time.monotonic() >= deadline:
                return out
            time.sleep(0.02)

    def delete(self, path, **kw):
        return self.request("DELETE", path, **kw)

    def post(self, path, body, **kw):
        return self.request("POST", path, body=body, **kw)

    def forward_raw(self, body, headers=None, conn=None):
        return self.post("/v1/forward", body, headers=headers, conn=conn)

    def forward(self, batch, headers=None, conn=None):
        """A batch that must succeed: returns its ForwardResult."""
        r = self.forward_raw(batch.body(), headers=headers, conn=conn)
        if r.status != 200:
            raise TestFailure("%s: POST /v1/forward %r: expected 200, got %d %r" %
                              (self.name, batch, r.status, r.body[:500]))
        check(r.headers.get("content-type", "").startswith("application/octet-stream"),
              "forward answer Content-Type %r" % r.headers.get("content-type"))
        return ForwardResult(r, batch)

    def seq(self, name):
        """GET /v1/sequences/{name}: the JSON document, or None for 404."""
        r = self.get("/v1/sequences/" + name)
        if r.status == 404:
            err = expect_error(r, 404, "unknown_sequence")
            check_eq(err.get("instance"), self.instance, "instance in the 404 of GET sequence")
            return None
        check_eq(r.status, 200, "GET /v1/sequences/%s status (body %r)" % (name, r.body[:300]))
        j = r.json()
        check_eq(j.get("instance"), self.instance, "instance in GET /v1/sequences/%s" % name)
        return j

    def delete_seq(self, name):
        r = self.delete("/v1/sequences/" + name)
        check_eq(r.status, 204, "DELETE /v1/sequences/%s status" % name)
        check_eq(r.body, b"", "DELETE body")
        ex = r.headers.get("dsv4d-existed")
        check(ex in ("0", "1"), "Dsv4d-Existed header %r" % ex)
        return ex == "1"

    def metrics(self):
        r = self.get("/metrics")
        check_eq(r.status, 200, "GET /metrics")
        return parse_metrics(r.body.decode("utf-8"))

    def used_blocks(self):
        return int(metric(self.metrics(), "dsv4d_kv_blocks", pool="swa", state="used"))

    def wait_used_blocks(self, want, timeout=2.0):
        """The used-block gauge may be published a moment after the answer: poll briefly."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.used_blocks()
            if got == want or time.monotonic() > deadline:
                check_eq(got, want, "dsv4d_kv_blocks{pool=\"swa\",state=\"used\"}")
                return got
            time.sleep(0.02)


def write_token_file(directory, token, mode=0o600, name="admin.token"):
    """A bearer token file with the given mode; returns its path."""
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(token + "\n")
    os.chmod(path, mode)
    return path


def parse_dump(buf):
    """A GET /admin/v1/dump file: (metadata, {layer: (positions int64 [T], records uint8 [T, 584])}).
    Checks the tensor names, dtypes and shapes and that they come by layer, records first."""
    meta, t = st_decode(buf)
    layers = {}
    order = []
    for name in t:
        m = re.match(r"^layers\.(\d+)\.(records|positions)$", name)
        check(m is not None, "dump: unexpected tensor %r" % name)
        order.append((int(m.group(1)), 0 if m.group(2) == "records" else 1))
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    hdr = json.loads(bytes(buf[8:8 + hlen]).decode())
    # In header order (empty tensors share an offset with their neighbour), with offsets rising.
    names = [k for k in hdr if k != "__metadata__"]
    offs = [hdr[k]["data_offsets"] for k in names]
    check(all(a[1] == b[0] for a, b in zip(offs, offs[1:])), "dump: tensors back to back %r" % offs)
    got = [(int(k.split(".")[1]), 0 if k.endswith("records") else 1) for k in names]
    check_eq(got, sorted(order), "dump: tensors ordered by layer, records before positions")
    for layer in sorted({x[0] for x in order}):
        dt, shape, _ = t["layers.%d.records" % layer]
        n = shape[0]
        recs = st_array(t, "layers.%d.records" % layer, "U8", (n, RECORD_BYTES))
        pos = st_array(t, "layers.%d.positions" % layer, "I64", (n,))
        layers[layer] = (pos, recs)
    return meta, layers


def expect_error(resp, status, code):
    """Checks an error answer: status, JSON body {"error": {"code", "message", ...}}; returns the object."""
    if resp.status != status:
        raise TestFailure("expected %d %s, got %d %r" % (status, code, resp.status, resp.body[:500]))
    ct = resp.headers.get("content-type", "")
    check(ct.startswith("application/json"), "error %d Content-Type %r" % (status, ct))
    j = resp.json()
    check(isinstance(j, dict) and isinstance(j.get("error"), dict), "error body shape: %r" % (j,))
    e = j["error"]
    check_eq(e.get("code"), code, "error code (message %r)" % e.get("message"))
    check(isinstance(e.get("message"), str) and e["message"], "error message: %r" % (e,))
    if status == 503:
        check("retry-after" in resp.headers, "503 %s without Retry-After" % code)
    return e


def held(j):
    """Blocks a sequence holds, from GET /v1/sequences: a count, or a list of ids (-1 = hole)."""
    b = j.get("blocks")
    if isinstance(b, list):
        return sum(1 for x in b if x is not None and x >= 0)
    check(isinstance(b, int) and not isinstance(b, bool), "blocks field %r" % (b,))
    return b


def find_values(obj, key):
    """Every value stored under key anywhere inside a JSON object."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                out.append(v)
            out.extend(find_values(v, key))
    elif isinstance(obj, list):
        for v in obj:
            out.extend(find_values(v, key))
    return out


# ---------------------------------------------------------------------------------------------------
# The independent model (tests/reference/dsv4_ref.py), imported by path.

_model = None


def model():
    global _model
    if _model is None:
        check(REF_PATH and os.path.exists(REF_PATH), "reference model not found at %r" % REF_PATH)
        spec = importlib.util.spec_from_file_location("dsv4_ref", REF_PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dsv4_ref"] = mod
        spec.loader.exec_module(mod)
        _model = Model(mod)
    return _model


def rope_kind(layer):
    """RoPE of a layer of the built-in V4-Flash geometry: compress ratio 0 for layers 0, 1 and the MTP
    layer 43 (plain), 4 or 128 for layers 2..42 (YaRN)."""
    return "yarn" if 2 <= layer <= 42 else "plain"


class Model:
    """Expected q_out bytes, records and digests for a batch, from the reference model."""

    def __init__(self, mod):
        self.mod = mod
        self._inv = {}

    def _rows(self, batch):
        kind = rope_kind(batch.layer)
        if kind not in self._inv:
            self._inv[kind] = self.mod.inv_freq(kind)
        return self.mod.rope_rows(self._inv[kind], batch.positions())

    def q_out(self, batch):
        return self.mod.q_path(batch.q, self._rows(batch))

    def records(self, batch):
        return self.mod.kv_records(batch.kv, self._rows(batch))

    def cache_digest(self, batch):
        return self.mod.records_digest(batch.positions(), self.records(batch))


def check_result(res, batch, what, bs=None):
    """q_out and cache_digest of a non-replayed answer against the model; slots against the mapper."""
    m = model()
    want_q = m.q_out(batch)
    if not np.array_equal(res.q_out, want_q):
        diff = np.argwhere(res.q_out != want_q)
        t, h, d = diff[0]
        raise TestFailure("%s: q_out differs from the model at %d of %d values; first at token %d "
                          "head %d dim %d: got 0x%04x, want 0x%04x" %
                          (what, len(diff), want_q.size, t, h, d, res.q_out[t, h, d],
                           want_q[t, h, d]))
    if batch.outputs and "digest" in batch.outputs.split(","):
        check_eq(res.cache_digest, m.cache_digest(batch), "%s: cache_digest" % what)
    if bs is not None:
        check_slots(res.slots, batch, bs, what)


def check_slots(slots, batch, bs, what):
    """Slots are >= 0, unique, at offset pos % bs, and one block id per logical block of a sequence."""
    pos = batch.positions()
    check(bool(np.all(slots >= 0)), "%s: negative slot in %r" % (what, slots.tolist()))
    check_eq(len(set(slots.tolist())), len(slots), "%s: unique slots" % what)
    check(bool(np.all(slots % bs == pos % bs)), "%s: slot offsets %r vs positions %r" %
          (what, (slots % bs).tolist(), pos.tolist()))
    i = 0
    for s in batch.segs:
        ids = {}
        for p in range(s.start, s.start + s.len):
            ids.setdefault(p // bs, set()).add(int(slots[i]) // bs)
            i += 1
        for lb, b in ids.items():
            check_eq(len(b), 1, "%s: block ids of logical block %d of %s" % (what, lb, s.seq))


# ---------------------------------------------------------------------------------------------------
# Raw sockets.


def connect(d, timeout=10.0):
    s = socket.create_connection(("127.0.0.1", d.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def wait_ready(d, timeout=20.0):
    """Polls /readyz until 200; meanwhile only 503 "restoring" (the snapshot directory being read)
    is accepted."""
    deadline = time.monotonic() + timeout
    while True:
        r = d.get("/readyz")
        if r.status == 200:
            return
        check(r.json().get("reason") in ("restoring", None), "readyz while starting: %r" % r.body)
        check(time.monotonic() < deadline, "%s not ready within %.0f s" % (d.name, timeout))
        time.sleep(0.02)


def wait_closed(sock, timeout):
    """True when the peer closes (EOF or reset) within timeout; drains anything sent before."""
    deadline = time.monotonic() + timeout
    got = b""
    while time.monotonic() < deadline:
        r, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        try:
            c = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return True, got
        if not c:
            return True, got
        got += c
    return False, got


# ---------------------------------------------------------------------------------------------------
# Runner.


def main(tests):
    """Run the test functions given (in order); print each result; exit 1 when any failed."""
    global DAEMON, REF_PATH
    if len(sys.argv) < 3:
        print("usage: %s <dsv4d> <dsv4_ref.py> [test name filter]" % sys.argv[0])
        sys.exit(2)
    DAEMON, REF_PATH = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    flt = sys.argv[3] if len(sys.argv) > 3 else None
    check(os.access(DAEMON, os.X_OK), "daemon binary %s not executable" % DAEMON)
    failed = []
    t_all = time.monotonic()
    for fn in tests:
        if flt and flt not in fn.__name__:
            continue
        del _live[:]
        t0 = time.monotonic()
        try:
            fn()
            print("PASS %-48s %6.2f s" % (fn.__name__, time.monotonic() - t0), flush=True)
        except Exception:  # noqa: BLE001 - report every failure and go on with the next test
            failed.append(fn.__name__)
            print("FAIL %-48s %6.2f s" % (fn.__name__, time.monotonic() - t0), flush=True)
            traceback.print_exc(file=sys.stdout)
            for d in _live:
                print("---- %s (%s) log, last lines:" % (d.name, " ".join(getattr(d, "cmd", []))))
                print(d.log_tail())
            sys.stdout.flush()
        finally:
            for d in _live:
                d.kill()
    print("%d tests, %d failed (%.1f s)%s" % (len(tests), len(failed), time.monotonic() - t_all,
                                              (": " + ", ".join(failed)) if failed else ""))
    sys.exit(1 if failed else 0)
