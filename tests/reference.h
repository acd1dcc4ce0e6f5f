/*
 * Float64 reference of docs/routing.md (the spec in code) and the checker
 * that compares a device result with it. Shared by the Check suites and by
 * the tools (moecl-bench). Like dav1d's checkasm, every optimised kernel is
 * judged by this file alone.
 */
#ifndef MOECL_TESTS_REFERENCE_H
#define MOECL_TESTS_REFERENCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <moecl/moecl.h>

/* Widen one element of a f32/f16/bf16 tensor to float (exactly). */
float ref_load(moecl_dtype dtype, const void *data, size_t index);
/* Narrow a float to f16 / bf16 (round to nearest even), for making inputs. */
uint16_t ref_float_to_half(float f);
uint16_t ref_float_to_bf16(float f);
size_t ref_dtype_size(moecl_dtype dtype);

/* Top-k gating in float64: writes topk_weights and topk_ids
 * ([num_tokens][top_k + num_shared_experts]: the routed slots, then the
 * shared ones). Rows are independent. */
void ref_topk_gating(const moecl_topk_gating_desc *desc, const void *gating, const float *bias,
                     float *topk_weights, int32_t *topk_ids);

/* Compare a device result with the reference. Returns 0 when it agrees:
 * ids distinct and in range, each id equal to the reference's or, at a
 * near-tie, one whose selection score differs from the reference pick's by
 * no more than the fp32 rounding bound of the two; weights within 1e-5 of
 * the reference weights of the ids actually chosen (NaN where the reference
 * is NaN). The shared slots (num_shared_experts) must hold ids
 * num_experts + j and exactly the fp32 product shared_expert_weight *
 * routed_scaling_factor (rounded to weights_dtype). Otherwise returns the
 * number of bad rows and writes the first problem (row, position, values)
 * into msg. */
int ref_check_topk_gating(const moecl_topk_gating_desc *desc, const void *gating, const float *bias,
                          const float *topk_weights, const int32_t *topk_ids, char *msg, size_t msg_size);

/* ref_check_topk_gating with moecl_topk_gating_ex's expert_scale
 * (float[num_experts]; NULL: none): each reference weight times its
 * expert's scale, the tolerance with it. */
int ref_check_topk_gating_scaled(const moecl_topk_gating_desc *desc, const void *gating, const float *bias,
                                 const float *expert_scale, const float *topk_weights, const int32_t *topk_ids,
                                 char *msg, size_t msg_size);
/* moecl_topk_weights in float64 (docs/routing.md section 11): the
 * weights desc's convention gives the ids topk_ids ([num_tokens][top_k];
 * an id outside [0, num_experts) weighs 0 and is left out). */
void ref_topk_weights(const moecl_topk_gating_desc *desc, const void *gating, const int32_t *topk_ids,
                      float *topk_weights);
/* Compare a device's replayed weights with the reference, as
 * ref_check_topk_gating compares weights (the same tolerances); the slots
 * that hold no expert must be exactly 0. Returns the number of bad rows,
 * the first problem in msg. */
int ref_check_topk_weights(const moecl_topk_gating_desc *desc, const void *gating, const int32_t *topk_ids,
                           const float *topk_weights, char *msg, size_t msg_size);
/* ref_check_topk_gating on the outputs and bias in desc's types
 * (weights_dtype, ids_dtype, bias_dtype): widened exactly, the weights
 * within the rounding to weights_dtype too (an overflow of it may be
 * +-inf); an int64 id outside the int32 range is a bad id. */
int ref_check_topk_gating_typed(const moecl_topk_gating_desc *desc, const void *gating, const void *bias,
                                const void *topk_weights, const void *topk_ids, char *msg, size_t msg_size);

/* The same with expert_scale, as ref_check_topk_gating_scaled. */
int ref_check_topk_gating_typed_scaled(const moecl_topk_gating_desc *desc, const void *gating, const void *bias,
                                       const float *expert_scale, const void *topk_weights, const void *topk_ids,
                                       char *msg, size_t msg_size);
/* Whether element index of narrow (weights of dtype) holds exactly the
 * host's rounding of f32_weight (ref_float_to_bf16, ref_float_to_half:
 * nearest even; for f16 any NaN where f32_weight is NaN). */
bool ref_same_rounding(moecl_dtype dtype, float f32_weight, const void *narrow, size_t index);

/* moecl_router in float64: the grounded router's g (router_logits may be
 * NULL: g = alpha * hidden @ ground^T) through desc->gating's pipeline
 * with an optional bias (any output may be NULL). Rows are top_k +
 * num_shared_experts slots: the shared ones' ids num_experts + j and
 * their constant weight (shared_expert_weight * routed_scaling_factor in
 * fp32). */
void ref_router(const moecl_grounded_router_desc *desc, const void *token_hidden, const float *router_logits,
                const void *expert_ground, const float *bias, float *out_pairs, float *topk_weights,
                int32_t *topk_ids);

/* As ref_check_topk_gating, for ref_router (g's fp32 bound carried
 * through the scores and weights, docs/routing.md section 4); NULL
 * outputs are not checked. Rows of top_k + num_shared_experts slots: the
 * shared ones' ids and constant weight exactly. */
int ref_check_router(const moecl_grounded_router_desc *desc, const void *token_hidden, const float *router_logits,
                     const void *expert_ground, const float *bias, const float *out_pairs,
                     const float *topk_weights, const int32_t *topk_ids, char *msg, size_t msg_size);

/* moecl_router_ex's outputs beyond moecl_router's, for ref_check_router_ex:
 * the bias of desc->bias_dtype, the per-expert scale, the valid count, the
 * typed weights and ids, the captured ids, the histograms. NULL: absent. */
typedef struct ref_router_ex {
    const void *bias;           /* [E] of desc->bias_dtype */
    const float *expert_scale;  /* [E] */
    const int32_t *num_valid;   /* [1] */
    const void *topk_weights;   /* [T][k] of desc->weights_dtype (required) */
    const void *topk_ids;       /* [T][k] of desc->ids_dtype (required) */
    const void *captured_ids;   /* [T][k] of captured_dtype */
    moecl_index_dtype captured_dtype;
    const int32_t *expert_counts;                 /* [E + S] */
    const int32_t *load_before, *load_after;      /* [E + S] each, both or neither */
    const void *shared_expert_gate;               /* [S][H] of desc->hidden_dtype */
} ref_router_ex;

/* ref_check_router for moecl_router_ex: the rows before the valid count n
 * (num_valid clamped to [0, T]; T without it) against the reference, each
 * weight divided by its expert's scale first (the scale multiplies the
 * final f32 weight once, so the quotient is that weight within 2^-24 of
 * it); the rows from n on ids -1 and weights 0 in every slot; the captured
 * ids the routed ids; expert_counts the histogram of the valid rows' ids
 * (E + S experts), and load_after load_before plus it; with
 * shared_expert_gate the shared slots' weights sigmoid(hidden . gate[j])
 * within the bound of docs/routing.md section 3, else the constant.
 * Returns the bad rows (or -1), msg the first. */
int ref_check_router_ex(const moecl_grounded_router_desc *desc, const void *token_hidden, const float *router_logits,
                        const void *expert_ground, const ref_router_ex *x, char *msg, size_t msg_size);

/* Grounded router in float64 (any output may be NULL). */
void ref_grounded_router(const moecl_grounded_router_desc *desc, const void *token_hidden,
                         const float *router_logits, const void *expert_ground, float *out_pairs,
                         float *topk_weights, int32_t *topk_ids);

/* As ref_check_topk_gating, for the grounded router; NULL outputs are not
 * checked. */
int ref_check_grounded_router(const moecl_grounded_router_desc *desc, const void *token_hidden,
                              const float *router_logits, const void *expert_ground, const float *out_pairs,
                              const float *topk_weights, const int32_t *topk_ids, char *msg, size_t msg_size);

/* moe_align (docs/routing.md, "Dispatch: moe_align"), by counting and a
 * serial stable walk over the slots. sorted_token_ids has
 * moecl_moe_align_max_padded(desc) entries and block_expert_ids that
 * divided by block_size; slot_positions and num_invalid may be NULL. */
void ref_moe_align(const moecl_moe_align_desc *desc, const int32_t *topk_ids, int32_t *expert_counts,
                   int32_t *sorted_token_ids, int32_t *block_expert_ids, int32_t *num_tokens_post_padded,
                   int32_t *slot_positions, int32_t *num_invalid);

/* Compare a device result with ref_moe_align's exactly (the result is
 * unique). NULL slot_positions / num_invalid are not checked. Returns 0
 * when equal, else the number of differing elements, with the first
 * difference (output, index, values) in msg. */
int ref_check_moe_align(const moecl_moe_align_desc *desc, const int32_t *topk_ids, const int32_t *expert_counts,
                        const int32_t *sorted_token_ids, const int32_t *block_expert_ids,
                        const int32_t *num_tokens_post_padded, const int32_t *slot_positions,
                        const int32_t *num_invalid, char *msg, size_t msg_size);

/* The same two with expert parallelism: where desc->num_global_experts is
 * not 0, topk_ids are global ids and expert_map (that many entries) maps
 * each to a local expert or -1 (docs/routing.md, "Expert parallelism in
 * moe_align"); with 0, expert_map is unused and they are the two above. */
void ref_moe_align_map(const moecl_moe_align_desc *desc, const int32_t *topk_ids, const int32_t *expert_map,
                       int32_t *expert_counts, int32_t *sorted_token_ids, int32_t *block_expert_ids,
                       int32_t *num_tokens_post_padded, int32_t *slot_positions, int32_t *num_invalid);
int ref_check_moe_align_map(const moecl_moe_align_desc *desc, const int32_t *topk_ids, const int32_t *expert_map,
                            const int32_t *expert_counts, const int32_t *sorted_token_ids,
                            const int32_t *block_expert_ids, const int32_t *num_tokens_post_padded,
                            const int32_t *slot_positions, const int32_t *num_invalid, char *msg, size_t msg_size);

/* The outputs of moecl_ep_layout; NULL optional ones (token_in_rank,
 * tokens_per_rank, expert_counts) are neither written nor checked. */
typedef struct ref_ep_layout_out {
    int32_t *physical_ids, *rank_counts, *rank_offsets, *send_slots;
    uint8_t *token_in_rank;
    int32_t *tokens_per_rank, *expert_counts;
} ref_ep_layout_out;

/* The expert-parallel dispatch layout (docs/routing.md, "Expert-parallel
 * dispatch layout"), by a serial walk over the slots and a stable bucket
 * placement. The tables may be NULL as the call's buffers may be absent. */
void ref_ep_layout(const moecl_ep_layout_desc *desc, const int32_t *topk_ids, const int32_t *logical_to_physical,
                   const int32_t *replica_counts, const int32_t *physical_to_rank, const ref_ep_layout_out *out);

/* Compare a device result with ref_ep_layout's exactly (the result is
 * unique). Returns 0 when equal, else the number of differing elements,
 * with the first difference in msg. */
int ref_check_ep_layout(const moecl_ep_layout_desc *desc, const int32_t *topk_ids, const int32_t *logical_to_physical,
                        const int32_t *replica_counts, const int32_t *physical_to_rank, const ref_ep_layout_out *got,
                        char *msg, size_t msg_size);

/* Permute and combine (docs/routing.md, "Permute and combine"). ref_permute
 * writes rows [0, min(max(post, 0), num_padded)) of out as moecl_permute
 * does (the same dtype bit for bit, else through f32 to nearest even);
 * ref_combine writes every row of out in the documented f32 order, which
 * the device must match bit for bit; ref_combine_f64 is element (t, c)
 * in float64, with the sum of the terms' magnitudes (for a bound on the
 * f32 order's error). shared_out NULL: none. */
void ref_permute(const moecl_permute_desc *desc, const void *hidden_states, const int32_t *sorted_token_ids,
                 int32_t num_tokens_post_padded, void *out);
void ref_combine(const moecl_combine_desc *desc, const void *expert_out, const float *topk_weights,
                 const int32_t *slot_positions, const void *shared_out, void *out);
double ref_combine_f64(const moecl_combine_desc *desc, const void *expert_out, const float *topk_weights,
                       const int32_t *slot_positions, const void *shared_out, size_t t, size_t c, double *magnitude);

#endif
