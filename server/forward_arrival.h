#ifndef DSV4_SERVER_FORWARD_ARRIVAL_H
#define DSV4_SERVER_FORWARD_ARRIVAL_H

/*
 * A forward body checked as it arrives (the forward route's body watcher, http.h): once its
 * safetensors header is in, where its tensors lie (q and kv, and on a compressed layer ckv, ikv,
 * iq and iw) and the segments' lengths are read from it, and then each read's new bytes of them
 * are range-checked and hashed (engine.h, dsv4_check_t) on the thread that read them (the event
 * loop, or the bulk thread for a large body) while the client is still sending the rest. The
 * handler's own parse then takes the header as read here, and hands the check to the engine when
 * it finds every tensor where the watcher found it: the engine resumes it, so that its validation
 * is left with what had not arrived checked.
 *
 * A batch of several segments in a body of more than 2 MiB is left to the engine, whose validation
 * spreads the segments over its host threads (forward_arrival.c, SPREAD_BODY_BYTES).
 *
 * A body the watcher cannot follow (a header that does not parse, a layer number that does not, a
 * tensor missing, of another dtype or unaligned, segments that do not parse or add up) is left to
 * the handler's parse and the engine's validation as it is, which answer it as they would have:
 * the watcher never refuses anything. Shapes are the parse's to check: a body it refuses never
 * hands its check on.
 *
 * Thread affinity: begin, take and end on the loop thread; seen on whichever thread reads the
 * body (one at a time, http.h).
 */

#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "forward_parse.h"

typedef struct dsv4_arrival dsv4_arrival_t;

/* A watcher for a body of content_length bytes checked against lim (its heads, max_batch_tokens,
 * max_segments, index_heads, and layer_ratio, which may be called on the bulk thread); NULL when
 * out of memory (the body then goes unwatched). */
dsv4_arrival_t *dsv4_arrival_begin(const dsv4_forward_limits_t *lim, size_t content_length);
/* The body's first `have` bytes are in, at body (the same address every call). */
void dsv4_arrival_seen(dsv4_arrival_t *a, const uint8_t *body, size_t have);
/* The header's view parsed over body, moved into *view (then 1; else 0, *view untouched): the
 * handler's parse of the whole body would make the same one. */
int dsv4_arrival_take_view(dsv4_arrival_t *a, const uint8_t *body, size_t len,
                           dsv4_st_view_t *view);
/* The check begun over p's tensors, taken from a (the caller's to free), when p is the request the
 * watcher followed: the same tensors at the same bytes of the body; else NULL. (The engine uses it
 * only for the same segments.) */
dsv4_check_t *dsv4_arrival_take_check(dsv4_arrival_t *a, const dsv4_forward_req_t *p);
void dsv4_arrival_end(dsv4_arrival_t *a);

#endif
