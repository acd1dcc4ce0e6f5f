/* route-check: judges the .npy outputs of moecl-route against the float64
 * reference (tests/reference.c). It takes moecl-route's options, reads the
 * same inputs and the outputs whole, checks the outputs' dtypes and shapes,
 * then runs ref_check_topk_gating or ref_check_grounded_router; the pairs
 * must hold the same ids and bit-identical weights as the other outputs.
 * The dispatch outputs (moe_align) must equal ref_moe_align of the ids the
 * tool wrote (--ids, else the pairs' ids), or of --ids-in for --op align,
 * exactly, headers included; --summary-post-padded and --summary-invalid
 * give the summary's num_tokens_post_padded and num_invalid to check too.
 * Exit status: 0 the outputs agree, 1 they do not (or a file is bad),
 * 2 bad usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

#include "npy.h"
#include "reference.h"

static int fail(const char *fmt, const char *a, const char *b)
{
    fprintf(stderr, "route-check: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, "\n");
    return 1;
}

static void *read_all(const char *path, npy_file *n, char *err, size_t size)
{
    if (npy_open(n, path, err, size))
        return NULL;
    void *p = malloc(n->count * n->elem_size + 16);
    if (p && npy_read_rows(n, p, n->ndim ? n->shape[0] : 1, err, size)) {
        free(p);
        p = NULL;
    }
    npy_close(n);
    return p;
}

/* An ids file, int32 or int64, whole, as int32 (npy_read_ids). */
static int32_t *read_ids(const char *path, npy_file *n, char *err, size_t size)
{
    if (npy_open(n, path, err, size))
        return NULL;
    int32_t *p = malloc(n->count * 4 + 16);
    if (p && npy_read_ids(n, p, n->ndim ? n->shape[0] : 1, err, size)) {
        free(p);
        p = NULL;
    }
    npy_close(n);
    return p;
}

static void shape_text(char *out, size_t size, int ndim, const uint64_t *shape)
{
    int n = snprintf(out, size, "(");
    for (int d = 0; d < ndim && n < (int)size - 24; d++)
        n += snprintf(out + n, size - (size_t)n, "%s%llu", d ? ", " : "", (unsigned long long)shape[d]);
    snprintf(out + n, size - (size_t)n, "%s)", ndim == 1 ? "," : "");
}

/* The output's header must say kind and this shape. */
static int check_shape(const npy_file *n, npy_kind kind, int ndim, const uint64_t *shape)
{
    bool ok = n->kind == kind && n->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++)
        ok = n->shape[d] == shape[d];
    if (ok)
        return 0;
    char got[160], want[160];
    shape_text(got, sizeof(got), n->ndim, n->shape);
    shape_text(want, sizeof(want), ndim, shape);
    fprintf(stderr, "route-check: %s: dtype %s, shape %s; want %s, shape %s\n", n->path, npy_kind_name(n->kind), got,
            npy_kind_name(kind), want);
    return 1;
}

/* [tokens][k], and [2] for pairs. */
static int check_output(const npy_file *n, npy_kind kind, uint64_t tokens, uint32_t k, bool pairs)
{
    const uint64_t shape[3] = {tokens, k, 2};
    return check_shape(n, kind, pairs ? 3 : 2, shape);
}

/* The dispatch outputs, in moecl-route's order. */
enum { D_COUNTS, D_SORTED, D_BLOCKS, D_SLOTS, D_POST, NUM_D };
static const char *const d_flag[NUM_D] = {"--expert-counts", "--sorted-token-ids", "--block-expert-ids",
                                          "--slot-positions", "--post-padded"};

/* Each dispatch output given in path[] against ref_moe_align of ids:
 * its header, then its values exactly (an output not given is not
 * checked: the reference's own array stands in for it). want_post and
 * want_invalid are the summary's values, checked when >= 0. */
static int check_dispatch(const char *const path[NUM_D], uint32_t tokens, uint32_t k, uint32_t experts,
                          uint32_t block, const int32_t *ids, long long want_post, long long want_invalid)
{
    const moecl_moe_align_desc d = moecl_moe_align_desc_init(tokens, k, experts, block);
    const uint64_t max_padded = moecl_moe_align_max_padded(&d), slots = (uint64_t)tokens * k;
    const uint64_t shapes[NUM_D][2] = {{experts}, {max_padded}, {max_padded / block}, {tokens, k}, {1}};
    int32_t *ref[NUM_D], *got[NUM_D] = {NULL}, invalid = 0;
    ref[D_COUNTS] = malloc((size_t)experts * 4);
    ref[D_SORTED] = malloc((size_t)max_padded * 4 + 4);
    ref[D_BLOCKS] = malloc((size_t)(max_padded / block) * 4 + 4);
    ref[D_SLOTS] = malloc((size_t)slots * 4 + 4);
    ref[D_POST] = malloc(4);
    for (int i = 0; i < NUM_D; i++)
        if (!ref[i])
            return fail("out of memory for the moe_align reference%s%s", "", "");
    ref_moe_align(&d, ids, ref[D_COUNTS], ref[D_SORTED], ref[D_BLOCKS], ref[D_POST], ref[D_SLOTS], &invalid);
    char err[1024], msg[512] = "";
    int bad = 0;
    for (int i = 0; i < NUM_D && !bad; i++) {
        npy_file n;
        if (!path[i])
            continue;
        if (!(got[i] = read_all(path[i], &n, err, sizeof(err))))
            bad = fail("%s%s", err, "");
        else
            bad = check_shape(&n, NPY_I32, i == D_SLOTS ? 2 : 1, shapes[i]);
    }
    const int32_t summary_invalid = (int32_t)want_invalid;
    if (!bad)
        bad = ref_check_moe_align(&d, ids, got[D_COUNTS] ? got[D_COUNTS] : ref[D_COUNTS],
                                  got[D_SORTED] ? got[D_SORTED] : ref[D_SORTED],
                                  got[D_BLOCKS] ? got[D_BLOCKS] : ref[D_BLOCKS],
                                  got[D_POST] ? got[D_POST] : ref[D_POST], got[D_SLOTS],
                                  want_invalid >= 0 ? &summary_invalid : NULL, msg, sizeof(msg));
    if (bad && msg[0])
        fprintf(stderr, "route-check: moe_align: %d differences from the reference; first: %s\n", bad, msg);
    if (!bad && want_post >= 0 && want_post != *ref[D_POST]) {
        fprintf(stderr, "route-check: the summary says num_tokens_post_padded %lld, the reference has %d\n",
                want_post, *ref[D_POST]);
        bad = 1;
    }
    if (!bad)
        printf("route-check: moe_align of %llu slots, %u experts, block size %u: the dispatch outputs agree with "
               "the reference (num_tokens_post_padded %d, num_invalid %d)\n",
               (unsigned long long)slots, experts, block, *ref[D_POST], invalid);
    for (int i = 0; i < NUM_D; i++) {
        free(ref[i]);
        free(got[i]);
    }
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    const char *op = "topk", *logits = NULL, *hidden = NULL, *ground = NULL, *bias = NULL;
    const char *weights = NULL, *ids = NULL, *pairs = NULL, *ids_in = NULL, *dispatch[NUM_D] = {NULL};
    long top_k = 0, groups = 0, topk_group = 0, experts_in = 0, block = 64, shared = 0;
    long long want_post = -1, want_invalid = -1;
    bool any_dispatch = false;
    bool renormalize = false, bf16 = false;
    float scale = 1.0f, alpha = 1.0f, renormalize_floor = 0.0f, renormalize_eps = 0.0f, shared_weight = 1.0f;
    moecl_scoring scoring = MOECL_SCORING_SOFTMAX;
    moecl_group_score group_score = MOECL_GROUP_SCORE_MAX;
    moecl_group_fill group_fill = MOECL_GROUP_FILL_NEG_INF;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--renormalize")) {
            renormalize = true;
            continue;
        } else if (!strcmp(a, "--bf16")) {
            bf16 = true;
            continue;
        } else if (!strcmp(a, "--no-progress") || !strcmp(a, "--all-experts")) { /* moecl-route's own */
            continue;
        } else if (a[0] != '-') {
            logits = a;
            continue;
        }
        if (!v) {
            fprintf(stderr, "route-check: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--op"))
            op = v;
        else if (!strcmp(a, "--logits"))
            logits = v;
        else if (!strcmp(a, "--hidden"))
            hidden = v;
        else if (!strcmp(a, "--ground"))
            ground = v;
        else if (!strcmp(a, "--bias"))
            bias = v;
        else if (!strcmp(a, "--weights"))
            weights = v;
        else if (!strcmp(a, "--ids"))
            ids = v;
        else if (!strcmp(a, "--pairs"))
            pairs = v;
        else if (!strcmp(a, "--ids-in"))
            ids_in = v;
        else if (!strcmp(a, "--experts"))
            experts_in = atol(v);
        else if (!strcmp(a, "--block-size"))
            block = atol(v), any_dispatch = true;
        else if (!strcmp(a, "--summary-post-padded"))
            want_post = atoll(v), any_dispatch = true;
        else if (!strcmp(a, "--summary-invalid"))
            want_invalid = atoll(v), any_dispatch = true;
        else if (!strcmp(a, "--top-k"))
            top_k = atol(v);
        else if (!strcmp(a, "--groups"))
            groups = atol(v);
        else if (!strcmp(a, "--topk-group"))
            topk_group = atol(v);
        else if (!strcmp(a, "--group-score"))
            group_score = !strcmp(v, "top2sum") ? MOECL_GROUP_SCORE_TOP2_SUM : MOECL_GROUP_SCORE_MAX;
        else if (!strcmp(a, "--group-fill"))
            group_fill = !strcmp(v, "zero") ? MOECL_GROUP_FILL_ZERO : MOECL_GROUP_FILL_NEG_INF;
        else if (!strcmp(a, "--renormalize-floor"))
            renormalize_floor = strtof(v, NULL);
        else if (!strcmp(a, "--renormalize-eps"))
            renormalize_eps = strtof(v, NULL);
        else if (!strcmp(a, "--scoring"))
            scoring = !strcmp(v, "sigmoid") ? MOECL_SCORING_SIGMOID : MOECL_SCORING_SOFTMAX;
        else if (!strcmp(a, "--scale"))
            scale = strtof(v, NULL);
        else if (!strcmp(a, "--alpha"))
            alpha = strtof(v, NULL);
        else if (!strcmp(a, "--shared-experts"))
            shared = atol(v);
        else if (!strcmp(a, "--shared-weight"))
            shared_weight = strtof(v, NULL);
        else if (strcmp(a, "--chunk-rows") && strcmp(a, "--device")) { /* moecl-route's own; ignored */
            int j = 0;
            while (j < NUM_D && strcmp(a, d_flag[j]))
                j++;
            if (j == NUM_D) {
                fprintf(stderr, "route-check: unknown option %s\n", a);
                return 2;
            }
            dispatch[j] = v;
            any_dispatch = true;
        }
    }
    if (block < 1 || block > 1024) {
        fprintf(stderr, "route-check: --block-size is 1..1024\n");
        return 2;
    }
    if (!strcmp(op, "align")) {
        npy_file n;
        char err[1024];
        int32_t *in = NULL;
        if (!ids_in || experts_in < 1 || experts_in > 4096) {
            fprintf(stderr, "route-check: --op align needs --ids-in and --experts 1..4096\n");
            return 2;
        }
        if (!(in = read_ids(ids_in, &n, err, sizeof(err))))
            return fail("%s%s", err, "");
        if ((n.kind != NPY_I32 && n.kind != NPY_I64) || n.ndim != 2)
            return fail("%s: not a 2-D '<i4' or '<i8' array%s", ids_in, "");
        const int r = check_dispatch(dispatch, (uint32_t)n.shape[0], (uint32_t)n.shape[1], (uint32_t)experts_in,
                                     (uint32_t)block, in, want_post, want_invalid);
        free(in);
        return r;
    }
    if (!logits || !top_k || (!weights && !ids && !pairs)) {
        fprintf(stderr, "route-check: needs the logits, --top-k and at least one output\n");
        return 2;
    }
    if (any_dispatch && !ids && !pairs) {
        fprintf(stderr, "route-check: the dispatch outputs are checked against the routed ids: give --ids or "
                        "--pairs\n");
        return 2;
    }
    const bool topk = !strcmp(op, "topk");
    char err[1024];
    npy_file nl, nh, ng, nb, nw, ni, np;
    void *l = NULL, *h = NULL, *g = NULL;
    float *b = NULL, *w = NULL, *p = NULL;
    int32_t *id = NULL;
    if (!(l = read_all(logits, &nl, err, sizeof(err))) || (hidden && !(h = read_all(hidden, &nh, err, sizeof(err)))) ||
        (ground && !(g = read_all(ground, &ng, err, sizeof(err)))) ||
        (bias && !(b = read_all(bias, &nb, err, sizeof(err)))) ||
        (weights && !(w = read_all(weights, &nw, err, sizeof(err)))) ||
        (ids && !(id = read_all(ids, &ni, err, sizeof(err)))) ||
        (pairs && !(p = read_all(pairs, &np, err, sizeof(err)))))
        return fail("%s%s", err, "");
    const npy_file *main_in = topk ? &nl : &nh;
    moecl_dtype dtype = main_in->kind == NPY_F32 ? MOECL_F32 : main_in->kind == NPY_F16 ? MOECL_F16 : MOECL_BF16;
    if ((main_in->kind == NPY_U2 || main_in->kind == NPY_V2) && !bf16)
        return fail("%s: 16-bit integers without --bf16%s", main_in->path, "");
    const uint64_t tokens = nl.shape[0];
    /* k: a row's slots, --top-k as given here (the routed ones and the
     * shared ones after them). */
    const uint32_t experts = (uint32_t)nl.shape[1], k = (uint32_t)top_k;
    if (shared < 0 || shared >= top_k)
        return fail("--shared-experts: it must be below --top-k (a row's slots)%s%s", "", "");
    if ((weights && check_output(&nw, NPY_F32, tokens, k, false)) ||
        (ids && check_output(&ni, NPY_I32, tokens, k, false)) ||
        (pairs && check_output(&np, NPY_F32, tokens, k, true)))
        return 1;
    const size_t nk = (size_t)tokens * k;
    /* The pairs against the other outputs: the same ids, the same bits. */
    if (p) {
        for (size_t i = 0; i < nk; i++) {
            if ((w && memcmp(&p[2 * i + 1], &w[i], 4)) || (id && p[2 * i] != (float)id[i])) {
                char at[96];
                snprintf(at, sizeof(at), "%zu (row %zu, slot %zu)", i, i / k, i % k);
                return fail("%s: pair %s differs from the weights or ids", pairs, at);
            }
        }
    }
    char msg[512] = "";
    int bad;
    if (topk) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init((uint32_t)tokens, experts, k - (uint32_t)shared);
        d.num_shared_experts = (uint32_t)shared;
        d.shared_expert_weight = shared_weight;
        d.gating_dtype = dtype;
        d.scoring = scoring;
        d.num_expert_groups = (uint32_t)groups;
        d.topk_group = (uint32_t)topk_group;
        d.group_score = group_score;
        d.renormalize = renormalize;
        d.routed_scaling_factor = scale;
        d.group_fill = group_fill;
        d.renormalize_floor = renormalize_floor;
        d.renormalize_eps = renormalize_eps;
        /* The op needs both weights and ids; rebuild them from the pairs. */
        if (!w || !id) {
            if (!p)
                return fail("topk: give --weights and --ids, or --pairs%s%s", "", "");
            if (!w && !(w = malloc(nk * 4 + 4)))
                return 1;
            if (!id && !(id = malloc(nk * 4 + 4)))
                return 1;
            for (size_t i = 0; i < nk; i++) {
                w[i] = p[2 * i + 1];
                id[i] = (int32_t)p[2 * i];
            }
        }
        bad = ref_check_topk_gating(&d, l, b, w, id, msg, sizeof(msg));
    } else {
        moecl_grounded_router_desc d =
            moecl_grounded_router_desc_init((uint32_t)tokens, (uint32_t)nh.shape[1], experts, alpha);
        d.top_k = k - (uint32_t)shared;
        d.num_shared_experts = (uint32_t)shared;
        d.shared_expert_weight = shared_weight;
        d.hidden_dtype = dtype;
        bad = ref_check_grounded_router(&d, h, l, g, p, w, id, msg, sizeof(msg));
        if (!id && p && any_dispatch) {
            if (!(id = malloc(nk * 4 + 4)))
                return 1;
            for (size_t i = 0; i < nk; i++)
                id[i] = (int32_t)p[2 * i];
        }
    }
    if (bad) {
        fprintf(stderr, "route-check: %d bad rows of %llu; first: %s\n", bad, (unsigned long long)tokens, msg);
        return 1;
    }
    printf("route-check: %llu rows x top %u agree with the reference\n", (unsigned long long)tokens, k);
    if (any_dispatch &&
        check_dispatch(dispatch, (uint32_t)tokens, k, experts + (uint32_t)shared, (uint32_t)block, id, want_post,
                       want_invalid))
        return 1;
    free(l);
    free(h);
    free(g);
    free(b);
    free(w);
    free(p);
    free(id);
    return 0;
}
