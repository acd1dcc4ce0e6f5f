#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* Uniform on [0, 10): 24 random bits, so every value is a multiple of
 * 10 / 2^24 (a float holds it to within an ulp). */
static float tool_rand_uniform10(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 40) * (10.0 / 16777216.0));
}

static void *tool_fill_tensor(uint64_t *s, moecl_dtype t, size_t n, float scale, float (*draw)(uint64_t *))
{
    void *p = malloc(n * ref_dtype_size(t) + 4);
    if (!p)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        float v = draw(s) * scale;
        if (t == MOECL_F32)
            ((float *)p)[i] = v;
        else
            ((uint16_t *)p)[i] = t == MOECL_F16 ? ref_float_to_half(v) : ref_float_to_bf16(v);
    }
    return p;
}

void *tool_random_tensor(uint64_t *s, moecl_dtype t, size_t n, float scale)
{
    return tool_fill_tensor(s, t, n, scale, tool_randn);
}

void *tool_logits_tensor(uint64_t *s, moecl_dtype t, size_t n, tool_logits dist)
{
    return tool_fill_tensor(s, t, n, 1.0f, dist == TOOL_LOGITS_UNIFORM10 ? tool_rand_uniform10 : tool_randn);
}

bool tool_parse_logits(const char *text, tool_logits *out)
{
    if (strcmp(text, "normal") == 0)
        *out = TOOL_LOGITS_NORMAL;
    else if (strcmp(text, "uniform10") == 0)
        *out = TOOL_LOGITS_UNIFORM10;
    else
        return false;
    return true;
}

const char *tool_logits_name(tool_logits dist)
{
    return dist == TOOL_LOGITS_UNIFORM10 ? "uniform10" : "normal";
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
