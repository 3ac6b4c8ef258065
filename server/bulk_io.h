#pragma once
/*
 * A thread of its own ("dsv4d-bulk") that moves large request bodies from their sockets into
 * memory, and large answers from memory into their sockets, so that the loop thread never copies
 * them: while a prefill's 64 MiB body or answer moves, the loop serves the other connections (a
 * decode's request and answer) at once instead of between 1 MiB slices.
 *
 * A job names a duplicate of a connection's socket, which the bulk thread closes when the job
 * ends, and the bytes to move. The thread runs a libuv loop of its own and moves at most a slice a
 * job in each of its iterations, so that two large transfers share it. The job's callback runs on
 * the loop thread that submitted it. Every function here is for the loop thread only.
 */

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

typedef struct dsv4_bulk dsv4_bulk_t;
typedef struct dsv4_bulk_job dsv4_bulk_job_t;

struct dsv4_bulk_job {
  /* Set by the submitter. */
  int fd;         /* the socket's duplicate: the job's from the submit on, closed at its end */
  int writing;    /* 0: read bufs[0].len bytes into bufs[0].base; 1: write bufs[0 .. nb) */
  uv_buf_t *bufs; /* moved past as bytes go (the bulk thread's until the callback) */
  size_t nb;
  void (*cb)(dsv4_bulk_job_t *job); /* on the loop thread, once, after the fd is closed */
  void *data;
  /* Optional: on the bulk thread, after each read that brought bytes (done counts them). */
  void (*seen)(dsv4_bulk_job_t *job);
  /* Results, for the callback. */
  size_t done; /* bytes moved */
  int err;     /* 0 (all moved), UV_EOF (a read met the end), UV_ECANCELED or a negative errno */
  /* The module's. */
  atomic_int cancel;
  uv_poll_t poll;
  int poll_open;
  dsv4_bulk_job_t *next;
  dsv4_bulk_t *owner;
};

/* Start the thread; completions reach loop. slice: the bytes a job moves in one of the thread's
 * loop iterations at most. 0 or a DSV4_E* code. */
int dsv4_bulk_create(uv_loop_t *loop, size_t slice, dsv4_bulk_t **out);

/* Hand job over: from here until its callback the job, its fd and the memory its bufs name are the
 * bulk thread's. 0, or a DSV4_E* code (then nothing was taken: the fd is still the caller's). */
int dsv4_bulk_submit(dsv4_bulk_t *b, dsv4_bulk_job_t *job);

/* Ask a submitted job to end early: its callback then comes with UV_ECANCELED, unless it ended
 * first. */
void dsv4_bulk_cancel(dsv4_bulk_t *b, dsv4_bulk_job_t *job);

/* Stop the thread and free b once every submitted job's callback has run; cb(arg) then runs from
 * the loop, never inside this call. */
void dsv4_bulk_close(dsv4_bulk_t *b, void (*cb)(void *), void *arg);
