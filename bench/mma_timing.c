/* The grounded router at production shapes per dtype and precision (the
 * tensor-core kernel where the device has it, docs/routing.md section 4):
 * one call checked against the float64 reference on its first rows, then
 * device time (a marker before the call to the call's end, median of 100
 * calls on a profiling queue) with TFLOP/s of the GEMM and GB/s of the
 * hidden states and the ground table read once.
 *
 * Built by meson (bench/meson.build) as build/bench/mma_timing.
 * Run: build/bench/mma_timing [CASE...], CASE TxHxE:K:DTYPE[:PRECISION],
 * DTYPE f32|f16|bf16, PRECISION fp32|tf32|3xtf32 (default fp32); default
 * 16384x4096x128 top 8 in each dtype and precision and the DeepSeek-V3 router
 * (hidden 7168, 256 experts, bf16) at 1, 64 and 4083 tokens. Device: as
 * moecl_context_create(NULL) picks it ($MOECL_DEVICE). Exit status 1 if a
 * check or a call failed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

#include "reference.h"

#define CALLS 100
#define CHECK_ROWS 512u

static const char *const default_cases[] = {
    "16384x4096x128:8:bf16",      "16384x4096x128:8:f16",     "16384x4096x128:8:f32:tf32",
    "16384x4096x128:8:f32:3xtf32", "16384x4096x128:8:f32:fp32", "4083x7168x256:8:bf16",
    "64x7168x256:8:bf16",          "1x7168x256:8:bf16",
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

/* Uniform on [-1, 1). */
static float uniform(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(rng_state >> 11) * 0x1p-52 - 1.0);
}

/* n values of dtype, uniform on [-scale, scale). */
static void *random_tensor(moecl_dtype dt, size_t n, float scale)
{
    const size_t size = dt == MOECL_F32 ? 4 : 2;
    unsigned char *p = malloc(n * size);
    if (!p)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        const float v = scale * uniform();
        if (dt == MOECL_F32) {
            memcpy(p + 4 * i, &v, 4);
        } else {
            uint32_t u;
            memcpy(&u, &v, 4);
            /* bf16: the top half (truncated); f16: a value exact in f16 (the
             * 11 top bits of a number of magnitude in [2^-14, 1)). */
            uint16_t w = (uint16_t)(u >> 16);
            if (dt == MOECL_F16) {
                const float a = fabsf(v) < 0x1p-14f ? 0.0f : fabsf(v);
                int e;
                const float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
                const uint32_t mant = (uint32_t)(m * 2048.0f) & 0x3ffu;
                w = a == 0.0f ? 0 : (uint16_t)(((uint32_t)(e - 1 + 15) << 10) | mant);
                if (v < 0)
                    w |= 0x8000u;
            }
            memcpy(p + 2 * i, &w, 2);
        }
    }
    return p;
}

static cl_mem make(cl_context cl, size_t bytes, const void *data)
{
    cl_int err;
    cl_mem m = clCreateBuffer(cl, CL_MEM_READ_WRITE | (data ? CL_MEM_COPY_HOST_PTR : 0), bytes, (void *)data, &err);
    if (!m)
        fprintf(stderr, "clCreateBuffer of %zu bytes: %d\n", bytes, err);
    return m;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static bool parse_case(const char *text, moecl_grounded_router_desc *d)
{
    unsigned t, h, e, k;
    char dtype[8] = "", prec[8] = "fp32";
    if (sscanf(text, "%ux%ux%u:%u:%7[a-z0-9]:%7[a-z0-9]", &t, &h, &e, &k, dtype, prec) < 5)
        return false;
    *d = moecl_grounded_router_desc_init(t, h, e, 1.0f);
    d->top_k = k;
    d->hidden_dtype = strcmp(dtype, "f32") == 0 ? MOECL_F32 : strcmp(dtype, "f16") == 0 ? MOECL_F16 : MOECL_BF16;
    d->precision = strcmp(prec, "tf32") == 0     ? MOECL_PRECISION_TF32
                   : strcmp(prec, "3xtf32") == 0 ? MOECL_PRECISION_3XTF32
                                                 : MOECL_PRECISION_FP32;
    return strcmp(dtype, "f32") == 0 || strcmp(dtype, "f16") == 0 || strcmp(dtype, "bf16") == 0;
}

/* One case: check, time, print. False if anything failed. */
static bool run_case(moecl_context *ctx, const char *text)
{
    moecl_grounded_router_desc d;
    if (!parse_case(text, &d)) {
        fprintf(stderr, "bad case %s (TxHxE:K:DTYPE[:PRECISION])\n", text);
        return false;
    }
    const size_t T = d.num_tokens, H = d.hidden_dim, E = d.num_experts, K = d.top_k;
    const size_t in_size = d.hidden_dtype == MOECL_F32 ? 4 : 2;
    void *hidden = random_tensor(d.hidden_dtype, T * H, 1.0f / sqrtf((float)H));
    void *ground = random_tensor(d.hidden_dtype, E * H, 1.0f);
    float *logits = random_tensor(MOECL_F32, T * E, 0.1f);
    float *weights = malloc(T * K * 4);
    int32_t *ids = malloc(T * K * 4);
    cl_context cl = moecl_context_cl_context(ctx);
    cl_mem m[5] = {make(cl, T * H * in_size, hidden), make(cl, T * E * 4, logits), make(cl, E * H * in_size, ground),
                   make(cl, T * K * 4, NULL), make(cl, T * K * 4, NULL)};
    bool ok = hidden && ground && logits && weights && ids && m[0] && m[1] && m[2] && m[3] && m[4];
    const moecl_buffer none = {NULL, 0};
    double times[CALLS];
    int timed = 0;
    char msg[512] = "";
    int bad = -1;
    if (ok && moecl_grounded_router_prepare(ctx, &d) != MOECL_SUCCESS) {
        fprintf(stderr, "%s: prepare: %s\n", text, moecl_context_error(ctx));
        ok = false;
    }
    for (int i = -1; ok && i < CALLS; i++) {
        cl_event marker = NULL, done = NULL;
        cl_command_queue q = moecl_context_queue(ctx);
        clEnqueueMarkerWithWaitList(q, 0, NULL, &marker);
        moecl_status st = moecl_grounded_router(ctx, &d, (moecl_buffer){m[0], 0}, (moecl_buffer){m[1], 0},
                                                (moecl_buffer){m[2], 0}, none, (moecl_buffer){m[3], 0},
                                                (moecl_buffer){m[4], 0}, 0, NULL, &done);
        if (st != MOECL_SUCCESS) {
            fprintf(stderr, "%s: %s: %s\n", text, moecl_status_string(st), moecl_context_error(ctx));
            ok = false;
        } else {
            clWaitForEvents(1, &done);
            cl_ulong start = 0, end = 0;
            clGetEventProfilingInfo(marker, CL_PROFILING_COMMAND_END, sizeof(start), &start, NULL);
            clGetEventProfilingInfo(done, CL_PROFILING_COMMAND_END, sizeof(end), &end, NULL);
            if (i >= 0)
                times[timed++] = (double)(end - start) * 1e-3;
        }
        if (marker)
            clReleaseEvent(marker);
        if (done)
            clReleaseEvent(done);
        if (ok && i == -1) {
            /* The first rows against the reference (rows are independent). */
            clEnqueueReadBuffer(q, m[3], CL_TRUE, 0, T * K * 4, weights, 0, NULL, NULL);
            clEnqueueReadBuffer(q, m[4], CL_TRUE, 0, T * K * 4, ids, 0, NULL, NULL);
            moecl_grounded_router_desc part = d;
            part.num_tokens = T < CHECK_ROWS ? (uint32_t)T : CHECK_ROWS;
            bad = ref_check_grounded_router(&part, hidden, logits, ground, NULL, weights, ids, msg, sizeof(msg));
            if (bad != 0)
                ok = false;
        }
    }
    if (timed > 0) {
        qsort(times, (size_t)timed, sizeof(double), cmp_double);
        const double us = times[timed / 2];
        const double flops = 2.0 * (double)T * (double)H * (double)E;
        const double bytes = (double)(T * H + E * H) * (double)in_size + (double)(T * E * 4 + T * K * 8);
        printf("%-30s dev_us %9.2f (p10 %9.2f p90 %9.2f)  %7.1f TFLOP/s  %7.1f GB/s  check %s\n", text, us,
               times[timed / 10], times[timed * 9 / 10], flops / us * 1e-6, bytes / us * 1e-3,
               bad == 0 ? "ok" : "FAIL");
    } else {
        printf("%-30s failed  check %s\n", text, bad == 0 ? "ok" : "FAIL");
    }
    if (bad != 0)
        printf("  %d bad rows of the first %u: %s\n", bad, CHECK_ROWS, msg);
    for (int i = 0; i < 5; i++)
        if (m[i])
            clReleaseMemObject(m[i]);
    free(hidden);
    free(ground);
    free(logits);
    free(weights);
    free(ids);
    return ok;
}

int main(int argc, char **argv)
{
    moecl_context *probe = NULL, *ctx = NULL;
    if (moecl_context_create(NULL, &probe) != MOECL_SUCCESS) {
        fprintf(stderr, "no device: %s\n", moecl_context_error(NULL));
        return 1;
    }
    cl_device_id dev = moecl_context_device(probe);
    cl_context cl = moecl_context_cl_context(probe);
    cl_int err;
    cl_command_queue pq = clCreateCommandQueue(cl, dev, CL_QUEUE_PROFILING_ENABLE, &err);
    if (!pq || moecl_context_create_from_cl(cl, dev, pq, &ctx) != MOECL_SUCCESS) {
        fprintf(stderr, "profiling queue: %d %s\n", err, moecl_context_error(NULL));
        return 1;
    }
    bool ok = true;
    const int n = argc > 1 ? argc - 1 : (int)(sizeof(default_cases) / sizeof(default_cases[0]));
    for (int i = 0; i < n; i++)
        ok = run_case(ctx, argc > 1 ? argv[i + 1] : default_cases[i]) && ok;
    moecl_context_info info;
    if (moecl_context_query_info(ctx, &info) == MOECL_SUCCESS)
        printf("inline PTX: %s (%s)\n", info.inline_ptx ? "on" : "off", info.inline_ptx_reason);
    moecl_context_destroy(ctx);
    moecl_context_destroy(probe);
    clReleaseCommandQueue(pq);
    return ok ? 0 : 1;
}
