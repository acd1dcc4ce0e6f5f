/* The kernel parameters of top-k gating and the grounded router, each
 * named once in a table, and what derives from one: the packed plan key,
 * the -D defines and the readable line. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* How a value reads in the defines. */
typedef enum param_format {
    FORMAT_UINT = 0, /* decimal */
    FORMAT_FLOAT,    /* a float's bits, as a hex literal: the kernel gets them exactly */
} param_format;

/* One kernel parameter: a -D define of the op's program. */
typedef struct param {
    const char *name;  /* the define */
    const char *label; /* in the readable line */
    /* Width in the packed plan key; 0: not in it (the launch shape and the
     * device facts, which the request and the context determine). */
    unsigned key_bits;
    /* In every variant's defines, even at def; else only where the value
     * differs from def, so that the defines (and the disk-cache entries)
     * of the variants that leave it at def do not depend on it. */
    bool always;
    uint32_t def;           /* the kernel's value where the define is absent */
    uint32_t min, max;      /* the values the op passes */
    unsigned kernels;       /* the kernels whose builds read it (KERNELS()); 0: all */
    unsigned with;          /* WITH(p): read only where param p is nonzero; 0: always read */
    param_format format;
    const char *const *names; /* the values' names in the readable line; NULL: numbers */
    /* Rows of the gating block: the value, from the op's gating source. */
    uint32_t (*get)(const moecl_gating_source *s);
} param;

/* A row's first seven fields; the rest by name, where a row sets them. */
#define PARAM(n, l, bits, alw, d, lo, hi) \
    .name = (n), .label = (l), .key_bits = (bits), .always = (alw), .def = (d), .min = (lo), .max = (hi)
#define KERNEL_BIT(k) (1u << (k))
#define WITH(p) ((p) + 1u)

static const char *const dtype_names[] = {"f32", "f16", "bf16", NULL};
static const char *const index_names[] = {"i32", "i64", NULL};
static const char *const capture_names[] = {"none", "i32", "i64", "i16", NULL};
static const char *const kernel_names[] = {"rows", "team", "tiled", "mma", "splitk", NULL};
static const char *const scoring_names[] = {"softmax", "sigmoid", "sqrtsoftplus", "raw", NULL};
static const char *const weighting_names[] = {"score", "softmax-chosen", "sigmoid-chosen", NULL};
static const char *const group_score_names[] = {"max", "top2-sum", NULL};
static const char *const group_fill_names[] = {"neg-inf", "zero", NULL};
static const char *const precision_names[] = {"fp32", "tf32", "3xtf32", NULL};

/* ---- cl/gating.cl: the gating block, shared by both ops ---- */

static uint32_t get_scoring(const moecl_gating_source *s) { return (uint32_t)s->desc->scoring; }
static uint32_t get_bias(const moecl_gating_source *s) { return s->has_bias; }
static uint32_t get_groups(const moecl_gating_source *s) { return s->groups; }
static uint32_t get_topk_group(const moecl_gating_source *s) { return s->groups ? s->topk_group : 0; }
static uint32_t get_group_score(const moecl_gating_source *s)
{
    return s->groups ? (uint32_t)s->desc->group_score : 0;
}
static uint32_t get_renormalize(const moecl_gating_source *s) { return s->desc->renormalize; }
static uint32_t get_floor(const moecl_gating_source *s)
{
    uint32_t bits = 0;
    if (s->desc->renormalize && s->desc->renormalize_floor > 0.0f)
        memcpy(&bits, &s->desc->renormalize_floor, sizeof(bits));
    return bits;
}
static uint32_t get_eps(const moecl_gating_source *s)
{
    uint32_t bits = 0;
    if (s->desc->renormalize && s->desc->renormalize_eps > 0.0f)
        memcpy(&bits, &s->desc->renormalize_eps, sizeof(bits));
    return bits;
}
static uint32_t get_group_fill(const moecl_gating_source *s)
{
    return s->groups && s->desc->group_fill == MOECL_GROUP_FILL_ZERO;
}
static uint32_t get_weighting(const moecl_gating_source *s) { return (uint32_t)s->desc->weighting; }
static uint32_t get_weights_dtype(const moecl_gating_source *s) { return (uint32_t)s->desc->weights_dtype; }
static uint32_t get_ids_dtype(const moecl_gating_source *s) { return (uint32_t)s->desc->ids_dtype; }
/* Without a bias its type is nothing to the kernel. */
static uint32_t get_bias_dtype(const moecl_gating_source *s)
{
    return s->has_bias ? (uint32_t)s->desc->bias_dtype : 0;
}

/* cl/gating.cl's parameters, read by every kernel of both programs.
 * Adding a gating option is a row here (its value from the source) and
 * its use in the kernel: nothing else on the host. A new row is not
 * `always`, and its def is the kernel's default, so that every variant
 * that leaves it there keeps its defines and cache entries. */
static const param gating_params[] = {
    {PARAM("SCORING", "scoring", 2, true, 0, 0, MOECL_SCORING_RAW), .names = scoring_names, .get = get_scoring},
    {PARAM("HAS_BIAS", "bias", 1, true, 0, 0, 1), .get = get_bias},
    {PARAM("NUM_GROUPS", "groups", 13, true, 0, 0, MOECL_MAX_EXPERTS), .get = get_groups},
    {PARAM("TOPK_GROUP", "topk_group", 13, true, 0, 0, MOECL_MAX_EXPERTS), .get = get_topk_group},
    {PARAM("GROUP_SCORE", "group_score", 1, true, 0, 0, MOECL_GROUP_SCORE_TOP2_SUM), .names = group_score_names,
     .get = get_group_score},
    {PARAM("RENORMALIZE", "renormalize", 1, true, 0, 0, 1), .get = get_renormalize},
    {PARAM("RENORM_FLOOR", "floor", 32, false, 0, 0, UINT32_MAX), .format = FORMAT_FLOAT, .get = get_floor},
    {PARAM("GROUP_FILL", "group_fill", 1, false, 0, 0, MOECL_GROUP_FILL_ZERO), .names = group_fill_names,
     .get = get_group_fill},
    {PARAM("WEIGHTING", "weighting", 2, false, 0, 0, MOECL_WEIGHTS_SIGMOID_CHOSEN), .names = weighting_names,
     .get = get_weighting},
    {PARAM("RENORM_EPS", "eps", 32, false, 0, 0, UINT32_MAX), .format = FORMAT_FLOAT, .get = get_eps},
    {PARAM("WEIGHTS_DTYPE", "weights", 2, false, 0, 0, MOECL_BF16), .names = dtype_names, .get = get_weights_dtype},
    {PARAM("IDS_DTYPE", "ids", 1, false, 0, 0, MOECL_I64), .names = index_names, .get = get_ids_dtype},
    {PARAM("BIAS_DTYPE", "bias_dtype", 2, false, 0, 0, MOECL_BF16), .names = dtype_names, .get = get_bias_dtype},
};
#define NUM_GATING_PARAMS (sizeof(gating_params) / sizeof(gating_params[0]))
_Static_assert(NUM_GATING_PARAMS <= MOECL_GATING_MAX_PARAMS, "moecl_variant_values holds the gating block");

/* ---- cl/topk_gating.cl (and moecl_route_dispatch's program) ---- */

static const param topk_params[MOECL_TOPK_PARAMS] = {
    [MOECL_TOPK_NUM_EXPERTS] = {PARAM("NUM_EXPERTS", "experts", 13, true, 0, 1, MOECL_MAX_EXPERTS)},
    [MOECL_TOPK_TOPK] = {PARAM("TOPK", "top_k", 7, true, 0, 1, MOECL_MAX_TOPK)},
    [MOECL_TOPK_IN_DTYPE] = {PARAM("IN_DTYPE", "dtype", 2, true, 0, 0, MOECL_BF16), .names = dtype_names},
    [MOECL_TOPK_HAS_COUNTS] = {PARAM("HAS_COUNTS", "counts", 1, false, 0, 0, 1)},
    /* the gating block sits here (moecl_variant_topk_gating.gating_at) */
    [MOECL_TOPK_TEAM] = {PARAM("TEAM", "team", 0, true, 1, 1, MOECL_LAUNCH_MAX_TEAM)},
    [MOECL_TOPK_ROWS] = {PARAM("ROWS", "rows", 0, true, 1, 1, MOECL_LAUNCH_MAX_ROWS)},
    [MOECL_TOPK_TEAM_SHUFFLE] = {PARAM("TEAM_SHUFFLE", "shuffle", 0, true, 0, 0, 1)},
    [MOECL_TOPK_EPT] = {PARAM("EPT", "ept", 0, true, 0, 1, MOECL_MAX_EXPERTS)},
    [MOECL_TOPK_CPU_DEVICE] = {PARAM("CPU_DEVICE", "cpu", 0, true, 0, 0, 1)},
    [MOECL_TOPK_ROUTE_DISPATCH] = {PARAM("ROUTE_DISPATCH", "dispatch", 1, false, 0, 0, 1),
                                   .kernels = KERNEL_BIT(MOECL_KERNEL_TEAM)},
    [MOECL_TOPK_FUSED_WG] = {PARAM("FUSED_WG", "fused_wg", 0, false, 1, 1, UINT32_MAX),
                             .kernels = KERNEL_BIT(MOECL_KERNEL_TEAM), .with = WITH(MOECL_TOPK_ROUTE_DISPATCH)},
    /* cl/replay.cl's program (src/replay.c): 1 given ids, 2 hash routing */
    [MOECL_TOPK_REPLAY] = {PARAM("REPLAY", "replay", 2, false, 0, 0, 2)},
    [MOECL_TOPK_HAS_LOAD] = {PARAM("HAS_LOAD", "load", 1, false, 0, 0, 1)},
    [MOECL_TOPK_HAS_VALID] = {PARAM("HAS_VALID", "valid", 1, false, 0, 0, 1)},
    /* moecl_topk_gating_ex's captured_ids (0 none, else 1 + its
     * moecl_index_dtype) and expert_scale */
    [MOECL_TOPK_CAPTURE] = {PARAM("CAPTURE", "capture", 2, false, 0, 0, 1 + MOECL_I16), .names = capture_names},
    [MOECL_TOPK_HAS_SCALE] = {PARAM("HAS_SCALE", "scale", 1, false, 0, 0, 1)},
    /* shared experts: their count, and their weight's bits where there are some */
    [MOECL_TOPK_SHARED] = {PARAM("SHARED", "shared", 7, false, 0, 0, MOECL_MAX_TOPK - 1)},
    [MOECL_TOPK_SHARED_WEIGHT] = {PARAM("SHARED_WEIGHT", "shared_weight", 32, false, 0, 0, UINT32_MAX),
                                  .with = WITH(MOECL_TOPK_SHARED), .format = FORMAT_FLOAT},
    /* moecl_route_dispatch_ex's load by local expert: their number, 0 none */
    [MOECL_TOPK_LOAD_MAP] = {PARAM("LOAD_MAP", "load_map", 13, false, 0, 0, MOECL_MAX_EXPERTS)},
};

/* ---- cl/grounded_router.cl (and moecl_grounded_route_dispatch's) ---- */

#define TILED KERNEL_BIT(MOECL_KERNEL_TILED)
#define MMA KERNEL_BIT(MOECL_KERNEL_MMA)
#define SPLITK KERNEL_BIT(MOECL_KERNEL_SPLITK)
static const param grounded_params[MOECL_GROUNDED_PARAMS] = {
    [MOECL_GROUNDED_HIDDEN_DIM] = {PARAM("HIDDEN_DIM", "hidden", 17, true, 0, 1, MOECL_MAX_HIDDEN)},
    [MOECL_GROUNDED_NUM_EXPERTS] = {PARAM("NUM_EXPERTS", "experts", 13, true, 0, 1, MOECL_MAX_EXPERTS)},
    [MOECL_GROUNDED_TOPK] = {PARAM("TOPK", "top_k", 7, true, 0, 1, MOECL_MAX_TOPK)},
    [MOECL_GROUNDED_IN_DTYPE] = {PARAM("IN_DTYPE", "dtype", 2, true, 0, 0, MOECL_BF16), .names = dtype_names},
    [MOECL_GROUNDED_HAS_PAIRS] = {PARAM("HAS_PAIRS", "pairs", 1, true, 0, 0, 1)},
    [MOECL_GROUNDED_HAS_WEIGHTS] = {PARAM("HAS_WEIGHTS", "weights", 1, true, 0, 0, 1)},
    [MOECL_GROUNDED_HAS_IDS] = {PARAM("HAS_IDS", "ids", 1, true, 0, 0, 1)},
    [MOECL_GROUNDED_HAS_LOGITS] = {PARAM("HAS_LOGITS", "logits", 1, false, 1, 0, 1)},
    /* in the key everywhere: it decides whether the mma kernel serves */
    [MOECL_GROUNDED_PRECISION] = {PARAM("PRECISION", "precision", 2, true, 0, 0, MOECL_PRECISION_3XTF32),
                                  .kernels = MMA, .names = precision_names},
    /* the gating block sits here (moecl_variant_grounded_router.gating_at) */
    [MOECL_GROUNDED_KERNEL] = {PARAM("KERNEL", "kernel", 0, true, 0, 0, MOECL_KERNEL_SPLITK), .names = kernel_names},
    [MOECL_GROUNDED_TM] = {PARAM("TM", "tm", 0, true, 0, 1, UINT32_MAX)},
    [MOECL_GROUNDED_TN] = {PARAM("TN", "tn", 0, true, 0, 0, UINT32_MAX)},
    [MOECL_GROUNDED_TK] = {PARAM("TK", "tk", 0, true, 0, 0, UINT32_MAX)},
    [MOECL_GROUNDED_MT] = {PARAM("MT", "mt", 0, true, 4, 1, UINT32_MAX)},
    [MOECL_GROUNDED_NT] = {PARAM("NT", "nt", 0, true, 4, 1, UINT32_MAX)},
    [MOECL_GROUNDED_TEAM] = {PARAM("TEAM", "team", 0, true, 1, 1, MOECL_LAUNCH_MAX_TEAM)},
    [MOECL_GROUNDED_ROWS] = {PARAM("ROWS", "rows", 0, true, 1, 1, MOECL_LAUNCH_MAX_ROWS)},
    [MOECL_GROUNDED_EPT] = {PARAM("EPT", "ept", 0, true, 1, 1, MOECL_MAX_EXPERTS)},
    [MOECL_GROUNDED_TEAM_SHUFFLE] = {PARAM("TEAM_SHUFFLE", "shuffle", 0, true, 0, 0, 1)},
    [MOECL_GROUNDED_VEC] = {PARAM("VEC", "vec", 0, true, 1, 1, 4), .kernels = TILED},
    [MOECL_GROUNDED_DB] = {PARAM("DB", "db", 0, true, 0, 0, 1), .kernels = TILED},
    [MOECL_GROUNDED_WC] = {PARAM("WC", "wc", 0, true, 0, 1, UINT32_MAX), .kernels = TILED},
    [MOECL_GROUNDED_MMA_MI] = {PARAM("MMA_MI", "mma_mi", 0, true, 0, 1, 2), .kernels = MMA},
    [MOECL_GROUNDED_MMA_NT] = {PARAM("MMA_NT", "mma_nt", 0, true, 0, 1, 8), .kernels = MMA},
    [MOECL_GROUNDED_MMA_WM] = {PARAM("MMA_WM", "mma_wm", 0, true, 0, 1, 8), .kernels = MMA},
    [MOECL_GROUNDED_MMA_WN] = {PARAM("MMA_WN", "mma_wn", 0, true, 0, 1, UINT32_MAX), .kernels = MMA},
    [MOECL_GROUNDED_MMA_KW] = {PARAM("MMA_KW", "mma_kw", 0, true, 0, 8, 16), .kernels = MMA},
    [MOECL_GROUNDED_ROUTE_DISPATCH] = {PARAM("ROUTE_DISPATCH", "dispatch", 1, false, 0, 0, 1),
                                       .kernels = KERNEL_BIT(MOECL_KERNEL_TEAM)},
    [MOECL_GROUNDED_FUSED_WG] = {PARAM("FUSED_WG", "fused_wg", 0, false, 1, 1, UINT32_MAX),
                                 .kernels = KERNEL_BIT(MOECL_KERNEL_TEAM), .with = WITH(MOECL_GROUNDED_ROUTE_DISPATCH)},
    /* g's rounding, cap and one-row logits: cl/gating.cl's logit_of */
    [MOECL_GROUNDED_LOGIT_ROUND] = {PARAM("LOGIT_ROUND", "round", 2, false, 0, 0, MOECL_BF16), .names = dtype_names},
    [MOECL_GROUNDED_SOFTCAP] = {PARAM("SOFTCAP", "softcap", 32, false, 0, 0, UINT32_MAX), .format = FORMAT_FLOAT},
    [MOECL_GROUNDED_LOGITS_ROW] = {PARAM("LOGITS_ROW", "logits_row", 1, false, 0, 0, 1)},
    /* moecl_router_ex's optional outputs (cl/grounded_router.cl) */
    [MOECL_GROUNDED_HAS_COUNTS] = {PARAM("HAS_COUNTS", "counts", 1, false, 0, 0, 1)},
    [MOECL_GROUNDED_HAS_LOAD] = {PARAM("HAS_LOAD", "load", 1, false, 0, 0, 1)},
    [MOECL_GROUNDED_HAS_VALID] = {PARAM("HAS_VALID", "valid", 1, false, 0, 0, 1)},
    /* 1 + moecl_index_dtype where captured_ids is given */
    [MOECL_GROUNDED_CAPTURE] = {PARAM("CAPTURE", "capture", 2, false, 0, 0, 3), .names = capture_names},
    [MOECL_GROUNDED_HAS_SCALE] = {PARAM("HAS_SCALE", "scale", 1, false, 0, 0, 1)},
    /* shared experts (past the third key word): their count, their
     * constant weight's bits, or moecl_router_ex's per-token gate */
    [MOECL_GROUNDED_SHARED] = {PARAM("SHARED", "shared", 7, false, 0, 0, MOECL_MAX_TOPK - 1)},
    [MOECL_GROUNDED_SHARED_WEIGHT] = {PARAM("SHARED_WEIGHT", "shared_weight", 32, false, 0, 0, UINT32_MAX),
                                      .with = WITH(MOECL_GROUNDED_SHARED), .format = FORMAT_FLOAT},
    [MOECL_GROUNDED_SHARED_GATE] = {PARAM("SHARED_GATE", "shared_gate", 1, false, 0, 0, 1),
                                    .with = WITH(MOECL_GROUNDED_SHARED)},
    /* the split-K kernel's work-group (cl/grounded_router.cl, KERNEL 4) */
    [MOECL_GROUNDED_SPLIT_WG] = {PARAM("SPLIT_WG", "split_wg", 0, true, 256, 32, 256), .kernels = SPLITK},
    /* a call of few tokens, which the device table may send to the split-K
     * kernel (MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS): its own plan */
    [MOECL_GROUNDED_SMALL] = {PARAM("SMALL_BATCH", "small", 1, false, 0, 0, 1), .kernels = SPLITK},
};
#undef TILED
#undef MMA
#undef SPLITK
_Static_assert(MOECL_TOPK_PARAMS <= MOECL_VARIANT_MAX_PARAMS && MOECL_GROUNDED_PARAMS <= MOECL_VARIANT_MAX_PARAMS,
               "moecl_variant_values holds every op's parameters");

/* An op's parameters: its own, in the order of its enum, with the gating
 * block before its own parameter gating_at. */
struct moecl_variant_op {
    const char *name;
    moecl_op op;
    const param *params;
    unsigned num_params, gating_at;
};

const moecl_variant_op moecl_variant_topk_gating = {"topk_gating", MOECL_OP_TOPK_GATING, topk_params,
                                                    MOECL_TOPK_PARAMS, MOECL_TOPK_TEAM};
const moecl_variant_op moecl_variant_grounded_router = {"grounded_router", MOECL_OP_GROUNDED_ROUTER, grounded_params,
                                                        MOECL_GROUNDED_PARAMS, MOECL_GROUNDED_KERNEL};

/* ---- walking an op's parameters ---- */

/* The plan key's words (moecl_plan_key) and the bits they hold for the
 * parameters: 62 of the first (the op takes two), all of the others. */
#define KEY_WORDS 4
#define KEY_BITS (62 + 64 * (KEY_WORDS - 1))

/* The i-th parameter of op in order, and its value in v (i below
 * num_params + NUM_GATING_PARAMS). */
static const param *param_at(const moecl_variant_op *op, const moecl_variant_values *v, unsigned i,
                             uint32_t *value)
{
    if (i >= op->gating_at && i < op->gating_at + NUM_GATING_PARAMS) {
        *value = v->gating[i - op->gating_at];
        return &gating_params[i - op->gating_at];
    }
    const unsigned own = i < op->gating_at ? i : i - (unsigned)NUM_GATING_PARAMS;
    *value = v->param[own];
    return &op->params[own];
}

static unsigned count_of(const moecl_variant_op *op)
{
    return op->num_params + (unsigned)NUM_GATING_PARAMS;
}

/* Whether the variant of kernel carries p at value: a kernel that reads
 * it, and (unless p is always there) a value other than the kernel's. */
static bool carried(const moecl_variant_values *v, moecl_kernel_kind kernel, const param *p, uint32_t value)
{
    if (p->kernels && !(p->kernels & KERNEL_BIT(kernel)))
        return false;
    if (p->with && !v->param[p->with - 1])
        return false;
    return p->always || value != p->def;
}

void moecl_variant_gating(moecl_variant_values *v, const moecl_gating_source *source)
{
    for (size_t i = 0; i < NUM_GATING_PARAMS; i++)
        v->gating[i] = gating_params[i].get(source);
}

moecl_plan_key moecl_variant_key(const moecl_context *ctx, const moecl_variant_op *op, const moecl_variant_values *v)
{
    /* moecl_plan_key_of keeps 62 bits of the first word: the fields fill
     * those in order, then the next words, one split where it falls. */
    uint64_t words[KEY_WORDS] = {0, 0, 0, 0};
    const unsigned width[KEY_WORDS] = {62, 64, 64, 64};
    unsigned word = 0, at = 0;
    for (unsigned i = 0; i < count_of(op) && word < KEY_WORDS; i++) {
        uint32_t value;
        const param *p = param_at(op, v, i, &value);
        uint64_t bits = p->key_bits < 32 ? value & ((1u << p->key_bits) - 1) : value;
        for (unsigned left = p->key_bits; left > 0 && word < KEY_WORDS;) {
            const unsigned take = left < width[word] - at ? left : width[word] - at;
            words[word] |= (bits & ((1ull << take) - 1)) << at;
            bits >>= take;
            left -= take;
            at += take;
            if (at == width[word]) {
                word++;
                at = 0;
            }
        }
    }
    return moecl_plan_key_of(ctx, op->op, words[0], words[1], words[2], words[3]);
}

/* Appends printf-formatted text at *used, as far as size allows. */
static void append(char *buf, size_t size, size_t *used, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(buf + *used, size > *used ? size - *used : 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        *used += (size_t)n;
    if (*used >= size)
        *used = size ? size - 1 : 0;
}

static double float_of(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof(f));
    return (double)f;
}

void moecl_variant_defines(const moecl_variant_op *op, const moecl_variant_values *v, moecl_kernel_kind kernel,
                           char *buf, size_t size)
{
    size_t used = 0;
    if (size)
        buf[0] = '\0';
    /* Those always there first, then those set, each in the table's
     * order: a variant's defines are the fixed part followed by what it
     * sets. */
    for (int pass = 0; pass < 2; pass++)
        for (unsigned i = 0; i < count_of(op); i++) {
            uint32_t value;
            const param *p = param_at(op, v, i, &value);
            if (p->always != (pass == 0) || !carried(v, kernel, p, value))
                continue;
            if (p->format == FORMAT_FLOAT)
                append(buf, size, &used, "%s-D%s=%af", used ? " " : "", p->name, float_of(value));
            else
                append(buf, size, &used, "%s-D%s=%u", used ? " " : "", p->name, (unsigned)value);
        }
}

/* The name of value among names, if it has one. */
static const char *name_of(const char *const *names, uint32_t value)
{
    for (uint32_t i = 0; names && names[i]; i++)
        if (i == value)
            return names[i];
    return NULL;
}

size_t moecl_variant_text(const moecl_variant_op *op, const moecl_variant_values *v, moecl_kernel_kind kernel,
                          char *buf, size_t size)
{
    size_t used = 0;
    if (size)
        buf[0] = '\0';
    append(buf, size, &used, "%s %s:", op->name, name_of(kernel_names, kernel));
    for (unsigned i = 0; i < count_of(op); i++) {
        uint32_t value;
        const param *p = param_at(op, v, i, &value);
        if (!carried(v, kernel, p, value))
            continue;
        const char *name = name_of(p->names, value);
        if (name)
            append(buf, size, &used, " %s=%s", p->label, name);
        else if (p->format == FORMAT_FLOAT)
            append(buf, size, &used, " %s=%g", p->label, float_of(value));
        else if (p->max == 1 && p->min == 0) /* a flag: named where set */
            append(buf, size, &used, value ? " %s" : "", p->label);
        else
            append(buf, size, &used, " %s=%u", p->label, (unsigned)value);
    }
    return used;
}

const char *moecl_variant_check(const moecl_variant_op *op, const moecl_variant_values *v, moecl_kernel_kind kernel)
{
    static const moecl_variant_values none;
    const bool values = v != NULL;
    if (!v)
        v = &none;
    unsigned bits = 0;
    for (unsigned i = 0; i < count_of(op); i++) {
        uint32_t value;
        const param *p = param_at(op, v, i, &value);
        if (!p->name || !p->label)
            return "a parameter without a name";
        bits += p->key_bits;
        /* Values beyond the key's bits would share a plan. */
        if (p->key_bits && p->key_bits < 32 && p->max >= (1u << p->key_bits))
            return p->name;
        if (values && carried(v, kernel, p, value) && (value < p->min || value > p->max))
            return p->name;
    }
    return bits > KEY_BITS ? "the packed key (254 bits)" : NULL;
}
