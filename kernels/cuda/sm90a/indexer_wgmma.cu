/*
 * The indexer's scores on Hopper's warpgroup MMAs (SPEC §8.5, §8.9): the keys of the tensor-core
 * score kernel (indexer_mma.cu) in both modes, bit for bit, for the same grid of (token, split)
 * CTAs, waves and key slots. Built for sm_90a only (wgmma has no other target);
 * dsv4__indexer_wg_ready says whether the current device runs it.
 *
 * With mma.sync each warp held the token's q^ as A fragments (128 registers for 64 heads), which
 * capped that kernel at 8 warps an SM, one after the other building its fragments, issuing its MMAs
 * and summing (tests/bench/NOTES.md, "The indexer's n-tiles two at a time"). Here the MMA is
 * transposed: D[entry][head] = entries (A, M = 64 a tile) x q^ (B, N = 64 heads), both operands in
 * shared memory in wgmma's canonical K-major layout without swizzle (8 rows x 16 bytes a core
 * matrix; core matrices 1 KiB apart along K, 128 bytes apart along M or N), so one copy of q^
 * serves every warpgroup and the accumulators (32 floats a thread a tile) are the only MMA state
 * in registers.
 *
 * The CTA's three warpgroups (384 threads; 168 registers a thread) take the split's rounds of 128
 * entries in turn, each at its own pace, with its own barrier: while one converts, another's MMAs
 * run. A warpgroup stages its next round by cp.async a round ahead (indexer-mx.cuh); each of its
 * warps takes the mode of its 32 entries (warp_mode, at most p.mma_cap) and turns their nibbles
 * into bf16 values of the round's two tiles (the byte table of their codes, dsv4_index_mx_bf16x4).
 * Each tile then runs in the lower mode of its two warps (each gives the same d, dsv4-compress.h):
 *   fused    the 8 k-steps of 16 dims accumulated in the tensor cores, d exactly;
 *   partial  each k-step's 16 dims from zero on mma.sync (ldmatrix fragments), dsv4_fold8's adds;
 *   scalar   dsv4_dot128 of the dequantised entry, a warp an entry, two heads a lane.
 * Both tiles' fused MMAs are issued whatever their modes, before either is waited for: an MMA on a
 * path the compiler cannot prove the whole warpgroup takes (a branch on the mode, or a predicate)
 * makes it serialize every MMA of the kernel. So spread index codes (every tile in partial mode)
 * cost more tensor time here than on indexer_mma.cu, which is then the quicker
 * (tests/bench/NOTES.md); the compressor's codes, within one of each other, are mostly fused.
 *
 * q^'s columns are permuted so that the thread of quad lane c holds, for its two entries of a
 * tile, heads 16m + 4c .. 16m + 4c + 3 of each m = 0..3 (column 8j + 2c + b is head
 * 16(j / 2) + 2(2c + j % 2) + b), which are fast mode's partials P(2c) and P(2c + 1): each thread
 * sums them in SPEC §8.9's order, adds the two (g with g ^ 1), and the quad's shuffles add g ^ 2,
 * then g ^ 4, the same tree as indexer_mma.cu's. Exact mode's chain over the heads in order runs
 * around the quad instead, four heads a lane at a time. A warp of 32 entries whose own mode is
 * scalar keeps exact mode's chain in fast mode, as there.
 *
 * Ordering (SPEC §5.2): the byte table is built before the dependency wait (it reads nothing); the
 * query rows, the records and the error word are read after it, as in indexer_mma.cu.
 */
#include "../indexer-mx.cuh"

#include <atomic>

/* Without sm_90a's features the MMAs below would compile to nothing (CMake builds this file for
 * that architecture alone). */
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90a/indexer_wgmma.cu is built for sm_90a only"
#endif

/* Entries a wgmma tile (its M); a warpgroup's round is two tiles, and the CTA's three warpgroups
 * take the split's rounds in turn, each at its own pace. */
#define WG_TILE 64
#define WG_GROUPS 3
#define WG_THREADS (128 * WG_GROUPS)
#define WG_ROUND (2 * WG_TILE)
/* Bytes of a K-major bf16 operand of 64 rows: 16 core-matrix columns of 8 core matrices. */
#define WG_OPERAND (WG_TILE * DSV4_INDEX_DIM * 2)
#define WG_KSTEP 2048u /* bytes between two k-steps' first core matrices (16 dims) */
#define WG_LBO 1024u   /* between core matrices adjacent along K */
#define WG_SBO 128u    /* between core matrices adjacent along M or N */

static_assert(MMA_HEADS == WG_TILE, "q^'s 64 heads are the MMA's N");

/* A warpgroup's part of the shared memory. */
typedef struct {
  uint8_t ent[2][WG_OPERAND]; /* the round's entries, bf16: A of its two tiles */
  uint8_t stage[2][WG_ROUND * STAGE_ROW];
  uint32_t codes[2][WG_ROUND];
  int mode[4];                   /* each warp's 32 entries' mode this round */
  float row[4][MMA_HEADS];       /* the scalar product: an entry's d */
  float kbuf[4][DSV4_INDEX_DIM]; /* the scalar product: the entry dequantised */
} wg_group_t;

typedef struct {
  wg_group_t g[WG_GROUPS];
  uint8_t q[WG_OPERAND]; /* q^, bf16, columns permuted: B */
  uint4 lut[256];        /* dsv4_index_mx_lut of every code */
  float w[MMA_HEADS];    /* by head */
  float wcol[MMA_HEADS]; /* by q^'s column */
  uint32_t qsum[MMA_HEADS];
  uint32_t qstat[4];
} wg_smem_t;

static_assert(sizeof(wg_smem_t) % 16 == 0, "whole 16-byte chunks");
/* An sm_90 CTA's shared memory at most (227 KiB), below the 256 KiB that a descriptor's address
 * field spans (wg_desc, tile_fused). */
static_assert(sizeof(wg_smem_t) <= 227 * 1024, "the kernel's shared memory fits a CTA");

/* The byte offset of element (row r, dim k) in a canonical operand. */
static __device__ __forceinline__ uint32_t wg_off(uint32_t r, uint32_t k) {
  return (k / 8) * WG_LBO + (r / 8) * WG_SBO + (r % 8) * 16 + (k % 8) * 2;
}

/* The head of q^'s column n (see the header). */
static __device__ __forceinline__ uint32_t head_of_col(uint32_t n) {
  const uint32_t j = n / 8, c = (n % 8) / 2, b = n % 2;
  return 16 * (j / 2) + 2 * (2 * c + j % 2) + b;
}

/* The column of head h: head_of_col's inverse. */
static __device__ __forceinline__ uint32_t col_of_head(uint32_t h) {
  const uint32_t m = h / 16, g = (h % 16) / 2, b = h % 2;
  return 8 * (2 * m + g % 2) + 2 * (g / 2) + b;
}

/* A shared-memory matrix descriptor of a canonical operand at p (no swizzle). */
static __device__ __forceinline__ uint64_t wg_desc(const void *p) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  return (uint64_t)((a >> 4) & 0x3FFFu) | (uint64_t)((WG_LBO >> 4) & 0x3FFFu) << 16 |
         (uint64_t)((WG_SBO >> 4) & 0x3FFFu) << 32;
}

#define WG_R8(i)                                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),      \
      "+f"(d[i + 6]), "+f"(d[i + 7])

/* One m64n64k16 step: d (+)= A . B^T, accumulating when acc. */
static __device__ __forceinline__ void wg_mma(float (&d)[32], uint64_t a, uint64_t b, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "%32, %33, p, 1, 1, 0, 0;\n}\n"
               : WG_R8(0), WG_R8(8), WG_R8(16), WG_R8(24)
               : "l"(a), "l"(b), "r"(acc));
#else
  (void)d, (void)a, (void)b, (void)acc;
#endif
}

static __device__ __forceinline__ void wg_fence(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void wg_commit(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

/* Until at most N of the warpgroup's MMA groups are pending; then d's registers are read only
 * after it (the empty asm ties them to this point). */
template <int N> static __device__ __forceinline__ void wg_wait(float (&d)[32]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
#pragma unroll
  for (int i = 0; i < 32; i++)
    asm volatile("" : "+f"(d[i])::"memory");
}

/* Generic-proxy stores to shared memory made visible to the MMAs' reads (before a barrier). */
static __device__ __forceinline__ void wg_proxy_fence(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/* The warpgroup's barrier (named barrier 1 + G, its 128 threads). */
static __device__ __forceinline__ void wg_sync(uint32_t g) {
  asm volatile("bar.sync %0, 128;" ::"r"(1 + g) : "memory");
}

/* The fused mode's 8 k-steps into d: da and dq the descriptors of the tile's and q^'s first
 * k-step (a k-step further is WG_KSTEP >> 4 more in the address field, which does not carry out of
 * it below 256 KiB). */
static __device__ __forceinline__ void tile_fused(float (&d)[32], uint64_t da, uint64_t dq) {
#pragma unroll
  for (int l = 0; l < 8; l++)
    wg_mma(d, da + l * (WG_KSTEP >> 4), dq + l * (WG_KSTEP >> 4), l > 0);
  wg_commit();
}

/* ldmatrix of four 8x8 b16 matrices: lane i gives row i % 8 of matrix i / 8 at p. */
static __device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"((uint32_t)__cvta_generic_to_shared(p)));
}

/*
 * Partial mode for T tiles (1 or 2: both of the round's where both are in it): d[k] = dsv4_fold8
 * of the 8 partials of 16 dims of tile k, ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)), each
 * an mma.sync m16n8k16 from zero. The warp's own 16 rows of each tile (16w..) against the 8 n-tiles
 * of q^'s columns: mma.sync's results of n-tile j are registers 4j..4j + 3 of the warpgroup MMA's
 * layout, so tiles_keys takes them as they are. The fragments come from the operands by ldmatrix
 * (a core matrix is an 8x8 matrix of it); the tiles' A fragments stay in registers, and each
 * n-tile's B fragments, read from shared memory by every warp, serve both tiles.
 */
template <int T>
static __device__ __forceinline__ void tiles_partial(float (&d0)[32], float (&d1)[32],
                                                     const uint8_t *a0, const uint8_t *a1,
                                                     const uint8_t *q) {
  const uint32_t lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, mi = lane / 8;
  /* a[0..3] of partial l: rows 0-7 / 8-15 of dims 16l.., then of 16l + 8.. */
  const uint32_t aoff = wg_off(16 * w + 8 * (mi % 2) + lane % 8, 8 * (mi / 2));
  uint32_t af[T][8][4];
  float res[T][32]; /* indexed by the n-tile, a runtime value: in local memory */
#pragma unroll
  for (int k = 0; k < T; k++)
#pragma unroll
    for (int l = 0; l < 8; l++)
      ldsm4(af[k][l], (k ? a1 : a0) + aoff + l * WG_KSTEP);
#pragma unroll 1
  for (int j = 0; j < 8; j++) {
    /* dsv4_fold8's pairs in its order: s = (p0 + p4) + (p2 + p6), then t = (p1 + p5) + (p3 + p7),
     * s + t; each pair's B fragments in one load (partials l and l + 4). */
    float s[T][4], t[T][4];
#pragma unroll
    for (int pr = 0; pr < 4; pr++) {
      const int l = pr == 0 ? 0 : pr == 1 ? 2 : pr == 2 ? 1 : 3;
      uint32_t b[4]; /* b0, b1 of partial l, then of l + 4: columns 8j.. */
      ldsm4(b, q + wg_off(8 * j + lane % 8, 16 * (l + 4 * (mi / 2)) + 8 * (mi % 2)));
#pragma unroll
      for (int k = 0; k < T; k++) {
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f}, y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma16816(x, af[k][l], b[0], b[1]);
        mma16816(y, af[k][l + 4], b[2], b[3]);
        float *acc = pr < 2 ? s[k] : t[k];
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const float v = __fadd_rn(x[i], y[i]);
          acc[i] = pr % 2 ? __fadd_rn(acc[i], v) : v;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < T; k++)
#pragma unroll
      for (int i = 0; i < 4; i++)
        res[k][4 * j + i] = __fadd_rn(s[k][i], t[k][i]);
  }
#pragma unroll
  for (int i = 0; i < 32; i++) { /* every element written: d's old values are dead before */
    d0[i] = res[0][i];
    if (T == 2)
      d1[i] = res[T - 1][i];
  }
}

/*
 * The keys of the round's two tiles from d (rows g and g + 8 of the thread's warp in each), the
 * weights of the thread's columns read once for its four rows; lane c = 0 stores row g's key,
 * c = 1 row g + 8's, of a tile in `on` whose entry index is below i1.
 *
 * FAST: each thread's partials P(2c) and P(2c + 1) in order and their sum, then the quad's (see the
 * header), its rows' sums added crosswise: after lanes c and c ^ 1 exchange the row the other
 * keeps, the even lanes hold row g's, the odd ones row g + 8's, the same tree's values.
 *
 * Exact mode: each entry's chain over the heads in order (h = 0..63 from +0.0f) passed around its
 * quad, four terms at lane 0, then lane 1, 2, 3, for m = 0..3 (lane c holds heads 16m + 4c ..
 * 16m + 4c + 3); every lane computes a step from the value its quad's lane of the step broadcast,
 * and only that lane's is passed on.
 */
template <bool FAST>
static __device__ __forceinline__ void tiles_keys(const float (&d)[2][32], const float *wcol,
                                                  const bool (&on)[2], uint32_t *keys, uint32_t i0,
                                                  uint32_t i1) {
  const uint32_t lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, w = (threadIdx.x >> 5) & 3;
  float s[2][2][2] = {}; /* [tile][row][P(2c), P(2c + 1)], or the chain in [..][0] */
#pragma unroll
  for (int m = 0; m < 4; m++) {
    const int j0 = 2 * m, j1 = 2 * m + 1;
    const float2 w0 = *reinterpret_cast<const float2 *>(wcol + 8 * j0 + 2 * c),
                 w1 = *reinterpret_cast<const float2 *>(wcol + 8 * j1 + 2 * c);
#pragma unroll
    for (uint32_t step = 0; step < (FAST ? 1u : 4u); step++)
#pragma unroll
      for (int k = 0; k < 2; k++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
          float *x = s[k][r];
          const int e = FAST ? 1 : 0; /* the exact chain stays in x[0] */
          x[0] = dsv4_index_score_add(w0.x, d[k][4 * j0 + 2 * r], x[0]);
          x[0] = dsv4_index_score_add(w0.y, d[k][4 * j0 + 2 * r + 1], x[0]);
          x[e] = dsv4_index_score_add(w1.x, d[k][4 * j1 + 2 * r], x[e]);
          x[e] = dsv4_index_score_add(w1.y, d[k][4 * j1 + 2 * r + 1], x[e]);
          if (!FAST) /* lane step's were heads 16m + 4 step .. + 3 */
            x[0] = __shfl_sync(FULL, x[0], (lane & ~3u) | step);
        }
  }
#pragma unroll
  for (int k = 0; k < 2; k++) {
    float t;
    if (FAST) {
      const float t0 = __fadd_rn(s[k][0][0], s[k][0][1]), t1 = __fadd_rn(s[k][1][0], s[k][1][1]);
      const bool odd = c & 1;
      t = __fadd_rn(odd ? t1 : t0, __shfl_xor_sync(FULL, odd ? t0 : t1, 1));
      t = __fadd_rn(t, __shfl_xor_sync(FULL, t, 2));
    } else {
      t = c ? s[k][1][0] : s[k][0][0];
    }
    const uint32_t i = i0 + WG_TILE * k + 16 * w + g + 8 * c;
    if (on[k] && c < 2 && i < i1)
      keys[i] = dsv4_index_score_key(t);
  }
}

/* Warp w's 32 entries of its warpgroup's round (rows 32w..) into tile w / 2's rows 32(w % 2)..,
 * bf16: lane l takes entry l, a block of 32 dims at a time (its 16 value bytes in one load, the
 * byte table of its code), and stores 4 rows of 8 dims; the 8 lanes of a quarter write the 8 rows
 * of one core matrix, and read stage rows in distinct banks. */
static __device__ void warp_convert(wg_group_t &gr, const uint4 *lut, int buf) {
  const uint32_t w = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, r = 32 * w + lane;
  const uint8_t *row = gr.stage[buf] + r * STAGE_ROW;
  const uint32_t c4 = gr.codes[buf][r];
  uint8_t *ent = gr.ent[w / 2] + wg_off(32 * (w % 2) + lane, 0);
#pragma unroll
  for (uint32_t k = 0; k < DSV4_MXFP4_BLOCKS; k++) {
    const uint4 x = *reinterpret_cast<const uint4 *>(row + 16 * k);
    const uint4 t = lut[(c4 >> (8 * k)) & 255u];
    const uint32_t tw[4] = {t.x, t.y, t.z, t.w}, xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (uint32_t j = 0; j < 4; j++) { /* dims 32k + 8j .. + 7 */
      uint4 v;
      dsv4_index_mx_bf16x4(xw[j] & 0xffffu, tw, &v.x, &v.y);
      dsv4_index_mx_bf16x4(xw[j] >> 16, tw, &v.z, &v.w);
      *reinterpret_cast<uint4 *>(ent + (4 * k + j) * WG_LBO) = v;
    }
  }
}

/* dsv4_dot128(q^ of column col, kb): the same 8 fma chains of 16 dims from +0.0f and
 * dsv4_fold8, q^'s bf16 values (exact) read from the B operand. */
static __device__ float dot128_q(const uint8_t *q, uint32_t col, const float *kb) {
  float p[8];
#pragma unroll
  for (int l = 0; l < 8; l++) {
    float acc = 0.0f;
#pragma unroll 4
    for (uint32_t k = 0; k < 16; k++) {
      const uint32_t dim = 16 * l + k;
      const uint16_t bits = *reinterpret_cast<const uint16_t *>(q + wg_off(col, dim));
      acc = DSV4_FMA(__uint_as_float((uint32_t)bits << 16), kb[dim], acc);
    }
    p[l] = acc;
  }
  return dsv4_fold8(p);
}

/* The scalar product for the warp's 16 rows of its warpgroup's tile h (round rows 64h + 16w..):
 * per entry, d of two heads a lane into row, then its key, by its own warp's mode: exact mode's
 * chain (lane 0, the heads in order) for a warp of the scalar product, else fast mode's order
 * (lanes 0..7 the partials P(g), a tree of shuffles). */
template <bool FAST>
static __device__ void tile_scalar(const wg_smem_t &sm, wg_group_t &gr, int buf, uint32_t h,
                                   uint32_t n, uint32_t *keys, uint32_t base, uint32_t i1) {
  const uint32_t lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  float *kb = gr.kbuf[w], *row = gr.row[w];
  for (uint32_t e = 0; e < 16; e++) {
    const uint32_t r = WG_TILE * h + 16 * w + e;
    if (r >= n)
      break; /* warp-uniform */
    const uint8_t *v = gr.stage[buf] + r * STAGE_ROW + 2 * lane;
    const float scale = dsv4_ue8m0_scale((uint8_t)(gr.codes[buf][r] >> (8 * (lane / 8))));
    kb[4 * lane] = dsv4_e2m1_to_f32((uint8_t)(v[0] & 15u)) * scale;
    kb[4 * lane + 1] = dsv4_e2m1_to_f32((uint8_t)(v[0] >> 4)) * scale;
    kb[4 * lane + 2] = dsv4_e2m1_to_f32((uint8_t)(v[1] & 15u)) * scale;
    kb[4 * lane + 3] = dsv4_e2m1_to_f32((uint8_t)(v[1] >> 4)) * scale;
    __syncwarp();
    for (uint32_t hd = lane; hd < MMA_HEADS; hd += 32)
      row[hd] = dot128_q(sm.q, col_of_head(hd), kb);
    __syncwarp();
    float acc = 0.0f;
    if (!FAST || gr.mode[r / 32] == DSV4_INDEX_MX_SCALAR) {
      if (lane == 0)
        for (uint32_t hd = 0; hd < MMA_HEADS; hd++)
          acc = dsv4_index_score_add(sm.w[hd], row[hd], acc);
    } else {
      const uint32_t g = lane % 8;
      for (uint32_t m = 0; m < 4; m++) {
        acc = dsv4_index_score_add(sm.w[16 * m + 2 * g], row[16 * m + 2 * g], acc);
        acc = dsv4_index_score_add(sm.w[16 * m + 2 * g + 1], row[16 * m + 2 * g + 1], acc);
      }
      for (uint32_t x = 1; x < 8; x <<= 1)
        acc = __fadd_rn(acc, __shfl_xor_sync(FULL, acc, x));
    }
    if (lane == 0 && base + r < i1)
      keys[base + r] = dsv4_index_score_key(acc);
    __syncwarp();
  }
}

/* The token's q^ into sm.q (bf16, columns permuted), its weights, summaries and statistics: the
 * query kernel's rows of slot blockIdx.x (after the dependency wait); the q^ values are bf16
 * numbers, so their top halves are exact. */
static __device__ void token_setup(const idx_params_t &p, wg_smem_t &sm) {
  const float *src = slot_queries(p, blockIdx.x);
  for (uint32_t i = threadIdx.x; i < MMA_HEADS * DSV4_INDEX_DIM / 4; i += WG_THREADS) {
    const uint32_t n = i / (DSV4_INDEX_DIM / 4), k = 4 * (i % (DSV4_INDEX_DIM / 4));
    const float4 x = __ldcg(reinterpret_cast<const float4 *>(src + head_of_col(n) * QROW + k));
    const uint2 v = make_uint2(__float_as_uint(x.x) >> 16 | (__float_as_uint(x.y) & 0xffff0000u),
                               __float_as_uint(x.z) >> 16 | (__float_as_uint(x.w) & 0xffff0000u));
    *reinterpret_cast<uint2 *>(sm.q + wg_off(n, k)) = v;
  }
  for (uint32_t h = threadIdx.x; h < MMA_HEADS; h += WG_THREADS) {
    sm.w[h] = __ldcg(src + h * QROW + DSV4_INDEX_DIM);
    sm.wcol[col_of_head(h)] = sm.w[h];
    sm.qsum[h] = __float_as_uint(__ldcg(src + h * QROW + DSV4_INDEX_DIM + 1));
  }
  __syncthreads();
  if (threadIdx.x < 32)
    heads_stats(sm.qsum, sm.qstat);
  wg_proxy_fence();
  __syncthreads(); /* the statistics, for every warpgroup's modes */
}

/* The warpgroup's two tiles of its staged round (entries base + row, n in the round), each in the
 * lower mode of its two warps: both tiles' fused MMAs issued whatever their modes (a tile past the
 * round's entries or of another mode wastes them, the tensor cores being otherwise idle), so that
 * no MMA lies on a path the compiler cannot prove the warpgroup takes together (it would serialize
 * them all); then partial mode's mma.sync where a tile needs it, and each tile's keys. */
template <bool FAST>
static __device__ void wg_round(const idx_params_t &p, const wg_smem_t &sm, wg_group_t &gr, int buf,
                                uint32_t n, uint32_t *keys, uint32_t base, uint32_t i1, uint32_t s,
                                int64_t jlo) {
  float d[2][32];
  const uint64_t dq = wg_desc(sm.q);
  wg_fence();
  tile_fused(d[0], wg_desc(gr.ent[0]), dq);
  tile_fused(d[1], wg_desc(gr.ent[1]), dq);
  /* The next round's records while the MMAs run: their addresses' loads wait here, not before the
   * conversion. stage[buf ^ 1] was last read in the round before (the top barrier passed). */
  const uint32_t next = base + WG_GROUPS * WG_ROUND;
  if (next < i1)
    stage_round(p, s, jlo, next, min(i1, next + WG_ROUND), gr.stage[buf ^ 1], gr.codes[buf ^ 1],
                threadIdx.x & 127);
  wg_wait<1>(d[0]);
  wg_wait<0>(d[1]);
  const bool two = WG_TILE < n;
  const int m0 = min(gr.mode[0], gr.mode[1]);
  const int m1 = two ? min(gr.mode[2], gr.mode[3]) : DSV4_INDEX_MX_FUSED;
  if (m0 == DSV4_INDEX_MX_PARTIAL && m1 == DSV4_INDEX_MX_PARTIAL)
    tiles_partial<2>(d[0], d[1], gr.ent[0], gr.ent[1], sm.q);
  else if (m0 == DSV4_INDEX_MX_PARTIAL)
    tiles_partial<1>(d[0], d[0], gr.ent[0], gr.ent[0], sm.q);
  else if (m1 == DSV4_INDEX_MX_PARTIAL)
    tiles_partial<1>(d[1], d[1], gr.ent[1], gr.ent[1], sm.q);
  const bool on[2] = {m0 != DSV4_INDEX_MX_SCALAR, two && m1 != DSV4_INDEX_MX_SCALAR};
  tiles_keys<FAST>(d, sm.wcol, on, keys, base, i1);
  if (m0 == DSV4_INDEX_MX_SCALAR)
    tile_scalar<FAST>(sm, gr, buf, 0, n, keys, base, i1);
  if (two && m1 == DSV4_INDEX_MX_SCALAR)
    tile_scalar<FAST>(sm, gr, buf, 1, n, keys, base, i1);
}

/* Split y of token t_base + blockIdx.x: the queries, then warpgroup G's rounds of WG_ROUND
 * entries, the split's rounds G, G + WG_GROUPS, .. */
template <bool FAST>
__global__ void __launch_bounds__(WG_THREADS, 1) dsv4__indexer_score_wg_kernel(idx_params_t p) {
  extern __shared__ uint4 smem_raw[];
  wg_smem_t &sm = *reinterpret_cast<wg_smem_t *>(smem_raw);
  mx_lut_build(sm.lut, WG_THREADS);
  uint32_t t, s, i0, i1;
  int64_t jlo;
  if (!score_begin(p, &t, &s, &jlo, &i0, &i1))
    return;
  const uint32_t G = threadIdx.x >> 7, tid = threadIdx.x & 127, W = (threadIdx.x >> 5) & 3;
  wg_group_t &gr = sm.g[G];
  uint32_t base = i0 + WG_ROUND * G;
  if (base < i1)
    stage_round(p, s, jlo, base, min(i1, base + WG_ROUND), gr.stage[0], gr.codes[0], tid);
  token_setup(p, sm);
  uint32_t *keys = p.keys + (uint64_t)blockIdx.x * p.keys_per_cta;
  /* Round k of the warpgroup: its records staged in stage[k & 1] during round k - 1. Its barrier
   * at the top of a round separates the records' arrival and the last round's MMAs and scalar
   * products (every reader of ent, row, kbuf and that round's stage) from this round's writes. */
  for (int buf = 0; base < i1; buf ^= 1, base += WG_GROUPS * WG_ROUND) {
    dsv4__cp_async_wait_all();
    wg_sync(G);
    const uint32_t n = min(i1 - base, (uint32_t)WG_ROUND);
    if (32 * W < n) { /* warp-uniform */
      const int mode = warp_mode(sm.qstat, gr.stage[buf], gr.codes[buf], 32 * W,
                                 min(n - 32 * W, 32u), p.mma_cap);
      if ((threadIdx.x & 31) == 0)
        gr.mode[W] = mode;
      warp_convert(gr, sm.lut, buf);
    } else if ((threadIdx.x & 31) == 0) {
      gr.mode[W] = DSV4_INDEX_MX_FUSED; /* no entries: the tile's other warp decides */
    }
    wg_proxy_fence();
    wg_sync(G);
    wg_round<FAST>(p, sm, gr, buf, n, keys, base, i1, s, jlo);
  }
}

static std::atomic<int> ready_cache[DEV_CACHE];

/* The kernel's only image is sm_90a's: elsewhere its attributes cannot be read. */
static int wg_ready_probe(int dev) {
  cudaFuncAttributes fa;
  return cudaFuncGetAttributes(&fa, dsv4__indexer_score_wg_kernel<true>) == cudaSuccess &&
         smem_grants(dev, sizeof(wg_smem_t));
}

int dsv4__indexer_wg_ready(void) {
  return per_device_cached(ready_cache, wg_ready_probe);
}

cudaError_t dsv4__indexer_wg_launch(const idx_params_t &p, dim3 grid, cudaStream_t s, int pdl,
                                    int fast) {
  /* The devices whose limit is raised, per kernel. */
  static std::atomic<uint64_t> limit_raised[2] = {{0}, {0}};
  void (*kernel)(idx_params_t) =
      fast ? dsv4__indexer_score_wg_kernel<true> : dsv4__indexer_score_wg_kernel<false>;
  cudaError_t e = dsv4__cuda_smem_limit(kernel, sizeof(wg_smem_t), limit_raised[fast ? 1 : 0]);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(kernel, grid, WG_THREADS, sizeof(wg_smem_t), s, pdl, p);
}
