#include "kvweights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "dsv4-numerics.h"
#include "safetensors.h"

/* A regular file of at most 1 GiB (a weights file for every layer is a few hundred KiB). */
#define WEIGHTS_MAX_BYTES ((off_t)1 << 30)

static int read_file(const char *path, uint8_t **buf, size_t *len, const char **why) {
  FILE *f = fopen(path, "rb");
  struct stat st;
  *why = "cannot be opened";
  if (!f)
    return DSV4_EIO;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > WEIGHTS_MAX_BYTES) {
    *why = "is not a regular file of at most 1 GiB";
    fclose(f);
    return DSV4_EIO;
  }
  size_t n = (size_t)st.st_size;
  *buf = malloc(n + 1);
  if (!*buf) {
    fclose(f);
    return DSV4_ENOMEM;
  }
  *len = fread(*buf, 1, n, f);
  fclose(f);
  *why = "could not be read whole";
  return *len == n ? 0 : DSV4_EIO;
}

int dsv4_kv_norm_weights_load(const char *path, const uint32_t *served_layers, uint32_t n_served,
                              float **out, char *err, size_t errlen) {
  uint8_t *buf = NULL;
  size_t len = 0;
  dsv4_st_view_t v;
  float *w;
  int rc;

  *out = NULL;
  if (!path || !*path) {
    snprintf(err, errlen, "kv_norm = fused needs kv_norm_weights (a safetensors file)");
    return DSV4_ECONFIG;
  }
  const char *why;
  rc = read_file(path, &buf, &len, &why);
  if (rc) {
    snprintf(err, errlen, "kv_norm_weights file %s %s", path, why);
    free(buf);
    return rc;
  }
  if (dsv4_st_parse(buf, len, &v)) {
    snprintf(err, errlen, "%s: %s", path, v.error);
    free(buf);
    return DSV4_ECONFIG;
  }
  w = malloc(sizeof(float) * DSV4_HEAD_DIM * (n_served ? n_served : 1));
  rc = w ? 0 : DSV4_ENOMEM;
  for (uint32_t i = 0; !rc && i < n_served; i++) {
    char name[96];
    const dsv4_st_tensor_t *t;
    snprintf(name, sizeof(name), "layers.%u.attn.kv_norm.weight", served_layers[i]);
    t = dsv4_st_find(&v, name);
    if (!t) {
      snprintf(name, sizeof(name), "layers.%u.kv_norm.weight", served_layers[i]);
      t = dsv4_st_find(&v, name);
    }
    if (!t || t->ndim != 1 || t->shape[0] != DSV4_HEAD_DIM ||
        (t->dtype != DSV4_ST_BF16 && t->dtype != DSV4_ST_F32)) {
      snprintf(err, errlen, "%s: layer %u needs \"%s\" as BF16 or F32 [512]", path,
               served_layers[i], name);
      rc = DSV4_ECONFIG;
      break;
    }
    for (int k = 0; k < DSV4_HEAD_DIM; k++) {
      float x;
      if (t->dtype == DSV4_ST_BF16) {
        uint16_t h;
        memcpy(&h, t->data + sizeof(h) * k, sizeof(h));
        x = dsv4_bf16_to_f32(h);
      } else {
        memcpy(&x, t->data + sizeof(x) * k, sizeof(x));
      }
      /* Bounded weights keep (z * r) * w finite: |z * r| <= sqrt(512). */
      if (!(x > -0x1p32f && x < 0x1p32f)) {
        snprintf(err, errlen, "%s: \"%s\"[%d] is not finite or |w| >= 2^32", path, name, k);
        rc = DSV4_ECONFIG;
        break;
      }
      w[(size_t)i * DSV4_HEAD_DIM + k] = x;
    }
  }
  dsv4_st_view_free(&v);
  free(buf);
  if (rc) {
    free(w);
    return rc;
  }
  *out = w;
  return 0;
}
