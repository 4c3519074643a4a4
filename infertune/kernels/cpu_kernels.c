/* infertune's CPU kernels for decode steps and the elementwise work of prefills, x86-64 with AVX-512 BF16 and
 * VNNI (AMX where present).
 *
 * At a few rows a linear layer is a matrix-vector product: every weight byte is read once, so the step runs at
 * the speed of memory. These kernels stream each weight once for up to MR rows of activations at a time and
 * prefetch ahead of the stream, which is what the generic GEMM paths do not do at M = 1.
 *
 *   it_linear_bf16  y = x W^T (+ b)            bf16 x, bf16 W [N, K], fp32 accumulation (VDPBF16PS at one row,
 *                                              AMX tiles at 2+ rows where the CPU has them)
 *   it_linear_w8    y = (x W_q^T) * s (+ b)    bf16 x, int8 W_q [N, K], per-row scale s; x is rounded to
 *                                              int16 per row (dynamic, symmetric) and multiplied in int32
 *                                              (VPDPBUSD on its two bytes), so |x - x_q * s_x| <= s_x / 2,
 *                                              s_x = max|x| / 32512
 *   it_linear_w4    y = sum_g (x_g . q_g) s_g + (sum x_g) z_g (+ b)
 *                                              bf16 x, 4-bit W (two per byte, see below), per-group scale s
 *                                              and offset z (w = q * s + z), x in int16 as above (VPDPWSSD)
 *   it_dequant_w8 / it_dequant_w4              a quantized layer's bf16 weights, for a prefill's GEMM
 *   it_linear_bf16c                            y = x W^T (+ b) with W in the lossless 12-bit layout (bf16c below),
 *                                              any M on AMX (SiLU-and-multiply in the epilogue for a gate_up);
 *                                              it_bf16c_hist / _pack / _escapes build it, it_unpack_bf16c undoes it
 *   it_rmsnorm_mt / it_silu_mul / it_rotary    the elementwise work of prefills, rounded as the PyTorch code
 *   it_decode_layers                           a whole decode step of a Llama decoder, or a step of fresh prompts
 *                                              (see its comment); it_fused_timers: its split by part;
 *                                              it_decode_attention: its attention alone
 *
 * The linear kernels take x [M, K] with row stride ldx and write y [M, N] (bf16) with row stride ldy. Threads
 * split the output features with OpenMP; the library links the libgomp torch has already loaded, so the two
 * share one thread pool.
 *
 * Built at run time by infertune/kernels/cpu.py (cc -O3 -mavx512bf16 -mavx512vnni ... -fopenmp) and loaded
 * with ctypes; where it cannot be built, the engine keeps torch's kernels.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <omp.h>

typedef uint16_t bf16;

#define NR 4          /* weight rows per block */
#define MR 4          /* activation rows per pass over a block */
#define PF_BYTES 1024 /* software prefetch distance along a weight row */
#ifndef PF_KEYS
#define PF_KEYS 32    /* ... and along a sequence's K/V rows in the decode attention */
#endif

static inline float bf2f(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f2bf(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline __mmask16 mask16(int64_t left) { /* the first min(left, 16) lanes */
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __m512 load_bf16x16(const bf16* p, __mmask16 m) { /* 16 bf16 (masked) -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m256i round_bf16x16(__m512 v) { /* 16 fp32 -> bf16, nearest even, as f2bf (finite values) */
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

static inline int pick_threads(int64_t n_blocks, int64_t bytes, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (bytes < (1 << 16)) return 1; /* not worth waking a second thread */
    if (n_blocks < nthreads) return (int)(n_blocks > 0 ? n_blocks : 1);
    return nthreads;
}

/* Feature tiles (of 16) in 64-feature chunk ch of an N16-feature weight: 4, fewer in a last partial chunk */
static inline int chunk_tiles(int64_t N16, int64_t ch) {
    return (int)((N16 - ch * 64) / 16 < 4 ? (N16 - ch * 64) / 16 : 4);
}

/* One row of a quantized weight as bf16, rounded as the PyTorch references: bf16(q * bf16(s)) for int8,
 * bf16(q * s + z) (fp32 multiply, then add) for int4 in the 64-column nibble layout. */
static inline void dequant_w8_row(const int8_t* q, float s, bf16* out, int64_t K) {
    const __m512 sv = _mm512_set1_ps(s);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k))));
        _mm256_storeu_si256((__m256i*)(out + k), round_bf16x16(_mm512_mul_ps(v, sv)));
    }
    for (; k < K; k++) out[k] = f2bf((float)q[k] * s);
}

static inline void dequant_w4_row(const uint8_t* p, const float* scale, const float* zero, int64_t gs, bf16* out,
                                  int64_t K) {
    for (int64_t k0 = 0; k0 < K; k0 += 64) { /* 32 bytes: columns k0 + b (low) and k0 + 32 + b (high) */
        const int64_t g = k0 / gs;
        const __m512 sv = _mm512_set1_ps(scale[g]), zv = _mm512_set1_ps(zero[g]);
        for (int64_t h = 0; h < 2; h++) { /* bytes 16 h .. 16 h + 15 */
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + k0 / 2 + 16 * h)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
            _mm256_storeu_si256((__m256i*)(out + k0 + 16 * h), round_bf16x16(_mm512_add_ps(_mm512_mul_ps(lo, sv), zv)));
            _mm256_storeu_si256((__m256i*)(out + k0 + 32 + 16 * h),
                                round_bf16x16(_mm512_add_ps(_mm512_mul_ps(hi, sv), zv)));
        }
    }
}

static inline float w8_scale(const void* scale, int scale_is_f32, int64_t n) {
    /* the reference multiplies in bf16: q.to(bf16) * s.to(bf16) */
    return bf2f(scale_is_f32 ? f2bf(((const float*)scale)[n]) : ((const bf16*)scale)[n]);
}

/* ------------------------------------------------------------------ bf16 x bf16 */

static inline __attribute__((always_inline)) void bf16_block(
    const bf16* x, int64_t ldx, int mr, const bf16* w, int nr, int64_t K, float out[MR][NR]) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t kfull = K & ~(int64_t)31;
    for (int64_t k = 0; k < kfull; k += 32) {
        __m512bh wv[NR];
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                _mm_prefetch((const char*)(w + j * K + k) + PF_BYTES, _MM_HINT_T0);
                wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
            }
        }
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
                for (int j = 0; j < NR; j++)
                    if (j < nr) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
            }
        }
    }
    if (kfull < K) {
        __mmask32 m = (__mmask32)((1ull << (K - kfull)) - 1);
        __m512bh wv[NR];
        for (int j = 0; j < NR; j++)
            if (j < nr) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * K + kfull);
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * ldx + kfull);
                for (int j = 0; j < NR; j++)
                    if (j < nr) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++)
            if (i < mr && j < nr) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* Call CASE(rows of x, rows of W) with constant trip counts for full blocks (so the compiler keeps the
 * accumulators in registers) and with the runtime counts for the last, partial block of W. */
#define DISPATCH_BLOCK(CASE)                  \
    if (nr == NR) {                           \
        if (mr == 4) CASE(4, 4);              \
        else if (mr == 3) CASE(3, 4);         \
        else if (mr == 2) CASE(2, 4);         \
        else CASE(1, 4);                      \
    } else {                                  \
        CASE(mr, nr);                         \
    }

#define BF16_CASE(MRC, NRC) bf16_block(x + m0 * ldx, ldx, MRC, wb, NRC, K, out)

static void linear_bf16_avx512(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y,
                               int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + NR - 1) / NR;
    const int nt = pick_threads(nblocks, N * K * 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const bf16* wb = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            float out[MR][NR];
            DISPATCH_BLOCK(BF16_CASE)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++)
                    y[(m0 + i) * ldy + n0 + j] = f2bf(out[i][j] + (bias ? bf2f(bias[n0 + j]) : 0.0f));
        }
    }
}

/* ------------------------------------------------------------------ bf16 on AMX tiles
 *
 * C^T = W x^T, 16 output features x 16 activation rows per tile: the A operand is 16 rows of W read in place
 * (row stride 2K bytes, so no repacking of the weights), the B operand is x transposed into VNNI pairs
 * (built once per call). Four accumulator tiles cover 64 output features per pass over K.
 */
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1; /* -1 unknown, 0 unusable, 1 usable */
#define AMX_MIN_ROWS 2 /* at one row the AVX-512 path streams as fast */
#define AMX_GEMM_MIN_ROWS 17 /* from here the 2 x 2 blocked GEMM (two row tiles) */


typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Asks Linux for the AMX tile state (once per process; torch's oneDNN asks too). 1 where AMX can run. */
int it_amx_init(int has_amx_flags) {
    if (amx_state < 0)
        amx_state = has_amx_flags && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_state;
}

void it_amx_disable(void) { amx_state = 0; }

/* This thread's tiles: n tiles of 16 rows x 64 bytes (16 fp32 accumulators, or 16 x 32 bf16 operands), the first
 * n_short of them (and tile 7, where n_short > 0) with `short_rows` rows instead. The barrier keeps the compiler
 * from dropping the stores into cfg (GCC saw them as dead before LDTILECFG, and the CPU then refused the stale
 * bytes of the unused tiles). */
__attribute__((target("amx-tile")))
static void amx_tiles(int n, int n_short, int short_rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < n; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    for (int t = 0; t < n_short; t++) cfg.rows[t] = (uint8_t)short_rows;
    if (n_short > 0) cfg.rows[7] = (uint8_t)short_rows;
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

static inline void amx_configure(int n) { amx_tiles(n, 0, 16); }

/* ------------------------------------------------------------------ bf16 weights in 12 bits, losslessly
 *
 * A bf16 weight is a high byte (sign and 7 exponent bits) and a low byte (the last exponent bit and 7 mantissa
 * bits). A layer's weights use few high bytes (a trained or random layer's exponents span a few binades), so
 * each weight is stored as its low byte plus a 4-bit code into a table of the layer's 16 most common high bytes;
 * the rare weight whose high byte is not in the table is stored aside and patched in. Decoding is a table
 * lookup (VPSHUFB) and two widenings per 32 weights, exact: the tiles see the very bf16 values of the
 * checkpoint, 25% fewer bytes stream from memory in a decode step, and the layer holds 0.75x the memory.
 *
 * Layout (built by kernels/cpu.py pack_bf16c): the output features in chunks of 64 (zero-padded), each chunk as
 * K / 32 tiles of 64 features x 32 weights. A tile is stored as it decodes: four AMX B operands in VNNI order, one
 * per 16 features (64 "rows" of 64 bytes: row 16 g + p holds, for features 16 g .. 16 g + 15, their weights 2 p and
 * 2 p + 1), each pair of rows 96 bytes (see bf16c_tile). So the kernels multiply x (rows as they are, the A
 * operand) by decoded tiles straight away: no transpose of x going in, none of the products coming out. Tiles
 * follow each other chunk by chunk, so a thread walking its chunks reads one sequential stream.
 */
typedef struct {
    const uint8_t* codes;      /* [N64 / 64][K / 32][64][48] */
    const uint8_t* table;      /* [16] high bytes */
    const int32_t* esc_start;  /* [N64 / 64 * K / 32 + 1]: the escapes of tile t are esc_start[t] .. esc_start[t + 1] */
    const uint16_t* esc_pos;   /* r * 32 + j within the decoded tile (VNNI row r, element j) */
    const bf16* esc_val;       /* the weight */
} bf16c;

#define BF16C_TILE_BYTES (64 * 48)
#define BF16C_PF_TILES 4 /* prefetch distance along the stream, in tiles */

/* Rows r0 .. r1 - 1 (even bounds) of tile t as bf16 into out, rows ld elements apart, escapes not patched. Two
 * rows a step: their 64 low bytes (in the order VPUNPCKL/HBW interleave, see pack_bf16c), then 32 bytes of codes (byte i:
 * low byte i's code in its low nibble, low byte i + 32's in its high nibble); one VPSHUFB looks up the 64 high
 * bytes, and the two unpacks write the two rows. */
static inline void bf16c_pairs(const bf16c* c, int64_t t, int r0, int r1, bf16* out, int64_t ld) {
    const uint8_t* b = c->codes + t * BF16C_TILE_BYTES;
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)c->table));
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int r = r0; r < r1; r += 2) {
        const uint8_t* p = b + r * 48;
        if ((r & 3) == 0) /* 4 rows = 3 lines */
            for (int l = 0; l < 192; l += 64) _mm_prefetch((const char*)p + BF16C_PF_TILES * BF16C_TILE_BYTES + l, _MM_HINT_T0);
        const __m256i nib = _mm256_loadu_si256((const __m256i*)(p + 64));
        const __m512i code = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(nib), _mm256_srli_epi16(nib, 4), 1), nibble);
        const __m512i hi = _mm512_shuffle_epi8(table, code), lo = _mm512_loadu_si512((const void*)p);
        _mm512_storeu_si512(out + r * ld, _mm512_unpacklo_epi8(lo, hi));
        _mm512_storeu_si512(out + (r + 1) * ld, _mm512_unpackhi_epi8(lo, hi));
    }
}

/* The escapes of tile t (weights outside the table) patched into its decoded rows at out (ld elements apart) */
static inline void bf16c_patch(const bf16c* c, int64_t t, bf16* out, int64_t ld) {
    for (int32_t e = c->esc_start[t]; e < c->esc_start[t + 1]; e++)
        out[(c->esc_pos[e] >> 5) * ld + (c->esc_pos[e] & 31)] = c->esc_val[e];
}

/* Rows 0 .. rows - 1 of tile (chunk, ks), escapes patched */
static inline void bf16c_tile(const bf16c* c, int64_t KS, int64_t chunk, int64_t ks, int rows, bf16* out,
                              int64_t ld) {
    bf16c_pairs(c, chunk * KS + ks, 0, rows, out, ld);
    bf16c_patch(c, chunk * KS + ks, out, ld);
}

/* 16 * nblk output features from n0 for mr (<= 16) rows: the weight rows from w0 (row stride K) */
__attribute__((target("amx-tile,amx-bf16")))
static void amx_rows(const bf16* w0, const bf16* xt, const bf16* bias, bf16* y,
                     int64_t ldy, int mr, int64_t n0, int nblk, int64_t K) {
    /* tiles 0-3: C, 4-5: A (alternating), 6: B */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const int64_t ld = K * 2, ts = 16 * K; /* A row stride (bytes), tile stride */
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(6, xt + k * 16, 64);
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
                    amx_rows(w + n0 * K, xt + p * K * 16, bias, y + m0 * ldy, ldy, mr, n0, nblk, K);
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

__attribute__((target("amx-tile,amx-bf16")))
static void linear_bf16_amx_gemm(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                                 int64_t M, int64_t N16, int64_t K, int nthreads, bf16* xt) {
    const int64_t nchunks = (N16 + 31) / 32; /* chunks of 32 features */
    const int64_t mb = gemm_rows_per_block(K);
    const int nt = pick_threads(nchunks, N16 * K * 2 * ((M + 15) / 16), nthreads);
#pragma omp parallel num_threads(nt)
    {
        amx_configure(8);
        gemm_block g;
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
                for (int64_t p = 0; p < tiles; p += 2) {
                    g.na = N16 - n0 >= 32 ? 2 : 1;
                    g.nb = tiles - p >= 2 ? 2 : 1;
                    g.n0 = n0;
                    g.m0 = b0 + 16 * p;
                    for (int b = 0; b < g.nb; b++) {
                        const int64_t left = M - (g.m0 + 16 * b);
                        g.mr[b] = (int)(left < 16 ? left : 16);
                    }
                    gemm_block_compute(w + n0 * K, xt + p * K * 16, K, &g);
                    for (int a = 0; a < g.na; a++)
                        for (int b = 0; b < g.nb; b++) gemm_tile_store(&g, a, b, bias, y, ldy);
                }
            }
#pragma omp barrier /* xt is rewritten by the next block of rows */
        }
        _tile_release();
    }
}

static inline __m512 bf16_round_f32(__m512 v) { /* fp32 -> the nearest bf16, back in fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_bf16x16(v)), 16));
}

static inline __m512 exp512(__m512 x) { /* e^x, relative error ~1e-7 over the clamped range */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}



/* 1 / d to ~1 ulp: the 14-bit estimate and one Newton step (a division costs ~4x as much here) */
static inline __m512 rcp512(__m512 d) {
    const __m512 r = _mm512_rcp14_ps(d);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
}

static inline __m512 silu512(__m512 g) { /* g / (1 + e^-g) in fp32 */
    return _mm512_mul_ps(g, rcp512(_mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
}

/* ------------------------------------------------------------------ 12-bit weights on the tiles
 *
 * C = x W^T with x as the A operand (16 rows x 32 k, read in place) and the decoded tiles of W as B operands (VNNI,
 * 16 k-pairs x 16 features); each accumulator tile is 16 rows x 16 features of y. The products are those of
 * linear_bf16's tiles (each output the same pairs summed in the same order), so the bits match.
 */

/* bf16(a + b) into x (m lanes), as f2bf rounds, a NaN sum quiet: the residual add */
static inline void store_sum_bf16x16(bf16* x, __m512 a, __m512 b, __mmask16 m) {
    const __m512 v = _mm512_add_ps(a, b);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m256i q = _mm256_or_si256(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)),
                                      _mm256_set1_epi16(0x40));
    _mm256_mask_storeu_epi16(x, m, _mm256_mask_blend_epi16(nan, round_bf16x16(v), q));
}

/* rows (<= 16) fp32 accumulator rows c [rows][16] + bias -> bf16 y[m][n .. n + 15]; with add, that bf16 is added
 * into y instead (bf16(y + bf16(c + bias)): the residual add of add_rows, on the product as it would be stored) */
static inline void tile_rows_out(const float* c, const bf16* bias, int64_t n, bf16* y, int64_t ldy, int rows, int add) {
    const __m512 bv = bias ? load_bf16x16(bias + n, 0xffff) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        const __m256i r = round_bf16x16(_mm512_add_ps(_mm512_loadu_ps(c + 16 * m), bv));
        bf16* out = y + m * ldy + n;
        if (add)
            store_sum_bf16x16(out, load_bf16x16(out, 0xffff),
                              _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)), 0xffff);
        else
            _mm256_storeu_si256((__m256i*)out, r);
    }
}

/* A gate_up weight packed with its gate and up rows interleaved 16 by 16 (feature tile 2 p: gate features
 * 16 p .. 16 p + 15, tile 2 p + 1: the same up features; inter = the intermediate size): the accumulator rows of
 * pair p, cg and cu [rows][16], become either gate_up's columns (gate at 16 p, up at inter + 16 p) or, with silu,
 * act = bf16(bf16(silu(g)) * u) at column 16 p, rounded as silu_mul_rows (g and u first rounded to bf16). */
static inline void tile_pair_out(const float* cg, const float* cu, int64_t p, bf16* y, int64_t ldy, int rows,
                                 int64_t inter, int silu) {
    for (int m = 0; m < rows; m++) {
        const __m512 zero = _mm512_setzero_ps(); /* (+ 0, as tile_rows_out adds a missing bias: -0 becomes +0) */
        const __m512 g = bf16_round_f32(_mm512_add_ps(_mm512_loadu_ps(cg + 16 * m), zero));
        const __m512 u = bf16_round_f32(_mm512_add_ps(_mm512_loadu_ps(cu + 16 * m), zero));
        if (silu) {
            _mm256_storeu_si256((__m256i*)(y + m * ldy + 16 * p), round_bf16x16(_mm512_mul_ps(bf16_round_f32(silu512(g)), u)));
        } else {
            _mm256_storeu_si256((__m256i*)(y + m * ldy + 16 * p), round_bf16x16(g));
            _mm256_storeu_si256((__m256i*)(y + m * ldy + inter + 16 * p), round_bf16x16(u));
        }
    }
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
            if (inter) /* (a chunk holds whole pairs: N16 / 16 is even) */
                for (int b = 0; b < nblk; b += 2) tile_pair_out(c[b], c[b + 1], n0 / 32 + b / 2, y, ldy, mr, inter, epi);
            else
                for (int b = 0; b < nblk; b++) tile_rows_out(c[b], bias, n0 + 16 * b, y, ldy, mr, epi);
        }
        _tile_release();
    }
}

/* A slab of a chunk being decoded a few row pairs at a time into out [ke - k0][64][32]: the B operand of k-step ks,
 * features 16 g.., at out + (ks - k0) * 2048 + g * 512 (64-byte rows) */
typedef struct {
    const bf16c* cw;
    int64_t chunk, KS, ks, k0, ke; /* tiles k0 .. ke - 1 of the chunk (a slab); ks: the next one */
    int rows, r;
    bf16* out; /* tile k0's rows */
} chunk_decoder;

/* Decodes `pairs` more row pairs (fewer at the end); a tile's escapes are patched after its last pair */
static inline void decode_some(chunk_decoder* d, int pairs) {
    if (d->ks >= d->ke) return;
    const int64_t t = d->chunk * d->KS + d->ks;
    bf16* out = d->out + (d->ks - d->k0) * 2048;
    const int r1 = d->r + 2 * pairs < d->rows ? d->r + 2 * pairs : d->rows;
    bf16c_pairs(d->cw, t, d->r, r1, out, 32);
    d->r = r1;
    if (d->r >= d->rows) {
        bf16c_patch(d->cw, t, out, 32);
        d->ks++;
        d->r = 0;
    }
}

/* The decoder of a GEMM step's weights (steps: block-major, then slab of KSL k-steps, then chunk) into out */
static inline chunk_decoder step_decoder(const bf16c* cw, int64_t step, int64_t nchunks, int64_t nslabs, int64_t KSL,
                                         int64_t KS, int64_t N16, bf16* out) {
    const int64_t c = step % nchunks, k0 = step / nchunks % nslabs * KSL;
    return (chunk_decoder){cw, c, KS, k0, k0, k0 + KSL < KS ? k0 + KSL : KS, 16 * chunk_tiles(N16, c), 0, out};
}

/* The output rows of a finished 2 x 2 block (its accumulators stored in c), written a few rows at a time while
 * the tiles multiply the next block: the vector work of rounding (and SiLU) overlaps the tiles' work. Row i of
 * the job is row i of token tile 0 for i < r0, else row i - r0 of token tile 1. */
typedef struct {
    const float (*c)[256];
    const bf16* bias;
    bf16* y; /* row 0 of token tile 0 */
    int64_t ldy, n, inter; /* n: the first feature (column) of feature tile 0 */
    int na, r0, r1, epi, next, per_step; /* epi: as linear_bf16c's */
} epi_job;

static inline void epi_some(epi_job* e, int rows) {
    for (; rows > 0 && e->next < e->r0 + e->r1; rows--, e->next++) {
        const int tt = e->next >= e->r0, m = tt ? e->next - e->r0 : e->next;
        bf16* yr = e->y + (16 * tt + m) * e->ldy;
        const float* c0 = e->c[2 * tt] + 16 * m;
        if (e->inter) {
            tile_pair_out(c0, e->c[2 * tt + 1] + 16 * m, e->n / 32, yr, e->ldy, 1, e->inter, e->epi);
        } else {
            tile_rows_out(c0, e->bias, e->n, yr, e->ldy, 1, e->epi);
            if (e->na == 2) tile_rows_out(e->c[2 * tt + 1] + 16 * m, e->bias, e->n + 16, yr, e->ldy, 1, e->epi);
        }
    }
}

/* One 2 x 2 block over K columns (all of K, or a slab): row tiles a0 (and a1, where given) of x against feature
 * tiles wb (and wb + 512 where na == 2) of a decoded chunk; c[2 r + f] gets row tile r x feature tile f, added to
 * cin's (the previous slabs' sums) where given, else to zero. Tiles 0-3: C, 4-5: x, 6-7: W. Each k-step also
 * decodes `pairs` row pairs of the next chunk (where d is given): its codes stream in from memory while the
 * tiles multiply. */
__attribute__((target("amx-tile,amx-bf16")))
static inline void bf16c_block(const bf16* a0, int64_t lda0, const bf16* a1, int64_t lda1, const bf16* wb, int na,
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
        _tile_loadd(4, a0 + k, lda0);
        _tile_dpbf16ps(0, 4, 6);
        if (na == 2) { _tile_loadd(7, b + 512, 64); _tile_dpbf16ps(1, 4, 7); }
        if (a1) {
            _tile_loadd(5, a1 + k, lda1);
            _tile_dpbf16ps(2, 5, 6);
            if (na == 2) _tile_dpbf16ps(3, 5, 7);
        }
        if (d) decode_some(d, pairs);
        epi_some(e, e->per_step);
    }
    epi_some(e, 32); /* (whatever rounding left) */
    _tile_stored(0, c[0], 64);
    if (na == 2) _tile_stored(1, c[1], 64);
    if (a1) {
        _tile_stored(2, c[2], 64);
        if (na == 2) _tile_stored(3, c[3], 64);
    }
}

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
static void linear_bf16c_gemm(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy,
                              int64_t M, int64_t N16, int64_t K, int nthreads, bf16* xtail, bf16* wdec, int64_t inter,
                              int epi) {
    const int64_t nchunks = (N16 + 63) / 64, tiles = (M + 15) / 16, full = M / 16, KS = K / 32;
    const int64_t KSL = bf16c_slab_ks(M, K), nslabs = (KS + KSL - 1) / KSL, per_block = nslabs * nchunks;
    const int64_t bt = BF16C_GEMM_ROWS / 16, pairs_per_block = (bf16c_block_rows(M) + 31) / 32;
    if (full < tiles) {
        memset(xtail, 0, (size_t)(16 * K * 2));
        for (int64_t m = 16 * full; m < M; m++) memcpy(xtail + (m - 16 * full) * K, x + m * ldx, (size_t)(K * 2));
    }
    float* spill = (float*)((char*)wdec + bf16c_bufs_bytes(K, nthreads));
    int64_t done[nslabs > 1 ? nchunks : 1]; /* per chunk: the slab steps finished (block b's slab s is b nslabs + s) */
    memset(done, 0, sizeof done);
    const int nt = pick_threads(nchunks, N16 * K * tiles, nthreads);
    int64_t next_step = 0;
#pragma omp parallel num_threads(nt)
    {
        amx_configure(8);
        float cb[2][4][256] __attribute__((aligned(64))); /* a block's accumulators, and the previous block's */
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
            chunk_decoder d0 = step_decoder(cw, step, nchunks, nslabs, KSL, KS, N16, buf[0]);
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
                dn = step_decoder(cw, next, nchunks, nslabs, KSL, KS, N16, buf[cur ^ 1]);
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
                const bf16* a0 = (t < full ? x + 16 * t * ldx : xtail) + k0 * 32;
                const bf16* a1 = !two ? NULL : (t + 1 < full ? x + 16 * (t + 1) * ldx : xtail) + k0 * 32;
                const int64_t lda0 = t < full ? ldx * 2 : K * 2, lda1 = t + 1 < full ? ldx * 2 : K * 2;
                const int r0 = (int)(M - 16 * t < 16 ? M - 16 * t : 16);
                const int r1 = two ? (int)(M - 16 * (t + 1) < 16 ? M - 16 * (t + 1) : 16) : 0;
                for (int g = 0; g < nblk; g += 2) {
                    const int na = nblk - g >= 2 ? 2 : 1;
                    float (*sp)[256] = nslabs > 1 ? (float (*)[256])(spill + ((ch * pairs_per_block + (t - t0) / 2) * 2 + g / 2) * 1024) : NULL;
                    bf16c_block(a0, lda0, a1, lda1, wc + g * 512, na, klen, s > 0 ? (const float (*)[256])sp : NULL,
                                last ? cb[cur_c] : sp, d, pairs, &job);
                    if (!last) continue;
                    /* this block's rows go out during the next block (or below, after the last) */
                    job = (epi_job){(const float (*)[256])cb[cur_c], bias, y + 16 * t * ldy, ldy, n0 + 16 * g, inter,
                                    na, r0, two ? r1 : 0, epi, 0, (int)((r0 + r1 + k1 - k0 - 1) / (k1 - k0))};
                    cur_c ^= 1;
                }
            }
            if (nslabs > 1) __atomic_store_n(&done[ch], b * nslabs + s + 1, __ATOMIC_RELEASE);
            if (d) {
                while (dn.ks < dn.ke) decode_some(&dn, 32); /* (rounding left a few pairs) */
                cur ^= 1;
            }
            step = next;
        }
        epi_some(&job, 32); /* the last block's rows */
        _tile_release();
    }
}

/* x [M, K] times a 12-bit weight: scratch holds bf16c_scratch_bytes(M, K); dec bf16c_dec_bytes(M, N16, K, nthreads) */
static inline int64_t bf16c_scratch_bytes(int64_t M, int64_t K) { return M > 16 ? ((16 * K * 2 + 63) & ~(int64_t)63) : 0; }

/* inter > 0: the weight is a gate_up with its rows interleaved (see tile_pair_out), and epi = 1 writes act
 * [M, inter] (SiLU-and-multiply); inter = 0: epi = 1 adds the product into y (y += x W^T + bias, each product
 * rounded to bf16 first, as add_rows adds it: a residual) */
static void linear_bf16c(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N16, int64_t K, int nthreads, bf16* scratch, bf16* dec, int64_t inter,
                         int epi) {
    if (M <= 16)
        linear_bf16c_rows(x, ldx, cw, bias, y, ldy, (int)M, N16, K, nthreads, inter, epi);
    else
        linear_bf16c_gemm(x, ldx, cw, bias, y, ldy, M, N16, K, nthreads, scratch, dec, inter, epi);
}

/* scratch: bf16_scratch_bytes(M, K), 64-byte aligned (the transposed activations of the AMX path) */
static inline int64_t bf16_scratch_bytes(int64_t M, int64_t K) {
    /* the GEMM's blocks hold at least 32 rows, more than amx_rows_per_block allows for K past 12288 */
    const int64_t amx = amx_rows_per_block(K), gemm = gemm_rows_per_block(K);
    const int64_t mb = M >= AMX_GEMM_MIN_ROWS && gemm > amx ? gemm : amx;
    const int64_t rows = M < mb ? (M + 15) & ~(int64_t)15 : mb;
    return (rows * K * 2 + 63) & ~(int64_t)63;
}

static void linear_bf16(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int nthreads, void* scratch) {
    const int64_t n16 = N & ~(int64_t)15;
    if (amx_state == 1 && K % 32 == 0 && n16 > 0 && M >= AMX_MIN_ROWS) {
        if (M >= AMX_GEMM_MIN_ROWS)
            linear_bf16_amx_gemm(x, ldx, w, bias, y, ldy, M, n16, K, nthreads, (bf16*)scratch);
        else
            linear_bf16_amx(x, ldx, w, bias, y, ldy, M, n16, K, nthreads, (bf16*)scratch);
        if (n16 < N)
            linear_bf16_avx512(x, ldx, w + n16 * K, bias ? bias + n16 : NULL, y + n16, ldy, M, N - n16, K, nthreads);
        return;
    }
    linear_bf16_avx512(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}

void it_linear_bf16(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    void* scratch = aligned_alloc(64, (size_t)bf16_scratch_bytes(M, K));
    linear_bf16(x, ldx, w, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}

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

static inline void dequant_rows(const qweight* q, int64_t n0, int64_t rows, int64_t K, bf16* out) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = n0 + r;
        if (q->kind == 1)
            dequant_w8_row((const int8_t*)q->w + n * K, w8_scale(q->scale, q->scale_is_f32, n), out + r * K, K);
        else
            dequant_w4_row((const uint8_t*)q->w + n * (K / 2), (const float*)q->scale + n * (K / q->gs),
                           q->zero + n * (K / q->gs), q->gs, out + r * K, K);
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
            amx_rows(buf, xt, bias, y, ldy, mr, n0, nblk, K);
        }
        _tile_release();
    }
}

/* Any M: up to 16 rows one pass decoding tile by tile, more on the 2 x 2 blocked GEMM, each thread decoding 64
 * features of W at a time; epi as linear_bf16c's. Returns 0, or -2 where the shapes or the CPU do not fit (N % 16,
 * K % 32, no AMX). */
int it_linear_bf16c(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy, int64_t M,
                    int64_t N, int64_t K, int nthreads, int64_t inter, int epi) {
    if (amx_state != 1 || M < 1 || N % 16 || K % 32) return -2;
    if (inter && (N != 2 * inter || inter % 16 || bias)) return -3;
    bf16* scratch = M > 16 ? aligned_alloc(64, (size_t)bf16c_scratch_bytes(M, K)) : NULL;
    bf16* wdec = M > 16 ? aligned_alloc(64, (size_t)bf16c_dec_bytes(M, N, K, nthreads)) : NULL;
    linear_bf16c(x, ldx, cw, bias, y, ldy, M, N, K, nthreads, scratch, wdec, inter, epi);
    free(wdec);
    free(scratch);
    return 0;
}

/* How many slabs of K the tile GEMM cuts an M-row product into (1: K in one piece, the sums kept in the tiles) */
int64_t it_bf16c_slabs(int64_t M, int64_t K) {
    if (M <= 16 || K % 32) return 1;
    const int64_t KS = K / 32, KSL = bf16c_slab_ks(M, K);
    return (KS + KSL - 1) / KSL;
}

/* Packing (kernels/cpu.py pack_bf16c drives it): the histogram of high bytes; then the codes of every tile, with
 * each tile's count of weights outside the table; then the escapes' positions and values (esc_start filled). */
void it_bf16c_hist(const bf16* w, int64_t n, int64_t* hist, int nthreads) {
    memset(hist, 0, 256 * sizeof(int64_t));
    const int nt = pick_threads(nthreads, n * 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        int64_t mine[256] = {0};
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) mine[w[i] >> 8]++;
#pragma omp critical
        for (int h = 0; h < 256; h++) hist[h] += mine[h];
    }
}

/* Byte s of a row pair's stored low bytes is weight BF16C_ORDER[s] of the pair (row r's 32, then row r + 1's):
 * VPUNPCKLBW / VPUNPCKHBW interleave bytes 0-7 / 8-15 of each 128-bit lane, so s = 16 L + 8 h + j carries weight
 * 32 h + 8 L + j, and the low unpack gives row r in order, the high one row r + 1. */
static const uint8_t BF16C_ORDER[64] = {0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35, 36, 37, 38, 39,
                                        8, 9, 10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
                                        16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
                                        24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};

/* 16 x 16 32-bit words: out row i = column i of the 16 rows at src (row strides ld and ldo, in bf16) */
static inline void transpose_pairs16(const bf16* src, int64_t ld, bf16* out, int64_t ldo) {
    float t[256] __attribute__((aligned(64)));
    __m512 r[16];
    for (int i = 0; i < 16; i++) _mm512_store_si512((void*)(t + 16 * i), _mm512_loadu_si512((const void*)(src + i * ld)));
    transpose16x16_ps(t, r);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512((void*)(out + ldo * i), _mm512_castps_si512(r[i]));
}

/* Tile (chunk c, k-step ks) of w [N, K] in the decoded order: vt [64][32], row 16 g + p = features 16 g .. +15 of
 * chunk c, each its weights 2 p and 2 p + 1; zero for features past N. inter > 0: w is a gate_up [2 inter, K]
 * packed with gate and up interleaved 16 by 16 (feature tile 2 i: gate rows 16 i.., 2 i + 1: up rows inter + 16 i..) */
static void vnni_tile(const bf16* w, int64_t N, int64_t K, int64_t inter, int64_t c, int64_t ks, bf16* vt) {
    for (int g = 0; g < 4; g++) {
        const int64_t n = c * 64 + 16 * g, tile = n / 16;
        const int64_t row = inter ? (tile % 2) * inter + (tile / 2) * 16 : n;
        if (n >= N) memset(vt + g * 512, 0, 1024);
        else transpose_pairs16(w + row * K + ks * 32, K, vt + g * 512, 32);
    }
}

__attribute__((target("avx512vbmi")))
void it_bf16c_pack(const bf16* w, int64_t N, int64_t K, int64_t inter, const uint8_t* table, uint8_t* codes, int32_t* esc_count,
                   int nthreads) {
    const int64_t nchunks = (N + 63) / 64, KS = K / 32;
    const __m512i order = _mm512_loadu_si512((const void*)BF16C_ORDER);
#pragma omp parallel for num_threads(pick_threads(nchunks, N * K * 2, nthreads)) schedule(static)
    for (int64_t c = 0; c < nchunks; c++)
        for (int64_t ks = 0; ks < KS; ks++) {
            uint8_t* b = codes + (c * KS + ks) * BF16C_TILE_BYTES;
            bf16 vt[64 * 32] __attribute__((aligned(64)));
            vnni_tile(w, N, K, inter, c, ks, vt);
            int32_t esc = 0;
            for (int r = 0; r < 64; r += 2) {
                uint8_t* p = b + r * 48;
                if (c * 64 + (r / 16) * 16 >= N) { /* the rows of a padding feature tile */
                    memset(p, 0, 96);
                    continue;
                }
                const __m512i v0 = _mm512_loadu_si512((const void*)(vt + r * 32));
                const __m512i v1 = _mm512_loadu_si512((const void*)(vt + (r + 1) * 32));
                const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(v0)),
                                                      _mm512_cvtepi16_epi8(v1), 1);
                const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(v0, 8))),
                                                      _mm512_cvtepi16_epi8(_mm512_srli_epi16(v1, 8)), 1);
                __m512i code = _mm512_setzero_si512();
                __mmask64 found = 0;
                for (int t = 0; t < 16; t++) {
                    const __mmask64 m = _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)table[t]));
                    code = _mm512_mask_mov_epi8(code, m, _mm512_set1_epi8((char)t));
                    found |= m;
                }
                esc += 64 - __builtin_popcountll(found);
                const __m512i cs = _mm512_permutexvar_epi8(order, code);
                _mm512_storeu_si512((void*)p, _mm512_permutexvar_epi8(order, lo));
                _mm256_storeu_si256((__m256i*)(p + 64), _mm256_or_si256(_mm512_castsi512_si256(cs),
                                    _mm256_slli_epi16(_mm512_extracti64x4_epi64(cs, 1), 4)));
            }
            esc_count[c * KS + ks] = esc;
        }
}

/* esc_start [tiles + 1] (the prefix sums of esc_count) given; fills esc_pos / esc_val tile by tile */
void it_bf16c_escapes(const bf16* w, int64_t N, int64_t K, int64_t inter, const int8_t* code_of, const int32_t* esc_start,
                      uint16_t* esc_pos, bf16* esc_val, int nthreads) {
    const int64_t nchunks = (N + 63) / 64, KS = K / 32;
#pragma omp parallel for num_threads(pick_threads(nchunks, N * K * 2, nthreads)) schedule(static)
    for (int64_t c = 0; c < nchunks; c++)
        for (int64_t ks = 0; ks < KS; ks++) {
            int32_t e = esc_start[c * KS + ks];
            if (e == esc_start[c * KS + ks + 1]) continue; /* most tiles have none */
            bf16 vt[64 * 32] __attribute__((aligned(64)));
            vnni_tile(w, N, K, inter, c, ks, vt);
            for (int r = 0; r < 64 && c * 64 + (r / 16) * 16 < N; r++)
                for (int j = 0; j < 32; j++) {
                    const bf16 v = vt[r * 32 + j];
                    if (code_of[v >> 8] < 0) { esc_pos[e] = (uint16_t)(r * 32 + j); esc_val[e] = v; e++; }
                }
        }
}

/* The bf16 weight [N, K] back from the 12-bit layout (for prefills' GEMMs and tests) */
void it_unpack_bf16c(const bf16c* cw, bf16* w, int64_t N, int64_t K, int nthreads) {
    const int64_t nchunks = (N + 63) / 64;
    const int nt = pick_threads(nchunks, N * K * 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            const int ng = (int)((N - c * 64) / 16 < 4 ? (N - c * 64) / 16 : 4);
            bf16 vt[64 * 32] __attribute__((aligned(64)));
            for (int64_t ks = 0; ks < K / 32; ks++) {
                bf16c_tile(cw, K / 32, c, ks, 16 * ng, vt, 32);
                for (int g = 0; g < ng; g++) /* the transpose of 32-bit words undoes itself */
                    transpose_pairs16(vt + g * 512, 32, w + (c * 64 + 16 * g) * K + ks * 32, K);
            }
        }
    }
}

/* Whether linear_w8 / linear_w4 take the AMX path for these shapes */
static inline int use_q_amx(int64_t M, int64_t N, int64_t K) {
    return amx_state == 1 && M >= AMX_MIN_ROWS && M <= 16 && K % 32 == 0 && N >= 16;
}

/* ------------------------------------------------------------------ activations to int16 */

/* x [M, K] bf16 -> xq [M, Kp] int16 (zero padded to Kp, a multiple of 32), sx[m] = max|x_m| / 32767,
 * xsum[m * G + g] = sum of x over group g (of size gs) when xsum is not NULL. */
/* Activations are rounded to integers in [-X_QMAX, X_QMAX]: 127 * 256, so that the int8 kernel can split each
 * into two signed bytes (w8_block). */
#define X_QMAX 32512.0f

static void quantize_rows_i16(const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int16_t* xq,
                              float* sx, float* xsum, int64_t gs) {
    for (int64_t m = 0; m < M; m++) {
        const bf16* xr = x + m * ldx;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float a = fabsf(bf2f(xr[k]));
            amax = a > amax ? a : amax;
        }
        float s = amax > 0.0f ? amax / X_QMAX : 1.0f;
        float inv = 1.0f / s;
        sx[m] = s;
        int16_t* q = xq + m * Kp;
        for (int64_t k = 0; k < K; k++) {
            float v = nearbyintf(bf2f(xr[k]) * inv);
            v = v > X_QMAX ? X_QMAX : (v < -X_QMAX ? -X_QMAX : v);
            q[k] = (int16_t)v;
        }
        for (int64_t k = K; k < Kp; k++) q[k] = 0;
        if (xsum) {
            for (int64_t g = 0; g < K / gs; g++) {
                float t = 0.0f;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) t += bf2f(xr[k]);
                xsum[m * (K / gs) + g] = t;
            }
        }
    }
}

/* ------------------------------------------------------------------ int8 weights, int16 activations */

/* x_q = 256 h + l with l = ((x_q + 128) & 255) - 128 and h = (x_q - l) / 256, both signed bytes (|x_q| <= 32512
 * keeps h <= 127, see quantize_rows_i16). The weight goes in as the unsigned operand of VPDPBUSD, flipped to
 * q + 128 with one XOR, 64 columns per instruction:
 *   sum q x_q = 256 (sum (q + 128) h - 128 sum h) + (sum (q + 128) l - 128 sum l)
 * Lanes sum 4 products of at most 255 * 128 per instruction, so int32 holds any K below ~4M. */
static inline __attribute__((always_inline)) void w8_block(
    const int8_t* xh, const int8_t* xl, int64_t Kp, const int32_t* hsum, const int32_t* lsum, int mr,
    const int8_t* w, int nr, int64_t K, float out[MR][NR]) {
    __m512i ah[MR][NR], al[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) ah[i][j] = al[i][j] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += 64) {
        const int64_t left = K - k;
        const __mmask64 m = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        __m512i wv[NR];
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                _mm_prefetch((const char*)(w + j * K + k) + PF_BYTES / 2, _MM_HINT_T0);
                /* past K: q = 0 -> 128, against x = 0 (padded): no contribution */
                wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + j * K + k), flip);
            }
        }
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                const __m512i hv = _mm512_loadu_si512(xh + i * Kp + k), lv = _mm512_loadu_si512(xl + i * Kp + k);
                for (int j = 0; j < NR; j++) {
                    if (j < nr) {
                        ah[i][j] = _mm512_dpbusd_epi32(ah[i][j], wv[j], hv);
                        al[i][j] = _mm512_dpbusd_epi32(al[i][j], wv[j], lv);
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

/* x_q (int16 rows, padded to Kp) -> the signed bytes h and l of each value and their row sums */
static void split_rows_i16(const int16_t* xq, int64_t M, int64_t Kp, int8_t* xh, int8_t* xl, int32_t* hsum,
                           int32_t* lsum) {
    for (int64_t m = 0; m < M; m++) {
        int32_t hs = 0, ls = 0;
        for (int64_t k = 0; k < Kp; k++) {
            const int32_t v = xq[m * Kp + k], l = ((v + 128) & 255) - 128, h = (v - l) / 256;
            xh[m * Kp + k] = (int8_t)h;
            xl[m * Kp + k] = (int8_t)l;
            hs += h;
            ls += l;
        }
        hsum[m] = hs;
        lsum[m] = ls;
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

/* scale: per output row, bf16 (scale_is_f32 = 0) or fp32 (1). scratch: qlin_scratch_bytes(M, K, nthreads). */
static void linear_w8(const bf16* x, int64_t ldx, const int8_t* w, const void* scale, int scale_is_f32,
                      const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch) {
    if (use_q_amx(M, N, K)) {
        const qweight q = {1, w, scale, scale_is_f32, NULL, 0};
        const int64_t n16 = N & ~(int64_t)15;
        linear_q_amx(&q, x, ldx, bias, y, ldy, M, n16, K, nthreads, (char*)scratch + w8_scratch_bytes(M, K));
        if (n16 == N) return;
        w += n16 * K; /* the last N % 16 features: the VNNI path below */
        scale = (const char*)scale + n16 * (scale_is_f32 ? 4 : 2);
        bias = bias ? bias + n16 : NULL;
        y += n16;
        N -= n16;
    }
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    int8_t* xh = (int8_t*)(sx + M + M * (K / 32 + 1));
    int8_t* xl = xh + M * Kp;
    int32_t* hsum = (int32_t*)(xl + M * Kp);
    int32_t* lsum = hsum + M;
    quantize_rows_i16(x, ldx, M, K, Kp, xq, sx, NULL, 1);
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
    void* scratch = aligned_alloc(64, (size_t)qlin_scratch_bytes(M, K, nthreads));
    linear_w8(x, ldx, w, scale, scale_is_f32, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}

/* ------------------------------------------------------------------ int4 weights, int16 activations
 *
 * Layout (kernels/cpu.py pack_w4): row n of W is K / 2 bytes; in each run of 64 columns starting at k0, byte
 * b (0..31) holds column k0 + b in its low nibble and k0 + 32 + b in its high nibble, so one 32-byte load
 * widens to 32 int16 whose low and high nibbles are columns k0 .. k0 + 31 and k0 + 32 .. k0 + 63. Values q in
 * 0..15 with, per row and group of gs columns (gs a multiple of 64), w = q * scale + zero (fp32 [N, K / gs]).
 */
static inline __attribute__((always_inline)) void w4_block(
    const int16_t* xq, int64_t Kp, const float* xsum, int mr, const uint8_t* w, int nr, int64_t K, int64_t gs,
    const float* scale, const float* zero, float out[MR][NR], float zout[MR][NR]) {
    const int64_t G = K / gs;
    __m512 accf[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) accf[i][j] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi16(0x0f);
    for (int64_t g = 0; g < G; g++) {
        __m512i acc[MR][NR];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 64) {
            __m512i wlo[NR], whi[NR];
            for (int j = 0; j < NR; j++) {
                if (j < nr) {
                    const uint8_t* p = w + j * (K / 2) + k / 2;
                    _mm_prefetch((const char*)p + PF_BYTES, _MM_HINT_T0);
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

#define W4_CASE(MRC, NRC) w4_block(xq + m0 * Kp, Kp, xsum + m0 * G, MRC, wb, NRC, K, gs, scale + n0 * G, \
                                   zero + n0 * G, out, zout)

/* scratch: qlin_scratch_bytes(M, K, nthreads), aligned */
static void linear_w4(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero, int64_t gs,
                      const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch) {
    if (use_q_amx(M, N, K)) {
        const qweight q = {2, w, scale, 0, zero, gs};
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
    const int64_t Kp = (K + 31) & ~(int64_t)31, G = K / gs;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    float* xsum = sx + M;
    quantize_rows_i16(x, ldx, M, K, Kp, xq, sx, xsum, gs);
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
    void* scratch = aligned_alloc(64, (size_t)qlin_scratch_bytes(M, K, nthreads));
    linear_w4(x, ldx, w, scale, zero, gs, bias, y, ldy, M, N, K, nthreads, scratch);
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
    for (int64_t n = 0; n < N; n++) dequant_w8_row(q + n * K, w8_scale(scale, scale_is_f32, n), out + n * K, K);
}

void it_dequant_w4(const uint8_t* packed, const float* scale, const float* zero, int64_t gs, bf16* out, int64_t N,
                   int64_t K, int nthreads) {
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) dequant_w4_row(packed + n * (K / 2), scale + n * G, zero + n * G, gs, out + n * K, K);
}

/* ------------------------------------------------------------------ a whole decode step of a Llama decoder
 *
 * it_decode_layers runs every decoder layer of a decode-only step (T <= 16 sequences, one new token each) in one
 * call: per layer RMSNorm, the qkv projection, rotary, the K/V write into the paged cache, attention over each
 * sequence's blocks, o_proj and the residual, RMSNorm, gate/up, SiLU-and-multiply, down and the residual. It
 * rounds to bf16 where the PyTorch path (models/llama.py) does, so the two agree to bf16 rounding; what it
 * saves is the ~15 ms of per-op dispatch a 24-layer step otherwise spends outside the matmuls. All scratch
 * lives in one caller-owned workspace (it_decode_workspace_bytes): the step allocates nothing.
 */

typedef struct {
    int32_t kind;         /* 0: bf16 weight [N, K]; 1: int8 [N, K], per-row scale; 2: int4 (it_linear_w4's layout);
                             3: bf16 in 12 bits (w points at a bf16c; N % 16 == 0, K % 32 == 0, AMX) */
    int32_t scale_is_f32; /* kind 1: scale is fp32 (1) or bf16 (0) */
    const void* w;
    const void* scale;    /* kind 1: [N]; kind 2: fp32 [N, K / group] */
    const bf16* bias;     /* [N] or NULL */
    int64_t N, K;
    const float* zero;    /* kind 2: fp32 [N, K / group] */
    int64_t group;        /* kind 2: columns per group */
    int64_t inter;        /* kind 3: > 0 where the weight is a gate_up with gate and up rows interleaved 16 by 16
                             (linear_bf16c); the MLP then takes act straight from its tiles */
} it_lin;

typedef struct {
    const bf16* input_norm;    /* [hidden] */
    const bf16* post_norm;     /* [hidden] */
    it_lin qkv, o, gate_up, down;
    void* kv_cache;            /* [2, num_blocks, block_size, Hkv, D] bf16 (or int8 rows, see it_model.kv_int8) */
} it_layer;

typedef struct {
    int64_t hidden, n_heads, n_kv_heads, head_dim, inter;
    int64_t num_blocks, block_size;
    const float* cos_sin;      /* [max_position, head_dim]: cos of the D/2 frequencies, then sin */
    float eps, scale;
    int32_t nthreads, n_layers;
    int32_t kv_int8; /* 1: the cache holds int8 rows of D values + their fp32 scale (layers/attention/paged.py
                        Int8PagedAttention), [2, num_blocks, block_size, Hkv, D + 4] bytes */
    int32_t gate_up_fused; /* 1: every layer's gate_up hands act straight over (it_lin.inter): no [T, 2I] scratch */
} it_model;

typedef struct {
    int64_t T;                   /* decode rows, one per sequence */
    const int64_t* positions;    /* [T] */
    const int64_t* slots;        /* [T] cache slot of each new token */
    const int64_t* block_tables; /* [T, max_blocks] */
    const int64_t* context_lens; /* [T], the new token included */
    int64_t max_blocks;
    void* work;                  /* it_decode_workspace_bytes(model, T, max_blocks * block_size) bytes, aligned */
    int64_t work_bytes;
    const int64_t* out_rows;     /* [n_out], ascending: the rows whose hidden state the caller reads (the last of
                                    each sampled sequence); n_out = 0: every row */
    int64_t n_out;
} it_step;

#define ALIGN64(n) (((n) + 63) & ~(int64_t)63)

static int64_t lin_scratch_bytes(int64_t T, int64_t K, int nthreads) {
    /* (int8 / int4 weights only ever see decode rows here: steps with prompts take bf16 projections only) */
    const int64_t amx = bf16_scratch_bytes(T, K), w8 = qlin_scratch_bytes(T < 16 ? T : 16, K, nthreads);
    return ALIGN64(amx > w8 ? amx : w8);
}

typedef struct {
    float* sc;   /* [G, max_ctx] scores, fp32 */
    bf16* pb;    /* [G, ldp] exponentials, bf16, zero past len up to a multiple of 32 */
    bf16* qt;    /* [D / 32][16 pairs][16 heads][2] */
    float* cbuf; /* [16, 16] */
    bf16* tmp;   /* [32, D] gathered or dequantized K/V rows */
    bf16* vb;    /* [2][16 pairs][16 dims][2] */
    bf16* zero;  /* [D] */
    bf16* vpack; /* steps of prompt rows only: [max_ctx / 32][D / 16][16 pairs][16 dims][2], a sequence's V as tiles */
    int64_t ldp;
} attn_ws;

static inline int64_t attn_ldp(int64_t max_ctx) { return (max_ctx + 31) & ~(int64_t)31; }

/* per attention thread, in floats: the parts of attn_ws, each 64-byte aligned */
/* Rows of scores per attention thread: a decode row's query heads (up to 16 at a time), or, in steps of more than
 * 16 rows (prompts), 16 rows of one query head (attn_rows_amx) */
static inline int64_t attn_score_rows(int64_t group, int64_t T) { return T > 16 || group > 16 ? 16 : group; }

static inline int64_t attn_floats(int64_t G, int64_t max_ctx, int64_t D, int rows) {
    return ALIGN64(G * max_ctx * 4) / 4 + ALIGN64(G * attn_ldp(max_ctx) * 2) / 4 + ALIGN64(D * 32) / 4 + 256 +
           ALIGN64(32 * D * 2) / 4 + 512 + ALIGN64(D * 2) / 4 + (rows ? ALIGN64(attn_ldp(max_ctx) * D * 2) / 4 : 0);
}

static attn_ws attn_workspace(float* base, int64_t G, int64_t max_ctx, int64_t D) {
    attn_ws w;
    char* p = (char*)base;
    w.ldp = attn_ldp(max_ctx);
    w.sc = (float*)p;   p += ALIGN64(G * max_ctx * 4);
    w.pb = (bf16*)p;    p += ALIGN64(G * w.ldp * 2);
    w.qt = (bf16*)p;    p += ALIGN64(D * 32);
    w.cbuf = (float*)p; p += 1024;
    w.tmp = (bf16*)p;   p += ALIGN64(32 * D * 2);
    w.vb = (bf16*)p;    p += 2048;
    w.zero = (bf16*)p;  p += ALIGN64(D * 2);
    w.vpack = (bf16*)p; /* (there only where attn_floats counted it) */
    return w;
}


/* Offsets of the workspace's parts, in bytes. */
typedef struct { int64_t h, qkv, o, gu, act, y, lin, dec, attn, total; } ws_layout;

static ws_layout workspace(const it_model* m, int64_t T, int64_t max_ctx) {
    ws_layout l;
    const int64_t hq = m->n_heads * m->head_dim, qkv = (m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    const int64_t group = m->n_heads / m->n_kv_heads;
    int64_t off = 0;
    l.h = off;    off += ALIGN64(T * m->hidden * 2);
    l.qkv = off;  off += ALIGN64(T * qkv * 2);
    l.o = off;    off += ALIGN64(T * hq * 2);
    l.gu = off;   off += m->gate_up_fused ? 0 : ALIGN64(T * 2 * m->inter * 2);
    l.act = off;  off += ALIGN64(T * m->inter * 2);
    l.y = off;    off += ALIGN64(T * m->hidden * 2);
    /* a linear's scratch: the largest over the layers' input widths (the transposed block of the tile GEMM is not
       monotonic in K); past 16 rows then each thread's [64, K] rows of a 12-bit weight, decoded for the GEMM */
    int64_t lin = 0;
    const int64_t widths[3] = {m->hidden, hq, m->inter};
    for (int i = 0; i < 3; i++) {
        const int64_t b = lin_scratch_bytes(T, widths[i], m->nthreads);
        lin = b > lin ? b : lin;
    }
    l.lin = off;  off += lin;
    /* (the largest over the four projections' shapes; bf16 ones need less) */
    const int64_t shapes[4][2] = {{qkv, m->hidden}, {m->hidden, hq}, {2 * m->inter, m->hidden}, {m->hidden, m->inter}};
    int64_t dec = 0;
    for (int i = 0; i < 4; i++) {
        const int64_t b = bf16c_dec_bytes(T, (shapes[i][0] + 15) / 16 * 16, shapes[i][1], m->nthreads);
        dec = b > dec ? b : dec;
    }
    l.dec = off;  off += ALIGN64(dec);
    /* attention, per thread: scores [group, max_ctx] and output accumulators [group, D], fp32 */
    l.attn = off; off += ALIGN64((int64_t)(m->nthreads > 0 ? m->nthreads : 1) *
                                 attn_floats(attn_score_rows(group, T), max_ctx, m->head_dim, T > 16) * 4);
    l.total = off;
    return l;
}

int64_t it_decode_workspace_bytes(const it_model* m, int64_t T, int64_t max_ctx) {
    return workspace(m, T, max_ctx).total;
}

/* x[t] = bf16(x[t] + y[t]), as f2bf rounds (NaN kept quiet) */
static void add_rows(bf16* x, const bf16* y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = mask16(n - i);
        store_sum_bf16x16(x + i, load_bf16x16(x + i, m), load_bf16x16(y + i, m), m);
    }
}

static void run_lin(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                    void* scratch, bf16* dec, int silu) { /* (silu: a 12-bit gate_up's act, see linear_bf16c) */
    if (L->kind == 0)
        linear_bf16(x, ldx, (const bf16*)L->w, L->bias, y, ldy, M, L->N, L->K, nthreads, scratch);
    else if (L->kind == 3) /* past 16 rows (a fused prefill's) each thread decodes 64 features of W at a time into dec */
        linear_bf16c(x, ldx, (const bf16c*)L->w, L->bias, y, ldy, M, L->N, L->K, nthreads, (bf16*)scratch, dec,
                     L->inter, silu);
    else if (L->kind == 2)
        linear_w4(x, ldx, (const uint8_t*)L->w, (const float*)L->scale, L->zero, L->group, L->bias, y, ldy, M, L->N,
                  L->K, nthreads, scratch);
    else
        linear_w8(x, ldx, (const int8_t*)L->w, L->scale, L->scale_is_f32, L->bias, y, ldy, M, L->N, L->K, nthreads,
                  scratch);
}

/* x_res += x W^T (+ bias), each product rounded to bf16 first: a 12-bit weight adds in its epilogue, any other
 * writes y, then add_rows */
static void run_lin_add(const it_lin* L, const bf16* x, int64_t ldx, bf16* x_res, bf16* y, int64_t H, int64_t M,
                        int nthreads, void* scratch, bf16* dec) { /* x_res, y: [M, H] */
    if (L->kind == 3 && !L->inter) {
        linear_bf16c(x, ldx, (const bf16c*)L->w, L->bias, x_res, H, M, L->N, L->K, nthreads, (bf16*)scratch, dec, 0, 1);
    } else {
        run_lin(L, x, ldx, y, H, M, nthreads, scratch, dec, 0);
        add_rows(x_res, y, M * H);
    }
}

/* out = w * bf16(x / rms(x)), as RMSNorm in layers/norm.py rounds */
static inline int rows_threads(int64_t T, int64_t elems, int nthreads) {
    return (T > 1 && elems >= (1 << 16) && nthreads > 1) ? (int)(T < nthreads ? T : nthreads) : 1;
}


static void rmsnorm_rows(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(rows_threads(T, T * H, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16* xr = x + t * H;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 m = mask16(H - i);
            const __m512 v = load_bf16x16(xr + i, m);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 m = mask16(H - i);
            const __m512 n = bf16_round_f32(_mm512_mul_ps(load_bf16x16(xr + i, m), r));
            _mm256_mask_storeu_epi16(out + t * H + i, m, round_bf16x16(_mm512_mul_ps(load_bf16x16(w + i, m), n)));
        }
    }
}


/* act[t, i] = bf16(bf16(silu(g)) * u), gate | up side by side in gu [T, 2I] (layers/activation.py) */
static void silu_mul_rows(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(rows_threads(T, T * I, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16* g = gu + t * 2 * I;
        const bf16* u = g + I;
        bf16* a = act + t * I;
        int64_t i = 0;
        for (; i + 64 <= I; i += 64) { /* four independent vectors a pass: the exp chains overlap */
            __m512 sv[4];
            for (int j = 0; j < 4; j++) sv[j] = silu512(load_bf16x16(g + i + 16 * j, 0xffff));
            for (int j = 0; j < 4; j++)
                _mm256_storeu_si256((__m256i*)(a + i + 16 * j),
                                    round_bf16x16(_mm512_mul_ps(bf16_round_f32(sv[j]), load_bf16x16(u + i + 16 * j, 0xffff))));
        }
        for (; i < I; i += 16) {
            const __mmask16 m = mask16(I - i);
            const __m512 s = silu512(load_bf16x16(g + i, m));
            _mm256_mask_storeu_epi16(a + i, m, round_bf16x16(_mm512_mul_ps(bf16_round_f32(s), load_bf16x16(u + i, m))));
        }
    }
}

/* rotary (rotate-half) of q and k heads in qkv [T, (Hq + 2 Hkv) D], in fp32, rounded once to bf16 */
/* Rotate `heads` heads of D at the start of each row of qk (row stride ld) in place: cs[t] (row stride ld_cs)
 * holds the D / 2 cosines then the D / 2 sines of row t's position. fp32 products, one rounding to bf16. */
static void rotary_apply(bf16* qk, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cs, int64_t ld_cs,
                         const int64_t* positions, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(rows_threads(T, T * heads * D, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cs + (positions ? positions[t] : t) * ld_cs;
        for (int64_t h = 0; h < heads; h++) {
            bf16* v = qk + t * ld + h * D;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = mask16(half - i);
                const __m512 x1 = load_bf16x16(v + i, m), x2 = load_bf16x16(v + half + i, m);
                const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, c + half + i);
                const __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
                const __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
                _mm256_mask_storeu_epi16(v + i, m, round_bf16x16(o1));
                _mm256_mask_storeu_epi16(v + half + i, m, round_bf16x16(o2));
            }
        }
    }
}

static void rotary_rows(const it_model* m, const it_step* s, bf16* qkv) {
    const int64_t D = m->head_dim, width = (m->n_heads + 2 * m->n_kv_heads) * D;
    rotary_apply(qkv, width, s->T, m->n_heads + m->n_kv_heads, D, m->cos_sin, D, s->positions, m->nthreads);
}

/* Lane j of the result = the sum of the 16 lanes of v[j]: four rounds of shuffles and adds, then one permute. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* quarters 0-1: partials of v[2i]; 2-3: of v[2i + 1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter q: partials of v[4i + q] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* in quarter q: two partials of v[8i + q], two of v[8i + 4 + q] */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    /* element 4q + s: the total of v[4s + q] */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, r);
}

/* Cache row `row` (slot * Hkv + head) of K (which = 0) or V (1) as bf16: in place for a bf16 cache; for an int8
 * cache dequantized into tmp, rounded to bf16 as Int8PagedAttention._decoded does. */
static inline const bf16* kv_row(const it_model* m, const void* cache, int which, int64_t row, bf16* tmp) {
    const int64_t D = m->head_dim, rows = m->num_blocks * m->block_size * m->n_kv_heads;
    if (!m->kv_int8) return (const bf16*)cache + (which * rows + row) * D;
    const int8_t* q = (const int8_t*)cache + (which * rows + row) * (D + 4);
    float sc;
    memcpy(&sc, q + D, 4);
    for (int64_t d = 0; d < D; d++) tmp[d] = f2bf((float)q[d] * sc);
    return tmp;
}

/* The cache slot of key j of a sequence with block table `table` (bs, the block size, is a power of two: a 64-bit
 * division here had cost more than the dot products) */
static inline int64_t kv_slot(const int64_t* table, int64_t j, int64_t bs) {
    const int sh = __builtin_ctzll((unsigned long long)bs);
    return (table[j >> sh] << sh) | (j & (bs - 1));
}

/* K (0) or V (1) rows of keys j0 .. j0 + nb - 1 of a sequence (block table `table`, kv head g) into rows[] */
static inline void kv_rows(const it_model* m, const void* cache, int which, const int64_t* table, int64_t j0, int nb,
                           int64_t g, bf16* tmp, const bf16** rows) {
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads;
    for (int jj = 0; jj < nb; jj++) {
        const int64_t j = j0 + jj;
        rows[jj] = kv_row(m, cache, which, kv_slot(table, j, bs) * hkv + g, tmp + jj * D);
    }
}

/* Asks for the cache lines of entries i0 .. i0 + 15 of one sequence's K/V stream (its K rows 0 .. len - 1, then its
 * V rows; a bf16 cache) ahead of their use: the rows sit in scattered blocks the hardware prefetchers do not follow. */
static inline void kv_prefetch(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                               int64_t i0) {
    if (m->kv_int8) return;
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads, rows = m->num_blocks * bs * hkv;
    const int64_t end = i0 + 16 < 2 * len ? i0 + 16 : 2 * len;
    for (int64_t i = i0; i < end; i++) {
        const int64_t which = i >= len, j = i - which * len;
        const char* r = (const char*)((const bf16*)cache + (which * rows + kv_slot(table, j, bs) * hkv + g) * D);
        for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
    }
}

/* Write one K or V row (bf16 [D]) into the cache; int8: symmetric amax / 127 scale, as Int8PagedAttention. */
static inline void kv_write(const it_model* m, void* cache, int which, int64_t row, const bf16* x) {
    const int64_t D = m->head_dim, rows = m->num_blocks * m->block_size * m->n_kv_heads;
    if (!m->kv_int8) {
        memcpy((bf16*)cache + (which * rows + row) * D, x, (size_t)D * 2);
        return;
    }
    int8_t* q = (int8_t*)cache + (which * rows + row) * (D + 4);
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) { const float a = fabsf(bf2f(x[d])); amax = a > amax ? a : amax; }
    float sc = amax / 127.0f;
    sc = sc < 1e-8f ? 1e-8f : sc;
    for (int64_t d = 0; d < D; d++) {
        float v = nearbyintf(bf2f(x[d]) / sc);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[d] = (int8_t)v;
    }
    memcpy(q + D, &sc, 4);
}

/* Scores of G query heads (q, rows D apart) against keys 0 .. len - 1 of one sequence and KV head g, times the
 * softmax scale, into sc [G, max_ctx]. 16 keys a pass: per head, 16 dot-product vectors (one per key, over D in
 * bf16 pairs), summed across lanes together. A pass always covers 16 keys (a zero row past the end) so the 16
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void attn_scores(const it_model* m, const void* cache,
                                                              const int64_t* table, int64_t len, int64_t g,
                                                              const bf16* q, const int G, float* sc,
                                                              int64_t max_ctx, bf16* tmp, const bf16* zero) {
    const int64_t D = m->head_dim;
    const __m512 scale = _mm512_set1_ps(m->scale);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int nb = (int)(len - j0 < 16 ? len - j0 : 16);
        const bf16* kr[16];
        kv_prefetch(m, cache, table, len, g, j0 + PF_KEYS);
        kv_rows(m, cache, 0, table, j0, nb, g, tmp, kr);
        for (int jj = nb; jj < 16; jj++) kr[jj] = zero;
        for (int h = 0; h < G; h++) {
            __m512 a[16];
            for (int jj = 0; jj < 16; jj++) a[jj] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                const __mmask32 mk = D - d >= 32 ? (__mmask32)0xffffffffu : (__mmask32)0xffffu;
                const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mk, q + h * D + d);
                for (int jj = 0; jj < 16; jj++)
                    a[jj] = _mm512_dpbf16_ps(a[jj], qv, (__m512bh)_mm512_maskz_loadu_epi16(mk, kr[jj] + d));
            }
            _mm512_mask_storeu_ps(sc + h * max_ctx + j0, mask16(nb), _mm512_mul_ps(reduce16(a), scale));
        }
    }
}

/* the largest of r[0 .. len - 1], in every lane */
static inline __m512 row_max(const float* r, int64_t len) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = mask16(len - j);
        mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, r + j));
    }
    return _mm512_set1_ps(_mm512_reduce_max_ps(mv));
}

/* p = softmax(p) over len entries, in place */
static inline void softmax_row(float* r, int64_t len) {
    const __m512 mx = row_max(r, len);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = mask16(len - j);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, r + j), mx));
        _mm512_mask_storeu_ps(r + j, mk, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = mask16(len - j);
        _mm512_mask_storeu_ps(r + j, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, r + j), inv));
    }
}

/* o[h] = sum_j p[h, j] V[j] for the G heads, 32 dims a pass (one 64-byte line of each V row): the 2G accumulators
 * stay in registers over the whole sequence, and each probability is broadcast once for both 16-dim halves. */
static inline __attribute__((always_inline)) void attn_values(const it_model* m, const void* cache,
                                                              const int64_t* table, int64_t len, int64_t g,
                                                              const int G, const float* sc, int64_t max_ctx,
                                                              bf16* o, bf16* tmp) {
    const int64_t D = m->head_dim;
    for (int64_t d = 0; d < D; d += 32) {
        const int two = D - d >= 32;
        __m512 a0[8], a1[8];
        for (int h = 0; h < G; h++) { a0[h] = _mm512_setzero_ps(); a1[h] = _mm512_setzero_ps(); }
        for (int64_t j0 = 0; j0 < len; j0 += 16) {
            const int nb = (int)(len - j0 < 16 ? len - j0 : 16);
            const bf16* vr[16];
            if (d == 0) kv_prefetch(m, cache, table, len, g, len + j0 + PF_KEYS);
            kv_rows(m, cache, 1, table, j0, nb, g, tmp, vr);
            for (int jj = 0; jj < nb; jj++) {
                const __m512 v0 = load_bf16x16(vr[jj] + d, 0xffff);
                const __m512 v1 = load_bf16x16(vr[jj] + d + 16, two ? 0xffff : 0);
                for (int h = 0; h < G; h++) {
                    const __m512 p = _mm512_set1_ps(sc[h * max_ctx + j0 + jj]);
                    a0[h] = _mm512_fmadd_ps(p, v0, a0[h]);
                    a1[h] = _mm512_fmadd_ps(p, v1, a1[h]);
                }
            }
        }
        for (int h = 0; h < G; h++) {
            _mm256_storeu_si256((__m256i*)(o + h * D + d), round_bf16x16(a0[h]));
            if (two) _mm256_storeu_si256((__m256i*)(o + h * D + d + 16), round_bf16x16(a1[h]));
        }
    }
}

/* One sequence's attention for G (<= 8, a compile-time constant where inlined) query heads of KV head g */
static inline __attribute__((always_inline)) void attn_heads(const it_model* m, const void* cache,
                                                             const int64_t* table, int64_t len, int64_t g,
                                                             const bf16* q, const int G, float* sc, int64_t max_ctx,
                                                             bf16* o, bf16* tmp, const bf16* zero) {
    attn_scores(m, cache, table, len, g, q, G, sc, max_ctx, tmp, zero);
    for (int h = 0; h < G; h++) softmax_row(sc + h * max_ctx, len);
    attn_values(m, cache, table, len, g, G, sc, max_ctx, o, tmp);
}

#define ATTN_G(G) static void attn_heads_##G(const it_model* m, const void* cache, const int64_t* table, int64_t len, \
    int64_t g, const bf16* q, float* sc, int64_t max_ctx, bf16* o, bf16* tmp, const bf16* zero) { \
    attn_heads(m, cache, table, len, g, q, G, sc, max_ctx, o, tmp, zero); }
ATTN_G(1) ATTN_G(2) ATTN_G(3) ATTN_G(4) ATTN_G(5) ATTN_G(6) ATTN_G(7) ATTN_G(8)
#undef ATTN_G

typedef void (*attn_heads_fn)(const it_model*, const void*, const int64_t*, int64_t, int64_t, const bf16*, float*,
                              int64_t, bf16*, bf16*, const bf16*);
static const attn_heads_fn attn_heads_by_g[9] = {0, attn_heads_1, attn_heads_2, attn_heads_3, attn_heads_4,
                                                  attn_heads_5, attn_heads_6, attn_heads_7, attn_heads_8};

/* ---- the same attention on AMX tiles (head_dim a multiple of 32, up to 16 query heads a pass)
 *
 * Scores: C [16 keys, 16 heads] = K [16 keys, D] Q^T, the K rows loaded as tiles straight from the cache block
 * and Q^T (VNNI pairs, built once per task) as the B operand; the tile is transposed in registers into the
 * head-major rows of sc. Softmax over each head's row in fp32; the unnormalized exponentials go to P in bf16 (as
 * torch's CPU flash attention rounds them before its P V GEMM) and their fp32 sums divide the output at the end.
 * Values: C [heads, 16 dims] += P [heads, 32 keys] V [32 keys, 16 dims], V's rows interleaved into key pairs.
 */
/* words 2i, 2i + 1 of the result = word i of a, word i of b (two rows' 16 bf16, interleaved into key pairs) */
static inline __m512i pair_rows(const bf16* a, const bf16* b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                                         _mm256_loadu_si256((const __m256i*)b), 1);
    return _mm512_permutexvar_epi16(idx, x);
}

/* PV for one 32-key chunk into accumulator tile C (0-3) through B tile TB (5 or 6): B = the chunk's V rows, dims
 * d .. d + 15, in key pairs */
#define ATTN_PV_TILE(C, TB, d, vb)                                                                              \
    do {                                                                                                        \
        for (int p_ = 0; p_ < 16; p_++)                                                                         \
            _mm512_storeu_si512((vb) + p_ * 32, pair_rows(vr[2 * p_] + (d), vr[2 * p_ + 1] + (d)));             \
        _tile_loadd(TB, (vb), 64);                                                                              \
        _tile_dpbf16ps(C, 7, TB);                                                                               \
    } while (0)

/* One sequence's attention for G (<= 16) query heads q (rows D apart) of KV head g into o (rows D apart). Tiles
 * (configured by attn_tiles): 0-3 PV accumulators [G, 16], 4 K rows, 5-6 Q^T / V pairs, 7 P [G, 32 keys]; the
 * score accumulator reuses 6. */
/* A row of scores (its first len keys) -> softmax numerators in bf16 at p, zero from len up to len32 (P for the
 * tiles, as torch's CPU flash attention rounds it); returns 1 / their fp32 sum */
static inline float softmax_bf16_row(const float* r, int64_t len, int64_t len32, bf16* p) {
    const __m512 mx = row_max(r, len);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len32; j += 16) {
        const __mmask16 mk = j < len ? mask16(len - j) : 0;
        const __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, r + j), mx)));
        _mm256_storeu_si256((__m256i*)(p + j), round_bf16x16(e));
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* P V accumulators 0 .. nc - 1 (16 dims each) of nrows rows, times each row's 1 / sum, as bf16 into out (ldo apart) */
__attribute__((target("amx-tile,amx-bf16")))
static inline void attn_pv_out(const attn_ws* w, int nc, int nrows, const float* inv, bf16* out, int64_t ldo) {
    for (int c = 0; c < nc; c++) {
        if (c == 0) _tile_stored(0, w->cbuf, 64);
        if (c == 1) _tile_stored(1, w->cbuf, 64);
        if (c == 2) _tile_stored(2, w->cbuf, 64);
        if (c == 3) _tile_stored(3, w->cbuf, 64);
        for (int i = 0; i < nrows; i++)
            _mm256_storeu_si256((__m256i*)(out + i * ldo + 16 * c),
                                round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(w->cbuf + 16 * i), _mm512_set1_ps(inv[i]))));
    }
}

/* O = P V over the first len keys for the 16 rows of P in w->pb (each zero past its own keys up to a multiple of
 * 32), V read straight from the cache 32 keys a step, 64 dims (four accumulator tiles) a pass; row i < nrows of O,
 * times inv[i], is written to out + i * ldo as bf16. Tiles: 0-3 the accumulators, 7 P, 5-6 V in pairs of keys. */
__attribute__((target("amx-tile,amx-bf16")))
static void attn_pv_amx(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                        const attn_ws* w, int nrows, const float* inv, bf16* out, int64_t ldo) {
    const int64_t D = m->head_dim;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nc = (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j0 = 0; j0 < len; j0 += 32) {
            const bf16* vr[32];
            const int n0 = (int)(len - j0 < 16 ? len - j0 : 16);
            if (d0 == 0) kv_prefetch(m, cache, table, len, g, len + j0 + PF_KEYS);
            kv_rows(m, cache, 1, table, j0, n0, g, w->tmp, vr);
            if (j0 + 16 < len) {
                const int n1 = (int)(len - j0 - 16 < 16 ? len - j0 - 16 : 16);
                if (d0 == 0) kv_prefetch(m, cache, table, len, g, len + j0 + 16 + PF_KEYS);
                kv_rows(m, cache, 1, table, j0 + 16, n1, g, w->tmp + 16 * D, vr + 16);
                for (int jj = 16 + n1; jj < 32; jj++) vr[jj] = w->zero;
            } else {
                for (int jj = n0; jj < 32; jj++) vr[jj] = w->zero;
            }
            _tile_loadd(7, w->pb + j0, w->ldp * 2);
            ATTN_PV_TILE(0, 5, d0, w->vb);
            if (nc > 1) ATTN_PV_TILE(1, 6, d0 + 16, w->vb + 512);
            if (nc > 2) ATTN_PV_TILE(2, 5, d0 + 32, w->vb);
            if (nc > 3) ATTN_PV_TILE(3, 6, d0 + 48, w->vb + 512);
        }
        attn_pv_out(w, nc, nrows, inv, out + d0, ldo);
    }
}

__attribute__((target("amx-tile,amx-bf16")))
static void attn_heads_amx(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                           const bf16* q, int G, bf16* o, const attn_ws* w, int64_t max_ctx) {
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads;
    /* Q^T: the (k, k + 1) pair of head h is 32-bit word (k / 32) * 256 + ((k % 32) / 2) * 16 + h of qt */
    memset(w->qt, 0, (size_t)D * 32);
    const __m512i pairs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    for (int h = 0; h < G; h++)
        for (int64_t k = 0; k < D; k += 32)
            _mm512_i32scatter_epi32((int*)w->qt + (k / 32) * 256 + h, pairs, _mm512_loadu_si512(q + h * D + k), 4);
    const __m512 scale = _mm512_set1_ps(m->scale);
    /* scores, 16 keys a tile */
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int nb = (int)(len - j0 < 16 ? len - j0 : 16);
        kv_prefetch(m, cache, table, len, g, j0 + PF_KEYS);
        const bf16* kb;
        int64_t ldk;
        if (!m->kv_int8 && bs >= 16) { /* 16 keys of one block, rows hkv * D apart (past len: unused slots) */
            kb = (const bf16*)cache + (kv_slot(table, j0, bs) * hkv + g) * D;
            ldk = hkv * D * 2;
        } else {
            const bf16* kr[16];
            kv_rows(m, cache, 0, table, j0, nb, g, w->tmp + 16 * D, kr);
            for (int jj = 0; jj < 16; jj++) memcpy(w->tmp + jj * D, jj < nb ? kr[jj] : w->zero, (size_t)D * 2);
            kb = w->tmp;
            ldk = D * 2;
        }
        _tile_zero(6);
        for (int64_t k = 0; k < D; k += 32) {
            _tile_loadd(4, kb + k, ldk);
            _tile_loadd(5, w->qt + (k / 32) * 512, 64);
            _tile_dpbf16ps(6, 4, 5);
        }
        _tile_stored(6, w->cbuf, 64);
        __m512 s[16];
        transpose16x16_ps(w->cbuf, s); /* s[h] = the 16 keys' scores of head h */
        for (int h = 0; h < G; h++) _mm512_mask_storeu_ps(w->sc + h * max_ctx + j0, mask16(nb), _mm512_mul_ps(s[h], scale));
    }
    /* softmax numerators in bf16, zero up to the next multiple of 32 keys; their sums in fp32 */
    float inv[16];
    const int64_t len32 = (len + 31) & ~(int64_t)31;
    for (int h = 0; h < G; h++) inv[h] = softmax_bf16_row(w->sc + h * max_ctx, len, len32, w->pb + h * w->ldp);
    attn_pv_amx(m, cache, table, len, g, w, G, inv, o, D);
}

__attribute__((target("amx-tile")))
static void amx_release(void) { _tile_release(); }

/* This thread's tiles for attn_heads_amx with G heads: all eight, the PV accumulators (0-3) and P (7) G rows */
static inline void attn_tiles(int G) { amx_tiles(8, 4, G); }

/* Attention of each decode row over its sequence's paged K/V; o [T, Hq, D] bf16. One task per (row, KV head):
 * the group of query heads sharing that KV head (up to 16 at a time on AMX, 8 on AVX-512) reads each K/V row once. */
/* Rows t0 .. t0 + n - 1 (n <= 16) of one sequence at consecutive positions (a prompt's rows: row i attends to the
 * first len - (n - 1 - i) keys), KV head g, bf16 cache, block_size a multiple of 16: each query head of the group
 * in turn, its 16 rows on the tiles at once (scores as S^T = K Q^T, 16 keys a tile, then P V), so each K/V tile
 * load serves 16 rows where attn_heads_amx serves one. Rounds as attn_heads_amx. */
__attribute__((target("amx-tile,amx-bf16")))
/* V of keys 0 .. len - 1 of KV head g (bf16 cache) as the B tiles of P V, once for all the query heads of the
 * group: tile (key block j0 / 32, dims 16 c ..) at vp + ((j0 / 32) (D / 16) + c) 512, pairs past len zero */
static void attn_pack_v(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                        const attn_ws* w, bf16* vp) {
    const int64_t D = m->head_dim;
    for (int64_t j0 = 0; j0 < len; j0 += 32) {
        const bf16* vr[32];
        const int n0 = (int)(len - j0 < 16 ? len - j0 : 16);
        kv_rows(m, cache, 1, table, j0, n0, g, w->tmp, vr);
        if (j0 + 16 < len) {
            const int n1 = (int)(len - j0 - 16 < 16 ? len - j0 - 16 : 16);
            kv_rows(m, cache, 1, table, j0 + 16, n1, g, w->tmp + 16 * D, vr + 16);
            for (int jj = 16 + n1; jj < 32; jj++) vr[jj] = w->zero;
        } else {
            for (int jj = n0; jj < 32; jj++) vr[jj] = w->zero;
        }
        bf16* t = vp + (j0 / 32) * (D / 16) * 512;
        for (int64_t c = 0; c < D / 16; c++, t += 512)
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(t + p * 32, pair_rows(vr[2 * p] + 16 * c, vr[2 * p + 1] + 16 * c));
    }
}

/* attn_pv_amx on V packed by attn_pack_v: the same tile products in the same order */
__attribute__((target("amx-tile,amx-bf16")))
static void attn_pv_packed(const it_model* m, int64_t len, const attn_ws* w, const bf16* vp, int nrows,
                           const float* inv, bf16* out, int64_t ldo) {
    const int64_t D = m->head_dim;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nc = (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j0 = 0; j0 < len; j0 += 32) {
            const bf16* t = vp + ((j0 / 32) * (D / 16) + d0 / 16) * 512;
            _tile_loadd(7, w->pb + j0, w->ldp * 2);
            _tile_loadd(5, t, 64);
            _tile_dpbf16ps(0, 7, 5);
            if (nc > 1) { _tile_loadd(6, t + 512, 64); _tile_dpbf16ps(1, 7, 6); }
            if (nc > 2) { _tile_loadd(5, t + 1024, 64); _tile_dpbf16ps(2, 7, 5); }
            if (nc > 3) { _tile_loadd(6, t + 1536, 64); _tile_dpbf16ps(3, 7, 6); }
        }
        attn_pv_out(w, nc, nrows, inv, out + d0, ldo);
    }
}

static void attn_rows_amx(const it_model* m, const void* cache, const int64_t* table, int64_t len, int n, int64_t g,
                          const bf16* qkv, int64_t width, int64_t t0, bf16* o, const attn_ws* w, int64_t max_ctx) {
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads, group = m->n_heads / hkv;
    const __m512i pairs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    const __m512 scale = _mm512_set1_ps(m->scale);
    const int64_t len32 = (len + 31) & ~(int64_t)31;
    attn_pack_v(m, cache, table, len, g, w, w->vpack); /* (V as tiles once for the group's query heads) */
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        /* Q^T of the n rows: the (k, k + 1) pair of row r is 32-bit word (k / 32) * 256 + ((k % 32) / 2) * 16 + r */
        memset(w->qt, 0, (size_t)D * 32);
        for (int r = 0; r < n; r++)
            for (int64_t k = 0; k < D; k += 32)
                _mm512_i32scatter_epi32((int*)w->qt + (k / 32) * 256 + r, pairs,
                                        _mm512_loadu_si512(qkv + (t0 + r) * width + h * D + k), 4);
        for (int64_t j0 = 0; j0 < len; j0 += 16) { /* 16 keys of one block, rows hkv * D apart */
            const int nb = (int)(len - j0 < 16 ? len - j0 : 16);
            const bf16* kb = (const bf16*)cache + (kv_slot(table, j0, bs) * hkv + g) * D;
            _tile_zero(6);
            for (int64_t k = 0; k < D; k += 32) {
                _tile_loadd(4, kb + k, hkv * D * 2);
                _tile_loadd(5, w->qt + (k / 32) * 512, 64);
                _tile_dpbf16ps(6, 4, 5);
            }
            _tile_stored(6, w->cbuf, 64);
            __m512 sr[16];
            transpose16x16_ps(w->cbuf, sr); /* sr[r] = row r's scores of the 16 keys */
            for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(w->sc + r * max_ctx + j0, mask16(nb), _mm512_mul_ps(sr[r], scale));
        }
        float inv[16];
        for (int r = 0; r < n; r++) /* row r's own keys; zero past them up to len32 */
            inv[r] = softmax_bf16_row(w->sc + r * max_ctx, len - (n - 1 - r), len32, w->pb + r * w->ldp);
        for (int r = n; r < 16; r++) memset(w->pb + r * w->ldp, 0, (size_t)len32 * 2);
        attn_pv_packed(m, len, w, w->vpack, n, inv, o + (t0 * m->n_heads + h) * D, m->n_heads * D);
    }
}

/* Attention of each decode row over its sequence's paged K/V; o [T, Hq, D] bf16. One task per (row, KV head):
 * the group of query heads sharing that KV head (up to 16 at a time on AMX, 8 on AVX-512) reads each K/V row once.
 * On AMX with a bf16 cache, rows that continue the previous row's sequence (same block table, one more key: a
 * prompt's rows) go in blocks of up to 16 to attn_rows_amx instead, a task per (block, KV head). */
static void attention_rows(const it_model* m, const it_step* s, const bf16* qkv, const void* cache, bf16* o,
                           float* scratch, int64_t max_ctx, int use_amx) {
    const int64_t D = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, T = s->T;
    const int64_t width = (m->n_heads + 2 * hkv) * D;
    const int amx = use_amx && amx_state == 1 && D % 32 == 0, step = amx ? 16 : 8;
    const int64_t G = attn_score_rows(group, T);
    /* blocks of rows: start[b], rows[b] (1: a row on its own); on the stack for a decode step's few rows */
    int64_t small[32];
    int64_t* start = T <= 16 ? small : malloc((size_t)T * 2 * sizeof(int64_t));
    int64_t* rows = start + T, nblocks = 0;
    const int blocks_ok = amx && T > 16 && !m->kv_int8 && m->block_size % 16 == 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = s->block_tables + t * s->max_blocks;
        if (blocks_ok && nblocks > 0 && rows[nblocks - 1] < 16 && s->context_lens[t] == s->context_lens[t - 1] + 1 &&
            start[nblocks - 1] + rows[nblocks - 1] == t &&
            memcmp(tab, tab - s->max_blocks, (size_t)s->max_blocks * sizeof(int64_t)) == 0) {
            rows[nblocks - 1]++;
        } else {
            start[nblocks] = t;
            rows[nblocks++] = 1;
        }
    }
    const int64_t tasks = nblocks * hkv;
    const int nt = (int)(tasks < m->nthreads ? tasks : m->nthreads);
#pragma omp parallel num_threads(nt > 0 ? nt : 1)
    {
        const attn_ws w = attn_workspace(scratch + (int64_t)omp_get_thread_num() * attn_floats(G, max_ctx, D, T > 16), G,
                                         max_ctx, D);
        memset(w.zero, 0, (size_t)D * 2);
        int tiles = 0; /* the G the tiles are configured for */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / hkv, g = task % hkv, t = start[b];
            const int64_t* table = s->block_tables + t * s->max_blocks;
            if (rows[b] > 1) {
                if (tiles != 16) { attn_tiles(16); tiles = 16; }
                attn_rows_amx(m, cache, table, s->context_lens[t + rows[b] - 1], (int)rows[b], g, qkv, width, t, o,
                              &w, max_ctx);
                continue;
            }
            for (int64_t h0 = 0; h0 < group; h0 += step) {
                const int Gh = (int)(group - h0 < step ? group - h0 : step);
                const bf16* q = qkv + t * width + (g * group + h0) * D;
                bf16* out = o + (t * m->n_heads + g * group + h0) * D;
                if (amx) {
                    if (tiles != Gh) { attn_tiles(Gh); tiles = Gh; }
                    attn_heads_amx(m, cache, table, s->context_lens[t], g, q, Gh, out, &w, max_ctx);
                } else {
                    attn_heads_by_g[Gh](m, cache, table, s->context_lens[t], g, q, w.sc, max_ctx, out, w.tmp, w.zero);
                }
            }
        }
        if (tiles) amx_release();
    }
    if (start != small) free(start);
}

/* The elementwise work of prefills (any T), on rows: RMSNorm (also the final norm of a fused decode step),
 * SiLU-and-multiply, rotary. */
void it_rmsnorm_mt(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
    rmsnorm_rows(x, w, out, T, H, eps, nthreads);
}

void it_silu_mul(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {
    silu_mul_rows(gu, act, T, I, nthreads);
}

void it_rotary(bf16* qk, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cs, int64_t ld_cs,
               int nthreads) {
    rotary_apply(qk, ld, T, heads, D, cs, ld_cs, NULL, nthreads);
}

/* The decode attention of it_decode_layers alone, for tests: qkv [T, (Hq + 2 Hkv) D] (the queries are read), one
 * layer's cache, o [T, Hq, D]; s->work as for it_decode_layers. use_amx = 0 takes the AVX-512 path where the AMX
 * one would run. Returns 0, -1 (workspace too small) or -2 (shapes, as it_decode_layers). */
int it_decode_attention(const it_model* m, const it_step* s, const bf16* qkv, const void* cache, bf16* o, int use_amx) {
    const int64_t max_ctx = s->max_blocks * m->block_size;
    if (m->head_dim % 16 || m->n_heads % m->n_kv_heads || s->T < 1) return -2;
    const ws_layout l = workspace(m, s->T, max_ctx);
    if (l.total > s->work_bytes) return -1;
    attention_rows(m, s, qkv, cache, o, (float*)((char*)s->work + l.attn), max_ctx, use_amx);
    return 0;
}

/* Wall time of the fused step's parts, summed over calls (it_fused_timers reads them): a step's split for
 * `infertune profile`, at one clock read a part and layer. */
enum { FT_NORM, FT_QKV, FT_ROTARY_KV, FT_ATTN, FT_O, FT_RESIDUAL, FT_GATE_UP, FT_DOWN, FT_PARTS };
static double fused_time[FT_PARTS];
static int64_t fused_calls, fused_rows;

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* out [FT_PARTS + 2]: seconds per part (norm, qkv, rotary + K/V write, attention, o_proj, residual adds, gate_up
 * (+ SiLU), down), then calls and rows; reset: zero them after reading */
void it_fused_timers(double* out, int reset) {
    for (int i = 0; i < FT_PARTS; i++) out[i] = fused_time[i];
    out[FT_PARTS] = (double)fused_calls;
    out[FT_PARTS + 1] = (double)fused_rows;
    if (reset) {
        memset(fused_time, 0, sizeof fused_time);
        fused_calls = fused_rows = 0;
    }
}

/* x [T, hidden] bf16 (T decode rows, or the rows of fresh prompts), updated in place through every layer.
 * Returns 0, or -1 if the workspace is too small, -2 if the shapes are outside what this path handles (head_dim
 * not a multiple of 16, ...). */
int it_decode_layers(const it_model* m, const it_layer* layers, const it_step* s, bf16* x) {
    const int64_t T = s->T, H = m->hidden, D = m->head_dim, max_ctx = s->max_blocks * m->block_size;
    if (D % 16 || m->n_heads % m->n_kv_heads || T < 1) return -2;
    const ws_layout l = workspace(m, T, max_ctx);
    if (l.total > s->work_bytes) return -1;
    char* w = (char*)s->work;
    bf16 *h = (bf16*)(w + l.h), *qkv = (bf16*)(w + l.qkv), *o = (bf16*)(w + l.o), *gu = (bf16*)(w + l.gu);
    bf16 *act = (bf16*)(w + l.act), *y = (bf16*)(w + l.y);
    void* lin = w + l.lin;
    bf16* dec = (bf16*)(w + l.dec);
    float* attn = (float*)(w + l.attn);
    const int64_t hkv = m->n_kv_heads, width = (m->n_heads + 2 * hkv) * D, hq = m->n_heads * D;
    double t0 = now_s(), t1;
#define PART(i) (t1 = now_s(), fused_time[i] += t1 - t0, t0 = t1)
    /* Past the last layer's attention only the rows the caller reads go on: the other rows' K / V are all written
       by then, and nothing else reads their hidden states. They are moved to the front here (rows ascending, so
       in place) and back at the end; x's other rows are left undefined. */
    const int sub = s->n_out > 0 && s->n_out < T;
    for (int li = 0; li < m->n_layers; li++) {
        const it_layer* L = layers + li;
        rmsnorm_rows(x, L->input_norm, h, T, H, m->eps, m->nthreads);
        PART(FT_NORM);
        run_lin(&L->qkv, h, H, qkv, width, T, m->nthreads, lin, dec, 0);
        PART(FT_QKV);
        rotary_rows(m, s, qkv);
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < hkv; g++) {
                kv_write(m, L->kv_cache, 0, s->slots[t] * hkv + g, qkv + t * width + hq + g * D);
                kv_write(m, L->kv_cache, 1, s->slots[t] * hkv + g, qkv + t * width + hq + (hkv + g) * D);
            }
        PART(FT_ROTARY_KV);
        attention_rows(m, s, qkv, L->kv_cache, o, attn, max_ctx, 1);
        int64_t R = T; /* rows from here on */
        if (sub && li == m->n_layers - 1) {
            for (int64_t i = 0; i < s->n_out; i++)
                if (s->out_rows[i] != i) {
                    memcpy(o + i * hq, o + s->out_rows[i] * hq, (size_t)hq * 2);
                    memcpy(x + i * H, x + s->out_rows[i] * H, (size_t)H * 2);
                }
            R = s->n_out;
        }
        PART(FT_ATTN);
        run_lin_add(&L->o, o, hq, x, y, H, R, m->nthreads, lin, dec); /* (the residual add with it) */
        PART(FT_O);
        rmsnorm_rows(x, L->post_norm, h, R, H, m->eps, m->nthreads);
        PART(FT_NORM);
        if (L->gate_up.kind == 3 && L->gate_up.inter) { /* SiLU-and-multiply in the GEMM's epilogue */
            run_lin(&L->gate_up, h, H, act, m->inter, R, m->nthreads, lin, dec, 1);
        } else {
            run_lin(&L->gate_up, h, H, gu, 2 * m->inter, R, m->nthreads, lin, dec, 0);
            silu_mul_rows(gu, act, R, m->inter, m->nthreads);
        }
        PART(FT_GATE_UP);
        run_lin_add(&L->down, act, m->inter, x, y, H, R, m->nthreads, lin, dec);
        PART(FT_DOWN);
        if (R < T)
            for (int64_t i = R - 1; i >= 0; i--)
                if (s->out_rows[i] != i) memcpy(x + s->out_rows[i] * H, x + i * H, (size_t)H * 2);
        PART(FT_RESIDUAL);
    }
#undef PART
    fused_calls++;
    fused_rows += T;
    return 0;
}
