#ifndef DSV4_KERNELS_DECIMAL_H
#define DSV4_KERNELS_DECIMAL_H

/*
 * The one parser of decimal numbers in text the daemon and dsv4ctl read: configuration values,
 * request metadata and headers, admin query strings and paths, dsv4ctl's arguments and dump tensor
 * names. It lives in kernels' core because every library above (config, kvcache, the engine, the
 * server, dsv4ctl) links that one.
 *
 * Thread affinity: none (a pure function of its arguments).
 */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most digits a number may have: UINT64_MAX has 20. Longer text (zeros in front of a small
 * number too) is refused rather than scanned without bound. */
#define DSV4_DECIMAL_MAX_DIGITS 20

/*
 * s[0..len) as an unsigned decimal number of at most max. Strict: 1 to DSV4_DECIMAL_MAX_DIGITS
 * ASCII digits and nothing else (no sign, no space, no empty text); leading zeros are allowed and
 * add nothing. s need not be NUL-terminated and is not read past len (s may be NULL when len is 0).
 * Returns 0 with the value in *out, DSV4_EINVAL for text that is not such a number, or
 * DSV4_ERANGE for a number above max. *out is left alone on failure.
 */
int dsv4_parse_decimal(const char *s, size_t len, uint64_t max, uint64_t *out);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_KERNELS_DECIMAL_H */
