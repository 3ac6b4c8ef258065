#include "records.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"

#ifdef DSV4_HAVE_XXHASH
#include <xxhash.h>
#endif

void dsv4_record_read(const uint8_t *layer_base, uint32_t block_size, size_t stride, int64_t slot,
                      uint8_t out[DSV4_RECORD_BYTES]) {
  assert(slot >= 0);
  const uint8_t *block = layer_base + (size_t)(slot / block_size) * stride;
  uint32_t o = (uint32_t)(slot % block_size);
  /* NoPE and RoPE are adjacent in the block; the scales live in the block's tail. */
  memcpy(out, block + DSV4_TOKEN_DATA_OFFSET(o), DSV4_TOKEN_DATA_BYTES);
  memcpy(out + DSV4_TOKEN_DATA_BYTES, block + DSV4_SCALE_OFFSET(block_size, o), DSV4_SCALE_BYTES);
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
  XXH3_state_t *state;
};

static void put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

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
  uint8_t buf[8 + DSV4_RECORD_BYTES];
  put_le64(buf, (uint64_t)position);
  memcpy(buf + 8, record, DSV4_RECORD_BYTES);
  XXH3_64bits_update(d->state, buf, sizeof(buf));
}

void dsv4_records_digest_add_slot(dsv4_records_digest_t *d, int64_t position,
                                  const uint8_t *layer_base, uint32_t block_size, size_t stride,
                                  int64_t slot) {
  uint8_t rec[DSV4_RECORD_BYTES];
  dsv4_record_read(layer_base, block_size, stride, slot, rec);
  dsv4_records_digest_add(d, position, rec);
}

uint64_t dsv4_records_digest_value(const dsv4_records_digest_t *d) {
  return XXH3_64bits_digest(d->state);
}

uint64_t dsv4_block_digest(const uint8_t *layer_base, size_t stride, uint32_t block_id) {
  return XXH3_64bits(layer_base + (size_t)block_id * stride, stride);
}

int dsv4_pool_digest(const dsv4_pool_t *pool, uint32_t layer, const uint8_t *layer_base,
                     size_t stride, uint64_t *digest) {
  *digest = 0;
  XXH3_state_t *s = XXH3_createState();
  if (s == NULL)
    return DSV4_ENOMEM;
  uint64_t acc = 0;
  for (uint32_t b = 0; b < pool->n_blocks; b++) {
    if (!dsv4_pool_is_used(pool, b))
      continue;
    uint8_t head[8];
    put_le32(head, layer);
    put_le32(head + 4, b);
    XXH3_64bits_reset(s);
    XXH3_64bits_update(s, head, sizeof(head));
    XXH3_64bits_update(s, layer_base + (size_t)b * stride, stride);
    acc ^= XXH3_64bits_digest(s);
  }
  XXH3_freeState(s);
  *digest = acc;
  return 0;
}

int dsv4_seq_digest(const dsv4_seqtable_t *st, uint32_t layer_index, const char *name,
                    uint32_t name_len, const uint8_t *layer_base, uint64_t *digest,
                    uint64_t *n_records) {
  const dsv4_seqtable_config_t *cfg = dsv4_seqtable_config(st);
  *digest = 0;
  if (n_records != NULL)
    *n_records = 0;
  if (layer_index >= cfg->n_layers)
    return DSV4_EINVAL;
  dsv4_seq_info_t info;
  int rc = dsv4_seqtable_info(st, name, name_len, &info);
  if (rc != 0)
    return rc;
  dsv4_records_digest_t *d;
  rc = dsv4_records_digest_create(&d);
  if (rc != 0) {
    dsv4_seq_info_free(&info);
    return rc;
  }
  uint32_t bs = cfg->block_size;
  size_t stride = DSV4_BLOCK_STRIDE(bs);
  int64_t first, end;
  dsv4_seq_stored_range(&info, bs, layer_index, &first, &end);
  for (int64_t pos = first; pos < end; pos++) {
    int64_t slot = dsv4_seq_slot(&info, bs, pos);
    assert(slot >= 0);
    dsv4_records_digest_add_slot(d, pos, layer_base, bs, stride, slot);
  }
  *digest = dsv4_records_digest_value(d);
  if (n_records != NULL)
    *n_records = (uint64_t)(end - first);
  dsv4_records_digest_destroy(d);
  dsv4_seq_info_free(&info);
  return 0;
}

#endif /* DSV4_HAVE_XXHASH */
