/* W4A16 on a packed weight (it_lin kind 6, IT_KIND_W4P): group-wise int4 weights w = q s + z (q in 0..15, fp32 s and
 * z per output feature and group of gs columns), kept in a layout of 64-feature blocks that stream as one run of
 * memory each, as W8A8's packed weight does (gemm_i8.c): linear_w4's one-row GEMV reads 4 weight rows side by side,
 * 4 streams a thread, and on a Zen 5 read 0.69x the bytes a second W8A8's packed GEMM read on the same machine.
 *
 * Layout (kernels/cpu.py pack_w4p builds it): words [N64 / 64][K / 8][64] (uint32), the word (b, p, f) the 8 columns
 * 8p .. 8p + 7 of feature 64 b + f: its byte j (0..3) holds column 8p + j in its low nibble and 8p + 4 + j in its
 * high nibble. Scales and offsets [N64 / 64][G][64] fp32 (G = K / gs), so a group's 16 features are one vector.
 * Features past N hold q = 0, s = z = 0.
 *
 * One or two rows of x at a time (the int kernel, below the bf16 GEMM's rows): x rounded to int16 per row and split
 * into signed bytes (x_q = 256 h + l) as linear_w4 does (act_i16.h), the nibbles masked to bytes as VPDPBUSD's
 * unsigned operand (no flip, no widening) against broadcast words of h and l: per packed vector (16 features x 8
 * columns) two masks and four VPDPBUSD a row; per group the exact int32 sums 256 H + L (the integers w4b_block
 * sums), then, per feature in fp32 and group by group, acc = acc + float(S) s (a multiply, then an add); the offsets'
 * term z = sum_g z_g xsum_g in the same order as w4b_block (fp32, the exact x's sums); y = bf16(acc s_x + z + bias).
 * The fp32 order differs from w4b_block's (its lanes hold columns, summed across at the end), so the two differ in
 * the last bits; tests/test_kernels.py holds this one to an exact emulation of this order.
 *
 * From gemm_rows_noamx rows (prompts, where GEMM_KC % gs == 0): gemm_dpbf16.c's GEMM, each slab rebuilt in bf16
 * straight into the GEMM's pair-interleaved order (bf16(q s + z), the PyTorch reference's rounding, as it_dequant_w4):
 * bit for bit linear_w4's prompt path on the same integers. */
#define W4P_MR 2
#define W4P_CHUNK 64 /* rows of x the int kernel quantizes at a time (its scratch: w8_scratch_bytes(64, K) at most) */
#ifndef W4P_PF
#define W4P_PF 2048 /* the weight stream is asked into L1 this many bytes ahead (0: not; one row, A/B: 1.00-1.05x) */
#endif

static inline int64_t w4p_scratch_bytes(int64_t M, int64_t K) { return w8_scratch_bytes(M < W4P_CHUNK ? M : W4P_CHUNK, K); }

/* rows [mr] x features [64] of block b: see the top of this file. xh, xl: rows of x_q's bytes (stride Kp); xsum:
 * [mr][G] the sums of x per group; out: [mr][64] acc s_x + z (before the bias) */
static inline __attribute__((always_inline)) void w4p_block(const int8_t* xh, const int8_t* xl, int64_t Kp,
                                                            const float* xsum, const float* sx, const int MRC,
                                                            const uint32_t* wb, const float* sT, const float* zT,
                                                            int64_t gs, int64_t K, float out[W4P_MR][64]) {
    const int64_t G = K / gs, per_group = gs / 8;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[W4P_MR][4], z[W4P_MR][4];
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = z[i][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        /* (one row with the high nibbles' products in accumulators of their own, one VPDPBUSD a chain an octet: no
           faster, 1.01x in an interleaved A/B of two builds on the Zen 5; not latency-bound) */
        __m512i H[W4P_MR][4], L[W4P_MR][4];
        for (int i = 0; i < MRC; i++)
            for (int v = 0; v < 4; v++) H[i][v] = L[i][v] = _mm512_setzero_si512();
        for (int64_t p = g * per_group; p < (g + 1) * per_group; p++) {
            const uint32_t* q = wb + p * 64;
#if W4P_PF > 0
            _mm_prefetch((const char*)q + W4P_PF, _MM_HINT_T0);
            _mm_prefetch((const char*)q + W4P_PF + 64, _MM_HINT_T0);
            _mm_prefetch((const char*)q + W4P_PF + 128, _MM_HINT_T0);
            _mm_prefetch((const char*)q + W4P_PF + 192, _MM_HINT_T0);
#endif
            __m512i ha[W4P_MR], hb[W4P_MR], la[W4P_MR], lb[W4P_MR];
            for (int i = 0; i < MRC; i++) {
                int32_t t[4];
                memcpy(t, xh + i * Kp + 8 * p, 8);
                memcpy(t + 2, xl + i * Kp + 8 * p, 8);
                ha[i] = _mm512_set1_epi32(t[0]);
                hb[i] = _mm512_set1_epi32(t[1]);
                la[i] = _mm512_set1_epi32(t[2]);
                lb[i] = _mm512_set1_epi32(t[3]);
            }
            for (int v = 0; v < 4; v++) {
                const __m512i w = _mm512_load_si512(q + 16 * v);
                const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), m4);
                for (int i = 0; i < MRC; i++) {
                    H[i][v] = dpbusd(dpbusd(H[i][v], lo, ha[i]), hi, hb[i]);
                    L[i][v] = dpbusd(dpbusd(L[i][v], lo, la[i]), hi, lb[i]);
                }
            }
        }
        for (int v = 0; v < 4; v++) {
            const __m512 s = _mm512_load_ps(sT + g * 64 + 16 * v), zz = _mm512_load_ps(zT + g * 64 + 16 * v);
            for (int i = 0; i < MRC; i++) {
                const __m512i S = _mm512_add_epi32(_mm512_slli_epi32(H[i][v], 8), L[i][v]); /* 256 H + L, exact */
                acc[i][v] = _mm512_add_ps(acc[i][v], _mm512_mul_ps(_mm512_cvtepi32_ps(S), s));
                z[i][v] = _mm512_add_ps(z[i][v], _mm512_mul_ps(zz, _mm512_set1_ps(xsum[i * G + g])));
            }
        }
    }
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++)
            _mm512_storeu_ps(out[i] + 16 * v, _mm512_add_ps(_mm512_mul_ps(acc[i][v], _mm512_set1_ps(sx[i])), z[i][v]));
}

static void w4p_block_1(const int8_t* xh, const int8_t* xl, int64_t Kp, const float* xsum, const float* sx,
                        const uint32_t* wb, const float* sT, const float* zT, int64_t gs, int64_t K,
                        float out[W4P_MR][64]) {
    w4p_block(xh, xl, Kp, xsum, sx, 1, wb, sT, zT, gs, K, out);
}
static void w4p_block_2(const int8_t* xh, const int8_t* xl, int64_t Kp, const float* xsum, const float* sx,
                        const uint32_t* wb, const float* sT, const float* zT, int64_t gs, int64_t K,
                        float out[W4P_MR][64]) {
    w4p_block(xh, xl, Kp, xsum, sx, 2, wb, sT, zT, gs, K, out);
}

/* The int kernel for rows [M] (M <= W4P_CHUNK); scratch: w8_scratch_bytes(M, K) */
static void w4p_int_rows(const bf16* x, int64_t ldx, const uint32_t* w, const float* sT, const float* zT, int64_t gs,
                         const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                         void* scratch) {
    const int64_t Kp = i8_kp(K), G = K / gs, nblocks = (N + 63) / 64;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    float* xsum = sx + M;
    int8_t* xh = (int8_t*)(xsum + M * (K / 32 + 1));
    int8_t* xl = xh + M * Kp;
    int32_t* hsum = (int32_t*)(xl + M * Kp);
    quantize_rows_i16_512(x, ldx, M, K, Kp, xq, sx, xsum, gs);
    split_rows_i16(xq, M, Kp, xh, xl, hsum, hsum + M);
    const int nt = pick_threads(nblocks, N * K / 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * 64;
        const int nrows = (int)(N - n0 < 64 ? N - n0 : 64);
        const uint32_t* wb = w + b * (K / 8) * 64;
        const float *sb = sT + b * G * 64, *zb = zT + b * G * 64;
        for (int64_t m0 = 0; m0 < M; m0 += W4P_MR) {
            float out[W4P_MR][64];
            const int mr = (int)(M - m0 < W4P_MR ? M - m0 : W4P_MR);
            if (mr == 2)
                w4p_block_2(xh + m0 * Kp, xl + m0 * Kp, Kp, xsum + m0 * G, sx + m0, wb, sb, zb, gs, K, out);
            else
                w4p_block_1(xh + m0 * Kp, xl + m0 * Kp, Kp, xsum + m0 * G, sx + m0, wb, sb, zb, gs, K, out);
            for (int i = 0; i < mr; i++)
                for (int f = 0; f < nrows; f++)
                    y[(m0 + i) * ldy + n0 + f] = f2bf(out[i][f] + (bias ? bf2f(bias[n0 + f]) : 0.0f));
        }
    }
}

/* gemm_src.pack: features n0 .. n0 + 63 (block n0 / 64; rows past N are zeros already), columns k0 .. k0 + kc - 1 ->
 * the GEMM's slab wp[pair][v][l] = (bf16(w[n0 + 16 v + l][k0 + 2 pair]), ... + 1) as 32-bit words, w = q s + z
 * (ctx: a tile_src, bf16c_gemm.c) */
static void w4p_pack_slab(const void* ctx, int64_t K, int64_t n0, int nrows, int64_t k0, int64_t kc, uint32_t* wp,
                          bf16* tmp) {
    (void)K;
    (void)nrows;
    (void)tmp;
    for (int64_t p = k0 / 8; p < (k0 + kc) / 8; p++) w4p_octet((const tile_src*)ctx, n0 / 64, p, wp + (p - k0 / 8) * 256, 64, 16);
}

/* Rows past which W4A16 prompts go to the AMX tiles (bf16c_gemm.c's tiles_gemm on the nibbles rebuilt in bf16 a
 * 64-feature chunk at a time), below them the int kernel */
#ifndef W4P_AMX_MIN_ROWS
#define W4P_AMX_MIN_ROWS 16
#endif

static inline int w4p_tiles_take(int64_t M, int64_t N, int64_t gs) {
    return amx_state == 1 && M > W4P_AMX_MIN_ROWS && N % 16 == 0 && gs % 32 == 0;
}

/* Whether linear_w4p writes a gate_up's SiLU-and-multiply itself (silu = 1: the tiles' epilogue on gate and up
 * tiles paired by the decoder, tile_src.inter): where the tiles take the rows and the intermediate size is a
 * multiple of 32 */
static inline int w4p_act_takes(int64_t M, int64_t N, int64_t gs) {
    return w4p_tiles_take(M, N, gs) && N % 64 == 0;
}

/* The tile path's dec buffer (bf16c_dec_bytes), and what it_linear_w4p allocates: scratch, then dec */
static inline int64_t w4p_dec_bytes(int64_t M, int64_t N, int64_t K, int nthreads) {
    return w4p_tiles_take(M, N, 64) ? bf16c_dec_bytes(M, N, K, nthreads) : 0;
}

/* scratch: w4p_scratch_bytes(M, K) (none where the GEMM takes every row) */
/* silu = 1 (only where w4p_act_takes and dec is given): w is a gate_up [2 I, K] and y gets act [M, I] */
static void linear_w4p(const bf16* x, int64_t ldx, const uint32_t* w, const float* sT, const float* zT, int64_t gs,
                       const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                       void* scratch, bf16* dec, int silu) {
    const tile_src c = {.w4 = w, .sT = sT, .zT = zT, .gs = gs, .K = K, .inter = silu ? N / 2 : 0};
    if (dec && w4p_tiles_take(M, N, gs)) { /* (scratch: bf16c_scratch_bytes(M, K), the last row tile zero-padded) */
        tiles_gemm(x, ldx, &c, silu ? NULL : bias, y, ldy, M, N, K, nthreads, (bf16*)scratch, dec, c.inter, silu, 0, 0, 0);
        return;
    }
    if (gemm_noamx_takes(M, K) && GEMM_KC % gs == 0) {
        const gemm_src src = {NULL, 1, w4p_pack_slab, &c}; /* (no row-wise prefetch: the blocks stream in order) */
        dpbf16_gemm(x, ldx, &src, bias, y, ldy, M, N, K, nthreads);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += W4P_CHUNK) {
        const int64_t rows = M - m0 < W4P_CHUNK ? M - m0 : W4P_CHUNK;
        w4p_int_rows(x + m0 * ldx, ldx, w, sT, zT, gs, bias, y + m0 * ldy, ldy, rows, N, K, nthreads, scratch);
    }
}

/* w: pack_w4p's words; sT, zT: its fp32 [N64 / 64][K / gs][64]; K % gs == 0, gs % 64 == 0 (checked by the caller).
 * 0: done; -2: no scratch */
int it_linear_w4p(const bf16* x, int64_t ldx, const uint32_t* w, const float* sT, const float* zT, int64_t gs,
                  const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t sb = w4p_scratch_bytes(M, K), tb = bf16c_scratch_bytes(M, K), db = w4p_dec_bytes(M, N, K, nthreads);
    const int64_t head = ((sb > tb ? sb : tb) + 63) & ~(int64_t)63;
    char* scratch = aligned_alloc(64, (size_t)(head + db));
    if (!scratch) return -2;
    linear_w4p(x, ldx, w, sT, zT, gs, bias, y, ldy, M, N, K, nthreads, scratch, db ? (bf16*)(scratch + head) : NULL, 0);
    free(scratch);
    return 0;
}
