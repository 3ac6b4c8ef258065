/*
 * A batch's range checks and replay identity (SPEC §4: per segment, XXH3 of its q bytes, then its
 * kv bytes, then on a compressed layer its rows of ckv, ikv, iq and iw, §8.8), kept as one state
 * per segment so that the work can begin before the batch does: the HTTP server feeds a body's
 * tensors as its reads bring them (dsv4_check_feed), while the client is still sending, and the
 * engine's validation resumes each segment where the arrival left it. Either way every byte is
 * checked and hashed once, in the same order, so the hashes are those of one pass over the whole
 * batch.
 */
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t in the segment's state */
#include <xxhash.h>
#if defined(__x86_64__)
/* libxxhash's run-time dispatch picks its AVX2/AVX-512 XXH3 loop (2.5x the SSE2 one here). */
#include <xxh_x86dispatch.h>
#endif

#include "dsv4-compress.h"
#include "engine-internal.h"

/* The limits of SPEC §8.8 as the bits of the smallest magnitude refused. */
#define F32_LIMIT_2_59 0x5D000000u
#define F32_LIMIT_2_32 0x4F800000u
#define BF16_LIMIT_2_32 0x4F80u

static int bf16_2_59(const void *x, size_t n) {
  return dsv4_bf16_any_out_of_range(x, n);
}
static int f32_2_59(const void *x, size_t n) {
  return dsv4_f32_any_at_least(x, n, F32_LIMIT_2_59);
}
static int bf16_2_32(const void *x, size_t n) {
  return dsv4_bf16_any_at_least(x, n, BF16_LIMIT_2_32);
}
static int f32_2_32(const void *x, size_t n) {
  return dsv4_f32_any_at_least(x, n, F32_LIMIT_2_32);
}

/* One tensor of the batch as the check reads it. */
typedef struct {
  size_t row;  /* values of one token */
  size_t size; /* bytes of one value: 2 (bf16) or 4 (f32) */
  int (*out_of_range)(const void *x, size_t n);
  const char
      *name; /* named in a refusal (SPEC §8.8); NULL for q and kv, whose refusal names none */
} tensor_t;

typedef struct {
  XXH3_state_t st;
  size_t
      done[DSV4_CHECK_TENSORS]; /* values of the segment's rows of each tensor checked and hashed */
  int finished;                 /* the engine took the digest */
} seg_check_t;

struct dsv4_check {
  seg_check_t *seg;  /* [n_segs], 64-byte aligned (XXH3_state_t's alignment) */
  uint32_t *len;     /* [n_segs] tokens */
  uint32_t *tok_off; /* [n_segs] first token */
  uint32_t n_segs, n_tokens;
  dsv4_check_shape_t shape;
  tensor_t t[DSV4_CHECK_TENSORS];
  int n_t;
  uint32_t open;          /* arrival: every segment below it has all of its rows fed */
  int bad;                /* a value out of range was met: nothing more is fed */
  const char *bad_tensor; /* its tensor's name (NULL for q and kv) */
  int used;               /* a validation took it (a state is finished once) */
  size_t fed;             /* bytes fed by dsv4_check_feed */
};

int dsv4_check_tensors(uint32_t ratio) {
  return ratio == 4 ? 6 : ratio == 128 ? 3 : 2;
}

/* The tensors of a batch of this shape, in the order a segment's hash takes them. */
static int tensors_of(const dsv4_check_shape_t *sh, tensor_t *t) {
  const size_t ih = sh->index_heads;
  t[0] = (tensor_t){(size_t)sh->heads * DSV4_HEAD_DIM, 2, bf16_2_59, NULL};
  t[1] = (tensor_t){DSV4_HEAD_DIM, 2, bf16_2_59, NULL};
  t[2] = (tensor_t){sh->ratio == 4 ? 2048 : 1024, 4, f32_2_59, "ckv"};
  t[3] = (tensor_t){512, 4, f32_2_59, "ikv"};
  t[4] = (tensor_t){ih * DSV4_INDEX_DIM, 2, bf16_2_32, "iq"};
  t[5] = (tensor_t){ih, 4, f32_2_32, "iw"};
  return dsv4_check_tensors(sh->ratio);
}

dsv4_check_t *dsv4_check_create(const dsv4_check_shape_t *sh, const uint32_t *seg_len,
                                uint32_t n_segs) {
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
    memset(c->seg[s].done, 0, sizeof(c->seg[s].done));
    c->seg[s].finished = 0;
  }
  c->n_segs = n_segs;
  c->n_tokens = (uint32_t)t;
  c->shape = *sh;
  c->n_t = tensors_of(sh, c->t);
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

/* Feed n values of tensor t at x to the hash in cache-sized pieces, range-checking each piece just
 * before it is hashed, so the bytes are read from memory once for both. 1 when one is out of range.
 */
static int check_and_hash(XXH3_state_t *st, const tensor_t *t, const uint8_t *x, size_t n) {
  const size_t piece = 16384 / t->size; /* 16 KiB, well inside L1 */
  for (size_t off = 0; off < n; off += piece) {
    const size_t len = n - off < piece ? n - off : piece;
    if (t->out_of_range(x + off * t->size, len))
      return 1;
    XXH3_64bits_update(st, x + off * t->size, len * t->size);
  }
  return 0;
}

/*
 * Segment s's rows of each tensor in turn (one only once all of the one before it is in), each up
 * to lim[k] of its values counted from the segment's first, at most *budget bytes of q and kv,
 * which it lessens (the compressed rows, a fraction of q's, go whole once a round reaches them
 * with budget left, as engine.h documents a chunked batch's rounds). data[k]: the batch's tensor k.
 * 1 on a value out of range, its tensor's name in *bad. Writes nothing of c but segment s's state:
 * the engine feeds segments on several threads at once.
 */
static int seg_feed(dsv4_check_t *c, uint32_t s, const void *const *data, const size_t *lim,
                    size_t *budget, const char **bad) {
  seg_check_t *x = &c->seg[s];
  for (int k = 0; k < c->n_t && *budget; k++) {
    const tensor_t *t = &c->t[k];
    const size_t n = (size_t)c->len[s] * t->row, stop = lim[k] < n ? lim[k] : n;
    if (x->done[k] < stop) {
      const size_t room = k >= 2 ? SIZE_MAX : *budget / t->size ? *budget / t->size : 1;
      const size_t m = stop - x->done[k] < room ? stop - x->done[k] : room;
      const uint8_t *p = data[k];
      if (check_and_hash(&x->st, t, p + ((size_t)c->tok_off[s] * t->row + x->done[k]) * t->size,
                         m)) {
        *bad = t->name;
        return 1;
      }
      x->done[k] += m;
      if (k < 2)
        *budget -= m * t->size < *budget ? m * t->size : *budget;
    }
    if (x->done[k] < n)
      break;
  }
  return 0;
}

/* Whether all of segment s's rows are in. */
static int seg_fed(const dsv4_check_t *c, uint32_t s) {
  for (int k = 0; k < c->n_t; k++)
    if (c->seg[s].done[k] < (size_t)c->len[s] * c->t[k].row)
      return 0;
  return 1;
}

int dsv4_check_feed(dsv4_check_t *c, const void *const *data, const size_t *vals) {
  if (c->bad)
    return 1;
  for (uint32_t s = c->open; s < c->n_segs; s++) {
    seg_check_t *x = &c->seg[s];
    size_t lim[DSV4_CHECK_TENSORS], before = 0, after = 0;
    for (int k = 0; k < c->n_t; k++) {
      const size_t first = (size_t)c->tok_off[s] * c->t[k].row;
      lim[k] = vals[k] <= first ? 0 : vals[k] - first;
      before += x->done[k] * c->t[k].size;
    }
    size_t budget = SIZE_MAX;
    if (seg_feed(c, s, data, lim, &budget, &c->bad_tensor)) {
      c->bad = 1;
      return 1;
    }
    for (int k = 0; k < c->n_t; k++)
      after += x->done[k] * c->t[k].size;
    c->fed += after - before;
    if (x->done[0] < (size_t)c->len[s] * c->t[0].row)
      break; /* the segments after it have none of their q yet */
    if (s == c->open && seg_fed(c, s))
      c->open++;
  }
  return 0;
}

/* ---- the engine's side -------------------------------------------------------------------- */

dsv4_check_t *dsv4__check_take(dsv4_check_t *given, const dsv4_check_shape_t *sh,
                               const dsv4_forward_t *f, dsv4_check_t **own) {
  *own = NULL;
  int fits = given && !given->used && given->shape.heads == sh->heads &&
             given->shape.ratio == sh->ratio &&
             (sh->ratio != 4 || given->shape.index_heads == sh->index_heads) &&
             given->n_segs == f->n_segs && given->n_tokens == f->n_tokens;
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
  *own = dsv4_check_create(sh, len, f->n_segs);
  free(len);
  if (*own)
    (*own)->used = 1;
  return *own;
}

int dsv4__check_bad(const dsv4_check_t *c, const char **tensor) {
  *tensor = c->bad_tensor;
  return c->bad;
}

int dsv4__check_all_fed(const dsv4_check_t *c) {
  return c->open == c->n_segs;
}

int dsv4__check_seg_finished(const dsv4_check_t *c, uint32_t s) {
  return c->seg[s].finished;
}

int dsv4__check_seg_feed(dsv4_check_t *c, uint32_t s, const void *const *data, size_t *budget,
                         uint64_t *digest, const char **bad) {
  const size_t all[DSV4_CHECK_TENSORS] = {SIZE_MAX, SIZE_MAX, SIZE_MAX,
                                          SIZE_MAX, SIZE_MAX, SIZE_MAX};
  *bad = NULL;
  int rc = seg_feed(c, s, data, all, budget, bad);
  if (rc || seg_fed(c, s)) {
    c->seg[s].finished = 1;
    if (!rc)
      *digest = XXH3_64bits_digest(&c->seg[s].st);
  }
  return rc;
}
