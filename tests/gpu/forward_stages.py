"""Where a forward batch's time goes, per backend: prints a table, asserts nothing beyond correct
answers (a benchmark, not a test).

For each backend named on the command line, a daemon serving one layer at 64 heads gets a prefill of
16 sequences x 64 tokens (one batch of 1024 tokens) twice: the daemon's first batch (row "prefill
1st", whose launches on a device backend also load the kernels' code) on sequences deleted after it,
then the measured one (row "prefill"); then 30 decode steps of the second prefill's 16 sequences
(16 tokens a batch), after 10 that are not measured (the first launches of a kernel load its module),
sent one after the other with no pause (every body is made first and the answers are checked after
the last, so that the daemon sees a gateway's pace, not the client's); every tenth answer's q_out is
checked against the reference model. The daemon's own
dsv4d_forward_seconds{stage} histograms give the mean time of validate, plan and kernel (on a device
backend, kernel is the uploads, both launches, the downloads and the sync, and the daemon also reports
those three parts: upload, launch, download) per batch; "client" is the
request's wall time seen over loopback HTTP. The ceiling for the kernel stage on a device is the PCIe
time of q in and q_out back, N x 64 x 1 KiB each way: at 55 GB/s (FIELD-NOTES, the H200 host's
link), and measured in the run on this host ("floor (run)": the median GPU time of a copy of those
bytes from page-locked host memory to the device and one back, through the CUDA runtime's library
by ctypes; "-" where there is none).

Then 30 more decode steps (again after 10 unmeasured ones) ask for attention alone (outputs=attn: q in, attn back, the same bytes over
PCIe as q_out), in exact mode and, on a backend that offers it, in fast mode (rows decode+attn and
decode+fast); their answers are checked for shape and mode, not values (test_attention.py does that).

    python3 tests/gpu/forward_stages.py <dsv4d> <dsv4_ref.py> cpu cuda

DSV4_STAGES_DAEMON_ARGS adds options to every daemon's command line (for instance "--threads 8
--busy-poll-us 100").
"""

import ctypes
import ctypes.util
import glob
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import dsv4_harness as h  # noqa: E402

HEADS = 64
SEQS = 16
PREFILL = 64
STEPS = 30
# Decode steps run and not measured before each measured phase: the first launches of a kernel
# variant load its module and the first copies touch cold pages, costs a serving daemon pays once.
WARM = 10
PCIE_BPS = 55e9


def cudart():
    """The CUDA runtime library through ctypes, or None where it cannot be loaded."""
    cands = [ctypes.util.find_library("cudart")]
    cands += sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so*"), reverse=True)
    for c in cands:
        if not c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


def pcie_floor_us(lib, nbytes, reps=20):
    """The median GPU time (us) of nbytes copied from page-locked host memory to the device and
    nbytes back, one after the other on the default stream (after 3 unmeasured rounds), or None
    when a CUDA call fails (no device)."""
    vp = ctypes.c_void_p
    bufs = {k: vp() for k in ("h_in", "h_out", "d_in", "d_out")}
    ev = [vp(), vp()]
    ok = all(lib.cudaHostAlloc(ctypes.byref(bufs[k]), ctypes.c_size_t(nbytes), 0) == 0
             for k in ("h_in", "h_out"))
    ok = ok and all(lib.cudaMalloc(ctypes.byref(bufs[k]), ctypes.c_size_t(nbytes)) == 0
                    for k in ("d_in", "d_out"))
    ok = ok and all(lib.cudaEventCreate(ctypes.byref(e)) == 0 for e in ev)
    times = []
    for i in range(reps + 3 if ok else 0):
        ms = ctypes.c_float()
        rc = lib.cudaEventRecord(ev[0], None)
        rc |= lib.cudaMemcpyAsync(bufs["d_in"], bufs["h_in"], ctypes.c_size_t(nbytes), 1, None)
        rc |= lib.cudaMemcpyAsync(bufs["h_out"], bufs["d_out"], ctypes.c_size_t(nbytes), 2, None)
        rc |= lib.cudaEventRecord(ev[1], None)
        rc |= lib.cudaEventSynchronize(ev[1])
        rc |= lib.cudaEventElapsedTime(ctypes.byref(ms), ev[0], ev[1])
        if rc != 0:
            times = []
            break
        if i >= 3:
            times.append(ms.value * 1e3)
    for k in ("h_in", "h_out"):
        if bufs[k].value:
            lib.cudaFreeHost(bufs[k])
    for k in ("d_in", "d_out"):
        if bufs[k].value:
            lib.cudaFree(bufs[k])
    for e in ev:
        if e.value:
            lib.cudaEventDestroy(e)
    return statistics.median(times) if times else None


def stage_sums(d):
    ms = d.metrics()
    out = {}
    for (name, labels), v in ms.items():
        lab = dict(labels)
        if name in ("dsv4d_forward_seconds_sum", "dsv4d_forward_seconds_count") and "stage" in lab:
            # The classes (decode, prefill) of one stage add up.
            key = (name.rsplit("_", 1)[1], lab["stage"])
            out[key] = out.get(key, 0) + v
    return out


def means(before, after):
    res = {}
    for stage in ("validate", "plan", "kernel", "upload", "launch", "download"):
        n = after.get(("count", stage), 0) - before.get(("count", stage), 0)
        s = after.get(("sum", stage), 0) - before.get(("sum", stage), 0)
        res[stage] = s / n * 1e6 if n else float("nan")
    return res


def write_sinks(path):
    """A checkpoint with layer 0's attention sinks (64 heads), all the daemon needs for attn."""
    sinks = np.linspace(-2.0, 2.0, HEADS).astype("<f4").tobytes()
    with open(path, "wb") as f:
        f.write(h.st_encode([("layers.0.attn.attn_sink", "F32", [HEADS], sinks)], {"format": "pt"}))


def decode_steps(d, conn, rng, backend, first, rows, mode=None):
    """WARM + STEPS decode steps of the 16 sequences from position `first`, asking for q (mode
    None) or for attn alone in `mode`. Every body is made before the first is sent and the answers
    are checked after the last: the requests follow each other at once, as a gateway's layers do,
    and the means are over the last STEPS."""
    outputs = "q" if mode is None else "attn"
    steps = []
    for step in range(WARM + STEPS):
        segs = [h.Seg("s%d" % i, first + step, 1) for i in range(SEQS)]
        b = h.Batch.random(rng, 0, segs, HEADS, outputs=outputs)
        meta = b.metadata()
        if mode is not None:
            meta["attention"] = mode
        steps.append((b, b.body(meta)))
    answers = []
    t_client = 0.0
    for step, (b, body) in enumerate(steps):
        if step == WARM:
            m0 = stage_sums(d)
        t0 = time.perf_counter()
        answers.append(d.forward_raw(body, conn=conn))
        if step >= WARM:
            t_client += time.perf_counter() - t0
    m1 = stage_sums(d)
    for step, ((b, _), r) in enumerate(zip(steps, answers)):
        what = "%s %s step %d" % (backend, mode or "decode", step)
        h.check_eq(r.status, 200, what)
        if mode is None:
            if step % 10 == 0:
                h.check_result(h.ForwardResult(r, b), b, what)
            continue
        m, t = h.st_decode(r.body)
        h.check_eq(m.get("attention"), mode, "the mode that ran")
        h.check_eq(sorted(t), ["attn", "slots"], "outputs=attn answers attn and slots")
    name = "decode" if mode is None else "decode+" + ("attn" if mode == "exact" else "fast")
    rows.append((backend, name, SEQS, t_client / STEPS * 1e6, means(m0, m1)))


def run(backend, rng, rows):
    weights = os.path.join(tempfile.mkdtemp(prefix="dsv4d-stages-"), "w.safetensors")
    write_sinks(weights)
    args = ["--backend", backend, "--layers", "0-0", "--heads", str(HEADS), "--kv-blocks", "256",
            "--max-batch-tokens", "2048", "--weights", weights]
    args += os.environ.get("DSV4_STAGES_DAEMON_ARGS", "").split()
    with h.Daemon(args, name=backend) as d:
        conn = d.conn()
        # The daemon's first prefill (sequences w*, then deleted), then the measured one (s*).
        for prefix, name in (("w", "prefill 1st"), ("s", "prefill")):
            segs = [h.Seg("%s%d" % (prefix, i), 0, PREFILL, True) for i in range(SEQS)]
            b = h.Batch.random(rng, 0, segs, HEADS, outputs="q")
            m0 = stage_sums(d)
            t0 = time.perf_counter()
            res = d.forward(b, conn=conn)
            client = (time.perf_counter() - t0) * 1e6
            h.check_result(res, b, "%s %s" % (backend, name))
            rows.append((backend, name, b.n, client, means(m0, stage_sums(d))))
        for i in range(SEQS):
            d.delete_seq("w%d" % i)
        decode_steps(d, conn, rng, backend, PREFILL, rows)
        decode_steps(d, conn, rng, backend, PREFILL + WARM + STEPS, rows, "exact")
        if backend == "cuda":  # fast mode: the cuda backend on sm_90 and newer
            decode_steps(d, conn, rng, backend, PREFILL + 2 * (WARM + STEPS), rows, "fast")
        conn.close()
        pinned_note(d, backend)


def pinned_note(d, backend):
    """One line: the pinned pool's size and the bodies and answers that did not fit in it (those
    cross PCIe from pageable memory, through the backend's staging)."""
    ms = d.metrics()
    fb = {dict(lab).get("use"): v for (name, lab), v in ms.items()
          if name == "dsv4d_pinned_pool_fallbacks_total"}
    total = sum(v for (name, _), v in ms.items() if name == "dsv4d_pinned_pool_bytes_total")
    print("# %s: pinned pool %.0f MiB, fallbacks: body %d, output %d" % (
        backend, total / 2**20, fb.get("body", 0), fb.get("output", 0)))


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    h.DAEMON, h.REF_PATH = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    rng = np.random.default_rng(7)
    rows = []
    for backend in sys.argv[3:]:
        run(backend, rng, rows)
    # The floors measured once every daemon has stopped, so that nothing else uses the link.
    lib = cudart() if any(r[0] == "cuda" for r in rows) else None
    measured = {}
    for n in sorted({r[2] for r in rows}) if lib else ():
        measured[n] = pcie_floor_us(lib, n * HEADS * 1024)
    print("%-8s %-12s %6s %10s %10s %8s %10s %10s %10s %10s %10s %12s" % (
        "backend", "batch", "tokens", "client us", "valid. us", "plan us", "kernel us", "upload us",
        "launch us", "downl. us", "PCIe floor", "floor (run)"))
    for backend, phase, n, client, st in rows:
        floor = 2.0 * n * HEADS * 1024 / PCIE_BPS * 1e6
        run_floor = measured.get(n)
        print("%-8s %-12s %6d %10.0f %10.0f %8.0f %10.0f %10.1f %10.1f %10.1f %10.0f %12s" % (
            backend, phase, n, client, st["validate"], st["plan"], st["kernel"], st["upload"],
            st["launch"], st["download"], floor,
            "-" if run_floor is None else "%.0f" % run_floor))
    print("(upload, launch, download: parts of kernel on a device backend; nan on the host CPU one)")


if __name__ == "__main__":
    main()
