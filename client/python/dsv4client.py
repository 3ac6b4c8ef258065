"""dsv4client: Python binding (ctypes) of libdsv4client, the same-host client of dsv4d's shared
regions (SPEC §6.1 in docs/SPEC.md).

    import numpy as np, dsv4client
    c = dsv4client.Client("/run/dsv4d/shm.sock")
    r = c.region(64 << 20)                      # a sealed memfd, mapped here and in the daemon
    q = r.array(np.uint16, (n, heads, 512), 0)  # bf16 bits, written in place
    ...
    res = c.forward(r, layer=0, segments=[("req-1", 0, n, True)], heads=heads,
                    q_off=0, kv_off=..., out={"q_out": ..., "slots": ...}, outputs="q,digest")
    q_out = r.array(np.uint16, (n, heads, 512), res["tensors"]["q_out"]["data_offsets"][0])

The library is found through $DSV4CLIENT_LIB, then next to this file's checkout build
(build*/libdsv4client.so), then by the loader (ctypes.util.find_library).
"""

import ctypes
import ctypes.util
import glob
import json
import os
import threading

__all__ = ["Client", "Forward", "Region", "Reply", "Result", "Dsv4Error", "load_library",
           "segments"]


class Result(ctypes.Structure):
    """dsv4c_result_t: the daemon's answer."""

    _fields_ = [("status", ctypes.c_int), ("code", ctypes.c_char * 48),
                ("message", ctypes.c_char * 512), ("cache_digest", ctypes.c_char * 17),
                ("attention", ctypes.c_char * 8), ("replayed", ctypes.c_int),
                ("json", ctypes.c_void_p)]


class _Segment(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_char_p), ("start", ctypes.c_int64), ("len", ctypes.c_uint32),
                ("is_new", ctypes.c_int)]


class _Forward(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_uint32), ("segs", ctypes.POINTER(_Segment)),
                ("n_segs", ctypes.c_uint32), ("heads", ctypes.c_uint32),
                ("outputs", ctypes.c_char_p), ("attention", ctypes.c_char_p),
                ("q_off", ctypes.c_size_t), ("kv_off", ctypes.c_size_t),
                ("q_out_off", ctypes.c_size_t), ("slots_off", ctypes.c_size_t),
                ("attn_off", ctypes.c_size_t), ("lse_off", ctypes.c_size_t),
                ("deadline_ms", ctypes.c_int64),
                ("ckv_width", ctypes.c_uint32), ("index_heads", ctypes.c_uint32),
                ("ckv_off", ctypes.c_size_t), ("ikv_off", ctypes.c_size_t),
                ("iq_off", ctypes.c_size_t), ("iw_off", ctypes.c_size_t),
                ("index_topk", ctypes.c_uint32), ("topk_off", ctypes.c_size_t)]


class Dsv4Error(Exception):
    """A refusal: status (the HTTP status of the same failure), code, message and the answer."""

    def __init__(self, answer):
        self.answer = answer
        self.status = answer["status"]
        err = answer.get("error", {})
        self.code, self.message = err.get("code"), err.get("message")
        super().__init__("%d %s: %s" % (self.status, self.code, self.message))


def load_library(path=None):
    here = os.path.dirname(os.path.abspath(__file__))
    cands = [path, os.environ.get("DSV4CLIENT_LIB")]
    cands += sorted(glob.glob(os.path.join(here, "..", "..", "build*", "libdsv4client.so")))
    cands.append(ctypes.util.find_library("dsv4client"))
    for c in cands:
        if c and (os.path.exists(c) or not os.path.isabs(c)):
            try:
                lib = ctypes.CDLL(c)
                break
            except OSError:
                continue
    else:
        raise OSError("libdsv4client not found (set DSV4CLIENT_LIB)")
    vp, sz, res = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(Result)
    lib.dsv4c_connect.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(vp)]
    lib.dsv4c_close.argtypes = [vp]
    lib.dsv4c_close.restype = None
    lib.dsv4c_set_spin.argtypes = [vp, ctypes.c_uint32]
    lib.dsv4c_set_spin.restype = None
    lib.dsv4c_result_free.argtypes = [res]
    lib.dsv4c_result_free.restype = None
    lib.dsv4c_region_create.argtypes = [vp, sz, ctypes.POINTER(vp), res]
    lib.dsv4c_region_data.argtypes = [vp]
    lib.dsv4c_region_data.restype = vp
    lib.dsv4c_region_size.argtypes = [vp]
    lib.dsv4c_region_size.restype = sz
    lib.dsv4c_region_id.argtypes = [vp]
    lib.dsv4c_region_id.restype = ctypes.c_uint32
    lib.dsv4c_region_destroy.argtypes = [vp, vp]
    lib.dsv4c_forward.argtypes = [vp, vp, ctypes.POINTER(_Forward), res]
    lib.dsv4c_request.argtypes = [vp, ctypes.c_char_p, ctypes.c_int, res]
    return lib


def _reply(free, res):
    """The C result read into a Reply, and freed (free: dsv4c_result_free)."""
    try:
        return Reply(res)
    finally:
        free(res)


def _answer(lib, res):
    """The answer's JSON as a dict, and the C result freed."""
    return _reply(lib.dsv4c_result_free, res).answer


def _seg_array(segs):
    """The C array of segments (seq, start, len[, new]): what Forward.segments takes, built once
    for several Forwards (a step's layers of each kind)."""
    return (_Segment * len(segs))(*[(s[0].encode(), s[1], s[2], 1 if len(s) > 3 and s[3] else 0)
                                    for s in segs])


segments = _seg_array  # public: Forward.segments takes what it makes


def _forward_args(layer, segs, heads, q_off, kv_off, out, outputs, attention, deadline_ms,
                  compressed):
    """dsv4c_forward_t of Client.forward's arguments, segs a _seg_array. A negative offset is a
    ValueError (ctypes would wrap it into a huge size_t)."""
    c = compressed or {}
    offs = [q_off, kv_off] + list(out.values()) + [v for v in c.values() if v is not None]
    if any(v < 0 for v in offs):
        raise ValueError("forward: a negative offset or width (%r)" % min(offs))
    return _Forward(layer, segs, len(segs), heads, outputs.encode(),
                    attention.encode() if attention else None, q_off, kv_off,
                    out.get("q_out", 0), out.get("slots", 0), out.get("attn", 0),
                    out.get("lse", 0), -1 if deadline_ms is None else deadline_ms,
                    c.get("ckv_width", 0), c.get("index_heads", 0), c.get("ckv", 0),
                    c.get("ikv", 0), c.get("iq", 0), c.get("iw", 0), c.get("index_topk", 0),
                    out.get("topk", 0))


class Reply:
    """A forward's answer as the C library read it (dsv4c_result_t): status, replayed,
    cache_digest and attention as attributes, and answer, the whole JSON as Client.forward returns
    it, parsed only when first read."""

    __slots__ = ("status", "replayed", "_res_digest", "_res_attention", "_text", "_answer")

    def __init__(self, res):
        self.status, self.replayed = res.status, bool(res.replayed)
        self._res_digest, self._res_attention = res.cache_digest, res.attention
        self._text = ctypes.string_at(res.json) if res.json else None
        self._answer = None

    @property
    def cache_digest(self):
        """The cache digest (outputs naming digest), else ""."""
        return self._res_digest.decode()

    @property
    def attention(self):
        """"exact" or "fast" for a forward that ran attention, else ""."""
        return self._res_attention.decode()

    @property
    def answer(self):
        if self._answer is None and self._text is not None:
            self._answer = json.loads(self._text)
        return self._answer


def _errno(rc, what):
    return OSError(-rc, "%s: %s" % (what, os.strerror(-rc)))


class Region:
    """A shared region: buffer is a writable memoryview of its bytes."""

    def __init__(self, client, handle):
        self._client, self._h = client, handle
        lib = client._lib
        self.id = lib.dsv4c_region_id(handle)
        self.size = lib.dsv4c_region_size(handle)
        self.address = lib.dsv4c_region_data(handle)
        self.buffer = memoryview((ctypes.c_ubyte * self.size).from_address(self.address)).cast("B")

    def array(self, dtype, shape, offset):
        """A numpy array over the region's bytes at offset (no copy)."""
        import numpy as np
        count = 1
        for d in shape:
            count *= d
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

    def destroy(self):
        """Unregister and unmap: every array over buffer must be gone."""
        if self._h:
            self.buffer.release()
            h, self._h = self._h, None
            with self._client._lock:  # a closed client's region is unmapped only
                rc = self._client._lib.dsv4c_region_destroy(self._client._c, h)
            if rc:
                raise _errno(rc, "unregister")


class Client:
    """One connection to the daemon's listen_shm socket; one request at a time: threads that share
    a client (or its Forwards) take turns on its lock, since the library reuses the connection's
    buffers from call to call."""

    def __init__(self, path, token=None, lib=None, spin_us=0):
        """spin_us: poll for each answer that long before sleeping (dsv4c_set_spin)."""
        self._lib = lib or load_library()
        self._lock = threading.Lock()
        self._c = ctypes.c_void_p()
        rc = self._lib.dsv4c_connect(path.encode(), token.encode() if token else None,
                                     ctypes.byref(self._c))
        if rc:
            raise _errno(rc, "connect to %s" % path)
        if spin_us:
            self._lib.dsv4c_set_spin(self._c, spin_us)

    def close(self):
        with self._lock:
            if self._c:
                self._lib.dsv4c_close(self._c)
                self._c = ctypes.c_void_p()

    def _live(self, region=None):
        """The connection's handle; ValueError when the client is closed or the region destroyed
        (the library would be handed a null handle), or the region is another client's."""
        if not self._c or (region is not None and not region._h):
            raise ValueError("the client is closed or the region destroyed")
        if region is not None and region._client is not self:
            raise ValueError("the region is another client's")
        return self._c

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def region(self, nbytes):
        """A new region of at least nbytes; Dsv4Error when the daemon refuses it."""
        h, res = ctypes.c_void_p(), Result()
        with self._lock:
            rc = self._lib.dsv4c_region_create(self._live(), nbytes, ctypes.byref(h), res)
        ans = _answer(self._lib, res)
        if rc == -71 and ans:  # EPROTO: the daemon answered with a refusal
            raise Dsv4Error(ans)
        if rc:
            raise _errno(rc, "region")
        return Region(self, h)

    def forward(self, region, layer, segments, heads, q_off, kv_off, out, outputs="q",
                attention=None, deadline_ms=None, check=True, compressed=None):
        """One batch; segments are (seq, start, len[, new]). out maps q_out, slots, attn, lse and
        topk to offsets in the region. compressed: a compressed layer's tensors (SPEC §8.2) as a
        dict of offsets in the region: ckv (with ckv_width 2048 or 1024), and at ratio 4 ikv, iq
        and iw (with index_heads) and index_topk for a topk output. Returns the answer as a dict
        (status, metadata, tensors: the outputs' header with data_offsets into the region); a
        refusal raises Dsv4Error unless check is false."""
        f = _forward_args(layer, _seg_array(segments), heads, q_off, kv_off, out, outputs,
                          attention, deadline_ms, compressed)
        res = Result()
        with self._lock:
            rc = self._lib.dsv4c_forward(self._live(region), region._h, f, res)
        if rc:
            raise _errno(rc, "forward")
        return self._checked(_answer(self._lib, res), check)

    def prepare(self, region, heads, q_off, kv_off, out, outputs="q", attention=None,
                deadline_ms=None, compressed=None):
        """A Forward: forward's arguments but the layer and the segments, built once for calls
        that repeat them."""
        return Forward(self, region, heads, q_off, kv_off, out, outputs, attention, deadline_ms,
                       compressed)

    def request(self, msg, fd=-1, check=False):
        """A raw message (a dict or JSON text) with a descriptor attached when fd >= 0."""
        text = msg if isinstance(msg, str) else json.dumps(msg, separators=(",", ":"))
        res = Result()
        with self._lock:
            rc = self._lib.dsv4c_request(self._live(), text.encode(), fd, res)
        if rc:
            raise _errno(rc, "request")
        return self._checked(_answer(self._lib, res), check)

    @staticmethod
    def _checked(ans, check):
        if check and ans["status"] != 200:
            raise Dsv4Error(ans)
        return ans


class Forward:
    """Client.forward's arguments built once (Client.prepare), for a caller that repeats them: a
    gateway's decode step sends the same segments through every layer, and its layers' tensors lie
    at the same offsets.

        fw = c.prepare(r, heads=64, q_off=0, kv_off=kv_off, out=out)
        for step in ...:
            fw.segments([("req-1", pos, 1), ("req-2", pos2, 1)])
            for layer in (0, 1):
                ...                                   # q and kv of this layer into the region
                rep = fw(layer)                       # a Reply; Dsv4Error on a refusal

    Each kind of layer takes a Forward of its own (a compressed layer's tensors, SPEC §8.2, differ
    by ratio); dsv4client.segments builds a step's segments once for all of them. One call costs
    the C library's call and the reading of its result: no arguments are built and no JSON is
    parsed unless Reply.answer is read."""

    def __init__(self, client, region, heads, q_off, kv_off, out, outputs, attention, deadline_ms,
                 compressed):
        self._fn = client._lib.dsv4c_forward
        self._free = client._lib.dsv4c_result_free
        self._client, self._region = client, region
        self._f = _forward_args(0, _seg_array([]), heads, q_off, kv_off, out, outputs, attention,
                                deadline_ms, compressed)
        self._res = Result()

    def segments(self, segs):
        """The segments of the next calls: a list of (seq, start, len[, new]), or the array
        dsv4client.segments made of one."""
        arr = segs if isinstance(segs, ctypes.Array) else _seg_array(segs)
        self._f.segs, self._f.n_segs = arr, len(arr)

    def __call__(self, layer, check=True):
        """Run the batch on layer; a refusal raises Dsv4Error unless check is false."""
        f, res, client, region = self._f, self._res, self._client, self._region
        with client._lock:
            c = client._live(region)
            f.layer = layer
            rc = self._fn(c, region._h, f, res)
            rep = _reply(self._free, res)
        if rc:
            raise _errno(rc, "forward")
        if check and rep.status != 200:
            raise Dsv4Error(rep.answer)
        return rep
