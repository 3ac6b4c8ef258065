/*
 * The indexer's selection of a ratio-4 layer (SPEC §8.5), exact mode, computing exactly the CPU
 * reference's selection (cpu_compress.c): per token, the top-k of its visible entries under (score
 * descending, entry ascending), listed in increasing entry, -1 padded.
 *
 *   check    one warp per token: its segment and position, and for a token that must score (more
 *            than topk visible entries) the block of every visible entry, the lanes taking every
 *            32nd block. Consecutive tokens of a segment see entries from the same first one, so
 *            a token whose predecessor scored checks only the blocks past the predecessor's last
 *            one (together they cover every range). A failure sets bits of the error word, and
 *            the select kernel then writes nothing. With the tensor-core score kernels the check's
 *            CTAs are part of the first wave's query launch (indexer_mma.cu), beside the queries,
 *            which do not depend on it: one launch less ahead of the scores.
 *   score    in waves of at most one token per SM (a token's keys take one slot of the key
 *            scratch), a grid of (token, split) CTAs: a token's visible entries are split over
 *            several CTAs, so that one token's scan spreads over the device. Each CTA of a token
 *            that must score computes the dequantised index queries q^ of every head
 *            (dsv4_index_query: RoPE at p, Hadamard, MXFP4; a warp per head, index_query_warp)
 *            and the weights into shared memory; then one thread per entry of its split
 *            dequantises the entry's index record, computes its score (the heads in order,
 *            dsv4_index_score_add) and stores the order key (dsv4_index_score_key) at the entry's
 *            index in the token's slot. A split with fewer entries than threads (a decode at short
 *            context) gives each entry a group of TPE lanes that share its heads' dot products and
 *            add them in the same order. With V4's 64 index heads on compute capability 9.0 and
 *            newer the same grid runs indexer_mma.cu's kernel instead, whose dot products come from
 *            the tensor cores with the same bits, after a query kernel that forms each scoring
 *            token's q^ once for all its splits, at the end of the token's key slot
 *            (dsv4__cuda_indexer_set_path picks the per-entry kernel, or the tensor-core kernel's
 *            lower modes, for the tests that compare them).
 *   select   one CTA of 512 threads per token of the wave. A token with at most topk visible
 *            entries lists them. Otherwise a radix select over its keys (8 bits at a time from
 *            the top, a shared histogram per round, a shared atomic a key, the bucket found by a
 *            block-wide scan) finds the k-th largest key T and how many keys equal to T are taken
 *            (a round whose bucket is taken whole ends it early, T the bucket's least key); a last
 *            pass over the keys in entry order, 4096 at a time (8 a thread) with two block-wide
 *            prefix sums, lists every key above T and the first of those equal to T. A token of
 *            at most 16384 keys (64K positions) has them loaded into registers once, in the last
 *            pass's layout (the first 4096 before the token's range is read, beside it), and its
 *            last pass takes one prefix sum over all of them; above that, the rounds read them
 *            from global memory until the keys still in the race fit 8192, which the round that
 *            counts them copies into shared memory for the later rounds. One select CTA an SM:
 *            its launch asks for unused shared memory (select_pad_probe), whatever registers the
 *            kernel is compiled to (128 a thread, which alone would do; 64 would allow two).
 *
 * The scores are the CPU's to the bit (the same functions of dsv4-compress.h in the same order) and
 * the selection is a function of the scores alone, so the lists are equal. In fast mode
 * (dsv4_indexer_args_t.fast) the tensor-core kernel sums the heads in another fixed order, so a
 * list may differ from the CPU's at near-ties (SPEC §8.9).
 *
 * Ordering (SPEC §5.2): every kernel executes the dependency wait first in every CTA (the select
 * kernel's waits for the score kernel that wrote its keys; the tensor-core score kernel only fills
 * a table in shared memory before it); the score and select kernels read the error word after it,
 * and return only after it.
 */
#include "indexer-common.cuh"

#include <atomic>

/* Consecutive keys a thread takes in a round of list_selected. */
#define LIST_PER 8
/* Lanes per entry in score_entries_grouped. */
#define TPE 8

/* ---- check ---- */

__global__ void __launch_bounds__(CHECK_BLOCK) dsv4__indexer_check_kernel(idx_params_t p) {
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  indexer_check_item(p, blockIdx.x * CHECK_BLOCK + threadIdx.x);
}

/* ---- select ---- */

/* Threads of a select CTA: a token's selection is one CTA, so at small batches the CTA's warps are
 * all an SM has to hide the histogram's shared atomics and the scans' barriers with. On the H200
 * 512 beat 256 at 64K positions (the wider CTA's histogram) and 1024 (its wider scans). */
#define SELECT_THREADS 512
#define SELECT_WARPS (SELECT_THREADS / 32)

/* The inclusive prefix sum of x over the warp's lanes. */
static __device__ __forceinline__ uint32_t warp_scan(uint32_t x) {
  const uint32_t lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t y = __shfl_up_sync(FULL, x, off);
    if (lane >= (uint32_t)off)
      x += y;
  }
  return x;
}

/* The exclusive prefix sum of v over the CTA (in thread order) and, in *total, the sum. */
static __device__ uint32_t block_scan(uint32_t v, uint32_t *warp_sums, uint32_t *total) {
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t x = warp_scan(v);
  if (lane == 31)
    warp_sums[warp] = x;
  __syncthreads();
  uint32_t before = 0, all = 0;
  for (uint32_t w = 0; w < SELECT_WARPS; w++) {
    before += w < warp ? warp_sums[w] : 0u;
    all += warp_sums[w];
  }
  __syncthreads(); /* warp_sums is rewritten by the next scan */
  *total = all;
  return before + x - v;
}

/* The scores of entries jlo + i, i in [i0, i1), of segment s as order keys in keys[i]: a thread
 * per entry, each head's dot product and the heads' sum in order. */
static __device__ void score_entries(const idx_params_t &p, uint32_t s, int64_t jlo, uint32_t i0,
                                     uint32_t i1, const float *qhat, const float *w,
                                     uint32_t *keys) {
  for (uint32_t i = i0 + threadIdx.x; i < i1; i += SEL_THREADS) {
    float k[DSV4_INDEX_DIM];
    entry_key(p, s, jlo + i, k);
    float acc = 0.0f;
    for (uint32_t h = 0; h < p.n_heads; h++)
      acc = dsv4_index_score_add(w[h], dsv4_dot128(qhat + (size_t)h * Q_STRIDE, k), acc);
    keys[i] = dsv4_index_score_key(acc);
  }
}

/*
 * The same keys when a split has fewer entries than threads (a decode token's split at short
 * context): TPE lanes per entry, lane g of a group computing the dot products of heads g, g + TPE,
 * ...; then every lane of the group adds the heads' terms in order, taking each product from the
 * lane that computed it, so the sum is the one score_entries forms. Every lane of a warp takes the
 * same number of turns (the shuffles), and only those of an entry in range compute or store.
 */
static __device__ void score_entries_grouped(const idx_params_t &p, uint32_t s, int64_t jlo,
                                             uint32_t i0, uint32_t i1, const float *qhat,
                                             const float *w, uint32_t *keys) {
  constexpr uint32_t PER = SEL_THREADS / TPE; /* entries a turn */
  constexpr uint32_t MAXM = (DSV4_MAX_HEADS + TPE - 1) / TPE;
  const uint32_t lane = threadIdx.x & 31, g = lane % TPE, base = lane - g;
  for (uint32_t i = i0 + threadIdx.x / TPE; i - threadIdx.x / TPE < i1; i += PER) {
    const bool in = i < i1;
    float d[MAXM];
    if (in) {
      float k[DSV4_INDEX_DIM];
      entry_key(p, s, jlo + i, k);
#pragma unroll
      for (uint32_t m = 0; m < MAXM; m++)
        d[m] = g + TPE * m < p.n_heads ? dsv4_dot128(qhat + (size_t)(g + TPE * m) * Q_STRIDE, k)
                                       : 0.0f;
    } else {
#pragma unroll
      for (uint32_t m = 0; m < MAXM; m++)
        d[m] = 0.0f;
    }
    float acc = 0.0f;
#pragma unroll
    for (uint32_t m = 0; m < MAXM; m++)
      for (uint32_t gg = 0; gg < TPE; gg++) {
        const float v = __shfl_sync(FULL, d[m], base + gg);
        if (TPE * m + gg < p.n_heads)
          acc = dsv4_index_score_add(w[TPE * m + gg], v, acc);
      }
    if (in && g == 0)
      keys[i] = dsv4_index_score_key(acc);
  }
}

/* Keys a selection copies into shared memory once those still in the race fit (32 KiB). */
#define SEL_CAND 8192
/* Keys a thread loads at once in a histogram round from global memory. */
#define HIST_UNROLL 4
/* Rounds of list_selected whose keys a thread holds in registers: tokens with at most REG_KEYS
 * keys are selected without reading them twice. */
#define REG_KEYS 16384
/* Keys of one round of list_selected: LIST_PER consecutive keys a thread. */
#define LIST_ROUND (SELECT_THREADS * LIST_PER)
#define REG_ROUNDS (REG_KEYS / LIST_ROUND)

/* Shared state of the selection. */
typedef struct {
  uint32_t hist[256];
  uint32_t warp_sums[SELECT_WARPS];
  uint32_t round_sums[REG_ROUNDS * SELECT_WARPS]; /* list_registers' scan: a warp's sums a round */
  uint32_t prefix, need, count, n_cand;
  uint32_t cand[SEL_CAND]; /* the keys in the race, in no particular order */
} sel_smem_t;

/* One count per lane with in into bucket b of hist: a shared atomic a key (the hardware serialises
 * the lanes of one bucket). Called by whole warps, as the other round helpers. */
static __device__ __forceinline__ void hist_add(uint32_t *hist, uint32_t b, bool in) {
  if (in)
    atomicAdd(&hist[b], 1u);
}

/* The lanes' keys with in appended to sm.cand, one atomic a warp. Called by whole warps. */
static __device__ __forceinline__ void cand_add(sel_smem_t &sm, uint32_t key, bool in) {
  const uint32_t act = __ballot_sync(FULL, in), lane = threadIdx.x & 31;
  if (!act)
    return; /* warp-uniform */
  const uint32_t leader = __ffs(act) - 1;
  uint32_t base = 0;
  if (lane == leader)
    base = atomicAdd(&sm.n_cand, (uint32_t)__popc(act));
  base = __shfl_sync(FULL, base, leader);
  if (in)
    sm.cand[base + __popc(act & ((1u << lane) - 1u))] = key;
}

/* The histogram under shift of the keys of src[0..n) still in the race ((key & mask) == prefix),
 * HIST_UNROLL loads in flight a thread; with compact, those keys copied into sm.cand too. */
static __device__ void hist_round(const uint32_t *src, uint32_t n, uint32_t mask, uint32_t prefix,
                                  int shift, bool compact, sel_smem_t &sm) {
  for (uint32_t base = 0; base < n; base += SELECT_THREADS * HIST_UNROLL) {
    uint32_t key[HIST_UNROLL];
#pragma unroll
    for (int u = 0; u < HIST_UNROLL; u++) {
      const uint32_t i = base + u * SELECT_THREADS + threadIdx.x;
      key[u] = i < n ? src[i] : 0u;
    }
#pragma unroll
    for (int u = 0; u < HIST_UNROLL; u++) {
      const bool in = base + u * SELECT_THREADS + threadIdx.x < n && (key[u] & mask) == prefix;
      hist_add(sm.hist, (key[u] >> shift) & 255u, in);
      if (compact)
        cand_add(sm, key[u], in);
    }
  }
}

/* After a round's histogram under shift: the bucket b of the k-th largest. The keys matching
 * *prefix number at least *need, so there is exactly one b whose buckets above hold fewer than
 * *need keys and b and those above at least *need. Thread x looks at bucket 255 - x, the scan
 * summing the buckets above it (the threads from 256 on add nothing). *prefix takes b and *need
 * what is left of it; sm.count holds the keys in b.
 */
static __device__ void radix_choose(int shift, uint32_t *prefix, uint32_t *need, sel_smem_t &sm) {
  static_assert(SELECT_THREADS >= 256, "a thread per bucket");
  const uint32_t b = 255u - threadIdx.x, hb = threadIdx.x < 256 ? sm.hist[b] : 0u;
  uint32_t total;
  const uint32_t above = block_scan(hb, sm.warp_sums, &total);
  if (threadIdx.x < 256 && above < *need && above + hb >= *need) {
    sm.prefix = *prefix | (b << shift);
    sm.need = *need - above;
    sm.count = hb;
  }
  __syncthreads();
  *prefix = sm.prefix;
  *need = sm.need;
}

/* A threshold T of the n keys and in *need how many keys equal to T the top k take: the k-th
 * largest key, as cpu_compress.c's select_topk finds it, one histogram per 8 bits; or, once a
 * round's chosen bucket is taken whole, the least key of that bucket (its lower bits zero) with
 * *need every key equal to it, since the top k are then exactly the keys from T up. The first round
 * whose keys in the race fit SEL_CAND copies them into shared memory, and the later rounds read
 * them there. */
static __device__ uint32_t radix_select(const uint32_t *keys, uint32_t n, uint32_t k,
                                        uint32_t *need_out, sel_smem_t &sm) {
  uint32_t prefix = 0, mask = 0, need = k, count = n, n_src = n;
  const uint32_t *src = keys;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (uint32_t i = threadIdx.x; i < 256; i += SELECT_THREADS)
      sm.hist[i] = 0;
    if (threadIdx.x == 0)
      sm.n_cand = 0;
    __syncthreads();
    const bool compact = src == keys && shift > 0 && count <= SEL_CAND; /* CTA-uniform */
    hist_round(src, n_src, mask, prefix, shift, compact, sm);
    __syncthreads();
    if (compact) {
      src = sm.cand;
      n_src = count; /* every key of the round's race, sm.n_cand of them */
    }
    radix_choose(shift, &prefix, &need, sm);
    count = sm.count;
    mask |= 255u << shift;
    if (count == need) { /* CTA-uniform: the bucket is taken whole */
      need = UINT32_MAX;
      break;
    }
  }
  *need_out = need;
  return prefix;
}

/* How far list_selected got: the keys taken and the keys equal to T met. */
typedef struct {
  uint32_t taken, ties;
} list_state_t;

/* One round of list_selected: the thread's LIST_PER keys of entries i0.. (those below n), two
 * block-wide prefix sums (the keys equal to T before the thread's, then the keys taken before
 * its). Called by the whole CTA. */
static __device__ __forceinline__ void list_round(const uint32_t (&key)[LIST_PER], uint32_t i0,
                                                  uint32_t n, uint32_t T, uint32_t need,
                                                  int64_t jlo, int32_t *out, sel_smem_t &sm,
                                                  list_state_t &st) {
  uint32_t my_eq = 0;
#pragma unroll
  for (uint32_t v = 0; v < LIST_PER; v++)
    my_eq += i0 + v < n && key[v] == T ? 1u : 0u;
  uint32_t n_eq, n_take;
  uint32_t eq = st.ties + block_scan(my_eq, sm.warp_sums, &n_eq); /* keys equal to T before */
  uint32_t take = 0, my_take = 0;
#pragma unroll
  for (uint32_t v = 0; v < LIST_PER; v++) {
    const bool in = i0 + v < n, is_t = in && key[v] == T;
    if ((in && key[v] > T) || (is_t && eq < need)) {
      take |= 1u << v;
      my_take++;
    }
    eq += is_t ? 1u : 0u;
  }
  uint32_t at = st.taken + block_scan(my_take, sm.warp_sums, &n_take);
#pragma unroll
  for (uint32_t v = 0; v < LIST_PER; v++)
    if (take & (1u << v))
      out[at++] = (int32_t)(jlo + i0 + v);
  st.taken += n_take;
  st.ties += n_eq;
}

/* Every key above T and the first need keys equal to T, in entry order, into out[0..k): rounds
 * of LIST_PER consecutive keys a thread. */
static __device__ void list_selected(const uint32_t *keys, uint32_t n, uint32_t T, uint32_t need,
                                     int64_t jlo, int32_t *out, sel_smem_t &sm) {
  list_state_t st = {0, 0};
  for (uint32_t base = 0; base < n; base += LIST_ROUND) {
    const uint32_t i0 = base + threadIdx.x * LIST_PER;
    uint32_t key[LIST_PER];
#pragma unroll
    for (uint32_t v = 0; v < LIST_PER; v++)
      key[v] = i0 + v < n ? keys[i0 + v] : 0u;
    list_round(key, i0, n, T, need, jlo, out, sm, st);
  }
}

/* Every key above T and the first need keys equal to T, in entry order, from the registers of
 * select_in_registers: one block-wide scan over every round's counts at once (in entry order:
 * round, thread), the keys above T in the low 16 bits and those equal to T in the high (at most
 * REG_KEYS of either). The keys a thread's run takes start at the keys above T before it plus those
 * equal to T before it, at most need. */
static __device__ void list_registers(const uint32_t (&k)[REG_ROUNDS][LIST_PER], uint32_t n,
                                      uint32_t T, uint32_t need, int64_t jlo, int32_t *out,
                                      sel_smem_t &sm) {
  static_assert(REG_ROUNDS * SELECT_WARPS == 64, "the first warp scans two sums a lane");
  static_assert(REG_KEYS < 65536, "counts packed 16 bits each");
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t8 = threadIdx.x * LIST_PER;
  uint32_t c[REG_ROUNDS], x[REG_ROUNDS];
#pragma unroll
  for (uint32_t r = 0; r < REG_ROUNDS; r++) {
    c[r] = x[r] = 0;
    if (r * LIST_ROUND >= n) /* CTA-uniform: a short token counts and scans only its rounds */
      continue;
#pragma unroll
    for (uint32_t v = 0; v < LIST_PER; v++)
      if (r * LIST_ROUND + t8 + v < n)
        c[r] += k[r][v] > T ? 1u : k[r][v] == T ? 0x10000u : 0u;
    x[r] = warp_scan(c[r]);
  }
  if (lane == 31)
#pragma unroll
    for (uint32_t r = 0; r < REG_ROUNDS; r++)
      sm.round_sums[r * SELECT_WARPS + warp] = x[r];
  __syncthreads();
  if (warp == 0) { /* the 64 warp sums' exclusive prefix sums, in place */
    const uint32_t a = sm.round_sums[2 * lane], b = sm.round_sums[2 * lane + 1];
    const uint32_t incl = warp_scan(a + b);
    sm.round_sums[2 * lane] = incl - a - b;
    sm.round_sums[2 * lane + 1] = incl - b;
  }
  __syncthreads();
#pragma unroll
  for (uint32_t r = 0; r < REG_ROUNDS; r++) {
    if (r * LIST_ROUND >= n) /* CTA-uniform */
      break;
    const uint32_t before = sm.round_sums[r * SELECT_WARPS + warp] + x[r] - c[r];
    uint32_t eq = before >> 16, at = (before & 0xffffu) + min(eq, need);
#pragma unroll
    for (uint32_t v = 0; v < LIST_PER; v++) {
      const uint32_t i = r * LIST_ROUND + t8 + v;
      if (i >= n)
        break;
      if (k[r][v] > T || (k[r][v] == T && eq < need))
        out[at++] = (int32_t)(jlo + i);
      eq += k[r][v] == T ? 1u : 0u;
    }
  }
}

/* The selection of at most REG_KEYS keys (a token at up to 64K positions on a ratio-4 layer) from
 * registers: k holds each thread's list_selected keys (those past n any value), every histogram
 * round and the list (list_registers) read them there. */
static __device__ void select_in_registers(uint32_t (&k)[REG_ROUNDS][LIST_PER], uint32_t n,
                                           uint32_t topk, int64_t jlo, int32_t *out,
                                           sel_smem_t &sm) {
  const uint32_t t8 = threadIdx.x * LIST_PER;
  uint32_t prefix = 0, mask = 0, need = topk;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (uint32_t i = threadIdx.x; i < 256; i += SELECT_THREADS)
      sm.hist[i] = 0;
    __syncthreads();
#pragma unroll
    for (uint32_t r = 0; r < REG_ROUNDS; r++)
      if (r * LIST_ROUND < n) /* CTA-uniform: a short token skips the rounds it has no key in */
#pragma unroll
        for (uint32_t v = 0; v < LIST_PER; v++)
          hist_add(sm.hist, (k[r][v] >> shift) & 255u,
                   r * LIST_ROUND + t8 + v < n && (k[r][v] & mask) == prefix);
    __syncthreads();
    radix_choose(shift, &prefix, &need, sm);
    mask |= 255u << shift;
    if (sm.count == need) { /* CTA-uniform: the bucket is taken whole (radix_select) */
      need = UINT32_MAX;
      break;
    }
  }
  list_registers(k, n, prefix, need, jlo, out, sm);
}

/* The thread's select_in_registers keys of rounds R0..R1 - 1 among the first words words of keys
 * (16-byte aligned, words a multiple of 4; zeros past them), 16 bytes a load from the L2 (written
 * by the grid before), issued where this is called (volatile: not sunk into the branch that uses
 * them). */
template <uint32_t R0, uint32_t R1>
static __device__ __forceinline__ void load_reg_keys(const uint32_t *keys, uint32_t words,
                                                     uint32_t (&k)[REG_ROUNDS][LIST_PER]) {
  static_assert(LIST_PER % 4 == 0 && R1 <= REG_ROUNDS, "whole 16-byte loads of the rounds");
  const uint32_t t8 = threadIdx.x * LIST_PER;
#pragma unroll
  for (uint32_t r = R0; r < R1; r++)
#pragma unroll
    for (uint32_t v = 0; v < LIST_PER; v += 4) {
      const uint32_t i = r * LIST_ROUND + t8 + v;
      uint32_t a = 0, b = 0, c = 0, d = 0;
      if (i < words)
        asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                     : "l"(keys + i));
      k[r][v] = a;
      k[r][v + 1] = b;
      k[r][v + 2] = c;
      k[r][v + 3] = d;
    }
}

/* select_in_registers of keys[0..n), loaded here a word at a time (keys need not be aligned). */
static __device__ void select_registers(const uint32_t *keys, uint32_t n, uint32_t topk,
                                        int64_t jlo, int32_t *out, sel_smem_t &sm) {
  const uint32_t t8 = threadIdx.x * LIST_PER;
  uint32_t k[REG_ROUNDS][LIST_PER];
#pragma unroll
  for (uint32_t r = 0; r < REG_ROUNDS; r++)
#pragma unroll
    for (uint32_t v = 0; v < LIST_PER; v++)
      k[r][v] = r * LIST_ROUND + t8 + v < n ? keys[r * LIST_ROUND + t8 + v] : 0u;
  select_in_registers(k, n, topk, jlo, out, sm);
}

/* The top topk of the n > topk keys (entries jlo, jlo + 1, ...) listed in entry order into out.
 * The select kernel loads a token's registers itself (load_reg_keys, beside its range) and calls
 * this only above REG_KEYS; the register branch here serves gpu_select_test's kernel and the
 * broken build's copy in shared memory, whose keys load_reg_keys' global loads cannot read. */
static __device__ void select_keys(const uint32_t *keys, uint32_t n, uint32_t topk, int64_t jlo,
                                   int32_t *out, sel_smem_t &sm) {
  if (n <= REG_KEYS) {
    select_registers(keys, n, topk, jlo, out, sm);
    return;
  }
  uint32_t need = 0;
  const uint32_t T = radix_select(keys, n, topk, &need, sm);
  list_selected(keys, n, T, need, jlo, out, sm);
}

/* Split y of token t_base + blockIdx.x: the queries, then the keys of its entries, a thread (or
 * TPE lanes) per entry. */
__global__ void __launch_bounds__(SEL_THREADS) dsv4__indexer_score_kernel(idx_params_t p) {
  extern __shared__ float qhat[]; /* [n_heads, Q_STRIDE] q^, then [n_heads] weights */
  uint32_t t, s, i0, i1;
  int64_t jlo;
  if (!score_begin(p, &t, &s, &jlo, &i0, &i1))
    return;
  float *w = qhat + (size_t)p.n_heads * Q_STRIDE;
  const float *rope_row = p.rope + (uint64_t)p.pos[t] * DSV4_ROPE_ROW_FLOATS;
  /* A warp per head's query (index_query_warp), a thread per head's weight. */
  for (uint32_t h = threadIdx.x / 32; h < p.n_heads; h += SEL_WARPS)
    index_query_warp(p.iq + ((uint64_t)t * p.n_heads + h) * DSV4_INDEX_DIM, rope_row,
                     qhat + (size_t)h * Q_STRIDE, nullptr);
  for (uint32_t h = threadIdx.x; h < p.n_heads; h += SEL_THREADS)
    w[h] = __fmul_rn(p.iw[(uint64_t)t * p.n_heads + h], p.w_scale);
  __syncthreads();
  uint32_t *keys = p.keys + (uint64_t)blockIdx.x * p.keys_per_cta;
  if (i1 - i0 < SEL_THREADS) /* CTA-uniform */
    score_entries_grouped(p, s, jlo, i0, i1, qhat, w, keys);
  else
    score_entries(p, s, jlo, i0, i1, qhat, w, keys);
}

/* Token t_base + blockIdx.x's selection: all visible entries when at most topk, else the top topk
 * of the keys the score kernel wrote. */
__global__ void __launch_bounds__(SELECT_THREADS) dsv4__indexer_select_kernel(idx_params_t p) {
  __shared__ sel_smem_t sm;
#ifdef DSV4_TEST_BROKEN_SELECT_EARLY_READ
  /* Test-only breakage of SPEC §5.2 (gpu_inv_select_wait_broken_early_read): the first SEL_CAND
   * keys of the CTA's slot copied into shared memory before the dependency wait, and a token of at
   * most that many selected from the copy. */
  for (uint32_t i = threadIdx.x; i < SEL_CAND && i < p.keys_per_cta; i += SELECT_THREADS)
    sm.cand[i] = p.keys[(uint64_t)blockIdx.x * p.keys_per_cta + i];
  __syncthreads();
#endif
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  const uint32_t t = p.t_base + blockIdx.x;
  if (t >= p.n_tokens)
    return;
  /* The slot's first round of keys (as many of the first LIST_ROUND as a token of
   * the launch can see, slot_key_words) is loaded first, then the error word and the token's
   * range, so that their latencies overlap instead of adding up; the keys past the token's count
   * are never used. The later rounds only once the count is known: a launch's bound is the
   * model's context, and loading 16384 keys for a token of 2048 cost a wave of selects at 8K more
   * than the overlap gained. */
  const uint32_t *keys = p.keys + (uint64_t)blockIdx.x * p.keys_per_cta;
  uint32_t k[REG_ROUNDS][LIST_PER];
  load_reg_keys<0, 1>(
      keys, (uint32_t)min(min(slot_key_words(p.max_pos), p.keys_per_cta), (uint64_t)LIST_ROUND), k);
  const uint32_t err = __ldcg(p.err);
  uint32_t s = 0;
  int64_t jlo = 0, jhi = 0;
  (void)token_range(p, t, &s, &jlo, &jhi); /* checked */
  if (err != 0)
    return; /* the check (or an earlier launch of the batch) failed: write nothing */
  const int64_t n = jhi > jlo ? jhi - jlo : 0;
  int32_t *out = p.sel + (uint64_t)t * p.topk;
  if (n <= (int64_t)p.topk) {
    for (uint32_t j = threadIdx.x; j < p.topk; j += SELECT_THREADS)
      out[j] = j < n ? (int32_t)(jlo + j) : -1;
    return;
  }
#ifdef DSV4_TEST_BROKEN_SELECT_EARLY_READ
  if (n <= SEL_CAND) { /* CTA-uniform; below REG_KEYS, so select_keys never writes sm.cand */
    select_keys(sm.cand, (uint32_t)n, p.topk, jlo, out, sm);
    return;
  }
#endif
  if (n <= REG_KEYS) { /* CTA-uniform */
    load_reg_keys<1, REG_ROUNDS>(keys, ((uint32_t)n + 3) & ~3u, k);
    select_in_registers(k, (uint32_t)n, p.topk, jlo, out, sm);
  } else {
    select_keys(keys, (uint32_t)n, p.topk, jlo, out, sm);
  }
}

#ifdef DSV4_TEST_SELECT
/* gpu_select_test: the selection of CTA b's n[b] keys at keys + b * stride into out + b * topk. */
__global__ void __launch_bounds__(SELECT_THREADS)
    dsv4__indexer_select_test_kernel(const uint32_t *keys, uint64_t stride, const uint32_t *n,
                                     uint32_t topk, int32_t *out) {
  __shared__ sel_smem_t sm;
  select_keys(keys + blockIdx.x * stride, n[blockIdx.x], topk, 0, out + (uint64_t)blockIdx.x * topk,
              sm);
}

extern "C" int dsv4__cuda_test_select(const uint32_t *keys, uint64_t stride, const uint32_t *n,
                                      uint32_t count, uint32_t topk, int32_t *out) {
  dsv4__indexer_select_test_kernel<<<count, SELECT_THREADS>>>(keys, stride, n, topk, out);
  return dsv4__cuda_err(cudaDeviceSynchronize());
}

extern "C" int dsv4__cuda_test_select_launch(const dsv4_test_select_launch_t *a, cudaStream_t s,
                                             int pdl) {
  idx_params_t p = {};
  p.pos = a->positions;
  p.tok_seg = a->tok_seg;
  p.seg_p0 = a->seg_p0;
  p.sel = a->sel;
  p.keys = a->keys;
  p.err = a->err;
  p.max_pos = a->max_positions;
  p.keys_per_cta = a->keys_per_cta;
  p.n_tokens = a->n_tokens;
  p.n_segments = a->n_segments;
  p.topk = a->topk;
  return dsv4__cuda_err(
      dsv4__cuda_launch(dsv4__indexer_select_kernel, a->n_tokens, SELECT_THREADS, s, pdl, p));
}
#endif

/* ---- the launch ---- */

/* The score path of later launches in this process (dsv4__cuda_indexer_set_path). */
static std::atomic<int> score_path{DSV4_CUDA_INDEXER_AUTO};

extern "C" void dsv4__cuda_indexer_set_path(int path) {
  score_path.store(path, std::memory_order_relaxed);
}

static std::atomic<int> force_sync{0};

extern "C" void dsv4__cuda_indexer_force_sync(int on) {
  force_sync.store(on, std::memory_order_relaxed);
}

/*
 * Dynamic shared memory a select CTA asks for and does not use: enough that an SM holds one select
 * CTA, where 64 registers a thread would let it hold two. Two a SM made the selects of a batch
 * of 64 or 256 tokens 4-14 % slower, the CTAs of a wave's selects sharing SMs while others sat
 * idle (tests/bench/NOTES.md, "The select's one-scan listing at one CTA an SM"). Half the SM's
 * shared memory and a byte, less the CTA's static; 0 where the device would not grant it.
 */
static int select_pad_probe(int dev) {
  int per_sm = 0, optin = 0;
  cudaFuncAttributes fa;
  if (cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, dsv4__indexer_select_kernel) != cudaSuccess)
    return 0;
  const long pad = (long)per_sm / 2 + 1 - (long)fa.sharedSizeBytes;
  return pad > 0 && pad + (long)fa.sharedSizeBytes <= (long)optin ? (int)pad : 0;
}

static std::atomic<int> pad_cache[DEV_CACHE];

/* The select kernel over the wave's ctas tokens, one CTA an SM (select_pad_probe). */
static cudaError_t select_launch(const idx_params_t &p, uint32_t ctas, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  const size_t pad = (size_t)per_device_cached(pad_cache, select_pad_probe);
  if (pad) {
    const cudaError_t e = dsv4__cuda_smem_limit(dsv4__indexer_select_kernel, pad, limit_raised);
    if (e != cudaSuccess)
      return e;
  }
  return dsv4__cuda_launch_smem(dsv4__indexer_select_kernel, ctas, SELECT_THREADS, pad, s, pdl, p);
}

extern "C" uint64_t dsv4__cuda_indexer_keys_per_cta(int64_t max_positions) {
  /* The keys, then the tensor-core kernel's query rows (slot_queries). */
  return slot_key_words(max_positions) + SLOT_QUERY_WORDS;
}

extern "C" int dsv4__cuda_indexer_mma(uint32_t n_heads) {
  dsv4__cuda_dev_t dev;
  return n_heads == MMA_HEADS && !dsv4__cuda_dev_info(&dev) && dev.pdl && dsv4__indexer_mma_fits();
}

extern "C" int dsv4__cuda_indexer_wg(uint32_t n_heads) {
  return dsv4__cuda_indexer_mma(n_heads) && dsv4__indexer_wg_ready();
}

extern "C" uint32_t dsv4__cuda_indexer_ctas(uint32_t n_tokens) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  return n_tokens < (uint32_t)dev.sms ? n_tokens : (uint32_t)dev.sms;
}

extern "C" int dsv4__cuda_indexer(const dsv4_indexer_args_t *a, const float *rope_rows_dev,
                                  int64_t max_positions, uint32_t *keys_dev, uint64_t keys_len,
                                  uint32_t *err_dev, cudaStream_t s, int pdl) {
  int rc = dsv4_backend_check_indexer_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  /* keys_dev on 16 bytes: the query rows at the end of each slot are copied as float4. */
  if (!rope_rows_dev || max_positions <= 0 || !err_dev || !keys_dev || ((uintptr_t)keys_dev & 15u))
    return DSV4_EINVAL;
  dsv4__cuda_dev_t dev;
  int err = dsv4__cuda_dev_info(&dev);
  if (err)
    return err;
  idx_params_t p = {};
  p.pos = a->positions;
  p.tok_seg = a->tok_seg;
  p.seg_p0 = a->seg_p0;
  p.iq = a->iq;
  p.iw = a->iw;
  p.rope = rope_rows_dev;
  p.seg_c_first_lb = a->seg_c_first_lb;
  p.seg_cbt_off = a->seg_cbt_off;
  p.seg_cbt_len = a->seg_cbt_len;
  p.c_bt = a->c_block_table;
  p.i_cache = a->i_cache;
  p.sel = a->sel;
  p.keys = keys_dev;
  p.err = err_dev;
  p.max_pos = max_positions;
  p.keys_per_cta = dsv4__cuda_indexer_keys_per_cta(max_positions);
  p.w_scale = a->w_scale;
  p.n_tokens = a->n_tokens;
  p.n_segments = a->n_segments;
  p.topk = a->topk;
  p.n_heads = a->n_heads;
  p.c_bt_entries = a->c_bt_entries;
  p.c_n_blocks = a->c_n_blocks;
  while ((1u << p.bs_shift) < a->block_size)
    p.bs_shift++;
  /* The tensor-core kernel for V4's 64 index heads on compute capability 9.0 and newer (the
   * devices with programmatic dependent launch) that grant its shared memory, unless a test asks
   * for the per-entry one. */
  const int path = score_path.load(std::memory_order_relaxed);
  const int mma = path != DSV4_CUDA_INDEXER_THREADS && dsv4__cuda_indexer_mma(a->n_heads);
  /* Fast mode (SPEC §8.9): the same d, the heads' sum in another fixed order. Either mode on
   * warpgroup MMAs where the device runs them. */
  const int fast =
      mma && (path >= DSV4_CUDA_INDEXER_MMA_FAST || (path == DSV4_CUDA_INDEXER_AUTO && a->fast));
  const int wg = mma && !force_sync.load(std::memory_order_relaxed) && dsv4__indexer_wg_ready();
  p.mma_cap = path == DSV4_CUDA_INDEXER_MMA_PARTIAL || path == DSV4_CUDA_INDEXER_MMA_FAST_PARTIAL
                  ? DSV4_INDEX_MX_PARTIAL
              : path == DSV4_CUDA_INDEXER_MMA_SCALAR || path == DSV4_CUDA_INDEXER_MMA_FAST_SCALAR
                  ? DSV4_INDEX_MX_SCALAR
                  : DSV4_INDEX_MX_FUSED;
  const uint32_t ctas = a->n_tokens < (uint32_t)dev.sms ? a->n_tokens : (uint32_t)dev.sms;
  if (keys_len < (uint64_t)ctas * p.keys_per_cta)
    return DSV4_EINVAL;
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  const size_t smem = (size_t)a->n_heads * (Q_STRIDE + 1) * sizeof(float);
  cudaError_t e = dsv4__cuda_smem_limit(
      dsv4__indexer_score_kernel, DSV4_MAX_HEADS * (Q_STRIDE + 1) * sizeof(float), limit_raised);
  if (e != cudaSuccess)
    return dsv4__cuda_err(e);
  pdl = pdl && dev.pdl;
  /* A warp a token at large batches; a small batch's tokens get more, up to 32 each, so that the
   * check has about 8 warps an SM. */
  uint32_t check_warps = (uint32_t)dev.sms * 8 / (a->n_tokens ? a->n_tokens : 1);
  check_warps = check_warps < 1 ? 1 : check_warps > 32 ? 32 : check_warps;
  p.check_tpt = 32 * check_warps;
  const uint64_t check_items = (uint64_t)a->n_tokens * p.check_tpt > a->n_segments
                                   ? (uint64_t)a->n_tokens * p.check_tpt
                                   : (uint64_t)a->n_segments;
  const uint64_t check_ctas = (check_items + CHECK_BLOCK - 1) / CHECK_BLOCK;
  if (check_ctas > 0x7fffffffu)
    return DSV4_EINVAL;
  /* With the tensor-core kernels the check runs in the first wave's query launch, beside it. */
  if (!mma)
    e = dsv4__cuda_launch(dsv4__indexer_check_kernel, (unsigned)check_ctas, CHECK_BLOCK, s, pdl, p);
  /* Waves of ctas tokens (one key slot each); a token's entries split over about one CTA per SM
   * across the wave: a full wave takes one CTA per token, which computes the token's queries
   * once. */
  uint32_t splits = (uint32_t)dev.sms / ctas;
  splits = splits < 1 ? 1 : splits;
  for (uint32_t t0 = 0; e == cudaSuccess && t0 < a->n_tokens; t0 += ctas) {
    p.t_base = t0;
    if (mma) {
      e = t0 == 0 ? dsv4__indexer_check_query_launch(p, ctas, (uint32_t)check_ctas, s, pdl)
                  : dsv4__indexer_query_launch(p, ctas, s, pdl);
      if (e == cudaSuccess && wg)
        e = dsv4__indexer_wg_launch(p, dim3(ctas, splits, 1), s, pdl, fast);
      else if (e == cudaSuccess)
        e = dsv4__indexer_mma_launch(p, dim3(ctas, splits, 1), s, pdl, fast);
    } else {
      e = dsv4__cuda_launch_smem(dsv4__indexer_score_kernel, dim3(ctas, splits, 1), SEL_THREADS,
                                 smem, s, pdl, p);
    }
    if (e == cudaSuccess)
      e = select_launch(p, ctas, s, pdl);
  }
  return dsv4__cuda_err(e);
}
