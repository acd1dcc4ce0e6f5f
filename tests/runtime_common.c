#include "runtime_common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double rt_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void rt_sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void rt_reset_error(moecl_context *ctx)
{
    moecl_status st = moecl_topk_gating_prepare(ctx, NULL);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(ctx), "desc") != NULL, "prepare(NULL desc) says \"%s\"",
                  moecl_context_error(ctx));
}

void rt_reset_null_error(void)
{
    moecl_context *c = CTX_SENTINEL;
    ck_assert_int_eq(moecl_context_create_from_cl(NULL, NULL, NULL, &c), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_null(c);
    ck_assert_msg(strstr(moecl_context_error(NULL), "context") != NULL, "adopt(NULL) says \"%s\"",
                  moecl_context_error(NULL));
}

void rt_assert_error_names(moecl_context *ctx, const char *what, const char *label)
{
    const char *msg = moecl_context_error(ctx);
    ck_assert_ptr_nonnull(msg);
    bool found = false;
    for (const char *p = what; *p && !found;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        char alt[128];
        snprintf(alt, sizeof(alt), "%.*s", (int)len, p);
        found = len > 0 && strstr(msg, alt) != NULL;
        p += len + (bar ? 1 : 0);
    }
    ck_assert_msg(found, "%s: the message \"%s\" does not name %s", label, msg, what);
}

void rt_assert_mem_poison(cl_command_queue q, cl_mem m, const char *what, const char *label)
{
    size_t n = 0;
    ck_assert_int_eq(clGetMemObjectInfo(m, CL_MEM_SIZE, sizeof(n), &n, NULL), CL_SUCCESS);
    unsigned char *buf = malloc(n);
    ck_assert_ptr_nonnull(buf);
    cl_int err = clEnqueueReadBuffer(q, m, CL_TRUE, 0, n, buf, 0, NULL, NULL);
    size_t at = harness_first_unpoisoned(buf, n);
    free(buf);
    ck_assert_msg(err == CL_SUCCESS, "%s: reading %s back: %d", label, what, err);
    ck_assert_msg(at == n, "%s: %s changed at byte %zu of %zu", label, what, at, n);
}

cl_int rt_event_status(cl_event ev)
{
    cl_int s = -12345;
    ck_assert_int_eq(clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(s), &s, NULL), CL_SUCCESS);
    return s;
}

void rt_check_all_routes(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng)
{
    harness_check_topk(ctx, d, rng, false, HARNESS_HOST, 0);
    harness_check_topk(ctx, d, rng, true, HARNESS_HOST, 0);
    harness_check_topk(ctx, d, rng, false, HARNESS_DEVICE, 256);
    harness_check_topk(ctx, d, rng, true, HARNESS_DEVICE, 4);
}

static const char *const env_names[] = {"MOECL_DEVICE", "MOECL_CACHE_DIR", "MOECL_KERNEL_DIR", "XDG_CACHE_HOME",
                                        "HOME", NULL};

void rt_env_setup(void) { harness_env_save(env_names, "runtime"); }

void rt_env_teardown(void) { harness_env_restore(); }

TCase *rt_tcase(Suite *s, const char *name, bool env_fixture)
{
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, 300);
    if (env_fixture)
        tcase_add_checked_fixture(tc, rt_env_setup, rt_env_teardown);
    suite_add_tcase(s, tc);
    return tc;
}
