/*
 * The pinned pool's allocator (server/pinned_pool.c): alignment, exhaustion, coalescing, reuse,
 * pointers that are not its own, random sequences against a model of the live blocks, and two
 * threads allocating and freeing at once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dsv4-error.h"
#include "pinned_pool.h"

#define KIB ((size_t)1024)

static dsv4_pinned_pool_t *make(size_t bytes) {
  dsv4_pinned_pool_t *p = NULL;
  assert_int_equal(dsv4_pinned_pool_create(bytes, &p), 0);
  assert_non_null(p);
  return p;
}

static dsv4_pinned_stats_t stats(dsv4_pinned_pool_t *p) {
  dsv4_pinned_stats_t s;
  dsv4_pinned_pool_stats(p, &s);
  return s;
}

static size_t off_of(dsv4_pinned_pool_t *p, const void *b) {
  return (size_t)((const uint8_t *)b - (const uint8_t *)dsv4_pinned_pool_base(p));
}

/* The arena is whole pages, page-aligned; every block is 64-byte aligned, inside the arena, and
 * holds its bytes apart from every other block. */
static void test_alignment(void **state) {
  (void)state;
  static const size_t sizes[] = {1, 63, 64, 65, 1000, 4097, 127, 3};
  enum { N = sizeof(sizes) / sizeof(sizes[0]) };
  dsv4_pinned_pool_t *p = make(100 * KIB + 5);
  size_t page = (size_t)sysconf(_SC_PAGESIZE), want_used = 0;
  uint8_t *b[N];
  assert_int_equal((uintptr_t)dsv4_pinned_pool_base(p) % page, 0);
  assert_int_equal(dsv4_pinned_pool_bytes(p) % page, 0);
  assert_true(dsv4_pinned_pool_bytes(p) >= 100 * KIB + 5);
  for (size_t i = 0; i < N; i++) {
    b[i] = dsv4_pinned_pool_alloc(p, sizes[i]);
    assert_non_null(b[i]);
    assert_int_equal((uintptr_t)b[i] % DSV4_PINNED_ALIGN, 0);
    assert_true(dsv4_pinned_pool_owns(p, b[i]));
    assert_true(dsv4_pinned_pool_owns(p, b[i] + sizes[i] - 1));
    memset(b[i], (int)(i + 1), sizes[i]);
    want_used += (sizes[i] + 63) / 64 * 64;
  }
  for (size_t i = 0; i < N; i++)
    for (size_t k = 0; k < sizes[i]; k++)
      assert_int_equal(b[i][k], (uint8_t)(i + 1));
  assert_int_equal(stats(p).used, want_used);
  assert_int_equal(stats(p).blocks, N);
  for (size_t i = 0; i < N; i++)
    assert_int_equal(dsv4_pinned_pool_free(p, b[i]), 0);
  assert_int_equal(stats(p).used, 0);
  dsv4_pinned_pool_destroy(p);
}

/* The VmFlags line of the mapping that holds a, from /proc/self/smaps ("" when not found). */
static void vm_flags(const void *a, char *out, size_t n) {
  FILE *f = fopen("/proc/self/smaps", "r");
  char line[512];
  int inside = 0;
  out[0] = 0;
  assert_non_null(f);
  while (fgets(line, sizeof(line), f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
      inside = (uintptr_t)a >= lo && (uintptr_t)a < hi;
    else if (inside && !strncmp(line, "VmFlags:", 8)) {
      snprintf(out, n, "%s", line + 8);
      break;
    }
  }
  fclose(f);
}

/* The kernel's transparent huge page mode: "always", "madvise", "never", or "" if not told. */
static const char *thp_mode(void) {
  static char mode[16];
  char line[128] = "";
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  mode[0] = 0;
  if (f) {
    if (fgets(line, sizeof(line), f)) {
      char *a = strchr(line, '['), *z = a ? strchr(a, ']') : NULL;
      if (a && z && z - a - 1 < (long)sizeof(mode))
        snprintf(mode, sizeof(mode), "%.*s", (int)(z - a - 1), a + 1);
    }
    fclose(f);
  }
  return mode;
}

/* A placement report of a committed arena: nodes the host has (or -1 without NUMA), huge bytes
 * in whole huge pages within the arena. */
/* The kernel's transparent huge page size (hpage_pmd_size), or 0 where it has none. */
static size_t thp_bytes(void) {
  unsigned long n = 0;
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
  if (f) {
    if (fscanf(f, "%lu", &n) != 1)
      n = 0;
    fclose(f);
  }
  return (size_t)n;
}

static void check_placement(const dsv4_pinned_placement_t *at, size_t bytes) {
  int nodes[2] = {at->first_node, at->last_node};
  for (int i = 0; i < 2; i++)
    if (nodes[i] != -1) {
      char path[64];
      assert_true(nodes[i] >= 0);
      snprintf(path, sizeof(path), "/sys/devices/system/node/node%d", nodes[i]);
      assert_int_equal(access(path, F_OK), 0);
    }
  assert_true(at->huge_bytes <= bytes);
  if (thp_bytes())
    assert_int_equal(at->huge_bytes % thp_bytes(), 0);
  else
    assert_int_equal(at->huge_bytes, 0);
}

/* The arena starts on a huge page boundary and is advised to use huge pages ("hg" in its VmFlags),
 * so that a device's mapping of it needs fewer translations; DSV4_POOL_NO_HUGEPAGE=1, or a kernel
 * without transparent huge pages, leaves it plain (page-aligned, no advice). Either way its bytes
 * are the pool's. */
static void test_huge_pages(void **state) {
  (void)state;
  char flags[512];
  dsv4_pinned_pool_t *p = make(5 * 1024 * KIB + 3);
  vm_flags(dsv4_pinned_pool_base(p), flags, sizeof(flags));
  if (thp_bytes()) {
    assert_int_equal((uintptr_t)dsv4_pinned_pool_base(p) % thp_bytes(), 0);
    assert_non_null(strstr(flags, " hg"));
  } else {
    /* A kernel without transparent huge pages: a plain arena, as with the variable. */
    assert_null(strstr(flags, " hg"));
  }
  uint8_t *b = dsv4_pinned_pool_alloc(p, 5 * 1024 * KIB);
  assert_non_null(b);
  memset(b, 7, 5 * 1024 * KIB);
  dsv4_pinned_placement_t at;
  dsv4_pinned_pool_placement(p, &at);
  check_placement(&at, dsv4_pinned_pool_bytes(p));
  printf("advised: nodes %d..%d, %zu bytes in huge pages (THP %s)\n", at.first_node, at.last_node,
         at.huge_bytes, thp_mode());
  assert_int_equal(dsv4_pinned_pool_free(p, b), 0);
  dsv4_pinned_pool_destroy(p);

  setenv("DSV4_POOL_NO_HUGEPAGE", "1", 1);
  p = make(5 * 1024 * KIB + 3);
  unsetenv("DSV4_POOL_NO_HUGEPAGE");
  vm_flags(dsv4_pinned_pool_base(p), flags, sizeof(flags));
  assert_true(flags[0] != 0);
  assert_null(strstr(flags, " hg"));
  memset(dsv4_pinned_pool_base(p), 7, dsv4_pinned_pool_bytes(p));
  dsv4_pinned_pool_placement(p, &at);
  check_placement(&at, dsv4_pinned_pool_bytes(p));
  /* Unadvised memory gets huge pages only where the kernel gives them to every mapping. */
  if (strcmp(thp_mode(), "always") != 0)
    assert_int_equal(at.huge_bytes, 0);
  dsv4_pinned_pool_destroy(p);
}

/* A pool with no run large enough answers NULL, and the fallback then comes from the heap. */
static void test_exhaustion(void **state) {
  (void)state;
  dsv4_pinned_pool_t *p = make(64 * KIB);
  size_t total = dsv4_pinned_pool_bytes(p);
  int fell = -1;
  void *all = dsv4_pinned_pool_alloc(p, total);
  assert_non_null(all);
  assert_ptr_equal(all, dsv4_pinned_pool_base(p));
  assert_null(dsv4_pinned_pool_alloc(p, 1));
  assert_int_equal(stats(p).largest_free, 0);
  /* Full: dsv4_pinned_alloc falls back to the heap and says so; its free goes to the heap. */
  uint8_t *h = dsv4_pinned_alloc(p, 100, &fell);
  assert_non_null(h);
  assert_int_equal(fell, 1);
  assert_false(dsv4_pinned_pool_owns(p, h));
  assert_int_equal((uintptr_t)h % DSV4_PINNED_ALIGN, 0);
  memset(h, 0xab, 128); /* rounded up to 128 */
  dsv4_pinned_free(p, h);
  dsv4_pinned_free(p, all);
  assert_int_equal(stats(p).used, 0);
  /* More than the arena, and nothing, are never served. */
  assert_null(dsv4_pinned_pool_alloc(p, total + 1));
  assert_null(dsv4_pinned_pool_alloc(p, SIZE_MAX));
  assert_null(dsv4_pinned_pool_alloc(p, 0));
  assert_null(dsv4_pinned_alloc(p, SIZE_MAX, &fell));
  /* With room, dsv4_pinned_alloc serves from the pool; a NULL pool (off) is no fallback. */
  uint8_t *q = dsv4_pinned_alloc(p, 0, &fell);
  assert_int_equal(fell, 0);
  assert_true(dsv4_pinned_pool_owns(p, q));
  assert_int_equal(stats(p).used, DSV4_PINNED_ALIGN);
  dsv4_pinned_free(p, q);
  h = dsv4_pinned_alloc(NULL, 10, &fell);
  assert_non_null(h);
  assert_int_equal(fell, 0);
  dsv4_pinned_free(NULL, h);
  dsv4_pinned_free(p, NULL);
  dsv4_pinned_pool_destroy(p);
  /* No arena of nothing, or of more than an address space; a one-byte arena is one page. */
  dsv4_pinned_pool_t *bad = p;
  assert_int_equal(dsv4_pinned_pool_create(0, &bad), DSV4_EINVAL);
  assert_null(bad);
  assert_int_equal(dsv4_pinned_pool_create(SIZE_MAX, &bad), DSV4_EINVAL);
  assert_null(bad);
  dsv4_pinned_pool_destroy(NULL);
  p = make(1);
  assert_int_equal(dsv4_pinned_pool_bytes(p), (size_t)sysconf(_SC_PAGESIZE));
  dsv4_pinned_pool_destroy(p);
}

/* Freed neighbours merge: whatever the order of the frees, an empty pool is one run again, and a
 * block of the whole arena fits. */
static void test_coalescing(void **state) {
  (void)state;
  static const int orders[][4] = {{1, 3, 0, 2}, {0, 1, 2, 3}, {3, 2, 1, 0}, {2, 0, 3, 1}};
  dsv4_pinned_pool_t *p = make(64 * KIB);
  size_t total = dsv4_pinned_pool_bytes(p);
  for (size_t o = 0; o < sizeof(orders) / sizeof(orders[0]); o++) {
    void *b[4];
    for (int i = 0; i < 4; i++)
      assert_non_null(b[i] = dsv4_pinned_pool_alloc(p, 4 * KIB));
    assert_int_equal(stats(p).free_extents, 1); /* the tail */
    assert_int_equal(stats(p).largest_free, total - 16 * KIB);
    for (int k = 0; k < 4; k++)
      assert_int_equal(dsv4_pinned_pool_free(p, b[orders[o][k]]), 0);
    assert_int_equal(stats(p).free_extents, 1);
    assert_int_equal(stats(p).largest_free, total);
    assert_int_equal(stats(p).blocks, 0);
  }
  /* Two holes apart stay two runs; the block between them joins them into one. */
  void *a = dsv4_pinned_pool_alloc(p, 4 * KIB), *b = dsv4_pinned_pool_alloc(p, 4 * KIB);
  void *c = dsv4_pinned_pool_alloc(p, 4 * KIB), *d = dsv4_pinned_pool_alloc(p, 4 * KIB);
  assert_int_equal(dsv4_pinned_pool_free(p, a), 0);
  assert_int_equal(dsv4_pinned_pool_free(p, c), 0);
  assert_int_equal(stats(p).free_extents, 3); /* a, c and the tail */
  assert_null(dsv4_pinned_pool_alloc(p, total - 8 * KIB));
  assert_int_equal(dsv4_pinned_pool_free(p, b), 0);
  assert_int_equal(stats(p).free_extents, 2);
  assert_int_equal(stats(p).largest_free, total - 16 * KIB);
  void *abc = dsv4_pinned_pool_alloc(p, 12 * KIB);
  assert_ptr_equal(abc, a);
  assert_int_equal(dsv4_pinned_pool_free(p, abc), 0);
  assert_int_equal(dsv4_pinned_pool_free(p, d), 0);
  assert_non_null(a = dsv4_pinned_pool_alloc(p, total));
  assert_int_equal(dsv4_pinned_pool_free(p, a), 0);
  dsv4_pinned_pool_destroy(p);
}

/* A freed block is served again: the same size at the same place, a smaller one at the front of
 * the hole it left. */
static void test_reuse(void **state) {
  (void)state;
  dsv4_pinned_pool_t *p = make(256 * KIB);
  void *x = dsv4_pinned_pool_alloc(p, 10000);
  for (int i = 0; i < 100; i++) {
    assert_int_equal(dsv4_pinned_pool_free(p, x), 0);
    void *y = dsv4_pinned_pool_alloc(p, 10000);
    assert_ptr_equal(y, x);
    x = y;
  }
  void *a = dsv4_pinned_pool_alloc(p, 8 * KIB), *b = dsv4_pinned_pool_alloc(p, 8 * KIB);
  assert_int_equal(off_of(p, b), off_of(p, a) + 8 * KIB);
  assert_int_equal(dsv4_pinned_pool_free(p, a), 0);
  void *s = dsv4_pinned_pool_alloc(p, 4 * KIB);
  assert_ptr_equal(s, a);
  void *t = dsv4_pinned_pool_alloc(p, 4 * KIB);
  assert_int_equal(off_of(p, t), off_of(p, a) + 4 * KIB);
  assert_int_equal(stats(p).blocks, 4);
  dsv4_pinned_free(p, x);
  dsv4_pinned_free(p, b);
  dsv4_pinned_free(p, s);
  dsv4_pinned_free(p, t);
  assert_int_equal(stats(p).used, 0);
  assert_int_equal(stats(p).free_extents, 1);
  dsv4_pinned_pool_destroy(p);
}

/* A pointer outside the arena is not the pool's; one inside that starts no live block (inside a
 * block, a free run, a block freed twice) is refused and changes nothing. */
static void test_foreign_pointers(void **state) {
  (void)state;
  dsv4_pinned_pool_t *p = make(64 * KIB);
  uint8_t *base = dsv4_pinned_pool_base(p);
  size_t total = dsv4_pinned_pool_bytes(p);
  uint8_t *heap = malloc(64);
  uint8_t *a = dsv4_pinned_pool_alloc(p, 256), *b = dsv4_pinned_pool_alloc(p, 256);
  assert_non_null(heap);
  assert_int_equal(dsv4_pinned_pool_free(p, heap), DSV4_ENOTFOUND);
  assert_false(dsv4_pinned_pool_owns(p, heap));
  assert_int_equal(dsv4_pinned_pool_free(p, NULL), DSV4_ENOTFOUND);
  assert_int_equal(dsv4_pinned_pool_free(p, base + total), DSV4_ENOTFOUND);
  assert_int_equal(dsv4_pinned_pool_free(p, base - 64), DSV4_ENOTFOUND);
  assert_int_equal(dsv4_pinned_pool_free(p, a + 64), DSV4_EINVAL);
  assert_int_equal(dsv4_pinned_pool_free(p, a + 1), DSV4_EINVAL);
  assert_int_equal(dsv4_pinned_pool_free(p, base + total - 64), DSV4_EINVAL); /* a free run */
  assert_int_equal(stats(p).blocks, 2);
  assert_int_equal(stats(p).used, 512);
  assert_int_equal(dsv4_pinned_pool_free(p, a), 0);
  assert_int_equal(dsv4_pinned_pool_free(p, a), DSV4_EINVAL);
  assert_int_equal(stats(p).blocks, 1);
  assert_int_equal(stats(p).used, 256);
  /* dsv4_pinned_free sends a heap pointer to the heap (ASan would report a wrong free). */
  dsv4_pinned_free(p, heap);
  dsv4_pinned_free(p, b);
  assert_int_equal(stats(p).used, 0);
  dsv4_pinned_pool_destroy(p);
}

/* xorshift64*: a reproducible stream without global state, one per thread. */
static uint64_t rnd(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1Dull;
}

typedef struct {
  uint8_t *p;
  size_t n;
} live_t;

/* Every live block lies inside the arena and apart from the others; the pool counts them right. */
static void check_model(dsv4_pinned_pool_t *p, const live_t *live, size_t n_live) {
  size_t used = 0;
  dsv4_pinned_stats_t s = stats(p);
  for (size_t i = 0; i < n_live; i++) {
    size_t a = off_of(p, live[i].p), len = (live[i].n + 63) / 64 * 64;
    assert_int_equal(a % DSV4_PINNED_ALIGN, 0);
    assert_true(a + len <= s.total);
    for (size_t k = i + 1; k < n_live; k++) {
      size_t b = off_of(p, live[k].p), blen = (live[k].n + 63) / 64 * 64;
      assert_true(a + len <= b || b + blen <= a);
    }
    used += len;
  }
  assert_int_equal(s.used, used);
  assert_int_equal(s.blocks, n_live);
  assert_true(s.largest_free <= s.total - s.used);
  assert_true(s.free_extents <= n_live + 1); /* coalesced: no two free runs touch */
}

/* Random allocations and frees against a model of the live blocks, checked after every step. */
static void test_random_against_model(void **state) {
  (void)state;
  enum { MAXLIVE = 48 };
  dsv4_pinned_pool_t *p = make(128 * KIB);
  live_t live[MAXLIVE];
  size_t n_live = 0, refused = 0;
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  for (int step = 0; step < 4000; step++) {
    int do_alloc = n_live == 0 || (n_live < MAXLIVE && rnd(&seed) % 3 != 0);
    if (do_alloc) {
      size_t n = 1 + rnd(&seed) % (12 * KIB);
      uint8_t *b = dsv4_pinned_pool_alloc(p, n);
      if (!b) {
        /* Refused only when no free run is that large. */
        assert_true(stats(p).largest_free < (n + 63) / 64 * 64);
        refused++;
        continue;
      }
      live[n_live++] = (live_t){b, n};
    } else {
      size_t i = rnd(&seed) % n_live;
      assert_int_equal(dsv4_pinned_pool_free(p, live[i].p), 0);
      live[i] = live[--n_live];
    }
    check_model(p, live, n_live);
  }
  assert_true(refused > 0); /* the sequence did reach a full pool */
  while (n_live)
    assert_int_equal(dsv4_pinned_pool_free(p, live[--n_live].p), 0);
  assert_int_equal(stats(p).free_extents, 1);
  dsv4_pinned_pool_destroy(p);
}

typedef struct {
  dsv4_pinned_pool_t *p;
  uint8_t tag;
  uint64_t seed;
  size_t served, refused, corrupt;
} worker_t;

/* One thread: blocks filled with its tag and checked before they are freed, so a block handed to
 * both threads at once shows as a corrupt byte. */
static void *worker(void *arg) {
  enum { MAXLIVE = 16 };
  worker_t *w = arg;
  live_t live[MAXLIVE];
  size_t n_live = 0;
  for (int it = 0; it < 20000; it++) {
    if (n_live < MAXLIVE && (n_live == 0 || rnd(&w->seed) % 2)) {
      size_t n = 1 + rnd(&w->seed) % (16 * KIB);
      uint8_t *b = dsv4_pinned_pool_alloc(w->p, n);
      if (!b) {
        w->refused++;
        continue;
      }
      memset(b, w->tag, n);
      live[n_live++] = (live_t){b, n};
      w->served++;
    } else {
      size_t i = rnd(&w->seed) % n_live;
      for (size_t k = 0; k < live[i].n; k++)
        w->corrupt += live[i].p[k] != w->tag;
      if (dsv4_pinned_pool_free(w->p, live[i].p))
        w->corrupt++;
      live[i] = live[--n_live];
    }
  }
  while (n_live)
    if (dsv4_pinned_pool_free(w->p, live[--n_live].p))
      w->corrupt++;
  return NULL;
}

static void test_two_threads(void **state) {
  (void)state;
  dsv4_pinned_pool_t *p = make(256 * KIB);
  worker_t w[2] = {{p, 0x5a, 1, 0, 0, 0}, {p, 0xa5, 2, 0, 0, 0}};
  pthread_t t[2];
  for (int i = 0; i < 2; i++)
    assert_int_equal(pthread_create(&t[i], NULL, worker, &w[i]), 0);
  for (int i = 0; i < 2; i++)
    assert_int_equal(pthread_join(t[i], NULL), 0);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(w[i].corrupt, 0);
    assert_true(w[i].served > 1000);
  }
  /* Sixteen blocks of up to 16 KiB per thread overrun 256 KiB now and then. */
  assert_true(w[0].refused + w[1].refused > 0);
  assert_int_equal(stats(p).used, 0);
  assert_int_equal(stats(p).blocks, 0);
  assert_int_equal(stats(p).free_extents, 1);
  dsv4_pinned_pool_destroy(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_alignment),        cmocka_unit_test(test_exhaustion),
      cmocka_unit_test(test_coalescing),       cmocka_unit_test(test_reuse),
      cmocka_unit_test(test_foreign_pointers), cmocka_unit_test(test_random_against_model),
      cmocka_unit_test(test_two_threads),      cmocka_unit_test(test_huge_pages),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
