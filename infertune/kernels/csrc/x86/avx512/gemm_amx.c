/* 16 * nblk output features from n0 for mr (<= 16) rows: the weight rows from w0 (row stride K) */
__attribute__((target("amx-tile,amx-bf16")))
static void amx_rows(const bf16* w0, const bf16* xt, const bf16* bias, bf16* y,
                     int64_t ldy, int mr, int64_t n0, int nblk, int64_t K, int pf) {
    /* tiles 0-3: C, 4-5: A (alternating), 6: B */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const int64_t ld = K * 2, ts = 16 * K; /* A row stride (bytes), tile stride */
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(6, xt + k * 16, 64);
        if (pf) /* (weights from memory; not rows just rebuilt in a thread's buffer) */
            for (int r = 0; r < 16 * nblk; r++) _mm_prefetch((const char*)(w0 + r * K + k) + PF_BYTES, _MM_HINT_T0);
        const bf16* a = w0 + k;
        _tile_loadd(4, a, ld);
        _tile_dpbf16ps(0, 4, 6);
        if (nblk > 1) { _tile_loadd(5, a + ts, ld); _tile_dpbf16ps(1, 5, 6); }
        if (nblk > 2) { _tile_loadd(4, a + 2 * ts, ld); _tile_dpbf16ps(2, 4, 6); }
        if (nblk > 3) { _tile_loadd(5, a + 3 * ts, ld); _tile_dpbf16ps(3, 5, 6); }
    }
    float c[4][16][16];
    _tile_stored(0, c[0], 64);
    if (nblk > 1) _tile_stored(1, c[1], 64);
    if (nblk > 2) _tile_stored(2, c[2], 64);
    if (nblk > 3) _tile_stored(3, c[3], 64);
    /* c[b][feature][row] -> y[row][features]: one 16-lane gather per row (a column of the tile) */
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int b = 0; b < nblk; b++) {
        const int64_t n = n0 + b * 16;
        const __m512 bv = bias ? load_bf16x16(bias + n, 0xffff) : _mm512_setzero_ps();
        for (int m = 0; m < mr; m++)
            _mm256_storeu_si256((__m256i*)(y + m * ldy + n),
                                round_bf16x16(_mm512_add_ps(_mm512_i32gather_ps(col, &c[b][0][m], 4), bv)));
    }
}

/* xt[k/2][m][k%2] = x[m][k] for the mr (<= 16) rows of x, zero for m >= mr: the B operand of the AMX tiles. One
 * gather per column pair (the 16 rows' (k, k + 1) as 32-bit words). */
static void transpose_rows_amx(const bf16* x, int64_t ldx, int mr, int64_t K, bf16* xt) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)ldx));
    const __mmask16 live = (__mmask16)((1u << mr) - 1);
    for (int64_t kp = 0; kp < K / 2; kp++) {
        const __m512i idx = _mm512_add_epi32(rows, _mm512_set1_epi32((int)(2 * kp)));
        _mm512_storeu_si512(xt + kp * 32, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, x, 2));
    }
}

/* Rows of x per pass over the weights: the transposed rows (K * 2 bytes each) of one block stay in L2 beside the
 * 64-feature weight chunk being multiplied, so each chunk is read from memory once per block of rows. */
static inline int64_t amx_rows_per_block(int64_t K) {
    int64_t mb = ((int64_t)786432 / (K * 2)) & ~(int64_t)15;
    return mb < 16 ? 16 : (mb > 256 ? 256 : mb);
}

/* scratch: amx_rows_per_block(K) * K * 2 bytes, aligned */
__attribute__((target("amx-tile,amx-bf16")))
static void linear_bf16_amx(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y,
                            int64_t ldy, int64_t M, int64_t N16, int64_t K, int nthreads, bf16* xt) {
    const int64_t nchunks = (N16 / 16 + 3) / 4; /* 64 features a chunk */
    const int64_t mb = amx_rows_per_block(K);
    for (int64_t b0 = 0; b0 < M; b0 += mb) {
        const int64_t rows = M - b0 < mb ? M - b0 : mb, passes = (rows + 15) / 16;
        for (int64_t p = 0; p < passes; p++) { /* pass p: rows b0 + 16 p .. */
            const int64_t m0 = b0 + 16 * p;
            transpose_rows_amx(x + m0 * ldx, ldx, (int)(M - m0 < 16 ? M - m0 : 16), K, xt + p * K * 16);
        }
        const int nt = pick_threads(nchunks, N16 * K * 2 * passes, nthreads);
#pragma omp parallel num_threads(nt)
        {
            amx_configure(7);
#pragma omp for schedule(static)
            for (int64_t c = 0; c < nchunks; c++) {
                const int64_t n0 = c * 64;
                const int nblk = chunk_tiles(N16, c);
                for (int64_t p = 0; p < passes; p++) { /* the chunk comes from memory once, then from cache */
                    const int64_t m0 = b0 + 16 * p;
                    const int mr = (int)(M - m0 < 16 ? M - m0 : 16);
                    amx_rows(w + n0 * K, xt + p * K * 16, bias, y + m0 * ldy, ldy, mr, n0, nblk, K, 1);
                }
            }
            _tile_release();
        }
    }
}

/* ------------------------------------------------------------------ prefill GEMM on AMX (M > 16 rows)
 *
 * The same C^T = W x^T as above, blocked 2 x 2: two weight tiles (32 output features, read in place) against two
 * activation tiles (32 rows of x, transposed into VNNI pairs once per call) feed four accumulator tiles, so each
 * tile load serves two TDPBF16PS instead of one. A block of rows of x (transposed, ~768 KB) stays in L2 while each
 * thread walks its 32-feature chunks of W; a chunk (32 K bf16) comes from memory once per block of rows and then
 * from L2 for every pair of 16-row tiles. The accumulators of one 32 x 32 block are stored, transposed in
 * registers (16 x 16 fp32, 64 shuffles) and written as bf16 rows. (Writing them between the next block's k-steps,
 * to overlap the epilogue with the tiles, measured no faster.)
 */

/* out[m] = lanes f of c[f][m]: a 16 x 16 fp32 transpose in registers (in-lane unpacks, then 128-bit shuffles) */
static inline void transpose16x16_ps(const float* c, __m512 out[16]) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(c + 16 * i);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + j]: column j (+4, +8, +12 in the next 128-bit lanes) of rows 4i..4i+3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c2 = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c2));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c2));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 vlo = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), vhi = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        const __m512 wlo = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 whi = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        out[j] = _mm512_shuffle_f32x4(vlo, wlo, 0x88);
        out[j + 8] = _mm512_shuffle_f32x4(vlo, wlo, 0xdd);
        out[j + 4] = _mm512_shuffle_f32x4(vhi, whi, 0x88);
        out[j + 12] = _mm512_shuffle_f32x4(vhi, whi, 0xdd);
    }
}

/* A 32 x 32 (or smaller) output block whose accumulators were stored in c[a][b] (feature tile a, row tile b) */
typedef struct {
    float c[2][2][256];
    int na, nb, mr[2]; /* tiles used; valid rows of each row tile */
    int64_t n0, m0;
} gemm_block;

/* Writes tile (a, b) of a stored block: transposed to rows, plus the bias, rounded to bf16 */
static void gemm_tile_store(const gemm_block* g, int a, int b, const bf16* bias, bf16* y, int64_t ldy) {
    __m512 rows[16];
    const int64_t n = g->n0 + 16 * a;
    const __m512 bv = bias ? load_bf16x16(bias + n, 0xffff) : _mm512_setzero_ps();
    transpose16x16_ps(g->c[a][b], rows);
    bf16* yb = y + (g->m0 + 16 * b) * ldy + n;
    for (int m = 0; m < g->mr[b]; m++)
        _mm256_storeu_si256((__m256i*)(yb + m * ldy), round_bf16x16(_mm512_add_ps(rows[m], bv)));
}

/* tiles 0-3: C[a][b] at 2a + b, 4-5: W (feature tiles), 6-7: x^T (row tiles); the accumulators end in g->c */
__attribute__((target("amx-tile,amx-bf16")))
static void gemm_block_compute(const bf16* w0, const bf16* xt0, int64_t K, gemm_block* g) {
    const int64_t ld = K * 2;
    const bf16* xt1 = xt0 + K * 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, w0 + k, ld);
        _tile_loadd(6, xt0 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (g->nb == 2) { _tile_loadd(7, xt1 + k * 16, 64); _tile_dpbf16ps(1, 4, 7); }
        if (g->na == 2) {
            _tile_loadd(5, w0 + 16 * K + k, ld);
            _tile_dpbf16ps(2, 5, 6);
            if (g->nb == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, g->c[0][0], 64);
    if (g->nb == 2) _tile_stored(1, g->c[0][1], 64);
    if (g->na == 2) {
        _tile_stored(2, g->c[1][0], 64);
        if (g->nb == 2) _tile_stored(3, g->c[1][1], 64);
    }
}

/* Rows of x per block of the GEMM: a multiple of 32 whose transpose fits the L2 share amx_rows_per_block allows */
static inline int64_t gemm_rows_per_block(int64_t K) {
    const int64_t mb = amx_rows_per_block(K) & ~(int64_t)31;
    return mb < 32 ? 32 : mb;
}

/* Rows of x per block where each block rebuilds the weight's chunks from quantized rows (quant_amx.c): at least 128,
 * so a long K (down_proj's 4864: 64 rows by the L2 share) rebuilds the weight half as often; a W4A16 down_proj at
 * 512-2048 rows ran 1.10-1.16x faster at 128 (96: level, 192: 1.05x, 256: 0.9x; a C harness, 2026-12-06) */
static inline int64_t gemm_rows_per_rebuild_block(int64_t K) {
    const int64_t mb = gemm_rows_per_block(K);
    return mb < 128 ? 128 : mb;
}

/* Where the GEMM's 32-feature chunks of W come from: w's rows in place (rebuild NULL), or rebuilt into a thread's
 * buffer of 32 rows (bufs: 32 x K a thread) by rebuild(ctx, n0, rows, K, out): quantized weights (quant_amx.c) */
typedef struct {
    const bf16* w;
    void (*rebuild)(const void* ctx, int64_t n0, int64_t rows, int64_t K, bf16* out);
    const void* ctx;
    bf16* bufs;
} amx_wsrc;

__attribute__((target("amx-tile,amx-bf16")))
static void amx_gemm_src(const bf16* x, int64_t ldx, const amx_wsrc* src, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N16, int64_t K, int nthreads, bf16* xt) {
    const int64_t nchunks = (N16 + 31) / 32; /* chunks of 32 features */
    const int64_t mb = src->rebuild ? gemm_rows_per_rebuild_block(K) : gemm_rows_per_block(K);
    const int nt = pick_threads(nchunks, N16 * K * 2 * ((M + 15) / 16), nthreads);
#pragma omp parallel num_threads(nt)
    {
        amx_configure(8);
        gemm_block g;
        bf16* wd = src->rebuild ? src->bufs + (int64_t)omp_get_thread_num() * 32 * K : NULL;
        for (int64_t b0 = 0; b0 < M; b0 += mb) {
            const int64_t rows = M - b0 < mb ? M - b0 : mb, tiles = (rows + 15) / 16;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < tiles; p++) {
                const int64_t m0 = b0 + 16 * p;
                transpose_rows_amx(x + m0 * ldx, ldx, (int)(M - m0 < 16 ? M - m0 : 16), K, xt + p * K * 16);
            } /* (implicit barrier: the whole block is transposed before any thread multiplies) */
#pragma omp for schedule(static) nowait
            for (int64_t c = 0; c < nchunks; c++) {
                const int64_t n0 = c * 32;
                g.na = N16 - n0 >= 32 ? 2 : 1;
                const bf16* wc = wd;
                if (wd) /* (once a block of rows: the chunk's rows rebuilt, then every row tile's pair on them) */
                    src->rebuild(src->ctx, n0, 16 * g.na, K, wd);
                else
                    wc = src->w + n0 * K;
                for (int64_t p = 0; p < tiles; p += 2) {
                    g.nb = tiles - p >= 2 ? 2 : 1;
                    g.n0 = n0;
                    g.m0 = b0 + 16 * p;
                    for (int b = 0; b < g.nb; b++) {
                        const int64_t left = M - (g.m0 + 16 * b);
                        g.mr[b] = (int)(left < 16 ? left : 16);
                    }
                    gemm_block_compute(wc, xt + p * K * 16, K, &g);
                    for (int a = 0; a < g.na; a++)
                        for (int b = 0; b < g.nb; b++) gemm_tile_store(&g, a, b, bias, y, ldy);
                }
            }
#pragma omp barrier /* xt is rewritten by the next block of rows */
        }
        _tile_release();
    }
}

static void linear_bf16_amx_gemm(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                                 int64_t M, int64_t N16, int64_t K, int nthreads, bf16* xt) {
    const amx_wsrc src = {w, NULL, NULL, NULL};
    amx_gemm_src(x, ldx, &src, bias, y, ldy, M, N16, K, nthreads, xt);
}
