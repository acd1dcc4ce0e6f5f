/* Launch configurations (src/launch.c and the ops' choose_launch): the tune
 * file round trip, garbage and foreign files ignored, configurations the
 * device cannot run ignored, the precedence forced > env > tune file >
 * table > default, the device table's entries and values, correct
 * results under many configurations, the
 * inline PTX paths (chosen by compute capability; a build with them
 * that fails falls back to the portable kernels), and the failure
 * contract of the header: OpenCL calls of the ops made to fail (see
 * "Failures" below), the status and message that come back, and what
 * the failed call left in its outputs.
 *
 * Links the library's objects, not its ABI, to reach the internals (the
 * tune table, moecl_launch_force, the variant override), as moecl-tune
 * does. Every test runs in a fixture with its own MOECL_CACHE_DIR and the
 * run's variant override (--variant, none in meson's run), both restored
 * afterwards. */
#include "harness.h"
#include "harness_env.h"
#include "internal.h"

#include <dirent.h>
#include <dlfcn.h>
#include <math.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------------- */
/* Fixture                                                                 */
/* ---------------------------------------------------------------------- */

static const char *const fx_names[] = {"MOECL_CACHE_DIR", NULL};

static void env_setup(void)
{
    harness_env_save(fx_names, "launch");
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", harness_env_dir(), 1), 0);
    harness_override_with(NULL);
}

static void env_teardown(void)
{
    harness_env_restore();
    harness_override_with(NULL);
}

/* ---------------------------------------------------------------------- */
/* Helpers                                                                 */
/* ---------------------------------------------------------------------- */

static void tune_path_of(const moecl_context *ctx, char *path, size_t size)
{
    const char *dir = harness_env_dir();
    ck_assert_msg(moecl_tune_path(&ctx->info, path, size), "no tune file path with MOECL_CACHE_DIR=%s", dir);
    ck_assert_msg(strncmp(path, dir, strlen(dir)) == 0, "tune file %s is not in %s", path, dir);
}

/* The file's first two lines for this device. */
static void header_of(const moecl_context *ctx, char *buf, size_t size)
{
    const moecl_device_info *i = &ctx->info;
    snprintf(buf, size, "moecl-tune 1\ndevice %s | %s | %s\n", i->platform_name, i->device_name, i->driver_version);
}

/* Write header (if asked) + body as the device's tune file. */
static void write_tune_file(const moecl_context *ctx, bool header, const char *body, size_t body_size)
{
    char path[PATH_MAX + 128], head[600] = "";
    tune_path_of(ctx, path, sizeof(path));
    if (header)
        header_of(ctx, head, sizeof(head));
    size_t hl = strlen(head);
    char *all = malloc(hl + body_size + 1);
    ck_assert_ptr_nonnull(all);
    memcpy(all, head, hl);
    memcpy(all + hl, body, body_size);
    harness_write_file(path, all, hl + body_size);
    free(all);
}

static moecl_launch_config cfg_rows(unsigned rows) { return (moecl_launch_config){MOECL_KERNEL_ROWS, 1, rows, 0, {0}}; }
static moecl_launch_config cfg_team(unsigned team, unsigned rows)
{
    return (moecl_launch_config){MOECL_KERNEL_TEAM, team, rows, 0, {0}};
}
static moecl_launch_config cfg_tiled(unsigned tile) { return (moecl_launch_config){MOECL_KERNEL_TILED, 1, 0, tile, {0}}; }

static void config_text(const moecl_launch_config *c, char *buf, size_t size)
{
    moecl_launch_config_text(c, buf, size);
}

static void assert_config(const moecl_launch_config *got, const moecl_launch_config *want, const char *label)
{
    char g[128], w[128];
    config_text(got, g, sizeof(g));
    config_text(want, w, sizeof(w));
    ck_assert_msg(moecl_launch_config_equal(got, want), "%s: %s, expected %s", label, g, w);
}

static moecl_launch_source topk_launch(const moecl_context *ctx, const moecl_topk_gating_desc *d,
                                       moecl_launch_config *config)
{
    moecl_launch_key key;
    return moecl_topk_gating_launch(ctx, d, &key, config);
}

static moecl_launch_source grounded_launch(const moecl_context *ctx, const moecl_grounded_router_desc *d,
                                           moecl_launch_config *config)
{
    moecl_launch_key key;
    return moecl_grounded_router_launch(ctx, d, &key, config);
}

static void assert_source(moecl_launch_source got, moecl_launch_source want, const char *label)
{
    ck_assert_msg(got == want, "%s: source %s, expected %s", label, moecl_launch_source_name(got),
                  moecl_launch_source_name(want));
}

/* The shapes the tests key on. */
static moecl_topk_gating_desc topk128(void) { return moecl_topk_gating_desc_init(67, 128, 8); }
static moecl_topk_gating_desc topk_grouped(void)
{
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(45, 256, 8);
    d.scoring = MOECL_SCORING_SIGMOID;
    d.num_expert_groups = 8;
    d.topk_group = 4;
    d.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
    d.renormalize = true;
    d.routed_scaling_factor = 2.5f;
    return d;
}
static moecl_grounded_router_desc grounded16(void) { return moecl_grounded_router_desc_init(75, 128, 16, 0.5f); }

/* Run d on random inputs and compare with the reference; with_counts:
 * through moecl_topk_gating_with_counts_host, the histogram checked
 * against the ids the call chose. */
static void check_topk_run(moecl_context *ctx, const moecl_topk_gating_desc *d, bool with_bias, bool with_counts,
                           uint64_t stream, const char *label)
{
    harness_rng rng = harness_rng_for(stream);
    const size_t n = (size_t)d->num_tokens * d->num_experts, nk = (size_t)d->num_tokens * d->top_k;
    void *gating = harness_random_tensor(&rng, d->gating_dtype, n, 2.0f);
    float *bias = with_bias ? harness_random_tensor(&rng, MOECL_F32, d->num_experts, 0.05f) : NULL;
    float *w = malloc(nk * 4 + 4);
    int32_t *ids = malloc(nk * 4 + 4), *counts = malloc(d->num_experts * 4), *want = calloc(d->num_experts, 4);
    ck_assert(w && ids && counts && want);
    memset(w, HARNESS_POISON, nk * 4);
    memset(ids, HARNESS_POISON, nk * 4);
    moecl_status st = with_counts ? moecl_topk_gating_with_counts_host(ctx, d, gating, bias, w, ids, counts)
                                  : moecl_topk_gating_host(ctx, d, gating, bias, w, ids);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", label, moecl_status_string(st), moecl_context_error(ctx));
    char msg[512] = "";
    int bad = ref_check_topk_gating(d, gating, bias, w, ids, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", label, bad, msg);
    if (with_counts) {
        for (size_t i = 0; i < nk; i++)
            want[ids[i]]++;
        ck_assert_msg(memcmp(counts, want, d->num_experts * 4) == 0, "%s: expert_counts differ from the ids", label);
    }
    free(gating);
    free(bias);
    free(w);
    free(ids);
    free(counts);
    free(want);
}

static void check_topk(moecl_context *ctx, const moecl_topk_gating_desc *d, bool with_bias, uint64_t stream,
                       const char *label)
{
    check_topk_run(ctx, d, with_bias, false, stream, label);
}

static void check_grounded(moecl_context *ctx, const moecl_grounded_router_desc *d, uint64_t stream,
                           const char *label)
{
    harness_rng rng = harness_rng_for(stream);
    const size_t t = d->num_tokens, h = d->hidden_dim, e = d->num_experts, k = d->top_k;
    void *hidden = harness_random_tensor(&rng, MOECL_F32, t * h, 1.0f / sqrtf((float)h));
    float *logits = harness_random_tensor(&rng, MOECL_F32, t * e, 1.0f);
    void *ground = harness_random_tensor(&rng, MOECL_F32, e * h, 1.0f);
    float *pairs = malloc(t * k * 8 + 4);
    ck_assert_ptr_nonnull(pairs);
    memset(pairs, HARNESS_POISON, t * k * 8);
    moecl_status st = moecl_grounded_router_host(ctx, d, hidden, logits, ground, pairs, NULL, NULL);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", label, moecl_status_string(st), moecl_context_error(ctx));
    char msg[512] = "";
    int bad = ref_check_grounded_router(d, hidden, logits, ground, pairs, NULL, NULL, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", label, bad, msg);
    free(hidden);
    free(logits);
    free(ground);
    free(pairs);
}

/* The untuned choice for a desc: a context without a tune file. */
static moecl_launch_source untuned_topk(const moecl_topk_gating_desc *d, moecl_launch_config *config)
{
    moecl_context *ctx = harness_context();
    moecl_tune_free(&ctx->tuned);
    moecl_launch_source s = topk_launch(ctx, d, config);
    moecl_context_destroy(ctx);
    return s;
}

static moecl_launch_source untuned_grounded(const moecl_grounded_router_desc *d, moecl_launch_config *config)
{
    moecl_context *ctx = harness_context();
    moecl_tune_free(&ctx->tuned);
    moecl_launch_source s = grounded_launch(ctx, d, config);
    moecl_context_destroy(ctx);
    return s;
}

/* Entries of the fixture's directory other than . and .. */
static int entries_in_root(void)
{
    DIR *d = opendir(harness_env_dir());
    ck_assert_ptr_nonnull(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

/* ---------------------------------------------------------------------- */
/* Round trip                                                              */
/* ---------------------------------------------------------------------- */

START_TEST(test_round_trip)
{
    moecl_context *ctx = harness_context();
    ck_assert_uint_eq(ctx->tuned.count, 0);
    const moecl_topk_gating_desc t = topk128(), g = topk_grouped();
    const moecl_grounded_router_desc r = grounded16();
    moecl_launch_key kt, kg, kr;
    moecl_launch_config unused;
    moecl_topk_gating_launch(ctx, &t, &kt, &unused);
    moecl_topk_gating_launch(ctx, &g, &kg, &unused);
    moecl_grounded_router_launch(ctx, &r, &kr, &unused);
    ck_assert_uint_eq(kg.groups, 8);
    ck_assert_uint_eq(kr.hidden_bucket, 128);

    const moecl_launch_config ct = cfg_team(4, 2), cg = cfg_rows(16), cr = cfg_team(8, 4);
    moecl_tune_table table = {0};
    const moecl_launch_config first = cfg_rows(1);
    ck_assert(moecl_tune_set(&table, &kt, &first));
    ck_assert(moecl_tune_set(&table, &kt, &ct)); /* replaces */
    ck_assert(moecl_tune_set(&table, &kg, &cg));
    ck_assert(moecl_tune_set(&table, &kr, &cr));
    /* Keys no request here asks for, of every kernel kind, survive too. */
    const moecl_launch_key other[4] = {moecl_launch_key_topk(4096, 64, 64), moecl_launch_key_grounded(3000, 128, 8),
                                       moecl_launch_key_grounded(65536, 1, 1), moecl_launch_key_grounded(7168, 256, 8)};
    ck_assert_uint_eq(other[1].hidden_bucket, 4096);
    const moecl_launch_config gemm = {MOECL_KERNEL_TILED, 1, 0, 64, {128, 32, 8, 4, 2, 0, 0}};
    const moecl_launch_config oc[4] = {cfg_team(256, 16), cfg_tiled(128), cfg_rows(4096), gemm};
    for (int i = 0; i < 4; i++)
        ck_assert(moecl_tune_set(&table, &other[i], &oc[i]));
    ck_assert_uint_eq(table.count, 7);
    ck_assert(moecl_tune_store(&ctx->info, &table, "a comment\nof two lines"));

    /* Loaded back equal. */
    moecl_tune_table back;
    moecl_tune_load(&ctx->info, &back);
    ck_assert_uint_eq(back.count, table.count);
    for (size_t i = 0; i < table.count; i++) {
        const moecl_launch_config *c = moecl_tune_find(&back, &table.entries[i].key);
        ck_assert_msg(c != NULL, "entry %zu lost", i);
        assert_config(c, &table.entries[i].config, "round trip");
    }
    moecl_tune_free(&back);

    /* Only the tune file is left in the directory (no temporary files). */
    char path[PATH_MAX + 128];
    tune_path_of(ctx, path, sizeof(path));
    struct stat st;
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(entries_in_root(), 1);
    moecl_context_destroy(ctx);

    /* A new context reads it at creation and its calls use it. */
    ctx = harness_context();
    ck_assert_uint_eq(ctx->tuned.count, table.count);
    moecl_launch_config got;
    assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_TUNED, "topk e=128");
    assert_config(&got, &ct, "topk e=128");
    assert_source(topk_launch(ctx, &g, &got), MOECL_SOURCE_TUNED, "topk grouped");
    assert_config(&got, &cg, "topk grouped");
    assert_source(grounded_launch(ctx, &r, &got), MOECL_SOURCE_TUNED, "grounded");
    assert_config(&got, &cr, "grounded");
    /* hidden 100 shares the bucket of 128. */
    moecl_grounded_router_desc r100 = moecl_grounded_router_desc_init(9, 100, 16, 0.5f);
    assert_source(grounded_launch(ctx, &r100, &got), MOECL_SOURCE_TUNED, "grounded hidden 100");
    check_topk(ctx, &t, false, 1, "tuned topk e=128");
    check_topk(ctx, &g, true, 2, "tuned topk grouped");
    check_grounded(ctx, &r, 3, "tuned grounded");
    check_grounded(ctx, &r100, 4, "tuned grounded hidden 100");

    /* describe says where each seed configuration came from. */
    size_t need = moecl_context_describe(ctx, NULL, 0);
    char *text = malloc(need + 1);
    ck_assert_ptr_nonnull(text);
    moecl_context_describe(ctx, text, need + 1);
    ck_assert_msg(strstr(text, "launch topk e=128 k=8 groups=0: kernel=team team=4 rows=2 (tuned)") != NULL, "%s",
                  text);
    ck_assert_msg(strstr(text, "launch grounded e=16 k=2 hidden=128: kernel=team team=8 rows=4 (tuned)") != NULL,
                  "%s", text);
    ck_assert_msg(strstr(text, path) != NULL, "describe does not name the tune file %s: %s", path, text);
    free(text);
    moecl_context_destroy(ctx);
    moecl_tune_free(&table);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Garbage and foreign files                                               */
/* ---------------------------------------------------------------------- */

/* Lines of which exactly the ones marked good must load. Each bad line has
 * a key of its own (where its key is well-formed), so that loading one
 * would show in the count. */
static const struct {
    bool good;
    const char *line;
} mixed_lines[] = {
    {true, "topk e=128 k=8 groups=0 kernel=team team=4 rows=2"},
    {true, "  topk   e=256\tk=8 groups=8 kernel=rows rows=16  "}, /* spaces and tabs */
    {true, "grounded e=16 k=2 hidden=128 kernel=team team=8 rows=4\r"}, /* CRLF */
    {true, "grounded e=128 k=8 hidden=4096 kernel=tiled tile=64"},
    {true, "grounded e=129 k=8 hidden=4096 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=8 vec=4 db=1"},
    {true, "grounded e=130 k=8 hidden=4096 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=4 vec=4 db=1 wc=8"},
    {true, "topk e=64 k=2 kernel=rows rows=8"}, /* groups defaults to 0 */
    {false, "# a comment"},
    {false, ""},
    {false, "topk e=101 k=8 groups=0 kernel=team team=3 rows=2"},      /* team not a power of two */
    {false, "topk e=102 k=8 groups=0 kernel=team team=512 rows=2"},    /* team too large */
    {false, "topk e=103 k=8 groups=0 kernel=team team=1 rows=2"},      /* a team kernel of one */
    {false, "topk e=104 k=8 groups=0 kernel=team rows=2"},             /* team missing */
    {false, "topk e=105 k=8 groups=0 kernel=rows rows=3"},             /* rows not a power of two */
    {false, "topk e=106 k=8 groups=0 kernel=rows rows=0"},
    {false, "topk e=107 k=8 groups=0 kernel=rows rows=8192"},          /* rows too large */
    {false, "topk e=108 k=8 groups=0 kernel=rows rows=-8"},
    {false, "topk e=109 k=8 groups=0 kernel=rows rows=8x"},
    {false, "topk e=110 k=8 groups=0 kernel=rows rows=99999999999999999999"},
    {false, "topk e=111 k=8 groups=0 kernel=rows"},                    /* rows missing */
    {false, "topk e=112 k=8 groups=0 kernel=tiled tile=64"},           /* tiled is grounded only */
    {false, "topk e=113 k=8 groups=0 kernel=warp rows=8"},             /* unknown kernel */
    {false, "topk e=114 k=8 groups=0 rows=8"},                         /* kernel missing */
    {false, "topk e=115 k=8 groups=0 kernel=rows rows=8 colour=blue"}, /* unknown field */
    {false, "topk e=116 k=8 k=8 groups=0 kernel=rows rows=8"},         /* field twice */
    {false, "topk e=117 k=8 groups=0 kernel=rows rows=8 rows"},        /* no '=' */
    {false, "topk e=118 k=8 groups=0 kernel=rows team=2 rows=8"},      /* a team for the rows kernel */
    {false, "topk e=0 k=8 groups=0 kernel=rows rows=8"},
    {false, "topk e=5000 k=8 groups=0 kernel=rows rows=8"},
    {false, "topk e=4 k=8 groups=0 kernel=rows rows=8"},               /* k > e */
    {false, "topk e=119 k=65 groups=0 kernel=rows rows=8"},            /* k > 64 */
    {false, "topk e=120 k=0 groups=0 kernel=rows rows=8"},
    {false, "topk e=121 k=8 groups=4 kernel=rows rows=8"},             /* groups does not divide */
    {false, "topk e=122 k=8 hidden=128 kernel=rows rows=8"},
    {false, "topk k=8 kernel=rows rows=8"},                            /* e missing */
    {false, "grounded e=16 k=2 kernel=rows rows=8"},                   /* hidden missing */
    {false, "grounded e=17 k=2 hidden=100 kernel=rows rows=8"},        /* not a bucket */
    {false, "grounded e=18 k=2 hidden=131072 kernel=rows rows=8"},
    {false, "grounded e=19 k=2 hidden=128 groups=1 kernel=rows rows=8"},
    {false, "grounded e=20 k=2 hidden=128 kernel=tiled tile=48"},
    {false, "grounded e=21 k=2 hidden=128 kernel=tiled tile=256"},
    {false, "grounded e=22 k=2 hidden=128 kernel=tiled tile=64 rows=4"},
    {false, "grounded e=23 k=2 hidden=128 kernel=tiled"},              /* tile missing */
    /* The GEMM tile's fields: all or none, each in range. */
    {false, "grounded e=24 k=2 hidden=128 kernel=tiled tile=64 tn=128"},
    {false, "grounded e=25 k=2 hidden=128 kernel=tiled tile=64 tn=96 tk=16 mt=8 nt=8 vec=4 db=1"},
    {false, "grounded e=26 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=8 vec=3 db=1"},
    {false, "grounded e=27 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=8 vec=4 db=2"},
    {false, "grounded e=28 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=16 mt=3 nt=8 vec=4 db=1"},
    {false, "grounded e=29 k=2 hidden=128 kernel=team team=4 rows=2 tn=64 tk=16 mt=4 nt=4 vec=4 db=1"},
    {false, "grounded e=30 k=2 hidden=128 kernel=tiled tile=16 tn=128 tk=16 mt=32 nt=8 vec=4 db=1"},
    {false, "grounded e=31 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=2 mt=8 nt=8 vec=1 db=1"},
    {false, "grounded e=32 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=8 vec=4 db=1 db=1"},
    /* wc: optional, only with the other fields, a power of two dividing tn / nt */
    {false, "grounded e=33 k=2 hidden=128 kernel=tiled tile=64 wc=8"},
    {false, "grounded e=34 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=4 vec=4 db=1 wc=3"},
    {false, "grounded e=35 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=4 vec=4 db=1 wc=64"},
    {false, "grounded e=36 k=2 hidden=128 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=4 vec=4 db=1 wc=0x8"},
    {false, "grounded e=37 k=2 hidden=128 kernel=team team=4 rows=2 wc=4"},
    {false, "router e=24 k=2 hidden=128 kernel=rows rows=8"},          /* unknown op */
    {false, "TOPK e=123 k=8 groups=0 kernel=rows rows=8"},
    {false, "topk e=124 k=8 groups=0 kernel=rows rows=8 \x01"},        /* control character */
    {false, "topk=1 e=125 k=8 groups=0 kernel=rows rows=8"},
    {false, "moecl-tune 1"},
};

START_TEST(test_garbage_ignored)
{
    harness_rng rng = harness_rng_for(10);
    moecl_context *ctx = harness_context();
    char path[PATH_MAX + 128];
    tune_path_of(ctx, path, sizeof(path));

    /* A file of good and bad lines: the good ones load, in order (a later
     * good line for a key replaces an earlier one). */
    char body[8192] = "";
    size_t good = 0;
    for (size_t i = 0; i < sizeof(mixed_lines) / sizeof(mixed_lines[0]); i++) {
        strcat(body, mixed_lines[i].line);
        strcat(body, "\n");
        good += mixed_lines[i].good;
    }
    /* A line too long to be an entry, though it starts like one. */
    size_t len = strlen(body);
    strcat(body, "topk e=32 k=2 kernel=rows rows=8 "); /* and 700 spaces */
    len = strlen(body);
    memset(body + len, ' ', 700);
    body[len + 700] = '\0';
    strcat(body, "\n");
    /* A line with a NUL byte in it, then a replacement for the first key. */
    const char nul_line[] = "topk e=16 k=2 kernel=rows rows=8\0 junk\n";
    len = strlen(body);
    memcpy(body + len, nul_line, sizeof(nul_line) - 1);
    len += sizeof(nul_line) - 1;
    const char last[] = "topk e=128 k=8 groups=0 kernel=team team=8 rows=2"; /* no newline at the end */
    memcpy(body + len, last, sizeof(last) - 1);
    len += sizeof(last) - 1;
    write_tune_file(ctx, true, body, len);
    moecl_context_destroy(ctx);

    ctx = harness_context();
    ck_assert_uint_eq(ctx->tuned.count, good);
    const moecl_launch_key k128 = moecl_launch_key_topk(128, 8, 0);
    const moecl_launch_config *c = moecl_tune_find(&ctx->tuned, &k128);
    ck_assert_ptr_nonnull(c);
    const moecl_launch_config want = cfg_team(8, 2);
    assert_config(c, &want, "the later line for topk e=128");
    const moecl_launch_key k64 = moecl_launch_key_topk(64, 2, 0), kg = moecl_launch_key_grounded(128, 16, 2);
    ck_assert_ptr_nonnull(moecl_tune_find(&ctx->tuned, &k64));
    ck_assert_ptr_nonnull(moecl_tune_find(&ctx->tuned, &kg));
    const moecl_launch_key k32 = moecl_launch_key_topk(32, 2, 0), k16 = moecl_launch_key_topk(16, 2, 0);
    ck_assert_ptr_null(moecl_tune_find(&ctx->tuned, &k32));
    ck_assert_ptr_null(moecl_tune_find(&ctx->tuned, &k16));
    moecl_context_destroy(ctx);

    /* Whole files that are not ours: nothing loads, creation succeeds and
     * the ops still work. */
    const char *entry = "topk e=128 k=8 groups=0 kernel=team team=4 rows=2\n";
    char head[600];
    ctx = harness_context();
    header_of(ctx, head, sizeof(head));
    moecl_context_destroy(ctx);
    char foreign[1200];
    snprintf(foreign, sizeof(foreign), "moecl-tune 1\ndevice Other Platform | Other Device | 9.9\n%s", entry);
    char wrong_magic[1200];
    snprintf(wrong_magic, sizeof(wrong_magic), "moecl-tune 2%s%s", strchr(head, '\n'), entry);
    char no_identity[1200];
    snprintf(no_identity, sizeof(no_identity), "moecl-tune 1\n%s", entry);
    char case_changed[1200];
    snprintf(case_changed, sizeof(case_changed), "%s%s", head, entry);
    /* Every letter's case flipped (an all-capitals name such as "NVIDIA
     * H200" must change too). */
    for (char *p = strchr(case_changed, '\n') + 8; *p != '\n'; p++)
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z'))
            *p = (char)(*p ^ 0x20);
    char half_header[1200];
    snprintf(half_header, sizeof(half_header), "%.*s", (int)(strlen(head) / 2), head);
    const char *const texts[] = {foreign, wrong_magic, no_identity, case_changed, half_header, "", entry};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        harness_write_file(path, texts[i], strlen(texts[i]));
        ctx = harness_context();
        ck_assert_msg(ctx->tuned.count == 0, "file %zu: %zu entries loaded", i, ctx->tuned.count);
        moecl_context_destroy(ctx);
    }

    /* Random bytes, with and without our header first. */
    for (int round = 0; round < 8; round++) {
        size_t n = 1 + harness_rand_u32(&rng) % 6000;
        char *bytes = malloc(n);
        ck_assert_ptr_nonnull(bytes);
        for (size_t i = 0; i < n; i++) {
            /* Mostly entry-like characters, so the parser gets far. */
            static const char alphabet[] = "topkgrundeimshlwa=0123456789 \n\t#\r";
            uint32_t r = harness_rand_u32(&rng);
            bytes[i] = (r & 7) ? alphabet[(r >> 3) % (sizeof(alphabet) - 1)] : (char)(r >> 8);
        }
        ctx = harness_context();
        write_tune_file(ctx, round & 1, bytes, n);
        moecl_context_destroy(ctx);
        free(bytes);
        ctx = harness_context();
        ck_assert(ctx->tuned.count <= 1024);
        moecl_launch_config got;
        const moecl_topk_gating_desc d = topk128();
        topk_launch(ctx, &d, &got); /* whatever loaded, the choice resolves */
        moecl_context_destroy(ctx);
    }

    /* A file too big (over 1 MiB) is ignored whole. */
    {
        size_t n = ((size_t)1 << 20) + 4096;
        char *big = malloc(n);
        ck_assert_ptr_nonnull(big);
        ctx = harness_context();
        size_t hl = strlen(head), el = strlen(entry), at = 0;
        memcpy(big, head, hl);
        at = hl;
        while (at + el <= n) {
            memcpy(big + at, entry, el);
            at += el;
        }
        harness_write_file(path, big, at);
        moecl_context_destroy(ctx);
        free(big);
        ctx = harness_context();
        ck_assert_uint_eq(ctx->tuned.count, 0);
        moecl_context_destroy(ctx);
    }

    /* A directory where the file should be. */
    ck_assert_int_eq(unlink(path), 0);
    ck_assert_int_eq(mkdir(path, 0700), 0);
    ctx = harness_context();
    ck_assert_uint_eq(ctx->tuned.count, 0);
    moecl_tune_table one = {0};
    const moecl_launch_config c1 = cfg_rows(8);
    ck_assert(moecl_tune_set(&one, &k128, &c1));
    ck_assert(!moecl_tune_store(&ctx->info, &one, NULL)); /* cannot replace a directory: reported, no crash */
    moecl_tune_free(&one);
    const moecl_topk_gating_desc d = topk128();
    check_topk(ctx, &d, false, 11, "tune path is a directory");
    moecl_context_destroy(ctx);
    ck_assert_int_eq(rmdir(path), 0);

    /* The cache off: no path, nothing loaded, nothing stored. */
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", "off", 1), 0);
    ctx = harness_context();
    char none[64];
    ck_assert(!moecl_tune_path(&ctx->info, none, sizeof(none)));
    ck_assert_uint_eq(ctx->tuned.count, 0);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Configurations the device cannot run                                    */
/* ---------------------------------------------------------------------- */

START_TEST(test_invalid_config_ignored)
{
    const moecl_topk_gating_desc t = topk128(), t256 = moecl_topk_gating_desc_init(9, 256, 8);
    moecl_topk_gating_desc t4096 = moecl_topk_gating_desc_init(3, 4096, 8);
    t4096.num_expert_groups = 64;
    t4096.topk_group = 2;
    const moecl_grounded_router_desc r = grounded16();
    moecl_grounded_router_desc wide = moecl_grounded_router_desc_init(5, 65536, 16, 0.5f);
    moecl_launch_config base_t, base_t256, base_t4096, base_r, base_w;
    const moecl_launch_source src_t = untuned_topk(&t, &base_t), src_t256 = untuned_topk(&t256, &base_t256),
                              src_t4096 = untuned_topk(&t4096, &base_t4096),
                              src_r = untuned_grounded(&r, &base_r), src_w = untuned_grounded(&wide, &base_w);

    /* team 256 x 4096 rows is past every device's work-group limit and
     * local memory; 256 x past_rows (the power of two of rows just past
     * this device's work-group limit: 32 on pocl, whose limit is 4096, 64
     * on Intel's CPU runtime, 8192) past the work-group limit;
     * 256 grouped rows of 4096 experts take 4 MiB of local memory in a
     * work-group of 4096, which pocl allows; the
     * team kernel with hidden 65536 in local memory past every device's
     * local memory; the 8x8 tile needs 64 experts a tile (16 here). */
    moecl_context *ctx = harness_context();
    unsigned past_rows = 1;
    while ((size_t)256 * past_rows <= ctx->info.max_work_group_size)
        past_rows *= 2;
    char body[1024];
    snprintf(body, sizeof(body),
             "topk e=128 k=8 groups=0 kernel=team team=256 rows=4096\n"
             "topk e=256 k=8 groups=0 kernel=team team=256 rows=%u\n"
             "topk e=4096 k=8 groups=64 kernel=team team=16 rows=256\n"
             "grounded e=16 k=2 hidden=128 kernel=tiled tile=128\n"
             "grounded e=16 k=2 hidden=65536 kernel=team team=4 rows=1\n",
             past_rows);
    write_tune_file(ctx, true, body, strlen(body));
    moecl_context_destroy(ctx);

    ctx = harness_context();
    ck_assert_uint_eq(ctx->tuned.count, 5); /* well-formed: loaded, then refused at use */
    moecl_launch_config got;
    assert_source(topk_launch(ctx, &t, &got), src_t, "team 256 x 4096");
    assert_config(&got, &base_t, "team 256 x 4096");
    assert_source(topk_launch(ctx, &t256, &got), src_t256, "team 256 past the work-group limit");
    assert_config(&got, &base_t256, "team 256 past the work-group limit");
    assert_source(topk_launch(ctx, &t4096, &got), src_t4096, "4 MiB of local memory");
    assert_config(&got, &base_t4096, "4 MiB of local memory");
    assert_source(grounded_launch(ctx, &r, &got), src_r, "tile 128 for 16 experts");
    assert_config(&got, &base_r, "tile 128 for 16 experts");
    assert_source(grounded_launch(ctx, &wide, &got), src_w, "team kernel for hidden 65536");
    assert_config(&got, &base_w, "team kernel for hidden 65536");
    check_topk(ctx, &t, false, 20, "invalid tuned topk");
    check_grounded(ctx, &r, 21, "invalid tuned grounded");

    /* Forcing one is refused the same way. */
    const moecl_launch_config bad = cfg_team(256, 4096);
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &bad);
    assert_source(topk_launch(ctx, &t, &got), src_t, "forced team 256 x 4096");
    assert_config(&got, &base_t, "forced team 256 x 4096");
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, NULL);

    /* A work-group of two team work-items aborts pocl's compiler: refused
     * there, from any source. */
    if (ctx->info.vendor == MOECL_VENDOR_POCL) {
        const moecl_launch_config two = cfg_team(2, 1);
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &two);
        assert_source(topk_launch(ctx, &t, &got), src_t, "team 2 x 1 on pocl");
        moecl_launch_force(ctx, MOECL_OP_GROUNDED_ROUTER, &two);
        assert_source(grounded_launch(ctx, &r, &got), src_r, "grounded team 2 x 1 on pocl");
        /* Private arrays past 4 MiB a work-group overflow pocl's stack. */
        const moecl_launch_config deep = cfg_rows(4096), half = cfg_rows(2048);
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &deep);
        assert_source(topk_launch(ctx, &t256, &got), src_t256, "256 experts x 4096 rows on pocl");
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &half);
        assert_source(topk_launch(ctx, &t256, &got), MOECL_SOURCE_FORCED, "256 experts x 2048 rows on pocl");
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, NULL);
        moecl_launch_force(ctx, MOECL_OP_GROUNDED_ROUTER, NULL);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Precedence: forced > env > tune file > table > default                  */
/* ---------------------------------------------------------------------- */

START_TEST(test_precedence)
{
    const moecl_topk_gating_desc t = topk128();
    const moecl_grounded_router_desc r = grounded16();
    moecl_launch_config base_t, base_r, got;
    const moecl_launch_source src_t = untuned_topk(&t, &base_t), src_r = untuned_grounded(&r, &base_r);
    ck_assert(src_t == MOECL_SOURCE_TABLE || src_t == MOECL_SOURCE_DEFAULT);
    ck_assert(src_r == MOECL_SOURCE_TABLE || src_r == MOECL_SOURCE_DEFAULT);
    moecl_context *ctx = harness_context();
    /* The device table: pocl on CPUs has a top-k gating entry. */
    if (ctx->info.vendor == MOECL_VENDOR_POCL && (ctx->info.type & CL_DEVICE_TYPE_CPU))
        assert_source(src_t, MOECL_SOURCE_TABLE, "pocl top-k, no tune file");

    /* The tune file beats the table and the default. */
    const moecl_launch_config tuned_t = cfg_team(4, 2), tuned_r = cfg_rows(2);
    char body[512];
    snprintf(body, sizeof(body),
             "topk e=128 k=8 groups=0 kernel=team team=4 rows=2\n"
             "grounded e=16 k=2 hidden=128 kernel=rows rows=2\n");
    write_tune_file(ctx, true, body, strlen(body));
    moecl_context_destroy(ctx);
    ctx = harness_context();
    assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_TUNED, "tune file over table/default");
    assert_config(&got, &tuned_t, "tune file over table/default");
    assert_source(grounded_launch(ctx, &r, &got), MOECL_SOURCE_TUNED, "grounded tune file");
    assert_config(&got, &tuned_r, "grounded tune file");

    /* Forced beats the tune file. */
    const moecl_launch_config forced = cfg_team(16, 4);
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &forced);
    assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_FORCED, "forced over tune file");
    assert_config(&got, &forced, "forced over tune file");
    /* ... for its op only. */
    assert_source(grounded_launch(ctx, &r, &got), MOECL_SOURCE_TUNED, "forcing top-k leaves the grounded router");
    check_topk(ctx, &t, false, 30, "forced team 16 x 4");
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, NULL);
    assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_TUNED, "forcing stopped");
    moecl_context_destroy(ctx);

    /* The variant override beats the tune file (copied at context
     * creation). */
    static const struct {
        const char *variant;
        bool topk_override, grounded_override;
    } overrides[] = {
        {"class=gpu", true, true},
        {"class=cpu", true, true},
        {"team=8", true, false},
        {"tile=128", false, true},
        {"grounded=mma", false, true},
    };
    for (size_t i = 0; i < sizeof(overrides) / sizeof(overrides[0]); i++) {
        const char *label = overrides[i].variant;
        harness_override_with(label);
        ctx = harness_context();
        moecl_launch_source s = topk_launch(ctx, &t, &got);
        if (overrides[i].topk_override) {
            assert_source(s, MOECL_SOURCE_OVERRIDE, label);
            ck_assert_msg(!moecl_launch_config_equal(&got, &tuned_t), "%s: the tune file's choice was used", label);
        } else {
            assert_source(s, MOECL_SOURCE_TUNED, label);
        }
        if (!strcmp(label, "team=8")) {
            const moecl_launch_config team8 = {MOECL_KERNEL_TEAM, 8, got.rows, 0, {0}};
            assert_config(&got, &team8, label);
        }
        if (!strcmp(label, "class=cpu")) {
            const moecl_launch_config rows8 = cfg_rows(8);
            assert_config(&got, &rows8, label);
        }
        s = grounded_launch(ctx, &r, &got);
        assert_source(s, overrides[i].grounded_override ? MOECL_SOURCE_OVERRIDE : MOECL_SOURCE_TUNED, label);
        check_topk(ctx, &t, false, 31 + i, label);
        check_grounded(ctx, &r, 41 + i, label);
        /* Forced still beats the override. */
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &forced);
        assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_FORCED, label);
        moecl_context_destroy(ctx);
    }

    /* team=8 with class=cpu: the rows kernel, as before. */
    harness_override_with("team=8 class=cpu");
    ctx = harness_context();
    assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_OVERRIDE, "team=8 with the cpu class");
    ck_assert_int_eq(got.kernel, MOECL_KERNEL_ROWS);
    moecl_context_destroy(ctx);
    harness_override_with(NULL);
}
END_TEST

/* The variant override's text (src/override.c): every name read into its
 * field; a bad word rejected, named in the message, and the override set
 * before it kept. */
START_TEST(test_override_text)
{
    moecl_launch_env env;
    ck_assert_int_eq(moecl_override_parse("class=gpu team=16 align=fused ep=fused-last ep_wg=64 ep_groups=2 "
                                          "grounded=mma binaries=off",
                                          &env),
                     MOECL_SUCCESS);
    ck_assert_int_eq(env.binaries, -1);
    ck_assert(env.launch_class_forced && env.launch_class == MOECL_LAUNCH_GPU);
    ck_assert_uint_eq(env.team, 16);
    ck_assert_int_eq(env.align_path, MOECL_ALIGN_FUSED);
    ck_assert_int_eq(env.ep_path, MOECL_EP_FUSED_LAST);
    ck_assert_uint_eq(env.ep_fused_wg, 64);
    ck_assert_uint_eq(env.ep_fused_groups, 2);
    ck_assert(env.grounded_mma && !env.grounded_wide_tile);
    ck_assert_int_eq(moecl_override_parse("  tile=64 tn=128\ttk=16 mt=8 nt=8 vec=4 db=1 ", &env), MOECL_SUCCESS);
    ck_assert_int_eq(env.grounded_tile.kernel, MOECL_KERNEL_TILED);
    ck_assert_uint_eq(env.grounded_tile.tile, 64);
    ck_assert_uint_eq(env.grounded_tile.tiled.tn, 128);
    ck_assert_int_eq(moecl_override_parse("binaries=on", &env), MOECL_SUCCESS);
    ck_assert_int_eq(env.binaries, 1);
    ck_assert_int_eq(env.table_vendor, MOECL_VENDOR_OTHER);
    ck_assert_int_eq(moecl_override_parse("table=nvidia", &env), MOECL_SUCCESS);
    ck_assert_int_eq(env.table_vendor, MOECL_VENDOR_NVIDIA);
    ck_assert_int_eq(moecl_override_parse("table=rusticl", &env), MOECL_SUCCESS);
    ck_assert_int_eq(env.table_vendor, MOECL_VENDOR_RUSTICL);
    ck_assert_int_eq(moecl_override_parse("tile=128", &env), MOECL_SUCCESS);
    ck_assert(env.grounded_wide_tile && env.grounded_tile.kernel == MOECL_KERNEL_ROWS);
    ck_assert_int_eq(moecl_override_parse("", &env), MOECL_SUCCESS);
    ck_assert(!env.launch_class_forced && !env.team && env.align_path == MOECL_ALIGN_AUTO && !env.binaries);
    static const char *const bad[][2] = {
        {"class=tpu", "tpu"},  {"team=3", "3"},   {"team=512", "512"},     {"align", "align"},
        {"color=red", "color"}, {"ep_groups=0", "0"}, {"ep=one", "one"}, {"tn=128", "tile=N"},
        {"grounded=tiled", "tiled"}, {"class=gpu ep_wg=16", "16"}, {"binaries=1", "1"}, {"table=other", "other"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ck_assert_msg(moecl_override_parse(bad[i][0], &env) == MOECL_ERROR_INVALID_ARGUMENT, "'%s' accepted",
                      bad[i][0]);
        ck_assert_msg(strstr(moecl_context_error(NULL), bad[i][1]) != NULL, "'%s': the message does not name %s: %s",
                      bad[i][0], bad[i][1], moecl_context_error(NULL));
    }
    ck_assert_int_eq(moecl_override_set("team=8"), MOECL_SUCCESS);
    ck_assert_int_eq(moecl_override_set("team=7"), MOECL_ERROR_INVALID_ARGUMENT);
    moecl_override_get(&env);
    ck_assert_uint_eq(env.team, 8);
    harness_override_with(NULL);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* The device table (src/device_table.c)                                   */
/* ---------------------------------------------------------------------- */

/* A device as device.c would record it, of vendor and type, named name. */
static moecl_device_info table_device(moecl_vendor vendor, cl_device_type type, const char *name)
{
    moecl_device_info info;
    memset(&info, 0, sizeof(info));
    snprintf(info.device_name, sizeof(info.device_name), "%s", name);
    info.vendor = vendor;
    info.type = type;
    info.launch_class = type & CL_DEVICE_TYPE_CPU ? MOECL_LAUNCH_CPU : MOECL_LAUNCH_GPU;
    return info;
}

/* The grounded router's kernel on llvmpipe-like facts (rusticl's loop
 * limit) and on the same facts without it (pocl's vendor). */
static const char *grounded_kernel_on(moecl_vendor vendor, uint32_t tokens, uint32_t hidden, uint32_t experts,
                                      uint32_t k)
{
    moecl_device_info info = table_device(vendor, CL_DEVICE_TYPE_CPU, "llvmpipe (LLVM 15.0.6, 256 bits)");
    info.max_work_group_size = 1024;
    info.local_mem_size = 32768;
    info.compute_units = 8;
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(tokens, hidden, experts, 0.5f);
    d.top_k = k;
    char defines[1024];
    const char *kernel = "unset";
    moecl_grounded_router_defines(&info, &d, true, true, true, defines, sizeof(defines), &kernel);
    return kernel;
}

static void assert_define(const char *text, const char *name, int value, const char *label);

/* Top-k gating's kernel and defines on the same facts. */
static const char *topk_kernel_on(moecl_vendor vendor, uint32_t experts, uint32_t k, char *defines, size_t size)
{
    moecl_device_info info = table_device(vendor, CL_DEVICE_TYPE_CPU, "llvmpipe (LLVM 15.0.6, 256 bits)");
    info.max_work_group_size = 1024;
    info.local_mem_size = 32768;
    info.compute_units = 8;
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, experts, k);
    const char *kernel = "unset";
    moecl_topk_gating_defines(&info, &d, false, false, defines, size, &kernel);
    return kernel;
}

static void assert_table_launch(const moecl_device_info *info, const moecl_launch_key *key,
                                const moecl_launch_config *want, const char *label)
{
    const moecl_launch_config *got = moecl_device_table_launch(info, key);
    if (!want) {
        char text[128] = "";
        if (got)
            moecl_launch_config_text(got, text, sizeof(text));
        ck_assert_msg(got == NULL, "%s: a table entry (%s)", label, text);
        return;
    }
    ck_assert_msg(got != NULL, "%s: no table entry", label);
    assert_config(got, want, label);
}

/* The table's entries by vendor, device type, op and expert count, and its
 * values: the defaults, and over them the vendor's. */
START_TEST(test_device_table)
{
    const moecl_device_info h200 = table_device(MOECL_VENDOR_NVIDIA, CL_DEVICE_TYPE_GPU, "NVIDIA H200");
    const moecl_device_info nv_cpu = table_device(MOECL_VENDOR_NVIDIA, CL_DEVICE_TYPE_CPU, "NVIDIA something");
    const moecl_device_info pocl = table_device(MOECL_VENDOR_POCL, CL_DEVICE_TYPE_CPU, "pthread-skylake");
    const moecl_device_info pocl_gpu = table_device(MOECL_VENDOR_POCL, CL_DEVICE_TYPE_GPU, "pocl gpu");
    const moecl_device_info amd = table_device(MOECL_VENDOR_AMD, CL_DEVICE_TYPE_GPU, "gfx90a");
    const moecl_device_info intel = table_device(MOECL_VENDOR_INTEL, CL_DEVICE_TYPE_GPU, "dg2");

    const moecl_launch_key topk256 = moecl_launch_key_topk(256, 8, 0), topk128 = moecl_launch_key_topk(128, 8, 0);
    const moecl_launch_key grounded128 = moecl_launch_key_grounded(4096, 128, 8);
    const moecl_launch_key grounded16 = moecl_launch_key_grounded(128, 16, 2);
    const moecl_launch_config team32 = cfg_team(32, 4), rows8 = cfg_rows(8);
    const moecl_launch_config tiled = {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 4, 4, 1, 0}};
    assert_table_launch(&h200, &topk256, &team32, "NVIDIA top-k 256");
    assert_table_launch(&nv_cpu, &topk256, &team32, "NVIDIA top-k 256, any type");
    assert_table_launch(&h200, &topk128, NULL, "NVIDIA top-k 128");
    assert_table_launch(&h200, &grounded128, &tiled, "NVIDIA GPU grounded 128");
    assert_table_launch(&nv_cpu, &grounded128, NULL, "NVIDIA CPU grounded 128");
    assert_table_launch(&h200, &grounded16, NULL, "NVIDIA grounded 16");
    assert_table_launch(&pocl, &topk128, &rows8, "pocl CPU top-k");
    assert_table_launch(&pocl, &topk256, &rows8, "pocl CPU top-k 256");
    assert_table_launch(&pocl, &grounded16, NULL, "pocl grounded");
    assert_table_launch(&pocl_gpu, &topk128, NULL, "pocl GPU top-k");
    const moecl_device_info *plain[] = {&amd, &intel};
    for (size_t i = 0; i < 2; i++) {
        assert_table_launch(plain[i], &topk256, NULL, plain[i]->device_name);
        assert_table_launch(plain[i], &grounded128, NULL, plain[i]->device_name);
    }

    /* Values: AMD and Intel take the defaults, NVIDIA and pocl their own
     * over them; pairs by launch class. */
    const moecl_device_params d = moecl_device_table_params(&amd);
    ck_assert(memcmp(&d, &(moecl_device_params){0}, sizeof(d)) != 0);
    const moecl_device_params i = moecl_device_table_params(&intel), n = moecl_device_table_params(&h200);
    const moecl_device_params p = moecl_device_table_params(&pocl);
    ck_assert(memcmp(&d, &i, sizeof(d)) == 0);
    ck_assert_uint_eq(d.value[MOECL_DP_PTX_MIN_MAJOR], 0);
    ck_assert_uint_eq(n.value[MOECL_DP_PTX_MIN_MAJOR], 7);
    ck_assert_uint_eq(d.value[MOECL_DP_NATIVE_MATH], 0);
    ck_assert_uint_eq(n.value[MOECL_DP_NATIVE_MATH], 1);
    ck_assert_uint_eq(d.value[MOECL_DP_REFUSE_TEAM_WG], 0);
    ck_assert_uint_eq(p.value[MOECL_DP_REFUSE_TEAM_WG], 2);
    ck_assert_uint_eq(d.value[MOECL_DP_PRIVATE_MAX], 0);
    ck_assert_uint_eq(p.value[MOECL_DP_PRIVATE_MAX], 4u << 20);
    ck_assert_uint_eq(d.value[MOECL_DP_ROUTE_ONE_KERNEL_MAX_SLOTS], 5120);
    ck_assert_uint_eq(n.value[MOECL_DP_ROUTE_ONE_KERNEL_MAX_SLOTS], 256);
    ck_assert_uint_eq(n.value[MOECL_DP_ROUTE_ONE_KERNEL_FORCED_MAX_SLOTS], 8192);
    ck_assert_uint_eq(moecl_device_param_class(&d, MOECL_DP_ALIGN_FUSED_MAX_SLOTS_CPU, MOECL_LAUNCH_CPU), 8192);
    ck_assert_uint_eq(moecl_device_param_class(&d, MOECL_DP_ALIGN_FUSED_MAX_SLOTS_CPU, MOECL_LAUNCH_GPU), 5120);
    ck_assert_uint_eq(moecl_device_param_class(&d, MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_CPU, MOECL_LAUNCH_CPU), 0);
    ck_assert_uint_eq(moecl_device_param_class(&d, MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_CPU, MOECL_LAUNCH_GPU), 0);
    ck_assert_uint_eq(moecl_device_param_class(&d, MOECL_DP_EP_FUSED_CPU, MOECL_LAUNCH_CPU), 0);
    ck_assert_uint_eq(moecl_device_param_class(&d, MOECL_DP_EP_FUSED_CPU, MOECL_LAUNCH_GPU), 1);
    /* rusticl: llvmpipe's faults by its device name, not the platform's
     * other devices. */
    const moecl_device_info llvmpipe = table_device(MOECL_VENDOR_RUSTICL, CL_DEVICE_TYPE_CPU, "llvmpipe (LLVM 15.0.6)");
    const moecl_device_info radeonsi = table_device(MOECL_VENDOR_RUSTICL, CL_DEVICE_TYPE_GPU, "AMD Radeon (radeonsi)");
    const moecl_device_params lp = moecl_device_table_params(&llvmpipe);
    ck_assert_uint_eq(d.value[MOECL_DP_KERNEL_WG_QUERY], 1);
    ck_assert_uint_eq(lp.value[MOECL_DP_KERNEL_WG_QUERY], 0);
    ck_assert_uint_eq(d.value[MOECL_DP_LOOP_LIMIT], 0);
    ck_assert_uint_eq(lp.value[MOECL_DP_LOOP_LIMIT], 65535);
    const moecl_device_params rs = moecl_device_table_params(&radeonsi);
    ck_assert(memcmp(&d, &rs, sizeof(d)) == 0);
    /* Where one token a work-item of the rows kernel passes the loop
     * limit, the split-K kernel; where that passes it too, none. */
    static const struct {
        uint32_t tokens, hidden, experts, k;
        const char *limited;
    } loops[] = {{64, 256, 64, 8, "grounded_router_rows"},   {1, 4096, 56, 8, "grounded_router_rows"},
                 {1, 4096, 88, 8, "grounded_router_splitk"}, {4096, 4096, 128, 8, "grounded_router_splitk"},
                 {1, 65536, 8, 2, "grounded_router_splitk"}, {1, 16, 2048, 64, "grounded_router_splitk"},
                 {1, 16, 4096, 64, NULL}};
    for (size_t i = 0; i < sizeof(loops) / sizeof(loops[0]); i++) {
        const char *got = grounded_kernel_on(MOECL_VENDOR_RUSTICL, loops[i].tokens, loops[i].hidden,
                                             loops[i].experts, loops[i].k);
        ck_assert_msg(loops[i].limited ? got && strcmp(got, loops[i].limited) == 0 : got == NULL,
                      "llvmpipe %u x %u x %u top %u: %s, not %s", loops[i].tokens, loops[i].hidden,
                      loops[i].experts, loops[i].k, got ? got : "none", loops[i].limited ? loops[i].limited : "none");
        ck_assert_str_eq(grounded_kernel_on(MOECL_VENDOR_POCL, loops[i].tokens, loops[i].hidden, loops[i].experts,
                                            loops[i].k),
                         "grounded_router_rows");
    }
    /* Top-k's rows kernel without the CPU fast path under the limit, and
     * none where a row's loops pass it. */
    char topk_defines[1024];
    ck_assert_str_eq(topk_kernel_on(MOECL_VENDOR_RUSTICL, 2048, 64, topk_defines, sizeof(topk_defines)),
                     "topk_gating_rows");
    assert_define(topk_defines, "CPU_DEVICE", 0, "llvmpipe");
    ck_assert_ptr_null(topk_kernel_on(MOECL_VENDOR_RUSTICL, 4096, 64, topk_defines, sizeof(topk_defines)));
    ck_assert_str_eq(topk_kernel_on(MOECL_VENDOR_POCL, 4096, 64, topk_defines, sizeof(topk_defines)),
                     "topk_gating_rows");
    assert_define(topk_defines, "CPU_DEVICE", 1, "pocl");
    /* The device name does not move a vendor's values. */
    const moecl_device_info other = table_device(MOECL_VENDOR_NVIDIA, CL_DEVICE_TYPE_GPU, "");
    const moecl_device_params o = moecl_device_table_params(&other);
    ck_assert(memcmp(&n, &o, sizeof(n)) == 0);

    /* The override's table=nvidia on pocl: NVIDIA's values over pocl's,
     * pocl's own kept where NVIDIA has none; no inline PTX without a
     * compute capability. */
    moecl_device_info forced = pocl;
    forced.env.table_vendor = MOECL_VENDOR_NVIDIA;
    const moecl_device_params f = moecl_device_table_params(&forced);
    ck_assert_uint_eq(f.value[MOECL_DP_NATIVE_MATH], 1);
    ck_assert_uint_eq(f.value[MOECL_DP_UNROLL], 1);
    ck_assert_uint_eq(f.value[MOECL_DP_ROUTE_ONE_KERNEL_MAX_SLOTS], 256);
    ck_assert_uint_eq(f.value[MOECL_DP_PTX_MIN_MAJOR], 7);
    ck_assert_uint_eq(f.value[MOECL_DP_REFUSE_TEAM_WG], 2);
    ck_assert_uint_eq(f.value[MOECL_DP_BINARY_CACHE], 0);
    ck_assert(!moecl_device_ptx(&forced));
    forced = h200;
    forced.env.table_vendor = MOECL_VENDOR_AMD; /* a vendor with no entry: the device's values */
    const moecl_device_params a = moecl_device_table_params(&forced);
    ck_assert(memcmp(&a, &n, sizeof(n)) == 0);

    /* A context holds its device's values. */
    moecl_context *ctx = harness_context();
    const moecl_device_params here = moecl_device_table_params(&ctx->info);
    ck_assert(memcmp(&ctx->params, &here, sizeof(here)) == 0);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Launch plans (src/plan.c)                                               */
/* ---------------------------------------------------------------------- */

static const moecl_plan *topk_plan(moecl_context *ctx, const moecl_topk_gating_desc *d, bool bias, bool counts)
{
    const moecl_plan *p = NULL;
    moecl_status st = moecl_topk_gating_plan(ctx, d, bias, counts, &p);
    ck_assert_msg(st == MOECL_SUCCESS, "plan: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_ptr_nonnull(p);
    return p;
}

/* A request's plan is built once and found again; requests that differ in
 * what the kernel is built with (bias, histogram, dtype, floor, grounded
 * outputs) get plans of their own, and calls that alternate between them
 * each route right. */
START_TEST(test_plan_cache)
{
    moecl_context *ctx = harness_context();
    ck_assert_uint_eq(moecl_plan_count(ctx), 0);
    const moecl_topk_gating_desc d = topk128();
    const moecl_plan *plain = topk_plan(ctx, &d, false, false);
    ck_assert_uint_eq(moecl_plan_count(ctx), 1);
    ck_assert_ptr_eq(topk_plan(ctx, &d, false, false), plain);
    check_topk(ctx, &d, false, 5100, "plain, first call");
    ck_assert_uint_eq(moecl_plan_count(ctx), 1); /* the host path found the same plan */
    ck_assert_ptr_eq(topk_plan(ctx, &d, false, false), plain);

    const moecl_plan *bias = topk_plan(ctx, &d, true, false), *counts = topk_plan(ctx, &d, false, true);
    moecl_topk_gating_desc half = d;
    half.gating_dtype = MOECL_F16;
    const moecl_plan *f16 = topk_plan(ctx, &half, false, false);
    moecl_topk_gating_desc floored = d;
    floored.renormalize = true;
    floored.renormalize_floor = 0.25f;
    const moecl_plan *floor1 = topk_plan(ctx, &floored, false, false);
    floored.renormalize_floor = 0.5f;
    const moecl_plan *floor2 = topk_plan(ctx, &floored, false, false);
    const moecl_plan *all[] = {plain, bias, counts, f16, floor1, floor2};
    for (size_t i = 0; i < 6; i++)
        for (size_t j = i + 1; j < 6; j++) {
            ck_assert_msg(all[i] != all[j], "requests %zu and %zu share a plan", i, j);
            ck_assert_msg(all[i]->variants[0] != all[j]->variants[0], "requests %zu and %zu share a kernel", i, j);
        }
    ck_assert_uint_eq(moecl_plan_count(ctx), 6);
    /* Only the floor's bits tell those two apart; the same bits are the same plan. */
    ck_assert_ptr_eq(topk_plan(ctx, &floored, false, false), floor2);

    /* Alternating calls: each takes its own kernel (a bias applied to a
     * plain call, or a histogram kernel run without one, would route
     * wrong or fail). */
    for (int round = 0; round < 2; round++) {
        check_topk(ctx, &d, true, 5110 + round, "bias");
        check_topk(ctx, &d, false, 5120 + round, "plain after bias");
        check_topk_run(ctx, &d, false, true, 5130 + round, "counts");
        check_topk(ctx, &half, true, 5140 + round, "f16 with bias after f32");
        check_topk(ctx, &d, false, 5150 + round, "f32 after f16");
        check_topk(ctx, &floored, false, 5160 + round, "floor 0.5");
    }
    ck_assert_uint_eq(moecl_plan_count(ctx), 7); /* f16 with bias is the one new request */

    /* The grounded router: the outputs are build-time choices. */
    const moecl_grounded_router_desc r = grounded16();
    const moecl_plan *pairs = NULL, *separate = NULL, *again = NULL;
    ck_assert_int_eq(moecl_grounded_router_plan(ctx, &r, true, false, false, &pairs), MOECL_SUCCESS);
    ck_assert_int_eq(moecl_grounded_router_plan(ctx, &r, false, true, true, &separate), MOECL_SUCCESS);
    ck_assert_int_eq(moecl_grounded_router_plan(ctx, &r, true, false, false, &again), MOECL_SUCCESS);
    ck_assert(pairs != separate && pairs->variants[0] != separate->variants[0]);
    ck_assert_ptr_eq(again, pairs);
    check_grounded(ctx, &r, 5170, "grounded pairs");
    moecl_context_destroy(ctx);
}
END_TEST

/* moecl_launch_force takes effect on the next call after the request's
 * plan was cached, for its op only, and stopping it brings back the
 * unforced configuration. */
START_TEST(test_plan_force_after_cached)
{
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc d = topk128();
    const moecl_grounded_router_desc r = grounded16();
    check_topk(ctx, &d, false, 5200, "before forcing");
    check_grounded(ctx, &r, 5201, "grounded before forcing");
    const moecl_plan *before = topk_plan(ctx, &d, false, false), *grounded_before = NULL, *grounded_after = NULL;
    ck_assert_int_eq(moecl_grounded_router_plan(ctx, &r, true, false, false, &grounded_before), MOECL_SUCCESS);
    const moecl_launch_config unforced = before->config;
    const moecl_launch_source unforced_source = before->source;
    ck_assert(unforced_source != MOECL_SOURCE_FORCED);

    const moecl_launch_config team = cfg_team(16, 4), rows = cfg_rows(2);
    const moecl_launch_config first = moecl_launch_config_equal(&unforced, &team) ? rows : team;
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &first);
    const moecl_plan *forced = topk_plan(ctx, &d, false, false);
    ck_assert(forced != before);
    assert_source(forced->source, MOECL_SOURCE_FORCED, "forced after cached");
    assert_config(&forced->config, &first, "forced after cached");
    check_topk(ctx, &d, false, 5210, "forced after cached");
    /* Another forced configuration, again on the next call. */
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &rows);
    const moecl_plan *second = topk_plan(ctx, &d, false, false);
    assert_config(&second->config, &rows, "second forced");
    ck_assert_uint_eq(second->local, 2);
    check_topk(ctx, &d, false, 5220, "second forced");
    /* The grounded router's plan is untouched. */
    ck_assert_int_eq(moecl_grounded_router_plan(ctx, &r, true, false, false, &grounded_after), MOECL_SUCCESS);
    ck_assert_ptr_eq(grounded_after, grounded_before);

    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, NULL);
    const moecl_plan *after = topk_plan(ctx, &d, false, false);
    assert_source(after->source, unforced_source, "forcing stopped");
    assert_config(&after->config, &unforced, "forcing stopped");
    check_topk(ctx, &d, false, 5230, "forcing stopped");
    moecl_context_destroy(ctx);
}
END_TEST

/* Set by a buffer's destructor callback (which may run on another
 * thread, after the release that frees it). */
static void CL_CALLBACK note_freed(cl_mem mem, void *flag)
{
    (void)mem;
    __atomic_store_n((int *)flag, 1, __ATOMIC_SEQ_CST);
}

/* Whether the buffer watched by flag was freed within two seconds. */
static bool freed_soon(const int *flag)
{
    for (int i = 0; i < 200 && !__atomic_load_n(flag, __ATOMIC_SEQ_CST); i++)
        usleep(10000);
    return __atomic_load_n(flag, __ATOMIC_SEQ_CST) != 0;
}

static cl_mem watched_buffer(cl_context cc, size_t bytes, int *freed)
{
    cl_int err;
    cl_mem m = clCreateBuffer(cc, CL_MEM_READ_ONLY, bytes, NULL, &err);
    ck_assert_ptr_nonnull(m);
    *freed = 0;
    ck_assert_int_eq(clSetMemObjectDestructorCallback(m, note_freed, freed), CL_SUCCESS);
    return m;
}

static moecl_status gate_call(moecl_context *ctx, const moecl_topk_gating_desc *d, cl_mem gating, cl_mem w, cl_mem ids)
{
    const moecl_status st = moecl_topk_gating(ctx, d, (moecl_buffer){gating, 0}, (moecl_buffer){NULL, 0},
                                              (moecl_buffer){w, 0}, (moecl_buffer){ids, 0}, 0, NULL, NULL);
    ck_assert_int_eq(clFinish(moecl_context_queue(ctx)), CL_SUCCESS);
    return st;
}

/* The context holds a reference to the caller's buffers of a kernel's
 * last call (moecl_buffer): a buffer the caller released is freed when
 * the kernel gets another one, at moecl_context_forget_buffers and at
 * moecl_context_destroy. A held buffer is checked against its size again
 * (a request it is too small for is refused), and a handle that comes
 * back for a smaller buffer once the old one is freed is checked anew. */
START_TEST(test_plan_buffer_released)
{
    moecl_context *ctx = harness_context();
    cl_context cc = moecl_context_cl_context(ctx);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(64, 32, 4);
    const moecl_topk_gating_desc twice = moecl_topk_gating_desc_init(128, 32, 4);
    const size_t in_bytes = (size_t)64 * 32 * 4, out_bytes = (size_t)128 * 4 * 4;
    cl_int err;
    cl_mem w = clCreateBuffer(cc, CL_MEM_READ_WRITE, out_bytes, NULL, &err);
    cl_mem ids = clCreateBuffer(cc, CL_MEM_READ_WRITE, out_bytes, NULL, &err);
    cl_mem other = clCreateBuffer(cc, CL_MEM_READ_ONLY, in_bytes, NULL, &err);
    ck_assert(w && ids && other);
    bool reused = false;
    for (int round = 0; round < 8; round++) {
        int freed = 0;
        cl_mem big = watched_buffer(cc, in_bytes, &freed);
        ck_assert_msg(gate_call(ctx, &d, big, w, ids) == MOECL_SUCCESS, "round %d: %s", round,
                      moecl_context_error(ctx));
        cl_uint refs = 0;
        ck_assert_int_eq(clGetMemObjectInfo(big, CL_MEM_REFERENCE_COUNT, sizeof(refs), &refs, NULL), CL_SUCCESS);
        ck_assert_msg(refs == 2, "round %d: %u references to the caller's buffer, not 2 (its own and the context's)",
                      round, refs);
        /* Held, and checked against the size kept: twice the tokens need
         * twice the bytes. */
        moecl_status st = gate_call(ctx, &twice, big, w, ids);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT && strstr(moecl_context_error(ctx), "gating: needs"),
                      "round %d: a held buffer too small for the request was accepted: %s", round,
                      moecl_context_error(ctx));
        ck_assert_msg(gate_call(ctx, &d, big, w, ids) == MOECL_SUCCESS, "round %d again: %s", round,
                      moecl_context_error(ctx));
        const cl_mem old = big;
        clReleaseMemObject(big);
        ck_assert_msg(!__atomic_load_n(&freed, __ATOMIC_SEQ_CST), "round %d: a held buffer was freed", round);
        /* Freed when the kernel gets another buffer (odd rounds) or when
         * the context forgets its buffers (even rounds). */
        if (round % 2)
            ck_assert_msg(gate_call(ctx, &d, other, w, ids) == MOECL_SUCCESS, "round %d other: %s", round,
                          moecl_context_error(ctx));
        else
            moecl_context_forget_buffers(ctx);
        ck_assert_msg(freed_soon(&freed), "round %d: the released buffer was not freed (%s)", round,
                      round % 2 ? "another buffer" : "moecl_context_forget_buffers");
        cl_mem small = clCreateBuffer(cc, CL_MEM_READ_ONLY, in_bytes / 2, NULL, &err);
        ck_assert_ptr_nonnull(small);
        reused |= small == old;
        st = gate_call(ctx, &d, small, w, ids);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT && strstr(moecl_context_error(ctx), "gating: needs"),
                      "round %d (handle %s): a buffer of half the size was accepted: %s", round,
                      small == old ? "reused" : "new", moecl_context_error(ctx));
        clReleaseMemObject(small);
    }
    if (!reused)
        fprintf(stderr, "launch: the driver never gave a released buffer's handle to the next buffer here\n");
    /* Destroying the context frees what it held. */
    int freed = 0;
    cl_mem last = watched_buffer(cc, in_bytes, &freed);
    ck_assert_msg(gate_call(ctx, &d, last, w, ids) == MOECL_SUCCESS, "last: %s", moecl_context_error(ctx));
    clReleaseMemObject(last);
    moecl_context_destroy(ctx);
    ck_assert_msg(freed_soon(&freed), "moecl_context_destroy did not release the caller's buffer it held");
    clReleaseMemObject(w);
    clReleaseMemObject(ids);
    clReleaseMemObject(other);
}
END_TEST

#define PLAN_THREADS 4

/* One thread's call of the concurrent test: no ck_assert in here. */
typedef struct plan_worker {
    moecl_context *ctx;
    const moecl_topk_gating_desc *desc;
    pthread_barrier_t *start;
    cl_mem gating, weights, ids;
    float *w;
    int32_t *chosen;
    moecl_status st;
    cl_int read;
} plan_worker;

static void *plan_worker_run(void *arg)
{
    plan_worker *p = arg;
    const size_t nk = (size_t)p->desc->num_tokens * p->desc->top_k;
    pthread_barrier_wait(p->start);
    cl_event done = NULL;
    p->st = moecl_topk_gating(p->ctx, p->desc, (moecl_buffer){p->gating, 0}, (moecl_buffer){NULL, 0},
                              (moecl_buffer){p->weights, 0}, (moecl_buffer){p->ids, 0}, 0, NULL, &done);
    p->read = CL_SUCCESS;
    if (p->st == MOECL_SUCCESS) {
        cl_command_queue q = moecl_context_queue(p->ctx);
        p->read = clEnqueueReadBuffer(q, p->weights, CL_TRUE, 0, nk * 4, p->w, 1, &done, NULL);
        if (p->read == CL_SUCCESS)
            p->read = clEnqueueReadBuffer(q, p->ids, CL_TRUE, 0, nk * 4, p->chosen, 0, NULL, NULL);
        clReleaseEvent(done);
    }
    return NULL;
}

/* First calls of one request from several threads at once on a fresh
 * context: one plan is built, and every call routes right. */
START_TEST(test_plan_concurrent_first_calls)
{
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(41, 96, 6);
    const size_t n = (size_t)d.num_tokens * d.num_experts, nk = (size_t)d.num_tokens * d.top_k;
    pthread_barrier_t start;
    ck_assert_int_eq(pthread_barrier_init(&start, NULL, PLAN_THREADS), 0);
    plan_worker workers[PLAN_THREADS];
    void *inputs[PLAN_THREADS];
    pthread_t threads[PLAN_THREADS];
    for (int i = 0; i < PLAN_THREADS; i++) {
        harness_rng rng = harness_rng_for(5300 + (uint64_t)i);
        inputs[i] = harness_random_tensor(&rng, MOECL_F32, n, 2.0f);
        cl_int err;
        cl_context cc = moecl_context_cl_context(ctx);
        workers[i] = (plan_worker){ctx, &d, &start, NULL, NULL, NULL, malloc(nk * 4), malloc(nk * 4), MOECL_SUCCESS,
                                   CL_SUCCESS};
        workers[i].gating = clCreateBuffer(cc, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, n * 4, inputs[i], &err);
        workers[i].weights = clCreateBuffer(cc, CL_MEM_READ_WRITE, nk * 4, NULL, &err);
        workers[i].ids = clCreateBuffer(cc, CL_MEM_READ_WRITE, nk * 4, NULL, &err);
        ck_assert(workers[i].gating && workers[i].weights && workers[i].ids && workers[i].w && workers[i].chosen);
    }
    ck_assert_uint_eq(moecl_plan_count(ctx), 0);
    for (int i = 0; i < PLAN_THREADS; i++)
        ck_assert_int_eq(pthread_create(&threads[i], NULL, plan_worker_run, &workers[i]), 0);
    for (int i = 0; i < PLAN_THREADS; i++)
        ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
    pthread_barrier_destroy(&start);
    ck_assert_uint_eq(moecl_plan_count(ctx), 1);
    for (int i = 0; i < PLAN_THREADS; i++) {
        plan_worker *p = &workers[i];
        ck_assert_msg(p->st == MOECL_SUCCESS, "thread %d: %s", i, moecl_status_string(p->st));
        ck_assert_int_eq(p->read, CL_SUCCESS);
        char msg[512] = "";
        const int bad = ref_check_topk_gating(&d, inputs[i], NULL, p->w, p->chosen, msg, sizeof(msg));
        ck_assert_msg(bad == 0, "thread %d: %d bad rows; first: %s", i, bad, msg);
        clReleaseMemObject(p->gating);
        clReleaseMemObject(p->weights);
        clReleaseMemObject(p->ids);
        free(p->w);
        free(p->chosen);
        free(inputs[i]);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Results stay right under every kind of configuration                    */
/* ---------------------------------------------------------------------- */

START_TEST(test_configs_correct)
{
    moecl_context *ctx = harness_context();
    /* Token counts that leave the last work-group partly empty. */
    const moecl_topk_gating_desc t = topk128(), g = topk_grouped();
    const moecl_launch_config topk_configs[] = {cfg_rows(1),      cfg_rows(4),      cfg_rows(256),   cfg_team(2, 4),
                                                cfg_team(4, 1),   cfg_team(16, 8),  cfg_team(64, 2), cfg_team(128, 1),
                                                cfg_team(256, 1)};
    for (size_t i = 0; i < sizeof(topk_configs) / sizeof(topk_configs[0]); i++) {
        char label[128], text[96];
        config_text(&topk_configs[i], text, sizeof(text));
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &topk_configs[i]);
        moecl_launch_config got;
        snprintf(label, sizeof(label), "topk e=128 %s", text);
        assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_FORCED, label);
        check_topk(ctx, &t, i & 1, 100 + i, label);
        snprintf(label, sizeof(label), "topk grouped %s", text);
        assert_source(topk_launch(ctx, &g, &got), MOECL_SOURCE_FORCED, label);
        check_topk(ctx, &g, true, 200 + i, label);
    }
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, NULL);

    const moecl_grounded_router_desc r = grounded16();
    /* Hidden 64: the team-of-64 table (64 x 129 floats) fits in 48 KiB of
     * local memory, as on the H200. */
    moecl_grounded_router_desc r64 = moecl_grounded_router_desc_init(70, 64, 80, 0.25f);
    r64.top_k = 8;
    const moecl_launch_config grounded_configs[] = {cfg_rows(1),      cfg_rows(32),  cfg_team(4, 2), cfg_team(16, 8),
                                                    cfg_team(64, 1),  cfg_tiled(16), cfg_tiled(32),  cfg_tiled(64),
                                                    cfg_tiled(128)};
    for (size_t i = 0; i < sizeof(grounded_configs) / sizeof(grounded_configs[0]); i++) {
        char label[128], text[96];
        config_text(&grounded_configs[i], text, sizeof(text));
        moecl_launch_force(ctx, MOECL_OP_GROUNDED_ROUTER, &grounded_configs[i]);
        moecl_launch_config got;
        /* The 8x8 tile needs 64 experts a tile: only the wide table. */
        if (grounded_configs[i].tile != 128) {
            snprintf(label, sizeof(label), "grounded 75x128x16 %s", text);
            assert_source(grounded_launch(ctx, &r, &got), MOECL_SOURCE_FORCED, label);
            check_grounded(ctx, &r, 300 + i, label);
        }
        snprintf(label, sizeof(label), "grounded 70x64x80 k8 %s", text);
        assert_source(grounded_launch(ctx, &r64, &got), MOECL_SOURCE_FORCED, label);
        check_grounded(ctx, &r64, 400 + i, label);
    }
    /* Every tile of the table, its GEMM parameters written out, on edges in
     * all three dimensions: 37 tokens, hidden 203 (odd: no whole vectors at
     * its end, nor whole hidden steps) and 130 experts (a partial tile of
     * 128 or 64). Where the device's local memory or work-group limit
     * refuses a tile the library takes another, which says nothing about
     * the tile, so it must run at least the rule's 64-token one. */
    moecl_grounded_router_desc ragged = moecl_grounded_router_desc_init(37, 203, 130, 0.5f);
    ragged.top_k = 8;
    size_t tiles;
    const moecl_launch_config *tile = moecl_grounded_tile_configs(&tiles);
    unsigned ran = 0;
    for (size_t i = 0; i < tiles; i++) {
        moecl_launch_config c = tile[i];
        if (!c.tiled.tn)
            c.tiled.tn = 64;
        char label[160], text[96];
        config_text(&c, text, sizeof(text));
        moecl_launch_force(ctx, MOECL_OP_GROUNDED_ROUTER, &c);
        moecl_launch_config got;
        snprintf(label, sizeof(label), "grounded 37x203x130 k8 %s", text);
        if (grounded_launch(ctx, &ragged, &got) != MOECL_SOURCE_FORCED) {
            ck_assert_msg(i != 1, "%s: the rule's tile does not run", label);
            continue;
        }
        check_grounded(ctx, &ragged, 500 + i, label);
        ran++;
    }
    ck_assert_uint_gt(ran, 0);
    moecl_launch_force(ctx, MOECL_OP_GROUNDED_ROUTER, NULL);
    moecl_context_destroy(ctx);
}
END_TEST

/* Rows per work-group only say how many rows share a work-group: every
 * row's arithmetic is the same, so ids and weights agree bit for bit across
 * them (and across repeated calls). Team sizes change the reduction order
 * of a row and are checked against the reference only. */
START_TEST(test_rows_per_group_bit_identical)
{
    moecl_context *ctx = harness_context();
    harness_rng rng = harness_rng_for(900);
    moecl_topk_gating_desc descs[3] = {topk128(), topk_grouped(), topk128()};
    descs[2].scoring = MOECL_SCORING_SIGMOID;
    descs[2].renormalize = true;
    for (size_t c = 0; c < 3; c++) {
        const moecl_topk_gating_desc *d = &descs[c];
        const size_t n = (size_t)d->num_tokens * d->num_experts, nk = (size_t)d->num_tokens * d->top_k;
        void *gating = harness_random_tensor(&rng, d->gating_dtype, n, 2.0f);
        float *bias = harness_random_tensor(&rng, MOECL_F32, d->num_experts, 0.05f);
        float *w0 = malloc(nk * 4), *w = malloc(nk * 4);
        int32_t *i0 = malloc(nk * 4), *ids = malloc(nk * 4);
        ck_assert(gating && bias && w0 && w && i0 && ids);
        /* The rows kernel, then the team kernel (team 16), each at several
         * rows per work-group (8 rows of the grouped case fill 24 KiB of
         * local memory, within every GPU's 32 KiB or more; 16 would not fit
         * the H200's 48 KiB); the first of each is the baseline. */
        const moecl_launch_config configs[2][4] = {{cfg_rows(1), cfg_rows(8), cfg_rows(32), cfg_rows(128)},
                                                   {cfg_team(16, 1), cfg_team(16, 2), cfg_team(16, 4),
                                                    cfg_team(16, 8)}};
        for (size_t kind = 0; kind < 2; kind++) {
            for (size_t i = 0; i < 4; i++) {
                char text[96];
                config_text(&configs[kind][i], text, sizeof(text));
                moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &configs[kind][i]);
                moecl_launch_config got;
                assert_source(topk_launch(ctx, d, &got), MOECL_SOURCE_FORCED, text);
                for (int rep = 0; rep < 2; rep++) {
                    moecl_status st = moecl_topk_gating_host(ctx, d, gating, bias, i ? w : w0, i ? ids : i0);
                    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s", text, moecl_context_error(ctx));
                    if (i == 0 && rep == 0) {
                        char msg[512] = "";
                        ck_assert_msg(ref_check_topk_gating(d, gating, bias, w0, i0, msg, sizeof(msg)) == 0,
                                      "case %zu %s: %s", c, text, msg);
                        continue;
                    }
                    if (i == 0)
                        continue;
                    ck_assert_msg(memcmp(ids, i0, nk * 4) == 0, "case %zu %s: ids differ from rows per group 1", c,
                                  text);
                    ck_assert_msg(memcmp(w, w0, nk * 4) == 0, "case %zu %s: weights differ from rows per group 1",
                                  c, text);
                }
            }
        }
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, NULL);
        free(gating);
        free(bias);
        free(w0);
        free(w);
        free(i0);
        free(ids);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Failures: what a failed call reports, and what it leaves                */
/* ---------------------------------------------------------------------- */

/* The OpenCL calls that can fail once a call is validated are interposed
 * here: this program links the library's objects, so their calls of
 * clSetKernelArg, clEnqueueNDRangeKernel, clEnqueueFillBuffer and
 * clGetKernelWorkGroupInfo bind to the definitions below, which pass them
 * on to the ICD loader's (dlsym RTLD_NEXT) unless a fault is armed for that
 * call. The library has no hook and knows nothing of it. While faults are
 * armed, every command enqueued gets an event, kept so that a test can see
 * whether the failed call left it running. */

enum fault_call { FAULT_SET_ARG, FAULT_ENQUEUE, FAULT_FILL, FAULT_WG_LIMIT };

typedef struct fault {
    enum fault_call call;
    const char *kernel; /* a prefix of the kernel's name; for the fill, the buffer's name in the message */
    int arg;            /* FAULT_SET_ARG: the argument's index */
    cl_int code;        /* what the call returns; FAULT_WG_LIMIT: the CL_KERNEL_WORK_GROUP_SIZE reported */
} fault;

#define MAX_FAULTS 2
#define MAX_WATCHED 16
static fault armed[MAX_FAULTS];
static int num_armed;
static char fired_kernel[128]; /* the kernel of the first fault that fired */
static cl_event watched[MAX_WATCHED]; /* the first MAX_WATCHED of them */
static int num_watched;                /* commands enqueued while armed */

static cl_int (*real_set_arg)(cl_kernel, cl_uint, size_t, const void *);
static cl_int (*real_enqueue)(cl_command_queue, cl_kernel, cl_uint, const size_t *, const size_t *, const size_t *,
                              cl_uint, const cl_event *, cl_event *);
static cl_int (*real_fill)(cl_command_queue, cl_mem, const void *, size_t, size_t, size_t, cl_uint, const cl_event *,
                           cl_event *);
static cl_int (*real_wg_info)(cl_kernel, cl_device_id, cl_kernel_work_group_info, size_t, void *, size_t *);

static void *real_symbol(const char *name)
{
    void *p = dlsym(RTLD_NEXT, name);
    if (!p) {
        fprintf(stderr, "launch: dlsym(RTLD_NEXT, %s) found nothing\n", name);
        abort();
    }
    return p;
}

/* Before any OpenCL call (main). */
static void faults_init(void)
{
    real_set_arg = (__typeof__(real_set_arg))real_symbol("clSetKernelArg");
    real_enqueue = (__typeof__(real_enqueue))real_symbol("clEnqueueNDRangeKernel");
    real_fill = (__typeof__(real_fill))real_symbol("clEnqueueFillBuffer");
    real_wg_info = (__typeof__(real_wg_info))real_symbol("clGetKernelWorkGroupInfo");
}

static void kernel_name(cl_kernel kernel, char *name, size_t size)
{
    if (clGetKernelInfo(kernel, CL_KERNEL_FUNCTION_NAME, size, name, NULL) != CL_SUCCESS)
        snprintf(name, size, "?");
}

/* The armed fault for this call, or NULL. */
static const fault *fault_of(enum fault_call call, cl_kernel kernel, int arg)
{
    char name[128] = "";
    if (kernel)
        kernel_name(kernel, name, sizeof(name));
    for (int i = 0; i < num_armed; i++) {
        const fault *f = &armed[i];
        if (f->call == call && (call == FAULT_FILL || strncmp(name, f->kernel, strlen(f->kernel)) == 0) &&
            (call != FAULT_SET_ARG || f->arg == arg)) {
            if (!fired_kernel[0] && call != FAULT_WG_LIMIT)
                snprintf(fired_kernel, sizeof(fired_kernel), "%s", kernel ? name : f->kernel);
            return f;
        }
    }
    return NULL;
}

/* No ck_assert in here: a failure would longjmp out of the library. */
static void watch(cl_event ev, bool callers)
{
    if (num_armed == 0 || !ev)
        return;
    if (num_watched < MAX_WATCHED) {
        if (callers)
            clRetainEvent(ev);
        watched[num_watched] = ev;
    } else if (!callers) {
        clReleaseEvent(ev);
    }
    num_watched++;
}

cl_int clSetKernelArg(cl_kernel kernel, cl_uint index, size_t size, const void *value)
{
    const fault *f = num_armed ? fault_of(FAULT_SET_ARG, kernel, (int)index) : NULL;
    return f ? f->code : real_set_arg(kernel, index, size, value);
}

cl_int clEnqueueNDRangeKernel(cl_command_queue queue, cl_kernel kernel, cl_uint dims, const size_t *offset,
                              const size_t *global, const size_t *local, cl_uint num_wait, const cl_event *wait,
                              cl_event *ev)
{
    if (num_armed) {
        const fault *f = fault_of(FAULT_ENQUEUE, kernel, -1);
        if (f)
            return f->code;
        /* A work-group past the limit the kernel reported: what a driver
         * answers. */
        f = fault_of(FAULT_WG_LIMIT, kernel, -1);
        if (f && local && local[0] > (size_t)f->code)
            return CL_INVALID_WORK_GROUP_SIZE;
    }
    cl_event mine = NULL;
    cl_int err = real_enqueue(queue, kernel, dims, offset, global, local, num_wait, wait,
                              ev ? ev : num_armed ? &mine : NULL);
    if (err == CL_SUCCESS)
        watch(ev ? *ev : mine, ev != NULL);
    return err;
}

cl_int clEnqueueFillBuffer(cl_command_queue queue, cl_mem buffer, const void *pattern, size_t pattern_size,
                           size_t offset, size_t size, cl_uint num_wait, const cl_event *wait, cl_event *ev)
{
    const fault *f = num_armed ? fault_of(FAULT_FILL, NULL, -1) : NULL;
    if (f)
        return f->code;
    cl_event mine = NULL;
    cl_int err = real_fill(queue, buffer, pattern, pattern_size, offset, size, num_wait, wait,
                           ev ? ev : num_armed ? &mine : NULL);
    if (err == CL_SUCCESS)
        watch(ev ? *ev : mine, ev != NULL);
    return err;
}

cl_int clGetKernelWorkGroupInfo(cl_kernel kernel, cl_device_id device, cl_kernel_work_group_info param, size_t size,
                                void *value, size_t *size_ret)
{
    cl_int err = real_wg_info(kernel, device, param, size, value, size_ret);
    const fault *f = num_armed && err == CL_SUCCESS && param == CL_KERNEL_WORK_GROUP_SIZE && value
                         ? fault_of(FAULT_WG_LIMIT, kernel, -1)
                         : NULL;
    if (f)
        *(size_t *)value = (size_t)f->code;
    return err;
}

static void arm(const fault *faults, int n)
{
    ck_assert(n <= MAX_FAULTS);
    for (int i = 0; i < n; i++)
        armed[i] = faults[i];
    num_armed = n;
    fired_kernel[0] = '\0';
    num_watched = 0;
}

static void disarm(void)
{
    num_armed = 0;
    for (int i = 0; i < num_watched && i < MAX_WATCHED; i++)
        clReleaseEvent(watched[i]);
    num_watched = 0;
}

/* The failed call's status and message, and every command it enqueued
 * (enqueued of them) complete when it returned. */
static void assert_failure(moecl_context *ctx, moecl_status st, cl_int want, const char *call, int arg,
                           int enqueued, const char *label)
{
    ck_assert_msg(st == (moecl_status)want, "%s: status %d (%s), expected %d (%s); message: %s", label, (int)st,
                  moecl_status_string(st), (int)want, moecl_status_string((moecl_status)want),
                  moecl_context_error(ctx));
    char expect[256];
    if (arg >= 0)
        snprintf(expect, sizeof(expect), "%s(%s, arg %d) failed: %s", call, fired_kernel, arg,
                 moecl_status_string((moecl_status)want));
    else
        snprintf(expect, sizeof(expect), "%s(%s) failed: %s", call, fired_kernel,
                 moecl_status_string((moecl_status)want));
    ck_assert_msg(fired_kernel[0], "%s: the fault never fired", label);
    ck_assert_msg(strstr(moecl_context_error(ctx), expect), "%s: message \"%s\" does not say \"%s\"", label,
                  moecl_context_error(ctx), expect);
    ck_assert_msg(num_watched == enqueued, "%s: %d commands were enqueued before the failure, expected %d", label,
                  num_watched, enqueued);
    for (int i = 0; i < num_watched && i < MAX_WATCHED; i++) {
        cl_int status = CL_QUEUED;
        ck_assert_int_eq(clGetEventInfo(watched[i], CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(status), &status, NULL),
                         CL_SUCCESS);
        ck_assert_msg(status == CL_COMPLETE, "%s: command %d of the failed call was still %d when it returned", label,
                      i, (int)status);
    }
}

/* Every byte of the whole buffer (the tensor and the poison around it)
 * still poison. */
static void assert_untouched(moecl_context *ctx, moecl_buffer b, const char *what, const char *label)
{
    size_t size = 0;
    ck_assert_int_eq(clGetMemObjectInfo(b.mem, CL_MEM_SIZE, sizeof(size), &size, NULL), CL_SUCCESS);
    unsigned char *bytes = malloc(size);
    ck_assert_ptr_nonnull(bytes);
    ck_assert_int_eq(clEnqueueReadBuffer(moecl_context_queue(ctx), b.mem, CL_TRUE, 0, size, bytes, 0, NULL, NULL),
                     CL_SUCCESS);
    size_t x = 0;
    while (x < size && bytes[x] == HARNESS_POISON)
        x++;
    free(bytes);
    ck_assert_msg(x == size, "%s: %s byte %zu of %zu changed by the failed call", label, what, x, size);
}

static void assert_host_untouched(const void *p, size_t size, const char *what, const char *label)
{
    const unsigned char *bytes = p;
    size_t x = 0;
    while (x < size && bytes[x] == HARNESS_POISON)
        x++;
    ck_assert_msg(x == size, "%s: %s byte %zu of %zu changed by the failed call", label, what, x, size);
}

/* moe_align's buffers for d and ids, outputs poisoned. */
enum { A_IDS, A_COUNTS, A_SORTED, A_BLOCKS, A_POST, A_SLOTS, A_INVALID, A_NUM };
static const char *const align_names[A_NUM] = {"topk_ids",         "expert_counts",  "sorted_token_ids",
                                               "block_expert_ids", "num_tokens_post_padded", "slot_positions",
                                               "num_invalid"};

static void align_buffers(moecl_context *ctx, const moecl_moe_align_desc *d, const int32_t *ids, moecl_buffer *b)
{
    const size_t slots = (size_t)d->num_tokens * d->top_k, mp = (size_t)moecl_moe_align_max_padded(d);
    const size_t sizes[A_NUM] = {slots * 4, (size_t)d->num_experts * 4, mp * 4, mp / d->block_size * 4, 4,
                                 slots * 4, 4};
    for (int i = 0; i < A_NUM; i++)
        b[i] = harness_buffer(ctx, sizes[i], 4 * (size_t)(i + 1), i == A_IDS ? ids : NULL);
}

/* wait: an event for the call's wait list, or NULL. */
static moecl_status align_call(moecl_context *ctx, const moecl_moe_align_desc *d, const moecl_buffer *b,
                               cl_event wait, cl_event *done)
{
    return moecl_moe_align(ctx, d, b[A_IDS], b[A_COUNTS], b[A_SORTED], b[A_BLOCKS], b[A_POST], b[A_SLOTS],
                           b[A_INVALID], wait ? 1 : 0, wait ? &wait : NULL, done);
}

/* The outputs of mask (bits of A_*) are untouched. */
static void assert_align_untouched(moecl_context *ctx, const moecl_buffer *b, unsigned mask, const char *label)
{
    for (int i = A_COUNTS; i < A_NUM; i++)
        if (mask & (1u << i))
            assert_untouched(ctx, b[i], align_names[i], label);
}

#define ALIGN_OUTPUTS ((1u << A_NUM) - 2) /* all but topk_ids */
/* What the scatter writes; the scan before it writes the rest. */
#define ALIGN_SCATTERED (1u << A_SORTED | 1u << A_BLOCKS | 1u << A_SLOTS)

static void align_ids(const moecl_moe_align_desc *d, int32_t *ids)
{
    harness_rng rng = harness_rng_for(7100);
    const size_t slots = (size_t)d->num_tokens * d->top_k;
    for (size_t s = 0; s < slots; s++)
        ids[s] = s % 29 == 0 ? -1 : (int32_t)(harness_rand_u32(&rng) % d->num_experts);
}

/* A successful call on ctx after the failures: right, every output. */
static void assert_align_right(moecl_context *ctx, const moecl_moe_align_desc *d, const int32_t *ids,
                               const char *label)
{
    moecl_buffer b[A_NUM];
    align_buffers(ctx, d, ids, b);
    cl_event done = NULL;
    moecl_status st = align_call(ctx, d, b, NULL, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", label, moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    const size_t slots = (size_t)d->num_tokens * d->top_k, mp = (size_t)moecl_moe_align_max_padded(d);
    int32_t *counts = malloc(d->num_experts * 4), *sorted = malloc(mp * 4), *blocks = malloc(mp / d->block_size * 4),
            *pos = malloc(slots * 4), post, invalid;
    ck_assert(counts && sorted && blocks && pos);
    harness_read(ctx, b[A_COUNTS], d->num_experts * 4, counts);
    harness_read(ctx, b[A_SORTED], mp * 4, sorted);
    harness_read(ctx, b[A_BLOCKS], mp / d->block_size * 4, blocks);
    harness_read(ctx, b[A_POST], 4, &post);
    harness_read(ctx, b[A_SLOTS], slots * 4, pos);
    harness_read(ctx, b[A_INVALID], 4, &invalid);
    char msg[256];
    ck_assert_msg(ref_check_moe_align(d, ids, counts, sorted, blocks, &post, pos, &invalid, msg, sizeof(msg)) == 0,
                  "%s: %s", label, msg);
    free(counts);
    free(sorted);
    free(blocks);
    free(pos);
    for (int i = 0; i < A_NUM; i++)
        harness_release(b[i]);
}

/* A wait-list event that another thread completes 200 ms after it is
 * made: a failed call that waits for what it enqueued returns only after
 * that, with those commands complete; one that does not returns while they
 * are still queued. Static: the thread outlives a failed assertion. */
static struct later {
    cl_event ev;
    pthread_t thread;
} later;

static void *complete_later(void *arg)
{
    (void)arg;
    usleep(200 * 1000);
    clSetUserEventStatus(later.ev, CL_COMPLETE);
    return NULL;
}

static cl_event later_start(moecl_context *ctx)
{
    cl_int err;
    later.ev = clCreateUserEvent(moecl_context_cl_context(ctx), &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    ck_assert_int_eq(pthread_create(&later.thread, NULL, complete_later, NULL), 0);
    return later.ev;
}

static void later_end(void)
{
    ck_assert_int_eq(pthread_join(later.thread, NULL), 0);
    clReleaseEvent(later.ev);
}

/* One failing moe_align call: faults armed, the status, message and
 * commands as assert_failure checks them, and the outputs of `untouched`
 * unchanged. late: the call waits on later's event. */
static void align_fault(moecl_context *ctx, const moecl_moe_align_desc *d, const int32_t *ids, const fault *faults,
                        int n, const char *call, int arg, int enqueued, unsigned untouched, bool late,
                        const char *label)
{
    moecl_buffer b[A_NUM];
    align_buffers(ctx, d, ids, b);
    arm(faults, n);
    cl_event done = NULL;
    moecl_status st = align_call(ctx, d, b, late ? later_start(ctx) : NULL, &done);
    ck_assert_msg(done == NULL, "%s: the failed call returned an event", label);
    assert_failure(ctx, st, faults[0].code, call, arg, enqueued, label);
    if (late)
        later_end();
    disarm();
    assert_align_untouched(ctx, b, untouched, label);
    for (int i = 0; i < A_NUM; i++)
        harness_release(b[i]);
}

/* The moe_align cases of both paths on ctx (its own queue, or an adopted
 * out-of-order one). */
static void align_faults_on(moecl_context *ctx, const char *queue)
{
    /* 256 slots: one chunk, so the chunked path runs all three kernels. */
    const moecl_moe_align_desc d = moecl_moe_align_desc_init(64, 4, 16, 8);
    int32_t ids[256];
    align_ids(&d, ids);
    char label[160];
    const moecl_align_path path = ctx->info.env.align_path;
    ctx->info.env.align_path = MOECL_ALIGN_CHUNKED;
    /* Argument errors of a later kernel: found before anything is
     * enqueued, reported with the first failing call's own code (a second
     * failing argument must not change it). */
    const fault scatter_arg[] = {{FAULT_SET_ARG, "moe_align_scatter", 7, CL_INVALID_MEM_OBJECT},
                                 {FAULT_SET_ARG, "moe_align_scatter", 15, CL_INVALID_ARG_VALUE}};
    snprintf(label, sizeof(label), "%s, chunked, scatter arg 7", queue);
    align_fault(ctx, &d, ids, scatter_arg, 2, "clSetKernelArg", 7, 0, ALIGN_OUTPUTS, false, label);
    const fault scan_arg[] = {{FAULT_SET_ARG, "moe_align_scan", 4, CL_INVALID_MEM_OBJECT}};
    snprintf(label, sizeof(label), "%s, chunked, scan arg 4", queue);
    align_fault(ctx, &d, ids, scan_arg, 1, "clSetKernelArg", 4, 0, ALIGN_OUTPUTS, false, label);
    /* The driver refusing an enqueue: the first leaves nothing; the scan
     * leaves the count kernel, which writes only scratch; the scatter
     * leaves the count and the scan, which wrote expert_counts,
     * num_tokens_post_padded and num_invalid (unspecified now), but not
     * what the scatter writes. Either way what ran is waited for. */
    const fault count_enq[] = {{FAULT_ENQUEUE, "moe_align_count", -1, CL_OUT_OF_RESOURCES}};
    snprintf(label, sizeof(label), "%s, chunked, count enqueue", queue);
    align_fault(ctx, &d, ids, count_enq, 1, "clEnqueueNDRangeKernel", -1, 0, ALIGN_OUTPUTS, false, label);
    const fault scan_enq[] = {{FAULT_ENQUEUE, "moe_align_scan", -1, CL_OUT_OF_RESOURCES}};
    snprintf(label, sizeof(label), "%s, chunked, scan enqueue", queue);
    align_fault(ctx, &d, ids, scan_enq, 1, "clEnqueueNDRangeKernel", -1, 1, ALIGN_OUTPUTS, false, label);
    const fault scatter_enq[] = {{FAULT_ENQUEUE, "moe_align_scatter", -1, CL_OUT_OF_HOST_MEMORY}};
    snprintf(label, sizeof(label), "%s, chunked, scatter enqueue", queue);
    align_fault(ctx, &d, ids, scatter_enq, 1, "clEnqueueNDRangeKernel", -1, 2, ALIGN_SCATTERED, false, label);
    snprintf(label, sizeof(label), "%s, chunked, scatter enqueue, wait list pending", queue);
    align_fault(ctx, &d, ids, scatter_enq, 1, "clEnqueueNDRangeKernel", -1, 2, ALIGN_SCATTERED, true, label);
    snprintf(label, sizeof(label), "%s, chunked, after the failures", queue);
    assert_align_right(ctx, &d, ids, label);

    ctx->info.env.align_path = MOECL_ALIGN_ONE_GROUP;
    const fault one_arg[] = {{FAULT_SET_ARG, "moe_align_one_group", 9, CL_INVALID_MEM_OBJECT}};
    snprintf(label, sizeof(label), "%s, one group, arg 9", queue);
    align_fault(ctx, &d, ids, one_arg, 1, "clSetKernelArg", 9, 0, ALIGN_OUTPUTS, false, label);
    const fault one_enq[] = {{FAULT_ENQUEUE, "moe_align_one_group", -1, CL_OUT_OF_RESOURCES}};
    snprintf(label, sizeof(label), "%s, one group, enqueue", queue);
    align_fault(ctx, &d, ids, one_enq, 1, "clEnqueueNDRangeKernel", -1, 0, ALIGN_OUTPUTS, false, label);
    snprintf(label, sizeof(label), "%s, one group, after the failures", queue);
    assert_align_right(ctx, &d, ids, label);

    /* The fused kernel: its arguments; the fill of its ticket, which comes
     * first where the scratch's ticket is not known to be 0 (here: the
     * chunked path used it last; every call on an out-of-order queue); its
     * enqueue after that fill, and on an in-order queue without one once a
     * fused call has left the ticket 0. Only the scratch changes. */
    ctx->info.env.align_path = MOECL_ALIGN_FUSED;
    const fault fused_arg[] = {{FAULT_SET_ARG, "moe_align_fused", 9, CL_INVALID_MEM_OBJECT}};
    snprintf(label, sizeof(label), "%s, fused, arg 9", queue);
    align_fault(ctx, &d, ids, fused_arg, 1, "clSetKernelArg", 9, 0, ALIGN_OUTPUTS, false, label);
    const fault ticket_fill[] = {{FAULT_FILL, "the moe_align ticket", -1, CL_OUT_OF_RESOURCES}};
    snprintf(label, sizeof(label), "%s, fused, ticket fill", queue);
    align_fault(ctx, &d, ids, ticket_fill, 1, "clEnqueueFillBuffer", -1, 0, ALIGN_OUTPUTS, false, label);
    const fault fused_enq[] = {{FAULT_ENQUEUE, "moe_align_fused", -1, CL_OUT_OF_RESOURCES}};
    snprintf(label, sizeof(label), "%s, fused, enqueue after the fill", queue);
    align_fault(ctx, &d, ids, fused_enq, 1, "clEnqueueNDRangeKernel", -1, 1, ALIGN_OUTPUTS, false, label);
    snprintf(label, sizeof(label), "%s, fused, after the failures", queue);
    assert_align_right(ctx, &d, ids, label);
    snprintf(label, sizeof(label), "%s, fused, enqueue, ticket left 0", queue);
    align_fault(ctx, &d, ids, fused_enq, 1, "clEnqueueNDRangeKernel", -1, ctx->in_order ? 0 : 1, ALIGN_OUTPUTS,
                false, label);
    snprintf(label, sizeof(label), "%s, fused, after the enqueue failure", queue);
    assert_align_right(ctx, &d, ids, label);

    /* The parallel fused kernel: one command, no scratch. */
    ctx->info.env.align_path = MOECL_ALIGN_FUSED_PARALLEL;
    const fault par_arg[] = {{FAULT_SET_ARG, "moe_align_fused_parallel", 8, CL_INVALID_MEM_OBJECT}};
    snprintf(label, sizeof(label), "%s, fused-parallel, arg 8", queue);
    align_fault(ctx, &d, ids, par_arg, 1, "clSetKernelArg", 8, 0, ALIGN_OUTPUTS, false, label);
    const fault par_enq[] = {{FAULT_ENQUEUE, "moe_align_fused_parallel", -1, CL_OUT_OF_RESOURCES}};
    snprintf(label, sizeof(label), "%s, fused-parallel, enqueue", queue);
    align_fault(ctx, &d, ids, par_enq, 1, "clEnqueueNDRangeKernel", -1, 0, ALIGN_OUTPUTS, false, label);
    snprintf(label, sizeof(label), "%s, fused-parallel, after the failures", queue);
    assert_align_right(ctx, &d, ids, label);
    ctx->info.env.align_path = path;
}

/* Top-k gating: 37 tokens of 32 experts, f32 (not the f16 shapes of issue
 * 12's CPU-kernel fault). */
enum { G_GATING, G_WEIGHTS, G_IDS, G_COUNTS, G_NUM };

static void gating_buffers(moecl_context *ctx, const moecl_topk_gating_desc *d, moecl_buffer *b)
{
    harness_rng rng = harness_rng_for(7200);
    const size_t t = d->num_tokens, e = d->num_experts, k = d->top_k;
    float *logits = harness_random_tensor(&rng, MOECL_F32, t * e, 2.0f);
    b[G_GATING] = harness_buffer(ctx, t * e * 4, 8, logits);
    b[G_WEIGHTS] = harness_buffer(ctx, t * k * 4, 4, NULL);
    b[G_IDS] = harness_buffer(ctx, t * k * 4, 12, NULL);
    b[G_COUNTS] = harness_buffer(ctx, e * 4, 16, NULL);
    free(logits);
}

static void gating_fault(moecl_context *ctx, bool with_counts, const fault *faults, int n, const char *call, int arg,
                         int enqueued, bool counts_untouched, bool late, const char *label)
{
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(37, 32, 4);
    moecl_buffer b[G_NUM], none = {NULL, 0};
    gating_buffers(ctx, &d, b);
    arm(faults, n);
    cl_event done = NULL, wait = late ? later_start(ctx) : NULL;
    const cl_uint num_wait = wait ? 1 : 0;
    const cl_event *waits = wait ? &wait : NULL;
    moecl_status st =
        with_counts ? moecl_topk_gating_with_counts(ctx, &d, b[G_GATING], none, b[G_WEIGHTS], b[G_IDS], b[G_COUNTS],
                                                    num_wait, waits, &done)
                    : moecl_topk_gating(ctx, &d, b[G_GATING], none, b[G_WEIGHTS], b[G_IDS], num_wait, waits, &done);
    ck_assert_msg(done == NULL, "%s: the failed call returned an event", label);
    assert_failure(ctx, st, faults[0].code, call, arg, enqueued, label);
    if (late)
        later_end();
    disarm();
    assert_untouched(ctx, b[G_WEIGHTS], "topk_weights", label);
    assert_untouched(ctx, b[G_IDS], "topk_ids", label);
    if (counts_untouched)
        assert_untouched(ctx, b[G_COUNTS], "expert_counts", label);
    for (int i = 0; i < G_NUM; i++)
        harness_release(b[i]);
}

/* The error of the first failing argument is the one reported, and a
 * failed binding leaves nothing enqueued and every output byte as it was:
 * each op, both moe_align paths, both queue kinds where the device has
 * out-of-order queues; and the calls that follow are right. */
START_TEST(test_failed_argument)
{
    moecl_context *ctx = harness_context();
    /* Without a bias: gating, weights, ids (2), then the scalars (3), or
     * the counts (3) and the scalars (4). */
    const fault gating_args[] = {{FAULT_SET_ARG, "topk_gating", 2, CL_INVALID_MEM_OBJECT},
                                 {FAULT_SET_ARG, "topk_gating", 3, CL_INVALID_ARG_SIZE}};
    gating_fault(ctx, false, gating_args, 2, "clSetKernelArg", 2, 0, true, false, "topk_gating, arg 2");
    gating_fault(ctx, true, gating_args, 2, "clSetKernelArg", 2, 0, true, false, "topk_gating_with_counts, arg 2");
    const fault counts_arg[] = {{FAULT_SET_ARG, "topk_gating", 3, CL_INVALID_MEM_OBJECT}};
    gating_fault(ctx, true, counts_arg, 1, "clSetKernelArg", 3, 0, true, false, "topk_gating_with_counts, arg 3");
    const moecl_topk_gating_desc t = moecl_topk_gating_desc_init(37, 32, 4);
    check_topk(ctx, &t, false, 7300, "topk_gating after the failures");

    /* The grounded router: an argument error with another after it. */
    const moecl_grounded_router_desc r = grounded16();
    harness_rng rng = harness_rng_for(7400);
    const size_t n = r.num_tokens, h = r.hidden_dim, e = r.num_experts, k = r.top_k;
    float *hidden = harness_random_tensor(&rng, MOECL_F32, n * h, 0.1f);
    float *logits = harness_random_tensor(&rng, MOECL_F32, n * e, 1.0f);
    float *ground = harness_random_tensor(&rng, MOECL_F32, e * h, 1.0f);
    moecl_buffer hb = harness_buffer(ctx, n * h * 4, 0, hidden), lb = harness_buffer(ctx, n * e * 4, 4, logits),
                 gb = harness_buffer(ctx, e * h * 4, 8, ground), pb = harness_buffer(ctx, n * k * 8, 4, NULL),
                 wb = harness_buffer(ctx, n * k * 4, 8, NULL), ib = harness_buffer(ctx, n * k * 4, 12, NULL);
    const fault router_args[] = {{FAULT_SET_ARG, "grounded_router", 12, CL_INVALID_ARG_SIZE},
                                 {FAULT_SET_ARG, "grounded_router", 13, CL_INVALID_ARG_VALUE}};
    arm(router_args, 2);
    cl_event done = NULL;
    moecl_status st = moecl_grounded_router(ctx, &r, hb, lb, gb, pb, wb, ib, 0, NULL, &done);
    ck_assert_ptr_null(done);
    assert_failure(ctx, st, CL_INVALID_ARG_SIZE, "clSetKernelArg", 12, 0, "grounded_router, arg 12");
    disarm();
    assert_untouched(ctx, pb, "out_pairs", "grounded_router, arg 12");
    assert_untouched(ctx, wb, "topk_weights", "grounded_router, arg 12");
    assert_untouched(ctx, ib, "topk_ids", "grounded_router, arg 12");
    moecl_buffer all[] = {hb, lb, gb, pb, wb, ib};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        harness_release(all[i]);
    free(hidden);
    free(logits);
    free(ground);
    check_grounded(ctx, &r, 7401, "grounded_router after the failures");
    moecl_context_destroy(ctx);
}
END_TEST

/* What a call leaves when an enqueue after its first fails (the driver's
 * CL_OUT_OF_RESOURCES and the like): moe_align's chained kernels on both
 * queue kinds, its host path, and the zero fill of
 * moecl_topk_gating_with_counts. */
START_TEST(test_failed_enqueue)
{
    moecl_context *ctx = harness_context();
    align_faults_on(ctx, "in-order queue");

    /* The host path: no host byte written. */
    const moecl_moe_align_desc d = moecl_moe_align_desc_init(64, 4, 16, 8);
    int32_t ids[256], counts[16], sorted[256 + 16 * 7], blocks[(256 + 16 * 7) / 8], post, pos[256], invalid;
    align_ids(&d, ids);
    const moecl_align_path path = ctx->info.env.align_path;
    ctx->info.env.align_path = MOECL_ALIGN_CHUNKED;
    const fault scatter_enq[] = {{FAULT_ENQUEUE, "moe_align_scatter", -1, CL_OUT_OF_RESOURCES}};
    memset(counts, HARNESS_POISON, sizeof(counts));
    memset(sorted, HARNESS_POISON, sizeof(sorted));
    memset(blocks, HARNESS_POISON, sizeof(blocks));
    memset(&post, HARNESS_POISON, sizeof(post));
    memset(pos, HARNESS_POISON, sizeof(pos));
    memset(&invalid, HARNESS_POISON, sizeof(invalid));
    arm(scatter_enq, 1);
    moecl_status st = moecl_moe_align_host(ctx, &d, ids, counts, sorted, blocks, &post, pos, &invalid);
    assert_failure(ctx, st, CL_OUT_OF_RESOURCES, "clEnqueueNDRangeKernel", -1, 2, "moe_align_host, scatter enqueue");
    disarm();
    assert_host_untouched(counts, sizeof(counts), "expert_counts", "moe_align_host");
    assert_host_untouched(sorted, sizeof(sorted), "sorted_token_ids", "moe_align_host");
    assert_host_untouched(blocks, sizeof(blocks), "block_expert_ids", "moe_align_host");
    assert_host_untouched(&post, sizeof(post), "num_tokens_post_padded", "moe_align_host");
    assert_host_untouched(pos, sizeof(pos), "slot_positions", "moe_align_host");
    assert_host_untouched(&invalid, sizeof(invalid), "num_invalid", "moe_align_host");
    ctx->info.env.align_path = path;

    /* With counts: a failed fill leaves nothing; a failed kernel enqueue
     * leaves the fill, waited for (expert_counts unspecified), and the
     * kernel's outputs untouched. */
    const fault fill[] = {{FAULT_FILL, "expert_counts", -1, CL_OUT_OF_RESOURCES}};
    gating_fault(ctx, true, fill, 1, "clEnqueueFillBuffer", -1, 0, true, false, "topk_gating_with_counts, fill");
    const fault kernel_enq[] = {{FAULT_ENQUEUE, "topk_gating", -1, CL_OUT_OF_RESOURCES}};
    gating_fault(ctx, true, kernel_enq, 1, "clEnqueueNDRangeKernel", -1, 1, false, false,
                 "topk_gating_with_counts, kernel enqueue");
    /* The fill waits on an event not yet complete when the kernel's
     * enqueue fails: the call returns only once the fill ran. */
    gating_fault(ctx, true, kernel_enq, 1, "clEnqueueNDRangeKernel", -1, 1, false, true,
                 "topk_gating_with_counts, kernel enqueue, wait list pending");
    gating_fault(ctx, false, kernel_enq, 1, "clEnqueueNDRangeKernel", -1, 0, true, false,
                 "topk_gating, kernel enqueue");

    cl_device_id dev = moecl_context_device(ctx);
    cl_command_queue_properties props = 0;
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_QUEUE_PROPERTIES, sizeof(props), &props, NULL), CL_SUCCESS);
    if (props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) {
        cl_int err;
        cl_command_queue ooo =
            clCreateCommandQueue(moecl_context_cl_context(ctx), dev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
        moecl_context *adopted = NULL;
        ck_assert_int_eq(moecl_context_create_from_cl(moecl_context_cl_context(ctx), dev, ooo, &adopted),
                         MOECL_SUCCESS);
        align_faults_on(adopted, "out-of-order queue");
        moecl_context_destroy(adopted);
        clReleaseCommandQueue(ooo);
    } else {
        fprintf(stderr, "launch: the device has no out-of-order queues; test_failed_enqueue checks the in-order "
                        "queue only\n");
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* A device-table limit of 0 for the parallel fused kernel means never
 * by default (docs/routing.md, section 7), for an empty call too: with
 * that kernel's enqueue armed to fail, empty and one-token calls of both
 * classes take another path and come out right. */
START_TEST(test_align_parallel_limit_zero)
{
    moecl_context *ctx = harness_context();
    ctx->info.env.align_path = MOECL_ALIGN_AUTO;
    const fault parallel_enq[] = {{FAULT_ENQUEUE, "moe_align_fused_parallel", -1, CL_OUT_OF_RESOURCES}};
    for (int c = 0; c < 2; c++) {
        ctx->info.launch_class = c ? MOECL_LAUNCH_GPU : MOECL_LAUNCH_CPU;
        const char *cls = c ? "gpu" : "cpu";
        if (moecl_device_param_class(&ctx->params, MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_CPU, ctx->info.launch_class)) {
            fprintf(stderr, "launch: the %s class takes the parallel kernel by default here; not checked\n", cls);
            continue;
        }
        for (uint32_t tokens = 0; tokens <= 1; tokens++) {
            const moecl_moe_align_desc d = moecl_moe_align_desc_init(tokens, 4, 16, 8);
            const int32_t ids[4] = {3, -1, 3, 15};
            int32_t counts[16], sorted[4 + 16 * 7], blocks[(4 + 16 * 7) / 8], post, pos[4], invalid;
            arm(parallel_enq, 1);
            const moecl_status st = moecl_moe_align_host(ctx, &d, ids, counts, sorted, blocks, &post, pos, &invalid);
            disarm();
            ck_assert_msg(st == MOECL_SUCCESS, "%s class, %u tokens: %s: %s", cls, tokens, moecl_status_string(st),
                          moecl_context_error(ctx));
            char msg[256] = "";
            ck_assert_msg(!ref_check_moe_align(&d, ids, counts, sorted, blocks, &post, pos, &invalid, msg,
                                               sizeof(msg)),
                          "%s class, %u tokens: %s", cls, tokens, msg);
        }
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* A kernel whose CL_KERNEL_WORK_GROUP_SIZE is below the work-group the
 * call needs (registers can lower it below the device's limit): refused
 * before anything is enqueued, not after the kernels before it ran. The
 * limit is read when the variant is created, so the fault is armed before
 * the first call on a fresh context. The GPU class, so that moe_align's
 * scatter has work-groups of more than one. */
START_TEST(test_work_group_limit_first)
{
    moecl_context *ctx = harness_context();
    ctx->info.launch_class = MOECL_LAUNCH_GPU;
    ctx->info.env.align_path = MOECL_ALIGN_CHUNKED;
    const moecl_moe_align_desc d = moecl_moe_align_desc_init(64, 4, 16, 8);
    int32_t ids[256];
    align_ids(&d, ids);
    const fault scatter_limit[] = {{FAULT_WG_LIMIT, "moe_align_scatter", -1, 1}};
    moecl_buffer b[A_NUM];
    align_buffers(ctx, &d, ids, b);
    arm(scatter_limit, 1);
    moecl_status st = align_call(ctx, &d, b, NULL, NULL);
    ck_assert_msg(st == (moecl_status)CL_INVALID_WORK_GROUP_SIZE, "moe_align: status %d (%s): %s", (int)st,
                  moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_msg(strstr(moecl_context_error(ctx), "moe_align_scatter"), "moe_align: message \"%s\"",
                  moecl_context_error(ctx));
    ck_assert_msg(num_watched == 0, "moe_align: %d kernels enqueued before the refusal", num_watched);
    disarm();
    assert_align_untouched(ctx, b, ALIGN_OUTPUTS, "moe_align, scatter limit 1");
    for (int i = 0; i < A_NUM; i++)
        harness_release(b[i]);
    moecl_context_destroy(ctx);

    /* With counts: refused before the fill. */
    ctx = harness_context();
    const fault gating_limit[] = {{FAULT_WG_LIMIT, "topk_gating", -1, 1}};
    const moecl_topk_gating_desc t = moecl_topk_gating_desc_init(37, 32, 4);
    moecl_buffer g[G_NUM], none = {NULL, 0};
    gating_buffers(ctx, &t, g);
    /* A team kernel (its work-group size is compiled in) of more than one
     * work-item, whatever the device. */
    const moecl_launch_config team16 = cfg_team(16, 2);
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &team16);
    arm(gating_limit, 1);
    st = moecl_topk_gating_with_counts(ctx, &t, g[G_GATING], none, g[G_WEIGHTS], g[G_IDS], g[G_COUNTS], 0, NULL,
                                       NULL);
    ck_assert_msg(st == (moecl_status)CL_INVALID_WORK_GROUP_SIZE, "with counts: status %d (%s): %s", (int)st,
                  moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_msg(strstr(moecl_context_error(ctx), "topk_gating_team"), "with counts: message \"%s\"",
                  moecl_context_error(ctx));
    ck_assert_msg(num_watched == 0, "with counts: %d commands enqueued before the refusal", num_watched);
    disarm();
    assert_untouched(ctx, g[G_WEIGHTS], "topk_weights", "with counts, limit 1");
    assert_untouched(ctx, g[G_IDS], "topk_ids", "with counts, limit 1");
    assert_untouched(ctx, g[G_COUNTS], "expert_counts", "with counts, limit 1");
    for (int i = 0; i < G_NUM; i++)
        harness_release(g[i]);
    moecl_context_destroy(ctx);

    /* The rows kernel has no compiled-in work-group size: it runs in
     * work-groups of the kernel's limit instead (Intel's CPU runtime
     * reports 1 for rows of 4096 experts), and its results are right. */
    ctx = harness_context();
    const moecl_launch_config rows8 = cfg_rows(8);
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &rows8);
    arm(gating_limit, 1);
    check_topk(ctx, &t, false, 1400, "rows kernel, limit 1");
    disarm();
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Inline PTX by compute capability, and the portable fallback             */
/* ---------------------------------------------------------------------- */

/* An NVIDIA GPU as device.c would record it, H200-like apart from the
 * compute capability (0.0: cl_nv_device_attribute_query not listed). */
static moecl_device_info nvidia_gpu(cl_uint major, cl_uint minor)
{
    moecl_device_info info;
    memset(&info, 0, sizeof(info));
    snprintf(info.platform_name, sizeof(info.platform_name), "NVIDIA CUDA");
    snprintf(info.device_name, sizeof(info.device_name), "NVIDIA test GPU");
    info.type = CL_DEVICE_TYPE_GPU;
    info.vendor = MOECL_VENDOR_NVIDIA;
    info.compute_units = 132;
    info.local_mem_size = 49152;
    info.max_work_group_size = 1024;
    info.launch_class = MOECL_LAUNCH_GPU;
    info.launch_reason = "test";
    info.nv_compute_major = major;
    info.nv_compute_minor = minor;
    info.ptx = moecl_device_ptx(&info);
    return info;
}

static void assert_define(const char *text, const char *name, int value, const char *label)
{
    char want[64];
    snprintf(want, sizeof(want), "-D%s=%d", name, value);
    ck_assert_msg(strstr(text, want) != NULL, "%s: no %s in \"%s\"", label, want, text);
}

START_TEST(test_ptx_by_capability)
{
    static const struct {
        cl_uint major, minor;
        bool ptx;
    } cases[] = {{0, 0, false}, {5, 2, false}, {6, 1, false}, {7, 0, true}, {8, 6, true}, {9, 0, true}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        moecl_device_info info = nvidia_gpu(cases[c].major, cases[c].minor);
        char label[64];
        snprintf(label, sizeof(label), "NVIDIA, compute capability %u.%u", cases[c].major, cases[c].minor);
        ck_assert_msg(info.ptx == cases[c].ptx, "%s: PTX %s", label, info.ptx ? "on" : "off");
        const int want = cases[c].ptx ? 1 : 0;
        char *options = moecl_build_options(&info);
        ck_assert_ptr_nonnull(options);
        assert_define(options, "MOECL_PTX", want, label);
        assert_define(options, "MOECL_VENDOR_NVIDIA", 1, label); /* the vendor's other choices stay */
        free(options);
        /* Team 16, 8 rows: whole warps, so only PTX decides the shuffles. */
        char defines[1024];
        const char *kernel = NULL;
        const moecl_topk_gating_desc t = moecl_topk_gating_desc_init(1, 128, 8);
        moecl_topk_gating_defines(&info, &t, false, false, defines, sizeof(defines), &kernel);
        ck_assert_str_eq(kernel, "topk_gating_team");
        assert_define(defines, "TEAM", 16, label);
        assert_define(defines, "TEAM_SHUFFLE", want, label);
        const moecl_grounded_router_desc g = moecl_grounded_router_desc_init(1, 128, 16, 0.5f);
        moecl_grounded_router_defines(&info, &g, true, false, false, defines, sizeof(defines), &kernel);
        ck_assert_str_eq(kernel, "grounded_router_team");
        assert_define(defines, "TEAM_SHUFFLE", want, label);
        moecl_moe_align_defines(&info, defines, sizeof(defines), &kernel);
        assert_define(defines, "WARP_MATCH", want, label);
    }
    /* The capability of another vendor's device does not count. */
    moecl_device_info other = nvidia_gpu(9, 0);
    other.vendor = MOECL_VENDOR_AMD;
    ck_assert(!moecl_device_ptx(&other));

    /* The extension list is matched by whole names. */
    const char *const listed[] = {"cl_nv_device_attribute_query", "cl_khr_fp64 cl_nv_device_attribute_query",
                                  "cl_nv_device_attribute_query cl_nv_pragma_unroll",
                                  "cl_khr_fp64 cl_nv_device_attribute_query cl_nv_pragma_unroll "};
    const char *const unlisted[] = {"", "cl_khr_fp64", "cl_nv_device_attribute_query_x",
                                    "xcl_nv_device_attribute_query cl_khr_fp64", "cl_nv_device_attribute"};
    for (size_t i = 0; i < sizeof(listed) / sizeof(listed[0]); i++)
        ck_assert_msg(moecl_extension_listed(listed[i], "cl_nv_device_attribute_query"), "not found in \"%s\"",
                      listed[i]);
    for (size_t i = 0; i < sizeof(unlisted) / sizeof(unlisted[0]); i++)
        ck_assert_msg(!moecl_extension_listed(unlisted[i], "cl_nv_device_attribute_query"), "found in \"%s\"",
                      unlisted[i]);

    /* The device here: what it recorded, and what describe says. */
    moecl_context *ctx = harness_context();
    const moecl_device_info *i = &ctx->info;
    ck_assert(i->ptx == moecl_device_ptx(i));
    if (i->vendor == MOECL_VENDOR_NVIDIA)
        ck_assert_msg(i->nv_compute_major > 0, "an NVIDIA device without a compute capability (%s)", i->device_name);
    else
        ck_assert_msg(i->nv_compute_major == 0 && !i->ptx, "%s reports compute capability %u.%u", i->device_name,
                      i->nv_compute_major, i->nv_compute_minor);
    char text[8192];
    moecl_context_describe(ctx, text, sizeof(text));
    ck_assert_msg(strstr(text, i->ptx ? "inline PTX: on (compute capability" : "inline PTX: off (") != NULL,
                  "describe: %s", text);
    moecl_context_destroy(ctx);
}
END_TEST

/* A context on the device here that takes the PTX paths as on an NVIDIA
 * GPU of compute capability 9.0, although its compiler has no inline asm
 * (pocl and Intel's CPU runtime reject `asm`): every build with PTX fails,
 * so calls must be served by the portable fallback. */
static moecl_context *ptx_context(void)
{
    moecl_context *ctx = harness_context();
    ctx->info.nv_compute_major = 9;
    ctx->info.nv_compute_minor = 0;
    ctx->info.ptx = true;
    free(ctx->build_options);
    ctx->build_options = moecl_build_options(&ctx->info);
    ck_assert_ptr_nonnull(ctx->build_options);
    ck_assert_ptr_nonnull(strstr(ctx->build_options, "-DMOECL_PTX=1"));
    return ctx;
}

/* After the first call: the PTX build failed, the portable one served,
 * describe says so, and the recovered failure left no message. */
static void assert_fell_back(moecl_context *ctx, const char *label)
{
    ck_assert_msg(moecl_registry_ptx_failed(ctx->registry), "%s: no build with PTX failed", label);
    ck_assert_msg(strcmp(moecl_context_error(ctx), "") == 0, "%s: an error message after success: %s", label,
                  moecl_context_error(ctx));
    char text[8192];
    moecl_context_describe(ctx, text, sizeof(text));
    ck_assert_msg(strstr(text, "inline PTX: off (compute capability 9.0, but a build with it failed") != NULL,
                  "%s: describe: %s", label, text);
}

static void check_align(moecl_context *ctx, const moecl_moe_align_desc *d, uint64_t stream, const char *label)
{
    harness_rng rng = harness_rng_for(stream);
    const size_t slots = (size_t)d->num_tokens * d->top_k, e = d->num_experts;
    const size_t padded = (size_t)moecl_moe_align_max_padded(d), nblocks = padded / d->block_size;
    int32_t *ids = malloc(slots * 4), *counts = malloc(e * 4), *sorted = malloc(padded * 4);
    int32_t *blocks = malloc(nblocks * 4 + 4), *positions = malloc(slots * 4);
    int32_t post = -7, invalid = -7;
    ck_assert(ids && counts && sorted && blocks && positions);
    for (size_t i = 0; i < slots; i++) /* a few ids out of range: they count as invalid */
        ids[i] = harness_rand_u32(&rng) % 16 == 0 ? -1 : (int32_t)(harness_rand_u32(&rng) % e);
    memset(counts, HARNESS_POISON, e * 4);
    memset(sorted, HARNESS_POISON, padded * 4);
    memset(blocks, HARNESS_POISON, nblocks * 4);
    memset(positions, HARNESS_POISON, slots * 4);
    moecl_status st = moecl_moe_align_host(ctx, d, ids, counts, sorted, blocks, &post, positions, &invalid);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", label, moecl_status_string(st), moecl_context_error(ctx));
    char msg[512] = "";
    int bad = ref_check_moe_align(d, ids, counts, sorted, blocks, &post, positions, &invalid, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d differences; first: %s", label, bad, msg);
    free(ids);
    free(counts);
    free(sorted);
    free(blocks);
    free(positions);
}

START_TEST(test_ptx_build_falls_back)
{
    moecl_context *probe = harness_context();
    const bool native = probe->info.ptx;
    moecl_context_destroy(probe);
    if (native) {
        /* An NVIDIA GPU that builds the PTX: nothing to fall back from. */
        fprintf(stderr, "launch: the device builds inline PTX; the fallback test needs a device without asm\n");
        return;
    }
    /* Top-k gating, team 16 with 2 rows: one warp a group, shuffles. */
    moecl_context *ctx = ptx_context();
    const moecl_topk_gating_desc t = topk128();
    const moecl_launch_config team = cfg_team(16, 2);
    moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &team);
    check_topk(ctx, &t, false, 1200, "topk e=128 team 16x2, PTX build failing");
    assert_fell_back(ctx, "topk");
    check_topk(ctx, &t, true, 1201, "topk e=128 team 16x2 with bias, after the fallback");
    moecl_context_destroy(ctx);

    /* The grounded router's team kernel. */
    ctx = ptx_context();
    moecl_launch_force(ctx, MOECL_OP_GROUNDED_ROUTER, &team);
    const moecl_grounded_router_desc r = grounded16();
    check_grounded(ctx, &r, 1210, "grounded team 16x2, PTX build failing");
    assert_fell_back(ctx, "grounded");
    moecl_context_destroy(ctx);

    /* moe_align: one program for every path; the one-group kernel with the
     * warp path's arguments, and the chunked path. */
    ctx = ptx_context();
    const moecl_moe_align_desc a = moecl_moe_align_desc_init(37, 6, 40, 16);
    ctx->info.env.align_path = MOECL_ALIGN_ONE_GROUP;
    check_align(ctx, &a, 1220, "moe_align one-group, PTX build failing");
    assert_fell_back(ctx, "moe_align");
    ctx->info.env.align_path = MOECL_ALIGN_CHUNKED;
    check_align(ctx, &a, 1221, "moe_align chunked, after the fallback");
    moecl_context_destroy(ctx);
}
END_TEST

/* The parameter tables (src/variant.c): consistent, and the defines,
 * readable line and key that derive from one variant of each op. */
START_TEST(test_variant_tables)
{
    ck_assert_ptr_null(moecl_variant_check(&moecl_variant_topk_gating, NULL, MOECL_KERNEL_TEAM));
    ck_assert_ptr_null(moecl_variant_check(&moecl_variant_grounded_router, NULL, MOECL_KERNEL_TILED));
    moecl_context ctx;
    memset(&ctx, 0, sizeof(ctx));
    char text[512];

    /* DeepSeek-V3's gating in route dispatch's team kernel, with a floor. */
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 256, 8);
    d.num_expert_groups = 8;
    d.topk_group = 4;
    d.scoring = MOECL_SCORING_SIGMOID;
    d.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
    d.renormalize = true;
    d.renormalize_floor = 0x1p-14f;
    moecl_variant_values v;
    memset(&v, 0, sizeof(v));
    v.param[MOECL_TOPK_NUM_EXPERTS] = 256;
    v.param[MOECL_TOPK_TOPK] = 8;
    v.param[MOECL_TOPK_TEAM] = 32;
    v.param[MOECL_TOPK_ROWS] = 4;
    v.param[MOECL_TOPK_EPT] = 8;
    v.param[MOECL_TOPK_ROUTE_DISPATCH] = 1;
    v.param[MOECL_TOPK_FUSED_WG] = 128;
    const moecl_gating_source source = {&d, 8, 4, true};
    moecl_variant_gating(&v, &source);
    const moecl_variant_op *op = &moecl_variant_topk_gating;
    ck_assert_ptr_null(moecl_variant_check(op, &v, MOECL_KERNEL_TEAM));
    moecl_variant_defines(op, &v, MOECL_KERNEL_TEAM, text, sizeof(text));
    ck_assert_str_eq(text, "-DNUM_EXPERTS=256 -DTOPK=8 -DIN_DTYPE=0 -DSCORING=1 -DHAS_BIAS=1 -DNUM_GROUPS=8 "
                           "-DTOPK_GROUP=4 -DGROUP_SCORE=1 -DRENORMALIZE=1 -DTEAM=32 -DROWS=4 -DTEAM_SHUFFLE=0 "
                           "-DEPT=8 -DCPU_DEVICE=0 -DRENORM_FLOOR=0x1p-14f -DROUTE_DISPATCH=1 -DFUSED_WG=128");
    moecl_variant_text(op, &v, MOECL_KERNEL_TEAM, text, sizeof(text));
    ck_assert_str_eq(text, "topk_gating team: experts=256 top_k=8 dtype=f32 scoring=sigmoid bias groups=8 "
                           "topk_group=4 group_score=top2-sum renormalize floor=6.10352e-05 team=32 rows=4 ept=8 "
                           "dispatch fused_wg=128");
    /* The rows kernel reads no dispatch; a short buffer ends the text. */
    moecl_variant_defines(op, &v, MOECL_KERNEL_ROWS, text, sizeof(text));
    ck_assert_ptr_null(strstr(text, "DISPATCH"));
    moecl_variant_defines(op, &v, MOECL_KERNEL_TEAM, text, 12);
    ck_assert_str_eq(text, "-DNUM_EXPER");
    /* Each field of the key apart, the one the two words split included. */
    const moecl_plan_key base = moecl_variant_key(&ctx, op, &v);
    moecl_variant_values w = v;
    w.param[MOECL_TOPK_TEAM] = 64; /* the launch shape is not in the key */
    moecl_plan_key k = moecl_variant_key(&ctx, op, &w);
    ck_assert(k.a == base.a && k.b == base.b);
    d.renormalize_floor = 0x1p-13f; /* the floor's low bits are in the first word, the high in the second */
    moecl_variant_gating(&w, &source);
    k = moecl_variant_key(&ctx, op, &w);
    ck_assert(k.a == base.a && k.b != base.b);
    d.renormalize_floor = 0x1p-14f;
    d.weighting = MOECL_WEIGHTS_SIGMOID_CHOSEN;
    moecl_variant_gating(&w, &source);
    k = moecl_variant_key(&ctx, op, &w);
    ck_assert(k.b != base.b);
    d.weighting = MOECL_WEIGHTS_SCORE;
    w = v;
    w.param[MOECL_TOPK_TOPK] = 65;
    ck_assert_str_eq(moecl_variant_check(op, &w, MOECL_KERNEL_TEAM), "TOPK");

    /* The grounded router's tiled kernel: the tile's VEC, DB and WC, no
     * mma parameters, the gating block's zeros. */
    const moecl_topk_gating_desc raw = moecl_topk_gating_desc_init(1, 128, 8);
    const moecl_gating_source none = {&raw, 0, 0, false};
    memset(&v, 0, sizeof(v));
    const unsigned grounded[][2] = {
        {MOECL_GROUNDED_HIDDEN_DIM, 4096}, {MOECL_GROUNDED_NUM_EXPERTS, 128}, {MOECL_GROUNDED_TOPK, 8},
        {MOECL_GROUNDED_IN_DTYPE, 2},      {MOECL_GROUNDED_HAS_PAIRS, 1},     {MOECL_GROUNDED_HAS_LOGITS, 1},
        {MOECL_GROUNDED_KERNEL, 2},        {MOECL_GROUNDED_TM, 64},           {MOECL_GROUNDED_TN, 128},
        {MOECL_GROUNDED_TK, 16},           {MOECL_GROUNDED_MT, 8},            {MOECL_GROUNDED_NT, 4},
        {MOECL_GROUNDED_TEAM, 1},          {MOECL_GROUNDED_ROWS, 1},          {MOECL_GROUNDED_EPT, 1},
        {MOECL_GROUNDED_VEC, 4},           {MOECL_GROUNDED_DB, 1},            {MOECL_GROUNDED_WC, 8},
        {MOECL_GROUNDED_MMA_MI, 2},        {MOECL_GROUNDED_FUSED_WG, 1}};
    for (size_t i = 0; i < sizeof(grounded) / sizeof(grounded[0]); i++)
        v.param[grounded[i][0]] = grounded[i][1];
    moecl_variant_gating(&v, &none);
    op = &moecl_variant_grounded_router;
    ck_assert_ptr_null(moecl_variant_check(op, &v, MOECL_KERNEL_TILED));
    moecl_variant_defines(op, &v, MOECL_KERNEL_TILED, text, sizeof(text));
    ck_assert_str_eq(text, "-DHIDDEN_DIM=4096 -DNUM_EXPERTS=128 -DTOPK=8 -DIN_DTYPE=2 -DHAS_PAIRS=1 -DHAS_WEIGHTS=0 "
                           "-DHAS_IDS=0 -DSCORING=0 -DHAS_BIAS=0 -DNUM_GROUPS=0 -DTOPK_GROUP=0 -DGROUP_SCORE=0 "
                           "-DRENORMALIZE=0 -DKERNEL=2 -DTM=64 -DTN=128 -DTK=16 -DMT=8 -DNT=4 -DTEAM=1 -DROWS=1 "
                           "-DEPT=1 -DTEAM_SHUFFLE=0 -DVEC=4 -DDB=1 -DWC=8");
    /* Groups of up to 4096 experts: topk_group's field spans the words. */
    const moecl_plan_key gbase = moecl_variant_key(&ctx, op, &v);
    const moecl_gating_source wide = {&raw, 4096, 4096, false};
    w = v;
    moecl_variant_gating(&w, &wide);
    k = moecl_variant_key(&ctx, op, &w);
    ck_assert(k.a != gbase.a && k.b != gbase.b);
    /* Shared experts fill the fourth word, the first three stay: their
     * count, the constant weight's bits, the gate; named in the defines
     * only where set. */
    ck_assert(gbase.d == 0);
    const unsigned shared_params[] = {MOECL_GROUNDED_SHARED, MOECL_GROUNDED_SHARED_WEIGHT,
                                      MOECL_GROUNDED_SHARED_GATE};
    const uint32_t shared_values[] = {63, 0x3ecccccdu /* 0.4f */, 1};
    moecl_plan_key last = gbase;
    w = v;
    for (size_t i = 0; i < 3; i++) {
        w.param[shared_params[i]] = shared_values[i];
        k = moecl_variant_key(&ctx, op, &w);
        ck_assert(k.a == gbase.a && k.b == gbase.b && k.c == gbase.c && k.d != last.d);
        last = k;
    }
    ck_assert_ptr_null(moecl_variant_check(op, &w, MOECL_KERNEL_TILED));
    moecl_variant_defines(op, &w, MOECL_KERNEL_TILED, text, sizeof(text));
    ck_assert_ptr_nonnull(strstr(text, " -DSHARED=63 -DSHARED_WEIGHT=0x1.99999ap-2f -DSHARED_GATE=1"));
    w.param[MOECL_GROUNDED_SHARED] = 64;
    ck_assert_str_eq(moecl_variant_check(op, &w, MOECL_KERNEL_TILED), "SHARED");
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    faults_init();
    Suite *s = suite_create("launch");
    TCase *tc = tcase_create("tune_file");
    tcase_set_timeout(tc, 600);
    tcase_add_checked_fixture(tc, env_setup, env_teardown);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_garbage_ignored);
    tcase_add_test(tc, test_invalid_config_ignored);
    tcase_add_test(tc, test_rows_per_group_bit_identical);
    tcase_add_test(tc, test_precedence);
    tcase_add_test(tc, test_device_table);
    tcase_add_test(tc, test_override_text);
    tcase_add_test(tc, test_configs_correct);
    tcase_add_test(tc, test_plan_cache);
    tcase_add_test(tc, test_plan_buffer_released);
    tcase_add_test(tc, test_plan_force_after_cached);
    tcase_add_test(tc, test_plan_concurrent_first_calls);
    suite_add_tcase(s, tc);
    TCase *failures = tcase_create("failures");
    tcase_set_timeout(failures, 600);
    tcase_add_checked_fixture(failures, env_setup, env_teardown);
    tcase_add_test(failures, test_failed_argument);
    tcase_add_test(failures, test_failed_enqueue);
    tcase_add_test(failures, test_work_group_limit_first);
    tcase_add_test(failures, test_align_parallel_limit_zero);
    suite_add_tcase(s, failures);
    tc = tcase_create("ptx");
    tcase_set_timeout(tc, 600);
    tcase_add_checked_fixture(tc, env_setup, env_teardown);
    tcase_add_test(tc, test_ptx_by_capability);
    tcase_add_test(tc, test_ptx_build_falls_back);
    suite_add_tcase(s, tc);
    tc = tcase_create("variants");
    tcase_add_test(tc, test_variant_tables);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
