/*
 * The staged CPU backend (cpu_staged.h): device addresses are made up, translated back to the CPU
 * backend's buffers only inside this file, so any use of them as host pointers outside it faults.
 */
#include "cpu_staged.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-layout.h"

/* Device addresses start here: non-canonical on x86-64 (and beyond any 48-bit user address), so a
 * host load or store through one faults instead of silently reading the right bytes. */
#define DEV_BASE ((uintptr_t)0xdead000000000000ull)
#define DEV_ALIGN ((uintptr_t)4096)
/* What dst holds between a download_async and the sync that delivers it. */
#define DEFERRED_POISON 0xa5

typedef struct {
  uintptr_t dev;
  dsv4_devbuf_t real; /* the inner CPU backend's buffer */
} staged_buf_t;

/* A host range given to host_register, and the made-up device window host_alias maps it at. */
typedef struct {
  uintptr_t p;
  size_t n;
  uintptr_t dev;
} host_range_t;

/* A download_async not yet delivered (the source bytes as they were when it was queued), or what
 * a launch wrote in place into registered host memory (host_alias): copied into dst by the next
 * sync, or, when queued inside an overlapped batch's phases, by that batch's wait. */
typedef struct {
  void *dst;
  void *bytes;
  size_t n;
  int in_batch;    /* queued between a batch's UPLOADS and SUBMITTED phases */
  uint64_t ticket; /* that batch's, from its SUBMITTED phase (0 until then) */
} deferred_t;

/* A download_async of a batch's DOWNLOADS phase (overlap mode): src is read when the batch is
 * waited for, the latest moment backend.h allows, so a later batch that wrote it first shows. */
typedef struct {
  void *dst;
  dsv4_devbuf_t src;
  size_t off, n;
  uint64_t ticket; /* 0 until the batch's SUBMITTED phase */
} late_read_t;

/* Registered host memory a launch read in place (host_alias), as it was then: backend.h has the
 * caller leave it unchanged until the sync or batch_wait that ends the batch, which checks that
 * it did (a device may read it at any moment until then). */
typedef struct {
  const uint8_t *host;
  uint8_t *bytes;
  size_t n;
  uint64_t ticket; /* the batch's, from its SUBMITTED phase (0 until then) */
} in_place_read_t;

/* The staging bytes an insert wrote as q_out (made-up device addresses lo .. hi), by the launch
 * numbered launch (stats.launches once it was counted): what a marked download may copy. */
typedef struct {
  uintptr_t lo, hi;
  size_t launch;
  uint64_t ticket; /* the batch's, from its SUBMITTED phase (0 until then) */
} q_write_t;

typedef struct {
  dsv4_backend_t base; /* first */
  dsv4_backend_t *inner;
  dsv4_backend_ops_t ops;
  staged_buf_t *bufs;
  size_t n_bufs, cap_bufs;
  uintptr_t next_dev;
  host_range_t *ranges;
  size_t n_ranges, cap_ranges;
  deferred_t *deferred;
  size_t n_deferred, cap_deferred;
  /* Overlap mode (cpu_staged_overlap): the batch phase, the reads not yet made, the tickets. */
  int phase;
  late_read_t *late;
  size_t n_late, cap_late;
  in_place_read_t *reads;
  size_t n_reads, cap_reads;
  int reads_lost; /* a read not recorded for want of memory: the checks are off from there */
  /* Marks (backend.h): the launches each one follows; the q_out writes since the last sync. */
  size_t mark_launches[DSV4_MARKS];
  q_write_t *writes;
  size_t n_writes, cap_writes;
  int writes_lost; /* a write not recorded for want of memory: marked downloads are unchecked */
  uint64_t next_ticket, waited_ticket;
  dsv4_test_cpu_staged_stats_t stats;
  int alias; /* host_alias answers (0 with DSV4_CUDA_NO_ALIAS=1, as the CUDA backend reads it) */
  /* Host scratch of the fused decode path's stand-in (q_out the CPU backend computes and drops). */
  uint16_t *q_scratch;
  size_t q_scratch_bytes;
} staged_t;

/* The array arr (n elements of size elem used of *cap) with room for one more, doubling from
 * first: arr itself, or its reallocation; NULL (out of memory) with arr and *cap unchanged. */
static void *grow(void *arr, size_t n, size_t *cap, size_t elem, size_t first) {
  if (n < *cap)
    return arr;
  size_t c = *cap ? 2 * *cap : first;
  void *p = realloc(arr, c * elem);
  if (p)
    *cap = c;
  return p;
}

static staged_t *staged_of(dsv4_backend_t *be) {
  return (staged_t *)be;
}

/* The host address of [p, p + n) when it lies inside the device window of a registered range
 * (host_alias), else NULL. */
static void *window_host(staged_t *s, const void *p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < s->n_ranges; i++) {
    const host_range_t *r = &s->ranges[i];
    if (a >= r->dev && a - r->dev <= r->n && n <= r->n - (a - r->dev))
      return (void *)(r->p + (a - r->dev));
  }
  return NULL;
}

/* A launch reads the n host bytes at host in place: keep them as they are now (in_place_read_t). */
static void read_record(staged_t *s, const void *host, size_t n) {
  void *grown = grow(s->reads, s->n_reads, &s->cap_reads, sizeof(*s->reads), 16);
  uint8_t *bytes = grown ? malloc(n) : NULL;
  if (!bytes) {
    s->reads_lost = 1;
    return;
  }
  s->reads = grown;
  memcpy(bytes, host, n);
  s->reads[s->n_reads++] = (in_place_read_t){host, bytes, n, 0};
}

/* The end of batch ticket (every batch when 0): the host memory its launches read in place must
 * hold what they read; a caller that changed it before this point would have fed a device other
 * bytes than it checked, so the test stops here. Before any write in place is delivered. */
static void reads_check(staged_t *s, uint64_t ticket) {
  size_t kept = 0;
  for (size_t i = 0; i < s->n_reads; i++) {
    in_place_read_t *r = &s->reads[i];
    if (ticket && r->ticket != ticket) {
      s->reads[kept++] = *r;
      continue;
    }
    if (!s->reads_lost && memcmp(r->host, r->bytes, r->n)) {
      fprintf(stderr,
              "cpu_staged: %zu bytes of host memory a launch read in place changed "
              "before its batch ended\n",
              r->n);
      abort();
    }
    free(r->bytes);
  }
  s->n_reads = kept;
}

/* The insert just counted writes n staging bytes at dev as q_out (q_write_t). */
static void q_write_record(staged_t *s, uintptr_t dev, size_t n) {
  void *grown = grow(s->writes, s->n_writes, &s->cap_writes, sizeof(*s->writes), 16);
  if (!grown) {
    s->writes_lost = 1;
    return;
  }
  s->writes = grown;
  s->writes[s->n_writes++] = (q_write_t){dev, dev + n, s->stats.launches, 0};
}

/* Keep the writes of batches other than ticket (none when ticket is 0: a sync ends them all). */
static void q_writes_end(staged_t *s, uint64_t ticket) {
  size_t kept = 0;
  for (size_t i = 0; i < s->n_writes && ticket; i++)
    if (s->writes[i].ticket != ticket)
      s->writes[kept++] = s->writes[i];
  s->n_writes = kept;
  if (!kept)
    s->writes_lost = 0; /* nothing left that a lost record could have covered */
}

/* Whether launches up to number upto wrote every byte of lo .. hi and none after them wrote any:
 * then a download that waits for those launches only copies what the caller asked for. */
static int q_writes_cover(const staged_t *s, uintptr_t lo, uintptr_t hi, size_t upto) {
  for (size_t i = 0; i < s->n_writes; i++)
    if (s->writes[i].launch > upto && s->writes[i].lo < hi && lo < s->writes[i].hi)
      return 0;
  while (lo < hi) {
    size_t i = 0;
    while (i < s->n_writes &&
           !(s->writes[i].launch <= upto && s->writes[i].lo <= lo && lo < s->writes[i].hi))
      i++;
    if (i == s->n_writes)
      return 0;
    lo = s->writes[i].hi;
  }
  return 1;
}

/* The host address of [p, p + n) when it lies inside one buffer, or inside the device window of a
 * registered range (a read in place: read_record), else NULL. */
static void *to_host(staged_t *s, const void *p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < s->n_bufs; i++) {
    staged_buf_t *b = &s->bufs[i];
    if (a >= b->dev && a - b->dev <= b->real.size && n <= b->real.size - (a - b->dev))
      return (uint8_t *)b->real.ptr + (a - b->dev);
  }
  void *h = window_host(s, p, n);
  if (h && n)
    read_record(s, h, n);
  return h;
}

/* The buffer a devbuf names: its address is a buffer's start, its size at most that buffer's. */
static staged_buf_t *find_buf(staged_t *s, const dsv4_devbuf_t *d) {
  for (size_t i = 0; d && i < s->n_bufs; i++)
    if (s->bufs[i].dev == (uintptr_t)d->ptr && d->size <= s->bufs[i].real.size)
      return &s->bufs[i];
  return NULL;
}

static void st_destroy(dsv4_backend_t *be) {
  staged_t *s = staged_of(be);
  /* For the integration tests, which see the daemon only from outside: how many batches overlapped
   * another, appended to the file DSV4_TEST_STAGED_STATS names. */
  const char *path = getenv("DSV4_TEST_STAGED_STATS");
  FILE *fp = path && s->ops.batch_phase ? fopen(path, "a") : NULL;
  if (fp) {
    fprintf(fp, "overlapped %zu\n", s->stats.overlapped);
    fclose(fp);
  }
  for (size_t i = 0; i < s->n_deferred; i++)
    free(s->deferred[i].bytes);
  free(s->deferred);
  for (size_t i = 0; i < s->n_reads; i++)
    free(s->reads[i].bytes);
  free(s->reads);
  free(s->late);
  free(s->writes);
  for (size_t i = 0; i < s->n_bufs; i++)
    s->inner->ops->buf_free(s->inner, &s->bufs[i].real);
  dsv4_backend_close(s->inner);
  free(s->bufs);
  free(s->ranges);
  free(s->q_scratch);
  free(s);
}

/* The scratch for n bytes of q_out, or NULL (out of memory). The inner backend is done with it when
 * its call returns (the CPU backend computes in the call). */
static uint16_t *q_scratch(staged_t *s, size_t n) {
  if (n > s->q_scratch_bytes) {
    uint16_t *p = realloc(s->q_scratch, n);
    if (!p)
      return NULL;
    s->q_scratch = p;
    s->q_scratch_bytes = n;
  }
  return s->q_scratch;
}

/* The registered range the n host bytes at p lie inside, or NULL. */
static const host_range_t *range_of(const staged_t *s, const void *p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < s->n_ranges; i++)
    if (a >= s->ranges[i].p && a - s->ranges[i].p <= s->ranges[i].n &&
        n <= s->ranges[i].n - (a - s->ranges[i].p))
      return &s->ranges[i];
  return NULL;
}

/* 1 when the n host bytes at p lie inside one registered range. */
static int registered(const staged_t *s, const void *p, size_t n) {
  return range_of(s, p, n) != NULL;
}

/* As cudaHostRegister: a range overlapping one already registered is refused. */
static int st_host_register(dsv4_backend_t *be, void *p, size_t n) {
  staged_t *s = staged_of(be);
  uintptr_t a = (uintptr_t)p;
  if (!p || !n || a > UINTPTR_MAX - n)
    return DSV4_EINVAL;
  for (size_t i = 0; i < s->n_ranges; i++)
    if (a < s->ranges[i].p + s->ranges[i].n && s->ranges[i].p < a + n)
      return DSV4_EINVAL;
  void *grown = grow(s->ranges, s->n_ranges, &s->cap_ranges, sizeof(*s->ranges), 8);
  if (!grown)
    return DSV4_ENOMEM;
  s->ranges = grown;
  s->ranges[s->n_ranges++] = (host_range_t){a, n, s->next_dev};
  s->next_dev += (n + DEV_ALIGN - 1) / DEV_ALIGN * DEV_ALIGN + DEV_ALIGN;
  s->stats.live_registrations = s->n_ranges;
  return 0;
}

/* As CUDA's: aligned registered memory at its device window, which launches read and write in
 * place (what an insert writes there arrives at the batch's end: st_insert). */
static void *st_host_alias(dsv4_backend_t *be, const void *p, size_t n) {
  staged_t *s = staged_of(be);
  uintptr_t a = (uintptr_t)p;
  const host_range_t *r =
      s->alias && p && n && !(a & (DSV4_ALIAS_ALIGN - 1)) ? range_of(s, p, n) : NULL;
  if (!r)
    return NULL;
  s->stats.aliases++;
  return (void *)(r->dev + (a - r->p));
}

/* Unregistering what was never registered is a bug of the caller: fail loudly. */
static void st_host_unregister(dsv4_backend_t *be, void *p) {
  staged_t *s = staged_of(be);
  for (size_t i = 0; i < s->n_ranges; i++)
    if (s->ranges[i].p == (uintptr_t)p) {
      s->ranges[i] = s->ranges[--s->n_ranges];
      s->stats.live_registrations = s->n_ranges;
      return;
    }
  fprintf(stderr, "cpu_staged: host_unregister(%p) names no registered range\n", p);
  abort();
}

static int st_alloc(dsv4_backend_t *be, size_t size, dsv4_devbuf_t *out) {
  staged_t *s = staged_of(be);
  if (!out)
    return DSV4_EINVAL;
  void *grown = grow(s->bufs, s->n_bufs, &s->cap_bufs, sizeof(*s->bufs), 16);
  if (!grown)
    return DSV4_ENOMEM;
  s->bufs = grown;
  staged_buf_t *b = &s->bufs[s->n_bufs];
  int rc = s->inner->ops->buf_alloc(s->inner, size, &b->real);
  if (rc)
    return rc;
  b->dev = s->next_dev;
  /* A guard gap after each buffer: a pointer one past the end of one is inside no other. */
  s->next_dev += (size + DEV_ALIGN - 1) / DEV_ALIGN * DEV_ALIGN + DEV_ALIGN;
  s->n_bufs++;
  out->ptr = (void *)b->dev;
  out->size = size;
  return 0;
}

static void st_free(dsv4_backend_t *be, dsv4_devbuf_t *d) {
  staged_t *s = staged_of(be);
  staged_buf_t *b = find_buf(s, d);
  if (!b)
    return;
  s->inner->ops->buf_free(s->inner, &b->real);
  *b = s->bufs[--s->n_bufs];
  d->ptr = NULL;
  d->size = 0;
}

static int st_upload(dsv4_backend_t *be, const dsv4_devbuf_t *dst, size_t off, const void *src,
                     size_t n) {
  staged_t *s = staged_of(be);
  staged_buf_t *b = find_buf(s, dst);
  if (!b || off > dst->size || n > dst->size - off || (n && !src))
    return DSV4_EINVAL;
  /* The source must be host memory: a device address here would be a staging bug. */
  if (n && to_host(s, src, 0))
    return DSV4_EINVAL;
  s->stats.uploads++;
  s->stats.registered_uploads += n && registered(s, src, n);
  return s->inner->ops->upload(s->inner, &b->real, off, src, n);
}

/* The buffer of a download's src, or NULL when the download is refused: src is none of this
 * backend's buffers, the range runs past it, or dst is missing or a device address. */
static staged_buf_t *download_src(staged_t *s, const void *dst, const dsv4_devbuf_t *src,
                                  size_t off, size_t n) {
  staged_buf_t *b = find_buf(s, src);
  if (!b || off > src->size || n > src->size - off || (n && !dst))
    return NULL;
  return n && to_host(s, dst, 0) ? NULL : b;
}

static int st_download(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                       size_t n) {
  staged_t *s = staged_of(be);
  staged_buf_t *b = download_src(s, dst, src, off, n);
  if (!b)
    return DSV4_EINVAL;
  s->stats.downloads++;
  s->stats.registered_downloads += n && registered(s, dst, n);
  return s->inner->ops->download(s->inner, dst, &b->real, off, n);
}

/* Queue n bytes (malloc'd; owned from here on success) for dst, which holds DEFERRED_POISON until
 * they are delivered (deferred_t). */
static int deferred_queue(staged_t *s, void *dst, void *bytes, size_t n) {
  void *grown = grow(s->deferred, s->n_deferred, &s->cap_deferred, sizeof(*s->deferred), 8);
  if (!grown)
    return DSV4_ENOMEM;
  s->deferred = grown;
  s->deferred[s->n_deferred++] = (deferred_t){dst, bytes, n, s->phase != 0, 0};
  memset(dst, DEFERRED_POISON, n);
  return 0;
}

/* What a launch of this batch wrote in place over the n host bytes at host (the newest such
 * write), as the device's next launch would read it back, or NULL when none did. */
static const void *deferred_pending(const staged_t *s, const void *host, size_t n) {
  const uint8_t *a = host;
  for (size_t i = s->n_deferred; i-- > 0;) {
    const deferred_t *d = &s->deferred[i];
    const uint8_t *b = d->dst;
    if (!d->ticket && a >= b && (size_t)(a - b) <= d->n && n <= d->n - (size_t)(a - b))
      return (const uint8_t *)d->bytes + (a - b);
  }
  return NULL;
}

/* Deliver the queued bytes of batch ticket (every one when ticket is 0), in queue order. */
static void deferred_deliver(staged_t *s, uint64_t ticket) {
  size_t kept = 0;
  for (size_t i = 0; i < s->n_deferred; i++) {
    deferred_t *d = &s->deferred[i];
    if (ticket && d->ticket != ticket) {
      s->deferred[kept++] = *d;
      continue;
    }
    memcpy(d->dst, d->bytes, d->n);
    free(d->bytes);
  }
  s->n_deferred = kept;
}

static int late_queue(staged_t *s, void *dst, const dsv4_devbuf_t *src, size_t off, size_t n) {
  void *grown = grow(s->late, s->n_late, &s->cap_late, sizeof(*s->late), 8);
  if (!grown)
    return DSV4_ENOMEM;
  s->late = grown;
  s->late[s->n_late++] = (late_read_t){dst, *src, off, n, 0};
  memset(dst, DEFERRED_POISON, n);
  s->stats.async_downloads++;
  s->stats.registered_downloads += registered(s, dst, n);
  return 0;
}

/* Make the reads of batch ticket (every batch's when ticket is 0), in queue order. A source freed
 * since is a bug of the caller: it fails the wait. */
static int late_deliver(staged_t *s, uint64_t ticket) {
  size_t kept = 0;
  int rc = 0;
  for (size_t i = 0; i < s->n_late; i++) {
    late_read_t *r = &s->late[i];
    if (ticket && r->ticket != ticket) {
      s->late[kept++] = *r;
      continue;
    }
    staged_buf_t *b = find_buf(s, &r->src);
    if (!b) {
      fprintf(stderr, "cpu_staged: a batch's download source was freed before its wait\n");
      rc = DSV4_EBACKEND;
      continue;
    }
    int drc = s->inner->ops->download(s->inner, r->dst, &b->real, r->off, r->n);
    if (!rc)
      rc = drc;
  }
  s->n_late = kept;
  return rc;
}

static int st_batch_phase(dsv4_backend_t *be, int phase, uint64_t *ticket) {
  staged_t *s = staged_of(be);
  if (phase < DSV4_BATCH_UPLOADS || phase > DSV4_BATCH_SUBMITTED || phase != s->phase % 4 + 1)
    return DSV4_EINVAL;
  if (phase == DSV4_BATCH_SUBMITTED) {
    if (!ticket)
      return DSV4_EINVAL;
    /* backend.h: at most two batches between their submission and their wait. */
    if (s->next_ticket - s->waited_ticket >= 2) {
      fprintf(stderr, "cpu_staged: a third batch submitted before the first was waited for\n");
      abort();
    }
    /* One batch still in flight: this one overlaps it. */
    s->stats.overlapped += s->next_ticket - s->waited_ticket == 1;
    *ticket = ++s->next_ticket;
    for (size_t i = 0; i < s->n_late; i++)
      if (!s->late[i].ticket)
        s->late[i].ticket = *ticket;
    for (size_t i = 0; i < s->n_deferred; i++)
      if (s->deferred[i].in_batch && !s->deferred[i].ticket)
        s->deferred[i].ticket = *ticket;
    /* Every launch since the last sync or submission is this batch's (one queued before its
     * UPLOADS phase too: the engine's q half). */
    for (size_t i = 0; i < s->n_reads; i++)
      if (!s->reads[i].ticket)
        s->reads[i].ticket = *ticket;
    for (size_t i = 0; i < s->n_writes; i++)
      if (!s->writes[i].ticket)
        s->writes[i].ticket = *ticket;
    s->phase = 0;
    return 0;
  }
  s->phase = phase;
  return 0;
}

static int st_batch_wait(dsv4_backend_t *be, uint64_t ticket) {
  staged_t *s = staged_of(be);
  /* A sync since the batch was submitted has waited for it already. */
  if (ticket && ticket <= s->waited_ticket)
    return 0;
  if (ticket != s->waited_ticket + 1 || ticket > s->next_ticket) {
    fprintf(stderr, "cpu_staged: batch %llu waited for out of order\n", (unsigned long long)ticket);
    abort();
  }
  s->waited_ticket = ticket;
  s->stats.batch_waits++;
  reads_check(s, ticket);
  q_writes_end(s, ticket);
  int rc = s->inner->ops->sync(s->inner);
  int lrc = late_deliver(s, ticket);
  deferred_deliver(s, ticket);
  return rc ? rc : lrc;
}

/*
 * As a device's copy engine: the bytes are read now (later work on the queue may overwrite them)
 * and reach dst at the next sync. Until then dst holds DEFERRED_POISON, so a caller that reads it
 * early sees bytes no backend computes instead of, by luck, the right ones.
 */
static int st_download_async(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                             size_t n) {
  staged_t *s = staged_of(be);
  staged_buf_t *b = download_src(s, dst, src, off, n);
  if (!b)
    return DSV4_EINVAL;
  if (n == 0)
    return 0;
  if (s->phase == DSV4_BATCH_DOWNLOADS)
    return late_queue(s, dst, src, off, n);
  void *bytes = malloc(n);
  if (!bytes)
    return DSV4_ENOMEM;
  int rc = s->inner->ops->download(s->inner, bytes, &b->real, off, n);
  if (!rc)
    rc = deferred_queue(s, dst, bytes, n);
  if (rc) {
    free(bytes);
    return rc;
  }
  s->stats.async_downloads++;
  s->stats.registered_downloads += registered(s, dst, n);
  return 0;
}

/* Translate field f of a launch (n bytes from it); a field that is not inside a buffer refuses the
 * launch. */
#define XLATE(s, f, n)                                                                             \
  do {                                                                                             \
    void *h_ = to_host((s), (f), (n));                                                             \
    if (!h_)                                                                                       \
      return DSV4_EINVAL;                                                                          \
    (f) = h_;                                                                                      \
  } while (0)

static int st_map(dsv4_backend_t *be, const dsv4_map_args_t *a) {
  staged_t *s = staged_of(be);
  if (!a)
    return DSV4_EINVAL;
  dsv4_map_args_t h = *a;
  size_t n = a->n_tokens, nseg = a->n_segments;
  XLATE(s, h.positions, n * sizeof(int64_t));
  XLATE(s, h.tok_seg, n * sizeof(int32_t));
  XLATE(s, h.seg_first_lb, nseg * sizeof(int64_t));
  XLATE(s, h.seg_bt_off, nseg * sizeof(uint32_t));
  XLATE(s, h.seg_bt_len, nseg * sizeof(uint32_t));
  /* Slots written into registered host memory (host_alias) arrive there at the batch's end, as
   * an insert's q_out does (st_insert); the insert reads them back before that. */
  int64_t *in_place = n ? window_host(s, h.slots, n * sizeof(int64_t)) : NULL;
  if (!in_place)
    XLATE(s, h.slots, n * sizeof(int64_t));
  uint64_t bt = 0;
  for (size_t i = 0; i < nseg; i++)
    if ((uint64_t)h.seg_bt_off[i] + h.seg_bt_len[i] > bt)
      bt = (uint64_t)h.seg_bt_off[i] + h.seg_bt_len[i];
  if (nseg)
    XLATE(s, h.block_table, bt * sizeof(int32_t));
  if (in_place && !(h.slots = malloc(n * sizeof(int64_t))))
    return DSV4_ENOMEM;
  s->stats.launches++;
  int rc = s->inner->ops->map_slots(s->inner, &h);
  if (in_place && !rc)
    rc = deferred_queue(s, in_place, h.slots, n * sizeof(int64_t));
  if (in_place && rc)
    free(h.slots);
  return rc;
}

static int st_mark(dsv4_backend_t *be, unsigned k) {
  staged_t *s = staged_of(be);
  if (k >= DSV4_MARKS)
    return DSV4_EINVAL;
  s->mark_launches[k] = s->stats.launches;
  s->stats.marks++;
  return 0;
}

/*
 * As a device's copy engine that waits for mark k's launches only: where those launches wrote
 * every byte asked for, and none since, the bytes the other downloads deliver; otherwise the
 * copy may run before the launch that writes them, and dst receives DEFERRED_POISON, bytes no
 * backend computes, so that the caller's answer shows it (tests/unit/inv_q_pieces.c).
 */
static int st_download_marked(dsv4_backend_t *be, unsigned k, void *dst, const dsv4_devbuf_t *src,
                              size_t off, size_t n) {
  staged_t *s = staged_of(be);
  if (k >= DSV4_MARKS || !download_src(s, dst, src, off, n))
    return DSV4_EINVAL;
  s->stats.marked_downloads++;
  const uintptr_t lo = (uintptr_t)src->ptr + off;
  if (n == 0 || s->writes_lost || q_writes_cover(s, lo, lo + n, s->mark_launches[k]))
    return st_download_async(be, dst, src, off, n);
  s->stats.early_marked++;
  void *bytes = malloc(n);
  if (!bytes)
    return DSV4_ENOMEM;
  memset(bytes, DEFERRED_POISON, n);
  int rc = deferred_queue(s, dst, bytes, n);
  if (rc)
    free(bytes);
  return rc;
}

static int st_insert(dsv4_backend_t *be, const dsv4_insert_args_t *a) {
  staged_t *s = staged_of(be);
  if (!a)
    return DSV4_EINVAL;
  dsv4_insert_args_t h = *a;
  size_t n = a->n_tokens, q_bytes = n * a->heads * DSV4_HEAD_DIM * sizeof(uint16_t);
  XLATE(s, h.q, q_bytes);
  XLATE(s, h.kv, n * DSV4_HEAD_DIM * sizeof(uint16_t));
  XLATE(s, h.positions, n * sizeof(int64_t));
  XLATE(s, h.slots, n * sizeof(int64_t));
  /* Slots the producer wrote in place are read as it wrote them (st_map). */
  const void *pending = n ? deferred_pending(s, h.slots, n * sizeof(int64_t)) : NULL;
  if (pending)
    h.slots = pending;
  /* The fused decode path's KV-only insert (DSV4_BE_ATTN_FUSED_Q): the CPU backend writes q_out
   * with the records, so it gets a scratch q_out that nobody reads. */
  uint16_t *in_place = NULL; /* q_out written into registered host memory (host_alias) */
  if (!h.q_out && h.write_kv && n) {
    if (!(h.q_out = q_scratch(s, q_bytes)))
      return DSV4_ENOMEM;
  } else if (n && (in_place = window_host(s, h.q_out, q_bytes)) != NULL) {
    h.q_out = NULL; /* a buffer of its own, once the other arguments are translated */
  } else {
    XLATE(s, h.q_out, q_bytes);
  }
  if (h.kv_norm_weight)
    XLATE(s, h.kv_norm_weight, DSV4_HEAD_DIM * sizeof(float));
  if (h.write_kv)
    XLATE(s, h.cache, (size_t)a->n_blocks * a->stride);
  /* As a device's launch, an insert whose q_out is in place puts its bytes in host memory when the
   * batch completes (its sync or wait); until then that memory holds DEFERRED_POISON. */
  if (in_place && !(h.q_out = malloc(q_bytes)))
    return DSV4_ENOMEM;
  /* The RoPE table is a host structure by contract (a device backend mirrors its rows). */
  s->stats.launches++;
  if (!in_place && a->q_out) /* into staging (not in place, not the fused path's scratch) */
    q_write_record(s, (uintptr_t)a->q_out, q_bytes);
  int rc = s->inner->ops->qkv_insert(s->inner, &h);
  if (in_place && !rc)
    rc = deferred_queue(s, in_place, h.q_out, q_bytes);
  if (in_place && rc)
    free(h.q_out);
  return rc;
}

/* The engine's windows of attention launch h (its arrays translated, backend.h): equal to those
 * dsv4_attn_windows builds from its tables, as a device backend reads them in their place, or the
 * launch is refused (DSV4_EINVAL). The CPU backend behind walks the tables: h->win becomes NULL. */
static int st_windows_check(staged_t *s, dsv4_attn_args_t *h) {
  const size_t bytes = (size_t)h->n_tokens * sizeof(dsv4_attn_win_t);
  if ((uintptr_t)h->win % 16 != 0) /* a device backend reads them as 16-byte words */
    return DSV4_EINVAL;
  XLATE(s, h->win, bytes);
  dsv4_attn_win_t *w = malloc(bytes ? bytes : 1);
  if (!w)
    return DSV4_ENOMEM;
  const int same = dsv4_attn_windows(h, w) == 0 && memcmp(w, h->win, bytes) == 0;
  free(w);
  if (!same) {
    fprintf(stderr, "cpu_staged: the engine's windows differ from its tables\n");
    return DSV4_EINVAL;
  }
  s->stats.windows++;
  h->win = NULL;
  return 0;
}

static int st_attn(dsv4_backend_t *be, const dsv4_attn_args_t *a) {
  staged_t *s = staged_of(be);
  if (!a)
    return DSV4_EINVAL;
  dsv4_attn_args_t h = *a;
  size_t n = a->n_tokens, nseg = a->n_segments;
  size_t q_bytes = n * a->heads * DSV4_HEAD_DIM * sizeof(uint16_t);
  XLATE(s, h.q, q_bytes);
  XLATE(s, h.positions, n * sizeof(int64_t));
  XLATE(s, h.tok_seg, n * sizeof(int32_t));
  XLATE(s, h.seg_p0, nseg * sizeof(int64_t));
  XLATE(s, h.seg_first_lb, nseg * sizeof(int64_t));
  XLATE(s, h.seg_bt_off, nseg * sizeof(uint32_t));
  XLATE(s, h.seg_bt_len, nseg * sizeof(uint32_t));
  if (nseg)
    XLATE(s, h.block_table, (size_t)a->bt_entries * sizeof(int32_t));
  XLATE(s, h.cache, (size_t)a->n_blocks * a->stride);
  if (h.sink)
    XLATE(s, h.sink, a->heads * sizeof(float));
  XLATE(s, h.out, q_bytes);
  if (h.lse)
    XLATE(s, h.lse, n * a->heads * sizeof(float));
  if (h.c_cache) {
    XLATE(s, h.c_cache, (size_t)a->c_n_blocks * a->stride);
    XLATE(s, h.seg_c_first_lb, nseg * sizeof(int64_t));
    XLATE(s, h.seg_cbt_off, nseg * sizeof(uint32_t));
    XLATE(s, h.seg_cbt_len, nseg * sizeof(uint32_t));
    if (nseg)
      XLATE(s, h.c_block_table, (size_t)a->c_bt_entries * sizeof(int32_t));
    if (h.c_sel)
      XLATE(s, h.c_sel, n * a->c_sel_stride * sizeof(int32_t));
  }
  s->stats.launches++;
  s->stats.attn_launches++;
  if (h.win) {
    int rc = st_windows_check(s, &h);
    if (rc)
      return rc;
  }
  /* The fused decode path (DSV4_BE_ATTN_FUSED_Q): q is the raw q, whose q_out the CPU backend's
   * insert computes first (without touching the cache), the bytes a device's attention computes
   * itself. */
  if (h.q_raw && n) {
    uint16_t *q_out = q_scratch(s, q_bytes);
    if (!q_out)
      return DSV4_ENOMEM;
    dsv4_insert_args_t qa = {.n_tokens = a->n_tokens,
                             .heads = a->heads,
                             .q = h.q,
                             .kv = h.q, /* not read without write_kv */
                             .positions = h.positions,
                             .slots = h.positions, /* read, unused without write_kv */
                             .rope = a->rope,
                             .eps = a->eps,
                             .write_kv = 0,
                             .q_out = q_out};
    int rc = s->inner->ops->qkv_insert(s->inner, &qa);
    if (rc)
      return rc;
    h.q = q_out;
    h.q_raw = 0;
  }
  return s->inner->ops->attention(s->inner, &h);
}

/* The entry tables of a compress or indexer launch (the same field names in both). */
#define XLATE_CTABLE(s, h, nseg)                                                                   \
  do {                                                                                             \
    XLATE(s, (h).seg_c_first_lb, (nseg) * sizeof(int64_t));                                        \
    XLATE(s, (h).seg_cbt_off, (nseg) * sizeof(uint32_t));                                          \
    XLATE(s, (h).seg_cbt_len, (nseg) * sizeof(uint32_t));                                          \
    if (nseg)                                                                                      \
      XLATE(s, (h).c_block_table, (size_t)(h).c_bt_entries * sizeof(int32_t));                     \
  } while (0)

static int st_compress(dsv4_backend_t *be, const dsv4_compress_args_t *a) {
  staged_t *s = staged_of(be);
  if (!a)
    return DSV4_EINVAL;
  dsv4_compress_args_t h = *a;
  size_t n = a->n_tokens, nseg = a->n_segments, coff = a->ratio == 4 ? 2 : 1;
  XLATE(s, h.positions, n * sizeof(int64_t));
  XLATE(s, h.tok_seg, n * sizeof(int32_t));
  XLATE(s, h.seg_p0, nseg * sizeof(int64_t));
  XLATE(s, h.seg_slot, nseg * sizeof(uint32_t));
  XLATE(s, h.ckv, n * 2 * coff * DSV4_HEAD_DIM * sizeof(float));
  XLATE(s, h.ring, (size_t)a->n_slots * DSV4_RING_FLOATS(a->ratio) * sizeof(float));
  XLATE(s, h.ape, (size_t)a->ratio * coff * DSV4_HEAD_DIM * sizeof(float));
  XLATE(s, h.norm_weight, DSV4_HEAD_DIM * sizeof(float));
  XLATE(s, h.c_cache, (size_t)a->c_n_blocks * a->stride);
  if (a->ratio == 4) {
    XLATE(s, h.ikv, n * 512 * sizeof(float));
    XLATE(s, h.i_ape, 4 * 256 * sizeof(float));
    XLATE(s, h.i_norm_weight, 128 * sizeof(float));
    XLATE(s, h.i_cache, (size_t)a->c_n_blocks * DSV4_INDEX_BLOCK_BYTES(a->block_size));
  }
  XLATE_CTABLE(s, h, nseg);
  s->stats.launches++;
  return s->inner->ops->compress(s->inner, &h);
}

static int st_indexer(dsv4_backend_t *be, const dsv4_indexer_args_t *a) {
  staged_t *s = staged_of(be);
  if (!a)
    return DSV4_EINVAL;
  dsv4_indexer_args_t h = *a;
  size_t n = a->n_tokens, nseg = a->n_segments;
  XLATE(s, h.positions, n * sizeof(int64_t));
  XLATE(s, h.tok_seg, n * sizeof(int32_t));
  XLATE(s, h.seg_p0, nseg * sizeof(int64_t));
  XLATE(s, h.iq, n * a->n_heads * 128 * sizeof(uint16_t));
  XLATE(s, h.iw, n * a->n_heads * sizeof(float));
  XLATE(s, h.i_cache, (size_t)a->c_n_blocks * DSV4_INDEX_BLOCK_BYTES(a->block_size));
  XLATE(s, h.sel, n * a->topk * sizeof(int32_t));
  XLATE_CTABLE(s, h, nseg);
  s->stats.launches++;
  s->stats.indexer_launches++;
  s->stats.fast_indexer_launches += a->fast != 0;
  return s->inner->ops->indexer(s->inner, &h);
}

static int st_sync(dsv4_backend_t *be) {
  staged_t *s = staged_of(be);
  s->stats.syncs++;
  reads_check(s, 0);
  q_writes_end(s, 0);
  int rc = s->inner->ops->sync(s->inner);
  /* The copies were queued before the work that failed, if any: a device delivers them too. */
  deferred_deliver(s, 0);
  int lrc = late_deliver(s, 0);
  /* sync() waits for every batch: a batch cut short in its submission ends here. */
  s->phase = 0;
  s->waited_ticket = s->next_ticket;
  return rc ? rc : lrc;
}

static void st_host_parallel(dsv4_backend_t *be, void (*fn)(void *, size_t, size_t), void *arg,
                             size_t n) {
  staged_t *s = staged_of(be);
  s->inner->ops->host_parallel(s->inner, fn, arg, n);
}

static int staged_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                       size_t why_len, int overlap) {
  staged_t *s = calloc(1, sizeof(*s));
  int rc;
  if (!s || !out) {
    free(s);
    return s ? DSV4_EINVAL : DSV4_ENOMEM;
  }
  rc = dsv4_backend_open("cpu", opt, &s->inner, why, why_len);
  if (rc) {
    free(s);
    return rc;
  }
  s->ops = *s->inner->ops;
  s->ops.name = "cpu_staged";
  s->ops.caps = 0; /* no DSV4_BE_HOST_MEMORY: the engine must stage */
  /* The fused decode path, as a device backend with attention offers it (SPEC §7). */
  if (s->inner->ops->attention)
    s->ops.caps |= DSV4_BE_ATTN_FUSED_Q;
  s->ops.destroy = st_destroy;
  s->ops.buf_alloc = st_alloc;
  s->ops.buf_free = st_free;
  s->ops.upload = st_upload;
  s->ops.download = st_download;
  s->ops.download_async = st_download_async;
  s->ops.map_slots = st_map;
  s->ops.qkv_insert = st_insert;
  s->ops.sync = st_sync;
  s->ops.attention = s->inner->ops->attention ? st_attn : NULL;
  s->ops.compress = s->inner->ops->compress ? st_compress : NULL;
  s->ops.indexer = s->inner->ops->indexer ? st_indexer : NULL;
  s->ops.host_parallel = s->inner->ops->host_parallel ? st_host_parallel : NULL;
  s->ops.host_register = st_host_register;
  s->ops.host_unregister = st_host_unregister;
  s->ops.host_alias = st_host_alias;
  s->ops.mark = st_mark;
  s->ops.download_marked = st_download_marked;
  const char *no_alias = getenv("DSV4_CUDA_NO_ALIAS");
  s->alias = !(no_alias && strcmp(no_alias, "1") == 0);
  if (overlap) {
    s->ops.name = "cpu_staged_overlap";
    s->ops.caps |= DSV4_BE_OVERLAP;
    s->ops.batch_phase = st_batch_phase;
    s->ops.batch_wait = st_batch_wait;
  }
  s->next_dev = DEV_BASE;
  s->base.ops = &s->ops;
  *out = &s->base;
  return 0;
}

int dsv4_test_cpu_staged_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                              size_t why_len) {
  return staged_open(opt, out, why, why_len, 0);
}

int dsv4_test_cpu_staged_overlap_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out,
                                      char *why, size_t why_len) {
  return staged_open(opt, out, why, why_len, 1);
}

void dsv4_test_cpu_staged_stats(dsv4_backend_t *be, dsv4_test_cpu_staged_stats_t *out) {
  staged_t *s = staged_of(be);
  *out = s->stats;
  out->live_buffers = s->n_bufs;
}

int dsv4_test_backend_absent(const char *name) {
  dsv4_backend_t *be = NULL;
  char why[256] = "";
  int rc = dsv4_backend_open(name, NULL, &be, why, sizeof(why));
  /* A name this build lacks is no absent device: the test runs and fails. */
  if (rc == DSV4_ENODEV && strncmp(why, "unknown backend", 15) != 0) {
    printf("skipped: backend %s: %s\n", name, why);
    return 1;
  }
  dsv4_backend_close(be);
  return 0;
}

int dsv4_test_backend_from_args(int argc, char **argv, const char **backend) {
  if (argc > 1)
    *backend = argv[1];
  if (dsv4_backend_register("cpu_staged", dsv4_test_cpu_staged_open) ||
      dsv4_backend_register("cpu_staged_overlap", dsv4_test_cpu_staged_overlap_open))
    return 1;
  return dsv4_test_backend_absent(*backend) ? 77 : 0;
}
