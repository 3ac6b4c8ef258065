#include "config.h"

#include "config-internal.h"

#include <ctype.h>
#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "decimal.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"

#ifndef DSV4_VERSION
#define DSV4_VERSION "unknown"
#endif

/* The most CPU backend threads, also when "0" takes the online cores. */
#define MAX_THREADS 1024
/* The longest snapshot_dir: its files' paths (a sequence name and a suffix below it) stay within
 * PATH_MAX (the message says the same number). */
#define SNAPSHOT_DIR_MAX 3072
/* The largest page-locked pool (MiB): page-locked memory cannot be swapped or reclaimed, so a
 * value meant as bytes or a typo of a few digits is refused rather than starving the host. */
#define PINNED_POOL_MAX_MIB 65536
/* The longest string option value (the messages say the same number). */
#define OPT_STR_MAX 4096
/* The derived max_body_bytes: safetensors' 8-byte length prefix, room for the largest header the
 * codec takes (DSV4_ST_MAX_HEADER), the tensors, rounded up to whole MiB. */
#define BODY_PREFIX_BYTES 8
#define BODY_HEADER_ROOM ((uint64_t)1 << 20)
#define BODY_ROUND ((uint64_t)1 << 20)

#define STR_(x) #x
#define STR(x) STR_(x) /* a macro's value as a string literal */

typedef enum { OPT_STR, OPT_ENUM, OPT_U32, OPT_U64, OPT_INT, OPT_BOOL } opt_type_t;

enum {
  OPT_SECRET = 1u << 0,  /* a token file: the path is shown, the contents never read here */
  OPT_POW2 = 1u << 1,    /* the value must also be a power of two */
  OPT_ZERO_OK = 1u << 2, /* 0 is accepted outside min..max and means "derive it" */
  OPT_NOFILE = 1u << 3,  /* may not appear in the JSON file (the file's own name) */
  OPT_HOST = 1u << 4,    /* unset, the value comes from the host (dsv4_config_load), not def */
};

/* One row per option: everything else (file, env, flags, checks, help, JSON) reads this table. */
typedef struct {
  const char *name;
  opt_type_t type;
  size_t offset;
  const char *def; /* parsed by the same code as every other source */
  uint64_t min, max;
  const char *values; /* OPT_ENUM: the allowed values, separated by '|' */
  unsigned flags;
  const char *help;
} opt_t;

#define F(field) offsetof(dsv4_config_t, field)
#define DAY_MS 86400000ull

static const opt_t opts[] = {
    {"host", OPT_STR, F(host), "127.0.0.1", 0, 0, NULL, 0, "data plane listen address"},
    {"port", OPT_INT, F(port), "8400", 0, 65535, NULL, 0,
     "data plane TCP port (0 = an ephemeral port)"},
    {"api_token_file", OPT_STR, F(api_token_file), "", 0, 0, NULL, OPT_SECRET,
     "file holding the data plane bearer token (empty = no token)"},
    {"listen_unix", OPT_STR, F(listen_unix), "", 0, 0, NULL, 0,
     "also serve the data plane on a Unix domain socket at this path (mode 0660; empty = off)"},
    {"listen_shm", OPT_STR, F(listen_shm), "", 0, 0, NULL, 0,
     "serve shared-memory regions (zero-copy forwards for same-host clients) on a SOCK_SEQPACKET "
     "Unix socket at this path (mode 0660; empty = off)"},
    {"admin_host", OPT_STR, F(admin_host), "127.0.0.1", 0, 0, NULL, 0,
     "admin plane listen address"},
    {"admin_port", OPT_INT, F(admin_port), "8401", 0, 65535, NULL, 0,
     "admin plane TCP port (0 = an ephemeral port)"},
    {"admin_token_file", OPT_STR, F(admin_token_file), "", 0, 0, NULL, OPT_SECRET,
     "file holding the admin plane bearer token (empty = no token)"},
    {"admin_dump_chunk_bytes", OPT_U32, F(admin_dump_chunk_bytes), "1048576", 4096, 64u << 20, NULL,
     0, "bytes a dump reads per executor step (a batch waits at most one step)"},
    {"backend", OPT_ENUM, F(backend), "auto", 0, 0, "auto|cpu|cuda|level_zero", 0,
     "compute backend"},
    {"threads", OPT_U32, F(threads), "0", 0, MAX_THREADS, NULL, 0,
     "CPU backend threads (0 = online cores)"},
    {"block_size", OPT_U32, F(block_size), "64", DSV4_MIN_BLOCK_SIZE, DSV4_MAX_BLOCK_SIZE, NULL,
     OPT_POW2, "tokens per KV cache block"},
    {"kv_blocks", OPT_U32, F(kv_blocks), "256", 1, 1u << 24, NULL, 0,
     "block ids in the KV cache pool (memory = kv_blocks x stride x served layers)"},
    {"compressed_branch", OPT_ENUM, F(compressed_branch), "on", 0, 0, "on|off", 0,
     "run the compressed branch (SPEC §8) of ratio-4 and ratio-128 layers where weights and "
     "backend "
     "allow (off: those layers serve their SWA part only, and their compressors are not read)"},
    {"max_sequences", OPT_U32, F(max_sequences), "256", 1, 1u << 20, NULL, 0,
     "live sequences at most (503 sequence_limit beyond); each holds one compressor state slot"},
    {"c4_blocks", OPT_U32, F(c4_blocks), "256", 1, 1u << 24, NULL, 0,
     "block ids of the ratio-4 compressed entries (each holds block_size entries = 4 x block_size "
     "positions, at every ratio-4 layer)"},
    {"c128_blocks", OPT_U32, F(c128_blocks), "64", 1, 1u << 24, NULL, 0,
     "block ids of the ratio-128 compressed entries (each holds block_size entries = 128 x "
     "block_size positions, at every ratio-128 layer)"},
    {"model_config", OPT_STR, F(model_config), "", 0, 0, NULL, 0,
     "HuggingFace config.json of the model (empty = built-in DeepSeek V4-Flash)"},
    {"heads", OPT_U32, F(heads), "0", 1, DSV4_MAX_HEADS, NULL, OPT_ZERO_OK,
     "query heads served (0 = the model's num_attention_heads)"},
    {"head_offset", OPT_U32, F(head_offset), "0", 0, DSV4_MAX_HEADS - 1, NULL, 0,
     "first query head served (tensor-parallel shard)"},
    {"layers", OPT_STR, F(layers), "", 0, 0, NULL, 0,
     "layers served, e.g. 0-42 or 0,2,5-7 (empty = 0..num_hidden_layers-1)"},
    {"kv_norm", OPT_ENUM, F(kv_norm), "prenormed", 0, 0, "prenormed|fused", 0,
     "kv arrives normalised (prenormed) or the daemon applies the kv RMSNorm (fused)"},
    {"kv_norm_weights", OPT_STR, F(kv_norm_weights), "", 0, 0, NULL, 0,
     "older name of weights, used when weights is empty"},
    {"weights", OPT_STR, F(weights), "", 0, 0, NULL, 0,
     "checkpoint: a safetensors file, or a directory with model.safetensors.index.json and its "
     "shards (attention sinks, kv_norm weights; needed for outputs attn/lse and kv_norm fused)"},
    {"attention_mode", OPT_ENUM, F(attention_mode), "exact", 0, 0, "exact|fast", 0,
     "attention numerics: exact (byte-identical on every backend) or fast (a GPU's tensor cores)"},
    {"max_batch_tokens", OPT_U32, F(max_batch_tokens), "16384", 1, 1u << 20, NULL, 0,
     "most tokens in one forward batch"},
    {"max_segments", OPT_U32, F(max_segments), "1024", 1, 1u << 20, NULL, 0,
     "most segments in one forward batch"},
    {"max_header_bytes", OPT_U64, F(max_header_bytes), "65536", 1024, 16u << 20, NULL, 0,
     "most bytes of HTTP request headers (431 beyond)"},
    {"max_body_bytes", OPT_U64, F(max_body_bytes), "0", 1, (uint64_t)1 << 40, NULL, OPT_ZERO_OK,
     "most bytes of a request body (413 beyond; 0 = derived from max_batch_tokens and heads)"},
    {"max_connections", OPT_U32, F(max_connections), "0", 1, 1u << 24, NULL, OPT_ZERO_OK,
     "open data plane connections; more get 503 too_many_connections (0 = the soft RLIMIT_NOFILE "
     "less a reserve of 64 descriptors)"},
    {"queue_depth", OPT_U32, F(queue_depth), "64", 1, 65536, NULL, 0,
     "batches waiting for the executor (503 queue_full beyond)"},
    {"prefill_chunk_tokens", OPT_U32, F(prefill_chunk_tokens), "128", 0, 1u << 20, NULL, 0,
     "a prefill batch of more tokens runs in chunks of this many, waiting decodes between them (0 "
     "= never chunk)"},
    {"prefill_chunk_tokens_alone", OPT_U32, F(prefill_chunk_tokens_alone), "512", 0, 1u << 20, NULL,
     0,
     "the chunks of such a prefill while no decode batch has begun since the last chunked prefill "
     "did, nor begins between its chunks: fewer launches and syncs for prefills alone (at most "
     "prefill_chunk_tokens: the same chunks)"},
    {"pinned_pool_mib", OPT_U32, F(pinned_pool_mib), "256", 0, PINNED_POOL_MAX_MIB, NULL, 0,
     "MiB of page-locked host memory for request bodies and answers, registered once with a "
     "backend that copies from it directly (cuda); past it, buffers come from the heap (0 = off)"},
    {"busy_poll_us", OPT_U32, F(busy_poll_us), "0", 0, 10000, NULL, OPT_HOST,
     "microseconds the executor thread and the event loop spin after each batch and answer instead "
     "of sleeping: no wake-up latency in a steady stream, for two cores while it lasts (0 = off; "
     "unset: " STR(DSV4_BUSY_POLL_AUTO_US) " where the daemon may use at least " STR(
         DSV4_BUSY_POLL_MIN_CPUS) " CPUs, else 0)"},
    {"inline_decode_tokens", OPT_U32, F(inline_decode_tokens), "64", 0, 1u << 20, NULL, 0,
     "a decode batch of at most this many tokens from a lone client (one data-plane connection "
     "open) that finds the executor idle runs on the event loop's thread, without the two thread "
     "hand-offs (0 = never)"},
    {"direct_answer_bytes", OPT_U32, F(direct_answer_bytes), "4198400", 0, 1u << 30, NULL, 0,
     "a forward's answer of at most this many bytes goes to the socket from the executor's thread "
     "as soon as it is made, as much of it as the socket takes at once (of a larger answer its "
     "first 256 KiB; the rest from the event loop), rather than waiting for the loop to wake (0 = "
     "always from the loop)"},
    {"in_place_max_bytes", OPT_U64, F(in_place_max_bytes), "4194304", 0, (uint64_t)1 << 40, NULL, 0,
     "on a backend whose launches reach page-locked host memory (cuda): a batch, or a prefill's "
     "chunk, whose q has more bytes than this goes through device memory with copies, and a "
     "smaller one is read and written in place (0 = no limit: every batch in place)"},
    {"cache_flush_bytes", OPT_U64, F(cache_flush_bytes), "4194304", 0, (uint64_t)1 << 40, NULL, 0,
     "on a backend with device memory (cuda): a batch whose q has more bytes than this has its q "
     "and kv flushed from the CPU caches on the host threads before the device copies them (once "
     "they are checked, or before the batch's q half): some hosts copy memory that many cores "
     "have just read at half its rate (0 = never)"},
    {"io_slice_bytes", OPT_U32, F(io_slice_bytes), "1048576", 65536, 1u << 30, NULL, 0,
     "bytes of a request body read, or of an answer written, on one connection in an event loop "
     "iteration at most: what a prefill's large body or answer holds the loop before the other "
     "connections' turns"},
    {"bulk_io_bytes", OPT_U32, F(bulk_io_bytes), "2097152", 0, 1u << 30, NULL, 0,
     "the rest of a request body, or of an answer, of at least this many bytes moves between its "
     "socket and memory on a thread of its own, so that the event loop serves the other "
     "connections meanwhile (0 = the loop moves every byte)"},
    {"check_on_arrival", OPT_BOOL, F(check_on_arrival), "true", 0, 1, NULL, 0,
     "a forward body's tensors are range-checked and hashed (SPEC 4) by the thread that reads "
     "them, as they arrive, rather than by the executor once the whole body is in"},
    {"sequence_idle_timeout_s", OPT_U64, F(sequence_idle_timeout_s), "600", 1, 31536000, NULL, 0,
     "seconds without a batch after which a sequence is deleted"},
    {"implicit_create", OPT_BOOL, F(implicit_create), "false", 0, 1, NULL, 0,
     "accept unknown sequences without \"new\": true"},
    {"header_timeout_ms", OPT_U64, F(header_timeout_ms), "10000", 1, DAY_MS, NULL, 0,
     "milliseconds to receive a request's headers"},
    {"body_timeout_ms", OPT_U64, F(body_timeout_ms), "30000", 1, DAY_MS, NULL, 0,
     "milliseconds to receive a request's body"},
    {"idle_timeout_ms", OPT_U64, F(idle_timeout_ms), "60000", 1, DAY_MS, NULL, 0,
     "milliseconds a keep-alive connection may stay idle"},
    {"write_timeout_ms", OPT_U64, F(write_timeout_ms), "30000", 1, DAY_MS, NULL, 0,
     "milliseconds to send a response"},
    {"drain_timeout_ms", OPT_U64, F(drain_timeout_ms), "30000", 0, DAY_MS, NULL, 0,
     "milliseconds to finish in-flight work after SIGTERM"},
    {"snapshot_dir", OPT_STR, F(snapshot_dir), "", 0, 0, NULL, 0,
     "directory where a drain writes every live sequence as a dump, which the next start restores "
     "before /readyz turns 200 (empty = off)"},
    {"log_level", OPT_ENUM, F(log_level), "info", 0, 0, "debug|info|warn|error", 0,
     "least severe log level written"},
    {"config_file", OPT_STR, F(config_file), "", 0, 0, NULL, OPT_NOFILE,
     "JSON file of options (also --config and DSV4D_CONFIG)"},
};

#define N_OPTS (sizeof(opts) / sizeof(opts[0]))
_Static_assert(sizeof(opts) / sizeof(opts[0]) <= DSV4_CONFIG_MAX_OPTIONS,
               "DSV4_CONFIG_MAX_OPTIONS is too small for the option table");

static const char *const source_names[] = {"default", "file", "env", "cli"};

/* Where a value came from, spelled the way the user wrote it, for error messages. */
typedef struct {
  dsv4_config_source_t src;
  const char *spelling; /* "--block-size", "DSV4D_BLOCK_SIZE", or the file path */
} origin_t;

int dsv4__config_fail(char *why, size_t why_len, const char *fmt, ...) {
  if (why && why_len) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, why_len, fmt, ap);
    va_end(ap);
  }
  return DSV4_ECONFIG;
}

static void origin_text(const opt_t *o, const origin_t *org, char *buf, size_t n) {
  switch (org->src) {
  case DSV4_CONFIG_SRC_DEFAULT:
    snprintf(buf, n, "the built-in default");
    break;
  case DSV4_CONFIG_SRC_FILE:
    snprintf(buf, n, "config file %s (key %s)", org->spelling, o->name);
    break;
  case DSV4_CONFIG_SRC_ENV:
    snprintf(buf, n, "environment variable %s", org->spelling);
    break;
  case DSV4_CONFIG_SRC_CLI:
    snprintf(buf, n, "command line %s", org->spelling);
    break;
  }
}

/* The allowed values of an option, in words, shared by errors and --help. */
static void allowed_text(const opt_t *o, char *buf, size_t n) {
  switch (o->type) {
  case OPT_STR:
    snprintf(buf, n, "any string");
    break;
  case OPT_ENUM:
    snprintf(buf, n, "one of %s", o->values);
    break;
  case OPT_BOOL:
    snprintf(buf, n, "true or false (also 1/0, yes/no, on/off)");
    break;
  default:
    snprintf(buf, n, "%san integer from %llu to %llu%s", (o->flags & OPT_ZERO_OK) ? "0 or " : "",
             (unsigned long long)o->min, (unsigned long long)o->max,
             (o->flags & OPT_POW2) ? ", a power of two" : "");
    break;
  }
}

static const char *type_text(const opt_t *o) {
  switch (o->type) {
  case OPT_STR:
    return "string";
  case OPT_ENUM:
    return "enum";
  case OPT_BOOL:
    return "bool";
  default:
    return "integer";
  }
}

static int bad_value(const opt_t *o, const char *value, const origin_t *org, const char *reason,
                     char *why, size_t why_len) {
  char from[512], allowed[160];
  origin_text(o, org, from, sizeof(from));
  allowed_text(o, allowed, sizeof(allowed));
  return dsv4__config_fail(why, why_len, "option %s: value \"%s\" from %s %s; allowed: %s", o->name,
                           value, from, reason, allowed);
}

static void env_name(const opt_t *o, char *buf, size_t n) {
  size_t i = 0;
  int k = snprintf(buf, n, "DSV4D_");
  for (const char *p = o->name; *p && (size_t)k + i + 1 < n; p++, i++)
    buf[k + i] = (char)toupper((unsigned char)*p);
  buf[k + i] = 0;
}

static void flag_name(const opt_t *o, char *buf, size_t n) {
  snprintf(buf, n, "--%s", o->name);
  for (char *p = buf + 2; *p; p++)
    if (*p == '_')
      *p = '-';
}

static int parse_bool(const char *s, int *out) {
  static const char *const yes[] = {"true", "1", "yes", "on"};
  static const char *const no[] = {"false", "0", "no", "off"};
  for (size_t i = 0; i < 4; i++) {
    if (strcasecmp(s, yes[i]) == 0)
      return *out = 1, 0;
    if (strcasecmp(s, no[i]) == 0)
      return *out = 0, 0;
  }
  return -1;
}

static int enum_has(const char *values, const char *s) {
  size_t n = strlen(s);
  for (const char *p = values; *p;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len == n && n && strncmp(p, s, n) == 0)
      return 1;
    if (!bar)
      break;
    p = bar + 1;
  }
  return 0;
}

/* Validate value for option o and store it; the one place any source's text becomes a value. */
static int opt_set(dsv4_config_t *cfg, size_t idx, const char *value, const origin_t *org,
                   char *why, size_t why_len) {
  const opt_t *o = &opts[idx];
  char *field = (char *)cfg + o->offset;
  uint64_t v = 0;
  switch (o->type) {
  case OPT_STR:
  case OPT_ENUM: {
    if (o->type == OPT_ENUM && !enum_has(o->values, value))
      return bad_value(o, value, org, "is not an allowed value", why, why_len);
    if (strlen(value) > OPT_STR_MAX)
      return bad_value(o, "...", org, "is longer than 4096 bytes", why, why_len);
    char *copy = strdup(value);
    if (!copy)
      return dsv4__config_fail(why, why_len, "option %s: out of memory", o->name), DSV4_ENOMEM;
    free(*(char **)field);
    *(char **)field = copy;
    break;
  }
  case OPT_BOOL: {
    int b;
    if (parse_bool(value, &b))
      return bad_value(o, value, org, "is not a boolean", why, why_len);
    *(int *)field = b;
    break;
  }
  case OPT_U32:
  case OPT_U64:
  case OPT_INT:
    if (dsv4_parse_decimal(value, strlen(value), UINT64_MAX, &v))
      return bad_value(o, value, org, "is not a decimal integer", why, why_len);
    if (!(v == 0 && (o->flags & OPT_ZERO_OK)) && (v < o->min || v > o->max))
      return bad_value(o, value, org, "is out of range", why, why_len);
    if ((o->flags & OPT_POW2) && (v & (v - 1)) != 0)
      return bad_value(o, value, org, "is not a power of two", why, why_len);
    if (o->type == OPT_U32)
      *(uint32_t *)field = (uint32_t)v;
    else if (o->type == OPT_U64)
      *(uint64_t *)field = v;
    else
      *(int *)field = (int)v;
    break;
  }
  cfg->sources[idx] = (unsigned char)org->src;
  return 0;
}

static const opt_t *opt_find(const char *name, size_t len, size_t *idx) {
  for (size_t i = 0; i < N_OPTS; i++) {
    const char *a = opts[i].name;
    size_t k = 0;
    /* Dashes and underscores are the same character in option names. */
    for (; k < len && a[k]; k++) {
      char c = name[k] == '-' ? '_' : name[k];
      if (c != a[k])
        break;
    }
    if (k == len && !a[k]) {
      *idx = i;
      return &opts[i];
    }
  }
  return NULL;
}

static size_t opt_index_of_field(size_t offset) {
  for (size_t i = 0; i < N_OPTS; i++)
    if (opts[i].offset == offset)
      return i;
  return 0;
}

/* One assignment collected from the environment or the command line, applied in precedence order.
 */
typedef struct {
  size_t idx;
  const char *value;
  char spelling[96];
} assign_t;

static int collect_cli(int argc, char **argv, assign_t *out, size_t *n, char *why, size_t why_len) {
  *n = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strncmp(a, "--", 2) != 0 || a[2] == 0)
      return dsv4__config_fail(
          why, why_len,
          "command line: unexpected argument \"%s\"; options are --name=value or "
          "--name value (see --help)",
          a);
    const char *name = a + 2;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    size_t idx;
    const char *value = eq ? eq + 1 : NULL;
    const opt_t *o = opt_find(name, len, &idx);
    if (!o && len == 6 && strncmp(name, "config", 6) == 0)
      o = opt_find("config_file", 11, &idx);
    int negated = 0;
    if (!o && len > 3 && strncmp(name, "no-", 3) == 0) {
      o = opt_find(name + 3, len - 3, &idx);
      if (o && o->type != OPT_BOOL)
        o = NULL;
      negated = o != NULL;
    }
    if (!o)
      return dsv4__config_fail(why, why_len, "command line: unknown option --%.*s (see --help)",
                               (int)len, name);
    if (negated) {
      if (value)
        return dsv4__config_fail(why, why_len, "command line: --%.*s takes no value", (int)len,
                                 name);
      value = "false";
    } else if (!value) {
      int b;
      /* A boolean takes "--name", or "--name true|false" when a boolean word follows. */
      if (o->type == OPT_BOOL && i + 1 < argc && parse_bool(argv[i + 1], &b) == 0)
        value = argv[++i];
      else if (o->type == OPT_BOOL)
        value = "true";
      else if (i + 1 < argc)
        value = argv[++i];
      else
        return dsv4__config_fail(why, why_len, "command line: option --%.*s needs a value",
                                 (int)len, name);
    }
    assign_t *as = &out[(*n)++];
    as->idx = idx;
    as->value = value;
    snprintf(as->spelling, sizeof(as->spelling), "--%.*s", (int)len, name);
  }
  return 0;
}

static int collect_env(char **envp, assign_t *out, size_t *n, size_t cap, char *why,
                       size_t why_len) {
  *n = 0;
  for (char **e = envp; e && *e; e++) {
    if (strncmp(*e, "DSV4D_", 6) != 0)
      continue;
    const char *eq = strchr(*e, '=');
    if (!eq)
      continue;
    size_t len = (size_t)(eq - *e);
    char lower[96];
    if (len - 6 >= sizeof(lower))
      return dsv4__config_fail(why, why_len, "environment: unknown variable %.*s", (int)len, *e);
    for (size_t k = 6; k < len; k++)
      lower[k - 6] = (char)tolower((unsigned char)(*e)[k]);
    lower[len - 6] = 0;
    size_t idx;
    const opt_t *o = NULL;
    /* Names are upper case with underscores only, so DSV4D_BLOCK-SIZE is not an alias. */
    if (!strchr(lower, '-'))
      o = opt_find(lower, len - 6, &idx);
    if (!o && strcmp(lower, "config") == 0)
      o = opt_find("config_file", 11, &idx);
    if (!o)
      return dsv4__config_fail(why, why_len, "environment: unknown variable %.*s (see --help)",
                               (int)len, *e);
    if (*n >= cap)
      return dsv4__config_fail(why, why_len, "environment: too many DSV4D_ variables");
    assign_t *as = &out[(*n)++];
    as->idx = idx;
    as->value = eq + 1;
    snprintf(as->spelling, sizeof(as->spelling), "%.*s", (int)len, *e);
  }
  return 0;
}

/* A JSON value in the form the option's parser reads; the type must match the option's. */
static int json_to_text(const opt_t *o, json_t *v, char *buf, size_t n, const char **out) {
  switch (o->type) {
  case OPT_STR:
  case OPT_ENUM:
    if (!json_is_string(v))
      return -1;
    *out = json_string_value(v);
    return 0;
  case OPT_BOOL:
    if (!json_is_boolean(v))
      return -1;
    *out = json_is_true(v) ? "true" : "false";
    return 0;
  default:
    if (!json_is_integer(v))
      return -1;
    snprintf(buf, n, "%lld", (long long)json_integer_value(v));
    *out = buf;
    return 0;
  }
}

static int apply_file(dsv4_config_t *cfg, const char *path, char *why, size_t why_len) {
  json_error_t je;
  json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
  if (!root)
    return dsv4__config_fail(why, why_len, "config file %s: %s (line %d, column %d)", path, je.text,
                             je.line, je.column);
  int rc = 0;
  if (!json_is_object(root)) {
    rc = dsv4__config_fail(why, why_len, "config file %s: the top level must be a JSON object",
                           path);
    goto out;
  }
  const char *key;
  json_t *v;
  origin_t org = {DSV4_CONFIG_SRC_FILE, path};
  json_object_foreach(root, key, v) {
    size_t idx;
    const opt_t *o = opt_find(key, strlen(key), &idx);
    /* File keys are the field names exactly: a dash is not accepted here. */
    if (!o || strcmp(o->name, key) != 0) {
      rc = dsv4__config_fail(why, why_len, "config file %s: unknown key \"%s\" (see --help)", path,
                             key);
      goto out;
    }
    if (o->flags & OPT_NOFILE) {
      rc = dsv4__config_fail(
          why, why_len,
          "config file %s: key %s cannot be set inside a config file (use --config "
          "or DSV4D_CONFIG)",
          path, key);
      goto out;
    }
    char buf[32], shown[64];
    const char *text;
    if (json_to_text(o, v, buf, sizeof(buf), &text)) {
      char *dump = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
      snprintf(shown, sizeof(shown), "%s", dump ? dump : "?");
      free(dump);
      rc = bad_value(o, shown, &org, "has the wrong JSON type", why, why_len);
      goto out;
    }
    if (o->type == OPT_U32 || o->type == OPT_U64 || o->type == OPT_INT) {
      if (json_integer_value(v) < 0) {
        rc = bad_value(o, text, &org, "is out of range", why, why_len);
        goto out;
      }
    }
    if ((rc = opt_set(cfg, idx, text, &org, why, why_len)))
      goto out;
  }
out:
  json_decref(root);
  return rc;
}

static int apply_assigns(dsv4_config_t *cfg, const assign_t *as, size_t n, dsv4_config_source_t src,
                         int skip_config, char *why, size_t why_len) {
  for (size_t i = 0; i < n; i++) {
    if (skip_config && opts[as[i].idx].offset == F(config_file))
      continue;
    origin_t org = {src, as[i].spelling};
    int rc = opt_set(cfg, as[i].idx, as[i].value, &org, why, why_len);
    if (rc)
      return rc;
  }
  return 0;
}

/* A message for a resolve-time check that names the option, its value and where it came from. */
static int resolve_fail(const dsv4_config_t *cfg, size_t offset, const char *value,
                        const char *reason, char *why, size_t why_len) {
  size_t idx = opt_index_of_field(offset);
  const opt_t *o = &opts[idx];
  char spelling[96], from[512];
  switch (cfg->sources[idx]) {
  case DSV4_CONFIG_SRC_ENV:
    env_name(o, spelling, sizeof(spelling));
    break;
  case DSV4_CONFIG_SRC_CLI:
    flag_name(o, spelling, sizeof(spelling));
    break;
  default:
    snprintf(spelling, sizeof(spelling), "%s", cfg->config_file ? cfg->config_file : "");
    break;
  }
  origin_t org = {(dsv4_config_source_t)cfg->sources[idx], spelling};
  origin_text(o, &org, from, sizeof(from));
  return dsv4__config_fail(why, why_len, "option %s: value \"%s\" from %s %s", o->name, value, from,
                           reason);
}

/* The layer number at the start of p: the text after it, or NULL when p does not start with one. */
static const char *layer_number(const char *p, uint64_t *out) {
  size_t n = strspn(p, "0123456789");
  return dsv4_parse_decimal(p, n, UINT64_MAX, out) == 0 ? p + n : NULL;
}

static int parse_layers(dsv4_config_t *cfg, char *why, size_t why_len) {
  const dsv4_model_t *m = &cfg->model;
  uint32_t total = m->n_layers_total;
  unsigned char *seen = calloc(total, 1);
  if (!seen)
    return DSV4_ENOMEM;
  int rc = 0;
  char reason[320];
  uint32_t count = 0;
  const char *s = cfg->layers;
  if (!*s) {
    for (uint32_t l = 0; l < m->num_hidden_layers; l++)
      seen[l] = 1;
    count = m->num_hidden_layers;
  } else {
    const char *p = s;
    for (;;) {
      while (*p == ' ')
        p++;
      uint64_t a, b;
      if (!(p = layer_number(p, &a)))
        goto syntax;
      b = a;
      if (*p == '-') {
        if (!(p = layer_number(p + 1, &b)))
          goto syntax;
        if (b < a) {
          snprintf(reason, sizeof(reason), "has the descending range %llu-%llu",
                   (unsigned long long)a, (unsigned long long)b);
          rc = resolve_fail(cfg, F(layers), s, reason, why, why_len);
          goto out;
        }
      }
      if (b >= total) {
        snprintf(reason, sizeof(reason),
                 "names layer %llu beyond the model: %s has layers 0..%u (%u hidden + %u MTP)",
                 (unsigned long long)b, m->name, total - 1, m->num_hidden_layers,
                 m->num_nextn_predict_layers);
        rc = resolve_fail(cfg, F(layers), s, reason, why, why_len);
        goto out;
      }
      for (uint64_t l = a; l <= b; l++) {
        if (seen[l]) {
          snprintf(reason, sizeof(reason), "lists layer %llu twice", (unsigned long long)l);
          rc = resolve_fail(cfg, F(layers), s, reason, why, why_len);
          goto out;
        }
        seen[l] = 1;
        count++;
      }
      while (*p == ' ')
        p++;
      if (*p == 0)
        break;
      if (*p != ',')
        goto syntax;
      p++;
    }
  }
  cfg->served_layers = malloc((count ? count : 1) * sizeof(uint32_t));
  if (!cfg->served_layers) {
    rc = DSV4_ENOMEM;
    goto out;
  }
  cfg->n_served = 0;
  for (uint32_t l = 0; l < total; l++)
    if (seen[l])
      cfg->served_layers[cfg->n_served++] = l;
  goto out;
syntax:
  rc = resolve_fail(cfg, F(layers), s,
                    "is not a layer list; allowed: comma-separated layers and inclusive ranges "
                    "such as 0-42 or 0,2,5-7",
                    why, why_len);
out:
  free(seen);
  return rc;
}

unsigned dsv4_config_usable_cpus(void) {
  cpu_set_t set;
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned n = sched_getaffinity(0, sizeof(set), &set) == 0 ? (unsigned)CPU_COUNT(&set)
               : online > 0                                 ? (unsigned)online
                                                            : 1;
  /* A container's cgroup (v2, its own namespace) may allow less time than its CPUs: "max" or a
   * quota and a period in microseconds. */
  FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
  if (!f)
    return n;
  char quota[32];
  unsigned long long period = 0;
  if (fscanf(f, "%31s %llu", quota, &period) == 2 && strcmp(quota, "max") != 0 && period > 0) {
    unsigned long long q = strtoull(quota, NULL, 10), cpus = (q + period - 1) / period;
    if (cpus >= 1 && cpus < n)
      n = (unsigned)cpus;
  }
  fclose(f);
  return n;
}

static int resolve(dsv4_config_t *cfg, char *why, size_t why_len) {
  int rc;
  char reason[768], val[32];
  if (*cfg->model_config) {
    char merr[512];
    rc = dsv4_model_load_file(&cfg->model, cfg->model_config, merr, sizeof(merr));
    if (rc == DSV4_ENOMEM)
      return rc;
    if (rc) {
      snprintf(reason, sizeof(reason), "is not a usable model: %s", merr);
      return resolve_fail(cfg, F(model_config), cfg->model_config, reason, why, why_len);
    }
  } else if ((rc = dsv4_model_builtin_flash(&cfg->model))) {
    return rc;
  }
  uint32_t nh = cfg->model.num_attention_heads;
  if (cfg->head_offset >= nh) {
    snprintf(val, sizeof(val), "%u", cfg->head_offset);
    snprintf(reason, sizeof(reason), "is beyond the model's %u heads; allowed: 0 to %u", nh,
             nh - 1);
    return resolve_fail(cfg, F(head_offset), val, reason, why, why_len);
  }
  if (cfg->heads == 0)
    cfg->heads = nh - cfg->head_offset;
  if ((uint64_t)cfg->head_offset + cfg->heads > nh) {
    snprintf(val, sizeof(val), "%u", cfg->heads);
    snprintf(reason, sizeof(reason),
             "with head_offset %u exceeds the model's %u heads; allowed: 1 to %u (head_offset + "
             "heads <= num_attention_heads)",
             cfg->head_offset, nh, nh - cfg->head_offset);
    return resolve_fail(cfg, F(heads), val, reason, why, why_len);
  }
  if ((rc = parse_layers(cfg, why, why_len)))
    return rc;
  /* Listen addresses are IP literals: a name (localhost) or stray space would only fail later, at
   * bind time, without naming where the value came from. */
  {
    const size_t fields[2] = {F(host), F(admin_host)};
    const char *hosts[2] = {cfg->host, cfg->admin_host};
    for (int i = 0; i < 2; i++) {
      unsigned char a[sizeof(struct in6_addr)];
      if (inet_pton(AF_INET, hosts[i], a) != 1 && inet_pton(AF_INET6, hosts[i], a) != 1)
        return resolve_fail(cfg, fields[i], hosts[i],
                            "is not an IP address; allowed: an IPv4 or IPv6 literal such as "
                            "127.0.0.1, 0.0.0.0 or ::1 (names are not resolved)",
                            why, why_len);
    }
  }
  /* kv_norm_weights is the older name of weights: it stands in when weights is not set. */
  size_t weights_field = *cfg->weights || !*cfg->kv_norm_weights ? F(weights) : F(kv_norm_weights);
  cfg->weights_path = *(char **)((char *)cfg + weights_field);
  if (strcmp(cfg->kv_norm, "fused") == 0 && !*cfg->weights_path)
    return resolve_fail(cfg, F(kv_norm), cfg->kv_norm,
                        "needs weights, or its older name kv_norm_weights (the model's "
                        "safetensors checkpoint, for the layers' kv_norm weights); allowed: "
                        "prenormed, or fused with weights set",
                        why, why_len);
  if (*cfg->weights_path && access(cfg->weights_path, R_OK) != 0) {
    snprintf(reason, sizeof(reason), "cannot be read: %s", strerror(errno));
    return resolve_fail(cfg, weights_field, cfg->weights_path, reason, why, why_len);
  }
  /* Checked now rather than at the drain, when a snapshot that cannot be written is lost. */
  struct stat sb;
  if (*cfg->snapshot_dir &&
      (strlen(cfg->snapshot_dir) > SNAPSHOT_DIR_MAX || stat(cfg->snapshot_dir, &sb) != 0 ||
       !S_ISDIR(sb.st_mode) || access(cfg->snapshot_dir, W_OK | X_OK) != 0))
    return resolve_fail(cfg, F(snapshot_dir), cfg->snapshot_dir,
                        "is not a directory the daemon can write; allowed: an existing writable "
                        "directory (a path of at most 3072 bytes), or empty (no snapshots)",
                        why, why_len);
  if (cfg->sources[opt_index_of_field(F(busy_poll_us))] == DSV4_CONFIG_SRC_DEFAULT)
    cfg->busy_poll_us =
        dsv4_config_usable_cpus() >= DSV4_BUSY_POLL_MIN_CPUS ? DSV4_BUSY_POLL_AUTO_US : 0;
  if (cfg->threads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cfg->threads = n > 0 ? (uint32_t)(n > MAX_THREADS ? MAX_THREADS : n) : 1;
  }
  if (cfg->max_body_bytes) {
    cfg->max_body_bytes_effective = cfg->max_body_bytes;
  } else {
    /* q [N, H, 512] and kv [N, 512] in bf16, the length prefix and a full-size header; plus the
     * largest compressed branch among the served layers (SPEC §8.8): ckv [N, 2048] F32, ikv [N,
     * 512] F32, iq [N, index heads, 128] BF16 and iw [N, index heads] F32 at ratio 4, ckv [N, 1024]
     * F32 at ratio 128. */
    uint64_t per_token = ((uint64_t)cfg->heads * DSV4_HEAD_DIM + DSV4_HEAD_DIM) * sizeof(uint16_t);
    uint64_t branch = 0, ih = cfg->model.index_n_heads;
    for (uint32_t i = 0; i < cfg->n_served; i++) {
      uint32_t r = cfg->model.compress_ratios[cfg->served_layers[i]];
      uint64_t b = r == 4 ? (2048 + 512) * 4 + ih * 128 * 2 + ih * 4 : r == 128 ? 1024 * 4 : 0;
      branch = b > branch ? b : branch;
    }
    per_token += branch;
    uint64_t need =
        BODY_PREFIX_BYTES + BODY_HEADER_ROOM + (uint64_t)cfg->max_batch_tokens * per_token;
    cfg->max_body_bytes_effective = (need + BODY_ROUND - 1) / BODY_ROUND * BODY_ROUND;
  }
  return 0;
}

void dsv4_config_print_help(FILE *out) {
  fprintf(out,
          "Usage: dsv4d [--config FILE] [--name=value | --name value]...\n"
          "Serves the attention layers of DeepSeek V4 over HTTP.\n\n"
          "Each option is read, from lowest to highest precedence, from its built-in default,\n"
          "the JSON config file (key = the option name), the environment (DSV4D_<NAME>) and\n"
          "the command line (--name or --name with dashes). Booleans also take --name and\n"
          "--no-name.\n\n"
          "  --help, -h     print this help and exit\n"
          "  --version      print the version and exit\n\n");
  for (size_t i = 0; i < N_OPTS; i++) {
    const opt_t *o = &opts[i];
    char flag[96], env[96], allowed[160];
    flag_name(o, flag, sizeof(flag));
    env_name(o, env, sizeof(env));
    allowed_text(o, allowed, sizeof(allowed));
    if (o->flags & OPT_HOST)
      fprintf(out, "  %s (%s, default depends on the host, see below; %s; env %s)\n      %s\n",
              flag, type_text(o), allowed, env, o->help);
    else
      fprintf(out, "  %s (%s, default \"%s\"; %s; env %s%s)\n      %s\n", flag, type_text(o),
              o->def, allowed, env, (o->flags & OPT_SECRET) ? "; secret" : "", o->help);
  }
}

int dsv4_config_load(dsv4_config_t *cfg, int argc, char **argv, char **envp, char *why,
                     size_t why_len) {
  memset(cfg, 0, sizeof(*cfg));
  if (why && why_len)
    why[0] = 0;
  int rc = 0;
  origin_t def = {DSV4_CONFIG_SRC_DEFAULT, "default"};
  for (size_t i = 0; i < N_OPTS; i++)
    if ((rc = opt_set(cfg, i, opts[i].def, &def, why, why_len)))
      return rc;

  /* --help and --version win over everything else, even a broken configuration. */
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      dsv4_config_print_help(stdout);
      return DSV4_CONFIG_HELP;
    }
    if (strcmp(argv[i], "--version") == 0) {
      printf("dsv4d %s\n", DSV4_VERSION);
      return DSV4_CONFIG_VERSION;
    }
  }

  size_t nenv = 0, ncli = 0, cap = 0;
  for (char **e = envp; e && *e; e++)
    cap++;
  assign_t *cli = calloc(argc > 0 ? (size_t)argc : 1, sizeof(assign_t));
  assign_t *env = calloc(cap ? cap : 1, sizeof(assign_t));
  if (!cli || !env) {
    rc = DSV4_ENOMEM;
    goto out;
  }
  if ((rc = collect_cli(argc, argv, cli, &ncli, why, why_len)) ||
      (rc = collect_env(envp, env, &nenv, cap, why, why_len)))
    goto out;

  /* The file's name comes from the command line, else the environment; it is applied first. */
  if ((rc = apply_assigns(cfg, env, nenv, DSV4_CONFIG_SRC_ENV, 0, why, why_len)) ||
      (rc = apply_assigns(cfg, cli, ncli, DSV4_CONFIG_SRC_CLI, 0, why, why_len)))
    goto out;
  if (*cfg->config_file) {
    dsv4_config_source_t cf_src =
        (dsv4_config_source_t)cfg->sources[opt_index_of_field(F(config_file))];
    char *path = strdup(cfg->config_file);
    if (!path) {
      rc = DSV4_ENOMEM;
      goto out;
    }
    /* Reset to defaults so that the file sits below env and CLI, then re-apply those above it. */
    for (size_t i = 0; i < N_OPTS; i++)
      if ((rc = opt_set(cfg, i, opts[i].def, &def, why, why_len)))
        break;
    origin_t org = {cf_src, path};
    if (!rc)
      rc = opt_set(cfg, opt_index_of_field(F(config_file)), path, &org, why, why_len);
    if (!rc)
      rc = apply_file(cfg, path, why, why_len);
    free(path);
    if (rc || (rc = apply_assigns(cfg, env, nenv, DSV4_CONFIG_SRC_ENV, 1, why, why_len)) ||
        (rc = apply_assigns(cfg, cli, ncli, DSV4_CONFIG_SRC_CLI, 1, why, why_len)))
      goto out;
  }
  rc = resolve(cfg, why, why_len);
  if (rc == DSV4_ENOMEM && why && why_len && !why[0])
    snprintf(why, why_len, "configuration: out of memory");
out:
  free(cli);
  free(env);
  return rc;
}

const char *dsv4_config_source(const dsv4_config_t *cfg, const char *name) {
  size_t idx;
  const opt_t *o = opt_find(name, strlen(name), &idx);
  if (!o || strcmp(o->name, name) != 0 || cfg->sources[idx] > DSV4_CONFIG_SRC_CLI)
    return NULL;
  return source_names[cfg->sources[idx]];
}

static json_t *rope_json(const dsv4_rope_params_t *p) {
  json_t *r = json_pack("{s:f, s:b}", "theta", p->theta, "yarn", p->yarn);
  if (r && p->yarn)
    json_object_update_new(r,
                           json_pack("{s:f, s:f, s:f, s:f}", "factor", p->factor,
                                     "original_max_position_embeddings", p->original_max_position,
                                     "beta_fast", p->beta_fast, "beta_slow", p->beta_slow));
  return r;
}

json_t *dsv4_config_to_json(const dsv4_config_t *cfg) {
  json_t *options = json_object();
  json_t *root = json_object();
  if (!options || !root)
    goto fail;
  for (size_t i = 0; i < N_OPTS; i++) {
    const opt_t *o = &opts[i];
    const char *field = (const char *)cfg + o->offset;
    json_t *v;
    switch (o->type) {
    case OPT_STR:
    case OPT_ENUM:
      v = json_string(*(char *const *)field ? *(char *const *)field : "");
      break;
    case OPT_BOOL:
      v = json_boolean(*(const int *)field);
      break;
    case OPT_U32:
      v = json_integer(*(const uint32_t *)field);
      break;
    case OPT_U64:
      v = json_integer((json_int_t) * (const uint64_t *)field);
      break;
    default:
      v = json_integer(*(const int *)field);
      break;
    }
    unsigned s = cfg->sources[i] <= DSV4_CONFIG_SRC_CLI ? cfg->sources[i] : 0;
    json_t *row = json_pack("{s:o, s:s}", "value", v, "source", source_names[s]);
    if (row && (o->flags & OPT_SECRET))
      json_object_set_new(row, "secret", json_true());
    if (!row || json_object_set_new(options, o->name, row))
      goto fail;
  }
  json_t *layers = json_array(), *ratios = json_array();
  for (uint32_t i = 0; layers && i < cfg->n_served; i++)
    json_array_append_new(layers, json_integer(cfg->served_layers[i]));
  for (uint32_t i = 0; ratios && cfg->model.compress_ratios && i < cfg->model.n_layers_total; i++)
    json_array_append_new(ratios, json_integer(cfg->model.compress_ratios[i]));
  const dsv4_model_t *m = &cfg->model;
  json_t *model = json_pack(
      "{s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:I, s:o, s:o, s:o}", "name",
      m->name ? m->name : "", "num_attention_heads", (int)m->num_attention_heads, "head_dim",
      (int)m->head_dim, "qk_rope_head_dim", (int)m->qk_rope_head_dim, "sliding_window",
      (int)m->sliding_window, "num_hidden_layers", (int)m->num_hidden_layers,
      "num_nextn_predict_layers", (int)m->num_nextn_predict_layers, "rms_norm_eps",
      (double)m->rms_norm_eps, "max_position_embeddings", (json_int_t)m->max_position_embeddings,
      "compress_ratios", ratios, "rope_plain", rope_json(&m->rope_plain), "rope_compress",
      rope_json(&m->rope_compress));
  json_t *resolved =
      json_pack("{s:o, s:o, s:I}", "model", model, "served_layers", layers,
                "max_body_bytes_effective", (json_int_t)cfg->max_body_bytes_effective);
  if (!resolved)
    goto fail;
  json_object_set_new(root, "options", options);
  json_object_set_new(root, "resolved", resolved);
  return root;
fail:
  json_decref(options);
  json_decref(root);
  return NULL;
}

void dsv4_config_free(dsv4_config_t *cfg) {
  if (!cfg)
    return;
  for (size_t i = 0; i < N_OPTS; i++)
    if (opts[i].type == OPT_STR || opts[i].type == OPT_ENUM) {
      char **p = (char **)((char *)cfg + opts[i].offset);
      free(*p);
      *p = NULL;
    }
  dsv4_model_free(&cfg->model);
  free(cfg->served_layers);
  cfg->served_layers = NULL;
  cfg->n_served = 0;
}
