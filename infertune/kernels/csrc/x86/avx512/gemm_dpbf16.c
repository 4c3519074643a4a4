/* bf16 GEMM on AVX-512 BF16 without AMX (Zen 4 / 5, or AMX switched off): y = x W^T (+ b) for a few rows up to
 * prefill sizes, VDPBF16PS with one operand a broadcast pair of x.
 *
 * VDPBF16PS adds, per fp32 lane, the products of one bf16 pair of each operand. With lanes = 16 output features
 * and the other operand a pair (x[m, 2p], x[m, 2p + 1]) broadcast to every lane, no sum across lanes is ever
 * needed (the GEMV's 16 horizontal reductions per output block go) and each weight vector serves GEMM_MR rows from a
 * register. The weights must then sit pair-interleaved, VNNI order: per 16 features, k-pair p of all 16 in one
 * vector. Each thread repacks its 64 output features GEMM_KC columns at a time (a 16 x 16 transpose of 32-bit
 * pairs, GEMM_KC / 2 x 64 pairs = 64 KB: L2) and multiplies every row of the chunk by that slab before taking the
 * next, so the repack is paid once per GEMM_MB rows. Between slabs the fp32 sums of each row block wait in `acc`
 * (exactly: a store and a load), so the sums run over k in order, as one pass would. Scratch lives on the stack.
 *
 * Micro-kernel: GEMM_MR (6) rows x 64 features, 24 accumulators and 4 weight vectors in registers; per k-pair 4
 * weight loads and 6 broadcasts feed 24 VDPBF16PS. Threads split the 64-feature blocks (static). Rounding: fp32
 * sums of the exact bf16 products, + bias in fp32, to bf16 nearest even as torch rounds (NaN kept NaN), as
 * linear_bf16_avx512. Needs K even (the broadcast reads x in pairs); other shapes keep the GEMV.
 */
#define GEMM_MR 6    /* rows of x per micro-kernel */
#ifndef GEMM_KC
#define GEMM_KC 512  /* columns of W per packed slab (64 features x 512 bf16 = 64 KB: L2; 256 measured ~3% slower) */
#endif
#ifndef GEMM_MB
#define GEMM_MB 512  /* rows per pass over a packed slab (their fp32 sums, [512, 64], 128 KB of the thread's stack,
                        between slabs; 128 rows, 32 KB, repacked each slab 4x as often: 16 x 128-token prompts'
                        GEMMs 1.03-1.05x slower on a Zen 5) */
#endif
#ifndef GEMM_PREFETCH
#define GEMM_PREFETCH 1 /* (0: no software prefetch of the next slab, to measure what it brings) */
#endif
/* The crossover from the GEMV (benchmarks/bench_gemm_noamx.py, 386M model shapes, 2 threads, a quiet Zen 4): the
 * GEMV, which reads each weight once for all the rows, leads up to 32 rows (1.3-2.1x at 16, 1.3-1.6x at 32, the MLP's
 * down with K = 4864 most), the two tie at 48 and the GEMM leads from 64 (0.96-1.23x) and 128 (1.1-1.3x), at every K
 * measured. So: the GEMM from GEMM_NOAMX_MIN_ROWS rows. (A first measurement under a load of 14-17 had put the
 * crossover at 16 rows, 64 for long K.) */
#ifndef GEMM_NOAMX_MIN_ROWS
#define GEMM_NOAMX_MIN_ROWS 64
#endif
/* Without AMX, bf16 linears of at least this many rows take this GEMM, fewer the GEMV (linear_bf16.c): set once at
 * load (kernels/cpu.py; INFERTUNE_NOAMX_GEMM=0 sets a huge value: the GEMV at every size, the behaviour before) */
static int64_t gemm_rows_noamx = GEMM_NOAMX_MIN_ROWS;

static inline int gemm_noamx_takes(int64_t M, int64_t K) {
    return K % 2 == 0 && M >= gemm_rows_noamx;
}

/* 16 fp32 -> bf16 as f2bf rounds, NaN included (round_bf16x16 is for finite values) */
static inline __m256i round_bf16x16_nan(__m512 v) {
    const __m256i r = round_bf16x16(v);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m256i q = _mm256_or_si256(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)),
                                      _mm256_set1_epi16(0x40));
    return _mm256_mask_blend_epi16(nan, r, q);
}

/* Pairs of W rows n0 .. n0 + 63 (rows past nrows zero), columns k0 .. k0 + kc - 1 (kc even; columns past kc in the
 * last group of 32 zero): wp[p][v][l] = the pair (w[n0 + 16 v + l][k0 + 2 p], ... + 1), as 32-bit words */
static void gemm_pack_slab(const bf16* w, int64_t K, int64_t n0, int nrows, int64_t k0, int64_t kc, uint32_t* wp) {
    for (int64_t c = 0; c < kc; c += 32) { /* 16 pairs a pass */
        const int64_t left = kc - c;
        const __mmask32 mk = mask32(left);
        const int np = (int)(left >= 32 ? 16 : left / 2);
        for (int v = 0; v < 4; v++) {
            float rows[256];
            for (int l = 0; l < 16; l++) {
                const int r = 16 * v + l;
                const __m512i row = r < nrows ? _mm512_maskz_loadu_epi16(mk, w + (n0 + r) * K + k0 + c)
                                              : _mm512_setzero_si512();
                _mm512_storeu_si512(rows + 16 * l, row);
            }
            __m512 t[16];
            transpose16x16_ps(rows, t); /* t[p] lane l = pair p of row l (32-bit words moved as floats, bit for bit) */
            for (int p = 0; p < np; p++) _mm512_store_si512(wp + ((c / 2 + p) * 4 + v) * 16, _mm512_castps_si512(t[p]));
        }
    }
}

/* acc rows [MRC, 64] (+)= x rows [MRC, kc] . the packed slab; first: start from zero, else from acc */
/* The next slab's weight rows are asked into L2 while this one's rows multiply: pf_lines cache lines of the
 * [64 rows, pf_row_bytes] slab at pf (rows pf_ld bytes apart) from line pf_first, spread over its k-pairs. (The rows of a slab
 * are 64 short runs that the hardware prefetchers do not follow in time; without this a slab's repack waits on
 * memory at every slab.) */
typedef struct {
    const char* base;
    int64_t ld, row_lines, first, count;
} gemm_pf;

IT_PREFETCH_FN void gemm_prefetch_line(const gemm_pf* pf, int64_t j) {
    if (j < pf->count) {
        const int64_t line = pf->first + j;
        _mm_prefetch(pf->base + (line / pf->row_lines) * pf->ld + (line % pf->row_lines) * 64, _MM_HINT_T1);
    }
}

static inline __attribute__((always_inline)) void gemm_micro(const bf16* x, int64_t ldx, const int MRC,
                                                             const uint32_t* wp, int64_t np, float* acc, int first,
                                                             const gemm_pf* pf) {
    __m512 c[GEMM_MR][4];
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++) c[i][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + i * 64 + 16 * v);
    const int64_t lpp = pf->base && np > 0 ? (pf->count + np - 1) / np : 0; /* lines per k-pair */
    for (int64_t p = 0; p < np; p++) {
        for (int64_t j = p * lpp; j < (p + 1) * lpp; j++) gemm_prefetch_line(pf, j);
        const uint32_t* q = wp + p * 64;
        const __m512bh w0 = (__m512bh)_mm512_load_si512(q), w1 = (__m512bh)_mm512_load_si512(q + 16);
        const __m512bh w2 = (__m512bh)_mm512_load_si512(q + 32), w3 = (__m512bh)_mm512_load_si512(q + 48);
        for (int i = 0; i < MRC; i++) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + 2 * p, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            c[i][0] = _mm512_dpbf16_ps(c[i][0], w0, xb);
            c[i][1] = _mm512_dpbf16_ps(c[i][1], w1, xb);
            c[i][2] = _mm512_dpbf16_ps(c[i][2], w2, xb);
            c[i][3] = _mm512_dpbf16_ps(c[i][3], w3, xb);
        }
    }
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(acc + i * 64 + 16 * v, c[i][v]);
}

#define GEMM_MICRO(R) static void gemm_micro_##R(const bf16* x, int64_t ldx, const uint32_t* wp, int64_t np, \
    float* acc, int first, const gemm_pf* pf) { gemm_micro(x, ldx, R, wp, np, acc, first, pf); }
GEMM_MICRO(1) GEMM_MICRO(2) GEMM_MICRO(3) GEMM_MICRO(4) GEMM_MICRO(5) GEMM_MICRO(6)
#undef GEMM_MICRO
typedef void (*gemm_micro_fn)(const bf16*, int64_t, const uint32_t*, int64_t, float*, int, const gemm_pf*);
static const gemm_micro_fn gemm_micro_by_rows[GEMM_MR + 1] = {0, gemm_micro_1, gemm_micro_2, gemm_micro_3,
                                                              gemm_micro_4, gemm_micro_5, gemm_micro_6};

/* The sums of rows [mr, 64] (+ bias), rounded, into y's columns n0 .. n0 + nrows - 1 */
static inline void gemm_store(const float* acc, int mr, const bf16* bias, int64_t n0, int nrows, bf16* y,
                              int64_t ldy) {
    for (int v = 0; v < 4 && 16 * v < nrows; v++) {
        const __mmask16 mk = mask16(nrows - 16 * v);
        const __m512 bv = bias ? load_bf16x16(bias + n0 + 16 * v, mk) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            _mm256_mask_storeu_epi16(y + i * ldy + n0 + 16 * v, mk,
                                     round_bf16x16_nan(_mm512_add_ps(_mm512_load_ps(acc + i * 64 + 16 * v), bv)));
    }
}

/* Where a GEMM's weight slabs come from: bf16 rows (w, row stride K), or a quantized layer whose pack rebuilds each
 * slab's rows in bf16 first (gemv_quant.c's q_pack_slab). bytes_per_2col: a row's bytes per two columns (4 for bf16,
 * 2 int8, 1 int4), for the prefetch of the next slab's rows from base (NULL: none, where the slabs do not come from
 * rows, gemm_w4p.c). */
typedef struct {
    const char* base;
    int64_t bytes_per_2col;
    void (*pack)(const void* ctx, int64_t K, int64_t n0, int nrows, int64_t k0, int64_t kc, uint32_t* wp, bf16* tmp);
    const void* ctx;
} gemm_src;

static inline __attribute__((always_inline)) void dpbf16_gemm(const bf16* x, int64_t ldx, const gemm_src* src,
                                                              const bf16* bias, bf16* y, int64_t ldy, int64_t M,
                                                              int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + 63) / 64;
    const int nt = pick_threads(nblocks, N * K / 2 * src->bytes_per_2col, nthreads);
#pragma omp parallel num_threads(nt)
    {
        uint32_t wp[GEMM_KC / 2 * 64] __attribute__((aligned(64)));
        float acc[GEMM_MB * 64] __attribute__((aligned(64)));
        bf16 tmp[src->pack ? 64 * GEMM_KC : 1] __attribute__((aligned(64))); /* a quantized slab's rows in bf16 */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * 64;
            const int nrows = (int)(N - n0 < 64 ? N - n0 : 64);
            for (int64_t m0 = 0; m0 < M; m0 += GEMM_MB) {
                const int64_t rows = M - m0 < GEMM_MB ? M - m0 : GEMM_MB;
                for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
                    const int64_t kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
                    if (src->pack)
                        src->pack(src->ctx, K, n0, nrows, k0, kc, wp, tmp);
                    else
                        gemm_pack_slab((const bf16*)src->base, K, n0, nrows, k0, kc, wp);
                    /* the slab packed next: this block's next columns, else the next block's first (a thread's
                       blocks are consecutive under the static schedule) */
                    gemm_pf pf = {0};
                    const int last = k0 + kc >= K;
                    const int64_t nk0 = last ? 0 : k0 + kc, nn0 = last && m0 + GEMM_MB >= M ? n0 + 64 : n0;
                    if (nn0 < N && GEMM_PREFETCH && src->base) {
                        const int64_t nkc = K - nk0 < GEMM_KC ? K - nk0 : GEMM_KC;
                        const int64_t nr = N - nn0 < 64 ? N - nn0 : 64;
                        pf.ld = K / 2 * src->bytes_per_2col;
                        pf.base = src->base + nn0 * pf.ld + nk0 / 2 * src->bytes_per_2col;
                        pf.row_lines = (nkc / 2 * src->bytes_per_2col + 63) / 64;
                        pf.count = nr * pf.row_lines;
                    }
                    const int64_t micros = (rows + GEMM_MR - 1) / GEMM_MR, share = (pf.count + micros - 1) / micros;
                    for (int64_t i0 = 0; i0 < rows; i0 += GEMM_MR) {
                        const int mr = (int)(rows - i0 < GEMM_MR ? rows - i0 : GEMM_MR);
                        float* a = acc + i0 * 64;
                        gemm_pf part = pf;
                        part.first = (i0 / GEMM_MR) * share;
                        part.count = pf.count - part.first < share ? pf.count - part.first : share;
                        gemm_micro_by_rows[mr](x + (m0 + i0) * ldx + k0, ldx, wp, kc / 2, a, k0 == 0, &part);
                        if (k0 + kc >= K) gemm_store(a, mr, bias, n0, nrows, y + (m0 + i0) * ldy, ldy);
                    }
                }
            }
        }
    }
}

static void linear_bf16_dpbf16_gemm(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y,
                                    int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const gemm_src src = {(const char*)w, 4, NULL, NULL};
    dpbf16_gemm(x, ldx, &src, bias, y, ldy, M, N, K, nthreads);
}
