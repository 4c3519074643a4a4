/* ------------------------------------------------------------------ 12-bit weights: entry points and packer */

int it_linear_bf16c(const bf16* x, int64_t ldx, const bf16c* cw, const bf16* bias, bf16* y, int64_t ldy, int64_t M,
                    int64_t N, int64_t K, int nthreads, int64_t inter, int epi) {
    if (M < 1 || N % 16 || K % 32) return -2;
    if (inter && (N != 2 * inter || inter % 16 || bias)) return -3;
    const int tiles = amx_state == 1 && M > 16; /* (without AMX: bf16c_noamx.c, no scratch) */
    bf16* scratch = tiles ? aligned_alloc(64, (size_t)bf16c_scratch_bytes(M, K)) : NULL;
    bf16* wdec = tiles ? aligned_alloc(64, (size_t)bf16c_dec_bytes(M, N, K, nthreads)) : NULL;
    linear_bf16c(x, ldx, cw, bias, y, ldy, M, N, K, nthreads, scratch, wdec, inter, epi);
    free(wdec);
    free(scratch);
    return 0;
}

/* How many slabs of K the tile GEMM cuts an M-row product into (1: K in one piece, the sums kept in the tiles) */
int64_t it_bf16c_slabs(int64_t M, int64_t K) {
    if (M <= 16 || K % 32) return 1;
    const int64_t KS = K / 32, KSL = bf16c_slab_ks(M, K);
    return (KS + KSL - 1) / KSL;
}

/* Packing (kernels/cpu.py pack_bf16c drives it): the histogram of high bytes; then the codes of every tile, with
 * each tile's count of weights outside the table; then the escapes' positions and values (esc_start filled). */
void it_bf16c_hist(const bf16* w, int64_t n, int64_t* hist, int nthreads) {
    memset(hist, 0, 256 * sizeof(int64_t));
    const int nt = pick_threads(nthreads, n * 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
        int64_t mine[256] = {0};
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) mine[w[i] >> 8]++;
#pragma omp critical
        for (int h = 0; h < 256; h++) hist[h] += mine[h];
    }
}

/* Byte s of a row pair's stored low bytes is weight BF16C_ORDER[s] of the pair (row r's 32, then row r + 1's):
 * VPUNPCKLBW / VPUNPCKHBW interleave bytes 0-7 / 8-15 of each 128-bit lane, so s = 16 L + 8 h + j carries weight
 * 32 h + 8 L + j, and the low unpack gives row r in order, the high one row r + 1. */
static const uint8_t BF16C_ORDER[64] = {0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35, 36, 37, 38, 39,
                                        8, 9, 10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
                                        16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
                                        24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};

/* 16 x 16 32-bit words: out row i = column i of the 16 rows at src (row strides ld and ldo, in bf16) */
static inline void transpose_pairs16(const bf16* src, int64_t ld, bf16* out, int64_t ldo) {
    float t[256] __attribute__((aligned(64)));
    __m512 r[16];
    for (int i = 0; i < 16; i++) _mm512_store_si512((void*)(t + 16 * i), _mm512_loadu_si512((const void*)(src + i * ld)));
    transpose16x16_ps(t, r);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512((void*)(out + ldo * i), _mm512_castps_si512(r[i]));
}

/* Tile (chunk c, k-step ks) of w [N, K] in the decoded order: vt [64][32], row 16 g + p = features 16 g .. +15 of
 * chunk c, each its weights 2 p and 2 p + 1; zero for features past N. inter > 0: w is a gate_up [2 inter, K]
 * packed with gate and up interleaved 16 by 16 (feature tile 2 i: gate rows 16 i.., 2 i + 1: up rows inter + 16 i..) */
static void vnni_tile(const bf16* w, int64_t N, int64_t K, int64_t inter, int64_t c, int64_t ks, bf16* vt) {
    for (int g = 0; g < 4; g++) {
        const int64_t n = c * 64 + 16 * g, tile = n / 16;
        const int64_t row = inter ? (tile % 2) * inter + (tile / 2) * 16 : n;
        if (n >= N) memset(vt + g * 512, 0, 1024);
        else transpose_pairs16(w + row * K + ks * 32, K, vt + g * 512, 32);
    }
}

__attribute__((target("avx512vbmi")))
void it_bf16c_pack(const bf16* w, int64_t N, int64_t K, int64_t inter, const uint8_t* table, uint8_t* codes, int32_t* esc_count,
                   int nthreads) {
    const int64_t nchunks = (N + 63) / 64, KS = K / 32;
    const __m512i order = _mm512_loadu_si512((const void*)BF16C_ORDER);
#pragma omp parallel for num_threads(pick_threads(nchunks, N * K * 2, nthreads)) schedule(static)
    for (int64_t c = 0; c < nchunks; c++)
        for (int64_t ks = 0; ks < KS; ks++) {
            uint8_t* b = codes + (c * KS + ks) * BF16C_TILE_BYTES;
            bf16 vt[64 * 32] __attribute__((aligned(64)));
            vnni_tile(w, N, K, inter, c, ks, vt);
            int32_t esc = 0;
            for (int r = 0; r < 64; r += 2) {
                uint8_t* p = b + r * 48;
                if (c * 64 + (r / 16) * 16 >= N) { /* the rows of a padding feature tile */
                    memset(p, 0, 96);
                    continue;
                }
                const __m512i v0 = _mm512_loadu_si512((const void*)(vt + r * 32));
                const __m512i v1 = _mm512_loadu_si512((const void*)(vt + (r + 1) * 32));
                const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(v0)),
                                                      _mm512_cvtepi16_epi8(v1), 1);
                const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(v0, 8))),
                                                      _mm512_cvtepi16_epi8(_mm512_srli_epi16(v1, 8)), 1);
                __m512i code = _mm512_setzero_si512();
                __mmask64 found = 0;
                for (int t = 0; t < 16; t++) {
                    const __mmask64 m = _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)table[t]));
                    code = _mm512_mask_mov_epi8(code, m, _mm512_set1_epi8((char)t));
                    found |= m;
                }
                esc += 64 - __builtin_popcountll(found);
                const __m512i cs = _mm512_permutexvar_epi8(order, code);
                _mm512_storeu_si512((void*)p, _mm512_permutexvar_epi8(order, lo));
                _mm256_storeu_si256((__m256i*)(p + 64), _mm256_or_si256(_mm512_castsi512_si256(cs),
                                    _mm256_slli_epi16(_mm512_extracti64x4_epi64(cs, 1), 4)));
            }
            esc_count[c * KS + ks] = esc;
        }
}

/* esc_start [tiles + 1] (the prefix sums of esc_count) given; fills esc_pos / esc_val tile by tile */
void it_bf16c_escapes(const bf16* w, int64_t N, int64_t K, int64_t inter, const int8_t* code_of, const int32_t* esc_start,
                      uint16_t* esc_pos, bf16* esc_val, int nthreads) {
    const int64_t nchunks = (N + 63) / 64, KS = K / 32;
#pragma omp parallel for num_threads(pick_threads(nchunks, N * K * 2, nthreads)) schedule(static)
    for (int64_t c = 0; c < nchunks; c++)
        for (int64_t ks = 0; ks < KS; ks++) {
            int32_t e = esc_start[c * KS + ks];
            if (e == esc_start[c * KS + ks + 1]) continue; /* most tiles have none */
            bf16 vt[64 * 32] __attribute__((aligned(64)));
            vnni_tile(w, N, K, inter, c, ks, vt);
            for (int r = 0; r < 64 && c * 64 + (r / 16) * 16 < N; r++)
                for (int j = 0; j < 32; j++) {
                    const bf16 v = vt[r * 32 + j];
                    if (code_of[v >> 8] < 0) { esc_pos[e] = (uint16_t)(r * 32 + j); esc_val[e] = v; e++; }
                }
        }
}

/* The bf16 weight [N, K] back from the 12-bit layout (for prefills' GEMMs and tests) */
void it_unpack_bf16c(const bf16c* cw, bf16* w, int64_t N, int64_t K, int nthreads) {
    const int64_t nchunks = (N + 63) / 64;
    const int nt = pick_threads(nchunks, N * K * 2, nthreads);
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            const int ng = (int)((N - c * 64) / 16 < 4 ? (N - c * 64) / 16 : 4);
            bf16 vt[64 * 32] __attribute__((aligned(64)));
            for (int64_t ks = 0; ks < K / 32; ks++) {
                bf16c_tile(cw, K / 32, c, ks, 16 * ng, vt, 32);
                for (int g = 0; g < ng; g++) /* the transpose of 32-bit words undoes itself */
                    transpose_pairs16(vt + g * 512, 32, w + (c * 64 + 16 * g) * K + ks * 32, K);
            }
        }
    }
}
