/* Greedy sampling's argmax: portable C, shared by every ISA's library.
 *
 *   it_argmax_rows   logits [rows, n] fp32 (rows ld apart) -> per row the index of its largest value exactly as
 *                    logits.nan_to_num(nan=-inf).argmax(-1) picks it: NaN counts as -inf, and nan_to_num also takes
 *                    -inf to the lowest finite float and +inf to the largest (so -inf beats NaN, and +inf ties with
 *                    FLT_MAX); the first index among equal values. Without the [rows, n] copy and two passes torch
 *                    makes.
 *   it_argmax_rows_bf16  the same for bf16 logits, each read as the fp32 it widens to (exactly), so a bf16 LM head's
 *                    output needs no fp32 copy first.
 *
 * One pass over a row in 16 lanes (GCC's vector extension: compares and blends on every ISA's registers), each
 * lane's best and its first index; a second, scalar pass only where the best is +-inf or +-FLT_MAX, which
 * nan_to_num maps onto each other. A thread a row where there are rows and work enough for two.
 */
#ifndef IT_SAMPLE_H
#define IT_SAMPLE_H
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* nan_to_num's map of a value that is not NaN: -inf -> -FLT_MAX, +inf -> FLT_MAX */
static inline float clamp_finite(float v) { return v > FLT_MAX ? FLT_MAX : v < -FLT_MAX ? -FLT_MAX : v; }

/* 16 floats and their compare masks, as GCC's vector extension lays them on each ISA's registers */
typedef float argmax_vf __attribute__((vector_size(64)));
typedef int32_t argmax_vi __attribute__((vector_size(64)));

/* 16 values from x + i as fp32 lanes: fp32 as it is, or bf16 widened (exact: a bf16 is an fp32's high half) */
typedef uint16_t argmax_vh __attribute__((vector_size(32)));
typedef uint32_t argmax_vu __attribute__((vector_size(64)));
/* (through a pointer: a 64-byte vector returned by value is an ABI question on ISAs without 512-bit registers) */
static inline __attribute__((always_inline)) void argmax_load(argmax_vf* v, const void* x, int64_t i, int bf16) {
    if (bf16) {
        argmax_vh h;
        memcpy(&h, (const uint16_t*)x + i, sizeof h);
        *v = (argmax_vf)(__builtin_convertvector(h, argmax_vu) << 16);
    } else {
        memcpy(v, (const float*)x + i, sizeof *v);
    }
}

static inline __attribute__((always_inline)) float argmax_at(const void* x, int64_t i, int bf16) {
    if (!bf16) return ((const float*)x)[i];
    const uint32_t u = (uint32_t)((const uint16_t*)x)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int64_t argmax_row(const void* x, int64_t n, int bf16) {
    /* one pass, 16 lanes at a time: each lane's largest value that is not NaN (a NaN never compares greater) and
       where it first stands; then the lanes' best, the lowest index among lanes that hold it, the tail after them */
    argmax_vf lane = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                      -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    argmax_vi at = {0}, idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const argmax_vi step = {16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
    int64_t i = 0;
    for (; i + 16 <= n && i + 16 <= INT32_MAX; i += 16, idx += step) {
        argmax_vf v;
        argmax_load(&v, x, i, bf16);
        const argmax_vi gt = v > lane;
        lane = (argmax_vf)((gt & (argmax_vi)v) | (~gt & (argmax_vi)lane));
        at = (gt & idx) | (~gt & at);
    }
    float m = -INFINITY;
    int64_t best = -1;
    for (int j = 0; j < 16; j++)
        if (lane[j] > m || (lane[j] == m && m > -INFINITY && at[j] < best)) m = lane[j], best = at[j];
    for (; i < n; i++) {
        const float v = argmax_at(x, i, bf16);
        if (v > m) m = v, best = i;
    }
    if (m > -FLT_MAX && m < FLT_MAX) return best; /* (the first value equal to m: nan_to_num leaves it as it is) */
    /* m is +-inf or +-FLT_MAX (or every value NaN): the first value that nan_to_num maps to what it maps m to (it maps
       monotonically, NaN below every other value); none (every value NaN): 0 */
    const float target = clamp_finite(m);
    for (i = 0; i < n; i++) {
        const float v = argmax_at(x, i, bf16);
        if (v == v && clamp_finite(v) == target) return i;
    }
    return 0;
}

static void argmax_rows(const void* x, int64_t rows, int64_t n, int64_t ld, int64_t* out, int nthreads, int bf16) {
    const int nt = rows > 1 && rows * n >= (1 << 16) && nthreads > 1 ? (int)(rows < nthreads ? rows : nthreads) : 1;
    const int64_t esize = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row((const char*)x + r * ld * esize, n, bf16);
}

void it_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out, int nthreads) {
    argmax_rows(x, rows, n, ld, out, nthreads, 0);
}

/* The same for bf16 logits [rows, n] (rows ld elements apart), read as the fp32 values they widen to: the index
 * it_argmax_rows gives for logits.float(), without that copy (a decode step's bf16 LM head output goes straight in) */
void it_argmax_rows_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t ld, int64_t* out, int nthreads) {
    argmax_rows(x, rows, n, ld, out, nthreads, 1);
}
#endif
