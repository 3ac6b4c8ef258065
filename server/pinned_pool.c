/*
 * The pinned pool (pinned_pool.h). The arena is described by a list of blocks in address order,
 * kept outside it (the arena is the device's to read and write, and a header inside a block would
 * sit where a socket or a DMA engine writes). Free blocks are also on a free list that allocations
 * scan first fit; live blocks are indexed by offset in a binary tree (tsearch), so a free finds its
 * block in O(log n) and tells a stray pointer from a block.
 */
#include "pinned_pool.h"

#include <assert.h>
#include <pthread.h>
#include <search.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dsv4-error.h"
#include "host_numa.h"

typedef struct blk {
  size_t off; /* the key of the live tree: first */
  size_t len;
  struct blk *prev, *next;   /* neighbours in the arena, by address */
  struct blk *fprev, *fnext; /* the free list, while free */
  int used;
} blk_t;

struct dsv4_pinned_pool {
  pthread_mutex_t mu;
  uint8_t *base;
  size_t bytes;
  blk_t *head;      /* the block at offset 0 */
  blk_t *free_head; /* free blocks, the most recently freed first */
  void *live;       /* tsearch tree of live blocks by offset */
  size_t used, n_live, n_free;
};

static size_t round_up(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}

static int cmp_off(const void *a, const void *b) {
  size_t x = ((const blk_t *)a)->off, y = ((const blk_t *)b)->off;
  return x < y ? -1 : x > y;
}

static void free_push(dsv4_pinned_pool_t *p, blk_t *b) {
  b->fprev = NULL;
  b->fnext = p->free_head;
  if (p->free_head)
    p->free_head->fprev = b;
  p->free_head = b;
  p->n_free++;
}

static void free_unlink(dsv4_pinned_pool_t *p, blk_t *b) {
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    p->free_head = b->fnext;
  if (b->fnext)
    b->fnext->fprev = b->fprev;
  p->n_free--;
}

/* Remove b from the address list (its bytes have gone to a neighbour). */
static void phys_unlink(blk_t *b) {
  if (b->prev)
    b->prev->next = b->next;
  if (b->next)
    b->next->prev = b->prev;
}

/* The size of a transparent huge page (x86-64: 2 MiB; arm64 with 64 KiB pages: 512 MiB), or 0 where
 * the kernel has none. */
static size_t thp_size(void) {
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
  unsigned long n = 0;
  if (!f)
    return 0;
  if (fscanf(f, "%lu", &n) != 1)
    n = 0;
  fclose(f);
  return (size_t)n;
}

/*
 * The arena: anonymous memory, committed only as it is touched or registered, starting on a huge
 * page boundary and advised to use huge pages (unless DSV4_POOL_NO_HUGEPAGE=1). A device reads
 * and writes the arena by DMA and, through its mapping, in place; where the driver and an IOMMU
 * map a huge page whole, they hold one translation for 2 MiB instead of 512 (x86-64). Where the
 * kernel has no transparent huge pages the arena is plain. NULL when it cannot be mapped.
 */
static void *map_arena(size_t bytes, size_t pg) {
  const size_t huge = thp_size();
  const char *off = getenv("DSV4_POOL_NO_HUGEPAGE");
  int advise = !(off && off[0] == '1' && off[1] == 0);
  size_t slack = advise && huge > pg && huge % pg == 0 && bytes <= SIZE_MAX - huge ? huge - pg : 0;
  uint8_t *m =
      mmap(NULL, bytes + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED)
    return NULL;
  if (slack) {
    uint8_t *a = (uint8_t *)round_up((uintptr_t)m, huge);
    if (a > m)
      munmap(m, (size_t)(a - m));
    if (m + slack > a)
      munmap(a + bytes, (size_t)(m + slack - a));
    m = a;
  }
#ifdef MADV_HUGEPAGE
  if (advise)
    (void)madvise(m, bytes, MADV_HUGEPAGE);
#endif
  return m;
}

int dsv4_pinned_pool_create(size_t bytes, dsv4_pinned_pool_t **out) {
  long page = sysconf(_SC_PAGESIZE);
  size_t pg = page > 0 ? (size_t)page : 4096;
  *out = NULL;
  if (bytes == 0 || bytes > SIZE_MAX - pg)
    return DSV4_EINVAL;
  dsv4_pinned_pool_t *p = calloc(1, sizeof(*p));
  blk_t *b = calloc(1, sizeof(*b));
  if (!p || !b) {
    free(p);
    free(b);
    return DSV4_ENOMEM;
  }
  p->bytes = round_up(bytes, pg);
  void *m = map_arena(p->bytes, pg);
  if (!m) {
    free(p);
    free(b);
    return DSV4_ENOMEM;
  }
  p->base = m;
  pthread_mutex_init(&p->mu, NULL);
  b->len = p->bytes;
  p->head = b;
  free_push(p, b);
  *out = p;
  return 0;
}

static void no_free(void *node) {
  (void)node;
}

void dsv4_pinned_pool_destroy(dsv4_pinned_pool_t *p) {
  if (!p)
    return;
  /* The tree holds pointers to blocks the list below frees: empty it without freeing them. */
  tdestroy(p->live, no_free);
  for (blk_t *b = p->head, *nx; b; b = nx) {
    nx = b->next;
    free(b);
  }
  munmap(p->base, p->bytes);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

void *dsv4_pinned_pool_base(const dsv4_pinned_pool_t *p) {
  return p->base;
}

size_t dsv4_pinned_pool_bytes(const dsv4_pinned_pool_t *p) {
  return p->bytes;
}

int dsv4_pinned_pool_owns(const dsv4_pinned_pool_t *p, const void *ptr) {
  uintptr_t a = (uintptr_t)ptr, b = (uintptr_t)p->base;
  return a >= b && a - b < p->bytes;
}

/* Take need bytes from the front of free block f: 0, or DSV4_ENOMEM with nothing changed. */
static int take(dsv4_pinned_pool_t *p, blk_t *f, size_t need) {
  blk_t *rest = NULL;
  if (f->len > need && !(rest = malloc(sizeof(*rest))))
    return DSV4_ENOMEM;
  if (!tsearch(f, &p->live, cmp_off)) {
    free(rest);
    return DSV4_ENOMEM;
  }
  free_unlink(p, f);
  if (rest) {
    /* The remainder stays free, right after the block taken. */
    *rest = (blk_t){.off = f->off + need, .len = f->len - need, .prev = f, .next = f->next};
    if (f->next)
      f->next->prev = rest;
    f->next = rest;
    f->len = need;
    free_push(p, rest);
  }
  f->used = 1;
  p->used += need;
  p->n_live++;
  return 0;
}

void *dsv4_pinned_pool_alloc(dsv4_pinned_pool_t *p, size_t n) {
  void *out = NULL;
  if (!p || n == 0 || n > p->bytes)
    return NULL;
  size_t need = round_up(n, DSV4_PINNED_ALIGN);
  pthread_mutex_lock(&p->mu);
  blk_t *f = p->free_head;
  while (f && f->len < need)
    f = f->fnext;
  if (f && take(p, f, need) == 0)
    out = p->base + f->off;
  pthread_mutex_unlock(&p->mu);
  return out;
}

int dsv4_pinned_pool_free(dsv4_pinned_pool_t *p, void *ptr) {
  if (!p || !dsv4_pinned_pool_owns(p, ptr))
    return DSV4_ENOTFOUND;
  blk_t key = {.off = (size_t)((uint8_t *)ptr - p->base)};
  pthread_mutex_lock(&p->mu);
  void **hit = tfind(&key, &p->live, cmp_off);
  if (!hit) {
    pthread_mutex_unlock(&p->mu);
    return DSV4_EINVAL;
  }
  blk_t *b = *hit;
  tdelete(&key, &p->live, cmp_off);
  b->used = 0;
  p->used -= b->len;
  p->n_live--;
  /* Merge with free neighbours, so the arena holds no two adjacent free runs. */
  if (b->next && !b->next->used) {
    blk_t *nx = b->next;
    free_unlink(p, nx);
    b->len += nx->len;
    phys_unlink(nx);
    free(nx);
  }
  if (b->prev && !b->prev->used) {
    b->prev->len += b->len;
    phys_unlink(b);
    free(b);
  } else {
    free_push(p, b);
  }
  pthread_mutex_unlock(&p->mu);
  return 0;
}

void dsv4_pinned_pool_stats(dsv4_pinned_pool_t *p, dsv4_pinned_stats_t *out) {
  pthread_mutex_lock(&p->mu);
  *out = (dsv4_pinned_stats_t){
      .total = p->bytes, .used = p->used, .blocks = p->n_live, .free_extents = p->n_free};
  for (const blk_t *f = p->free_head; f; f = f->fnext)
    if (f->len > out->largest_free)
      out->largest_free = f->len;
  pthread_mutex_unlock(&p->mu);
}

void *dsv4_pinned_alloc(dsv4_pinned_pool_t *p, size_t n, int *fell_back) {
  *fell_back = 0;
  if (n > SIZE_MAX - DSV4_PINNED_ALIGN)
    return NULL;
  /* aligned_alloc takes a multiple of the alignment (C11 7.22.3.1). */
  size_t sz = n ? round_up(n, DSV4_PINNED_ALIGN) : DSV4_PINNED_ALIGN;
  if (p) {
    void *b = dsv4_pinned_pool_alloc(p, sz);
    if (b)
      return b;
    *fell_back = 1;
  }
  return aligned_alloc(DSV4_PINNED_ALIGN, sz);
}

void dsv4_pinned_free(dsv4_pinned_pool_t *p, void *ptr) {
  if (!ptr)
    return;
  if (p && dsv4_pinned_pool_owns(p, ptr)) {
    int rc = dsv4_pinned_pool_free(p, ptr);
    /* Inside the arena and no live block: a double free. The heap must never see it. */
    assert(rc == 0);
    (void)rc;
    return;
  }
  free(ptr);
}

/* AnonHugePages of the mappings that overlap [base, base + bytes), from /proc/self/smaps. */
static size_t huge_bytes(const uint8_t *base, size_t bytes) {
  FILE *f = fopen("/proc/self/smaps", "r");
  char line[512];
  int inside = 0;
  size_t kib_total = 0;
  if (!f)
    return 0;
  uintptr_t b0 = (uintptr_t)base, b1 = b0 + bytes;
  size_t overlap_kib = 0;
  while (fgets(line, sizeof(line), f)) {
    unsigned long lo, hi, kib;
    char *dash = strchr(line, '-'), *sp = strchr(line, ' ');
    if (dash && sp && dash < sp && sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
      if (lo >= b1)
        break; /* smaps lists mappings by address */
      inside = hi > b0;
      /* A mapping merged with a neighbour counts no more than its part in the arena. */
      if (inside)
        overlap_kib = ((hi < b1 ? hi : b1) - (lo > b0 ? lo : b0)) >> 10;
    } else if (inside && sscanf(line, "AnonHugePages: %lu kB", &kib) == 1)
      kib_total += kib < overlap_kib ? kib : overlap_kib;
  }
  fclose(f);
  return kib_total << 10;
}

void dsv4_pinned_pool_placement(const dsv4_pinned_pool_t *p, dsv4_pinned_placement_t *out) {
  out->first_node = dsv4_page_numa_node(p->base);
  out->last_node = dsv4_page_numa_node(p->base + p->bytes - 1);
  out->huge_bytes = huge_bytes(p->base, p->bytes);
}
