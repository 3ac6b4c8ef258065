/*
 * libFuzzer driver for the configuration parsers. The input is split at NUL bytes into fields: the
 * first is a model config.json text, the rest alternate between command-line arguments and
 * environment entries (DSV4D_ prefixed so they reach the option table). Whatever the input, loading
 * must return 0 or a negative code with a message, and freeing must release everything.
 *
 * Build: clang -fsanitize=fuzzer,address,undefined -Iconfig -Ikernels tests/fuzz/config_fuzz.c
 *        config/config.c config/model.c kernels/rope.c kernels/error.c -ljansson -lm
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "dsv4-error.h"
#include "model.h"

#define MAX_FIELDS 32

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *buf = malloc(size + 1);
  if (!buf)
    return 0;
  memcpy(buf, data, size);
  buf[size] = 0;

  char *fields[MAX_FIELDS];
  size_t nf = 0;
  for (char *p = buf; nf < MAX_FIELDS && p <= buf + size; p += strlen(p) + 1)
    fields[nf++] = p;

  char err[512];
  dsv4_model_t m;
  int rc = dsv4_model_load_json(&m, fields[0], err, sizeof(err));
  if (rc == 0) {
    /* A model that loads is consistent: every layer has RoPE parameters, one past the end none. */
    for (uint32_t l = 0; l < m.n_layers_total; l++)
      if (!dsv4_model_layer_rope(&m, l))
        abort();
    if (dsv4_model_layer_rope(&m, m.n_layers_total))
      abort();
  } else if (rc != DSV4_ECONFIG && rc != DSV4_ENOMEM) {
    abort();
  }
  dsv4_model_free(&m);

  char *argv[MAX_FIELDS + 1];
  char *envp[MAX_FIELDS + 1];
  char *owned[MAX_FIELDS];
  int argc = 0;
  size_t ne = 0, no = 0;
  argv[argc++] = (char *)"dsv4d";
  for (size_t i = 1; i < nf; i++) {
    /* Never let the fuzzer ask for --help or a config file: both touch the outside world. */
    if (strstr(fields[i], "help") || strstr(fields[i], "version") || strstr(fields[i], "config") ||
        strcmp(fields[i], "-h") == 0)
      continue;
    if (i % 2) {
      argv[argc++] = fields[i];
    } else {
      size_t n = strlen(fields[i]) + 7;
      char *e = malloc(n);
      if (!e)
        break;
      memcpy(e, "DSV4D_", 6);
      memcpy(e + 6, fields[i], n - 6);
      owned[no++] = e;
      envp[ne++] = e;
    }
  }
  argv[argc] = NULL;
  envp[ne] = NULL;
  dsv4_config_t cfg;
  rc = dsv4_config_load(&cfg, argc, argv, envp, err, sizeof(err));
  if (rc == 0) {
    if (cfg.heads == 0 || cfg.n_served == 0 || cfg.max_body_bytes_effective == 0)
      abort();
    json_t *j = dsv4_config_to_json(&cfg);
    json_decref(j);
  } else if (rc > 0 || (rc != DSV4_ECONFIG && rc != DSV4_ENOMEM) || !err[0]) {
    abort();
  }
  dsv4_config_free(&cfg);
  for (size_t i = 0; i < no; i++)
    free(owned[i]);
  free(buf);
  return 0;
}
