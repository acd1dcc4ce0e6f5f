/* Context lifetime: creating or adopting the OpenCL objects, accessors. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* Options every kernel build gets. No fast-math: the NaN and tie rules of
 * the spec need IEEE comparisons and exact NaN propagation. */
char *moecl_build_options(const moecl_device_info *info)
{
    const char *user = getenv("MOECL_BUILD_OPTIONS");
    char buf[1024];
    const int nvidia = info->vendor == MOECL_VENDOR_NVIDIA;
    snprintf(buf, sizeof(buf), "-cl-std=CL1.2 -DMOECL_VENDOR_NVIDIA=%d -DNATIVE_MATH=%d -DMOECL_PTX=%d%s%s", nvidia,
             nvidia, info->ptx ? 1 : 0, user && *user ? " " : "", user ? user : "");
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

/* snprintf at buf + *len, keeping *len the length of the whole text as
 * snprintf counts it (the part past size is counted, not written). */
static void append(char *buf, size_t size, size_t *len, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t size, size_t *len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char none[1];
    int n = *len < size ? vsnprintf(buf + *len, size - *len, fmt, ap) : vsnprintf(none, 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        *len += (size_t)n;
}

#define COPY(dst, src) snprintf((dst), sizeof(dst), "%s", (src))

/* The NVIDIA warp paths: whether they are built, and why not. */
static void describe_ptx(const moecl_context *ctx, moecl_context_info *r)
{
    const moecl_device_info *i = &ctx->info;
    r->inline_ptx = i->ptx && !moecl_registry_ptx_failed(ctx->registry);
    if (i->ptx && !r->inline_ptx)
        snprintf(r->inline_ptx_reason, sizeof(r->inline_ptx_reason),
                 "compute capability %u.%u, but a build with it failed; portable kernels", i->nv_compute_major,
                 i->nv_compute_minor);
    else if (i->ptx)
        snprintf(r->inline_ptx_reason, sizeof(r->inline_ptx_reason), "compute capability %u.%u", i->nv_compute_major,
                 i->nv_compute_minor);
    else if (i->vendor != MOECL_VENDOR_NVIDIA)
        COPY(r->inline_ptx_reason, "not an NVIDIA device");
    else if (i->nv_compute_major == 0)
        COPY(r->inline_ptx_reason, "no compute capability: cl_nv_device_attribute_query absent");
    else
        snprintf(r->inline_ptx_reason, sizeof(r->inline_ptx_reason),
                 "compute capability %u.%u; the warp paths need 7.0", i->nv_compute_major, i->nv_compute_minor);
}

/* What the seed shapes launch with, and from where. */
static void describe_launches(const moecl_context *ctx, moecl_context_info *r)
{
    moecl_topk_gating_desc t[3] = {moecl_topk_gating_desc_init(1, 128, 8), moecl_topk_gating_desc_init(1, 256, 8),
                                   moecl_topk_gating_desc_init(1, 256, 8)};
    t[2].num_expert_groups = 8; /* DeepSeek-V3 */
    t[2].topk_group = 4;
    moecl_grounded_router_desc g[2] = {moecl_grounded_router_desc_init(1, 128, 16, 0.5f),
                                       moecl_grounded_router_desc_init(1, 4096, 128, 0.5f)};
    g[1].top_k = 8;
    static const char *const kernels[] = {"rows", "team", "tiled", "mma"};
    for (int n = 0; n < 5; n++) {
        moecl_launch_key key;
        moecl_launch_config config;
        moecl_launch_source source = n < 3 ? moecl_topk_gating_launch(ctx, &t[n], &key, &config)
                                           : moecl_grounded_router_launch(ctx, &g[n - 3], &key, &config);
        moecl_launch_info *l = &r->launches[r->num_launches++];
        COPY(l->op, key.op == MOECL_OP_TOPK_GATING ? "topk" : "grounded");
        l->num_experts = key.num_experts;
        l->top_k = key.top_k;
        l->groups = key.groups;
        l->hidden_bucket = key.hidden_bucket;
        COPY(l->kernel, (unsigned)config.kernel <= MOECL_KERNEL_MMA ? kernels[config.kernel] : "?");
        l->team = config.team;
        l->rows = config.rows;
        l->tile = config.tile;
        COPY(l->source, moecl_launch_source_name(source));
        moecl_launch_key_text(&key, l->key_text, sizeof(l->key_text));
        moecl_launch_config_text(&config, l->config_text, sizeof(l->config_text));
    }
}

static void describe(const moecl_context *ctx, moecl_context_info *r)
{
    const moecl_device_info *i = &ctx->info;
    static const char *const vendors[] = {"other", "NVIDIA", "AMD", "Intel", "pocl"};
    memset(r, 0, sizeof(*r));
    r->struct_size = sizeof(*r);
    COPY(r->platform, i->platform_name);
    COPY(r->device, i->device_name);
    COPY(r->device_version, i->device_version);
    COPY(r->driver, i->driver_version);
    COPY(r->type, (i->type & CL_DEVICE_TYPE_CPU)           ? "CPU"
                  : (i->type & CL_DEVICE_TYPE_GPU)         ? "GPU"
                  : (i->type & CL_DEVICE_TYPE_ACCELERATOR) ? "accelerator"
                                                           : "other");
    COPY(r->vendor, vendors[i->vendor]);
    r->compute_units = i->compute_units;
    r->local_memory_bytes = i->local_mem_size;
    r->max_work_group_size = i->max_work_group_size;
    COPY(r->launch_class, moecl_launch_class_name(i->launch_class));
    COPY(r->launch_class_reason, i->launch_reason);
    COPY(r->kernel_dir, ctx->kernel_dir ? ctx->kernel_dir : "");
    if (!moecl_cache_dir(r->kernel_cache, sizeof(r->kernel_cache)))
        r->kernel_cache[0] = '\0';
    describe_ptx(ctx, r);
    if (moecl_tune_path(i, r->tune_file, sizeof(r->tune_file)))
        r->tune_file_present = access(r->tune_file, F_OK) == 0;
    else
        r->tune_file[0] = '\0';
    r->tune_keys_read = (uint32_t)ctx->tuned.count;
    describe_launches(ctx, r);
}

moecl_status moecl_context_query_info(const moecl_context *ctx, moecl_context_info *info)
{
    /* The first version of the record is this one: a caller's record is
     * at least that large. */
    if (!ctx || !info || info->struct_size < sizeof(moecl_context_info))
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          !ctx    ? "ctx is NULL"
                          : !info ? "info is NULL"
                                  : "info->struct_size is below sizeof(moecl_context_info) (set it before the call)");
    moecl_context_info *r = malloc(sizeof(*r));
    if (!r)
        return moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory describing the context");
    describe(ctx, r);
    memcpy(info, r, sizeof(*r)); /* a larger caller record keeps its newer fields' bytes as they were */
    info->struct_size = sizeof(*r);
    free(r);
    return MOECL_SUCCESS;
}

size_t moecl_context_describe(const moecl_context *ctx, char *buf, size_t size)
{
    if (size)
        buf[0] = '\0';
    moecl_context_info *r = ctx ? malloc(sizeof(*r)) : NULL;
    if (!r)
        return 0;
    describe(ctx, r);
    size_t len = 0;
    append(buf, size, &len,
           "platform: %s\n"
           "device: %s\n"
           "device version: %s\n"
           "driver: %s\n"
           "type: %s\n"
           "vendor: %s\n"
           "compute units: %u\n"
           "local memory: %llu bytes\n"
           "max work-group size: %zu\n"
           "launch class: %s (%s)\n"
           "kernel sources: %s\n"
           "kernel cache: %s\n"
           "inline PTX: %s (%s)\n",
           r->platform, r->device, r->device_version, r->driver, r->type, r->vendor, (unsigned)r->compute_units,
           (unsigned long long)r->local_memory_bytes, r->max_work_group_size, r->launch_class,
           r->launch_class_reason, *r->kernel_dir ? r->kernel_dir : "embedded",
           *r->kernel_cache ? r->kernel_cache : "off", r->inline_ptx ? "on" : "off", r->inline_ptx_reason);
    if (*r->tune_file)
        append(buf, size, &len, "tune file: %s (%skeys read at creation: %u)\n", r->tune_file,
               r->tune_file_present ? "" : "absent, moecl-tune writes it; ", (unsigned)r->tune_keys_read);
    else
        append(buf, size, &len, "tune file: off (no cache directory)\n");
    for (uint32_t n = 0; n < r->num_launches; n++)
        append(buf, size, &len, "launch %s: %s (%s)\n", r->launches[n].key_text, r->launches[n].config_text,
               r->launches[n].source);
    free(r);
    return len;
}
