#include "commands.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "client.h"
#include "dsv4-error.h"
#include "fmt.h"
#include "verify.h"

typedef struct {
  const dsv4_ctl_args_t *a;
  FILE *out, *err;
  dsv4_ctl_url_t url;
  char *token;
  dsv4_ctl_request_t req;
} ctx_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A daemon's answer other than 200 to method target: the error line on err (and with --json the
 * document itself on out, for scripts that read the code). Exit 1. */
static int method_error(ctx_t *c, const char *method, const char *target,
                        const dsv4_ctl_response_t *r) {
  char line[512];
  dsv4_ctl_format_error(r->status, r->body, r->body_len, line, sizeof(line));
  if (r->retry_after[0])
    fprintf(c->err, "dsv4ctl: %s %s: %s (retry after %s s)\n", method, target, line,
            r->retry_after);
  else if (r->status == 401 && !c->token)
    fprintf(c->err, "dsv4ctl: %s %s: %s (no --token-file given)\n", method, target, line);
  else
    fprintf(c->err, "dsv4ctl: %s %s: %s\n", method, target, line);
  if (c->a->json && r->body) {
    json_t *doc = json_loadb(r->body, r->body_len, 0, NULL);
    if (doc) {
      json_dumpf(doc, c->out, JSON_COMPACT);
      fputc('\n', c->out);
      json_decref(doc);
    }
  }
  return DSV4_CTL_EXIT_ERROR;
}

static int daemon_error(ctx_t *c, const char *target, const dsv4_ctl_response_t *r) {
  return method_error(c, "GET", target, r);
}

/* method target (with a body when given) on the daemon of req, whose answer must be 200 or 201 with
 * a JSON object: 0 with *doc, or the exit code after printing why. */
static int call_json(ctx_t *c, const dsv4_ctl_request_t *req, const char *method,
                     const char *target, const uint8_t *body, size_t body_len, json_t **doc) {
  *doc = NULL;
  dsv4_ctl_response_t r;
  char err[DSV4_CTL_ERR_LEN];
  int rc = dsv4_ctl_send(req, method, target, body, body_len, &r, err, sizeof(err));
  if (rc != 0) {
    fprintf(c->err, "dsv4ctl: %s %s: %s\n", method, target, err);
    return DSV4_CTL_EXIT_USAGE;
  }
  if (r.status != 200 && r.status != 201) {
    rc = method_error(c, method, target, &r);
    dsv4_ctl_response_free(&r);
    return rc;
  }
  json_error_t je;
  *doc = json_loadb(r.body ? r.body : "", r.body_len, 0, &je);
  if (!*doc || !json_is_object(*doc)) {
    fprintf(c->err, "dsv4ctl: %s %s: the answer is not a JSON object (%s)\n", method, target,
            *doc ? "another JSON value" : je.text);
    json_decref(*doc);
    *doc = NULL;
    dsv4_ctl_response_free(&r);
    return DSV4_CTL_EXIT_USAGE;
  }
  dsv4_ctl_response_free(&r);
  return 0;
}

/* GET target and parse its JSON document: 0 with *doc, or the exit code after printing why. */
static int get_json(ctx_t *c, const char *target, json_t **doc) {
  return call_json(c, &c->req, "GET", target, NULL, 0, doc);
}

static int show(ctx_t *c, const char *target, void (*print)(FILE *, const json_t *)) {
  json_t *doc;
  int rc = get_json(c, target, &doc);
  if (rc != 0)
    return rc;
  if (c->a->json) {
    json_dumpf(doc, c->out, JSON_COMPACT);
    fputc('\n', c->out);
  } else {
    print(c->out, doc);
  }
  json_decref(doc);
  return DSV4_CTL_EXIT_OK;
}

/* -- dump: the body goes straight to FILE.part; the rename happens only after it all arrived. */

typedef struct {
  ctx_t *c;
  const char *part;
  int fd;
  int show; /* 0 none, 1 a line rewritten in place (tty), 2 a line per second */
  uint64_t got;
  int64_t total;
  double t0, last;
  char why[DSV4_CTL_ERR_LEN];
} dump_t;

/* Seconds between two progress reports: on a terminal (one line redrawn), else (a line each). */
#define PROGRESS_TTY_S 0.1
#define PROGRESS_LOG_S 1.0
/* The file a dump streams into until it is complete: the output's name and this suffix. */
#define PART_SUFFIX ".part"

static void progress(dump_t *d, int final) {
  if (!d->show)
    return;
  double t = now_s();
  if (!final && t - d->last < (d->show == 1 ? PROGRESS_TTY_S : PROGRESS_LOG_S))
    return;
  d->last = t;
  double mib = (double)d->got / (1024.0 * 1024.0), el = t - d->t0;
  char tot[64] = "";
  if (d->total >= 0)
    snprintf(tot, sizeof(tot), " / %.2f MiB (%3.0f%%)", (double)d->total / (1024.0 * 1024.0),
             d->total ? 100.0 * (double)d->got / (double)d->total : 100.0);
  fprintf(d->c->err, "%sdump %s: %.2f MiB%s, %.1f MiB/s%s", d->show == 1 ? "\r" : "", d->c->a->seq,
          mib, tot, el > 0 ? mib / el : 0.0, d->show == 1 && !final ? "   " : "\n");
  fflush(d->c->err);
}

static int dump_headers(void *ud, const dsv4_ctl_response_t *r) {
  dump_t *d = ud;
  if (r->status != 200)
    return 0; /* an error document: buffer it */
  d->total = r->content_length;
  d->fd = open(d->part, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (d->fd < 0) {
    snprintf(d->why, sizeof(d->why), "%s: %s", d->part, strerror(errno));
    return DSV4_EIO;
  }
  d->t0 = d->last = now_s();
  progress(d, 0);
  return 1;
}

static int dump_data(void *ud, const uint8_t *p, size_t n) {
  dump_t *d = ud;
  while (n > 0) {
    ssize_t w = write(d->fd, p, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0) {
      snprintf(d->why, sizeof(d->why), "writing %s: %s", d->part, strerror(errno));
      return DSV4_EIO;
    }
    p += w;
    n -= (size_t)w;
    d->got += (uint64_t)w;
  }
  progress(d, 0);
  return 0;
}

static int cmd_dump(ctx_t *c, const char *target) {
  const dsv4_ctl_args_t *a = c->a;
  size_t plen = strlen(a->output) + sizeof(PART_SUFFIX);
  char *part = malloc(plen);
  if (!part) {
    fprintf(c->err, "dsv4ctl: out of memory\n");
    return DSV4_CTL_EXIT_USAGE;
  }
  snprintf(part, plen, "%s" PART_SUFFIX, a->output);
  dump_t d = {.c = c, .part = part, .fd = -1, .total = -1};
  d.show = a->progress == 1 ? (c->err && isatty(fileno(c->err)) ? 1 : 2) : 0;
  dsv4_ctl_sink_t sink = {.on_headers = dump_headers, .on_data = dump_data, .ud = &d};
  dsv4_ctl_request_t req = c->req;
  req.sink = &sink;
  dsv4_ctl_response_t r;
  char err[DSV4_CTL_ERR_LEN];
  int rc = dsv4_ctl_get(&req, target, &r, err, sizeof(err));
  int exit_code = DSV4_CTL_EXIT_OK;
  if (rc != 0) {
    if (d.show == 1 && d.got)
      fputc('\n', c->err);
    fprintf(c->err, "dsv4ctl: GET %s: %s\n", target, d.why[0] ? d.why : err);
    exit_code = DSV4_CTL_EXIT_USAGE;
  } else if (r.status != 200) {
    exit_code = daemon_error(c, target, &r);
  } else if (r.content_length < 0) {
    fprintf(c->err,
            "dsv4ctl: GET %s: the answer has no Content-Length, so a dump cut short could not be "
            "told from a whole one\n",
            target);
    exit_code = DSV4_CTL_EXIT_USAGE;
  } else if ((uint64_t)r.content_length != d.got) {
    fprintf(c->err, "dsv4ctl: GET %s: %" PRIu64 " bytes written of %lld\n", target, d.got,
            (long long)r.content_length);
    exit_code = DSV4_CTL_EXIT_USAGE;
  } else {
    progress(&d, 1);
  }
  if (rc == 0)
    dsv4_ctl_response_free(&r);
  if (d.fd >= 0) {
    /* The file is renamed into place only once its bytes are on disk. */
    if (exit_code == DSV4_CTL_EXIT_OK && fsync(d.fd) != 0) {
      fprintf(c->err, "dsv4ctl: fsync %s: %s\n", part, strerror(errno));
      exit_code = DSV4_CTL_EXIT_USAGE;
    }
    if (close(d.fd) != 0 && exit_code == DSV4_CTL_EXIT_OK) {
      fprintf(c->err, "dsv4ctl: close %s: %s\n", part, strerror(errno));
      exit_code = DSV4_CTL_EXIT_USAGE;
    }
    if (exit_code == DSV4_CTL_EXIT_OK && rename(part, a->output) != 0) {
      fprintf(c->err, "dsv4ctl: rename %s to %s: %s\n", part, a->output, strerror(errno));
      exit_code = DSV4_CTL_EXIT_USAGE;
    }
    if (exit_code != DSV4_CTL_EXIT_OK)
      unlink(part);
  }
  free(part);
  if (exit_code != DSV4_CTL_EXIT_OK)
    return exit_code;

  /* What arrived is checked like any file: the digests the daemon computed against the bytes. */
  dsv4_ctl_verify_t v;
  rc = dsv4_ctl_verify_file(a->output, &v);
  if (rc != 0) {
    fprintf(c->err, "dsv4ctl: %s: the dump is not well-formed: %s\n", a->output, v.error);
    exit_code = DSV4_CTL_EXIT_USAGE;
  } else {
    dsv4_ctl_verify_print(c->out, a->output, &v, a->json);
    exit_code = dsv4_ctl_verify_all_ok(&v) ? DSV4_CTL_EXIT_OK : DSV4_CTL_EXIT_ERROR;
  }
  dsv4_ctl_verify_free(&v);
  return exit_code;
}

/* -- restore and migrate: a dump sent with PUT, its digests checked where it landed. */

/* A whole file mapped read-only: 0, or DSV4_EIO with why set. */
static int map_file(const char *path, const uint8_t **buf, size_t *len, char *why, size_t why_len) {
  struct stat sb;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  *buf = NULL;
  *len = 0;
  if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size == 0) {
    snprintf(why, why_len, "%s: %s", path,
             fd < 0 ? strerror(errno) : "not a regular file with a dump in it");
    if (fd >= 0)
      close(fd);
    return DSV4_EIO;
  }
  void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    snprintf(why, why_len, "%s: mmap: %s", path, strerror(errno));
    return DSV4_EIO;
  }
  *buf = m;
  *len = (size_t)sb.st_size;
  return 0;
}

/* What a restore's answer says, as a table: the sequence, then per layer its next and digest. */
static void print_restored(FILE *out, const json_t *doc) {
  fprintf(out, "%s %s: p0 %lld, %lld blocks\n",
          json_is_true(json_object_get(doc, "replaced")) ? "replaced" : "restored",
          json_string_value(json_object_get(doc, "seq")),
          (long long)json_integer_value(json_object_get(doc, "p0")),
          (long long)json_integer_value(json_object_get(doc, "blocks")));
  fprintf(out, "%-5s  %12s  %-16s\n", "LAYER", "NEXT", "DIGEST");
  const char *k;
  json_t *v;
  json_object_foreach(json_object_get(doc, "digests"), k, v) {
    json_t *next = json_object_get(json_object_get(doc, "next"), k);
    fprintf(out, "%-5s  %12lld  %-16s\n", k, (long long)json_integer_value(next),
            json_string_value(v));
  }
}

/* PUT the dump buf to seq on the daemon of req: 0 with *doc, or the exit code after printing. */
static int put_dump(ctx_t *c, const dsv4_ctl_request_t *req, const char *seq, int replace,
                    const uint8_t *buf, size_t len, json_t **doc) {
  char target[256];
  snprintf(target, sizeof(target), "/admin/v1/sequences/%s%s", seq, replace ? "?replace=1" : "");
  return call_json(c, req, "PUT", target, buf, len, doc);
}

static int cmd_restore(ctx_t *c) {
  const dsv4_ctl_args_t *a = c->a;
  const uint8_t *buf;
  size_t len;
  char why[DSV4_CTL_ERR_LEN];
  json_t *doc;
  if (map_file(a->file, &buf, &len, why, sizeof(why)) != 0) {
    fprintf(c->err, "dsv4ctl: restore: %s\n", why);
    return DSV4_CTL_EXIT_USAGE;
  }
  int rc = put_dump(c, &c->req, a->seq, a->replace, buf, len, &doc);
  munmap((void *)buf, len);
  if (rc != 0)
    return rc;
  if (a->json) {
    json_dumpf(doc, c->out, JSON_COMPACT);
    fputc('\n', c->out);
  } else {
    print_restored(c->out, doc);
  }
  json_decref(doc);
  return DSV4_CTL_EXIT_OK;
}

/* The other daemon of a migrate: its URL and token. */
typedef struct {
  dsv4_ctl_url_t url;
  char *token;
  dsv4_ctl_request_t req;
} peer_t;

/* Whether the digests of seq on the daemon of req are those the dump's layers say: 0, 1 when one
 * differs (named on err), or the exit code of a failed call. */
static int same_digests(ctx_t *c, const dsv4_ctl_request_t *req, const dsv4_ctl_verify_t *v,
                        const char *where) {
  for (size_t i = 0; i < v->n_layers; i++) {
    char target[256];
    json_t *doc;
    snprintf(target, sizeof(target), "/admin/v1/checksums?layer=%u&seq=%s", v->layers[i].layer,
             c->a->seq);
    int rc = call_json(c, req, "GET", target, NULL, 0, &doc);
    if (rc != 0)
      return rc;
    const char *got = json_string_value(
        json_object_get(json_object_get(json_object_get(doc, "sequences"), c->a->seq), "digest"));
    int same = got && strcmp(got, v->layers[i].expected) == 0;
    if (!same)
      fprintf(c->err, "dsv4ctl: migrate %s: layer %u on the %s has digest %s, the dump %s\n",
              c->a->seq, v->layers[i].layer, where, got ? got : "(none)", v->layers[i].expected);
    json_decref(doc);
    if (!same)
      return 1;
  }
  return 0;
}

/* DELETE seq on the daemon of req: 0 once it answered 204, else the exit code after printing. */
static int delete_seq(ctx_t *c, const dsv4_ctl_request_t *req) {
  char target[256], err[DSV4_CTL_ERR_LEN];
  dsv4_ctl_response_t r;
  snprintf(target, sizeof(target), "/admin/v1/sequences/%s", c->a->seq);
  int rc = dsv4_ctl_send(req, "DELETE", target, NULL, 0, &r, err, sizeof(err));
  if (rc != 0) {
    fprintf(c->err, "dsv4ctl: DELETE %s: %s\n", target, err);
    return DSV4_CTL_EXIT_USAGE;
  }
  rc = r.status == 204 ? 0 : method_error(c, "DELETE", target, &r);
  dsv4_ctl_response_free(&r);
  return rc;
}

/* Migrate step 1: the source's dump of every layer, in memory, checked like any dump. */
static int migrate_fetch(ctx_t *c, dsv4_ctl_response_t *r, dsv4_ctl_verify_t *v) {
  char target[256], err[DSV4_CTL_ERR_LEN];
  dsv4_ctl_request_t req = c->req;
  memset(v, 0, sizeof(*v));
  req.max_buffer = SIZE_MAX / 2;
  snprintf(target, sizeof(target), "/admin/v1/dump?seq=%s", c->a->seq);
  int rc = dsv4_ctl_get(&req, target, r, err, sizeof(err));
  if (rc != 0) {
    fprintf(c->err, "dsv4ctl: GET %s: %s\n", target, err);
    return DSV4_CTL_EXIT_USAGE;
  }
  if (r->status != 200)
    return method_error(c, "GET", target, r);
  if (r->content_length < 0 || (uint64_t)r->content_length != r->body_len) {
    fprintf(c->err, "dsv4ctl: GET %s: %zu bytes of %lld\n", target, r->body_len,
            (long long)r->content_length);
    return DSV4_CTL_EXIT_USAGE;
  }
  if (dsv4_ctl_verify_buffer((const uint8_t *)r->body, r->body_len, v) != 0) {
    fprintf(c->err, "dsv4ctl: GET %s: not a dump: %s\n", target, v->error);
    return DSV4_CTL_EXIT_USAGE;
  }
  if (!dsv4_ctl_verify_all_ok(v)) {
    fprintf(c->err, "dsv4ctl: GET %s: the dump does not match its own digests\n", target);
    return DSV4_CTL_EXIT_ERROR;
  }
  return 0;
}

/* Migrate steps 2 to 4: restore on the target, its digests there, the source unchanged meanwhile.
 * On a failure after the restore the target's copy is deleted again. */
static int migrate_place(ctx_t *c, peer_t *to, const dsv4_ctl_response_t *r,
                         const dsv4_ctl_verify_t *v) {
  json_t *doc;
  const char *seq = c->a->seq, *why = NULL;
  int rc = put_dump(c, &to->req, seq, 0, (const uint8_t *)r->body, r->body_len, &doc);
  if (rc != 0) {
    fprintf(c->err, "dsv4ctl: migrate %s: the target refused it; the source is intact\n", seq);
    return rc;
  }
  json_decref(doc);
  rc = same_digests(c, &to->req, v, "target");
  if (rc != 0)
    why = "its digests on the target differ from the dump's";
  /* A batch that reached the source after the dump would be lost by the delete. */
  if (rc == 0 && (rc = same_digests(c, &c->req, v, "source")) != 0)
    why = "the source moved on after the dump (route no batches of it to the source meanwhile)";
  if (rc == 0)
    return 0;
  int del = delete_seq(c, &to->req);
  fprintf(c->err, "dsv4ctl: migrate %s: %s; the source is intact, %s\n", seq,
          why ? why : "a digest could not be read",
          del == 0 ? "the target's copy was deleted" : "the target's copy could NOT be deleted");
  return rc < 0 || rc == DSV4_CTL_EXIT_USAGE ? DSV4_CTL_EXIT_USAGE : DSV4_CTL_EXIT_ERROR;
}

static int cmd_migrate(ctx_t *c) {
  const dsv4_ctl_args_t *a = c->a;
  peer_t to;
  char msg[DSV4_CTL_ERR_LEN];
  memset(&to, 0, sizeof(to));
  const char *tok_file = a->to_token_file ? a->to_token_file : a->token_file;
  if (dsv4_ctl_url_parse(a->to, &to.url, msg, sizeof(msg)) != 0 ||
      (tok_file && dsv4_ctl_read_token(tok_file, &to.token, msg, sizeof(msg)) != 0)) {
    fprintf(c->err, "dsv4ctl: --to: %s\n", msg);
    return DSV4_CTL_EXIT_USAGE;
  }
  to.req = (dsv4_ctl_request_t){.url = &to.url, .token = to.token, .timeout_ms = a->timeout_ms};
  dsv4_ctl_response_t r;
  dsv4_ctl_verify_t v;
  memset(&r, 0, sizeof(r));
  int rc = migrate_fetch(c, &r, &v);
  if (rc != 0)
    fprintf(c->err, "dsv4ctl: migrate %s: nothing changed\n", a->seq);
  if (rc == 0)
    rc = migrate_place(c, &to, &r, &v);
  if (rc == 0 && (rc = delete_seq(c, &c->req)) != 0)
    fprintf(c->err,
            "dsv4ctl: migrate %s: restored and verified on the target, but the source's could "
            "not be deleted: it is now on both; delete it on the source\n",
            a->seq);
  if (rc == 0) {
    if (a->json) {
      json_t *doc =
          json_pack("{s:s,s:s,s:s,s:I,s:I,s:b}", "seq", a->seq, "from", a->admin, "to", a->to,
                    "bytes", (json_int_t)r.body_len, "layers", (json_int_t)v.n_layers, "ok", 1);
      json_dumpf(doc, c->out, JSON_COMPACT);
      fputc('\n', c->out);
      json_decref(doc);
    } else {
      fprintf(c->out, "migrated %s: %zu bytes, %zu layers with equal digests, deleted on %s\n",
              a->seq, r.body_len, v.n_layers, a->admin);
    }
  }
  dsv4_ctl_verify_free(&v);
  dsv4_ctl_response_free(&r);
  free(to.token);
  return rc;
}

static int cmd_verify(const dsv4_ctl_args_t *a, FILE *out, FILE *err) {
  dsv4_ctl_verify_t v;
  int rc = dsv4_ctl_verify_file(a->file, &v);
  int exit_code;
  if (rc != 0) {
    fprintf(err, "dsv4ctl: verify %s: %s\n", a->file, v.error);
    exit_code = DSV4_CTL_EXIT_USAGE;
  } else {
    dsv4_ctl_verify_print(out, a->file, &v, a->json);
    exit_code = dsv4_ctl_verify_all_ok(&v) ? DSV4_CTL_EXIT_OK : DSV4_CTL_EXIT_ERROR;
  }
  dsv4_ctl_verify_free(&v);
  return exit_code;
}

int dsv4_ctl_run(const dsv4_ctl_args_t *a, FILE *out, FILE *err, int err_is_tty) {
  switch (a->cmd) {
  case DSV4_CTL_CMD_HELP:
    fputs(dsv4_ctl_usage, out);
    return DSV4_CTL_EXIT_OK;
  case DSV4_CTL_CMD_VERSION:
    fprintf(out, "dsv4ctl %s\n", DSV4_VERSION);
    return DSV4_CTL_EXIT_OK;
  case DSV4_CTL_CMD_VERIFY:
    return cmd_verify(a, out, err);
  default:
    break;
  }

  ctx_t c = {.a = a, .out = out, .err = err};
  char msg[DSV4_CTL_ERR_LEN];
  if (dsv4_ctl_url_parse(a->admin, &c.url, msg, sizeof(msg)) != 0) {
    fprintf(err, "dsv4ctl: %s\n", msg);
    return DSV4_CTL_EXIT_USAGE;
  }
  if (a->token_file && dsv4_ctl_read_token(a->token_file, &c.token, msg, sizeof(msg)) != 0) {
    fprintf(err, "dsv4ctl: %s\n", msg);
    return DSV4_CTL_EXIT_USAGE;
  }
  c.req.url = &c.url;
  c.req.token = c.token;
  c.req.timeout_ms = a->timeout_ms;

  char target[512];
  int rc;
  switch (a->cmd) {
  case DSV4_CTL_CMD_STATUS:
    rc = show(&c, "/admin/v1/cache", dsv4_ctl_print_cache);
    break;
  case DSV4_CTL_CMD_SEQ:
    if (a->seq) {
      snprintf(target, sizeof(target), "/admin/v1/sequences/%s", a->seq);
      rc = show(&c, target, dsv4_ctl_print_sequence);
    } else {
      rc = show(&c, "/admin/v1/sequences", dsv4_ctl_print_sequences);
    }
    break;
  case DSV4_CTL_CMD_TOKEN:
    snprintf(target, sizeof(target), "/admin/v1/sequences/%s/tokens/%" PRId64 "?layer=%" PRIu32,
             a->seq, a->pos, a->layer);
    rc = show(&c, target, dsv4_ctl_print_token);
    break;
  case DSV4_CTL_CMD_ENTRY:
    snprintf(target, sizeof(target), "/admin/v1/sequences/%s/entries/%" PRId64 "?layer=%" PRIu32,
             a->seq, a->pos, a->layer);
    rc = show(&c, target, dsv4_ctl_print_entry);
    break;
  case DSV4_CTL_CMD_CHECKSUM:
    snprintf(target, sizeof(target), "/admin/v1/checksums?layer=%" PRIu32 "%s%s", a->layer,
             a->seq ? "&seq=" : "", a->seq ? a->seq : "");
    rc = show(&c, target, dsv4_ctl_print_checksums);
    break;
  case DSV4_CTL_CMD_RESTORE:
    rc = cmd_restore(&c);
    break;
  case DSV4_CTL_CMD_MIGRATE:
    rc = cmd_migrate(&c);
    break;
  case DSV4_CTL_CMD_SNAPSHOT:
  case DSV4_CTL_CMD_DUMP: {
    char layers[48] = "";
    if (a->has_layers)
      snprintf(layers, sizeof(layers), "&layers=%" PRIu32 "-%" PRIu32, a->layer_first,
               a->layer_last);
    snprintf(target, sizeof(target), "/admin/v1/dump?seq=%s%s", a->seq, layers);
    dsv4_ctl_args_t copy = *a;
    if (copy.progress < 0)
      copy.progress = err_is_tty;
    c.a = &copy;
    rc = cmd_dump(&c, target);
    break;
  }
  default:
    fprintf(err, "dsv4ctl: no command\n");
    rc = DSV4_CTL_EXIT_USAGE;
  }
  free(c.token);
  return rc;
}
