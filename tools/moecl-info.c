/* moecl-info: the OpenCL platforms and devices there are, which one moecl
 * picks and why, the device facts its kernels are tuned on, and the launch
 * configurations it chose for representative shapes and where from.
 * --json writes the same as one JSON object, for scripts. */
#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

static void usage(FILE *f)
{
    fprintf(f, "usage: moecl-info [--device SELECTOR] [--json] [--help]\n"
               "Lists the OpenCL devices, the one moecl chooses (SELECTOR, else $MOECL_DEVICE,\n"
               "else the first GPU/accelerator, else the first CPU) and what moecl knows of it:\n"
               "device facts, kernel cache, tune file, launch configurations of representative\n"
               "shapes and their source.\n"
               "  --json   one JSON object on stdout instead of the text: moecl_version,\n"
               "           platforms[] with their devices[], selection, picked (null when moecl\n"
               "           picks no device) with launch[], and error (null or the reason)\n"
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

/* A JSON string: quotes, backslashes and control characters escaped; other
 * bytes as they are (the OpenCL names are ASCII or UTF-8). */
static void json_str(const char *s)
{
    if (!s) {
        fputs("null", stdout);
        return;
    }
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p == '\n')
            fputs("\\n", stdout);
        else if (*p == '\t')
            fputs("\\t", stdout);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

static bool all_digits(const char *s)
{
    if (!*s)
        return false;
    for (; *s; s++)
        if (!isdigit((unsigned char)*s))
            return false;
    return true;
}

/* A value: a JSON number if it is all digits, else a string. */
static void json_value(const char *s)
{
    if (all_digits(s))
        fputs(s, stdout);
    else
        json_str(s);
}

/* "Name value" -> "name_value", in place ("inline PTX" -> "inline_ptx"). */
static char *snake(char *s)
{
    for (char *p = s; *p; p++)
        *p = *p == ' ' || *p == '-' ? '_' : (char)tolower((unsigned char)*p);
    return s;
}

/* Space-separated "k=v" tokens as JSON members, after an optional leading
 * token without '=' that becomes `first_name`. */
static void json_kv_tokens(char *text, const char *first_name)
{
    bool first = true;
    for (char *tok = strtok(text, " "); tok; tok = strtok(NULL, " ")) {
        char *eq = strchr(tok, '=');
        printf("%s", first ? "" : ", ");
        first = false;
        if (!eq) {
            json_str(first_name);
            printf(": ");
            json_str(tok);
            continue;
        }
        *eq = '\0';
        json_str(tok);
        printf(": ");
        json_value(eq + 1);
    }
}

/* "launch KEY: CONFIG (SOURCE)", not "launch class: ...". */
static bool is_launch_line(const char *line)
{
    return !strncmp(line, "launch ", 7) && strncmp(line, "launch class: ", 14);
}

/* One line of moecl_context_describe(), "key: value", as a JSON member;
 * launch lines ("launch KEY: CONFIG (SOURCE)") go to the launch array. The
 * few values with a unit or a note get their own members. */
static void json_describe_line(char *line, bool *first)
{
    char *colon = strstr(line, ": ");
    if (!colon || is_launch_line(line))
        return;
    *colon = '\0';
    char *key = snake(line), *value = colon + 2;
    printf("%s\n    ", *first ? "" : ",");
    *first = false;
    size_t n = strlen(value);
    if (!strcmp(key, "local_memory") && n > 6 && !strcmp(value + n - 6, " bytes")) {
        value[n - 6] = '\0';
        printf("\"local_memory_bytes\": ");
        json_value(value);
    } else if (!strcmp(key, "launch_class") && strstr(value, " (") && value[n - 1] == ')') {
        char *paren = strstr(value, " (");
        *paren = '\0';
        value[n - 1] = '\0';
        printf("\"launch_class\": ");
        json_str(value);
        printf(",\n    \"launch_class_reason\": ");
        json_str(paren + 2);
    } else if (!strcmp(key, "kernel_cache")) {
        printf("\"kernel_cache\": ");
        json_str(strcmp(value, "off") ? value : NULL);
    } else if (!strcmp(key, "tune_file")) {
        /* "PATH (absent, ...; keys read at creation: N)" or "off (...)" */
        char *paren = strstr(value, " (");
        if (paren)
            *paren = '\0';
        bool off = !strcmp(value, "off");
        const char *keys = paren ? strstr(paren + 2, "keys read at creation: ") : NULL;
        printf("\"tune_file\": ");
        json_str(off ? NULL : value);
        printf(",\n    \"tune_file_present\": %s", !off && paren && !strstr(paren + 2, "absent") ? "true" : "false");
        printf(",\n    \"tune_keys_read\": %d", keys ? atoi(keys + strlen("keys read at creation: ")) : 0);
    } else {
        json_str(key);
        printf(": ");
        json_value(value);
    }
}

static void json_launch_lines(char *text)
{
    printf(",\n    \"launch\": [");
    bool first = true;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (!is_launch_line(line))
            continue;
        /* launch KEY: CONFIG (SOURCE) */
        char *colon = strstr(line, ": "), *paren = strrchr(line, '(');
        size_t n = strlen(line);
        if (!colon || !paren || paren < colon || line[n - 1] != ')')
            continue;
        *colon = '\0';
        paren[-1] = '\0';
        line[n - 1] = '\0';
        printf("%s\n      {\"key\": {", first ? "" : ",");
        first = false;
        json_kv_tokens(line + 7, "op");
        printf("}, \"config\": {");
        json_kv_tokens(colon + 2, "config");
        printf("}, \"source\": ");
        json_str(paren + 1);
        printf("}");
    }
    printf("\n    ]");
}

static void device_json(cl_device_id dev, cl_uint p, cl_uint d, bool first)
{
    char name[256] = "", vendor[256] = "", version[256] = "", driver[256] = "";
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
    printf("%s\n        {\"index\": %u, \"selector\": \"%u:%u\", \"name\": ", first ? "" : ",", d, p, d);
    json_str(name);
    printf(", \"type\": ");
    json_str(type_name(t));
    printf(", \"vendor\": ");
    json_str(vendor);
    printf(", \"version\": ");
    json_str(version);
    printf(", \"driver\": ");
    json_str(driver);
    printf(", \"compute_units\": %u, \"global_memory_bytes\": %llu, \"local_memory_bytes\": %llu, "
           "\"max_work_group_size\": %zu}",
           units, (unsigned long long)global, (unsigned long long)local, wg);
}

int main(int argc, char **argv)
{
    const char *selector = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            selector = argv[++i];
        } else if (!strcmp(argv[i], "--json")) {
            json = true;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (json) {
        printf("{\n  \"moecl_version\": ");
        json_str(moecl_version());
        printf(",\n  \"platforms\": [");
    } else {
        printf("moecl %s\n\nOpenCL devices (select with \"P:D\", \"gpu\", \"cpu\" or a name substring):\n",
               moecl_version());
    }
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
        if (json) {
            printf("%s\n    {\"index\": %u, \"name\": ", p ? "," : "", p);
            json_str(pname);
            printf(", \"vendor\": ");
            json_str(pvendor);
            printf(", \"version\": ");
            json_str(pversion);
            printf(", \"devices\": [");
        }
        for (cl_uint d = 0; d < nd && d < 64; d++) {
            if (json) {
                device_json(devices[d], p, d, d == 0);
                continue;
            }
            char dname[256] = "";
            cl_device_type t = 0;
            clGetDeviceInfo(devices[d], CL_DEVICE_NAME, sizeof(dname), dname, NULL);
            clGetDeviceInfo(devices[d], CL_DEVICE_TYPE, sizeof(t), &t, NULL);
            printf("  %u:%u  %-11s  %s / %s\n", p, d, type_name(t), pname, dname);
        }
        if (json)
            printf("%s]}", nd ? "\n      " : "");
    }
    if (json)
        printf("%s],\n", np ? "\n  " : "");
    else if (np == 0)
        printf("  (none)\n");

    const char *env = getenv("MOECL_DEVICE");
    const char *why = selector ? "the --device selector"
                      : env && *env ? "$MOECL_DEVICE"
                                    : "the default rule: first GPU/accelerator, else first CPU";
    if (json) {
        printf("  \"selection\": {\"selector\": ");
        json_str(selector ? selector : env && *env ? env : NULL);
        printf(", \"by\": ");
        json_str(selector ? "--device" : env && *env ? "MOECL_DEVICE" : "default");
        printf("},\n");
    }
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(selector, &ctx);
    if (st != MOECL_SUCCESS) {
        if (json) {
            char err[1024];
            snprintf(err, sizeof(err), "%s: %s", moecl_status_string(st), moecl_context_error(NULL));
            printf("  \"picked\": null,\n  \"error\": ");
            json_str(err);
            printf("\n}\n");
        } else {
            printf("\nmoecl picks no device: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        }
        return 1;
    }
    /* The whole description, however long the paths in it. */
    size_t need = moecl_context_describe(ctx, NULL, 0);
    char *text = malloc(need + 1), *copy = malloc(need + 1);
    if (!text || !copy) {
        free(text);
        free(copy);
        moecl_context_destroy(ctx);
        return 1;
    }
    moecl_context_describe(ctx, text, need + 1);
    moecl_context_destroy(ctx);
    if (json) {
        memcpy(copy, text, need + 1);
        printf("  \"picked\": {");
        bool first = true;
        char *save = NULL;
        for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
            json_describe_line(line, &first);
        json_launch_lines(copy);
        printf("\n  },\n  \"error\": null\n}\n");
        free(text);
        free(copy);
        return 0;
    }
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
    free(copy);
    return 0;
}
