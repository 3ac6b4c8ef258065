#!/usr/bin/python3
"""Writes the seed corpus of fuzz_forward (tests/fuzz/corpus/forward): POST /v1/forward bodies for the
fuzzer's limits (heads 2, max_batch_tokens 8, max_segments 8, layers 0-3 of which 2 runs the
compressed branch at ratio 4 and 3 at ratio 128 with 2 index heads, max_position_embeddings 65536),
a few accepted and one of each kind of refusal, and a few segments texts alone. Usage:
forward_corpus.py [out-dir]"""

import json
import os
import struct
import sys

HEADS = 2


def body(n=1, heads=HEADS, layer="0", segments=None, outputs=None, odd=False, tensors=None, meta=None,
         align=2):
    """A safetensors body whose data section starts on a multiple of align bytes (16: the F32
    tensors too, so that they are read in place); odd=True leaves it 1 byte off 2-alignment."""
    if segments is None:
        segments = [{"seq": "s0", "start": 0, "len": n, "new": True}]
    if tensors is None:
        tensors = [("q", "BF16", [n, heads, 512], 2), ("kv", "BF16", [n, 512], 2)]
    if meta is None:
        meta = {"layer": layer, "segments": segments if isinstance(segments, str) else json.dumps(segments)}
        if outputs is not None:
            meta["outputs"] = outputs
    hdr, off, data = {"__metadata__": meta}, 0, b""
    for i, (name, dtype, shape, size) in enumerate(tensors):
        nbytes = size
        for d in shape:
            nbytes *= d
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
        data += bytes([(i * 37 + j) & 0x7F for j in range(nbytes)])
    text = json.dumps(hdr, separators=(",", ":")).encode()
    want = 1 if odd else 0
    while (8 + len(text)) % (2 if odd else align) != want:
        text += b" "
    return struct.pack("<Q", len(text)) + text + data


def seg(seq, start, length, new=None):
    s = {"seq": seq, "start": start, "len": length}
    if new is not None:
        s["new"] = new
    return s


SEEDS = {
    # Accepted.
    "ok-one": body(),
    "ok-two-segs": body(3, layer="1", segments=[seg("a", 0, 2, True), seg("b.c:d-e_f", 100, 1)],
                        outputs="q,digest"),
    "ok-digest-only": body(2, layer="1", outputs=" digest ", segments=[seg("x", 5, 2, False)]),
    "ok-unaligned": body(2, layer="0", odd=True, segments=[seg("u", 0, 1), seg("v", 0, 1)]),
    "ok-c4": body(2, layer="2", segments=[seg("c", 0, 1, True), seg("d", 7, 1)],
                  tensors=[("q", "BF16", [2, HEADS, 512], 2), ("kv", "BF16", [2, 512], 2),
                           ("ckv", "F32", [2, 2048], 4), ("ikv", "F32", [2, 512], 4),
                           ("iq", "BF16", [2, 2, 128], 2), ("iw", "F32", [2, 2], 4)], align=16),
    "ok-c128-kv-first": body(3, layer="3", segments=[seg("e", 0, 3, True)],
                             tensors=[("ckv", "F32", [3, 1024], 4), ("kv", "BF16", [3, 512], 2),
                                      ("q", "BF16", [3, HEADS, 512], 2)], align=16),
    "ok-kv-first": body(1, tensors=[("kv", "BF16", [1, 512], 2), ("q", "BF16", [1, HEADS, 512], 2)]),
    "ok-max": body(8, segments=[seg("s%d" % i, 65535, 1) for i in range(8)], outputs=""),
    # Refused, one of each.
    "bad-heads": body(1, heads=8),
    "bad-n-too-big": body(9),
    "bad-unknown-tensor": body(1, tensors=[("q", "BF16", [1, HEADS, 512], 2), ("kv", "BF16", [1, 512], 2),
                                           ("x", "U8", [1], 1)]),
    "bad-missing-kv": body(1, tensors=[("q", "BF16", [1, HEADS, 512], 2)]),
    "bad-f32": body(1, tensors=[("q", "F32", [1, HEADS, 512], 4), ("kv", "BF16", [1, 512], 2)]),
    "bad-kv-dims": body(1, tensors=[("q", "BF16", [1, HEADS, 512], 2), ("kv", "BF16", [1, 2, 256], 2)]),
    "bad-no-layer": body(meta={"segments": "[]"}),
    "bad-layer-text": body(layer="0x1"),
    "bad-layer-unserved": body(layer="7"),
    "bad-attn": body(outputs="q,attn"),
    "bad-output": body(outputs="q,,digest"),
    "bad-segs-json": body(segments='[{"seq":"a",'),
    "bad-segs-object": body(segments='{"seq":"a"}'),
    "bad-segs-dup": body(segments='[{"seq":"a","seq":"b","start":0,"len":1}]'),
    "bad-segs-empty": body(segments=[]),
    "bad-segs-many": body(1, segments=[seg("s", 0, 1)] * 9),
    "bad-seg-key": body(segments=[{"seq": "a", "start": 0, "len": 1, "pos": 0}]),
    "bad-seg-name": body(segments=[seg(".hidden", 0, 1)]),
    "bad-seg-start": body(segments=[seg("a", -1, 1)]),
    "bad-seg-len": body(segments=[seg("a", 0, 0)]),
    "bad-seg-new": body(segments=[seg("a", 0, 1, "yes")]),
    "bad-seg-sum": body(2, segments=[seg("a", 0, 1)]),
    "bad-posrange": body(1, segments=[seg("a", 65536, 1)]),
    "bad-truncated": body()[:100],
    # Segments texts alone, for the two segments readers the driver compares on every input.
    "segs-plain": b'[{"seq":"a.b","start":7,"len":2,"new":true},{"len":1,"seq":"c-1:x_y","start":0}]',
    "segs-spaced": b' [ { "seq" : "a" ,\n "start" : 0 ,\t"len" : 3 , "new" : false } ]\r\n',
    "segs-escaped": b'[{"seq":"\\u0041b","start":0,"len":1}]',
    "segs-numbers": b'[{"seq":"a","start":1.0,"len":1},{"seq":"b","start":-0,"len":01}]',
}

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "corpus", "forward")
    os.makedirs(out, exist_ok=True)
    for name, b in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(b)
