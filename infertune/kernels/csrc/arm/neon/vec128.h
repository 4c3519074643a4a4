/* NEON helpers for the Arm kernels (AArch64, baseline Armv8-A Advanced SIMD): bf16 <-> fp32 on 4 lanes (a bf16 is
 * the high half of an fp32, so widening is a shift left by 16), rounding to bf16 as f2bf, padded tails, and the
 * exp polynomial of the x86 kernels. */
#ifndef IT_VEC128_H
#define IT_VEC128_H
#include <arm_neon.h>
#include "bf16.h"

#define NRN 4         /* weight rows per block */
#define MRN 2         /* activation rows per pass over a block */
#define PFN_BYTES 512 /* software prefetch distance along a weight row */

static inline float32x4_t bf16x4_f32(uint16x4_t v) { return vreinterpretq_f32_u32(vshll_n_u16(v, 16)); }
static inline float32x4_t bf16x8_lo(uint16x8_t v) { return bf16x4_f32(vget_low_u16(v)); }
static inline float32x4_t bf16x8_hi(uint16x8_t v) { return vreinterpretq_f32_u32(vshll_high_n_u16(v, 16)); }
static inline float32x4_t load_bf16x4(const bf16* p) { return bf16x4_f32(vld1_u16(p)); }

static inline uint32x4_t round_bits4(float32x4_t v) { /* fp32 -> its nearest bf16 in the high half (finite) */
    uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    u = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), odd));
    return vandq_u32(u, vdupq_n_u32(0xffff0000u));
}

static inline uint16x4_t round_bf16x4(float32x4_t v) { return vshrn_n_u32(round_bits4(v), 16); }
static inline float32x4_t bf16_round_f32x4(float32x4_t v) { return vreinterpretq_f32_u32(round_bits4(v)); }
static inline void store_bf16x4(bf16* p, float32x4_t v) { vst1_u16(p, round_bf16x4(v)); }

/* The first n (< 4) values at p, zero padded, and back: a row's tail runs the same vector code as its body. */
static inline float32x4_t load_bf16_tail4(const bf16* p, int64_t n) {
    bf16 t[4] = {0};
    memcpy(t, p, (size_t)n * 2);
    return load_bf16x4(t);
}

static inline float32x4_t load_f32_tail4(const float* p, int64_t n) {
    float t[4] = {0};
    memcpy(t, p, (size_t)n * 4);
    return vld1q_f32(t);
}

static inline void store_bf16_tail4(bf16* p, float32x4_t v, int64_t n) {
    bf16 t[4];
    store_bf16x4(t, v);
    memcpy(p, t, (size_t)n * 2);
}

static inline int64_t hsum4_s32(int32x4_t v) { return vaddlvq_s32(v); } /* exact: widened to int64 */

/* e^x, relative error ~1e-7 over the clamped range (the x86 kernels' polynomial, on 4 lanes) */
static inline float32x4_t exp128(float32x4_t x) {
    x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(88.0f)), vdupq_n_f32(-87.0f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
    r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187045e-06f));
    float32x4_t p = vdupq_n_f32(1.0f / 5040);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    /* 2^n for n in [-126, 127]: the exponent field, built directly */
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

static inline float32x4_t silu128(float32x4_t g) { /* g / (1 + e^-g) in fp32 */
    return vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), exp128(vnegq_f32(g))));
}

static inline float32x4_t tanh128(float32x4_t y) { /* tanh as the x86 kernels' tanh512 (SLEEF's cut-off too) */
    const float32x4_t ay = vabsq_f32(y);
    const float32x4_t e = exp128(vmulq_f32(vdupq_n_f32(-2.0f), ay));
    const float32x4_t t = vsubq_f32(vdupq_n_f32(1.0f), vdivq_f32(vaddq_f32(e, e), vaddq_f32(vdupq_n_f32(1.0f), e)));
    const uint32x4_t big = vcgtq_f32(ay, vdupq_n_f32(8.664339742f));
    return vbslq_f32(vdupq_n_u32(0x80000000u), y, vbslq_f32(big, vdupq_n_f32(1.0f), t)); /* with y's sign */
}

static inline float32x4_t gelu128(float32x4_t g) { /* gelu_pytorch_tanh, computed as the x86 kernels' gelu512 */
    const float32x4_t g3 = vmulq_f32(vmulq_f32(g, g), g);
    const float32x4_t y = vmulq_f32(vdupq_n_f32(0.7978845608028654f), vaddq_f32(g, vmulq_f32(vdupq_n_f32(0.044715f), g3)));
    return vmulq_f32(vmulq_f32(vdupq_n_f32(0.5f), g), vaddq_f32(vdupq_n_f32(1.0f), tanh128(y)));
}

/* Call CASE(rows of x, rows of W) with constant trip counts for full blocks, runtime ones for the last block */
#define DISPATCH_BLOCKN(CASE)         \
    if (nr == NRN) {                  \
        if (mr == 2) CASE(2, 4);      \
        else CASE(1, 4);              \
    } else {                          \
        CASE(mr, nr);                 \
    }
#endif
