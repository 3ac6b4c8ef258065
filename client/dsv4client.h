#ifndef DSV4_CLIENT_DSV4CLIENT_H
#define DSV4_CLIENT_DSV4CLIENT_H

/*
 * libdsv4client: a client on the daemon's host that shares memory with it (SPEC §6.1). The client
 * creates a region (a sealed memfd, mapped here and registered with the daemon), writes q and kv
 * into it, and asks for a forward naming their offsets; the daemon reads them there and writes
 * q_out, slots, attn and lse at the offsets given. Nothing is copied through a socket: a message
 * each way carries only the metadata.
 *
 * Calls on one client are made one at a time (one request in flight per connection, and the
 * client's message and answer buffers are reused from call to call): use one client per thread,
 * or a lock around its calls. Functions return 0 or a negative errno for the transport (the
 * connection, the memfd); the daemon's answer, success or refusal, is in a dsv4c_result_t.
 */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dsv4c_client dsv4c_client_t;
typedef struct dsv4c_region dsv4c_region_t;

/* Connect to the daemon's listen_shm socket. token: the data plane's bearer token, or NULL. */
int dsv4c_connect(const char *path, const char *token, dsv4c_client_t **out);
/* Close the connection: the daemon unregisters and unmaps its regions. Regions not destroyed
 * before stay mapped here until dsv4c_region_destroy. */
void dsv4c_close(dsv4c_client_t *c);
/*
 * Wait for each answer by polling the socket for up to spin_us microseconds before sleeping in
 * recv (0, the default: sleep at once). A client that calls again and again (a gateway's decode
 * steps) then is not woken by the scheduler for every answer, at the price of a busy core while it
 * waits; pair it with the daemon's busy_poll_us. At most 10,000 µs; larger values are clamped.
 */
void dsv4c_set_spin(dsv4c_client_t *c, uint32_t spin_us);

/* What the daemon answered. */
typedef struct {
  int status;            /* 200, or the HTTP status of the same failure over HTTP */
  char code[48];         /* the error code (SPEC §6), "" on success */
  char message[512];     /* the error message, "" on success */
  char cache_digest[17]; /* forward with outputs naming digest, else "" */
  char attention[8];     /* forward that ran attention: "exact" or "fast", else "" */
  int replayed;          /* forward: 1 for a replay */
  char *json;            /* the whole answer (malloc'd; dsv4c_result_free) */
} dsv4c_result_t;

void dsv4c_result_free(dsv4c_result_t *r);

/*
 * A region of bytes (rounded up to the page size): memfd_create with MFD_ALLOW_SEALING, sized,
 * sealed against shrinking, growing and further seals, mapped, and registered. On a refusal the
 * answer is in *res (when not NULL) and -EPROTO is returned.
 */
int dsv4c_region_create(dsv4c_client_t *c, size_t bytes, dsv4c_region_t **out, dsv4c_result_t *res);
void *dsv4c_region_data(const dsv4c_region_t *r);
size_t dsv4c_region_size(const dsv4c_region_t *r);
/* The daemon's id of the region (in raw messages). */
uint32_t dsv4c_region_id(const dsv4c_region_t *r);
/* Unregister (when the connection is still open), unmap and free. c is the client that created r,
 * or NULL when it is closed (r is then only unmapped); another client's region is -EINVAL and
 * stays as it was (region ids are the connection's own: another connection may hold the same). */
int dsv4c_region_destroy(dsv4c_client_t *c, dsv4c_region_t *r);

/* One segment of a batch (SPEC §4). */
typedef struct {
  const char *seq;
  int64_t start;
  uint32_t len;
  int is_new;
} dsv4c_segment_t;

/*
 * One forward batch whose tensors are in a region: q [N, heads, 512] BF16 at q_off and kv [N, 512]
 * BF16 at kv_off, N the sum of the segments' lengths. The outputs asked for are written at their
 * offsets: q_out [N, heads, 512] BF16, slots [N] I64 (always), attn [N, heads, 512] BF16, lse
 * [N, heads] F32. Offsets are multiples of the element size; 64 keeps every row on a cache line.
 */
typedef struct {
  uint32_t layer;
  const dsv4c_segment_t *segs;
  uint32_t n_segs;
  uint32_t heads;
  const char *outputs;   /* comma list of q, attn, lse, digest; NULL = "q" */
  const char *attention; /* "exact", "fast", or NULL for the daemon's default */
  size_t q_off, kv_off;
  size_t q_out_off, slots_off, attn_off, lse_off;
  int64_t deadline_ms; /* < 0: none */
  /*
   * A compressed layer's tensors (SPEC §8.2), 0 widths meaning absent: ckv F32 [N, ckv_width]
   * (2048 at ratio 4, 1024 at ratio 128) at ckv_off; at ratio 4 (index_heads the model's
   * index_n_heads, 64 on V4-Flash) ikv F32 [N, 512] at ikv_off, iq BF16 [N, index_heads, 128] at
   * iq_off and iw F32 [N, index_heads] at iw_off. With outputs naming topk, the selection I32 [N,
   * index_topk] is written at topk_off.
   */
  uint32_t ckv_width;
  uint32_t index_heads;
  size_t ckv_off, ikv_off, iq_off, iw_off;
  uint32_t index_topk;
  size_t topk_off;
} dsv4c_forward_t;

/* Run one batch. 0 when the daemon answered (res->status says how), else the transport's error;
 * -EINVAL, nothing sent, when r is not c's region. */
int dsv4c_forward(dsv4c_client_t *c, const dsv4c_region_t *r, const dsv4c_forward_t *f,
                  dsv4c_result_t *res);

/*
 * One raw message (JSON text) with a descriptor attached when fd >= 0, and its answer: for
 * requests this library does not build (and for tests of the daemon's refusals).
 */
int dsv4c_request(dsv4c_client_t *c, const char *msg, int fd, dsv4c_result_t *res);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_CLIENT_DSV4CLIENT_H */
