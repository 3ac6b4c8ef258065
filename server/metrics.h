#ifndef DSV4_SERVER_METRICS_H
#define DSV4_SERVER_METRICS_H

/*
 * A small Prometheus registry: counters, gauges and fixed-bucket histograms, each a family with a
 * fixed list of label names and one series per distinct tuple of label values. Rendering produces
 * the text exposition format (version 0.0.4) with HELP and TYPE lines and escaped label values.
 *
 * Thread affinity: any thread. Families are registered once at startup; series are created on first
 * use; updates and rendering may happen from the loop and the executor concurrently (one mutex per
 * registry: updates are a few per request, far from contention).
 */

#include <stddef.h>

typedef struct dsv4_metrics dsv4_metrics_t;
typedef struct dsv4_metric dsv4_metric_t; /* a family */
typedef struct dsv4_series dsv4_series_t; /* one label tuple of a family */

typedef enum {
  DSV4_METRIC_COUNTER = 0,
  DSV4_METRIC_GAUGE = 1,
  DSV4_METRIC_HISTOGRAM = 2,
} dsv4_metric_type_t;

#define DSV4_METRIC_MAX_LABELS 8
#define DSV4_METRIC_MAX_BUCKETS 32

int dsv4_metrics_create(dsv4_metrics_t **out);
void dsv4_metrics_destroy(dsv4_metrics_t *m);
/*
 * The process-wide registry (created on first call, never destroyed). The HTTP layer records
 * dsv4d_requests_total here unless its config names another registry.
 */
dsv4_metrics_t *dsv4_metrics_default(void);

/*
 * Register a family. Names and label names must match [a-zA-Z_:][a-zA-Z0-9_:]* (label names without
 * ':'); help is any text. Registering an existing name again with the same type and labels returns
 * the existing family; a conflicting one is DSV4_EINVAL. A family without labels has its single
 * series from the start, so it renders 0 before the first update.
 */
int dsv4_metrics_counter(dsv4_metrics_t *m, const char *name, const char *help,
                         const char *const *labels, size_t n_labels, dsv4_metric_t **out);
int dsv4_metrics_gauge(dsv4_metrics_t *m, const char *name, const char *help,
                       const char *const *labels, size_t n_labels, dsv4_metric_t **out);
/* The daemon's histograms of seconds (a forward's stages, its request): 10 µs to 5 s. */
#define DSV4_SECONDS_BOUNDS 18
extern const double dsv4_seconds_bounds[DSV4_SECONDS_BOUNDS];
/* bounds: strictly increasing finite upper bounds; +Inf is implicit. */
int dsv4_metrics_histogram(dsv4_metrics_t *m, const char *name, const char *help,
                           const char *const *labels, size_t n_labels, const double *bounds,
                           size_t n_bounds, dsv4_metric_t **out);

/* The series for a tuple of n_labels values (NULL when the family has no labels). */
int dsv4_metric_series(dsv4_metric_t *f, const char *const *values, dsv4_series_t **out);

/* Counters: v >= 0 (a negative v is ignored). Gauges: any v. */
void dsv4_series_add(dsv4_series_t *s, double v);
/* Gauges only. */
void dsv4_series_set(dsv4_series_t *s, double v);
/* Histograms only. */
void dsv4_series_observe(dsv4_series_t *s, double v);
/* The current value of a counter or gauge, or the observation count of a histogram. */
double dsv4_series_value(dsv4_series_t *s);

/* Shorthands: look the series up (creating it) and update; errors are dropped. */
void dsv4_metric_add(dsv4_metric_t *f, const char *const *values, double v);
void dsv4_metric_set(dsv4_metric_t *f, const char *const *values, double v);
void dsv4_metric_observe(dsv4_metric_t *f, const char *const *values, double v);

/*
 * A hook run (without the registry lock held) at the start of every render, for gauges that are
 * cheaper to compute at scrape time (pool occupancy, sequence counts). One hook per registry.
 */
void dsv4_metrics_set_collect(dsv4_metrics_t *m, void (*fn)(dsv4_metrics_t *m, void *arg),
                              void *arg);

/* Render every family in registration order into a malloc'd buffer (free() it), NUL-terminated. */
int dsv4_metrics_render(dsv4_metrics_t *m, char **out, size_t *out_len);

/* The Content-Type of the rendering. */
#define DSV4_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

#endif /* DSV4_SERVER_METRICS_H */
