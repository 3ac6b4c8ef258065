#ifndef DSV4_SERVER_SHM_H
#define DSV4_SERVER_SHM_H

/*
 * Shared regions (SPEC §6.1): the zero-copy transport for a client on the same host. The client
 * creates a sealed memfd, passes it over a SOCK_SEQPACKET Unix socket (listen_shm) with SCM_RIGHTS,
 * and then sends forward requests whose tensors are offsets into that region; the daemon reads q
 * where the client wrote it and writes the outputs into the region. Every message is one JSON
 * object each way; the forward request carries the HTTP body's safetensors header with the
 * region as its data section, so it is checked by the same code and answered with the same errors.
 *
 * libuv cannot pass an arbitrary descriptor over a pipe, so the socket is served with plain
 * accept4/recvmsg/send on uv_poll handles. Thread affinity: the loop thread only.
 */

#include <stddef.h>

struct dsv4_daemon;
typedef struct dsv4_shm_server dsv4_shm_server_t;

/*
 * Listen on path (mode 0660, a stale socket file replaced as for listen_unix). Registrations must
 * carry token when it is not NULL. At most max_connections clients at once (0 = no limit). 0, or
 * DSV4_EIO after a "cannot listen" error line, or DSV4_ENOMEM.
 */
int dsv4_shm_listen(struct dsv4_daemon *d, const char *path, const char *token,
                    size_t max_connections, dsv4_shm_server_t **out);
/* Stop accepting (the socket file goes) and close the connections with no request in flight;
 * the others close after their answer. */
void dsv4_shm_drain(dsv4_shm_server_t *s);
/* Connections still open. */
size_t dsv4_shm_connections(const dsv4_shm_server_t *s);
/* Close everything, unregistering and unmapping every region once no request uses it; cb runs
 * when the last handle is closed, and the server is freed. */
void dsv4_shm_close(dsv4_shm_server_t *s, void (*cb)(void *), void *arg);

#endif /* DSV4_SERVER_SHM_H */
