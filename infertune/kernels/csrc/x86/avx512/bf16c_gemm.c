/* ------------------------------------------------------------------ 12-bit weights on the tiles
 *
 * C = x W^T with x as the A operand (16 rows x 32 k, read in place) and the decoded tiles of W as B operands (VNNI,
 * 16 k-pairs x 16 features); each accumulator tile is 16 rows x 16 features of y. The products are those of
 * linear_bf16's tiles (each output the same pairs summed in the same order), so the bits match.
 */

/* Activations packed for the tile GEMM (a fused prompt's normed rows and act, written so by their producers): row r,
 * column c of an [M, K] matrix (K a multiple of 32, M rounded up to 16) at px_index(r, c, K): 16-row tiles one after
 * the other, each as its K / 32 A-operand tiles of 16 rows x 32 columns (1 KB, 64-byte rows) in k order. A tile load
 * then reads 1 KB in a row instead of 16 lines a row of x apart: at 2048 rows of the 386M model the GEMMs 0.92x the
 * time (the same packing cost on both sides). The rows past M are zeros. */
static inline int64_t px_index(int64_t r, int64_t c, int64_t K) {
    return ((r / 16 * (K / 32) + c / 32) * 16 + r % 16) * 32 + c % 32;
}

/* The rows of a packed [M, K] past M, up to its last row tile's end, set to zeros */
static void px_zero_tail(bf16* xp, int64_t M, int64_t K) {
    for (int64_t r = M; r % 16; r++)
        for (int64_t c = 0; c < K; c += 32) memset(xp + px_index(r, c, K), 0, 64);
}

/* bf16(a + b) into x (m lanes), as f2bf rounds, a NaN sum quiet: the residual add */
static inline void store_sum_bf16x16(bf16* x, __m512 a, __m512 b, __mmask16 m) {
    const __m512 v = _mm512_add_ps(a, b);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m256i q = _mm256_or_si256(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)),
                                      _mm256_set1_epi16(0x40));
    _mm256_mask_storeu_epi16(x, m, _mm256_mask_blend_epi16(nan, round_bf16x16(v), q));
}

/* rows (<= 16) fp32 accumulator rows c [rows][16] + bias -> bf16 y[m][n .. n + 15]; with add = 1, that bf16 is added
 * into y instead (bf16(y + bf16(c + bias)): the residual add of add_rows, on the product as it would be stored); add =
 * 2 stores it with non-temporal stores (y's 32 bytes aligned; the tile GEMM's outputs written as whole lines) */
static inline void tile_rows_out(const float* c, const bf16* bias, int64_t n, bf16* y, int64_t ldy, int rows, int add) {
    const __m512 bv = bias ? load_bf16x16(bias + n, 0xffff) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + 16 * m), bv);
        bf16* out = y + m * ldy + n;
        if (add == 1) {
            store_sum_bf16x16(out, load_bf16x16(out, 0xffff), bf16_round_f32(v), 0xffff);
            continue;
        }
        const __m256i r = round_bf16x16(v);
        if (add == 2)
            _mm256_stream_si256((__m256i*)out, r);
        else
            _mm256_storeu_si256((__m256i*)out, r);
    }
}

/* A gate_up weight packed with its gate and up rows interleaved 16 by 16 (feature tile 2 p: gate features
 * 16 p .. 16 p + 15, tile 2 p + 1: the same up features; inter = the intermediate size): the accumulator rows of
 * pair p, cg and cu [rows][16], become either gate_up's columns (gate at 16 p, up at inter + 16 p) or, with silu,
 * act = bf16(bf16(silu(g)) * u) at column 16 p, rounded as silu_mul_rows (g and u first rounded to bf16); silu = 2
 * writes act with non-temporal stores (32-byte aligned rows written whole: the tile GEMM's large outputs). */
static inline void tile_pair_out(const float* cg, const float* cu, int64_t p, bf16* y, int64_t ldy, int rows,
                                 int64_t inter, int silu) {
    for (int m = 0; m < rows; m++) {
        const __m512 zero = _mm512_setzero_ps(); /* (+ 0, as tile_rows_out adds a missing bias: -0 becomes +0) */
        const __m512 g = bf16_round_f32(_mm512_add_ps(_mm512_loadu_ps(cg + 16 * m), zero));
        const __m512 u = bf16_round_f32(_mm512_add_ps(_mm512_loadu_ps(cu + 16 * m), zero));
        if (silu) {
            const __m256i a = round_bf16x16(_mm512_mul_ps(bf16_round_f32(silu512(g)), u));
            if (silu == 2)
                _mm256_stream_si256((__m256i*)(y + m * ldy + 16 * p), a);
            else
                _mm256_storeu_si256((__m256i*)(y + m * ldy + 16 * p), a);
        } else {
            _mm256_storeu_si256((__m256i*)(y + m * ldy + 16 * p), round_bf16x16(g));
            _mm256_storeu_si256((__m256i*)(y + m * ldy + inter + 16 * p), round_bf16x16(u));
        }
    }
}

/* A 64-feature chunk's sums out: group g's rows at c + g * gstride ([rows][16] fp32), nblk groups, as tile_pair_out
 * (an interleaved gate_up: a chunk holds whole gate / up pairs, N16 / 16 even) or tile_rows_out (+ bias). Never
 * inlined: once a chunk, it is cold beside the tile loops, and inlined into the 16-row register path
 * (bf16c_noamx.c) it cost that path 1-2% (GCC inlined it or not as the rest of the library's size moved) */
static __attribute__((noinline)) void chunk_rows_out(const float* c, int64_t gstride, int nblk, int64_t n0,
                                                     const bf16* bias, bf16* y, int64_t ldy, int rows, int64_t inter,
                                                     int epi) {
    if (inter)
        for (int g = 0; g + 1 < nblk; g += 2)
            tile_pair_out(c + g * gstride, c + (g + 1) * gstride, n0 / 32 + g / 2, y, ldy, rows, inter, epi);
    else
        for (int g = 0; g < nblk; g++) tile_rows_out(c + g * gstride, bias, n0 + 16 * g, y, ldy, rows, epi);
}

/* Up to 16 rows, one pass: each thread decodes its chunks' tiles one at a time (into 4 KB on the stack) and
 * multiplies the mr rows of x by them. Tiles 0-3: C (mr rows), 4-5: W, 7: x (mr rows). */
__attribute__((target("amx-tile,amx-bf16")))
static void linear_bf16c_rows(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy,
                              int mr, int64_t N16, int64_t K, int nthreads, int64_t inter, int epi) {
    const int64_t nchunks = (N16 + 63) / 64, KS = K / 32;
    const int nt = pick_threads(nchunks, N16 * K * 3 / 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        amx_tiles(8, 4, mr);
        bf16 dec[64 * 32] __attribute__((aligned(64)));
        float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t ch = 0; ch < nchunks; ch++) {
            const int64_t n0 = ch * 64;
            const int nblk = chunk_tiles(N16, ch);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t ks = 0; ks < KS; ks++) {
                bf16c_tile(cw, KS, ch, ks, 16 * nblk, dec, 32);
                _tile_loadd(7, x + ks * 32, ldx * 2);
                _tile_loadd(4, dec, 64);
                _tile_dpbf16ps(0, 7, 4);
                if (nblk > 1) { _tile_loadd(5, dec + 512, 64); _tile_dpbf16ps(1, 7, 5); }
                if (nblk > 2) { _tile_loadd(4, dec + 1024, 64); _tile_dpbf16ps(2, 7, 4); }
                if (nblk > 3) { _tile_loadd(5, dec + 1536, 64); _tile_dpbf16ps(3, 7, 5); }
            }
            _tile_stored(0, c[0], 64);
            if (nblk > 1) _tile_stored(1, c[1], 64);
            if (nblk > 2) _tile_stored(2, c[2], 64);
            if (nblk > 3) _tile_stored(3, c[3], 64);
            chunk_rows_out(c[0], sizeof c[0] / sizeof(float), nblk, n0, bias, y, ldy, mr, inter, epi);
        }
        _tile_release();
    }
}

/* Where the tile GEMM's weight chunks come from: a 12-bit weight (cw), or, with cw NULL, W4A16's packed nibbles
 * (gemm_w4p.c's layout: w4, its blocked fp32 scales and offsets sT / zT [N64 / 64][K / gs][64], groups of gs
 * columns), each weight rebuilt as bf16(q s + z) (an fp32 multiply, then the add: the PyTorch reference's
 * dequantization, it_dequant_w4's and the VDPBF16PS GEMM's slabs' rounding). Either way the tiles multiply the very
 * bf16 weights a bf16 GEMM would on the unpacked weight, in linear_bf16's order: the same bits. */
typedef struct {
    const bf16c* cw;
    const uint32_t* w4;
    const float *sT, *zT;
    int64_t gs, K;
    /* W4A16: 0, or a gate_up's intermediate size (gate features 0 .. inter - 1, up ones inter .. 2 inter - 1, inter
       a multiple of 32): chunk c's four tiles are then gate 32c .., up 32c .., gate 32c + 16 .., up 32c + 16 .., the
       order a 12-bit gate_up is packed in, so the GEMM's epilogue writes SiLU-and-multiply (tile_pair_out) */
    int64_t inter;
    /* W4A16 in pack_w4's rows (cw and w4 NULL; w4r set): w4r [N, K / 2] (each run of 64 columns in 32 bytes, byte b
       holding column b in its low nibble and b + 32 in its high one), its fp32 scales and offsets sr / zr [N, K / gs];
       features from N on rebuild as zeros (w4r_tile) */
    const uint8_t* w4r;
    const float *sr, *zr;
    int64_t N;
    /* W8A16 on W8A8's packed weight (cw, w4 and w4r NULL; w8 set): w8 it_pack_w8a8's words ([N64 / 64][Kp / 4][64],
       each 4 columns of one feature + 128; features past N hold q = 0), its fp32 scales s8 [N]; each weight rebuilt
       as bf16(q bf16(s)) (w8_scale's scale, it_dequant_w8's rounding); N: the features the scales cover */
    const uint32_t* w8;
    const float* s8;
} tile_src;

#ifndef W4P_TILE_PF
#define W4P_TILE_PF 2048 /* a W4A16 block's nibbles are asked into L1 this many bytes ahead of the rebuild */
#endif

/* Octet p (columns 8p .. 8p + 7) of the 16 features 16 v .. of W4A16 block b (64 features) in bf16: four VNNI
 * rows (column pairs 4p + i), row i at out + i pstride (32-bit words, a feature's two weights, the even column in
 * the low half). The word (b, p, f) holds column 8p + j in byte j's low nibble and 8p + 4 + j in its high one
 * (gemm_w4p.c). */
static inline void w4p_group(const tile_src* s, int64_t b, int v, int64_t p, uint32_t* out, int64_t pstride) {
    const int64_t G = s->K / s->gs, g = 8 * p / s->gs;
    const __m512i m4 = _mm512_set1_epi32(0x0f), hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i word = _mm512_load_si512(s->w4 + (b * (s->K / 8) + p) * 64 + 16 * v);
    const __m512 sc = _mm512_load_ps(s->sT + (b * G + g) * 64 + 16 * v);
    const __m512 z = _mm512_load_ps(s->zT + (b * G + g) * 64 + 16 * v);
    static const int shift[8] = {0, 8, 16, 24, 4, 12, 20, 28}; /* column c: byte c % 4, high nibble past 3 */
    if ((dq_normal16(sc) & dq_normal16(z)) == 0xffff) {
        /* no weight of the 16 features' group can be denormal (dq_w4_row_is_normal's rule, lane by lane): both
           columns rounded by one VCVTNE2PS2BF16 (nearest even, as bf16_round_f32), then VPERMW pairs each feature's
           two bf16 into its word: the same bits in ~13 instructions a column pair instead of ~21 */
        const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                               6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int i = 0; i < 4; i++) {
            const __m512i q0 = _mm512_and_si512(_mm512_srli_epi32(word, shift[2 * i]), m4);
            const __m512i q1 = _mm512_and_si512(_mm512_srli_epi32(word, shift[2 * i + 1]), m4);
            const __m512 w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q0), sc), z);
            const __m512 w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q1), sc), z);
            _mm512_store_si512(out + i * pstride, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
        }
        return;
    }
    for (int i = 0; i < 4; i++) {
        const __m512i q0 = _mm512_and_si512(_mm512_srli_epi32(word, shift[2 * i]), m4);
        const __m512i q1 = _mm512_and_si512(_mm512_srli_epi32(word, shift[2 * i + 1]), m4);
        const __m512 w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q0), sc), z);
        const __m512 w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q1), sc), z);
        /* (both rounded as round_bf16x16: w0's bf16 to the low half, w1's left in the high one) */
        const __m512i r0 = _mm512_srli_epi32(_mm512_castps_si512(bf16_round_f32(w0)), 16);
        const __m512i r1 = _mm512_and_si512(_mm512_castps_si512(bf16_round_f32(w1)), hi16);
        _mm512_store_si512(out + i * pstride, _mm512_or_si512(r0, r1));
    }
}

static inline void w4p_prefetch(const tile_src* s, int64_t b, int64_t p) { /* (octet p of block b, W4P_TILE_PF on) */
#if W4P_TILE_PF > 0
    const uint32_t* wb = s->w4 + (b * (s->K / 8) + p) * 64;
    for (int l = 0; l < 256; l += 64) _mm_prefetch((const char*)wb + W4P_TILE_PF + l, _MM_HINT_T0);
#else
    (void)s, (void)b, (void)p;
#endif
}

/* Octet p (columns 8p .. 8p + 7) of the 16 features 16 v .. of W8A16's packed block b (64 features) in bf16, as
 * w4p_group lays them out: four VNNI rows (column pairs 4p + i). Words 2p and 2p + 1 of the block hold columns
 * 8p .. 8p + 3 and 8p + 4 .. 8p + 7, byte j of a word column j + 128. Each weight q bf16(s) rounded once: VCVTNE2PS2BF16
 * where no scale of the 16 features can make it a denormal (|s| >= 2^-126 or 0, as dequant_w8_row_fast asks), else
 * the exact rounding (bf16_round_f32). */
static inline void w8p_group(const tile_src* s, int64_t b, int v, int64_t p, uint32_t* out, int64_t pstride) {
    const int64_t f0 = 64 * b + 16 * v, left = s->N - f0;
    const __mmask16 live = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    const __m512 sc = bf16_round_f32(_mm512_maskz_loadu_ps(live, s->s8 + f0)); /* (past N: 0, their q are 0 too) */
    const __m512 a = _mm512_abs_ps(sc);
    const __mmask16 normal = _mm512_cmp_ps_mask(sc, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                             (_mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-126f), _CMP_GE_OQ) &
                              _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.4028234e38f), _CMP_LE_OQ));
    const uint32_t* wb = s->w8 + (b * (i8_kp(s->K) / 4) + 2 * p) * 64 + 16 * v;
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u), hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i word[2] = {_mm512_xor_si512(_mm512_load_si512(wb), flip),
                             _mm512_xor_si512(_mm512_load_si512(wb + 64), flip)}; /* (bytes: q, signed) */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int i = 0; i < 4; i++) {
        const __m512i w = word[i >> 1];
        const int t = 2 * (i & 1); /* (the pair's columns: bytes t and t + 1 of the word) */
        const __m512i q0 = _mm512_srai_epi32(_mm512_sllv_epi32(w, _mm512_set1_epi32(24 - 8 * t)), 24);
        const __m512i q1 = _mm512_srai_epi32(_mm512_sllv_epi32(w, _mm512_set1_epi32(16 - 8 * t)), 24);
        const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), sc), w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), sc);
        if (normal == 0xffff) {
            _mm512_store_si512(out + i * pstride, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
        } else {
            const __m512i r0 = _mm512_srli_epi32(_mm512_castps_si512(bf16_round_f32(w0)), 16);
            const __m512i r1 = _mm512_and_si512(_mm512_castps_si512(bf16_round_f32(w1)), hi16);
            _mm512_store_si512(out + i * pstride, _mm512_or_si512(r0, r1));
        }
    }
}

static inline void w8p_prefetch(const tile_src* s, int64_t b, int64_t p) { /* (octet p of block b, W4P_TILE_PF on) */
#if W4P_TILE_PF > 0
    const uint32_t* wb = s->w8 + (b * (i8_kp(s->K) / 4) + 2 * p) * 64;
    for (int l = 0; l < 512; l += 64) _mm_prefetch((const char*)wb + W4P_TILE_PF + l, _MM_HINT_T0);
#else
    (void)s, (void)b, (void)p;
#endif
}

/* Octet p of block b's four groups of 16 features: group v's rows at out + v vstride (see w4p_group) */
static inline void w4p_octet(const tile_src* s, int64_t b, int64_t p, uint32_t* out, int64_t pstride,
                             int64_t vstride) {
    w4p_prefetch(s, b, p);
    for (int v = 0; v < 4; v++) w4p_group(s, b, v, p, out + v * vstride, pstride);
}

/* Octet p of a tile GEMM chunk c's four 16-feature tiles from a packed W4A16 or W8A16 weight (tile_src.inter: a
 * gate_up's gate and up tiles in turn) into the decoded k-step's rows at out (tile v at out + 256 v words, its pair
 * rows 16 words apart) */
static inline void packed_chunk_octet(const tile_src* s, int64_t c, int64_t p, uint32_t* out) {
    if (!s->inter && !s->w8) {
        w4p_octet(s, c, p, out, 16, 256);
        return;
    }
    for (int v = 0; v < 4; v++) {
        const int64_t f = s->inter ? (v & 1 ? s->inter : 0) + 32 * c + 16 * (v >> 1) : 64 * c + 16 * v; /* its first */
        if (s->w8) {
            if (v < 2 && (s->inter || v == 0)) w8p_prefetch(s, f / 64, p);
            w8p_group(s, f / 64, (int)(f % 64 / 16), p, out + 256 * v, 16);
        } else {
            if (v < 2) w4p_prefetch(s, f / 64, p);
            w4p_group(s, f / 64, (int)(f % 64 / 16), p, out + 256 * v, 16);
        }
    }
}

/* The 16 x 16 transpose of 32-bit words: row p of the result holds word p of each input row, row i's in word i */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);  /* a lane: r_i[0] r_i+1[0] r_i[1] r_i+1[1] */
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]); /* r_i[2] r_i+1[2] r_i[3] r_i+1[3] */
    }
    for (int a = 0; a < 16; a += 4) { /* u[a + c], a lane L: rows a .. a + 3 at word 4 L + c */
        u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int c = 0; c < 4; c++) { /* row 4 L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
        const __m512i w0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), w1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i x0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i x1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(w0, x0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(w0, x0, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(w1, x1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(w1, x1, 0xDD);
    }
}

/* k-step ks (columns 32 ks ..) of features f .. f + 15 of W4A16 rows (tile_src.w4r) rebuilt in bf16 into a B operand
 * at out: row p (64 bytes) holds each feature's columns 2p and 2p + 1 (VNNI). A feature's 32 columns are the low or
 * the high nibbles of 32 bytes of its row: one VPERMW in its group's table (dequant_w4_row_fast's lookup: the same
 * multiply, add and rounding), or the exact rounding (dequant_w4_row's) where its scale or offset could make a
 * denormal weight; then the 16 x 16 transpose of the column pairs. */
static inline void w4r_tile(const tile_src* s, int64_t f, int64_t ks, bf16* out) {
    const int64_t G = s->K / s->gs, g = 32 * ks / s->gs, byte0 = (ks >> 1) * 32;
    const int hi = (int)(ks & 1);
    const __m512 q16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i r[16];
    for (int i = 0; i < 16; i++) {
        const int64_t n = f + i;
        if (n >= s->N) {
            r[i] = _mm512_setzero_si512();
            continue;
        }
        const float sc = s->sr[n * G + g], z = s->zr[n * G + g];
        const uint8_t* p = s->w4r + n * (s->K / 2) + byte0;
        if (dq_scale_ok(sc, 0x1p-102f) && dq_scale_ok(z, 0x1p-102f)) {
            const __m512 v = _mm512_add_ps(_mm512_mul_ps(q16, _mm512_set1_ps(sc)), _mm512_set1_ps(z));
            const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
            r[i] = _mm512_permutexvar_epi16(hi ? _mm512_srli_epi16(b, 4) : b, (__m512i)_mm512_cvtne2ps_pbh(v, v));
        } else {
            const __m512 sv = _mm512_set1_ps(sc), zv = _mm512_set1_ps(z);
            __m256i h[2];
            for (int j = 0; j < 2; j++) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * j)));
                const __m512i q = _mm512_and_si512(hi ? _mm512_srli_epi32(b, 4) : b, _mm512_set1_epi32(0xF));
                h[j] = round_bf16x16(_mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), sv), zv));
            }
            r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
        }
    }
    transpose16_epi32(r);
    for (int q = 0; q < 16; q++) _mm512_store_si512(out + 32 * q, r[q]);
}

/* Tile v (rows 16 v ..) of a tile GEMM chunk c's k-step ks from W4A16 rows (tile_src.inter: a gate_up's gate and up
 * tiles in turn, as packed_chunk_octet) */
static inline void w4r_chunk_tile(const tile_src* s, int64_t c, int64_t ks, int v, bf16* out) {
    const int64_t f = s->inter ? (v & 1 ? s->inter : 0) + 32 * c + 16 * (v >> 1) : 64 * c + 16 * v;
    w4r_tile(s, f, ks, out);
}

/* A slab of a chunk being decoded a few row pairs at a time into out [ke - k0][64][32]: the B operand of k-step ks,
 * features 16 g.., at out + (ks - k0) * 2048 + g * 512 (64-byte rows) */
typedef struct {
    const tile_src* src;
    int64_t chunk, KS, ks, k0, ke; /* tiles k0 .. ke - 1 of the chunk (a slab); ks: the next one */
    int rows, r;
    bf16* out; /* tile k0's rows */
} chunk_decoder;

/* Decodes `pairs` more row pairs (fewer at the end); a 12-bit tile's escapes are patched after its last pair, a
 * W4A16 tile goes in whole octets (16 of its 64 rows: four column pairs of each 16 features) */
static inline void decode_some(chunk_decoder* d, int pairs) {
    if (d->ks >= d->ke) return;
    const int64_t t = d->chunk * d->KS + d->ks;
    bf16* out = d->out + (d->ks - d->k0) * 2048;
    int r1 = d->r + 2 * pairs < d->rows ? d->r + 2 * pairs : d->rows;
    if (d->src->cw) {
        bf16c_pairs(d->src->cw, t, d->r, r1, out, 32);
    } else if (d->src->w4r) { /* (a whole 16-feature tile at a time) */
        r1 = (r1 + 15) & ~15;
        for (int r = d->r; r < r1; r += 16) w4r_chunk_tile(d->src, d->chunk, d->ks, r / 16, out + 32 * r);
    } else {
        r1 = (r1 + 15) & ~15;
        for (int r = d->r; r < r1; r += 16) packed_chunk_octet(d->src, d->chunk, 4 * d->ks + r / 16, (uint32_t*)out + 4 * r);
    }
    d->r = r1;
    if (d->r >= d->rows) {
        if (d->src->cw) bf16c_patch(d->src->cw, t, out, 32);
        d->ks++;
        d->r = 0;
    }
}

/* The decoder of a GEMM step's weights (steps: block-major, then slab of KSL k-steps, then chunk) into out (a W4A16
 * chunk's rows all 64: its features past N are zeros) */
static inline chunk_decoder step_decoder(const tile_src* src, int64_t step, int64_t nchunks, int64_t nslabs,
                                         int64_t KSL, int64_t KS, int64_t N16, bf16* out) {
    const int64_t c = step % nchunks, k0 = step / nchunks % nslabs * KSL;
    return (chunk_decoder){src, c, KS, k0, k0, k0 + KSL < KS ? k0 + KSL : KS, src->cw ? 16 * chunk_tiles(N16, c) : 64,
                           0, out};
}

/* The output rows of a finished row pair of a chunk (its blocks' accumulators stored in c: block g / 2 of the chunk's
 * feature pairs at c[g / 2]), written a few rows at a time while the tiles multiply the next row pair: the vector
 * work of rounding (and SiLU) overlaps the tiles' work. Each row goes out whole: the chunk's 64 features (or, with
 * an interleaved gate_up, its 32 act columns), full cache lines, never one half now and the other a block later
 * (half lines written apart cost the tile GEMM 10-15% at a gate_up's shape here). Row i of the job is row i of
 * token tile 0 for i < r0, else row i - r0 of token tile 1. */
typedef struct {
    const float (*c)[4][256];
    const bf16* bias;
    bf16* y; /* row 0 of token tile 0 */
    int64_t ldy, n, inter; /* n: the chunk's first feature (column) */
    int nb, na[2], r0, r1, epi, next, per_step; /* nb: blocks (feature pairs) of the chunk; epi: as linear_bf16c's */
    int stream; /* the rows (a plain product, or act) go out with non-temporal stores: whole lines past the caches */
    int64_t pk, row0; /* pk > 0: act goes out packed (px_index, act's K = pk) at y (its row 0): the row pair's rows
                         from row0 */
} epi_job;

static inline void epi_some(epi_job* e, int rows) {
    for (; rows > 0 && e->next < e->r0 + e->r1; rows--, e->next++) {
        const int tt = e->next >= e->r0, m = tt ? e->next - e->r0 : e->next;
        bf16* yr = e->y + (16 * tt + m) * e->ldy;
        for (int b = 0; b < e->nb; b++) {
            const float* c0 = e->c[b][2 * tt] + 16 * m;
            const int64_t n = e->n + 32 * b;
            if (e->pk) { /* (act's 16 columns of the pair at their packed place: tile_pair_out's one row there) */
                tile_pair_out(c0, e->c[b][2 * tt + 1] + 16 * m, 0, e->y + px_index(e->row0 + 16 * tt + m, n / 2, e->pk),
                              0, 1, e->pk, e->stream ? 2 : 1);
            } else if (e->inter) {
                tile_pair_out(c0, e->c[b][2 * tt + 1] + 16 * m, n / 32, yr, e->ldy, 1, e->inter,
                              e->epi && e->stream ? 2 : e->epi);
            } else {
                const int mode = e->epi ? 1 : e->stream ? 2 : 0;
                tile_rows_out(c0, e->bias, n, yr, e->ldy, 1, mode);
                if (e->na[b] == 2) tile_rows_out(e->c[b][2 * tt + 1] + 16 * m, e->bias, n + 16, yr, e->ldy, 1, mode);
            }
        }
    }
}

/* One 2 x 2 block over K columns (all of K, or a slab): row tiles a0 (and a1, where given) of x against feature
 * tiles wb (and wb + 512 where na == 2) of a decoded chunk; c[2 r + f] gets row tile r x feature tile f, added to
 * cin's (the previous slabs' sums) where given, else to zero (x's k-step s at a0 + s astep: 32 in rows, 512 packed).
 * Tiles 0-3: C, 4-5: x, 6-7: W. Each k-step also
 * decodes `pairs` row pairs of the next chunk (where d is given): its codes stream in from memory while the
 * tiles multiply. */
__attribute__((target("amx-tile,amx-bf16")))
static inline void bf16c_block(const bf16* a0, int64_t lda0, const bf16* a1, int64_t lda1, int64_t astep, const bf16* wb, int na,
                               int64_t K, const float (*cin)[256], float c[4][256], chunk_decoder* d, int pairs,
                               epi_job* e) {
    if (cin) {
        _tile_loadd(0, cin[0], 64);
        if (na == 2) _tile_loadd(1, cin[1], 64);
        if (a1) {
            _tile_loadd(2, cin[2], 64);
            if (na == 2) _tile_loadd(3, cin[3], 64);
        }
    } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
        const bf16* b = wb + k * 64;
        _tile_loadd(6, b, 64);
        _tile_loadd(4, a0 + k / 32 * astep, lda0);
        _tile_dpbf16ps(0, 4, 6);
        if (na == 2) { _tile_loadd(7, b + 512, 64); _tile_dpbf16ps(1, 4, 7); }
        if (a1) {
            _tile_loadd(5, a1 + k / 32 * astep, lda1);
            _tile_dpbf16ps(2, 5, 6);
            if (na == 2) _tile_dpbf16ps(3, 5, 7);
        }
        if (d) decode_some(d, pairs);
        epi_some(e, e->per_step);
    }
    _tile_stored(0, c[0], 64);
    if (na == 2) _tile_stored(1, c[1], 64);
    if (a1) {
        _tile_stored(2, c[2], 64);
        if (na == 2) _tile_stored(3, c[3], 64);
    }
}

/* An act of at least this many bytes (SiLU out of a gate_up GEMM) is written with non-temporal stores: at a
 * 2048 x 4864 act (20 MB) a prefill of the 386M model 3% faster on an AMX Xeon (bench_kernel_builds.py, 8 rounds
 * 0.95-0.98x); below it (a MoE expert's rows, short prompts) act stays in the caches for the down GEMM (a MoE
 * expert's act streamed too: level). The sizes between were not measured. */
#define BF16C_STREAM_BYTES (4 << 20)
#define BF16C_EPI_STREAM IT_BF16C_EPI_STREAM /* linear_bf16c's epi: a plain product, past the caches (below) */

#define BF16C_GEMM_ROWS 512 /* rows of x per block: each thread decodes a chunk once per block */
#define BF16C_SLAB_BYTES (1536 * 1024) /* a block's x and two decoded chunks over one slab of K fit this (L2) */

static inline int64_t bf16c_block_rows(int64_t M) {
    const int64_t rows = (M + 15) / 16 * 16;
    return rows < BF16C_GEMM_ROWS ? rows : BF16C_GEMM_ROWS;
}

/* k-steps (of 32) per slab of K: the whole of K unless a block's rows of x and a thread's two decoded chunks over
 * all of K would overflow BF16C_SLAB_BYTES; then equal slabs that fit */
static inline int64_t bf16c_slab_ks(int64_t M, int64_t K) {
    const int64_t KS = K / 32;
    int64_t fit = BF16C_SLAB_BYTES / (64 * bf16c_block_rows(M) + 8192); /* x row tile bytes + 2 chunks, a k-step */
    fit = fit < 4 ? 4 : fit;
    if (fit >= KS) return KS;
    const int64_t n = (KS + fit - 1) / fit;
    return (KS + n - 1) / n;
}

/* The GEMM's dec buffer: each thread's two decoded chunks [2][64, K], then, where K is cut into slabs, the fp32
 * sums of a block of rows over the slabs done so far, 2 x 2 tiles by 2 x 2 tiles [N64 / 64][rows / 32][2][4][256] */
static inline int64_t bf16c_bufs_bytes(int64_t K, int nthreads) { /* the decoded chunks' part */
    return ((int64_t)(nthreads > 0 ? nthreads : 1) * 128 * K * 2 + 63) & ~(int64_t)63;
}
static inline int64_t bf16c_dec_bytes(int64_t M, int64_t N16, int64_t K, int nthreads) {
    if (M <= 16) return 0;
    const int64_t bufs = bf16c_bufs_bytes(K, nthreads);
    const int64_t spill = bf16c_slab_ks(M, K) < K / 32 ? (N16 + 63) / 64 * 64 * ((bf16c_block_rows(M) + 31) / 32 * 32) * 4 : 0;
    return bufs + spill;
}

/* More than 16 rows: the steps (a block of up to BF16C_GEMM_ROWS rows, a slab of K, a 64-feature chunk of W) go
 * out one at a time to whichever thread is free (a thread that falls behind, a core taken away for a while, takes
 * fewer). A thread multiplies every row of the block by its decoded chunk's slab 2 x 2 tiles at a time while it
 * decodes its next step's into its other buffer (dec: two [64, K] a thread). The slabs of one chunk run in order
 * (a step waits for the chunk's previous one), their sums kept in dec past the buffers; where K is one slab the
 * sums stay in the tiles. x is read in place; a last partial row tile is copied zero-padded into xtail [16, K]
 * first, so no tile load reads past the M rows. */
__attribute__((target("amx-tile,amx-bf16")))
static void tiles_gemm(const bf16* x, int64_t ldx, const tile_src* src, const bf16* bias, bf16* y, int64_t ldy,
                       int64_t M, int64_t N16, int64_t K, int nthreads, bf16* xtail, bf16* wdec, int64_t inter, int epi,
                       int stream, int xpacked, int64_t ypk) {
    const int64_t nchunks = (N16 + 63) / 64, tiles = (M + 15) / 16, full = M / 16, KS = K / 32;
    const int64_t KSL = bf16c_slab_ks(M, K), nslabs = (KS + KSL - 1) / KSL, per_block = nslabs * nchunks;
    const int64_t bt = BF16C_GEMM_ROWS / 16, pairs_per_block = (bf16c_block_rows(M) + 31) / 32;
    if (full < tiles && !xpacked) {
        memset(xtail, 0, (size_t)(16 * K * 2));
        for (int64_t m = 16 * full; m < M; m++) memcpy(xtail + (m - 16 * full) * K, x + m * ldx, (size_t)(K * 2));
    }
    float* spill = (float*)((char*)wdec + bf16c_bufs_bytes(K, nthreads));
    /* Outputs past the caches (non-temporal stores, whole 64-byte lines: y and its rows 64-byte aligned): a plain
       product where the caller asks (BF16C_EPI_STREAM: a MoE expert's down rows, 0.84x the experts' time of a MoE
       prefill on an AMX Xeon; streaming every plain product, a dense prompt's q / k / v too, left that prefill level:
       the q / k / v GEMM 0.77x, what reads them next as much slower), act (SiLU of a gate_up) where it is large;
       a store that misses the caches costs the tiles far more here than the reader's trip to memory. The residual
       adds (epi = 1 without inter) read y first and store as usual. */
    const int lines = ypk ? !((uintptr_t)y & 63) : rows_on_lines(y, ldy);
    const int stream_rows = lines && !inter && stream;
    const int stream_act = lines && inter && epi && M * inter * 2 >= BF16C_STREAM_BYTES;
    int64_t done[nslabs > 1 ? nchunks : 1]; /* per chunk: the slab steps finished (block b's slab s is b nslabs + s) */
    memset(done, 0, sizeof done);
    const int nt = pick_threads(nchunks, N16 * K * tiles, nthreads);
    int64_t next_step = 0;
#pragma omp parallel num_threads(nt)
    {
        amx_configure(8);
        /* a row pair's accumulators (a block per feature pair of the chunk), and the previous row pair's */
        float cb[2][2][4][256] __attribute__((aligned(64)));
        int cur_c = 0;
        epi_job job = {0};
        const int tid = omp_get_thread_num();
        bf16* buf[2] = {wdec + (int64_t)tid * 128 * K, wdec + (int64_t)tid * 128 * K + 64 * K};
        const int64_t steps = (tiles + bt - 1) / bt * per_block;
        int cur = 0;
        /* Steps block-major, then slab, then chunk. Each thread decodes the step it will take next while it
           multiplies. */
        int64_t step = __atomic_fetch_add(&next_step, 1, __ATOMIC_RELAXED);
        if (step < steps) { /* (the first step's slab up front) */
            chunk_decoder d0 = step_decoder(src, step, nchunks, nslabs, KSL, KS, N16, buf[0]);
            while (d0.ks < d0.ke) decode_some(&d0, 32);
        }
        while (step < steps) {
            const int64_t b = step / per_block, s = step / nchunks % nslabs, ch = step % nchunks;
            const int64_t t0 = b * bt, t1 = t0 + bt < tiles ? t0 + bt : tiles;
            const int64_t k0 = s * KSL, k1 = k0 + KSL < KS ? k0 + KSL : KS, klen = (k1 - k0) * 32;
            const int64_t n0 = ch * 64;
            const int nblk = chunk_tiles(N16, ch);
            const int64_t next = __atomic_fetch_add(&next_step, 1, __ATOMIC_RELAXED);
            chunk_decoder dn, *d = NULL;
            if (next < steps && next % per_block != step % per_block) { /* (the same slab of a chunk stays decoded) */
                dn = step_decoder(src, next, nchunks, nslabs, KSL, KS, N16, buf[cur ^ 1]);
                d = &dn;
            }
            const int64_t ksteps = ((t1 - t0 + 1) / 2) * ((nblk + 1) / 2) * (k1 - k0);
            const int pairs = d ? (int)(((dn.ke - dn.k0) * dn.rows / 2 + ksteps - 1) / ksteps) : 0;
            if (nslabs > 1) /* the chunk's previous slab (or, at s = 0, the previous block's last) must be done */
                while (__atomic_load_n(&done[ch], __ATOMIC_ACQUIRE) < b * nslabs + s) _mm_pause();
            const bf16* wc = buf[cur];
            const int last = s == nslabs - 1;
            for (int64_t t = t0; t < t1; t += 2) {
                const int two = t + 1 < t1;
                const bf16 *a0, *a1 = NULL;
                int64_t lda0 = 64, lda1 = 64;
                if (xpacked) {
                    a0 = x + px_index(16 * t, k0 * 32, K);
                    if (two) a1 = x + px_index(16 * (t + 1), k0 * 32, K);
                } else {
                    a0 = (t < full ? x + 16 * t * ldx : xtail) + k0 * 32;
                    if (two) a1 = (t + 1 < full ? x + 16 * (t + 1) * ldx : xtail) + k0 * 32;
                    lda0 = t < full ? ldx * 2 : K * 2, lda1 = t + 1 < full ? ldx * 2 : K * 2;
                }
                const int r0 = (int)(M - 16 * t < 16 ? M - 16 * t : 16);
                const int r1 = two ? (int)(M - 16 * (t + 1) < 16 ? M - 16 * (t + 1) : 16) : 0;
                for (int g = 0; g < nblk; g += 2) {
                    const int na = nblk - g >= 2 ? 2 : 1;
                    float (*sp)[256] = nslabs > 1 ? (float (*)[256])(spill + ((ch * pairs_per_block + (t - t0) / 2) * 2 + g / 2) * 1024) : NULL;
                    bf16c_block(a0, lda0, a1, lda1, xpacked ? 512 : 32, wc + g * 512, na, klen, s > 0 ? (const float (*)[256])sp : NULL,
                                last ? cb[cur_c][g / 2] : sp, d, pairs, &job);
                }
                epi_some(&job, 32); /* (whatever rounding left of the previous row pair's) */
                if (!last) continue;
                /* this row pair's rows go out during the next one's blocks (or below, after the last) */
                const int nb = (nblk + 1) / 2;
                job = (epi_job){(const float (*)[4][256])cb[cur_c], bias, ypk ? y : y + 16 * t * ldy, ldy, n0, inter, nb,
                                {nblk >= 2 ? 2 : 1, nblk >= 4 ? 2 : 1}, r0, two ? r1 : 0, epi, 0,
                                (int)((r0 + r1 + nb * (k1 - k0) - 1) / (nb * (k1 - k0))),
                                /* (whole lines: 64 features a row, or an interleaved chunk's 32 act columns) */
                                inter ? stream_act && nblk == 4 : stream_rows && nblk % 2 == 0, ypk, 16 * t};
                cur_c ^= 1;
            }
            if (nslabs > 1) __atomic_store_n(&done[ch], b * nslabs + s + 1, __ATOMIC_RELEASE);
            if (d) {
                while (dn.ks < dn.ke) decode_some(&dn, 32); /* (rounding left a few pairs) */
                cur ^= 1;
            }
            step = next;
        }
        epi_some(&job, 32); /* the last row pair's rows */
        _mm_sfence(); /* (the non-temporal stores seen before any thread reads act) */
        _tile_release();
    }
}

/* x [M, K] times a 12-bit weight: scratch holds bf16c_scratch_bytes(M, K); dec bf16c_dec_bytes(M, N16, K, nthreads) */
static inline int64_t bf16c_scratch_bytes(int64_t M, int64_t K) { return M > 16 ? ((16 * K * 2 + 63) & ~(int64_t)63) : 0; }

/* inter > 0: the weight is a gate_up with its rows interleaved (see tile_pair_out), and epi = 1 writes act
 * [M, inter] (SiLU-and-multiply); inter = 0: epi = 1 adds the product into y (y += x W^T + bias, each product
 * rounded to bf16 first, as add_rows adds it: a residual), epi = BF16C_EPI_STREAM writes it as epi = 0 does, past
 * the caches on the tile GEMM where its rows are whole lines (a caller that reads y much later: a MoE layer's
 * experts' down rows, read by the combine once every expert is done) */
static void linear_bf16c_noamx(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy,
                               int64_t M, int64_t N16, int64_t K, int nthreads, int64_t inter, int epi, int stream);

static void linear_bf16c(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N16, int64_t K, int nthreads, bf16* scratch, bf16* dec, int64_t inter,
                         int epi) {
    const int stream = epi == BF16C_EPI_STREAM; /* (a hint the GEMMs past 16 rows take; otherwise a plain product) */
    if (stream) epi = 0;
    if (amx_state != 1) /* (bf16c_noamx.c: VDPBF16PS on the decoded tiles) */
        linear_bf16c_noamx(x, ldx, cw, bias, y, ldy, M, N16, K, nthreads, inter, epi, stream);
    else if (M <= 16)
        linear_bf16c_rows(x, ldx, cw, bias, y, ldy, (int)M, N16, K, nthreads, inter, epi);
    else {
        const tile_src src = {.cw = cw, .K = K};
        tiles_gemm(x, ldx, &src, bias, y, ldy, M, N16, K, nthreads, scratch, dec, inter, epi, stream, 0, 0);
    }
}

/* linear_bf16c on AMX past 16 rows with x packed (px_index: xp holds (M + 15) / 16 row tiles of K); with ypk > 0 (a
 * gate_up with inter == ypk and epi = 1) act goes out packed too, for down's GEMM. The same products in the same
 * order as from rows: the same bits. */
static void linear_bf16c_px(const bf16* xp, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy, int64_t M,
                            int64_t N16, int64_t K, int nthreads, bf16* dec, int64_t inter, int epi, int64_t ypk) {
    const tile_src src = {.cw = cw, .K = K};
    tiles_gemm(xp, K, &src, bias, y, ldy, M, N16, K, nthreads, NULL, dec, inter, epi, 0, 1, ypk);
}

/* scratch: bf16_scratch_bytes(M, K), 64-byte aligned (the transposed activations of the AMX path) */
