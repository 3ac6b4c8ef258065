#ifndef DSV4_SERVER_FORWARD_PARSE_H
#define DSV4_SERVER_FORWARD_PARSE_H

/*
 * The request side of POST /v1/forward (SPEC §6): a safetensors body with tensors q [N, H, 512] and
 * kv [N, 512] in BF16 and __metadata__ "layer", "segments" (JSON text) and optionally "outputs"
 * and "attention", turned into checked fields ready for a dsv4_forward_t. Everything here is pure:
 * no engine, no HTTP request, so the most exposed parser of the daemon is unit-tested and fuzzed on
 * its own.
 *
 * Thread affinity: none.
 */

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "engine.h"
#include "safetensors.h"
#include "seqtable.h"

/* SPEC §4's rule for sequence names, as error messages state it. */
#define DSV4_SEQ_NAME_RULE "1..128 bytes of [A-Za-z0-9._:-], not starting with '.'"

/* A copy of q or kv and the result buffer (q_out, then slots) start on this boundary: a cache
 * line, and the widest vector the CPU kernels load and store. */
#define DSV4_FORWARD_ALIGN 64

/* What a body is checked against. */
typedef struct {
  uint32_t heads; /* H of every batch */
  uint32_t max_batch_tokens;
  uint32_t max_segments;
  int64_t max_position_embeddings;
  /* Whether a model layer is served: layer_served(layer_arg, layer) when set, else membership in
   * served_layers[0..n_served). */
  int (*layer_served)(const void *layer_arg, uint32_t layer);
  const void *layer_arg;
  const uint32_t *served_layers;
  uint32_t n_served;
  /* The compressed branch (SPEC §8.2): the ratio (4 or 128) of a served layer whose branch the
   * daemon runs, else 0 (the layer then takes q and kv only). NULL: 0 for every layer. */
  uint32_t (*layer_ratio)(const void *layer_arg, uint32_t layer);
  uint32_t index_heads; /* index_n_heads: iq is [N, index_heads, 128], iw [N, index_heads] */
} dsv4_forward_limits_t;

/* A parsed forward body. The pointers point into the body, the view or the segments document. */
typedef struct {
  uint32_t layer;
  uint32_t n_tokens;    /* N */
  const uint16_t *q;    /* [N, heads, 512] bf16, 2-aligned: into the body or into q_copy */
  const uint16_t *kv;   /* [N, 512] bf16, likewise */
  size_t q_bytes;       /* N * heads * 512 * 2 */
  size_t kv_bytes;      /* N * 512 * 2 */
  dsv4_seg_req_t *segs; /* [n_segs]; names point into segs_doc or segs_text; hash = 0 */
  uint32_t n_segs;
  int want_q;      /* "outputs" absent or naming q */
  int want_digest; /* "outputs" naming digest */
  int want_attn;   /* "outputs" naming attn */
  int want_lse;    /* "outputs" naming lse */
  int want_topk;   /* "outputs" naming topk (a ratio-4 layer's selection) */
  int attention;   /* DSV4_ATTENTION_*: the "attention" metadata, or DEFAULT when absent */
  /* The compressed branch's tensors (SPEC §8.2), by the layer's ratio: ckv at 4 and 128, ikv, iq
   * and iw at 4; NULL otherwise. F32 tensors are 4-aligned and bf16 ones 2-aligned (copies when the
   * sender's offsets were not). */
  uint32_t ratio;
  const float *ckv;   /* [N, 2 * coff * 512] */
  const float *ikv;   /* [N, 512] */
  const uint16_t *iq; /* [N, index_heads, 128] */
  const float *iw;    /* [N, index_heads] */
  /* On a refused compressed tensor (SPEC §8.8): its name and "missing", "unexpected", "dtype" or
   * "shape"; NULL otherwise. */
  const char *bad_tensor;
  const char *bad_reason;
  /* Owned storage, released by dsv4_forward_req_free(). */
  dsv4_st_view_t view;
  json_t *segs_doc;
  char *segs_text;  /* the segments' text, when read without a document */
  char *segs_given; /* the segments' text given beside the header instead of in __metadata__ (a
                     * shared-region message's trailer, SPEC §6.1), set before the parse */
  uint16_t *q_copy, *kv_copy; /* aligned copies when the sender's offsets were not 2-aligned */
  void *c_copy[4];            /* the same for ckv, ikv, iq and iw */
  size_t c_bytes[4];          /* their sizes */
} dsv4_forward_req_t;

/*
 * Parse body[0..len) into *out. Returns 0, DSV4_EINVAL (malformed body or metadata), DSV4_ELAYER (a
 * layer not served), DSV4_EPOSRANGE (a segment past max_position_embeddings) or DSV4_ENOMEM; on
 * every error but DSV4_ENOMEM why says what is wrong. Whatever the result, *out must be released
 * with dsv4_forward_req_free(). body must outlive *out.
 */
int dsv4_forward_parse(const uint8_t *body, size_t len, const dsv4_forward_limits_t *lim,
                       dsv4_forward_req_t *out, char *why, size_t why_len);
/*
 * The same checks on a view already made (out->view, owned by *out from here on): the tensors
 * and the metadata of a request whose tensors live in a shared region (SPEC §6.1). Returns and
 * release as for dsv4_forward_parse.
 */
int dsv4_forward_parse_view(const dsv4_forward_limits_t *lim, dsv4_forward_req_t *out, char *why,
                            size_t why_len);
void dsv4_forward_req_free(dsv4_forward_req_t *r);

/* The segments text into r->segs and r->n_segs, or an error and its message (exposed for the unit
 * test, which holds the two readers to the same answers). fast: the usual shape is read without a
 * JSON document when it can be; 0: always through the JSON parser. */
int dsv4__forward_segments(const char *segs_s, uint32_t max_segments, int fast,
                           dsv4_forward_req_t *r, char *why, size_t why_len);
/*
 * Make the request own every input that reaches the cache or the rings (kv, ckv, ikv, iq, iw): a
 * copy of each one still pointing into memory the sender can change (a shared region), so that what
 * the range check passed is what the kernels read. 0 or DSV4_ENOMEM.
 */
int dsv4_forward_req_own_cache_inputs(dsv4_forward_req_t *r);

#endif /* DSV4_SERVER_FORWARD_PARSE_H */
