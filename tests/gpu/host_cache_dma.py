"""How fast the copy engines move page-locked host memory that the CPU's cores hold in their
caches: a benchmark (prints a table, asserts nothing), the CUDA runtime's library by ctypes.

64 MiB of anonymous memory on huge pages, given to cudaHostRegister as the daemon's pool is, copied
to the device (H2D) and from it (D2H) with cudaMemcpyAsync, the median (min-max) of 8 timed copies
after 2, each right after the memory was left as the row says: cold (nobody touched it since the
last copy), or read or written by 16 or 4 threads (numpy, which releases the GIL, in equal parts),
as a batch's validation reads a request body on the host threads before the device copies it (the
daemon's cache_flush_bytes). The ceiling is the cold row of the same run; then one row of each
kind of memory cold (cudaHostAlloc, registered 4 KiB pages, registered huge pages) with both
directions at once.

    python3 tests/gpu/host_cache_dma.py

Without a device it prints "skipped".
"""

import ctypes
import ctypes.util
import glob
import mmap
import statistics
import sys
import threading

N = 64 << 20
HUGE = 2 << 20
vp = ctypes.c_void_p


def cudart():
    cands = [ctypes.util.find_library("cudart")]
    cands += sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so*"), reverse=True)
    for c in cands:
        if c:
            try:
                return ctypes.CDLL(c)
            except OSError:
                pass
    return None


class Bench:
    def __init__(self, lib):
        self.lib, self.keep = lib, []
        self.d = [vp(), vp()]
        for d in self.d:
            if lib.cudaMalloc(ctypes.byref(d), ctypes.c_size_t(N)) != 0:
                raise OSError("cudaMalloc")
        self.ev = [vp(), vp()]
        for e in self.ev:
            lib.cudaEventCreate(ctypes.byref(e))

    def registered(self, huge):
        """N bytes of mmap'd memory, registered, and a numpy view of them."""
        m = mmap.mmap(-1, N + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        a = ctypes.addressof(ctypes.c_char.from_buffer(m))
        a = (a + HUGE - 1) & ~(HUGE - 1)
        if huge:
            ctypes.CDLL(None).madvise(vp(a), ctypes.c_size_t(N), 14)  # MADV_HUGEPAGE
        ctypes.memset(a, 1, N)
        if self.lib.cudaHostRegister(vp(a), ctypes.c_size_t(N), 2) != 0:
            raise OSError("cudaHostRegister")
        self.keep.append(m)
        import numpy as np
        return a, np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(a))

    def host_alloc(self):
        p = vp()
        if self.lib.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(N), 0) != 0:
            raise OSError("cudaHostAlloc")
        return p.value, None

    def copy(self, kind, host):
        if kind == "H2D":
            return self.lib.cudaMemcpyAsync(self.d[0], vp(host), ctypes.c_size_t(N), 1, None)
        return self.lib.cudaMemcpyAsync(vp(host), self.d[1], ctypes.c_size_t(N), 2, None)

    def timed(self, queue, prep=lambda: None, reps=8):
        t = []
        for i in range(reps + 2):
            prep()
            self.lib.cudaEventRecord(self.ev[0], None)
            queue()
            self.lib.cudaEventRecord(self.ev[1], None)
            self.lib.cudaEventSynchronize(self.ev[1])
            ms = ctypes.c_float()
            self.lib.cudaEventElapsedTime(ctypes.byref(ms), self.ev[0], self.ev[1])
            if i >= 2:
                t.append(ms.value * 1e3)
        return statistics.median(t), min(t), max(t)


def threads_over(arr, k, fn):
    import numpy as np

    parts = np.array_split(arr.view(np.uint64), k)
    ts = [threading.Thread(target=fn, args=(p,)) for p in parts]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def main():
    lib = cudart()
    ndev = ctypes.c_int(0)
    if lib is None or lib.cudaGetDeviceCount(ctypes.byref(ndev)) != 0 or ndev.value == 0:
        print("skipped: no CUDA device")
        return 0
    b = Bench(lib)
    print("# host_cache_dma: 64 MiB copies, median (min-max) us of 8; ceiling: the cold row")
    print("%-28s %22s %22s" % ("memory before the copy", "H2D", "D2H"))
    hi, ai = b.registered(True)
    ho, ao = b.registered(True)
    rows = [("cold", lambda a: (lambda: None)),
            ("read by 16 threads", lambda a: (lambda: threads_over(a, 16, lambda p: p.sum()))),
            ("read by 4 threads", lambda a: (lambda: threads_over(a, 4, lambda p: p.sum()))),
            ("written by 16 threads", lambda a: (lambda: threads_over(a, 16, lambda p: p.fill(7)))),
            ("written by 4 threads", lambda a: (lambda: threads_over(a, 4, lambda p: p.fill(7))))]
    fmt = lambda r: "%7.0f (%5.0f-%5.0f)" % r
    for name, mk in rows:
        cells = []
        for kind, addr, arr in (("H2D", hi, ai), ("D2H", ho, ao)):
            cells.append(fmt(b.timed(lambda: b.copy(kind, addr), mk(arr))))
        print("%-28s %22s %22s" % (name, cells[0], cells[1]), flush=True)
    print("%-28s %22s %22s %22s" % ("cold memory of each kind", "H2D", "D2H", "both at once"))
    for name, alloc in (("cudaHostAlloc", b.host_alloc), ("registered 4 KiB pages",
                        lambda: b.registered(False)), ("registered huge pages",
                        lambda: b.registered(True))):
        i, _ = alloc()
        o, _ = alloc()
        s = vp()
        lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1)  # non-blocking: beside the default one
        both = lambda: (b.copy("H2D", i), lib.cudaMemcpyAsync(vp(o), b.d[1], ctypes.c_size_t(N), 2, s),
                        lib.cudaStreamSynchronize(s))
        print("%-28s %22s %22s %22s" % (name, fmt(b.timed(lambda: b.copy("H2D", i))),
                                       fmt(b.timed(lambda: b.copy("D2H", o))), fmt(b.timed(both))),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
