/* route-check: judges the .npy outputs of moecl-route against the float64
 * reference (tests/reference.c). It takes moecl-route's options, reads the
 * same inputs and the outputs whole, checks the outputs' dtypes and shapes,
 * then runs ref_check_topk_gating or ref_check_grounded_router; the pairs
 * must hold the same ids and bit-identical weights as the other outputs.
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

/* The output's header must say kind and [tokens][k] (and [2] for pairs). */
static int check_output(const npy_file *n, npy_kind kind, uint64_t tokens, uint32_t k, bool pairs)
{
    const int ndim = pairs ? 3 : 2;
    if (n->kind != kind || n->ndim != ndim || n->shape[0] != tokens || n->shape[1] != k ||
        (pairs && n->shape[2] != 2)) {
        fprintf(stderr, "route-check: %s: dtype %s, %d-D (%llu, %llu, ...); want %s [%llu][%u]%s\n", n->path,
                npy_kind_name(n->kind), n->ndim, (unsigned long long)n->shape[0],
                (unsigned long long)(n->ndim > 1 ? n->shape[1] : 0), npy_kind_name(kind), (unsigned long long)tokens,
                k, pairs ? "[2]" : "");
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *op = "topk", *logits = NULL, *hidden = NULL, *ground = NULL, *bias = NULL;
    const char *weights = NULL, *ids = NULL, *pairs = NULL;
    long top_k = 0, groups = 0, topk_group = 0;
    bool renormalize = false, bf16 = false;
    float scale = 1.0f, alpha = 1.0f;
    moecl_scoring scoring = MOECL_SCORING_SOFTMAX;
    moecl_group_score group_score = MOECL_GROUP_SCORE_MAX;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--renormalize")) {
            renormalize = true;
            continue;
        } else if (!strcmp(a, "--bf16")) {
            bf16 = true;
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
        else if (!strcmp(a, "--top-k"))
            top_k = atol(v);
        else if (!strcmp(a, "--groups"))
            groups = atol(v);
        else if (!strcmp(a, "--topk-group"))
            topk_group = atol(v);
        else if (!strcmp(a, "--group-score"))
            group_score = !strcmp(v, "top2sum") ? MOECL_GROUP_SCORE_TOP2_SUM : MOECL_GROUP_SCORE_MAX;
        else if (!strcmp(a, "--scoring"))
            scoring = !strcmp(v, "sigmoid") ? MOECL_SCORING_SIGMOID : MOECL_SCORING_SOFTMAX;
        else if (!strcmp(a, "--scale"))
            scale = strtof(v, NULL);
        else if (!strcmp(a, "--alpha"))
            alpha = strtof(v, NULL);
        else if (strcmp(a, "--chunk-rows") && strcmp(a, "--device")) { /* moecl-route's own; ignored */
            fprintf(stderr, "route-check: unknown option %s\n", a);
            return 2;
        }
    }
    if (!logits || !top_k || (!weights && !ids && !pairs)) {
        fprintf(stderr, "route-check: needs the logits, --top-k and at least one output\n");
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
    const uint32_t experts = (uint32_t)nl.shape[1], k = (uint32_t)top_k;
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
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init((uint32_t)tokens, experts, k);
        d.gating_dtype = dtype;
        d.scoring = scoring;
        d.num_expert_groups = (uint32_t)groups;
        d.topk_group = (uint32_t)topk_group;
        d.group_score = group_score;
        d.renormalize = renormalize;
        d.routed_scaling_factor = scale;
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
        d.top_k = k;
        d.hidden_dtype = dtype;
        bad = ref_check_grounded_router(&d, h, l, g, p, w, id, msg, sizeof(msg));
    }
    if (bad) {
        fprintf(stderr, "route-check: %d bad rows of %llu; first: %s\n", bad, (unsigned long long)tokens, msg);
        return 1;
    }
    printf("route-check: %llu rows x top %u agree with the reference\n", (unsigned long long)tokens, k);
    free(l);
    free(h);
    free(g);
    free(b);
    free(w);
    free(p);
    free(id);
    return 0;
}
