/* The kernel variants the library builds on GPUs that are not here, for the
 * portability suite (tests/portability.py compiles them offline).
 *
 * For each target in the table below, a moecl_device_info is fabricated
 * with the facts the runtime would query on such a device (vendor, local
 * memory, maximum work-group size) in each launch class and with each
 * team top-k method; for each specialisation in the lists below, the
 * library's own functions give the build options and -D defines the
 * runtime would pass there (moecl_build_options,
 * moecl_topk_gating_defines, moecl_topk_gating_replay_defines,
 * moecl_grounded_router_defines: the code path of the ops' prepare). The program text is moecl_program_source's, so
 * MOECL_KERNEL_DIR applies as at run time.
 *
 * Usage: portability_variants OUTDIR
 * Writes OUTDIR/topk_gating.cl, OUTDIR/grounded_router.cl,
 * OUTDIR/moe_align.cl, OUTDIR/route_dispatch.cl, OUTDIR/ep_layout.cl,
 * OUTDIR/grounded_dispatch.cl and OUTDIR/replay.cl (the program texts)
 * and OUTDIR/manifest.tsv, one
 * compile per line, identical ones (same compiler, target, program and
 * options) once:
 *   compiler  target  device-config  program-file  kernel-name(s)  options  description
 * (kernel-names comma-separated where one program serves several: moe_align's
 * four kernels)
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "internal.h"

/* ---- the devices ---- */

typedef struct target {
    const char *compiler; /* "ocloc" or "clang" (tests/portability.py runs them) */
    const char *arch;     /* ocloc -device, clang -mcpu */
    const char *config;   /* the device facts, in words */
    moecl_vendor vendor;
    cl_ulong local_mem_size;
    size_t max_work_group_size;
} target;

/* Intel: CL_DEVICE_LOCAL_MEM_SIZE and CL_DEVICE_MAX_WORK_GROUP_SIZE as the
 * Intel compute runtime reports them (Arc A-series dg2 and Data Center GPU
 * Max pvc 1024 work-items; Xe-LP integrated tgllp 512). AMD: 64 KiB of LDS
 * a work-group on CDNA2/3 and RDNA2/3; ROCm's OpenCL reports 256 as the
 * maximum work-group size, and 1024 is what the hardware allows, so both
 * are listed (the launch shapes chosen today use at most 256 work-items,
 * so both give the same variants, each compiled once). */
static const target targets[] = {
    {"ocloc", "dg2", "Intel GPU dg2-like: 64 KiB local, max WG 1024", MOECL_VENDOR_INTEL, 65536, 1024},
    {"ocloc", "pvc", "Intel GPU pvc-like: 128 KiB local, max WG 1024", MOECL_VENDOR_INTEL, 131072, 1024},
    {"ocloc", "tgllp", "Intel GPU tgllp-like: 64 KiB local, max WG 512", MOECL_VENDOR_INTEL, 65536, 512},
    {"clang", "gfx90a", "AMD GPU: 64 KiB local, max WG 1024", MOECL_VENDOR_AMD, 65536, 1024},
    {"clang", "gfx90a", "AMD GPU: 64 KiB local, max WG 256", MOECL_VENDOR_AMD, 65536, 256},
    {"clang", "gfx940", "AMD GPU: 64 KiB local, max WG 1024", MOECL_VENDOR_AMD, 65536, 1024},
    {"clang", "gfx940", "AMD GPU: 64 KiB local, max WG 256", MOECL_VENDOR_AMD, 65536, 256},
    {"clang", "gfx1030", "AMD GPU: 64 KiB local, max WG 1024", MOECL_VENDOR_AMD, 65536, 1024},
    {"clang", "gfx1030", "AMD GPU: 64 KiB local, max WG 256", MOECL_VENDOR_AMD, 65536, 256},
    {"clang", "gfx1100", "AMD GPU: 64 KiB local, max WG 1024", MOECL_VENDOR_AMD, 65536, 1024},
    {"clang", "gfx1100", "AMD GPU: 64 KiB local, max WG 256", MOECL_VENDOR_AMD, 65536, 256},
};

/* The per-device configurations a device of a target can be in: the GPU
 * launch class (its default), the CPU launch class (the variant
 * override's class=cpu), the 128-token grounded tile (tile=128) and the
 * grounded router's tensor-core kernel (grounded=mma: emulated, as these
 * devices build it; the PTX itself needs NVIDIA's compiler) and its
 * split-K kernel (grounded=splitk). The last three change only the
 * grounded router. */
typedef struct config {
    const char *name;
    moecl_launch_class launch_class;
    bool grounded_wide_tile, grounded_mma, grounded_splitk;
} config;

static const config configs[] = {
    {"gpu class", MOECL_LAUNCH_GPU, false, false, false},
    {"cpu class", MOECL_LAUNCH_CPU, false, false, false},
    {"gpu class, 128-token grounded tile", MOECL_LAUNCH_GPU, true, false, false},
    {"gpu class, grounded mma kernel", MOECL_LAUNCH_GPU, false, true, false},
    {"gpu class, grounded split-K kernel", MOECL_LAUNCH_GPU, false, false, true},
};

static bool grounded_only(const config *c) { return c->grounded_wide_tile || c->grounded_mma || c->grounded_splitk; }

static moecl_device_info fabricate(const target *t, const config *c)
{
    moecl_device_info info;
    memset(&info, 0, sizeof(info));
    snprintf(info.platform_name, sizeof(info.platform_name), "%s", t->vendor == MOECL_VENDOR_INTEL
                                                                        ? "Intel(R) OpenCL Graphics"
                                                                        : "AMD Accelerated Parallel Processing");
    snprintf(info.device_name, sizeof(info.device_name), "%s", t->arch);
    info.type = CL_DEVICE_TYPE_GPU;
    info.vendor = t->vendor;
    info.compute_units = 64;
    info.local_mem_size = t->local_mem_size;
    info.max_work_group_size = t->max_work_group_size;
    info.launch_class = c->launch_class;
    info.launch_reason = c->name;
    info.env.grounded_wide_tile = c->grounded_wide_tile;
    info.env.grounded_mma = c->grounded_mma;
    info.env.grounded_splitk = c->grounded_splitk;
    return info;
}

/* ---- the specialisations ---- */

/* A top-k gating specialisation. Every expert count, top_k, grouping,
 * dtype, scoring, bias and renormalisation setting of the brief occurs, in
 * combinations the runtime accepts (groups divide the experts and hold
 * top_k). In the GPU class E=7 gets the rows kernel (a team of one) and
 * E=4096 with 8 groups at k=64 runs out of 64 KiB of local memory and
 * falls back to it too; the other eleven get the team kernel, with teams
 * of 16, 32 and 256 (linear and tree reductions) and every value of every
 * other axis among them. */
typedef struct topk_spec {
    unsigned experts, k, groups, topk_group;
    moecl_group_score group_score;
    moecl_dtype dtype;
    moecl_scoring scoring;
    bool bias, renormalize;
} topk_spec;

#define NONE 0, 0, MOECL_GROUP_SCORE_MAX
#define MAX8 8, 4, MOECL_GROUP_SCORE_MAX
#define TOP2 8, 4, MOECL_GROUP_SCORE_TOP2_SUM
#define SOFTMAX MOECL_SCORING_SOFTMAX
#define SIGMOID MOECL_SCORING_SIGMOID
static const topk_spec topk_specs[] = {
    {7, 1, NONE, MOECL_F32, SOFTMAX, false, false},     {7, 7, NONE, MOECL_BF16, SIGMOID, true, true},
    {128, 8, NONE, MOECL_F16, SOFTMAX, true, false},    {128, 64, MAX8, MOECL_BF16, SIGMOID, false, true},
    {128, 1, TOP2, MOECL_F32, SIGMOID, true, true},     {256, 8, TOP2, MOECL_F32, SIGMOID, true, true},
    {256, 1, MAX8, MOECL_F16, SOFTMAX, false, false},   {256, 64, NONE, MOECL_BF16, SOFTMAX, false, true},
    {4096, 8, TOP2, MOECL_F16, SIGMOID, true, false},   {4096, 64, MAX8, MOECL_F32, SOFTMAX, true, true},
    {4096, 1, NONE, MOECL_BF16, SIGMOID, false, false}, {4096, 64, NONE, MOECL_F16, SOFTMAX, false, true},
    {4096, 8, NONE, MOECL_F32, SOFTMAX, true, false},
};
/* The descriptor of spec s (one token). */
static moecl_topk_gating_desc topk_desc_of(const topk_spec *s)
{
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, s->experts, s->k);
    d.num_expert_groups = s->groups;
    d.topk_group = s->topk_group;
    d.group_score = s->group_score;
    d.gating_dtype = s->dtype;
    d.scoring = s->scoring;
    d.renormalize = s->renormalize;
    return d;
}

/* Indices into topk_specs of the specs also compiled as counting variants
 * (moecl_topk_gating_with_counts), in every class: E=7 k=1 (the rows
 * kernel in every class), E=128 k=8 softmax with bias, E=256 k=8
 * DeepSeek-V3-like grouped, E=4096 k=64 softmax without bias. (The rows
 * kernel's softmax fast path is built for CPU devices only, which these
 * targets are not.) */
static const size_t counts_specs[] = {0, 2, 5, 11};
/* Indices into topk_specs of the specs also compiled with the peers'
 * conventions, the zero fill of dropped groups and llama.cpp's
 * renormalisation floor (-DGROUP_FILL=1 -DRENORM_FLOOR=...): grouped in
 * the team kernel without and with a bias (E=128 k=64, E=256 k=8) and at
 * E=4096 (the rows kernel where local memory runs out), and the rows
 * kernel at E=7 (the floor only: no groups). */
static const size_t convention_specs[] = {1, 3, 5, 9};

/* The replay kernels' conventions (cl/replay.cl), on the convention specs
 * in turn: each scoring with a weighting (softmax and raw only with the
 * weightings of the chosen), and each renormalisation rule (none, the
 * floor, renormalize_eps). */
typedef struct replay_convention {
    moecl_scoring scoring;
    moecl_weighting weighting;
    bool renormalize;
    float floor, eps;
} replay_convention;

static const replay_convention replay_conventions[] = {
    {MOECL_SCORING_SQRTSOFTPLUS, MOECL_WEIGHTS_SCORE, true, 0.0f, 1e-20f},
    {MOECL_SCORING_RAW, MOECL_WEIGHTS_SOFTMAX_CHOSEN, true, 6.103515625e-5f, 0.0f},
    {MOECL_SCORING_SIGMOID, MOECL_WEIGHTS_SIGMOID_CHOSEN, false, 0.0f, 0.0f},
    {MOECL_SCORING_SOFTMAX, MOECL_WEIGHTS_SOFTMAX_CHOSEN, true, 0.0f, 1e-20f},
};

#undef NONE
#undef MAX8
#undef TOP2
#undef SOFTMAX
#undef SIGMOID

/* A grounded router specialisation: hidden 128 and 4096; at hidden 128
 * expert tables small enough for the team kernel (7, 16, 64) and wider ones
 * for the tiled kernel (256; at hidden 4096 every table is tiled); each
 * dtype and each output set (0: the seed's pairs, 1: weights and ids,
 * 2: all three) in both kernels. */
typedef struct grounded_spec {
    unsigned hidden, experts, k;
    moecl_dtype dtype;
    unsigned outputs;
} grounded_spec;

static const grounded_spec grounded_specs[] = {
    {128, 16, 2, MOECL_F32, 0},  {128, 7, 1, MOECL_BF16, 1},      {128, 64, 8, MOECL_F16, 2},
    {128, 256, 64, MOECL_BF16, 0}, {4096, 16, 2, MOECL_F16, 0},   {4096, 256, 8, MOECL_F32, 1},
    {4096, 4096, 64, MOECL_BF16, 2},
};

/* The f32 precisions that run on tensor cores (the mma configuration). */
static const grounded_spec mma_f32_specs[] = {{4096, 256, 8, MOECL_F32, 1}, {100, 20, 4, MOECL_F32, 2}};
static const moecl_precision mma_f32_precisions[] = {MOECL_PRECISION_TF32, MOECL_PRECISION_3XTF32};

static const char *const dtype_names[] = {"f32", "f16", "bf16"};
static const char *const scoring_names[] = {"softmax", "sigmoid", "sqrtsoftplus", "raw"};

/* ---- output ---- */

typedef struct line {
    const char *compiler, *arch, *program, *options;
} line;

static line *lines;
static size_t num_lines, cap_lines;
static FILE *manifest;
static size_t num_specs;

static void *xmalloc(size_t n)
{
    void *p = malloc(n);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static char *xstrdup(const char *s)
{
    char *p = xmalloc(strlen(s) + 1);
    strcpy(p, s);
    return p;
}

/* One compile, unless the same one is listed already. */
static void emit(const target *t, const char *program, const char *build_options, const char *defines,
                 const char *kernel_name, const char *description)
{
    char options[2048];
    snprintf(options, sizeof(options), "%s %s", build_options, defines);
    num_specs++;
    /* The warp paths are inline PTX: only for NVIDIA. */
    static const char *const ptx[] = {"-DMOECL_PTX=1", "-DTEAM_SHUFFLE=1", "-DWARP_MATCH=1"};
    for (size_t i = 0; i < sizeof(ptx) / sizeof(ptx[0]); i++) {
        if (t->vendor != MOECL_VENDOR_NVIDIA && strstr(options, ptx[i])) {
            fprintf(stderr, "portability_variants: %s on %s (%s) for %s: %s\n", ptx[i] + 2, t->arch, t->config,
                    description, options);
            exit(1);
        }
    }
    for (size_t i = 0; i < num_lines; i++)
        if (strcmp(lines[i].compiler, t->compiler) == 0 && strcmp(lines[i].arch, t->arch) == 0 &&
            strcmp(lines[i].program, program) == 0 && strcmp(lines[i].options, options) == 0)
            return;
    if (num_lines == cap_lines) {
        cap_lines = cap_lines ? 2 * cap_lines : 256;
        line *grown = realloc(lines, cap_lines * sizeof(*lines));
        if (!grown) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
        lines = grown;
    }
    lines[num_lines++] = (line){t->compiler, t->arch, program, xstrdup(options)};
    fprintf(manifest, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t->compiler, t->arch, t->config, program, kernel_name, options,
            description);
}

static void write_program(const char *dir, moecl_program_kind kind, const char *name)
{
    /* moecl_program_source reads ctx->kernel_dir only (and records errors
     * against ctx): a context that is otherwise empty serves. */
    moecl_context ctx;
    memset(&ctx, 0, sizeof(ctx));
    const char *kernel_dir = getenv("MOECL_KERNEL_DIR");
    ctx.kernel_dir = kernel_dir && *kernel_dir ? (char *)kernel_dir : NULL;
    char *text;
    size_t size;
    if (moecl_program_source(&ctx, kind, &text, &size) != MOECL_SUCCESS) {
        fprintf(stderr, "portability_variants: %s\n", moecl_context_error(&ctx));
        exit(1);
    }
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(text, 1, size, f) != size || fclose(f) != 0) {
        fprintf(stderr, "portability_variants: cannot write %s: %s\n", path, strerror(errno));
        exit(1);
    }
    free(text);
}

/* moecl_topk_weights (given ids) and moecl_hash_routing (ids from the
 * table) for descriptor d: cl/replay.cl's kernel, whose shape is the one
 * top-k gating runs for d (what names the spec in words). */
static void emit_replay(const target *t, const char *options, const config *c, const moecl_device_info *info,
                        const moecl_topk_gating_desc *d, const char *what)
{
    for (unsigned mode = 1; mode <= 2; mode++) {
        char defines[512], description[512], renorm[64] = "";
        const char *kernel;
        moecl_topk_gating_replay_defines(info, d, mode, defines, sizeof(defines), &kernel);
        if (!strstr(defines, mode == 1 ? " -DREPLAY=1" : " -DREPLAY=2")) {
            fprintf(stderr, "portability_variants: the replay defines do not name REPLAY=%u: %s\n", mode, defines);
            exit(1);
        }
        if (d->renormalize)
            snprintf(renorm, sizeof(renorm), " renormalize%s%s", d->renormalize_floor > 0.0f ? " floor 2^-14" : "",
                     d->renormalize_eps > 0.0f ? " eps 1e-20" : "");
        snprintf(description, sizeof(description), "%s E=%u k=%u %s %s weighting %d%s groups=%u/%u %s[%s]",
                 mode == 1 ? "replay" : "hash_routing", d->num_experts, d->top_k, dtype_names[d->gating_dtype],
                 scoring_names[d->scoring], (int)d->weighting, renorm, d->num_expert_groups, d->topk_group, what,
                 c->name);
        emit(t, "replay.cl", options, defines, kernel, description);
    }
}

/* A grounded router specialisation at a precision, and
 * moecl_grounded_route_dispatch's one kernel (the team kernel with
 * moe_align's steps after its rows) where the rule gives the team kernel
 * (its defines do not depend on the outputs: the router's weights and
 * ids). */
static void emit_grounded(const target *t, const char *options, const config *c, const moecl_device_info *info,
                          const grounded_spec *s, moecl_precision precision, uint32_t shared)
{
    char defines[512], description[512], extra[32] = "";
    const char *kernel;
    const bool pairs = s->outputs != 1, weights = s->outputs != 0, ids = s->outputs != 0;
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(1, s->hidden, s->experts, 0.5f);
    d.top_k = s->k;
    d.hidden_dtype = s->dtype;
    d.precision = precision;
    d.num_shared_experts = shared;
    d.shared_expert_weight = 0.4f;
    if (shared)
        snprintf(extra, sizeof(extra), " shared %u", shared);
    moecl_grounded_router_defines(info, &d, pairs, weights, ids, defines, sizeof(defines), &kernel);
    snprintf(description, sizeof(description), "grounded_router H=%u E=%u k=%u %s%s%s outputs=%s [%s]", s->hidden,
             s->experts, s->k, dtype_names[s->dtype],
             precision == MOECL_PRECISION_TF32 ? " tf32" : precision == MOECL_PRECISION_3XTF32 ? " 3xtf32" : "",
             extra, s->outputs == 0 ? "pairs" : s->outputs == 1 ? "weights+ids" : "pairs+weights+ids", c->name);
    emit(t, "grounded_router.cl", options, defines, kernel, description);
    moecl_grounded_router_route_defines(info, &d, defines, sizeof(defines), &kernel);
    if (kernel) {
        snprintf(description, sizeof(description), "grounded_dispatch H=%u E=%u k=%u %s%s [%s]", s->hidden,
                 s->experts, s->k, dtype_names[s->dtype], extra, c->name);
        emit(t, "grounded_dispatch.cl", options, defines, kernel, description);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "portability_variants: cannot create %s: %s\n", dir, strerror(errno));
        return 1;
    }
    write_program(dir, MOECL_PROGRAM_TOPK_GATING, "topk_gating.cl");
    write_program(dir, MOECL_PROGRAM_GROUNDED_ROUTER, "grounded_router.cl");
    write_program(dir, MOECL_PROGRAM_MOE_ALIGN, "moe_align.cl");
    write_program(dir, MOECL_PROGRAM_ROUTE_DISPATCH, "route_dispatch.cl");
    write_program(dir, MOECL_PROGRAM_EP_LAYOUT, "ep_layout.cl");
    write_program(dir, MOECL_PROGRAM_GROUNDED_DISPATCH, "grounded_dispatch.cl");
    write_program(dir, MOECL_PROGRAM_REPLAY, "replay.cl");
    write_program(dir, MOECL_PROGRAM_PERMUTE, "permute.cl");
    char path[4096];
    snprintf(path, sizeof(path), "%s/manifest.tsv", dir);
    manifest = fopen(path, "w");
    if (!manifest) {
        fprintf(stderr, "portability_variants: cannot write %s: %s\n", path, strerror(errno));
        return 1;
    }

    for (size_t ti = 0; ti < sizeof(targets) / sizeof(targets[0]); ti++) {
        const target *t = &targets[ti];
        for (size_t ci = 0; ci < sizeof(configs) / sizeof(configs[0]); ci++) {
            const config *c = &configs[ci];
            const moecl_device_info info = fabricate(t, c);
            char *options = moecl_build_options(&info);
            if (!options) {
                fprintf(stderr, "out of memory\n");
                return 1;
            }
            char defines[512], description[512];
            const char *kernel;

            /* The wide-tile configuration changes only the grounded
             * router's tiled kernel. */
            for (size_t i = 0; !grounded_only(c) && i < sizeof(topk_specs) / sizeof(topk_specs[0]); i++) {
                const topk_spec *s = &topk_specs[i];
                moecl_topk_gating_desc d = topk_desc_of(s);
                moecl_topk_gating_defines(&info, &d, s->bias, false, defines, sizeof(defines), &kernel);
                snprintf(description, sizeof(description), "topk_gating E=%u k=%u %s %s%s groups=%s%s [%s]",
                         s->experts, s->k, dtype_names[s->dtype], s->scoring ? "sigmoid" : "softmax",
                         s->bias ? " bias" : "", s->groups ? (s->group_score ? "8/4 top2-sum" : "8/4 max") : "none",
                         s->renormalize ? " renormalize" : "", c->name);
                emit(t, "topk_gating.cl", options, defines, kernel, description);
                /* The plain entry points' defines never name HAS_COUNTS
                 * (their kernels and cache entries do not depend on it). */
                if (strstr(defines, "HAS_COUNTS")) {
                    fprintf(stderr, "portability_variants: the plain variant names HAS_COUNTS: %s\n", defines);
                    exit(1);
                }
            }

            /* The zero fill and the floor, appended to the plain defines
             * only when set (so that the other variants' defines and cache
             * entries do not depend on them). */
            for (size_t i = 0; !grounded_only(c) && i < sizeof(convention_specs) / sizeof(convention_specs[0]);
                 i++) {
                const topk_spec *s = &topk_specs[convention_specs[i]];
                moecl_topk_gating_desc d = topk_desc_of(s);
                d.scoring = s->scoring;
                d.renormalize = true;
                d.group_fill = MOECL_GROUP_FILL_ZERO;
                d.renormalize_floor = 6.103515625e-5f;
                moecl_topk_gating_defines(&info, &d, s->bias, false, defines, sizeof(defines), &kernel);
                if (!strstr(defines, " -DRENORM_FLOOR=0x1p-14f") || !s->groups != !strstr(defines, " -DGROUP_FILL=1")) {
                    fprintf(stderr, "portability_variants: the conventions' defines are missing: %s\n", defines);
                    exit(1);
                }
                snprintf(description, sizeof(description),
                         "topk_gating E=%u k=%u %s %s%s groups=%s%s renormalize floor 2^-14 [%s]", s->experts, s->k,
                         dtype_names[s->dtype], s->scoring ? "sigmoid" : "softmax", s->bias ? " bias" : "",
                         s->groups ? (s->group_score ? "8/4 top2-sum" : "8/4 max") : "none",
                         s->groups ? " zero fill" : "", c->name);
                emit(t, "topk_gating.cl", options, defines, kernel, description);
            }

            /* The scorings and weightings of cl/gating.cl: on
             * the convention specs, sqrt(softplus) and raw selection with
             * each chosen weighting. */
            for (size_t i = 0; i < sizeof(convention_specs) / sizeof(convention_specs[0]); i++) {
                const topk_spec *s = &topk_specs[convention_specs[i]];
                moecl_topk_gating_desc d = topk_desc_of(s);
                d.scoring = i % 2 ? MOECL_SCORING_RAW : MOECL_SCORING_SQRTSOFTPLUS;
                d.weighting = (moecl_weighting)(1 + i % 2);
                d.renormalize = true;
                moecl_topk_gating_defines(&info, &d, s->bias, false, defines, sizeof(defines), &kernel);
                snprintf(description, sizeof(description), "topk_gating E=%u k=%u %s %s weighting %d%s groups=%s [%s]",
                         s->experts, s->k, dtype_names[s->dtype], i % 2 ? "raw" : "sqrtsoftplus", (int)d.weighting,
                         s->bias ? " bias" : "", s->groups ? "8/4" : "none", c->name);
                emit(t, "topk_gating.cl", options, defines, kernel, description);
            }

            /* The output and bias dtypes (STORE_WEIGHT, STORE_ID,
             * LOAD_BIAS of cl/gating.cl): on the convention specs, f16 or
             * bf16 weights, int64 ids and an f16 or bf16 bias, each named
             * in the defines only where set. */
            for (size_t i = 0; i < sizeof(convention_specs) / sizeof(convention_specs[0]); i++) {
                const topk_spec *s = &topk_specs[convention_specs[i]];
                moecl_topk_gating_desc d = topk_desc_of(s);
                moecl_topk_gating_defines(&info, &d, s->bias, false, defines, sizeof(defines), &kernel);
                if (strstr(defines, "WEIGHTS_DTYPE") || strstr(defines, "IDS_DTYPE") || strstr(defines, "BIAS_DTYPE")) {
                    fprintf(stderr, "portability_variants: a default variant names a dtype: %s\n", defines);
                    exit(1);
                }
                d.weights_dtype = i % 2 ? MOECL_BF16 : MOECL_F16;
                d.ids_dtype = MOECL_I64;
                d.bias_dtype = i % 2 ? MOECL_F16 : MOECL_BF16;
                moecl_topk_gating_defines(&info, &d, s->bias, false, defines, sizeof(defines), &kernel);
                snprintf(description, sizeof(description), "topk_gating E=%u k=%u %s weights %s ids i64%s%s [%s]",
                         s->experts, s->k, dtype_names[s->dtype], dtype_names[d.weights_dtype],
                         s->bias ? " bias " : "", s->bias ? dtype_names[d.bias_dtype] : "", c->name);
                emit(t, "topk_gating.cl", options, defines, kernel, description);
            }

            /* moecl_topk_gating_with_counts: the counting variant of a few
             * specs (and moecl_route_dispatch's), so that each kernel (rows, with and without the
             * softmax fast path; team, plain and grouped) compiles with
             * the histogram argument. */
            for (size_t i = 0; !grounded_only(c) && i < sizeof(counts_specs) / sizeof(counts_specs[0]); i++) {
                const topk_spec *s = &topk_specs[counts_specs[i]];
                moecl_topk_gating_desc d = topk_desc_of(s);
                char plain[512];
                moecl_topk_gating_defines(&info, &d, s->bias, false, plain, sizeof(plain), &kernel);
                moecl_topk_gating_defines(&info, &d, s->bias, true, defines, sizeof(defines), &kernel);
                if (strncmp(defines, plain, strlen(plain)) != 0 || strcmp(defines + strlen(plain), " -DHAS_COUNTS=1")) {
                    fprintf(stderr, "portability_variants: counting defines '%s' are not the plain '%s' + HAS_COUNTS\n",
                            defines, plain);
                    exit(1);
                }
                snprintf(description, sizeof(description), "topk_gating with counts E=%u k=%u %s %s%s groups=%s [%s]",
                         s->experts, s->k, dtype_names[s->dtype], s->scoring ? "sigmoid" : "softmax",
                         s->bias ? " bias" : "", s->groups ? (s->group_score ? "8/4 top2-sum" : "8/4 max") : "none",
                         c->name);
                emit(t, "topk_gating.cl", options, defines, kernel, description);
                /* moecl_topk_gating_ex with every optional tensor, the
                 * captured ids' dtype in turn. */
                static const moecl_index_dtype captures[] = {MOECL_I16, MOECL_I32, MOECL_I64};
                const moecl_index_dtype cap = captures[i % 3];
                moecl_topk_gating_ex_defines(&info, &d, s->bias, cap, defines, sizeof(defines), &kernel);
                snprintf(description, sizeof(description),
                         "topk_gating ex (capture %s, scale, valid, load) E=%u k=%u %s %s%s groups=%s [%s]",
                         cap == MOECL_I16 ? "i16" : cap == MOECL_I32 ? "i32" : "i64", s->experts, s->k,
                         dtype_names[s->dtype], s->scoring ? "sigmoid" : "softmax", s->bias ? " bias" : "",
                         s->groups ? (s->group_score ? "8/4 top2-sum" : "8/4 max") : "none", c->name);
                emit(t, "topk_gating.cl", options, defines, kernel, description);
                /* moecl_route_dispatch's one kernel for the same spec (the
                 * team kernel with moe_align's steps after its rows), where
                 * the rule gives it the team kernel. */
                /* moecl_route_dispatch_ex's load counter and valid count
                 * too, on the specs without a bias. */
                for (int ex = 0; ex < (s->bias ? 1 : 2); ex++) {
                    moecl_topk_gating_route_defines(&info, &d, s->bias, ex, ex, defines, sizeof(defines), &kernel);
                    if (!kernel)
                        continue;
                    snprintf(description, sizeof(description), "route_dispatch E=%u k=%u %s %s%s%s groups=%s [%s]",
                             s->experts, s->k, dtype_names[s->dtype], s->scoring ? "sigmoid" : "softmax",
                             s->bias ? " bias" : "", ex ? " load valid" : "",
                             s->groups ? (s->group_score ? "8/4 top2-sum" : "8/4 max") : "none", c->name);
                    emit(t, "route_dispatch.cl", options, defines, kernel, description);
                }
            }

            /* Shared experts (SHARED, SHARED_WEIGHT): named in the defines
             * only where set, with and without counts, and in
             * moecl_route_dispatch's one kernel. */
            for (size_t i = 0; !grounded_only(c) && i < sizeof(counts_specs) / sizeof(counts_specs[0]); i++) {
                const topk_spec *s = &topk_specs[counts_specs[i]];
                moecl_topk_gating_desc d = topk_desc_of(s);
                char plain[512];
                moecl_topk_gating_defines(&info, &d, s->bias, false, plain, sizeof(plain), &kernel);
                d.num_shared_experts = 1 + (uint32_t)(i % 2);
                d.shared_expert_weight = 0.4f;
                moecl_topk_gating_defines(&info, &d, s->bias, i % 2 == 1, defines, sizeof(defines), &kernel);
                const char *count = d.num_shared_experts == 1 ? " -DSHARED=1" : " -DSHARED=2";
                if (strstr(plain, "SHARED") || !strstr(defines, count) || !strstr(defines, " -DSHARED_WEIGHT=")) {
                    fprintf(stderr, "portability_variants: shared-expert defines '%s' (plain '%s')\n", defines, plain);
                    exit(1);
                }
                snprintf(description, sizeof(description), "topk_gating shared %u%s E=%u k=%u %s %s%s groups=%s [%s]",
                         d.num_shared_experts, i % 2 ? " with counts" : "", s->experts, s->k, dtype_names[s->dtype],
                         s->scoring ? "sigmoid" : "softmax", s->bias ? " bias" : "", s->groups ? "8/4" : "none",
                         c->name);
                emit(t, "topk_gating.cl", options, defines, kernel, description);
                moecl_topk_gating_route_defines(&info, &d, s->bias, false, false, defines, sizeof(defines), &kernel);
                if (kernel) {
                    snprintf(description, sizeof(description), "route_dispatch shared %u E=%u k=%u %s [%s]",
                             d.num_shared_experts, s->experts, s->k, dtype_names[s->dtype], c->name);
                    emit(t, "route_dispatch.cl", options, defines, kernel, description);
                }
            }

            /* Replay and hash routing: every top-k spec (the bias has no
             * place: it steers selection only), the conventions on the
             * convention specs, and DeepSeek-V4's preset (384 experts top
             * 6, sqrt(softplus), renormalize_eps), whose hash layers are
             * what hash routing serves, in f32 and bf16. */
            for (size_t i = 0; !grounded_only(c) && i < sizeof(topk_specs) / sizeof(topk_specs[0]); i++) {
                const moecl_topk_gating_desc d = topk_desc_of(&topk_specs[i]);
                emit_replay(t, options, c, &info, &d, "");
            }
            for (size_t i = 0; !grounded_only(c) && i < sizeof(convention_specs) / sizeof(convention_specs[0]);
                 i++) {
                const replay_convention *rc = &replay_conventions[i];
                moecl_topk_gating_desc d = topk_desc_of(&topk_specs[convention_specs[i]]);
                d.scoring = rc->scoring;
                d.weighting = rc->weighting;
                d.renormalize = rc->renormalize;
                d.renormalize_floor = rc->floor;
                d.renormalize_eps = rc->eps;
                emit_replay(t, options, c, &info, &d, "");
            }
            for (int dt = 0; !grounded_only(c) && dt < 2; dt++) {
                moecl_topk_gating_desc d;
                if (moecl_topk_gating_desc_preset("deepseek-v4", 1, &d) != MOECL_SUCCESS) {
                    fprintf(stderr, "portability_variants: no deepseek-v4 preset\n");
                    exit(1);
                }
                d.gating_dtype = dt ? MOECL_BF16 : MOECL_F32;
                emit_replay(t, options, c, &info, &d, "deepseek-v4 ");
            }

            for (size_t i = 0; i < sizeof(grounded_specs) / sizeof(grounded_specs[0]); i++)
                emit_grounded(t, options, c, &info, &grounded_specs[i], MOECL_PRECISION_FP32, 0);
            /* Shared experts (SHARED, SHARED_WEIGHT) on a team-sized and a
             * tiled spec (the mma configuration's kernel on the f16 one). */
            emit_grounded(t, options, c, &info, &grounded_specs[2], MOECL_PRECISION_FP32, 2);
            emit_grounded(t, options, c, &info, &grounded_specs[5], MOECL_PRECISION_FP32, 1);
            for (size_t i = 0; c->grounded_mma && i < sizeof(mma_f32_specs) / sizeof(mma_f32_specs[0]); i++)
                emit_grounded(t, options, c, &info, &mma_f32_specs[i], mma_f32_precisions[i], 0);

            /* moecl_router: the grounded router through the gating
             * pipeline, DeepSeek-V3's conventions (sigmoid, bias, groups
             * where the table divides by 8, renormalised, factor 2.5, no
             * router logits) and Llama 4's (raw selection, sigmoid of the
             * chosen, with logits), on each grounded spec. */
            for (size_t i = 0; i < sizeof(grounded_specs) / sizeof(grounded_specs[0]); i++) {
                const grounded_spec *s = &grounded_specs[i];
                for (int conv = 0; conv < 2; conv++) {
                    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(1, s->hidden, s->experts, 1.0f);
                    d.top_k = s->k;
                    d.hidden_dtype = s->dtype;
                    const bool grouped = conv == 0 && s->experts % 8 == 0 && s->k <= s->experts / 2;
                    if (conv == 0)
                        d.gating = (moecl_gating){MOECL_SCORING_SIGMOID, MOECL_WEIGHTS_SCORE, grouped ? 8 : 0,
                                                  grouped ? 4 : 0, MOECL_GROUP_SCORE_TOP2_SUM, MOECL_GROUP_FILL_NEG_INF,
                                                  true, 0.0f, 2.5f, 1e-20f};
                    else {
                        /* with g as a bf16 or f16 model has it: rounded,
                         * capped, one row of logits (a gate bias) */
                        d.gating.weighting = MOECL_WEIGHTS_SIGMOID_CHOSEN;
                        d.logits_dtype = i % 2 ? MOECL_F16 : MOECL_BF16;
                        d.logit_softcap = i % 3 == 0 ? 30.0f : 0.0f;
                        d.router_logits_row = i % 2 == 1;
                    }
                    moecl_router_defines(&info, &d, conv == 0, conv == 1, defines, sizeof(defines), &kernel);
                    snprintf(description, sizeof(description), "router H=%u E=%u k=%u %s %s [%s]", s->hidden,
                             s->experts, s->k, dtype_names[s->dtype],
                             conv == 0 ? (grouped ? "deepseek-v3 8/4 bias no-logits" : "sigmoid bias no-logits")
                                       : "llama4 raw sigmoid-chosen, rounded logits",
                             c->name);
                    emit(t, "grounded_router.cl", options, defines, kernel, description);
                    /* moecl_router_ex with every option (its defines after
                     * the variant's) and narrow types, on three specs. */
                    if (conv == 0 && (i == 0 || i == 2 || i == 5)) {
                        d.weights_dtype = MOECL_BF16;
                        d.ids_dtype = MOECL_I64;
                        d.bias_dtype = MOECL_F16;
                        /* on two specs shared experts, on one with their gate */
                        d.num_shared_experts = i == 0 ? 0 : i == 2 ? 1 : 2;
                        moecl_router_defines(&info, &d, true, false, defines, sizeof(defines), &kernel);
                        const size_t used = strlen(defines);
                        snprintf(defines + used, sizeof(defines) - used,
                                 " -DHAS_COUNTS=1 -DHAS_LOAD=1 -DHAS_VALID=1 -DCAPTURE=3 -DHAS_SCALE=1%s",
                                 i == 5 ? " -DSHARED_GATE=1" : "");
                        snprintf(description, sizeof(description),
                                 "router_ex H=%u E=%u k=%u %s bf16 weights, int64 ids, f16 bias, every option%s [%s]",
                                 s->hidden, s->experts, s->k, dtype_names[s->dtype],
                                 i == 0 ? "" : i == 2 ? ", a shared expert" : ", shared experts and their gate",
                                 c->name);
                        emit(t, "grounded_router.cl", options, defines, kernel, description);
                    }
                }
            }

            /* moe_align: one program of four kernels, whose defines
             * depend on the launch class and the maximum work-group size
             * only (the other configurations repeat these). */
            if (!grounded_only(c)) {
                moecl_moe_align_defines(&info, defines, sizeof(defines), &kernel);
                snprintf(description, sizeof(description), "moe_align [%s]",
                         c->launch_class == MOECL_LAUNCH_CPU ? "cpu class" : "gpu class");
                emit(t, "moe_align.cl", options, defines, kernel, description);
                /* The same program with the expert map (HAS_MAP). */
                moecl_moe_align_map_defines(&info, defines, sizeof(defines), &kernel);
                snprintf(description, sizeof(description), "moe_align expert map [%s]",
                         c->launch_class == MOECL_LAUNCH_CPU ? "cpu class" : "gpu class");
                emit(t, "moe_align.cl", options, defines, kernel, description);
                /* The layout's program: moe_align's source and defines,
                 * and the fused kernel's work-group. */
                snprintf(description, sizeof(description), "ep_layout [%s]",
                         c->launch_class == MOECL_LAUNCH_CPU ? "cpu class" : "gpu class");
                moecl_ep_layout_defines(&info, defines, sizeof(defines), &kernel);
                emit(t, "ep_layout.cl", options, defines, kernel, description);
                /* Permute (gather and scatter) and combine: every dtype
                 * pair, combine's shared rows each dtype in turn; the
                 * launch shape is an argument, so both classes build the
                 * same programs. */
                for (int in = 0; in < 3; in++)
                    for (int out = 0; out < 3; out++) {
                        moecl_permute_defines(false, (moecl_dtype)in, (moecl_dtype)out, -1, defines, sizeof(defines),
                                              &kernel);
                        /* Without shared rows one program serves the three. */
                        snprintf(description, sizeof(description), "permute, scatter and combine %s->%s",
                                 dtype_names[in], dtype_names[out]);
                        emit(t, "permute.cl", options, defines, "permute_rows,permute_scatter,combine_rows",
                             description);
                        const int shared = (in + out) % 3;
                        moecl_permute_defines(true, (moecl_dtype)in, (moecl_dtype)out, shared, defines,
                                              sizeof(defines), &kernel);
                        snprintf(description, sizeof(description), "combine %s->%s shared %s", dtype_names[in],
                                 dtype_names[out], shared < 0 ? "none" : dtype_names[shared]);
                        emit(t, "permute.cl", options, defines, kernel, description);
                    }
            }
            free(options);
        }
        /* Every tile of the grounded router's table (the override's
         * tile=... words name one) in the GPU class, on the first target of each
         * compiler, one shape each, the dtypes in turn (the tiles differ in
         * their defines only; the other targets compile the rule's); where
         * the target's local memory or work-group limit refuses one, the
         * rule's kernel compiles instead (a repeat, compiled once). */
        size_t tiles;
        const moecl_launch_config *tile = moecl_grounded_tile_configs(&tiles);
        const bool first_of_compiler = ti == 0 || strcmp(targets[ti - 1].compiler, t->compiler) != 0;
        for (size_t ti2 = 0; first_of_compiler && ti2 < tiles; ti2++) {
            moecl_device_info info = fabricate(t, &configs[0]);
            info.env.grounded_tile = tile[ti2];
            char *options = moecl_build_options(&info);
            if (!options) {
                fprintf(stderr, "out of memory\n");
                return 1;
            }
            static const grounded_spec tile_specs[] = {
                {4096, 256, 8, MOECL_F32, 1}, {203, 130, 8, MOECL_F16, 2}, {4096, 128, 8, MOECL_BF16, 0}};
            {
                const grounded_spec *s = &tile_specs[ti2 % (sizeof(tile_specs) / sizeof(tile_specs[0]))];
                moecl_grounded_router_desc d = moecl_grounded_router_desc_init(1, s->hidden, s->experts, 0.5f);
                d.top_k = s->k;
                d.hidden_dtype = s->dtype;
                char defines[512], description[512], text[128];
                const char *kernel;
                moecl_grounded_router_defines(&info, &d, s->outputs != 1, s->outputs != 0, s->outputs != 0, defines,
                                              sizeof(defines), &kernel);
                moecl_launch_config_text(&tile[ti2], text, sizeof(text));
                snprintf(description, sizeof(description), "grounded_router H=%u E=%u k=%u %s [gpu class, %s]",
                         s->hidden, s->experts, s->k, dtype_names[s->dtype], text);
                emit(t, "grounded_router.cl", options, defines, kernel, description);
            }
            free(options);
        }
    }
    if (fclose(manifest) != 0) {
        fprintf(stderr, "portability_variants: cannot write %s: %s\n", path, strerror(errno));
        return 1;
    }
    printf("%zu specialisations, %zu distinct compiles\n", num_specs, num_lines);
    return 0;
}
