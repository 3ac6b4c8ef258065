"""Batches that overlap on the device (dsv4_engine_forward_begin/end, a backend with
DSV4_BE_OVERLAP): several clients send prefills and decode steps of their own sequences at once,
without the digest, so the executor begins one batch while the one before is in flight. Every
answer is the model's, the slots are the mapper's, and a final batch of each sequence with the
digest (which runs alone) shows the cache holds what the batches wrote. On the staged backend in
overlap mode the backend's count of overlapped batches must be non-zero; elsewhere the answers
alone are checked."""

import os
import sys
import tempfile
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 8
BS = 64
CLIENTS = 4
STEPS = 12


def test_concurrent_batches_overlap():
    """CLIENTS clients, each a 30-token prefill then STEPS decode steps on layer 0, all at once;
    then each sequence's next step with the digest."""
    stats = os.path.join(tempfile.mkdtemp(prefix="dsv4d-overlap-"), "stats")
    with Daemon(h.SMALL, env={"DSV4_TEST_STAGED_STATS": stats}) as d:
        results, errors = {}, []

        def client(i):
            try:
                rng = np.random.default_rng(200 + i)
                seq = "o%d" % i
                for k in range(STEPS + 1):
                    n = 30 if k == 0 else 1
                    p0 = 0 if k == 0 else 30 + k - 1
                    b = Batch.random(rng, 0, [Seg(seq, p0, n, k == 0)], HEADS, outputs="q")
                    results[(i, k)] = (b, d.forward(b))
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        check(not errors, "concurrent clients: %r" % errors[:1])
        check_eq(len(results), CLIENTS * (STEPS + 1), "answers")
        for (i, k), (b, res) in sorted(results.items()):
            h.check_result(res, b, "client %d batch %d" % (i, k), bs=BS)
        rng = np.random.default_rng(300)
        for i in range(CLIENTS):
            b = Batch.random(rng, 0, [Seg("o%d" % i, 30 + STEPS, 1)], HEADS)
            h.check_result(d.forward(b), b, "o%d's step with the digest" % i, bs=BS)
        check_eq(d.stop(), 0, "exit status after SIGTERM")
    if h.BACKEND_NAME == "cpu_staged_overlap":
        with open(stats) as f:
            n = int(f.read().split()[-1])
        print("batches that overlapped another: %d" % n)
        check(n > 0, "no batch overlapped another (the executor never began one beside another)")


if __name__ == "__main__":
    h.main([test_concurrent_batches_overlap])
