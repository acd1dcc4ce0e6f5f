/* The kernels' memory layout (cl/layout.h) against what the OpenCL
 * implementation reports for the compiled kernels.
 *
 * The variants are the portability suite's: tests/portability_variants
 * (its path in MOECL_TEST_VARIANTS) writes the manifest of every variant
 * the library builds on the Intel and AMD GPUs it describes, and each is
 * built here on the present device with the same -D defines. Variants that
 * differ only in defines the layout does not read (dtype, bias, outputs,
 * conventions, counts) are built once: the layout is a function of the
 * rest, so those compiles would test the same description again.
 *
 * Local memory: CL_KERNEL_LOCAL_MEM_SIZE of a kernel whose __local
 * arguments are not set counts the arrays compiled into it (an unset
 * __local argument counts 0). The rule:
 *   pocl: reported == described
 *   others: described <= reported <= described + 8 * (the kernel's arrays)
 *   NVIDIA also reports 1 for a kernel with no __local array at all.
 * pocl reports the plain sum of the arrays' sizes (a uchar[3] then a
 * ulong[5] report 43). Intel's CPU runtime aligns each array to its
 * element type (the same two report 48), which can add up to 7 bytes an
 * array, hence the allowance; for every kernel here it too reports the
 * plain sum. A description that misses an array, counts one twice or
 * sizes one wrong fails on pocl whatever the size; elsewhere when the
 * error exceeds the allowance.
 *
 * Private memory: pocl reports 1024 for every kernel, whatever its arrays
 * (a kernel with none reports 1024), so nothing is checked there. Intel's
 * CPU runtime reports the private arrays it keeps in memory (0 for a
 * kernel with none, 1024 for a float[256] indexed at run time). The
 * rule there, for the arrays the layout describes (those too large for
 * registers, LARGE_PRIVATE bytes and more): reported >= described, so a
 * description that leaves out or undersizes one fails, and that is the
 * side the host relies on (it refuses work-groups whose private arrays
 * overflow pocl's stacks, src/launch.c). No upper bound: for 8 of the
 * rows kernels Intel reports 17-18 times the description, which reads as
 * the arrays of the 16 work-items it vectorises together. NVIDIA reports
 * what its compiler keeps in local (stack) memory after promoting what it
 * can to registers, which can be less than the arrays (1200 for arrays of
 * 1260 on the H200): not checked there either. */
#include "harness.h"
#include "internal.h"

#include "../cl/layout.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define LARGE_PRIVATE 1024

/* The integer value of -DNAME=... in defines; fails the test if absent
 * and required. */
static long define_of(const char *defines, const char *name, long fallback)
{
    char pattern[64];
    snprintf(pattern, sizeof(pattern), "-D%s=", name);
    const char *at = defines;
    while ((at = strstr(at, pattern)) != NULL) {
        if (at == defines || at[-1] == ' ')
            return strtol(at + strlen(pattern), NULL, 0);
        at++;
    }
    return fallback;
}

typedef struct variant_line {
    moecl_program_kind kind;
    char *kernels;  /* comma-separated */
    char *defines;  /* the -D defines after the build options */
    char *key;      /* the kernel and the defines the layout reads */
    char *description;
} variant_line;

static variant_line *variants;
static size_t num_variants;

/* The defines each kernel's layout reads: the key that makes a variant
 * distinct here. */
static const char *const layout_defines[] = {"SCORING", "NUM_EXPERTS", "TOPK", "NUM_GROUPS", "TEAM", "ROWS", "EPT",
                                             "TEAM_SHUFFLE", "HIDDEN_DIM", "KERNEL", "TM", "TN",
                                             "TK", "MT", "NT", "WG", "SCAN_WG", "ONE_WG", "WARP_MATCH",
                                             "MOECL_PTX", "CPU_DEVICE", "ROUTE_DISPATCH", "FUSED_WG", "WEIGHTING"};

static char *layout_key(const char *kernels, const char *options)
{
    char key[1024];
    int at = snprintf(key, sizeof(key), "%s", kernels);
    for (size_t i = 0; i < sizeof(layout_defines) / sizeof(layout_defines[0]); i++)
        at += snprintf(key + at, sizeof(key) - (size_t)at, " %s=%ld", layout_defines[i],
                       define_of(options, layout_defines[i], -1));
    return strdup(key);
}

/* Run the generator into a fresh directory and read its manifest, keeping
 * the first variant of each layout key. */
static void load_variants(void)
{
    const char *generator = getenv("MOECL_TEST_VARIANTS");
    ck_assert_msg(generator && *generator, "MOECL_TEST_VARIANTS (tests/portability_variants) is not set: run the "
                                           "suite through `meson test`");
    const char *tmp = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s/moecl-layout-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    ck_assert_msg(mkdtemp(dir) != NULL, "mkdtemp(%s): %s", dir, strerror(errno));
    char out[4200];
    snprintf(out, sizeof(out), "%s/variants", dir);
    const pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        freopen("/dev/null", "w", stdout);
        execl(generator, generator, out, (char *)NULL);
        _exit(127);
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s %s failed", generator, out);

    char path[4300];
    snprintf(path, sizeof(path), "%s/manifest.tsv", out);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "cannot read %s", path);
    char line[8192];
    size_t cap = 0, listed = 0;
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        char *field[7];
        char *save = NULL, *p = line;
        int n = 0;
        for (char *tok; n < 7 && (tok = strtok_r(p, "\t", &save)); p = NULL)
            field[n++] = tok;
        ck_assert_msg(n == 7, "a manifest line has %d fields: %s", n, line);
        listed++;
        const char *options = field[5];
        /* The variant's defines follow the portability target's build
         * options, which end in -DMOECL_PTX=0 (the targets are not
         * NVIDIA's); the present device builds them with its own
         * options, PTX and native math where it has them. */
        const char *ptx = strstr(options, "-DMOECL_PTX=");
        const char *defines = ptx ? strchr(ptx, ' ') : NULL;
        ck_assert_msg(defines != NULL, "the variant's options '%s' have no -DMOECL_PTX= followed by defines", options);
        char *key = layout_key(field[4], options);
        bool seen = false;
        for (size_t i = 0; i < num_variants && !seen; i++)
            seen = strcmp(variants[i].key, key) == 0;
        if (seen) {
            free(key);
            continue;
        }
        if (num_variants == cap) {
            cap = cap ? 2 * cap : 64;
            variants = realloc(variants, cap * sizeof(*variants));
            ck_assert_ptr_nonnull(variants);
        }
        variant_line *v = &variants[num_variants++];
        v->kind = strcmp(field[3], "topk_gating.cl") == 0       ? MOECL_PROGRAM_TOPK_GATING
                  : strcmp(field[3], "grounded_router.cl") == 0 ? MOECL_PROGRAM_GROUNDED_ROUTER
                  : strcmp(field[3], "route_dispatch.cl") == 0  ? MOECL_PROGRAM_ROUTE_DISPATCH
                  : strcmp(field[3], "grounded_dispatch.cl") == 0 ? MOECL_PROGRAM_GROUNDED_DISPATCH
                  : strcmp(field[3], "ep_layout.cl") == 0         ? MOECL_PROGRAM_EP_LAYOUT
                  : strcmp(field[3], "replay.cl") == 0            ? MOECL_PROGRAM_REPLAY
                  : strcmp(field[3], "permute.cl") == 0           ? MOECL_PROGRAM_PERMUTE
                                                                : MOECL_PROGRAM_MOE_ALIGN;
        v->kernels = strdup(field[4]);
        v->defines = strdup(defines + 1);
        v->key = key;
        v->description = strdup(field[6]);
    }
    fclose(f);
    ck_assert_msg(num_variants > 0, "the manifest %s lists no variants", path);
    printf("test_layout: %zu variants listed, %zu distinct layouts\n", listed, num_variants);
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    ck_assert_int_eq(system(cmd), 0);
}

/* What the layout describes for one kernel of a variant. arrays: the
 * number of __local arrays compiled into the kernel (for the padding
 * allowance). */
typedef struct described {
    size_t local, private_bytes;
    unsigned arrays;
} described;

/* The local arrays of cl/gating.cl's team pipeline (TEAM_GATING_LOCALS)
 * for the variant's TEAM, ROWS and EPT: top-k's team kernel's, and the
 * split-K kernel's gating by teams. */
static described team_gating(const char *d, bool shuffle)
{
    const size_t team = (size_t)define_of(d, "TEAM", 0), groups = (size_t)define_of(d, "NUM_GROUPS", 0);
    const bool softmax = define_of(d, "SCORING", 0) == 0;
    described r = {0, 0, 0};
    r.local = LAYOUT_TOPK_TEAM_LOCAL_BYTES(team, (size_t)define_of(d, "ROWS", 0), (size_t)define_of(d, "EPT", 0),
                                           (size_t)define_of(d, "TOPK", 0), (size_t)define_of(d, "NUM_EXPERTS", 0),
                                           groups, softmax, shuffle);
    r.arrays = (shuffle || !softmax ? 0 : 1) + 3 + 2 + (groups ? 3 + (LAYOUT_GROUP_PARTS(team, groups) > 1 ? 3 : 0) : 0);
    return r;
}

/* ptx: whether the device builds with MOECL_PTX=1 (its own options, not
 * the variant's portable target's: moecl_build_options). */
static described describe(const char *kernel, const char *d, bool ptx)
{
#define D(name) ((size_t)define_of(d, name, 0))
    const bool shuffle = ptx && D("TEAM_SHUFFLE") != 0;
    described r = {0, 0, 0};
    if (strcmp(kernel, "topk_gating_team") == 0) {
        r = team_gating(d, shuffle);
        r.private_bytes = LAYOUT_TOPK_TEAM_PRIVATE_BYTES(D("EPT"));
    } else if (strcmp(kernel, "replay_team") == 0) {
        const bool softmax = D("SCORING") == 0 && D("WEIGHTING") == 0;
        r.local = LAYOUT_REPLAY_TEAM_LOCAL_BYTES(D("TEAM"), D("ROWS"), D("TOPK"), softmax, shuffle);
        r.arrays = (shuffle || !softmax ? 0 : 1) + 2;
    } else if (strcmp(kernel, "replay_rows") == 0) {
        /* No local memory, and no private array cl/layout.h describes
         * (for a softmax, the row's logits and scores as blocks: fewer
         * than top-k's rows kernel keeps for the same row). */
    } else if (strcmp(kernel, "topk_gating_rows") == 0) {
        r.private_bytes = LAYOUT_TOPK_ROWS_PRIVATE_BYTES(D("NUM_EXPERTS"), D("TOPK"), D("NUM_GROUPS"));
    } else if (strcmp(kernel, "grounded_router_team") == 0) {
        /* The gating pipeline's arrays beyond the seed gating's (the
         * softmax slots, the group arrays: cl/gating.cl) are top-k's. */
        const size_t team = D("TEAM"), groups = D("NUM_GROUPS");
        const bool softmax = D("SCORING") == 0;
        r.local = LAYOUT_GROUNDED_TEAM_LOCAL_BYTES(D("HIDDEN_DIM"), team, D("EPT"), D("ROWS"), D("TOPK")) +
                  D("ROWS") * (LAYOUT_TOPK_TEAM_ROW_BYTES(team, D("EPT"), D("TOPK"), D("NUM_EXPERTS"), groups, softmax,
                                                          shuffle) -
                               LAYOUT_TOPK_TEAM_ROW_BYTES(team, D("EPT"), D("TOPK"), D("NUM_EXPERTS"), 0, false, true));
        r.private_bytes = LAYOUT_GROUNDED_TEAM_PRIVATE_BYTES(D("EPT"));
        r.arrays = 4 + 3 + (shuffle || !softmax ? 0 : 1) +
                   (groups ? 3 + (LAYOUT_GROUP_PARTS(team, groups) > 1 ? 3 : 0) : 0);
    } else if (strcmp(kernel, "grounded_router_tiled") == 0) {
        r.local = LAYOUT_GROUNDED_TILED_LOCAL_BYTES(D("TM"), D("TN"), D("TK"), D("VEC"), D("DB"), D("TOPK"));
        r.arrays = 2;
    } else if (strcmp(kernel, "grounded_router_mma") == 0) {
        /* Emulated without MOECL_PTX (cl/router_mma.cl, MMA_EMULATE): the
         * native kernel has no scratch. */
        const bool emulated = D("MMA_EMULATE") != 0 || !ptx;
        r.local = LAYOUT_GROUNDED_MMA_LOCAL_BYTES(D("TM"), D("TN"), D("MMA_KW"), D("MMA_WM") * D("MMA_WN"), emulated);
        r.arrays = emulated ? 2 : 1;
    } else if (strcmp(kernel, "grounded_router_splitk") == 0) {
        /* The chunk and lanes' sums, then the rows of g; the last
         * work-group's flag; with teams (TEAM > 1) the gating's rows, as
         * top-k's team kernel has them. */
        if (D("TEAM") > 1)
            r = team_gating(d, shuffle);
        r.local += LAYOUT_GROUNDED_SPLITK_LOCAL_BYTES(D("TM"), D("TK"), D("SPLIT_WG"), D("NUM_EXPERTS"));
        r.arrays += 2;
    } else if (strcmp(kernel, "grounded_router_rows") == 0) {
        r.private_bytes = LAYOUT_GROUNDED_ROWS_PRIVATE_BYTES(D("TM"), D("NUM_EXPERTS"), D("TOPK"));
    } else if (strcmp(kernel, "moe_align_scan") == 0) {
        r.local = LAYOUT_ALIGN_SCAN_STATIC_BYTES(D("SCAN_WG"));
        r.arrays = 2;
    } else if (strcmp(kernel, "moe_align_scatter") == 0) {
        r.local = LAYOUT_ALIGN_SCATTER_STATIC_BYTES(D("WG"));
        r.arrays = D("WG") > 1 ? 1 : 0;
    } else if (strcmp(kernel, "moe_align_one_group") == 0) {
        const bool warp = ptx && D("WARP_MATCH") != 0;
        r.local = LAYOUT_ALIGN_ONE_GROUP_STATIC_BYTES(D("ONE_WG"), warp);
        r.arrays = warp ? 1 : 2;
    } else if (strcmp(kernel, "moe_align_fused") == 0) {
        r.local = LAYOUT_ALIGN_FUSED_STATIC_BYTES(D("FUSED_WG"));
        r.arrays = D("FUSED_WG") > 1 ? 3 : 2;
    } else if (strcmp(kernel, "moe_align_fused_parallel") == 0) {
        r.local = LAYOUT_ALIGN_PARALLEL_STATIC_BYTES(D("FUSED_WG"));
        r.arrays = D("FUSED_WG") > 1 ? 2 : 1;
    } else if (strcmp(kernel, "ep_layout_fused") == 0) {
        r.local = LAYOUT_EP_FUSED_STATIC_BYTES(D("FWG"));
        r.arrays = 2;
    } else if (strcmp(kernel, "ep_layout_place") == 0) {
        r.local = LAYOUT_EP_PLACE_STATIC_BYTES(D("WG"));
        r.arrays = D("WG") > 1 ? 1 : 0;
    } else {
        /* permute_rows, permute_scatter and combine_rows (cl/permute.cl)
         * keep no local memory and no private arrays. */
        ck_assert_msg(strcmp(kernel, "moe_align_count") == 0 || strcmp(kernel, "ep_layout_count") == 0 ||
                          strcmp(kernel, "ep_layout_scan") == 0 || strcmp(kernel, "permute_rows") == 0 ||
                          strcmp(kernel, "permute_scatter") == 0 || strcmp(kernel, "combine_rows") == 0,
                      "no layout for kernel %s", kernel);
    }
    /* The kernels of moecl_route_dispatch and moecl_grounded_route_dispatch
     * (a team kernel built with ROUTE_DISPATCH): moe_align_fused's
     * compiled-in arrays after the rows' (cl/common.cl, DISPATCH_LOCALS). */
    if (D("ROUTE_DISPATCH")) {
        r.local += LAYOUT_ALIGN_FUSED_STATIC_BYTES(D("FUSED_WG"));
        r.arrays += 3;
    }
#undef D
    return r;
}

static bool is_pocl(const moecl_context *ctx) { return ctx->info.vendor == MOECL_VENDOR_POCL; }

START_TEST(test_layout_matches_compiler)
{
    moecl_context *ctx = harness_context();
    load_variants();
    const bool private_meaningful = ctx->info.vendor == MOECL_VENDOR_INTEL;
    if (!private_meaningful)
        printf("test_layout: %s does not report the private arrays as such; private arrays not checked\n",
               ctx->info.platform_name);
    unsigned checked = 0, failures = 0;
    for (size_t i = 0; i < num_variants; i++) {
        const variant_line *v = &variants[i];
        char names[256];
        snprintf(names, sizeof(names), "%s", v->kernels);
        char *save = NULL;
        for (char *name = strtok_r(names, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
            moecl_variant *variant = NULL;
            moecl_status st = moecl_variant_get(ctx, v->kind, v->defines, name, &variant);
            ck_assert_msg(st == MOECL_SUCCESS, "building %s (%s): %s", name, v->description,
                          moecl_context_error(ctx));
            moecl_pooled_kernel *pooled = NULL;
            ck_assert_int_eq(moecl_variant_acquire(ctx, variant, &pooled), MOECL_SUCCESS);
            const cl_kernel kernel = pooled->kernel;
            cl_ulong local = 0, priv = 0;
            ck_assert_int_eq(clGetKernelWorkGroupInfo(kernel, ctx->device, CL_KERNEL_LOCAL_MEM_SIZE, sizeof(local),
                                                      &local, NULL),
                             CL_SUCCESS);
            ck_assert_int_eq(clGetKernelWorkGroupInfo(kernel, ctx->device, CL_KERNEL_PRIVATE_MEM_SIZE, sizeof(priv),
                                                      &priv, NULL),
                             CL_SUCCESS);
            moecl_variant_release(variant, pooled);
            const described want = describe(name, v->defines, ctx->info.ptx);
            const size_t allowance = is_pocl(ctx)                                         ? 0
                                     : ctx->info.vendor == MOECL_VENDOR_NVIDIA && want.arrays == 0 ? 1
                                                                                                : 8 * (size_t)want.arrays;
            const bool local_ok = local >= want.local && local <= want.local + allowance;
            const bool private_ok = !private_meaningful || want.private_bytes < LARGE_PRIVATE || priv >= want.private_bytes;
            if (getenv("MOECL_TEST_LAYOUT_VERBOSE") || !local_ok || !private_ok)
                printf("test_layout: %-22s local %8llu described %8zu (+%zu)  private %7llu described %7zu  %s%s  [%s]\n",
                       name, (unsigned long long)local, want.local, allowance, (unsigned long long)priv,
                       want.private_bytes, local_ok ? "" : "LOCAL MISMATCH ", private_ok ? "" : "PRIVATE UNDER",
                       v->description);
            failures += !local_ok || !private_ok;
            checked++;
        }
    }
    printf("test_layout: %u kernels checked on %s\n", checked, ctx->info.device_name);
    ck_assert_msg(failures == 0, "%u of %u kernels do not match cl/layout.h (lines above)", failures, checked);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("layout");
    TCase *tc = tcase_create("layout");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_layout_matches_compiler);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
