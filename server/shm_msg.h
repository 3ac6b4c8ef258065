#ifndef DSV4_SERVER_SHM_MSG_H
#define DSV4_SERVER_SHM_MSG_H

/*
 * A shared-region forward message's fields (SPEC §6.1), as shm.c checks them: from the message's
 * jansson document, or read in one pass without one when the message has the usual shape (the
 * one libdsv4client writes: "op", "region", "header", "out" and optionally "deadline_ms" and
 * "segments_bytes", each once, integers of 1 to 18 digits, keys and "forward" without escapes, the
 * header as dsv4_st_scan_header reads it). For such a message both give the same fields, so the
 * daemon answers it the same either way (shm_msg_test, fuzz_shm_msg).
 *
 * Thread affinity: none.
 */
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "safetensors.h"

/* One entry of "out", in message order: its name and whether its value is an integer >= 0. */
typedef struct {
  const char *name;
  int ok;
  int64_t off;
} dsv4_shm_out_t;

#define DSV4_SHM_SCAN_OUTS 8

typedef struct {
  json_t *region_json; /* from a document: "region" as given (a 404 echoes it), else NULL */
  int region_ok;       /* "region" is an integer */
  int64_t region;
  int deadline_given, deadline_ok; /* "deadline_ms" given; an integer >= 0 */
  int64_t deadline_ms;
  /* The header: the document's (NULL when missing), or, read without a document, the scanned
   * header that dsv4_st_view_region_raw takes (then header is NULL and raw is not). */
  json_t *header;
  dsv4_st_raw_t *raw;
  int segs_given;     /* "segments_bytes" given */
  int64_t segs_bytes; /* its value, -1 when it is not an integer */
  int out_object;     /* "out" is an object */
  dsv4_shm_out_t *outs;
  size_t n_outs;
  /* What the fields own: outs is scan_outs unless a document had more entries (then malloc'd). */
  dsv4_shm_out_t scan_outs[DSV4_SHM_SCAN_OUTS];
  char *mem;
} dsv4_shm_fwd_t;

/* The fields of a forward message's document msg (a reference to nothing: msg outlives *m). 0, or
 * DSV4_ENOMEM. */
int dsv4_shm_fwd_from_doc(json_t *msg, dsv4_shm_fwd_t *m);
/*
 * A forward message of the usual shape at text[0..len), read without a document: 0 with *m
 * filled and *used the bytes of its JSON object (what follows is "segments_bytes" of segments
 * text, or only white space), or DSV4_ST_NOT_USUAL for any other message and when out of memory
 * (nothing to free: read it with jansson).
 */
int dsv4_shm_fwd_scan(const char *text, size_t len, dsv4_shm_fwd_t *m, size_t *used);
void dsv4_shm_fwd_free(dsv4_shm_fwd_t *m);

#endif /* DSV4_SERVER_SHM_MSG_H */
