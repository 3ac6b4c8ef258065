#ifndef DSV4_KERNELS_BACKEND_H
#define DSV4_KERNELS_BACKEND_H

/*
 * The one interface between the daemon and a compute device: a table of function pointers, in the
 * manner of SQLite's VFS. The CPU backend is the reference; CUDA and Level Zero implement the same
 * table and must produce the same bytes (SPEC §2).
 *
 * Ordering contract (SPEC §5): map_slots is the producer, qkv_insert its consumer. A backend runs
 * them in submission order on one queue; qkv_insert may not read slots, q, kv or positions, nor
 * write anything, before map_slots of the same batch has completed. attention, when submitted,
 * consumes what qkv_insert wrote (q_out and the cache; on the fused decode path the raw q and the
 * cache) and obeys the same rule towards it. sync() returns once all submitted work has completed.
 * Argument structs hold device addresses (on the CPU backend, host addresses), and the memory they
 * point to must stay valid until sync() returns (or, for an overlapped batch, its batch_wait).
 *
 * Thread affinity: a backend is driven by one thread at a time (the executor).
 */

#include <stddef.h>
#include <stdint.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "rope.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dsv4_backend dsv4_backend_t;

/* A device allocation. On a backend with DSV4_BE_HOST_MEMORY, ptr is an ordinary host pointer. */
typedef struct {
  void *ptr;
  size_t size;
} dsv4_devbuf_t;

/* Backend capabilities. */
enum {
  /* Device memory is host memory: jobs may point straight at host buffers (no staging copies). */
  DSV4_BE_HOST_MEMORY = 1u << 0,
  /* The attention op also has a fast mode (SPEC §7: tensor cores, within FlashMLA's tolerances of
   * exact); selected per launch by dsv4_attn_args_t.fast. It covers every launch the attention op
   * runs, with or without compressed entries (the union of SPEC §8.6, where the backend offers the
   * compressed branch). */
  DSV4_BE_ATTN_FAST = 1u << 1,
  /* The fused decode path (SPEC §7): qkv_insert takes q_out NULL (the KV rows only) and attention
   * takes the raw q (dsv4_attn_args_t.q_raw), normalising and rotating it itself. */
  DSV4_BE_ATTN_FUSED_Q = 1u << 2,
  /* Batches may overlap: the table has batch_phase and batch_wait (see there), and download_async.
   */
  DSV4_BE_OVERLAP = 1u << 3,
};

/*
 * The phases of a batch submitted for overlap (DSV4_BE_OVERLAP), in this order, each announced by
 * batch_phase before its calls:
 *  - UPLOADS: the uploads that follow go on a copy queue of their own; they may run while the
 *    launches of batches submitted before still run, and they do not wait for those launches.
 *  - LAUNCHES: the launches that follow run after those uploads, and after every launch submitted
 *    before (one queue, in submission order, as ever: SPEC §5 holds across batches).
 *  - DOWNLOADS: the download_async calls that follow run after those launches, on a copy queue;
 *    each reads its source at some time before batch_wait of this batch returns, so the caller lets
 *    no later batch write a source before then.
 *  - SUBMITTED: the batch is whole; *ticket receives its completion point, for batch_wait.
 * Until batch_wait of a batch returns, the host memory its uploads read and its downloads write
 * stays valid and unchanged (the caller neither writes the one nor reads the other). Only batch
 * calls (phases, uploads, launches, download_async, mark, download_marked) may come between
 * SUBMITTED and the batch's batch_wait; sync() waits for every batch as well.
 */
enum {
  DSV4_BATCH_UPLOADS = 1,
  DSV4_BATCH_LAUNCHES,
  DSV4_BATCH_DOWNLOADS,
  DSV4_BATCH_SUBMITTED,
};

/* The producer: sequence block tables -> one cache slot per token. */
typedef struct {
  uint32_t n_tokens;
  uint32_t n_segments;
  uint32_t block_size;
  uint32_t n_blocks;           /* pool size; a slot is < n_blocks * block_size */
  const int64_t *positions;    /* [n_tokens] */
  const int32_t *tok_seg;      /* [n_tokens] segment of each token */
  const int64_t *seg_first_lb; /* [n_segments] logical block that block_table[seg_bt_off] maps */
  const uint32_t *seg_bt_off;  /* [n_segments] first entry of the segment in block_table */
  const uint32_t *seg_bt_len;  /* [n_segments] entries of the segment in block_table */
  const int32_t *block_table;  /* physical block ids; < 0 = no block (the token gets slot -1) */
  int64_t *slots;              /* [n_tokens] out: block * block_size + offset, or -1 */
  /* Entries of block_table (at least every seg_bt_off + seg_bt_len), or 0 when not given; a
   * non-zero length needs a block_table. A backend may read that many entries ahead of the tokens
   * (the CUDA producer stages a small table in shared memory). A segment whose table runs past it
   * is refused by the CPU backend and by the Level Zero backend (its sync answers DSV4_EINVAL); the
   * CUDA producer maps the tokens past it to slot -1 (it cannot refuse: cuda-kernels.h). */
  uint32_t bt_entries;
} dsv4_map_args_t;

/* The consumer: Q norm + RoPE, KV (norm) + RoPE + fp8/UE8M0 quantise + paged insert (SPEC
 * §2.1-2.2). */
typedef struct {
  uint32_t n_tokens;
  uint32_t heads;           /* 1..128 */
  const uint16_t *q;        /* [n_tokens, heads, 512] bf16 */
  const uint16_t *kv;       /* [n_tokens, 512] bf16 */
  const int64_t *positions; /* [n_tokens] */
  const int64_t *slots;     /* [n_tokens] from map_slots; < 0 = do not write */
  /* Rows of every position in the batch already materialised. The table must outlive the backend:
   * the CUDA backend keeps a device mirror of each table it is given, found by its address and
   * refreshed before every launch. */
  const dsv4_rope_table_t *rope;
  const float *kv_norm_weight; /* [512] fp32, or NULL for kv_norm = prenormed */
  float eps;                   /* RMSNorm epsilon */
  int write_kv;                /* 0: compute q_out only (a replayed batch), never touch the cache */
  /* [n_tokens, heads, 512] bf16 out. NULL (only with write_kv, and only on a backend with
   * DSV4_BE_ATTN_FUSED_Q; the others refuse it with DSV4_EINVAL): the KV rows only, q is not read,
   * for the fused decode path where the attention normalises the raw q itself. */
  uint16_t *q_out;
  uint8_t *cache; /* the layer's cache: n_blocks * stride bytes */
  uint32_t block_size;
  uint32_t n_blocks;
  uint64_t stride; /* DSV4_BLOCK_STRIDE(block_size) */
} dsv4_insert_args_t;

/*
 * A token's window as the engine plans it (dsv4_attn_windows): its candidates are the positions
 * lo .. lo + n - 1 (the last the query's), whose logical blocks lo / bs .. (lo + n - 1) / bs map
 * to the physical blocks blk[0..], -1 past them. 64 bytes, so that one line holds it.
 */
#define DSV4_ATTN_WIN_BLOCKS 12
typedef struct {
  int64_t lo;
  uint32_t n;        /* 1..DSV4_WINDOW */
  uint32_t reserved; /* 0 */
  int32_t blk[DSV4_ATTN_WIN_BLOCKS];
} dsv4_attn_win_t;

/*
 * Exact-mode attention (SPEC §7), run after the batch's insert: every token sees the whole batch's
 * records. Token t at position p = positions[t] of segment s = tok_seg[t] attends, per head, to the
 * positions max(seg_p0[s], p - 127)..p of its sequence in increasing order. The slot of a position
 * comes from the segment's block table as in dsv4_map_args_t (the arrays the engine builds for
 * map_slots): logical block lb = pos / block_size is entry seg_bt_off[s] + (lb - seg_first_lb[s]).
 * A candidate whose logical block lies outside the segment's table (or past bt_entries), or whose
 * entry is < 0 or >= n_blocks, or a token with p < seg_p0[s], fails the launch with DSV4_EINVAL
 * before anything is written, and such a block is never read.
 *
 * Per head: logits from the canonical dot product, the max, weights dsv4_expf(l - m), the sink in
 * the denominator only, o = N / D, the inverse RoPE at p, one rounding to bf16. lse = m +
 * dsv4_logf(sum of the weights), the sink excluded (FlashMLA's convention), so lse does not depend
 * on the sink. A sink of +inf makes D infinite and the head's output zeros (signed: N / +inf, then
 * the RoPE fma); -inf adds nothing. Inputs the daemon validated (|q|, |kv| < 2^59) cannot overflow.
 *
 * A backend may run attention on its own queue after qkv_insert; the memory behind the pointers
 * must stay valid until sync() returns, as for the other launches.
 */
typedef struct {
  uint32_t n_tokens;
  uint32_t n_segments;
  uint32_t heads;              /* 1..128 */
  const uint16_t *q;           /* [n_tokens, heads, 512] bf16: the q_out of the batch's insert */
  const int64_t *positions;    /* [n_tokens] */
  const int32_t *tok_seg;      /* [n_tokens] segment of each token */
  const int64_t *seg_p0;       /* [n_segments] the sequence's first position (no candidate below) */
  const int64_t *seg_first_lb; /* [n_segments] logical block that block_table[seg_bt_off] maps */
  const uint32_t *seg_bt_off;  /* [n_segments] first entry of the segment in block_table */
  const uint32_t *seg_bt_len;  /* [n_segments] entries of the segment in block_table */
  const int32_t *block_table;  /* physical block ids */
  uint32_t bt_entries;         /* entries of block_table, or 0 when not given (as for map_slots) */
  const uint8_t *cache;        /* the layer's cache: n_blocks * stride bytes */
  uint32_t block_size;
  uint32_t n_blocks;
  uint64_t stride; /* DSV4_BLOCK_STRIDE(block_size) */
  /* [heads] fp32: the layer's attn_sink from head_offset on; NULL = no sink. */
  const float *sink;
  /* The layer's RoPE table (rows of every query position materialised; the inverse rotation at
   * the query's position). Like qkv_insert's, it must outlive the backend. */
  const dsv4_rope_table_t *rope;
  uint16_t *out; /* [n_tokens, heads, 512] bf16 out */
  float *lse;    /* [n_tokens, heads] fp32 out, or NULL when not wanted */
  int fast; /* fast mode (SPEC §7): only on a backend with DSV4_BE_ATTN_FAST, window or union */
  /*
   * The compressed branch of a layer of ratio >= 2 (SPEC §8.6), or c_cache NULL for an SWA-only
   * layer. After its window, a token at position p of segment s attends to compressed entries j in
   * increasing order: with c_sel NULL (ratio 128) every visible entry floor(seg_p0[s] / ratio) <= j
   * < floor((p + 1) / ratio); with c_sel, the entries c_sel[t * c_sel_stride + k] (increasing,
   * padded with -1, which ends the list). Entry j is the record at offset j % block_size of the
   * block c_block_table[seg_cbt_off[s] + (j / block_size - seg_c_first_lb[s])] of c_cache (the same
   * record layout, block_size and stride as the SWA cache). A candidate whose block lies outside
   * the segment's table, or is < 0 or >= c_n_blocks, fails the launch with DSV4_EINVAL before
   * anything is written, and so does a listed entry that is not visible or not above the one
   * before it (any negative value but the -1 that ends a row is such an entry; a row without -1
   * holds c_sel_stride entries). ratio is 4 or 128 (the range form is valid at either); c_sel
   * needs c_sel_stride >= 1 and a c_cache. With c_cache NULL the other compressed fields are not
   * read. One max, one denominator (with the sink) and one fma chain run over the window then the
   * entries. A backend that does not run the compressed branch yet refuses such a launch with
   * DSV4_EUNSUPPORTED (check ops->compress before asking for it).
   */
  uint32_t ratio;
  const uint8_t *c_cache;
  uint32_t c_n_blocks;
  const int64_t *seg_c_first_lb; /* [n_segments] */
  const uint32_t *seg_cbt_off;   /* [n_segments] */
  const uint32_t *seg_cbt_len;   /* [n_segments] */
  const int32_t *c_block_table;
  uint32_t c_bt_entries; /* entries of c_block_table, or 0 when not given (as bt_entries) */
  const int32_t *c_sel;  /* [n_tokens, c_sel_stride] or NULL */
  uint32_t c_sel_stride;
  /*
   * The fused decode path (SPEC §7), only on a backend with DSV4_BE_ATTN_FUSED_Q (the shared check
   * below refuses it): q is the batch's raw q (the insert's input) instead of its q_out, and the
   * attention applies SPEC §2.1's Q norm with eps and the RoPE at each token's position from its
   * own rope table (which must be the insert's) before anything else, computing exactly the bf16
   * values the insert would have written. Every output byte is the unfused path's.
   */
  int q_raw;
  float eps;
  /*
   * Optional (NULL: the backend walks the tables): [n_tokens] windows, 16-byte aligned, that
   * dsv4_attn_windows built from this launch's positions, segments and block table. A backend may
   * take a token's window and blocks from it instead of from those arrays (the CUDA backend's
   * SWA-only launches do: one round of loads where the tables are three dependent ones); one that
   * does refuses a window that is empty or longer than DSV4_WINDOW, whose last position has no
   * RoPE row, or whose blocks lie outside the pool, as it refuses the tables' faults.
   */
  const dsv4_attn_win_t *win;
} dsv4_attn_args_t;

/*
 * The compressor of one layer (SPEC §8.3, and the indexer's keys §8.5 at ratio 4), run after
 * qkv_insert of a batch that is not a replay. Tokens of one segment are consecutive positions in
 * batch order. For each token in order: its row enters the ring; when (p + 1) % ratio == 0 entry j
 * = p / ratio is emitted from the rows of positions >= max(0, seg_p0[s]) (the ring holds them): the
 * 584-byte record into c_cache (entry j's block and offset as in dsv4_attn_args_t) and, at ratio 4,
 * the 68-byte index record into i_cache at the same block id (values at 64 * (j % bs), codes at 64
 * * bs + 4 * (j % bs) of the block's DSV4_INDEX_BLOCK_BYTES). Entries are written once each; a
 * block outside the segment's table fails the launch with DSV4_EINVAL before anything is written.
 * So does a segment whose tokens are not one run of consecutive positions p >= seg_p0[s] >= 0, two
 * segments with one state slot, a slot >= n_slots, a position outside the RoPE table, or an
 * emission whose RoPE row is not materialised.
 */
typedef struct {
  uint32_t ratio; /* 4 or 128 */
  uint32_t n_tokens;
  uint32_t n_segments;
  const int64_t *positions; /* [n_tokens] */
  const int32_t *tok_seg;   /* [n_tokens] */
  const int64_t *seg_p0;    /* [n_segments] */
  const uint32_t *seg_slot; /* [n_segments] state slot of the segment's sequence */
  const float *ckv;         /* [n_tokens, 2 * coff * 512]: kv then gate (coff 2 at ratio 4) */
  const float *ikv;         /* ratio 4: [n_tokens, 512] kv then gate of the indexer; else NULL */
  float *ring;              /* [n_slots, DSV4_RING_FLOATS(ratio)] */
  uint32_t n_slots;
  const float *ape;           /* [ratio, coff * 512] */
  const float *norm_weight;   /* [512] the compressor's norm.weight */
  const float *i_ape;         /* ratio 4: [4, 256] */
  const float *i_norm_weight; /* ratio 4: [128] */
  float eps;
  const dsv4_rope_table_t *rope; /* the layer's YaRN table; rows at ratio * j materialised */
  const int64_t *seg_c_first_lb;
  const uint32_t *seg_cbt_off;
  const uint32_t *seg_cbt_len;
  const int32_t *c_block_table;
  uint32_t c_bt_entries;
  uint8_t *c_cache; /* c_n_blocks * stride */
  uint8_t *i_cache; /* ratio 4: c_n_blocks * DSV4_INDEX_BLOCK_BYTES(block_size); else NULL */
  uint32_t c_n_blocks;
  uint32_t block_size;
  uint64_t stride;
} dsv4_compress_args_t;

/*
 * The indexer's selection (SPEC §8.5) for every token of a batch of a ratio-4 layer, run after the
 * batch's compress: token t at position p of segment s sees entries floor(seg_p0[s] / 4) <= j <
 * floor((p + 1) / 4). If at most topk are visible, all are selected; otherwise the topk with the
 * highest scores (ties to the lower j). sel[t * topk ..] lists them in increasing j, padded with
 * -1. Index records are read from i_cache through the segment's table as in dsv4_compress_args_t.
 * Only a token that sees more than topk entries reads records and its RoPE row at p; for such a
 * token a visible entry's block outside the table, or a missing row, fails the launch with
 * DSV4_EINVAL before anything is written, as does a token below its p0.
 */
typedef struct {
  uint32_t n_tokens;
  uint32_t n_segments;
  uint32_t topk;    /* index_topk */
  uint32_t n_heads; /* index_n_heads; the head dim is 128 */
  float w_scale;    /* (float)(128 * n_heads)^-0.5, the weights' scale */
  const int64_t *positions;
  const int32_t *tok_seg;
  const int64_t *seg_p0;
  const uint16_t *iq; /* [n_tokens, n_heads, 128] bf16, before RoPE */
  const float *iw;    /* [n_tokens, n_heads] */
  const dsv4_rope_table_t *rope;
  const int64_t *seg_c_first_lb;
  const uint32_t *seg_cbt_off;
  const uint32_t *seg_cbt_len;
  const int32_t *c_block_table;
  uint32_t c_bt_entries;
  const uint8_t *i_cache;
  uint32_t c_n_blocks;
  uint32_t block_size;
  int32_t *sel; /* [n_tokens, topk] out */
  /* Fast mode (SPEC §8.9): a backend may sum each score's heads in another fixed order, so that
   * the selection can differ from exact mode's at near-ties; CUDA does with 64 index heads on
   * compute capability 9.0 and newer, the other backends select as in exact mode. */
  int fast;
} dsv4_indexer_args_t;

typedef struct dsv4_backend_ops {
  const char *name;
  unsigned caps;
  void (*destroy)(dsv4_backend_t *be);
  /* A zero-filled device allocation. */
  int (*buf_alloc)(dsv4_backend_t *be, size_t size, dsv4_devbuf_t *out);
  void (*buf_free)(dsv4_backend_t *be, dsv4_devbuf_t *buf);
  /* Queue a copy of n host bytes into dst at off. src may be reused once the call returns, except
   * memory given to host_register: a backend may read it in place until the next sync (or the
   * batch_wait of the overlapped batch it belongs to), so the caller leaves it unchanged until
   * then. */
  int (*upload)(dsv4_backend_t *be, const dsv4_devbuf_t *dst, size_t off, const void *src,
                size_t n);
  /* Copy n bytes of src at off into host dst, after everything queued before; the bytes are in
   * dst when the call returns. */
  int (*download)(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off, size_t n);
  /*
   * Optional (NULL: the caller uses download). Queue a copy of n bytes of src at off into host dst,
   * after everything queued before: the bytes are in dst once the next sync() returns (0), or, in
   * an overlapped batch's DOWNLOADS phase, once that batch's batch_wait does. Until then dst must
   * stay valid and the caller neither reads nor writes it; what it holds in between is
   * unspecified. A backend that cannot defer the copy (CUDA: dst is not registered memory) may
   * complete it before returning, as download does. Outside a DOWNLOADS phase, work queued after
   * the call may overwrite src: the copy reads the bytes it had when it was queued (inside one, see
   * DSV4_BATCH_DOWNLOADS: src stays unwritten until the batch's batch_wait).
   */
  int (*download_async)(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                        size_t n);
  int (*map_slots)(dsv4_backend_t *be, const dsv4_map_args_t *a);
  int (*qkv_insert)(dsv4_backend_t *be, const dsv4_insert_args_t *a);
  /* Optional (NULL: the backend has no attention): exact-mode attention, after qkv_insert. */
  int (*attention)(dsv4_backend_t *be, const dsv4_attn_args_t *a);
  /* Optional (NULL: no compressed branch): SPEC §8, after qkv_insert and before attention. */
  int (*compress)(dsv4_backend_t *be, const dsv4_compress_args_t *a);
  int (*indexer)(dsv4_backend_t *be, const dsv4_indexer_args_t *a);
  int (*sync)(dsv4_backend_t *be);
  /*
   * Optional (NULL: the caller runs the items itself). Run fn over items 0..n_items-1 on the
   * backend's host threads, returning once all are done: host-side work such as input validation,
   * which would otherwise leave those threads idle between launches. fn must not call the backend.
   */
  void (*host_parallel)(dsv4_backend_t *be, void (*fn)(void *arg, size_t first, size_t last),
                        void *arg, size_t n_items);
  /*
   * Optional, both or neither (NULL: the backend copies from any host memory as fast, as the CPU
   * does). Make the n bytes of host memory at p (a shared region a client maps with the daemon,
   * SPEC §6.1, or the daemon's page-locked pool) memory the device copies from and to directly
   * (CUDA: cudaHostRegister; uploads from it and downloads into it skip the staging), until
   * host_unregister(p). Called once per region, not per batch; p stays mapped until after
   * host_unregister returns, which the caller calls only after a sync (or the batch_wait of an
   * overlapped batch) that follows its last copy from or to p.
   */
  /*
   * With DSV4_BE_OVERLAP, both (else NULL). batch_phase starts phase (DSV4_BATCH_*) of the batch
   * being submitted; at DSV4_BATCH_SUBMITTED it writes the batch's ticket. batch_wait returns once
   * every call of the batch with that ticket has completed: its download_async bytes are in host
   * memory, and it answers what sync() would for the batch's launches (0, DSV4_EINVAL for a
   * launch that refused on the device, or a device error). At most two batches are submitted and
   * not yet waited for; each ticket is waited for once, in submission order. A batch whose
   * submission failed part way is waited for by sync() instead (which waits for everything).
   */
  int (*batch_phase)(dsv4_backend_t *be, int phase, uint64_t *ticket);
  int (*batch_wait)(dsv4_backend_t *be, uint64_t ticket);
  int (*host_register)(dsv4_backend_t *be, void *p, size_t n);
  void (*host_unregister)(dsv4_backend_t *be, void *p);
  /*
   * Optional (NULL: none). The address at which launches read or write the n bytes of host memory
   * at p in place, or NULL when they cannot: p lies inside one range given to host_register and is
   * aligned to DSV4_ALIAS_ALIGN (CUDA: the registered pages' device mapping, which kernels reach
   * over PCIe). A launch pointed at it replaces an upload from p or a download into p: it reads
   * the bytes when it runs (so they stay unchanged until the sync or batch_wait that ends the
   * batch, as an upload from registered memory does), and what it writes is in host memory once
   * that sync or batch_wait returns, as a download_async's bytes are, and not read before.
   */
  void *(*host_alias)(dsv4_backend_t *be, const void *p, size_t n);
  /*
   * Optional, both or neither (NULL: a download waits for every launch queued before it). mark
   * names the point the launches have reached, the launches queued so far, as mark k (0 <= k <
   * DSV4_MARKS; a later mark k replaces it). download_marked is download_async of bytes that the
   * launches before mark k wrote, ordered after those launches only: it may run beside launches
   * queued after the mark (CUDA: the download stream waits for the mark's event, not for the
   * stream), so an output written piece by piece crosses PCIe while its later pieces are computed.
   * Its bytes land as a download_async's do, by the next sync, or by batch_wait of the batch in
   * whose phases it was queued. The caller queues no launch or upload that writes src's bytes
   * after mark k before then: unlike download_async's, the copy may read them after such work.
   */
  int (*mark)(dsv4_backend_t *be, unsigned k);
  int (*download_marked)(dsv4_backend_t *be, unsigned k, void *dst, const dsv4_devbuf_t *src,
                         size_t off, size_t n);
} dsv4_backend_ops_t;

/* The marks a backend keeps (mark, download_marked). */
#define DSV4_MARKS 8u

/* The alignment host_alias asks of host memory: the launches' 16-byte loads and stores. */
#define DSV4_ALIAS_ALIGN 16u

/* Every backend's handle starts with this, so generic code can reach the table. */
struct dsv4_backend {
  const dsv4_backend_ops_t *ops;
};

/*
 * The argument checks every backend makes before it writes anything: 0 or DSV4_EINVAL. A launch of
 * zero tokens needs no pointers (it is valid and does nothing). The insert check covers everything
 * but the RoPE rows, which each backend holds in its own form. Pointers are only compared with
 * NULL, so these work on device addresses too.
 */
int dsv4_backend_check_map_args(const dsv4_map_args_t *a);
int dsv4_backend_check_insert_args(const dsv4_insert_args_t *a);
/* The attention check covers everything but the block table's contents, the positions and the
 * RoPE rows, which the backend checks where it can read them (before it writes anything). */
int dsv4_backend_check_attn_args(const dsv4_attn_args_t *a);
/* The windows of a's tokens (dsv4_attn_args_t.win) from its arrays, read on the host: 0, or
 * DSV4_EINVAL for a launch that the tables would refuse (a token's segment, its position below
 * its p0 or p0 below 0, or a window block outside the segment's table, past bt_entries or outside
 * the pool); the RoPE rows are not looked at. */
int dsv4_attn_windows(const dsv4_attn_args_t *a, dsv4_attn_win_t *win);

/* The compress and indexer checks cover everything but the positions, the segments' tables and the
 * RoPE rows, which the backend checks where it can read them (before it writes anything). */
int dsv4_backend_check_compress_args(const dsv4_compress_args_t *a);
int dsv4_backend_check_indexer_args(const dsv4_indexer_args_t *a);

typedef struct {
  uint32_t threads; /* CPU worker threads; 0 = one per online core */
} dsv4_backend_options_t;

typedef int (*dsv4_backend_open_fn)(const dsv4_backend_options_t *opt, dsv4_backend_t **out,
                                    char *why, size_t why_len);

/*
 * Add a backend under name, opened only when asked for by that name (never by "auto"): for programs
 * that embed the engine with a device of their own, and for tests that wrap a backend to inject
 * faults. Call before any backend is opened; not thread-safe. DSV4_ENOSPC when the table is full.
 */
int dsv4_backend_register(const char *name, dsv4_backend_open_fn open);

/*
 * Open the backend called name ("cpu", "cuda", "level_zero", or "auto" for the first usable one, in
 * that order: cuda, level_zero, cpu, of those this build has). On failure why holds one line that
 * says what was missing. Under "auto" why also holds, on success, the backends skipped on the way
 * with their reasons ("cuda: no CUDA device; level_zero: zeInit found no driver"), or "" when the
 * first one opened.
 */
int dsv4_backend_open(const char *name, const dsv4_backend_options_t *opt, dsv4_backend_t **out,
                      char *why, size_t why_len);

static inline void dsv4_backend_close(dsv4_backend_t *be) {
  if (be)
    be->ops->destroy(be);
}

#ifdef __cplusplus
}
#endif

#endif /* DSV4_KERNELS_BACKEND_H */
