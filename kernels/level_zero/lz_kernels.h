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
/* A selected compressed entry that is not visible or not above the one before it (SPEC §8.6). */
#define DSV4_LZ_ERR_ENTRY 64u
/* A compressor state slot >= n_slots, or one slot for two segments (SPEC §8.3). */
#define DSV4_LZ_ERR_STATE 128u

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
 * sink, has_sink, rope_rows, out, lse, want_lse, err, ratio, c_cache, seg_c_first_lb, seg_cbt_off,
 * c_block_table, c_sel, c_sel_stride) computes rows of 512 outputs (row = t * H + h) in the thread
 * layout of dsv4_qkv_insert, and writes nothing when the error word is not zero. ratio 0 is an
 * SWA-only layer (the compressed arguments are not read); otherwise the window is followed by the
 * compressed entries (SPEC §8.6): every visible one (c_sel_stride 0) or the row of c_sel.
 *
 * On a compressed layer a third launch, dsv4_attn_c_check(n_tokens, n_segments, ratio, block_size,
 * c_n_blocks, c_bt_entries, positions, tok_seg, seg_p0, seg_c_first_lb, seg_cbt_off, seg_cbt_len,
 * c_block_table, c_sel, c_sel_stride, err), shaped as dsv4_attn_check and run after it, checks
 * every compressed candidate (its visibility, order and block).
 */
#define DSV4_LZ_ATTN_CHECK_KERNEL "dsv4_attn_check"
#define DSV4_LZ_ATTN_CHECK_NARGS 13
#define DSV4_LZ_ATTN_C_CHECK_KERNEL "dsv4_attn_c_check"
#define DSV4_LZ_ATTN_C_CHECK_NARGS 16
#define DSV4_LZ_ATTN_KERNEL "dsv4_attention"
#define DSV4_LZ_ATTN_NARGS 27
/* dsv4_attention takes its candidates in chunks of this many: a list longer than the window (the
 * compressed entries follow it) has its logits computed again, chunk by chunk, for the weights. */
#define DSV4_LZ_ATTN_CHUNK DSV4_WINDOW
/* Local memory of one dsv4_attention work-group: per row, q as fp32, the logits and weights of one
 * chunk of candidates, and the row's chunk count. */
#define DSV4_LZ_ATTN_LOCAL_BYTES                                                                   \
  (DSV4_LZ_ROWS_PER_GROUP * (DSV4_HEAD_DIM + 2 * DSV4_LZ_ATTN_CHUNK + 1) * 4)

/*
 * The compressor (SPEC §8.3, and the index keys of §8.5 at ratio 4) is three launches, in the
 * order of cpu_compress.c's two passes:
 *
 * dsv4_compress_check(n_tokens, n_segments, ratio, block_size, n_slots, c_n_blocks, c_bt_entries,
 * max_pos, positions, tok_seg, seg_p0, seg_slot, seg_c_first_lb, seg_cbt_off, seg_cbt_len,
 * c_block_table, seen, err), over max(n_tokens, n_segments) work-items in groups of
 * DSV4_LZ_MAP_GROUP_SIZE: everything the CPU backend refuses, as error bits. seen is zeroed device
 * scratch of n_segments + n_slots words (a segment's runs, then a slot's segments).
 *
 * dsv4_compress_emit(e0, n_emit, emit_tok, emit_rope, ratio, positions, tok_seg, seg_p0, seg_slot,
 * ckv, ikv, ring, ape, norm_w, i_ape, i_norm_w, eps, seg_c_first_lb, seg_cbt_off, c_block_table,
 * c_n_blocks, c_cache, i_cache, block_size, stride, err), one work-group of DSV4_LZ_GROUP_SIZE per
 * emission e0 + group: emission e is token emit_tok[e], and emit_rope[64 e ..] is the RoPE row of
 * its entry's first position. The host lists the emissions (the tokens with (p + 1) % ratio == 0,
 * in batch order) from the positions it reads back for the RoPE rows.
 *
 * dsv4_compress_ring(t0, n_tokens, ratio, positions, tok_seg, seg_slot, ckv, ikv, ring, ape, i_ape,
 * err), one work-group of DSV4_LZ_GROUP_SIZE per token t0 + group: the rows that stay in the ring.
 *
 * The emissions read ring rows that the ring launch overwrites, and both write nothing once the
 * error word is set, so each runs behind a barrier after the one before.
 */
#define DSV4_LZ_COMP_CHECK_KERNEL "dsv4_compress_check"
#define DSV4_LZ_COMP_CHECK_NARGS 18
#define DSV4_LZ_COMP_EMIT_KERNEL "dsv4_compress_emit"
#define DSV4_LZ_COMP_EMIT_NARGS 26
#define DSV4_LZ_COMP_RING_KERNEL "dsv4_compress_ring"
#define DSV4_LZ_COMP_RING_NARGS 12
/* The longest row list of one emission: 128 rows at ratio 128 (4 + 4 at ratio 4). */
#define DSV4_LZ_POOL_ROWS 128

/*
 * The indexer (SPEC §8.5) is two launches. dsv4_index_check(n_tokens, n_segments, topk,
 * block_size, c_n_blocks, c_bt_entries, max_pos, positions, tok_seg, seg_p0, seg_c_first_lb,
 * seg_cbt_off, seg_cbt_len, c_block_table, err), shaped as dsv4_attn_check: the blocks of every
 * visible entry of a token that scores. Then dsv4_index_select(n_tokens, topk, n_heads, w_scale,
 * positions, tok_seg, seg_p0, iq, iw, rope_rows, seg_c_first_lb, seg_cbt_off, c_block_table,
 * i_cache, block_size, sel, keys, keys_per_group, qhat, err) in G work-groups of
 * DSV4_LZ_GROUP_SIZE, group g taking the tokens g, g + G, ...: keys holds keys_per_group score keys
 * per group (at least the most entries a token sees), qhat DSV4_LZ_QHAT_FLOATS(n_heads) floats per
 * group. rope_rows holds the RoPE row of each token's position ([N, 64], as for the insert).
 */
#define DSV4_LZ_INDEX_CHECK_KERNEL "dsv4_index_check"
#define DSV4_LZ_INDEX_CHECK_NARGS 15
#define DSV4_LZ_INDEX_KERNEL "dsv4_index_select"
#define DSV4_LZ_INDEX_NARGS 20
/* A group's q^ of every head (DSV4_INDEX_DIM = 128 floats each), then the scaled weights. */
#define DSV4_LZ_QHAT_FLOATS(n_heads) ((unsigned long)(n_heads) * (128 + 1))

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
