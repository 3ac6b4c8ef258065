#include "backend.h"

#include <stdio.h>
#include <string.h>

#include "cpu/cpu_backend.h"
#ifdef DSV4_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif
#ifdef DSV4_HAVE_LEVEL_ZERO
#include "level_zero/lz_backend.h"
#endif

typedef struct {
  const char *name;
  dsv4_backend_open_fn open;
} registry_row_t;

/* In the order "auto" tries them: the fastest device first, the CPU reference last. */
static const registry_row_t registry[] = {
#ifdef DSV4_HAVE_CUDA
    {"cuda", dsv4_cuda_backend_open},
#endif
#ifdef DSV4_HAVE_LEVEL_ZERO
    {"level_zero", dsv4_level_zero_backend_open},
#endif
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

int dsv4_backend_check_map_args(const dsv4_map_args_t *a) {
  if (!a || !DSV4_BLOCK_SIZE_VALID(a->block_size))
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->positions || !a->tok_seg || !a->seg_first_lb || !a->seg_bt_off || !a->seg_bt_len ||
      !a->slots || ((a->n_segments || a->bt_entries) && !a->block_table))
    return DSV4_EINVAL;
  return 0;
}

int dsv4_backend_check_insert_args(const dsv4_insert_args_t *a) {
  if (!a || a->heads < 1 || a->heads > DSV4_MAX_HEADS)
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->q || !a->kv || !a->positions || !a->slots || !a->q_out)
    return DSV4_EINVAL;
  if (a->write_kv && (!a->cache || !DSV4_BLOCK_SIZE_VALID(a->block_size) ||
                      a->stride != DSV4_BLOCK_STRIDE(a->block_size)))
    return DSV4_EINVAL;
  return 0;
}

int dsv4_backend_check_attn_args(const dsv4_attn_args_t *a) {
  if (!a || a->heads < 1 || a->heads > DSV4_MAX_HEADS || !DSV4_BLOCK_SIZE_VALID(a->block_size))
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->q || !a->positions || !a->tok_seg || !a->seg_p0 || !a->seg_first_lb || !a->seg_bt_off ||
      !a->seg_bt_len || !a->cache || !a->rope || !a->out || a->n_segments == 0 ||
      a->n_blocks == 0 || !a->block_table || a->stride != DSV4_BLOCK_STRIDE(a->block_size))
    return DSV4_EINVAL;
  return 0;
}

/* Append "name: reason" to the semicolon-separated list in why (truncated, never overflowing). */
static void note_skipped(char *why, size_t why_len, const char *name, const char *reason) {
  size_t used = strnlen(why, why_len);
  if (used + 1 >= why_len)
    return;
  snprintf(why + used, why_len - used, "%s%s: %s", used ? "; " : "", name,
           reason[0] ? reason : "unavailable");
}

int dsv4_backend_open(const char *name, const dsv4_backend_options_t *opt, dsv4_backend_t **out,
                      char *why, size_t why_len) {
  size_t n = sizeof(registry) / sizeof(registry[0]);
  int is_auto = strcmp(name, "auto") == 0;
  int err = DSV4_ENODEV;
  char one[256];
  if (why_len)
    why[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    if (!is_auto && strcmp(name, registry[i].name) != 0)
      continue;
    if (!is_auto)
      return registry[i].open(opt, out, why, why_len);
    /* Under "auto" every backend skipped on the way is named with its reason, so the daemon can
     * say in one line why it runs on the one it found. */
    one[0] = '\0';
    err = registry[i].open(opt, out, one, sizeof(one));
    if (err == 0)
      return 0;
    if (why_len)
      note_skipped(why, why_len, registry[i].name, one);
  }
  for (size_t i = 0; !is_auto && i < n_extra; i++)
    if (strcmp(name, extra[i].name) == 0)
      return extra[i].open(opt, out, why, why_len);
  if (!is_auto && why_len) {
    int len = snprintf(why, why_len, "unknown backend \"%s\" (this build has:", name);
    for (size_t i = 0; i < n && len > 0 && (size_t)len < why_len; i++)
      len += snprintf(why + len, why_len - (size_t)len, " %s", registry[i].name);
    if (len > 0 && (size_t)len < why_len)
      snprintf(why + len, why_len - (size_t)len, ")");
  }
  return err;
}
