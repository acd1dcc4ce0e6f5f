/* MOECL_KERNEL_DIR: kernels read from a folder instead of the embedded
 * sources. A missing file or a source that does not compile is
 * MOECL_ERROR_BUILD with the file or the build log in the message, on
 * prepare and on both call paths, which write nothing; the real sources
 * give the right answers. The variable is read at context creation. */
#include "runtime_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------------- */
/* MOECL_KERNEL_DIR                                                       */
/* ---------------------------------------------------------------------- */

static moecl_context *context_with_kernel_dir(const char *dir)
{
    ck_assert_int_eq(setenv("MOECL_KERNEL_DIR", dir, 1), 0);
    moecl_context *ctx = harness_context();
    /* Read at creation: unsetting it now must not matter. */
    unsetenv("MOECL_KERNEL_DIR");
    return ctx;
}

static void expect_build_error(const char *dir, const char *needle, const char *label)
{
    moecl_context *ctx = context_with_kernel_dir(dir);
    cl_command_queue q = moecl_context_queue(ctx);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(3, EA, KA);
    rt_reset_error(ctx);
    moecl_status st = moecl_topk_gating_prepare(ctx, &d);
    ck_assert_msg(st == MOECL_ERROR_BUILD, "%s: prepare: status %d (%s)", label, (int)st, moecl_status_string(st));
    rt_assert_error_names(ctx, needle, label);

    /* The calls fail the same way and write nothing. */
    float hg[3 * EA], hw[3 * KA];
    int32_t hi[3 * KA];
    memset(hg, 0, sizeof(hg));
    memset(hw, HARNESS_POISON, sizeof(hw));
    memset(hi, HARNESS_POISON, sizeof(hi));
    rt_reset_error(ctx);
    st = moecl_topk_gating_host(ctx, &d, hg, NULL, hw, hi);
    ck_assert_msg(st == MOECL_ERROR_BUILD, "%s: host call: status %d", label, (int)st);
    rt_assert_error_names(ctx, needle, label);
    ck_assert(harness_first_unpoisoned(hw, sizeof(hw)) == sizeof(hw));
    ck_assert(harness_first_unpoisoned(hi, sizeof(hi)) == sizeof(hi));

    moecl_buffer g = harness_buffer(ctx, sizeof(hg), 0, hg);
    moecl_buffer w = harness_buffer(ctx, sizeof(hw), 0, NULL), ids = harness_buffer(ctx, sizeof(hi), 0, NULL);
    cl_event done = DONE_SENTINEL;
    rt_reset_error(ctx);
    st = moecl_topk_gating(ctx, &d, g, (moecl_buffer){NULL, 0}, w, ids, 0, NULL, &done);
    ck_assert_msg(st == MOECL_ERROR_BUILD, "%s: device call: status %d", label, (int)st);
    rt_assert_error_names(ctx, needle, label);
    ck_assert(done == DONE_SENTINEL);
    rt_assert_mem_poison(q, w.mem, "topk_weights", label);
    rt_assert_mem_poison(q, ids.mem, "topk_ids", label);
    harness_release(g);
    harness_release(w);
    harness_release(ids);
    moecl_context_destroy(ctx);
}

START_TEST(test_kernel_dir)
{
    const char *cl_dir = getenv("MOECL_TEST_CL_DIR");
    ck_assert_msg(cl_dir && *cl_dir, "MOECL_TEST_CL_DIR (the cl/ folder of the sources) is not set: run the suite "
                                     "through `meson test`");
    /* No disk cache: every build below compiles the files themselves. */
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", "off", 1), 0);
    harness_rng rng = harness_rng_for(110);
    char src[HARNESS_PATH], dst[HARNESS_PATH];

    /* An empty directory: the first file is missing. */
    char empty[PATH_MAX];
    harness_env_path(empty, sizeof(empty), "empty");
    ck_assert_int_eq(mkdir(empty, 0700), 0);
    expect_build_error(empty, "common.cl", "empty MOECL_KERNEL_DIR");

    /* Only the shared files (common.cl, gating.cl): the op's file is
     * missing. */
    static const char *const shared[] = {"common.cl", "gating.cl"};
    char partial[PATH_MAX];
    harness_env_path(partial, sizeof(partial), "partial");
    ck_assert_int_eq(mkdir(partial, 0700), 0);
    for (size_t i = 0; i < 2; i++) {
        snprintf(src, sizeof(src), "%s/%s", cl_dir, shared[i]);
        snprintf(dst, sizeof(dst), "%s/%s", partial, shared[i]);
        harness_copy_file(src, dst);
    }
    expect_build_error(partial, "topk_gating.cl", "MOECL_KERNEL_DIR without topk_gating.cl");

    /* Sources that do not compile: the build log is in the message. */
    char broken[PATH_MAX];
    harness_env_path(broken, sizeof(broken), "broken");
    ck_assert_int_eq(mkdir(broken, 0700), 0);
    for (size_t i = 0; i < 2; i++) {
        snprintf(src, sizeof(src), "%s/%s", cl_dir, shared[i]);
        snprintf(dst, sizeof(dst), "%s/%s", broken, shared[i]);
        harness_copy_file(src, dst);
    }
    snprintf(dst, sizeof(dst), "%s/topk_gating.cl", broken);
    harness_write_file(dst, "#error moecl_rt_broken_source\n", strlen("#error moecl_rt_broken_source\n"));
    expect_build_error(broken, "moecl_rt_broken_source", "MOECL_KERNEL_DIR with a source that does not compile");

    /* The real sources. */
    moecl_context *ctx = context_with_kernel_dir(cl_dir);
    size_t need = moecl_context_describe(ctx, NULL, 0);
    char *text = malloc(need + 1);
    ck_assert_ptr_nonnull(text);
    moecl_context_describe(ctx, text, need + 1);
    ck_assert_msg(strstr(text, cl_dir) != NULL, "describe does not show the kernel dir: %s", text);
    free(text);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(31, EA, KA);
    moecl_status st = moecl_topk_gating_prepare(ctx, &d);
    ck_assert_msg(st == MOECL_SUCCESS, "prepare from %s: %s: %s", cl_dir, moecl_status_string(st),
                  moecl_context_error(ctx));
    rt_check_all_routes(ctx, &d, &rng);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, NULL);
    Suite *s = suite_create("runtime_kernel_dir");
    TCase *tc = rt_tcase(s, "kernel_dir", true);
    tcase_add_test(tc, test_kernel_dir);
    return harness_run(s);
}
