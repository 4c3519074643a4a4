/* The ABI of abi.h, for the loader's check (kernels/cpu.py check_abi): the version, then for each shared struct
 * its size and the offset and size of each field, in the order it_struct_sizes writes them (cpu.py abi_layout),
 * then the weight kinds, the MoE routing rules' values, the fused step's count of timed parts and the activations'
 * values. */
#include <stddef.h>
#include "abi.h"

int it_abi(void) { return IT_ABI_VERSION; }

#define SZ(T) (int64_t)sizeof(T)
#define OF(T, f) (int64_t)offsetof(T, f), (int64_t)sizeof(((T*)0)->f) /* where a field is, and its width */

/* Writes up to n values into out; returns how many there are (call with n = 0 to ask). */
int64_t it_struct_sizes(int64_t* out, int64_t n) {
    const int64_t v[] = {
        SZ(it_lin), OF(it_lin, kind), OF(it_lin, scale_is_f32), OF(it_lin, w), OF(it_lin, scale), OF(it_lin, bias),
        OF(it_lin, N), OF(it_lin, K), OF(it_lin, zero), OF(it_lin, group), OF(it_lin, inter),
        SZ(it_layer), OF(it_layer, input_norm), OF(it_layer, post_norm), OF(it_layer, qkv), OF(it_layer, o),
        OF(it_layer, gate_up), OF(it_layer, down), OF(it_layer, kv_cache), OF(it_layer, q_norm),
        OF(it_layer, k_norm), OF(it_layer, moe), OF(it_layer, window), OF(it_layer, group), OF(it_layer, pre_ff_norm),
        OF(it_layer, post_ff_norm), OF(it_layer, cos_sin), OF(it_layer, mla),
        SZ(it_model), OF(it_model, hidden), OF(it_model, n_heads), OF(it_model, n_kv_heads), OF(it_model, head_dim),
        OF(it_model, inter), OF(it_model, num_blocks), OF(it_model, block_size), OF(it_model, cos_sin),
        OF(it_model, eps), OF(it_model, scale), OF(it_model, nthreads), OF(it_model, n_layers), OF(it_model, kv_int8),
        OF(it_model, gate_up_fused), OF(it_model, moe_experts), OF(it_model, moe_top_k), OF(it_model, act),
        OF(it_model, norm_f32), OF(it_model, softcap), OF(it_model, mla_rank), OF(it_model, mla_rope),
        OF(it_model, mla_nope), OF(it_model, mla_v), OF(it_model, mla_q_rank),
        SZ(it_step), OF(it_step, T), OF(it_step, positions), OF(it_step, slots), OF(it_step, block_tables),
        OF(it_step, context_lens), OF(it_step, max_blocks), OF(it_step, work), OF(it_step, work_bytes),
        OF(it_step, out_rows), OF(it_step, n_out), OF(it_step, stats), OF(it_step, router_logits),
        OF(it_step, first_layer), OF(it_step, handed_back), OF(it_step, route_rows), OF(it_step, route_weights),
        OF(it_step, route_ids), OF(it_step, tied_rows), OF(it_step, expert_load), OF(it_step, n_groups),
        OF(it_step, group_slots), OF(it_step, group_tables), OF(it_step, tp_shm), OF(it_step, tp_seq),
        OF(it_step, tp_rank), OF(it_step, tp_size), OF(it_step, tp_max_numel), OF(it_step, tp_reduce_fn),
        SZ(it_step_stats), OF(it_step_stats, seconds), OF(it_step_stats, calls), OF(it_step_stats, rows),
        OF(it_step_stats, allreduce_calls), OF(it_step_stats, allreduce_bytes), OF(it_step_stats, kv_read_bytes),
        SZ(bf16c), OF(bf16c, codes), OF(bf16c, table), OF(bf16c, esc_start), OF(bf16c, esc_pos), OF(bf16c, esc_val),
        SZ(it_moe), OF(it_moe, num_experts), OF(it_moe, top_k), OF(it_moe, scoring), OF(it_moe, topk_method),
        OF(it_moe, n_group), OF(it_moe, topk_group), OF(it_moe, norm_topk_prob), OF(it_moe, routed_scaling_factor),
        OF(it_moe, torch_ties),
        SZ(it_moe_layer), OF(it_moe_layer, rule), OF(it_moe_layer, router), OF(it_moe_layer, bias),
        OF(it_moe_layer, gate_up), OF(it_moe_layer, down), OF(it_moe_layer, shared_gate_up),
        OF(it_moe_layer, shared_down), OF(it_moe_layer, shared_gate), OF(it_moe_layer, expert_offset),
        OF(it_moe_layer, local_experts), OF(it_moe_layer, router_f32),
        SZ(it_mla_layer), OF(it_mla_layer, q_a), OF(it_mla_layer, q_b), OF(it_mla_layer, kv_a),
        OF(it_mla_layer, q_a_norm), OF(it_mla_layer, kv_a_norm), OF(it_mla_layer, kv_up), OF(it_mla_layer, latent_eps),
        OF(it_mla_layer, interleaved),
        IT_KIND_BF16, IT_KIND_W8, IT_KIND_W4, IT_KIND_BF16C, IT_KIND_W8A8, IT_KIND_W8P, IT_KIND_W4P,
        IT_MOE_SOFTMAX, IT_MOE_SIGMOID, IT_MOE_GREEDY, IT_MOE_GROUP_LIMITED, IT_MOE_NOAUX_TC, IT_FT_PARTS,
        IT_ACT_SILU, IT_ACT_GELU_TANH, IT_BF16C_EPI_STREAM,
    };
    const int64_t count = (int64_t)(sizeof v / sizeof v[0]);
    for (int64_t i = 0; i < count && i < n; i++) out[i] = v[i];
    return count;
}
