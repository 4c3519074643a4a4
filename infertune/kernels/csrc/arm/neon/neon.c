/* infertune's CPU kernels for AArch64 (Armv8-A Advanced SIMD, the NEON every 64-bit Arm server and laptop has:
 * Graviton, Ampere, Apple M, Cobalt, Grace): the small-batch linears (bf16, W8A16, W4A16), the bf16 FMA GEMM
 * (gemm.c: decode batches and short prompts, the AVX2 library's contract), the dequantization of
 * quantized weights for prefills, the elementwise kernels (RMSNorm, SiLU-and-multiply, rotary), the fused decoder
 * step (csrc/fused_step.h over fused.c's attention, workspace and linears) and the mixture-of-experts routing and
 * grouped experts (csrc/moe.h over these GEMVs), with the same entry points and contracts as the x86 libraries, so
 * kernels/cpu.py calls any of them. No 12-bit weights (x86 AVX-512 / AMX only). Tested for correctness under
 * qemu-user (tests/test_neon.py); not yet measured on Arm hardware: no speed claim.
 *
 * One translation unit (this file #includes its parts); built by kernels/cpu.py with -march=armv8-a. */
#define _GNU_SOURCE
#include <arm_neon.h>
#include <omp.h>
#include "bf16.h"
#include "abi.h"
#include "act_i16.h"
#include "arm/neon/vec128.h"

#include "abi.c"
#include "arm/neon/gemv.c"
#include "arm/neon/gemm.c"
#include "arm/neon/elementwise.c"
#include "kv_cache.h"
#include "arm/neon/fused.c"
#include "moe_gemv.h"
#include "fused_step.h"
