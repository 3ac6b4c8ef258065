#ifndef DSV4_KERNELS_CUDA_INDEXER_MX_CUH
#define DSV4_KERNELS_CUDA_INDEXER_MX_CUH
/*
 * What the indexer's two tensor-core score kernels share (indexer_mma.cu: mma.sync on compute
 * capability 8.0 and newer; sm90a/indexer_wgmma.cu: warpgroup MMAs on 9.0): a round's index
 * records staged into shared memory by cp.async, and the choice of a warp's mode from the
 * summaries of its entries' and the heads' blocks (dsv4_index_mx_mode).
 */
#include "indexer-common.cuh"

/* Entries a staged round: one a thread of the CTA. */
#define STAGE_ENTRIES SEL_THREADS
/* Bytes per staged record's values: 64 and a pad, 16-byte aligned for cp.async. */
#define STAGE_ROW 80

/* The records of entries jlo + i, i in [b0, b1), of the segment of table tb into rows i - b0 of
 * stage and codes, a thread an entry (tid: the thread's row, from 0 for the first of the threads
 * that stage): 4 copies of 16 value bytes and one of the 4 codes. */
static __device__ void stage_round(const idx_params_t &p, const dsv4__seg_table_t &tb, int64_t jlo,
                                   uint32_t b0, uint32_t b1, uint8_t *stage, uint32_t *codes,
                                   uint32_t tid) {
  const uint32_t i = b0 + tid;
  if (i < b1) {
    const uint8_t *vals, *c;
    entry_record(p, tb, jlo + i, &vals, &c);
    uint8_t *row = stage + tid * STAGE_ROW;
#pragma unroll
    for (int k = 0; k < 4; k++)
      dsv4__cp_async16(row + 16 * k, vals + 16 * k);
    dsv4__cp_async<4>(codes + tid, c);
  }
  dsv4__cp_async_commit();
}

/* dsv4_index_mx_lut of every code into lut[256], by the CTA's nthreads threads (it reads
 * nothing: before the dependency wait). */
static __device__ __forceinline__ void mx_lut_build(uint4 *lut, uint32_t nthreads) {
  for (uint32_t c = threadIdx.x; c < 256; c += nthreads) {
    uint32_t t[4];
    dsv4_index_mx_lut(c, t);
    lut[c] = make_uint4(t[0], t[1], t[2], t[3]);
  }
}

/* The statistics of a set of summaries, one a lane (absent lanes with in false): per-block minima
 * of the nonzero bytes (255 where none), maxima and the largest span, as dsv4_index_mx_mode takes
 * them. Every lane returns them. */
static __device__ void warp_stats(uint32_t sum, bool in, uint32_t *lo, uint32_t *hi,
                                  uint32_t *span) {
  *lo = *hi = 0;
#pragma unroll
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    const uint32_t c = in ? (sum >> (8 * b)) & 255u : 0u;
    *lo |= __reduce_min_sync(FULL, c ? c : 255u) << (8 * b);
    *hi |= __reduce_max_sync(FULL, c) << (8 * b);
  }
  *span = __reduce_max_sync(FULL, in ? dsv4_index_mx_span(sum) : 0u);
}

/* The summary of a staged record (dsv4_index_mx_summary from words). */
static __device__ uint32_t staged_summary(const uint8_t *row, uint32_t codes) {
  const uint4 *v = reinterpret_cast<const uint4 *>(row);
  uint32_t sum = 0;
#pragma unroll
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    const uint4 x = v[b];
    const bool nz = ((x.x | x.y | x.z | x.w) & 0x77777777u) != 0;
    sum |= dsv4_index_mx_block(nz, (codes >> (8 * b)) & 255u) << (8 * b);
  }
  return sum;
}

/* The heads' statistics from their summaries (qsum, MMA_HEADS of them), by the CTA's first warp:
 * the per-block minima and maxima and the largest span into qstat[0..2]; into qstat[3] the
 * largest of the maxima (bits 0..7: DSV4_INDEX_MX_INVALID where some block is) and the smallest
 * of the minima (bits 8..15), for warp_mode's first look. */
static __device__ void heads_stats(const uint32_t *qsum, uint32_t *qstat) {
  /* Two heads a lane: the statistics of the lanes' first and second heads, then both. */
  uint32_t lo[2], hi[2], span[2];
  warp_stats(qsum[threadIdx.x], true, &lo[0], &hi[0], &span[0]);
  warp_stats(qsum[threadIdx.x + 32], true, &lo[1], &hi[1], &span[1]);
  if (threadIdx.x == 0) {
    uint32_t l = 0, h = 0;
    for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
      l |= min((lo[0] >> (8 * b)) & 255u, (lo[1] >> (8 * b)) & 255u) << (8 * b);
      h |= max((hi[0] >> (8 * b)) & 255u, (hi[1] >> (8 * b)) & 255u) << (8 * b);
    }
    qstat[0] = l;
    qstat[1] = h;
    qstat[2] = max(span[0], span[1]);
    uint32_t hmax, lmin, unused;
    dsv4_index_mx_range(h, &hmax, &unused);
    dsv4_index_mx_range(l, &unused, &lmin);
    qstat[3] = hmax | lmin << 8;
  }
}

/* Whether the warp's entries pass dsv4_index_mx_fused_glance: each lane's largest code, smallest
 * code and largest span, reduced over the warp, against the heads' statistics (heads_stats). */
static __device__ __forceinline__ bool warp_glance(const uint32_t *qstat, uint32_t khi,
                                                   uint32_t klo, uint32_t kspan) {
  khi = __reduce_max_sync(FULL, khi);
  klo = __reduce_min_sync(FULL, klo);
  kspan = __reduce_max_sync(FULL, kspan);
  return dsv4_index_mx_fused_glance(qstat[3] & 255u, (qstat[3] >> 8) & 255u, qstat[2], khi, klo,
                                    kspan);
}

/*
 * The mode of the warp's rows r0..r0 + rows - 1 of a staged round: what its entries' summaries
 * and the heads' statistics (heads_stats) allow, at most cap. Fused mode at a first look from the
 * codes alone (dsv4_index_mx_code_range: every block taken as nonzero; no value byte read), else
 * at a second from the summaries' extremes (each look three reductions, warp_glance), else the
 * per-block statistics decide (dsv4_index_mx_mode, nine). Each look that passes implies the next,
 * so the mode is the per-block statistics' in every case.
 */
static __device__ __forceinline__ int warp_mode(const uint32_t *qstat, const uint8_t *stage,
                                                const uint32_t *codes, uint32_t r0, uint32_t rows,
                                                uint32_t cap) {
  const uint32_t lane = threadIdx.x & 31;
  const bool in = lane < rows;
  const uint32_t c4 = in ? codes[r0 + lane] : 0u;
  uint32_t khi = 0u, klo = 255u, kspan = 0u;
  if (in)
    dsv4_index_mx_code_range(c4, &khi, &klo, &kspan);
  int mode = DSV4_INDEX_MX_FUSED;
  if (!warp_glance(qstat, khi, klo, kspan)) {
    const uint32_t sum = in ? staged_summary(stage + (r0 + lane) * STAGE_ROW, c4) : 0u;
    dsv4_index_mx_range(sum, &khi, &klo);
    if (!warp_glance(qstat, khi, klo, dsv4_index_mx_span(sum))) {
      uint32_t lo, hi, span;
      warp_stats(sum, in, &lo, &hi, &span);
      mode = dsv4_index_mx_mode(qstat[0], qstat[1], qstat[2], lo, hi, span);
    }
  }
  return mode < (int)cap ? mode : (int)cap;
}

#endif /* DSV4_KERNELS_CUDA_INDEXER_MX_CUH */
