/* moecl-info: the OpenCL platforms and devices there are, which one moecl
 * picks and why, the device facts its kernels are tuned on, and the launch
 * configurations it chose for representative shapes and where from.
 * --json writes the same as one JSON object, for scripts: the picked
 * device is moecl_context_query_info()'s record, serialised. --variant
 * shows what a forced variant changes; it sets the variant override, an
 * internal of the library, so this program links the library's objects. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

#include "internal.h"
#include "tool_args.h"
#include "tool_json.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: moecl-info [--device SELECTOR] [--json] [--variant TEXT] [--help]\n"
               "Lists the OpenCL devices, the one moecl chooses (SELECTOR, else $MOECL_DEVICE,\n"
               "else the first GPU/accelerator, else the first CPU) and what moecl knows of it:\n"
               "device facts, kernel cache, tune file, launch configurations of representative\n"
               "shapes and their source.\n"
               "  --json   one JSON object on stdout instead of the text: moecl_version,\n"
               "           platforms[] with their devices[], selection, picked (null when moecl\n"
               "           picks no device: moecl_context_query_info's record, with launch[]), and\n"
               "           error (null or the reason). Strings are valid UTF-8: a byte of a driver's\n"
               "           name that is not is written as U+FFFD.\n"
               "  --variant TEXT  force a kernel variant (\"class=gpu team=16 ...\", the words of\n"
               "           docs/environment.md, \"Forcing a variant\") and show what it changes; the\n"
               "           text names it, the JSON as \"variant\" (null without one).\n"
               "Exit status: 0 ok, 1 no usable device (moecl picks none), 2 bad usage.\n");
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

/* A path member: the path, or null where the record has none (""). */
static void add_path(cJSON *obj, const char *name, const char *path)
{
    tool_json_add_string(obj, name, *path ? path : NULL);
}

static cJSON *device_json(cl_device_id dev, cl_uint p, cl_uint d)
{
    char name[256] = "", vendor[256] = "", version[256] = "", driver[256] = "", selector[32];
    cl_device_type t = 0;
    cl_uint units = 0;
    cl_ulong global = 0, local = 0;
    size_t wg = 0;
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof(name), name, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_VENDOR, sizeof(vendor), vendor, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_VERSION, sizeof(version), version, NULL);
    clGetDeviceInfo(dev, CL_DRIVER_VERSION, sizeof(driver), driver, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_TYPE, sizeof(t), &t, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(units), &units, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof(global), &global, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_LOCAL_MEM_SIZE, sizeof(local), &local, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof(wg), &wg, NULL);
    snprintf(selector, sizeof(selector), "%u:%u", p, d);
    cJSON *j = cJSON_CreateObject();
    tool_json_add_number(j, "index", d);
    tool_json_add_string(j, "selector", selector);
    tool_json_add_string(j, "name", name);
    tool_json_add_string(j, "type", type_name(t));
    tool_json_add_string(j, "vendor", vendor);
    tool_json_add_string(j, "version", version);
    tool_json_add_string(j, "driver", driver);
    tool_json_add_number(j, "compute_units", units);
    tool_json_add_number(j, "global_memory_bytes", (double)global);
    tool_json_add_number(j, "local_memory_bytes", (double)local);
    tool_json_add_number(j, "max_work_group_size", (double)wg);
    return j;
}

static cJSON *launch_json(const moecl_launch_info *l)
{
    cJSON *j = cJSON_CreateObject(), *key = cJSON_CreateObject(), *config = cJSON_CreateObject();
    cJSON_AddItemToObject(j, "key", key);
    tool_json_add_string(key, "op", l->op);
    tool_json_add_number(key, "num_experts", l->num_experts);
    tool_json_add_number(key, "top_k", l->top_k);
    tool_json_add_number(key, "groups", l->groups);
    tool_json_add_number(key, "hidden_bucket", l->hidden_bucket);
    tool_json_add_string(key, "text", l->key_text);
    cJSON_AddItemToObject(j, "config", config);
    tool_json_add_string(config, "kernel", l->kernel);
    tool_json_add_number(config, "team", l->team);
    tool_json_add_number(config, "rows", l->rows);
    tool_json_add_number(config, "tile", l->tile);
    tool_json_add_string(config, "text", l->config_text);
    tool_json_add_string(j, "source", l->source);
    return j;
}

/* The record, member for member. */
static cJSON *picked_json(const moecl_context_info *r)
{
    cJSON *j = cJSON_CreateObject();
    tool_json_add_string(j, "platform", r->platform);
    tool_json_add_string(j, "device", r->device);
    tool_json_add_string(j, "device_version", r->device_version);
    tool_json_add_string(j, "driver", r->driver);
    tool_json_add_string(j, "type", r->type);
    tool_json_add_string(j, "vendor", r->vendor);
    tool_json_add_number(j, "compute_units", r->compute_units);
    tool_json_add_number(j, "local_memory_bytes", (double)r->local_memory_bytes);
    tool_json_add_number(j, "max_work_group_size", (double)r->max_work_group_size);
    tool_json_add_string(j, "launch_class", r->launch_class);
    tool_json_add_string(j, "launch_class_reason", r->launch_class_reason);
    add_path(j, "kernel_dir", r->kernel_dir);
    add_path(j, "kernel_cache", r->kernel_cache);
    tool_json_add_bool(j, "kernel_binaries", r->kernel_binaries);
    tool_json_add_bool(j, "inline_ptx", r->inline_ptx);
    tool_json_add_string(j, "inline_ptx_reason", r->inline_ptx_reason);
    add_path(j, "tune_file", r->tune_file);
    tool_json_add_bool(j, "tune_file_present", r->tune_file_present);
    tool_json_add_number(j, "tune_keys_read", r->tune_keys_read);
    cJSON *launch = cJSON_CreateArray();
    for (uint32_t i = 0; i < r->num_launches; i++)
        cJSON_AddItemToArray(launch, launch_json(&r->launches[i]));
    cJSON_AddItemToObject(j, "launch", launch);
    return j;
}

/* The platforms and their devices: a JSON array, or the text list. */
static cJSON *list_devices(bool json)
{
    cJSON *list = json ? cJSON_CreateArray() : NULL;
    cl_platform_id platforms[16];
    cl_uint np = 0;
    if (clGetPlatformIDs(16, platforms, &np) != CL_SUCCESS)
        np = 0;
    for (cl_uint p = 0; p < np && p < 16; p++) {
        char pname[256] = "", pvendor[256] = "", pversion[256] = "";
        clGetPlatformInfo(platforms[p], CL_PLATFORM_NAME, sizeof(pname), pname, NULL);
        clGetPlatformInfo(platforms[p], CL_PLATFORM_VENDOR, sizeof(pvendor), pvendor, NULL);
        clGetPlatformInfo(platforms[p], CL_PLATFORM_VERSION, sizeof(pversion), pversion, NULL);
        cl_device_id devices[64];
        cl_uint nd = 0;
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 64, devices, &nd) != CL_SUCCESS)
            nd = 0;
        cJSON *plat = json ? cJSON_CreateObject() : NULL, *devs = json ? cJSON_CreateArray() : NULL;
        for (cl_uint d = 0; d < nd && d < 64; d++) {
            if (json) {
                cJSON_AddItemToArray(devs, device_json(devices[d], p, d));
                continue;
            }
            char dname[256] = "";
            cl_device_type t = 0;
            clGetDeviceInfo(devices[d], CL_DEVICE_NAME, sizeof(dname), dname, NULL);
            clGetDeviceInfo(devices[d], CL_DEVICE_TYPE, sizeof(t), &t, NULL);
            printf("  %u:%u  %-11s  %s / %s\n", p, d, type_name(t), pname, dname);
        }
        if (json) {
            tool_json_add_number(plat, "index", p);
            tool_json_add_string(plat, "name", pname);
            tool_json_add_string(plat, "vendor", pvendor);
            tool_json_add_string(plat, "version", pversion);
            cJSON_AddItemToObject(plat, "devices", devs);
            cJSON_AddItemToArray(list, plat);
        }
    }
    if (!json && np == 0)
        printf("  (none)\n");
    return list;
}

static int parse_args(int argc, char **argv, const char **selector, bool *json, const char **variant)
{
    enum { OPT_DEVICE = 256, OPT_JSON, OPT_VARIANT };
    static const struct option longopts[] = {{"device", required_argument, NULL, OPT_DEVICE},
                                             {"json", no_argument, NULL, OPT_JSON},
                                             {"variant", required_argument, NULL, OPT_VARIANT},
                                             {"help", no_argument, NULL, 'h'},
                                             {NULL, 0, NULL, 0}};
    int c;
    while ((c = tool_getopt("moecl-info", usage, argc, argv, "h", longopts)) != -1) {
        if (c == 'h') {
            usage(stdout);
            return 0;
        } else if (c == OPT_DEVICE) {
            *selector = optarg;
        } else if (c == OPT_JSON) {
            *json = true;
        } else if (c == OPT_VARIANT) {
            if (moecl_override_set(optarg) != MOECL_SUCCESS)
                return tool_bad_usage("moecl-info", usage, "--variant %s: %s", optarg, moecl_context_error(NULL));
            *variant = optarg;
        } else {
            return 2; /* tool_getopt named it */
        }
    }
    if (optind < argc)
        return tool_bad_usage("moecl-info", usage, "unexpected argument '%s'", argv[optind]);
    return -1;
}

int main(int argc, char **argv)
{
    const char *selector = NULL, *variant = NULL;
    bool json = false;
    int status = parse_args(argc, argv, &selector, &json, &variant);
    if (status >= 0)
        return status;
    cJSON *doc = json ? cJSON_CreateObject() : NULL;
    if (json) {
        tool_json_add_string(doc, "moecl_version", moecl_version());
        tool_json_add_string(doc, "variant", variant);
    } else {
        printf("moecl %s\n\nOpenCL devices (select with \"P:D\", \"gpu\", \"cpu\" or a name substring):\n",
               moecl_version());
    }
    cJSON *platforms = list_devices(json);
    const char *env = getenv("MOECL_DEVICE");
    const bool by_env = !selector && env && *env;
    if (json) {
        cJSON_AddItemToObject(doc, "platforms", platforms);
        cJSON *sel = cJSON_CreateObject();
        tool_json_add_string(sel, "selector", selector ? selector : by_env ? env : NULL);
        tool_json_add_string(sel, "by", selector ? "--device" : by_env ? "MOECL_DEVICE" : "default");
        cJSON_AddItemToObject(doc, "selection", sel);
    }
    moecl_context *ctx = NULL;
    moecl_context_info info = {.struct_size = sizeof(info)};
    moecl_status st = moecl_context_create(selector, &ctx);
    char err[1024] = "";
    if (st != MOECL_SUCCESS)
        snprintf(err, sizeof(err), "%s: %s", moecl_status_string(st), moecl_context_error(NULL));
    else if ((st = moecl_context_query_info(ctx, &info)) != MOECL_SUCCESS)
        snprintf(err, sizeof(err), "describing the context: %s: %s", moecl_status_string(st),
                 moecl_context_error(ctx));
    if (json) {
        cJSON_AddItemToObject(doc, "picked", st == MOECL_SUCCESS ? picked_json(&info) : cJSON_CreateNull());
        tool_json_add_string(doc, "error", st == MOECL_SUCCESS ? NULL : err);
        const bool written = tool_json_write(stdout, doc);
        cJSON_Delete(doc);
        moecl_context_destroy(ctx);
        return st != MOECL_SUCCESS || !written ? 1 : 0;
    }
    if (st != MOECL_SUCCESS) {
        printf("\nmoecl picks no device: %s\n", err);
        moecl_context_destroy(ctx);
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
    moecl_context_destroy(ctx);
    printf("\nOps: top-k gating (moecl_topk_gating: softmax/sigmoid, bias, groups, renormalize, scale;\n"
           "     f32/f16/bf16 logits; 1..4096 experts, top_k 1..64) and the grounded router\n"
           "     (moecl_grounded_router: logits + alpha * hidden @ ground^T, top-k, softmax over the chosen;\n"
           "     hidden 1..65536).\n");
    printf("\nmoecl picks (by %s):\n",
           selector ? "the --device selector"
           : by_env ? "$MOECL_DEVICE"
                    : "the default rule: first GPU/accelerator, else first CPU");
    if (variant)
        printf("  variant override: %s\n", variant);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n"))
        printf("  %s\n", line);
    printf("\n\"launch\" lines: the configuration representative keys launch with, and where it came from:\n"
           "default (computed from the device facts), table (moecl's built-in per-device table), tuned (the\n"
           "tune file moecl-tune wrote), override (computed under the variant override, --variant).\n");
    free(text);
    return 0;
}
