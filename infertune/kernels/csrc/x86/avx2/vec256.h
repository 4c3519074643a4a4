/* AVX2 + FMA helpers for the AVX2 kernels: bf16 <-> fp32 on 8 lanes (a bf16 is the high half of an fp32, so
 * widening is a shift or an unpack against zero), rounding to bf16 as f2bf, horizontal sums, padded tails. */
#ifndef IT_VEC256_H
#define IT_VEC256_H
#include <immintrin.h>
#include "bf16.h"

#define NR2 4          /* weight rows per block */
#define MR2 2          /* activation rows per pass over a block (16 ymm registers: 8 accumulators, 4 weights) */
#define PF2_BYTES 1024 /* software prefetch distance along a weight row */

static inline __m256 bf16x8_f32(__m128i v) { /* 8 bf16 -> fp32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline __m256 load_bf16x8(const bf16* p) { return bf16x8_f32(_mm_loadu_si128((const __m128i*)p)); }

static inline __m256i round_bits8(__m256 v) { /* fp32 -> its nearest bf16 in the high half, low half zero */
    __m256i u = _mm256_castps_si256(v);
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                             _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    return _mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u));
}

static inline __m128i round_bf16x8(__m256 v) { /* 8 fp32 -> 8 bf16, nearest even, as f2bf (finite values) */
    const __m256i u = _mm256_srli_epi32(round_bits8(v), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08));
}

static inline __m256 bf16_round_f32x8(__m256 v) { return _mm256_castsi256_ps(round_bits8(v)); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int64_t hsum8_epi32(__m256i v) { /* exact: widened to int64 before adding */
    const __m256i lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v));
    const __m256i hi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1));
    const __m256i s = _mm256_add_epi64(lo, hi);
    int64_t t[4];
    _mm256_storeu_si256((__m256i*)t, s);
    return t[0] + t[1] + t[2] + t[3];
}

/* The first n (< 8) values at p, zero padded, and back: the tails of the elementwise kernels run the same vector
 * code as their bodies, so a row rounds the same wherever its length ends. */
static inline __m256 load_bf16_tail(const bf16* p, int64_t n) {
    bf16 t[8] = {0};
    memcpy(t, p, (size_t)n * 2);
    return load_bf16x8(t);
}

static inline __m256 load_f32_tail(const float* p, int64_t n) {
    float t[8] = {0};
    memcpy(t, p, (size_t)n * 4);
    return _mm256_loadu_ps(t);
}

static inline void store_bf16_tail(bf16* p, __m256 v, int64_t n) {
    bf16 t[8];
    _mm_storeu_si128((__m128i*)t, round_bf16x8(v));
    memcpy(p, t, (size_t)n * 2);
}

/* e^x, relative error ~1e-7 over the clamped range (the AVX-512 kernels' polynomial, on 8 lanes) */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n for n in [-126, 127]: the exponent field, built directly */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 silu256(__m256 g) { /* g / (1 + e^-g) in fp32 */
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

static inline __m256 tanh256(__m256 y) { /* tanh as tanh512 (torch's vectorized tanh, SLEEF's, cut-off included) */
    const __m256 sign = _mm256_set1_ps(-0.0f), ay = _mm256_andnot_ps(sign, y);
    const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), ay));
    const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_add_ps(e, e), _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    const __m256 big = _mm256_cmp_ps(ay, _mm256_set1_ps(8.664339742f), _CMP_GT_OQ);
    return _mm256_or_ps(_mm256_blendv_ps(t, _mm256_set1_ps(1.0f), big), _mm256_and_ps(sign, y));
}

static inline __m256 gelu256(__m256 g) { /* gelu_pytorch_tanh, computed as gelu512 */
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), tanh256(y)));
}

/* Call CASE(rows of x, rows of W) with constant trip counts for full blocks, runtime ones for the last block */
#define DISPATCH_BLOCK2(CASE)         \
    if (nr == NR2) {                  \
        if (mr == 2) CASE(2, 4);      \
        else CASE(1, 4);              \
    } else {                          \
        CASE(mr, nr);                 \
    }
#endif
