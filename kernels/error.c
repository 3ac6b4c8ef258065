#include "dsv4-error.h"

#include <stddef.h>

typedef struct {
  int err;
  const char *code;
  int status;
  const char *msg;
} err_row_t;

static const err_row_t err_rows[] = {
#define DSV4__ERR_ROW(name, val, code, status, msg) {(val), (code), (status), (msg)},
    DSV4_ERRNO_MAP(DSV4__ERR_ROW)
#undef DSV4__ERR_ROW
};

static const err_row_t *find(int err) {
  for (size_t i = 0; i < sizeof(err_rows) / sizeof(err_rows[0]); i++)
    if (err_rows[i].err == err)
      return &err_rows[i];
  return NULL;
}

const char *dsv4_strerror(int err) {
  const err_row_t *r = find(err);
  return r ? r->msg : "unknown error";
}

const char *dsv4_err_code(int err) {
  const err_row_t *r = find(err);
  return r ? r->code : "internal_error";
}

int dsv4_err_http_status(int err) {
  const err_row_t *r = find(err);
  return r ? r->status : 500;
}
