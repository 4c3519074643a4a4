/* ------------------------------------------------------------------ a whole decode step of a Llama decoder
 *
 * it_decode_layers runs every decoder layer of a decode-only step (T <= 16 sequences, one new token each) in one
 * call: per layer RMSNorm, the qkv projection, rotary, the K/V write into the paged cache, attention over each
 * sequence's blocks, o_proj and the residual, RMSNorm, gate/up, SiLU-and-multiply, down and the residual. It
 * rounds to bf16 where the PyTorch path (models/llama.py) does, so the two agree to bf16 rounding; what it
 * saves is the ~15 ms of per-op dispatch a 24-layer step otherwise spends outside the matmuls. All scratch
 * lives in one caller-owned workspace (it_decode_workspace_bytes): the step allocates nothing.
 */


#define ALIGN64(n) (((n) + 63) & ~(int64_t)63)

static int64_t lin_scratch_bytes(int64_t T, int64_t K, int nthreads) {
    /* (W8A16 / W4A16 on [N, K]: up to 16 rows a call here; past them, prompts, the slab GEMM needs none and the
       per-block rebuild its q_amx_scratch_bytes part) */
    /* (W8A8 rounds every row of x to int8 first, prompts included: i8_scratch_bytes) */
    const int64_t amx = bf16_scratch_bytes(T, K), w8 = qlin_scratch_bytes(T < 16 ? T : 16, K, nthreads);
    /* (W8A16 on the packed weight: every row of x split into int16's two bytes, prompts included) */
    /* (W4A16 on the packed weight: up to W4P_CHUNK rows at a time below the GEMM's rows; on AMX past 16 rows, as a
       12-bit weight, the tile GEMM's zero-padded last row tile) */
    /* (W8A16 / W4A16 in rows past 16 on AMX: x's transposed block and each thread's rebuilt chunk, quant_amx.c) */
    const int64_t sizes[7] = {amx, w8, i8_scratch_bytes(T, K), w8p_scratch_bytes(T, K), w4p_scratch_bytes(T, K),
                              bf16c_scratch_bytes(T, K), T > 16 && amx_state == 1 ? q_amx_gemm_scratch_bytes(T, K, nthreads) : 0};
    int64_t most = 0;
    for (int i = 0; i < 7; i++) most = sizes[i] > most ? sizes[i] : most;
    return ALIGN64(most);
}

typedef struct {
    float* sc;   /* [G, max_ctx] scores, fp32 */
    bf16* pb;    /* [G, ldp] exponentials, bf16, zero past len up to a multiple of 32 */
    bf16* pl;    /* [G, ldp] decode rows on AMX: what pb's rounding left of each exponential, bf16 (zero past len) */
    bf16* qt;    /* [D / 32][16 pairs][16 heads][2] */
    float* cbuf; /* [16, 16] */
    bf16* tmp;   /* [32, D] gathered or dequantized K/V rows */
    bf16* vb;    /* [2][16 pairs][16 dims][2] */
    bf16* zero;  /* [D] */
    bf16* vpack; /* steps of prompt rows only: [max_ctx / 32][D / 16][16 pairs][16 dims][2], a sequence's V as tiles */
    int64_t ldp;
} attn_ws;

static inline int64_t attn_ldp(int64_t max_ctx) { return (max_ctx + 31) & ~(int64_t)31; }

/* per attention thread, in floats: the parts of attn_ws, each 64-byte aligned */
/* Rows of scores per attention thread: a decode row's query heads (up to 16 at a time), or, in steps of more than
 * 16 rows (prompts), 16 rows of one query head (attn_rows_amx) */
static inline int64_t attn_score_rows(int64_t group, int64_t T) { return T > 16 || group > 16 ? 16 : group; }

static inline int64_t attn_floats(int64_t G, int64_t max_ctx, int64_t D, int rows) {
    return ALIGN64(G * max_ctx * 4) / 4 + 2 * (ALIGN64(G * attn_ldp(max_ctx) * 2) / 4) + ALIGN64(D * 32) / 4 + 256 +
           ALIGN64(32 * D * 2) / 4 + 512 + ALIGN64(D * 2) / 4 + (rows ? ALIGN64(attn_ldp(max_ctx) * D * 2) / 4 : 0);
}

static attn_ws attn_workspace(float* base, int64_t G, int64_t max_ctx, int64_t D) {
    attn_ws w;
    char* p = (char*)base;
    w.ldp = attn_ldp(max_ctx);
    w.sc = (float*)p;   p += ALIGN64(G * max_ctx * 4);
    w.pb = (bf16*)p;    p += ALIGN64(G * w.ldp * 2);
    w.pl = (bf16*)p;    p += ALIGN64(G * w.ldp * 2);
    w.qt = (bf16*)p;    p += ALIGN64(D * 32);
    w.cbuf = (float*)p; p += 1024;
    w.tmp = (bf16*)p;   p += ALIGN64(32 * D * 2);
    w.vb = (bf16*)p;    p += 2048;
    w.zero = (bf16*)p;  p += ALIGN64(D * 2);
    w.vpack = (bf16*)p; /* (there only where attn_floats counted it) */
    return w;
}


/* Offsets of the workspace's parts, in bytes. */
typedef struct { int64_t h, qkv, o, gu, act, y, lin, dec, attn, total; } ws_layout;

static ws_layout workspace(const it_model* m, int64_t T, int64_t max_ctx) {
    ws_layout l;
    const int64_t hq = m->n_heads * m->head_dim, qkv = (m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    const int64_t group = m->n_heads / m->n_kv_heads;
    int64_t off = 0;
    const int64_t T16 = (T + 15) / 16 * 16; /* (h and act may be packed for the tile GEMM: whole row tiles) */
    l.h = off;    off += ALIGN64(T16 * m->hidden * 2);
    l.qkv = off;  off += ALIGN64(T * qkv * 2);
    l.o = off;    off += ALIGN64(T * hq * 2);
    l.gu = off;   off += m->gate_up_fused ? 0 : ALIGN64(T * 2 * m->inter * 2);
    l.act = off;  off += ALIGN64(T16 * m->inter * 2);
    l.y = off;    off += ALIGN64(T * m->hidden * 2);
    /* a linear's scratch: the largest over the layers' input widths (the transposed block of the tile GEMM is not
       monotonic in K); past 16 rows then each thread's [64, K] rows of a 12-bit weight, decoded for the GEMM */
    int64_t lin = 0;
    /* (latent attention: q_b's input, q's low rank, and o_proj's, heads x v) */
    const int64_t widths[5] = {m->hidden, hq, m->inter, m->mla_q_rank, m->n_heads * m->mla_v};
    for (int i = 0; i < 5; i++) { /* (inter is 0 where every MLP is a mixture of experts) */
        if (widths[i] < 1) continue;
        const int64_t b = lin_scratch_bytes(T, widths[i], m->nthreads);
        lin = b > lin ? b : lin;
    }
    l.lin = off;  off += lin;
    /* (the largest over the four projections' shapes; bf16 ones need less) */
    /* (latent attention: q_a, q_b (or q_proj), kv_a, o_proj) */
    const int64_t qb = m->n_heads * (m->mla_nope + m->mla_rope), hv = m->n_heads * m->mla_v;
    const int64_t shapes[8][2] = {{qkv, m->hidden}, {m->hidden, hq}, {2 * m->inter, m->hidden}, {m->hidden, m->inter},
                                  {m->mla_q_rank, m->hidden}, {qb, m->mla_q_rank > 0 ? m->mla_q_rank : m->hidden},
                                  {m->mla_rank > 0 ? m->head_dim : 0, m->hidden}, {m->hidden, hv}};
    int64_t dec = 0;
    for (int i = 0; i < 8; i++) {
        if (shapes[i][0] < 1 || shapes[i][1] < 1) continue;
        const int64_t b = bf16c_dec_bytes(T, (shapes[i][0] + 15) / 16 * 16, shapes[i][1], m->nthreads);
        dec = b > dec ? b : dec;
    }
    l.dec = off;  off += ALIGN64(dec);
    /* attention, per thread: scores [group, max_ctx] and output accumulators [group, D], fp32 */
    l.attn = off; off += ALIGN64((int64_t)(m->nthreads > 0 ? m->nthreads : 1) *
                                 attn_floats(attn_score_rows(group, T), max_ctx, m->head_dim, T > 16) * 4);
    l.total = off;
    return l;
}


/* x[t] = bf16(x[t] + y[t]), as f2bf rounds (NaN kept quiet) */
static void add_rows(bf16* x, const bf16* y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = mask16(n - i);
        store_sum_bf16x16(x + i, load_bf16x16(x + i, m), load_bf16x16(y + i, m), m);
    }
}

/* dec: bf16c_dec_bytes(M, N, K, nthreads) where M > 16 (a 12-bit weight's, or on AMX a W4A16 one's, decoded chunks) */
static void run_lin(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                    void* scratch, bf16* dec, int silu) {
    /* (silu: a 12-bit gate_up's act, see linear_bf16c; a W4A16 gate_up's where w4p_act_takes, see linear_w4p, or in
       rows where w4_act_takes, see linear_w4, a packed W8A16 one's where w8p_act_takes; -1: a W4A16 one in rows, or a
       packed W8A16 one, adds into y, where w4_add_takes / w8p_add_takes) */
    if (L->kind == IT_KIND_BF16)
        linear_bf16(x, ldx, (const bf16*)L->w, L->bias, y, ldy, M, L->N, L->K, nthreads, scratch);
    else if (L->kind == IT_KIND_BF16C) /* past 16 rows (a fused prefill's) each thread decodes 64 features of W at a time into dec */
        linear_bf16c(x, ldx, (const bf16c*)L->w, L->bias, y, ldy, M, L->N, L->K, nthreads, (bf16*)scratch, dec,
                     L->inter, silu);
    else if (L->kind == IT_KIND_W8A8) /* (it_decode_layers checked K) */
        linear_w8a8(x, ldx, (const uint32_t*)L->w, (const float*)L->scale, L->zero, L->bias, y, ldy, M, L->N, L->K,
                    nthreads, scratch);
    else if (L->kind == IT_KIND_W8P) /* (it_decode_layers checked K; past 16 rows on AMX the tiles, as 12-bit) */
        linear_w8p(x, ldx, (const uint32_t*)L->w, (const float*)L->scale, L->bias, y, ldy, M, L->N, L->K, nthreads,
                   scratch, dec, silu == 1 || silu == -1 ? silu : 0); /* (BF16C_EPI_STREAM: a 12-bit hint) */
    else if (L->kind == IT_KIND_W4P) /* (it_decode_layers checked the group; past 16 rows on AMX the tiles, as 12-bit) */
        linear_w4p(x, ldx, (const uint32_t*)L->w, (const float*)L->scale, L->zero, L->group, L->bias, y, ldy, M, L->N,
                   L->K, nthreads, scratch, dec, silu == 1);
    else if (L->kind == IT_KIND_W4)
        linear_w4(x, ldx, (const uint8_t*)L->w, (const float*)L->scale, L->zero, L->group, L->bias, y, ldy, M, L->N,
                  L->K, nthreads, scratch, dec, silu);
    else
        linear_w8(x, ldx, (const int8_t*)L->w, L->scale, L->scale_is_f32, L->bias, y, ldy, M, L->N, L->K, nthreads,
                  scratch);
}

/* x_res += x W^T (+ bias), each product rounded to bf16 first: a 12-bit weight adds in its epilogue, and so does a
 * W4A16 one in rows or a packed W8A16 one on AMX past 16 rows (w4_add_takes / w8p_add_takes: the same tile GEMM),
 * any other writes y, then add_rows */
static void run_lin_add(const it_lin* L, const bf16* x, int64_t ldx, bf16* x_res, bf16* y, int64_t H, int64_t M,
                        int nthreads, void* scratch, bf16* dec) { /* x_res, y: [M, H] */
    if (L->kind == IT_KIND_BF16C && !L->inter) {
        linear_bf16c(x, ldx, (const bf16c*)L->w, L->bias, x_res, H, M, L->N, L->K, nthreads, (bf16*)scratch, dec, 0, 1);
    } else if ((L->kind == IT_KIND_W4 && w4_add_takes(M, L->N, L->K)) ||
               (L->kind == IT_KIND_W8P && w8p_add_takes(M, L->N, L->K))) {
        run_lin(L, x, ldx, x_res, H, M, nthreads, scratch, dec, -1);
    } else {
        run_lin(L, x, ldx, y, H, M, nthreads, scratch, dec, 0);
        add_rows(x_res, y, M * H);
    }
}

/* A fused prompt's activations packed for the tile GEMM (bf16c_gemm.c px_index) where a 12-bit linear takes rows
 * rows on AMX (fused_step.h: a dense layer's normed rows for qkv and gate_up, and act from gate_up to down) */
static int px_on = 1;
/* Sets (on >= 0) and returns whether the fused step packs them (A/B benchmarks and the test that holds both to the
 * same bits) */
int it_px_gemm(int on) {
    if (on >= 0) px_on = on != 0;
    return px_on;
}
static inline int px_takes(const it_lin* L, int64_t rows) {
    return px_on && amx_state == 1 && rows > 16 && L->kind == IT_KIND_BF16C && L->K % 32 == 0 && L->N % 16 == 0;
}
/* a W4A16 (rows) or W8A16 (packed) gate_up whose tile GEMM writes act itself (gemv_quant.c w4_act_takes,
 * gemm_w8p.c w8p_act_takes; SiLU only) */
#define GATE_UP_ACT_TAKES(m, L, R)                                                                              \
    ((m)->act == IT_ACT_SILU &&                                                                                 \
     (((L)->kind == IT_KIND_W4 && w4_act_takes((R), (L)->N, (L)->K, (L)->bias)) ||                              \
      ((L)->kind == IT_KIND_W8P && w8p_act_takes((R), (L)->N, (L)->K, (L)->bias))))
#define PX_TAKES px_takes
#define PX_NORM rmsnorm_rows_px
/* y = xp W^T (+ bias) from packed rows xp: epi 0 writes y [M, ldy], epi 1 with a gate_up (inter) writes act packed
 * (act's K = ypk), epi 1 without adds into y (the residual) */
static void run_lin_px(const it_lin* L, const bf16* xp, bf16* y, int64_t ldy, int64_t M, int nthreads, bf16* dec,
                       int epi, int64_t ypk) {
    linear_bf16c_px(xp, (const bf16c*)L->w, L->bias, y, ldy, M, L->N, L->K, nthreads, dec, L->inter, epi, ypk);
}
#define RUN_LIN_PX run_lin_px
#define PX_ZERO_TAIL px_zero_tail
