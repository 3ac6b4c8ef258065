"""The `weights` checkpoint (SPEC §7): a safetensors file, or a HuggingFace directory with
model.safetensors.index.json and its shards, names with or without the `model.` prefix, and tensors
of dtypes the daemon never decodes beside the ones it reads (as a published shard has them). The
daemon reads each served layer's attention sink (the served heads' slice) and, for kv_norm = fused,
its kv_norm weight; a missing tensor, a wrong dtype or shape refuses the start with one log line
naming the tensor and the file. Without weights, outputs attn and lse are refused with a 400 naming
the option; a compressed layer (ratio >= 2) refuses them naming the compressed branch; fast mode on
a backend without it is refused; nothing is changed by any refusal.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 8
MODEL_HEADS = 64  # V4-Flash's num_attention_heads: attn_sink's length
LAYERS = (0, 1, 2, 3)


def sinks_for(layer):
    return (np.arange(MODEL_HEADS, dtype=np.float32) * 0.25 - 4.0 + layer).astype(np.float32)


def sink_entry(layer, prefix="", dtype="F32", shape=None):
    s = sinks_for(layer)
    if dtype == "F32":
        raw = s.astype("<f4").tobytes()
    elif dtype == "BF16":
        raw = h.f32_to_bf16(s).astype("<u2").tobytes()
    else:
        raw = s.astype("<f4").view("<i4").tobytes()
    return (prefix + "layers.%d.attn.attn_sink" % layer, dtype, shape or [MODEL_HEADS], raw)


def good_entries():
    """A checkpoint for LAYERS: the sinks, and the compressors of layers 2 (ratio 4) and 3 (128)."""
    return [sink_entry(l) for l in LAYERS] + [e for l in LAYERS for e in h.compressor_entries(l)]


def other_dtypes():
    """Tensors of dtypes only a checkpoint holds: read past, never decoded."""
    return [("layers.0.attn.wq_a.weight", "F8_E4M3", [4, 8], bytes(32)),
            ("layers.0.attn.wq_a.scale", "F8_E8M0", [4], bytes(4)),
            ("layers.0.ffn.experts.0.w1.weight", "I8", [2, 8], bytes(16)),
            ("embed.weight", "F16", [2, 4], bytes(16))]


def write_file(path, entries):
    with open(path, "wb") as f:
        f.write(h.st_encode(entries, {"format": "pt"}))


def write_sharded(directory, shards):
    """shards: {file name: entries}; writes each shard and the index mapping every name to it."""
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    for fname, entries in shards.items():
        write_file(os.path.join(directory, fname), entries)
        for e in entries:
            weight_map[e[0]] = fname
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def attn_batch(rng, layer, seq, new=True, outputs="attn", ratio=0):
    b = Batch.random(rng, layer, [Seg(seq, 0, 3, new)], HEADS, ratio=ratio)
    b.outputs = outputs
    return b


def test_sharded_directory():
    tmp = tempfile.mkdtemp(prefix="dsv4d-w-")
    d_ckpt = os.path.join(tmp, "ckpt")
    write_sharded(d_ckpt, {
        "model-00001-of-00002.safetensors": other_dtypes() + [sink_entry(0), sink_entry(2)] +
        h.compressor_entries(2),
        "model-00002-of-00002.safetensors": [sink_entry(1, "model.", "BF16"),
                                             sink_entry(3, "model.")] +
        h.compressor_entries(3, "model."),
    })
    with Daemon(h.SMALL + ["--weights", d_ckpt]) as d:
        cfg = d.admin_json("/admin/v1/config")
        opt = cfg["options"]["weights"]
        check_eq(opt["value"], d_ckpt, "/admin/v1/config shows the weights source")
        check_eq(opt["source"], "cli", "the weights option's source")
        cache = d.admin_json("/admin/v1/cache")
        att = cache.get("attention")
        check(isinstance(att, dict), "/admin/v1/cache has an attention section: %r" % (cache,))
        check_eq(att["weights"], d_ckpt, "attention.weights")
        check_eq(att["mode"], "exact", "attention.mode")
        # Layers 2 (ratio 4) and 3 (ratio 128) attend over the compressed branch too: ready where
        # the backend runs it, else refused naming it (SPEC §8).
        check(0 in att["ready_layers"] and 1 in att["ready_layers"], "SWA layers ready: %r" % att)
        rng = np.random.default_rng(3)
        for i, (layer, out) in enumerate(((2, "attn"), (3, "lse"), (3, "q,attn,lse"))):
            seq = "c%d-%d" % (layer, i)
            if layer in att["ready_layers"]:
                r = d.forward_raw(attn_batch(rng, layer, seq, outputs=out,
                                             ratio=h.flash_ratio(layer)).body())
                check_eq(r.status, 200, "layer %d serves %s: %r" % (layer, out, r))
                meta, t = h.st_decode(r.body)
                for name in out.split(","):
                    check(name.replace("q", "q_out") in t, "layer %d answers %s" % (layer, name))
                continue
            check("compressed branch" in att["not_ready"].get(str(layer), ""),
                  "layer %d not ready, naming the compressed branch: %r" % (layer, att))
            r = d.forward_raw(attn_batch(rng, layer, seq, outputs=out).body())
            e = h.expect_error(r, 400, "unsupported")
            check("compressed branch" in e["message"] and str(layer) in e["message"],
                  "layer %d refusal names the compressed branch: %r" % (layer, e))
            check(d.seq(seq) is None, "a refused batch created no sequence")
            # The same batch without attention outputs is served.
            d.forward(attn_batch(rng, layer, seq, outputs="q"))


def test_no_weights():
    rng = np.random.default_rng(4)
    with Daemon(h.SMALL) as d:
        for out in ("attn", "lse", "q,attn,digest"):
            r = d.forward_raw(attn_batch(rng, 0, "nw", outputs=out).body())
            e = h.expect_error(r, 400, "unsupported")
            check("weights" in e["message"], "the refusal names the weights option: %r" % (e,))
        check(d.seq("nw") is None, "a refused batch created no sequence")
        check_eq(d.used_blocks(), 0, "a refused batch took no block")
        att = d.admin_json("/admin/v1/cache")["attention"]
        check_eq(att["ready_layers"], [], "no layer is ready without weights")
        check_eq(att["weights"], "", "no weights source")
        d.forward(attn_batch(rng, 0, "nw", outputs="q,digest"))


def test_fast_refused_on_cpu():
    if h.BACKEND not in (None, "cpu"):
        print("fast mode on backend %s: covered by the GPU suite" % h.BACKEND)
        return
    tmp = tempfile.mkdtemp(prefix="dsv4d-w-")
    path = os.path.join(tmp, "w.safetensors")
    write_file(path, good_entries())
    rng = np.random.default_rng(5)
    with Daemon(h.SMALL + ["--weights", path]) as d:
        b = attn_batch(rng, 0, "f")
        meta = b.metadata()
        meta["attention"] = "fast"
        e = h.expect_error(d.forward_raw(b.body(meta)), 400, "unsupported")
        check("fast" in e["message"] and "cpu" in e["message"], "fast refusal: %r" % (e,))
        meta["attention"] = "quick"
        e = h.expect_error(d.forward_raw(b.body(meta)), 400, "bad_request")
        check("attention" in e["message"], "bad attention value: %r" % (e,))
        check(d.seq("f") is None, "refused batches created no sequence")
    run_refused(["--weights", path, "--attention-mode", "fast"], "fast", "attention_mode fast")


def run_refused(args, what, needle):
    """The daemon must exit with status 2 before listening, in one log line naming needle."""
    cmd = [h.DAEMON, "--host", "127.0.0.1", "--port", "0", "--admin-port", "0"]
    if h.BACKEND:
        cmd += ["--backend", h.BACKEND]
    cmd += h.SMALL + args
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=60)
    err = p.stderr.decode("utf-8", "replace")
    check(p.returncode in (1, 2), "%s: exit status %d (log %r)" % (what, p.returncode, err[-500:]))
    check("listening" not in err, "%s: the daemon must not listen" % what)
    lines = [ln for ln in err.splitlines() if needle in ln]
    check(len(lines) == 1 and json.loads(lines[0])["level"] == "error",
          "%s: one error line naming %r (log %r)" % (what, needle, err[-600:]))
    return json.loads(lines[0])


def test_refused_checkpoints():
    tmp = tempfile.mkdtemp(prefix="dsv4d-w-")
    good = good_entries()
    comp = [e for l in LAYERS for e in h.compressor_entries(l)]
    sinks = [sink_entry(l) for l in LAYERS]

    def without(name):
        return [e for e in good if e[0] != name]

    def replaced(name, entry):
        return [entry if e[0] == name else e for e in good]

    ape3 = "layers.3.attn.compressor.ape"
    cases = [
        ("layer 2's sink missing", sinks[:2] + sinks[3:] + comp, "layers.2.attn.attn_sink"),
        ("wrong dtype", sinks[:1] + [sink_entry(1, dtype="I32")] + sinks[2:] + comp,
         "layers.1.attn.attn_sink"),
        ("wrong shape", sinks[:3] + [sink_entry(3, shape=[8, 8])] + comp,
         "layers.3.attn.attn_sink"),
        # SPEC §8.2: a served compressed layer's compressor tensors are required too.
        ("layer 2's compressor ape missing", without("layers.2.attn.compressor.ape"),
         "layers.2.attn.compressor.ape"),
        ("layer 2's indexer norm missing", without("layers.2.attn.indexer.compressor.norm.weight"),
         "layers.2.attn.indexer.compressor.norm.weight"),
        ("layer 3's ape of the ratio-4 shape", replaced(ape3, (ape3, "F32", [4, 1024],
                                                               bytes(4 * 4 * 1024))), ape3),
        ("a non-finite ape", replaced(ape3, (ape3, "F32", [128, 512], np.full(
            (128, 512), np.inf, np.float32).astype("<f4").tobytes())), ape3),
    ]
    for i, (what, entries, tensor) in enumerate(cases):
        path = os.path.join(tmp, "w%d.safetensors" % i)
        write_file(path, entries)
        line = run_refused(["--weights", path], what, tensor)
        check(path in line.get("why", ""), "%s: the line names the file: %r" % (what, line))
    # A NaN sink is refused; +inf and -inf are valid sinks.
    v = sinks_for(0)
    v[HEADS - 1] = np.float32("nan")
    s = replaced("layers.0.attn.attn_sink",
                 ("layers.0.attn.attn_sink", "F32", [MODEL_HEADS], v.astype("<f4").tobytes()))
    path = os.path.join(tmp, "nan.safetensors")
    write_file(path, s)
    run_refused(["--weights", path], "NaN sink", "layers.0.attn.attn_sink")
    # A directory whose index names a shard that is not there.
    d_ckpt = os.path.join(tmp, "broken")
    write_sharded(d_ckpt, {"model-00001-of-00002.safetensors": good[:2],
                           "model-00002-of-00002.safetensors": good[2:]})
    os.remove(os.path.join(d_ckpt, "model-00002-of-00002.safetensors"))
    run_refused(["--weights", d_ckpt], "missing shard", "model-00002-of-00002.safetensors")
    # A directory without an index, and a file that is not safetensors.
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    run_refused(["--weights", empty], "no index", "model.safetensors.index.json")
    path = os.path.join(tmp, "garbage")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 1 << 40) + b"{}")
    run_refused(["--weights", path], "garbage", "garbage")


if __name__ == "__main__":
    h.main([test_sharded_directory, test_no_weights, test_fast_refused_on_cpu,
            test_refused_checkpoints])
