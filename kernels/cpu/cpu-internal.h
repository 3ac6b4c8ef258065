#ifndef DSV4_KERNELS_CPU_CPU_INTERNAL_H
#define DSV4_KERNELS_CPU_CPU_INTERNAL_H

/*
 * Private pieces of the CPU backend: the per-token kernels and the hooks the unit tests use.
 * Nothing outside kernels/cpu/ and its tests includes this header. The worker pool it runs on is a
 * unit of its own (host_pool.h), shared with the CUDA backend's host glue.
 */

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "host_pool.h"

/*
 * Instruction-set levels of the per-token kernels, in increasing order of width. Every level
 * produces the same bytes; DSV4__CPU_ISA_COUNT is one past the last, for loops over the levels.
 */
enum {
  DSV4__CPU_ISA_SCALAR = 0,
  DSV4__CPU_ISA_AVX2 = 1, /* AVX2 + FMA (x86-64-v3) */
  DSV4__CPU_ISA_AVX512 = 2,
  DSV4__CPU_ISA_COUNT = 3,
};

/* Launches whose q input is smaller than this run on the calling thread alone. */
#define DSV4__CPU_INLINE_Q_BYTES (256u * 1024u)

/* ---- per-token kernels (cpu_kernels.c) ---- */

/* Whether this machine can run the kernels of isa. */
int dsv4__cpu_isa_supported(int isa);
/* The best level this machine supports. */
int dsv4__cpu_isa_best(void);
/* The level's short name ("scalar", "avx2", "avx512"), or "unknown". */
const char *dsv4__cpu_isa_name(int isa);

/*
 * SPEC §2.1 for heads consecutive heads of one token: q and out point at [heads, 512] bf16. With
 * stream set, a level may write out with non-temporal stores (for batches larger than the caches);
 * the bytes are the same either way, and they are visible to other threads once the call returns.
 */
void dsv4__cpu_q_heads(int isa, const uint16_t *q, uint16_t *out, uint32_t heads,
                       const float *rope_row, float eps, int stream);

/*
 * SPEC §2.2 for one token: data receives the 576 bytes NoPE fp8 | RoPE bf16, scales the 8 scale
 * bytes (pad byte 0). w is the kv_norm weight or NULL (prenormed). Each byte is stored once.
 */
void dsv4__cpu_kv_token(int isa, const uint16_t *kv, const float *rope_row, const float *w,
                        float eps, uint8_t *data, uint8_t *scales);

#if defined(__x86_64__)
/* The AVX-512 kernels (cpu_kernels_avx512.c); callers check dsv4__cpu_isa_supported first. */
void dsv4__cpu_q_heads_avx512(const uint16_t *q, uint16_t *out, uint32_t heads,
                              const float *rope_row, float eps, int stream);
void dsv4__cpu_kv_token_avx512(const uint16_t *kv, const float *rope_row, const float *w, float eps,
                               uint8_t *data, uint8_t *scales);
/* The AVX2 + FMA kernels (cpu_kernels_avx2.c), for machines without AVX-512; same contract. */
void dsv4__cpu_q_heads_avx2(const uint16_t *q, uint16_t *out, uint32_t heads, const float *rope_row,
                            float eps, int stream);
void dsv4__cpu_kv_token_avx2(const uint16_t *kv, const float *rope_row, const float *w, float eps,
                             uint8_t *data, uint8_t *scales);
#endif

/* ---- exact attention (cpu_attention.c, SPEC §7 and §8.6) ---- */

/* Candidates dequantised at a time: a list of any length (the window, then the compressed
 * entries) passes through the workspace in tiles of this many, so its size does not grow with
 * the list. */
#define DSV4__CPU_ATTN_TILE 128
/* Heads rounded up to the vector levels' groups of four (their last group computes unused heads
 * from zero queries, into rows that must exist). */
#define DSV4__CPU_ATTN_HEADS4(nh) (((nh) + 3u) & ~3u)
/* Floats of the workspace of an item of nh heads with logit rows of l_stride floats (a multiple
 * of 16, at least the item's candidate count): one tile dequantised in the level's own layout, the
 * queries of every head as fp32 (in the level's layout), the sums N of every head, then the logits
 * of every head over the whole list. Each part starts 64-byte aligned when the workspace does. */
#define DSV4__CPU_ATTN_WORK_FLOATS(nh, l_stride)                                                   \
  ((size_t)DSV4__CPU_ATTN_TILE * DSV4_HEAD_DIM +                                                   \
   (size_t)DSV4__CPU_ATTN_HEADS4(nh) * (2u * DSV4_HEAD_DIM + (size_t)(l_stride)))

/*
 * One work item: nh consecutive heads of one token over its candidate list, nw window positions
 * lo..lo + nw - 1, then nc - nw compressed entries (SPEC §8.6): j_lo, j_lo + 1, ... or, with sel,
 * sel[0..nc - nw - 1]. Every candidate was checked by the launch.
 */
typedef struct {
  const dsv4_attn_args_t *a; /* the launch: caches and block tables */
  uint32_t seg;              /* the token's segment */
  const uint16_t *q;         /* [nh, 512] bf16, the rotated queries */
  uint32_t nh;
  uint32_t nc; /* 1..: the window, then the compressed entries */
  uint32_t nw; /* 1..128 */
  int64_t lo;
  int64_t j_lo;
  const int32_t *sel;
  const float *rope_row; /* cos and sin at the query's position */
  const float *sink;     /* [nh], or NULL */
  uint16_t *out;         /* [nh, 512] bf16 */
  float *lse;            /* [nh], or NULL */
  /* The parts of the participant's workspace (DSV4__CPU_ATTN_WORK_FLOATS(nh, l_stride)). */
  float *tile, *qf, *n, *l;
  uint32_t l_stride;
} dsv4__cpu_attn_item_t;

/* The 576 data bytes and the 8 scale bytes of candidates first..first + count - 1 of it (count at
 * most DSV4__CPU_ATTN_TILE), in list order. */
void dsv4__cpu_attn_records(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count,
                            const uint8_t **data, const uint8_t **scales);

/* SPEC §7 / §8.6 for one item at the given level; every level stores the same bytes, each once. */
void dsv4__cpu_attn_item(int isa, const dsv4__cpu_attn_item_t *it);
#if defined(__x86_64__)
/* The vector levels (cpu_attention_avx2.c, cpu_attention_avx512.c); same contract. */
void dsv4__cpu_attn_item_avx512(const dsv4__cpu_attn_item_t *it);
void dsv4__cpu_attn_item_avx2(const dsv4__cpu_attn_item_t *it);
#endif

/* The workspaces of one backend's attention launches, one per pool participant. */
typedef struct dsv4__cpu_attn_scratch dsv4__cpu_attn_scratch_t;
void dsv4__cpu_attn_scratch_free(dsv4__cpu_attn_scratch_t *s);

/*
 * The CPU backend's attention op: checks every argument and every candidate's block before it
 * writes anything, then runs the items on the pool (the join orders it before the next launch).
 * *scratch is allocated on first use, grown when a launch's lists need more, and kept for later
 * launches.
 */
int dsv4__cpu_attention(dsv4_host_pool_t *pool, int isa, dsv4__cpu_attn_scratch_t **scratch,
                        const dsv4_attn_args_t *a);

/* ---- the compressed branch (cpu_compress.c, SPEC §8.3, §8.5) ---- */

/*
 * The CPU backend's compress op: checks every argument, every emission's block and RoPE row before
 * it writes anything, then pools the emissions on the pool and writes the ring rows after them.
 */
int dsv4__cpu_compress(dsv4_host_pool_t *pool, int isa, const dsv4_compress_args_t *a);

/* One row of a pooling at the channels of its half: the score is s[c] + ape[c] (one rounding) for
 * a row of this batch, and the stored s[c] (ape NULL) for a row from the ring. */
typedef struct {
  const float *kv;
  const float *s;
  const float *ape;
} dsv4__cpu_pool_row_t;

#if defined(__x86_64__)
/*
 * The vector levels of the compressor's pooling (SPEC §8.3): z[c] for c < channels (a multiple of
 * 16) over n >= 1 rows in R's order, one channel per lane, each lane running dsv4-compress.h's max,
 * dsv4_pool_add and divide in their order (cpu_compress_avx512.c, cpu_compress_avx2.c).
 */
void dsv4__cpu_pool_rows_avx512(const dsv4__cpu_pool_row_t *rows, uint32_t n, uint32_t channels,
                                float *z);
void dsv4__cpu_pool_rows_avx2(const dsv4__cpu_pool_row_t *rows, uint32_t n, uint32_t channels,
                              float *z);
#endif

/* The workspaces of one backend's indexer launches, one per pool participant. */
typedef struct dsv4__cpu_index_scratch dsv4__cpu_index_scratch_t;
void dsv4__cpu_index_scratch_free(dsv4__cpu_index_scratch_t *s);

/*
 * The CPU backend's indexer op: checks every argument and every block a selection reads before it
 * writes anything, then selects per token on the pool, scoring at the given level (every level
 * selects the same entries). *scratch is allocated (or enlarged) by the launch that first needs it
 * and kept for later launches.
 */
int dsv4__cpu_indexer(dsv4_host_pool_t *pool, int isa, dsv4__cpu_index_scratch_t **scratch,
                      const dsv4_indexer_args_t *a);

/*
 * The vector levels of the index scores (SPEC §8.5), one token's scores over a run of visible
 * entries. Lanes are entries: each lane runs the scalar level's operations in its order (8 fma
 * chains of 16 dims from +0.0f, the fold 4, 2, 1, then fmaf(w_h, max(d, +0.0f), acc) over the heads
 * in order), so the scores are the scalar level's bytes. Entries come in groups of 16 that start at
 * a multiple of 16: block sizes are multiples of 16, so a group's records are consecutive in one
 * index block. Lanes before the run (lead of them in the first group) and after it read nothing.
 */
#define DSV4__CPU_INDEX_GROUP 16
/* Heads per pass over the keys. */
#define DSV4__CPU_INDEX_QUAD 4
/* q^ of the vector levels is stored by groups of 16 heads: qt[(h / 16) * 16 * 128 + 16 * d + h %
 * 16], so the values of one dim of four heads are side by side, with zeros past the last head. */
#define DSV4__CPU_INDEX_QHEADS 16
/* Floats of a level's workspace (64-byte aligned): the dequantised keys of a pass (up to 4 groups
 * of 16 entries, 128 dims) and the chains' partial sums (8 chains, 4 heads, 64 lanes). */
#define DSV4__CPU_INDEX_WORK_FLOATS (4 * DSV4__CPU_INDEX_GROUP * 128 + 8 * 4 * 64)

typedef struct {
  const uint8_t *vals;  /* the group's 16 records' value bytes, 64 each, consecutive */
  const uint8_t *codes; /* their block codes, 4 each, consecutive */
} dsv4__cpu_index_group_t;

typedef struct {
  const float *qt; /* q^ in the DSV4__CPU_INDEX_QHEADS layout */
  const float *w;  /* [n_heads] the scaled weights */
  uint32_t n_heads;
  const dsv4__cpu_index_group_t *groups; /* ceil((lead + n) / 16) of them */
  uint32_t lead;                         /* lanes of the first group before the run */
  uint32_t n;                            /* entries of the run */
  float *scores;                         /* [n] out */
  float *work;                           /* DSV4__CPU_INDEX_WORK_FLOATS */
} dsv4__cpu_index_scan_t;

/*
 * q^ of n_heads heads (dsv4_index_query: RoPE at the token's row, Hadamard, MXFP4, dequantised)
 * from iq [n_heads, 128] bf16, into qt in the DSV4__CPU_INDEX_QHEADS layout, heads up to a multiple
 * of 16 zero. Lanes are heads, each running dsv4_index_query's operations in its order.
 */
#if defined(__x86_64__)
/* cpu_compress_avx512.c and cpu_compress_avx2.c; callers check dsv4__cpu_isa_supported first. */
void dsv4__cpu_index_queries_avx512(const uint16_t *iq, uint32_t n_heads, const float *rope_row,
                                    float *qt);
void dsv4__cpu_index_scan_avx512(const dsv4__cpu_index_scan_t *s);
void dsv4__cpu_index_queries_avx2(const uint16_t *iq, uint32_t n_heads, const float *rope_row,
                                  float *qt);
void dsv4__cpu_index_scan_avx2(const dsv4__cpu_index_scan_t *s);
#endif

/*
 * ---- test-only hooks of the ordering-invariant tests (tests/unit/inv_*.c, SPEC §5) ----
 *
 * Each is compiled only under a DSV4_TEST_* macro that only tests/unit/invariants.cmake defines, so
 * the daemon's build contains none of them. The DSV4_TEST_BROKEN_* macros break one invariant on
 * purpose, so that ctest shows on every run that the invariant's test can fail.
 */
#ifdef DSV4_TEST_COUNT_STORES
/* Defined by the test: n bytes at p were stored into q_out or the cache (SPEC §5.1). */
void dsv4__test_count_store(const void *p, size_t n);
#define DSV4__COUNT_STORE(p, n) dsv4__test_count_store((p), (n))
#else
#define DSV4__COUNT_STORE(p, n) ((void)0)
#endif
#if defined(DSV4_TEST_DELAY_PRODUCER) || defined(DSV4_TEST_BROKEN_NO_JOIN)
/* Wait for producer threads that a broken map_slots left running (a no-op when it joined them). */
void dsv4__cpu_backend_test_drain(dsv4_backend_t *be);
#endif

/* ---- test hooks (cpu_backend.c) ---- */

/* Select the kernel level of a CPU backend; DSV4_EUNSUPPORTED if this machine cannot run it. */
int dsv4__cpu_backend_set_isa(dsv4_backend_t *be, int isa);
/* q_out bytes per launch from which the kernels write q_out with non-temporal stores. */
void dsv4__cpu_backend_set_stream_bytes(dsv4_backend_t *be, uint64_t bytes);
/* The number of worker threads (participants other than the caller) and their start MXCSR. */
unsigned dsv4__cpu_backend_workers(dsv4_backend_t *be);
unsigned dsv4__cpu_backend_worker_mxcsr(dsv4_backend_t *be, unsigned worker);

#endif /* DSV4_KERNELS_CPU_CPU_INTERNAL_H */
