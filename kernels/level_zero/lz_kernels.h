#ifndef DSV4_KERNELS_LEVEL_ZERO_LZ_KERNELS_H
#define DSV4_KERNELS_LEVEL_ZERO_LZ_KERNELS_H

/*
 * What the OpenCL C kernels (dsv4_kernels.cl) and the programs that launch them (the Level Zero
 * glue, the PoCL tests) must agree on: the work-group shape, the kernel names and the order of
 * their arguments. Included by OpenCL C and by plain C.
 *
 * dsv4_qkv_insert works on rows of 512 values: rows 0..N*H-1 are the Q heads (token t = row / H,
 * head h = row % H), rows N*H..N*H+N-1 the KV rows of the N tokens (only when write_kv is set). One
 * row is 32 work-items ("lanes"), lane l owning dims 16l..16l+15: lanes 0..27 the NoPE dims (four
 * lanes per 64-value scale tile), lanes 28..31 the 32 RoPE pairs. A work-group holds
 * DSV4_LZ_ROWS_PER_GROUP rows.
 */

#include "dsv4-layout.h"

#define DSV4_LZ_LANES 32
#define DSV4_LZ_DIMS_PER_LANE 16
#define DSV4_LZ_ROWS_PER_GROUP 8
#define DSV4_LZ_GROUP_SIZE (DSV4_LZ_LANES * DSV4_LZ_ROWS_PER_GROUP)
#define DSV4_LZ_ROPE_LANE0 (DSV4_NOPE_DIM / DSV4_LZ_DIMS_PER_LANE) /* 28 */
#define DSV4_LZ_TILE_LANES (DSV4_TILE / DSV4_LZ_DIMS_PER_LANE)     /* the lanes of one NoPE tile */
#define DSV4_LZ_MAP_GROUP_SIZE 64

/* Bits of the error word the kernels may set (the launch never writes out of bounds instead). */
#define DSV4_LZ_ERR_SEGMENT 1u  /* a token's segment index is out of range */
#define DSV4_LZ_ERR_POSITION 2u /* a negative position */
#define DSV4_LZ_ERR_BLOCK 4u    /* a block id >= n_blocks in a segment's block table */
#define DSV4_LZ_ERR_SLOT 8u     /* a slot >= n_blocks * block_size given to qkv_insert */
#define DSV4_LZ_ERR_TABLE 16u   /* a segment's block table runs past bt_entries (when given) */
/* An attention candidate's block is not in its segment's table, or its entry is < 0. */
#define DSV4_LZ_ERR_MISSING 32u

/*
 * dsv4_map_slots(n_tokens, block_size, n_blocks, positions, tok_seg, seg_first_lb, seg_bt_off,
 *                seg_bt_len, block_table, n_segments, slots, err, bt_entries [, slot_count]),
 * over max(n_tokens, n_segments) work-items
 */
#define DSV4_LZ_MAP_KERNEL "dsv4_map_slots"
#define DSV4_LZ_MAP_NARGS 13

/*
 * dsv4_qkv_insert(row0, n_rows, n_tokens, heads, write_kv, q, kv, slots, rope_rows, kv_w, fused,
 *                 eps, q_out, cache, block_size, n_blocks, stride, err [, q_count, cache_count])
 * rope_rows holds the 64 floats of each token's RoPE row ([N, 64]); row0 is the first row of this
 * launch, so that a large batch may be split into several launches.
 */
#define DSV4_LZ_INSERT_KERNEL "dsv4_qkv_insert"
#define DSV4_LZ_INSERT_NARGS 18

/*
 * Attention (SPEC §7) is two launches. dsv4_attn_check(n_tokens, n_segments, block_size, n_blocks,
 * positions, tok_seg, seg_p0, seg_first_lb, seg_bt_off, seg_bt_len, block_table, bt_entries, err),
 * over max(n_tokens, n_segments) work-items in groups of DSV4_LZ_MAP_GROUP_SIZE, checks every
 * candidate's block and sets error bits only. Then dsv4_attention(row0, n_rows, heads, q,
 * positions, tok_seg, seg_p0, seg_first_lb, seg_bt_off, block_table, cache, block_size, stride,
 * sink, has_sink, rope_rows, out, lse, want_lse, err) computes rows of 512 outputs (row = t * H +
 * h) in the thread layout of dsv4_qkv_insert, and writes nothing when the error word is not zero.
 */
#define DSV4_LZ_ATTN_CHECK_KERNEL "dsv4_attn_check"
#define DSV4_LZ_ATTN_CHECK_NARGS 13
#define DSV4_LZ_ATTN_KERNEL "dsv4_attention"
#define DSV4_LZ_ATTN_NARGS 20
/* Local memory of one dsv4_attention work-group: per row, q as fp32 and the logits and weights of
 * the window's candidates. */
#define DSV4_LZ_ATTN_LOCAL_BYTES (DSV4_LZ_ROWS_PER_GROUP * (DSV4_HEAD_DIM + 2 * DSV4_WINDOW) * 4)

/*
 * dsv4_fp_probe(in, out), one work-item (SPEC §2 on the device, see lz_probe.h): out[0] =
 * in[0] * in[1] + in[2] as written, out[1] = in[3] * in[4], out[2 + i] = the RMS factor of in[5 +
 * i] with eps = (float)1e-6, for i < DSV4_LZ_PROBE_RMS.
 */
#define DSV4_LZ_PROBE_KERNEL "dsv4_fp_probe"
#define DSV4_LZ_PROBE_RMS 64
#define DSV4_LZ_PROBE_IN (5 + DSV4_LZ_PROBE_RMS)
#define DSV4_LZ_PROBE_OUT (2 + DSV4_LZ_PROBE_RMS)

#endif /* DSV4_KERNELS_LEVEL_ZERO_LZ_KERNELS_H */
