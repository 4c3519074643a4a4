/* ------------------------------------------------------------------ quantized weights at 2-16 rows on AMX
 *
 * At several rows the int16 VNNI kernels below become compute-bound. Where the CPU has AMX, each thread instead
 * rebuilds 64 rows of the weight in bf16 in its own L2-sized buffer (the prefill's rounding: dequant_w8_row /
 * dequant_w4_row) and multiplies them on the tiles like a bf16 weight; the weight bytes still stream once.
 */
typedef struct {
    int kind; /* 1: int8, 2: int4 (it_lin's kinds) */
    const void* w;
    const void* scale;
    int scale_is_f32;
    const float* zero;
    int64_t gs;
} qweight;

static inline int64_t q_amx_scratch_bytes(int64_t K, int nthreads) {
    return (K * 32 + (int64_t)(nthreads > 0 ? nthreads : 1) * 64 * K * 2 + 127) & ~(int64_t)63;
}

#ifndef W4_REBUILD_AHEAD_ROWS
#define W4_REBUILD_AHEAD_ROWS 8
#endif
static inline void dequant_rows(const qweight* q, int64_t n0, int64_t rows, int64_t K, bf16* out) {
    for (int64_t r = 0; r < rows; r++) { /* (the exact rounding, 32 values an instruction where none can be denormal) */
        const int64_t n = n0 + r;
        /* the int4 row W4_REBUILD_AHEAD_ROWS rows on, into L2, a line as the rebuild reaches each (past the last row:
           a prefetch never faults): at 8 / 16 requests with AMX (linear_q_amx) the fused W4A16 decode step took
           0.93x / 0.96x the time (32 rows on: level), where `perf` had put half of linear_q_amx's samples on the
           rebuild's loads of the weight; spread along the row instead of a burst at its start, the 16-row linears of
           a step 1.1x faster again (docs/kernels.md) */
        if (q->kind == IT_KIND_W8)
            dequant_w8_row_fast((const int8_t*)q->w + n * K, w8_scale(q->scale, q->scale_is_f32, n), out + r * K, K);
        else
            dequant_w4_row_ahead((const uint8_t*)q->w + n * (K / 2), (const float*)q->scale + n * (K / q->gs),
                                 q->zero + n * (K / q->gs), q->gs, out + r * K, K, W4_REBUILD_AHEAD_ROWS * (K / 2));
    }
}

/* M <= 16, K % 32 == 0, N16 a multiple of 16; scratch: q_amx_scratch_bytes(K, nthreads), aligned */
__attribute__((target("amx-tile,amx-bf16")))
static void linear_q_amx(const qweight* q, const bf16* x, int64_t ldx, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N16, int64_t K, int nthreads, void* scratch) {
    bf16* xt = (bf16*)scratch;
    bf16* bufs = xt + K * 16;
    const int mr = (int)M;
    transpose_rows_amx(x, ldx, mr, K, xt);
    const int64_t nchunks = (N16 / 16 + 3) / 4;
    const int nt = pick_threads(nchunks, N16 * K, nthreads);
#pragma omp parallel num_threads(nt)
    {
        bf16* buf = bufs + (int64_t)omp_get_thread_num() * 64 * K;
        amx_configure(7);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            const int64_t n0 = c * 64;
            const int nblk = chunk_tiles(N16, c);
            dequant_rows(q, n0, 16 * nblk, K, buf);
            amx_rows(buf, xt, bias, y, ldy, mr, n0, nblk, K, 0);
        }
        _tile_release();
    }
}

/* ------------------------------------------------------------------ quantized weights past 16 rows on AMX
 *
 * A prompt's W8A16 / W4A16 layer used to rebuild its whole weight in bf16 (it_dequant_w8 / _w4: N x K x 2 bytes
 * written, then read back) for the tile GEMM. Here linear_bf16_amx_gemm's blocks take their two weight tiles from a
 * thread's buffer of the chunk's 32 rows rebuilt in bf16 (dequant_rows: the same rounding), so the products, their
 * order and the bits are that GEMM's on the dequantized weight, and the weight streams once a block of rows as int8
 * / int4, with no copy. N16 a multiple of 16, K % 32 == 0, M > 16 (AMX_GEMM_MIN_ROWS up). */

/* The scratch's first part: x's transposed block (amx_gemm_src's xt); then each thread's 32 rebuilt rows */
static inline int64_t q_amx_xt_bytes(int64_t M, int64_t K) {
    const int64_t mb = gemm_rows_per_rebuild_block(K);
    return (M < mb ? (M + 31) & ~(int64_t)31 : mb) * K * 2;
}

static inline int64_t q_amx_gemm_scratch_bytes(int64_t M, int64_t K, int nthreads) {
    return (q_amx_xt_bytes(M, K) + (int64_t)(nthreads > 0 ? nthreads : 1) * 32 * K * 2 + 63) & ~(int64_t)63;
}

static inline int q_amx_gemm_takes(int64_t M, int64_t N, int64_t K) {
    return amx_state == 1 && M >= AMX_GEMM_MIN_ROWS && K % 32 == 0 && N >= 16;
}

static void q_rebuild_rows(const void* q, int64_t n0, int64_t rows, int64_t K, bf16* out) {
    dequant_rows((const qweight*)q, n0, rows, K, out);
}

static void linear_q_amx_gemm(const qweight* q, const bf16* x, int64_t ldx, const bf16* bias, bf16* y, int64_t ldy,
                              int64_t M, int64_t N16, int64_t K, int nthreads, void* scratch) {
    const amx_wsrc src = {NULL, q_rebuild_rows, q, (bf16*)((char*)scratch + q_amx_xt_bytes(M, K))};
    amx_gemm_src(x, ldx, &src, bias, y, ldy, M, N16, K, nthreads, (bf16*)scratch);
}

/* Past 16 rows on AMX (q_amx_gemm_takes): the tiles above for the first N16 features, and the last N % 16 as
 * linear_bf16 does them (its AVX-512 GEMV on their rows rebuilt in bf16), so the whole is linear_bf16 on the
 * dequantized weight. scratch: q_amx_gemm_scratch_bytes(M, K, nthreads), aligned */
static void linear_q_amx_big(const qweight* q, const bf16* x, int64_t ldx, const bf16* bias, bf16* y, int64_t ldy,
                             int64_t M, int64_t N, int64_t K, int nthreads, void* scratch) {
    const int64_t n16 = N & ~(int64_t)15, tail = N - n16;
    linear_q_amx_gemm(q, x, ldx, bias, y, ldy, M, n16, K, nthreads, scratch);
    if (tail) { /* (its rows rebuilt into the first thread's buffer, free again) */
        bf16* wt = (bf16*)((char*)scratch + q_amx_xt_bytes(M, K));
        dequant_rows(q, n16, tail, K, wt);
        linear_bf16_avx512(x, ldx, wt, bias ? bias + n16 : NULL, y + n16, ldy, M, tail, K, nthreads);
    }
}
