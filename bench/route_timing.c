/* moecl_route_dispatch against moecl_topk_gating + moecl_moe_align back to
 * back, and moecl_grounded_route_dispatch against moecl_grounded_router +
 * moecl_moe_align, on one device: first both on the same inputs, outputs
 * compared byte for byte; then, in interleaved rounds (route, pair, route,
 * pair), device time (the span from a marker enqueued before the call to
 * the end of its last command, median of 200 calls on a profiling queue)
 * and wall time per call (1000 calls back to back on a queue without
 * profiling, one clFinish). Top-k: softmax, fp32, top_k 8; grounded: fp32,
 * top_k 2, alpha 0.5 (moecl-bench's grounded seed); block 64.
 *
 * Built by meson (bench/meson.build) as build/bench/route_timing.
 * Run: build/bench/route_timing [SHAPE...], SHAPE TOKENSxEXPERTS (top-k) or
 * TOKENSxHIDDENxEXPERTS (grounded); default 1x128 129x128 256x128 520x128
 * 1019x128 13526x256 1x128x16 129x128x16 256x128x16 4096x128x16. Device: as
 * moecl_context_create(NULL) picks it ($MOECL_DEVICE). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <moecl/moecl.h>

#define ROUNDS 2
#define DEVICE_CALLS 200
#define WALL_CALLS 1000

/* One case: top-k gating's desc, or the grounded router's where grounded. */
typedef struct routing {
    bool grounded;
    moecl_topk_gating_desc topk;
    moecl_grounded_router_desc g;
    uint32_t tokens, experts, top_k;
} routing;

/* The inputs (gating; or hidden, logits, ground) and the outputs. */
typedef struct bufs {
    cl_mem in[3], weights, ids, counts, sorted, blocks, post, slots, invalid;
    size_t sizes[8]; /* the outputs' bytes, weights to invalid */
} bufs;

static cl_mem make(cl_context cl, size_t bytes, const void *data)
{
    cl_int err;
    cl_mem m = clCreateBuffer(cl, CL_MEM_READ_WRITE | (data ? CL_MEM_COPY_HOST_PTR : 0), bytes, (void *)data, &err);
    if (!m) {
        fprintf(stderr, "clCreateBuffer of %zu bytes: %d\n", bytes, err);
        exit(1);
    }
    return m;
}

static moecl_buffer at(cl_mem m) { return (moecl_buffer){m, 0}; }

static moecl_status call(moecl_context *ctx, const routing *d, bool pair, const bufs *b, cl_event after,
                         cl_event *done)
{
    const cl_uint n = after ? 1 : 0;
    const cl_event *w = after ? &after : NULL;
    const moecl_buffer none = {NULL, 0};
    if (!pair && d->grounded)
        return moecl_grounded_route_dispatch(ctx, &d->g, 64, at(b->in[0]), at(b->in[1]), at(b->in[2]), at(b->weights),
                                             at(b->ids), at(b->counts), at(b->sorted), at(b->blocks), at(b->post),
                                             at(b->slots), at(b->invalid), n, w, done);
    if (!pair)
        return moecl_route_dispatch(ctx, &d->topk, 64, at(b->in[0]), none, at(b->weights), at(b->ids),
                                    at(b->counts), at(b->sorted), at(b->blocks), at(b->post), at(b->slots),
                                    at(b->invalid), n, w, done);
    const moecl_moe_align_desc a = moecl_moe_align_desc_init(d->tokens, d->top_k, d->experts, 64);
    moecl_status st = d->grounded ? moecl_grounded_router(ctx, &d->g, at(b->in[0]), at(b->in[1]), at(b->in[2]), none,
                                                          at(b->weights), at(b->ids), n, w, NULL)
                                  : moecl_topk_gating(ctx, &d->topk, at(b->in[0]), none, at(b->weights), at(b->ids),
                                                      n, w, NULL);
    if (st == MOECL_SUCCESS)
        st = moecl_moe_align(ctx, &a, at(b->ids), at(b->counts), at(b->sorted), at(b->blocks), at(b->post),
                             at(b->slots), at(b->invalid), 0, NULL, done);
    return st;
}

static void check(moecl_context *ctx, moecl_status st)
{
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "%s: %s\n", moecl_status_string(st), moecl_context_error(ctx));
        exit(1);
    }
}

static int cmp_double(const void *x, const void *y)
{
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Median device span of DEVICE_CALLS calls (after 20 untimed). */
static double device_us(moecl_context *ctx, const routing *d, bool pair, const bufs *b)
{
    static double t[DEVICE_CALLS];
    for (int i = -20; i < DEVICE_CALLS; i++) {
        cl_event marker, done;
        if (clEnqueueMarkerWithWaitList(moecl_context_queue(ctx), 0, NULL, &marker) != CL_SUCCESS)
            exit(1);
        check(ctx, call(ctx, d, pair, b, marker, &done));
        clWaitForEvents(1, &done);
        cl_ulong start = 0, end = 0;
        clGetEventProfilingInfo(marker, CL_PROFILING_COMMAND_END, sizeof(start), &start, NULL);
        clGetEventProfilingInfo(done, CL_PROFILING_COMMAND_END, sizeof(end), &end, NULL);
        if (i >= 0)
            t[i] = (double)(end - start) / 1e3;
        clReleaseEvent(marker);
        clReleaseEvent(done);
    }
    qsort(t, DEVICE_CALLS, sizeof(t[0]), cmp_double);
    return t[DEVICE_CALLS / 2];
}

static double wall_us(moecl_context *ctx, const routing *d, bool pair, const bufs *b)
{
    for (int i = 0; i < 20; i++)
        check(ctx, call(ctx, d, pair, b, NULL, NULL));
    clFinish(moecl_context_queue(ctx));
    const double t0 = now_us();
    for (int i = 0; i < WALL_CALLS; i++)
        check(ctx, call(ctx, d, pair, b, NULL, NULL));
    clFinish(moecl_context_queue(ctx));
    return (now_us() - t0) / WALL_CALLS;
}

/* Every output of the last call, for the comparison. */
static unsigned char *outputs(moecl_context *ctx, const bufs *b, size_t *total)
{
    const cl_mem mems[8] = {b->weights, b->ids, b->counts, b->sorted, b->blocks, b->post, b->slots, b->invalid};
    *total = 0;
    for (int i = 0; i < 8; i++)
        *total += b->sizes[i];
    unsigned char *all = malloc(*total), *p = all;
    for (int i = 0; i < 8; i++) {
        clEnqueueReadBuffer(moecl_context_queue(ctx), mems[i], CL_TRUE, 0, b->sizes[i], p, 0, NULL, NULL);
        p += b->sizes[i];
    }
    return all;
}

int main(int argc, char **argv)
{
    static const char *defaults[] = {"1x128",     "129x128",  "256x128",    "520x128",    "1019x128",
                                     "13526x256", "1x128x16", "129x128x16", "256x128x16", "4096x128x16"};
    const char **shapes = argc > 1 ? (const char **)argv + 1 : defaults;
    const int num_shapes = argc > 1 ? argc - 1 : (int)(sizeof(defaults) / sizeof(defaults[0]));
    moecl_context *probe;
    if (moecl_context_create(NULL, &probe) != MOECL_SUCCESS) {
        fprintf(stderr, "%s\n", moecl_context_error(NULL));
        return 1;
    }
    cl_device_id dev = moecl_context_device(probe);
    cl_context cl = moecl_context_cl_context(probe);
    char name[256] = "";
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof(name), name, NULL);
    cl_int err;
    cl_command_queue pq = clCreateCommandQueue(cl, dev, CL_QUEUE_PROFILING_ENABLE, &err);
    moecl_context *prof, *plain;
    if (!pq || moecl_context_create_from_cl(cl, dev, pq, &prof) != MOECL_SUCCESS ||
        moecl_context_create_from_cl(cl, dev, NULL, &plain) != MOECL_SUCCESS) {
        fprintf(stderr, "contexts: %d %s\n", err, moecl_context_error(NULL));
        return 1;
    }
    printf("device: %s (moecl %s)\n", name, moecl_version());
    printf("%-12s %5s | %-24s | %-24s | bits\n", "shape", "round", "route dispatch dev/wall us",
           "routing+moe_align dev/wall us");
    for (int s = 0; s < num_shapes; s++) {
        unsigned t, e, h = 0;
        const int fields = sscanf(shapes[s], "%ux%ux%u", &t, &e, &h);
        if (fields == 3) {
            const unsigned experts = h;
            h = e;
            e = experts;
        }
        if (fields < 2 || !t || e < 8) {
            fprintf(stderr, "bad shape %s (TOKENSxEXPERTS or TOKENSxHIDDENxEXPERTS)\n", shapes[s]);
            return 2;
        }
        routing d = {fields == 3, moecl_topk_gating_desc_init(t, e, 8), moecl_grounded_router_desc_init(t, h, e, 0.5f),
                     t, e, fields == 3 ? 2 : 8};
        const moecl_moe_align_desc a = moecl_moe_align_desc_init(t, d.top_k, e, 64);
        const size_t max_padded = (size_t)moecl_moe_align_max_padded(&a), nk = (size_t)t * d.top_k;
        /* Inputs uniform on [-5, 5) (the hidden states and ground table
         * scaled by 1 / sqrt(hidden), so that the dot products are of order
         * one): the logits, then hidden, then ground. */
        const size_t n_in[3] = {(size_t)t * e, (size_t)t * h, (size_t)e * h};
        float *host[3];
        uint64_t seed = 12345 + s;
        for (int i = 0; i < 3; i++) {
            host[i] = malloc((n_in[i] ? n_in[i] : 1) * 4);
            const float scale = i == 0 ? 1.0f : 1.0f / sqrtf((float)h);
            for (size_t j = 0; j < n_in[i]; j++) {
                seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                host[i][j] = ((float)((seed >> 40) % 20000) / 2000.0f - 5.0f) * scale;
            }
        }
        bufs b = {{d.grounded ? make(cl, n_in[1] * 4, host[1]) : make(cl, n_in[0] * 4, host[0]),
                   d.grounded ? make(cl, n_in[0] * 4, host[0]) : NULL, d.grounded ? make(cl, n_in[2] * 4, host[2]) : NULL},
                  make(cl, nk * 4, NULL),
                  make(cl, nk * 4, NULL),
                  make(cl, e * 4, NULL),
                  make(cl, max_padded * 4, NULL),
                  make(cl, max_padded / 64 * 4, NULL),
                  make(cl, 4, NULL),
                  make(cl, nk * 4, NULL),
                  make(cl, 4, NULL),
                  {nk * 4, nk * 4, e * 4, max_padded * 4, max_padded / 64 * 4, 4, nk * 4, 4}};
        size_t n1, n2;
        check(plain, call(plain, &d, false, &b, NULL, NULL));
        unsigned char *one = outputs(plain, &b, &n1);
        check(plain, call(plain, &d, true, &b, NULL, NULL));
        unsigned char *two = outputs(plain, &b, &n2);
        const bool same = n1 == n2 && memcmp(one, two, n1) == 0;
        for (int r = 0; r < ROUNDS; r++) {
            const double rd = device_us(prof, &d, false, &b), rw = wall_us(plain, &d, false, &b);
            const double pd = device_us(prof, &d, true, &b), pw = wall_us(plain, &d, true, &b);
            printf("%-12s %5d | %10.2f / %-11.2f | %10.2f / %-11.2f | %s\n", shapes[s], r + 1, rd, rw, pd, pw,
                   same ? "identical" : "DIFFER");
        }
        free(one);
        free(two);
        for (int i = 0; i < 3; i++)
            free(host[i]);
        const cl_mem all[11] = {b.in[0], b.in[1], b.in[2], b.weights, b.ids,    b.counts,
                                b.sorted, b.blocks, b.post,  b.slots,   b.invalid};
        for (int i = 0; i < 11; i++)
            if (all[i])
                clReleaseMemObject(all[i]);
        if (!same)
            return 1;
    }
    moecl_context_destroy(prof);
    moecl_context_destroy(plain);
    clReleaseCommandQueue(pq);
    moecl_context_destroy(probe);
    return 0;
}
