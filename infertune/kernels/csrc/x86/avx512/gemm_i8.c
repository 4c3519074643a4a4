/* W8A8 on AVX-512 VNNI: y = (x_q W_q^T) * s_x * s_w (+ b), int8 weights [N, K] with an fp32 scale per output row
 * and int8 activations with an fp32 scale per row of x, multiplied in int32 (VPDPBUSD), exactly as quant/int8.py
 * W8A8Method's reference (torch._int_mm) multiplies them.
 *
 * The activations are rounded here, as quantize_int8_per_token rounds them: per row s_x = max(max|x| / 127, 1e-12)
 * in fp32, x_q = round_half_even(x / s_x) clamped to +-127 (a true division, as torch's); or, with a calibrated
 * static scale (StoredW8A8 with static activations), s_x = that scale for every row, and values past it saturate.
 * The sums of int8 products are exact in int32 (K up to I8_MAX_K), then y = bf16(float(sum) * s_x * s_w) in that
 * order, and a bias is added to that bf16 value and rounded again, as the reference's `y + bias` does: bit for bit
 * the PyTorch path's result (finite x).
 *
 * VPDPBUSD multiplies unsigned by signed bytes. The weight is the unsigned operand, flipped to q + 128 by one XOR,
 * and the activations the signed one, so sum q x = sum (q + 128) x - 128 sum x, with sum x (a row's x_q summed) from
 * the rounding pass.
 *
 * The weights are packed once, at load (it_pack_w8a8), in VPDPBUSD's order: per 64 output features, each 32-bit
 * word 4 consecutive columns of one feature, 16 features a vector, the blocks one after another in memory. A
 * micro-kernel of GEMM_MR rows x 64 features keeps 24 int32 accumulators in registers; per word of the weights its 4
 * vectors serve GEMM_MR broadcast words of x (no sum across lanes is ever needed). The same kernel runs a decode
 * step's few rows (the weights stream in order, the next slab asked into L2 as this one multiplies) and a prompt's
 * thousands (the int32 sums of a 128-row block wait in `acc` between I8_KC-column slabs). Measured on a Zen 4
 * against the GEMV over [N, K] rows it replaced (benchmarks/bench_w8a8.py, weights streaming from memory): 0.94x
 * at 1 row (both at the memory's speed), 1.41x at 16, 1.65x at 32; 1.9x the bf16 VDPBF16PS GEMM at 512.
 */
#define I8_KC 1024         /* columns per slab: 64 features x 1024 bytes = 64 KB (L2), as the bf16 GEMM's */
#ifndef I8_PF_MIN_ROWS
/* rows from which a pass asks for the next slab into L2 as it goes (gemm_prefetch_line). Below, the rows stream the
 * weights at memory speed without it, and it only adds requests: on a Zen 5 (W8A16 on the packed weight, the 386M
 * model's linears streaming) 0.80x at 1 row and 0.93x at 4, against 1.11x / 1.13x / 1.10x at 8 / 12 / 16 rows and
 * level at 128. (The prefetch had been compiled out until 2026-12-05, bf16.h IT_PREFETCH_FN: these are its first
 * measurements.) */
#define I8_PF_MIN_ROWS 8
#endif
#ifndef I8_MB
#define I8_MB 128          /* rows a pass over a slab (their int32 sums, [128, 128] words, 64 KB, between slabs) */
#endif
#define I8_NB 64           /* output features a block of the packed weight holds */
#define I8_FLIP 0x80       /* (the weight as VPDPBUSD's unsigned operand: q + 128) */
#define I8_ROW_PAD 32      /* (gemm_i8_amx.c's tiles read whole 32-row groups) */
#include "w8a8.h"          /* I8_MAX_K, the scratch, unpacking, the entry points */

/* acc += the products of u (unsigned bytes) and s (signed), 4 a lane: VPDPBUSD. (Through the intrinsic GCC 12 copied
 * each of the micro-kernel's 24 accumulators to the stack and back at every step; as an asm statement with the
 * accumulator in and out, they stay in registers.) */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

/* x [M, K] bf16 -> xq [M, Kp] int8, sx [M], xsum [M]: see the top of this file; static_scale NULL: per row */
static void quantize_rows_i8(const bf16* x, int64_t ldx, int64_t M, int64_t K, const float* static_scale,
                             int nthreads, int8_t* xq, float* sx, int32_t* xsum) {
    const int64_t Kp = i8_kp(K);
    const int nt = M >= 8 && M * K >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const bf16* xr = x + m * ldx;
        float s;
        if (static_scale) {
            s = *static_scale;
        } else {
            __m512 amax = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16)
                amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(xr + k, mask16(K - k))));
            s = i8_row_scale(_mm512_reduce_max_ps(amax));
        }
        sx[m] = s;
        const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        __m512i sum = _mm512_setzero_si512();
        int8_t* q = xq + m * Kp;
        for (int64_t k = 0; k < Kp; k += 16) {
            const __mmask16 mk = K - k > 0 ? mask16(K - k) : 0; /* (none past K: zeros) */
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load_bf16x16(xr + k, mk), sv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i i = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
            sum = _mm512_add_epi32(sum, i);
            _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(i));
        }
        xsum[m] = _mm512_reduce_add_epi32(sum);
    }
}

/* ------------------------------------------------------------------ the GEMM on the packed weights */

/* Weight rows n0 .. n0 + 63 (rows past nrows zero), columns k0 .. k0 + kc - 1 (kc a multiple of 64; columns past K
 * zero) -> wp[p][v][l] = bytes k0 + 4p .. + 3 of row n0 + 16 v + l, each + 128 (the XOR) */
static void i8_pack_slab(const int8_t* w, int64_t K, int64_t n0, int nrows, int64_t k0, int64_t kc, uint32_t* wp) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; c < kc; c += 64) { /* 16 words a row a pass */
        const int64_t left = K - (k0 + c);
        const __mmask64 mk = left >= 64 ? ~(__mmask64)0 : left > 0 ? (((__mmask64)1 << left) - 1) : 0;
        for (int v = 0; v < 4; v++) {
            float rows[256];
            for (int l = 0; l < 16; l++) {
                const int r = 16 * v + l;
                const __m512i row = r < nrows ? _mm512_maskz_loadu_epi8(mk, w + (n0 + r) * K + k0 + c)
                                              : _mm512_setzero_si512();
                _mm512_storeu_si512(rows + 16 * l, _mm512_xor_si512(row, flip));
            }
            __m512 t[16];
            transpose16x16_ps(rows, t); /* t[p] lane l = word p of row l (moved as floats, bit for bit) */
            for (int p = 0; p < 16; p++) _mm512_store_si512(wp + ((c / 4 + p) * 4 + v) * 16, _mm512_castps_si512(t[p]));
        }
    }
}

static inline __attribute__((always_inline)) void i8_micro(const int8_t* xq, int64_t Kp, const int MRC,
                                                           const uint32_t* wp, int64_t nw, int32_t* acc, int first,
                                                           const gemm_pf* pf) {
    __m512i c[GEMM_MR][4];
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++) c[i][v] = first ? _mm512_setzero_si512() : _mm512_load_si512(acc + i * 64 + 16 * v);
    const int64_t lpw = pf->base && nw > 0 ? (pf->count + nw - 1) / nw : 0; /* lines per word */
    for (int64_t p = 0; p < nw; p++) {
        for (int64_t j = p * lpw; j < (p + 1) * lpw; j++) gemm_prefetch_line(pf, j);
        const uint32_t* q = wp + p * 64;
        const __m512i w0 = _mm512_load_si512(q), w1 = _mm512_load_si512(q + 16);
        const __m512i w2 = _mm512_load_si512(q + 32), w3 = _mm512_load_si512(q + 48);
        for (int i = 0; i < MRC; i++) {
            int32_t word;
            memcpy(&word, xq + i * Kp + 4 * p, 4);
            const __m512i xb = _mm512_set1_epi32(word);
            c[i][0] = dpbusd(c[i][0], w0, xb);
            c[i][1] = dpbusd(c[i][1], w1, xb);
            c[i][2] = dpbusd(c[i][2], w2, xb);
            c[i][3] = dpbusd(c[i][3], w3, xb);
        }
    }
    for (int i = 0; i < MRC; i++)
        for (int v = 0; v < 4; v++) _mm512_store_si512(acc + i * 64 + 16 * v, c[i][v]);
}

#define I8_MICRO(R) static void i8_micro_##R(const int8_t* xq, int64_t Kp, const uint32_t* wp, int64_t nw, \
    int32_t* acc, int first, const gemm_pf* pf) { i8_micro(xq, Kp, R, wp, nw, acc, first, pf); }
I8_MICRO(1) I8_MICRO(2) I8_MICRO(3) I8_MICRO(4) I8_MICRO(5) I8_MICRO(6)
#undef I8_MICRO
typedef void (*i8_micro_fn)(const int8_t*, int64_t, const uint32_t*, int64_t, int32_t*, int, const gemm_pf*);
static const i8_micro_fn i8_micro_by_rows[GEMM_MR + 1] = {0, i8_micro_1, i8_micro_2, i8_micro_3,
                                                          i8_micro_4, i8_micro_5, i8_micro_6};

/* 16 values a row of y: a vector store, past the caches where asked and whole */
static inline void i8_put16(bf16* y, __mmask16 mk, __m256i o, int stream) {
    if (stream && mk == 0xffff)
        _mm256_stream_si256((__m256i*)y, o);
    else
        _mm256_mask_storeu_epi16(y, mk, o);
}

/* a block's masks, fp32 scales and bias, 16 features a vector from n0 (nrows of them); returns the vectors */
static inline int i8_block_consts(const float* scale, const bf16* bias, int64_t n0, int nrows, __mmask16 mk[4],
                                  __m512 sw[4], __m512 bv[4]) {
    const int nv = (nrows + 15) / 16;
    for (int v = 0; v < nv; v++) {
        mk[v] = mask16(nrows - 16 * v);
        sw[v] = _mm512_maskz_loadu_ps(mk[v], scale + n0 + 16 * v);
        bv[v] = bias ? load_bf16x16(bias + n0 + 16 * v, mk[v]) : _mm512_setzero_ps();
    }
    return nv;
}

/* The sums of rows [mr, 64] less 128 sum x, scaled, (+ bias), rounded into y's columns n0 .. n0 + nrows - 1: a row's
 * features at once (whole cache lines, written while they are in L1) */
static inline void i8_store(const int32_t* acc, int mr, const float* sx, const int32_t* xsum, const float* scale,
                            const bf16* bias, int64_t n0, int nrows, bf16* y, int64_t ldy, int stream) {
    __mmask16 mk[4];
    __m512 sw[4], bv[4];
    const int nv = i8_block_consts(scale, bias, n0, nrows, mk, sw, bv);
    for (int i = 0; i < mr; i++) {
        const __m512i c = _mm512_set1_epi32(128 * xsum[i]);
        const __m512 s = _mm512_set1_ps(sx[i]);
        for (int v = 0; v < nv; v++) {
            const __m512i d = _mm512_sub_epi32(_mm512_load_si512(acc + i * 64 + 16 * v), c);
            __m256i o = round_bf16x16_nan(_mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), s), sw[v]));
            if (bias) /* (the reference adds the bias to the bf16 product) */
                o = round_bf16x16_nan(_mm512_add_ps(
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(o), 16)), bv[v]));
            i8_put16(y + i * ldy + n0 + 16 * v, mk[v], o, stream);
        }
    }
}

/* The packed weight (it_pack_w8a8): [N64 / 64 blocks][Kp / 4 words][64 features] 32-bit words, each 4 consecutive
 * columns of one feature + 128 (the weight as VPDPBUSD's unsigned operand); rows past N and columns past K hold
 * 128 (q = 0), which meets x_q = 0 past K, and rows past N are never stored. A thread's blocks are consecutive and
 * each block is one run of memory, so the weights stream in order. */

/* One pass of rows over a packed slab: the rows m .. m + mr - 1 of x times the slab's nw words (wp) into acc (first:
 * from zero), the next slab's lines asked into L2 meanwhile (pf); store: the slab is the block's last, so the sums
 * go out to y's features n0 .. n0 + nrows - 1. (W8A8 here; W8A16 on the same packed weight, gemm_w8p.c.) */
typedef void (*i8_rows_fn)(const void* ctx, int64_t m, int mr, int64_t k0, const uint32_t* wp, int64_t nw,
                           int32_t* acc, int first, const gemm_pf* pf, int store, int64_t n0, int nrows);

/* The driver both products share: threads split the blocks of 64 features (consecutive blocks a thread, each one
 * run of memory, so the weights stream in order); per block, each I8_MB-row pass streams the block's I8_KC-column
 * slabs, mr_max rows at a time (acc_row int32 sums a row wait in acc between slabs). */
static void i8_drive(const uint32_t* wpk, int64_t M, int64_t N, int64_t K, int nthreads, int mr_max, int acc_row,
                     i8_rows_fn rows_fn, const void* ctx) {
    const int64_t Kp = i8_kp(K), nblocks = (N + 63) / 64, block_words = Kp / 4 * 64;
    const int nt = pick_threads(nblocks, N * K, nthreads);
#pragma omp parallel num_threads(nt)
    {
        int32_t acc[I8_MB * 128] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * 64;
            const int nrows = (int)(N - n0 < 64 ? N - n0 : 64);
            const uint32_t* wb = wpk + b * block_words;
            for (int64_t m0 = 0; m0 < M; m0 += I8_MB) {
                const int64_t rows = M - m0 < I8_MB ? M - m0 : I8_MB;
                const int last_rows = m0 + I8_MB >= M;
                for (int64_t k0 = 0; k0 < Kp; k0 += I8_KC) {
                    const int64_t kc = Kp - k0 < I8_KC ? Kp - k0 : I8_KC;
                    const uint32_t* wp = wb + k0 / 4 * 64;
                    /* the slab multiplied next, into L2: this block's next columns, or past the last row block the
                       next block's first (both the words right after this slab's), spread over the slab's words */
                    gemm_pf pf = {0};
                    const int64_t next = k0 + kc < Kp || last_rows ? kc / 4 * 64 : 0; /* words on */
                    const int64_t left = (nblocks - b) * block_words - (k0 + kc) / 4 * 64; /* words of W after it */
                    if (next && left > 0 && M >= I8_PF_MIN_ROWS) {
                        const int64_t nw = left < I8_KC / 4 * 64 ? left : I8_KC / 4 * 64;
                        pf.base = (const char*)(wp + next);
                        pf.ld = 0;
                        pf.row_lines = nw * 4 / 64;
                        pf.count = pf.row_lines;
                    }
                    const int64_t micros = (rows + mr_max - 1) / mr_max, share = (pf.count + micros - 1) / micros;
                    for (int64_t i0 = 0; i0 < rows; i0 += mr_max) {
                        const int mr = (int)(rows - i0 < mr_max ? rows - i0 : mr_max);
                        gemm_pf part = pf;
                        part.first = (i0 / mr_max) * share;
                        part.count = pf.count - part.first < share ? pf.count - part.first : share;
                        rows_fn(ctx, m0 + i0, mr, k0, wp, kc / 4, acc + i0 * acc_row, k0 == 0, &part, k0 + kc >= Kp,
                                n0, nrows);
                    }
                }
            }
        }
    }
}

typedef struct {
    const int8_t* xq;
    const float* sx;
    const int32_t* xsum;
    const float* scale;
    const bf16* bias;
    bf16* y;
    int64_t Kp, ldy;
    int stream; /* y past the caches (non-temporal stores) */
} i8_job;

static void i8_rows(const void* ctx, int64_t m, int mr, int64_t k0, const uint32_t* wp, int64_t nw, int32_t* acc,
                    int first, const gemm_pf* pf, int store, int64_t n0, int nrows) {
    const i8_job* j = (const i8_job*)ctx;
    i8_micro_by_rows[mr](j->xq + m * j->Kp + k0, j->Kp, wp, nw, acc, first, pf);
    if (store)
        i8_store(acc, mr, j->sx + m, j->xsum + m, j->scale, j->bias, n0, nrows, j->y + m * j->ldy, j->ldy, j->stream);
}

#include "gemm_i8_amx.c"

static void i8a_rows(const void* ctx, const int32_t* acc, int64_t r0, int rows, int64_t n0, int nrows) {
    const i8_job* j = (const i8_job*)ctx;
    i8_store(acc, rows, j->sx + r0, j->xsum + r0, j->scale, j->bias, n0, nrows, j->y + r0 * j->ldy, j->ldy,
             j->stream);
}

static void w8a8_gemm(const int8_t* xq, const float* sx, const int32_t* xsum, const uint32_t* wpk,
                      const float* scale, const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                      int nthreads) {
    const i8_job job = {xq, sx, xsum, scale, bias, y, i8_kp(K), ldy, i8a_stream(M, N, y, ldy)};
    if (i8_amx_takes())
        i8a_drive(xq, M, job.Kp, wpk, N, nthreads, i8a_rows, &job);
    else
        i8_drive(wpk, M, N, K, nthreads, GEMM_MR, 64, i8_rows, &job);
}


/* q int8 [N, K] -> the packed weight, i8_packed_words(N, K) words. -1 where q holds -128: outside the contract's
 * -127..127 (the AVX2 library's product needs it; both refuse it alike) */
int it_pack_w8a8(const int8_t* q, int64_t N, int64_t K, uint32_t* out, int nthreads) {
    if (i8_has_min128(q, N * K)) return -1;
    const int64_t nblocks = (N + 63) / 64, Kp = i8_kp(K);
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t b = 0; b < nblocks; b++)
        i8_pack_slab(q, K, b * 64, (int)(N - b * 64 < 64 ? N - b * 64 : 64), 0, Kp, out + b * (Kp / 4) * 64);
    return 0;
}
