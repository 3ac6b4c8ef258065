#ifndef DSV4_TESTS_ST_VIEWS_H
#define DSV4_TESTS_ST_VIEWS_H

/*
 * Two safetensors answers held to each other (a view or a refusal, with its code ra / rb), as the
 * tests and fuzzers of the readers without documents compare them with jansson's: NULL when they
 * are the same field by field, else what differs.
 */
#include <string.h>

#include "safetensors.h"

static const char *st_views_differ(int ra, const dsv4_st_view_t *a, int rb,
                                   const dsv4_st_view_t *b) {
  if (ra != rb || strcmp(a->error, b->error))
    return "the answers differ";
  if (a->n_tensors != b->n_tensors || a->n_meta != b->n_meta)
    return "the entries differ";
  for (size_t i = 0; i < a->n_tensors; i++) {
    const dsv4_st_tensor_t *x = &a->tensors[i], *y = &b->tensors[i];
    if (strcmp(x->name, y->name) || x->dtype != y->dtype || x->ndim != y->ndim ||
        memcmp(x->shape, y->shape, sizeof(x->shape)) || x->numel != y->numel ||
        x->nbytes != y->nbytes || x->offset != y->offset || x->data != y->data)
      return "a tensor differs";
  }
  for (size_t i = 0; i < a->n_meta; i++)
    if (strcmp(a->meta[i].key, b->meta[i].key) || strcmp(a->meta[i].value, b->meta[i].value))
      return "a metadata entry differs";
  return NULL;
}

#endif /* DSV4_TESTS_ST_VIEWS_H */
