/* Device selection and the context: selectors (none, MOECL_DEVICE, "gpu",
 * "cpu", "gpu:N", "cpu:N", "P:D", platform and device names in any case),
 * the message that lists the devices when none matches, the context's
 * accessors and moecl_context_describe, and no OpenCL platform at all (a child process,
 * `test_device --probe-create`, with an empty ICD directory: it needs fresh
 * OpenCL loader state). */
#include "runtime_common.h"

#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------------- */
/* Device selection and context accessors                                 */
/* ---------------------------------------------------------------------- */

static cl_device_type device_type(cl_device_id dev)
{
    cl_device_type t = 0;
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_TYPE, sizeof(t), &t, NULL), CL_SUCCESS);
    return t;
}

static void expect_no_device(const char *selector, const char *source_hint)
{
    rt_reset_null_error();
    moecl_context *ctx = CTX_SENTINEL;
    moecl_status st = moecl_context_create(selector, &ctx);
    ck_assert_msg(st == MOECL_ERROR_NO_DEVICE, "selector \"%s\": status %d (%s)", selector ? selector : "(NULL)",
                  (int)st, moecl_status_string(st));
    ck_assert_msg(ctx == NULL, "selector \"%s\": *ctx not set to NULL", selector ? selector : "(NULL)");
    const char *msg = moecl_context_error(NULL);
    ck_assert_msg(strstr(msg, "0:0") != NULL, "selector \"%s\": the message does not list the devices: %s",
                  selector ? selector : "(NULL)", msg);
    if (source_hint)
        ck_assert_msg(strstr(msg, source_hint) != NULL, "the message does not mention %s: %s", source_hint, msg);
}

static moecl_context *expect_device(const char *selector, cl_device_id want)
{
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(selector, &ctx);
    ck_assert_msg(st == MOECL_SUCCESS, "selector \"%s\": %s: %s", selector ? selector : "(NULL)",
                  moecl_status_string(st), moecl_context_error(NULL));
    ck_assert_ptr_nonnull(ctx);
    if (want)
        ck_assert_msg(moecl_context_device(ctx) == want, "selector \"%s\" chose another device",
                      selector ? selector : "(NULL)");
    return ctx;
}

START_TEST(test_device_selection)
{
    unsetenv("MOECL_DEVICE");
    cl_platform_id platforms[16];
    cl_uint np = 0;
    ck_assert_int_eq(clGetPlatformIDs(16, platforms, &np), CL_SUCCESS);
    ck_assert_uint_ge(np, 1);
    cl_device_id dev00;
    ck_assert_int_eq(clGetDeviceIDs(platforms[0], CL_DEVICE_TYPE_ALL, 1, &dev00, NULL), CL_SUCCESS);
    /* Every device of every platform in order: all_gpus (GPUs and
     * accelerators) and all_cpus, as "gpu:N" and "cpu:N" number them. */
    cl_device_id all_gpus[256], all_cpus[256];
    unsigned num_gpus = 0, num_cpus = 0;
    for (cl_uint p = 0; p < np; p++) {
        cl_device_id devs[64];
        cl_uint nd = 0;
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 64, devs, &nd) != CL_SUCCESS)
            continue;
        for (cl_uint i = 0; i < nd && i < 64; i++) {
            cl_device_type t = device_type(devs[i]);
            if ((t & CL_DEVICE_TYPE_CPU) && num_cpus < 256)
                all_cpus[num_cpus++] = devs[i];
            if ((t & (CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR)) && num_gpus < 256)
                all_gpus[num_gpus++] = devs[i];
        }
    }
    cl_device_id first_cpu = num_cpus ? all_cpus[0] : NULL, first_gpu = num_gpus ? all_gpus[0] : NULL;

    /* No selector, no MOECL_DEVICE: the first GPU or accelerator, else the
     * first CPU. */
    moecl_context *def = expect_device(NULL, first_gpu ? first_gpu : first_cpu);
    moecl_context_destroy(def);
    if (first_gpu) {
        def = expect_device("gpu", first_gpu);
        moecl_context_destroy(def);
    } else {
        expect_no_device("gpu", "gpu");
    }

    moecl_context *ctx = expect_device("0:0", dev00);
    moecl_context_destroy(ctx);

    if (first_cpu) {
        ctx = expect_device("cpu", first_cpu);
        ck_assert(device_type(moecl_context_device(ctx)) & CL_DEVICE_TYPE_CPU);
        moecl_context_destroy(ctx);
    } else {
        expect_no_device("cpu", NULL);
    }

    /* "gpu:N" and "cpu:N": the Nth device of the kind, all platforms
     * together; one past the last is no device; malformed ones are errors
     * (not substrings). */
    for (int kind = 0; kind < 2; kind++) {
        const bool gpu = kind == 0;
        const unsigned count = gpu ? num_gpus : num_cpus;
        for (unsigned i = 0; i < count; i++) {
            char sel[16];
            snprintf(sel, sizeof(sel), "%s:%u", gpu ? "GPU" : "cpu", i);
            moecl_context *c = expect_device(sel, gpu ? all_gpus[i] : all_cpus[i]);
            moecl_context_destroy(c);
        }
        char past[16];
        snprintf(past, sizeof(past), "%s:%u", gpu ? "gpu" : "cpu", count);
        expect_no_device(past, past);
    }
    static const char *const malformed[] = {"gpu:", "cpu:x", "gpu:-1", "gpu: 0", "cpu:0 ", "gpu:1x", "cpu:99999"};
    for (size_t i = 0; i < sizeof(malformed) / sizeof(malformed[0]); i++) {
        moecl_context *c = CTX_SENTINEL;
        ck_assert_int_eq(moecl_context_create(malformed[i], &c), MOECL_ERROR_NO_DEVICE);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(moecl_context_error(NULL), "is not \"gpu:N\" or \"cpu:N\"") != NULL,
                      "selector \"%s\": %s", malformed[i], moecl_context_error(NULL));
    }

    expect_no_device("9:9", "9:9");
    expect_no_device("no-such-device-xyz", "no-such-device-xyz");

    /* A substring of the platform name, in another case. */
    char pname[256] = "";
    ck_assert_int_eq(clGetPlatformInfo(platforms[0], CL_PLATFORM_NAME, sizeof(pname), pname, NULL), CL_SUCCESS);
    pname[sizeof(pname) - 1] = '\0';
    char word[16] = "";
    size_t n = 0;
    for (const char *p = pname; *p && *p != ' ' && *p != '/' && n < sizeof(word) - 1; p++)
        word[n++] = islower((unsigned char)*p) ? (char)toupper((unsigned char)*p) : (char)tolower((unsigned char)*p);
    word[n] = '\0';
    ck_assert_msg(n > 0, "platform 0 has no name");
    ctx = expect_device(word, dev00);
    moecl_context_destroy(ctx);
    if (strcasestr(pname, "portable")) {
        ctx = expect_device("portable", dev00);
        moecl_context_destroy(ctx);
    }
    /* The whole "platform / device" label. */
    char dname[256] = "", label[600];
    ck_assert_int_eq(clGetDeviceInfo(dev00, CL_DEVICE_NAME, sizeof(dname), dname, NULL), CL_SUCCESS);
    dname[sizeof(dname) - 1] = '\0';
    snprintf(label, sizeof(label), "%s / %s", pname, dname);
    ctx = expect_device(label, dev00);
    moecl_context_destroy(ctx);

    /* MOECL_DEVICE for a NULL selector; an explicit selector wins over it. */
    if (first_cpu) {
        setenv("MOECL_DEVICE", "cpu", 1);
        ctx = expect_device(NULL, first_cpu);
        moecl_context_destroy(ctx);
    }
    setenv("MOECL_DEVICE", "no-such-device", 1);
    expect_no_device(NULL, "no-such-device");
    ctx = expect_device("0:0", dev00);
    moecl_context_destroy(ctx);
    unsetenv("MOECL_DEVICE");

    /* NULL output pointer. */
    rt_reset_null_error();
    ck_assert_int_eq(moecl_context_create(NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(NULL), "ctx") != NULL, "create(NULL ctx) says \"%s\"",
                  moecl_context_error(NULL));
    ck_assert_int_eq(moecl_context_create("0:0", NULL), MOECL_ERROR_INVALID_ARGUMENT);
}
END_TEST

START_TEST(test_context_accessors)
{
    moecl_context *ctx = harness_context();
    cl_context c = moecl_context_cl_context(ctx);
    cl_device_id dev = moecl_context_device(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(dev);
    ck_assert_ptr_nonnull(q);
    cl_context qc = NULL;
    cl_device_id qd = NULL;
    cl_command_queue_properties props = 0;
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_CONTEXT, sizeof(qc), &qc, NULL), CL_SUCCESS);
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_DEVICE, sizeof(qd), &qd, NULL), CL_SUCCESS);
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_PROPERTIES, sizeof(props), &props, NULL), CL_SUCCESS);
    ck_assert_ptr_eq(qc, c);
    ck_assert_ptr_eq(qd, dev);
    ck_assert_msg(!(props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE), "the context's own queue is out of order");

    ck_assert_ptr_null(moecl_context_cl_context(NULL));
    ck_assert_ptr_null(moecl_context_device(NULL));
    ck_assert_ptr_null(moecl_context_queue(NULL));
    moecl_context_destroy(NULL);

    /* No failure yet on this context: "". */
    ck_assert_str_eq(moecl_context_error(ctx), "");

    size_t need = moecl_context_describe(ctx, NULL, 0);
    ck_assert_uint_gt(need, 0);
    char *text = malloc(need + 1);
    ck_assert_ptr_nonnull(text);
    memset(text, 'x', need + 1);
    ck_assert_uint_eq(moecl_context_describe(ctx, text, need + 1), need);
    ck_assert_uint_eq(strlen(text), need);
    ck_assert_msg(strstr(text, "launch class") != NULL, "describe: %s", text);
    char dname[256] = "";
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof(dname), dname, NULL), CL_SUCCESS);
    dname[sizeof(dname) - 1] = '\0';
    ck_assert_msg(strstr(text, dname) != NULL, "describe does not name the device \"%s\": %s", dname, text);
    /* The length returned is the length written. */
    char *big = malloc(need + 4096);
    ck_assert_ptr_nonnull(big);
    ck_assert_uint_eq(moecl_context_describe(ctx, big, need + 4096), need);
    ck_assert_uint_eq(strlen(big), need);
    ck_assert_str_eq(big, text);
    free(big);
    /* Truncation as snprintf does it. */
    char small[16];
    memset(small, 'x', sizeof(small));
    ck_assert_uint_eq(moecl_context_describe(ctx, small, sizeof(small)), need);
    ck_assert_uint_eq(strlen(small), sizeof(small) - 1);
    ck_assert(memcmp(small, text, sizeof(small) - 1) == 0);
    free(text);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* No OpenCL platform: a child process with an empty ICD directory        */
/* ---------------------------------------------------------------------- */

/* The child's side: create a context on the default device, report. */
static int probe_create(void)
{
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(NULL, &ctx);
    printf("status %d\nctx %s\nmessage %s\n", (int)st, ctx ? "set" : "null", moecl_context_error(NULL));
    moecl_context_destroy(ctx);
    fflush(stdout);
    return 0;
}

/* Run this executable with --probe-create in the environment of environ
 * minus the names in drop plus the NAME=VALUE strings in add; its output
 * goes into out. Returns the exit status. */
static int spawn_probe(const char *const *drop, const char *const *add, char *out, size_t out_size)
{
    char self[PATH_MAX];
    harness_self_path(self, sizeof(self));
    const char *argv[] = {self, "--probe-create", NULL};
    return harness_spawn(argv, drop, add, out, out_size);
}

static int probe_status(const char *out)
{
    const char *s = strstr(out, "status ");
    ck_assert_msg(s != NULL, "the probe printed no status: %s", out);
    return atoi(s + 7);
}

START_TEST(test_no_platform)
{
    char out[8192];
    /* Control: the probe sees a device in this environment. It asks for
     * the CPU device: a GPU held by this process may refuse a second one
     * (exclusive compute mode; seen on the H200 machine), pocl never does. */
    const char *control[] = {"MOECL_DEVICE=cpu", NULL};
    const char *control_drop[] = {"MOECL_DEVICE", NULL};
    ck_assert_int_eq(spawn_probe(control_drop, control, out, sizeof(out)), 0);
    ck_assert_msg(probe_status(out) == MOECL_SUCCESS, "the probe fails with the normal environment: %s", out);
    ck_assert_msg(strstr(out, "ctx set") != NULL, "%s", out);

    char vendors[PATH_MAX], assign[PATH_MAX + 32];
    harness_env_path(vendors, sizeof(vendors), "vendors");
    ck_assert_int_eq(mkdir(vendors, 0700), 0);
    snprintf(assign, sizeof(assign), "OCL_ICD_VENDORS=%s", vendors);
    const char *drop[] = {"OCL_ICD_VENDORS", "OCL_ICD_FILENAMES", NULL};
    const char *add[] = {assign, NULL};
    ck_assert_int_eq(spawn_probe(drop, add, out, sizeof(out)), 0);
    ck_assert_msg(probe_status(out) == MOECL_ERROR_NO_DEVICE, "no platform: expected %d: %s", MOECL_ERROR_NO_DEVICE,
                  out);
    ck_assert_msg(strstr(out, "ctx null") != NULL, "no platform: *ctx not NULL: %s", out);
    ck_assert_msg(strstr(out, "pocl-opencl-icd") != NULL, "no platform: no install hint: %s", out);
}
END_TEST

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--probe-create") == 0)
        return probe_create();
    harness_args(argc, argv, NULL);

    Suite *s = suite_create("runtime_device");
    TCase *tc = rt_tcase(s, "context", true);
    tcase_add_test(tc, test_device_selection);
    tcase_add_test(tc, test_context_accessors);
    tcase_add_test(tc, test_no_platform);
    return harness_run(s);
}
