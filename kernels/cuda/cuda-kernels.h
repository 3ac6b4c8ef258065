#ifndef DSV4_KERNELS_CUDA_CUDA_KERNELS_H
#define DSV4_KERNELS_CUDA_CUDA_KERNELS_H

/*
 * The CUDA kernels of the backend (the .cu files of kernels/cuda) behind C-callable launch
 * wrappers, for the host glue (cuda_backend.c) and the GPU tests. The wrappers enqueue work on a
 * stream and return; they never synchronise and never read device memory.
 *
 * Device memory. Every pointer inside the argument structs is a device address from cudaMalloc
 * (never managed memory, never a host pointer), valid until the stream has run the launch:
 *
 *   dsv4_map_args_t (producer, SPEC §4 slot mapper):
 *     positions [n_tokens] int64, tok_seg [n_tokens] int32, seg_first_lb [n_segments] int64,
 *     seg_bt_off / seg_bt_len [n_segments] uint32, block_table [bt_entries] int32 (when
 *     bt_entries is 0: as many as the segments map), slots [n_tokens] int64 (written).
 *   dsv4_insert_args_t (consumer, SPEC §2.1-2.2 and the paged insert of §3):
 *     q [n_tokens, heads, 512] bf16, kv [n_tokens, 512] bf16, q_out [n_tokens, heads, 512] bf16
 *     (written; NULL with write_kv: the KV rows only), positions [n_tokens] int64, slots
 *     [n_tokens] int64, kv_norm_weight [512] fp32 or NULL, cache n_blocks * stride bytes
 *     (written). q, kv, q_out, kv_norm_weight and cache must be 16-byte aligned (cudaMalloc gives
 *     256). The field `rope` (a host table) is not read: the rows come from rope_rows_dev.
 *   dsv4_attn_args_t (attention after the insert, SPEC §7, exact mode only):
 *     q [n_tokens, heads, 512] bf16 (the insert's q_out, or with q_raw its raw q), positions
 *     [n_tokens] int64, tok_seg [n_tokens] int32, seg_p0 / seg_first_lb [n_segments] int64,
 *     seg_bt_off / seg_bt_len [n_segments] uint32, block_table int32, cache, sink [heads] fp32
 *     or NULL, out [n_tokens, heads, 512] bf16 (written), lse [n_tokens, heads] fp32 or NULL
 *     (written). q, out and cache must be 16-byte aligned; `rope` is not read (rope_rows_dev, as
 *     for the insert).
 *
 * RoPE rows. rope_rows_dev is the device mirror of one host table (dsv4_rope_table_t of rope.h),
 * dense and indexed by position: the 64 floats of row p (cos[0..31] then sin[0..31], exactly the
 * 256 bytes dsv4_rope_table_row(t, p) points at) lie at rope_rows_dev + 64 * p. It must be
 * 16-byte aligned. Only rows of the positions of a launch are read, so the host glue may allocate
 * max_positions * 256 bytes once (256 MiB for 1,048,576 positions) and copy each chunk of
 * DSV4_ROPE_CHUNK_ROWS rows (64 KiB, contiguous in the host table) when dsv4_rope_table_ensure
 * materialises it, before the launch that reads it, on the same stream. Rows never change once
 * written, which is what lets the consumer read them before its dependency wait.
 *
 * Validation. The wrappers check what the host can see (sizes, alignment, null pointers) and
 * return DSV4_EINVAL before launching anything. They cannot see the contents of device arrays:
 * the caller validates tok_seg, block ids and positions on its host copies before uploading them,
 * as cpu_map_slots does, to answer DSV4_EINVAL as the CPU backend would. The kernels still never
 * write outside their buffers: a block id >= n_blocks or a table entry at or past bt_entries (when
 * given) maps to slot -1, and the consumer writes no record for a slot >= n_blocks * block_size or
 * a position outside 0..max_positions-1 (q_out is then left unwritten for that token; valid
 * batches never meet either case).
 *
 * Ordering (SPEC §5.2). With pdl != 0 on a device of compute capability 9.0 or more, the launch
 * carries cudaLaunchAttributeProgrammaticStreamSerialization: it may start while the previous
 * kernel on the stream still runs. Both kernels execute griddepcontrol.wait in every thread block
 * before they read any mutable memory or write anything; before it they only read their own
 * (immutable) parameters, so that the wait hides the parameters' constant-cache misses, and compute
 * indices, and the producer prefetches the lines of its inputs into the L2 (a prefetch returns no
 * value; README, Decisions; tests/gpu/gpu_inv_producer_wait.c). The producer triggers its
 * dependents at its start, so the consumer's launch and block scheduling overlap the producer's
 * work; the consumer triggers its own after its wait. Without PDL (pdl == 0, or an sm_80 device)
 * the same code runs in plain stream order.
 *
 * Attention is the consumer of the insert in the same way (its kernels wait before they read q,
 * the metadata or the cache, and read only their parameters and the sinks before; the sinks must
 * not change while launches that use them are queued). It cannot refuse a bad batch on the host
 * either, and a failed launch must write nothing (backend.h): its kernels check every token's
 * segment, position (p0 <= p < max_positions) and window blocks, and when one fails they set bits
 * of the caller's device error word (DSV4_CUDA_ATTN_ERR_*), write no output at all, and read no
 * block outside the pool. The host glue reads the word at sync and answers DSV4_EINVAL.
 *
 * Return values: 0, DSV4_EINVAL for bad arguments, or the mapping of the CUDA error of the launch
 * (dsv4__cuda_err). n_tokens == 0 launches nothing and returns 0.
 */

#include <cuda_runtime_api.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* SPEC §4: one slot per token from the segments' block tables (the producer). */
int dsv4__cuda_map_slots(const dsv4_map_args_t *a, cudaStream_t s, int pdl);

/*
 * SPEC §2.1-2.2 and §3: q_out for every token, and the record of every token with slot >= 0 when
 * a->write_kv (the consumer). max_positions is the number of rows rope_rows_dev holds.
 */
int dsv4__cuda_qkv_insert(const dsv4_insert_args_t *a, const float *rope_rows_dev,
                          int64_t max_positions, cudaStream_t s, int pdl);

/* Bits of the attention kernels' error word: a token's segment outside the launch; its position
 * below its segment's p0 or past the RoPE rows; a block of its window outside its segment's table
 * (or past bt_entries), < 0, or outside the pool. */
#define DSV4_CUDA_ATTN_ERR_SEGMENT 1u
#define DSV4_CUDA_ATTN_ERR_POSITION 2u
#define DSV4_CUDA_ATTN_ERR_BLOCK 4u
/* The same word serves the compressed branch's kernels (compress, indexer, the union attention):
 * the three bits above with their meaning (a segment seen twice or not one run of consecutive
 * positions counts as a segment or position error; an entry's block as a block error), and: a
 * selected entry not visible or not above the one before it; a state slot outside the pool or
 * shared by two segments. Once the word is set, every later kernel of the batch writes nothing. */
#define DSV4_CUDA_ERR_SEGMENT DSV4_CUDA_ATTN_ERR_SEGMENT
#define DSV4_CUDA_ERR_POSITION DSV4_CUDA_ATTN_ERR_POSITION
#define DSV4_CUDA_ERR_BLOCK DSV4_CUDA_ATTN_ERR_BLOCK
#define DSV4_CUDA_ERR_ENTRY 8u
#define DSV4_CUDA_ERR_SLOT 16u

/* An attention launch of at most this many tokens is checked whole by every CTA of its attention
 * kernel; a larger one by a check kernel queued before it (attention-common.cuh): without
 * compressed entries, and with them. For the tests, which report the path a launch takes. */
#define DSV4_CUDA_ATTN_CHECK_ALL_MAX 1024u
#define DSV4_CUDA_UNION_CHECK_ALL_MAX 16u
/* A launch with compressed entries is checked by every CTA only while its tokens' checks take at
 * most this many parts (a token's selection row is a part per 32 entries, a token without one a
 * part): two rounds of a CTA's 16 warps. A decode step of 3 or more tokens with selections of 512
 * has the check kernel, whose CTA per token takes the parts side by side. */
#define DSV4_CUDA_UNION_CHECK_ALL_PARTS 32u

/* 1 when a launch of n_tokens with compressed entries (selection rows of sel_stride entries, 0
 * without a selection) is checked by the CTAs of its attention kernel (every CTA all of it, or, in
 * a split fast launch, each CTA what it reads), 0 when the check kernel runs first. */
static inline int dsv4__cuda_union_checks_all(uint32_t n_tokens, uint32_t sel_stride) {
  const uint64_t parts = sel_stride ? ((uint64_t)sel_stride + 31) / 32 : 1;
  return n_tokens <= DSV4_CUDA_UNION_CHECK_ALL_MAX &&
         (uint64_t)n_tokens * parts <= DSV4_CUDA_UNION_CHECK_ALL_PARTS;
}

/*
 * SPEC §7: out and lse for every token, or nothing and bits in
 * *err_dev (a device word the caller zeroes and reads back after the stream has run the launch).
 * rope_rows_dev and max_positions as for the insert; the rows of every query position are read.
 * With a->c_cache, the union of SPEC §8.6 (attention.cu): the compressed fields are device
 * addresses like the others (seg_c_first_lb, seg_cbt_off, seg_cbt_len [n_segments], c_block_table,
 * c_sel [n_tokens, c_sel_stride] or NULL, c_cache 16-byte aligned), checked before the attention
 * kernel writes anything (by a kernel before it, or by its own CTAs in a launch of a few tokens); a
 * launch that finds its word already set writes nothing either.
 * a->fast selects fast mode (tensor cores, compute capability 9.0 and newer: attention_fast.cu
 * for the window, attention_fast_union.cu with compressed entries, behind the same checks).
 * part_dev is device scratch of part_len floats (16-byte aligned) for the partial states of a fast
 * launch that splits its tokens' lists (a small batch): at least
 * dsv4__cuda_attention_part_floats(a) (attention-split.h; 0 for every other launch, which may pass
 * NULL), else DSV4_EINVAL; the stream must be done with it before it is reused or freed.
 */
int dsv4__cuda_attention(const dsv4_attn_args_t *a, const float *rope_rows_dev,
                         int64_t max_positions, float *part_dev, uint64_t part_len,
                         uint32_t *err_dev, cudaStream_t s, int pdl);
/* The floats of partial state a launch of a's shape on the current device writes (0: it does not
 * split). */
uint64_t dsv4__cuda_attention_part_floats(const dsv4_attn_args_t *a);

/*
 * SPEC §8.3 (compress.cu): the rows of a batch into the rings and its emissions into c_cache (and
 * i_cache at ratio 4), or nothing and bits in *err_dev (as for the attention; a word already set
 * also stops it). Device addresses: positions, tok_seg [n_tokens], seg_p0 [n_segments], seg_slot
 * [n_segments], ckv [n_tokens, 2 coff 512], ikv [n_tokens, 512], ring, ape, norm_weight, i_ape,
 * i_norm_weight, the entry tables, c_cache, i_cache. The field `rope` is not read: the rows of the
 * positions ratio * j of the emissions come from rope_rows_dev, which must hold them (the engine
 * materialises them before the launch, as for the insert). The check runs in one CTA with a bitmap
 * of the segments and slots in shared memory: n_segments + n_slots must stay below 376,768
 * (DSV4_EINVAL otherwise, before anything is launched).
 */
int dsv4__cuda_compress(const dsv4_compress_args_t *a, const float *rope_rows_dev,
                        int64_t max_positions, uint32_t *err_dev, cudaStream_t s, int pdl);

/*
 * SPEC §8.5 (indexer.cu): the selection of every token into sel [n_tokens, topk], or nothing and
 * bits in *err_dev. Device addresses: positions, tok_seg, seg_p0, iq [n_tokens, n_heads, 128] bf16,
 * iw [n_tokens, n_heads], the entry tables, i_cache, sel; the rows of the positions of the tokens
 * that score come from rope_rows_dev. keys_dev is device scratch of keys_len uint32 for the scores:
 * at least dsv4__cuda_indexer_ctas(n_tokens) * dsv4__cuda_indexer_keys_per_cta(max_positions)
 * (a slot a token of the wave: the most entries a token can see, then the tensor-core kernel's
 * query rows) and on 16 bytes, else DSV4_EINVAL; the stream must be done with it before it is
 * reused or freed.
 */
int dsv4__cuda_indexer(const dsv4_indexer_args_t *a, const float *rope_rows_dev,
                       int64_t max_positions, uint32_t *keys_dev, uint64_t keys_len,
                       uint32_t *err_dev, cudaStream_t s, int pdl);
uint32_t dsv4__cuda_indexer_ctas(uint32_t n_tokens);
uint64_t dsv4__cuda_indexer_keys_per_cta(int64_t max_positions);
/* 1 when dsv4__cuda_indexer scores n_heads index heads on the current device with the tensor-core
 * kernel (indexer_mma.cu: 64 heads, compute capability 9.0 and newer, its shared memory granted),
 * whose fast mode then applies; 0 when it runs the per-entry kernel. */
int dsv4__cuda_indexer_mma(uint32_t n_heads);

/*
 * Which score kernel dsv4__cuda_indexer runs from now on in this process, for the GPU tests and
 * benchmarks that compare them on the same inputs (every path gives the same keys, bit for bit):
 * AUTO (the daemon's) the tensor-core kernel where it applies (64 index heads, compute capability
 * 9.0 and newer: sm90a/indexer_wgmma.cu where the device runs it, else indexer_mma.cu) and the
 * per-entry kernel elsewhere; THREADS the per-entry kernel
 * everywhere; MMA_PARTIAL and MMA_SCALAR the tensor-core kernel (where it applies) with its fused
 * mode, or both its matrix modes, left out, so that its partial mode and its scalar product run on
 * any data.
 */
enum {
  DSV4_CUDA_INDEXER_AUTO = 0,
  DSV4_CUDA_INDEXER_THREADS = 1,
  DSV4_CUDA_INDEXER_MMA_PARTIAL = 2,
  DSV4_CUDA_INDEXER_MMA_SCALAR = 3,
  /* Fast mode (dsv4_indexer_args_t.fast) whatever the launch asks; FAST_PARTIAL and FAST_SCALAR
   * with the modes left out as for MMA_PARTIAL and MMA_SCALAR. Every tensor-core path runs the
   * warpgroup-MMA kernel (sm90a/indexer_wgmma.cu) where the device runs it, else indexer_mma.cu's
   * (dsv4__cuda_indexer_force_sync). */
  DSV4_CUDA_INDEXER_MMA_FAST = 4,
  DSV4_CUDA_INDEXER_MMA_FAST_PARTIAL = 5,
  DSV4_CUDA_INDEXER_MMA_FAST_SCALAR = 6
};
void dsv4__cuda_indexer_set_path(int path);
/* With on, the tensor-core paths run indexer_mma.cu's kernel even where the warpgroup-MMA one
 * (sm90a/indexer_wgmma.cu, both modes) would run: the tests and benchmarks that compare the two;
 * off by default. */
void dsv4__cuda_indexer_force_sync(int on);
/* 1 when the indexer's scores run on warpgroup MMAs on the current device (dsv4__indexer_wg_ready,
 * for 64 index heads). */
int dsv4__cuda_indexer_wg(uint32_t n_heads);

/* Whether device dev can run the attention kernels (about 199 KiB of shared memory per block:
 * compute capability 9.0 and 10.0 can, 8.x cannot). */
int dsv4__cuda_attention_supported(int dev);

/* The heads one CTA of the attention kernel computes for a launch of that shape on the current
 * device (64, 32, 16 or 8), or 0 when the device cannot be queried: for the tests and the
 * benchmark, which report it. */
uint32_t dsv4__cuda_attention_heads_per_block(uint32_t n_tokens, uint32_t heads);

/* Whether device dev runs fast mode (compute capability 9.0 or newer, and its shared memory), and
 * the heads one CTA of the fast kernel computes for a launch of that shape (64, 32 or 16). */
int dsv4__cuda_attention_fast_supported(int dev);
uint32_t dsv4__cuda_attention_fast_heads_per_block(uint32_t n_tokens, uint32_t heads);
/* The same for the fast union kernel (compressed entries; 64 on warpgroup MMAs, 32 or 16 heads per
 * CTA), and the splits
 * of each token's list in a fast union launch of that shape (1: not split; 0 when the device cannot
 * be queried). */
int dsv4__cuda_attention_fast_union_supported(int dev);
uint32_t dsv4__cuda_attention_fast_union_heads_per_block(uint32_t n_tokens, uint32_t heads);
uint32_t dsv4__cuda_attention_fast_union_splits(uint32_t n_tokens, uint32_t heads);
/* The splits of each token's window in a fast launch without compressed entries (1, 2, 4 or 8). */
uint32_t dsv4__cuda_attention_fast_splits(uint32_t n_tokens, uint32_t heads);
/* With on, the fast kernels' CTAs of 64 heads run on mma.sync even where the warpgroup-MMA forms
 * (sm90a/attention_fast_wg.cu, the window's; sm90a/attention_fast_union_wg.cu, the union's, whose
 * launches then take CTAs of 32 or 16 heads) would run: the tests and benchmarks that compare the
 * two; off by default. dsv4__cuda_attention_fast_wg: 1 when the window's form runs on the current
 * device; dsv4__cuda_attention_fast_union_wg: the union's. */
void dsv4__cuda_attention_fast_force_sync(int on);
int dsv4__cuda_attention_fast_wg(void);
int dsv4__cuda_attention_fast_union_wg(void);
/* With on, every fast union launch of more than 32 heads takes the warpgroup kernel's 64-head CTAs
 * where the device runs it (dsv4__cuda_attention_fast_union_wg), whatever the launcher would
 * choose (a force_sync wins over it): the tests that run both kernels on the same cases; off by
 * default. */
void dsv4__cuda_attention_fast_union_force_wg(int on);
#ifdef DSV4_PHASE_PROBE
/* A build with the phase probe (CMake DSV4_CUDA_PHASES, phase-probe.cuh): the fast window kernel's
 * cycles a CTA since the last call, by phase (the dependency wait, the window's blocks, the copies'
 * issue and the launch's check, the staging's end, the scores, the softmax, the weighted sum and
 * its stores), and the CTAs counted (-1: unreadable). */
long long dsv4__cuda_attention_fast_phases(double cycles[7]);
/* The fast union kernel's, each phase summed over a CTA's tiles: the wait, the setup, the
 * addresses and staging, the scores, the softmax, the weighted sum, the output (or a split's
 * partial state). */
long long dsv4__cuda_attention_fast_union_phases(double cycles[7]);
/* The exact window kernel's: the wait, the setup, the staging, the logits, the weights and sums,
 * the chains N (0 unless heads is a multiple of 64), the output's division, RoPE and stores. */
long long dsv4__cuda_attention_phases(double cycles[7]);
#endif

/*
 * A CUDA error as a project error code: cudaSuccess -> 0, out of memory -> DSV4_ENOMEM, no device
 * or no usable driver -> DSV4_ENODEV, everything else -> DSV4_EBACKEND. For the host glue's own
 * CUDA calls as well, so that one table maps them all.
 */
int dsv4__cuda_err(cudaError_t e);

/* Whether launches on device dev use programmatic dependent launch (compute capability >= 9.0). */
int dsv4__cuda_pdl_supported(int dev);

#if defined(DSV4_TEST_COUNT_STORES)
/*
 * Test-only (tests/gpu, SPEC §5.1): in a build with DSV4_TEST_COUNT_STORES every store of the
 * consumer into [base_k, base_k + len_k) also adds 1 to counts_k[byte offset] (uint32 device
 * arrays) for each byte it stores. Up to two regions (q_out and the cache); len 0 disables one.
 */
int dsv4__cuda_test_count_regions(void *base0, size_t len0, unsigned *counts0, void *base1,
                                  size_t len1, unsigned *counts1);
#endif

#if defined(DSV4_TEST_TUNE)
/* Test-only (the benchmark's tuning build): rows per warp of every warp of the insert kernel (at
 * most 64, no one-row tail); 0 = its own choice. */
extern unsigned dsv4__cuda_test_rows_per_warp;
/* Test-only: 1 = rows copied without arithmetic, 2 = the same in grid-stride row order, 4 = q_out
 * with plain stores instead of evict-first ones. */
extern unsigned dsv4__cuda_test_flags_host;
/* Test-only (tests/gpu/gpu_attn_fast_test.c's split build): the splits of every fast launch (at
 * most DSV4_UNION_MAX_SPLITS; a window launch takes the power of two at or below); 0 = the
 * launcher's choice. */
extern unsigned dsv4__cuda_test_union_splits;
/* Test-only (the same build): 1 = a split window launch ends in the combine kernel, not in its
 * thread-block clusters; 0 = clusters where the device can run them. The count of split window
 * launches queued as clusters. */
extern unsigned dsv4__cuda_test_window_combine, dsv4__cuda_test_window_cluster_launches;
#endif

#if defined(DSV4_TEST_SELECT)
/* Test-only (tests/gpu/gpu_select_test.c, indexer.cu built again): the indexer's selection, one
 * CTA per problem b < count, of the n[b] > topk keys at keys + b * stride into out + b * topk, as
 * entries 0.. (all device pointers); waits for the device. 0 or a DSV4_E* code. */
int dsv4__cuda_test_select(const uint32_t *keys, uint64_t stride, const uint32_t *n, uint32_t count,
                           uint32_t topk, int32_t *out);
/* Test-only (tests/gpu/gpu_inv_select_wait.c): the select kernel itself, one CTA a token (token t
 * in key slot t), with programmatic dependent launch when pdl, queued on s. Device arrays; token
 * t sees entries seg_p0[s] / 4 .. (positions[t] + 1) / 4 of its segment s, as at ratio 4. */
typedef struct {
  const int64_t *positions;
  const int32_t *tok_seg;
  const int64_t *seg_p0;
  uint32_t *keys; /* n_tokens slots of keys_per_cta */
  int32_t *sel;   /* [n_tokens, topk] */
  uint32_t *err;
  int64_t max_positions;
  uint64_t keys_per_cta;
  uint32_t n_tokens, n_segments, topk;
} dsv4_test_select_launch_t;
int dsv4__cuda_test_select_launch(const dsv4_test_select_launch_t *a, cudaStream_t s, int pdl);
#endif

#ifdef __cplusplus
}
#endif

#endif /* DSV4_KERNELS_CUDA_CUDA_KERNELS_H */
