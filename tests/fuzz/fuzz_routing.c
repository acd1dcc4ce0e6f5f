/* libFuzzer target: bytes -> a top-k gating or grounded router request with
 * small inputs, run through the host API on pocl, checked against the
 * header's contract. Built and run by tests/fuzz/build-and-run.sh (clang,
 * -fsanitize=fuzzer,address,undefined).
 *
 * Checked on every input:
 *  - the status is a valid moecl_status (0, a library code, or an OpenCL
 *    code above -2000) and is exactly what the header's validation rules
 *    predict for the request: MOECL_SUCCESS for a valid one,
 *    MOECL_ERROR_INVALID_ARGUMENT otherwise;
 *  - on error (and with num_tokens == 0) no output byte changed; the error
 *    detail is a non-empty string;
 *  - on success: no byte after an output changed (guard bytes), the ids of
 *    a row are distinct and in [0, num_experts), out_pairs' indices are
 *    the ids; for finite inputs the weights are finite; for moderate inputs
 *    (|x| <= 1000) the weights obey the op's bounds and the result agrees
 *    with the float64 reference checker (tests/reference.c).
 * A violation prints what and aborts, which libFuzzer reports as a crash.
 *
 * Kernel variants are compiled per shape and option set, which costs pocl
 * about a second each, so the decoder picks expert counts mostly from a
 * short list and the fuzzer spends its time on the host code around the
 * kernels rather than in the compiler. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

#include "internal.h"
#include "reference.h"

#define GUARD 64
#define POISON 0xA5
#define MAX_TOKENS 8u
#define MAX_HIDDEN 64u
#define MODERATE 1000.0f

/* Two contexts: the one-row-per-work-item kernels and the team kernels. */
static moecl_context *contexts[2];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_routing: invariant broken: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    /* The target is built from the library's sources, so it reaches the
     * variant override (src/internal.h). */
    static const char *const classes[2] = {"class=cpu", "class=gpu"};
    for (int i = 0; i < 2; i++) {
        moecl_status st = moecl_override_set(classes[i]);
        if (st == MOECL_SUCCESS)
            st = moecl_context_create(NULL, &contexts[i]);
        if (st != MOECL_SUCCESS) {
            fprintf(stderr, "fuzz_routing: moecl_context_create: %s: %s\n", moecl_status_string(st),
                    moecl_context_error(NULL));
            exit(1);
        }
    }
    moecl_override_set(NULL);
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Bytes in                                                                 */
/* ---------------------------------------------------------------------- */

typedef struct reader {
    const uint8_t *p;
    size_t n;
    uint64_t fill; /* past the end: a generator seeded from the input */
} reader;

static uint8_t rd8(reader *r)
{
    if (r->n) {
        r->n--;
        return *r->p++;
    }
    r->fill = r->fill * 6364136223846793005ull + 1442695040888963407ull;
    return (uint8_t)(r->fill >> 56);
}

static uint16_t rd16(reader *r)
{
    uint16_t lo = rd8(r);
    return (uint16_t)(lo | (uint16_t)rd8(r) << 8);
}

static uint32_t rd32(reader *r)
{
    uint32_t lo = rd16(r);
    return lo | (uint32_t)rd16(r) << 16;
}

static float bits_to_float(uint32_t b)
{
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Mostly small expert counts with the interesting edges; sometimes any
 * count up to 319 (0 is invalid). */
static uint32_t pick_experts(reader *r)
{
    static const uint32_t common[] = {1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 33, 60, 64, 128, 256, 257, 300};
    uint8_t b = rd8(r);
    if (b < 240)
        return common[b % (sizeof(common) / sizeof(common[0]))];
    return rd16(r) % 320;
}

/* Mostly a valid top_k; sometimes any byte (0 and > min(E, 64) invalid). */
static uint32_t pick_topk(reader *r, uint32_t experts)
{
    uint8_t b = rd8(r);
    uint32_t kmax = experts < 64 ? experts : 64;
    if (b < 240 && kmax > 0)
        return 1 + b % (kmax < 8 ? kmax : 8);
    return rd8(r);
}

/* A value of a tensor, by mode: 0 small integers and halves, 1 raw bits
 * (NaN, inf, subnormals, huge), 2 a few distinct values (ties), 3 normal
 * magnitudes with random signs. */
static float pick_value(reader *r, int mode, moecl_dtype dtype)
{
    switch (mode) {
    case 0:
        return (int8_t)rd8(r) * 0.5f;
    case 1:
        if (dtype == MOECL_F32)
            return bits_to_float(rd32(r));
        return NAN; /* unused: raw f16/bf16 bits are stored as they are */
    case 2:
        return (float)(rd8(r) % 3);
    default:
        return (int16_t)rd16(r) / 4096.0f;
    }
}

/* Fill n elements of dtype; raw mode stores the input's bits. Returns
 * whether every element is finite and whether every one is moderate. */
static void fill_tensor(reader *r, int mode, moecl_dtype dtype, void *data, size_t n, bool *finite, bool *moderate)
{
    for (size_t i = 0; i < n; i++) {
        if (mode == 1 && dtype != MOECL_F32) {
            uint16_t bits = rd16(r);
            memcpy((uint8_t *)data + 2 * i, &bits, 2);
        } else {
            float v = pick_value(r, mode, dtype);
            if (dtype == MOECL_F32)
                memcpy((uint8_t *)data + 4 * i, &v, 4);
            else {
                uint16_t bits = dtype == MOECL_F16 ? ref_float_to_half(v) : ref_float_to_bf16(v);
                memcpy((uint8_t *)data + 2 * i, &bits, 2);
            }
        }
        float v = ref_load(dtype, data, i);
        if (!isfinite(v))
            *finite = *moderate = false;
        else if (fabsf(v) > MODERATE)
            *moderate = false;
    }
}

/* ---------------------------------------------------------------------- */
/* Checks                                                                   */
/* ---------------------------------------------------------------------- */

static void *poisoned(size_t n)
{
    uint8_t *p = malloc(n + GUARD);
    if (!p)
        die("malloc failed", NULL);
    memset(p, POISON, n + GUARD);
    return p;
}

static bool all_poison(const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != POISON)
            return false;
    return true;
}

static bool valid_status(moecl_status st)
{
    int s = (int)st;
    return s == MOECL_SUCCESS || (s <= MOECL_ERROR_INVALID_ARGUMENT && s >= MOECL_ERROR_OUT_OF_MEMORY) ||
           (s < 0 && s > -2000);
}

static void check_status(moecl_context *ctx, moecl_status st, bool expect_ok, const char *op)
{
    char msg[512];
    if (!valid_status(st)) {
        snprintf(msg, sizeof(msg), "%s returned %d", op, (int)st);
        die("not a moecl_status", msg);
    }
    moecl_status want = expect_ok ? MOECL_SUCCESS : MOECL_ERROR_INVALID_ARGUMENT;
    if (st != want) {
        snprintf(msg, sizeof(msg), "%s returned %d (%s), the header's rules say %d: %s", op, (int)st,
                 moecl_status_string(st), (int)want, moecl_context_error(ctx));
        die("unexpected status", msg);
    }
    if (st != MOECL_SUCCESS) {
        const char *e = moecl_context_error(ctx);
        if (!e || !e[0])
            die("a failed call left no error detail", op);
    }
}

/* Ids of each row distinct and in range. */
static void check_ids(const int32_t *ids, uint32_t tokens, uint32_t k, uint32_t experts, const char *op)
{
    char msg[256];
    for (uint32_t t = 0; t < tokens; t++)
        for (uint32_t i = 0; i < k; i++) {
            int32_t id = ids[(size_t)t * k + i];
            if (id < 0 || (uint32_t)id >= experts) {
                snprintf(msg, sizeof(msg), "%s: row %u position %u: id %d, num_experts %u", op, t, i, id, experts);
                die("id out of range", msg);
            }
            for (uint32_t j = 0; j < i; j++)
                if (ids[(size_t)t * k + j] == id) {
                    snprintf(msg, sizeof(msg), "%s: row %u: id %d at positions %u and %u", op, t, id, j, i);
                    die("ids not distinct", msg);
                }
        }
}

/* ---------------------------------------------------------------------- */
/* Top-k gating                                                             */
/* ---------------------------------------------------------------------- */

static bool topk_desc_valid(const moecl_topk_gating_desc *d)
{
    if (d->num_experts < 1 || d->num_experts > 4096)
        return false;
    uint32_t kmax = d->num_experts < 64 ? d->num_experts : 64;
    if (d->top_k < 1 || d->top_k > kmax)
        return false;
    if (d->num_expert_groups == 0) {
        if (d->topk_group != 0)
            return false;
    } else {
        if (d->num_experts % d->num_expert_groups != 0)
            return false;
        if (d->topk_group < 1 || d->topk_group > d->num_expert_groups)
            return false;
        if ((uint64_t)d->top_k > (uint64_t)d->topk_group * (d->num_experts / d->num_expert_groups))
            return false;
    }
    return (unsigned)d->gating_dtype <= MOECL_BF16 && (unsigned)d->scoring <= MOECL_SCORING_RAW &&
           (unsigned)d->group_score <= MOECL_GROUP_SCORE_TOP2_SUM && isfinite(d->routed_scaling_factor);
}

static void fuzz_topk(moecl_context *ctx, reader *r)
{
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(0, 1, 1);
    d.num_tokens = rd8(r) % (MAX_TOKENS + 1);
    d.num_experts = pick_experts(r);
    d.top_k = pick_topk(r, d.num_experts);
    uint8_t g = rd8(r);
    if (g >= 128) {
        static const uint32_t groups[] = {1, 2, 3, 4, 8, 16};
        d.num_expert_groups = g >= 250 ? rd8(r) : groups[g % 6];
        uint8_t kg = rd8(r);
        d.topk_group = kg >= 250 ? rd8(r) : (d.num_expert_groups ? 1 + kg % d.num_expert_groups : kg % 2);
    } else if (g >= 124) {
        d.topk_group = 1; /* without groups: invalid */
    }
    uint8_t flags = rd8(r);
    d.gating_dtype = (moecl_dtype)(flags % 3);
    d.scoring = (moecl_scoring)((flags >> 2) & 1);
    d.group_score = (moecl_group_score)((flags >> 3) & 1);
    d.renormalize = (flags >> 4) & 1;
    const bool with_bias = (flags >> 5) & 1;
    if (flags == 0xFF) { /* rarely, enum values out of range */
        uint8_t which = rd8(r);
        if (which % 3 == 0)
            d.gating_dtype = (moecl_dtype)(int8_t)rd8(r);
        else if (which % 3 == 1)
            d.scoring = (moecl_scoring)(int8_t)rd8(r);
        else
            d.group_score = (moecl_group_score)(int8_t)rd8(r);
    }
    static const float factors[] = {1.0f, 2.5f, -1.0f, 0.0f, 16.0f, 1e-3f};
    uint8_t fb = rd8(r);
    d.routed_scaling_factor = fb < 240 ? factors[fb % 6] : bits_to_float(rd32(r));
    const int mode = rd8(r) % 4;
    /* Rarely a NULL input or output where one is required. */
    const uint8_t nulls = rd8(r);
    const bool null_gating = nulls == 0xF1, null_weights = nulls == 0xF2, null_ids = nulls == 0xF3;

    const bool desc_ok = topk_desc_valid(&d);
    const size_t t = d.num_tokens, e = desc_ok ? d.num_experts : 1, k = desc_ok ? d.top_k : 1;
    const size_t in_bytes = t * e * ref_dtype_size(desc_ok ? d.gating_dtype : MOECL_F32);
    void *gating = malloc(in_bytes + 1);
    float *bias = with_bias ? malloc(e * 4) : NULL;
    if (!gating || (with_bias && !bias))
        die("malloc failed", NULL);
    bool finite = true, moderate = true;
    fill_tensor(r, mode, desc_ok ? d.gating_dtype : MOECL_F32, gating, t * e, &finite, &moderate);
    if (bias)
        fill_tensor(r, mode == 1 ? 1 : 3, MOECL_F32, bias, e, &finite, &moderate);
    const size_t out_bytes = t * k * 4;
    float *w = poisoned(out_bytes);
    int32_t *ids = poisoned(out_bytes);

    moecl_status st = moecl_topk_gating_host(ctx, &d, null_gating ? NULL : gating, bias, null_weights ? NULL : w,
                                             null_ids ? NULL : ids);
    const bool expect_ok = desc_ok && (t == 0 || (!null_gating && !null_weights && !null_ids));
    check_status(ctx, st, expect_ok, "moecl_topk_gating_host");

    if (st != MOECL_SUCCESS || t == 0) {
        if (!all_poison(w, out_bytes + GUARD) || !all_poison(ids, out_bytes + GUARD))
            die("an output changed although the call wrote nothing", moecl_status_string(st));
    } else {
        if (!all_poison((uint8_t *)w + out_bytes, GUARD) || !all_poison((uint8_t *)ids + out_bytes, GUARD))
            die("a byte after an output changed", "moecl_topk_gating_host");
        check_ids(ids, d.num_tokens, d.top_k, d.num_experts, "topk_gating");
        const float f = d.routed_scaling_factor;
        char msg[768];
        for (size_t row = 0; row < t; row++) {
            double sum = 0;
            for (size_t i = 0; i < k; i++) {
                float v = w[row * k + i];
                /* Scores are in [0, 1] and so are renormalised weights: a
                 * weight is finite for finite inputs and at most |factor|. */
                if (finite && fabsf(f) < 1e37f && (!isfinite(v) || fabsf(v) > fabsf(f) * 1.0001f + 1e-30f)) {
                    snprintf(msg, sizeof(msg), "row %zu position %zu: weight %g, factor %g", row, i, (double)v,
                             (double)f);
                    die("topk_gating: weight not finite or above |factor|", msg);
                }
                sum += fabs((double)v);
            }
            if (finite && d.renormalize && fabsf(f) < 1e37f && sum != 0 &&
                fabs(sum - fabs((double)f)) > 1e-4 * fabs((double)f) + 1e-30) {
                snprintf(msg, sizeof(msg), "row %zu: |weights| sum to %g, factor %g", row, sum, (double)f);
                die("topk_gating: renormalised weights do not sum to |factor|", msg);
            }
        }
        if (moderate) {
            msg[0] = '\0';
            int bad = ref_check_topk_gating(&d, gating, bias, w, ids, msg, sizeof(msg));
            if (bad)
                die("topk_gating disagrees with the float64 reference", msg);
        }
    }
    free(gating);
    free(bias);
    free(w);
    free(ids);
}

/* ---------------------------------------------------------------------- */
/* Grounded router                                                          */
/* ---------------------------------------------------------------------- */

static bool grounded_desc_valid(const moecl_grounded_router_desc *d)
{
    uint32_t kmax = d->num_experts < 64 ? d->num_experts : 64;
    return d->hidden_dim >= 1 && d->hidden_dim <= 65536 && d->num_experts >= 1 && d->num_experts <= 4096 &&
           d->top_k >= 1 && d->top_k <= kmax && isfinite(d->alpha) && (unsigned)d->hidden_dtype <= MOECL_BF16;
}

static void fuzz_grounded(moecl_context *ctx, reader *r)
{
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(0, 1, 1, 1.0f);
    d.num_tokens = rd8(r) % (MAX_TOKENS + 1);
    uint8_t hb = rd8(r);
    /* Hidden sizes 1..64; rarely 0 or one past the limit (invalid, and
     * never allocated: validation comes first). */
    d.hidden_dim = hb < 250 ? 1 + hb % MAX_HIDDEN : (hb & 1 ? 0 : 65537);
    d.num_experts = pick_experts(r);
    d.top_k = pick_topk(r, d.num_experts);
    static const float alphas[] = {0.5f, 1.0f, -0.75f, 0.0f, 4.0f};
    uint8_t ab = rd8(r);
    d.alpha = ab < 240 ? alphas[ab % 5] : bits_to_float(rd32(r));
    uint8_t flags = rd8(r);
    d.hidden_dtype = flags == 0xFF ? (moecl_dtype)(int8_t)rd8(r) : (moecl_dtype)(flags % 3);
    const int outputs = (flags >> 2) & 7; /* pairs, weights, ids; 0 is invalid */
    const int mode = rd8(r) % 4;

    const bool desc_ok = grounded_desc_valid(&d);
    const size_t t = d.num_tokens, h = desc_ok ? d.hidden_dim : 1, e = desc_ok ? d.num_experts : 1,
                 k = desc_ok ? d.top_k : 1;
    const moecl_dtype dt = desc_ok ? d.hidden_dtype : MOECL_F32;
    void *hidden = malloc(t * h * ref_dtype_size(dt) + 1), *ground = malloc(e * h * ref_dtype_size(dt) + 1);
    float *logits = malloc(t * e * 4 + 1);
    if (!hidden || !ground || !logits)
        die("malloc failed", NULL);
    bool finite = true, moderate = true;
    fill_tensor(r, mode, dt, hidden, t * h, &finite, &moderate);
    fill_tensor(r, mode, dt, ground, e * h, &finite, &moderate);
    fill_tensor(r, mode, MOECL_F32, logits, t * e, &finite, &moderate);
    if (!isfinite(d.alpha) || fabsf(d.alpha) > MODERATE)
        moderate = false;

    const size_t pair_bytes = t * k * 8, out_bytes = t * k * 4;
    float *pairs = poisoned(pair_bytes), *weights = poisoned(out_bytes);
    int32_t *ids = poisoned(out_bytes);
    moecl_status st = moecl_grounded_router_host(ctx, &d, hidden, logits, ground, outputs & 1 ? pairs : NULL,
                                                 outputs & 2 ? weights : NULL, outputs & 4 ? ids : NULL);
    check_status(ctx, st, desc_ok && outputs != 0, "moecl_grounded_router_host");

    const bool wrote = st == MOECL_SUCCESS && t > 0;
    const void *outs[3] = {pairs, weights, ids};
    const size_t sizes[3] = {pair_bytes, out_bytes, out_bytes};
    for (int i = 0; i < 3; i++) {
        const bool given = wrote && (outputs >> i & 1);
        if (!all_poison((const uint8_t *)outs[i] + (given ? sizes[i] : 0), (given ? 0 : sizes[i]) + GUARD))
            die(given ? "a byte after an output changed" : "an output changed although the call wrote nothing",
                "moecl_grounded_router_host");
    }
    if (wrote) {
        char msg[768];
        if (outputs & 4)
            check_ids(ids, d.num_tokens, d.top_k, d.num_experts, "grounded_router");
        if (outputs & 1) {
            for (size_t i = 0; i < t * k; i++) {
                float idx = pairs[2 * i];
                if (!(idx >= 0 && idx < (float)d.num_experts && idx == floorf(idx)) ||
                    ((outputs & 4) && idx != (float)ids[i])) {
                    snprintf(msg, sizeof(msg), "pair %zu: index %g (num_experts %u)", i, (double)idx, d.num_experts);
                    die("grounded_router: bad out_pairs index", msg);
                }
            }
            int32_t *pair_ids = malloc(t * k * 4 + 1);
            if (!pair_ids)
                die("malloc failed", NULL);
            for (size_t i = 0; i < t * k; i++)
                pair_ids[i] = (int32_t)pairs[2 * i];
            check_ids(pair_ids, d.num_tokens, d.top_k, d.num_experts, "grounded_router out_pairs");
            free(pair_ids);
        }
        /* Weights are a softmax over the chosen values: in [0, 1], summing
         * to 1, when nothing overflows (moderate inputs). */
        for (size_t row = 0; moderate && row < t; row++) {
            double sum_w = 0, sum_p = 0;
            for (size_t i = 0; i < k; i++) {
                float a = outputs & 2 ? weights[row * k + i] : 0.5f, b = outputs & 1 ? pairs[2 * (row * k + i) + 1] : 0.5f;
                if (!(a >= 0 && a <= 1.0001f) || !(b >= 0 && b <= 1.0001f)) {
                    snprintf(msg, sizeof(msg), "row %zu position %zu: weight %g, pair weight %g", row, i, (double)a,
                             (double)b);
                    die("grounded_router: weight outside [0, 1]", msg);
                }
                sum_w += a;
                sum_p += b;
            }
            if (((outputs & 2) && fabs(sum_w - 1) > 1e-4) || ((outputs & 1) && fabs(sum_p - 1) > 1e-4)) {
                snprintf(msg, sizeof(msg), "row %zu: weights sum to %g, pair weights to %g", row, sum_w, sum_p);
                die("grounded_router: weights do not sum to 1", msg);
            }
        }
        if (moderate) {
            msg[0] = '\0';
            int bad = ref_check_grounded_router(&d, hidden, logits, ground, outputs & 1 ? pairs : NULL,
                                                outputs & 2 ? weights : NULL, outputs & 4 ? ids : NULL, msg,
                                                sizeof(msg));
            if (bad)
                die("grounded_router disagrees with the float64 reference", msg);
        }
    }
    (void)finite;
    free(hidden);
    free(ground);
    free(logits);
    free(pairs);
    free(weights);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size, 0x9e3779b97f4a7c15ull ^ size};
    for (size_t i = 0; i < size; i++)
        r.fill = (r.fill ^ data[i]) * 0x100000001b3ull;
    uint8_t head = rd8(&r);
    moecl_context *ctx = contexts[(head >> 1) & 1];
    if (head & 1)
        fuzz_grounded(ctx, &r);
    else
        fuzz_topk(ctx, &r);
    return 0;
}
