/* Grounded router, host side: validation, the kernel variant a request
 * needs, argument binding and one enqueue; and the blocking host path. */
#include <float.h>
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
                              MOECL_GROUP_FILL_NEG_INF, false, 0.0f, 1.0f, 0.0f};
    d.num_shared_experts = 0;
    d.shared_expert_weight = 1.0f;
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
    if ((unsigned)d->logits_dtype > MOECL_BF16)
        return INVALID("logits_dtype is %d; it must be MOECL_F32, MOECL_F16 or MOECL_BF16", (int)d->logits_dtype);
    /* A subnormal cap is refused as the renormalisation floor is: a device
     * without denormals would divide by 0. */
    if (!(d->logit_softcap == 0.0f || (isfinite(d->logit_softcap) && d->logit_softcap >= FLT_MIN)))
        return INVALID("logit_softcap is %g; it must be 0 or a finite float >= FLT_MIN (2^-126)",
                       (double)d->logit_softcap);
    /* The gating fields: top-k gating's rules and messages. */
    const moecl_topk_gating_desc gating = moecl_grounded_gating_desc(d);
    return moecl_topk_gating_validate(ctx, &gating);
#undef INVALID
}

uint64_t moecl_grounded_logit_rows(const moecl_grounded_router_desc *d)
{
    return d->router_logits_row ? 1 : d->num_tokens;
}

moecl_topk_gating_desc moecl_grounded_gating_desc(const moecl_grounded_router_desc *d)
{
    moecl_topk_gating_desc t = moecl_topk_gating_desc_init(d->num_tokens, d->num_experts, d->top_k);
    const moecl_gating *g = &d->gating;
    t.scoring = g->scoring;
    t.weighting = g->weighting;
    t.num_expert_groups = g->num_expert_groups;
    t.topk_group = g->topk_group;
    t.group_score = g->group_score;
    t.group_fill = g->group_fill;
    t.renormalize = g->renormalize;
    t.renormalize_floor = g->renormalize_floor;
    t.renormalize_eps = g->renormalize_eps;
    t.routed_scaling_factor = g->routed_scaling_factor;
    t.weights_dtype = d->weights_dtype;
    t.ids_dtype = d->ids_dtype;
    t.bias_dtype = d->bias_dtype;
    t.num_shared_experts = d->num_shared_experts;
    t.shared_expert_weight = d->shared_expert_weight;
    return t;
}

/* What a configuration launches on a device. */
typedef struct grounded_shape {
    moecl_kernel_kind kind;
    unsigned tm, tn, tk;       /* tiled: tile of tokens x experts x hidden step */
    unsigned mt, nt;           /* tiled: each work-item's register block */
    unsigned vec, db;          /* tiled: vector width, double buffering */
    unsigned wc;               /* tiled: work-items side by side along the experts */
    unsigned team, rows, ept;  /* team */
    bool shuffle;              /* team: warp shuffles (inline PTX) */
    size_t local;              /* work-group size */
    size_t rows_per_group;     /* tokens a work-group routes */
    const char *kernel_name;
    unsigned mma_mi, mma_nt, mma_wm, mma_wn, mma_kw; /* mma: a warp's m16 and n8 tiles, warps, words a k step */
    unsigned split_chunks, split_groups; /* split-K: hidden chunks, work-groups of a token block */
} grounded_shape;

/* A request: the descriptor, the outputs the call writes, and whether the
 * team kernel ends with the dispatch (moecl_grounded_route_dispatch). */
typedef struct grounded_request {
    const moecl_grounded_router_desc *desc;
    bool pairs, weights, ids, dispatch;
    bool has_bias, no_logits; /* moecl_router: a bias; router_logits absent */
    /* moecl_router_ex's options: the histograms, the valid count, the
     * per-expert scale, and the capture (0, or 1 + its moecl_index_dtype) */
    bool counts, load, valid, scale;
    unsigned capture;
    bool shared_gate; /* moecl_router_ex's shared_expert_gate */
    /* few enough tokens for the split-K kernel by the device table
     * (MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS) */
    bool small;
} grounded_request;

/* Whether the tiled kernel's running top-k serves the request: selection
 * on g itself, no bias, no groups (cl/grounded_router.cl, MERGEABLE). */
static bool mergeable(const grounded_request *r)
{
    return r->desc->gating.scoring == MOECL_SCORING_RAW && !r->has_bias && r->desc->gating.num_expert_groups == 0;
}

/* The team kernel's local memory beyond the seed's gating: the pipeline's
 * softmax slots and group arrays (cl/gating.cl, TEAM_GATING_LOCALS), as a
 * bound for every variant (softmax, no shuffles). */
static size_t gating_extra_local(unsigned team, unsigned rows, unsigned k, unsigned experts, unsigned groups)
{
    return moecl_layout_topk_team_local(team, rows, experts, k, groups, true, false) -
           moecl_layout_topk_team_local(team, rows, experts, k, 0, false, false);
}

/* Local memory of grounded_router_tiled and grounded_router_team
 * (cl/layout.h). */
static size_t tiled_local_bytes(unsigned tm, const moecl_tile_params *p, unsigned k)
{
    return moecl_layout_grounded_tiled_local(tm, p->tn, p->tk, p->vec, p->db, k);
}

static size_t team_local_bytes(unsigned hidden, unsigned team, unsigned ept, unsigned rows, unsigned k,
                               unsigned experts, unsigned groups)
{
    return moecl_layout_grounded_team_local(hidden, team, ept, rows, k) +
           gating_extra_local(team, rows, k, experts, groups);
}

size_t moecl_grounded_router_team_local(const moecl_grounded_router_desc *d, unsigned team, unsigned rows)
{
    return team_local_bytes(d->hidden_dim, team, (d->num_experts + team - 1) / team, rows, d->top_k, d->num_experts,
                            d->gating.num_expert_groups);
}

/* The tiled kernel's configurations: the rule's, in the order it tries
 * them, then the ones only moecl-tune's sweep, a tune file or
 * the override's tile= asks for. tn 0: the experts rounded up to a power of
 * two, 16 to 64. The rule starts at 64 tokens with 4 x 4 blocks; 128
 * tokens with 8 x 8 blocks measured slower on the H200 in a form of the
 * kernel without its vector loads and double buffering (3109 against
 * 1125 us at 16384 x 4096 x 128, top 8), so only the override tile=128
 * starts the rule there. */
#define RULE_TILE_CONFIGS 4
static const moecl_launch_config tile_configs[] = {
    /* the rule's (the override tile=128 starts at the first) */
    {MOECL_KERNEL_TILED, 1, 0, 128, {0, 16, 8, 8, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {0, 16, 4, 4, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 32, {0, 16, 4, 4, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 16, {0, 16, 4, 4, 4, 1, 0}},
    /* all 128 experts of a token in one tile: 8 x 8 and 8 x 4 blocks */
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 8, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 8, 8, 8, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 32, 8, 8, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 4, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 4, 8, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 32, {128, 16, 4, 8, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 32, {128, 16, 8, 4, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 128, {128, 16, 8, 8, 4, 1, 0}},
    /* 64 experts a tile */
    {MOECL_KERNEL_TILED, 1, 0, 64, {64, 16, 8, 8, 4, 1, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {64, 16, 4, 4, 4, 0, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 128, {64, 16, 8, 8, 4, 0, 0}},
    /* scalar and pair loads */
    {MOECL_KERNEL_TILED, 1, 0, 64, {64, 16, 4, 4, 1, 0, 0}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 8, 2, 1, 0}},
    /* warps of several tokens and experts (wc: work-items along the
     * experts), so that one local read serves more of a warp */
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 4, 4, 1, 8}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 4, 4, 1, 4}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 8, 4, 1, 4}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 8, 4, 1, 8}},
    {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 16, 4, 4, 1, 8}},
    {MOECL_KERNEL_TILED, 1, 0, 128, {64, 16, 8, 8, 4, 1, 4}},
};
#define NUM_TILE_CONFIGS (sizeof(tile_configs) / sizeof(tile_configs[0]))

const moecl_launch_config *moecl_grounded_tile_configs(size_t *count)
{
    *count = NUM_TILE_CONFIGS;
    return tile_configs;
}

/* Experts a tile of the tiled kernel covers where its configuration leaves
 * it open. */
static unsigned tile_experts(unsigned experts)
{
    unsigned tn = 16;
    while (tn < 64 && tn < experts)
        tn <<= 1;
    return tn;
}

/* The tiled kernel in configuration c (the table's first entry of its
 * tokens when c leaves the tile open), if the device can run it: a
 * work-group of at least a work-item per token (the merge takes one each)
 * within the device's limit, and local memory. */
static bool tiled_shape(const moecl_device_info *info, const moecl_launch_config *c, unsigned experts, unsigned k,
                        grounded_shape *shape)
{
    moecl_tile_params p = c->tiled;
    if (!p.tk) {
        size_t t = 0;
        while (t < NUM_TILE_CONFIGS && tile_configs[t].tile != c->tile)
            t++;
        if (t == NUM_TILE_CONFIGS)
            return false;
        p = tile_configs[t].tiled;
    }
    if (!p.tn)
        p.tn = tile_experts(experts);
    const unsigned tm = c->tile;
    if (!p.mt || !p.nt || !p.vec || tm % p.mt || p.tn % p.nt || p.tk % p.vec)
        return false;
    size_t local = (size_t)(tm / p.mt) * (p.tn / p.nt);
    if (local < tm || local > info->max_work_group_size || tiled_local_bytes(tm, &p, k) > moecl_local_budget(info))
        return false;
    const unsigned wc = p.wc ? p.wc : p.tn / p.nt;
    if ((p.tn / p.nt) % wc)
        return false;
    *shape = (grounded_shape){MOECL_KERNEL_TILED, tm, p.tn, p.tk, p.mt, p.nt, p.vec, p.db, wc, 1, 1, 1, false, local, tm,
                              "grounded_router_tiled", 0, 0, 0, 0, 0, 0, 0};
    return true;
}

/* The team kernel with team work-items per token and rows tokens a
 * work-group, if the device can run it. */
static bool team_shape(const moecl_device_info *info, unsigned team, unsigned rows, unsigned hidden,
                       unsigned experts, unsigned k, unsigned groups, grounded_shape *shape)
{
    const unsigned ept = (experts + team - 1) / team;
    if ((size_t)team * rows > info->max_work_group_size ||
        team_local_bytes(hidden, team, ept, rows, k, experts, groups) > moecl_local_budget(info))
        return false;
    /* Shuffles need teams inside a warp and work-groups of whole warps. */
    const bool shuffle = info->ptx && team <= 32 && (team * rows) % 32 == 0;
    /* mt, nt: defines every kernel's source expects. */
    *shape = (grounded_shape){MOECL_KERNEL_TEAM, 8, 0, 0, 4, 4, 1, 0, 0, team, rows, ept, shuffle, (size_t)team * rows,
                              rows, "grounded_router_team", 0, 0, 0, 0, 0, 0, 0};
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
 * forced (the override grounded=mma) and runs emulated. */
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
        *shape = (grounded_shape){MOECL_KERNEL_MMA, tm, tn, kw, 4, 4, 1, 0, 0, 1, 1, 1, false, local, tm,
                                  "grounded_router_mma", mi, nt, w, wn, kw, 0, 0};
        return true;
    }
    return false;
}

/* The gating pipeline's loops for one token of the request. */
static uint64_t gating_loops(const grounded_request *r)
{
    const moecl_grounded_router_desc *d = r->desc;
    return moecl_rows_gating_loops(d->num_experts, d->top_k, d->gating.num_expert_groups, d->gating.topk_group);
}

/* An upper bound on the loop iterations of a work-item of the rows kernel
 * with tm tokens: a value of the dot products per 4 iterations and 8 an
 * expert, then the gating. On rusticl's llvmpipe (MOECL_DP_LOOP_LIMIT
 * 65535) one token at hidden 4096 routed 72 experts right and 80 wrong
 * (some 4.5 values an iteration), and 4096 experts at hidden 16, top 64,
 * wrong (the expert loops and the gating). */
static uint64_t rows_loops(const grounded_request *r, unsigned tm)
{
    const uint64_t experts = r->desc->num_experts, hidden = r->desc->hidden_dim;
    return tm * (experts * hidden / 4 + 8 * experts + gating_loops(r));
}

/* The plain-loop kernel with `rows` work-items a work-group, each taking
 * LAYOUT_GROUNDED_ROWS_TM tokens (grounded_router_rows' TM), fewer where
 * the driver's loop limit would cut the work-item's loops short; false
 * where one token a work-item passes it too. */
static bool rows_shape(const moecl_device_info *info, const grounded_request *r, unsigned rows,
                       grounded_shape *shape)
{
    unsigned tm = LAYOUT_GROUNDED_ROWS_TM(r->desc->num_experts, r->desc->top_k);
    while (tm > 1 && !moecl_loops_fit(info, rows_loops(r, tm)))
        tm = tm > 8 ? 8 : tm / 2;
    if (!moecl_loops_fit(info, rows_loops(r, tm)))
        return false;
    *shape = (grounded_shape){MOECL_KERNEL_ROWS, tm, 0, 0, 4, 4, 1, 0, 0, 1, 1, 1, false, rows, (size_t)rows * tm,
                              "grounded_router_rows", 0, 0, 0, 0, 0, 0, 0};
    return true;
}

/* An upper bound on the loop iterations of a work-item of the split-K
 * kernel (wg work-items, tm tokens, tiles of tn experts, chunks of tk):
 * the staging, the tile's expert rows, the last work-group's gather of
 * the chunks and its gating (a token a work-item). */
static uint64_t splitk_loops(const grounded_request *r, unsigned wg, unsigned tm, unsigned tn, unsigned tk,
                             unsigned chunks)
{
    const uint64_t lanes = LAYOUT_SPLITK_LANES(wg), rows = LAYOUT_SPLITK_ROWS(wg);
    const uint64_t g_stride = (r->desc->num_experts + 7) / 8 * 8;
    const uint64_t stage = (uint64_t)tm * tk / wg + 1;
    const uint64_t tile = (tn + rows - 1) / rows * (3 * (uint64_t)tm + tk / 4 / lanes + 1 + lanes);
    const uint64_t gather = ((uint64_t)tm * g_stride / wg + 1) * (chunks + 1);
    return stage + tile + gather + gating_loops(r);
}

/* The split-K kernel for the request with hidden chunks of `chunk` indices
 * (0: the largest power of two from 1024 down to the device table's
 * MOECL_DP_GROUNDED_SPLITK_MIN_CHUNK that gives a token block at least two
 * work-groups per compute unit, or that floor), if the device runs it: a
 * work-group of 256 work-items (fewer where the device allows fewer, 32 at
 * least), tiles of 64 experts (fewer for a smaller table), TM 8 tokens a
 * block (at most a token a row of lanes), 4, 2 or 1 where local memory
 * holds no more; the gating by teams of 32 lanes a token above 32
 * experts where their arrays fit and the driver has no loop limit, else
 * a work-item a token; and on a device whose
 * work-groups' private arrays are limited (pocl), the gating's arrays
 * within it. Never the dispatch, which needs the team kernel. */
static bool splitk_shape_within(const moecl_device_info *info, const grounded_request *r, unsigned chunk,
                                size_t wg_max, grounded_shape *shape)
{
    if (r->dispatch)
        return false;
    const unsigned hidden = r->desc->hidden_dim, experts = r->desc->num_experts;
    unsigned wg = 256;
    while (wg > info->max_work_group_size || wg > wg_max)
        wg >>= 1;
    if (wg < 32)
        return false;
    const moecl_device_params table = moecl_device_table_params(info);
    const uint32_t private_max = table.value[MOECL_DP_PRIVATE_MAX];
    const unsigned k = r->desc->top_k, lanes = LAYOUT_SPLITK_LANES(wg), rows = LAYOUT_SPLITK_ROWS(wg);
    unsigned tn = rows;
    while (tn < 64 && tn < experts)
        tn <<= 1;
    const unsigned tiles = (experts + tn - 1) / tn;
    unsigned tk = chunk;
    if (!tk) {
        const unsigned floor = table.value[MOECL_DP_GROUNDED_SPLITK_MIN_CHUNK];
        tk = 1024;
        while (tk > floor && (uint64_t)tiles * ((hidden + tk - 1) / tk) < 2 * (uint64_t)info->compute_units)
            tk >>= 1;
    }
    const unsigned chunks = (hidden + tk - 1) / tk;
    /* The gating: teams of a row's lanes, a token each, where there are
     * more experts than lanes and the teams' arrays fit; else a work-item
     * a token (a lane would hold one expert or none; top-k's team scratch
     * at top 16 of 512 experts is 6.4 KiB a row). H100, 2026-12-07, one
     * token: teams 18.9 against 82.3 us at 256 experts, 10.0 against 9.2
     * at 8. On a driver with a loop limit, a work-item a token: splitk_loops
     * bounds that pipeline, not a team lane's (its tie-breaking top-k
     * loops grow as 32 min(EPT, k)^2). A team is a warp's 32 lanes in a
     * work-group of whole warps, as shuffles need. */
    const unsigned team_tries[] = {lanes, 1};
    const bool teams = experts > lanes && !table.value[MOECL_DP_LOOP_LIMIT];
    for (size_t t = teams ? 0 : 1; t < sizeof(team_tries) / sizeof(team_tries[0]); t++) {
        const unsigned team = team_tries[t];
        const bool by_teams = team > 1;
        const size_t private_bytes = by_teams ? moecl_layout_topk_team_private(team, experts)
                                              : moecl_layout_grounded_rows_private(1, experts, k);
        if (private_max && (uint64_t)wg * private_bytes > private_max)
            continue;
        const size_t gating_local =
            by_teams ? moecl_layout_topk_team_local(team, rows, experts, k, r->desc->gating.num_expert_groups, true,
                                                    false)
                     : 0;
        for (unsigned tm = by_teams && rows < 8 ? rows : 8; tm >= 1; tm >>= 1)
            if (LAYOUT_GROUNDED_SPLITK_LOCAL_BYTES((size_t)tm, (size_t)tk, (size_t)wg, (size_t)experts) +
                        gating_local <=
                    moecl_local_budget(info) &&
                moecl_params_loops_fit(&table, splitk_loops(r, wg, tm, tn, tk, chunks))) {
                *shape = (grounded_shape){MOECL_KERNEL_SPLITK, tm, tn, tk, 4, 4, 1, 0, 0, team, by_teams ? rows : 1,
                                          by_teams ? (experts + team - 1) / team : 1, by_teams && info->ptx, wg, tm,
                                          "grounded_router_splitk", 0, 0, 0, 0, 0, chunks, tiles * chunks};
                return true;
            }
    }
    return false;
}

static bool splitk_shape(const moecl_device_info *info, const grounded_request *r, unsigned chunk,
                         grounded_shape *shape)
{
    return splitk_shape_within(info, r, chunk, 256, shape);
}

/* The split-K configuration of the request (its chunk written out), if the
 * device runs it. */
static bool splitk_config(const moecl_device_info *info, const grounded_request *r, unsigned chunk,
                          moecl_launch_config *config, grounded_shape *shape)
{
    if (!splitk_shape(info, r, chunk, shape))
        return false;
    *config = (moecl_launch_config){MOECL_KERNEL_SPLITK, 1, 0, shape->tk, {0}};
    return true;
}

/* The check: whether the device can run configuration c for the request,
 * for its exact hidden size, and the shape it launches. */
static bool check_config(const moecl_device_info *info, const moecl_launch_config *c, const void *request,
                         void *shape_out)
{
    const grounded_request *r = request;
    grounded_shape *shape = shape_out;
    const unsigned hidden = r->desc->hidden_dim, experts = r->desc->num_experts, k = r->desc->top_k;
    const unsigned groups = r->desc->gating.num_expert_groups;
    switch (c->kernel) {
    case MOECL_KERNEL_ROWS:
        return c->team == 1 && moecl_is_pow2(c->rows) && c->rows <= info->max_work_group_size &&
               rows_shape(info, r, c->rows, shape);
    case MOECL_KERNEL_TEAM:
        return c->team >= 2 && c->team <= MOECL_LAUNCH_MAX_TEAM && moecl_is_pow2(c->team) && moecl_is_pow2(c->rows) &&
               team_shape(info, c->team, c->rows, hidden, experts, k, groups, shape);
    case MOECL_KERNEL_MMA:
        return mma_shape(info, r, shape);
    case MOECL_KERNEL_SPLITK:
        return splitk_shape(info, r, c->tile, shape);
    case MOECL_KERNEL_TILED:
        /* Where the tensor cores serve the request, no table, tune file or
         * variable takes it off them (their launch key has no dtype). */
        if (mma_native(info) && mma_shape(info, r, &(grounded_shape){0}))
            return false;
        if (!mergeable(r))
            return false; /* the other gatings need whole rows of g */
        return tiled_shape(info, c, experts, k, shape);
    }
    return false;
}

/* The plain loops: two work-items of LAYOUT_GROUNDED_ROWS_TM (32, or 8)
 * tokens, at most 64 tokens a work-group, so that both cores of a small
 * CPU get work from 65 tokens on. Where one token a work-item passes the
 * driver's loop limit, the split-K kernel, whose work-items take a chunk
 * of the hidden dimension and a tile of the experts; where neither fits,
 * the plain loops, which the check then refuses (the call fails). */
static moecl_launch_config plain_config(const moecl_device_info *info, const grounded_request *r)
{
    const moecl_launch_config rows = {MOECL_KERNEL_ROWS, 1, 2, 0, {0}};
    moecl_launch_config splitk;
    grounded_shape shape;
    if (!moecl_loops_fit(info, rows_loops(r, 1)) && splitk_config(info, r, 0, &splitk, &shape))
        return splitk;
    return rows;
}

/* The rule: the configuration the device facts (and the environment's
 * record) give a request. */
static moecl_launch_config rule_config(const moecl_device_info *info, const void *request)
{
    const grounded_request *r = request;
    const unsigned hidden = r->desc->hidden_dim, experts = r->desc->num_experts, k = r->desc->top_k;
    const unsigned groups = r->desc->gating.num_expert_groups;
    /* The plain loops, or split-K where the driver's loop limit cuts them
     * short (plain_config). */
    const moecl_launch_config rows_kernel = plain_config(info, r);
    const moecl_launch_config *env_tile = &info->env.grounded_tile;
    const bool env_tiled = info->env.grounded_wide_tile || env_tile->kernel == MOECL_KERNEL_TILED;
    grounded_shape shape;
    moecl_launch_config splitk;
    /* Split-K where the override asks for it, at every token count. */
    if (info->env.grounded_splitk && splitk_config(info, r, info->env.splitk_chunk, &splitk, &shape))
        return splitk;
    /* Tensor cores where the device has them (or forced): the default for
     * f16 and bf16 and for the TF32 precisions, with the seed's gating. */
    if ((info->env.grounded_mma || mma_native(info)) && mma_shape(info, r, &shape))
        return (moecl_launch_config){MOECL_KERNEL_MMA, 1, 0, 0, {0}};
    /* the override's tile= asks for the GPU rule unless the override says class=cpu. */
    if (info->launch_class == MOECL_LAUNCH_CPU && (!env_tiled || info->env.launch_class_forced))
        return rows_kernel;
    /* One tiled configuration named by the override's tile= words, whatever the
     * shape, where the device runs it. */
    if (env_tile->kernel == MOECL_KERNEL_TILED && mergeable(r) && tiled_shape(info, env_tile, experts, k, &shape))
        return *env_tile;
    /* Small expert tables (the seed's 16 x 128): a team per token, the table
     * in local memory. */
    if (experts <= 64) {
        unsigned team = 1;
        while (team < experts && team < 32)
            team <<= 1;
        for (unsigned rows = 128 / team; team > 1 && rows >= 1; rows >>= 1)
            if ((rows >= 4 || rows * team >= 64) && team_shape(info, team, rows, hidden, experts, k, groups, &shape))
                return (moecl_launch_config){MOECL_KERNEL_TEAM, team, rows, 0, {0}};
    }
    /* The tiled kernel merges a running top-k, right only for mergeable
     * gatings; the others take the plain loops, which hold whole rows. */
    if (!mergeable(r))
        return rows_kernel;
    for (size_t c = info->env.grounded_wide_tile ? 0 : 1; c < RULE_TILE_CONFIGS; c++)
        if (tiled_shape(info, &tile_configs[c], experts, k, &shape)) {
            moecl_launch_config chosen = tile_configs[c];
            chosen.tiled.tn = shape.tn; /* written out, as a tune file holds it */
            return chosen;
        }
    return rows_kernel; /* a device too small for either still runs the plain loops */
}

static const moecl_launch_rule launch_rule = {rule_config, check_config};

static moecl_launch_source resolve(const moecl_context *ctx, const moecl_device_info *info, const grounded_request *r,
                                   moecl_launch_config *config, grounded_shape *shape)
{
    const moecl_launch_key key = moecl_launch_key_grounded(r->desc->hidden_dim, r->desc->num_experts, r->desc->top_k);
    /* No kernel name after it: no kernel fits the device (its loop limit). */
    shape->kernel_name = NULL;
    /* A call of few tokens goes split-K where the device table says so
     * and the hidden dimension splits (more than one chunk: a shorter walk
     * is short anyway), before the tune file's and the table's
     * configurations (keyed by shape, not by tokens); moecl_launch_force
     * and the override still decide. */
    if (ctx && r->small && !ctx->forced[MOECL_OP_GROUNDED_ROUTER].active &&
        !moecl_launch_env_decides(&info->env, MOECL_OP_GROUNDED_ROUTER) &&
        splitk_config(info, r, 0, config, shape) && shape->split_chunks > 1)
        return MOECL_SOURCE_TABLE;
    return moecl_launch_resolve(ctx, info, &key, &launch_rule, r, config, shape);
}

moecl_launch_source moecl_grounded_router_launch(const moecl_context *ctx, const moecl_grounded_router_desc *d,
                                                 moecl_launch_key *key, moecl_launch_config *config)
{
    const grounded_request r = {.desc = d, .pairs = true, .weights = false, .ids = false, .dispatch = false,
                                .has_bias = false, .no_logits = false};
    grounded_shape shape;
    *key = moecl_launch_key_grounded(d->hidden_dim, d->num_experts, d->top_k);
    return resolve(ctx, &ctx->info, &r, config, &shape);
}

/* The variant of request r: its parameters (src/variant.c), with the
 * launch shape s where it is known (the plan key needs none of it). */
static moecl_variant_values values_of(const grounded_request *r, const grounded_shape *s)
{
    const moecl_grounded_router_desc *d = r->desc;
    moecl_variant_values v;
    memset(&v, 0, sizeof(v));
    uint32_t *p = v.param;
    p[MOECL_GROUNDED_HIDDEN_DIM] = d->hidden_dim;
    p[MOECL_GROUNDED_NUM_EXPERTS] = d->num_experts;
    p[MOECL_GROUNDED_TOPK] = d->top_k;
    p[MOECL_GROUNDED_IN_DTYPE] = (uint32_t)d->hidden_dtype;
    p[MOECL_GROUNDED_HAS_PAIRS] = r->pairs;
    p[MOECL_GROUNDED_HAS_WEIGHTS] = r->weights;
    p[MOECL_GROUNDED_HAS_IDS] = r->ids;
    p[MOECL_GROUNDED_HAS_LOGITS] = !r->no_logits;
    p[MOECL_GROUNDED_PRECISION] = (uint32_t)d->precision;
    p[MOECL_GROUNDED_ROUTE_DISPATCH] = r->dispatch;
    p[MOECL_GROUNDED_LOGIT_ROUND] = (uint32_t)d->logits_dtype;
    const float cap = d->logit_softcap > 0.0f ? d->logit_softcap : 0.0f; /* -0: none, as 0 */
    memcpy(&p[MOECL_GROUNDED_SOFTCAP], &cap, sizeof(cap));
    p[MOECL_GROUNDED_LOGITS_ROW] = d->router_logits_row && !r->no_logits;
    p[MOECL_GROUNDED_HAS_COUNTS] = r->counts;
    p[MOECL_GROUNDED_HAS_LOAD] = r->load;
    p[MOECL_GROUNDED_HAS_VALID] = r->valid;
    p[MOECL_GROUNDED_CAPTURE] = r->capture;
    p[MOECL_GROUNDED_HAS_SCALE] = r->scale;
    p[MOECL_GROUNDED_SHARED] = d->num_shared_experts;
    p[MOECL_GROUNDED_SHARED_GATE] = d->num_shared_experts && r->shared_gate;
    /* The constant only where it is read: one plan for any other. */
    if (d->num_shared_experts && !r->shared_gate)
        memcpy(&p[MOECL_GROUNDED_SHARED_WEIGHT], &d->shared_expert_weight, sizeof(float));
    if (s) {
        p[MOECL_GROUNDED_KERNEL] = (uint32_t)s->kind;
        p[MOECL_GROUNDED_TM] = s->tm;
        p[MOECL_GROUNDED_TN] = s->tn;
        p[MOECL_GROUNDED_TK] = s->tk;
        p[MOECL_GROUNDED_MT] = s->mt;
        p[MOECL_GROUNDED_NT] = s->nt;
        p[MOECL_GROUNDED_TEAM] = s->team;
        p[MOECL_GROUNDED_ROWS] = s->rows;
        p[MOECL_GROUNDED_EPT] = s->ept;
        p[MOECL_GROUNDED_TEAM_SHUFFLE] = s->shuffle;
        p[MOECL_GROUNDED_VEC] = s->vec;
        p[MOECL_GROUNDED_DB] = s->db;
        p[MOECL_GROUNDED_WC] = s->wc;
        p[MOECL_GROUNDED_MMA_MI] = s->mma_mi;
        p[MOECL_GROUNDED_MMA_NT] = s->mma_nt;
        p[MOECL_GROUNDED_MMA_WM] = s->mma_wm;
        p[MOECL_GROUNDED_MMA_WN] = s->mma_wn;
        p[MOECL_GROUNDED_MMA_KW] = s->mma_kw;
        p[MOECL_GROUNDED_FUSED_WG] = s->team * s->rows;
        p[MOECL_GROUNDED_SPLIT_WG] = s->kind == MOECL_KERNEL_SPLITK ? (uint32_t)s->local : 256;
    }
    p[MOECL_GROUNDED_SMALL] = r->small;
    const moecl_topk_gating_desc gating = moecl_grounded_gating_desc(d);
    const moecl_gating_source source = {&gating, d->gating.num_expert_groups, d->gating.topk_group, r->has_bias};
    moecl_variant_gating(&v, &source);
    return v;
}

/* The -D defines of the variant of request r in shape s. */
static void defines_of(const grounded_request *r, const grounded_shape *s, char *defines, size_t size)
{
    const moecl_variant_values v = values_of(r, s);
    moecl_variant_defines(&moecl_variant_grounded_router, &v, s->kind, defines, size);
}

/* The defines and kernel of a resolved shape; none (NULL, "") where no
 * kernel fits the device. */
static void defines_of_fitting(const grounded_request *r, const grounded_shape *s, char *buf, size_t size,
                               const char **kernel_name)
{
    *kernel_name = s->kernel_name;
    if (s->kernel_name)
        defines_of(r, s, buf, size);
    else if (size)
        buf[0] = '\0';
}

void moecl_grounded_router_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc,
                                   bool pairs, bool weights, bool ids, char *buf, size_t size,
                                   const char **kernel_name)
{
    const grounded_request r = {.desc = desc, .pairs = pairs, .weights = weights, .ids = ids, .dispatch = false,
                                .has_bias = false, .no_logits = false};
    moecl_launch_config config;
    grounded_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of_fitting(&r, &shape, buf, size, kernel_name);
}

void moecl_router_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc, bool has_bias,
                          bool has_logits, char *buf, size_t size, const char **kernel_name)
{
    const grounded_request r = {.desc = desc, .pairs = false, .weights = true, .ids = true, .dispatch = false,
                                .has_bias = has_bias, .no_logits = !has_logits};
    moecl_launch_config config;
    grounded_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of_fitting(&r, &shape, buf, size, kernel_name);
}

void moecl_grounded_router_route_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc,
                                         char *buf, size_t size, const char **kernel_name)
{
    const grounded_request r = {.desc = desc, .pairs = false, .weights = true, .ids = true, .dispatch = true,
                                .has_bias = false, .no_logits = false};
    moecl_launch_config config;
    grounded_shape shape;
    resolve(NULL, info, &r, &config, &shape);
    defines_of_fitting(&r, &shape, buf, size, kernel_name);
    if (*kernel_name && shape.kind != MOECL_KERNEL_TEAM)
        *kernel_name = NULL;
}

/* The plan of a request (moecl_plan_build). */
static moecl_status build_plan(moecl_context *ctx, const void *request, moecl_plan *plan)
{
    const grounded_request *r = request;
    grounded_shape shape;
    plan->source = resolve(ctx, &ctx->info, r, &plan->config, &shape);
    plan->launch_key = moecl_launch_key_grounded(r->desc->hidden_dim, r->desc->num_experts, r->desc->top_k);
    if (!shape.kernel_name) {
        const moecl_grounded_router_desc *d = r->desc;
        return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED,
                          "grounded router: at %u experts x hidden %u, top_k %u, %u expert groups, no kernel keeps "
                          "a work-item within the driver's loop limit of %u iterations (docs/devices.md)",
                          d->num_experts, d->hidden_dim, d->top_k, d->gating.num_expert_groups,
                          ctx->params.value[MOECL_DP_LOOP_LIMIT]);
    }
    if (r->dispatch && shape.kind != MOECL_KERNEL_TEAM) {
        char text[512];
        const moecl_variant_values v = values_of(r, &shape);
        moecl_variant_text(&moecl_variant_grounded_router, &v, shape.kind, text, sizeof(text));
        return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED,
                          "grounded route dispatch in one kernel needs the team kernel (%s)", text);
    }
    char defines[512];
    defines_of(r, &shape, defines, sizeof(defines));
    moecl_status st = moecl_variant_get(ctx, r->dispatch ? MOECL_PROGRAM_GROUNDED_DISPATCH : MOECL_PROGRAM_GROUNDED_ROUTER,
                                        defines, shape.kernel_name, &plan->variants[0]);
    /* Split-K's work-group is compiled in: where the built kernel allows
     * fewer work-items (its registers: Intel's CPU runtime allows 128 at
     * 4096 experts, top 64), build it again for the largest that fits. */
    grounded_shape smaller;
    while (st == MOECL_SUCCESS && shape.kind == MOECL_KERNEL_SPLITK) {
        const size_t limit = moecl_variant_work_group_limit(plan->variants[0]);
        if (!limit || shape.local <= limit || !splitk_shape_within(&ctx->info, r, shape.tk, shape.local / 2, &smaller))
            break;
        shape = smaller;
        defines_of(r, &shape, defines, sizeof(defines));
        st = moecl_variant_get(ctx, MOECL_PROGRAM_GROUNDED_ROUTER, defines, shape.kernel_name, &plan->variants[0]);
    }
    if (st != MOECL_SUCCESS)
        return st;
    plan->num_kernels = 1;
    plan->kernel_names[0] = shape.kernel_name;
    plan->limits[0] = moecl_variant_work_group_limit(plan->variants[0]);
    plan->local = shape.local;
    plan->rows_per_group = shape.rows_per_group;
    plan->split_chunks = shape.split_chunks;
    plan->split_groups = shape.split_groups;
    return MOECL_SUCCESS;
}

static moecl_plan_key key_of(const moecl_context *ctx, const grounded_request *r)
{
    const moecl_variant_values v = values_of(r, NULL);
    return moecl_variant_key(ctx, &moecl_variant_grounded_router, &v);
}

moecl_status moecl_grounded_router_plan(moecl_context *ctx, const moecl_grounded_router_desc *desc, bool pairs,
                                        bool weights, bool ids, const moecl_plan **plan)
{
    const grounded_request r = {.desc = desc, .pairs = pairs, .weights = weights, .ids = ids, .dispatch = false,
                                .has_bias = false, .no_logits = false};
    const moecl_plan_key key = key_of(ctx, &r);
    return moecl_plan_get(ctx, &key, build_plan, &r, plan);
}

moecl_status moecl_grounded_router_route_plan(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                              const moecl_plan **plan)
{
    const grounded_request r = {.desc = desc, .pairs = false, .weights = true, .ids = true, .dispatch = true,
                                .has_bias = false, .no_logits = false};
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

/* The buffers of a call, in the kernel's argument order (the optional
 * six after the scalars, where present). */
enum { HIDDEN, LOGITS, GROUND, BIAS, PAIRS, WEIGHTS, IDS, COUNTS, LOAD, VALID, CAPTURED, SCALE, GATE, NUM_BUFFERS };
#define FIRST_OPTIONAL COUNTS
_Static_assert(NUM_BUFFERS == MOECL_GROUNDED_BUFFERS, "the binding's buffers");
/* The buffers of a call, the capture's type, whether binding validates
 * them (the caller's; the host path's own need none), and whether it is
 * moecl_router's (router_logits may be absent; topk_weights and topk_ids
 * required). */
typedef struct bound_buffers {
    moecl_buffer b[NUM_BUFFERS];
    moecl_index_dtype capture_dtype;
    bool check, router;
} bound_buffers;

static const char *const buffer_names[NUM_BUFFERS] = {
    "token_hidden", "router_logits", "expert_ground",    "bias",         "out_pairs",   "topk_weights",
    "topk_ids",     "expert_counts", "expert_load",      "num_valid_tokens", "captured_ids", "expert_scale",
    "shared_expert_gate"};

static size_t index_size(moecl_index_dtype t) { return t == MOECL_I16 ? 2 : moecl_index_size(t); }

/* Each buffer's element size and bytes for desc. */
static void buffer_sizes(const moecl_grounded_router_desc *d, moecl_index_dtype capture_dtype,
                         size_t elem[NUM_BUFFERS], uint64_t bytes[NUM_BUFFERS])
{
    /* slots: a row's (the shared ones too), k: the routed (the capture's);
     * ce: the experts the histograms count (the shared ones too). */
    const uint64_t t = d->num_tokens, h = d->hidden_dim, e = d->num_experts, k = d->top_k;
    const uint64_t slots = moecl_grounded_row_slots(d), ce = moecl_grounded_id_experts(d);
    const size_t sizes[NUM_BUFFERS] = {moecl_dtype_size(d->hidden_dtype),
                                       4,
                                       moecl_dtype_size(d->hidden_dtype),
                                       moecl_dtype_size(d->bias_dtype),
                                       4,
                                       moecl_dtype_size(d->weights_dtype),
                                       moecl_index_size(d->ids_dtype),
                                       4,
                                       4,
                                       4,
                                       index_size(capture_dtype),
                                       4,
                                       moecl_dtype_size(d->hidden_dtype)};
    const uint64_t count[NUM_BUFFERS] = {t * h,  moecl_grounded_logit_rows(d) * e,
                                         e * h,  e,
                                         t * slots * 2, t * slots,
                                         t * slots, ce,
                                         ce,     1,
                                         t * k,  e,
                                         (uint64_t)d->num_shared_experts * h};
    for (int i = 0; i < NUM_BUFFERS; i++) {
        elem[i] = sizes[i];
        bytes[i] = count[i] * sizes[i];
    }
}

void moecl_grounded_router_bind(const moecl_grounded_router_desc *d, const moecl_buffer buffers[NUM_BUFFERS],
                                moecl_index_dtype capture_dtype, bool check, bool outputs_required,
                                bool logits_required, moecl_grounded_binding *b)
{
    size_t elem[NUM_BUFFERS];
    uint64_t bytes[NUM_BUFFERS];
    buffer_sizes(d, capture_dtype, elem, bytes);
    cl_uint n = 0;
    for (int i = 0; i < NUM_BUFFERS; i++) {
        const bool required = i == HIDDEN || i == GROUND || (i == LOGITS && logits_required) ||
                              (outputs_required && (i == WEIGHTS || i == IDS)) || i >= FIRST_OPTIONAL;
        b->mem[i] = buffers[i].mem;
        b->checks[i] = (moecl_buffer_check){buffer_names[i], bytes[i], buffers[i].offset, elem[i], required};
        /* Offsets travel in elements: the kernels index typed pointers. */
        b->off[i] = buffers[i].offset / elem[i];
        if (i == FIRST_OPTIONAL) {
            b->num_tokens = d->num_tokens;
            b->alpha = d->alpha;
            b->scaling_factor = d->gating.routed_scaling_factor;
            b->args[n++] = MOECL_ARG(b->num_tokens);
            b->args[n++] = MOECL_ARG(b->alpha);
            b->args[n++] = MOECL_ARG(b->scaling_factor);
        }
        /* The optional six are arguments only where present (a define). */
        if (i >= FIRST_OPTIONAL && !b->mem[i])
            continue;
        b->args[n++] = MOECL_ARG_CHECKED(b->mem[i], check ? &b->checks[i] : NULL);
        b->args[n++] = MOECL_ARG(b->off[i]);
    }
    b->num_args = n;
}

/* The request of a call: which buffers it has (has[i]), moecl_router's
 * or not, the capture's type. */
static grounded_request request_of(const moecl_context *ctx, const moecl_grounded_router_desc *d,
                                   const bool has[NUM_BUFFERS], bool router, moecl_index_dtype capture_dtype)
{
    const uint32_t small_max = moecl_device_param_class(&ctx->params, MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS_CPU,
                                                        ctx->info.launch_class);
    const grounded_request r = {d,          has[PAIRS], has[WEIGHTS], has[IDS],   false,
                                has[BIAS],  router && !has[LOGITS],   has[COUNTS], has[LOAD],
                                has[VALID], has[SCALE], has[CAPTURED] ? 1u + (unsigned)capture_dtype : 0u,
                                has[GATE],  d->num_tokens >= 1 && d->num_tokens <= small_max};
    return r;
}

static grounded_request request_of_buffers(const moecl_context *ctx, const moecl_grounded_router_desc *d,
                                           const bound_buffers *b)
{
    bool has[NUM_BUFFERS];
    for (int i = 0; i < NUM_BUFFERS; i++)
        has[i] = b->b[i].mem != NULL;
    return request_of(ctx, d, has, b->router, b->capture_dtype);
}

/* The split-K kernel's launch (plan p): the context's scratch (a ticket per
 * token block, then the partial dot products, cl/layout.h), the tickets
 * zeroed first where they may not be 0 (the last work-group of each block
 * puts its ticket back), after the zeroing of expert_counts where given. */
static moecl_status launch_splitk(moecl_context *ctx, const moecl_plan *p, const moecl_launch_call *call,
                                  uint32_t experts, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const size_t blocks = (call->tokens + p->rows_per_group - 1) / p->rows_per_group;
    const size_t words = LAYOUT_SPLITK_SCRATCH_WORDS(blocks, (size_t)p->split_chunks, (size_t)call->tokens,
                                                     (size_t)experts);
    cl_mem scratch;
    moecl_status st = moecl_scratch_acquire(ctx, words * 4, &scratch);
    if (st != MOECL_SUCCESS)
        return st;
    const bool reused = ctx->in_order && ctx->scratch_lock_ready;
    moecl_kernel_arg args[MOECL_MAX_KERNEL_ARGS];
    memcpy(args, call->args, call->num_args * sizeof(args[0]));
    cl_uint n = call->num_args;
    args[n++] = MOECL_ARG_MEM(scratch);
    moecl_step steps[3];
    int count = 0;
    if (call->zero)
        steps[count++] =
            (moecl_step){0, NULL, 0, 0, 0, call->zero, call->zero_offset, call->zero_bytes, call->zero_name, NULL};
    if (!reused || ctx->scratch_zero_words < blocks)
        steps[count++] = (moecl_step){0, NULL, 0, 0, 0, scratch, 0, blocks * 4, "the split-K router's tickets", NULL};
    steps[count++] = (moecl_step){0, args, n, blocks * p->split_groups * p->local, p->local, NULL, 0, 0, NULL, NULL};
    st = moecl_plan_run(ctx, p, steps, count, num_wait, wait, done);
    if (reused)
        ctx->scratch_zero_words = st == MOECL_SUCCESS ? blocks : 0;
    moecl_scratch_release(ctx, scratch);
    return st;
}

/* Bind and enqueue (src/plan.c): expert_counts is zeroed first, and the
 * kernel waits on that. */
static moecl_status launch(moecl_context *ctx, const moecl_grounded_router_desc *d, const bound_buffers *b,
                           cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    moecl_grounded_binding bound;
    moecl_grounded_router_bind(d, b->b, b->capture_dtype, b->check, b->router, !b->router, &bound);
    const grounded_request r = request_of_buffers(ctx, d, b);
    const moecl_launch_call call = {key_of(ctx, &r),
                                    build_plan,
                                    &r,
                                    bound.args,
                                    bound.num_args,
                                    d->num_tokens,
                                    b->b[COUNTS].mem,
                                    b->b[COUNTS].offset,
                                    (size_t)moecl_grounded_id_experts(d) * 4,
                                    "expert_counts"};
    if (d->num_tokens > 0) {
        /* The split-K kernel has its own launch: its plan first (a bad
         * buffer still costs no compile). */
        const moecl_plan *p = moecl_plan_find(ctx, &call.key);
        moecl_status st = MOECL_SUCCESS;
        if (!p && ((st = moecl_check_args(ctx, call.args, call.num_args)) != MOECL_SUCCESS ||
                   (st = moecl_plan_get(ctx, &call.key, build_plan, &r, &p)) != MOECL_SUCCESS))
            return st;
        if (p->config.kernel == MOECL_KERNEL_SPLITK)
            return launch_splitk(ctx, p, &call, d->num_experts, num_wait, wait, done);
    }
    return moecl_plan_launch(ctx, &call, num_wait, wait, done);
}

/* The checks of moecl_router_ex's optional tensors beyond their buffers:
 * the capture's type, and a shared gate only with shared experts. */
static moecl_status check_options(moecl_context *ctx, const moecl_grounded_router_desc *d, moecl_index_dtype t,
                                  bool has_gate)
{
    if ((unsigned)t > MOECL_I16)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "captured_ids_dtype is %d; it must be MOECL_I32, MOECL_I64 or MOECL_I16", (int)t);
    if (has_gate && !d->num_shared_experts)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "shared_expert_gate is given but num_shared_experts is 0; the gate weighs shared slots");
    return MOECL_SUCCESS;
}

/* The device-buffer call of every entry point. */
static moecl_status route_device(moecl_context *ctx, const moecl_grounded_router_desc *desc, const bound_buffers *b,
                                 cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = moecl_grounded_router_validate(ctx, desc);
    if (st != MOECL_SUCCESS || (st = check_options(ctx, desc, b->capture_dtype, b->b[GATE].mem)) != MOECL_SUCCESS)
        return st;
    if (!b->router && !b->b[PAIRS].mem && !b->b[WEIGHTS].mem && !b->b[IDS].mem)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "out_pairs, topk_weights, topk_ids: all absent; at least one output is needed");
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS)
        return st;
    return launch(ctx, desc, b, num_wait, wait, done);
}

moecl_status moecl_grounded_router(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                   moecl_buffer token_hidden, moecl_buffer router_logits, moecl_buffer expert_ground,
                                   moecl_buffer out_pairs, moecl_buffer topk_weights, moecl_buffer topk_ids,
                                   cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const bound_buffers b = {
        {token_hidden, router_logits, expert_ground, {NULL, 0}, out_pairs, topk_weights, topk_ids}, MOECL_I32, true,
        false};
    return route_device(ctx, desc, &b, num_wait, wait, done);
}

/* The first version of moecl_router_tensors and of the host form (the
 * second adds shared_expert_gate). */
#define TENSORS_V1 (offsetof(moecl_router_tensors, expert_scale) + sizeof(moecl_buffer))
#define HOST_TENSORS_V1 (offsetof(moecl_router_host_tensors, expert_scale) + sizeof(const float *))

moecl_status moecl_router_ex(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                             const moecl_router_tensors *tensors, cl_uint num_wait, const cl_event *wait,
                             cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_router_tensors r;
    const moecl_status st = moecl_copy_record(ctx, tensors, TENSORS_V1, sizeof(r), "expert_scale", &r);
    if (st != MOECL_SUCCESS)
        return st;
    const moecl_router_tensors *t = &r;
    const bound_buffers b = {{t->token_hidden, t->router_logits, t->expert_ground, t->bias, {NULL, 0},
                              t->topk_weights, t->topk_ids, t->expert_counts, t->expert_load, t->num_valid_tokens,
                              t->captured_ids, t->expert_scale, t->shared_expert_gate},
                             t->captured_ids_dtype,
                             true,
                             true};
    return route_device(ctx, desc, &b, num_wait, wait, done);
}

moecl_status moecl_router(moecl_context *ctx, const moecl_grounded_router_desc *desc, moecl_buffer token_hidden,
                          moecl_buffer router_logits, moecl_buffer expert_ground, moecl_buffer bias,
                          moecl_buffer topk_weights, moecl_buffer topk_ids, cl_uint num_wait, const cl_event *wait,
                          cl_event *done)
{
    moecl_router_tensors t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    t.token_hidden = token_hidden;
    t.router_logits = router_logits;
    t.expert_ground = expert_ground;
    t.bias = bias;
    t.topk_weights = topk_weights;
    t.topk_ids = topk_ids;
    return moecl_router_ex(ctx, desc, &t, num_wait, wait, done);
}

/* The blocking host-memory call of every entry point: the library's own
 * buffers, filled from and read back into the caller's memory (expert_load
 * both: the call adds to it). h: the router's tensors; pairs: the grounded
 * router's out_pairs (router false). */
static moecl_status route_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                               const moecl_router_host_tensors *h, float *pairs, bool router)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = moecl_grounded_router_validate(ctx, desc);
    if (st != MOECL_SUCCESS ||
        (st = check_options(ctx, desc, h->captured_ids_dtype, h->shared_expert_gate)) != MOECL_SUCCESS)
        return st;
    if (!router && !pairs && !h->topk_weights && !h->topk_ids)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "out_pairs, topk_weights, topk_ids: all NULL; at least one output is needed");
    if (desc->num_tokens > 0) {
        const char *missing = !h->token_hidden                ? "token_hidden"
                              : !h->router_logits && !router  ? "router_logits"
                              : !h->expert_ground             ? "expert_ground"
                              : router && !h->topk_weights    ? "topk_weights"
                              : router && !h->topk_ids        ? "topk_ids"
                                                              : NULL;
        if (missing)
            return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    }
    const void *const from[NUM_BUFFERS] = {h->token_hidden, h->router_logits, h->expert_ground, h->bias,
                                           NULL, NULL, NULL, NULL, h->expert_load, h->num_valid_tokens, NULL,
                                           h->expert_scale, h->shared_expert_gate};
    void *const to[NUM_BUFFERS] = {NULL, NULL, NULL, NULL, pairs, h->topk_weights, h->topk_ids, h->expert_counts,
                                   h->expert_load, NULL, h->captured_ids, NULL, NULL};
    bool has[NUM_BUFFERS];
    for (int i = 0; i < NUM_BUFFERS; i++)
        has[i] = from[i] || to[i];
    const moecl_plan *p;
    const grounded_request r = request_of(ctx, desc, has, router, h->captured_ids_dtype);
    const moecl_plan_key key = key_of(ctx, &r);
    if ((st = moecl_plan_get(ctx, &key, build_plan, &r, &p)) != MOECL_SUCCESS)
        return st; /* built before the buffers are made: a build failure costs no copy */
    if (desc->num_tokens == 0) {
        if (h->expert_counts)
            memset(h->expert_counts, 0, (size_t)moecl_grounded_id_experts(desc) * 4);
        return MOECL_SUCCESS;
    }
    size_t elem[NUM_BUFFERS];
    uint64_t bytes[NUM_BUFFERS];
    buffer_sizes(desc, h->captured_ids_dtype, elem, bytes);
    size_t sizes[NUM_BUFFERS];
    for (int i = 0; i < NUM_BUFFERS; i++)
        sizes[i] = (size_t)bytes[i];
    bound_buffers b;
    memset(&b, 0, sizeof(b));
    b.router = router;
    b.capture_dtype = h->captured_ids_dtype;
    cl_mem mems[NUM_BUFFERS] = {NULL};
    for (int i = 0; i < NUM_BUFFERS && st == MOECL_SUCCESS; i++)
        if (from[i] || to[i]) {
            /* The histograms are added to (atomics read them). */
            const cl_mem_flags flags = !to[i]                                ? CL_MEM_READ_ONLY
                                       : from[i] || i == COUNTS              ? CL_MEM_READ_WRITE
                                                                             : CL_MEM_WRITE_ONLY;
            st = moecl_host_buffer(ctx, buffer_names[i], flags, sizes[i], from[i], &mems[i]);
            b.b[i].mem = mems[i];
        }
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS)
        st = launch(ctx, desc, &b, 0, NULL, &ran);
    /* Read back the outputs (expert_load with them), from PAIRS on. */
    return moecl_host_call_end(ctx, st, ran, mems, NUM_BUFFERS, PAIRS, sizes + PAIRS, to);
}

/* moecl_router_host's six tensors as a record. */
static moecl_router_host_tensors host_tensors_of(const void *token_hidden, const float *router_logits,
                                                 const void *expert_ground, const void *bias, void *topk_weights,
                                                 void *topk_ids)
{
    moecl_router_host_tensors h;
    memset(&h, 0, sizeof(h));
    h.struct_size = sizeof(h);
    h.token_hidden = token_hidden;
    h.router_logits = router_logits;
    h.expert_ground = expert_ground;
    h.bias = bias;
    h.topk_weights = topk_weights;
    h.topk_ids = topk_ids;
    return h;
}

moecl_status moecl_grounded_router_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                        const void *token_hidden, const float *router_logits, const void *expert_ground,
                                        float *out_pairs, void *topk_weights, void *topk_ids)
{
    const moecl_router_host_tensors h =
        host_tensors_of(token_hidden, router_logits, expert_ground, NULL, topk_weights, topk_ids);
    return route_host(ctx, desc, &h, out_pairs, false);
}

moecl_status moecl_router_ex_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                  const moecl_router_host_tensors *tensors)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_router_host_tensors h;
    const moecl_status st = moecl_copy_record(ctx, tensors, HOST_TENSORS_V1, sizeof(h), "expert_scale", &h);
    return st != MOECL_SUCCESS ? st : route_host(ctx, desc, &h, NULL, true);
}

moecl_status moecl_router_host(moecl_context *ctx, const moecl_grounded_router_desc *desc, const void *token_hidden,
                               const float *router_logits, const void *expert_ground, const void *bias,
                               void *topk_weights, void *topk_ids)
{
    const moecl_router_host_tensors h =
        host_tensors_of(token_hidden, router_logits, expert_ground, bias, topk_weights, topk_ids);
    return moecl_router_ex_host(ctx, desc, &h);
}
