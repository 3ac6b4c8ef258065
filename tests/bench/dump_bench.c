/*
 * dump_bench: GET /admin/v1/dump against its ceiling, a bare libuv + llhttp server (bare_server)
 * sending a body of the same size over the same loopback, measured side by side in one run
 * (DESIGN.md "Performance method"); and the latency of one-token forward batches while dumps
 * stream, against the same batches on an idle daemon, next to the time of one dump chunk.
 *
 * The daemon serves `--layers` layers with one head; one sequence is prefilled with `--tokens`
 * tokens in one batch per layer, so that every position stays stored and the dump is
 * layers x tokens x 592 bytes.
 *
 * Usage: dump_bench [--daemon PATH] [--bare PATH] [--layers N] [--tokens N] [--chunk BYTES]
 *                   [--runs N] [--batches N] [--threads N]
 * The daemon and bare_server default to this program's build tree (../../dsv4d, ./bare_server).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_child.h"

static pid_t daemon_pid = -1, bare_pid = -1;

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("dump_bench: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  stop_child(&daemon_pid);
  stop_child(&bare_pid);
  exit(1);
}

/* ---- A blocking HTTP/1.1 client: one request, the whole answer read and counted ------------- */

static int connect_port(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int one = 1;
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0)
    die("connect to port %d: %s", port, strerror(errno));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

static void write_all(int fd, const void *p, size_t n) {
  const char *c = p;
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      die("write: %s", strerror(errno));
    c += w;
    n -= (size_t)w;
  }
}

/* Read one answer on fd: its status; *body_len the body bytes (read into scratch and dropped). */
static int read_answer(int fd, uint8_t *scratch, size_t cap, uint64_t *body_len) {
  size_t have = 0;
  char *end = NULL;
  while (!end) {
    ssize_t r = read(fd, scratch + have, cap - 1 - have);
    if (r <= 0)
      die("read: %s", r ? strerror(errno) : "connection closed");
    have += (size_t)r;
    scratch[have] = '\0';
    end = strstr((char *)scratch, "\r\n\r\n");
  }
  int status = atoi((char *)scratch + 9);
  const char *cl = strcasestr((char *)scratch, "\r\nContent-Length:");
  if (!cl || cl > end)
    die("an answer without Content-Length");
  uint64_t len = strtoull(cl + 17, NULL, 10), got = have - (size_t)(end + 4 - (char *)scratch);
  while (got < len) {
    size_t want = len - got < cap ? (size_t)(len - got) : cap;
    ssize_t r = read(fd, scratch, want);
    if (r <= 0)
      die("read body: %s", r ? strerror(errno) : "connection closed");
    got += (size_t)r;
  }
  *body_len = len;
  return status;
}

/* GET path on port (with one extra header line, may be NULL): bytes and nanoseconds. */
static uint64_t timed_get(int port, const char *path, const char *extra, uint8_t *scratch,
                          size_t cap, uint64_t *ns) {
  char req[512];
  int n = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: bench\r\n%s%s\r\n", path,
                   extra ? extra : "", extra ? "\r\n" : "");
  int fd = connect_port(port);
  uint64_t t0 = now_ns(), len;
  write_all(fd, req, (size_t)n);
  int status = read_answer(fd, scratch, cap, &len);
  *ns = now_ns() - t0;
  close(fd);
  if (status != 200)
    die("GET %s on port %d answered %d", path, port, status);
  return len;
}

/* GET path on port into a NUL-terminated malloc'd text (a small answer: /metrics). */
static char *get_text(int port, const char *path) {
  char req[256];
  int n = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: bench\r\n\r\n", path);
  int fd = connect_port(port);
  size_t cap = 1 << 16, have = 0;
  char *b = malloc(cap);
  write_all(fd, req, (size_t)n);
  for (;;) {
    if (have + 1 == cap && !(b = realloc(b, cap *= 2)))
      die("out of memory");
    ssize_t r = read(fd, b + have, cap - 1 - have);
    if (r <= 0)
      die("read /metrics: %s", r ? strerror(errno) : "connection closed");
    have += (size_t)r;
    b[have] = '\0';
    char *end = strstr(b, "\r\n\r\n");
    const char *cl = strcasestr(b, "\r\nContent-Length:");
    if (end && cl && have >= (size_t)(end + 4 - b) + strtoull(cl + 17, NULL, 10))
      break;
  }
  close(fd);
  return b;
}

/* The cumulative count of dsv4d_forward_seconds_bucket{stage="queue",class=...,le=...} per bound,
 * both classes together; -1 where neither class has a series yet. */
#define N_LE 19
static const char *const le_names[N_LE] = {
    "1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01",
    "0.025", "0.05",    "0.1",   "0.25",   "0.5",     "1",      "2.5",   "5",      "+Inf"};

static void queue_buckets(int port, double out[N_LE]) {
  char *t = get_text(port, "/metrics");
  static const char *const classes[2] = {"decode", "prefill"};
  for (int i = 0; i < N_LE; i++) {
    out[i] = -1;
    for (int c = 0; c < 2; c++) {
      char key[112];
      snprintf(key, sizeof(key),
               "dsv4d_forward_seconds_bucket{stage=\"queue\",class=\"%s\",le=\"%s\"} ", classes[c],
               le_names[i]);
      const char *p = strstr(t, key);
      if (p)
        out[i] = (out[i] < 0 ? 0 : out[i]) + strtod(p + strlen(key), NULL);
    }
  }
  free(t);
}

/* ---- Forward batches ------------------------------------------------------------------------ */

/* A forward body: n tokens of one head for seq at layer from position start. */
static uint8_t *forward_body(uint32_t layer, const char *seq, uint32_t start, uint32_t n,
                             int new_seq, size_t *len) {
  char hdr[1024];
  size_t q = (size_t)n * 512 * 2;
  int h =
      snprintf(hdr, sizeof(hdr),
               "{\"__metadata__\":{\"layer\":\"%u\",\"segments\":\"[{\\\"seq\\\":\\\"%s\\\","
               "\\\"start\\\":%u,\\\"len\\\":%u%s}]\"},\"q\":{\"dtype\":\"BF16\",\"shape\":[%u,1,"
               "512],\"data_offsets\":[0,%zu]},\"kv\":{\"dtype\":\"BF16\",\"shape\":[%u,512],"
               "\"data_offsets\":[%zu,%zu]}}",
               layer, seq, start, n, new_seq ? ",\\\"new\\\":true" : "", n, q, n, q, 2 * q);
  while (h % 8)
    hdr[h++] = ' ';
  *len = 8 + (size_t)h + 2 * q;
  uint8_t *b = malloc(*len);
  if (!b)
    die("out of memory");
  uint64_t hl = (uint64_t)h;
  for (int i = 0; i < 8; i++)
    b[i] = (uint8_t)(hl >> (8 * i));
  memcpy(b + 8, hdr, (size_t)h);
  /* Finite bf16 values of modest size: random mantissa and sign, exponents 2^-8 .. 2^7. */
  uint32_t x = 2463534242u ^ (start * 2654435761u) ^ layer;
  uint16_t *v = (uint16_t *)(void *)(b + 8 + h);
  for (size_t i = 0; i < 2 * (size_t)n * 512; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v[i] = (uint16_t)((x & 0x807f) | ((119u + (x >> 8) % 16) << 7));
  }
  return b;
}

static uint64_t post_forward(int fd, const uint8_t *body, size_t len, uint8_t *scratch,
                             size_t cap) {
  char req[256];
  int n = snprintf(req, sizeof(req),
                   "POST /v1/forward HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                   "application/octet-stream\r\nContent-Length: %zu\r\n\r\n",
                   len);
  uint64_t t0 = now_ns(), got;
  write_all(fd, req, (size_t)n);
  write_all(fd, body, len);
  int status = read_answer(fd, scratch, cap, &got);
  if (status != 200)
    die("forward answered %d: %.200s", status, (char *)scratch);
  return now_ns() - t0;
}

/* ---- Children ------------------------------------------------------------------------------- */

static int find_port(const char *line, const char *listener) {
  char key[40];
  snprintf(key, sizeof(key), "\"listener\":\"%s\"", listener);
  const char *p = strstr(line, "\"listening\"") ? strstr(line, key) : NULL;
  p = p ? strstr(p, "\"port\":") : NULL;
  return p ? atoi(p + 7) : -1;
}

static void start_daemon(char **argv, int *data_port, int *admin_port) {
  char log[64] = "/tmp/dump_bench_daemon_XXXXXX";
  int lfd = mkstemp(log);
  if (lfd < 0)
    die("mkstemp: %s", strerror(errno));
  daemon_pid = fork();
  if (daemon_pid == 0) {
    dup2(lfd, 2);
    execv(argv[0], argv);
    _exit(127);
  }
  close(lfd);
  FILE *f = fopen(log, "r");
  char line[4096];
  *data_port = *admin_port = -1;
  for (uint64_t until = now_ns() + 60000000000ull; now_ns() < until;) {
    if (f && fgets(line, sizeof(line), f)) {
      if (find_port(line, "data") > 0)
        *data_port = find_port(line, "data");
      if (find_port(line, "admin") > 0)
        *admin_port = find_port(line, "admin");
      if (*data_port > 0 && *admin_port > 0)
        break;
      continue;
    }
    clearerr(f);
    if (waitpid(daemon_pid, NULL, WNOHANG) == daemon_pid)
      die("the daemon exited before listening (log %s)", log);
    usleep(20000);
  }
  if (f)
    fclose(f);
  if (*data_port <= 0 || *admin_port <= 0)
    die("no listening lines from the daemon (log %s)", log);
  /* Kept: each dump's "dump" line splits its time into snapshot + digests and streaming. */
  fprintf(stderr, "dump_bench: daemon log %s\n", log);
}

static int start_bare(const char *path, uint64_t max_bytes) {
  int pfd[2];
  char max[32];
  snprintf(max, sizeof(max), "%llu", (unsigned long long)max_bytes);
  if (pipe(pfd))
    die("pipe: %s", strerror(errno));
  bare_pid = fork();
  if (bare_pid == 0) {
    dup2(pfd[1], 1);
    close(pfd[0]);
    close(pfd[1]);
    execl(path, path, "--port", "0", "--max-response-bytes", max, (char *)NULL);
    _exit(127);
  }
  close(pfd[1]);
  char buf[32] = {0};
  struct pollfd p = {.fd = pfd[0], .events = POLLIN};
  if (poll(&p, 1, 10000) <= 0 || read(pfd[0], buf, sizeof(buf) - 1) <= 0)
    die("bare server %s did not print its port", path);
  close(pfd[0]);
  return atoi(buf);
}

/* ---- Measurements --------------------------------------------------------------------------- */

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

typedef struct {
  int port;
  char path[128];
  volatile int stop;
  uint64_t dumps;
  uint64_t bytes, ns;
} dump_loop_t;

static void *dump_loop(void *arg) {
  dump_loop_t *L = arg;
  size_t cap = 1 << 20;
  uint8_t *scratch = malloc(cap);
  while (!L->stop) {
    uint64_t ns, n = timed_get(L->port, L->path, NULL, scratch, cap, &ns);
    L->dumps++;
    L->bytes += n;
    L->ns += ns;
  }
  free(scratch);
  return NULL;
}

static void latency(int data_port, uint32_t first_pos, uint32_t n, uint64_t *out, uint8_t *scratch,
                    size_t cap) {
  int fd = connect_port(data_port);
  for (uint32_t i = 0; i < n; i++) {
    size_t len;
    uint8_t *b = forward_body(0, "lat", first_pos + i, 1, first_pos + i == 0, &len);
    out[i] = post_forward(fd, b, len, scratch, cap);
    free(b);
  }
  close(fd);
  qsort(out, n, sizeof(*out), cmp_u64);
}

int main(int argc, char **argv) {
  char self[PATH_MAX], daemon_path[PATH_MAX + 16], bare_path[PATH_MAX + 16];
  const char *dpath = NULL, *bpath = NULL;
  uint32_t layers = 16, tokens = 8192, chunk = 1u << 20, runs = 5, batches = 200, threads = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v)
      die("%s needs a value", a);
    if (!strcmp(a, "--daemon"))
      dpath = v;
    else if (!strcmp(a, "--bare"))
      bpath = v;
    else if (!strcmp(a, "--layers"))
      layers = (uint32_t)atoi(v);
    else if (!strcmp(a, "--tokens"))
      tokens = (uint32_t)atoi(v);
    else if (!strcmp(a, "--chunk"))
      chunk = (uint32_t)atoi(v);
    else if (!strcmp(a, "--runs"))
      runs = (uint32_t)atoi(v);
    else if (!strcmp(a, "--batches"))
      batches = (uint32_t)atoi(v);
    else if (!strcmp(a, "--threads"))
      threads = (uint32_t)atoi(v);
    else
      die("unknown option %s", a);
    i++;
  }
  if (layers < 1 || layers > 43 || tokens < 64 || tokens > 16384 || runs < 1 || batches < 10)
    die("layers 1..43, tokens 64..16384, runs >= 1, batches >= 10");
  ssize_t r = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (r <= 0)
    die("cannot find this program");
  self[r] = '\0';
  *strrchr(self, '/') = '\0';
  snprintf(daemon_path, sizeof(daemon_path), "%s/../../dsv4d", self);
  snprintf(bare_path, sizeof(bare_path), "%s/bare_server", self);
  signal(SIGPIPE, SIG_IGN);

  char s_layers[32], s_blocks[32], s_chunk[32], s_threads[32];
  snprintf(s_threads, sizeof(s_threads), "%u", threads);
  snprintf(s_layers, sizeof(s_layers), "0-%u", layers - 1);
  snprintf(s_blocks, sizeof(s_blocks), "%u", tokens / 64 + 8);
  snprintf(s_chunk, sizeof(s_chunk), "%u", chunk);
  char *dargv[] = {(char *)(dpath ? dpath : daemon_path),
                   "--port",
                   "0",
                   "--admin-port",
                   "0",
                   "--heads",
                   "1",
                   "--threads",
                   s_threads,
                   "--layers",
                   s_layers,
                   "--kv-blocks",
                   s_blocks,
                   "--admin-dump-chunk-bytes",
                   s_chunk,
                   "--log-level",
                   "info",
                   NULL};
  int data_port, admin_port;
  start_daemon(dargv, &data_port, &admin_port);

  size_t cap = 1 << 20;
  uint8_t *scratch = malloc(cap);
  int fd = connect_port(data_port);
  for (uint32_t l = 0; l < layers; l++) {
    size_t len;
    uint8_t *b = forward_body(l, "bench", 0, tokens, l == 0, &len);
    post_forward(fd, b, len, scratch, cap);
    free(b);
  }
  close(fd);

  uint64_t *d_ns = calloc(runs, 8), *b_ns = calloc(runs, 8), size = 0, ns;
  for (uint32_t i = 0; i < runs; i++) {
    size = timed_get(admin_port, "/admin/v1/dump?seq=bench", NULL, scratch, cap, &ns);
    d_ns[i] = ns;
  }
  int bare_port = start_bare(bpath ? bpath : bare_path, size);
  char extra[64];
  snprintf(extra, sizeof(extra), "Bench-Response-Bytes: %llu", (unsigned long long)size);
  for (uint32_t i = 0; i < runs; i++) {
    uint64_t got = timed_get(bare_port, "/", extra, scratch, cap, &ns);
    if (got != size)
      die("bare server sent %llu bytes, not %llu", (unsigned long long)got,
          (unsigned long long)size);
    b_ns[i] = ns;
  }
  stop_child(&bare_pid);
  qsort(d_ns, runs, 8, cmp_u64);
  qsort(b_ns, runs, 8, cmp_u64);
  double mb = (double)size / 1e6;
  printf("dump of %u layers x %u tokens: %llu bytes, chunk %u bytes, daemon threads %s, %u runs "
         "each\n",
         layers, tokens, (unsigned long long)size, chunk, threads ? s_threads : "cores", runs);
  printf("%-22s %10s %10s %10s %10s\n", "", "best ms", "best MB/s", "median ms", "median MB/s");
  printf("%-22s %10.2f %10.0f %10.2f %10.0f\n", "daemon /admin/v1/dump", d_ns[0] * 1e-6,
         mb / (d_ns[0] * 1e-9), d_ns[runs / 2] * 1e-6, mb / (d_ns[runs / 2] * 1e-9));
  printf("%-22s %10.2f %10.0f %10.2f %10.0f\n", "bare_server", b_ns[0] * 1e-6,
         mb / (b_ns[0] * 1e-9), b_ns[runs / 2] * 1e-6, mb / (b_ns[runs / 2] * 1e-9));
  printf("%-22s %10s %9.1f%% %10s %9.1f%%\n", "daemon / bare", "", 100.0 * b_ns[0] / d_ns[0], "",
         100.0 * b_ns[runs / 2] / d_ns[runs / 2]);

  /* Forward latency: idle, then while dumps stream back to back. */
  uint64_t *idle = calloc(batches, 8), *busy = calloc(batches, 8);
  double q0[N_LE], q1[N_LE];
  latency(data_port, 0, batches, idle, scratch, cap);
  queue_buckets(data_port, q0);
  dump_loop_t L = {.port = admin_port};
  snprintf(L.path, sizeof(L.path), "/admin/v1/dump?seq=bench");
  pthread_t th;
  pthread_create(&th, NULL, dump_loop, &L);
  usleep(20000);
  latency(data_port, batches, batches, busy, scratch, cap);
  queue_buckets(data_port, q1);
  L.stop = 1;
  pthread_join(th, NULL);
  double chunk_ms = L.ns ? (double)chunk / ((double)L.bytes / (double)L.ns) * 1e-6 : 0;
  double dump_ms = L.dumps ? (double)L.ns / (double)L.dumps * 1e-6 : 0;
  printf(
      "\none-token forward batches (layer 0), %u each; %llu dumps streamed during the second set\n",
      batches, (unsigned long long)L.dumps);
  printf("%-22s %10s %10s %10s\n", "latency ms", "p50", "p99", "max");
  printf("%-22s %10.3f %10.3f %10.3f\n", "idle daemon", idle[batches / 2] * 1e-6,
         idle[batches * 99 / 100] * 1e-6, idle[batches - 1] * 1e-6);
  printf("%-22s %10.3f %10.3f %10.3f\n", "during dumps", busy[batches / 2] * 1e-6,
         busy[batches * 99 / 100] * 1e-6, busy[batches - 1] * 1e-6);
  printf("one chunk at the dump's rate: %.3f ms; one whole dump: %.1f ms\n", chunk_ms, dump_ms);
  /* The executor queue wait of the batches sent during dumps (dsv4d_forward_seconds{stage=queue}):
   * what a batch waited for behind dump steps, without the client's and the loop's share. */
  printf("executor queue wait of those batches (cumulative):");
  for (int i = 0; i < N_LE; i++)
    if (q1[i] >= 0 && q0[i] >= 0 && (i == 0 || q1[i - 1] - q0[i - 1] < batches))
      printf(" <=%s s: %.0f", le_names[i], q1[i] - q0[i]);
  printf("\n");

  stop_child(&daemon_pid);
  free(scratch);
  free(d_ns);
  free(b_ns);
  free(idle);
  free(busy);
  return 0;
}
