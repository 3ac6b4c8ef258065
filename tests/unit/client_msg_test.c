/*
 * libdsv4client's forward message (client/dsv4client.c, included here for its static builders):
 * the text forward_plain writes directly is byte for byte the text forward_json dumps from the
 * document jansson builds, for every form a forward takes (outputs in any order, repeated or
 * spaced, attention, a deadline, a compressed layer's tensors, new segments), and the plain
 * builder steps aside (0) where escaping is needed, leaving those requests to jansson; and the
 * answer reader takes the daemon's form of a forward's 200 answer without jansson, with the same
 * fields, and leaves every other text to jansson; and a region is refused to a client not its own.
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
  /* The plain texts start non-empty: forward_plain writes them from the start. */
  text_t p = {0}, after_p = {0};
  put_lit(&p, "stale");
  put_lit(&after_p, "stale");
  char *after_j = NULL;
  assert_int_equal(forward_plain(&r, f, &p, &after_p), 1);
  char *j = forward_json(&r, f, &after_j);
  assert_false(p.oom || after_p.oom);
  assert_non_null(j);
  assert_string_equal(p.p, j);
  assert_int_equal(p.len, strlen(j));
  assert_non_null(after_j);
  assert_string_equal(after_p.p, after_j);
  assert_int_equal(after_p.len, strlen(after_j));
  /* Both paths write plain segments with segments_plain: their text against jansson's dump. */
  uint64_t n = 0;
  char *segs_j = segments_json(f, &n);
  assert_non_null(segs_j);
  assert_string_equal(after_p.p, segs_j);
  free(p.p), free(j), free(after_p.p), free(after_j), free(segs_j);
}

static void test_plain_equals_jansson(void **state) {
  (void)state;
  /* A negative start is the daemon's to refuse: the message carries it as jansson writes it. */
  const dsv4c_segment_t segs[4] = {
      {"req-1", 0, 150, 1}, {"b.2:x_y", 40, 1, 0}, {"c", 9000000000LL, 3, 0}, {"d", -5, 1, 0}};
  const char *outputs[] = {
      NULL, "q", "attn", "q,attn,lse,digest", "lse, attn ,q,q,topk", "digest", "topk,attn,lse,q"};
  for (size_t o = 0; o < sizeof(outputs) / sizeof(outputs[0]); o++)
    for (int form = 0; form < 4; form++) {
      dsv4c_forward_t f = {.layer = 2 + form,
                           .segs = segs,
                           .n_segs = form == 1 ? 1 : 4,
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

/* What needs escaping goes to jansson: the plain builder returns 0 and writes no message. */
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
    text_t p = {0}, plain_after = {0};
    assert_int_equal(forward_plain(&r, &f, &p, &plain_after), 0);
    free(p.p);
    free(plain_after.p);
    char *after = NULL;
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

/* Both readers of an answer: the same rc and fields. */
static void same_result(const char *text, int want_fast) {
  dsv4c_result_t a, b;
  const int fast = read_forward_ok(text, strlen(text), &a);
  assert_int_equal(fast, want_fast ? 0 : 1);
  if (!want_fast) {
    dsv4c_result_free(&a);
    return;
  }
  assert_int_equal(read_answer_json(text, strlen(text), &b), 0);
  assert_int_equal(a.status, b.status);
  assert_string_equal(a.code, b.code);
  assert_string_equal(a.message, b.message);
  assert_string_equal(a.cache_digest, b.cache_digest);
  assert_string_equal(a.attention, b.attention);
  assert_int_equal(a.replayed, b.replayed);
  assert_string_equal(a.json, b.json);
  dsv4c_result_free(&a);
  dsv4c_result_free(&b);
}

#define INST "\"instance\":\"0123456789abcdef0123456789abcdef\"}"
#define SLOTS "\"slots\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}"
#define Q_OUT "\"q_out\":{\"dtype\":\"BF16\",\"shape\":[1,64,512],\"data_offsets\":[64,65600]}"

/*
 * A forward's 200 answer in the daemon's form is read without jansson, with jansson's fields; any
 * other text (an error, keys in another order, white space, a number with a leading zero or too
 * many digits, a digest or an instance of the wrong length, a cut or longer text) goes to jansson.
 */
static void test_answer_reader(void **state) {
  (void)state;
  const char *fast[] = {
      "{\"metadata\":{},\"tensors\":{" Q_OUT "," SLOTS "},\"status\":200," INST,
      "{\"metadata\":{\"cache_digest\":\"00ff00ff00ff00ff\"},\"tensors\":{" SLOTS
      "},\"status\":200," INST,
      "{\"metadata\":{\"cache_digest\":\"00ff00ff00ff00ff\",\"attention\":\"fast\",\"replayed\":"
      "\"true\"},\"tensors\":{" Q_OUT "," SLOTS "},\"status\":200," INST,
      "{\"metadata\":{\"attention\":\"exact\"},\"tensors\":{" SLOTS "},\"status\":200," INST,
      "{\"metadata\":{\"replayed\":\"true\"},\"tensors\":{" SLOTS "},\"status\":200," INST,
  };
  for (size_t i = 0; i < sizeof(fast) / sizeof(fast[0]); i++)
    same_result(fast[i], 1);
  const char *other[] = {
      "{\"status\":404,\"instance\":\"x\",\"error\":{\"code\":\"not_found\",\"message\":\"m\"}}",
      "{\"tensors\":{" SLOTS "},\"metadata\":{},\"status\":200," INST,
      "{\"metadata\":{\"replayed\":\"true\",\"attention\":\"fast\"},\"tensors\":{" SLOTS
      "},\"status\":200," INST,
      "{\"metadata\": {},\"tensors\":{" SLOTS "},\"status\":200," INST,
      "{\"metadata\":{},\"tensors\":{\"slots\":{\"dtype\":\"I64\",\"shape\":[01],\"data_"
      "offsets\":[0,8]}},\"status\":200," INST,
      "{\"metadata\":{},\"tensors\":{\"slots\":{\"dtype\":\"I64\",\"shape\":[1],\"data_"
      "offsets\":[0,12345678901234567890]}},\"status\":200," INST,
      "{\"metadata\":{\"cache_digest\":\"00ff\"},\"tensors\":{" SLOTS "},\"status\":200," INST,
      "{\"metadata\":{\"attention\":\"slow\"},\"tensors\":{" SLOTS "},\"status\":200," INST,
      "{\"metadata\":{},\"tensors\":{" SLOTS "},\"status\":200,\"instance\":\"0123\"}",
      "{\"metadata\":{},\"tensors\":{" SLOTS "},\"status\":201," INST,
      "{\"metadata\":{},\"tensors\":{" SLOTS "},\"status\":200," INST " ",
      "{\"metadata\":{},\"tensors\":{" SLOTS "},\"status\":200,\"instance\":\"0123456789abcdef",
  };
  for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++)
    same_result(other[i], 0);
}

/* A region is its own client's: another client's forward or destroy of it is -EINVAL, with
 * nothing sent (neither fake client has a socket) and the region left as it was. */
static void test_region_of_another_client(void **state) {
  (void)state;
  dsv4c_client_t a = {.fd = -1}, b = {.fd = -1};
  uint8_t page[64];
  dsv4c_region_t r = {.base = page, .size = sizeof(page), .id = 1, .client = &a};
  const dsv4c_segment_t seg = {"s", 0, 1, 1};
  const dsv4c_forward_t f = {.segs = &seg, .n_segs = 1, .heads = 8, .deadline_ms = -1};
  dsv4c_result_t res;
  memset(&res, 0x5a, sizeof(res));
  assert_int_equal(dsv4c_forward(&b, &r, &f, &res), -EINVAL);
  assert_null(res.json);
  assert_int_equal(res.status, 0);
  assert_int_equal(dsv4c_region_destroy(&b, &r), -EINVAL);
  assert_ptr_equal(r.base, page);
  assert_null(b.msg.p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plain_equals_jansson),
      cmocka_unit_test(test_escaping_left_to_jansson),
      cmocka_unit_test(test_answer_reader),
      cmocka_unit_test(test_region_of_another_client),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
