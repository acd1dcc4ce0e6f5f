/* moe_align, host side: validation, the launch shape, the choice of path
 * (one work-group for small routings on GPUs, one of the two fused
 * kernels, or three chained launches; cl/moe_align.cl says what each
 * kernel does), the
 * scratch buffer, and the blocking host-memory path. A call with an
 * expert map runs the same paths on the program built with HAS_MAP, its
 * kernels taking the map's three arguments last. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

#define MOECL_ALIGN_MAX_BLOCK 1024u

moecl_moe_align_desc moecl_moe_align_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t num_experts,
                                               uint32_t block_size)
{
    moecl_moe_align_desc d;
    memset(&d, 0, sizeof(d));
    d.num_tokens = num_tokens;
    d.top_k = top_k;
    d.num_experts = num_experts;
    d.block_size = block_size;
    return d;
}

uint64_t moecl_moe_align_max_padded(const moecl_moe_align_desc *d)
{
    if (!d)
        return 0;
    const uint64_t pad = d->block_size ? (uint64_t)d->num_experts * (d->block_size - 1) : 0;
    return (uint64_t)d->num_tokens * d->top_k + pad;
}

static moecl_status validate_desc(moecl_context *ctx, const moecl_moe_align_desc *d)
{
#define INVALID(...) moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, __VA_ARGS__)
    if (!d)
        return INVALID("desc is NULL");
    if (d->num_experts < 1 || d->num_experts > MOECL_MAX_EXPERTS)
        return INVALID("num_experts is %u; it must be in 1..%u", d->num_experts, MOECL_MAX_EXPERTS);
    if (d->top_k < 1 || d->top_k > MOECL_MAX_TOPK)
        return INVALID("top_k is %u; it must be in 1..%u", d->top_k, MOECL_MAX_TOPK);
    if (d->block_size < 1 || d->block_size > MOECL_ALIGN_MAX_BLOCK)
        return INVALID("block_size is %u; it must be in 1..%u", d->block_size, MOECL_ALIGN_MAX_BLOCK);
    const uint64_t max_padded = moecl_moe_align_max_padded(d);
    if (max_padded > INT32_MAX)
        return INVALID("num_tokens is %u; num_tokens * top_k + num_experts * (block_size - 1) = %llu must be at "
                       "most %d (INT32_MAX), so that positions fit in int32",
                       d->num_tokens, (unsigned long long)max_padded, INT32_MAX);
    return MOECL_SUCCESS;
#undef INVALID
}

moecl_status moecl_moe_align_validate(moecl_context *ctx, const moecl_moe_align_desc *desc)
{
    return validate_desc(ctx, desc);
}

/* ---- launch shape and variants ---- */

typedef struct align_shape {
    unsigned wg, scan_wg, one_wg, fused_wg;
    bool warp_match; /* inline PTX: the one-group kernel ranks with match.any.sync (cl/moe_align.cl) */
} align_shape;

static unsigned floor_pow2(size_t v, unsigned cap)
{
    unsigned p = 1;
    while (p * 2 <= cap && p * 2 <= v)
        p *= 2;
    return p;
}

/* The work-groups the device table gives, each within the device's
 * limit: the chunk kernels' (by launch class), the scan's and the
 * one-group kernel's (one work-group each), the fused kernel's (by launch
 * class). */
static align_shape shape_of(const moecl_device_info *info)
{
    const moecl_device_params p = moecl_device_table_params(info);
    const size_t limit = info->max_work_group_size;
    align_shape s;
    s.wg = floor_pow2(limit, moecl_device_param_class(&p, MOECL_DP_ALIGN_CHUNK_WG_CPU, info->launch_class));
    s.scan_wg = floor_pow2(limit, p.value[MOECL_DP_ALIGN_GROUP_WG]);
    s.one_wg = floor_pow2(limit, p.value[MOECL_DP_ALIGN_GROUP_WG]);
    s.fused_wg = floor_pow2(limit, moecl_device_param_class(&p, MOECL_DP_ALIGN_FUSED_WG_CPU, info->launch_class));
    s.warp_match = info->ptx && s.one_wg >= 32;
    return s;
}

enum { COUNT_KERNEL, SCAN_KERNEL, SCATTER_KERNEL, ONE_GROUP_KERNEL, FUSED_KERNEL, PARALLEL_KERNEL, NUM_KERNELS };
static const char *const kernel_names[NUM_KERNELS] = {"moe_align_count",     "moe_align_scan",
                                                      "moe_align_scatter",   "moe_align_one_group",
                                                      "moe_align_fused",     "moe_align_fused_parallel"};

/* Without the map, exactly the defines of the kernels before it. */
static void defines_of(const align_shape *s, bool has_map, char *buf, size_t size)
{
    snprintf(buf, size, "-DWG=%u -DSCAN_WG=%u -DONE_WG=%u -DFUSED_WG=%u -DWARP_MATCH=%d%s", s->wg, s->scan_wg,
             s->one_wg, s->fused_wg, s->warp_match, has_map ? " -DHAS_MAP=1" : "");
}

static const char *const all_kernel_names =
    "moe_align_count,moe_align_scan,moe_align_scatter,moe_align_one_group,moe_align_fused,moe_align_fused_parallel";

void moecl_moe_align_defines(const moecl_device_info *info, char *buf, size_t size, const char **kernel_names_out)
{
    const align_shape s = shape_of(info);
    defines_of(&s, false, buf, size);
    *kernel_names_out = all_kernel_names;
}

void moecl_moe_align_map_defines(const moecl_device_info *info, char *buf, size_t size,
                                 const char **kernel_names_out)
{
    const align_shape s = shape_of(info);
    defines_of(&s, true, buf, size);
    *kernel_names_out = all_kernel_names;
}

/* The plan (moecl_plan_build): one program of six kernels, which the
 * registry shares between them; request points to whether it has the
 * map. */
static moecl_status build_plan(moecl_context *ctx, const void *request, moecl_plan *p)
{
    char defines[160];
    const align_shape s = shape_of(&ctx->info);
    defines_of(&s, *(const bool *)request, defines, sizeof(defines));
    for (int i = 0; i < NUM_KERNELS; i++) {
        moecl_status st = moecl_variant_get(ctx, MOECL_PROGRAM_MOE_ALIGN, defines, kernel_names[i], &p->variants[i]);
        if (st != MOECL_SUCCESS)
            return st;
        p->kernel_names[i] = kernel_names[i];
        p->limits[i] = moecl_variant_work_group_limit(p->variants[i]);
    }
    p->num_kernels = NUM_KERNELS;
    p->source = MOECL_SOURCE_DEFAULT;
    p->wg = s.wg;
    p->scan_wg = s.scan_wg;
    p->one_wg = s.one_wg;
    p->fused_wg = s.fused_wg;
    p->warp_match = s.warp_match;
    /* Register use can lower a kernel's work-group limit below the
     * device's; then the other paths serve those sizes. */
    p->one_group_fits = p->limits[ONE_GROUP_KERNEL] >= s.one_wg;
    p->fused_fits = p->limits[FUSED_KERNEL] >= s.fused_wg;
    p->parallel_fits = p->limits[PARALLEL_KERNEL] >= s.fused_wg;
    return MOECL_SUCCESS;
}

/* Keyed by the launch class and the map: the device facts are the
 * context's. */
static moecl_status align_plan(moecl_context *ctx, bool has_map, const moecl_plan **plan)
{
    const moecl_plan_key key =
        moecl_plan_key_of(ctx, MOECL_OP_MOE_ALIGN, (uint64_t)ctx->info.launch_class, has_map, 0, 0);
    return moecl_plan_get(ctx, &key, build_plan, &has_map, plan);
}

moecl_status moecl_moe_align_plan(moecl_context *ctx, bool has_map, const moecl_plan **plan)
{
    return align_plan(ctx, has_map, plan);
}

/* Local bytes of the one-group kernel's slot_cols argument: a ushort per
 * slot where the warp path keeps them, else a placeholder. */
static size_t slot_cols_bytes(const moecl_plan *p, uint64_t slots)
{
    return moecl_layout_moe_align_slot_cols(slots, p->warp_match);
}

/* Local memory of the one-group kernel: two words per expert column, two
 * per work-item, and the slot columns. */
static uint64_t one_group_local_bytes(const moecl_plan *p, uint32_t experts, uint64_t slots)
{
    return 2 * ((uint64_t)experts + 1) * 4 + (uint64_t)p->one_wg * 8 + slot_cols_bytes(p, slots);
}

/* Whether the one-group kernel can serve d: where the device runs it at
 * its work-group and local memory holds two words per expert (and, with
 * WARP_MATCH, a ushort per slot). */
static bool one_group_serves(const moecl_context *ctx, const moecl_plan *p, const moecl_moe_align_desc *d)
{
    const uint64_t slots = (uint64_t)d->num_tokens * d->top_k;
    if (!p->one_group_fits || (p->warp_match && slots > 65536)) /* slot columns in local memory */
        return false;
    /* 1 KiB for what the compiler places in local memory besides. */
    return one_group_local_bytes(p, d->num_experts, slots) + 1024 <= ctx->info.local_mem_size;
}

/* Whether the fused kernel can serve d: where the device runs it at its
 * work-group and local memory holds two words per expert column. */
static bool fused_serves(const moecl_context *ctx, const moecl_plan *p, const moecl_moe_align_desc *d)
{
    return p->fused_fits &&
           moecl_layout_moe_align_fused_local(d->num_experts, p->fused_wg) + 1024 <= ctx->info.local_mem_size;
}

/* Whether the parallel fused kernel can serve d: where the device runs it
 * at its work-group and local memory holds three words per expert column. */
static bool parallel_serves(const moecl_context *ctx, const moecl_plan *p, const moecl_moe_align_desc *d)
{
    return p->parallel_fits &&
           moecl_layout_moe_align_parallel_local(d->num_experts, p->fused_wg) + 1024 <= ctx->info.local_mem_size;
}

typedef enum align_route { ROUTE_ONE_GROUP, ROUTE_FUSED, ROUTE_PARALLEL, ROUTE_CHUNKED } align_route;

/* The path of d: the override's align= where it forces one the device can run;
 * else, within the device table's limits, the parallel fused kernel (each
 * work-group counts every slot, so beyond some size the other paths win),
 * the fused kernel (its last work-group places every slot, so beyond some
 * size the chunked path's three launches, which place in parallel, win),
 * then the one-group kernel where the fused kernel does not fit (its tiles
 * run one after another in one work-group), then the chunked path. */
static align_route route_of(const moecl_context *ctx, const moecl_plan *p, const moecl_moe_align_desc *d)
{
    const moecl_device_info *info = &ctx->info;
    const moecl_align_path path = info->env.align_path;
    const uint64_t slots = (uint64_t)d->num_tokens * d->top_k;
    const moecl_launch_class c = info->launch_class;
    switch (path) {
    case MOECL_ALIGN_ONE_GROUP:
        return one_group_serves(ctx, p, d) ? ROUTE_ONE_GROUP : ROUTE_CHUNKED;
    case MOECL_ALIGN_FUSED:
        return fused_serves(ctx, p, d) ? ROUTE_FUSED : ROUTE_CHUNKED;
    case MOECL_ALIGN_FUSED_PARALLEL:
        return parallel_serves(ctx, p, d) ? ROUTE_PARALLEL : ROUTE_CHUNKED;
    case MOECL_ALIGN_CHUNKED:
        return ROUTE_CHUNKED;
    default:
        break;
    }
    const moecl_device_params *t = &ctx->params;
    /* A limit of 0 is never, an empty call included. */
    const uint32_t parallel_cap = moecl_device_param_class(t, MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_CPU, c);
    if (parallel_cap && slots <= parallel_cap && parallel_serves(ctx, p, d))
        return ROUTE_PARALLEL;
    const uint32_t one_cap = moecl_device_param_class(
        t, p->warp_match ? MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_WARP_CPU : MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_CPU, c);
    if (slots <= moecl_device_param_class(t, MOECL_DP_ALIGN_FUSED_MAX_SLOTS_CPU, c) && fused_serves(ctx, p, d))
        return ROUTE_FUSED;
    if (one_cap && slots <= one_cap && one_group_serves(ctx, p, d))
        return ROUTE_ONE_GROUP;
    return ROUTE_CHUNKED;
}

moecl_status moecl_moe_align_prepare(moecl_context *ctx, const moecl_moe_align_desc *desc)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    const moecl_plan *p;
    return align_plan(ctx, desc->num_global_experts > 0, &p);
}

/* ---- enqueue ---- */

/* The buffers, and the map's length (0: no map, and map unused). */
typedef struct align_args {
    moecl_mem_at ids, counts, sorted, blocks, post, slots, invalid, map;
    cl_uint num_global;
} align_args;

#define ARG(v) MOECL_ARG(v)
#define MEM(m) MOECL_ARG_MEM(m)
#define LOCAL(bytes) MOECL_ARG_LOCAL(bytes)
/* The map's arguments (MAP_KERNEL_PARAMS), last in every argument list
 * that has them; NARGS counts them only where the call has a map. */
#define MAP_ARGS(a) MEM((a)->map.mem), ARG((a)->map.off), ARG((a)->num_global)
#define NARGS(args, a) ((cl_uint)(sizeof(args) / sizeof((args)[0])) - ((a)->num_global ? 0 : 3))

/* Small routings: everything in one work-group, one launch, no scratch. */
static moecl_status enqueue_one_group(moecl_context *ctx, const moecl_moe_align_desc *d, const moecl_plan *p,
                                      const align_args *a, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const cl_uint slots = d->num_tokens * d->top_k, experts = d->num_experts, block = d->block_size;
    const cl_uint max_padded = (cl_uint)moecl_moe_align_max_padded(d), num_blocks = max_padded / block;
    const cl_uint has_slots = a->slots.mem != NULL, has_invalid = a->invalid.mem != NULL;
    const size_t cols_bytes = moecl_layout_moe_align_cols(experts);
    const moecl_kernel_arg args[] = {
        MEM(a->ids.mem),     ARG(a->ids.off),     ARG(slots),          ARG(experts),        ARG(block),
        ARG(max_padded),     ARG(num_blocks),     MEM(a->counts.mem),  ARG(a->counts.off),
        MEM(a->sorted.mem),  ARG(a->sorted.off),  MEM(a->blocks.mem),  ARG(a->blocks.off),  MEM(a->post.mem),
        ARG(a->post.off),    MEM(a->slots.mem),   ARG(a->slots.off),   ARG(has_slots),      MEM(a->invalid.mem),
        ARG(a->invalid.off), ARG(has_invalid),    LOCAL(cols_bytes), LOCAL(cols_bytes),
        LOCAL(slot_cols_bytes(p, slots)), MAP_ARGS(a)};
    moecl_step one = {ONE_GROUP_KERNEL, args, NARGS(args, a), p->one_wg, p->one_wg, NULL, 0, 0, NULL, NULL};
    return moecl_plan_run(ctx, p, &one, 1, num_wait, wait, done);
}

/* Chunks of slots: at least num_experts + 1 slots each, so that the count
 * matrix is no larger than the slots; about 256 chunks on GPUs (the scan
 * walks them serially) and 8 per compute unit on CPUs; a multiple of wg. */
static uint32_t chunk_size(const moecl_context *ctx, unsigned wg, uint32_t slots, uint32_t experts)
{
    const uint32_t target = ctx->info.launch_class == MOECL_LAUNCH_CPU
                                ? 8 * (ctx->info.compute_units ? ctx->info.compute_units : 1)
                                : 256;
    uint64_t chunk = ((uint64_t)slots + target - 1) / target;
    if (chunk < (uint64_t)experts + 1)
        chunk = (uint64_t)experts + 1;
    if (chunk < 256)
        chunk = 256;
    return (uint32_t)moecl_round_up(chunk, wg);
}

/* One launch at every size: the fused kernel, whose scratch holds the
 * ticket (word 0), the count matrix, its prefixes and a rank per slot. The ticket is 0
 * between calls (the last work-group resets it); a new buffer, or one the
 * chunked path wrote, is zeroed first, by a fill the kernel waits on. */
static moecl_status enqueue_fused(moecl_context *ctx, const moecl_moe_align_desc *d, const moecl_plan *p,
                                  const align_args *a, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const cl_uint slots = d->num_tokens * d->top_k, experts = d->num_experts, block = d->block_size;
    /* CPUs: one work-group of one work-item, which walks the slots in
     * order: counts and ranks passed between work-groups by atomics cost
     * more there than the parallel count saves (pocl: 44-46 us at 129 x 128
     * against 9-10 for the three kernels). */
    const cl_uint chunk = ctx->info.launch_class == MOECL_LAUNCH_CPU ? (slots ? slots : 1)
                                                                     : chunk_size(ctx, p->fused_wg, slots, experts);
    const cl_uint groups = slots ? (cl_uint)(((uint64_t)slots + chunk - 1) / chunk) : 1;
    const size_t scratch_bytes = (1 + 2 * (size_t)groups * (experts + 1) + slots) * 4;
    cl_mem scratch;
    moecl_status st = moecl_scratch_acquire(ctx, scratch_bytes, &scratch);
    if (st != MOECL_SUCCESS)
        return st;
    const bool reused = ctx->in_order && ctx->scratch_lock_ready;
    const cl_uint has_slots = a->slots.mem != NULL, has_invalid = a->invalid.mem != NULL;
    const size_t cols_bytes = moecl_layout_moe_align_cols(experts);
    const moecl_kernel_arg args[] = {
        MEM(a->ids.mem),    ARG(a->ids.off),     ARG(slots),          ARG(experts),        ARG(chunk),
        ARG(block),         MEM(scratch),        MEM(a->counts.mem),  ARG(a->counts.off),  MEM(a->sorted.mem),
        ARG(a->sorted.off), MEM(a->blocks.mem),  ARG(a->blocks.off),  MEM(a->post.mem),    ARG(a->post.off),
        MEM(a->slots.mem),  ARG(a->slots.off),   ARG(has_slots),      MEM(a->invalid.mem), ARG(a->invalid.off),
        ARG(has_invalid),   LOCAL(cols_bytes),   LOCAL(cols_bytes),   MAP_ARGS(a)};
    moecl_step steps[2];
    int n = 0;
    if (!reused || ctx->scratch_zero_words < 1)
        steps[n++] = (moecl_step){0, NULL, 0, 0, 0, scratch, 0, 4, "the moe_align ticket", NULL};
    steps[n++] = (moecl_step){FUSED_KERNEL, args, NARGS(args, a), (size_t)groups * p->fused_wg, p->fused_wg,
                              NULL,         0,    0,              NULL, NULL};
    st = moecl_plan_run(ctx, p, steps, n, num_wait, wait, done);
    if (reused)
        ctx->scratch_zero_words = st == MOECL_SUCCESS ? 1 : 0; /* its ticket, word 0 */
    moecl_scratch_release(ctx, scratch);
    return st;
}

/* One launch with no scratch and nothing passed between work-groups: each
 * counts every slot and places its own chunk. Chunks: the fused kernel's
 * on GPUs; on CPUs one per compute unit (each work-group reads every id,
 * so more work-groups than threads would only repeat that). */
static moecl_status enqueue_parallel(moecl_context *ctx, const moecl_moe_align_desc *d, const moecl_plan *p,
                                     const align_args *a, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const cl_uint slots = d->num_tokens * d->top_k, experts = d->num_experts, block = d->block_size;
    const cl_uint units = ctx->info.compute_units ? ctx->info.compute_units : 1;
    const cl_uint chunk = ctx->info.launch_class == MOECL_LAUNCH_CPU
                              ? (cl_uint)(slots ? ((uint64_t)slots + units - 1) / units : 1)
                              : chunk_size(ctx, p->fused_wg, slots, experts);
    const cl_uint groups = slots ? (cl_uint)(((uint64_t)slots + chunk - 1) / chunk) : 1;
    const cl_uint has_slots = a->slots.mem != NULL, has_invalid = a->invalid.mem != NULL;
    const size_t cols_bytes = moecl_layout_moe_align_cols(experts);
    const moecl_kernel_arg args[] = {
        MEM(a->ids.mem),     ARG(a->ids.off),    ARG(slots),         ARG(experts),        ARG(chunk),
        ARG(block),          MEM(a->counts.mem), ARG(a->counts.off), MEM(a->sorted.mem),  ARG(a->sorted.off),
        MEM(a->blocks.mem),  ARG(a->blocks.off), MEM(a->post.mem),   ARG(a->post.off),    MEM(a->slots.mem),
        ARG(a->slots.off),   ARG(has_slots),     MEM(a->invalid.mem), ARG(a->invalid.off), ARG(has_invalid),
        LOCAL(cols_bytes),   LOCAL(cols_bytes),  LOCAL(cols_bytes),  MAP_ARGS(a)};
    moecl_step step = {PARALLEL_KERNEL, args, NARGS(args, a), (size_t)groups * p->fused_wg, p->fused_wg,
                       NULL,            0,    0,              NULL, NULL};
    return moecl_plan_run(ctx, p, &step, 1, num_wait, wait, done);
}

static moecl_status enqueue(moecl_context *ctx, const moecl_moe_align_desc *d, const moecl_plan *p,
                            const align_args *a, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const align_route route = route_of(ctx, p, d);
    if (route == ROUTE_ONE_GROUP)
        return enqueue_one_group(ctx, d, p, a, num_wait, wait, done);
    if (route == ROUTE_FUSED)
        return enqueue_fused(ctx, d, p, a, num_wait, wait, done);
    if (route == ROUTE_PARALLEL)
        return enqueue_parallel(ctx, d, p, a, num_wait, wait, done);
    const moecl_plan *s = p;
    const cl_uint slots = d->num_tokens * d->top_k, experts = d->num_experts, block = d->block_size;
    const cl_uint max_padded = (cl_uint)moecl_moe_align_max_padded(d), num_blocks = max_padded / block;
    const cl_uint chunk = chunk_size(ctx, s->wg, slots, experts);
    const cl_uint chunks = (cl_uint)(((uint64_t)slots + chunk - 1) / chunk);
    const size_t cols = (size_t)experts + 1;
    const size_t matrix_words = (size_t)chunks * cols;
    /* The count matrix [chunks][cols], then expert_start[cols] and
     * totals[cols]. */
    const size_t scratch_bytes = (matrix_words + 2 * cols) * 4;
    cl_mem scratch;
    moecl_status st = moecl_scratch_acquire(ctx, scratch_bytes, &scratch);
    if (st != MOECL_SUCCESS)
        return st;
    const cl_ulong starts_off = matrix_words;
    const cl_uint has_slots = a->slots.mem != NULL, has_invalid = a->invalid.mem != NULL;
    const moecl_kernel_arg count_args[] = {MEM(a->ids.mem), ARG(a->ids.off), ARG(slots),
                                           ARG(experts),    ARG(chunk),      MEM(scratch),
                                           LOCAL(moecl_layout_moe_align_cols(experts)), MAP_ARGS(a)};
    const moecl_kernel_arg scan_args[] = {MEM(scratch),        ARG(chunks),         ARG(experts),     ARG(block),
                                          MEM(a->counts.mem),  ARG(a->counts.off),  MEM(a->post.mem), ARG(a->post.off),
                                          MEM(a->invalid.mem), ARG(a->invalid.off), ARG(has_invalid),
                                          LOCAL(moecl_layout_moe_align_cols(experts))};
    const moecl_kernel_arg scatter_args[] = {
        MEM(a->ids.mem),    ARG(a->ids.off),    ARG(slots),        ARG(experts),      ARG(chunk),
        MEM(scratch),       ARG(starts_off),    MEM(a->sorted.mem), ARG(a->sorted.off), MEM(a->slots.mem),
        ARG(a->slots.off),  ARG(has_slots),     ARG(block),        ARG(max_padded),   ARG(num_blocks),
        MEM(a->blocks.mem), ARG(a->blocks.off), LOCAL(moecl_layout_moe_align_cols(experts)), MAP_ARGS(a)};
#define STEP(k, args, nargs, groups, wg)                                                                          \
    ((moecl_step){k, args, nargs, (size_t)(groups) * (wg), (wg), NULL, 0, 0, NULL, NULL})
    moecl_step steps[3];
    int n = 0;
    if (chunks > 0)
        steps[n++] = STEP(COUNT_KERNEL, count_args, NARGS(count_args, a), chunks, s->wg);
    steps[n++] = STEP(SCAN_KERNEL, scan_args, (cl_uint)(sizeof(scan_args) / sizeof(scan_args[0])), 1, s->scan_wg);
    /* Also with no slots: the scatter writes the padding and the blocks. */
    steps[n++] = STEP(SCATTER_KERNEL, scatter_args, NARGS(scatter_args, a), chunks ? chunks : 1, s->wg);
#undef STEP
    st = moecl_plan_run(ctx, p, steps, n, num_wait, wait, done);
    if (ctx->in_order && ctx->scratch_lock_ready)
        ctx->scratch_zero_words = 0; /* the count matrix starts at word 0 */
    /* Every kernel that uses it is enqueued (or waited for). */
    moecl_scratch_release(ctx, scratch);
    return st;
}

/* The outputs' sizes in bytes, and the map's. */
typedef struct align_sizes {
    uint64_t ids, counts, sorted, blocks, map;
} align_sizes;

static align_sizes sizes_of(const moecl_moe_align_desc *d)
{
    const uint64_t max_padded = moecl_moe_align_max_padded(d);
    return (align_sizes){(uint64_t)d->num_tokens * d->top_k * 4, (uint64_t)d->num_experts * 4, max_padded * 4,
                         max_padded / d->block_size * 4, (uint64_t)d->num_global_experts * 4};
}

/* A map is given exactly where desc asks for one. */
static moecl_status check_map(moecl_context *ctx, const moecl_moe_align_desc *d, bool has_map)
{
    if (d->num_global_experts > 0 && !has_map)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "num_global_experts is %u but expert_map is absent (moecl_moe_align_ex takes the map)",
                          d->num_global_experts);
    if (d->num_global_experts == 0 && has_map)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "expert_map is given but num_global_experts is 0: set it to the map's length");
    return MOECL_SUCCESS;
}

moecl_status moecl_moe_align_ex(moecl_context *ctx, const moecl_moe_align_desc *desc,
                                const moecl_moe_align_tensors *t, cl_uint num_wait, const cl_event *wait,
                                cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    /* Its first version, which ends at expert_map, is today's whole record. */
    if ((st = moecl_check_record(ctx, t, t ? t->struct_size : 0, sizeof(*t), sizeof(*t))) != MOECL_SUCCESS ||
        (st = check_map(ctx, desc, t->expert_map.mem != NULL)) != MOECL_SUCCESS)
        return st;
    const align_sizes z = sizes_of(desc);
    const bool has_map = desc->num_global_experts > 0;
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "topk_ids", t->topk_ids, z.ids, 4, true)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "expert_counts", t->expert_counts, z.counts, 4, true)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "sorted_token_ids", t->sorted_token_ids, z.sorted, 4, true)) !=
            MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "block_expert_ids", t->block_expert_ids, z.blocks, 4, true)) !=
            MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "num_tokens_post_padded", t->num_tokens_post_padded, 4, 4, true)) !=
            MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "slot_positions", t->slot_positions, z.ids, 4, false)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "num_invalid", t->num_invalid, 4, 4, false)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "expert_map", t->expert_map, z.map, 4, has_map)) != MOECL_SUCCESS)
        return st;
    const moecl_plan *p;
    if ((st = align_plan(ctx, has_map, &p)) != MOECL_SUCCESS)
        return st;
    const align_args a = {
        {t->topk_ids.mem, t->topk_ids.offset / 4},
        {t->expert_counts.mem, t->expert_counts.offset / 4},
        {t->sorted_token_ids.mem, t->sorted_token_ids.offset / 4},
        {t->block_expert_ids.mem, t->block_expert_ids.offset / 4},
        {t->num_tokens_post_padded.mem, t->num_tokens_post_padded.offset / 4},
        {t->slot_positions.mem, t->slot_positions.offset / 4},
        {t->num_invalid.mem, t->num_invalid.offset / 4},
        {t->expert_map.mem, t->expert_map.offset / 4},
        desc->num_global_experts,
    };
    return enqueue(ctx, desc, p, &a, num_wait, wait, done);
}

moecl_status moecl_moe_align(moecl_context *ctx, const moecl_moe_align_desc *desc, moecl_buffer topk_ids,
                             moecl_buffer expert_counts, moecl_buffer sorted_token_ids, moecl_buffer block_expert_ids,
                             moecl_buffer num_tokens_post_padded, moecl_buffer slot_positions,
                             moecl_buffer num_invalid, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const moecl_moe_align_tensors t = {sizeof(t),      topk_ids,       expert_counts, sorted_token_ids,
                                       block_expert_ids, num_tokens_post_padded, slot_positions, num_invalid,
                                       {NULL, 0}};
    return moecl_moe_align_ex(ctx, desc, &t, num_wait, wait, done);
}

moecl_status moecl_moe_align_ex_host(moecl_context *ctx, const moecl_moe_align_desc *desc,
                                     const moecl_moe_align_host_tensors *t)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    /* Its first version, which ends at expert_map, is today's whole record. */
    if ((st = moecl_check_record(ctx, t, t ? t->struct_size : 0, sizeof(*t), sizeof(*t))) != MOECL_SUCCESS ||
        (st = check_map(ctx, desc, t->expert_map != NULL)) != MOECL_SUCCESS)
        return st;
    const align_sizes z = sizes_of(desc);
    const char *missing = (!t->topk_ids && z.ids)                   ? "topk_ids"
                          : !t->expert_counts                       ? "expert_counts"
                          : !t->sorted_token_ids && z.sorted        ? "sorted_token_ids"
                          : !t->block_expert_ids && z.blocks        ? "block_expert_ids"
                          : !t->num_tokens_post_padded              ? "num_tokens_post_padded"
                                                                    : NULL;
    if (missing)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    const bool has_map = desc->num_global_experts > 0;
    const moecl_plan *p;
    if ((st = align_plan(ctx, has_map, &p)) != MOECL_SUCCESS)
        return st;
    /* Buffers of at least 4 bytes: OpenCL refuses empty ones. */
#define AT_LEAST_4(n) ((size_t)((n) ? (n) : 4))
    enum { IDS, MAP, COUNTS, SORTED, BLOCKS, POST, SLOTS, INVALID, NUM };
    cl_mem m[NUM] = {NULL};
    const size_t sizes[NUM] = {AT_LEAST_4(z.ids),    AT_LEAST_4(z.map),    AT_LEAST_4(z.counts), AT_LEAST_4(z.sorted),
                               AT_LEAST_4(z.blocks), 4,                    AT_LEAST_4(z.ids),    4};
    const char *names[NUM] = {"topk_ids", "expert_map", "expert_counts", "sorted_token_ids", "block_expert_ids",
                              "num_tokens_post_padded", "slot_positions", "num_invalid"};
    void *const hosts[NUM] = {NULL,
                              NULL,
                              t->expert_counts,
                              z.sorted ? t->sorted_token_ids : NULL,
                              z.blocks ? t->block_expert_ids : NULL,
                              t->num_tokens_post_padded,
                              z.ids ? t->slot_positions : NULL,
                              t->num_invalid};
    for (int i = 0; i < NUM && st == MOECL_SUCCESS; i++) {
        if (i == IDS)
            st = moecl_host_buffer(ctx, names[i], CL_MEM_READ_ONLY, sizes[i], z.ids ? t->topk_ids : NULL, &m[i]);
        else if (i == MAP) {
            if (has_map)
                st = moecl_host_buffer(ctx, names[i], CL_MEM_READ_ONLY, sizes[i], t->expert_map, &m[i]);
        } else if ((i != SLOTS || t->slot_positions) && (i != INVALID || t->num_invalid))
            st = moecl_host_buffer(ctx, names[i], CL_MEM_WRITE_ONLY, sizes[i], NULL, &m[i]);
    }
#undef AT_LEAST_4
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS) {
        const align_args a = {{m[IDS], 0},   {m[COUNTS], 0}, {m[SORTED], 0},  {m[BLOCKS], 0}, {m[POST], 0},
                              {m[SLOTS], 0}, {m[INVALID], 0}, {m[MAP], 0}, desc->num_global_experts};
        st = enqueue(ctx, desc, p, &a, 0, NULL, &ran);
    }
    /* Every output, read back where the host gave one. */
    const size_t read_sizes[NUM - COUNTS] = {z.counts, z.sorted, z.blocks, 4, z.ids, 4};
    return moecl_host_call_end(ctx, st, ran, m, NUM, COUNTS, read_sizes, hosts);
}

moecl_status moecl_moe_align_host(moecl_context *ctx, const moecl_moe_align_desc *desc, const int32_t *topk_ids,
                                  int32_t *expert_counts, int32_t *sorted_token_ids, int32_t *block_expert_ids,
                                  int32_t *num_tokens_post_padded, int32_t *slot_positions, int32_t *num_invalid)
{
    const moecl_moe_align_host_tensors t = {sizeof(t),        topk_ids,       expert_counts,
                                            sorted_token_ids, block_expert_ids, num_tokens_post_padded,
                                            slot_positions,   num_invalid,    NULL};
    return moecl_moe_align_ex_host(ctx, desc, &t);
}
