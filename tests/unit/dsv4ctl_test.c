/*
 * dsv4ctl: URL and argument parsing, the table and JSON views, verify on dumps built here (good,
 * flipped bytes, bad headers), and the client against a scripted HTTP server on 127.0.0.1 that
 * answers each connection with canned bytes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <jansson.h>
#include <xxhash.h>

#include "args.h"
#include "client.h"
#include "commands.h"
#include "dsv4-error.h"
#include "fmt.h"
#include "safetensors.h"
#include "verify.h"

/* ---- helpers ------------------------------------------------------------------------------- */

/* Everything written to a memstream, as a string the caller frees. */
typedef struct {
  char *buf;
  size_t len;
  FILE *f;
} capture_t;

static void cap_open(capture_t *c) {
  c->buf = NULL;
  c->len = 0;
  c->f = open_memstream(&c->buf, &c->len);
  assert_non_null(c->f);
}

static char *cap_close(capture_t *c) {
  fclose(c->f);
  return c->buf;
}

/* argv of "dsv4ctl" and the NULL-terminated strings of ap (at most 31); returns argc. */
static int make_argv(char **argv, va_list ap) {
  int argc = 0;
  argv[argc++] = (char *)"dsv4ctl";
  const char *s;
  while ((s = va_arg(ap, const char *)) != NULL && argc < 32)
    argv[argc++] = (char *)s;
  return argc;
}

static int parse(dsv4_ctl_args_t *a, const char *env_admin, const char *env_token, ...) {
  char *argv[32];
  va_list ap;
  va_start(ap, env_token);
  int argc = make_argv(argv, ap);
  va_end(ap);
  char err[DSV4_CTL_ERR_LEN] = "";
  int rc = dsv4_ctl_args_parse(argc, argv, env_admin, env_token, a, err, sizeof(err));
  if (rc != 0)
    assert_true(err[0] != '\0');
  return rc;
}

/* The error message of a parse that must fail. */
static char last_err[DSV4_CTL_ERR_LEN];
static void expect_usage(const char *want, int argc, const char **args) {
  char *argv[16];
  argv[0] = (char *)"dsv4ctl";
  for (int i = 0; i < argc; i++)
    argv[i + 1] = (char *)args[i];
  dsv4_ctl_args_t a;
  int rc = dsv4_ctl_args_parse(argc + 1, argv, NULL, NULL, &a, last_err, sizeof(last_err));
  if (rc != DSV4_EINVAL || !strstr(last_err, want))
    print_error("args starting \"%s\": rc %d, error \"%s\", wanted \"%s\"\n", args[0], rc, last_err,
                want);
  assert_int_equal(rc, DSV4_EINVAL);
  assert_non_null(strstr(last_err, want));
}
#define EXPECT_USAGE(want, ...)                                                                    \
  do {                                                                                             \
    const char *args_[] = {__VA_ARGS__};                                                           \
    expect_usage(want, (int)(sizeof(args_) / sizeof(args_[0])), args_);                            \
  } while (0)

/* ---- URL parsing --------------------------------------------------------------------------- */

static void url_ok(const char *s, const char *host, const char *port, const char *base, int v6) {
  dsv4_ctl_url_t u;
  char err[DSV4_CTL_ERR_LEN] = "";
  int rc = dsv4_ctl_url_parse(s, &u, err, sizeof(err));
  if (rc != 0)
    print_error("%s: %s\n", s, err);
  assert_int_equal(rc, 0);
  assert_string_equal(u.host, host);
  assert_string_equal(u.port, port);
  assert_string_equal(u.base, base);
  assert_int_equal(u.ipv6, v6);
}

static void url_bad(const char *s, const char *want) {
  dsv4_ctl_url_t u;
  char err[DSV4_CTL_ERR_LEN] = "";
  int rc = dsv4_ctl_url_parse(s, &u, err, sizeof(err));
  if (rc != DSV4_EINVAL || !strstr(err, want))
    print_error("%s: rc %d \"%s\", wanted \"%s\"\n", s, rc, err, want);
  assert_int_equal(rc, DSV4_EINVAL);
  assert_non_null(strstr(err, want));
}

static void test_url(void **state) {
  (void)state;
  url_ok("http://127.0.0.1:8401", "127.0.0.1", "8401", "", 0);
  url_ok("http://127.0.0.1:8401/", "127.0.0.1", "8401", "", 0);
  url_ok("HTTP://admin.example:1/dsv4//", "admin.example", "1", "/dsv4", 0);
  url_ok("http://localhost", "localhost", "80", "", 0);
  url_ok("localhost:8401", "localhost", "8401", "", 0);
  url_ok("http://[::1]:8401/x", "::1", "8401", "/x", 1);
  url_ok("http://[::1]", "::1", "80", "", 1);
  url_ok("http://h:00065535", "h", "65535", "", 0);

  url_bad("", "empty");
  url_bad("https://127.0.0.1:8401", "https is not supported");
  url_bad("ftp://h:1", "only http://");
  url_bad("http://user:pw@h:1", "user info");
  url_bad("http://h:1/?x=1", "query or fragment");
  url_bad("http://h:1#f", "query or fragment");
  url_bad("http://h:0", "not 1..65535");
  url_bad("http://h:65536", "not 1..65535");
  url_bad("http://h:8x", "not 1..65535");
  url_bad("http://h:", "bad port");
  url_bad("http://:8401", "no host");
  url_bad("http://[::1:8401", "unterminated");
  url_bad("http://[::1]8401", "junk after");
  url_bad("http://[zz]:1", "bad IPv6");
  url_bad("http://h st:1", "bad character ' '");
  url_bad("http://h:1/a b", "bad character in the path");
}

/* ---- argument parsing ---------------------------------------------------------------------- */

static void test_args_defaults_and_env(void **state) {
  (void)state;
  dsv4_ctl_args_t a;
  assert_int_equal(parse(&a, NULL, NULL, "status", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_STATUS);
  assert_string_equal(a.admin, DSV4_CTL_DEFAULT_ADMIN);
  assert_null(a.token_file);
  assert_int_equal(a.json, 0);
  assert_int_equal(a.progress, -1);
  assert_int_equal(a.timeout_ms, DSV4_CTL_DEFAULT_TIMEOUT_MS);

  /* The environment gives defaults; flags win over it, in either position and form. */
  assert_int_equal(parse(&a, "http://e:1", "/env/tok", "status", NULL), 0);
  assert_string_equal(a.admin, "http://e:1");
  assert_string_equal(a.token_file, "/env/tok");
  assert_int_equal(parse(&a, "http://e:1", "/env/tok", "status", "--admin", "http://f:2",
                         "--token-file=/t", "--json", "--timeout", "5", NULL),
                   0);
  assert_string_equal(a.admin, "http://f:2");
  assert_string_equal(a.token_file, "/t");
  assert_int_equal(a.json, 1);
  assert_int_equal(a.timeout_ms, 5000);
  assert_int_equal(parse(&a, "", "", "--json", "--admin=http://g:3", "status", NULL), 0);
  assert_string_equal(a.admin, "http://g:3");
  assert_null(a.token_file);

  assert_int_equal(parse(&a, NULL, NULL, "--help", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_HELP);
  assert_int_equal(parse(&a, NULL, NULL, "status", "--version", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_VERSION);
}

static void test_args_commands(void **state) {
  (void)state;
  dsv4_ctl_args_t a;
  assert_int_equal(parse(&a, NULL, NULL, "seq", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_SEQ);
  assert_null(a.seq);
  assert_int_equal(parse(&a, NULL, NULL, "seq", "req-1:a.b_c", NULL), 0);
  assert_string_equal(a.seq, "req-1:a.b_c");

  assert_int_equal(parse(&a, NULL, NULL, "token", "s", "70", "--layer", "3", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_TOKEN);
  assert_string_equal(a.seq, "s");
  assert_int_equal(a.pos, 70);
  assert_int_equal(a.has_layer, 1);
  assert_int_equal(a.layer, 3);
  assert_int_equal(parse(&a, NULL, NULL, "--layer=0", "token", "s", "0", NULL), 0);
  assert_int_equal(a.layer, 0);
  assert_int_equal(a.pos, 0);
  assert_int_equal(parse(&a, NULL, NULL, "entry", "s", "38", "--layer", "2", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_ENTRY);
  assert_string_equal(a.seq, "s");
  assert_int_equal(a.pos, 38);
  assert_int_equal(a.has_layer, 1);
  assert_int_equal(a.layer, 2);

  assert_int_equal(parse(&a, NULL, NULL, "checksum", "--layer", "43", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_CHECKSUM);
  assert_null(a.seq);
  assert_int_equal(a.layer, 43);
  assert_int_equal(parse(&a, NULL, NULL, "checksum", "--layer", "1", "--seq", "x", NULL), 0);
  assert_string_equal(a.seq, "x");

  assert_int_equal(parse(&a, NULL, NULL, "dump", "--seq", "x", "-o", "/tmp/f", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_DUMP);
  assert_int_equal(a.has_layers, 0);
  assert_string_equal(a.output, "/tmp/f");
  assert_int_equal(
      parse(&a, NULL, NULL, "dump", "--seq=x", "--layers", "2-5", "--output=o", "--progress", NULL),
      0);
  assert_int_equal(a.has_layers, 1);
  assert_int_equal(a.layer_first, 2);
  assert_int_equal(a.layer_last, 5);
  assert_int_equal(a.progress, 1);
  assert_int_equal(parse(&a, NULL, NULL, "dump", "--seq", "x", "--layers", "7", "-o", "o",
                         "--no-progress", NULL),
                   0);
  assert_int_equal(a.layer_first, 7);
  assert_int_equal(a.layer_last, 7);
  assert_int_equal(a.progress, 0);

  /* A sequence name may start with '-': after "--" it is no option. */
  assert_int_equal(parse(&a, NULL, NULL, "seq", "--json", "--", "-x", NULL), 0);
  assert_string_equal(a.seq, "-x");
  assert_int_equal(a.json, 1);
  assert_int_equal(parse(&a, NULL, NULL, "seq", "-7", NULL), 0);
  assert_string_equal(a.seq, "-7");
  assert_int_equal(parse(&a, NULL, NULL, "verify", "--", "-odd-name", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_VERIFY);
  assert_string_equal(a.file, "-odd-name");

  /* The commands that move a sequence. */
  assert_int_equal(parse(&a, NULL, NULL, "snapshot", "--seq", "s", "-o", "f.st", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_SNAPSHOT);
  assert_string_equal(a.output, "f.st");
  assert_int_equal(parse(&a, NULL, NULL, "restore", "--seq", "s", "f.st", NULL), 0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_RESTORE);
  assert_string_equal(a.file, "f.st");
  assert_int_equal(a.replace, 0);
  assert_int_equal(parse(&a, NULL, NULL, "restore", "f.st", "--replace", "--seq=s", NULL), 0);
  assert_int_equal(a.replace, 1);
  assert_int_equal(parse(&a, NULL, NULL, "migrate", "--seq", "s", "--to", "10.0.0.2:8401",
                         "--to-token-file", "/t", NULL),
                   0);
  assert_int_equal(a.cmd, DSV4_CTL_CMD_MIGRATE);
  assert_string_equal(a.to, "10.0.0.2:8401");
  assert_string_equal(a.to_token_file, "/t");
}

static void test_args_errors(void **state) {
  (void)state;
  const char *none[] = {"--json"};
  expect_usage("no command", 1, none);
  EXPECT_USAGE("unknown command \"stats\"", "stats");
  EXPECT_USAGE("unknown option \"--jsn\"", "status", "--jsn");
  EXPECT_USAGE("--admin needs a value", "status", "--admin");
  EXPECT_USAGE("--json takes no value", "status", "--json=1");
  EXPECT_USAGE("status takes no arguments", "status", "x");
  EXPECT_USAGE("--timeout \"0\"", "status", "--timeout", "0");
  EXPECT_USAGE("--timeout \"1.5\"", "status", "--timeout", "1.5");
  EXPECT_USAGE("at most one sequence", "seq", "a", "b");
  EXPECT_USAGE("not a sequence name", "seq", "a/b");
  EXPECT_USAGE("not a sequence name", "seq", ".hidden");
  EXPECT_USAGE("usage: token SEQ POS", "token", "s", "--layer", "0");
  EXPECT_USAGE("position \"-1\"", "token", "s", "-1", "--layer", "0");
  EXPECT_USAGE("position \"5x\"", "token", "s", "5x", "--layer", "0");
  EXPECT_USAGE("position \"99999999999999999999\"", "token", "s", "99999999999999999999", "--layer",
               "0");
  EXPECT_USAGE("token needs --layer", "token", "s", "5");
  EXPECT_USAGE("--layer \"x\"", "token", "s", "5", "--layer", "x");
  EXPECT_USAGE("usage: entry SEQ J", "entry", "s", "--layer", "2");
  EXPECT_USAGE("entry \"-1\"", "entry", "s", "-1", "--layer", "2");
  EXPECT_USAGE("entry needs --layer", "entry", "s", "5");
  EXPECT_USAGE("not a sequence name", "entry", "a/b", "5", "--layer", "2");
  EXPECT_USAGE("seq takes no --layer", "seq", "--layer", "2");
  EXPECT_USAGE("--layer \"-1\"", "checksum", "--layer", "-1");
  EXPECT_USAGE("checksum needs --layer", "checksum");
  EXPECT_USAGE("use --seq", "checksum", "--layer", "0", "s");
  EXPECT_USAGE("status takes no --layer", "status", "--layer", "0");
  EXPECT_USAGE("seq takes no --seq", "seq", "--seq", "a");
  EXPECT_USAGE("dump needs --seq", "dump", "-o", "f");
  EXPECT_USAGE("dump needs -o", "dump", "--seq", "a");
  EXPECT_USAGE("-o needs a file name", "dump", "--seq", "a", "-o=");
  EXPECT_USAGE("--layers \"5-2\"", "dump", "--seq", "a", "--layers", "5-2", "-o", "f");
  EXPECT_USAGE("--layers \"1-\"", "dump", "--seq", "a", "--layers", "1-", "-o", "f");
  EXPECT_USAGE("--layers \"a\"", "dump", "--seq", "a", "--layers", "a", "-o", "f");
  EXPECT_USAGE("checksum takes no --layers", "checksum", "--layer", "0", "--layers", "0-1");
  EXPECT_USAGE("verify takes no -o", "verify", "f", "-o", "g");
  EXPECT_USAGE("usage: verify FILE", "verify");
  EXPECT_USAGE("too many arguments", "verify", "a", "b", "c", "d", "e");
  EXPECT_USAGE("snapshot needs -o", "snapshot", "--seq", "a");
  EXPECT_USAGE("snapshot needs --seq", "snapshot", "-o", "f");
  EXPECT_USAGE("a snapshot holds every layer", "snapshot", "--seq", "a", "-o", "f", "--layers",
               "0-1");
  EXPECT_USAGE("usage: restore --seq S FILE", "restore", "--seq", "a");
  EXPECT_USAGE("restore needs --seq", "restore", "f");
  EXPECT_USAGE("not a sequence name", "restore", "--seq", "a/b", "f");
  EXPECT_USAGE("restore takes no -o", "restore", "--seq", "a", "f", "-o", "g");
  EXPECT_USAGE("dump takes no --replace", "dump", "--seq", "a", "-o", "f", "--replace");
  EXPECT_USAGE("migrate needs --to", "migrate", "--seq", "a");
  EXPECT_USAGE("migrate takes no positional arguments", "migrate", "--seq", "a", "--to", "h:1",
               "x");
  EXPECT_USAGE("restore takes no --to", "restore", "--seq", "a", "f", "--to", "h:1");
  EXPECT_USAGE("status takes no --to-token-file", "status", "--to-token-file", "t");
  EXPECT_USAGE("--replace takes no value", "restore", "--seq", "a", "f", "--replace=1");
}

/* ---- views --------------------------------------------------------------------------------- */

static json_t *doc_of(const char *text) {
  json_error_t e;
  json_t *d = json_loads(text, 0, &e);
  if (!d)
    print_error("bad test JSON: %s\n", e.text);
  assert_non_null(d);
  return d;
}

static void test_table(void **state) {
  (void)state;
  static const char *const heads[] = {"NAME", "N", "NOTE"};
  dsv4_ctl_table_t t;
  dsv4_ctl_table_init(&t, 3, heads, 2u);
  const char *r1[] = {"a", "1", "short"};
  const char *r2[] = {"longer-name", "12345", NULL};
  dsv4_ctl_table_add(&t, r1);
  dsv4_ctl_table_add(&t, r2);
  capture_t c;
  cap_open(&c);
  dsv4_ctl_table_print(&t, c.f);
  char *s = cap_close(&c);
  assert_string_equal(s, "NAME             N  NOTE\n"
                         "a                1  short\n"
                         "longer-name  12345  -\n");
  free(s);

  char buf[64];
  json_t *l = doc_of("[0,1,2,3,43]");
  dsv4_ctl_format_layers(l, buf, sizeof(buf));
  assert_string_equal(buf, "0-3,43");
  json_decref(l);
  l = doc_of("[5]");
  dsv4_ctl_format_layers(l, buf, sizeof(buf));
  assert_string_equal(buf, "5");
  json_decref(l);
  dsv4_ctl_format_layers(NULL, buf, sizeof(buf));
  assert_string_equal(buf, "-");
  l = doc_of("[0,2,4,5]");
  dsv4_ctl_format_layers(l, buf, 6); /* truncated, never overflowing */
  assert_string_equal(buf, "0,2,4");
  json_decref(l);

  const char *err = "{\"error\":{\"code\":\"unknown_sequence\",\"message\":\"no sequence "
                    "\\\"x\\\"\",\"instance\":\"ab\"}}";
  char line[256];
  dsv4_ctl_format_error(404, err, strlen(err), line, sizeof(line));
  assert_string_equal(line, "404 unknown_sequence: no sequence \"x\"");
  dsv4_ctl_format_error(502, "Bad\r\nGateway", 12, line, sizeof(line));
  assert_string_equal(line, "502 (not a JSON error: Bad  Gateway)");
  dsv4_ctl_format_error(500, NULL, 0, line, sizeof(line));
  assert_string_equal(line, "500 (not a JSON error)");
}

static char *render(void (*print)(FILE *, const json_t *), const char *text) {
  json_t *d = doc_of(text);
  capture_t c;
  cap_open(&c);
  print(c.f, d);
  json_decref(d);
  return cap_close(&c);
}

static void test_views(void **state) {
  (void)state;
  char *s = render(dsv4_ctl_print_cache,
                   "{\"instance\":\"00112233445566778899aabbccddeeff\",\"version\":\"0.1.0\","
                   "\"backend\":\"cpu\",\"layout\":\"fp8_ds_mla\",\"fp8\":\"F8_E4M3FN\","
                   "\"scale\":\"UE8M0\",\"block_size\":64,\"window\":128,\"record_bytes\":584,"
                   "\"stride\":37440,\"heads\":8,\"served_layers\":[0,1,2,3],\"kv_blocks\":64,"
                   "\"blocks_used\":3,\"blocks_free\":61,\"usage_ratio\":0.046875,"
                   "\"cache_bytes\":9584640,\"sequences\":1,"
                   "\"pool_digests\":{\"10\":\"000000000000000a\",\"2\":\"0000000000000002\"}}");
  assert_string_equal(s, "instance         00112233445566778899aabbccddeeff\n"
                         "version          0.1.0 (backend cpu)\n"
                         "layout           fp8_ds_mla (NoPE F8_E4M3FN, scales UE8M0, 584-byte "
                         "records)\n"
                         "block_size       64 tokens, stride 37440 bytes, window 128\n"
                         "heads            8\n"
                         "layers           0-3 (4 served)\n"
                         "blocks           3 used, 61 free of 64 (4.69 %)\n"
                         "cache_bytes      9584640 (9.1 MiB)\n"
                         "sequences        1\n"
                         "\n"
                         "LAYER  POOL_DIGEST\n"
                         "    2  0000000000000002\n"
                         "   10  000000000000000a\n");
  free(s);

  /* A document missing fields still prints, with "-" where a value is missing. */
  s = render(dsv4_ctl_print_cache, "{\"instance\":\"x\"}");
  assert_non_null(strstr(s, "heads            -\n"));
  assert_non_null(strstr(s, "layers           - (0 served)\n"));
  free(s);

  s = render(dsv4_ctl_print_sequences,
             "{\"instance\":\"i\",\"count\":2,\"sequences\":["
             "{\"seq\":\"a\",\"p0\":0,\"blocks\":2,\"next\":{\"0\":70,\"1\":70,\"2\":64,\"3\":64},"
             "\"idle_ms\":1234},"
             "{\"seq\":\"bb\",\"p0\":5,\"blocks\":1,\"next\":{\"0\":7,\"2\":7},\"idle_ms\":3}]}");
  assert_string_equal(s, "SEQ  P0  BLOCKS  IDLE_MS  NEXT\n"
                         "a     0       2     1234  0-1:70 2-3:64\n"
                         "bb    5       1        3  0:7 2:7\n"
                         "2 sequence(s)\n");
  free(s);

  s = render(dsv4_ctl_print_sequence,
             "{\"instance\":\"i\",\"seq\":\"a\",\"p0\":0,\"next\":{\"0\":70,\"1\":64},"
             "\"last_start\":{\"0\":69,\"1\":0},\"stored\":{\"0\":[0,69],\"1\":null},"
             "\"release_held_by\":null,\"blocks\":2,\"block_table\":["
             "{\"logical\":0,\"block\":17,\"first\":0,\"last\":63},"
             "{\"logical\":1,\"block\":3,\"first\":64,\"last\":127}]}");
  assert_string_equal(s, "seq              a\n"
                         "instance         i\n"
                         "p0               0\n"
                         "blocks           2\n"
                         "release_held_by  -\n"
                         "\n"
                         "LAYER  NEXT  LAST_START  STORED\n"
                         "    0    70          69  0-69\n"
                         "    1    64           0  -\n"
                         "\n"
                         "LOGICAL  BLOCK  FIRST  LAST\n"
                         "      0     17      0    63\n"
                         "      1      3     64   127\n");
  free(s);

  s = render(dsv4_ctl_print_checksums,
             "{\"instance\":\"i\",\"layer\":0,\"pool\":\"00000000000000ff\","
             "\"blocks\":{\"17\":\"0000000000000011\",\"3\":\"0000000000000003\"},"
             "\"sequences\":{\"a\":{\"digest\":\"00000000000000aa\",\"first\":0,\"last\":69,"
             "\"records\":70},\"e\":{\"digest\":\"2d06800538d394c2\",\"first\":null,"
             "\"last\":null,\"records\":0}}}");
  assert_string_equal(s, "layer 0  pool 00000000000000ff\n"
                         "\n"
                         "BLOCK  DIGEST\n"
                         "    3  0000000000000003\n"
                         "   17  0000000000000011\n"
                         "\n"
                         "SEQ  FIRST  LAST  RECORDS  DIGEST\n"
                         "a        0    69       70  00000000000000aa\n"
                         "e        -     -        0  2d06800538d394c2\n");
  free(s);

  /* A token: 7 groups of 64 NoPE values with their scale, the raw bytes, then RoPE. */
  json_t *tok =
      json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:s}", "seq", "a", "layer", 1, "position", 5,
                "block", 17, "offset", 5, "slot", 1093, "record_digest", "0123456789abcdef");
  json_t *fp8 = json_array(), *nope = json_array(), *codes = json_array(), *scales = json_array(),
         *rope = json_array(), *rb = json_array();
  for (int i = 0; i < 448; i++) {
    json_array_append_new(fp8, json_integer(i & 255));
    json_array_append_new(nope, json_real(i * 0.5));
  }
  for (int g = 0; g < 7; g++) {
    json_array_append_new(codes, json_integer(120 + g));
    json_array_append_new(scales, json_real(1.0 / (1 << (7 - g))));
  }
  for (int i = 0; i < 64; i++) {
    json_array_append_new(rope, json_real(-i * 0.25));
    json_array_append_new(rb, json_integer(0xbe80 + i));
  }
  json_object_set_new(tok, "fp8", fp8);
  json_object_set_new(tok, "nope", nope);
  json_object_set_new(tok, "scale_codes", codes);
  json_object_set_new(tok, "scales", scales);
  json_object_set_new(tok, "rope", rope);
  json_object_set_new(tok, "rope_bf16", rb);
  capture_t c;
  cap_open(&c);
  dsv4_ctl_print_token(c.f, tok);
  json_decref(tok);
  s = cap_close(&c);
  assert_non_null(strstr(s, "seq a  layer 1  position 5  block 17  offset 5  slot 1093\n"));
  assert_non_null(strstr(s, "record_digest    0123456789abcdef\n"));
  assert_non_null(strstr(s, "\nNoPE dims 0-63: scale code 120 = 0.0078125\n"));
  assert_non_null(strstr(s, "\nNoPE dims 384-447: scale code 126 = 0.5\n"));
  assert_non_null(strstr(s, "   440:             220           220.5             221"));
  assert_non_null(strstr(s, "   432: b0 b1 b2 b3"));
  assert_non_null(
      strstr(s, "\nRoPE (64 values):\n     0:               0           -0.25            -0.5"));
  assert_non_null(strstr(s, "    48: beb0 beb1"));
  free(s);
}

/* An entry: its head, its record as a token's, then at ratio 4 the index record by 32-blocks. */
static void test_print_entry(void **state) {
  (void)state;
  json_t *doc = json_pack("{s:s, s:i, s:i, s:i, s:[i,i], s:i, s:i, s:i, s:s}", "seq", "a", "layer",
                          2, "ratio", 4, "entry", 38, "window", 152, 155, "block", 9, "offset", 6,
                          "slot", 150, "record_digest", "00000000000000e1");
  json_t *codes = json_array(), *scales = json_array(), *nope = json_array();
  for (int g = 0; g < 7; g++) {
    json_array_append_new(codes, json_integer(127));
    json_array_append_new(scales, json_real(1.0));
  }
  for (int i = 0; i < 448; i++)
    json_array_append_new(nope, json_real(i));
  json_object_set_new(doc, "scale_codes", codes);
  json_object_set_new(doc, "scales", scales);
  json_object_set_new(doc, "nope", nope);
  json_t *ix = json_pack("{s:s}", "record_digest", "00000000000000f2");
  json_t *icodes = json_array(), *iscales = json_array(), *vals = json_array(), *nib = json_array();
  for (int b = 0; b < 4; b++) {
    json_array_append_new(icodes, json_integer(125 + b));
    json_array_append_new(iscales, json_real(0.25 * (1 << b)));
  }
  for (int i = 0; i < 128; i++) {
    json_array_append_new(vals, json_real(i % 2 ? -1.5 : 6.0));
    json_array_append_new(nib, json_integer(i % 2 ? 0xb : 0x7));
  }
  json_object_set_new(ix, "scale_codes", icodes);
  json_object_set_new(ix, "scales", iscales);
  json_object_set_new(ix, "values", vals);
  json_object_set_new(ix, "e2m1", nib);
  json_object_set_new(doc, "index", ix);
  capture_t c;
  cap_open(&c);
  dsv4_ctl_print_entry(c.f, doc);
  char *s = cap_close(&c);
  assert_non_null(strstr(
      s, "seq a  layer 2  entry 38  ratio 4  positions 152-155  block 9  offset 6  slot 150\n"
         "record_digest    00000000000000e1\n"));
  assert_non_null(strstr(s, "\nNoPE dims 384-447: scale code 127 = 1\n"));
  assert_non_null(strstr(s, "\nindex record (MXFP4)\nrecord_digest    00000000000000f2\n"));
  assert_non_null(strstr(s, "\ndims 0-31: scale code 125 = 0.25\n"));
  assert_non_null(strstr(s, "\ndims 96-127: scale code 128 = 2\n"));
  assert_non_null(strstr(s, "    96:               6            -1.5               6"));
  assert_non_null(strstr(s, "  e2m1 nibbles:\n    96: 7 b 7 b"));
  free(s);
  /* At ratio 128 there is no index record to show. */
  json_object_del(doc, "index");
  cap_open(&c);
  dsv4_ctl_print_entry(c.f, doc);
  s = cap_close(&c);
  assert_null(strstr(s, "index record"));
  assert_non_null(strstr(s, "record_digest    00000000000000e1\n"));
  free(s);
  json_decref(doc);
}

/* ---- dumps built here ---------------------------------------------------------------------- */

#define RB 584

/* A dump of layers [first, first + n) where layer first+i holds t[i] records at positions
 * p_first[i].., each record filled from a pattern; digests computed here with one-shot XXH3 over
 * the concatenation (independent of the streaming helper verify uses). reverse: tensors in the
 * opposite order, as another writer may put them. */
typedef struct {
  uint8_t *buf;
  size_t len;
} blob_t;

/* When >= 0, make_dump leaves a gap in its layers after the one at this index (a daemon serving a
 * set with gaps writes its layers as comma-joined runs). */
static int make_dump_gap_after = -1;

static uint32_t dump_layer(uint32_t first, uint32_t i) {
  return first + i + (make_dump_gap_after >= 0 && i > (uint32_t)make_dump_gap_after ? 1 : 0);
}

static blob_t make_dump(uint32_t first, uint32_t n, const uint64_t *t, const int64_t *p_first,
                        int reverse, const char *extra_key, const char *extra_value) {
  dsv4_st_desc_t desc[16];
  dsv4_st_meta_t meta[40];
  size_t nm = 0;
  static char keys[16][2][32], vals[16][2][48], range[32];
  uint8_t *data[16];
  size_t nd = 0;
  meta[nm++] = (dsv4_st_meta_t){"layout", "fp8_ds_mla"};
  meta[nm++] = (dsv4_st_meta_t){"fp8", "F8_E4M3FN"};
  meta[nm++] = (dsv4_st_meta_t){"scale", "UE8M0"};
  meta[nm++] = (dsv4_st_meta_t){"block_size", "64"};
  meta[nm++] = (dsv4_st_meta_t){"window", "128"};
  meta[nm++] = (dsv4_st_meta_t){"record_bytes", "584"};
  meta[nm++] = (dsv4_st_meta_t){"p0", "0"};
  meta[nm++] = (dsv4_st_meta_t){"seq", "a"};
  meta[nm++] = (dsv4_st_meta_t){"instance", "00112233445566778899aabbccddeeff"};
  if (make_dump_gap_after >= 0 && (uint32_t)make_dump_gap_after + 1 < n)
    snprintf(range, sizeof(range), "%u-%u,%u-%u", first, dump_layer(first, make_dump_gap_after),
             dump_layer(first, make_dump_gap_after + 1), dump_layer(first, n - 1));
  else
    snprintf(range, sizeof(range), "%u-%u", first, first + n - 1);
  meta[nm++] = (dsv4_st_meta_t){"layers", range};
  if (extra_key)
    meta[nm++] = (dsv4_st_meta_t){extra_key, extra_value};
  for (uint32_t i = 0; i < n; i++) {
    uint32_t l = dump_layer(first, i);
    size_t rb = t[i] * RB, pb = t[i] * 8;
    uint8_t *rec = malloc(rb + pb + 1);
    assert_non_null(rec);
    uint8_t *pos = rec + rb;
    for (size_t k = 0; k < rb; k++)
      rec[k] = (uint8_t)(k * 31 + l * 7 + 1);
    /* The digest input: [LE64 position || record] per record. */
    uint8_t *cat = malloc(t[i] * (8 + RB) + 1);
    assert_non_null(cat);
    for (uint64_t r = 0; r < t[i]; r++) {
      uint64_t p = (uint64_t)(p_first[i] + (int64_t)r);
      for (int b = 0; b < 8; b++)
        pos[8 * r + b] = cat[r * (8 + RB) + b] = (uint8_t)(p >> (8 * b));
      memcpy(cat + r * (8 + RB) + 8, rec + r * RB, RB);
    }
    char hex[17];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)XXH3_64bits(cat, t[i] * (8 + RB)));
    free(cat);
    snprintf(keys[i][0], 32, "digest.%u", l);
    snprintf(vals[i][0], 48, "%s", hex);
    snprintf(keys[i][1], 32, "positions.%u", l);
    if (t[i])
      snprintf(vals[i][1], 48, "%lld-%lld", (long long)p_first[i],
               (long long)(p_first[i] + (int64_t)t[i] - 1));
    else
      vals[i][1][0] = '\0';
    meta[nm++] = (dsv4_st_meta_t){keys[i][0], vals[i][0]};
    meta[nm++] = (dsv4_st_meta_t){keys[i][1], vals[i][1]};
    static char names[16][2][32];
    snprintf(names[i][0], 32, "layers.%u.records", l);
    snprintf(names[i][1], 32, "layers.%u.positions", l);
    desc[nd] = (dsv4_st_desc_t){names[i][0], DSV4_ST_U8, 2, {(int64_t)t[i], RB}, rb};
    data[nd++] = rec;
    desc[nd] = (dsv4_st_desc_t){names[i][1], DSV4_ST_I64, 1, {(int64_t)t[i]}, pb};
    data[nd++] = pos;
  }
  if (reverse)
    for (size_t i = 0; i < nd / 2; i++) {
      dsv4_st_desc_t dt = desc[i];
      desc[i] = desc[nd - 1 - i];
      desc[nd - 1 - i] = dt;
      uint8_t *p = data[i];
      data[i] = data[nd - 1 - i];
      data[nd - 1 - i] = p;
    }
  uint8_t *hdr;
  size_t hlen, dlen;
  assert_int_equal(dsv4_st_build_header(desc, nd, meta, nm, &hdr, &hlen, &dlen), 0);
  blob_t b = {malloc(hlen + dlen + 1), hlen + dlen};
  assert_non_null(b.buf);
  memcpy(b.buf, hdr, hlen);
  size_t off = hlen;
  for (size_t i = 0; i < nd; i++) {
    memcpy(b.buf + off, data[i], desc[i].nbytes);
    off += desc[i].nbytes;
  }
  for (size_t i = 0; i < nd; i++) {
    int is_rec = strstr(desc[i].name, ".records") != NULL;
    if (is_rec)
      free(data[i]); /* positions live in the same allocation */
  }
  free(hdr);
  return b;
}

static const uint64_t T3[] = {70, 0, 5};
static const int64_t P3[] = {0, 0, 123};

static blob_t good_dump(void) {
  return make_dump(2, 3, T3, P3, 0, NULL, NULL);
}

static int verify_buf(const blob_t *b, dsv4_ctl_verify_t *v) {
  return dsv4_ctl_verify_buffer(b->buf, b->len, v);
}

static void test_verify_good(void **state) {
  (void)state;
  blob_t b = good_dump();
  dsv4_ctl_verify_t v;
  assert_int_equal(verify_buf(&b, &v), 0);
  assert_int_equal(v.n_layers, 3);
  assert_true(dsv4_ctl_verify_all_ok(&v));
  assert_int_equal(v.layers[0].layer, 2);
  assert_int_equal(v.layers[0].records, 70);
  assert_int_equal(v.layers[0].first, 0);
  assert_int_equal(v.layers[0].last, 69);
  assert_int_equal(v.layers[1].records, 0);
  /* The digest of an empty list is XXH3 of zero bytes. */
  assert_string_equal(v.layers[1].computed, "2d06800538d394c2");
  assert_int_equal(v.layers[2].first, 123);
  assert_int_equal(v.layers[2].last, 127);
  assert_string_equal(v.seq, "a");
  assert_string_equal(v.instance, "00112233445566778899aabbccddeeff");

  capture_t c;
  cap_open(&c);
  dsv4_ctl_verify_print(c.f, "d.st", &v, 0);
  char *s = cap_close(&c);
  char want[1024];
  snprintf(want, sizeof(want),
           "d.st: %zu bytes, seq a, p0 0, instance 00112233445566778899aabbccddeeff\n"
           "LAYER  RECORDS  POSITIONS          EXPECTED          COMPUTED          OK\n"
           "2           70  0-69               %s  %s  ok\n"
           "3            0  -                  2d06800538d394c2  2d06800538d394c2  ok\n"
           "4            5  123-127            %s  %s  ok\n"
           "all 3 layers match\n",
           b.len, v.layers[0].expected, v.layers[0].expected, v.layers[2].expected,
           v.layers[2].expected);
  assert_string_equal(s, want);
  free(s);

  cap_open(&c);
  dsv4_ctl_verify_print(c.f, "d.st", &v, 1);
  s = cap_close(&c);
  json_t *j = doc_of(s);
  assert_true(json_is_true(json_object_get(j, "ok")));
  json_t *l1 = json_array_get(json_object_get(j, "layers"), 1);
  assert_int_equal(json_integer_value(json_object_get(l1, "layer")), 3);
  assert_true(json_is_null(json_object_get(l1, "first")));
  assert_string_equal(json_string_value(json_object_get(l1, "computed")), "2d06800538d394c2");
  json_decref(j);
  free(s);
  dsv4_ctl_verify_free(&v);

  /* The same file written with the tensors in the other order verifies too. */
  free(b.buf);
  b = make_dump(2, 3, T3, P3, 1, NULL, NULL);
  assert_int_equal(verify_buf(&b, &v), 0);
  assert_true(dsv4_ctl_verify_all_ok(&v));
  dsv4_ctl_verify_free(&v);
  free(b.buf);
}

/* Offset of the data section (where the first tensor starts). */
static size_t data_start(const blob_t *b) {
  uint64_t h = 0;
  for (int i = 7; i >= 0; i--)
    h = (h << 8) | b->buf[i];
  return 8 + (size_t)h;
}

static void test_verify_mismatch(void **state) {
  (void)state;
  blob_t b = good_dump();
  size_t d0 = data_start(&b);
  dsv4_ctl_verify_t v;
  /* One bit of one record of layer 2: only that layer fails. */
  b.buf[d0 + 584 * 33 + 100] ^= 0x01;
  assert_int_equal(verify_buf(&b, &v), 0);
  assert_false(dsv4_ctl_verify_all_ok(&v));
  assert_false(v.layers[0].ok);
  assert_string_not_equal(v.layers[0].expected, v.layers[0].computed);
  assert_true(v.layers[1].ok);
  assert_true(v.layers[2].ok);
  capture_t c;
  cap_open(&c);
  dsv4_ctl_verify_print(c.f, "d.st", &v, 0);
  char *s = cap_close(&c);
  assert_non_null(strstr(s, "  MISMATCH\n"));
  assert_non_null(strstr(s, "1 of 3 layers do not match\n"));
  free(s);
  dsv4_ctl_verify_free(&v);
  b.buf[d0 + 584 * 33 + 100] ^= 0x01;

  /* A position changed: its digest input changes, and the range is no longer consecutive. */
  size_t pos0 = d0 + 70 * 584;
  b.buf[pos0 + 8 * 10] ^= 0x40;
  assert_int_equal(verify_buf(&b, &v), 0);
  assert_false(v.layers[0].ok);
  assert_non_null(strstr(v.layers[0].problem, "not consecutive"));
  dsv4_ctl_verify_free(&v);
  b.buf[pos0 + 8 * 10] ^= 0x40;
  free(b.buf);

  /* positions.{L} disagreeing with the tensor is a mismatch, not a format error. */
  b = make_dump(2, 3, T3, P3, 0, NULL, NULL);
  blob_t b2 = make_dump(0, 1, T3, P3, 0, "positions.9", "x"); /* out-of-range key: ignored */
  assert_int_equal(verify_buf(&b2, &v), 0);
  assert_true(dsv4_ctl_verify_all_ok(&v));
  dsv4_ctl_verify_free(&v);
  free(b2.buf);
  free(b.buf);
  static const uint64_t t1[] = {4};
  static const int64_t p1[] = {10};
  b = make_dump(0, 1, t1, p1, 0, NULL, NULL);
  /* Rewrite "positions.0":"10-13" as "10-14" in place (same length). */
  char *m = memmem(b.buf, b.len, "\"10-13\"", 7);
  assert_non_null(m);
  m[5] = '4';
  assert_int_equal(verify_buf(&b, &v), 0);
  assert_false(v.layers[0].ok);
  assert_string_equal(v.layers[0].expected, v.layers[0].computed);
  assert_non_null(strstr(v.layers[0].problem, "positions.0"));
  dsv4_ctl_verify_free(&v);
  free(b.buf);
}

static void expect_not_dump(const blob_t *b, const char *want) {
  dsv4_ctl_verify_t v;
  int rc = verify_buf(b, &v);
  if (rc != DSV4_EINVAL || !strstr(v.error, want))
    print_error("rc %d, error \"%s\", wanted \"%s\"\n", rc, v.error, want);
  assert_int_equal(rc, DSV4_EINVAL);
  assert_non_null(strstr(v.error, want));
  dsv4_ctl_verify_free(&v);
}

/* Replace the first occurrence of from by to (same length) in a blob's header. */
static void patch(blob_t *b, const char *from, const char *to) {
  assert_int_equal(strlen(from), strlen(to));
  char *m = memmem(b->buf, data_start(b), from, strlen(from));
  assert_non_null(m);
  memcpy(m, to, strlen(to));
}

/* A dump of a served set with gaps ("2-3,5-5", as the daemon writes it) verifies layer by layer; a
 * tensor of the gap layer is outside the metadata's layers. */
static void test_verify_gapped_layers(void **state) {
  (void)state;
  make_dump_gap_after = 1;
  blob_t b = good_dump();
  make_dump_gap_after = -1;
  assert_non_null(memmem(b.buf, data_start(&b), "\"2-3,5-5\"", 9));
  dsv4_ctl_verify_t v;
  assert_int_equal(verify_buf(&b, &v), 0);
  assert_int_equal(v.n_layers, 3);
  assert_true(dsv4_ctl_verify_all_ok(&v));
  assert_int_equal(v.layers[0].layer, 2);
  assert_int_equal(v.layers[1].layer, 3);
  assert_int_equal(v.layers[2].layer, 5);
  assert_int_equal(v.layers[2].first, 123);
  dsv4_ctl_verify_free(&v);
  patch(&b, "\"layers.5.records\"", "\"layers.4.records\"");
  expect_not_dump(&b, "outside the layers 2-3,5-5");
  free(b.buf);
}

static void test_verify_bad_files(void **state) {
  (void)state;
  blob_t b = good_dump();
  blob_t cut = {b.buf, b.len - 1};
  expect_not_dump(&cut, "past the data section");
  cut.len = 5;
  expect_not_dump(&cut, "shorter than the 8-byte");
  cut.len = 0;
  expect_not_dump(&cut, "shorter than the 8-byte");
  cut.len = 100;
  expect_not_dump(&cut, "past the end");
  free(b.buf);

  struct {
    const char *from, *to, *want;
  } cases[] = {
      {"\"fp8_ds_mla\"", "\"fp8_ds_mlb\"", "layout is \"fp8_ds_mlb\""},
      {"\"layout\"", "\"layouT\"", "no \"layout\""},
      {"\"layers\"", "\"layerz\"", "no \"layers\""},
      {"\"2-4\"", "\"2-3\"", "\"layers.4.records\" is outside the layers 2-3"},
      {"\"2-4\"", "\"4-2\"", "is not a list of increasing runs"},
      {"\"2-4\"", "\"4,3\"", "is not a list of increasing runs"},
      {"\"2-4\"", "\",24\"", "is not a list of increasing runs"},
      {"\"2-4\"", "\"24,\"", "is not a list of increasing runs"},
      {"\"2-4\"", "\"2,2\"", "is not a list of increasing runs"},
      {"\"digest.3\"", "\"digest.9\"", "digest.9 names no layer"},
      {"\"digest.3\"", "\"Digest.3\"", "metadata has no digest.3"},
      {"\"layers.3.records\"", "\"layers.7.records\"", "outside the layers 2-4"},
      {"\"layers.3.records\"", "\"layers.3.recordz\"", "is not layers.{L}.records"},
      {"\"layers.3.records\"", "\"layers.03.record\"", "is not layers.{L}.records"},
      {"\"UE8M0\"", "\"UE8M1\"", "scale is \"UE8M1\""},
      {"\"584\"", "\"585\"", "record_bytes is \"585\""},
      {"\"128\"", "\"256\"", "window is \"256\""},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    b = good_dump();
    patch(&b, cases[i].from, cases[i].to);
    expect_not_dump(&b, cases[i].want);
    free(b.buf);
  }

  /* A digest that is not 16 lowercase hex digits. */
  b = good_dump();
  dsv4_ctl_verify_t v;
  assert_int_equal(verify_buf(&b, &v), 0);
  char from[24], to[24];
  snprintf(from, sizeof(from), "\"%s\"", v.layers[0].expected);
  snprintf(to, sizeof(to), "\"%.15sX\"", v.layers[0].expected);
  dsv4_ctl_verify_free(&v);
  patch(&b, from, to);
  expect_not_dump(&b, "is not 16 lowercase hex");
  free(b.buf);

  /* Wrong dtypes and shapes: a records tensor as I64, a positions tensor as U8 of the same size. */
  static const uint64_t t1[] = {1};
  static const int64_t p1[] = {0};
  b = make_dump(0, 1, t1, p1, 0, NULL, NULL);
  patch(&b, "\"dtype\":\"U8\",\"shape\":[1,584]", "\"dtype\":\"U8\",\"shape\":[2,292]");
  expect_not_dump(&b, "must be U8 [T, 584]");
  free(b.buf);
  b = make_dump(0, 1, t1, p1, 0, NULL, NULL);
  patch(&b, "\"dtype\":\"I64\",\"shape\":[1]", "\"dtype\":\"I32\",\"shape\":[2]");
  expect_not_dump(&b, "must be I64 [T]");
  free(b.buf);
  /* Records and positions of different lengths. */
  dsv4_st_desc_t desc[2] = {{"layers.0.records", DSV4_ST_U8, 2, {1, RB}, RB},
                            {"layers.0.positions", DSV4_ST_I64, 1, {2}, 16}};
  dsv4_st_meta_t meta[3] = {
      {"layout", "fp8_ds_mla"}, {"layers", "0"}, {"digest.0", "0000000000000000"}};
  uint8_t *hdr;
  size_t hlen, dlen;
  assert_int_equal(dsv4_st_build_header(desc, 2, meta, 3, &hdr, &hlen, &dlen), 0);
  b.len = hlen + dlen;
  b.buf = calloc(1, b.len);
  assert_non_null(b.buf);
  memcpy(b.buf, hdr, hlen);
  free(hdr);
  expect_not_dump(&b, "layer 0 has 1 records but 2 positions");
  free(b.buf);
}

static char *write_temp(const blob_t *b) {
  char *path = strdup("/tmp/dsv4ctl-test-XXXXXX");
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, b->buf, b->len), (ssize_t)b->len);
  close(fd);
  return path;
}

static int run_cmd(char **out, char **err, ...) {
  char *argv[32];
  va_list ap;
  va_start(ap, err);
  int argc = make_argv(argv, ap);
  va_end(ap);
  dsv4_ctl_args_t a;
  char msg[DSV4_CTL_ERR_LEN];
  int rc = dsv4_ctl_args_parse(argc, argv, NULL, NULL, &a, msg, sizeof(msg));
  if (rc != 0) {
    print_error("args: %s\n", msg);
    fail();
  }
  capture_t o, e;
  cap_open(&o);
  cap_open(&e);
  rc = dsv4_ctl_run(&a, o.f, e.f, 0);
  *out = cap_close(&o);
  *err = cap_close(&e);
  return rc;
}

static void test_verify_exit_codes(void **state) {
  (void)state;
  blob_t b = good_dump();
  char *path = write_temp(&b);
  char *out, *err;
  assert_int_equal(run_cmd(&out, &err, "verify", path, NULL), 0);
  assert_non_null(strstr(out, "all 3 layers match"));
  assert_string_equal(err, "");
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "verify", "--json", path, NULL), 0);
  json_t *j = doc_of(out);
  assert_true(json_is_true(json_object_get(j, "ok")));
  json_decref(j);
  free(out);
  free(err);
  unlink(path);
  free(path);

  /* A flipped byte: exit 1. */
  b.buf[data_start(&b) + 7] ^= 0x80;
  path = write_temp(&b);
  assert_int_equal(run_cmd(&out, &err, "verify", path, NULL), 1);
  assert_non_null(strstr(out, "MISMATCH"));
  free(out);
  free(err);
  unlink(path);
  free(path);
  b.buf[data_start(&b) + 7] ^= 0x80;

  /* Truncated, a bad header, a missing file: exit 2 with the reason on stderr. */
  blob_t cut = {b.buf, b.len - 100};
  path = write_temp(&cut);
  assert_int_equal(run_cmd(&out, &err, "verify", path, NULL), 2);
  assert_string_equal(out, "");
  assert_non_null(strstr(err, "not a safetensors file"));
  free(out);
  free(err);
  unlink(path);
  free(path);
  b.buf[9] = '[';
  path = write_temp(&b);
  assert_int_equal(run_cmd(&out, &err, "verify", path, NULL), 2);
  assert_non_null(strstr(err, "header is not valid JSON"));
  free(out);
  free(err);
  unlink(path);
  free(path);
  assert_int_equal(run_cmd(&out, &err, "verify", "/nonexistent/dump.st", NULL), 2);
  assert_non_null(strstr(err, "No such file"));
  free(out);
  free(err);
  free(b.buf);
}

/* ---- the client against a scripted server -------------------------------------------------- */

typedef struct {
  const char *bytes; /* what to answer (NULL: accept, read the request, answer nothing) */
  size_t len;
  int hold_ms; /* keep the connection open this long after writing (for timeouts) */
} script_t;

static struct {
  int lfd;
  int port;
  pthread_t th;
  script_t script[4];
  int n;
  char request[4096]; /* the last request's head */
  char body[4096];    /* and its body (up to Content-Length, at most this much) */
  size_t body_len;
} srv;

static void *serve(void *arg) {
  (void)arg;
  for (int i = 0; i < srv.n; i++) {
    int fd = accept(srv.lfd, NULL, NULL);
    if (fd < 0)
      return NULL;
    size_t got = 0;
    while (got < sizeof(srv.request) - 1) {
      ssize_t n = read(fd, srv.request + got, sizeof(srv.request) - 1 - got);
      if (n <= 0)
        break;
      got += (size_t)n;
      srv.request[got] = '\0';
      if (strstr(srv.request, "\r\n\r\n"))
        break;
    }
    /* A body announced by Content-Length is read whole before the answer, as the daemon does. */
    char *end = strstr(srv.request, "\r\n\r\n"), *cl = strstr(srv.request, "Content-Length: ");
    srv.body_len = 0;
    if (end && cl && cl < end) {
      size_t want = (size_t)strtoul(cl + 16, NULL, 10),
             have = got - (size_t)(end + 4 - srv.request);
      want = want < sizeof(srv.body) ? want : sizeof(srv.body);
      memcpy(srv.body, end + 4, have < want ? have : want);
      srv.body_len = have < want ? have : want;
      while (srv.body_len < want) {
        ssize_t n = read(fd, srv.body + srv.body_len, want - srv.body_len);
        if (n <= 0)
          break;
        srv.body_len += (size_t)n;
      }
    }
    const script_t *s = &srv.script[i];
    if (s->bytes) {
      size_t off = 0;
      while (off < s->len) {
        ssize_t n = send(fd, s->bytes + off, s->len - off, MSG_NOSIGNAL);
        if (n <= 0)
          break;
        off += (size_t)n;
      }
    }
    if (s->hold_ms)
      usleep((useconds_t)s->hold_ms * 1000);
    close(fd);
  }
  return NULL;
}

/* Start serving the scripts, one per connection, in order. */
static void serve_start(int n, const script_t *scripts) {
  memset(&srv, 0, sizeof(srv));
  srv.lfd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(srv.lfd >= 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  assert_int_equal(bind(srv.lfd, (struct sockaddr *)&a, sizeof(a)), 0);
  assert_int_equal(listen(srv.lfd, 8), 0);
  socklen_t sl = sizeof(a);
  assert_int_equal(getsockname(srv.lfd, (struct sockaddr *)&a, &sl), 0);
  srv.port = ntohs(a.sin_port);
  srv.n = n;
  memcpy(srv.script, scripts, (size_t)n * sizeof(*scripts));
  assert_int_equal(pthread_create(&srv.th, NULL, serve, NULL), 0);
}

static void serve_stop(void) {
  pthread_join(srv.th, NULL);
  close(srv.lfd);
}

static const char *admin_url(void) {
  static char u[64];
  snprintf(u, sizeof(u), "http://127.0.0.1:%d", srv.port);
  return u;
}

/* A JSON answer with its Content-Length. */
static char *json_answer(const char *status, const char *headers, const char *body) {
  char *r = NULL;
  assert_true(asprintf(&r,
                       "HTTP/1.1 %s\r\nContent-Type: application/json\r\n%sContent-Length: "
                       "%zu\r\n\r\n%s",
                       status, headers, strlen(body), body) > 0);
  return r;
}

#define CACHE_JSON                                                                                 \
  "{\"instance\":\"00112233445566778899aabbccddeeff\",\"version\":\"0.1.0\",\"backend\":\"cpu\","  \
  "\"served_layers\":[0,1],\"heads\":8}"

static void test_client_json_and_errors(void **state) {
  (void)state;
  char ok[512];
  snprintf(ok, sizeof(ok),
           "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDsv4d-Instance: "
           "00112233445566778899aabbccddeeff\r\nContent-Length: %zu\r\n\r\n%s",
           strlen(CACHE_JSON), CACHE_JSON);
  /* The same document chunked, split at odd places. */
  char chunked[1024];
  size_t h = strlen(CACHE_JSON) / 3;
  snprintf(chunked, sizeof(chunked),
           "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
           "\r\n%zx\r\n%.*s\r\n%zx\r\n%s\r\n0\r\n\r\n",
           h, (int)h, CACHE_JSON, strlen(CACHE_JSON) - h, &CACHE_JSON[h]);
  char *e404 = json_answer("404 Not Found", "",
                           "{\"error\":{\"code\":\"unknown_sequence\",\"message\":\"no "
                           "sequence a\",\"instance\":\"0011\"}}");
  char *e429 = json_answer("429 Too Many Requests", "Retry-After: 1\r\n",
                           "{\"error\":{\"code\":\"dump_in_progress\",\"message\":\"one at a "
                           "time\"}}");
  script_t s[4] = {{ok, strlen(ok), 0},
                   {chunked, strlen(chunked), 0},
                   {e404, strlen(e404), 0},
                   {e429, strlen(e429), 0}};
  serve_start(4, s);
  char *out, *err;
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "status", NULL), 0);
  assert_non_null(strstr(out, "layers           0-1 (2 served)\n"));
  assert_non_null(strstr(srv.request, "GET /admin/v1/cache HTTP/1.1\r\n"));
  assert_null(strstr(srv.request, "Authorization"));
  free(out);
  free(err);

  /* --json prints the document as it came (compact), whatever the transfer coding. */
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "--json", "status", NULL), 0);
  json_t *got = doc_of(out), *want = doc_of(CACHE_JSON);
  assert_true(json_equal(got, want));
  json_decref(got);
  json_decref(want);
  free(out);
  free(err);

  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "--json", "seq", "a", NULL), 1);
  assert_non_null(strstr(srv.request, "GET /admin/v1/sequences/a HTTP/1.1\r\n"));
  assert_string_equal(err, "dsv4ctl: GET /admin/v1/sequences/a: 404 unknown_sequence: no "
                           "sequence a\n");
  got = doc_of(out);
  assert_string_equal(json_string_value(json_object_get(json_object_get(got, "error"), "code")),
                      "unknown_sequence");
  json_decref(got);
  free(out);
  free(err);

  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "dump", "--seq", "a", "-o",
                           "/tmp/dsv4ctl-never-written", NULL),
                   1);
  assert_non_null(strstr(err, "429 dump_in_progress: one at a time (retry after 1 s)"));
  assert_int_equal(access("/tmp/dsv4ctl-never-written", F_OK), -1);
  assert_int_equal(access("/tmp/dsv4ctl-never-written.part", F_OK), -1);
  free(out);
  free(err);
  serve_stop();
  free(e404);
  free(e429);
}

static void test_client_targets_and_token(void **state) {
  (void)state;
  const char *ok = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}";
  script_t s[4] = {
      {ok, strlen(ok), 0}, {ok, strlen(ok), 0}, {ok, strlen(ok), 0}, {ok, strlen(ok), 0}};
  serve_start(4, s);
  char tok[] = "/tmp/dsv4ctl-token-XXXXXX";
  int fd = mkstemp(tok);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "s3cr3t-T0ken\n", 13), 13);
  close(fd);
  char url[96];
  snprintf(url, sizeof(url), "http://127.0.0.1:%d/prefix/", srv.port);
  char *out, *err;
  assert_int_equal(run_cmd(&out, &err, "--admin", url, "--token-file", tok, "token", "q.1", "77",
                           "--layer", "3", NULL),
                   0);
  assert_non_null(
      strstr(srv.request, "GET /prefix/admin/v1/sequences/q.1/tokens/77?layer=3 HTTP/1.1\r\n"));
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "--admin", url, "--token-file", tok, "entry", "q.1", "19",
                           "--layer", "2", NULL),
                   0);
  assert_non_null(
      strstr(srv.request, "GET /prefix/admin/v1/sequences/q.1/entries/19?layer=2 HTTP/1.1\r\n"));
  assert_non_null(strstr(srv.request, "\r\nAuthorization: Bearer s3cr3t-T0ken\r\n"));
  char host[64];
  snprintf(host, sizeof(host), "\r\nHost: 127.0.0.1:%d\r\n", srv.port);
  assert_non_null(strstr(srv.request, host));
  free(out);
  free(err);
  assert_int_equal(
      run_cmd(&out, &err, "--admin", url, "checksum", "--layer", "2", "--seq", "z", NULL), 0);
  assert_non_null(strstr(srv.request, "GET /prefix/admin/v1/checksums?layer=2&seq=z HTTP/1.1"));
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "--admin", url, "--json", "seq", NULL), 0);
  assert_non_null(strstr(srv.request, "GET /prefix/admin/v1/sequences HTTP/1.1"));
  assert_string_equal(out, "{}\n");
  free(out);
  free(err);
  serve_stop();

  /* Token files that would break the request, or hold nothing, are refused before connecting. */
  fd = open(tok, O_WRONLY | O_TRUNC);
  assert_int_equal(write(fd, "two\nlines\n", 10), 10);
  close(fd);
  assert_int_equal(run_cmd(&out, &err, "--admin", url, "--token-file", tok, "status", NULL), 2);
  assert_non_null(strstr(err, "control character at byte 3"));
  free(out);
  free(err);
  fd = open(tok, O_WRONLY | O_TRUNC);
  assert_int_equal(write(fd, " \n", 2), 2);
  close(fd);
  assert_int_equal(run_cmd(&out, &err, "--admin", url, "--token-file", tok, "status", NULL), 2);
  assert_non_null(strstr(err, "is empty"));
  free(out);
  free(err);
  unlink(tok);
  assert_int_equal(run_cmd(&out, &err, "--admin", url, "--token-file", tok, "status", NULL), 2);
  assert_non_null(strstr(err, "No such file"));
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "--admin", "https://h", "status", NULL), 2);
  assert_non_null(strstr(err, "https is not supported"));
  free(out);
  free(err);
}

static void test_client_restore(void **state) {
  (void)state;
  char *ok = json_answer("201 Created", "",
                         "{\"instance\":\"0011\",\"seq\":\"r.1\",\"p0\":5,\"next\":{\"0\":308,"
                         "\"1\":306},\"blocks\":3,\"replaced\":false,\"digests\":{\"0\":"
                         "\"00000000000000aa\",\"1\":\"00000000000000bb\"}}");
  char *bad = json_answer("400 Bad Request", "",
                          "{\"error\":{\"code\":\"digest_mismatch\",\"message\":\"layer 1: the "
                          "records hash to 1, the dump says 2\",\"layer\":1}}");
  script_t s[2] = {{ok, strlen(ok), 0}, {bad, strlen(bad), 0}};
  serve_start(2, s);
  blob_t b = {(uint8_t *)strdup("not really a dump, the daemon checks it"), 39};
  char *path = write_temp(&b);
  char *out, *err;
  assert_int_equal(
      run_cmd(&out, &err, "--admin", admin_url(), "restore", "--seq", "r.1", path, NULL), 0);
  assert_non_null(strstr(srv.request, "PUT /admin/v1/sequences/r.1 HTTP/1.1\r\n"));
  assert_non_null(strstr(srv.request, "\r\nContent-Length: 39\r\n"));
  assert_int_equal(srv.body_len, 39);
  assert_memory_equal(srv.body, b.buf, 39);
  assert_non_null(strstr(out, "restored r.1: p0 5, 3 blocks\n"));
  assert_non_null(strstr(out, "1               306  00000000000000bb\n"));
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "restore", "--seq", "r.1", path,
                           "--replace", NULL),
                   1);
  assert_non_null(strstr(srv.request, "PUT /admin/v1/sequences/r.1?replace=1 HTTP/1.1\r\n"));
  assert_string_equal(err, "dsv4ctl: PUT /admin/v1/sequences/r.1?replace=1: 400 digest_mismatch: "
                           "layer 1: the records hash to 1, the dump says 2\n");
  free(out);
  free(err);
  serve_stop();
  /* A file that is not there is refused before anything is sent. */
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "restore", "--seq", "r.1",
                           "/nonexistent/r.st", NULL),
                   2);
  assert_non_null(strstr(err, "No such file"));
  free(out);
  free(err);
  unlink(path);
  free(path);
  free(b.buf);
  free(ok);
  free(bad);
}

static void test_client_failures(void **state) {
  (void)state;
  /* Nothing listening: exit 2 naming the address. */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
  socklen_t sl = sizeof(a);
  getsockname(fd, (struct sockaddr *)&a, &sl);
  char url[64];
  snprintf(url, sizeof(url), "http://127.0.0.1:%d", ntohs(a.sin_port));
  close(fd);
  char *out, *err;
  assert_int_equal(run_cmd(&out, &err, "--admin", url, "status", NULL), 2);
  assert_non_null(strstr(err, "cannot connect to 127.0.0.1:"));
  assert_non_null(strstr(err, "Connection refused"));
  free(out);
  free(err);

  /* A body cut short, garbage instead of HTTP, a 200 that is not JSON, and silence. */
  const char *cut = "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"a\":1";
  const char *junk = "SSH-2.0-OpenSSH_9.2\r\n";
  const char *html = "HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n<html>";
  script_t s[4] = {
      {cut, strlen(cut), 0}, {junk, strlen(junk), 0}, {html, strlen(html), 0}, {NULL, 0, 1500}};
  serve_start(4, s);
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "status", NULL), 2);
  assert_non_null(strstr(err, "connection closed before the answer was complete (6 of 100"));
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "status", NULL), 2);
  assert_non_null(strstr(err, "bad HTTP answer"));
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "status", NULL), 2);
  assert_non_null(strstr(err, "not a JSON object"));
  free(out);
  free(err);
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "--timeout", "1", "status", NULL),
                   2);
  assert_non_null(strstr(err, "no data from 127.0.0.1:"));
  free(out);
  free(err);
  serve_stop();
}

/* A dump response: the head, then the file. */
static char *dump_response(const blob_t *b, size_t *len, size_t announce) {
  char head[256];
  int hn = snprintf(head, sizeof(head),
                    "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    "Content-Length: %zu\r\n\r\n",
                    announce);
  char *r = malloc((size_t)hn + b->len);
  assert_non_null(r);
  memcpy(r, head, (size_t)hn);
  memcpy(r + hn, b->buf, b->len);
  *len = (size_t)hn + b->len;
  return r;
}

static void test_dump(void **state) {
  (void)state;
  static const uint64_t t[] = {300, 0};
  static const int64_t p[] = {1000, 0};
  blob_t good = make_dump(0, 2, t, p, 0, NULL, NULL);
  blob_t bad = make_dump(0, 2, t, p, 0, NULL, NULL);
  bad.buf[data_start(&bad) + 584 * 299] ^= 1;
  size_t gl, bl, cl;
  char *gr = dump_response(&good, &gl, good.len);
  char *br = dump_response(&bad, &bl, bad.len);
  char *cr = dump_response(&good, &cl, good.len + 10); /* announces more than it sends */
  /* No Content-Length (the body ends when the connection closes), and cut short. */
  static const char nohead[] = "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                               "Connection: close\r\n\r\n";
  size_t nl = sizeof(nohead) - 1 + good.len / 2;
  char *nr = malloc(nl);
  assert_non_null(nr);
  memcpy(nr, nohead, sizeof(nohead) - 1);
  memcpy(nr + sizeof(nohead) - 1, good.buf, good.len / 2);
  script_t s[4] = {{gr, gl, 0}, {br, bl, 0}, {cr, cl, 0}, {nr, nl, 0}};
  serve_start(4, s);
  char dir[] = "/tmp/dsv4ctl-dump-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char file[128], part[140];
  snprintf(file, sizeof(file), "%s/a.safetensors", dir);
  snprintf(part, sizeof(part), "%s.part", file);

  char *out, *err;
  assert_int_equal(run_cmd(&out, &err, "--admin", admin_url(), "dump", "--seq", "a", "--layers",
                           "0-1", "-o", file, "--progress", NULL),
                   0);
  assert_non_null(strstr(srv.request, "GET /admin/v1/dump?seq=a&layers=0-1 HTTP/1.1\r\n"));
  assert_non_null(strstr(out, "all 2 layers match"));
  /* Not a terminal: whole progress lines, the last one complete. */
  char want[96];
  snprintf(want, sizeof(want), "(100%%)");
  assert_non_null(strstr(err, want));
  assert_true(err[strlen(err) - 1] == '\n');
  free(out);
  free(err);
  struct stat sb;
  assert_int_equal(stat(file, &sb), 0);
  assert_int_equal((size_t)sb.st_size, good.len);
  assert_int_equal(sb.st_mode & 0777, 0600);
  assert_int_equal(access(part, F_OK), -1);
  unlink(file);

  /* The bytes arrive but one record does not match its digest: kept for inspection, exit 1. */
  assert_int_equal(
      run_cmd(&out, &err, "--admin", admin_url(), "--json", "dump", "--seq", "a", "-o", file, NULL),
      1);
  json_t *j = doc_of(out);
  assert_true(json_is_false(json_object_get(j, "ok")));
  assert_true(
      json_is_false(json_object_get(json_array_get(json_object_get(j, "layers"), 0), "ok")));
  assert_true(json_is_true(json_object_get(json_array_get(json_object_get(j, "layers"), 1), "ok")));
  json_decref(j);
  assert_string_equal(err, "");
  free(out);
  free(err);
  assert_int_equal(access(file, F_OK), 0);
  unlink(file);

  /* Cut short: neither the file nor the part file remains. */
  assert_int_equal(
      run_cmd(&out, &err, "--admin", admin_url(), "dump", "--seq", "a", "-o", file, NULL), 2);
  assert_non_null(strstr(err, "connection closed before the answer was complete"));
  assert_int_equal(access(file, F_OK), -1);
  assert_int_equal(access(part, F_OK), -1);
  free(out);
  free(err);

  /* Without a Content-Length a cut dump cannot be told from a whole one: refused, no file. */
  assert_int_equal(
      run_cmd(&out, &err, "--admin", admin_url(), "dump", "--seq", "a", "-o", file, NULL), 2);
  assert_non_null(strstr(err, "no Content-Length"));
  assert_int_equal(access(file, F_OK), -1);
  assert_int_equal(access(part, F_OK), -1);
  free(out);
  free(err);
  serve_stop();
  rmdir(dir);
  free(nr);
  free(gr);
  free(br);
  free(cr);
  free(good.buf);
  free(bad.buf);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_url),
      cmocka_unit_test(test_args_defaults_and_env),
      cmocka_unit_test(test_args_commands),
      cmocka_unit_test(test_args_errors),
      cmocka_unit_test(test_table),
      cmocka_unit_test(test_views),
      cmocka_unit_test(test_print_entry),
      cmocka_unit_test(test_verify_good),
      cmocka_unit_test(test_verify_mismatch),
      cmocka_unit_test(test_verify_gapped_layers),
      cmocka_unit_test(test_verify_bad_files),
      cmocka_unit_test(test_verify_exit_codes),
      cmocka_unit_test(test_client_json_and_errors),
      cmocka_unit_test(test_client_targets_and_token),
      cmocka_unit_test(test_client_restore),
      cmocka_unit_test(test_client_failures),
      cmocka_unit_test(test_dump),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
