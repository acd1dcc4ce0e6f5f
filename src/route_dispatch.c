/* Routing through to dispatch in one call (docs/routing.md, "Routing
 * through to dispatch"): for decode-sized routings on the team kernel, one
 * launch of topk_gating_team built with ROUTE_DISPATCH (each work-group
 * routes its rows, then takes them as its chunk of moe_align_fused:
 * cl/topk_gating.cl, cl/moe_align.cl); otherwise top-k gating, then
 * moe_align on its topk_ids, enqueued back to back. Everything either way
 * could refuse is checked before the first enqueue, so bad input changes
 * no output. */
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

/* The most slots the one kernel takes: its last work-group places every
 * slot alone, as moe_align_fused's does, whose GPU limit this is
 * (src/moe_align.c, MOECL_ALIGN_FUSED_MAX_SLOTS_GPU). On NVIDIA's OpenCL
 * (the H200) it beat the two calls in wall time up to 32 tokens at top_k 8
 * and lost from 64 (bench/RESULTS.md, "moecl_route_dispatch on the H200"),
 * so there the default stops at 256 slots; MOECL_ALIGN=fused asks for the
 * one kernel up to the general limit on every device. */
#define ROUTE_ONE_KERNEL_MAX_SLOTS 5120u
#define ROUTE_ONE_KERNEL_MAX_SLOTS_NVIDIA 256u

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

/* Whether the one kernel serves the call, and its plan: some tokens, at
 * most ROUTE_ONE_KERNEL_MAX_SLOTS slots, top-k on the team kernel, no
 * MOECL_ALIGN forcing another path, the device's work-group limit and
 * local memory (the team's rows, then moe_align_fused's two arrays of
 * E + 1 words and its compiled-in ones). */
static moecl_status one_kernel_plan(moecl_context *ctx, const moecl_topk_gating_desc *d, bool has_bias,
                                    const moecl_plan **plan)
{
    *plan = NULL;
    const uint64_t slots = (uint64_t)d->num_tokens * d->top_k;
    const moecl_align_path forced = ctx->info.env.align_path;
    const uint64_t cap = ctx->info.vendor == MOECL_VENDOR_NVIDIA && forced != MOECL_ALIGN_FUSED
                             ? ROUTE_ONE_KERNEL_MAX_SLOTS_NVIDIA
                             : ROUTE_ONE_KERNEL_MAX_SLOTS;
    if (slots == 0 || slots > cap || forced == MOECL_ALIGN_ONE_GROUP || forced == MOECL_ALIGN_CHUNKED)
        return MOECL_SUCCESS;
    const moecl_plan *p;
    moecl_status st = moecl_topk_gating_plan(ctx, d, has_bias, false, &p);
    if (st != MOECL_SUCCESS || p->config.kernel != MOECL_KERNEL_TEAM)
        return st;
    const unsigned team = p->config.team, rows = p->config.rows, wg = team * rows;
    const size_t local = moecl_layout_topk_team_local(team, rows, d->num_experts, d->top_k, d->num_expert_groups,
                                                      true, false) +
                         moecl_layout_moe_align_fused_local(d->num_experts, wg);
    if (local + 1024 > ctx->info.local_mem_size)
        return MOECL_SUCCESS;
    if ((st = moecl_topk_gating_route_plan(ctx, d, has_bias, &p)) != MOECL_SUCCESS)
        return st;
    if (p->limits[0] && p->limits[0] < p->local)
        return MOECL_SUCCESS; /* register use: the two calls serve it */
    *plan = p;
    return MOECL_SUCCESS;
}

/* The one launch. Its scratch (the context's, as moe_align's fused path
 * uses it): the ticket, the count matrix and its prefixes, a rank and a
 * column per slot; the ticket is zeroed first where it may not be 0. */
static moecl_status enqueue_one_kernel(moecl_context *ctx, const moecl_topk_gating_desc *d, uint32_t block_size,
                                       const moecl_plan *p, const route_buffers *b, cl_uint num_wait,
                                       const cl_event *wait, cl_event *done)
{
    const uint64_t t = d->num_tokens, e = d->num_experts, k = d->top_k;
    const size_t in_size = moecl_dtype_size(d->gating_dtype);
    const moecl_moe_align_desc align = moecl_moe_align_desc_init(d->num_tokens, d->top_k, d->num_experts, block_size);
    const uint64_t max_padded = moecl_moe_align_max_padded(&align);
    const size_t groups = (t + p->rows_per_group - 1) / p->rows_per_group;
    const size_t scratch_bytes = (1 + 2 * groups * (e + 1) + 2 * t * k) * 4;
    cl_mem scratch;
    moecl_status st = moecl_scratch_acquire(ctx, scratch_bytes, &scratch);
    if (st != MOECL_SUCCESS)
        return st;
    const bool reused = ctx->in_order && ctx->scratch_lock_ready;
    const moecl_buffer_check checks[] = {{"gating", t * e * in_size, b->gating.offset, in_size, true},
                                         {"bias", e * 4, b->bias.offset, 4, false},
                                         {"topk_weights", t * k * 4, b->weights.offset, 4, true},
                                         {"topk_ids", t * k * 4, b->ids.offset, 4, true},
                                         {"expert_counts", e * 4, b->counts.offset, 4, true},
                                         {"sorted_token_ids", max_padded * 4, b->sorted.offset, 4, true},
                                         {"block_expert_ids", max_padded / block_size * 4, b->blocks.offset, 4, true},
                                         {"num_tokens_post_padded", 4, b->post.offset, 4, true},
                                         {"slot_positions", t * k * 4, b->slots.offset, 4, false},
                                         {"num_invalid", 4, b->invalid.offset, 4, false}};
    const layout_topk_args scalars = {b->gating.offset / in_size, b->bias.offset / 4, b->weights.offset / 4,
                                      b->ids.offset / 4, 0, d->num_tokens, d->routed_scaling_factor};
    const layout_dispatch_args dargs = {b->counts.offset / 4, b->sorted.offset / 4, b->blocks.offset / 4,
                                        b->post.offset / 4,   b->slots.offset / 4,  b->invalid.offset / 4,
                                        block_size,           b->slots.mem != NULL, b->invalid.mem != NULL, 0};
    const size_t cols_bytes = moecl_layout_moe_align_cols(d->num_experts);
    moecl_kernel_arg args[16];
    cl_uint n = 0;
    args[n++] = MOECL_ARG_CHECKED(b->gating.mem, &checks[0]);
    if (b->bias.mem)
        args[n++] = MOECL_ARG_CHECKED(b->bias.mem, &checks[1]);
    args[n++] = MOECL_ARG_CHECKED(b->weights.mem, &checks[2]);
    args[n++] = MOECL_ARG_CHECKED(b->ids.mem, &checks[3]);
    args[n++] = MOECL_ARG(scalars);
    args[n++] = MOECL_ARG_MEM(scratch);
    const moecl_buffer *outs[] = {&b->counts, &b->sorted, &b->blocks, &b->post, &b->slots, &b->invalid};
    for (int i = 0; i < 6; i++)
        args[n++] = MOECL_ARG_CHECKED(outs[i]->mem, &checks[4 + i]);
    args[n++] = MOECL_ARG(dargs);
    args[n++] = MOECL_ARG_LOCAL(cols_bytes);
    args[n++] = MOECL_ARG_LOCAL(cols_bytes);
    moecl_step steps[2];
    int count = 0;
    if (!reused || !ctx->scratch_ticket_zero)
        steps[count++] = (moecl_step){0, NULL, 0, 0, 0, scratch, 0, 4, "the route dispatch ticket", NULL};
    steps[count++] = (moecl_step){0, args, n, groups * p->local, p->local, NULL, 0, 0, NULL, NULL};
    st = moecl_plan_run(ctx, p, steps, count, num_wait, wait, done);
    if (reused)
        ctx->scratch_ticket_zero = st == MOECL_SUCCESS;
    moecl_scratch_release(ctx, scratch);
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
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS)
        return st;
    const moecl_plan *one;
    if ((st = one_kernel_plan(ctx, desc, bias.mem != NULL, &one)) != MOECL_SUCCESS)
        return st;
    if (one)
        return enqueue_one_kernel(ctx, desc, block_size, one, &b, num_wait, wait, done);
    if ((st = check_align_buffers(ctx, &align, &b)) != MOECL_SUCCESS)
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
    const moecl_plan *p, *one;
    if ((st = moecl_topk_gating_plan(ctx, desc, bias != NULL, false, &p)) != MOECL_SUCCESS ||
        (st = moecl_moe_align_plan(ctx, &p)) != MOECL_SUCCESS ||
        (st = one_kernel_plan(ctx, desc, bias != NULL, &one)) != MOECL_SUCCESS)
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
        st = one ? enqueue_one_kernel(ctx, desc, block_size, one, &b, 0, NULL, &ran)
                 : enqueue(ctx, desc, &align, &b, 0, NULL, &ran);
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
