/* The Prometheus registry: exposition text, escaping, histogram buckets, concurrent updates. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "metrics.h"

/* The exposition text, malloc'd, straight into the caller's variable: through a local of this
 * helper, whose address the registry gets, gcc (-Wdangling-pointer, -O3) cannot rule out that the
 * text points into that local after the inlined helper's scope has ended. */
static void render(dsv4_metrics_t *m, char **text) {
  size_t len;
  assert_int_equal(dsv4_metrics_render(m, text, &len), 0);
  assert_int_equal(strlen(*text), len);
}

static void test_counter_gauge_text(void **state) {
  (void)state;
  dsv4_metrics_t *m;
  assert_int_equal(dsv4_metrics_create(&m), 0);
  const char *labels[] = {"route", "code"};
  dsv4_metric_t *req, *seqs, *usage;
  assert_int_equal(dsv4_metrics_counter(m, "dsv4d_requests_total", "Requests.\nBy route \\ code.",
                                        labels, 2, &req),
                   0);
  assert_int_equal(dsv4_metrics_gauge(m, "dsv4d_sequences", "Live sequences.", NULL, 0, &seqs), 0);
  assert_int_equal(dsv4_metrics_gauge(m, "dsv4d_kv_cache_usage_ratio", "Usage.", NULL, 0, &usage),
                   0);
  /* Unlabelled families render 0 before any update. */
  char *t;
  render(m, &t);
  assert_non_null(strstr(t, "\ndsv4d_sequences 0\n"));
  free(t);

  const char *a[] = {"forward", "200"}, *b[] = {"for\"w\\a\nrd", "503"};
  dsv4_metric_add(req, a, 1);
  dsv4_metric_add(req, a, 2);
  dsv4_metric_add(req, a, -5); /* counters never go down */
  dsv4_metric_add(req, b, 1);
  dsv4_metric_set(seqs, NULL, 42);
  dsv4_metric_add(seqs, NULL, -2);
  dsv4_metric_set(usage, NULL, 0.1);
  render(m, &t);
  const char *want = "# HELP dsv4d_requests_total Requests.\\nBy route \\\\ code.\n"
                     "# TYPE dsv4d_requests_total counter\n"
                     "dsv4d_requests_total{route=\"forward\",code=\"200\"} 3\n"
                     "dsv4d_requests_total{route=\"for\\\"w\\\\a\\nrd\",code=\"503\"} 1\n"
                     "# HELP dsv4d_sequences Live sequences.\n"
                     "# TYPE dsv4d_sequences gauge\n"
                     "dsv4d_sequences 40\n"
                     "# HELP dsv4d_kv_cache_usage_ratio Usage.\n"
                     "# TYPE dsv4d_kv_cache_usage_ratio gauge\n"
                     "dsv4d_kv_cache_usage_ratio 0.1\n";
  assert_string_equal(t, want);
  free(t);

  dsv4_series_t *s;
  assert_int_equal(dsv4_metric_series(req, a, &s), 0);
  assert_true(dsv4_series_value(s) == 3.0);
  /* A counter cannot be set. */
  dsv4_series_set(s, 100);
  assert_true(dsv4_series_value(s) == 3.0);
  dsv4_metrics_destroy(m);
}

static void test_registration_rules(void **state) {
  (void)state;
  dsv4_metrics_t *m;
  assert_int_equal(dsv4_metrics_create(&m), 0);
  const char *l1[] = {"stage"}, *l2[] = {"other"}, *dup[] = {"a", "a"}, *bad[] = {"1x"},
             *le[] = {"le"}, *reserved[] = {"__x"};
  dsv4_metric_t *f1, *f2;
  assert_int_equal(dsv4_metrics_counter(m, "x_total", "h", l1, 1, &f1), 0);
  assert_int_equal(dsv4_metrics_counter(m, "x_total", "other help", l1, 1, &f2), 0);
  assert_ptr_equal(f1, f2);
  assert_int_equal(dsv4_metrics_counter(m, "x_total", "h", l2, 1, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_gauge(m, "x_total", "h", l1, 1, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_counter(m, "y", "h", dup, 2, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_counter(m, "y", "h", bad, 1, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_counter(m, "y", "h", reserved, 1, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_counter(m, "y-z", "h", NULL, 0, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_counter(m, "9y", "h", NULL, 0, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_counter(m, "ns:y_total", "h", NULL, 0, &f2), 0);
  double bounds[] = {1, 2, 2};
  assert_int_equal(dsv4_metrics_histogram(m, "h", "h", le, 1, bounds, 2, &f2), DSV4_EINVAL);
  assert_int_equal(dsv4_metrics_histogram(m, "h", "h", NULL, 0, bounds, 3, &f2), DSV4_EINVAL);
  double inf[] = {1, INFINITY};
  assert_int_equal(dsv4_metrics_histogram(m, "h", "h", NULL, 0, inf, 2, &f2), DSV4_EINVAL);
  dsv4_series_t *s;
  assert_int_equal(dsv4_metric_series(f1, NULL, &s), DSV4_EINVAL);
  dsv4_metrics_destroy(m);
}

static void test_histogram(void **state) {
  (void)state;
  dsv4_metrics_t *m;
  assert_int_equal(dsv4_metrics_create(&m), 0);
  const char *labels[] = {"stage"};
  double bounds[] = {0.001, 0.01, 0.1, 1};
  dsv4_metric_t *h;
  assert_int_equal(
      dsv4_metrics_histogram(m, "dsv4d_forward_seconds", "Forward time.", labels, 1, bounds, 4, &h),
      0);
  const char *v[] = {"insert"};
  double obs[] = {0.0005, 0.001, 0.002, 0.05, 0.05, 0.5, 3.0};
  double sum = 0;
  for (size_t i = 0; i < 7; i++) {
    dsv4_metric_observe(h, v, obs[i]);
    sum += obs[i];
  }
  dsv4_metric_observe(h, v, NAN); /* ignored */
  char *t;
  render(m, &t);
  /* le is "less or equal": 0.001 falls in the first bucket; counts are cumulative. */
  const char *want = "# HELP dsv4d_forward_seconds Forward time.\n"
                     "# TYPE dsv4d_forward_seconds histogram\n"
                     "dsv4d_forward_seconds_bucket{stage=\"insert\",le=\"0.001\"} 2\n"
                     "dsv4d_forward_seconds_bucket{stage=\"insert\",le=\"0.01\"} 3\n"
                     "dsv4d_forward_seconds_bucket{stage=\"insert\",le=\"0.1\"} 5\n"
                     "dsv4d_forward_seconds_bucket{stage=\"insert\",le=\"1\"} 6\n"
                     "dsv4d_forward_seconds_bucket{stage=\"insert\",le=\"+Inf\"} 7\n";
  assert_memory_equal(t, want, strlen(want));
  char line[128];
  snprintf(line, sizeof(line), "dsv4d_forward_seconds_count{stage=\"insert\"} 7\n");
  assert_non_null(strstr(t, line));
  char *p = strstr(t, "dsv4d_forward_seconds_sum{stage=\"insert\"} ");
  assert_non_null(p);
  assert_true(strtod(p + strlen("dsv4d_forward_seconds_sum{stage=\"insert\"} "), NULL) == sum);
  free(t);

  /* An unlabelled histogram. */
  dsv4_metric_t *bt;
  double tb[] = {1, 16, 256};
  assert_int_equal(dsv4_metrics_histogram(m, "dsv4d_batch_tokens", "Tokens.", NULL, 0, tb, 3, &bt),
                   0);
  dsv4_metric_observe(bt, NULL, 300);
  render(m, &t);
  assert_non_null(strstr(t, "dsv4d_batch_tokens_bucket{le=\"256\"} 0\n"
                            "dsv4d_batch_tokens_bucket{le=\"+Inf\"} 1\n"
                            "dsv4d_batch_tokens_sum 300\n"
                            "dsv4d_batch_tokens_count 1\n"));
  free(t);
  dsv4_metrics_destroy(m);
}

static void collect(dsv4_metrics_t *m, void *arg) {
  (void)m;
  dsv4_metric_set(arg, NULL, 7);
}

static void test_collect_hook(void **state) {
  (void)state;
  dsv4_metrics_t *m;
  assert_int_equal(dsv4_metrics_create(&m), 0);
  dsv4_metric_t *g;
  assert_int_equal(dsv4_metrics_gauge(m, "g", "", NULL, 0, &g), 0);
  dsv4_metrics_set_collect(m, collect, g);
  char *t;
  render(m, &t);
  assert_string_equal(t, "# HELP g \n# TYPE g gauge\ng 7\n");
  free(t);
  dsv4_metrics_destroy(m);
}

static dsv4_metric_t *shared_counter;
static dsv4_metric_t *shared_hist;

static void *hammer(void *arg) {
  const char *codes[] = {"200", "503"};
  const char *v[] = {"forward", codes[(uintptr_t)arg & 1]};
  for (int i = 0; i < 50000; i++) {
    dsv4_metric_add(shared_counter, v, 1);
    dsv4_metric_observe(shared_hist, NULL, (double)(i % 4));
  }
  return NULL;
}

static void test_concurrent(void **state) {
  (void)state;
  dsv4_metrics_t *m;
  assert_int_equal(dsv4_metrics_create(&m), 0);
  const char *labels[] = {"route", "code"};
  double b[] = {0.5, 1.5, 2.5};
  assert_int_equal(dsv4_metrics_counter(m, "c_total", "c", labels, 2, &shared_counter), 0);
  assert_int_equal(dsv4_metrics_histogram(m, "hh", "h", NULL, 0, b, 3, &shared_hist), 0);
  pthread_t th[4];
  for (uintptr_t i = 0; i < 4; i++)
    assert_int_equal(pthread_create(&th[i], NULL, hammer, (void *)i), 0);
  /* Render while the updates run: it must never see a torn structure. */
  for (int i = 0; i < 20; i++) {
    char *r;
    render(m, &r);
    free(r);
  }
  for (int i = 0; i < 4; i++)
    pthread_join(th[i], NULL);
  char *t;
  render(m, &t);
  assert_non_null(strstr(t, "c_total{route=\"forward\",code=\"200\"} 100000\n"));
  assert_non_null(strstr(t, "c_total{route=\"forward\",code=\"503\"} 100000\n"));
  assert_non_null(strstr(t, "hh_bucket{le=\"0.5\"} 50000\n"));
  assert_non_null(strstr(t, "hh_bucket{le=\"+Inf\"} 200000\n"));
  assert_non_null(strstr(t, "hh_sum 300000\n"));
  free(t);
  dsv4_metrics_destroy(m);
}

static void test_default_registry(void **state) {
  (void)state;
  dsv4_metrics_t *a = dsv4_metrics_default(), *b = dsv4_metrics_default();
  assert_non_null(a);
  assert_ptr_equal(a, b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_counter_gauge_text), cmocka_unit_test(test_registration_rules),
      cmocka_unit_test(test_histogram),          cmocka_unit_test(test_collect_hook),
      cmocka_unit_test(test_concurrent),         cmocka_unit_test(test_default_registry),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
