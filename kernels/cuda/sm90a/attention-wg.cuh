#ifndef DSV4_KERNELS_CUDA_SM90A_ATTENTION_WG_CUH
#define DSV4_KERNELS_CUDA_SM90A_ATTENTION_WG_CUH
/*
 * What the fast attention kernels on warpgroup MMAs share (attention_fast_wg.cu, the window's;
 * attention_fast_union_wg.cu and attention_fast_union_ws.cu, the union's): the staged operands'
 * descriptors in the 128-byte swizzle (swz_atoms, attention-fast.cuh) and the MMAs of their two
 * steps, the scores (q and the records, both K-major: each k-step from zero in the window's, in
 * chains of two in the union's, awg_scores) and the weighted sums (the weights K-major, the records
 * MN-major as V, accumulated).
 */
#include "wgmma.cuh"

/* Bytes between the atoms of the staged operands (swz_atoms): along a row's pieces, between groups
 * of 8 rows of 1 KiB rows (q, the records) and of 256-byte rows (the window's weights); the union's
 * weights of 64 candidates, rows of 128 bytes, take one atom a group. */
#define AWG_ATOM 1024u
#define AWG_GROUP_K ((uint32_t)(8 * K_ROW))
#define AWG_GROUP_P ((uint32_t)(8 * P_ROW))
/* A k-step (16 bf16 values, 32 bytes) further along a K-major operand's atom. */
#define AWG_KSTEP 32u
/* The scores' k-steps in flight (each MMA's partial in its own registers). */
#define AWG_KF 4

/* Until a k-step's MMA has landed, with `later` MMA groups issued after it (groups complete in
 * the order issued): at most min(later, AWG_KF - 1) may stay pending. */
static __device__ __forceinline__ void awg_wait_kstep(int later) {
  static_assert(AWG_KF == 4, "the waits below: at most 3 groups pending");
  if (later >= 3)
    wg_wait_group<3>();
  else if (later == 2)
    wg_wait_group<2>();
  else if (later == 1)
    wg_wait_group<1>();
  else
    wg_wait_group<0>();
}

/* A shared-memory matrix descriptor in the 128-byte swizzle mode: the operand at shared address a
 * (its atoms on 1 KiB boundaries), lbo and sbo the leading and stride byte offsets. */
static __device__ __forceinline__ uint64_t awg_desc(uint32_t a, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((a >> 4) & 0x3FFFu) | (uint64_t)((lbo >> 4) & 0x3FFFu) << 16 |
         (uint64_t)((sbo >> 4) & 0x3FFFu) << 32 | 1ull << 62;
}

/* K-major: the leading byte offset is unused in the swizzled modes (1 by convention). */
static __device__ __forceinline__ uint64_t awg_desc_k(uint32_t a, uint32_t sbo) {
  return awg_desc(a, 16, sbo);
}

#define AWG_R8(d, i)                                                                               \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),      \
      "+f"(d[i + 6]), "+f"(d[i + 7])

/* d = A . B^T from zero (ACC: d += A . B^T), m64n16k16, A and B K-major by descriptors. */
template <int ACC = 0>
static __device__ __forceinline__ void awg_mma_n16(float (&d)[8], uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7}, "
               "%8, %9, p, 1, 1, 0, 0;\n}\n"
               : AWG_R8(d, 0)
               : "l"(a), "l"(b), "n"(ACC));
#else
  (void)d, (void)a, (void)b;
#endif
}

/* d = A . B^T from zero (ACC: d += A . B^T), m64n32k16, A and B K-major by descriptors. */
template <int ACC = 0>
static __device__ __forceinline__ void awg_mma_n32(float (&d)[16], uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
               "%16, %17, p, 1, 1, 0, 0;\n}\n"
               : AWG_R8(d, 0), AWG_R8(d, 8)
               : "l"(a), "l"(b), "n"(ACC));
#else
  (void)d, (void)a, (void)b;
#endif
}

/* d += A . B, m64n64k16, A K-major and B MN-major by descriptors. */
static __device__ __forceinline__ void awg_mma_n64(float (&d)[32], uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "%32, %33, p, 1, 1, 0, 1;\n}\n"
               : AWG_R8(d, 0), AWG_R8(d, 8), AWG_R8(d, 16), AWG_R8(d, 24)
               : "l"(a), "l"(b), "n"(1));
#else
  (void)d, (void)a, (void)b;
#endif
}

/* d += A . B, m64n128k16, A K-major and B MN-major by descriptors. */
static __device__ __forceinline__ void awg_mma_n128(float (&d)[64], uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "
               "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "
               "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "%64, %65, p, 1, 1, 0, 1;\n}\n"
               : AWG_R8(d, 0), AWG_R8(d, 8), AWG_R8(d, 16), AWG_R8(d, 24), AWG_R8(d, 32),
                 AWG_R8(d, 40), AWG_R8(d, 48), AWG_R8(d, 56)
               : "l"(a), "l"(b), "n"(1));
#else
  (void)d, (void)a, (void)b;
#endif
}

/* d += A . B, m64n256k16, A K-major and B MN-major by descriptors. */
static __device__ __forceinline__ void awg_mma_n256(float (&d)[128], uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "
      "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "
      "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "
      "%123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 1;\n}\n"
      : AWG_R8(d, 0), AWG_R8(d, 8), AWG_R8(d, 16), AWG_R8(d, 24), AWG_R8(d, 32), AWG_R8(d, 40),
        AWG_R8(d, 48), AWG_R8(d, 56), AWG_R8(d, 64), AWG_R8(d, 72), AWG_R8(d, 80), AWG_R8(d, 88),
        AWG_R8(d, 96), AWG_R8(d, 104), AWG_R8(d, 112), AWG_R8(d, 120)
      : "l"(a), "l"(b), "n"(1));
#else
  (void)d, (void)a, (void)b;
#endif
}

/* The scores of a warpgroup's N candidates (K-major at ka) for the 64 rows of q (K-major at qa),
 * over 512 dims in chains of two k-steps (the first from zero, the second accumulated in the
 * tensor cores), two chains in flight, each chain's partial added to acc in fp32 in order once it
 * has landed. acc: the warp's N / 8 n-tiles, 4 j + i as mma.sync's m16n8 fragment. */
template <int N> static __device__ void awg_scores(uint32_t qa, uint32_t ka, float (&acc)[N / 2]) {
  static_assert(N == 16 || N == 32, "m64n16k16 or m64n32k16");
  constexpr int NC = DSV4_HEAD_DIM / 32;
  float d[2][N / 2] = {};
  wg_tie(d[0]);
  wg_tie(d[1]);
#pragma unroll
  for (int c = 0; c <= NC; c++) {
    if (c < NC) {
      wg_fence(); /* the buffer's last reads (the adds below) come before the MMAs write it */
#pragma unroll
      for (int k = 0; k < 2; k++) {
        const int ks = 2 * c + k;
        const uint32_t off = (ks >> 2) * AWG_ATOM + (ks & 3) * AWG_KSTEP;
        const uint64_t qd = awg_desc_k(qa + off, AWG_GROUP_K),
                       kd = awg_desc_k(ka + off, AWG_GROUP_K);
        if constexpr (N == 16) {
          if (k == 0)
            awg_mma_n16<0>(d[c % 2], qd, kd);
          else
            awg_mma_n16<1>(d[c % 2], qd, kd);
        } else {
          if (k == 0)
            awg_mma_n32<0>(d[c % 2], qd, kd);
          else
            awg_mma_n32<1>(d[c % 2], qd, kd);
        }
      }
      wg_commit();
    }
    const int done = c - 1;
    if (done < 0)
      continue;
    if (done < NC - 1)
      wg_wait_group<1>(); /* the chain after it may stay pending */
    else
      wg_wait_group<0>();
    wg_tie(d[done % 2]);
#pragma unroll
    for (int i = 0; i < N / 2; i++)
      acc[i] += d[done % 2][i];
  }
}

#endif /* DSV4_KERNELS_CUDA_SM90A_ATTENTION_WG_CUH */
