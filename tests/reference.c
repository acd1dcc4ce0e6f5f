/*
 * Float64 reference of docs/routing.md (../shared/spec/routing.md) and the
 * checker that judges a device result against it.
 *
 * Layout: one function per spec step. A per-row function computes, for one
 * token, everything the spec defines (scores, selection scores, group
 * scores, kept groups, reference ids) together with an interval [lo, hi]
 * that the device's fp32 value of every compared quantity must lie in. The
 * reference entry points use the values; the checkers use the values and
 * the intervals, so both always agree on what the spec says.
 *
 * Thread safety: no mutable static state; every call allocates its own
 * scratch and frees it before returning.
 */
#include "reference.h"

#include <moecl/moecl.h>

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The spec caps top_k at 64 (moecl.h), so per-row id lists live on the stack. */
#define MAX_TOP_K 64u

/* Unit roundoff of fp32: the relative error of one correctly rounded fp32
 * operation (round to nearest). */
#define U32 ((double)FLT_EPSILON / 2.0)
/* An error of n ulp of an fp32 result y is at most n * FLT_EPSILON * |y|
 * (ulp(y) <= 2^-23 |y| for normal y). */
#define EPS32 ((double)FLT_EPSILON)
/* Smallest normal fp32 (2^-126): the most a result is off when a device
 * flushes it to zero, or computes it in the subnormal range where the
 * relative bounds above do not hold. */
#define TINY32 0x1p-126
/* Every real >= this rounds to +inf in fp32: the midpoint between FLT_MAX
 * and 2^128. */
#define OVERFLOW32 0x1.ffffffp127
/* A softmax or sigmoid score below this is exactly 0 in fp32 on every
 * device: softmax's exp(x - max) is then below 2^-160 (the sum is at most
 * 4096 = 2^12), sigmoid's exp(-x) overflows to inf; either way 2^11 below
 * the smallest subnormal (2^-149), beyond any ulp bound of exp. Such scores
 * tie exactly, so they go by index (routing.md, 1). */
#define ZERO32 0x1p-172

/* Weights must agree with the float64 reference to this (routing.md, 3). */
#define WEIGHT_TOL 1e-5
/* Below this renormalisation sum the fp32 chosen scores are (near)
 * subnormal: the device's sum may be 0 (no renormalisation) or carry a
 * large relative error, so the weights are only checked to lie between 0
 * and the scaling factor. (With a sum >= 2^-96 the absolute 2^-125 errors of
 * up to 64 scores move a weight by < 1e-6.) */
#define RENORM_TINY_SUM 0x1p-96

#if defined(__GNUC__)
#define REF_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define REF_PRINTF(f, a)
#endif

/* gamma_n of Higham: |fl(sum of n roundings) - exact| <= gamma_n * (sum of
 * the magnitudes involved), for any evaluation order. */
static double gamma32(double n)
{
    return n * U32 / (1.0 - n * U32);
}

/* ====================================================================== */
/* Element types                                                           */
/* ====================================================================== */

static float float_from_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static uint32_t bits_from_float(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* IEEE binary16 -> binary32, exact for every input (subnormals, infinities,
 * NaN payloads). */
static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;

    if (exponent == 0x1fu) /* inf or NaN: the payload moves up unchanged */
        return float_from_bits(sign | 0x7f800000u | (mantissa << 13));
    if (exponent != 0) /* normal: rebias 15 -> 127 */
        return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    /* zero or subnormal: mantissa * 2^-24, exactly representable in fp32 */
    float v = ldexpf((float)mantissa, -24);
    return sign ? -v : v;
}

float ref_load(moecl_dtype dtype, const void *data, size_t index)
{
    const unsigned char *p = data;
    switch (dtype) {
    case MOECL_F16: {
        uint16_t h;
        memcpy(&h, p + index * 2, sizeof h);
        return half_to_float(h);
    }
    case MOECL_BF16: {
        uint16_t h;
        memcpy(&h, p + index * 2, sizeof h);
        return float_from_bits((uint32_t)h << 16);
    }
    case MOECL_F32:
    default: {
        float f;
        memcpy(&f, p + index * 4, sizeof f);
        return f;
    }
    }
}

/* Drop the low `shift` bits of m, rounding to nearest, ties to even. */
static uint32_t round_shift_rne(uint32_t m, unsigned shift)
{
    uint32_t kept = m >> shift;
    uint32_t rest = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (kept & 1u)))
        kept++;
    return kept;
}

uint16_t ref_float_to_half(float f)
{
    uint32_t x = bits_from_float(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7fffffffu;

    if (a > 0x7f800000u) /* NaN stays NaN: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 rounds (ties to even) past 65504: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* normal half (>= 2^-14): rebias, round 23 -> 10 bits */
        uint32_t h = ((a >> 23) - 112u) << 10 | ((a & 0x7fffffu) >> 13);
        uint32_t rest = a & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
            h++; /* a carry into the exponent is the right result */
        return (uint16_t)(sign | h);
    }
    /* subnormal half: value / 2^-24, rounded. value = m * 2^(e - 150) with
     * the 24-bit significand m, so value / 2^-24 = m >> (126 - e). */
    uint32_t e = a >> 23;
    if (e < 102) /* < 2^-25: rounds to zero (float subnormals included) */
        return sign;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    return (uint16_t)(sign | round_shift_rne(m, 126u - e)); /* 0x400 = min normal is right */
}

uint16_t ref_float_to_bf16(float f)
{
    uint32_t x = bits_from_float(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN (quiet) */
        return (uint16_t)((x >> 16) | 0x0040u);
    /* round to nearest even on the low 16 bits; overflow carries into inf */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

size_t ref_dtype_size(moecl_dtype dtype)
{
    switch (dtype) {
    case MOECL_F32:
        return 4;
    case MOECL_F16:
    case MOECL_BF16:
        return 2;
    default:
        return 0;
    }
}

/* ====================================================================== */
/* Ordering (routing.md 1.4, 2; moecl.h "Ordering")                        */
/* ====================================================================== */

/* Larger first; NaN after every number (-inf included); equal values
 * (+0 == -0) and two NaN by lower index. A strict total order. */
static bool ranks_before(double ka, uint32_t a, double kb, uint32_t b)
{
    if (isnan(ka))
        return isnan(kb) && a < b;
    if (isnan(kb))
        return true;
    if (ka != kb)
        return ka > kb;
    return a < b;
}

typedef struct keyed {
    double key;
    uint32_t index;
} keyed;

static int keyed_cmp(const void *pa, const void *pb)
{
    const keyed *a = pa, *b = pb;
    if (ranks_before(a->key, a->index, b->key, b->index))
        return -1;
    if (ranks_before(b->key, b->index, a->key, a->index))
        return 1;
    return 0;
}

/* Sort the entries i < n with mask[i] & bit (all when mask is NULL) into
 * scratch in spec order; returns their count. */
static uint32_t rank_entries(const double *key, const unsigned char *mask, unsigned char bit, uint32_t n,
                             keyed *scratch)
{
    uint32_t count = 0;
    for (uint32_t i = 0; i < n; i++)
        if (!mask || (mask[i] & bit))
            scratch[count++] = (keyed){key[i], i};
    qsort(scratch, count, sizeof *scratch, keyed_cmp);
    return count;
}

/* The interval a device's fp32 value of the float64 value v (bound err on
 * the difference) lies in. NaN stays NaN (lo = hi = NaN: NaN-ness is the
 * same on the device, every step propagates it alike); infinities are exact
 * points; finite values past the fp32 range may be +-inf on the device. */
static void device_interval(double v, double err, double *lo, double *hi)
{
    if (isnan(v) || isinf(v)) {
        *lo = *hi = v;
        return;
    }
    *lo = v - err;
    *hi = v + err;
    if (*hi >= OVERFLOW32)
        *hi = INFINITY;
    if (*lo <= -OVERFLOW32)
        *lo = -INFINITY;
}

/* Can a device rank entry a (upper bound ahi, index ia) before entry b
 * (lower bound blo, index ib)? Only if some values inside the two intervals
 * order them so: a's largest value above b's smallest, or equal to it with
 * the lower index. NaN ranks last; two NaN may come in either order (the
 * checker does not insist on the index order among NaN). */
static bool may_precede(double ahi, uint32_t ia, double blo, uint32_t ib)
{
    if (isnan(ahi))
        return isnan(blo);
    if (isnan(blo))
        return true;
    return ahi > blo || (ahi == blo && ia < ib);
}

/* ====================================================================== */
/* Messages                                                                */
/* ====================================================================== */

static void put_msg(char *msg, size_t size, const char *fmt, ...) REF_PRINTF(3, 4);

static void put_msg(char *msg, size_t size, const char *fmt, ...)
{
    if (!msg || size == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, size, fmt, ap);
    va_end(ap);
}

/* ====================================================================== */
/* Checks shared by both ops                                               */
/* ====================================================================== */

/* Expert flag bits (per row). */
enum {
    F_ELIGIBLE = 1, /* in a group the reference keeps (all, without groups) */
    F_POOL = 2,     /* checker: in a group the device must have kept */
    F_CHOSEN = 4,   /* checker: among the device's ids */
};

/* Every id in [0, n) and the ids of the row distinct. */
static bool check_ids_valid(uint32_t row, const int32_t *ids, uint32_t k, uint32_t n, char *msg, size_t size)
{
    for (uint32_t j = 0; j < k; j++) {
        if (ids[j] < 0 || (uint32_t)ids[j] >= n) {
            put_msg(msg, size, "row %u pos %u: id %d out of range [0, %u)", (unsigned)row, (unsigned)j,
                    (int)ids[j], (unsigned)n);
            return false;
        }
        for (uint32_t i = 0; i < j; i++) {
            if (ids[i] == ids[j]) {
                put_msg(msg, size, "row %u pos %u: id %d repeats pos %u", (unsigned)row, (unsigned)j, (int)ids[j],
                        (unsigned)i);
                return false;
            }
        }
    }
    return true;
}

/* What is wrong with a ranking, for the message. */
typedef enum rank_fault {
    RANK_ORDER,  /* `other`, placed later, ranks above the id beyond rounding */
    RANK_MISSED, /* `other` was not chosen but ranks above the id beyond rounding */
    RANK_TIE,    /* `other` has equal inputs and the lower index, but comes later or not at all */
} rank_fault;

typedef struct rank_problem {
    uint32_t pos;  /* position of the device id at fault */
    int32_t other; /* the expert it cannot precede */
    rank_fault fault;
} rank_problem;

/* Whether the device computes bit-equal values for experts a and b of the
 * row (equal inputs, or values that are certainly 0). */
typedef bool (*same_input_fn)(const void *ctx, uint32_t a, uint32_t b);

/* Can the device put expert a before expert b? As may_precede, and never
 * when the device holds one value for both (same()) and a has the larger
 * index: an exact tie, which goes to the lower index. */
static bool may_precede_expert(const double *v, const double *lo, const double *hi, uint32_t a, uint32_t b,
                               same_input_fn same, const void *ctx)
{
    if (!may_precede(hi[a], a, lo[b], b))
        return false;
    (void)v;
    return !(a > b && same(ctx, a, b));
}

/*
 * Is ids[0..k) a top-k, in order, that a device can produce from values
 * lying in their intervals [lo, hi], choosing among the experts flagged
 * F_POOL? For intervals this holds exactly when every chosen id may
 * precede every later chosen id and every unchosen pool expert (set each
 * value to the largest lower bound from its position on: that is a
 * descending assignment inside every interval). So this accepts every
 * near-tie swap and nothing else. On top, experts with equal inputs must
 * come in index order (may_precede_expert).
 *
 * The intervals of the unchosen are compared with the weakest chosen id
 * only (NaN if any, else the smallest upper bound, ties to the larger
 * index): if that one may precede an expert, all may. Equal inputs are
 * looked for among the chosen with an equal value.
 *
 * Sets F_CHOSEN on the ids (valid, distinct). Returns the position of the
 * weakest id through *weakest, for the fill check of groups.
 */
static bool check_ranking(const double *v, const double *lo, const double *hi, unsigned char *flags, uint32_t n,
                          const int32_t *ids, uint32_t k, same_input_fn same, const void *ctx, rank_problem *problem,
                          uint32_t *weakest)
{
    for (uint32_t j = 0; j < k; j++)
        flags[ids[j]] |= F_CHOSEN;

    /* (a) the device's own order */
    for (uint32_t j = 1; j < k; j++) {
        for (uint32_t i = 0; i < j; i++) {
            if (!may_precede_expert(v, lo, hi, (uint32_t)ids[i], (uint32_t)ids[j], same, ctx)) {
                bool tie = may_precede(hi[ids[i]], (uint32_t)ids[i], lo[ids[j]], (uint32_t)ids[j]);
                *problem = (rank_problem){i, ids[j], tie ? RANK_TIE : RANK_ORDER};
                return false;
            }
        }
    }

    /* (b) nothing left out ranks above a chosen id */
    uint32_t w = 0;
    for (uint32_t j = 1; j < k; j++) {
        double hw = hi[ids[w]], hj = hi[ids[j]];
        if (isnan(hw))
            continue;
        if (isnan(hj) || hj < hw || (hj == hw && ids[j] > ids[w]))
            w = j;
    }
    *weakest = w;
    for (uint32_t e = 0; e < n; e++) {
        if ((flags[e] & (F_POOL | F_CHOSEN)) != F_POOL)
            continue;
        if (!may_precede(hi[ids[w]], (uint32_t)ids[w], lo[e], e)) {
            *problem = (rank_problem){w, (int32_t)e, RANK_MISSED};
            return false;
        }
        for (uint32_t j = 0; j < k; j++) {
            uint32_t c = (uint32_t)ids[j];
            if (c > e && same(ctx, c, e)) {
                *problem = (rank_problem){j, (int32_t)e, RANK_TIE};
                return false;
            }
        }
    }
    return true;
}

/* Message for a ranking problem: the device id at the position, the
 * reference id there, and why the device's choice cannot be rounding. */
static void rank_message(char *msg, size_t size, uint32_t row, const rank_problem *p, const int32_t *ids,
                         const int32_t *ref_ids, const double *v, const double *err, const char *name)
{
    int32_t id = ids[p->pos], ref = ref_ids[p->pos], o = p->other;
    char why[160];
    if (p->fault == RANK_MISSED)
        snprintf(why, sizeof why, "id %d (%s=%.9g +-%.2g) was not chosen but ranks above id %d beyond fp32 rounding",
                 (int)o, name, v[o], err[o], (int)id);
    else if (p->fault == RANK_ORDER)
        snprintf(why, sizeof why, "id %d (%s=%.9g +-%.2g), placed after it, ranks above it beyond fp32 rounding",
                 (int)o, name, v[o], err[o]);
    else
        snprintf(why, sizeof why,
                 "id %d ties id %d exactly on every device (equal inputs, or both scores 0) and has the lower index, "
                 "but comes later or not at all",
                 (int)o, (int)id);
    put_msg(msg, size, "row %u pos %u: id %d (%s=%.9g +-%.2g) but reference id %d (%s=%.9g +-%.2g); %s",
            (unsigned)row, (unsigned)p->pos, (int)id, name, v[id], err[id], (int)ref, name, v[ref], err[ref], why);
}

/* One weight against its float64 expectation: NaN exactly where the
 * reference is NaN, the same infinity where it is infinite, else within
 * tol. */
static bool weight_ok(double got, double want, double tol)
{
    if (isnan(want))
        return isnan(got);
    if (isinf(want))
        return got == want;
    return !isnan(got) && fabs(got - want) <= tol;
}

/* ====================================================================== */
/* Top-k gating (routing.md, section 1)                                    */
/* ====================================================================== */

/* Group flag bits (per row). */
enum {
    G_KEPT = 1,     /* kept by the reference */
    G_MUST = 2,     /* kept by every device whose values lie in the intervals */
    G_POSSIBLE = 4, /* kept by some such device */
    G_USED = 8,     /* holds one of the device's ids */
    G_TRY = 16,     /* checker, zero fill: in the kept set being tried */
};

typedef struct gating_row {
    const moecl_topk_gating_desc *desc;
    const float *bias;        /* of the row being computed (NULL: none) */
    uint32_t E, k, G, gs, kg; /* experts, top_k, groups, group size, topk_group */
    double sigma;             /* bound of the row-wide relative error of the softmax sum */
    /* [E] */
    double *x;       /* logits, widened */
    double *score;   /* step 1: softmax or sigmoid */
    double *s;       /* step 2: selection score */
    double *err;     /* bound of |device fp32 s - s| (the score's bound before step 2) */
    double *lo, *hi; /* device_interval(s, err) */
    /* Zero fill (fill_zero): s, lo and hi with the dropped experts' s set
     * to 0 (fs, flo, fhi), and the score each expert weighs with (wscore:
     * 0 for a dropped expert without a bias). Without it wscore is score. */
    bool fill_zero;
    double *fs, *flo, *fhi, *wscore;
    unsigned char *flags;
    keyed *scratch;
    /* [G] */
    double *gscore, *glo, *ghi; /* step 3: group score and its device interval */
    double *sorted;             /* checker scratch */
    unsigned char *gflags;
    int32_t ids[MAX_TOP_K]; /* step 4: reference ids */
    /* The grounded router's x = g: the bound of |device fp32 g - g| per
     * expert (NULL: x is exact, top-k gating's logits), and whether two
     * experts' device g are bit-equal (NULL: equal x are). */
    const double *xerr;
    bool (*same_x)(const void *ctx, uint32_t a, uint32_t b);
    const void *same_ctx;
    /* moecl_topk_gating_ex's expert_scale (NULL: none): each chosen
     * expert's final weight times its scale. */
    const float *scale;
} gating_row;

static bool gating_desc_valid(const moecl_topk_gating_desc *d)
{
    if (!d || d->num_experts < 1 || d->num_experts > 4096 || d->top_k < 1 || d->top_k > d->num_experts ||
        d->top_k > MAX_TOP_K || d->num_shared_experts > MAX_TOP_K - d->top_k ||
        (d->num_shared_experts && !isfinite(d->shared_expert_weight)))
        return false;
    if (d->num_expert_groups == 0) {
        if (d->topk_group != 0)
            return false;
    } else if (d->num_experts % d->num_expert_groups != 0 || d->topk_group < 1 ||
               d->topk_group > d->num_expert_groups ||
               (uint64_t)d->top_k > (uint64_t)d->topk_group * (d->num_experts / d->num_expert_groups)) {
        return false;
    }
    if (d->gating_dtype != MOECL_F32 && d->gating_dtype != MOECL_F16 && d->gating_dtype != MOECL_BF16)
        return false;
    if ((unsigned)d->scoring > MOECL_SCORING_RAW || (unsigned)d->weighting > MOECL_WEIGHTS_SIGMOID_CHOSEN)
        return false;
    if (d->group_score != MOECL_GROUP_SCORE_MAX && d->group_score != MOECL_GROUP_SCORE_TOP2_SUM)
        return false;
    if (d->group_fill != MOECL_GROUP_FILL_NEG_INF && d->group_fill != MOECL_GROUP_FILL_ZERO)
        return false;
    if (!(d->renormalize_floor == 0.0f || (isfinite(d->renormalize_floor) && d->renormalize_floor >= FLT_MIN)))
        return false;
    if (!(d->renormalize_eps == 0.0f || (isfinite(d->renormalize_eps) && d->renormalize_eps >= FLT_MIN)))
        return false;
    if (d->renormalize_floor != 0.0f && d->renormalize_eps != 0.0f)
        return false;
    return isfinite(d->routed_scaling_factor);
}

static void gating_row_free(gating_row *r)
{
    free(r->x);
    free(r->gscore);
    free(r->flags);
    free(r->scratch);
}

static bool gating_row_alloc(gating_row *r, const moecl_topk_gating_desc *d)
{
    memset(r, 0, sizeof *r);
    r->desc = d;
    r->E = d->num_experts;
    r->k = d->top_k;
    r->G = d->num_expert_groups;
    r->gs = r->G ? r->E / r->G : r->E;
    r->kg = d->topk_group;
    r->fill_zero = r->G > 0 && d->group_fill == MOECL_GROUP_FILL_ZERO;
    size_t E = r->E, G = r->G ? r->G : 1;
    r->x = malloc(10 * E * sizeof(double));
    r->gscore = malloc(4 * G * sizeof(double));
    r->flags = calloc(E + G, 1);
    r->scratch = malloc(E * sizeof(keyed));
    if (!r->x || !r->gscore || !r->flags || !r->scratch) {
        gating_row_free(r);
        return false;
    }
    r->score = r->x + E;
    r->s = r->score + E;
    r->err = r->s + E;
    r->lo = r->err + E;
    r->hi = r->lo + E;
    r->fs = r->hi + E;
    r->flo = r->fs + E;
    r->fhi = r->flo + E;
    r->wscore = r->fhi + E;
    r->glo = r->gscore + G;
    r->ghi = r->glo + G;
    r->sorted = r->ghi + G;
    r->gflags = r->flags + E;
    return true;
}

/*
 * Step 1, softmax: score_e = exp(x_e - m) / sum exp(x_i - m), m the largest
 * non-NaN logit (NaN if all are). IEEE propagation does the rest: a NaN
 * logit makes the sum NaN, a +inf logit gives inf - inf = NaN, an all -inf
 * row gives -inf - -inf = NaN; every score of such a row is NaN.
 *
 * Error bound of the device's fp32 score (x_e and m are exact fp32):
 *   d = fl(x_e - m)         relative error u = eps/2, so exp(d) is off by a
 *                           factor exp(|x_e - m| u) ~ 1 + |x_e - m| u;
 *   p = exp(d)              <= 4 ulp: relative 4 eps;
 *   score = p / S           <= 3 ulp: relative 3 eps.
 * First order |x_e - m| u + 7 eps; one more eps covers the products of
 * those factors (|x_e - m| <= 104 wherever fp32 p is not already
 * subnormal). p or the quotient falling below 2^-126 (flushed, or
 * subnormal so the relative bounds fail) costs at most 2^-126 each
 * (S >= 1): absolute 2^-125.
 *
 * The rounding error of S itself scales every score of the row by one
 * common factor 1/(1 + sigma). That never changes an order between scores,
 * nor between group scores (max and sum are homogeneous), so it is left
 * out of the per-expert bound; it only matters once a bias is added (step
 * 2). sigma comes from rho >= |S~ - S| / S: the p errors (|d| u + 4 eps,
 * weighted by score), the fp32 summation in any order (gamma_{E-1}) and
 * the flushed p (E 2^-126, S >= 1).
 */
static void softmax_scores(gating_row *r)
{
    uint32_t E = r->E;
    double m = NAN;
    for (uint32_t e = 0; e < E; e++)
        if (!isnan(r->x[e]) && (isnan(m) || r->x[e] > m))
            m = r->x[e];

    double sum = 0.0;
    for (uint32_t e = 0; e < E; e++) {
        r->score[e] = exp(r->x[e] - m);
        sum += r->score[e];
    }

    double p_err = 0.0; /* sum of score_e * (relative error of p_e) */
    for (uint32_t e = 0; e < E; e++) {
        double score = r->score[e] / sum;
        if (score < ZERO32)
            score = 0.0; /* 0 on every device: an exact tie */
        double d = fabs(r->x[e] - m);
        r->score[e] = score;
        r->err[e] = 2.0 * TINY32;
        if (score > 0.0) { /* (score 0: x_e = -inf or exp underflow, d may be inf) */
            r->err[e] += score * (d * U32 + 8.0 * EPS32);
            p_err += score * (d * U32 + 4.0 * EPS32);
        }
    }
    double rho = p_err + gamma32(E - 1.0) * (1.0 + p_err) + E * TINY32;
    r->sigma = rho / (1.0 - rho);
}

/*
 * Step 1, sigmoid: 1 / (1 + exp(-x)); +inf -> 1, -inf -> 0, NaN -> NaN.
 *
 * Error bound of the device's fp32 score: exp(-x) <= 4 ulp (relative
 * 4 eps); 1 + that, rounded (u), changes 1 + exp(-x) by at most
 * 4 eps + u relatively; the division <= 3 ulp (3 eps): first order
 * 7.5 eps, 8 eps with the second-order terms. exp(-x) overflowing to inf
 * (x < -88.7) gives 0 where the true score is < 2^-126, and a subnormal or
 * flushed quotient is off by < 2^-126: absolute 2^-125 covers both.
 * No row-wide term.
 */
static void sigmoid_scores(gating_row *r)
{
    for (uint32_t e = 0; e < r->E; e++) {
        double score = 1.0 / (1.0 + exp(-r->x[e]));
        if (score < ZERO32)
            score = 0.0; /* 0 on every device: an exact tie */
        r->score[e] = score;
        r->err[e] = 2.0 * TINY32 + (score > 0.0 ? 8.0 * EPS32 * score : 0.0);
    }
    r->sigma = 0.0;
}

/*
 * Step 1, sqrt(softplus(x)), softplus(x) = x for x > 20, log1p(exp(x))
 * otherwise; NaN -> NaN, -inf -> 0, +inf -> +inf.
 *
 * Error bound of the device's fp32 score. x > 20: sqrt(x), <= 3 ulp.
 * Otherwise y = exp(x) carries a relative 4 eps; log1p(y (1 + d)) differs
 * from log1p(y) by about d y / (1 + y), which relative to log1p(y) is at
 * most d (log1p(y) >= y / (1 + y)): 4 eps, and log1p's own <= 2 ulp make
 * softplus 6 eps; sqrt halves a relative error (3 eps) and adds its own
 * <= 3 ulp: 6 eps, 7 eps with the second-order terms. exp(x) below 2^-126
 * (x < -87.3) may be flushed to 0 or subnormal: softplus is then off by up
 * to 2^-126 absolutely, and its sqrt by up to 2^-63: the absolute term.
 * Certainly 0 only where exp(x) is below half the smallest subnormal
 * (x < -103.98, score < 2^-75): there every device gives 0 (and an exact
 * tie); ZERO32-style.
 */
static void sqrtsoftplus_scores(gating_row *r)
{
    for (uint32_t e = 0; e < r->E; e++) {
        const double x = r->x[e];
        double score = sqrt(x > 20.0 ? x : log1p(exp(x)));
        if (x < -104.0)
            score = 0.0; /* 0 on every device: an exact tie */
        r->score[e] = score;
        r->err[e] = 0x1p-62 + (score > 0.0 ? 7.0 * EPS32 * score : 0.0);
    }
    r->sigma = 0.0;
}

/* Step 1, the logit itself: exact. */
static void raw_scores(gating_row *r)
{
    for (uint32_t e = 0; e < r->E; e++) {
        r->score[e] = r->x[e];
        r->err[e] = 0.0;
    }
    r->sigma = 0.0;
}

static void gating_scores(const void *gating, uint32_t row, gating_row *r)
{
    for (uint32_t e = 0; e < r->E; e++)
        r->x[e] = ref_load(r->desc->gating_dtype, gating, (size_t)row * r->E + e);
    switch (r->desc->scoring) {
    case MOECL_SCORING_SOFTMAX:
        softmax_scores(r);
        break;
    case MOECL_SCORING_SIGMOID:
        sigmoid_scores(r);
        break;
    case MOECL_SCORING_SQRTSOFTPLUS:
        sqrtsoftplus_scores(r);
        break;
    case MOECL_SCORING_RAW:
        raw_scores(r);
        break;
    }
}

/*
 * Step 2: s = score + bias. The bias steers selection only.
 * Error bound: the fp32 add rounds once (u |s|, the second-order part is
 * inside the 1 eps slack of step 1) and may flush a subnormal sum
 * (2^-126); with softmax the row-wide factor of the sum no longer cancels
 * against the bias, so sigma * score joins. Without a bias s = score and
 * the bound stays the score's.
 */
static void selection_scores(const float *bias, gating_row *r)
{
    for (uint32_t e = 0; e < r->E; e++) {
        double s = r->score[e];
        if (bias) {
            s += (double)bias[e];
            r->err[e] += U32 * fabs(s) + TINY32 + r->sigma * r->score[e];
        }
        r->s[e] = s;
        device_interval(s, r->err[e], &r->lo[e], &r->hi[e]);
    }
}

/* The two largest non-NaN values of v[first .. first+n) (a repeated maximum
 * fills both); returns how many non-NaN there are. */
static uint32_t top_two(const double *v, uint32_t first, uint32_t n, double *a, double *b)
{
    uint32_t count = 0;
    *a = *b = -INFINITY;
    for (uint32_t i = first; i < first + n; i++) {
        if (isnan(v[i]))
            continue;
        count++;
        if (v[i] > *a) {
            *b = *a;
            *a = v[i];
        } else if (v[i] > *b) {
            *b = v[i];
        }
    }
    return count;
}

/*
 * Step 3a: one group's score and the interval of the device's value.
 * MAX: the largest non-NaN s. TOP2_SUM: the sum of the two largest non-NaN
 * s (a repeated maximum counts twice); a group with one non-NaN s (or of
 * one expert) scores that s. An all-NaN group scores NaN.
 *
 * Both are monotone in every s, so the device's value lies between the
 * function of the lower bounds and that of the upper bounds; the fp32 add of
 * TOP2_SUM rounds once more (u |sum|, and 2^-126 if flushed). NaN-ness of
 * each s is the same on the device, so the same s are passed over. If two
 * infinities of opposite sign meet in TOP2_SUM, the sum is NaN in both.
 */
static void group_score(gating_row *r, uint32_t g)
{
    uint32_t first = g * r->gs;
    double v, lo, hi;
    if (r->desc->group_score == MOECL_GROUP_SCORE_MAX) {
        double unused;
        uint32_t n = top_two(r->s, first, r->gs, &v, &unused);
        top_two(r->lo, first, r->gs, &lo, &unused);
        top_two(r->hi, first, r->gs, &hi, &unused);
        if (n == 0)
            v = lo = hi = NAN;
    } else {
        double v2, lo2, hi2;
        uint32_t n = top_two(r->s, first, r->gs, &v, &v2);
        top_two(r->lo, first, r->gs, &lo, &lo2);
        top_two(r->hi, first, r->gs, &hi, &hi2);
        if (n == 0) {
            v = lo = hi = NAN;
        } else if (n >= 2) {
            v += v2;
            lo += lo2;
            hi += hi2;
            if (isnan(v)) {
                lo = hi = NAN;
            } else {
                lo -= U32 * fabs(lo) + TINY32;
                hi += U32 * fabs(hi) + TINY32;
            }
        }
    }
    r->gscore[g] = v;
    if (!isnan(v)) {
        if (hi >= OVERFLOW32)
            hi = INFINITY;
        if (lo <= -OVERFLOW32)
            lo = -INFINITY;
    }
    r->glo[g] = lo;
    r->ghi[g] = hi;
}

/* Step 3: group limit. Keep the topk_group groups ranking first by group
 * score (NaN last, ties to the lower group); only their experts are
 * eligible (MOECL_GROUP_FILL_NEG_INF), or every expert is, those of the
 * dropped groups with s = 0 (MOECL_GROUP_FILL_ZERO, fill_dropped).
 * Without groups every expert is. */
static void group_limit(gating_row *r)
{
    memset(r->flags, 0, r->E + (r->G ? r->G : 1));
    if (r->G == 0) {
        memset(r->flags, F_ELIGIBLE, r->E);
        return;
    }
    for (uint32_t g = 0; g < r->G; g++)
        group_score(r, g);
    rank_entries(r->gscore, NULL, 0, r->G, r->scratch);
    for (uint32_t i = 0; i < r->kg; i++)
        r->gflags[r->scratch[i].index] |= G_KEPT;
    for (uint32_t e = 0; e < r->E; e++)
        if (r->gflags[e / r->gs] & G_KEPT)
            r->flags[e] |= F_ELIGIBLE;
}

/*
 * Step 3, zero fill: the experts outside the kept groups (those without
 * F_ELIGIBLE, or for the checker those of groups without G_TRY) select with
 * s = 0 exactly, an interval [0, 0]. Without a bias the fill replaces the
 * score itself (the seed masks the scores, which are also its weights), so
 * such an expert weighs 0; with a bias only the selection score is replaced
 * (TensorRT-LLM's PyTorch DeepSeek-V3 path masks the biased scores and
 * takes the weights from the unbiased ones), so it weighs its score.
 */
static void fill_dropped(gating_row *r, bool by_try)
{
    for (uint32_t e = 0; e < r->E; e++) {
        const bool kept = by_try ? (r->gflags[e / r->gs] & G_TRY) != 0 : (r->flags[e] & F_ELIGIBLE) != 0;
        r->fs[e] = kept ? r->s[e] : 0.0;
        r->flo[e] = kept ? r->lo[e] : 0.0;
        r->fhi[e] = kept ? r->hi[e] : 0.0;
        r->wscore[e] = kept || r->bias ? r->score[e] : 0.0;
    }
}

/* Step 4: the top_k eligible experts by s, in spec order; with the zero
 * fill, the top_k of all experts by the filled s. */
static void select_topk(gating_row *r)
{
    if (r->fill_zero) {
        fill_dropped(r, false);
        rank_entries(r->fs, NULL, 0, r->E, r->scratch);
    } else {
        memcpy(r->wscore, r->score, r->E * sizeof(double));
        rank_entries(r->s, r->flags, F_ELIGIBLE, r->E, r->scratch);
    }
    for (uint32_t j = 0; j < r->k; j++)
        r->ids[j] = (int32_t)r->scratch[j].index;
}

/* Steps 1-4 for one row: the single source of both the reference and the
 * checker. */
static void gating_row_compute(const void *gating, const float *bias, uint32_t row, gating_row *r)
{
    r->bias = bias;
    gating_scores(gating, row, r);
    selection_scores(bias, r);
    group_limit(r);
    select_topk(r);
}

/* Step 5's divisor of the sum S of the chosen scores: 1 without
 * renormalize; with it S + eps (an eps > 0, the models' rule, NaN
 * included), S when S > 0 (moecl's rule, renormalize_floor 0) or
 * max(S, floor) (a floor > 0, llama.cpp's clamp); 1 for a NaN S, and for
 * S = 0 without a floor. */
static double weights_divisor(const moecl_topk_gating_desc *d, double sum)
{
    if (d->renormalize && d->renormalize_eps > 0.0f)
        return sum + (double)d->renormalize_eps;
    if (!d->renormalize || isnan(sum))
        return 1.0;
    const double fl = (double)d->renormalize_floor;
    if (fl > 0.0)
        return sum >= fl ? sum : fl;
    return sum > 0.0 ? sum : 1.0;
}

/* Softmax over the chosen x, max-subtracted (m the largest non-NaN one).
 * IEEE propagation: a NaN among them, a +inf maximum (inf - inf) or all
 * -inf (-inf - -inf) make every weight NaN. */
static void softmax_chosen(const double *x, const int32_t *ids, uint32_t k, double *w)
{
    double m = -INFINITY, sum = 0.0;
    for (uint32_t j = 0; j < k; j++)
        if (x[ids[j]] > m)
            m = x[ids[j]];
    for (uint32_t j = 0; j < k; j++) {
        w[j] = exp(x[ids[j]] - m);
        sum += w[j];
    }
    for (uint32_t j = 0; j < k; j++)
        w[j] /= sum;
}

/* Step 5: w of each chosen expert by the weighting: its unbiased score
 * (wscore: 0 for a zero-filled expert without a bias), a softmax over the
 * chosen logits x, or the sigmoid of its logit; divided by
 * weights_divisor(); times routed_scaling_factor. Returns the divisor. */
static double chosen_weights(const moecl_topk_gating_desc *d, moecl_weighting weighting, const double *wscore,
                             const double *x, const int32_t *ids, double *w)
{
    double sum = 0.0;
    if (weighting == MOECL_WEIGHTS_SOFTMAX_CHOSEN)
        softmax_chosen(x, ids, d->top_k, w);
    for (uint32_t j = 0; j < d->top_k; j++) {
        if (weighting == MOECL_WEIGHTS_SCORE)
            w[j] = wscore[ids[j]];
        else if (weighting == MOECL_WEIGHTS_SIGMOID_CHOSEN)
            w[j] = 1.0 / (1.0 + exp(-x[ids[j]]));
        sum += w[j];
    }
    const double divisor = weights_divisor(d, sum);
    for (uint32_t j = 0; j < d->top_k; j++)
        w[j] = w[j] / divisor * (double)d->routed_scaling_factor;
    return divisor;
}

/* A shared slot's weight: the fp32 product (the float64 product of two
 * floats is exact, so one rounding gives it). */
static float shared_weight(const moecl_topk_gating_desc *d)
{
    return (float)((double)d->shared_expert_weight * (double)d->routed_scaling_factor);
}

void ref_topk_gating(const moecl_topk_gating_desc *desc, const void *gating, const float *bias,
                     float *topk_weights, int32_t *topk_ids)
{
    if (!desc || desc->num_tokens == 0 || !gating_desc_valid(desc))
        return;
    const size_t k = desc->top_k, row = k + desc->num_shared_experts;
    gating_row r;
    if (!gating_row_alloc(&r, desc)) {
        /* No way to report: poison the outputs so that any comparison fails. */
        for (size_t i = 0; i < (size_t)desc->num_tokens * row; i++) {
            if (topk_weights)
                topk_weights[i] = NAN;
            if (topk_ids)
                topk_ids[i] = -1;
        }
        return;
    }
    for (uint32_t t = 0; t < desc->num_tokens; t++) {
        double w[MAX_TOP_K];
        gating_row_compute(gating, bias, t, &r);
        chosen_weights(desc, desc->weighting, r.wscore, r.x, r.ids, w);
        for (size_t j = 0; j < row; j++) {
            if (topk_weights)
                topk_weights[t * row + j] = j < k ? (float)w[j] : shared_weight(desc);
            if (topk_ids)
                topk_ids[t * row + j] = j < k ? r.ids[j] : (int32_t)(desc->num_experts + j - k);
        }
    }
    gating_row_free(&r);
}

/* Count of the sorted (ascending) a[0..n) that are >= v (strict: > v). */
static uint32_t count_above(const double *a, uint32_t n, double v, bool strict)
{
    uint32_t lo = 0, hi = n; /* first index whose value is >= v (> v) */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (strict ? a[mid] > v : a[mid] >= v)
            hi = mid;
        else
            lo = mid + 1;
    }
    return n - lo;
}

static int double_cmp(const void *pa, const void *pb)
{
    double a = *(const double *)pa, b = *(const double *)pb;
    return (a > b) - (a < b);
}

/* Sorted non-NaN entries of v[0..n) into out; returns their count. */
static uint32_t sorted_finite(const double *v, uint32_t n, double *out)
{
    uint32_t count = 0;
    for (uint32_t i = 0; i < n; i++)
        if (!isnan(v[i]))
            out[count++] = v[i];
    qsort(out, count, sizeof *out, double_cmp);
    return count;
}

/*
 * Which groups a device whose group scores lie in [glo, ghi] must keep
 * (fewer than topk_group other groups can rank above it) and which it can
 * keep (fewer than topk_group must rank above it). Counted on sorted
 * bounds; an exact tie of bounds counts as "can rank above" both ways (it
 * needs zero-width intervals, i.e. infinite group scores: lenient there).
 */
static void classify_groups(gating_row *r)
{
    uint32_t G = r->G, kg = r->kg;
    uint32_t n = sorted_finite(r->ghi, G, r->sorted);
    for (uint32_t g = 0; g < G; g++) {
        uint32_t can_above = isnan(r->ghi[g]) ? G - 1 : count_above(r->sorted, n, r->glo[g], false) - 1;
        if (can_above < kg)
            r->gflags[g] |= G_MUST;
    }
    n = sorted_finite(r->glo, G, r->sorted);
    for (uint32_t g = 0; g < G; g++) {
        uint32_t must_above = isnan(r->ghi[g]) ? n : count_above(r->sorted, n, r->ghi[g], true);
        if (must_above < kg)
            r->gflags[g] |= G_POSSIBLE;
    }
}

/* The group score of rank topk_group - 1 in the reference: the boundary
 * between kept and dropped, for messages. */
static uint32_t boundary_group(gating_row *r)
{
    rank_entries(r->gscore, NULL, 0, r->G, r->scratch);
    return r->scratch[r->kg - 1].index;
}

/* Equal bias and either equal logits or scores that are both certainly 0
 * (ZERO32): the device's s are bit-equal. */
static bool gating_same_input(const void *ctx, uint32_t a, uint32_t b)
{
    const gating_row *r = ctx;
    if (r->bias && r->bias[a] != r->bias[b])
        return false;
    if (r->score[a] == 0.0 && r->score[b] == 0.0 && !r->xerr)
        return true;
    return r->same_x ? r->same_x(r->same_ctx, a, b) : r->x[a] == r->x[b];
}

/* Groups g and h hold experts with equal inputs, position by position. */
static bool same_group_input(const gating_row *r, uint32_t g, uint32_t h)
{
    for (uint32_t i = 0; i < r->gs; i++)
        if (!gating_same_input(r, g * r->gs + i, h * r->gs + i))
            return false;
    return true;
}

/*
 * Group limit as a device may have applied it. Every id must lie in a group
 * the device can keep; the groups it used plus the groups it must keep
 * (those kept whatever the rounding, and lower-index twins of used groups)
 * may not exceed topk_group; their experts form the pool the ids are ranked
 * against. Sets F_POOL. Returns the number of further groups the device
 * kept without using (checked by check_group_fill).
 */
static bool check_group_limit(gating_row *r, uint32_t row, const int32_t *ids, uint32_t *fill, char *msg,
                              size_t size)
{
    classify_groups(r);
    for (uint32_t j = 0; j < r->k; j++) {
        uint32_t g = (uint32_t)ids[j] / r->gs;
        if (!(r->gflags[g] & G_POSSIBLE)) {
            uint32_t b = boundary_group(r);
            put_msg(msg, size,
                    "row %u pos %u: id %d is in group %u (group score %.9g, [%.9g, %.9g]) that cannot be kept: "
                    "group %u holds the topk_group-th largest group score %.9g ([%.9g, %.9g])",
                    (unsigned)row, (unsigned)j, (int)ids[j], (unsigned)g, r->gscore[g], r->glo[g], r->ghi[g],
                    (unsigned)b, r->gscore[b], r->glo[b], r->ghi[b]);
            return false;
        }
        r->gflags[g] |= G_USED;
    }
    /* A group with the same inputs as a used one has the bit-equal group
     * score on the device; with the lower index it ranks above, so it was
     * kept too (its experts then tie exactly with the used group's). */
    for (uint32_t g = 0; g < r->G; g++) {
        if (!(r->gflags[g] & G_USED))
            continue;
        for (uint32_t h = 0; h < g; h++)
            if (!(r->gflags[h] & (G_USED | G_MUST)) && r->gscore[h] == r->gscore[g] && same_group_input(r, h, g))
                r->gflags[h] |= G_MUST;
    }
    uint32_t kept = 0;
    for (uint32_t g = 0; g < r->G; g++)
        if (r->gflags[g] & (G_USED | G_MUST))
            kept++;
    if (kept > r->kg) {
        put_msg(msg, size,
                "row %u: the groups of the ids and the groups every correct result keeps (beyond rounding, "
                "or as lower-index twins of a used group) make %u groups, more than topk_group %u",
                (unsigned)row, (unsigned)kept, (unsigned)r->kg);
        return false;
    }
    for (uint32_t e = 0; e < r->E; e++)
        if (r->gflags[e / r->gs] & (G_USED | G_MUST))
            r->flags[e] |= F_POOL;
    *fill = r->kg - kept;
    return true;
}

/* The device kept `fill` groups it took no id from. There must be that many
 * groups it can keep none of whose experts ranks above its weakest id. */
static bool check_group_fill(gating_row *r, uint32_t row, const int32_t *ids, uint32_t weakest, uint32_t fill,
                             char *msg, size_t size)
{
    if (fill == 0)
        return true;
    int32_t w = ids[weakest];
    uint32_t harmless = 0;
    int32_t blocker = -1;
    for (uint32_t g = 0; g < r->G && harmless < fill; g++) {
        if ((r->gflags[g] & (G_USED | G_MUST)) || !(r->gflags[g] & G_POSSIBLE))
            continue;
        bool ok = true;
        for (uint32_t e = g * r->gs; e < (g + 1) * r->gs && ok; e++) {
            if (!may_precede(r->hi[w], (uint32_t)w, r->lo[e], e)) {
                ok = false;
                if (blocker < 0)
                    blocker = (int32_t)e;
            }
        }
        harmless += ok;
    }
    if (harmless >= fill)
        return true;
    put_msg(msg, size,
            "row %u pos %u: id %d (s=%.9g +-%.2g): %u more group(s) must be kept, but every group that can be "
            "holds an expert ranking above it beyond fp32 rounding (e.g. id %d, s=%.9g +-%.2g)",
            (unsigned)row, (unsigned)weakest, (int)w, r->s[w], r->err[w], (unsigned)fill, (int)blocker,
            blocker >= 0 ? r->s[blocker] : NAN, blocker >= 0 ? r->err[blocker] : NAN);
    return false;
}

/*
 * The weights' share of the grounded router's g errors (xerr), at the ids
 * the device chose. Before renormalising, weight v_j moves by dv_j: the
 * score's bound err (which holds g's share, see grounded_scores) for
 * WEIGHTS_SCORE; for a softmax over the chosen g, v_j = 1 / sum_l
 * exp(g_l - g_j) moves by a factor of at most exp(xerr_j + max xerr);
 * for the sigmoid of g_j by at most exp(xerr_j) (sigmoid' <= sigmoid).
 * Renormalised by D, w_j = f v_j / D moves by |f| / D (dv_j + |v_j|
 * sum dv / D); else by |f| dv_j.
 */
static void x_error_tolerance(const gating_row *r, const int32_t *ids, double divisor, double *xtol)
{
    const moecl_topk_gating_desc *d = r->desc;
    moecl_topk_gating_desc plain = *d;
    plain.renormalize = false;
    plain.routed_scaling_factor = 1.0f;
    double v[MAX_TOP_K], dv[MAX_TOP_K], max_err = 0.0, sum_dv = 0.0;
    chosen_weights(&plain, d->weighting, r->wscore, r->x, ids, v);
    for (uint32_t j = 0; j < r->k; j++)
        max_err = fmax(max_err, r->xerr[ids[j]]);
    for (uint32_t j = 0; j < r->k; j++) {
        const double e = r->xerr[ids[j]];
        dv[j] = d->weighting == MOECL_WEIGHTS_SCORE          ? r->err[ids[j]]
                : d->weighting == MOECL_WEIGHTS_SOFTMAX_CHOSEN ? fabs(v[j]) * expm1(e + max_err)
                                                              : fabs(v[j]) * expm1(e);
        if (!isfinite(dv[j]))
            dv[j] = 0.0; /* NaN or infinite weights are checked exactly */
        sum_dv += dv[j];
    }
    const double f = fabs((double)d->routed_scaling_factor);
    for (uint32_t j = 0; j < r->k; j++)
        xtol[j] = d->renormalize && divisor != 1.0 ? f / divisor * (dv[j] + (isfinite(v[j]) ? fabs(v[j]) : 0.0) * sum_dv / divisor)
                                                   : f * dv[j];
}

/* Weights of one row against the reference scores (wscore) of the ids the
 * device chose. */
static bool check_gating_weights(const gating_row *r, uint32_t row, const int32_t *ids, const float *got, char *msg,
                                 size_t size)
{
    const moecl_topk_gating_desc *d = r->desc;
    double want[MAX_TOP_K];
    double factor = (double)d->routed_scaling_factor;
    double tol = WEIGHT_TOL * fmax(1.0, fabs(factor));
    double divisor = chosen_weights(d, d->weighting, r->wscore, r->x, ids, want);
    bool tiny = d->renormalize && divisor < RENORM_TINY_SUM;
    /* Unbounded weights (the scores of RAW and SQRTSOFTPLUS): the fp32
     * error is relative, 16 eps covering the score's (section 4) and the
     * divide and scale; renormalised, the fp32 sum of k terms adds
     * gamma_k times sum |w| / |sum w|, which cancellation can make large
     * (the RAW logits have either sign). */
    double rel = 0.0;
    if (d->weighting == MOECL_WEIGHTS_SCORE &&
        (d->scoring == MOECL_SCORING_RAW || d->scoring == MOECL_SCORING_SQRTSOFTPLUS)) {
        double mag = 0.0, sum = 0.0;
        for (uint32_t j = 0; j < r->k; j++) {
            mag += fabs(want[j]);
            sum += want[j];
        }
        const bool cancels = d->renormalize && divisor != 1.0 && sum != 0.0 && isfinite(mag);
        rel = 16.0 * EPS32 + (cancels ? gamma32(r->k) * mag / fabs(sum) : 0.0);
    }
    double xtol[MAX_TOP_K] = {0};
    if (r->xerr)
        x_error_tolerance(r, ids, divisor, xtol);
    /* A narrow weights_dtype rounds the f32 weight once more, to nearest:
     * half an ulp, 2^-8 (bf16) or 2^-11 (f16) of it relative; past the
     * type's largest finite value (plus half an ulp) it is +-inf. */
    const double out_rel = d->weights_dtype == MOECL_BF16 ? 0x1p-8 : d->weights_dtype == MOECL_F16 ? 0x1p-11 : 0.0;
    const double out_max = d->weights_dtype == MOECL_BF16 ? 0x1.ff8p127 : d->weights_dtype == MOECL_F16 ? 65520.0
                                                                                                        : INFINITY;
    for (uint32_t j = 0; j < r->k; j++) {
        double w = (double)got[j];
        /* The scale multiplies the weight and its error bound (one more
         * f32 rounding, inside WEIGHT_TOL). */
        const double sj = r->scale && ids[j] >= 0 && (uint32_t)ids[j] < r->E ? (double)r->scale[ids[j]] : 1.0;
        want[j] *= sj;
        const double stol = tol * fmax(1.0, fabs(sj));
        const double wtol = stol + (rel * fabs(want[j]) + xtol[j]) * fmax(1.0, fabs(sj));
        const double otol = out_rel * (fabs(want[j]) + wtol);
        const double lo = fmin(0.0, factor * sj) * (1.0 + out_rel) - stol;
        const double hi = fmax(0.0, factor * sj) * (1.0 + out_rel) + stol;
        bool ok = tiny ? (w >= lo && w <= hi) : weight_ok(w, want[j], wtol + otol);
        /* An overflow of the narrow type: the sign of the weight, and a
         * weight that may round past the type's range. */
        if (!ok && !tiny && isinf(w) && !isinf(want[j]) && isfinite(out_max))
            ok = (w > 0) == (want[j] > 0) && fabs(want[j]) + wtol + otol >= out_max;
        if (!ok) {
            put_msg(msg, size,
                    "row %u pos %u: weight %.9g for id %d but reference %.9g (score %.9g, weighing %.9g, %s "
                    "divisor %.9g, routed_scaling_factor %.9g)%s",
                    (unsigned)row, (unsigned)j, w, (int)ids[j], want[j], r->score[ids[j]], r->wscore[ids[j]],
                    d->renormalize ? "renormalised over the chosen ids," : "chosen score", divisor, factor,
                    tiny ? "; the divisor is tiny, so only 0 <= weight/factor <= 1 is required" : "");
            return false;
        }
    }
    return true;
}

/* Zero fill: an expert the kept set being tried (G_TRY) drops has s = 0
 * exactly; so has a kept one whose score is certainly 0 and whose bias is
 * 0 (or absent). */
static bool filled_zero(const gating_row *r, uint32_t e)
{
    if (!(r->gflags[e / r->gs] & G_TRY))
        return true;
    return r->score[e] == 0.0 && (!r->bias || r->bias[e] == 0.0f);
}

/* Bit-equal filled s on the device: two kept experts as without the fill,
 * else both certainly 0. */
static bool filled_same_input(const void *ctx, uint32_t a, uint32_t b)
{
    const gating_row *r = ctx;
    if ((r->gflags[a / r->gs] & G_TRY) && (r->gflags[b / r->gs] & G_TRY))
        return gating_same_input(r, a, b);
    return filled_zero(r, a) && filled_zero(r, b);
}

/* The ids and weights against the kept set flagged G_TRY. */
static bool check_filled(gating_row *r, uint32_t row, const float *weights, const int32_t *ids, char *msg,
                         size_t size)
{
    fill_dropped(r, true);
    memset(r->flags, F_POOL, r->E);
    rank_problem p;
    uint32_t weakest;
    if (!check_ranking(r->fs, r->flo, r->fhi, r->flags, r->E, ids, r->k, filled_same_input, r, &p, &weakest)) {
        rank_message(msg, size, row, &p, ids, r->ids, r->fs, r->err, "filled s");
        return false;
    }
    return check_gating_weights(r, row, ids, weights, msg, size);
}

/* Kept sets tried per row at most; past it the row fails (a checker
 * limit, said in the message). */
#define MAX_KEPT_SETS 20000u

typedef struct kept_search {
    gating_row *r;
    uint32_t row;
    const float *weights;
    const int32_t *ids;
    const uint32_t *cand; /* the groups that may or may not be kept */
    uint32_t n_cand;
    unsigned *banned; /* [G]: lower-index twins left out that forbid this group */
    uint32_t tries;
    bool found;
} kept_search;

/* Every set of `need` groups from cand[pos..] added to the G_TRY set,
 * until one passes. A group left out bans its higher-index twins: equal
 * inputs give bit-equal group scores, and the tie goes to the lower
 * index. */
static void search_kept(kept_search *q, uint32_t pos, uint32_t need)
{
    gating_row *r = q->r;
    if (q->found || q->tries >= MAX_KEPT_SETS)
        return;
    if (need == 0) {
        q->tries++;
        q->found = check_filled(r, q->row, q->weights, q->ids, NULL, 0);
        return;
    }
    if (q->n_cand - pos < need)
        return;
    const uint32_t g = q->cand[pos];
    if (!q->banned[g]) {
        r->gflags[g] |= G_TRY;
        search_kept(q, pos + 1, need - 1);
        r->gflags[g] &= (unsigned char)~G_TRY;
    }
    for (uint32_t i = pos + 1; i < q->n_cand; i++)
        if (r->gscore[q->cand[i]] == r->gscore[g] && same_group_input(r, g, q->cand[i]))
            q->banned[q->cand[i]]++;
    search_kept(q, pos + 1, need);
    for (uint32_t i = pos + 1; i < q->n_cand; i++)
        if (r->gscore[q->cand[i]] == r->gscore[g] && same_group_input(r, g, q->cand[i]))
            q->banned[q->cand[i]]--;
}

/*
 * Zero fill. Every expert may be chosen, those of the groups the device
 * dropped with s = 0. Which groups it kept is not known where group scores
 * are near a tie: the reference's kept set is tried, then every set of
 * topk_group groups that holds each group every correct device keeps (and
 * their lower-index twins), and others only among the groups some correct
 * device can keep; the row passes if one set explains the ids and the
 * weights. The message is the reference set's.
 */
static bool check_zero_fill_row(gating_row *r, uint32_t row, const float *weights, const int32_t *ids, char *msg,
                                size_t size)
{
    for (uint32_t g = 0; g < r->G; g++)
        r->gflags[g] = (r->gflags[g] & G_KEPT) ? G_KEPT | G_TRY : 0;
    if (check_filled(r, row, weights, ids, msg, size))
        return true;
    classify_groups(r);
    /* Lower-index twins of a must-keep group rank above it: kept too. */
    for (uint32_t g = 0; g < r->G; g++)
        if (r->gflags[g] & G_MUST)
            for (uint32_t h = 0; h < g; h++)
                if ((r->gflags[h] & G_POSSIBLE) && r->gscore[h] == r->gscore[g] && same_group_input(r, h, g))
                    r->gflags[h] |= G_MUST;
    uint32_t must = 0, n_cand = 0;
    uint32_t *cand = malloc(r->G * (sizeof(uint32_t) + sizeof(unsigned)));
    if (!cand)
        return false;
    unsigned *banned = (unsigned *)(cand + r->G);
    for (uint32_t g = 0; g < r->G; g++) {
        r->gflags[g] &= (unsigned char)~G_TRY;
        banned[g] = 0;
        if (r->gflags[g] & G_MUST) {
            r->gflags[g] |= G_TRY;
            must++;
        } else if (r->gflags[g] & G_POSSIBLE) {
            cand[n_cand++] = g;
        }
    }
    kept_search q = {r, row, weights, ids, cand, n_cand, banned, 0, false};
    if (must <= r->kg)
        search_kept(&q, 0, r->kg - must);
    free(cand);
    if (q.found && msg && size)
        msg[0] = '\0';
    if (!q.found && q.tries >= MAX_KEPT_SETS) {
        const size_t used = msg ? strlen(msg) : 0;
        if (msg && used < size)
            snprintf(msg + used, size - used, " (and the checker stopped after %u kept sets)", MAX_KEPT_SETS);
    }
    return q.found;
}

static bool check_gating_row(gating_row *r, uint32_t row, const float *weights, const int32_t *ids, char *msg,
                             size_t size)
{
    if (!check_ids_valid(row, ids, r->k, r->E, msg, size))
        return false;
    if (r->fill_zero)
        return check_zero_fill_row(r, row, weights, ids, msg, size);

    uint32_t fill = 0;
    if (r->G) {
        memset(r->flags, 0, r->E); /* F_ELIGIBLE is not needed any more */
        if (!check_group_limit(r, row, ids, &fill, msg, size))
            return false;
    } else {
        memset(r->flags, F_POOL, r->E);
    }

    rank_problem p;
    uint32_t weakest;
    if (!check_ranking(r->s, r->lo, r->hi, r->flags, r->E, ids, r->k, gating_same_input, r, &p, &weakest)) {
        rank_message(msg, size, row, &p, ids, r->ids, r->s, r->err, "s");
        return false;
    }
    if (r->G && !check_group_fill(r, row, ids, weakest, fill, msg, size))
        return false;
    return check_gating_weights(r, row, ids, weights, msg, size);
}

/* The shared slots of rows with num_shared_experts: each row's exact ids
 * and weight (the weight as weights_dtype rounds it, widened); the routed
 * slots are copied into w and ids ([num_tokens][top_k]) for the check of
 * the rows without them. Returns the bad rows. */
static int check_shared_slots(const moecl_topk_gating_desc *d, const float *weights, const int32_t *ids, float *w,
                              int32_t *routed_ids, char *msg, size_t size)
{
    const size_t k = d->top_k, row = k + d->num_shared_experts;
    const float f32 = shared_weight(d);
    float want = f32;
    if (d->weights_dtype != MOECL_F32) {
        const uint16_t narrow = d->weights_dtype == MOECL_BF16 ? ref_float_to_bf16(f32) : ref_float_to_half(f32);
        want = ref_load(d->weights_dtype, &narrow, 0);
    }
    int bad = 0;
    for (size_t t = 0; t < d->num_tokens; t++) {
        memcpy(w + t * k, weights + t * row, k * sizeof(float));
        memcpy(routed_ids + t * k, ids + t * row, k * sizeof(int32_t));
        for (size_t j = k; j < row; j++) {
            const int32_t want_id = (int32_t)(d->num_experts + j - k);
            const float got = weights[t * row + j];
            if (ids[t * row + j] != want_id || memcmp(&got, &want, sizeof(float)) != 0) {
                if (!bad)
                    put_msg(msg, size, "row %zu shared slot %zu: id %d weight %.9g, want id %d weight %.9g", t, j,
                            ids[t * row + j], (double)got, want_id, (double)want);
                bad++;
                break;
            }
        }
    }
    return bad;
}

int ref_check_topk_gating(const moecl_topk_gating_desc *desc, const void *gating, const float *bias,
                          const float *topk_weights, const int32_t *topk_ids, char *msg, size_t msg_size)
{
    return ref_check_topk_gating_scaled(desc, gating, bias, NULL, topk_weights, topk_ids, msg, msg_size);
}

int ref_check_topk_gating_scaled(const moecl_topk_gating_desc *desc, const void *gating, const float *bias,
                                 const float *expert_scale, const float *topk_weights, const int32_t *topk_ids,
                                 char *msg, size_t msg_size)
{
    if (msg && msg_size)
        msg[0] = '\0';
    if (desc && desc->num_tokens == 0)
        return 0;
    if (!gating_desc_valid(desc) || !gating || !topk_weights || !topk_ids) {
        put_msg(msg, msg_size, "ref_check_topk_gating: invalid descriptor or missing array");
        return -1;
    }
    if (desc->num_shared_experts) {
        const size_t nk = (size_t)desc->num_tokens * desc->top_k;
        float *w = malloc(nk * sizeof(float));
        int32_t *ids = malloc(nk * sizeof(int32_t));
        if (!w || !ids) {
            free(w);
            free(ids);
            put_msg(msg, msg_size, "ref_check_topk_gating: out of memory");
            return -1;
        }
        const int shared_bad = check_shared_slots(desc, topk_weights, topk_ids, w, ids, msg, msg_size);
        moecl_topk_gating_desc routed = *desc;
        routed.num_shared_experts = 0;
        const int bad =
            ref_check_topk_gating_scaled(&routed, gating, bias, expert_scale, w, ids, shared_bad ? NULL : msg, msg_size);
        free(w);
        free(ids);
        return bad < 0 ? bad : bad + shared_bad; /* rows bad in both count twice: enough to fail */
    }
    gating_row r;
    if (!gating_row_alloc(&r, desc)) {
        put_msg(msg, msg_size, "ref_check_topk_gating: out of memory");
        return -1;
    }
    r.scale = expert_scale;
    int bad = 0;
    size_t k = desc->top_k;
    for (uint32_t t = 0; t < desc->num_tokens; t++) {
        gating_row_compute(gating, bias, t, &r);
        if (!check_gating_row(&r, t, topk_weights + t * k, topk_ids + t * k, bad ? NULL : msg, msg_size))
            bad++;
    }
    gating_row_free(&r);
    return bad;
}

/* The typed outputs widened: weights to float (exact), ids to int32, an
 * int64 id outside the int32 range to INT32_MIN (out of range, so the
 * check names it). */
int ref_check_topk_gating_typed(const moecl_topk_gating_desc *desc, const void *gating, const void *bias,
                                const void *topk_weights, const void *topk_ids, char *msg, size_t msg_size)
{
    return ref_check_topk_gating_typed_scaled(desc, gating, bias, NULL, topk_weights, topk_ids, msg, msg_size);
}

int ref_check_topk_gating_typed_scaled(const moecl_topk_gating_desc *desc, const void *gating, const void *bias,
                                       const float *expert_scale, const void *topk_weights, const void *topk_ids,
                                       char *msg, size_t msg_size)
{
    if (msg && msg_size)
        msg[0] = '\0';
    if (!desc || desc->num_tokens == 0)
        return ref_check_topk_gating(desc, gating, NULL, NULL, NULL, msg, msg_size);
    const size_t nk = (size_t)desc->num_tokens * (desc->top_k + desc->num_shared_experts), e = desc->num_experts;
    float *w = topk_weights ? malloc(nk * sizeof(float)) : NULL;
    int32_t *ids = topk_ids ? malloc(nk * sizeof(int32_t)) : NULL;
    float *b = bias ? malloc(e * sizeof(float)) : NULL;
    if ((topk_weights && !w) || (topk_ids && !ids) || (bias && !b)) {
        free(w);
        free(ids);
        free(b);
        put_msg(msg, msg_size, "ref_check_topk_gating_typed: out of memory");
        return -1;
    }
    for (size_t i = 0; w && i < nk; i++)
        w[i] = ref_load(desc->weights_dtype, topk_weights, i);
    for (size_t i = 0; ids && i < nk; i++) {
        if (desc->ids_dtype == MOECL_I64) {
            int64_t v;
            memcpy(&v, (const char *)topk_ids + i * 8, 8);
            ids[i] = v >= INT32_MIN && v <= INT32_MAX ? (int32_t)v : INT32_MIN;
        } else {
            memcpy(&ids[i], (const char *)topk_ids + i * 4, 4);
        }
    }
    for (size_t i = 0; b && i < e; i++)
        b[i] = ref_load(desc->bias_dtype, bias, i);
    const int bad = ref_check_topk_gating_scaled(desc, gating, b, expert_scale, w, ids, msg, msg_size);
    free(w);
    free(ids);
    free(b);
    return bad;
}

bool ref_same_rounding(moecl_dtype dtype, float f32_weight, const void *narrow, size_t index)
{
    uint16_t got;
    switch (dtype) {
    case MOECL_BF16:
        memcpy(&got, (const char *)narrow + index * 2, 2);
        return got == ref_float_to_bf16(f32_weight);
    case MOECL_F16:
        memcpy(&got, (const char *)narrow + index * 2, 2);
        /* A NaN's payload is the device's (vstore_half_rte): NaN is enough. */
        if (isnan(f32_weight))
            return (got & 0x7c00u) == 0x7c00u && (got & 0x3ffu) != 0;
        return got == ref_float_to_half(f32_weight);
    default: {
        float f;
        memcpy(&f, (const char *)narrow + index * 4, 4);
        return memcmp(&f, &f32_weight, 4) == 0;
    }
    }
}

/* ====================================================================== */
/* Routing replay (routing.md, section 11): the weights of given ids       */
/* ====================================================================== */

/* Row t's scores (step 1 alone: replay selects nothing, so an expert
 * weighs its score), and the ids of the row that are experts, compacted
 * into valid[] with their positions in pos[]; returns their count. */
static uint32_t replay_row(const void *gating, const int32_t *ids, uint32_t t, gating_row *r, int32_t *valid,
                           uint32_t *pos)
{
    gating_scores(gating, t, r);
    memcpy(r->wscore, r->score, r->E * sizeof(double));
    uint32_t n = 0;
    for (uint32_t j = 0; j < r->desc->top_k; j++) {
        const int32_t id = ids[(size_t)t * r->desc->top_k + j];
        if (id >= 0 && (uint32_t)id < r->E) {
            valid[n] = id;
            pos[n++] = j;
        }
    }
    return n;
}

void ref_topk_weights(const moecl_topk_gating_desc *desc, const void *gating, const int32_t *topk_ids,
                      float *topk_weights)
{
    if (!desc || desc->num_tokens == 0 || !gating_desc_valid(desc))
        return;
    const size_t k = desc->top_k;
    gating_row r;
    if (!gating_row_alloc(&r, desc)) {
        for (size_t i = 0; i < (size_t)desc->num_tokens * k; i++)
            topk_weights[i] = NAN;
        return;
    }
    for (uint32_t t = 0; t < desc->num_tokens; t++) {
        int32_t valid[MAX_TOP_K];
        uint32_t pos[MAX_TOP_K];
        double w[MAX_TOP_K];
        const uint32_t n = replay_row(gating, topk_ids, t, &r, valid, pos);
        moecl_topk_gating_desc part = *desc;
        part.top_k = n;
        for (size_t j = 0; j < k; j++)
            topk_weights[t * k + j] = 0.0f;
        if (n)
            chosen_weights(&part, desc->weighting, r.wscore, r.x, valid, w);
        for (uint32_t i = 0; i < n; i++)
            topk_weights[t * k + pos[i]] = (float)w[i];
    }
    gating_row_free(&r);
}

int ref_check_topk_weights(const moecl_topk_gating_desc *desc, const void *gating, const int32_t *topk_ids,
                           const float *topk_weights, char *msg, size_t msg_size)
{
    if (msg_size)
        msg[0] = '\0';
    if (!desc || !gating_desc_valid(desc)) {
        put_msg(msg, msg_size, "invalid descriptor");
        return 1;
    }
    if (desc->num_tokens == 0)
        return 0;
    gating_row r;
    if (!gating_row_alloc(&r, desc)) {
        put_msg(msg, msg_size, "out of memory");
        return 1;
    }
    const size_t k = desc->top_k;
    int bad = 0;
    for (uint32_t t = 0; t < desc->num_tokens; t++) {
        int32_t valid[MAX_TOP_K];
        uint32_t pos[MAX_TOP_K];
        float got[MAX_TOP_K];
        const uint32_t n = replay_row(gating, topk_ids, t, &r, valid, pos);
        bool ok = true;
        for (size_t j = 0, i = 0; j < k && ok; j++) {
            if (i < n && pos[i] == j) {
                got[i++] = topk_weights[t * k + j];
            } else if (topk_weights[t * k + j] != 0.0f) {
                if (!bad)
                    put_msg(msg, msg_size, "row %u pos %u: weight %.9g for id %d, which is no expert: want 0",
                            (unsigned)t, (unsigned)j, (double)topk_weights[t * k + j], (int)topk_ids[t * k + j]);
                ok = false;
            }
        }
        if (ok && n) {
            moecl_topk_gating_desc part = *desc;
            part.top_k = n;
            r.desc = &part;
            r.k = n;
            char row_msg[512];
            ok = check_gating_weights(&r, t, valid, got, row_msg, sizeof row_msg);
            if (!ok && !bad)
                put_msg(msg, msg_size, "%s%s", row_msg, n < k ? " (slots that are no expert left out)" : "");
            r.desc = desc;
            r.k = desc->top_k;
        }
        bad += !ok;
    }
    gating_row_free(&r);
    return bad;
}

/* ====================================================================== */
/* Grounded router (routing.md, section 2)                                 */
/* ====================================================================== */

typedef struct grounded_row {
    const moecl_grounded_router_desc *desc;
    const float *logits; /* inputs of the row being computed (logits may be NULL) */
    const void *ground;
    uint32_t row;
    uint32_t E, H, k;
    double *h;   /* [H] the token's hidden state, widened */
    double *g;   /* [E] grounded logits */
    double *err; /* [E] bound of |device fp32 g - g| */
    moecl_topk_gating_desc gating; /* desc->gating as top-k gating's fields */
    gating_row gr;                 /* the gating pipeline over g */
} grounded_row;

static moecl_topk_gating_desc grounded_gating(const moecl_grounded_router_desc *d)
{
    moecl_topk_gating_desc t = moecl_topk_gating_desc_init(d->num_tokens, d->num_experts, d->top_k);
    t.scoring = d->gating.scoring;
    t.weighting = d->gating.weighting;
    t.num_expert_groups = d->gating.num_expert_groups;
    t.topk_group = d->gating.topk_group;
    t.group_score = d->gating.group_score;
    t.group_fill = d->gating.group_fill;
    t.renormalize = d->gating.renormalize;
    t.renormalize_floor = d->gating.renormalize_floor;
    t.renormalize_eps = d->gating.renormalize_eps;
    t.routed_scaling_factor = d->gating.routed_scaling_factor;
    t.weights_dtype = d->weights_dtype; /* the tolerance of a narrow type */
    t.ids_dtype = d->ids_dtype;
    t.bias_dtype = d->bias_dtype;
    t.num_shared_experts = d->num_shared_experts; /* validated as top-k's */
    t.shared_expert_weight = d->shared_expert_weight;
    return t;
}

static bool grounded_desc_valid(const moecl_grounded_router_desc *d)
{
    if (!(d && d->hidden_dim >= 1 && d->hidden_dim <= 65536 && d->num_experts >= 1 && d->num_experts <= 4096 &&
          d->top_k >= 1 && d->top_k <= d->num_experts && d->top_k <= MAX_TOP_K && isfinite(d->alpha) &&
          (d->hidden_dtype == MOECL_F32 || d->hidden_dtype == MOECL_F16 || d->hidden_dtype == MOECL_BF16) &&
          (unsigned)d->precision <= MOECL_PRECISION_3XTF32 && (unsigned)d->logits_dtype <= MOECL_BF16 &&
          (d->logit_softcap == 0.0f || (isfinite(d->logit_softcap) && d->logit_softcap >= FLT_MIN))))
        return false;
    const moecl_topk_gating_desc t = grounded_gating(d);
    return gating_desc_valid(&t);
}

static void grounded_row_free(grounded_row *r)
{
    free(r->h);
    gating_row_free(&r->gr);
}

static bool grounded_row_alloc(grounded_row *r, const moecl_grounded_router_desc *d)
{
    memset(r, 0, sizeof *r);
    r->desc = d;
    r->E = d->num_experts;
    r->H = d->hidden_dim;
    r->k = d->top_k;
    r->gating = grounded_gating(d);
    r->gating.num_shared_experts = 0; /* the pipeline's rows: the routed slots */
    size_t E = r->E;
    r->h = malloc(((size_t)r->H + 2 * E) * sizeof(double));
    if (!r->h || !gating_row_alloc(&r->gr, &r->gating)) {
        free(r->h);
        r->h = NULL;
        return false;
    }
    r->g = r->h + r->H;
    r->err = r->g + E;
    return true;
}

/*
 * The opt-in precisions of f32 hidden states (docs/routing.md, section 4)
 * add the operands' rounding to each product, relative to |h_i w_ei|:
 *   TF32: each operand rounded to tf32 (nearest, 10 mantissa bits: within
 *   2^-11 relative), so a product within (1 + 2^-11)^2 - 1 = 2^-10 + 2^-22;
 *   the products of two tf32 values are exact in fp32.
 *   3xTF32: x = hi + lo + r with hi = tf32(x), lo = tf32(x - hi), |x - hi|
 *   <= 2^-11 |x| and |r| <= 2^-11 |x - hi| <= 2^-22 |x|; the three products
 *   hi*hi + hi*lo + lo*hi miss hi_x r_y + r_x hi_y + (x - hi_x)(y - hi_y),
 *   within (2 (1 + 2^-11) + 1) 2^-22; and 3H products are summed, so the
 *   accumulation term is gamma_{3H+2}.
 * Both also hold on the portable kernels, which compute these in fp32.
 */
static void precision_terms(const moecl_grounded_router_desc *d, double *rel, double *adds)
{
    *rel = 0.0;
    *adds = (double)d->hidden_dim;
    if (d->hidden_dtype != MOECL_F32)
        return;
    if (d->precision == MOECL_PRECISION_TF32) {
        *rel = 0x1p-10 + 0x1p-22;
    } else if (d->precision == MOECL_PRECISION_3XTF32) {
        *rel = (3.0 + 0x1p-10) * 0x1p-22;
        *adds = 3.0 * d->hidden_dim;
    }
}

/*
 * g_e = logit_e + alpha * dot(h, ground_e) (logit_e 0 where router_logits
 * is absent), in float64 (the products of two widened fp32 values are
 * exact; the float64 sum's own error is ~2^-29 of the fp32 bound below).
 *
 * Error bound of the device's fp32 g_e, the dot product accumulated in fp32
 * in any order, alpha applied to the sum or to the terms, the logit added
 * last (or by an fma):
 *   alpha * dot: H products, H - 1 adds and the alpha multiply are H + 1
 *   roundings of terms bounded by |alpha| sum |h_i w_ei|: gamma_{H+1};
 *   + logit: one rounding, u |g_e| plus u times the error above, which
 *   gamma_{H+2} absorbs;
 *   flushed subnormal products or partial sums: < 2^-126 each, 2H of them
 *   scaled by |alpha|, and 2^-126 for each of the last multiply and add.
 */
/* Token row's router logit of expert e (the one row where it is shared). */
static double router_logit(const moecl_grounded_router_desc *d, const float *logits, uint32_t row, uint32_t e)
{
    if (!logits)
        return 0.0;
    return (double)logits[(d->router_logits_row ? 0 : (size_t)row * d->num_experts) + e];
}

/* x rounded to the p-bit significand of a type whose normal numbers start
 * at 2^emin and whose finite numbers end below `over` (to nearest, ties to
 * even; beyond: infinity). */
static double round_to_bits(double x, int p, int emin, double over)
{
    if (!isfinite(x) || x == 0.0)
        return x;
    int e;
    frexp(x, &e); /* |x| in [2^(e-1), 2^e) */
    const int q = (e - 1 < emin ? emin : e - 1) - (p - 1);
    const double y = ldexp(nearbyint(ldexp(x, -q)), q);
    return fabs(y) >= over ? copysign(INFINITY, x) : y;
}

/*
 * g as the model has it (cl/gating.cl, logit_of): rounded to bf16 (8-bit
 * significand) or f16 (11 bits, normal from 2^-14, infinite from 65520),
 * then capped, c tanh(g / c). The device rounds its own fp32 g, within err
 * of the reference's: the two rounded values differ by at most err plus
 * one unit of the type at |g| + err. The cap moves g by at most what moves
 * its argument (tanh' <= 1), and adds its own fp32 error: tanh's few ulp
 * and the divide and multiply (8 eps of the result), and the divide's
 * rounding carried through, at most u c.
 */
static void grounded_logit_of(const moecl_grounded_router_desc *d, double *g, double *err)
{
    if (d->logits_dtype != MOECL_F32 && !isnan(*g)) {
        const bool bf16 = d->logits_dtype == MOECL_BF16;
        const int p = bf16 ? 8 : 11, emin = bf16 ? -126 : -14;
        const double over = bf16 ? ldexp(2.0 - ldexp(1.0, -8), 127) : 65520.0;
        int e;
        frexp(fabs(*g) + *err, &e);
        *err += ldexp(1.0, (e - 1 < emin ? emin : e - 1) - (p - 1));
        *g = round_to_bits(*g, p, emin, over);
    }
    if (d->logit_softcap > 0.0f) {
        const double c = (double)d->logit_softcap;
        *g = c * tanh(*g / c);
        *err += 8.0 * EPS32 * fabs(*g) + U32 * c;
    }
}

static void grounded_logits(const void *hidden, const float *logits, const void *ground, uint32_t row,
                            grounded_row *r)
{
    const moecl_grounded_router_desc *d = r->desc;
    double alpha = (double)d->alpha;
    double rel, adds;
    precision_terms(d, &rel, &adds);
    double gam = gamma32(adds + 2.0) + rel * (1.0 + gamma32(adds + 2.0));
    for (uint32_t i = 0; i < r->H; i++)
        r->h[i] = ref_load(d->hidden_dtype, hidden, (size_t)row * r->H + i);
    for (uint32_t e = 0; e < r->E; e++) {
        double dot = 0.0, mag = 0.0;
        for (uint32_t i = 0; i < r->H; i++) {
            double p = r->h[i] * (double)ref_load(d->hidden_dtype, ground, (size_t)e * r->H + i);
            dot += p;
            mag += fabs(p);
        }
        double g = router_logit(d, logits, row, e) + alpha * dot;
        double err = gam * fabs(alpha) * mag + U32 * fabs(g) + (2.0 * r->H * fabs(alpha) + 2.0) * TINY32;
        grounded_logit_of(d, &g, &err);
        r->g[e] = g;
        r->err[e] = err;
    }
}

/* Equal router logit (or none) and equal ground rows: the device's g are
 * bit-equal (the same fp32 operations on the same values). */
static bool grounded_same_input(const void *ctx, uint32_t a, uint32_t b)
{
    const grounded_row *r = ctx;
    const moecl_grounded_router_desc *d = r->desc;
    if (r->g[a] != r->g[b]) /* only equal float64 values come from equal inputs: a cheap filter */
        return false;
    if (router_logit(d, r->logits, r->row, a) != router_logit(d, r->logits, r->row, b))
        return false;
    for (uint32_t i = 0; i < r->H; i++)
        if (ref_load(d->hidden_dtype, r->ground, (size_t)a * r->H + i) !=
            ref_load(d->hidden_dtype, r->ground, (size_t)b * r->H + i))
            return false;
    return true;
}

/*
 * Step 1 on g: the scores of section 2 with g's error carried through.
 * RAW: the score is g, its bound g's. Sigmoid and sqrt(softplus) change by
 * a factor of at most exp(|dg|) when g moves by dg (their logarithmic
 * derivatives are at most 1: sigmoid' = sigmoid (1 - sigmoid), softplus' =
 * sigmoid <= softplus); softmax by at most exp(2 max |dg|) (its numerator
 * and its sum each by exp(max |dg|)). Those factors on top of the fp32
 * bound of the scoring itself.
 */
static void grounded_scores(grounded_row *r)
{
    gating_row *q = &r->gr;
    double max_err = 0.0;
    for (uint32_t e = 0; e < r->E; e++) {
        q->x[e] = r->g[e];
        if (!isnan(r->g[e]))
            max_err = fmax(max_err, r->err[e]);
    }
    switch (r->gating.scoring) {
    case MOECL_SCORING_SOFTMAX:
        softmax_scores(q);
        break;
    case MOECL_SCORING_SIGMOID:
        sigmoid_scores(q);
        break;
    case MOECL_SCORING_SQRTSOFTPLUS:
        sqrtsoftplus_scores(q);
        break;
    case MOECL_SCORING_RAW:
        raw_scores(q);
        break;
    }
    for (uint32_t e = 0; e < r->E; e++) {
        const double score = fabs(q->score[e]);
        if (r->gating.scoring == MOECL_SCORING_RAW)
            q->err[e] = r->err[e];
        else if (isfinite(score))
            q->err[e] += score * expm1(r->gating.scoring == MOECL_SCORING_SOFTMAX ? 2.0 * max_err : r->err[e]) +
                         (score == 0.0 ? 2.0 * TINY32 : 0.0);
    }
    if (r->gating.scoring == MOECL_SCORING_SOFTMAX)
        q->sigma = expm1(2.0 * max_err) + q->sigma;
}

static void grounded_row_compute(const void *hidden, const float *logits, const void *ground, const float *bias,
                                 uint32_t row, grounded_row *r)
{
    r->logits = logits;
    r->ground = ground;
    r->row = row;
    grounded_logits(hidden, logits, ground, row, r);
    gating_row *q = &r->gr;
    q->bias = bias;
    q->xerr = r->err;
    q->same_x = grounded_same_input;
    q->same_ctx = r;
    grounded_scores(r);
    selection_scores(bias, q);
    group_limit(q);
    select_topk(q);
}

void ref_router(const moecl_grounded_router_desc *desc, const void *token_hidden, const float *router_logits,
                const void *expert_ground, const float *bias, float *out_pairs, float *topk_weights,
                int32_t *topk_ids)
{
    if (!desc || desc->num_tokens == 0 || !grounded_desc_valid(desc))
        return;
    const size_t k = desc->top_k, slots = k + desc->num_shared_experts;
    grounded_row r;
    if (!grounded_row_alloc(&r, desc)) {
        for (size_t i = 0; i < (size_t)desc->num_tokens * slots; i++) {
            if (out_pairs)
                out_pairs[2 * i] = out_pairs[2 * i + 1] = NAN;
            if (topk_weights)
                topk_weights[i] = NAN;
            if (topk_ids)
                topk_ids[i] = -1;
        }
        return;
    }
    for (uint32_t t = 0; t < desc->num_tokens; t++) {
        double w[MAX_TOP_K];
        grounded_row_compute(token_hidden, router_logits, expert_ground, bias, t, &r);
        chosen_weights(&r.gating, r.gating.weighting, r.gr.wscore, r.gr.x, r.gr.ids, w);
        const moecl_topk_gating_desc shared = grounded_gating(desc);
        for (size_t j = 0; j < slots; j++) {
            const size_t i = t * slots + j;
            const int32_t id = j < k ? r.gr.ids[j] : (int32_t)(desc->num_experts + j - k);
            const float wj = j < k ? (float)w[j] : shared_weight(&shared);
            if (out_pairs) {
                out_pairs[2 * i] = (float)id;
                out_pairs[2 * i + 1] = wj;
            }
            if (topk_weights)
                topk_weights[i] = wj;
            if (topk_ids)
                topk_ids[i] = id;
        }
    }
    grounded_row_free(&r);
}

void ref_grounded_router(const moecl_grounded_router_desc *desc, const void *token_hidden,
                         const float *router_logits, const void *expert_ground, float *out_pairs,
                         float *topk_weights, int32_t *topk_ids)
{
    ref_router(desc, token_hidden, router_logits, expert_ground, NULL, out_pairs, topk_weights, topk_ids);
}

/* The device's ids of one row: from topk_ids, else from the index field of
 * out_pairs (which must then be an exact expert number); when both are
 * given they must agree. */
static bool grounded_device_ids(const grounded_row *r, uint32_t row, const float *pairs, const int32_t *ids,
                                int32_t *out, char *msg, size_t size)
{
    for (uint32_t j = 0; j < r->k; j++) {
        if (pairs) {
            double f = (double)pairs[2 * j];
            if (!(f >= 0.0 && f < (double)r->E && f == floor(f))) {
                put_msg(msg, size, "row %u pos %u: out_pairs index %.9g is not an expert id in [0, %u)",
                        (unsigned)row, (unsigned)j, f, (unsigned)r->E);
                return false;
            }
            out[j] = (int32_t)f;
            if (ids && ids[j] != out[j]) {
                put_msg(msg, size, "row %u pos %u: out_pairs index %.9g but topk_ids %d", (unsigned)row,
                        (unsigned)j, f, (int)ids[j]);
                return false;
            }
        } else {
            out[j] = ids[j];
        }
    }
    return true;
}

/* One row through top-k gating's checker (check_gating_row) on g: the ids
 * (from topk_ids or out_pairs) and each weights output; with weights only,
 * the ids are the reference's. */
static bool check_grounded_row(grounded_row *r, uint32_t row, const float *pairs, const float *weights,
                               const int32_t *ids, char *msg, size_t size)
{
    int32_t dev[MAX_TOP_K];
    float w[MAX_TOP_K];
    if (pairs || ids) {
        if (!grounded_device_ids(r, row, pairs, ids, dev, msg, size))
            return false;
    } else {
        memcpy(dev, r->gr.ids, r->k * sizeof(int32_t));
    }
    for (int out = 0; out < 2; out++) {
        if (out == 0 && !weights)
            continue;
        if (out == 1 && !pairs)
            continue;
        for (uint32_t j = 0; j < r->k; j++)
            w[j] = out == 0 ? weights[j] : pairs[2 * j + 1];
        if (!check_gating_row(&r->gr, row, w, dev, msg, size)) {
            const size_t used = msg ? strlen(msg) : 0;
            if (msg && used < size)
                snprintf(msg + used, size - used, " [%s]", out == 0 ? "topk_weights" : "out_pairs weight");
            return false;
        }
    }
    if (!weights && !pairs) { /* ids alone: their ranking, with the reference's weights of them */
        double want[MAX_TOP_K];
        chosen_weights(&r->gating, r->gating.weighting, r->gr.wscore, r->gr.x, dev, want);
        for (uint32_t j = 0; j < r->k; j++)
            w[j] = (float)want[j];
        return check_gating_row(&r->gr, row, w, dev, msg, size);
    }
    return true;
}

/*
 * Shared slot j's gate, sigmoid(dot(h, gate[j])) (docs/routing.md, §3), in
 * float64 with the bound of the device's f32 value: the dot product one fma
 * chain, H roundings of terms bounded by sum |h_i gate_ji|, gamma_H of it,
 * and 2H flushed subnormals; sigmoid's slope is at most 1/4; then the
 * device's 1 / (1 + exp(-x)), a few ulp of a value at most 1: 8 eps
 * absolute (and 2^-125 where it underflows). An infinite dot product
 * gives exactly 0 or 1, a NaN one NaN (tol 0).
 */
static double shared_gate_ref(const moecl_grounded_router_desc *d, const void *hidden, const void *gate, size_t t,
                              size_t j, double *tol)
{
    const size_t H = d->hidden_dim;
    double dot = 0.0, mag = 0.0;
    for (size_t i = 0; i < H; i++) {
        const double p = (double)ref_load(d->hidden_dtype, hidden, t * H + i) *
                         (double)ref_load(d->hidden_dtype, gate, j * H + i);
        dot += p;
        mag += fabs(p);
    }
    *tol = isfinite(dot) ? 0.25 * (gamma32((double)H) * mag + 2.0 * (double)H * TINY32) + 8.0 * EPS32 + 2.0 * TINY32
                         : 0.0;
    return 1.0 / (1.0 + exp(-dot));
}

/* The device's f32 weight w of a shared slot whose f32 value is want
 * (within tol), once more rounded to dtype where that is narrow. */
static bool shared_weight_ok(moecl_dtype dtype, float got, double want, double tol)
{
    if (tol == 0.0 && !isnan(want)) { /* a constant, or an infinite gate: exact */
        const float f32 = (float)want;
        float narrow = f32;
        if (dtype != MOECL_F32) {
            const uint16_t h = dtype == MOECL_BF16 ? ref_float_to_bf16(f32) : ref_float_to_half(f32);
            narrow = ref_load(dtype, &h, 0);
        }
        return memcmp(&got, &narrow, sizeof(float)) == 0;
    }
    const double out_rel = dtype == MOECL_BF16 ? 0x1p-8 : dtype == MOECL_F16 ? 0x1p-11 : 0.0;
    return weight_ok((double)got, want, tol + out_rel * (fabs(want) + tol));
}

/* The shared slots of a router's rows of k + S slots: rows before n have
 * ids E + j and the constant weight, or the gate's (gate not NULL); the
 * routed slots of every row are copied into rp, rw, rids ([T][k], each
 * where its output is given) for the check of the rows without them.
 * Returns the bad rows. */
static int check_router_shared(const moecl_grounded_router_desc *d, const void *hidden, const void *gate, uint32_t n,
                               const float *pairs, const float *weights, const int32_t *ids, float *rp, float *rw,
                               int32_t *rids, char *msg, size_t size)
{
    const size_t k = d->top_k, slots = k + d->num_shared_experts;
    const moecl_topk_gating_desc g = grounded_gating(d);
    int bad = 0;
    for (size_t t = 0; t < d->num_tokens; t++) {
        if (pairs)
            memcpy(rp + 2 * t * k, pairs + 2 * t * slots, 2 * k * sizeof(float));
        if (weights)
            memcpy(rw + t * k, weights + t * slots, k * sizeof(float));
        if (ids)
            memcpy(rids + t * k, ids + t * slots, k * sizeof(int32_t));
        for (size_t j = k; t < n && j < slots; j++) {
            const size_t i = t * slots + j;
            const int32_t want_id = (int32_t)(d->num_experts + j - k);
            double tol = 0.0;
            const double want = gate ? shared_gate_ref(d, hidden, gate, t, j - k, &tol) : (double)shared_weight(&g);
            const bool id_ok = (!ids || ids[i] == want_id) && (!pairs || pairs[2 * i] == (float)want_id);
            const bool w_ok = (!weights || shared_weight_ok(d->weights_dtype, weights[i], want, tol)) &&
                              (!pairs || shared_weight_ok(MOECL_F32, pairs[2 * i + 1], want, tol));
            if (!id_ok || !w_ok) {
                if (!bad)
                    put_msg(msg, size,
                            "row %zu shared slot %zu: id %d weight %.9g (out_pairs %.9g, %.9g), want id %d weight "
                            "%.9g (within %.3g)%s",
                            t, j, ids ? (int)ids[i] : -2, weights ? (double)weights[i] : NAN,
                            pairs ? (double)pairs[2 * i] : NAN, pairs ? (double)pairs[2 * i + 1] : NAN, (int)want_id,
                            want, tol, gate ? " (the shared gate's sigmoid)" : "");
                bad++;
                break;
            }
        }
    }
    return bad;
}

/* ref_check_router with shared slots: those checked, the routed ones
 * through the check without them. */
static int check_router_split(const moecl_grounded_router_desc *desc, const void *token_hidden,
                              const float *router_logits, const void *expert_ground, const float *bias,
                              const void *gate, const float *out_pairs, const float *topk_weights,
                              const int32_t *topk_ids, char *msg, size_t msg_size)
{
    const size_t nk = (size_t)desc->num_tokens * desc->top_k;
    float *rp = out_pairs ? malloc(2 * nk * sizeof(float)) : NULL, *rw = topk_weights ? malloc(nk * sizeof(float)) : NULL;
    int32_t *rids = topk_ids ? malloc(nk * sizeof(int32_t)) : NULL;
    if ((out_pairs && !rp) || (topk_weights && !rw) || (topk_ids && !rids)) {
        free(rp);
        free(rw);
        free(rids);
        put_msg(msg, msg_size, "ref_check_router: out of memory");
        return -1;
    }
    const int shared_bad = check_router_shared(desc, token_hidden, gate, desc->num_tokens, out_pairs, topk_weights,
                                               topk_ids, rp, rw, rids, msg, msg_size);
    moecl_grounded_router_desc routed = *desc;
    routed.num_shared_experts = 0;
    const int bad = ref_check_router(&routed, token_hidden, router_logits, expert_ground, bias, rp, rw, rids,
                                     shared_bad ? NULL : msg, msg_size);
    free(rp);
    free(rw);
    free(rids);
    return bad < 0 ? bad : bad + shared_bad;
}

int ref_check_router(const moecl_grounded_router_desc *desc, const void *token_hidden, const float *router_logits,
                     const void *expert_ground, const float *bias, const float *out_pairs,
                     const float *topk_weights, const int32_t *topk_ids, char *msg, size_t msg_size)
{
    if (msg && msg_size)
        msg[0] = '\0';
    if (desc && desc->num_tokens == 0)
        return 0;
    if (!grounded_desc_valid(desc) || !token_hidden || !expert_ground) {
        put_msg(msg, msg_size, "ref_check_router: invalid descriptor or missing input");
        return -1;
    }
    if (desc->num_shared_experts)
        return check_router_split(desc, token_hidden, router_logits, expert_ground, bias, NULL, out_pairs,
                                  topk_weights, topk_ids, msg, msg_size);
    grounded_row r;
    if (!grounded_row_alloc(&r, desc)) {
        put_msg(msg, msg_size, "ref_check_router: out of memory");
        return -1;
    }
    int bad = 0;
    size_t k = desc->top_k;
    for (uint32_t t = 0; t < desc->num_tokens; t++) {
        grounded_row_compute(token_hidden, router_logits, expert_ground, bias, t, &r);
        if (!check_grounded_row(&r, t, out_pairs ? out_pairs + 2 * t * k : NULL,
                                topk_weights ? topk_weights + t * k : NULL, topk_ids ? topk_ids + t * k : NULL,
                                bad ? NULL : msg, msg_size))
            bad++;
    }
    grounded_row_free(&r);
    return bad;
}

int ref_check_grounded_router(const moecl_grounded_router_desc *desc, const void *token_hidden,
                              const float *router_logits, const void *expert_ground, const float *out_pairs,
                              const float *topk_weights, const int32_t *topk_ids, char *msg, size_t msg_size)
{
    if (!router_logits && desc && desc->num_tokens > 0) {
        put_msg(msg, msg_size, "ref_check_grounded_router: router_logits is missing");
        return -1;
    }
    return ref_check_router(desc, token_hidden, router_logits, expert_ground, NULL, out_pairs, topk_weights,
                            topk_ids, msg, msg_size);
}

/* An id of type t at index i, widened (int64 outside int32: INT32_MIN). */
static int32_t load_index(moecl_index_dtype t, const void *p, size_t i)
{
    if (t == MOECL_I64) {
        int64_t v;
        memcpy(&v, (const char *)p + i * 8, 8);
        return v >= INT32_MIN && v <= INT32_MAX ? (int32_t)v : INT32_MIN;
    }
    if (t == MOECL_I16) {
        int16_t v;
        memcpy(&v, (const char *)p + i * 2, 2);
        return v;
    }
    int32_t v;
    memcpy(&v, (const char *)p + i * 4, 4);
    return v;
}

/* The padding rows, the capture and the histograms of ref_check_router_ex
 * (w, ids: the outputs widened; n: the valid rows). */
static int check_router_ex_extras(const moecl_grounded_router_desc *d, const ref_router_ex *x, const float *w,
                                  const int32_t *ids, uint32_t n, char *msg, size_t size)
{
    /* A row's slots (the shared ones too); the capture holds k a row;
     * E: the experts counted (the shared ones too). */
    const size_t k = d->top_k, slots = k + d->num_shared_experts, E = d->num_experts + d->num_shared_experts;
    int bad = 0;
    for (uint32_t t = n; t < d->num_tokens; t++)
        for (size_t j = 0; j < slots; j++)
            if (ids[t * slots + j] != -1 || w[t * slots + j] != 0.0f) {
                if (!bad++)
                    put_msg(msg, size, "padding row %u pos %zu: id %d weight %.9g, want -1 and 0", (unsigned)t, j,
                            (int)ids[t * slots + j], (double)w[t * slots + j]);
                break;
            }
    for (size_t i = 0; x->captured_ids && i < (size_t)d->num_tokens * k; i++)
        if (load_index(x->captured_dtype, x->captured_ids, i) != ids[i / k * slots + i % k]) {
            if (!bad++)
                put_msg(msg, size, "captured_ids[%zu] is %d but topk_ids %d", i,
                        (int)load_index(x->captured_dtype, x->captured_ids, i), (int)ids[i / k * slots + i % k]);
            break;
        }
    if (!x->expert_counts && !x->load_after)
        return bad;
    int64_t *hist = calloc(E ? E : 1, sizeof(int64_t));
    if (!hist) {
        put_msg(msg, size, "ref_check_router_ex: out of memory");
        return -1;
    }
    for (size_t i = 0; i < (size_t)n * slots; i++)
        if (ids[i] >= 0 && (size_t)ids[i] < E)
            hist[ids[i]]++;
    for (size_t e = 0; e < E; e++) {
        const bool counts_bad = x->expert_counts && x->expert_counts[e] != hist[e];
        const bool load_bad = x->load_after && (int64_t)x->load_after[e] != (int64_t)x->load_before[e] + hist[e];
        if (counts_bad || load_bad) {
            if (!bad++)
                put_msg(msg, size, "expert %zu: expert_counts %d, expert_load %d after %d, but %lld routed", e,
                        x->expert_counts ? (int)x->expert_counts[e] : -1, x->load_after ? (int)x->load_after[e] : -1,
                        x->load_before ? (int)x->load_before[e] : -1, (long long)hist[e]);
            break;
        }
    }
    free(hist);
    return bad;
}

int ref_check_router_ex(const moecl_grounded_router_desc *desc, const void *token_hidden, const float *router_logits,
                        const void *expert_ground, const ref_router_ex *x, char *msg, size_t msg_size)
{
    if (msg && msg_size)
        msg[0] = '\0';
    if (!desc || !x || (desc->num_tokens > 0 && (!x->topk_weights || !x->topk_ids))) {
        put_msg(msg, msg_size, "ref_check_router_ex: missing descriptor or output");
        return -1;
    }
    if (!grounded_desc_valid(desc)) {
        put_msg(msg, msg_size, "ref_check_router_ex: invalid descriptor");
        return -1;
    }
    /* k: a row's slots (the shared ones too) from here on. */
    const size_t T = desc->num_tokens, k = (size_t)desc->top_k + desc->num_shared_experts, E = desc->num_experts;
    uint32_t n = desc->num_tokens;
    if (x->num_valid)
        n = *x->num_valid <= 0 ? 0 : (uint32_t)*x->num_valid < n ? (uint32_t)*x->num_valid : n;
    float *w = malloc((T * k + 1) * sizeof(float)), *b = malloc((E + 1) * sizeof(float));
    int32_t *ids = malloc((T * k + 1) * sizeof(int32_t));
    if (!w || !b || !ids) {
        free(w);
        free(b);
        free(ids);
        put_msg(msg, msg_size, "ref_check_router_ex: out of memory");
        return -1;
    }
    for (size_t i = 0; i < T * k; i++) {
        w[i] = ref_load(desc->weights_dtype, x->topk_weights, i);
        ids[i] = load_index(desc->ids_dtype, x->topk_ids, i);
    }
    for (size_t e = 0; x->bias && e < E; e++)
        b[e] = ref_load(desc->bias_dtype, x->bias, e);
    int bad = check_router_ex_extras(desc, x, w, ids, n, msg, msg_size);
    /* The weights before the scale (an id out of range is the checker's to
     * name: left as it is; shared slots are not scaled). */
    for (size_t i = 0; x->expert_scale && i < (size_t)n * k; i++)
        if (i % k < desc->top_k && ids[i] >= 0 && (size_t)ids[i] < E)
            w[i] = (float)((double)w[i] / (double)x->expert_scale[ids[i]]);
    moecl_grounded_router_desc valid = *desc;
    valid.num_tokens = n;
    if (bad == 0 && desc->num_shared_experts)
        bad = check_router_split(&valid, token_hidden, router_logits, expert_ground, x->bias ? b : NULL,
                                 x->shared_expert_gate, NULL, w, ids, msg, msg_size);
    else if (bad == 0)
        bad = ref_check_router(&valid, token_hidden, router_logits, expert_ground, x->bias ? b : NULL, NULL, w, ids,
                               msg, msg_size);
    free(w);
    free(b);
    free(ids);
    return bad;
}

/* ---- moe_align ---- */

/* The expert a slot's id is aligned to (docs/routing.md's rule, written
 * from the spec): its local expert, REF_SKIPPED (counted in num_invalid)
 * or REF_REMOTE (another rank's expert: not counted). */
#define REF_SKIPPED (-1)
#define REF_REMOTE (-2)
static int64_t ref_align_expert(const moecl_moe_align_desc *d, const int32_t *expert_map, int32_t id)
{
    int64_t e = id;
    if (d->num_global_experts) {
        if (id < 0 || (int64_t)id >= (int64_t)d->num_global_experts)
            return REF_SKIPPED;
        e = expert_map[id];
        if (e == -1)
            return REF_REMOTE;
    }
    return e >= 0 && e < (int64_t)d->num_experts ? e : REF_SKIPPED;
}

void ref_moe_align(const moecl_moe_align_desc *d, const int32_t *topk_ids, int32_t *expert_counts,
                   int32_t *sorted_token_ids, int32_t *block_expert_ids, int32_t *num_tokens_post_padded,
                   int32_t *slot_positions, int32_t *num_invalid)
{
    ref_moe_align_map(d, topk_ids, NULL, expert_counts, sorted_token_ids, block_expert_ids, num_tokens_post_padded,
                      slot_positions, num_invalid);
}

void ref_moe_align_map(const moecl_moe_align_desc *d, const int32_t *topk_ids, const int32_t *expert_map,
                       int32_t *expert_counts, int32_t *sorted_token_ids, int32_t *block_expert_ids,
                       int32_t *num_tokens_post_padded, int32_t *slot_positions, int32_t *num_invalid)
{
    const size_t slots = (size_t)d->num_tokens * d->top_k, experts = d->num_experts, block = d->block_size;
    const size_t max_padded = (size_t)moecl_moe_align_max_padded(d), num_blocks = max_padded / block;
    size_t *cursor = malloc((experts + 1) * sizeof(size_t));
    int32_t invalid = 0;
    for (size_t e = 0; e < experts; e++)
        expert_counts[e] = 0;
    for (size_t s = 0; s < slots; s++) {
        const int64_t e = ref_align_expert(d, expert_map, topk_ids[s]);
        if (e >= 0)
            expert_counts[e]++;
        else if (e == REF_SKIPPED)
            invalid++;
    }
    /* Each expert's run starts where the previous padded run ends. */
    size_t at = 0;
    for (size_t e = 0; e < experts; e++) {
        cursor[e] = at;
        at += ((size_t)expert_counts[e] + block - 1) / block * block;
    }
    *num_tokens_post_padded = (int32_t)at;
    for (size_t p = 0; p < max_padded; p++)
        sorted_token_ids[p] = (int32_t)slots;
    for (size_t b = 0; b < num_blocks; b++)
        block_expert_ids[b] = -1;
    for (size_t e = 0; e < experts; e++)
        for (size_t p = cursor[e]; p < cursor[e] + ((size_t)expert_counts[e] + block - 1) / block * block; p += block)
            block_expert_ids[p / block] = (int32_t)e;
    /* Slots in increasing order: stable within an expert. */
    for (size_t s = 0; s < slots; s++) {
        const int64_t e = ref_align_expert(d, expert_map, topk_ids[s]);
        int32_t pos = -1;
        if (e >= 0) {
            pos = (int32_t)cursor[e]++;
            sorted_token_ids[pos] = (int32_t)s;
        }
        if (slot_positions)
            slot_positions[s] = pos;
    }
    if (num_invalid)
        *num_invalid = invalid;
    free(cursor);
}

/* Compare n elements; count the differences and describe the first. */
static int diff_i32(const char *name, const int32_t *got, const int32_t *want, size_t n, char *msg, size_t msg_size,
                    int bad_before)
{
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (got[i] == want[i])
            continue;
        if (bad == 0 && bad_before == 0)
            snprintf(msg, msg_size, "%s[%zu] is %d, the reference has %d", name, i, got[i], want[i]);
        bad++;
    }
    return bad;
}

int ref_check_moe_align(const moecl_moe_align_desc *d, const int32_t *topk_ids, const int32_t *expert_counts,
                        const int32_t *sorted_token_ids, const int32_t *block_expert_ids,
                        const int32_t *num_tokens_post_padded, const int32_t *slot_positions,
                        const int32_t *num_invalid, char *msg, size_t msg_size)
{
    return ref_check_moe_align_map(d, topk_ids, NULL, expert_counts, sorted_token_ids, block_expert_ids,
                                   num_tokens_post_padded, slot_positions, num_invalid, msg, msg_size);
}

int ref_check_moe_align_map(const moecl_moe_align_desc *d, const int32_t *topk_ids, const int32_t *expert_map,
                            const int32_t *expert_counts, const int32_t *sorted_token_ids,
                            const int32_t *block_expert_ids, const int32_t *num_tokens_post_padded,
                            const int32_t *slot_positions, const int32_t *num_invalid, char *msg, size_t msg_size)
{
    const size_t slots = (size_t)d->num_tokens * d->top_k, experts = d->num_experts;
    const size_t max_padded = (size_t)moecl_moe_align_max_padded(d), num_blocks = max_padded / d->block_size;
    int32_t *counts = malloc(experts * 4), *sorted = malloc(max_padded * 4 + 4), *blocks = malloc(num_blocks * 4 + 4);
    int32_t *slot = malloc(slots * 4 + 4), post, invalid;
    if (msg_size)
        msg[0] = '\0';
    ref_moe_align_map(d, topk_ids, expert_map, counts, sorted, blocks, &post, slot, &invalid);
    int bad = 0;
    bad += diff_i32("num_tokens_post_padded", num_tokens_post_padded, &post, 1, msg, msg_size, bad);
    bad += diff_i32("expert_counts", expert_counts, counts, experts, msg, msg_size, bad);
    bad += diff_i32("sorted_token_ids", sorted_token_ids, sorted, max_padded, msg, msg_size, bad);
    bad += diff_i32("block_expert_ids", block_expert_ids, blocks, num_blocks, msg, msg_size, bad);
    if (slot_positions)
        bad += diff_i32("slot_positions", slot_positions, slot, slots, msg, msg_size, bad);
    if (num_invalid)
        bad += diff_i32("num_invalid", num_invalid, &invalid, 1, msg, msg_size, bad);
    free(counts);
    free(sorted);
    free(blocks);
    free(slot);
    return bad;
}

/* ---- the expert-parallel dispatch layout ---- */

/* Where slot (t, e) goes: its physical expert, or -1 where it is not sent
 * (docs/routing.md's rule, written from the spec, not from the kernel). */
static int32_t ref_ep_physical(const moecl_ep_layout_desc *d, size_t t, int32_t e, const int32_t *l2p,
                               const int32_t *replica_counts, const int32_t *p2r)
{
    if (e < 0 || (uint32_t)e >= d->num_experts)
        return -1;
    int64_t p = e;
    if (l2p) {
        const int64_t c = replica_counts[e];
        if (c < 1 || c > (int64_t)d->max_replicas)
            return -1;
        const uint32_t hash = (uint32_t)(((uint64_t)t * 2654435761ull) & 0xffffffffull);
        p = l2p[(size_t)e * d->max_replicas + hash % (uint32_t)c];
        if (p < 0 || p >= (int64_t)d->num_physical)
            return -1;
    }
    if (p2r && (p2r[p] < 0 || p2r[p] >= (int64_t)d->num_ranks))
        return -1;
    return (int32_t)p;
}

static size_t ref_ep_rank(const moecl_ep_layout_desc *d, int32_t p, const int32_t *p2r)
{
    return p2r ? (size_t)p2r[p] : (size_t)p / (d->num_physical / d->num_ranks);
}

void ref_ep_layout(const moecl_ep_layout_desc *d, const int32_t *topk_ids, const int32_t *l2p,
                   const int32_t *replica_counts, const int32_t *p2r, const ref_ep_layout_out *out)
{
    const size_t tokens = d->num_tokens, k = d->top_k, ranks = d->num_ranks, slots = tokens * k;
    size_t *cursor = calloc(ranks + 1, sizeof(size_t));
    for (size_t r = 0; r < ranks; r++) {
        out->rank_counts[r] = 0;
        if (out->tokens_per_rank)
            out->tokens_per_rank[r] = 0;
    }
    if (out->expert_counts)
        for (size_t p = 0; p < d->num_physical; p++)
            out->expert_counts[p] = 0;
    if (out->token_in_rank)
        memset(out->token_in_rank, 0, tokens * ranks);
    uint8_t *seen = calloc(ranks + 1, 1);
    for (size_t t = 0; t < tokens; t++) {
        memset(seen, 0, ranks);
        for (size_t j = 0; j < k; j++) {
            const size_t s = t * k + j;
            const int32_t p = ref_ep_physical(d, t, topk_ids[s], l2p, replica_counts, p2r);
            out->physical_ids[s] = p;
            if (p < 0)
                continue;
            const size_t r = ref_ep_rank(d, p, p2r);
            out->rank_counts[r]++;
            if (out->expert_counts)
                out->expert_counts[p]++;
            if (!seen[r]) {
                seen[r] = 1;
                if (out->tokens_per_rank)
                    out->tokens_per_rank[r]++;
                if (out->token_in_rank)
                    out->token_in_rank[t * ranks + r] = 1;
            }
        }
    }
    size_t at = 0;
    for (size_t r = 0; r < ranks; r++) {
        out->rank_offsets[r] = (int32_t)at;
        cursor[r] = at;
        at += (size_t)out->rank_counts[r];
    }
    out->rank_offsets[ranks] = (int32_t)at;
    for (size_t i = at; i < slots; i++)
        out->send_slots[i] = -1;
    /* Slots in increasing order: stable within a rank. */
    for (size_t s = 0; s < slots; s++)
        if (out->physical_ids[s] >= 0)
            out->send_slots[cursor[ref_ep_rank(d, out->physical_ids[s], p2r)]++] = (int32_t)s;
    free(seen);
    free(cursor);
}

int ref_check_ep_layout(const moecl_ep_layout_desc *d, const int32_t *topk_ids, const int32_t *l2p,
                        const int32_t *replica_counts, const int32_t *p2r, const ref_ep_layout_out *got, char *msg,
                        size_t msg_size)
{
    const size_t tokens = d->num_tokens, ranks = d->num_ranks, slots = tokens * d->top_k;
    ref_ep_layout_out want = {malloc(slots * 4 + 4),
                              malloc(ranks * 4),
                              malloc(ranks * 4 + 4),
                              malloc(slots * 4 + 4),
                              got->token_in_rank ? malloc(tokens * ranks + 1) : NULL,
                              got->tokens_per_rank ? malloc(ranks * 4) : NULL,
                              got->expert_counts ? malloc((size_t)d->num_physical * 4) : NULL};
    ref_ep_layout(d, topk_ids, l2p, replica_counts, p2r, &want);
    int bad = 0;
    bad += diff_i32("physical_ids", got->physical_ids, want.physical_ids, slots, msg, msg_size, bad);
    bad += diff_i32("rank_counts", got->rank_counts, want.rank_counts, ranks, msg, msg_size, bad);
    bad += diff_i32("rank_offsets", got->rank_offsets, want.rank_offsets, ranks + 1, msg, msg_size, bad);
    bad += diff_i32("send_slots", got->send_slots, want.send_slots, slots, msg, msg_size, bad);
    if (got->token_in_rank)
        for (size_t i = 0; i < tokens * ranks; i++)
            if (got->token_in_rank[i] != want.token_in_rank[i]) {
                if (bad == 0)
                    snprintf(msg, msg_size, "token_in_rank[%zu] is %u, the reference has %u", i,
                             got->token_in_rank[i], want.token_in_rank[i]);
                bad++;
            }
    if (got->tokens_per_rank)
        bad += diff_i32("tokens_per_rank", got->tokens_per_rank, want.tokens_per_rank, ranks, msg, msg_size, bad);
    if (got->expert_counts)
        bad += diff_i32("expert_counts", got->expert_counts, want.expert_counts, d->num_physical, msg, msg_size, bad);
    free(want.physical_ids);
    free(want.rank_counts);
    free(want.rank_offsets);
    free(want.send_slots);
    free(want.token_in_rank);
    free(want.tokens_per_rank);
    free(want.expert_counts);
    return bad;
}

/* ====================================================================== */
/* Permute and combine (docs/routing.md, "Permute and combine")            */
/* ====================================================================== */

/* Store f into element index of a dtype tensor, to nearest even. */
static void ref_store(moecl_dtype dtype, void *data, size_t index, float f)
{
    unsigned char *p = data;
    if (dtype == MOECL_F32) {
        memcpy(p + index * 4, &f, 4);
    } else {
        const uint16_t h = dtype == MOECL_F16 ? ref_float_to_half(f) : ref_float_to_bf16(f);
        memcpy(p + index * 2, &h, 2);
    }
}

void ref_permute(const moecl_permute_desc *d, const void *hidden_states, const int32_t *sorted_token_ids,
                 int32_t num_tokens_post_padded, void *out)
{
    const size_t h = d->hidden, in_size = ref_dtype_size(d->in_dtype), out_size = ref_dtype_size(d->out_dtype);
    const size_t n = num_tokens_post_padded < 0                             ? 0
                     : (size_t)num_tokens_post_padded < d->num_padded ? (size_t)num_tokens_post_padded
                                                                          : d->num_padded;
    const int64_t slots = (int64_t)d->num_tokens * d->top_k;
    for (size_t p = 0; p < n; p++) {
        const int64_t s = sorted_token_ids[p];
        unsigned char *o = (unsigned char *)out + p * h * out_size;
        if (s < 0 || s >= slots) {
            memset(o, 0, h * out_size);
            continue;
        }
        const size_t row = (size_t)s / d->top_k;
        const unsigned char *x = (const unsigned char *)hidden_states + row * h * in_size;
        if (d->in_dtype == d->out_dtype)
            memcpy(o, x, h * out_size); /* the bits themselves */
        else
            for (size_t c = 0; c < h; c++)
                ref_store(d->out_dtype, o, c, ref_load(d->in_dtype, x, c));
    }
}

void ref_combine(const moecl_combine_desc *d, const void *expert_out, const float *topk_weights,
                 const int32_t *slot_positions, const void *shared_out, void *out)
{
    const size_t h = d->hidden, k = d->top_k;
    for (size_t t = 0; t < d->num_tokens; t++)
        for (size_t c = 0; c < h; c++) {
            /* The documented order: f32, from +0, j ascending, each
             * product and sum rounded (volatile: no contraction). */
            volatile float acc = 0.0f;
            for (size_t j = 0; j < k; j++) {
                const int32_t p = slot_positions[t * k + j];
                if (p < 0 || (uint32_t)p >= d->num_padded)
                    continue;
                volatile float prod = topk_weights[t * k + j] * ref_load(d->in_dtype, expert_out, (size_t)p * h + c);
                acc = acc + prod;
            }
            if (shared_out)
                acc = acc + ref_load(d->shared_dtype, shared_out, t * h + c);
            ref_store(d->out_dtype, out, t * h + c, acc);
        }
}

double ref_combine_f64(const moecl_combine_desc *d, const void *expert_out, const float *topk_weights,
                       const int32_t *slot_positions, const void *shared_out, size_t t, size_t c, double *magnitude)
{
    const size_t h = d->hidden, k = d->top_k;
    double acc = 0.0, mag = 0.0;
    for (size_t j = 0; j < k; j++) {
        const int32_t p = slot_positions[t * k + j];
        if (p < 0 || (uint32_t)p >= d->num_padded)
            continue;
        const double term = (double)topk_weights[t * k + j] * ref_load(d->in_dtype, expert_out, (size_t)p * h + c);
        acc += term;
        mag += fabs(term);
    }
    if (shared_out) {
        const double s = ref_load(d->shared_dtype, shared_out, t * h + c);
        acc += s;
        mag += fabs(s);
    }
    *magnitude = mag;
    return acc;
}
