
/* Whether linear_w8 / linear_w4 take the AMX path for these shapes */
static inline int use_q_amx(int64_t M, int64_t N, int64_t K) {
    return amx_state == 1 && M >= AMX_MIN_ROWS && M <= 16 && K % 32 == 0 && N >= 16;
}

#include "act_i16.h" /* quantize_rows_i16, X_QMAX */

/* act_i16.h's quantize_rows_i16 on AVX-512, the same values bit for bit for finite x: the max of |x| (VMAXPS with x
 * first, so a NaN is skipped as the scalar compare skips it), s and 1 / s as there, x * (1 / s) rounded half to even
 * (VRNDSCALEPS), clamped (a NaN x to -32512, where the scalar loop's conversion of it is undefined), converted
 * exactly; each group's sum of x still added in column order (fp32), the groups
 * side by side for the adds' latency. Every linear rounds its rows first, on one thread, before its weights stream:
 * with this loop (and the splits below) a W4A16 batch-1 decode step took 0.96-0.99x the time of the scalar loops'
 * on an AMX Xeon (qkv, o_proj and down 0.95-0.98x: the rounding's share grows as N shrinks). */
/* 16 values of a row (mk: those to read, zeros past them) rounded to int16 by 1 / s_x = iv: x iv rounded half to
 * even, clamped to +-X_QMAX, in int32 lanes (exact) */
static inline __m512i round_i16x16(const bf16* p, __mmask16 mk, __m512 iv) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load_bf16x16(p, mk), iv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-X_QMAX)), _mm512_set1_ps(X_QMAX)));
}

static void quantize_rows_i16_512(const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int16_t* xq,
                                  float* sx, float* xsum, int64_t gs) {
    for (int64_t m = 0; m < M; m++) {
        const bf16* xr = x + m * ldx;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
            amax = _mm512_max_ps(_mm512_abs_ps(load_bf16x16(xr + k, mask16(K - k))), amax);
        const float a = _mm512_reduce_max_ps(amax), s = a > 0.0f ? a / X_QMAX : 1.0f, inv = 1.0f / s;
        sx[m] = s;
        const __m512 iv = _mm512_set1_ps(inv);
        int16_t* q = xq + m * Kp;
        for (int64_t k = 0; k < Kp; k += 16) /* (zeros past K) */
            _mm256_mask_storeu_epi16(q + k, Kp - k >= 16 ? (__mmask16)0xffff : mask16(Kp - k),
                                     _mm512_cvtepi32_epi16(round_i16x16(xr + k, k < K ? mask16(K - k) : 0, iv)));
        if (!xsum) continue;
        const int64_t G = K / gs;
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int ng = (int)(G - g0 < 8 ? G - g0 : 8);
            float t[8] = {0.0f};
            for (int64_t k = 0; k < gs; k++)
                for (int j = 0; j < ng; j++) t[j] += bf2f(xr[(g0 + j) * gs + k]);
            for (int j = 0; j < ng; j++) xsum[m * G + g0 + j] = t[j];
        }
    }
}

/* ------------------------------------------------------------------ 4 / 8-16 rows without AMX: dequantize, then bf16
 *
 * The int16-activation kernels below multiply a 64-column run of weights once per row of x, two VPDPBUSD per run a
 * row for W8A16 (the activation's two bytes), with per-row horizontal sums, and their 4 x 4 blocks' 32 accumulators
 * spill: on a Zen 4 a 16-row step's linears took 3x the bf16 GEMV's time (2.5x with 2-row passes, which do not
 * spill). So without AMX, from q_dq_rows rows to 16,
 * each thread rebuilds its block's NR weight rows in bf16 in its cache (w = bf16(q s) for int8, bf16(q s + z) in
 * fp32 for int4: exactly what it_dequant_w8 / _w4 and the PyTorch reference compute) and runs the bf16 GEMV's block
 * (bf16_block) on them for every row of x: the result is the bf16 GEMV on the dequantized weight bit for bit, the
 * AMX path's contract without its tiles, and the weights still stream from memory as int8 / int4. */
/* From how many rows (per kind) this pays over the int16-activation kernels: interleaved on a Zen 4, a decode step's
 * linears of the 386M model, W8A16 at 2 / 4 / 8 / 16 rows 0.80x / 1.29x / 1.63x / 2.06x, W4A16 0.55x / 0.84x / 1.17x /
 * 1.51x (its dequantization, q s + z, takes more work a weight). */
#ifndef QDQ_W8_ROWS
#define QDQ_W8_ROWS 4
#endif
#ifndef QDQ_W4_ROWS
#define QDQ_W4_ROWS 8
#endif
#ifndef QDQ_PF_BLOCKS
#define QDQ_PF_BLOCKS 2 /* the weight rows this many blocks on are asked into L2 */
#endif
static int64_t q_dq_rows[3] = {0, QDQ_W8_ROWS, QDQ_W4_ROWS}; /* by it_kind (it_q_dq_rows; 17: off, for A/B runs) */

static inline int use_q_dq(int64_t M, it_kind kind) {
    return amx_state != 1 && M >= q_dq_rows[kind] && M <= 16;
}

/* scratch: the AMX path's per-thread weight rows (q_amx_scratch_bytes(K, nthreads), aligned; NR rows a thread) */
static void linear_q_dq(const qweight* q, const bf16* x, int64_t ldx, const bf16* bias, bf16* y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int nthreads, void* scratch) {
    const int64_t nblocks = (N + NR - 1) / NR;
    const int nt = pick_threads(nblocks, q->kind == IT_KIND_W8 ? N * K : N * K / 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        bf16* wd = (bf16*)((char*)scratch + K * 32) + (int64_t)omp_get_thread_num() * 64 * K;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            if (b + QDQ_PF_BLOCKS < nblocks) { /* the weight rows a few blocks on, into L2, while these multiply */
                const int64_t rb = q->kind == IT_KIND_W8 ? K : K / 2; /* (a thread's blocks are consecutive) */
                const char* nx = (const char*)q->w + (n0 + QDQ_PF_BLOCKS * NR) * rb;
                for (int64_t o = 0; o < NR * rb; o += 64) _mm_prefetch(nx + o, _MM_HINT_T1);
            }
            dequant_rows(q, n0, nr, K, wd);
            bf16_rows_block(x, ldx, wd, nr, n0, M, K, bias, y, ldy);
        }
    }
}

/* ------------------------------------------------------------------ prompts without AMX: the GEMM on rebuilt slabs
 *
 * Past 16 rows a quantized layer used to be rebuilt whole in bf16 (it_dequant_w8 / _w4: N x K x 2 bytes written,
 * then read back by the GEMM) before each prompt's GEMM. Here gemm_dpbf16.c's GEMM takes its weight slabs from the
 * quantized rows instead: each thread rebuilds its 64 features x GEMM_KC columns in bf16 (the same rounding as
 * it_dequant_w8 / _w4) in a 64 KB buffer and repacks them as it repacks a bf16 slab, so the weights stream once as
 * int8 / int4 and the result is the GEMM's on the dequantized weight, bit for bit. Int4 needs the slabs to hold
 * whole groups (GEMM_KC % gs == 0). From gemm_rows_noamx rows (the bf16 GEMM's crossover); below it, and where the
 * GEMM cannot take the layer (K odd, int4 groups that straddle slabs), the per-block rebuild and the bf16 GEMV
 * (linear_q_dq), which needs only q_amx_scratch_bytes(K) of scratch at any row count (so the fused step's prompts
 * fit in the scratch it sizes for 16 rows). */
static void q_pack_slab(const void* ctx, int64_t K, int64_t n0, int nrows, int64_t k0, int64_t kc, uint32_t* wp,
                        bf16* tmp) {
    const qweight* q = (const qweight*)ctx;
    for (int r = 0; r < nrows; r++) {
        const int64_t n = n0 + r;
        if (q->kind == IT_KIND_W8) {
            dequant_w8_row_fast((const int8_t*)q->w + n * K + k0, w8_scale(q->scale, q->scale_is_f32, n),
                                tmp + r * GEMM_KC, kc);
        } else {
            const int64_t g0 = n * (K / q->gs) + k0 / q->gs; /* (the slab holds whole groups) */
            dequant_w4_row_fast((const uint8_t*)q->w + n * (K / 2) + k0 / 2, (const float*)q->scale + g0, q->zero + g0,
                                q->gs, tmp + r * GEMM_KC, kc);
        }
    }
    gemm_pack_slab(tmp, GEMM_KC, 0, nrows, 0, kc, wp);
}

static inline int use_q_gemm(int64_t M, int64_t K, const qweight* q) {
    return amx_state != 1 && gemm_noamx_takes(M, K) && (q->kind == IT_KIND_W8 || GEMM_KC % q->gs == 0);
}

static void linear_q_gemm(const qweight* q, const bf16* x, int64_t ldx, const bf16* bias, bf16* y, int64_t ldy,
                          int64_t M, int64_t N, int64_t K, int nthreads) {
    const gemm_src src = {(const char*)q->w, q->kind == IT_KIND_W8 ? 2 : 1, q_pack_slab, q};
    dpbf16_gemm(x, ldx, &src, bias, y, ldy, M, N, K, nthreads);
}

/* Rows past 16 without AMX (prompts, the fused step's too) */
static inline int q_prompt_rows(int64_t M) { return M > 16 && amx_state != 1; }

/* linear_w8 / linear_w4 at q_prompt_rows: the GEMM on rebuilt slabs, else the per-block rebuild, whose scratch
 * (q_amx_scratch_bytes) is all it needs. 0: not such a call. */
static int linear_q_prompt(const qweight* q, const bf16* x, int64_t ldx, const bf16* bias, bf16* y, int64_t ldy,
                           int64_t M, int64_t N, int64_t K, int nthreads, void* scratch) {
    if (!q_prompt_rows(M)) return 0;
    if (use_q_gemm(M, K, q))
        linear_q_gemm(q, x, ldx, bias, y, ldy, M, N, K, nthreads);
    else
        linear_q_dq(q, x, ldx, bias, y, ldy, M, N, K, nthreads, scratch); /* (any M) */
    return 1;
}

/* ------------------------------------------------------------------ int8 weights, int16 activations */

/* x_q = 256 h + l with l = ((x_q + 128) & 255) - 128 and h = (x_q - l) / 256, both signed bytes (|x_q| <= 32512
 * keeps h <= 127, see quantize_rows_i16). The weight goes in as the unsigned operand of VPDPBUSD, flipped to
 * q + 128 with one XOR, 64 columns per instruction:
 *   sum q x_q = 256 (sum (q + 128) h - 128 sum h) + (sum (q + 128) l - 128 sum l)
 * Lanes sum 4 products of at most 255 * 128 per instruction, so int32 holds any K below ~4M. */
/* (the weight vectors of rows past nr are never loaded nor used: GCC cannot see that through the j < nr tests) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void w8_block(
    const int8_t* xh, const int8_t* xl, int64_t Kp, const int32_t* hsum, const int32_t* lsum, int mr,
    const int8_t* w, int nr, int64_t K, float out[MR][NR]) {
    __m512i ah[MR][NR], al[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) ah[i][j] = al[i][j] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int64_t far = pf_far_offset(NR * K);
    for (int64_t k = 0; k < K; k += 64) {
        const int64_t left = K - k;
        const __mmask64 m = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        __m512i wv[NR];
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                pf_weights(w + j * K + k, far, PF_BYTES / 2);
                /* past K: q = 0 -> 128, against x = 0 (padded): no contribution */
                wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + j * K + k), flip);
            }
        }
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                const __m512i hv = _mm512_loadu_si512(xh + i * Kp + k), lv = _mm512_loadu_si512(xl + i * Kp + k);
                for (int j = 0; j < NR; j++) {
                    if (j < nr) {
                        /* (gemm_i8.c's asm VPDPBUSD: through the intrinsic GCC 12 loaded each accumulator from
                           the stack and stored it back twice at every step, 3 memory ops a product) */
                        ah[i][j] = dpbusd(ah[i][j], wv[j], hv);
                        al[i][j] = dpbusd(al[i][j], wv[j], lv);
                    }
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++)
            if (i < mr && j < nr) {
                const double h = (double)_mm512_reduce_add_epi32(ah[i][j]) - 128.0 * hsum[i];
                const double l = (double)_mm512_reduce_add_epi32(al[i][j]) - 128.0 * lsum[i];
                out[i][j] = (float)(256.0 * h + l); /* the exact integer sum, rounded once */
            }
}
#pragma GCC diagnostic pop

/* x_q (int16 rows, padded to Kp) -> the signed bytes h and l of each value and their row sums */
/* (32 values a step: l = the low byte sign-extended, h = (x_q - l) >> 8 exactly, in 16-bit lanes; the sums in int32) */
static inline void split32_i16(__m512i v, __m512i* h, __m512i* l) {
    *l = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
    *h = _mm512_srai_epi16(_mm512_sub_epi16(v, *l), 8);
}

static void split_rows_i16(const int16_t* xq, int64_t M, int64_t Kp, int8_t* xh, int8_t* xl, int32_t* hsum,
                           int32_t* lsum) {
    const __m512i ones = _mm512_set1_epi16(1);
    for (int64_t m = 0; m < M; m++) {
        __m512i hs = _mm512_setzero_si512(), ls = _mm512_setzero_si512();
        for (int64_t k = 0; k < Kp; k += 32) {
            const __mmask32 mk = mask32(Kp - k);
            __m512i h, l;
            split32_i16(_mm512_maskz_loadu_epi16(mk, xq + m * Kp + k), &h, &l);
            _mm256_mask_storeu_epi8(xh + m * Kp + k, mk, _mm512_cvtepi16_epi8(h));
            _mm256_mask_storeu_epi8(xl + m * Kp + k, mk, _mm512_cvtepi16_epi8(l));
            hs = _mm512_add_epi32(hs, _mm512_madd_epi16(h, ones));
            ls = _mm512_add_epi32(ls, _mm512_madd_epi16(l, ones));
        }
        hsum[m] = _mm512_reduce_add_epi32(hs);
        lsum[m] = _mm512_reduce_add_epi32(ls);
    }
}

#define W8_CASE(MRC, NRC) w8_block(xh + m0 * Kp, xl + m0 * Kp, Kp, hsum + m0, lsum + m0, MRC, wb, NRC, K, out)

/* int16 activations [M, Kp] (Kp = K rounded up to 64), their scales [M], (int4) group sums [M, K / 32 at most],
 * (int8) the activations' signed high and low bytes [M, Kp] each and their row sums [M] each */
static inline int64_t w8_scratch_bytes(int64_t M, int64_t K) {
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    return (M * Kp * 2 + M * 4 + M * (K / 32 + 1) * 4 + M * Kp * 2 + M * 8 + 255) & ~(int64_t)63;
}

/* linear_w8 / linear_w4: the VNNI path's scratch, then the AMX path's */
static inline int64_t qlin_scratch_bytes(int64_t M, int64_t K, int nthreads) {
    return w8_scratch_bytes(M, K) + q_amx_scratch_bytes(K, nthreads);
}

/* The scratch it_linear_w8 / _w4 allocate for linear_w8 / linear_w4 (free() it after): none where the GEMM on rebuilt
 * slabs takes the call, the per-block rebuild's for other prompt rows without AMX, else qlin_scratch_bytes */
static void* q_api_scratch(const qweight* q, int64_t M, int64_t K, int nthreads) {
    if (amx_state == 1 && M >= AMX_GEMM_MIN_ROWS) { /* (linear_q_amx_big's, or where K does not fit it, the rest's) */
        const int64_t a = q_amx_gemm_scratch_bytes(M, K, nthreads), b = qlin_scratch_bytes(M, K, nthreads);
        return aligned_alloc(64, (size_t)(a > b ? a : b));
    }
    const int prompt = q_prompt_rows(M);
    if (prompt && use_q_gemm(M, K, q)) return NULL;
    return aligned_alloc(64, (size_t)(prompt ? q_amx_scratch_bytes(K, nthreads) : qlin_scratch_bytes(M, K, nthreads)));
}

/* scale: per output row, bf16 (scale_is_f32 = 0) or fp32 (1). scratch: qlin_scratch_bytes(M, K, nthreads). */
static void linear_w8(const bf16* x, int64_t ldx, const int8_t* w, const void* scale, int scale_is_f32,
                      const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch) {
    if (q_amx_gemm_takes(M, N, K)) { /* (prompts on AMX; scratch: q_amx_gemm_scratch_bytes) */
        const qweight q = {IT_KIND_W8, w, scale, scale_is_f32, NULL, 0};
        linear_q_amx_big(&q, x, ldx, bias, y, ldy, M, N, K, nthreads, scratch);
        return;
    }
    if (use_q_amx(M, N, K)) {
        const qweight q = {IT_KIND_W8, w, scale, scale_is_f32, NULL, 0};
        const int64_t n16 = N & ~(int64_t)15;
        linear_q_amx(&q, x, ldx, bias, y, ldy, M, n16, K, nthreads, (char*)scratch + w8_scratch_bytes(M, K));
        if (n16 == N) return;
        w += n16 * K; /* the last N % 16 features: the VNNI path below */
        scale = (const char*)scale + n16 * (scale_is_f32 ? 4 : 2);
        bias = bias ? bias + n16 : NULL;
        y += n16;
        N -= n16;
    }
    if (use_q_dq(M, IT_KIND_W8)) {
        const qweight q = {IT_KIND_W8, w, scale, scale_is_f32, NULL, 0};
        linear_q_dq(&q, x, ldx, bias, y, ldy, M, N, K, nthreads, (char*)scratch + w8_scratch_bytes(M, K));
        return;
    }
    {
        const qweight q = {IT_KIND_W8, w, scale, scale_is_f32, NULL, 0};
        if (linear_q_prompt(&q, x, ldx, bias, y, ldy, M, N, K, nthreads, scratch)) return;
    }
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    int8_t* xh = (int8_t*)(sx + M + M * (K / 32 + 1));
    int8_t* xl = xh + M * Kp;
    int32_t* hsum = (int32_t*)(xl + M * Kp);
    int32_t* lsum = hsum + M;
    quantize_rows_i16_512(x, ldx, M, K, Kp, xq, sx, NULL, 1);
    split_rows_i16(xq, M, Kp, xh, xl, hsum, lsum);
    const int64_t nblocks = (N + NR - 1) / NR;
    const int nt = pick_threads(nblocks, N * K, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const int8_t* wb = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            float out[MR][NR];
            DISPATCH_BLOCK(W8_CASE)
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
    const qweight q = {IT_KIND_W8, w, scale, scale_is_f32, NULL, 0};
    void* scratch = q_api_scratch(&q, M, K, nthreads);
    linear_w8(x, ldx, w, scale, scale_is_f32, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}

/* For tests: the activations' rounding by act_i16.h's portable loop (impl 0) or this library's (1), and the splits
 * of x_q into signed bytes (split_rows_i16: rows of Kp; w4b_split_row: one row in the int4 nibbles' order) */
void it_quantize_rows_i16(const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int16_t* xq, float* sx,
                          float* xsum, int64_t gs, int impl) {
    if (impl)
        quantize_rows_i16_512(x, ldx, M, K, Kp, xq, sx, xsum, gs);
    else
        quantize_rows_i16(x, ldx, M, K, Kp, xq, sx, xsum, gs);
}

void it_split_rows_i16(const int16_t* xq, int64_t M, int64_t Kp, int8_t* xh, int8_t* xl, int32_t* hsum,
                       int32_t* lsum) {
    split_rows_i16(xq, M, Kp, xh, xl, hsum, lsum);
}

/* ------------------------------------------------------------------ int4 weights, int16 activations
 *
 * Layout (kernels/cpu.py pack_w4): row n of W is K / 2 bytes; in each run of 64 columns starting at k0, byte
 * b (0..31) holds column k0 + b in its low nibble and k0 + 32 + b in its high nibble, so one 32-byte load
 * widens to 32 int16 whose low and high nibbles are columns k0 .. k0 + 31 and k0 + 32 .. k0 + 63. Values q in
 * 0..15 with, per row and group of gs columns (gs a multiple of 64), w = q * scale + zero (fp32 [N, K / gs]).
 */
/* sum_g zero_g * (sum of x over g), with the exact sums of x: 16 groups a vector, then one sum across the lanes. As a
 * scalar loop (z += zero_g xsum_g, group by group) it was one chain of G dependent adds after each block (GCC kept
 * their order), about as long as the block's own work at K = 4864 (38 groups), and the next block's work did not fit
 * under it: w4b_block on weights in L2 took 1.10x (K = 896) / 1.20x (K = 4864) the time (docs/kernels.md). The order
 * differs from group by group in the last bits, inside the fp32-sum term of the error bound tests/test_kernels.py
 * holds linear_w4 to. */
static inline float zero_dot(const float* zero, const float* xsum, int64_t G) {
    __m512 z = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 m = mask16(G - g);
        z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, zero + g), _mm512_maskz_loadu_ps(m, xsum + g), z);
    }
    return _mm512_reduce_add_ps(z);
}

/* (the weight vectors of rows past nr are never loaded nor used: GCC cannot see that through the j < nr tests) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void w4_block(
    const int16_t* xq, int64_t Kp, const float* xsum, int mr, const uint8_t* w, int nr, int64_t K, int64_t gs,
    const float* scale, const float* zero, float out[MR][NR], float zout[MR][NR]) {
    const int64_t G = K / gs;
    __m512 accf[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) accf[i][j] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi16(0x0f);
    const int64_t far = pf_far_offset(NR * (K / 2));
    for (int64_t g = 0; g < G; g++) {
        __m512i acc[MR][NR];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 64) {
            __m512i wlo[NR], whi[NR];
            for (int j = 0; j < NR; j++) {
                if (j < nr) {
                    const uint8_t* p = w + j * (K / 2) + k / 2;
                    pf_weights(p, far, PF_BYTES);
                    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
                    wlo[j] = _mm512_and_si512(b, lo4);  /* columns k .. k + 31 */
                    whi[j] = _mm512_srli_epi16(b, 4);   /* columns k + 32 .. k + 63 */
                }
            }
            for (int i = 0; i < MR; i++) {
                if (i < mr) {
                    const __m512i xlo = _mm512_loadu_si512(xq + i * Kp + k);
                    const __m512i xhi = _mm512_loadu_si512(xq + i * Kp + k + 32);
                    for (int j = 0; j < NR; j++)
                        if (j < nr) acc[i][j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[i][j], wlo[j], xlo), whi[j], xhi);
                }
            }
        }
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                const __m512 sv = _mm512_set1_ps(scale[j * G + g]);
                for (int i = 0; i < MR; i++)
                    if (i < mr) accf[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), sv, accf[i][j]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++)
            if (i < mr && j < nr) {
                float z = 0.0f; /* sum_g zero_g * (sum of x over g), with the exact sums of x */
                for (int64_t g = 0; g < G; g++) z += zero[j * G + g] * xsum[i * G + g];
                out[i][j] = _mm512_reduce_add_ps(accf[i][j]);
                zout[i][j] = z;
            }
}
#pragma GCC diagnostic pop

#define W4_CASE(MRC, NRC) w4_block(xq + m0 * Kp, Kp, xsum + m0 * G, MRC, wb, NRC, K, gs, scale + n0 * G, \
                                   zero + n0 * G, out, zout)

/* ------------------------------------------------------------------ int4 weights at one row: the nibbles as bytes
 *
 * With gs a multiple of 128, one 64-byte load holds 128 weights: its low nibbles are columns k .. k + 31 and
 * k + 64 .. k + 95, its high nibbles k + 32 .. k + 63 and k + 96 .. k + 127 (pack_w4's runs of 64, two of them).
 * Masked to bytes they are the unsigned operand of VPDPBUSD as they are (0..15: no flip, no widening), against
 * the signed high and low bytes of the int16 activations (x_q = 256 h + l, as w8_block), which w4b_split_row lays
 * out per 128 columns in the nibbles' order. Per 128 weights: one load, three byte ops and four VPDPBUSD, against
 * two widening loads, four ops and four VPDPWSSD in w4_block; the per-group int32 sums 256 H + L are exact and
 * the same integers w4_block sums, so the error bound is the same. Decode rows beyond W4B_MAX_ROWS keep w4_block,
 * which widens each weight once for all its rows. */
#ifndef W4B_MAX_ROWS
#define W4B_MAX_ROWS 1
#endif

/* x_q (int16 [K], K % 128 == 0) -> h and l bytes [K] each, per 128 columns: [A (64) | B (64)], where A pairs with the
 * low nibbles (columns 0..31, 64..95 of the 128) and B with the high ones (32..63, 96..127) */
static void w4b_split_row(const int16_t* xq, int64_t K, int8_t* xh, int8_t* xl) {
    static const int src[4] = {0, 64, 32, 96}; /* where each 32-byte quarter of [A | B] comes from */
    for (int64_t k = 0; k < K; k += 128)
        for (int part = 0; part < 4; part++) {
            __m512i h, l;
            split32_i16(_mm512_loadu_si512(xq + k + src[part]), &h, &l);
            _mm256_storeu_si256((__m256i*)(xh + k + part * 32), _mm512_cvtepi16_epi8(h));
            _mm256_storeu_si256((__m256i*)(xl + k + part * 32), _mm512_cvtepi16_epi8(l));
        }
}

void it_w4b_split_row(const int16_t* xq, int64_t K, int8_t* xh, int8_t* xl) { w4b_split_row(xq, K, xh, xl); }

/* (the weight vectors of rows past nr are never loaded nor used: GCC cannot see that through the j < nr tests) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void w4b_block(const int8_t* xh, const int8_t* xl, const float* xsum,
                                                            const uint8_t* w, int nr, int64_t K, int64_t gs,
                                                            const float* scale, const float* zero, float out[NR],
                                                            float zout[NR]) {
    const int64_t G = K / gs, far = pf_far_offset(NR * (K / 2));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 accf[NR];
    for (int j = 0; j < NR; j++) accf[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i ah[NR], al[NR];
        for (int j = 0; j < NR; j++) ah[j] = al[j] = _mm512_setzero_si512();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 128) {
            const __m512i xah = _mm512_loadu_si512(xh + k), xbh = _mm512_loadu_si512(xh + k + 64);
            const __m512i xal = _mm512_loadu_si512(xl + k), xbl = _mm512_loadu_si512(xl + k + 64);
            for (int j = 0; j < NR; j++) {
                if (j < nr) {
                    const uint8_t* p = w + j * (K / 2) + k / 2;
                    pf_weights(p, far, PF_BYTES);
                    const __m512i b = _mm512_loadu_si512(p);
                    const __m512i lo = _mm512_and_si512(b, m4), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
                    ah[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ah[j], lo, xah), hi, xbh);
                    al[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(al[j], lo, xal), hi, xbl);
                }
            }
        }
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(ah[j], 8), al[j]); /* 256 H + L, exact */
                accf[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(scale[j * G + g]), accf[j]);
            }
        }
    }
    for (int j = 0; j < nr; j++) {
        out[j] = _mm512_reduce_add_ps(accf[j]);
        zout[j] = zero_dot(zero + j * G, xsum, G);
    }
}
#pragma GCC diagnostic pop

/* linear_w4 for M <= W4B_MAX_ROWS rows, gs % 128 == 0; xq / sx / xsum as quantize_rows_i16 left them, xh / xl
 * scratch of M * K bytes each */
static void linear_w4b(const int16_t* xq, int64_t Kp, const float* sx, const float* xsum, int8_t* xh, int8_t* xl,
                       const uint8_t* w, const float* scale, const float* zero, int64_t gs, const bf16* bias, bf16* y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t G = K / gs, nblocks = (N + NR - 1) / NR;
    for (int64_t m = 0; m < M; m++) w4b_split_row(xq + m * Kp, K, xh + m * K, xl + m * K);
    const int nt = pick_threads(nblocks, N * K / 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        for (int64_t m = 0; m < M; m++) {
            float out[NR], zout[NR];
            if (nr == NR)
                w4b_block(xh + m * K, xl + m * K, xsum + m * G, w + n0 * (K / 2), NR, K, gs, scale + n0 * G,
                          zero + n0 * G, out, zout);
            else
                w4b_block(xh + m * K, xl + m * K, xsum + m * G, w + n0 * (K / 2), nr, K, gs, scale + n0 * G,
                          zero + n0 * G, out, zout);
            for (int j = 0; j < nr; j++)
                y[m * ldy + n0 + j] = f2bf(out[j] * sx[m] + zout[j] + (bias ? bf2f(bias[n0 + j]) : 0.0f));
        }
    }
}

/* With AMX, W4A16 on pack_w4's rows multiplies 2-16 rows on the bf16 tiles, each 64 features' rows rebuilt in bf16
 * first (linear_q_amx), from this many rows; below it w4_block's int16 products: the fused W4A16 decode step took
 * 0.60x / 0.85x the time at 2 / 4 requests with them, 1.12x / 1.48x at 6 / 8 (docs/kernels.md) */
#ifndef W4_AMX_MIN_ROWS
#define W4_AMX_MIN_ROWS 5
#endif
static int64_t w4_amx_rows = W4_AMX_MIN_ROWS; /* (it_w4_amx_rows, for tests and A/B runs) */
/* W4A16 prompts on AMX through linear_w4_tiles (1), or linear_q_amx_big's 2 x 2 blocks (0): it_w4_tiles, for tests
 * and A/B runs */
static int w4_tiles_on = 1;
int it_w4_tiles(int on) {
    if (on >= 0) w4_tiles_on = on != 0;
    return w4_tiles_on;
}

/* Sets (rows > 0) and returns the rows from which W4A16 on pack_w4's rows takes the tiles with AMX (up to 16) */
int64_t it_w4_amx_rows(int64_t rows) {
    if (rows > 0) w4_amx_rows = rows;
    return w4_amx_rows;
}

/* Prompts on AMX with a dec buffer (bf16c_dec_bytes(M, N & ~15, K, nthreads)): the 12-bit weights' tile GEMM
 * (bf16c_gemm.c tiles_gemm: each 64-feature chunk rebuilt into its VNNI tiles between the tile products, steps to
 * whichever thread is free) on the rows rebuilt 16 features x 32 columns at a time (w4r_tile), the last N % 16
 * features as linear_q_amx_big does them: linear_bf16 on the dequantized weight, bit for bit. scratch:
 * q_amx_gemm_scratch_bytes(M, K, nthreads) (its first 32 x K: the zero-padded last row tile, then the tail's rows). */
static void linear_w4_tiles(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero,
                            int64_t gs, const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                            int nthreads, void* scratch, bf16* dec, int silu) {
    const int64_t n16 = N & ~(int64_t)15, tail = N - n16;
    if (silu > 0) { /* (w4_act_takes: a gate_up [2 I, K], I % 32 == 0, no bias; y gets act [M, I]) */
        const tile_src src = {.gs = gs, .K = K, .inter = N / 2, .w4r = w, .sr = scale, .zr = zero, .N = N};
        tiles_gemm(x, ldx, &src, NULL, y, ldy, M, N, K, nthreads, (bf16*)scratch, dec, N / 2, 1, 0, 0, 0);
        return;
    }
    if (silu < 0) { /* (w4_add_takes: N % 16 == 0; y += x W^T (+ bias), each product rounded first: a residual) */
        const tile_src src = {.gs = gs, .K = K, .w4r = w, .sr = scale, .zr = zero, .N = N};
        tiles_gemm(x, ldx, &src, bias, y, ldy, M, N, K, nthreads, (bf16*)scratch, dec, 0, 1, 0, 0, 0);
        return;
    }
    const tile_src src = {.gs = gs, .K = K, .w4r = w, .sr = scale, .zr = zero, .N = n16};
    tiles_gemm(x, ldx, &src, bias, y, ldy, M, n16, K, nthreads, (bf16*)scratch, dec, 0, 0, 0, 0, 0);
    if (tail) {
        const qweight q = {IT_KIND_W4, w, scale, 0, zero, gs};
        bf16* wt = (bf16*)scratch + 16 * K;
        dequant_rows(&q, n16, tail, K, wt);
        linear_bf16_avx512(x, ldx, wt, bias ? bias + n16 : NULL, y + n16, ldy, M, tail, K, nthreads);
    }
}

/* Whether linear_w4 adds its product into y itself (silu = -1: the tile GEMM's epilogue, as a 12-bit o_proj / down's
 * residual add), given a dec buffer */
static inline int w4_add_takes(int64_t M, int64_t N, int64_t K) {
    return q_amx_gemm_takes(M, N, K) && w4_tiles_on && N % 16 == 0;
}

/* Whether linear_w4 writes a gate_up's SiLU-and-multiply itself (silu = 1: the tile GEMM's epilogue on gate and up
 * tiles paired by the decoder, tile_src.inter, as a 12-bit gate_up's), given a dec buffer */
static inline int w4_act_takes(int64_t M, int64_t N, int64_t K, const bf16* bias) {
    return q_amx_gemm_takes(M, N, K) && w4_tiles_on && N % 64 == 0 && !bias;
}

/* scratch: qlin_scratch_bytes(M, K, nthreads), aligned (past 16 rows on AMX: q_amx_gemm_scratch_bytes). dec: NULL,
 * or (prompts on AMX) bf16c_dec_bytes(M, N & ~15, K, nthreads) for linear_w4_tiles; silu = 1 only where
 * w4_act_takes and dec is given: w is a gate_up [2 I, K] and y gets act [M, I]; silu = -1 only where w4_add_takes and
 * dec is given: y += the product (each rounded to bf16 first, as add_rows adds it) */
static void linear_w4(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero, int64_t gs,
                      const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch, bf16* dec, int silu) {
    if (q_amx_gemm_takes(M, N, K)) { /* (prompts on AMX; scratch: q_amx_gemm_scratch_bytes) */
        if (dec && w4_tiles_on) {
            linear_w4_tiles(x, ldx, w, scale, zero, gs, bias, y, ldy, M, N, K, nthreads, scratch, dec, silu);
            return;
        }
        const qweight q = {IT_KIND_W4, w, scale, 0, zero, gs};
        linear_q_amx_big(&q, x, ldx, bias, y, ldy, M, N, K, nthreads, scratch);
        return;
    }
    if (use_q_amx(M, N, K) && M >= w4_amx_rows) {
        const qweight q = {IT_KIND_W4, w, scale, 0, zero, gs};
        const int64_t n16 = N & ~(int64_t)15;
        linear_q_amx(&q, x, ldx, bias, y, ldy, M, n16, K, nthreads, (char*)scratch + w8_scratch_bytes(M, K));
        if (n16 == N) return;
        w += n16 * (K / 2); /* the last N % 16 features: the VNNI path below */
        scale += n16 * (K / gs);
        zero += n16 * (K / gs);
        bias = bias ? bias + n16 : NULL;
        y += n16;
        N -= n16;
    }
    if (use_q_dq(M, IT_KIND_W4)) {
        const qweight q = {IT_KIND_W4, w, scale, 0, zero, gs};
        linear_q_dq(&q, x, ldx, bias, y, ldy, M, N, K, nthreads, (char*)scratch + w8_scratch_bytes(M, K));
        return;
    }
    {
        const qweight q = {IT_KIND_W4, w, scale, 0, zero, gs};
        if (linear_q_prompt(&q, x, ldx, bias, y, ldy, M, N, K, nthreads, scratch)) return;
    }
    const int64_t Kp = (K + 31) & ~(int64_t)31, G = K / gs;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    float* xsum = sx + M;
    quantize_rows_i16_512(x, ldx, M, K, Kp, xq, sx, xsum, gs);
    if (M <= W4B_MAX_ROWS && gs % 128 == 0) {
        int8_t* xh = (int8_t*)(xsum + M * (K / 32 + 1)); /* (w8_scratch_bytes' h and l bytes: M * Kp each) */
        linear_w4b(xq, Kp, sx, xsum, xh, xh + M * K, w, scale, zero, gs, bias, y, ldy, M, N, K, nthreads);
        return;
    }
    const int64_t nblocks = (N + NR - 1) / NR;
    const int nt = pick_threads(nblocks, N * K / 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const uint8_t* wb = w + n0 * (K / 2);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            float out[MR][NR], zout[MR][NR];
            DISPATCH_BLOCK(W4_CASE)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    const int64_t n = n0 + j;
                    y[(m0 + i) * ldy + n] = f2bf(out[i][j] * sx[m0 + i] + zout[i][j] + (bias ? bf2f(bias[n]) : 0.0f));
                }
        }
    }
}

/* K % gs == 0, gs % 64 == 0 (checked by the caller) */
void it_linear_w4(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero, int64_t gs,
                  const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const qweight q = {IT_KIND_W4, w, scale, 0, zero, gs};
    void* scratch = q_api_scratch(&q, M, K, nthreads);
    const int64_t db = q_amx_gemm_takes(M, N, K) ? bf16c_dec_bytes(M, N & ~(int64_t)15, K, nthreads) : 0;
    bf16* dec = db ? (bf16*)aligned_alloc(64, (size_t)((db + 63) & ~(int64_t)63)) : NULL;
    linear_w4(x, ldx, w, scale, zero, gs, bias, y, ldy, M, N, K, nthreads, scratch, dec, 0);
    free(dec);
    free(scratch);
}

/* ------------------------------------------------------------------ dense weights for prefills
 *
 * Past 16 rows torch's GEMM (oneDNN / AMX) beats the kernels above, so a quantized layer's prefill multiplies a
 * bf16 copy of its weights, rebuilt here per call, in parallel and in one pass: w = bf16(q * s) for int8 (as the
 * PyTorch reference rounds it), w = bf16(q * s + z) in fp32 for int4.
 */
void it_dequant_w8(const int8_t* q, const void* scale, int scale_is_f32, bf16* out, int64_t N, int64_t K,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) dequant_w8_row_fast(q + n * K, w8_scale(scale, scale_is_f32, n), out + n * K, K);
}

void it_dequant_w4(const uint8_t* packed, const float* scale, const float* zero, int64_t gs, bf16* out, int64_t N,
                   int64_t K, int nthreads) {
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++)
        dequant_w4_row_fast(packed + n * (K / 2), scale + n * G, zero + n * G, gs, out + n * K, K);
}

/* Sets (rows > 0) and returns the rows from which W8A16 (kind 1) / W4A16 (kind 2) without AMX dequantize a block at a
 * time and run the bf16 GEMV (q_dq_rows; up to 16 rows; 17 or more: the int16-activation kernels at every row count) */
int64_t it_q_dq_rows(int64_t kind, int64_t rows) {
    if (kind != IT_KIND_W8 && kind != IT_KIND_W4) return -1;
    if (rows > 0) q_dq_rows[kind] = rows;
    return q_dq_rows[kind];
}
