/* infertune's CPU kernels for x86-64 with AVX2 + FMA + F16C and no AVX-512 (Haswell and later, Zen 1 and later):
 * the small-batch linears (bf16, W8A16, W4A16), the bf16 FMA GEMM (prompts and decode batches: gemm.c), W8A8's
 * int8 x int8 product (VPMADDUBSW on weights packed at load: gemm_i8.c), the
 * dequantization of quantized weights for prefills, the elementwise kernels (RMSNorm, SiLU-and-multiply, rotary),
 * the fused decoder step (csrc/fused_step.h over fused.c's attention, workspace and linears), the mixture-of-experts
 * routing and grouped experts (csrc/moe.h over these linears), with the same entry points and contracts as the
 * AVX-512 library (csrc/x86/avx512/avx512.c), so kernels/cpu.py calls either. The 12-bit weights and the AMX tile
 * paths are AVX-512 / AMX only.
 *
 * One translation unit (this file #includes its parts); built by kernels/cpu.py with -mavx2 -mfma -mf16c only. */
#define _GNU_SOURCE
#define IT_HAS_W8A8 /* it_lin kind 4 (W8A8): gemm_i8.c; fused_step.h and moe.h take it */
#include <immintrin.h>
#include <omp.h>
#include "bf16.h"
#include "abi.h"
#include "act_i16.h"
#include "x86/avx2/vec256.h"

#include "abi.c"
#include "sample.h"
#include "x86/avx2/gemv.c"
#include "x86/avx2/gemm.c"
#include "x86/avx2/gemm_i8.c"
#include "x86/avx2/elementwise.c"
#include "kv_cache.h"
#include "x86/avx2/fused.c"
#include "moe_gemv.h"
#include "fused_step.h"
