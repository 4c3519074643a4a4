/* Mixture-of-experts layers: the routing (GatingTopK) and the routed experts as one grouped GEMM. Portable C over
 * a variant's linear kernels, shared by every ISA's library.
 *
 *   it_moe_route    router logits [T, E] -> each token's top_k experts and their weights, by every rule of
 *                   config.py MoeArch exactly as layers/moe.py route() applies it, plus the grouping: how many rows
 *                   each expert got and the (token, slot) rows sorted by expert, stable (group_by_expert)
 *   it_moe_experts  the routed experts over those rows: per expert that got n > 0 rows, its n rows of x gathered,
 *                   gate_up, SiLU-and-multiply, down, each row scaled by its weight and summed into its token's
 *                   output (experts nobody picked cost nothing), rounded to bf16 where experts_reference rounds
 *
 * Ties: route() takes torch.topk's picks. Among equal values this kernel puts the lower index first, which orders a
 * token's slots but never decides which experts it gets (the layer's output does not depend on the order), unless
 * the tie sits at the boundary: the k-th best expert equal to the next one, or the topk_group-th best group equal
 * to the next. There the set is torch.topk's: on CPU, for k * 64 > n, topk puts the (value, index) pairs through
 * libstdc++'s std::nth_element and takes the first k, and moe_topk_torch runs the same steps on the same
 * comparisons (it_moe.torch_ties, set where kernels/cpu.py has checked this against the torch in the process at
 * load). Where it cannot say (the rule's torch_ties off, topk's heap path at k * 64 <= n, introselect's depth
 * limit, a NaN score) the row hands back: it_moe_route returns 1 and the caller routes with route(), or
 * it_moe_route_rows flags the tied rows alone and the caller (the fused step's hand-back, layers/moe.py Router)
 * routes those, keeps this kernel's picks for the others and groups the whole. In bf16, where router logits tie
 * often, a boundary tie takes ~4% of a layer's tokens (the 64-expert benchmark model).
 *
 * A variant defines, before it includes this file:
 *   moe_linear(L, x, ldx, y, ldy, M, nthreads, scratch, silu)
 *                                           y = x W^T (+ bias) for one expert's it_lin (bf16, w8, w4; 12-bit where
 *                                           MOE_BF16C is defined; W8A8 / the packed W8A16 / W4A16 where the variant
 *                                           defines IT_HAS_W8A8 / IT_HAS_W8P / IT_HAS_W4P); silu (a 12-bit gate_up
 *                                           with inter > 0 only):
 *                                           y = act [M, inter], SiLU-and-multiply in the GEMM's epilogue; for an
 *                                           expert's down it is MOE_DOWN_EPI (default 0), a hint the variant may
 *                                           define (AVX-512: its rows written past the caches)
 *   moe_linear_scratch(M, N, K, nthreads)   the bytes of scratch moe_linear needs at up to M rows of [N, K]
 *   moe_silu_mul(gu, act, M, I, nthreads)   act = bf16(bf16(silu(gate)) * up), as it_silu_mul
 * and may define MOE_SCORES(softmax, logit, scores, E), the router's scores of one row in vectors (softmax: exp(l -
 * max) / sum, else sigmoid), returning 0 where it leaves the row to the scalar loop (a NaN or infinite logit), and
 * MOE_ADD_ROW(acc, y, w, n) / MOE_STORE_ROW(o, acc, n), the combine's acc[j] += bf16(y[j] w) and
 * o[j] = bf16(acc[j]) over n <= 64 features, vectorized (default: moe_add_row / moe_store_row below, scalar),
 * and MOE_BF16C where its moe_linear takes 12-bit experts: their it_lin's w points at E bf16c descriptions (expert
 * e's weight is the e-th), each a bf16 weight in the lossless 12-bit layout, bit for bit the bf16 expert's products.
 */
#ifndef IT_MOE_H
#define IT_MOE_H
#include <omp.h>
#include "bf16.h"
#include "abi.h"

#define MOE_ALIGN64(n) (((n) + 63) & ~(int64_t)63)
#ifndef MOE_DOWN_EPI
#define MOE_DOWN_EPI 0 /* moe_linear's silu argument for an expert's down (a variant's hint; 0: a plain product) */
#endif
#ifndef MOE_ACT_IN_GATE_UP /* whether moe_linear(gate_up, .., silu = 1) writes act [n, I] itself for n rows (a 12-bit
                              gate_up with gate and up interleaved: the GEMM's epilogue), else gu, then moe_silu_mul */
#define MOE_ACT_IN_GATE_UP(g, n) ((g)->kind == IT_KIND_BF16C && (g)->inter)
#endif
/* The most experts a layer may have here (DeepSeek-V3 has 256, Qwen3-235B 128): the routing's scratch lives on the
 * stack, ~26 KB a thread at this size */
#define IT_MOE_MAX_EXPERTS 1024
/* it_moe_experts runs the experts side by side (one per thread at a time) where at least as many as the threads hold
   rows, and they hold this many rows each on average; else one after the other with each one's output features split
   over the threads. On the MoE preset's experts with 2 threads, streamed from memory (benchmarks/bench_moe_kernels.py
   builds the library with 1000000 here to compare): at one row an expert (top-8 at batch 1) the two tie, 1.48 and
   1.49 ms; at 16 tokens side by side takes 8.97 ms against 10.13, at 128 tokens 13.2 against 16.3. */
#ifndef IT_MOE_SIDE_BY_SIDE_ROWS
#define IT_MOE_SIDE_BY_SIDE_ROWS 0
#endif

/* The index of the best of v[0 .. n) not yet taken: the highest value, the lowest index among equal ones (a value
   no comparison prefers, NaN, stands only where it is the first one left). */
static inline int64_t moe_best(const float* v, const uint8_t* taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* torch.topk's k largest of v [n] where ties decide them (route() on CPU, k * 64 > n: topk_impl_loop's
 * std::nth_element(q, q + k - 1, q + n) on the pairs (v[i], i), "NaN first, then greater", the first k taken):
 * libstdc++'s introselect step for step (depth limit 2 floor(log2 n), the median of the second, middle and last
 * pairs moved to the front as pivot, an unguarded partition, an insertion sort of the last <= 3), so the same
 * comparisons leave the same pairs in front. taken[i] = 1 for the k picked. Returns 0, or 1 where it cannot say
 * (k * 64 <= n: topk's heap path; the depth limit reached: introselect's heap fallback). q: n pairs of scratch. */
typedef struct {
    float v;
    int32_t i;
} moe_pair;
static inline int moe_pair_before(moe_pair a, moe_pair b) { return (a.v != a.v && b.v == b.v) || a.v > b.v; }
static inline void moe_pair_swap(moe_pair* q, int64_t a, int64_t b) {
    const moe_pair t = q[a];
    q[a] = q[b];
    q[b] = t;
}
static int moe_topk_torch(const float* v, int64_t n, int64_t k, moe_pair* q, uint8_t* taken) {
    if (k < 1 || k > n || k * 64 <= n) return 1;
    for (int64_t i = 0; i < n; i++) q[i] = (moe_pair){v[i], (int32_t)i};
    int64_t f = 0, l = n, depth = 0;
    const int64_t nth = k - 1;
    for (int64_t m = n; m > 1; m >>= 1) depth += 2;
    while (l - f > 3) {
        if (depth-- == 0) return 1;
        const int64_t a = f + 1, b = f + (l - f) / 2, c = l - 1; /* the median of a, b, c to the front */
        int64_t med;
        if (moe_pair_before(q[a], q[b]))
            med = moe_pair_before(q[b], q[c]) ? b : moe_pair_before(q[a], q[c]) ? c : a;
        else
            med = moe_pair_before(q[a], q[c]) ? a : moe_pair_before(q[b], q[c]) ? c : b;
        moe_pair_swap(q, f, med);
        int64_t lo = f + 1, hi = l; /* partition [f + 1, l) around q[f], unguarded (the median bounds both scans) */
        for (;;) {
            while (moe_pair_before(q[lo], q[f])) lo++;
            hi--;
            while (moe_pair_before(q[f], q[hi])) hi--;
            if (lo >= hi) break;
            moe_pair_swap(q, lo, hi);
            lo++;
        }
        if (lo <= nth) f = lo;
        else l = lo;
    }
    for (int64_t i = f + 1; i < l; i++) { /* insertion sort of [f, l) */
        const moe_pair x = q[i];
        if (moe_pair_before(x, q[f])) {
            memmove(q + f + 1, q + f, (size_t)(i - f) * sizeof(moe_pair));
            q[f] = x;
        } else {
            int64_t j = i;
            for (; moe_pair_before(x, q[j - 1]); j--) q[j] = q[j - 1];
            q[j] = x;
        }
    }
    memset(taken, 0, (size_t)n);
    for (int64_t i = 0; i < k; i++) taken[q[i].i] = 1;
    return 0;
}

/* The k best of v [n], no NaN among them, in ids (highest first, the lower index first among equal ones: moe_best's
 * picks k times over) and the (k + 1)-th best value (where k < n; else 0), in one pass: each value that beats the
 * (k + 1)-th best so far goes in after those at least as large. q: k + 1 pairs of scratch. */
static inline float moe_top(const float* v, int64_t n, int64_t k, moe_pair* q, int64_t* ids) {
    const int64_t cap = k < n ? k + 1 : k;
    int64_t cnt = 0;
    for (int64_t i = 0; i < n; i++) {
        const float x = v[i];
        if (cnt == cap && !(x > q[cap - 1].v)) continue;
        int64_t p = cnt < cap ? cnt++ : cap - 1;
        for (; p > 0 && q[p - 1].v < x; p--) q[p] = q[p - 1];
        q[p] = (moe_pair){x, (int32_t)i};
    }
    for (int64_t j = 0; j < k; j++) ids[j] = q[j].i;
    return k < n ? q[k].v : 0.0f;
}

/* One token: scores [E] and choice [E] (scratch), taken [E] and group scratch [n_group] (+ taken [n_group]), q [E]
 * pairs (moe_topk_torch's). Returns 1 where a tie (or a NaN) decides which experts the token gets and torch.topk's
 * pick is not known here (see Ties above), else 0. */
static int moe_route_row(const it_moe* m, const float* logit, const float* bias, float* scores, float* choice,
                          uint8_t* taken, float* gscore, uint8_t* gtaken, moe_pair* q, float* w, int64_t* ids) {
    const int64_t E = m->num_experts, k = m->top_k;
#ifdef MOE_SCORES
    if (MOE_SCORES(m->scoring == IT_MOE_SOFTMAX, logit, scores, E)) { /* (the variant's vectors: finite logits) */
    } else
#endif
    if (m->scoring == IT_MOE_SOFTMAX) { /* as torch: exp(l - max), times 1 / sum */
        float mx = logit[0];
        for (int64_t e = 1; e < E; e++) mx = logit[e] > mx ? logit[e] : mx;
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            scores[e] = expf(logit[e] - mx);
            sum += scores[e];
        }
        const float inv = 1.0f / sum;
        for (int64_t e = 0; e < E; e++) scores[e] *= inv;
    } else {
        for (int64_t e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-logit[e]));
    }
    int tied = 0;
    for (int64_t e = 0; e < E; e++) {
        choice[e] = bias ? scores[e] + bias[e] : scores[e];
        tied |= choice[e] != choice[e];
    }
    if (m->topk_method != IT_MOE_GREEDY && m->n_group > 1) {
        const int64_t G = m->n_group, per = E / G;
        for (int64_t g = 0; g < G; g++) {
            const float* c = choice + g * per;
            if (m->topk_method == IT_MOE_NOAUX_TC) { /* a group is worth the sum of its two best choices */
                memset(taken, 0, (size_t)per);
                int64_t a = 0; /* (moe_best with nothing taken: the first of the highest) */
                for (int64_t i = 1; i < per; i++)
                    if (c[i] > c[a]) a = i;
                taken[a] = 1;
                gscore[g] = per > 1 ? c[a] + c[moe_best(c, taken, per)] : c[a];
            } else { /* group_limited_greedy: its best one */
                float mx = c[0];
                for (int64_t i = 1; i < per; i++) mx = c[i] > mx ? c[i] : mx;
                gscore[g] = mx;
            }
        }
        memset(gtaken, 0, (size_t)G);
        int64_t last = 0;
        for (int64_t j = 0; j < m->topk_group; j++) gtaken[last = moe_best(gscore, gtaken, G)] = 1;
        if (m->topk_group < G && gscore[moe_best(gscore, gtaken, G)] == gscore[last]) /* torch.topk's groups */
            tied |= !m->torch_ties || moe_topk_torch(gscore, G, m->topk_group, q, gtaken);
        const float fill = m->topk_method == IT_MOE_NOAUX_TC ? -INFINITY : 0.0f; /* as route() masks them */
        for (int64_t g = 0; g < G; g++)
            if (!gtaken[g])
                for (int64_t i = 0; i < per; i++) choice[g * per + i] = fill;
    }
    float next; /* the (k + 1)-th best choice (k < E) */
    if (!tied) {
        next = moe_top(choice, E, k, q, ids);
    } else { /* (a NaN: moe_best's passes, as route() will decide the row anyway) */
        memset(taken, 0, (size_t)E);
        for (int64_t j = 0; j < k; j++) taken[ids[j] = moe_best(choice, taken, E)] = 1;
        next = k < E ? choice[moe_best(choice, taken, E)] : 0.0f;
    }
    if (k < E && next == choice[ids[k - 1]]) { /* a tie at the boundary */
        if (!m->torch_ties || moe_topk_torch(choice, E, k, q, taken)) {
            tied = 1;
        } else { /* torch.topk's set: its slots best first, the lower index among equal ones */
            for (int64_t e = 0; e < E; e++) taken[e] ^= 1;
            for (int64_t j = 0; j < k; j++) taken[ids[j] = moe_best(choice, taken, E)] = 1;
        }
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        w[j] = scores[ids[j]]; /* the unbiased score */
        sum += w[j];
    }
    if (m->norm_topk_prob) {
        const float den = sum + (m->scoring == IT_MOE_SIGMOID ? 1e-20f : 0.0f);
        for (int64_t j = 0; j < k; j++) w[j] /= den;
    }
    if (m->routed_scaling_factor != 1.0f)
        for (int64_t j = 0; j < k; j++) w[j] *= m->routed_scaling_factor;
    return tied;
}

int64_t it_moe_max_experts(void) { return IT_MOE_MAX_EXPERTS; }

/* moe_topk_torch row by row over v [rows, n] fp32 (kernels/cpu.py checks it against the process's torch.topk at
 * load; the tests): taken [rows, n] the k picked in each row, all 0 in a row it cannot say for. Returns how many
 * such rows. */
int64_t it_moe_topk_torch(const float* v, int64_t rows, int64_t n, int64_t k, uint8_t* taken) {
    if (n < 1 || n > IT_MOE_MAX_EXPERTS) return rows;
    moe_pair q[IT_MOE_MAX_EXPERTS];
    int64_t unsaid = 0;
    for (int64_t r = 0; r < rows; r++)
        if (moe_topk_torch(v + r * n, n, k, q, taken + r * n)) {
            memset(taken + r * n, 0, (size_t)n);
            unsaid++;
        }
    return unsaid;
}

/* Every row's routing: logits [T, E], fp32 (logits_bf16 = 0) or bf16, rows ld apart; bias [E] fp32 or NULL (selection
 * only) -> weights [T, k] fp32, ids [T, k]; where tie is given, tie[t] = 1 where a tie at the boundary (or a NaN)
 * decides row t's experts (its weights and ids are then this kernel's pick, which route() may not make), else 0.
 * Returns 1 where some row ties, 0 where none does; -2 where the rule does not fit (E not a multiple of n_group, k or
 * topk_group out of range). */
static int moe_route_rows(const void* logits, int logits_bf16, int64_t ld, int64_t T, const it_moe* m,
                          const float* bias, float* weights, int64_t* ids, uint8_t* tie, int nthreads) {
    const int64_t E = m->num_experts, k = m->top_k, G = m->n_group > 1 ? m->n_group : 1;
    if (E < 1 || E > IT_MOE_MAX_EXPERTS || k < 1 || k > E || E % G || m->topk_group < 1 || m->topk_group > G)
        return -2;
    /* ~1 us a token: a second thread pays off from a prefill's few dozen tokens */
    const int nt = T * E >= 4096 && nthreads > 1 ? nthreads : 1;
    int tied = 0;
#pragma omp parallel num_threads(nt) reduction(| : tied)
    {
        float buf[4 * IT_MOE_MAX_EXPERTS]; /* (on the stack, ~26 KB with the two below: E and G <= IT_MOE_MAX_EXPERTS) */
        uint8_t tbuf[2 * IT_MOE_MAX_EXPERTS];
        moe_pair q[IT_MOE_MAX_EXPERTS];
        float *scores = buf, *choice = buf + E, *lrow = buf + 2 * E, *gscore = buf + 3 * E;
        uint8_t *taken = tbuf, *gtaken = tbuf + E;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const float* l = (const float*)logits + t * ld;
            if (logits_bf16) {
                for (int64_t e = 0; e < E; e++) lrow[e] = bf2f(((const bf16*)logits)[t * ld + e]);
                l = lrow;
            }
            const int r = moe_route_row(m, l, bias, scores, choice, taken, gscore, gtaken, q, weights + t * k, ids + t * k);
            if (tie) tie[t] = (uint8_t)r;
            tied |= r;
        }
    }
    return tied;
}

/* The flat (token, slot) pairs t * k + j of ids [T, k] grouped by expert: counts [E], order [T k] (a counting sort:
 * stable, so each expert's rows stay in (token, slot) order, as group_by_expert's stable argsort) */
static void moe_group(const int64_t* ids, int64_t T, int64_t k, int64_t E, int64_t* counts, int64_t* order) {
    memset(counts, 0, (size_t)E * 8);
    for (int64_t f = 0; f < T * k; f++) counts[ids[f]]++;
    int64_t next[IT_MOE_MAX_EXPERTS];
    for (int64_t e = 0, s = 0; e < E; e++) {
        next[e] = s;
        s += counts[e];
    }
    for (int64_t f = 0; f < T * k; f++) order[next[ids[f]]++] = f;
}

/* moe_route_rows, then moe_group: weights [T, k], ids [T, k], counts [E], order [T k]. Returns 0; 1 where a tie at
 * the boundary decides some token's experts (nothing is grouped: the caller routes with route(), or routes the tied
 * rows alone with it_moe_route_rows); -2 where the rule does not fit. */
int it_moe_route(const void* logits, int logits_bf16, int64_t ld, int64_t T, const it_moe* m, const float* bias,
                 float* weights, int64_t* ids, int64_t* counts, int64_t* order, int nthreads) {
    const int rc = moe_route_rows(logits, logits_bf16, ld, T, m, bias, weights, ids, NULL, nthreads);
    if (rc) return rc;
    moe_group(ids, T, m->top_k, m->num_experts, counts, order);
    return 0;
}

/* Every row's routing and its tie flag (moe_route_rows), for a caller that routes only the tied rows itself and groups
 * the whole (layers/moe.py Router, as the fused step does after a hand-back). Returns how many rows tie, or -2. */
int64_t it_moe_route_rows(const void* logits, int logits_bf16, int64_t ld, int64_t T, const it_moe* m,
                          const float* bias, float* weights, int64_t* ids, uint8_t* tie, int nthreads) {
    const int rc = moe_route_rows(logits, logits_bf16, ld, T, m, bias, weights, ids, tie, nthreads);
    if (rc < 0) return rc;
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) n += tie[t];
    return n;
}

/* 1 where a linear's kind is one this library's run_lin takes (W8A8: IT_HAS_W8A8; packed W8A16 / W4A16: IT_HAS_W8P /
 * IT_HAS_W4P): the experts' check below, and the fused step's for every layer's linears (fused_step.h) */
static int lin_kind_ok(const it_lin* L) {
    const int kind = L->kind;
#ifndef IT_HAS_W8A8
    if (kind == IT_KIND_W8A8) return 0;
#endif
#ifndef IT_HAS_W8P
    if (kind == IT_KIND_W8P) return 0;
#endif
#ifndef IT_HAS_W4P
    if (kind == IT_KIND_W4P) return 0;
#endif
    if (kind == IT_KIND_W8A8 || kind == IT_KIND_W8P) return L->K >= 1 && L->K <= I8_MAX_K; /* (int32 sums) */
    if (kind == IT_KIND_W4P) return L->group >= 64 && L->group % 64 == 0 && L->K % L->group == 0;
    return 1;
}

/* Expert e's slice of a stacked projection: L describes expert 0 ([E, N, K] weights, scales [E, N] or
 * [E, N, K / group], bias [E, N] or NULL) */
static it_lin moe_expert_lin(const it_lin* L, int64_t e) {
    it_lin r = *L;
    const int64_t N = L->N, K = L->K;
    if (L->kind == IT_KIND_BF16) {
        r.w = (const bf16*)L->w + e * N * K;
    } else if (L->kind == IT_KIND_W8) {
        r.w = (const int8_t*)L->w + e * N * K;
        r.scale = (const char*)L->scale + e * N * (L->scale_is_f32 ? 4 : 2);
#ifdef IT_HAS_W8A8
    } else if (L->kind == IT_KIND_W8A8) { /* (each expert's pack_w8a8 words, fp32 scales) */
        r.w = (const uint32_t*)L->w + e * i8_packed_words(N, K);
        r.scale = (const float*)L->scale + e * N;
#endif
#ifdef MOE_BF16C
    } else if (L->kind == IT_KIND_BF16C) {
        r.w = (const bf16c*)L->w + e;
#endif
#ifdef IT_HAS_W8P
    } else if (L->kind == IT_KIND_W8P) { /* (each expert's pack_w8a8 words of its int8 weight, fp32 scales) */
        r.w = (const uint32_t*)L->w + e * i8_packed_words(N, K);
        r.scale = (const float*)L->scale + e * N;
#endif
#ifdef IT_HAS_W4P
    } else if (L->kind == IT_KIND_W4P) { /* (each expert's pack_w4p words, its blocked fp32 scale and zero) */
        const int64_t nb = (N + 63) / 64;
        r.w = (const uint32_t*)L->w + e * nb * (K / 8) * 64;
        r.scale = (const float*)L->scale + e * nb * (K / L->group) * 64;
        r.zero = L->zero + e * nb * (K / L->group) * 64;
#endif
    } else { /* IT_KIND_W4 */
        r.w = (const uint8_t*)L->w + e * N * (K / 2);
        r.scale = (const float*)L->scale + e * N * (K / L->group);
        r.zero = L->zero + e * N * (K / L->group);
    }
    if (L->bias) r.bias = L->bias + e * N;
    return r;
}

#ifndef MOE_ADD_ROW
/* acc[j] += bf16(y[j] * w), j < n (a variant may define its own, vectorized: moe.c) */
static inline void moe_add_row(float* acc, const bf16* y, float w, int64_t n) {
    for (int64_t j = 0; j < n; j++) acc[j] += bf2f(f2bf(bf2f(y[j]) * w));
}
static inline void moe_store_row(bf16* o, const float* acc, int64_t n) {
    for (int64_t j = 0; j < n; j++) o[j] = f2bf(acc[j]);
}
#define MOE_ADD_ROW moe_add_row
#define MOE_STORE_ROW moe_store_row
#endif
#ifndef MOE_ADD_STORE_ROW
/* o[j] = bf16(o[j] + bf16(acc[j])): the combine's output added into a residual as add_rows adds it */
static inline void moe_add_store_row(bf16* o, const float* acc, int64_t n) {
    for (int64_t j = 0; j < n; j++) o[j] = f2bf(bf2f(o[j]) + bf2f(f2bf(acc[j])));
}
#define MOE_ADD_STORE_ROW moe_add_store_row
#endif

/* out[t] = bf16 of the fp32 sum over its slots, in the order of their rows (ascending expert), of
 * bf16(y[row] * bf16(w)): experts_reference's index_add_ into zeros (torch sums bf16 sources in fp32); add: that
 * bf16 added into out instead (out a residual: bf16(out + it), as add_rows adds a layer's output) */
static void moe_combine(const bf16* ys, const float* weights, const int64_t* order, const int64_t* pos, int64_t T,
                        int64_t k, int64_t H, bf16* out, int nthreads, int64_t lo, int64_t hi, int add) {
    const int nt = T > 1 && T * k * H >= (1 << 16) && nthreads > 1 ? (int)(T < nthreads ? T : nthreads) : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t rows[64], n = 0; /* the token's rows in [lo, hi) (its slots here), ascending (k <= 64: the caller) */
        for (int64_t j = 0; j < k; j++) {
            int64_t r = pos[t * k + j], i = n;
            if (r < lo || r >= hi) continue;
            n++;
            for (; i > 0 && rows[i - 1] > r; i--) rows[i] = rows[i - 1];
            rows[i] = r;
        }
        float w[64];
        for (int64_t i = 0; i < n; i++) w[i] = bf2f(f2bf(weights[order[rows[i]]]));
        bf16* o = out + t * H;
        /* 64 features at a time, each slot's products added in turn: the same sums in the same order as slot by slot
           per feature, in loops over features a variant vectorizes (MOE_ADD_ROW) */
        for (int64_t h0 = 0; h0 < H; h0 += 64) {
            const int64_t nh = H - h0 < 64 ? H - h0 : 64;
            float acc[64] = {0.0f};
            for (int64_t i = 0; i < n; i++) MOE_ADD_ROW(acc, ys + rows[i] * H + h0, w[i], nh);
            if (add) MOE_ADD_STORE_ROW(o + h0, acc, nh);
            else MOE_STORE_ROW(o + h0, acc, nh);
        }
    }
}

/* What an expert's rows read and write in it_moe_experts: x and the projections (their expert 0 is expert `off`:
 * expert parallel), the grouping, the buffers of the grouped rows (gathered x [R, H], gate_up [R, 2I], act [R, I],
 * down [R, H]) */
typedef struct {
    const bf16* x;
    int64_t ldx, k, H, I, off;
    const it_lin *gate_up, *down;
    const int64_t *order, *start, *counts;
    bf16 *xs, *gu, *act, *ys;
    char* qbuf; /* MOE_ONE_ROW's scratch (its MOE_ONE_ROW_BYTES) */
} moe_rows;

#ifdef MOE_ONE_ROW
/* A variant's path for steps where every expert picked holds one row (a decode step of one token, or of tokens that
   picked different experts): returns 1 where it computed ys (the rows' down outputs, as moe_expert computes them), 0
   where the experts' kinds are not its own (then the per-expert path runs) */
static int MOE_ONE_ROW(const moe_rows* m, const int64_t* active, int64_t na, int64_t T, int nthreads);
/* MOE_ONE_ROW_BYTES(T, k, H, I, E): the most scratch (m->qbuf) it needs for T tokens over any kinds it takes */
static int64_t MOE_ONE_ROW_BYTES(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E);
#endif

/* Expert e's rows: gathered, gate_up, SiLU-and-multiply, down (nthreads: the linears' threads) */
static void moe_expert(const moe_rows* m, int64_t e, int nthreads, void* scratch) {
    const int64_t r0 = m->start[e], n = m->counts[e], H = m->H, I = m->I;
    for (int64_t i = 0; i < n; i++)
        memcpy(m->xs + (r0 + i) * H, m->x + (m->order[r0 + i] / m->k) * m->ldx, (size_t)H * 2);
    const it_lin g = moe_expert_lin(m->gate_up, e - m->off), d = moe_expert_lin(m->down, e - m->off);
    if (MOE_ACT_IN_GATE_UP(&g, n)) { /* act straight from the GEMM's epilogue */
        moe_linear(&g, m->xs + r0 * H, H, m->act + r0 * I, I, n, nthreads, scratch, 1);
    } else {
        moe_linear(&g, m->xs + r0 * H, H, m->gu + r0 * 2 * I, 2 * I, n, nthreads, scratch, 0);
        moe_silu_mul(m->gu + r0 * 2 * I, m->act + r0 * I, n, I, nthreads);
    }
    moe_linear(&d, m->act + r0 * I, I, m->ys + r0 * H, H, n, nthreads, scratch, MOE_DOWN_EPI);
}

/* An expert's linears' scratch at up to M rows on nthreads threads (gate_up takes H inputs, down I) */
static inline int64_t moe_expert_scratch(int64_t M, int64_t H, int64_t I, int nthreads) {
    const int64_t s_h = moe_linear_scratch(M, 2 * I, H, nthreads), s_i = moe_linear_scratch(M, H, I, nthreads);
    return MOE_ALIGN64(s_h > s_i ? s_h : s_i);
}

/* The workspace moe_experts_ws takes for T tokens (top-k k, E experts, hidden H, expert width I, nthreads threads),
 * whatever the experts' kinds and however the rows fall on them: the grouping's index, the grouped rows (x, gate_up,
 * act, down), each thread's linear scratch at up to T k rows, the one-row path's scratch */
static int64_t moe_experts_ws_need(int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, int nthreads) {
    const int nt = nthreads < 1 ? 1 : nthreads;
    const int64_t R = T * k;
    /* the linears' scratch: one a thread with the experts side by side (each on one thread), or one on all of them */
    const int64_t side = nt * moe_expert_scratch(R, H, I, 1), split = moe_expert_scratch(R, H, I, nt);
    const int64_t scratch = side > split ? side : split;
    int64_t need = MOE_ALIGN64((2 * E + R) * 8) + MOE_ALIGN64(R * H * 2) + MOE_ALIGN64(R * 2 * I * 2) +
                   MOE_ALIGN64(R * I * 2) + MOE_ALIGN64(R * H * 2) + scratch;
#ifdef MOE_ONE_ROW
    need += MOE_ALIGN64(MOE_ONE_ROW_BYTES(T, k, H, I, E));
#endif
    return need + 64; /* (room to align the start) */
}

/* The bytes of workspace the fused step's MoE layers need for T tokens beyond it_decode_workspace_bytes: the caller
 * adds the largest over its MoE layers (I: a layer's expert width, gate_up's N / 2) */
int64_t it_moe_experts_ws_bytes(int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, int nthreads) {
    if (T < 1 || k < 1 || E < 1 || H < 1 || I < 1) return 0;
    return moe_experts_ws_need(T, k, E, H, I, nthreads);
}

/* x [T, H] bf16 (rows ldx apart); gate_up and down: expert 0's it_lin of the stacked [E, 2I, H] and [E, H, I]
 * projections (gate rows, then up rows); weights [T, k], order [T k], counts [E] from it_moe_route -> out [T, H]
 * bf16. The experts side by side on the threads (each streams its own weights; one parallel region a call, a dynamic
 * schedule, the busiest first) or one after the other with their features split: IT_MOE_SIDE_BY_SIDE_ROWS.
 * ws: ws_bytes of scratch (moe_experts_ws_need for T; it allocates nothing). Returns 0, -1 where ws is too small,
 * or -2 where the shapes, or the grouping (counts summing to T k, order a permutation of 0 .. T k - 1), do not fit.
 * Over experts off .. off + local - 1 only (expert parallel: this rank's; gate_up and down describe expert off),
 * their slots' sum into out, zero for a token with none of them: the rows of the other experts are another rank's.
 * add: out += the result instead (bf16(out + result), add_rows's rounding: the fused step's residual, one rank). */
static int moe_experts_ws(const bf16* x, int64_t ldx, int64_t T, const it_lin* gate_up, const it_lin* down, int64_t E,
                          int64_t off, int64_t local, int64_t k, const float* weights, const int64_t* order,
                          const int64_t* counts, bf16* out, int nthreads, char* ws, int64_t ws_bytes, int add) {
    const int64_t H = gate_up->K, I = down->K, R = T * k;
    if (gate_up->N != 2 * I || down->N != H || k < 1 || k > 64 || T < 1) return -2;
    if (off < 0 || local < 1 || off + local > E) return -2;
    for (int i = 0; i < 2; i++) {
        const it_lin* L = i ? down : gate_up;
        int known = L->kind == IT_KIND_BF16 || L->kind == IT_KIND_W8 || L->kind == IT_KIND_W4;
        known |= L->kind == IT_KIND_W8A8 && lin_kind_ok(L) && !L->zero; /* (W8A8 experts: activations per token) */
        known |= (L->kind == IT_KIND_W8P || L->kind == IT_KIND_W4P) && lin_kind_ok(L);
#ifdef MOE_BF16C
        known |= L->kind == IT_KIND_BF16C && L->N % 16 == 0 && L->K % 32 == 0 && (!L->inter || 2 * L->inter == L->N);
#endif
        if (!known) return -2;
        if (L->kind == IT_KIND_W4 && (L->group < 1 || L->K % L->group || L->K % 2)) return -2;
    }
    if (nthreads < 1) nthreads = 1;
    if (!ws || ws_bytes < moe_experts_ws_need(T, k, E, H, I, nthreads)) return -1;
    char* p = (char*)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    int64_t* idx = (int64_t*)p;
    p += MOE_ALIGN64((2 * E + R) * 8);
    int64_t *start = idx, *active = idx + E, *pos = idx + 2 * E;
    int64_t na = 0, maxn = 0, rows = 0;
    for (int64_t e = 0; e < E; e++) {
        start[e] = rows;
        rows += counts[e] > 0 ? counts[e] : 0;
        if (e < off || e >= off + local) continue;
        if (counts[e] > 0) active[na++] = e;
        maxn = counts[e] > maxn ? counts[e] : maxn;
    }
    const int64_t lo = start[off], hi = off + local < E ? start[off + local] : rows; /* this part's rows */
    int bad = rows != R;
    for (int64_t r = 0; r < R; r++) pos[r] = -1;
    for (int64_t r = 0; r < R && !bad; r++) {
        bad = order[r] < 0 || order[r] >= R || pos[order[r]] >= 0;
        if (!bad) pos[order[r]] = r;
    }
    if (bad) return -2; /* not a grouping of these T k rows */
    /* the busiest experts first, so that the last ones to start are short */
    for (int64_t i = 1; i < na; i++) {
        const int64_t e = active[i];
        int64_t j = i;
        for (; j > 0 && counts[active[j - 1]] < counts[e]; j--) active[j] = active[j - 1];
        active[j] = e;
    }
    const int outer = na >= nthreads && R >= (int64_t)IT_MOE_SIDE_BY_SIDE_ROWS * na ? nthreads : 1;
    const int inner = outer > 1 ? 1 : nthreads;
    const int64_t scratch = moe_expert_scratch(maxn, H, I, inner);
    bf16* xs = (bf16*)p;
    bf16* gu = (bf16*)(p += MOE_ALIGN64(R * H * 2));
    bf16* act = (bf16*)(p += MOE_ALIGN64(R * 2 * I * 2));
    bf16* ys = (bf16*)(p += MOE_ALIGN64(R * I * 2));
    char* lin = p += MOE_ALIGN64(R * H * 2);
    char* qbuf = p + outer * scratch; /* (within the bound: scratch here <= the need's, outer <= nthreads) */
    const moe_rows rows_of = {x, ldx, k, H, I, off, gate_up, down, order, start, counts, xs, gu, act, ys, qbuf};
#ifdef MOE_ONE_ROW
    const int one_row = maxn == 1 && MOE_ONE_ROW(&rows_of, active, na, T, nthreads); /* (it computed ys) */
#else
    const int one_row = 0;
#endif
    if (!one_row && outer > 1) { /* (a region of its own only here: nested in one, the linears' would not reuse threads) */
#pragma omp parallel for num_threads(outer) schedule(dynamic, 1)
        for (int64_t a = 0; a < na; a++)
            moe_expert(&rows_of, active[a], 1, lin + (int64_t)omp_get_thread_num() * scratch);
    } else if (!one_row) {
        for (int64_t a = 0; a < na; a++) moe_expert(&rows_of, active[a], nthreads, lin);
    }
    moe_combine(ys, weights, order, pos, T, k, H, out, nthreads, lo, hi, add);
    return 0;
}

/* it_moe_experts_part (below) on the caller's workspace ws of ws_bytes (it_moe_experts_ws_bytes(T, ...) or more): a
 * caller that keeps it from call to call spares the fresh pages of a prefill's grouped rows (tens of MB a layer).
 * Returns 0, -1 where ws is too small, or -2 (see above). */
int it_moe_experts_ws(const bf16* x, int64_t ldx, int64_t T, const it_lin* gate_up, const it_lin* down, int64_t E,
                      int64_t off, int64_t local, int64_t k, const float* weights, const int64_t* order,
                      const int64_t* counts, bf16* out, int nthreads, void* ws, int64_t ws_bytes) {
    if (T < 1 || k < 1 || E < 1 || gate_up->K < 1 || down->K < 1) return -2;
    return moe_experts_ws(x, ldx, T, gate_up, down, E, off, local, k, weights, order, counts, out, nthreads,
                          (char*)ws, ws_bytes, 0);
}

/* it_moe_experts over experts off .. off + local - 1 only (expert parallel), for callers without a workspace: it
 * allocates one for the call (the fused step passes its own: moe_experts_ws). Returns 0, or -2 (see above). */
int it_moe_experts_part(const bf16* x, int64_t ldx, int64_t T, const it_lin* gate_up, const it_lin* down, int64_t E,
                        int64_t off, int64_t local, int64_t k, const float* weights, const int64_t* order,
                        const int64_t* counts, bf16* out, int nthreads) {
    if (T < 1 || k < 1 || E < 1 || gate_up->K < 1 || down->K < 1) return -2;
    const int64_t bytes = moe_experts_ws_need(T, k, E, gate_up->K, down->K, nthreads);
    char* ws = (char*)malloc((size_t)bytes);
    if (!ws) return -2;
    const int rc = it_moe_experts_ws(x, ldx, T, gate_up, down, E, off, local, k, weights, order, counts, out,
                                     nthreads, ws, bytes);
    free(ws);
    return rc;
}

int it_moe_experts(const bf16* x, int64_t ldx, int64_t T, const it_lin* gate_up, const it_lin* down, int64_t E,
                   int64_t k, const float* weights, const int64_t* order, const int64_t* counts, bf16* out,
                   int nthreads) {
    return it_moe_experts_part(x, ldx, T, gate_up, down, E, 0, E, k, weights, order, counts, out, nthreads);
}
#endif
