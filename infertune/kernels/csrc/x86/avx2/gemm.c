/* ------------------------------------------------------------------ bf16 GEMM on AVX2 + FMA
 *
 * y = x W^T (+ b) for steps past a few rows (prompts, decode batches), x86 CPUs without AVX-512. AVX2 has no bf16
 * dot product, so both operands are widened to fp32 (a bf16 is the high half of an fp32: exact) and multiplied with
 * FMA on 8 lanes, one lane per output feature: acc[lane] = fma(x[m, k], w[n + lane, k], acc[lane]). A bf16 x bf16
 * product is exact in fp32 (8 + 8 significant bits), so each output is the fp32 sum of its exact products over k
 * in order, rounded once to bf16 (+ bias in fp32 first), as the GEMV and the other variants' contract.
 *
 * Blocking (GotoBLAS-like, per thread, all scratch on the thread's stack: no allocation):
 *   - threads split the output features in blocks of FMA_NB (64), static schedule;
 *   - for each block, rows in passes of FMA_MB (132), K in slabs of FMA_KC (256) columns: the block's 64 weight rows
 *     x FMA_KC columns are widened and transposed into four k-major panels of 16 features (64 KB in L2, one panel
 *     16 KB in L1), and the pass's rows of x x FMA_KC columns widened into fp32 (132 KB in L2);
 *   - micro-kernel: 6 rows x 16 features, 12 ymm accumulators, 2 weight vectors and one broadcast of x; per k 2
 *     loads, 6 broadcasts (load-port only) and 12 FMA: FMA-bound, no sums across lanes;
 *   - between slabs the fp32 sums wait in a [FMA_MB, 64] stack buffer (a store and a load: exact), so every output
 *     sums its products over k in order, as one pass would;
 *   - while a slab multiplies, the next slab's weight rows are asked into L2 (the rows of a slab are 64 short runs
 *     that the hardware prefetchers do not follow in time), spread over the micro-kernel's k loop.
 *
 * Which row counts take it (it_linear_bf16 below; gemm_rows_fma): measured by benchmarks/bench_gemm_avx2.py. */
#ifndef FMA_KC
#define FMA_KC 256 /* columns per slab: one 16-feature panel of fp32 = 16 KB (L1), the block's four 64 KB */
#endif
#define FMA_NB 64  /* output features per thread block (four panels of 16) */
#ifndef FMA_MB
#define FMA_MB 132 /* rows per pass over a slab (a multiple of FMA_MR; 128-row prompts in one): x's fp32 slab 132 KB,
                      the sums 33 KB, on the thread's stack with the 64 KB of W */
#endif
#define FMA_MR 6   /* rows per micro-kernel */

/* it_linear_bf16 takes the GEMM from this many rows (fewer: the GEMV): set once at load (kernels/cpu.py), or by
 * tests and benchmarks through it_gemm_rows_fma. The value: benchmarks/bench_gemm_avx2.py on the 386M model's
 * shapes (docs/kernels.md "AVX2"). */
#ifndef FMA_GEMM_MIN_ROWS
#define FMA_GEMM_MIN_ROWS 32
#endif
static int64_t gemm_rows_fma = FMA_GEMM_MIN_ROWS;
/* ... and below it, the GEMV on x widened once (gemv.c linear_bf16_gemvx) from this many rows */
#ifndef GEMVX_MIN_ROWS
#define GEMVX_MIN_ROWS 2
#endif
static int64_t gemvx_rows = GEMVX_MIN_ROWS;

/* 8 fp32 -> 8 bf16 as f2bf rounds, NaN included (a NaN stays a quiet NaN) */
static inline __m128i round_bf16x8_nan(__m256 v) {
    const __m256i r = _mm256_srli_epi32(round_bits8(v), 16);
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i u = _mm256_blendv_epi8(r, q, nan);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08));
}

/* r[j] (8 values of row j) -> r[c] (value c of each of the 8 rows) */
static inline void transpose8x8_ps(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        s[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}

/* W rows n0 .. n0 + 63 (rows past nrows zero), columns k0 .. k0 + kc - 1, widened: wp[v][k][l] = w[n0 + 16 v + l][k0 + k] */
static void fma_pack_w(const bf16* w, int64_t K, int64_t n0, int nrows, int64_t k0, int64_t kc, float* wp) {
    const int64_t k8 = kc & ~(int64_t)7;
    for (int h = 0; h < FMA_NB / 8; h++) { /* 8 features at a time: half a panel */
        float* dst = wp + (h / 2) * FMA_KC * 16 + (h % 2) * 8;
        const int r0 = 8 * h;
        for (int64_t k = 0; k < k8; k += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = r0 + j < nrows ? load_bf16x8(w + (n0 + r0 + j) * K + k0 + k) : _mm256_setzero_ps();
            transpose8x8_ps(r);
            for (int c = 0; c < 8; c++) _mm256_store_ps(dst + (k + c) * 16, r[c]);
        }
        for (int64_t k = k8; k < kc; k++)
            for (int j = 0; j < 8; j++) dst[k * 16 + j] = r0 + j < nrows ? bf2f(w[(n0 + r0 + j) * K + k0 + k]) : 0.0f;
    }
}

/* x rows m0 .. m0 + rows - 1, columns k0 .. k0 + kc - 1, widened: xp[i][k] (row stride FMA_KC) */
static void fma_pack_x(const bf16* x, int64_t ldx, int64_t rows, int64_t k0, int64_t kc, float* xp) {
    const int64_t k8 = kc & ~(int64_t)7;
    for (int64_t i = 0; i < rows; i++) {
        const bf16* xr = x + i * ldx + k0;
        float* d = xp + i * FMA_KC;
        int64_t k = 0;
        for (; k < k8; k += 8) _mm256_store_ps(d + k, load_bf16x8(xr + k));
        for (; k < kc; k++) d[k] = bf2f(xr[k]);
    }
}

/* The next slab's weight rows, to ask into L2 a few lines at a time while this slab multiplies */
typedef struct {
    const char* base;                    /* its first row's first byte (NULL: nothing to fetch) */
    int64_t ld, row_lines, first, count; /* row stride in bytes, lines per row, this call's share of the lines */
} fma_pf;

IT_PREFETCH_FN void fma_prefetch(const fma_pf* pf, int64_t j) {
    if (j < pf->count) {
        const int64_t line = pf->first + j;
        _mm_prefetch(pf->base + (line / pf->row_lines) * pf->ld + (line % pf->row_lines) * 64, _MM_HINT_T1);
    }
}

/* acc [MRC, 64] columns 16 v .. 16 v + 15 (+)= xp rows [MRC, kc] . panel (first: from zero).
 * The 12 accumulators are named variables, not an array: with an array of __m256 GCC 12 at -O3 kept them on the
 * stack, a store each per k step (12 stores for 12 FMAs, seen in the disassembly), which held this GEMM near 60% of
 * the FMA peak; at -O2, or as scalars, they stay in registers. This call's share of the next slab's lines is asked
 * for at once, before the FMAs. */
static inline __attribute__((always_inline)) void fma_micro(const float* xp, const int MRC, const float* panel,
                                                            int64_t kc, float* acc, int first, const fma_pf* pf) {
#define FMA_DECL(i)                                                                       \
    __m256 c##i##a = _mm256_setzero_ps(), c##i##b = _mm256_setzero_ps();                \
    if (MRC > i && !first) {                                                              \
        c##i##a = _mm256_load_ps(acc + i * FMA_NB);                                       \
        c##i##b = _mm256_load_ps(acc + i * FMA_NB + 8);                                   \
    }
#define FMA_ROW(i)                                                                        \
    if (MRC > i) {                                                                        \
        const __m256 xb = _mm256_broadcast_ss(xp + i * FMA_KC + k);                       \
        c##i##a = _mm256_fmadd_ps(xb, w0, c##i##a);                                       \
        c##i##b = _mm256_fmadd_ps(xb, w1, c##i##b);                                       \
    }
#define FMA_STORE(i)                                                                      \
    if (MRC > i) {                                                                        \
        _mm256_store_ps(acc + i * FMA_NB, c##i##a);                                       \
        _mm256_store_ps(acc + i * FMA_NB + 8, c##i##b);                                   \
    }
    FMA_DECL(0) FMA_DECL(1) FMA_DECL(2) FMA_DECL(3) FMA_DECL(4) FMA_DECL(5)
    for (int64_t j = 0; j < pf->count; j++) fma_prefetch(pf, j);
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_load_ps(panel + k * 16), w1 = _mm256_load_ps(panel + k * 16 + 8);
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
    }
    FMA_STORE(0) FMA_STORE(1) FMA_STORE(2) FMA_STORE(3) FMA_STORE(4) FMA_STORE(5)
#undef FMA_DECL
#undef FMA_ROW
#undef FMA_STORE
}

#define FMA_MICRO(R)                                                                                             \
    static void fma_micro_##R(const float* xp, const float* panel, int64_t kc, float* acc, int first,           \
                              const fma_pf* pf) {                                                                \
        fma_micro(xp, R, panel, kc, acc, first, pf);                                                             \
    }
FMA_MICRO(1) FMA_MICRO(2) FMA_MICRO(3) FMA_MICRO(4) FMA_MICRO(5) FMA_MICRO(6)
#undef FMA_MICRO
typedef void (*fma_micro_fn)(const float*, const float*, int64_t, float*, int, const fma_pf*);
static const fma_micro_fn fma_micro_by_rows[FMA_MR + 1] = {0, fma_micro_1, fma_micro_2, fma_micro_3,
                                                           fma_micro_4, fma_micro_5, fma_micro_6};

/* rows [mr, 64] of sums (+ bias), rounded, into y's columns n0 .. n0 + nrows - 1 */
static void fma_store(const float* acc, int64_t mr, const bf16* bias, int64_t n0, int nrows, bf16* y, int64_t ldy) {
    for (int v = 0; v < FMA_NB / 8 && 8 * v < nrows; v++) {
        const int n = nrows - 8 * v < 8 ? nrows - 8 * v : 8;
        const __m256 bv = !bias ? _mm256_setzero_ps()
                          : n == 8 ? load_bf16x8(bias + n0 + 8 * v)
                                   : load_bf16_tail(bias + n0 + 8 * v, n);
        for (int64_t i = 0; i < mr; i++) {
            const __m128i r = round_bf16x8_nan(_mm256_add_ps(_mm256_load_ps(acc + i * FMA_NB + 8 * v), bv));
            if (n == 8) {
                _mm_storeu_si128((__m128i*)(y + i * ldy + n0 + 8 * v), r);
            } else {
                bf16 t[8];
                _mm_storeu_si128((__m128i*)t, r);
                memcpy(y + i * ldy + n0 + 8 * v, t, (size_t)n * 2);
            }
        }
    }
}

static void linear_bf16_fma_gemm(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                                 int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + FMA_NB - 1) / FMA_NB;
    const int nt = pick_threads(nblocks, N * K * 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        float wp[FMA_NB / 16 * FMA_KC * 16] __attribute__((aligned(64)));
        float xp[FMA_MB * FMA_KC] __attribute__((aligned(64)));
        float acc[FMA_MB * FMA_NB] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * FMA_NB;
            const int nrows = (int)(N - n0 < FMA_NB ? N - n0 : FMA_NB);
            for (int64_t m0 = 0; m0 < M; m0 += FMA_MB) {
                const int64_t rows = M - m0 < FMA_MB ? M - m0 : FMA_MB;
                for (int64_t k0 = 0; k0 < K; k0 += FMA_KC) {
                    const int64_t kc = K - k0 < FMA_KC ? K - k0 : FMA_KC;
                    fma_pack_w(w, K, n0, nrows, k0, kc, wp);
                    fma_pack_x(x + m0 * ldx, ldx, rows, k0, kc, xp);
                    /* the slab packed next: this block's next columns, else (after the last pass of rows) the next
                       block's first, which under the static schedule is this thread's next block */
                    fma_pf pf = {0};
                    const int last = k0 + kc >= K;
                    const int64_t nk0 = last ? 0 : k0 + kc, nn0 = last && m0 + FMA_MB >= M ? n0 + FMA_NB : n0;
                    if (nn0 < N) {
                        const int64_t nkc = K - nk0 < FMA_KC ? K - nk0 : FMA_KC;
                        const int64_t nr = N - nn0 < FMA_NB ? N - nn0 : FMA_NB;
                        pf.base = (const char*)(w + nn0 * K + nk0);
                        pf.ld = K * 2;
                        pf.row_lines = (nkc * 2 + 63) / 64;
                        pf.count = nr * pf.row_lines;
                    }
                    const int panels = (nrows + 15) / 16;
                    const int64_t micros = panels * ((rows + FMA_MR - 1) / FMA_MR);
                    const int64_t share = (pf.count + micros - 1) / micros;
                    int64_t call = 0;
                    for (int v = 0; v < panels; v++)
                        for (int64_t i0 = 0; i0 < rows; i0 += FMA_MR, call++) {
                            const int mr = (int)(rows - i0 < FMA_MR ? rows - i0 : FMA_MR);
                            fma_pf part = pf;
                            part.first = call * share;
                            part.count = pf.count - part.first < share ? pf.count - part.first : share;
                            if (part.count < 0) part.count = 0;
                            fma_micro_by_rows[mr](xp + i0 * FMA_KC, wp + v * FMA_KC * 16, kc,
                                                  acc + i0 * FMA_NB + 16 * v, k0 == 0, &part);
                        }
                    if (last) fma_store(acc, rows, bias, n0, nrows, y + m0 * ldy, ldy);
                }
            }
        }
    }
}

/* Sets (rows > 0) and returns gemm_rows_fma */
int64_t it_gemm_rows_fma(int64_t rows) {
    if (rows > 0) gemm_rows_fma = rows;
    return gemm_rows_fma;
}

/* The two paths on their own, whatever the rows (tests, benchmarks) */
void it_linear_bf16_gemv(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
    linear_bf16_gemv2(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}

int it_linear_bf16_gemm_fma(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                            int64_t M, int64_t N, int64_t K, int nthreads) {
    linear_bf16_fma_gemm(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
    return 0;
}

int it_linear_bf16_gemvx(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
    return linear_bf16_gemvx(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}

/* Sets (rows > 0) and returns gemvx_rows */
int64_t it_gemvx_rows(int64_t rows) {
    if (rows > 0) gemvx_rows = rows;
    return gemvx_rows;
}

/* y = x W^T (+ b): the GEMV below gemvx_rows rows, the GEMV on widened x below gemm_rows_fma, the GEMM from it */
void it_linear_bf16(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M >= gemm_rows_fma)
        linear_bf16_fma_gemm(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
    else if (M < gemvx_rows || linear_bf16_gemvx(x, ldx, w, bias, y, ldy, M, N, K, nthreads) != 0)
        linear_bf16_gemv2(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}
