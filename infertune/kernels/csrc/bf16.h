/* bf16 <-> fp32 as torch rounds, and the thread count heuristic: portable C, shared by every ISA's kernels. */
#ifndef IT_BF16_H
#define IT_BF16_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef uint16_t bf16;

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

static inline int pick_threads(int64_t n_blocks, int64_t bytes, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (bytes < (1 << 16)) return 1; /* not worth waking a second thread */
    if (n_blocks < nthreads) return (int)(n_blocks > 0 ? n_blocks : 1);
    return nthreads;
}

/* Feature tiles (of 16) in 64-feature chunk ch of an N16-feature weight: 4, fewer in a last partial chunk */
/* ------------------------------------------------------------------ the GEMVs' prefetch of the weight stream
 *
 * near (pf_far_bytes 0, the default): each weight row asks for its own bytes a fixed distance ahead, into L1; tuned
 * on Intel Xeons. far: each row asks for the same columns of the row a whole number of blocks ahead (at least
 * pf_far_bytes), into L2. On AMD Zen 4 (2 cores) near leaves a bf16 GEMV at ~19 GB/s against a 26-30 GB/s sum; far
 * reads at ~33 (benchmarks/bench_prefetch.py). The AVX-512 library's bf16 weights (its bf16 GEMV, the 12-bit
 * codec's stream) have a setting of their own, pf_bf16_far_bytes: on AMD Zen 5 their near prefetch is the faster
 * one (a 12-bit decode step 1.03-1.07x, the 12-bit linears 1.1-1.4x at one row) while the int8 / int4 GEMVs still
 * want far, and so does the AVX2 library's bf16 GEMV (far 1.07-1.08x there, forced on the Zen 5): it reads
 * pf_far_bytes. Both set once at
 * load by kernels/cpu.py (it_set_prefetch, then it_set_prefetch_bf16), before any kernel runs; the kernels only
 * read them.
 */
static int64_t pf_far_bytes, pf_bf16_far_bytes;

/* A helper whose only effect is a prefetch: always inlined. GCC counts __builtin_prefetch as no side effect, so a
 * call to a separate helper that only prefetches is "pure" and its caller's dead-code pass deletes it: the
 * GEMM slabs' prefetch (gemm_prefetch_line, fma_prefetch) had been compiled out that way. tests/test_cpu_isa.py
 * checks the built libraries' micro-kernels still hold their prefetch instructions. */
#define IT_PREFETCH_FN static inline __attribute__((always_inline))

/* both settings (the quantized GEMVs' and bf16 weights') */
void it_set_prefetch(int64_t far_bytes) { pf_far_bytes = pf_bf16_far_bytes = far_bytes > 0 ? far_bytes : 0; }

/* bf16 weights' alone */
void it_set_prefetch_bf16(int64_t far_bytes) { pf_bf16_far_bytes = far_bytes > 0 ? far_bytes : 0; }

int64_t it_get_prefetch(void) { return pf_far_bytes; }

int64_t it_get_prefetch_bf16(void) { return pf_bf16_far_bytes; }

static inline int64_t pf_far_blocks(int64_t far_bytes, int64_t block_bytes) {
    if (far_bytes <= 0 || block_bytes <= 0) return 0;
    return (far_bytes + block_bytes - 1) / block_bytes * block_bytes;
}

/* how far ahead a block of block_bytes (weight rows side by side in memory) asks for its weights: 0 when near;
 * pf_far_offset for int8 / int4 weights, pf_far_offset_bf16 for bf16 ones */
static inline int64_t pf_far_offset(int64_t block_bytes) { return pf_far_blocks(pf_far_bytes, block_bytes); }

static inline int64_t pf_far_offset_bf16(int64_t block_bytes) { return pf_far_blocks(pf_bf16_far_bytes, block_bytes); }

/* ask for the weight bytes far_off ahead of p into L2 (far), or near_off ahead into L1 (near) */
IT_PREFETCH_FN void pf_weights(const void* p, int64_t far_off, int64_t near_off) {
    if (far_off)
        __builtin_prefetch((const char*)p + far_off, 0, 2);
    else
        __builtin_prefetch((const char*)p + near_off, 0, 3);
}

#endif
