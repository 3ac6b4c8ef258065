#include "records.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "dsv4-compress.h"
#include "dsv4-numerics.h"

#ifdef DSV4_HAVE_XXHASH
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack for the pool digest's terms */
#include <xxhash.h>
#if defined(__x86_64__)
/* libxxhash's run-time dispatch picks its AVX2/AVX-512 XXH3 loop (2.5x the SSE2 one). */
#include <xxh_x86dispatch.h>
#endif
#endif

void dsv4_records_gather(const uint8_t *data, const uint8_t *scales, uint32_t n, uint8_t *out,
                         size_t out_stride) {
  for (uint32_t i = 0; i < n; i++) {
    uint8_t *rec = out + (size_t)i * out_stride;
    memcpy(rec, data + (size_t)i * DSV4_TOKEN_DATA_BYTES, DSV4_TOKEN_DATA_BYTES);
    memcpy(rec + DSV4_TOKEN_DATA_BYTES, scales + (size_t)i * DSV4_SCALE_BYTES, DSV4_SCALE_BYTES);
  }
}

void dsv4_records_scatter(const uint8_t *in, size_t in_stride, uint32_t n, uint8_t *data,
                          uint8_t *scales) {
  for (uint32_t i = 0; i < n; i++) {
    const uint8_t *rec = in + (size_t)i * in_stride;
    memcpy(data + (size_t)i * DSV4_TOKEN_DATA_BYTES, rec, DSV4_TOKEN_DATA_BYTES);
    memcpy(scales + (size_t)i * DSV4_SCALE_BYTES, rec + DSV4_TOKEN_DATA_BYTES, DSV4_SCALE_BYTES);
  }
}

/* The scale codes the insert path can produce for a finite bf16 tile (SPEC §2.2): amax from 1e-4
 * to the largest bf16 gives e from -22 to 120. */
#define CODE_MIN 105
#define CODE_MAX 247

const char *dsv4_record_implausible(const uint8_t rec[DSV4_RECORD_BYTES]) {
  const uint8_t *sc = rec + DSV4_TOKEN_DATA_BYTES;
  for (int t = 0; t < DSV4_NTILES; t++)
    if (sc[t] < CODE_MIN || sc[t] > CODE_MAX)
      return "a scale code outside 105..247";
  if (sc[DSV4_NTILES] != 0)
    return "a non-zero scale padding byte";
  for (int i = 0; i < DSV4_NOPE_DIM; i++)
    if ((rec[i] & 0x7f) == 0x7f)
      return "an e4m3 NaN byte";
  return NULL;
}

void dsv4_record_read(const uint8_t *layer_base, uint32_t block_size, size_t stride, int64_t slot,
                      uint8_t out[DSV4_RECORD_BYTES]) {
  assert(slot >= 0);
  const uint8_t *block = layer_base + (size_t)(slot / block_size) * stride;
  uint32_t o = (uint32_t)(slot % block_size);
  /* NoPE and RoPE are adjacent in the block; the scales live in the block's tail. */
  dsv4_records_gather(block + DSV4_TOKEN_DATA_OFFSET(o), block + DSV4_SCALE_OFFSET(block_size, o),
                      1, out, DSV4_RECORD_BYTES);
}

dsv4_layer_src_t dsv4_layer_src_host(const uint8_t *layer_base, uint32_t block_size) {
  return (dsv4_layer_src_t){layer_base, NULL, NULL, 0, block_size, DSV4_BLOCK_STRIDE(block_size)};
}

int dsv4_seq_records_read(const dsv4_layer_src_t *src, const dsv4_seq_info_t *info, int64_t pos,
                          uint32_t n, uint8_t *out, size_t out_stride) {
  const uint32_t bs = src->block_size;
  uint8_t *fetched = NULL; /* a run's NoPE|RoPE bytes, then its scale entries */
  int rc = 0;
  /* A logical block is one physical block, so the positions of one logical block are a run of
   * consecutive offsets: one read of its NoPE|RoPE bytes and one of its scales. */
  while (n > 0 && !rc) {
    int64_t slot = dsv4_seq_slot(info, bs, pos);
    if (slot < 0) {
      rc = DSV4_EINVAL;
      break;
    }
    uint64_t base = (uint64_t)(slot / bs) * src->stride;
    uint32_t o = (uint32_t)(slot % bs);
    uint32_t run = bs - o < n ? bs - o : n;
    if (src->host) {
      dsv4_records_gather(src->host + base + DSV4_TOKEN_DATA_OFFSET(o),
                          src->host + base + DSV4_SCALE_OFFSET(bs, o), run, out, out_stride);
    } else {
      uint8_t *scales;
      if (!fetched && !(fetched = malloc((size_t)bs * DSV4_RECORD_BYTES)))
        return DSV4_ENOMEM;
      scales = fetched + (size_t)bs * DSV4_TOKEN_DATA_BYTES;
      rc = src->read(src->arg, src->layer, base + DSV4_TOKEN_DATA_OFFSET(o),
                     (size_t)run * DSV4_TOKEN_DATA_BYTES, fetched);
      if (!rc)
        rc = src->read(src->arg, src->layer, base + DSV4_SCALE_OFFSET(bs, o),
                       (size_t)run * DSV4_SCALE_BYTES, scales);
      if (!rc)
        dsv4_records_gather(fetched, scales, run, out, out_stride);
    }
    out += (size_t)run * out_stride;
    pos += run;
    n -= run;
  }
  free(fetched);
  return rc;
}

void dsv4_record_decode(const uint8_t rec[DSV4_RECORD_BYTES], dsv4_record_fields_t *out) {
  const uint8_t *sc = rec + DSV4_TOKEN_DATA_BYTES;
  out->fp8 = rec;
  out->scale_codes = sc;
  /* UE8M0: 2^(code-127); 255 is NaN. */
  for (int t = 0; t < DSV4_NTILES; t++)
    out->scales[t] = sc[t] == 255 ? NAN : ldexp(1.0, sc[t] - 127);
  /* e4m3 * 2^(code-127) in double is exact (at most 4 significant bits, exponent in range). */
  for (int i = 0; i < DSV4_NOPE_DIM; i++) {
    uint8_t c = sc[i / DSV4_TILE];
    out->nope[i] = c == 255 ? NAN : ldexp((double)dsv4_e4m3_to_f32(rec[i]), c - 127);
  }
  for (int i = 0; i < DSV4_ROPE_DIM; i++) {
    const uint8_t *p = rec + DSV4_NOPE_DIM + 2 * i;
    out->rope_bits[i] = (uint16_t)(p[0] | p[1] << 8);
    out->rope[i] = dsv4_bf16_to_f32(out->rope_bits[i]);
  }
}

void dsv4_index_record_decode(const uint8_t rec[DSV4_INDEX_RECORD_BYTES],
                              dsv4_index_fields_t *out) {
  const uint8_t *sc = rec + DSV4_INDEX_VALUE_BYTES;
  out->scale_codes = sc;
  /* UE8M0 as the MX formats define it: 2^(code-127) for every code, code 0 included; 255 is NaN
   * (the insert path writes 1..253 only, but a decode for people shows whatever is stored). */
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++)
    out->scales[b] = sc[b] == 255 ? NAN : ldexp(1.0, sc[b] - 127);
  for (int i = 0; i < DSV4_INDEX_DIM; i++) {
    uint8_t nib = (uint8_t)(i & 1 ? rec[i / 2] >> 4 : rec[i / 2] & 15u);
    out->nibbles[i] = nib;
    /* An e2m1 value has at most two significant bits: the product is exact in double. */
    out->values[i] = (double)dsv4_e2m1_to_f32(nib) * out->scales[i / DSV4_MXFP4_BLOCK];
  }
}

void dsv4_seq_stored_range(const dsv4_seq_info_t *info, uint32_t block_size, uint32_t layer,
                           int64_t *first, int64_t *end) {
  int64_t f = info->first_lb * (int64_t)block_size;
  if (f < info->p0)
    f = info->p0;
  int64_t e = info->next[layer];
  if (info->n_blocks_held == 0 || e < f)
    e = f;
  *first = f;
  *end = e;
}

int64_t dsv4_seq_slot(const dsv4_seq_info_t *info, uint32_t block_size, int64_t pos) {
  if (pos < 0)
    return -1;
  int64_t lb = pos / block_size;
  if (lb < info->first_lb || lb - info->first_lb >= (int64_t)info->n_blocks_held)
    return -1;
  int32_t b = info->blocks[lb - info->first_lb];
  if (b < 0)
    return -1;
  return (int64_t)b * block_size + pos % block_size;
}

/* The low `bytes` bytes of v, little-endian. */
static void put_le(uint8_t *p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

void dsv4_position_put(uint8_t out[8], int64_t position) {
  put_le(out, (uint64_t)position, 8);
}

void dsv4_digest_hex(uint64_t digest, char out[17]) {
  static const char hex[] = "0123456789abcdef";
  for (int i = 15; i >= 0; i--) {
    out[i] = hex[digest & 15];
    digest >>= 4;
  }
  out[16] = '\0';
}

#ifdef DSV4_HAVE_XXHASH

struct dsv4_records_digest {
  XXH3_state_t *state; /* from XXH3_createState, which gives it the alignment it asks for */
};

/* An entry of the records digest: [LE int64 position || record]. */
#define ENTRY_BYTES (8u + DSV4_RECORD_BYTES)
/* Entries hashed at a time by dsv4_records_digest_add_seq: 16 entries are 9.25 KiB, copied and
 * hashed in L1. */
#define DIGEST_GROUP 16u

int dsv4_records_digest_create(dsv4_records_digest_t **out) {
  *out = NULL;
  dsv4_records_digest_t *d = malloc(sizeof(*d));
  if (d == NULL)
    return DSV4_ENOMEM;
  d->state = XXH3_createState();
  if (d->state == NULL) {
    free(d);
    return DSV4_ENOMEM;
  }
  XXH3_64bits_reset(d->state);
  *out = d;
  return 0;
}

void dsv4_records_digest_destroy(dsv4_records_digest_t *d) {
  if (d == NULL)
    return;
  XXH3_freeState(d->state);
  free(d);
}

void dsv4_records_digest_reset(dsv4_records_digest_t *d) {
  XXH3_64bits_reset(d->state);
}

void dsv4_records_digest_add(dsv4_records_digest_t *d, int64_t position,
                             const uint8_t record[DSV4_RECORD_BYTES]) {
  /* One update per record: XXH3's streaming result equals the one-shot hash of the concatenation.
   */
  uint8_t buf[ENTRY_BYTES];
  dsv4_position_put(buf, position);
  memcpy(buf + 8, record, DSV4_RECORD_BYTES);
  XXH3_64bits_update(d->state, buf, sizeof(buf));
}

void dsv4_records_digest_add_index(dsv4_records_digest_t *d, int64_t entry,
                                   const uint8_t record[DSV4_INDEX_RECORD_BYTES]) {
  uint8_t buf[8u + DSV4_INDEX_RECORD_BYTES];
  dsv4_position_put(buf, entry);
  memcpy(buf + 8, record, DSV4_INDEX_RECORD_BYTES);
  XXH3_64bits_update(d->state, buf, sizeof(buf));
}

void dsv4_records_digest_add_slot(dsv4_records_digest_t *d, int64_t position,
                                  const uint8_t *layer_base, uint32_t block_size, size_t stride,
                                  int64_t slot) {
  uint8_t rec[DSV4_RECORD_BYTES];
  dsv4_record_read(layer_base, block_size, stride, slot, rec);
  dsv4_records_digest_add(d, position, rec);
}

int dsv4_records_digest_add_seq(dsv4_records_digest_t *d, const dsv4_layer_src_t *src,
                                const dsv4_seq_info_t *info, int64_t pos, uint32_t n) {
  uint8_t group[DIGEST_GROUP * ENTRY_BYTES];
  for (uint32_t g = 0; g < n; g += DIGEST_GROUP) {
    uint32_t k = n - g < DIGEST_GROUP ? n - g : DIGEST_GROUP;
    /* The records land in their entries, so the group is one update of the §3.1 byte string. */
    int rc = dsv4_seq_records_read(src, info, pos + g, k, group + 8, ENTRY_BYTES);
    if (rc)
      return rc;
    for (uint32_t j = 0; j < k; j++)
      dsv4_position_put(group + (size_t)j * ENTRY_BYTES, pos + g + j);
    XXH3_64bits_update(d->state, group, (size_t)k * ENTRY_BYTES);
  }
  return 0;
}

uint64_t dsv4_records_digest_value(const dsv4_records_digest_t *d) {
  return XXH3_64bits_digest(d->state);
}

int dsv4_seq_digest(const dsv4_layer_src_t *src, const dsv4_seq_info_t *info, uint32_t layer_index,
                    uint64_t *digest, int64_t *first, int64_t *end) {
  int64_t f, t;
  dsv4_records_digest_t *d;
  int rc = dsv4_records_digest_create(&d);
  if (rc)
    return rc;
  dsv4_seq_stored_range(info, src->block_size, layer_index, &f, &t);
  if (first)
    *first = f;
  if (end)
    *end = t;
  rc = dsv4_records_digest_add_seq(d, src, info, f, (uint32_t)(t - f));
  if (!rc)
    *digest = dsv4_records_digest_value(d);
  dsv4_records_digest_destroy(d);
  return rc;
}

uint64_t dsv4_block_digest(const uint8_t *block, size_t stride) {
  return XXH3_64bits(block, stride);
}

/* The pool digest's term of block b: XXH3(LE32 layer || LE32 b || block bytes). */
static uint64_t pool_term(XXH3_state_t *s, uint32_t layer, uint32_t b, const uint8_t *block,
                          size_t stride) {
  uint8_t head[8];
  put_le(head, layer, 4);
  put_le(head + 4, b, 4);
  XXH3_64bits_reset(s);
  XXH3_64bits_update(s, head, sizeof(head));
  XXH3_64bits_update(s, block, stride);
  return XXH3_64bits_digest(s);
}

int dsv4_pool_digest(const dsv4_pool_t *pool, uint32_t layer, const dsv4_layer_src_t *src,
                     uint64_t *digest, uint64_t *block_digests, uint8_t *used) {
  XXH3_state_t s;
  uint8_t *fetched = NULL;
  uint64_t acc = 0;
  int rc = 0;
  if (!src->host && !(fetched = malloc(src->stride)))
    return DSV4_ENOMEM;
  for (uint32_t b = 0; b < pool->n_blocks && !rc; b++) {
    if (!dsv4_pool_is_used(pool, b))
      continue;
    const uint8_t *block = fetched;
    if (src->host)
      block = src->host + (size_t)b * src->stride;
    else if ((rc = src->read(src->arg, src->layer, (uint64_t)b * src->stride, src->stride,
                             fetched)) != 0)
      break;
    acc ^= pool_term(&s, layer, b, block, src->stride);
    if (block_digests)
      block_digests[b] = dsv4_block_digest(block, src->stride);
    if (used)
      used[b] = 1;
  }
  free(fetched);
  if (!rc)
    *digest = acc;
  return rc;
}

#endif /* DSV4_HAVE_XXHASH */
