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
#endif
