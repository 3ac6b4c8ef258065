/*
 * Logical records and the SPEC §3.1 digests: the functions of kvcache/records.h that the daemon
 * runs (the engine's admin reads and digests are these over its cache, in host memory or behind a
 * download), each through a host buffer and through a read callback like a device's. Expected
 * values are built here by hand from the SPEC's byte layout (literal offsets, not the layout
 * macros) and hashed with XXH3_64bits in one shot.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-error.h"
#include "dsv4-numerics.h"
#include "records.h"

#ifdef DSV4_HAVE_XXHASH
#include <xxhash.h>
#endif

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint8_t rbyte(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint8_t)(rng >> 32);
}

static uint8_t *random_layer(uint32_t n_blocks, size_t stride) {
  uint8_t *p = malloc(n_blocks * stride);
  assert_non_null(p);
  for (size_t i = 0; i < n_blocks * stride; i++)
    p[i] = rbyte();
  return p;
}

/* The record of (block, offset) by the SPEC's formulas, spelled out. */
static void hand_record(const uint8_t *base, uint32_t bs, size_t stride, uint32_t block, uint32_t o,
                        uint8_t *out) {
  const uint8_t *blk = base + block * stride;
  memcpy(out, blk + 576 * o, 448);
  memcpy(out + 448, blk + 576 * o + 448, 128);
  memcpy(out + 576, blk + 576 * bs + 8 * o, 8);
}

/*
 * A layer behind a read callback, as the daemon sees a device cache: every read is counted and
 * copied from the buffer; reads from number fail_at on fail with DSV4_EBACKEND (0: never).
 */
typedef struct {
  const uint8_t *base;
  size_t size;
  unsigned reads, fail_at;
} fake_dev_t;

static int fake_read(void *arg, uint32_t layer, uint64_t off, size_t n, void *dst) {
  fake_dev_t *f = arg;
  assert_int_equal(layer, 5); /* passed on as given */
  f->reads++;
  if (f->fail_at && f->reads >= f->fail_at)
    return DSV4_EBACKEND;
  assert_true(off <= f->size && n <= f->size - off);
  memcpy(dst, f->base + off, n);
  return 0;
}

static dsv4_layer_src_t dev_src(fake_dev_t *f, const uint8_t *base, uint32_t n_blocks,
                                uint32_t bs) {
  *f = (fake_dev_t){base, (size_t)n_blocks * DSV4_BLOCK_STRIDE(bs), 0, 0};
  return (dsv4_layer_src_t){NULL, fake_read, f, 5, bs, DSV4_BLOCK_STRIDE(bs)};
}

static void test_stride(void **state) {
  (void)state;
  /* SPEC §3: stride = ceil(584*bs/576)*576; bs = 64 gives 37440. */
  assert_int_equal(DSV4_BLOCK_STRIDE(64), 37440);
  assert_int_equal(DSV4_BLOCK_STRIDE(16), 17 * 576);
  assert_int_equal(DSV4_BLOCK_STRIDE(256), 260 * 576);
}

static void test_record_read(void **state) {
  (void)state;
  const uint32_t bss[] = {16, 64, 256};
  for (int k = 0; k < 3; k++) {
    uint32_t bs = bss[k];
    size_t stride = (size_t)((584 * bs + 575) / 576) * 576;
    uint8_t *base = random_layer(3, stride);
    for (uint32_t b = 0; b < 3; b++) {
      for (uint32_t o = 0; o < bs; o += (o < 3 || o > bs - 3) ? 1 : 7) {
        uint8_t got[584], want[584];
        dsv4_record_read(base, bs, stride, (int64_t)b * bs + o, got);
        hand_record(base, bs, stride, b, o, want);
        assert_memory_equal(got, want, 584);
      }
    }
    free(base);
  }
}

/* A snapshot of positions first_lb*bs .. over the given block ids (-1 a hole). */
static void test_records_scatter(void **state) {
  (void)state;
  const uint32_t bs = 16;
  const size_t stride = DSV4_BLOCK_STRIDE(bs);
  uint8_t *blk = random_layer(1, stride);
  uint8_t recs[3 * DSV4_RECORD_BYTES], back[3 * DSV4_RECORD_BYTES];
  for (size_t i = 0; i < sizeof(recs); i++)
    recs[i] = rbyte();
  /* Three records at offsets 5..7, then read back through the one reader. */
  dsv4_records_scatter(recs, DSV4_RECORD_BYTES, 3, blk + DSV4_TOKEN_DATA_OFFSET(5),
                       blk + DSV4_SCALE_OFFSET(bs, 5));
  for (uint32_t i = 0; i < 3; i++)
    dsv4_record_read(blk, bs, stride, 5 + i, back + (size_t)i * DSV4_RECORD_BYTES);
  assert_memory_equal(back, recs, sizeof(recs));
  free(blk);
}

static void test_record_implausible(void **state) {
  (void)state;
  uint8_t rec[DSV4_RECORD_BYTES];
  memset(rec, 0x11, sizeof(rec));
  for (int t = 0; t < DSV4_NTILES; t++)
    rec[DSV4_TOKEN_DATA_BYTES + t] = (uint8_t)(105 + 20 * t);
  rec[DSV4_TOKEN_DATA_BYTES + 7] = 0;
  assert_null(dsv4_record_implausible(rec));
  rec[DSV4_TOKEN_DATA_BYTES + 3] = 247;
  assert_null(dsv4_record_implausible(rec));
  rec[DSV4_TOKEN_DATA_BYTES + 3] = 248;
  assert_non_null(dsv4_record_implausible(rec));
  rec[DSV4_TOKEN_DATA_BYTES + 3] = 104;
  assert_non_null(dsv4_record_implausible(rec));
  rec[DSV4_TOKEN_DATA_BYTES + 3] = 200;
  rec[DSV4_TOKEN_DATA_BYTES + 7] = 1;
  assert_non_null(dsv4_record_implausible(rec));
  rec[DSV4_TOKEN_DATA_BYTES + 7] = 0;
  rec[447] = 0xff;
  assert_non_null(dsv4_record_implausible(rec));
  rec[447] = 0x7e; /* the largest finite e4m3 is fine; RoPE bytes may hold anything */
  rec[448] = 0xff;
  assert_null(dsv4_record_implausible(rec));
}

static dsv4_seq_info_t snapshot(int64_t first_lb, int32_t *blocks, uint32_t n, int64_t *next) {
  dsv4_seq_info_t in;
  memset(&in, 0, sizeof(in));
  in.first_lb = first_lb;
  in.blocks = blocks;
  in.n_blocks_held = n;
  in.next = next;
  in.last_start = next;
  return in;
}

static void test_seq_records_read(void **state) {
  (void)state;
  const uint32_t bs = 16;
  const size_t stride = DSV4_BLOCK_STRIDE(bs);
  uint8_t *base = random_layer(6, stride);
  int32_t blocks[4] = {4, 0, -1, 5};
  int64_t next[1] = {4 * 16};
  dsv4_seq_info_t in = snapshot(2, blocks, 4, next); /* positions 32..95, 64..79 not held */
  /* Runs that start and end inside blocks and cross a block boundary, with a wider out_stride. */
  const int64_t starts[] = {32, 37, 40, 47, 80};
  const uint32_t counts[] = {1, 27, 16, 17, 16};
  for (int k = 0; k < 5; k++) {
    const size_t os = DSV4_RECORD_BYTES + 8;
    uint8_t *got = calloc(counts[k], os), *dev = calloc(counts[k], os);
    assert_true(got && dev);
    dsv4_layer_src_t host = dsv4_layer_src_host(base, bs);
    fake_dev_t f;
    dsv4_layer_src_t d = dev_src(&f, base, 6, bs);
    assert_int_equal(dsv4_seq_records_read(&host, &in, starts[k], counts[k], got, os), 0);
    assert_int_equal(dsv4_seq_records_read(&d, &in, starts[k], counts[k], dev, os), 0);
    /* Two reads per block's run: its NoPE|RoPE bytes, then its scales. */
    uint32_t runs = (uint32_t)((starts[k] + counts[k] - 1) / bs - starts[k] / bs + 1);
    assert_int_equal(f.reads, 2 * runs);
    for (uint32_t i = 0; i < counts[k]; i++) {
      int64_t p = starts[k] + i;
      uint8_t want[584];
      hand_record(base, bs, stride, (uint32_t)blocks[p / bs - 2], (uint32_t)(p % bs), want);
      assert_memory_equal(got + i * os, want, 584);
      assert_memory_equal(dev + i * os, want, 584);
    }
    free(got);
    free(dev);
  }
  /* A position in a hole or outside the table, and a failing read. */
  uint8_t rec[584 * 2];
  dsv4_layer_src_t host = dsv4_layer_src_host(base, bs);
  assert_int_equal(dsv4_seq_records_read(&host, &in, 63, 2, rec, 584), DSV4_EINVAL);
  assert_int_equal(dsv4_seq_records_read(&host, &in, 31, 1, rec, 584), DSV4_EINVAL);
  assert_int_equal(dsv4_seq_records_read(&host, &in, 96, 1, rec, 584), DSV4_EINVAL);
  fake_dev_t f;
  dsv4_layer_src_t d = dev_src(&f, base, 6, bs);
  f.fail_at = 2;
  assert_int_equal(dsv4_seq_records_read(&d, &in, 40, 2, rec, 584), DSV4_EBACKEND);
  free(base);
}

static void test_record_decode(void **state) {
  (void)state;
  uint8_t rec[584];
  for (int i = 0; i < 448; i++)
    rec[i] = (uint8_t)(i * 37 + 1);
  rec[0] = 0x38;   /* 1.0 */
  rec[1] = 0xc4;   /* -3.0 */
  rec[2] = 0x01;   /* 2^-9, the smallest subnormal */
  rec[3] = 0x7f;   /* NaN */
  rec[64] = 0x7e;  /* 448 */
  rec[448] = 0x80; /* RoPE 0: bf16 0x3f80 = 1.0, little-endian */
  rec[449] = 0x3f;
  rec[450] = 0x00; /* RoPE 1: bf16 0xc000 = -2.0 */
  rec[451] = 0xc0;
  for (int i = 2; i < 64; i++) {
    rec[448 + 2 * i] = (uint8_t)i;
    rec[449 + 2 * i] = 0x40;
  }
  const uint8_t codes[8] = {127, 130, 0, 254, 255, 1, 126, 0};
  memcpy(rec + 576, codes, 8);
  dsv4_record_fields_t f;
  dsv4_record_decode(rec, &f);
  assert_ptr_equal(f.fp8, rec);
  assert_ptr_equal(f.scale_codes, rec + 576);
  assert_true(f.scales[0] == 1.0 && f.scales[1] == 8.0);
  assert_true(f.scales[2] == 0x1p-127 && f.scales[3] == 0x1p127 && f.scales[5] == 0x1p-126);
  assert_true(f.scales[4] != f.scales[4]); /* code 255 is NaN */
  assert_true(f.nope[0] == 1.0 && f.nope[1] == -3.0 && f.nope[2] == 0x1p-9);
  assert_true(f.nope[3] != f.nope[3]);
  assert_true(f.nope[64] == 448.0 * 8.0);
  assert_true(f.nope[128 + 5] == (double)dsv4_e4m3_to_f32(rec[128 + 5]) * 0x1p-127);
  for (int i = 256; i < 320; i++)
    assert_true(f.nope[i] != f.nope[i]); /* every value of a NaN-scaled tile */
  assert_true(f.nope[447] == (double)dsv4_e4m3_to_f32(rec[447]) * 0.5);
  assert_int_equal(f.rope_bits[0], 0x3f80);
  assert_int_equal(f.rope_bits[1], 0xc000);
  assert_true(f.rope[0] == 1.0f && f.rope[1] == -2.0f);
  assert_int_equal(f.rope_bits[63], 0x403f);
}

/* SPEC §8.5's index record: element 2i in the low nibble of byte i, 2i+1 in the high one, the
 * e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} with bit 3 the sign, each 32-block scaled by its UE8M0
 * code at byte 64 + block. */
static void test_index_record_decode(void **state) {
  (void)state;
  static const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  uint8_t rec[68];
  for (int i = 0; i < 64; i++)
    rec[i] = (uint8_t)(i * 29 + 7);
  rec[0] = 0x9f;  /* element 0: 0xf = -6; element 1: 0x9 = -0.5 */
  rec[16] = 0x08; /* element 32: -0 (sign bit alone); element 33: +0 */
  const uint8_t codes[4] = {127, 130, 0, 255};
  memcpy(rec + 64, codes, 4);
  dsv4_index_fields_t f;
  dsv4_index_record_decode(rec, &f);
  assert_ptr_equal(f.scale_codes, rec + 64);
  assert_true(f.scales[0] == 1.0 && f.scales[1] == 8.0 && f.scales[2] == 0x1p-127);
  assert_true(f.scales[3] != f.scales[3]); /* code 255 is NaN */
  assert_int_equal(f.nibbles[0], 0xf);
  assert_int_equal(f.nibbles[1], 0x9);
  assert_true(f.values[0] == -6.0 && f.values[1] == -0.5);
  assert_int_equal(f.nibbles[32], 0x8);
  assert_true(f.values[32] == 0.0 && signbit(f.values[32]));
  assert_true(f.values[33] == 0.0 && !signbit(f.values[33]));
  for (int i = 2; i < 96; i++) {
    uint8_t nib = (uint8_t)(i & 1 ? rec[i / 2] >> 4 : rec[i / 2] & 15);
    double want = ldexp((nib & 8 ? -1.0 : 1.0) * grid[nib & 7], codes[i / 32] - 127);
    assert_int_equal(f.nibbles[i], nib);
    assert_true(f.values[i] == want && signbit(f.values[i]) == signbit(want));
  }
  for (int i = 96; i < 128; i++)
    assert_true(f.values[i] != f.values[i]); /* every value of the NaN-scaled block */
}

static void test_hex(void **state) {
  (void)state;
  char s[17];
  dsv4_digest_hex(0x0123456789abcdefull, s);
  assert_string_equal(s, "0123456789abcdef");
  dsv4_digest_hex(0, s);
  assert_string_equal(s, "0000000000000000");
  dsv4_digest_hex(UINT64_MAX, s);
  assert_string_equal(s, "ffffffffffffffff");
  dsv4_digest_hex(0xA0B0C0D0E0F00001ull, s);
  assert_string_equal(s, "a0b0c0d0e0f00001");
  /* Positions are little-endian int64 in the digests and in a dump. */
  uint8_t le[8];
  const uint8_t want[8] = {8, 7, 6, 5, 4, 3, 2, 1},
                minus2[8] = {0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  dsv4_position_put(le, 0x0102030405060708ll);
  assert_memory_equal(le, want, 8);
  dsv4_position_put(le, -2);
  assert_memory_equal(le, minus2, 8);
}

static void test_stored_range_and_slot(void **state) {
  (void)state;
  int64_t next[2] = {300, 40};
  int64_t last[2] = {250, 40};
  int32_t blocks[4] = {7, 3, 9, 1};
  dsv4_seq_info_t in;
  memset(&in, 0, sizeof(in));
  in.p0 = 40;
  in.next = next;
  in.last_start = last;
  in.first_lb = 15; /* positions 240..303 at bs 16 */
  in.blocks = blocks;
  in.n_blocks_held = 4;
  int64_t f, e;
  dsv4_seq_stored_range(&in, 16, 0, &f, &e);
  assert_int_equal(f, 240);
  assert_int_equal(e, 300);
  dsv4_seq_stored_range(&in, 16, 1, &f, &e); /* layer 1 wrote nothing */
  assert_int_equal(f, e);
  assert_int_equal(dsv4_seq_slot(&in, 16, 240), 7 * 16);
  assert_int_equal(dsv4_seq_slot(&in, 16, 257), 3 * 16 + 1);
  assert_int_equal(dsv4_seq_slot(&in, 16, 303), 1 * 16 + 15);
  assert_int_equal(dsv4_seq_slot(&in, 16, 239), -1);
  assert_int_equal(dsv4_seq_slot(&in, 16, 304), -1);
  /* p0 inside the first held block: storage starts at p0. */
  in.first_lb = 2;
  dsv4_seq_stored_range(&in, 16, 0, &f, &e);
  assert_int_equal(f, 40);
}

#ifdef DSV4_HAVE_XXHASH

static void le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static void test_records_digest(void **state) {
  (void)state;
  const uint32_t bs = 64;
  const size_t stride = 37440;
  uint8_t *base = random_layer(4, stride);
  /* Slots in arbitrary order with positions of every byte width, including above 2^32. */
  const int64_t slots[] = {5, 64 * 3 + 63, 0, 64 + 17, 64 * 2};
  const int64_t pos[] = {0, 1, 0x1234, 0x100000000ll + 7, 0x0102030405060708ll};
  enum { N = 5 };
  uint8_t *cat = malloc(N * 592);
  assert_non_null(cat);
  for (int i = 0; i < N; i++) {
    le64(cat + 592 * i, (uint64_t)pos[i]);
    hand_record(base, bs, stride, (uint32_t)(slots[i] / bs), (uint32_t)(slots[i] % bs),
                cat + 592 * i + 8);
  }
  /* The first position's bytes really are little-endian. */
  assert_int_equal(cat[592 * 4], 0x08);
  assert_int_equal(cat[592 * 4 + 7], 0x01);
  dsv4_records_digest_t *d;
  assert_int_equal(dsv4_records_digest_create(&d), 0);
  assert_true(dsv4_records_digest_value(d) == XXH3_64bits(cat, 0));
  for (int i = 0; i < N; i++) {
    dsv4_records_digest_add_slot(d, pos[i], base, bs, stride, slots[i]);
    /* Streaming: the value after i+1 records is the digest of that prefix. */
    assert_true(dsv4_records_digest_value(d) == XXH3_64bits(cat, (size_t)(i + 1) * 592));
  }
  uint64_t full = dsv4_records_digest_value(d);
  /* The same list fed as records gives the same digest; any change in order or content does not. */
  dsv4_records_digest_reset(d);
  for (int i = 0; i < N; i++)
    dsv4_records_digest_add(d, pos[i], cat + 592 * i + 8);
  assert_true(dsv4_records_digest_value(d) == full);
  dsv4_records_digest_reset(d);
  for (int i = N - 1; i >= 0; i--)
    dsv4_records_digest_add_slot(d, pos[i], base, bs, stride, slots[i]);
  assert_true(dsv4_records_digest_value(d) != full);
  /* A byte of the scales tail, outside the token data, is part of the record. */
  base[3 * stride + 576 * 64 + 8 * 63 + 7] ^= 1;
  dsv4_records_digest_reset(d);
  for (int i = 0; i < N; i++)
    dsv4_records_digest_add_slot(d, pos[i], base, bs, stride, slots[i]);
  assert_true(dsv4_records_digest_value(d) != full);
  dsv4_records_digest_destroy(d);
  free(cat);
  free(base);
}

static void test_block_digest(void **state) {
  (void)state;
  const size_t stride = 17 * 576;
  uint8_t *base = random_layer(3, stride);
  assert_true(dsv4_block_digest(base + 2 * stride, stride) ==
              XXH3_64bits(base + 2 * stride, stride));
  uint64_t d1 = dsv4_block_digest(base + stride, stride);
  base[2 * stride - 1] ^= 0x80; /* the last padding byte of block 1 */
  assert_true(dsv4_block_digest(base + stride, stride) != d1);
  free(base);
}

/* The pool digest by its definition, built here. */
static uint64_t hand_pool_digest(const uint8_t *base, size_t stride, uint32_t layer,
                                 const uint32_t *used, int n_used) {
  uint8_t *buf = malloc(8 + stride);
  assert_non_null(buf);
  uint64_t acc = 0;
  for (int i = 0; i < n_used; i++) {
    uint32_t b = used[i];
    for (int k = 0; k < 4; k++) {
      buf[k] = (uint8_t)(layer >> (8 * k));
      buf[4 + k] = (uint8_t)(b >> (8 * k));
    }
    memcpy(buf + 8, base + b * stride, stride);
    acc ^= XXH3_64bits(buf, 8 + stride);
  }
  free(buf);
  return acc;
}

/*
 * The pool digest of a host layer at bs 16, checked against the same through a read callback (one
 * read per used block), with the block digests and used flags it reports on the way.
 */
static int pool_digest(const dsv4_pool_t *p, uint32_t layer, const uint8_t *base, uint64_t *out) {
  enum { MAXB = 8 };
  const size_t stride = DSV4_BLOCK_STRIDE(16);
  uint64_t bd[MAXB], bd2[MAXB], d2 = 1;
  uint8_t used[MAXB] = {0}, used2[MAXB] = {0};
  assert_true(p->n_blocks <= MAXB);
  dsv4_layer_src_t host = dsv4_layer_src_host(base, 16);
  int rc = dsv4_pool_digest(p, layer, &host, out, bd, used);
  if (rc)
    return rc;
  fake_dev_t f;
  dsv4_layer_src_t dev = dev_src(&f, base, p->n_blocks, 16);
  assert_int_equal(dsv4_pool_digest(p, layer, &dev, &d2, bd2, used2), 0);
  assert_true(d2 == *out);
  unsigned n_used = 0;
  for (uint32_t b = 0; b < p->n_blocks; b++) {
    assert_int_equal(used[b], dsv4_pool_is_used(p, b));
    assert_int_equal(used2[b], used[b]);
    if (!used[b])
      continue;
    n_used++;
    assert_true(bd[b] == XXH3_64bits(base + b * stride, stride));
    assert_true(bd2[b] == bd[b]);
  }
  assert_int_equal(f.reads, n_used);
  /* Without block digests or used flags the pool digest is the same. */
  assert_int_equal(dsv4_pool_digest(p, layer, &host, &d2, NULL, NULL), 0);
  assert_true(d2 == *out);
  return 0;
}

static void test_pool_digest(void **state) {
  (void)state;
  enum { NB = 8 };
  const size_t stride = 17 * 576;
  uint8_t *base = random_layer(NB, stride);
  dsv4_pool_t p1, p2;
  assert_int_equal(dsv4_pool_init(&p1, NB), 0);
  assert_int_equal(dsv4_pool_init(&p2, NB), 0);
  /* p1 allocates 0..5 and frees 1 and 4; p2 reaches the same used set {0,2,3,5} another way. */
  uint32_t id;
  for (int i = 0; i < 6; i++)
    assert_int_equal(dsv4_pool_alloc(&p1, &id), 0);
  dsv4_pool_free(&p1, 4);
  dsv4_pool_free(&p1, 1);
  for (int i = 0; i < NB; i++)
    assert_int_equal(dsv4_pool_alloc(&p2, &id), 0);
  const uint32_t back[] = {7, 1, 6, 4};
  for (int i = 0; i < 4; i++)
    dsv4_pool_free(&p2, back[i]);
  const uint32_t used[] = {0, 2, 3, 5};
  uint64_t d1, d2;
  assert_int_equal(pool_digest(&p1, 11, base, &d1), 0);
  assert_int_equal(pool_digest(&p2, 11, base, &d2), 0);
  assert_true(d1 == hand_pool_digest(base, stride, 11, used, 4));
  assert_true(d1 == d2);
  /* The layer number is hashed. */
  assert_int_equal(pool_digest(&p1, 12, base, &d2), 0);
  assert_true(d1 != d2);
  /* Bytes of free blocks do not count; one byte of a used block does. */
  base[1 * stride + 5] ^= 1;
  base[7 * stride + stride - 1] ^= 1;
  assert_int_equal(pool_digest(&p1, 11, base, &d2), 0);
  assert_true(d1 == d2);
  base[3 * stride + 100] ^= 4;
  assert_int_equal(pool_digest(&p1, 11, base, &d2), 0);
  assert_true(d1 != d2);
  base[3 * stride + 100] ^= 4;
  /* Swapping the contents of two used blocks changes it (ids are hashed with the bytes)... */
  uint8_t *tmp = malloc(stride);
  assert_non_null(tmp);
  memcpy(tmp, base + 2 * stride, stride);
  memcpy(base + 2 * stride, base + 5 * stride, stride);
  memcpy(base + 5 * stride, tmp, stride);
  assert_int_equal(pool_digest(&p1, 11, base, &d2), 0);
  assert_true(d1 != d2);
  /* ...while the same content per id placed in another buffer layout (a permuted copy read
   * back through the permutation) gives the same value. */
  memcpy(base + 5 * stride, base + 2 * stride, stride);
  memcpy(base + 2 * stride, tmp, stride);
  assert_int_equal(pool_digest(&p1, 11, base, &d2), 0);
  assert_true(d1 == d2);
  /* An empty pool digests to 0 (the XOR of nothing). */
  dsv4_pool_t p3;
  assert_int_equal(dsv4_pool_init(&p3, NB), 0);
  assert_int_equal(pool_digest(&p3, 11, base, &d2), 0);
  assert_true(d2 == 0);
  /* A failed read is the answer, not a digest. */
  fake_dev_t f;
  dsv4_layer_src_t dev = dev_src(&f, base, NB, 16);
  f.fail_at = 3;
  d2 = 7;
  assert_int_equal(dsv4_pool_digest(&p1, 11, &dev, &d2, NULL, NULL), DSV4_EBACKEND);
  assert_true(d2 == 7);
  dsv4_pool_destroy(&p3);
  free(tmp);
  dsv4_pool_destroy(&p1);
  dsv4_pool_destroy(&p2);
  free(base);
}

/* A recognisable record for (position, layer). */
static void pattern(int64_t pos, uint32_t layer, uint8_t *rec) {
  for (int i = 0; i < 584; i++)
    rec[i] = (uint8_t)(pos * 31 + i * 7 + (pos >> 8) + layer * 101);
}

/* Store a record by the SPEC's offsets. */
static void write_record(uint8_t *base, uint32_t bs, size_t stride, int64_t slot,
                         const uint8_t *rec) {
  uint8_t *blk = base + (size_t)(slot / bs) * stride;
  uint32_t o = (uint32_t)(slot % bs);
  memcpy(blk + 576 * o, rec, 576);
  memcpy(blk + 576 * bs + 8 * o, rec + 576, 8);
}

/* Plan, "run" (write the pattern records) and commit one segment. */
static void run_segment(dsv4_seqtable_t *st, dsv4_plan_t *plan, uint8_t *base, uint32_t layer,
                        const char *name, int64_t start, uint32_t len, int is_new) {
  const uint32_t bs = 16;
  const size_t stride = 17 * 576;
  dsv4_seg_req_t r = {name, (uint32_t)strlen(name), start, len, is_new, (uint64_t)start};
  assert_int_equal(dsv4_seqtable_plan(st, layer, &r, 1, 0, plan), 0);
  for (int64_t p = start; p < start + len; p++) {
    int32_t b = plan->block_table[plan->segs[0].bt_off + (p / bs - plan->segs[0].first_lb)];
    uint8_t rec[584];
    pattern(p, layer, rec);
    write_record(base, bs, stride, (int64_t)b * bs + p % bs, rec);
  }
  dsv4_seqtable_commit(st, plan, 0);
}

static uint64_t hand_digest(int64_t first, int64_t end, uint32_t layer) {
  size_t n = (size_t)(end - first);
  uint8_t *cat = malloc(n * 592 + 1);
  assert_non_null(cat);
  for (int64_t p = first; p < end; p++) {
    le64(cat + 592 * (p - first), (uint64_t)p);
    pattern(p, layer, cat + 592 * (p - first) + 8);
  }
  uint64_t d = XXH3_64bits(cat, n * 592);
  free(cat);
  return d;
}

/*
 * The sequence digest of `name` at a layer of a host buffer (bs 16, 64 blocks), checked against
 * the same through a read callback; *n receives the number of records. The table's error when
 * the sequence is unknown.
 */
static int seq_digest(dsv4_seqtable_t *st, uint32_t layer, const char *name, const uint8_t *base,
                      uint64_t *digest, uint64_t *n) {
  dsv4_seq_info_t info;
  int rc = dsv4_seqtable_info(st, name, (uint32_t)strlen(name), &info);
  if (rc)
    return rc;
  dsv4_layer_src_t host = dsv4_layer_src_host(base, 16);
  fake_dev_t f;
  dsv4_layer_src_t dev = dev_src(&f, base, 64, 16);
  int64_t first, end, f2, e2;
  uint64_t d2;
  assert_int_equal(dsv4_seq_digest(&host, &info, layer, digest, &first, &end), 0);
  assert_int_equal(dsv4_seq_digest(&dev, &info, layer, &d2, &f2, &e2), 0);
  assert_true(d2 == *digest);
  assert_int_equal(f2, first);
  assert_int_equal(e2, end);
  *n = (uint64_t)(end - first);
  /* Fed in pieces of every size, the records digest of the stored range is the same. */
  dsv4_records_digest_t *d;
  assert_int_equal(dsv4_records_digest_create(&d), 0);
  for (int64_t p = first, k = 1; p < end; p += k, k = k * 3 % 37) {
    uint32_t m = (uint32_t)(end - p < k ? end - p : k);
    assert_int_equal(dsv4_records_digest_add_seq(d, &dev, &info, p, m), 0);
  }
  assert_true(dsv4_records_digest_value(d) == *digest);
  dsv4_records_digest_destroy(d);
  dsv4_seq_info_free(&info);
  return 0;
}

static void test_seq_digest(void **state) {
  (void)state;
  const uint32_t bs = 16, NB = 64;
  const size_t stride = 17 * 576;
  uint8_t *base[2];
  for (int l = 0; l < 2; l++) {
    base[l] = calloc(NB, stride);
    assert_non_null(base[l]);
  }
  dsv4_pool_t pool;
  assert_int_equal(dsv4_pool_init(&pool, NB), 0);
  dsv4_seqtable_config_t cfg = {2, bs, 1 << 20, 0, 0, 0};
  dsv4_seqtable_t *st;
  assert_int_equal(dsv4_seqtable_create(&cfg, &pool, &st), 0);
  dsv4_plan_t plan;
  dsv4_plan_init(&plan);
  /* Layer 0 writes 5..204 then 205..259, layer 1 5..204 then 205..209: both windows start at
   * 205 - 127 = 78, in block 4, so the stored records begin at position 64. */
  run_segment(st, &plan, base[0], 0, "q", 5, 200, 1);
  run_segment(st, &plan, base[1], 1, "q", 5, 200, 0);
  run_segment(st, &plan, base[0], 0, "q", 205, 55, 0);
  uint64_t d, n;
  /* While layer 1 still has s = 5, everything from p0 is stored. */
  assert_int_equal(seq_digest(st, 0, "q", base[0], &d, &n), 0);
  assert_int_equal(n, 260 - 5);
  assert_true(d == hand_digest(5, 260, 0));
  run_segment(st, &plan, base[1], 1, "q", 205, 5, 0);
  assert_int_equal(seq_digest(st, 0, "q", base[0], &d, &n), 0);
  assert_int_equal(n, 260 - 64);
  assert_true(d == hand_digest(64, 260, 0));
  assert_int_equal(seq_digest(st, 1, "q", base[1], &d, &n), 0);
  assert_int_equal(n, 210 - 64);
  assert_true(d == hand_digest(64, 210, 1));
  /* A sequence that layer 1 has not written: the digest of the empty list. */
  run_segment(st, &plan, base[0], 0, "e", 3, 2, 1);
  assert_int_equal(seq_digest(st, 1, "e", base[1], &d, &n), 0);
  assert_int_equal(n, 0);
  assert_true(d == XXH3_64bits(NULL, 0));
  assert_int_equal(seq_digest(st, 0, "e", base[0], &d, &n), 0);
  assert_true(d == hand_digest(3, 5, 0));
  assert_int_equal(seq_digest(st, 0, "r", base[0], &d, &n), DSV4_ENOSEQ);
  dsv4_plan_free(&plan);
  dsv4_seqtable_destroy(st);
  dsv4_pool_destroy(&pool);
  free(base[0]);
  free(base[1]);
}

#endif /* DSV4_HAVE_XXHASH */

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stride),
      cmocka_unit_test(test_record_read),
      cmocka_unit_test(test_records_scatter),
      cmocka_unit_test(test_record_implausible),
      cmocka_unit_test(test_seq_records_read),
      cmocka_unit_test(test_record_decode),
      cmocka_unit_test(test_index_record_decode),
      cmocka_unit_test(test_hex),
      cmocka_unit_test(test_stored_range_and_slot),
#ifdef DSV4_HAVE_XXHASH
      cmocka_unit_test(test_records_digest),
      cmocka_unit_test(test_block_digest),
      cmocka_unit_test(test_pool_digest),
      cmocka_unit_test(test_seq_digest),
#endif
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
