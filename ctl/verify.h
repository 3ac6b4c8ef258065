#ifndef DSV4_CTL_VERIFY_H
#define DSV4_CTL_VERIFY_H

/*
 * Verification of a dump (GET /admin/v1/dump): a safetensors file whose tensors are, per model
 * layer L, `layers.{L}.records` U8 [T, 584] and `layers.{L}.positions` I64 [T], with `__metadata__`
 * naming the layout, the layer range and each layer's SPEC §3.1 sequence digest `digest.{L}`. Each
 * digest is recomputed from the file: XXH3 over [LE int64 position || 584-byte record] in file
 * order.
 *
 * A layer that ran the compressed branch (SPEC §8.7) also has `layers.{L}.c_records` U8 [T, 584],
 * `layers.{L}.c_entries` I64 [T], at ratio 4 `layers.{L}.i_records` U8 [T, 68], and
 * `layers.{L}.ring` F32, with `c_digest.{L}`, `i_digest.{L}` (SPEC §3.1 with the entry j in place
 * of the position) and `ring_digest.{L}` (XXH3 over the ring's bytes), each recomputed too.
 *
 * Any writer's file in that format verifies (tensor order and header padding are free, so a file
 * re-saved by the Python safetensors package still does). The header is checked strictly: a file
 * that is not exactly this format is an error, not a mismatch.
 *
 * Thread affinity: none.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define DSV4_CTL_VERIFY_ERR_LEN 320

typedef struct {
  uint32_t layer;
  uint64_t records;    /* T */
  int64_t first, last; /* first and last position (when records > 0) */
  char expected[17];   /* digest.{L} from the metadata */
  char computed[17];   /* recomputed from the tensors */
  char problem[192];   /* "" or why the layer's content is inconsistent beyond its digest */
  int ok;              /* expected == computed and no problem (the compressed part's too) */
  /* The compressed branch's state, when the dump carries it for this layer (SPEC §8.7): entries
   * j0 .. j0 + entries - 1 and the c_digest, i_digest (ratio 4: with index records) and
   * ring_digest, each expected from the metadata and recomputed. */
  int compressed, has_index;
  uint64_t entries;
  int64_t j0;
  char c_expected[17], c_computed[17];
  char i_expected[17], i_computed[17];
  char ring_expected[17], ring_computed[17];
} dsv4_ctl_layer_check_t;

typedef struct {
  dsv4_ctl_layer_check_t *layers; /* in layer order */
  size_t n_layers;
  uint64_t file_bytes;
  char seq[136]; /* metadata values, "" when absent */
  char p0[24];
  char instance[40];
  char version[32];
  char error[DSV4_CTL_VERIFY_ERR_LEN]; /* why the file is not a dump (when the call failed) */
} dsv4_ctl_verify_t;

/*
 * Check buf[0..len) (a whole dump). 0: the file is a well-formed dump and *out says, per layer,
 * whether its digest matches. DSV4_EINVAL: not a dump (out->error says why). DSV4_ENOMEM.
 * Release *out with dsv4_ctl_verify_free() in every case.
 */
int dsv4_ctl_verify_buffer(const uint8_t *buf, size_t len, dsv4_ctl_verify_t *out);
/* The same for a file, read through mmap. DSV4_EIO when it cannot be opened or read. */
int dsv4_ctl_verify_file(const char *path, dsv4_ctl_verify_t *out);
void dsv4_ctl_verify_free(dsv4_ctl_verify_t *v);
/* 1 when s is a digest as JSON and metadata write it: 16 lowercase hex digits. */
int dsv4_ctl_is_digest(const char *s);
/* 1 when every layer is ok. */
int dsv4_ctl_verify_all_ok(const dsv4_ctl_verify_t *v);

/* The per-layer table (layer, records, positions, expected, computed, ok), or with json a document
 * {"file", "ok", "seq", "p0", "instance", "layers": [{"layer", "records", "first", "last",
 * "expected", "computed", "ok", "problem"?}]}. */
void dsv4_ctl_verify_print(FILE *out, const char *path, const dsv4_ctl_verify_t *v, int json);

#endif /* DSV4_CTL_VERIFY_H */
