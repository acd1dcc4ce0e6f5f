/* Launch configurations: the record both ops' choose_launch functions
 * resolve a request to, the overrides of the computed rule (the device
 * table's entries, src/device_table.c, and the tune file moecl-tune
 * writes beside the kernel cache), and the hook with which moecl-tune
 * forces a configuration.
 *
 * Precedence, first that applies and is valid on the device:
 *   forced (moecl-tune's hook) > the variant override (class, team, tile,
 *   grounded: the computed rule under what it forces) > tune file >
 *   device table > computed default.
 * This file hands out the candidates; the ops check each against the device
 * (work-group size, local memory), since only they know their kernels.
 * Both happen when a request's launch plan is built (src/plan.c), not per
 * call.
 *
 * The tune file is plain text, one per device identity (platform, device
 * name, driver version), named by a hash of it like the cache entries:
 *
 *   moecl-tune 1
 *   device <platform> | <device> | <driver>
 *   # comments
 *   topk e=256 k=8 groups=8 kernel=team team=32 rows=4
 *   grounded e=16 k=2 hidden=128 kernel=team team=16 rows=8
 *   grounded e=128 k=8 hidden=4096 kernel=tiled tile=64
 *   grounded e=128 k=8 hidden=4096 kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=8 vec=4 db=1
 *
 * A file whose first two lines differ (another device, another format) is
 * ignored whole; a bad entry line is ignored alone; a later line for the
 * same key replaces an earlier one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "kernel_layout.h"

#define TUNE_MAGIC "moecl-tune 1"
#define TUNE_MAX_FILE ((size_t)1 << 20)
#define TUNE_MAX_ENTRIES 1024u
#define TUNE_MAX_LINE 512

moecl_launch_key moecl_launch_key_topk(uint32_t num_experts, uint32_t top_k, uint32_t groups)
{
    return (moecl_launch_key){MOECL_OP_TOPK_GATING, num_experts, top_k, groups, 0};
}

/* Hidden sizes share a key per power of two: what suits 3000 suits 4096,
 * and one tuned size then serves its neighbours. The op still checks the
 * configuration against the exact size. */
moecl_launch_key moecl_launch_key_grounded(uint32_t hidden_dim, uint32_t num_experts, uint32_t top_k)
{
    return (moecl_launch_key){MOECL_OP_GROUNDED_ROUTER, num_experts, top_k, 0, moecl_pow2_at_least(hidden_dim)};
}

static bool key_equal(const moecl_launch_key *a, const moecl_launch_key *b)
{
    return a->op == b->op && a->num_experts == b->num_experts && a->top_k == b->top_k && a->groups == b->groups &&
           a->hidden_bucket == b->hidden_bucket;
}

bool moecl_launch_config_equal(const moecl_launch_config *a, const moecl_launch_config *b)
{
    const moecl_tile_params *p = &a->tiled, *q = &b->tiled;
    return a->kernel == b->kernel && a->team == b->team && a->rows == b->rows && a->tile == b->tile && p->tn == q->tn &&
           p->tk == q->tk && p->mt == q->mt && p->nt == q->nt && p->vec == q->vec && p->db == q->db && p->wc == q->wc;
}

const char *moecl_launch_source_name(moecl_launch_source s)
{
    static const char *const names[] = {"default", "table", "tuned", "override", "forced"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "?";
}

static const char *const kernel_names[] = {"rows", "team", "tiled", "mma", "splitk"};

int moecl_launch_key_text(const moecl_launch_key *key, char *buf, size_t size)
{
    if (key->op == MOECL_OP_TOPK_GATING)
        return snprintf(buf, size, "topk e=%u k=%u groups=%u", key->num_experts, key->top_k, key->groups);
    return snprintf(buf, size, "grounded e=%u k=%u hidden=%u", key->num_experts, key->top_k, key->hidden_bucket);
}

int moecl_launch_config_text(const moecl_launch_config *c, char *buf, size_t size)
{
    const char *kernel = (unsigned)c->kernel <= MOECL_KERNEL_SPLITK ? kernel_names[c->kernel] : "?";
    const moecl_tile_params *p = &c->tiled;
    if (c->kernel == MOECL_KERNEL_TILED && !p->tk)
        return snprintf(buf, size, "kernel=tiled tile=%u", c->tile);
    if (c->kernel == MOECL_KERNEL_TILED && p->wc)
        return snprintf(buf, size, "kernel=tiled tile=%u tn=%u tk=%u mt=%u nt=%u vec=%u db=%u wc=%u", c->tile, p->tn,
                        p->tk, p->mt, p->nt, p->vec, p->db, p->wc);
    if (c->kernel == MOECL_KERNEL_TILED)
        return snprintf(buf, size, "kernel=tiled tile=%u tn=%u tk=%u mt=%u nt=%u vec=%u db=%u", c->tile, p->tn, p->tk,
                        p->mt, p->nt, p->vec, p->db);
    if (c->kernel == MOECL_KERNEL_MMA)
        return snprintf(buf, size, "kernel=mma");
    if (c->kernel == MOECL_KERNEL_SPLITK)
        return c->tile ? snprintf(buf, size, "kernel=splitk tile=%u", c->tile) : snprintf(buf, size, "kernel=splitk");
    if (c->kernel == MOECL_KERNEL_TEAM)
        return snprintf(buf, size, "kernel=team team=%u rows=%u", c->team, c->rows);
    return snprintf(buf, size, "kernel=%s rows=%u", kernel, c->rows);
}

/* ---- resolving ---- */

/* The private arrays of a work-group of configuration c, roughly: the
 * top-k kernels keep about 8 bytes per expert per row (scores and ranks),
 * the grounded team kernel 12; the grounded rows kernel's are per
 * work-item (its tokens' dot products and keys), counted the same way. */
static uint64_t work_group_private_bytes(const moecl_launch_key *key, const moecl_launch_config *c)
{
    if (key->op == MOECL_OP_GROUNDED_ROUTER && c->kernel == MOECL_KERNEL_ROWS) {
        /* grounded_router_rows: LAYOUT_GROUNDED_ROWS_TM tokens a work-item (cl/layout.h). */
        const unsigned tm = LAYOUT_GROUNDED_ROWS_TM(key->num_experts, key->top_k);
        return (uint64_t)c->rows * moecl_layout_grounded_rows_private(tm, key->num_experts, key->top_k);
    }
    const uint64_t per_expert = key->op == MOECL_OP_TOPK_GATING ? 8 : c->kernel == MOECL_KERNEL_TEAM ? 12 : 0;
    return (uint64_t)c->rows * key->num_experts * per_expert;
}

/* Configurations a driver is known to mishandle (the device table names
 * them), refused before the op sees them: a team kernel in a work-group
 * of few work-items, and work-groups whose private arrays pass a limit. */
static bool driver_refuses(const moecl_device_params *params, const moecl_launch_key *key,
                           const moecl_launch_config *c)
{
    const uint32_t team_wg = params->value[MOECL_DP_REFUSE_TEAM_WG], private_max = params->value[MOECL_DP_PRIVATE_MAX];
    if (team_wg && c->kernel == MOECL_KERNEL_TEAM && c->team * c->rows <= team_wg)
        return true;
    return private_max && work_group_private_bytes(key, c) > private_max;
}

bool moecl_launch_env_decides(const moecl_launch_env *env, moecl_op op)
{
    if (env->launch_class_forced)
        return true;
    switch (op) {
    case MOECL_OP_TOPK_GATING:
        return env->team != 0;
    case MOECL_OP_GROUNDED_ROUTER:
        return env->grounded_wide_tile || env->grounded_tile.kernel == MOECL_KERNEL_TILED || env->grounded_mma ||
               env->grounded_splitk;
    default:
        return env->align_path != MOECL_ALIGN_AUTO;
    }
}

moecl_launch_source moecl_launch_default_source(const moecl_device_info *info, moecl_op op)
{
    return moecl_launch_env_decides(&info->env, op) ? MOECL_SOURCE_OVERRIDE : MOECL_SOURCE_DEFAULT;
}

unsigned moecl_launch_overrides(const moecl_context *ctx, const moecl_launch_key *key,
                                moecl_launch_config configs[MOECL_LAUNCH_MAX_OVERRIDES],
                                moecl_launch_source sources[MOECL_LAUNCH_MAX_OVERRIDES])
{
    const moecl_launch_config *c[MOECL_LAUNCH_MAX_OVERRIDES] = {NULL, NULL, NULL};
    if ((unsigned)key->op < MOECL_NUM_OPS && ctx->forced[key->op].active)
        c[0] = &ctx->forced[key->op].config;
    if (!moecl_launch_env_decides(&ctx->info.env, key->op)) {
        c[1] = moecl_tune_find(&ctx->tuned, key);
        c[2] = moecl_device_table_launch(&ctx->info, key);
    }
    static const moecl_launch_source source_of[MOECL_LAUNCH_MAX_OVERRIDES] = {
        MOECL_SOURCE_FORCED, MOECL_SOURCE_TUNED, MOECL_SOURCE_TABLE};
    unsigned n = 0;
    for (unsigned i = 0; i < MOECL_LAUNCH_MAX_OVERRIDES; i++) {
        if (c[i] && !driver_refuses(&ctx->params, key, c[i])) {
            configs[n] = *c[i];
            sources[n++] = source_of[i];
        }
    }
    return n;
}

moecl_launch_source moecl_launch_resolve(const moecl_context *ctx, const moecl_device_info *info,
                                         const moecl_launch_key *key, const moecl_launch_rule *rule,
                                         const void *request, moecl_launch_config *config, void *shape)
{
    if (ctx) {
        moecl_launch_config configs[MOECL_LAUNCH_MAX_OVERRIDES];
        moecl_launch_source sources[MOECL_LAUNCH_MAX_OVERRIDES];
        const unsigned n = moecl_launch_overrides(ctx, key, configs, sources);
        for (unsigned i = 0; i < n; i++) {
            if (rule->check(info, &configs[i], request, shape)) {
                *config = configs[i];
                return sources[i];
            }
        }
    }
    *config = rule->rule(info, request);
    if (!rule->check(info, config, request, shape)) {
        /* A device whose work-groups hold fewer than the rule's rows. */
        *config = (moecl_launch_config){MOECL_KERNEL_ROWS, 1, 1, 0, {0}};
        rule->check(info, config, request, shape);
    }
    return moecl_launch_default_source(info, key->op);
}

void moecl_launch_force(moecl_context *ctx, moecl_op op, const moecl_launch_config *config)
{
    if ((unsigned)op >= MOECL_NUM_OPS)
        return;
    ctx->forced[op].active = config != NULL;
    if (config)
        ctx->forced[op].config = *config;
    /* Plans resolved before are not this op's plans any more. */
    atomic_fetch_add(&ctx->force_gen[op], 1);
}

/* ---- the tune table ---- */

const moecl_launch_config *moecl_tune_find(const moecl_tune_table *t, const moecl_launch_key *key)
{
    for (size_t i = 0; i < t->count; i++)
        if (key_equal(&t->entries[i].key, key))
            return &t->entries[i].config;
    return NULL;
}

bool moecl_tune_set(moecl_tune_table *t, const moecl_launch_key *key, const moecl_launch_config *config)
{
    for (size_t i = 0; i < t->count; i++) {
        if (key_equal(&t->entries[i].key, key)) {
            t->entries[i].config = *config;
            return true;
        }
    }
    if (t->count >= TUNE_MAX_ENTRIES)
        return false;
    if (t->count == t->capacity) {
        size_t cap = t->capacity ? 2 * t->capacity : 16;
        moecl_tune_entry *grown = realloc(t->entries, cap * sizeof(*grown));
        if (!grown)
            return false;
        t->entries = grown;
        t->capacity = cap;
    }
    t->entries[t->count++] = (moecl_tune_entry){*key, *config};
    return true;
}

void moecl_tune_free(moecl_tune_table *t)
{
    free(t->entries);
    memset(t, 0, sizeof(*t));
}

/* ---- the tune file ---- */

/* "platform | device | driver", control characters replaced, so it stays
 * one line of the file. */
static void identity_line(const moecl_device_info *info, char *buf, size_t size)
{
    snprintf(buf, size, "%s | %s | %s", info->platform_name, info->device_name, info->driver_version);
    for (char *p = buf; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            *p = '?';
}

bool moecl_tune_path(const moecl_device_info *info, char *path, size_t size)
{
    char dir[3072], id[512];
    if (!moecl_cache_dir(dir, sizeof(dir)))
        return false;
    identity_line(info, id, sizeof(id));
    size_t len = strlen(id);
    int n = snprintf(path, size, "%s/tune-%016llx%016llx.txt", dir, (unsigned long long)moecl_hash64(id, len, 0),
                     (unsigned long long)moecl_hash64(id, len, 1));
    return n > 0 && (size_t)n < size;
}

/* A decimal number of at most 7 digits (no sign, no spaces). */
static bool parse_uint(const char *s, uint32_t *out)
{
    size_t n = strlen(s);
    if (n == 0 || n > 7)
        return false;
    uint32_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        v = v * 10 + (uint32_t)(s[i] - '0');
    }
    *out = v;
    return true;
}

/* The shape rules of a GEMM tile, before any device check: experts a tile
 * 16..256, hidden steps 4..64, blocks 1..16, each a power of two; the block
 * divides the tile, the vector (1, 2 or 4) the hidden step; wc, if given, a
 * power of two dividing the block columns tn / nt. */
static bool tile_params_valid(unsigned tile, const moecl_tile_params *p)
{
    return moecl_is_pow2(p->tn) && p->tn >= 16 && p->tn <= 256 && moecl_is_pow2(p->tk) && p->tk >= 4 && p->tk <= 64 &&
           moecl_is_pow2(p->mt) && p->mt <= 16 && tile % p->mt == 0 && moecl_is_pow2(p->nt) && p->nt <= 16 &&
           p->tn % p->nt == 0 && (p->vec == 1 || p->vec == 2 || p->vec == 4) && p->tk % p->vec == 0 && p->db <= 1 &&
           (p->wc == 0 || (moecl_is_pow2(p->wc) && (p->tn / p->nt) % p->wc == 0));
}

/* One entry line (NUL-terminated, no newline) into key and config; false
 * for anything malformed or out of range. Only the shape of the
 * configuration is checked here; the device checks come at use. */
static bool parse_entry(char *line, moecl_launch_key *key, moecl_launch_config *config)
{
    enum { F_E, F_K, F_GROUPS, F_HIDDEN, F_TEAM, F_ROWS, F_TILE, F_TN, F_TK, F_MT, F_NT, F_VEC, F_DB, F_WC, F_KERNEL,
           F_COUNT };
    static const char *const names[F_COUNT] = {"e",  "k",  "groups", "hidden", "team", "rows", "tile", "tn",
                                               "tk", "mt", "nt",     "vec",    "db",   "wc",   "kernel"};
    uint32_t value[F_COUNT] = {0};
    bool seen[F_COUNT] = {false};
    char *save = NULL;
    const char *op = strtok_r(line, " \t", &save);
    if (!op)
        return false;
    bool topk = strcmp(op, "topk") == 0;
    if (!topk && strcmp(op, "grounded") != 0)
        return false;
    for (char *tok = strtok_r(NULL, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq)
            return false;
        *eq = '\0';
        int f = -1;
        for (int i = 0; i < F_COUNT; i++)
            if (strcmp(tok, names[i]) == 0)
                f = i;
        if (f < 0 || seen[f])
            return false;
        seen[f] = true;
        if (f == F_KERNEL) {
            int kind = -1;
            for (int i = 0; i <= MOECL_KERNEL_SPLITK; i++)
                if (strcmp(eq + 1, kernel_names[i]) == 0)
                    kind = i;
            if (kind < 0)
                return false;
            value[f] = (uint32_t)kind;
        } else if (!parse_uint(eq + 1, &value[f])) {
            return false;
        }
    }
    const uint32_t e = value[F_E], k = value[F_K];
    if (!seen[F_E] || !seen[F_K] || !seen[F_KERNEL] || e < 1 || e > MOECL_MAX_EXPERTS || k < 1 ||
        k > (e < MOECL_MAX_TOPK ? e : MOECL_MAX_TOPK))
        return false;
    if (topk) {
        const uint32_t g = value[F_GROUPS];
        if (seen[F_HIDDEN] || (g && (g > e || e % g)))
            return false;
        *key = moecl_launch_key_topk(e, k, g);
    } else {
        const uint32_t h = value[F_HIDDEN];
        if (seen[F_GROUPS] || !seen[F_HIDDEN] || !moecl_is_pow2(h) || h > MOECL_MAX_HIDDEN)
            return false;
        *key = moecl_launch_key_grounded(h, e, k);
    }
    moecl_launch_config c = {(moecl_kernel_kind)value[F_KERNEL], 1, 0, 0, {0}};
    /* The GEMM tile's fields come all together or not at all (the table's
     * entry for the tile), and only with the tiled kernel; wc is optional
     * among them. */
    unsigned tile_fields = 0;
    for (int f = F_TN; f <= F_DB; f++)
        tile_fields += seen[f];
    if ((tile_fields != 0 || seen[F_WC]) && (tile_fields != F_DB - F_TN + 1 || c.kernel != MOECL_KERNEL_TILED))
        return false;
    switch (c.kernel) {
    case MOECL_KERNEL_ROWS:
        if (seen[F_TILE] || (seen[F_TEAM] && value[F_TEAM] != 1))
            return false;
        c.rows = value[F_ROWS];
        break;
    case MOECL_KERNEL_TEAM:
        c.team = value[F_TEAM];
        c.rows = value[F_ROWS];
        if (seen[F_TILE] || !moecl_is_pow2(c.team) || c.team < 2 || c.team > MOECL_LAUNCH_MAX_TEAM)
            return false;
        break;
    case MOECL_KERNEL_TILED:
        c.tile = value[F_TILE];
        c.tiled = (moecl_tile_params){value[F_TN], value[F_TK], value[F_MT], value[F_NT],
                                      value[F_VEC], value[F_DB], value[F_WC]};
        if (topk || seen[F_TEAM] || seen[F_ROWS] || !moecl_is_pow2(c.tile) || c.tile < 16 || c.tile > 128 ||
            (tile_fields && !tile_params_valid(c.tile, &c.tiled)))
            return false;
        break;
    case MOECL_KERNEL_MMA:
        if (topk || seen[F_TEAM] || seen[F_ROWS] || seen[F_TILE])
            return false;
        break;
    case MOECL_KERNEL_SPLITK:
        /* tile: the hidden chunk of a work-group, 0 (absent) chosen */
        c.tile = value[F_TILE];
        if (topk || seen[F_TEAM] || seen[F_ROWS] ||
            (c.tile && (!moecl_is_pow2(c.tile) || c.tile < 16 || c.tile > 8192)))
            return false;
        break;
    }
    if (c.kernel != MOECL_KERNEL_TILED && c.kernel != MOECL_KERNEL_MMA && c.kernel != MOECL_KERNEL_SPLITK &&
        (!moecl_is_pow2(c.rows) || c.rows > MOECL_LAUNCH_MAX_ROWS))
        return false;
    *config = c;
    return true;
}

bool moecl_launch_config_parse(const char *text, moecl_launch_config *config)
{
    /* An entry line of a key under which every configuration is valid, so
     * that the file, the variable and moecl-tune share one parser. */
    char line[TUNE_MAX_LINE];
    moecl_launch_key key;
    const int n = snprintf(line, sizeof(line), "grounded e=1 k=1 hidden=1 %s", text);
    return n > 0 && (size_t)n < sizeof(line) && parse_entry(line, &key, config);
}

/* Split text into lines; the first two must be the magic and this device's
 * identity, the rest are entries, comments or blank. */
static void parse_file(char *text, size_t size, const char *identity, moecl_tune_table *t)
{
    char *p = text, *end = text + size;
    for (unsigned line_no = 0; p < end; line_no++) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        char *line_end = nl ? nl : end;
        size_t len = (size_t)(line_end - p);
        bool clean = len < TUNE_MAX_LINE && memchr(p, '\0', len) == NULL;
        if (clean && len && p[len - 1] == '\r')
            len--;
        char line[TUNE_MAX_LINE];
        if (clean) {
            memcpy(line, p, len);
            line[len] = '\0';
            for (size_t i = 0; i < len && clean; i++)
                clean = (unsigned char)line[i] >= 0x20 || line[i] == '\t';
        }
        p = nl ? nl + 1 : end;
        if (line_no == 0 || line_no == 1) {
            char want[600];
            snprintf(want, sizeof(want), "device %s", identity);
            if (!clean || strcmp(line, line_no == 0 ? TUNE_MAGIC : want) != 0)
                return;
            continue;
        }
        if (!clean || line[strspn(line, " \t")] == '#' || line[strspn(line, " \t")] == '\0')
            continue;
        moecl_launch_key key;
        moecl_launch_config config;
        if (parse_entry(line, &key, &config) && !moecl_tune_set(t, &key, &config))
            return;
    }
}

void moecl_tune_load(const moecl_device_info *info, moecl_tune_table *t)
{
    memset(t, 0, sizeof(*t));
    char path[4096], id[512];
    if (!moecl_tune_path(info, path, sizeof(path)))
        return;
    FILE *f = fopen(path, "rb");
    if (!f)
        return;
    /* One byte more than allowed tells a file that is too big: ignored. */
    char *text = malloc(TUNE_MAX_FILE + 1);
    size_t n = text ? fread(text, 1, TUNE_MAX_FILE + 1, f) : 0;
    fclose(f);
    if (text && n <= TUNE_MAX_FILE) {
        identity_line(info, id, sizeof(id));
        parse_file(text, n, id, t);
    }
    free(text);
}

bool moecl_tune_store(const moecl_device_info *info, const moecl_tune_table *t, const char *comment)
{
    char path[4096], tmp[4200], dir[3072], id[512];
    if (!moecl_tune_path(info, path, sizeof(path)) || !moecl_cache_dir(dir, sizeof(dir)) || !moecl_cache_make_dir(dir))
        return false;
    int local; /* a name no other writer uses: the pid and this call's stack address */
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld.%llx", path, (long)getpid(), (unsigned long long)(uintptr_t)&local);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return false;
    identity_line(info, id, sizeof(id));
    bool ok = fprintf(f, "%s\ndevice %s\n", TUNE_MAGIC, id) > 0;
    if (comment)
        for (const char *c = comment; *c && ok;) {
            size_t len = strcspn(c, "\n");
            ok = fprintf(f, "# %.*s\n", (int)len, c) > 0;
            c += len + (c[len] == '\n');
        }
    for (size_t i = 0; i < t->count && ok; i++) {
        char key[128], config[128];
        moecl_launch_key_text(&t->entries[i].key, key, sizeof(key));
        moecl_launch_config_text(&t->entries[i].config, config, sizeof(config));
        ok = fprintf(f, "%s %s\n", key, config) > 0;
    }
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return false;
    }
    return true;
}
