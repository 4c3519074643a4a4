/* ------------------------------------------------------------------ GEMVs on AVX2 + FMA
 *
 * The AVX-512 library's three small-batch linears with the same entry points and the same contracts, for x86
 * CPUs without AVX-512 (Haswell to Alder Lake client parts, Zen 1-3). Each streams its weights once per MR2 rows
 * of x, NR2 weight rows at a time, prefetching ahead, threads splitting the output features:
 *   bf16   w and x widened to fp32 by an unpack against zero (the high half of an fp32 is a bf16), FMA into fp32
 *          accumulators: the products are exact, the sums fp32, one rounding to bf16 at the end
 *   W8A16  x rounded per row to int16 (act_i16.h, as the AVX-512 kernels), w sign-extended to int16, VPMADDWD into
 *          int32 lanes, flushed to an exact int64 every 1024 columns (no lane can overflow): the exact integer
 *          sum, rounded once, times the scales
 *   W4A16  the same int16 x, the nibbles widened to int16 (pack_w4's layout), VPMADDWD per group into int32 lanes
 *          (exact: a lane sums gs / 8 products of at most 15 x 32767, < 2^31 for gs <= 1024), each lane times the
 *          group's scale into an fp32 lane (a convert and an FMA), the 8 lanes summed once at the end (it summed
 *          each group exactly across the lanes first: the lanes are 1.09-1.11x at one row, 1.17-1.22x at two and
 *          ~1.25x at 4-16 on the Zen 5, a step's linears of the 386M model); the zero term from the exact sums of x
 */

/* ---- bf16 */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized" /* (rows past nr are never loaded nor used) */
static inline __attribute__((always_inline)) void bf16_block2(
    const bf16* x, int64_t ldx, int mr, const bf16* w, int nr, int64_t K, float out[MR2][NR2]) {
    __m256 acc[MR2][NR2];
    for (int i = 0; i < MR2; i++)
        for (int j = 0; j < NR2; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i z = _mm256_setzero_si256();
    const int64_t k16 = K & ~(int64_t)15;
    const int64_t far = pf_far_offset(NR2 * K * 2);
    for (int64_t k = 0; k < k16; k += 16) {
        __m256i wv[NR2];
        for (int j = 0; j < NR2; j++)
            if (j < nr) {
                pf_weights(w + j * K + k, far, PF2_BYTES);
                wv[j] = _mm256_loadu_si256((const __m256i*)(w + j * K + k));
            }
        for (int i = 0; i < MR2; i++) {
            if (i < mr) {
                /* unpacking w and x alike pairs the same columns: lanes 0-3 and 8-11 from lo, 4-7 and 12-15 from hi */
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + i * ldx + k));
                const __m256 xl = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, xv));
                const __m256 xh = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, xv));
                for (int j = 0; j < NR2; j++)
                    if (j < nr) {
                        acc[i][j] = _mm256_fmadd_ps(xl, _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, wv[j])), acc[i][j]);
                        acc[i][j] = _mm256_fmadd_ps(xh, _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, wv[j])), acc[i][j]);
                    }
            }
        }
    }
    for (int i = 0; i < MR2; i++)
        for (int j = 0; j < NR2; j++)
            if (i < mr && j < nr) {
                float t = hsum8(acc[i][j]);
                for (int64_t k = k16; k < K; k++) t += bf2f(x[i * ldx + k]) * bf2f(w[j * K + k]);
                out[i][j] = t;
            }
}
#pragma GCC diagnostic pop

#define BF16_CASE2(MRC, NRC) bf16_block2(x + m0 * ldx, ldx, MRC, wb, NRC, K, out)

/* (it_linear_bf16, gemm.c, takes this GEMV below gemm_rows_fma rows) */
static void linear_bf16_gemv2(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                              int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + NR2 - 1) / NR2;
    const int nt = pick_threads(nblocks, N * K * 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR2;
        const int nr = (int)(N - n0 < NR2 ? N - n0 : NR2);
        const bf16* wb = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {
            const int mr = (int)(M - m0 < MR2 ? M - m0 : MR2);
            float out[MR2][NR2];
            DISPATCH_BLOCK2(BF16_CASE2)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++)
                    y[(m0 + i) * ldy + n0 + j] = f2bf(out[i][j] + (bias ? bf2f(bias[n0 + j]) : 0.0f));
        }
    }
}

/* ---- bf16, a few rows: x widened once, so the inner loop unpacks only the weights
 *
 * The GEMV above unpacks a 16-column group of x for every block of weight rows it meets and a group of W for every
 * pass of rows: 12 shuffles per 16 FMA, which on the shuffle ports costs more than the FMAs themselves (it ran at
 * ~60% of the FMA peak at 16 rows). Here x is widened to fp32 once per call, in the order the unpacks of W give
 * (per 16 columns: 0-3, 8-11, then 4-7, 12-15), into a buffer the calling thread keeps (grown, never shrunk: no
 * allocation once a step's largest x has been seen); the FMAs read it straight from memory (L1: MRX rows of a few
 * KB). Per 16 columns: 2 weight loads, 4 unpacks, 16 FMA for MRX (4) rows x NRX (2) weight rows, 8 accumulators.
 * Sums: per lane in k order (the lo half of a 16-column group, then its hi half), the 8 lanes added at the end, +
 * the columns past the last 16 in order: the very order of the GEMV above, so the two give the same bits. */
#define MRX 4 /* rows of x per pass over a block */
#define NRX 2 /* weight rows per block */

/* A buffer a thread keeps for its calls: grown to at least bytes (64-byte aligned, contents not kept), never shrunk,
 * so no allocation once a step's largest need has been seen; NULL if it cannot grow */
static void* thread_buffer(void** buf, int64_t* cap, int64_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *cap = (bytes + 63) & ~(int64_t)63;
        *buf = aligned_alloc(64, (size_t)*cap);
        if (!*buf) *cap = 0;
    }
    return *buf;
}

static __thread void* xf_buf; /* this thread's widened x (see above), xf_cap bytes */
static __thread int64_t xf_cap;

static float* widened_x(const bf16* x, int64_t ldx, int64_t M, int64_t K16) {
    float* xf = thread_buffer(&xf_buf, &xf_cap, M * K16 * 4);
    if (!xf) return NULL;
    const __m256i z = _mm256_setzero_si256();
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K16; k += 16) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(x + m * ldx + k));
            _mm256_store_ps(xf + m * K16 + k, _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v)));
            _mm256_store_ps(xf + m * K16 + k + 8, _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v)));
        }
    return xf;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized" /* (rows past mr / nr are never loaded nor used) */
static inline __attribute__((always_inline)) void bf16_blockx(const float* xf, int64_t K16, const bf16* x,
                                                              int64_t ldx, int mr, const bf16* w, int nr, int64_t K,
                                                              float out[MRX][NRX]) {
    __m256 acc[MRX][NRX];
    for (int i = 0; i < MRX; i++)
        for (int j = 0; j < NRX; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i z = _mm256_setzero_si256();
    const int64_t far = pf_far_offset(NRX * K * 2);
    for (int64_t k = 0; k < K16; k += 16) {
        __m256 wl[NRX], wh[NRX];
        for (int j = 0; j < NRX; j++)
            if (j < nr) {
                pf_weights(w + j * K + k, far, PF2_BYTES);
                const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + j * K + k));
                wl[j] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, wv));
                wh[j] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, wv));
            }
        for (int i = 0; i < MRX; i++)
            if (i < mr)
                for (int j = 0; j < NRX; j++)
                    if (j < nr) {
                        acc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(xf + i * K16 + k), wl[j], acc[i][j]);
                        acc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(xf + i * K16 + k + 8), wh[j], acc[i][j]);
                    }
    }
    for (int i = 0; i < MRX; i++)
        for (int j = 0; j < NRX; j++)
            if (i < mr && j < nr) {
                float t = hsum8(acc[i][j]);
                for (int64_t k = K16; k < K; k++) t += bf2f(x[i * ldx + k]) * bf2f(w[j * K + k]);
                out[i][j] = t;
            }
}
#pragma GCC diagnostic pop

#define BF16X_CASE(MRC, NRC) bf16_blockx(xf + m0 * K16, K16, x + m0 * ldx, ldx, MRC, wb, NRC, K, out)

/* Returns 0, or -1 where the widened x could not be allocated (nothing written; the caller takes the GEMV above) */
static int linear_bf16_gemvx(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                             int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t K16 = K & ~(int64_t)15;
    const float* xf = widened_x(x, ldx, M, K16);
    if (!xf && M * K16 > 0) return -1;
    const int64_t nblocks = (N + NRX - 1) / NRX;
    const int nt = pick_threads(nblocks, N * K * 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NRX;
        const int nr = (int)(N - n0 < NRX ? N - n0 : NRX);
        const bf16* wb = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MRX) {
            const int mr = (int)(M - m0 < MRX ? M - m0 : MRX);
            float out[MRX][NRX];
            if (nr == NRX) {
                if (mr == MRX) BF16X_CASE(MRX, NRX);
                else BF16X_CASE(mr, NRX);
            } else {
                BF16X_CASE(mr, nr);
            }
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++)
                    y[(m0 + i) * ldy + n0 + j] = f2bf(out[i][j] + (bias ? bf2f(bias[n0 + j]) : 0.0f));
        }
    }
    return 0;
}

/* ---- int8 weights, int16 activations */
#define W8_FLUSH 1024 /* columns between flushes of the int32 lanes: 64 VPMADDWD of <= 2 * 128 * 32512 each */

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void w8_block2(
    const int16_t* xq, int64_t Kp, int mr, const int8_t* w, int nr, int64_t K, float out[MR2][NR2]) {
    int64_t tot[MR2][NR2];
    __m256i acc[MR2][NR2];
    for (int i = 0; i < MR2; i++)
        for (int j = 0; j < NR2; j++) tot[i][j] = 0, acc[i][j] = _mm256_setzero_si256();
    const int64_t k16 = K & ~(int64_t)15;
    const int64_t far = pf_far_offset(NR2 * K);
    for (int64_t k0 = 0; k0 < k16; k0 += W8_FLUSH) {
        const int64_t k1 = k0 + W8_FLUSH < k16 ? k0 + W8_FLUSH : k16;
        for (int64_t k = k0; k < k1; k += 16) {
            __m256i wv[NR2];
            for (int j = 0; j < NR2; j++)
                if (j < nr) {
                    pf_weights(w + j * K + k, far, PF2_BYTES / 2);
                    wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + j * K + k)));
                }
            for (int i = 0; i < MR2; i++)
                if (i < mr) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + i * Kp + k));
                    for (int j = 0; j < NR2; j++)
                        if (j < nr) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(xv, wv[j]));
                }
        }
        for (int i = 0; i < MR2; i++)
            for (int j = 0; j < NR2; j++)
                if (i < mr && j < nr) tot[i][j] += hsum8_epi32(acc[i][j]), acc[i][j] = _mm256_setzero_si256();
    }
    for (int i = 0; i < MR2; i++)
        for (int j = 0; j < NR2; j++)
            if (i < mr && j < nr) {
                for (int64_t k = k16; k < K; k++) tot[i][j] += (int64_t)xq[i * Kp + k] * w[j * K + k];
                out[i][j] = (float)tot[i][j]; /* the exact integer sum, rounded once */
            }
}
#pragma GCC diagnostic pop

#define W8_CASE2(MRC, NRC) w8_block2(xq + m0 * Kp, Kp, MRC, wb, NRC, K, out)

/* int16 activations [M, Kp], their scales [M], the group sums of x [M, K / 64 at most] */
static inline int64_t q_scratch_bytes(int64_t M, int64_t K) {
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    return (M * Kp * 2 + M * 4 + M * (K / 64 + 1) * 4 + 255) & ~(int64_t)63;
}

/* scratch: q_scratch_bytes(M, K), 64-byte aligned */
static void linear_w8(const bf16* x, int64_t ldx, const int8_t* w, const void* scale, int scale_is_f32,
                      const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch) {
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    quantize_rows_i16(x, ldx, M, K, Kp, xq, sx, NULL, 1);
    const int64_t nblocks = (N + NR2 - 1) / NR2;
    const int nt = pick_threads(nblocks, N * K, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR2;
        const int nr = (int)(N - n0 < NR2 ? N - n0 : NR2);
        const int8_t* wb = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {
            const int mr = (int)(M - m0 < MR2 ? M - m0 : MR2);
            float out[MR2][NR2];
            DISPATCH_BLOCK2(W8_CASE2)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    const int64_t n = n0 + j;
                    const float s = scale_is_f32 ? ((const float*)scale)[n] : bf2f(((const bf16*)scale)[n]);
                    y[(m0 + i) * ldy + n] = f2bf(out[i][j] * sx[m0 + i] * s + (bias ? bf2f(bias[n]) : 0.0f));
                }
        }
    }
}

void it_linear_w8(const bf16* x, int64_t ldx, const int8_t* w, const void* scale, int scale_is_f32,
                  const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    void* scratch = aligned_alloc(64, (size_t)q_scratch_bytes(M, K));
    linear_w8(x, ldx, w, scale, scale_is_f32, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}

/* ---- int4 weights, int16 activations (pack_w4: per 64 columns from k0, byte b holds column k0 + b in its low
 * nibble and k0 + 32 + b in its high one; K % gs == 0, gs % 64 == 0, checked by the caller) */
/* At many rows: the block's nibbles widened once
 *
 * w4_block2 widened a block's nibbles to int16 on every pass of MR2 rows: at 16 rows that is 8 times per block, 6
 * shuffles and ALU ops per 64 columns of a weight row each time, against 8 VPMADDWD + add pairs a row pair's pass
 * does with them; the integer kernels run ALU-bound there, not memory-bound (the 386M model's 16-row W4A16 decode
 * streams ~2 GB/s). From W4_WIDE_MIN_ROWS rows a block's NR2 rows are widened once into an int16 buffer the thread
 * keeps (pack_w4's runs of 64 come out in plain column order: the low nibbles of bytes 0-15 and 16-31 are columns
 * 0-31, their high ones 32-63), and each pass reads them from L1 / L2: per 16 columns 2 loads of x, 4 of W and 8
 * VPMADDWD + add pairs for 8 (row, weight row) pairs (w4_block2 with wide = 1). Each int32 lane sums the same columns
 * in the same group as from the nibbles (exact integers), and the group's convert and FMA and the final lane sum are the same: the same bits.
 * Measured on an Intel Xeon (model 167, forced to this library), a step's W4A16 linears of the 386M model: 0.95-0.97x
 * the time at 16 rows, 0.93-0.95x at 20-24, 0.99x at 12, level at 8, 1.09-1.12x slower at 3-4 (the buffer's
 * stores and reloads outweigh what 1-2 passes save). There VPMADDWD's issue rate bounds both kernels (a C loop
 * retires ~0.8 a cycle); a CPU with more multiply pipes (Zen 4 / 5) spends a larger share on the widening: not
 * measured. */
#ifndef W4_WIDE_MIN_ROWS
#define W4_WIDE_MIN_ROWS 12
#endif

static __thread void* w4w_buf; /* this thread's widened block: NR2 rows of K int16, w4w_cap bytes */
static __thread int64_t w4w_cap;

/* rows [0, nr) of a block (K / 2 bytes each) -> int16 [nr, K], NULL if the buffer cannot grow */
static int16_t* widened_w4(const uint8_t* w, int nr, int64_t K) {
    int16_t* ww = thread_buffer(&w4w_buf, &w4w_cap, NR2 * K * 2);
    if (!ww) return NULL;
    const __m256i lo4 = _mm256_set1_epi16(0x0f);
    const int64_t far = pf_far_offset(NR2 * (K / 2));
    for (int j = 0; j < nr; j++)
        for (int64_t k = 0; k < K; k += 64) {
            const uint8_t* p = w + j * (K / 2) + k / 2;
            pf_weights(p, far, PF2_BYTES);
            const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
            const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
            int16_t* o = ww + j * K + k;
            _mm256_store_si256((__m256i*)o, _mm256_and_si256(b0, lo4));
            _mm256_store_si256((__m256i*)(o + 16), _mm256_and_si256(b1, lo4));
            _mm256_store_si256((__m256i*)(o + 32), _mm256_srli_epi16(b0, 4));
            _mm256_store_si256((__m256i*)(o + 48), _mm256_srli_epi16(b1, 4));
        }
    return ww;
}

/* A block of NR2 weight rows against MR2 rows of x: each group's exact int32 lanes times its scale into fp32 lanes,
 * summed lane by lane over the groups, then across the lanes; the zero term from the exact sums of x. The weights come
 * as pack_w4's nibbles w, widened for each pass (wide = 0), or as the block widened once, ww (int16 [nr, K], wide = 1:
 * see above); wide is a constant at each call, so each inlined copy keeps one of the two loops. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void w4_block2(
    const int16_t* xq, int64_t Kp, const float* xsum, int mr, const uint8_t* w, const int16_t* ww, int wide, int nr,
    int64_t K, int64_t gs, const float* scale, const float* zero, float out[MR2][NR2], float zout[MR2][NR2]) {
    const int64_t G = K / gs;
    __m256 lanes[MR2][NR2]; /* each group's int32 lanes times its scale, summed over the groups lane by lane */
    for (int i = 0; i < MR2; i++)
        for (int j = 0; j < NR2; j++) lanes[i][j] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi16(0x0f);
    const int64_t far = pf_far_offset(NR2 * (K / 2));
    for (int64_t g = 0; g < G; g++) {
        __m256i acc[MR2][NR2];
        for (int i = 0; i < MR2; i++)
            for (int j = 0; j < NR2; j++) acc[i][j] = _mm256_setzero_si256();
        if (wide) {
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
                __m256i xv[MR2];
                for (int i = 0; i < MR2; i++)
                    if (i < mr) xv[i] = _mm256_loadu_si256((const __m256i*)(xq + i * Kp + k));
                for (int j = 0; j < NR2; j++)
                    if (j < nr) {
                        const __m256i wv = _mm256_load_si256((const __m256i*)(ww + j * K + k));
                        for (int i = 0; i < MR2; i++)
                            if (i < mr) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(xv[i], wv));
                    }
            }
        } else {
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 64) {
                for (int j = 0; j < NR2; j++) {
                    if (j < nr) {
                        const uint8_t* p = w + j * (K / 2) + k / 2;
                        pf_weights(p, far, PF2_BYTES);
                        const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
                        const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
                        const __m256i w0 = _mm256_and_si256(b0, lo4), w1 = _mm256_and_si256(b1, lo4); /* k .. k + 31 */
                        const __m256i w2 = _mm256_srli_epi16(b0, 4), w3 = _mm256_srli_epi16(b1, 4);    /* k + 32 .. */
                        for (int i = 0; i < MR2; i++) {
                            if (i < mr) {
                                const int16_t* xr = xq + i * Kp + k;
                                __m256i s = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)xr));
                                s = _mm256_add_epi32(s, _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(xr + 16))));
                                s = _mm256_add_epi32(s, _mm256_madd_epi16(w2, _mm256_loadu_si256((const __m256i*)(xr + 32))));
                                s = _mm256_add_epi32(s, _mm256_madd_epi16(w3, _mm256_loadu_si256((const __m256i*)(xr + 48))));
                                acc[i][j] = _mm256_add_epi32(acc[i][j], s);
                            }
                        }
                    }
                }
            }
        }
        for (int i = 0; i < MR2; i++)
            for (int j = 0; j < NR2; j++)
                if (i < mr && j < nr)
                    lanes[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]), _mm256_set1_ps(scale[j * G + g]), lanes[i][j]);
    }
    for (int i = 0; i < MR2; i++)
        for (int j = 0; j < NR2; j++)
            if (i < mr && j < nr) {
                float z = 0.0f; /* sum_g zero_g * (sum of x over g), with the exact sums of x */
                for (int64_t g = 0; g < G; g++) z += zero[j * G + g] * xsum[i * G + g];
                out[i][j] = hsum8(lanes[i][j]);
                zout[i][j] = z;
            }
}
#pragma GCC diagnostic pop

#define W4_CASE2(MRC, NRC) w4_block2(xq + m0 * Kp, Kp, xsum + m0 * G, MRC, wb, ww, 0, NRC, K, gs, scale + n0 * G, \
                                     zero + n0 * G, out, zout)
#define W4W_CASE2(MRC, NRC) w4_block2(xq + m0 * Kp, Kp, xsum + m0 * G, MRC, wb, ww, 1, NRC, K, gs, scale + n0 * G, \
                                      zero + n0 * G, out, zout)

/* scratch: q_scratch_bytes(M, K), 64-byte aligned */
static void linear_w4(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero, int64_t gs,
                      const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch) {
    const int64_t Kp = (K + 63) & ~(int64_t)63, G = K / gs;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    float* xsum = sx + M;
    quantize_rows_i16(x, ldx, M, K, Kp, xq, sx, xsum, gs);
    const int64_t nblocks = (N + NR2 - 1) / NR2;
    const int nt = pick_threads(nblocks, N * K / 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR2;
        const int nr = (int)(N - n0 < NR2 ? N - n0 : NR2);
        const uint8_t* wb = w + n0 * (K / 2);
        const int16_t* ww = M >= W4_WIDE_MIN_ROWS ? widened_w4(wb, nr, K) : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {
            const int mr = (int)(M - m0 < MR2 ? M - m0 : MR2);
            float out[MR2][NR2], zout[MR2][NR2];
            if (ww) {
                DISPATCH_BLOCK2(W4W_CASE2)
            } else {
                DISPATCH_BLOCK2(W4_CASE2)
            }
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    const int64_t n = n0 + j;
                    y[(m0 + i) * ldy + n] = f2bf(out[i][j] * sx[m0 + i] + zout[i][j] + (bias ? bf2f(bias[n]) : 0.0f));
                }
        }
    }
}

void it_linear_w4(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero, int64_t gs,
                  const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    void* scratch = aligned_alloc(64, (size_t)q_scratch_bytes(M, K));
    linear_w4(x, ldx, w, scale, zero, gs, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}

/* ---- dense weights for prefills: w = bf16(q * bf16(s)) for int8, bf16(q * s + z) (fp32 multiply, then add) for
 * int4, bit for bit the PyTorch references (as the AVX-512 library) */
static inline float w8_scale2(const void* scale, int scale_is_f32, int64_t n) {
    return bf2f(scale_is_f32 ? f2bf(((const float*)scale)[n]) : ((const bf16*)scale)[n]);
}

void it_dequant_w8(const int8_t* q, const void* scale, int scale_is_f32, bf16* out, int64_t N, int64_t K,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float s = w8_scale2(scale, scale_is_f32, n);
        const __m256 sv = _mm256_set1_ps(s);
        const int8_t* qr = q + n * K;
        bf16* o = out + n * K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qr + k))));
            _mm_storeu_si128((__m128i*)(o + k), round_bf16x8(_mm256_mul_ps(v, sv)));
        }
        for (; k < K; k++) o[k] = f2bf((float)qr[k] * s);
    }
}

void it_dequant_w4(const uint8_t* packed, const float* scale, const float* zero, int64_t gs, bf16* out, int64_t N,
                   int64_t K, int nthreads) {
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* p = packed + n * (K / 2);
        bf16* o = out + n * K;
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            const int64_t g = k0 / gs;
            const __m256 sv = _mm256_set1_ps(scale[n * G + g]), zv = _mm256_set1_ps(zero[n * G + g]);
            for (int64_t h = 0; h < 4; h++) { /* bytes 8 h .. 8 h + 7: columns k0 + 8 h .. (low), k0 + 32 + 8 h .. (high) */
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + k0 / 2 + 8 * h)));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                _mm_storeu_si128((__m128i*)(o + k0 + 8 * h), round_bf16x8(_mm256_add_ps(_mm256_mul_ps(lo, sv), zv)));
                _mm_storeu_si128((__m128i*)(o + k0 + 32 + 8 * h), round_bf16x8(_mm256_add_ps(_mm256_mul_ps(hi, sv), zv)));
            }
        }
    }
}
