/*
 * libdsv4client's forward message (client/dsv4client.c, included here for its static builders):
 * the text forward_plain writes directly is byte for byte the text forward_json dumps from the
 * document jansson builds, for every form a forward takes (outputs in any order, repeated or
 * spaced, attention, a deadline, a compressed layer's tensors, new segments), and the plain
 * builder steps aside (NULL) where escaping is needed, leaving those requests to jansson.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "../../client/dsv4client.c"

/* Both builders on f: the same message text and the same segments' text after it. */
static void same_message(const dsv4c_forward_t *f) {
  const dsv4c_region_t r = {.base = NULL, .size = 1u << 30, .id = 7};
  char *after_p = NULL, *after_j = NULL;
  char *p = forward_plain(&r, f, &after_p);
  char *j = forward_json(&r, f, &after_j);
  assert_non_null(p);
  assert_non_null(j);
  assert_string_equal(p, j);
  assert_non_null(after_p);
  assert_non_null(after_j);
  assert_string_equal(after_p, after_j);
  free(p), free(j), free(after_p), free(after_j);
}

static void test_plain_equals_jansson(void **state) {
  (void)state;
  const dsv4c_segment_t segs[3] = {
      {"req-1", 0, 150, 1}, {"b.2:x_y", 40, 1, 0}, {"c", 9000000000LL, 3, 0}};
  const char *outputs[] = {
      NULL, "q", "attn", "q,attn,lse,digest", "lse, attn ,q,q,topk", "digest", "topk,attn,lse,q"};
  for (size_t o = 0; o < sizeof(outputs) / sizeof(outputs[0]); o++)
    for (int form = 0; form < 4; form++) {
      dsv4c_forward_t f = {.layer = 2 + form,
                           .segs = segs,
                           .n_segs = form == 1 ? 1 : 3,
                           .heads = 64,
                           .outputs = outputs[o],
                           .attention = form == 2   ? "fast"
                                        : form == 3 ? "exact"
                                                    : NULL,
                           .q_off = 0,
                           .kv_off = 1u << 24,
                           .q_out_off = 1u << 25,
                           .slots_off = 3u << 24,
                           .attn_off = 1u << 26,
                           .lse_off = 5u << 24,
                           .deadline_ms = form == 1   ? 250
                                          : form == 2 ? 0
                                                      : -1,
                           .index_topk = 512,
                           .topk_off = 6u << 24};
      if (form >= 2) { /* a compressed layer: ratio 4 with the indexer's tensors, or 128 */
        f.ckv_width = form == 2 ? 2048 : 1024;
        f.ckv_off = 7u << 24;
        f.index_heads = form == 2 ? 64 : 0;
        f.ikv_off = 8u << 24;
        f.iq_off = 9u << 24;
        f.iw_off = 10u << 24;
      }
      same_message(&f);
    }
}

/* What needs escaping goes to jansson: the plain builder returns NULL and leaves no text. */
static void test_escaping_left_to_jansson(void **state) {
  (void)state;
  const dsv4c_segment_t plain = {"a", 0, 1, 1}, quoted = {"a\"b", 0, 1, 1};
  const dsv4c_region_t r = {.id = 1};
  const struct {
    const dsv4c_segment_t *seg;
    const char *outputs, *attention;
  } cases[] = {{&quoted, "q", NULL}, {&plain, "q,\"x", NULL}, {&plain, "q", "fa\\st"}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    dsv4c_forward_t f = {.segs = cases[i].seg,
                         .n_segs = 1,
                         .heads = 8,
                         .outputs = cases[i].outputs,
                         .attention = cases[i].attention,
                         .deadline_ms = -1};
    char *after = NULL;
    char *p = forward_plain(&r, &f, &after);
    assert_null(p);
    free(after);
    after = NULL;
    char *j = forward_json(&r, &f, &after);
    assert_non_null(j); /* jansson escapes it; the daemon then judges the request */
    json_error_t err;
    json_t *doc = json_loads(j, 0, &err);
    assert_non_null(doc);
    json_decref(doc);
    free(j);
    free(after);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plain_equals_jansson),
      cmocka_unit_test(test_escaping_left_to_jansson),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
