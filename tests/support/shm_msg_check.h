#ifndef DSV4_TESTS_SHM_MSG_CHECK_H
#define DSV4_TESTS_SHM_MSG_CHECK_H

/*
 * A shared-region forward message read both ways (server/shm_msg.h): when dsv4_shm_fwd_scan reads
 * it without a document, jansson must read it too, end its object where the scan did, and give
 * the same fields, and the header must give the same view (or the same refusal) against a region.
 * Shared by shm_msg_test and fuzz_shm_msg.
 */
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "dsv4-error.h"
#include "safetensors.h"
#include "shm_msg.h"
#include "st_views.h"

static const char *shm_fields_differ(const dsv4_shm_fwd_t *a, const dsv4_shm_fwd_t *b) {
  if (a->region_ok != b->region_ok || a->region != b->region)
    return "region differs";
  if (a->deadline_given != b->deadline_given || a->deadline_ok != b->deadline_ok ||
      a->deadline_ms != b->deadline_ms)
    return "deadline_ms differs";
  if (a->segs_given != b->segs_given || a->segs_bytes != b->segs_bytes)
    return "segments_bytes differs";
  if (a->out_object != b->out_object || a->n_outs != b->n_outs)
    return "out differs";
  for (size_t i = 0; i < a->n_outs; i++)
    if (strcmp(a->outs[i].name, b->outs[i].name) || a->outs[i].ok != b->outs[i].ok ||
        a->outs[i].off != b->outs[i].off)
      return "an out entry differs";
  return NULL;
}

/*
 * 1 when the scan read text[0..len) and both readings agree (the header checked against a region
 * of region_size bytes), 0 when the scan left it to jansson, -1 on a disagreement (*why says
 * which).
 */
static int shm_msg_check(const char *text, size_t len, size_t region_size, const char **why) {
  dsv4_shm_fwd_t a, b;
  size_t used = 0;
  int rc = dsv4_shm_fwd_scan(text, len, &a, &used);
  *why = NULL;
  if (rc == DSV4_ST_NOT_USUAL)
    return 0;
  if (rc) {
    *why = "the scan failed";
    return -1;
  }
  json_error_t je;
  json_t *msg = json_loadb(text, len, JSON_REJECT_DUPLICATES | JSON_DISABLE_EOF_CHECK, &je);
  const char *op = json_string_value(json_object_get(msg, "op"));
  int have_b = 0;
  if (!json_is_object(msg) || (size_t)je.position != used || !op || strcmp(op, "forward"))
    *why = "jansson reads another message";
  else if ((have_b = 1, dsv4_shm_fwd_from_doc(msg, &b)))
    *why = "out of memory";
  else if (!(*why = shm_fields_differ(&a, &b))) {
    const uint8_t *base = (const uint8_t *)(uintptr_t)0x10000;
    dsv4_st_view_t va, vb;
    int ra = dsv4_st_view_region_raw(a.raw, base, region_size, &va);
    a.raw = NULL; /* taken */
    int rb = dsv4_st_view_region(b.header, base, region_size, &vb);
    *why = st_views_differ(ra, &va, rb, &vb);
    dsv4_st_view_free(&va);
    dsv4_st_view_free(&vb);
  }
  if (have_b)
    dsv4_shm_fwd_free(&b);
  json_decref(msg);
  dsv4_shm_fwd_free(&a);
  return *why ? -1 : 1;
}

#endif /* DSV4_TESTS_SHM_MSG_CHECK_H */
