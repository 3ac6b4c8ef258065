#ifndef DSV4_SERVER_ENGINE_ADMIN_H
#define DSV4_SERVER_ENGINE_ADMIN_H

/*
 * The engine's side of the admin plane (SPEC §3.1, §6): counts, sequence snapshots, logical
 * records and the digests, and pins that keep a dump's blocks as they are. Records and digests are
 * the definitions of kvcache/records.h over the engine's cache, read straight from host memory or
 * through dsv4__engine_cache_read, so that they work whatever memory the backend keeps it in.
 *
 * Thread affinity: the executor thread only, between batches (like the engine), except where a
 * function says otherwise.
 */

#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "records.h"

typedef struct {
  uint32_t block_size;
  uint64_t stride;
  uint32_t kv_blocks;
  uint32_t blocks_free;
  uint32_t blocks_pinned_released; /* freed by their sequence, held back by a dump's pins */
  uint32_t sequences;
} dsv4_engine_counts_t;

/* Exact counts (not the relaxed snapshots the loop reads for /metrics). */
void dsv4_engine_counts(dsv4_engine_t *e, dsv4_engine_counts_t *out);
/* Any thread: the geometry the engine was created with. */
uint32_t dsv4_engine_block_size(const dsv4_engine_t *e);

/* Visit every live sequence (see dsv4_seqtable_foreach); next/last_start by served index. */
int dsv4_engine_foreach_seq(dsv4_engine_t *e, dsv4_seq_visit_fn fn, void *arg);

/*
 * Copy the logical records (584 bytes each, SPEC §3) of positions pos .. pos+n-1 at served layer
 * idx into out, using the block table of a sequence snapshot; every position must be in a held
 * block. Reads each block's run of records with two cache reads. DSV4_EINVAL for a position outside
 * the table, DSV4_ENOMEM, or the backend's read error.
 */
int dsv4_engine_read_records(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                             int64_t pos, uint32_t n, uint8_t *out);

/*
 * Add positions pos .. pos+n-1 of a snapshot at served layer idx to a §3.1 records digest
 * (records.h), read straight from the cache.
 */
int dsv4_engine_digest_records(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                               int64_t pos, uint32_t n, dsv4_records_digest_t *d);

/* Several digests fed at once, one job per digest, spread over the backend's host threads when the
 * cache is in host memory (else one after the other). The first failure is returned. */
typedef struct {
  uint32_t idx;
  const dsv4_seq_info_t *info;
  int64_t pos;
  uint32_t n;
  dsv4_records_digest_t *d;
} dsv4_engine_digest_job_t;
int dsv4_engine_digest_records_multi(dsv4_engine_t *e, const dsv4_engine_digest_job_t *jobs,
                                     uint32_t count);

/*
 * The §3.1 sequence digest at served layer idx of a snapshot: its stored records in position order.
 * *first / *end (may be NULL) receive the stored range [first, end).
 */
int dsv4_engine_seq_digest(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                           uint64_t *digest, int64_t *first, int64_t *end);

/*
 * The §3.1 pool digest of served layer idx (model layer `layer` in the hash) and, when
 * block_digests is not NULL, the block digest of every used block b in block_digests[b]
 * (kv_blocks entries; entries of unused blocks are left alone). used[b] (may be NULL) is set to 1
 * for every used block. One read of each used block serves both.
 */
int dsv4_engine_pool_digest(dsv4_engine_t *e, uint32_t idx, uint32_t layer, uint64_t *pool,
                            uint64_t *block_digests, uint8_t *used);

/*
 * One compressed entry of a sequence (SPEC §8.7), for the admin plane's entry inspector: its
 * 584-byte record, at ratio 4 its 68-byte index record (64 value bytes, then the 4 codes), and
 * where it lives. ratio, j0 and j1 are set whenever the layer runs the branch, so that a refusal
 * can say which entries exist.
 */
typedef struct {
  uint32_t ratio;  /* 4 or 128 */
  int64_t j0, j1;  /* the emitted entries [j0, j1): floor(p0 / r) .. floor(next / r) */
  int64_t block;   /* the entry block of the layer's pool (c4 or c128) */
  uint32_t offset; /* the entry's offset in it, j % block_size */
  uint8_t record[DSV4_RECORD_BYTES];
  uint8_t index[DSV4_INDEX_RECORD_BYTES]; /* ratio 4 only */
} dsv4_engine_entry_t;

/*
 * Read entry j of sequence name at served layer idx, given the sequence's snapshot info (its p0
 * and next positions; the caller took it in the same executor turn). Returns 0, DSV4_EINVAL when
 * the layer does not run the branch (out->ratio 0), DSV4_ENOTEMITTED when j is not an emitted
 * entry (outside [out->j0, out->j1)), DSV4_ENOSEQ / DSV4_EEXPIRED, DSV4_ENOMEM or the backend's
 * read error. Reads only: nothing changes.
 */
int dsv4_engine_read_entry(dsv4_engine_t *e, const char *name, uint32_t len, uint32_t idx,
                           const dsv4_seq_info_t *info, int64_t j, dsv4_engine_entry_t *out);

/*
 * Pin the blocks a snapshot holds (its -1 holes skipped), so that a release, a delete or an expiry
 * defers their return to the pool until the unpin: their bytes stay as the snapshot saw them. All
 * or nothing. The unpin takes the same snapshot.
 */
int dsv4_engine_pin(dsv4_engine_t *e, const dsv4_seq_info_t *info);
void dsv4_engine_unpin(dsv4_engine_t *e, const dsv4_seq_info_t *info);

#endif /* DSV4_SERVER_ENGINE_ADMIN_H */
