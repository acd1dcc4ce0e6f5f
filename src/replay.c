/* Routing replay (moecl_topk_weights) and hash routing
 * (moecl_hash_routing), host side: validation, argument binding and one
 * enqueue of cl/replay.cl's kernel, whose variant and launch shape
 * src/topk_gating.c derives from top-k gating's; and the blocking
 * host-memory paths. */
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

enum { MODE_REPLAY = 1, MODE_HASH = 2 };

/* The buffers of a call, and whether binding validates them (the caller's
 * buffers; the host path's own need no check). ids: the given topk_ids
 * (replay) or input_ids (hash routing); out_ids: hash routing's topk_ids. */
typedef struct replay_buffers {
    moecl_buffer gating, ids, table, weights, out_ids;
    uint32_t vocab_size;
    bool check;
} replay_buffers;

static moecl_status validate(moecl_context *ctx, const moecl_topk_gating_desc *desc, unsigned mode,
                             uint32_t vocab_size)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = moecl_topk_gating_validate(ctx, desc);
    if (st == MOECL_SUCCESS && mode == MODE_HASH && (vocab_size < 1 || vocab_size > INT32_MAX))
        st = moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "vocab_size is %u; it must be in 1..INT32_MAX",
                        (unsigned)vocab_size);
    /* cl/replay.cl stores f32 weights and int32 ids only. */
    if (st == MOECL_SUCCESS && (desc->weights_dtype != MOECL_F32 || desc->ids_dtype != MOECL_I32))
        st = moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                        "weights_dtype is %d and ids_dtype %d; replay and hash routing write f32 weights "
                        "(MOECL_F32) and int32 ids (MOECL_I32)",
                        (int)desc->weights_dtype, (int)desc->ids_dtype);
    /* Given ids carry no shared slots: a replay's rows are the routed ones. */
    if (st == MOECL_SUCCESS && desc->num_shared_experts)
        st = moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                        "num_shared_experts is %u; replay and hash routing take none (0)",
                        (unsigned)desc->num_shared_experts);
    return st;
}

/* Bind and enqueue (src/plan.c through src/topk_gating.c). */
static moecl_status launch(moecl_context *ctx, const moecl_topk_gating_desc *d, unsigned mode,
                           const replay_buffers *b, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const uint64_t t = d->num_tokens, e = d->num_experts, k = d->top_k;
    const size_t in_size = moecl_dtype_size(d->gating_dtype);
    const bool hash = mode == MODE_HASH;
    const moecl_buffer_check checks[5] = {
        {"gating", t * e * in_size, b->gating.offset, in_size, true},
        {hash ? "input_ids" : "topk_ids", (hash ? t : t * k) * 4, b->ids.offset, 4, true},
        {"tid2eid", (uint64_t)b->vocab_size * k * 4, b->table.offset, 4, true},
        {"topk_weights", t * k * 4, b->weights.offset, 4, true},
        {"topk_ids", t * k * 4, b->out_ids.offset, 4, true}};
    const moecl_buffer_check *c = b->check ? checks : NULL;
    const layout_replay_args scalars = {b->gating.offset / in_size,
                                        b->ids.offset / 4,
                                        b->table.offset / 4,
                                        b->weights.offset / 4,
                                        b->out_ids.offset / 4,
                                        d->num_tokens,
                                        b->vocab_size,
                                        d->routed_scaling_factor,
                                        0};
    moecl_kernel_arg args[6];
    cl_uint n = 0;
    args[n++] = MOECL_ARG_CHECKED(b->gating.mem, c ? &c[0] : NULL);
    args[n++] = MOECL_ARG_CHECKED(b->ids.mem, c ? &c[1] : NULL);
    if (hash)
        args[n++] = MOECL_ARG_CHECKED(b->table.mem, c ? &c[2] : NULL);
    args[n++] = MOECL_ARG_CHECKED(b->weights.mem, c ? &c[3] : NULL);
    if (hash)
        args[n++] = MOECL_ARG_CHECKED(b->out_ids.mem, c ? &c[4] : NULL);
    args[n++] = MOECL_ARG(scalars);
    return moecl_topk_gating_replay_launch(ctx, d, mode, args, n, num_wait, wait, done);
}

static moecl_status device_call(moecl_context *ctx, const moecl_topk_gating_desc *desc, unsigned mode,
                                const replay_buffers *b, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    moecl_status st = validate(ctx, desc, mode, b->vocab_size);
    if (st == MOECL_SUCCESS)
        st = moecl_check_wait_list(ctx, num_wait, wait);
    return st == MOECL_SUCCESS ? launch(ctx, desc, mode, b, num_wait, wait, done) : st;
}

moecl_status moecl_topk_weights(moecl_context *ctx, const moecl_topk_gating_desc *desc, moecl_buffer gating,
                                moecl_buffer topk_ids, moecl_buffer topk_weights, cl_uint num_wait,
                                const cl_event *wait, cl_event *done)
{
    const replay_buffers b = {gating, topk_ids, {NULL, 0}, topk_weights, {NULL, 0}, 0, true};
    return device_call(ctx, desc, MODE_REPLAY, &b, num_wait, wait, done);
}

moecl_status moecl_hash_routing(moecl_context *ctx, const moecl_topk_gating_desc *desc, moecl_buffer gating,
                                moecl_buffer input_ids, moecl_buffer tid2eid, uint32_t vocab_size,
                                moecl_buffer topk_weights, moecl_buffer topk_ids, cl_uint num_wait,
                                const cl_event *wait, cl_event *done)
{
    const replay_buffers b = {gating, input_ids, tid2eid, topk_weights, topk_ids, vocab_size, true};
    return device_call(ctx, desc, MODE_HASH, &b, num_wait, wait, done);
}

/* The host-memory call of either op: the inputs copied into the call's
 * own buffers, the outputs read back. */
static moecl_status host_call(moecl_context *ctx, const moecl_topk_gating_desc *desc, unsigned mode,
                              const void *gating, const int32_t *ids, const int32_t *table, uint32_t vocab_size,
                              float *topk_weights, int32_t *topk_ids_out)
{
    moecl_status st = validate(ctx, desc, mode, vocab_size);
    if (st != MOECL_SUCCESS)
        return st;
    const bool hash = mode == MODE_HASH;
    const char *missing = NULL;
    if (hash && !table)
        missing = "tid2eid";
    else if (desc->num_tokens > 0)
        missing = !gating ? "gating" : !ids ? (hash ? "input_ids" : "topk_ids") : !topk_weights ? "topk_weights"
                                     : hash && !topk_ids_out ? "topk_ids" : NULL;
    if (missing)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    const moecl_plan *p;
    if ((st = moecl_topk_gating_replay_plan(ctx, desc, mode, &p)) != MOECL_SUCCESS)
        return st;
    (void)p; /* built before the buffers are made: a build failure costs no copy */
    if (desc->num_tokens == 0)
        return MOECL_SUCCESS;
    const size_t t = desc->num_tokens, e = desc->num_experts, k = desc->top_k;
    enum { GATING, IDS, TABLE, WEIGHTS, OUT_IDS, NUM };
    cl_mem m[NUM] = {NULL};
    if ((st = moecl_host_buffer(ctx, "gating", CL_MEM_READ_ONLY, t * e * moecl_dtype_size(desc->gating_dtype), gating,
                                &m[GATING])) == MOECL_SUCCESS &&
        (st = moecl_host_buffer(ctx, hash ? "input_ids" : "topk_ids", CL_MEM_READ_ONLY, (hash ? t : t * k) * 4, ids,
                                &m[IDS])) == MOECL_SUCCESS &&
        (!hash || (st = moecl_host_buffer(ctx, "tid2eid", CL_MEM_READ_ONLY, (size_t)vocab_size * k * 4, table,
                                          &m[TABLE])) == MOECL_SUCCESS) &&
        (st = moecl_host_buffer(ctx, "topk_weights", CL_MEM_WRITE_ONLY, t * k * 4, NULL, &m[WEIGHTS])) ==
            MOECL_SUCCESS &&
        hash)
        st = moecl_host_buffer(ctx, "topk_ids", CL_MEM_WRITE_ONLY, t * k * 4, NULL, &m[OUT_IDS]);
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS) {
        const replay_buffers b = {{m[GATING], 0},  {m[IDS], 0},      {m[TABLE], 0}, {m[WEIGHTS], 0},
                                  {m[OUT_IDS], 0}, vocab_size, false};
        st = launch(ctx, desc, mode, &b, 0, NULL, &ran);
    }
    const size_t sizes[2] = {t * k * 4, t * k * 4};
    void *const hosts[NUM] = {NULL, NULL, NULL, topk_weights, hash ? topk_ids_out : NULL};
    return moecl_host_call_end(ctx, st, ran, m, NUM, WEIGHTS, sizes, hosts);
}

moecl_status moecl_topk_weights_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, const void *gating,
                                     const int32_t *topk_ids, float *topk_weights)
{
    return host_call(ctx, desc, MODE_REPLAY, gating, topk_ids, NULL, 0, topk_weights, NULL);
}

moecl_status moecl_hash_routing_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, const void *gating,
                                     const int32_t *input_ids, const int32_t *tid2eid, uint32_t vocab_size,
                                     float *topk_weights, int32_t *topk_ids)
{
    return host_call(ctx, desc, MODE_HASH, gating, input_ids, tid2eid, vocab_size, topk_weights, topk_ids);
}
