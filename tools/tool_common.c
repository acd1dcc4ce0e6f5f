#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "reference.h"
#include "tool_common.h"

double tool_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

int tool_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

float tool_randn(uint64_t *s)
{
    double u[2];
    for (int i = 0; i < 2; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        u[i] = ((*s >> 11) + 0.5) / 9007199254740992.0;
    }
    return (float)(sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
}

void *tool_random_tensor(uint64_t *s, moecl_dtype t, size_t n, float scale)
{
    void *p = malloc(n * ref_dtype_size(t) + 4);
    if (!p)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        float v = tool_randn(s) * scale;
        if (t == MOECL_F32)
            ((float *)p)[i] = v;
        else
            ((uint16_t *)p)[i] = t == MOECL_F16 ? ref_float_to_half(v) : ref_float_to_bf16(v);
    }
    return p;
}

cl_mem tool_make_buffer(const char *prog, cl_context c, size_t size, const void *data)
{
    cl_int err;
    cl_mem m = clCreateBuffer(c, CL_MEM_READ_WRITE | (data ? CL_MEM_COPY_HOST_PTR : 0), size ? size : 4, (void *)data,
                              &err);
    if (!m) {
        fprintf(stderr, "%s: clCreateBuffer(%zu) failed: %d\n", prog, size, err);
        exit(1);
    }
    return m;
}

double tool_event_us(cl_event ev)
{
    cl_ulong start = 0, end = 0;
    clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_START, sizeof(start), &start, NULL);
    clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_END, sizeof(end), &end, NULL);
    return (double)(end - start) / 1e3;
}
