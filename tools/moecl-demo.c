/* moecl-demo: routes the seed shapes of top-k gating on the default device,
 * checks each result against the float64 reference and prints the time of
 * a call. The quick start's main job until moecl-bench exists. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>

#include <moecl/moecl.h>

#include "reference.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static float randn(unsigned long long *state)
{
    /* Box-Muller on a 64-bit LCG: inputs like torch.randn's, reproducible. */
    double u[2];
    for (int i = 0; i < 2; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        u[i] = ((*state >> 11) + 0.5) / 9007199254740992.0;
    }
    return (float)(sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
}

int main(int argc, char **argv)
{
    const char *selector = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            selector = argv[++i];
        } else {
            fprintf(stderr, "usage: moecl-demo [--device SELECTOR]\n");
            return !strcmp(argv[i], "--help") ? 0 : 2;
        }
    }
    moecl_context *ctx;
    moecl_status st = moecl_context_create(selector, &ctx);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "moecl-demo: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        return 1;
    }
    char text[4096];
    moecl_context_describe(ctx, text, sizeof(text));
    printf("%s\n", text);

    static const unsigned shapes[][2] = {{1, 128},    {129, 128},  {256, 128},  {520, 128},  {1019, 128},
                                         {2044, 128}, {4083, 128}, {8192, 128}, {8037, 256}, {13526, 256}};
    int failures = 0;
    unsigned long long rng = 42;
    printf("%-14s %-10s %-12s %s\n", "tokens x E", "top_k", "check", "host call (ms, median of 5)");
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(shapes[s][0], shapes[s][1], 8);
        size_t n = (size_t)d.num_tokens * d.num_experts, nk = (size_t)d.num_tokens * d.top_k;
        float *logits = malloc(n * sizeof(float)), *w = malloc(nk * sizeof(float));
        int32_t *ids = malloc(nk * sizeof(int32_t));
        if (!logits || !w || !ids)
            return 1;
        for (size_t i = 0; i < n; i++)
            logits[i] = randn(&rng);
        double times[5];
        for (int r = 0; r < 5 && st == MOECL_SUCCESS; r++) {
            memset(w, 0xff, nk * sizeof(float));
            double t0 = now_ms();
            st = moecl_topk_gating_host(ctx, &d, logits, NULL, w, ids);
            times[r] = now_ms() - t0;
        }
        char msg[512] = "";
        int bad = st == MOECL_SUCCESS ? ref_check_topk_gating(&d, logits, NULL, w, ids, msg, sizeof(msg)) : 1;
        if (st != MOECL_SUCCESS)
            snprintf(msg, sizeof(msg), "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
        for (int i = 1; i < 5; i++)
            for (int j = i; j > 0 && times[j] < times[j - 1]; j--) {
                double t = times[j];
                times[j] = times[j - 1];
                times[j - 1] = t;
            }
        char shape[32];
        snprintf(shape, sizeof(shape), "%ux%u", d.num_tokens, d.num_experts);
        printf("%-14s %-10u %-12s %.3f\n", shape, d.top_k, bad ? "FAIL" : "ok", st == MOECL_SUCCESS ? times[2] : 0.0);
        if (bad) {
            printf("  %s\n", msg);
            failures++;
        }
        if (s == 0 && !bad) {
            printf("  token 0 routes to:");
            for (unsigned j = 0; j < d.top_k; j++)
                printf(" %d (%.4f)", ids[j], w[j]);
            printf("\n");
        }
        free(logits);
        free(w);
        free(ids);
        st = MOECL_SUCCESS;
    }
    moecl_context_destroy(ctx);
    printf("%s\n", failures ? "FAILED" : "all shapes match the float64 reference");
    return failures ? 1 : 0;
}
