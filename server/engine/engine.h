#ifndef DSV4_SERVER_ENGINE_H
#define DSV4_SERVER_ENGINE_H

/*
 * The engine: everything a forward batch touches below HTTP. It owns the backend, one cache buffer
 * per served layer, the block pool, the sequence table and the RoPE tables, and runs one batch as
 * validate -> plan -> map_slots (producer) -> qkv_insert (consumer) -> sync -> commit.
 *
 * Thread affinity: the executor thread only, except where a function says otherwise. Nothing here
 * knows about HTTP, so the engine is tested without a socket.
 */

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "model.h"
#include "seqtable.h"

typedef struct dsv4_engine dsv4_engine_t;

/* The compressor's small tensors of one served layer (SPEC §8.2), fp32; NULL members for a layer
 * without a compressed branch. */
typedef struct {
  const float *ape;    /* [ratio, coff * 512] */
  const float *norm;   /* [512] */
  const float *i_ape;  /* ratio 4: [4, 256] */
  const float *i_norm; /* ratio 4: [128] */
} dsv4_engine_compressor_t;

typedef struct {
  const char *backend; /* "auto", "cpu", ... */
  uint32_t threads;    /* CPU worker threads, 0 = online cores */
  uint32_t block_size;
  uint32_t kv_blocks;
  uint32_t heads;            /* H of every batch */
  const dsv4_model_t *model; /* geometry; must outlive the engine */
  const uint32_t *served_layers;
  uint32_t n_served;
  const float *kv_norm_weights; /* [n_served][512] fp32 for kv_norm = fused, else NULL */
  /* [n_served][heads] fp32: each served layer's attention sinks (the served heads' slice), or NULL
   * when no checkpoint is configured (then no batch can ask for attention). Copied. */
  const float *attn_sinks;
  int attention_mode; /* DSV4_ATTENTION_EXACT or _FAST: what DSV4_ATTENTION_DEFAULT means */
  /* The compressed branch (SPEC §8): [n_served] compressor weights (copied), or NULL. A served
   * layer of ratio 4 or 128 runs its branch when its weights are given and the backend has the
   * compress and indexer ops; otherwise it serves its SWA part only, as a ratio-0 layer does, and
   * refuses attention. c4_blocks and c128_blocks size the entry block pools. */
  const dsv4_engine_compressor_t *compressors;
  uint32_t c4_blocks;
  uint32_t c128_blocks;
  uint32_t max_sequences;
  int implicit_create;
  uint64_t idle_timeout_ns;
  /* A batch with a yield hook and more tokens than this runs its kernels in token ranges of this
   * many, calling the hook between them; 0 = never. */
  uint32_t prefill_chunk_tokens;
  /* The token ranges of such a batch while no decode batch (one token a segment) has begun on
   * this engine since the last chunked batch began, and none begins in its hook: a stream of
   * prefills alone pays fewer launches and syncs. Used when larger than prefill_chunk_tokens. */
  uint32_t prefill_chunk_tokens_alone;
  /* On a backend with marks (backend.h), a q half launched ahead of its batch's validation
   * (engine.c, q_early_launch) goes in launches of about this many bytes of q (at most DSV4_MARKS
   * of them: a larger batch's pieces are larger), each downloaded on its own as soon as it is done
   * and the batch accepted; 0 = 2 MiB. */
  uint32_t q_piece_bytes;
  /* On a backend that maps host memory for its launches (backend.h, host_alias): a batch (or a
   * chunk of one) whose q is larger than this many bytes has its q and kv uploaded and q_out
   * downloaded through device staging instead of read and written in place; 0 = no limit (the
   * daemon's default is 4 MiB). On some hosts the launches' own reads and writes over PCIe run at
   * half the copy engines' rate for a prefill (tests/bench/NOTES.md, "In place against the
   * copy engines on four H100 hosts").
   */
  uint64_t in_place_max_bytes;
  /* On a staged backend: a batch whose q is larger than this many bytes has its q and kv flushed
   * from the CPU caches on the host threads before the device copies or reads them: once it is
   * validated, before its q half where it has one, or chunk by chunk for a batch in chunks
   * (host_flush.h); 0 = never. */
  uint64_t cache_flush_bytes;
} dsv4_engine_params_t;

/* Per-stage timings of one batch, in nanoseconds. */
typedef struct {
  uint64_t validate_ns;
  uint64_t plan_ns;
  uint64_t kernel_ns;
  uint64_t digest_ns;
  /* On a backend with device memory (staged), kernel_ns split in three: the uploads (host copies
   * into the backend's staging and the queued transfers), the launches, and the downloads (queued
   * to complete at the batch's one sync) with that sync, which waits for the device to finish.
   * For a batch that overlapped (dsv4_engine_forward_begin left it in flight), download_ns is the
   * queuing of its downloads plus the time dsv4_engine_forward_end waited for it: host time spent
   * on the batch, not the device's, which ran partly behind the batch before it. */
  int staged;
  uint64_t upload_ns;
  uint64_t launch_ns;
  uint64_t download_ns;
  /* A batch run in chunks: the time its yield hook took (other batches), left out of kernel_ns. */
  uint64_t yield_ns;
  /* The bytes flushed from the host's caches before the device copies (cache_flush_bytes). */
  uint64_t flushed_bytes;
} dsv4_engine_timing_t;

/* Attention modes (SPEC §7): exact is byte-identical on every backend; fast is a GPU's own. */
enum {
  DSV4_ATTENTION_DEFAULT = 0, /* the engine's configured mode */
  DSV4_ATTENTION_EXACT = 1,
  DSV4_ATTENTION_FAST = 2,
};

/*
 * A batch's range checks and replay hashes (SPEC §4: per segment, XXH3 of its q, then its kv, then
 * on a compressed layer its rows of ckv, ikv, iq and iw, §8.8), begun before the batch runs: fed as
 * its body arrives, so that the engine's validation finds them done, or as far as they got, and
 * resumes them. The tensors, in that order: q and kv; ckv at ratio 128; ckv, ikv, iq and iw at
 * ratio 4 (dsv4_check_tensors of them). create: for segments of seg_len[i] tokens (n_segs >= 1) of
 * a batch of this shape; NULL when out of memory or the lengths add up past 2^32 - 1. feed: what is
 * in since the last call, the first vals[k] values of tensor k at data[k] (no more than the batch
 * has); a segment's rows of a tensor go in after all of its rows of the tensors before it, so they
 * may come in any order. Returns 1 once a value is out of range, after which nothing more is fed.
 * Any one thread at a time, until handed to the engine.
 */
#define DSV4_CHECK_TENSORS 6
typedef struct {
  uint32_t heads;
  uint32_t ratio;       /* the layer's compressed branch as the engine runs it (0: none) */
  uint32_t index_heads; /* ratio 4: iq [N, index_heads, 128], iw [N, index_heads] */
} dsv4_check_shape_t;
typedef struct dsv4_check dsv4_check_t;
int dsv4_check_tensors(uint32_t ratio);
dsv4_check_t *dsv4_check_create(const dsv4_check_shape_t *sh, const uint32_t *seg_len,
                                uint32_t n_segs);
int dsv4_check_feed(dsv4_check_t *c, const void *const *data, const size_t *vals);
size_t dsv4_check_fed_bytes(const dsv4_check_t *c); /* bytes checked and hashed by feed */
void dsv4_check_free(dsv4_check_t *c);

/* One forward batch. Inputs are host buffers; outputs go to host buffers the caller provides. */
typedef struct {
  uint32_t layer; /* model layer number (the engine maps it to its served index) */
  uint32_t n_tokens;
  const uint16_t *q;    /* [n_tokens, heads, 512] bf16 */
  const uint16_t *kv;   /* [n_tokens, 512] bf16 */
  dsv4_seg_req_t *segs; /* hash is filled in by the engine */
  uint32_t n_segs;
  int want_digest;
  uint16_t *q_out; /* [n_tokens, heads, 512] (also the attention's input: always given) */
  /* q_out is not an output of the request: a decode batch with attention may then leave it
   * unwritten and run the fused path (SPEC §7), whose answer is the same bytes. */
  int q_unwanted;
  int64_t *slots; /* [n_tokens] */
  /* Attention after the insert (SPEC §7), when attn or lse is given; NULL = not wanted. */
  uint16_t *attn; /* [n_tokens, heads, 512] bf16 */
  float *lse;     /* [n_tokens, heads] */
  int attention;  /* DSV4_ATTENTION_*; the mode that ran is written back (EXACT or FAST) */
  /* The compressed branch's inputs (SPEC §8.2), on a layer whose branch runs (see
   * dsv4_engine_layer_ratio): ckv [n_tokens, 2 * coff * 512] at ratio 4 and 128; ikv [n_tokens,
   * 512], iq [n_tokens, index_n_heads, 128] bf16 and iw [n_tokens, index_n_heads] at ratio 4. */
  const float *ckv;
  const float *ikv;
  const uint16_t *iq;
  const float *iw;
  int32_t *topk;          /* ratio 4: [n_tokens, index_topk] the indexer's selection out, or NULL */
  const char *bad_tensor; /* on DSV4_ERANGE: the tensor holding the value */
  /* The range checks and hashes begun over the batch's tensors as they arrived, or NULL. Used when
   * its segments and shape are the batch's (else the engine begins its own); the caller's to free
   * afterwards. */
  dsv4_check_t *check;
  /*
   * Chunking (a prefill): when set and the batch has more than prefill_chunk_tokens tokens, the
   * kernels run in token ranges and yield(yield_arg) is called between two of them; its range
   * check and hashes run in rounds of at most 2 MiB of q or kv per segment, with the hook between
   * two rounds as well. The whole batch is validated and planned before the first range, and
   * committed after the last, so the answer and the cache are those of one launch. The hook may run
   * other batches on this engine (one at a time, none nested, none naming a sequence of this one);
   * nothing else (no delete, no expiry sweep, no admin read).
   */
  void (*yield)(void *yield_arg);
  void *yield_arg;
  /* Results. */
  uint32_t chunks; /* token ranges the kernels ran in (1 unless chunked; 0 when refused) */
  int replayed;
  uint64_t digest;         /* when want_digest */
  dsv4_plan_error_t error; /* details of a refused plan */
  char **dropped;          /* on DSV4_EBACKEND: names of the dropped sequences (malloc'd) */
  uint32_t n_dropped;
  dsv4_engine_timing_t timing;
  /* Set by dsv4_engine_forward_begin when the batch was left in flight. */
  int in_flight;
} dsv4_forward_t;

/* Whether f is a decode batch: every segment one token (else a prefill). The executor's classes
 * and the metrics' class label follow it. */
static inline int dsv4_forward_is_decode(const dsv4_forward_t *f) {
  for (uint32_t s = 0; s < f->n_segs; s++)
    if (f->segs[s].len != 1)
      return 0;
  return 1;
}

int dsv4_engine_create(const dsv4_engine_params_t *p, dsv4_engine_t **out, char *why,
                       size_t why_len);
void dsv4_engine_destroy(dsv4_engine_t *e);

/*
 * Run one batch. Returns 0, a validation error (DSV4_ERANGE for a q/kv element with |x| >= 2^59, or
 * any dsv4_seqtable_plan error with f->error filled: then nothing changed), or DSV4_EBACKEND when
 * the device failed (every sequence of the batch dropped, names in f->dropped).
 */
int dsv4_engine_forward(dsv4_engine_t *e, dsv4_forward_t *f);

/*
 * The same in two halves, so that batches overlap on a backend that can (DSV4_BE_OVERLAP): one
 * batch's copies run while another's kernels do. dsv4_engine_forward_begin validates, plans and
 * either runs the batch to its end, answering as dsv4_engine_forward, or submits it and returns 0
 * with f->in_flight set; dsv4_engine_forward_end(f) then waits for it and answers for it (0, or
 * DSV4_EBACKEND with its sequences dropped). While a batch is in flight only a batch for which
 * dsv4_engine_can_overlap holds may begin (any other is refused with DSV4_EINVAL and changes
 * nothing), and it must name none of the in-flight batch's sequences (the caller's keys); at most
 * two are in flight, and they end in the order they began. Nothing else may use the engine
 * (delete, expiry, admin reads, a yield hook's batches) while a batch is in flight.
 */
int dsv4_engine_forward_begin(dsv4_engine_t *e, dsv4_forward_t *f);
int dsv4_engine_forward_end(dsv4_engine_t *e, dsv4_forward_t *f);
/* Whether f may overlap: the backend can, the batch wants no digest, its layer runs no compressed
 * branch and it does not run in chunks. */
int dsv4_engine_can_overlap(const dsv4_engine_t *e, const dsv4_forward_t *f);
/* Batches in flight (0, 1 or 2). */
int dsv4_engine_in_flight(const dsv4_engine_t *e);

/*
 * Whether a batch of model layer `layer` may ask for attention in `mode` (DSV4_ATTENTION_*): 0, or
 * DSV4_EUNSUPPORTED with why naming what is missing (the weights option, the layer's compressed
 * branch, the backend's attention or its fast mode). Any thread: it reads the engine's immutable
 * parameters only.
 */
int dsv4_engine_attention_check(const dsv4_engine_t *e, uint32_t layer, int mode, char *why,
                                size_t why_len);
/* The mode DSV4_ATTENTION_DEFAULT stands for. Any thread. */
int dsv4_engine_attention_default(const dsv4_engine_t *e);
/* The mode a batch of `layer` runs in when it asked for `requested` (DSV4_ATTENTION_*): what it
 * asked for, or with DSV4_ATTENTION_DEFAULT the configured mode (fast mode covers every layer the
 * backend runs attention on, the compressed branch's union included). */
int dsv4_engine_attention_mode(const dsv4_engine_t *e, uint32_t layer, int requested);
void dsv4_forward_release(dsv4_forward_t *f);

int dsv4_engine_delete(dsv4_engine_t *e, const char *name, uint32_t len, int *existed);
uint32_t dsv4_engine_expire(dsv4_engine_t *e, uint64_t now_ns);
/* Snapshot of a sequence, next/last_start indexed by served layer. */
int dsv4_engine_seq_info(dsv4_engine_t *e, const char *name, uint32_t len, dsv4_seq_info_t *out);

/* 1 when some served layer runs the compressed branch. Any thread. */
int dsv4_engine_runs_compressed(const dsv4_engine_t *e);
/* [n_served] the ratio at which each served layer runs the branch (0 where it does not), or NULL
 * when no layer runs it; valid for the engine's life. */
const uint32_t *dsv4_engine_c_ratios(const dsv4_engine_t *e);
/* The ratio (4 or 128) of a served model layer whose compressed branch runs, else 0. Any thread. */
uint32_t dsv4_engine_layer_ratio(const dsv4_engine_t *e, uint32_t layer);
/* Any thread: the entry block pools' sizes and free counts (c4 then c128; 0 when absent). */
void dsv4_engine_cpool_counts(const dsv4_engine_t *e, uint32_t total[2], uint32_t free_[2]);
/*
 * A shared region's mapping (SPEC §6.1), or the daemon's pinned pool, for the backend's
 * host_register hook, once per range: 0 when the backend needs none or took it, else its error (the
 * range is then not used). Unregister before unmapping. Executor thread, or while no executor
 * thread runs (the pinned pool is registered before it starts and unregistered after it stopped).
 */
int dsv4_engine_host_register(dsv4_engine_t *e, void *p, size_t n);
void dsv4_engine_host_unregister(dsv4_engine_t *e, void *p);
/* 1 when the backend has the host_register hook: it copies faster from registered memory. Any
 * thread. */
int dsv4_engine_can_host_register(const dsv4_engine_t *e);

/* The served index of a model layer, or -1. Any thread. */
int dsv4_engine_layer_index(const dsv4_engine_t *e, uint32_t layer);
/* Any thread: the backend's name, and whether it is still usable. */
const char *dsv4_engine_backend_name(const dsv4_engine_t *e);
int dsv4_engine_healthy(const dsv4_engine_t *e);
/* Any thread: block and sequence counts (relaxed snapshots). */
uint32_t dsv4_engine_blocks_total(const dsv4_engine_t *e);
uint32_t dsv4_engine_blocks_free(const dsv4_engine_t *e);
uint32_t dsv4_engine_sequences(const dsv4_engine_t *e);
/* Bytes of cache memory allocated for all served layers. */
uint64_t dsv4_engine_cache_bytes(const dsv4_engine_t *e);

/* 1 when any element of n bf16 values has |x| >= 2^59 (this also catches Inf and NaN). */
int dsv4_bf16_any_out_of_range(const uint16_t *x, size_t n);
/* 1 when any of n bf16 (f32) values has a magnitude whose bits, the sign cleared, are at least
 * limit_bits: |x| >= the limit, or Inf or NaN (range_check.c). */
int dsv4_bf16_any_at_least(const uint16_t *x, size_t n, uint16_t limit_bits);
int dsv4_f32_any_at_least(const float *x, size_t n, uint32_t limit_bits);

#endif /* DSV4_SERVER_ENGINE_H */
