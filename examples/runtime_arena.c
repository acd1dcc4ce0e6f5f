/* runtime_arena: moecl inside a runtime that owns its OpenCL objects.
 *
 * An inference runtime typically creates its own cl_context and in-order
 * queue, allocates one large device buffer (an arena) and places every
 * tensor at a byte offset inside it. This program plays such a runtime:
 *
 *   1. picks a device (the first GPU or accelerator, else the first CPU:
 *      what moecl_context_create(NULL, ...) picks when MOECL_DEVICE is
 *      unset) and creates its own context and in-order queue;
 *   2. allocates ONE arena buffer and lays out in it, at byte offsets, the
 *      inputs and outputs of both ops;
 *   3. adopts its context and queue with moecl_context_create_from_cl;
 *   4. uploads the inputs, runs top-k gating after the uploads, the
 *      grounded router after top-k gating (each call waits on the previous
 *      call's event, as it must on an out-of-order queue), and reads the
 *      outputs back after the grounded router;
 *   5. checks a few rows against values worked out by hand, prints a short
 *      report and releases everything.
 *
 * Exit status: 0 ok, 1 a call failed or a value is wrong, 77 no OpenCL
 * device (meson's "skipped"). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

/* Top-k gating: 4 tokens over 8 experts, top 2, softmax, with a bias. */
#define T 4
#define E 8
#define K 2
/* The grounded router: the same tokens, hidden size 4, the same experts. */
#define H 4
#define ALPHA 0.5f

/* ---- 1. the runtime's own device, context and queue ---- */

static cl_device_id pick_device(void)
{
    cl_platform_id platforms[16];
    cl_uint np = 0;
    if (clGetPlatformIDs(16, platforms, &np) != CL_SUCCESS)
        return NULL;
    static const cl_device_type wanted[2] = {CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR, CL_DEVICE_TYPE_CPU};
    for (int w = 0; w < 2; w++)
        for (cl_uint p = 0; p < np && p < 16; p++) {
            cl_device_id d;
            cl_uint nd = 0;
            if (clGetDeviceIDs(platforms[p], wanted[w], 1, &d, &nd) == CL_SUCCESS && nd > 0)
                return d;
        }
    return NULL;
}

/* ---- 2. the arena's layout ---- */

typedef struct region {
    const char *name;
    size_t bytes, offset;
} region;

enum {
    R_LOGITS,   /* float [T][E]    top-k gating input */
    R_BIAS,     /* float [E]       correction bias */
    R_WEIGHTS,  /* float [T][K]    top-k gating output */
    R_IDS,      /* int32 [T][K]    top-k gating output */
    R_HIDDEN,   /* float [T][H]    grounded router input */
    R_RLOGITS,  /* float [T][E]    grounded router input */
    R_GROUND,   /* float [E][H]    grounded router input */
    R_PAIRS,    /* float [T][K][2] grounded router output: (index, weight) */
    R_GWEIGHTS, /* float [T][K]    grounded router output */
    R_GIDS,     /* int32 [T][K]    grounded router output */
    NUM_REGIONS
};

/* Each tensor starts on a 256-byte boundary (moecl needs only a multiple
 * of the element size); the first 1 KiB stands for the runtime's other
 * tensors, so that no offset is 0. */
static size_t lay_out(region *r)
{
    const region spec[NUM_REGIONS] = {
        {"logits", T * E * 4, 0},   {"bias", E * 4, 0},          {"topk weights", T * K * 4, 0},
        {"topk ids", T * K * 4, 0}, {"hidden", T * H * 4, 0},    {"router logits", T * E * 4, 0},
        {"ground", E * H * 4, 0},   {"pairs", T * K * 2 * 4, 0}, {"grounded weights", T * K * 4, 0},
        {"grounded ids", T * K * 4, 0},
    };
    size_t at = 1024;
    for (int i = 0; i < NUM_REGIONS; i++) {
        r[i] = spec[i];
        r[i].offset = at;
        at = (at + r[i].bytes + 255) / 256 * 256;
    }
    return at;
}

/* ---- 5. checking by hand ---- */

static int failures;

static void expect(const char *what, int row, int slot, double got, double want)
{
    const bool ok = fabs(got - want) <= 1e-5;
    if (!ok) {
        printf("  WRONG %s row %d slot %d: %.7f, want %.7f\n", what, row, slot, got, want);
        failures++;
    }
}

static void expect_id(const char *what, int row, int slot, int got, int want)
{
    if (got != want) {
        printf("  WRONG %s row %d slot %d: id %d, want %d\n", what, row, slot, got, want);
        failures++;
    }
}

static int fail_cl(const char *what, cl_int err)
{
    fprintf(stderr, "runtime_arena: %s failed (OpenCL error %d)\n", what, err);
    return 1;
}

int main(void)
{
    /* 1. The runtime's objects. */
    cl_device_id device = pick_device();
    if (!device) {
        fprintf(stderr, "runtime_arena: no OpenCL device (install pocl-opencl-icd for CPUs)\n");
        return 77;
    }
    char name[256] = "";
    clGetDeviceInfo(device, CL_DEVICE_NAME, sizeof(name), name, NULL);
    cl_int err;
    cl_context context = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    if (!context)
        return fail_cl("clCreateContext", err);
    cl_command_queue queue = clCreateCommandQueue(context, device, 0, &err); /* in-order */
    if (!queue)
        return fail_cl("clCreateCommandQueue", err);

    /* 2. One arena; every tensor at an offset inside it. */
    region r[NUM_REGIONS];
    const size_t arena_bytes = lay_out(r);
    cl_mem arena = clCreateBuffer(context, CL_MEM_READ_WRITE, arena_bytes, NULL, &err);
    if (!arena)
        return fail_cl("clCreateBuffer", err);
#define AT(i) ((moecl_buffer){arena, r[i].offset})

    /* 3. Adopt the context and the queue. moecl retains them; the runtime
     *    keeps its own references and releases them itself. */
    moecl_context *ctx;
    moecl_status st = moecl_context_create_from_cl(context, device, queue, &ctx);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "runtime_arena: moecl_context_create_from_cl: %s: %s\n", moecl_status_string(st),
                moecl_context_error(NULL));
        return 1;
    }

    /* Inputs with answers one can work out by hand.
     * Top-k gating: in row t, expert 3t%8 has logit 4, expert (3t+1)%8 has
     * logit 2, the others 0. The bias is -1 for expert 0 and 0 elsewhere.
     * Grounded router: hidden row t is 3 at position t, 0 elsewhere; ground
     * row e is 1 at position e-4 for experts 4..7 and 0 for experts 0..3; the
     * router logits are 1 for expert 0 and 0 elsewhere. So for token t,
     * g[0] = 1, g[t+4] = 0 + 0.5 * 3 * 1 = 1.5, every other g is 0. */
    float logits[T][E] = {{0}}, bias[E] = {0}, hidden[T][H] = {{0}}, rlogits[T][E] = {{0}}, ground[E][H] = {{0}};
    for (int t = 0; t < T; t++) {
        logits[t][3 * t % E] = 4.0f;
        logits[t][(3 * t + 1) % E] = 2.0f;
        hidden[t][t] = 3.0f;
        rlogits[t][0] = 1.0f;
    }
    bias[0] = -1.0f;
    for (int e = 4; e < E; e++)
        ground[e][e - 4] = 1.0f;

    /* 4. Upload, route, route, read back: each step waits on the last. */
    const struct {
        int region;
        const void *data;
    } uploads[5] = {{R_LOGITS, logits}, {R_BIAS, bias}, {R_HIDDEN, hidden}, {R_RLOGITS, rlogits}, {R_GROUND, ground}};
    cl_event written[5];
    for (int i = 0; i < 5; i++)
        if ((err = clEnqueueWriteBuffer(queue, arena, CL_FALSE, r[uploads[i].region].offset,
                                        r[uploads[i].region].bytes, uploads[i].data, 0, NULL, &written[i])) !=
            CL_SUCCESS)
            return fail_cl("clEnqueueWriteBuffer", err);

    moecl_topk_gating_desc gating = moecl_topk_gating_desc_init(T, E, K); /* softmax, f32 */
    cl_event gated, routed;
    st = moecl_topk_gating(ctx, &gating, AT(R_LOGITS), AT(R_BIAS), AT(R_WEIGHTS), AT(R_IDS), 5, written, &gated);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "runtime_arena: moecl_topk_gating: %s: %s\n", moecl_status_string(st),
                moecl_context_error(ctx));
        return 1;
    }
    moecl_grounded_router_desc grounded = moecl_grounded_router_desc_init(T, H, E, ALPHA); /* top 2, f32 */
    st = moecl_grounded_router(ctx, &grounded, AT(R_HIDDEN), AT(R_RLOGITS), AT(R_GROUND), AT(R_PAIRS),
                               AT(R_GWEIGHTS), AT(R_GIDS), 1, &gated, &routed);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "runtime_arena: moecl_grounded_router: %s: %s\n", moecl_status_string(st),
                moecl_context_error(ctx));
        return 1;
    }
    /* The outputs lie in the arena from R_WEIGHTS to the end of R_GIDS (the
     * grounded router's inputs in between are read back too: one copy). */
    const size_t from = r[R_WEIGHTS].offset, span = r[R_GIDS].offset + r[R_GIDS].bytes - from;
    unsigned char *back = malloc(span);
    if (!back) {
        fprintf(stderr, "runtime_arena: out of memory\n");
        return 1;
    }
    cl_event read;
    if ((err = clEnqueueReadBuffer(queue, arena, CL_FALSE, from, span, back, 1, &routed, &read)) != CL_SUCCESS)
        return fail_cl("clEnqueueReadBuffer", err);
    if ((err = clWaitForEvents(1, &read)) != CL_SUCCESS)
        return fail_cl("waiting for the read-back", err);
#define BACK(i, type) ((const type *)(back + r[i].offset - from))
    const float *w = BACK(R_WEIGHTS, float), *gw = BACK(R_GWEIGHTS, float), *pairs = BACK(R_PAIRS, float);
    const int32_t *ids = BACK(R_IDS, int32_t), *gids = BACK(R_GIDS, int32_t);

    /* 5. The report, and the rows checked by hand. */
    printf("runtime_arena: moecl %s on %s\n", moecl_version(), name);
    printf("arena: one buffer of %zu bytes\n", arena_bytes);
    for (int i = 0; i < NUM_REGIONS; i++)
        printf("  %-17s at offset %5zu, %4zu bytes\n", r[i].name, r[i].offset, r[i].bytes);
    printf("top-k gating (softmax, top %d of %d, bias -1 on expert 0):\n", K, E);
    for (int t = 0; t < T; t++)
        printf("  token %d: experts %d, %d  weights %.6f, %.6f\n", t, ids[t * K], ids[t * K + 1], w[t * K],
               w[t * K + 1]);
    printf("grounded router (alpha %.1f, top %d; pairs = (index, weight)):\n", (double)ALPHA, K);
    for (int t = 0; t < T; t++)
        printf("  token %d: (%.0f, %.6f) (%.0f, %.6f)\n", t, pairs[t * 4], pairs[t * 4 + 1], pairs[t * 4 + 2],
               pairs[t * 4 + 3]);

    /* Top-k gating. A row's softmax has e^4, e^2 and six e^0 terms. Row 1:
     * experts 3 (logit 4) and 4 (logit 2). Row 0: expert 0 has logit 4,
     * but its bias of -1 puts its selection score (0.80 - 1) below every
     * other expert's, so the row picks expert 1 (logit 2) and then, among
     * the six experts tied at logit 0, the lowest index, 2. The weights are
     * the unbiased scores. */
    const double S = exp(4.0) + exp(2.0) + 6.0;
    expect_id("topk", 0, 0, ids[0], 1);
    expect_id("topk", 0, 1, ids[1], 2);
    expect("topk weight", 0, 0, w[0], exp(2.0) / S);
    expect("topk weight", 0, 1, w[1], 1.0 / S);
    expect_id("topk", 1, 0, ids[2], 3);
    expect_id("topk", 1, 1, ids[3], 4);
    expect("topk weight", 1, 0, w[2], exp(4.0) / S);
    expect("topk weight", 1, 1, w[3], exp(2.0) / S);
    /* Grounded router: token t picks expert t+4 (g = 1.5) then expert 0
     * (g = 1), with a softmax over the two: 1 / (1 + e^-0.5) and the rest.
     * The three outputs agree. */
    const double hi = 1.0 / (1.0 + exp(-0.5));
    for (int t = 0; t < T; t++) {
        expect_id("grounded", t, 0, gids[t * K], t + 4);
        expect_id("grounded", t, 1, gids[t * K + 1], 0);
        expect("grounded weight", t, 0, gw[t * K], hi);
        expect("grounded weight", t, 1, gw[t * K + 1], 1.0 - hi);
        for (int j = 0; j < K; j++) {
            expect_id("pairs", t, j, (int)pairs[(t * K + j) * 2], gids[t * K + j]);
            expect("pairs weight", t, j, pairs[(t * K + j) * 2 + 1], gw[t * K + j]);
        }
    }
    printf("%s\n", failures ? "FAILED" : "ok: the checked rows match the values worked out by hand");

    /* Release: the events, then moecl (after the queue has drained), then
     * the runtime's own objects. */
    for (int i = 0; i < 5; i++)
        clReleaseEvent(written[i]);
    clReleaseEvent(gated);
    clReleaseEvent(routed);
    clReleaseEvent(read);
    clFinish(queue);
    moecl_context_destroy(ctx);
    clReleaseMemObject(arena);
    clReleaseCommandQueue(queue);
    clReleaseContext(context);
    free(back);
    return failures ? 1 : 0;
}
