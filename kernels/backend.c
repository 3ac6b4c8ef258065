#include "backend.h"

#include <stdio.h>
#include <string.h>

#include "cpu/cpu_backend.h"

typedef struct {
  const char *name;
  dsv4_backend_open_fn open;
} registry_row_t;

/* In the order "auto" tries them: the fastest device first, the CPU reference last. */
static const registry_row_t registry[] = {
    {"cpu", dsv4_cpu_backend_open},
};

/* Backends added at run time; opened by name only. */
#define EXTRA_MAX 4
static registry_row_t extra[EXTRA_MAX];
static size_t n_extra;

int dsv4_backend_register(const char *name, dsv4_backend_open_fn open) {
  if (n_extra == EXTRA_MAX)
    return DSV4_ENOSPC;
  extra[n_extra].name = name;
  extra[n_extra].open = open;
  n_extra++;
  return 0;
}

int dsv4_backend_open(const char *name, const dsv4_backend_options_t *opt, dsv4_backend_t **out,
                      char *why, size_t why_len) {
  size_t n = sizeof(registry) / sizeof(registry[0]);
  int is_auto = strcmp(name, "auto") == 0;
  int err = DSV4_ENODEV;
  if (why_len)
    why[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    if (!is_auto && strcmp(name, registry[i].name) != 0)
      continue;
    err = registry[i].open(opt, out, why, why_len);
    if (err == 0 || !is_auto)
      return err;
  }
  for (size_t i = 0; !is_auto && i < n_extra; i++)
    if (strcmp(name, extra[i].name) == 0)
      return extra[i].open(opt, out, why, why_len);
  if (!is_auto && why_len)
    snprintf(why, why_len, "unknown backend \"%s\" (this build has: cpu)", name);
  return err;
}
