#ifndef DSV4_SERVER_LOG_H
#define DSV4_SERVER_LOG_H

/*
 * JSON-lines logs: one object per line, {"ts": "2025-01-02T03:04:05.678Z", "level": "info",
 * "msg": "...", ...fields}, written to stderr (or the fd set with dsv4_log_set_fd) with a single
 * write() per line, so lines from different threads never interleave.
 *
 * Thread affinity: any thread. The level and fd are process-wide; set them before starting threads.
 */

#include <stdarg.h>
#include <stddef.h>

#include <jansson.h>

typedef enum {
  DSV4_LOG_DEBUG = 0,
  DSV4_LOG_INFO = 1,
  DSV4_LOG_WARN = 2,
  DSV4_LOG_ERROR = 3,
} dsv4_log_level_t;

/* Lines below level are dropped (default DSV4_LOG_INFO). */
void dsv4_log_set_level(int level);
int dsv4_log_get_level(void);
/* "debug" | "info" | "warn" | "error" into *out; DSV4_EINVAL otherwise. */
int dsv4_log_parse_level(const char *name, int *out);
const char *dsv4_log_level_name(int level);
/* Non-zero when a line at level would be written (to skip building expensive fields). */
int dsv4_log_enabled(int level);
/* Where lines go (default 2, stderr). Returns the previous fd. */
int dsv4_log_set_fd(int fd);

/*
 * Write one line. fields (stolen, may be NULL) is a JSON object whose members follow ts, level and
 * msg; members named ts, level or msg are ignored.
 */
void dsv4_log(int level, const char *msg, json_t *fields);
/*
 * Write one line with fields built by jansson's json_pack format, e.g.
 * dsv4_logp(DSV4_LOG_INFO, "loaded", "{s:s, s:i}", "backend", "cpu", "layers", 43).
 * fmt NULL means no fields.
 */
void dsv4_logp(int level, const char *msg, const char *fmt, ...);
void dsv4_vlogp(int level, const char *msg, const char *fmt, va_list ap);

/*
 * The line integration tests read the port from, written once a listener is bound:
 * {"msg": "listening", "listener": "data", "host": "127.0.0.1", "port": 8400}.
 */
void dsv4_log_listening(const char *listener, const char *host, int port);
/* The same line for the data plane's Unix domain socket: "listener":"unix","path":path. */
void dsv4_log_listening_unix(const char *path);
/* The same for another listener on a socket file ("shm"). */
void dsv4_log_listening_path(const char *listener, const char *path);

/* Format the RFC 3339 UTC timestamp with milliseconds for ns since the epoch into buf[25+]. */
void dsv4_log_format_ts(char *buf, size_t len, long long epoch_ns);

#endif /* DSV4_SERVER_LOG_H */
