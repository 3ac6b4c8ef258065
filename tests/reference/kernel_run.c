/*
 * kernel_run: drives one backend's qkv_insert (or map_slots) from raw files, so that the numpy
 * model in dsv4_ref.py can check the C kernels byte for byte.
 *
 * Usage: kernel_run <dir>
 *
 * <dir>/params.txt holds key=value lines: mode (insert|map, default insert), backend (default cpu),
 * n_tokens, heads, block_size, n_blocks, rope (plain|yarn), kv_norm (prenormed|fused), write_kv
 * (0|1), threads, and for mode=map n_segments and n_block_table.
 *
 * mode=insert reads q.bin [N,H,512] u16, kv.bin [N,512] u16, positions.bin [N] i64, slots.bin [N]
 * i64, kv_norm_weight.bin [512] f32 (kv_norm=fused) and optionally cache_in.bin (the initial cache,
 * else zeros); it writes q_out.bin and cache.bin.
 *
 * mode=map reads positions.bin [N] i64, tok_seg.bin [N] i32, seg_first_lb.bin [S] i64,
 * seg_bt_off.bin [S] u32, seg_bt_len.bin [S] u32 and block_table.bin [B] i32; it writes the
 * return code of map_slots to rc.txt and, when it is 0, the slots to slots_out.bin.
 *
 * mode=attn (SPEC §7) takes n_tokens, heads, n_segments, n_block_table, block_size, n_blocks, rope,
 * sink (0|1) and lse (0|1); it reads q.bin [N,H,512] u16 (the rotated queries), positions.bin,
 * tok_seg.bin, seg_p0.bin [S] i64, seg_first_lb.bin, seg_bt_off.bin, seg_bt_len.bin,
 * block_table.bin, cache_in.bin and, with sink=1, sink.bin [H] f32; it writes the return code of
 * the attention launch to rc.txt and, when it is 0, out.bin [N,H,512] u16 and (lse=1) lse.bin
 * [N,H] f32.
 *
 * mode=attn with ratio (4|128) adds the compressed entries (SPEC §8.6): c_n_blocks,
 * n_c_block_table and c_sel_stride (0: every visible entry) in params.txt; c_cache_in.bin
 * [c_n_blocks * stride] u8, seg_c_first_lb.bin [S] i64, seg_cbt_off.bin [S] u32, seg_cbt_len.bin
 * [S] u32, c_block_table.bin i32 and, with c_sel_stride > 0, c_sel.bin [N, c_sel_stride] i32.
 *
 * All files are little-endian, which is the host order on every machine the daemon supports.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu-internal.h"
#include "dsv4-layout.h"
#include "rope.h"

#define MAX_PARAMS 32

typedef struct {
  char key[64];
  char val[192];
} param_t;

static param_t params[MAX_PARAMS];
static int n_params;

static int load_params(const char *dir) {
  char path[4096];
  char line[512];
  FILE *f;

  snprintf(path, sizeof path, "%s/params.txt", dir);
  f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "kernel_run: cannot open %s: %s\n", path, strerror(errno));
    return -1;
  }
  while (fgets(line, sizeof line, f)) {
    char *eq = strchr(line, '=');
    char *end;
    if (!eq || n_params == MAX_PARAMS)
      continue;
    *eq = '\0';
    end = eq + 1 + strcspn(eq + 1, "\r\n");
    *end = '\0';
    /* An over-long key or value is an error, not something to truncate into a different one. */
    if (strlen(line) >= sizeof params[0].key || strlen(eq + 1) >= sizeof params[0].val) {
      fprintf(stderr, "kernel_run: parameter line too long in %s\n", path);
      fclose(f);
      return -1;
    }
    memcpy(params[n_params].key, line, strlen(line) + 1);
    memcpy(params[n_params].val, eq + 1, strlen(eq + 1) + 1);
    n_params++;
  }
  fclose(f);
  return 0;
}

static const char *param_str(const char *key, const char *def) {
  for (int i = 0; i < n_params; i++)
    if (strcmp(params[i].key, key) == 0)
      return params[i].val;
  return def;
}

static long long param_int(const char *key, long long def) {
  const char *v = param_str(key, NULL);
  return v ? strtoll(v, NULL, 10) : def;
}

/*
 * Read exactly n bytes of <dir>/<name> into a fresh allocation. A missing optional file returns
 * NULL with *missing set, so the caller can tell absence from a short or unreadable file.
 */
static void *read_file(const char *dir, const char *name, size_t n, int optional, int *missing) {
  char path[4096];
  FILE *f;
  void *buf;

  if (missing)
    *missing = 0;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  f = fopen(path, "rb");
  if (!f) {
    if (optional && errno == ENOENT) {
      if (missing)
        *missing = 1;
      return NULL;
    }
    fprintf(stderr, "kernel_run: cannot open %s: %s\n", path, strerror(errno));
    return NULL;
  }
  buf = malloc(n ? n : 1);
  if (buf && n && fread(buf, 1, n, f) != n) {
    fprintf(stderr, "kernel_run: %s is shorter than %zu bytes\n", path, n);
    free(buf);
    buf = NULL;
  } else if (buf && fgetc(f) != EOF) {
    fprintf(stderr, "kernel_run: %s is longer than %zu bytes\n", path, n);
    free(buf);
    buf = NULL;
  }
  fclose(f);
  return buf;
}

static int write_file(const char *dir, const char *name, const void *buf, size_t n) {
  char path[4096];
  FILE *f;
  int ok;

  snprintf(path, sizeof path, "%s/%s", dir, name);
  f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "kernel_run: cannot create %s: %s\n", path, strerror(errno));
    return -1;
  }
  ok = fwrite(buf, 1, n, f) == n;
  ok = (fclose(f) == 0) && ok;
  if (!ok)
    fprintf(stderr, "kernel_run: short write to %s\n", path);
  return ok ? 0 : -1;
}

/* A device buffer holding a copy of host bytes (or zeros when src is NULL). */
static int dev_from_host(dsv4_backend_t *be, const void *src, size_t n, dsv4_devbuf_t *out) {
  int rc = be->ops->buf_alloc(be, n ? n : 1, out);
  if (rc == 0 && src && n)
    rc = be->ops->upload(be, out, 0, src, n);
  if (rc)
    fprintf(stderr, "kernel_run: device buffer of %zu bytes: %s\n", n, dsv4_strerror(rc));
  return rc;
}

static int run_insert(const char *dir, dsv4_backend_t *be) {
  const long long n = param_int("n_tokens", -1);
  const long long heads = param_int("heads", -1);
  const long long bs = param_int("block_size", 64);
  const long long n_blocks = param_int("n_blocks", -1);
  const char *rope_kind = param_str("rope", "plain");
  const char *kv_norm = param_str("kv_norm", "prenormed");
  const int write_kv = (int)param_int("write_kv", 1);
  const int fused = strcmp(kv_norm, "fused") == 0;
  size_t q_bytes, kv_bytes, tok_bytes, cache_bytes;
  uint16_t *q = NULL, *kv = NULL, *q_out = NULL;
  int64_t *pos = NULL, *slots = NULL;
  float *w = NULL;
  uint8_t *cache = NULL;
  dsv4_devbuf_t dq = {0}, dkv = {0}, dpos = {0}, dslots = {0}, dw = {0}, dqo = {0}, dcache = {0};
  dsv4_rope_table_t *table = NULL;
  float inv[DSV4_ROPE_PAIRS];
  int missing = 0, rc = -1;

  if (n < 1 || heads < 1 || heads > DSV4_MAX_HEADS || n_blocks < 1 || bs < DSV4_MIN_BLOCK_SIZE ||
      bs > DSV4_MAX_BLOCK_SIZE || (bs & (bs - 1)) != 0 ||
      (strcmp(rope_kind, "plain") != 0 && strcmp(rope_kind, "yarn") != 0) ||
      (!fused && strcmp(kv_norm, "prenormed") != 0)) {
    fprintf(stderr, "kernel_run: bad or missing parameters in %s/params.txt\n", dir);
    return -1;
  }
  q_bytes = (size_t)n * (size_t)heads * DSV4_HEAD_DIM * 2;
  kv_bytes = (size_t)n * DSV4_HEAD_DIM * 2;
  tok_bytes = (size_t)n * 8;
  cache_bytes = (size_t)n_blocks * DSV4_BLOCK_STRIDE(bs);

  q = read_file(dir, "q.bin", q_bytes, 0, NULL);
  kv = read_file(dir, "kv.bin", kv_bytes, 0, NULL);
  pos = read_file(dir, "positions.bin", tok_bytes, 0, NULL);
  slots = read_file(dir, "slots.bin", tok_bytes, 0, NULL);
  q_out = calloc(q_bytes, 1);
  if (!q || !kv || !pos || !slots || !q_out)
    goto out;
  if (fused) {
    w = read_file(dir, "kv_norm_weight.bin", DSV4_HEAD_DIM * sizeof(float), 0, NULL);
    if (!w)
      goto out;
  }
  cache = read_file(dir, "cache_in.bin", cache_bytes, 1, &missing);
  if (!cache && !missing)
    goto out;

  /* The rows of exactly the batch's positions, as the daemon materialises them. */
  dsv4_rope_inv_freq(
      strcmp(rope_kind, "yarn") == 0 ? &dsv4_rope_yarn_default : &dsv4_rope_plain_default, inv);
  if ((rc = dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &table)) != 0 ||
      (rc = dsv4_rope_table_ensure(table, pos, (size_t)n)) != 0) {
    fprintf(stderr, "kernel_run: rope table: %s\n", dsv4_strerror(rc));
    goto out;
  }

  if (dev_from_host(be, q, q_bytes, &dq) || dev_from_host(be, kv, kv_bytes, &dkv) ||
      dev_from_host(be, pos, tok_bytes, &dpos) || dev_from_host(be, slots, tok_bytes, &dslots) ||
      dev_from_host(be, NULL, q_bytes, &dqo) || dev_from_host(be, cache, cache_bytes, &dcache) ||
      (fused && dev_from_host(be, w, DSV4_HEAD_DIM * sizeof(float), &dw))) {
    rc = -1;
    goto out;
  }

  {
    dsv4_insert_args_t a;
    memset(&a, 0, sizeof a);
    a.n_tokens = (uint32_t)n;
    a.heads = (uint32_t)heads;
    a.q = dq.ptr;
    a.kv = dkv.ptr;
    a.positions = dpos.ptr;
    a.slots = dslots.ptr;
    a.rope = table;
    a.kv_norm_weight = fused ? dw.ptr : NULL;
    a.eps = 1e-6f;
    a.write_kv = write_kv;
    a.q_out = dqo.ptr;
    a.cache = dcache.ptr;
    a.block_size = (uint32_t)bs;
    a.n_blocks = (uint32_t)n_blocks;
    a.stride = DSV4_BLOCK_STRIDE(bs);
    rc = be->ops->qkv_insert(be, &a);
    if (rc == 0)
      rc = be->ops->sync(be);
    if (rc) {
      fprintf(stderr, "kernel_run: qkv_insert: %s\n", dsv4_strerror(rc));
      goto out;
    }
  }

  if (!cache && !(cache = malloc(cache_bytes))) {
    rc = -1;
    goto out;
  }
  if ((rc = be->ops->download(be, q_out, &dqo, 0, q_bytes)) != 0 ||
      (rc = be->ops->download(be, cache, &dcache, 0, cache_bytes)) != 0) {
    fprintf(stderr, "kernel_run: download: %s\n", dsv4_strerror(rc));
    goto out;
  }
  rc = write_file(dir, "q_out.bin", q_out, q_bytes);
  if (rc == 0)
    rc = write_file(dir, "cache.bin", cache, cache_bytes);

out:
  if (dq.ptr)
    be->ops->buf_free(be, &dq);
  if (dkv.ptr)
    be->ops->buf_free(be, &dkv);
  if (dpos.ptr)
    be->ops->buf_free(be, &dpos);
  if (dslots.ptr)
    be->ops->buf_free(be, &dslots);
  if (dw.ptr)
    be->ops->buf_free(be, &dw);
  if (dqo.ptr)
    be->ops->buf_free(be, &dqo);
  if (dcache.ptr)
    be->ops->buf_free(be, &dcache);
  dsv4_rope_table_destroy(table);
  free(q);
  free(kv);
  free(pos);
  free(slots);
  free(w);
  free(q_out);
  free(cache);
  return rc;
}

static int run_map(const char *dir, dsv4_backend_t *be) {
  const long long n = param_int("n_tokens", -1);
  const long long n_seg = param_int("n_segments", -1);
  const long long n_bt = param_int("n_block_table", -1);
  const long long bs = param_int("block_size", 64);
  const long long n_blocks = param_int("n_blocks", -1);
  int64_t *pos = NULL, *first_lb = NULL, *slots = NULL;
  int32_t *tok_seg = NULL, *bt = NULL;
  uint32_t *bt_off = NULL, *bt_len = NULL;
  dsv4_devbuf_t dpos = {0}, dseg = {0}, dfirst = {0}, doff = {0}, dlen = {0}, dbt = {0},
                dslots = {0};
  char rc_text[32];
  int rc = -1;

  if (n < 1 || n_seg < 1 || n_bt < 0 || n_blocks < 1 || bs < 1) {
    fprintf(stderr, "kernel_run: bad or missing map parameters in %s/params.txt\n", dir);
    return -1;
  }
  pos = read_file(dir, "positions.bin", (size_t)n * 8, 0, NULL);
  tok_seg = read_file(dir, "tok_seg.bin", (size_t)n * 4, 0, NULL);
  first_lb = read_file(dir, "seg_first_lb.bin", (size_t)n_seg * 8, 0, NULL);
  bt_off = read_file(dir, "seg_bt_off.bin", (size_t)n_seg * 4, 0, NULL);
  bt_len = read_file(dir, "seg_bt_len.bin", (size_t)n_seg * 4, 0, NULL);
  bt = read_file(dir, "block_table.bin", (size_t)n_bt * 4, 0, NULL);
  slots = malloc((size_t)n * 8);
  if (!pos || !tok_seg || !first_lb || !bt_off || !bt_len || !bt || !slots)
    goto out;
  if (dev_from_host(be, pos, (size_t)n * 8, &dpos) ||
      dev_from_host(be, tok_seg, (size_t)n * 4, &dseg) ||
      dev_from_host(be, first_lb, (size_t)n_seg * 8, &dfirst) ||
      dev_from_host(be, bt_off, (size_t)n_seg * 4, &doff) ||
      dev_from_host(be, bt_len, (size_t)n_seg * 4, &dlen) ||
      dev_from_host(be, bt, (size_t)n_bt * 4, &dbt) ||
      dev_from_host(be, NULL, (size_t)n * 8, &dslots))
    goto out;
  {
    dsv4_map_args_t a;
    memset(&a, 0, sizeof a);
    a.n_tokens = (uint32_t)n;
    a.n_segments = (uint32_t)n_seg;
    a.block_size = (uint32_t)bs;
    a.n_blocks = (uint32_t)n_blocks;
    a.positions = dpos.ptr;
    a.tok_seg = dseg.ptr;
    a.seg_first_lb = dfirst.ptr;
    a.seg_bt_off = doff.ptr;
    a.seg_bt_len = dlen.ptr;
    a.block_table = dbt.ptr;
    a.slots = dslots.ptr;
    rc = be->ops->map_slots(be, &a);
    if (rc == 0)
      rc = be->ops->sync(be);
  }
  /* A refused table is a result too: the test compares the code against its expectation. */
  snprintf(rc_text, sizeof rc_text, "%d\n", rc);
  if (write_file(dir, "rc.txt", rc_text, strlen(rc_text)) != 0) {
    rc = -1;
    goto out;
  }
  if (rc == 0) {
    rc = be->ops->download(be, slots, &dslots, 0, (size_t)n * 8);
    if (rc == 0)
      rc = write_file(dir, "slots_out.bin", slots, (size_t)n * 8);
  } else {
    rc = 0;
  }

out:
  if (dpos.ptr)
    be->ops->buf_free(be, &dpos);
  if (dseg.ptr)
    be->ops->buf_free(be, &dseg);
  if (dfirst.ptr)
    be->ops->buf_free(be, &dfirst);
  if (doff.ptr)
    be->ops->buf_free(be, &doff);
  if (dlen.ptr)
    be->ops->buf_free(be, &dlen);
  if (dbt.ptr)
    be->ops->buf_free(be, &dbt);
  if (dslots.ptr)
    be->ops->buf_free(be, &dslots);
  free(pos);
  free(tok_seg);
  free(first_lb);
  free(bt_off);
  free(bt_len);
  free(bt);
  free(slots);
  return rc;
}

/* The attention inputs of mode=attn, read from files (any of them NULL when unreadable). */
typedef struct {
  uint16_t *q, *out;
  int64_t *pos, *p0, *first_lb;
  int32_t *tok_seg, *bt;
  uint32_t *bt_off, *bt_len;
  uint8_t *cache;
  float *sink, *lse;
  /* The compressed branch (ratio > 0). */
  uint8_t *c_cache;
  int64_t *c_first_lb;
  uint32_t *cbt_off, *cbt_len;
  int32_t *cbt, *c_sel;
} attn_files_t;

static void attn_files_free(attn_files_t *f) {
  free(f->q);
  free(f->out);
  free(f->pos);
  free(f->p0);
  free(f->first_lb);
  free(f->tok_seg);
  free(f->bt);
  free(f->bt_off);
  free(f->bt_len);
  free(f->cache);
  free(f->sink);
  free(f->lse);
  free(f->c_cache);
  free(f->c_first_lb);
  free(f->cbt_off);
  free(f->cbt_len);
  free(f->cbt);
  free(f->c_sel);
}

/* The compressed branch of a mode=attn launch, when params.txt names a ratio: its files into f and
 * its fields into a. 0, or -1 when a file or a parameter is missing. */
static int attn_compressed(const char *dir, long long n, long long n_seg, long long bs,
                           attn_files_t *f, dsv4_attn_args_t *a) {
  const long long ratio = param_int("ratio", 0), c_n_blocks = param_int("c_n_blocks", -1);
  const long long n_cbt = param_int("n_c_block_table", -1);
  const long long stride = param_int("c_sel_stride", 0);
  if (ratio == 0)
    return 0;
  if (c_n_blocks < 1 || n_cbt < 0 || stride < 0 || stride > UINT32_MAX) {
    fprintf(stderr, "kernel_run: bad compressed parameters in %s/params.txt\n", dir);
    return -1;
  }
  f->c_cache =
      read_file(dir, "c_cache_in.bin", (size_t)c_n_blocks * DSV4_BLOCK_STRIDE(bs), 0, NULL);
  f->c_first_lb = read_file(dir, "seg_c_first_lb.bin", (size_t)n_seg * 8, 0, NULL);
  f->cbt_off = read_file(dir, "seg_cbt_off.bin", (size_t)n_seg * 4, 0, NULL);
  f->cbt_len = read_file(dir, "seg_cbt_len.bin", (size_t)n_seg * 4, 0, NULL);
  f->cbt = read_file(dir, "c_block_table.bin", (size_t)n_cbt * 4, 0, NULL);
  f->c_sel = stride ? read_file(dir, "c_sel.bin", (size_t)n * (size_t)stride * 4, 0, NULL) : NULL;
  if (!f->c_cache || !f->c_first_lb || !f->cbt_off || !f->cbt_len || !f->cbt ||
      (stride && !f->c_sel))
    return -1;
  a->ratio = (uint32_t)ratio;
  a->c_cache = f->c_cache;
  a->c_n_blocks = (uint32_t)c_n_blocks;
  a->seg_c_first_lb = f->c_first_lb;
  a->seg_cbt_off = f->cbt_off;
  a->seg_cbt_len = f->cbt_len;
  a->c_block_table = f->cbt;
  a->c_bt_entries = (uint32_t)n_cbt;
  a->c_sel = f->c_sel;
  a->c_sel_stride = (uint32_t)stride;
  return 0;
}

/* On the CPU backend (host memory) the launch reads the files' buffers directly. */
static int run_attn(const char *dir, dsv4_backend_t *be) {
  const long long n = param_int("n_tokens", -1), heads = param_int("heads", -1);
  const long long n_seg = param_int("n_segments", -1), n_bt = param_int("n_block_table", -1);
  const long long bs = param_int("block_size", 64), n_blocks = param_int("n_blocks", -1);
  const int with_sink = (int)param_int("sink", 0), with_lse = (int)param_int("lse", 1);
  const char *rope_kind = param_str("rope", "plain");
  attn_files_t f;
  dsv4_rope_table_t *table = NULL;
  float inv[DSV4_ROPE_PAIRS];
  char rc_text[32];
  int rc = -1;

  memset(&f, 0, sizeof f);
  if (n < 1 || heads < 1 || heads > DSV4_MAX_HEADS || n_seg < 1 || n_bt < 1 || n_blocks < 1 ||
      !DSV4_BLOCK_SIZE_VALID(bs) || !(be->ops->caps & DSV4_BE_HOST_MEMORY) || !be->ops->attention) {
    fprintf(stderr, "kernel_run: bad attn parameters in %s/params.txt (or no host attention)\n",
            dir);
    return -1;
  }
  size_t q_bytes = (size_t)n * (size_t)heads * DSV4_HEAD_DIM * 2;
  f.q = read_file(dir, "q.bin", q_bytes, 0, NULL);
  f.pos = read_file(dir, "positions.bin", (size_t)n * 8, 0, NULL);
  f.tok_seg = read_file(dir, "tok_seg.bin", (size_t)n * 4, 0, NULL);
  f.p0 = read_file(dir, "seg_p0.bin", (size_t)n_seg * 8, 0, NULL);
  f.first_lb = read_file(dir, "seg_first_lb.bin", (size_t)n_seg * 8, 0, NULL);
  f.bt_off = read_file(dir, "seg_bt_off.bin", (size_t)n_seg * 4, 0, NULL);
  f.bt_len = read_file(dir, "seg_bt_len.bin", (size_t)n_seg * 4, 0, NULL);
  f.bt = read_file(dir, "block_table.bin", (size_t)n_bt * 4, 0, NULL);
  f.cache = read_file(dir, "cache_in.bin", (size_t)n_blocks * DSV4_BLOCK_STRIDE(bs), 0, NULL);
  f.sink = with_sink ? read_file(dir, "sink.bin", (size_t)heads * 4, 0, NULL) : NULL;
  f.out = malloc(q_bytes);
  f.lse = malloc((size_t)n * (size_t)heads * 4);
  if (!f.q || !f.pos || !f.tok_seg || !f.p0 || !f.first_lb || !f.bt_off || !f.bt_len || !f.bt ||
      !f.cache || (with_sink && !f.sink) || !f.out || !f.lse)
    goto out;
  dsv4_rope_inv_freq(
      strcmp(rope_kind, "yarn") == 0 ? &dsv4_rope_yarn_default : &dsv4_rope_plain_default, inv);
  if ((rc = dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &table)) != 0 ||
      (rc = dsv4_rope_table_ensure(table, f.pos, (size_t)n)) != 0) {
    fprintf(stderr, "kernel_run: rope table: %s\n", dsv4_strerror(rc));
    goto out;
  }
  dsv4_attn_args_t a = {
      .n_tokens = (uint32_t)n,
      .n_segments = (uint32_t)n_seg,
      .heads = (uint32_t)heads,
      .q = f.q,
      .positions = f.pos,
      .tok_seg = f.tok_seg,
      .seg_p0 = f.p0,
      .seg_first_lb = f.first_lb,
      .seg_bt_off = f.bt_off,
      .seg_bt_len = f.bt_len,
      .block_table = f.bt,
      .bt_entries = (uint32_t)n_bt,
      .cache = f.cache,
      .block_size = (uint32_t)bs,
      .n_blocks = (uint32_t)n_blocks,
      .stride = DSV4_BLOCK_STRIDE(bs),
      .sink = f.sink,
      .rope = table,
      .out = f.out,
      .lse = with_lse ? f.lse : NULL,
  };
  if (attn_compressed(dir, n, n_seg, bs, &f, &a) != 0) {
    rc = -1;
    goto out;
  }
  rc = be->ops->attention(be, &a);
  if (rc == 0)
    rc = be->ops->sync(be);
  snprintf(rc_text, sizeof rc_text, "%d\n", rc);
  if (write_file(dir, "rc.txt", rc_text, strlen(rc_text)) != 0) {
    rc = -1;
    goto out;
  }
  if (rc == 0) {
    rc = write_file(dir, "out.bin", f.out, q_bytes);
    if (rc == 0 && with_lse)
      rc = write_file(dir, "lse.bin", f.lse, (size_t)n * (size_t)heads * 4);
  } else {
    rc = 0; /* a refused launch is a result: the test compares the code */
  }
out:
  dsv4_rope_table_destroy(table);
  attn_files_free(&f);
  return rc;
}

int main(int argc, char **argv) {
  dsv4_backend_options_t opt;
  dsv4_backend_t *be = NULL;
  char why[256] = "";
  const char *mode;
  int rc;

  if (argc != 2) {
    fprintf(stderr, "usage: kernel_run <dir>\n");
    return 2;
  }
  if (load_params(argv[1]) != 0)
    return 1;
  memset(&opt, 0, sizeof opt);
  opt.threads = (uint32_t)param_int("threads", 0);
  rc = dsv4_backend_open(param_str("backend", "cpu"), &opt, &be, why, sizeof why);
  if (rc) {
    fprintf(stderr, "kernel_run: backend %s: %s (%s)\n", param_str("backend", "cpu"),
            dsv4_strerror(rc), why);
    return 1;
  }
  /* isa=scalar|avx2|avx512 runs the CPU backend at that kernel level; exit 77 when this CPU lacks
   * it. */
  if (strcmp(param_str("isa", "best"), "best") != 0) {
    int isa = -1;
    for (int i = 0; i < DSV4__CPU_ISA_COUNT; i++)
      if (strcmp(param_str("isa", ""), dsv4__cpu_isa_name(i)) == 0)
        isa = i;
    if (isa < 0) {
      fprintf(stderr, "kernel_run: unknown kernel level %s\n", param_str("isa", ""));
      dsv4_backend_close(be);
      return 2;
    }
    if (dsv4__cpu_backend_set_isa(be, isa) != 0) {
      fprintf(stderr, "kernel_run: kernel level %s is not available on this CPU\n",
              param_str("isa", ""));
      dsv4_backend_close(be);
      return 77;
    }
  }
  mode = param_str("mode", "insert");
  if (strcmp(mode, "insert") == 0) {
    rc = run_insert(argv[1], be);
  } else if (strcmp(mode, "map") == 0) {
    rc = run_map(argv[1], be);
  } else if (strcmp(mode, "attn") == 0) {
    rc = run_attn(argv[1], be);
  } else {
    fprintf(stderr, "kernel_run: unknown mode %s\n", mode);
    rc = -1;
  }
  dsv4_backend_close(be);
  return rc == 0 ? 0 : 1;
}
