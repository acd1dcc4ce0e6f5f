/* moecl-info: the OpenCL platforms and devices there are, which one moecl
 * picks and why, the device facts its kernels are tuned on, and the launch
 * configurations it chose for representative shapes and where from. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

static void usage(FILE *f)
{
    fprintf(f, "usage: moecl-info [--device SELECTOR] [--help]\n"
               "Lists the OpenCL devices, the one moecl chooses (SELECTOR, else $MOECL_DEVICE,\n"
               "else the first GPU/accelerator, else the first CPU) and what moecl knows of it.\n"
               "Exit status: 0 ok, 1 no usable device, 2 bad usage.\n");
}

static const char *type_name(cl_device_type t)
{
    if (t & CL_DEVICE_TYPE_GPU)
        return "GPU";
    if (t & CL_DEVICE_TYPE_ACCELERATOR)
        return "accelerator";
    if (t & CL_DEVICE_TYPE_CPU)
        return "CPU";
    return "other";
}

int main(int argc, char **argv)
{
    const char *selector = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            selector = argv[++i];
        } else {
            usage(stderr);
            return 2;
        }
    }
    printf("moecl %s\n\nOpenCL devices (select with \"P:D\", \"gpu\", \"cpu\" or a name substring):\n",
           moecl_version());
    cl_platform_id platforms[16];
    cl_uint np = 0;
    if (clGetPlatformIDs(16, platforms, &np) != CL_SUCCESS)
        np = 0;
    for (cl_uint p = 0; p < np && p < 16; p++) {
        char pname[256] = "";
        clGetPlatformInfo(platforms[p], CL_PLATFORM_NAME, sizeof(pname), pname, NULL);
        cl_device_id devices[64];
        cl_uint nd = 0;
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 64, devices, &nd) != CL_SUCCESS)
            nd = 0;
        for (cl_uint d = 0; d < nd && d < 64; d++) {
            char dname[256] = "";
            cl_device_type t = 0;
            clGetDeviceInfo(devices[d], CL_DEVICE_NAME, sizeof(dname), dname, NULL);
            clGetDeviceInfo(devices[d], CL_DEVICE_TYPE, sizeof(t), &t, NULL);
            printf("  %u:%u  %-11s  %s / %s\n", p, d, type_name(t), pname, dname);
        }
    }
    if (np == 0)
        printf("  (none)\n");

    const char *env = getenv("MOECL_DEVICE");
    const char *why = selector ? "the --device selector"
                      : env && *env ? "$MOECL_DEVICE"
                                    : "the default rule: first GPU/accelerator, else first CPU";
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(selector, &ctx);
    if (st != MOECL_SUCCESS) {
        printf("\nmoecl picks no device: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        return 1;
    }
    /* The whole description, however long the paths in it. */
    size_t need = moecl_context_describe(ctx, NULL, 0);
    char *text = malloc(need + 1);
    if (!text) {
        moecl_context_destroy(ctx);
        return 1;
    }
    moecl_context_describe(ctx, text, need + 1);
    printf("\nOps: top-k gating (moecl_topk_gating: softmax/sigmoid, bias, groups, renormalize, scale;\n"
           "     f32/f16/bf16 logits; 1..4096 experts, top_k 1..64) and the grounded router\n"
           "     (moecl_grounded_router: logits + alpha * hidden @ ground^T, top-k, softmax over the chosen;\n"
           "     hidden 1..65536).\n");
    printf("\nmoecl picks (by %s):\n", why);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n"))
        printf("  %s\n", line);
    printf("\n\"launch\" lines: the configuration representative keys launch with, and where it came from:\n"
           "default (computed from the device facts), table (moecl's built-in per-device table), tuned (the\n"
           "tune file moecl-tune wrote), env (MOECL_LAUNCH_CLASS, MOECL_TEAM or MOECL_GROUNDED_TILE).\n");
    free(text);
    moecl_context_destroy(ctx);
    return 0;
}
