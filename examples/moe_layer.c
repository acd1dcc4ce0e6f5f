/* moe_layer: a Mixtral/Qwen3-style MoE feed-forward layer on one OpenCL
 * queue, with moecl's routing, permute and combine around CLBlast's GEMMs
 * (docs/moe-layer.md walks through it).
 *
 *   x [T][H] ─► router GEMM (CLBlast) ─► logits [T][E]
 *     ─► moecl_route_dispatch: softmax, top k, renormalise (Mixtral,
 *        Qwen3-MoE), then moe_align's blocks of block_size slots
 *     ─► moecl_permute: each slot's row of x, in the experts' order [P][H]
 *     ─► gate_up: block b times its expert's W1 [2I][H] (CLBlast's batched
 *        GEMM, one GEMM a block, the offsets from block_expert_ids)
 *     ─► SiLU(gate) * up (silu_and_mul below) [P][I]
 *     ─► down: block b times its expert's W2 [H][I] (batched GEMM) [P][H]
 *     ─► moecl_combine: each token's rows, weighted, summed: out [T][H]
 *
 * Every command goes to moecl's context's queue, which is in-order: the
 * moecl calls wait on the previous step's event, and CLBlast (whose C API
 * takes no wait list) enqueues behind them in queue order. The one host
 * synchronisation is the read of num_tokens_post_padded and
 * block_expert_ids: CLBlast's batched GEMM takes its offsets in host
 * arrays. The permute is enqueued before that read, so the device gathers
 * the rows while the host waits.
 *
 * It prints the output's checksum and the median wall time of a layer over
 * --runs runs after --warmup runs; --dump DIR writes the inputs and the
 * outputs as raw little-endian files for tests/examples/moe_layer_check.py,
 * which recomputes the layer in float64 and bounds the difference. A
 * --fault list runs the layer once per fault in one process and one
 * context (CLBlast compiles its kernels once), each run dumped to DIR/F.
 *
 * Exit status: 0 ok, 1 a call failed, 2 bad options, 77 no OpenCL device
 * (meson's "skipped"). */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <clblast_c.h>
#include <moecl/moecl.h>

/* ---- options ---- */

#define MAX_FAULTS 3 /* none, offset, silu: each at most once */

typedef struct options {
    int tokens, hidden, inter, experts, top_k, block;
    int seed, runs, warmup;
    bool steps;
    const char *dump;   /* folder for --dump, or NULL */
    const char *device; /* moecl_context_create's selector, or NULL: MOECL_DEVICE */
    /* Deliberate bugs, to show that the check catches each: the layer
     * runs once per entry, in this order. */
    const char *faults[MAX_FAULTS];
    int num_faults;
} options;

/* Model shapes (--model): hidden, intermediate, experts, top k. */
static const struct {
    const char *name;
    int hidden, inter, experts, top_k;
} models[] = {
    {"small", 1024, 3584, 8, 2},    /* Mixtral-8x7B's experts with H and I divided by 4 */
    {"mixtral", 4096, 14336, 8, 2}, /* Mixtral-8x7B */
    {"qwen3", 2048, 768, 128, 8},   /* Qwen3-30B-A3B */
};

static void usage(FILE *f)
{
    fprintf(f, "usage: moe_layer [options]\n"
               "  --model M     small (default: Mixtral-8x7B with H and I / 4), mixtral or qwen3\n"
               "                (Qwen3-30B-A3B); sets --hidden, --inter, --experts, --top-k\n"
               "  --tokens T    tokens in the batch (default 128)\n"
               "  --hidden H    hidden size\n"
               "  --inter I     each expert's intermediate size\n"
               "  --experts E   routed experts\n"
               "  --top-k K     experts per token\n"
               "  --block B     moe_align's block size: rows per GEMM of the batch (default 16)\n"
               "  --seed S      seed of the inputs (default 1)\n"
               "  --runs N      timed layers (default 20)\n"
               "  --warmup W    untimed layers before them (default 2)\n"
               "  --steps       also time each step (a clFinish after each)\n"
               "  --device SEL  moecl's device selector (default: MOECL_DEVICE, else the first GPU, else a CPU)\n"
               "  --dump DIR    write inputs and outputs to DIR (raw little-endian)\n"
               "  --fault F     none, offset or silu: a deliberate bug the check must catch; a comma\n"
               "                list (offset,silu) runs the layer once per fault in one process, each\n"
               "                run dumped to DIR/F\n");
}

/* --fault's comma list into o->faults (pointers to static names); false
 * for an unknown or repeated name or an empty entry. */
static bool parse_faults(const char *v, options *o)
{
    static const char *const names[MAX_FAULTS] = {"none", "offset", "silu"};
    o->num_faults = 0;
    for (const char *p = v;; p++) {
        const size_t len = strcspn(p, ",");
        const char *name = NULL;
        for (int n = 0; n < MAX_FAULTS; n++)
            if (strlen(names[n]) == len && !strncmp(p, names[n], len))
                name = names[n];
        for (int i = 0; name && i < o->num_faults; i++)
            if (o->faults[i] == name)
                name = NULL;
        if (!name)
            return false;
        o->faults[o->num_faults++] = name;
        p += len;
        if (!*p)
            return true;
    }
}

/* 0 when every option parsed, -1 for --help, 2 otherwise (with a message). */
static int parse_options(int argc, char **argv, options *o)
{
    *o = (options){128, 1024, 3584, 8, 2, 16, 1, 20, 2, false, NULL, NULL, {"none"}, 1};
    const struct {
        const char *name;
        int *value, min;
    } numbers[] = {{"--tokens", &o->tokens, 1},   {"--hidden", &o->hidden, 1}, {"--inter", &o->inter, 1},
                   {"--experts", &o->experts, 1}, {"--top-k", &o->top_k, 1},   {"--block", &o->block, 1},
                   {"--seed", &o->seed, 0},       {"--runs", &o->runs, 1},     {"--warmup", &o->warmup, 0}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return -1;
        }
        if (strcmp(a, "--steps") == 0) {
            o->steps = true;
            continue;
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        bool known = false;
        if (v && strcmp(a, "--model") == 0)
            for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++)
                if (strcmp(v, models[m].name) == 0) {
                    o->hidden = models[m].hidden;
                    o->inter = models[m].inter;
                    o->experts = models[m].experts;
                    o->top_k = models[m].top_k;
                    known = true;
                }
        if (v && strcmp(a, "--dump") == 0)
            o->dump = v, known = true;
        if (v && strcmp(a, "--device") == 0)
            o->device = v, known = true;
        if (v && strcmp(a, "--fault") == 0)
            known = parse_faults(v, o);
        for (size_t n = 0; v && !known && n < sizeof(numbers) / sizeof(numbers[0]); n++) {
            char *end;
            errno = 0;
            const long x = strtol(v, &end, 10);
            if (strcmp(a, numbers[n].name) == 0 && *v && !*end && !errno && x >= numbers[n].min && x <= 1 << 20) {
                *numbers[n].value = (int)x;
                known = true;
            }
        }
        if (!known) {
            fprintf(stderr, "moe_layer: bad option or value: %s%s%s\n", a, v ? " " : "", v ? v : "");
            usage(stderr);
            return 2;
        }
    }
    if (o->top_k > o->experts || o->top_k > 64) {
        fprintf(stderr, "moe_layer: --top-k must be at most --experts and 64\n");
        return 2;
    }
    return 0;
}

/* ---- the layer's tensors ---- */

typedef struct layer {
    int T, H, I, E, K, B;
    size_t P, max_blocks; /* moe_align's capacity (rows) and its blocks */
    bool fault_offset;
    moecl_context *ctx;
    cl_context cl;
    cl_command_queue queue;
    cl_kernel silu_and_mul;
    /* Inputs: x [T][H], router [E][H], w1 [E][2I][H] (gate rows, then up
     * rows), w2 [E][H][I]. */
    cl_mem x, router, w1, w2;
    /* Routing: logits [T][E], topk_weights f32 [T][K], topk_ids [T][K],
     * expert_counts [E], sorted_token_ids [P], slot_positions [T][K], and
     * `dispatch`: num_tokens_post_padded, then block_expert_ids
     * [max_blocks], so that one read brings both to the host. */
    cl_mem logits, topk_weights, topk_ids, expert_counts, sorted, slot_positions, dispatch;
    /* Rows in moe_align's order: xs [P][H], h [P][2I], g [P][I], y [P][H];
     * and the layer's output [T][H]. */
    cl_mem xs, h, g, y, out;
    /* The host side of the batched GEMMs. */
    int32_t *dispatch_host;
    size_t *a_off, *b_off, *c_off;
    float *alphas, *betas;
} layer;

static int fail_cl(const char *what, cl_int err)
{
    fprintf(stderr, "moe_layer: %s failed (OpenCL error %d)\n", what, err);
    return 1;
}

static int fail_moecl(const layer *l, const char *what, moecl_status st)
{
    fprintf(stderr, "moe_layer: %s: %s: %s\n", what, moecl_status_string(st), moecl_context_error(l->ctx));
    return 1;
}

static int fail_clblast(const char *what, CLBlastStatusCode st)
{
    fprintf(stderr, "moe_layer: %s failed (CLBlast status %d)\n", what, (int)st);
    return 1;
}

/* SiLU(gate) * up for row p of h = [gate | up], each half I wide (vLLM's
 * silu_and_mul; Mixtral's w1 and w3, Qwen3-MoE's gate_proj and up_proj).
 * The fault build drops the multiply. */
static const char silu_and_mul_source[] =
    "__kernel void silu_and_mul(__global const float *h, __global float *g, int inter)\n"
    "{\n"
    "    const size_t i = get_global_id(0), p = get_global_id(1), n = (size_t)inter;\n"
    "    const float gate = h[p * 2 * n + i], up = h[p * 2 * n + n + i];\n"
    "    const float silu = gate / (1.0f + exp(-gate));\n"
    "#ifdef FAULT_SILU_WITHOUT_MUL\n"
    "    g[p * n + i] = silu;\n"
    "#else\n"
    "    g[p * n + i] = silu * up;\n"
    "#endif\n"
    "}\n";

static int build_silu_and_mul(layer *l, bool fault)
{
    cl_int err;
    const char *src = silu_and_mul_source;
    cl_program prog = clCreateProgramWithSource(l->cl, 1, &src, NULL, &err);
    if (!prog)
        return fail_cl("clCreateProgramWithSource", err);
    cl_device_id dev = moecl_context_device(l->ctx);
    err = clBuildProgram(prog, 1, &dev, fault ? "-DFAULT_SILU_WITHOUT_MUL" : "", NULL, NULL);
    if (err != CL_SUCCESS) {
        char log[4096] = "";
        clGetProgramBuildInfo(prog, dev, CL_PROGRAM_BUILD_LOG, sizeof(log) - 1, log, NULL);
        fprintf(stderr, "moe_layer: building silu_and_mul failed (%d):\n%s\n", err, log);
        clReleaseProgram(prog);
        return 1;
    }
    l->silu_and_mul = clCreateKernel(prog, "silu_and_mul", &err);
    clReleaseProgram(prog); /* the kernel keeps it */
    return l->silu_and_mul ? 0 : fail_cl("clCreateKernel", err);
}

/* Deterministic inputs: splitmix64, uniform in [-scale, scale). */
static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

static float *random_tensor(size_t n, float scale, uint64_t *seed)
{
    float *v = malloc(n * sizeof(float));
    for (size_t i = 0; v && i < n; i++)
        v[i] = scale * ((float)(splitmix64(seed) >> 40) * 0x1p-23f - 1.0f);
    return v;
}

static cl_mem device_tensor(layer *l, size_t bytes, const void *init, cl_int *err)
{
    cl_mem m = clCreateBuffer(l->cl, CL_MEM_READ_WRITE | (init ? CL_MEM_COPY_HOST_PTR : 0), bytes ? bytes : 4,
                              (void *)init, err);
    /* Zeros in the GEMMs' outputs: CLBlast computes alpha * AB + beta * C,
     * and 0 * C is NaN where C holds a NaN's bits. */
    if (m && !init) {
        const float zero = 0.0f;
        *err = clEnqueueFillBuffer(l->queue, m, &zero, sizeof(zero), 0, bytes ? bytes : 4, 0, NULL, NULL);
    }
    return m;
}

/* The inputs (host copies kept in `host` for --dump), the buffers and the
 * silu_and_mul kernel. */
static int layer_create(layer *l, const options *o, const char *fault, moecl_context *ctx, float *host[4])
{
    *l = (layer){.T = o->tokens, .H = o->hidden, .I = o->inter, .E = o->experts, .K = o->top_k, .B = o->block};
    l->ctx = ctx;
    l->cl = moecl_context_cl_context(ctx);
    l->queue = moecl_context_queue(ctx);
    l->fault_offset = strcmp(fault, "offset") == 0;
    const size_t T = (size_t)l->T, H = (size_t)l->H, I = (size_t)l->I, E = (size_t)l->E, K = (size_t)l->K;
    const moecl_moe_align_desc align = moecl_moe_align_desc_init(l->T, l->K, l->E, l->B);
    l->P = (size_t)moecl_moe_align_max_padded(&align);
    l->max_blocks = l->P / (size_t)l->B;

    /* Logits and every GEMM's output near unit variance: a uniform in
     * [-s, s) has variance s^2 / 3, so s = 3 / sqrt(n) over n products of
     * inputs of variance 1/3 (x) gives about 1. */
    uint64_t seed = (uint64_t)o->seed;
    host[0] = random_tensor(T * H, 1.0f, &seed);
    host[1] = random_tensor(E * H, 3.0f / sqrtf((float)H), &seed);
    host[2] = random_tensor(E * 2 * I * H, 3.0f / sqrtf((float)H), &seed);
    host[3] = random_tensor(E * H * I, 3.0f / sqrtf((float)I), &seed);
    l->dispatch_host = malloc((1 + l->max_blocks) * sizeof(int32_t));
    l->a_off = malloc(l->max_blocks * sizeof(size_t));
    l->b_off = malloc(l->max_blocks * sizeof(size_t));
    l->c_off = malloc(l->max_blocks * sizeof(size_t));
    l->alphas = malloc(l->max_blocks * sizeof(float));
    l->betas = malloc(l->max_blocks * sizeof(float));
    if (!host[0] || !host[1] || !host[2] || !host[3] || !l->dispatch_host || !l->a_off || !l->b_off || !l->c_off ||
        !l->alphas || !l->betas) {
        fprintf(stderr, "moe_layer: out of host memory\n");
        return 1;
    }
    for (size_t b = 0; b < l->max_blocks; b++)
        l->alphas[b] = 1.0f, l->betas[b] = 0.0f;

    const struct {
        cl_mem *mem;
        size_t bytes;
        const void *init;
    } tensors[] = {
        {&l->x, T * H * 4, host[0]},
        {&l->router, E * H * 4, host[1]},
        {&l->w1, E * 2 * I * H * 4, host[2]},
        {&l->w2, E * H * I * 4, host[3]},
        {&l->logits, T * E * 4, NULL},
        {&l->topk_weights, T * K * 4, NULL},
        {&l->topk_ids, T * K * 4, NULL},
        {&l->expert_counts, E * 4, NULL},
        {&l->sorted, l->P * 4, NULL},
        {&l->slot_positions, T * K * 4, NULL},
        {&l->dispatch, (1 + l->max_blocks) * 4, NULL},
        {&l->xs, l->P * H * 4, NULL},
        {&l->h, l->P * 2 * I * 4, NULL},
        {&l->g, l->P * I * 4, NULL},
        {&l->y, l->P * H * 4, NULL},
        {&l->out, T * H * 4, NULL},
    };
    for (size_t i = 0; i < sizeof(tensors) / sizeof(tensors[0]); i++) {
        cl_int err;
        *tensors[i].mem = device_tensor(l, tensors[i].bytes, tensors[i].init, &err);
        if (!*tensors[i].mem || err != CL_SUCCESS)
            return fail_cl("creating a buffer", err);
    }
    return build_silu_and_mul(l, strcmp(fault, "silu") == 0);
}

static void layer_release(layer *l)
{
    cl_mem *mems[] = {&l->x,        &l->router,        &l->w1,   &l->w2,
                      &l->logits,   &l->topk_weights,  &l->topk_ids, &l->expert_counts,
                      &l->sorted,   &l->slot_positions, &l->dispatch, &l->xs,
                      &l->h,        &l->g,             &l->y,    &l->out};
    for (size_t i = 0; i < sizeof(mems) / sizeof(mems[0]); i++)
        if (*mems[i])
            clReleaseMemObject(*mems[i]);
    if (l->silu_and_mul)
        clReleaseKernel(l->silu_and_mul);
    free(l->dispatch_host);
    free(l->a_off);
    free(l->b_off);
    free(l->c_off);
    free(l->alphas);
    free(l->betas);
}

/* ---- the layer's steps, in order ---- */

#define BUF(m) ((moecl_buffer){(m), 0})

/* logits [T][E] = x [T][H] * router^T. */
static int router_gemm(layer *l, cl_event *done)
{
    CLBlastStatusCode st = CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, l->T, l->E,
                                        l->H, 1.0f, l->x, 0, l->H, l->router, 0, l->H, 0.0f, l->logits, 0, l->E,
                                        &l->queue, done);
    return st == CLBlastSuccess ? 0 : fail_clblast("the router GEMM", st);
}

/* Softmax, top k, renormalised (Mixtral, Qwen3-MoE's norm_topk_prob), and
 * moe_align's dispatch in one call. */
static int route(layer *l, cl_event logits, cl_event *done)
{
    moecl_topk_gating_desc desc = moecl_topk_gating_desc_init(l->T, l->E, l->K);
    desc.renormalize = true;
    const moecl_status st = moecl_route_dispatch(
        l->ctx, &desc, l->B, BUF(l->logits), BUF(NULL), BUF(l->topk_weights), BUF(l->topk_ids),
        BUF(l->expert_counts), BUF(l->sorted), (moecl_buffer){l->dispatch, 4}, BUF(l->dispatch),
        BUF(l->slot_positions), BUF(NULL), 1, &logits, done);
    return st == MOECL_SUCCESS ? 0 : fail_moecl(l, "moecl_route_dispatch", st);
}

/* xs [P][H]: slot s's row of x at its place in moe_align's order. */
static int permute(layer *l, cl_event routed, cl_event *done)
{
    const moecl_permute_desc desc = moecl_permute_desc_init(l->T, l->K, l->H, (uint32_t)l->P);
    const moecl_status st =
        moecl_permute(l->ctx, &desc, BUF(l->x), BUF(l->sorted), BUF(l->dispatch), BUF(l->xs), 1, &routed, done);
    return st == MOECL_SUCCESS ? 0 : fail_moecl(l, "moecl_permute", st);
}

/* num_tokens_post_padded and block_expert_ids to the host, for the batched
 * GEMMs' offsets; returns the number of blocks in *blocks. */
static int read_dispatch(layer *l, cl_event routed, size_t *blocks)
{
    const cl_int err = clEnqueueReadBuffer(l->queue, l->dispatch, CL_TRUE, 0, (1 + l->max_blocks) * 4,
                                           l->dispatch_host, 1, &routed, NULL);
    if (err != CL_SUCCESS)
        return fail_cl("reading block_expert_ids", err);
    *blocks = (size_t)l->dispatch_host[0] / (size_t)l->B;
    if (*blocks > l->max_blocks) {
        fprintf(stderr, "moe_layer: num_tokens_post_padded %d exceeds moe_align's capacity\n", l->dispatch_host[0]);
        return 1;
    }
    return 0;
}

/* One GEMM per block: out rows [b B, b B + B) = in rows times the block's
 * expert's weight [n][k], transposed. */
static int expert_gemm(layer *l, size_t blocks, size_t n, size_t k, cl_mem in, cl_mem weight, cl_mem out,
                       const char *what, cl_event *done)
{
    const size_t B = (size_t)l->B;
    for (size_t b = 0; b < blocks; b++) {
        size_t e = (size_t)l->dispatch_host[1 + b];
        if (l->fault_offset)
            e = (e + 1) % (size_t)l->E; /* the next expert's weights */
        l->a_off[b] = b * B * k;
        l->b_off[b] = e * n * k;
        l->c_off[b] = b * B * n;
    }
    const CLBlastStatusCode st = CLBlastSgemmBatched(
        CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, B, n, k, l->alphas, in, l->a_off, k, weight,
        l->b_off, k, l->betas, out, l->c_off, n, blocks, &l->queue, done);
    return st == CLBlastSuccess ? 0 : fail_clblast(what, st);
}

/* g [rows][I] = SiLU(h[:, :I]) * h[:, I:]. */
static int activation(layer *l, size_t rows, cl_event *done)
{
    const cl_int inter = l->I;
    cl_int err = clSetKernelArg(l->silu_and_mul, 0, sizeof(cl_mem), &l->h);
    err |= clSetKernelArg(l->silu_and_mul, 1, sizeof(cl_mem), &l->g);
    err |= clSetKernelArg(l->silu_and_mul, 2, sizeof(cl_int), &inter);
    const size_t global[2] = {(size_t)l->I, rows};
    if (err == CL_SUCCESS)
        err = clEnqueueNDRangeKernel(l->queue, l->silu_and_mul, 2, NULL, global, NULL, 0, NULL, done);
    return err == CL_SUCCESS ? 0 : fail_cl("silu_and_mul", err);
}

/* out [T][H] = sum over each token's slots of weight * y[slot's row]. */
static int combine(layer *l, cl_event down, cl_event *done)
{
    const moecl_combine_desc desc = moecl_combine_desc_init(l->T, l->K, l->H, (uint32_t)l->P);
    const moecl_status st = moecl_combine(l->ctx, &desc, BUF(l->y), BUF(l->topk_weights), BUF(l->slot_positions),
                                          BUF(NULL), BUF(l->out), 1, &down, done);
    return st == MOECL_SUCCESS ? 0 : fail_moecl(l, "moecl_combine", st);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

enum { STEP_ROUTER, STEP_ROUTE, STEP_PERMUTE, STEP_GATE_UP, STEP_ACT, STEP_DOWN, STEP_COMBINE, NUM_STEPS };
static const char *const step_names[NUM_STEPS] = {"router GEMM", "route_dispatch", "permute + read",
                                                  "gate_up GEMMs", "silu_and_mul", "down GEMMs", "combine"};

/* One layer, every command on the queue; returns when the output is
 * written. With `steps`, a clFinish after each step and its wall time in
 * steps[]. */
static int layer_forward(layer *l, double *steps)
{
    cl_event ev[NUM_STEPS] = {NULL};
    size_t blocks = 0;
    double t = now();
#define STEP(i, call)                                                                                               \
    do {                                                                                                           \
        if (call)                                                                                                  \
            goto fail;                                                                                             \
        if (steps) {                                                                                               \
            clFinish(l->queue);                                                                                    \
            const double t1 = now();                                                                               \
            steps[i] = t1 - t;                                                                                     \
            t = t1;                                                                                                \
        }                                                                                                          \
    } while (0)
    STEP(STEP_ROUTER, router_gemm(l, &ev[STEP_ROUTER]));
    STEP(STEP_ROUTE, route(l, ev[STEP_ROUTER], &ev[STEP_ROUTE]));
    STEP(STEP_PERMUTE, permute(l, ev[STEP_ROUTE], &ev[STEP_PERMUTE]) || read_dispatch(l, ev[STEP_ROUTE], &blocks));
    const size_t H = (size_t)l->H, I = (size_t)l->I;
    STEP(STEP_GATE_UP, blocks && expert_gemm(l, blocks, 2 * I, H, l->xs, l->w1, l->h, "the gate_up GEMMs",
                                             &ev[STEP_GATE_UP]));
    STEP(STEP_ACT, blocks && activation(l, blocks * (size_t)l->B, &ev[STEP_ACT]));
    STEP(STEP_DOWN, blocks && expert_gemm(l, blocks, H, I, l->g, l->w2, l->y, "the down GEMMs", &ev[STEP_DOWN]));
    /* The in-order queue puts the combine after the down GEMMs; its wait
     * list names the last event there is. */
    cl_event last = ev[STEP_DOWN] ? ev[STEP_DOWN] : ev[STEP_PERMUTE];
    STEP(STEP_COMBINE, combine(l, last, &ev[STEP_COMBINE]));
#undef STEP
    const cl_int err = clWaitForEvents(1, &ev[STEP_COMBINE]);
    for (int i = 0; i < NUM_STEPS; i++)
        if (ev[i])
            clReleaseEvent(ev[i]);
    return err == CL_SUCCESS ? 0 : fail_cl("waiting for the layer", err);
fail:
    clFinish(l->queue);
    for (int i = 0; i < NUM_STEPS; i++)
        if (ev[i])
            clReleaseEvent(ev[i]);
    return 1;
}

/* ---- report and dump ---- */

static int compare_doubles(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int write_file(const char *dir, const char *name, const void *data, size_t bytes)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    const bool ok = f && fwrite(data, 1, bytes, f) == bytes;
    if (f && fclose(f) != 0)
        return fprintf(stderr, "moe_layer: writing %s failed\n", path), 1;
    if (!ok)
        return fprintf(stderr, "moe_layer: writing %s failed: %s\n", path, strerror(errno)), 1;
    return 0;
}

/* Inputs as generated, then the device's logits, routing and output, raw
 * little-endian (f32, int32); shape.txt holds the sizes. */
static int dump(const layer *l, const char *dir, float *const host[4], const float *out)
{
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1)
        return fprintf(stderr, "moe_layer: --dump writes little-endian files; this host is big-endian\n"), 1;
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return fprintf(stderr, "moe_layer: mkdir %s: %s\n", dir, strerror(errno)), 1;
    const size_t T = (size_t)l->T, H = (size_t)l->H, I = (size_t)l->I, E = (size_t)l->E, K = (size_t)l->K;
    float *logits = malloc(T * E * 4), *weights = malloc(T * K * 4);
    int32_t *ids = malloc(T * K * 4);
    int rc = 1;
    if (logits && weights && ids && clEnqueueReadBuffer(l->queue, l->logits, CL_TRUE, 0, T * E * 4, logits, 0, NULL,
                                                        NULL) == CL_SUCCESS &&
        clEnqueueReadBuffer(l->queue, l->topk_weights, CL_TRUE, 0, T * K * 4, weights, 0, NULL, NULL) == CL_SUCCESS &&
        clEnqueueReadBuffer(l->queue, l->topk_ids, CL_TRUE, 0, T * K * 4, ids, 0, NULL, NULL) == CL_SUCCESS) {
        char shape[256];
        const int n = snprintf(shape, sizeof(shape), "tokens %d\nhidden %d\ninter %d\nexperts %d\ntop_k %d\nblock %d\n",
                               l->T, l->H, l->I, l->E, l->K, l->B);
        rc = write_file(dir, "shape.txt", shape, (size_t)n) || write_file(dir, "x.f32", host[0], T * H * 4) ||
             write_file(dir, "router.f32", host[1], E * H * 4) ||
             write_file(dir, "w1.f32", host[2], E * 2 * I * H * 4) ||
             write_file(dir, "w2.f32", host[3], E * H * I * 4) ||
             write_file(dir, "logits.f32", logits, T * E * 4) ||
             write_file(dir, "topk_weights.f32", weights, T * K * 4) ||
             write_file(dir, "topk_ids.i32", ids, T * K * 4) || write_file(dir, "out.f32", out, T * H * 4);
    } else {
        fprintf(stderr, "moe_layer: reading the routing back for --dump failed\n");
    }
    free(logits);
    free(weights);
    free(ids);
    return rc;
}

/* The layer with one fault ("none": none) on ctx: --warmup and --runs
 * layers, the report, and the dump to dir (NULL: none). */
static int run_layer(moecl_context *ctx, const options *o, const char *fault, const char *dir)
{
    layer l = {0};
    float *host[4] = {NULL};
    float *out = malloc((size_t)o->tokens * (size_t)o->hidden * 4);
    int rc = out ? layer_create(&l, o, fault, ctx, host) : 1;
    char device[256] = "", driver[128] = "";
    clGetDeviceInfo(moecl_context_device(ctx), CL_DEVICE_NAME, sizeof(device), device, NULL);
    clGetDeviceInfo(moecl_context_device(ctx), CL_DRIVER_VERSION, sizeof(driver), driver, NULL);
    if (!rc)
        printf("moe_layer: moecl %s on %s (driver %s)\n"
               "  tokens %d, hidden %d, intermediate %d, experts %d, top %d, block %d, seed %d%s%s\n",
               moecl_version(), device, driver, l.T, l.H, l.I, l.E, l.K, l.B, o->seed,
               strcmp(fault, "none") ? ", fault " : "", strcmp(fault, "none") ? fault : "");

    /* The first layer builds the kernels (moecl's from its disk cache where
     * it has them; CLBlast compiles its own once a process, at the first
     * run of a --fault list). */
    double *times = calloc((size_t)o->runs, sizeof(double));
    double *step_times = calloc((size_t)o->runs * NUM_STEPS, sizeof(double));
    if (!rc && (!times || !step_times))
        rc = 1;
    double first = 0.0;
    for (int r = 0; !rc && r < o->warmup + o->runs; r++) {
        const double t0 = now();
        rc = layer_forward(&l, NULL);
        const double t = now() - t0;
        if (r == 0)
            first = t;
        if (r >= o->warmup)
            times[r - o->warmup] = t;
    }
    for (int r = 0; !rc && o->steps && r < o->runs; r++)
        rc = layer_forward(&l, step_times + (size_t)r * NUM_STEPS);
    if (!rc) {
        const cl_int err = clEnqueueReadBuffer(l.queue, l.out, CL_TRUE, 0, (size_t)l.T * (size_t)l.H * 4, out, 0,
                                               NULL, NULL);
        rc = err == CL_SUCCESS ? 0 : fail_cl("reading the output", err);
    }
    if (!rc) {
        double sum = 0.0, sum_abs = 0.0;
        for (size_t i = 0; i < (size_t)l.T * (size_t)l.H; i++)
            sum += out[i], sum_abs += fabs(out[i]);
        const size_t blocks = (size_t)l.dispatch_host[0] / (size_t)l.B;
        printf("  %zu blocks of %d rows (%d slots, %d rows with padding, capacity %zu)\n", blocks, l.B, l.T * l.K,
               l.dispatch_host[0], l.P);
        printf("output checksum: sum %.9e, sum of |out| %.9e\n", sum, sum_abs);
        printf("first layer (kernel builds included): %.3f ms\n", first * 1e3);
        printf("layer time: median %.3f ms of %d runs after %d warm-up (wall, clFinish'd)\n",
               median(times, o->runs) * 1e3, o->runs, o->warmup);
        for (int s = 0; o->steps && s < NUM_STEPS; s++) {
            for (int r = 0; r < o->runs; r++)
                times[r] = step_times[(size_t)r * NUM_STEPS + (size_t)s];
            printf("  %-16s median %.3f ms\n", step_names[s], median(times, o->runs) * 1e3);
        }
        if (dir)
            rc = dump(&l, dir, host, out);
        if (!rc && dir)
            printf("dumped to %s\n", dir);
    }
    if (l.ctx)
        layer_release(&l);
    for (int i = 0; i < 4; i++)
        free(host[i]);
    free(out);
    free(times);
    free(step_times);
    return rc;
}

int main(int argc, char **argv)
{
    options o;
    const int parsed = parse_options(argc, argv, &o);
    if (parsed)
        return parsed < 0 ? 0 : parsed;

    moecl_context *ctx;
    moecl_status st = moecl_context_create(o.device, &ctx);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "moe_layer: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        return st == MOECL_ERROR_NO_DEVICE ? 77 : 1;
    }
    /* With a list, DIR holds a folder per fault. */
    if (o.dump && o.num_faults > 1 && mkdir(o.dump, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "moe_layer: mkdir %s: %s\n", o.dump, strerror(errno));
        moecl_context_destroy(ctx);
        return 1;
    }
    int rc = 0;
    for (int f = 0; !rc && f < o.num_faults; f++) {
        char dir[4096] = "";
        if (o.dump && o.num_faults > 1)
            snprintf(dir, sizeof(dir), "%s/%s", o.dump, o.faults[f]);
        else if (o.dump)
            snprintf(dir, sizeof(dir), "%s", o.dump);
        rc = run_layer(ctx, &o, o.faults[f], o.dump ? dir : NULL);
    }
    moecl_context_destroy(ctx);
    return rc;
}
