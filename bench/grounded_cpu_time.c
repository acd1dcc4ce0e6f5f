/* The grounded router's cost per call on a CPU device as processor time:
 * the process's user + system time over one blocking call (enqueue, wait)
 * divided by the number of online cores, best of N calls after one
 * warm-up, beside the wall time of the same calls. On a machine whose
 * cores other work shares, wall and profiling times measure the sharing
 * as much as the kernel; the processor time counts only the cycles the
 * call's threads ran (bench/README.md). It does
 * not suit a runtime whose threads spin while they wait (OpenMP's
 * default), so PyTorch is timed by bench/torch_reference.py instead.
 *
 * Built by meson (bench/meson.build) as build/bench/grounded_cpu_time.
 * Run: build/bench/grounded_cpu_time [TOKENS HIDDEN EXPERTS TOP_K [CALLS]],
 * default 16384 4096 128 8 5: f32, alpha 0.5, weights and ids, inputs
 * uniform from a fixed seed. Device: as moecl_context_create(NULL) picks
 * it ($MOECL_DEVICE). Prints the ids' FNV-1a hash, which compares builds
 * (the same inputs every run). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <moecl/moecl.h>

static double wall_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double cpu_s(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)(r.ru_utime.tv_sec + r.ru_stime.tv_sec) + (double)(r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1e-6;
}

/* Uniform on [-scale, scale) from a 32-bit LCG. */
static float *random_floats(uint32_t *seed, size_t n, float scale)
{
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; p && i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        p[i] = ((float)(*seed >> 8) / 16777216.0f * 2.0f - 1.0f) * scale;
    }
    return p;
}

static int fail(const char *what, moecl_context *ctx)
{
    fprintf(stderr, "grounded_cpu_time: %s: %s\n", what, ctx ? moecl_context_error(ctx) : "failed");
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 1 && argc != 5 && argc != 6) {
        fprintf(stderr, "usage: grounded_cpu_time [TOKENS HIDDEN EXPERTS TOP_K [CALLS]]\n");
        return 2;
    }
    const unsigned t = argc > 1 ? (unsigned)atoi(argv[1]) : 16384, h = argc > 1 ? (unsigned)atoi(argv[2]) : 4096;
    const unsigned e = argc > 1 ? (unsigned)atoi(argv[3]) : 128, k = argc > 1 ? (unsigned)atoi(argv[4]) : 8;
    const int calls = argc > 5 ? atoi(argv[5]) : 5;
    moecl_context *ctx;
    if (moecl_context_create(NULL, &ctx) != MOECL_SUCCESS || calls < 1)
        return fail("context", NULL);
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(t, h, e, 0.5f);
    d.top_k = k;
    uint32_t seed = 1234;
    float *hidden = random_floats(&seed, (size_t)t * h, 1.0f), *ground = random_floats(&seed, (size_t)e * h, 1.0f / 64);
    float *logits = random_floats(&seed, (size_t)t * e, 1.0f), *weights = malloc((size_t)t * k * 4);
    int32_t *ids = malloc((size_t)t * k * 4);
    if (!hidden || !ground || !logits || !weights || !ids)
        return fail("out of memory", NULL);
    cl_context cl = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    cl_int err;
    const cl_mem_flags in = CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR;
    cl_mem bh = clCreateBuffer(cl, in, (size_t)t * h * 4, hidden, &err);
    cl_mem bg = clCreateBuffer(cl, in, (size_t)e * h * 4, ground, &err);
    cl_mem bl = clCreateBuffer(cl, in, (size_t)t * e * 4, logits, &err);
    cl_mem bw = clCreateBuffer(cl, CL_MEM_WRITE_ONLY, (size_t)t * k * 4, NULL, &err);
    cl_mem bi = clCreateBuffer(cl, CL_MEM_WRITE_ONLY, (size_t)t * k * 4, NULL, &err);
    if (!bh || !bg || !bl || !bw || !bi)
        return fail("buffers", NULL);
    if (moecl_grounded_router_prepare(ctx, &d) != MOECL_SUCCESS)
        return fail("prepare", ctx);
    const moecl_buffer none = {NULL, 0};
    const long cores = sysconf(_SC_NPROCESSORS_ONLN) > 0 ? sysconf(_SC_NPROCESSORS_ONLN) : 1;
    double best_wall = 1e30, best_cpu = 1e30;
    for (int i = -1; i < calls; i++) {
        const double w0 = wall_s(), c0 = cpu_s();
        if (moecl_grounded_router(ctx, &d, (moecl_buffer){bh, 0}, (moecl_buffer){bl, 0}, (moecl_buffer){bg, 0}, none,
                                  (moecl_buffer){bw, 0}, (moecl_buffer){bi, 0}, 0, NULL, NULL) != MOECL_SUCCESS)
            return fail("moecl_grounded_router", ctx);
        clFinish(q);
        const double w = wall_s() - w0, c = (cpu_s() - c0) / (double)cores;
        if (i >= 0) {
            best_wall = w < best_wall ? w : best_wall;
            best_cpu = c < best_cpu ? c : best_cpu;
        }
    }
    clEnqueueReadBuffer(q, bi, CL_TRUE, 0, (size_t)t * k * 4, ids, 0, NULL, NULL);
    uint64_t hash = 1469598103934665603ull;
    for (size_t i = 0; i < (size_t)t * k; i++)
        for (int byte = 0; byte < 4; byte++) {
            hash ^= (uint32_t)ids[i] >> (8 * byte) & 0xff;
            hash *= 1099511628211ull;
        }
    printf("grounded %ux%ux%u k%u f32: processor time / %ld cores %.2f ms, wall %.2f ms (best of %d); "
           "%.1f GFLOP/s by processor time; ids fnv1a %016llx\n",
           t, h, e, k, cores, best_cpu * 1e3, best_wall * 1e3, calls, 2.0 * t * h * e / best_cpu * 1e-9,
           (unsigned long long)hash);
    cl_mem all[5] = {bh, bg, bl, bw, bi};
    for (int i = 0; i < 5; i++)
        clReleaseMemObject(all[i]);
    free(hidden);
    free(ground);
    free(logits);
    free(weights);
    free(ids);
    moecl_context_destroy(ctx);
    return 0;
}
