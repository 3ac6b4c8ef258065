/*
 * libFuzzer driver for the safetensors parser. Beyond "no crash, no leak", an accepted body must
 * satisfy what the parser promises (tensors inside the buffer, covering the data section exactly)
 * and survive a round trip through the header writer; the parse and the writer without a document
 * must answer exactly as the document's (dsv4__st_parse_reference,
 * dsv4__st_build_header_reference).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "safetensors.h"
#include "st_views.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The parse without a document (the usual header's reader) answers as the document does: the
 * same code, message, tensors and metadata. */
static void same_as_document(const uint8_t *buf, size_t size, int rc, const dsv4_st_view_t *v) {
  dsv4_st_view_t w;
  int rw = dsv4__st_parse_reference(buf, size, &w);
  if (st_views_differ(rc, v, rw, &w))
    abort();
  dsv4_st_view_free(&w);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A private copy, so reads past the end are caught by ASan whatever libFuzzer's buffer is. */
  uint8_t *buf = malloc(size ? size : 1);
  if (!buf)
    return 0;
  memcpy(buf, data, size);
  dsv4_st_view_t v;
  int parsed = dsv4_st_parse(buf, size, &v);
  same_as_document(buf, size, parsed, &v);
  if (parsed != 0) {
    if (v.error[0] == '\0')
      abort(); /* every rejection says why */
    free(buf);
    return 0;
  }
  size_t total = 0;
  dsv4_st_desc_t *d = calloc(v.n_tensors ? v.n_tensors : 1, sizeof(*d));
  for (size_t i = 0; i < v.n_tensors; i++) {
    const dsv4_st_tensor_t *t = &v.tensors[i];
    if (t->data < v.data || t->data + t->nbytes > v.data + v.data_len)
      abort();
    if (t->nbytes != t->numel * dsv4_st_dtype_size(t->dtype))
      abort();
    total += t->nbytes;
    d[i].name = t->name;
    d[i].dtype = t->dtype;
    d[i].ndim = t->ndim;
    memcpy(d[i].shape, t->shape, sizeof(d[i].shape));
    d[i].nbytes = t->nbytes;
  }
  if (total != v.data_len)
    abort();
  uint8_t *hdr;
  size_t hlen, dlen;
  int rc = dsv4_st_build_header(d, v.n_tensors, v.meta, v.n_meta, &hdr, &hlen, &dlen);
  {
    /* The header written directly is the document's dump, byte for byte. */
    uint8_t *ref = NULL;
    size_t rlen = 0, rdlen = 0;
    int rr = dsv4__st_build_header_reference(d, v.n_tensors, v.meta, v.n_meta, &ref, &rlen, &rdlen);
    if (rr != rc || (rc == 0 && (rlen != hlen || rdlen != dlen || memcmp(ref, hdr, hlen))))
      abort();
    free(ref);
  }
  if (rc == 0) {
    if (dlen != total || hlen % 8 != 0)
      abort();
    uint8_t *again = malloc(hlen + dlen + 1);
    memcpy(again, hdr, hlen);
    memset(again + hlen, 0xA5, dlen);
    dsv4_st_view_t w;
    if (dsv4_st_parse(again, hlen + dlen, &w) != 0 || w.n_tensors != v.n_tensors ||
        w.n_meta != v.n_meta)
      abort();
    for (size_t i = 0; i < v.n_tensors; i++) {
      const dsv4_st_tensor_t *t = dsv4_st_find(&w, v.tensors[i].name);
      if (!t || t->dtype != v.tensors[i].dtype || t->nbytes != v.tensors[i].nbytes)
        abort();
    }
    dsv4_st_view_free(&w);
    free(again);
    free(hdr);
  } else if (rc != DSV4_ETOOBIG) {
    /* What the parser accepts the writer can write, unless padding pushes it past the limit. */
    abort();
  }
  free(d);
  dsv4_st_view_free(&v);
  free(buf);
  return 0;
}
