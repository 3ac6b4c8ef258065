#include "args.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "decimal.h"
#include "dsv4-error.h"
#include "seqtable.h"

const char dsv4_ctl_usage[] =
    "usage: dsv4ctl [--admin URL] [--token-file FILE] [--json] [--timeout S] COMMAND\n"
    "\n"
    "commands:\n"
    "  status                              cache geometry, capacity and pool digests\n"
    "  seq [S]                             all sequences, or one with its block table\n"
    "  token S POS --layer L               one record, decoded\n"
    "  entry S J --layer L                 one compressed entry (and index record), decoded\n"
    "  checksum --layer L [--seq S]        pool, block and sequence digests of a layer\n"
    "  dump --seq S [--layers a-b] -o FILE a sequence's records as safetensors, then verify\n"
    "  verify FILE                         recompute a dump's digests\n"
    "  snapshot --seq S -o FILE            a dump of every layer, one that restore takes\n"
    "  restore --seq S FILE [--replace]    recreate S from a snapshot (--replace: over a live S)\n"
    "  migrate --seq S --to HOST:PORT      snapshot S, restore it on the other admin listener,\n"
    "                                      check its digests there, then delete it here\n"
    "\n"
    "options:\n"
    "  --admin URL        admin listener (default $DSV4CTL_ADMIN, else " DSV4_CTL_DEFAULT_ADMIN
    ")\n"
    "  --token-file FILE  bearer token (default $DSV4CTL_TOKEN_FILE)\n"
    "  --json             print the daemon's JSON documents instead of tables\n"
    "  --progress         progress line for dump even when stderr is not a terminal\n"
    "  --no-progress      no progress line\n"
    "  --to-token-file F  migrate: the target's bearer token (default: --token-file's)\n"
    "  --timeout S        seconds to connect and between reads (default 30)\n"
    "  --                 the rest are arguments (for a sequence name starting with '-')\n"
    "\n"
    "exit status: 0 ok, 1 the daemon answered an error or verify found a mismatch,\n"
    "2 usage, connection or I/O error\n";

__attribute__((format(printf, 3, 4))) static int fail(char *err, size_t errlen, const char *fmt,
                                                      ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
  return DSV4_EINVAL;
}

int dsv4_ctl_parse_layers(const char *s, uint32_t *first, uint32_t *last) {
  char buf[32];
  size_t n = strlen(s);
  if (n == 0 || n >= sizeof(buf))
    return DSV4_EINVAL;
  memcpy(buf, s, n + 1);
  char *dash = strchr(buf, '-');
  uint64_t a, b;
  if (dash) {
    *dash = '\0';
    if (dsv4_parse_decimal(buf, strlen(buf), INT32_MAX, &a) != 0 ||
        dsv4_parse_decimal(dash + 1, strlen(dash + 1), INT32_MAX, &b) != 0 || a > b)
      return DSV4_EINVAL;
  } else {
    if (dsv4_parse_decimal(buf, n, INT32_MAX, &a) != 0)
      return DSV4_EINVAL;
    b = a;
  }
  *first = (uint32_t)a;
  *last = (uint32_t)b;
  return 0;
}

int dsv4_ctl_url_parse(const char *s, dsv4_ctl_url_t *out, char *err, size_t errlen) {
  memset(out, 0, sizeof(*out));
  if (!s || !*s)
    return fail(err, errlen, "admin URL is empty");
  const char *p = s;
  const char *sep = strstr(s, "://");
  if (sep) {
    size_t n = (size_t)(sep - s);
    if (n == 5 && strncasecmp(s, "https", 5) == 0)
      return fail(err, errlen,
                  "admin URL \"%.200s\": https is not supported (the admin listener speaks plain "
                  "HTTP; reach a remote one through an SSH tunnel or a TLS proxy)",
                  s);
    if (n != 4 || strncasecmp(s, "http", 4) != 0)
      return fail(err, errlen, "admin URL \"%.200s\": only http:// URLs are supported", s);
    p = sep + 3;
  }
  /* The authority ends at the first '/', or at the end; '?' and '#' have no meaning here. */
  size_t alen = strcspn(p, "/?#");
  if (p[alen] == '?' || p[alen] == '#' || strpbrk(p + alen, "?#"))
    return fail(err, errlen, "admin URL \"%.200s\": a query or fragment is not allowed", s);
  if (memchr(p, '@', alen))
    return fail(err, errlen, "admin URL \"%.200s\": user info is not allowed (use --token-file)",
                s);
  const char *host = p, *port = NULL;
  size_t hlen;
  if (alen > 0 && p[0] == '[') {
    const char *close = memchr(p, ']', alen);
    if (!close)
      return fail(err, errlen, "admin URL \"%.200s\": unterminated IPv6 literal", s);
    host = p + 1;
    hlen = (size_t)(close - host);
    const char *after = close + 1;
    if (after < p + alen) {
      if (*after != ':')
        return fail(err, errlen, "admin URL \"%.200s\": junk after the IPv6 literal", s);
      port = after + 1;
    }
    for (size_t i = 0; i < hlen; i++)
      if (!strchr("0123456789abcdefABCDEF:.", host[i]))
        return fail(err, errlen, "admin URL \"%.200s\": bad IPv6 literal", s);
    out->ipv6 = 1;
  } else {
    const char *colon = memchr(p, ':', alen);
    hlen = colon ? (size_t)(colon - p) : alen;
    if (colon)
      port = colon + 1;
    for (size_t i = 0; i < hlen; i++) {
      char c = host[i];
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '.' || c == '-' || c == '_'))
        return fail(err, errlen, "admin URL \"%.200s\": bad character '%c' in the host", s, c);
    }
  }
  if (hlen == 0)
    return fail(err, errlen, "admin URL \"%.200s\": no host", s);
  if (hlen >= sizeof(out->host))
    return fail(err, errlen, "admin URL: host longer than %zu bytes", sizeof(out->host) - 1);
  memcpy(out->host, host, hlen);
  if (port) {
    size_t plen = (size_t)(p + alen - port);
    char pb[16];
    uint64_t v;
    if (plen == 0 || plen >= sizeof(pb))
      return fail(err, errlen, "admin URL \"%.200s\": bad port", s);
    memcpy(pb, port, plen);
    pb[plen] = '\0';
    if (dsv4_parse_decimal(pb, plen, UINT16_MAX, &v) != 0 || v == 0)
      return fail(err, errlen, "admin URL \"%.200s\": port \"%s\" is not 1..65535", s, pb);
    snprintf(out->port, sizeof(out->port), "%u", (unsigned)v);
  } else {
    snprintf(out->port, sizeof(out->port), "80");
  }
  const char *path = p + alen;
  size_t plen = strlen(path);
  while (plen > 0 && path[plen - 1] == '/')
    plen--;
  if (plen >= sizeof(out->base))
    return fail(err, errlen, "admin URL: path longer than %zu bytes", sizeof(out->base) - 1);
  for (size_t i = 0; i < plen; i++)
    if ((unsigned char)path[i] <= ' ' || (unsigned char)path[i] >= 0x7f)
      return fail(err, errlen, "admin URL \"%.200s\": bad character in the path", s);
  memcpy(out->base, path, plen);
  return 0;
}

static const struct {
  const char *name;
  int cmd;
} commands[] = {
    {"status", DSV4_CTL_CMD_STATUS},   {"seq", DSV4_CTL_CMD_SEQ},
    {"token", DSV4_CTL_CMD_TOKEN},     {"checksum", DSV4_CTL_CMD_CHECKSUM},
    {"dump", DSV4_CTL_CMD_DUMP},       {"verify", DSV4_CTL_CMD_VERIFY},
    {"help", DSV4_CTL_CMD_HELP},       {"snapshot", DSV4_CTL_CMD_SNAPSHOT},
    {"restore", DSV4_CTL_CMD_RESTORE}, {"migrate", DSV4_CTL_CMD_MIGRATE},
    {"entry", DSV4_CTL_CMD_ENTRY},
};

/* Options that take a value; the rest are flags. */
static const char *const valued[] = {"--admin", "--token-file",   "--timeout", "--layer",
                                     "--seq",   "--layers",       "-o",        "--output",
                                     "--to",    "--to-token-file"};

static int is_valued(const char *name) {
  for (size_t i = 0; i < sizeof(valued) / sizeof(valued[0]); i++)
    if (strcmp(name, valued[i]) == 0)
      return 1;
  return 0;
}

static int check_seq(const char *s, char *err, size_t errlen) {
  if (!dsv4_seq_name_valid(s, strlen(s)))
    return fail(err, errlen,
                "\"%.64s\" is not a sequence name (1..128 of A-Z a-z 0-9 . _ : -, not starting "
                "with '.')",
                s);
  return 0;
}

/* What the command line holds once the options are read: the positional arguments and --layer. */
typedef struct {
  const char *pos[4];
  int n_pos;
  const char *layer;
  int done; /* --help or --version: nothing else is looked at */
} scan_t;

/* Argument pass 1, one option: its value (NULL for a flag) into *out or sc. */
static int apply_option(const char *name, const char *val, const char *a, dsv4_ctl_args_t *out,
                        scan_t *sc, char *err, size_t errlen) {
  if (strcmp(name, "--admin") == 0) {
    out->admin = val;
  } else if (strcmp(name, "--token-file") == 0) {
    out->token_file = val;
  } else if (strcmp(name, "--timeout") == 0) {
    uint64_t t;
    if (dsv4_parse_decimal(val, strlen(val), DSV4_CTL_MAX_TIMEOUT_S, &t) != 0 || t == 0)
      return fail(err, errlen, "--timeout \"%.64s\" is not a whole number of seconds 1..3600", val);
    out->timeout_ms = (int)t * 1000;
  } else if (strcmp(name, "--layer") == 0) {
    sc->layer = val;
  } else if (strcmp(name, "--seq") == 0) {
    out->seq = val;
  } else if (strcmp(name, "--layers") == 0) {
    if (dsv4_ctl_parse_layers(val, &out->layer_first, &out->layer_last) != 0)
      return fail(err, errlen, "--layers \"%.64s\" is not a decimal layer or range a-b (a <= b)",
                  val);
    out->has_layers = 1;
  } else if (strcmp(name, "-o") == 0 || strcmp(name, "--output") == 0) {
    if (!*val)
      return fail(err, errlen, "%s needs a file name", name);
    out->output = val;
  } else if (strcmp(name, "--to") == 0) {
    out->to = val;
  } else if (strcmp(name, "--to-token-file") == 0) {
    out->to_token_file = val;
  } else if (strcmp(name, "--replace") == 0) {
    out->replace = 1;
  } else if (strcmp(name, "--json") == 0) {
    out->json = 1;
  } else if (strcmp(name, "--progress") == 0) {
    out->progress = 1;
  } else if (strcmp(name, "--no-progress") == 0) {
    out->progress = 0;
  } else if (strcmp(name, "-h") == 0 || strcmp(name, "--help") == 0) {
    out->cmd = DSV4_CTL_CMD_HELP;
    sc->done = 1;
  } else if (strcmp(name, "--version") == 0) {
    out->cmd = DSV4_CTL_CMD_VERSION;
    sc->done = 1;
  } else {
    return fail(err, errlen, "unknown option \"%.64s\"", a);
  }
  return 0;
}

/* Argument pass 1: options ("--name value", "--name=value") and positional arguments, any order. */
static int scan_args(int argc, char *const *argv, dsv4_ctl_args_t *out, scan_t *sc, char *err,
                     size_t errlen) {
  int only_positional = 0;
  for (int i = 1; i < argc && !sc->done; i++) {
    const char *a = argv[i];
    /* "-1" is a (bad) position, not an option: let the command say so. */
    if (only_positional || a[0] != '-' || strcmp(a, "-") == 0 || (a[1] >= '0' && a[1] <= '9')) {
      if (sc->n_pos == (int)(sizeof(sc->pos) / sizeof(sc->pos[0])))
        return fail(err, errlen, "too many arguments (\"%.64s\")", a);
      sc->pos[sc->n_pos++] = a;
      continue;
    }
    if (strcmp(a, "--") == 0) {
      only_positional = 1;
      continue;
    }
    char name[32];
    const char *val = NULL;
    const char *eq = strchr(a, '=');
    size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
    if (nlen >= sizeof(name))
      return fail(err, errlen, "unknown option \"%.64s\"", a);
    memcpy(name, a, nlen);
    name[nlen] = '\0';
    if (is_valued(name)) {
      if (eq) {
        val = eq + 1;
      } else {
        if (i + 1 >= argc)
          return fail(err, errlen, "option %s needs a value", name);
        val = argv[++i];
      }
    } else if (eq) {
      return fail(err, errlen, "option %s takes no value", name);
    }
    int rc = apply_option(name, val, a, out, sc, err, errlen);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* Argument pass 2: the command named first, and --layer as a number. */
static int pick_command(const scan_t *sc, dsv4_ctl_args_t *out, char *err, size_t errlen) {
  if (sc->n_pos == 0)
    return fail(err, errlen, "no command given");
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    if (strcmp(sc->pos[0], commands[i].name) == 0)
      out->cmd = commands[i].cmd;
  if (out->cmd == DSV4_CTL_CMD_NONE)
    return fail(err, errlen, "unknown command \"%.64s\"", sc->pos[0]);
  if (sc->layer) {
    uint64_t l;
    if (dsv4_parse_decimal(sc->layer, strlen(sc->layer), INT32_MAX, &l) != 0)
      return fail(err, errlen, "--layer \"%.64s\" is not a decimal layer number", sc->layer);
    out->layer = (uint32_t)l;
    out->has_layer = 1;
  }
  return 0;
}

/* Argument pass 3: the options only some commands take. */
static int check_options(const scan_t *sc, const dsv4_ctl_args_t *out, char *err, size_t errlen) {
  const char *cmd = sc->pos[0];
  int c = out->cmd;
  int want_layer = c == DSV4_CTL_CMD_TOKEN || c == DSV4_CTL_CMD_ENTRY || c == DSV4_CTL_CMD_CHECKSUM;
  int want_seq = c == DSV4_CTL_CMD_CHECKSUM || c == DSV4_CTL_CMD_DUMP ||
                 c == DSV4_CTL_CMD_SNAPSHOT || c == DSV4_CTL_CMD_RESTORE ||
                 c == DSV4_CTL_CMD_MIGRATE;
  if (sc->layer && !want_layer)
    return fail(err, errlen, "%s takes no --layer", cmd);
  if (out->seq && !want_seq)
    return fail(err, errlen, "%s takes no --seq", cmd);
  if (out->has_layers && c != DSV4_CTL_CMD_DUMP)
    return fail(err, errlen, "%s takes no --layers%s", cmd,
                c == DSV4_CTL_CMD_SNAPSHOT ? " (a snapshot holds every layer)" : "");
  if (out->output && c != DSV4_CTL_CMD_DUMP && c != DSV4_CTL_CMD_SNAPSHOT)
    return fail(err, errlen, "%s takes no -o", cmd);
  if (out->replace && c != DSV4_CTL_CMD_RESTORE)
    return fail(err, errlen, "%s takes no --replace", cmd);
  if ((out->to || out->to_token_file) && c != DSV4_CTL_CMD_MIGRATE)
    return fail(err, errlen, "%s takes no %s", cmd, out->to ? "--to" : "--to-token-file");
  return 0;
}

/* Argument pass 4, the commands that move a sequence: snapshot, restore and migrate. */
static int check_transfer(const scan_t *sc, dsv4_ctl_args_t *out, char *err, size_t errlen) {
  const char *cmd = sc->pos[0];
  if (out->cmd == DSV4_CTL_CMD_RESTORE) {
    if (sc->n_pos != 2)
      return fail(err, errlen, "usage: restore --seq S FILE [--replace]");
    out->file = sc->pos[1];
  } else if (sc->n_pos > 1) {
    return fail(err, errlen, "%s takes no positional arguments (\"%.64s\")", cmd, sc->pos[1]);
  }
  if (!out->seq)
    return fail(err, errlen, "%s needs --seq S", cmd);
  if (check_seq(out->seq, err, errlen) != 0)
    return DSV4_EINVAL;
  if (out->cmd == DSV4_CTL_CMD_SNAPSHOT && !out->output)
    return fail(err, errlen, "snapshot needs -o FILE");
  if (out->cmd == DSV4_CTL_CMD_MIGRATE && (!out->to || !*out->to))
    return fail(err, errlen, "migrate needs --to HOST:PORT");
  return 0;
}

/* Argument pass 4: the positional arguments and required options of each command. */
static int check_command(const scan_t *sc, dsv4_ctl_args_t *out, char *err, size_t errlen) {
  const char *cmd = sc->pos[0];
  int n_pos = sc->n_pos;
  const char *const *pos_args = sc->pos;
  switch (out->cmd) {
  case DSV4_CTL_CMD_HELP:
  case DSV4_CTL_CMD_STATUS:
    if (n_pos > 1)
      return fail(err, errlen, "%s takes no arguments (\"%.64s\")", cmd, pos_args[1]);
    break;
  case DSV4_CTL_CMD_SEQ:
    if (n_pos > 2)
      return fail(err, errlen, "seq takes at most one sequence name (\"%.64s\")", pos_args[2]);
    if (n_pos == 2) {
      out->seq = pos_args[1];
      if (check_seq(out->seq, err, errlen) != 0)
        return DSV4_EINVAL;
    }
    break;
  case DSV4_CTL_CMD_TOKEN:
  case DSV4_CTL_CMD_ENTRY: {
    int tok = out->cmd == DSV4_CTL_CMD_TOKEN;
    if (n_pos != 3)
      return fail(err, errlen,
                  tok ? "usage: token SEQ POS --layer L" : "usage: entry SEQ J --layer L");
    out->seq = pos_args[1];
    if (check_seq(out->seq, err, errlen) != 0)
      return DSV4_EINVAL;
    uint64_t p;
    if (dsv4_parse_decimal(pos_args[2], strlen(pos_args[2]), INT64_MAX, &p) != 0)
      return fail(err, errlen, "%s \"%.64s\" is not a non-negative decimal",
                  tok ? "position" : "entry", pos_args[2]);
    out->pos = (int64_t)p;
    if (!out->has_layer)
      return fail(err, errlen, "%s needs --layer L", cmd);
    break;
  }
  case DSV4_CTL_CMD_CHECKSUM:
    if (n_pos > 1)
      return fail(err, errlen, "checksum takes no positional arguments (\"%.64s\"; use --seq)",
                  pos_args[1]);
    if (!out->has_layer)
      return fail(err, errlen, "checksum needs --layer L");
    if (out->seq && check_seq(out->seq, err, errlen) != 0)
      return DSV4_EINVAL;
    break;
  case DSV4_CTL_CMD_DUMP:
    if (n_pos > 1)
      return fail(err, errlen, "dump takes no positional arguments (\"%.64s\")", pos_args[1]);
    if (!out->seq)
      return fail(err, errlen, "dump needs --seq S");
    if (check_seq(out->seq, err, errlen) != 0)
      return DSV4_EINVAL;
    if (!out->output)
      return fail(err, errlen, "dump needs -o FILE");
    break;
  case DSV4_CTL_CMD_VERIFY:
    if (n_pos != 2)
      return fail(err, errlen, "usage: verify FILE");
    out->file = pos_args[1];
    break;
  case DSV4_CTL_CMD_SNAPSHOT:
  case DSV4_CTL_CMD_RESTORE:
  case DSV4_CTL_CMD_MIGRATE:
    return check_transfer(sc, out, err, errlen);
  default:
    break;
  }
  return 0;
}

int dsv4_ctl_args_parse(int argc, char *const *argv, const char *env_admin, const char *env_token,
                        dsv4_ctl_args_t *out, char *err, size_t errlen) {
  memset(out, 0, sizeof(*out));
  out->admin = env_admin && *env_admin ? env_admin : DSV4_CTL_DEFAULT_ADMIN;
  out->token_file = env_token && *env_token ? env_token : NULL;
  out->progress = -1;
  out->timeout_ms = DSV4_CTL_DEFAULT_TIMEOUT_MS;
  out->pos = -1;
  scan_t sc = {.n_pos = 0};
  int rc = scan_args(argc, argv, out, &sc, err, errlen);
  if (rc != 0 || sc.done)
    return rc;
  if ((rc = pick_command(&sc, out, err, errlen)) != 0 ||
      (rc = check_options(&sc, out, err, errlen)) != 0)
    return rc;
  return check_command(&sc, out, err, errlen);
}
