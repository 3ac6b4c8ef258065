/*
 * A forward body checked as it arrives: forward_arrival.h.
 */
#include "forward_arrival.h"

#include <stdlib.h>
#include <string.h>

#include "dsv4-layout.h"

enum { WAIT_HEADER, FEEDING, OFF };

struct dsv4_arrival {
  int state;
  size_t content_length;
  uint32_t heads, max_tokens, max_segments;
  dsv4_st_view_t view; /* the header's, over the whole body (view_ok) */
  int view_ok;
  const uint8_t *body;    /* where the view was parsed */
  dsv4_check_t *check;    /* FEEDING: over q and kv */
  const uint16_t *q, *kv; /* their data in the body */
  size_t q_at, kv_at;     /* their first byte's offset in the body */
  size_t q_vals, kv_vals; /* their bf16 values */
};

dsv4_arrival_t *dsv4_arrival_begin(const dsv4_forward_limits_t *lim, size_t content_length) {
  dsv4_arrival_t *a = calloc(1, sizeof(*a));
  if (!a)
    return NULL;
  a->content_length = content_length;
  a->heads = lim->heads;
  a->max_tokens = lim->max_batch_tokens;
  a->max_segments = lim->max_segments;
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

/* q [N, heads, 512] and kv [N, 512] in BF16, 2-aligned, N in 1..max_tokens: their N, else 0. */
static uint32_t tensors_followed(const dsv4_arrival_t *a, const dsv4_st_tensor_t *q,
                                 const dsv4_st_tensor_t *kv) {
  if (!q || !kv || q->dtype != DSV4_ST_BF16 || kv->dtype != DSV4_ST_BF16 || q->ndim != 3 ||
      kv->ndim != 2 || ((uintptr_t)q->data & 1) || ((uintptr_t)kv->data & 1))
    return 0;
  const int64_t n = q->shape[0];
  if (n < 1 || n > (int64_t)a->max_tokens || q->shape[1] != a->heads ||
      q->shape[2] != DSV4_HEAD_DIM || kv->shape[0] != n || kv->shape[1] != DSV4_HEAD_DIM)
    return 0;
  return (uint32_t)n;
}

/* The header is in: its view over the whole body, and the check when the body can be followed. */
static void header_in(dsv4_arrival_t *a, const uint8_t *body) {
  a->state = OFF;
  if (dsv4_st_parse(body, a->content_length, &a->view) != 0)
    return;
  a->view_ok = 1;
  a->body = body;
  const dsv4_st_tensor_t *q = dsv4_st_find(&a->view, "q"), *kv = dsv4_st_find(&a->view, "kv");
  const uint32_t n = tensors_followed(a, q, kv);
  const char *segs_s = dsv4_st_meta(&a->view, "segments");
  if (!n || !segs_s)
    return;
  dsv4_forward_req_t r;
  char why[8];
  memset(&r, 0, sizeof(r));
  uint32_t *lens = NULL;
  uint64_t total = 0;
  if (dsv4__forward_segments(segs_s, a->max_segments, 1, &r, why, sizeof(why)) == 0 &&
      (lens = malloc(r.n_segs * sizeof(uint32_t))) != NULL) {
    for (uint32_t s = 0; s < r.n_segs; s++)
      total += lens[s] = r.segs[s].len;
    if (total == n)
      a->check = dsv4_check_create(a->heads, lens, r.n_segs);
  }
  free(lens);
  dsv4_forward_req_free(&r);
  if (!a->check)
    return;
  a->q = (const uint16_t *)(const void *)q->data;
  a->kv = (const uint16_t *)(const void *)kv->data;
  a->q_at = (size_t)(q->data - body);
  a->kv_at = (size_t)(kv->data - body);
  a->q_vals = q->nbytes / 2;
  a->kv_vals = kv->nbytes / 2;
  a->state = FEEDING;
}

/* Whole bf16 values of a tensor at `at` of `vals` values that the body's first have bytes hold. */
static size_t values_in(size_t at, size_t vals, size_t have) {
  const size_t v = have <= at ? 0 : (have - at) / 2;
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
  if (dsv4_check_feed(a->check, a->q, values_in(a->q_at, a->q_vals, have), a->kv,
                      values_in(a->kv_at, a->kv_vals, have)))
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
  if (!a || !a->check || p->q != a->q || p->kv != a->kv)
    return NULL;
  dsv4_check_t *c = a->check;
  a->check = NULL;
  return c;
}
