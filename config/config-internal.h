#ifndef DSV4_CONFIG_CONFIG_INTERNAL_H
#define DSV4_CONFIG_CONFIG_INTERNAL_H

#include <stddef.h>

/* Format a message into why (when given) and return DSV4_ECONFIG: every config and model error. */
int dsv4__config_fail(char *why, size_t why_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif /* DSV4_CONFIG_CONFIG_INTERNAL_H */
