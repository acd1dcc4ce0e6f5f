/* checkvariants: every kernel variant the device accepts, against the
 * float64 reference (tests/reference.c), in one process, as dav1d's
 * checkasm runs every optimised function against its C reference.
 *
 * For each op (top-k gating, the grounded router, moe_align,
 * route_dispatch with the grounded route, the expert-parallel layout,
 * permute with combine) the
 * variants come from the library itself: the variant override's words
 * (src/override.c: class, align, ep, ep_wg, ep_groups, grounded, tile)
 * select a context's paths, and moecl_launch_force forces a configuration
 * of top-k gating or the grounded router on a context: every power-of-two
 * team with one row and with the rule's rows, the rows kernel, the
 * grounded router's tiled configurations (moecl_grounded_tile_configs)
 * and its tensor-core kernel. A forced configuration counts for a shape
 * where moecl_launch_resolve takes it (the op's check on this device);
 * a path where the context's plan runs it. A variant no shape accepts is
 * reported as refused, not checked.
 *
 * Each variant runs each shape it accepts on fresh random inputs (--seed
 * repeats a run), on adversarial rows (exact ties, scores that underflow
 * to 0, NaN and infinities, crowded tops), with one token and none, into
 * poisoned outputs (0xFF: NaN and -1; 0xAB) with poisoned bytes before and
 * after each output, and is compared with the reference's checker. A
 * failure names the op, the variant (its override or configuration text),
 * the shape and the case; the exit status is then 1.
 *
 * Usage: checkvariants [--seed N] [--op NAME] [--variant TEXT] [--small]
 *                      [--bench] [--iterations N] [--list] [--verbose]
 * --variant keeps the variants whose text contains TEXT; --small keeps the
 * shapes small (oclgrind, Mesa rusticl); --bench times each variant on a
 * representative shape after its check (moecl-bench's method: the median
 * device time of profiled calls, from a marker before the call to the end
 * of its last command, and the wall time of calls back to back on a queue
 * without profiling). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "reference.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* ---- options, random numbers, reporting ---- */

static struct {
    uint64_t seed;
    const char *op, *variant;
    bool small, bench, list, verbose;
    int iterations;
} opt;

typedef struct rng {
    uint64_t state;
} rng;

static uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A generator for one (op, variant, shape, case): the same inputs for the
 * same seed, whatever else runs. */
static rng rng_for(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t x = opt.seed ^ (a * 0xd1b54a32d192ed03ull) ^ (b * 0x8cb92ba72f3d8dd7ull) ^ (c * 0x9fb21c651e98df25ull);
    return (rng){splitmix(&x)};
}

static uint32_t rand_u32(rng *r) { return (uint32_t)(splitmix(&r->state) >> 32); }
static double rand_uniform(rng *r) { return (splitmix(&r->state) >> 11) * 0x1.0p-53; }
static float randn(rng *r)
{
    const double u1 = rand_uniform(r) + 0x1.0p-54, u2 = rand_uniform(r);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "checkvariants: out of host memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

static void die(const char *what, const moecl_context *ctx, int st)
{
    fprintf(stderr, "checkvariants: %s: %s (%d): %s\n", what, moecl_status_string(st), st, moecl_context_error(ctx));
    exit(2);
}

/* A variant: the override its context is created under, and the
 * configuration forced on the op (top-k gating, grounded router). */
typedef struct variant {
    char name[200];
    char override[128];
    bool forced;
    moecl_launch_config config;
} variant;

/* One op's tally. */
typedef struct tally {
    int variants, passed, refused, runs;
    bool variant_failed;
} tally;

static int failures;

/* A failed case: everything needed to find the variant again. */
static void fail(tally *t, const char *op, const variant *v, const char *shape, const char *what, const char *fmt, ...)
{
    char msg[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    printf("FAIL %s variant [%s] shape [%s] case %s (seed %llu): %s\n", op, v->name, shape, what,
           (unsigned long long)opt.seed, msg);
    fflush(stdout);
    t->variant_failed = true;
    failures++;
}

/* ---- contexts: one per override text, all on one cl_context ---- */

static cl_context cl_ctx;
static cl_device_id cl_dev;
static cl_command_queue queue, plain_queue; /* plain_queue: no profiling (--bench's wall time) */

typedef struct ctx_entry {
    char text[128];
    moecl_context *ctx, *plain;
} ctx_entry;
static ctx_entry ctxs[96];
static int num_ctxs;

/* The context of override text (created on first use); plain: the one on
 * the queue without profiling. */
static moecl_context *context_for(const char *text, bool plain)
{
    for (int i = 0; i < num_ctxs; i++)
        if (strcmp(ctxs[i].text, text) == 0)
            return plain ? ctxs[i].plain : ctxs[i].ctx;
    if (num_ctxs == (int)COUNT(ctxs)) {
        fprintf(stderr, "checkvariants: too many contexts\n");
        exit(2);
    }
    ctx_entry *e = &ctxs[num_ctxs++];
    snprintf(e->text, sizeof(e->text), "%s", text);
    moecl_status st = moecl_override_set(text);
    if (st != MOECL_SUCCESS)
        die(text, NULL, st);
    if ((st = moecl_context_create_from_cl(cl_ctx, cl_dev, queue, &e->ctx)) != MOECL_SUCCESS)
        die("moecl_context_create_from_cl", NULL, st);
    e->plain = e->ctx;
    if (plain_queue && (st = moecl_context_create_from_cl(cl_ctx, cl_dev, plain_queue, &e->plain)) != MOECL_SUCCESS)
        die("moecl_context_create_from_cl", NULL, st);
    moecl_override_set(NULL);
    return plain ? e->plain : e->ctx;
}

/* Force v's configuration (v NULL or unforced: none) for op on ctx and,
 * with --bench, on its plain twin. */
static void force(const variant *v, moecl_op op)
{
    moecl_launch_force(context_for(v->override, false), op, v->forced ? &v->config : NULL);
    if (opt.bench)
        moecl_launch_force(context_for(v->override, true), op, v->forced ? &v->config : NULL);
}

static void unforce(const variant *v, moecl_op op)
{
    moecl_launch_force(context_for(v->override, false), op, NULL);
    if (opt.bench)
        moecl_launch_force(context_for(v->override, true), op, NULL);
}

static bool selected(const variant *v) { return !opt.variant || strstr(v->name, opt.variant); }

/* A variant's end: counted where some shape accepted it. */
static void finish_variant(tally *tl, const char *op, const variant *v, int accepted)
{
    if (opt.list)
        return;
    if (!accepted) {
        tl->refused++;
        if (opt.verbose)
            printf("%s [%s]: refused by the device for every shape\n", op, v->name);
    } else {
        tl->variants++;
        tl->passed += !tl->variant_failed;
        if (opt.verbose)
            printf("%s [%s]: %d shapes, %s\n", op, v->name, accepted, tl->variant_failed ? "FAILED" : "ok");
    }
    fflush(stdout);
}

/* ---- buffers: poison before and after each tensor ---- */

#define FRONT 64
#define SLACK 64

typedef struct dbuf {
    cl_mem mem;
    size_t size;
    unsigned char poison;
} dbuf;

static dbuf make_buf(const void *data, size_t size, unsigned char poison)
{
    const size_t total = FRONT + size + SLACK;
    unsigned char *fill = xmalloc(total);
    memset(fill, poison, total);
    if (data && size)
        memcpy(fill + FRONT, data, size);
    cl_int err;
    dbuf b = {clCreateBuffer(cl_ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, total, fill, &err), size, poison};
    free(fill);
    if (!b.mem) {
        fprintf(stderr, "checkvariants: clCreateBuffer(%zu bytes): %d\n", total, err);
        exit(2);
    }
    return b;
}

static moecl_buffer at(const dbuf *b) { return (moecl_buffer){b->mem, b->mem ? FRONT : 0}; }
static const dbuf absent = {NULL, 0, 0};

static void release(dbuf *b)
{
    if (b->mem)
        clReleaseMemObject(b->mem);
    b->mem = NULL;
}

/* Read an output back; false (and why in msg) where a byte before or
 * after it changed. */
static bool read_buf(const dbuf *b, void *out, const char *name, char *msg, size_t msg_size)
{
    if (!b->mem)
        return true;
    const size_t total = FRONT + b->size + SLACK;
    unsigned char *all = xmalloc(total);
    cl_int err = clEnqueueReadBuffer(queue, b->mem, CL_TRUE, 0, total, all, 0, NULL, NULL);
    if (err != CL_SUCCESS) {
        snprintf(msg, msg_size, "reading %s: %d", name, err);
        free(all);
        return false;
    }
    for (size_t i = 0; i < total; i++) {
        if (i == FRONT)
            i += b->size;
        if (i < total && all[i] != b->poison) {
            snprintf(msg, msg_size, "%s: byte %zd %s the tensor was written (0x%02x, poison 0x%02x)", name,
                     i < FRONT ? (ptrdiff_t)(FRONT - i) : (ptrdiff_t)(i - FRONT - b->size),
                     i < FRONT ? "before" : "after", all[i], b->poison);
            free(all);
            return false;
        }
    }
    if (out)
        memcpy(out, all + FRONT, b->size);
    free(all);
    return true;
}

/* Poisons in turn: 0xFF (NaN weights, id -1) and 0xAB. */
static unsigned char poison_of(unsigned c) { return c % 2 ? 0xAB : 0xFF; }

static void store(moecl_dtype dtype, void *data, size_t i, float v)
{
    if (dtype == MOECL_F32)
        ((float *)data)[i] = v;
    else if (dtype == MOECL_F16)
        ((uint16_t *)data)[i] = ref_float_to_half(v);
    else
        ((uint16_t *)data)[i] = ref_float_to_bf16(v);
}

static const char *dtype_name(moecl_dtype t) { return t == MOECL_F32 ? "f32" : t == MOECL_F16 ? "f16" : "bf16"; }

/* ---- adversarial rows ---- */

/* Kinds of rows: exact ties, underflowed scores, NaN and infinities,
 * huge values, crowded tops. Returns whether the row ties exactly where
 * it ties (the ids must then equal the reference's, lower index first). */
enum { SPECIAL_KINDS = 17 };

static bool special_row(rng *r, int kind, float *row, uint32_t n)
{
    bool exact = true;
    for (uint32_t e = 0; e < n; e++)
        row[e] = randn(r);
    switch (kind) {
    case 0: /* all equal */
        for (uint32_t e = 0; e < n; e++)
            row[e] = 0.5f;
        break;
    case 1: /* all zero, +0 and -0 */
        for (uint32_t e = 0; e < n; e++)
            row[e] = (e & 1) ? -0.0f : 0.0f;
        break;
    case 2: /* duplicates from a small set */
        for (uint32_t e = 0; e < n; e++)
            row[e] = (float)((int)(rand_u32(r) % 4) - 1);
        break;
    case 3: /* one NaN */
        row[rand_u32(r) % n] = NAN;
        exact = false;
        break;
    case 4: /* all NaN */
        for (uint32_t e = 0; e < n; e++)
            row[e] = NAN;
        break;
    case 5: /* one +inf */
        row[rand_u32(r) % n] = INFINITY;
        exact = false;
        break;
    case 6: /* every third -inf */
        for (uint32_t e = 0; e < n; e += 3)
            row[e] = -INFINITY;
        exact = false;
        break;
    case 7: /* all -inf */
        for (uint32_t e = 0; e < n; e++)
            row[e] = -INFINITY;
        break;
    case 8: /* +-1e30 only */
        for (uint32_t e = 0; e < n; e++)
            row[e] = (rand_u32(r) & 1) ? 1e30f : -1e30f;
        break;
    case 9: /* NaN, +inf and -inf together */
        row[0] = NAN;
        row[n / 2] = INFINITY;
        row[n - 1] = -INFINITY;
        exact = false;
        break;
    case 10: /* scores that underflow to 0, logits rising with the index */
        for (uint32_t e = 0; e < n; e++)
            row[e] = -130.0f - (float)(n - e);
        row[n / 2] = 0.0f;
        break;
    case 11: /* [0, -300, -200, -250] repeated: underflow under softmax */
        for (uint32_t e = 0; e < n; e++)
            row[e] = (const float[]){0.0f, -300.0f, -200.0f, -250.0f}[e % 4];
        break;
    case 12: /* two maxima at 1e30 */
        row[n / 3] = 1e30f;
        row[n - 1] = 1e30f;
        exact = false;
        break;
    case 13: /* crowded: a grid of quarters, exact ties at every place */
        for (uint32_t e = 0; e < n; e++)
            row[e] = (float)(floor(40.0 * rand_uniform(r)) / 4.0);
        break;
    case 14: /* crowded: uniform [0, 10) */
        for (uint32_t e = 0; e < n; e++)
            row[e] = (float)(10.0 * rand_uniform(r));
        exact = false;
        break;
    case 15: /* near-ties: a third within 2^-16 of 9 */
        for (uint32_t e = 0; e < n; e++) {
            const double u = rand_uniform(r);
            row[e] = rand_u32(r) % 3 == 0 ? 9.0f + (float)ldexp(u, -16) : (float)(8.0 * u);
        }
        exact = false;
        break;
    default: /* huge and tiny magnitudes together */
        for (uint32_t e = 0; e < n; e++)
            row[e] = (e % 3 == 0 ? 1e-40f : e % 3 == 1 ? 3e38f : -3e38f) * (rand_u32(r) & 1 ? 1 : -1);
        exact = false;
        break;
    }
    return exact;
}

/* The cases every shape runs: fresh random rows, the adversarial rows,
 * one token, no token, many tokens. */
typedef enum case_kind { CASE_RANDOM, CASE_SPECIAL, CASE_ONE, CASE_NONE, CASE_MANY, NUM_CASES } case_kind;
static const char *const case_names[NUM_CASES] = {"random", "adversarial", "one-token", "no-tokens", "many-tokens"};

/* ---- timing (--bench) ---- */

typedef moecl_status (*call_fn)(moecl_context *ctx, const void *state, cl_uint num_wait, const cl_event *wait,
                                cl_event *done);

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* moecl-bench's figures: the median (p10, p90) device time of profiled
 * calls, each from a marker enqueued before it to the end of its last
 * command, and the wall time per call of calls back to back on a queue
 * without profiling. */
static void bench(const char *op, const variant *v, const char *shape, moecl_context *ctx, moecl_context *plain,
                  call_fn call, const void *state)
{
    const int iterations = opt.iterations, wall_calls = opt.iterations * 4;
    double *t = xmalloc(sizeof(double) * (size_t)iterations);
    moecl_status st;
    for (int i = -3; i < iterations; i++) {
        cl_event marker, ev;
        if (clEnqueueMarkerWithWaitList(queue, 0, NULL, &marker) != CL_SUCCESS)
            die("clEnqueueMarkerWithWaitList", ctx, MOECL_ERROR_UNSUPPORTED);
        if ((st = call(ctx, state, 1, &marker, &ev)) != MOECL_SUCCESS)
            die(op, ctx, st);
        clWaitForEvents(1, &ev);
        cl_ulong start = 0, end = 0;
        clGetEventProfilingInfo(marker, CL_PROFILING_COMMAND_END, sizeof(start), &start, NULL);
        clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_END, sizeof(end), &end, NULL);
        if (i >= 0)
            t[i] = (double)(end - start) / 1e3;
        clReleaseEvent(marker);
        clReleaseEvent(ev);
    }
    qsort(t, (size_t)iterations, sizeof(double), cmp_double);
    for (int i = 0; i < 3; i++)
        if ((st = call(plain, state, 0, NULL, NULL)) != MOECL_SUCCESS)
            die(op, plain, st);
    clFinish(plain_queue);
    const double t0 = now_s();
    for (int i = 0; i < wall_calls; i++)
        if ((st = call(plain, state, 0, NULL, NULL)) != MOECL_SUCCESS)
            die(op, plain, st);
    clFinish(plain_queue);
    const double wall_us = (now_s() - t0) * 1e6 / wall_calls;
    printf("bench %-15s %-58s %-34s device %10.2f us (p10 %.2f, p90 %.2f)  wall %10.2f us\n", op, v->name, shape,
           t[iterations / 2], t[iterations / 10], t[iterations * 9 / 10], wall_us);
    fflush(stdout);
    free(t);
}

/* ---- top-k gating ---- */

typedef struct topk_shape {
    uint32_t experts, k, groups, topk_group;
    moecl_group_score group_score;
    moecl_dtype dtype;
    moecl_scoring scoring;
    moecl_weighting weighting;
    bool bias, renormalize, zero_fill, floor;
    float scale;
    bool large; /* left out with --small */
} topk_shape;

/* The smallest request; softmax weights without renormalising, which
 * carry the team's sum over the whole row (100 experts: teams of 16 and
 * more have lanes part full and lanes empty); an odd expert count with
 * sqrt(softplus) and a floor; DeepSeek-V3's grouped selection; the
 * largest request. */
static const topk_shape topk_shapes[] = {
    {1, 1, 0, 0, MOECL_GROUP_SCORE_MAX, MOECL_F32, MOECL_SCORING_SOFTMAX, MOECL_WEIGHTS_SCORE, false, false, false, false,
     1.0f, false},
    {100, 4, 0, 0, MOECL_GROUP_SCORE_MAX, MOECL_F32, MOECL_SCORING_SOFTMAX, MOECL_WEIGHTS_SCORE, false, false, false,
     false, 1.0f, false},
    {160, 6, 0, 0, MOECL_GROUP_SCORE_MAX, MOECL_BF16, MOECL_SCORING_SQRTSOFTPLUS, MOECL_WEIGHTS_SOFTMAX_CHOSEN, true,
     true, false, true, 1.0f, false},
    {256, 8, 8, 4, MOECL_GROUP_SCORE_TOP2_SUM, MOECL_F16, MOECL_SCORING_SIGMOID, MOECL_WEIGHTS_SCORE, true, true, false,
     false, 2.5f, false},
    {4096, 64, 0, 0, MOECL_GROUP_SCORE_MAX, MOECL_F32, MOECL_SCORING_SOFTMAX, MOECL_WEIGHTS_SCORE, false, false, false,
     false, 1.0f, true},
};

static moecl_topk_gating_desc topk_desc(const topk_shape *s, uint32_t tokens)
{
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens, s->experts, s->k);
    d.num_expert_groups = s->groups;
    d.topk_group = s->topk_group;
    d.group_score = s->group_score;
    d.gating_dtype = s->dtype;
    d.scoring = s->scoring;
    d.weighting = s->weighting;
    d.renormalize = s->renormalize;
    d.routed_scaling_factor = s->scale;
    d.group_fill = s->zero_fill ? MOECL_GROUP_FILL_ZERO : MOECL_GROUP_FILL_NEG_INF;
    d.renormalize_floor = s->floor ? 6.103515625e-5f : 0.0f;
    return d;
}

static void topk_shape_text(const topk_shape *s, char *buf, size_t size)
{
    static const char *const scorings[] = {"softmax", "sigmoid", "sqrtsoftplus", "raw"};
    snprintf(buf, size, "E=%u k=%u %s %s%s%s%s", s->experts, s->k, dtype_name(s->dtype), scorings[s->scoring],
             s->bias ? " bias" : "", s->groups ? " groups=8/4" : "", s->renormalize ? " renormalize" : "");
}

/* Tokens of a case: about two work-groups and a part of a third for
 * random rows, two of each adversarial kind, many for the large run. */
static uint32_t tokens_of(case_kind c, uint32_t experts)
{
    switch (c) {
    case CASE_RANDOM:
        return opt.small ? 19 : 67;
    case CASE_SPECIAL:
        return 2 * SPECIAL_KINDS;
    case CASE_ONE:
        return 1;
    case CASE_NONE:
        return 0;
    default:
        return experts >= 1024 ? 131 : 2053;
    }
}

/* Rows of case c: random, or adversarial (exact[t] set where ids must
 * match exactly). */
static void fill_rows(rng *r, case_kind c, moecl_dtype dtype, void *data, uint32_t tokens, uint32_t n, float scale,
                      bool *exact)
{
    float *row = xmalloc(n * sizeof(float));
    for (uint32_t t = 0; t < tokens; t++) {
        bool ex = false;
        if (c == CASE_SPECIAL)
            ex = special_row(r, (int)(t % SPECIAL_KINDS), row, n);
        else
            for (uint32_t e = 0; e < n; e++)
                row[e] = randn(r) * scale;
        if (exact)
            exact[t] = ex;
        for (uint32_t e = 0; e < n; e++)
            store(dtype, data, (size_t)t * n + e, row[e]);
    }
    free(row);
}

typedef struct topk_call {
    moecl_topk_gating_desc d;
    dbuf gating, bias, w, ids;
} topk_call;

static moecl_status topk_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w, cl_event *done)
{
    const topk_call *c = state;
    return moecl_topk_gating(ctx, &c->d, at(&c->gating), at(&c->bias), at(&c->w), at(&c->ids), nw, w, done);
}

/* The top-k variants: the rule of each launch class, then every
 * configuration moecl_launch_force can ask for: the rows kernel (one row,
 * the rules' rows counts) and the team kernel, every power of two up to
 * MOECL_LAUNCH_MAX_TEAM, one row a work-group and the rule's rows. */
static int topk_variants(variant *v, int max)
{
    int n = 0;
    static const char *const classes[] = {"class=cpu", "class=gpu"};
    for (size_t i = 0; i < COUNT(classes); i++) {
        v[n] = (variant){{0}, {0}, false, {0}};
        snprintf(v[n].name, sizeof(v[n].name), "%s", classes[i]);
        snprintf(v[n].override, sizeof(v[n].override), "%s", classes[i]);
        n++;
    }
    moecl_launch_config configs[64];
    int nc = 0;
    static const unsigned rows_counts[] = {1, 8, 64};
    for (size_t i = 0; i < COUNT(rows_counts); i++)
        configs[nc++] = (moecl_launch_config){MOECL_KERNEL_ROWS, 1, rows_counts[i], 0, {0}};
    for (unsigned team = 2; team <= MOECL_LAUNCH_MAX_TEAM; team *= 2) {
        configs[nc++] = (moecl_launch_config){MOECL_KERNEL_TEAM, team, 1, 0, {0}};
        if (team < 128)
            configs[nc++] = (moecl_launch_config){MOECL_KERNEL_TEAM, team, 128 / team, 0, {0}};
    }
    for (int i = 0; i < nc && n < max; i++) {
        v[n] = (variant){{0}, "class=gpu", true, configs[i]};
        moecl_launch_config_text(&configs[i], v[n].name, sizeof(v[n].name));
        n++;
    }
    return n;
}

/* Whether ctx launches v for s (a forced configuration its check takes). */
static bool topk_accepts(moecl_context *ctx, const variant *v, const topk_shape *s)
{
    if (!v->forced)
        return true;
    const moecl_topk_gating_desc d = topk_desc(s, 1);
    moecl_launch_key key;
    moecl_launch_config config;
    return moecl_topk_gating_launch(ctx, &d, &key, &config) == MOECL_SOURCE_FORCED &&
           moecl_launch_config_equal(&config, &v->config);
}

static void topk_check_case(tally *tl, moecl_context *ctx, const variant *v, const topk_shape *s, const char *shape,
                            case_kind c, unsigned vi, unsigned si)
{
    rng r = rng_for(1, vi * 16 + si, c);
    const uint32_t tokens = tokens_of(c, s->experts);
    topk_call call = {topk_desc(s, tokens), absent, absent, absent, absent};
    const size_t n = (size_t)tokens * s->experts, nk = (size_t)tokens * s->k, in_size = ref_dtype_size(s->dtype);
    void *gating = xmalloc(n * in_size);
    bool *exact = xmalloc(tokens + 1);
    fill_rows(&r, c, s->dtype, gating, tokens, s->experts, s->scoring == MOECL_SCORING_SOFTMAX ? 2.0f : 4.0f, exact);
    float *bias = NULL;
    if (s->bias) {
        bias = xmalloc(s->experts * sizeof(float));
        for (uint32_t e = 0; e < s->experts; e++)
            bias[e] = c == CASE_SPECIAL && e % 2 ? 0.0f : 0.1f * randn(&r);
    }
    const unsigned char poison = poison_of(c);
    call.gating = make_buf(gating, n * in_size, 0xFF);
    if (bias)
        call.bias = make_buf(bias, s->experts * sizeof(float), 0xFF);
    call.w = make_buf(NULL, nk * 4, poison);
    call.ids = make_buf(NULL, nk * 4, poison);
    float *w = xmalloc(nk * 4);
    int32_t *ids = xmalloc(nk * 4);
    char msg[1200] = "";
    moecl_status st = topk_run(ctx, &call, 0, NULL, NULL);
    tl->runs++;
    if (st != MOECL_SUCCESS) {
        fail(tl, "topk_gating", v, shape, case_names[c], "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    } else if (clFinish(queue) != CL_SUCCESS || !read_buf(&call.w, w, "topk_weights", msg, sizeof(msg)) ||
               !read_buf(&call.ids, ids, "topk_ids", msg, sizeof(msg))) {
        fail(tl, "topk_gating", v, shape, case_names[c], "%s", msg);
    } else if (tokens == 0) {
        /* nothing written: read_buf checked the slack; the tensors are empty */
    } else if (ref_check_topk_gating(&call.d, gating, bias, w, ids, msg, sizeof(msg))) {
        fail(tl, "topk_gating", v, shape, case_names[c], "tokens %u: %s", tokens, msg);
    } else if (c == CASE_SPECIAL && !bias) {
        /* Exact ties stay exact only without a bias (a float64 sum can
         * separate what fp32 ties). */
        float *rw = xmalloc(nk * 4);
        int32_t *rid = xmalloc(nk * 4);
        ref_topk_gating(&call.d, gating, bias, rw, rid);
        for (size_t j = 0; j < nk; j++)
            if (exact[j / s->k] && ids[j] != rid[j]) {
                fail(tl, "topk_gating", v, shape, case_names[c],
                     "row %zu (adversarial kind %zu, exact ties): position %zu id %d, reference %d", j / s->k,
                     (j / s->k) % SPECIAL_KINDS, j % s->k, ids[j], rid[j]);
                break;
            }
        free(rw);
        free(rid);
    }
    if (opt.bench && c == (opt.small ? CASE_RANDOM : CASE_MANY) && !tl->variant_failed)
        bench("topk_gating", v, shape, ctx, context_for(v->override, true), topk_run, &call);
    release(&call.gating);
    release(&call.bias);
    release(&call.w);
    release(&call.ids);
    free(gating);
    free(exact);
    free(bias);
    free(w);
    free(ids);
}

static void check_topk(tally *tl)
{
    variant vs[64];
    const int nv = topk_variants(vs, 64);
    for (int vi = 0; vi < nv; vi++) {
        const variant *v = &vs[vi];
        if (!selected(v))
            continue;
        moecl_context *ctx = context_for(v->override, false);
        force(v, MOECL_OP_TOPK_GATING);
        int accepted = 0;
        tl->variant_failed = false;
        for (size_t si = 0; si < COUNT(topk_shapes); si++) {
            const topk_shape *s = &topk_shapes[si];
            if ((opt.small && s->large) || !topk_accepts(ctx, v, s))
                continue;
            accepted++;
            char shape[160];
            topk_shape_text(s, shape, sizeof(shape));
            if (opt.list) {
                printf("topk_gating [%s] %s\n", v->name, shape);
                continue;
            }
            for (int c = 0; c < NUM_CASES; c++)
                if (!(c == CASE_MANY && opt.small))
                    topk_check_case(tl, ctx, v, s, shape, (case_kind)c, (unsigned)vi, (unsigned)si);
        }
        unforce(v, MOECL_OP_TOPK_GATING);
        finish_variant(tl, "topk_gating", v, accepted);
    }
}

/* ---- the grounded router ---- */

typedef struct gr_shape {
    uint32_t hidden, experts, k;
    moecl_dtype dtype;
    bool router; /* moecl_router: DeepSeek-V3's gating, a bias, no router logits */
    bool large;
    /* moecl_router_ex: bf16 weights, int64 ids, every option (the valid
     * count a third short of the rows, int16 capture, a per-expert scale,
     * with shared experts their per-token gate) */
    bool ex;
    /* shared experts: after the routed slots, weight 0.4 (moecl_router's)
     * or their gate (moecl_router_ex's) */
    uint32_t shared;
} gr_shape;

/* The smallest request; odd sizes (every tile's edges); a router's gating
 * (the kernels that hold whole rows of g); the most experts and the
 * largest top_k. The last at hidden 1024, not a model's 4096: its time is
 * H * E in every one of some 40 variants (on pocl about 45 of this op's
 * 120 CPU seconds at 4096), and the op suite checks hidden 4096 with the
 * kernels each launch class picks. */
static const gr_shape gr_shapes[] = {
    {1, 1, 1, MOECL_F16, false, false, false, 0},
    {203, 130, 8, MOECL_BF16, false, false, false, 0},
    {256, 64, 6, MOECL_BF16, true, false, false, 1},
    {1024, 4096, 64, MOECL_BF16, false, true, false, 0},
    {64, 130, 8, MOECL_F16, false, false, true, 2},
};

static moecl_grounded_router_desc gr_desc(const gr_shape *s, uint32_t tokens)
{
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(tokens, s->hidden, s->experts, 0.75f);
    d.top_k = s->k;
    d.hidden_dtype = s->dtype;
    if (s->router) {
        d.alpha = 1.0f;
        d.gating = (moecl_gating){MOECL_SCORING_SIGMOID, MOECL_WEIGHTS_SCORE, 8, 4, MOECL_GROUP_SCORE_TOP2_SUM,
                                  MOECL_GROUP_FILL_NEG_INF, true, 0.0f, 2.5f, 1e-20f};
    }
    if (s->ex) {
        d.weights_dtype = MOECL_BF16;
        d.ids_dtype = MOECL_I64;
    }
    d.num_shared_experts = s->shared;
    d.shared_expert_weight = 0.4f;
    return d;
}

static void gr_shape_text(const gr_shape *s, char *buf, size_t size)
{
    const int n = snprintf(buf, size, "H=%u E=%u k=%u %s%s%s", s->hidden, s->experts, s->k, dtype_name(s->dtype),
                           s->router ? " router sigmoid bias groups=8/4 no-logits" : "",
                           s->ex ? " router_ex bf16 weights, int64 ids, counts, load, valid, int16 capture, scale"
                                 : "");
    /* shared experts: with their gate in router_ex */
    if (s->shared && n > 0 && (size_t)n < size)
        snprintf(buf + n, size - (size_t)n, " shared=%u%s", s->shared, s->ex ? " gate" : "");
}

typedef struct gr_call {
    moecl_grounded_router_desc d;
    bool router;
    dbuf hidden, logits, ground, bias, pairs, w, ids;
    bool ex;
    dbuf counts, load, valid, captured, scale, gate;
} gr_call;

static moecl_status gr_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w, cl_event *done)
{
    const gr_call *c = state;
    if (c->ex) {
        moecl_router_tensors t;
        memset(&t, 0, sizeof(t));
        t.struct_size = sizeof(t);
        t.token_hidden = at(&c->hidden);
        t.router_logits = at(&c->logits);
        t.expert_ground = at(&c->ground);
        t.topk_weights = at(&c->w);
        t.topk_ids = at(&c->ids);
        t.expert_counts = at(&c->counts);
        t.expert_load = at(&c->load);
        t.num_valid_tokens = at(&c->valid);
        t.captured_ids = at(&c->captured);
        t.captured_ids_dtype = MOECL_I16;
        t.expert_scale = at(&c->scale);
        t.shared_expert_gate = at(&c->gate);
        return moecl_router_ex(ctx, &c->d, &t, nw, w, done);
    }
    if (c->router)
        return moecl_router(ctx, &c->d, at(&c->hidden), at(&c->logits), at(&c->ground), at(&c->bias), at(&c->w),
                            at(&c->ids), nw, w, done);
    return moecl_grounded_router(ctx, &c->d, at(&c->hidden), at(&c->logits), at(&c->ground), at(&c->pairs),
                                 at(&c->w), at(&c->ids), nw, w, done);
}

/* The grounded router's variants: the rule of each launch class, the
 * 128-token tile, the tensor-core kernel and the split-K kernel (its own
 * chunk, and chunks of 16 hidden indices) as the override asks for them,
 * then every configuration moecl_launch_force can ask for: the rows
 * kernel (one work-item, the rule's two), the team kernel (every power of
 * two up to MOECL_LAUNCH_MAX_TEAM, one row and the rule's rows), every
 * tiled configuration of moecl_grounded_tile_configs, the tensor-core
 * kernel, and the split-K kernel (its chunk chosen, and of 32). */
static int gr_variants(variant *v, int max)
{
    int n = 0;
    static const char *const rules[] = {"class=cpu",
                                        "class=gpu",
                                        "class=gpu tile=128",
                                        "class=gpu grounded=mma",
                                        "class=gpu grounded=splitk",
                                        "class=cpu grounded=splitk kchunk=16"};
    for (size_t i = 0; i < COUNT(rules); i++) {
        v[n] = (variant){{0}, {0}, false, {0}};
        snprintf(v[n].name, sizeof(v[n].name), "%s", rules[i]);
        snprintf(v[n].override, sizeof(v[n].override), "%s", rules[i]);
        n++;
    }
    moecl_launch_config configs[128];
    int nc = 0;
    configs[nc++] = (moecl_launch_config){MOECL_KERNEL_ROWS, 1, 1, 0, {0}};
    configs[nc++] = (moecl_launch_config){MOECL_KERNEL_ROWS, 1, 2, 0, {0}};
    for (unsigned team = 2; team <= MOECL_LAUNCH_MAX_TEAM; team *= 2) {
        configs[nc++] = (moecl_launch_config){MOECL_KERNEL_TEAM, team, 1, 0, {0}};
        if (team < 128)
            configs[nc++] = (moecl_launch_config){MOECL_KERNEL_TEAM, team, 128 / team, 0, {0}};
    }
    size_t tiles;
    const moecl_launch_config *tile = moecl_grounded_tile_configs(&tiles);
    for (size_t i = 0; i < tiles && nc < (int)COUNT(configs) - 1; i++)
        configs[nc++] = tile[i];
    configs[nc++] = (moecl_launch_config){MOECL_KERNEL_MMA, 1, 0, 0, {0}};
    configs[nc++] = (moecl_launch_config){MOECL_KERNEL_SPLITK, 1, 0, 0, {0}};
    configs[nc++] = (moecl_launch_config){MOECL_KERNEL_SPLITK, 1, 0, 32, {0}};
    for (int i = 0; i < nc && n < max; i++) {
        v[n] = (variant){{0}, "class=gpu", true, configs[i]};
        moecl_launch_config_text(&configs[i], v[n].name, sizeof(v[n].name));
        n++;
    }
    return n;
}

static bool gr_accepts(moecl_context *ctx, const variant *v, const gr_shape *s)
{
    const moecl_grounded_router_desc d = gr_desc(s, 1);
    moecl_launch_key key;
    moecl_launch_config config;
    const moecl_launch_source src = moecl_grounded_router_launch(ctx, &d, &key, &config);
    /* pocl 3.1 crashes (SIGSEGV in the kernel) running the emulated
     * tensor-core kernel at E=4096, a work-group of 2048 work-items whose
     * emulation scratch outgrows a worker thread's stack: left out there
     * until the library refuses it (driver_refuses in src/launch.c). */
    if (s->large && config.kernel == MOECL_KERNEL_MMA && ctx->info.vendor == MOECL_VENDOR_POCL)
        return false;
    if (!v->forced)
        return true;
    return src == MOECL_SOURCE_FORCED && moecl_launch_config_equal(&config, &v->config);
}

/* A shape's table of ground rows: random, made once and shared by every
 * case and variant of the shape. At the largest shape (16.8M values)
 * making it per case took half of the op's time on pocl, four times
 * what the kernels and the reference took. */
static void *gr_grounds[COUNT(gr_shapes)];

static const void *gr_ground(const gr_shape *s, unsigned si)
{
    if (!gr_grounds[si]) {
        rng r = rng_for(3, si, 0);
        gr_grounds[si] = xmalloc((size_t)s->experts * s->hidden * ref_dtype_size(s->dtype));
        fill_rows(&r, CASE_RANDOM, s->dtype, gr_grounds[si], s->experts, s->hidden, 1.0f, NULL);
    }
    return gr_grounds[si];
}

static void gr_check_case(tally *tl, moecl_context *ctx, const variant *v, const gr_shape *s, const char *shape,
                          case_kind c, unsigned vi, unsigned si)
{
    rng r = rng_for(2, vi * 16 + si, c);
    uint32_t tokens = tokens_of(c, s->experts);
    if (s->large && c == CASE_RANDOM)
        tokens = 9;
    gr_call call = {gr_desc(s, tokens), s->router, absent, absent, absent, absent, absent, absent, absent,
                    s->ex,              absent,    absent, absent, absent, absent, absent};
    /* k: a row's slots, kr the routed ones (the capture's); CE: the
     * experts the histograms count (the shared ones too) */
    const size_t H = s->hidden, E = s->experts, k = s->k + s->shared, kr = s->k, in_size = ref_dtype_size(s->dtype);
    const size_t CE = E + s->shared;
    void *hidden = xmalloc((size_t)tokens * H * in_size);
    const void *ground = gr_ground(s, si);
    float *logits = s->router ? NULL : xmalloc((size_t)tokens * E * 4), *bias = NULL;
    /* Hidden states of unit RMS over sqrt(H), so that g is of order one.
     * Adversarial rows: g = the logits exactly (zero hidden states) with
     * the logits adversarial; for the router, which has none, the hidden
     * states themselves. */
    if (c == CASE_SPECIAL && s->router) {
        fill_rows(&r, c, s->dtype, hidden, tokens, (uint32_t)H, 1.0f, NULL);
        /* Not the row of +-3e38: its dot products overflow in an order
         * each kernel sums in, which no reference can stand for. */
        for (uint32_t t = SPECIAL_KINDS - 1; t < tokens; t += SPECIAL_KINDS)
            memset((char *)hidden + (size_t)t * H * in_size, 0, H * in_size);
    }
    else if (c == CASE_SPECIAL)
        memset(hidden, 0, (size_t)tokens * H * in_size);
    else
        fill_rows(&r, CASE_RANDOM, s->dtype, hidden, tokens, (uint32_t)H, 1.0f / sqrtf((float)H), NULL);
    if (logits)
        fill_rows(&r, c == CASE_SPECIAL ? CASE_SPECIAL : CASE_RANDOM, MOECL_F32, logits, tokens, (uint32_t)E, 1.0f,
                  NULL);
    if (s->router) {
        bias = xmalloc(E * 4);
        for (size_t e = 0; e < E; e++)
            bias[e] = 0.1f * randn(&r);
    }
    const unsigned char poison = poison_of(c);
    const size_t nk = (size_t)tokens * k;
    call.hidden = make_buf(hidden, (size_t)tokens * H * in_size, 0xFF);
    call.ground = make_buf(ground, E * H * in_size, 0xFF);
    if (logits)
        call.logits = make_buf(logits, (size_t)tokens * E * 4, 0xFF);
    if (bias)
        call.bias = make_buf(bias, E * 4, 0xFF);
    if (!s->router && !s->ex)
        call.pairs = make_buf(NULL, nk * 8, poison);
    call.w = make_buf(NULL, nk * 4, poison);
    call.ids = make_buf(NULL, nk * (s->ex ? 8 : 4), poison);
    float *pairs = xmalloc(nk * 8), *w = xmalloc(nk * 4);
    int32_t *ids = xmalloc(nk * 8);
    /* moecl_router_ex's: the load's entries before, the count, the scale */
    int32_t *counts = NULL, *load = NULL, *load_before = NULL, valid = (int32_t)(tokens - tokens / 3);
    int16_t *captured = NULL;
    float *scale = NULL;
    void *gate = NULL;
    if (s->ex) {
        counts = xmalloc(CE * 4);
        load = xmalloc(CE * 4);
        load_before = xmalloc(CE * 4);
        captured = xmalloc((size_t)tokens * kr * 2 + 1);
        scale = xmalloc(E * 4);
        for (size_t e = 0; e < CE; e++)
            load_before[e] = (int32_t)(e % 11) - 4;
        for (size_t e = 0; e < E; e++)
            scale[e] = (0.375f + 0.25f * (float)(e % 7)) * (e % 5 == 3 ? -1.0f : 1.0f);
        call.counts = make_buf(NULL, CE * 4, poison);
        call.load = make_buf(load_before, CE * 4, 0xFF);
        call.valid = make_buf(&valid, 4, 0xFF);
        call.captured = make_buf(NULL, (size_t)tokens * kr * 2, poison);
        call.scale = make_buf(scale, E * 4, 0xFF);
        if (s->shared) {
            gate = xmalloc(s->shared * H * in_size);
            fill_rows(&r, CASE_RANDOM, s->dtype, gate, s->shared, (uint32_t)H, 1.0f, NULL);
            call.gate = make_buf(gate, s->shared * H * in_size, 0xFF);
        }
    }
    char msg[1200] = "";
    moecl_status st = gr_run(ctx, &call, 0, NULL, NULL);
    tl->runs++;
    const char *op = "grounded_router";
    if (st != MOECL_SUCCESS) {
        fail(tl, op, v, shape, case_names[c], "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    } else if (clFinish(queue) != CL_SUCCESS || !read_buf(&call.pairs, pairs, "out_pairs", msg, sizeof(msg)) ||
               !read_buf(&call.w, w, "topk_weights", msg, sizeof(msg)) ||
               !read_buf(&call.ids, ids, "topk_ids", msg, sizeof(msg))) {
        fail(tl, op, v, shape, case_names[c], "%s", msg);
    } else if (s->ex && (!read_buf(&call.counts, counts, "expert_counts", msg, sizeof(msg)) ||
                         !read_buf(&call.load, load, "expert_load", msg, sizeof(msg)) ||
                         !read_buf(&call.captured, captured, "captured_ids", msg, sizeof(msg)))) {
        fail(tl, op, v, shape, case_names[c], "%s", msg);
    } else if (s->ex) {
        const ref_router_ex x = {NULL, scale, &valid, w, ids, captured, MOECL_I16, counts, load_before, load, gate};
        if (ref_check_router_ex(&call.d, hidden, logits, ground, &x, msg, sizeof(msg)))
            fail(tl, op, v, shape, case_names[c], "tokens %u valid %d: %s", tokens, (int)valid, msg);
    } else if (tokens && s->router && ref_check_router(&call.d, hidden, NULL, ground, bias, NULL, w, ids, msg,
                                                       sizeof(msg))) {
        fail(tl, op, v, shape, case_names[c], "tokens %u: %s", tokens, msg);
    } else if (tokens && !s->router && ref_check_grounded_router(&call.d, hidden, logits, ground, pairs, w, ids, msg,
                                                                 sizeof(msg))) {
        fail(tl, op, v, shape, case_names[c], "tokens %u: %s", tokens, msg);
    }
    if (opt.bench && c == (opt.small ? CASE_RANDOM : CASE_MANY) && !tl->variant_failed)
        bench(op, v, shape, ctx, context_for(v->override, true), gr_run, &call);
    release(&call.hidden);
    release(&call.ground);
    release(&call.logits);
    release(&call.bias);
    release(&call.pairs);
    release(&call.w);
    release(&call.ids);
    dbuf *ex_bufs[] = {&call.counts, &call.load, &call.valid, &call.captured, &call.scale, &call.gate};
    for (size_t i = 0; i < COUNT(ex_bufs); i++)
        release(ex_bufs[i]);
    free(hidden);
    free(logits);
    free(bias);
    free(pairs);
    free(w);
    free(ids);
    free(counts);
    free(load);
    free(load_before);
    free(captured);
    free(scale);
    free(gate);
}

static void check_grounded(tally *tl)
{
    variant vs[128];
    const int nv = gr_variants(vs, 128);
    for (int vi = 0; vi < nv; vi++) {
        const variant *v = &vs[vi];
        if (!selected(v))
            continue;
        moecl_context *ctx = context_for(v->override, false);
        force(v, MOECL_OP_GROUNDED_ROUTER);
        int accepted = 0;
        tl->variant_failed = false;
        for (size_t si = 0; si < COUNT(gr_shapes); si++) {
            const gr_shape *s = &gr_shapes[si];
            if ((opt.small && s->large) || !gr_accepts(ctx, v, s))
                continue;
            accepted++;
            char shape[160];
            gr_shape_text(s, shape, sizeof(shape));
            if (opt.list) {
                printf("grounded_router [%s] %s\n", v->name, shape);
                continue;
            }
            /* The largest shape without the adversarial rows: its time is
             * the product H * E, whatever the rows hold (two thirds of the
             * op's time on pocl), and those rows go through cl/gating.cl,
             * which the top-k op checks at E=4096 k=64 with every kind. */
            for (int c = 0; c < NUM_CASES; c++)
                if (!(c == CASE_MANY && (opt.small || s->large)) && !(c == CASE_SPECIAL && s->large))
                    gr_check_case(tl, ctx, v, s, shape, (case_kind)c, (unsigned)vi, (unsigned)si);
        }
        unforce(v, MOECL_OP_GROUNDED_ROUTER);
        finish_variant(tl, "grounded_router", v, accepted);
    }
    for (size_t si = 0; si < COUNT(gr_shapes); si++) {
        free(gr_grounds[si]);
        gr_grounds[si] = NULL;
    }
}

/* ---- variants named by the override alone ---- */

/* Variants that are override texts: each launch class with each of the
 * paths listed (NULL: the class's own choice). */
static int path_variants(variant *v, int max, const char *const *paths, size_t num_paths)
{
    int n = 0;
    static const char *const classes[] = {"class=cpu", "class=gpu"};
    for (size_t c = 0; c < COUNT(classes); c++)
        for (size_t p = 0; p < num_paths && n < max; p++) {
            v[n] = (variant){{0}, {0}, false, {0}};
            snprintf(v[n].override, sizeof(v[n].override), "%s%s%s", classes[c], paths[p] ? " " : "",
                     paths[p] ? paths[p] : "");
            snprintf(v[n].name, sizeof(v[n].name), "%s", v[n].override);
            n++;
        }
    return n;
}

/* Random expert ids in [0, experts) with some out of range (a runtime's
 * padding rows carry -1); adversarial: every slot on one expert, on the
 * last one, out of range, alternating. */
static void fill_ids(rng *r, case_kind c, int32_t *ids, size_t slots, uint32_t experts)
{
    for (size_t i = 0; i < slots; i++) {
        int32_t id = (int32_t)(rand_u32(r) % experts);
        if (c == CASE_SPECIAL) {
            static const int32_t bad[] = {-1, INT32_MIN, INT32_MAX};
            switch ((i * 7 / (slots ? slots : 1)) % 7) {
            case 0: id = 0; break;
            case 1: id = (int32_t)experts - 1; break;
            case 2: id = bad[i % 3]; break;
            case 3: id = (int32_t)experts; break;
            case 4: id = (int32_t)(i % 2 ? 0 : experts - 1); break;
            default: break;
            }
        } else if (rand_u32(r) % 16 == 0) {
            id = rand_u32(r) % 2 ? -1 : (int32_t)experts + (int32_t)(rand_u32(r) % 3);
        }
        ids[i] = id;
    }
}

/* ---- moe_align ---- */

typedef struct align_shape_s {
    uint32_t k, experts, block;
    bool large;
} align_shape_s;

static const align_shape_s align_shapes[] = {
    {1, 1, 1, false},
    {8, 256, 16, false},
    {6, 60, 64, false},
    {64, 4096, 1024, true},
};

typedef struct align_call {
    moecl_moe_align_desc d;
    dbuf ids, counts, sorted, blocks, post, slots, invalid;
} align_call;

static moecl_status align_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w, cl_event *done)
{
    const align_call *c = state;
    return moecl_moe_align(ctx, &c->d, at(&c->ids), at(&c->counts), at(&c->sorted), at(&c->blocks), at(&c->post),
                           at(&c->slots), at(&c->invalid), nw, w, done);
}

/* moe_align's outputs for d, poisoned; slot_positions and num_invalid
 * only where optional. */
static void align_outputs(const moecl_moe_align_desc *d, unsigned char poison, bool optional, dbuf *counts,
                          dbuf *sorted, dbuf *blocks, dbuf *post, dbuf *slots, dbuf *invalid)
{
    const size_t max_padded = (size_t)moecl_moe_align_max_padded(d);
    *counts = make_buf(NULL, (size_t)d->num_experts * 4, poison);
    *sorted = make_buf(NULL, max_padded * 4, poison);
    *blocks = make_buf(NULL, max_padded / d->block_size * 4, poison);
    *post = make_buf(NULL, 4, poison);
    *slots = optional ? make_buf(NULL, (size_t)d->num_tokens * d->top_k * 4, poison) : absent;
    *invalid = optional ? make_buf(NULL, 4, poison) : absent;
}

/* Read moe_align's outputs back and compare them with the reference for
 * ids; false with the reason in msg. */
static bool align_verify(const moecl_moe_align_desc *d, const int32_t *ids, const dbuf *counts, const dbuf *sorted,
                         const dbuf *blocks, const dbuf *post, const dbuf *slots, const dbuf *invalid, char *msg,
                         size_t msg_size)
{
    int32_t *o_counts = xmalloc(counts->size), *o_sorted = xmalloc(sorted->size), *o_blocks = xmalloc(blocks->size);
    int32_t o_post, o_invalid, *o_slots = xmalloc(slots->size);
    bool ok = read_buf(counts, o_counts, "expert_counts", msg, msg_size) &&
              read_buf(sorted, o_sorted, "sorted_token_ids", msg, msg_size) &&
              read_buf(blocks, o_blocks, "block_expert_ids", msg, msg_size) &&
              read_buf(post, &o_post, "num_tokens_post_padded", msg, msg_size) &&
              read_buf(slots, o_slots, "slot_positions", msg, msg_size) &&
              read_buf(invalid, &o_invalid, "num_invalid", msg, msg_size);
    if (ok && ref_check_moe_align(d, ids, o_counts, o_sorted, o_blocks, &o_post, slots->mem ? o_slots : NULL,
                                  invalid->mem ? &o_invalid : NULL, msg, msg_size))
        ok = false;
    free(o_counts);
    free(o_sorted);
    free(o_blocks);
    free(o_slots);
    return ok;
}

/* The plan of the context's moe_align (its work-group limits). */
static const moecl_plan *align_plan(moecl_context *ctx)
{
    const moecl_plan *p;
    moecl_status st = moecl_moe_align_plan(ctx, false, &p);
    if (st != MOECL_SUCCESS)
        die("moe_align's kernels", ctx, st);
    return p;
}

/* Whether the context's moe_align runs the path its override forces
 * (the path falls back to the chunked one where the device does not run
 * it at its work-group). */
static bool align_accepts(moecl_context *ctx)
{
    const moecl_plan *p = align_plan(ctx);
    switch (ctx->info.env.align_path) {
    case MOECL_ALIGN_ONE_GROUP:
        return p->one_group_fits;
    case MOECL_ALIGN_FUSED:
        return p->fused_fits;
    case MOECL_ALIGN_FUSED_PARALLEL:
        return p->parallel_fits;
    default:
        return true;
    }
}

static uint32_t align_tokens(case_kind c, uint32_t k)
{
    return c == CASE_MANY ? (k >= 64 ? 2053 : 4099) : c == CASE_SPECIAL ? 301 : tokens_of(c, 1);
}

static void align_check_case(tally *tl, moecl_context *ctx, const variant *v, const align_shape_s *s,
                             const char *shape, case_kind c, unsigned vi, unsigned si)
{
    rng r = rng_for(3, vi * 16 + si, c);
    const uint32_t tokens = align_tokens(c, s->k);
    align_call call;
    call.d = moecl_moe_align_desc_init(tokens, s->k, s->experts, s->block);
    const size_t slots = (size_t)tokens * s->k;
    int32_t *ids = xmalloc(slots * 4);
    fill_ids(&r, c, ids, slots, s->experts);
    call.ids = make_buf(ids, slots * 4, 0xFF);
    align_outputs(&call.d, poison_of(c), c != CASE_ONE, &call.counts, &call.sorted, &call.blocks, &call.post,
                  &call.slots, &call.invalid);
    char msg[1200] = "";
    moecl_status st = align_run(ctx, &call, 0, NULL, NULL);
    tl->runs++;
    if (st != MOECL_SUCCESS)
        fail(tl, "moe_align", v, shape, case_names[c], "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    else if (clFinish(queue) != CL_SUCCESS || !align_verify(&call.d, ids, &call.counts, &call.sorted, &call.blocks,
                                                            &call.post, &call.slots, &call.invalid, msg, sizeof(msg)))
        fail(tl, "moe_align", v, shape, case_names[c], "tokens %u: %s", tokens, msg);
    if (opt.bench && c == (opt.small ? CASE_RANDOM : CASE_MANY) && !tl->variant_failed)
        bench("moe_align", v, shape, ctx, context_for(v->override, true), align_run, &call);
    release(&call.ids);
    release(&call.counts);
    release(&call.sorted);
    release(&call.blocks);
    release(&call.post);
    release(&call.slots);
    release(&call.invalid);
    free(ids);
}

static void check_align(tally *tl)
{
    static const char *const paths[] = {NULL, "align=one-group", "align=fused", "align=chunked",
                                        "align=fused-parallel"};
    variant vs[16];
    const int nv = path_variants(vs, 16, paths, COUNT(paths));
    for (int vi = 0; vi < nv; vi++) {
        const variant *v = &vs[vi];
        if (!selected(v))
            continue;
        moecl_context *ctx = context_for(v->override, false);
        tl->variant_failed = false;
        int accepted = 0;
        for (size_t si = 0; si < COUNT(align_shapes) && align_accepts(ctx); si++) {
            const align_shape_s *s = &align_shapes[si];
            if (opt.small && s->large)
                continue;
            accepted++;
            char shape[96];
            snprintf(shape, sizeof(shape), "k=%u E=%u block=%u", s->k, s->experts, s->block);
            if (opt.list) {
                printf("moe_align [%s] %s\n", v->name, shape);
                continue;
            }
            for (int c = 0; c < NUM_CASES; c++)
                if (!(c == CASE_MANY && opt.small))
                    align_check_case(tl, ctx, v, s, shape, (case_kind)c, (unsigned)vi, (unsigned)si);
        }
        finish_variant(tl, "moe_align", v, accepted);
    }
}

/* ---- the expert-parallel layout ---- */

typedef struct ep_shape {
    uint32_t k, experts, ranks, physical, replicas;
    bool table, large;
} ep_shape;

/* The smallest; replicas with a rank table; ranks past the fused kernel's
 * 256 (its variants take the three kernels there); contiguous blocks
 * without a map; the largest. */
static const ep_shape ep_shapes[] = {
    {1, 1, 1, 1, 1, false, false},
    {8, 256, 8, 288, 3, true, false},
    {6, 64, 300, 64, 1, true, false},
    {8, 128, 16, 128, 1, false, false},
    {64, 4096, 1024, 16384, 64, true, true},
};

typedef struct ep_call {
    moecl_ep_layout_desc d;
    dbuf ids, l2p, rc, p2r, phys, rank_counts, rank_offsets, send, tir, tpr, counts;
} ep_call;

static moecl_status ep_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w, cl_event *done)
{
    const ep_call *c = state;
    return moecl_ep_layout(ctx, &c->d, at(&c->ids), at(&c->l2p), at(&c->rc), at(&c->p2r), at(&c->phys),
                           at(&c->rank_counts), at(&c->rank_offsets), at(&c->send), at(&c->tir), at(&c->tpr),
                           at(&c->counts), nw, w, done);
}

static const moecl_plan *ep_plan(moecl_context *ctx)
{
    const moecl_ep_layout_desc d = moecl_ep_layout_desc_init(1, 1, 1, 1);
    moecl_status st = moecl_ep_layout_prepare(ctx, &d);
    if (st != MOECL_SUCCESS)
        die("the layout's kernels", ctx, st);
    const moecl_plan_key key = moecl_plan_key_of(ctx, MOECL_OP_EP_LAYOUT, (uint64_t)ctx->info.launch_class, 0, 0, 0);
    return moecl_plan_find(ctx, &key);
}

/* Whether the context runs the fused kernel its override asks for, at the
 * work-group it names. */
static bool ep_accepts(moecl_context *ctx)
{
    const moecl_launch_env *env = &ctx->info.env;
    if (env->ep_path != MOECL_EP_FUSED && env->ep_path != MOECL_EP_FUSED_LAST && !env->ep_fused_groups)
        return true;
    const moecl_plan *p = ep_plan(ctx);
    return p && p->fused_fits && (!env->ep_fused_wg || p->fused_wg == env->ep_fused_wg);
}

static void ep_check_case(tally *tl, moecl_context *ctx, const variant *v, const ep_shape *s, const char *shape,
                          case_kind c, unsigned vi, unsigned si)
{
    rng r = rng_for(4, vi * 16 + si, c);
    const uint32_t tokens = align_tokens(c, s->k);
    ep_call call;
    memset(&call, 0, sizeof(call));
    call.d = moecl_ep_layout_desc_init(tokens, s->k, s->experts, s->ranks);
    call.d.num_physical = s->physical;
    call.d.max_replicas = s->replicas;
    const bool map = s->physical != s->experts || s->replicas > 1;
    const size_t slots = (size_t)tokens * s->k;
    int32_t *ids = xmalloc(slots * 4), *l2p = NULL, *rc = NULL, *p2r = NULL;
    fill_ids(&r, c, ids, slots, s->experts);
    /* The tables, a few entries out of range (those slots are not sent). */
    if (map) {
        l2p = xmalloc((size_t)s->experts * s->replicas * 4);
        rc = xmalloc((size_t)s->experts * 4);
        for (size_t i = 0; i < (size_t)s->experts * s->replicas; i++)
            l2p[i] = rand_u32(&r) % 64 ? (int32_t)(rand_u32(&r) % s->physical) : (int32_t)s->physical;
        for (uint32_t e = 0; e < s->experts; e++)
            rc[e] = rand_u32(&r) % 32 ? 1 + (int32_t)(rand_u32(&r) % s->replicas) : 0;
    }
    if (s->table) {
        p2r = xmalloc((size_t)s->physical * 4);
        for (uint32_t p = 0; p < s->physical; p++)
            p2r[p] = rand_u32(&r) % 64 ? (int32_t)(rand_u32(&r) % s->ranks) : -1;
    }
    const unsigned char poison = poison_of(c);
    const bool optional = c != CASE_ONE;
    call.ids = make_buf(ids, slots * 4, 0xFF);
    call.l2p = map ? make_buf(l2p, (size_t)s->experts * s->replicas * 4, 0xFF) : absent;
    call.rc = map ? make_buf(rc, (size_t)s->experts * 4, 0xFF) : absent;
    call.p2r = s->table ? make_buf(p2r, (size_t)s->physical * 4, 0xFF) : absent;
    call.phys = make_buf(NULL, slots * 4, poison);
    call.rank_counts = make_buf(NULL, (size_t)s->ranks * 4, poison);
    call.rank_offsets = make_buf(NULL, ((size_t)s->ranks + 1) * 4, poison);
    call.send = make_buf(NULL, slots * 4, poison);
    call.tir = optional ? make_buf(NULL, (size_t)tokens * s->ranks, poison) : absent;
    call.tpr = optional ? make_buf(NULL, (size_t)s->ranks * 4, poison) : absent;
    call.counts = optional ? make_buf(NULL, (size_t)s->physical * 4, poison) : absent;
    ref_ep_layout_out got = {xmalloc(slots * 4),   xmalloc((size_t)s->ranks * 4), xmalloc(((size_t)s->ranks + 1) * 4),
                             xmalloc(slots * 4),   NULL, NULL, NULL};
    if (optional) {
        got.token_in_rank = xmalloc((size_t)tokens * s->ranks);
        got.tokens_per_rank = xmalloc((size_t)s->ranks * 4);
        got.expert_counts = xmalloc((size_t)s->physical * 4);
    }
    char msg[1200] = "";
    moecl_status st = ep_run(ctx, &call, 0, NULL, NULL);
    tl->runs++;
    if (st != MOECL_SUCCESS)
        fail(tl, "ep_layout", v, shape, case_names[c], "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    else if (clFinish(queue) != CL_SUCCESS || !read_buf(&call.phys, got.physical_ids, "physical_ids", msg, sizeof(msg)) ||
             !read_buf(&call.rank_counts, got.rank_counts, "rank_counts", msg, sizeof(msg)) ||
             !read_buf(&call.rank_offsets, got.rank_offsets, "rank_offsets", msg, sizeof(msg)) ||
             !read_buf(&call.send, got.send_slots, "send_slots", msg, sizeof(msg)) ||
             !read_buf(&call.tir, got.token_in_rank, "token_in_rank", msg, sizeof(msg)) ||
             !read_buf(&call.tpr, got.tokens_per_rank, "tokens_per_rank", msg, sizeof(msg)) ||
             !read_buf(&call.counts, got.expert_counts, "expert_counts", msg, sizeof(msg)) ||
             ref_check_ep_layout(&call.d, ids, l2p, rc, p2r, &got, msg, sizeof(msg)))
        fail(tl, "ep_layout", v, shape, case_names[c], "tokens %u: %s", tokens, msg);
    if (opt.bench && c == (opt.small ? CASE_RANDOM : CASE_MANY) && !tl->variant_failed)
        bench("ep_layout", v, shape, ctx, context_for(v->override, true), ep_run, &call);
    dbuf *bufs[] = {&call.ids,  &call.l2p, &call.rc,  &call.p2r, &call.phys,  &call.rank_counts,
                    &call.rank_offsets, &call.send, &call.tir, &call.tpr, &call.counts};
    for (size_t i = 0; i < COUNT(bufs); i++)
        release(bufs[i]);
    free(ids);
    free(l2p);
    free(rc);
    free(p2r);
    free(got.physical_ids);
    free(got.rank_counts);
    free(got.rank_offsets);
    free(got.send_slots);
    free(got.token_in_rank);
    free(got.tokens_per_rank);
    free(got.expert_counts);
}

/* The layout's variants: each class with its own path, each path forced,
 * the fused kernel on two work-groups (its grid-wide wait between them),
 * and the fused kernel at every work-group ep_wg names. */
static int ep_variants(variant *v, int max)
{
    static const char *const paths[] = {NULL, "ep=chunked", "ep=fused", "ep=fused-last", "ep=fused ep_groups=2"};
    int n = path_variants(v, max, paths, COUNT(paths));
    for (unsigned wg = 32; wg <= 1024 && n < max; wg *= 2) {
        v[n] = (variant){{0}, {0}, false, {0}};
        snprintf(v[n].override, sizeof(v[n].override), "class=gpu ep=fused ep_wg=%u", wg);
        snprintf(v[n].name, sizeof(v[n].name), "%s", v[n].override);
        n++;
    }
    return n;
}

static void check_ep(tally *tl)
{
    variant vs[32];
    const int nv = ep_variants(vs, 32);
    for (int vi = 0; vi < nv; vi++) {
        const variant *v = &vs[vi];
        if (!selected(v))
            continue;
        moecl_context *ctx = context_for(v->override, false);
        tl->variant_failed = false;
        int accepted = 0;
        for (size_t si = 0; si < COUNT(ep_shapes) && ep_accepts(ctx); si++) {
            const ep_shape *s = &ep_shapes[si];
            if (opt.small && s->large)
                continue;
            accepted++;
            char shape[128];
            snprintf(shape, sizeof(shape), "k=%u E=%u ranks=%u physical=%u replicas=%u%s", s->k, s->experts, s->ranks,
                     s->physical, s->replicas, s->table ? " table" : "");
            if (opt.list) {
                printf("ep_layout [%s] %s\n", v->name, shape);
                continue;
            }
            for (int c = 0; c < NUM_CASES; c++)
                if (!(c == CASE_MANY && opt.small))
                    ep_check_case(tl, ctx, v, s, shape, (case_kind)c, (unsigned)vi, (unsigned)si);
        }
        finish_variant(tl, "ep_layout", v, accepted);
    }
}

/* ---- routing through to dispatch ---- */

/* A top-k shape (topk non-NULL) or a grounded one, and moe_align's block. */
typedef struct route_shape {
    const topk_shape *topk;
    const gr_shape *grounded;
    uint32_t block;
} route_shape;

static const gr_shape route_gr_shapes[] = {
    {128, 16, 2, MOECL_F32, false, false, false, 0},
    {64, 64, 8, MOECL_BF16, false, false, false, 0},
};
static const route_shape route_shapes[] = {
    {&topk_shapes[0], NULL, 1},
    {&topk_shapes[2], NULL, 16},
    {NULL, &route_gr_shapes[0], 16},
    {NULL, &route_gr_shapes[1], 4},
};

typedef struct route_call {
    bool grounded;
    moecl_topk_gating_desc td;
    moecl_grounded_router_desc gd;
    uint32_t block;
    dbuf in[3], w, ids, counts, sorted, blocks, post, slots, invalid;
} route_call;

static moecl_status route_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w, cl_event *done)
{
    const route_call *c = state;
    if (c->grounded)
        return moecl_grounded_route_dispatch(ctx, &c->gd, c->block, at(&c->in[0]), at(&c->in[1]), at(&c->in[2]),
                                             at(&c->w), at(&c->ids), at(&c->counts), at(&c->sorted), at(&c->blocks),
                                             at(&c->post), at(&c->slots), at(&c->invalid), nw, w, done);
    return moecl_route_dispatch(ctx, &c->td, c->block, at(&c->in[0]), at(&c->in[1]), at(&c->w), at(&c->ids),
                                at(&c->counts), at(&c->sorted), at(&c->blocks), at(&c->post), at(&c->slots),
                                at(&c->invalid), nw, w, done);
}

static void route_shape_text(const route_shape *s, char *buf, size_t size)
{
    char inner[160];
    if (s->topk)
        topk_shape_text(s->topk, inner, sizeof(inner));
    else
        gr_shape_text(s->grounded, inner, sizeof(inner));
    snprintf(buf, size, "%s %s block=%u", s->topk ? "top-k" : "grounded", inner, s->block);
}

static void route_check_case(tally *tl, moecl_context *ctx, const variant *v, const route_shape *s,
                             const char *shape, case_kind c, unsigned vi, unsigned si)
{
    rng r = rng_for(5, vi * 16 + si, c);
    const uint32_t experts = s->topk ? s->topk->experts : s->grounded->experts;
    const uint32_t k = s->topk ? s->topk->k : s->grounded->k;
    const uint32_t tokens = tokens_of(c, experts);
    route_call call;
    memset(&call, 0, sizeof(call));
    call.grounded = s->grounded != NULL;
    call.block = s->block;
    const size_t nk = (size_t)tokens * k;
    void *in[3] = {NULL, NULL, NULL};
    if (s->topk) {
        call.td = topk_desc(s->topk, tokens);
        in[0] = xmalloc((size_t)tokens * experts * ref_dtype_size(s->topk->dtype));
        fill_rows(&r, c, s->topk->dtype, in[0], tokens, experts, 2.0f, NULL);
        call.in[0] = make_buf(in[0], (size_t)tokens * experts * ref_dtype_size(s->topk->dtype), 0xFF);
        if (s->topk->bias) {
            in[1] = xmalloc((size_t)experts * 4);
            for (uint32_t e = 0; e < experts; e++)
                ((float *)in[1])[e] = 0.1f * randn(&r);
            call.in[1] = make_buf(in[1], (size_t)experts * 4, 0xFF);
        }
    } else {
        const gr_shape *g = s->grounded;
        const size_t in_size = ref_dtype_size(g->dtype);
        call.gd = gr_desc(g, tokens);
        in[0] = xmalloc((size_t)tokens * g->hidden * in_size);
        in[1] = xmalloc((size_t)tokens * experts * 4);
        in[2] = xmalloc((size_t)experts * g->hidden * in_size);
        if (c == CASE_SPECIAL)
            memset(in[0], 0, (size_t)tokens * g->hidden * in_size);
        else
            fill_rows(&r, CASE_RANDOM, g->dtype, in[0], tokens, g->hidden, 1.0f / sqrtf((float)g->hidden), NULL);
        fill_rows(&r, c == CASE_SPECIAL ? CASE_SPECIAL : CASE_RANDOM, MOECL_F32, in[1], tokens, experts, 1.0f, NULL);
        fill_rows(&r, CASE_RANDOM, g->dtype, in[2], experts, g->hidden, 1.0f, NULL);
        call.in[0] = make_buf(in[0], (size_t)tokens * g->hidden * in_size, 0xFF);
        call.in[1] = make_buf(in[1], (size_t)tokens * experts * 4, 0xFF);
        call.in[2] = make_buf(in[2], (size_t)experts * g->hidden * in_size, 0xFF);
    }
    const unsigned char poison = poison_of(c);
    call.w = make_buf(NULL, nk * 4, poison);
    call.ids = make_buf(NULL, nk * 4, poison);
    moecl_moe_align_desc ad = moecl_moe_align_desc_init(tokens, k, experts, s->block);
    align_outputs(&ad, poison, c != CASE_ONE, &call.counts, &call.sorted, &call.blocks, &call.post, &call.slots,
                  &call.invalid);
    float *w = xmalloc(nk * 4);
    int32_t *ids = xmalloc(nk * 4);
    char msg[1200] = "";
    moecl_status st = route_run(ctx, &call, 0, NULL, NULL);
    tl->runs++;
    const char *op = "route_dispatch";
    if (st != MOECL_SUCCESS) {
        fail(tl, op, v, shape, case_names[c], "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    } else if (clFinish(queue) != CL_SUCCESS || !read_buf(&call.w, w, "topk_weights", msg, sizeof(msg)) ||
               !read_buf(&call.ids, ids, "topk_ids", msg, sizeof(msg))) {
        fail(tl, op, v, shape, case_names[c], "%s", msg);
    } else if (tokens && s->topk && ref_check_topk_gating(&call.td, in[0], in[1], w, ids, msg, sizeof(msg))) {
        fail(tl, op, v, shape, case_names[c], "tokens %u, the routing: %s", tokens, msg);
    } else if (tokens && s->grounded &&
               ref_check_grounded_router(&call.gd, in[0], in[1], in[2], NULL, w, ids, msg, sizeof(msg))) {
        fail(tl, op, v, shape, case_names[c], "tokens %u, the routing: %s", tokens, msg);
    } else if (!align_verify(&ad, ids, &call.counts, &call.sorted, &call.blocks, &call.post, &call.slots,
                             &call.invalid, msg, sizeof(msg))) {
        fail(tl, op, v, shape, case_names[c], "tokens %u, the dispatch of the ids it chose: %s", tokens, msg);
    }
    if (opt.bench && c == (opt.small ? CASE_RANDOM : CASE_MANY) && !tl->variant_failed)
        bench(op, v, shape, ctx, context_for(v->override, true), route_run, &call);
    dbuf *bufs[] = {&call.in[0], &call.in[1], &call.in[2], &call.w, &call.ids, &call.counts, &call.sorted,
                    &call.blocks, &call.post, &call.slots, &call.invalid};
    for (size_t i = 0; i < COUNT(bufs); i++)
        release(bufs[i]);
    for (int i = 0; i < 3; i++)
        free(in[i]);
    free(w);
    free(ids);
}

/* route_dispatch's variants: each class under each of moe_align's paths
 * (the one kernel where neither one-group nor chunked is forced), then the
 * one kernel on every top-k team (forced, GPU class, moe_align's fused
 * path). */
static int route_variants(variant *v, int max)
{
    static const char *const paths[] = {NULL, "align=one-group", "align=fused", "align=chunked"};
    int n = path_variants(v, max, paths, COUNT(paths));
    for (unsigned team = 2; team <= MOECL_LAUNCH_MAX_TEAM && n < max; team *= 2) {
        v[n] = (variant){{0}, "class=gpu align=fused", true,
                         {MOECL_KERNEL_TEAM, team, team < 128 ? 128 / team : 1, 0, {0}}};
        char text[128];
        moecl_launch_config_text(&v[n].config, text, sizeof(text));
        snprintf(v[n].name, sizeof(v[n].name), "%s %s", v[n].override, text);
        n++;
    }
    return n;
}

static void check_route(tally *tl)
{
    variant vs[32];
    const int nv = route_variants(vs, 32);
    for (int vi = 0; vi < nv; vi++) {
        const variant *v = &vs[vi];
        if (!selected(v))
            continue;
        moecl_context *ctx = context_for(v->override, false);
        force(v, MOECL_OP_TOPK_GATING);
        tl->variant_failed = false;
        int accepted = 0;
        for (size_t si = 0; si < COUNT(route_shapes) && align_accepts(ctx); si++) {
            const route_shape *s = &route_shapes[si];
            /* A forced top-k team: the top-k shapes that take it. */
            if (v->forced && (!s->topk || !topk_accepts(ctx, v, s->topk)))
                continue;
            accepted++;
            char shape[200];
            route_shape_text(s, shape, sizeof(shape));
            if (opt.list) {
                printf("route_dispatch [%s] %s\n", v->name, shape);
                continue;
            }
            for (int c = 0; c < NUM_CASES; c++)
                if (!(c == CASE_MANY && opt.small))
                    route_check_case(tl, ctx, v, s, shape, (case_kind)c, (unsigned)vi, (unsigned)si);
        }
        unforce(v, MOECL_OP_TOPK_GATING);
        finish_variant(tl, "route_dispatch", v, accepted);
    }
}

/* ---- permute (gather and scatter) and combine ---- */

typedef struct permute_shape {
    uint32_t k, experts, block, hidden;
    moecl_dtype in, out;
    int shared; /* combine's shared rows' dtype, -1: none */
    bool large;
} permute_shape;

/* top_k 1 to 64, hidden without and with a scalar tail (and all tail),
 * every dtype as input and as output; f32 outputs show a sum's last bit. */
static const permute_shape permute_shapes[] = {
    {1, 4, 4, 7, MOECL_F32, MOECL_F32, -1, false},
    {2, 16, 8, 64, MOECL_F16, MOECL_BF16, MOECL_F32, false},
    {8, 64, 16, 129, MOECL_BF16, MOECL_F16, MOECL_BF16, false},
    {8, 16, 4, 1, MOECL_BF16, MOECL_F32, MOECL_F32, false},
    {64, 256, 4, 33, MOECL_F32, MOECL_BF16, MOECL_F16, false},
    {4, 16, 8, 24, MOECL_F16, MOECL_F16, MOECL_F16, false},
    {8, 64, 16, 4096, MOECL_BF16, MOECL_BF16, -1, true},
};

typedef struct permute_call {
    moecl_permute_desc pd;
    moecl_combine_desc cd;
    dbuf x, sorted, post, perm, scat, y, w, pos, shared, out;
} permute_call;

static moecl_status permute_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w,
                                cl_event *done)
{
    const permute_call *c = state;
    return moecl_permute(ctx, &c->pd, at(&c->x), at(&c->sorted), at(&c->post), at(&c->perm), nw, w, done);
}

static moecl_status scatter_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w,
                                cl_event *done)
{
    const permute_call *c = state;
    return moecl_permute_scatter(ctx, &c->pd, at(&c->x), at(&c->sorted), at(&c->post), at(&c->pos), at(&c->scat),
                                 nw, w, done);
}

static moecl_status combine_run(moecl_context *ctx, const void *state, cl_uint nw, const cl_event *w,
                                cl_event *done)
{
    const permute_call *c = state;
    return moecl_combine(ctx, &c->cd, at(&c->y), at(&c->w), at(&c->pos), at(&c->shared), at(&c->out), nw, w, done);
}

/* Elements of got and want (dtype) agree: the same bits, or both NaN. */
static bool same_values(moecl_dtype dtype, const void *got, const void *want, size_t n, size_t *first)
{
    const size_t z = ref_dtype_size(dtype);
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)got + i * z, (const char *)want + i * z, z) != 0 &&
            !(isnan(ref_load(dtype, got, i)) && isnan(ref_load(dtype, want, i)))) {
            *first = i;
            return false;
        }
    return true;
}

/* One case of a shape: the ids of case c through the reference moe_align,
 * then permute of random (or adversarial) rows and combine of random
 * expert rows, each against the reference. */
static void permute_check_case(tally *tl, moecl_context *ctx, const variant *v, const permute_shape *s,
                               const char *shape, case_kind c, unsigned vi, unsigned si)
{
    rng r = rng_for(6, vi * 16 + si, c);
    /* Many tokens: 4096 (512 at top 64 or hidden 4096: the host's
     * reference and buffers stay small). */
    const uint32_t tokens = c == CASE_MANY ? (s->k > 8 || s->large ? 512 : 4096) : tokens_of(c, 1);
    const size_t slots = (size_t)tokens * s->k, h = s->hidden;
    const moecl_moe_align_desc ad = moecl_moe_align_desc_init(tokens, s->k, s->experts, s->block);
    const uint32_t padded = (uint32_t)moecl_moe_align_max_padded(&ad);
    int32_t *ids = xmalloc(slots * 4 + 4), *sorted = xmalloc((size_t)padded * 4 + 4);
    int32_t *pos = xmalloc(slots * 4 + 4), *counts = xmalloc((size_t)s->experts * 4);
    int32_t *blocks = xmalloc((size_t)padded / s->block * 4 + 4), post, invalid;
    fill_ids(&r, c, ids, slots, s->experts);
    ref_moe_align(&ad, ids, counts, sorted, blocks, &post, pos, &invalid);
    const size_t in_z = ref_dtype_size(s->in), out_z = ref_dtype_size(s->out);
    const size_t sh_z = s->shared >= 0 ? ref_dtype_size((moecl_dtype)s->shared) : 0;
    void *x = xmalloc(tokens * h * in_z + 1), *y = xmalloc(padded * h * in_z + 1);
    void *sh = xmalloc(tokens * h * (sh_z ? sh_z : 1) + 1);
    float *w = xmalloc(slots * 4 + 4);
    fill_rows(&r, c, s->in, x, tokens, (uint32_t)h, 1.0f, NULL);
    fill_rows(&r, CASE_RANDOM, s->in, y, padded, (uint32_t)h, 1.0f, NULL);
    if (sh_z)
        fill_rows(&r, CASE_RANDOM, (moecl_dtype)s->shared, sh, tokens, (uint32_t)h, 1.0f, NULL);
    for (size_t i = 0; i < slots; i++)
        w[i] = (float)rand_uniform(&r);
    const unsigned char poison = poison_of(c);
    permute_call call;
    call.pd = moecl_permute_desc_init(tokens, s->k, s->hidden, padded);
    call.pd.in_dtype = s->in;
    call.pd.out_dtype = s->out;
    call.cd = moecl_combine_desc_init(tokens, s->k, s->hidden, padded);
    call.cd.in_dtype = s->in;
    call.cd.out_dtype = s->out;
    call.cd.shared_dtype = sh_z ? (moecl_dtype)s->shared : MOECL_F32;
    call.x = tokens ? make_buf(x, tokens * h * in_z, 0xFF) : absent;
    call.sorted = make_buf(sorted, (size_t)padded * 4, 0xFF);
    call.post = make_buf(&post, 4, 0xFF);
    call.perm = make_buf(NULL, padded * h * out_z, poison);
    call.scat = make_buf(NULL, padded * h * out_z, poison);
    call.y = make_buf(y, padded * h * in_z, 0xFF);
    call.w = tokens ? make_buf(w, slots * 4, 0xFF) : absent;
    call.pos = tokens ? make_buf(pos, slots * 4, 0xFF) : absent;
    call.shared = sh_z && tokens ? make_buf(sh, tokens * h * sh_z, 0xFF) : absent;
    call.out = tokens ? make_buf(NULL, tokens * h * out_z, poison) : absent;
    /* What the calls must leave: the reference's rows, poison past post. */
    unsigned char *want_perm = xmalloc(padded * h * out_z + 1), *got_perm = xmalloc(padded * h * out_z + 1);
    unsigned char *want_out = xmalloc(tokens * h * out_z + 1), *got_out = xmalloc(tokens * h * out_z + 1);
    unsigned char *got_scat = xmalloc(padded * h * out_z + 1);
    memset(want_perm, poison, padded * h * out_z);
    ref_permute(&call.pd, x, sorted, post, want_perm);
    ref_combine(&call.cd, y, w, pos, sh_z ? sh : NULL, want_out);
    char msg[1200] = "";
    size_t first = 0;
    moecl_status st = permute_run(ctx, &call, 0, NULL, NULL);
    if (st == MOECL_SUCCESS)
        st = scatter_run(ctx, &call, 0, NULL, NULL);
    if (st == MOECL_SUCCESS)
        st = combine_run(ctx, &call, 0, NULL, NULL);
    tl->runs++;
    if (st != MOECL_SUCCESS)
        fail(tl, "permute", v, shape, case_names[c], "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    else if (clFinish(queue) != CL_SUCCESS || !read_buf(&call.perm, got_perm, "permute's out", msg, sizeof(msg)) ||
             !read_buf(&call.scat, got_scat, "permute_scatter's out", msg, sizeof(msg)) ||
             !read_buf(&call.out, got_out, "combine's out", msg, sizeof(msg)))
        fail(tl, "permute", v, shape, case_names[c], "%s", msg);
    else if (!same_values(s->out, got_perm, want_perm, padded * h, &first))
        fail(tl, "permute", v, shape, case_names[c], "tokens %u: permute's row %zu column %zu differs", tokens,
             first / h, first % h);
    else if (!same_values(s->out, got_scat, want_perm, padded * h, &first))
        fail(tl, "permute", v, shape, case_names[c], "tokens %u: permute_scatter's row %zu column %zu differs",
             tokens, first / h, first % h);
    else if (!same_values(s->out, got_out, want_out, tokens * h, &first))
        fail(tl, "permute", v, shape, case_names[c], "tokens %u: combine's token %zu column %zu differs", tokens,
             first / h, first % h);
    if (opt.bench && c == (opt.small ? CASE_RANDOM : CASE_MANY) && !tl->variant_failed) {
        char text[160];
        snprintf(text, sizeof(text), "%s permute", shape);
        bench("permute", v, text, ctx, context_for(v->override, true), permute_run, &call);
        snprintf(text, sizeof(text), "%s permute_scatter", shape);
        bench("permute", v, text, ctx, context_for(v->override, true), scatter_run, &call);
        snprintf(text, sizeof(text), "%s combine", shape);
        bench("permute", v, text, ctx, context_for(v->override, true), combine_run, &call);
    }
    dbuf *bufs[] = {&call.x,   &call.sorted, &call.post, &call.perm,   &call.scat,
                    &call.y,   &call.w,      &call.pos,  &call.shared, &call.out};
    for (size_t i = 0; i < COUNT(bufs); i++)
        release(bufs[i]);
    void *mem[] = {ids, sorted, pos, counts, blocks, x, y, sh, w, want_perm, got_perm, got_scat, want_out, got_out};
    for (size_t i = 0; i < COUNT(mem); i++)
        free(mem[i]);
}

static void check_permute(tally *tl)
{
    static const char *const paths[] = {NULL};
    variant vs[4];
    const int nv = path_variants(vs, 4, paths, COUNT(paths));
    for (int vi = 0; vi < nv; vi++) {
        const variant *v = &vs[vi];
        if (!selected(v))
            continue;
        moecl_context *ctx = context_for(v->override, false);
        tl->variant_failed = false;
        int accepted = 0;
        for (size_t si = 0; si < COUNT(permute_shapes); si++) {
            const permute_shape *s = &permute_shapes[si];
            if (opt.small && s->large)
                continue;
            accepted++;
            char shape[128];
            snprintf(shape, sizeof(shape), "k=%u E=%u block=%u hidden=%u %s->%s shared %s", s->k, s->experts,
                     s->block, s->hidden, dtype_name(s->in), dtype_name(s->out),
                     s->shared < 0 ? "none" : dtype_name((moecl_dtype)s->shared));
            if (opt.list) {
                printf("permute [%s] %s\n", v->name, shape);
                continue;
            }
            for (int c = 0; c < NUM_CASES; c++)
                if (!(c == CASE_MANY && opt.small))
                    permute_check_case(tl, ctx, v, s, shape, (case_kind)c, (unsigned)vi, (unsigned)si);
        }
        finish_variant(tl, "permute", v, accepted);
    }
}

/* ---- main ---- */

typedef struct op_entry {
    const char *name;
    void (*check)(tally *);
} op_entry;

static const op_entry ops[] = {
    {"topk_gating", check_topk},
    {"grounded_router", check_grounded},
    {"moe_align", check_align},
    {"route_dispatch", check_route},
    {"ep_layout", check_ep},
    {"permute", check_permute},
};

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--seed N] [--op NAME] [--variant TEXT] [--small] [--bench] [--iterations N] [--list] "
            "[--verbose]\n"
            "  --op: topk_gating, grounded_router, moe_align, route_dispatch, ep_layout, permute\n"
            "  --variant: the variants whose text contains TEXT (the text FAIL and --list print)\n",
            argv0);
    exit(2);
}

int main(int argc, char **argv)
{
    opt.iterations = 50;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const bool more = i + 1 < argc;
        if (strcmp(a, "--seed") == 0 && more)
            opt.seed = strtoull(argv[++i], NULL, 0);
        else if (strcmp(a, "--op") == 0 && more)
            opt.op = argv[++i];
        else if (strcmp(a, "--variant") == 0 && more)
            opt.variant = argv[++i];
        else if (strcmp(a, "--iterations") == 0 && more && atoi(argv[i + 1]) >= 10)
            opt.iterations = atoi(argv[++i]);
        else if (strcmp(a, "--small") == 0)
            opt.small = true;
        else if (strcmp(a, "--bench") == 0)
            opt.bench = true;
        else if (strcmp(a, "--list") == 0)
            opt.list = true;
        else if (strcmp(a, "--verbose") == 0)
            opt.verbose = true;
        else
            usage(argv[0]);
    }
    bool known = !opt.op;
    for (size_t i = 0; i < COUNT(ops); i++)
        known |= opt.op && strcmp(opt.op, ops[i].name) == 0;
    if (!known)
        usage(argv[0]);
    if (!opt.seed)
        opt.seed = ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid() ^ (uint64_t)clock();
    printf("checkvariants: seed %llu (--seed repeats it)\n", (unsigned long long)opt.seed);
    fflush(stdout);

    /* The device: $MOECL_DEVICE or the default, as every suite takes it.
     * Every variant's context shares its cl_context, so that one buffer
     * serves them all. */
    moecl_context *base;
    moecl_status st = moecl_context_create(NULL, &base);
    if (st != MOECL_SUCCESS)
        die("moecl_context_create", NULL, st);
    cl_ctx = moecl_context_cl_context(base);
    cl_dev = moecl_context_device(base);
    clRetainContext(cl_ctx);
    cl_int err;
    queue = clCreateCommandQueue(cl_ctx, cl_dev, opt.bench ? CL_QUEUE_PROFILING_ENABLE : 0, &err);
    if (!queue)
        die("clCreateCommandQueue", NULL, err);
    if (opt.bench && !(plain_queue = clCreateCommandQueue(cl_ctx, cl_dev, 0, &err)))
        die("clCreateCommandQueue", NULL, err);
    char device[256];
    clGetDeviceInfo(cl_dev, CL_DEVICE_NAME, sizeof(device), device, NULL);
    device[sizeof(device) - 1] = '\0';
    printf("checkvariants: device %s\n", device);
    moecl_context_destroy(base);

    const double t0 = now_s();
    for (size_t i = 0; i < COUNT(ops); i++) {
        if (opt.op && strcmp(opt.op, ops[i].name) != 0)
            continue;
        tally t = {0, 0, 0, 0, false};
        const double t1 = now_s();
        ops[i].check(&t);
        if (!opt.list)
            printf("%-15s %3d variants checked, %3d passed, %2d refused by the device (%d runs, %.1f s)\n",
                   ops[i].name, t.variants, t.passed, t.refused, t.runs, now_s() - t1);
        fflush(stdout);
    }
    for (int i = 0; i < num_ctxs; i++) {
        if (ctxs[i].plain != ctxs[i].ctx)
            moecl_context_destroy(ctxs[i].plain);
        moecl_context_destroy(ctxs[i].ctx);
    }
    if (plain_queue)
        clReleaseCommandQueue(plain_queue);
    clReleaseCommandQueue(queue);
    clReleaseContext(cl_ctx);
    if (!opt.list)
        printf("checkvariants: %s in %.1f s\n", failures ? "FAILED" : "all variants passed", now_s() - t0);
    return failures ? 1 : 0;
}
