/* The mixture-of-experts kernels (moe.h) over this library's linears: run_lin (decode_ws.c) takes one expert's bf16
 * rows to the GEMV at one row, the AMX tiles at 2-16 and the tile GEMM past them (VDPBF16PS without AMX); int8 /
 * int4 experts go 16 rows a pass through the W8A16 / W4A16 kernels (AMX rebuilds each weight chunk in bf16), 12-bit
 * experts all their rows in one linear_bf16c (see moe_linear). Int8 / int4 experts of one row each (a
 * decode step's token) take moe_one_row below. */

#define MOE_BF16C
/* an expert's gate_up writes act itself: a 12-bit one packed interleaved, or on AMX past 16 rows a packed W4A16 or
   W8A16 one (its decoder pairs the gate and up tiles, gemm_w4p.c w4p_act_takes, gemm_w8p.c w8p_act_takes) */
#define MOE_ACT_IN_GATE_UP(g, n)                                                                                     \
    (((g)->kind == IT_KIND_BF16C && (g)->inter) ||                                                                 \
     ((g)->kind == IT_KIND_W4P && !(g)->bias && w4p_act_takes(n, (g)->N, (g)->group)) ||                           \
     ((g)->kind == IT_KIND_W8P && w8p_act_takes(n, (g)->N, (g)->K, (g)->bias)))
#define MOE_ONE_ROW moe_one_row
/* an expert's down rows, read by the combine only once every expert is done: 12-bit ones past the caches
   (bf16c_gemm.c BF16C_EPI_STREAM; other kinds ignore it) */
#define MOE_DOWN_EPI BF16C_EPI_STREAM
#define MOE_ONE_ROW_BYTES moe_one_row_bytes
#ifndef MOE_ONE_ROW_OFF
#define MOE_ONE_ROW_OFF 0
#endif

/* A 12-bit expert's rows go to linear_bf16c all at once: past 16 rows its GEMM (the AMX tiles, or VDPBF16PS on the
 * decoded tiles without AMX) decodes each 64-feature chunk of the weight once a block of 512 rows, where passes of 16
 * rows would decode it once a pass (a prefill's expert holds hundreds of rows). On AMX that GEMM takes a zero-padded
 * last row tile and each thread's two decoded chunks from the scratch: moe_bf16c_scratch. A packed W4A16 or W8A16
 * expert's rows past 16 take the same GEMM on AMX (its nibbles or bytes rebuilt in bf16 chunk by chunk, gemm_w4p.c,
 * gemm_w8p.c). */
static inline int64_t moe_bf16c_scratch(int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M <= 16) return 0;
    return ALIGN64(bf16c_scratch_bytes(M, K)) + ALIGN64(bf16c_dec_bytes(M, (N + 15) / 16 * 16, K, nthreads));
}

static void moe_linear(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                       void* scratch, int silu) {
    if (L->kind == IT_KIND_BF16C || (L->kind == IT_KIND_W4P && w4p_tiles_take(M, L->N, L->group)) ||
        (L->kind == IT_KIND_W8P && w8p_tiles_take(M, L->N, L->K))) {
        bf16* dec = (bf16*)((char*)scratch + ALIGN64(bf16c_scratch_bytes(M, L->K)));
        run_lin(L, x, ldx, y, ldy, M, nthreads, scratch, M > 16 ? dec : NULL, silu);
        return;
    }
    /* (W8A8 and the packed W8A16 / W4A16: their kernels take any row count, and lin_scratch_bytes holds what they
       need for all of them; int8 / int4 rows: 16 a pass) */
    const int64_t step =
        L->kind == IT_KIND_BF16 || L->kind == IT_KIND_W8A8 || L->kind == IT_KIND_W8P || L->kind == IT_KIND_W4P ? M : 16;
    for (int64_t m0 = 0; m0 < M; m0 += step)
        run_lin(L, x + m0 * ldx, ldx, y + m0 * ldy, ldy, M - m0 < step ? M - m0 : step, nthreads, scratch, NULL, silu);
}

/* the scratch of moe_linear at up to M rows of [N, K] (quantized kinds at up to 16 rows a pass) */
static inline int64_t moe_linear_scratch(int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t lin = lin_scratch_bytes(M, K, nthreads), c = moe_bf16c_scratch(M, N, K, nthreads);
    return lin > c ? lin : c;
}

#define moe_silu_mul silu_mul_rows

/* moe.h's combine, 16 features a vector: acc[j] += bf16(y[j] * w), then o = bf16(acc), as its portable loop (finite
 * values; the portable one was scalar: a third of a 2048-token layer's time with small experts) */
static inline void moe_add_row16(float* acc, const bf16* y, float w, int64_t n) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = mask16(n - j);
        const __m512 p = bf16_round_f32(_mm512_mul_ps(load_bf16x16(y + j, m), wv));
        _mm512_mask_storeu_ps(acc + j, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + j), p));
    }
}
static inline void moe_store_row16(bf16* o, const float* acc, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = mask16(n - j);
        _mm256_mask_storeu_epi16(o + j, m, round_bf16x16(_mm512_maskz_loadu_ps(m, acc + j)));
    }
}
/* o = bf16(o + bf16(acc)), add_rows's rounding (store_sum_bf16x16), 16 features a vector */
static inline void moe_add_store_row16(bf16* o, const float* acc, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = mask16(n - j);
        store_sum_bf16x16(o + j, load_bf16x16(o + j, m), bf16_round_f32(_mm512_maskz_loadu_ps(m, acc + j)), m);
    }
}
#define MOE_ADD_ROW moe_add_row16
#define MOE_STORE_ROW moe_store_row16
#define MOE_ADD_STORE_ROW moe_add_store_row16

/* moe.h's router scores of one row, 16 experts a vector: softmax exp(l - max) / sum (the sum in 16 lanes, then
 * across them) or sigmoid 1 / (1 + exp(-l)), with exp512 (~1e-7 relative) where the scalar loop calls expf: the
 * weights agree with route()'s to ~1e-7 (tests/test_moe_kernels.py holds them to 1e-6), the picks are the same but
 * where two scores sit within an ulp of each other. A row with a NaN or an infinite logit returns 0 (the scalar loop,
 * whose NaN handling hands the row back; exp512 clamps). Was 64 scalar expf a row: ~0.9 us a token of a 64-expert
 * router, ~12 ms of a 16 x 128 MoE preset prefill. */
static inline int moe_scores16(int softmax, const float* logit, float* scores, int64_t E) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    for (int64_t e = 0; e < E; e += 16) {
        const __mmask16 m = mask16(E - e);
        const __m512 l = _mm512_maskz_loadu_ps(m, logit + e);
        bad |= _mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(l), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ); /* NaN or inf */
        mx = _mm512_mask_max_ps(mx, m, mx, l);
    }
    if (bad) return 0;
    if (!softmax) {
        for (int64_t e = 0; e < E; e += 16) {
            const __mmask16 m = mask16(E - e);
            const __m512 l = _mm512_maskz_loadu_ps(m, logit + e);
            const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), l)));
            _mm512_mask_storeu_ps(scores + e, m, _mm512_div_ps(_mm512_set1_ps(1.0f), d));
        }
        return 1;
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t e = 0; e < E; e += 16) {
        const __mmask16 m = mask16(E - e);
        const __m512 x = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, logit + e), top));
        _mm512_mask_storeu_ps(scores + e, m, x);
        sum = _mm512_mask_add_ps(sum, m, sum, x);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t e = 0; e < E; e += 16) {
        const __mmask16 m = mask16(E - e);
        _mm512_mask_storeu_ps(scores + e, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + e), inv));
    }
    return 1;
}
#ifndef MOE_SCORES_OFF
#define MOE_SCORES moe_scores16
#endif

#include "moe.h"

/* [b0, b1): thread t's contiguous share of n blocks over nt threads */
static inline void moe_share(int64_t n, int t, int nt, int64_t* b0, int64_t* b1) {
    *b0 = n * t / nt;
    *b1 = n * (t + 1) / nt;
}

/* Rows rounded to int16 for the quantized GEMVs at one row, as linear_w8 / linear_w4 round them: per row the int16
 * values (Kp: K padded to 64 for int8, K for int4), their scale, the signed high and low bytes (split_rows_i16's
 * layout and row sums for int8, w4b_split_row's for int4) and the int4 groups' sums of x. */
typedef struct {
    int64_t K, Kp, G;
    int16_t* q;
    float *s, *sum;
    int8_t *h, *l;
    int32_t *hs, *ls;
} moe_qrows;

static int64_t moe_qrows_bytes_of(int64_t Kp, int64_t G, int64_t rows) {
    return MOE_ALIGN64(rows * Kp * 2) + 2 * MOE_ALIGN64(rows * Kp) + MOE_ALIGN64(rows * 4) +
           MOE_ALIGN64(rows * (G + 1) * 4) + 2 * MOE_ALIGN64(rows * 4);
}

static int64_t moe_qrows_bytes(const it_lin* L, int64_t rows) {
    const int64_t K = L->K, Kp = L->kind == IT_KIND_W8 ? (K + 63) & ~(int64_t)63 : K;
    return moe_qrows_bytes_of(Kp, L->kind == IT_KIND_W4 ? K / L->group : 0, rows);
}

/* moe_one_row's scratch for T tokens at most, whichever kinds it takes (int8: K padded to 64; int4: groups of 128
 * or more): T rows of x rounded for gate_up, a row an expert picked (at most E, at most T k) for down */
static int64_t moe_one_row_bytes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E) {
    const int64_t most = T * k < E ? T * k : E;
    return MOE_ALIGN64(moe_qrows_bytes_of((H + 63) & ~(int64_t)63, H / 128 + 1, T)) +
           moe_qrows_bytes_of((I + 63) & ~(int64_t)63, I / 128 + 1, most);
}

static moe_qrows moe_qrows_at(const it_lin* L, int64_t rows, char* p) {
    moe_qrows r;
    r.K = L->K;
    r.Kp = L->kind == IT_KIND_W8 ? (r.K + 63) & ~(int64_t)63 : r.K;
    r.G = L->kind == IT_KIND_W4 ? r.K / L->group : 0;
    r.q = (int16_t*)p, p += MOE_ALIGN64(rows * r.Kp * 2);
    r.h = (int8_t*)p, p += MOE_ALIGN64(rows * r.Kp);
    r.l = (int8_t*)p, p += MOE_ALIGN64(rows * r.Kp);
    r.s = (float*)p, p += MOE_ALIGN64(rows * 4);
    r.sum = (float*)p, p += MOE_ALIGN64(rows * (r.G + 1) * 4);
    r.hs = (int32_t*)p, p += MOE_ALIGN64(rows * 4);
    r.ls = (int32_t*)p;
    return r;
}

/* row i of q from x (K values) */
static void moe_qrow(const it_lin* L, const moe_qrows* q, int64_t i, const bf16* x) {
    int16_t* xq = q->q + i * q->Kp;
    if (L->kind == IT_KIND_W4) {
        quantize_rows_i16_512(x, q->K, 1, q->K, q->Kp, xq, q->s + i, q->sum + i * q->G, L->group);
        w4b_split_row(xq, q->K, q->h + i * q->Kp, q->l + i * q->Kp);
    } else {
        quantize_rows_i16_512(x, q->K, 1, q->K, q->Kp, xq, q->s + i, NULL, 1);
        split_rows_i16(xq, 1, q->Kp, q->h + i * q->Kp, q->l + i * q->Kp, q->hs + i, q->ls + i);
    }
}

/* One projection of the na experts' rows as one stack of NR-feature blocks, this thread's share [b0, b1): expert a's
 * row (m->start[e], one row an expert) multiplies q's row of its token (by_token: the step's tokens, order / k) or
 * q's row a (the experts' own rows) and writes N features at out + its row * N, as linear_w4 / linear_w8 at one row.
 * At the last blocks of an expert the next one's first bytes are asked for (the in-row prefetch runs past the end). */
static void moe_q_blocks(const moe_rows* m, const it_lin* L, const int64_t* active, int64_t na, int by_token,
                         const moe_qrows* q, bf16* out, int64_t b0, int64_t b1) {
    const int64_t N = L->N, K = L->K, per = (N + NR - 1) / NR, G = q->G, Kp = q->Kp;
    const int w4 = L->kind == IT_KIND_W4;
    const int64_t row_bytes = w4 ? K / 2 : K, ahead = pf_far_offset(NR * row_bytes) / (NR * row_bytes); /* blocks */
    for (int64_t b = b0; b < b1; b++) {
        const int64_t a = b / per, n0 = (b % per) * NR, row = m->start[active[a]];
        const int64_t r = by_token ? m->order[row] / m->k : a;
        const it_lin e = moe_expert_lin(L, active[a] - m->off);
        if (b % per == per - 1 - ahead && a + 1 < na && b + ahead + 1 < b1) { /* the next expert's first blocks */
            const it_lin nx = moe_expert_lin(L, active[a + 1] - m->off);
            for (int64_t off = 0; off < (ahead + 1) * NR * row_bytes; off += 64)
                __builtin_prefetch((const char*)nx.w + off, 0, 2);
        }
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        bf16* y = out + row * N + n0;
        if (w4) {
            float o[NR], z[NR];
            const uint8_t* w = (const uint8_t*)e.w + n0 * (K / 2);
            const float *s = (const float*)e.scale + n0 * G, *zr = e.zero + n0 * G;
            const int8_t *xh = q->h + r * Kp, *xl = q->l + r * Kp;
            if (nr == NR)
                w4b_block(xh, xl, q->sum + r * G, w, NR, K, L->group, s, zr, o, z);
            else
                w4b_block(xh, xl, q->sum + r * G, w, nr, K, L->group, s, zr, o, z);
            for (int j = 0; j < nr; j++)
                y[j] = f2bf(o[j] * q->s[r] + z[j] + (e.bias ? bf2f(e.bias[n0 + j]) : 0.0f));
        } else {
            float o[MR][NR] = {{0.0f}}; /* (w8_block writes row 0 only: GCC cannot see it) */
            const int8_t* w = (const int8_t*)e.w + n0 * K;
            const int8_t *xh = q->h + r * Kp, *xl = q->l + r * Kp;
            if (nr == NR)
                w8_block(xh, xl, Kp, q->hs + r, q->ls + r, 1, w, NR, K, o);
            else
                w8_block(xh, xl, Kp, q->hs + r, q->ls + r, 1, w, nr, K, o);
            for (int j = 0; j < nr; j++) {
                const int64_t n = n0 + j;
                const float sc = e.scale_is_f32 ? ((const float*)e.scale)[n] : bf2f(((const bf16*)e.scale)[n]);
                y[j] = f2bf(o[0][j] * q->s[r] * sc + (e.bias ? bf2f(e.bias[n]) : 0.0f));
            }
        }
    }
}

/* Whether the one-row path takes this projection: int8, or int4 in groups of 128 or more, on the kernels linear_w8 /
 * linear_w4 run at one row (not the AMX or dequantizing paths, which A/B settings can move to one row) */
static int moe_one_row_takes(const it_lin* L) {
    if (L->kind == IT_KIND_W4 && L->group % 128 == 0) return !use_q_dq(1, IT_KIND_W4) && !use_q_amx(1, L->N, L->K);
    if (L->kind == IT_KIND_W8) return !use_q_dq(1, IT_KIND_W8) && !use_q_amx(1, L->N, L->K);
    return 0;
}

/* Int8 / int4 experts where every expert picked holds one row: the tokens' rows are rounded to int16 once (not once
 * an expert), then the experts' gate_up rows run as one stack of row blocks split evenly over the threads, each
 * row's SiLU-and-multiply and its rounding, then the down rows the same way, in one parallel region. Each product is
 * linear_w8's / linear_w4's at one row (quantize_rows_i16, then w8_block / w4b_block), so ys are bit for bit the
 * per-expert path's; what changes is that no thread waits on an expert of its own while the other streams, and the
 * weights of the next expert are asked for before its first block. */
static int moe_one_row(const moe_rows* m, const int64_t* active, int64_t na, int64_t T, int nthreads) {
    const it_lin *gl = m->gate_up, *dl = m->down;
    if (MOE_ONE_ROW_OFF || !moe_one_row_takes(gl) || !moe_one_row_takes(dl)) return 0;
    const int64_t H = m->H, I = m->I, tb = MOE_ALIGN64(moe_qrows_bytes(gl, T));
    char* buf = m->qbuf; /* (moe_one_row_bytes of it, from the caller's workspace) */
    const moe_qrows xq = moe_qrows_at(gl, T, buf), aq = moe_qrows_at(dl, na, buf + tb);
    const int64_t nb_g = na * ((2 * I + NR - 1) / NR), nb_d = na * ((H + NR - 1) / NR);
    const int nt = (int)(nthreads < nb_d ? nthreads : nb_d);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t b0, b1;
        for (int64_t j = t; j < T; j += n) moe_qrow(gl, &xq, j, m->x + j * m->ldx);
#pragma omp barrier
        moe_share(nb_g, t, n, &b0, &b1);
        moe_q_blocks(m, gl, active, na, 1, &xq, m->gu, b0, b1);
#pragma omp barrier
        for (int64_t a = t; a < na; a += n) {
            const int64_t r = m->start[active[a]];
            silu_mul_row(m->gu + r * 2 * I, m->gu + r * 2 * I + I, m->act + r * I, I);
            moe_qrow(dl, &aq, a, m->act + r * I);
        }
#pragma omp barrier
        moe_share(nb_d, t, n, &b0, &b1);
        moe_q_blocks(m, dl, active, na, 0, &aq, m->ys, b0, b1);
    }
    return 1;
}
