#ifndef DSV4_SERVER_ADMIN_QUERY_H
#define DSV4_SERVER_ADMIN_QUERY_H

/*
 * The admin plane's query strings and path numbers (SPEC §6, README "Admin API"). Strict: a key the
 * route does not take, a key given twice, an empty key or a value that is not what the key expects
 * is DSV4_EINVAL with a message naming the key. Values are percent-decoded ('+' is not a space:
 * no admin value contains one). Whether a layer is served is the caller's check.
 *
 * Thread affinity: none (pure functions of their arguments).
 */

#include <stddef.h>
#include <stdint.h>

#include "seqtable.h"

enum {
  DSV4_AQ_LAYER = 1u,   /* layer=L */
  DSV4_AQ_LAYERS = 2u,  /* layers=a-b (inclusive) or layers=a */
  DSV4_AQ_SEQ = 4u,     /* seq=S */
  DSV4_AQ_REPLACE = 8u, /* replace=0|1 */
};

/* Layer numbers above this are refused as not a layer at all (no model has that many). */
#define DSV4_AQ_MAX_LAYER 1000000u
/* Positions in a path (/tokens/{pos}) above this, the largest of 18 digits, are refused as not a
 * position at all: no model reaches it, and int64 arithmetic on a position stays far from wrapping.
 */
#define DSV4_AQ_MAX_POSITION 999999999999999999ull

typedef struct {
  unsigned have;   /* DSV4_AQ_* of the keys present */
  uint32_t layer;  /* layer=L */
  uint32_t lo, hi; /* layers=a-b, lo <= hi */
  char seq[DSV4_SEQ_NAME_MAX + 1];
  uint32_t seq_len; /* seq=S, a valid sequence name, NUL-terminated in seq */
  int replace;      /* replace=1 */
} dsv4_admin_query_t;

/*
 * Parse query (without the '?', "" when none) allowing only the keys in `allowed`. Returns 0 or
 * DSV4_EINVAL with why (NUL-terminated, truncated to why_len) saying which key and why.
 */
int dsv4_admin_query_parse(const char *query, unsigned allowed, dsv4_admin_query_t *out, char *why,
                           size_t why_len);

#endif /* DSV4_SERVER_ADMIN_QUERY_H */
