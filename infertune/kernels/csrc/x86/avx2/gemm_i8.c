/* W8A8 on AVX2: y = (x_q W_q^T) * s_x * s_w (+ b), the AVX-512 library's it_linear_w8a8 contract (csrc/x86/avx512/
 * gemm_i8.c: the activations rounded to int8 as quantize_int8_per_token rounds them, exact int32 sums, then
 * bf16(float(sum) * s_x * s_w) and the bias added to that) for x86 CPUs without AVX-512.
 *
 * AVX2 has no VPDPBUSD; VPMADDUBSW multiplies unsigned by signed bytes and adds adjacent pairs into int16 lanes,
 * saturating. With the sign of x moved onto the weight (VPSIGNB) and |x| as the unsigned operand, each pair is at
 * most 2 x 127 x 127 = 32258: no saturation, provided the weights lie in -127..127 (quantize_int8_per_channel's
 * range; pack_w8a8 refuses -128). VPMADDWD against ones then adds the pairs into int32 lanes: 4 products a lane,
 * 32 an instruction triple (sign, multiply-add, widen-add) plus one add. (llama.cpp's Q8_0 dot product takes the
 * same route, with a float scale per 32 columns; per-channel scales keep the sums in int32 to the end.)
 *
 * The weights are packed at load (it_pack_w8a8) in that order: per 16 output features, each 32-bit word 4
 * consecutive columns of one feature (as they are: signed), 8 features a vector, the blocks one after another.
 * A micro-kernel of I8_MR rows x 16 features keeps 8 int32 accumulators; the weights stream in order, each block's
 * I8_KC-column slab serving every row of a 128-row block (their int32 sums wait in `acc` between slabs).
 */
#define I8_KC 1024         /* columns per slab: 16 features x 1024 bytes = 16 KB */
#define I8_MB 128          /* rows per pass over a slab */
#define I8_MR 4            /* rows per micro-kernel: 8 accumulators, 2 weight vectors, x, |x|, a product, ones */
#define I8_PF_WORDS 64     /* how far ahead along the packed weights (words of 16 features: 64 B each) to ask */
#define I8_NB 16           /* output features a block of the packed weight holds */
#define I8_FLIP 0          /* (the weights as they are: signed) */
#define I8_SIGNED_DRIVER /* w8a8.h i8_gemm_signed */
#include "w8a8.h"          /* I8_MAX_K, the scratch, unpacking, the entry points */

/* x [M, K] bf16 -> xq [M, Kp] int8, sx [M] and xsum [M] (the rows' sums, which this product does not need: the
 * AVX-512 one's), as quantize_int8_per_token (or by *static_scale) */
static void quantize_rows_i8(const bf16* x, int64_t ldx, int64_t M, int64_t K, const float* static_scale,
                             int nthreads, int8_t* xq, float* sx, int32_t* xsum) {
    const int64_t Kp = i8_kp(K), K8 = K & ~(int64_t)7;
    const int nt = M >= 8 && M * K >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const bf16* xr = x + m * ldx;
        float s;
        if (static_scale) {
            s = *static_scale;
        } else {
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 amax = _mm256_setzero_ps();
            for (int64_t k = 0; k < K8; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load_bf16x8(xr + k)));
            float a[8];
            _mm256_storeu_ps(a, amax);
            float t = 0.0f;
            for (int i = 0; i < 8; i++) t = a[i] > t ? a[i] : t;
            for (int64_t k = K8; k < K; k++) t = fabsf(bf2f(xr[k])) > t ? fabsf(bf2f(xr[k])) : t;
            s = i8_row_scale(t);
        }
        sx[m] = s;
        const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
        int8_t* q = xq + m * Kp;
        for (int64_t k = 0; k < K8; k += 8) {
            const __m256 v = _mm256_round_ps(_mm256_div_ps(load_bf16x8(xr + k), sv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            int32_t w[8];
            _mm256_storeu_si256((__m256i*)w, _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi)));
            for (int i = 0; i < 8; i++) q[k + i] = (int8_t)w[i];
        }
        for (int64_t k = K8; k < K; k++) {
            q[k] = i8_round1(bf2f(xr[k]), s);
        }
        for (int64_t k = K; k < Kp; k++) q[k] = 0;
        xsum[m] = 0;
    }
}

/* acc [MRC, 16] (+)= x_q rows [MRC, 4 nw] . the packed words. The 8 accumulators are named variables, not an array:
 * with an array GCC 12 at -O3 kept them on the stack, a store each per step (as it did the FMA GEMM's: gemm.c
 * fma_micro) */
static inline __attribute__((always_inline)) void i8_micro(const int8_t* xq, int64_t Kp, const int MRC,
                                                           const uint32_t* wp, int64_t nw, int32_t* acc, int first) {
#define I8_DECL(i)                                                                           \
    __m256i c##i##a = _mm256_setzero_si256(), c##i##b = _mm256_setzero_si256();            \
    if (MRC > i && !first) {                                                                 \
        c##i##a = _mm256_load_si256((const __m256i*)(acc + i * 16));                         \
        c##i##b = _mm256_load_si256((const __m256i*)(acc + i * 16 + 8));                     \
    }
#define I8_ROW(i)                                                                            \
    if (MRC > i) {                                                                           \
        int32_t word;                                                                        \
        memcpy(&word, xq + i * Kp + 4 * p, 4);                                               \
        const __m256i xb = _mm256_set1_epi32(word), xa = _mm256_abs_epi8(xb);                \
        c##i##a = _mm256_add_epi32(c##i##a,                                                  \
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, xb)), ones)); \
        c##i##b = _mm256_add_epi32(c##i##b,                                                  \
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, xb)), ones)); \
    }
#define I8_STORE(i)                                                                          \
    if (MRC > i) {                                                                           \
        _mm256_store_si256((__m256i*)(acc + i * 16), c##i##a);                               \
        _mm256_store_si256((__m256i*)(acc + i * 16 + 8), c##i##b);                           \
    }
    I8_DECL(0) I8_DECL(1) I8_DECL(2) I8_DECL(3)
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t p = 0; p < nw; p++) {
        const uint32_t* q = wp + p * 16;
        _mm_prefetch((const char*)(q + I8_PF_WORDS * 16), _MM_HINT_T0);
        const __m256i w0 = _mm256_load_si256((const __m256i*)q), w1 = _mm256_load_si256((const __m256i*)(q + 8));
        I8_ROW(0) I8_ROW(1) I8_ROW(2) I8_ROW(3)
    }
    I8_STORE(0) I8_STORE(1) I8_STORE(2) I8_STORE(3)
#undef I8_DECL
#undef I8_ROW
#undef I8_STORE
}

#define I8_MICRO(R) static void i8_micro_##R(const int8_t* xq, int64_t Kp, const uint32_t* wp, int64_t nw, \
    int32_t* acc, int first) { i8_micro(xq, Kp, R, wp, nw, acc, first); }
I8_MICRO(1) I8_MICRO(2) I8_MICRO(3) I8_MICRO(4)
#undef I8_MICRO
static const i8_micro_fn i8_micro_by_rows[I8_MR + 1] = {0, i8_micro_1, i8_micro_2, i8_micro_3, i8_micro_4};

/* The sums of rows [mr, 16], scaled, (+ bias), rounded into y's columns n0 .. n0 + nrows - 1 */
static inline void i8_store(const int32_t* acc, int mr, const float* sx, const float* scale, const bf16* bias,
                            int64_t n0, int nrows, bf16* y, int64_t ldy) {
    for (int v = 0; v < 2 && 8 * v < nrows; v++) {
        const int n = nrows - 8 * v < 8 ? nrows - 8 * v : 8, c = (int)n0 + 8 * v;
        const __m256 sw = n == 8 ? _mm256_loadu_ps(scale + c) : load_f32_tail(scale + c, n);
        const __m256 bv = !bias ? _mm256_setzero_ps() : n == 8 ? load_bf16x8(bias + c) : load_bf16_tail(bias + c, n);
        for (int i = 0; i < mr; i++) {
            const __m256 s = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(acc + i * 16 + 8 * v)));
            __m128i o = round_bf16x8_nan(_mm256_mul_ps(_mm256_mul_ps(s, _mm256_set1_ps(sx[i])), sw));
            if (bias) /* (the reference adds the bias to the bf16 product) */
                o = round_bf16x8_nan(_mm256_add_ps(bf16x8_f32(o), bv));
            if (n == 8)
                _mm_storeu_si128((__m128i*)(y + i * ldy + c), o);
            else
                memcpy(y + i * ldy + c, &o, (size_t)n * 2);
        }
    }
}

static void w8a8_gemm(const int8_t* xq, const float* sx, const int32_t* xsum, const uint32_t* wpk,
                      const float* scale, const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                      int nthreads) {
    (void)xsum; /* (no offset to take back: the weights stay signed) */
    i8_gemm_signed(xq, sx, wpk, scale, bias, y, ldy, M, N, K, nthreads, i8_micro_by_rows, I8_MR);
}


/* q int8 [N, K] -> the packed weight, i8_packed_words(N, K) words (w8a8.h i8_pack_words: the weights as they are) */
int it_pack_w8a8(const int8_t* q, int64_t N, int64_t K, uint32_t* out, int nthreads) {
    return i8_pack_words(q, N, K, out, nthreads);
}
