#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t process_seed;

uint64_t harness_seed(void)
{
    if (!process_seed) {
        const char *env = getenv("MOECL_TEST_SEED");
        process_seed = env && *env ? strtoull(env, NULL, 0)
                                   : ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid() ^ (uint64_t)clock();
        if (!process_seed)
            process_seed = 1;
        fprintf(stderr, "moecl tests: seed %llu (set MOECL_TEST_SEED to repeat)\n",
                (unsigned long long)process_seed);
    }
    return process_seed;
}

static uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

harness_rng harness_rng_for(uint64_t stream)
{
    uint64_t x = harness_seed() ^ (stream * 0xd1b54a32d192ed03ull);
    harness_rng r = {splitmix(&x)};
    return r;
}

uint32_t harness_rand_u32(harness_rng *rng) { return (uint32_t)(splitmix(&rng->state) >> 32); }

double harness_rand_uniform(harness_rng *rng) { return (splitmix(&rng->state) >> 11) * 0x1.0p-53; }

float harness_randn(harness_rng *rng)
{
    double u1 = harness_rand_uniform(rng) + 0x1.0p-54, u2 = harness_rand_uniform(rng);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void harness_store(moecl_dtype dtype, void *data, size_t index, float value)
{
    if (dtype == MOECL_F32)
        ((float *)data)[index] = value;
    else if (dtype == MOECL_F16)
        ((uint16_t *)data)[index] = ref_float_to_half(value);
    else
        ((uint16_t *)data)[index] = ref_float_to_bf16(value);
}

void *harness_random_tensor(harness_rng *rng, moecl_dtype dtype, size_t n, float scale)
{
    void *data = malloc(n * ref_dtype_size(dtype) + 1);
    ck_assert_ptr_nonnull(data);
    for (size_t i = 0; i < n; i++)
        harness_store(dtype, data, i, harness_randn(rng) * scale);
    return data;
}

moecl_context *harness_context(void)
{
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(NULL, &ctx);
    ck_assert_msg(st == MOECL_SUCCESS, "moecl_context_create: %s: %s", moecl_status_string(st),
                  moecl_context_error(NULL));
    return ctx;
}

moecl_buffer harness_buffer(moecl_context *ctx, size_t size, size_t offset, const void *data)
{
    size_t total = size + offset + 64; /* slack after the tensor too: writes past it show */
    unsigned char *fill = malloc(total);
    ck_assert_ptr_nonnull(fill);
    memset(fill, HARNESS_POISON, total);
    if (data && size)
        memcpy(fill + offset, data, size);
    cl_int err;
    cl_mem mem = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, total, fill,
                                &err);
    free(fill);
    ck_assert_msg(mem != NULL, "clCreateBuffer: %d", err);
    moecl_buffer b = {mem, offset};
    return b;
}

void harness_read(moecl_context *ctx, moecl_buffer buf, size_t size, void *out)
{
    if (!size)
        return;
    cl_int err = clEnqueueReadBuffer(moecl_context_queue(ctx), buf.mem, CL_TRUE, buf.offset, size, out, 0, NULL, NULL);
    ck_assert_int_eq(err, CL_SUCCESS);
}

void harness_release(moecl_buffer buf)
{
    if (buf.mem)
        clReleaseMemObject(buf.mem);
}

bool harness_quick(void)
{
    const char *env = getenv("MOECL_TEST_QUICK");
    return env && *env && strcmp(env, "0") != 0;
}

int harness_run(Suite *suite)
{
    SRunner *runner = srunner_create(suite);
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed ? 1 : 0;
}
