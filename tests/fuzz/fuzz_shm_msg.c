/*
 * libFuzzer driver for a shared-region forward message read without a document
 * (server/shm_msg.c): whenever the scan reads a message, jansson reads the same fields and the
 * same header (tests/support/shm_msg_check.h); beyond that, no crash and no leak.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shm_msg_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A private copy, so reads past the end are caught by ASan whatever libFuzzer's buffer is. */
  char *buf = malloc(size ? size : 1);
  if (!buf)
    return 0;
  memcpy(buf, data, size);
  const char *why = NULL;
  /* The region's size from the input's first byte: headers inside it and past it. */
  size_t region = size ? (size_t)data[0] << 8 : 0;
  if (shm_msg_check(buf, size, region, &why) < 0)
    abort();
  free(buf);
  return 0;
}
