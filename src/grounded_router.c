/* Grounded router, host side: validation, the kernel variant a request
 * needs, argument binding and one enqueue; and the blocking host path. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

moecl_grounded_router_desc moecl_grounded_router_desc_init(uint32_t num_tokens, uint32_t hidden_dim,
                                                           uint32_t num_experts, float alpha)
{
    moecl_grounded_router_desc d;
    memset(&d, 0, sizeof(d));
    d.num_tokens = num_tokens;
    d.hidden_dim = hidden_dim;
    d.num_experts = num_experts;
    d.top_k = 2;
    d.alpha = alpha;
    d.hidden_dtype = MOECL_F32;
    d.precision = MOECL_PRECISION_FP32;
    d.gating = (moecl_gating){MOECL_SCORING_RAW, MOECL_WEIGHTS_SOFTMAX_CHOSEN, 0, 0, MOECL_GROUP_SCORE_MAX,
                              MOECL_GROUP_FILL_NEG_INF, false, 0.0f, 1.0f};
    return d;
}

moecl_status moecl_grounded_router_validate(moecl_context *ctx, const moecl_grounded_router_desc *d)
{
#define INVALID(...) moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, __VA_ARGS__)
    if (!d)
        return INVALID("desc is NULL");
    if (d->hidden_dim < 1 || d->hidden_dim > MOECL_MAX_HIDDEN)
        return INVALID("hidden_dim is %u; it must be in 1..%u", d->hidden_dim, MOECL_MAX_HIDDEN);
    moecl_status st = moecl_check_experts_topk(ctx, d->num_experts, d->top_k);
    if (st != MOECL_SUCCESS)
        return st;
    if (!isfinite(d->alpha))
        return INVALID("alpha is %g; it must be finite", (double)d->alpha);
    if ((unsigned)d->hidden_dtype > MOECL_BF16)
        return INVALID("hidden_dtype is %d; it must be MOECL_F32, MOECL_F16 or MOECL_BF16", (int)d->hidden_dtype);
    if ((unsigned)d->precision > MOECL_PRECISION_3XTF32)
        return INVALID("precision is %d; it must be MOECL_PRECISION_FP32, _TF32 or _3XTF32", (int)d->precision);
    return MOECL_SUCCESS;
#undef INVALID
}

/* What a configuration launches on a device. */
typedef struct grounded_shape {
    moecl_kernel_kind kind;
    unsigned tm, tn, tk;       /* tiled: tile of tokens x experts x hidden step */
    unsigned mt, nt;           /* tiled: each work-item's register block */
    unsigned team, rows, ept;  /* team */
    bool shuffle;              /* team: warp shuffles (inline PTX) */
    size_t local;              /* work-group size */
    size_t rows_per_group;     /* tokens a work-group routes */
    const char *kernel_name;
    unsigned mma_mi, mma_nt, mma_wm, mma_wn, mma_kw; /* mma: a warp's m16 and n8 tiles, warps, words a k step */
} grounded_shape;

/* A request: the descriptor, the outputs the call writes, and whether the
 * team kernel ends with the dispatch (moecl_grounded_route_dispatch). */
typedef struct grounded_request {
    const moecl_grounded_router_desc *desc;
    bool pairs, weights, ids, dispatch;
} grounded_request;

/* Local memory of grounded_router_tiled and grounded_router_team
 * (cl/layout.h). */
static size_t tiled_local_bytes(unsigned tm, unsigned tn, unsigned tk, unsigned k)
{
    return moecl_layout_grounded_tiled_local(tm, tn, tk, k);
}

static size_t team_local_bytes(unsigned hidden, unsigned team, unsigned ept, unsigned rows, unsigned k)
{
    return moecl_layout_grounded_team_local(hidden, team, ept, rows, k);
}

/* Tiles of 64 tokens with 4 x 4 blocks per work-item, smaller where local
 * memory is short. 128 tokens with 8 x 8 blocks (more multiply-adds per
 * local-memory read) measured slower on the H200 (bench/RESULTS.md,
 * "Moved from code comments"), so
 * only MOECL_GROUNDED_TILE=128 (or a tuned configuration) asks for it.
 * Rows: tokens, register block rows and columns. */
static const unsigned tile_configs[][3] = {{128, 8, 8}, {64, 4, 4}, {32, 4, 4}, {16, 4, 4}};
#define NUM_TILE_CONFIGS (sizeof(tile_configs) / sizeof(tile_configs[0]))

/* Experts a tile of the tiled kernel covers. */
static unsigned tile_experts(unsigned experts)
{
    unsigned tn = 16;
    while (tn < 64 && tn < experts)
        tn <<= 1;
    return tn;
}

/* The tiled kernel with tile_configs[c], if the device can run it. */
static bool tiled_shape(const moecl_device_info *info, size_t c, unsigned experts, unsigned k, grounded_shape *shape)
{
    const unsigned tm = tile_configs[c][0], mt = tile_configs[c][1], nt = tile_configs[c][2];
    const unsigned tn = tile_experts(experts), tk = 16;
    if (mt == 8 && tn < 64)
        return false;
    size_t local = (size_t)(tm / mt) * (tn / nt);
    if (local < tm || local > info->max_work_group_size || tiled_local_bytes(tm, tn, tk, k) > moecl_local_budget(info))
        return false;
    *shape = (grounded_shape){MOECL_KERNEL_TILED, tm, tn, tk, mt, nt, 1, 1, 1, false, local, tm,
                              "grounded_router_tiled", 0, 0, 0, 0, 0};
    return true;
}

/* The team kernel with team work-items per token and rows tokens a
 * work-group, if the device can run it. */
static bool team_shape(const moecl_device_info *info, unsigned team, unsigned rows, unsigned hidden,
                       unsigned experts, unsigned k, grounded_shape *shape)
{
    const unsigned ept = (experts + team - 1) / team;
    if ((size_t)team * rows > info->max_work_group_size ||
        team_local_bytes(hidden, team, ept, rows, k) > moecl_local_budget(info))
        return false;
    /* Shuffles need teams inside a warp and work-groups of whole warps. */
    const bool shuffle = info->ptx && team <= 32 && (team * rows) % 32 == 0;
    /* mt, nt: defines every kernel's source expects. */
    *shape = (grounded_shape){MOECL_KERNEL_TEAM, 8, 0, 0, 4, 4, team, rows, ept, shuffle, (size_t)team * rows, rows,
                              "grounded_router_team", 0, 0, 0, 0, 0};
    return true;
}

/* Whether a request may run on tensor cores: f16 and bf16 always, f32 only
 * with the opt-in TF32 precisions (FP32 never does); never the dispatch,
 * which needs the team kernel. */
static bool mma_wanted(const grounded_request *r)
{
    return !r->dispatch && (r->desc->hidden_dtype != MOECL_F32 || r->desc->precision != MOECL_PRECISION_FP32);
}

/* Whether the device runs the mma instructions themselves: NVIDIA sm_80+
 * (bf16 and tf32 mma.sync) with inline PTX. Elsewhere the kernel is only
 * forced (MOECL_GROUNDED_KERNEL=mma) and runs emulated. */
static bool mma_native(const moecl_device_info *info)
{
    return info->ptx && info->nv_compute_major >= 8;
}

/* grounded_router_mma for the request, if the device can run it: every
 * expert in one pass, warps of 64 experts (8 n8 tiles), as many warps
 * along the experts as needed and along the tokens up to 8 warps in all;
 * each warp two m16 tiles, then one, with k steps of 16 words, then 8, as
 * local memory allows. Many tokens a work-group, because each work-group
 * reads the whole ground table: at 16384 x 4096 x 128 bf16, 128 tokens a
 * work-group read as many ground bytes as hidden ones. */
static bool mma_shape(const moecl_device_info *info, const grounded_request *r, grounded_shape *shape)
{
    if (!mma_wanted(r))
        return false;
    const unsigned experts = r->desc->num_experts;
    const unsigned nt = experts >= 64 ? 8 : (experts + 7) / 8;
    const unsigned wn = (experts + 8 * nt - 1) / (8 * nt);
    const unsigned wm = wn >= 8 ? 1 : 8 / wn;
    /* The emulation's scratch where the device has no mma.sync. */
    const bool emulated = !mma_native(info);
    static const unsigned tries[][3] = {{1, 2, 16}, {1, 2, 8}, {1, 1, 16}, {1, 1, 8}, {2, 1, 8}, {4, 1, 8}};
    for (size_t i = 0; i < sizeof(tries) / sizeof(tries[0]); i++) {
        const unsigned w = wm / tries[i][0] ? wm / tries[i][0] : 1, mi = tries[i][1], kw = tries[i][2];
        const unsigned tm = 16 * mi * w, tn = 8 * nt * wn;
        const size_t local = (size_t)32 * w * wn;
        if (local > info->max_work_group_size ||
            LAYOUT_GROUNDED_MMA_LOCAL_BYTES((size_t)tm, (size_t)tn, (size_t)kw, (size_t)w * wn, emulated) >
                moecl_local_budget(info))
            continue;
        *shape = (grounded_shape){MOECL_KERNEL_MMA, tm, tn, kw, 4, 4, 1, 1, 1, false, local, tm,
                                  "grounded_router_mma", mi, nt, w, wn, kw};
        return true;
    }
    return false;
}

/* The plain-loop kernel with `rows` work-items a work-group, each taking
 * 8 tokens (grounded_router_rows' register block, TM). */
static grounded_shape rows_shape(unsigned rows)
{
    return (grounded_shape){MOECL_KERNEL_ROWS, 8, 0, 0, 4, 4, 1, 1, 1, false, rows, (size_t)rows * 8,
                            "grounded_router_rows", 0, 0, 0, 0, 0};
}

/* The check: whether the device can run configuration c for the request,
 * for its exact hidden size, and the shape it launches. */
static bool check_config(const moecl_device_info *info, const moecl_launch_config *c, const void *request,
                         void *shape_out)
{
    const grounded_request *r = request;
    grounded_shape *shape = shape_out;
    const unsigned hidden = r->desc->hidden_dim, experts = r->desc->num_experts, k = r->desc->top_k;
    switch (c->kernel) {
    case MOECL_KERNEL_ROWS:
        if (c->team != 1 || !moecl_is_pow2(c->rows) || c->rows > info->max_work_group_size)
            return false;
        *shape = rows_shape(c->rows);
        return true;
    case MOECL_KERNEL_TEAM:
        return c->team >= 2 && c->team <= MOECL_LAUNCH_MAX_TEAM && moecl_is_pow2(c->team) && moecl_is_pow2(c->rows) &&
               team_shape(info, c->team, c->rows, hidden, experts, k, shape);
    case MOECL_KERNEL_MMA:
        return mma_shape(info, r, shape);
    case MOECL_KERNEL_TILED:
        for (size_t t = 0; t < NUM_TILE_CONFIGS; t++)
            if (tile_configs[t][0] == c->tile && tiled_shape(info, t, experts, k, shape))
                return true;
        return false;
    }
    return false;
}

/* The rule: the configuration the device facts (and the environment's
 * record) give a request. */
static moecl_launch_config rule_config(const moecl_device_info *info, const void *request)
{
    const grounded_request *r = request;
    const unsigned hidden = r->desc->hidden_dim, experts = r->desc->num_experts, k = r->desc->top_k;
    const moecl_launch_config rows_kernel = {MOECL_KERNEL_ROWS, 1, 8, 0};
    grounded_shape shape;
    /* Tensor cores where the device has them (or forced): the default for
     * f16 and bf16 and for the TF32 precisions. */
    if ((info->env.grounded_mma || mma_native(info)) && mma_shape(info, r, &shape))
        return (moecl_launch_config){MOECL_KERNEL_MMA, 1, 0, 0};
    /* MOECL_GROUNDED_TILE asks for the GPU rule unless MOECL_LAUNCH_CLASS=cpu. */
    if (info->launch_class == MOECL_LAUNCH_CPU && (!info->env.grounded_wide_tile || info->env.launch_class_forced))
        return rows_kernel;
    /* Small expert tables (the seed's 16 x 128): a team per token, the table
     * in local memory. */
    if (experts <= 64) {
        unsigned team = 1;
        while (team < experts && team < 32)
            team <<= 1;
        for (unsigned rows = 128 / team; team > 1 && rows >= 1; rows >>= 1)
            if ((rows >= 4 || rows * team >= 64) && team_shape(info, team, rows, hidden, experts, k, &shape))
                return (moecl_launch_config){MOECL_KERNEL_TEAM, team, rows, 0};
    }
    for (size_t c = info->env.grounded_wide_tile ? 0 : 1; c < NUM_TILE_CONFIGS; c++)
        if (tiled_shape(info, c, experts, k, &shape))
            return (moecl_launch_config){MOECL_KERNEL_TILED, 1, 0, tile_configs[c][0]};
    return rows_kernel; /* a device too small for either still runs the plain loops */
}

static const moecl_launch_rule launch_rule = {rule_config, check_config};

static moecl_launch_source resolve(const moecl_context *ctx, const moecl_device_info *info, const grounded_request *r,
                                   moecl_launch_config *config, grounded_shape *shape)
{
    const moecl_launch_key key = moecl_launch_key_grounded(r->desc->hidden_dim, r->desc->num_experts, r->desc->top_k);
    return moecl_launch_resolve(ctx, info, &key, &launch_rule, r, config, shape);
}

moecl_launch_source moecl_grounded_router_launch(const moecl_context *ctx, const moecl_grounded_router_desc *d,
                                                 moecl_launch_key *key, moecl_launch_config *config)
{
    const grounded_request r = {d, true, false, false, false};
    grounded_shape shape;
    *key = moecl_launch_key_grounded(d->hidden_dim, d->num_experts, d->top_k);
    return resolve(ctx, &ctx->info, &r, config, &shape);
}

/* The -D defines of the variant of request r in shape s. */
static void defines_of(const grounded_request *r, const grounded_shape *s, char *defines, size_t size)
{
    const moecl_grounded_router_desc *d = r->desc;
    snprintf(defines, size,
             "-DHIDDEN_DIM=%u -DNUM_EXPERTS=%u -DTOPK=%u -DIN_DTYPE=%d -DHAS_PAIRS=%d -DHAS_WEIGHTS=%d -DHAS_IDS=%d "
             "-DKERNEL=%d -DTM=%u -DTN=%u -DTK=%u -DMT=%u -DNT=%u -DTEAM=%u -DROWS=%u -DEPT=%u -DTEAM_SHUFFLE=%d",
             d->hidden_dim, d->num_experts, d->top_k, (int)d->hidden_dtype, r->pairs, r->weights, r->ids,
             (int)s->kind, s->tm, s->tn, s->tk, s->mt, s->nt, s->team, s->rows, s->ept, s->shuffle ? 1 : 0);
    /* Appended only when set, so that the router's own variants keep their
     * defines (and disk-cache entries). */
    if (s->kind == MOECL_KERNEL_MMA) {
        const size_t used = strlen(defines);
        snprintf(defines + used, size > used ? size - used : 0,
                 " -DPRECISION=%d -DMMA_MI=%u -DMMA_NT=%u -DMMA_WM=%u -DMMA_WN=%u -DMMA_KW=%u", (int)d->precision,
                 s->mma_mi, s->mma_nt, s->mma_wm, s->mma_wn, s->mma_kw);
    }
    if (r->dispatch) {
        const size_t used = strlen(defines);
        snprintf(defines + used, size > used ? size - used : 0, " -DROUTE_DISPATCH=1 -DFUSED_WG=%u",
                 s->team * s->rows);
    }
}

void moecl_grounded_router_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc,
                                   bool pairs, bool weights, bool ids, char *buf, size_t size,
                                   const char **kernel_name)
{
    const grounded_request r = {desc, pairs, weights, ids, false};
    moecl_launch_config config;
    grounded_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of(&r, &shape, buf, size);
    *kernel_name = shape.kernel_name;
}

void moecl_grounded_router_route_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc,
                                         char *buf, size_t size, const char **kernel_name)
{
    const grounded_request r = {desc, false, true, true, true};
    moecl_launch_config config;
    grounded_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of(&r, &shape, buf, size);
    *kernel_name = shape.kind == MOECL_KERNEL_TEAM ? shape.kernel_name : NULL;
}

/* The plan of a request (moecl_plan_build). */
static moecl_status build_plan(moecl_context *ctx, const void *request, moecl_plan *plan)
{
    const grounded_request *r = request;
    grounded_shape shape;
    plan->source = resolve(ctx, &ctx->info, r, &plan->config, &shape);
    plan->launch_key = moecl_launch_key_grounded(r->desc->hidden_dim, r->desc->num_experts, r->desc->top_k);
    if (r->dispatch && shape.kind != MOECL_KERNEL_TEAM)
        return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED, "grounded route dispatch in one kernel needs the team kernel");
    char defines[512];
    defines_of(r, &shape, defines, sizeof(defines));
    moecl_status st = moecl_variant_get(ctx, r->dispatch ? MOECL_PROGRAM_GROUNDED_DISPATCH : MOECL_PROGRAM_GROUNDED_ROUTER,
                                        defines, shape.kernel_name, &plan->variants[0]);
    if (st != MOECL_SUCCESS)
        return st;
    plan->num_kernels = 1;
    plan->kernel_names[0] = shape.kernel_name;
    plan->limits[0] = moecl_variant_work_group_limit(plan->variants[0]);
    plan->local = shape.local;
    plan->rows_per_group = shape.rows_per_group;
    return MOECL_SUCCESS;
}

/* Everything the defines depend on, packed: dtype 2 bits, the three
 * outputs, experts 13, top_k 7, hidden 17, the dispatch epilogue, the
 * precision 2. */
static moecl_plan_key key_of(const moecl_context *ctx, const grounded_request *r)
{
    const moecl_grounded_router_desc *d = r->desc;
    const uint64_t a = (uint64_t)d->hidden_dtype | (uint64_t)r->pairs << 2 | (uint64_t)r->weights << 3 |
                       (uint64_t)r->ids << 4 | (uint64_t)d->num_experts << 5 | (uint64_t)d->top_k << 18 |
                       (uint64_t)d->hidden_dim << 25 | (uint64_t)r->dispatch << 42 |
                       (uint64_t)d->precision << 43;
    return moecl_plan_key_of(ctx, MOECL_OP_GROUNDED_ROUTER, a, 0);
}

moecl_status moecl_grounded_router_plan(moecl_context *ctx, const moecl_grounded_router_desc *desc, bool pairs,
                                        bool weights, bool ids, const moecl_plan **plan)
{
    const grounded_request r = {desc, pairs, weights, ids, false};
    const moecl_plan_key key = key_of(ctx, &r);
    return moecl_plan_get(ctx, &key, build_plan, &r, plan);
}

moecl_status moecl_grounded_router_route_plan(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                              const moecl_plan **plan)
{
    const grounded_request r = {desc, false, true, true, true};
    const moecl_plan_key key = key_of(ctx, &r);
    return moecl_plan_get(ctx, &key, build_plan, &r, plan);
}

moecl_status moecl_grounded_router_prepare(moecl_context *ctx, const moecl_grounded_router_desc *desc)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = moecl_grounded_router_validate(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    /* The outputs are a build-time choice: prepare the seed's pairs, the
     * separate weights and ids, and all three. */
    const moecl_plan *p;
    if ((st = moecl_grounded_router_plan(ctx, desc, true, false, false, &p)) == MOECL_SUCCESS &&
        (st = moecl_grounded_router_plan(ctx, desc, false, true, true, &p)) == MOECL_SUCCESS)
        st = moecl_grounded_router_plan(ctx, desc, true, true, true, &p);
    return st;
}

/* The buffers of a call, in the kernel's argument order, and whether
 * binding validates them (the caller's; the host path's own need none). */
enum { HIDDEN, LOGITS, GROUND, PAIRS, WEIGHTS, IDS, NUM_BUFFERS };
_Static_assert(NUM_BUFFERS == MOECL_GROUNDED_BUFFERS, "the binding's buffers");
typedef struct bound_buffers {
    moecl_buffer b[NUM_BUFFERS];
    bool check;
} bound_buffers;

static const char *const buffer_names[NUM_BUFFERS] = {"token_hidden", "router_logits", "expert_ground",
                                                      "out_pairs",    "topk_weights",  "topk_ids"};

void moecl_grounded_router_bind(const moecl_grounded_router_desc *d, const moecl_buffer buffers[NUM_BUFFERS],
                                bool check, bool outputs_required, moecl_grounded_binding *b)
{
    const uint64_t t = d->num_tokens, h = d->hidden_dim, e = d->num_experts, k = d->top_k;
    const size_t in_size = moecl_dtype_size(d->hidden_dtype);
    const uint64_t bytes[NUM_BUFFERS] = {t * h * in_size, t * e * 4, e * h * in_size, t * k * 8, t * k * 4, t * k * 4};
    for (int i = 0; i < NUM_BUFFERS; i++) {
        const size_t elem = i == HIDDEN || i == GROUND ? in_size : 4;
        const bool required = i < PAIRS || (outputs_required && i != PAIRS);
        b->mem[i] = buffers[i].mem;
        b->checks[i] = (moecl_buffer_check){buffer_names[i], bytes[i], buffers[i].offset, elem, required};
        /* Offsets travel in elements: the kernels index typed pointers. */
        b->off[i] = buffers[i].offset / elem;
        b->args[2 * i] = MOECL_ARG_CHECKED(b->mem[i], check ? &b->checks[i] : NULL);
        b->args[2 * i + 1] = MOECL_ARG(b->off[i]);
    }
    b->num_tokens = d->num_tokens;
    b->alpha = d->alpha;
    b->args[2 * NUM_BUFFERS] = MOECL_ARG(b->num_tokens);
    b->args[2 * NUM_BUFFERS + 1] = MOECL_ARG(b->alpha);
}

/* Bind and enqueue (src/plan.c). */
static moecl_status launch(moecl_context *ctx, const moecl_grounded_router_desc *d, const bound_buffers *b,
                           cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    moecl_grounded_binding bound;
    moecl_grounded_router_bind(d, b->b, b->check, false, &bound);
    const grounded_request r = {d, b->b[PAIRS].mem != NULL, b->b[WEIGHTS].mem != NULL, b->b[IDS].mem != NULL, false};
    const moecl_launch_call call = {key_of(ctx, &r), build_plan, &r, bound.args, MOECL_GROUNDED_ARGS, d->num_tokens,
                                    NULL, 0, 0, NULL};
    return moecl_plan_launch(ctx, &call, num_wait, wait, done);
}

moecl_status moecl_grounded_router(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                   moecl_buffer token_hidden, moecl_buffer router_logits, moecl_buffer expert_ground,
                                   moecl_buffer out_pairs, moecl_buffer topk_weights, moecl_buffer topk_ids,
                                   cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = moecl_grounded_router_validate(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    if (!out_pairs.mem && !topk_weights.mem && !topk_ids.mem)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "out_pairs, topk_weights, topk_ids: all absent; at least one output is needed");
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS)
        return st;
    const bound_buffers b = {{token_hidden, router_logits, expert_ground, out_pairs, topk_weights, topk_ids}, true};
    return launch(ctx, desc, &b, num_wait, wait, done);
}

moecl_status moecl_grounded_router_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                        const void *token_hidden, const float *router_logits, const void *expert_ground,
                                        float *out_pairs, float *topk_weights, int32_t *topk_ids)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = moecl_grounded_router_validate(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    if (!out_pairs && !topk_weights && !topk_ids)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "out_pairs, topk_weights, topk_ids: all NULL; at least one output is needed");
    if (desc->num_tokens > 0 && (!token_hidden || !router_logits || !expert_ground))
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL",
                          !token_hidden ? "token_hidden" : !router_logits ? "router_logits" : "expert_ground");
    const moecl_plan *p;
    if ((st = moecl_grounded_router_plan(ctx, desc, out_pairs != NULL, topk_weights != NULL, topk_ids != NULL, &p)) !=
            MOECL_SUCCESS ||
        desc->num_tokens == 0)
        return st;
    const size_t t = desc->num_tokens, h = desc->hidden_dim, e = desc->num_experts, k = desc->top_k;
    const size_t in_size = moecl_dtype_size(desc->hidden_dtype);
    bound_buffers b;
    memset(&b, 0, sizeof(b));
    const void *inputs[3] = {token_hidden, router_logits, expert_ground};
    void *outputs[3] = {out_pairs, topk_weights, topk_ids};
    const size_t sizes[NUM_BUFFERS] = {t * h * in_size, t * e * 4, e * h * in_size, t * k * 8, t * k * 4, t * k * 4};
    cl_event ran = NULL;
    for (int i = 0; i < NUM_BUFFERS && st == MOECL_SUCCESS; i++)
        if (i < PAIRS || outputs[i - PAIRS])
            st = moecl_host_buffer(ctx, buffer_names[i], i < PAIRS ? CL_MEM_READ_ONLY : CL_MEM_WRITE_ONLY, sizes[i],
                                   i < PAIRS ? inputs[i] : NULL, &b.b[i].mem);
    if (st == MOECL_SUCCESS)
        st = launch(ctx, desc, &b, 0, NULL, &ran);
    if (st == MOECL_SUCCESS) {
        const cl_mem mems[3] = {b.b[PAIRS].mem, b.b[WEIGHTS].mem, b.b[IDS].mem};
        st = moecl_read_back(ctx, ran, 3, mems, sizes + PAIRS, outputs);
    }
    if (ran)
        clReleaseEvent(ran);
    for (int i = 0; i < NUM_BUFFERS; i++)
        if (b.b[i].mem)
            clReleaseMemObject(b.b[i].mem);
    return st;
}
