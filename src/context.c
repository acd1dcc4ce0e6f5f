/* Context lifetime: creating or adopting the OpenCL objects, accessors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Options every kernel build gets. No fast-math: the NaN and tie rules of
 * the spec need IEEE comparisons and exact NaN propagation. */
char *moecl_build_options(const moecl_device_info *info)
{
    const char *user = getenv("MOECL_BUILD_OPTIONS");
    char buf[1024];
    const moecl_device_params p = moecl_device_table_params(info);
    snprintf(buf, sizeof(buf), "-cl-std=CL1.2 -DMOECL_VENDOR_NVIDIA=%u -DNATIVE_MATH=%u -DMOECL_PTX=%d%s%s",
             (unsigned)p.value[MOECL_DP_UNROLL], (unsigned)p.value[MOECL_DP_NATIVE_MATH], info->ptx ? 1 : 0,
             user && *user ? " " : "", user ? user : "");
    return strdup(buf);
}

static moecl_status finish_context(moecl_context *c, moecl_context **out)
{
    cl_command_queue_properties props = 0;
    c->in_order = clGetCommandQueueInfo(c->queue, CL_QUEUE_PROPERTIES, sizeof(props), &props, NULL) == CL_SUCCESS &&
                  !(props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE);
    c->scratch_lock_ready = pthread_mutex_init(&c->scratch_lock, NULL) == 0;
    moecl_status st = moecl_device_query(c->device, &c->info);
    if (st != MOECL_SUCCESS) {
        moecl_context_destroy(c);
        return moecl_fail(NULL, st, "querying the device failed (%s)", moecl_status_string(st));
    }
    c->params = moecl_device_table_params(&c->info);
    c->build_options = moecl_build_options(&c->info);
    moecl_device_info portable = c->info;
    portable.ptx = false;
    c->portable_options = moecl_build_options(&portable);
    /* One small file read, once: warm creation stays fast. */
    moecl_tune_load(&c->info, &c->tuned);
    const char *dir = getenv("MOECL_KERNEL_DIR");
    c->kernel_dir = dir && *dir ? strdup(dir) : NULL;
    st = moecl_registry_create(&c->registry);
    if (st == MOECL_SUCCESS)
        st = moecl_plans_create(&c->plans);
    if (st == MOECL_SUCCESS && (!c->build_options || !c->portable_options || (dir && *dir && !c->kernel_dir)))
        st = MOECL_ERROR_OUT_OF_MEMORY;
    if (st != MOECL_SUCCESS) {
        moecl_context_destroy(c);
        return moecl_fail(NULL, st, "out of host memory creating the context");
    }
    *out = c;
    return MOECL_SUCCESS;
}

moecl_status moecl_context_create(const char *device, moecl_context **ctx)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx (the output pointer) is NULL");
    *ctx = NULL;
    cl_platform_id platform;
    cl_device_id dev;
    moecl_status st = moecl_device_select(device, &platform, &dev);
    if (st != MOECL_SUCCESS)
        return st;
    moecl_context *c = calloc(1, sizeof(*c));
    if (!c)
        return moecl_fail(NULL, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory creating the context");
    c->platform = platform;
    c->device = dev;
    clRetainDevice(dev); /* a no-op for root devices; destroy releases it either way */
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)platform, 0};
    cl_int err;
    c->context = clCreateContext(props, 1, &dev, NULL, NULL, &err);
    if (!c->context) {
        free(c);
        return moecl_fail(NULL, err, "clCreateContext failed (%s)", moecl_status_string(err));
    }
    c->queue = clCreateCommandQueue(c->context, dev, 0, &err);
    if (!c->queue) {
        moecl_context_destroy(c);
        return moecl_fail(NULL, err, "clCreateCommandQueue failed (%s)", moecl_status_string(err));
    }
    return finish_context(c, ctx);
}

moecl_status moecl_context_create_from_cl(cl_context context, cl_device_id device, cl_command_queue queue,
                                          moecl_context **ctx)
{
    if (!ctx)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "ctx (the output pointer) is NULL");
    *ctx = NULL;
    if (!context || !device)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "%s is NULL", !context ? "context" : "device");

    /* The device must be one of the context's. */
    cl_uint num = 0;
    cl_int err = clGetContextInfo(context, CL_CONTEXT_NUM_DEVICES, sizeof(num), &num, NULL);
    if (err != CL_SUCCESS)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "context is not a valid cl_context (%s)",
                          moecl_status_string(err));
    cl_device_id *devices = num ? malloc(num * sizeof(cl_device_id)) : NULL;
    if (num && !devices)
        return moecl_fail(NULL, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory creating the context");
    err = num ? clGetContextInfo(context, CL_CONTEXT_DEVICES, num * sizeof(cl_device_id), devices, NULL) : CL_SUCCESS;
    bool member = false;
    for (cl_uint i = 0; err == CL_SUCCESS && i < num; i++)
        member |= devices[i] == device;
    free(devices);
    if (!member)
        return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "device is not a device of context");
    if (queue) {
        cl_context qctx = NULL;
        cl_device_id qdev = NULL;
        err = clGetCommandQueueInfo(queue, CL_QUEUE_CONTEXT, sizeof(qctx), &qctx, NULL);
        if (err == CL_SUCCESS)
            err = clGetCommandQueueInfo(queue, CL_QUEUE_DEVICE, sizeof(qdev), &qdev, NULL);
        if (err != CL_SUCCESS)
            return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "queue is not a valid cl_command_queue (%s)",
                              moecl_status_string(err));
        if (qctx != context || qdev != device)
            return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "queue belongs to another %s",
                              qctx != context ? "context" : "device");
    }

    moecl_context *c = calloc(1, sizeof(*c));
    if (!c)
        return moecl_fail(NULL, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory creating the context");
    clGetDeviceInfo(device, CL_DEVICE_PLATFORM, sizeof(c->platform), &c->platform, NULL);
    c->context = context;
    clRetainContext(context);
    c->device = device;
    clRetainDevice(device);
    if (queue) {
        c->queue = queue;
        clRetainCommandQueue(queue);
    } else {
        c->queue = clCreateCommandQueue(context, device, 0, &err);
        if (!c->queue) {
            moecl_context_destroy(c);
            return moecl_fail(NULL, err, "clCreateCommandQueue failed (%s)", moecl_status_string(err));
        }
    }
    return finish_context(c, ctx);
}

void moecl_context_destroy(moecl_context *ctx)
{
    if (!ctx)
        return;
    /* Plans first: they point into the registry's variants. */
    moecl_plans_destroy(ctx->plans);
    moecl_registry_destroy(ctx->registry);
    if (ctx->scratch)
        clReleaseMemObject(ctx->scratch);
    if (ctx->scratch_lock_ready)
        pthread_mutex_destroy(&ctx->scratch_lock);
    if (ctx->queue)
        clReleaseCommandQueue(ctx->queue);
    if (ctx->device)
        clReleaseDevice(ctx->device); /* a no-op for root devices; pairs with the retain when adopted */
    if (ctx->context)
        clReleaseContext(ctx->context);
    free(ctx->build_options);
    free(ctx->portable_options);
    free(ctx->kernel_dir);
    moecl_tune_free(&ctx->tuned);
    moecl_error_forget(ctx);
    free(ctx);
}

void moecl_context_forget_buffers(moecl_context *ctx)
{
    if (ctx)
        moecl_registry_forget_buffers(ctx->registry);
}

cl_context moecl_context_cl_context(const moecl_context *ctx) { return ctx ? ctx->context : NULL; }
cl_device_id moecl_context_device(const moecl_context *ctx) { return ctx ? ctx->device : NULL; }
cl_command_queue moecl_context_queue(const moecl_context *ctx) { return ctx ? ctx->queue : NULL; }
