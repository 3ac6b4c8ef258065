#ifndef DSV4_KERNELS_HOST_FLUSH_H
#define DSV4_KERNELS_HOST_FLUSH_H

/*
 * Host memory out of the CPU caches before a device reads or writes it. On some hosts a device's
 * copy of memory whose lines sit in many cores' caches (a request body the host threads have just
 * checked, an answer buffer last used for another batch) runs at a third to a half of its rate
 * from memory, the snoops of every line costing more than the line (tests/bench/NOTES.md, "Host
 * caches and the copy engines").
 *
 * Thread affinity: any thread; the bytes are unchanged.
 */
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Write back and evict every cache line that holds a byte of [p, p + n) (x86-64: clflushopt where
 * the CPU has it, else clflush, then a store fence; elsewhere nothing). */
void dsv4_host_flush(const void *p, size_t n);
/* Whether dsv4_host_flush does anything on this CPU. */
int dsv4_host_flush_works(void);

#ifdef __cplusplus
}
#endif
#endif
