/*
 * libFuzzer driver for dsv4ctl's parsers of untrusted input: the first byte picks one, the rest is
 * its input. 0: verify on a dump file's bytes (any file an operator is handed); 1: the admin URL;
 * 2: the command line (NUL-separated arguments). Each must accept or refuse with a reason, never
 * read outside its input, and an accepted dump must hold consistent per-layer results.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "dsv4-error.h"
#include "verify.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
  do {                                                                                             \
    if (!(c)) {                                                                                    \
      fprintf(stderr, "fuzz_dsv4ctl: %s:%d: %s\n", __FILE__, __LINE__, #c);                        \
      abort();                                                                                     \
    }                                                                                              \
  } while (0)

static void fuzz_verify(const uint8_t *p, size_t n) {
  /* An exact-size copy, so that ASan sees any read past the file's last byte. */
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf)
    return;
  memcpy(buf, p, n);
  dsv4_ctl_verify_t v;
  int rc = dsv4_ctl_verify_buffer(buf, n, &v);
  CHECK(rc == 0 || rc == DSV4_EINVAL || rc == DSV4_ENOMEM);
  if (rc != 0) {
    CHECK(v.error[0] != '\0');
  } else {
    CHECK(v.n_layers >= 1);
    uint64_t bytes = 0;
    for (size_t i = 0; i < v.n_layers; i++) {
      const dsv4_ctl_layer_check_t *c = &v.layers[i];
      CHECK(i == 0 || c->layer == v.layers[i - 1].layer + 1);
      CHECK(dsv4_ctl_is_digest(c->expected) && dsv4_ctl_is_digest(c->computed));
      CHECK(c->ok == (strcmp(c->expected, c->computed) == 0 && c->problem[0] == '\0'));
      bytes += c->records * (584 + 8);
    }
    CHECK(bytes <= n);
    static FILE *null;
    if (!null)
      null = fopen("/dev/null", "w");
    if (null) {
      dsv4_ctl_verify_print(null, "f", &v, 0);
      dsv4_ctl_verify_print(null, "f", &v, 1);
    }
  }
  dsv4_ctl_verify_free(&v);
  free(buf);
}

static void fuzz_url(const uint8_t *p, size_t n) {
  char *s = malloc(n + 1);
  if (!s)
    return;
  memcpy(s, p, n);
  s[n] = '\0';
  dsv4_ctl_url_t u;
  char err[DSV4_CTL_ERR_LEN];
  err[0] = '\0';
  int rc = dsv4_ctl_url_parse(s, &u, err, sizeof(err));
  CHECK(rc == 0 || rc == DSV4_EINVAL);
  if (rc == 0) {
    CHECK(u.host[0] != '\0');
    long port = strtol(u.port, NULL, 10);
    CHECK(port >= 1 && port <= 65535);
    CHECK(u.base[0] == '\0' || (u.base[0] == '/' && u.base[strlen(u.base) - 1] != '/'));
    CHECK(!strpbrk(u.host, "/?#@ \r\n") && !strpbrk(u.base, "?# \r\n"));
  } else {
    CHECK(err[0] != '\0');
  }
  free(s);
}

static void fuzz_args(const uint8_t *p, size_t n) {
  char *s = malloc(n + 1);
  if (!s)
    return;
  memcpy(s, p, n);
  s[n] = '\0';
  char *argv[34];
  int argc = 0;
  argv[argc++] = (char *)"dsv4ctl";
  for (size_t i = 0; i <= n && argc < 33;) {
    argv[argc++] = s + i;
    i += strlen(s + i) + 1;
  }
  argv[argc] = NULL;
  dsv4_ctl_args_t a;
  char err[DSV4_CTL_ERR_LEN];
  err[0] = '\0';
  int rc = dsv4_ctl_args_parse(argc, argv, NULL, NULL, &a, err, sizeof(err));
  CHECK(rc == 0 || rc == DSV4_EINVAL);
  if (rc != 0) {
    CHECK(err[0] != '\0');
  } else {
    CHECK(a.cmd != DSV4_CTL_CMD_NONE);
    if (a.cmd == DSV4_CTL_CMD_TOKEN)
      CHECK(a.seq && a.pos >= 0 && a.has_layer);
    if (a.cmd == DSV4_CTL_CMD_CHECKSUM)
      CHECK(a.has_layer);
    if (a.cmd == DSV4_CTL_CMD_DUMP)
      CHECK(a.seq && a.output && (!a.has_layers || a.layer_first <= a.layer_last));
    if (a.cmd == DSV4_CTL_CMD_VERIFY)
      CHECK(a.file != NULL);
    CHECK(a.timeout_ms >= 1000);
  }
  free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  switch (data[0] % 3) {
  case 0:
    fuzz_verify(data + 1, size - 1);
    break;
  case 1:
    fuzz_url(data + 1, size - 1);
    break;
  default:
    fuzz_args(data + 1, size - 1);
    break;
  }
  return 0;
}
