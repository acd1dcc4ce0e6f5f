/* Routing through to dispatch in one call (docs/routing.md, "Routing
 * through to dispatch"), from logits (moecl_route_dispatch: top-k gating)
 * or from the grounded router's inputs (moecl_grounded_route_dispatch):
 * for decode-sized routings on the routing's team kernel, one launch of
 * that kernel built with ROUTE_DISPATCH (each work-group routes its rows,
 * then takes them as its chunk of moe_align_fused: cl/common.cl,
 * cl/moe_align.cl); otherwise the routing call, then moe_align on its
 * topk_ids, enqueued back to back. Everything either way could refuse is
 * checked before the first enqueue, so bad input changes no output. The
 * two functions share every step but the routing's (route_step).
 * moecl_route_dispatch_ex adds top-k's valid count and load counter (in
 * the routing kernel, either path) and moe_align's expert map (the two
 * calls only); moecl_route_dispatch is it without them. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

/* The routing step of a call: top-k gating's (topk) or, where is_grounded,
 * the grounded router's (grounded), either desc possibly NULL until
 * validated; whether top-k has a bias; the inputs (gating and bias; or
 * token_hidden, router_logits and expert_ground) and outputs. The two
 * functions differ only here. */
typedef struct route_step {
    bool is_grounded, has_bias;
    const moecl_topk_gating_desc *topk;
    const moecl_grounded_router_desc *grounded;
    moecl_buffer in[3];
    moecl_buffer weights, ids;
    /* moecl_route_dispatch_ex's (top-k only): absent ones have mem NULL;
     * num_local 0 without a map. */
    moecl_buffer load, valid, map;
    uint32_t num_local;
} route_step;

/* moe_align's outputs. */
typedef struct dispatch_buffers {
    moecl_buffer counts, sorted, blocks, post, slots, invalid;
} dispatch_buffers;

static uint32_t step_tokens(const route_step *s)
{
    return s->is_grounded ? s->grounded->num_tokens : s->topk->num_tokens;
}
/* The slots of a token and the experts the ids range over, as moe_align
 * sees them: with the routing's shared experts (validated first). */
static uint32_t step_top_k(const route_step *s)
{
    return s->is_grounded ? moecl_grounded_row_slots(s->grounded) : moecl_topk_row_slots(s->topk);
}
static uint32_t step_experts(const route_step *s)
{
    return s->is_grounded ? moecl_grounded_id_experts(s->grounded) : moecl_topk_id_experts(s->topk);
}
static uint32_t step_shared(const route_step *s)
{
    return s->is_grounded ? s->grounded->num_shared_experts : s->topk->num_shared_experts;
}
/* The columns of the routing's logits. */
static uint32_t step_logit_experts(const route_step *s)
{
    return s->is_grounded ? s->grounded->num_experts : s->topk->num_experts;
}

/* The element size of topk_weights. */
static size_t step_weights_size(const route_step *s)
{
    return moecl_dtype_size(s->is_grounded ? s->grounded->weights_dtype : s->topk->weights_dtype);
}

/* The context and both descriptors' checks; *align receives moe_align's
 * descriptor. */
static moecl_status validate(moecl_context *ctx, const route_step *s, uint32_t block_size, moecl_moe_align_desc *align)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st =
        s->is_grounded ? moecl_grounded_router_validate(ctx, s->grounded) : moecl_topk_gating_validate(ctx, s->topk);
    if (st != MOECL_SUCCESS)
        return st;
    /* moe_align reads int32 ids, in both paths. */
    const moecl_index_dtype ids_dtype = s->is_grounded ? s->grounded->ids_dtype : s->topk->ids_dtype;
    if (ids_dtype != MOECL_I32)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "ids_dtype is %d; route dispatch writes int32 ids (MOECL_I32), which moe_align reads: "
                          "call %s for int64 ids",
                          (int)ids_dtype, s->is_grounded ? "moecl_grounded_router()" : "moecl_topk_gating()");
    const bool has_map = s->map.mem != NULL;
    /* The map is over the routed experts, which a shared slot's id is not. */
    if (has_map && step_shared(s))
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "num_shared_experts is %u with an expert_map; the map covers the routed experts only: "
                          "append shared experts without a map",
                          step_shared(s));
    if (has_map && s->num_local == 0)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "expert_map is given but num_local_experts is 0: set it to this rank's expert count");
    if (has_map && s->num_local > MOECL_MAX_EXPERTS)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "num_local_experts is %u; it must be in 1..%u",
                          s->num_local, MOECL_MAX_EXPERTS);
    if (!has_map && s->num_local != 0)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "num_local_experts is %u but expert_map is absent; it must be 0 without a map",
                          s->num_local);
    *align = moecl_moe_align_desc_init(step_tokens(s), step_top_k(s), has_map ? s->num_local : step_experts(s),
                                       block_size);
    if (has_map)
        align->num_global_experts = step_experts(s);
    return moecl_moe_align_validate(ctx, align);
}

/* moe_align's outputs, which the routing call does not check (it checks
 * its own buffers before it enqueues anything), and the routing outputs
 * both functions require (the grounded router alone would take either). */
static moecl_status check_align_buffers(moecl_context *ctx, const moecl_moe_align_desc *d, const route_step *s,
                                        const dispatch_buffers *b)
{
    const uint64_t slots = (uint64_t)d->num_tokens * d->top_k * 4, max_padded = moecl_moe_align_max_padded(d);
    const size_t w_size = step_weights_size(s);
    moecl_status st;
    if ((st = moecl_check_buffer(ctx, "topk_weights", s->weights, slots / 4 * w_size, w_size, true)) ||
        (st = moecl_check_buffer(ctx, "topk_ids", s->ids, slots, 4, true)) ||
        (st = moecl_check_buffer(ctx, "expert_counts", b->counts, (uint64_t)d->num_experts * 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "sorted_token_ids", b->sorted, max_padded * 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "block_expert_ids", b->blocks, max_padded / d->block_size * 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "num_tokens_post_padded", b->post, 4, 4, true)) ||
        (st = moecl_check_buffer(ctx, "slot_positions", b->slots, slots, 4, false)) ||
        (st = moecl_check_buffer(ctx, "num_invalid", b->invalid, 4, 4, false)))
        return st;
    return MOECL_SUCCESS;
}

/* moecl_route_dispatch_ex's own tensors, which either path reads: checked
 * before anything is enqueued (moe_align would check the map only after
 * top-k's kernel). */
static moecl_status check_ex_buffers(moecl_context *ctx, const route_step *s)
{
    const uint64_t e = step_experts(s), load = s->map.mem ? s->num_local : e;
    moecl_status st;
    if ((st = moecl_check_buffer(ctx, "expert_load", s->load, load * 4, 4, false)) ||
        (st = moecl_check_buffer(ctx, "num_valid_tokens", s->valid, 4, 4, false)) ||
        (st = moecl_check_buffer(ctx, "expert_map", s->map, e * 4, 4, false)))
        return st;
    return MOECL_SUCCESS;
}

/* The routing call alone (the two calls' first). */
static moecl_status enqueue_routing(moecl_context *ctx, const route_step *s, cl_uint num_wait, const cl_event *wait,
                                    cl_event *done)
{
    if (!s->is_grounded) {
        moecl_topk_gating_tensors t;
        memset(&t, 0, sizeof(t));
        t.struct_size = sizeof(t);
        t.gating = s->in[0];
        t.bias = s->in[1];
        t.topk_weights = s->weights;
        t.topk_ids = s->ids;
        t.expert_load = s->load;
        t.num_valid_tokens = s->valid;
        return moecl_topk_gating_ex_mapped(ctx, s->topk, &t, s->map, s->num_local, num_wait, wait, done);
    }
    return moecl_grounded_router(ctx, s->grounded, s->in[0], s->in[1], s->in[2], (moecl_buffer){NULL, 0}, s->weights,
                                 s->ids, num_wait, wait, done);
}

/* The routing call's own plan (built before anything is enqueued). */
static moecl_status routing_plan(moecl_context *ctx, const route_step *s, const moecl_plan **plan)
{
    if (!s->is_grounded)
        return moecl_topk_gating_ex_plan(ctx, s->topk, s->has_bias, s->load.mem != NULL, s->valid.mem != NULL,
                                         s->map.mem ? s->num_local : 0, plan);
    return moecl_grounded_router_plan(ctx, s->grounded, false, true, true, plan);
}

/* The two calls. moe_align's kernels are built first, so that a build
 * failure enqueues nothing; on an out-of-order queue moe_align waits on
 * the routing kernel's event. If moe_align fails after the routing was
 * enqueued, the routing kernel is waited for before the error returns. */
static moecl_status enqueue(moecl_context *ctx, const route_step *s, const moecl_moe_align_desc *align,
                            const dispatch_buffers *b, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const moecl_plan *p;
    moecl_status st = moecl_moe_align_plan(ctx, s->map.mem != NULL, &p);
    if (st != MOECL_SUCCESS)
        return st;
    cl_event routed = NULL;
    st = enqueue_routing(ctx, s, num_wait, wait, ctx->in_order ? NULL : &routed);
    if (st != MOECL_SUCCESS)
        return st;
    const moecl_moe_align_tensors t = {sizeof(t), s->ids,  b->counts,  b->sorted, b->blocks,
                                       b->post,   b->slots, b->invalid, s->map};
    st = moecl_moe_align_ex(ctx, align, &t, routed ? 1 : 0, routed ? &routed : NULL, done);
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

/* The routing kernel's local memory at its configuration (team, rows),
 * without the epilogue's. */
static size_t routing_team_local(const route_step *s, unsigned team, unsigned rows)
{
    if (!s->is_grounded)
        return moecl_layout_topk_team_local(team, rows, s->topk->num_experts, s->topk->top_k,
                                            s->topk->num_expert_groups, true, false);
    return moecl_grounded_router_team_local(s->grounded, team, rows);
}

/* Whether the one kernel serves the call, and its plan: some tokens, at
 * most the device table's slots (its last work-group places every slot,
 * as moe_align_fused's does, its work-items in parallel; the override's
 * align=fused or fused-parallel asks for it up to the table's forced
 * limit: the ids are this launch's own, so no work-group but the last
 * can know them all, and the parallel kernel's scheme, each work-group
 * counting every id, does not apply), the routing on its team kernel,
 * no override (align=) forcing another path, the device's work-group limit and
 * local memory (the team's rows, then moe_align_fused's two arrays of
 * E + 1 words and its compiled-in ones). */
static moecl_status one_kernel_plan(moecl_context *ctx, const route_step *s, const moecl_plan **plan)
{
    *plan = NULL;
    const uint64_t slots = (uint64_t)step_tokens(s) * step_top_k(s);
    const moecl_align_path forced = ctx->info.env.align_path;
    const bool fused = forced == MOECL_ALIGN_FUSED || forced == MOECL_ALIGN_FUSED_PARALLEL;
    const uint64_t cap = ctx->params.value[fused ? MOECL_DP_ROUTE_ONE_KERNEL_FORCED_MAX_SLOTS
                                                 : MOECL_DP_ROUTE_ONE_KERNEL_MAX_SLOTS];
    /* The map is read by moe_align's kernels only (HAS_MAP), not by the
     * epilogue: a mapped call takes the two calls. */
    if (slots == 0 || slots > cap || forced == MOECL_ALIGN_ONE_GROUP || forced == MOECL_ALIGN_CHUNKED || s->map.mem)
        return MOECL_SUCCESS;
    const moecl_plan *p;
    /* The configuration, which the optional tensors do not change. */
    moecl_status st = s->is_grounded ? moecl_grounded_router_plan(ctx, s->grounded, false, true, true, &p)
                                     : moecl_topk_gating_plan(ctx, s->topk, s->has_bias, false, &p);
    if (st != MOECL_SUCCESS || p->config.kernel != MOECL_KERNEL_TEAM)
        return st;
    const unsigned team = p->config.team, rows = p->config.rows, wg = team * rows;
    const size_t local = routing_team_local(s, team, rows) + moecl_layout_moe_align_fused_local(step_experts(s), wg);
    if (local + 1024 > ctx->info.local_mem_size)
        return MOECL_SUCCESS;
    st = s->is_grounded ? moecl_grounded_router_route_plan(ctx, s->grounded, &p)
                        : moecl_topk_gating_route_plan(ctx, s->topk, s->has_bias, s->load.mem != NULL,
                                                     s->valid.mem != NULL, &p);
    if (st != MOECL_SUCCESS)
        return st;
    if (p->limits[0] && p->limits[0] < p->local)
        return MOECL_SUCCESS; /* register use: the two calls serve it */
    /* A slot's column and its rank in its work-group's slots share a word
     * (cl/layout.h); every shape the descriptors admit fits. */
    if (step_experts(s) + 1 >= (1u << LAYOUT_DISPATCH_COLUMN_BITS) ||
        (uint64_t)p->rows_per_group * step_top_k(s) > (1u << (32 - LAYOUT_DISPATCH_COLUMN_BITS)))
        return MOECL_SUCCESS;
    *plan = p;
    return MOECL_SUCCESS;
}

/* The routing kernel's own arguments in the one kernel, and what they
 * point to. */
typedef struct routing_args {
    moecl_buffer_check checks[6];
    layout_topk_args scalars;
    moecl_grounded_binding grounded;
} routing_args;

static cl_uint bind_routing(const route_step *s, routing_args *r, moecl_kernel_arg *args)
{
    cl_uint n = 0;
    if (s->is_grounded) {
        const moecl_buffer buffers[MOECL_GROUNDED_BUFFERS] = {s->in[0], s->in[1],   s->in[2], {NULL, 0},
                                                              {NULL, 0}, s->weights, s->ids};
        moecl_grounded_router_bind(s->grounded, buffers, MOECL_I32, true, true, true, &r->grounded);
        for (; n < r->grounded.num_args; n++)
            args[n] = r->grounded.args[n];
        return n;
    }
    const moecl_topk_gating_desc *d = s->topk;
    const uint64_t t = d->num_tokens, e = d->num_experts, k = moecl_topk_row_slots(d);
    const size_t in_size = moecl_dtype_size(d->gating_dtype), bias_size = moecl_dtype_size(d->bias_dtype);
    const size_t w_size = moecl_dtype_size(d->weights_dtype);
    const moecl_buffer *b = s->in;
    r->checks[0] = (moecl_buffer_check){"gating", t * e * in_size, b[0].offset, in_size, true};
    r->checks[1] = (moecl_buffer_check){"bias", e * bias_size, b[1].offset, bias_size, false};
    r->checks[2] = (moecl_buffer_check){"topk_weights", t * k * w_size, s->weights.offset, w_size, true};
    r->checks[3] = (moecl_buffer_check){"topk_ids", t * k * 4, s->ids.offset, 4, true};
    r->checks[4] = (moecl_buffer_check){"expert_load", e * 4, s->load.offset, 4, false};
    r->checks[5] = (moecl_buffer_check){"num_valid_tokens", 4, s->valid.offset, 4, false};
    r->scalars = (layout_topk_args){.gating_off = b[0].offset / in_size,
                                    .bias_off = b[1].offset / bias_size,
                                    .weights_off = s->weights.offset / w_size,
                                    .ids_off = s->ids.offset / 4,
                                    .load_off = s->load.offset / 4,
                                    .valid_off = s->valid.offset / 4,
                                    .num_tokens = d->num_tokens,
                                    .scaling_factor = d->routed_scaling_factor};
    args[n++] = MOECL_ARG_CHECKED(b[0].mem, &r->checks[0]);
    if (b[1].mem)
        args[n++] = MOECL_ARG_CHECKED(b[1].mem, &r->checks[1]);
    args[n++] = MOECL_ARG_CHECKED(s->weights.mem, &r->checks[2]);
    args[n++] = MOECL_ARG_CHECKED(s->ids.mem, &r->checks[3]);
    /* cl/topk_gating.cl's LOAD_PARAM, VALID_PARAM: arguments only where given. */
    if (s->load.mem)
        args[n++] = MOECL_ARG_CHECKED(s->load.mem, &r->checks[4]);
    if (s->valid.mem)
        args[n++] = MOECL_ARG_CHECKED(s->valid.mem, &r->checks[5]);
    args[n++] = MOECL_ARG(r->scalars);
    return n;
}

/* The one launch: the routing kernel's arguments, then the epilogue's
 * (DISPATCH_PARAMS, cl/common.cl). Its scratch (the context's, as
 * moe_align's fused path uses it): the ticket, the count matrix and its
 * prefixes, a slot's rank and column in one word per slot; the ticket is zeroed first
 * where it may not be 0. */
static moecl_status enqueue_one_kernel(moecl_context *ctx, const route_step *s, uint32_t block_size,
                                       const moecl_plan *p, const dispatch_buffers *b, cl_uint num_wait,
                                       const cl_event *wait, cl_event *done)
{
    const uint64_t t = step_tokens(s), e = step_experts(s), k = step_top_k(s);
    const moecl_moe_align_desc align = moecl_moe_align_desc_init(t, k, e, block_size);
    const uint64_t max_padded = moecl_moe_align_max_padded(&align);
    const size_t groups = (t + p->rows_per_group - 1) / p->rows_per_group;
    const size_t scratch_bytes = (1 + 2 * groups * (e + 1) + t * k) * 4;
    cl_mem scratch;
    moecl_status st = moecl_scratch_acquire(ctx, scratch_bytes, &scratch);
    if (st != MOECL_SUCCESS)
        return st;
    const bool reused = ctx->in_order && ctx->scratch_lock_ready;
    const moecl_buffer_check checks[] = {{"expert_counts", e * 4, b->counts.offset, 4, true},
                                         {"sorted_token_ids", max_padded * 4, b->sorted.offset, 4, true},
                                         {"block_expert_ids", max_padded / block_size * 4, b->blocks.offset, 4, true},
                                         {"num_tokens_post_padded", 4, b->post.offset, 4, true},
                                         {"slot_positions", t * k * 4, b->slots.offset, 4, false},
                                         {"num_invalid", 4, b->invalid.offset, 4, false}};
    const layout_dispatch_args dargs = {b->counts.offset / 4, b->sorted.offset / 4, b->blocks.offset / 4,
                                        b->post.offset / 4,   b->slots.offset / 4,  b->invalid.offset / 4,
                                        block_size,           b->slots.mem != NULL, b->invalid.mem != NULL, 0};
    const size_t cols_bytes = moecl_layout_moe_align_cols((unsigned)e);
    routing_args routing;
    moecl_kernel_arg args[MOECL_MAX_KERNEL_ARGS];
    cl_uint n = bind_routing(s, &routing, args);
    args[n++] = MOECL_ARG_MEM(scratch);
    const moecl_buffer *outs[] = {&b->counts, &b->sorted, &b->blocks, &b->post, &b->slots, &b->invalid};
    for (int i = 0; i < 6; i++)
        args[n++] = MOECL_ARG_CHECKED(outs[i]->mem, &checks[i]);
    args[n++] = MOECL_ARG(dargs);
    args[n++] = MOECL_ARG_LOCAL(cols_bytes);
    args[n++] = MOECL_ARG_LOCAL(cols_bytes);
    moecl_step steps[2];
    int count = 0;
    if (!reused || ctx->scratch_zero_words < 1)
        steps[count++] = (moecl_step){0, NULL, 0, 0, 0, scratch, 0, 4, "the route dispatch ticket", NULL};
    steps[count++] = (moecl_step){0, args, n, groups * p->local, p->local, NULL, 0, 0, NULL, NULL};
    st = moecl_plan_run(ctx, p, steps, count, num_wait, wait, done);
    if (reused)
        ctx->scratch_zero_words = st == MOECL_SUCCESS ? 1 : 0; /* its ticket, word 0 */
    moecl_scratch_release(ctx, scratch);
    return st;
}

/* Either function on device buffers. */
static moecl_status route_dispatch(moecl_context *ctx, const route_step *s, uint32_t block_size,
                                   const dispatch_buffers *b, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    moecl_moe_align_desc align;
    moecl_status st = validate(ctx, s, block_size, &align);
    if (st != MOECL_SUCCESS)
        return st;
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS ||
        (st = check_ex_buffers(ctx, s)) != MOECL_SUCCESS)
        return st;
    const moecl_plan *one;
    if ((st = one_kernel_plan(ctx, s, &one)) != MOECL_SUCCESS)
        return st;
    if (one)
        return enqueue_one_kernel(ctx, s, block_size, one, b, num_wait, wait, done);
    if ((st = check_align_buffers(ctx, &align, s, b)) != MOECL_SUCCESS)
        return st;
    return enqueue(ctx, s, &align, b, num_wait, wait, done);
}

/* Either function on host memory: the inputs' pointers (in the order of
 * route_step's in), the outputs', and moecl_route_dispatch_ex's, in a
 * blocking call. */
typedef struct host_outputs {
    void *weights;
    int32_t *ids, *counts, *sorted, *blocks, *post, *slots, *invalid;
    int32_t *load; /* copied in and back: the call adds to it */
    const int32_t *valid, *map;
} host_outputs;

static moecl_status route_dispatch_host(moecl_context *ctx, route_step *s, uint32_t block_size,
                                        const void *const in[3], const host_outputs *o)
{
    /* Only presence matters to the checks and plans before the buffers
     * exist: a placeholder stands for each given host array. */
    cl_mem given = (cl_mem)(uintptr_t)1;
    s->load = (moecl_buffer){o->load ? given : NULL, 0};
    s->valid = (moecl_buffer){o->valid ? given : NULL, 0};
    s->map = (moecl_buffer){o->map ? given : NULL, 0};
    moecl_moe_align_desc align;
    moecl_status st = validate(ctx, s, block_size, &align);
    if (st != MOECL_SUCCESS)
        return st;
    enum { IN0, IN1, IN2, VALID, MAP, WEIGHTS, IDS, COUNTS, SORTED, BLOCKS, POST, SLOTS, INVALID, LOAD, NUM };
    const uint64_t t = step_tokens(s), e = step_logit_experts(s), slots = t * step_top_k(s) * 4;
    const bool tokens = t > 0;
    const uint64_t max_padded = moecl_moe_align_max_padded(&align);
    /* The inputs: top-k's gating and its optional bias; the grounded
     * router's three, all required. */
    static const char *const topk_names[3] = {"gating", "bias", NULL};
    static const char *const grounded_names[3] = {"token_hidden", "router_logits", "expert_ground"};
    const char *const *in_names = s->is_grounded ? grounded_names : topk_names;
    uint64_t in_bytes[3] = {0, 0, 0};
    if (!s->is_grounded) {
        in_bytes[0] = t * e * moecl_dtype_size(s->topk->gating_dtype);
        in_bytes[1] = in[1] ? e * moecl_dtype_size(s->topk->bias_dtype) : 0;
    } else {
        const uint64_t h = s->grounded->hidden_dim, in_size = moecl_dtype_size(s->grounded->hidden_dtype);
        in_bytes[0] = t * h * in_size;
        in_bytes[1] = moecl_grounded_logit_rows(s->grounded) * e * 4;
        in_bytes[2] = e * h * in_size;
    }
    const char *missing = NULL;
    for (int i = 0; i < 3 && !missing; i++)
        if (tokens && in_names[i] && (s->is_grounded || i == IN0) && !in[i])
            missing = in_names[i];
    if (!missing)
        missing = tokens && !o->weights                     ? "topk_weights"
                  : tokens && !o->ids                       ? "topk_ids"
                  : !o->counts                              ? "expert_counts"
                  : !o->sorted && max_padded                ? "sorted_token_ids"
                  : !o->blocks && max_padded >= block_size  ? "block_expert_ids"
                  : !o->post                                ? "num_tokens_post_padded"
                                                            : NULL;
    if (missing)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    const moecl_plan *p, *one;
    if ((st = routing_plan(ctx, s, &p)) != MOECL_SUCCESS ||
        (st = moecl_moe_align_plan(ctx, o->map != NULL, &p)) != MOECL_SUCCESS)
        return st; /* built before the buffers are made: a build failure costs no copy */
    if ((st = one_kernel_plan(ctx, s, &one)) != MOECL_SUCCESS)
        return st;
    /* At least 4 bytes: OpenCL refuses empty buffers. */
    const uint64_t bytes[NUM] = {in_bytes[0],    in_bytes[1],
                                 in_bytes[2],    4,
                                 e * 4,          slots / 4 * step_weights_size(s),
                                 slots,          (uint64_t)align.num_experts * 4,
                                 max_padded * 4, max_padded / block_size * 4,
                                 4,              slots,
                                 4,              (uint64_t)(o->map ? s->num_local : step_experts(s)) * 4};
    const void *const sources[NUM] = {tokens ? in[0] : NULL, tokens ? in[1] : NULL, tokens ? in[2] : NULL,
                                      o->valid, o->map, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, o->load};
    void *outputs[NUM] = {NULL,      NULL,      NULL,    NULL,      NULL,       tokens ? o->weights : NULL,
                          tokens ? o->ids : NULL, o->counts, o->sorted, o->blocks, o->post, tokens ? o->slots : NULL,
                          o->invalid, o->load};
    for (int i = 0; i < NUM; i++)
        if (!bytes[i])
            outputs[i] = NULL; /* nothing to read (and sorted_token_ids may be NULL then) */
    static const char *const names[NUM] = {NULL, NULL, NULL, "num_valid_tokens", "expert_map", "topk_weights",
                                           "topk_ids", "expert_counts", "sorted_token_ids", "block_expert_ids",
                                           "num_tokens_post_padded", "slot_positions", "num_invalid", "expert_load"};
    cl_mem m[NUM] = {NULL};
    for (int i = 0; i < NUM && st == MOECL_SUCCESS; i++) {
        const bool input = i < WEIGHTS;
        const bool wanted = i <= IN2 ? in_names[i] && (s->is_grounded || i == IN0 || in[i])
                            : i == VALID ? o->valid != NULL
                            : i == MAP   ? o->map != NULL
                            : i == LOAD  ? o->load != NULL
                                         : (i != SLOTS || o->slots) && (i != INVALID || o->invalid);
        if (wanted)
            st = moecl_host_buffer(ctx, i <= IN2 ? in_names[i] : names[i],
                                   input ? CL_MEM_READ_ONLY : CL_MEM_READ_WRITE, (size_t)(bytes[i] ? bytes[i] : 4),
                                   sources[i], &m[i]);
    }
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS) {
        for (int i = 0; i < 3; i++)
            s->in[i] = (moecl_buffer){m[i], 0};
        s->weights = (moecl_buffer){m[WEIGHTS], 0};
        s->ids = (moecl_buffer){m[IDS], 0};
        s->load = (moecl_buffer){m[LOAD], 0};
        s->valid = (moecl_buffer){m[VALID], 0};
        s->map = (moecl_buffer){m[MAP], 0};
        const dispatch_buffers b = {{m[COUNTS], 0}, {m[SORTED], 0}, {m[BLOCKS], 0},
                                    {m[POST], 0},   {m[SLOTS], 0},  {m[INVALID], 0}};
        st = one ? enqueue_one_kernel(ctx, s, block_size, one, &b, 0, NULL, &ran)
                 : enqueue(ctx, s, &align, &b, 0, NULL, &ran);
    }
    size_t sizes[NUM - WEIGHTS];
    for (int i = WEIGHTS; i < NUM; i++)
        sizes[i - WEIGHTS] = (size_t)bytes[i];
    return moecl_host_call_end(ctx, st, ran, m, NUM, WEIGHTS, sizes, outputs);
}

/* The first version of the tensors records: each ends at num_local_experts. */
#define TENSORS_V1 (offsetof(moecl_route_dispatch_tensors, num_local_experts) + sizeof(uint32_t))
#define HOST_TENSORS_V1 (offsetof(moecl_route_dispatch_host_tensors, num_local_experts) + sizeof(uint32_t))

/* The checks before a record is read: ctx, then the record's own. */
static moecl_status check_record(moecl_context *ctx, const void *record, size_t struct_size, size_t first,
                                 size_t known)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    return moecl_check_record(ctx, record, struct_size, first, known);
}

moecl_status moecl_route_dispatch_ex(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                                     const moecl_route_dispatch_tensors *tensors, cl_uint num_wait,
                                     const cl_event *wait, cl_event *done)
{
    const moecl_status st = check_record(ctx, tensors, tensors ? tensors->struct_size : 0, TENSORS_V1,
                                         sizeof(moecl_route_dispatch_tensors));
    if (st != MOECL_SUCCESS)
        return st;
    const moecl_route_dispatch_tensors *t = tensors;
    const route_step s = {false,           t->bias.mem != NULL, desc,       NULL, {t->gating, t->bias, {NULL, 0}},
                          t->topk_weights, t->topk_ids,         t->expert_load, t->num_valid_tokens, t->expert_map,
                          t->num_local_experts};
    const dispatch_buffers b = {t->expert_counts,          t->sorted_token_ids, t->block_expert_ids,
                                t->num_tokens_post_padded, t->slot_positions,   t->num_invalid};
    return route_dispatch(ctx, &s, block_size, &b, num_wait, wait, done);
}

moecl_status moecl_route_dispatch(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                                  moecl_buffer gating, moecl_buffer bias, moecl_buffer topk_weights,
                                  moecl_buffer topk_ids, moecl_buffer expert_counts, moecl_buffer sorted_token_ids,
                                  moecl_buffer block_expert_ids, moecl_buffer num_tokens_post_padded,
                                  moecl_buffer slot_positions, moecl_buffer num_invalid, cl_uint num_wait,
                                  const cl_event *wait, cl_event *done)
{
    const moecl_route_dispatch_tensors t = {.struct_size = sizeof(t),
                                            .gating = gating,
                                            .bias = bias,
                                            .topk_weights = topk_weights,
                                            .topk_ids = topk_ids,
                                            .expert_counts = expert_counts,
                                            .sorted_token_ids = sorted_token_ids,
                                            .block_expert_ids = block_expert_ids,
                                            .num_tokens_post_padded = num_tokens_post_padded,
                                            .slot_positions = slot_positions,
                                            .num_invalid = num_invalid};
    return moecl_route_dispatch_ex(ctx, desc, block_size, &t, num_wait, wait, done);
}

moecl_status moecl_route_dispatch_ex_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                                          const moecl_route_dispatch_host_tensors *tensors)
{
    const moecl_status st = check_record(ctx, tensors, tensors ? tensors->struct_size : 0, HOST_TENSORS_V1,
                                         sizeof(moecl_route_dispatch_host_tensors));
    if (st != MOECL_SUCCESS)
        return st;
    const moecl_route_dispatch_host_tensors *h = tensors;
    route_step s = {false, h->bias != NULL, desc, NULL, {{NULL, 0}, {NULL, 0}, {NULL, 0}}, {NULL, 0}, {NULL, 0},
                    {NULL, 0}, {NULL, 0}, {NULL, 0}, h->num_local_experts};
    const void *const in[3] = {h->gating, h->bias, NULL};
    const host_outputs o = {h->topk_weights,     h->topk_ids,         h->expert_counts,
                            h->sorted_token_ids, h->block_expert_ids, h->num_tokens_post_padded,
                            h->slot_positions,   h->num_invalid,      h->expert_load,
                            h->num_valid_tokens, h->expert_map};
    return route_dispatch_host(ctx, &s, block_size, in, &o);
}

moecl_status moecl_route_dispatch_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                                       const void *gating, const void *bias, void *topk_weights, int32_t *topk_ids,
                                       int32_t *expert_counts, int32_t *sorted_token_ids, int32_t *block_expert_ids,
                                       int32_t *num_tokens_post_padded, int32_t *slot_positions, int32_t *num_invalid)
{
    const moecl_route_dispatch_host_tensors h = {sizeof(h),        gating,           bias,
                                                 topk_weights,     topk_ids,         expert_counts,
                                                 sorted_token_ids, block_expert_ids, num_tokens_post_padded,
                                                 slot_positions,   num_invalid,      NULL,
                                                 NULL,             NULL,             0};
    return moecl_route_dispatch_ex_host(ctx, desc, block_size, &h);
}

moecl_status moecl_grounded_route_dispatch(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                           uint32_t block_size, moecl_buffer token_hidden, moecl_buffer router_logits,
                                           moecl_buffer expert_ground, moecl_buffer topk_weights,
                                           moecl_buffer topk_ids, moecl_buffer expert_counts,
                                           moecl_buffer sorted_token_ids, moecl_buffer block_expert_ids,
                                           moecl_buffer num_tokens_post_padded, moecl_buffer slot_positions,
                                           moecl_buffer num_invalid, cl_uint num_wait, const cl_event *wait,
                                           cl_event *done)
{
    const route_step s = {true,     false,     NULL,      desc,      {token_hidden, router_logits, expert_ground},
                          topk_weights, topk_ids, {NULL, 0}, {NULL, 0}, {NULL, 0}, 0};
    const dispatch_buffers b = {expert_counts,          sorted_token_ids, block_expert_ids,
                                num_tokens_post_padded, slot_positions,   num_invalid};
    return route_dispatch(ctx, &s, block_size, &b, num_wait, wait, done);
}

moecl_status moecl_grounded_route_dispatch_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                                uint32_t block_size, const void *token_hidden,
                                                const float *router_logits, const void *expert_ground,
                                                void *topk_weights, int32_t *topk_ids, int32_t *expert_counts,
                                                int32_t *sorted_token_ids, int32_t *block_expert_ids,
                                                int32_t *num_tokens_post_padded, int32_t *slot_positions,
                                                int32_t *num_invalid)
{
    route_step s = {true,      false,     NULL,      desc,      {{NULL, 0}, {NULL, 0}, {NULL, 0}}, {NULL, 0}, {NULL, 0},
                    {NULL, 0}, {NULL, 0}, {NULL, 0}, 0};
    const void *const in[3] = {token_hidden, router_logits, expert_ground};
    const host_outputs o = {topk_weights,     topk_ids,  expert_counts,  sorted_token_ids,
                            block_expert_ids, num_tokens_post_padded, slot_positions, num_invalid,
                            NULL,             NULL,      NULL};
    return route_dispatch_host(ctx, &s, block_size, in, &o);
}
