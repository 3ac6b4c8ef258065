#include "backend.h"

#include <stdio.h>
#include <string.h>

#include "cpu/cpu_backend.h"

typedef int (*open_fn)(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                       size_t why_len);

typedef struct {
  const char *name;
  open_fn open;
} registry_row_t;

/* In the order "auto" tries them: the fastest device first, the CPU reference last. */
static const registry_row_t registry[] = {
    {"cpu", dsv4_cpu_backend_open},
};

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
  if (!is_auto && why_len)
    snprintf(why, why_len, "unknown backend \"%s\" (this build has: cpu)", name);
  return err;
}
