/* ------------------------------------------------------------------ bf16 GEMM on NEON
 *
 * y = x W^T (+ b) for steps of several rows (decode batches, short prompts), AArch64 with baseline Advanced SIMD:
 * the AVX2 library's FMA GEMM (csrc/x86/avx2/gemm.c) on 4 lanes, with its entry points and its contract. Both
 * operands are widened to fp32 (a bf16 is the high half of an fp32: exact) and multiplied with FMLA by element, one
 * lane per output feature: acc[lane] = fma(x[m, k], w[n + lane, k], acc[lane]). A bf16 x bf16 product is exact in
 * fp32, so each output is the fp32 sum of its exact products over k in order, + bias in fp32, rounded once to bf16
 * (NaN kept a NaN): bit for bit the AVX2 GEMM's result.
 *
 * Blocking (per thread, all scratch on the thread's stack: no allocation):
 *   - threads split the output features in blocks of NEON_NB (64), static schedule;
 *   - for each block, rows in passes of NEON_MB, K in slabs of NEON_KC columns: the block's 64 weight rows x
 *     NEON_KC columns widened and transposed (4 x 4 at a time) into four k-major panels of 16 features, the pass's
 *     rows of x widened into fp32;
 *   - micro-kernel: NEON_MR (6) rows x 16 features, 24 of the 32 q registers as accumulators, 4 for the panel's
 *     row of 16 weights; per k 4 loads and 24 FMLA, the x values broadcast from memory;
 *   - between slabs the fp32 sums wait in a [NEON_MB, 64] stack buffer (a store and a load: exact), so every output
 *     still sums its products over k in order.
 *
 * Not measured on Arm hardware (tests/test_neon.py checks it under qemu-user for correctness only): the blocking
 * sizes and the row count from which it_linear_bf16 takes it (NEON_GEMM_MIN_ROWS) are reasoned, not tuned. */
#define NEON_KC 256 /* columns per slab: one 16-feature panel of fp32 = 16 KB, the block's four 64 KB */
#define NEON_NB 64  /* output features per thread block (four panels of 16) */
#define NEON_MB 96  /* rows per pass over a slab (a multiple of NEON_MR): x's fp32 slab 96 KB, the sums 24 KB */
#define NEON_MR 6   /* rows per micro-kernel */

/* it_linear_bf16 takes the GEMM from this many rows (fewer: the GEMV, which streams the weights once per MRN = 2
 * rows): a guess from that count, not a measurement; it_gemm_rows_fma sets it (tests, benchmarks). */
#ifndef NEON_GEMM_MIN_ROWS
#define NEON_GEMM_MIN_ROWS 6
#endif
static int64_t gemm_rows_neon = NEON_GEMM_MIN_ROWS;

/* c[j] = (r0[j], r1[j], r2[j], r3[j]): four rows of 4 -> four columns */
static inline void transpose4x4_f32(float32x4_t r[4]) {
    const float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    const float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}

/* W rows n0 .. n0 + 63 (rows past nrows zero), columns k0 .. k0 + kc - 1, widened:
 * wp[v][k][l] = w[n0 + 16 v + l][k0 + k] */
static void neon_pack_w(const bf16* w, int64_t K, int64_t n0, int nrows, int64_t k0, int64_t kc, float* wp) {
    const int64_t k4 = kc & ~(int64_t)3;
    for (int q = 0; q < NEON_NB / 4; q++) { /* 4 features at a time: a quarter of a panel */
        float* dst = wp + (q / 4) * NEON_KC * 16 + (q % 4) * 4;
        const int r0 = 4 * q;
        for (int64_t k = 0; k < k4; k += 4) {
            float32x4_t r[4];
            for (int j = 0; j < 4; j++)
                r[j] = r0 + j < nrows ? load_bf16x4(w + (n0 + r0 + j) * K + k0 + k) : vdupq_n_f32(0.0f);
            transpose4x4_f32(r);
            for (int c = 0; c < 4; c++) vst1q_f32(dst + (k + c) * 16, r[c]);
        }
        for (int64_t k = k4; k < kc; k++)
            for (int j = 0; j < 4; j++) dst[k * 16 + j] = r0 + j < nrows ? bf2f(w[(n0 + r0 + j) * K + k0 + k]) : 0.0f;
    }
}

/* x rows 0 .. rows - 1 (row stride ldx), columns k0 .. k0 + kc - 1, widened: xp[i][k] (row stride NEON_KC) */
static void neon_pack_x(const bf16* x, int64_t ldx, int64_t rows, int64_t k0, int64_t kc, float* xp) {
    const int64_t k4 = kc & ~(int64_t)3;
    for (int64_t i = 0; i < rows; i++) {
        const bf16* xr = x + i * ldx + k0;
        float* d = xp + i * NEON_KC;
        int64_t k = 0;
        for (; k < k4; k += 4) vst1q_f32(d + k, load_bf16x4(xr + k));
        for (; k < kc; k++) d[k] = bf2f(xr[k]);
    }
}

/* acc [MRC, 64] columns 16 v .. 16 v + 15 (+)= xp rows [MRC, kc] . panel (first: from zero) */
static inline __attribute__((always_inline)) void neon_micro(const float* xp, const int MRC, const float* panel,
                                                             int64_t kc, float* acc, int first) {
    float32x4_t c[NEON_MR][4];
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++) c[i][v] = first ? vdupq_n_f32(0.0f) : vld1q_f32(acc + i * NEON_NB + 4 * v);
    for (int64_t k = 0; k < kc; k++) {
        const float* p = panel + k * 16;
        const float32x4_t w0 = vld1q_f32(p), w1 = vld1q_f32(p + 4), w2 = vld1q_f32(p + 8), w3 = vld1q_f32(p + 12);
        for (int i = 0; i < MRC; i++) {
            const float xv = xp[i * NEON_KC + k];
            c[i][0] = vfmaq_n_f32(c[i][0], w0, xv);
            c[i][1] = vfmaq_n_f32(c[i][1], w1, xv);
            c[i][2] = vfmaq_n_f32(c[i][2], w2, xv);
            c[i][3] = vfmaq_n_f32(c[i][3], w3, xv);
        }
    }
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++) vst1q_f32(acc + i * NEON_NB + 4 * v, c[i][v]);
}

#define NEON_MICRO(R)                                                                                             \
    static void neon_micro_##R(const float* xp, const float* panel, int64_t kc, float* acc, int first) {          \
        neon_micro(xp, R, panel, kc, acc, first);                                                                 \
    }
NEON_MICRO(1) NEON_MICRO(2) NEON_MICRO(3) NEON_MICRO(4) NEON_MICRO(5) NEON_MICRO(6)
#undef NEON_MICRO
typedef void (*neon_micro_fn)(const float*, const float*, int64_t, float*, int);
static const neon_micro_fn neon_micro_by_rows[NEON_MR + 1] = {0, neon_micro_1, neon_micro_2, neon_micro_3,
                                                              neon_micro_4, neon_micro_5, neon_micro_6};

/* rows [mr, 64] of sums (+ bias), rounded as f2bf (NaN kept), into y's columns n0 .. n0 + nrows - 1 */
static void neon_store(const float* acc, int64_t mr, const bf16* bias, int64_t n0, int nrows, bf16* y, int64_t ldy) {
    for (int64_t i = 0; i < mr; i++)
        for (int j = 0; j < nrows; j++)
            y[i * ldy + n0 + j] = f2bf(acc[i * NEON_NB + j] + (bias ? bf2f(bias[n0 + j]) : 0.0f));
}

static void linear_bf16_neon_gemm(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                                  int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + NEON_NB - 1) / NEON_NB;
    const int nt = pick_threads(nblocks, N * K * 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        float wp[NEON_NB / 16 * NEON_KC * 16] __attribute__((aligned(64)));
        float xp[NEON_MB * NEON_KC] __attribute__((aligned(64)));
        float acc[NEON_MB * NEON_NB] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * NEON_NB;
            const int nrows = (int)(N - n0 < NEON_NB ? N - n0 : NEON_NB);
            const int panels = (nrows + 15) / 16;
            for (int64_t m0 = 0; m0 < M; m0 += NEON_MB) {
                const int64_t rows = M - m0 < NEON_MB ? M - m0 : NEON_MB;
                for (int64_t k0 = 0; k0 < K; k0 += NEON_KC) {
                    const int64_t kc = K - k0 < NEON_KC ? K - k0 : NEON_KC;
                    neon_pack_w(w, K, n0, nrows, k0, kc, wp);
                    neon_pack_x(x + m0 * ldx, ldx, rows, k0, kc, xp);
                    for (int v = 0; v < panels; v++)
                        for (int64_t i0 = 0; i0 < rows; i0 += NEON_MR) {
                            const int mr = (int)(rows - i0 < NEON_MR ? rows - i0 : NEON_MR);
                            neon_micro_by_rows[mr](xp + i0 * NEON_KC, wp + v * NEON_KC * 16, kc,
                                                   acc + i0 * NEON_NB + 16 * v, k0 == 0);
                        }
                    if (k0 + kc >= K) neon_store(acc, rows, bias, n0, nrows, y + m0 * ldy, ldy);
                }
            }
        }
    }
}

/* Sets (rows > 0) and returns gemm_rows_neon (the AVX2 library's name for its own: kernels/cpu.py calls either) */
int64_t it_gemm_rows_fma(int64_t rows) {
    if (rows > 0) gemm_rows_neon = rows;
    return gemm_rows_neon;
}

/* The two paths on their own, whatever the rows (tests, benchmarks): the AVX2 library's entry points */
void it_linear_bf16_gemv(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
    linear_bf16_gemvn(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}

int it_linear_bf16_gemm_fma(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                            int64_t M, int64_t N, int64_t K, int nthreads) {
    linear_bf16_neon_gemm(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
    return 0;
}

/* y = x W^T (+ b): the GEMV below gemm_rows_neon rows, the GEMM from it */
void it_linear_bf16(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M >= gemm_rows_neon)
        linear_bf16_neon_gemm(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
    else
        linear_bf16_gemvn(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}
