/* One context shared by several threads: checked calls of both shapes on
 * both paths from four threads at once, and routing while another thread
 * builds dozens of variants (the variant registry grows under the
 * lookups). The workers use the harness_try_* helpers, which do not
 * assert: a Check assertion outside the test's thread cannot stop it. */
#include "runtime_common.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------- */
/* One context, several threads                                           */
/* ---------------------------------------------------------------------- */

#define THREADS 4
#define CALLS 50
/* harness_quick (valgrind and the sanitizer build, where a checked call
 * costs tens of times more): still every combination, four times a thread. */
#define QUICK_CALLS 16

typedef struct worker {
    moecl_context *ctx;
    int id;
    int calls;
    harness_error err;
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    harness_rng rng = harness_rng_for(1000 + (uint64_t)w->id);
    const int calls = harness_quick() ? QUICK_CALLS : CALLS;
    for (int i = 0; i < calls; i++) {
        /* Paths alternate every call, shapes every two calls, so every
         * thread runs all four combinations. */
        harness_path path = (i % 2) ? HARNESS_DEVICE : HARNESS_HOST;
        bool big = ((i / 2 + w->id) % 2) != 0;
        uint32_t t = 1 + harness_rand_u32(&rng) % 48;
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(t, big ? EB : EA, big ? KB : KA);
        bool bias = (harness_rand_u32(&rng) & 1) != 0;
        size_t offset = (size_t)(harness_rand_u32(&rng) % 4) * 64;
        harness_error e = {0};
        if (!harness_try_topk(w->ctx, &d, &rng, bias, path, offset, &e))
            harness_fail(&w->err, "thread %d, call %d: %s", w->id, i, e.msg);
        w->calls++;
    }
    return NULL;
}

START_TEST(test_threads)
{
    (void)harness_seed(); /* before any thread asks for it */
    moecl_context *ctx = harness_context();
    worker workers[THREADS];
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) {
        workers[i] = (worker){.ctx = ctx, .id = i};
        ck_assert_int_eq(pthread_create(&threads[i], NULL, worker_main, &workers[i]), 0);
    }
    for (int i = 0; i < THREADS; i++)
        ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
    int failures = 0;
    const char *first = NULL;
    for (int i = 0; i < THREADS; i++) {
        ck_assert_int_eq(workers[i].calls, harness_quick() ? QUICK_CALLS : CALLS);
        failures += workers[i].err.count;
        if (workers[i].err.count && !first)
            first = workers[i].err.msg;
    }
    ck_assert_msg(failures == 0, "%d of %d calls failed; first: %s", failures,
                  THREADS * (harness_quick() ? QUICK_CALLS : CALLS), first);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Routing while another thread builds dozens of variants                 */
/* ---------------------------------------------------------------------- */

/* The registry's array of variants is reallocated as it grows past 16 and
 * 32 entries (src/program.c) while other threads look variants up in it.
 * Each round takes a fresh context (a fresh registry): one thread builds
 * BUILD_SHAPES shapes (E = 17, 18, ..., k 1: a distinct NUM_EXPERTS define
 * each; prepare builds the variants with and without bias, so 32 variants,
 * which with the routed shape's two cross both growths; under
 * harness_quick half as many, one growth) while ROUTERS threads route
 * on the shape built first, checked against the reference, and between
 * their calls look up the newest variant (prepare of a built shape is a
 * registry lookup and nothing else; the newest is last, so the lookup
 * walks the whole array). A lookup that walks the array as it moves reads
 * freed memory. ASan reports it only when a lookup starts in the instant
 * between the builder's own lookup and the move, so the test runs many
 * rounds; ThreadSanitizer reports the unordered accesses whatever the
 * timing. After the first round the builds come from the disk cache and
 * are cheap; no round starts after BUILD_SECONDS. */
#define ROUTERS 2
#define BUILD_SHAPES 16
#define BUILD_ROUNDS 40
#define BUILD_SECONDS 10.0
#define LOOKUPS_PER_ROUTE 500

typedef struct router {
    moecl_context *ctx;
    int id;
    atomic_int *stop, *built; /* shapes the builder has finished */
    int routes;
    harness_error err;
} router;

static void *router_main(void *arg)
{
    router *r = arg;
    harness_rng rng = harness_rng_for(1100 + (uint64_t)r->id);
    /* At least one checked call, however fast the builder is. */
    for (int i = 0; i == 0 || !atomic_load(r->stop); i++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1 + harness_rand_u32(&rng) % 24, EA, KA);
        harness_error e = {0};
        if (!harness_try_topk(r->ctx, &d, &rng, (i & 1) != 0, (i / 2 + r->id) % 2 ? HARNESS_DEVICE : HARNESS_HOST, 64,
                              &e))
            harness_fail(&r->err, "router %d, call %d: %s", r->id, i, e.msg);
        r->routes++;
        /* The newest variants: the search walks the whole array. */
        const int newest = atomic_load(r->built);
        const moecl_topk_gating_desc lookup = newest ? moecl_topk_gating_desc_init(1, 17 + (uint32_t)newest - 1, 1)
                                                     : moecl_topk_gating_desc_init(1, EA, KA);
        for (int j = 0; j < LOOKUPS_PER_ROUTE && !atomic_load(r->stop); j++) {
            moecl_status st = moecl_topk_gating_prepare(r->ctx, &lookup);
            if (st != MOECL_SUCCESS)
                harness_fail(&r->err, "router %d, lookup: %s: %s", r->id, moecl_status_string(st),
                             moecl_context_error(r->ctx));
        }
    }
    return NULL;
}

static void build_while_routing(int round, uint32_t shapes)
{
    harness_rng rng = harness_rng_for(1099 + (uint64_t)round * 7);
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc built = moecl_topk_gating_desc_init(1, EA, KA);
    moecl_status st = moecl_topk_gating_prepare(ctx, &built);
    ck_assert_msg(st == MOECL_SUCCESS, "prepare: %s: %s", moecl_status_string(st), moecl_context_error(ctx));

    atomic_int stop = 0, built_shapes = 0;
    router routers[ROUTERS];
    pthread_t threads[ROUTERS];
    for (int i = 0; i < ROUTERS; i++) {
        routers[i] = (router){.ctx = ctx, .id = round * ROUTERS + i, .stop = &stop, .built = &built_shapes};
        ck_assert_int_eq(pthread_create(&threads[i], NULL, router_main, &routers[i]), 0);
    }
    char first_build[1200] = "";
    for (uint32_t i = 0; i < shapes; i++) {
        const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 17 + i, 1);
        st = moecl_topk_gating_prepare(ctx, &d);
        if (st != MOECL_SUCCESS && !first_build[0])
            snprintf(first_build, sizeof(first_build), "building E=%u: %s: %s", 17 + i, moecl_status_string(st),
                     moecl_context_error(ctx));
        if (st == MOECL_SUCCESS)
            atomic_store(&built_shapes, (int)i + 1);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < ROUTERS; i++)
        ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
    ck_assert_msg(!first_build[0], "round %d: %s", round, first_build);
    for (int i = 0; i < ROUTERS; i++) {
        ck_assert_msg(routers[i].err.count == 0, "round %d: %d of %d calls of router %d failed; first: %s", round,
                      routers[i].err.count, routers[i].routes, i, routers[i].err.msg);
        ck_assert_int_ge(routers[i].routes, 1);
    }
    /* The variants built meanwhile serve their shapes. */
    for (uint32_t e = 17 + (uint32_t)round % 5; e < 17 + shapes; e += 5) {
        const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(5, e, 1);
        harness_check_topk(ctx, &d, &rng, e % 2 != 0, HARNESS_HOST, 0);
    }
    moecl_context_destroy(ctx);
}

START_TEST(test_threads_while_building)
{
    (void)harness_seed(); /* before any thread asks for it */
    /* harness_quick (the sanitizer build): half the shapes, one growth a
     * round. */
    const uint32_t shapes = harness_quick() ? BUILD_SHAPES / 2 : BUILD_SHAPES;
    const double t0 = rt_now_s();
    for (int round = 0; round < BUILD_ROUNDS && (round == 0 || rt_now_s() - t0 < BUILD_SECONDS); round++)
        build_while_routing(round, shapes);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, NULL);
    Suite *s = suite_create("runtime_threads");
    TCase *tc = rt_tcase(s, "threads", false);
    tcase_add_test(tc, test_threads);
    /* Not under valgrind: its 18 builds compiled there (harness_valgrind)
     * took 7 minutes, and with the threads taking turns the moving array
     * is never read in the instant that matters; the sanitizer build and
     * the plain run check it. */
    if (!harness_valgrind())
        tcase_add_test(tc, test_threads_while_building);
    return harness_run(s);
}
