/* W8A8's parts every ISA's kernel shares (csrc/x86/avx512/gemm_i8.c, csrc/x86/avx2/gemm_i8.c,
 * csrc/arm/neon/gemm_i8.c): the sizes, the scratch, the packed weight's blocks, its packing and unpacking, the entry
 * points. Portable C. The including file defines, before
 * it: I8_NB, the output features a block of the packed weight holds, and I8_FLIP, the byte every weight was XORed
 * with when packed (0x80 where the weight is VPDPBUSD's unsigned operand, 0 where it stays signed); and, anywhere in
 * the translation unit, its own
 *   quantize_rows_i8(x, ldx, M, K, static_scale, nthreads, xq, sx, xsum)   x -> int8 rows, their scales and sums
 *   w8a8_gemm(xq, sx, xsum, w, scale, bias, y, ldy, M, N, K, nthreads)     the product on the packed weight
 *   it_pack_w8a8(q, N, K, out, nthreads)                                   the packing (i8_pack_words, or its own)
 * and, where its kernels read whole groups of rows (AMX tiles), I8_ROW_PAD: the rows past the last they may read. */
#ifndef IT_W8A8_H
#define IT_W8A8_H
#include <math.h>
#include "bf16.h"

#define I8_MAX_K (1 << 16) /* sums of K products of at most 255 x 127 stay in int32 */

static inline int64_t i8_kp(int64_t K) { return (K + 63) & ~(int64_t)63; }

#ifndef I8_ROW_PAD
#define I8_ROW_PAD 0
#endif

/* scratch: x_q [M, Kp] (zero past K), s_x [M], sum x_q [M], then I8_ROW_PAD rows' bytes (read, never used) */
static inline int64_t i8_scratch_bytes(int64_t M, int64_t K) {
    return ((M + I8_ROW_PAD) * i8_kp(K) + M * 8 + 127) & ~(int64_t)63;
}

static inline int64_t i8_packed_words(int64_t N, int64_t K) { return (N + I8_NB - 1) / I8_NB * (i8_kp(K) / 4) * I8_NB; }

/* a row's activation scale from its max |x|, as quantize_int8_per_token: max / 127, at least 1e-12 */
static inline float i8_row_scale(float amax) {
    const float s = amax / 127.0f;
    return s < 1e-12f ? 1e-12f : s;
}

/* one value of x / s rounded half to even, clamped to -127..127 (the vector loops' tails) */
static inline int8_t i8_round1(float x, float s) {
    const float v = nearbyintf(x / s);
    return (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
}

/* 1 where q [n] holds -128: outside the contract's -127..127 (the AVX2 product needs it; every library refuses it) */
static inline int i8_has_min128(const int8_t* q, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (q[i] == -128) return 1;
    return 0;
}

static void quantize_rows_i8(const bf16* x, int64_t ldx, int64_t M, int64_t K, const float* static_scale,
                             int nthreads, int8_t* xq, float* sx, int32_t* xsum);
static void w8a8_gemm(const int8_t* xq, const float* sx, const int32_t* xsum, const uint32_t* wpk,
                      const float* scale, const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                      int nthreads);

/* q int8 [N, K] -> the packed weight in this layout, element by element (word (b, p, l) = columns 4p .. 4p + 3 of row
 * I8_NB b + l, each byte XOR I8_FLIP, zero weights past N and K): the portable packing (AVX2, NEON; the AVX-512
 * library packs its own way, to the same layout). -1 (nothing written) where q holds -128. */
static inline int i8_pack_words(const int8_t* q, int64_t N, int64_t K, uint32_t* out, int nthreads) {
    if (i8_has_min128(q, N * K)) return -1;
    const int64_t Kp = i8_kp(K), nblocks = (N + I8_NB - 1) / I8_NB;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        uint8_t* blk = (uint8_t*)(out + b * (Kp / 4) * I8_NB);
        for (int64_t p = 0; p < Kp / 4; p++)
            for (int l = 0; l < I8_NB; l++)
                for (int j = 0; j < 4; j++) {
                    const int64_t n = b * I8_NB + l, k = 4 * p + j;
                    blk[(p * I8_NB + l) * 4 + j] = (uint8_t)((uint8_t)(n < N && k < K ? q[n * K + k] : 0) ^ I8_FLIP);
                }
    }
    return 0;
}

#ifdef I8_SIGNED_DRIVER
/* The product on signed weights in blocks of 16 features (AVX2, NEON: I8_NB 16, I8_FLIP 0), whose including file
 * defines I8_KC (columns a slab) and I8_MB (rows a pass over a slab), its micro-kernels (acc [mr, 16] (+)= the rows
 * [mr, 4 nw] . nw packed words; first: = instead of +=) and
 *   i8_store(acc, mr, sx, scale, bias, n0, nrows, y, ldy)   rows [mr, 16] of sums scaled, (+ bias), rounded into y */
typedef void (*i8_micro_fn)(const int8_t*, int64_t, const uint32_t*, int64_t, int32_t*, int);
static inline void i8_store(const int32_t* acc, int mr, const float* sx, const float* scale, const bf16* bias,
                            int64_t n0, int nrows, bf16* y, int64_t ldy);

/* micro[r] takes r rows (1 .. MR). Threads split the blocks of features; per block, each I8_MB-row pass streams the
 * block's weights in order, each I8_KC-column slab serving every row of the pass (their sums wait in acc). */
static inline void i8_gemm_signed(const int8_t* xq, const float* sx, const uint32_t* wpk, const float* scale,
                                  const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                                  int nthreads, const i8_micro_fn* micro, int MR) {
    const int64_t Kp = i8_kp(K), nblocks = (N + 15) / 16, block_words = Kp / 4 * 16;
    const int nt = pick_threads(nblocks, N * K, nthreads);
#pragma omp parallel num_threads(nt)
    {
        int32_t acc[I8_MB * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * 16;
            const int nrows = (int)(N - n0 < 16 ? N - n0 : 16);
            const uint32_t* wb = wpk + b * block_words;
            for (int64_t m0 = 0; m0 < M; m0 += I8_MB) {
                const int64_t rows = M - m0 < I8_MB ? M - m0 : I8_MB;
                for (int64_t k0 = 0; k0 < Kp; k0 += I8_KC) {
                    const int64_t kc = Kp - k0 < I8_KC ? Kp - k0 : I8_KC;
                    for (int64_t i0 = 0; i0 < rows; i0 += MR) {
                        const int mr = (int)(rows - i0 < MR ? rows - i0 : MR);
                        const int64_t m = m0 + i0;
                        micro[mr](xq + m * Kp + k0, Kp, wb + k0 / 4 * 16, kc / 4, acc + i0 * 16, k0 == 0);
                        if (k0 + kc >= Kp) i8_store(acc + i0 * 16, mr, sx + m, scale, bias, n0, nrows, y + m * ldy, ldy);
                    }
                }
            }
        }
    }
}
#endif

/* The features a block of the packed weight holds (kernels/cpu.py w8a8_packed_shape) */
int64_t it_w8a8_block(void) { return I8_NB; }

/* the packed weight -> q int8 [N, K] */
void it_unpack_w8a8(const uint32_t* packed, int64_t N, int64_t K, int8_t* q) {
    const int64_t Kp = i8_kp(K);
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* blk = (const uint8_t*)(packed + (n / I8_NB) * (Kp / 4) * I8_NB);
        for (int64_t k = 0; k < K; k++) q[n * K + k] = (int8_t)(blk[((k / 4) * I8_NB + n % I8_NB) * 4 + k % 4] ^ I8_FLIP);
    }
}

/* scratch: i8_scratch_bytes(M, K). 0: done; -1: K out of range (the caller keeps torch's). */
static int linear_w8a8(const bf16* x, int64_t ldx, const uint32_t* wpk, const float* scale, const float* static_scale,
                       const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                       void* scratch) {
    if (K > I8_MAX_K || K < 1) return -1;
    int8_t* xq = (int8_t*)scratch;
    float* sx = (float*)(xq + M * i8_kp(K));
    int32_t* xsum = (int32_t*)(sx + M);
    quantize_rows_i8(x, ldx, M, K, static_scale, nthreads, xq, sx, xsum);
    w8a8_gemm(xq, sx, xsum, wpk, scale, bias, y, ldy, M, N, K, nthreads);
    return 0;
}

/* w: the packed weight (it_pack_w8a8); static_scale: NULL (per row) or a calibrated scale [1]; returns as
 * linear_w8a8, or -2 where the scratch cannot be had */
int it_linear_w8a8(const bf16* x, int64_t ldx, const uint32_t* w, const float* scale, const float* static_scale,
                   const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    void* scratch = aligned_alloc(64, (size_t)i8_scratch_bytes(M, K));
    if (!scratch) return -2;
    const int rc = linear_w8a8(x, ldx, w, scale, static_scale, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
    return rc;
}
#endif
