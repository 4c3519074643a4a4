/* infertune's CPU kernels for AArch64 (Armv8-A Advanced SIMD, the NEON every 64-bit Arm server and laptop has:
 * Graviton, Ampere, Apple M, Cobalt, Grace): the small-batch linears (bf16, W8A16, W4A16), the bf16 FMA GEMM
 * (gemm.c: decode batches and short prompts, the AVX2 library's contract), W8A8's int8 x int8 product (SDOT where
 * the CPU has it, else SMULL + SADALP, on weights packed at load: gemm_i8.c), the dequantization of
 * quantized weights for prefills, the elementwise kernels (RMSNorm, SiLU-and-multiply, rotary), the fused decoder
 * step (csrc/fused_step.h over fused.c's attention, workspace and linears) and the mixture-of-experts routing and
 * grouped experts (csrc/moe.h over these GEMVs), with the same entry points and contracts as the x86 libraries, so
 * kernels/cpu.py calls any of them. No 12-bit weights (x86 AVX-512 / AMX only). Tested for correctness under
 * qemu-user (tests/test_neon.py); not yet measured on Arm hardware: no speed claim.
 *
 * One translation unit (this file #includes its parts); built by kernels/cpu.py with -march=armv8-a. */
#define _GNU_SOURCE
#define IT_HAS_W8A8 /* it_lin kind 4 (W8A8): gemm_i8.c; fused_step.h and moe.h take it */
#include <arm_neon.h>
#include <omp.h>
#include "bf16.h"
#include "abi.h"
#include "act_i16.h"
#include "arm/neon/vec128.h"

#include "abi.c"
#include "sample.h"
#include "arm/neon/gemv.c"
#include "arm/neon/gemm.c"
#include "arm/neon/gemm_i8.c"
#include "arm/neon/elementwise.c"
#include "kv_cache.h"
#include "arm/neon/fused.c"
#include "moe_gemv.h"
#include "fused_step.h"
