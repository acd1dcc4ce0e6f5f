/* Status strings and the per-thread error detail of each context. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define ERROR_SLOTS 8
#define ERROR_LENGTH 2048

/* Each thread keeps the detail of its last failure on its last few
 * contexts; slot 0 is the most recent. No locks, no allocation. */
typedef struct error_slot {
    const moecl_context *ctx;
    bool used;
    char message[ERROR_LENGTH];
} error_slot;

static _Thread_local error_slot error_slots[ERROR_SLOTS];

static error_slot *find_slot(const moecl_context *ctx)
{
    for (int i = 0; i < ERROR_SLOTS; i++)
        if (error_slots[i].used && error_slots[i].ctx == ctx)
            return &error_slots[i];
    return NULL;
}

moecl_status moecl_fail(const moecl_context *ctx, moecl_status status, const char *fmt, ...)
{
    error_slot *slot = find_slot(ctx);
    int index = slot ? (int)(slot - error_slots) : ERROR_SLOTS - 1;
    /* Move the slot to the front so the oldest context's detail is the one dropped. */
    error_slot tmp = error_slots[index];
    memmove(&error_slots[1], &error_slots[0], (size_t)index * sizeof(error_slot));
    error_slots[0] = tmp;
    error_slots[0].ctx = ctx;
    error_slots[0].used = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_slots[0].message, ERROR_LENGTH, fmt, ap);
    va_end(ap);
    return status;
}

void moecl_error_forget(const moecl_context *ctx)
{
    error_slot *slot = find_slot(ctx);
    if (slot)
        slot->used = false;
}

const char *moecl_context_error(const moecl_context *ctx)
{
    error_slot *slot = find_slot(ctx);
    return slot ? slot->message : "";
}

const char *moecl_status_string(moecl_status status)
{
    switch ((int)status) {
    case MOECL_SUCCESS: return "success";
    case MOECL_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case MOECL_ERROR_UNSUPPORTED: return "unsupported on this device or build";
    case MOECL_ERROR_NO_DEVICE: return "no OpenCL device";
    case MOECL_ERROR_BUILD: return "kernel build failed";
    case MOECL_ERROR_OUT_OF_MEMORY: return "out of host memory";
#define CL_CASE(code) case code: return #code
    CL_CASE(CL_DEVICE_NOT_FOUND);
    CL_CASE(CL_DEVICE_NOT_AVAILABLE);
    CL_CASE(CL_COMPILER_NOT_AVAILABLE);
    CL_CASE(CL_MEM_OBJECT_ALLOCATION_FAILURE);
    CL_CASE(CL_OUT_OF_RESOURCES);
    CL_CASE(CL_OUT_OF_HOST_MEMORY);
    CL_CASE(CL_PROFILING_INFO_NOT_AVAILABLE);
    CL_CASE(CL_MEM_COPY_OVERLAP);
    CL_CASE(CL_BUILD_PROGRAM_FAILURE);
    CL_CASE(CL_MISALIGNED_SUB_BUFFER_OFFSET);
    CL_CASE(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST);
    CL_CASE(CL_INVALID_VALUE);
    CL_CASE(CL_INVALID_DEVICE_TYPE);
    CL_CASE(CL_INVALID_PLATFORM);
    CL_CASE(CL_INVALID_DEVICE);
    CL_CASE(CL_INVALID_CONTEXT);
    CL_CASE(CL_INVALID_QUEUE_PROPERTIES);
    CL_CASE(CL_INVALID_COMMAND_QUEUE);
    CL_CASE(CL_INVALID_HOST_PTR);
    CL_CASE(CL_INVALID_MEM_OBJECT);
    CL_CASE(CL_INVALID_BINARY);
    CL_CASE(CL_INVALID_BUILD_OPTIONS);
    CL_CASE(CL_INVALID_PROGRAM);
    CL_CASE(CL_INVALID_PROGRAM_EXECUTABLE);
    CL_CASE(CL_INVALID_KERNEL_NAME);
    CL_CASE(CL_INVALID_KERNEL);
    CL_CASE(CL_INVALID_ARG_INDEX);
    CL_CASE(CL_INVALID_ARG_VALUE);
    CL_CASE(CL_INVALID_ARG_SIZE);
    CL_CASE(CL_INVALID_KERNEL_ARGS);
    CL_CASE(CL_INVALID_WORK_DIMENSION);
    CL_CASE(CL_INVALID_WORK_GROUP_SIZE);
    CL_CASE(CL_INVALID_WORK_ITEM_SIZE);
    CL_CASE(CL_INVALID_GLOBAL_OFFSET);
    CL_CASE(CL_INVALID_EVENT_WAIT_LIST);
    CL_CASE(CL_INVALID_EVENT);
    CL_CASE(CL_INVALID_OPERATION);
    CL_CASE(CL_INVALID_BUFFER_SIZE);
    CL_CASE(CL_INVALID_GLOBAL_WORK_SIZE);
    CL_CASE(CL_COMPILE_PROGRAM_FAILURE);
    CL_CASE(CL_LINKER_NOT_AVAILABLE);
    CL_CASE(CL_LINK_PROGRAM_FAILURE);
    CL_CASE(CL_DEVICE_PARTITION_FAILED);
    CL_CASE(CL_KERNEL_ARG_INFO_NOT_AVAILABLE);
    CL_CASE(CL_INVALID_SAMPLER);
    CL_CASE(CL_INVALID_IMAGE_SIZE);
    CL_CASE(CL_INVALID_MIP_LEVEL);
    CL_CASE(CL_INVALID_PROPERTY);
    CL_CASE(CL_INVALID_IMAGE_DESCRIPTOR);
    CL_CASE(CL_INVALID_COMPILER_OPTIONS);
    CL_CASE(CL_INVALID_LINKER_OPTIONS);
    CL_CASE(CL_INVALID_DEVICE_PARTITION_COUNT);
#undef CL_CASE
    case -1001: return "CL_PLATFORM_NOT_FOUND_KHR";
    default: return (int)status < 0 && (int)status > -2000 ? "OpenCL error (see the CL/cl.h codes)" : "unknown status";
    }
}

const char *moecl_version(void) { return MOECL_VERSION_STRING; }
