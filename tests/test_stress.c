/* Load, concurrency and determinism: many threads on one context, threads
 * with their own contexts, two processes warming one empty kernel cache at
 * once, and bit-identical results on repeated calls and across launch
 * shapes. Every result is checked against the float64 reference. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "internal.h"

extern char **environ;

/* ---------------------------------------------------------------------- */
/* One checked call of either op, on the host or the device-buffer path.   */
/* ---------------------------------------------------------------------- */

/* The calls run in worker threads, so they record failures in a
 * harness_error and use the harness_try_* helpers: no Check assertion. */

/* A random top-k gating descriptor among a few model shapes, each in one
 * dtype: every dtype still appears, and the calls share about 60 kernel
 * variants, so that the threads race over first builds and cache hits
 * alike (compiles are most of this suite's time on a CPU driver). */
static moecl_topk_gating_desc random_topk_desc(harness_rng *rng, uint32_t tokens)
{
    static const uint32_t shapes[][3] = {
        {8, 2, MOECL_F32}, {64, 6, MOECL_F16}, {128, 8, MOECL_BF16}, {256, 8, MOECL_F32}, {60, 4, MOECL_BF16}};
    const uint32_t *s = shapes[harness_rand_u32(rng) % 5];
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens, s[0], s[1]);
    d.gating_dtype = (moecl_dtype)s[2];
    d.scoring = (harness_rand_u32(rng) & 1) ? MOECL_SCORING_SIGMOID : MOECL_SCORING_SOFTMAX;
    d.renormalize = (harness_rand_u32(rng) & 1) != 0;
    if (s[0] == 256 && (harness_rand_u32(rng) & 1)) {
        d.num_expert_groups = 8;
        d.topk_group = 4;
        d.group_score = (harness_rand_u32(rng) & 1) ? MOECL_GROUP_SCORE_TOP2_SUM : MOECL_GROUP_SCORE_MAX;
    }
    return d;
}

/* Wait for done and read the n outputs back; false (recorded in r) on a
 * failure. Releases done. */
static bool read_outputs(moecl_context *ctx, cl_event done, const moecl_buffer *outs, void *const *dst,
                         const size_t *sizes, int n, harness_error *r)
{
    cl_int err = clWaitForEvents(1, &done);
    clReleaseEvent(done);
    if (err != CL_SUCCESS)
        return harness_fail(r, "clWaitForEvents on the call's event: %d", err);
    for (int i = 0; i < n; i++)
        if (!harness_try_read(ctx, outs[i], sizes[i], dst[i], r))
            return false;
    return true;
}

static void topk_call(moecl_context *ctx, harness_rng *rng, bool device_path, harness_error *r)
{
    const uint32_t tokens = 1 + harness_rand_u32(rng) % 40;
    const moecl_topk_gating_desc d = random_topk_desc(rng, tokens);
    const bool has_bias = (harness_rand_u32(rng) & 1) != 0;
    const size_t n = (size_t)tokens * d.num_experts, out = (size_t)tokens * d.top_k;
    void *g = harness_try_random_tensor(rng, d.gating_dtype, n, 2.0f, r);
    float *bias = has_bias ? harness_try_random_tensor(rng, MOECL_F32, d.num_experts, 0.5f, r) : NULL;
    float *w = harness_poisoned(out * sizeof(float));
    int32_t *ids = harness_poisoned(out * sizeof(int32_t));
    if (!g || (has_bias && !bias) || !w || !ids) {
        harness_fail(r, "out of memory");
        goto done;
    }
    moecl_status st = MOECL_SUCCESS;
    bool made = true;
    if (!device_path) {
        st = moecl_topk_gating_host(ctx, &d, g, bias, w, ids);
    } else {
        const size_t esz = ref_dtype_size(d.gating_dtype);
        const size_t off = (size_t)(harness_rand_u32(rng) % 4) * 64;
        moecl_buffer bg = harness_try_buffer(ctx, n * esz, off, g, r);
        moecl_buffer bb = has_bias ? harness_try_buffer(ctx, d.num_experts * sizeof(float), 0, bias, r)
                                   : (moecl_buffer){NULL, 0};
        moecl_buffer bw = harness_try_buffer(ctx, out * sizeof(float), off, NULL, r);
        moecl_buffer bi = harness_try_buffer(ctx, out * sizeof(int32_t), 0, NULL, r);
        if (bg.mem && (!has_bias || bb.mem) && bw.mem && bi.mem) {
            cl_event done_ev = NULL;
            st = moecl_topk_gating(ctx, &d, bg, bb, bw, bi, 0, NULL, &done_ev);
            const moecl_buffer outs[2] = {bw, bi};
            void *dst[2] = {w, ids};
            const size_t sizes[2] = {out * sizeof(float), out * sizeof(int32_t)};
            if (st == MOECL_SUCCESS && !read_outputs(ctx, done_ev, outs, dst, sizes, 2, r))
                made = false;
        } else {
            made = false;
        }
        harness_release(bg);
        harness_release(bb);
        harness_release(bw);
        harness_release(bi);
    }
    if (!made)
        goto done; /* recorded in r */
    if (st != MOECL_SUCCESS) {
        harness_fail(r, "top-k gating: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
        goto done;
    }
    char msg[900];
    if (ref_check_topk_gating(&d, g, bias, w, ids, msg, sizeof(msg)) != 0)
        harness_fail(r, "top-k gating%s: %s", device_path ? " (device buffers)" : " (host)", msg);
done:
    free(g);
    free(bias);
    free(w);
    free(ids);
}

static void grounded_call(moecl_context *ctx, harness_rng *rng, bool device_path, harness_error *r)
{
    static const uint32_t shapes[][3] = {{16, 16, 2}, {128, 16, 2}, {64, 96, 8}};
    const uint32_t *s = shapes[harness_rand_u32(rng) % 3];
    const uint32_t tokens = 1 + harness_rand_u32(rng) % 70;
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(tokens, s[0], s[1], 0.25f);
    d.top_k = s[2];
    d.hidden_dtype = (moecl_dtype)(harness_rand_u32(rng) % 3);
    const size_t nh = (size_t)tokens * d.hidden_dim, nl = (size_t)tokens * d.num_experts;
    const size_t ng = (size_t)d.num_experts * d.hidden_dim, out = (size_t)tokens * d.top_k;
    void *h = harness_try_random_tensor(rng, d.hidden_dtype, nh, 1.0f, r);
    float *l = harness_try_random_tensor(rng, MOECL_F32, nl, 1.0f, r);
    void *gr = harness_try_random_tensor(rng, d.hidden_dtype, ng, 1.0f, r);
    float *pairs = harness_poisoned(out * 2 * sizeof(float));
    float *w = harness_poisoned(out * sizeof(float));
    int32_t *ids = harness_poisoned(out * sizeof(int32_t));
    if (!h || !l || !gr || !pairs || !w || !ids) {
        harness_fail(r, "out of memory");
        goto done;
    }
    moecl_status st = MOECL_SUCCESS;
    bool made = true;
    if (!device_path) {
        st = moecl_grounded_router_host(ctx, &d, h, l, gr, pairs, w, ids);
    } else {
        const size_t esz = ref_dtype_size(d.hidden_dtype);
        moecl_buffer b[6] = {
            harness_try_buffer(ctx, nh * esz, 128, h, r),
            harness_try_buffer(ctx, nl * sizeof(float), 0, l, r),
            harness_try_buffer(ctx, ng * esz, 64, gr, r),
            harness_try_buffer(ctx, out * 2 * sizeof(float), 0, NULL, r),
            harness_try_buffer(ctx, out * sizeof(float), 32, NULL, r),
            harness_try_buffer(ctx, out * sizeof(int32_t), 0, NULL, r),
        };
        for (int i = 0; i < 6; i++)
            made = made && b[i].mem;
        if (made) {
            cl_event done_ev = NULL;
            st = moecl_grounded_router(ctx, &d, b[0], b[1], b[2], b[3], b[4], b[5], 0, NULL, &done_ev);
            void *dst[3] = {pairs, w, ids};
            const size_t sizes[3] = {out * 2 * sizeof(float), out * sizeof(float), out * sizeof(int32_t)};
            if (st == MOECL_SUCCESS && !read_outputs(ctx, done_ev, b + 3, dst, sizes, 3, r))
                made = false;
        }
        for (int i = 0; i < 6; i++)
            harness_release(b[i]);
    }
    if (!made)
        goto done; /* recorded in r */
    if (st != MOECL_SUCCESS) {
        harness_fail(r, "grounded router: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
        goto done;
    }
    char msg[900];
    if (ref_check_grounded_router(&d, h, l, gr, pairs, w, ids, msg, sizeof(msg)) != 0)
        harness_fail(r, "grounded router%s: %s", device_path ? " (device buffers)" : " (host)", msg);
done:
    free(h);
    free(l);
    free(gr);
    free(pairs);
    free(w);
    free(ids);
}

/* ---------------------------------------------------------------------- */
/* 1. Eight threads share one context, 200 mixed calls each.               */
/* ---------------------------------------------------------------------- */

#define SHARED_THREADS 8
#define SHARED_CALLS 200

typedef struct worker {
    moecl_context *ctx; /* NULL: the worker makes its own contexts */
    int id, calls;
    harness_error result;
} worker;

static void *shared_worker(void *arg)
{
    worker *w = arg;
    harness_rng rng = harness_rng_for(2000 + (uint64_t)w->id);
    for (int i = 0; i < SHARED_CALLS; i++) {
        /* Op and path change every call, in a pattern that differs per
         * thread, so every combination overlaps with every other. */
        const bool grounded = ((i + w->id) % 3) == 0;
        const bool device_path = ((i / 2 + w->id) % 2) != 0;
        if (grounded)
            grounded_call(w->ctx, &rng, device_path, &w->result);
        else
            topk_call(w->ctx, &rng, device_path, &w->result);
        w->calls++;
    }
    return NULL;
}

static void run_workers(worker *workers, int n, void *(*fn)(void *))
{
    (void)harness_seed(); /* before any thread asks for it */
    pthread_t threads[SHARED_THREADS];
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(pthread_create(&threads[i], NULL, fn, &workers[i]), 0);
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
    int failures = 0;
    const char *first = NULL;
    for (int i = 0; i < n; i++) {
        failures += workers[i].result.count;
        if (workers[i].result.count && !first)
            first = workers[i].result.msg;
    }
    ck_assert_msg(failures == 0, "%d calls failed; first: %s", failures, first);
}

START_TEST(test_threads_shared_context)
{
    moecl_context *ctx = harness_context();
    worker workers[SHARED_THREADS];
    for (int i = 0; i < SHARED_THREADS; i++)
        workers[i] = (worker){.ctx = ctx, .id = i};
    run_workers(workers, SHARED_THREADS, shared_worker);
    for (int i = 0; i < SHARED_THREADS; i++)
        ck_assert_int_eq(workers[i].calls, SHARED_CALLS);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 2. Threads that each create, use and destroy their own contexts.        */
/* ---------------------------------------------------------------------- */

#define OWN_THREADS 4
#define OWN_ROUNDS 6

static void *own_context_worker(void *arg)
{
    worker *w = arg;
    harness_rng rng = harness_rng_for(3000 + (uint64_t)w->id);
    for (int i = 0; i < OWN_ROUNDS; i++) {
        moecl_context *ctx = NULL;
        moecl_status st = moecl_context_create(getenv("MOECL_DEVICE"), &ctx);
        if (st != MOECL_SUCCESS) {
            harness_fail(&w->result, "context create: %s: %s", moecl_status_string(st), moecl_context_error(NULL));
            continue;
        }
        topk_call(ctx, &rng, (i & 1) != 0, &w->result);
        grounded_call(ctx, &rng, (i & 1) == 0, &w->result);
        moecl_context_destroy(ctx);
        w->calls++;
    }
    return NULL;
}

START_TEST(test_threads_own_contexts)
{
    worker workers[OWN_THREADS];
    for (int i = 0; i < OWN_THREADS; i++)
        workers[i] = (worker){.ctx = NULL, .id = i};
    run_workers(workers, OWN_THREADS, own_context_worker);
    for (int i = 0; i < OWN_THREADS; i++)
        ck_assert_int_eq(workers[i].calls, OWN_ROUNDS);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 3. Two processes warm one empty cache directory at the same time.       */
/* ---------------------------------------------------------------------- */

/* The child: prepare a few variants and route with them, checked (a Check
 * suite of its own, since the helpers assert). */
START_TEST(test_warm_child)
{
    moecl_context *ctx = harness_context();
    harness_rng rng = harness_rng_for(4000 + (uint64_t)getpid());
    harness_error r = {0};
    for (int i = 0; i < 6; i++) {
        topk_call(ctx, &rng, (i & 1) != 0, &r);
        grounded_call(ctx, &rng, (i & 1) == 0, &r);
    }
    moecl_context_destroy(ctx);
    ck_assert_msg(r.count == 0, "child %d: %d failed calls; first: %s", (int)getpid(), r.count, r.msg);
}
END_TEST

static int warm_child(void)
{
    Suite *s = suite_create("stress-child");
    TCase *tc = tcase_create("warm-cache");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_warm_child);
    suite_add_tcase(s, tc);
    return harness_run(s);
}

static char self_path[PATH_MAX];

static pid_t spawn_child(void)
{
    char *argv[] = {self_path, (char *)"--warm-cache-child", NULL};
    pid_t pid;
    int err = posix_spawn(&pid, self_path, NULL, NULL, argv, environ);
    ck_assert_msg(err == 0, "posix_spawn %s: %s", self_path, strerror(err));
    return pid;
}

static int count_entries(const char *dir)
{
    char cmd[PATH_MAX + 64];
    snprintf(cmd, sizeof(cmd), "ls -A '%s' | wc -l", dir);
    FILE *p = popen(cmd, "r");
    int n = -1;
    if (p) {
        if (fscanf(p, "%d", &n) != 1)
            n = -1;
        pclose(p);
    }
    return n;
}

START_TEST(test_two_processes_one_cache)
{
    char dir[] = "/tmp/moecl-stress-cache-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", dir, 1), 0);
    /* Children use the same seed stream rules; fix the seed for them. */
    char seed[32];
    snprintf(seed, sizeof(seed), "%llu", (unsigned long long)harness_seed());
    setenv("MOECL_TEST_SEED", seed, 1);
    for (int round = 0; round < 2; round++) {
        /* Round 0 starts from the empty directory; round 1 reads what the
         * racing writers left. */
        pid_t a = spawn_child(), b = spawn_child();
        int sa = 0, sb = 0;
        ck_assert_int_eq(waitpid(a, &sa, 0), a);
        ck_assert_int_eq(waitpid(b, &sb, 0), b);
        ck_assert_msg(WIFEXITED(sa) && WEXITSTATUS(sa) == 0, "round %d: first child failed (status %d)", round, sa);
        ck_assert_msg(WIFEXITED(sb) && WEXITSTATUS(sb) == 0, "round %d: second child failed (status %d)", round,
                      sb);
    }
    /* Entries were written, and no temporary file was left behind. */
    ck_assert_int_ge(count_entries(dir), 1);
    char cmd[PATH_MAX + 64];
    snprintf(cmd, sizeof(cmd), "ls -A '%s' | grep -c tmp", dir);
    FILE *p = popen(cmd, "r");
    int tmp = -1;
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(fscanf(p, "%d", &tmp), 1);
    pclose(p);
    ck_assert_msg(tmp == 0, "%d temporary files left in %s", tmp, dir);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    ck_assert_int_eq(system(cmd), 0);
    unsetenv("MOECL_CACHE_DIR");
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 4. Determinism.                                                         */
/* ---------------------------------------------------------------------- */

typedef struct routed {
    float *w;
    int32_t *ids;
} routed;

static routed route_topk(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *g, const float *bias)
{
    const size_t out = (size_t)d->num_tokens * d->top_k;
    routed r = {malloc(out * sizeof(float)), malloc(out * sizeof(int32_t))};
    ck_assert(r.w && r.ids);
    moecl_status st = moecl_topk_gating_host(ctx, d, g, bias, r.w, r.ids);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    return r;
}

/* A context under the variant override words (harness_override_with). */
static moecl_context *context_with_variant(const char *words)
{
    harness_override_with(words);
    moecl_context *ctx = harness_context();
    harness_override_with(NULL);
    return ctx;
}

START_TEST(test_determinism)
{
    harness_rng rng = harness_rng_for(5000);
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", "off", 1), 0);
    /* Several option sets, 1000 rows each. */
    for (int c = 0; c < 4; c++) {
        moecl_topk_gating_desc d = random_topk_desc(&rng, 1000);
        if (c == 0) {
            d = moecl_topk_gating_desc_init(1000, 256, 8);
            d.scoring = MOECL_SCORING_SIGMOID;
            d.num_expert_groups = 8;
            d.topk_group = 4;
            d.renormalize = true;
        }
        const size_t n = (size_t)d.num_tokens * d.num_experts, out = (size_t)d.num_tokens * d.top_k;
        void *g = harness_random_tensor(&rng, d.gating_dtype, n, 2.0f);
        float *bias = harness_random_tensor(&rng, MOECL_F32, d.num_experts, 0.5f);

        /* Repeated calls on one context: bit-identical. */
        moecl_context *ctx = harness_context();
        routed first = route_topk(ctx, &d, g, bias);
        for (int rep = 0; rep < 5; rep++) {
            routed again = route_topk(ctx, &d, g, bias);
            ck_assert_msg(memcmp(again.ids, first.ids, out * 4) == 0, "case %d: ids changed on call %d", c, rep + 2);
            ck_assert_msg(memcmp(again.w, first.w, out * 4) == 0, "case %d: weights changed on call %d", c,
                          rep + 2);
            free(again.w);
            free(again.ids);
        }
        moecl_context_destroy(ctx);

        /* Other launch shapes on the same device: the same ids, each
         * result checked against the reference. Weights are not compared
         * bit for bit here: the two launch classes run different kernels,
         * and the team size changes a row's reduction order (on the H200
         * even sigmoid weights differed in their last bit between teams of
         * 8 and 32, 2026-11-30). The launch suite checks that rows per
         * work-group leave every bit alone. */
        static const char *const shapes[] = {"class=cpu", "class=gpu", "class=gpu team=8", "class=gpu team=32"};
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            ctx = context_with_variant(shapes[s]);
            routed other = route_topk(ctx, &d, g, bias);
            moecl_context_destroy(ctx);
            char msg[900];
            ck_assert_msg(ref_check_topk_gating(&d, g, bias, other.w, other.ids, msg, sizeof(msg)) == 0,
                          "case %d, %s: %s", c, shapes[s], msg);
            ck_assert_msg(memcmp(other.ids, first.ids, out * 4) == 0, "case %d, %s: ids differ", c, shapes[s]);
            free(other.w);
            free(other.ids);
        }
        free(first.w);
        free(first.ids);
        free(g);
        free(bias);
    }
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 5. Shapes whose byte counts pass 32 bits, with buffers far too small.   */
/* ---------------------------------------------------------------------- */

START_TEST(test_huge_shapes)
{
    moecl_context *ctx = harness_context();
    cl_command_queue q = moecl_context_queue(ctx);
    const size_t small = 4096;
    moecl_buffer in = harness_buffer(ctx, small, 0, NULL), in2 = harness_buffer(ctx, small, 0, NULL);
    moecl_buffer in3 = harness_buffer(ctx, small, 0, NULL), out1 = harness_buffer(ctx, small, 0, NULL);
    moecl_buffer out2 = harness_buffer(ctx, small, 0, NULL), out3 = harness_buffer(ctx, small, 0, NULL);
    /* num_tokens x experts x 4 bytes: 2^32 - 1 tokens x 4096 x 4 is about
     * 2^46 bytes, past 32 bits and every device's memory. */
    const uint32_t token_counts[] = {UINT32_MAX, 1u << 20, 262145};
    for (size_t i = 0; i < sizeof(token_counts) / sizeof(token_counts[0]); i++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(token_counts[i], 4096, 64);
        cl_event done = (cl_event)&d;
        moecl_status st = moecl_topk_gating(ctx, &d, in, (moecl_buffer){NULL, 0}, out1, out2, 0, NULL, &done);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "top-k, %u tokens: status %d", token_counts[i], (int)st);
        ck_assert_msg(strstr(moecl_context_error(ctx), "gating") != NULL, "message: %s", moecl_context_error(ctx));
        ck_assert_msg(done == (cl_event)&d, "*done was written");

        moecl_grounded_router_desc g = moecl_grounded_router_desc_init(token_counts[i], 65536, 4096, 1.0f);
        g.top_k = 64;
        st = moecl_grounded_router(ctx, &g, in, in2, in3, out1, out2, out3, 0, NULL, NULL);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "grounded, %u tokens: status %d", token_counts[i], (int)st);
        ck_assert_msg(strstr(moecl_context_error(ctx), "hidden") != NULL, "message: %s", moecl_context_error(ctx));
    }
    /* Nothing was written: every output still holds the poison. */
    moecl_buffer outs[3] = {out1, out2, out3};
    for (int o = 0; o < 3; o++) {
        unsigned char bytes[4096];
        ck_assert_int_eq(clEnqueueReadBuffer(q, outs[o].mem, CL_TRUE, 0, small, bytes, 0, NULL, NULL), CL_SUCCESS);
        for (size_t b = 0; b < small; b++)
            ck_assert_msg(bytes[b] == HARNESS_POISON, "output %d byte %zu was written", o, b);
    }
    harness_release(in);
    harness_release(in2);
    harness_release(in3);
    harness_release(out1);
    harness_release(out2);
    harness_release(out3);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    /* Binaries in the cache on every device (on pocl the device table
     * leaves them to pocl's own cache): the race is over moecl's entries. */
    if (argc > 1 && strcmp(argv[1], "--warm-cache-child") == 0)
        return moecl_override_set("binaries=on") == MOECL_SUCCESS ? warm_child() : 1;
    ssize_t len = readlink("/proc/self/exe", self_path, sizeof(self_path) - 1);
    if (len <= 0)
        return 1;
    self_path[len] = '\0';
    harness_args(argc, argv, moecl_override_set);

    Suite *s = suite_create("stress");
    TCase *tc = tcase_create("stress");
    tcase_set_timeout(tc, 900);
    /* First, before this process opens OpenCL: on the H200 a child process
     * started after its parent had created a context saw no NVIDIA
     * platform (cause not established), which would test the driver, not
     * the cache. */
    tcase_add_test(tc, test_two_processes_one_cache);
    tcase_add_test(tc, test_threads_shared_context);
    tcase_add_test(tc, test_threads_own_contexts);
    tcase_add_test(tc, test_determinism);
    tcase_add_test(tc, test_huge_shapes);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
