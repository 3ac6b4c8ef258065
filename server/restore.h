#ifndef DSV4_SERVER_RESTORE_H
#define DSV4_SERVER_RESTORE_H

/*
 * Sequences that outlive the process (SPEC §6): PUT /admin/v1/sequences/{seq} recreates one from a
 * dump, DELETE /admin/v1/sequences/{seq} drops one from the admin plane (admin_restore.c), and
 * with snapshot_dir a drain writes every live sequence as a dump that the next start restores
 * (snapshot.c). Both paths read a dump with dump_format.c and apply it with dsv4__restore_apply.
 */

#include <jansson.h>

#include "daemon.h"
#include "dump_format.h"
#include "engine_restore.h"
#include "http.h"

/* The route handlers of PUT and DELETE /admin/v1/sequences/{seq} (loop thread). */
void dsv4__admin_on_restore(dsv4_req_t *req, void *ctx);
void dsv4__admin_on_delete(dsv4_req_t *req, void *ctx);

/* The largest dump this daemon can restore: every served layer's records filling the pool, and the
 * largest header the codec takes. A bigger body cannot fit and is refused before it is read. */
uint64_t dsv4__restore_max_body(const dsv4_config_t *cfg);

/* What a dump must match here (want points into model, which must outlive it). Any thread. */
void dsv4__restore_expect(const dsv4_daemon_t *d, dsv4_dump_expect_t *want, char model[17]);

/*
 * Restore a dump read by dsv4_dump_parse as sequence name, then read the restored records back and
 * check that every layer's §3.1 digest is the dump's (a sequence that does not is dropped again:
 * DSV4_EBACKEND). Executor thread. Returns 0 or what dsv4_engine_restore returns, with res filled.
 */
int dsv4__restore_apply(dsv4_daemon_t *d, const char *name, uint32_t len,
                        const dsv4_dump_parsed_t *p, int replace,
                        dsv4_engine_restore_result_t *res);

/* The JSON details of a refused restore (field and values, layer and digests, needed and free,
 * ...), merged into its error answer; NULL when there are none. */
json_t *dsv4__restore_error_details(int rc, const dsv4_dump_parsed_t *p,
                                    const dsv4_engine_restore_result_t *res, const char *seq);

/* Snapshots (snapshot.c), executor thread: write every live sequence to cfg->snapshot_dir (then a
 * manifest), or restore what the manifest there lists. Each logs what it did. */
void dsv4__snapshot_write(dsv4_daemon_t *d);
void dsv4__snapshot_restore(dsv4_daemon_t *d);

#endif /* DSV4_SERVER_RESTORE_H */
