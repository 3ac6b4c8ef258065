#include "args.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "dsv4-error.h"
#include "seqtable.h"

const char dsv4_ctl_usage[] =
    "usage: dsv4ctl [--admin URL] [--token-file FILE] [--json] [--timeout S] COMMAND\n"
    "\n"
    "commands:\n"
    "  status                              cache geometry, capacity and pool digests\n"
    "  seq [S]                             all sequences, or one with its block table\n"
    "  token S POS --layer L               one record, decoded\n"
    "  checksum --layer L [--seq S]        pool, block and sequence digests of a layer\n"
    "  dump --seq S [--layers a-b] -o FILE a sequence's records as safetensors, then verify\n"
    "  verify FILE                         recompute a dump's digests\n"
    "\n"
    "options:\n"
    "  --admin URL        admin listener (default $DSV4CTL_ADMIN, else " DSV4_CTL_DEFAULT_ADMIN
    ")\n"
    "  --token-file FILE  bearer token (default $DSV4CTL_TOKEN_FILE)\n"
    "  --json             print the daemon's JSON documents instead of tables\n"
    "  --progress         progress line for dump even when stderr is not a terminal\n"
    "  --no-progress      no progress line\n"
    "  --timeout S        seconds to connect and between reads (default 30)\n"
    "  --                 the rest are arguments (for a sequence name starting with '-')\n"
    "\n"
    "exit status: 0 ok, 1 the daemon answered an error or verify found a mismatch,\n"
    "2 usage, connection or I/O error\n";

__attribute__((format(printf, 3, 4))) static int fail(char *why, size_t why_len, const char *fmt,
                                                      ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, why_len, fmt, ap);
  va_end(ap);
  return DSV4_EINVAL;
}

/* A non-negative decimal of at most max, digits only (no sign, no spaces, no leading '+'). */
static int parse_dec(const char *s, uint64_t max, uint64_t *out) {
  if (!s || !*s)
    return DSV4_EINVAL;
  uint64_t v = 0;
  for (const char *p = s; *p; p++) {
    if (*p < '0' || *p > '9')
      return DSV4_EINVAL;
    if (v > (max - (uint64_t)(*p - '0')) / 10)
      return DSV4_EINVAL;
    v = v * 10 + (uint64_t)(*p - '0');
  }
  *out = v;
  return 0;
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
    if (parse_dec(buf, INT32_MAX, &a) != 0 || parse_dec(dash + 1, INT32_MAX, &b) != 0 || a > b)
      return DSV4_EINVAL;
  } else {
    if (parse_dec(buf, INT32_MAX, &a) != 0)
      return DSV4_EINVAL;
    b = a;
  }
  *first = (uint32_t)a;
  *last = (uint32_t)b;
  return 0;
}

int dsv4_ctl_url_parse(const char *s, dsv4_ctl_url_t *out, char *why, size_t why_len) {
  memset(out, 0, sizeof(*out));
  if (!s || !*s)
    return fail(why, why_len, "admin URL is empty");
  const char *p = s;
  const char *sep = strstr(s, "://");
  if (sep) {
    size_t n = (size_t)(sep - s);
    if (n == 5 && strncasecmp(s, "https", 5) == 0)
      return fail(why, why_len,
                  "admin URL \"%.200s\": https is not supported (the admin listener speaks plain "
                  "HTTP; reach a remote one through an SSH tunnel or a TLS proxy)",
                  s);
    if (n != 4 || strncasecmp(s, "http", 4) != 0)
      return fail(why, why_len, "admin URL \"%.200s\": only http:// URLs are supported", s);
    p = sep + 3;
  }
  /* The authority ends at the first '/', or at the end; '?' and '#' have no meaning here. */
  size_t alen = strcspn(p, "/?#");
  if (p[alen] == '?' || p[alen] == '#' || strpbrk(p + alen, "?#"))
    return fail(why, why_len, "admin URL \"%.200s\": a query or fragment is not allowed", s);
  if (memchr(p, '@', alen))
    return fail(why, why_len, "admin URL \"%.200s\": user info is not allowed (use --token-file)",
                s);
  const char *host = p, *port = NULL;
  size_t hlen;
  if (alen > 0 && p[0] == '[') {
    const char *close = memchr(p, ']', alen);
    if (!close)
      return fail(why, why_len, "admin URL \"%.200s\": unterminated IPv6 literal", s);
    host = p + 1;
    hlen = (size_t)(close - host);
    const char *after = close + 1;
    if (after < p + alen) {
      if (*after != ':')
        return fail(why, why_len, "admin URL \"%.200s\": junk after the IPv6 literal", s);
      port = after + 1;
    }
    for (size_t i = 0; i < hlen; i++)
      if (!strchr("0123456789abcdefABCDEF:.", host[i]))
        return fail(why, why_len, "admin URL \"%.200s\": bad IPv6 literal", s);
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
        return fail(why, why_len, "admin URL \"%.200s\": bad character '%c' in the host", s, c);
    }
  }
  if (hlen == 0)
    return fail(why, why_len, "admin URL \"%.200s\": no host", s);
  if (hlen >= sizeof(out->host))
    return fail(why, why_len, "admin URL: host longer than %zu bytes", sizeof(out->host) - 1);
  memcpy(out->host, host, hlen);
  if (port) {
    size_t plen = (size_t)(p + alen - port);
    char pb[16];
    uint64_t v;
    if (plen == 0 || plen >= sizeof(pb))
      return fail(why, why_len, "admin URL \"%.200s\": bad port", s);
    memcpy(pb, port, plen);
    pb[plen] = '\0';
    if (parse_dec(pb, 65535, &v) != 0 || v == 0)
      return fail(why, why_len, "admin URL \"%.200s\": port \"%s\" is not 1..65535", s, pb);
    snprintf(out->port, sizeof(out->port), "%u", (unsigned)v);
  } else {
    snprintf(out->port, sizeof(out->port), "80");
  }
  const char *path = p + alen;
  size_t plen = strlen(path);
  while (plen > 0 && path[plen - 1] == '/')
    plen--;
  if (plen >= sizeof(out->base))
    return fail(why, why_len, "admin URL: path longer than %zu bytes", sizeof(out->base) - 1);
  for (size_t i = 0; i < plen; i++)
    if ((unsigned char)path[i] <= ' ' || (unsigned char)path[i] >= 0x7f)
      return fail(why, why_len, "admin URL \"%.200s\": bad character in the path", s);
  memcpy(out->base, path, plen);
  return 0;
}

static const struct {
  const char *name;
  int cmd;
} commands[] = {
    {"status", DSV4_CTL_CMD_STATUS}, {"seq", DSV4_CTL_CMD_SEQ},
    {"token", DSV4_CTL_CMD_TOKEN},   {"checksum", DSV4_CTL_CMD_CHECKSUM},
    {"dump", DSV4_CTL_CMD_DUMP},     {"verify", DSV4_CTL_CMD_VERIFY},
    {"help", DSV4_CTL_CMD_HELP},
};

/* Options that take a value; the rest are flags. */
static const char *const valued[] = {"--admin", "--token-file", "--timeout", "--layer",
                                     "--seq",   "--layers",     "-o",        "--output"};

static int is_valued(const char *name) {
  for (size_t i = 0; i < sizeof(valued) / sizeof(valued[0]); i++)
    if (strcmp(name, valued[i]) == 0)
      return 1;
  return 0;
}

static int check_seq(const char *s, char *why, size_t why_len) {
  if (!dsv4_seq_name_valid(s, strlen(s)))
    return fail(why, why_len,
                "\"%.64s\" is not a sequence name (1..128 of A-Z a-z 0-9 . _ : -, not starting "
                "with '.')",
                s);
  return 0;
}

int dsv4_ctl_args_parse(int argc, char *const *argv, const char *env_admin, const char *env_token,
                        dsv4_ctl_args_t *out, char *why, size_t why_len) {
  memset(out, 0, sizeof(*out));
  out->admin = env_admin && *env_admin ? env_admin : DSV4_CTL_DEFAULT_ADMIN;
  out->token_file = env_token && *env_token ? env_token : NULL;
  out->progress = -1;
  out->timeout_ms = DSV4_CTL_DEFAULT_TIMEOUT_MS;
  out->pos = -1;
  const char *pos_args[4];
  int n_pos = 0;
  const char *layer = NULL;
  int only_positional = 0;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    /* "-1" is a (bad) position, not an option: let the command say so. */
    if (only_positional || a[0] != '-' || strcmp(a, "-") == 0 || (a[1] >= '0' && a[1] <= '9')) {
      if (n_pos == (int)(sizeof(pos_args) / sizeof(pos_args[0])))
        return fail(why, why_len, "too many arguments (\"%.64s\")", a);
      pos_args[n_pos++] = a;
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
      return fail(why, why_len, "unknown option \"%.64s\"", a);
    memcpy(name, a, nlen);
    name[nlen] = '\0';
    if (is_valued(name)) {
      if (eq) {
        val = eq + 1;
      } else {
        if (i + 1 >= argc)
          return fail(why, why_len, "option %s needs a value", name);
        val = argv[++i];
      }
    } else if (eq) {
      return fail(why, why_len, "option %s takes no value", name);
    }
    if (strcmp(name, "--admin") == 0) {
      out->admin = val;
    } else if (strcmp(name, "--token-file") == 0) {
      out->token_file = val;
    } else if (strcmp(name, "--timeout") == 0) {
      uint64_t t;
      if (parse_dec(val, 3600, &t) != 0 || t == 0)
        return fail(why, why_len, "--timeout \"%.64s\" is not a whole number of seconds 1..3600",
                    val);
      out->timeout_ms = (int)t * 1000;
    } else if (strcmp(name, "--layer") == 0) {
      layer = val;
    } else if (strcmp(name, "--seq") == 0) {
      out->seq = val;
    } else if (strcmp(name, "--layers") == 0) {
      if (dsv4_ctl_parse_layers(val, &out->layer_first, &out->layer_last) != 0)
        return fail(why, why_len, "--layers \"%.64s\" is not a decimal layer or range a-b (a <= b)",
                    val);
      out->has_layers = 1;
    } else if (strcmp(name, "-o") == 0 || strcmp(name, "--output") == 0) {
      if (!*val)
        return fail(why, why_len, "%s needs a file name", name);
      out->output = val;
    } else if (strcmp(name, "--json") == 0) {
      out->json = 1;
    } else if (strcmp(name, "--progress") == 0) {
      out->progress = 1;
    } else if (strcmp(name, "--no-progress") == 0) {
      out->progress = 0;
    } else if (strcmp(name, "-h") == 0 || strcmp(name, "--help") == 0) {
      out->cmd = DSV4_CTL_CMD_HELP;
      return 0;
    } else if (strcmp(name, "--version") == 0) {
      out->cmd = DSV4_CTL_CMD_VERSION;
      return 0;
    } else {
      return fail(why, why_len, "unknown option \"%.64s\"", a);
    }
  }

  if (n_pos == 0)
    return fail(why, why_len, "no command given");
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    if (strcmp(pos_args[0], commands[i].name) == 0)
      out->cmd = commands[i].cmd;
  if (out->cmd == DSV4_CTL_CMD_NONE)
    return fail(why, why_len, "unknown command \"%.64s\"", pos_args[0]);
  const char *cmd = pos_args[0];
  if (layer) {
    uint64_t l;
    if (parse_dec(layer, INT32_MAX, &l) != 0)
      return fail(why, why_len, "--layer \"%.64s\" is not a decimal layer number", layer);
    out->layer = (uint32_t)l;
    out->has_layer = 1;
  }

  /* Which arguments each command takes: anything else is a mistake worth naming. */
  int want_layer = out->cmd == DSV4_CTL_CMD_TOKEN || out->cmd == DSV4_CTL_CMD_CHECKSUM;
  if (layer && !want_layer)
    return fail(why, why_len, "%s takes no --layer", cmd);
  if (out->seq && out->cmd != DSV4_CTL_CMD_CHECKSUM && out->cmd != DSV4_CTL_CMD_DUMP)
    return fail(why, why_len, "%s takes no --seq", cmd);
  if (out->has_layers && out->cmd != DSV4_CTL_CMD_DUMP)
    return fail(why, why_len, "%s takes no --layers", cmd);
  if (out->output && out->cmd != DSV4_CTL_CMD_DUMP)
    return fail(why, why_len, "%s takes no -o", cmd);

  switch (out->cmd) {
  case DSV4_CTL_CMD_HELP:
  case DSV4_CTL_CMD_STATUS:
    if (n_pos > 1)
      return fail(why, why_len, "%s takes no arguments (\"%.64s\")", cmd, pos_args[1]);
    break;
  case DSV4_CTL_CMD_SEQ:
    if (n_pos > 2)
      return fail(why, why_len, "seq takes at most one sequence name (\"%.64s\")", pos_args[2]);
    if (n_pos == 2) {
      out->seq = pos_args[1];
      if (check_seq(out->seq, why, why_len) != 0)
        return DSV4_EINVAL;
    }
    break;
  case DSV4_CTL_CMD_TOKEN: {
    if (n_pos != 3)
      return fail(why, why_len, "usage: token SEQ POS --layer L");
    out->seq = pos_args[1];
    if (check_seq(out->seq, why, why_len) != 0)
      return DSV4_EINVAL;
    uint64_t p;
    if (parse_dec(pos_args[2], INT64_MAX, &p) != 0)
      return fail(why, why_len, "position \"%.64s\" is not a non-negative decimal", pos_args[2]);
    out->pos = (int64_t)p;
    if (!out->has_layer)
      return fail(why, why_len, "token needs --layer L");
    break;
  }
  case DSV4_CTL_CMD_CHECKSUM:
    if (n_pos > 1)
      return fail(why, why_len, "checksum takes no positional arguments (\"%.64s\"; use --seq)",
                  pos_args[1]);
    if (!out->has_layer)
      return fail(why, why_len, "checksum needs --layer L");
    if (out->seq && check_seq(out->seq, why, why_len) != 0)
      return DSV4_EINVAL;
    break;
  case DSV4_CTL_CMD_DUMP:
    if (n_pos > 1)
      return fail(why, why_len, "dump takes no positional arguments (\"%.64s\")", pos_args[1]);
    if (!out->seq)
      return fail(why, why_len, "dump needs --seq S");
    if (check_seq(out->seq, why, why_len) != 0)
      return DSV4_EINVAL;
    if (!out->output)
      return fail(why, why_len, "dump needs -o FILE");
    break;
  case DSV4_CTL_CMD_VERIFY:
    if (n_pos != 2)
      return fail(why, why_len, "usage: verify FILE");
    out->file = pos_args[1];
    break;
  default:
    break;
  }
  return 0;
}
