#ifndef DSV4_SERVER_SAFETENSORS_H
#define DSV4_SERVER_SAFETENSORS_H

/*
 * A strict safetensors codec (SPEC §6). The parser checks everything the format allows to go wrong
 * (header length, JSON shape, dtypes, shapes, sizes with checked arithmetic, offsets covering the
 * data section exactly once, in order, up to the last byte) and returns a view whose tensor
 * pointers point into the caller's buffer: nothing is copied. The writer produces only the header
 * bytes, so a response can be sent as [header, tensor buffers...] without copying tensor data.
 *
 * Thread affinity: none; a view is read-only after parsing and may be shared.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

/* The JSON header's limit in bytes, not counting the 8-byte length prefix. */
#define DSV4_ST_MAX_HEADER ((size_t)1 << 20)
#define DSV4_ST_MAX_DIMS 8
#define DSV4_ST_ERR_LEN 256

typedef enum {
  DSV4_ST_BF16 = 0,
  DSV4_ST_F32 = 1,
  DSV4_ST_I64 = 2,
  DSV4_ST_I32 = 3,
  DSV4_ST_U8 = 4,
  DSV4_ST_F8_E4M3 = 5,
  /* A checkpoint's tensor of any other safetensors dtype (F16, I8, F8_E8M0, ...): located, never
   * decoded. Only dsv4_st_parse_checkpoint produces it. */
  DSV4_ST_OTHER = -1,
} dsv4_st_dtype_t;

/* Bytes per element (0 for an unknown dtype). */
size_t dsv4_st_dtype_size(int dtype);
/* The dtype's name in the header, e.g. "BF16" (NULL for an unknown dtype). */
const char *dsv4_st_dtype_name(int dtype);
/* The dtype for a header name; DSV4_EINVAL when the name is not one of the six. */
int dsv4_st_dtype_parse(const char *name, int *out);

typedef struct {
  const char *name; /* NUL-terminated; owned by the view */
  int dtype;        /* DSV4_ST_* */
  int ndim;         /* 0 (a scalar) .. DSV4_ST_MAX_DIMS */
  int64_t shape[DSV4_ST_MAX_DIMS];
  size_t numel;        /* product of shape */
  const uint8_t *data; /* into the parsed buffer; not aligned beyond what the sender chose */
  size_t nbytes;       /* numel * dtype size */
  size_t offset;       /* from the start of the data section */
} dsv4_st_tensor_t;

typedef struct {
  const char *key;
  const char *value;
} dsv4_st_meta_t;

typedef struct {
  dsv4_st_tensor_t *tensors; /* in header order */
  size_t n_tensors;
  dsv4_st_meta_t *meta; /* __metadata__ entries in header order */
  size_t n_meta;
  size_t header_len;   /* JSON bytes after the 8-byte prefix */
  const uint8_t *data; /* the data section */
  size_t data_len;
  json_t *doc;   /* the parsed header; owns the name and metadata strings */
  char *strings; /* or, for a header read without a document, the strings' own memory */
  char error[DSV4_ST_ERR_LEN]; /* why parsing failed, naming the tensor and the problem */
  int checkpoint;              /* parsed by dsv4_st_parse_checkpoint */
  int region;                  /* made by dsv4_st_view_region: data is a shared region */
} dsv4_st_view_t;

/*
 * Parse buf[0..len) into *out. On failure returns DSV4_EINVAL (or DSV4_ENOMEM) with out->error set
 * and nothing to free; on success the view must be released with dsv4_st_view_free(). buf must
 * outlive the view.
 */
int dsv4_st_parse(const uint8_t *buf, size_t len, dsv4_st_view_t *out);
/*
 * The same for a published checkpoint file (a model's shard): every safetensors dtype is accepted,
 * those outside the six above as DSV4_ST_OTHER. A request body is never parsed this way.
 */
int dsv4_st_parse_checkpoint(const uint8_t *buf, size_t len, dsv4_st_view_t *out);
/*
 * A view of tensors that live in a shared region (SPEC §6.1) rather than after their header: header
 * is the safetensors header as a JSON object (a reference is taken), its data_offsets count from
 * base, and every tensor must lie inside [0, size), begin on a multiple of its element size and
 * share no byte with another (gaps are allowed). Errors and release as for dsv4_st_parse.
 */
int dsv4_st_view_region(json_t *header, const uint8_t *base, size_t size, dsv4_st_view_t *out);
/*
 * A header of the usual shape (an object of at most 16 tensor entries and "__metadata__", which
 * safetensors.c reads without a document) scanned from its JSON text at text[0..len), its values
 * not yet checked against any data: *out, for dsv4_st_view_region_raw once the region is known.
 * *used receives the bytes the object took (with used NULL, only white space may follow it).
 * DSV4_ST_NOT_USUAL, with nothing to free, for any other text: the caller reads it with jansson.
 * dsv4_st_view_region_raw answers as dsv4_st_view_region does for the same header, and takes raw.
 */
#define DSV4_ST_NOT_USUAL 1
typedef struct dsv4_st_raw dsv4_st_raw_t;
int dsv4_st_scan_header(const char *text, size_t len, size_t *used, dsv4_st_raw_t **out);
int dsv4_st_view_region_raw(dsv4_st_raw_t *raw, const uint8_t *base, size_t size,
                            dsv4_st_view_t *out);
void dsv4_st_raw_free(dsv4_st_raw_t *r);
void dsv4_st_view_free(dsv4_st_view_t *v);
/* A tensor by name, or NULL. */
const dsv4_st_tensor_t *dsv4_st_find(const dsv4_st_view_t *v, const char *name);
/* A __metadata__ value by key, or NULL. */
const char *dsv4_st_meta(const dsv4_st_view_t *v, const char *key);

/* One tensor of a file to write. */
typedef struct {
  const char *name;
  int dtype;
  int ndim;
  int64_t shape[DSV4_ST_MAX_DIMS];
  size_t nbytes; /* must equal product(shape) * dtype size; the writer checks it */
} dsv4_st_desc_t;

/*
 * Build the header for tensors laid out back to back in the order given: the 8-byte length prefix
 * and the JSON header, padded with spaces so the data section starts 8-byte aligned. *out is
 * malloc'd (free() it); *out_len is its length and *data_len the total tensor bytes that must
 * follow. Tensor names and metadata keys must not repeat; no tensor may be named "__metadata__".
 */
int dsv4_st_build_header(const dsv4_st_desc_t *tensors, size_t n_tensors,
                         const dsv4_st_meta_t *meta, size_t n_meta, uint8_t **out, size_t *out_len,
                         size_t *data_len);

/*
 * One tensor's header entry, "name":{"dtype":"BF16","shape":[...],"data_offsets":[begin,end]}, as
 * the writer (and jansson's compact dump) writes it, onto x: for answers that list tensors in
 * another file's form (a shared region's, SPEC §6.1). name must need no escaping.
 */
void dsv4_st_put_entry(FILE *x, const char *name, int dtype, int ndim, const int64_t *shape,
                       size_t begin, size_t end);

/*
 * The same parse and header writer with jansson's document only (the functions above take the
 * usual shapes without one, and must answer exactly as these do): for tests and fuzzers.
 */
int dsv4__st_parse_reference(const uint8_t *buf, size_t len, dsv4_st_view_t *out);
int dsv4__st_build_header_reference(const dsv4_st_desc_t *tensors, size_t n_tensors,
                                    const dsv4_st_meta_t *meta, size_t n_meta, uint8_t **out,
                                    size_t *out_len, size_t *data_len);

#endif /* DSV4_SERVER_SAFETENSORS_H */
