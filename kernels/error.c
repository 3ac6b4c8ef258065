#include "dsv4-error.h"

#include <stddef.h>

typedef struct {
  int err;
  const char *msg;
} err_row_t;

static const err_row_t err_rows[] = {
#define DSV4__ERR_ROW(name, val, msg) {(val), (msg)},
    DSV4_ERRNO_MAP(DSV4__ERR_ROW)
#undef DSV4__ERR_ROW
};

const char *dsv4_strerror(int err) {
  for (size_t i = 0; i < sizeof(err_rows) / sizeof(err_rows[0]); i++)
    if (err_rows[i].err == err)
      return err_rows[i].msg;
  return "unknown error";
}
