/* bf16 vector helpers shared by the elementwise / row kernels of src/ops/cuda (norm.cu,
 * short_conv.cu, swiglu.cu): the two bf16 halves of a 32-bit word as fp32 (exact), an fp32
 * rounded to bf16 bits (round to nearest even), and 8 (uint4) or 1 (unsigned short) bf16
 * values unpacked to / packed from fp32. Internal to src/ops/cuda; not a public header. */
#ifndef LINMOE_OPS_CUDA_VEC_CUH
#define LINMOE_OPS_CUDA_VEC_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t bf_bits(float f) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ void unpack(const uint4 &v, float (&f)[8]) {
    f[0] = bf_lo(v.x), f[1] = bf_hi(v.x), f[2] = bf_lo(v.y), f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z), f[5] = bf_hi(v.z), f[6] = bf_lo(v.w), f[7] = bf_hi(v.w);
}
__device__ __forceinline__ void unpack(const unsigned short &v, float (&f)[1]) {
    f[0] = __uint_as_float((uint32_t)v << 16);
}
__device__ __forceinline__ void pack(const float (&f)[8], uint4 &v) {
    v.x = bf_bits(f[0]) | (bf_bits(f[1]) << 16);
    v.y = bf_bits(f[2]) | (bf_bits(f[3]) << 16);
    v.z = bf_bits(f[4]) | (bf_bits(f[5]) << 16);
    v.w = bf_bits(f[6]) | (bf_bits(f[7]) << 16);
}
__device__ __forceinline__ void pack(const float (&f)[1], unsigned short &v) {
    v = (unsigned short)bf_bits(f[0]);
}

#endif
