/*
 * shm_bench: what a forward costs through the daemon's shared regions (listen_shm, SPEC §6.1), end
 * to end, against the least the work can cost.
 *
 * The daemon is started here from the command after "--", with --listen-shm and --listen-unix
 * added. One client of libdsv4client creates a region holding q, kv, q_out and slots, writes the
 * inputs once, and times decode batches: each call is one token for each of N sequences (positions
 * advancing, each position sent once per served layer, as http_bench sends them), from the call to
 * the answer in the client's region. The same batches then go over HTTP, on the daemon's Unix
 * socket and on loopback TCP, one request at a time from this process, so that one table shows
 * what the zero-copy path saves.
 *
 * The ceilings, measured in the same run:
 *  - the CPU op (bench_forward.h): the CPU backend's map_slots + qkv_insert of the same batch,
 *    in-process, on --cpu-threads threads: the work itself, on a CPU daemon;
 *  - on a CUDA daemon (this program built with DSV4_CUDA): the PCIe floor of the same bytes (q + kv
 *    to the device, q_out + slots back, page-locked, cuda_floor.cu), the same with an empty
 *    producer/consumer kernel pair in between (the least a forward's device time can be), and the
 *    device time of the batch's forward step itself (slot map + insert from CUDA-graph replays,
 *    cuda_insert_sets.h, as cuda_insert_bench times it); the ceiling is the PCIe floor's p50 plus
 *    that device time.
 * The ratio printed is the zero-copy path's p50 over the ceiling (target: at most 1.5).
 *
 * Usage: shm_bench [options] -- DAEMON COMMAND..., for instance
 *   shm_bench -- build/dsv4d --port 0 --admin-port 0 --threads 2 --layers 0-3 --kv-blocks 512
 */
#include <errno.h>
#include <fcntl.h>
#include <llhttp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "bench_forward.h"
#include "dsv4client.h"

#ifdef SHM_BENCH_CUDA
#include "../gpu/gpu_common.h"
#include "cuda_bench_common.h"
#include "cuda_floor.h"
#include "cuda_insert_sets.h"
#endif

#define ALIGN_UP(x) (((x) + 63) & ~(size_t)63)

typedef struct {
  char **daemon_argv;
  uint32_t n;
  uint32_t heads; /* 0: the daemon's */
  long calls;
  long http_calls; /* < 0: as many as calls */
  long warmup;
  int layers;
  unsigned cpu_threads;
  uint32_t spin_us; /* the client's poll for each answer (dsv4c_set_spin) */
  int run_http;
} opts_t;

static opts_t O = {
    .n = 64,
    .calls = 10000,
    .http_calls = -1,
    .warmup = 100,
    .layers = 4,
    .cpu_threads = 2,
    .run_http = 1,
};

static bench_daemon_t daemon_child = {.prog = "shm_bench", .pid = -1};
/* The device time of the batch's forward step on a CUDA daemon (0: not measured). */
static double insert_us;

static void die(const char *fmt, const char *arg) {
  fprintf(stderr, "shm_bench: ");
  fprintf(stderr, fmt, arg);
  fputc('\n', stderr);
  exit(1);
}

/* ---- Samples ------------------------------------------------------------------------------ */

typedef struct {
  double *us;
  long n;
  double wall_s; /* the measured calls' wall time, for calls/s */
  double mean_us;
  /* The daemon's mean per call in each stage (its /metrics around the run), -1 when unknown. */
  double stage_us[N_STAGES];
  /* The daemon's whole time per call (dsv4d_shm_forward_seconds through a region, else
   * dsv4d_forward_request_seconds), -1 when unknown. */
  double request_us;
} samples_t;

static void samples_init(samples_t *s, long cap) {
  s->us = malloc((size_t)(cap > 0 ? cap : 1) * sizeof(*s->us));
  s->n = 0;
  s->wall_s = 0;
  if (!s->us)
    die("%s", "out of memory");
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Nearest rank: the smallest sample with at least pct % of the samples at or below it. */
static double pct(const samples_t *s, int pct) {
  long i = (s->n * pct + 99) / 100;
  return s->n ? s->us[(i ? i : 1) - 1] : 0;
}

static void samples_sort(samples_t *s) {
  double sum = 0;
  for (long i = 0; i < s->n; i++)
    sum += s->us[i];
  s->mean_us = s->n ? sum / (double)s->n : 0;
  qsort(s->us, (size_t)s->n, sizeof(*s->us), cmp_double);
}

/* The daemon's stage means per call between two scrapes of its /metrics (s0 before a run). */
static void samples_stages(samples_t *st, const stages_t *s0, const stages_t *s1) {
  for (int k = 0; k < N_STAGES; k++) {
    double c = s1->count[k] - s0->count[k];
    st->stage_us[k] = s0->ok && s1->ok && c > 0 ? (s1->sum[k] - s0->sum[k]) / c * 1e6 : -1;
  }
  const double rc = s1->req_count - s0->req_count, sc = s1->shm_count - s0->shm_count;
  st->request_us = !s0->ok || !s1->ok ? -1
                   : sc > 0           ? (s1->shm_sum - s0->shm_sum) / sc * 1e6
                   : rc > 0           ? (s1->req_sum - s0->req_sum) / rc * 1e6
                                      : -1;
}

/* ---- The batches ---------------------------------------------------------------------------- */

/* Call k of a run: layer k % layers at position k / layers; the first call creates the sequences.
 */
static int call_layer(long k) {
  return (int)(k % O.layers);
}

static int64_t call_pos(long k) {
  return k / O.layers;
}

static size_t q_bytes(void) {
  return (size_t)O.n * O.heads * DSV4_HEAD_DIM * 2;
}

static size_t kv_bytes(void) {
  return (size_t)O.n * DSV4_HEAD_DIM * 2;
}

/* ---- The zero-copy path ------------------------------------------------------------------- */

/*
 * Time warm-up + calls forwards through a region; the sequences are named shms0 .. shms(N-1). The
 * daemon's stage timings come from /metrics on tcp around the measured calls.
 */
static int run_shm(const char *path, const bench_target_t *tcp, samples_t *st) {
  dsv4c_client_t *c = NULL;
  dsv4c_region_t *r = NULL;
  dsv4c_result_t res = {0};
  int rc = dsv4c_connect(path, getenv("DSV4D_TOKEN"), &c);
  if (rc) {
    fprintf(stderr, "shm_bench: connect %s: %s\n", path, strerror(-rc));
    return -1;
  }
  dsv4c_set_spin(c, O.spin_us);
  dsv4c_forward_t f = {.heads = O.heads, .outputs = "q", .deadline_ms = -1};
  f.q_off = 0;
  f.kv_off = ALIGN_UP(q_bytes());
  f.q_out_off = ALIGN_UP(f.kv_off + kv_bytes());
  f.slots_off = ALIGN_UP(f.q_out_off + q_bytes());
  rc = dsv4c_region_create(c, f.slots_off + (size_t)O.n * 8, &r, &res);
  if (rc) {
    fprintf(stderr, "shm_bench: region: %s %s\n", rc == -EPROTO ? res.code : strerror(-rc),
            res.message);
    dsv4c_result_free(&res);
    dsv4c_close(c);
    return -1;
  }
  dsv4c_result_free(&res);
  uint8_t *base = dsv4c_region_data(r);
  /* q and kv are adjacent in bench_fill_tensors' layout; here they are two fills. */
  bench_fill_tensors(base + f.q_off, O.n, O.heads);
  bench_fill_tensors(base + f.kv_off, O.n, 0);
  dsv4c_segment_t *segs = calloc(O.n, sizeof(*segs));
  char(*names)[16] = calloc(O.n, sizeof(*names));
  if (!segs || !names)
    die("%s", "out of memory");
  for (uint32_t i = 0; i < O.n; i++) {
    snprintf(names[i], sizeof(names[i]), "shms%u", i);
    segs[i].seq = names[i];
    segs[i].len = 1;
  }
  f.segs = segs;
  f.n_segs = O.n;
  uint64_t t_first = 0;
  stages_t s0 = {0}, s1 = {0};
  for (long k = 0; k < O.warmup + O.calls && rc == 0; k++) {
    f.layer = (uint32_t)call_layer(k);
    for (uint32_t i = 0; i < O.n; i++) {
      segs[i].start = call_pos(k);
      segs[i].is_new = k == 0;
    }
    if (k == O.warmup) {
      scrape_stages(tcp, &s0);
      t_first = now_ns();
    }
    uint64_t t0 = now_ns();
    rc = dsv4c_forward(c, r, &f, &res);
    uint64_t t1 = now_ns();
    if (rc) {
      fprintf(stderr, "shm_bench: forward: %s\n", strerror(-rc));
    } else if (res.status != 200) {
      fprintf(stderr, "shm_bench: forward answered %d %s: %s\n", res.status, res.code, res.message);
      rc = -1;
    } else if (k >= O.warmup) {
      st->us[st->n++] = (double)(t1 - t0) * 1e-3;
      st->wall_s = (double)(t1 - t_first) * 1e-9;
    }
    dsv4c_result_free(&res);
  }
  scrape_stages(tcp, &s1);
  samples_stages(st, &s0, &s1);
  free(segs);
  free(names);
  dsv4c_region_destroy(c, r);
  dsv4c_close(c);
  return rc ? -1 : 0;
}

/* ---- The same batches over HTTP ----------------------------------------------------------- */

typedef struct {
  int fd;
  llhttp_t parser;
  llhttp_settings_t settings;
  int status, complete;
  char body[512]; /* the start of the answer's body, for an error message */
  size_t body_len;
  char *buf; /* receive buffer */
} hclient_t;

static int on_h_begin(llhttp_t *p) {
  hclient_t *h = p->data;
  h->status = 0;
  h->complete = 0;
  h->body_len = 0;
  return 0;
}

static int on_h_headers(llhttp_t *p) {
  ((hclient_t *)p->data)->status = llhttp_get_status_code(p);
  return 0;
}

static int on_h_body(llhttp_t *p, const char *at, size_t n) {
  hclient_t *h = p->data;
  size_t room = sizeof(h->body) - 1 - h->body_len;
  memcpy(h->body + h->body_len, at, n < room ? n : room);
  h->body_len += n < room ? n : room;
  h->body[h->body_len] = '\0';
  return 0;
}

static int on_h_complete(llhttp_t *p) {
  ((hclient_t *)p->data)->complete = 1;
  return 0;
}

#define HBUF_BYTES (1u << 20)

static int hclient_open(hclient_t *h, const bench_target_t *t) {
  memset(h, 0, sizeof(*h));
  h->fd = bench_connect(t);
  h->buf = malloc(HBUF_BYTES);
  if (h->fd < 0 || !h->buf) {
    char name[128];
    fprintf(stderr, "shm_bench: cannot connect to %s: %s\n",
            bench_target_name(t, name, sizeof(name)), strerror(errno));
    free(h->buf);
    return -1;
  }
  int one = 1;
  if (!t->path[0])
    setsockopt(h->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  struct timeval tv = {.tv_sec = 60};
  setsockopt(h->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(h->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  llhttp_settings_init(&h->settings);
  h->settings.on_message_begin = on_h_begin;
  h->settings.on_headers_complete = on_h_headers;
  h->settings.on_body = on_h_body;
  h->settings.on_message_complete = on_h_complete;
  llhttp_init(&h->parser, HTTP_RESPONSE, &h->settings);
  h->parser.data = h;
  return 0;
}

static void hclient_close(hclient_t *h) {
  if (h->fd >= 0)
    close(h->fd);
  free(h->buf);
}

/* Send head + body (blocking) and read the whole answer; the status, or -1 on a transport error. */
static int hclient_exchange(hclient_t *h, const char *head, size_t head_len, const uint8_t *body,
                            size_t body_len) {
  struct iovec iov[2] = {{(void *)head, head_len}, {(void *)body, body_len}};
  int iovcnt = body_len ? 2 : 1;
  for (size_t left = head_len + body_len; left;) {
    ssize_t w = writev(h->fd, iov, iovcnt);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    left -= (size_t)w;
    for (int i = 0; i < iovcnt && w; i++) {
      size_t m = (size_t)w < iov[i].iov_len ? (size_t)w : iov[i].iov_len;
      iov[i].iov_base = (char *)iov[i].iov_base + m;
      iov[i].iov_len -= m;
      w -= (ssize_t)m;
    }
  }
  h->complete = 0;
  while (!h->complete) {
    ssize_t r = recv(h->fd, h->buf, HBUF_BYTES, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0 || llhttp_execute(&h->parser, h->buf, (size_t)r) != HPE_OK)
      return -1;
  }
  return h->status;
}

/* Delete sequences <prefix>s0 .. s(N-1), so that the next run finds the pool as it was. */
static int delete_sequences(hclient_t *h, const char *prefix) {
  for (uint32_t i = 0; i < O.n; i++) {
    char req[256];
    int len = snprintf(req, sizeof(req),
                       "DELETE /v1/sequences/%ss%u HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       "Content-Length: 0\r\n\r\n",
                       prefix, i);
    int status = hclient_exchange(h, req, (size_t)len, NULL, 0);
    if (status < 200 || status > 299) {
      fprintf(stderr, "shm_bench: DELETE answered %d: %s\n", status, h->body);
      return -1;
    }
  }
  return 0;
}

/*
 * Time warm-up + calls forwards over HTTP to t, sequences named <prefix>s0 ..; then delete them.
 * The daemon's stage timings come from /metrics on tcp around the measured calls.
 */
static int run_http(const bench_target_t *t, const bench_target_t *tcp, const char *prefix,
                    long calls, samples_t *st) {
  hclient_t h;
  if (hclient_open(&h, t))
    return -1;
  size_t tlen = q_bytes() + kv_bytes(), cap = 1024 + (size_t)O.n * 96;
  uint8_t *tensors = malloc(tlen);
  char *head = malloc(cap);
  if (!tensors || !head)
    die("%s", "out of memory");
  bench_fill_tensors(tensors, O.n, O.heads);
  int rc = 0;
  uint64_t t_first = 0;
  stages_t s0 = {0}, s1 = {0};
  for (long k = 0; k < O.warmup + calls && rc == 0; k++) {
    if (k == O.warmup) {
      scrape_stages(tcp, &s0);
      t_first = now_ns();
    }
    uint64_t t0 = now_ns();
    size_t hl = bench_forward_head(head, cap, prefix, O.n, O.heads, call_layer(k), call_pos(k),
                                   k == 0, tlen, 0, NULL);
    int status = hl ? hclient_exchange(&h, head, hl, tensors, tlen) : -1;
    uint64_t t1 = now_ns();
    if (status != 200) {
      fprintf(stderr, "shm_bench: HTTP forward answered %d: %s\n", status, h.body);
      rc = -1;
    } else if (k >= O.warmup) {
      st->us[st->n++] = (double)(t1 - t0) * 1e-3;
      st->wall_s = (double)(t1 - t_first) * 1e-9;
    }
  }
  scrape_stages(tcp, &s1);
  samples_stages(st, &s0, &s1);
  if (rc == 0)
    rc = delete_sequences(&h, prefix);
  hclient_close(&h);
  free(tensors);
  free(head);
  return rc;
}

/* ---- The ceilings -----------------------------------------------------------------------------
 */

/* The CPU op alone on the same batch, warm-up + calls steps. */
static int run_cpu_op(samples_t *st) {
  bench_cpu_op_t op;
  size_t tlen;
  uint8_t *tensors = bench_make_tensors(O.n, O.heads, &tlen);
  if (!tensors)
    die("%s", "out of memory");
  if (bench_cpu_op_open(&op, O.n, O.heads, O.cpu_threads, "shm_bench", 0, 0)) {
    free(tensors);
    return -1;
  }
  int rc = 0;
  uint64_t t_first = 0;
  for (long k = 0; k < O.warmup + O.calls && rc == 0; k++) {
    if (k == O.warmup)
      t_first = now_ns();
    uint64_t t0 = now_ns();
    rc = bench_cpu_op_step(&op, tensors, k);
    uint64_t t1 = now_ns();
    if (rc)
      fprintf(stderr, "shm_bench: cpu op failed: %s\n", dsv4_strerror(rc));
    else if (k >= O.warmup) {
      st->us[st->n++] = (double)(t1 - t0) * 1e-3;
      st->wall_s = (double)(t1 - t_first) * 1e-9;
    }
  }
  bench_cpu_op_close(&op);
  free(tensors);
  return rc ? -1 : 0;
}

#ifdef SHM_BENCH_CUDA
/* The PCIe floor of the batch's bytes, and with the empty kernel pair between the copies. */
static int run_pcie_floor(samples_t *copy, samples_t *pair) {
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    fprintf(stderr, "shm_bench: no CUDA stream\n");
    return -1;
  }
  long reps = O.calls < 2000 ? O.calls : 2000;
  int rc = bench_pcie_floor(s, q_bytes() + kv_bytes(), q_bytes() + (size_t)O.n * 8, (int)reps,
                            copy->us, pair->us);
  if (rc) {
    cudaStreamDestroy(s);
    return -1;
  }
  copy->n = pair->n = reps;
  /* The forward step's device time on the batch's shape, from graph replays. */
  float *mirror = NULL;
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_plain_default, INSERT_MAX_POS, &mirror);
  insert_sets_t x;
  insert_sets_make(&x, O.heads, O.n, mirror, rope);
  insert_us = insert_sets_us(&x, 0, mirror, s);
  insert_sets_free(&x);
  cudaFree(mirror);
  dsv4_rope_table_destroy(rope);
  cudaStreamDestroy(s);
  return 0;
}
#endif

/* ---- The daemon --------------------------------------------------------------------------- */

/* The value of "key" in a JSON line, as text without quotes (enough for the started line). */
static int json_field(const char *line, const char *key, char *out, size_t len) {
  char pat[64];
  snprintf(pat, sizeof(pat), "\"%s\":", key);
  const char *p = strstr(line, pat);
  if (!p)
    return -1;
  p += strlen(pat);
  while (*p == ' ' || *p == '"')
    p++;
  size_t i = 0;
  while (p[i] && p[i] != '"' && p[i] != ',' && p[i] != '}' && i + 1 < len) {
    out[i] = p[i];
    i++;
  }
  out[i] = '\0';
  return i ? 0 : -1;
}

/* The backend and the heads from the daemon's "started" line. */
static int read_started(char *backend, size_t len, uint32_t *heads) {
  FILE *f = fopen(daemon_child.log, "r");
  char line[4096], h[16];
  int rc = -1;
  while (f && fgets(line, sizeof(line), f)) {
    if (strstr(line, "\"msg\":\"started\"") && json_field(line, "backend", backend, len) == 0 &&
        json_field(line, "heads", h, sizeof(h)) == 0) {
      *heads = (uint32_t)strtoul(h, NULL, 10);
      rc = 0;
      break;
    }
  }
  if (f)
    fclose(f);
  return rc;
}

/* A copy of the daemon's command with --listen-shm and --listen-unix added. */
static char **daemon_command(char *shm_path, char *unix_path) {
  int n = 0;
  while (O.daemon_argv[n])
    n++;
  char **v = calloc((size_t)n + 5, sizeof(*v));
  if (!v)
    die("%s", "out of memory");
  memcpy(v, O.daemon_argv, (size_t)n * sizeof(*v));
  v[n] = "--listen-shm";
  v[n + 1] = shm_path;
  v[n + 2] = "--listen-unix";
  v[n + 3] = unix_path;
  return v;
}

/* ---- Main ----------------------------------------------------------------------------------- */

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [options] -- DAEMON COMMAND...\n"
          "  --tokens N         sequences per call, one token each (64)\n"
          "  --heads H          query heads (default: the daemon's)\n"
          "  --calls C          measured calls per path (10000)\n"
          "  --http-calls C     measured calls over HTTP (default: --calls)\n"
          "  --warmup W         unmeasured calls first (100)\n"
          "  --layers L         cycle over layers 0..L-1 at each position (4); the daemon\n"
          "                     must serve exactly these, or its blocks are never released\n"
          "  --cpu-threads T    CPU backend threads for the cpu op ceiling (2)\n"
          "  --spin-us S        the shm client polls for each answer S us before sleeping (0)\n"
          "  --no-http          the zero-copy path and the ceilings only\n"
          "The daemon must be started with --port 0 (its data port is read from its log) and\n"
          "enough --kv-blocks for 3 * N sequences' blocks; this program adds --listen-shm and\n"
          "--listen-unix. DSV4D_TOKEN is the bearer token, if the daemon wants one.\n",
          argv0);
  exit(2);
}

static long parse_long(const char *v, long lo, long hi, const char *argv0) {
  char *end;
  long x = strtol(v, &end, 10);
  if (end == v || *end || x < lo || x > hi)
    usage(argv0);
  return x;
}

static void parse_args(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--") == 0) {
      O.daemon_argv = i + 1 < argc ? argv + i + 1 : NULL;
      break;
    } else if (strcmp(a, "--no-http") == 0) {
      O.run_http = 0;
      continue;
    } else if (!v) {
      usage(argv[0]);
    } else if (strcmp(a, "--tokens") == 0) {
      O.n = (uint32_t)parse_long(v, 1, 16384, argv[0]);
    } else if (strcmp(a, "--heads") == 0) {
      O.heads = (uint32_t)parse_long(v, 1, DSV4_MAX_HEADS, argv[0]);
    } else if (strcmp(a, "--calls") == 0) {
      O.calls = parse_long(v, 1, 100000000, argv[0]);
    } else if (strcmp(a, "--http-calls") == 0) {
      O.http_calls = parse_long(v, 1, 100000000, argv[0]);
    } else if (strcmp(a, "--warmup") == 0) {
      O.warmup = parse_long(v, 1, 1000000, argv[0]);
    } else if (strcmp(a, "--layers") == 0) {
      O.layers = (int)parse_long(v, 1, 1024, argv[0]);
    } else if (strcmp(a, "--cpu-threads") == 0) {
      O.cpu_threads = (unsigned)parse_long(v, 1, 1024, argv[0]);
    } else if (strcmp(a, "--spin-us") == 0) {
      O.spin_us = (uint32_t)parse_long(v, 0, 10000, argv[0]);
    } else {
      usage(argv[0]);
    }
    i++;
  }
  if (!O.daemon_argv)
    usage(argv[0]);
  if (O.http_calls < 0)
    O.http_calls = O.calls;
}

static void on_fatal_signal(int sig) {
  /* Leave no daemon behind when interrupted. */
  if (daemon_child.pid > 0)
    kill(daemon_child.pid, SIGKILL);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void stop_daemon(void) {
  stop_child(&daemon_child.pid);
}

enum { R_SHM, R_UNIX, R_TCP, R_CPU, R_PCIE, R_PCIE_PAIR, R_COUNT };

static const char *const row_names[R_COUNT] = {
    "shm: listen_shm region (zero-copy)",
    "http: listen_unix socket",
    "http: loopback TCP",
    "ceiling: cpu op alone",
    "ceiling: PCIe floor (H2D + D2H)",
    "ceiling: PCIe floor + empty kernel pair",
};

static void print_row(int r, samples_t *s) {
  if (!s->n) {
    printf("%-42s %8s %9s %9s %9s %9s\n", row_names[r], "-", "-", "-", "-", "-");
    return;
  }
  samples_sort(s);
  char rate[32] = "-";
  /* The device floors are timed on the GPU's clock, one after another: no calls/s for them. */
  if (s->wall_s > 0)
    snprintf(rate, sizeof(rate), "%.0f", (double)s->n / s->wall_s);
  printf("%-42s %8ld %9.1f %9.1f %9.1f %9s\n", row_names[r], s->n, pct(s, 50), pct(s, 99),
         s->us[s->n - 1], rate);
}

/* Where a call's time goes in the daemon, by its own stage timings, for the paths through it. */
static void print_stages(const samples_t *rows) {
  printf(
      "# the daemon's mean per call (us) by its forward_seconds stages over the measured calls;\n"
      "# rest = the client's mean - the stages: the transport, parsing, thread hand-offs;\n"
      "# request: the daemon's whole time per call (dsv4d_shm_forward_seconds, message read to\n"
      "# answer sent; over HTTP dsv4d_forward_request_seconds), of which the stages are a part;\n"
      "# outside = the client's mean - request: the client library and the transport;\n"
      "# \"-\": the daemon recorded no stage for these calls\n");
  printf("%-42s %9s | %9s %9s %9s %9s | %9s | %9s %9s\n", "path", "mean", "queue", "validate",
         "plan", "kernel", "rest", "request", "outside");
  for (int r = R_SHM; r <= R_TCP; r++) {
    if (!rows[r].n)
      continue;
    char cols[N_STAGES + 1][16];
    double rest = rows[r].mean_us;
    int known = 0;
    for (int k = 0; k < N_STAGES; k++) {
      snprintf(cols[k], sizeof(cols[k]), "-");
      if (rows[r].stage_us[k] >= 0) {
        snprintf(cols[k], sizeof(cols[k]), "%.1f", rows[r].stage_us[k]);
        rest -= rows[r].stage_us[k];
        known = 1;
      }
    }
    if (known)
      snprintf(cols[N_STAGES], sizeof(cols[N_STAGES]), "%.1f", rest);
    else
      snprintf(cols[N_STAGES], sizeof(cols[N_STAGES]), "-");
    char req[16] = "-", outside[16] = "-";
    if (rows[r].request_us >= 0) {
      snprintf(req, sizeof(req), "%.1f", rows[r].request_us);
      snprintf(outside, sizeof(outside), "%.1f", rows[r].mean_us - rows[r].request_us);
    }
    printf("%-42s %9.1f | %9s %9s %9s %9s | %9s | %9s %9s\n", row_names[r], rows[r].mean_us,
           cols[0], cols[1], cols[2], cols[3], cols[4], req, outside);
  }
}

static void print_table(const char *backend, samples_t *rows) {
  printf(
      "# shm_bench: N = %u (sequences, one token each per call), H = %u heads, backend %s, layers "
      "0-%d in turn, %ld warm-up calls\n",
      O.n, O.heads, backend, O.layers - 1, O.warmup);
  printf("# request q + kv %zu B, answer q_out + slots %zu B; latency per call in microseconds, "
         "cpu op on %u thread(s); the shm client polls %u us for an answer before sleeping\n",
         q_bytes() + kv_bytes(), q_bytes() + (size_t)O.n * 8, O.cpu_threads, O.spin_us);
  printf("%-42s %8s %9s %9s %9s %9s\n", "path", "calls", "p50", "p99", "max", "calls/s");
  for (int r = 0; r < R_COUNT; r++)
    if ((r < R_PCIE && (O.run_http || (r != R_UNIX && r != R_TCP))) || rows[r].n)
      print_row(r, &rows[r]);
  const char *ceil_name = row_names[R_CPU] + 9;
  double ceil_us = rows[R_CPU].n ? pct(&rows[R_CPU], 50) : 0;
  if (insert_us > 0 && rows[R_PCIE].n) {
    printf("# forward step's device time (slot map + insert, graph replays): %.2f us\n", insert_us);
    ceil_name = "PCIe floor p50 + the step's device time";
    ceil_us = pct(&rows[R_PCIE], 50) + insert_us;
  }
  if (rows[R_SHM].n && ceil_us > 0)
    printf("# shm p50 / ceiling (%s, %.1f us) = %.2f x (target <= 1.5 x)\n", ceil_name, ceil_us,
           pct(&rows[R_SHM], 50) / ceil_us);
  print_stages(rows);
  if (rows[R_SHM].n && rows[R_UNIX].n && rows[R_TCP].n)
    printf("# http p50 / shm p50: Unix socket %.2f x, TCP %.2f x\n",
           pct(&rows[R_UNIX], 50) / pct(&rows[R_SHM], 50),
           pct(&rows[R_TCP], 50) / pct(&rows[R_SHM], 50));
}

/* Run every path and ceiling in turn; 0 or -1. */
static int run_all(const char *sockdir, bench_target_t *tcp, char *backend, size_t blen,
                   samples_t *rows) {
  bench_target_t unix_t = {0};
  char shm_path[128];
  snprintf(shm_path, sizeof(shm_path), "%s/shm.sock", sockdir);
  snprintf(unix_t.path, sizeof(unix_t.path), "%s/data.sock", sockdir);
  char **argv = daemon_command(shm_path, unix_t.path);
  tcp->port = bench_daemon_start(&daemon_child, argv);
  free(argv);
  uint32_t heads = 0;
  if (tcp->port < 0)
    return -1;
  if (read_started(backend, blen, &heads)) {
    fprintf(stderr, "shm_bench: no \"started\" line with the backend and heads\n");
    return -1;
  }
  if (!O.heads)
    O.heads = heads;
  for (int r = 0; r < R_COUNT; r++)
    samples_init(&rows[r], r == R_UNIX || r == R_TCP ? O.http_calls : O.calls);
  int rc = run_shm(shm_path, tcp, &rows[R_SHM]);
  /* The region's sequences are deleted over HTTP: the shared-region socket has no delete. */
  hclient_t h;
  if (rc == 0 && (rc = hclient_open(&h, tcp)) == 0) {
    rc = delete_sequences(&h, "shm");
    hclient_close(&h);
  }
  if (rc == 0 && O.run_http)
    rc = run_http(&unix_t, tcp, "unx", O.http_calls, &rows[R_UNIX]);
  if (rc == 0 && O.run_http)
    rc = run_http(tcp, tcp, "tcp", O.http_calls, &rows[R_TCP]);
  if (rc)
    bench_daemon_log_tail(&daemon_child);
  if (rc == 0)
    rc = run_cpu_op(&rows[R_CPU]);
#ifdef SHM_BENCH_CUDA
  if (rc == 0 && strcmp(backend, "cuda") == 0)
    rc = run_pcie_floor(&rows[R_PCIE], &rows[R_PCIE_PAIR]);
#endif
  return rc;
}

int main(int argc, char **argv) {
  parse_args(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, on_fatal_signal);
  signal(SIGTERM, on_fatal_signal);
  atexit(stop_daemon);
  char sockdir[64] = "/tmp/shm_bench_XXXXXX";
  if (!mkdtemp(sockdir))
    die("cannot create a socket folder: %s", strerror(errno));
  bench_target_t tcp = {0};
  samples_t rows[R_COUNT];
  memset(rows, 0, sizeof(rows));
  char backend[32] = "?";
  int rc = run_all(sockdir, &tcp, backend, sizeof(backend), rows);
  stop_daemon();
  char path[128];
  snprintf(path, sizeof(path), "%s/shm.sock", sockdir);
  unlink(path);
  snprintf(path, sizeof(path), "%s/data.sock", sockdir);
  unlink(path);
  rmdir(sockdir);
  if (rc == 0) {
    unlink(daemon_child.log);
    print_table(backend, rows);
  }
  for (int r = 0; r < R_COUNT; r++)
    free(rows[r].us);
  return rc ? 1 : 0;
}
