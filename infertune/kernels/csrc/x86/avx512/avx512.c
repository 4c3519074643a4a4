/* infertune's CPU kernels for decode steps and the elementwise work of prefills, x86-64 with AVX-512 BF16 and
 * VNNI (AMX where present).
 *
 * At a few rows a linear layer is a matrix-vector product: every weight byte is read once, so the step runs at
 * the speed of memory. These kernels stream each weight once for up to MR rows of activations at a time and
 * prefetch ahead of the stream, which is what the generic GEMM paths do not do at M = 1.
 *
 *   it_linear_bf16  y = x W^T (+ b)            bf16 x, bf16 W [N, K], fp32 accumulation (VDPBF16PS at one row,
 *                                              AMX tiles at 2+ rows where the CPU has them; without AMX the
 *                                              VDPBF16PS GEMM from gemm_rows_noamx rows, gemm_dpbf16.c)
 *   it_linear_w8    y = (x W_q^T) * s (+ b)    bf16 x, int8 W_q [N, K], per-row scale s; x is rounded to
 *                                              int16 per row (dynamic, symmetric) and multiplied in int32
 *                                              (VPDPBUSD on its two bytes), so |x - x_q * s_x| <= s_x / 2,
 *                                              s_x = max|x| / 32512
 *   it_linear_w4    y = sum_g (x_g . q_g) s_g + (sum x_g) z_g (+ b)
 *                                              bf16 x, 4-bit W (two per byte, see below), per-group scale s
 *                                              and offset z (w = q * s + z), x in int16 as above (VPDPWSSD)
 *   it_dequant_w8 / it_dequant_w4              a quantized layer's bf16 weights, for a prefill's GEMM
 *   it_linear_w8a8  y = (x_q W_q^T) s_x s_w (+ b)
 *                                              int8 W_q [N, K] and x rounded to int8 per row (or by a static
 *                                              scale) as quant/int8.py W8A8Method does, exact int32 sums
 *                                              (VPDPBUSD; a GEMM on VNNI slabs for prompts, gemm_i8.c)
 *   it_linear_bf16c                            y = x W^T (+ b) with W in the lossless 12-bit layout (bf16c below),
 *                                              any M on AMX (SiLU-and-multiply in the epilogue for a gate_up),
 *                                              without AMX VDPBF16PS on the decoded tiles (bf16c_noamx.c);
 *                                              it_bf16c_hist / _pack / _escapes build it, it_unpack_bf16c undoes it
 *   it_rmsnorm_mt / it_silu_mul / it_rotary    the elementwise work of prefills, rounded as the PyTorch code
 *   it_decode_layers                           a whole decode step of a Llama decoder, or a step of fresh prompts
 *                                              (see its comment; its split by part into the caller's
 *                                              it_step.stats); it_decode_attention: its attention alone
 *   it_moe_route / it_moe_experts              a mixture-of-experts layer's routing and its experts as one grouped
 *                                              GEMM (csrc/moe.h, over the linears above: moe.c)
 *
 * The linear kernels take x [M, K] with row stride ldx and write y [M, N] (bf16) with row stride ldy. Threads
 * split the output features with OpenMP; the library links the libgomp torch has already loaded, so the two
 * share one thread pool.
 *
 * Built at run time by infertune/kernels/cpu.py as one translation unit (this file #includes the others, so the
 * compiler sees and inlines across all of them exactly as it did the one file they came from): cc -O3
 * -mavx512bf16 -mavx512vnni ... -fopenmp, loaded with ctypes; where it cannot be built, the engine keeps torch's
 * kernels.
 */
#define _GNU_SOURCE
#define IT_HAS_W8A8 /* it_lin kind 4 (W8A8): gemm_i8.c; fused_step.h and moe.h take it */
#define IT_HAS_W8P  /* it_lin kind 5 (W8A16 on the packed weight): gemm_w8p.c; fused_step.h and moe.h take it */
#define IT_HAS_W4P  /* it_lin kind 6 (W4A16 on a packed weight): gemm_w4p.c; fused_step.h and moe.h take it */
#include <immintrin.h>
#include <time.h>
#include <omp.h>
#include "bf16.h"
#include "vec512.h"
#include "abi.h"

#include "abi.c"
#include "sample.h"
#include "gemv_bf16.c"
#include "amx.c"
#include "bf16c_codec.c"
#include "gemm_amx.c"
#include "gemm_dpbf16.c"
#include "gemm_i8.c"
#include "bf16c_gemm.c"
#include "bf16c_noamx.c"
#include "linear_bf16.c"
#include "quant_amx.c"
#include "bf16c_api.c"
#include "gemv_quant.c"
#include "gemm_w8p.c"
#include "gemm_w4p.c"
#include "decode_ws.c"
#include "elementwise.c"
#include "attention.c"
#include "moe.c"
#include "fused_step.h"
