/* W8A16 on W8A8's packed weight (it_lin kind 5, IT_KIND_W8P): int8 weights with an fp32 scale per output feature,
 * kept in it_pack_w8a8's layout, times bf16 activations rounded to int16 per row exactly as linear_w8 rounds them
 * (act_i16.h quantize_rows_i16: s_x = max|x| / 32512, x_q = round_half_even(x / s_x), computed as x * (1 / s_x)).
 *
 * Why: linear_w8's one-row GEMV reads 4 weight rows of [N, K] side by side, 4 streams a thread, and on a Zen 5 read
 * 35-51 GB/s where W8A8's packed GEMM (one stream a thread) read 68-72 on the same bytes (BENCHMARKS.md). Here
 * W8A16 streams the packed weight as W8A8 does.
 *
 * x_q = 256 h + l with l = ((x_q + 128) & 255) - 128 and h = (x_q - l) / 256, both signed bytes (|x_q| <= 32512
 * keeps h <= 127); the packed weight holds q + 128 (VPDPBUSD's unsigned operand), so per output feature
 *   sum q x_q = 256 (sum (q + 128) h - 128 sum h) + (sum (q + 128) l - 128 sum l),
 * two VPDPBUSD a packed word a row (its h word and its l word broadcast), each lane's int32 sum exact (K <= I8_MAX_K),
 * and 256 H + L formed exactly in fp64, rounded once to fp32: the same fp32 value w8_block (gemv_quant.c) computes,
 * and the same epilogue, y = bf16(out * s_x * s_w + bias) in fp32, so the result is linear_w8's on [N, K] bit for bit
 * at the rows linear_w8 runs its int16 kernels (1-3 without AMX), and the same integer arithmetic at every other row
 * count (where linear_w8 rebuilds bf16 weights instead). One kernel for every M: the h and l bytes are rows of an int8
 * matrix, so W8A8's micro-kernel (gemm_i8.c i8_micro, W8P_MR rows x 64 features x (h, l) = 24 accumulators) and
 * driver (i8_drive) run them as they are.
 *
 * AVX-512 library only: AVX2 / NEON keep W8A16 on [N, K] (their int16 kernels widen the weight; no measurement says
 * this layout pays there). With AMX, prompts past 16 rows leave this arithmetic for the bf16 tile GEMM on the words
 * rebuilt in bf16 (w8p_tiles_take below). */
#define W8P_MR 3 /* rows of x a micro-kernel: W8A8's GEMM_MR int8 rows, h and l of each */
_Static_assert(2 * W8P_MR <= GEMM_MR, "i8_micro takes both bytes of W8P_MR rows");

/* scratch: the h and l bytes as rows 2m and 2m + 1 of one int8 matrix [2M, Kp], s_x [M], sum h and sum l [M] each,
 * then I8_ROW_PAD rows' bytes (the AMX tiles' reads past the last row) */
static inline int64_t w8p_scratch_bytes(int64_t M, int64_t K) {
    return ((2 * M + I8_ROW_PAD) * i8_kp(K) + M * 12 + 127) & ~(int64_t)63;
}

/* x [M, K] bf16 -> xhl [2M, Kp] (row 2m: x_m's h bytes, 2m + 1: its l bytes; zero past K), sx [M], hsum, lsum [M]:
 * quantize_rows_i16 then split_rows_i16, vectorised (the same fp32 operations: the max of |x|, max / 32512, its
 * reciprocal, x times it rounded half to even, clamped to +-32512) */
static void w8p_quantize_rows(const bf16* x, int64_t ldx, int64_t M, int64_t K, int nthreads, int8_t* xhl, float* sx,
                              int32_t* hsum, int32_t* lsum) {
    const int64_t Kp = i8_kp(K);
    const int nt = M >= 8 && M * K >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const bf16* xr = x + m * ldx;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(xr + k, mask16(K - k))));
        const float a = _mm512_reduce_max_ps(amax), s = a > 0.0f ? a / X_QMAX : 1.0f;
        sx[m] = s;
        const __m512 inv = _mm512_set1_ps(1.0f / s);
        const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
        __m512i hs = _mm512_setzero_si512(), ls = _mm512_setzero_si512();
        for (int64_t k = 0; k < Kp; k += 16) {
            const __m512i q = round_i16x16(xr + k, K - k > 0 ? mask16(K - k) : 0, inv); /* (none past K: zeros) */
            const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, c128), c255), c128);
            const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(q, l), 8); /* (exact: q - l is a multiple of 256) */
            hs = _mm512_add_epi32(hs, h);
            ls = _mm512_add_epi32(ls, l);
            _mm_storeu_si128((__m128i*)(xhl + 2 * m * Kp + k), _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128((__m128i*)(xhl + (2 * m + 1) * Kp + k), _mm512_cvtepi32_epi8(l));
        }
        hsum[m] = _mm512_reduce_add_epi32(hs);
        lsum[m] = _mm512_reduce_add_epi32(ls);
    }
}

/* 16 exact int32 lanes H and L -> fp32 (256 H + L), formed exactly in fp64 and rounded once */
static inline __m512 w8p_combine(__m512i H, __m512i L) {
    const __m512d c256 = _mm512_set1_pd(256.0);
    const __m256 lo = _mm512_cvtpd_ps(_mm512_fmadd_pd(c256, _mm512_cvtepi32_pd(_mm512_castsi512_si256(H)),
                                                      _mm512_cvtepi32_pd(_mm512_castsi512_si256(L))));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_fmadd_pd(c256, _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(H, 1)),
                                                      _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(L, 1))));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

typedef struct {
    const int8_t* xhl;
    const float* sx;
    const int32_t *hsum, *lsum;
    const float* scale;
    const bf16* bias;
    bf16* y;
    int64_t Kp, ldy;
    int stream; /* y past the caches (non-temporal stores; the tiles' path only: gemm_i8_amx.c) */
} w8p_job;

/* The rows' sums less 128 sum h / l, combined, y = bf16(out s_x s_w + bias) in fp32 (w8_block's epilogue); a row's
 * features at once (whole cache lines) */
static void w8p_store(const w8p_job* j, const int32_t* acc, int64_t m, int mr, int64_t n0, int nrows) {
    __mmask16 mk[4];
    __m512 sw[4], bv[4];
    const int nv = i8_block_consts(j->scale, j->bias, n0, nrows, mk, sw, bv);
    for (int i = 0; i < mr; i++) {
        const __m512i ch = _mm512_set1_epi32(128 * j->hsum[m + i]), cl = _mm512_set1_epi32(128 * j->lsum[m + i]);
        const __m512 s = _mm512_set1_ps(j->sx[m + i]);
        for (int v = 0; v < nv; v++) {
            const __m512i H = _mm512_sub_epi32(_mm512_load_si512(acc + i * 128 + 16 * v), ch);
            const __m512i L = _mm512_sub_epi32(_mm512_load_si512(acc + i * 128 + 64 + 16 * v), cl);
            const __m512 o = _mm512_mul_ps(_mm512_mul_ps(w8p_combine(H, L), s), sw[v]);
            i8_put16(j->y + (m + i) * j->ldy + n0 + 16 * v, mk[v], round_bf16x16_nan(_mm512_add_ps(o, bv[v])),
                     j->stream);
        }
    }
}

static void w8p_rows(const void* ctx, int64_t m, int mr, int64_t k0, const uint32_t* wp, int64_t nw, int32_t* acc,
                     int first, const gemm_pf* pf, int store, int64_t n0, int nrows) {
    const w8p_job* j = (const w8p_job*)ctx;
    /* W8A8's micro-kernel on 2 mr int8 rows: x_m's h and l sums land in acc's rows 2i and 2i + 1, [h 64 | l 64] */
    i8_micro_by_rows[2 * mr](j->xhl + 2 * m * j->Kp + k0, j->Kp, wp, nw, acc, first, pf);
    if (store) w8p_store(j, acc, m, mr, n0, nrows);
}

/* the AMX tiles' sums of int8 rows r0 .. r0 + rows - 1 (x_m's h and l: rows 2 m and 2 m + 1, acc [h 64 | l 64] a
 * row of x, as w8p_rows's) */
static void w8p_amx_rows(const void* ctx, const int32_t* acc, int64_t r0, int rows, int64_t n0, int nrows) {
    w8p_store((const w8p_job*)ctx, acc, r0 / 2, rows / 2, n0, nrows);
}

/* Prompts on AMX: past w8p_tile_rows rows (W8P_AMX_MIN_ROWS) of a weight of a multiple of 16 features (K a multiple of 32), the
 * 12-bit weights' tile GEMM (bf16c_gemm.c tiles_gemm) on the packed words rebuilt in bf16 a 64-feature chunk at a
 * time (w8p_group: bf16(q bf16(s)), it_dequant_w8's weights), so the products are linear_bf16's on the dequantized
 * weight, and a gate_up writes SiLU-and-multiply in the GEMM's epilogue, o_proj and down add into the residual there
 * (the fused step), as a 12-bit or a W4A16 weight does. Below those rows, and without AMX, the exact integer
 * arithmetic above. Measured: BENCHMARKS.md (2026-12-07, third session). */
/* Rows past which prompts take the tiles: on a Xeon with AMX (2026-12-07, the 386M model's prompts, one engine,
 * interleaved) a 128-token prompt ran 1.03x the int8 passes' time on the tiles (each chunk's rebuild shared by too
 * few rows), 256 tokens 0.96x, 512 0.86-0.92x, 16 x 128 0.86x */
#ifndef W8P_AMX_MIN_ROWS
#define W8P_AMX_MIN_ROWS 128
#endif
static int w8p_tiles_on = 1; /* (it_w8p_tiles, for tests and A/B runs) */
static int64_t w8p_tile_rows = W8P_AMX_MIN_ROWS; /* (it_w8p_tile_rows) */
int it_w8p_tiles(int on) {
    if (on >= 0) w8p_tiles_on = on != 0;
    return w8p_tiles_on;
}

/* Sets (rows > 0) and returns the rows past which W8A16 prompts take the tiles with AMX (tests, A/B runs) */
int64_t it_w8p_tile_rows(int64_t rows) {
    if (rows > 0) w8p_tile_rows = rows < 16 ? 16 : rows;
    return w8p_tile_rows;
}

static inline int w8p_tiles_take(int64_t M, int64_t N, int64_t K) {
    return w8p_tiles_on && amx_state == 1 && M > w8p_tile_rows && N % 16 == 0 && K % 32 == 0 && K <= I8_MAX_K;
}

/* Whether linear_w8p writes a gate_up's SiLU-and-multiply itself (silu = 1: gate and up tiles paired by the decoder,
 * tile_src.inter; no bias), or adds its product into y (silu = -1: a residual), given a dec buffer */
static inline int w8p_act_takes(int64_t M, int64_t N, int64_t K, const bf16* bias) {
    return w8p_tiles_take(M, N, K) && N % 64 == 0 && !bias;
}
static inline int w8p_add_takes(int64_t M, int64_t N, int64_t K) { return w8p_tiles_take(M, N, K); }

/* The tile path's dec buffer (bf16c_dec_bytes), and what it_linear_w8p allocates: scratch, then dec */
static inline int64_t w8p_dec_bytes(int64_t M, int64_t N, int64_t K, int nthreads) {
    return w8p_tiles_take(M, N, K) ? bf16c_dec_bytes(M, N, K, nthreads) : 0;
}

/* scratch: w8p_scratch_bytes(M, K) (and bf16c_scratch_bytes(M, K) where dec is given). 0: done; -1: K out of range
 * (the caller keeps torch's). dec: NULL, or bf16c_dec_bytes(M, N, K, nthreads) for the tiles; silu = 1 only where
 * w8p_act_takes (w a gate_up [2 I, K], y gets act [M, I]), -1 only where w8p_add_takes (y += the product, each
 * rounded to bf16 first, as add_rows adds it) */
static int linear_w8p(const bf16* x, int64_t ldx, const uint32_t* wpk, const float* scale, const bf16* bias, bf16* y,
                      int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads, void* scratch, bf16* dec, int silu) {
    if (K > I8_MAX_K || K < 1) return -1;
    if (dec && w8p_tiles_take(M, N, K)) {
        const tile_src c = {.K = K, .inter = silu > 0 ? N / 2 : 0, .N = N, .w8 = wpk, .s8 = scale};
        tiles_gemm(x, ldx, &c, silu > 0 ? NULL : bias, y, ldy, M, N, K, nthreads, (bf16*)scratch, dec, c.inter,
                   silu != 0, 0, 0, 0);
        return 0;
    }
    const int64_t Kp = i8_kp(K);
    int8_t* xhl = (int8_t*)scratch;
    float* sx = (float*)(xhl + 2 * M * Kp);
    int32_t* hsum = (int32_t*)(sx + M);
    int32_t* lsum = hsum + M;
    w8p_quantize_rows(x, ldx, M, K, nthreads, xhl, sx, hsum, lsum);
    const w8p_job job = {xhl, sx, hsum, lsum, scale, bias, y, Kp, ldy, i8a_stream(M, N, y, ldy)};
    if (i8_amx_takes())
        i8a_drive(xhl, 2 * M, Kp, wpk, N, nthreads, w8p_amx_rows, &job);
    else
        i8_drive(wpk, M, N, K, nthreads, W8P_MR, 128, w8p_rows, &job);
    return 0;
}

/* w: it_pack_w8a8's packed weight of int8 [N, K]; scale fp32 [N]; returns as linear_w8p, or -2 where the scratch
 * cannot be had */
int it_linear_w8p(const bf16* x, int64_t ldx, const uint32_t* w, const float* scale, const bf16* bias, bf16* y,
                  int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t sb = w8p_scratch_bytes(M, K), tb = bf16c_scratch_bytes(M, K), db = w8p_dec_bytes(M, N, K, nthreads);
    const int64_t head = ((sb > tb ? sb : tb) + 63) & ~(int64_t)63;
    char* scratch = aligned_alloc(64, (size_t)(head + db));
    if (!scratch) return -2;
    const int rc = linear_w8p(x, ldx, w, scale, bias, y, ldy, M, N, K, nthreads, scratch,
                              db ? (bf16*)(scratch + head) : NULL, 0);
    free(scratch);
    return rc;
}
