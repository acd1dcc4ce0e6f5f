/* What a context reports about itself: moecl_context_query_info's record
 * and moecl_context_describe's text. Above the ops: it asks them what
 * representative requests launch, as a caller would; the context layer
 * below calls no op. */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

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
    else
        moecl_device_ptx_reason(i, r->inline_ptx_reason, sizeof(r->inline_ptx_reason));
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
    static const char *const kernels[] = {"rows", "team", "tiled", "mma", "splitk"};
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
        COPY(l->kernel, (unsigned)config.kernel <= MOECL_KERNEL_SPLITK ? kernels[config.kernel] : "?");
        l->team = config.team;
        l->rows = config.rows;
        l->tile = config.tile;
        COPY(l->source, moecl_launch_source_name(source));
        moecl_launch_key_text(&key, l->key_text, sizeof(l->key_text));
        moecl_launch_config_text(&config, l->config_text, sizeof(l->config_text));
    }
}

/* By moecl_vendor. */
static const char *const vendors[] = {"other", "NVIDIA", "AMD", "Intel", "pocl", "rusticl"};

static void describe(const moecl_context *ctx, moecl_context_info *r)
{
    const moecl_device_info *i = &ctx->info;
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
    r->kernel_binaries = moecl_program_binaries(ctx);
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
    /* The first version of the record ends at launches[]: a caller built
     * against it gets those fields, and its struct_size back. */
    const size_t first = offsetof(moecl_context_info, kernel_binaries);
    if (!ctx || !info || info->struct_size < first)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          !ctx    ? "ctx is NULL"
                          : !info ? "info is NULL"
                                  : "info->struct_size is below the first version of moecl_context_info "
                                    "(set it to sizeof(moecl_context_info) before the call)");
    moecl_context_info *r = malloc(sizeof(*r));
    if (!r)
        return moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory describing the context");
    describe(ctx, r);
    /* A larger caller record keeps its newer fields' bytes as they were, a
     * smaller one gets the fields it has; struct_size says what was filled. */
    const size_t size = info->struct_size < sizeof(*r) ? info->struct_size : sizeof(*r);
    memcpy(info, r, size);
    info->struct_size = size;
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
           "kernel binaries: %s\n"
           "inline PTX: %s (%s)\n",
           r->platform, r->device, r->device_version, r->driver, r->type, r->vendor, (unsigned)r->compute_units,
           (unsigned long long)r->local_memory_bytes, r->max_work_group_size, r->launch_class,
           r->launch_class_reason, *r->kernel_dir ? r->kernel_dir : "embedded",
           *r->kernel_cache ? r->kernel_cache : "off",
           r->kernel_binaries  ? "stored in the kernel cache"
           : *r->kernel_cache ? "left to the OpenCL implementation's own cache"
                              : "not stored",
           r->inline_ptx ? "on" : "off", r->inline_ptx_reason);
    if (ctx->info.env.table_vendor)
        append(buf, size, &len, "device table: %s's values over the device's (forced by the variant override)\n",
               vendors[ctx->info.env.table_vendor]);
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
