/* The expert-parallel dispatch layout, host side: validation, the path
 * (three chained launches, or the one-launch fused kernel; cl/ep_layout.cl says
 * what each kernel does), the chunks, the scratch buffer and the blocking
 * host-memory path. */
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

#define EP_MAX_PHYSICAL 16384u
#define EP_MAX_RANKS 1024u
#define EP_MAX_REPLICAS 64u
#define EP_MAX_CHUNKS 4096u

/* cl/ep_layout.cl's flags. */
enum { EP_MAP = 1, EP_TABLE = 2, EP_TIR = 4, EP_TPR = 8, EP_COUNTS = 16, EP_MAY_WAIT = 32 };
/* The fused kernel's rows a pass (flags >> EP_ROWS_SHIFT), at most EP_MAX_ROWS. */
enum { EP_ROWS_SHIFT = 8, EP_MAX_ROWS = 4 };

/* The fused kernel's limits: its tickets are 7-bit fields (at most 127
 * work-groups), a slot's rank in its chunk is 16 bits, and its sub-tile
 * counts take NSUB rows of num_ranks + 1 words of local memory. */
#define EP_FUSED_MAX_GROUPS 127u
#define EP_FUSED_MAX_CHUNK_SLOTS 65536u
#define EP_FUSED_MAX_RANKS 256u

moecl_ep_layout_desc moecl_ep_layout_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t num_experts,
                                               uint32_t num_ranks)
{
    moecl_ep_layout_desc d;
    memset(&d, 0, sizeof(d));
    d.num_tokens = num_tokens;
    d.top_k = top_k;
    d.num_experts = num_experts;
    d.num_physical = num_experts;
    d.num_ranks = num_ranks;
    d.max_replicas = 1;
    return d;
}

static moecl_status validate_desc(moecl_context *ctx, const moecl_ep_layout_desc *d)
{
#define INVALID(...) moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, __VA_ARGS__)
    if (!d)
        return INVALID("desc is NULL");
    if (d->top_k < 1 || d->top_k > MOECL_MAX_TOPK)
        return INVALID("top_k is %u; it must be in 1..%u", d->top_k, MOECL_MAX_TOPK);
    if (d->num_experts < 1 || d->num_experts > MOECL_MAX_EXPERTS)
        return INVALID("num_experts is %u; it must be in 1..%u", d->num_experts, MOECL_MAX_EXPERTS);
    if (d->num_physical < d->num_experts || d->num_physical > EP_MAX_PHYSICAL)
        return INVALID("num_physical is %u; it must be in num_experts..%u (%u..%u)", d->num_physical,
                       EP_MAX_PHYSICAL, d->num_experts, EP_MAX_PHYSICAL);
    if (d->num_ranks < 1 || d->num_ranks > EP_MAX_RANKS)
        return INVALID("num_ranks is %u; it must be in 1..%u", d->num_ranks, EP_MAX_RANKS);
    if (d->max_replicas < 1 || d->max_replicas > EP_MAX_REPLICAS)
        return INVALID("max_replicas is %u; it must be in 1..%u", d->max_replicas, EP_MAX_REPLICAS);
    const uint64_t slots = (uint64_t)d->num_tokens * d->top_k;
    if (slots > INT32_MAX)
        return INVALID("num_tokens is %u; num_tokens * top_k = %llu must be at most %d (INT32_MAX), so that slot "
                       "indices fit in int32",
                       d->num_tokens, (unsigned long long)slots, INT32_MAX);
    return MOECL_SUCCESS;
#undef INVALID
}

/* The checks that depend on which tables are given. */
static moecl_status validate_tables(moecl_context *ctx, const moecl_ep_layout_desc *d, bool has_map,
                                    bool has_counts, bool has_table)
{
#define INVALID(...) moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, __VA_ARGS__)
    if (has_map != has_counts)
        return INVALID("logical_to_physical is %s but replica_counts is %s; give both or neither",
                       has_map ? "given" : "absent", has_counts ? "given" : "absent");
    if (!has_map && (d->num_physical != d->num_experts || d->max_replicas != 1))
        return INVALID("without logical_to_physical the map is the identity: num_physical (%u) must equal "
                       "num_experts (%u) and max_replicas (%u) be 1",
                       d->num_physical, d->num_experts, d->max_replicas);
    if (!has_table && d->num_physical % d->num_ranks != 0)
        return INVALID("without physical_to_rank the experts are placed in contiguous blocks: num_physical (%u) "
                       "must be a multiple of num_ranks (%u)",
                       d->num_physical, d->num_ranks);
    return MOECL_SUCCESS;
#undef INVALID
}

/* ---- the plan ---- */

enum { COUNT_KERNEL, SCAN_KERNEL, PLACE_KERNEL, FUSED_KERNEL, NUM_KERNELS };
static const char *const kernel_names[NUM_KERNELS] = {"ep_layout_count", "ep_layout_scan", "ep_layout_place",
                                                      "ep_layout_fused"};

/* The fused kernel's work-group: the device table's (or
 * the override's ep_wg) where the device allows, else the largest power of
 * two below the device's limit. */
static unsigned fused_wg_of(const moecl_device_info *info)
{
    const unsigned cap =
        info->env.ep_fused_wg ? info->env.ep_fused_wg : moecl_device_table_params(info).value[MOECL_DP_EP_FUSED_WG];
    unsigned w = 1;
    while (w * 2 <= cap && w * 2 <= info->max_work_group_size)
        w *= 2;
    return w;
}

void moecl_ep_layout_defines(const moecl_device_info *info, char *buf, size_t size, const char **kernel_names_out)
{
    char align[128];
    const char *names;
    moecl_moe_align_defines(info, align, sizeof(align), &names);
    snprintf(buf, size, "%s -DFWG=%u", align, fused_wg_of(info));
    *kernel_names_out = "ep_layout_count,ep_layout_scan,ep_layout_place,ep_layout_fused";
}

/* moe_align's defines (WG, SCAN_WG, ...), and FWG: the program includes
 * moe_align's source and the three kernels take its work-groups. */
static moecl_status build_plan(moecl_context *ctx, const void *request, moecl_plan *p)
{
    const moecl_plan *align = request;
    char defines[160];
    const char *names;
    moecl_ep_layout_defines(&ctx->info, defines, sizeof(defines), &names);
    moecl_status st;
    for (int i = 0; i < NUM_KERNELS; i++) {
        st = moecl_variant_get(ctx, MOECL_PROGRAM_EP_LAYOUT, defines, kernel_names[i], &p->variants[i]);
        if (st != MOECL_SUCCESS)
            return st;
        p->kernel_names[i] = kernel_names[i];
        p->limits[i] = moecl_variant_work_group_limit(p->variants[i]);
    }
    p->num_kernels = NUM_KERNELS;
    p->source = MOECL_SOURCE_DEFAULT;
    p->wg = align->wg;
    p->scan_wg = align->scan_wg;
    p->fused_wg = fused_wg_of(&ctx->info);
    p->fused_fits = p->limits[FUSED_KERNEL] >= p->fused_wg;
    return MOECL_SUCCESS;
}

/* moe_align's plan is looked up first, outside the table's lock that
 * building this one holds: its work-groups are this plan's. */
static moecl_status plan_of(moecl_context *ctx, const moecl_plan **plan)
{
    const moecl_plan *align;
    moecl_status st = moecl_moe_align_plan(ctx, false, &align);
    if (st != MOECL_SUCCESS)
        return st;
    const moecl_plan_key key = moecl_plan_key_of(ctx, MOECL_OP_EP_LAYOUT, (uint64_t)ctx->info.launch_class, 0, 0, 0);
    return moecl_plan_get(ctx, &key, build_plan, align, plan);
}

moecl_status moecl_ep_layout_prepare(moecl_context *ctx, const moecl_ep_layout_desc *desc)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    const moecl_plan *p;
    return plan_of(ctx, &p);
}

/* ---- enqueue ---- */

typedef struct ep_args {
    moecl_mem_at ids, l2p, replicas, p2r, phys, rank_counts, rank_offsets, send, tir, tpr, counts;
} ep_args;

/* Tokens per chunk: about 256 chunks on GPUs (the scan walks them
 * serially, as moe_align's does) and 8 per compute unit on CPUs; at least
 * as many slots as the matrix has columns, so that the matrix is no larger
 * than the slots; at most EP_MAX_CHUNKS chunks. */
static uint32_t chunk_tokens_of(const moecl_context *ctx, const moecl_ep_layout_desc *d)
{
    const uint32_t target = ctx->info.launch_class == MOECL_LAUNCH_CPU
                                ? 8 * (ctx->info.compute_units ? ctx->info.compute_units : 1)
                                : 256;
    uint64_t chunk = ((uint64_t)d->num_tokens + target - 1) / target;
    const uint64_t least = (2 * (uint64_t)d->num_ranks + 1 + d->top_k - 1) / d->top_k;
    if (chunk < least)
        chunk = least;
    const uint64_t most_chunks = ((uint64_t)d->num_tokens + chunk - 1) / chunk;
    if (most_chunks > EP_MAX_CHUNKS)
        chunk = ((uint64_t)d->num_tokens + EP_MAX_CHUNKS - 1) / EP_MAX_CHUNKS;
    return (uint32_t)(chunk ? chunk : 1);
}

#define ARG(v) MOECL_ARG(v)
#define MEM(m) MOECL_ARG_MEM(m)
#define LOCAL(bytes) MOECL_ARG_LOCAL(bytes)

/* The fused kernel's launch for d: tokens per chunk (whole tiles of
 * fused_wg / top_k tokens, about one chunk per compute unit, at most
 * EP_FUSED_MAX_GROUPS chunks), work-groups and local bytes; false where
 * it cannot serve d. */
typedef struct fused_shape {
    uint32_t chunk, groups, cols, rows;
    size_t local_bytes;
} fused_shape;

static bool fused_shape_of(const moecl_context *ctx, const moecl_plan *p, const moecl_ep_layout_desc *d,
                           bool has_counts, fused_shape *f)
{
    const unsigned wg = p->fused_wg;
    if (!p->fused_fits || wg < d->top_k || d->num_ranks > EP_FUSED_MAX_RANKS)
        return false;
    const uint32_t tile_tokens = wg / d->top_k;
    /* At least 4, so that a device of one compute unit (oclgrind) still
     * runs the tickets between work-groups. */
    uint32_t target = ctx->info.compute_units > 4 ? ctx->info.compute_units : 4;
    if (ctx->info.env.ep_fused_groups)
        target = ctx->info.env.ep_fused_groups;
    if (target > EP_FUSED_MAX_GROUPS)
        target = EP_FUSED_MAX_GROUPS;
    uint64_t chunk = ((uint64_t)d->num_tokens + target - 1) / target;
    chunk = moecl_round_up(chunk ? chunk : 1, tile_tokens);
    if (chunk * d->top_k > EP_FUSED_MAX_CHUNK_SLOTS)
        return false;
    f->chunk = (uint32_t)chunk;
    f->groups = d->num_tokens ? (uint32_t)(((uint64_t)d->num_tokens + chunk - 1) / chunk) : 1;
    f->cols = 2 * d->num_ranks + 1 + (has_counts ? d->num_physical : 0);
    /* Rows a pass: as many as the chunk has, up to EP_MAX_ROWS, fewer
     * where local memory is short (each row adds a line of counts a
     * sub-tile and its tokens' rank sets). */
    const size_t all = moecl_local_budget(&ctx->info), fixed = moecl_layout_ep_fused_static(wg);
    if (all < fixed)
        return false;
    const size_t budget = all - fixed;
    f->rows = chunk / tile_tokens < EP_MAX_ROWS ? (uint32_t)(chunk / tile_tokens) : EP_MAX_ROWS;
    for (;; f->rows--) {
        f->local_bytes =
            moecl_layout_ep_fused_lm(wg, f->cols, d->num_ranks, (size_t)chunk * d->top_k, d->top_k, f->rows);
        if (f->rows == 1 || f->local_bytes <= budget)
            break;
    }
    return f->local_bytes <= budget;
}

/* One launch: the fused kernel, whose scratch holds the tickets (word 0,
 * 0 between calls, as moe_align's fused kernel keeps it: a new buffer, or
 * one a three-kernel path wrote, is zeroed first by a fill; otherwise the
 * kernel is the call's only command) and the count matrix. */
static moecl_status enqueue_fused(moecl_context *ctx, const moecl_ep_layout_desc *d, const moecl_plan *p,
                                  const ep_args *a, const fused_shape *f, cl_uint flags, cl_uint num_wait,
                                  const cl_event *wait, cl_event *done)
{
    const size_t scratch_bytes = (1 + (size_t)f->groups * f->cols) * 4;
    cl_mem scratch;
    moecl_status st = moecl_scratch_acquire(ctx, scratch_bytes, &scratch);
    if (st != MOECL_SUCCESS)
        return st;
    const bool reused = ctx->in_order && ctx->scratch_lock_ready;
    const cl_uint8 dims = {{d->num_tokens, d->top_k, d->num_experts, d->num_physical, d->num_ranks, d->max_replicas,
                            flags | f->rows << EP_ROWS_SHIFT, f->chunk}};
    const cl_ulong4 in0 = {{a->ids.off, a->l2p.off, a->replicas.off, a->p2r.off}};
    const cl_ulong4 out0 = {{a->phys.off, a->tir.off, a->rank_counts.off, a->rank_offsets.off}};
    const cl_ulong4 out1 = {{a->send.off, a->tpr.off, a->counts.off, 0}};
    const moecl_kernel_arg args[] = {
        MEM(a->ids.mem),         MEM(a->l2p.mem),          MEM(a->replicas.mem), MEM(a->p2r.mem),
        ARG(in0),                ARG(dims),                MEM(a->phys.mem),     MEM(a->tir.mem),
        MEM(a->rank_counts.mem), MEM(a->rank_offsets.mem), ARG(out0),            MEM(a->send.mem),
        MEM(a->tpr.mem),         MEM(a->counts.mem),       ARG(out1),            MEM(scratch),
        LOCAL(f->local_bytes)};
    moecl_step steps[2];
    int n = 0;
    if (!reused || ctx->scratch_zero_words < 1)
        steps[n++] = (moecl_step){0, NULL, 0, 0, 0, scratch, 0, 4, "the layout's tickets", NULL};
    steps[n++] = (moecl_step){FUSED_KERNEL, args, (cl_uint)(sizeof(args) / sizeof(args[0])),
                              (size_t)f->groups * p->fused_wg, p->fused_wg, NULL, 0, 0, NULL, NULL};
    st = moecl_plan_run(ctx, p, steps, n, num_wait, wait, done);
    if (reused)
        ctx->scratch_zero_words = st == MOECL_SUCCESS ? 1 : 0; /* its ticket, word 0 */
    moecl_scratch_release(ctx, scratch);
    return st;
}

static moecl_status enqueue(moecl_context *ctx, const moecl_ep_layout_desc *d, const moecl_plan *p,
                            const ep_args *a, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const cl_uint tokens = d->num_tokens, top_k = d->top_k, experts = d->num_experts, physical = d->num_physical;
    const cl_uint ranks = d->num_ranks, replicas = d->max_replicas;
    const cl_uint flags = (a->l2p.mem ? EP_MAP : 0) | (a->p2r.mem ? EP_TABLE : 0) | (a->tir.mem ? EP_TIR : 0) |
                          (a->tpr.mem ? EP_TPR : 0) | (a->counts.mem ? EP_COUNTS : 0);
    /* The path: the override's ep= where it forces one the device can run,
     * else the device table's for the launch class. */
    const moecl_ep_path path = ctx->info.env.ep_path;
    const bool fused = moecl_device_param_class(&ctx->params, MOECL_DP_EP_FUSED_CPU, ctx->info.launch_class);
    fused_shape f;
    if (path != MOECL_EP_CHUNKED && (path != MOECL_EP_AUTO || fused) &&
        fused_shape_of(ctx, p, d, a->counts.mem != NULL, &f))
        return enqueue_fused(ctx, d, p, a, &f, flags | (path == MOECL_EP_FUSED_LAST ? 0 : EP_MAY_WAIT), num_wait,
                             wait, done);
    const cl_uint chunk = chunk_tokens_of(ctx, d);
    const cl_uint chunks = (cl_uint)(((uint64_t)tokens + chunk - 1) / chunk);
    const size_t cols = 2 * (size_t)ranks + 1;
    const size_t matrix_words = (size_t)chunks * cols;
    /* The count matrix [chunks][cols], the rank starts [ranks + 1], then
     * each slot's rank (its key). */
    const size_t slots = (size_t)tokens * top_k;
    const size_t scratch_bytes = (matrix_words + ranks + 1 + slots) * 4;
    cl_mem scratch;
    moecl_status st = moecl_scratch_acquire(ctx, scratch_bytes, &scratch);
    if (st != MOECL_SUCCESS)
        return st;
    const cl_ulong starts_off = matrix_words, keys_off = matrix_words + ranks + 1;
    const moecl_kernel_arg count_args[] = {
        MEM(a->ids.mem),  ARG(a->ids.off),      ARG(tokens),           ARG(top_k),          ARG(experts),
        ARG(physical),    ARG(ranks),           ARG(replicas),         ARG(flags),          MEM(a->l2p.mem),
        ARG(a->l2p.off),  MEM(a->replicas.mem), ARG(a->replicas.off),  MEM(a->p2r.mem),     ARG(a->p2r.off),
        ARG(chunk),       MEM(a->phys.mem),     ARG(a->phys.off),      MEM(a->tir.mem),     ARG(a->tir.off),
        MEM(scratch),     ARG(keys_off),        LOCAL(cols * 4)};
    const moecl_kernel_arg scan_args[] = {
        MEM(scratch),          ARG(chunks),          ARG(ranks),       ARG(physical),       ARG(flags),
        MEM(a->rank_counts.mem), ARG(a->rank_counts.off), MEM(a->rank_offsets.mem), ARG(a->rank_offsets.off),
        MEM(a->tpr.mem),       ARG(a->tpr.off),      MEM(a->counts.mem), ARG(a->counts.off), LOCAL(cols * 4)};
    const moecl_kernel_arg place_args[] = {
        MEM(a->phys.mem),   ARG(a->phys.off),   ARG(tokens),       ARG(top_k),        ARG(ranks),
        ARG(flags),         ARG(chunk),         MEM(scratch),      ARG(starts_off),   ARG(keys_off),
        MEM(a->send.mem),   ARG(a->send.off),   MEM(a->counts.mem), ARG(a->counts.off),
        LOCAL(((size_t)ranks + 1) * 4)};
#define STEP(k, args, groups, wg)                                                                                 \
    ((moecl_step){k, args, (cl_uint)(sizeof(args) / sizeof(args[0])), (size_t)(groups) * (wg), (wg), NULL, 0, 0, NULL, \
                  NULL})
    moecl_step steps[3];
    int n = 0;
    if (chunks > 0)
        steps[n++] = STEP(COUNT_KERNEL, count_args, chunks, p->wg);
    steps[n++] = STEP(SCAN_KERNEL, scan_args, 1, p->scan_wg);
    if (chunks > 0)
        steps[n++] = STEP(PLACE_KERNEL, place_args, chunks, p->wg);
#undef STEP
    st = moecl_plan_run(ctx, p, steps, n, num_wait, wait, done);
    if (ctx->in_order && ctx->scratch_lock_ready)
        ctx->scratch_zero_words = 0; /* moe_align's fused ticket is word 0 */
    moecl_scratch_release(ctx, scratch);
    return st;
}

/* The tensors' sizes in bytes. */
typedef struct ep_sizes {
    uint64_t ids, l2p, replicas, p2r, ranks, offsets, tir, physical;
} ep_sizes;

static ep_sizes sizes_of(const moecl_ep_layout_desc *d)
{
    const uint64_t slots = (uint64_t)d->num_tokens * d->top_k;
    return (ep_sizes){slots * 4,
                      (uint64_t)d->num_experts * d->max_replicas * 4,
                      (uint64_t)d->num_experts * 4,
                      (uint64_t)d->num_physical * 4,
                      (uint64_t)d->num_ranks * 4,
                      ((uint64_t)d->num_ranks + 1) * 4,
                      (uint64_t)d->num_tokens * d->num_ranks,
                      (uint64_t)d->num_physical * 4};
}

moecl_status moecl_ep_layout(moecl_context *ctx, const moecl_ep_layout_desc *desc, moecl_buffer topk_ids,
                             moecl_buffer logical_to_physical, moecl_buffer replica_counts,
                             moecl_buffer physical_to_rank, moecl_buffer physical_ids, moecl_buffer rank_counts,
                             moecl_buffer rank_offsets, moecl_buffer send_slots, moecl_buffer token_in_rank,
                             moecl_buffer tokens_per_rank, moecl_buffer expert_counts, cl_uint num_wait,
                             const cl_event *wait, cl_event *done)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    if ((st = validate_tables(ctx, desc, logical_to_physical.mem != NULL, replica_counts.mem != NULL,
                              physical_to_rank.mem != NULL)) != MOECL_SUCCESS)
        return st;
    const ep_sizes z = sizes_of(desc);
    const bool any = desc->num_tokens > 0;
    if ((st = moecl_check_wait_list(ctx, num_wait, wait)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "topk_ids", topk_ids, z.ids, 4, any)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "logical_to_physical", logical_to_physical, z.l2p, 4, false)) !=
            MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "replica_counts", replica_counts, z.replicas, 4, false)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "physical_to_rank", physical_to_rank, z.p2r, 4, false)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "physical_ids", physical_ids, z.ids, 4, any)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "rank_counts", rank_counts, z.ranks, 4, true)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "rank_offsets", rank_offsets, z.offsets, 4, true)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "send_slots", send_slots, z.ids, 4, any)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "token_in_rank", token_in_rank, z.tir, 1, false)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "tokens_per_rank", tokens_per_rank, z.ranks, 4, false)) != MOECL_SUCCESS ||
        (st = moecl_check_buffer(ctx, "expert_counts", expert_counts, z.physical, 4, false)) != MOECL_SUCCESS)
        return st;
    const moecl_plan *p;
    if ((st = plan_of(ctx, &p)) != MOECL_SUCCESS)
        return st;
    const ep_args a = {
        {topk_ids.mem, topk_ids.offset / 4},
        {logical_to_physical.mem, logical_to_physical.offset / 4},
        {replica_counts.mem, replica_counts.offset / 4},
        {physical_to_rank.mem, physical_to_rank.offset / 4},
        {physical_ids.mem, physical_ids.offset / 4},
        {rank_counts.mem, rank_counts.offset / 4},
        {rank_offsets.mem, rank_offsets.offset / 4},
        {send_slots.mem, send_slots.offset / 4},
        {token_in_rank.mem, token_in_rank.offset},
        {tokens_per_rank.mem, tokens_per_rank.offset / 4},
        {expert_counts.mem, expert_counts.offset / 4},
    };
    return enqueue(ctx, desc, p, &a, num_wait, wait, done);
}

moecl_status moecl_ep_layout_host(moecl_context *ctx, const moecl_ep_layout_desc *desc, const int32_t *topk_ids,
                                  const int32_t *logical_to_physical, const int32_t *replica_counts,
                                  const int32_t *physical_to_rank, int32_t *physical_ids, int32_t *rank_counts,
                                  int32_t *rank_offsets, int32_t *send_slots, uint8_t *token_in_rank,
                                  int32_t *tokens_per_rank, int32_t *expert_counts)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    moecl_status st = validate_desc(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    if ((st = validate_tables(ctx, desc, logical_to_physical != NULL, replica_counts != NULL,
                              physical_to_rank != NULL)) != MOECL_SUCCESS)
        return st;
    const ep_sizes z = sizes_of(desc);
    const char *missing = (!topk_ids && z.ids)       ? "topk_ids"
                          : (!physical_ids && z.ids) ? "physical_ids"
                          : !rank_counts             ? "rank_counts"
                          : !rank_offsets            ? "rank_offsets"
                          : (!send_slots && z.ids)   ? "send_slots"
                                                     : NULL;
    if (missing)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    const moecl_plan *p;
    if ((st = plan_of(ctx, &p)) != MOECL_SUCCESS)
        return st;
    /* Buffers of at least 4 bytes: OpenCL refuses empty ones. */
#define AT_LEAST_4(n) ((size_t)((n) ? (n) : 4))
    enum { IDS, L2P, REPLICAS, P2R, PHYS, RANKS, OFFSETS, SEND, TIR, TPR, COUNTS, NUM };
    const void *const inputs[P2R + 1] = {z.ids ? topk_ids : NULL, logical_to_physical, replica_counts,
                                         physical_to_rank};
    void *const hosts[NUM] = {NULL, NULL, NULL, NULL, z.ids ? physical_ids : NULL, rank_counts, rank_offsets,
                              z.ids ? send_slots : NULL, z.tir ? token_in_rank : NULL, tokens_per_rank,
                              expert_counts};
    const uint64_t sizes[NUM] = {z.ids, z.l2p, z.replicas, z.p2r, z.ids, z.ranks, z.offsets, z.ids, z.tir, z.ranks,
                                 z.physical};
    const char *names[NUM] = {"topk_ids",    "logical_to_physical", "replica_counts", "physical_to_rank",
                              "physical_ids", "rank_counts",        "rank_offsets",   "send_slots",
                              "token_in_rank", "tokens_per_rank",   "expert_counts"};
    cl_mem m[NUM] = {NULL};
    for (int i = 0; i < NUM && st == MOECL_SUCCESS; i++) {
        if (i <= P2R) {
            if (i == IDS || inputs[i])
                st = moecl_host_buffer(ctx, names[i], CL_MEM_READ_ONLY, AT_LEAST_4(sizes[i]), inputs[i], &m[i]);
        } else if (hosts[i] || i == PHYS || i == SEND) {
            /* physical_ids and send_slots are always written (tokens > 0). */
            st = moecl_host_buffer(ctx, names[i], CL_MEM_READ_WRITE, AT_LEAST_4(sizes[i]), NULL, &m[i]);
        }
    }
#undef AT_LEAST_4
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS) {
        const ep_args a = {{m[IDS], 0},   {m[L2P], 0},     {m[REPLICAS], 0}, {m[P2R], 0},
                           {m[PHYS], 0},  {m[RANKS], 0},   {m[OFFSETS], 0},  {m[SEND], 0},
                           {m[TIR], 0},   {m[TPR], 0},     {m[COUNTS], 0}};
        st = enqueue(ctx, desc, p, &a, 0, NULL, &ran);
    }
    size_t read_sizes[NUM - PHYS];
    for (int i = PHYS; i < NUM; i++)
        read_sizes[i - PHYS] = (size_t)sizes[i];
    return moecl_host_call_end(ctx, st, ran, m, NUM, PHYS, read_sizes, hosts);
}
