/* Program text: cl/layout.h, then the embedded .cl sources or the files of
 * MOECL_KERNEL_DIR. The layout is always the embedded copy, even under
 * MOECL_KERNEL_DIR: the host sizes launches from the same header compiled
 * into the library (src/layout.c), so a kernel built from another copy
 * could disagree with the sizes it is launched with. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_source.h"

static const char *const program_files[][5] = {
    [MOECL_PROGRAM_TOPK_GATING] = {"common.cl", "gating.cl", "topk_gating.cl", NULL},
    [MOECL_PROGRAM_GROUNDED_ROUTER] = {"common.cl", "gating.cl", "grounded_router.cl", "router_mma.cl", NULL},
    [MOECL_PROGRAM_MOE_ALIGN] = {"moe_align.cl", NULL},
    [MOECL_PROGRAM_ROUTE_DISPATCH] = {"common.cl", "moe_align.cl", "gating.cl", "topk_gating.cl", NULL},
    [MOECL_PROGRAM_EP_LAYOUT] = {"moe_align.cl", "ep_layout.cl", NULL},
    [MOECL_PROGRAM_GROUNDED_DISPATCH] = {"common.cl", "moe_align.cl", "gating.cl", "grounded_router.cl", NULL},
    [MOECL_PROGRAM_REPLAY] = {"common.cl", "gating.cl", "replay.cl", NULL},
    [MOECL_PROGRAM_PERMUTE] = {"permute.cl", NULL},
};

static const moecl_embedded_source *embedded(const char *name)
{
    for (const moecl_embedded_source *s = moecl_embedded_sources; s->name; s++)
        if (strcmp(s->name, name) == 0)
            return s;
    return NULL;
}

/* Read dir/name whole; NULL on any failure. */
static char *read_file(const char *dir, const char *name, size_t *size)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    long len = -1;
    if (fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (buf = malloc((size_t)len + 1)) && fread(buf, 1, (size_t)len, f) == (size_t)len) {
        buf[len] = '\0';
        *size = (size_t)len;
    } else {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    return buf;
}

moecl_status moecl_program_source(const moecl_context *ctx, moecl_program_kind kind, char **text, size_t *size)
{
    const char *parts[5] = {NULL};
    size_t lengths[5] = {0};
    char *owned[5] = {NULL};
    moecl_status st = MOECL_SUCCESS;
    size_t total = 0;
    int n = 0;
    const moecl_embedded_source *layout = embedded("layout.h");
    if (!layout)
        return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED, "this build embeds no layout.h");
    parts[n] = layout->text;
    lengths[n] = layout->size;
    total += lengths[n++] + 1;
    for (int f = 0; program_files[kind][f]; f++, n++) {
        const char *name = program_files[kind][f];
        if (ctx->kernel_dir) {
            owned[n] = read_file(ctx->kernel_dir, name, &lengths[n]);
            parts[n] = owned[n];
            if (!parts[n]) {
                st = moecl_fail(ctx, MOECL_ERROR_BUILD, "MOECL_KERNEL_DIR is set but %s/%s cannot be read",
                                ctx->kernel_dir, name);
                break;
            }
        } else {
            const moecl_embedded_source *s = embedded(name);
            if (!s) {
                st = moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED, "this build embeds no %s", name);
                break;
            }
            parts[n] = s->text;
            lengths[n] = s->size;
        }
        total += lengths[n] + 1;
    }
    char *out = NULL;
    if (st == MOECL_SUCCESS) {
        out = malloc(total + 1);
        if (!out) {
            st = moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory reading kernel sources");
        } else {
            size_t at = 0;
            for (int i = 0; i < n; i++) {
                memcpy(out + at, parts[i], lengths[i]);
                at += lengths[i];
                out[at++] = '\n';
            }
            out[at] = '\0';
            *text = out;
            *size = at;
        }
    }
    for (int i = 0; i < 5; i++)
        free(owned[i]);
    return st;
}
