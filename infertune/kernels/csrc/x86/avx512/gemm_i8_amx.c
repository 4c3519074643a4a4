/* The int8 products of gemm_i8.c (W8A8) and gemm_w8p.c (W8A16: the h and l bytes of x as int8 rows) on AMX-INT8
 * tiles, from the same packed weight, with the same exact int32 sums and the same epilogues: bit for bit what the
 * VPDPBUSD kernels give, faster where AMX runs.
 *
 * Why no repacking: it_pack_w8a8's layout is already TDPBSUD's B operand. A block of the packed weight is
 * [Kp / 4 words][64 features], each 32-bit word 4 consecutive columns of one feature (+ 128), and a B tile is
 * 16 rows (4-column groups) x 16 features x 4 bytes: features 16 v .. 16 v + 15 of columns 4 p .. 4 p + 63 are the
 * 64-byte runs at words (p + r) * 64 + 16 v, r = 0 .. 15, one tile load with a 256-byte stride. The A operand is 16
 * rows of the int8 activations (row stride Kp, columns past K zero), loaded in place. TDPBSUD multiplies the signed
 * activations by the unsigned weight bytes, so the sums hold sum (q + 128) x, less 128 sum x in the epilogue, as
 * VPDPBUSD's do.
 *
 * Blocking: threads split the 64-feature blocks (consecutive blocks a thread: the weights stream in order). Up to 16
 * rows (a decode step): one A tile against the block's four B tiles over all of K (C: 4 tiles, 16 rows x 64
 * features), the weight asked into L2 ahead. Past 16: passes of up to 512 rows (I8A_PASS_BYTES of int8 rows: they
 * stay in L2) go over every block before the next pass starts, so a block's weight is read once a pass; each block
 * runs a pass 32 rows at a time, 32 rows x 32 features over all of K (C: 2 x 2 tiles, A: 2, B: 2), each half of the
 * block in turn, the sums out of the tiles into one of two buffers (8 KB each, in L1) and through the epilogue two rows
 * at a time between the next group's tile products (the tiles and the vector units work side by side). The
 * tiles read whole 16-row (32-row) groups, so the rows' buffer holds I8_ROW_PAD rows past the last (the callers'
 * scratch sizes count them); what they hold goes into sums that are never stored. */
#ifndef I8_STREAM_BYTES
/* outputs from this size go past the caches (non-temporal stores, whole lines: rows_on_lines): a 16 x 128-token
 * gate_up's [2048, 9728] on an AMX Xeon, W8A8 prompts 0.91x (its GEMM 0.84x); at 4 MB q / k / v too (0.77x), but
 * rotary and attention, reading them next, 1.08-1.14x: level, so not those */
#define I8_STREAM_BYTES (8 << 20)
#endif
#ifndef I8A_PASS_BYTES
#define I8A_PASS_BYTES (1 << 20) /* a pass's int8 rows (they stay in L2) */
#endif
_Static_assert(I8_ROW_PAD >= 32, "the scratch holds the 32-row groups' reads past the last row");

/* whether the tiles take the int8 products (at every row count: AMX runs here) */
static inline int i8_amx_takes(void) { return amx_state == 1; }

/* whether an [M, N] bf16 output y goes past the caches (the tiles' path only) */
static inline int i8a_stream(int64_t M, int64_t N, const bf16* y, int64_t ldy) {
    return i8_amx_takes() && M * N * 2 >= I8_STREAM_BYTES && rows_on_lines(y, ldy);
}

/* acc [16, 64] (row stride 64 int32) = rows a .. a + 15 (stride lda) times the block wp (nq words of 64 features) */
__attribute__((target("amx-tile,amx-int8")))
static inline void i8a_1x4(const int8_t* a, int64_t lda, const uint32_t* wp, int64_t nq, int32_t* acc) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t p = 0; p < nq; p += 16) { /* 64 columns */
        const uint32_t* w = wp + p * 64;
        /* the weight two k-steps on (4 KB a step), into L2: a decode step's rows stream it from memory (batch-1
           decode 0.84x W8A16, 0.88x W8A8 on an AMX Xeon; one step or four on: the same; 16 rows level) */
        for (int l = 0; l < 64; l++) _mm_prefetch((const char*)(w + 2 * 16 * 64) + 64 * l, _MM_HINT_T1);
        _tile_loadd(4, a + 4 * p, lda);
        _tile_loadd(5, w, 256);
        _tile_dpbsud(0, 4, 5);
        _tile_loadd(6, w + 16, 256);
        _tile_dpbsud(1, 4, 6);
        _tile_loadd(5, w + 32, 256);
        _tile_dpbsud(2, 4, 5);
        _tile_loadd(6, w + 48, 256);
        _tile_dpbsud(3, 4, 6);
    }
    _tile_stored(0, acc, 256); _tile_stored(1, acc + 16, 256);
    _tile_stored(2, acc + 32, 256); _tile_stored(3, acc + 48, 256);
}

/* The sums of rows r0 .. r0 + rows - 1 (acc [rows, 64], row stride 64) for features n0 .. n0 + nrows - 1 */
typedef void (*i8a_store_fn)(const void* ctx, const int32_t* acc, int64_t r0, int rows, int64_t n0, int nrows);

/* The previous 32-row group's epilogue, two rows at a time between the next group's tile products (the tiles and
 * the vector units work side by side): its sums (acc), rows, block, and the rows done */
typedef struct {
    i8a_store_fn store;
    const void* ctx;
    const int32_t* acc;
    int64_t r0, n0;
    int rows, nrows, done;
} i8a_epi;

static inline void i8a_epi_rows(i8a_epi* e, int n) { /* the next n rows (fewer where fewer are left) */
    n = e->rows - e->done < n ? e->rows - e->done : n;
    if (n > 0) e->store(e->ctx, e->acc + e->done * 64, e->r0 + e->done, n, e->n0, e->nrows);
    e->done += n;
}

static inline void i8a_epi_step(i8a_epi* e) { i8a_epi_rows(e, 2); } /* (2: W8A16's h and l rows of one x row) */

static inline void i8a_epi_finish(i8a_epi* e) { i8a_epi_rows(e, e->rows); }

/* acc [32, 64]'s features 32 h .. 32 h + 31 = rows a .. a + 31 times the block's same features, over all of K (the
 * accumulators stay in their tiles) */
__attribute__((target("amx-tile,amx-int8")))
static inline void i8a_2x2(const int8_t* a, int64_t lda, const uint32_t* wp, int64_t nq, int32_t* acc, int h,
                           i8a_epi* epi) {
    int32_t* c = acc + 32 * h;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint32_t* w0 = wp + 32 * h;
    for (int64_t p = 0; p < nq; p += 16) {
        i8a_epi_step(epi);
        _tile_loadd(4, a + 4 * p, lda);
        _tile_loadd(6, w0 + p * 64, 256);
        _tile_dpbsud(0, 4, 6);
        _tile_loadd(7, w0 + p * 64 + 16, 256);
        _tile_dpbsud(1, 4, 7);
        _tile_loadd(5, a + 16 * lda + 4 * p, lda);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbsud(3, 5, 7);
    }
    _tile_stored(0, c, 256); _tile_stored(1, c + 16, 256);
    _tile_stored(2, c + 16 * 64, 256); _tile_stored(3, c + 16 * 64 + 16, 256);
}


/* rows a pass takes over all the blocks: their int8 rows stay in L2 (I8A_PASS_BYTES) beside the block multiplied */
static inline int64_t i8a_pass_rows(int64_t Kp) {
    const int64_t p = ((int64_t)I8A_PASS_BYTES / Kp) & ~(int64_t)31;
    return p < 32 ? 32 : p > 512 ? 512 : p;
}

/* a [R (+ I8_ROW_PAD readable), Kp] int8 rows times the packed weight wpk of N features; store() takes each group of
 * up to 32 rows of each block as soon as its sums are out of the tiles */
__attribute__((target("amx-tile,amx-int8")))
static void i8a_drive(const int8_t* a, int64_t R, int64_t Kp, const uint32_t* wpk, int64_t N, int nthreads,
                      i8a_store_fn store, const void* ctx) {
    const int64_t nblocks = (N + 63) / 64, block_words = Kp / 4 * 64, nq = Kp / 4;
    const int64_t pass = R <= 16 ? 16 : i8a_pass_rows(Kp);
    const int nt = pick_threads(nblocks, N * Kp, nthreads);
#pragma omp parallel num_threads(nt)
    {
        int32_t acc[2][32 * 64] __attribute__((aligned(64)));
        amx_configure(8);
        for (int64_t r0 = 0; r0 < R; r0 += pass) { /* (a pass's rows stay in L2 while the blocks go by) */
            const int64_t rows = R - r0 < pass ? R - r0 : pass;
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < nblocks; b++) {
                const int64_t n0 = b * 64;
                const int nrows = (int)(N - n0 < 64 ? N - n0 : 64);
                const uint32_t* wb = wpk + b * block_words;
                if (rows <= 16) {
                    i8a_1x4(a + r0 * Kp, Kp, wb, nq, acc[0]);
                    store(ctx, acc[0], r0, (int)rows, n0, nrows);
                    continue;
                }
                i8a_epi epi = {store, ctx, acc[1], 0, n0, 0, nrows, 0}; /* (none pending yet) */
                for (int64_t i = 0; i < rows; i += 32) {
                    int32_t* cur = acc[(i / 32) & 1];
                    i8a_2x2(a + (r0 + i) * Kp, Kp, wb, nq, cur, 0, &epi);
                    i8a_2x2(a + (r0 + i) * Kp, Kp, wb, nq, cur, 1, &epi);
                    i8a_epi_finish(&epi);
                    epi.acc = cur, epi.r0 = r0 + i, epi.rows = (int)(rows - i < 32 ? rows - i : 32), epi.done = 0;
                }
                i8a_epi_finish(&epi);
            }
        }
        _mm_sfence(); /* (the non-temporal stores a store() may make, seen by all before the barrier) */
        _tile_release();
    }
}
