/*
 * Snapshots (snapshot_dir): once a drain has finished its batches, every live sequence is written
 * to the directory as a dump file (the format GET /admin/v1/dump streams), then one manifest lists
 * them; the next start restores what the manifest lists before /readyz turns 200.
 *
 * Every file is written to a temporary name, fsynced and renamed, and the directory fsynced, so a
 * crash leaves either the old file or the new one, never a mix. The manifest is written last and
 * records each file's length and XXH3, so a file that is torn, cut or corrupt afterwards is told
 * from a whole one before it is parsed; such a file is logged and skipped, and a dump that parses
 * is still checked whole (dump_format.c) before anything is restored from it. Once restored, the
 * manifest is removed first and then the files: a later crash never brings back state that the
 * gateway has moved past.
 *
 * Both run on the executor thread, where nothing else runs meanwhile (the drain has finished every
 * batch; at start-up the restore is the first job, and requests that arrive wait behind it).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "engine_admin.h"
#include "errors.h"
#include "log.h"
#include "records.h"
#include "restore.h"

#define MANIFEST "manifest.json"
#define MANIFEST_FORMAT "dsv4d-snapshot"
#define MANIFEST_VERSION 1
/* A dump file's name: the sequence's name (never starting with '.', never holding '/') and this. */
#define DUMP_SUFFIX ".safetensors"
/* A file being written: a leading '.' (no sequence name has one) and this suffix. */
#define TMP_SUFFIX ".tmp"
/* Room for a path inside snapshot_dir: the directory, '/', a 128-byte name and the suffixes. */
#define NAME_ROOM 160

/* ---- files ------------------------------------------------------------------------------- */

/* A file being written, hashed as it goes (the manifest records the XXH3 of every byte). */
typedef struct {
  int fd;
  uint64_t bytes;
  XXH3_state_t *h;
} out_t;

static int out_write(out_t *o, const void *p, size_t n) {
  const uint8_t *b = p;
  XXH3_64bits_update(o->h, p, n);
  o->bytes += n;
  while (n > 0) {
    ssize_t w = write(o->fd, b, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return DSV4_EIO;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

static void join(char *out, size_t cap, const char *dir, const char *name) {
  snprintf(out, cap, "%s/%s", dir, name);
}

static int sync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return DSV4_EIO;
  int rc = fsync(fd) == 0 ? 0 : DSV4_EIO;
  close(fd);
  return rc;
}

/* Open dir/.name.tmp for writing; *tmp receives its path. */
static int open_tmp(const char *dir, const char *name, char *tmp, size_t cap, out_t *o) {
  char leaf[NAME_ROOM + sizeof(TMP_SUFFIX) + 1];
  snprintf(leaf, sizeof(leaf), ".%s" TMP_SUFFIX, name);
  join(tmp, cap, dir, leaf);
  o->bytes = 0;
  o->h = XXH3_createState();
  if (!o->h)
    return DSV4_ENOMEM;
  XXH3_64bits_reset(o->h);
  o->fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  return o->fd < 0 ? DSV4_EIO : 0;
}

/* fsync, close and rename into place (rc: the writes' result so far); the temporary file goes on
 * any failure. */
static int close_tmp(out_t *o, int rc, const char *tmp, const char *dir, const char *name) {
  char path[PATH_MAX];
  if (!rc && fsync(o->fd) != 0)
    rc = DSV4_EIO;
  if (o->fd >= 0 && close(o->fd) != 0 && !rc)
    rc = DSV4_EIO;
  o->fd = -1;
  join(path, sizeof(path), dir, name);
  if (!rc && rename(tmp, path) != 0)
    rc = DSV4_EIO;
  if (rc)
    unlink(tmp);
  return rc;
}

/* ---- writing ------------------------------------------------------------------------------ */

typedef struct {
  char **names;
  uint32_t n, cap;
} names_t;

static int collect(const char *name, uint32_t len, const dsv4_seq_info_t *info, void *arg) {
  names_t *ns = arg;
  (void)info;
  if (ns->n == ns->cap) {
    uint32_t cap = ns->cap ? ns->cap * 2 : 16;
    char **p = realloc(ns->names, cap * sizeof(*p));
    if (!p)
      return DSV4_ENOMEM;
    ns->names = p;
    ns->cap = cap;
  }
  if (!(ns->names[ns->n] = strndup(name, len)))
    return DSV4_ENOMEM;
  ns->n++;
  return 0;
}

/* One sequence as a dump, described for the header: stored ranges, digests and state. */
typedef struct {
  dsv4_seq_info_t info;
  dsv4_seq_layer_state_t *state;
  int64_t *first, *end;
  uint64_t *digest;
  dsv4_seq_cstate_t *cstate; /* [n_served] the compressed state (SPEC §8.7) */
  uint8_t *ctail;            /* its bytes, which end the file */
  size_t ctail_len;
  uint32_t n;
} seqdump_t;

static int seqdump_read(dsv4_daemon_t *d, const char *name, seqdump_t *sd) {
  uint32_t n = d->cfg->n_served, len = (uint32_t)strlen(name);
  sd->n = n;
  sd->state = calloc(n, sizeof(*sd->state));
  sd->first = calloc(n, sizeof(*sd->first));
  sd->end = calloc(n, sizeof(*sd->end));
  sd->digest = calloc(n, sizeof(*sd->digest));
  sd->cstate = calloc(n, sizeof(*sd->cstate));
  if (!sd->state || !sd->first || !sd->end || !sd->digest || !sd->cstate)
    return DSV4_ENOMEM;
  dsv4_seq_state_t ss = {0, sd->state};
  int rc = dsv4_engine_seq_info(d->engine, name, len, &sd->info);
  if (!rc)
    rc = dsv4_engine_seq_state(d->engine, name, len, &ss);
  for (uint32_t i = 0; i < n && !rc; i++)
    rc =
        dsv4_engine_seq_digest(d->engine, i, &sd->info, &sd->digest[i], &sd->first[i], &sd->end[i]);
  for (uint32_t i = 0; i < n && !rc; i++)
    rc = dsv4_engine_read_cstate(d->engine, name, len, i, &sd->cstate[i]);
  return rc;
}

static void seqdump_free(seqdump_t *sd) {
  dsv4_seq_info_free(&sd->info);
  free(sd->state);
  free(sd->first);
  free(sd->end);
  free(sd->digest);
  for (uint32_t i = 0; sd->cstate && i < sd->n; i++)
    dsv4_engine_cstate_free(&sd->cstate[i]);
  free(sd->cstate);
  free(sd->ctail);
}

/* The records and positions of every layer after the header, a chunk of records at a time. */
static int write_body(dsv4_daemon_t *d, const seqdump_t *sd, out_t *o, uint8_t *buf, size_t cap) {
  uint32_t per = (uint32_t)(cap / DSV4_RECORD_BYTES);
  for (uint32_t i = 0; i < d->cfg->n_served; i++) {
    for (int64_t p = sd->first[i]; p < sd->end[i];) {
      uint32_t k = sd->end[i] - p < per ? (uint32_t)(sd->end[i] - p) : per;
      int rc = dsv4_engine_read_records(d->engine, i, &sd->info, p, k, buf);
      if (!rc)
        rc = out_write(o, buf, (size_t)k * DSV4_RECORD_BYTES);
      if (rc)
        return rc;
      p += k;
    }
    for (int64_t p = sd->first[i]; p < sd->end[i];) {
      uint32_t k = 0;
      for (; k < cap / 8 && p + k < sd->end[i]; k++)
        dsv4_position_put(buf + 8 * (size_t)k, p + k);
      int rc = out_write(o, buf, (size_t)k * 8);
      if (rc)
        return rc;
      p += k;
    }
  }
  return 0;
}

/* Write sequence name to dir/name.safetensors; its manifest row on success. */
static json_t *write_one(dsv4_daemon_t *d, const char *name, uint8_t *buf, size_t cap, int *rc) {
  const dsv4_config_t *cfg = d->cfg;
  char model[17], tmp[PATH_MAX], file[NAME_ROOM], hex[17];
  seqdump_t sd;
  out_t o = {-1, 0, NULL};
  uint8_t *head = NULL;
  size_t head_len = 0;
  uint64_t total = 0;
  memset(&sd, 0, sizeof(sd));
  snprintf(file, sizeof(file), "%s" DUMP_SUFFIX, name);
  *rc = seqdump_read(d, name, &sd);
  if (!*rc) {
    dsv4_dump_model_id(&cfg->model, model);
    dsv4_dump_desc_t dd = {
        .seq = name,
        .instance = d->instance,
        .model_id = model,
        .block_size = cfg->block_size,
        .heads = cfg->heads,
        .head_offset = cfg->head_offset,
        .p0 = sd.info.p0,
        .n = cfg->n_served,
        .layer = cfg->served_layers,
        .first = sd.first,
        .end = sd.end,
        .digest = sd.digest,
        .layers = sd.state,
        .cstate = dsv4_engine_runs_compressed(d->engine) ? sd.cstate : NULL,
    };
    *rc = dsv4_dump_header(&dd, &head, &head_len, &total, NULL);
    if (!*rc)
      *rc = dsv4_dump_ctail(&dd, &sd.ctail, &sd.ctail_len);
  }
  if (!*rc)
    *rc = open_tmp(cfg->snapshot_dir, file, tmp, sizeof(tmp), &o);
  if (!*rc)
    *rc = out_write(&o, head, head_len);
  if (!*rc)
    *rc = write_body(d, &sd, &o, buf, cap);
  if (!*rc && sd.ctail_len)
    *rc = out_write(&o, sd.ctail, sd.ctail_len);
  if (!*rc && o.bytes != total)
    *rc = DSV4_EIO;
  if (o.fd >= 0)
    *rc = close_tmp(&o, *rc, tmp, cfg->snapshot_dir, file);
  json_t *row = NULL;
  if (!*rc) {
    dsv4_digest_hex(XXH3_64bits_digest(o.h), hex);
    row = json_pack("{s:s,s:s,s:I,s:s}", "seq", name, "file", file, "bytes", (json_int_t)o.bytes,
                    "xxh3", hex);
  }
  XXH3_freeState(o.h);
  free(head);
  seqdump_free(&sd);
  return row;
}

static int write_manifest(dsv4_daemon_t *d, json_t *rows) {
  const char *dir = d->cfg->snapshot_dir;
  char tmp[PATH_MAX];
  out_t o = {-1, 0, NULL};
  json_t *doc = json_pack("{s:s,s:i,s:s,s:s,s:I,s:O}", "format", MANIFEST_FORMAT, "version",
                          MANIFEST_VERSION, "instance", d->instance, "daemon", DSV4_VERSION,
                          "block_size", (json_int_t)d->cfg->block_size, "sequences", rows);
  char *text = doc ? json_dumps(doc, JSON_INDENT(1)) : NULL;
  int rc = text ? open_tmp(dir, MANIFEST, tmp, sizeof(tmp), &o) : DSV4_ENOMEM;
  if (!rc)
    rc = out_write(&o, text, strlen(text));
  if (o.fd >= 0)
    rc = close_tmp(&o, rc, tmp, dir, MANIFEST);
  if (!rc)
    rc = sync_dir(dir);
  XXH3_freeState(o.h);
  free(text);
  json_decref(doc);
  return rc;
}

void dsv4__snapshot_write(dsv4_daemon_t *d) {
  uint64_t t0 = uv_hrtime(), bytes = 0;
  size_t cap = d->cfg->admin_dump_chunk_bytes;
  names_t ns = {NULL, 0, 0};
  json_t *rows = json_array();
  uint8_t *buf = malloc(cap);
  uint32_t skipped = 0;
  int rc = rows && buf ? dsv4_engine_foreach_seq(d->engine, collect, &ns) : DSV4_ENOMEM;
  for (uint32_t i = 0; i < ns.n && !rc; i++) {
    int one;
    json_t *row = write_one(d, ns.names[i], buf, cap, &one);
    if (row) {
      bytes += (uint64_t)json_integer_value(json_object_get(row, "bytes"));
      json_array_append_new(rows, row);
    } else {
      skipped++;
      dsv4_logp(DSV4_LOG_ERROR, "snapshot: cannot write a sequence", "{s:s,s:s,s:s}", "seq",
                ns.names[i], "dir", d->cfg->snapshot_dir, "error", dsv4_strerror(one));
    }
  }
  /* Sequences written (or none) are listed even when others were not: each file stands alone. */
  if (!rc)
    rc = write_manifest(d, rows);
  if (rc)
    dsv4_logp(DSV4_LOG_ERROR, "snapshot not written", "{s:s,s:s}", "dir", d->cfg->snapshot_dir,
              "error", dsv4_strerror(rc));
  else
    dsv4_logp(DSV4_LOG_INFO, "snapshot written", "{s:s,s:I,s:i,s:I,s:f}", "dir",
              d->cfg->snapshot_dir, "sequences", (json_int_t)json_array_size(rows), "skipped",
              (int)skipped, "bytes", (json_int_t)bytes, "ms", (double)(uv_hrtime() - t0) * 1e-6);
  for (uint32_t i = 0; i < ns.n; i++)
    free(ns.names[i]);
  free(ns.names);
  free(buf);
  json_decref(rows);
}

/* ---- restoring ---------------------------------------------------------------------------- */

/* A whole file into memory; DSV4_EIO with why set when it cannot be read. */
static int slurp(const char *path, uint8_t **out, size_t *len, char *why, size_t why_len) {
  struct stat sb;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  *out = NULL;
  if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    snprintf(why, why_len, "cannot open: %s", fd < 0 ? strerror(errno) : "not a regular file");
    if (fd >= 0)
      close(fd);
    return DSV4_EIO;
  }
  *len = (size_t)sb.st_size;
  *out = malloc(*len ? *len : 1);
  size_t got = 0;
  while (*out && got < *len) {
    ssize_t r = read(fd, *out + got, *len - got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    got += (size_t)r;
  }
  close(fd);
  if (!*out || got != *len) {
    snprintf(why, why_len, "cannot read: %s", *out ? "short read" : "out of memory");
    free(*out);
    *out = NULL;
    return DSV4_EIO;
  }
  return 0;
}

/* Restore one manifest row; 0, or an error with why set (the file is then skipped). */
static int restore_one(dsv4_daemon_t *d, json_t *row, char *why, size_t why_len) {
  const char *seq = json_string_value(json_object_get(row, "seq"));
  const char *file = json_string_value(json_object_get(row, "file"));
  const char *hex = json_string_value(json_object_get(row, "xxh3"));
  json_t *bytes = json_object_get(row, "bytes");
  char want_file[NAME_ROOM], path[PATH_MAX], got[17], model[17];
  if (!seq || !dsv4_seq_name_valid(seq, strlen(seq)) || !file || !hex || !json_is_integer(bytes)) {
    snprintf(why, why_len, "manifest row without a valid seq, file, bytes and xxh3");
    return DSV4_EINVAL;
  }
  /* The file is named after the sequence: a manifest never points outside the directory. */
  snprintf(want_file, sizeof(want_file), "%s" DUMP_SUFFIX, seq);
  if (strcmp(file, want_file) != 0) {
    snprintf(why, why_len, "manifest names file \"%.64s\" for sequence %s", file, seq);
    return DSV4_EINVAL;
  }
  uint8_t *buf;
  size_t len;
  join(path, sizeof(path), d->cfg->snapshot_dir, file);
  int rc = slurp(path, &buf, &len, why, why_len);
  if (rc)
    return rc;
  dsv4_digest_hex(XXH3_64bits(buf, len), got);
  if ((json_int_t)len != json_integer_value(bytes) || strcmp(got, hex) != 0) {
    snprintf(why, why_len,
             "torn or corrupt: %zu bytes with XXH3 %s, the manifest says %" JSON_INTEGER_FORMAT
             " bytes with %s",
             len, got, json_integer_value(bytes), hex);
    free(buf);
    return DSV4_EIO;
  }
  dsv4_dump_expect_t want;
  dsv4_dump_parsed_t p;
  dsv4_engine_restore_result_t res;
  dsv4__restore_expect(d, &want, model);
  rc = dsv4_dump_parse(buf, len, &want, &p);
  memset(&res, 0, sizeof(res));
  if (!rc)
    rc = dsv4__restore_apply(d, seq, (uint32_t)strlen(seq), &p, 0, &res);
  if (rc)
    snprintf(why, why_len, "%s", p.why[0] ? p.why : res.why[0] ? res.why : dsv4_strerror(rc));
  dsv4_dump_parsed_free(&p);
  free(buf);
  return rc;
}

/* The manifest as JSON, or NULL (nothing to restore: none, or one that cannot be used). */
static json_t *read_manifest(const char *path) {
  char why[160];
  uint8_t *text;
  size_t len;
  json_error_t je;
  if (access(path, F_OK) != 0)
    return NULL;
  if (slurp(path, &text, &len, why, sizeof(why)) == 0) {
    json_t *doc = json_loadb((const char *)text, len, 0, &je);
    free(text);
    const char *fmt = json_string_value(json_object_get(doc, "format"));
    if (doc && fmt && !strcmp(fmt, MANIFEST_FORMAT) &&
        json_integer_value(json_object_get(doc, "version")) == MANIFEST_VERSION &&
        json_is_array(json_object_get(doc, "sequences")))
      return doc;
    json_decref(doc);
    snprintf(why, sizeof(why), "not a snapshot manifest of version %d", MANIFEST_VERSION);
  }
  /* Set aside, so that the next start does not trip over it again; the files stay for a look. */
  char bad[PATH_MAX + 8];
  snprintf(bad, sizeof(bad), "%s.bad", path);
  rename(path, bad);
  dsv4_logp(DSV4_LOG_ERROR, "snapshot manifest unusable; nothing restored", "{s:s,s:s,s:s}", "path",
            path, "why", why, "moved_to", bad);
  return NULL;
}

void dsv4__snapshot_restore(dsv4_daemon_t *d) {
  const char *dir = d->cfg->snapshot_dir;
  char path[PATH_MAX], why[320];
  uint64_t t0 = uv_hrtime();
  uint32_t restored = 0, skipped = 0;
  join(path, sizeof(path), dir, MANIFEST);
  json_t *doc = read_manifest(path);
  if (!doc)
    return;
  json_t *rows = json_object_get(doc, "sequences");
  uint8_t *done = calloc(json_array_size(rows) + 1, 1);
  for (size_t i = 0; done && i < json_array_size(rows); i++) {
    json_t *row = json_array_get(rows, i);
    int rc = restore_one(d, row, why, sizeof(why));
    if (rc == 0) {
      done[i] = 1;
      restored++;
      continue;
    }
    skipped++;
    const char *file = json_string_value(json_object_get(row, "file"));
    dsv4_logp(DSV4_LOG_ERROR, "snapshot file skipped", "{s:s,s:s,s:s,s:s}", "file",
              file ? file : "?", "dir", dir, "error", dsv4_http_error(rc).code, "why", why);
  }
  /* The manifest goes first: a crash from here on restores nothing twice. */
  unlink(path);
  sync_dir(dir);
  for (size_t i = 0; done && i < json_array_size(rows); i++) {
    if (!done[i])
      continue;
    join(path, sizeof(path), dir,
         json_string_value(json_object_get(json_array_get(rows, i), "file")));
    unlink(path);
  }
  const char *from = json_string_value(json_object_get(doc, "instance"));
  dsv4_logp(DSV4_LOG_INFO, "snapshot restored", "{s:s,s:s,s:i,s:i,s:f}", "dir", dir, "from",
            from ? from : "?", "restored", (int)restored, "skipped", (int)skipped, "ms",
            (double)(uv_hrtime() - t0) * 1e-6);
  free(done);
  json_decref(doc);
}
