#include "shm_msg.h"

#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "json_scan.h"

int dsv4_shm_fwd_from_doc(json_t *msg, dsv4_shm_fwd_t *m) {
  memset(m, 0, sizeof(*m));
  json_t *id = json_object_get(msg, "region"), *dl = json_object_get(msg, "deadline_ms");
  json_t *sb = json_object_get(msg, "segments_bytes"), *out = json_object_get(msg, "out");
  m->region_json = id;
  m->region_ok = json_is_integer(id);
  m->region = m->region_ok ? (int64_t)json_integer_value(id) : 0;
  m->deadline_given = dl != NULL;
  m->deadline_ok = json_is_integer(dl) && json_integer_value(dl) >= 0;
  m->deadline_ms = m->deadline_ok ? (int64_t)json_integer_value(dl) : 0;
  m->header = json_object_get(msg, "header");
  m->segs_given = sb != NULL;
  m->segs_bytes = !sb ? 0 : json_is_integer(sb) ? (int64_t)json_integer_value(sb) : -1;
  m->out_object = json_is_object(out);
  size_t n = m->out_object ? json_object_size(out) : 0;
  m->outs = n > DSV4_SHM_SCAN_OUTS ? calloc(n, sizeof(*m->outs)) : m->scan_outs;
  if (!m->outs)
    return DSV4_ENOMEM;
  const char *key;
  json_t *val;
  if (m->out_object)
    json_object_foreach(out, key, val) {
      dsv4_shm_out_t *o = &m->outs[m->n_outs++];
      o->name = key;
      o->ok = json_is_integer(val) && json_integer_value(val) >= 0;
      o->off = o->ok ? (int64_t)json_integer_value(val) : 0;
    }
  return 0;
}

/* "out": {name: offset, ...} of at most DSV4_SHM_SCAN_OUTS names, none twice. */
static int scan_outs(dsv4_scan_t *s, dsv4_shm_fwd_t *m) {
  m->out_object = 1;
  m->outs = m->scan_outs;
  if (!dsv4_scan_take(s, '{'))
    return 0;
  if (dsv4_scan_take(s, '}'))
    return 1;
  do {
    const char *k = m->n_outs < DSV4_SHM_SCAN_OUTS ? dsv4_scan_string(s, 0) : NULL;
    dsv4_shm_out_t *o = &m->outs[m->n_outs];
    if (!k || !dsv4_scan_take(s, ':') || !dsv4_scan_int(s, &o->off))
      return 0;
    for (size_t i = 0; i < m->n_outs; i++)
      if (!strcmp(m->outs[i].name, k))
        return 0;
    o->name = k;
    o->ok = 1;
    m->n_outs++;
  } while (dsv4_scan_take(s, ','));
  return dsv4_scan_take(s, '}');
}

/* One "key": value of the message into m; seen marks the keys read (each at most once). */
static int scan_field(dsv4_scan_t *s, dsv4_shm_fwd_t *m, unsigned *seen) {
  static const char *const keys[] = {"op",  "region",      "header",
                                     "out", "deadline_ms", "segments_bytes"};
  const char *k = dsv4_scan_string(s, 0);
  unsigned i = 0;
  while (k && i < 6 && strcmp(k, keys[i]))
    i++;
  if (!k || i == 6 || (*seen & (1u << i)) || !dsv4_scan_take(s, ':'))
    return 0;
  *seen |= 1u << i;
  switch (i) {
  case 0: {
    const char *op = dsv4_scan_string(s, 0);
    return op && !strcmp(op, "forward");
  }
  case 1:
    m->region_ok = dsv4_scan_int(s, &m->region);
    return m->region_ok;
  case 2: {
    size_t used = 0;
    dsv4_scan_ws(s);
    int rc = dsv4_st_scan_header(s->p, (size_t)(s->end - s->p), &used, &m->raw);
    s->p += rc ? 0 : used;
    return rc == 0;
  }
  case 3:
    return scan_outs(s, m);
  case 4:
    m->deadline_given = 1;
    m->deadline_ok = dsv4_scan_int(s, &m->deadline_ms);
    return m->deadline_ok;
  default:
    m->segs_given = 1;
    return dsv4_scan_int(s, &m->segs_bytes);
  }
}

int dsv4_shm_fwd_scan(const char *text, size_t len, dsv4_shm_fwd_t *m, size_t *used) {
  memset(m, 0, sizeof(*m));
  /* Every string is shorter unescaped than its quoted text: len bytes hold them all. Out of
   * memory, jansson reads the message (and answers for it). */
  if (!(m->mem = malloc(len + 1)))
    return DSV4_ST_NOT_USUAL;
  dsv4_scan_t s = {text, text + len, m->mem};
  unsigned seen = 0;
  int ok = dsv4_scan_take(&s, '{');
  while (ok) {
    ok = scan_field(&s, m, &seen);
    if (!ok || !dsv4_scan_take(&s, ','))
      break;
  }
  /* op, region, header and out given; after the object the segments text, or white space. */
  ok = ok && (seen & 15u) == 15u && dsv4_scan_take(&s, '}');
  *used = (size_t)(s.p - text);
  for (const char *p = s.p; ok && !m->segs_given && p < s.end; p++)
    ok = *p == ' ' || *p == '\t' || *p == '\n' || *p == '\r';
  if (!ok) {
    dsv4_shm_fwd_free(m);
    return DSV4_ST_NOT_USUAL;
  }
  return 0;
}

void dsv4_shm_fwd_free(dsv4_shm_fwd_t *m) {
  dsv4_st_raw_free(m->raw);
  if (m->outs != m->scan_outs)
    free(m->outs);
  free(m->mem);
  memset(m, 0, sizeof(*m));
}
