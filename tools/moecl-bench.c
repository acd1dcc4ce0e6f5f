/* moecl-bench: correctness check, then timings, for each op and shape.
 *
 * For every case: (0) one call checked against the float64 reference;
 * (a) device time from OpenCL profiling events, median of --iterations
 * calls after a warm-up, on the same input (L2-warm) or, with --cold,
 * rotating through input sets larger than the last-level cache; (b) wall
 * time per call of 1000 calls enqueued back to back on a queue without
 * profiling, one clFinish; (c) achieved GB/s and, with --copy-floor, its
 * ratio to a copy kernel timed on the same device in the same run. An empty
 * kernel is timed too, as the floor of a launch.
 *
 * moe_align runs one to three kernels a call. Its device time is the span from a
 * marker enqueued just before the call (the call waits on it) to the end
 * of the call's last kernel: the kernels' own times plus the gaps between
 * them on the device, which a chain of launches really costs. The calls go
 * one at a time, so the queue is idle when the marker runs. The
 * expert-parallel layout (one to three kernels) is timed the same way.
 * With --marker every case is, so that a one-kernel routing call and the
 * layout it is compared with both span from a marker; without it the
 * comparison line of a layout case puts its last kernel's own time next
 * to the routing kernel's (both START..END of one kernel where the layout
 * is one launch). */
#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <moecl/moecl.h>

#include "internal.h"
#include "reference.h"
#include "tool_args.h"
#include "tool_common.h"
#include "tool_json.h"

/* OP_GROUNDED_ROUTE: moecl_grounded_route_dispatch, the grounded desc with
 * the align desc's block_size. OP_ROUTE: moecl_route_dispatch, the topk
 * desc with the align desc's block_size. OP_ROUTER: moecl_router on the grounded
 * desc, without router logits, with a bias where `bias` is set.
 * OP_REPLAY: moecl_topk_weights on the topk desc, given distinct ids;
 * OP_HASH: moecl_hash_routing on the topk desc, a table of HASH_VOCAB
 * token ids. OP_PERMUTE, OP_COMBINE: moecl_permute and moecl_combine on
 * the moe_align output (the reference's) of a routing of the align desc,
 * perm's hidden size and dtype (in and out alike; combine's comb the
 * same); OP_PERMUTE with scatter: moecl_permute_scatter, given moe_align's
 * slot positions too. */
typedef enum op_kind {
    OP_TOPK, OP_GROUNDED, OP_ALIGN, OP_EP, OP_GROUNDED_ROUTE, OP_ROUTER, OP_REPLAY, OP_HASH, OP_PERMUTE, OP_COMBINE,
    OP_ROUTE
} op_kind;

/* DeepSeek-V4's vocabulary (its hash layers' tid2eid rows). */
#define HASH_VOCAB 129280u

typedef struct bench_case {
    const char *label;
    op_kind op;
    moecl_topk_gating_desc topk;
    bool bias;
    moecl_grounded_router_desc grounded;
    moecl_moe_align_desc align;
    moecl_ep_layout_desc ep; /* with replicas where ep.max_replicas > 1 */
    moecl_permute_desc perm;
    bool scatter; /* OP_PERMUTE: moecl_permute_scatter */
    moecl_combine_desc comb;
    double t_sol_us, t_prod_us; /* the seed's figures, 0 if none */
} bench_case;

typedef struct bench_result {
    double median_us, p10_us, p90_us, wall_us, bytes, gbps, copy_ratio;
    double prepare_ms; /* building or loading the kernels: cold or warm cache */
    double host_us;    /* median time inside the call (validation and enqueueing) */
    double kernel_us;  /* median of the returned event's own START..END: for moe_align its last kernel */
    int iterations, wall_calls; /* what was run: fewer than asked only for slow calls */
    bool checked_ok;
    char check_msg[256];
    uint64_t ids_hash; /* FNV-1a of the chosen ids: compares devices (same inputs everywhere) */
} bench_result;

#define MAX_ONLY 16

typedef struct options {
    const char *device, *json, *csv;
    const char *only[MAX_ONLY]; /* --only: names or shell patterns, any of which selects a case */
    int num_only;
    const char *variant; /* --variant: the variant override, or NULL */
    unsigned shapes[16][3]; /* --shape T,E,K: extra softmax top-k cases (MAX_SHAPES) */
    int num_shapes;
    int iterations, wall_calls;
    bool cold, quick, host_cost, marker, copy_floor, list;
    tool_logits logits; /* --logits: how the top-k cases' logits are drawn */
} options;

static void die(const char *what, moecl_context *ctx, int st)
{
    fprintf(stderr, "\nmoecl-bench: %s: %s (%d): %s\n", what, moecl_status_string(st), st, moecl_context_error(ctx));
    exit(1);
}

/* ---- the device's own floor and ceiling: an empty kernel and a copy ---- */

static const char *probe_source = "__kernel void empty(__global float *p) { (void)p; }\n"
                                  "__kernel void copy(__global const float4 *in, __global float4 *out) {\n"
                                  "    size_t i = get_global_id(0); out[i] = in[i]; }\n";

typedef struct probes {
    double empty_us, copy_gbps;
    double empty_wall_us; /* wall time per call back to back, as the cases' wall_us */
} probes;

static cl_kernel empty_kernel(cl_context c, cl_device_id dev)
{
    cl_int err;
    cl_program prog = clCreateProgramWithSource(c, 1, &probe_source, NULL, &err);
    if (!prog || clBuildProgram(prog, 1, &dev, NULL, NULL, NULL) != CL_SUCCESS) {
        fprintf(stderr, "moecl-bench: cannot build the empty kernel\n");
        exit(1);
    }
    cl_kernel k = clCreateKernel(prog, "empty", &err);
    clReleaseProgram(prog); /* the kernel keeps it */
    if (!k) {
        fprintf(stderr, "moecl-bench: cannot create the empty kernel (%d)\n", err);
        exit(1);
    }
    return k;
}

/* What a bare launch costs the host: the argument and the enqueue, as a
 * library call has at least. */
static cl_int enqueue_empty(cl_command_queue q, cl_kernel k, cl_mem arg, cl_uint num_wait, const cl_event *wait,
                            cl_event *done)
{
    const size_t one = 1;
    cl_int err = clSetKernelArg(k, 0, sizeof(cl_mem), &arg);
    return err != CL_SUCCESS ? err : clEnqueueNDRangeKernel(q, k, 1, NULL, &one, &one, num_wait, wait, done);
}

/* Wall time per call of `calls` empty kernels back to back on q, one clFinish
 * (the same count and queue as a case's wall_us). */
static double empty_wall_us(cl_command_queue q, cl_kernel k, cl_mem arg, int calls)
{
    for (int i = 0; i < 10; i++)
        enqueue_empty(q, k, arg, 0, NULL, NULL);
    clFinish(q);
    const double t0 = tool_now_us();
    for (int i = 0; i < calls; i++)
        if (enqueue_empty(q, k, arg, 0, NULL, NULL) != CL_SUCCESS) {
            fprintf(stderr, "moecl-bench: enqueueing the empty kernel failed\n");
            exit(1);
        }
    clFinish(q);
    return (tool_now_us() - t0) / calls;
}

/* The empty kernel, and with copy the copy kernel: 1 GiB each way (far
 * past any cache), median of 20 calls, about a second on a GPU and ten on
 * a CPU, so only on request (--copy-floor). */
static probes measure_probes(cl_context c, cl_device_id dev, cl_command_queue q, cl_command_queue plain_q,
                             int iterations, int wall_calls, bool copy_floor)
{
    probes r = {0, 0, 0};
    cl_int err;
    cl_program prog = clCreateProgramWithSource(c, 1, &probe_source, NULL, &err);
    if (!prog || clBuildProgram(prog, 1, &dev, NULL, NULL, NULL) != CL_SUCCESS)
        return r;
    cl_kernel empty = clCreateKernel(prog, "empty", &err), copy = clCreateKernel(prog, "copy", &err);
    const size_t n4 = (size_t)64 << 20; /* 64 Mi float4 = 1 GiB each way: far past any cache */
    cl_ulong max_alloc = 0;
    clGetDeviceInfo(dev, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof(max_alloc), &max_alloc, NULL);
    size_t count = copy_floor ? n4 : 1024;
    while (count * 16 > max_alloc / 2 && count > 1024)
        count /= 2;
    cl_mem a = tool_make_buffer("moecl-bench", c, count * 16, NULL), b = tool_make_buffer("moecl-bench", c, count * 16, NULL);
    clEnqueueFillBuffer(q, a, &(float){1.0f}, 4, 0, count * 16, 0, NULL, NULL);
    clSetKernelArg(empty, 0, sizeof(cl_mem), &a);
    clSetKernelArg(copy, 0, sizeof(cl_mem), &a);
    clSetKernelArg(copy, 1, sizeof(cl_mem), &b);
    double *t = malloc(sizeof(double) * (size_t)iterations);
    size_t one = 1, local = 1, g = count, lc = 256;
    for (int pass = 0; pass < (copy_floor ? 2 : 1); pass++) {
        cl_kernel k = pass == 0 ? empty : copy;
        size_t *gs = pass == 0 ? &one : &g, *ls = pass == 0 ? &local : &lc;
        const int calls = pass == 0 || iterations < 20 ? iterations : 20;
        for (int i = pass == 0 ? -5 : -2; i < calls; i++) {
            cl_event ev;
            if (clEnqueueNDRangeKernel(q, k, 1, NULL, gs, ls, 0, NULL, &ev) != CL_SUCCESS)
                break;
            clWaitForEvents(1, &ev);
            if (i >= 0)
                t[i] = tool_event_us(ev);
            clReleaseEvent(ev);
        }
        qsort(t, (size_t)calls, sizeof(double), tool_cmp_double);
        if (pass == 0)
            r.empty_us = t[calls / 2];
        else
            r.copy_gbps = 2.0 * count * 16 / (t[calls / 2] * 1e3);
    }
    free(t);
    r.empty_wall_us = empty_wall_us(plain_q, empty, a, wall_calls);
    clReleaseMemObject(a);
    clReleaseMemObject(b);
    clReleaseKernel(empty);
    clReleaseKernel(copy);
    clReleaseProgram(prog);
    return r;
}

/* ---- one case ---- */

typedef struct case_buffers {
    int sets;
    cl_mem in[64], in2[64], in3[64]; /* gating | hidden, logits, ground */
    cl_mem bias, out1, out2, out3, out4, out5, out6, out7;
    cl_mem tables[3];                    /* the layout's map, replica counts and placement, or NULL */
    int32_t *host_tables[3];
    cl_mem dispatch[6]; /* OP_GROUNDED_ROUTE: moe_align's outputs, after weights (out1) and ids (out2) */
    void *host_in, *host_in2, *host_in3; /* set 0, for the check */
    float *host_bias;
    /* OP_PERMUTE, OP_COMBINE: moe_align's sorted ids and slot positions
     * (in tables[0] and tables[2], its num_tokens_post_padded in
     * tables[1]) and the weights (combine: in out2). */
    int32_t *host_sorted, *host_pos, post;
    float *host_w;
} case_buffers;

static bool permute_op(const bench_case *c) { return c->op == OP_PERMUTE || c->op == OP_COMBINE; }

/* Whether the case's op takes the topk desc: top-k gating, replay, hash
 * routing, top-k's route dispatch. */
static bool topk_desc_op(const bench_case *c)
{
    return c->op == OP_TOPK || c->op == OP_REPLAY || c->op == OP_HASH || c->op == OP_ROUTE;
}

/* Whether the case's call writes moe_align's outputs after a routing's
 * (b->dispatch). */
static bool dispatch_op(const bench_case *c) { return c->op == OP_GROUNDED_ROUTE || c->op == OP_ROUTE; }

/* Replay's given ids or hash routing's token ids. */
static size_t replay_ids_bytes(const bench_case *c)
{
    return (size_t)c->topk.num_tokens * (c->op == OP_REPLAY ? c->topk.top_k : 1) * 4;
}

static size_t input_bytes(const bench_case *c)
{
    /* The rows read once: permute's tokens, combine's routed rows (every
     * slot of the bench's routings is routed). */
    if (c->op == OP_PERMUTE)
        return (size_t)c->perm.num_tokens * c->perm.hidden * ref_dtype_size(c->perm.in_dtype);
    if (c->op == OP_COMBINE)
        return (size_t)c->comb.num_tokens * c->comb.top_k * c->comb.hidden * ref_dtype_size(c->comb.in_dtype);
    if (c->op == OP_ALIGN)
        return (size_t)c->align.num_tokens * c->align.top_k * 4;
    if (c->op == OP_EP)
        return (size_t)c->ep.num_tokens * c->ep.top_k * 4;
    if (topk_desc_op(c)) {
        /* hash routing also reads a table row (top_k ids) a token */
        const size_t gating = (size_t)c->topk.num_tokens * c->topk.num_experts * ref_dtype_size(c->topk.gating_dtype);
        const size_t rows = c->op == OP_HASH ? (size_t)c->topk.num_tokens * c->topk.top_k * 4 : 0;
        return gating + (c->op == OP_REPLAY || c->op == OP_HASH ? replay_ids_bytes(c) : 0) + rows;
    }
    const moecl_grounded_router_desc *d = &c->grounded;
    size_t s = ref_dtype_size(d->hidden_dtype);
    const size_t logits = c->op == OP_ROUTER ? 0 : (size_t)d->num_tokens * d->num_experts * 4;
    return (size_t)d->num_tokens * d->hidden_dim * s + logits + (size_t)d->num_experts * d->hidden_dim * s;
}

/* moe_align: counts, sorted ids, blocks, post, slot positions, invalid. */
static size_t align_sizes(const moecl_moe_align_desc *d, size_t sizes[6])
{
    const size_t max_padded = (size_t)moecl_moe_align_max_padded(d), slots = (size_t)d->num_tokens * d->top_k;
    sizes[0] = (size_t)d->num_experts * 4;
    sizes[1] = max_padded * 4;
    sizes[2] = max_padded / d->block_size * 4;
    sizes[3] = 4;
    sizes[4] = slots * 4;
    sizes[5] = 4;
    return sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4] + sizes[5];
}

/* The layout: physical_ids, rank_counts, rank_offsets, send_slots,
 * token_in_rank, tokens_per_rank, expert_counts. */
static size_t ep_sizes(const moecl_ep_layout_desc *d, size_t sizes[7])
{
    const size_t slots = (size_t)d->num_tokens * d->top_k, ranks = d->num_ranks;
    const size_t s[7] = {slots * 4, ranks * 4, (ranks + 1) * 4, slots * 4, (size_t)d->num_tokens * ranks, ranks * 4,
                         (size_t)d->num_physical * 4};
    size_t total = 0;
    for (int i = 0; i < 7; i++)
        total += sizes[i] = s[i];
    return total;
}

/* The replicas of a layout case: the first 32 experts doubled, each
 * replica on the rank half the ranks away from its expert's block (a
 * table); without replicas, contiguous blocks (no tables). */
static void ep_tables(cl_context cl, const moecl_ep_layout_desc *d, case_buffers *b)
{
    if (d->max_replicas < 2)
        return;
    const uint32_t e = d->num_experts, hot = d->num_physical - e, per = e / d->num_ranks ? e / d->num_ranks : 1;
    int32_t *l2p = malloc((size_t)e * 2 * 4), *replicas = malloc((size_t)e * 4), *p2r = malloc((size_t)d->num_physical * 4);
    for (uint32_t x = 0; x < e; x++) {
        replicas[x] = x < hot ? 2 : 1;
        l2p[2 * x] = (int32_t)x;
        l2p[2 * x + 1] = x < hot ? (int32_t)(e + x) : -1;
        p2r[x] = (int32_t)((x / per) % d->num_ranks);
    }
    for (uint32_t x = 0; x < hot; x++)
        p2r[e + x] = (int32_t)((x / per + d->num_ranks / 2) % d->num_ranks);
    int32_t *host[3] = {l2p, replicas, p2r};
    const size_t bytes[3] = {(size_t)e * 2 * 4, (size_t)e * 4, (size_t)d->num_physical * 4};
    for (int i = 0; i < 3; i++) {
        b->host_tables[i] = host[i];
        b->tables[i] = tool_make_buffer("moecl-bench", cl, bytes[i], host[i]);
    }
}

/* Replay's and hash routing's ids, in tables[0] (and host_tables[0]):
 * top_k distinct experts a token (replay), or a token id a token (hash
 * routing), whose table, top_k distinct experts a row, is tables[1]. */
static void replay_tables(cl_context cl, const bench_case *c, uint64_t *seed, case_buffers *b)
{
    const uint32_t e = c->topk.num_experts, k = c->topk.top_k;
    const size_t rows = c->op == OP_REPLAY ? c->topk.num_tokens : HASH_VOCAB;
    int32_t *ids = malloc(rows * k * 4 + 4);
    for (size_t r = 0; r < rows; r++)
        for (size_t j = 0; j < k; j++) {
            bool again;
            do {
                *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
                ids[r * k + j] = (int32_t)((*seed >> 33) % e);
                again = false;
                for (size_t i = 0; i < j; i++)
                    again |= ids[r * k + i] == ids[r * k + j];
            } while (again);
        }
    if (c->op == OP_REPLAY) {
        b->host_tables[0] = ids;
        b->tables[0] = tool_make_buffer("moecl-bench", cl, rows * k * 4, ids);
        return;
    }
    int32_t *tokens = malloc((size_t)c->topk.num_tokens * 4 + 4);
    for (size_t t = 0; t < c->topk.num_tokens; t++) {
        *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
        tokens[t] = (int32_t)((*seed >> 33) % HASH_VOCAB);
    }
    b->host_tables[0] = tokens;
    b->tables[0] = tool_make_buffer("moecl-bench", cl, replay_ids_bytes(c), tokens);
    b->host_tables[1] = ids;
    b->tables[1] = tool_make_buffer("moecl-bench", cl, rows * k * 4, ids);
}

/* The routing's (token, slot) pairs. */
static size_t routed_slots(const bench_case *c)
{
    return topk_desc_op(c) ? (size_t)c->topk.num_tokens * c->topk.top_k
                           : (size_t)c->grounded.num_tokens * c->grounded.top_k;
}

static size_t output_bytes(const bench_case *c)
{
    size_t sizes[7];
    if (c->op == OP_ALIGN)
        return align_sizes(&c->align, sizes);
    if (dispatch_op(c))
        return routed_slots(c) * 8 + align_sizes(&c->align, sizes);
    if (c->op == OP_EP)
        return ep_sizes(&c->ep, sizes);
    if (c->op == OP_REPLAY)
        return (size_t)c->topk.num_tokens * c->topk.top_k * 4; /* the weights only */
    return routed_slots(c) * 8;
}

/* A routing of c->align (distinct uniform ids a token) through the
 * reference moe_align, its outputs as tables, the rows (permute's hidden
 * states, combine's expert rows) in each set, the output, and combine's
 * weights. */
static void permute_setup(cl_context cl, const bench_case *c, uint64_t *seed, case_buffers *b)
{
    const moecl_moe_align_desc *d = &c->align;
    const size_t slots = (size_t)d->num_tokens * d->top_k, padded = (size_t)moecl_moe_align_max_padded(d);
    int32_t *ids = malloc(slots * 4 + 4), *counts = malloc((size_t)d->num_experts * 4);
    int32_t *blocks = malloc(padded / d->block_size * 4 + 4), invalid;
    b->host_sorted = malloc(padded * 4 + 4);
    b->host_pos = malloc(slots * 4 + 4);
    for (size_t t = 0; t < d->num_tokens; t++)
        for (size_t j = 0; j < d->top_k; j++) {
            int32_t id;
            bool again;
            do {
                *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
                id = (int32_t)((*seed >> 33) % d->num_experts);
                again = false;
                for (size_t i = 0; i < j; i++)
                    again |= ids[t * d->top_k + i] == id;
            } while (again);
            ids[t * d->top_k + j] = id;
        }
    ref_moe_align(d, ids, counts, b->host_sorted, blocks, &b->post, b->host_pos, &invalid);
    free(ids);
    free(counts);
    free(blocks);
    b->tables[0] = tool_make_buffer("moecl-bench", cl, padded * 4, b->host_sorted);
    b->tables[1] = tool_make_buffer("moecl-bench", cl, 4, &b->post);
    b->tables[2] = tool_make_buffer("moecl-bench", cl, slots * 4, b->host_pos);
    const bool perm = c->op == OP_PERMUTE;
    const moecl_dtype in = perm ? c->perm.in_dtype : c->comb.in_dtype;
    const moecl_dtype out = perm ? c->perm.out_dtype : c->comb.out_dtype;
    const size_t h = perm ? c->perm.hidden : c->comb.hidden, rows = perm ? d->num_tokens : padded;
    for (int s = 0; s < b->sets; s++) {
        void *x = tool_random_tensor(seed, in, rows * h, 1.0f);
        b->in[s] = tool_make_buffer("moecl-bench", cl, rows * h * ref_dtype_size(in), x);
        if (s == 0)
            b->host_in = x;
        else
            free(x);
    }
    b->out1 = tool_make_buffer("moecl-bench", cl, (perm ? padded : d->num_tokens) * h * ref_dtype_size(out), NULL);
    if (!perm) {
        b->host_w = tool_random_tensor(seed, MOECL_F32, slots, 0.3f);
        b->out2 = tool_make_buffer("moecl-bench", cl, slots * 4, b->host_w);
    }
}

static void setup_buffers(cl_context cl, const bench_case *c, bool cold, tool_logits logits, case_buffers *b)
{
    memset(b, 0, sizeof(*b));
    uint64_t seed = 12345;
    /* Cold: enough input sets to exceed 256 MiB, more than any GPU's L2 or
     * a CPU's last-level cache. */
    size_t per_set = input_bytes(c);
    b->sets = 1;
    if (cold)
        while (b->sets < 64 && (size_t)b->sets * per_set < ((size_t)256 << 20))
            b->sets++;
    if (permute_op(c)) {
        permute_setup(cl, c, &seed, b);
        return;
    }
    for (int s = 0; s < b->sets; s++) {
        if (c->op == OP_ALIGN || c->op == OP_EP) {
            /* A routing result: distinct uniform ids per token. */
            const moecl_moe_align_desc a = moecl_moe_align_desc_init(c->ep.num_tokens, c->ep.top_k, c->ep.num_experts, 1);
            const moecl_moe_align_desc *d = c->op == OP_ALIGN ? &c->align : &a;
            int32_t *ids = malloc(input_bytes(c) + 4);
            for (size_t t = 0; t < d->num_tokens; t++)
                for (size_t j = 0; j < d->top_k; j++) {
                    int32_t id;
                    bool again;
                    do {
                        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                        id = (int32_t)((seed >> 33) % d->num_experts);
                        again = false;
                        for (size_t i = 0; i < j && d->top_k <= d->num_experts; i++)
                            again |= ids[t * d->top_k + i] == id;
                    } while (again);
                    ids[t * d->top_k + j] = id;
                }
            b->in[s] = tool_make_buffer("moecl-bench", cl, input_bytes(c), ids);
            if (s == 0)
                b->host_in = ids;
            else
                free(ids);
        } else if (topk_desc_op(c)) {
            const moecl_topk_gating_desc *d = &c->topk;
            void *g = tool_logits_tensor(&seed, d->gating_dtype, d->num_tokens, d->num_experts, logits);
            b->in[s] = tool_make_buffer("moecl-bench", cl,
                                        (size_t)d->num_tokens * d->num_experts * ref_dtype_size(d->gating_dtype), g);
            if (s == 0)
                b->host_in = g;
            else
                free(g);
        } else {
            const moecl_grounded_router_desc *d = &c->grounded;
            size_t hs = ref_dtype_size(d->hidden_dtype);
            void *h = tool_random_tensor(&seed, d->hidden_dtype, (size_t)d->num_tokens * d->hidden_dim,
                                    1.0f / sqrtf((float)d->hidden_dim));
            /* moecl_router's cases have no router logits. */
            void *l = c->op == OP_ROUTER
                          ? NULL
                          : tool_random_tensor(&seed, MOECL_F32, (size_t)d->num_tokens * d->num_experts, 1.0f);
            void *g = tool_random_tensor(&seed, d->hidden_dtype, (size_t)d->num_experts * d->hidden_dim, 1.0f);
            b->in[s] = tool_make_buffer("moecl-bench", cl, (size_t)d->num_tokens * d->hidden_dim * hs, h);
            if (l)
                b->in2[s] = tool_make_buffer("moecl-bench", cl, (size_t)d->num_tokens * d->num_experts * 4, l);
            b->in3[s] = tool_make_buffer("moecl-bench", cl, (size_t)d->num_experts * d->hidden_dim * hs, g);
            if (s == 0) {
                b->host_in = h;
                b->host_in2 = l;
                b->host_in3 = g;
            } else {
                free(h);
                free(l);
                free(g);
            }
        }
    }
    if (c->bias) {
        const uint32_t experts = c->op == OP_TOPK ? c->topk.num_experts : c->grounded.num_experts;
        b->host_bias = tool_random_tensor(&seed, MOECL_F32, experts, 0.05f);
        b->bias = tool_make_buffer("moecl-bench", cl, experts * 4, b->host_bias);
    }
    if (c->op == OP_ALIGN) {
        size_t sizes[6];
        align_sizes(&c->align, sizes);
        cl_mem *outs[6] = {&b->out1, &b->out2, &b->out3, &b->out4, &b->out5, &b->out6};
        for (int i = 0; i < 6; i++)
            *outs[i] = tool_make_buffer("moecl-bench", cl, sizes[i], NULL);
        return;
    }
    if (c->op == OP_EP) {
        size_t sizes[7];
        ep_sizes(&c->ep, sizes);
        cl_mem *outs[7] = {&b->out1, &b->out2, &b->out3, &b->out4, &b->out5, &b->out6, &b->out7};
        for (int i = 0; i < 7; i++)
            *outs[i] = tool_make_buffer("moecl-bench", cl, sizes[i] ? sizes[i] : 4, NULL);
        ep_tables(cl, &c->ep, b);
        return;
    }
    if (dispatch_op(c)) {
        size_t sizes[6];
        align_sizes(&c->align, sizes);
        for (int i = 0; i < 6; i++)
            b->dispatch[i] = tool_make_buffer("moecl-bench", cl, sizes[i] ? sizes[i] : 4, NULL);
    }
    if (c->op == OP_REPLAY || c->op == OP_HASH)
        replay_tables(cl, c, &seed, b);
    size_t nk = routed_slots(c);
    b->out1 = tool_make_buffer("moecl-bench", cl, nk * 8, NULL); /* weights, or pairs */
    b->out2 = tool_make_buffer("moecl-bench", cl, nk * 4, NULL); /* ids */
}

static void free_buffers(case_buffers *b)
{
    for (int s = 0; s < b->sets; s++) {
        cl_mem all[3] = {b->in[s], b->in2[s], b->in3[s]};
        for (int i = 0; i < 3; i++)
            if (all[i])
                clReleaseMemObject(all[i]);
    }
    cl_mem rest[17] = {b->bias,        b->out1,        b->out2,        b->out3,        b->out4,        b->out5,
                       b->out6,        b->out7,        b->tables[0],   b->tables[1],   b->tables[2],   b->dispatch[0],
                       b->dispatch[1], b->dispatch[2], b->dispatch[3], b->dispatch[4], b->dispatch[5]};
    for (int i = 0; i < 17; i++)
        if (rest[i])
            clReleaseMemObject(rest[i]);
    for (int i = 0; i < 3; i++)
        free(b->host_tables[i]);
    free(b->host_in);
    free(b->host_in2);
    free(b->host_in3);
    free(b->host_bias);
    free(b->host_sorted);
    free(b->host_pos);
    free(b->host_w);
}

/* The case's call; with after, it waits on that event (a marker), whatever
 * the op, so that every op's span from a marker holds the same wait. */
static moecl_status call_after(moecl_context *ctx, const bench_case *c, const case_buffers *b, int set,
                               cl_event after, cl_event *done)
{
    moecl_buffer none = {NULL, 0};
    if (c->op == OP_PERMUTE && c->scatter)
        return moecl_permute_scatter(ctx, &c->perm, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->tables[0], 0},
                                     (moecl_buffer){b->tables[1], 0}, (moecl_buffer){b->tables[2], 0},
                                     (moecl_buffer){b->out1, 0}, after ? 1 : 0, after ? &after : NULL, done);
    if (c->op == OP_PERMUTE)
        return moecl_permute(ctx, &c->perm, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->tables[0], 0},
                             (moecl_buffer){b->tables[1], 0}, (moecl_buffer){b->out1, 0}, after ? 1 : 0,
                             after ? &after : NULL, done);
    if (c->op == OP_COMBINE)
        return moecl_combine(ctx, &c->comb, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->out2, 0},
                             (moecl_buffer){b->tables[2], 0}, none, (moecl_buffer){b->out1, 0}, after ? 1 : 0,
                             after ? &after : NULL, done);
    if (c->op == OP_EP) {
        moecl_buffer t[3];
        for (int i = 0; i < 3; i++)
            t[i] = (moecl_buffer){b->tables[i], 0};
        return moecl_ep_layout(ctx, &c->ep, (moecl_buffer){b->in[set], 0}, t[0], t[1], t[2], (moecl_buffer){b->out1, 0},
                               (moecl_buffer){b->out2, 0}, (moecl_buffer){b->out3, 0}, (moecl_buffer){b->out4, 0},
                               (moecl_buffer){b->out5, 0}, (moecl_buffer){b->out6, 0}, (moecl_buffer){b->out7, 0},
                               after ? 1 : 0, after ? &after : NULL, done);
    }
    if (c->op == OP_ALIGN)
        return moecl_moe_align(ctx, &c->align, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->out1, 0},
                               (moecl_buffer){b->out2, 0}, (moecl_buffer){b->out3, 0}, (moecl_buffer){b->out4, 0},
                               (moecl_buffer){b->out5, 0}, (moecl_buffer){b->out6, 0}, after ? 1 : 0,
                               after ? &after : NULL, done);
    if (c->op == OP_GROUNDED_ROUTE) {
        const cl_mem *d = b->dispatch;
        return moecl_grounded_route_dispatch(
            ctx, &c->grounded, c->align.block_size, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->in2[set], 0},
            (moecl_buffer){b->in3[set], 0}, (moecl_buffer){b->out1, 0}, (moecl_buffer){b->out2, 0},
            (moecl_buffer){d[0], 0}, (moecl_buffer){d[1], 0}, (moecl_buffer){d[2], 0}, (moecl_buffer){d[3], 0},
            (moecl_buffer){d[4], 0}, (moecl_buffer){d[5], 0}, after ? 1 : 0, after ? &after : NULL, done);
    }
    if (c->op == OP_REPLAY)
        return moecl_topk_weights(ctx, &c->topk, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->tables[0], 0},
                                  (moecl_buffer){b->out1, 0}, after ? 1 : 0, after ? &after : NULL, done);
    if (c->op == OP_HASH)
        return moecl_hash_routing(ctx, &c->topk, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->tables[0], 0},
                                  (moecl_buffer){b->tables[1], 0}, HASH_VOCAB, (moecl_buffer){b->out1, 0},
                                  (moecl_buffer){b->out2, 0}, after ? 1 : 0, after ? &after : NULL, done);
    moecl_buffer bias = {b->bias, 0};
    if (c->op == OP_ROUTE) {
        const cl_mem *d = b->dispatch;
        return moecl_route_dispatch(ctx, &c->topk, c->align.block_size, (moecl_buffer){b->in[set], 0},
                                    b->bias ? bias : none, (moecl_buffer){b->out1, 0}, (moecl_buffer){b->out2, 0},
                                    (moecl_buffer){d[0], 0}, (moecl_buffer){d[1], 0}, (moecl_buffer){d[2], 0},
                                    (moecl_buffer){d[3], 0}, (moecl_buffer){d[4], 0}, (moecl_buffer){d[5], 0},
                                    after ? 1 : 0, after ? &after : NULL, done);
    }
    if (c->op == OP_TOPK)
        return moecl_topk_gating(ctx, &c->topk, (moecl_buffer){b->in[set], 0}, b->bias ? bias : none,
                                 (moecl_buffer){b->out1, 0}, (moecl_buffer){b->out2, 0}, after ? 1 : 0,
                                 after ? &after : NULL, done);
    if (c->op == OP_ROUTER)
        return moecl_router(ctx, &c->grounded, (moecl_buffer){b->in[set], 0}, none, (moecl_buffer){b->in3[set], 0},
                            b->bias ? bias : none, (moecl_buffer){b->out1, 0}, (moecl_buffer){b->out2, 0},
                            after ? 1 : 0, after ? &after : NULL, done);
    /* The seed's layout: stacked (index, weight) pairs. */
    return moecl_grounded_router(ctx, &c->grounded, (moecl_buffer){b->in[set], 0}, (moecl_buffer){b->in2[set], 0},
                                 (moecl_buffer){b->in3[set], 0}, (moecl_buffer){b->out1, 0}, none, none, after ? 1 : 0,
                                 after ? &after : NULL, done);
}

static moecl_status call(moecl_context *ctx, const bench_case *c, const case_buffers *b, int set, cl_event *done)
{
    return call_after(ctx, c, b, set, NULL, done);
}

/* One timed call: its kernel's time, or for moe_align, the layout, the
 * route dispatches and (all_from_marker) every op the span from a
 * marker just before it to the end of its last kernel; also the time spent inside the call and the returned
 * event's own START..END. */
static moecl_status timed_call(moecl_context *ctx, const bench_case *c, const case_buffers *b, int set,
                               bool all_from_marker, double *us, double *host_us, double *kernel_us)
{
    cl_event marker = NULL, ev = NULL;
    if ((all_from_marker || c->op == OP_ALIGN || c->op == OP_EP || dispatch_op(c)) &&
        clEnqueueMarkerWithWaitList(moecl_context_queue(ctx), 0, NULL, &marker) != CL_SUCCESS)
        return MOECL_ERROR_UNSUPPORTED;
    const double h0 = tool_now_us();
    moecl_status st = call_after(ctx, c, b, set, marker, &ev);
    *host_us = tool_now_us() - h0;
    if (st == MOECL_SUCCESS) {
        clWaitForEvents(1, &ev);
        *kernel_us = tool_event_us(ev);
        if (marker) {
            cl_ulong start = 0, end = 0;
            clGetEventProfilingInfo(marker, CL_PROFILING_COMMAND_END, sizeof(start), &start, NULL);
            clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_END, sizeof(end), &end, NULL);
            *us = (double)(end - start) / 1e3;
        } else {
            *us = tool_event_us(ev);
        }
        clReleaseEvent(ev);
    }
    if (marker)
        clReleaseEvent(marker);
    return st;
}

static uint64_t fnv1a_ids(const int32_t *ids, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        for (int byte = 0; byte < 4; byte++) {
            h ^= (uint32_t)ids[i] >> (8 * byte) & 0xff;
            h *= 1099511628211ull;
        }
    return h;
}

static void check_case(moecl_context *ctx, const bench_case *c, const case_buffers *b, bench_result *r)
{
    cl_command_queue q = moecl_context_queue(ctx);
    size_t nk = routed_slots(c);
    float *w = malloc(nk * 8 + 4);
    int32_t *ids = malloc(nk * 4 + 4);
    cl_event ev;
    moecl_status st = call(ctx, c, b, 0, &ev);
    if (st != MOECL_SUCCESS)
        die(c->label, ctx, st);
    clWaitForEvents(1, &ev);
    clReleaseEvent(ev);
    int bad;
    if (permute_op(c)) {
        /* Bit for bit against the reference (the same dtype in and out:
         * permute copies bits; combine's order is the documented one). */
        const bool perm = c->op == OP_PERMUTE;
        const size_t h = perm ? c->perm.hidden : c->comb.hidden;
        const size_t rows = perm ? (size_t)b->post : c->comb.num_tokens;
        const size_t bytes = rows * h * ref_dtype_size(perm ? c->perm.out_dtype : c->comb.out_dtype);
        unsigned char *got = malloc(bytes + 1), *want = malloc(bytes + 1);
        if (bytes)
            clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, bytes, got, 0, NULL, NULL);
        if (perm)
            ref_permute(&c->perm, b->host_in, b->host_sorted, b->post, want);
        else
            ref_combine(&c->comb, b->host_in, b->host_w, b->host_pos, NULL, want);
        size_t i = 0;
        while (i < bytes && got[i] == want[i])
            i++;
        bad = i < bytes;
        if (bad)
            snprintf(r->check_msg, sizeof(r->check_msg), "out: byte %zu (row %zu) differs", i,
                     i / (bytes / rows));
        r->ids_hash = fnv1a_ids(b->host_sorted, (size_t)b->post);
        r->checked_ok = !bad;
        free(got);
        free(want);
        free(w);
        free(ids);
        return;
    }
    if (c->op == OP_EP) {
        size_t sizes[7];
        ep_sizes(&c->ep, sizes);
        void *outs[7];
        cl_mem mems[7] = {b->out1, b->out2, b->out3, b->out4, b->out5, b->out6, b->out7};
        for (int i = 0; i < 7; i++) {
            outs[i] = malloc(sizes[i] + 4);
            if (sizes[i])
                clEnqueueReadBuffer(q, mems[i], CL_TRUE, 0, sizes[i], outs[i], 0, NULL, NULL);
        }
        const ref_ep_layout_out got = {outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], outs[6]};
        bad = ref_check_ep_layout(&c->ep, b->host_in, b->host_tables[0], b->host_tables[1], b->host_tables[2], &got,
                                  r->check_msg, sizeof(r->check_msg));
        r->ids_hash = fnv1a_ids(outs[3], sizes[3] / 4);
        r->checked_ok = bad == 0;
        for (int i = 0; i < 7; i++)
            free(outs[i]);
        free(w);
        free(ids);
        return;
    }
    if (c->op == OP_ALIGN) {
        size_t sizes[6];
        align_sizes(&c->align, sizes);
        int32_t *outs[6];
        cl_mem mems[6] = {b->out1, b->out2, b->out3, b->out4, b->out5, b->out6};
        for (int i = 0; i < 6; i++) {
            outs[i] = malloc(sizes[i] + 4);
            clEnqueueReadBuffer(q, mems[i], CL_TRUE, 0, sizes[i], outs[i], 0, NULL, NULL);
        }
        bad = ref_check_moe_align(&c->align, b->host_in, outs[0], outs[1], outs[2], outs[3], outs[4], outs[5],
                                  r->check_msg, sizeof(r->check_msg));
        r->ids_hash = fnv1a_ids(outs[1], sizes[1] / 4);
        r->checked_ok = bad == 0;
        for (int i = 0; i < 6; i++)
            free(outs[i]);
        free(w);
        free(ids);
        return;
    }
    if (c->op == OP_TOPK || c->op == OP_ROUTE) {
        clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, nk * 4, w, 0, NULL, NULL);
        clEnqueueReadBuffer(q, b->out2, CL_TRUE, 0, nk * 4, ids, 0, NULL, NULL);
        bad = ref_check_topk_gating(&c->topk, b->host_in, b->host_bias, w, ids, r->check_msg, sizeof(r->check_msg));
    } else if (c->op == OP_REPLAY || c->op == OP_HASH) {
        /* The weights against the reference on the ids weighed: the given
         * ones, or the table's rows, which hash routing must return. */
        clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, nk * 4, w, 0, NULL, NULL);
        bad = 0;
        if (c->op == OP_REPLAY) {
            memcpy(ids, b->host_tables[0], nk * 4);
        } else {
            const size_t k = c->topk.top_k;
            int32_t *got = malloc(nk * 4 + 4);
            clEnqueueReadBuffer(q, b->out2, CL_TRUE, 0, nk * 4, got, 0, NULL, NULL);
            for (size_t i = 0; i < nk; i++)
                ids[i] = b->host_tables[1][(size_t)b->host_tables[0][i / k] * k + i % k];
            for (size_t i = 0; i < nk && !bad; i++)
                if (got[i] != ids[i]) {
                    snprintf(r->check_msg, sizeof(r->check_msg), "row %zu slot %zu: id %d, the table holds %d",
                             i / k, i % k, (int)got[i], (int)ids[i]);
                    bad = 1;
                }
            free(got);
        }
        if (!bad)
            bad = ref_check_topk_weights(&c->topk, b->host_in, ids, w, r->check_msg, sizeof(r->check_msg));
    } else if (c->op == OP_ROUTER) {
        clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, nk * 4, w, 0, NULL, NULL);
        clEnqueueReadBuffer(q, b->out2, CL_TRUE, 0, nk * 4, ids, 0, NULL, NULL);
        bad = ref_check_router(&c->grounded, b->host_in, NULL, b->host_in3, b->host_bias, NULL, w, ids, r->check_msg,
                               sizeof(r->check_msg));
    } else if (c->op == OP_GROUNDED_ROUTE) {
        clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, nk * 4, w, 0, NULL, NULL);
        clEnqueueReadBuffer(q, b->out2, CL_TRUE, 0, nk * 4, ids, 0, NULL, NULL);
        bad = ref_check_grounded_router(&c->grounded, b->host_in, b->host_in2, b->host_in3, NULL, w, ids,
                                        r->check_msg, sizeof(r->check_msg));
    } else {
        clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, nk * 8, w, 0, NULL, NULL);
        bad = ref_check_grounded_router(&c->grounded, b->host_in, b->host_in2, b->host_in3, w, NULL, NULL,
                                        r->check_msg, sizeof(r->check_msg));
        for (size_t i = 0; i < nk; i++) /* the pairs' index halves */
            ids[i] = (int32_t)w[2 * i];
    }
    /* A route dispatch: the routing's weights and ids checked above, then
     * the dispatch exactly against moe_align's for those ids. */
    if (!bad && dispatch_op(c)) {
        size_t sizes[6];
        align_sizes(&c->align, sizes);
        int32_t *outs[6];
        for (int i = 0; i < 6; i++) {
            outs[i] = malloc(sizes[i] + 4);
            clEnqueueReadBuffer(q, b->dispatch[i], CL_TRUE, 0, sizes[i], outs[i], 0, NULL, NULL);
        }
        bad = ref_check_moe_align(&c->align, ids, outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], r->check_msg,
                                  sizeof(r->check_msg));
        for (int i = 0; i < 6; i++)
            free(outs[i]);
    }
    r->ids_hash = fnv1a_ids(ids, nk);
    r->checked_ok = bad == 0;
    free(w);
    free(ids);
}

static void run_case(moecl_context *prof, moecl_context *plain, const bench_case *c, const options *o,
                     double copy_gbps, bench_result *r)
{
    memset(r, 0, sizeof(*r));
    case_buffers b;
    setup_buffers(moecl_context_cl_context(prof), c, o->cold, o->logits, &b);
    moecl_status st;
    double p0 = tool_now_us();
    if (permute_op(c)) {
        /* No _prepare: a call with nothing to do builds the kernel. */
        moecl_permute_desc pd = c->perm;
        moecl_combine_desc cd = c->comb;
        pd.num_padded = 0;
        cd.num_tokens = 0;
        const int32_t zero = 0;
        for (int i = 0; i < 2; i++) {
            moecl_context *ctx = i ? plain : prof;
            st = c->op == OP_COMBINE ? moecl_combine_host(ctx, &cd, NULL, NULL, NULL, NULL, NULL)
                 : c->scatter        ? moecl_permute_scatter_host(ctx, &pd, NULL, NULL, &zero, NULL, NULL)
                                     : moecl_permute_host(ctx, &pd, NULL, NULL, &zero, NULL);
            if (st != MOECL_SUCCESS)
                die(c->label, ctx, st);
        }
    } else if (c->op == OP_ALIGN) {
        if ((st = moecl_moe_align_prepare(prof, &c->align)) || (st = moecl_moe_align_prepare(plain, &c->align)))
            die(c->label, prof, st);
    } else if (c->op == OP_EP) {
        if ((st = moecl_ep_layout_prepare(prof, &c->ep)) || (st = moecl_ep_layout_prepare(plain, &c->ep)))
            die(c->label, prof, st);
    } else if (c->op == OP_TOPK || c->op == OP_ROUTE) {
        /* A route dispatch's one kernel is built by its first call (the
         * check's): prepare_ms covers top-k and moe_align's kernels. */
        if ((st = moecl_topk_gating_prepare(prof, &c->topk)) || (st = moecl_topk_gating_prepare(plain, &c->topk)) ||
            (c->op == OP_ROUTE &&
             ((st = moecl_moe_align_prepare(prof, &c->align)) || (st = moecl_moe_align_prepare(plain, &c->align)))))
            die(c->label, prof, st);
    } else if (c->op == OP_REPLAY || c->op == OP_HASH) {
        /* No _prepare: a call of no tokens builds the kernel, nothing else. */
        moecl_topk_gating_desc none = c->topk;
        none.num_tokens = 0;
        for (int i = 0; i < 2; i++) {
            moecl_context *ctx = i ? plain : prof;
            st = c->op == OP_REPLAY ? moecl_topk_weights_host(ctx, &none, NULL, NULL, NULL)
                                    : moecl_hash_routing_host(ctx, &none, NULL, NULL, b.host_tables[1], HASH_VOCAB,
                                                              NULL, NULL);
            if (st != MOECL_SUCCESS)
                die(c->label, ctx, st);
        }
    } else if ((st = moecl_grounded_router_prepare(prof, &c->grounded)) ||
               (st = moecl_grounded_router_prepare(plain, &c->grounded)) ||
               (c->op == OP_GROUNDED_ROUTE && ((st = moecl_moe_align_prepare(prof, &c->align)) ||
                                               (st = moecl_moe_align_prepare(plain, &c->align))))) {
        die(c->label, prof, st);
    }
    r->prepare_ms = (tool_now_us() - p0) / 1e3;
    check_case(prof, c, &b, r);

    /* A call slower than 0.1 s (a large GEMM on a CPU) gets fewer calls, at
     * least 10, so one case stays within about 20 s; the table says so. */
    double probe0 = tool_now_us();
    cl_event probe_ev;
    if ((st = call(prof, c, &b, 0, &probe_ev)) != MOECL_SUCCESS)
        die(c->label, prof, st);
    clWaitForEvents(1, &probe_ev);
    clReleaseEvent(probe_ev);
    const double one_call_us = tool_now_us() - probe0;
    int iterations = o->iterations, wall_calls = o->wall_calls, warmup = 10;
    if (one_call_us > 1e5) {
        int fit = (int)(2e7 / one_call_us);
        iterations = fit < 10 ? 10 : fit < iterations ? fit : iterations;
        wall_calls = fit < 10 ? 10 : fit < wall_calls ? fit : wall_calls;
        warmup = 1;
    }
    r->iterations = iterations;
    r->wall_calls = wall_calls;

    /* (a) device time, one call at a time. */
    double *t = malloc(sizeof(double) * 3 * (size_t)iterations), *host = t + iterations, *kern = host + iterations;
    for (int i = -warmup; i < iterations; i++) {
        int set = b.sets > 1 ? (i + warmup) % b.sets : 0;
        double us = 0, host_us = 0, kernel_us = 0;
        if ((st = timed_call(prof, c, &b, set, o->marker, &us, &host_us, &kernel_us)) != MOECL_SUCCESS)
            die(c->label, prof, st);
        if (i >= 0) {
            t[i] = us;
            host[i] = host_us;
            kern[i] = kernel_us;
        }
    }
    qsort(host, (size_t)iterations, sizeof(double), tool_cmp_double);
    qsort(kern, (size_t)iterations, sizeof(double), tool_cmp_double);
    r->host_us = host[iterations / 2];
    r->kernel_us = kern[iterations / 2];
    qsort(t, (size_t)iterations, sizeof(double), tool_cmp_double);
    r->median_us = t[iterations / 2];
    r->p10_us = t[iterations / 10];
    r->p90_us = t[iterations * 9 / 10];
    free(t);

    /* (b) wall time per call, back to back, no profiling. */
    cl_command_queue q = moecl_context_queue(plain);
    for (int i = 0; i < warmup; i++)
        call(plain, c, &b, 0, NULL);
    clFinish(q);
    double t0 = tool_now_us();
    for (int i = 0; i < wall_calls; i++)
        if ((st = call(plain, c, &b, b.sets > 1 ? i % b.sets : 0, NULL)) != MOECL_SUCCESS)
            die(c->label, plain, st);
    clFinish(q);
    r->wall_us = (tool_now_us() - t0) / wall_calls;

    /* (c) bytes that must move: inputs read once, outputs written once. */
    r->bytes = (double)input_bytes(c) + (double)output_bytes(c) +
               (b.bias ? (c->op == OP_TOPK ? c->topk.num_experts : c->grounded.num_experts) * 4.0 : 0.0);
    /* permute: the ids and the rows it writes (num_tokens_post_padded of
     * them, padding included), its scatter counted alike (its slot
     * positions left out, so that the two compare); combine: the weights
     * and positions and the tokens' rows. */
    if (c->op == OP_PERMUTE)
        r->bytes = (double)input_bytes(c) + 4.0 * ((double)moecl_moe_align_max_padded(&c->align) + 1) +
                   (double)b.post * c->perm.hidden * ref_dtype_size(c->perm.out_dtype);
    else if (c->op == OP_COMBINE)
        r->bytes = (double)input_bytes(c) + 8.0 * c->comb.num_tokens * c->comb.top_k +
                   (double)c->comb.num_tokens * c->comb.hidden * ref_dtype_size(c->comb.out_dtype);
    r->gbps = r->bytes / (r->median_us * 1e3);
    r->copy_ratio = copy_gbps > 0 ? r->gbps / copy_gbps : NAN; /* NAN: no --copy-floor */
    free_buffers(&b);
}

/* ---- --host-cost: what a call costs the host ---- */

enum { HOST_COST_BATCH = 200, HOST_COST_ROUNDS = 15 };

typedef struct host_cost {
    double topk_us, empty_us;           /* host time per call behind a user event, best round */
    double topk_wall_us, empty_wall_us; /* wall time per call back to back, no user event */
} host_cost;

/* One batch of calls: either moecl_topk_gating or the bare empty launch. */
typedef struct host_cost_target {
    moecl_context *ctx;
    const moecl_topk_gating_desc *desc;
    cl_mem gating, weights, ids; /* NULL gating: the empty kernel instead */
    cl_kernel empty;
} host_cost_target;

static void host_cost_call(const host_cost_target *t, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    cl_int err;
    if (t->gating) {
        moecl_buffer none = {NULL, 0};
        err = moecl_topk_gating(t->ctx, t->desc, (moecl_buffer){t->gating, 0}, none, (moecl_buffer){t->weights, 0},
                                (moecl_buffer){t->ids, 0}, num_wait, wait, done);
    } else {
        err = enqueue_empty(moecl_context_queue(t->ctx), t->empty, t->weights, num_wait, wait, done);
    }
    if (err != CL_SUCCESS) {
        fprintf(stderr, "moecl-bench: %s failed during --host-cost: %d: %s\n",
                t->gating ? "moecl_topk_gating" : "the empty kernel", err, moecl_context_error(t->ctx));
        exit(1);
    }
}

/* Host time per call: batches of HOST_COST_BATCH calls on the context's own
 * queue, each waiting on a user event that is completed only after the
 * batch is timed, so no kernel runs meanwhile and only the host's work is
 * measured. Best of HOST_COST_ROUNDS; between rounds every returned event is
 * released, the user event completed and the queue drained. */
static double host_cost_behind_event(const host_cost_target *t)
{
    cl_command_queue q = moecl_context_queue(t->ctx);
    cl_context cl = moecl_context_cl_context(t->ctx);
    cl_event done[HOST_COST_BATCH];
    double best = INFINITY;
    for (int round = 0; round < HOST_COST_ROUNDS; round++) {
        cl_int err;
        cl_event gate = clCreateUserEvent(cl, &err);
        if (!gate) {
            fprintf(stderr, "moecl-bench: clCreateUserEvent failed: %d\n", err);
            exit(1);
        }
        const double t0 = tool_now_us();
        for (int i = 0; i < HOST_COST_BATCH; i++)
            host_cost_call(t, 1, &gate, &done[i]);
        const double per_call = (tool_now_us() - t0) / HOST_COST_BATCH;
        best = per_call < best ? per_call : best;
        for (int i = 0; i < HOST_COST_BATCH; i++)
            clReleaseEvent(done[i]);
        clSetUserEventStatus(gate, CL_COMPLETE);
        clReleaseEvent(gate);
        clFinish(q);
    }
    return best;
}

/* Wall time per call of `calls` calls back to back, one clFinish. */
static double host_cost_wall(const host_cost_target *t, int calls)
{
    cl_command_queue q = moecl_context_queue(t->ctx);
    for (int i = 0; i < 10; i++)
        host_cost_call(t, 0, NULL, NULL);
    clFinish(q);
    const double t0 = tool_now_us();
    for (int i = 0; i < calls; i++)
        host_cost_call(t, 0, NULL, NULL);
    clFinish(q);
    return (tool_now_us() - t0) / calls;
}

/* The top-k call (device buffers, no bias) and the bare empty launch, both
 * on ctx's own queue (no profiling), measured the same two ways. The call
 * is checked against the reference first, so what is timed is a real call. */
static host_cost measure_host_cost(moecl_context *ctx, const moecl_topk_gating_desc *desc, int wall_calls)
{
    cl_context cl = moecl_context_cl_context(ctx);
    bench_case c;
    memset(&c, 0, sizeof(c));
    c.label = "topk host cost";
    c.op = OP_TOPK;
    c.topk = *desc;
    case_buffers b;
    setup_buffers(cl, &c, false, TOOL_LOGITS_NORMAL, &b);
    bench_result check;
    memset(&check, 0, sizeof(check));
    check_case(ctx, &c, &b, &check);
    if (!check.checked_ok) {
        fprintf(stderr, "moecl-bench: the top-k call failed its check: %s\n", check.check_msg);
        exit(1);
    }
    host_cost_target topk = {ctx, desc, b.in[0], b.out1, b.out2, NULL};
    host_cost_target empty = {ctx, desc, NULL, b.out1, NULL, empty_kernel(cl, moecl_context_device(ctx))};
    host_cost r;
    r.topk_us = host_cost_behind_event(&topk);
    r.empty_us = host_cost_behind_event(&empty);
    r.topk_wall_us = host_cost_wall(&topk, wall_calls);
    r.empty_wall_us = host_cost_wall(&empty, wall_calls);
    clReleaseKernel(empty.empty);
    free_buffers(&b);
    return r;
}

/* ---- the default cases ---- */

/* Room for the default cases (about 100) and MAX_SHAPES --shape cases;
 * main checks that the default list leaves a margin. */
#define MAX_SHAPES 16
#define MAX_CASES 256

static int default_cases(bench_case *out, bool quick)
{
    static const struct {
        unsigned t, e;
        double sol, prod;
    } seed[] = {{1, 128, 0.00, 11.40},    {129, 128, 0.01, 12.80},  {256, 128, 0.03, 13.00},  {520, 128, 0.06, 13.00},
                {1019, 128, 0.11, 13.10}, {2044, 128, 0.22, 13.30}, {4083, 128, 0.44, 17.10}, {8192, 128, 0.89, 25.60},
                {8037, 256, 1.65, 39.40}, {13526, 256, 2.78, 56.20}};
    int n = 0;
    for (size_t i = 0; i < sizeof(seed) / sizeof(seed[0]); i++) {
        bench_case *c = &out[n++];
        memset(c, 0, sizeof(*c));
        c->label = "topk softmax";
        c->op = OP_TOPK;
        c->topk = moecl_topk_gating_desc_init(seed[i].t, seed[i].e, 8);
        c->t_sol_us = seed[i].sol;
        c->t_prod_us = seed[i].prod;
    }
    static const unsigned dsv3_tokens[] = {1, 4083, 13526};
    for (int i = 0; i < 3; i++) {
        bench_case *c = &out[n++];
        memset(c, 0, sizeof(*c));
        c->label = "topk dsv3 grouped";
        c->op = OP_TOPK;
        c->topk = moecl_topk_gating_desc_init(dsv3_tokens[i], 256, 8);
        c->topk.scoring = MOECL_SCORING_SIGMOID;
        c->topk.num_expert_groups = 8;
        c->topk.topk_group = 4;
        c->topk.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
        c->topk.renormalize = true;
        c->topk.routed_scaling_factor = 2.5f;
        c->bias = true;
    }
    for (int dt = 1; dt <= 2; dt++) {
        bench_case *c = &out[n++];
        memset(c, 0, sizeof(*c));
        c->label = dt == 1 ? "topk softmax f16" : "topk softmax bf16";
        c->op = OP_TOPK;
        c->topk = moecl_topk_gating_desc_init(8192, 128, 8);
        c->topk.gating_dtype = (moecl_dtype)dt;
    }
    /* Routing replay and hash routing (moecl_topk_weights,
     * moecl_hash_routing): the seed's softmax at a decode and a prefill
     * size, and DeepSeek-V4's preset (384 experts, top 6, sqrt(softplus),
     * renormalised with eps, factor 2.5), whose hash layers route so; the
     * prefill sizes only without --quick. */
    static const unsigned replay_tokens[] = {1, 4083};
    for (int op = 0; op < 2; op++)
        for (int v4 = 0; v4 < 2; v4++)
            for (int i = 0; i < (quick ? 1 : 2); i++) {
                bench_case *c = &out[n++];
                memset(c, 0, sizeof(*c));
                c->label = op ? (v4 ? "hash dsv4" : "hash") : (v4 ? "replay dsv4" : "replay");
                c->op = op ? OP_HASH : OP_REPLAY;
                c->topk = moecl_topk_gating_desc_init(replay_tokens[i], 128, 8);
                if (v4 && moecl_topk_gating_desc_preset("deepseek-v4", replay_tokens[i], &c->topk) != MOECL_SUCCESS)
                    die("the deepseek-v4 preset", NULL, MOECL_ERROR_INVALID_ARGUMENT);
            }
    /* moe_align after the routing of the seed shapes: top_k 8, block 64. */
    for (size_t i = 0; i < sizeof(seed) / sizeof(seed[0]); i++) {
        bench_case *c = &out[n++];
        memset(c, 0, sizeof(*c));
        c->label = "moe_align";
        c->op = OP_ALIGN;
        c->align = moecl_moe_align_desc_init(seed[i].t, 8, seed[i].e, 64);
    }
    /* Permute (gather and scatter) and combine around the expert GEMMs:
     * 4096 tokens and one, top 8 of 256 experts, block 64 (DeepSeek-V3's
     * routing), hidden 4096 and 7168, f32 and bf16 in and out; one token
     * only with --quick. */
    static const unsigned pc_tokens[] = {1, 4096}, pc_hidden[] = {4096, 7168};
    static const moecl_dtype pc_dtypes[] = {MOECL_F32, MOECL_BF16};
    for (int op = 0; op < 3; op++)
        for (int ti = 0; ti < (quick ? 1 : 2); ti++)
            for (int hi = 0; hi < 2; hi++)
                for (int di = 0; di < 2; di++) {
                    bench_case *c = &out[n++];
                    memset(c, 0, sizeof(*c));
                    c->label = op == 1 ? "combine" : op == 2 ? "permute_scatter" : "permute";
                    c->op = op == 1 ? OP_COMBINE : OP_PERMUTE;
                    c->scatter = op == 2;
                    c->align = moecl_moe_align_desc_init(pc_tokens[ti], 8, 256, 64);
                    const uint32_t padded = (uint32_t)moecl_moe_align_max_padded(&c->align);
                    c->perm = moecl_permute_desc_init(pc_tokens[ti], 8, pc_hidden[hi], padded);
                    c->perm.in_dtype = c->perm.out_dtype = pc_dtypes[di];
                    c->comb = moecl_combine_desc_init(pc_tokens[ti], 8, pc_hidden[hi], padded);
                    c->comb.in_dtype = c->comb.out_dtype = pc_dtypes[di];
                }
    /* The expert-parallel layout after a routing of 256 experts, top_k 8:
     * 8 and 64 ranks, without replicas and with the first 32 experts
     * doubled (288 physical). */
    static const unsigned ep_tokens[] = {1, 129, 4083, 13526}, ep_ranks[] = {8, 64};
    for (size_t i = 0; i < 4; i++)
        for (size_t r = 0; r < 2; r++)
            for (int hot = 0; hot < 2; hot++) {
                bench_case *c = &out[n++];
                memset(c, 0, sizeof(*c));
                c->label = "ep_layout";
                c->op = OP_EP;
                c->ep = moecl_ep_layout_desc_init(ep_tokens[i], 8, 256, ep_ranks[r]);
                if (hot) {
                    c->ep.num_physical = 256 + 32;
                    c->ep.max_replicas = 2;
                }
            }
    bench_case *g = &out[n++];
    memset(g, 0, sizeof(*g));
    g->label = "grounded seed";
    g->op = OP_GROUNDED;
    g->grounded = moecl_grounded_router_desc_init(4096, 128, 16, 0.5f);
    /* The large grounded shape, 16384 tokens x hidden 4096 x 128 experts, top
     * 8: f32 in each precision mode, and f16 and bf16 hidden states (--only
     * 16384x4096 selects the five). */
    static const struct {
        const char *label;
        moecl_dtype dtype;
        moecl_precision precision;
    } large[] = {{"grounded large", MOECL_F32, MOECL_PRECISION_FP32},
                 {"grounded tf32", MOECL_F32, MOECL_PRECISION_TF32},
                 {"grounded 3xtf32", MOECL_F32, MOECL_PRECISION_3XTF32},
                 {"grounded f16", MOECL_F16, MOECL_PRECISION_FP32},
                 {"grounded bf16", MOECL_BF16, MOECL_PRECISION_FP32}};
    for (size_t i = 0; !quick && i < sizeof(large) / sizeof(large[0]); i++) {
        g = &out[n++];
        memset(g, 0, sizeof(*g));
        g->label = large[i].label;
        g->op = OP_GROUNDED;
        g->grounded = moecl_grounded_router_desc_init(16384, 4096, 128, 0.5f);
        g->grounded.top_k = 8;
        g->grounded.hidden_dtype = large[i].dtype;
        g->grounded.precision = large[i].precision;
    }
    /* DeepSeek-V3's router from hidden states in one launch (moecl_router):
     * g = hidden @ W^T (bf16, hidden 7168, 256 experts, no router logits),
     * sigmoid scores plus the correction bias select within the top 4 of 8
     * groups (top-2 sums), top 8, the unbiased scores renormalised and
     * scaled by 2.5. 4083 tokens only without --quick. */
    static const unsigned router_tokens[] = {1, 64, 4083};
    for (int i = 0; i < (quick ? 2 : 3); i++) {
        g = &out[n++];
        memset(g, 0, sizeof(*g));
        g->label = "router dsv3";
        g->op = OP_ROUTER;
        g->bias = true;
        g->grounded = moecl_grounded_router_desc_init(router_tokens[i], 7168, 256, 1.0f);
        g->grounded.top_k = 8;
        g->grounded.hidden_dtype = MOECL_BF16;
        g->grounded.gating = (moecl_gating){MOECL_SCORING_SIGMOID, MOECL_WEIGHTS_SCORE,       8, 4,
                                            MOECL_GROUP_SCORE_TOP2_SUM, MOECL_GROUP_FILL_NEG_INF, true, 0.0f,
                                            2.5f,                     0.0f};
    }
    /* The other families' routers from hidden states (their presets,
     * bf16 hidden states as their checkpoints; Kimi K2 with its correction
     * bias, GPT-OSS without its gate bias): Qwen3-MoE 4096 -> 128 top 8,
     * Mixtral 4096 -> 8 top 2, GPT-OSS 2880 -> 128 top 4, Kimi K2 7168 ->
     * 384 top 8. 4083 tokens only without --quick. */
    static const struct {
        const char *family, *label;
        bool bias;
    } families[] = {{"qwen3-moe", "router qwen3-moe", false},
                    {"mixtral", "router mixtral", false},
                    {"gpt-oss", "router gpt-oss", false},
                    {"kimi-k2", "router kimi-k2", true}};
    for (size_t f = 0; f < sizeof(families) / sizeof(families[0]); f++)
        for (int i = 0; i < (quick ? 2 : 3); i++) {
            g = &out[n];
            memset(g, 0, sizeof(*g));
            if (moecl_grounded_router_desc_preset(families[f].family, router_tokens[i], &g->grounded) !=
                MOECL_SUCCESS)
                continue; /* not reached: the names are the library's own */
            g->label = families[f].label;
            g->op = OP_ROUTER;
            g->bias = families[f].bias;
            g->grounded.hidden_dtype = MOECL_BF16;
            n++;
        }
    /* Top-k softmax through to dispatch (moecl_route_dispatch, top 8,
     * block 64) at the decode sizes of the seed shapes: one launch where
     * the device and the override (align=) allow, else the two calls. */
    static const unsigned topk_route_tokens[] = {1, 129, 256, 520, 1019};
    for (size_t i = 0; i < sizeof(topk_route_tokens) / sizeof(topk_route_tokens[0]); i++) {
        g = &out[n++];
        memset(g, 0, sizeof(*g));
        g->label = "route softmax";
        g->op = OP_ROUTE;
        g->topk = moecl_topk_gating_desc_init(topk_route_tokens[i], 128, 8);
        g->align = moecl_moe_align_desc_init(topk_route_tokens[i], 8, 128, 64);
    }
    /* The grounded router through to dispatch (block 64): decode sizes and
     * the seed shape. */
    static const unsigned route_tokens[] = {1, 129, 256, 4096};
    for (int i = 0; i < 4; i++) {
        g = &out[n++];
        memset(g, 0, sizeof(*g));
        g->label = "grounded route";
        g->op = OP_GROUNDED_ROUTE;
        g->grounded = moecl_grounded_router_desc_init(route_tokens[i], 128, 16, 0.5f);
        g->align = moecl_moe_align_desc_init(route_tokens[i], 2, 16, 64);
    }
    return n;
}

static void shape_text(const bench_case *c, char *buf, size_t size)
{
    if (permute_op(c))
        snprintf(buf, size, "%ux%u k%u e%u b%u", c->align.num_tokens, c->perm.hidden, c->align.top_k,
                 c->align.num_experts, c->align.block_size);
    else if (c->op == OP_ALIGN)
        snprintf(buf, size, "%ux%u k%u b%u", c->align.num_tokens, c->align.num_experts, c->align.top_k,
                 c->align.block_size);
    else if (c->op == OP_EP)
        snprintf(buf, size, "%ux%u k%u r%u p%u", c->ep.num_tokens, c->ep.num_experts, c->ep.top_k, c->ep.num_ranks,
                 c->ep.num_physical);
    else if (c->op == OP_ROUTE)
        snprintf(buf, size, "%ux%u k%u b%u", c->topk.num_tokens, c->topk.num_experts, c->topk.top_k,
                 c->align.block_size);
    else if (topk_desc_op(c))
        snprintf(buf, size, "%ux%u k%u", c->topk.num_tokens, c->topk.num_experts, c->topk.top_k);
    else if (c->op == OP_GROUNDED_ROUTE)
        snprintf(buf, size, "%ux%ux%u k%u b%u", c->grounded.num_tokens, c->grounded.hidden_dim,
                 c->grounded.num_experts, c->grounded.top_k, c->align.block_size);
    else
        snprintf(buf, size, "%ux%ux%u k%u", c->grounded.num_tokens, c->grounded.hidden_dim, c->grounded.num_experts,
                 c->grounded.top_k);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: moecl-bench [--device SEL] [--iterations N] [--wall-calls N] [--cold] [--quick] [--marker]\n"
               "                   [--only NAME]... [--list] [--shape T,E,K]... [--json FILE] [--csv FILE]\n"
               "                   [--logits KIND] [--copy-floor] [--host-cost] [--variant TEXT]\n"
               "                   [--help]\n"
               "Checks each op against the float64 reference, then times it: device time from OpenCL\n"
               "profiling (median of N calls, default 200; --cold rotates inputs larger than the cache),\n"
               "wall time per call of back-to-back calls (default 1000), GB/s, and with --copy-floor the\n"
               "ratio to a copy kernel (1 GiB each way, median of 20 calls: seconds on a CPU). The header\n"
               "names the device in one line; moecl-info describes it. --quick: fewer calls and no large\n"
               "grounded-router cases. --shape adds a softmax top-k case of T tokens, E experts, top_k K\n"
               "(repeatable). --only NAME keeps the cases whose label (\"moe_align\"), shape (\"1x128 k8\n"
               "b64\") or both (\"moe_align 1x128 k8 b64\") is NAME in full; *, ? and [...] make NAME a\n"
               "shell pattern (--only '1x128 *': every shape of 1 token x 128 experts); repeatable, any\n"
               "match keeps a case; one that keeps none is a bad usage. --list prints the names the\n"
               "options select and exits. Progress goes to stderr when it is a terminal. --logits KIND: the\n"
               "top-k cases' logits, all from the same seeded generator: normal (standard normal, the\n"
               "default), uniform10 (uniform on [0, 10): top values crowd together), hot (standard normal,\n"
               "8 hot experts, every E/8-th from 0, raised by 3) or ties (levels 0..7 plus 0..3 times\n"
               "2^-20: exact and near ties at the k-th place); bench/torch_reference.py --logits draws the\n"
               "same kinds. --json FILE and\n"
               "--csv FILE write the table for scripts too (dtype as 0 f32, 1 f16, 2 bf16, 3 int32\n"
               "(moe_align); ids_fnv1a hashes the ids of the check, for moe_align the sorted_token_ids;\n"
               "JSON strings are valid UTF-8: a byte that is not is written as U+FFFD). moe_align's\n"
               "device time spans its kernels: from a marker just before the call to the end of its last, as\n"
               "the layout's (ep_layout) and the grounded route dispatch's. --marker times every case so\n"
               "(a one-kernel call's dev_us then includes the gap between the marker and its kernel, as\n"
               "theirs does; every call waits on its marker through its wait list). A layout case's line\n"
               "under the table compares it with the routing of the same shape alike: each one's last\n"
               "kernel START..END (the whole call where both are one launch, as the fused layout is once\n"
               "its scratch is set up), with --marker each one's span from its marker, and each one's\n"
               "wall time.\n"
               "--variant TEXT forces a kernel variant in every context (\"class=gpu align=fused ...\", the words\n"
               "of docs/environment.md, \"Forcing a variant\"); the header and the JSON name it.\n"
               "--host-cost instead times what a moecl_topk_gating call (device buffers, softmax, f32;\n"
               "1,128,8 or the --shape) costs the host: batches of 200 calls on the context's own queue\n"
               "behind an uncompleted user event, so no kernel runs, best of 15 rounds, against a bare\n"
               "clSetKernelArg + clEnqueueNDRangeKernel of an empty kernel; then both as wall time per\n"
               "call back to back (--wall-calls).\n"
               "Columns of the table (one row a case, times in microseconds):\n"
               "  op, shape   the case: T tokens x E experts kK (top_k); grounded TxHxE (H the hidden\n"
               "              size); moe_align T x E kK bB (block size B); permute and combine T x H kK eE\n"
               "              bB (the routing of T tokens, top K of E experts, block B, moe_align's\n"
               "              order; hidden H; permute_scatter: permute's rows, token-major);\n"
               "              GB/s counts each hidden (permute) or expert row (combine) read\n"
               "              once, the ids, and the rows written\n"
               "  dtype       the input's type (f32, f16, bf16; i32 for moe_align's ids)\n"
               "  dev_us      device time per call, median of N profiled calls; p10_us, p90_us: the\n"
               "              10th and 90th percentiles\n"
               "  wall_us     wall time per call of --wall-calls calls back to back (host and device)\n"
               "  GB/s        bytes the op must read and write over dev_us; %%copy: that against the\n"
               "              copy kernel's GB/s on the same device (the header line; - without\n"
               "              --copy-floor, and null or empty in the JSON and CSV)\n"
               "  T_SOL       the seed's speed-of-light time for the shape (on hardware it calls XPU-A)\n"
               "  T_Prod      the seed's time of the production implementation (vllm._custom_ops);\n"
               "              both given only for the seed's ten top-k shapes, copied from the seed,\n"
               "              not measured here (the seed: the two task documents moecl was built\n"
               "              from, README \"Terms\")\n"
               "  prep_ms     the prepare calls' time: kernel build, or load from the kernel cache\n"
               "  calls       how many calls dev_us is the median of\n"
               "  check       ok or FAIL against the float64 reference (FAIL: the reason follows)\n"
               "The last line is the verdict, \"P/N checks passed\" (not with --host-cost).\n"
               "Long options are spelled out in full: an abbreviation is a bad usage.\n"
               "Exit status: 0 all checks passed, 1 a check or a call failed or FILE could not be written, 2 bad usage.\n");
}

enum {
    OPT_DEVICE = 256,
    OPT_ITERATIONS,
    OPT_WALL_CALLS,
    OPT_JSON,
    OPT_CSV,
    OPT_ONLY,
    OPT_SHAPE,
    OPT_COLD,
    OPT_QUICK,
    OPT_HOST_COST,
    OPT_LOGITS,
    OPT_MARKER,
    OPT_VARIANT,
    OPT_COPY_FLOOR,
    OPT_LIST,
};

/* "T,E,K": three whole numbers, experts and top_k at least 1. */
static bool parse_shape(const char *text, unsigned out[3])
{
    char buf[64];
    if (snprintf(buf, sizeof(buf), "%s", text) >= (int)sizeof(buf))
        return false;
    char *save = NULL, *part = strtok_r(buf, ",", &save);
    for (int i = 0; i < 3; i++, part = strtok_r(NULL, ",", &save)) {
        long v;
        if (!tool_parse_int(part, i == 0 ? 0 : 1, UINT32_MAX, &v))
            return false;
        out[i] = (unsigned)v;
    }
    return part == NULL && text[strlen(text) - 1] != ',';
}

/* The options, checked before any device is touched: -1 to go on, else
 * the exit status (0 after --help, 2 for a bad usage, named). */
static int parse_args(int argc, char **argv, options *o)
{
    static const struct option longopts[] = {
        {"device", required_argument, NULL, OPT_DEVICE},   {"iterations", required_argument, NULL, OPT_ITERATIONS},
        {"wall-calls", required_argument, NULL, OPT_WALL_CALLS}, {"json", required_argument, NULL, OPT_JSON},
        {"csv", required_argument, NULL, OPT_CSV},         {"only", required_argument, NULL, OPT_ONLY},
        {"shape", required_argument, NULL, OPT_SHAPE},     {"cold", no_argument, NULL, OPT_COLD},
        {"quick", no_argument, NULL, OPT_QUICK},           {"host-cost", no_argument, NULL, OPT_HOST_COST},
        {"logits", required_argument, NULL, OPT_LOGITS},   {"marker", no_argument, NULL, OPT_MARKER},
        {"variant", required_argument, NULL, OPT_VARIANT},
        {"copy-floor", no_argument, NULL, OPT_COPY_FLOOR}, {"list", no_argument, NULL, OPT_LIST},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *prog = "moecl-bench";
    memset(o, 0, sizeof(*o));
    o->iterations = 200;
    o->wall_calls = 1000;
    int c;
    long v;
    while ((c = tool_getopt(prog, usage, argc, argv, "h", longopts)) != -1) {
        switch (c) {
        case 'h':
            usage(stdout);
            return 0;
        case OPT_DEVICE:
            o->device = optarg;
            break;
        case OPT_ITERATIONS:
            if (!tool_parse_int(optarg, 10, 10000000, &v))
                return tool_bad_usage(prog, usage, "--iterations %s: expected a whole number, at least 10", optarg);
            o->iterations = (int)v;
            break;
        case OPT_WALL_CALLS:
            if (!tool_parse_int(optarg, 1, 100000000, &v))
                return tool_bad_usage(prog, usage, "--wall-calls %s: expected a whole number, at least 1", optarg);
            o->wall_calls = (int)v;
            break;
        case OPT_JSON:
            o->json = optarg;
            break;
        case OPT_CSV:
            o->csv = optarg;
            break;
        case OPT_ONLY:
            if (o->num_only == MAX_ONLY)
                return tool_bad_usage(prog, usage, "--only %s: at most %d --only", optarg, MAX_ONLY);
            o->only[o->num_only++] = optarg;
            break;
        case OPT_COPY_FLOOR:
            o->copy_floor = true;
            break;
        case OPT_LIST:
            o->list = true;
            break;
        case OPT_SHAPE:
            if (o->num_shapes == 16)
                return tool_bad_usage(prog, usage, "--shape %s: at most 16 --shape", optarg);
            if (!parse_shape(optarg, o->shapes[o->num_shapes]))
                return tool_bad_usage(prog, usage, "--shape %s: expected T,E,K (tokens, experts, top_k)", optarg);
            o->num_shapes++;
            break;
        case OPT_COLD:
            o->cold = true;
            break;
        case OPT_QUICK:
            o->quick = true;
            break;
        case OPT_HOST_COST:
            o->host_cost = true;
            break;
        case OPT_VARIANT:
            if (moecl_override_set(optarg) != MOECL_SUCCESS)
                return tool_bad_usage(prog, usage, "--variant %s: %s", optarg, moecl_context_error(NULL));
            o->variant = optarg;
            break;
        case OPT_MARKER:
            o->marker = true;
            break;
        case OPT_LOGITS:
            if (!tool_parse_logits(optarg, &o->logits))
                return tool_bad_usage(prog, usage, "--logits %s: expected normal, uniform10, hot or ties", optarg);
            break;
        default:
            return 2; /* tool_getopt named it */
        }
    }
    if (optind < argc)
        return tool_bad_usage(prog, usage, "unexpected argument '%s'", argv[optind]);
    if (o->host_cost && o->num_shapes > 1)
        return tool_bad_usage(prog, usage, "--host-cost times one shape: one --shape at most");
    if (o->host_cost && (o->num_only || o->cold || o->csv))
        return tool_bad_usage(prog, usage, "--host-cost times one top-k call: not with --only, --cold or --csv");
    if (o->quick) {
        o->iterations = o->iterations > 50 ? 50 : o->iterations;
        o->wall_calls = o->wall_calls > 100 ? 100 : o->wall_calls;
    }
    return -1;
}

/* --only: each pattern is matched whole, as a shell pattern (fnmatch: a
 * plain name matches only itself; *, ? and [...] widen it), against the
 * case's label, its shape and "label shape"; any pattern that matches
 * selects the case. */
static bool case_selected(const bench_case *c, const options *o)
{
    if (!o->num_only)
        return true;
    char shape[64], full[160];
    shape_text(c, shape, sizeof(shape));
    snprintf(full, sizeof(full), "%s %s", c->label, shape);
    const char *names[3] = {c->label, shape, full};
    for (int p = 0; p < o->num_only; p++)
        for (int i = 0; i < 3; i++)
            if (!fnmatch(o->only[p], names[i], 0))
                return true;
    return false;
}

/* The case's dtype as the CSV and JSON give it: 3 for the ids (i32). */
static int case_dtype(const bench_case *c)
{
    return c->op == OP_ALIGN || c->op == OP_EP ? 3
           : permute_op(c)                     ? (int)c->perm.in_dtype
           : topk_desc_op(c)                   ? (int)c->topk.gating_dtype
                                               : (int)c->grounded.hidden_dtype;
}

static const char *dtype_name(const bench_case *c)
{
    moecl_dtype dt = permute_op(c)     ? c->perm.in_dtype
                     : topk_desc_op(c) ? c->topk.gating_dtype
                                       : c->grounded.hidden_dtype;
    return c->op == OP_ALIGN || c->op == OP_EP ? "i32" : dt == MOECL_F32 ? "f32" : dt == MOECL_F16 ? "f16" : "bf16";
}

/* Figures rounded for the JSON, as the table prints them. */
static double rounded(double v, double scale) { return round(v * scale) / scale; }

static cJSON *case_json(const bench_case *c, const bench_result *r)
{
    char shape[64], hash[17];
    shape_text(c, shape, sizeof(shape));
    snprintf(hash, sizeof(hash), "%016llx", (unsigned long long)r->ids_hash);
    const int dt = case_dtype(c);
    cJSON *j = cJSON_CreateObject();
    const struct {
        const char *name;
        double value, scale;
    } numbers[] = {{"dtype", dt, 1},
                   {"device_us", r->median_us, 1e3},
                   {"p10_us", r->p10_us, 1e3},
                   {"p90_us", r->p90_us, 1e3},
                   {"wall_us", r->wall_us, 1e3},
                   {"gbps", r->gbps, 1e2},
                   {"copy_ratio", r->copy_ratio, 1e4},
                   {"t_sol_us", c->t_sol_us, 1e2},
                   {"t_prod_us", c->t_prod_us, 1e2},
                   {"prepare_ms", r->prepare_ms, 1e2},
                   {"calls", r->iterations, 1},
                   {"wall_calls", r->wall_calls, 1},
                   {"host_us", r->host_us, 1e3},
                   {"kernel_us", r->kernel_us, 1e3}};
    tool_json_add_string(j, "op", c->label);
    tool_json_add_string(j, "shape", shape);
    for (size_t i = 0; i < sizeof(numbers) / sizeof(numbers[0]); i++) /* NAN (copy_ratio without --copy-floor): null */
        cJSON_AddItemToObject(j, numbers[i].name, isnan(numbers[i].value)
                                                      ? cJSON_CreateNull()
                                                      : cJSON_CreateNumber(rounded(numbers[i].value, numbers[i].scale)));
    tool_json_add_bool(j, "check", r->checked_ok);
    tool_json_add_string(j, "ids_fnv1a", hash);
    return j;
}

/* Writes doc to f and closes f; false (and a message) if either failed. */
static bool finish_json(FILE *f, const char *path, cJSON *doc)
{
    bool ok = tool_json_write(f, doc);
    ok = fclose(f) == 0 && ok;
    cJSON_Delete(doc);
    if (!ok)
        fprintf(stderr, "moecl-bench: writing %s failed\n", path);
    return ok;
}

static int run_host_cost(moecl_context *plain, const options *o, FILE *jf)
{
    const unsigned *shape = o->num_shapes ? o->shapes[0] : (const unsigned[3]){1, 128, 8};
    const unsigned t = shape[0], e = shape[1], k = shape[2];
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(t, e, k);
    host_cost h = measure_host_cost(plain, &d, o->wall_calls);
    printf("host cost per call, topk softmax %ux%u k%u f32, device buffers, on the context's own queue:\n"
           "  behind a user event (best of %d rounds of %d calls, no kernel runs):\n"
           "    moecl_topk_gating                      %8.3f us\n"
           "    clSetKernelArg + clEnqueueNDRangeKernel %7.3f us (empty kernel)\n"
           "    ratio                                  %8.2f\n"
           "  wall time per call, %d calls back to back, one clFinish:\n"
           "    moecl_topk_gating                      %8.3f us\n"
           "    empty kernel                           %8.3f us\n"
           "    difference                             %8.3f us\n",
           t, e, k, HOST_COST_ROUNDS, HOST_COST_BATCH, h.topk_us, h.empty_us, h.topk_us / h.empty_us, o->wall_calls,
           h.topk_wall_us, h.empty_wall_us, h.topk_wall_us - h.empty_wall_us);
    if (!jf)
        return 0;
    char shape_text_buf[64];
    snprintf(shape_text_buf, sizeof(shape_text_buf), "%ux%u k%u", t, e, k);
    cJSON *doc = cJSON_CreateObject(), *hc = cJSON_CreateObject();
    tool_json_add_string(doc, "version", moecl_version());
    cJSON_AddItemToObject(doc, "host_cost", hc);
    tool_json_add_string(hc, "shape", shape_text_buf);
    tool_json_add_number(hc, "rounds", HOST_COST_ROUNDS);
    tool_json_add_number(hc, "batch", HOST_COST_BATCH);
    tool_json_add_number(hc, "topk_host_us", rounded(h.topk_us, 1e4));
    tool_json_add_number(hc, "empty_host_us", rounded(h.empty_us, 1e4));
    tool_json_add_number(hc, "ratio", rounded(h.topk_us / h.empty_us, 1e4));
    tool_json_add_number(hc, "wall_calls", o->wall_calls);
    tool_json_add_number(hc, "topk_wall_us", rounded(h.topk_wall_us, 1e4));
    tool_json_add_number(hc, "empty_wall_us", rounded(h.empty_wall_us, 1e4));
    return finish_json(jf, o->json, doc) ? 0 : 1;
}

int main(int argc, char **argv)
{
    options o;
    int status = parse_args(argc, argv, &o);
    if (status >= 0)
        return status;
    bench_case cases[MAX_CASES];
    int n = o.host_cost ? 0 : default_cases(cases, o.quick);
    /* Fails every run (CI's smoke run too) well before the list outgrows
     * the array. */
    if (n > MAX_CASES - MAX_SHAPES - 64) {
        fprintf(stderr, "moecl-bench: %d default cases leave too little room in MAX_CASES (%d)\n", n, MAX_CASES);
        return 1;
    }
    for (int i = 0; i < o.num_shapes && !o.host_cost; i++) {
        bench_case *c = &cases[n++];
        memset(c, 0, sizeof(*c));
        c->label = "topk custom";
        c->op = OP_TOPK;
        c->topk = moecl_topk_gating_desc_init(o.shapes[i][0], o.shapes[i][1], o.shapes[i][2]);
    }
    int selected = 0;
    for (int i = 0; i < n; i++) {
        if (!case_selected(&cases[i], &o))
            continue;
        selected++;
        if (o.list) {
            char shape[64];
            shape_text(&cases[i], shape, sizeof(shape));
            printf("%s %s\n", cases[i].label, shape);
        }
    }
    if (o.list)
        return 0;
    if (!o.host_cost && selected == 0) {
        char patterns[512] = "";
        for (int p = 0, used = 0; p < o.num_only && used < (int)sizeof(patterns); p++)
            used += snprintf(patterns + used, sizeof(patterns) - (size_t)used, "%s--only %s", p ? " " : "", o.only[p]);
        return tool_bad_usage("moecl-bench", usage,
                              "%s matches no case's label, shape or \"label shape\" in full (--list names them; "
                              "'*' widens a pattern: --only '%s*')",
                              patterns, o.only[0]);
    }
    /* Opened before the runs, so that a path that cannot be written fails
     * at once rather than after the timing. */
    FILE *jf = o.json ? fopen(o.json, "w") : NULL, *cf = o.csv ? fopen(o.csv, "w") : NULL;
    if ((o.json && !jf) || (o.csv && !cf)) {
        fprintf(stderr, "moecl-bench: cannot write %s\n", o.json && !jf ? o.json : o.csv);
        return 1;
    }

    moecl_context *plain;
    double c0 = tool_now_us();
    moecl_status st = moecl_context_create(o.device, &plain);
    double create_ms = (tool_now_us() - c0) / 1e3;
    if (st != MOECL_SUCCESS)
        die("creating the context", NULL, st);
    /* One line names the device; moecl-info describes it. */
    char pname[256] = "?", dname[256] = "?";
    cl_platform_id platform;
    if (clGetDeviceInfo(moecl_context_device(plain), CL_DEVICE_PLATFORM, sizeof(platform), &platform, NULL) ==
        CL_SUCCESS)
        clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof(pname), pname, NULL);
    clGetDeviceInfo(moecl_context_device(plain), CL_DEVICE_NAME, sizeof(dname), dname, NULL);
    printf("moecl %s  %s  logits %s\ndevice: %s / %s (moecl-info describes it)\n", moecl_version(),
           o.cold ? "(cold: inputs rotate past the cache)" : "(L2-warm: same input)", tool_logits_name(o.logits), pname,
           dname);
    if (o.variant)
        printf("variant override: %s\n", o.variant);
    if (o.host_cost) {
        status = run_host_cost(plain, &o, jf);
        moecl_context_destroy(plain);
        return status;
    }
    cl_context cl = moecl_context_cl_context(plain);
    cl_device_id dev = moecl_context_device(plain);
    cl_int err;
    cl_command_queue pq = clCreateCommandQueue(cl, dev, CL_QUEUE_PROFILING_ENABLE, &err);
    if (!pq) {
        fprintf(stderr, "moecl-bench: cannot create a profiling queue (%d)\n", err);
        return 1;
    }
    moecl_context *prof;
    if ((st = moecl_context_create_from_cl(cl, dev, pq, &prof)) != MOECL_SUCCESS)
        die("adopting the profiling queue", NULL, st);
    clReleaseCommandQueue(pq);

    const bool progress = isatty(STDERR_FILENO);
    if (progress && o.copy_floor)
        fprintf(stderr, "timing the copy kernel (1 GiB each way) ...");
    probes pr = measure_probes(cl, dev, moecl_context_queue(prof), moecl_context_queue(plain), o.iterations,
                               o.wall_calls, o.copy_floor);
    if (progress && o.copy_floor)
        fprintf(stderr, "\r%60s\r", "");
    char copy[64] = "not timed (--copy-floor times it)";
    if (o.copy_floor)
        snprintf(copy, sizeof(copy), "%.1f GB/s (read + write)", pr.copy_gbps);
    printf("context creation: %.1f ms; empty kernel: %.2f us device time, %.2f us wall time per call of %d back to "
           "back; copy kernel: %s\n\n",
           create_ms, pr.empty_us, pr.empty_wall_us, o.wall_calls, copy);

    bench_result results[MAX_CASES];
    bool ran[MAX_CASES] = {false};
    int failures = 0, checked = 0, passed = 0;
    printf("%-18s %-20s %-5s %9s %9s %9s %10s %9s %6s %7s %7s %8s %5s %s\n", "op", "shape", "dtype", "dev_us", "p10_us",
           "p90_us", "wall_us", "GB/s", "%copy", "T_SOL", "T_Prod", "prep_ms", "calls", "check");
    for (int i = 0; i < n; i++) {
        const bench_case *c = &cases[i];
        char shape[64];
        shape_text(c, shape, sizeof(shape));
        if (!case_selected(c, &o))
            continue;
        if (progress)
            fprintf(stderr, "\r[%d/%d] %s %s ...          ", i + 1, n, c->label, shape);
        run_case(prof, plain, c, &o, pr.copy_gbps, &results[i]);
        ran[i] = true;
        const bench_result *r = &results[i];
        checked++;
        passed += r->checked_ok;
        char sol[16] = "", prod[16] = "";
        if (c->t_prod_us > 0) {
            snprintf(sol, sizeof(sol), "%.2f", c->t_sol_us);
            snprintf(prod, sizeof(prod), "%.2f", c->t_prod_us);
        }
        if (progress)
            fprintf(stderr, "\r%60s\r", "");
        char copy[16] = "-";
        if (!isnan(r->copy_ratio))
            snprintf(copy, sizeof(copy), "%.1f%%", 100 * r->copy_ratio);
        printf("%-18s %-20s %-5s %9.2f %9.2f %9.2f %10.2f %9.1f %6s %7s %7s %8.1f %5d %s\n", c->label, shape,
               dtype_name(c), r->median_us, r->p10_us, r->p90_us, r->wall_us, r->gbps, copy, sol, prod,
               r->prepare_ms, r->iterations, r->checked_ok ? "ok" : "FAIL");
        fflush(stdout);
        if (!r->checked_ok) {
            printf("  %s\n", r->check_msg);
            failures++;
        }
        /* moe_align: where its time goes, and next to the routing of the
         * same tokens and experts. */
        if (c->op == OP_ALIGN) {
            printf("  %.2f us in the call; last kernel %.2f us", r->host_us, r->kernel_us);
            for (int j = 0; j < i; j++)
                if (ran[j] && cases[j].op == OP_TOPK && !strcmp(cases[j].label, "topk softmax") &&
                    cases[j].topk.num_tokens == c->align.num_tokens &&
                    cases[j].topk.num_experts == c->align.num_experts && cases[j].topk.top_k == c->align.top_k) {
                    printf("; routing %.2f us + moe_align %.2f us = %.2f us device time", results[j].median_us,
                           r->median_us, results[j].median_us + r->median_us);
                    break;
                }
            printf("\n");
        }
        /* The layout next to the routing of the same tokens and experts,
         * measured alike: the last kernel's own START..END of each (the
         * whole call where both are one launch), the span from a marker
         * of each with --marker, wall time of each. */
        if (c->op == OP_EP)
            for (int j = 0; j < i; j++)
                if (ran[j] && cases[j].op == OP_TOPK && cases[j].topk.num_tokens == c->ep.num_tokens &&
                    cases[j].topk.num_experts == c->ep.num_experts && cases[j].topk.top_k == c->ep.top_k) {
                    printf("  routing (%s) / this layout, us: kernel %.2f / %.2f", cases[j].label,
                           results[j].kernel_us, r->kernel_us);
                    if (o.marker)
                        printf(", from a marker %.2f / %.2f", results[j].median_us, r->median_us);
                    printf(", wall %.2f / %.2f\n", results[j].wall_us, r->wall_us);
                }
    }
    if (cf)
        fprintf(cf, "op,shape,dtype,device_us,p10_us,p90_us,wall_us,gbps,copy_ratio,t_sol_us,t_prod_us,check\n");
    cJSON *doc = jf ? cJSON_CreateObject() : NULL, *list = jf ? cJSON_CreateArray() : NULL;
    for (int i = 0; i < n; i++) {
        if (!ran[i])
            continue;
        const bench_case *c = &cases[i];
        const bench_result *r = &results[i];
        char shape[64];
        shape_text(c, shape, sizeof(shape));
        int dt = case_dtype(c);
        if (list)
            cJSON_AddItemToArray(list, case_json(c, r));
        if (cf)
        {
            char ratio[32] = ""; /* empty without --copy-floor */
            if (!isnan(r->copy_ratio))
                snprintf(ratio, sizeof(ratio), "%.4f", r->copy_ratio);
            fprintf(cf, "%s,%s,%d,%.3f,%.3f,%.3f,%.3f,%.2f,%s,%.2f,%.2f,%s\n", c->label, shape, dt, r->median_us,
                    r->p10_us, r->p90_us, r->wall_us, r->gbps, ratio, c->t_sol_us, c->t_prod_us,
                    r->checked_ok ? "ok" : "FAIL");
        }
    }
    if (jf) {
        tool_json_add_string(doc, "version", moecl_version());
        tool_json_add_bool(doc, "cold", o.cold);
        tool_json_add_string(doc, "logits", tool_logits_name(o.logits));
        tool_json_add_string(doc, "variant", o.variant);
        tool_json_add_number(doc, "context_create_ms", rounded(create_ms, 1e2));
        tool_json_add_number(doc, "empty_kernel_us", rounded(pr.empty_us, 1e3));
        tool_json_add_number(doc, "empty_kernel_wall_us", rounded(pr.empty_wall_us, 1e3));
        cJSON_AddItemToObject(doc, "copy_gbps",
                              o.copy_floor ? cJSON_CreateNumber(rounded(pr.copy_gbps, 1e1)) : cJSON_CreateNull());
        cJSON_AddItemToObject(doc, "cases", list);
        failures += !finish_json(jf, o.json, doc);
    }
    if (cf && fclose(cf) != 0) {
        fprintf(stderr, "moecl-bench: writing %s failed\n", o.csv);
        failures++;
    }
    moecl_context_destroy(prof);
    moecl_context_destroy(plain);
    /* The verdict last, so that a reader (or a script) needs one line. */
    printf("\n%d/%d checks passed%s\n", passed, checked,
           failures > checked - passed ? " (but an output file could not be written)" : "");
    return failures ? 1 : 0;
}
