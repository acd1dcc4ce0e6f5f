/* Driver faults moecl's kernels are shaped around, each as the smallest
 * kernel that shows it, run on the device moecl picks. A test fails only if
 * the kernel shape moecl uses instead is wrong on this device; whether the
 * fault itself is still there is printed, so a fixed driver shows up in the
 * log and the workaround can be dropped:
 *   "drivers: <name>: present" or "drivers: <name>: absent".
 *
 * exp_across_barrier: Intel's CPU OpenCL runtime (2026.2.0) loses a
 * work-item's exp() result held in private memory across a barrier at
 * work-group sizes other than its vector width: every work-item reads the
 * last one's value. exp2, sqrt and log are not affected; a value stored in
 * local memory before the barrier, or computed after it, is right.
 * topk_gating_team therefore keeps the logits through its barriers and
 * scores the chosen ones after the selection (cl/topk_gating.cl, step 1). */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <CL/cl.h>

#include "harness.h"

static const char exp_source[] =
    "__kernel void across(__global const float *x, __global float *out) {\n"
    "    const float v = 1.0f / (1.0f + exp(-x[get_global_id(0)]));\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    out[get_global_id(0)] = v;\n"
    "}\n"
    /* moecl's shape: the input crosses the barrier, exp comes after. */
    "__kernel void after(__global const float *x, __global float *out) {\n"
    "    const float v = x[get_global_id(0)];\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    out[get_global_id(0)] = 1.0f / (1.0f + exp(-v));\n"
    "}\n";

enum { N = 256 };

/* Runs kernel `name` of exp_source over N work-items in groups of `local`;
 * returns how many outputs are off the host's sigmoid by more than 4 ulp. */
static int run_exp_kernel(moecl_context *ctx, const char *name, size_t local)
{
    cl_context cl = moecl_context_cl_context(ctx);
    cl_device_id dev = moecl_context_device(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    cl_int err;
    const char *src = exp_source;
    cl_program prog = clCreateProgramWithSource(cl, 1, &src, NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(clBuildProgram(prog, 1, &dev, "-cl-std=CL1.2", NULL, NULL), CL_SUCCESS);
    cl_kernel k = clCreateKernel(prog, name, &err);
    ck_assert_int_eq(err, CL_SUCCESS);

    float x[N], out[N];
    for (int i = 0; i < N; i++)
        x[i] = (float)(i % 37) * 0.1f - 1.5f;
    cl_mem bx = clCreateBuffer(cl, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof x, x, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    cl_mem bo = clCreateBuffer(cl, CL_MEM_WRITE_ONLY, sizeof out, NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 0, sizeof bx, &bx), CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 1, sizeof bo, &bo), CL_SUCCESS);
    const size_t global = N;
    ck_assert_int_eq(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, &local, 0, NULL, NULL), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueReadBuffer(q, bo, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL), CL_SUCCESS);

    int wrong = 0;
    for (int i = 0; i < N; i++) {
        const double want = 1.0 / (1.0 + exp(-(double)x[i]));
        wrong += !(fabs(out[i] - want) <= 4.0 * FLT_EPSILON * want);
    }
    clReleaseMemObject(bx);
    clReleaseMemObject(bo);
    clReleaseKernel(k);
    clReleaseProgram(prog);
    return wrong;
}

START_TEST(test_exp_across_barrier)
{
    moecl_context *ctx = harness_context();
    size_t max_wg = 0;
    ck_assert_int_eq(clGetDeviceInfo(moecl_context_device(ctx), CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof max_wg,
                                     &max_wg, NULL),
                     CL_SUCCESS);
    static const size_t locals[] = {8, 32, 64};
    int faulty = 0;
    for (size_t i = 0; i < sizeof locals / sizeof locals[0]; i++) {
        if (locals[i] > max_wg)
            continue;
        faulty += run_exp_kernel(ctx, "across", locals[i]);
        const int wrong = run_exp_kernel(ctx, "after", locals[i]);
        ck_assert_msg(wrong == 0, "exp after the barrier, work-groups of %zu: %d of %d outputs wrong", locals[i],
                      wrong, N);
    }
    fprintf(stderr, "drivers: exp_across_barrier: %s\n", faulty ? "present" : "absent");
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, NULL);
    Suite *s = suite_create("drivers");
    TCase *tc = tcase_create("quirks");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_exp_across_barrier);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
