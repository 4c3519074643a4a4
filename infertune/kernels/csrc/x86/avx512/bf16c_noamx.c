/* ------------------------------------------------------------------ 12-bit weights without AMX (Zen 4 / 5)
 *
 * A decoded tile row (bf16c_pairs) is one k-pair of 16 output features in VNNI order: exactly the weight operand of
 * VDPBF16PS against x's pair (x[m, 2 p], x[m, 2 p + 1]) broadcast to every lane, as the GEMM without AMX multiplies
 * (gemm_dpbf16.c). So each thread decodes its chunks' tiles one at a time into 4 KB (L1, escapes patched) and
 * multiplies up to 16 rows of x by each: per fp32 lane one output, its products summed over k in order from zero,
 * operands in gemm_micro's order, + bias in fp32, rounded once: the very sums of linear_bf16_dpbf16_gemm on the
 * bf16 weights, bit for bit, while a decode step streams 0.75x the bytes. Up to 4 rows' accumulators (16) stay in
 * registers across a tile; with more rows, every 4 rows' sums wait in c between tiles (a store and a load: exact).
 * From BF16C_NOAMX_GEMM_ROWS rows (prompts) the tiles are decoded a slab of GEMM_KC columns at a time straight into
 * the packed-slab order of gemm_dpbf16.c and multiplied by its micro-kernel (6 rows x 64 features), each slab once
 * per GEMM_MB rows: the same sums again. The epilogues are the AMX path's (bias, residual add, SiLU-and-multiply
 * of an interleaved gate_up).
 */
#ifndef BF16C_NOAMX_GEMM_ROWS
#define BF16C_NOAMX_GEMM_ROWS 16
#endif

/* acc[i][b] (+)= rows i < R of x (k-pairs of tile ks) . decoded tile dec, feature groups b < NB */
#define BF16C_NOAMX_ROWS(R, NB)                                                                          \
    do {                                                                                                  \
        __m512 acc[R][NB];                                                                                \
        for (int i = 0; i < (R); i++)                                                                     \
            for (int b = 0; b < (NB); b++) acc[i][b] = _mm512_load_ps(c[b] + 16 * (m0 + i));              \
        for (int p = 0; p < 16; p++) {                                                                    \
            __m512bh wv[NB];                                                                              \
            for (int b = 0; b < (NB); b++) wv[b] = (__m512bh)_mm512_load_si512(dec + (16 * b + p) * 32); \
            for (int i = 0; i < (R); i++) {                                                               \
                int32_t pair;                                                                             \
                memcpy(&pair, x + (m0 + i) * ldx + ks * 32 + 2 * p, 4);                                   \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                    \
                for (int b = 0; b < (NB); b++) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], wv[b], xb);       \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < (R); i++)                                                                     \
            for (int b = 0; b < (NB); b++) _mm512_store_ps(c[b] + 16 * (m0 + i), acc[i][b]);              \
    } while (0)

/* mr <= 16 rows of x times the whole 12-bit weight */
static void linear_bf16c_rows_noamx(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y,
                                    int64_t ldy, int mr, int64_t N16, int64_t K, int nthreads, int64_t inter, int epi) {
    const int64_t nchunks = (N16 + 63) / 64, KS = K / 32;
    const int nt = pick_threads(nchunks, N16 * K * 3 / 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        bf16 dec[64 * 32] __attribute__((aligned(64)));
        float c[4][256] __attribute__((aligned(64))); /* [feature group][row][16] */
#pragma omp for schedule(static)
        for (int64_t ch = 0; ch < nchunks; ch++) {
            const int64_t n0 = ch * 64;
            const int nblk = chunk_tiles(N16, ch);
            for (int b = 0; b < nblk; b++) memset(c[b], 0, (size_t)mr * 16 * sizeof(float));
            for (int64_t ks = 0; ks < KS; ks++) {
                bf16c_tile(cw, KS, ch, ks, 16 * nblk, dec, 32);
                for (int m0 = 0; m0 < mr; m0 += 4) {
                    const int r = mr - m0 < 4 ? mr - m0 : 4;
                    if (nblk == 4) {
                        if (r == 4) BF16C_NOAMX_ROWS(4, 4);
                        else if (r == 3) BF16C_NOAMX_ROWS(3, 4);
                        else if (r == 2) BF16C_NOAMX_ROWS(2, 4);
                        else BF16C_NOAMX_ROWS(1, 4);
                    } else if (nblk == 3) {
                        if (r == 4) BF16C_NOAMX_ROWS(4, 3);
                        else if (r == 3) BF16C_NOAMX_ROWS(3, 3);
                        else if (r == 2) BF16C_NOAMX_ROWS(2, 3);
                        else BF16C_NOAMX_ROWS(1, 3);
                    } else if (nblk == 2) {
                        if (r == 4) BF16C_NOAMX_ROWS(4, 2);
                        else if (r == 3) BF16C_NOAMX_ROWS(3, 2);
                        else if (r == 2) BF16C_NOAMX_ROWS(2, 2);
                        else BF16C_NOAMX_ROWS(1, 2);
                    } else {
                        if (r == 4) BF16C_NOAMX_ROWS(4, 1);
                        else if (r == 3) BF16C_NOAMX_ROWS(3, 1);
                        else if (r == 2) BF16C_NOAMX_ROWS(2, 1);
                        else BF16C_NOAMX_ROWS(1, 1);
                    }
                }
            }
            if (inter) /* (a chunk holds whole pairs: N16 / 16 is even) */
                for (int b = 0; b < nblk; b += 2) tile_pair_out(c[b], c[b + 1], n0 / 32 + b / 2, y, ldy, mr, inter, epi);
            else
                for (int b = 0; b < nblk; b++) tile_rows_out(c[b], bias, n0 + 16 * b, y, ldy, mr, epi);
        }
    }
}
#undef BF16C_NOAMX_ROWS

/* Tile t (rows 16 g + p: features 16 g.., k-pair p; g < rows / 16) decoded into wp in gemm_pack_slab's order: the
 * pair vector of (p, g) at wp + (p * 4 + g) * 16, escapes patched */
static inline void bf16c_tile_slab(const bf16c* c, int64_t t, int rows, uint32_t* wp) {
    const uint8_t* b = c->codes + t * BF16C_TILE_BYTES;
    const __m512i table = bf16c_table(c);
    for (int r = 0; r < rows; r += 2) {
        __m512i a, z;
        bf16c_row_pair(b + r * 48, r, table, &a, &z);
        _mm512_store_si512(wp + ((r % 16) * 4 + r / 16) * 16, a);
        _mm512_store_si512(wp + (((r + 1) % 16) * 4 + (r + 1) / 16) * 16, z);
    }
    for (int32_t e = c->esc_start[t]; e < c->esc_start[t + 1]; e++) {
        const int r = c->esc_pos[e] >> 5;
        ((bf16*)wp)[((r % 16) * 4 + r / 16) * 32 + (c->esc_pos[e] & 31)] = c->esc_val[e];
    }
}

/* From BF16C_NOAMX_GEMM_ROWS rows: slabs of decoded tiles through gemm_dpbf16.c's micro-kernel */
static void linear_bf16c_gemm_noamx(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y,
                                    int64_t ldy, int64_t M, int64_t N16, int64_t K, int nthreads, int64_t inter,
                                    int epi) {
    const int64_t nchunks = (N16 + 63) / 64, KS = K / 32, SL = GEMM_KC / 32; /* tiles a slab */
    const int nt = pick_threads(nchunks, N16 * K * 3 / 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        uint32_t wp[GEMM_KC / 2 * 64] __attribute__((aligned(64)));
        float acc[GEMM_MB * 64] __attribute__((aligned(64)));
        float c[4][GEMM_MR * 16] __attribute__((aligned(64)));
        const gemm_pf nopf = {0};
#pragma omp for schedule(static)
        for (int64_t ch = 0; ch < nchunks; ch++) {
            const int64_t n0 = ch * 64;
            const int nblk = chunk_tiles(N16, ch);
            if (nblk < 4) memset(wp, 0, sizeof wp); /* (the missing feature groups multiply as zeros, never stored) */
            for (int64_t m0 = 0; m0 < M; m0 += GEMM_MB) {
                const int64_t rows = M - m0 < GEMM_MB ? M - m0 : GEMM_MB;
                for (int64_t k0 = 0; k0 < KS; k0 += SL) {
                    const int64_t ns = KS - k0 < SL ? KS - k0 : SL;
                    for (int64_t j = 0; j < ns; j++) bf16c_tile_slab(cw, ch * KS + k0 + j, 16 * nblk, wp + j * 16 * 64);
                    for (int64_t i0 = 0; i0 < rows; i0 += GEMM_MR) {
                        const int mr = (int)(rows - i0 < GEMM_MR ? rows - i0 : GEMM_MR);
                        float* a = acc + i0 * 64;
                        gemm_micro_by_rows[mr](x + (m0 + i0) * ldx + k0 * 32, ldx, wp, ns * 16, a, k0 == 0, &nopf);
                        if (k0 + ns < KS) continue;
                        for (int b = 0; b < nblk; b++) /* [row][64] -> [group][row][16], for the epilogues */
                            for (int i = 0; i < mr; i++) memcpy(c[b] + 16 * i, a + 64 * i + 16 * b, 64);
                        bf16* yo = y + (m0 + i0) * ldy;
                        if (inter)
                            for (int b = 0; b < nblk; b += 2) tile_pair_out(c[b], c[b + 1], n0 / 32 + b / 2, yo, ldy, mr, inter, epi);
                        else
                            for (int b = 0; b < nblk; b++) tile_rows_out(c[b], bias, n0 + 16 * b, yo, ldy, mr, epi);
                    }
                }
            }
        }
    }
}

static void linear_bf16c_noamx(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy,
                               int64_t M, int64_t N16, int64_t K, int nthreads, int64_t inter, int epi) {
    if (M >= BF16C_NOAMX_GEMM_ROWS)
        linear_bf16c_gemm_noamx(x, ldx, cw, bias, y, ldy, M, N16, K, nthreads, inter, epi);
    else
        linear_bf16c_rows_noamx(x, ldx, cw, bias, y, ldy, (int)M, N16, K, nthreads, inter, epi);
}
