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

/* 1 + the index of value among names, or 0 (absent or another value). */
static int path_named(const char *value, const char *const *names, int n)
{
    for (int i = 0; value && i < n; i++)
        if (strcmp(value, names[i]) == 0)
            return i + 1;
    return 0;
}

/* The launch variables, read once here (every later decision reads the
 * record). MOECL_TEAM: a power of two 2..256 fixes the team size of the
 * top-k gating team kernel (tuning sweeps); anything else is ignored. It
 * and MOECL_GROUNDED_TILE (128, or one tiled configuration) ask for the GPU rule of their op unless
 * MOECL_LAUNCH_CLASS=cpu (see each op's rule). MOECL_ALIGN=one-group|
 * fused|chunked: moe_align's path whatever the size (one-group and fused
 * still only where the device runs them, src/moe_align.c).
 * MOECL_EP_LAYOUT=chunked|fused|fused-last: the expert-parallel layout's
 * path (src/ep_layout.c); MOECL_EP_FUSED_WG (a power of two 32..1024) and
 * MOECL_EP_FUSED_GROUPS (1..127) its fused kernel's work-group and
 * work-group count, for measurements. */
static void read_launch_env(moecl_launch_env *env)
{
    const char *forced = getenv("MOECL_LAUNCH_CLASS");
    env->launch_class_forced = forced && (strcmp(forced, "cpu") == 0 || strcmp(forced, "gpu") == 0);
    const char *team = getenv("MOECL_TEAM");
    unsigned long t = team ? strtoul(team, NULL, 10) : 0;
    env->team = (t >= 2 && t <= 256 && (t & (t - 1)) == 0) ? (unsigned)t : 0;
    const char *tile = getenv("MOECL_GROUNDED_TILE");
    env->grounded_wide_tile = tile && strcmp(tile, "128") == 0;
    /* Anything else: one tiled configuration in the tune file's syntax,
     * "tile=64 tn=128 ..." (ignored when malformed, as a bad tune line is). */
    char text[256];
    const int n = tile ? snprintf(text, sizeof(text), "kernel=tiled %s", tile) : 0;
    if (!tile || env->grounded_wide_tile || n < 0 || (size_t)n >= sizeof(text) ||
        !moecl_launch_config_parse(text, &env->grounded_tile))
        env->grounded_tile = (moecl_launch_config){MOECL_KERNEL_ROWS, 1, 0, 0, {0}};
    /* The paths by name, in their enums' order from 1 (0: chosen). */
    static const char *const align_paths[] = {"one-group", "fused", "chunked"};
    static const char *const ep_paths[] = {"chunked", "fused", "fused-last"};
    env->align_path = (moecl_align_path)path_named(getenv("MOECL_ALIGN"), align_paths, 3);
    env->ep_path = (moecl_ep_path)path_named(getenv("MOECL_EP_LAYOUT"), ep_paths, 3);
    const char *wg = getenv("MOECL_EP_FUSED_WG"), *groups = getenv("MOECL_EP_FUSED_GROUPS");
    const unsigned long w = wg ? strtoul(wg, NULL, 10) : 0, g = groups ? strtoul(groups, NULL, 10) : 0;
    env->ep_fused_wg = w >= 32 && w <= 1024 && (w & (w - 1)) == 0 ? (unsigned)w : 0;
    env->ep_fused_groups = g >= 1 && g <= 127 ? (unsigned)g : 0;
    const char *grounded = getenv("MOECL_GROUNDED_KERNEL");
    env->grounded_mma = grounded && strcmp(grounded, "mma") == 0;
}

/* The launch class is data: device type decides, an override table keyed by
 * vendor and type could refine it. MOECL_LAUNCH_CLASS overrides for kernel
 * development and for testing both paths on one device. */
static void choose_launch_class(moecl_device_info *info)
{
    read_launch_env(&info->env);
    const char *forced = getenv("MOECL_LAUNCH_CLASS");
    if (forced && strcmp(forced, "cpu") == 0) {
        info->launch_class = MOECL_LAUNCH_CPU;
        info->launch_reason = "forced by MOECL_LAUNCH_CLASS=cpu";
    } else if (forced && strcmp(forced, "gpu") == 0) {
        info->launch_class = MOECL_LAUNCH_GPU;
        info->launch_reason = "forced by MOECL_LAUNCH_CLASS=gpu";
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

static int find_first(const device_entry *e, unsigned n, bool gpu)
{
    for (unsigned i = 0; i < n; i++)
        if (gpu ? is_gpu_like(e[i].type) : (e[i].type & CL_DEVICE_TYPE_CPU) != 0)
            return (int)i;
    return -1;
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
        unsigned p, d;
        if (parse_index_pair(selector, &p, &d)) {
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
                          "\"gpu\", \"cpu\", \"P:D\" or a substring of \"platform / device\"; devices here: %s",
                          selector, source, list);
    }
    *platform = entries[found].platform;
    *device = entries[found].device;
    return MOECL_SUCCESS;
}
