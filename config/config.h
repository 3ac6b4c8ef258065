#ifndef DSV4_CONFIG_CONFIG_H
#define DSV4_CONFIG_CONFIG_H

/*
 * The daemon's configuration. One table row per option (config.c, in the style of redis's
 * static_configs[]) drives the JSON file, the DSV4D_* environment variables, the --flags, the range
 * checks, --help and /admin/v1/config, so no option is parsed by hand in two places.
 *
 * Precedence: built-in defaults < JSON file (--config FILE or DSV4D_CONFIG) < DSV4D_* environment
 * < command-line flags. Names: the field name in the file (`block_size`), `--block-size` or
 * `--block_size` on the command line (`--name=value` or `--name value`; a boolean also as `--name`
 * or `--no-name`), DSV4D_BLOCK_SIZE in the environment.
 */

#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Room for the source of every option; the table has fewer rows (checked at compile time). */
#define DSV4_CONFIG_MAX_OPTIONS 64

typedef enum {
  DSV4_CONFIG_SRC_DEFAULT = 0,
  DSV4_CONFIG_SRC_FILE,
  DSV4_CONFIG_SRC_ENV,
  DSV4_CONFIG_SRC_CLI
} dsv4_config_source_t;

typedef struct dsv4_config {
  char *host;             /* data plane listener, default 127.0.0.1 */
  int port;               /* default 8400; 0 = an ephemeral port (tests) */
  char *api_token_file;   /* bearer token for the data plane; empty = none (secret) */
  char *admin_host;       /* admin plane listener, default 127.0.0.1 */
  char *listen_unix;      /* data plane on a Unix domain socket too; "" = off */
  char *listen_shm;       /* shared regions' SOCK_SEQPACKET socket (SPEC §6.1); "" = off */
  int admin_port;         /* default 8401; 0 = an ephemeral port */
  char *admin_token_file; /* bearer token for the admin plane; empty = none (secret) */
  uint32_t admin_dump_chunk_bytes; /* bytes a dump reads per executor step */
  char *backend;                   /* auto|cpu|cuda|level_zero */
  uint32_t threads;    /* CPU executor threads; 0 in the input = online cores, never 0 after load */
  uint32_t block_size; /* power of two, 16..256 */
  uint32_t kv_blocks;  /* block ids in the pool */
  uint32_t max_sequences; /* live sequences (and compressor state slots) at most */
  uint32_t c4_blocks;     /* block ids of the ratio-4 compressed entries */
  uint32_t c128_blocks;   /* block ids of the ratio-128 compressed entries */
  char *model_config;     /* HF config.json; empty = built-in V4-Flash */
  uint32_t heads;         /* 0 in the input = the model's num_attention_heads; never 0 after load */
  uint32_t head_offset;   /* first served head; head_offset + heads <= num_attention_heads */
  char *layers;           /* e.g. "0-42" or "0,2,5-7"; empty = 0..num_hidden_layers-1 */
  char *kv_norm;          /* prenormed|fused */
  char *kv_norm_weights;  /* older name of weights */
  char *weights;          /* checkpoint: safetensors file or HF directory; empty = none */
  char *attention_mode;   /* exact|fast */
  char *compressed_branch; /* on|off */
  uint32_t max_batch_tokens;
  uint32_t max_segments;
  uint64_t max_header_bytes;
  uint64_t max_body_bytes;  /* 0 = derived, see max_body_bytes_effective */
  uint32_t max_connections; /* data plane; 0 = dsv4_server_default_max_connections() */
  uint32_t queue_depth;
  uint32_t prefill_chunk_tokens;       /* 0 = never chunk a prefill */
  uint32_t prefill_chunk_tokens_alone; /* its chunks while no decode runs beside it */
  uint32_t pinned_pool_mib;            /* page-locked pool for bodies and answers; 0 = off */
  uint32_t busy_poll_us; /* executor and loop spin this long after each batch; 0 = off; unset:
                          * DSV4_BUSY_POLL_AUTO_US where DSV4_BUSY_POLL_MIN_CPUS are usable */
  uint32_t inline_decode_tokens; /* a lone client's decode this small runs on the loop thread */
  uint32_t direct_answer_bytes;  /* of a forward's answer written by the executor thread */
  uint64_t in_place_max_bytes;   /* a batch's q this large at most is read in place (cuda) */
  uint64_t cache_flush_bytes;    /* a larger batch's tensors leave the CPU caches before copies */
  uint32_t io_slice_bytes;       /* a connection's read or write in a loop iteration, at most */
  uint32_t bulk_io_bytes;        /* a body's or answer's rest this large moves on its own thread */
  int check_on_arrival;          /* a forward body's q and kv checked and hashed as they arrive */
  uint64_t sequence_idle_timeout_s;
  int implicit_create; /* 0 or 1 */
  uint64_t header_timeout_ms, body_timeout_ms, idle_timeout_ms, write_timeout_ms;
  uint64_t drain_timeout_ms;
  char *snapshot_dir; /* where a drain writes every live sequence; "" = off */
  char *log_level;    /* debug|info|warn|error */
  char *config_file;  /* the JSON file read, empty when none */

  /* Resolved after load. */
  dsv4_model_t model;
  uint32_t *served_layers; /* ascending, no duplicates, each < model.n_layers_total */
  uint32_t n_served;
  /*
   * max_body_bytes when set, else derived: 8 (length prefix) + 1 MiB (safetensors header allowance)
   * + max_batch_tokens * (heads * 512 * 2 + 512 * 2), rounded up to a multiple of 1 MiB.
   */
  uint64_t max_body_bytes_effective;
  const char *weights_path; /* weights, or kv_norm_weights when weights is empty ("" = none) */

  /* Where each option's value came from, indexed by the table row (see dsv4_config_source). */
  unsigned char sources[DSV4_CONFIG_MAX_OPTIONS];
} dsv4_config_t;

/* What dsv4_config_load returns after printing --help or --version to stdout (main exits 0). */
#define DSV4_CONFIG_HELP 1
#define DSV4_CONFIG_VERSION 2

/* busy_poll_us when it is not set: this many microseconds where the daemon may keep at least
 * DSV4_BUSY_POLL_MIN_CPUS CPUs busy (dsv4_config_usable_cpus), else 0. Its two spinning threads
 * took 10-40 % of a 2-core machine's tokens/s, and gave a 16-core host's one-token decodes 6-28 %
 * more (tests/bench/NOTES.md); hosts between were not measured, so they do not spin. */
#define DSV4_BUSY_POLL_AUTO_US 100
#define DSV4_BUSY_POLL_MIN_CPUS 16

/* The CPUs this process may keep busy: its affinity mask's, or fewer where its cgroup (v2) has a
 * CPU quota (cpu.max), rounded up. */
unsigned dsv4_config_usable_cpus(void);

/*
 * Fill cfg from the defaults, the JSON file, envp (NULL-terminated "NAME=value" strings; NULL = no
 * environment) and argv[1..argc-1], then load the model and resolve the derived values.
 * Returns 0; DSV4_CONFIG_HELP or DSV4_CONFIG_VERSION after printing to stdout; DSV4_ENOMEM; or
 * DSV4_ECONFIG with why naming the option, the value, the source and the allowed range or values.
 * Unknown DSV4D_* variables, unknown flags and unknown file keys are errors. cfg must be freed with
 * dsv4_config_free after any return (it is always left in a freeable state).
 */
int dsv4_config_load(dsv4_config_t *cfg, int argc, char **argv, char **envp, char *why,
                     size_t why_len);

/*
 * The effective configuration: {"options": {name: {"value": v, "source": "default|file|env|cli"}},
 * "resolved": {...}}. Secret options (token files) show their path with "secret": true; the
 * configuration never reads their contents. NULL on allocation failure; the caller owns the
 * reference.
 */
json_t *dsv4_config_to_json(const dsv4_config_t *cfg);

/* The source of option `name` ("default", "file", "env", "cli"), or NULL for an unknown name. */
const char *dsv4_config_source(const dsv4_config_t *cfg, const char *name);

void dsv4_config_free(dsv4_config_t *cfg);

/* Every option: its type, default, range or values, environment variable and a one-line
 * description. */
void dsv4_config_print_help(FILE *out);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_CONFIG_CONFIG_H */
