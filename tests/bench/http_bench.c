/*
 * http_bench: what the daemon's HTTP path costs beyond the work itself.
 *
 * Decode batches of N tokens (N sequences of one token each, positions advancing every step) and
 * H heads go to three targets, with the same bytes in the same run.
 *
 * The daemon: POST /v1/forward to the real daemon, started here from the command after "--".
 *
 * The bare server: the same requests to bare_server, a libuv + llhttp server that answers with a
 * body of the daemon's response size and does no work; the ceiling for moving the payload.
 *
 * The CPU op: the CPU backend's map_slots + qkv_insert on the same batches, called in-process
 * without HTTP; the ceiling for the work.
 *
 * The table gives each one's tokens/s and per-batch latency, the daemon's share of each ceiling,
 * and where a daemon batch's time goes by the daemon's own stage timings. Absolute times drift on
 * shared machines, so the targets take turns over several rounds and the ratios are the figures
 * to compare.
 *
 * The load generator is one thread driving a few keep-alive connections over non-blocking sockets
 * (poll), so that on a small machine it takes as little CPU from the server as it can. Each
 * connection owns its own sequences, so at most one batch per sequence is in flight, as a gateway
 * would keep it. Every phase is bounded in time and in requests, and only loopback is used.
 *
 * Usage: http_bench [options] [-- DAEMON COMMAND...], for instance
 *   http_bench -- build/dsv4d --port 0 --admin-port 0 --threads 2 --layers 0-3 --kv-blocks 512
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <llhttp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "bench_daemon.h"
#include "bench_forward.h"

#define MAX_CONNS 16
#define MAX_NS 16
#define RECV_BYTES (1u << 20)
#define ERRBODY_MAX 1024
/* Phases that overrun this many seconds past their own budget are abandoned as a failure. */
#define GRACE_S 60

typedef struct {
  const char *bare_path;
  char **daemon_argv; /* NULL: no daemon run */
  uint32_t ns[MAX_NS];
  int n_ns;
  uint32_t heads;
  int conns;
  double seconds;
  int warmup;
  int rounds;
  long max_requests;
  int layers; /* requests cycle over layers 0..layers-1 at each position */
  int64_t p0;
  unsigned cpu_threads;
  int run_bare, run_cpu;
  int unix_socket;  /* --unix: the daemon and bare_server over Unix sockets */
  const char *attn; /* --attn MODE: outputs=attn in mode exact or fast; NULL: outputs q as before */
  char meta_extra[80]; /* what --attn adds to each request's __metadata__ */
  int verbose;
} opts_t;

static opts_t O = {
    .heads = 64,
    .conns = 2,
    .seconds = 2.0,
    .warmup = 3,
    .rounds = 3,
    .max_requests = 200000,
    .layers = 4,
    .p0 = 0,
    .cpu_threads = 2,
    .run_bare = 1,
    .run_cpu = 1,
};

static void die(const char *fmt, const char *arg) {
  fprintf(stderr, "http_bench: ");
  fprintf(stderr, fmt, arg);
  fputc('\n', stderr);
  exit(1);
}

/* ---- Latency samples ---------------------------------------------------------------------- */

typedef struct {
  uint64_t *v;
  size_t n, cap;
  uint64_t tokens;
  uint64_t elapsed; /* measured windows, added up over the rounds */
} stats_t;

static void stats_add(stats_t *s, uint64_t lat_ns, uint32_t tokens) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 4096;
    uint64_t *p = realloc(s->v, cap * sizeof(*p));
    if (!p)
      die("%s", "out of memory");
    s->v = p;
    s->cap = cap;
  }
  s->v[s->n++] = lat_ns;
  s->tokens += tokens;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

typedef struct {
  double tok_s, p50_us, p99_us, mean_us;
  size_t requests;
  int ok;
} result_t;

/* Nearest-rank percentiles over the measured requests; tokens/s over the measured windows. */
static result_t stats_result(stats_t *s) {
  result_t r = {0};
  if (s->n == 0 || s->elapsed == 0)
    return r;
  qsort(s->v, s->n, sizeof(*s->v), cmp_u64);
  size_t i50 = (s->n * 50 + 99) / 100, i99 = (s->n * 99 + 99) / 100;
  r.p50_us = (double)s->v[(i50 ? i50 : 1) - 1] * 1e-3;
  r.p99_us = (double)s->v[(i99 ? i99 : 1) - 1] * 1e-3;
  r.tok_s = (double)s->tokens / ((double)s->elapsed * 1e-9);
  double sum = 0;
  for (size_t i = 0; i < s->n; i++)
    sum += (double)s->v[i];
  r.mean_us = sum / (double)s->n * 1e-3;
  r.requests = s->n;
  r.ok = 1;
  return r;
}

/* ---- Batches -------------------------------------------------------------------------------- */

/* The response size the daemon would give when it has not told us: q_out, slots and a header. */
static size_t expected_response_bytes(uint32_t n, uint32_t heads) {
  return (size_t)n * heads * DSV4_HEAD_DIM * 2 + (size_t)n * 8 + 8 + 200;
}

/* ---- Connections ---------------------------------------------------------------------------- */

enum { C_IDLE, C_SENDING, C_RECEIVING, C_DONE };

typedef struct conn {
  int fd;
  int state;
  int id;
  llhttp_t parser;
  int status;
  int complete;
  char errbody[ERRBODY_MAX + 1];
  size_t errbody_len;
  uint64_t content_length;
  /* The request being sent: head (HTTP head + safetensors header) then the shared tensor bytes. */
  char *head;
  size_t head_cap;
  struct iovec iov[2];
  int iovcnt;
  size_t to_send, sent;
  uint64_t t_start;
  /* Per-connection progress through the phase. */
  long step;
  long done_requests;
  uint32_t del_next;
} conn_t;

static llhttp_settings_t rsettings;
static char *recv_buf;

static int on_r_begin(llhttp_t *p) {
  conn_t *c = p->data;
  c->status = 0;
  c->errbody_len = 0;
  c->complete = 0;
  return 0;
}

static int on_r_headers(llhttp_t *p) {
  conn_t *c = p->data;
  c->status = llhttp_get_status_code(p);
  c->content_length = p->content_length;
  return 0;
}

static int on_r_body(llhttp_t *p, const char *at, size_t n) {
  conn_t *c = p->data;
  /* Only the start of a body is kept: enough for an error message and a sanity check. */
  size_t room = ERRBODY_MAX - c->errbody_len;
  if (n > room)
    n = room;
  memcpy(c->errbody + c->errbody_len, at, n);
  c->errbody_len += n;
  c->errbody[c->errbody_len] = '\0';
  return 0;
}

static int on_r_complete(llhttp_t *p) {
  conn_t *c = p->data;
  c->complete = 1;
  return 0;
}

/* A non-blocking connection to t (TCP_NODELAY on TCP), or -1. */
static int connect_target(const bench_target_t *t) {
  int fd = bench_connect(t);
  if (fd < 0)
    return -1;
  int one = 1;
  if (!t->path[0])
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

static void conn_reserve(conn_t *c, size_t need) {
  if (need <= c->head_cap)
    return;
  char *p = realloc(c->head, need);
  if (!p)
    die("%s", "out of memory");
  c->head = p;
  c->head_cap = need;
}

static void conn_start(conn_t *c, size_t head_len, const uint8_t *data, size_t data_len) {
  c->iov[0].iov_base = c->head;
  c->iov[0].iov_len = head_len;
  c->iov[1].iov_base = (void *)data;
  c->iov[1].iov_len = data_len;
  c->iovcnt = data_len ? 2 : 1;
  c->to_send = head_len + data_len;
  c->sent = 0;
  c->state = C_SENDING;
  c->complete = 0;
  c->t_start = now_ns();
}

/* Advance a connection; returns -1 on a socket or protocol failure. */
static int conn_io(conn_t *c, short revents) {
  if (revents & POLLNVAL)
    return -1;
  if (c->state == C_SENDING && (revents & (POLLOUT | POLLERR | POLLHUP))) {
    while (c->sent < c->to_send) {
      ssize_t w = writev(c->fd, c->iov, c->iovcnt);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
          return 0;
        if (errno == EINTR)
          continue;
        return -1;
      }
      c->sent += (size_t)w;
      size_t k = (size_t)w;
      for (int i = 0; i < c->iovcnt && k; i++) {
        size_t m = k < c->iov[i].iov_len ? k : c->iov[i].iov_len;
        c->iov[i].iov_base = (char *)c->iov[i].iov_base + m;
        c->iov[i].iov_len -= m;
        k -= m;
      }
    }
    c->state = C_RECEIVING;
    return 0;
  }
  if (c->state == C_RECEIVING && (revents & (POLLIN | POLLERR | POLLHUP))) {
    for (;;) {
      ssize_t r = recv(c->fd, recv_buf, RECV_BYTES, 0);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
          return 0;
        if (errno == EINTR)
          continue;
        return -1;
      }
      if (r == 0)
        return -1; /* the server closed a keep-alive connection mid-exchange */
      if (llhttp_execute(&c->parser, recv_buf, (size_t)r) != HPE_OK)
        return -1;
      if (c->complete) {
        c->state = C_DONE;
        return 0;
      }
    }
  }
  return 0;
}

/* ---- One target (daemon or bare server) ---------------------------------------------------- */

typedef struct {
  int is_daemon;
  uint32_t n;
  const uint8_t *tensors;
  size_t tensors_len;
  size_t resp_bytes; /* Bench-Response-Bytes sent with every forward request */
  int round;
  size_t seen_resp_bytes;
  stats_t *st;
  uint64_t t_last; /* the last measured completion */
  conn_t conns[MAX_CONNS];
} run_t;

/* Build the next forward request of connection c: step k is layer k % layers at p0 + k / layers. */
static void build_forward(run_t *R, conn_t *c) {
  conn_reserve(c, 1024 + (size_t)R->n * 96);
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "r%db%uc%d", R->round, R->n, c->id);
  size_t h = bench_forward_head(c->head, c->head_cap, prefix, R->n, O.heads,
                                (int)(c->step % O.layers), O.p0 + c->step / O.layers, c->step == 0,
                                R->tensors_len, R->resp_bytes, O.meta_extra);
  if (!h)
    die("%s", "request header buffer too small");
  conn_start(c, h, R->tensors, R->tensors_len);
}

static void build_delete(run_t *R, conn_t *c, uint32_t i) {
  conn_reserve(c, 512);
  int h = snprintf(c->head, c->head_cap,
                   "DELETE /v1/sequences/r%db%uc%ds%u HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   "Content-Length: 0\r\n\r\n",
                   R->round, R->n, c->id, i);
  conn_start(c, (size_t)h, NULL, 0);
}

enum { PH_WARMUP, PH_MEASURE, PH_DELETE };

/* Check a finished forward response; prints why and returns -1 when it is not a success. */
static int check_forward(run_t *R, conn_t *c) {
  if (c->status != 200) {
    fprintf(stderr, "http_bench: %s answered %d to a forward of %u tokens: %s\n",
            R->is_daemon ? "daemon" : "bare server", c->status, R->n, c->errbody);
    if (strstr(c->errbody, "kv_pool_exhausted"))
      fprintf(stderr,
              "http_bench: blocks are released only once every served layer has moved "
              "on: serve layers 0..%d (--layers), and give --kv-blocks >= 3 * conns * N\n",
              O.layers - 1);
    return -1;
  }
  if (R->is_daemon && !R->seen_resp_bytes) {
    /* The first answer shows the real response size, which the bare server then reproduces. */
    const char *want = O.attn ? "\"attn\"" : "\"q_out\"";
    if (!strstr(c->errbody + (c->errbody_len > 8 ? 8 : c->errbody_len), want)) {
      fprintf(stderr, "http_bench: daemon response has no %s tensor\n", want);
      return -1;
    }
    R->seen_resp_bytes = (size_t)c->content_length;
  }
  return 0;
}

/* Drive every connection through one phase. Returns 0, or -1 on any failure. */
static int run_phase(run_t *R, int phase, uint64_t deadline) {
  struct pollfd pf[MAX_CONNS];
  int active = 0;
  uint64_t hard = (phase == PH_MEASURE ? deadline : now_ns()) + (uint64_t)GRACE_S * 1000000000u;
  long total = 0;
  for (int i = 0; i < O.conns; i++) {
    conn_t *c = &R->conns[i];
    c->done_requests = 0;
    c->del_next = 0;
    if (phase == PH_DELETE) {
      if (c->del_next < R->n)
        build_delete(R, c, c->del_next++);
    } else {
      build_forward(R, c);
    }
    active++;
  }
  while (active > 0) {
    int n = 0;
    int map[MAX_CONNS];
    for (int i = 0; i < O.conns; i++) {
      conn_t *c = &R->conns[i];
      if (c->state != C_SENDING && c->state != C_RECEIVING)
        continue;
      pf[n].fd = c->fd;
      pf[n].events = c->state == C_SENDING ? POLLOUT : POLLIN;
      pf[n].revents = 0;
      map[n++] = i;
    }
    int pr = poll(pf, (nfds_t)n, 1000);
    if (pr < 0 && errno != EINTR)
      return -1;
    if (now_ns() > hard) {
      fprintf(stderr, "http_bench: a phase overran its time bound (N = %u)\n", R->n);
      return -1;
    }
    for (int k = 0; k < n && pr > 0; k++) {
      if (!pf[k].revents)
        continue;
      conn_t *c = &R->conns[map[k]];
      if (conn_io(c, pf[k].revents)) {
        fprintf(stderr, "http_bench: connection %d failed (%s)\n", c->id,
                errno ? strerror(errno) : "closed");
        return -1;
      }
      if (c->state != C_DONE)
        continue;
      uint64_t t = now_ns();
      c->state = C_IDLE;
      int more = 0;
      if (phase == PH_DELETE) {
        if (c->status < 200 || c->status > 299) {
          fprintf(stderr, "http_bench: DELETE answered %d: %s\n", c->status, c->errbody);
          return -1;
        }
        if (c->del_next < R->n) {
          build_delete(R, c, c->del_next++);
          more = 1;
        }
      } else {
        if (check_forward(R, c))
          return -1;
        c->step++;
        c->done_requests++;
        total++;
        if (phase == PH_WARMUP) {
          more = c->done_requests < O.warmup;
        } else {
          stats_add(R->st, t - c->t_start, R->n);
          R->t_last = t;
          more = t < deadline && total < O.max_requests;
        }
        if (more)
          build_forward(R, c);
      }
      if (!more)
        active--;
    }
  }
  return 0;
}

/*
 * One round of one target for one N: connect, warm up, measure (samples added to st, stage
 * timings to stages when given), delete the round's sequences, disconnect.
 */
static int run_target(const bench_target_t *t, int is_daemon, int round, uint32_t n,
                      const uint8_t *tensors, size_t tlen, size_t resp_bytes, stats_t *st,
                      size_t *seen_resp, stages_t *stages) {
  run_t *R = calloc(1, sizeof(*R));
  if (!R)
    die("%s", "out of memory");
  R->is_daemon = is_daemon;
  R->n = n;
  R->tensors = tensors;
  R->tensors_len = tlen;
  R->resp_bytes = resp_bytes;
  R->round = round;
  R->st = st;
  int rc = 0;
  for (int i = 0; i < O.conns; i++) {
    conn_t *c = &R->conns[i];
    c->id = i;
    c->fd = connect_target(t);
    if (c->fd < 0) {
      char name[128];
      fprintf(stderr, "http_bench: cannot connect to %s: %s\n",
              bench_target_name(t, name, sizeof(name)), strerror(errno));
      rc = -1;
      break;
    }
    llhttp_init(&c->parser, HTTP_RESPONSE, &rsettings);
    c->parser.data = c;
  }
  if (rc == 0)
    rc = run_phase(R, PH_WARMUP, 0);
  stages_t s0, s1;
  int have_stages = is_daemon && stages && rc == 0 && scrape_stages(t, &s0) == 0;
  if (rc == 0) {
    uint64_t t0 = now_ns();
    rc = run_phase(R, PH_MEASURE, t0 + (uint64_t)(O.seconds * 1e9));
    if (rc == 0 && R->t_last > t0)
      st->elapsed += R->t_last - t0;
  }
  if (have_stages && rc == 0 && scrape_stages(t, &s1) == 0) {
    for (int k = 0; k < N_STAGES; k++) {
      stages->sum[k] += s1.sum[k] - s0.sum[k];
      stages->count[k] += s1.count[k] - s0.count[k];
    }
    stages->req_sum += s1.req_sum - s0.req_sum;
    stages->req_count += s1.req_count - s0.req_count;
    stages->ok = 1;
  }
  if (rc == 0)
    rc = run_phase(R, PH_DELETE, 0);
  if (seen_resp)
    *seen_resp = R->seen_resp_bytes;
  for (int i = 0; i < O.conns; i++) {
    if (R->conns[i].fd > 0)
      close(R->conns[i].fd);
    free(R->conns[i].head);
  }
  free(R);
  return rc;
}

/* ---- Child processes ------------------------------------------------------------------------ */

static bench_daemon_t daemon_child = {.prog = "http_bench", .pid = -1};
static pid_t bare_pid = -1;

static void stop_children(void) {
  stop_child(&daemon_child.pid);
  stop_child(&bare_pid);
}

/*
 * Start bare_server on a loopback TCP port, or on the Unix socket unix_path when it is not NULL;
 * its first line on stdout is the bound port (or the path). Returns the port (0 for a Unix socket)
 * or -1.
 */
static int start_bare(const char *path, const char *unix_path) {
  int pfd[2];
  if (pipe(pfd))
    die("pipe: %s", strerror(errno));
  bare_pid = fork();
  if (bare_pid < 0)
    die("fork: %s", strerror(errno));
  if (bare_pid == 0) {
    dup2(pfd[1], 1);
    close(pfd[0]);
    close(pfd[1]);
    if (unix_path)
      execl(path, path, "--unix", unix_path, (char *)NULL);
    else
      execl(path, path, "--port", "0", (char *)NULL);
    fprintf(stderr, "exec %s: %s\n", path, strerror(errno));
    _exit(127);
  }
  close(pfd[1]);
  char buf[160];
  size_t have = 0;
  uint64_t until = now_ns() + 10ull * 1000000000u;
  while (have < sizeof(buf) - 1 && now_ns() < until) {
    struct pollfd p = {.fd = pfd[0], .events = POLLIN};
    if (poll(&p, 1, 200) <= 0)
      continue;
    ssize_t r = read(pfd[0], buf + have, sizeof(buf) - 1 - have);
    if (r <= 0)
      break;
    have += (size_t)r;
    buf[have] = '\0';
    if (strchr(buf, '\n'))
      break;
  }
  close(pfd[0]);
  buf[have] = '\0';
  if (unix_path) {
    buf[strcspn(buf, "\n")] = '\0';
    if (strcmp(buf, unix_path) == 0)
      return 0;
    fprintf(stderr, "http_bench: bare server %s did not listen on %s\n", path, unix_path);
    return -1;
  }
  int port = atoi(buf);
  if (port <= 0) {
    fprintf(stderr, "http_bench: bare server %s did not print its port\n", path);
    return -1;
  }
  return port;
}

/* ---- The CPU op alone ---------------------------------------------------------------------- */

/* The CPU op alone (bench_forward.h) on the same batches, timed step by step after a warm-up. */
static int run_cpu(uint32_t n, const uint8_t *tensors, stats_t *st) {
  bench_cpu_op_t op;
  if (bench_cpu_op_open(&op, n, O.heads, O.cpu_threads, "http_bench", O.attn != NULL, O.p0))
    return -1;
  int rc = 0;
  uint64_t t0 = 0, deadline = 0;
  size_t n0 = st->n;
  for (long step = 0; rc == 0; step++) {
    if (step == O.warmup) {
      t0 = now_ns();
      deadline = t0 + (uint64_t)(O.seconds * 1e9);
    }
    uint64_t t = now_ns();
    rc = bench_cpu_op_step(&op, tensors, O.p0 + step);
    if (rc) {
      fprintf(stderr, "http_bench: cpu op failed: %s\n", dsv4_strerror(rc));
      break;
    }
    uint64_t t1 = now_ns();
    if (step >= O.warmup) {
      stats_add(st, t1 - t, n);
      if (t1 >= deadline || (long)(st->n - n0) >= O.max_requests) {
        st->elapsed += t1 - t0;
        break;
      }
    }
  }
  bench_cpu_op_close(&op);
  return rc ? -1 : 0;
}

/* ---- Main ----------------------------------------------------------------------------------- */

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [options] [-- DAEMON COMMAND...]\n"
          "  --tokens 1,16,64     batch sizes N (N sequences of one token each)\n"
          "  --heads H            query heads per token (64); must match the daemon's heads\n"
          "  --conns C            keep-alive connections (2), each with its own N sequences\n"
          "  --seconds S          measured time per N, target and round (2)\n"
          "  --rounds R           rounds; the targets take turns in each (3)\n"
          "  --warmup W           unmeasured requests per connection first (3)\n"
          "  --max-requests M     measured requests per N, target and round at most (200000)\n"
          "  --layers L           cycle over layers 0..L-1 at each position (4); the daemon\n"
          "                       must serve exactly these, or its blocks are never released\n"
          "  --start P            first position of every sequence (0)\n"
          "  --cpu-threads T      CPU backend threads for the cpu op ceiling (2)\n"
          "  --bare PATH          bare_server binary (default: beside this program)\n"
          "  --no-bare, --no-cpu  skip a ceiling\n"
          "  --unix               the daemon (with --listen-unix added to its command) and\n"
          "                       bare_server over Unix sockets instead of loopback TCP\n"
          "  --attn MODE          ask for outputs=attn in MODE (exact or fast) instead of q; the\n"
          "                       daemon gets --weights with sinks for H heads of layers\n"
          "                       0..L-1, which must be SWA-only (V4-Flash: --layers 2 here\n"
          "                       and --layers 0-1 for the daemon); the cpu op then attends too\n"
          "Without a daemon command only the ceilings run. The daemon must be started with\n"
          "--port 0 (its data port is read from its log) and enough --kv-blocks for\n"
          "3 * C * max(N) sequences' blocks.\n",
          argv0);
  exit(2);
}

static void parse_args(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--") == 0) {
      if (i + 1 < argc)
        O.daemon_argv = argv + i + 1;
      return;
    } else if (strcmp(a, "--no-bare") == 0) {
      O.run_bare = 0;
    } else if (strcmp(a, "--unix") == 0) {
      O.unix_socket = 1;
    } else if (strcmp(a, "--no-cpu") == 0) {
      O.run_cpu = 0;
    } else if (!v) {
      usage(argv[0]);
    } else if (strcmp(a, "--tokens") == 0) {
      O.n_ns = 0;
      for (const char *p = v; *p && O.n_ns < MAX_NS;) {
        char *end;
        unsigned long n = strtoul(p, &end, 10);
        if (end == p || n < 1 || n > 16384)
          usage(argv[0]);
        O.ns[O.n_ns++] = (uint32_t)n;
        p = *end == ',' ? end + 1 : end;
      }
      i++;
    } else if (strcmp(a, "--heads") == 0) {
      O.heads = (uint32_t)atoi(v), i++;
    } else if (strcmp(a, "--conns") == 0) {
      O.conns = atoi(v), i++;
    } else if (strcmp(a, "--seconds") == 0) {
      O.seconds = atof(v), i++;
    } else if (strcmp(a, "--rounds") == 0) {
      O.rounds = atoi(v), i++;
    } else if (strcmp(a, "--warmup") == 0) {
      O.warmup = atoi(v), i++;
    } else if (strcmp(a, "--max-requests") == 0) {
      O.max_requests = atol(v), i++;
    } else if (strcmp(a, "--layers") == 0) {
      O.layers = atoi(v), i++;
    } else if (strcmp(a, "--start") == 0) {
      O.p0 = atoll(v), i++;
    } else if (strcmp(a, "--cpu-threads") == 0) {
      O.cpu_threads = (unsigned)atoi(v), i++;
    } else if (strcmp(a, "--bare") == 0) {
      O.bare_path = v, i++;
    } else if (strcmp(a, "--attn") == 0) {
      if (strcmp(v, "exact") != 0 && strcmp(v, "fast") != 0)
        usage(argv[0]);
      O.attn = v, i++;
      snprintf(O.meta_extra, sizeof(O.meta_extra), ",\"outputs\":\"attn\",\"attention\":\"%s\"", v);
    } else {
      usage(argv[0]);
    }
  }
}

static void on_fatal_signal(int sig) {
  /* Leave no server behind when interrupted. */
  if (daemon_child.pid > 0)
    kill(daemon_child.pid, SIGKILL);
  if (bare_pid > 0)
    kill(bare_pid, SIGKILL);
  signal(sig, SIG_DFL);
  raise(sig);
}

/* A copy of the daemon's command (freed with free) with option opt and its value added. */
static char **with_option(char **argv, char *opt, char *value) {
  int n = 0;
  while (argv[n])
    n++;
  char **v = calloc((size_t)n + 3, sizeof(*v));
  if (!v)
    die("%s", "out of memory");
  memcpy(v, argv, (size_t)n * sizeof(*v));
  v[n] = opt;
  v[n + 1] = value;
  return v;
}

/*
 * For --attn: a safetensors checkpoint at path with layers.L.attn.attn_sink, F32 [H], for the
 * layers the bench cycles over, the sinks spread over [-2, 2] as the cpu op's are.
 */
static void write_sinks(const char *path) {
  char hdr[8192];
  size_t j = 1, bytes = (size_t)O.heads * sizeof(float);
  hdr[0] = '{';
  for (int l = 0; l < O.layers && j < sizeof(hdr) - 256; l++)
    j += (size_t)snprintf(hdr + j, sizeof(hdr) - j,
                          "%s\"layers.%d.attn.attn_sink\":{\"dtype\":\"F32\",\"shape\":[%u],"
                          "\"data_offsets\":[%zu,%zu]}",
                          l ? "," : "", l, O.heads, (size_t)l * bytes, (size_t)(l + 1) * bytes);
  hdr[j++] = '}';
  while (j % 8)
    hdr[j++] = ' ';
  FILE *f = fopen(path, "wb");
  if (!f)
    die("cannot write the sinks checkpoint: %s", strerror(errno));
  uint8_t len[8];
  for (int b = 0; b < 8; b++)
    len[b] = (uint8_t)(((uint64_t)j >> (8 * b)) & 0xFF);
  int ok = fwrite(len, 1, 8, f) == 8 && fwrite(hdr, 1, j, f) == j;
  for (int l = 0; ok && l < O.layers; l++)
    for (uint32_t h = 0; ok && h < O.heads; h++) {
      float x = O.heads > 1 ? -2.0f + 4.0f * (float)h / (float)(O.heads - 1) : 0.0f;
      ok = fwrite(&x, sizeof(x), 1, f) == 1; /* little-endian hosts only, like the daemon */
    }
  if (fclose(f) != 0 || !ok)
    die("cannot write the sinks checkpoint: %s", strerror(errno));
}

/*
 * Where the two servers listen. With --unix both get a Unix socket in a fresh folder (sockdir,
 * removed at the end) and the daemon's command gets --listen-unix; its TCP data port stays open but
 * unused. Returns the daemon's command, or NULL for none.
 */
static char **plan_targets(bench_target_t *dt, bench_target_t *bt, char *sockdir, size_t len,
                           char *weights) {
  if (!O.unix_socket && !O.attn)
    return O.daemon_argv;
  snprintf(sockdir, len, "/tmp/http_bench_XXXXXX");
  if (!mkdtemp(sockdir))
    die("cannot create a socket folder: %s", strerror(errno));
  char **argv = O.daemon_argv;
  if (O.unix_socket) {
    snprintf(dt->path, sizeof(dt->path), "%s/dsv4d.sock", sockdir);
    snprintf(bt->path, sizeof(bt->path), "%s/bare.sock", sockdir);
    argv = argv ? with_option(argv, "--listen-unix", dt->path) : NULL;
  }
  if (O.attn && argv) {
    snprintf(weights, len, "%s/sinks.safetensors", sockdir);
    write_sinks(weights);
    char **a = with_option(argv, "--weights", weights);
    if (argv != O.daemon_argv)
      free(argv);
    argv = a;
  }
  return argv;
}

static void fmt_pct(char *buf, size_t n, const result_t *a, const result_t *b) {
  if (a->ok && b->ok && b->tok_s > 0)
    snprintf(buf, n, "%.1f%%", 100.0 * a->tok_s / b->tok_s);
  else
    snprintf(buf, n, "-");
}

static void fmt_res(char *buf, size_t n, const result_t *r) {
  if (r->ok)
    snprintf(buf, n, "%10.0f %9.0f %9.0f", r->tok_s, r->p50_us, r->p99_us);
  else
    snprintf(buf, n, "%10s %9s %9s", "-", "-", "-");
}

int main(int argc, char **argv) {
  static const uint32_t default_ns[] = {1, 16, 64};
  parse_args(argc, argv);
  if (O.n_ns == 0) {
    memcpy(O.ns, default_ns, sizeof(default_ns));
    O.n_ns = 3;
  }
  if (O.heads < 1 || O.heads > DSV4_MAX_HEADS || O.conns < 1 || O.conns > MAX_CONNS ||
      O.seconds <= 0 || O.seconds > 600 || O.rounds < 1 || O.rounds > 100 || O.warmup < 1 ||
      O.layers < 1 || O.p0 < 0 || O.max_requests < 1)
    usage(argv[0]);
  static char bare_default[PATH_MAX];
  if (!O.bare_path) {
    ssize_t r = readlink("/proc/self/exe", bare_default, sizeof(bare_default) - 32);
    if (r <= 0)
      die("%s", "cannot find this program's folder; pass --bare");
    bare_default[r] = '\0';
    char *slash = strrchr(bare_default, '/');
    strcpy(slash ? slash + 1 : bare_default, "bare_server");
    O.bare_path = bare_default;
  }
  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, on_fatal_signal);
  signal(SIGTERM, on_fatal_signal);
  atexit(stop_children);

  llhttp_settings_init(&rsettings);
  rsettings.on_message_begin = on_r_begin;
  rsettings.on_headers_complete = on_r_headers;
  rsettings.on_body = on_r_body;
  rsettings.on_message_complete = on_r_complete;
  recv_buf = malloc(RECV_BYTES);
  if (!recv_buf)
    die("%s", "out of memory");

  result_t res[MAX_NS][3];
  stats_t st[MAX_NS][3];
  stages_t stages[MAX_NS];
  size_t resp[MAX_NS];
  memset(res, 0, sizeof(res));
  memset(st, 0, sizeof(st));
  memset(stages, 0, sizeof(stages));
  uint8_t *tensors[MAX_NS];
  size_t tlen[MAX_NS];
  for (int k = 0; k < O.n_ns; k++) {
    tensors[k] = bench_make_tensors(O.ns[k], O.heads, &tlen[k]);
    if (!tensors[k])
      die("%s", "out of memory");
    resp[k] = expected_response_bytes(O.ns[k], O.heads);
  }

  /*
   * Both servers stay up for the whole run (an idle server costs nothing) and the three targets
   * take turns, N by N and round by round, so slow drifts in what else the machine is doing fall
   * on all three alike; samples are pooled over the rounds.
   */
  int failed = 0;
  bench_target_t dt = {0}, bt = {0};
  char sockdir[64] = "", weights[64] = "";
  char **dargv = plan_targets(&dt, &bt, sockdir, sizeof(sockdir), weights);
  if (dargv && (dt.port = bench_daemon_start(&daemon_child, dargv)) < 0)
    return 1;
  if (O.run_bare && (bt.port = start_bare(O.bare_path, O.unix_socket ? bt.path : NULL)) < 0)
    return 1;
  for (int r = 0; r < O.rounds && !failed; r++) {
    for (int k = 0; k < O.n_ns && !failed; k++) {
      if (dargv) {
        size_t seen = 0;
        failed = run_target(&dt, 1, r, O.ns[k], tensors[k], tlen[k], resp[k], &st[k][0], &seen,
                            &stages[k]) != 0;
        if (failed)
          bench_daemon_log_tail(&daemon_child);
        if (seen)
          resp[k] = seen;
      }
      if (O.run_bare && !failed)
        failed = run_target(&bt, 0, r, O.ns[k], tensors[k], tlen[k], resp[k], &st[k][1], NULL,
                            NULL) != 0;
      if (O.run_cpu && !failed)
        failed = run_cpu(O.ns[k], tensors[k], &st[k][2]) != 0;
    }
  }
  stop_child(&daemon_child.pid);
  stop_child(&bare_pid);
  if (!failed && dargv)
    unlink(daemon_child.log);
  if (sockdir[0]) {
    if (dt.path[0])
      unlink(dt.path);
    if (bt.path[0])
      unlink(bt.path);
    if (weights[0])
      unlink(weights);
    rmdir(sockdir);
  }
  if (dargv != O.daemon_argv)
    free(dargv);
  if (failed)
    return 1;
  double stage_us[MAX_NS][N_STAGES], req_us[MAX_NS];
  for (int k = 0; k < O.n_ns; k++) {
    req_us[k] = stages[k].ok && stages[k].req_count > 0
                    ? stages[k].req_sum / stages[k].req_count * 1e6
                    : -1;
    for (int t = 0; t < 3; t++) {
      res[k][t] = stats_result(&st[k][t]);
      free(st[k][t].v);
    }
    for (int i = 0; i < N_STAGES; i++)
      stage_us[k][i] =
          stages[k].ok && stages[k].count[i] > 0 ? stages[k].sum[i] / stages[k].count[i] * 1e6 : -1;
  }

  printf("# http_bench: H = %u heads, %d connection(s), %d round(s) of %.1f s per cell, cpu op on "
         "%u thread(s)\n",
         O.heads, O.conns, O.rounds, O.seconds, O.cpu_threads);
  if (O.unix_socket)
    printf("# transport: Unix sockets (the daemon's listen_unix, bare_server --unix)\n");
  if (O.attn)
    printf("# outputs: attn, attention %s (the cpu op: map_slots + qkv_insert + exact attention)\n",
           O.attn);
  printf("# tok/s over the measured window; p50/p99 per request (batch) in microseconds\n");
  printf("%5s %9s | %10s %9s %9s | %10s %9s %9s | %10s %9s %9s | %7s %7s %7s\n", "N", "resp B",
         "daemon", "p50", "p99", "bare", "p50", "p99", "cpu op", "p50", "p99", "%bare", "%cpu",
         "%lower");
  for (int k = 0; k < O.n_ns; k++) {
    char d[48], b[48], c[48], pb[16], pc[16], pl[16];
    fmt_res(d, sizeof(d), &res[k][0]);
    fmt_res(b, sizeof(b), &res[k][1]);
    fmt_res(c, sizeof(c), &res[k][2]);
    fmt_pct(pb, sizeof(pb), &res[k][0], &res[k][1]);
    fmt_pct(pc, sizeof(pc), &res[k][0], &res[k][2]);
    const result_t *lower = NULL;
    if (res[k][1].ok && res[k][2].ok)
      lower = res[k][1].tok_s < res[k][2].tok_s ? &res[k][1] : &res[k][2];
    else if (res[k][1].ok || res[k][2].ok)
      lower = res[k][1].ok ? &res[k][1] : &res[k][2];
    if (lower)
      fmt_pct(pl, sizeof(pl), &res[k][0], lower);
    else
      snprintf(pl, sizeof(pl), "-");
    printf("%5u %9zu | %s | %s | %s | %7s %7s %7s\n", O.ns[k], resp[k], d, b, c, pb, pc, pl);
  }
  if (O.daemon_argv) {
    /* Where a daemon request's time goes: its own stage timings against the client's mean. */
    printf("# daemon mean per batch (us): stages from its /metrics over the measured window;\n"
           "# rest = client mean - stages = HTTP in/out, parsing, loop<->executor hand-offs;\n"
           "# request: the daemon's whole time (forward_request_seconds, first byte to the answer\n"
           "# handed to the socket), of which the stages are a part; outside = client mean - "
           "request\n");
    printf("%5s | %9s | %9s %9s %9s %9s | %9s | %9s %9s\n", "N", "mean", "queue", "validate",
           "plan", "kernel", "rest", "request", "outside");
    for (int k = 0; k < O.n_ns; k++) {
      if (!res[k][0].ok)
        continue;
      double rest = res[k][0].mean_us;
      char cols[N_STAGES][16];
      for (int i = 0; i < N_STAGES; i++) {
        if (stage_us[k][i] >= 0) {
          snprintf(cols[i], sizeof(cols[i]), "%.0f", stage_us[k][i]);
          rest -= stage_us[k][i];
        } else {
          snprintf(cols[i], sizeof(cols[i]), "-");
        }
      }
      char rq[16] = "-", out[16] = "-";
      if (req_us[k] >= 0) {
        snprintf(rq, sizeof(rq), "%.0f", req_us[k]);
        snprintf(out, sizeof(out), "%.0f", res[k][0].mean_us - req_us[k]);
      }
      printf("%5u | %9.0f | %9s %9s %9s %9s | %9.0f | %9s %9s\n", O.ns[k], res[k][0].mean_us,
             cols[0], cols[1], cols[2], cols[3], rest, rq, out);
    }
  }
  for (int k = 0; k < O.n_ns; k++)
    free(tensors[k]);
  free(recv_buf);
  return 0;
}
