/* Validation and helpers for buffers and wait lists, shared by the ops. */
#include <string.h>

#include "internal.h"

moecl_status moecl_check_buffer_size(moecl_context *ctx, const char *name, moecl_buffer buf, uint64_t bytes,
                                     size_t elem_size, bool required, size_t *size_out)
{
    *size_out = 0;
    if (!buf.mem) {
        if (required)
            return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s: the buffer is absent (mem is NULL)", name);
        return MOECL_SUCCESS;
    }
    size_t size = 0;
    cl_context owner = NULL;
    cl_int err = clGetMemObjectInfo(buf.mem, CL_MEM_SIZE, sizeof(size), &size, NULL);
    if (err == CL_SUCCESS)
        err = clGetMemObjectInfo(buf.mem, CL_MEM_CONTEXT, sizeof(owner), &owner, NULL);
    if (err != CL_SUCCESS)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s: not a valid cl_mem (%s)", name,
                          moecl_status_string(err));
    if (owner != ctx->context)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s: the buffer belongs to another cl_context", name);
    *size_out = size;
    return moecl_check_buffer_fits(ctx, name, buf.offset, bytes, elem_size, size);
}

moecl_status moecl_check_buffer(moecl_context *ctx, const char *name, moecl_buffer buf, uint64_t bytes,
                                size_t elem_size, bool required)
{
    size_t size;
    return moecl_check_buffer_size(ctx, name, buf, bytes, elem_size, required, &size);
}

moecl_status moecl_check_buffer_fits(moecl_context *ctx, const char *name, size_t offset, uint64_t bytes,
                                     size_t elem_size, size_t size)
{
    if (offset % elem_size != 0)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "%s: byte offset %zu is not a multiple of the element size %zu", name, offset, elem_size);
    if (offset > size || bytes > (uint64_t)(size - offset))
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "%s: needs %llu bytes at offset %zu but the buffer holds %zu bytes", name,
                          (unsigned long long)bytes, offset, size);
    return MOECL_SUCCESS;
}

moecl_status moecl_check_experts_topk(moecl_context *ctx, uint32_t num_experts, uint32_t top_k)
{
    if (num_experts < 1 || num_experts > MOECL_MAX_EXPERTS)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "num_experts is %u; it must be in 1..%u", num_experts,
                          MOECL_MAX_EXPERTS);
    const uint32_t k_max = num_experts < MOECL_MAX_TOPK ? num_experts : MOECL_MAX_TOPK;
    if (top_k < 1 || top_k > k_max)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "top_k is %u; it must be in 1..%u (min(num_experts, %u))",
                          top_k, k_max, MOECL_MAX_TOPK);
    return MOECL_SUCCESS;
}

moecl_status moecl_check_record(moecl_context *ctx, const void *record, size_t struct_size, size_t first,
                                size_t known)
{
    if (!record)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "tensors is NULL");
    if (struct_size < first || struct_size > known)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                          "tensors->struct_size is %zu; this moecl takes %zu to %zu (set it to sizeof the record)",
                          struct_size, first, known);
    return MOECL_SUCCESS;
}

moecl_status moecl_copy_record(moecl_context *ctx, const void *record, size_t v1, size_t v2, const char *v1_end,
                               void *out)
{
    size_t struct_size = 0;
    if (record)
        memcpy(&struct_size, record, sizeof(struct_size));
    moecl_status st = moecl_check_record(ctx, record, struct_size, v1, v2);
    /* The sizes are the versions: one that ends inside a field would
     * leave it half there. */
    if (st == MOECL_SUCCESS && struct_size != v1 && struct_size != v2)
        st = moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT,
                        "tensors->struct_size is %zu; this moecl takes %zu (up to %s) or %zu (set it to sizeof the "
                        "record)",
                        struct_size, v1, v1_end, v2);
    if (st == MOECL_SUCCESS) {
        memset(out, 0, v2);
        memcpy(out, record, struct_size);
    }
    return st;
}

moecl_status moecl_check_wait_list(moecl_context *ctx, cl_uint num_wait, const cl_event *wait)
{
    if (num_wait > 0 && !wait)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "wait: num_wait is %u but wait is NULL", num_wait);
    if (num_wait == 0 && wait)
        return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "wait: given but num_wait is 0");
    for (cl_uint i = 0; i < num_wait; i++) {
        cl_context owner = NULL;
        cl_int err = wait[i] ? clGetEventInfo(wait[i], CL_EVENT_CONTEXT, sizeof(owner), &owner, NULL)
                             : CL_INVALID_EVENT;
        if (err != CL_SUCCESS)
            return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "wait[%u]: not a valid cl_event (%s)", i,
                              moecl_status_string(err));
        if (owner != ctx->context)
            return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "wait[%u]: the event belongs to another cl_context",
                              i);
    }
    return MOECL_SUCCESS;
}

moecl_status moecl_enqueue_nothing(moecl_context *ctx, cl_uint num_wait, const cl_event *wait, cl_event *done)
{
    if (!done && num_wait == 0)
        return MOECL_SUCCESS;
    /* A marker keeps the contract: the wait list orders later work and
     * *done completes after it. */
    cl_event ev = NULL;
    cl_int err = clEnqueueMarkerWithWaitList(ctx->queue, num_wait, wait, done ? &ev : NULL);
    if (err != CL_SUCCESS)
        return moecl_fail(ctx, err, "clEnqueueMarkerWithWaitList failed (%s)", moecl_status_string(err));
    if (done)
        *done = ev;
    return MOECL_SUCCESS;
}

moecl_status moecl_host_buffer(moecl_context *ctx, const char *name, cl_mem_flags flags, size_t size,
                               const void *host, cl_mem *mem)
{
    cl_int err;
    *mem = clCreateBuffer(ctx->context, flags | (host ? CL_MEM_COPY_HOST_PTR : 0), size, (void *)host, &err);
    if (!*mem)
        return moecl_fail(ctx, err, "%s: clCreateBuffer of %zu bytes failed (%s)", name, size,
                          moecl_status_string(err));
    return MOECL_SUCCESS;
}

moecl_status moecl_read_back(moecl_context *ctx, cl_event ran, cl_uint count, const cl_mem *mems,
                             const size_t *sizes, void *const *hosts)
{
    /* Events rather than clFinish: the queue may be out of order, and other
     * threads' work on it is none of this call's business. */
    cl_event reads[MOECL_MAX_READ_BACK];
    cl_uint n = 0;
    cl_int err = CL_SUCCESS;
    for (cl_uint i = 0; i < count && err == CL_SUCCESS; i++)
        if (hosts[i] && (err = clEnqueueReadBuffer(ctx->queue, mems[i], CL_FALSE, 0, sizes[i], hosts[i], 1, &ran,
                                                   &reads[n])) == CL_SUCCESS)
            n++;
    const cl_int wait_err = n ? clWaitForEvents(n, reads) : clWaitForEvents(1, &ran);
    if (err == CL_SUCCESS)
        err = wait_err;
    for (cl_uint i = 0; i < n; i++)
        clReleaseEvent(reads[i]);
    if (err != CL_SUCCESS)
        return moecl_fail(ctx, err, "reading the results back failed (%s)", moecl_status_string(err));
    return MOECL_SUCCESS;
}

moecl_status moecl_host_call_end(moecl_context *ctx, moecl_status st, cl_event ran, cl_mem *mems, cl_uint count,
                                 cl_uint first, const size_t *sizes, void *const *hosts)
{
    if (st == MOECL_SUCCESS)
        st = moecl_read_back(ctx, ran, count - first, mems + first, sizes, hosts + first);
    if (ran)
        clReleaseEvent(ran);
    for (cl_uint i = 0; i < count; i++)
        if (mems[i])
            clReleaseMemObject(mems[i]);
    return st;
}

static moecl_status create_scratch(moecl_context *ctx, size_t bytes, cl_mem *mem)
{
    cl_int err = CL_SUCCESS;
    *mem = clCreateBuffer(ctx->context, CL_MEM_READ_WRITE, bytes, NULL, &err);
    if (!*mem)
        return moecl_fail(ctx, err, "clCreateBuffer of %zu scratch bytes failed (%s)", bytes, moecl_status_string(err));
    return MOECL_SUCCESS;
}

moecl_status moecl_scratch_acquire(moecl_context *ctx, size_t bytes, cl_mem *mem)
{
    if (!ctx->in_order || !ctx->scratch_lock_ready)
        return create_scratch(ctx, bytes, mem);
    pthread_mutex_lock(&ctx->scratch_lock);
    if (ctx->scratch_bytes < bytes) {
        /* Released now, freed by OpenCL once earlier calls' kernels ran. */
        if (ctx->scratch)
            clReleaseMemObject(ctx->scratch);
        ctx->scratch_bytes = 0;
        const size_t grown = moecl_round_up(bytes, 64 * 1024);
        const moecl_status st = create_scratch(ctx, grown, &ctx->scratch);
        if (st != MOECL_SUCCESS) {
            pthread_mutex_unlock(&ctx->scratch_lock);
            return st;
        }
        ctx->scratch_bytes = grown;
        ctx->scratch_zero_words = 0;
    }
    *mem = ctx->scratch;
    return MOECL_SUCCESS;
}

void moecl_scratch_release(moecl_context *ctx, cl_mem mem)
{
    if (!ctx->in_order || !ctx->scratch_lock_ready)
        clReleaseMemObject(mem);
    else
        pthread_mutex_unlock(&ctx->scratch_lock);
}
