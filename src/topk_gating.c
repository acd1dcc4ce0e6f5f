/* Top-k gating, host side: validation, the kernel variant a request needs,
 * argument binding and one enqueue; and the blocking host-memory path. */
#include <float.h>
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

uint64_t moecl_rows_gating_loops(uint32_t experts, uint32_t top_k, uint32_t groups, uint32_t topk_group)
{
    const uint64_t e = experts, k = top_k, blocks = (e + 7) / 8;
    /* Steps 1-2 and 5: a few passes over the blocks and the slots. */
    uint64_t loops = 16 * blocks + 4 * k;
    if (groups)
        /* Step 3 (every expert into its group, the kept groups' threshold,
         * the fill), then step 4 unpruned: every expert may be inserted,
         * moving up to k - 1 keys (ascending values). */
        loops += 2 * e + (uint64_t)groups * (topk_group + 2) + e * k;
    else
        /* The floor (k per block), then at most the lanes of the k blocks
         * of the largest maxima inserted, each moving up to k - 1 keys. */
        loops += blocks * k + 8 * k * k;
    return loops;
}

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
    d.weighting = MOECL_WEIGHTS_SCORE;
    d.renormalize_eps = 0.0f;
    d.weights_dtype = MOECL_F32;
    d.ids_dtype = MOECL_I32;
    d.bias_dtype = MOECL_F32;
    d.num_shared_experts = 0;
    d.shared_expert_weight = 1.0f;
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
    if ((unsigned)d->scoring > MOECL_SCORING_RAW)
        return INVALID("scoring is %d; it must be MOECL_SCORING_SOFTMAX, _SIGMOID, _SQRTSOFTPLUS or _RAW",
                       (int)d->scoring);
    if ((unsigned)d->weighting > MOECL_WEIGHTS_SIGMOID_CHOSEN)
        return INVALID("weighting is %d; it must be MOECL_WEIGHTS_SCORE, _SOFTMAX_CHOSEN or _SIGMOID_CHOSEN",
                       (int)d->weighting);
    if ((unsigned)d->group_score > MOECL_GROUP_SCORE_TOP2_SUM)
        return INVALID("group_score is %d; it must be MOECL_GROUP_SCORE_MAX or MOECL_GROUP_SCORE_TOP2_SUM",
                       (int)d->group_score);
    if (!isfinite(d->routed_scaling_factor))
        return INVALID("routed_scaling_factor is %g; it must be finite", (double)d->routed_scaling_factor);
    /* Subnormal floors are refused: a device without denormals would
     * flush one to 0 and divide as moecl's rule does, another not. */
    const float rf = d->renormalize_floor, re = d->renormalize_eps;
    if (!(rf == 0.0f || (isfinite(rf) && rf >= FLT_MIN)))
        return INVALID("renormalize_floor is %g; it must be 0 or a finite float >= FLT_MIN (2^-126)", (double)rf);
    if (!(re == 0.0f || (isfinite(re) && re >= FLT_MIN)))
        return INVALID("renormalize_eps is %g; it must be 0 or a finite float >= FLT_MIN (2^-126)", (double)re);
    if (rf != 0.0f && re != 0.0f)
        return INVALID("renormalize_floor (%g) and renormalize_eps (%g) are both set; at most one may be", (double)rf,
                       (double)re);
    if ((unsigned)d->group_fill > MOECL_GROUP_FILL_ZERO)
        return INVALID("group_fill is %d; it must be MOECL_GROUP_FILL_NEG_INF or MOECL_GROUP_FILL_ZERO",
                       (int)d->group_fill);
    if ((unsigned)d->weights_dtype > MOECL_BF16)
        return INVALID("weights_dtype is %d; it must be MOECL_F32, MOECL_F16 or MOECL_BF16", (int)d->weights_dtype);
    if ((unsigned)d->ids_dtype > MOECL_I64)
        return INVALID("ids_dtype is %d; it must be MOECL_I32 or MOECL_I64", (int)d->ids_dtype);
    if ((unsigned)d->bias_dtype > MOECL_BF16)
        return INVALID("bias_dtype is %d; it must be MOECL_F32, MOECL_F16 or MOECL_BF16", (int)d->bias_dtype);
    if (d->num_shared_experts > MOECL_MAX_TOPK - d->top_k)
        return INVALID("num_shared_experts is %u; top_k (%u) + num_shared_experts must be at most %u",
                       d->num_shared_experts, d->top_k, MOECL_MAX_TOPK);
    if (d->num_shared_experts && !isfinite(d->shared_expert_weight))
        return INVALID("shared_expert_weight is %g; it must be finite", (double)d->shared_expert_weight);
    return MOECL_SUCCESS;
#undef INVALID
}

moecl_status moecl_topk_gating_validate(moecl_context *ctx, const moecl_topk_gating_desc *desc)
{
    return validate_desc(ctx, desc);
}

/* What a configuration launches on a device: work-items per row, rows a
 * work-group, warp shuffles (inline PTX) for the team reductions, and the
 * kernel. */
typedef struct topk_shape {
    unsigned team, rows;
    bool shuffle;
    const char *kernel_name;
} topk_shape;

/* A request: the descriptor and the build-time choices of the call, with
 * the group limits that select nothing away dropped. */
typedef struct topk_request {
    const moecl_topk_gating_desc *desc;
    bool has_bias, has_counts;
    bool has_load, has_valid; /* moecl_topk_gating_ex's expert_load, num_valid_tokens */
    bool has_dispatch; /* moecl_route_dispatch's kernel: moe_align after the rows (team kernel only) */
    unsigned groups, topk_group;
    unsigned replay; /* cl/replay.cl's kernel (src/replay.c): 1 given ids, 2 hash routing; 0 top-k */
    unsigned capture; /* moecl_topk_gating_ex's captured_ids: 0 none, else 1 + captured_ids_dtype */
    bool has_scale;   /* moecl_topk_gating_ex's expert_scale */
    unsigned load_map; /* the load by local expert: their number (LOAD_MAP); 0 by expert id */
} topk_request;

/* The request's capture define: 1 + the captured ids' dtype, 0 for none. */
static unsigned capture_of(bool has_capture, moecl_index_dtype dtype)
{
    return has_capture ? 1u + (unsigned)dtype : 0u;
}

/* Local memory the team kernel needs for `rows` rows (cl/layout.h), for
 * either scoring and without shuffles: a bound for every variant. */
static size_t team_local_bytes(unsigned team, unsigned rows, unsigned k, unsigned experts, unsigned groups)
{
    return moecl_layout_topk_team_local(team, rows, experts, k, groups, true, false);
}

/* Whether a work-item of the rows kernel (a row) stays within the
 * driver's loop limit: the rows pipeline's bound, the row's load and the
 * shared slots. A replay selects nothing: a few passes over the row. */
static bool rows_fit(const moecl_device_info *info, const topk_request *r)
{
    const moecl_topk_gating_desc *d = r->desc;
    const uint64_t blocks = (d->num_experts + 7) / 8;
    if (r->replay)
        return moecl_loops_fit(info, 8 * blocks + 4 * (uint64_t)d->top_k + d->num_shared_experts);
    return moecl_loops_fit(info, moecl_rows_gating_loops(d->num_experts, d->top_k, r->groups, r->topk_group) +
                                     2 * blocks + d->num_shared_experts);
}

/* The check: whether the device can run configuration c for the request
 * (work-group size, local memory, the rows kernel's loop limit), and the
 * shape it launches. */
static bool check_config(const moecl_device_info *info, const moecl_launch_config *c, const void *request,
                         void *shape_out)
{
    const topk_request *r = request;
    topk_shape *shape = shape_out;
    const unsigned experts = r->desc->num_experts, k = r->desc->top_k;
    const bool pow2_rows = moecl_is_pow2(c->rows);
    if (c->kernel == MOECL_KERNEL_ROWS && c->team == 1 && pow2_rows && c->rows <= info->max_work_group_size &&
        rows_fit(info, r)) {
        *shape = (topk_shape){1, c->rows, false, "topk_gating_rows"};
        return true;
    }
    if (c->kernel != MOECL_KERNEL_TEAM || c->team < 2 || c->team > MOECL_LAUNCH_MAX_TEAM || !moecl_is_pow2(c->team) ||
        !pow2_rows || (size_t)c->team * c->rows > info->max_work_group_size ||
        team_local_bytes(c->team, c->rows, k, experts, r->groups) > moecl_local_budget(info))
        return false;
    /* Shuffles need teams inside a warp and work-groups of whole warps. */
    const bool shuffle = info->ptx && c->team <= 32 && (c->team * c->rows) % 32 == 0;
    *shape = (topk_shape){c->team, c->rows, shuffle, "topk_gating_team"};
    return true;
}

/* The rule: the configuration the device facts (and the environment's
 * record) give a request. */
static moecl_launch_config rule_config(const moecl_device_info *info, const void *request)
{
    const topk_request *r = request;
    const unsigned experts = r->desc->num_experts, k = r->desc->top_k;
    const moecl_launch_config rows_kernel = {MOECL_KERNEL_ROWS, 1, 8, 0, {0}};
    /* the override team= asks for the team kernel unless the override says
     * class=cpu. A row past the driver's loop limit gets the rows kernel
     * all the same, which the check refuses: the call fails (the team
     * kernel, forced at 4096 experts, top 64, team 32, wrote ids -1 on
     * rusticl, so it is no way round). */
    if (info->launch_class == MOECL_LAUNCH_CPU && (!info->env.team || info->env.launch_class_forced))
        return rows_kernel;
    /* About eight elements per work-item, at most 256 work-items a row. */
    unsigned team = info->env.team ? info->env.team : moecl_pow2_at_least((experts + 7) / 8);
    if (team > 256)
        team = 256;
    while (team > 1 && team > info->max_work_group_size)
        team >>= 1;
    if (team == 1)
        return (moecl_launch_config){MOECL_KERNEL_ROWS, 1, 64, 0, {0}};
    unsigned rows = team >= 128 ? 1 : 128 / team;
    while (rows * team > info->max_work_group_size)
        rows >>= 1;
    const size_t budget = moecl_local_budget(info);
    while (rows > 1 && team_local_bytes(team, rows, k, experts, r->groups) > budget)
        rows >>= 1;
    if (rows == 0 || team_local_bytes(team, rows, k, experts, r->groups) > budget)
        return rows_kernel; /* too big for local memory: the per-row loops serve every shape */
    return (moecl_launch_config){MOECL_KERNEL_TEAM, team, rows, 0, {0}};
}

static const moecl_launch_rule launch_rule = {rule_config, check_config};

static moecl_launch_source resolve(const moecl_context *ctx, const moecl_device_info *info, const topk_request *r,
                                   moecl_launch_config *config, topk_shape *shape)
{
    const moecl_launch_key key = moecl_launch_key_topk(r->desc->num_experts, r->desc->top_k, r->groups);
    /* No kernel name after it: no kernel fits the device (its loop limit). */
    shape->kernel_name = NULL;
    return moecl_launch_resolve(ctx, info, &key, &launch_rule, r, config, shape);
}

/* Group limits that select nothing away are dropped: keeping every group
 * keeps everything, and groups of one expert rank exactly as the experts
 * do. Not the latter with the zero fill: a dropped expert then selects
 * with 0.0, which can beat a kept one (a negative biased score, or an
 * exact 0 of a higher index). */
static topk_request request_of(const moecl_topk_gating_desc *d, bool has_bias, bool has_counts)
{
    topk_request r = {.desc = d, .has_bias = has_bias, .has_counts = has_counts,
                      .groups = d->num_expert_groups, .topk_group = d->topk_group};
    if (r.groups && (r.topk_group == r.groups ||
                     (d->num_experts / r.groups == 1 && d->group_fill != MOECL_GROUP_FILL_ZERO)))
        r.groups = r.topk_group = 0;
    return r;
}

/* The variant of request r: its parameters (src/variant.c), with the
 * launch shape s where it is known (the plan key needs none of it). */
static moecl_variant_values values_of(const moecl_device_info *info, const topk_request *r, const topk_shape *s)
{
    const moecl_topk_gating_desc *d = r->desc;
    moecl_variant_values v;
    memset(&v, 0, sizeof(v));
    v.param[MOECL_TOPK_NUM_EXPERTS] = d->num_experts;
    v.param[MOECL_TOPK_TOPK] = d->top_k;
    v.param[MOECL_TOPK_IN_DTYPE] = (uint32_t)d->gating_dtype;
    v.param[MOECL_TOPK_HAS_COUNTS] = r->has_counts;
    v.param[MOECL_TOPK_HAS_LOAD] = r->has_load;
    v.param[MOECL_TOPK_HAS_VALID] = r->has_valid;
    v.param[MOECL_TOPK_CAPTURE] = r->capture;
    v.param[MOECL_TOPK_HAS_SCALE] = r->has_scale;
    v.param[MOECL_TOPK_LOAD_MAP] = r->load_map;
    /* The CPU fast path's loops are not bounded against a driver's loop
     * limit (rusticl's llvmpipe routed ascending rows of 2048 experts, top
     * 64, wrong with it): there the generic loops, whose bound rows_fit
     * checks. */
    v.param[MOECL_TOPK_CPU_DEVICE] =
        (info->type & CL_DEVICE_TYPE_CPU) != 0 && !moecl_device_table_params(info).value[MOECL_DP_LOOP_LIMIT];
    v.param[MOECL_TOPK_ROUTE_DISPATCH] = r->has_dispatch;
    v.param[MOECL_TOPK_REPLAY] = r->replay;
    v.param[MOECL_TOPK_SHARED] = d->num_shared_experts;
    if (d->num_shared_experts) /* else not in the key either: one plan for any weight */
        memcpy(&v.param[MOECL_TOPK_SHARED_WEIGHT], &d->shared_expert_weight, sizeof(float));
    if (s) {
        v.param[MOECL_TOPK_TEAM] = s->team;
        v.param[MOECL_TOPK_ROWS] = s->rows;
        v.param[MOECL_TOPK_TEAM_SHUFFLE] = s->shuffle;
        v.param[MOECL_TOPK_EPT] = (d->num_experts + s->team - 1) / s->team;
        v.param[MOECL_TOPK_FUSED_WG] = s->team * s->rows;
    }
    const moecl_gating_source gating = {d, r->groups, r->topk_group, r->has_bias};
    moecl_variant_gating(&v, &gating);
    return v;
}

static moecl_kernel_kind kernel_of(const topk_shape *s)
{
    return s->team > 1 ? MOECL_KERNEL_TEAM : MOECL_KERNEL_ROWS;
}

static moecl_plan_key key_of(const moecl_context *ctx, const topk_request *r)
{
    const moecl_variant_values v = values_of(&ctx->info, r, NULL);
    return moecl_variant_key(ctx, &moecl_variant_topk_gating, &v);
}

moecl_launch_source moecl_topk_gating_launch(const moecl_context *ctx, const moecl_topk_gating_desc *d,
                                             moecl_launch_key *key, moecl_launch_config *config)
{
    const topk_request r = request_of(d, false, false);
    topk_shape shape;
    *key = moecl_launch_key_topk(d->num_experts, d->top_k, r.groups);
    return resolve(ctx, &ctx->info, &r, config, &shape);
}

/* The kernel of request r in shape s: cl/replay.cl's for a replay. */
static const char *kernel_name_of(const topk_request *r, const topk_shape *s)
{
    return !r->replay ? s->kernel_name : s->team > 1 ? "replay_team" : "replay_rows";
}

/* The -D defines of the variant of request r in shape s. */
static void defines_of(const moecl_device_info *info, const topk_request *r, const topk_shape *s, char *defines,
                       size_t size)
{
    const moecl_variant_values v = values_of(info, r, s);
    moecl_variant_defines(&moecl_variant_topk_gating, &v, kernel_of(s), defines, size);
}

/* The defines of a resolved shape; none ("") where no kernel fits the
 * device (its kernel name NULL). */
static void defines_of_fitting(const moecl_device_info *info, const topk_request *r, const topk_shape *s,
                               char *defines, size_t size)
{
    if (s->kernel_name)
        defines_of(info, r, s, defines, size);
    else if (size)
        defines[0] = '\0';
}

void moecl_topk_gating_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, bool has_bias,
                               bool has_counts, char *buf, size_t size, const char **kernel_name)
{
    const topk_request r = request_of(desc, has_bias, has_counts);
    moecl_launch_config config;
    topk_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of_fitting(info, &r, &shape, buf, size);
    *kernel_name = shape.kernel_name;
}

void moecl_topk_gating_ex_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, bool has_bias,
                                  moecl_index_dtype capture_dtype, char *buf, size_t size, const char **kernel_name)
{
    topk_request r = request_of(desc, has_bias, true);
    r.has_load = r.has_valid = r.has_scale = true;
    r.capture = capture_of(true, capture_dtype);
    moecl_launch_config config;
    topk_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of_fitting(info, &r, &shape, buf, size);
    *kernel_name = shape.kernel_name;
}

void moecl_topk_gating_route_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, bool has_bias,
                                     bool has_load, bool has_valid, char *buf, size_t size, const char **kernel_name)
{
    topk_request r = request_of(desc, has_bias, false);
    r.has_dispatch = true;
    r.has_load = has_load;
    r.has_valid = has_valid;
    moecl_launch_config config;
    topk_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of_fitting(info, &r, &shape, buf, size);
    *kernel_name = shape.kernel_name && shape.team > 1 ? shape.kernel_name : NULL;
}

/* The plan of a request (moecl_plan_build): the configuration, the
 * variant and the work sizes. */
static moecl_status build_plan(moecl_context *ctx, const void *request, moecl_plan *plan)
{
    const topk_request *r = request;
    topk_shape shape;
    plan->source = resolve(ctx, &ctx->info, r, &plan->config, &shape);
    plan->launch_key = moecl_launch_key_topk(r->desc->num_experts, r->desc->top_k, r->groups);
    if (!shape.kernel_name)
        return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED,
                          "top-k gating: at %u experts, top_k %u, %u expert groups (%u kept), no kernel keeps a "
                          "work-item within the driver's loop limit of %u iterations (docs/devices.md)",
                          r->desc->num_experts, r->desc->top_k, r->groups, r->topk_group,
                          ctx->params.value[MOECL_DP_LOOP_LIMIT]);
    if (r->has_dispatch && shape.team == 1) {
        char text[512];
        const moecl_variant_values v = values_of(&ctx->info, r, &shape);
        moecl_variant_text(&moecl_variant_topk_gating, &v, kernel_of(&shape), text, sizeof(text));
        return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED, "route dispatch in one kernel needs the team kernel (%s)",
                          text);
    }
    char defines[512];
    defines_of(&ctx->info, r, &shape, defines, sizeof(defines));
    const moecl_program_kind kind = r->replay         ? MOECL_PROGRAM_REPLAY
                                    : r->has_dispatch ? MOECL_PROGRAM_ROUTE_DISPATCH
                                                      : MOECL_PROGRAM_TOPK_GATING;
    const char *kernel_name = kernel_name_of(r, &shape);
    moecl_status st = moecl_variant_get(ctx, kind, defines, kernel_name, &plan->variants[0]);
    if (st != MOECL_SUCCESS)
        return st;
    plan->num_kernels = 1;
    plan->kernel_names[0] = kernel_name;
    plan->limits[0] = moecl_variant_work_group_limit(plan->variants[0]);
    /* The rows kernel (one work-item a row, no required work-group size)
     * runs in work-groups of any size: it takes the kernel's limit where
     * that is smaller (Intel's CPU runtime reports 1 for rows of 4096
     * experts, whose private arrays are large). The team kernel's size is
     * compiled in: a call checks it against the limit. */
    size_t rows = shape.rows;
    if (shape.team == 1 && plan->limits[0] && rows > plan->limits[0])
        rows = plan->limits[0];
    plan->local = (size_t)shape.team * rows;
    plan->rows_per_group = rows;
    return MOECL_SUCCESS;
}

static moecl_status plan_of(moecl_context *ctx, const topk_request *r, const moecl_plan **plan)
{
    const moecl_plan_key key = key_of(ctx, r);
    return moecl_plan_get(ctx, &key, build_plan, r, plan);
}

moecl_status moecl_topk_gating_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, bool has_bias,
                                    bool has_counts, const moecl_plan **plan)
{
    const topk_request r = request_of(desc, has_bias, has_counts);
    return plan_of(ctx, &r, plan);
}

moecl_status moecl_topk_gating_ex_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, bool has_bias,
                                       bool has_load, bool has_valid, uint32_t load_map, const moecl_plan **plan)
{
    topk_request r = request_of(desc, has_bias, false);
    r.has_load = has_load;
    r.has_valid = has_valid;
    r.load_map = has_load ? load_map : 0;
    return plan_of(ctx, &r, plan);
}

moecl_status moecl_topk_gating_route_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, bool has_bias,
                                          bool has_load, bool has_valid, const moecl_plan **plan)
{
    topk_request r = request_of(desc, has_bias, false);
    r.has_dispatch = true;
    r.has_load = has_load;
    r.has_valid = has_valid;
    return plan_of(ctx, &r, plan);
}

/* The replay variant: top-k gating's without a bias (the bias steers
 * selection only) and with its group limit kept, so that the launch shape,
 * and with it softmax's sum, is the one top-k gating runs (cl/replay.cl). */
static topk_request replay_request_of(const moecl_topk_gating_desc *d, unsigned mode)
{
    topk_request r = request_of(d, false, false);
    r.replay = mode;
    return r;
}

moecl_status moecl_topk_gating_replay_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, unsigned mode,
                                           const moecl_plan **plan)
{
    const topk_request r = replay_request_of(desc, mode);
    return plan_of(ctx, &r, plan);
}

void moecl_topk_gating_replay_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, unsigned mode,
                                      char *buf, size_t size, const char **kernel_name)
{
    const topk_request r = replay_request_of(desc, mode);
    moecl_launch_config config;
    topk_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of_fitting(info, &r, &shape, buf, size);
    *kernel_name = shape.kernel_name ? kernel_name_of(&r, &shape) : NULL;
}

moecl_status moecl_topk_gating_replay_launch(moecl_context *ctx, const moecl_topk_gating_desc *desc, unsigned mode,
                                             const moecl_kernel_arg *args, cl_uint num_args, cl_uint num_wait,
                                             const cl_event *wait, cl_event *done)
{
    const topk_request r = replay_request_of(desc, mode);
    const moecl_launch_call call = {key_of(ctx, &r), build_plan, &r, args, num_args, desc->num_tokens, NULL, 0, 0, NULL};
    return moecl_plan_launch(ctx, &call, num_wait, wait, done);
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
    const moecl_plan *p;
    st = moecl_topk_gating_plan(ctx, desc, false, false, &p);
    if (st == MOECL_SUCCESS)
        st = moecl_topk_gating_plan(ctx, desc, true, false, &p);
    return st;
}

/* The tensors of a call (moecl_topk_gating_tensors' fields; every entry
 * point comes through here), and whether binding validates them (the
 * caller's buffers; the host path's own need no check). */
typedef struct topk_buffers {
    moecl_buffer gating, bias, weights, ids, counts, load, valid;
    bool check;
    bool need_counts; /* moecl_topk_gating_with_counts: expert_counts is required */
    moecl_buffer captured, scale; /* moecl_topk_gating_ex's captured_ids and expert_scale */
    moecl_index_dtype captured_dtype;
    moecl_buffer map; /* moecl_route_dispatch_ex's: the load by local expert (LOAD_MAP) */
    uint32_t num_local;
} topk_buffers;

/* Every moecl_topk_gating_ex capture fits int16: no num_experts moecl
 * takes exceeds its ids. */
_Static_assert(MOECL_MAX_EXPERTS <= 32767, "MOECL_I16 captured ids hold every expert id");

static moecl_status check_capture_dtype(moecl_context *ctx, moecl_index_dtype dtype)
{
    if (dtype != MOECL_I16 && dtype != MOECL_I32 && dtype != MOECL_I64)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "captured_ids_dtype is %d; it must be MOECL_I16, MOECL_I32 or MOECL_I64", (int)dtype);
    return MOECL_SUCCESS;
}

/* Bind and enqueue (src/plan.c): the counts are zeroed first, and the
 * kernel waits on that; the load counter is not. */
static moecl_status launch(moecl_context *ctx, const moecl_topk_gating_desc *d, const topk_buffers *b,
                           cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    /* k: a row's slots; ce: the counts' experts (both with the shared ones);
     * the capture holds the routed slots only. */
    const uint64_t t = d->num_tokens, e = d->num_experts, k = moecl_topk_row_slots(d), ce = moecl_topk_id_experts(d);
    const size_t in_size = moecl_dtype_size(d->gating_dtype), bias_size = moecl_dtype_size(d->bias_dtype);
    const size_t w_size = moecl_dtype_size(d->weights_dtype), id_size = moecl_index_size(d->ids_dtype);
    const size_t cap_size = moecl_index_size(b->captured_dtype);
    const moecl_buffer_check checks[9] = {{"gating", t * e * in_size, b->gating.offset, in_size, true},
                                          {"bias", e * bias_size, b->bias.offset, bias_size, false},
                                          {"topk_weights", t * k * w_size, b->weights.offset, w_size, true},
                                          {"topk_ids", t * k * id_size, b->ids.offset, id_size, true},
                                          {"expert_counts", ce * 4, b->counts.offset, 4, true},
                                          {"expert_load", (b->map.mem ? b->num_local : ce) * 4, b->load.offset, 4, true},
                                          {"num_valid_tokens", 4, b->valid.offset, 4, true},
                                          {"captured_ids", t * d->top_k * cap_size, b->captured.offset, cap_size, true},
                                          {"expert_scale", e * 4, b->scale.offset, 4, true}};
    const moecl_buffer_check map_check = {"expert_map", e * 4, b->map.offset, 4, true};
    const cl_ulong map_off = b->map.offset / 4;
    const moecl_buffer_check *c = b->check ? checks : NULL;
    /* Offsets travel in elements: the kernels index typed pointers. The
     * scalars are one argument, and the optional tensors arguments only
     * where the request has them (cl/topk_gating.cl, cl/layout.h). */
    const layout_topk_args scalars = {.gating_off = b->gating.offset / in_size,
                                      .bias_off = b->bias.offset / bias_size,
                                      .weights_off = b->weights.offset / w_size,
                                      .ids_off = b->ids.offset / id_size,
                                      .counts_off = b->counts.offset / 4,
                                      .load_off = b->load.offset / 4,
                                      .valid_off = b->valid.offset / 4,
                                      .captured_off = b->captured.offset / cap_size,
                                      .scale_off = b->scale.offset / 4,
                                      .num_tokens = d->num_tokens,
                                      .scaling_factor = d->routed_scaling_factor};
    const moecl_buffer *const order[9] = {&b->gating, &b->bias,  &b->weights,  &b->ids,  &b->counts,
                                          &b->load,   &b->valid, &b->captured, &b->scale};
    moecl_kernel_arg args[12];
    cl_uint n = 0;
    for (int i = 0; i < 9; i++) {
        if (order[i]->mem || i == 0 || i == 2 || i == 3 || (i == 4 && b->need_counts)) /* required: as they are */
            args[n++] = MOECL_ARG_CHECKED(order[i]->mem, c ? &c[i] : NULL);
        if (i == 5 && b->load.mem && b->map.mem) { /* LOAD_MAP's two after the load */
            args[n++] = MOECL_ARG_CHECKED(b->map.mem, c ? &map_check : NULL);
            args[n++] = MOECL_ARG(map_off);
        }
    }
    args[n++] = MOECL_ARG(scalars);
    topk_request r = request_of(d, b->bias.mem != NULL, b->counts.mem != NULL || b->need_counts);
    r.has_load = b->load.mem != NULL;
    r.has_valid = b->valid.mem != NULL;
    r.capture = capture_of(b->captured.mem != NULL, b->captured_dtype);
    r.has_scale = b->scale.mem != NULL;
    r.load_map = b->load.mem && b->map.mem ? b->num_local : 0;
    const moecl_launch_call call = {key_of(ctx, &r), build_plan,    &r,      args,           n,
                                    d->num_tokens,   b->counts.mem, b->counts.offset, ce * 4, "expert_counts"};
    return moecl_plan_launch(ctx, &call, num_wait, wait, done);
}

/* The first version of moecl_topk_gating_tensors and of the host form. */
#define TENSORS_V1 (offsetof(moecl_topk_gating_tensors, num_valid_tokens) + sizeof(moecl_buffer))
#define HOST_TENSORS_V1 (offsetof(moecl_topk_gating_host_tensors, num_valid_tokens) + sizeof(int32_t *))


/* The device-buffer call of every entry point. */
static moecl_status gating_device(moecl_context *ctx, const moecl_topk_gating_desc *desc, const topk_buffers *b,
                                  cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    if (b->captured.mem && (st = check_capture_dtype(ctx, b->captured_dtype)) != MOECL_SUCCESS)
        return st;
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS)
        return st;
    return launch(ctx, desc, b, num_wait, wait, done);
}

moecl_status moecl_topk_gating(moecl_context *ctx, const moecl_topk_gating_desc *desc, moecl_buffer gating,
                               moecl_buffer bias, moecl_buffer topk_weights, moecl_buffer topk_ids, cl_uint num_wait,
                               const cl_event *wait, cl_event *done)
{
    const topk_buffers b = {.gating = gating, .bias = bias, .weights = topk_weights, .ids = topk_ids, .check = true};
    return gating_device(ctx, desc, &b, num_wait, wait, done);
}

moecl_status moecl_topk_gating_with_counts(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                           moecl_buffer gating, moecl_buffer bias, moecl_buffer topk_weights,
                                           moecl_buffer topk_ids, moecl_buffer expert_counts, cl_uint num_wait,
                                           const cl_event *wait, cl_event *done)
{
    const topk_buffers b = {.gating = gating,
                            .bias = bias,
                            .weights = topk_weights,
                            .ids = topk_ids,
                            .counts = expert_counts,
                            .check = true,
                            .need_counts = true};
    return gating_device(ctx, desc, &b, num_wait, wait, done);
}

moecl_status moecl_topk_gating_ex(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                  const moecl_topk_gating_tensors *tensors, cl_uint num_wait, const cl_event *wait,
                                  cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_topk_gating_tensors t;
    const moecl_status st = moecl_copy_record(ctx, tensors, TENSORS_V1, sizeof(t), "num_valid_tokens", &t);
    if (st != MOECL_SUCCESS)
        return st;
    const topk_buffers b = {t.gating,        t.bias,        t.topk_weights,     t.topk_ids,
                            t.expert_counts, t.expert_load, t.num_valid_tokens, true,
                            false,           t.captured_ids, t.expert_scale,    t.captured_ids_dtype,
                            {NULL, 0},       0};
    return gating_device(ctx, desc, &b, num_wait, wait, done);
}

moecl_status moecl_topk_gating_ex_mapped(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                         const moecl_topk_gating_tensors *t, moecl_buffer expert_map,
                                         uint32_t num_local, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const topk_buffers b = {t->gating,        t->bias,         t->topk_weights,  t->topk_ids,
                            t->expert_counts, t->expert_load,  t->num_valid_tokens, true,
                            false,            t->captured_ids, t->expert_scale,  t->captured_ids_dtype,
                            expert_map,       num_local};
    return gating_device(ctx, desc, &b, num_wait, wait, done);
}

/* The host-memory call of every entry point: the library's own buffers,
 * filled from and read back into the caller's memory (expert_load both:
 * the call adds to it). */
static moecl_status gating_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                const moecl_topk_gating_host_tensors *h, bool need_counts)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    if (desc->num_tokens > 0 && (!h->gating || !h->topk_weights || !h->topk_ids))
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL",
                          !h->gating ? "gating" : !h->topk_weights ? "topk_weights" : "topk_ids");
    if (need_counts && !h->expert_counts)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "expert_counts is NULL");
    if (h->captured_ids && (st = check_capture_dtype(ctx, h->captured_ids_dtype)) != MOECL_SUCCESS)
        return st;
    const moecl_plan *p;
    topk_request r = request_of(desc, h->bias != NULL, h->expert_counts != NULL);
    r.has_load = h->expert_load != NULL;
    r.has_valid = h->num_valid_tokens != NULL;
    r.capture = capture_of(h->captured_ids != NULL, h->captured_ids_dtype);
    r.has_scale = h->expert_scale != NULL;
    if ((st = plan_of(ctx, &r, &p)) != MOECL_SUCCESS)
        return st;
    (void)p; /* built before the buffers are made: a build failure costs no copy */
    const size_t t = desc->num_tokens, e = desc->num_experts, k = moecl_topk_row_slots(desc);
    const size_t ce = moecl_topk_id_experts(desc);
    const size_t w_bytes = t * k * moecl_dtype_size(desc->weights_dtype);
    const size_t id_bytes = t * k * moecl_index_size(desc->ids_dtype);
    if (desc->num_tokens == 0) {
        if (h->expert_counts)
            memset(h->expert_counts, 0, ce * 4);
        return MOECL_SUCCESS;
    }
    enum { GATING, BIAS, SCALE, LOAD, VALID, WEIGHTS, IDS, COUNTS, CAPTURED, NUM };
    const void *const from[NUM] = {h->gating, h->bias, h->expert_scale, h->expert_load, h->num_valid_tokens,
                                   NULL,      NULL,    NULL,            NULL};
    void *const to[NUM] = {NULL,          NULL,        NULL,          h->expert_load, NULL,
                           h->topk_weights, h->topk_ids, h->expert_counts, h->captured_ids};
    static const char *const names[NUM] = {"gating",       "bias",          "expert_scale",
                                           "expert_load",  "num_valid_tokens", "topk_weights",
                                           "topk_ids",     "expert_counts", "captured_ids"};
    const size_t sizes[NUM] = {t * e * moecl_dtype_size(desc->gating_dtype),
                               e * moecl_dtype_size(desc->bias_dtype),
                               e * 4,
                               ce * 4,
                               4,
                               w_bytes,
                               id_bytes,
                               ce * 4,
                               t * desc->top_k * moecl_index_size(h->captured_ids_dtype)};
    cl_mem mems[NUM] = {NULL};
    for (int i = 0; i < NUM && st == MOECL_SUCCESS; i++)
        if (from[i] || to[i])
            /* The counts are added to (atomics read them), as the load is. */
            st = moecl_host_buffer(ctx, names[i],
                                   !to[i]                      ? CL_MEM_READ_ONLY
                                   : from[i] || i == COUNTS    ? CL_MEM_READ_WRITE
                                                               : CL_MEM_WRITE_ONLY,
                                   sizes[i], from[i], &mems[i]);
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS) {
        const topk_buffers b = {{mems[GATING], 0},   {mems[BIAS], 0},  {mems[WEIGHTS], 0}, {mems[IDS], 0},
                                {mems[COUNTS], 0},   {mems[LOAD], 0},  {mems[VALID], 0},   false,
                                false,               {mems[CAPTURED], 0}, {mems[SCALE], 0}, h->captured_ids_dtype,
                                {NULL, 0},           0};
        st = launch(ctx, desc, &b, 0, NULL, &ran);
    }
    /* Read back the outputs: expert_load with them, from LOAD on. */
    return moecl_host_call_end(ctx, st, ran, mems, NUM, LOAD, sizes + LOAD, to);
}

moecl_status moecl_topk_gating_host(moecl_context *ctx, const moecl_topk_gating_desc *desc, const void *gating,
                                    const void *bias, void *topk_weights, void *topk_ids)
{
    const moecl_topk_gating_host_tensors h = {sizeof(h), gating, bias, topk_weights, topk_ids, NULL, NULL, NULL,
                                              NULL,       MOECL_I32, NULL};
    return gating_host(ctx, desc, &h, false);
}

moecl_status moecl_topk_gating_with_counts_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                                const void *gating, const void *bias, void *topk_weights,
                                                void *topk_ids, int32_t *expert_counts)
{
    const moecl_topk_gating_host_tensors h = {sizeof(h), gating, bias, topk_weights, topk_ids, expert_counts, NULL,
                                              NULL,       NULL,   MOECL_I32, NULL};
    return gating_host(ctx, desc, &h, true);
}

moecl_status moecl_topk_gating_ex_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                       const moecl_topk_gating_host_tensors *tensors)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_topk_gating_host_tensors h;
    const moecl_status st = moecl_copy_record(ctx, tensors, HOST_TENSORS_V1, sizeof(h), "num_valid_tokens", &h);
    return st != MOECL_SUCCESS ? st : gating_host(ctx, desc, &h, false);
}
