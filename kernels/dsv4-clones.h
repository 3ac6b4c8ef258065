#ifndef DSV4_KERNELS_DSV4_CLONES_H
#define DSV4_KERNELS_DSV4_CLONES_H
/*
 * DSV4_CLONES("arch=x86-64-v4", "avx2", "default"): a function compiled once per x86-64 level
 * named, the one for the CPU picked once at load (target_clones, GCC and clang), where the compiler
 * has the attribute. Empty elsewhere, and in sanitizer builds: their ifunc resolvers run before the
 * sanitizer runtime is set up (ThreadSanitizer then crashes at start-up).
 */
#if defined(__has_feature) /* clang names its sanitizers this way only */
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DSV4_CLONES(...)
#endif
#endif
#if !defined(DSV4_CLONES) && defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones) && !defined(__SANITIZE_ADDRESS__) &&                            \
    !defined(__SANITIZE_THREAD__)
#define DSV4_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#endif
#endif
#ifndef DSV4_CLONES
#define DSV4_CLONES(...)
#endif

#endif /* DSV4_KERNELS_DSV4_CLONES_H */
