/* The mixture-of-experts kernels (moe.h) over a library's small-batch linears (it_linear_bf16 / _w8 / _w4, each
 * allocating its own scratch): the AVX2 and NEON libraries include this after their gemv.c and elementwise.c. */
#ifndef IT_MOE_GEMV_H
#define IT_MOE_GEMV_H

static void moe_linear(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                       void* scratch, int silu) { /* (silu: 12-bit experts only, which these libraries refuse) */
    (void)scratch, (void)silu;
    if (L->kind == IT_KIND_BF16)
        it_linear_bf16(x, ldx, (const bf16*)L->w, L->bias, y, ldy, M, L->N, L->K, nthreads);
    else if (L->kind == IT_KIND_W8)
        it_linear_w8(x, ldx, (const int8_t*)L->w, L->scale, L->scale_is_f32, L->bias, y, ldy, M, L->N, L->K, nthreads);
#ifdef IT_HAS_W8A8
    else if (L->kind == IT_KIND_W8A8) /* (moe.h checked K) */
        it_linear_w8a8(x, ldx, (const uint32_t*)L->w, (const float*)L->scale, L->zero, L->bias, y, ldy, M, L->N, L->K,
                       nthreads);
#endif
    else
        it_linear_w4(x, ldx, (const uint8_t*)L->w, (const float*)L->scale, L->zero, L->group, L->bias, y, ldy, M, L->N,
                     L->K, nthreads);
}

static inline int64_t moe_linear_scratch(int64_t M, int64_t K, int nthreads) {
    (void)M, (void)K, (void)nthreads;
    return 0;
}

#define moe_silu_mul it_silu_mul

#include "moe.h"
#endif
