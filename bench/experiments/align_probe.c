/* H200 probe (not built by meson): why moe_align spends tens of µs inside
 * the call. Times the OpenCL calls the host side makes, and asks the
 * driver for moe_align_one_group's work-group limit.
 *   gcc -O2 bench/experiments/align_probe.c -Iinclude -Lbuild/src -lmoecl -lOpenCL -o probe */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <moecl/moecl.h>

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv)
{
    const char *src_path = argc > 1 ? argv[1] : "cl/moe_align.cl";
    moecl_context *ctx = NULL;
    if (moecl_context_create(NULL, &ctx) != MOECL_SUCCESS) {
        printf("context: %s\n", moecl_context_error(NULL));
        return 1;
    }
    cl_context cl = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    cl_device_id dev;
    clGetCommandQueueInfo(q, CL_QUEUE_DEVICE, sizeof(dev), &dev, NULL);
    /* 1. The one-group kernel's limits. */
    FILE *f = fopen(src_path, "rb");
    char *src = calloc(1, 1 << 20);
    if (fread(src, 1, (1 << 20) - 1, f) == 0)
        return 1;
    fclose(f);
    cl_int err;
    cl_program prog = clCreateProgramWithSource(cl, 1, (const char **)&src, NULL, &err);
    err = clBuildProgram(prog, 1, &dev, "-cl-std=CL1.2 -DWG=128 -DSCAN_WG=256 -DONE_WG=256", NULL, NULL);
    printf("build: %d\n", err);
    if (err) {
        char log[16384] = "";
        clGetProgramBuildInfo(prog, dev, CL_PROGRAM_BUILD_LOG, sizeof(log), log, NULL);
        printf("%s\n", log);
    }
    const char *names[] = {"moe_align_one_group", "moe_align_count", "moe_align_scatter"};
    for (int i = 0; i < 3; i++) {
        cl_kernel k = clCreateKernel(prog, names[i], &err);
        size_t wg = 0;
        cl_ulong lm = 0, pm = 0;
        clGetKernelWorkGroupInfo(k, dev, CL_KERNEL_WORK_GROUP_SIZE, sizeof(wg), &wg, NULL);
        clGetKernelWorkGroupInfo(k, dev, CL_KERNEL_LOCAL_MEM_SIZE, sizeof(lm), &lm, NULL);
        clGetKernelWorkGroupInfo(k, dev, CL_KERNEL_PRIVATE_MEM_SIZE, sizeof(pm), &pm, NULL);
        printf("%s: err %d work-group limit %zu, static local %llu, private %llu\n", names[i], err, wg,
               (unsigned long long)lm, (unsigned long long)pm);
        clReleaseKernel(k);
    }
    /* 2. Costs of host calls. */
    double t0 = now_us();
    for (int i = 0; i < 1000; i++) {
        cl_mem m = clCreateBuffer(cl, CL_MEM_READ_WRITE, 40960, NULL, &err);
        clReleaseMemObject(m);
    }
    printf("clCreateBuffer+release 40 KiB: %.2f us\n", (now_us() - t0) / 1000);
    cl_mem m = clCreateBuffer(cl, CL_MEM_READ_WRITE, 1 << 20, NULL, &err);
    t0 = now_us();
    size_t sz;
    for (int i = 0; i < 1000; i++)
        clGetMemObjectInfo(m, CL_MEM_SIZE, sizeof(sz), &sz, NULL);
    printf("clGetMemObjectInfo: %.3f us\n", (now_us() - t0) / 1000);
    /* 3. moe_align host calls, per path size. */
    const unsigned tokens[] = {1, 256, 4083, 13526};
    for (int s = 0; s < 4; s++) {
        moecl_moe_align_desc d = moecl_moe_align_desc_init(tokens[s], 8, tokens[s] > 8192 ? 256 : 128, 64);
        size_t slots = (size_t)d.num_tokens * 8, mp = moecl_moe_align_max_padded(&d);
        int32_t *ids = malloc(slots * 4);
        for (size_t i = 0; i < slots; i++)
            ids[i] = rand() % d.num_experts;
        cl_mem in = clCreateBuffer(cl, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, slots * 4, ids, &err);
        cl_mem o[6];
        size_t osz[6] = {d.num_experts * 4, mp * 4, mp / 64 * 4 + 4, 4, slots * 4, 4};
        for (int i = 0; i < 6; i++)
            o[i] = clCreateBuffer(cl, CL_MEM_READ_WRITE, osz[i], NULL, &err);
        moecl_status st = moecl_moe_align_prepare(ctx, &d);
        double host = 0;
        cl_event ev;
        for (int i = 0; i < 210; i++) {
            t0 = now_us();
            st = moecl_moe_align(ctx, &d, (moecl_buffer){in, 0}, (moecl_buffer){o[0], 0}, (moecl_buffer){o[1], 0},
                                 (moecl_buffer){o[2], 0}, (moecl_buffer){o[3], 0}, (moecl_buffer){o[4], 0},
                                 (moecl_buffer){o[5], 0}, 0, NULL, &ev);
            if (i >= 10)
                host += now_us() - t0;
            clWaitForEvents(1, &ev);
            clReleaseEvent(ev);
        }
        t0 = now_us();
        for (int i = 0; i < 200; i++)
            moecl_moe_align(ctx, &d, (moecl_buffer){in, 0}, (moecl_buffer){o[0], 0}, (moecl_buffer){o[1], 0},
                            (moecl_buffer){o[2], 0}, (moecl_buffer){o[3], 0}, (moecl_buffer){o[4], 0},
                            (moecl_buffer){o[5], 0}, 0, NULL, NULL);
        clFinish(q);
        printf("T=%u: status %d, in the call %.2f us (waiting each), back to back %.2f us/call\n", tokens[s], st,
               host / 200, (now_us() - t0) / 200);
        for (int i = 0; i < 6; i++)
            clReleaseMemObject(o[i]);
        clReleaseMemObject(in);
        free(ids);
    }
    moecl_context_destroy(ctx);
    return 0;
}
