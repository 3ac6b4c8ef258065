/*
 * The consumer: Q weightless RMSNorm + RoPE, and KV (optional RMSNorm) + RoPE + fp8/UE8M0
 * quantisation + paged insert (SPEC §2.1-2.2, §3), computing exactly the CPU reference's bytes.
 *
 * Rows and thread mapping. A token has `heads` Q rows (none when q_out is NULL: the KV-only
 * launch of the fused decode path) and, when the launch writes the cache, one KV row (the last):
 * 512 bf16 values, 1 KiB. A warp processes a row at a time. Lane l holds dims 8l..8l+7 ("a") and
 * 256+8l..256+8l+7 ("b"): two 16-byte pieces at byte 16l and 512+16l, so every warp-wide access
 * covers 512 contiguous bytes. The canonical sum of squares and the Q row's numerics map onto this
 * layout exactly ("split" in q-norm.cuh, which the attention kernels share). The RoPE dims
 * 448..511 are "b" of lanes 24..31, four pairs each, with one 16-byte load of cos and one of sin
 * from the resident RoPE row.
 *
 * KV: the seven 64-value NoPE tiles are eight lanes each ("a" of lanes 8j..8j+7 for tiles 0..3,
 * "b" of lanes 8(j-4).. for tiles 4..6), so a tile's amax takes three xor shuffles. Each lane
 * stores its 8 fp8 bytes (or, on lanes 24..31, 16 bytes of rotated bf16), and lane 0 stores the 8
 * scale bytes: every output byte has exactly one store (SPEC §5.1), computed in registers first.
 *
 * Grid. 128-thread blocks; the launch's rows in token order are cut into runs of one row per warp
 * (a small launch: the shortest path to its last byte), or two or three (a large one: many short
 * blocks in launch order, so that the rows in flight at any moment lie close together in memory,
 * which the DRAM serves best), with a last wave of one-row warps, so that the grid's last blocks
 * are its shortest. A warp streams its run through a ring of two rows in shared memory filled by
 * cp.async, so the next row is in flight while one is computed.
 *
 * Ordering (SPEC §5.2): every block executes griddepcontrol.wait before it reads positions, slots,
 * q or kv or stores anything; before it there is only index arithmetic and the reading of the
 * kernel's own (immutable) parameters.
 */
#include "cuda-internal.cuh"
#include "q-norm.cuh"

#include "dsv4-error.h"
#include "dsv4-numerics.h"

#define QKV_BLOCK 128
#define WARPS_PER_BLOCK (QKV_BLOCK / 32)
#define FULL 0xffffffffu
#define ROW_U4 (DSV4_HEAD_DIM * 2 / 16) /* uint4s in a 512-value bf16 row */
/* The lane mapping of the comment above: a lane's "b" values start HALF_DIMS dims (HALF_U4 uint4s
 * of bf16) after its "a" values; lanes from ROPE_LANE0 hold the RoPE dims in "b". */
#define LANE_DIMS 8
#define HALF_DIMS (DSV4_HEAD_DIM / 2)
#define HALF_U4 (ROW_U4 / 2)
#define ROPE_LANE0 ((DSV4_NOPE_DIM - HALF_DIMS) / LANE_DIMS)
static_assert(ROPE_LANE0 == QN_SPLIT_ROPE_LANE0, "the split layout of q-norm.cuh");
/* A RoPE row in float4s: cos in the first ROPE_SIN_F4, then sin. */
#define ROPE_ROW_F4 (DSV4_ROPE_ROW_FLOATS / 4)
#define ROPE_SIN_F4 (DSV4_ROPE_PAIRS / 4)
/* The lanes of one 64-value NoPE tile, and the kv_norm weights of "b" in float4s. */
#define TILE_LANES (DSV4_TILE / LANE_DIMS)
#define HALF_W4 (HALF_DIMS / 4)
/* Rows in flight per warp: the entries of its shared-memory ring (a power of two). */
#define RING 2

typedef struct {
  const uint4 *q;
  const uint4 *kv;
  const int64_t *pos;
  const int64_t *slots;
  const float4 *rope; /* 16 float4 per row: cos 0..7, sin 8..15 */
  const float4 *w;    /* kv_norm weight, 128 float4, or NULL */
  uint4 *q_out;
  uint8_t *cache;
  float eps;
  uint32_t heads;
  uint32_t ipt; /* items per token: heads, + 1 with the KV item */
  uint16_t bs_shift;
  uint16_t per; /* rows per warp of warps 0..w2-1 */
  uint64_t stride;
  uint64_t n_slots;
  int64_t max_pos;
  uint32_t n_rows; /* n_tokens * ipt */
  uint32_t w2;     /* warps w2.. have one row each */
} insert_params_t;

static_assert(sizeof(insert_params_t) == 112, "the parameter block stays within its lines");

#ifdef DSV4_TEST_TUNE
/* Test-only (tests/bench, the tuning build): rows per warp of every warp (no one-row tail),
 * instead of the launcher's choice; at most 64. */
unsigned dsv4__cuda_test_rows_per_warp;
#endif

/* ---- stores (counted in the single-writer test build) ---- */

#ifdef DSV4_TEST_COUNT_STORES
typedef struct {
  uintptr_t base;
  size_t len;
  unsigned *counts;
} count_region_t;
__device__ count_region_t count_regions[2];

static __device__ void count_store(const void *p, unsigned n) {
  uintptr_t a = (uintptr_t)p;
  for (int r = 0; r < 2; r++) {
    const count_region_t *c = &count_regions[r];
    if (a >= c->base && a - c->base < c->len)
      for (unsigned k = 0; k < n && a - c->base + k < c->len; k++)
        atomicAdd(&c->counts[a - c->base + k], 1u);
  }
}

extern "C" int dsv4__cuda_test_count_regions(void *base0, size_t len0, unsigned *counts0,
                                             void *base1, size_t len1, unsigned *counts1) {
  count_region_t r[2] = {{(uintptr_t)base0, len0, counts0}, {(uintptr_t)base1, len1, counts1}};
  return dsv4__cuda_err(cudaMemcpyToSymbol(count_regions, r, sizeof(r)));
}
#define COUNT_STORE(p, n) count_store((p), (n))
#else
#define COUNT_STORE(p, n) ((void)0)
#endif

static __device__ __forceinline__ void st16(void *p, uint4 v) {
  *(uint4 *)p = v;
  COUNT_STORE(p, 16);
}

/*
 * q_out: written once and never read here. A small launch (CS) stores it evict-first
 * (st.global.cs), which keeps in the L2 what the next forwards come back to; a large one with
 * plain stores, which move more of the copy bandwidth on large launches and would cost time on
 * small ones (see tests/bench/NOTES.md, "Figures formerly quoted in kernel comments", qkv_insert:
 * q_out stores).
 */
#ifdef DSV4_TEST_TUNE
__device__ unsigned dsv4__cuda_test_flags_dev;
#define dsv4__cuda_test_flags dsv4__cuda_test_flags_dev
#endif

template <bool CS> static __device__ __forceinline__ void st16q(uint4 *p, uint4 v) {
#ifdef DSV4_TEST_TUNE
  if (dsv4__cuda_test_flags & 4) {
    *p = v;
    return;
  }
#endif
  if (CS)
    __stcs(p, v);
  else
    *p = v;
  COUNT_STORE(p, 16);
}

static __device__ __forceinline__ void st8(void *p, uint2 v) {
  *(uint2 *)p = v;
  COUNT_STORE(p, 8);
}

/* ---- numerics on a lane's eight values (q-norm.cuh, shared with the attention kernels) ---- */

static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return dsv4__bf16x2_rn(lo, hi);
}

/* ---- one row ---- */

/* The token a warp is at: its position's RoPE values for this lane, and its slot. */
typedef struct {
  float4 c, s;  /* cos and sin of this lane's four pairs (lanes 24..31) */
  int64_t slot; /* the token's slot when the warp's run holds its KV row */
  uint32_t t;
} tok_t;

template <bool CS>
static __device__ __forceinline__ void q_row(const insert_params_t &p, uint32_t lane,
                                             const tok_t &k, uint32_t h, uint4 ra, uint4 rb) {
  uint4 oa, ob;
  qn_row_split(lane, ra, rb, k.c, k.s, p.eps, &oa, &ob);
  uint4 *out = p.q_out + ((uint64_t)k.t * p.heads + h) * ROW_U4;
  st16q<CS>(out + lane, oa);
  st16q<CS>(out + HALF_U4 + lane, ob);
}

/* The tile maximum of |z| over the 8 lanes of an aligned group, from the 1e-4 floor. */
static __device__ __forceinline__ float tile_amax(const float z[8]) {
  float m = DSV4_AMAX_FLOOR;
#pragma unroll
  for (int k = 0; k < 8; k++) {
    float a = fabsf(z[k]);
    m = a > m ? a : m; /* as the CPU: a NaN never becomes the maximum */
  }
  m = fmaxf(m, __shfl_xor_sync(FULL, m, 1));
  m = fmaxf(m, __shfl_xor_sync(FULL, m, 2));
  return fmaxf(m, __shfl_xor_sync(FULL, m, 4));
}

static __device__ __forceinline__ uint2 quant8(const float z[8], dsv4_i32 e) {
  float scale = dsv4_pow2_neg(e);
  uint32_t p[4];
#pragma unroll
  for (int k = 0; k < 4; k++)
    p[k] = dsv4__e4m3x2_rn(__fmul_rn(z[2 * k], scale), __fmul_rn(z[2 * k + 1], scale));
  return make_uint2(p[0] | (p[1] << 16), p[2] | (p[3] << 16));
}

static __device__ __forceinline__ void kv_row(const insert_params_t &p, uint32_t lane,
                                              const tok_t &k, uint4 ra, uint4 rb) {
  float za[8], zb[8];
  qn_unpack8(ra, za);
  qn_unpack8(rb, zb);
  if (p.w) {
    float r = dsv4_rms_factor(qn_sumsq_split(za, zb), p.eps);
    const float4 w0 = p.w[2 * lane], w1 = p.w[2 * lane + 1];
    const float4 w2 = p.w[HALF_W4 + 2 * lane], w3 = p.w[HALF_W4 + 2 * lane + 1];
    const float wa[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    const float wb[8] = {w2.x, w2.y, w2.z, w2.w, w3.x, w3.y, w3.z, w3.w};
    /* Rounded to bf16 and back, a pair per instruction. */
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      uint32_t pa = pack2(__fmul_rn(__fmul_rn(za[k], r), wa[k]),
                          __fmul_rn(__fmul_rn(za[k + 1], r), wa[k + 1]));
      uint32_t pb = pack2(__fmul_rn(__fmul_rn(zb[k], r), wb[k]),
                          __fmul_rn(__fmul_rn(zb[k + 1], r), wb[k + 1]));
      za[k] = __uint_as_float(pa << 16);
      za[k + 1] = __uint_as_float(pa & 0xffff0000u);
      zb[k] = __uint_as_float(pb << 16);
      zb[k + 1] = __uint_as_float(pb & 0xffff0000u);
    }
  }
  dsv4_i32 ea = dsv4_ue8m0_exponent(tile_amax(za));
  dsv4_i32 eb = dsv4_ue8m0_exponent(tile_amax(zb)); /* lanes 24..31: not a tile, unused */
  uint32_t code_a = (uint32_t)(ea + DSV4_UE8M0_BIAS), code_b = (uint32_t)(eb + DSV4_UE8M0_BIAS);
  /* Scale byte j is tile j's code, held by the tile's first lane: lane TILE_LANES * j of "a" for
   * tiles 0..3, lane TILE_LANES * (j - 4) of "b" for tiles 4..6. */
  uint32_t lo = __shfl_sync(FULL, code_a, 0) | (__shfl_sync(FULL, code_a, TILE_LANES) << 8) |
                (__shfl_sync(FULL, code_a, 2 * TILE_LANES) << 16) |
                (__shfl_sync(FULL, code_a, 3 * TILE_LANES) << 24);
  uint32_t hi = __shfl_sync(FULL, code_b, 0) | (__shfl_sync(FULL, code_b, TILE_LANES) << 8) |
                (__shfl_sync(FULL, code_b, 2 * TILE_LANES) << 16); /* byte 7: the pad, 0 */
  uint64_t block = (uint64_t)k.slot >> p.bs_shift;
  uint64_t o = (uint64_t)k.slot & ((1ull << p.bs_shift) - 1);
  uint8_t *base = p.cache + block * p.stride;
  uint8_t *rec = base + o * DSV4_TOKEN_DATA_BYTES;
  st8(rec + LANE_DIMS * lane, quant8(za, ea));
  if (lane < ROPE_LANE0) {
    st8(rec + HALF_DIMS + LANE_DIMS * lane, quant8(zb, eb));
  } else {
#ifdef DSV4_TEST_BROKEN_BULK_STORE
    /* Test-only breakage of SPEC §5.1 (the vLLM XPU bug): the unrotated values first. */
    st16(rec + DSV4_NOPE_DIM + 2 * LANE_DIMS * (lane - ROPE_LANE0),
         make_uint4(pack2(zb[0], zb[1]), pack2(zb[2], zb[3]), pack2(zb[4], zb[5]),
                    pack2(zb[6], zb[7])));
#endif
    st16(rec + DSV4_NOPE_DIM + 2 * LANE_DIMS * (lane - ROPE_LANE0), qn_rope4(zb, k.c, k.s));
  }
  if (lane == 0)
    st8(base + ((uint64_t)DSV4_TOKEN_DATA_BYTES << p.bs_shift) + DSV4_SCALE_BYTES * o,
        make_uint2(lo, hi));
}

/* ---- asynchronous copies into the warp's ring of rows (cp.async, sm_80+) ---- */

/*
 * An L2 policy that evicts the lines it is attached to first (createpolicy, sm_80+). A small launch
 * reads its rows with it: they are read once, and the lines other forwards come back to (the
 * kernels' code and launch parameters, RoPE rows) then stay in the L2 instead of being pushed out
 * by them (see tests/bench/NOTES.md, "Figures formerly quoted in kernel comments", qkv_insert:
 * evict-first reads). No memory is read.
 */
static __device__ __forceinline__ uint64_t evict_first_policy(void) {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

/* 16 bytes from global to shared memory; with EF under the L2 policy pol. */
template <bool EF>
static __device__ __forceinline__ void cp16(uint4 *smem, const uint4 *gmem, uint64_t pol) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  if (EF)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(a), "l"(gmem),
                 "l"(pol)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem) : "memory");
}

static __device__ __forceinline__ void cp_commit(void) {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N> static __device__ __forceinline__ void cp_wait(void) {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* The row r of token t: Q head r, or the KV row (r == heads). */
static __device__ __forceinline__ const uint4 *row_of(const insert_params_t &p, uint32_t t,
                                                      uint32_t r) {
  return r < p.heads ? p.q + ((uint64_t)t * p.heads + r) * ROW_U4 : p.kv + (uint64_t)t * ROW_U4;
}

/* Issue the copies of row r of token t into ring entry e. */
template <bool EF>
static __device__ __forceinline__ void fetch_row(const insert_params_t &p, uint4 *e, uint32_t lane,
                                                 uint32_t t, uint32_t r, uint64_t pol) {
  const uint4 *row = row_of(p, t, r);
  cp16<EF>(e + lane, row + lane, pol);
  cp16<EF>(e + HALF_U4 + lane, row + HALF_U4 + lane, pol);
}

/*
 * The rows of the launch in token order (token t: Q heads 0..heads-1, then its KV row when the
 * launch writes the cache), cut into one contiguous run of `per` rows for each warp below w2 and
 * of one row for each warp from w2 on (the last wave of a large launch). A warp streams its run
 * through a ring of S rows in shared memory: each lane copies (cp.async) the 32 bytes of each row
 * it later reads itself, so the lane's own cp.async.wait_group is all the synchronisation there is,
 * and a copy group is committed for every row, empty or not, so that "the oldest row has arrived"
 * is always "at most S-1 groups pending". The ring runs across token boundaries; at each new token
 * the warp reads its position, RoPE row and slot. EF: the rows are read with the evict-first L2
 * policy.
 */
template <int S, bool EF>
__global__ void __launch_bounds__(QKV_BLOCK) dsv4__qkv_insert_kernel(insert_params_t p) {
  __shared__ uint4 rings[WARPS_PER_BLOCK][S * ROW_U4];
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t warp = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
  const uint32_t g0 = warp < p.w2 ? warp * p.per : p.w2 * p.per + (warp - p.w2);
  const uint32_t g1 = min(g0 + (warp < p.w2 ? p.per : 1u), p.n_rows);
  uint4 *ring = rings[threadIdx.x >> 5];
#ifdef DSV4_TEST_BROKEN_EARLY_READ
  /* Test-only breakage of SPEC §5.2 (the SGLang bug): the slot of the warp's first token is read
   * before the wait, while the producer may not have written it yet. */
  const int64_t early_slot = g0 < g1 ? p.slots[g0 / p.ipt] : -1;
#endif
  const uint64_t pol = EF ? evict_first_policy() : 0;
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  if (g0 >= g1)
    return;
  /* The prologue: the first S rows. */
  uint32_t gp = g0, pt = g0 / p.ipt, pr = g0 - pt * p.ipt;
#pragma unroll
  for (int d = 0; d < S; d++) {
    if (gp < g1) {
      fetch_row<EF>(p, ring + d * ROW_U4, lane, pt, pr, pol);
      gp++;
      if (++pr == p.ipt) {
        pr = 0;
        pt++;
      }
    }
    cp_commit();
  }
  tok_t k;
  k.t = 0xffffffffu;
  int ok = 0;
  uint32_t t = g0 / p.ipt, r = g0 - t * p.ipt;
  for (uint32_t g = g0; g < g1; g++) {
    if (t != k.t) {
      k.t = t;
      const int64_t pos = p.pos[t];
      /* The token's KV row is the last of its rows: the slot is needed when it is in this run. */
      k.slot = p.ipt > p.heads && t * p.ipt + p.heads < g1 ? p.slots[t] : -1;
#ifdef DSV4_TEST_BROKEN_EARLY_READ
      if (g == g0)
        k.slot = early_slot;
#endif
      ok = pos >= 0 && pos < p.max_pos;
      if (lane >= ROPE_LANE0 && ok) {
        const float4 *cs = p.rope + (uint64_t)pos * ROPE_ROW_F4 + (lane - ROPE_LANE0);
        k.c = cs[0];
        k.s = cs[ROPE_SIN_F4];
      }
    }
    uint4 *e = ring + ((g - g0) & (S - 1)) * ROW_U4;
    cp_wait<S - 1>();
    uint4 ra = e[lane], rb = e[HALF_U4 + lane];
    if (!ok) {
      /* warp-uniform; valid batches never get here (cuda-kernels.h) */
#ifdef DSV4_TEST_TUNE
    } else if (dsv4__cuda_test_flags & 1) {
      /* Tuning: the same traffic without the arithmetic. */
      uint4 *out = p.q_out + ((uint64_t)k.t * p.heads + (r < p.heads ? r : 0)) * ROW_U4;
      st16q<EF>(out + lane, ra);
      st16q<EF>(out + HALF_U4 + lane, rb);
#endif
    } else if (r < p.heads) {
      q_row<EF>(p, lane, k, r, ra, rb);
    } else if (k.slot >= 0 && (uint64_t)k.slot < p.n_slots) {
      kv_row(p, lane, k, ra, rb);
    }
    if (gp < g1) {
      fetch_row<EF>(p, e, lane, pt, pr, pol);
      gp++;
      if (++pr == p.ipt) {
        pr = 0;
        pt++;
      }
    }
    cp_commit();
    if (++r == p.ipt) {
      r = 0;
      t++;
    }
  }
  cp_wait<0>();
}

#ifdef DSV4_TEST_TUNE
unsigned dsv4__cuda_test_flags_host;
#endif

/* Resident blocks per SM of a kernel variant, read once (it depends on the registers, the shared
 * memory and the block size, which are the same on every device of one build). */
template <int S, bool EF> static int blocks_per_sm(void) {
  static int cached = 0;
  if (cached == 0) {
    int n = 0;
    /* The rings live in shared memory: ask for the carveout that holds the most of them. */
    (void)cudaFuncSetAttribute(dsv4__qkv_insert_kernel<S, EF>,
                               cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, dsv4__qkv_insert_kernel<S, EF>, QKV_BLOCK,
                                                      0) != cudaSuccess ||
        n < 1) {
      (void)cudaGetLastError();
      n = 1;
    }
    cached = n;
  }
  return cached;
}

extern "C" int dsv4__cuda_qkv_insert(const dsv4_insert_args_t *a, const float *rope_rows_dev,
                                     int64_t max_positions, cudaStream_t s, int pdl) {
  if (!a)
    return DSV4_EINVAL;
  /* q_out NULL with write_kv: the KV rows only (backend.h, the fused decode path), which the shared
   * check, made for every backend, refuses; it only compares pointers with NULL, so it sees a
   * stand-in here. */
  const int kv_only = !a->q_out && a->write_kv;
  dsv4_insert_args_t chk = *a;
  if (kv_only)
    chk.q_out = reinterpret_cast<uint16_t *>(a->cache);
  int rc = dsv4_backend_check_insert_args(&chk);
  if (rc || a->n_tokens == 0)
    return rc;
  if (!rope_rows_dev || max_positions <= 0)
    return DSV4_EINVAL;
  if (((uintptr_t)a->q | (uintptr_t)a->kv | (uintptr_t)a->q_out | (uintptr_t)rope_rows_dev |
       (uintptr_t)a->kv_norm_weight) &
      15u)
    return DSV4_EINVAL;
  insert_params_t p = {};
  if (a->write_kv) {
    uint32_t bs = a->block_size;
    if ((uintptr_t)a->cache & 15u)
      return DSV4_EINVAL;
    while ((1u << p.bs_shift) < bs)
      p.bs_shift++;
    p.n_slots = (uint64_t)a->n_blocks * bs;
  }
  dsv4__cuda_dev_t dev;
  int err = dsv4__cuda_dev_info(&dev);
  if (err)
    return err;
  p.q = (const uint4 *)a->q;
  p.kv = (const uint4 *)a->kv;
  p.pos = a->positions;
  p.slots = a->slots;
  p.rope = (const float4 *)rope_rows_dev;
  p.w = (const float4 *)a->kv_norm_weight;
  p.q_out = (uint4 *)a->q_out;
  p.cache = a->cache;
  p.eps = a->eps;
  /* A launch of the KV rows only has no Q rows: with heads 0 every row is a token's KV row. */
  p.heads = kv_only ? 0u : a->heads;
  p.ipt = p.heads + (a->write_kv ? 1u : 0u);
  p.stride = a->stride;
  p.max_pos = max_positions;
  pdl = pdl && dev.pdl;

  /*
   * Rows per warp: one while the rows fit on the device at once (a small batch: the shortest path
   * to its last byte), two up to 8 such waves of warps, three beyond. Many short blocks in launch
   * order keep the rows in flight at any moment close together in memory, which the DRAM serves
   * best: two rows per warp move more of the copy bandwidth at large N than one resident wave of
   * warps with long runs; three beat two only from many waves up. Beyond two waves the last wave
   * of warps has one row each, which shortens the grid's tail (see tests/bench/NOTES.md, "Figures
   * formerly quoted in kernel comments", qkv_insert: rows per warp).
   */
  uint64_t rows = (uint64_t)a->n_tokens * p.ipt;
  if (rows > 0x7fffffffu)
    return DSV4_EINVAL;
  p.n_rows = (uint32_t)rows;
  uint64_t resident = (uint64_t)dev.sms * blocks_per_sm<RING, false>() * WARPS_PER_BLOCK;
  p.per = rows <= resident ? 1 : rows <= 8 * resident ? 2 : 3;
#ifdef DSV4_TEST_TUNE
  {
    static unsigned flags_set = ~0u;
    if (flags_set != dsv4__cuda_test_flags_host) {
      flags_set = dsv4__cuda_test_flags_host;
      if (cudaMemcpyToSymbol(dsv4__cuda_test_flags_dev, &flags_set, sizeof(flags_set)) != 0)
        return DSV4_EBACKEND;
    }
  }
  const int forced = dsv4__cuda_test_rows_per_warp != 0;
  if (forced)
    p.per = (uint16_t)min(dsv4__cuda_test_rows_per_warp, 64u);
#else
  const int forced = 0;
#endif
  const uint64_t tail = !forced && p.per > 1 && rows > 2 * resident ? resident : 0;
  p.w2 = (uint32_t)((rows - tail) / p.per);
  uint64_t warps = p.w2 + (rows - (uint64_t)p.w2 * p.per);
  uint64_t grid = (warps + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
  if (grid > 0x7fffffffu)
    return DSV4_EINVAL;
  /*
   * Rows read evict-first up to eight waves of warps: it shortens small and medium forwards, and
   * costs time beyond, where every line is streamed anyway (see tests/bench/NOTES.md, "Figures
   * formerly quoted in kernel comments", qkv_insert: evict-first reads).
   */
  cudaError_t e;
  if (rows <= 8 * resident) {
    (void)blocks_per_sm<RING, true>(); /* its first call sets the variant's carveout */
    e = dsv4__cuda_launch(dsv4__qkv_insert_kernel<RING, true>, (unsigned)grid, QKV_BLOCK, s, pdl,
                          p);
  } else {
    e = dsv4__cuda_launch(dsv4__qkv_insert_kernel<RING, false>, (unsigned)grid, QKV_BLOCK, s, pdl,
                          p);
  }
  return dsv4__cuda_err(e);
}
