/* Platform and device enumeration, the selector grammar, device facts and
 * the launch class derived from them. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MAX_PLATFORMS 16
#define MAX_DEVICES 64

/* cl_nv_device_attribute_query (CL/cl_ext.h, which not every SDK ships). */
#ifndef CL_DEVICE_COMPUTE_CAPABILITY_MAJOR_NV
#define CL_DEVICE_COMPUTE_CAPABILITY_MAJOR_NV 0x4000
#endif
#ifndef CL_DEVICE_COMPUTE_CAPABILITY_MINOR_NV
#define CL_DEVICE_COMPUTE_CAPABILITY_MINOR_NV 0x4001
#endif

static const char no_platform_hint[] =
    "no OpenCL platform found: install an OpenCL driver (ICD). On Debian or Ubuntu, "
    "`apt-get install pocl-opencl-icd` gives a CPU device; GPU vendors ship their own "
    "(intel-opencl-icd, mesa-opencl-icd or ROCm, the NVIDIA driver). Check with `clinfo -l`.";

const char *moecl_launch_class_name(moecl_launch_class c)
{
    return c == MOECL_LAUNCH_CPU ? "cpu" : "gpu";
}

static void query_string(cl_device_id device, cl_device_info what, char *buf, size_t size)
{
    buf[0] = '\0';
    if (clGetDeviceInfo(device, what, size, buf, NULL) != CL_SUCCESS)
        buf[0] = '\0';
    buf[size - 1] = '\0';
}

static bool contains_nocase(const char *haystack, const char *needle)
{
    size_t n = strlen(needle);
    if (n == 0)
        return true;
    for (; *haystack; haystack++)
        if (strncasecmp(haystack, needle, n) == 0)
            return true;
    return false;
}

static moecl_vendor vendor_of(const char *platform, const char *vendor)
{
    if (contains_nocase(platform, "portable computing language") || contains_nocase(platform, "pocl"))
        return MOECL_VENDOR_POCL;
    /* Mesa's rusticl: its compiler (through SPIR-V and NIR) and runtime
     * serve every device it drives, so the platform decides. */
    if (strcasecmp(platform, "rusticl") == 0)
        return MOECL_VENDOR_RUSTICL;
    if (contains_nocase(vendor, "nvidia") || contains_nocase(platform, "nvidia"))
        return MOECL_VENDOR_NVIDIA;
    if (contains_nocase(vendor, "advanced micro devices") || contains_nocase(vendor, "amd"))
        return MOECL_VENDOR_AMD;
    if (contains_nocase(vendor, "intel"))
        return MOECL_VENDOR_INTEL;
    return MOECL_VENDOR_OTHER;
}

bool moecl_extension_listed(const char *extensions, const char *ext)
{
    const size_t n = strlen(ext);
    for (const char *p = extensions; n && (p = strstr(p, ext)) != NULL; p += n)
        if ((p == extensions || p[-1] == ' ') && (p[n] == ' ' || p[n] == '\0'))
            return true;
    return false;
}

/* The inline PTX of the kernels and what each instruction needs (PTX ISA,
 * "Target ISA Notes"):
 *   shfl.sync.bfly.b32   TEAM_SHUFFLE reductions   PTX 6.0, sm_30
 *   match.any.sync.b32   WARP_MATCH ranking        PTX 6.0, sm_70
 *   vote.sync.ballot.b32 WARP_MATCH ranking (ep)   PTX 6.0, sm_30
 *   bar.warp.sync        WARP_MATCH ranking        PTX 6.0, sm_30
 *   mov.u32 %lanemask_lt WARP_MATCH ranking        PTX 2.0, sm_20
 * The compute capability is queried here; the threshold the paths need is
 * the device table's (src/device_table.c, moecl_device_ptx). */
/* The compute capability where the device lists the extension (0.0 else). */
static void query_compute_capability(cl_device_id device, moecl_device_info *info)
{
    size_t size = 0;
    if (clGetDeviceInfo(device, CL_DEVICE_EXTENSIONS, 0, NULL, &size) != CL_SUCCESS || size == 0)
        return;
    char *extensions = malloc(size + 1);
    if (!extensions)
        return; /* no PTX paths: the portable kernels serve */
    if (clGetDeviceInfo(device, CL_DEVICE_EXTENSIONS, size, extensions, NULL) == CL_SUCCESS) {
        extensions[size] = '\0';
        cl_uint major = 0, minor = 0;
        if (moecl_extension_listed(extensions, "cl_nv_device_attribute_query") &&
            clGetDeviceInfo(device, CL_DEVICE_COMPUTE_CAPABILITY_MAJOR_NV, sizeof(major), &major, NULL) == CL_SUCCESS &&
            clGetDeviceInfo(device, CL_DEVICE_COMPUTE_CAPABILITY_MINOR_NV, sizeof(minor), &minor, NULL) == CL_SUCCESS) {
            info->nv_compute_major = major;
            info->nv_compute_minor = minor;
        }
    }
    free(extensions);
}

/* The launch class is data: the device type decides, the variant override
 * (class=cpu|gpu) forces one, for testing both kernels on one device. */
static void choose_launch_class(moecl_device_info *info)
{
    moecl_override_get(&info->env);
    if (info->env.launch_class_forced) {
        info->launch_class = info->env.launch_class;
        info->launch_reason = info->launch_class == MOECL_LAUNCH_CPU ? "forced by the variant override class=cpu"
                                                                     : "forced by the variant override class=gpu";
    } else if (info->type & CL_DEVICE_TYPE_CPU) {
        info->launch_class = MOECL_LAUNCH_CPU;
        info->launch_reason = "CPU device: one work-item per row vectorises best";
    } else {
        info->launch_class = MOECL_LAUNCH_GPU;
        info->launch_reason = "GPU or accelerator: a team of work-items per row";
    }
}

moecl_status moecl_device_query(cl_device_id device, moecl_device_info *info)
{
    memset(info, 0, sizeof(*info));
    cl_platform_id platform;
    cl_int err = clGetDeviceInfo(device, CL_DEVICE_PLATFORM, sizeof(platform), &platform, NULL);
    if (err != CL_SUCCESS)
        return err;
    if (clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof(info->platform_name), info->platform_name, NULL))
        info->platform_name[0] = '\0';
    info->platform_name[sizeof(info->platform_name) - 1] = '\0';
    query_string(device, CL_DEVICE_NAME, info->device_name, sizeof(info->device_name));
    query_string(device, CL_DRIVER_VERSION, info->driver_version, sizeof(info->driver_version));
    query_string(device, CL_DEVICE_VERSION, info->device_version, sizeof(info->device_version));
    char vendor[128];
    query_string(device, CL_DEVICE_VENDOR, vendor, sizeof(vendor));
    info->vendor = vendor_of(info->platform_name, vendor);
    err = clGetDeviceInfo(device, CL_DEVICE_TYPE, sizeof(info->type), &info->type, NULL);
    if (err == CL_SUCCESS)
        err = clGetDeviceInfo(device, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(info->compute_units),
                              &info->compute_units, NULL);
    if (err == CL_SUCCESS)
        err = clGetDeviceInfo(device, CL_DEVICE_LOCAL_MEM_SIZE, sizeof(info->local_mem_size),
                              &info->local_mem_size, NULL);
    if (err == CL_SUCCESS)
        err = clGetDeviceInfo(device, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof(info->max_work_group_size),
                              &info->max_work_group_size, NULL);
    if (err != CL_SUCCESS)
        return err;
    query_compute_capability(device, info);
    info->ptx = moecl_device_ptx(info);
    choose_launch_class(info);
    return MOECL_SUCCESS;
}

typedef struct device_entry {
    cl_platform_id platform;
    cl_device_id device;
    unsigned platform_index, device_index;
    cl_device_type type;
    char label[300]; /* "platform name / device name" */
} device_entry;

static moecl_status list_devices(device_entry *out, unsigned *count)
{
    cl_platform_id platforms[MAX_PLATFORMS];
    cl_uint num_platforms = 0;
    cl_int err = clGetPlatformIDs(MAX_PLATFORMS, platforms, &num_platforms);
    if (err == -1001 /* CL_PLATFORM_NOT_FOUND_KHR */ || (err == CL_SUCCESS && num_platforms == 0))
        return moecl_fail(NULL, MOECL_ERROR_NO_DEVICE, "%s", no_platform_hint);
    if (err != CL_SUCCESS)
        return moecl_fail(NULL, err, "clGetPlatformIDs failed (%s)", moecl_status_string(err));
    if (num_platforms > MAX_PLATFORMS)
        num_platforms = MAX_PLATFORMS;
    unsigned n = 0;
    for (cl_uint p = 0; p < num_platforms; p++) {
        cl_device_id devices[MAX_DEVICES];
        cl_uint num_devices = 0;
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, MAX_DEVICES, devices, &num_devices) != CL_SUCCESS)
            continue;
        if (num_devices > MAX_DEVICES)
            num_devices = MAX_DEVICES;
        char pname[128] = "";
        clGetPlatformInfo(platforms[p], CL_PLATFORM_NAME, sizeof(pname), pname, NULL);
        pname[sizeof(pname) - 1] = '\0';
        for (cl_uint d = 0; d < num_devices && n < MAX_DEVICES; d++) {
            device_entry *e = &out[n++];
            e->platform = platforms[p];
            e->device = devices[d];
            e->platform_index = p;
            e->device_index = d;
            e->type = 0;
            clGetDeviceInfo(devices[d], CL_DEVICE_TYPE, sizeof(e->type), &e->type, NULL);
            char dname[128];
            query_string(devices[d], CL_DEVICE_NAME, dname, sizeof(dname));
            snprintf(e->label, sizeof(e->label), "%s / %s", pname, dname);
        }
    }
    if (n == 0)
        return moecl_fail(NULL, MOECL_ERROR_NO_DEVICE, "OpenCL platforms exist but list no device. %s",
                          no_platform_hint);
    *count = n;
    return MOECL_SUCCESS;
}

static bool is_gpu_like(cl_device_type t)
{
    return (t & (CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR)) != 0;
}

static bool is_kind(const device_entry *e, bool gpu)
{
    return gpu ? is_gpu_like(e->type) : (e->type & CL_DEVICE_TYPE_CPU) != 0;
}

/* The nth device of a kind (GPU or accelerator, or CPU) in moecl-info's
 * order, all platforms together: "gpu:N", one per MPI rank of a host. */
static int find_nth(const device_entry *e, unsigned n, bool gpu, unsigned nth)
{
    for (unsigned i = 0; i < n; i++)
        if (is_kind(&e[i], gpu) && nth-- == 0)
            return (int)i;
    return -1;
}

static int find_first(const device_entry *e, unsigned n, bool gpu)
{
    return find_nth(e, n, gpu, 0);
}

/* "gpu:N" or "cpu:N": the kind and N (decimal digits only, no sign or
 * space). *malformed when the text starts so but does not parse: such a
 * selector is an error, never a substring to match. */
static bool parse_kind_index(const char *s, bool *gpu, unsigned *nth, bool *malformed)
{
    *malformed = false;
    if (strncasecmp(s, "gpu:", 4) != 0 && strncasecmp(s, "cpu:", 4) != 0)
        return false;
    *gpu = tolower((unsigned char)s[0]) == 'g';
    const char *digits = s + 4;
    char *end = NULL;
    const unsigned long v = isdigit((unsigned char)digits[0]) ? strtoul(digits, &end, 10) : 0;
    if (!end || *end != '\0' || v > 1000) {
        *malformed = true;
        return false;
    }
    *nth = (unsigned)v;
    return true;
}

static bool parse_index_pair(const char *s, unsigned *p, unsigned *d)
{
    char *end;
    if (!isdigit((unsigned char)s[0]))
        return false;
    unsigned long a = strtoul(s, &end, 10);
    if (*end != ':' || !isdigit((unsigned char)end[1]))
        return false;
    unsigned long b = strtoul(end + 1, &end, 10);
    if (*end != '\0' || a > 1000 || b > 1000)
        return false;
    *p = (unsigned)a;
    *d = (unsigned)b;
    return true;
}

moecl_status moecl_device_select(const char *selector, cl_platform_id *platform, cl_device_id *device)
{
    device_entry entries[MAX_DEVICES];
    unsigned n = 0;
    moecl_status st = list_devices(entries, &n);
    if (st != MOECL_SUCCESS)
        return st;

    const char *source = "the argument";
    if (!selector || !*selector) {
        selector = getenv("MOECL_DEVICE");
        source = "$MOECL_DEVICE";
    }
    int found = -1;
    if (!selector || !*selector) {
        found = find_first(entries, n, true);
        if (found < 0)
            found = find_first(entries, n, false);
        if (found < 0)
            found = 0;
    } else if (strcasecmp(selector, "gpu") == 0) {
        found = find_first(entries, n, true);
    } else if (strcasecmp(selector, "cpu") == 0) {
        found = find_first(entries, n, false);
    } else {
        unsigned p, d, nth;
        bool gpu, malformed;
        if (parse_kind_index(selector, &gpu, &nth, &malformed)) {
            found = find_nth(entries, n, gpu, nth);
        } else if (malformed) {
            return moecl_fail(NULL, MOECL_ERROR_NO_DEVICE,
                              "the selector \"%s\" (from %s) is not \"gpu:N\" or \"cpu:N\" with N a device "
                              "number from 0",
                              selector, source);
        } else if (parse_index_pair(selector, &p, &d)) {
            for (unsigned i = 0; i < n; i++)
                if (entries[i].platform_index == p && entries[i].device_index == d)
                    found = (int)i;
        } else {
            for (unsigned i = 0; i < n && found < 0; i++)
                if (contains_nocase(entries[i].label, selector))
                    found = (int)i;
        }
    }
    if (found < 0) {
        char list[1200] = "";
        size_t used = 0;
        for (unsigned i = 0; i < n && used < sizeof(list) - 1; i++) {
            int w = snprintf(list + used, sizeof(list) - used, "%s%u:%u %s", i ? "; " : "",
                             entries[i].platform_index, entries[i].device_index, entries[i].label);
            if (w < 0)
                break;
            used += (size_t)w;
        }
        return moecl_fail(NULL, MOECL_ERROR_NO_DEVICE,
                          "no OpenCL device matches the selector \"%s\" (from %s); selectors are "
                          "\"gpu\", \"cpu\", \"gpu:N\", \"cpu:N\", \"P:D\" or a substring of "
                          "\"platform / device\"; devices here: %s",
                          selector, source, list);
    }
    *platform = entries[found].platform;
    *device = entries[found].device;
    return MOECL_SUCCESS;
}
