#!/usr/bin/python3
"""Writes the seeds of fuzz_restore (tests/fuzz/corpus/restore) that carry the compressed branch's
state (SPEC §8.7, §8.9), for the geometry fuzz_restore's second reading expects: served layers 0
and 1, 8 heads from head 0, model "0123456789abcdef", layer 1 running the branch at ratio 4 (a
ratio-4 ring is 80 KiB; a ratio-128 one, 512 KiB, would be too long an input to fuzz). Layer 1's
tensors follow every layer's records and positions, as dsv4_dump_ctail writes them:
layers.1.c_records, layers.1.c_entries, layers.1.i_records, layers.1.ring. The SWA-only seeds
beside them are older hand-made files.

  compressed          accepted: p0 5, layer 0 written 5..8, layer 1 5..20 (entries 1..4)
  compressed-ring     accepted: layer 1 written 0..2, no entry emitted yet, only ring rows
  compressed-digest   refused: the c_digest of a valid file with one bit flipped

Usage: restore_corpus.py [out-dir]"""

import json
import os
import struct
import sys

import xxhash  # Debian's python3-xxhash

RING_FLOATS = 8 * 2048 + 8 * 512  # DSV4_RING_FLOATS(4)


def record(key):
    """A 584-byte record the insert path can write: e4m3 bytes without NaN (0x7f, 0xff), bf16 RoPE,
    seven scale codes in 105..247 and a zero pad byte."""
    nope = bytes(((key * 31 + i * 7) % 0x7e) | (0x80 if (i + key) % 3 == 0 else 0) for i in range(448))
    rope = b"".join(struct.pack("<H", 0x3f00 + ((key + i) % 256)) for i in range(64))
    codes = bytes(110 + (key + t) % 20 for t in range(7)) + b"\0"
    return nope + rope + codes


def index_record(j):
    """68 bytes: 64 bytes of e2m1 nibble pairs, then the four UE8M0 codes (1..253)."""
    return bytes((j * 13 + i * 5) & 0xFF for i in range(64)) + bytes(120 + (j + b) % 8 for b in range(4))


def framed(keys, recs):
    h = xxhash.xxh3_64()
    for k, r in zip(keys, recs):
        h.update(struct.pack("<q", k) + r)
    return h.hexdigest()


def dump(p0, next0, next1, last0, last1, corrupt=None):
    """A whole dump of layers 0 (SWA) and 1 (ratio 4): every stored position from p0 on."""
    meta = {"layout": "fp8_ds_mla", "fp8": "F8_E4M3FN", "scale": "UE8M0", "block_size": "16",
            "window": "128", "record_bytes": "584", "p0": str(p0), "seq": "s", "layers": "0-1",
            "heads": "8", "head_offset": "0", "model": "0123456789abcdef", "version": "0.1.0",
            "instance": "0" * 32}
    tensors = []
    for layer, nxt, last in ((0, next0, last0), (1, next1, last1)):
        pos = list(range(p0, nxt))
        recs = [record(100 * layer + p) for p in pos]
        meta["digest.%d" % layer] = framed(pos, recs)
        meta["next.%d" % layer] = str(nxt)
        meta["last.%d" % layer] = last
        meta["positions.%d" % layer] = "%d-%d" % (p0, nxt - 1) if pos else ""
        tensors.append(("layers.%d.records" % layer, "U8", [len(pos), 584], b"".join(recs)))
        tensors.append(("layers.%d.positions" % layer, "I64", [len(pos)],
                        b"".join(struct.pack("<q", p) for p in pos)))
    js = list(range(p0 // 4, max(p0 // 4, next1 // 4)))
    crecs = [record(1000 + j) for j in js]
    irecs = [index_record(j) for j in js]
    ring = b"".join(struct.pack("<f", ((k * 37) % 101 - 50) / 8.0) for k in range(RING_FLOATS))
    meta["c_digest.1"] = framed(js, crecs)
    meta["i_digest.1"] = framed(js, irecs)
    meta["ring_digest.1"] = xxhash.xxh3_64(ring).hexdigest()
    if corrupt:
        d = meta[corrupt]
        meta[corrupt] = d[:-1] + "%x" % (int(d[-1], 16) ^ 1)
    tensors += [("layers.1.c_records", "U8", [len(js), 584], b"".join(crecs)),
                ("layers.1.c_entries", "I64", [len(js)], b"".join(struct.pack("<q", j) for j in js)),
                ("layers.1.i_records", "U8", [len(js), 68], b"".join(irecs)),
                ("layers.1.ring", "F32", [RING_FLOATS], ring)]
    hdr, off, data = {"__metadata__": meta}, 0, b""
    for name, dtype, shape, raw in tensors:
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        data += raw
    text = json.dumps(hdr, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


SEEDS = {
    "compressed": dump(5, 9, 21, "5,4,1111111111111111", "18,3,2222222222222222"),
    "compressed-ring": dump(0, 3, 3, "0,3,1111111111111111", "0,3,2222222222222222"),
    "compressed-digest": dump(5, 9, 21, "5,4,1111111111111111", "18,3,2222222222222222",
                              corrupt="c_digest.1"),
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus", "restore")
    os.makedirs(out, exist_ok=True)
    for name, body in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(body)


if __name__ == "__main__":
    main()
