/* The mixture-of-experts kernels (moe.h) over this library's linears: run_lin (decode_ws.c) takes one expert's bf16
 * rows to the GEMV at one row, the AMX tiles at 2-16 and the tile GEMM past them (VDPBF16PS without AMX); int8 /
 * int4 experts go 16 rows a pass through the W8A16 / W4A16 kernels (AMX rebuilds each weight chunk in bf16), 12-bit
 * experts 16 rows a pass through linear_bf16c (AMX tiles, or the tiles decoded into registers without AMX: no
 * scratch; a prefill's expert with more rows decodes its tiles once a pass). */

#define MOE_BF16C

static void moe_linear(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                       void* scratch, int silu) {
    const int64_t step = L->kind == IT_KIND_BF16 ? M : 16;
    for (int64_t m0 = 0; m0 < M; m0 += step)
        run_lin(L, x + m0 * ldx, ldx, y + m0 * ldy, ldy, M - m0 < step ? M - m0 : step, nthreads, scratch, NULL, silu);
}

#define moe_linear_scratch lin_scratch_bytes /* (quantized kinds at up to 16 rows a pass) */
#define moe_silu_mul silu_mul_rows

#include "moe.h"
