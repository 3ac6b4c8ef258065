#ifndef DSV4_SERVER_ENGINE_RESTORE_H
#define DSV4_SERVER_ENGINE_RESTORE_H

/*
 * The engine's side of a restore (SPEC §6 PUT /admin/v1/sequences/{seq}): a sequence recreated
 * from its state and its stored records, which are placed in freshly allocated blocks, and the
 * state a dump carries for it. The dump's format (its checks, its digests) is the server's
 * business; this file gets the records already verified.
 *
 * Thread affinity: the executor thread only, between batches (like the engine).
 */

#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "seqtable.h"

/* A layer's compressed state (seqtable.h), as dumps carry it. */
typedef dsv4_seq_cstate_t dsv4_engine_cstate_t;

/*
 * Read a live sequence's compressed state at served layer idx into out (malloc'd arrays, freed by
 * dsv4_engine_cstate_free), through the engine's read path (downloads on a device backend). The
 * executor thread between batches: entry blocks and the slot stay while the sequence lives, and
 * nothing rewrites an emitted entry, so the copy is the state at this batch boundary. Returns 0,
 * DSV4_ENOSEQ, DSV4_EEXPIRED, DSV4_ENOMEM or the backend's error.
 */
int dsv4_engine_read_cstate(dsv4_engine_t *e, const char *name, uint32_t len, uint32_t idx,
                            dsv4_engine_cstate_t *out);
void dsv4_engine_cstate_free(dsv4_engine_cstate_t *c);

/* A sequence to restore. Every array is indexed by served layer. */
typedef struct {
  int64_t p0;
  /* The first position every written layer stores (SPEC §3.1 stored range): p0, or the first
   * position of the oldest block its daemon held. */
  int64_t first;
  const dsv4_seq_layer_state_t *layers; /* [n_served] */
  /* [n_served] the records of positions first .. next - 1 of each layer, 584 bytes each and
   * contiguous (NULL for a layer that stores none). */
  const uint8_t *const *records;
  /* [n_served] the compressed state of each layer, whose ratio must be the one this engine runs
   * the branch at (0 where it does not); NULL only when no served layer runs it. */
  const dsv4_engine_cstate_t *cstate;
} dsv4_engine_restore_t;

typedef struct {
  int replaced;          /* a live sequence of the name was replaced */
  int dropped;           /* DSV4_EBACKEND: the sequence replaced was dropped before the failure */
  uint32_t needed, free; /* DSV4_ENOSPC: blocks needed and available (free + what replace frees) */
  char pool[8];          /* DSV4_ENOSPC: the pool short of blocks ("" for swa, "c4", "c128") */
  int sequences_full;    /* DSV4_ENOSPC because of max_sequences */
  uint32_t blocks;       /* on success: blocks the sequence holds */
  char why[256];         /* DSV4_EINVAL / DSV4_EGEOMETRY: why */
} dsv4_engine_restore_result_t;

/*
 * Recreate sequence name from r. All or nothing: every check (a consistent state whose stored
 * records reach every window, the block size's alignment, an existing name, room in the pool and
 * under max_sequences) comes before the first change. Then blocks are taken, the records written
 * (uploaded on a device backend) and the sequence entered. Returns 0, DSV4_EINVAL (an inconsistent
 * state), DSV4_EGEOMETRY (the records start at a position that is not a multiple of this engine's
 * block size: its blocks would hold positions the dump does not have), DSV4_EEXIST (a live
 * sequence and replace 0), DSV4_ENOSPC, DSV4_ENOMEM, or DSV4_EBACKEND when the device failed while
 * the records were written (nothing restored; with replace on a pool that had room only once the
 * old sequence's blocks were back, that sequence is gone too: out->dropped).
 */
int dsv4_engine_restore(dsv4_engine_t *e, const char *name, uint32_t len,
                        const dsv4_engine_restore_t *r, int replace, uint64_t now_ns,
                        dsv4_engine_restore_result_t *out);

/* A live sequence's state (out->layers holds n_served entries), for a dump; DSV4_ENOSEQ /
 * DSV4_EEXPIRED otherwise. */
int dsv4_engine_seq_state(dsv4_engine_t *e, const char *name, uint32_t len, dsv4_seq_state_t *out);

#endif /* DSV4_SERVER_ENGINE_RESTORE_H */
