/* ------------------------------------------------------------------ bf16 weights in 12 bits, losslessly
 *
 * A bf16 weight is a high byte (sign and 7 exponent bits) and a low byte (the last exponent bit and 7 mantissa
 * bits). A layer's weights use few high bytes (a trained or random layer's exponents span a few binades), so
 * each weight is stored as its low byte plus a 4-bit code into a table of the layer's 16 most common high bytes;
 * the rare weight whose high byte is not in the table is stored aside and patched in. Decoding is a table
 * lookup (VPSHUFB) and two widenings per 32 weights, exact: the tiles see the very bf16 values of the
 * checkpoint, 25% fewer bytes stream from memory in a decode step, and the layer holds 0.75x the memory.
 *
 * Layout (built by kernels/cpu.py pack_bf16c): the output features in chunks of 64 (zero-padded), each chunk as
 * K / 32 tiles of 64 features x 32 weights. A tile is stored as it decodes: four AMX B operands in VNNI order, one
 * per 16 features (64 "rows" of 64 bytes: row 16 g + p holds, for features 16 g .. 16 g + 15, their weights 2 p and
 * 2 p + 1), each pair of rows 96 bytes (see bf16c_tile). So the kernels multiply x (rows as they are, the A
 * operand) by decoded tiles straight away: no transpose of x going in, none of the products coming out. Tiles
 * follow each other chunk by chunk, so a thread walking its chunks reads one sequential stream.
 */

#define BF16C_TILE_BYTES (64 * 48)
#ifndef BF16C_PF_TILES
#define BF16C_PF_TILES 4 /* the default prefetch distance along the stream, in tiles */
#endif

/* The prefetch distance along the 12-bit stream, in bytes: BF16C_PF_TILES tiles unless kernels/cpu.py sets it once
 * at load, before any kernel runs (it_set_prefetch_bf16c; the kernels only read it). 4 tiles were tuned before the
 * weights sat on 2 MB pages; on an Intel Xeon with AMX (model 167, 2026-12-07) 1 tile streams faster, on 2 MB pages
 * and on 4 KB ones (a batch-1 decode of the 386M model 0.89x the time, 0.80x on the AVX-512 path without AMX; the MoE
 * preset's 16 requests 0.95x), so cpu.py sets 1 on Intel CPUs and keeps 4 elsewhere (the Zen 4 / 5's distance,
 * not measured again). */
static int64_t pf_bf16c_bytes = BF16C_PF_TILES * BF16C_TILE_BYTES;

void it_set_prefetch_bf16c(int64_t tiles) { pf_bf16c_bytes = (tiles > 0 ? tiles : 1) * BF16C_TILE_BYTES; }

int64_t it_get_prefetch_bf16c(void) { return pf_bf16c_bytes / BF16C_TILE_BYTES; }

/* Rows r0 .. r1 - 1 (even bounds) of tile t as bf16 into out, rows ld elements apart, escapes not patched. Two
 * rows a step: their 64 low bytes (in the order VPUNPCKL/HBW interleave, see pack_bf16c), then 32 bytes of codes (byte i:
 * low byte i's code in its low nibble, low byte i + 32's in its high nibble); one VPSHUFB looks up the 64 high
 * bytes, and the two unpacks write the two rows. */
/* Rows r and r + 1 of a tile from their 144 bytes at p (r even): prefetches the stream ahead every 4 rows (3 lines;
 * into L2 where bf16 weights prefetch far, else L1: pf_bf16_far_bytes), looks the high bytes up in table and interleaves them with the
 * low bytes into *row0 and *row1 */
static inline void bf16c_row_pair(const uint8_t* p, int r, __m512i table, __m512i* row0, __m512i* row1) {
    if ((r & 3) == 0)
        for (int l = 0; l < 192; l += 64)
            pf_weights(p + l, pf_bf16_far_bytes ? pf_bf16c_bytes : 0, pf_bf16c_bytes);
    const __m256i nib = _mm256_loadu_si256((const __m256i*)(p + 64));
    const __m512i code = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(nib), _mm256_srli_epi16(nib, 4), 1), _mm512_set1_epi8(0x0f));
    const __m512i hi = _mm512_shuffle_epi8(table, code), lo = _mm512_loadu_si512((const void*)p);
    *row0 = _mm512_unpacklo_epi8(lo, hi);
    *row1 = _mm512_unpackhi_epi8(lo, hi);
}

static inline __m512i bf16c_table(const bf16c* c) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)c->table));
}

static inline void bf16c_pairs(const bf16c* c, int64_t t, int r0, int r1, bf16* out, int64_t ld) {
    const uint8_t* b = c->codes + t * BF16C_TILE_BYTES;
    const __m512i table = bf16c_table(c);
    for (int r = r0; r < r1; r += 2) {
        __m512i a, z;
        bf16c_row_pair(b + r * 48, r, table, &a, &z);
        _mm512_storeu_si512(out + r * ld, a);
        _mm512_storeu_si512(out + (r + 1) * ld, z);
    }
}

/* The escapes of tile t (weights outside the table) patched into its decoded rows at out (ld elements apart) */
static inline void bf16c_patch(const bf16c* c, int64_t t, bf16* out, int64_t ld) {
    for (int32_t e = c->esc_start[t]; e < c->esc_start[t + 1]; e++)
        out[(c->esc_pos[e] >> 5) * ld + (c->esc_pos[e] & 31)] = c->esc_val[e];
}

/* Rows 0 .. rows - 1 of tile (chunk, ks), escapes patched */
static inline void bf16c_tile(const bf16c* c, int64_t KS, int64_t chunk, int64_t ks, int rows, bf16* out,
                              int64_t ld) {
    bf16c_pairs(c, chunk * KS + ks, 0, rows, out, ld);
    bf16c_patch(c, chunk * KS + ks, out, ld);
}

