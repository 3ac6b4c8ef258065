/*
 * Unit tests of the configuration: defaults, the precedence of the four sources, range errors that
 * name the option, layer lists, the derived body limit, and the model geometry read from
 * HuggingFace-style config.json files (V4-Flash and V4-Pro shapes, RoPE scaling variants).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "dsv4-error.h"
#include "model.h"
#include "rope.h"

static char tmpdir[] = "/tmp/dsv4-config-test-XXXXXX";

/* Writes text to tmpdir/name and returns the path in a static rotating buffer. */
static const char *write_file(const char *name, const char *text) {
  static char paths[4][256];
  static int next;
  char *p = paths[next++ % 4];
  snprintf(p, 256, "%s/%s", tmpdir, name);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  return p;
}

/* Loads with argv (argv[0] added here) and a NULL-terminated env list. */
static int load(dsv4_config_t *cfg, char *err, size_t errlen, const char *const *args,
                const char *const *env) {
  char *argv[64];
  int argc = 0;
  argv[argc++] = (char *)"dsv4d";
  for (; args && *args; args++)
    argv[argc++] = (char *)*args;
  argv[argc] = NULL;
  return dsv4_config_load(cfg, argc, argv, (char **)env, err, errlen);
}

static void expect_ok(dsv4_config_t *cfg, const char *const *args, const char *const *env) {
  char err[1024];
  int rc = load(cfg, err, sizeof(err), args, env);
  if (rc != 0)
    fail_msg("load failed (%d): %s", rc, err);
}

/* Expects DSV4_ECONFIG with every needle in the message. */
static void expect_error(const char *const *args, const char *const *env, ...) {
  dsv4_config_t cfg;
  char err[1024];
  int rc = load(&cfg, err, sizeof(err), args, env);
  dsv4_config_free(&cfg);
  if (rc != DSV4_ECONFIG)
    fail_msg("expected DSV4_ECONFIG, got %d (first arg %s)", rc, args && args[0] ? args[0] : "");
  va_list ap;
  va_start(ap, env);
  for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;) {
    if (!strstr(err, needle))
      fail_msg("error \"%s\" lacks \"%s\"", err, needle);
  }
  va_end(ap);
}

static int rope_equal(const dsv4_rope_params_t *a, const dsv4_rope_params_t *b) {
  return a->theta == b->theta && a->yarn == b->yarn && a->factor == b->factor &&
         a->original_max_position == b->original_max_position && a->beta_fast == b->beta_fast &&
         a->beta_slow == b->beta_slow;
}

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static void test_defaults(void **state) {
  (void)state;
  dsv4_config_t cfg;
  expect_ok(&cfg, NULL, NULL);
  assert_string_equal(cfg.host, "127.0.0.1");
  assert_int_equal(cfg.port, 8400);
  assert_string_equal(cfg.admin_host, "127.0.0.1");
  assert_int_equal(cfg.admin_port, 8401);
  assert_string_equal(cfg.api_token_file, "");
  assert_string_equal(cfg.backend, "auto");
  assert_int_equal(cfg.threads, (uint32_t)sysconf(_SC_NPROCESSORS_ONLN));
  assert_int_equal(cfg.block_size, 64);
  assert_int_equal(cfg.kv_blocks, 256);
  assert_string_equal(cfg.model_config, "");
  assert_int_equal(cfg.heads, 64); /* resolved from the built-in model */
  assert_int_equal(cfg.head_offset, 0);
  assert_string_equal(cfg.layers, "");
  assert_string_equal(cfg.kv_norm, "prenormed");
  assert_string_equal(cfg.kv_norm_weights, "");
  assert_int_equal(cfg.max_batch_tokens, 16384);
  assert_int_equal(cfg.max_segments, 1024);
  assert_int_equal(cfg.max_header_bytes, 65536);
  assert_int_equal(cfg.max_body_bytes, 0);
  assert_int_equal(cfg.queue_depth, 64);
  assert_int_equal(cfg.prefill_chunk_tokens, 128);
  assert_int_equal(cfg.prefill_chunk_tokens_alone, 512);
  assert_int_equal(cfg.busy_poll_us, dsv4_config_usable_cpus() >= DSV4_BUSY_POLL_MIN_CPUS
                                         ? DSV4_BUSY_POLL_AUTO_US
                                         : 0);
  assert_int_equal(cfg.inline_decode_tokens, 64);
  assert_int_equal(cfg.io_slice_bytes, 1048576);
  assert_int_equal(cfg.bulk_io_bytes, 2097152);
  assert_int_equal(cfg.pinned_pool_mib, 256);
  assert_string_equal(cfg.listen_shm, "");
  assert_int_equal(cfg.sequence_idle_timeout_s, 600);
  assert_int_equal(cfg.implicit_create, 0);
  assert_int_equal(cfg.header_timeout_ms, 10000);
  assert_int_equal(cfg.body_timeout_ms, 30000);
  assert_int_equal(cfg.idle_timeout_ms, 60000);
  assert_int_equal(cfg.write_timeout_ms, 30000);
  assert_int_equal(cfg.drain_timeout_ms, 30000);
  assert_string_equal(cfg.snapshot_dir, "");
  assert_string_equal(cfg.log_level, "info");
  assert_string_equal(cfg.config_file, "");
  /* Layers 0..42 of the built-in V4-Flash model, not its MTP layer 43. */
  assert_int_equal(cfg.n_served, 43);
  for (uint32_t i = 0; i < 43; i++)
    assert_int_equal(cfg.served_layers[i], i);
  /* 8 + 1 MiB + 16384 * (64*1024 + 1024 + 26880) = 1,531,969,544 bytes, rounded up to 1462 MiB;
   * 26880 bytes per token are a ratio-4 layer's ckv, ikv, iq and iw (SPEC §8.8). */
  assert_int_equal(cfg.max_body_bytes_effective, 1462ull << 20);
  assert_string_equal(dsv4_config_source(&cfg, "block_size"), "default");
  assert_string_equal(dsv4_config_source(&cfg, "log_level"), "default");
  assert_null(dsv4_config_source(&cfg, "no_such_option"));
  dsv4_config_free(&cfg);
}

static void test_sources_and_precedence(void **state) {
  (void)state;
  const char *file = write_file("prec.json", "{\"block_size\": 32, \"port\": 9000, \"kv_blocks\": "
                                             "10, \"log_level\": \"debug\", \"implicit_create\": "
                                             "true, \"host\": \"0.0.0.0\"}");
  char cfgenv[300];
  snprintf(cfgenv, sizeof(cfgenv), "DSV4D_CONFIG=%s", file);
  dsv4_config_t cfg;

  /* File only (through --config). */
  expect_ok(&cfg, (const char *const[]){"--config", file, NULL}, NULL);
  assert_int_equal(cfg.block_size, 32);
  assert_int_equal(cfg.port, 9000);
  assert_int_equal(cfg.implicit_create, 1);
  assert_string_equal(cfg.host, "0.0.0.0");
  assert_string_equal(cfg.config_file, file);
  assert_string_equal(dsv4_config_source(&cfg, "block_size"), "file");
  assert_string_equal(dsv4_config_source(&cfg, "config_file"), "cli");
  assert_string_equal(dsv4_config_source(&cfg, "queue_depth"), "default");
  dsv4_config_free(&cfg);

  /* Env over file, file named by DSV4D_CONFIG; unrelated variables are ignored. */
  expect_ok(&cfg, NULL,
            (const char *const[]){"PATH=/usr/bin", cfgenv, "DSV4D_BLOCK_SIZE=128",
                                  "DSV4D_KV_BLOCKS=20", NULL});
  assert_int_equal(cfg.block_size, 128);
  assert_int_equal(cfg.kv_blocks, 20);
  assert_int_equal(cfg.port, 9000);
  assert_string_equal(dsv4_config_source(&cfg, "block_size"), "env");
  assert_string_equal(dsv4_config_source(&cfg, "port"), "file");
  assert_string_equal(dsv4_config_source(&cfg, "config_file"), "env");
  dsv4_config_free(&cfg);

  /* CLI over env over file, in both spellings and both forms. */
  expect_ok(&cfg,
            (const char *const[]){"--block-size", "256", "--kv_blocks=30", "--no-implicit-create",
                                  "--log-level=warn", NULL},
            (const char *const[]){cfgenv, "DSV4D_BLOCK_SIZE=128", "DSV4D_KV_BLOCKS=20",
                                  "DSV4D_LOG_LEVEL=error", NULL});
  assert_int_equal(cfg.block_size, 256);
  assert_int_equal(cfg.kv_blocks, 30);
  assert_int_equal(cfg.implicit_create, 0);
  assert_string_equal(cfg.log_level, "warn");
  assert_int_equal(cfg.port, 9000);
  assert_string_equal(dsv4_config_source(&cfg, "block_size"), "cli");
  assert_string_equal(dsv4_config_source(&cfg, "implicit_create"), "cli");
  dsv4_config_free(&cfg);

  /* --config on the command line wins over DSV4D_CONFIG. */
  const char *file2 = write_file("prec2.json", "{\"block_size\": 16}");
  expect_ok(&cfg, (const char *const[]){"--config=", NULL}, (const char *const[]){cfgenv, NULL});
  assert_int_equal(cfg.block_size, 64); /* an empty --config means no file */
  dsv4_config_free(&cfg);
  expect_ok(&cfg, (const char *const[]){"--config-file", file2, NULL},
            (const char *const[]){cfgenv, NULL});
  assert_int_equal(cfg.block_size, 16);
  assert_int_equal(cfg.port, 8400);
  dsv4_config_free(&cfg);

  /* A boolean flag alone means true; env booleans take words. */
  expect_ok(&cfg, (const char *const[]){"--implicit-create", NULL}, NULL);
  assert_int_equal(cfg.implicit_create, 1);
  dsv4_config_free(&cfg);
  expect_ok(&cfg, NULL, (const char *const[]){"DSV4D_IMPLICIT_CREATE=yes", NULL});
  assert_int_equal(cfg.implicit_create, 1);
  dsv4_config_free(&cfg);

  /* The page-locked pool: 0 turns it off, and its largest size is accepted. */
  expect_ok(&cfg, (const char *const[]){"--pinned-pool-mib", "0", NULL}, NULL);
  assert_int_equal(cfg.pinned_pool_mib, 0);
  dsv4_config_free(&cfg);
  expect_ok(&cfg, NULL, (const char *const[]){"DSV4D_PINNED_POOL_MIB=65536", NULL});
  assert_int_equal(cfg.pinned_pool_mib, 65536);
  assert_string_equal(dsv4_config_source(&cfg, "pinned_pool_mib"), "env");
  dsv4_config_free(&cfg);
}

/* busy_poll_us unset follows the CPUs the daemon may use (its affinity, here narrowed to one
 * CPU and then widened again); set, it is kept, 0 included. */
static void test_busy_poll_default(void **state) {
  (void)state;
  cpu_set_t all, one;
  assert_int_equal(sched_getaffinity(0, sizeof(all), &all), 0);
  unsigned n = dsv4_config_usable_cpus();
  assert_true(n >= 1 && n <= (unsigned)CPU_COUNT(&all));
  int first = 0;
  while (!CPU_ISSET(first, &all))
    first++;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  assert_int_equal(sched_setaffinity(0, sizeof(one), &one), 0);
  dsv4_config_t cfg;
  expect_ok(&cfg, NULL, NULL);
  unsigned narrowed = dsv4_config_usable_cpus();
  uint32_t narrowed_poll = cfg.busy_poll_us;
  dsv4_config_free(&cfg);
  assert_int_equal(sched_setaffinity(0, sizeof(all), &all), 0);
  assert_int_equal(narrowed, 1);
  assert_int_equal(narrowed_poll, 0);

  expect_ok(&cfg, NULL, NULL);
  assert_int_equal(cfg.busy_poll_us, n >= DSV4_BUSY_POLL_MIN_CPUS ? DSV4_BUSY_POLL_AUTO_US : 0);
  assert_string_equal(dsv4_config_source(&cfg, "busy_poll_us"), "default");
  dsv4_config_free(&cfg);
  const char *const values[] = {"0", "7", "100"};
  for (int i = 0; i < 3; i++) {
    expect_ok(&cfg, (const char *const[]){"--busy-poll-us", values[i], NULL}, NULL);
    assert_int_equal(cfg.busy_poll_us, (uint32_t)atoi(values[i]));
    dsv4_config_free(&cfg);
  }
}

static void test_range_errors_name_the_option(void **state) {
  (void)state;
  static const struct {
    const char *flag, *value, *option;
  } cases[] = {
      {"--block-size", "100", "block_size"},
      {"--block-size", "8", "block_size"},
      {"--block-size", "512", "block_size"},
      {"--port", "70000", "port"},
      {"--port", "-1", "port"},
      {"--port", "12x", "port"},
      {"--admin-port", "65536", "admin_port"},
      {"--heads", "129", "heads"},
      {"--head-offset", "128", "head_offset"},
      {"--kv-blocks", "0", "kv_blocks"},
      {"--threads", "5000", "threads"},
      {"--max-batch-tokens", "0", "max_batch_tokens"},
      {"--max-segments", "0", "max_segments"},
      {"--max-header-bytes", "10", "max_header_bytes"},
      {"--queue-depth", "0", "queue_depth"},
      {"--prefill-chunk-tokens", "2000000", "prefill_chunk_tokens"},
      {"--prefill-chunk-tokens-alone", "2000000", "prefill_chunk_tokens_alone"},
      {"--pinned-pool-mib", "-1", "pinned_pool_mib"},
      {"--pinned-pool-mib", "65537", "pinned_pool_mib"},
      {"--pinned-pool-mib", "99999999999", "pinned_pool_mib"},
      {"--busy-poll-us", "10001", "busy_poll_us"},
      {"--busy-poll-us", "-5", "busy_poll_us"},
      {"--inline-decode-tokens", "2000000", "inline_decode_tokens"},
      {"--io-slice-bytes", "65535", "io_slice_bytes"},
      {"--bulk-io-bytes", "1073741825", "bulk_io_bytes"},
      {"--header-timeout-ms", "0", "header_timeout_ms"},
      {"--body-timeout-ms", "0", "body_timeout_ms"},
      {"--idle-timeout-ms", "0", "idle_timeout_ms"},
      {"--write-timeout-ms", "0", "write_timeout_ms"},
      {"--drain-timeout-ms", "999999999999", "drain_timeout_ms"},
      {"--sequence-idle-timeout-s", "0", "sequence_idle_timeout_s"},
      {"--max-body-bytes", "99999999999999999999999", "max_body_bytes"},
      {"--backend", "gpu", "backend"},
      {"--log-level", "trace", "log_level"},
      {"--kv-norm", "none", "kv_norm"},
      {"--implicit-create=maybe", NULL, "implicit_create"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const char *args[3] = {cases[i].flag, cases[i].value, NULL};
    const char *value = cases[i].value ? cases[i].value : "maybe";
    char flag[64];
    snprintf(flag, sizeof(flag), "%.*s", (int)strcspn(cases[i].flag, "="), cases[i].flag);
    expect_error(args, NULL, cases[i].option, value, flag, "allowed", NULL);
  }
  /* The same checks hold for the environment and the file, and say which one it was. */
  expect_error(NULL, (const char *const[]){"DSV4D_BLOCK_SIZE=48", NULL}, "block_size", "48",
               "DSV4D_BLOCK_SIZE", "power of two", NULL);
  const char *f = write_file("range.json", "{\"queue_depth\": 0}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "queue_depth", "range.json",
               "from 1 to 65536", NULL);
  f = write_file("neg.json", "{\"port\": -5}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "port", "-5", NULL);
  f = write_file("type.json", "{\"port\": \"80\"}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "port", "wrong JSON type", NULL);
  f = write_file("bool.json", "{\"implicit_create\": 1}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "implicit_create", NULL);
}

static void test_unknown_and_malformed(void **state) {
  (void)state;
  expect_error((const char *const[]){"--no-such", "1", NULL}, NULL, "unknown option", "--no-such",
               NULL);
  expect_error((const char *const[]){"stray", NULL}, NULL, "stray", NULL);
  expect_error((const char *const[]){"--port", NULL}, NULL, "--port", "needs a value", NULL);
  expect_error((const char *const[]){"--no-port", NULL}, NULL, "--no-port", NULL);
  expect_error(NULL, (const char *const[]){"DSV4D_BLOK_SIZE=64", NULL}, "DSV4D_BLOK_SIZE", NULL);
  const char *f = write_file("unknown.json", "{\"blocksize\": 64}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "unknown key", "blocksize", NULL);
  f = write_file("dash.json", "{\"block-size\": 64}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "block-size", NULL);
  f = write_file("nested.json", "{\"config_file\": \"/x\"}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "config_file", NULL);
  f = write_file("broken.json", "{\"port\": ");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "broken.json", NULL);
  f = write_file("array.json", "[1]");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "JSON object", NULL);
  f = write_file("dup.json", "{\"port\": 1, \"port\": 2}");
  expect_error((const char *const[]){"--config", f, NULL}, NULL, "dup.json", NULL);
  expect_error((const char *const[]){"--config", "/nonexistent/dsv4d.json", NULL}, NULL,
               "/nonexistent/dsv4d.json", NULL);
}

static void expect_layers(const char *list, const uint32_t *want, uint32_t n) {
  dsv4_config_t cfg;
  char arg[128];
  snprintf(arg, sizeof(arg), "--layers=%s", list);
  expect_ok(&cfg, (const char *const[]){arg, NULL}, NULL);
  assert_int_equal(cfg.n_served, n);
  for (uint32_t i = 0; i < n; i++)
    assert_int_equal(cfg.served_layers[i], want[i]);
  dsv4_config_free(&cfg);
}

static void test_layer_lists(void **state) {
  (void)state;
  expect_layers("0,2,5-7", (const uint32_t[]){0, 2, 5, 6, 7}, 5);
  expect_layers("5-7, 0", (const uint32_t[]){0, 5, 6, 7}, 4);
  expect_layers("3", (const uint32_t[]){3}, 1);
  expect_layers("42-43", (const uint32_t[]){42, 43}, 2); /* the MTP layer when listed */
  expect_layers("4-4", (const uint32_t[]){4}, 1);
  expect_error((const char *const[]){"--layers", "1,1", NULL}, NULL, "layers", "1,1", "twice",
               NULL);
  expect_error((const char *const[]){"--layers", "0-3,2", NULL}, NULL, "layers", "twice", NULL);
  expect_error((const char *const[]){"--layers", "44", NULL}, NULL, "layers", "44", "beyond",
               "0..43", NULL);
  expect_error((const char *const[]){"--layers", "40-50", NULL}, NULL, "beyond", NULL);
  expect_error((const char *const[]){"--layers", "7-5", NULL}, NULL, "layers", "descending", NULL);
  static const char *const bad[] = {"a", "1,", ",1", "1--2", "1-", "-1", "1;2", "1 2", "1-2-3"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
    expect_error((const char *const[]){"--layers", bad[i], NULL}, NULL, "layers", bad[i],
                 "layer list", NULL);
  expect_error(NULL, (const char *const[]){"DSV4D_LAYERS=99", NULL}, "DSV4D_LAYERS", "99", NULL);
}

static void test_heads_and_offsets(void **state) {
  (void)state;
  dsv4_config_t cfg;
  expect_ok(&cfg, (const char *const[]){"--heads", "32", "--head-offset", "32", NULL}, NULL);
  assert_int_equal(cfg.heads, 32);
  assert_int_equal(cfg.head_offset, 32);
  dsv4_config_free(&cfg);
  expect_ok(&cfg, (const char *const[]){"--head-offset", "16", NULL}, NULL);
  assert_int_equal(cfg.heads, 48); /* the rest of the model's heads */
  dsv4_config_free(&cfg);
  expect_error((const char *const[]){"--heads", "33", "--head-offset", "32", NULL}, NULL, "heads",
               "33", "64", NULL);
  expect_error((const char *const[]){"--heads", "65", NULL}, NULL, "heads", "65", NULL);
  expect_error((const char *const[]){"--head-offset", "64", NULL}, NULL, "head_offset", "64", NULL);
}

static void test_derived_body_limit(void **state) {
  (void)state;
  dsv4_config_t cfg;
  /* 8 + 1 MiB + 1 * (1*1024 + 1024 + 26880) rounds up to 2 MiB. */
  expect_ok(&cfg, (const char *const[]){"--heads", "1", "--max-batch-tokens", "1", NULL}, NULL);
  assert_int_equal(cfg.max_body_bytes_effective, 2u << 20);
  dsv4_config_free(&cfg);
  /* 8 + 1 MiB + 1024 * (8*1024 + 1024 + 26880) = 8 + 1 MiB + 35.25 MiB rounds up to 37 MiB. */
  expect_ok(&cfg, (const char *const[]){"--heads", "8", "--max-batch-tokens", "1024", NULL}, NULL);
  assert_int_equal(cfg.max_body_bytes_effective, 37u << 20);
  dsv4_config_free(&cfg);
  /* Only the SWA layers: q and kv alone, 8 + 1 MiB + 9 MiB rounds up to 11 MiB. */
  expect_ok(
      &cfg,
      (const char *const[]){"--heads", "8", "--max-batch-tokens", "1024", "--layers", "0-1", NULL},
      NULL);
  assert_int_equal(cfg.max_body_bytes_effective, 11u << 20);
  dsv4_config_free(&cfg);
  /* Only a ratio-128 layer: ckv [N, 1024] F32, 8 + 1 MiB + 13 MiB = 15 MiB. */
  expect_ok(
      &cfg,
      (const char *const[]){"--heads", "8", "--max-batch-tokens", "1024", "--layers", "3", NULL},
      NULL);
  assert_int_equal(cfg.max_body_bytes_effective, 15u << 20);
  dsv4_config_free(&cfg);
  expect_ok(&cfg, (const char *const[]){"--max-body-bytes", "5000", NULL}, NULL);
  assert_int_equal(cfg.max_body_bytes, 5000);
  assert_int_equal(cfg.max_body_bytes_effective, 5000);
  dsv4_config_free(&cfg);
}

static void test_kv_norm(void **state) {
  (void)state;
  expect_error((const char *const[]){"--kv-norm", "fused", NULL}, NULL, "kv_norm", "fused",
               "kv_norm_weights", NULL);
  expect_error(
      (const char *const[]){"--kv-norm", "fused", "--kv-norm-weights", "/nonexistent/w", NULL},
      NULL, "kv_norm_weights", "/nonexistent/w", NULL);
  const char *w = write_file("w.safetensors", "x");
  dsv4_config_t cfg;
  expect_ok(&cfg, (const char *const[]){"--kv-norm", "fused", "--kv-norm-weights", w, NULL}, NULL);
  assert_string_equal(cfg.kv_norm, "fused");
  assert_string_equal(cfg.kv_norm_weights, w);
  dsv4_config_free(&cfg);
}

static void test_snapshot_dir(void **state) {
  (void)state;
  dsv4_config_t cfg;
  /* A directory that is not there, or a file, is refused at start rather than at the drain. */
  expect_error((const char *const[]){"--snapshot-dir", "/nonexistent/snap", NULL}, NULL,
               "snapshot_dir", "/nonexistent/snap", "writable directory", NULL);
  const char *f = write_file("not-a-dir", "x");
  expect_error((const char *const[]){"--snapshot-dir", f, NULL}, NULL, "snapshot_dir", NULL);
  expect_ok(&cfg, (const char *const[]){"--snapshot-dir", tmpdir, NULL}, NULL);
  assert_string_equal(cfg.snapshot_dir, tmpdir);
  assert_string_equal(dsv4_config_source(&cfg, "snapshot_dir"), "cli");
  dsv4_config_free(&cfg);
}

static void test_help_version_json(void **state) {
  (void)state;
  dsv4_config_t cfg;
  char err[256];
  assert_int_equal(load(&cfg, err, sizeof(err), (const char *const[]){"--help", NULL}, NULL),
                   DSV4_CONFIG_HELP);
  dsv4_config_free(&cfg);
  /* --help wins even over a broken option before it. */
  assert_int_equal(
      load(&cfg, err, sizeof(err), (const char *const[]){"--port", "x", "-h", NULL}, NULL),
      DSV4_CONFIG_HELP);
  dsv4_config_free(&cfg);
  assert_int_equal(load(&cfg, err, sizeof(err), (const char *const[]){"--version", NULL}, NULL),
                   DSV4_CONFIG_VERSION);
  dsv4_config_free(&cfg);

  FILE *f = tmpfile();
  assert_non_null(f);
  dsv4_config_print_help(f);
  long n = ftell(f);
  assert_true(n > 0);
  char *text = calloc((size_t)n + 1, 1);
  rewind(f);
  assert_int_equal(fread(text, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  static const char *const needles[] = {"--block-size",
                                        "DSV4D_BLOCK_SIZE",
                                        "power of two",
                                        "default \"64\"",
                                        "--kv-norm-weights",
                                        "prenormed|fused",
                                        "DSV4D_IMPLICIT_CREATE",
                                        "--drain-timeout-ms",
                                        "--api-token-file",
                                        "secret",
                                        "--layers",
                                        "--max-body-bytes",
                                        "--busy-poll-us (integer, default depends on the host"};
  for (size_t i = 0; i < sizeof(needles) / sizeof(needles[0]); i++)
    if (!strstr(text, needles[i]))
      fail_msg("help lacks %s", needles[i]);
  free(text);

  expect_ok(&cfg,
            (const char *const[]){"--api-token-file", "/etc/dsv4d/token", "--port", "9", NULL},
            (const char *const[]){"DSV4D_QUEUE_DEPTH=7", NULL});
  json_t *j = dsv4_config_to_json(&cfg);
  assert_non_null(j);
  json_t *opt = json_object_get(j, "options");
  json_t *port = json_object_get(opt, "port");
  assert_int_equal(json_integer_value(json_object_get(port, "value")), 9);
  assert_string_equal(json_string_value(json_object_get(port, "source")), "cli");
  json_t *qd = json_object_get(opt, "queue_depth");
  assert_int_equal(json_integer_value(json_object_get(qd, "value")), 7);
  assert_string_equal(json_string_value(json_object_get(qd, "source")), "env");
  json_t *tok = json_object_get(opt, "api_token_file");
  assert_string_equal(json_string_value(json_object_get(tok, "value")), "/etc/dsv4d/token");
  assert_true(json_is_true(json_object_get(tok, "secret")));
  assert_null(json_object_get(port, "secret"));
  json_t *ic = json_object_get(opt, "implicit_create");
  assert_true(json_is_false(json_object_get(ic, "value")));
  assert_string_equal(json_string_value(json_object_get(ic, "source")), "default");
  json_t *res = json_object_get(j, "resolved");
  assert_int_equal(json_array_size(json_object_get(res, "served_layers")), 43);
  assert_int_equal(
      json_array_size(json_object_get(json_object_get(res, "model"), "compress_ratios")), 44);
  json_decref(j);
  dsv4_config_free(&cfg);
}

/* ---- model geometry ---- */

/* Ratios of SPEC §1: `first` for layers 0 and 1, then 4 and 128 alternating, MTP layers 0. */
static uint32_t spec_ratio(uint32_t first, uint32_t hidden, uint32_t layer) {
  if (layer >= hidden)
    return 0;
  if (layer < 2)
    return first;
  return layer % 2 == 0 ? 4 : 128;
}

static char *model_json(uint32_t heads, uint32_t hidden, uint32_t nextn, uint32_t first,
                        const char *extra) {
  size_t cap = 16384;
  char *s = malloc(cap);
  int k = snprintf(s, cap,
                   "{\"num_attention_heads\": %u, \"head_dim\": 512, \"qk_rope_head_dim\": 64, "
                   "\"rms_norm_eps\": 1e-06, \"sliding_window\": 128, \"num_hidden_layers\": %u, "
                   "\"num_nextn_predict_layers\": %u, \"max_position_embeddings\": 1048576, "
                   "\"compress_ratios\": [",
                   heads, hidden, nextn);
  for (uint32_t l = 0; l < hidden + nextn; l++)
    k += snprintf(s + k, cap - (size_t)k, "%s%u", l ? ", " : "", spec_ratio(first, hidden, l));
  snprintf(s + k, cap - (size_t)k, "]%s%s}", extra && *extra ? ", " : "", extra ? extra : "");
  return s;
}

static const char *const YARN_SCALING =
    "\"rope_theta\": 10000, \"compress_rope_theta\": 160000, \"rope_scaling\": {\"type\": "
    "\"yarn\", \"factor\": 16, \"original_max_position_embeddings\": 65536, \"beta_fast\": 32, "
    "\"beta_slow\": 1, \"mscale\": 1.0, \"mscale_all_dim\": 1.0}";

static void check_builtin_inv_freq(const dsv4_model_t *m) {
  /* SPEC §2.3 lists: plain inv_freq[1] = 0x3f3ff911, YaRN inv_freq[1] = 0x3f300a3a, [31] too. */
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(dsv4_model_layer_rope(m, 0), f);
  assert_int_equal(float_bits(f[1]), 0x3f3ff911u);
  assert_int_equal(float_bits(f[31]), 0x390bd472u);
  dsv4_rope_inv_freq(dsv4_model_layer_rope(m, 2), f);
  assert_int_equal(float_bits(f[1]), 0x3f300a3au);
  assert_int_equal(float_bits(f[31]), 0x35187c4du);
}

static void test_model_builtin_flash(void **state) {
  (void)state;
  dsv4_model_t m;
  assert_int_equal(dsv4_model_builtin_flash(&m), 0);
  assert_int_equal(m.num_attention_heads, 64);
  assert_int_equal(m.head_dim, 512);
  assert_int_equal(m.qk_rope_head_dim, 64);
  assert_int_equal(m.sliding_window, 128);
  assert_int_equal(m.num_hidden_layers, 43);
  assert_int_equal(m.num_nextn_predict_layers, 1);
  assert_int_equal(m.n_layers_total, 44);
  assert_int_equal(float_bits(m.rms_norm_eps), 0x358637BDu);
  assert_int_equal(m.max_position_embeddings, 1048576);
  for (uint32_t l = 0; l < 44; l++)
    assert_int_equal(m.compress_ratios[l], spec_ratio(0, 43, l));
  assert_int_equal(m.compress_ratios[2], 4);
  assert_int_equal(m.compress_ratios[3], 128);
  assert_int_equal(m.compress_ratios[42], 4);
  assert_int_equal(m.compress_ratios[43], 0);
  assert_true(rope_equal(dsv4_model_layer_rope(&m, 0), &dsv4_rope_plain_default));
  assert_true(rope_equal(dsv4_model_layer_rope(&m, 2), &dsv4_rope_yarn_default));
  assert_true(rope_equal(dsv4_model_layer_rope(&m, 3), &dsv4_rope_yarn_default));
  assert_true(rope_equal(dsv4_model_layer_rope(&m, 43), &dsv4_rope_plain_default));
  assert_ptr_equal(dsv4_model_layer_rope(&m, 1), &m.rope_plain);
  assert_ptr_equal(dsv4_model_layer_rope(&m, 42), &m.rope_compress);
  assert_null(dsv4_model_layer_rope(&m, 44));
  check_builtin_inv_freq(&m);
  dsv4_model_free(&m);
  dsv4_model_free(&m); /* a second free is harmless */
}

static void test_model_flash_json_equals_builtin(void **state) {
  (void)state;
  char *js = model_json(64, 43, 1, 0, YARN_SCALING);
  dsv4_model_t m;
  char err[512];
  int rc = dsv4_model_load_json(&m, js, err, sizeof(err));
  if (rc)
    fail_msg("%s", err);
  dsv4_model_t b;
  assert_int_equal(dsv4_model_builtin_flash(&b), 0);
  assert_int_equal(m.n_layers_total, b.n_layers_total);
  assert_memory_equal(m.compress_ratios, b.compress_ratios, 44 * sizeof(uint32_t));
  assert_int_equal(float_bits(m.rms_norm_eps), float_bits(b.rms_norm_eps));
  assert_true(rope_equal(&m.rope_plain, &dsv4_rope_plain_default));
  assert_true(rope_equal(&m.rope_compress, &dsv4_rope_yarn_default));
  check_builtin_inv_freq(&m);
  dsv4_model_free(&m);
  dsv4_model_free(&b);

  /* The same text through a file and through the daemon's model_config option. */
  const char *path = write_file("flash.json", js);
  assert_int_equal(dsv4_model_load_file(&m, path, err, sizeof(err)), 0);
  assert_string_equal(m.name, path);
  dsv4_model_free(&m);
  free(js);
}

static void test_model_pro(void **state) {
  (void)state;
  char *js = model_json(128, 61, 1, 128, YARN_SCALING);
  const char *path = write_file("pro.json", js);
  free(js);
  dsv4_config_t cfg;
  expect_ok(&cfg, (const char *const[]){"--model-config", path, "--layers", "0-61", NULL}, NULL);
  const dsv4_model_t *m = &cfg.model;
  assert_int_equal(m->num_attention_heads, 128);
  assert_int_equal(m->num_hidden_layers, 61);
  assert_int_equal(m->n_layers_total, 62);
  assert_int_equal(m->compress_ratios[0], 128);
  assert_int_equal(m->compress_ratios[1], 128);
  assert_int_equal(m->compress_ratios[2], 4);
  assert_int_equal(m->compress_ratios[60], 4);
  assert_int_equal(m->compress_ratios[61], 0);
  assert_int_equal(cfg.heads, 128);
  assert_int_equal(cfg.n_served, 62);
  /* Pro's first layers are compressed, so they take YaRN; the MTP layer is plain. */
  assert_true(rope_equal(dsv4_model_layer_rope(m, 0), &dsv4_rope_yarn_default));
  assert_true(rope_equal(dsv4_model_layer_rope(m, 61), &dsv4_rope_plain_default));
  dsv4_config_free(&cfg);
  expect_ok(&cfg, (const char *const[]){"--model-config", path, NULL}, NULL);
  assert_int_equal(cfg.n_served, 61);
  dsv4_config_free(&cfg);
  expect_error((const char *const[]){"--model-config", path, "--layers", "62", NULL}, NULL,
               "layers", "62", NULL);
}

/* Loads a Flash-shaped model with the given RoPE keys; returns its compress-layer parameters. */
static dsv4_rope_params_t load_variant(const char *extra, dsv4_rope_params_t *plain) {
  char *js = model_json(64, 43, 1, 0, extra);
  dsv4_model_t m;
  char err[512];
  int rc = dsv4_model_load_json(&m, js, err, sizeof(err));
  free(js);
  if (rc)
    fail_msg("variant %s: %s", extra, err);
  dsv4_rope_params_t r = *dsv4_model_layer_rope(&m, 2);
  if (plain)
    *plain = *dsv4_model_layer_rope(&m, 0);
  dsv4_model_free(&m);
  return r;
}

static void expect_model_error(const char *js, const char *needle) {
  dsv4_model_t m;
  char err[512];
  int rc = dsv4_model_load_json(&m, js, err, sizeof(err));
  if (rc != DSV4_ECONFIG)
    fail_msg("expected an error naming %s, got %d", needle, rc);
  if (!strstr(err, needle))
    fail_msg("error \"%s\" lacks \"%s\"", err, needle);
  assert_null(m.compress_ratios);
}

static void test_model_rope_variants(void **state) {
  (void)state;
  dsv4_rope_params_t plain, c;

  /* Flat rope_parameters with rope_type (transformers v5) gives the built-in YaRN set. */
  c = load_variant("\"rope_theta\": 10000, \"compress_rope_theta\": 160000, \"rope_parameters\": "
                   "{\"rope_type\": \"yarn\", \"factor\": 16, "
                   "\"original_max_position_embeddings\": 65536}",
                   &plain);
  assert_true(rope_equal(&c, &dsv4_rope_yarn_default)); /* beta defaults 32 and 1 */
  assert_true(rope_equal(&plain, &dsv4_rope_plain_default));

  /* Nested main/compress, thetas inside the sections, deepseek_yarn. */
  c = load_variant("\"rope_parameters\": {\"main\": {\"rope_type\": \"default\", \"rope_theta\": "
                   "20000}, \"compress\": {\"type\": \"deepseek_yarn\", \"rope_theta\": 320000, "
                   "\"factor\": 8, \"original_max_position_embeddings\": 4096, \"beta_fast\": 16, "
                   "\"beta_slow\": 2}}",
                   &plain);
  assert_int_equal(c.yarn, 1);
  assert_true(c.theta == 320000.0 && c.factor == 8.0 && c.original_max_position == 4096.0);
  assert_true(c.beta_fast == 16.0 && c.beta_slow == 2.0);
  assert_int_equal(plain.yarn, 0);
  assert_true(plain.theta == 20000.0);

  /* rope_parameters preferred over rope_scaling; rope_scaling used when it is absent. */
  c = load_variant("\"compress_rope_theta\": 160000, \"rope_parameters\": {\"type\": "
                   "\"default\"}, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, "
                   "\"original_max_position_embeddings\": 65536}",
                   NULL);
  assert_int_equal(c.yarn, 0);
  c = load_variant("\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4, "
                   "\"original_max_position_embeddings\": 8192}",
                   NULL);
  assert_int_equal(c.yarn, 1);
  assert_true(c.factor == 4.0 && c.original_max_position == 8192.0 && c.theta == 160000.0);

  /* Nested sections that carry only thetas: the scaling comes from rope_scaling, as in the flat
   * form (without a compress section at all, too). */
  c = load_variant(
      "\"rope_parameters\": {\"main\": {\"rope_theta\": 10000}, \"compress\": "
      "{\"rope_theta\": 160000}}, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, "
      "\"original_max_position_embeddings\": 65536}",
      &plain);
  assert_true(rope_equal(&c, &dsv4_rope_yarn_default));
  assert_true(rope_equal(&plain, &dsv4_rope_plain_default));
  c = load_variant("\"compress_rope_theta\": 160000, \"rope_parameters\": {\"main\": "
                   "{\"rope_theta\": 10000}}, \"rope_scaling\": {\"rope_type\": \"deepseek_yarn\", "
                   "\"factor\": 16, \"original_max_position_embeddings\": 65536}",
                   NULL);
  assert_true(rope_equal(&c, &dsv4_rope_yarn_default));
  /* A typed nested compress section still wins over rope_scaling. */
  c = load_variant("\"rope_parameters\": {\"compress\": {\"type\": \"default\", \"rope_theta\": "
                   "160000}}, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, "
                   "\"original_max_position_embeddings\": 65536}",
                   NULL);
  assert_int_equal(c.yarn, 0);
  assert_true(c.theta == 160000.0);

  /* A non-YaRN type: compressed layers use the plain recipe with compress_rope_theta. */
  c = load_variant("\"rope_theta\": 10000, \"compress_rope_theta\": 40000, \"rope_scaling\": "
                   "{\"type\": \"linear\", \"factor\": 2}",
                   &plain);
  assert_int_equal(c.yarn, 0);
  assert_true(c.theta == 40000.0);
  assert_true(rope_equal(&plain, &dsv4_rope_plain_default));
  /* ... and its inv_freq follow the recipe: inv_freq[0] = 1 and [1] = 40000^(-1/32). */
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&c, f);
  assert_true(f[0] == 1.0f);
  assert_true(f[1] != 0 && fabs((double)f[1] - 0.718) < 0.01);
  /* No scaling at all: plain recipe too. */
  c = load_variant("\"compress_rope_theta\": 160000", NULL);
  assert_int_equal(c.yarn, 0);
  assert_true(c.theta == 160000.0);

  /* Errors name the key. */
  char *js = model_json(64, 43, 1, 0,
                        "\"rope_scaling\": {\"type\": \"yarn\", \"rope_type\": \"linear\", "
                        "\"factor\": 16, \"original_max_position_embeddings\": 65536}");
  expect_model_error(js, "rope_type");
  free(js);
  js = model_json(64, 43, 1, 0, "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16}");
  expect_model_error(js, "original_max_position_embeddings");
  free(js);
  js =
      model_json(64, 43, 1, 0,
                 "\"rope_scaling\": {\"type\": \"yarn\", \"original_max_position_embeddings\": 1}");
  expect_model_error(js, "rope_scaling.factor");
  free(js);
  /* YaRN with theta 1 divides by ln(1) = 0 in the correction range: refused, not NaN tables. */
  js = model_json(64, 43, 1, 0,
                  "\"compress_rope_theta\": 1, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": "
                  "16, \"original_max_position_embeddings\": 65536}");
  expect_model_error(js, "theta");
  free(js);
  js = model_json(64, 43, 1, 0, "\"rope_theta\": -1");
  expect_model_error(js, "rope_theta");
  free(js);
  /* Bases and YaRN parameters whose tables would not be finite (or not fp32) are refused. */
  static const char *const bad[][2] = {
      {"\"rope_theta\": 1e-300", "rope_theta"},
      {"\"rope_theta\": 0.5", "rope_theta"},
      {"\"rope_theta\": 1e39", "rope_theta"},
      {"\"compress_rope_theta\": 1e-300", "compress_rope_theta"},
      {"\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 0.5, "
       "\"original_max_position_embeddings\": 65536}",
       "factor"},
      {"\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, "
       "\"original_max_position_embeddings\": 65536, \"beta_fast\": 1e300}",
       "beta_fast"},
      {"\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, "
       "\"original_max_position_embeddings\": 0.5}",
       "original_max_position_embeddings"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    js = model_json(64, 43, 1, 0, bad[i][0]);
    expect_model_error(js, bad[i][1]);
    free(js);
  }
}

static void test_model_shape_errors(void **state) {
  (void)state;
  /* 44 entries for 43 + 0 layers. */
  char *js = model_json(64, 43, 1, 0, "\"num_nextn_predict_layers\": 0");
  expect_model_error(js, "duplicate"); /* jansson refuses the repeated key */
  free(js);
  js = model_json(64, 43, 1, 0, NULL);
  /* Cut the MTP entry: 43 entries for 43 + 1 layers. */
  char *last = strrchr(js, ',');
  memmove(last, "]}", 3);
  expect_model_error(js, "compress_ratios");
  free(js);
  static const char *const fixed[][2] = {
      {"\"head_dim\": 512", "\"head_dim\": 256"},
      {"\"qk_rope_head_dim\": 64", "\"qk_rope_head_dim\": 32"},
      {"\"sliding_window\": 128", "\"sliding_window\": 4096"},
      {"\"num_attention_heads\": 64", "\"num_attention_heads\": 0"},
      {"\"num_attention_heads\": 64", "\"num_attention_heads\": 129"},
      {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 0"},
      /* 0 as an fp32 (it would make the RMS factor of an all-zero row a NaN), an fp32 subnormal,
       * and one past the top of the range. */
      {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 1e-50"},
      {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 1e-40"},
      {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 2"},
      {"\"head_dim\": 512", "\"head_dim\": \"512\""}};
  for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++) {
    js = model_json(64, 43, 1, 0, NULL);
    char *at = strstr(js, fixed[i][0]);
    assert_non_null(at);
    char *out = malloc(strlen(js) + 32);
    snprintf(out, strlen(js) + 32, "%.*s%s%s", (int)(at - js), js, fixed[i][1],
             at + strlen(fixed[i][0]));
    char key[64];
    snprintf(key, sizeof(key), "%.*s", (int)(strchr(fixed[i][1] + 1, '"') - fixed[i][1] - 1),
             fixed[i][1] + 1);
    expect_model_error(out, key);
    free(out);
    free(js);
  }
  expect_model_error("{\"num_hidden_layers\": 2, \"compress_ratios\": [0, 0]}",
                     "num_attention_heads");
  expect_model_error("{\"num_attention_heads\": 8, \"num_hidden_layers\": 2, \"compress_ratios\": "
                     "[0, -4]}",
                     "compress_ratios[1]");
  /* A required key that is null is missing, not zero. */
  expect_model_error("{\"num_attention_heads\": null, \"num_hidden_layers\": 2, "
                     "\"compress_ratios\": [0, 0]}",
                     "num_attention_heads");
  expect_model_error("{\"num_attention_heads\": 8, \"num_hidden_layers\": null, "
                     "\"num_nextn_predict_layers\": 1, \"compress_ratios\": [0]}",
                     "num_hidden_layers");
  expect_model_error("[]", "object");
  expect_model_error("{", "JSON");

  /* A minimal model: absent keys take the Flash values, num_nextn_predict_layers 0. */
  dsv4_model_t m;
  char err[512];
  assert_int_equal(dsv4_model_load_json(&m,
                                        "{\"num_attention_heads\": 8, \"num_hidden_layers\": 2, "
                                        "\"compress_ratios\": [0, 4]}",
                                        err, sizeof(err)),
                   0);
  assert_int_equal(m.n_layers_total, 2);
  assert_int_equal(m.head_dim, 512);
  assert_int_equal(float_bits(m.rms_norm_eps), 0x358637BDu);
  assert_int_equal(m.max_position_embeddings, 1048576);
  dsv4_model_free(&m);

  /* Through the daemon, a bad model file is an error naming model_config. */
  const char *path = write_file("bad-model.json", "{\"num_attention_heads\": 8, \"head_dim\": "
                                                  "128, \"num_hidden_layers\": 1, "
                                                  "\"compress_ratios\": [0]}");
  char envv[300];
  snprintf(envv, sizeof(envv), "DSV4D_MODEL_CONFIG=%s", path);
  expect_error(NULL, (const char *const[]){envv, NULL}, "model_config", "head_dim", "128",
               "DSV4D_MODEL_CONFIG", NULL);
  expect_error((const char *const[]){"--model-config", "/nonexistent/config.json", NULL}, NULL,
               "model_config", "/nonexistent/config.json", NULL);
}

static int setup(void **state) {
  (void)state;
  return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  char cmd[300];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_sources_and_precedence),
      cmocka_unit_test(test_busy_poll_default),
      cmocka_unit_test(test_range_errors_name_the_option),
      cmocka_unit_test(test_unknown_and_malformed),
      cmocka_unit_test(test_layer_lists),
      cmocka_unit_test(test_heads_and_offsets),
      cmocka_unit_test(test_derived_body_limit),
      cmocka_unit_test(test_kv_norm),
      cmocka_unit_test(test_snapshot_dir),
      cmocka_unit_test(test_help_version_json),
      cmocka_unit_test(test_model_builtin_flash),
      cmocka_unit_test(test_model_flash_json_equals_builtin),
      cmocka_unit_test(test_model_pro),
      cmocka_unit_test(test_model_rope_variants),
      cmocka_unit_test(test_model_shape_errors),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
