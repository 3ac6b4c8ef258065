/*
 * The SPIR-V the daemon embeds (lz_spirv.h) is byte for byte the module llvm-spirv wrote at build
 * time, and is a little-endian SPIR-V module (magic 0x07230203, version at most 1.2 so that older
 * drivers take it).
 *   lz_spirv_embed_test <dsv4_kernels_cr.spv> <dsv4_kernels_fp64.spv>
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "level_zero/lz_spirv.h"

static int check(const char *path, const unsigned char *embedded, size_t size) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "FAIL: cannot open %s\n", path);
    return 1;
  }
  unsigned char *file = malloc(size + 1);
  size_t n = file ? fread(file, 1, size + 1, f) : 0;
  fclose(f);
  int bad = !file || n != size || memcmp(file, embedded, size) != 0;
  free(file);
  if (bad) {
    fprintf(stderr, "FAIL: the embedded module (%zu bytes) is not %s (%zu bytes read)\n", size,
            path, n);
    return 1;
  }
  uint32_t magic = (uint32_t)embedded[0] | (uint32_t)embedded[1] << 8 |
                   (uint32_t)embedded[2] << 16 | (uint32_t)embedded[3] << 24;
  uint32_t version = (uint32_t)embedded[5] << 8 | embedded[6] << 16;
  if (magic != 0x07230203u || size % 4 != 0 || version > 0x00010200u) {
    fprintf(stderr, "FAIL: %s: magic 0x%08x, version 0x%08x, %zu bytes\n", path, magic, version,
            size);
    return 1;
  }
  printf("ok: %s embedded, %zu bytes, SPIR-V %u.%u\n", path, size, (unsigned)embedded[6],
         (unsigned)embedded[5]);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s <cr.spv> <fp64.spv>\n", argv[0]);
    return 2;
  }
  int bad = check(argv[1], dsv4__lz_spirv_cr, dsv4__lz_spirv_cr_size);
  bad |= check(argv[2], dsv4__lz_spirv_fp64, dsv4__lz_spirv_fp64_size);
  return bad;
}
