/* Kernel variants: a registry from (program, defines, kernel) to a built
 * cl_program and a pool of cl_kernel objects. Lookups (made when a launch
 * plan is built, src/plan.c) take one mutex around a short search; builds
 * take a second mutex so that a long compile never blocks calls of
 * variants already built. A call borrows a pooled kernel with an atomic
 * flag. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Kernels per variant: one per thread that calls it at the same time. */
#define POOL_MAX 64

struct moecl_variant {
    moecl_program_kind kind;
    char *defines;
    char *kernel_name;
    cl_program program;
    pthread_mutex_t pool_lock; /* making a pooled kernel */
    moecl_pooled_kernel *pool[POOL_MAX];
    atomic_size_t created; /* pool[0..created-1] are published */
    size_t work_group_limit; /* CL_KERNEL_WORK_GROUP_SIZE, queried once at creation; 0 if unknown */
};

/* items, count, capacity and ptx_failed change only with both locks held:
 * a build holds build_lock throughout, and takes lock for each change,
 * because find() walks items under lock alone (a build that moved the
 * array under build_lock only would free it under a concurrent walk). */
struct moecl_registry {
    pthread_mutex_t lock;       /* for readers without build_lock: find(), moecl_registry_ptx_failed() */
    pthread_mutex_t build_lock; /* one build at a time per context */
    moecl_variant **items;
    size_t count, capacity;
    bool ptx_failed; /* a build with inline PTX failed: build portable from then on */
};

moecl_status moecl_registry_create(moecl_registry **reg)
{
    moecl_registry *r = calloc(1, sizeof(*r));
    if (!r)
        return MOECL_ERROR_OUT_OF_MEMORY;
    pthread_mutex_init(&r->lock, NULL);
    pthread_mutex_init(&r->build_lock, NULL);
    *reg = r;
    return MOECL_SUCCESS;
}

void moecl_arg_state_release(moecl_arg_state *s)
{
    if (s->held)
        clReleaseMemObject(s->held);
    *s = (moecl_arg_state){0};
}

/* Drop what a pooled kernel remembers of its arguments and release the
 * buffer references it holds. With unset, a held buffer's argument is set
 * to NULL first: a driver may keep the buffer an argument names alive
 * until the argument changes (rusticl does), which would defeat
 * moecl_context_forget_buffers. */
static void pooled_forget(moecl_pooled_kernel *k, bool unset)
{
    for (size_t i = 0; i < MOECL_MAX_KERNEL_ARGS; i++) {
        if (unset && k->args[i].held)
            clSetKernelArg(k->kernel, (cl_uint)i, sizeof(cl_mem), NULL);
        moecl_arg_state_release(&k->args[i]);
    }
}

static void variant_destroy(moecl_variant *v)
{
    if (!v)
        return;
    /* Every kernel is back in the pool once no call is in flight. */
    const size_t n = atomic_load(&v->created);
    for (size_t i = 0; i < n; i++) {
        pooled_forget(v->pool[i], false);
        clReleaseKernel(v->pool[i]->kernel);
        free(v->pool[i]);
    }
    if (v->program)
        clReleaseProgram(v->program);
    pthread_mutex_destroy(&v->pool_lock);
    free(v->defines);
    free(v->kernel_name);
    free(v);
}

void moecl_registry_destroy(moecl_registry *reg)
{
    if (!reg)
        return;
    for (size_t i = 0; i < reg->count; i++)
        variant_destroy(reg->items[i]);
    free(reg->items);
    pthread_mutex_destroy(&reg->lock);
    pthread_mutex_destroy(&reg->build_lock);
    free(reg);
}

static moecl_variant *find(moecl_registry *reg, moecl_program_kind kind, const char *defines, const char *kernel_name)
{
    moecl_variant *found = NULL;
    pthread_mutex_lock(&reg->lock);
    for (size_t i = 0; i < reg->count && !found; i++) {
        moecl_variant *v = reg->items[i];
        if (v->kind == kind && strcmp(v->defines, defines) == 0 && strcmp(v->kernel_name, kernel_name) == 0)
            found = v;
    }
    pthread_mutex_unlock(&reg->lock);
    return found;
}

/* The identity of a compiled program, as the disk cache keys it. */
static char *cache_identity(const moecl_context *ctx, const char *options, const char *source, size_t source_size)
{
    const moecl_device_info *i = &ctx->info;
    size_t size = 1024 + strlen(options) + sizeof(i->platform_name) + sizeof(i->device_name) +
                  sizeof(i->driver_version) + sizeof(i->device_version);
    char *key = malloc(size);
    if (key)
        snprintf(key, size, "moecl %s\nplatform %s\ndevice %s\ndriver %s\nversion %s\noptions %s\nsource %016llx%016llx\n",
                 moecl_version(), i->platform_name, i->device_name, i->driver_version, i->device_version, options,
                 (unsigned long long)moecl_hash64(source, source_size, 0),
                 (unsigned long long)moecl_hash64(source, source_size, 1));
    return key;
}

static moecl_status build_failure(moecl_context *ctx, cl_program program, cl_int err, const char *defines)
{
    char log[1600] = "";
    size_t len = 0;
    if (clGetProgramBuildInfo(program, ctx->device, CL_PROGRAM_BUILD_LOG, 0, NULL, &len) == CL_SUCCESS && len > 0) {
        char *full = malloc(len + 1);
        if (full && clGetProgramBuildInfo(program, ctx->device, CL_PROGRAM_BUILD_LOG, len, full, NULL) == CL_SUCCESS) {
            full[len] = '\0';
            snprintf(log, sizeof(log), "%s", full); /* the head of the log holds the first error */
        }
        free(full);
    }
    return moecl_fail(ctx, MOECL_ERROR_BUILD, "building the kernel with \"%s\" failed (%s): %s", defines,
                      moecl_status_string(err), log);
}

bool moecl_program_binaries(const moecl_context *ctx)
{
    char dir[4096];
    const int forced = ctx->info.env.binaries;
    return moecl_cache_dir(dir, sizeof(dir)) &&
           (forced ? forced > 0 : ctx->params.value[MOECL_DP_BINARY_CACHE] != 0);
}

/* Build with base options (the context's, or its portable ones) and
 * defines, from the binary cache if it holds a valid entry, else from
 * source (and store the result). quiet: a compile error is returned as
 * MOECL_ERROR_BUILD without a message, for a caller that tries again. */
static moecl_status build_program(moecl_context *ctx, const char *base_options, moecl_program_kind kind,
                                  const char *defines, bool quiet, cl_program *out)
{
    char *source = NULL;
    size_t source_size = 0;
    moecl_status st = moecl_program_source(ctx, kind, &source, &source_size);
    if (st != MOECL_SUCCESS)
        return st;
    size_t opt_size = strlen(base_options) + strlen(defines) + 2;
    char *options = malloc(opt_size);
    char *key = NULL;
    if (options) {
        snprintf(options, opt_size, "%s %s", base_options, defines);
        key = cache_identity(ctx, options, source, source_size);
    }
    if (!options || !key) {
        free(source);
        free(options);
        return moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory building a kernel");
    }

    cl_int err;
    cl_program program = NULL;
    unsigned char *binary = NULL;
    size_t binary_size = 0;
    const bool cached = moecl_program_binaries(ctx);
    if (cached && moecl_cache_load(key, &binary, &binary_size)) {
        const unsigned char *bins[1] = {binary};
        cl_int bin_status;
        program = clCreateProgramWithBinary(ctx->context, 1, &ctx->device, &binary_size, bins, &bin_status, &err);
        if (program && (err != CL_SUCCESS || bin_status != CL_SUCCESS ||
                        clBuildProgram(program, 1, &ctx->device, options, NULL, NULL) != CL_SUCCESS)) {
            clReleaseProgram(program); /* a stale or foreign binary: rebuild below */
            program = NULL;
        }
        free(binary);
    }
    if (!program) {
        const char *text = source;
        program = clCreateProgramWithSource(ctx->context, 1, &text, &source_size, &err);
        if (!program) {
            st = moecl_fail(ctx, err, "clCreateProgramWithSource failed (%s)", moecl_status_string(err));
        } else if ((err = clBuildProgram(program, 1, &ctx->device, options, NULL, NULL)) != CL_SUCCESS) {
            st = quiet ? MOECL_ERROR_BUILD : build_failure(ctx, program, err, defines);
            clReleaseProgram(program);
            program = NULL;
        } else if (cached) {
            size_t size = 0;
            if (clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, NULL) == CL_SUCCESS && size) {
                unsigned char *bin = malloc(size);
                if (bin && clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof(bin), &bin, NULL) == CL_SUCCESS)
                    moecl_cache_store(key, bin, size);
                free(bin);
            }
        }
    }
    free(source);
    free(options);
    free(key);
    *out = program;
    return st;
}

/* The program for defines, with the context's options; where those enable
 * inline PTX and the build fails (an NVIDIA compiler that rejects an
 * instruction, or an implementation without asm), the portable build
 * instead, and only that from then on. The PTX paths are one define
 * (MOECL_PTX) away from the portable kernels, and the ops size arguments
 * and local memory for both, so the variant serves its calls either way.
 * Called with build_lock held. */
static moecl_status build_variant_program(moecl_context *ctx, moecl_program_kind kind, const char *defines,
                                          cl_program *out)
{
    moecl_registry *reg = ctx->registry;
    if (ctx->info.ptx && !reg->ptx_failed) {
        moecl_status st = build_program(ctx, ctx->build_options, kind, defines, true, out);
        if (st != MOECL_ERROR_BUILD)
            return st;
    }
    moecl_status st = build_program(ctx, ctx->portable_options, kind, defines, false, out);
    /* Stop trying PTX only when it was the PTX that failed. */
    if (st == MOECL_SUCCESS && ctx->info.ptx && !reg->ptx_failed) {
        pthread_mutex_lock(&reg->lock);
        reg->ptx_failed = true;
        pthread_mutex_unlock(&reg->lock);
    }
    return st;
}

bool moecl_registry_ptx_failed(moecl_registry *reg)
{
    pthread_mutex_lock(&reg->lock);
    bool failed = reg->ptx_failed;
    pthread_mutex_unlock(&reg->lock);
    return failed;
}

moecl_status moecl_variant_get(moecl_context *ctx, moecl_program_kind kind, const char *defines,
                               const char *kernel_name, moecl_variant **variant)
{
    moecl_registry *reg = ctx->registry;
    moecl_variant *v = find(reg, kind, defines, kernel_name);
    if (v) {
        *variant = v;
        return MOECL_SUCCESS;
    }
    pthread_mutex_lock(&reg->build_lock);
    v = find(reg, kind, defines, kernel_name); /* another thread may have built it meanwhile */
    moecl_status st = MOECL_SUCCESS;
    if (!v) {
        v = calloc(1, sizeof(*v));
        /* Room for v before the build, so that running out of memory costs
         * no compile; count and capacity are ours to read (build_lock). */
        if (v && reg->count == reg->capacity) {
            size_t cap = reg->capacity ? 2 * reg->capacity : 16;
            pthread_mutex_lock(&reg->lock);
            moecl_variant **items = realloc(reg->items, cap * sizeof(*items));
            if (items) {
                reg->items = items;
                reg->capacity = cap;
            }
            pthread_mutex_unlock(&reg->lock);
        }
        if (!v || reg->count == reg->capacity || !(v->defines = strdup(defines)) ||
            !(v->kernel_name = strdup(kernel_name))) {
            st = moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory registering a kernel");
        } else {
            v->kind = kind;
            pthread_mutex_init(&v->pool_lock, NULL);
            /* Another kernel of the same program (moe_align has four):
             * share its cl_program rather than build it again. */
            cl_program sibling = NULL;
            pthread_mutex_lock(&reg->lock);
            for (size_t i = 0; i < reg->count && !sibling; i++)
                if (reg->items[i]->kind == kind && strcmp(reg->items[i]->defines, defines) == 0)
                    sibling = reg->items[i]->program;
            pthread_mutex_unlock(&reg->lock);
            if (sibling && clRetainProgram(sibling) == CL_SUCCESS)
                v->program = sibling;
            else
                st = build_variant_program(ctx, kind, defines, &v->program);
            cl_kernel k = NULL;
            moecl_pooled_kernel *first = NULL;
            if (st == MOECL_SUCCESS) {
                /* Create one kernel now so that a wrong kernel name fails here, not in a call. */
                cl_int err;
                k = clCreateKernel(v->program, kernel_name, &err);
                first = calloc(1, sizeof(*first));
                if (!k)
                    st = moecl_fail(ctx, err, "clCreateKernel(%s) failed (%s)", kernel_name, moecl_status_string(err));
                else if (!first)
                    st = moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory registering a kernel");
            }
            if (st == MOECL_SUCCESS) {
                /* Register use can lower this below the device's limit;
                 * where the device table knows the query to be wrong, the
                 * device's limit stands. */
                if (!ctx->params.value[MOECL_DP_KERNEL_WG_QUERY])
                    v->work_group_limit = ctx->info.max_work_group_size;
                else if (clGetKernelWorkGroupInfo(k, ctx->device, CL_KERNEL_WORK_GROUP_SIZE,
                                                  sizeof(v->work_group_limit), &v->work_group_limit,
                                                  NULL) != CL_SUCCESS)
                    v->work_group_limit = 0;
                first->kernel = k;
                atomic_init(&first->busy, false);
                v->pool[0] = first;
                atomic_init(&v->created, 1);
                pthread_mutex_lock(&reg->lock);
                reg->items[reg->count++] = v;
                pthread_mutex_unlock(&reg->lock);
            } else {
                if (k)
                    clReleaseKernel(k);
                free(first);
            }
        }
        if (st != MOECL_SUCCESS) {
            variant_destroy(v);
            v = NULL;
        }
    }
    pthread_mutex_unlock(&reg->build_lock);
    *variant = v;
    return st;
}

moecl_status moecl_variant_acquire(moecl_context *ctx, moecl_variant *v, moecl_pooled_kernel **kernel)
{
    size_t n = atomic_load_explicit(&v->created, memory_order_acquire);
    for (size_t i = 0; i < n; i++) {
        bool idle = false;
        if (!atomic_load_explicit(&v->pool[i]->busy, memory_order_relaxed) &&
            atomic_compare_exchange_strong_explicit(&v->pool[i]->busy, &idle, true, memory_order_acquire,
                                                    memory_order_relaxed)) {
            *kernel = v->pool[i];
            return MOECL_SUCCESS;
        }
    }
    /* Every kernel is in use by another thread: make one more, pooled
     * while there is room. */
    moecl_pooled_kernel *p = calloc(1, sizeof(*p));
    if (!p)
        return moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory creating a kernel");
    cl_int err;
    p->kernel = clCreateKernel(v->program, v->kernel_name, &err);
    if (!p->kernel) {
        free(p);
        return moecl_fail(ctx, err, "clCreateKernel(%s) failed (%s)", v->kernel_name, moecl_status_string(err));
    }
    atomic_init(&p->busy, true);
    pthread_mutex_lock(&v->pool_lock);
    n = atomic_load_explicit(&v->created, memory_order_relaxed);
    if (n < POOL_MAX) {
        v->pool[n] = p;
        atomic_store_explicit(&v->created, n + 1, memory_order_release);
    } else {
        p->temporary = true;
    }
    pthread_mutex_unlock(&v->pool_lock);
    *kernel = p;
    return MOECL_SUCCESS;
}

void moecl_registry_forget_buffers(moecl_registry *reg)
{
    pthread_mutex_lock(&reg->lock);
    for (size_t i = 0; i < reg->count; i++) {
        moecl_variant *v = reg->items[i];
        const size_t n = atomic_load(&v->created);
        for (size_t j = 0; j < n; j++)
            pooled_forget(v->pool[j], true);
    }
    pthread_mutex_unlock(&reg->lock);
}

size_t moecl_variant_work_group_limit(const moecl_variant *v)
{
    return v->work_group_limit;
}

void moecl_variant_release(moecl_variant *v, moecl_pooled_kernel *k)
{
    (void)v;
    if (k->temporary) {
        pooled_forget(k, false);
        clReleaseKernel(k->kernel);
        free(k);
        return;
    }
    atomic_store_explicit(&k->busy, false, memory_order_release);
}
