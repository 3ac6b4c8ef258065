#ifndef DSV4_KERNELS_CUDA_INDEXER_COMMON_CUH
#define DSV4_KERNELS_CUDA_INDEXER_COMMON_CUH
/*
 * What the indexer's kernels share (SPEC §8.5): the parameter block, a token's visible entries and
 * the part of them a CTA of the score grid takes, an entry's index record in the pool, and the
 * index query of one head by a warp. indexer.cu holds the check, the per-entry score kernel, the
 * selection and the launch; indexer_mma.cu the score kernel on tensor cores.
 */
#include "cuda-internal.cuh"

#include "dsv4-compress.h"
#include "dsv4-error.h"
#include "dsv4-numerics.h"

/* Floats per row of q^ in shared memory: 128 and a pad of 4, so the lanes of a warp that read
 * different heads' rows (score_entries_grouped) read different banks. */
#define Q_STRIDE (DSV4_INDEX_DIM + 4)
#define SEL_THREADS 256
#define SEL_WARPS (SEL_THREADS / 32)
#define FULL 0xffffffffu
/* The index heads of the tensor-core score kernel (V4's index_n_heads); other counts take the
 * per-entry kernel. */
#define MMA_HEADS 64
/* A head's row of the query kernel's output (indexer_mma.cu): q^ (128 floats), then its weight and
 * its block summary's bits, 2 floats of pad: Q_STRIDE floats, whole 16-byte chunks. */
#define QROW Q_STRIDE
/* The words at the end of each key slot that hold its token's MMA_HEADS rows of QROW floats. */
#define SLOT_QUERY_WORDS ((uint64_t)MMA_HEADS * QROW)

typedef struct {
  const int64_t *pos;
  const int32_t *tok_seg;
  const int64_t *seg_p0;
  const uint16_t *iq; /* [n_tokens, n_heads, 128] bf16 */
  const float *iw;    /* [n_tokens, n_heads] */
  const float *rope;  /* rows of 64 floats by position */
  const int64_t *seg_c_first_lb;
  const uint32_t *seg_cbt_off;
  const uint32_t *seg_cbt_len;
  const int32_t *c_bt;
  const uint8_t *i_cache;
  int32_t *sel;
  uint32_t *keys; /* [gridDim.x, keys_per_cta] */
  uint32_t *err;
  int64_t max_pos;
  uint64_t keys_per_cta;
  float w_scale;
  uint32_t n_tokens, n_segments, topk, n_heads, c_bt_entries, c_n_blocks, bs_shift;
  uint32_t t_base;    /* the first token of this wave: key slot x holds token t_base + x */
  uint32_t check_tpt; /* the check kernel's threads a token, a multiple of 32 */
  /* The tensor-core kernel's highest mode (DSV4_INDEX_MX_FUSED in the daemon; lower ones let the
   * GPU tests run its partial mode and its scalar product on any data). */
  uint32_t mma_cap;
} idx_params_t;

static_assert(sizeof(idx_params_t) % 4 == 0, "parameter block of whole words");
static_assert(QROW % 4 == 0, "query rows of whole 16-byte chunks");

/* Key slot x's query rows (the query kernel's output, read by the tensor-core score kernel): the
 * last SLOT_QUERY_WORDS words of the slot, 16-byte aligned (keys_per_cta is a multiple of 4). */
static __device__ __forceinline__ float *slot_queries(const idx_params_t &p, uint32_t x) {
  return reinterpret_cast<float *>(p.keys + (uint64_t)x * p.keys_per_cta + p.keys_per_cta -
                                   SLOT_QUERY_WORDS);
}

/* Words of a token's key slot that its keys take: the most entries a token below max_pos can see,
 * rounded up to 16 bytes (the query rows follow them, slot_queries). */
static __host__ __device__ __forceinline__ uint64_t slot_key_words(int64_t max_pos) {
  return ((uint64_t)(max_pos > 0 ? max_pos : 0) / 4 + 1 + 3) & ~(uint64_t)3;
}

/* Token t's segment and its visible entries jlo..jhi-1 (SPEC §8.4 at ratio 4); error bits. t is a
 * token of the launch, so its position is loaded beside its segment: two latencies, not three. */
static __device__ uint32_t token_range(const idx_params_t &p, uint32_t t, uint32_t *s, int64_t *jlo,
                                       int64_t *jhi) {
  const int32_t seg = p.tok_seg[t];
  const int64_t pos = p.pos[t];
  if (seg < 0 || (uint32_t)seg >= p.n_segments)
    return DSV4_CUDA_ERR_SEGMENT;
  const int64_t p0 = p.seg_p0[seg];
  if (p0 < 0 || pos < p0 || pos >= p.max_pos)
    return DSV4_CUDA_ERR_POSITION;
  *s = (uint32_t)seg;
  *jlo = p0 / 4;
  *jhi = (pos + 1) / 4;
  return 0;
}

/*
 * The part of token t = t_base + blockIdx.x's visible entries that this CTA of the score grid
 * takes: its segment s, its first entry jlo and entry indices [i0, i1) (split blockIdx.y of
 * gridDim.y). False, and nothing to write, when the error word is set (the check, or an earlier
 * launch of the batch, failed), there is no such token, the token sees at most topk entries (the
 * select kernel lists them whole) or the split is empty. After the dependency wait.
 */
static __device__ bool score_split(const idx_params_t &p, uint32_t *t, uint32_t *s, int64_t *jlo,
                                   uint32_t *i0, uint32_t *i1) {
  const uint32_t err = __ldcg(p.err); /* its latency under the token's range */
  *t = p.t_base + blockIdx.x;
  *s = 0;
  *jlo = 0;
  int64_t jhi = 0;
  if (*t >= p.n_tokens)
    return false;
  (void)token_range(p, *t, s, jlo, &jhi); /* checked */
  if (err != 0)
    return false;
  const int64_t n = jhi > *jlo ? jhi - *jlo : 0;
  if (n <= (int64_t)p.topk)
    return false;
  const uint32_t per = (uint32_t)((n + gridDim.y - 1) / gridDim.y);
  *i0 = blockIdx.y * per;
  *i1 = min((uint32_t)n, *i0 + per);
  return *i0 < *i1;
}

/* A score kernel's start: the dependency wait (after the parameters are read, which it may
 * precede), the trigger for the select kernel's prologue, and score_split's part of the token. */
static __device__ __forceinline__ bool score_begin(const idx_params_t &p, uint32_t *t, uint32_t *s,
                                                   int64_t *jlo, uint32_t *i0, uint32_t *i1) {
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  return score_split(p, t, s, jlo, i0, i1);
}

/* Threads of a check CTA (the check kernel's, and the check part of the check and query launch). */
#define CHECK_BLOCK 256

/* Thread `lane` of the check_tpt threads that check token t: the blocks lb, lb + check_tpt, ... of
 * its range. */
static __device__ uint32_t check_token(const idx_params_t &p, uint32_t t, uint32_t lane) {
  uint32_t s;
  int64_t jlo, jhi;
  uint32_t bits = token_range(p, t, &s, &jlo, &jhi);
  if (bits || jhi - jlo <= (int64_t)p.topk)
    return bits;
  int64_t lb = jlo >> p.bs_shift;
  const int64_t lb_hi = (jhi - 1) >> p.bs_shift;
  /* The predecessor of the same segment at p - 1, if it scored, checked up to its last block. */
  if (t > 0 && p.tok_seg[t - 1] == (int32_t)s && p.pos[t - 1] == p.pos[t] - 1) {
    const int64_t prev_hi = p.pos[t] / 4;
    if (prev_hi - jlo > (int64_t)p.topk && ((prev_hi - 1) >> p.bs_shift) > lb)
      lb = (prev_hi - 1) >> p.bs_shift;
  }
  for (lb += lane; lb <= lb_hi; lb += p.check_tpt)
    if (dsv4__entry_block(p, s, lb) < 0)
      return DSV4_CUDA_ERR_BLOCK;
  return 0;
}

/* Item i of the launch's check (after the dependency wait): segment i's table within the entries
 * given (as the CPU's ctable_segments_ok), and thread i % check_tpt of token i / check_tpt
 * (check_token; a decode token at 64K context has hundreds of blocks to look up, each a chain of
 * loads, so a small batch spreads them over the device). A failure sets bits of the error word. */
static __device__ void indexer_check_item(const idx_params_t &p, uint32_t i) {
  uint32_t bits = 0;
  if (i < p.n_segments && p.c_bt_entries &&
      (uint64_t)p.seg_cbt_off[i] + p.seg_cbt_len[i] > p.c_bt_entries)
    bits |= DSV4_CUDA_ERR_BLOCK;
  if (i / p.check_tpt < p.n_tokens)
    bits |= check_token(p, i / p.check_tpt, i % p.check_tpt);
  if (bits)
    atomicOr(p.err, bits);
}

/* The index record of entry j of the segment of table tb (its block checked): 64 value bytes, 4
 * codes. */
static __device__ void entry_record(const idx_params_t &p, const dsv4__seg_table_t &tb, int64_t j,
                                    const uint8_t **vals, const uint8_t **codes) {
  const uint64_t bs = 1u << p.bs_shift, o = (uint64_t)j & (bs - 1);
  const uint8_t *blk =
      p.i_cache + (uint64_t)dsv4__table_block(p, tb, j >> p.bs_shift) * DSV4_INDEX_BLOCK_BYTES(bs);
  *vals = blk + DSV4_INDEX_VALUE_BYTES * o;
  *codes = blk + DSV4_INDEX_VALUE_BYTES * bs + DSV4_MXFP4_BLOCKS * o;
}

/* Entry j of segment s dequantised into k. */
static __device__ void entry_key(const idx_params_t &p, uint32_t s, int64_t j, float *k) {
  const uint8_t *vals, *codes;
  entry_record(p, dsv4__seg_table(p, s), j, &vals, &codes);
  dsv4_mxfp4_dequant128(vals, codes, k);
}

/*
 * dsv4_index_query of one head by a warp: lane l holds dims 4l..4l + 3. Every value goes through
 * the operations the one-thread function applies to it (RoPE pairs, the Hadamard butterflies with
 * the lane's partner across a stage, the scale and bf16 rounding, the block's maximum, the nibble
 * and its value), so the bytes are the same; the stages' butterflies are independent (SPEC §8.5).
 * With summary, lane 0 also stores the head's dsv4_index_mx_summary (a block nonzero where one of
 * its nibbles has a nonzero magnitude, its code e + 127).
 */
static __device__ void index_query_warp(const uint16_t *iq, const float *rope_row, float *qhat,
                                        uint32_t *summary) {
  const uint32_t lane = threadIdx.x & 31;
  float x[4];
  for (int i = 0; i < 4; i++)
    x[i] = dsv4_bf16_to_f32(iq[4 * lane + i]);
  if (4 * lane >= DSV4_INDEX_ROPE_FIRST) /* two RoPE pairs a lane */
    for (int k = 0; k < 2; k++) {
      const uint32_t i = (4 * lane - DSV4_INDEX_ROPE_FIRST) / 2 + k;
      const float e = x[2 * k], o = x[2 * k + 1], c = rope_row[i],
                  sn = rope_row[DSV4_ROPE_PAIRS + i];
      x[2 * k] = dsv4_round_bf16(dsv4_rope_even(e, o, c, sn));
      x[2 * k + 1] = dsv4_round_bf16(dsv4_rope_odd(e, o, c, sn));
    }
  /* Stages h = 1 and 2 within the lane, then h = 4 .. 64 with lane l ^ (h / 4): the lower lane
   * keeps x + y, the upper one x - y, x being the lower lane's value. */
  for (int h = 1; h < 4; h <<= 1)
    for (int i = 0; i < 4; i++)
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
  for (uint32_t m = 1; m < 32; m <<= 1)
    for (int i = 0; i < 4; i++) {
      const float other = __shfl_xor_sync(FULL, x[i], m);
      x[i] = (lane & m) ? other - x[i] : x[i] + other;
    }
  const float hs = dsv4_u2f(DSV4_HADAMARD_SCALE_BITS);
  float amax = dsv4_u2f(DSV4_MXFP4_AMAX_FLOOR_BITS);
  for (int i = 0; i < 4; i++) {
    x[i] = dsv4_round_bf16(x[i] * hs);
    const float a = dsv4_u2f(dsv4_f2u(x[i]) & 0x7fffffffu);
    amax = a > amax ? a : amax;
  }
  /* A block of 32 values is 8 lanes. */
  for (uint32_t m = 1; m < DSV4_MXFP4_BLOCK / 4; m <<= 1) {
    const float a = __shfl_xor_sync(FULL, amax, m);
    amax = a > amax ? a : amax;
  }
  const int32_t e = dsv4_mxfp4_exponent(amax);
  const float scale = dsv4_pow2_neg(e), back = dsv4_ue8m0_scale((uint8_t)(e + DSV4_UE8M0_BIAS));
  uint8_t nib[4];
  for (int i = 0; i < 4; i++)
    nib[i] = dsv4_e2m1_nibble(x[i] * scale);
  float4 out;
  out.x = dsv4_e2m1_to_f32(nib[0]) * back;
  out.y = dsv4_e2m1_to_f32(nib[1]) * back;
  out.z = dsv4_e2m1_to_f32(nib[2]) * back;
  out.w = dsv4_e2m1_to_f32(nib[3]) * back;
  reinterpret_cast<float4 *>(qhat)[lane] = out;
  if (summary) { /* warp-uniform */
    const uint32_t nz = __ballot_sync(FULL, ((nib[0] | nib[1] | nib[2] | nib[3]) & 7u) != 0);
    uint32_t sum = 0;
    for (uint32_t b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
      const uint32_t code = (uint32_t)__shfl_sync(FULL, e, 8 * b) + DSV4_UE8M0_BIAS;
      sum |= dsv4_index_mx_block(((nz >> (8 * b)) & 0xffu) != 0, code) << (8 * b);
    }
    if (lane == 0)
      *summary = sum;
  }
}

/* A score kernel of the tensor-core kinds (kernels[fast]: its fast and exact forms) over grid, with
 * `smem` bytes of dynamic shared memory, its limit raised once a device (limit_raised[fast]: the
 * devices whose limit is raised for that form). */
static inline cudaError_t score_kernel_launch(void (*const (&kernels)[2])(idx_params_t),
                                              std::atomic<uint64_t> (&limit_raised)[2], size_t smem,
                                              unsigned threads, const idx_params_t &p, dim3 grid,
                                              cudaStream_t s, int pdl, int fast) {
  void (*kernel)(idx_params_t) = kernels[fast ? 1 : 0];
  cudaError_t e = dsv4__cuda_smem_limit(kernel, smem, limit_raised[fast ? 1 : 0]);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(kernel, grid, threads, smem, s, pdl, p);
}

/* The tensor-core score kernel (indexer_mma.cu) over grid (tokens of the wave, splits): the keys
 * of exactly the entries the per-entry kernel scores, with the same bits; with fast set, each
 * score's 64 heads summed in another fixed order (fast mode, SPEC §8.9). n_heads must be
 * MMA_HEADS, the device of compute capability 8.0 or newer and dsv4__indexer_mma_fits() true. */
cudaError_t dsv4__indexer_mma_launch(const idx_params_t &p, dim3 grid, cudaStream_t s, int pdl,
                                     int fast);
/* The same keys by warpgroup MMAs (sm90a/indexer_wgmma.cu), in fast mode with fast set, where
 * dsv4__indexer_wg_ready() says the current device runs that kernel (compute capability 9.0, whose
 * sm_90a image it has, granting its shared memory). */
cudaError_t dsv4__indexer_wg_launch(const idx_params_t &p, dim3 grid, cudaStream_t s, int pdl,
                                    int fast);
int dsv4__indexer_wg_ready(void);
/* The query kernel before it (indexer_mma.cu): the q^ rows, weights and summaries of the wave's
 * tokens (one slot each, ctas of them) into the end of their key slots. */
cudaError_t dsv4__indexer_query_launch(const idx_params_t &p, uint32_t ctas, cudaStream_t s,
                                       int pdl);
/* The first wave's query kernel and the launch's check (check_ctas CTAs of CHECK_BLOCK threads,
 * indexer_check_item) as one launch (indexer_mma.cu). */
cudaError_t dsv4__indexer_check_query_launch(const idx_params_t &p, uint32_t ctas,
                                             uint32_t check_ctas, cudaStream_t s, int pdl);
/* Whether the current device grants a CTA the kernel's shared memory (about 220 KiB: compute
 * capability 9.0 and 10.0 do). */
int dsv4__indexer_mma_fits(void);

#endif /* DSV4_KERNELS_CUDA_INDEXER_COMMON_CUH */
