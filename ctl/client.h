#ifndef DSV4_CTL_CLIENT_H
#define DSV4_CTL_CLIENT_H

/*
 * A minimal blocking HTTP/1.1 client for the admin plane: one request per connection (Connection:
 * close), responses parsed by llhttp, bodies either buffered (JSON documents, error answers) or
 * handed chunk by chunk to a sink (dumps, which are never held in memory whole).
 *
 * Thread affinity: none; a call owns its socket from connect to close.
 */

#include <stddef.h>
#include <stdint.h>

#include "args.h"

typedef struct {
  int status;             /* HTTP status */
  int64_t content_length; /* -1 when the response had none */
  char content_type[128]; /* "" when absent */
  char instance[40];      /* Dsv4d-Instance, "" when absent */
  char retry_after[32];   /* Retry-After, "" when absent */
  uint64_t body_bytes;    /* body bytes received (buffered or given to the sink) */
  char *body;             /* buffered body, NUL-terminated (NULL when the sink took it) */
  size_t body_len;
} dsv4_ctl_response_t;

typedef struct {
  /* Called once the headers are in: return 1 to receive the body through on_data, 0 to have it
   * buffered into the response, or a negative error code to stop. */
  int (*on_headers)(void *ud, const dsv4_ctl_response_t *r);
  /* A piece of the body; 0 or a negative error code to stop. */
  int (*on_data)(void *ud, const uint8_t *p, size_t n);
  void *ud;
} dsv4_ctl_sink_t;

typedef struct {
  const dsv4_ctl_url_t *url;
  const char *token;           /* bearer token, or NULL */
  int timeout_ms;              /* connect limit, and the longest wait for any read or write */
  size_t max_buffer;           /* largest body buffered (0: 64 MiB) */
  const dsv4_ctl_sink_t *sink; /* NULL: always buffer */
} dsv4_ctl_request_t;

/*
 * GET base + target (target starts with '/', already encoded). On 0, *resp holds the answer
 * whatever its status (free it with dsv4_ctl_response_free). On failure (no connection, timeout, a
 * response that is not HTTP or ends early, a sink error) returns a negative code with why set and
 * nothing to free: DSV4_EIO, DSV4_ETIMEDOUT, DSV4_ETOOBIG (body past max_buffer), DSV4_ENOMEM, or
 * the sink's.
 */
int dsv4_ctl_get(const dsv4_ctl_request_t *req, const char *target, dsv4_ctl_response_t *resp,
                 char *why, size_t why_len);
/*
 * The same for any method, with a body (body NULL: none, and no Content-Length). An answer that
 * comes before the whole body was sent (a refusal, then the connection closed) is still returned.
 */
int dsv4_ctl_send(const dsv4_ctl_request_t *req, const char *method, const char *target,
                  const uint8_t *body, size_t body_len, dsv4_ctl_response_t *resp, char *why,
                  size_t why_len);
void dsv4_ctl_response_free(dsv4_ctl_response_t *resp);

/*
 * Read a token file: its contents without trailing whitespace. Refused (DSV4_EINVAL, why set) when
 * unreadable, empty, or holding control characters, so a token never breaks the request line.
 * *out is malloc'd.
 */
int dsv4_ctl_read_token(const char *path, char **out, char *why, size_t why_len);

#endif /* DSV4_CTL_CLIENT_H */
