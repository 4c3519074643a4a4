/* bf16 weights times bf16 activations on AVX-512 BF16 (VDPBF16PS): the one-row path, and any row count
 * without AMX. */
/* ------------------------------------------------------------------ bf16 x bf16 */

/* (the weight vectors of rows past nr are never loaded nor used: GCC cannot see that through the j < nr tests) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void bf16_block(
    const bf16* x, int64_t ldx, int mr, const bf16* w, int nr, int64_t K, float out[MR][NR]) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t kfull = K & ~(int64_t)31, far = pf_far_offset_bf16(NR * K * 2);
    for (int64_t k = 0; k < kfull; k += 32) {
        __m512bh wv[NR];
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                pf_weights(w + j * K + k, far, PF_BYTES);
                wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
            }
        }
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
                for (int j = 0; j < NR; j++)
                    if (j < nr) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
            }
        }
    }
    if (kfull < K) {
        __mmask32 m = (__mmask32)((1ull << (K - kfull)) - 1);
        __m512bh wv[NR];
        for (int j = 0; j < NR; j++)
            if (j < nr) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * K + kfull);
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * ldx + kfull);
                for (int j = 0; j < NR; j++)
                    if (j < nr) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++)
            if (i < mr && j < nr) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#pragma GCC diagnostic pop

/* Call CASE(rows of x, rows of W) with constant trip counts for full blocks (so the compiler keeps the
 * accumulators in registers) and with the runtime counts for the last, partial block of W. */
#define DISPATCH_BLOCK(CASE)                  \
    if (nr == NR) {                           \
        if (mr == 4) CASE(4, 4);              \
        else if (mr == 3) CASE(3, 4);         \
        else if (mr == 2) CASE(2, 4);         \
        else CASE(1, 4);                      \
    } else {                                  \
        CASE(mr, nr);                         \
    }

#define BF16_CASE(MRC, NRC) bf16_block(x + m0 * ldx, ldx, MRC, wb, NRC, K, out)

/* Every row of x times the nr weight rows at wb (features n0 ..), + bias, rounded into y: one block of the GEMV */
static inline void bf16_rows_block(const bf16* x, int64_t ldx, const bf16* wb, int nr, int64_t n0, int64_t M,
                                   int64_t K, const bf16* bias, bf16* y, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = (int)(M - m0 < MR ? M - m0 : MR);
        float out[MR][NR];
        DISPATCH_BLOCK(BF16_CASE)
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++)
                y[(m0 + i) * ldy + n0 + j] = f2bf(out[i][j] + (bias ? bf2f(bias[n0 + j]) : 0.0f));
    }
}

static void linear_bf16_avx512(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y,
                               int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + NR - 1) / NR;
    const int nt = pick_threads(nblocks, N * K * 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR;
        bf16_rows_block(x, ldx, w + n0 * K, (int)(N - n0 < NR ? N - n0 : NR), n0, M, K, bias, y, ldy);
    }
}

