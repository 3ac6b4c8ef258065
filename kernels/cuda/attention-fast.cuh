#ifndef DSV4_KERNELS_CUDA_ATTENTION_FAST_CUH
#define DSV4_KERNELS_CUDA_ATTENTION_FAST_CUH
/*
 * What the two fast-mode kernels share (SPEC §7): the window's (attention_fast.cu) and the union's
 * (attention_fast_union.cu). The tensor-core primitives (ldmatrix; mma16816 is
 * cuda-internal.cuh's), the swizzled layout of staged rows, the scores of a tile of 128 candidates,
 * the weighted sum of a tile, the output's last steps, and the choice of the CTA shape.
 */
#include "attention-common.cuh"

/* Bytes of one row of weights (128 bf16) in shared memory. */
#define P_ROW 256
/* Floats per row of scores: 128 candidates and a pad that spreads the rows over the banks. */
#define S_STRIDE 132

/* Where a staged row's record waits for fast_dequant_rows (its raw NoPE bytes inside the 56 chunks
 * its NoPE dims take as bf16, so that the dequantisation reads the whole row before it writes; its
 * 8 chunks of RoPE dims, bf16 already, where they stay, chunks 56..63): the layouts' raw(). */
#define RAW_CHUNK 28

/*
 * The staged rows' layouts in shared memory (q, the window's records, the weights; rows of `row`
 * bytes, a multiple of 128, in blocks of a multiple of 8 rows): at(r, c, row) is the byte offset of
 * 16-byte chunk c of row r, raw(s, j) where chunk j of record s waits raw (fast_copy_record). In
 * both, the 8 rows of one chunk (ldmatrix) and the 8 chunks of one 128 bytes of a row (the staging)
 * fall in 8 different 16-byte bank groups.
 *
 * swz_rows (the mma.sync kernels): each row whole, its chunk c at place c ^ (r % 8) of its 128
 * bytes; a record's NoPE bytes raw at bytes 448.. of its row.
 */
struct swz_rows {
  static __device__ __forceinline__ uint32_t at(uint32_t r, uint32_t c, uint32_t row) {
    return r * row + ((c ^ (r & 7)) << 4);
  }
  static __device__ __forceinline__ uint32_t raw(uint32_t s, uint32_t j) {
    return j < RAW_CHUNK ? s * K_ROW + 16 * (RAW_CHUNK + j) : at(s, RAW_CHUNK + j, K_ROW);
  }
};

/* swz_atoms (the warpgroup MMAs, sm90a/attention_fast_wg.cu, which read it through descriptors):
 * the 128-byte swizzle's layout, a group of 8 rows taking 8 row bytes in which piece k of its rows
 * (chunks 8k..8k + 7 of each) lie together (a 1 KiB atom), a row's piece at 128 (r % 8), its chunk
 * c at place (c ^ r) % 8; a record's chunk j at the place of its row's chunk RAW_CHUNK + j. */
struct swz_atoms {
  static __device__ __forceinline__ uint32_t at(uint32_t r, uint32_t c, uint32_t row) {
    return (r >> 3) * (row << 3) + ((c >> 3) << 10) + ((r & 7) << 7) + (((c ^ r) & 7) << 4);
  }
  static __device__ __forceinline__ uint32_t raw(uint32_t s, uint32_t j) {
    return at(s, RAW_CHUNK + j, K_ROW);
  }
};

static __device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* The bytes from p in shared memory to the next multiple of A (a power of two) of its shared
 * address: how far a kernel's staged rows start into its dynamic shared memory, whose launch
 * gives A - 16 bytes of room for it. */
template <uint32_t A> static __device__ __forceinline__ uint32_t smem_align_pad(const void *p) {
  return (A - (smem_addr(p) & (A - 1))) & (A - 1);
}

static __device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

static __device__ __forceinline__ void ldsm4_t(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* lo and hi rounded to bf16 (to nearest even) and packed, lo in the low half: one instruction. */
static __device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

/* The warps of a fast kernel's CTA of MT m-tiles (the window's and the union's): 8 for one, 16 for
 * more. Such a CTA has an SM to itself (its shared memory), and its serial instruction stream is
 * the kernel's time: twice the warps share it (32, tried, were slower: 64 registers a thread). */
static constexpr __host__ __device__ int fast_warps(int mt) {
  return mt >= 2 ? 16 : 8;
}

/* Per-CTA facts beyond attn_misc_t: each head's sink, and its denominator D from the softmax. */
typedef struct {
  float sink[64];
  float den[64];
} fast_misc_t;

/*
 * The fused decode path's queries (p.q_raw): warp w takes rows w, w + 8, ... of the raw q, all in
 * flight at once, and turns each into the bf16 values the insert would have written (q-norm.cuh,
 * the run layout: lane l holds chunks 2l and 2l + 1), placed as fast_load_q places q_out.
 */
template <int MT, int W, class L>
static __device__ void fast_load_q_raw(const attn_params_t &p, uint32_t t, uint32_t h_first,
                                       uint8_t *sq, const float *rope) {
  constexpr int RW = 16 * MT / W;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4 v[RW][2];
#pragma unroll
  for (int i = 0; i < RW; i++) {
    const uint32_t h = warp + W * i;
    v[i][0] = v[i][1] = make_uint4(0, 0, 0, 0);
    if (h_first + h < p.heads) {
      const uint4 *row = p.q + ((uint64_t)t * p.heads + h_first + h) * 64;
      v[i][0] = row[2 * lane];
      v[i][1] = row[2 * lane + 1];
    }
  }
#pragma unroll
  for (int i = 0; i < RW; i++) {
    const uint32_t h = warp + W * i;
    if (h_first + h < p.heads) /* warp-uniform */
      qn_row_run(lane, rope, p.eps, v[i][0], v[i][1]);
    *reinterpret_cast<uint4 *>(sq + L::at(h, 2 * lane, K_ROW)) = v[i][0];
    *reinterpret_cast<uint4 *>(sq + L::at(h, 2 * lane + 1, K_ROW)) = v[i][1];
  }
}

/* The queries of heads h_first.. in shared memory, swizzled like the records (zeros past the last
 * head), by a CTA of W warps: on the fused decode path the raw rows normalised (rope: the query
 * position's RoPE row, ms.rope, after the setup); else q_out's rows by loads, which only the
 * ordering tests' broken builds use, before the wait (the kernels copy them: fast_copy_q). */
template <int MT, int W = ATTN_WARPS, class L = swz_rows>
static __device__ void fast_load_q(const attn_params_t &p, uint32_t t, uint32_t h_first,
                                   uint8_t *sq, const float *rope) {
  if (p.q_raw) {
    fast_load_q_raw<MT, W, L>(p, t, h_first, sq, rope);
    return;
  }
  constexpr int K = 16 * MT * 64 / (32 * W);
  uint4 v[K];
#pragma unroll
  for (int k = 0; k < K; k++) {
    const uint32_t i = threadIdx.x + 32 * W * k, h = i >> 6, c = i & 63;
    v[k] = h_first + h < p.heads ? p.q[((uint64_t)t * p.heads + h_first + h) * 64 + c]
                                 : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < K; k++) {
    const uint32_t i = threadIdx.x + 32 * W * k;
    *reinterpret_cast<uint4 *>(sq + L::at(i >> 6, i & 63, K_ROW)) = v[k];
  }
}

/* q_out's rows of heads h_first.. into shared memory as fast_load_q places them (zeros past the
 * last head), by asynchronous copies: issued right after the dependency wait, they land while the
 * window and the launch's check are read, and cost no registers. Complete after
 * dsv4__cp_async_wait_all and a barrier. */
template <int MT, int W, class L = swz_rows>
static __device__ void fast_copy_q(const attn_params_t &p, uint32_t t, uint32_t h_first,
                                   uint8_t *sq) {
#pragma unroll
  for (int k = 0; k < 16 * MT * 64 / (32 * W); k++) {
    const uint32_t i = threadIdx.x + 32 * W * k, h = i >> 6, c = i & 63;
    uint8_t *dst = sq + L::at(h, c, K_ROW);
    if (h_first + h < p.heads)
      dsv4__cp_async16(dst, p.q + ((uint64_t)t * p.heads + h_first + h) * 64 + c);
    else
      *reinterpret_cast<uint4 *>(dst) = make_uint4(0, 0, 0, 0);
  }
}

/*
 * The record whose 576 data bytes lie at rec and 8 scale bytes at scl into row s, by asynchronous
 * copies (a warp, lane by lane): its 36 chunks at the row's places RAW_CHUNK.. (the NoPE bytes raw,
 * the RoPE dims where they stay), its scales into sscl[s]. Complete after dsv4__cp_async_wait_all
 * and a barrier; then fast_dequant_rows.
 */
template <class L = swz_rows>
static __device__ __forceinline__ void fast_copy_record(uint8_t *sk, uint2 *sscl, uint32_t s,
                                                        const uint8_t *rec, const uint8_t *scl,
                                                        uint32_t lane) {
  /* chunk j of the record: 0..27 NoPE, 28..35 RoPE (j = 32 + lane) */
  dsv4__cp_async16(sk + L::raw(s, lane), rec + 16 * lane);
  if (lane < 4)
    dsv4__cp_async16(sk + L::raw(s, 32 + lane), rec + 16 * (32 + lane));
  else if (lane == 4)
    dsv4__cp_async<8>(sscl + s, scl);
}

/*
 * The NoPE dims of rows 0..n - 1, copied raw by fast_copy_record, dequantised in place to bf16
 * (dequant8, exact: the values stage_records writes), a warp per row (rows warp, warp + W, ...,
 * four in flight): lane l < 28 reads the row's raw chunk l (pieces 2 l and 2 l + 1, one scale
 * code), and once the warp has read the whole row it writes the pieces' swizzled chunks.
 */
template <int W, class L = swz_rows>
static __device__ void fast_dequant_rows(uint8_t *sk, const uint2 *sscl, uint32_t n, uint32_t warp,
                                         uint32_t lane) {
  for (uint32_t s0 = warp; s0 < n; s0 += 4 * W) {
    uint4 raw[4];
    uint32_t code[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const uint32_t s = s0 + W * r;
      if (s < n && lane < 28) {
        raw[r] = *reinterpret_cast<const uint4 *>(sk + L::raw(s, lane));
        code[r] = reinterpret_cast<const uint8_t *>(sscl + s)[lane >> 2];
      }
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const uint32_t s = s0 + W * r;
      if (s < n && lane < 28) {
        *reinterpret_cast<uint4 *>(sk + L::at(s, 2 * lane, K_ROW)) =
            dequant8(raw[r].x, raw[r].y, code[r]);
        *reinterpret_cast<uint4 *>(sk + L::at(s, 2 * lane + 1, K_ROW)) =
            dequant8(raw[r].z, raw[r].w, code[r]);
      }
    }
  }
}

/* Zeros in the rows n..end - 1 of the window (end: n rounded up to 16, or the whole window for
 * the warpgroup MMAs, whose weighted sums take every row), which the weighted sum multiplies by
 * zero weights: staged memory left from before could hold NaN patterns. */
template <class L = swz_rows>
static __device__ void fast_zero_tail(uint8_t *sk, uint32_t n, uint32_t end) {
  for (uint32_t i = threadIdx.x; i < (end - n) * 64; i += blockDim.x)
    *reinterpret_cast<uint4 *>(sk + L::at(n + (i >> 6), i & 63, K_ROW)) = make_uint4(0, 0, 0, 0);
}

/* The scores of the warp's m-tile and its 16 NP candidates: 2 NP n-tiles of 8, over 512 dims. */
template <int MT, int NP = MT>
static __device__ void fast_scores(const uint8_t *sq, const uint8_t *sk, uint32_t warp,
                                   uint32_t lane, float (&acc)[2 * NP][4]) {
  const uint32_t mt = warp % MT, c0 = (warp / MT) * 16 * NP;
  const uint32_t qa = smem_addr(sq), ka = smem_addr(sk);
  const uint32_t arow = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, acol = lane >> 4;
  const uint32_t brow = c0 + (lane & 7) + (lane >> 4) * 8, bcol = (lane >> 3) & 1;
#pragma unroll
  for (int j = 0; j < 2 * NP; j++)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    /* Each MMA sums its 16 products from zero and the partial joins the total in an fp32 add: the
     * MMA's accumulation truncates relative to its largest operand, so a running total fed back as
     * its accumulator would lose bits of every later partial (large logits felt it). */
#pragma unroll 4
  for (uint32_t kc = 0; kc < 64; kc += 2) {
    uint32_t a[4];
    ldsm4(qa + swz_rows::at(arow, kc + acol, K_ROW), a);
#pragma unroll
    for (int np = 0; np < NP; np++) {
      uint32_t b[4];
      float part[2][4] = {};
      ldsm4(ka + swz_rows::at(brow + 16 * np, kc + bcol, K_ROW), b);
      mma16816(part[0], a, b[0], b[1]);
      mma16816(part[1], a, b[2], b[3]);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        acc[2 * np][i] += part[0][i];
        acc[2 * np + 1][i] += part[1][i];
      }
    }
  }
}

/* The scaled scores into ss[head][candidate], -inf past the window's n candidates. */
template <int MT, int NP = MT>
static __device__ void fast_store_scores(float *ss, uint32_t warp, uint32_t lane, uint32_t n,
                                         const float (&acc)[2 * NP][4]) {
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  const uint32_t mt = warp % MT, c0 = (warp / MT) * 16 * NP;
  const uint32_t h = mt * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < 2 * NP; j++) {
    const uint32_t s = c0 + 8 * j + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const uint32_t si = s + (i & 1), hi = h + (i >> 1) * 8;
      ss[hi * S_STRIDE + si] = si < n ? __fmul_rn(acc[j][i], scale) : -INFINITY;
    }
  }
}

/*
 * The softmax's weights for the HPW heads warp, warp + W, ... of a warp, all at once so that their
 * shuffle trees overlap: each head's 128 scaled scores from ss (lane l: candidates l, l + 32, l +
 * 64, l + 96), m = max(m on entry, their maximum), the weights w = exp(l - m) in fp32 into the two
 * weight planes as bf16 pairs (hi = bf16(w), lo = bf16(w - hi)), and their sum S in one fixed order
 * (each lane's four in turn, then a shuffle tree), the same on every run.
 */
template <int HPW, int W, class L = swz_rows>
static __device__ __forceinline__ void fast_weights(const float *ss, uint8_t *sp, uint8_t *sp_lo,
                                                    uint32_t warp, uint32_t lane, float (&m)[HPW],
                                                    float (&sum)[HPW]) {
  float v[HPW][4], tm[HPW];
#pragma unroll
  for (int i = 0; i < HPW; i++) {
    tm[i] = -INFINITY;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      v[i][k] = ss[(warp + W * i) * S_STRIDE + lane + 32 * k];
      tm[i] = fmaxf(tm[i], v[i][k]);
    }
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1)
#pragma unroll
    for (int i = 0; i < HPW; i++)
      tm[i] = fmaxf(tm[i], __shfl_xor_sync(FULL, tm[i], off));
#pragma unroll
  for (int i = 0; i < HPW; i++) {
    const uint32_t h = warp + W * i;
    m[i] = fmaxf(m[i], tm[i]);
    sum[i] = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const float w = __expf(v[i][k] - m[i]); /* exp(-inf) = +0 past the candidates */
      sum[i] += w;
      const uint32_t hw = bf16x2(w, 0.0f);
      const uint16_t hi = (uint16_t)hw, lo = (uint16_t)bf16x2(w - __uint_as_float(hw << 16), 0.0f);
      const uint32_t s = lane + 32 * k, off = L::at(h, s >> 3, P_ROW) + 2 * (s & 7);
      *reinterpret_cast<uint16_t *>(sp + off) = hi;
      *reinterpret_cast<uint16_t *>(sp_lo + off) = lo;
    }
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1)
#pragma unroll
    for (int i = 0; i < HPW; i++)
      sum[i] += __shfl_xor_sync(FULL, sum[i], off);
}

/* A head's denominator D = S + exp(sink - m) (the sink in the denominator only; none without
 * sinks), and lse = m + log S (the sink excluded): the window's kernel, the union's and the split
 * union's combine compute them here. */
static __device__ __forceinline__ float fast_den(const attn_params_t &p, float sum, float m,
                                                 float sink) {
  return p.sink ? sum + __expf(sink - m) : sum;
}

static __device__ __forceinline__ float fast_lse(float m, float sum) {
  return m + logf(sum);
}

/* Dims d, d + 1 (d even) of an output row from N's values ne, no and inv = 1 / D: o = N inv, the
 * inverse RoPE on dims 448..511 (rope: the query position's row, cos then sin), one bf16 rounding
 * each, packed (dim d in the low half). */
static __device__ __forceinline__ uint32_t fast_out_pair(float ne, float no, float inv, uint32_t d,
                                                         const float *rope) {
  float e = ne * inv, od = no * inv;
  if (d >= DSV4_NOPE_DIM) {
    const uint32_t i = (d - DSV4_NOPE_DIM) / 2;
    const float c = rope[i], sn = rope[DSV4_ROPE_PAIRS + i];
    const float ee = dsv4_rope_inv_even(e, od, c, sn);
    od = dsv4_rope_inv_odd(e, od, c, sn);
    e = ee;
  }
  return bf16x2(e, od);
}

/* One split's term of a head's merge (the split union's combine kernel, a window cluster's
 * splits): a = exp(m_s - M) for the split's pair (m_s, S_s) and the heads' maximum M, then
 * S += S_s a and N += N_s a on thread i's 4 dims, in the splits' order (0 for a split without
 * candidates, m_s = -inf). */
static __device__ __forceinline__ void fast_merge_term(float2 ms, float4 x, float m, float &sum,
                                                       float4 &n) {
  const float a = __expf(ms.x - m);
  sum = sum + ms.y * a;
  n.x = n.x + x.x * a;
  n.y = n.y + x.y * a;
  n.z = n.z + x.z * a;
  n.w = n.w + x.w * a;
}

/* A merged head's end: lse (thread 0), then o = N / D on thread i's dims 4 i..4 i + 3 of token t's
 * head h (rope: the query position's row, read for the rotated dims only). */
static __device__ __forceinline__ void fast_merge_out(const attn_params_t &p, float m, float sum,
                                                      float4 n, float sink, const float *rope,
                                                      uint32_t t, uint32_t h, uint32_t i) {
  if (i == 0 && p.lse)
    p.lse[(uint64_t)t * p.heads + h] = fast_lse(m, sum);
  const float inv = 1.0f / fast_den(p, sum, m, sink); /* +inf (a sink of +inf) gives 0 */
  const uint32_t d = 4 * i;
  reinterpret_cast<uint2 *>(p.out + ((uint64_t)t * p.heads + h) * 64)[i] =
      make_uint2(fast_out_pair(n.x, n.y, inv, d, rope), fast_out_pair(n.z, n.w, inv, d + 2, rope));
}

/* Bytes of a warp's output tile in shared memory (fast_store_out_tile): 16 heads, 64 bf16 dims. */
#define OUT_TILE 2048

/*
 * o = N (1 / D), the inverse RoPE on dims 448..511, bf16, stored: the 8 n-tiles of dims d0..d0 + 63
 * of the warp's m-tile (a lane holds dims d, d + 1 of heads r and r + 8 of the tile, an even-odd
 * pair of the RoPE part), through the warp's tile in shared memory. The lanes' pairs go into it
 * (16 rows of 128 bytes, 16-byte chunk c of row r at chunk c ^ (r & 7): the quads' 4-byte writes
 * fall in 32 different banks), then each lane takes 16 bytes of it, so that a store writes four
 * whole rows of 128 bytes. The lanes' own 4-byte stores left each 32-byte sector half written by
 * one instruction: four times the L2 requests of whole lines.
 */
static __device__ void fast_store_out_tile(const attn_params_t &p, const attn_misc_t &ms,
                                           const fast_misc_t &fm, uint32_t t, uint32_t h_first,
                                           uint32_t mt, uint32_t d0, uint32_t lane, uint8_t *tile,
                                           const float (&acc)[8][4]) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const uint32_t r = (lane >> 2) + 8 * half;
    const float inv = 1.0f / fm.den[mt * 16 + r]; /* +inf (a sink of +inf) gives 0 */
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const uint32_t d = d0 + 8 * j + 2 * (lane & 3);
      *reinterpret_cast<uint32_t *>(tile + r * 128 + ((j ^ (r & 7)) << 4) + 4 * (lane & 3)) =
          fast_out_pair(acc[j][2 * half], acc[j][2 * half + 1], inv, d, ms.rope);
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t r = 4 * i + (lane >> 3), c = lane & 7, h = h_first + mt * 16 + r;
    const uint4 v = *reinterpret_cast<const uint4 *>(tile + r * 128 + ((c ^ (r & 7)) << 4));
    if (h < p.heads)
      p.out[((uint64_t)t * p.heads + h) * 64 + d0 / 8 + c] = v;
  }
  __syncwarp(); /* the tile is read before the warp's next chunk writes it */
}

/* The pairs (m, S) of a split launch's partial states, after every N (attention-split.h). */
static __device__ __forceinline__ float2 *part_ms(const attn_params_t &p) {
  return reinterpret_cast<float2 *>(p.part +
                                    (uint64_t)DSV4_HEAD_DIM * p.n_tokens * p.heads * p.nsplit);
}

/* N of split `split` unnormalised into its partial state: n-tile j of dims d0.. of heads h and h +
 * 8 of the CTA (a lane holds dims d, d + 1 of two heads, as in fast_store_out_tile). */
template <int NT>
static __device__ void fast_store_part(const attn_params_t &p, uint32_t t, uint32_t h_first,
                                       uint32_t h, uint32_t d0, uint32_t split, uint32_t lane,
                                       const float (&acc)[NT][4]) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const uint32_t hh = h + 8 * half;
    if (h_first + hh >= p.heads)
      continue;
    const uint64_t k = ((uint64_t)t * p.heads + h_first + hh) * p.nsplit + split;
    float2 *row = reinterpret_cast<float2 *>(p.part + k * DSV4_HEAD_DIM);
#pragma unroll
    for (int j = 0; j < NT; j++)
      row[(d0 + 8 * j + 2 * (lane & 3)) >> 1] = make_float2(acc[j][2 * half], acc[j][2 * half + 1]);
  }
}

/* The partial state of a split without candidates for each of the CTA's nh heads: N = 0, m = -inf,
 * S = 0 (the combine gives it the weight 0). */
static __device__ void fast_empty_part(const attn_params_t &p, uint32_t t, uint32_t h_first,
                                       uint32_t nh, uint32_t split) {
  const uint32_t live = h_first + nh <= p.heads ? nh : p.heads - h_first;
  for (uint32_t i = threadIdx.x; i < live * (DSV4_HEAD_DIM / 4); i += blockDim.x) {
    const uint64_t k =
        ((uint64_t)t * p.heads + h_first + i / (DSV4_HEAD_DIM / 4)) * p.nsplit + split;
    reinterpret_cast<float4 *>(p.part + k * DSV4_HEAD_DIM)[i % (DSV4_HEAD_DIM / 4)] =
        make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if (threadIdx.x < live)
    part_ms(p)[((uint64_t)t * p.heads + h_first + threadIdx.x) * p.nsplit + split] =
        make_float2(-INFINITY, 0.0f);
}

/*
 * N += P_hi V + P_lo V for the candidates 0..16 kcs / 2 - 1 (kcs: 8-candidate chunks, even): the
 * warp's m-tile of weights (planes at byte addresses pa and pla, rows of P_ROW) times dims d0..d0 +
 * 8 NT - 1 of the staged records at ka, NT n-tiles of 8 dims.
 */
template <int NT>
static __device__ __forceinline__ void fast_pv(uint32_t pa, uint32_t pla, uint32_t ka, uint32_t mt,
                                               uint32_t d0, uint32_t kcs, uint32_t lane,
                                               float (&acc)[NT][4]) {
  const uint32_t arow = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, acol = lane >> 4;
  const uint32_t brow = (lane & 7) + ((lane >> 3) & 1) * 8, bcol = lane >> 4;
  for (uint32_t kc = 0; kc < kcs; kc += 2) {
    uint32_t a[4], al[4];
    ldsm4(pa + swz_rows::at(arow, kc + acol, P_ROW), a);
    ldsm4(pla + swz_rows::at(arow, kc + acol, P_ROW), al);
#pragma unroll
    for (int np = 0; np < NT / 2; np++) {
      uint32_t b[4];
      ldsm4_t(ka + swz_rows::at(kc * 8 + brow, d0 / 8 + 2 * np + bcol, K_ROW), b);
      mma16816(acc[2 * np], a, b[0], b[1]);
      mma16816(acc[2 * np + 1], a, b[2], b[3]);
      mma16816(acc[2 * np], al, b[0], b[1]);
      mma16816(acc[2 * np + 1], al, b[2], b[3]);
    }
  }
}

/*
 * MT (at most max_mt) for a launch: the fewest rounds of the busiest SM (one CTA per SM), a CTA
 * costing about one unit of staging plus one per m-tile; ties go to larger CTAs (fewer stagings of
 * the same candidates).
 */
static inline int choose_mt(uint32_t n_tokens, uint32_t heads, int sms, int max_mt) {
  uint64_t best = UINT64_MAX;
  int best_mt = max_mt;
  for (int mt = max_mt; mt >= 1; mt /= 2) {
    const uint64_t groups = (heads + 16u * mt - 1) / (16u * mt);
    const uint64_t waves = ((uint64_t)n_tokens * groups + sms - 1) / sms;
    const uint64_t cost = waves * (uint64_t)(mt + 1);
    if (cost < best) {
      best = cost;
      best_mt = mt;
    }
  }
  return best_mt;
}

#endif /* DSV4_KERNELS_CUDA_ATTENTION_FAST_CUH */
