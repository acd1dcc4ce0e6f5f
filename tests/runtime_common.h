/* What the runtime suites (test_api.c, test_device.c, test_interop.c,
 * test_cache.c, test_kernel_dir.c, test_threads.c) share: their shapes,
 * sentinels, checks of the error detail and of untouched outputs, and
 * their environment fixture.
 *
 * Kernel variants are few on purpose (each costs a build): E=16,k=4 and
 * E=128,k=8, f32 logits, each with and without bias; only the threads
 * suite's registry test builds more (E=17..32, k=1: small rows kernels,
 * cheap to build). The suites share them through the kernel cache. */
#ifndef MOECL_TESTS_RUNTIME_COMMON_H
#define MOECL_TESTS_RUNTIME_COMMON_H

#include "harness.h"
#include "harness_env.h"

/* The two shapes every test shares. */
#define EA 16u
#define KA 4u
#define EB 128u
#define KB 8u

/* A value no library writes into *done: it must survive a failed call. */
#define DONE_SENTINEL ((cl_event)(uintptr_t)0x5eedu)
/* A value a failed create must overwrite with NULL. */
#define CTX_SENTINEL ((moecl_context *)(uintptr_t)0x5eedu)

double rt_now_s(void);
void rt_sleep_ms(long ms);

/* Overwrite ctx's error detail with a known one ("desc is NULL"), so that a
 * later check of the message cannot pass on a stale detail. */
void rt_reset_error(moecl_context *ctx);
/* The same for moecl_context_error(NULL): a failed adopt of NULL objects. */
void rt_reset_null_error(void);
/* ctx's error detail contains what, or one of its '|'-separated
 * alternatives. */
void rt_assert_error_names(moecl_context *ctx, const char *what, const char *label);
/* Fails the test unless every byte of m (read through q) is poison. */
void rt_assert_mem_poison(cl_command_queue q, cl_mem m, const char *what, const char *label);
/* The event's CL_EVENT_COMMAND_EXECUTION_STATUS. */
cl_int rt_event_status(cl_event ev);

/* harness_check_topk on the host and the device path, with and without
 * bias. */
void rt_check_all_routes(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng);

/* The checked fixture of the tests that change MOECL_DEVICE,
 * MOECL_CACHE_DIR, MOECL_KERNEL_DIR, XDG_CACHE_HOME or HOME, or write
 * files: harness_env_save of those, restored afterwards. */
void rt_env_setup(void);
void rt_env_teardown(void);

/* A test case of the suite with a 300 s timeout, in the fixture if
 * env_fixture. */
TCase *rt_tcase(Suite *s, const char *name, bool env_fixture);

#endif
