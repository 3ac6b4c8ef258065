#include "metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"

const double dsv4_seconds_bounds[DSV4_SECONDS_BOUNDS] = {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
                                                         1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                                                         0.1,  0.25,   0.5,  1,    2.5,    5};

struct dsv4_series {
  struct dsv4_series *next;
  dsv4_metric_t *family;
  char **values;
  double value;      /* counter or gauge */
  uint64_t *buckets; /* histogram: per-bucket (not cumulative) counts, n_bounds + 1 of them */
  double sum;
  uint64_t count;
};

struct dsv4_metric {
  struct dsv4_metric *next;
  dsv4_metrics_t *registry;
  int type;
  char *name;
  char *help;
  size_t n_labels;
  char *labels[DSV4_METRIC_MAX_LABELS];
  size_t n_bounds;
  double bounds[DSV4_METRIC_MAX_BUCKETS];
  dsv4_series_t *series, *series_tail;
};

struct dsv4_metrics {
  pthread_mutex_t mu;
  dsv4_metric_t *families, *families_tail;
  void (*collect)(dsv4_metrics_t *m, void *arg);
  void *collect_arg;
};

int dsv4_metrics_create(dsv4_metrics_t **out) {
  dsv4_metrics_t *m = calloc(1, sizeof(*m));
  if (!m)
    return DSV4_ENOMEM;
  pthread_mutex_init(&m->mu, NULL);
  *out = m;
  return 0;
}

static void series_free(dsv4_series_t *s, size_t n_labels) {
  if (s->values)
    for (size_t i = 0; i < n_labels; i++)
      free(s->values[i]);
  free(s->values);
  free(s->buckets);
  free(s);
}

void dsv4_metrics_destroy(dsv4_metrics_t *m) {
  if (!m)
    return;
  dsv4_metric_t *f = m->families;
  while (f) {
    dsv4_metric_t *fn = f->next;
    dsv4_series_t *s = f->series;
    while (s) {
      dsv4_series_t *sn = s->next;
      series_free(s, f->n_labels);
      s = sn;
    }
    for (size_t i = 0; i < f->n_labels; i++)
      free(f->labels[i]);
    free(f->name);
    free(f->help);
    free(f);
    f = fn;
  }
  pthread_mutex_destroy(&m->mu);
  free(m);
}

static pthread_once_t default_once = PTHREAD_ONCE_INIT;
static dsv4_metrics_t *default_registry;

static void default_init(void) {
  if (dsv4_metrics_create(&default_registry) != 0)
    default_registry = NULL;
}

dsv4_metrics_t *dsv4_metrics_default(void) {
  pthread_once(&default_once, default_init);
  return default_registry;
}

static int valid_name(const char *s, int allow_colon) {
  if (!s || !*s)
    return 0;
  for (size_t i = 0; s[i]; i++) {
    char c = s[i];
    int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
             (allow_colon && c == ':') || (i > 0 && c >= '0' && c <= '9');
    if (!ok)
      return 0;
  }
  return 1;
}

/* Create a series; caller holds the lock. values NULL for a family without labels. */
static int series_new(dsv4_metric_t *f, const char *const *values, dsv4_series_t **out) {
  dsv4_series_t *s = calloc(1, sizeof(*s));
  if (!s)
    return DSV4_ENOMEM;
  s->family = f;
  if (f->n_labels > 0) {
    s->values = calloc(f->n_labels, sizeof(char *));
    if (!s->values) {
      series_free(s, 0);
      return DSV4_ENOMEM;
    }
    for (size_t i = 0; i < f->n_labels; i++) {
      s->values[i] = strdup(values[i]);
      if (!s->values[i]) {
        series_free(s, f->n_labels);
        return DSV4_ENOMEM;
      }
    }
  }
  if (f->type == DSV4_METRIC_HISTOGRAM) {
    s->buckets = calloc(f->n_bounds + 1, sizeof(uint64_t));
    if (!s->buckets) {
      series_free(s, f->n_labels);
      return DSV4_ENOMEM;
    }
  }
  if (f->series_tail)
    f->series_tail->next = s;
  else
    f->series = s;
  f->series_tail = s;
  *out = s;
  return 0;
}

static int same_family(const dsv4_metric_t *f, int type, const char *const *labels, size_t n_labels,
                       const double *bounds, size_t n_bounds) {
  if (f->type != type || f->n_labels != n_labels || f->n_bounds != n_bounds)
    return 0;
  for (size_t i = 0; i < n_labels; i++)
    if (strcmp(f->labels[i], labels[i]) != 0)
      return 0;
  for (size_t i = 0; i < n_bounds; i++)
    if (f->bounds[i] != bounds[i])
      return 0;
  return 1;
}

static int family_new(dsv4_metrics_t *m, int type, const char *name, const char *help,
                      const char *const *labels, size_t n_labels, const double *bounds,
                      size_t n_bounds, dsv4_metric_t **out) {
  if (!m || !valid_name(name, 1) || n_labels > DSV4_METRIC_MAX_LABELS ||
      n_bounds > DSV4_METRIC_MAX_BUCKETS)
    return DSV4_EINVAL;
  for (size_t i = 0; i < n_labels; i++) {
    /* "le" is the histogram's own label; names starting "__" are reserved by Prometheus. */
    if (!valid_name(labels[i], 0) || strncmp(labels[i], "__", 2) == 0 ||
        (type == DSV4_METRIC_HISTOGRAM && strcmp(labels[i], "le") == 0))
      return DSV4_EINVAL;
    for (size_t j = 0; j < i; j++)
      if (strcmp(labels[i], labels[j]) == 0)
        return DSV4_EINVAL;
  }
  for (size_t i = 0; i < n_bounds; i++)
    if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
      return DSV4_EINVAL;

  int rc = 0;
  pthread_mutex_lock(&m->mu);
  for (dsv4_metric_t *f = m->families; f; f = f->next) {
    if (strcmp(f->name, name) == 0) {
      if (same_family(f, type, labels, n_labels, bounds, n_bounds))
        *out = f;
      else
        rc = DSV4_EINVAL;
      pthread_mutex_unlock(&m->mu);
      return rc;
    }
  }
  dsv4_metric_t *f = calloc(1, sizeof(*f));
  if (!f) {
    pthread_mutex_unlock(&m->mu);
    return DSV4_ENOMEM;
  }
  f->registry = m;
  f->type = type;
  f->name = strdup(name);
  f->help = strdup(help ? help : "");
  f->n_labels = n_labels;
  int oom = !f->name || !f->help;
  for (size_t i = 0; i < n_labels; i++) {
    f->labels[i] = strdup(labels[i]);
    oom |= !f->labels[i];
  }
  f->n_bounds = n_bounds;
  if (n_bounds)
    memcpy(f->bounds, bounds, n_bounds * sizeof(double));
  dsv4_series_t *s;
  if (!oom && n_labels == 0 && series_new(f, NULL, &s) != 0)
    oom = 1;
  if (oom) {
    for (size_t i = 0; i < n_labels; i++)
      free(f->labels[i]);
    free(f->name);
    free(f->help);
    free(f);
    pthread_mutex_unlock(&m->mu);
    return DSV4_ENOMEM;
  }
  if (m->families_tail)
    m->families_tail->next = f;
  else
    m->families = f;
  m->families_tail = f;
  pthread_mutex_unlock(&m->mu);
  *out = f;
  return 0;
}

int dsv4_metrics_counter(dsv4_metrics_t *m, const char *name, const char *help,
                         const char *const *labels, size_t n_labels, dsv4_metric_t **out) {
  return family_new(m, DSV4_METRIC_COUNTER, name, help, labels, n_labels, NULL, 0, out);
}

int dsv4_metrics_gauge(dsv4_metrics_t *m, const char *name, const char *help,
                       const char *const *labels, size_t n_labels, dsv4_metric_t **out) {
  return family_new(m, DSV4_METRIC_GAUGE, name, help, labels, n_labels, NULL, 0, out);
}

int dsv4_metrics_histogram(dsv4_metrics_t *m, const char *name, const char *help,
                           const char *const *labels, size_t n_labels, const double *bounds,
                           size_t n_bounds, dsv4_metric_t **out) {
  return family_new(m, DSV4_METRIC_HISTOGRAM, name, help, labels, n_labels, bounds, n_bounds, out);
}

int dsv4_metric_series(dsv4_metric_t *f, const char *const *values, dsv4_series_t **out) {
  if (!f)
    return DSV4_EINVAL;
  if (f->n_labels > 0) {
    if (!values)
      return DSV4_EINVAL;
    for (size_t i = 0; i < f->n_labels; i++)
      if (!values[i])
        return DSV4_EINVAL;
  }
  pthread_mutex_lock(&f->registry->mu);
  for (dsv4_series_t *s = f->series; s; s = s->next) {
    size_t i = 0;
    while (i < f->n_labels && strcmp(s->values[i], values[i]) == 0)
      i++;
    if (i == f->n_labels) {
      pthread_mutex_unlock(&f->registry->mu);
      *out = s;
      return 0;
    }
  }
  int rc = series_new(f, values, out);
  pthread_mutex_unlock(&f->registry->mu);
  return rc;
}

void dsv4_series_add(dsv4_series_t *s, double v) {
  if (!s || s->family->type == DSV4_METRIC_HISTOGRAM)
    return;
  if (s->family->type == DSV4_METRIC_COUNTER && !(v >= 0))
    return;
  pthread_mutex_lock(&s->family->registry->mu);
  s->value += v;
  pthread_mutex_unlock(&s->family->registry->mu);
}

void dsv4_series_set(dsv4_series_t *s, double v) {
  if (!s || s->family->type != DSV4_METRIC_GAUGE)
    return;
  pthread_mutex_lock(&s->family->registry->mu);
  s->value = v;
  pthread_mutex_unlock(&s->family->registry->mu);
}

void dsv4_series_observe(dsv4_series_t *s, double v) {
  if (!s || s->family->type != DSV4_METRIC_HISTOGRAM || isnan(v))
    return;
  const dsv4_metric_t *f = s->family;
  /* Buckets are "less than or equal" upper bounds, as Prometheus defines le. */
  size_t b = 0;
  while (b < f->n_bounds && v > f->bounds[b])
    b++;
  pthread_mutex_lock(&f->registry->mu);
  s->buckets[b]++;
  s->sum += v;
  s->count++;
  pthread_mutex_unlock(&f->registry->mu);
}

double dsv4_series_value(dsv4_series_t *s) {
  if (!s)
    return 0;
  pthread_mutex_lock(&s->family->registry->mu);
  double v = s->family->type == DSV4_METRIC_HISTOGRAM ? (double)s->count : s->value;
  pthread_mutex_unlock(&s->family->registry->mu);
  return v;
}

void dsv4_metric_add(dsv4_metric_t *f, const char *const *values, double v) {
  dsv4_series_t *s;
  if (dsv4_metric_series(f, values, &s) == 0)
    dsv4_series_add(s, v);
}

void dsv4_metric_set(dsv4_metric_t *f, const char *const *values, double v) {
  dsv4_series_t *s;
  if (dsv4_metric_series(f, values, &s) == 0)
    dsv4_series_set(s, v);
}

void dsv4_metric_observe(dsv4_metric_t *f, const char *const *values, double v) {
  dsv4_series_t *s;
  if (dsv4_metric_series(f, values, &s) == 0)
    dsv4_series_observe(s, v);
}

void dsv4_metrics_set_collect(dsv4_metrics_t *m, void (*fn)(dsv4_metrics_t *m, void *arg),
                              void *arg) {
  pthread_mutex_lock(&m->mu);
  m->collect = fn;
  m->collect_arg = arg;
  pthread_mutex_unlock(&m->mu);
}

typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} sbuf_t;

/* The exposition buffer's first size; it doubles from there (a scrape is a few kilobytes). */
#define SB_MIN_BYTES 4096

static void sb_put(sbuf_t *b, const char *s, size_t n) {
  if (b->oom)
    return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : SB_MIN_BYTES;
    while (cap < b->len + n + 1)
      cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void sb_str(sbuf_t *b, const char *s) {
  sb_put(b, s, strlen(s));
}

/* HELP text escapes backslash and newline; label values also escape the double quote. */
static void sb_escaped(sbuf_t *b, const char *s, int quote) {
  for (; *s; s++) {
    if (*s == '\\')
      sb_put(b, "\\\\", 2);
    else if (*s == '\n')
      sb_put(b, "\\n", 2);
    else if (quote && *s == '"')
      sb_put(b, "\\\"", 2);
    else
      sb_put(b, s, 1);
  }
}

/* Doubles below 2^53 in magnitude hold every integer exactly; 17 significant digits read back as
 * any double (DBL_DECIMAL_DIG). */
#define DOUBLE_EXACT_INT 9007199254740992.0
#define DOUBLE_MAX_DIGITS 17

/* The shortest decimal that reads back as v; integers without an exponent where exact. */
static void fmt_double(char *buf, size_t len, double v) {
  if (isnan(v)) {
    snprintf(buf, len, "NaN");
  } else if (isinf(v)) {
    snprintf(buf, len, v > 0 ? "+Inf" : "-Inf");
  } else if (v == floor(v) && fabs(v) < DOUBLE_EXACT_INT) {
    snprintf(buf, len, "%.0f", v);
  } else {
    for (int prec = 1; prec <= DOUBLE_MAX_DIGITS; prec++) {
      snprintf(buf, len, "%.*g", prec, v);
      if (strtod(buf, NULL) == v)
        return;
    }
  }
}

static void sb_double(sbuf_t *b, double v) {
  char num[40];
  fmt_double(num, sizeof(num), v);
  sb_str(b, num);
}

static void sb_labels(sbuf_t *b, const dsv4_metric_t *f, const dsv4_series_t *s, const char *le) {
  if (f->n_labels == 0 && !le)
    return;
  sb_put(b, "{", 1);
  for (size_t i = 0; i < f->n_labels; i++) {
    if (i)
      sb_put(b, ",", 1);
    sb_str(b, f->labels[i]);
    sb_put(b, "=\"", 2);
    sb_escaped(b, s->values[i], 1);
    sb_put(b, "\"", 1);
  }
  if (le) {
    if (f->n_labels)
      sb_put(b, ",", 1);
    sb_str(b, "le=\"");
    sb_str(b, le);
    sb_put(b, "\"", 1);
  }
  sb_put(b, "}", 1);
}

static void render_family(sbuf_t *b, const dsv4_metric_t *f) {
  static const char *const type_names[] = {"counter", "gauge", "histogram"};
  sb_str(b, "# HELP ");
  sb_str(b, f->name);
  sb_put(b, " ", 1);
  sb_escaped(b, f->help, 0);
  sb_str(b, "\n# TYPE ");
  sb_str(b, f->name);
  sb_put(b, " ", 1);
  sb_str(b, type_names[f->type]);
  sb_put(b, "\n", 1);
  for (const dsv4_series_t *s = f->series; s; s = s->next) {
    if (f->type != DSV4_METRIC_HISTOGRAM) {
      sb_str(b, f->name);
      sb_labels(b, f, s, NULL);
      sb_put(b, " ", 1);
      sb_double(b, s->value);
      sb_put(b, "\n", 1);
      continue;
    }
    uint64_t cum = 0;
    for (size_t i = 0; i <= f->n_bounds; i++) {
      char le[40];
      cum += s->buckets[i];
      if (i < f->n_bounds)
        fmt_double(le, sizeof(le), f->bounds[i]);
      else
        snprintf(le, sizeof(le), "+Inf");
      sb_str(b, f->name);
      sb_str(b, "_bucket");
      sb_labels(b, f, s, le);
      char num[32];
      snprintf(num, sizeof(num), " %llu\n", (unsigned long long)cum);
      sb_str(b, num);
    }
    sb_str(b, f->name);
    sb_str(b, "_sum");
    sb_labels(b, f, s, NULL);
    sb_put(b, " ", 1);
    sb_double(b, s->sum);
    sb_put(b, "\n", 1);
    sb_str(b, f->name);
    sb_str(b, "_count");
    sb_labels(b, f, s, NULL);
    char num[32];
    snprintf(num, sizeof(num), " %llu\n", (unsigned long long)s->count);
    sb_str(b, num);
  }
}

int dsv4_metrics_render(dsv4_metrics_t *m, char **out, size_t *out_len) {
  pthread_mutex_lock(&m->mu);
  void (*collect)(dsv4_metrics_t *, void *) = m->collect;
  void *arg = m->collect_arg;
  pthread_mutex_unlock(&m->mu);
  if (collect)
    collect(m, arg);

  sbuf_t b = {0};
  sb_put(&b, "", 0);
  pthread_mutex_lock(&m->mu);
  for (const dsv4_metric_t *f = m->families; f; f = f->next)
    render_family(&b, f);
  pthread_mutex_unlock(&m->mu);
  if (b.oom) {
    free(b.p);
    return DSV4_ENOMEM;
  }
  *out = b.p;
  *out_len = b.len;
  return 0;
}
