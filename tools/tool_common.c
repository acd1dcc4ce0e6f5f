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

/* v into element i of p in dtype t (f16/bf16 rounded to nearest even). */
static void tool_store(moecl_dtype t, void *p, size_t i, float v)
{
    if (t == MOECL_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = t == MOECL_F16 ? ref_float_to_half(v) : ref_float_to_bf16(v);
}

/* 24 random bits of the LCG state, as a double in [0, 1). */
static double tool_rand_unit(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 40) / 16777216.0;
}

/* Uniform on [0, 10): every value is a multiple of 10 / 2^24 (a float
 * holds it to within an ulp). */
static float tool_rand_uniform10(uint64_t *s)
{
    return (float)(tool_rand_unit(s) * 10.0);
}

/* One of 8 levels 0..7, plus 0, 1, 2 or 3 times 2^-20 (each equally
 * likely): a row of 128 holds about 16 values at the top level, so its
 * k-th place ties exactly with others and sits among near-ties a few
 * ulps apart (every value exact in f32). */
static float tool_rand_ties(uint64_t *s)
{
    const double level = floor(8.0 * tool_rand_unit(s));
    return (float)(level + ldexp(floor(4.0 * tool_rand_unit(s)), -20));
}

static void *tool_fill_tensor(uint64_t *s, moecl_dtype t, size_t n, float scale, float (*draw)(uint64_t *))
{
    void *p = malloc(n * ref_dtype_size(t) + 4);
    if (!p)
        return NULL;
    for (size_t i = 0; i < n; i++)
        tool_store(t, p, i, draw(s) * scale);
    return p;
}

void *tool_random_tensor(uint64_t *s, moecl_dtype t, size_t n, float scale)
{
    return tool_fill_tensor(s, t, n, scale, tool_randn);
}

/* Hot experts: every num_experts/8-th from 0 (all of them below 8). */
static bool tool_hot_expert(uint32_t e, uint32_t num_experts)
{
    const uint32_t stride = num_experts >= TOOL_HOT_EXPERTS ? num_experts / TOOL_HOT_EXPERTS : 1;
    return e % stride == 0 && e / stride < TOOL_HOT_EXPERTS;
}

void *tool_logits_tensor(uint64_t *s, moecl_dtype t, size_t tokens, uint32_t experts, tool_logits dist)
{
    const size_t n = tokens * experts;
    if (dist == TOOL_LOGITS_UNIFORM10)
        return tool_fill_tensor(s, t, n, 1.0f, tool_rand_uniform10);
    if (dist == TOOL_LOGITS_TIES)
        return tool_fill_tensor(s, t, n, 1.0f, tool_rand_ties);
    void *p = malloc(n * ref_dtype_size(t) + 4);
    if (!p)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        const bool hot = dist == TOOL_LOGITS_HOT && tool_hot_expert((uint32_t)(i % experts), experts);
        tool_store(t, p, i, tool_randn(s) + (hot ? TOOL_HOT_BOOST : 0.0f));
    }
    return p;
}

static const char *const logits_names[] = {"normal", "uniform10", "hot", "ties"};

bool tool_parse_logits(const char *text, tool_logits *out)
{
    for (size_t i = 0; i < sizeof(logits_names) / sizeof(logits_names[0]); i++)
        if (strcmp(text, logits_names[i]) == 0) {
            *out = (tool_logits)i;
            return true;
        }
    return false;
}

const char *tool_logits_name(tool_logits dist)
{
    return logits_names[dist];
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
