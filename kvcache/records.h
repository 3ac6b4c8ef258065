#ifndef DSV4_KVCACHE_RECORDS_H
#define DSV4_KVCACHE_RECORDS_H

/*
 * Logical records and the digests of SPEC §3, §3.1: the one definition of how a token's record is
 * read out of a layer's cache, how its fields decode, and how records, blocks and the pool are
 * hashed. The daemon (the forward cache_digest, the admin plane, the dump), dsv4ctl (a dump's
 * verification) and the tests all call these functions, so they cannot drift apart.
 *
 * A logical record is a token's 584 bytes in the order NoPE (448) | RoPE (128) | scales (8). The
 * digests are XXH3_64bits with seed 0 and are compiled only when DSV4_HAVE_XXHASH is defined, so
 * that the rest of kvcache builds on a machine with only the CUDA toolkit.
 *
 * Thread affinity: none (pure functions of their arguments, apart from a layer source's read
 * callback, which the caller owns); the seqtable helpers follow the table's.
 */

#include <stddef.h>
#include <stdint.h>

#include "dsv4-layout.h"
#include "pool.h"
#include "seqtable.h"

#define DSV4__RECORD_TEXT(x) #x
#define DSV4__RECORD_NUMBER(x) DSV4__RECORD_TEXT(x)

/* How the admin plane and a dump's metadata name the record format (SPEC §6); dsv4ctl checks a
 * dump against the same strings. */
#define DSV4_RECORD_LAYOUT "fp8_ds_mla"
#define DSV4_RECORD_FP8 "F8_E4M3FN"
#define DSV4_RECORD_SCALE "UE8M0"
#define DSV4_RECORD_BYTES_TEXT DSV4__RECORD_NUMBER(DSV4_RECORD_BYTES)
#define DSV4_RECORD_WINDOW_TEXT DSV4__RECORD_NUMBER(DSV4_WINDOW)
#define DSV4_RECORD_FIELDS "NoPE(448 e4m3) | RoPE(64 bf16 LE) | scales(7 UE8M0 + 1 pad)"

/* ---- reading records ------------------------------------------------------------------------ */

/*
 * Assemble the logical records of n tokens at consecutive offsets of one block: data points at the
 * first token's NoPE|RoPE bytes (576 per token, contiguous in a block), scales at its scale entry
 * (8 per token, contiguous in the block's tail). Record i goes to out + i * out_stride. Every
 * reader below ends here.
 */
void dsv4_records_gather(const uint8_t *data, const uint8_t *scales, uint32_t n, uint8_t *out,
                         size_t out_stride);

/*
 * The inverse of dsv4_records_gather: n logical records (record i at in + i * in_stride) split into
 * a block's NoPE|RoPE run (576 bytes per token, from data) and its scale run (8 per token, from
 * scales), as a restore places them.
 */
void dsv4_records_scatter(const uint8_t *in, size_t in_stride, uint32_t n, uint8_t *data,
                          uint8_t *scales);

/*
 * Whether a record is one the insert path can write (SPEC §2.2): its seven scale codes within
 * 105..247, its padding byte 0, and no e4m3 NaN byte (0x7f, 0xff) among the NoPE values. NULL when
 * it is, else a static phrase naming what is wrong. A restore refuses any other record: attention
 * over it would read values no batch could have produced.
 */
const char *dsv4_record_implausible(const uint8_t rec[DSV4_RECORD_BYTES]);

/* Copy the logical record of slot (block_id * block_size + offset, slot >= 0) out of a layer buffer
 * in host memory whose blocks are stride bytes apart. */
void dsv4_record_read(const uint8_t *layer_base, uint32_t block_size, size_t stride, int64_t slot,
                      uint8_t out[DSV4_RECORD_BYTES]);

/*
 * One served layer's cache as the readers below see it: in host memory (host set: records are
 * copied straight from it, one copy) or behind a read callback (host NULL: each block's run of
 * NoPE|RoPE bytes and its run of scale entries are fetched with one call each, then assembled).
 * read(arg, layer, off, n, dst) copies n bytes at offset off of the layer to dst and returns 0 or a
 * negative error code; layer is only passed on (the caller's number for the layer).
 */
typedef struct {
  const uint8_t *host;
  int (*read)(void *arg, uint32_t layer, uint64_t off, size_t n, void *dst);
  void *arg;
  uint32_t layer;
  uint32_t block_size;
  size_t stride;
} dsv4_layer_src_t;

/* A source over a layer buffer in host memory. */
dsv4_layer_src_t dsv4_layer_src_host(const uint8_t *layer_base, uint32_t block_size);

/*
 * Copy the logical records of positions pos .. pos+n-1 of a sequence snapshot (its block table)
 * out of a layer, record i at out + i * out_stride. DSV4_EINVAL when a position is not in a held
 * block, DSV4_ENOMEM, or the read callback's error (out is then partly written).
 */
int dsv4_seq_records_read(const dsv4_layer_src_t *src, const dsv4_seq_info_t *info, int64_t pos,
                          uint32_t n, uint8_t *out, size_t out_stride);

/* ---- decoding a record ---------------------------------------------------------------------- */

/* A logical record's fields, decoded for people (the admin plane's token inspector). Doubles hold
 * every value exactly. */
typedef struct {
  const uint8_t *fp8;         /* [448] the NoPE E4M3FN bytes (inside the record) */
  const uint8_t *scale_codes; /* [7] the UE8M0 codes (inside the record) */
  double scales[DSV4_NTILES]; /* 2^(code - 127); NaN for code 255 */
  double nope[DSV4_NOPE_DIM]; /* e4m3 value * its tile's scale; NaN for a NaN byte or scale */
  uint16_t rope_bits[DSV4_ROPE_DIM]; /* the bf16 RoPE values' bits (little-endian in the record) */
  float rope[DSV4_ROPE_DIM];
} dsv4_record_fields_t;

void dsv4_record_decode(const uint8_t rec[DSV4_RECORD_BYTES], dsv4_record_fields_t *out);

/* An index record's fields (SPEC §8.5: 64 bytes of e2m1 nibbles, element 2i in the low nibble of
 * byte i, then the UE8M0 codes of the four 32-blocks), decoded for people (the admin plane's entry
 * inspector). Doubles hold every value exactly. */
typedef struct {
  uint8_t nibbles[128];       /* element i's e2m1 nibble: bit 3 the sign, bits 0..2 the code */
  const uint8_t *scale_codes; /* [4] the UE8M0 codes (inside the record) */
  double scales[4];           /* 2^(code - 127); NaN for code 255 */
  double values[128];         /* the nibble's value * its block's scale; NaN for a NaN scale */
} dsv4_index_fields_t;

void dsv4_index_record_decode(const uint8_t rec[DSV4_INDEX_RECORD_BYTES], dsv4_index_fields_t *out);

/* ---- sequence snapshots --------------------------------------------------------------------- */

/*
 * The positions a sequence stores at a served layer, [*first, *end): from max(p0, first position of
 * the oldest held block) to the last position the layer wrote (SPEC §3.1). Empty (*first == *end)
 * when the layer has written nothing.
 */
void dsv4_seq_stored_range(const dsv4_seq_info_t *info, uint32_t block_size, uint32_t layer,
                           int64_t *first, int64_t *end);
/* The slot of position pos in a sequence, or -1 when its block is not held. */
int64_t dsv4_seq_slot(const dsv4_seq_info_t *info, uint32_t block_size, int64_t pos);

/* A position as the digests hash it and a dump's positions tensor holds it: little-endian int64. */
void dsv4_position_put(uint8_t out[8], int64_t position);

/* ---- digests -------------------------------------------------------------------------------- */

/* 16 lowercase hex digits and a NUL, as digests appear in JSON. */
void dsv4_digest_hex(uint64_t digest, char out[17]);

#ifdef DSV4_HAVE_XXHASH

/* The digest of a list of records: XXH3 over [LE int64 position || 584-byte record] in list order,
 * fed a record or a run of records at a time. */
typedef struct dsv4_records_digest dsv4_records_digest_t;

int dsv4_records_digest_create(dsv4_records_digest_t **out);
void dsv4_records_digest_destroy(dsv4_records_digest_t *d);
/* Start a new, empty list. */
void dsv4_records_digest_reset(dsv4_records_digest_t *d);
void dsv4_records_digest_add(dsv4_records_digest_t *d, int64_t position,
                             const uint8_t record[DSV4_RECORD_BYTES]);
/* SPEC §8.7: an index record of a ratio-4 layer, [LE int64 entry || 68 bytes]. */
void dsv4_records_digest_add_index(dsv4_records_digest_t *d, int64_t entry,
                                   const uint8_t record[DSV4_INDEX_RECORD_BYTES]);
/* Add the record stored at slot, reading it from a layer buffer in host memory (the forward
 * cache_digest runs over a batch's slots in token order). */
void dsv4_records_digest_add_slot(dsv4_records_digest_t *d, int64_t position,
                                  const uint8_t *layer_base, uint32_t block_size, size_t stride,
                                  int64_t slot);
/*
 * Add positions pos .. pos+n-1 of a sequence snapshot, read from a layer (dsv4_seq_records_read):
 * the records land in their [position || record] entries, a group of entries at a time, so each
 * group is one hash update of bytes that stay in L1. 0 or the reader's error.
 */
int dsv4_records_digest_add_seq(dsv4_records_digest_t *d, const dsv4_layer_src_t *src,
                                const dsv4_seq_info_t *info, int64_t pos, uint32_t n);
/* The digest of the list so far (more records may follow). */
uint64_t dsv4_records_digest_value(const dsv4_records_digest_t *d);

/*
 * Sequence digest at a served layer (layer_index as the table counts layers): the records of
 * dsv4_seq_stored_range in increasing position. *first / *end (may be NULL) receive the stored
 * range [first, end). 0, DSV4_ENOMEM or the reader's error.
 */
int dsv4_seq_digest(const dsv4_layer_src_t *src, const dsv4_seq_info_t *info, uint32_t layer_index,
                    uint64_t *digest, int64_t *first, int64_t *end);

/* Block digest: XXH3 over all stride bytes of one block. */
uint64_t dsv4_block_digest(const uint8_t *block, size_t stride);

/*
 * Pool digest of model layer `layer` (the number in the API, not the served index): XOR over the
 * pool's used blocks b of XXH3(LE32 layer || LE32 b || the block's stride bytes). XOR makes it
 * independent of the order blocks were allocated in (like redis DEBUG DIGEST). When block_digests
 * is not NULL, block_digests[b] receives the block digest of every used block b (n_blocks entries;
 * those of unused blocks are left alone); used[b] (may be NULL) is set to 1 for every used block.
 * One read of each used block serves all three. 0, DSV4_ENOMEM or the reader's error.
 */
int dsv4_pool_digest(const dsv4_pool_t *pool, uint32_t layer, const dsv4_layer_src_t *src,
                     uint64_t *digest, uint64_t *block_digests, uint8_t *used);

#endif /* DSV4_HAVE_XXHASH */

#endif /* DSV4_KVCACHE_RECORDS_H */
