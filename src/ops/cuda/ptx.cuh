/* Inline-PTX wrappers shared by the CUDA kernels of src/ops/cuda (attention.cu,
 * moe_experts.cu, kda_common.cuh): shared-memory addresses, ldmatrix, mma.sync m16n8k16
 * (bf16 in, fp32 accumulate), cp.async, mbarrier and the wgmma fences (sm_90a), and the
 * bf16 pair packing. PTX ISA sections: "Data Movement and Conversion Instructions"
 * (ldmatrix, cp.async, mbarrier), "Warp Level Matrix Multiply-Accumulate Instructions"
 * (mma, wgmma). Variants that differ (memory clobbers, a trapping wait, swizzled
 * descriptors) stay in their files. Internal to src/ops/cuda; not a public header. */
#ifndef LINMOE_OPS_CUDA_PTX_CUH
#define LINMOE_OPS_CUDA_PTX_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_u32(const void *ptr) {
    return (uint32_t)__cvta_generic_to_shared(ptr);
}
__device__ __forceinline__ void ldsm4(uint32_t r[4], const void *ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(ptr)));
}
__device__ __forceinline__ void ldsm4t(uint32_t r[4], const void *ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(ptr)));
}
/* d += a b: a 16x16 row-major fragment, b 16x8 column fragment, fp32 accumulators */
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}
/* 16 bytes, or zeros in shared memory (nothing read) when !valid (the src-size operand) */
__device__ __forceinline__ void cp_async16_zfill(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
/* generic-proxy writes to shared memory (st, stmatrix, cp.async) made visible to the
 * async proxy that wgmma and the bulk copies read through; each writing thread, before
 * the barrier */
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* mbarrier (shared::cta) */
__device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
/* wgmma (sm_90a) fences */
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* keeps the compiler from moving uses of wgmma accumulators across the wait */
template <int N> __device__ __forceinline__ void wg_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}
/* two floats -> a bf16 pair (round to nearest even), a in the low half */
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
}

#endif
