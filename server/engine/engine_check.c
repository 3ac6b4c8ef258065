/*
 * A batch's range check (|x| < 2^59) and replay identity (SPEC §4: per segment, XXH3 of its q
 * bytes, then its kv bytes, then its compressed rows), kept as one state per segment so that the
 * work can begin before the batch does: the HTTP server feeds a body's q and kv as its reads bring
 * them (dsv4_check_feed), while the client is still sending, and the engine's validation resumes
 * each segment where the arrival left it. Either way every byte is checked and hashed once, in the
 * same order, so the hashes are those of one pass over the whole batch.
 */
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t in the segment's state */
#include <xxhash.h>
#if defined(__x86_64__)
/* libxxhash's run-time dispatch picks its AVX2/AVX-512 XXH3 loop (2.5x the SSE2 one here). */
#include <xxh_x86dispatch.h>
#endif

#include "engine-internal.h"

typedef struct {
  XXH3_state_t st;
  size_t q_done, kv_done; /* bf16 values of the segment's q and kv checked and hashed */
  int done;               /* the engine took the digest */
} seg_check_t;

struct dsv4_check {
  seg_check_t *seg;  /* [n_segs], 64-byte aligned (XXH3_state_t's alignment) */
  uint32_t *len;     /* [n_segs] tokens */
  uint32_t *tok_off; /* [n_segs] first token */
  uint32_t n_segs, n_tokens, heads;
  uint32_t open; /* arrival: every segment below it has its q and kv all fed */
  int bad;       /* a value out of range was met: nothing more is fed */
  int used;      /* a validation took it (a state is finished once) */
  size_t fed;    /* bytes fed by dsv4_check_feed */
};

dsv4_check_t *dsv4_check_create(uint32_t heads, const uint32_t *seg_len, uint32_t n_segs) {
  dsv4_check_t *c = calloc(1, sizeof(*c));
  if (!c || !n_segs)
    goto fail;
  c->seg = aligned_alloc(64, (n_segs * sizeof(seg_check_t) + 63) & ~(size_t)63);
  c->len = malloc(n_segs * sizeof(uint32_t));
  c->tok_off = malloc(n_segs * sizeof(uint32_t));
  if (!c->seg || !c->len || !c->tok_off)
    goto fail;
  uint64_t t = 0;
  for (uint32_t s = 0; s < n_segs; s++) {
    c->tok_off[s] = (uint32_t)t;
    c->len[s] = seg_len[s];
    t += seg_len[s];
    if (t > UINT32_MAX)
      goto fail;
    XXH3_64bits_reset(&c->seg[s].st);
    c->seg[s].q_done = c->seg[s].kv_done = 0;
    c->seg[s].done = 0;
  }
  c->n_segs = n_segs;
  c->n_tokens = (uint32_t)t;
  c->heads = heads;
  return c;
fail:
  dsv4_check_free(c);
  return NULL;
}

void dsv4_check_free(dsv4_check_t *c) {
  if (!c)
    return;
  free(c->seg);
  free(c->len);
  free(c->tok_off);
  free(c);
}

size_t dsv4_check_fed_bytes(const dsv4_check_t *c) {
  return c->fed;
}

/* Feed bytes to the hash in cache-sized pieces, range-checking each piece just before it is hashed,
 * so the bytes are read from memory once for both. Returns 1 when a value is out of range. */
static int check_and_hash(XXH3_state_t *st, const uint16_t *x, size_t n) {
  enum { PIECE = 8192 }; /* bf16 values: 16 KiB, well inside L1 */
  for (size_t off = 0; off < n; off += PIECE) {
    size_t len = n - off < PIECE ? n - off : PIECE;
    if (dsv4_bf16_any_out_of_range(x + off, len))
      return 1;
    XXH3_64bits_update(st, x + off, len * 2);
  }
  return 0;
}

/*
 * Segment s's q, then its kv, fed up to q_lim and kv_lim of its values (its kv only once all of its
 * q is in), at most *budget values, which it lessens. q and kv: the batch's. 1 on a value out of
 * range.
 */
static int seg_feed(dsv4_check_t *c, uint32_t s, const uint16_t *q, size_t q_lim,
                    const uint16_t *kv, size_t kv_lim, size_t *budget) {
  seg_check_t *x = &c->seg[s];
  const size_t q_row = (size_t)c->heads * DSV4_HEAD_DIM;
  const size_t q_n = (size_t)c->len[s] * q_row;
  q += (size_t)c->tok_off[s] * q_row;
  kv += (size_t)c->tok_off[s] * DSV4_HEAD_DIM;
  int rc = 0;
  while (*budget && !rc) {
    size_t *done = x->q_done < q_n ? &x->q_done : &x->kv_done;
    const size_t lim = x->q_done < q_n ? q_lim : kv_lim;
    const uint16_t *src = x->q_done < q_n ? q : kv;
    if (*done >= lim)
      break;
    size_t k = lim - *done < *budget ? lim - *done : *budget;
    rc = check_and_hash(&x->st, src + *done, k);
    *done += k;
    *budget -= k;
  }
  return rc;
}

int dsv4_check_feed(dsv4_check_t *c, const uint16_t *q, size_t q_vals, const uint16_t *kv,
                    size_t kv_vals) {
  const size_t q_row = (size_t)c->heads * DSV4_HEAD_DIM;
  if (c->bad)
    return 1;
  for (uint32_t s = c->open; s < c->n_segs; s++) {
    seg_check_t *x = &c->seg[s];
    const size_t q0 = (size_t)c->tok_off[s] * q_row, q_n = (size_t)c->len[s] * q_row;
    const size_t kv0 = (size_t)c->tok_off[s] * DSV4_HEAD_DIM;
    const size_t kv_n = (size_t)c->len[s] * DSV4_HEAD_DIM;
    const size_t q_lim = q_vals <= q0 ? 0 : q_vals - q0 < q_n ? q_vals - q0 : q_n;
    const size_t kv_lim = kv_vals <= kv0 ? 0 : kv_vals - kv0 < kv_n ? kv_vals - kv0 : kv_n;
    const size_t before = x->q_done + x->kv_done;
    size_t budget = SIZE_MAX;
    if (seg_feed(c, s, q, q_lim, kv, kv_lim, &budget)) {
      c->bad = 1;
      return 1;
    }
    c->fed += (x->q_done + x->kv_done - before) * sizeof(uint16_t);
    if (x->q_done < q_n)
      break; /* the segments after it have none of their q yet */
    if (s == c->open && x->kv_done == kv_n)
      c->open++;
  }
  return 0;
}

/* ---- the engine's side -------------------------------------------------------------------- */

dsv4_check_t *dsv4__check_take(dsv4_check_t *given, uint32_t heads, const dsv4_forward_t *f,
                               dsv4_check_t **own) {
  *own = NULL;
  int fits = given && !given->used && given->heads == heads && given->n_segs == f->n_segs &&
             given->n_tokens == f->n_tokens;
  for (uint32_t s = 0; fits && s < f->n_segs; s++)
    fits = given->len[s] == f->segs[s].len;
  if (fits) {
    given->used = 1;
    return given;
  }
  uint32_t *len = malloc(f->n_segs * sizeof(uint32_t));
  if (!len)
    return NULL;
  for (uint32_t s = 0; s < f->n_segs; s++)
    len[s] = f->segs[s].len;
  *own = dsv4_check_create(heads, len, f->n_segs);
  free(len);
  if (*own)
    (*own)->used = 1;
  return *own;
}

int dsv4__check_bad(const dsv4_check_t *c) {
  return c->bad;
}

int dsv4__check_all_fed(const dsv4_check_t *c) {
  return c->open == c->n_segs;
}

int dsv4__check_seg_done(const dsv4_check_t *c, uint32_t s) {
  return c->seg[s].done;
}

int dsv4__check_seg_feed(dsv4_check_t *c, uint32_t s, const uint16_t *q, const uint16_t *kv,
                         size_t *budget, void **st) {
  seg_check_t *x = &c->seg[s];
  const size_t q_n = (size_t)c->len[s] * c->heads * DSV4_HEAD_DIM;
  const size_t kv_n = (size_t)c->len[s] * DSV4_HEAD_DIM;
  int rc = seg_feed(c, s, q, q_n, kv, kv_n, budget);
  *st = rc || x->kv_done < kv_n ? NULL : &x->st;
  return rc;
}

void dsv4__check_seg_finish(dsv4_check_t *c, uint32_t s) {
  c->seg[s].done = 1;
}
