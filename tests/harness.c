#include "harness.h"

#include <math.h>
#include <stdarg.h>
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

bool harness_fail(harness_error *e, const char *fmt, ...)
{
    if (e->count++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
        va_end(ap);
    }
    return false;
}

/* The message of a failed harness_try_* call, as a test failure. */
#define ASSERT_TRIED(ok, e) ck_assert_msg((ok), "%s", (e).msg)

void *harness_try_random_tensor(harness_rng *rng, moecl_dtype dtype, size_t n, float scale, harness_error *e)
{
    void *data = malloc(n * ref_dtype_size(dtype) + 1);
    if (!data) {
        harness_fail(e, "out of host memory for %zu values", n);
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        harness_store(dtype, data, i, harness_randn(rng) * scale);
    return data;
}

void *harness_random_tensor(harness_rng *rng, moecl_dtype dtype, size_t n, float scale)
{
    harness_error e = {0};
    void *data = harness_try_random_tensor(rng, dtype, n, scale, &e);
    ASSERT_TRIED(data != NULL, e);
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

moecl_context *harness_context_with_kernel_dir(const char *dir)
{
    const char *old_dir = getenv("MOECL_KERNEL_DIR");
    char *saved = old_dir ? strdup(old_dir) : NULL;
    setenv("MOECL_KERNEL_DIR", dir, 1);
    moecl_context *ctx = harness_context();
    if (saved)
        setenv("MOECL_KERNEL_DIR", saved, 1);
    else
        unsetenv("MOECL_KERNEL_DIR");
    free(saved);
    return ctx;
}

bool harness_replace_once(char **text, const char *old, const char *new_text)
{
    char *at = strstr(*text, old);
    if (!at || strstr(at + 1, old))
        return false;
    const size_t head = (size_t)(at - *text), len = strlen(*text), old_len = strlen(old), new_len = strlen(new_text);
    char *out = malloc(len - old_len + new_len + 1);
    if (!out)
        return false;
    memcpy(out, *text, head);
    memcpy(out + head, new_text, new_len);
    memcpy(out + head + new_len, at + old_len, len - head - old_len + 1);
    free(*text);
    *text = out;
    return true;
}

void harness_write_mutant(const char *name, const char *const (*edits)[2], size_t n, char *dir, char *path,
                          size_t path_size)
{
    const char *cl_dir = getenv("MOECL_TEST_CL_DIR");
    ck_assert_msg(cl_dir && *cl_dir, "MOECL_TEST_CL_DIR is not set (meson sets it to the source cl/ folder)");
    snprintf(path, path_size, "%s/%s", cl_dir, name);
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot read %s", path);
    char *text = calloc(1, 1 << 20);
    ck_assert_ptr_nonnull(text);
    const size_t len = fread(text, 1, (1 << 20) - 1, f);
    fclose(f);
    text[len] = '\0';
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(harness_replace_once(&text, edits[i][0], edits[i][1]),
                      "a mutation's anchor is not in cl/%s exactly once: \"%s\"", name, edits[i][0]);
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, path_size, "%s/%s", dir, name);
    f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
    free(text);
}

void *harness_poisoned(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p)
        memset(p, HARNESS_POISON, n ? n : 1);
    return p;
}

size_t harness_first_unpoisoned(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != HARNESS_POISON)
            return i;
    return n;
}

moecl_buffer harness_try_buffer(moecl_context *ctx, size_t size, size_t offset, const void *data, harness_error *e)
{
    const size_t total = size + offset + HARNESS_SLACK; /* writes past the tensor show */
    unsigned char *fill = harness_poisoned(total);
    moecl_buffer b = {NULL, 0};
    if (!fill) {
        harness_fail(e, "out of host memory for a buffer of %zu bytes", total);
        return b;
    }
    if (data && size)
        memcpy(fill + offset, data, size);
    cl_int err;
    cl_mem mem = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, total, fill,
                                &err);
    free(fill);
    if (!mem) {
        harness_fail(e, "clCreateBuffer(%zu bytes): %d", total, err);
        return b;
    }
    b.mem = mem;
    b.offset = offset;
    return b;
}

moecl_buffer harness_buffer(moecl_context *ctx, size_t size, size_t offset, const void *data)
{
    harness_error e = {0};
    moecl_buffer b = harness_try_buffer(ctx, size, offset, data, &e);
    ASSERT_TRIED(b.mem != NULL, e);
    return b;
}

bool harness_try_read(moecl_context *ctx, moecl_buffer buf, size_t size, void *out, harness_error *e)
{
    if (!size)
        return true;
    cl_int err = clEnqueueReadBuffer(moecl_context_queue(ctx), buf.mem, CL_TRUE, buf.offset, size, out, 0, NULL, NULL);
    return err == CL_SUCCESS || harness_fail(e, "clEnqueueReadBuffer(%zu bytes at %zu): %d", size, buf.offset, err);
}

void harness_read(moecl_context *ctx, moecl_buffer buf, size_t size, void *out)
{
    harness_error e = {0};
    ASSERT_TRIED(harness_try_read(ctx, buf, size, out, &e), e);
}

void harness_read_topk(moecl_context *ctx, moecl_buffer weights, moecl_buffer ids, size_t nk, float *w, int32_t *id,
                       const char *what)
{
    harness_read(ctx, weights, nk * sizeof(float) + 4, w);
    harness_read(ctx, ids, nk * sizeof(int32_t) + 4, id);
    uint32_t tail_w, tail_i;
    memcpy(&tail_w, w + nk, 4);
    memcpy(&tail_i, id + nk, 4);
    ck_assert_msg(tail_w == 0xFFFFFFFFu && tail_i == 0xFFFFFFFFu, "%s: wrote past the end of an output", what);
}

void harness_release(moecl_buffer buf)
{
    if (buf.mem)
        clReleaseMemObject(buf.mem);
}

/* The device path of harness_try_topk: outputs read back whole, so that a
 * write outside a tensor shows. */
static bool topk_device(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const void *bias,
                        void *w, void *ids, size_t offset, harness_error *e)
{
    const size_t gbytes = (size_t)d->num_tokens * d->num_experts * ref_dtype_size(d->gating_dtype);
    const size_t nk = (size_t)d->num_tokens * d->top_k;
    const size_t obytes[2] = {nk * ref_dtype_size(d->weights_dtype), nk * (d->ids_dtype == MOECL_I64 ? 8 : 4)};
    const size_t total = offset + nk * 8 + HARNESS_SLACK;
    moecl_buffer bg = harness_try_buffer(ctx, gbytes, offset, gating, e);
    moecl_buffer bb = bias && bg.mem ? harness_try_buffer(ctx, (size_t)d->num_experts * ref_dtype_size(d->bias_dtype),
                                                          offset, bias, e)
                                     : (moecl_buffer){NULL, 0};
    moecl_buffer bw = bg.mem ? harness_try_buffer(ctx, obytes[0], offset, NULL, e) : (moecl_buffer){NULL, 0};
    moecl_buffer bi = bw.mem ? harness_try_buffer(ctx, obytes[1], offset, NULL, e) : (moecl_buffer){NULL, 0};
    unsigned char *all = malloc(total);
    cl_event done = NULL;
    bool ok = false;
    if (!bg.mem || (bias && !bb.mem) || !bw.mem || !bi.mem || !all) {
        if (!all)
            harness_fail(e, "out of host memory");
        goto out;
    }
    moecl_status st = moecl_topk_gating(ctx, d, bg, bb, bw, bi, 0, NULL, &done);
    if (st != MOECL_SUCCESS) {
        harness_fail(e, "moecl_topk_gating: %s (%d): %s", moecl_status_string(st), (int)st, moecl_context_error(ctx));
        goto out;
    }
    if (!done) {
        harness_fail(e, "moecl_topk_gating succeeded but gave no event");
        goto out;
    }
    cl_int err = clWaitForEvents(1, &done);
    if (err != CL_SUCCESS) {
        harness_fail(e, "clWaitForEvents on the call's event: %d", err);
        goto out;
    }
    const moecl_buffer outs[2] = {bw, bi};
    void *dst[2] = {w, ids};
    for (int i = 0; i < 2; i++) {
        const char *name = i ? "topk_ids" : "topk_weights";
        const size_t size = offset + obytes[i] + HARNESS_SLACK;
        if (!harness_try_read(ctx, (moecl_buffer){outs[i].mem, 0}, size, all, e))
            goto out;
        size_t before = harness_first_unpoisoned(all, offset);
        size_t after = harness_first_unpoisoned(all + offset + obytes[i], HARNESS_SLACK);
        if (before != offset || after != HARNESS_SLACK) {
            harness_fail(e, "%s: a byte outside the tensor changed (%s it, offset %zu)", name,
                         before != offset ? "before" : "after", offset);
            goto out;
        }
        memcpy(dst[i], all + offset, obytes[i]);
    }
    ok = true;
out:
    if (done)
        clReleaseEvent(done);
    free(all);
    harness_release(bg);
    harness_release(bb);
    harness_release(bw);
    harness_release(bi);
    return ok;
}

bool harness_try_topk(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng, bool with_bias,
                      harness_path path, size_t offset, harness_error *e)
{
    const size_t t = d->num_tokens, n = t * d->top_k;
    char where[128];
    snprintf(where, sizeof(where), "%s path, T=%zu E=%u k=%u, %s bias, offset %zu",
             path == HARNESS_HOST ? "host" : "device", t, d->num_experts, d->top_k, with_bias ? "with" : "no", offset);
    /* The failures below go into a local record first, so the message
     * can name the shape. */
    harness_error local = {0};
    void *gating = harness_try_random_tensor(rng, d->gating_dtype, t * d->num_experts, 2.0f, &local);
    /* Bias of the size of a typical softmax score, so it changes picks;
     * outputs and bias of desc's types. */
    void *bias = with_bias ? harness_try_random_tensor(rng, d->bias_dtype, d->num_experts,
                                                       2.0f / (float)d->num_experts, &local)
                           : NULL;
    void *w = harness_poisoned(n * 8);
    void *ids = harness_poisoned(n * 8);
    bool ok = false;
    if (!gating || (with_bias && !bias) || !w || !ids) {
        harness_fail(&local, "out of host memory");
    } else if (path == HARNESS_HOST) {
        moecl_status st = moecl_topk_gating_host(ctx, d, gating, bias, w, ids);
        ok = st == MOECL_SUCCESS || harness_fail(&local, "moecl_topk_gating_host: %s (%d): %s",
                                                 moecl_status_string(st), (int)st, moecl_context_error(ctx));
    } else {
        ok = topk_device(ctx, d, gating, bias, w, ids, offset, &local);
    }
    if (ok) {
        char detail[600] = "";
        int rows = ref_check_topk_gating_typed(d, gating, bias, w, ids, detail, sizeof(detail));
        ok = rows == 0 || harness_fail(&local, "%d bad rows: %s", rows, detail);
    }
    if (!ok)
        harness_fail(e, "%s: %s", where, local.msg);
    free(gating);
    free(bias);
    free(w);
    free(ids);
    return ok;
}

void harness_check_topk(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng, bool with_bias,
                        harness_path path, size_t offset)
{
    harness_error e = {0};
    ASSERT_TRIED(harness_try_topk(ctx, d, rng, with_bias, path, offset, &e), e);
}

/* What harness_args read. */
static struct {
    harness_override_fn set_override;
    const char *variant;
    const char *tcase;
    bool quick;
} args = {NULL, "", NULL, false};

static void usage(const char *program, const char *problem, const char *arg)
{
    fprintf(stderr,
            "%s: %s%s%s\n"
            "usage: %s [--variant TEXT] [--quick] [--case NAME]\n"
            "  --variant TEXT  force a kernel variant (\"class=gpu align=fused ...\", docs/environment.md)\n"
            "  --quick         leave out the largest grids\n"
            "  --case NAME     run only the Check test case NAME\n",
            program, problem, arg ? " " : "", arg ? arg : "", program);
    exit(2);
}

void harness_args(int argc, char **argv, harness_override_fn set_override)
{
    const char *program = argc > 0 ? argv[0] : "test";
    args.set_override = set_override;
    for (int i = 1; i < argc; i++) {
        const bool has_value = i + 1 < argc;
        if (strcmp(argv[i], "--quick") == 0) {
            args.quick = true;
        } else if (strcmp(argv[i], "--case") == 0 || strcmp(argv[i], "--variant") == 0) {
            if (!has_value)
                usage(program, "option needs a value:", argv[i]);
            if (argv[i][2] == 'c')
                args.tcase = argv[++i];
            else
                args.variant = argv[++i];
        } else {
            usage(program, "unknown argument:", argv[i]);
        }
    }
    if (!*args.variant)
        return;
    if (!set_override)
        usage(program, "--variant: this program links the shared library, which cannot force a variant", NULL);
    const moecl_status st = set_override(args.variant);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "%s: --variant '%s': %s\n", program, args.variant, moecl_context_error(NULL));
        exit(2);
    }
    fprintf(stderr, "moecl tests: variant %s\n", args.variant);
}

const char *harness_variant(void) { return args.variant; }

void harness_override_with(const char *words)
{
    ck_assert_msg(args.set_override, "this test program cannot force a variant (linked with the shared library)");
    char text[512];
    const int n = snprintf(text, sizeof(text), "%s %s", args.variant, words ? words : "");
    ck_assert_msg(n > 0 && (size_t)n < sizeof(text), "variant text too long");
    const moecl_status st = args.set_override(text);
    ck_assert_msg(st == MOECL_SUCCESS, "variant override '%s': %s", text, moecl_context_error(NULL));
}

/* An environment flag: set, not empty and not "0". */
static bool env_flag(const char *name)
{
    const char *env = getenv(name);
    return env && *env && strcmp(env, "0") != 0;
}

bool harness_quick(void)
{
    return args.quick || env_flag("MOECL_TEST_QUICK");
}

bool harness_quick_skips(unsigned parity) { return harness_quick() && (parity & 1u); }

bool harness_valgrind(void)
{
    return env_flag("MOECL_TEST_VALGRIND");
}

int harness_run(Suite *suite)
{
    if (args.tcase && !suite_tcase(suite, args.tcase)) {
        fprintf(stderr, "--case %s: the suite has no such test case\n", args.tcase);
        return 2;
    }
    SRunner *runner = srunner_create(suite);
    srunner_run(runner, NULL, args.tcase, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed ? 1 : 0;
}
