/*
 * dsv4_host_flush (host_flush.h): one flush instruction per 64-byte line, clflushopt where CPUID
 * says so (leaf 7, EBX bit 23), which the CPU may run out of order with the others, then one
 * sfence so that every flush is done when the call returns.
 */
#include "host_flush.h"

#include <stdatomic.h>
#include <stdint.h>

#define LINE 64

#if defined(__x86_64__)
#include <cpuid.h>

static int has_clflushopt(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
    return 0;
  return (b >> 23) & 1u;
}

void dsv4_host_flush(const void *p, size_t n) {
  if (n == 0)
    return;
  static _Atomic int known = -1; /* every thread that finds it unknown stores the same value */
  int opt = atomic_load_explicit(&known, memory_order_relaxed);
  if (opt < 0) {
    opt = has_clflushopt();
    atomic_store_explicit(&known, opt, memory_order_relaxed);
  }
  uintptr_t a = (uintptr_t)p & ~(uintptr_t)(LINE - 1), end = (uintptr_t)p + n;
  if (opt) {
    for (; a < end; a += LINE)
      __asm__ volatile("clflushopt %0" : "+m"(*(volatile char *)a));
  } else {
    for (; a < end; a += LINE)
      __asm__ volatile("clflush %0" : "+m"(*(volatile char *)a));
  }
  __asm__ volatile("sfence" ::: "memory");
}

int dsv4_host_flush_works(void) {
  return 1;
}
#else
void dsv4_host_flush(const void *p, size_t n) {
  (void)p;
  (void)n;
}

int dsv4_host_flush_works(void) {
  return 0;
}
#endif
