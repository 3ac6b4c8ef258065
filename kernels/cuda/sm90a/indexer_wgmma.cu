/*
 * The indexer's scores on Hopper's warpgroup MMAs (SPEC §8.5, §8.9): the keys of the tensor-core
 * score kernel (indexer_mma.cu) in both modes, bit for bit, for the same grid of (token, split)
 * CTAs, waves and key slots. Built for sm_90a only (wgmma has no other target);
 * dsv4__indexer_wg_ready says whether the current device runs it.
 *
 * With mma.sync each warp held the token's q^ as A fragments (128 registers for 64 heads), which
 * capped that kernel at 8 warps an SM, one after the other building its fragments, issuing its MMAs
 * and summing (tests/bench/NOTES.md, "The indexer's n-tiles two at a time"). Here the MMA is
 * transposed: D[entry][head] = entries (A, M = 64 a tile) x q^ (B, N = 64 heads). q^ sits in
 * shared memory in wgmma's canonical K-major layout without swizzle (8 rows x 16 bytes a core
 * matrix; core matrices 1 KiB apart along K, 128 bytes apart along N), one copy for every
 * warpgroup; the entries are A fragments in registers, each warp converting its own 16 rows of a
 * tile from its own staged records, so the warps of a warpgroup share no buffer and no barrier:
 * only the MMAs' warpgroup-wide instructions (fence, issue, commit, wait) bring them together.
 *
 * The CTA's four warpgroups (512 threads) take the split's rounds of 128 entries in turn, each at
 * its own pace: while one converts, another's MMAs run. Warp w of a warpgroup owns the round's
 * entries 32w .. 32w + 31, staged by its own lanes by cp.async a round ahead (indexer-mx.cuh),
 * takes their mode (warp_mode, at most p.mma_cap) and is rows 16w .. 16w + 15 of the round's two
 * tiles in turn (its entries 32w + 16t .. in tile t). A lane turns its two rows' nibbles into bf16
 * values on the byte tables of their codes (dsv4_index_mx_bf16x8), which are its A fragments;
 * then, in the warp's mode (each gives the same d, dsv4-compress.h):
 *   fused    the 8 k-steps of 16 dims accumulated in the tensor cores, d exactly;
 *   partial  each k-step's 16 dims from zero on mma.sync (the same A fragments), dsv4_fold8's adds;
 *   scalar   dsv4_dot128 of the dequantised entry, a warp an entry, two heads a lane.
 * A tile's fused MMAs are issued whatever the warp's mode: an MMA on a path the compiler cannot
 * prove the whole warpgroup takes (a branch on the mode, or a predicate) makes it serialize every
 * MMA of the kernel. So spread index codes (partial mode) cost more tensor time here than on
 * indexer_mma.cu, which is then the quicker (tests/bench/NOTES.md); the compressor's codes, within
 * one of each other, are mostly fused.
 *
 * The dims within each 16-dim k-step are permuted (every mode sums a k-step's 16 products exactly,
 * so their order is free) so that a lane's 8 nibbles of a block are one word: lane c of a quad
 * holds, of k-step l, the dims 4q .. 4q + 3 of the step's 16 with q = c ^ (l & 1), which are half
 * a word of the record each; the two halves of a block's two steps make one word (kslot_of_dim).
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
#include "wgmma.cuh"

#include <atomic>

/* Without sm_90a's features the MMAs below would compile to nothing (CMake builds this file for
 * that architecture alone). */
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90a/indexer_wgmma.cu is built for sm_90a only"
#endif

/* Entries a wgmma tile (its M); a warpgroup's round is two tiles, 32 entries a warp, and the
 * CTA's warpgroups take the split's rounds in turn, each at its own pace. */
#define WG_TILE 64
#define WG_GROUPS 4
#define WG_THREADS (128 * WG_GROUPS)
#define WG_ROUND (2 * WG_TILE)
#define WG_WARP_ROWS (WG_ROUND / 4) /* a warp's entries of a round */
/* Bytes of q^, the K-major bf16 operand B of 64 rows: 16 core-matrix columns of 8 core matrices. */
#define WG_OPERAND (MMA_HEADS * DSV4_INDEX_DIM * 2)
#define WG_KSTEP 2048u /* bytes between two k-steps' first core matrices (16 dims) */
#define WG_LBO 1024u   /* between core matrices adjacent along K */
#define WG_SBO 128u    /* between core matrices adjacent along M or N */

static_assert(MMA_HEADS == WG_TILE, "q^'s 64 heads are the MMA's N");

/* A warpgroup's part of the shared memory: each warp's rows are its own. */
typedef struct {
  uint8_t stage[2][WG_ROUND * STAGE_ROW];
  uint32_t codes[2][WG_ROUND];
  float row[4][MMA_HEADS];       /* the scalar product: an entry's d */
  float kbuf[4][DSV4_INDEX_DIM]; /* the scalar product: the entry dequantised */
} wg_group_t;

typedef struct {
  wg_group_t g[WG_GROUPS];
  uint8_t q[WG_OPERAND]; /* q^, bf16, columns and dims permuted: B */
  uint4 lut[256];        /* dsv4_index_mx_lut of every code */
  float w[MMA_HEADS];    /* by head */
  float wcol[MMA_HEADS]; /* by q^'s column */
  uint32_t qsum[MMA_HEADS];
  uint32_t qstat[4];
} wg_smem_t;

static_assert(sizeof(wg_smem_t) % 16 == 0, "whole 16-byte chunks");
/* An sm_90 CTA's shared memory at most (227 KiB), below the 256 KiB that a descriptor's address
 * field spans (wg_desc_lo, tile_fused). */
static_assert(sizeof(wg_smem_t) <= 227 * 1024, "the kernel's shared memory fits a CTA");

/* The byte offset of element (row r, k-slot k) in a canonical operand. */
static __device__ __forceinline__ uint32_t wg_off(uint32_t r, uint32_t k) {
  return (k / 8) * WG_LBO + (r / 8) * WG_SBO + (r % 8) * 16 + (k % 8) * 2;
}

/* The k-slot of dim d (see the header): k-step l = d / 16; of its dims 4q + i, lane c = q ^ (l & 1)
 * holds i = 0, 1 at slots 2c, 2c + 1 and i = 2, 3 at 2c + 8, 2c + 9 (an A fragment's layout). */
static __device__ __forceinline__ uint32_t kslot_of_dim(uint32_t d) {
  const uint32_t l = d / 16, q = (d % 16) / 4, i = d % 4, c = q ^ (l & 1);
  return 16 * l + 2 * c + (i & 1) + 8 * (i >> 1);
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

/* The low word of a shared-memory matrix descriptor of a canonical operand at p (no swizzle): the
 * address and the leading byte offset; the high word is WG_DESC_HI (the stride byte offset). */
static __device__ __forceinline__ uint32_t wg_desc_lo(const void *p) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  return ((a >> 4) & 0x3FFFu) | ((WG_LBO >> 4) & 0x3FFFu) << 16;
}
#define WG_DESC_HI ((WG_SBO >> 4) & 0x3FFFu)

#define WG_R8(i)                                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),      \
      "+f"(d[i + 6]), "+f"(d[i + 7])

/* One m64n64k16 step with A from registers (the warp's 16 rows, mma.sync's A fragment) and B of
 * descriptor {blo, WG_DESC_HI}: d (+)= A . B^T, accumulating when acc. */
static __device__ __forceinline__ void wg_mma(float (&d)[32], const uint32_t (&a)[4], uint32_t blo,
                                              int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\n.reg .b64 b;\nsetp.ne.b32 p, %37, 0;\n"
               "mov.b64 b, {%36, %38};\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "{%32, %33, %34, %35}, b, p, 1, 1, 0;\n}\n"
               : WG_R8(0), WG_R8(8), WG_R8(16), WG_R8(24)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(blo), "r"(acc), "r"(WG_DESC_HI));
#else
  (void)d, (void)a, (void)blo, (void)acc;
#endif
}

/* Until none of the warpgroup's MMA groups is pending; then d's registers are read only after it.
 */
static __device__ __forceinline__ void wg_wait(float (&d)[32]) {
  wg_wait_group<0>();
  wg_tie(d);
}

/* The fused mode's 8 k-steps into d: a the tile's fragments, dq the low word of the descriptor of
 * q^'s first k-step (a k-step further is WG_KSTEP >> 4 more in the address field, which does not
 * carry out of it below 256 KiB). */
static __device__ __forceinline__ void tile_fused(float (&d)[32], uint32_t (&a)[8][4],
                                                  uint32_t dq) {
  /* The fragments are written before the fence (the empty asm ties them to this point). */
#pragma unroll
  for (int l = 0; l < 8; l++)
#pragma unroll
    for (int i = 0; i < 4; i++)
      asm volatile("" : "+r"(a[l][i])::"memory");
  wg_fence();
#pragma unroll
  for (int l = 0; l < 8; l++)
    wg_mma(d, a[l], dq + l * (WG_KSTEP >> 4), l > 0);
  wg_commit();
}

/* ldmatrix of four 8x8 b16 matrices: lane i gives row i % 8 of matrix i / 8 at p. */
static __device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"((uint32_t)__cvta_generic_to_shared(p)));
}

/*
 * The warp's A fragments of tile t: rows g and g + 8 of its 16 (its round rows 16t + g, + 8) from
 * the staged records of buffer buf, bf16 on the byte tables of their codes. Of block b (k-steps 2b
 * and 2b + 1) lane c takes word c >> 1 of each step's 8 bytes, the low half of step 2b's and the
 * high half of step 2b + 1's for even c, the other halves for odd c, as one word.
 */
static __device__ __forceinline__ void warp_fragments(const wg_group_t &gr, const uint4 *lut,
                                                      int buf, uint32_t t, uint32_t (&a)[8][4]) {
  const uint32_t lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const uint32_t w = (threadIdx.x >> 5) & 3, sel = (c & 1) ? 0x5432u : 0x7610u;
#pragma unroll
  for (uint32_t r = 0; r < 2; r++) {
    const uint32_t row = WG_WARP_ROWS * w + 16 * t + g + 8 * r;
    const uint8_t *v = gr.stage[buf] + row * STAGE_ROW + 4 * (c >> 1);
    const uint32_t codes = gr.codes[buf][row];
#pragma unroll
    for (uint32_t b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
      const uint4 tb = lut[__byte_perm(codes, 0u, 0x4440u | b)]; /* code b, zero-extended */
      const uint32_t tw[4] = {tb.x, tb.y, tb.z, tb.w};
      const uint32_t x = __byte_perm(*reinterpret_cast<const uint32_t *>(v + 16 * b),
                                     *reinterpret_cast<const uint32_t *>(v + 16 * b + 8), sel);
      uint32_t o[4];
      dsv4_index_mx_bf16x8(x, tw, o);
      a[2 * b][r] = o[0];
      a[2 * b][2 + r] = o[1];
      a[2 * b + 1][r] = o[2];
      a[2 * b + 1][2 + r] = o[3];
    }
  }
}

/*
 * Partial mode: d = dsv4_fold8 of the 8 partials of 16 dims of the warp's rows of the tile,
 * ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)), each an mma.sync m16n8k16 from zero on the
 * tile's A fragments against the 8 n-tiles of q^'s columns: mma.sync's results of n-tile j are
 * registers 4j..4j + 3 of the warpgroup MMA's layout, so tile_keys takes them as they are. The B
 * fragments come from q^ by ldmatrix (a core matrix is an 8x8 matrix of it).
 */
static __device__ __forceinline__ void tile_partial(float (&d)[32], const uint32_t (&a)[8][4],
                                                    const uint8_t *q) {
  const uint32_t lane = threadIdx.x & 31, mi = lane / 8;
  float res[32]; /* indexed by the n-tile, a runtime value: in local memory */
#pragma unroll 1
  for (int j = 0; j < 8; j++) {
    /* dsv4_fold8's pairs in its order: s = (p0 + p4) + (p2 + p6), then t = (p1 + p5) + (p3 + p7),
     * s + t; each pair's B fragments in one load (partials l and l + 4). */
    float s[4], t[4];
#pragma unroll
    for (int pr = 0; pr < 4; pr++) {
      const int l = pr == 0 ? 0 : pr == 1 ? 2 : pr == 2 ? 1 : 3;
      uint32_t b[4]; /* b0, b1 of partial l, then of l + 4: columns 8j.. */
      ldsm4(b, q + wg_off(8 * j + lane % 8, 16 * (l + 4 * (mi / 2)) + 8 * (mi % 2)));
      float x[4] = {0.0f, 0.0f, 0.0f, 0.0f}, y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma16816(x, a[l], b[0], b[1]);
      mma16816(y, a[l + 4], b[2], b[3]);
      float *acc = pr < 2 ? s : t;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float v = __fadd_rn(x[i], y[i]);
        acc[i] = pr % 2 ? __fadd_rn(acc[i], v) : v;
      }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
      res[4 * j + i] = __fadd_rn(s[i], t[i]);
  }
#pragma unroll
  for (int i = 0; i < 32; i++) /* every element written: d's old values are dead before */
    d[i] = res[i];
}

/*
 * The keys of the warp's rows of a tile from d (rows g and g + 8, round rows r0 + g, + 8), with the
 * weights of the thread's columns wc[j] (columns 8j + 2c, + 1); lane c = 0 stores row g's key,
 * c = 1 row g + 8's, when on and the entry index is below i1.
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
static __device__ __forceinline__ void tile_keys(const float (&d)[32], const float2 (&wc)[8],
                                                 bool on, uint32_t *keys, uint32_t i0,
                                                 uint32_t i1) {
  const uint32_t lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  float s[2][2] = {}; /* [row][P(2c), P(2c + 1)], or the chain in [..][0] */
#pragma unroll
  for (int m = 0; m < 4; m++) {
    const int j0 = 2 * m, j1 = 2 * m + 1;
    const float2 w0 = wc[j0], w1 = wc[j1];
#pragma unroll
    for (uint32_t step = 0; step < (FAST ? 1u : 4u); step++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float *x = s[r];
        const int e = FAST ? 1 : 0; /* the exact chain stays in x[0] */
        x[0] = dsv4_index_score_add(w0.x, d[4 * j0 + 2 * r], x[0]);
        x[0] = dsv4_index_score_add(w0.y, d[4 * j0 + 2 * r + 1], x[0]);
        x[e] = dsv4_index_score_add(w1.x, d[4 * j1 + 2 * r], x[e]);
        x[e] = dsv4_index_score_add(w1.y, d[4 * j1 + 2 * r + 1], x[e]);
        if (!FAST) /* lane step's were heads 16m + 4 step .. + 3 */
          x[0] = __shfl_sync(FULL, x[0], (lane & ~3u) | step);
      }
  }
  float t;
  if (FAST) {
    const float t0 = __fadd_rn(s[0][0], s[0][1]), t1 = __fadd_rn(s[1][0], s[1][1]);
    const bool odd = c & 1;
    t = __fadd_rn(odd ? t1 : t0, __shfl_xor_sync(FULL, odd ? t0 : t1, 1));
    t = __fadd_rn(t, __shfl_xor_sync(FULL, t, 2));
  } else {
    t = c ? s[1][0] : s[0][0];
  }
  const uint32_t i = i0 + g + 8 * c;
  if (on && c < 2 && i < i1)
    keys[i] = dsv4_index_score_key(t);
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
      const uint16_t bits = *reinterpret_cast<const uint16_t *>(q + wg_off(col, kslot_of_dim(dim)));
      acc = DSV4_FMA(__uint_as_float((uint32_t)bits << 16), kb[dim], acc);
    }
    p[l] = acc;
  }
  return dsv4_fold8(p);
}

/* The scalar product for the warp's 16 rows of a tile (round rows r0 .. r0 + 15, the first of them
 * below n), each entry's key by exact mode's chain (a warp of the scalar product keeps it in fast
 * mode too): per entry, d of two heads a lane into row, then the chain at lane 0. */
static __device__ void tile_scalar(const wg_smem_t &sm, wg_group_t &gr, int buf, uint32_t r0,
                                   uint32_t n, uint32_t *keys, uint32_t base, uint32_t i1) {
  const uint32_t lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  float *kb = gr.kbuf[w], *row = gr.row[w];
  for (uint32_t r = r0; r < r0 + 16 && r < n; r++) { /* warp-uniform */
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
    if (lane == 0) {
      float acc = 0.0f;
      for (uint32_t hd = 0; hd < MMA_HEADS; hd++)
        acc = dsv4_index_score_add(sm.w[hd], row[hd], acc);
      if (base + r < i1) /* always (r < n <= i1 - base); without it ptxas takes 124 registers */
        keys[base + r] = dsv4_index_score_key(acc);
    }
    __syncwarp();
  }
}

/* The token's q^ into sm.q (bf16, columns and dims permuted), its weights, summaries and
 * statistics: the query kernel's rows of slot blockIdx.x (after the dependency wait); the q^
 * values are bf16 numbers, so their top halves are exact. Dims 4q .. 4q + 3 of a k-step go to
 * two pairs of k-slots (kslot_of_dim). */
static __device__ void token_setup(const idx_params_t &p, wg_smem_t &sm) {
  const float *src = slot_queries(p, blockIdx.x);
  for (uint32_t i = threadIdx.x; i < MMA_HEADS * DSV4_INDEX_DIM / 4; i += WG_THREADS) {
    const uint32_t n = i / (DSV4_INDEX_DIM / 4), k = 4 * (i % (DSV4_INDEX_DIM / 4));
    const float4 x = __ldcg(reinterpret_cast<const float4 *>(src + head_of_col(n) * QROW + k));
    const uint32_t lo = __float_as_uint(x.x) >> 16 | (__float_as_uint(x.y) & 0xffff0000u),
                   hi = __float_as_uint(x.z) >> 16 | (__float_as_uint(x.w) & 0xffff0000u);
    *reinterpret_cast<uint32_t *>(sm.q + wg_off(n, kslot_of_dim(k))) = lo;
    *reinterpret_cast<uint32_t *>(sm.q + wg_off(n, kslot_of_dim(k + 2))) = hi;
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

/* Warp W's part of the round of entries base .. base + WG_ROUND - 1 (into stage[buf] and codes[buf]
 * of its warpgroup): its rows, a lane an entry. */
static __device__ __forceinline__ void stage_warp(const idx_params_t &p, wg_group_t &gr, int buf,
                                                  const dsv4__seg_table_t &tb, int64_t jlo,
                                                  uint32_t base, uint32_t i1) {
  const uint32_t W = (threadIdx.x >> 5) & 3, b0 = base + WG_WARP_ROWS * W;
  stage_round(p, tb, jlo, b0, min(i1, b0 + WG_WARP_ROWS),
              gr.stage[buf] + WG_WARP_ROWS * W * STAGE_ROW, gr.codes[buf] + WG_WARP_ROWS * W,
              threadIdx.x & 31);
}

/* The warp's part of its warpgroup's staged round (entries base + row, n in the round), in the
 * warp's mode: each tile's fused MMAs issued whatever the mode (a tile past the round's entries
 * or of another mode wastes them, the tensor cores being otherwise idle), so that no MMA lies on a
 * path the compiler cannot prove the warpgroup takes (it would serialize them all); then partial
 * mode's mma.sync where the warp needs it, and the keys. The next round is staged once the first
 * tile's MMAs are issued. */
template <bool FAST>
static __device__ void wg_round(const idx_params_t &p, const wg_smem_t &sm, wg_group_t &gr, int buf,
                                uint32_t n, int mode, const float2 (&wc)[8], uint32_t *keys,
                                uint32_t base, uint32_t i1, const dsv4__seg_table_t &tb,
                                int64_t jlo) {
  /* The same for every lane: from lane 0, so that the compiler keeps it in uniform registers. */
  const uint32_t dq = __shfl_sync(FULL, wg_desc_lo(sm.q), 0);
  const uint32_t W = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (uint32_t t = 0; t < 2; t++) {
    uint32_t a[8][4];
    float d[32];
    warp_fragments(gr, sm.lut, buf, t, a);
    tile_fused(d, a, dq);
    const uint32_t next = base + WG_GROUPS * WG_ROUND;
    if (t == 0 && next < i1) /* stage[buf ^ 1]: last read by this warp in the round before */
      stage_warp(p, gr, buf ^ 1, tb, jlo, next, i1);
    wg_wait(d);
    const uint32_t r0 = WG_WARP_ROWS * W + 16 * t;
    const bool any = r0 < n;
    if (mode == DSV4_INDEX_MX_PARTIAL && any)
      tile_partial(d, a, sm.q);
    tile_keys<FAST>(d, wc, any && mode != DSV4_INDEX_MX_SCALAR, keys, base + r0, i1);
    if (mode == DSV4_INDEX_MX_SCALAR && any)
      tile_scalar(sm, gr, buf, r0, n, keys, base, i1);
  }
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
  const uint32_t G = threadIdx.x >> 7, W = (threadIdx.x >> 5) & 3;
  wg_group_t &gr = sm.g[G];
  uint32_t base = i0 + WG_ROUND * G;
  const dsv4__seg_table_t tb = dsv4__seg_table(p, s);
  if (base < i1)
    stage_warp(p, gr, 0, tb, jlo, base, i1);
  token_setup(p, sm);
  uint32_t *keys = p.keys + (uint64_t)blockIdx.x * p.keys_per_cta;
  float2 wc[8]; /* the weights of the thread's columns 8j + 2c, + 1 */
#pragma unroll
  for (int j = 0; j < 8; j++)
    wc[j] = *reinterpret_cast<const float2 *>(sm.wcol + 8 * j + 2 * (threadIdx.x & 3));
  /* Round k of the warp: its records staged in stage[k & 1] during round k - 1 by its own lanes,
   * which its __syncwarp shows every lane. */
  for (int buf = 0; base < i1; buf ^= 1, base += WG_GROUPS * WG_ROUND) {
    dsv4__cp_async_wait_all();
    __syncwarp();
    const uint32_t n = min(i1 - base, (uint32_t)WG_ROUND), r0 = WG_WARP_ROWS * W;
    const int mode = r0 < n ? warp_mode(sm.qstat, gr.stage[buf], gr.codes[buf], r0,
                                        min(n - r0, (uint32_t)WG_WARP_ROWS), p.mma_cap)
                            : DSV4_INDEX_MX_FUSED; /* warp-uniform */
    wg_round<FAST>(p, sm, gr, buf, n, mode, wc, keys, base, i1, tb, jlo);
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
  static void (*const kernels[2])(idx_params_t) = {dsv4__indexer_score_wg_kernel<false>,
                                                   dsv4__indexer_score_wg_kernel<true>};
  static std::atomic<uint64_t> limit_raised[2] = {{0}, {0}};
  return score_kernel_launch(kernels, limit_raised, sizeof(wg_smem_t), WG_THREADS, p, grid, s, pdl,
                             fast);
}
