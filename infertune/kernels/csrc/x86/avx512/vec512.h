/* AVX-512 helpers shared by the AVX-512 kernels: masked bf16 loads, rounding to bf16, the dequantized rows of
 * quantized weights, exp / SiLU in fp32, and the GEMV blocking. */
#ifndef IT_VEC512_H
#define IT_VEC512_H
#include <immintrin.h>
#include "bf16.h"

#define NR 4          /* weight rows per block */
#define MR 4          /* activation rows per pass over a block */
#define PF_BYTES 1024 /* software prefetch distance along a weight row */
#ifndef PF_KEYS
#define PF_KEYS 32    /* ... and along a sequence's K/V rows in the decode attention */
#endif

static inline __mmask16 mask16(int64_t left) { /* the first min(left, 16) lanes */
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __mmask32 mask32(int64_t left) { /* the first min(left, 32) lanes */
    return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
}

static inline __m512 load_bf16x16(const bf16* p, __mmask16 m) { /* 16 bf16 (masked) -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m256i round_bf16x16(__m512 v) { /* 16 fp32 -> bf16, nearest even, as f2bf (finite values) */
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

static inline int chunk_tiles(int64_t N16, int64_t ch) {
    return (int)((N16 - ch * 64) / 16 < 4 ? (N16 - ch * 64) / 16 : 4);
}

/* One row of a quantized weight as bf16, rounded as the PyTorch references: bf16(q * bf16(s)) for int8,
 * bf16(q * s + z) (fp32 multiply, then add) for int4 in the 64-column nibble layout. */
static inline void dequant_w8_row(const int8_t* q, float s, bf16* out, int64_t K) {
    const __m512 sv = _mm512_set1_ps(s);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k))));
        _mm256_storeu_si256((__m256i*)(out + k), round_bf16x16(_mm512_mul_ps(v, sv)));
    }
    for (; k < K; k++) out[k] = f2bf((float)q[k] * s);
}

static inline void dequant_w4_row(const uint8_t* p, const float* scale, const float* zero, int64_t gs, bf16* out,
                                  int64_t K) {
    for (int64_t g = 0, k0 = 0; g < K / gs; g++) { /* group by group (K % gs == 0 at every caller) */
        const __m512 sv = _mm512_set1_ps(scale[g]), zv = _mm512_set1_ps(zero[g]);
        for (const int64_t end = k0 + gs; k0 < end; k0 += 64) /* 32 bytes: columns k0 + b (low), k0 + 32 + b (high) */
            for (int64_t h = 0; h < 2; h++) { /* bytes 16 h .. 16 h + 15 */
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + k0 / 2 + 16 * h)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                _mm256_storeu_si256((__m256i*)(out + k0 + 16 * h),
                                    round_bf16x16(_mm512_add_ps(_mm512_mul_ps(lo, sv), zv)));
                _mm256_storeu_si256((__m256i*)(out + k0 + 32 + 16 * h),
                                    round_bf16x16(_mm512_add_ps(_mm512_mul_ps(hi, sv), zv)));
            }
    }
}

/* The same rows with VCVTNE2PS2BF16 rounding 32 values an instruction. It rounds to nearest even as f2bf does, but
 * flushes denormals (inputs and results) to zero, so these are taken only where no product can be a nonzero
 * denormal (dq_row_is_normal): an int8 row whose scale is 0 or at least FLT_MIN (then |q s| >= |s|); an int4 row
 * whose every scale and offset is 0 or at least 2^-102 (each is then a multiple of 2^-125, and so are q s and
 * q s + z, exactly and once rounded: a nonzero result is at least 2^-125 > FLT_MIN). NaN or infinite scales keep
 * the exact path too. Same bits as dequant_w8_row / dequant_w4_row, ~2x fewer instructions. */
static inline int dq_scale_ok(float v, float least) {
    const float a = v < 0 ? -v : v;
    return v == 0.0f || (a >= least && a <= 3.4028234e38f);
}

/* Lanes of v that are 0 or finite with |v| >= 2^-102 (dq_scale_ok(., 2^-102) lane by lane; a NaN fails every
 * compare): an int4 group scale or offset with which q s + z is 0 or past FLT_MIN, never a denormal */
static inline __mmask16 dq_normal16(__m512 v) {
    const __m512 a = _mm512_abs_ps(v);
    return _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_EQ_OQ) |
           (_mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-102f), _CMP_GE_OQ) &
            _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.4028234e38f), _CMP_LE_OQ));
}

/* dq_scale_ok(., 2^-102) for every scale and offset of a row, 16 groups a compare: the scalar test of each group
 * (two compares and branches a group) had been ~a third of the instructions of a K = 4864 row's rebuild (perf) */
static inline int dq_w4_row_is_normal(const float* scale, const float* zero, int64_t G) {
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 live = G - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g)) - 1);
        const __mmask16 ok = dq_normal16(_mm512_maskz_loadu_ps(live, scale + g)) &
                             dq_normal16(_mm512_maskz_loadu_ps(live, zero + g));
        if ((ok & live) != live) return 0;
    }
    return 1;
}

static inline void dequant_w8_row_fast(const int8_t* q, float s, bf16* out, int64_t K) {
    if (!dq_scale_ok(s, 0x1p-126f)) {
        dequant_w8_row(q, s, out, K);
        return;
    }
    const __m512 sv = _mm512_set1_ps(s);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k))));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k + 16))));
        _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(b, sv), _mm512_mul_ps(a, sv)));
    }
    if (k < K) dequant_w8_row(q + k, s, out + k, K - k);
}

/* int4 rows a group at a time: a group's 16 possible values bf16(q s + z) (q = 0 .. 15, the same fp32 multiply, add
 * and VCVTNE2PS2BF16 as the row loop's, so the same bits) worked out once into a vector, then each 32 columns one
 * VPERMW lookup by their nibbles: ~8 instructions per 64 weights in place of ~26 */
/* ahead: 0, or a byte distance at which each 64-byte line of the row is asked into L2 as the rebuild reaches it (one
 * prefetch per line, spread along the row: the same lines asked for in one burst at the start of each row stalled
 * the rebuild on its prefetches, perf) */
static inline __attribute__((always_inline)) void dequant_w4_row_ahead(const uint8_t* p, const float* scale,
                                                                       const float* zero, int64_t gs, bf16* out,
                                                                       int64_t K, int64_t ahead) {
    if (!dq_w4_row_is_normal(scale, zero, K / gs)) {
        dequant_w4_row(p, scale, zero, gs, out, K);
        return;
    }
    const __m512 q16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* group by group (K % gs == 0 at every caller): with a 64-bit division k0 / gs per 64 weights, as this loop had,
       a rebuild into L1 took 1.28x the time (docs/kernels.md). The table holds the group's 16 values twice (words 0-15
       and 16-31) and VPERMW reads an index's low 5 bits, so a byte's low nibble indexes it without a mask. */
    for (int64_t g = 0, k0 = 0; g < K / gs; g++) {
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(q16, _mm512_set1_ps(scale[g])), _mm512_set1_ps(zero[g]));
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
        for (const int64_t end = k0 + gs; k0 < end; k0 += 64) { /* 32 bytes: columns k0 + b (low nibbles), k0 + 32 + b (high) */
            if (ahead && (k0 & 127) == 0) _mm_prefetch((const char*)p + k0 / 2 + ahead, _MM_HINT_T1);
            const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(p + k0 / 2)));
            _mm512_storeu_si512(out + k0, _mm512_permutexvar_epi16(b, table));
            _mm512_storeu_si512(out + k0 + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table));
        }
    }
}

static inline void dequant_w4_row_fast(const uint8_t* p, const float* scale, const float* zero, int64_t gs, bf16* out,
                                       int64_t K) {
    dequant_w4_row_ahead(p, scale, zero, gs, out, K, 0);
}

static inline float w8_scale(const void* scale, int scale_is_f32, int64_t n) {
    /* the reference multiplies in bf16: q.to(bf16) * s.to(bf16) */
    return bf2f(scale_is_f32 ? f2bf(((const float*)scale)[n]) : ((const bf16*)scale)[n]);
}

static inline __m512 bf16_round_f32(__m512 v) { /* fp32 -> the nearest bf16, back in fp32 (round_bf16x16's bits) */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __m512 exp512(__m512 x) { /* e^x, relative error ~1e-7 over the clamped range */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}



/* 1 / d to ~1 ulp: the 14-bit estimate and one Newton step (a division costs ~4x as much here) */
static inline __m512 rcp512(__m512 d) {
    const __m512 r = _mm512_rcp14_ps(d);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
}

static inline __m512 silu512(__m512 g) { /* g / (1 + e^-g) in fp32 */
    return _mm512_mul_ps(g, rcp512(_mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
}

/* tanh(y) in fp32 as torch's vectorized tanh (SLEEF's) gives it: tanh(|y|) = 1 - 2 E / (1 + E), E = e^-2|y|, with
 * y's sign, and +-1 past |y| = 8.664339742 (where SLEEF returns +-1). (Integer and / or: the float ones are
 * AVX512DQ.) */
static inline __m512 tanh512(__m512 y) {
    const __m512 ay = _mm512_abs_ps(y);
    const __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), ay));
    const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_add_ps(e, e), _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    const __mmask16 big = _mm512_cmp_ps_mask(ay, _mm512_set1_ps(8.664339742f), _CMP_GT_OQ);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_mask_blend_ps(big, t, _mm512_set1_ps(1.0f))), sign));
}

/* GeLU, tanh approximation (transformers' gelu_pytorch_tanh), as torch's vectorized formula computes it in fp32:
 * 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3) (1 + tanh(y) cancels where torch's does: 0 where tanh(y)
 * is -1) */
static inline __m512 gelu512(__m512 g) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), g3)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh512(y)));
}

/* Whether y's rows start on 64-byte lines (y and its row stride), so a row's whole chunk can go past the caches */
static inline int rows_on_lines(const bf16* y, int64_t ldy) { return !((uintptr_t)y & 63) && !(ldy & 31); }

#endif
