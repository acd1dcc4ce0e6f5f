/* Forcing a kernel variant: the process-wide override that tests and tools
 * set (CLBlast's OverrideParameters plays this part there). The library
 * reads no environment variable for it: a context takes a copy of the
 * override when it is created, and every later decision reads that copy
 * (moecl_device_info.env). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static pthread_mutex_t override_lock = PTHREAD_MUTEX_INITIALIZER;
static moecl_launch_env current; /* all zero: nothing forced */

/* 1 + the index of value among names, or 0. */
static int named(const char *value, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (strcmp(value, names[i]) == 0)
            return i + 1;
    return 0;
}

/* An unsigned in [lo, hi], a power of two where pow2; false otherwise. */
static bool number(const char *value, unsigned long lo, unsigned long hi, bool pow2, unsigned *out)
{
    char *end;
    if (!*value || *value == '-' || *value == '+')
        return false;
    const unsigned long v = strtoul(value, &end, 10);
    if (*end || v < lo || v > hi || (pow2 && (v & (v - 1))))
        return false;
    *out = (unsigned)v;
    return true;
}

static moecl_status bad(const char *word, const char *why)
{
    return moecl_fail(NULL, MOECL_ERROR_INVALID_ARGUMENT, "variant override: '%s': %s", word, why);
}

moecl_status moecl_override_parse(const char *text, moecl_launch_env *env)
{
    memset(env, 0, sizeof(*env));
    env->grounded_tile = (moecl_launch_config){MOECL_KERNEL_ROWS, 1, 0, 0, {0}};
    if (!text)
        return MOECL_SUCCESS;
    /* The tiled configuration's words, gathered in the tune file's syntax. */
    char tile[256] = "kernel=tiled";
    size_t tile_len = strlen(tile);
    bool tiled = false;
    char word[128];
    for (const char *p = text;;) {
        p += strspn(p, " \t");
        if (!*p)
            break;
        const size_t n = strcspn(p, " \t");
        if (n >= sizeof(word))
            return bad(p, "too long");
        memcpy(word, p, n);
        word[n] = '\0';
        p += n;
        char *eq = strchr(word, '=');
        if (!eq)
            return bad(word, "expected name=value");
        *eq = '\0';
        const char *name = word, *value = eq + 1;
        static const char *const classes[] = {"cpu", "gpu"};
        static const char *const align_paths[] = {"one-group", "fused", "chunked", "fused-parallel"};
        static const char *const ep_paths[] = {"chunked", "fused", "fused-last"};
        static const char *const on_off[] = {"on", "off"};
        static const char *const tile_words[] = {"tn", "tk", "mt", "nt", "vec", "db", "wc"};
        int k;
        if (strcmp(name, "class") == 0) {
            if (!(k = named(value, classes, 2)))
                return bad(value, "class is cpu or gpu");
            env->launch_class_forced = true;
            env->launch_class = k == 1 ? MOECL_LAUNCH_CPU : MOECL_LAUNCH_GPU;
        } else if (strcmp(name, "team") == 0) {
            if (!number(value, 2, 256, true, &env->team))
                return bad(value, "team is a power of two 2..256");
        } else if (strcmp(name, "align") == 0) {
            if (!(k = named(value, align_paths, 4)))
                return bad(value, "align is one-group, fused, chunked or fused-parallel");
            env->align_path = (moecl_align_path)k;
        } else if (strcmp(name, "ep") == 0) {
            if (!(k = named(value, ep_paths, 3)))
                return bad(value, "ep is chunked, fused or fused-last");
            env->ep_path = (moecl_ep_path)k;
        } else if (strcmp(name, "ep_wg") == 0) {
            if (!number(value, 32, 1024, true, &env->ep_fused_wg))
                return bad(value, "ep_wg is a power of two 32..1024");
        } else if (strcmp(name, "ep_groups") == 0) {
            if (!number(value, 1, 127, false, &env->ep_fused_groups))
                return bad(value, "ep_groups is 1..127");
        } else if (strcmp(name, "binaries") == 0) {
            if (!(k = named(value, on_off, 2)))
                return bad(value, "binaries is on or off");
            env->binaries = k == 1 ? 1 : -1;
        } else if (strcmp(name, "table") == 0) {
            /* In moecl_vendor's order, from MOECL_VENDOR_NVIDIA. */
            static const char *const vendors[] = {"nvidia", "amd", "intel", "pocl", "rusticl"};
            if (!(k = named(value, vendors, 5)))
                return bad(value, "table is nvidia, amd, intel, pocl or rusticl");
            env->table_vendor = (moecl_vendor)k;
        } else if (strcmp(name, "grounded") == 0) {
            static const char *const grounded_kernels[] = {"mma", "splitk"};
            if (!(k = named(value, grounded_kernels, 2)))
                return bad(value, "grounded is mma or splitk");
            env->grounded_mma = k == 1;
            env->grounded_splitk = k == 2;
        } else if (strcmp(name, "kchunk") == 0) {
            if (!number(value, 16, 8192, true, &env->splitk_chunk))
                return bad(value, "kchunk is a power of two 16..8192");
        } else if (strcmp(name, "tile") == 0 && strcmp(value, "128") == 0 && !tiled) {
            env->grounded_wide_tile = true;
        } else if (strcmp(name, "tile") == 0 || named(name, tile_words, 7)) {
            tiled |= strcmp(name, "tile") == 0;
            const int w = snprintf(tile + tile_len, sizeof(tile) - tile_len, " %s=%s", name, value);
            if (w < 0 || (size_t)w >= sizeof(tile) - tile_len)
                return bad(name, "too long");
            tile_len += (size_t)w;
        } else {
            return bad(name, "unknown name (class, team, align, ep, ep_wg, ep_groups, binaries, table, grounded, "
                             "kchunk, tile, tn, tk, mt, nt, vec, db, wc)");
        }
    }
    if (tile_len > strlen("kernel=tiled")) {
        if (!tiled || env->grounded_wide_tile)
            return bad(text, "a tiled configuration starts with tile=N (tile=128 alone: the wide tile first)");
        if (!moecl_launch_config_parse(tile, &env->grounded_tile))
            return bad(tile + strlen("kernel=tiled "), "not a tiled configuration the tune file accepts");
    }
    return MOECL_SUCCESS;
}

moecl_status moecl_override_set(const char *text)
{
    moecl_launch_env env;
    const moecl_status st = moecl_override_parse(text, &env);
    if (st != MOECL_SUCCESS)
        return st;
    pthread_mutex_lock(&override_lock);
    current = env;
    pthread_mutex_unlock(&override_lock);
    return MOECL_SUCCESS;
}

void moecl_override_get(moecl_launch_env *env)
{
    pthread_mutex_lock(&override_lock);
    *env = current;
    pthread_mutex_unlock(&override_lock);
}
