#ifndef DSV4_TESTS_BENCH_BENCH_DAEMON_H
#define DSV4_TESTS_BENCH_BENCH_DAEMON_H

/*
 * Starting the daemon for a benchmark (http_bench, shm_bench): its stderr goes to a file, read here
 * for the "listening" line of its data port (a file never fills up and blocks the daemon the way an
 * unread pipe would), and the last lines of that log are printed when something fails.
 */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include "bench_child.h"

/* Where a server listens: a loopback TCP port, or a Unix socket when path is not empty. */
typedef struct {
  int port;
  char path[108];
} bench_target_t;

/* A blocking connection to t, or -1 with errno set. */
static inline int bench_connect(const bench_target_t *t) {
  int unix_socket = t->path[0] != '\0';
  int fd = socket(unix_socket ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  int rc;
  if (unix_socket) {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", t->path);
    rc = connect(fd, (struct sockaddr *)&a, sizeof(a));
  } else {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)t->port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = connect(fd, (struct sockaddr *)&a, sizeof(a));
  }
  if (rc < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

/* The target in words, for messages and tables. */
static inline const char *bench_target_name(const bench_target_t *t, char *buf, size_t len) {
  if (t->path[0])
    snprintf(buf, len, "%s", t->path);
  else
    snprintf(buf, len, "127.0.0.1:%d", t->port);
  return buf;
}

typedef struct {
  const char *prog; /* the benchmark's name, for messages */
  pid_t pid;        /* -1 when not running */
  char log[64];     /* the daemon's log file */
} bench_daemon_t;

/* The port of the "data" listener from a JSON-lines log line, or -1. */
static inline int bench_listening_port(const char *line) {
  if (!strstr(line, "\"listening\"") || !strstr(line, "\"data\""))
    return -1;
  const char *p = strstr(line, "\"port\"");
  if (!p)
    return -1;
  p += 6;
  while (*p == ' ' || *p == ':')
    p++;
  char *end;
  long v = strtol(p, &end, 10);
  return end != p && v > 0 && v < 65536 ? (int)v : -1;
}

/* The last lines of the daemon's log (it logs every request, so the whole file can be long). */
static inline void bench_daemon_log_tail(const bench_daemon_t *d) {
  enum { TAIL = 20, LINE = 1024 };
  static char ring[TAIL][LINE];
  FILE *f = fopen(d->log, "r");
  if (!f)
    return;
  size_t n = 0;
  while (fgets(ring[n % TAIL], LINE, f)) {
    size_t l = strlen(ring[n % TAIL]);
    /* Long lines are cut; skip their remainder so that it does not count as a line. */
    if (l && ring[n % TAIL][l - 1] != '\n') {
      int ch;
      while ((ch = fgetc(f)) != EOF && ch != '\n')
        ;
    }
    n++;
  }
  fclose(f);
  fprintf(stderr, "%s: last lines of the daemon log (%s):\n", d->prog, d->log);
  for (size_t i = n > TAIL ? n - TAIL : 0; i < n; i++) {
    const char *line = ring[i % TAIL];
    fputs(line, stderr);
    if (!strchr(line, '\n'))
      fputc('\n', stderr);
  }
}

/* Fork and exec argv with stderr to a fresh log file; 0, or -1 with the reason printed. */
static inline int bench_daemon_spawn(bench_daemon_t *d, char **argv) {
  snprintf(d->log, sizeof(d->log), "/tmp/%.24s_daemon_XXXXXX", d->prog);
  int lfd = mkstemp(d->log);
  if (lfd < 0) {
    fprintf(stderr, "%s: cannot create a log file: %s\n", d->prog, strerror(errno));
    return -1;
  }
  d->pid = fork();
  if (d->pid < 0) {
    fprintf(stderr, "%s: fork: %s\n", d->prog, strerror(errno));
    return -1;
  }
  if (d->pid == 0) {
    dup2(lfd, 2);
    int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      dup2(devnull, 0);
      dup2(devnull, 1);
    }
    execvp(argv[0], argv);
    fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  close(lfd);
  return 0;
}

/*
 * Start the daemon and wait up to 60 s for its data port. Every listener is bound before the daemon
 * logs the first "listening" line, so its Unix and shared-region sockets are up by then too.
 */
static inline int bench_daemon_start(bench_daemon_t *d, char **argv) {
  if (bench_daemon_spawn(d, argv))
    return -1;
  FILE *f = fopen(d->log, "r");
  if (!f) {
    fprintf(stderr, "%s: cannot read %s\n", d->prog, d->log);
    return -1;
  }
  char line[4096];
  size_t have = 0;
  uint64_t until = now_ns() + 60ull * 1000000000u;
  while (now_ns() < until) {
    /* A partial line is kept only while room is left after it; stated here too, so that the read's
     * size is provably within line[] (gcc 13's fortified fgets could not see it through the loop).
     */
    if (have >= sizeof(line) - 1)
      have = 0;
    if (fgets(line + have, (int)(sizeof(line) - have), f)) {
      have = strlen(line);
      if (have && line[have - 1] != '\n' && have < sizeof(line) - 1)
        continue; /* a partial line: the rest comes later */
      int port = bench_listening_port(line);
      have = 0;
      if (port > 0) {
        fclose(f);
        return port;
      }
      continue;
    }
    clearerr(f);
    if (waitpid(d->pid, NULL, WNOHANG) == d->pid) {
      d->pid = -1;
      fclose(f);
      fprintf(stderr, "%s: the daemon exited before listening\n", d->prog);
      bench_daemon_log_tail(d);
      return -1;
    }
    usleep(20000);
  }
  fclose(f);
  fprintf(stderr, "%s: no \"listening\" line from the daemon within 60 s\n", d->prog);
  bench_daemon_log_tail(d);
  return -1;
}

/* ---- The daemon's own stage timings ---- */

#define N_STAGES 4
static const char *const stage_names[N_STAGES] = {"queue", "validate", "plan", "kernel"};

typedef struct {
  double sum[N_STAGES];
  double count[N_STAGES];
  /* dsv4d_forward_request_seconds over every class: an HTTP forward's whole time in the daemon,
   * from its first byte to its answer handed to the socket. */
  double req_sum, req_count;
  /* dsv4d_shm_forward_seconds over every class: a shared-region forward's, from its message read
   * to its answer sent. */
  double shm_sum, shm_count;
  int ok;
} stages_t;

/* Add the value of a histogram's _sum or _count line (name_ its family's name and "_") to *sum or
 * *count. */
static inline void scrape_sum_count(const char *line, const char *name_, double *sum,
                                    double *count) {
  const char *at = strstr(line, name_);
  if (!at || line[0] == '#')
    return;
  const char *close_brace = strchr(at, '}');
  at += strlen(name_);
  if (close_brace && strncmp(at, "sum{", 4) == 0)
    *sum += strtod(close_brace + 1, NULL);
  else if (close_brace && strncmp(at, "count{", 6) == 0)
    *count += strtod(close_brace + 1, NULL);
}

/*
 * Read the forward_seconds histogram's _sum and _count per stage from GET /metrics (a blocking
 * exchange on its own connection, outside any measured window). Differences of two scrapes give the
 * daemon's mean time per batch in each stage over the window between them.
 */
static inline int scrape_stages(const bench_target_t *t, stages_t *out) {
  memset(out, 0, sizeof(*out));
  int fd = bench_connect(t);
  if (fd < 0)
    return -1;
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  static const char req[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  size_t cap = 1 << 20, len = 0;
  char *buf = malloc(cap + 1);
  if (!buf || send(fd, req, sizeof(req) - 1, MSG_NOSIGNAL) != (ssize_t)(sizeof(req) - 1)) {
    free(buf);
    close(fd);
    return -1;
  }
  for (;;) {
    ssize_t r = recv(fd, buf + len, cap - len, 0);
    if (r <= 0)
      break;
    len += (size_t)r;
    if (len == cap)
      break;
  }
  close(fd);
  buf[len] = '\0';
  for (char *line = buf; line && *line;) {
    char *nl = strchr(line, '\n');
    if (nl)
      *nl = '\0';
    /* e.g. dsv4d_forward_seconds_sum{stage="kernel",class="prefill"} 0.0123: the classes of a
     * stage add up. */
    char *m = strstr(line, "dsv4d_forward_seconds_");
    scrape_sum_count(line, "dsv4d_forward_request_seconds_", &out->req_sum, &out->req_count);
    scrape_sum_count(line, "dsv4d_shm_forward_seconds_", &out->shm_sum, &out->shm_count);
    if (m && line[0] != '#') {
      int is_sum = strncmp(m + 22, "sum{", 4) == 0, is_count = strncmp(m + 22, "count{", 6) == 0;
      char *st = strstr(m, "stage=\"");
      char *close_brace = strchr(m, '}');
      if ((is_sum || is_count) && st && close_brace) {
        st += 7;
        for (int k = 0; k < N_STAGES; k++) {
          size_t sl = strlen(stage_names[k]);
          if (strncmp(st, stage_names[k], sl) == 0 && st[sl] == '"') {
            double v = strtod(close_brace + 1, NULL);
            if (is_sum)
              out->sum[k] += v;
            else
              out->count[k] += v;
            out->ok = 1;
          }
        }
      }
    }
    line = nl ? nl + 1 : NULL;
  }
  free(buf);
  return out->ok ? 0 : -1;
}

#endif /* DSV4_TESTS_BENCH_BENCH_DAEMON_H */
