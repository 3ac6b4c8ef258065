#ifndef DSV4_KVCACHE_RECORDS_H
#define DSV4_KVCACHE_RECORDS_H

/*
 * Logical records and the digests of SPEC §3, §3.1, over a layer's cache buffer in host memory (the
 * CPU backend's buffer, or a device buffer copied back).
 *
 * A logical record is a token's 584 bytes in the order NoPE (448) | RoPE (128) | scales (8). The
 * digests are XXH3_64bits with seed 0 and are compiled only when DSV4_HAVE_XXHASH is defined, so
 * that the rest of kvcache builds on a machine with only the CUDA toolkit.
 *
 * Thread affinity: none (pure functions of their arguments); the seqtable helpers follow the
 * table's.
 */

#include <stddef.h>
#include <stdint.h>

#include "dsv4-layout.h"
#include "pool.h"
#include "seqtable.h"

/* Copy the logical record of slot (block_id * block_size + offset, slot >= 0) out of a layer buffer
 * whose blocks are stride bytes apart. */
void dsv4_record_read(const uint8_t *layer_base, uint32_t block_size, size_t stride, int64_t slot,
                      uint8_t out[DSV4_RECORD_BYTES]);

/*
 * The positions a sequence stores at a served layer, [*first, *end): from max(p0, first position of
 * the oldest held block) to the last position the layer wrote (SPEC §3.1). Empty (*first == *end)
 * when the layer has written nothing.
 */
void dsv4_seq_stored_range(const dsv4_seq_info_t *info, uint32_t block_size, uint32_t layer,
                           int64_t *first, int64_t *end);
/* The slot of position pos in a sequence, or -1 when its block is not held. */
int64_t dsv4_seq_slot(const dsv4_seq_info_t *info, uint32_t block_size, int64_t pos);

/* 16 lowercase hex digits and a NUL, as digests appear in JSON. */
void dsv4_digest_hex(uint64_t digest, char out[17]);

#ifdef DSV4_HAVE_XXHASH

/* The digest of a list of records: XXH3 over [LE int64 position || 584-byte record] in list order,
 * fed one record at a time (the forward cache_digest runs over a batch's slots in token order). */
typedef struct dsv4_records_digest dsv4_records_digest_t;

int dsv4_records_digest_create(dsv4_records_digest_t **out);
void dsv4_records_digest_destroy(dsv4_records_digest_t *d);
/* Start a new, empty list. */
void dsv4_records_digest_reset(dsv4_records_digest_t *d);
void dsv4_records_digest_add(dsv4_records_digest_t *d, int64_t position,
                             const uint8_t record[DSV4_RECORD_BYTES]);
/* Add the record stored at slot, reading it from a layer buffer. */
void dsv4_records_digest_add_slot(dsv4_records_digest_t *d, int64_t position,
                                  const uint8_t *layer_base, uint32_t block_size, size_t stride,
                                  int64_t slot);
/* The digest of the list so far (more records may follow). */
uint64_t dsv4_records_digest_value(const dsv4_records_digest_t *d);

/* Block digest: XXH3 over all stride bytes of block block_id. */
uint64_t dsv4_block_digest(const uint8_t *layer_base, size_t stride, uint32_t block_id);

/*
 * Pool digest of model layer `layer` (the number in the API, not the served index): XOR over the
 * pool's used blocks b of XXH3(LE32 layer || LE32 b || the block's stride bytes). XOR makes it
 * independent of the order blocks were allocated in (like redis DEBUG DIGEST). DSV4_ENOMEM or 0.
 */
int dsv4_pool_digest(const dsv4_pool_t *pool, uint32_t layer, const uint8_t *layer_base,
                     size_t stride, uint64_t *digest);

/*
 * Sequence digest at a served layer (layer_index as the table counts layers): the records of
 * dsv4_seq_stored_range in increasing position, read from that layer's buffer. *n_records (may be
 * NULL) receives how many. DSV4_ENOSEQ / DSV4_EEXPIRED / DSV4_ENOMEM / DSV4_EINVAL (bad layer) or
 * 0.
 */
int dsv4_seq_digest(const dsv4_seqtable_t *st, uint32_t layer_index, const char *name,
                    uint32_t name_len, const uint8_t *layer_base, uint64_t *digest,
                    uint64_t *n_records);

#endif /* DSV4_HAVE_XXHASH */

#endif /* DSV4_KVCACHE_RECORDS_H */
