/* Top-k gating, host side: validation, the kernel variant a request needs,
 * argument binding and one enqueue; and the blocking host-memory path. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

moecl_topk_gating_desc moecl_topk_gating_desc_init(uint32_t num_tokens, uint32_t num_experts, uint32_t top_k)
{
    moecl_topk_gating_desc d;
    memset(&d, 0, sizeof(d));
    d.num_tokens = num_tokens;
    d.num_experts = num_experts;
    d.top_k = top_k;
    d.num_expert_groups = 0;
    d.topk_group = 0;
    d.gating_dtype = MOECL_F32;
    d.scoring = MOECL_SCORING_SOFTMAX;
    d.group_score = MOECL_GROUP_SCORE_MAX;
    d.renormalize = false;
    d.routed_scaling_factor = 1.0f;
    d.renormalize_floor = 0.0f;
    d.group_fill = MOECL_GROUP_FILL_NEG_INF;
    return d;
}

static moecl_status validate_desc(moecl_context *ctx, const moecl_topk_gating_desc *d)
{
#define INVALID(...) moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, __VA_ARGS__)
    if (!d)
        return INVALID("desc is NULL");
    moecl_status st = moecl_check_experts_topk(ctx, d->num_experts, d->top_k);
    if (st != MOECL_SUCCESS)
        return st;
    if (d->num_expert_groups == 0) {
        if (d->topk_group != 0)
            return INVALID("topk_group is %u; it must be 0 when num_expert_groups is 0", d->topk_group);
    } else {
        if (d->num_expert_groups > d->num_experts || d->num_experts % d->num_expert_groups != 0)
            return INVALID("num_expert_groups is %u; it must divide num_experts (%u)", d->num_expert_groups,
                           d->num_experts);
        if (d->topk_group < 1 || d->topk_group > d->num_expert_groups)
            return INVALID("topk_group is %u; it must be in 1..num_expert_groups (%u)", d->topk_group,
                           d->num_expert_groups);
        uint64_t reachable = (uint64_t)d->topk_group * (d->num_experts / d->num_expert_groups);
        if (d->top_k > reachable)
            return INVALID("top_k is %u but the %u kept groups of %u experts hold only %llu", d->top_k,
                           d->topk_group, d->num_experts / d->num_expert_groups, (unsigned long long)reachable);
    }
    if ((unsigned)d->gating_dtype > MOECL_BF16)
        return INVALID("gating_dtype is %d; it must be MOECL_F32, MOECL_F16 or MOECL_BF16", (int)d->gating_dtype);
    if ((unsigned)d->scoring > MOECL_SCORING_SIGMOID)
        return INVALID("scoring is %d; it must be MOECL_SCORING_SOFTMAX or MOECL_SCORING_SIGMOID", (int)d->scoring);
    if ((unsigned)d->group_score > MOECL_GROUP_SCORE_TOP2_SUM)
        return INVALID("group_score is %d; it must be MOECL_GROUP_SCORE_MAX or MOECL_GROUP_SCORE_TOP2_SUM",
                       (int)d->group_score);
    if (!isfinite(d->routed_scaling_factor))
        return INVALID("routed_scaling_factor is %g; it must be finite", (double)d->routed_scaling_factor);
    /* Subnormal floors are refused: a device without denormals would
     * flush one to 0 and divide as moecl's rule does, another not. */
    const float rf = d->renormalize_floor;
    if (!(rf == 0.0f || (isfinite(rf) && rf >= FLT_MIN)))
        return INVALID("renormalize_floor is %g; it must be 0 or a finite float >= FLT_MIN (2^-126)", (double)rf);
    if ((unsigned)d->group_fill > MOECL_GROUP_FILL_ZERO)
        return INVALID("group_fill is %d; it must be MOECL_GROUP_FILL_NEG_INF or MOECL_GROUP_FILL_ZERO",
                       (int)d->group_fill);
    return MOECL_SUCCESS;
#undef INVALID
}

typedef struct launch_shape {
    unsigned team, rows;
    bool shuffle; /* warp shuffles (inline PTX) for the team reductions */
    const char *kernel_name;
} launch_shape;

/* Local memory the team kernel needs for `rows` rows (mirrors the __local
 * arrays of topk_gating_team). */
static size_t team_local_bytes(unsigned team, unsigned rows, unsigned k, unsigned experts, unsigned groups)
{
    /* float_slots, chosen_weights and chosen_ids, then the top-k scratch
     * (common.cl). */
    const unsigned ept = (experts + team - 1) / team;
    size_t per_row = (size_t)team * 4 + (size_t)k * (4 + 4);
    per_row += moecl_team_topk_bytes(team, ept, k);
    if (groups)
        per_row += (size_t)experts * 4 + (size_t)groups * 9 + (team / groups >= 2 ? (size_t)team * 12 : 0);
    return per_row * rows;
}

/* The shape of a configuration from the table, the tune file or moecl-tune;
 * false when the device cannot run it (work-group size, local memory). */
static bool shape_of_config(const moecl_context *ctx, const moecl_launch_config *c, unsigned experts, unsigned k,
                            unsigned groups, launch_shape *shape)
{
    const moecl_device_info *info = &ctx->info;
    const bool pow2_rows = c->rows >= 1 && (c->rows & (c->rows - 1)) == 0;
    if (c->kernel == MOECL_KERNEL_ROWS && c->team == 1 && pow2_rows && c->rows <= info->max_work_group_size) {
        *shape = (launch_shape){1, c->rows, false, "topk_gating_rows"};
        return true;
    }
    size_t budget = moecl_local_budget(info);
    if (c->kernel != MOECL_KERNEL_TEAM || c->team < 2 || c->team > MOECL_LAUNCH_MAX_TEAM ||
        (c->team & (c->team - 1)) || !pow2_rows || (size_t)c->team * c->rows > info->max_work_group_size ||
        team_local_bytes(c->team, c->rows, k, experts, groups) > budget)
        return false;
    bool shuffle = info->ptx && c->team <= 32 && (c->team * c->rows) % 32 == 0;
    *shape = (launch_shape){c->team, c->rows, shuffle, "topk_gating_team"};
    return true;
}

/* The first configuration of the forced / tune file / table overrides
 * (launch.c orders them) that the device can run. */
static bool override_shape(const moecl_context *ctx, unsigned experts, unsigned k, unsigned groups,
                           launch_shape *shape, moecl_launch_source *source)
{
    const moecl_launch_key key = moecl_launch_key_topk(experts, k, groups);
    moecl_launch_config configs[MOECL_LAUNCH_MAX_OVERRIDES];
    moecl_launch_source sources[MOECL_LAUNCH_MAX_OVERRIDES];
    const unsigned n = moecl_launch_overrides(ctx, &key, configs, sources);
    for (unsigned i = 0; i < n; i++) {
        if (shape_of_config(ctx, &configs[i], experts, k, groups, shape)) {
            *source = sources[i];
            return true;
        }
    }
    *source = moecl_launch_default_source(&ctx->info, MOECL_OP_TOPK_GATING);
    return false;
}

/* An override that the device can run, else the rule computed from the
 * device facts. */
static launch_shape rule_launch(const moecl_device_info *info, unsigned experts, unsigned k, unsigned groups);

static launch_shape choose_launch(const moecl_context *ctx, unsigned experts, unsigned k, unsigned groups,
                                  moecl_launch_source *source)
{
    launch_shape chosen;
    if (override_shape(ctx, experts, k, groups, &chosen, source))
        return chosen;
    return rule_launch(&ctx->info, experts, k, groups);
}

/* The rule computed from the device facts alone. */
static launch_shape rule_launch(const moecl_device_info *info, unsigned experts, unsigned k, unsigned groups)
{
    launch_shape rows_kernel = {1, 8, false, "topk_gating_rows"};
    /* MOECL_TEAM asks for the team kernel unless MOECL_LAUNCH_CLASS=cpu. */
    if (info->launch_class == MOECL_LAUNCH_CPU && (!info->team_override || info->launch_class_forced))
        return rows_kernel;
    /* About eight elements per work-item, at most 256 work-items a row. */
    unsigned team = info->team_override ? info->team_override : moecl_pow2_at_least((experts + 7) / 8);
    if (team > 256)
        team = 256;
    while (team > 1 && team > info->max_work_group_size)
        team >>= 1;
    if (team == 1)
        return (launch_shape){1, 64, false, "topk_gating_rows"};
    unsigned rows = team >= 128 ? 1 : 128 / team;
    while (rows * team > info->max_work_group_size)
        rows >>= 1;
    size_t budget = moecl_local_budget(info);
    while (rows > 1 && team_local_bytes(team, rows, k, experts, groups) > budget)
        rows >>= 1;
    if (rows == 0 || team_local_bytes(team, rows, k, experts, groups) > budget)
        return rows_kernel; /* too big for local memory: the per-row loops serve every shape */
    /* Shuffles need teams inside a warp and work-groups of whole warps. */
    bool shuffle = info->ptx && team <= 32 && (team * rows) % 32 == 0;
    return (launch_shape){team, rows, shuffle, "topk_gating_team"};
}

/* Group limits that select nothing away are dropped: keeping every group
 * keeps everything, and groups of one expert rank exactly as the experts
 * do. Not the latter with the zero fill: a dropped expert then selects
 * with 0.0, which can beat a kept one (a negative biased score, or an
 * exact 0 of a higher index). */
static void effective_groups(const moecl_topk_gating_desc *d, unsigned *groups, unsigned *topk_group)
{
    *groups = d->num_expert_groups;
    *topk_group = d->topk_group;
    if (*groups && (*topk_group == *groups ||
                    (d->num_experts / *groups == 1 && d->group_fill != MOECL_GROUP_FILL_ZERO)))
        *groups = *topk_group = 0;
}

moecl_launch_source moecl_topk_gating_launch(const moecl_context *ctx, const moecl_topk_gating_desc *d,
                                             moecl_launch_key *key, moecl_launch_config *config)
{
    unsigned groups, topk_group;
    effective_groups(d, &groups, &topk_group);
    moecl_launch_source source;
    const launch_shape s = choose_launch(ctx, d->num_experts, d->top_k, groups, &source);
    *key = moecl_launch_key_topk(d->num_experts, d->top_k, groups);
    *config = (moecl_launch_config){s.team > 1 ? MOECL_KERNEL_TEAM : MOECL_KERNEL_ROWS, s.team, s.rows, 0};
    return source;
}

typedef struct prepared {
    moecl_variant *variant;
    launch_shape shape;
} prepared;

/* The launch shape and the -D defines of the variant that serves d: on
 * ctx (overrides, then the rule), or with ctx NULL on a device described
 * by info (the rule alone). */
static launch_shape variant_of(const moecl_context *ctx, const moecl_device_info *info,
                               const moecl_topk_gating_desc *d, bool has_bias, bool has_counts, char *defines,
                               size_t size)
{
    unsigned groups, topk_group;
    effective_groups(d, &groups, &topk_group);
    moecl_launch_source source;
    const launch_shape shape = ctx ? choose_launch(ctx, d->num_experts, d->top_k, groups, &source)
                                   : rule_launch(info, d->num_experts, d->top_k, groups);
    snprintf(defines, size,
             "-DNUM_EXPERTS=%u -DTOPK=%u -DIN_DTYPE=%d -DSCORING=%d -DHAS_BIAS=%d -DNUM_GROUPS=%u "
             "-DTOPK_GROUP=%u -DGROUP_SCORE=%d -DRENORMALIZE=%d -DTEAM=%u -DROWS=%u -DTEAM_SHUFFLE=%d -DEPT=%u "
             "-DCPU_DEVICE=%d",
             d->num_experts, d->top_k, (int)d->gating_dtype, (int)d->scoring, has_bias ? 1 : 0, groups, topk_group,
             groups ? (int)d->group_score : 0, d->renormalize ? 1 : 0, shape.team, shape.rows, shape.shuffle ? 1 : 0,
             (d->num_experts + shape.team - 1) / shape.team,
             (info->type & CL_DEVICE_TYPE_CPU) ? 1 : 0);
    /* Appended only when set: the defines, and so the kernels and
     * disk-cache entries, of requests that use none of these are what
     * they were before each was added. The floor is a hex literal, so the
     * kernel gets its exact bits. */
    if (has_counts) {
        const size_t used = strlen(defines);
        snprintf(defines + used, size > used ? size - used : 0, " -DHAS_COUNTS=1");
    }
    if (d->renormalize && d->renormalize_floor > 0.0f) {
        const size_t used = strlen(defines);
        snprintf(defines + used, size > used ? size - used : 0, " -DRENORM_FLOOR=%af",
                 (double)d->renormalize_floor);
    }
    if (groups && d->group_fill == MOECL_GROUP_FILL_ZERO) {
        const size_t used = strlen(defines);
        snprintf(defines + used, size > used ? size - used : 0, " -DGROUP_FILL=1");
    }
    return shape;
}

void moecl_topk_gating_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, bool has_bias,
                               bool has_counts, char *buf, size_t size, const char **kernel_name)
{
    *kernel_name = variant_of(NULL, info, desc, has_bias, has_counts, buf, size).kernel_name;
}

static moecl_status prepare(moecl_context *ctx, const moecl_topk_gating_desc *d, bool has_bias, bool has_counts,
                            prepared *out)
{
    char defines[512];
    out->shape = variant_of(ctx, &ctx->info, d, has_bias, has_counts, defines, sizeof(defines));
    return moecl_variant_get(ctx, MOECL_PROGRAM_TOPK_GATING, defines, out->shape.kernel_name, &out->variant);
}

moecl_status moecl_topk_gating_prepare(moecl_context *ctx, const moecl_topk_gating_desc *desc)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    /* Bias or not is a build-time choice; prepare both so that either call
     * finds its kernel. */
    prepared p;
    st = prepare(ctx, desc, false, false, &p);
    if (st == MOECL_SUCCESS)
        st = prepare(ctx, desc, true, false, &p);
    return st;
}

static moecl_status enqueue(moecl_context *ctx, const moecl_topk_gating_desc *d, const prepared *p, cl_mem gating,
                            size_t gating_off, cl_mem bias, size_t bias_off, cl_mem weights, size_t weights_off,
                            cl_mem ids, size_t ids_off, cl_mem counts, size_t counts_off, cl_uint num_wait,
                            const cl_event *wait, cl_event *done)
{
    const char *name = p->shape.kernel_name;
    const size_t limit = moecl_variant_work_group_limit(p->variant);
    size_t rows = p->shape.rows;
    /* The rows kernel (one work-item a row, no required work-group size)
     * runs in work-groups of any size: it takes the kernel's limit where
     * that is smaller (Intel's CPU runtime reports 1 for rows of 4096
     * experts, whose private arrays are large). */
    if (p->shape.team == 1 && limit && rows > limit)
        rows = limit;
    const size_t local = (size_t)p->shape.team * rows;
    const size_t global = moecl_round_up(d->num_tokens, rows) / rows * local;
    /* Checked before the fill, which the kernel's enqueue would otherwise
     * find already queued. */
    moecl_status st = moecl_check_work_group(ctx, name, local, limit);
    if (st != MOECL_SUCCESS)
        return st;
    cl_kernel kernel;
    if ((st = moecl_variant_acquire(ctx, p->variant, &kernel)) != MOECL_SUCCESS)
        return st;
    /* Offsets travel in elements: the kernels index typed pointers. */
    const cl_ulong offsets[5] = {gating_off / moecl_dtype_size(d->gating_dtype), bias_off / 4, weights_off / 4,
                                 ids_off / 4, counts_off / 4};
    const cl_uint num_tokens = d->num_tokens;
    const cl_float factor = d->routed_scaling_factor;
    const moecl_kernel_arg args[12] = {
        {sizeof(cl_mem), &gating},   {sizeof(cl_ulong), &offsets[0]}, {sizeof(cl_mem), bias ? &bias : NULL},
        {sizeof(cl_ulong), &offsets[1]}, {sizeof(cl_mem), &weights},  {sizeof(cl_ulong), &offsets[2]},
        {sizeof(cl_mem), &ids},      {sizeof(cl_ulong), &offsets[3]}, {sizeof(cl_uint), &num_tokens},
        {sizeof(cl_float), &factor}, {sizeof(cl_mem), &counts},       {sizeof(cl_ulong), &offsets[4]}};
    if ((st = moecl_set_kernel_args(ctx, kernel, name, args, counts ? 12 : 10)) != MOECL_SUCCESS) {
        moecl_variant_release(p->variant, kernel);
        return st;
    }
    /* The counts are zeroed first; the kernel waits on that (the queue may
     * be out of order). */
    cl_event zeroed = NULL;
    cl_int err = CL_SUCCESS;
    if (counts) {
        const cl_int zero = 0;
        err = clEnqueueFillBuffer(ctx->queue, counts, &zero, sizeof(zero), counts_off, (size_t)d->num_experts * 4,
                                  num_wait, wait, &zeroed);
        if (err != CL_SUCCESS) {
            moecl_variant_release(p->variant, kernel);
            return moecl_fail(ctx, err, "clEnqueueFillBuffer(expert_counts) failed: %s", moecl_status_string(err));
        }
        num_wait = 1;
        wait = &zeroed;
    }
    err = clEnqueueNDRangeKernel(ctx->queue, kernel, 1, NULL, &global, &local, num_wait, wait, done);
    moecl_variant_release(p->variant, kernel);
    if (err != CL_SUCCESS && zeroed)
        clWaitForEvents(1, &zeroed); /* nothing of the call runs after it returns */
    if (zeroed)
        clReleaseEvent(zeroed);
    if (err != CL_SUCCESS)
        return moecl_fail(ctx, err, "clEnqueueNDRangeKernel(%s) failed: %s", name, moecl_status_string(err));
    return MOECL_SUCCESS;
}

/* num_tokens == 0 with counts: only the zeroing, honouring the wait list;
 * done is its event. */
static moecl_status enqueue_zero_counts(moecl_context *ctx, const moecl_topk_gating_desc *d, cl_mem counts,
                                        size_t counts_off, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const cl_int zero = 0;
    cl_int err = clEnqueueFillBuffer(ctx->queue, counts, &zero, sizeof(zero), counts_off,
                                     (size_t)d->num_experts * 4, num_wait, wait, done);
    if (err != CL_SUCCESS)
        return moecl_fail(ctx, err, "clEnqueueFillBuffer(expert_counts) failed: %s", moecl_status_string(err));
    return MOECL_SUCCESS;
}

/* The device-buffer call; expert_counts.mem == NULL (with has_counts
 * false) is the plain entry point. */
static moecl_status gating_device(moecl_context *ctx, const moecl_topk_gating_desc *desc, moecl_buffer gating,
                                  moecl_buffer bias, moecl_buffer topk_weights, moecl_buffer topk_ids,
                                  bool has_counts, moecl_buffer expert_counts, cl_uint num_wait, const cl_event *wait,
                                  cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    const uint64_t t = desc->num_tokens, e = desc->num_experts, k = desc->top_k;
    const size_t in_size = moecl_dtype_size(desc->gating_dtype);
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS)
        return st;
    if ((st = moecl_check_buffer(ctx, "gating", gating, t * e * in_size, in_size, true)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "bias", bias, e * 4, 4, false)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "topk_weights", topk_weights, t * k * 4, 4, true)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "topk_ids", topk_ids, t * k * 4, 4, true)) != MOECL_SUCCESS)
        return st;
    if (has_counts &&
        (st = moecl_check_buffer(ctx, "expert_counts", expert_counts, e * 4, 4, true)) != MOECL_SUCCESS)
        return st;
    prepared p;
    if ((st = prepare(ctx, desc, bias.mem != NULL, has_counts, &p)) != MOECL_SUCCESS)
        return st;
    if (desc->num_tokens == 0)
        return has_counts
                   ? enqueue_zero_counts(ctx, desc, expert_counts.mem, expert_counts.offset, num_wait, wait, done)
                   : moecl_enqueue_nothing(ctx, num_wait, wait, done);
    return enqueue(ctx, desc, &p, gating.mem, gating.offset, bias.mem, bias.offset, topk_weights.mem,
                   topk_weights.offset, topk_ids.mem, topk_ids.offset, has_counts ? expert_counts.mem : NULL,
                   expert_counts.offset, num_wait, wait, done);
}

moecl_status moecl_topk_gating(moecl_context *ctx, const moecl_topk_gating_desc *desc, moecl_buffer gating,
                               moecl_buffer bias, moecl_buffer topk_weights, moecl_buffer topk_ids, cl_uint num_wait,
                               const cl_event *wait, cl_event *done)
{
    return gating_device(ctx, desc, gating, bias, topk_weights, topk_ids, false, (moecl_buffer){NULL, 0}, num_wait,
                         wait, done);
}

moecl_status moecl_topk_gating_with_counts(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                           moecl_buffer gating, moecl_buffer bias, moecl_buffer topk_weights,
                                           moecl_buffer topk_ids, moecl_buffer expert_counts, cl_uint num_wait,
                                           const cl_event *wait, cl_event *done)
{
    return gating_device(ctx, desc, gating, bias, topk_weights, topk_ids, true, expert_counts, num_wait, wait, done);
}

/* The host-memory call; has_counts false is the plain entry point. */
static moecl_status gating_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, const void *gating,
                                const float *bias, float *topk_weights, int32_t *topk_ids, bool has_counts,
                                int32_t *expert_counts)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    if (desc->num_tokens > 0 && (!gating || !topk_weights || !topk_ids))
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL",
                          !gating ? "gating" : !topk_weights ? "topk_weights" : "topk_ids");
    if (has_counts && !expert_counts)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "expert_counts is NULL");
    prepared p;
    if ((st = prepare(ctx, desc, bias != NULL, has_counts, &p)) != MOECL_SUCCESS)
        return st;
    const size_t t = desc->num_tokens, e = desc->num_experts, k = desc->top_k;
    if (desc->num_tokens == 0) {
        if (has_counts)
            memset(expert_counts, 0, e * 4);
        return MOECL_SUCCESS;
    }
    cl_mem in = NULL, b = NULL, w = NULL, ids = NULL, counts = NULL;
    cl_event ran = NULL;
    if ((st = moecl_host_buffer(ctx, "gating", CL_MEM_READ_ONLY, t * e * moecl_dtype_size(desc->gating_dtype), gating,
                                &in)) == MOECL_SUCCESS &&
        (!bias || (st = moecl_host_buffer(ctx, "bias", CL_MEM_READ_ONLY, e * 4, bias, &b)) == MOECL_SUCCESS) &&
        (st = moecl_host_buffer(ctx, "topk_weights", CL_MEM_WRITE_ONLY, t * k * 4, NULL, &w)) == MOECL_SUCCESS &&
        (st = moecl_host_buffer(ctx, "topk_ids", CL_MEM_WRITE_ONLY, t * k * 4, NULL, &ids)) == MOECL_SUCCESS &&
        (!has_counts ||
         (st = moecl_host_buffer(ctx, "expert_counts", CL_MEM_READ_WRITE, e * 4, NULL, &counts)) == MOECL_SUCCESS) &&
        (st = enqueue(ctx, desc, &p, in, 0, b, 0, w, 0, ids, 0, counts, 0, 0, NULL, &ran)) == MOECL_SUCCESS) {
        const cl_mem mems[3] = {w, ids, counts};
        const size_t sizes[3] = {t * k * 4, t * k * 4, e * 4};
        void *const hosts[3] = {topk_weights, topk_ids, expert_counts};
        st = moecl_read_back(ctx, ran, has_counts ? 3 : 2, mems, sizes, hosts);
    }
    if (ran)
        clReleaseEvent(ran);
    if (in)
        clReleaseMemObject(in);
    if (b)
        clReleaseMemObject(b);
    if (w)
        clReleaseMemObject(w);
    if (ids)
        clReleaseMemObject(ids);
    if (counts)
        clReleaseMemObject(counts);
    return st;
}

moecl_status moecl_topk_gating_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, const void *gating,
                                    const float *bias, float *topk_weights, int32_t *topk_ids)
{
    return gating_host(ctx, desc, gating, bias, topk_weights, topk_ids, false, NULL);
}

moecl_status moecl_topk_gating_with_counts_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                                const void *gating, const float *bias, float *topk_weights,
                                                int32_t *topk_ids, int32_t *expert_counts)
{
    return gating_host(ctx, desc, gating, bias, topk_weights, topk_ids, true, expert_counts);
}
