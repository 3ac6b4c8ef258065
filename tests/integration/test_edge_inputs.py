"""Inputs at the edges of the integer ranges and of alignment.

- A segment start near INT64_MAX is refused as position_out_of_range by the request validation, with
  nothing changed (start + len must never be formed where it can overflow: sanitizer builds catch it).
- A Dsv4d-Deadline-Ms too large for the clock, however many digits, is no deadline, not one that
  wrapped into the past.
- q and kv at odd byte offsets of the body (an odd-length header without padding) give the model's
  bytes, and the same batch sent again at even offsets is a replay of it.
"""

import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8
BS = 64
INT64_MAX = (1 << 63) - 1


def test_start_near_int64_max():
    rng = np.random.default_rng(11)
    with Daemon(h.SMALL) as d:
        ok = Batch.random(rng, 0, [Seg("keep", 0, 3, True)], HEADS)
        d.forward(ok)
        before = d.seq("keep")
        used = d.used_blocks()
        for start, n, new in ((INT64_MAX, 1, True), (INT64_MAX, 2, True), (INT64_MAX - 1, 3, False),
                              (INT64_MAX - 5, 8, True), (h.MAX_POSITION - 1, 2, True)):
            b = Batch.random(rng, 0, [Seg("huge", start, n, new)], HEADS)
            e = expect_error(d.forward_raw(b.body()), 400, "position_out_of_range")
            check("max_position_embeddings" in e["message"],
                  "start %d: refused by the request validation, message %r" % (start, e["message"]))
            # The same in the second segment of a batch whose first segment is valid.
            b = Batch.random(rng, 0, [Seg("keep", 3, 1), Seg("huge", start, n, new)], HEADS)
            expect_error(d.forward_raw(b.body()), 400, "position_out_of_range")
        check_eq(d.seq("huge"), None, "no sequence created by refused batches")
        check_eq(d.seq("keep"), before, "keep unchanged by refused batches")
        check_eq(d.used_blocks(), used, "used blocks unchanged by refused batches")
        # The last admissible position still works.
        b = Batch.random(rng, 0, [Seg("end", h.MAX_POSITION - 1, 1, True)], HEADS)
        h.check_result(d.forward(b), b, "position 2^20 - 1", bs=BS)


def test_far_deadline():
    rng = np.random.default_rng(12)
    with Daemon(h.SMALL) as d:
        # Around the largest span the clock can hold, (2^64 - 1) // 10^6 ms, and far beyond it (more
        # digits than any integer type): a deadline too far to add to the clock is no deadline.
        top = ((1 << 64) - 1) // 10**6
        for i, ms in enumerate((top, top - 1, top // 2, 10**12, top + 1, (1 << 64) - 1, 10**30)):
            b = Batch.random(rng, 0, [Seg("dl%d" % i, 0, 2, True)], HEADS)
            r = d.forward_raw(b.body(), headers={"Dsv4d-Deadline-Ms": str(ms)})
            check_eq(r.status, 200, "deadline %d ms: status (body %r)" % (ms, r.body[:200]))
        # What is not a whole number of ms: 400, nothing changes.
        for i, bad in enumerate(("-1", "1.5", "+5", "5ms", "0x10", " ")):
            b = Batch.random(rng, 0, [Seg("dlx%d" % i, 0, 2, True)], HEADS)
            expect_error(d.forward_raw(b.body(), headers={"Dsv4d-Deadline-Ms": bad}), 400,
                         "bad_request")
            check_eq(d.seq("dlx%d" % i), None, "no sequence from deadline %r" % bad)


def odd_body(batch):
    """The batch's body with an unpadded header of odd length: q and kv start at odd offsets."""
    meta = batch.metadata()
    qb = batch.q.astype("<u2").tobytes()
    kb = batch.kv.astype("<u2").tobytes()
    for pad in range(0, 16):
        meta["pad"] = "x" * pad  # unknown metadata keys are ignored
        header = {"__metadata__": meta,
                  "q": {"dtype": "BF16", "shape": list(batch.q.shape),
                        "data_offsets": [0, len(qb)]},
                  "kv": {"dtype": "BF16", "shape": list(batch.kv.shape),
                         "data_offsets": [len(qb), len(qb) + len(kb)]}}
        hj = json.dumps(header, separators=(",", ":")).encode()
        if len(hj) % 2 == 1:
            return struct.pack("<Q", len(hj)) + hj + qb + kb
    raise AssertionError("no odd header length found")


def test_odd_offsets():
    rng = np.random.default_rng(13)
    with Daemon(h.SMALL) as d:
        for layer in (0, 2):
            b = Batch.random(rng, layer, [Seg("o%d" % layer, 0, 5, True), Seg("p%d" % layer, 7, 3,
                                                                                True)], HEADS)
            body = odd_body(b)
            (hlen,) = struct.unpack_from("<Q", body, 0)
            check_eq((8 + hlen) % 2, 1, "q begins at an odd offset")
            r = d.forward_raw(body)
            check_eq(r.status, 200, "odd offsets, layer %d (body %r)" % (layer, r.body[:300]))
            res = h.ForwardResult(r, b)
            check_eq(res.replayed, None, "first send is not a replay")
            h.check_result(res, b, "odd offsets, layer %d" % layer, bs=BS)
            # The same bytes at even offsets: the replay identity hashes values, not addresses.
            again = d.forward(b)
            check_eq(again.replayed, "true", "the same batch at even offsets is a replay")
            check(np.array_equal(again.q_out, res.q_out), "replay q_out equals the first answer")
            check(np.array_equal(again.slots, res.slots), "replay slots equal the first answer")
            check_eq(again.cache_digest, res.cache_digest, "replay cache_digest")
            # And the next step at odd offsets continues the sequences.
            n = Batch.random(rng, layer, [Seg("o%d" % layer, 5, 1), Seg("p%d" % layer, 10, 1)],
                             HEADS)
            r = d.forward_raw(odd_body(n))
            check_eq(r.status, 200, "odd offsets, next step (body %r)" % r.body[:300])
            h.check_result(h.ForwardResult(r, n), n, "odd offsets, next step", bs=BS)


if __name__ == "__main__":
    h.main([test_start_near_int64_max, test_far_deadline, test_odd_offsets])
