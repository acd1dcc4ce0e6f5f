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
 * scores the chosen ones after the selection (cl/topk_gating.cl, step 1).
 *
 * kernel_work_group_size: Mesa's rusticl 22.3.6 on llvmpipe reports
 * CL_KERNEL_WORK_GROUP_SIZE 32 for every kernel, one whose
 * reqd_work_group_size is 128 too, while work-groups up to the device's
 * CL_DEVICE_MAX_WORK_GROUP_SIZE (1024) with barriers and local memory run
 * right. moecl would refuse every kernel of more than 32 work-items there
 * (the GPU launch class, moe_align's and the layout's work-groups), so
 * the device table (src/device_table.c, MOECL_DP_KERNEL_WG_QUERY) takes the
 * device's limit for every kernel on that driver. The test fails where the
 * fault is present and the table does not say so, or where a work-group
 * of the limit moecl takes runs wrong.
 *
 * loop_iteration_limit: Mesa 22.3.6's llvmpipe (under rusticl) leaves a
 * loop after 65535 iterations, the iterations of loops nested in it
 * counted too, and the kernel goes on with whatever it has: a loop of
 * 70000 counts 65535. The grounded router's rows kernel, whose
 * work-item loops over its tokens, the experts and the hidden size,
 * routed 64 experts at hidden 256 right with up to 24 tokens a work-item
 * and wrong from 25 (at hidden 512 from 13); where the device table
 * records the limit (MOECL_DP_LOOP_LIMIT) the plans bound each kernel's
 * iterations a work-item by it (src/grounded_router.c, src/topk_gating.c;
 * the loop_budget cases of the grounded_router and topk_gating suites).
 * The test fails where the fault is present and the table does not record
 * the limit this kernel shows.
 *
 * loop_budget_shared: that limit is one budget for every loop a work-item
 * runs, one after another too: loops of 60000 and 10000 iterations count
 * 60000 and 5534. It is each work-item's own: 256 work-items of a
 * work-group, 40000 iterations each, all count 40000. moe_align's kernels with one work-item a chunk (the CPU
 * class's shape) walk the padding positions, the blocks and the slots in
 * one work-item, and at 4096 experts (520192 padding positions at block
 * 128) wrote the first block only; where the limit is recorded the device
 * table gives them work-groups (MOECL_DP_ALIGN_CHUNK_WG_CPU,
 * MOECL_DP_ALIGN_FUSED_WG_CPU), which spread those loops. The test fails
 * where the fault is present and the table keeps one work-item a chunk,
 * or where the same loops spread over that work-group count wrong.
 *
 * kernel_arg_holds_buffer: rusticl 22.3.6 keeps a buffer a kernel argument
 * names alive (and counted in CL_CONTEXT_REFERENCE_COUNT) after the
 * caller has released it, until the argument changes or the kernel is
 * released. moecl_context_forget_buffers therefore sets the held buffer
 * arguments of its kernels to NULL (src/program.c), which the test checks
 * frees the buffer on this device. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <CL/cl.h>

#include "harness.h"
#include "internal.h"

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

/* A program of source built for the context's device as OpenCL C 1.2. */
static cl_program build_source(moecl_context *ctx, const char *source)
{
    cl_device_id dev = moecl_context_device(ctx);
    cl_int err;
    cl_program prog = clCreateProgramWithSource(moecl_context_cl_context(ctx), 1, &source, NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(clBuildProgram(prog, 1, &dev, "-cl-std=CL1.2", NULL, NULL), CL_SUCCESS);
    return prog;
}

static cl_kernel kernel_of(cl_program prog, const char *name)
{
    cl_int err;
    cl_kernel k = clCreateKernel(prog, name, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    return k;
}

/* Runs kernel `name` of exp_source over N work-items in groups of `local`;
 * returns how many outputs are off the host's sigmoid by more than 4 ulp. */
static int run_exp_kernel(moecl_context *ctx, const char *name, size_t local)
{
    cl_context cl = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    cl_int err;
    cl_program prog = build_source(ctx, exp_source);
    cl_kernel k = kernel_of(prog, name);

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

static const char wg_source[] =
    /* Each work-item reads its neighbour's id through local memory. */
    "__kernel __attribute__((reqd_work_group_size(128, 1, 1))) void fixed(__global uint *out) {\n"
    "    __local uint tile[128];\n"
    "    const uint lid = get_local_id(0);\n"
    "    tile[lid] = (uint)get_global_id(0);\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    out[get_global_id(0)] = tile[(lid + 1) % 128];\n"
    "}\n"
    "__kernel void any_size(__global uint *out, __local uint *tile) {\n"
    "    const uint lid = get_local_id(0);\n"
    "    tile[lid] = (uint)get_global_id(0);\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    out[get_global_id(0)] = tile[(lid + 1) % get_local_size(0)];\n"
    "}\n";

/* Runs kernel k (wg_source's) over 4 work-groups of `local`; returns how
 * many outputs are wrong. */
static int run_wg_kernel(moecl_context *ctx, cl_kernel k, size_t local, bool local_arg)
{
    cl_int err;
    const size_t global = 4 * local;
    cl_uint *out = malloc(global * sizeof(*out));
    ck_assert_ptr_nonnull(out);
    cl_mem b = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_WRITE_ONLY, global * sizeof(*out), NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 0, sizeof b, &b), CL_SUCCESS);
    if (local_arg)
        ck_assert_int_eq(clSetKernelArg(k, 1, local * sizeof(cl_uint), NULL), CL_SUCCESS);
    cl_command_queue q = moecl_context_queue(ctx);
    ck_assert_int_eq(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, &local, 0, NULL, NULL), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueReadBuffer(q, b, CL_TRUE, 0, global * sizeof(*out), out, 0, NULL, NULL), CL_SUCCESS);
    int wrong = 0;
    for (size_t i = 0; i < global; i++)
        wrong += out[i] != (cl_uint)(i - i % local + (i % local + 1) % local);
    clReleaseMemObject(b);
    free(out);
    return wrong;
}

START_TEST(test_kernel_work_group_size)
{
    moecl_context *ctx = harness_context();
    cl_device_id dev = moecl_context_device(ctx);
    const size_t device_max = ctx->info.max_work_group_size;
    cl_program prog = build_source(ctx, wg_source);
    cl_kernel fixed = kernel_of(prog, "fixed"), any = kernel_of(prog, "any_size");
    size_t fixed_limit = 0, any_limit = 0;
    ck_assert_int_eq(clGetKernelWorkGroupInfo(fixed, dev, CL_KERNEL_WORK_GROUP_SIZE, sizeof fixed_limit, &fixed_limit,
                                              NULL),
                     CL_SUCCESS);
    ck_assert_int_eq(clGetKernelWorkGroupInfo(any, dev, CL_KERNEL_WORK_GROUP_SIZE, sizeof any_limit, &any_limit, NULL),
                     CL_SUCCESS);
    /* The fault: a kernel that must run in work-groups of 128 said to
     * allow fewer, on a device that allows 128. */
    const bool present = device_max >= 128 && fixed_limit < 128;
    const bool fenced = ctx->params.value[MOECL_DP_KERNEL_WG_QUERY] == 0;
    fprintf(stderr, "drivers: kernel_work_group_size: %s (CL_KERNEL_WORK_GROUP_SIZE %zu and %zu, device %zu)\n",
            present ? "present" : "absent", fixed_limit, any_limit, device_max);
    ck_assert_msg(!present || fenced,
                  "%s reports CL_KERNEL_WORK_GROUP_SIZE %zu for a kernel of reqd_work_group_size 128: "
                  "name the device in src/device_table.c (MOECL_DP_KERNEL_WG_QUERY 0) if larger work-groups "
                  "run right there",
                  ctx->info.device_name, fixed_limit);
    /* moecl's shape: the limit it takes, and the reqd size. */
    const size_t limit = fenced ? device_max : any_limit;
    int wrong = run_wg_kernel(ctx, any, limit, true);
    ck_assert_msg(wrong == 0, "work-groups of %zu (%s): %d outputs wrong", limit,
                  fenced ? "the device's limit, as the table says" : "CL_KERNEL_WORK_GROUP_SIZE", wrong);
    if (device_max >= 128) {
        wrong = run_wg_kernel(ctx, fixed, 128, false);
        ck_assert_msg(wrong == 0, "reqd_work_group_size 128: %d outputs wrong", wrong);
    }
    clReleaseKernel(fixed);
    clReleaseKernel(any);
    clReleaseProgram(prog);
    moecl_context_destroy(ctx);
}
END_TEST

static const char loop_source[] =
    /* A count and a hash of the iterations, which no compiler folds. */
    "__kernel void count(__global const uint *n, __global uint *out) {\n"
    "    uint c = 0, h = 0;\n"
    "    for (uint i = 0; i < n[0]; i++) {\n"
    "        c++;\n"
    "        h = h * 1664525u + i;\n"
    "    }\n"
    "    out[0] = c;\n"
    "    out[1] = h;\n"
    "}\n";

START_TEST(test_loop_iteration_limit)
{
    moecl_context *ctx = harness_context();
    cl_context cl = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    cl_int err;
    cl_program prog = build_source(ctx, loop_source);
    cl_kernel k = kernel_of(prog, "count");
    const cl_uint n = 70000;
    cl_uint out[2] = {0, 0}, hash = 0;
    for (cl_uint i = 0; i < n; i++)
        hash = hash * 1664525u + i;
    cl_mem bn = clCreateBuffer(cl, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof n, (void *)&n, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    cl_mem bo = clCreateBuffer(cl, CL_MEM_WRITE_ONLY, sizeof out, NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 0, sizeof bn, &bn), CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 1, sizeof bo, &bo), CL_SUCCESS);
    const size_t one = 1;
    ck_assert_int_eq(clEnqueueNDRangeKernel(q, k, 1, NULL, &one, &one, 0, NULL, NULL), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueReadBuffer(q, bo, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL), CL_SUCCESS);
    const bool present = out[0] != n || out[1] != hash;
    fprintf(stderr, "drivers: loop_iteration_limit: %s (a loop of %u counted %u)\n", present ? "present" : "absent", n,
            out[0]);
    const uint32_t recorded = ctx->params.value[MOECL_DP_LOOP_LIMIT];
    ck_assert_msg(!present || recorded == out[0],
                  "%s left a loop of %u iterations after %u, and the device table records a limit of %u "
                  "(src/device_table.c, MOECL_DP_LOOP_LIMIT): the grounded router and top-k gating would route from "
                  "truncated loops here",
                  ctx->info.device_name, n, out[0], recorded);
    clReleaseMemObject(bn);
    clReleaseMemObject(bo);
    clReleaseKernel(k);
    clReleaseProgram(prog);
    moecl_context_destroy(ctx);
}
END_TEST

static const char budget_source[] =
    /* Two loops one after the other, each work-item taking every
     * get_global_size(0)-th iteration; its counts go to out[2 * gid]. */
    "__kernel void two_loops(__global const uint *n, __global uint *out) {\n"
    "    const uint gid = get_global_id(0), step = get_global_size(0);\n"
    "    uint a = 0, b = 0;\n"
    "    for (uint i = gid; i < n[0]; i += step)\n"
    "        a++;\n"
    "    for (uint i = gid; i < n[1]; i += step)\n"
    "        b++;\n"
    "    out[2 * gid] = a;\n"
    "    out[2 * gid + 1] = b;\n"
    "}\n";

/* Runs two_loops over `items` work-items in one work-group; returns the
 * two loops' total counts. */
static void run_two_loops(moecl_context *ctx, cl_kernel k, const cl_uint n[2], size_t items, cl_uint total[2])
{
    cl_context cl = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    cl_int err;
    cl_uint *out = calloc(2 * items, sizeof(*out));
    ck_assert_ptr_nonnull(out);
    cl_mem bn = clCreateBuffer(cl, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, 2 * sizeof(*n), (void *)n, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    cl_mem bo = clCreateBuffer(cl, CL_MEM_WRITE_ONLY, 2 * items * sizeof(*out), NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 0, sizeof bn, &bn), CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 1, sizeof bo, &bo), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueNDRangeKernel(q, k, 1, NULL, &items, &items, 0, NULL, NULL), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueReadBuffer(q, bo, CL_TRUE, 0, 2 * items * sizeof(*out), out, 0, NULL, NULL),
                     CL_SUCCESS);
    total[0] = total[1] = 0;
    for (size_t i = 0; i < items; i++) {
        total[0] += out[2 * i];
        total[1] += out[2 * i + 1];
    }
    clReleaseMemObject(bn);
    clReleaseMemObject(bo);
    free(out);
}

START_TEST(test_loop_budget_shared)
{
    moecl_context *ctx = harness_context();
    cl_program prog = build_source(ctx, budget_source);
    cl_kernel k = kernel_of(prog, "two_loops");
    const cl_uint n[2] = {60000, 10000};
    cl_uint got[2];
    run_two_loops(ctx, k, n, 1, got);
    const bool present = got[0] != n[0] || got[1] != n[1];
    fprintf(stderr, "drivers: loop_budget_shared: %s (loops of %u and %u counted %u and %u)\n",
            present ? "present" : "absent", n[0], n[1], got[0], got[1]);
    /* moe_align's CPU-class work-groups, as the table gives them. */
    const size_t limit = ctx->info.max_work_group_size;
    const size_t chunk_wg = ctx->params.value[MOECL_DP_ALIGN_CHUNK_WG_CPU];
    const size_t fused_wg = ctx->params.value[MOECL_DP_ALIGN_FUSED_WG_CPU];
    ck_assert_msg(!present || (chunk_wg > 1 && fused_wg > 1),
                  "%s leaves the second of two loops early and the device table keeps moe_align's CPU-class "
                  "kernels at %zu and %zu work-items (src/device_table.c, MOECL_DP_ALIGN_CHUNK_WG_CPU and "
                  "MOECL_DP_ALIGN_FUSED_WG_CPU): they would write part of their padding and blocks at 4096 experts",
                  ctx->info.device_name, chunk_wg, fused_wg);
    const size_t wgs[2] = {chunk_wg < limit ? chunk_wg : limit, fused_wg < limit ? fused_wg : limit};
    for (int i = 0; i < 2; i++) {
        run_two_loops(ctx, k, n, wgs[i], got);
        ck_assert_msg(got[0] == n[0] && got[1] == n[1], "loops of %u and %u over %zu work-items counted %u and %u",
                      n[0], n[1], wgs[i], got[0], got[1]);
    }
    /* The budget is a work-item's own, not its work-group's: the plans
     * bound each work-item's iterations (docs/routing.md, "A driver's loop
     * limit"). A work-group of 256 work-items, 40000 iterations each. */
    const size_t many = limit < 256 ? limit : 256;
    const cl_uint each[2] = {(cl_uint)(40000 * many), 0};
    run_two_loops(ctx, k, each, many, got);
    ck_assert_msg(got[0] == each[0],
                  "%zu work-items of 40000 iterations each counted %u in all, not %u: the loop limit is not a "
                  "work-item's own, and the plans' bounds do not hold",
                  many, got[0], each[0]);
    clReleaseKernel(k);
    clReleaseProgram(prog);
    moecl_context_destroy(ctx);
}
END_TEST

static const char arg_source[] = "__kernel void one(__global int *x) { x[get_global_id(0)] = 1; }\n";

static cl_uint context_refs(cl_context c)
{
    cl_uint n = 0;
    ck_assert_int_eq(clGetContextInfo(c, CL_CONTEXT_REFERENCE_COUNT, sizeof n, &n, NULL), CL_SUCCESS);
    return n;
}

START_TEST(test_kernel_arg_holds_buffer)
{
    moecl_context *ctx = harness_context();
    cl_context cl = moecl_context_cl_context(ctx);
    cl_program prog = build_source(ctx, arg_source);
    cl_kernel k = kernel_of(prog, "one");
    const cl_uint before = context_refs(cl);
    cl_int err;
    cl_mem b = clCreateBuffer(cl, CL_MEM_READ_WRITE, 64, NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(clSetKernelArg(k, 0, sizeof b, &b), CL_SUCCESS);
    clReleaseMemObject(b);
    const cl_uint held = context_refs(cl);
    fprintf(stderr, "drivers: kernel_arg_holds_buffer: %s (context references %u before the buffer, %u after its "
            "release)\n", held != before ? "present" : "absent", before, held);
    /* moecl's shape: the argument set to NULL lets the buffer go. */
    ck_assert_int_eq(clSetKernelArg(k, 0, sizeof(cl_mem), NULL), CL_SUCCESS);
    ck_assert_msg(context_refs(cl) == before, "a released buffer still counted after its argument was set to NULL: "
                  "%u context references, %u before", context_refs(cl), before);
    clReleaseKernel(k);
    clReleaseProgram(prog);
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
    tcase_add_test(tc, test_kernel_work_group_size);
    tcase_add_test(tc, test_loop_iteration_limit);
    tcase_add_test(tc, test_loop_budget_shared);
    tcase_add_test(tc, test_kernel_arg_holds_buffer);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
