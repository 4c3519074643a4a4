/* W8A8 on NEON: y = (x_q W_q^T) * s_x * s_w (+ b), the x86 libraries' it_linear_w8a8 contract (csrc/x86/avx512/
 * gemm_i8.c: the activations rounded to int8 as quantize_int8_per_token rounds them, exact int32 sums, then
 * bf16(float(sum) * s_x * s_w) and the bias added to that) for AArch64.
 *
 * The weights are packed at load as the AVX2 library packs them (w8a8.h i8_pack_words: per 16 output features, each
 * 32-bit word 4 consecutive columns of one feature, signed, 16 words a step along K), so 4 columns of 16 features
 * are 4 vectors of 16 bytes, each 4 features x 4 columns. Two products, one layout:
 *   - SDOT (Armv8.2 dot product, FEAT_DotProd: Neoverse N1 / V1 / V2 and later, Graviton 2+, Kunpeng 920, Apple M):
 *     vdotq_s32 adds each lane's 4 byte products into that lane: one instruction a vector of 4 features, 16
 *     products. Picked at run time where the CPU says it has it (getauxval AT_HWCAP HWCAP_ASIMDDP);
 *     INFERTUNE_NEON_DOTPROD=0 keeps the baseline (the tests run both under qemu).
 *   - baseline Armv8-A: SMULL / SMULL2 multiply 8 byte pairs into int16 lanes (|x w| <= 127 x 127: exact), SADALP
 *     adds adjacent int16 pairs into int32 lanes: each int32 lane holds half of one feature's 4 columns; the two
 *     halves are added (ADDP) when a slab ends.
 * Per row block (I8_MB rows) the weights stream in order, each block's I8_KC-column slab serving every row; a
 * micro-kernel's int32 sums are added into `acc` at the end of each slab. No speed claim: no Arm hardware measured it.
 */
#include <sys/auxv.h>

#define I8_KC 1024 /* columns per slab: 16 features x 1024 bytes = 16 KB */
#define I8_MB 128  /* rows per pass over a slab */
#define I8_NB 16   /* output features a block of the packed weight holds */
#define I8_FLIP 0  /* (the weights as they are: signed) */
#define I8_SIGNED_DRIVER /* w8a8.h i8_gemm_signed */
#include "w8a8.h"  /* I8_MAX_K, the scratch, packing, unpacking, the entry points */

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif

/* 1: the SDOT micro-kernels (the CPU has them and INFERTUNE_NEON_DOTPROD is not "0") */
static int i8_use_dot(void) {
    const char* env = getenv("INFERTUNE_NEON_DOTPROD");
    if (env && env[0] == '0') return 0;
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
}

/* x [M, K] bf16 -> xq [M, Kp] int8, sx [M] (and xsum [M], which this product does not need), as
 * quantize_int8_per_token: s = max(max|x| / 127, 1e-12) (or *static_scale), q = round-half-even(x / s) in -127..127 */
static void quantize_rows_i8(const bf16* x, int64_t ldx, int64_t M, int64_t K, const float* static_scale,
                             int nthreads, int8_t* xq, float* sx, int32_t* xsum) {
    const int64_t Kp = i8_kp(K), K4 = K & ~(int64_t)3;
    const int nt = M >= 8 && M * K >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const bf16* xr = x + m * ldx;
        float s;
        if (static_scale) {
            s = *static_scale;
        } else {
            float32x4_t amax = vdupq_n_f32(0.0f);
            for (int64_t k = 0; k < K4; k += 4) amax = vmaxq_f32(amax, vabsq_f32(load_bf16x4(xr + k)));
            float t = vmaxvq_f32(amax);
            for (int64_t k = K4; k < K; k++) t = fabsf(bf2f(xr[k])) > t ? fabsf(bf2f(xr[k])) : t;
            s = i8_row_scale(t);
        }
        sx[m] = s;
        const float32x4_t sv = vdupq_n_f32(s);
        const int32x4_t lo = vdupq_n_s32(-127), hi = vdupq_n_s32(127);
        int8_t* q = xq + m * Kp;
        for (int64_t k = 0; k < K4; k += 4) {
            /* (FCVTNS: round to nearest, ties to even, as torch.round; saturating, then clamped) */
            const int32x4_t v = vminq_s32(vmaxq_s32(vcvtnq_s32_f32(vdivq_f32(load_bf16x4(xr + k), sv)), lo), hi);
            int32_t w[4];
            vst1q_s32(w, v);
            for (int i = 0; i < 4; i++) q[k + i] = (int8_t)w[i];
        }
        for (int64_t k = K4; k < K; k++) {
            q[k] = i8_round1(bf2f(xr[k]), s);
        }
        for (int64_t k = K; k < Kp; k++) q[k] = 0;
        xsum[m] = 0;
    }
}

/* The micro-kernels: acc [MRC, 16] (+)= x_q rows [MRC, 4 nw] . the packed words (nw words of 16 features). Their
 * accumulators are named variables (macros), not arrays: GCC 12 at -O3 kept the x86 ones' arrays on the stack. */
#define I8_WORD(i) ({ int32_t word_; memcpy(&word_, xq + (i) * Kp + 4 * p, 4); vreinterpretq_s8_s32(vdupq_n_s32(word_)); })
#define I8_ADD_OUT(i, f0, f1, f2, f3)                                                                   \
    if (MRC > i) {                                                                                      \
        int32_t* a_ = acc + (i) * 16;                                                                   \
        if (first) {                                                                                    \
            vst1q_s32(a_, f0), vst1q_s32(a_ + 4, f1), vst1q_s32(a_ + 8, f2), vst1q_s32(a_ + 12, f3);    \
        } else {                                                                                        \
            vst1q_s32(a_, vaddq_s32(vld1q_s32(a_), f0)), vst1q_s32(a_ + 4, vaddq_s32(vld1q_s32(a_ + 4), f1)); \
            vst1q_s32(a_ + 8, vaddq_s32(vld1q_s32(a_ + 8), f2));                                        \
            vst1q_s32(a_ + 12, vaddq_s32(vld1q_s32(a_ + 12), f3));                                      \
        }                                                                                               \
    }

/* SDOT: 4 rows a pass, 4 accumulators (of 4 features) a row (these functions only are built for Armv8.2-A + DotProd;
 * they run only where i8_use_dot() said the CPU has it) */
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
static inline __attribute__((always_inline)) void i8_micro_dot(
    const int8_t* xq, int64_t Kp, const int MRC, const uint32_t* wp, int64_t nw, int32_t* acc, int first) {
#define I8_DOT_DECL(i) int32x4_t d##i##0 = vdupq_n_s32(0), d##i##1 = d##i##0, d##i##2 = d##i##0, d##i##3 = d##i##0;
#define I8_DOT_ROW(i)                                                                                   \
    if (MRC > i) {                                                                                      \
        const int8x16_t xb = I8_WORD(i);                                                                \
        d##i##0 = vdotq_s32(d##i##0, w0, xb), d##i##1 = vdotq_s32(d##i##1, w1, xb);                     \
        d##i##2 = vdotq_s32(d##i##2, w2, xb), d##i##3 = vdotq_s32(d##i##3, w3, xb);                     \
    }
    I8_DOT_DECL(0) I8_DOT_DECL(1) I8_DOT_DECL(2) I8_DOT_DECL(3)
    for (int64_t p = 0; p < nw; p++) {
        const int8_t* q = (const int8_t*)(wp + p * 16);
        __builtin_prefetch(q + 1024);
        const int8x16_t w0 = vld1q_s8(q), w1 = vld1q_s8(q + 16), w2 = vld1q_s8(q + 32), w3 = vld1q_s8(q + 48);
        I8_DOT_ROW(0) I8_DOT_ROW(1) I8_DOT_ROW(2) I8_DOT_ROW(3)
    }
    I8_ADD_OUT(0, d00, d01, d02, d03) I8_ADD_OUT(1, d10, d11, d12, d13)
    I8_ADD_OUT(2, d20, d21, d22, d23) I8_ADD_OUT(3, d30, d31, d32, d33)
#undef I8_DOT_DECL
#undef I8_DOT_ROW
}
#define I8_MICRO_DOT(R)                                                                                       \
    static void i8_dot_##R(const int8_t* xq, int64_t Kp, const uint32_t* wp, int64_t nw, int32_t* acc,        \
                           int first) {                                                                       \
        i8_micro_dot(xq, Kp, R, wp, nw, acc, first);                                                          \
    }
I8_MICRO_DOT(1) I8_MICRO_DOT(2) I8_MICRO_DOT(3) I8_MICRO_DOT(4)
#undef I8_MICRO_DOT
#pragma GCC pop_options

/* Baseline: 2 rows a pass, 8 accumulators a row (each vector of 4 features in two halves: lo for its features 0-1,
 * hi for 2-3, two int32 lanes a feature) */
static inline __attribute__((always_inline)) void i8_micro_base(const int8_t* xq, int64_t Kp, const int MRC,
                                                                const uint32_t* wp, int64_t nw, int32_t* acc,
                                                                int first) {
#define I8_BASE_DECL(i)                                                                                 \
    int32x4_t l##i##0 = vdupq_n_s32(0), l##i##1 = l##i##0, l##i##2 = l##i##0, l##i##3 = l##i##0;         \
    int32x4_t h##i##0 = l##i##0, h##i##1 = l##i##0, h##i##2 = l##i##0, h##i##3 = l##i##0;
#define I8_BASE_ONE(i, j)                                                                               \
    if (MRC > i) {                                                                                      \
        l##i##j = vpadalq_s16(l##i##j, vmull_s8(vget_low_s8(w), vget_low_s8(x##i)));                     \
        h##i##j = vpadalq_s16(h##i##j, vmull_high_s8(w, x##i));                                          \
    }
#define I8_BASE_VEC(j) /* one weight vector at a time: 16 accumulators, 2 rows of x, 1 weight, 2 products */ \
    {                                                                                                   \
        const int8x16_t w = vld1q_s8(q + 16 * (j));                                                     \
        I8_BASE_ONE(0, j) I8_BASE_ONE(1, j)                                                             \
    }
#define I8_BASE_OUT(i)                                                                                  \
    I8_ADD_OUT(i, vpaddq_s32(l##i##0, h##i##0), vpaddq_s32(l##i##1, h##i##1), vpaddq_s32(l##i##2, h##i##2), \
               vpaddq_s32(l##i##3, h##i##3))
    I8_BASE_DECL(0) I8_BASE_DECL(1)
    for (int64_t p = 0; p < nw; p++) {
        const int8_t* q = (const int8_t*)(wp + p * 16);
        __builtin_prefetch(q + 1024);
        const int8x16_t x0 = I8_WORD(0), x1 = MRC > 1 ? I8_WORD(1) : x0;
        I8_BASE_VEC(0) I8_BASE_VEC(1) I8_BASE_VEC(2) I8_BASE_VEC(3)
    }
    I8_BASE_OUT(0) I8_BASE_OUT(1)
#undef I8_BASE_DECL
#undef I8_BASE_ONE
#undef I8_BASE_VEC
#undef I8_BASE_OUT
}
#undef I8_WORD
#undef I8_ADD_OUT

#define I8_MICRO_BASE(R)                                                                                      \
    static void i8_base_##R(const int8_t* xq, int64_t Kp, const uint32_t* wp, int64_t nw, int32_t* acc,       \
                            int first) {                                                                      \
        i8_micro_base(xq, Kp, R, wp, nw, acc, first);                                                         \
    }
I8_MICRO_BASE(1) I8_MICRO_BASE(2)
#undef I8_MICRO_BASE
static const i8_micro_fn i8_dot_by_rows[5] = {0, i8_dot_1, i8_dot_2, i8_dot_3, i8_dot_4};
static const i8_micro_fn i8_base_by_rows[3] = {0, i8_base_1, i8_base_2};

/* The sums of rows [mr, 16], scaled, (+ bias), rounded into y's columns n0 .. n0 + nrows - 1: as the reference,
 * bf16((float(sum) * s_x) * s_w), then bf16(that + bias) */
static inline void i8_store(const int32_t* acc, int mr, const float* sx, const float* scale, const bf16* bias,
                            int64_t n0, int nrows, bf16* y, int64_t ldy) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nrows; j++) {
            const float v = (float)acc[i * 16 + j] * sx[i] * scale[n0 + j];
            bf16 o = f2bf(v);
            if (bias) o = f2bf(bf2f(o) + bf2f(bias[n0 + j]));
            y[i * ldy + n0 + j] = o;
        }
}

static void w8a8_gemm(const int8_t* xq, const float* sx, const int32_t* xsum, const uint32_t* wpk,
                      const float* scale, const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                      int nthreads) {
    (void)xsum; /* (no offset to take back: the weights stay signed) */
    const int dot = i8_use_dot();
    i8_gemm_signed(xq, sx, wpk, scale, bias, y, ldy, M, N, K, nthreads, dot ? i8_dot_by_rows : i8_base_by_rows,
                   dot ? 4 : 2);
}

/* q int8 [N, K] -> the packed weight, i8_packed_words(N, K) words (w8a8.h i8_pack_words: the weights as they are) */
int it_pack_w8a8(const int8_t* q, int64_t N, int64_t K, uint32_t* out, int nthreads) {
    return i8_pack_words(q, N, K, out, nthreads);
}
