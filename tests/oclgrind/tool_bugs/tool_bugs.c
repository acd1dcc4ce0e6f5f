/* The oclgrind 21.10 bugs that tests/oclgrind/run.sh works around, each as
 * the smallest kernel that shows it (tool_bugs/README.md says what each
 * one breaks in moecl and what the run leaves out for it).
 *
 *   tool_bugs --list        the names
 *   tool_bugs NAME          run that reproducer on the first OpenCL device there is
 *
 * Each kernel is correct OpenCL C: on a real implementation (pocl) every
 * reproducer prints "NAME: values right" and exits 0. Under oclgrind a
 * present bug shows as wrong values (exit 1), as a report in oclgrind's
 * log, or as a crash; run.sh runs each under the flags that show it and
 * says "present" or "absent", so a fixed oclgrind shows up in CI's log and
 * its workaround can go. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120
#endif
#include <CL/cl.h>

typedef struct bug {
    const char *name;
    const char *source; /* kernel "repro" */
    bool fill;          /* zero the output with clEnqueueFillBuffer first */
    size_t items;       /* work-items, one work-group */
    unsigned out_count; /* uints of output checked */
    unsigned expect[16];
    bool unwritten; /* the output buffer is created without host data */
} bug;

/* in[i] = i % 3 for i < 16, in[16 + i] = 1: so in[i] > in[16 + i] exactly
 * where i % 3 == 2. */
static const bug bugs[] = {
    /* `z -= (a > b)` on vectors: the compare gives -1 per true lane, so z
     * is 1 there. Clang's optimiser turns 0 - sext(cmp) into
     * zext(<N x i1> cmp); oclgrind's zext of a vector of i1 gives 255 for
     * true, at every width (2 to 16 lanes). -cl-opt-disable keeps the sext
     * and oclgrind is right. moecl: the top-k rows kernel's fast path
     * counts with `above -= lane_max.sw > lane_max` and `place -= ...`
     * (cl/topk_gating.cl), and then writes past slot_of[16]. */
    {"zext_bool_vector",
     "__kernel void repro(__global const uint *in, __global uint *out)\n"
     "{\n"
     "    const float4 a = convert_float4(vload4(0, in)), b = convert_float4(vload4(4, in + 12));\n"
     "    int4 z = (int4)(0);\n"
     "    z -= a > b;\n"
     "    vstore4(as_uint4(z), 0, out);\n"
     "}\n",
     false, 1, 4, {0, 0, 1, 0}, false},
    /* Lanes 8..15 of a 16-lane vector taken by a shuffle (.hi, or any
     * swizzle that reads them) are reported as uninitialised by
     * --uninitialized, though the vector came whole from a buffer the host
     * wrote; the values are right. 8-lane vectors are fine. moecl: the
     * rows kernels of top-k gating (fast path) and of the grounded router
     * use float16 (rotations, halves). */
    {"shuffle16_uninitialized",
     "__kernel void repro(__global const uint *in, __global uint *out)\n"
     "{\n"
     "    vstore8(vload16(0, in).hi, 0, out);\n"
     "}\n",
     false, 1, 8, {2, 0, 1, 2, 0, 1, 2, 0}, false},
    /* A shuffle whose mask has undefined elements (clang makes
     * <undef x 4, 12, 13, 14, 15> of `v.hi.hi` on a uint16) crashes
     * --uninitialized (SIGSEGV in Uninitialized::instructionExecuted).
     * moecl: the same kernels (hor16, hmax16). */
    {"shuffle_undef_crash",
     "__kernel void repro(__global const uint *in, __global uint *out)\n"
     "{\n"
     "    const uint16 v = vload16(0, in);\n"
     "    const uint8 a = v.hi;\n"
     "    vstore4(a.hi, 0, out);\n"
     "}\n",
     false, 1, 4, {0, 1, 2, 0}, false},
    /* An integer division and remainder of the same operands: clang's
     * DivRemPairs pass emits `freeze`, which --uninitialized does not
     * implement ("OCLGRIND FATAL ERROR ... Unsupported instruction:
     * freeze"); the work-item stops there and writes nothing.
     * -cl-opt-disable emits no freeze. moecl: grounded_router_team's
     * `idx / HIDDEN_DIM, idx % HIDDEN_DIM` loops. */
    {"freeze_unsupported",
     "__kernel void repro(__global const uint *in, __global uint *out)\n"
     "{\n"
     "    for (uint idx = get_local_id(0); idx < 16; idx += get_local_size(0)) {\n"
     "        const uint e = idx / 3, i = idx % 3;\n"
     "        out[idx] = e * 10 + i + in[16];\n"
     "    }\n"
     "}\n",
     false, 4, 16, {1, 2, 3, 11, 12, 13, 21, 22, 23, 31, 32, 33, 41, 42, 43, 51}, false},
    /* Bytes written by clEnqueueFillBuffer are taken for unwritten by
     * --uninitialized (also after the host wrote the buffer), so an
     * atomic_inc on a zero-filled histogram is reported as an
     * uninitialised value written to global memory; the values are right.
     * moecl: moecl_topk_gating_with_counts zeroes expert_counts that way. */
    {"fill_buffer_uninitialized",
     "__kernel void repro(__global const uint *in, __global uint *out)\n"
     "{\n"
     "    atomic_inc((__global volatile uint *)out + in[get_local_id(0)]);\n"
     "}\n",
     true, 4, 4, {2, 1, 1, 0}, false},
    /* The same with the kernel's own plain stores: after a fill, a word
     * the kernel writes and reads back (the same work-item, past a
     * barrier) is still taken for unwritten, so the read's value is
     * reported where it is stored on (here to global memory; a fill of
     * the buffer's first word alone does it too); the values are right.
     * moecl: moe_align's fused kernel and moecl_route_dispatch's one
     * kernel, whose scratch starts with the ticket's fill, store a lone
     * work-group's counts there and read them back. */
    {"fill_buffer_store_uninitialized",
     "__kernel void repro(__global const uint *in, __global uint *out)\n"
     "{\n"
     "    const uint i = get_local_id(0);\n"
     "    out[i] = in[i] + 1;\n"
     "    barrier(CLK_GLOBAL_MEM_FENCE);\n"
     "    out[4 + i] = out[i];\n"
     "}\n",
     true, 4, 8, {1, 2, 3, 1, 1, 2, 3, 1}, true},
    /* With --uninitialized, an atomic_xchg of a written value into a word
     * nothing wrote before (a buffer created without host data) is
     * reported as an uninitialised value written to global memory; the
     * old value it returns is thrown away, and the values are right.
     * moecl: moe_align's fused kernel passes counts and ranks between
     * work-groups that way through its scratch buffer. */
    {"atomic_unwritten_uninitialized",
     "__kernel void repro(__global const uint *in, __global uint *out)\n"
     "{\n"
     "    atomic_xchg((__global volatile uint *)out + get_local_id(0), in[get_local_id(0)]);\n"
     "}\n",
     false, 4, 4, {0, 1, 2, 0}, true},
};

#define NUM_BUGS (sizeof(bugs) / sizeof(bugs[0]))

static int run(const bug *b)
{
    /* The first device of the first platform that has one. */
    cl_platform_id platforms[16];
    cl_uint num_platforms = 0;
    cl_device_id device = NULL;
    cl_int err;
    if (clGetPlatformIDs(16, platforms, &num_platforms) != CL_SUCCESS)
        num_platforms = 0;
    for (cl_uint p = 0; p < num_platforms && p < 16 && !device; p++)
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 1, &device, NULL) != CL_SUCCESS)
            device = NULL;
    if (!device) {
        fprintf(stderr, "no OpenCL device\n");
        return 2;
    }
    cl_context ctx = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    cl_command_queue q = clCreateCommandQueue(ctx, device, 0, &err);
    const char *source = b->source;
    cl_program prog = clCreateProgramWithSource(ctx, 1, &source, NULL, &err);
    if (clBuildProgram(prog, 1, &device, "-cl-std=CL1.2", NULL, NULL) != CL_SUCCESS) {
        char log[8192] = "";
        clGetProgramBuildInfo(prog, device, CL_PROGRAM_BUILD_LOG, sizeof(log), log, NULL);
        fprintf(stderr, "%s: build failed:\n%s\n", b->name, log);
        return 2;
    }
    cl_kernel k = clCreateKernel(prog, "repro", &err);
    cl_uint in[32], out[16];
    for (int i = 0; i < 16; i++)
        in[i] = (cl_uint)(i % 3);
    for (int i = 16; i < 32; i++)
        in[i] = 1;
    memset(out, 0, sizeof(out));
    cl_mem in_buf = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof(in), in, &err);
    cl_mem out_buf = b->unwritten ? clCreateBuffer(ctx, CL_MEM_READ_WRITE, sizeof(out), NULL, &err)
                                  : clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof(out), out, &err);
    if (b->fill) {
        const cl_uint zero = 0;
        clEnqueueFillBuffer(q, out_buf, &zero, sizeof(zero), 0, sizeof(out), 0, NULL, NULL);
    }
    clSetKernelArg(k, 0, sizeof(in_buf), &in_buf);
    clSetKernelArg(k, 1, sizeof(out_buf), &out_buf);
    const size_t items = b->items;
    err = clEnqueueNDRangeKernel(q, k, 1, NULL, &items, &items, 0, NULL, NULL);
    if (err == CL_SUCCESS)
        err = clEnqueueReadBuffer(q, out_buf, CL_TRUE, 0, sizeof(out), out, 0, NULL, NULL);
    if (err != CL_SUCCESS) {
        fprintf(stderr, "%s: enqueue failed: %d\n", b->name, err);
        return 2;
    }
    int wrong = 0;
    for (unsigned i = 0; i < b->out_count; i++)
        wrong += out[i] != b->expect[i];
    printf("%s: values %s:", b->name, wrong ? "WRONG" : "right");
    for (unsigned i = 0; i < b->out_count; i++)
        printf(" %u", out[i]);
    if (wrong) {
        printf(" (the spec gives");
        for (unsigned i = 0; i < b->out_count; i++)
            printf(" %u", b->expect[i]);
        printf(")");
    }
    printf("\n");
    clReleaseMemObject(in_buf);
    clReleaseMemObject(out_buf);
    clReleaseKernel(k);
    clReleaseProgram(prog);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    return wrong ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--list") == 0) {
        for (size_t i = 0; i < NUM_BUGS; i++)
            printf("%s\n", bugs[i].name);
        return 0;
    }
    for (size_t i = 0; argc == 2 && i < NUM_BUGS; i++)
        if (strcmp(argv[1], bugs[i].name) == 0)
            return run(&bugs[i]);
    fprintf(stderr, "usage: %s --list | NAME\n", argv[0]);
    return 2;
}
