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
  struct tm tm;
  gmtime_r(&secs, &tm);
  snprintf(buf, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
           tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
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

void dsv4_vlogp(int level, const char *msg, const char *fmt, va_list ap) {
  if (!dsv4_log_enabled(level))
    return;
  json_t *fields = NULL;
  if (fmt) {
    json_error_t err;
    fields = json_vpack_ex(&err, 0, fmt, ap);
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
