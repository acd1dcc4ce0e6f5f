/* A program that uses moecl the way an outside project does: the public
 * header and the library only, found through pkg-config (an installed tree)
 * or a meson subproject. It routes four tokens over eight experts, top 2,
 * with the softmax of the seed op, and compares with ids and weights worked
 * out by hand. Usage: consumer [EXPECTED_VERSION]. Exit status 0 when the
 * version (if given) and the version macros, the ids, the weights and a
 * validation error are as expected, 1 otherwise. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

#define T 4
#define E 8
#define K 2

/* The version macros of moecl/version.h agree with one another, with
 * moecl_version() and with EXPECTED_VERSION (meson.build's). */
static int check_version_macros(const char *expected)
{
    char text[32];
    snprintf(text, sizeof(text), "%d.%d.%d", MOECL_VERSION_MAJOR, MOECL_VERSION_MINOR, MOECL_VERSION_PATCH);
    if (strcmp(text, MOECL_VERSION_STRING) != 0 || strcmp(MOECL_VERSION_STRING, moecl_version()) != 0 ||
        (expected && strcmp(MOECL_VERSION_STRING, expected) != 0) ||
        MOECL_VERSION_NUMBER != MOECL_VERSION_MAJOR * 10000 + MOECL_VERSION_MINOR * 100 + MOECL_VERSION_PATCH ||
        MOECL_VERSION_OF(0, 1, 0) != 100 || MOECL_VERSION_NUMBER < MOECL_VERSION_OF(0, 1, 0)) {
        fprintf(stderr, "consumer: version macros %s (%s, number %d) against moecl_version() %s, expected %s\n",
                MOECL_VERSION_STRING, text, MOECL_VERSION_NUMBER, moecl_version(), expected ? expected : "-");
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(moecl_version(), argv[1]) != 0) {
        fprintf(stderr, "consumer: moecl_version() is %s, expected %s\n", moecl_version(), argv[1]);
        return 1;
    }
    if (check_version_macros(argc > 1 ? argv[1] : NULL))
        return 1;
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(NULL, &ctx);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "consumer: no context: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        return 1;
    }
    static const float logits[T][E] = {
        {0, 1, 2, 3, 4, 5, 6, 7}, /* the last two */
        {7, 6, 5, 4, 3, 2, 1, 0}, /* the first two */
        {0, 0, 0, 5, 0, 4, 0, 0}, /* 3, then 5 */
        {1, 1, 1, 1, 1, 1, 1, 1}, /* all tied: the lowest indices */
    };
    /* softmax: e^7 / sum(e^0..e^7) = 0.632332683, e^6 / ... = 0.232622194;
     * e^5 / (e^5 + e^4 + 6) = 0.710072387, e^4 / ... = 0.261221033; 1/8. */
    static const int32_t want_ids[T][K] = {{7, 6}, {0, 1}, {3, 5}, {0, 1}};
    static const float want_weights[T][K] = {
        {0.632332683f, 0.232622194f},
        {0.632332683f, 0.232622194f},
        {0.710072387f, 0.261221033f},
        {0.125f, 0.125f},
    };
    float weights[T][K];
    int32_t ids[T][K];
    memset(ids, 0xff, sizeof(ids));
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(T, E, K);
    st = moecl_topk_gating_host(ctx, &d, logits, NULL, &weights[0][0], &ids[0][0]);
    int bad = 0;
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "consumer: moecl_topk_gating_host: %s: %s\n", moecl_status_string(st), moecl_context_error(ctx));
        bad = 1;
    } else {
        for (int t = 0; t < T; t++)
            for (int k = 0; k < K; k++) {
                float dw = weights[t][k] - want_weights[t][k];
                if (ids[t][k] != want_ids[t][k] || dw > 1e-5f || dw < -1e-5f) {
                    fprintf(stderr, "consumer: token %d, choice %d: expert %d weight %.9f, expected expert %d weight %.9f\n",
                            t, k, (int)ids[t][k], weights[t][k], (int)want_ids[t][k], want_weights[t][k]);
                    bad = 1;
                }
            }
    }
    /* An invalid request is refused with a message naming the field. */
    moecl_topk_gating_desc z = moecl_topk_gating_desc_init(T, E, 0);
    st = moecl_topk_gating_host(ctx, &z, logits, NULL, &weights[0][0], &ids[0][0]);
    if (st != MOECL_ERROR_INVALID_ARGUMENT || !strstr(moecl_context_error(ctx), "top_k")) {
        fprintf(stderr, "consumer: top_k 0 gave %s (\"%s\"), expected invalid argument naming top_k\n",
                moecl_status_string(st), moecl_context_error(ctx));
        bad = 1;
    }
    char line[256];
    moecl_context_describe(ctx, line, sizeof(line));
    line[strcspn(line, "\n")] = '\0';
    moecl_context_destroy(ctx);
    if (!bad)
        printf("consumer: moecl %s routes 4 tokens as expected (%s)\n", moecl_version(), line);
    return bad;
}
