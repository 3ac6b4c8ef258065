#ifndef DSV4_KERNELS_ERROR_H
#define DSV4_KERNELS_ERROR_H

/*
 * The project's error codes. Every function that can fail returns 0 or one of these negative
 * values. One row per code: the C name, the value and a human-readable message. The codes are data:
 * what an answer to a client makes of them (the HTTP status, the JSON error code) is the server's
 * business and lives in its one table (server/errors.c), which fails to build without a row for
 * every code here. Codes that only the HTTP layer returns (unauthorized, not found, ...) share this
 * numeric space so that one int carries any error.
 */
#define DSV4_ERRNO_MAP(X)                                                                          \
  X(EINVAL, -1, "invalid argument")                                                                \
  X(ENOMEM, -2, "out of memory")                                                                   \
  X(ERANGE, -3, "value out of range")                                                              \
  X(EPOSRANGE, -4, "position out of range")                                                        \
  X(ELAYER, -5, "unknown layer")                                                                   \
  X(EDUPSEQ, -6, "sequence appears in more than one segment")                                      \
  X(ENOSEQ, -7, "unknown sequence")                                                                \
  X(EPOSITION, -8, "position does not continue the sequence")                                      \
  X(EEXIST, -9, "sequence already exists")                                                         \
  X(EEXPIRED, -10, "sequence expired")                                                             \
  X(ENOSPC, -11, "kv cache pool exhausted")                                                        \
  X(EQUEUE, -12, "executor queue full")                                                            \
  X(EDRAIN, -13, "daemon is draining")                                                             \
  X(EDEADLINE, -14, "deadline exceeded before the batch started")                                  \
  X(EBACKEND, -15, "backend error")                                                                \
  X(EIO, -16, "input/output error")                                                                \
  X(ETOOBIG, -17, "payload too large")                                                             \
  X(EHDRBIG, -18, "headers too large")                                                             \
  X(EUNAUTH, -19, "missing or wrong bearer token")                                                 \
  X(EFORBID, -20, "forbidden")                                                                     \
  X(ENOTFOUND, -21, "not found")                                                                   \
  X(EMETHOD, -22, "method not allowed")                                                            \
  X(ENODEV, -23, "no usable device for this backend")                                              \
  X(ECONFIG, -24, "bad configuration")                                                             \
  X(ETIMEDOUT, -25, "request timed out")                                                           \
  X(ELENGTH, -26, "Content-Length required")                                                       \
  X(EUNSUPPORTED, -27, "unsupported")                                                              \
  X(EDUMPBUSY, -28, "another dump is streaming")                                                   \
  X(ENOTWRITTEN, -29, "position never written at this layer")                                      \
  X(ERELEASED, -30, "position no longer stored (out of the window)")                               \
  X(ECONNLIMIT, -31, "too many connections")                                                       \
  X(ESEQLIMIT, -32, "no free sequence slot (max_sequences)")                                       \
  X(EDIGEST, -33, "a digest does not match its records")                                           \
  X(EGEOMETRY, -34, "the dump does not match this daemon's layout or geometry")                    \
  X(ENOTEMITTED, -35, "compressed entry not emitted at this layer")

typedef enum {
#define DSV4__ERR_ENUM(name, val, msg) DSV4_##name = (val),
  DSV4_ERRNO_MAP(DSV4__ERR_ENUM)
#undef DSV4__ERR_ENUM
} dsv4_errno_t;

#ifndef __OPENCL_VERSION__
#ifdef __cplusplus
extern "C" {
#endif
/* A static English message for err ("unknown error" for codes outside the table). */
const char *dsv4_strerror(int err);
#ifdef __cplusplus
}
#endif
#endif

#endif /* DSV4_KERNELS_ERROR_H */
