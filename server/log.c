#include "log.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dsv4-error.h"

static atomic_int log_level = DSV4_LOG_INFO;
static atomic_int log_fd = 2;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

void dsv4_log_set_level(int level) {
  if (level < DSV4_LOG_DEBUG)
    level = DSV4_LOG_DEBUG;
  if (level > DSV4_LOG_ERROR)
    level = DSV4_LOG_ERROR;
  atomic_store(&log_level, level);
}

int dsv4_log_get_level(void) {
  return atomic_load(&log_level);
}

int dsv4_log_parse_level(const char *name, int *out) {
  for (int i = 0; i <= DSV4_LOG_ERROR; i++) {
    if (strcmp(name, level_names[i]) == 0) {
      *out = i;
      return 0;
    }
  }
  return DSV4_EINVAL;
}

const char *dsv4_log_level_name(int level) {
  return level >= DSV4_LOG_DEBUG && level <= DSV4_LOG_ERROR ? level_names[level] : "error";
}

int dsv4_log_enabled(int level) {
  return level >= atomic_load(&log_level);
}

int dsv4_log_set_fd(int fd) {
  return atomic_exchange(&log_fd, fd);
}

void dsv4_log_format_ts(char *buf, size_t len, long long epoch_ns) {
  time_t secs = (time_t)(epoch_ns / 1000000000LL);
  int ms = (int)((epoch_ns % 1000000000LL) / 1000000LL);
  if (ms < 0) {
    secs -= 1;
    ms += 1000;
  }
  /* The date and time by strftime, which writes them whole within len or returns 0 (also when
   * gmtime_r cannot represent secs, whose fields are then not read); the milliseconds, 0..999,
   * follow. */
  struct tm tm;
  size_t n = gmtime_r(&secs, &tm) ? strftime(buf, len, "%Y-%m-%dT%H:%M:%S", &tm) : 0;
  if (n < len)
    snprintf(buf + n, len - n, ".%03dZ", ms);
}

/* Write all of buf with one write() where the kernel allows it; retry only on a short write. */
static void write_line(int fd, const char *buf, size_t len) {
  while (len > 0) {
    ssize_t n = write(fd, buf, len);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return;
    }
    buf += n;
    len -= (size_t)n;
  }
}

/* Build and write one line whatever the level filter says; steals fields. */
static void emit(int level, const char *msg, json_t *fields) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  char tbuf[40];
  dsv4_log_format_ts(tbuf, sizeof(tbuf), (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);

  /* ts, level and msg come first; jansson keeps insertion order, so the fields follow them. */
  json_t *line = json_object();
  char *text = NULL;
  if (line) {
    json_object_set_new(line, "ts", json_string(tbuf));
    json_object_set_new(line, "level", json_string(dsv4_log_level_name(level)));
    json_t *m = json_string(msg ? msg : "");
    json_object_set_new(line, "msg", m ? m : json_string("(message is not UTF-8)"));
    if (json_is_object(fields))
      json_object_update_missing(line, fields);
    text = json_dumps(line, JSON_COMPACT | JSON_ENSURE_ASCII);
    json_decref(line);
  }
  if (fields)
    json_decref(fields);
  if (!text) {
    static const char oom[] = "{\"level\":\"error\",\"msg\":\"log line could not be built\"}\n";
    write_line(atomic_load(&log_fd), oom, sizeof(oom) - 1);
    return;
  }
  size_t n = strlen(text);
  char *withnl = realloc(text, n + 2);
  if (withnl) {
    withnl[n] = '\n';
    withnl[n + 1] = '\0';
    write_line(atomic_load(&log_fd), withnl, n + 1);
    free(withnl);
  } else {
    free(text);
  }
}

void dsv4_log(int level, const char *msg, json_t *fields) {
  if (!dsv4_log_enabled(level)) {
    if (fields)
      json_decref(fields);
    return;
  }
  emit(level, msg, fields);
}

/* s as a JSON string; when s is not UTF-8 (a path or value from the command line can hold any
 * bytes) its bytes outside ASCII become '?' and *cleaned is set. */
static json_t *lenient_string(const char *s, int *cleaned) {
  json_t *v = json_string(s);
  if (v)
    return v;
  char *c = strdup(s);
  if (!c)
    return NULL;
  for (char *p = c; *p; p++)
    if ((unsigned char)*p >= 0x80)
      *p = '?';
  *cleaned = 1;
  v = json_string(c);
  free(c);
  return v;
}

/*
 * The fields of fmt built again from ap when json_vpack_ex refused them, which it does only for a
 * string that is not UTF-8: the format subset the daemon's log calls use (an object of "s" keys
 * and s, i, I, f and b values), with such strings cleaned. NULL for any other format.
 */
static json_t *pack_lenient(const char *fmt, va_list ap) {
  json_t *o = json_object();
  const char *key = NULL;
  int cleaned = 0;
  for (const char *p = fmt; o && *p; p++) {
    json_t *v = NULL;
    switch (*p) {
    case '{':
    case '}':
    case ',':
    case ':':
    case ' ':
      continue;
    case 's': {
      const char *x = va_arg(ap, const char *);
      if (!key) {
        key = x ? x : "";
        continue;
      }
      v = x ? lenient_string(x, &cleaned) : json_null();
      break;
    }
    case 'i':
      v = json_integer(va_arg(ap, int));
      break;
    case 'b':
      v = json_boolean(va_arg(ap, int));
      break;
    case 'I':
      v = json_integer(va_arg(ap, json_int_t));
      break;
    case 'f':
      v = json_real(va_arg(ap, double));
      break;
    default:
      json_decref(o);
      return NULL;
    }
    if (!key || !v || json_object_set_new_nocheck(o, key, v) != 0) {
      json_decref(o);
      return NULL;
    }
    key = NULL;
  }
  if (o && cleaned)
    json_object_set_new(o, "log_note", json_string("bytes that were not UTF-8 are shown as ?"));
  return o;
}

void dsv4_vlogp(int level, const char *msg, const char *fmt, va_list ap) {
  if (!dsv4_log_enabled(level))
    return;
  json_t *fields = NULL;
  if (fmt) {
    json_error_t err;
    va_list again;
    va_copy(again, ap);
    fields = json_vpack_ex(&err, 0, fmt, ap);
    if (!fields)
      fields = pack_lenient(fmt, again);
    va_end(again);
    if (!fields)
      fields = json_pack("{s:s}", "log_error", err.text);
  }
  dsv4_log(level, msg, fields);
}

void dsv4_logp(int level, const char *msg, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  dsv4_vlogp(level, msg, fmt, ap);
  va_end(ap);
}

void dsv4_log_listening(const char *listener, const char *host, int port) {
  /* Integration tests wait for this line, so it is written whatever the level filter says. */
  emit(DSV4_LOG_INFO, "listening",
       json_pack("{s:s, s:s, s:i}", "listener", listener ? listener : "", "host", host ? host : "",
                 "port", port));
}

void dsv4_log_listening_unix(const char *path) {
  dsv4_log_listening_path("unix", path);
}

void dsv4_log_listening_path(const char *listener, const char *path) {
  emit(DSV4_LOG_INFO, "listening", json_pack("{s:s, s:s}", "listener", listener, "path", path));
}
