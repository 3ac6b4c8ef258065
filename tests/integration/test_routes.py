"""Every route of SPEC §6 on a live daemon: health, readiness, metrics, forward, sequences."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq, expect_error  # noqa: E402

HEADS = 8


def test_health_ready_and_instance():
    with Daemon(h.SMALL, name="a") as a, Daemon(h.SMALL, name="b") as b:
        for d in (a, b):
            for path in ("/healthz", "/readyz"):
                r = d.get(path)
                check_eq(r.status, 200, "GET %s" % path)
            # The instance is checked on every answer by the harness; here it must also stay put
            # across connections and routes.
            insts = {d.get(p).headers["dsv4d-instance"] for p in ("/healthz", "/readyz", "/metrics",
                                                                   "/v1/sequences/x", "/nope")}
            check_eq(insts, {d.instance}, "Dsv4d-Instance across routes")
        check(a.instance != b.instance, "two processes share the instance %s" % a.instance)


def test_metrics_names():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(7)
        d.forward(Batch.random(rng, 0, [Seg("m", 0, 3, True)], HEADS))
        r = d.get("/metrics")
        check_eq(r.status, 200, "GET /metrics")
        ct = r.headers.get("content-type", "")
        check(ct.startswith("text/plain"), "metrics Content-Type %r" % ct)
        ms = h.parse_metrics(r.body.decode())
        names = {k[0] for k in ms}
        missing = []  # reported at the end, after the values were checked
        for n in ("dsv4d_kv_cache_usage_ratio", "dsv4d_kv_blocks", "dsv4d_sequences",
                  "dsv4d_requests_total", "dsv4d_batch_tokens_bucket", "dsv4d_batch_tokens_sum",
                  "dsv4d_batch_tokens_count", "dsv4d_forward_seconds_bucket",
                  "dsv4d_forward_seconds_sum", "dsv4d_forward_seconds_count",
                  "dsv4d_kv_alloc_failures_total", "dsv4d_inflight_batches", "dsv4d_build_info",
                  "dsv4d_kv_block_size", "dsv4d_kv_blocks_total", "dsv4d_queued_batches",
                  "dsv4d_forward_request_seconds_bucket"):
            if n not in names:
                missing.append(n)
        used = h.metric(ms, "dsv4d_kv_blocks", pool="swa", state="used")
        free = h.metric(ms, "dsv4d_kv_blocks", pool="swa", state="free")
        check_eq(used + free, 64.0, "used + free blocks = --kv-blocks")
        # The pool's geometry, so that a router can turn free blocks into free tokens.
        check_eq(h.metric(ms, "dsv4d_kv_blocks_total", pool="swa"), 64.0, "dsv4d_kv_blocks_total = --kv-blocks")
        check_eq(h.metric(ms, "dsv4d_kv_block_size"), 64.0, "dsv4d_kv_block_size (default)")
        types = {ln.split()[2]: ln.split()[3] for ln in r.body.decode().splitlines()
                 if ln.startswith("# TYPE ")}
        for n in ("dsv4d_kv_block_size", "dsv4d_kv_blocks_total"):
            check_eq(types.get(n), "gauge", "# TYPE of %s" % n)
        check_eq(used, 1.0, "used blocks after one 3-token sequence")
        check_eq(h.metric(ms, "dsv4d_kv_cache_usage_ratio"), used / 64.0, "usage ratio")
        check_eq(h.metric(ms, "dsv4d_sequences"), 1.0, "dsv4d_sequences")
        check_eq(h.metric(ms, "dsv4d_inflight_batches"), 0.0, "dsv4d_inflight_batches when idle")
        check_eq(h.metric(ms, "dsv4d_kv_alloc_failures_total"), 0.0, "alloc failures")
        bi = [k for k in ms if k[0] in ("dsv4d_build_info", "dsv4_build_info")]
        check_eq(len(bi), 1, "one dsv4d_build_info series")
        labels = dict(bi[0][1])
        check("version" in labels and labels.get("backend") == h.BACKEND_NAME,
              "dsv4d_build_info labels %r" % labels)
        check_eq(h.metric(ms, "dsv4d_batch_tokens_count"), 1.0, "batch_tokens count")
        check_eq(h.metric(ms, "dsv4d_batch_tokens_sum"), 3.0, "batch_tokens sum")
        stages = {dict(k[1]).get("stage") for k in ms
                  if k[0] in ("dsv4d_forward_seconds_count", "dsv4_forward_seconds_count")}
        check(stages and None not in stages, "forward_seconds has a stage label: %r" % stages)
        base = {"queue", "validate", "plan", "kernel"}
        split = {"upload", "launch", "download"}
        staged = h.BACKEND_NAME != "cpu"  # every backend but the host CPU one stages in device memory
        check(base <= stages, "forward_seconds stages %r include %r" % (sorted(stages), sorted(base)))
        check_eq(split <= stages, staged,
                 "kernel split into upload/launch/download (stages %r, backend %s)"
                 % (sorted(stages), h.BACKEND_NAME))
        if staged:
            pre = {"class": "prefill"}
            part = sum(h.metric(ms, "dsv4d_forward_seconds_sum", stage=x, **pre) for x in split)
            whole = h.metric(ms, "dsv4d_forward_seconds_sum", stage="kernel", **pre)
            check(0 < part <= whole, "upload + launch + download (%g s) within kernel (%g s)"
                  % (part, whole))
        fwd = h.metric(ms, "dsv4d_requests_total", route="forward", code="200")
        check_eq(fwd, 1.0, "requests_total{route=forward,code=200}")
        # The executor's classes: a batch of one-token segments is a decode, any other a prefill.
        classes = {dict(k[1]).get("class") for k in ms if k[0] == "dsv4d_forward_seconds_count"}
        check_eq(classes, {"prefill"}, "forward_seconds classes after one 3-token batch")
        for c in ("decode", "prefill"):
            check_eq(h.metric(ms, "dsv4d_queued_batches", **{"class": c}), 0.0,
                     "dsv4d_queued_batches{class=%s} when idle" % c)
        d.forward(Batch.random(rng, 0, [Seg("m", 3, 1, False), Seg("n", 0, 1, True)], HEADS))
        msd = d.metrics()
        check_eq(h.metric(msd, "dsv4d_forward_seconds_count", stage="queue", **{"class": "decode"}),
                 1.0, "forward_seconds{stage=queue,class=decode} count after one decode batch")
        check_eq(h.metric(msd, "dsv4d_forward_seconds_count", stage="queue",
                          **{"class": "prefill"}), 1.0,
                 "forward_seconds{stage=queue,class=prefill} count unchanged by a decode batch")
        # A request's whole time in the daemon, per class: one of each, each at least its batch's
        # executor stages (queue, validate, plan, kernel: parts of it on the same clock).
        for c in ("decode", "prefill"):
            h.check_whole_time(msd, "dsv4d_forward_request_seconds", c, 1.0)
        # Counters move with the requests that follow.
        d.forward_raw(b"junk")
        ms2 = d.metrics()
        check_eq(h.metric(ms2, "dsv4d_requests_total", route="forward", code="400"), 1.0,
                 "requests_total{route=forward,code=400} after one bad request")
        check(not missing, "metrics missing from /metrics under their SPEC §6 names: %s (exported: %s)"
              % (", ".join(missing), ", ".join(sorted(n for n in names if n.startswith("dsv4")))))
    # The geometry gauges follow the configuration, not the defaults.
    with Daemon(["--kv-blocks", "40", "--block-size", "128", "--layers", "0-1", "--heads", "8",
                 "--threads", "1"], name="bs128") as d:
        ms = d.metrics()
        check_eq(h.metric(ms, "dsv4d_kv_block_size"), 128.0, "kv_block_size at --block-size 128")
        check_eq(h.metric(ms, "dsv4d_kv_blocks_total", pool="swa"), 40.0, "kv_blocks_total at --kv-blocks 40")


def test_forward_basic():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(1)
        for layer in (0, 3):  # one plain-RoPE layer, one YaRN layer
            b = Batch.random(rng, layer, [Seg("s%d" % layer, 0, 5, True)], HEADS)
            res = d.forward(b)
            check_eq(res.tensors, ["q_out", "slots"], "response tensors")
            check_eq(res.replayed, None, "replayed on a first batch")
            h.check_result(res, b, "layer %d" % layer, bs=64)
        # outputs absent: q only (this API version's default), no cache_digest.
        b = Batch.random(rng, 1, [Seg("s1", 0, 2, True)], HEADS, outputs=None)
        res = d.forward(b)
        check_eq(res.cache_digest, None, "cache_digest without outputs")
        h.check_result(res, b, "no outputs key")
        b = Batch.random(rng, 1, [Seg("s1", 2, 2)], HEADS, outputs="q")
        res = d.forward(b)
        check_eq(res.cache_digest, None, "cache_digest with outputs=q")
        h.check_result(res, b, "outputs=q")
        b = Batch.random(rng, 1, [Seg("s1", 4, 2)], HEADS, outputs="digest,q")
        res = d.forward(b)
        check(res.cache_digest is not None and len(res.cache_digest) == 16,
              "cache_digest %r is 16 hex digits" % res.cache_digest)
        h.check_result(res, b, "outputs=digest,q")


def test_sequences_get_and_delete():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(2)
        check_eq(d.seq("alpha"), None, "GET of a sequence never created")
        d.forward(Batch.random(rng, 0, [Seg("alpha", 10, 70, True)], HEADS))
        d.forward(Batch.random(rng, 2, [Seg("alpha", 10, 3)], HEADS))
        j = d.seq("alpha")
        check_eq(j["p0"], 10, "p0")
        check_eq(j["next"], {"0": 80, "1": 10, "2": 13, "3": 10}, "next per served layer")
        # Positions 10..79 live in logical blocks 0 and 1 at bs 64.
        check_eq(h.held(j), 2, "blocks held")
        d.wait_used_blocks(2)
        check_eq(d.delete_seq("alpha"), True, "Dsv4d-Existed for a live sequence")
        d.wait_used_blocks(0)
        check_eq(d.seq("alpha"), None, "GET after DELETE")
        check_eq(d.delete_seq("alpha"), False, "Dsv4d-Existed after DELETE")
        check_eq(d.delete_seq("never-made"), False, "Dsv4d-Existed for an unknown name")
        check_eq(h.metric(d.metrics(), "dsv4d_sequences"), 0.0, "dsv4d_sequences after DELETE")
        # The name is free again: "new" creates it afresh, at another p0.
        b = Batch.random(rng, 0, [Seg("alpha", 0, 4, True)], HEADS)
        h.check_result(d.forward(b), b, "recreated sequence", bs=64)
        check_eq(d.seq("alpha")["p0"], 0, "p0 of the recreated sequence")


def test_unknown_route_and_method():
    with Daemon(h.SMALL) as d:
        expect_error(d.get("/v1/nothing"), 404, "not_found")
        expect_error(d.get("/"), 404, "not_found")
        expect_error(d.get("/v1/forward"), 405, "method_not_allowed")
        expect_error(d.request("POST", "/healthz", body=b""), 405, "method_not_allowed")
        expect_error(d.request("PUT", "/v1/sequences/x", body=b"{}"), 405, "method_not_allowed")
        # An invalid sequence name in the path is a bad request, not a lookup.
        expect_error(d.get("/v1/sequences/.hidden"), 400, "bad_request")
        expect_error(d.get("/v1/sequences/" + "x" * 129), 400, "bad_request")
        expect_error(d.delete("/v1/sequences/a%20b"), 400, "bad_request")
        check_eq(d.get("/healthz").status, 200, "healthz after the errors")


if __name__ == "__main__":
    h.main([test_health_ready_and_instance, test_metrics_names, test_forward_basic,
            test_sequences_get_and_delete, test_unknown_route_and_method])
