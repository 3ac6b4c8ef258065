#include "bulk_io.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "dsv4-error.h"

#define DEFAULT_SLICE ((size_t)1 << 20)
/* The buffers of one write call: an answer's head and its tensors (fwd_answer has at most 6). */
#define BULK_IOV 16

struct dsv4_bulk {
  uv_async_t done_async; /* on main: finished jobs wait in outbox */
  uv_loop_t loop;        /* the bulk thread's */
  uv_async_t wake;       /* on the bulk loop: jobs in inbox, a cancel, or stop */
  uv_thread_t thread;
  size_t slice;
  pthread_mutex_t mu;
  dsv4_bulk_job_t *inbox, *outbox; /* under mu */
  int stop;                        /* under mu */
  dsv4_bulk_job_t *active;         /* the bulk thread's: jobs whose poll runs */
  size_t pending;                  /* main's: submitted, callback not yet run */
  int closing;
  void (*close_cb)(void *);
  void *close_arg;
};

/* ---- the bulk thread ------------------------------------------------------------------------ */

/* The job's fd is closed and its result goes back to the submitters' loop. */
static void job_complete(dsv4_bulk_job_t *j) {
  dsv4_bulk_t *b = j->owner;
  close(j->fd);
  j->fd = -1;
  pthread_mutex_lock(&b->mu);
  j->next = b->outbox;
  b->outbox = j;
  pthread_mutex_unlock(&b->mu);
  uv_async_send(&b->done_async);
}

static void on_poll_closed(uv_handle_t *h) {
  job_complete(h->data);
}

/* The job ends with err: off the active list, its poll closed, then complete. */
static void job_finish(dsv4_bulk_job_t *j, int err) {
  dsv4_bulk_t *b = j->owner;
  for (dsv4_bulk_job_t **p = &b->active; *p; p = &(*p)->next)
    if (*p == j) {
      *p = j->next;
      break;
    }
  j->err = err;
  if (!j->poll_open) {
    job_complete(j);
    return;
  }
  j->poll_open = 0;
  uv_poll_stop(&j->poll);
  uv_close((uv_handle_t *)&j->poll, on_poll_closed);
}

/* n bytes moved: past them in bufs. Returns whether the job's bytes are all moved. */
static bool job_advance(dsv4_bulk_job_t *j, size_t n) {
  j->done += n;
  while (j->nb > 0 && n >= j->bufs[0].len) {
    n -= j->bufs[0].len;
    j->bufs++;
    j->nb--;
  }
  if (j->nb == 0)
    return true;
  j->bufs[0].base += n;
  j->bufs[0].len -= n;
  return false;
}

/* One system call's worth of the job, at most budget bytes: what it moved, or -errno. */
static ssize_t job_syscall(dsv4_bulk_job_t *j, size_t budget) {
  if (!j->writing) {
    size_t want = j->bufs[0].len < budget ? j->bufs[0].len : budget;
    ssize_t n = read(j->fd, j->bufs[0].base, want);
    return n < 0 ? -errno : n;
  }
  struct iovec iov[BULK_IOV];
  size_t k = 0;
  for (size_t i = 0; i < j->nb && k < BULK_IOV && budget > 0; i++) {
    if (j->bufs[i].len == 0)
      continue;
    iov[k].iov_base = j->bufs[i].base;
    iov[k].iov_len = j->bufs[i].len < budget ? j->bufs[i].len : budget;
    budget -= iov[k++].iov_len;
  }
  struct msghdr m = {.msg_iov = iov, .msg_iovlen = k};
  ssize_t n = sendmsg(j->fd, &m, MSG_NOSIGNAL);
  return n < 0 ? -errno : n;
}

/* The socket is ready: move up to a slice, then give the other jobs their turn. */
static void on_ready(uv_poll_t *p, int status, int events) {
  (void)events;
  dsv4_bulk_job_t *j = p->data;
  if (status < 0) { /* libuv says UV_EBADF for any POLLERR: the socket's own error says more */
    int e = 0;
    socklen_t len = sizeof(e);
    job_finish(j, getsockopt(j->fd, SOL_SOCKET, SO_ERROR, &e, &len) == 0 && e ? -e : status);
    return;
  }
  size_t budget = j->owner->slice;
  while (budget > 0) {
    ssize_t n = job_syscall(j, budget);
    if (n == -EINTR)
      continue;
    if (n == -EAGAIN || n == -EWOULDBLOCK)
      return;
    if (n < 0 || (n == 0 && !j->writing)) {
      job_finish(j, n < 0 ? (int)n : UV_EOF);
      return;
    }
    budget -= (size_t)n < budget ? (size_t)n : budget;
    const bool all = job_advance(j, (size_t)n);
    if (!j->writing && j->seen)
      j->seen(j);
    if (all) {
      job_finish(j, 0);
      return;
    }
  }
}

static void job_start(dsv4_bulk_t *b, dsv4_bulk_job_t *j) {
  j->next = b->active;
  b->active = j;
  int rc = uv_poll_init(&b->loop, &j->poll, j->fd);
  if (rc != 0) {
    job_finish(j, rc);
    return;
  }
  j->poll.data = j;
  j->poll_open = 1;
  rc = uv_poll_start(&j->poll, j->writing ? UV_WRITABLE : UV_READABLE, on_ready);
  if (rc != 0)
    job_finish(j, rc);
}

/* New jobs start, cancelled ones end; after a stop, the thread's loop ends with its last job. */
static void on_wake(uv_async_t *h) {
  dsv4_bulk_t *b = h->data;
  pthread_mutex_lock(&b->mu);
  dsv4_bulk_job_t *in = b->inbox;
  b->inbox = NULL;
  int stop = b->stop;
  pthread_mutex_unlock(&b->mu);
  while (in) {
    dsv4_bulk_job_t *j = in;
    in = j->next;
    job_start(b, j);
  }
  for (dsv4_bulk_job_t *j = b->active, *next; j; j = next) {
    next = j->next;
    if (atomic_load(&j->cancel))
      job_finish(j, UV_ECANCELED);
  }
  if (stop && !b->active)
    uv_close((uv_handle_t *)&b->wake, NULL);
}

static void bulk_main(void *arg) {
  dsv4_bulk_t *b = arg;
  pthread_setname_np(pthread_self(), "dsv4d-bulk"); /* a name for top -H and /proc/PID/task */
  uv_run(&b->loop, UV_RUN_DEFAULT);
}

/* ---- the submitters' loop ------------------------------------------------------------------- */

static void on_done_closed(uv_handle_t *h) {
  dsv4_bulk_t *b = h->data;
  void (*cb)(void *) = b->close_cb;
  void *arg = b->close_arg;
  pthread_mutex_destroy(&b->mu);
  free(b);
  if (cb)
    cb(arg);
}

/* Every job is back: the thread stops (its loop ends once its wake handle is closed). */
static void bulk_shutdown(dsv4_bulk_t *b) {
  pthread_mutex_lock(&b->mu);
  b->stop = 1;
  pthread_mutex_unlock(&b->mu);
  uv_async_send(&b->wake);
  uv_thread_join(&b->thread);
  uv_loop_close(&b->loop);
  uv_close((uv_handle_t *)&b->done_async, on_done_closed);
}

static void on_done(uv_async_t *h) {
  dsv4_bulk_t *b = h->data;
  pthread_mutex_lock(&b->mu);
  dsv4_bulk_job_t *out = b->outbox;
  b->outbox = NULL;
  pthread_mutex_unlock(&b->mu);
  while (out) {
    dsv4_bulk_job_t *j = out;
    out = j->next;
    b->pending--;
    j->cb(j);
  }
  if (b->closing == 1 && b->pending == 0) {
    b->closing = 2;
    bulk_shutdown(b);
  }
}

int dsv4_bulk_create(uv_loop_t *loop, size_t slice, dsv4_bulk_t **out) {
  dsv4_bulk_t *b = calloc(1, sizeof(*b));
  if (!b)
    return DSV4_ENOMEM;
  b->slice = slice ? slice : DEFAULT_SLICE;
  if (pthread_mutex_init(&b->mu, NULL) != 0) {
    free(b);
    return DSV4_ENOMEM;
  }
  b->wake.data = b;
  b->done_async.data = b;
  if (uv_loop_init(&b->loop) != 0)
    goto no_loop;
  if (uv_async_init(&b->loop, &b->wake, on_wake) != 0)
    goto no_wake;
  if (uv_async_init(loop, &b->done_async, on_done) != 0)
    goto no_done;
  if (uv_thread_create(&b->thread, bulk_main, b) == 0) {
    *out = b;
    return 0;
  }
  /* The submitters' handle closes from their loop, whose callback then frees b. */
  b->closing = 2;
  uv_close((uv_handle_t *)&b->done_async, on_done_closed);
no_done:
  uv_close((uv_handle_t *)&b->wake, NULL);
  uv_run(&b->loop, UV_RUN_DEFAULT);
no_wake:
  (void)uv_loop_close(&b->loop);
no_loop:
  if (b->closing != 2) {
    pthread_mutex_destroy(&b->mu);
    free(b);
  }
  return DSV4_ENOMEM;
}

int dsv4_bulk_submit(dsv4_bulk_t *b, dsv4_bulk_job_t *job) {
  if (b->closing || !job->cb || (job->nb == 0) || (!job->writing && job->nb != 1))
    return DSV4_EINVAL;
  job->owner = b;
  job->done = 0;
  job->err = 0;
  job->poll_open = 0;
  atomic_store(&job->cancel, 0);
  pthread_mutex_lock(&b->mu);
  job->next = b->inbox;
  b->inbox = job;
  pthread_mutex_unlock(&b->mu);
  b->pending++;
  uv_async_send(&b->wake);
  return 0;
}

void dsv4_bulk_cancel(dsv4_bulk_t *b, dsv4_bulk_job_t *job) {
  atomic_store(&job->cancel, 1);
  uv_async_send(&b->wake);
}

void dsv4_bulk_close(dsv4_bulk_t *b, void (*cb)(void *), void *arg) {
  if (b->closing)
    return;
  b->closing = 1;
  b->close_cb = cb;
  b->close_arg = arg;
  if (b->pending == 0) {
    b->closing = 2;
    bulk_shutdown(b);
  }
}
