/* The mixture-of-experts kernels (moe.h) over this library's linears: run_lin (decode_ws.c) takes one expert's bf16
 * rows to the GEMV at one row, the AMX tiles at 2-16 and the tile GEMM past them (VDPBF16PS without AMX); int8 /
 * int4 experts go 16 rows a pass through the W8A16 / W4A16 kernels (AMX rebuilds each weight chunk in bf16), 12-bit
 * experts 16 rows a pass through linear_bf16c (AMX tiles, or the tiles decoded into registers without AMX: no
 * scratch; a prefill's expert with more rows decodes its tiles once a pass). Int4 experts of one row each (a decode
 * step's token) take moe_one_row below. */

#define MOE_BF16C
#define MOE_ONE_ROW moe_one_row
#ifndef MOE_ONE_ROW_OFF
#define MOE_ONE_ROW_OFF 0
#endif

static void moe_linear(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                       void* scratch, int silu) {
    const int64_t step = L->kind == IT_KIND_BF16 ? M : 16;
    for (int64_t m0 = 0; m0 < M; m0 += step)
        run_lin(L, x + m0 * ldx, ldx, y + m0 * ldy, ldy, M - m0 < step ? M - m0 : step, nthreads, scratch, NULL, silu);
}

#define moe_linear_scratch lin_scratch_bytes /* (quantized kinds at up to 16 rows a pass) */
#define moe_silu_mul silu_mul_rows

#include "moe.h"

/* [b0, b1): thread t's contiguous share of n blocks over nt threads */
static inline void moe_share(int64_t n, int t, int nt, int64_t* b0, int64_t* b1) {
    *b0 = n * t / nt;
    *b1 = n * (t + 1) / nt;
}

/* One projection of the na experts' rows as one stack of NR-feature blocks, this thread's share [b0, b1): expert a's
 * row reads its int16 row (h and l bytes, group sums, scale) at xrow[a] and writes N features at out + rows[a] * N.
 * At the last blocks of an expert the next one's first bytes are asked for (the in-row prefetch runs past the end). */
static void moe_w4_blocks(const it_lin* L, const int64_t* active, const int64_t* rows, const int64_t* xrow, int64_t na,
                          const int8_t* xh, const int8_t* xl, const float* xsum, const float* sx, bf16* out,
                          int64_t b0, int64_t b1) {
    const int64_t N = L->N, K = L->K, gs = L->group, G = K / gs, per = (N + NR - 1) / NR;
    const int64_t ahead = (pf_far_offset(NR * (K / 2)) + NR * (K / 2) - 1) / (NR * (K / 2)); /* blocks */
    for (int64_t b = b0; b < b1; b++) {
        const int64_t a = b / per, n0 = (b % per) * NR, r = xrow[a];
        const it_lin e = moe_expert_lin(L, active[a]);
        if (b % per == per - 1 - ahead && a + 1 < na && b + ahead + 1 < b1) { /* the next expert's first blocks */
            const it_lin nx = moe_expert_lin(L, active[a + 1]);
            for (int64_t off = 0; off < (ahead + 1) * NR * (K / 2); off += 64)
                __builtin_prefetch((const char*)nx.w + off, 0, 2);
        }
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        float o[NR], z[NR];
        const uint8_t* w = (const uint8_t*)e.w + n0 * (K / 2);
        const float *s = (const float*)e.scale + n0 * G, *zr = e.zero + n0 * G;
        if (nr == NR)
            w4b_block(xh + r * K, xl + r * K, xsum + r * G, w, NR, K, gs, s, zr, o, z);
        else
            w4b_block(xh + r * K, xl + r * K, xsum + r * G, w, nr, K, gs, s, zr, o, z);
        bf16* y = out + rows[a] * N + n0;
        for (int j = 0; j < nr; j++) y[j] = f2bf(o[j] * sx[r] + z[j] + (e.bias ? bf2f(e.bias[n0 + j]) : 0.0f));
    }
}

/* Int4 experts (groups of 128 or more) where every expert picked holds one row: the tokens' rows are rounded to int16
 * once (not once an expert), then the experts' gate_up rows run as one stack of row blocks split evenly over the
 * threads, each row's SiLU-and-multiply and its rounding, then the down rows the same way, in one parallel region.
 * Each product is linear_w4's at one row (quantize_rows_i16, w4b_block), so ys are bit for bit the per-expert
 * path's; what changes is that no thread waits on an expert of its own while the other streams, and the weights of
 * the next expert are asked for before its first block. */
static int moe_one_row(const moe_rows* m, const int64_t* active, int64_t na, int64_t T, int nthreads) {
    const it_lin *gl = m->gate_up, *dl = m->down;
    if (gl->kind != IT_KIND_W4 || dl->kind != IT_KIND_W4 || gl->group % 128 || dl->group % 128) return 0;
    if (MOE_ONE_ROW_OFF || use_q_dq(1, IT_KIND_W4) || use_q_amx(1, gl->N, gl->K) || use_q_amx(1, dl->N, dl->K)) return 0; /* (A/B settings) */
    const int64_t H = m->H, I = m->I, Gh = H / gl->group, Gi = I / dl->group;
    /* per token: int16 row [H], scale, group sums, then h bytes [T, H] and l bytes [T, H]; per expert row the same over I */
    const int64_t o_sx = MOE_ALIGN64(T * H * 2), o_xs = o_sx + MOE_ALIGN64(T * 4), o_xh = o_xs + MOE_ALIGN64(T * Gh * 4);
    const int64_t o_aq = o_xh + MOE_ALIGN64(T * H * 2), o_sa = o_aq + MOE_ALIGN64(na * I * 2);
    const int64_t o_as = o_sa + MOE_ALIGN64(na * 4), o_ah = o_as + MOE_ALIGN64(na * Gi * 4);
    const int64_t total = o_ah + MOE_ALIGN64(na * I * 2);
    char* buf = (char*)aligned_alloc(64, (size_t)total);
    int16_t *xq = (int16_t*)buf, *aq = (int16_t*)(buf + o_aq);
    float *sx = (float*)(buf + o_sx), *xsum = (float*)(buf + o_xs), *sa = (float*)(buf + o_sa);
    float* asum = (float*)(buf + o_as);
    int8_t *xh = (int8_t*)(buf + o_xh), *ah = (int8_t*)(buf + o_ah);
    int64_t* idx = (int64_t*)malloc((size_t)(3 * na) * 8); /* each expert's row, its token, its own index */
    int64_t *rows = idx, *tok = idx + na, *self = idx + 2 * na;
    for (int64_t a = 0; a < na; a++) {
        rows[a] = m->start[active[a]];
        tok[a] = m->order[rows[a]] / m->k;
        self[a] = a;
    }
    const int64_t nb_g = na * ((2 * I + NR - 1) / NR), nb_d = na * ((H + NR - 1) / NR);
    const int nt = (int)(nthreads < nb_d ? nthreads : nb_d);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t b0, b1;
        for (int64_t j = t; j < T; j += n) {
            quantize_rows_i16(m->x + j * m->ldx, m->ldx, 1, H, H, xq + j * H, sx + j, xsum + j * Gh, gl->group);
            w4b_split_row(xq + j * H, H, xh + j * H, xh + T * H + j * H);
        }
#pragma omp barrier
        moe_share(nb_g, t, n, &b0, &b1);
        moe_w4_blocks(gl, active, rows, tok, na, xh, xh + T * H, xsum, sx, m->gu, b0, b1);
#pragma omp barrier
        for (int64_t a = t; a < na; a += n) {
            const int64_t r = rows[a];
            silu_mul_row(m->gu + r * 2 * I, m->gu + r * 2 * I + I, m->act + r * I, I);
            quantize_rows_i16(m->act + r * I, I, 1, I, I, aq + a * I, sa + a, asum + a * Gi, dl->group);
            w4b_split_row(aq + a * I, I, ah + a * I, ah + na * I + a * I);
        }
#pragma omp barrier
        moe_share(nb_d, t, n, &b0, &b1);
        moe_w4_blocks(dl, active, rows, self, na, ah, ah + na * I, asum, sa, m->ys, b0, b1);
    }
    free(idx);
    free(buf);
    return 1;
}
