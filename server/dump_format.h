#ifndef DSV4_SERVER_DUMP_FORMAT_H
#define DSV4_SERVER_DUMP_FORMAT_H

/*
 * The dump file (SPEC §6 GET /admin/v1/dump): a safetensors file with, per served layer L in
 * order, `layers.{L}.records` U8 [T, 584] then `layers.{L}.positions` I64 [T], and __metadata__
 * naming the record layout, the geometry it belongs to (heads, head_offset, the model's id), p0,
 * and per layer the stored range, the §3.1 digest and the state a restore needs (next position,
 * last applied segment). One writer for the streamed dump and the snapshot files, one reader for
 * a restore (PUT /admin/v1/sequences/{seq}) and the snapshots read back at start-up.
 *
 * A layer that runs the compressed branch adds its compressed state after every layer's records
 * and positions (dsv4_dump_ctail, SPEC §8.9).
 *
 * The reader takes nothing on trust and changes nothing: it checks the file strictly (a tensor it
 * does not know, or compressed state of a layer that does not run the branch here, is refused
 * rather than ignored), then the geometry against this daemon's, then every position and digest.
 *
 * Thread affinity: none (pure functions of their arguments); the reader may run on any thread.
 */

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "seqtable.h"

/* The model's id in a dump's metadata `model`: XXH3 (16 hex digits) over what decides a record's
 * bytes and its meaning for later batches: num_attention_heads, the layers with their compress
 * ratios and RoPE frequencies (exact fp32 bits), rms_norm_eps and max_position_embeddings. */
void dsv4_dump_model_id(const dsv4_model_t *m, char out[17]);

/* What a dump's header says about one sequence. Arrays are per dumped layer, ascending. */
typedef struct {
  const char *seq;
  const char *instance;
  const char *model_id;
  uint32_t block_size;
  uint32_t heads, head_offset;
  int64_t p0;
  uint32_t n;                           /* layers in the dump */
  const uint32_t *layer;                /* [n] model layer numbers */
  const int64_t *first, *end;           /* [n] stored range [first, end) */
  const uint64_t *digest;               /* [n] §3.1 sequence digests */
  const dsv4_seq_layer_state_t *layers; /* [n] next and last segment */
  /* [n] the compressed state of each layer (SPEC §8.7; ratio 0 where the layer does not run the
   * branch), or NULL when none does: such a dump is exactly the SWA-only dump. */
  const dsv4_seq_cstate_t *cstate;
} dsv4_dump_desc_t;

/*
 * The file's header: the 8-byte length, the JSON header padded to 8 bytes. *out is malloc'd;
 * *total is the whole file's length. Layer i's records start at offsets[i] (may be NULL) and its
 * positions follow them: records then positions, layer after layer.
 */
int dsv4_dump_header(const dsv4_dump_desc_t *dd, uint8_t **out, size_t *out_len, uint64_t *total,
                     uint64_t *offsets);

/*
 * The compressed part of the file, which follows every layer's records and positions: per layer
 * that runs the branch, `layers.{L}.c_records` U8 [T, 584], `layers.{L}.c_entries` I64 [T] (the
 * entries j), at ratio 4 `layers.{L}.i_records` U8 [T, 68], and `layers.{L}.ring` F32
 * [DSV4_RING_FLOATS(ratio)] (the state slot's ring). Its bytes into *out (malloc'd, *out_len
 * long; 0 and NULL when no layer runs the branch); they end the file dsv4_dump_header describes.
 */
int dsv4_dump_ctail(const dsv4_dump_desc_t *dd, uint8_t **out, size_t *out_len);

/* The digests of one layer's compressed state: the entries' and the index records' (SPEC §3.1
 * with the entry j in place of the position) and the ring's (XXH3 over its little-endian bytes). */
void dsv4_dump_cdigests(const dsv4_seq_cstate_t *cs, uint64_t *c_digest, uint64_t *i_digest,
                        uint64_t *ring_digest);

/* What a restore expects of a dump: this daemon's geometry. */
typedef struct {
  const uint32_t *served_layers; /* ascending */
  uint32_t n_served;
  uint32_t heads, head_offset;
  const char *model_id;
  int64_t max_position;
  /* [n_served] the ratio at which each layer runs the compressed branch (0: it does not), or NULL
   * when none does: the dump must carry exactly those layers' compressed state. */
  const uint32_t *ratio;
} dsv4_dump_expect_t;

/* A dump read for a restore; arrays by served index, records pointing into the caller's buffer. */
typedef struct {
  int64_t p0;
  int64_t first;                   /* the first stored position of every written layer */
  uint32_t block_size;             /* the dump's (0 when it has none): for messages only */
  dsv4_seq_layer_state_t *layers;  /* [n_served] */
  const uint8_t **records;         /* [n_served] positions first .. next - 1, or NULL */
  uint64_t *digest;                /* [n_served] */
  dsv4_seq_cstate_t *cstate;       /* [n_served] pointing into the caller's buffer */
  char seq[DSV4_SEQ_NAME_MAX + 1]; /* the metadata's seq ("" when absent or not a name) */
  /* Why the dump was refused: a sentence, and for DSV4_EGEOMETRY the field with the dump's and
   * this daemon's values, for DSV4_EDIGEST the model layer with both digests. */
  char why[320];
  char field[32];
  char dump_value[96], daemon_value[96];
  int64_t layer; /* -1 when no layer is concerned */
  char expected[17], computed[17];
} dsv4_dump_parsed_t;

/*
 * Read buf[0..len) (a whole dump) for a restore into a daemon with geometry want. Returns 0, or
 * DSV4_EINVAL (not a dump, a tensor or key it does not know or lacks, inconsistent positions or
 * state, a record no batch can write), DSV4_EGEOMETRY (layout, record size, window, heads,
 * head_offset, model or served layers differ; the block size may), DSV4_EDIGEST (a layer's
 * records do not hash to its digest), DSV4_ENOMEM, with out->why and the details set. Free *out
 * with dsv4_dump_parsed_free in every case; buf must outlive it.
 */
int dsv4_dump_parse(const uint8_t *buf, size_t len, const dsv4_dump_expect_t *want,
                    dsv4_dump_parsed_t *out);
void dsv4_dump_parsed_free(dsv4_dump_parsed_t *p);

#endif /* DSV4_SERVER_DUMP_FORMAT_H */
