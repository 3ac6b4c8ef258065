#ifndef DSV4_KERNELS_ERROR_H
#define DSV4_KERNELS_ERROR_H

/*
 * The project's error codes. Every function that can fail returns 0 or one of these negative
 * values. One row per code: the C name, the JSON error code the HTTP API answers with, the HTTP
 * status and a human-readable message. The server maps codes to responses with this table alone, so
 * a new error needs exactly one new row.
 */
#define DSV4_ERRNO_MAP(X)                                                                          \
  X(EINVAL, -1, "bad_request", 400, "invalid argument")                                            \
  X(ENOMEM, -2, "out_of_memory", 503, "out of memory")                                             \
  X(ERANGE, -3, "value_out_of_range", 400, "value out of range")                                   \
  X(EPOSRANGE, -4, "position_out_of_range", 400, "position out of range")                          \
  X(ELAYER, -5, "unknown_layer", 400, "unknown layer")                                             \
  X(EDUPSEQ, -6, "duplicate_sequence", 400, "sequence appears in more than one segment")           \
  X(ENOSEQ, -7, "unknown_sequence", 404, "unknown sequence")                                       \
  X(EPOSITION, -8, "position_mismatch", 409, "position does not continue the sequence")            \
  X(EEXIST, -9, "sequence_exists", 409, "sequence already exists")                                 \
  X(EEXPIRED, -10, "sequence_expired", 410, "sequence expired")                                    \
  X(ENOSPC, -11, "kv_pool_exhausted", 503, "kv cache pool exhausted")                              \
  X(EQUEUE, -12, "queue_full", 503, "executor queue full")                                         \
  X(EDRAIN, -13, "draining", 503, "daemon is draining")                                            \
  X(EDEADLINE, -14, "deadline_exceeded", 504, "deadline exceeded before the batch started")        \
  X(EBACKEND, -15, "backend_error", 500, "backend error")                                          \
  X(EIO, -16, "io_error", 500, "input/output error")                                               \
  X(ETOOBIG, -17, "payload_too_large", 413, "payload too large")                                   \
  X(EHDRBIG, -18, "headers_too_large", 431, "headers too large")                                   \
  X(EUNAUTH, -19, "unauthorized", 401, "missing or wrong bearer token")                            \
  X(EFORBID, -20, "forbidden", 403, "forbidden")                                                   \
  X(ENOTFOUND, -21, "not_found", 404, "not found")                                                 \
  X(EMETHOD, -22, "method_not_allowed", 405, "method not allowed")                                 \
  X(ENODEV, -23, "no_device", 503, "no usable device for this backend")                            \
  X(ECONFIG, -24, "bad_config", 400, "bad configuration")                                          \
  X(ETIMEDOUT, -25, "timeout", 408, "request timed out")                                           \
  X(ELENGTH, -26, "length_required", 411, "Content-Length required")                               \
  X(EUNSUPPORTED, -27, "unsupported", 400, "unsupported")                                          \
  X(EDUMPBUSY, -28, "dump_in_progress", 429, "another dump is streaming")                          \
  X(ENOTWRITTEN, -29, "position_not_written", 404, "position never written at this layer")         \
  X(ERELEASED, -30, "position_released", 410, "position no longer stored (out of the window)")     \
  X(ECONNLIMIT, -31, "too_many_connections", 503, "too many connections")

typedef enum {
#define DSV4__ERR_ENUM(name, val, code, status, msg) DSV4_##name = (val),
  DSV4_ERRNO_MAP(DSV4__ERR_ENUM)
#undef DSV4__ERR_ENUM
} dsv4_errno_t;

#ifndef __OPENCL_VERSION__
#ifdef __cplusplus
extern "C" {
#endif
/* A static English message for err ("unknown error" for codes outside the table). */
const char *dsv4_strerror(int err);
/* The JSON error code for err, e.g. "unknown_sequence". */
const char *dsv4_err_code(int err);
/* The HTTP status the API answers err with. */
int dsv4_err_http_status(int err);
#ifdef __cplusplus
}
#endif
#endif

#endif /* DSV4_KERNELS_ERROR_H */
