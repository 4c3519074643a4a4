/* What the C side shares with Python (infertune/kernels/cpu.py declares the same structs as ctypes classes):
 * the ABI version, the weight kinds (cpu.py WeightKind mirrors them), the structs of the 12-bit weights and of
 * the fused step, and a mixture-of-experts layer's routing rule. it_abi() and it_struct_sizes() (abi.c) let the loader check, before any call, that both sides
 * agree; change a struct here, bump IT_ABI_VERSION and update cpu.py together. */
#ifndef IT_ABI_H
#define IT_ABI_H
#include "bf16.h"

#define IT_ABI_VERSION 18
#define IT_MAX_KV_GROUPS 8 /* it_step's KV cache groups at most (cpu.py MAX_KV_GROUPS) */
/* A block-table entry of an int4 block (the int4 tier of an int8 cache; scheduler_output.INT4_SHIFT and its
 * neighbours): the block id with 1 (its low half) or 2 (its high half) at bit IT_INT4_SHIFT */
#define IT_INT4_SHIFT 40
#define IT_BLOCK_ID_MASK ((1LL << IT_INT4_SHIFT) - 1)

/* it_lin.kind: how a linear layer's weight is stored */
typedef enum {
    IT_KIND_BF16 = 0, IT_KIND_W8 = 1, IT_KIND_W4 = 2, IT_KIND_BF16C = 3, IT_KIND_W8A8 = 4, IT_KIND_W8P = 5,
    IT_KIND_W4P = 6
} it_kind;

/* A bf16 weight in the lossless 12-bit layout (bf16c_codec.c) */
typedef struct {
    const uint8_t* codes;      /* [N64 / 64][K / 32][64][48] */
    const uint8_t* table;      /* [16] high bytes */
    const int32_t* esc_start;  /* [N64 / 64 * K / 32 + 1]: the escapes of tile t are esc_start[t] .. esc_start[t + 1] */
    const uint16_t* esc_pos;   /* r * 32 + j within the decoded tile (VNNI row r, element j) */
    const bf16* esc_val;       /* the weight */
} bf16c;

/* The fused step (fused_step.c): one linear layer, one decoder layer, the model, one step */
typedef struct {
    int32_t kind;         /* 0: bf16 weight [N, K]; 1: int8 [N, K], per-row scale; 2: int4 (it_linear_w4's layout);
                             3: bf16 in 12 bits (w points at a bf16c; N % 16 == 0, K % 32 == 0, AMX);
                             4: int8 packed (it_pack_w8a8) with fp32 scale [N], times int8 activations (W8A8: the
                             libraries that define IT_HAS_W8A8);
                             5: int8 packed as kind 4, fp32 scale [N], times bf16 activations rounded to int16 (W8A16
                             on the packed weight: the AVX-512 library's gemm_w8p.c, IT_HAS_W8P);
                             6: int4 in 64-feature blocks (pack_w4p), scale and zero fp32 [N64 / 64][K / group][64]
                             (W4A16 on a packed weight: gemm_w4p.c, IT_HAS_W4P) */
    int32_t scale_is_f32; /* kind 1: scale is fp32 (1) or bf16 (0) */
    const void* w;
    const void* scale;    /* kind 1: [N]; kind 2: fp32 [N, K / group]; kind 6: fp32 [N64 / 64][K / group][64] */
    const bf16* bias;     /* [N] or NULL */
    int64_t N, K;
    const float* zero;    /* kind 2: fp32 [N, K / group]; kind 6: laid out as its scale; kind 4: the activations'
                             static scale [1], or NULL (a scale per row) */
    int64_t group;        /* kinds 2, 6: columns per group */
    int64_t inter;        /* kind 3: > 0 where the weight is a gate_up with gate and up rows interleaved 16 by 16
                             (linear_bf16c); the MLP then takes act straight from its tiles */
} it_lin;

/* A mixture-of-experts layer's routing rule (config.py MoeArch; moe.h it_moe_route) */
enum { IT_MOE_SOFTMAX = 0, IT_MOE_SIGMOID = 1 };                              /* it_moe.scoring */
enum { IT_MOE_GREEDY = 0, IT_MOE_GROUP_LIMITED = 1, IT_MOE_NOAUX_TC = 2 };    /* it_moe.topk_method */
typedef struct {
    int32_t num_experts, top_k;
    int32_t scoring;
    int32_t topk_method;
    int32_t n_group, topk_group;  /* the groups of experts, and how many of them a token's experts come from */
    int32_t norm_topk_prob;       /* 1: the top-k weights renormalised to sum to 1 */
    float routed_scaling_factor;
    int32_t torch_ties;           /* 1: a tie at the top-k (or top group) boundary resolved as torch.topk resolves it
                                     (moe.h moe_topk_torch); 0: such a row hands back */
} it_moe;

/* A mixture-of-experts layer in the fused step (fused_step.h moe_mlp): the router, the routed experts and an optional
 * shared expert, as layers/moe.py MoE computes them through the kernels */
typedef struct {
    it_moe rule;
    const bf16* router;         /* [E, hidden] bf16 */
    const float* bias;          /* [E] selection bias (DeepSeek-V3's e_score_correction_bias) or NULL */
    it_lin gate_up, down;       /* the routed experts: expert 0's it_lin of the stacked [E, 2I, H] and [E, H, I] */
    it_lin shared_gate_up;      /* the shared expert's gate_up [2 I_s, H] (N = 0: no shared expert) */
    it_lin shared_down;         /* [H, I_s] */
    const bf16* shared_gate;    /* [hidden]: sigmoid(x . g) scales the shared expert's output (Qwen2-MoE); NULL: not */
    int64_t expert_offset;      /* expert parallel: gate_up / down hold experts expert_offset .. + local_experts - 1 */
    int64_t local_experts;      /* of rule.num_experts (the router's); 0: every expert */
    const float* router_f32;    /* [E, hidden] fp32 (DeepSeek's router): the logits in fp32 from the fp32 hidden
                                   state, as F.linear(x.float(), w); NULL: router (bf16) */
} it_moe_layer;

/* A latent-attention layer (DeepSeek-V2 / V3, fused_step.h / mla.h), with the model's dims in it_model.mla_*: the
 * cache keeps one row a token, [latent c (mla_rank), rotated k_pe (mla_rope)] (it_model.head_dim = their sum,
 * n_kv_heads = 1); the query is absorbed (q_lat = q_nope W_UK per head), attention runs over the rows themselves,
 * and W_UV takes each head's latent output to its v (layers/attention/mla.py MlaAttention._decode). */
typedef struct {
    it_lin q_a;              /* [q_rank, hidden]: q = q_b(norm(q_a(h))); N = 0: no low rank, q = q_b(h) (q_proj) */
    it_lin q_b;              /* [H (nope + rope), q_rank or hidden] */
    it_lin kv_a;             /* [rank + rope, hidden]: kv_a_proj_with_mqa */
    const bf16* q_a_norm;    /* [q_rank] (with q_a) */
    const bf16* kv_a_norm;   /* [rank]: the latent's RMSNorm */
    const bf16* kv_up;       /* [H, nope + v, rank] bf16: kv_b_proj, each head's W_UK rows then its W_UV rows */
    float latent_eps;        /* the two latent norms' epsilon */
    int32_t interleaved;     /* 1: q_pe / k_pe come as interleaved pairs, de-interleaved before the rotary */
} it_mla_layer;

typedef struct {
    /* The norms' weights: bf16 w, out = bf16(w * bf16(x / rms(x))) (Llama); where it_model.norm_f32 is set, fp32
       factors f (Gemma's 1 + w, computed in fp32), out = bf16((x / rms(x)) * f), one rounding (layers/norm.py) */
    const void* input_norm;    /* [hidden] */
    const void* post_norm;     /* [hidden]: the MLP's input norm; with pre_ff_norm set, the norm of o_proj's output
                                  before its residual add (Gemma's post-attention norm) */
    it_lin qkv, o, gate_up, down; /* (gate_up and down unused where moe is set) */
    void* kv_cache;            /* [2, num_blocks, block_size, Hkv, D] bf16 (or int8 rows, see it_model.kv_int8) */
    const void* q_norm;        /* [head_dim]: a per-head RMSNorm of q before rotary (Qwen3, Gemma 3; NULL: none) */
    const void* k_norm;        /* [head_dim]: the same for k (set with q_norm) */
    const it_moe_layer* moe;   /* NULL: the dense MLP (gate_up, down) */
    int64_t window;            /* > 0: a sliding window, each row attends to its last `window` keys (its own
                                  included), as transformers masks it; 0: to its whole context */
    int64_t group;             /* the KV cache group whose slots and block tables the layer reads (it_step.group_*;
                                  0 where the step has one) */
    const void* pre_ff_norm;   /* [hidden]: Gemma's sandwich norms, the MLP's input norm and (post_ff_norm) the norm
                                  of its output before the residual add; NULL: Llama's two norms a layer */
    const void* post_ff_norm;
    const float* cos_sin;      /* the layer's own rotary table (Gemma 3's sliding layers), as it_model.cos_sin;
                                  NULL: the model's */
    const it_mla_layer* mla;   /* latent attention (qkv and q_norm / k_norm unused); NULL: the heads' own K / V */
} it_layer;

enum { IT_ACT_SILU = 0, IT_ACT_GELU_TANH = 1 }; /* it_model.act */
enum { IT_BF16C_EPI_STREAM = 2 }; /* it_linear_bf16c's epi beside 0 / 1: a plain product written past the caches */

typedef struct {
    int64_t hidden, n_heads, n_kv_heads, head_dim, inter;
    int64_t num_blocks, block_size;
    const float* cos_sin;      /* [max_position, head_dim]: cos of the D/2 frequencies, then sin */
    float eps, scale;
    int32_t nthreads, n_layers;
    int32_t kv_int8; /* 1: the cache holds int8 rows of D values + their fp32 scale (layers/attention/paged.py
                        Int8PagedAttention), [2, num_blocks, block_size, Hkv, D + 4] bytes */
    int32_t gate_up_fused; /* 1: every layer's gate_up hands act straight over (it_lin.inter): no [T, 2I] scratch */
    int32_t moe_experts, moe_top_k; /* the most experts and top-k of the MoE layers (0: none): the routing's scratch */
    int32_t act;      /* the gated MLP's activation: IT_ACT_SILU, or IT_ACT_GELU_TANH (Gemma's gelu_pytorch_tanh) */
    int32_t norm_f32; /* 1: every norm's weight is fp32 factors (Gemma's 1 + w; it_layer) */
    float softcap;    /* > 0: each attention score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2's
                         attn_logit_softcapping); 0: none */
    /* Latent attention (it_mla_layer; 0: none): the latent's width, the rotary key's, q's no-rotary part per head,
       v per head, q's low rank (0: none). cos_sin then covers mla_rope dims. */
    int64_t mla_rank, mla_rope, mla_nope, mla_v, mla_q_rank;
} it_model;

/* The fused step's wall time per part, summed over calls, and its calls and rows: one per engine, owned by the
 * caller (it_step.stats points at it; kernels/x86_fused.py keeps one per fused decoder), so two engines in one
 * process keep their own counts and the library holds no counters of its own. Only the thread running the step
 * writes it; the caller reads or zeroes it between steps. */
enum { IT_FT_NORM, IT_FT_QKV, IT_FT_ROTARY_KV, IT_FT_ATTN, IT_FT_O, IT_FT_RESIDUAL, IT_FT_GATE_UP, IT_FT_DOWN,
       IT_FT_ROUTER, IT_FT_EXPERTS, IT_FT_ALLREDUCE, IT_FT_PARTS };
typedef struct {
    double seconds[IT_FT_PARTS]; /* norm, qkv, rotary + K/V write, attention, o_proj, residual adds, gate_up (+ SiLU / GeLU),
                                    down, the MoE router (+ top-k), the routed experts, the tensor-parallel
                                    all-reduces (cpu.py FUSED_PARTS; o_proj / down without theirs); a shared expert
                                    counts as gate_up and down */
    int64_t calls, rows;
    int64_t allreduce_calls, allreduce_bytes; /* tensor parallel: the all-reduces' pieces and the fp32 bytes each
                                                 rank published in them */
    int64_t kv_read_bytes;                    /* latent attention (mla.h): the cache rows' bytes its attention read */
} it_step_stats;

typedef struct {
    int64_t T;                   /* decode rows, one per sequence */
    const int64_t* positions;    /* [T] */
    const int64_t* slots;        /* [T] cache slot of each new token */
    const int64_t* block_tables; /* [T, max_blocks] */
    const int64_t* context_lens; /* [T], the new token included */
    int64_t max_blocks;
    void* work;                  /* it_decode_workspace_bytes(model, T, max_blocks * block_size) bytes, aligned */
    int64_t work_bytes;
    const int64_t* out_rows;     /* [n_out], ascending: the rows whose hidden state the caller reads (the last of
                                    each sampled sequence); n_out = 0: every row */
    int64_t n_out;
    it_step_stats* stats;        /* where the step adds its time, calls and rows; NULL: not timed (no clock reads) */
    /* Mixture-of-experts layers: where a tie at the top-k boundary decides some tokens' experts (moe.h), the step
       hands back (it_decode_layers returns 1) with the layer in handed_back, the tied rows' count in route_rows,
       their indices in tied_rows and their router logits packed in router_logits' first rows; the caller routes
       those rows (route()) and calls again from that layer with their routing in route_weights / route_ids,
       first_layer = handed_back (the other rows keep the step's own routing, kept in the workspace meanwhile). */
    bf16* router_logits;         /* [rows, moe_experts]: caller-owned */
    int32_t first_layer;         /* in: the layer to start at (0: the whole step) */
    int32_t handed_back;         /* out: where 1 was returned, the MoE layer whose routing the caller decides */
    int64_t route_rows;          /* out: that layer's tied rows */
    const float* route_weights;  /* in, first_layer's MoE only (NULL: route it here): [route_rows, k] */
    const int64_t* route_ids;    /* [route_rows, k] */
    int64_t* tied_rows;          /* [rows]: caller-owned (MoE models); out: the tied rows, ascending */
    int64_t* expert_load;        /* [n_layers, moe_experts]: the rows each MoE layer routed to each expert are added
                                    here (`infertune profile`'s expert-load table); NULL: not counted */
    /* KV cache groups (layers grouped by sliding window, each group with its own block tables: the blocks that fall
       out of a window are freed, and a table's entries below a row's window may hold any id): n_groups > 0 gives
       each group's slots [T] and block tables [T, max_blocks], read by the layers whose it_layer.group it is;
       0: every layer reads slots and block_tables above */
    int64_t n_groups;
    const int64_t* group_slots[IT_MAX_KV_GROUPS];
    const int64_t* group_tables[IT_MAX_KV_GROUPS];
    /* Tensor parallel on one host: each row-parallel output (o_proj, down; bf16 partial sums) is summed over the
       ranks before its residual add, through layers/shm_allreduce.py's shared-memory segment and protocol (int64
       counters [tp_size], then two buffers of tp_size fp32 slots of tp_max_numel; fp32 sums in rank order, rounded
       once). tp_size <= 1: none. */
    void* tp_shm;
    int64_t* tp_seq;             /* the last call's sequence number, shared with the Python side's calls */
    int32_t tp_rank, tp_size;
    int64_t tp_max_numel;
    /* Tensor parallel without the segment (ranks on more than one host, or INFERTUNE_TP_SHM=0): tp_shm NULL and
       this the caller's all-reduce, int (*)(bf16* y, int64_t n): y summed over the ranks in place (its collective,
       gloo), called from the step's own thread between the kernels; its time counts as the all-reduce part, its
       calls and bytes are the caller's to count. Its return value is ignored (the caller keeps its own error). */
    void* tp_reduce_fn;
} it_step;


int it_abi(void);
int64_t it_struct_sizes(int64_t* out, int64_t n);
#endif
