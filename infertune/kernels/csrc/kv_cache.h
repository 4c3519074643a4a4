/* The paged KV cache as the fused step reads and writes it (portable C, shared by the AVX-512 and AVX2 libraries):
 * a layer's cache is [2 (K, V), num_blocks * block_size * n_kv_heads rows, head_dim] bf16, or int8 rows of head_dim
 * values and one fp32 scale (Int8PagedAttention's layout). */
#ifndef IT_KV_CACHE_H
#define IT_KV_CACHE_H
#include "bf16.h"
#include "abi.h"

/* n int8 values q (nib 0), or the low (nib 1) / high (nib 2) nibbles of n bytes q sign-extended, times sc, each
 * rounded to bf16 into out (q * sc in fp32, then to the nearest even: the same numbers in every build) */
static inline void kv_dequant(const int8_t* q, int64_t n, float sc, int nib, bf16* out) {
    int64_t d = 0;
#if defined(__AVX512BW__)
    const __m512 s = _mm512_set1_ps(sc);
    for (; d + 16 <= n; d += 16) {
        __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + d)));
        if (nib == 1) x = _mm512_srai_epi32(_mm512_slli_epi32(x, 28), 28);
        if (nib == 2) x = _mm512_srai_epi32(x, 4);
        _mm256_storeu_si256((__m256i*)(out + d), round_bf16x16(_mm512_mul_ps(_mm512_cvtepi32_ps(x), s)));
    }
#elif defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(sc);
    for (; d + 8 <= n; d += 8) {
        __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + d)));
        if (nib == 1) x = _mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28);
        if (nib == 2) x = _mm256_srai_epi32(x, 4);
        _mm_storeu_si128((__m128i*)(out + d), round_bf16x8(_mm256_mul_ps(_mm256_cvtepi32_ps(x), s)));
    }
#endif
    for (; d < n; d++) {
        const int v = nib == 0 ? q[d] : nib == 1 ? ((q[d] & 15) ^ 8) - 8 : q[d] >> 4;
        out[d] = f2bf((float)v * sc);
    }
}

/* Cache row `row` (slot * Hkv + head) of K (which = 0) or V (1) as bf16: in place for a bf16 cache; for an int8
 * cache dequantized into tmp, rounded to bf16 as Int8PagedAttention._decoded does. */
static inline const bf16* kv_row(const it_model* m, const void* cache, int which, int64_t row, bf16* tmp) {
    const int64_t D = m->head_dim, rows = m->num_blocks * m->block_size * m->n_kv_heads;
    if (!m->kv_int8) return (const bf16*)cache + (which * rows + row) * D;
    const int8_t* q = (const int8_t*)cache + (which * rows + row) * (D + 4);
    float sc;
    memcpy(&sc, q + D, 4);
    kv_dequant(q, D, sc, 0, tmp);
    return tmp;
}

/* An IEEE half's bits as a float (the int4 tier's scales: normal or subnormal, never inf or NaN) */
static inline float kv_h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, mant = h & 0x3ffu;
    float f;
    if (e) {
        uint32_t bits = sign | ((e + 112u) << 23) | (mant << 13);
        memcpy(&f, &bits, 4);
        return f;
    }
    f = (float)mant * 5.9604644775390625e-08f; /* mant * 2^-24, exact */
    return sign ? -f : f;
#endif
}

/* Row `row` of an int4 block (the int4 tier, Int8PagedAttention.pack_int4's layout): its first token's record
 * (kind 1) or its second's (kind 2), D / 2 bytes of nibbles (values i and D / 2 + i in byte i) and an fp16 scale,
 * as D bf16 values */
static inline const bf16* kv_row_int4(const it_model* m, const void* cache, int which, int64_t row, int64_t kind,
                                      bf16* tmp) {
    const int64_t D = m->head_dim, rows = m->num_blocks * m->block_size * m->n_kv_heads, half = D / 2;
    const int8_t* q = (const int8_t*)cache + (which * rows + row) * (D + 4) + (kind - 1) * (half + 2);
    uint16_t h;
    memcpy(&h, q + half, 2);
    const float sc = kv_h2f(h);
    kv_dequant(q, half, sc, 1, tmp);
    kv_dequant(q, half, sc, 2, tmp + half);
    return tmp;
}

/* The cache slot of key j of a sequence with block table `table` (bs, the block size, is a power of two: a 64-bit
 * division here had cost more than the dot products); a bf16 cache's tables never hold an int4 entry */
static inline int64_t kv_slot(const int64_t* table, int64_t j, int64_t bs) {
    const int sh = __builtin_ctzll((unsigned long long)bs);
    return (table[j >> sh] << sh) | (j & (bs - 1));
}

/* Key j's K (which = 0) or V (1) row of KV head g in a bf16 cache */
static inline const bf16* kv_bf16_row(const it_model* m, const void* cache, int which, const int64_t* table, int64_t j,
                                      int64_t g) {
    const int64_t D = m->head_dim, hkv = m->n_kv_heads, rows = m->num_blocks * m->block_size * hkv;
    return (const bf16*)cache + (which * rows + kv_slot(table, j, m->block_size) * hkv + g) * D;
}

/* K (0) or V (1) rows of keys j0 .. j0 + nb - 1 that lie in one block of a bf16 cache: one lookup, rows hkv D apart */
static inline void kv_block_rows(const it_model* m, const void* cache, int which, const int64_t* table, int64_t j0,
                                 int nb, int64_t g, const bf16** rows) {
    const bf16* r = kv_bf16_row(m, cache, which, table, j0, g);
    const int64_t ld = m->n_kv_heads * m->head_dim;
    for (int jj = 0; jj < nb; jj++) rows[jj] = r + jj * ld;
}

/* K (0) or V (1) rows of keys j0 .. j0 + nb - 1 of a sequence (block table `table`, kv head g) into rows[]. An entry
 * with IT_INT4_LO / IT_INT4_HI set (the int4 tier, an int8 cache) reads that half of its int4 block. */
static inline void kv_rows(const it_model* m, const void* cache, int which, const int64_t* table, int64_t j0, int nb,
                           int64_t g, bf16* tmp, const bf16** rows) {
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads;
    if (!m->kv_int8 && (j0 & (bs - 1)) + nb <= bs) {
        kv_block_rows(m, cache, which, table, j0, nb, g, rows);
        return;
    }
    const int sh = __builtin_ctzll((unsigned long long)bs);
    for (int jj = 0; jj < nb; jj++) {
        const int64_t j = j0 + jj, entry = table[j >> sh], kind = entry >> IT_INT4_SHIFT;
        const int64_t row = ((((entry & IT_BLOCK_ID_MASK) << sh) | (j & (bs - 1))) * hkv) + g;
        rows[jj] = kind ? kv_row_int4(m, cache, which, row, kind, tmp + jj * D) : kv_row(m, cache, which, row, tmp + jj * D);
    }
}

/* A row's keys under a sliding window (window > 0): it attends to its last `window` keys, len - window .. len - 1
 * (transformers' mask: key j seen from query i iff i - window < j <= i). The blocks below the window's first may be
 * freed (their table entries hold any id), so the row reads from the block that holds that key on: *table advanced
 * to it and *len the keys from there. Returns how many of those keys lie before the window (fewer than a block),
 * which the caller masks (kv_mask_scores, then kv_zero_probs). window 0, or a context within it: the whole. */
static inline int64_t kv_window(int64_t window, int64_t block_size, const int64_t** table, int64_t* len) {
    if (window <= 0 || *len <= window) return 0;
    const int64_t first = *len - window, b0 = first / block_size;
    *table += b0;
    *len -= b0 * block_size;
    return first - b0 * block_size;
}

/* The first skip scores of G rows (ld apart) out of the softmax: -inf before it (so they do not count in a row's
 * max), and their probabilities zero after it (the exp of a clamped -inf is tiny, not zero) */
static inline void kv_mask_scores(float* sc, int64_t ld, int64_t G, int64_t skip) {
    for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < skip; j++) sc[h * ld + j] = -INFINITY;
}
static inline void kv_zero_probs(float* p, int64_t ld, int64_t G, int64_t skip) {
    for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < skip; j++) p[h * ld + j] = 0.0f;
}

/* Write one K or V row (bf16 [D]) into the cache; int8: symmetric amax / 127 scale, as Int8PagedAttention. */
static inline void kv_write(const it_model* m, void* cache, int which, int64_t row, const bf16* x) {
    const int64_t D = m->head_dim, rows = m->num_blocks * m->block_size * m->n_kv_heads;
    if (!m->kv_int8) {
        memcpy((bf16*)cache + (which * rows + row) * D, x, (size_t)D * 2);
        return;
    }
    int8_t* q = (int8_t*)cache + (which * rows + row) * (D + 4);
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) { const float a = fabsf(bf2f(x[d])); amax = a > amax ? a : amax; }
    float sc = amax / 127.0f;
    sc = sc < 1e-8f ? 1e-8f : sc;
    for (int64_t d = 0; d < D; d++) {
        float v = nearbyintf(bf2f(x[d]) / sc);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[d] = (int8_t)v;
    }
    memcpy(q + D, &sc, 4);
}

#if defined(__x86_64__)
#include <immintrin.h>

/* Asks for the cache lines of entries i0 .. i0 + 15 of one sequence's K/V stream (its K rows 0 .. len - 1, then its
 * V rows; a bf16 cache) ahead of their use: the rows sit in scattered blocks the hardware prefetchers do not follow. */
IT_PREFETCH_FN void kv_prefetch(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                               int64_t i0) {
    if (m->kv_int8) return;
    const int64_t D = m->head_dim, end = i0 + 16 < 2 * len ? i0 + 16 : 2 * len;
    for (int64_t i = i0; i < end; i++) {
        const int which = i >= len;
        const char* r = (const char*)kv_bf16_row(m, cache, which, table, i - which * len, g);
        for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
    }
}

/* Whether a sequence's 16-key chunks (keys j0 .. j0 + 15, j0 a multiple of 16) each lie in one block of a bf16 cache,
 * rows n_kv_heads * head_dim apart: the decode attention then takes a chunk's rows from its first (kv_block_rows, the
 * check out of its loops) and asks for a chunk ahead the same way (kv_ahead) */
static inline int kv_chunked(const it_model* m) { return !m->kv_int8 && m->block_size % 16 == 0; }

/* The chunk to ask for ahead of chunk j0 of a pass over K (which = 0; past K's last chunk, V's first ones) or V (1):
 * the first row of the chunk `ahead` keys on (NULL: none left) and its keys in *n (kv_chunked caches) */
static inline const char* kv_ahead(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                                   int which, int64_t j0, int64_t ahead, int* n) {
    int64_t j = j0 + ahead;
    const int64_t len16 = (len + 15) & ~(int64_t)15;
    if (!which && j >= len16) { j -= len16; which = 1; }
    if (j >= len) { *n = 0; return NULL; }
    *n = (int)(len - j < 16 ? len - j : 16);
    return (const char*)kv_bf16_row(m, cache, which, table, j, g);
}

/* Keys k0 .. k1 - 1 of a chunk kv_ahead found (rows ld bf16 apart, D wide) into L1: a few rows at a time between the
 * arithmetic, not all at once (the L1's outstanding misses are few: a burst of them stalls the loads behind it) */
IT_PREFETCH_FN void kv_ask(const char* r, int64_t ld, int64_t D, int k0, int k1) {
    for (int k = k0; k < k1; k++)
        for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(r + k * ld * 2 + b, _MM_HINT_T0);
}

/* The decode attention's rows of keys j0 .. j0 + nb - 1 (K: which = 0, V: 1) into rows[], and, where `ask`, what lies
 * `ahead` keys on. chunked (kv_chunked(m), taken out of the caller's loops): one lookup a chunk (kv_block_rows), and
 * the first row of the chunk ahead returned with its keys in *na, for the caller to kv_ask a few rows at a time; else
 * kv_rows, the keys ahead asked for at once (kv_prefetch), NULL returned and *na = 0. */
static inline __attribute__((always_inline)) const char* kv_attn_rows(const it_model* m, const void* cache, int which,
                                                                      const int64_t* table, int64_t len, int64_t j0,
                                                                      int nb, int64_t g, bf16* tmp, const bf16** rows,
                                                                      int chunked, int ask, int64_t ahead, int* na) {
    *na = 0;
    if (chunked) {
        kv_block_rows(m, cache, which, table, j0, nb, g, rows);
        return ask ? kv_ahead(m, cache, table, len, g, which, j0, ahead, na) : NULL;
    }
    if (ask) kv_prefetch(m, cache, table, len, g, which * len + j0 + ahead);
    kv_rows(m, cache, which, table, j0, nb, g, tmp, rows);
    return NULL;
}

#endif
#endif
