#ifndef DSV4_SERVER_HTTP_INTERNAL_H
#define DSV4_SERVER_HTTP_INTERNAL_H

/*
 * Entry points of the HTTP layer for tests and fuzzers only; the daemon does not use them.
 */

#include "http.h"

/*
 * Serve an already connected stream socket (one end of a socketpair, say) as a connection of s, as
 * if it had been accepted: the fuzzer feeds raw bytes through it. The fd is owned by s afterwards.
 * Loop thread only.
 */
int dsv4__server_adopt_fd(dsv4_server_t *s, int fd);

#endif /* DSV4_SERVER_HTTP_INTERNAL_H */
