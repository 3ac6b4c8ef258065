#ifndef DSV4_SERVER_ADMIN_H
#define DSV4_SERVER_ADMIN_H

/*
 * The admin plane's internals shared by admin.c (the read routes, audit, configuration) and
 * admin_dump.c (GET /admin/v1/dump). Loop thread unless a function says otherwise.
 */

#include <jansson.h>

#include "admin_query.h"
#include "daemon.h"

/* The route handler of GET /admin/v1/dump (admin_dump.c). */
void dsv4__admin_on_dump(dsv4_req_t *req, void *ctx);

/*
 * Check a query for a route: parse with the allowed keys, then the served-layer checks (layer,
 * layers). On failure the request has been answered (400 bad_request or unknown_layer) and 1 is
 * returned; 0 when the query is good.
 */
int dsv4__admin_query(dsv4_daemon_t *d, dsv4_req_t *req, unsigned allowed, unsigned required,
                      dsv4_admin_query_t *q);

/* Answer the error of a failed sequence lookup (unknown 404 with instance, expired 410, other). */
void dsv4__admin_seq_error(dsv4_daemon_t *d, dsv4_req_t *req, int rc, const char *seq);

#endif /* DSV4_SERVER_ADMIN_H */
