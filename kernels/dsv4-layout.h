#ifndef DSV4_KERNELS_LAYOUT_H
#define DSV4_KERNELS_LAYOUT_H

/*
 * The one definition of DeepSeek V4's attention geometry and of the "fp8_ds_mla" paged cache byte
 * layout (SPEC §1, §3). Plain C, CUDA and OpenCL C all include this header, so every backend agrees
 * on every offset by construction.
 *
 * A block of bs tokens:
 *   576*o       .. 576*o+447   fp8 E4M3FN NoPE values of the token at offset o
 *   576*o+448   .. 576*o+575   64 bf16 RoPE values, little-endian
 *   576*bs + 8*o .. +6         7 UE8M0 scale codes; byte +7 is padding, written as 0
 *   584*bs      .. stride-1    padding
 *   stride = ceil(584*bs / 576) * 576
 */

#define DSV4_HEAD_DIM 512
#define DSV4_NOPE_DIM 448
#define DSV4_ROPE_DIM 64
#define DSV4_ROPE_PAIRS 32
#define DSV4_TILE 64
#define DSV4_NTILES 7
#define DSV4_TOKEN_DATA_BYTES 576 /* NoPE fp8 (448) + RoPE bf16 (128) */
#define DSV4_SCALE_BYTES 8        /* 7 UE8M0 codes + 1 pad byte */
#define DSV4_RECORD_BYTES 584     /* a logical record: NoPE | RoPE | scales */
#define DSV4_WINDOW 128
/* The first candidate of a query at position p whose sequence starts at p0 (SPEC §7): the last
 * DSV4_WINDOW positions up to p, cut at p0. */
#define DSV4_WINDOW_LO(p, p0) ((p) - (DSV4_WINDOW - 1) > (p0) ? (p) - (DSV4_WINDOW - 1) : (p0))
#define DSV4_MAX_HEADS 128
#define DSV4_MIN_BLOCK_SIZE 16
#define DSV4_MAX_BLOCK_SIZE 256
#define DSV4_ROPE_ROW_FLOATS 64 /* cos[0..31] then sin[0..31] */
/* A block size the cache layout allows: a power of two in 16..256. */
#define DSV4_BLOCK_SIZE_VALID(bs)                                                                  \
  ((bs) >= DSV4_MIN_BLOCK_SIZE && (bs) <= DSV4_MAX_BLOCK_SIZE && ((bs) & ((bs)-1)) == 0)

/* Bytes between consecutive blocks of one layer's cache. */
#define DSV4_BLOCK_STRIDE(bs)                                                                      \
  ((((unsigned long)(bs)*DSV4_RECORD_BYTES + DSV4_TOKEN_DATA_BYTES - 1) / DSV4_TOKEN_DATA_BYTES) * \
   DSV4_TOKEN_DATA_BYTES)

/* Offset inside a block of the NoPE bytes of the token at offset o (RoPE follows at +448). */
#define DSV4_TOKEN_DATA_OFFSET(o) ((unsigned long)(o)*DSV4_TOKEN_DATA_BYTES)
/* Offset inside a block of the 8 scale bytes of the token at offset o. */
#define DSV4_SCALE_OFFSET(bs, o)                                                                   \
  ((unsigned long)(bs)*DSV4_TOKEN_DATA_BYTES + (unsigned long)(o)*DSV4_SCALE_BYTES)

/*
 * The compressor rings of one layer (SPEC §8.3): the state of one sequence lives in slot
 * seg_slot[s], ring_floats floats at ring + slot * ring_floats, zero at allocation. Token position
 * p keeps its row at row p mod DSV4_RING_ROWS(ratio):
 *  - ratio 128: 128 rows of kv[512] then s[512];
 *  - ratio 4: 8 rows of kv[1024] then s[1024] (half A then half B each), then 8 index rows of
 *    kv[256] then s[256]; s is gate + ape[p mod ratio], rounded once.
 */
#define DSV4_RING_ROWS(ratio) ((ratio) == 4u ? 8u : (ratio))
#define DSV4_RING_FLOATS(ratio)                                                                    \
  ((ratio) == 4u ? 8u * 2048u + 8u * 512u : (unsigned long)(ratio)*1024u)
/* Bytes of one index record (SPEC §8.5) and of one index block of block_size records: the 64-byte
 * values of every entry, then the 4-byte UE8M0 codes of every entry. */
#define DSV4_INDEX_RECORD_BYTES 68u
#define DSV4_INDEX_BLOCK_BYTES(bs) ((unsigned long)(bs)*DSV4_INDEX_RECORD_BYTES)

#endif /* DSV4_KERNELS_LAYOUT_H */
