#ifndef DSV4_CTL_ARGS_H
#define DSV4_CTL_ARGS_H

/*
 * dsv4ctl's command line: the admin URL and the arguments of each command, checked before anything
 * is sent, so that a typo never reaches the daemon and always exits 2 with a message naming the
 * argument.
 *
 * Thread affinity: none (pure functions of their arguments).
 */

#include <stddef.h>
#include <stdint.h>

/* Exit codes (the admin contract): 0 ok, 1 the daemon answered an error (or verify found a
 * mismatch), 2 usage, connection or I/O error. */
#define DSV4_CTL_EXIT_OK 0
#define DSV4_CTL_EXIT_ERROR 1
#define DSV4_CTL_EXIT_USAGE 2

#define DSV4_CTL_DEFAULT_ADMIN "http://127.0.0.1:8401"
#define DSV4_CTL_DEFAULT_TIMEOUT_MS 30000
#define DSV4_CTL_MAX_TIMEOUT_S 3600 /* the largest --timeout: an hour */
#define DSV4_CTL_ERR_LEN 256

/* An http:// URL split into what a request needs. */
typedef struct {
  char host[256]; /* without the brackets of an IPv6 literal */
  char port[6];   /* decimal, 1..65535 */
  char base[512]; /* path prefix before /admin/v1, without a trailing '/'; "" for none */
  int ipv6;       /* host is an IPv6 literal (the Host header needs brackets) */
} dsv4_ctl_url_t;

/*
 * Parse "http://host[:port][/prefix]" (or "host[:port][/prefix]": the scheme may be left out). The
 * port defaults to 80 as for any http URL. https, user info, a query or a fragment are refused.
 * DSV4_EINVAL with why set, or 0.
 */
int dsv4_ctl_url_parse(const char *s, dsv4_ctl_url_t *out, char *why, size_t why_len);

typedef enum {
  DSV4_CTL_CMD_NONE = 0,
  DSV4_CTL_CMD_HELP,
  DSV4_CTL_CMD_VERSION,
  DSV4_CTL_CMD_STATUS,
  DSV4_CTL_CMD_SEQ,
  DSV4_CTL_CMD_TOKEN,
  DSV4_CTL_CMD_CHECKSUM,
  DSV4_CTL_CMD_DUMP,
  DSV4_CTL_CMD_VERIFY,
  DSV4_CTL_CMD_SNAPSHOT,
  DSV4_CTL_CMD_RESTORE,
  DSV4_CTL_CMD_MIGRATE,
  DSV4_CTL_CMD_ENTRY,
} dsv4_ctl_cmd_t;

typedef struct {
  int cmd;                /* DSV4_CTL_CMD_* */
  const char *admin;      /* --admin, else $DSV4CTL_ADMIN, else DSV4_CTL_DEFAULT_ADMIN */
  const char *token_file; /* --token-file, else $DSV4CTL_TOKEN_FILE, else NULL */
  int json;               /* --json: the daemon's documents as they are, one per line */
  int progress;           /* --progress: 1; --no-progress: 0; else -1 (when stderr is a tty) */
  int timeout_ms;         /* --timeout SECONDS: connect and per-read limit */
  const char *seq; /* seq [S], token S, entry S, --seq S of checksum, dump, snapshot, restore,
                      migrate */
  int64_t pos;     /* token S POS; entry S J (the entry) */
  int has_layer;   /* token / entry / checksum --layer L */
  uint32_t layer;
  int has_layers; /* dump --layers a-b */
  uint32_t layer_first, layer_last;
  const char *output;        /* dump / snapshot -o FILE */
  const char *file;          /* verify FILE, restore FILE */
  int replace;               /* restore --replace */
  const char *to;            /* migrate --to HOST:PORT (or a URL) */
  const char *to_token_file; /* migrate --to-token-file, else token_file */
} dsv4_ctl_args_t;

/*
 * Parse argv[1..argc) into *out (pointers into argv and the env strings). Options may come before
 * or after the command, as "--name value" or "--name=value". env_admin and env_token (may be NULL)
 * are $DSV4CTL_ADMIN and $DSV4CTL_TOKEN_FILE. DSV4_EINVAL with why set, or 0.
 */
int dsv4_ctl_args_parse(int argc, char *const *argv, const char *env_admin, const char *env_token,
                        dsv4_ctl_args_t *out, char *why, size_t why_len);

/* "a-b" or "a" (decimal model layers, a <= b). DSV4_EINVAL or 0. */
int dsv4_ctl_parse_layers(const char *s, uint32_t *first, uint32_t *last);

/* The usage text printed by --help and after a usage error. */
extern const char dsv4_ctl_usage[];

#endif /* DSV4_CTL_ARGS_H */
