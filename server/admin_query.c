#include "admin_query.h"

#include <stdio.h>
#include <string.h>

#include "decimal.h"
#include "dsv4-error.h"

/* Longest value kept after decoding: a sequence name, or a layer range with room to spare. */
#define VALUE_MAX (DSV4_SEQ_NAME_MAX + 1)

static int hexval(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

/* Percent-decode s[0..len) into out; -1 for a bad escape, a NUL or more than cap bytes. */
static long decode(const char *s, size_t len, char *out, size_t cap) {
  size_t n = 0;
  for (size_t i = 0; i < len; i++) {
    char c = s[i];
    if (c == '%') {
      if (i + 2 >= len)
        return -1;
      int hi = hexval(s[i + 1]), lo = hexval(s[i + 2]);
      if (hi < 0 || lo < 0)
        return -1;
      c = (char)(hi * 16 + lo);
      i += 2;
    }
    if (c == '\0' || n == cap)
      return -1;
    out[n++] = c;
  }
  return (long)n;
}

static int layer_value(const char *v, size_t len, uint32_t *out) {
  uint64_t x;
  if (dsv4_parse_decimal(v, len, DSV4_AQ_MAX_LAYER, &x))
    return DSV4_EINVAL;
  *out = (uint32_t)x;
  return 0;
}

int dsv4_admin_query_parse(const char *query, unsigned allowed, dsv4_admin_query_t *out, char *why,
                           size_t why_len) {
  memset(out, 0, sizeof(*out));
  if (why_len)
    why[0] = '\0';
  const char *p = query ? query : "";
  while (*p) {
    const char *amp = strchr(p, '&');
    size_t plen = amp ? (size_t)(amp - p) : strlen(p);
    const char *eq = memchr(p, '=', plen);
    size_t klen = eq ? (size_t)(eq - p) : plen;
    const char *v = eq ? eq + 1 : p + plen;
    size_t vlen = eq ? plen - klen - 1 : 0;
    char key[24], val[VALUE_MAX];
    long kn = decode(p, klen, key, sizeof(key) - 1);
    long vn = decode(v, vlen, val, sizeof(val) - 1);
    if (kn <= 0) {
      snprintf(why, why_len, "query: an empty, malformed or unknown key");
      return DSV4_EINVAL;
    }
    key[kn] = '\0';
    unsigned bit = !strcmp(key, "layer")     ? DSV4_AQ_LAYER
                   : !strcmp(key, "layers")  ? DSV4_AQ_LAYERS
                   : !strcmp(key, "seq")     ? DSV4_AQ_SEQ
                   : !strcmp(key, "replace") ? DSV4_AQ_REPLACE
                                             : 0;
    if (!(bit & allowed)) {
      /* Named when printable ASCII (so the message stays valid JSON text), else not echoed. */
      int printable = 1;
      for (long i = 0; i < kn; i++)
        printable &= key[i] > ' ' && key[i] < 0x7f;
      snprintf(why, why_len, "query: unknown key \"%s\" for this route",
               printable ? key : "(unprintable)");
      return DSV4_EINVAL;
    }
    if (out->have & bit) {
      snprintf(why, why_len, "query: key \"%s\" given twice", key);
      return DSV4_EINVAL;
    }
    out->have |= bit;
    if (vn < 0) {
      snprintf(why, why_len, "query: the value of \"%s\" is malformed or too long", key);
      return DSV4_EINVAL;
    }
    val[vn] = '\0';
    if (bit == DSV4_AQ_LAYER) {
      if (layer_value(val, (size_t)vn, &out->layer)) {
        snprintf(why, why_len, "query: layer must be a decimal layer number");
        return DSV4_EINVAL;
      }
    } else if (bit == DSV4_AQ_LAYERS) {
      const char *dash = memchr(val, '-', (size_t)vn);
      size_t alen = dash ? (size_t)(dash - val) : (size_t)vn;
      int bad = layer_value(val, alen, &out->lo);
      if (!bad && dash)
        bad = layer_value(dash + 1, (size_t)vn - alen - 1, &out->hi);
      else if (!bad)
        out->hi = out->lo;
      if (bad || out->lo > out->hi) {
        snprintf(why, why_len, "query: layers must be a-b (decimal, a <= b) or one layer");
        return DSV4_EINVAL;
      }
    } else if (bit == DSV4_AQ_REPLACE) {
      if (strcmp(val, "0") != 0 && strcmp(val, "1") != 0) {
        snprintf(why, why_len, "query: replace must be 0 or 1");
        return DSV4_EINVAL;
      }
      out->replace = val[0] == '1';
    } else {
      if (!dsv4_seq_name_valid(val, (size_t)vn)) {
        snprintf(why, why_len,
                 "query: seq must be 1..128 bytes of [A-Za-z0-9._:-], not starting with '.'");
        return DSV4_EINVAL;
      }
      memcpy(out->seq, val, (size_t)vn + 1);
      out->seq_len = (uint32_t)vn;
    }
    p += plen;
    if (*p == '&')
      p++;
  }
  return 0;
}
