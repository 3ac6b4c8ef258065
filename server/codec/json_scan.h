#ifndef DSV4_SERVER_JSON_SCAN_H
#define DSV4_SERVER_JSON_SCAN_H

/*
 * One-pass readers of JSON text of a fixed, usual shape (the safetensors header, a forward's
 * segments, the shared-region forward message), for the paths where a jansson document costs more
 * than the rest of the work. They accept only a strict subset of JSON: a caller answers "not the
 * usual shape" on any failure and hands the text to jansson, whose answers stay the reference (each
 * user tests that).
 *
 * Strings are copied, unescaped and NUL-terminated, into memory the caller gives (out): a string
 * is never longer unescaped than its quoted text, so the text's length is always room enough.
 */
#include <stdint.h>
#include <string.h>

typedef struct {
  const char *p, *end;
  char *out; /* the next free byte of the strings' memory */
} dsv4_scan_t;

static inline void dsv4_scan_ws(dsv4_scan_t *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
    s->p++;
}

/* White space, then c. */
static inline int dsv4_scan_take(dsv4_scan_t *s, char c) {
  dsv4_scan_ws(s);
  if (s->p == s->end || *s->p != c)
    return 0;
  s->p++;
  return 1;
}

/* A string of printable ASCII into the strings' memory; escapes (\" \\ \/ \b \f \n \r \t) only
 * where esc. NULL for anything else. */
static inline const char *dsv4_scan_string(dsv4_scan_t *s, int esc) {
  static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
  if (!dsv4_scan_take(s, '"'))
    return NULL;
  char *start = s->out, *o = s->out;
  while (s->p < s->end) {
    char c = *s->p++;
    if (c == '"') {
      *o++ = '\0';
      s->out = o;
      return start;
    }
    if (c < 0x20 || c > 0x7e)
      return NULL;
    if (c == '\\') {
      const char *k = s->p < s->end && esc && *s->p ? strchr(from, *s->p) : NULL;
      if (!k)
        return NULL;
      c = to[k - from];
      s->p++;
    }
    *o++ = c;
  }
  return NULL;
}

/* An integer of 1 to 18 digits, without sign or leading zero, not followed by a fraction or an
 * exponent. */
static inline int dsv4_scan_int(dsv4_scan_t *s, int64_t *v) {
  dsv4_scan_ws(s);
  const char *q = s->p;
  int64_t x = 0;
  while (s->p < s->end && *s->p >= '0' && *s->p <= '9' && s->p - q < 18)
    x = x * 10 + (*s->p++ - '0');
  size_t n = (size_t)(s->p - q);
  if (n == 0 || (n > 1 && *q == '0') ||
      (s->p < s->end &&
       ((*s->p >= '0' && *s->p <= '9') || *s->p == '.' || *s->p == 'e' || *s->p == 'E')))
    return 0;
  *v = x;
  return 1;
}

/* White space, then the literal word w (true, false, null). */
static inline int dsv4_scan_lit(dsv4_scan_t *s, const char *w) {
  size_t n = strlen(w);
  dsv4_scan_ws(s);
  if ((size_t)(s->end - s->p) < n || memcmp(s->p, w, n))
    return 0;
  s->p += n;
  return 1;
}

#endif /* DSV4_SERVER_JSON_SCAN_H */
