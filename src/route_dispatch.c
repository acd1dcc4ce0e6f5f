/* Routing through to dispatch in one call (docs/routing.md, "Routing
 * through to dispatch"): top-k gating, then moe_align on its topk_ids,
 * enqueued back to back. Everything either step could refuse is checked
 * before the first enqueue, so bad input changes no output. */
#include <string.h>

#include "internal.h"

/* The buffers of a call: top-k gating's, then moe_align's outputs. */
typedef struct route_buffers {
    moecl_buffer gating, bias, weights, ids, counts, sorted, blocks, post, slots, invalid;
} route_buffers;

/* The context and both descriptors' checks; *align receives moe_align's
 * descriptor. */
static moecl_status validate(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                             moecl_moe_align_desc *align)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = moecl_topk_gating_validate(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    *align = moecl_moe_align_desc_init(desc->num_tokens, desc->top_k, desc->num_experts, block_size);
    return moecl_moe_align_validate(ctx, align);
}

/* moe_align's outputs, which the top-k call does not check (it checks its
 * own buffers before it enqueues anything). */
static moecl_status check_align_buffers(moecl_context *ctx, const moecl_moe_align_desc *d, const route_buffers *b)
{
    const uint64_t slots = (uint64_t)d->num_tokens * d->top_k * 4, max_padded = moecl_moe_align_max_padded(d);
    moecl_status st;
    if ((st = moecl_check_buffer(ctx, "expert_counts", b->counts, (uint64_t)d->num_experts * 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "sorted_token_ids", b->sorted, max_padded * 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "block_expert_ids", b->blocks, max_padded / d->block_size * 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "num_tokens_post_padded", b->post, 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "slot_positions", b->slots, slots, 4, false)) ||
        (st = moecl_check_buffer(ctx, "num_invalid", b->invalid, 4, 4, false)))
        return st;
    return MOECL_SUCCESS;
}

/* The two calls. moe_align's kernels are built first, so that a build
 * failure enqueues nothing; on an out-of-order queue moe_align waits on
 * the top-k kernel's event. If moe_align fails after top-k was enqueued,
 * the top-k kernel is waited for before the error returns. */
static moecl_status enqueue(moecl_context *ctx, const moecl_topk_gating_desc *desc, const moecl_moe_align_desc *align,
                            const route_buffers *b, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const moecl_plan *p;
    moecl_status st = moecl_moe_align_plan(ctx, &p);
    if (st != MOECL_SUCCESS)
        return st;
    cl_event routed = NULL;
    st = moecl_topk_gating(ctx, desc, b->gating, b->bias, b->weights, b->ids, num_wait, wait,
                           ctx->in_order ? NULL : &routed);
    if (st != MOECL_SUCCESS)
        return st;
    st = moecl_moe_align(ctx, align, b->ids, b->counts, b->sorted, b->blocks, b->post, b->slots, b->invalid,
                         routed ? 1 : 0, routed ? &routed : NULL, done);
    if (st != MOECL_SUCCESS) {
        if (routed)
            clWaitForEvents(1, &routed);
        else
            clFinish(ctx->queue);
    }
    if (routed)
        clReleaseEvent(routed);
    return st;
}

moecl_status moecl_route_dispatch(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                                  moecl_buffer gating, moecl_buffer bias, moecl_buffer topk_weights,
                                  moecl_buffer topk_ids, moecl_buffer expert_counts, moecl_buffer sorted_token_ids,
                                  moecl_buffer block_expert_ids, moecl_buffer num_tokens_post_padded,
                                  moecl_buffer slot_positions, moecl_buffer num_invalid, cl_uint num_wait,
                                  const cl_event *wait, cl_event *done)
{
    moecl_moe_align_desc align;
    moecl_status st = validate(ctx, desc, block_size, &align);
    if (st != MOECL_SUCCESS)
        return st;
    const route_buffers b = {gating,           bias,
                             topk_weights,     topk_ids,
                             expert_counts,    sorted_token_ids,
                             block_expert_ids, num_tokens_post_padded,
                             slot_positions,   num_invalid};
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS ||
        (st = check_align_buffers(ctx, &align, &b)) != MOECL_SUCCESS)
        return st;
    return enqueue(ctx, desc, &align, &b, num_wait, wait, done);
}

moecl_status moecl_route_dispatch_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                                       const void *gating, const float *bias, float *topk_weights, int32_t *topk_ids,
                                       int32_t *expert_counts, int32_t *sorted_token_ids, int32_t *block_expert_ids,
                                       int32_t *num_tokens_post_padded, int32_t *slot_positions, int32_t *num_invalid)
{
    moecl_moe_align_desc align;
    moecl_status st = validate(ctx, desc, block_size, &align);
    if (st != MOECL_SUCCESS)
        return st;
    const bool tokens = desc->num_tokens > 0;
    const uint64_t max_padded = moecl_moe_align_max_padded(&align);
    const char *missing = tokens && !gating           ? "gating"
                          : tokens && !topk_weights   ? "topk_weights"
                          : tokens && !topk_ids       ? "topk_ids"
                          : !expert_counts            ? "expert_counts"
                          : !sorted_token_ids && max_padded ? "sorted_token_ids"
                          : !block_expert_ids && max_padded >= block_size ? "block_expert_ids"
                          : !num_tokens_post_padded   ? "num_tokens_post_padded"
                                                      : NULL;
    if (missing)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    const moecl_plan *p;
    if ((st = moecl_topk_gating_plan(ctx, desc, bias != NULL, false, &p)) != MOECL_SUCCESS ||
        (st = moecl_moe_align_plan(ctx, &p)) != MOECL_SUCCESS)
        return st; /* built before the buffers are made: a build failure costs no copy */
    enum { GATING, BIAS, WEIGHTS, IDS, COUNTS, SORTED, BLOCKS, POST, SLOTS, INVALID, NUM };
    const uint64_t slots = (uint64_t)desc->num_tokens * desc->top_k * 4;
    /* At least 4 bytes: OpenCL refuses empty buffers. */
    const uint64_t bytes[NUM] = {(uint64_t)desc->num_tokens * desc->num_experts *
                                     moecl_dtype_size(desc->gating_dtype),
                                 (uint64_t)desc->num_experts * 4,
                                 slots,
                                 slots,
                                 (uint64_t)desc->num_experts * 4,
                                 max_padded * 4,
                                 max_padded / block_size * 4,
                                 4,
                                 slots,
                                 4};
    const void *const inputs[NUM] = {tokens ? gating : NULL, bias};
    void *outputs[NUM] = {NULL,
                                NULL,
                                tokens ? topk_weights : NULL,
                                tokens ? topk_ids : NULL,
                                expert_counts,
                                sorted_token_ids,
                                block_expert_ids,
                                num_tokens_post_padded,
                                tokens ? slot_positions : NULL,
                                num_invalid};
    for (int i = 0; i < NUM; i++)
        if (!bytes[i])
            outputs[i] = NULL; /* nothing to read (and sorted_token_ids may be NULL then) */
    static const char *const names[NUM] = {"gating",           "bias",     "topk_weights",
                                           "topk_ids",         "expert_counts", "sorted_token_ids",
                                           "block_expert_ids", "num_tokens_post_padded", "slot_positions",
                                           "num_invalid"};
    cl_mem m[NUM] = {NULL};
    for (int i = 0; i < NUM && st == MOECL_SUCCESS; i++) {
        const bool wanted = i == GATING || i == WEIGHTS || i == IDS || (i == BIAS && bias) ||
                            (i == SLOTS && slot_positions) || (i == INVALID && num_invalid) ||
                            (i >= COUNTS && i <= POST);
        if (wanted)
            st = moecl_host_buffer(ctx, names[i], i <= BIAS ? CL_MEM_READ_ONLY : CL_MEM_READ_WRITE,
                                   (size_t)(bytes[i] ? bytes[i] : 4), inputs[i], &m[i]);
    }
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS) {
        route_buffers b;
        moecl_buffer *const all[NUM] = {&b.gating, &b.bias,   &b.weights, &b.ids,   &b.counts,
                                        &b.sorted, &b.blocks, &b.post,    &b.slots, &b.invalid};
        for (int i = 0; i < NUM; i++)
            *all[i] = (moecl_buffer){m[i], 0};
        st = enqueue(ctx, desc, &align, &b, 0, NULL, &ran);
    }
    if (st == MOECL_SUCCESS) {
        size_t sizes[NUM - WEIGHTS];
        for (int i = WEIGHTS; i < NUM; i++)
            sizes[i - WEIGHTS] = (size_t)bytes[i];
        st = moecl_read_back(ctx, ran, NUM - WEIGHTS, m + WEIGHTS, sizes, outputs + WEIGHTS);
    }
    if (ran)
        clReleaseEvent(ran);
    for (int i = 0; i < NUM; i++)
        if (m[i])
            clReleaseMemObject(m[i]);
    return st;
}
