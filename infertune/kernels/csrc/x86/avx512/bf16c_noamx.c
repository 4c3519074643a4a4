/* ------------------------------------------------------------------ 12-bit weights without AMX (Zen 4 / 5)
 *
 * A decoded tile row (bf16c_row_pair) is one k-pair of 16 output features in VNNI order: exactly the weight operand
 * of VDPBF16PS against x's pair (x[m, 2 p], x[m, 2 p + 1]) broadcast to every lane, as the GEMM without AMX
 * multiplies (gemm_dpbf16.c). Per fp32 lane one output, its products summed over k in order from zero, + bias in
 * fp32, rounded once: the very sums of linear_bf16_dpbf16_gemm on the bf16 weights, bit for bit, on every path
 * below, while a decode step streams 0.75x the bytes. The epilogues are the AMX path's (bias, residual add,
 * SiLU-and-multiply of an interleaved gate_up).
 *
 * Up to bf16c_reg_max (16) rows, decode steps: the tiles are never stored decoded. Each row pair of a tile is
 * decoded into two registers (rows 16 g + p and + 1: feature group g's k-pairs p and p + 1), its escapes patched
 * there (a tile lists its escapes in row order), and multiplied at once by the rows' broadcast pairs of x, in the
 * tile's memory order: group-major (for g: for p), only group g's accumulators live (one chain a row, the other
 * groups' chains overlapping in the out-of-order window), waiting in memory between groups (a store and a load per
 * 16 VDPBF16PS a row: exact).
 * Against decoding each tile into 4 KB and reading it back (the path before), a tile's 64 stores and 64 loads go
 * and the wide rows no longer split in fours: a decode step's linears at 1 / 8 / 16 rows ran 1.11x / 1.30x / 1.44x
 * faster on a quiet Zen 4 (no change where memory bound them). 1-4 rows went k-pair-major (for p: for g: all four
 * groups' accumulators in registers) until the stream's order was found to matter more: that order visits a tile's
 * rows in four interleaved runs (768 bytes apart), which the hardware prefetchers did not follow; a streamed step's
 * linears at 1 / 2 / 4 rows ran 1.23x / 1.24x / 1.26x faster in memory order on a Zen 5 (level with the tiles in L3),
 * and a plain read of a tile's 96-byte pairs in the four runs reached ~0.7x the bandwidth of the same read in order.
 * More rows (prompts, linear_bf16c_gemm_noamx): the tiles are decoded a slab of GEMM_KC columns at a time straight
 * into the packed-slab order of gemm_dpbf16.c and multiplied by its micro-kernel (6 rows x 64 features), each
 * slab once per GEMM_MB rows. (Past 16 rows, the register path run 16 rows at a time, re-decoding, was 0.85-0.96x
 * this.)
 */
#ifndef BF16C_REG_ROWS
#define BF16C_REG_ROWS 16
#endif
/* rows up to which linear_bf16c_noamx takes the register paths (it_bf16c_reg_rows; 0: the slab GEMM at every row
 * count, for benchmarks) */
static int bf16c_reg_max = BF16C_REG_ROWS;

static inline __attribute__((always_inline)) void bf16c_patch_pair(const bf16c* cw, int32_t* e, int32_t end, int r,
                                                                   __m512i* v0, __m512i* v1) {
    for (; *e < end && (cw->esc_pos[*e] >> 5) < r + 2; (*e)++) { /* (rare: most tiles have none) */
        const int row = cw->esc_pos[*e] >> 5, lane = cw->esc_pos[*e] & 31;
        const __m512i val = _mm512_set1_epi16((short)cw->esc_val[*e]);
        if (row == r) *v0 = _mm512_mask_mov_epi16(*v0, (__mmask32)1u << lane, val);
        else *v1 = _mm512_mask_mov_epi16(*v1, (__mmask32)1u << lane, val);
    }
}

/* 1 .. 16 rows: the row pairs go feature-group-major (for g: for p: the tile's bytes in order), so only group g's R
 * accumulators (R independent chains) are live while its 8 row pairs are decoded; between groups and tiles they wait
 * in c (a store and a load per 16 R VDPBF16PS: exact). x's pairs are broadcast from memory into each VDPBF16PS. Each
 * lane still sums p = 0 .. 15 tile by tile in order: the same sums again. */
/* (rows 0 .. R - 1 of xs are stored as vectors before any is read: GCC does not follow that at R = 1) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void bf16c_reg_rows(const bf16* x, int64_t ldx, const bf16c* cw,
                                                                 const bf16* bias, bf16* y, int64_t ldy, const int R,
                                                                 int64_t ch, int nblk, int64_t KS, int64_t inter,
                                                                 int epi) {
    const __m512i table = bf16c_table(cw);
    float c[4][16 * 16] __attribute__((aligned(64))); /* [group][row][16] */
    for (int64_t ks = 0; ks < KS; ks++) {
        const int64_t t = ch * KS + ks;
        const uint8_t* b = cw->codes + t * BF16C_TILE_BYTES;
        const int32_t end = cw->esc_start[t + 1];
        int32_t e = cw->esc_start[t];
        /* the rows' 32 columns of this tile side by side on the stack, so every broadcast below reads one base
           address plus a constant: with a pointer per row, 16 pointers did not fit the registers and were reloaded
           from the stack between broadcasts (a linear's 16 rows ran 1.10-1.14x slower) */
        int32_t xs[16 * 16] __attribute__((aligned(64)));
        for (int i = 0; i < R; i++) _mm512_store_si512(xs + 16 * i, _mm512_loadu_si512(x + i * ldx + ks * 32));
        for (int g = 0; g < nblk; g++) {
            __m512 acc[16];
            for (int i = 0; i < R; i++) acc[i] = ks == 0 ? _mm512_setzero_ps() : _mm512_load_ps(c[g] + 16 * i);
            for (int p = 0; p < 16; p += 2) {
                const int r = 16 * g + p;
                __m512i v0, v1;
                bf16c_row_pair(b + r * 48, r, table, &v0, &v1);
                if (e < end) bf16c_patch_pair(cw, &e, end, r, &v0, &v1); /* (rows in order here) */
                for (int i = 0; i < R; i++) {
                    const int32_t p0 = xs[16 * i + p], p1 = xs[16 * i + p + 1];
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)v0, (__m512bh)_mm512_set1_epi32(p0));
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)v1, (__m512bh)_mm512_set1_epi32(p1));
                }
            }
            for (int i = 0; i < R; i++) _mm512_store_ps(c[g] + 16 * i, acc[i]);
        }
    }
    chunk_rows_out(c[0], sizeof c[0] / sizeof(float), nblk, ch * 64, bias, y, ldy, R, inter, epi);
}

#define BF16C_REG(R, BODY) static void bf16c_reg_rows_##R(const bf16* x, int64_t ldx, const bf16c* cw,        \
    const bf16* bias, bf16* y, int64_t ldy, int64_t ch, int nblk, int64_t KS, int64_t inter, int epi) { BODY; }
#define BF16C_ROWS(R) BF16C_REG(R, bf16c_reg_rows(x, ldx, cw, bias, y, ldy, R, ch, nblk, KS, inter, epi))
BF16C_ROWS(1) BF16C_ROWS(2) BF16C_ROWS(3) BF16C_ROWS(4) BF16C_ROWS(5) BF16C_ROWS(6) BF16C_ROWS(7) BF16C_ROWS(8)
BF16C_ROWS(9) BF16C_ROWS(10) BF16C_ROWS(11) BF16C_ROWS(12) BF16C_ROWS(13) BF16C_ROWS(14) BF16C_ROWS(15) BF16C_ROWS(16)
#pragma GCC diagnostic pop
#undef BF16C_ROWS
#undef BF16C_REG
typedef void (*bf16c_reg_fn)(const bf16*, int64_t, const bf16c*, const bf16*, bf16*, int64_t, int64_t, int, int64_t,
                             int64_t, int);
static const bf16c_reg_fn bf16c_reg_by_rows[17] = {
    0, bf16c_reg_rows_1, bf16c_reg_rows_2, bf16c_reg_rows_3, bf16c_reg_rows_4, bf16c_reg_rows_5, bf16c_reg_rows_6,
    bf16c_reg_rows_7, bf16c_reg_rows_8, bf16c_reg_rows_9, bf16c_reg_rows_10, bf16c_reg_rows_11, bf16c_reg_rows_12,
    bf16c_reg_rows_13, bf16c_reg_rows_14, bf16c_reg_rows_15, bf16c_reg_rows_16};

static void linear_bf16c_reg_noamx(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y,
                                   int64_t ldy, int mr, int64_t N16, int64_t K, int nthreads, int64_t inter, int epi) {
    const int64_t nchunks = (N16 + 63) / 64, KS = K / 32;
    const int nt = pick_threads(nchunks, N16 * K * 3 / 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++)
        bf16c_reg_by_rows[mr](x, ldx, cw, bias, y, ldy, ch, chunk_tiles(N16, ch), KS, inter, epi);
}

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

/* Past bf16c_reg_max rows: slabs of decoded tiles through gemm_dpbf16.c's micro-kernel */
static void linear_bf16c_gemm_noamx(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y,
                                    int64_t ldy, int64_t M, int64_t N16, int64_t K, int nthreads, int64_t inter,
                                    int epi, int stream) {
    const int64_t nchunks = (N16 + 63) / 64, KS = K / 32, SL = GEMM_KC / 32; /* tiles a slab */
    const int nt = pick_threads(nchunks, N16 * K * 3 / 2, nthreads);
    /* a plain product where the caller asks (stream: a MoE expert's down rows) goes past the caches, as on
       the tile GEMM (bf16c_gemm.c linear_bf16c_gemm), each row's 64 features whole. Forced to this path on an AMX
       Xeon: a MoE prefill 0.99x (6 rounds 0.91-1.01); a dense one's large act streamed too read 1.02x, so act stays
       in the caches here. Not measured on a Zen. */
    const int stream_rows = stream && !inter && rows_on_lines(y, ldy);
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
                        bf16* yr = y + (m0 + i0) * ldy;
                        if (stream_rows && nblk % 2 == 0) { /* (a row's lines whole, one after the other) */
                            for (int i = 0; i < mr; i++)
                                for (int b = 0; b < nblk; b++)
                                    tile_rows_out(a + 64 * i + 16 * b, bias, n0 + 16 * b, yr + i * ldy, ldy, 1, 2);
                            continue;
                        }
                        for (int b = 0; b < nblk; b++) /* [row][64] -> [group][row][16], for the epilogues */
                            for (int i = 0; i < mr; i++) memcpy(c[b] + 16 * i, a + 64 * i + 16 * b, 64);
                        chunk_rows_out(c[0], sizeof c[0] / sizeof(float), nblk, n0, bias, yr, ldy, mr, inter, epi);
                    }
                }
            }
        }
    }
    _mm_sfence(); /* (the non-temporal stores seen before any thread reads y) */
}

static void linear_bf16c_noamx(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy,
                               int64_t M, int64_t N16, int64_t K, int nthreads, int64_t inter, int epi, int stream) {
    if (M <= bf16c_reg_max) /* (the stream hint is the GEMM's alone) */
        linear_bf16c_reg_noamx(x, ldx, cw, bias, y, ldy, (int)M, N16, K, nthreads, inter, epi);
    else
        linear_bf16c_gemm_noamx(x, ldx, cw, bias, y, ldy, M, N16, K, nthreads, inter, epi, stream);
}
