/*
 * One attention item at a vector level (SPEC §7), the same at every level: the queries, the logits
 * tile by tile, the maximum and sums, the chains N tile by tile, and each head's output and lse.
 * Included once by cpu_attention_avx2.c and once by cpu_attention_avx512.c, after the level's own
 * queries_t, tile_load, tile_logits, max_logit, weights, tile_accumulate, finish_head and QUAD,
 * with DSV4__CPU_ATTN_ITEM_FN naming the function it defines; built with that file's ISA.
 */
#ifndef DSV4__CPU_ATTN_ITEM_FN
#error "define DSV4__CPU_ATTN_ITEM_FN before including cpu-attn-item.h"
#endif

/* Every head's max and weights over the whole list, and their sums S in list order; a quad's four
 * chains of additions run side by side (a head past nh sums logits of a zero query, unused). */
static void softmax_sums(const dsv4__cpu_attn_item_t *it, float *m, float *sum) {
  const uint32_t nc = it->nc;
  for (uint32_t h = 0; h < it->nh; h++) {
    float *l = it->l + (size_t)h * it->l_stride;
    m[h] = max_logit(l, nc);
    weights(l, nc, m[h]);
  }
  for (uint32_t h0 = 0; h0 < it->nh; h0 += QUAD) {
    const float *l = it->l + (size_t)h0 * it->l_stride;
    float acc[QUAD] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (uint32_t i = 0; i < nc; i++)
#pragma GCC unroll 4
      for (int h = 0; h < QUAD; h++)
        acc[h] = acc[h] + l[(size_t)h * it->l_stride + i];
    for (int h = 0; h < QUAD; h++)
      sum[h0 + h] = acc[h];
  }
}

void DSV4__CPU_ATTN_ITEM_FN(const dsv4__cpu_attn_item_t *it) {
  const uint32_t tiles = (it->nc + DSV4__CPU_ATTN_TILE - 1) / DSV4__CPU_ATTN_TILE;
  /* Heads past nh in the last quad have zero queries: their logits serve as weights of nothing. */
  for (uint32_t h0 = 0; h0 < it->nh; h0 += QUAD) {
    uint32_t nh = it->nh - h0 < QUAD ? it->nh - h0 : QUAD;
    queries_t(it->q + (size_t)h0 * DSV4_HEAD_DIM, nh, it->qf + (size_t)h0 * DSV4_HEAD_DIM);
  }
  /* The logits tile by tile from the last, so that the first tile is still in the workspace when
   * the chains N begin. */
  for (uint32_t k = tiles; k-- > 0;) {
    uint32_t first = k * DSV4__CPU_ATTN_TILE;
    uint32_t count = it->nc - first < DSV4__CPU_ATTN_TILE ? it->nc - first : DSV4__CPU_ATTN_TILE;
    tile_load(it, first, count);
    tile_logits(it, first, count);
  }
  float m[DSV4_MAX_HEADS], sum[DSV4_MAX_HEADS];
  softmax_sums(it, m, sum);
  for (uint32_t k = 0; k < tiles; k++) {
    uint32_t first = k * DSV4__CPU_ATTN_TILE;
    uint32_t count = it->nc - first < DSV4__CPU_ATTN_TILE ? it->nc - first : DSV4__CPU_ATTN_TILE;
    if (k)
      tile_load(it, first, count);
    tile_accumulate(it, first, count);
  }
  for (uint32_t h = 0; h < it->nh; h++) {
    float den = sum[h];
    if (it->sink)
      den = den + dsv4_expf(it->sink[h] - m[h]);
    finish_head(it->n + (size_t)h * DSV4_HEAD_DIM, den, it->rope_row,
                it->out + (size_t)h * DSV4_HEAD_DIM);
    if (it->lse)
      it->lse[h] = m[h] + dsv4_logf(sum[h]);
  }
}
