/* The mixture-of-experts kernels (moe.h) over a library's small-batch linears (the fused step's run_lin: the GEMVs
 * and GEMMs of it_linear_bf16 / _w8 / _w4 / _w8a8, int8 / int4 / W8A8 ones on the caller's scratch): the AVX2 and
 * NEON libraries include this after their fused.c. */
#ifndef IT_MOE_GEMV_H
#define IT_MOE_GEMV_H

static void moe_linear(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                       void* scratch, int silu) { /* (silu: 12-bit experts only, which these libraries refuse) */
    (void)silu;
    run_lin(L, x, ldx, y, ldy, M, nthreads, scratch, NULL, 0); /* (moe.h checked W8A8's K) */
}

/* the int16 rows of W8A16 / W4A16 and the int8 rows of W8A8, for M rows of K (bf16: none) */
static inline int64_t moe_linear_scratch(int64_t M, int64_t N, int64_t K, int nthreads) {
    (void)N, (void)nthreads;
    const int64_t q = q_scratch_bytes(M, K), i8 = i8_scratch_bytes(M, K);
    return q > i8 ? q : i8;
}

#define moe_silu_mul it_silu_mul

#include "moe.h"
#endif
