#ifndef DSV4_SERVER_ERRORS_H
#define DSV4_SERVER_ERRORS_H

/*
 * How the HTTP API answers an error code of kernels/dsv4-error.h (SPEC §6): the status and the JSON
 * error code. This is the one place that gives the codes an HTTP meaning; below server/ they are
 * codes with messages (dsv4_strerror) and nothing more.
 *
 * Thread affinity: none.
 */

typedef struct {
  int status;       /* the HTTP status, e.g. 404 */
  const char *code; /* the JSON error code, e.g. "unknown_sequence" (a static string) */
} dsv4_http_error_t;

/* The answer to err: 500 "internal_error" for a value that is no code of the table. */
dsv4_http_error_t dsv4_http_error(int err);

#endif /* DSV4_SERVER_ERRORS_H */
