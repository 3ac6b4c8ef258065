/*
 * A forward body checked as it arrives: forward_arrival.h.
 */
#include "forward_arrival.h"

#include <stdlib.h>
#include <string.h>

#include "decimal.h"

enum { WAIT_HEADER, FEEDING, OFF };

/* The tensors a check reads, in its order (engine.h). */
static const char *const names[DSV4_CHECK_TENSORS] = {"q", "kv", "ckv", "ikv", "iq", "iw"};

struct dsv4_arrival {
  int state;
  size_t content_length;
  dsv4_forward_limits_t lim;
  dsv4_st_view_t view; /* the header's, over the whole body (view_ok) */
  int view_ok;
  const uint8_t *body;                  /* where the view was parsed */
  dsv4_check_t *check;                  /* FEEDING: over the tensors */
  int n_t;                              /* how many of them the layer's body carries */
  const void *data[DSV4_CHECK_TENSORS]; /* their data in the body */
  size_t at[DSV4_CHECK_TENSORS];        /* their first byte's offset in the body */
  size_t vals[DSV4_CHECK_TENSORS];      /* their values */
  size_t size[DSV4_CHECK_TENSORS];      /* bytes a value */
};

dsv4_arrival_t *dsv4_arrival_begin(const dsv4_forward_limits_t *lim, size_t content_length) {
  dsv4_arrival_t *a = calloc(1, sizeof(*a));
  if (!a)
    return NULL;
  a->content_length = content_length;
  a->lim = *lim;
  return a;
}

void dsv4_arrival_end(dsv4_arrival_t *a) {
  if (!a)
    return;
  if (a->view_ok)
    dsv4_st_view_free(&a->view);
  dsv4_check_free(a->check);
  free(a);
}

/* Tensor k as the check reads it in place: its dtype, and its data aligned to its values (the
 * parse copies what is not, elsewhere). Its shape is the parse's to check: the check reads no more
 * values than the tensor holds (dsv4_arrival_seen), and is used only for a body the parse took. */
static int tensor_followed(const dsv4_st_tensor_t *t, int k) {
  static const int dtypes[DSV4_CHECK_TENSORS] = {DSV4_ST_BF16, DSV4_ST_BF16, DSV4_ST_F32,
                                                 DSV4_ST_F32,  DSV4_ST_BF16, DSV4_ST_F32};
  return t && t->dtype == dtypes[k] && !((uintptr_t)t->data & (dsv4_st_dtype_size(t->dtype) - 1));
}

/* The check's shape and N from the view: the layer's ratio as the engine runs it, q's N within the
 * limits and every tensor the layer takes followed; else 0. */
static uint32_t shape_of(const dsv4_arrival_t *a, dsv4_check_shape_t *sh) {
  const dsv4_st_tensor_t *q = dsv4_st_find(&a->view, "q");
  const char *layer_s = dsv4_st_meta(&a->view, "layer");
  uint64_t layer;
  if (!q || q->ndim < 1 || q->shape[0] < 1 || q->shape[0] > (int64_t)a->lim.max_batch_tokens ||
      !layer_s || dsv4_parse_decimal(layer_s, strlen(layer_s), UINT32_MAX, &layer))
    return 0;
  sh->heads = a->lim.heads;
  sh->ratio = a->lim.layer_ratio ? a->lim.layer_ratio(a->lim.layer_arg, (uint32_t)layer) : 0;
  sh->index_heads = a->lim.index_heads;
  const int n_t = dsv4_check_tensors(sh->ratio);
  for (int k = 0; k < n_t; k++)
    if (!tensor_followed(dsv4_st_find(&a->view, names[k]), k))
      return 0;
  return (uint32_t)q->shape[0];
}

/*
 * A batch of several segments in a larger body is left to the engine, whose validation spreads the
 * segments over the backend's host threads: on an H100 host a 64-token decode's 4 MiB checked on
 * arrival by the one thread that read it gave the daemon 5-11 % fewer tokens/s, a 16-token
 * decode's 1 MiB 9-14 % more (tests/bench/NOTES.md). A batch of one segment (a prefill) is checked
 * by one thread either way, and on arrival not by the executor's.
 */
#define SPREAD_BODY_BYTES ((size_t)2 << 20)

/* The segments' lengths from the view, adding up to n: a check for them, or NULL (also for several
 * segments in a body past SPREAD_BODY_BYTES). */
static dsv4_check_t *check_of(const dsv4_arrival_t *a, const dsv4_check_shape_t *sh, uint32_t n) {
  const char *segs_s = dsv4_st_meta(&a->view, "segments");
  dsv4_forward_req_t r;
  dsv4_check_t *c = NULL;
  char why[8];
  uint32_t *lens = NULL;
  uint64_t total = 0;
  memset(&r, 0, sizeof(r));
  if (segs_s && dsv4__forward_segments(segs_s, a->lim.max_segments, 1, &r, why, sizeof(why)) == 0 &&
      (lens = malloc(r.n_segs * sizeof(uint32_t))) != NULL) {
    for (uint32_t s = 0; s < r.n_segs; s++)
      total += lens[s] = r.segs[s].len;
    if (total == n && (r.n_segs == 1 || a->content_length <= SPREAD_BODY_BYTES))
      c = dsv4_check_create(sh, lens, r.n_segs);
  }
  free(lens);
  dsv4_forward_req_free(&r);
  return c;
}

/* The header is in: its view over the whole body, and the check when the body can be followed. */
static void header_in(dsv4_arrival_t *a, const uint8_t *body) {
  dsv4_check_shape_t sh;
  a->state = OFF;
  if (dsv4_st_parse(body, a->content_length, &a->view) != 0)
    return;
  a->view_ok = 1;
  a->body = body;
  const uint32_t n = shape_of(a, &sh);
  if (!n || !(a->check = check_of(a, &sh, n)))
    return;
  a->n_t = dsv4_check_tensors(sh.ratio);
  for (int k = 0; k < a->n_t; k++) {
    const dsv4_st_tensor_t *t = dsv4_st_find(&a->view, names[k]);
    a->data[k] = t->data;
    a->at[k] = (size_t)(t->data - body);
    a->size[k] = dsv4_st_dtype_size(t->dtype);
    a->vals[k] = t->nbytes / a->size[k];
  }
  a->state = FEEDING;
}

/* Whole values of a tensor at `at` of `vals` values of `size` bytes that the first have bytes hold.
 */
static size_t values_in(size_t at, size_t vals, size_t size, size_t have) {
  const size_t v = have <= at ? 0 : (have - at) / size;
  return v < vals ? v : vals;
}

void dsv4_arrival_seen(dsv4_arrival_t *a, const uint8_t *body, size_t have) {
  if (a->state == WAIT_HEADER) {
    if (have < 8)
      return;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
      hlen = hlen << 8 | body[i];
    if (hlen > a->content_length - 8) {
      a->state = OFF;
      return;
    }
    if (have < 8 + hlen)
      return;
    header_in(a, body);
  }
  if (a->state != FEEDING)
    return;
  size_t in[DSV4_CHECK_TENSORS];
  for (int k = 0; k < a->n_t; k++)
    in[k] = values_in(a->at[k], a->vals[k], a->size[k], have);
  if (dsv4_check_feed(a->check, a->data, in))
    a->state = OFF; /* out of range: the engine refuses the batch from the check */
}

int dsv4_arrival_take_view(dsv4_arrival_t *a, const uint8_t *body, size_t len,
                           dsv4_st_view_t *view) {
  if (!a || !a->view_ok || a->body != body || len != a->content_length)
    return 0;
  *view = a->view;
  memset(&a->view, 0, sizeof(a->view));
  a->view_ok = 0;
  return 1;
}

dsv4_check_t *dsv4_arrival_take_check(dsv4_arrival_t *a, const dsv4_forward_req_t *p) {
  const void *got[DSV4_CHECK_TENSORS] = {p->q, p->kv, p->ckv, p->ikv, p->iq, p->iw};
  if (!a || !a->check || a->n_t != dsv4_check_tensors(p->ratio))
    return NULL;
  for (int k = 0; k < a->n_t; k++)
    if (got[k] != a->data[k])
      return NULL;
  dsv4_check_t *c = a->check;
  a->check = NULL;
  return c;
}
