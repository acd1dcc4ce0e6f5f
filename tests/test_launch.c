/* Launch configurations (src/launch.c and the ops' choose_launch): the tune
 * file round trip, garbage and foreign files ignored, configurations the
 * device cannot run ignored, the precedence forced > env > tune file >
 * table > default, correct results under many configurations, and the
 * inline PTX paths: chosen by compute capability, and a build with them
 * that fails falls back to the portable kernels.
 *
 * Links the library's objects, not its ABI, to reach the internals (the
 * tune table, moecl_launch_force), as moecl-tune does. Every test runs in a
 * fixture with its own MOECL_CACHE_DIR and none of the launch variables
 * set, restored afterwards. */
#include "harness.h"
#include "internal.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------------- */
/* Fixture                                                                 */
/* ---------------------------------------------------------------------- */

static const char *const fx_names[] = {"MOECL_CACHE_DIR", "MOECL_LAUNCH_CLASS", "MOECL_TEAM", "MOECL_GROUNDED_TILE"};
#define FX_COUNT (sizeof(fx_names) / sizeof(fx_names[0]))
static char *fx_values[FX_COUNT];
static char fx_root[PATH_MAX];

static int remove_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    remove(path);
    return 0;
}

static void env_setup(void)
{
    for (size_t i = 0; i < FX_COUNT; i++) {
        const char *v = getenv(fx_names[i]);
        fx_values[i] = v ? strdup(v) : NULL;
        unsetenv(fx_names[i]);
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(fx_root, sizeof(fx_root), "%s/moecl-launch-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    ck_assert_msg(mkdtemp(fx_root) != NULL, "mkdtemp(%s): %s", fx_root, strerror(errno));
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", fx_root, 1), 0);
}

static void env_teardown(void)
{
    for (size_t i = 0; i < FX_COUNT; i++) {
        if (fx_values[i])
            setenv(fx_names[i], fx_values[i], 1);
        else
            unsetenv(fx_names[i]);
        free(fx_values[i]);
        fx_values[i] = NULL;
    }
    if (fx_root[0])
        nftw(fx_root, remove_entry, 16, FTW_PHYS | FTW_DEPTH);
    fx_root[0] = '\0';
}

/* ---------------------------------------------------------------------- */
/* Helpers                                                                 */
/* ---------------------------------------------------------------------- */

static void write_file(const char *path, const void *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "fopen(%s): %s", path, strerror(errno));
    ck_assert(fwrite(data, 1, size, f) == size);
    ck_assert(fclose(f) == 0);
}

static void tune_path_of(const moecl_context *ctx, char *path, size_t size)
{
    ck_assert_msg(moecl_tune_path(&ctx->info, path, size), "no tune file path with MOECL_CACHE_DIR=%s", fx_root);
    ck_assert_msg(strncmp(path, fx_root, strlen(fx_root)) == 0, "tune file %s is not in %s", path, fx_root);
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
    write_file(path, all, hl + body_size);
    free(all);
}

static moecl_launch_config cfg_rows(unsigned rows) { return (moecl_launch_config){MOECL_KERNEL_ROWS, 1, rows, 0}; }
static moecl_launch_config cfg_team(unsigned team, unsigned rows)
{
    return (moecl_launch_config){MOECL_KERNEL_TEAM, team, rows, 0};
}
static moecl_launch_config cfg_tiled(unsigned tile) { return (moecl_launch_config){MOECL_KERNEL_TILED, 1, 0, tile}; }

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

/* Run d on random inputs and compare with the reference. */
static void check_topk(moecl_context *ctx, const moecl_topk_gating_desc *d, bool with_bias, uint64_t stream,
                       const char *label)
{
    harness_rng rng = harness_rng_for(stream);
    const size_t n = (size_t)d->num_tokens * d->num_experts, nk = (size_t)d->num_tokens * d->top_k;
    void *gating = harness_random_tensor(&rng, d->gating_dtype, n, 2.0f);
    float *bias = with_bias ? harness_random_tensor(&rng, MOECL_F32, d->num_experts, 0.05f) : NULL;
    float *w = malloc(nk * 4 + 4);
    int32_t *ids = malloc(nk * 4 + 4);
    ck_assert(w && ids);
    memset(w, HARNESS_POISON, nk * 4);
    memset(ids, HARNESS_POISON, nk * 4);
    moecl_status st = moecl_topk_gating_host(ctx, d, gating, bias, w, ids);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", label, moecl_status_string(st), moecl_context_error(ctx));
    char msg[512] = "";
    int bad = ref_check_topk_gating(d, gating, bias, w, ids, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", label, bad, msg);
    free(gating);
    free(bias);
    free(w);
    free(ids);
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

/* Entries of fx_root other than . and .. */
static int entries_in_root(void)
{
    DIR *d = opendir(fx_root);
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
    const moecl_launch_key other[3] = {moecl_launch_key_topk(4096, 64, 64), moecl_launch_key_grounded(3000, 128, 8),
                                       moecl_launch_key_grounded(65536, 1, 1)};
    ck_assert_uint_eq(other[1].hidden_bucket, 4096);
    const moecl_launch_config oc[3] = {cfg_team(256, 16), cfg_tiled(128), cfg_rows(4096)};
    for (int i = 0; i < 3; i++)
        ck_assert(moecl_tune_set(&table, &other[i], &oc[i]));
    ck_assert_uint_eq(table.count, 6);
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
        write_file(path, texts[i], strlen(texts[i]));
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
        write_file(path, big, at);
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
     * local memory; 256 x 32 past the work-group limit of every device we
     * know (pocl's is 4096) while its 100 KiB of local memory fit pocl;
     * 256 grouped rows of 4096 experts take 4 MiB of local memory in a
     * work-group of 4096, which pocl allows; the
     * team kernel with hidden 65536 in local memory past every device's
     * local memory; the 8x8 tile needs 64 experts a tile (16 here). */
    moecl_context *ctx = harness_context();
    char body[1024];
    snprintf(body, sizeof(body),
             "topk e=128 k=8 groups=0 kernel=team team=256 rows=4096\n"
             "topk e=256 k=8 groups=0 kernel=team team=256 rows=32\n"
             "topk e=4096 k=8 groups=64 kernel=team team=16 rows=256\n"
             "grounded e=16 k=2 hidden=128 kernel=tiled tile=128\n"
             "grounded e=16 k=2 hidden=65536 kernel=team team=4 rows=1\n");
    write_tune_file(ctx, true, body, strlen(body));
    moecl_context_destroy(ctx);

    ctx = harness_context();
    ck_assert_uint_eq(ctx->tuned.count, 5); /* well-formed: loaded, then refused at use */
    moecl_launch_config got;
    assert_source(topk_launch(ctx, &t, &got), src_t, "team 256 x 4096");
    assert_config(&got, &base_t, "team 256 x 4096");
    assert_source(topk_launch(ctx, &t256, &got), src_t256, "team 256 x 32");
    assert_config(&got, &base_t256, "team 256 x 32");
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
    /* The built-in table: pocl on CPUs has a top-k gating entry. */
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

    /* The environment beats the tune file (read at context creation). */
    static const struct {
        const char *name, *value;
        bool topk_env, grounded_env;
    } envs[] = {
        {"MOECL_LAUNCH_CLASS", "gpu", true, true},
        {"MOECL_LAUNCH_CLASS", "cpu", true, true},
        {"MOECL_TEAM", "8", true, false},
        {"MOECL_GROUNDED_TILE", "128", false, true},
    };
    for (size_t i = 0; i < sizeof(envs) / sizeof(envs[0]); i++) {
        char label[96];
        snprintf(label, sizeof(label), "%s=%s", envs[i].name, envs[i].value);
        ck_assert_int_eq(setenv(envs[i].name, envs[i].value, 1), 0);
        ctx = harness_context();
        moecl_launch_source s = topk_launch(ctx, &t, &got);
        if (envs[i].topk_env) {
            assert_source(s, MOECL_SOURCE_ENV, label);
            ck_assert_msg(!moecl_launch_config_equal(&got, &tuned_t), "%s: the tune file's choice was used", label);
        } else {
            assert_source(s, MOECL_SOURCE_TUNED, label);
        }
        if (!strcmp(envs[i].name, "MOECL_TEAM")) {
            const moecl_launch_config team8 = {MOECL_KERNEL_TEAM, 8, got.rows, 0};
            assert_config(&got, &team8, label);
        }
        if (!strcmp(envs[i].value, "cpu")) {
            const moecl_launch_config rows8 = cfg_rows(8);
            assert_config(&got, &rows8, label);
        }
        s = grounded_launch(ctx, &r, &got);
        assert_source(s, envs[i].grounded_env ? MOECL_SOURCE_ENV : MOECL_SOURCE_TUNED, label);
        check_topk(ctx, &t, false, 31 + i, label);
        check_grounded(ctx, &r, 41 + i, label);
        /* Forced still beats the environment. */
        moecl_launch_force(ctx, MOECL_OP_TOPK_GATING, &forced);
        assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_FORCED, label);
        moecl_context_destroy(ctx);
        unsetenv(envs[i].name);
    }

    /* MOECL_TEAM with MOECL_LAUNCH_CLASS=cpu: the rows kernel, as before. */
    ck_assert_int_eq(setenv("MOECL_TEAM", "8", 1), 0);
    ck_assert_int_eq(setenv("MOECL_LAUNCH_CLASS", "cpu", 1), 0);
    ctx = harness_context();
    assert_source(topk_launch(ctx, &t, &got), MOECL_SOURCE_ENV, "MOECL_TEAM with the cpu class");
    ck_assert_int_eq(got.kernel, MOECL_KERNEL_ROWS);
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
    ctx->info.align_path = MOECL_ALIGN_ONE_GROUP;
    check_align(ctx, &a, 1220, "moe_align one-group, PTX build failing");
    assert_fell_back(ctx, "moe_align");
    ctx->info.align_path = MOECL_ALIGN_CHUNKED;
    check_align(ctx, &a, 1221, "moe_align chunked, after the fallback");
    moecl_context_destroy(ctx);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("launch");
    TCase *tc = tcase_create("tune_file");
    tcase_set_timeout(tc, 600);
    tcase_add_checked_fixture(tc, env_setup, env_teardown);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_garbage_ignored);
    tcase_add_test(tc, test_invalid_config_ignored);
    tcase_add_test(tc, test_rows_per_group_bit_identical);
    tcase_add_test(tc, test_precedence);
    tcase_add_test(tc, test_configs_correct);
    suite_add_tcase(s, tc);
    tc = tcase_create("ptx");
    tcase_set_timeout(tc, 600);
    tcase_add_checked_fixture(tc, env_setup, env_teardown);
    tcase_add_test(tc, test_ptx_by_capability);
    tcase_add_test(tc, test_ptx_build_falls_back);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
