/* moecl_permute, moecl_permute_scatter and moecl_combine, host side:
 * validation, the variant of the dtypes, the launch shape by launch class,
 * one enqueue of cl/permute.cl's kernel, and the blocking host-memory
 * paths. */
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "kernel_layout.h"

#define PERMUTE_MAX_HIDDEN (1u << 20)
/* Work-items of a work-group: GPUs take up to this many (rows of tpr
 * work-items), CPUs a few rows of one work-item each. */
#define PERMUTE_GPU_WG 256u
#define PERMUTE_CPU_ROWS 8u

/* The sizes both descriptors start with, every dtype f32 (0). */
#define INIT_SIZES(d)                                                                                          \
    do {                                                                                                       \
        memset(&(d), 0, sizeof(d));                                                                            \
        (d).num_tokens = num_tokens;                                                                           \
        (d).top_k = top_k;                                                                                     \
        (d).hidden = hidden;                                                                                   \
        (d).num_padded = num_padded;                                                                           \
    } while (0)

moecl_permute_desc moecl_permute_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t hidden, uint32_t num_padded)
{
    moecl_permute_desc d;
    INIT_SIZES(d);
    return d;
}

moecl_combine_desc moecl_combine_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t hidden, uint32_t num_padded)
{
    moecl_combine_desc d;
    INIT_SIZES(d);
    return d;
}

/* The fields both descriptors share, checked alike. */
typedef struct shape {
    uint32_t num_tokens, top_k, hidden, num_padded;
} shape;

static bool dtype_ok(moecl_dtype t)
{
    return t == MOECL_F32 || t == MOECL_F16 || t == MOECL_BF16;
}

static moecl_status validate(moecl_context *ctx, const void *desc, const shape *s, const moecl_dtype *dtypes,
                             const char *const *dtype_names, int num_dtypes)
{
#define INVALID(...) moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, __VA_ARGS__)
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx is NULL");
    if (!desc)
        return INVALID("desc is NULL");
    if (s->top_k < 1 || s->top_k > MOECL_MAX_TOPK)
        return INVALID("top_k is %u; it must be in 1..%u", s->top_k, MOECL_MAX_TOPK);
    if (s->hidden < 1 || s->hidden > PERMUTE_MAX_HIDDEN)
        return INVALID("hidden is %u; it must be in 1..%u", s->hidden, PERMUTE_MAX_HIDDEN);
    if (s->num_padded > INT32_MAX)
        return INVALID("num_padded is %u; it must be at most %d (INT32_MAX): positions are int32", s->num_padded,
                       INT32_MAX);
    if ((uint64_t)s->num_tokens * s->top_k > INT32_MAX)
        return INVALID("num_tokens * top_k is %llu; it must be at most %d (INT32_MAX): slots are int32",
                       (unsigned long long)s->num_tokens * s->top_k, INT32_MAX);
    for (int i = 0; i < num_dtypes; i++)
        if (!dtype_ok(dtypes[i]))
            return INVALID("%s is %d; it must be MOECL_F32, MOECL_F16 or MOECL_BF16", dtype_names[i],
                           (int)dtypes[i]);
    return MOECL_SUCCESS;
#undef INVALID
}

static moecl_status validate_permute(moecl_context *ctx, const moecl_permute_desc *d)
{
    static const char *const names[] = {"in_dtype", "out_dtype"};
    const shape s = d ? (shape){d->num_tokens, d->top_k, d->hidden, d->num_padded} : (shape){0, 0, 0, 0};
    const moecl_dtype dtypes[2] = {d ? d->in_dtype : MOECL_F32, d ? d->out_dtype : MOECL_F32};
    return validate(ctx, d, &s, dtypes, names, 2);
}

static moecl_status validate_combine(moecl_context *ctx, const moecl_combine_desc *d)
{
    static const char *const names[] = {"in_dtype", "out_dtype", "shared_dtype"};
    const shape s = d ? (shape){d->num_tokens, d->top_k, d->hidden, d->num_padded} : (shape){0, 0, 0, 0};
    const moecl_dtype dtypes[3] = {d ? d->in_dtype : MOECL_F32, d ? d->out_dtype : MOECL_F32,
                                   d ? d->shared_dtype : MOECL_F32};
    return validate(ctx, d, &s, dtypes, names, 3);
}

/* ---- variants and plans ---- */

/* The three kernels of cl/permute.cl. */
typedef enum permute_kind { KIND_GATHER, KIND_COMBINE, KIND_SCATTER } permute_kind;

/* What a program is built for: the kernel and its dtypes (shared -1: no
 * shared expert rows). */
typedef struct permute_request {
    permute_kind kind;
    moecl_dtype in, out;
    int shared;
} permute_request;

static const char *kernel_of(permute_kind kind)
{
    return kind == KIND_COMBINE ? "combine_rows" : kind == KIND_SCATTER ? "permute_scatter" : "permute_rows";
}

static void defines_of(const permute_request *r, char *buf, size_t size)
{
    if (r->kind == KIND_COMBINE && r->shared >= 0)
        snprintf(buf, size, "-DIN_DTYPE=%d -DOUT_DTYPE=%d -DHAS_SHARED=1 -DSHARED_DTYPE=%d", (int)r->in, (int)r->out,
                 r->shared);
    else
        snprintf(buf, size, "-DIN_DTYPE=%d -DOUT_DTYPE=%d", (int)r->in, (int)r->out);
}

void moecl_permute_defines(bool combine, moecl_dtype in, moecl_dtype out, int shared, char *buf, size_t size,
                           const char **kernel_name)
{
    const permute_request r = {combine ? KIND_COMBINE : KIND_GATHER, in, out, shared};
    defines_of(&r, buf, size);
    *kernel_name = kernel_of(r.kind);
}

static unsigned floor_pow2(size_t v, unsigned cap)
{
    unsigned p = 1;
    while (p * 2 <= cap && p * 2 <= v)
        p *= 2;
    return p;
}

/* The plan (moecl_plan_build): one kernel and its work-group, within the
 * device's limit and the kernel's. */
static moecl_status build_plan(moecl_context *ctx, const void *request, moecl_plan *p)
{
    const permute_request *r = request;
    char defines[128];
    defines_of(r, defines, sizeof(defines));
    const char *name = kernel_of(r->kind);
    moecl_status st = moecl_variant_get(ctx, MOECL_PROGRAM_PERMUTE, defines, name, &p->variants[0]);
    if (st != MOECL_SUCCESS)
        return st;
    p->kernel_names[0] = name;
    p->limits[0] = moecl_variant_work_group_limit(p->variants[0]);
    p->num_kernels = 1;
    p->source = MOECL_SOURCE_DEFAULT;
    size_t limit = ctx->info.max_work_group_size;
    if (p->limits[0] && p->limits[0] < limit)
        limit = p->limits[0];
    const bool gpu = ctx->info.launch_class == MOECL_LAUNCH_GPU;
    unsigned cap = gpu ? PERMUTE_GPU_WG : PERMUTE_CPU_ROWS;
    if (r->kind == KIND_SCATTER) {
        const moecl_device_params dp = moecl_device_table_params(&ctx->info);
        cap = dp.value[gpu ? MOECL_DP_SCATTER_WG_GPU : MOECL_DP_SCATTER_WG_CPU];
    }
    /* Under a driver's loop limit a row may need many work-items
     * (shape_for): the GPU class's work-group. */
    if (ctx->params.value[MOECL_DP_LOOP_LIMIT] && cap < PERMUTE_GPU_WG)
        cap = PERMUTE_GPU_WG;
    p->local = floor_pow2(limit ? limit : 1, cap);
    return MOECL_SUCCESS;
}

static moecl_status plan_of(moecl_context *ctx, const permute_request *r, const moecl_plan **plan)
{
    const uint64_t a = (uint64_t)ctx->info.launch_class | (uint64_t)r->in << 1 | (uint64_t)r->out << 3 |
                       (uint64_t)(r->shared + 1) << 5;
    const uint64_t tag = r->kind == KIND_COMBINE   ? MOECL_PLAN_TAG_COMBINE
                         : r->kind == KIND_SCATTER ? MOECL_PLAN_TAG_SCATTER
                                                   : MOECL_PLAN_TAG_PERMUTE;
    const moecl_plan_key key = moecl_plan_key_of(ctx, MOECL_OP_MOE_ALIGN, a, 0, tag, 0);
    return moecl_plan_get(ctx, &key, build_plan, r, plan);
}

/* The launch shape of rows rows of units (vectors) each: on GPUs tpr
 * work-items a row (enough for one unit each, at most the work-group) and
 * the rest of the work-group on more rows; on CPUs a work-item a row, or
 * as many as keep a work-item's loops within the driver's loop limit: a
 * work-item loops over its ceil(units / tpr) units, per_unit iterations
 * each (and 4 more for a row's tail). per_unit is twice the loops a unit
 * visits in the source: rusticl's llvmpipe left a permute of 65537 units
 * on two work-items a row short at the row's end, so a unit of the plain
 * copy costs it more than one iteration. */
typedef struct launch_shape {
    cl_uint tpr, rpg;
    size_t global, local;
} launch_shape;

/* Whether tpr work-items a row keep each within the driver's loop limit
 * (the context's table values: no table lookup on the call's path). */
static bool row_loops_fit(const moecl_context *ctx, cl_uint tpr, uint32_t units, uint32_t per_unit)
{
    return moecl_params_loops_fit(&ctx->params, ((uint64_t)units / tpr + 5) * per_unit);
}

static launch_shape shape_for(const moecl_context *ctx, const moecl_plan *p, uint64_t rows, uint32_t units,
                              uint32_t per_unit)
{
    launch_shape s;
    s.local = p->local;
    s.tpr = 1;
    if (ctx->info.launch_class == MOECL_LAUNCH_GPU) {
        s.tpr = moecl_pow2_at_least(units);
        if (s.tpr > s.local)
            s.tpr = (cl_uint)s.local;
    }
    while (s.tpr < s.local && !row_loops_fit(ctx, s.tpr, units, per_unit))
        s.tpr *= 2;
    s.rpg = (cl_uint)(s.local / s.tpr);
    s.global = ((size_t)rows + s.rpg - 1) / s.rpg * s.local;
    return s;
}

/* Whether shape s keeps a work-item within the driver's loop limit; the
 * failure's message where not. */
static moecl_status shape_fits(moecl_context *ctx, const launch_shape *s, const char *op, uint32_t hidden,
                               uint32_t units, uint32_t per_unit)
{
    if (row_loops_fit(ctx, s->tpr, units, per_unit))
        return MOECL_SUCCESS;
    return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED,
                      "%s: at hidden %u, %u work-items a row leave each more iterations than the driver's loop limit "
                      "of %u (docs/devices.md)",
                      op, hidden, s->tpr, ctx->params.value[MOECL_DP_LOOP_LIMIT]);
}

/* Each buffer against its check, where check (the device entry points;
 * the host paths make their own buffers), until one fails. */
static moecl_status check_buffers(moecl_context *ctx, const moecl_buffer_check *checks, const moecl_buffer *bufs,
                                  int count, bool check)
{
    moecl_status st = MOECL_SUCCESS;
    for (int i = 0; i < count && check && st == MOECL_SUCCESS; i++)
        st = moecl_check_buffer(ctx, checks[i].name, bufs[i], checks[i].bytes, checks[i].elem_size,
                                checks[i].required);
    return st;
}

/* ---- moecl_permute ---- */

static moecl_status permute_launch(moecl_context *ctx, const moecl_permute_desc *d, moecl_buffer in,
                                   moecl_buffer ids, moecl_buffer post, moecl_buffer out, bool check,
                                   cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const size_t in_size = moecl_dtype_size(d->in_dtype), out_size = moecl_dtype_size(d->out_dtype);
    const uint64_t rows_in = d->num_tokens, padded = d->num_padded, h = d->hidden;
    const moecl_buffer_check checks[4] = {
        {"hidden_states", rows_in * h * in_size, in.offset, in_size, rows_in > 0 && padded > 0},
        {"sorted_token_ids", padded * 4, ids.offset, 4, padded > 0},
        {"num_tokens_post_padded", 4, post.offset, 4, true},
        {"out", padded * h * out_size, out.offset, out_size, padded > 0}};
    const moecl_buffer bufs[4] = {in, ids, post, out};
    const permute_request r = {KIND_GATHER, d->in_dtype, d->out_dtype, -1};
    moecl_status st = check_buffers(ctx, checks, bufs, 4, check);
    const moecl_plan *p;
    if (st != MOECL_SUCCESS || (st = plan_of(ctx, &r, &p)) != MOECL_SUCCESS)
        return st;
    if (padded == 0)
        return moecl_enqueue_nothing(ctx, num_wait, wait, done);
    const launch_shape s = shape_for(ctx, p, d->num_padded, (d->hidden + 3) / 4, 2);
    if ((st = shape_fits(ctx, &s, "permute", d->hidden, (d->hidden + 3) / 4, 2)) != MOECL_SUCCESS)
        return st;
    /* An absent input (no tokens: every row is padding) is never read; the
     * kernel still takes a buffer, the output. */
    const cl_mem in_mem = in.mem ? in.mem : out.mem;
    const layout_permute_args scalars = {in.mem ? in.offset / in_size : 0,
                                         ids.offset / 4,
                                         post.offset / 4,
                                         out.offset / out_size,
                                         d->hidden,
                                         d->num_padded,
                                         d->num_tokens * d->top_k,
                                         d->top_k,
                                         s.tpr,
                                         s.rpg};
    const moecl_kernel_arg args[] = {MOECL_ARG_MEM(in_mem), MOECL_ARG_MEM(ids.mem), MOECL_ARG_MEM(post.mem),
                                     MOECL_ARG_MEM(out.mem), MOECL_ARG(scalars)};
    moecl_step step = {0, args, 5, s.global, s.local, NULL, 0, 0, NULL, NULL};
    return moecl_plan_run(ctx, p, &step, 1, num_wait, wait, done);
}

moecl_status moecl_permute(moecl_context *ctx, const moecl_permute_desc *desc, moecl_buffer hidden_states,
                           moecl_buffer sorted_token_ids, moecl_buffer num_tokens_post_padded, moecl_buffer out,
                           cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    moecl_status st = validate_permute(ctx, desc);
    if (st == MOECL_SUCCESS)
        st = moecl_check_wait_list(ctx, num_wait, wait);
    if (st != MOECL_SUCCESS)
        return st;
    return permute_launch(ctx, desc, hidden_states, sorted_token_ids, num_tokens_post_padded, out, true, num_wait,
                          wait, done);
}

/* ---- moecl_permute_scatter ---- */

static moecl_status scatter_launch(moecl_context *ctx, const moecl_permute_desc *d, moecl_buffer in, moecl_buffer ids,
                                   moecl_buffer post, moecl_buffer pos, moecl_buffer out, bool check,
                                   cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const size_t in_size = moecl_dtype_size(d->in_dtype), out_size = moecl_dtype_size(d->out_dtype);
    const uint64_t t = d->num_tokens, k = d->top_k, padded = d->num_padded, h = d->hidden;
    const moecl_buffer_check checks[5] = {
        {"hidden_states", t * h * in_size, in.offset, in_size, t > 0 && padded > 0},
        {"sorted_token_ids", padded * 4, ids.offset, 4, padded > 0},
        {"num_tokens_post_padded", 4, post.offset, 4, true},
        {"slot_positions", t * k * 4, pos.offset, 4, t > 0 && padded > 0},
        {"out", padded * h * out_size, out.offset, out_size, padded > 0}};
    const moecl_buffer bufs[5] = {in, ids, post, pos, out};
    moecl_status st = check_buffers(ctx, checks, bufs, 5, check);
    const permute_request r = {KIND_SCATTER, d->in_dtype, d->out_dtype, -1};
    const moecl_plan *p;
    if (st != MOECL_SUCCESS || (st = plan_of(ctx, &r, &p)) != MOECL_SUCCESS)
        return st;
    if (padded == 0)
        return moecl_enqueue_nothing(ctx, num_wait, wait, done);
    /* Without tokens only padding rows remain: the rows are never read and
     * the kernel takes the output in their place. */
    const bool tokens = t > 0 && in.mem && pos.mem;
    /* Rows as uint4 words where every row start of both sides is 16-byte
     * aligned (a buffer's base is, CL_DEVICE_MEM_BASE_ADDR_ALIGN). */
    const bool wide = h * out_size % 16 == 0 && out.offset % 16 == 0 &&
                      (!tokens || (h * in_size % 16 == 0 && in.offset % 16 == 0));
    const uint32_t units = wide ? (uint32_t)(h * out_size / 16) : (d->hidden + 3) / 4;
    const uint32_t zr = ctx->params.value[MOECL_DP_SCATTER_ZERO_ROWS];
    const uint32_t zero_rows = zr ? zr : 1;
    /* A token's row goes to its top_k slots; a padding work-item zeroes
     * zero_rows rows. */
    const uint32_t per_unit = 2 * (uint32_t)(k + 1 > zero_rows ? k + 1 : zero_rows);
    const launch_shape s =
        shape_for(ctx, p, (tokens ? t : 0) + (padded + zero_rows - 1) / zero_rows, units, per_unit);
    if ((st = shape_fits(ctx, &s, "permute_scatter", d->hidden, units, per_unit)) != MOECL_SUCCESS)
        return st;
    const layout_scatter_args scalars = {tokens ? in.offset / in_size : 0,
                                         ids.offset / 4,
                                         post.offset / 4,
                                         tokens ? pos.offset / 4 : 0,
                                         out.offset / out_size,
                                         d->hidden,
                                         d->num_padded,
                                         tokens ? d->num_tokens : 0,
                                         d->top_k,
                                         s.tpr,
                                         s.rpg,
                                         wide,
                                         zero_rows};
    const cl_mem in_mem = tokens ? in.mem : out.mem, pos_mem = tokens ? pos.mem : ids.mem;
    const moecl_kernel_arg args[] = {MOECL_ARG_MEM(in_mem), MOECL_ARG_MEM(ids.mem), MOECL_ARG_MEM(post.mem),
                                     MOECL_ARG_MEM(pos_mem), MOECL_ARG_MEM(out.mem), MOECL_ARG(scalars)};
    moecl_step step = {0, args, 6, s.global, s.local, NULL, 0, 0, NULL, NULL};
    return moecl_plan_run(ctx, p, &step, 1, num_wait, wait, done);
}

moecl_status moecl_permute_scatter(moecl_context *ctx, const moecl_permute_desc *desc, moecl_buffer hidden_states,
                                   moecl_buffer sorted_token_ids, moecl_buffer num_tokens_post_padded,
                                   moecl_buffer slot_positions, moecl_buffer out, cl_uint num_wait,
                                   const cl_event *wait, cl_event *done)
{
    moecl_status st = validate_permute(ctx, desc);
    if (st == MOECL_SUCCESS)
        st = moecl_check_wait_list(ctx, num_wait, wait);
    if (st != MOECL_SUCCESS)
        return st;
    return scatter_launch(ctx, desc, hidden_states, sorted_token_ids, num_tokens_post_padded, slot_positions, out,
                          true, num_wait, wait, done);
}

/* moecl_permute_host and moecl_permute_scatter_host (scatter: with
 * slot_positions). */
static moecl_status rows_host(moecl_context *ctx, const moecl_permute_desc *desc, bool scatter,
                              const void *hidden_states, const int32_t *sorted_token_ids,
                              const int32_t *num_tokens_post_padded, const int32_t *slot_positions, void *out)
{
    moecl_status st = validate_permute(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    const size_t t = desc->num_tokens, k = desc->top_k, padded = desc->num_padded, h = desc->hidden;
    const char *missing = !num_tokens_post_padded                       ? "num_tokens_post_padded"
                          : padded && t && !hidden_states               ? "hidden_states"
                          : padded && !sorted_token_ids                 ? "sorted_token_ids"
                          : scatter && padded && t && !slot_positions   ? "slot_positions"
                          : padded && !out                              ? "out"
                                                                        : NULL;
    if (missing)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    const permute_request r = {scatter ? KIND_SCATTER : KIND_GATHER, desc->in_dtype, desc->out_dtype, -1};
    const moecl_plan *p;
    if ((st = plan_of(ctx, &r, &p)) != MOECL_SUCCESS)
        return st;
    const int32_t n = *num_tokens_post_padded;
    const size_t rows = n < 0 ? 0 : (size_t)n < padded ? (size_t)n : padded;
    if (rows == 0)
        return MOECL_SUCCESS; /* nothing is written */
    const size_t in_size = moecl_dtype_size(desc->in_dtype), out_size = moecl_dtype_size(desc->out_dtype);
    enum { IN, IDS, POST, POS, OUT, NUM };
    cl_mem m[NUM] = {NULL};
    if ((!t || (st = moecl_host_buffer(ctx, "hidden_states", CL_MEM_READ_ONLY, t * h * in_size, hidden_states,
                                       &m[IN])) == MOECL_SUCCESS) &&
        (!t || !scatter ||
         (st = moecl_host_buffer(ctx, "slot_positions", CL_MEM_READ_ONLY, t * k * 4, slot_positions, &m[POS])) ==
             MOECL_SUCCESS) &&
        (st = moecl_host_buffer(ctx, "sorted_token_ids", CL_MEM_READ_ONLY, padded * 4, sorted_token_ids,
                                &m[IDS])) == MOECL_SUCCESS &&
        (st = moecl_host_buffer(ctx, "num_tokens_post_padded", CL_MEM_READ_ONLY, 4, num_tokens_post_padded,
                                &m[POST])) == MOECL_SUCCESS)
        st = moecl_host_buffer(ctx, "out", CL_MEM_WRITE_ONLY, padded * h * out_size, NULL, &m[OUT]);
    cl_event ran = NULL;
    const moecl_buffer in = {m[IN], 0}, ids = {m[IDS], 0}, post = {m[POST], 0}, o = {m[OUT], 0};
    if (st == MOECL_SUCCESS)
        st = scatter ? scatter_launch(ctx, desc, in, ids, post, (moecl_buffer){m[POS], 0}, o, false, 0, NULL, &ran)
                     : permute_launch(ctx, desc, in, ids, post, o, false, 0, NULL, &ran);
    /* Only the rows the kernel wrote come back. */
    const size_t sizes[1] = {rows * h * out_size};
    void *const hosts[NUM] = {NULL, NULL, NULL, NULL, out};
    return moecl_host_call_end(ctx, st, ran, m, NUM, OUT, sizes, hosts);
}

moecl_status moecl_permute_host(moecl_context *ctx, const moecl_permute_desc *desc, const void *hidden_states,
                                const int32_t *sorted_token_ids, const int32_t *num_tokens_post_padded, void *out)
{
    return rows_host(ctx, desc, false, hidden_states, sorted_token_ids, num_tokens_post_padded, NULL, out);
}

moecl_status moecl_permute_scatter_host(moecl_context *ctx, const moecl_permute_desc *desc, const void *hidden_states,
                                        const int32_t *sorted_token_ids, const int32_t *num_tokens_post_padded,
                                        const int32_t *slot_positions, void *out)
{
    return rows_host(ctx, desc, true, hidden_states, sorted_token_ids, num_tokens_post_padded, slot_positions,
                     out);
}

/* ---- moecl_combine ---- */

static moecl_status combine_launch(moecl_context *ctx, const moecl_combine_desc *d, moecl_buffer in,
                                   moecl_buffer weights, moecl_buffer pos, moecl_buffer shared, moecl_buffer out,
                                   bool check, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    const size_t in_size = moecl_dtype_size(d->in_dtype), out_size = moecl_dtype_size(d->out_dtype),
                 sh_size = moecl_dtype_size(d->shared_dtype);
    const uint64_t t = d->num_tokens, k = d->top_k, padded = d->num_padded, h = d->hidden;
    const moecl_buffer_check checks[5] = {
        {"expert_out", padded * h * in_size, in.offset, in_size, padded > 0 && t > 0},
        {"topk_weights", t * k * 4, weights.offset, 4, t > 0},
        {"slot_positions", t * k * 4, pos.offset, 4, t > 0},
        {"shared_out", t * h * sh_size, shared.offset, sh_size, false},
        {"out", t * h * out_size, out.offset, out_size, t > 0}};
    const moecl_buffer bufs[5] = {in, weights, pos, shared, out};
    moecl_status st = check_buffers(ctx, checks, bufs, 5, check);
    const permute_request r = {KIND_COMBINE, d->in_dtype, d->out_dtype, shared.mem ? (int)d->shared_dtype : -1};
    const moecl_plan *p;
    if (st != MOECL_SUCCESS || (st = plan_of(ctx, &r, &p)) != MOECL_SUCCESS)
        return st;
    if (t == 0)
        return moecl_enqueue_nothing(ctx, num_wait, wait, done);
    /* Each unit adds the top_k slots' rows and the shared one. */
    const uint32_t per_unit = 2 * (d->top_k + 2);
    const launch_shape s = shape_for(ctx, p, d->num_tokens, (d->hidden + 3) / 4, per_unit);
    if ((st = shape_fits(ctx, &s, "combine", d->hidden, (d->hidden + 3) / 4, per_unit)) != MOECL_SUCCESS)
        return st;
    /* Absent inputs are never read (no expert rows: every position is out
     * of range; no shared rows: HAS_SHARED 0); the kernel still takes a
     * buffer, the output. */
    const cl_mem in_mem = in.mem ? in.mem : out.mem, sh_mem = shared.mem ? shared.mem : out.mem;
    const layout_combine_args scalars = {in.mem ? in.offset / in_size : 0,
                                         weights.offset / 4,
                                         pos.offset / 4,
                                         shared.mem ? shared.offset / sh_size : 0,
                                         out.offset / out_size,
                                         d->hidden,
                                         in.mem ? d->num_padded : 0,
                                         d->num_tokens,
                                         d->top_k,
                                         s.tpr,
                                         s.rpg};
    const moecl_kernel_arg args[] = {MOECL_ARG_MEM(in_mem),  MOECL_ARG_MEM(weights.mem), MOECL_ARG_MEM(pos.mem),
                                     MOECL_ARG_MEM(sh_mem), MOECL_ARG_MEM(out.mem),     MOECL_ARG(scalars)};
    moecl_step step = {0, args, 6, s.global, s.local, NULL, 0, 0, NULL, NULL};
    return moecl_plan_run(ctx, p, &step, 1, num_wait, wait, done);
}

moecl_status moecl_combine(moecl_context *ctx, const moecl_combine_desc *desc, moecl_buffer expert_out,
                           moecl_buffer topk_weights, moecl_buffer slot_positions, moecl_buffer shared_out,
                           moecl_buffer out, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    moecl_status st = validate_combine(ctx, desc);
    if (st == MOECL_SUCCESS)
        st = moecl_check_wait_list(ctx, num_wait, wait);
    if (st != MOECL_SUCCESS)
        return st;
    return combine_launch(ctx, desc, expert_out, topk_weights, slot_positions, shared_out, out, true, num_wait, wait,
                          done);
}

moecl_status moecl_combine_host(moecl_context *ctx, const moecl_combine_desc *desc, const void *expert_out,
                                const float *topk_weights, const int32_t *slot_positions, const void *shared_out,
                                void *out)
{
    moecl_status st = validate_combine(ctx, desc);
    if (st != MOECL_SUCCESS)
        return st;
    const size_t t = desc->num_tokens, k = desc->top_k, padded = desc->num_padded, h = desc->hidden;
    const char *missing = !t                       ? NULL
                          : padded && !expert_out  ? "expert_out"
                          : !topk_weights          ? "topk_weights"
                          : !slot_positions        ? "slot_positions"
                          : !out                   ? "out"
                                                   : NULL;
    if (missing)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", missing);
    const permute_request r = {KIND_COMBINE, desc->in_dtype, desc->out_dtype,
                               shared_out ? (int)desc->shared_dtype : -1};
    const moecl_plan *p;
    if ((st = plan_of(ctx, &r, &p)) != MOECL_SUCCESS)
        return st;
    if (t == 0)
        return MOECL_SUCCESS;
    const size_t in_size = moecl_dtype_size(desc->in_dtype), out_size = moecl_dtype_size(desc->out_dtype),
                 sh_size = moecl_dtype_size(desc->shared_dtype);
    enum { IN, WEIGHTS, POS, SHARED, OUT, NUM };
    cl_mem m[NUM] = {NULL};
    if ((!padded || (st = moecl_host_buffer(ctx, "expert_out", CL_MEM_READ_ONLY, padded * h * in_size, expert_out,
                                            &m[IN])) == MOECL_SUCCESS) &&
        (st = moecl_host_buffer(ctx, "topk_weights", CL_MEM_READ_ONLY, t * k * 4, topk_weights, &m[WEIGHTS])) ==
            MOECL_SUCCESS &&
        (st = moecl_host_buffer(ctx, "slot_positions", CL_MEM_READ_ONLY, t * k * 4, slot_positions, &m[POS])) ==
            MOECL_SUCCESS &&
        (!shared_out || (st = moecl_host_buffer(ctx, "shared_out", CL_MEM_READ_ONLY, t * h * sh_size, shared_out,
                                                &m[SHARED])) == MOECL_SUCCESS))
        st = moecl_host_buffer(ctx, "out", CL_MEM_WRITE_ONLY, t * h * out_size, NULL, &m[OUT]);
    cl_event ran = NULL;
    if (st == MOECL_SUCCESS)
        st = combine_launch(ctx, desc, (moecl_buffer){m[IN], 0}, (moecl_buffer){m[WEIGHTS], 0},
                            (moecl_buffer){m[POS], 0}, (moecl_buffer){m[SHARED], 0}, (moecl_buffer){m[OUT], 0}, false,
                            0, NULL, &ran);
    const size_t sizes[1] = {t * h * out_size};
    void *const hosts[NUM] = {NULL, NULL, NULL, NULL, out};
    return moecl_host_call_end(ctx, st, ran, m, NUM, OUT, sizes, hosts);
}
