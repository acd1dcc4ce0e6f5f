/* ep_dispatch: expert parallelism across MPI ranks with moecl's layout.
 *
 * A mixture-of-experts layer whose experts do not fit one device spreads
 * them over several ranks (processes, one device each, on one machine or
 * several). Every rank holds some of the experts and its own batch of
 * tokens. This program plays one such layer, as N ranks:
 *
 *   1. each rank creates its own moecl context (one device per rank) and
 *      makes its own tokens (seeded by its rank): gating logits and hidden
 *      rows;
 *   2. routes them: softmax top-k gating, renormalised over the chosen k
 *      (the convention of Qwen3-MoE and Mixtral: moecl_topk_gating_host);
 *   3. computes the dispatch layout (moecl_ep_layout_host): the physical
 *      expert of every (token, slot), with replicas of hot experts on other
 *      ranks (vLLM's EPLB), how many slots go to each rank and in which
 *      order;
 *   4. exchanges the counts (MPI_Alltoall), then the hidden rows, the
 *      destination's local expert index and the routing weight of every
 *      slot (MPI_Alltoallv);
 *   5. on the receiving side, groups what arrived by local expert
 *      (moecl_moe_align_host, as a grouped expert GEMM would) and applies
 *      each expert, a stand-in with a known output, scaled by the slot's
 *      weight;
 *   6. sends the outputs back (MPI_Alltoallv, the reverse of step 4) and
 *      combines each token's k outputs in slot order;
 *   7. checks every token's output against a single-process computation
 *      of the same layer (no layout, no MPI: each slot's logical expert
 *      applied directly) and agrees on the verdict with MPI_Allreduce.
 *
 * What is sent: one message row per (token, slot), not one per (token,
 * rank) as DeepEP's dispatch does. A token with two experts on one rank is
 * then sent twice, but every returned row is one slot's output and the
 * sender combines the k slots in their own order, so the result is the
 * same bits as the single-process computation whatever the placement. With
 * one row per (token, rank), the receiver would sum its local slots first
 * and the sender sum per rank, a different order of float additions; the
 * layout's token_in_rank and tokens_per_rank are what such a dispatch
 * needs, and this program prints how many rows it would have sent.
 *
 * Exactness: the hidden values are small integers and the stand-in
 * expert e computes y = 2 x + 32 (e + 1), exact in float (|y| < 2^24 for
 * every valid e) and different for every expert whatever x is (|2 x| < 16).
 * The rest is float arithmetic done in the same order on both paths
 * (w * y rounded once, the k products summed from slot 0), so the check
 * is bit for bit. Only the routing weights are approximate: they are
 * checked against a float64 softmax within WEIGHT_TOL, and the combined
 * outputs against a float64 combination within the bound that implies.
 *
 * Usage: mpirun -np N ep_dispatch [options]; --help lists them. Exit
 * status: 0 on every rank when every check passed on every rank, 1 when
 * one failed (on every rank), 2 on bad usage. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include <moecl/moecl.h>

/* The routing weights may differ from float64's by a few float ulps of
 * 1.0 (the device's exp, a sum of k terms and a division); 2^-18 leaves
 * room for any conforming OpenCL device. */
#define WEIGHT_TOL (1.0 / (1 << 18))

typedef struct options {
    int tokens;      /* tokens per rank */
    int experts;     /* logical experts */
    int top_k;
    int hidden;      /* hidden size: floats per row sent */
    int replicas;    /* logical experts 0..replicas-1 (the "hot" ones) get extra copies */
    int copies;      /* copies of each replicated expert, the original included */
    int idle_ranks;  /* the last idle_ranks ranks hold no expert (they receive nothing) */
    int empty_rank;  /* this rank has no tokens (-1: none) */
    int block_size;  /* moe_align's block, as a grouped GEMM's tile of rows */
    int platform;    /* -1: MOECL_DEVICE or the default; else device "P:<local rank>" */
    int seed;
    const char *fault; /* a deliberate bug, to show that the check catches it */
} options;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: mpirun -np N ep_dispatch [options]\n"
            "  --tokens T       tokens per rank (default 32)\n"
            "  --experts E      logical experts (default 128)\n"
            "  --top-k K        experts per token (default 8)\n"
            "  --hidden H       hidden size (default 16)\n"
            "  --replicas N     experts 0..N-1 get extra copies on other ranks (default 0)\n"
            "  --copies C       copies of each of those, the original included (default 2)\n"
            "  --idle-ranks N   the last N ranks hold no expert and receive nothing (default 0)\n"
            "  --empty-rank R   rank R routes no tokens (default: none)\n"
            "  --block-size B   moe_align's block size on the receiving side (default 4)\n"
            "  --platform P     rank with local index i uses OpenCL device P:i (default: MOECL_DEVICE)\n"
            "  --seed S         seed of every rank's tokens (default 1)\n"
            "  --fault F        none, offset or replica: a deliberate bug the check must catch\n");
}

/* 0 when every option parsed, -1 for --help, else 2 (usage); rank 0
 * prints the reason. */
static int parse_options(int argc, char **argv, options *o, int rank)
{
    *o = (options){32, 128, 8, 16, 0, 2, 0, -1, 4, -1, 1, "none"};
    const struct {
        const char *name;
        int *value;
    } numbers[] = {{"--tokens", &o->tokens},         {"--experts", &o->experts},   {"--top-k", &o->top_k},
                   {"--hidden", &o->hidden},         {"--replicas", &o->replicas}, {"--copies", &o->copies},
                   {"--idle-ranks", &o->idle_ranks}, {"--empty-rank", &o->empty_rank},
                   {"--block-size", &o->block_size}, {"--platform", &o->platform}, {"--seed", &o->seed}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            if (rank == 0)
                usage(stdout);
            return -1;
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        bool known = false;
        if (v && strcmp(a, "--fault") == 0 && (!strcmp(v, "none") || !strcmp(v, "offset") || !strcmp(v, "replica"))) {
            o->fault = v;
            known = true;
        }
        for (size_t n = 0; v && !known && n < sizeof(numbers) / sizeof(numbers[0]); n++) {
            char *end;
            const long x = strtol(v, &end, 10);
            if (strcmp(a, numbers[n].name) == 0 && *v && !*end && x >= -1 && x <= 1 << 20) {
                *numbers[n].value = (int)x;
                known = true;
            }
        }
        if (!known) {
            if (rank == 0) {
                fprintf(stderr, "ep_dispatch: bad option or value: %s%s%s\n", a, v ? " " : "", v ? v : "");
                usage(stderr);
            }
            return 2;
        }
    }
    return 0;
}

/* ---- the expert placement: the same tables on every rank ---- */

/* Physical experts 0..E-1 are the logical ones; copy c (1..copies-1) of hot
 * expert i is physical E + (c - 1) * replicas + i. */
typedef struct placement {
    int num_physical, max_replicas;
    int32_t *logical_to_physical; /* [E][max_replicas], -1 past replica_counts; NULL without replicas */
    int32_t *replica_counts;      /* [E], NULL without replicas */
    int32_t *physical_to_rank;    /* [P] */
    int32_t *physical_to_logical; /* [P] */
    bool pass_rank_table;         /* false: the layout gets NULL, its contiguous default */
} placement;

/* Checks the options against the world size; a message and false if they
 * cannot be placed. */
static bool options_fit(const options *o, int ranks, int rank)
{
    const char *why = NULL;
    if (o->tokens < 0 || o->experts < 1 || o->top_k < 1 || o->top_k > o->experts || o->hidden < 1 ||
        o->block_size < 1 || o->replicas < 0 || o->replicas > o->experts || o->copies < 1 || o->copies > 64)
        why = "a size is out of range (tokens >= 0, 1 <= top_k <= experts, hidden, block size >= 1, "
              "0 <= replicas <= experts, 1 <= copies <= 64)";
    else if (o->idle_ranks < 0 || o->idle_ranks >= ranks)
        why = "--idle-ranks must leave at least one rank with experts";
    else if (o->experts < ranks - o->idle_ranks)
        why = "every rank that holds experts needs at least one";
    else if (o->empty_rank >= ranks)
        why = "--empty-rank is not a rank";
    else if ((double)o->tokens * o->top_k * o->hidden * ranks > INT_MAX)
        why = "tokens * top_k * hidden * ranks must fit an int (MPI's counts)";
    if (why && rank == 0)
        fprintf(stderr, "ep_dispatch: %s\n", why);
    return !why;
}

static void placement_make(const options *o, int ranks, placement *pl)
{
    const int E = o->experts, active = ranks - o->idle_ranks;
    const int extra = o->replicas * (o->copies - 1);
    pl->num_physical = E + extra;
    pl->max_replicas = extra ? o->copies : 1;
    pl->physical_to_rank = malloc(sizeof(int32_t) * (size_t)pl->num_physical);
    pl->physical_to_logical = malloc(sizeof(int32_t) * (size_t)pl->num_physical);
    /* The originals in contiguous blocks over the active ranks. */
    for (int e = 0; e < E; e++) {
        pl->physical_to_rank[e] = (int32_t)((long)e * active / E);
        pl->physical_to_logical[e] = e;
    }
    /* That is the layout's own default (physical_to_rank NULL) when every
     * rank is active and the blocks are equal; pass NULL then, to use it. */
    pl->pass_rank_table = extra || o->idle_ranks || E % ranks;
    pl->logical_to_physical = NULL;
    pl->replica_counts = NULL;
    if (!extra)
        return;
    pl->logical_to_physical = malloc(sizeof(int32_t) * (size_t)E * (size_t)pl->max_replicas);
    pl->replica_counts = malloc(sizeof(int32_t) * (size_t)E);
    for (int e = 0; e < E; e++) {
        int32_t *row = pl->logical_to_physical + (size_t)e * (size_t)pl->max_replicas;
        pl->replica_counts[e] = e < o->replicas ? o->copies : 1;
        row[0] = e;
        for (int c = 1; c < pl->max_replicas; c++) {
            if (e >= o->replicas) {
                row[c] = -1;
                continue;
            }
            const int p = E + (c - 1) * o->replicas + e;
            row[c] = p;
            /* Copy c lands c * (active / copies) ranks further on: copies
             * on different ranks where there are enough active ranks. */
            const int step = active / o->copies > 0 ? active / o->copies : 1;
            pl->physical_to_rank[p] = (pl->physical_to_rank[e] + c * step) % active;
            pl->physical_to_logical[p] = e;
        }
    }
}

static void placement_free(placement *pl)
{
    free(pl->logical_to_physical);
    free(pl->replica_counts);
    free(pl->physical_to_rank);
    free(pl->physical_to_logical);
}

/* ---- one rank's tokens ---- */

static uint64_t rng_next(uint64_t *s)
{
    /* splitmix64: a fixed, portable stream per seed */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Logits: each row a random permutation of E distinct values 1/16 apart,
 * so that no two experts tie and float32 and float64 pick the same k.
 * Hidden values: integers in [-4, 4]. */
static void make_tokens(const options *o, int rank, int T, float *logits, float *hidden)
{
    const int E = o->experts;
    uint64_t s = ((uint64_t)(uint32_t)o->seed << 32) ^ (uint64_t)rank;
    for (int t = 0; t < T; t++) {
        float *row = logits + (size_t)t * (size_t)E;
        for (int e = 0; e < E; e++)
            row[e] = (float)e / 16.0f - 4.0f;
        for (int e = E - 1; e > 0; e--) {
            const int j = (int)(rng_next(&s) % (uint64_t)(e + 1));
            const float v = row[e];
            row[e] = row[j];
            row[j] = v;
        }
    }
    for (size_t i = 0; i < (size_t)T * (size_t)o->hidden; i++)
        hidden[i] = (float)((int)(rng_next(&s) % 9) - 4);
}

/* ---- the stand-in expert and the combination, shared by both paths ---- */

/* Logical expert e's output for one row, scaled by the routing weight w:
 * out = w * (2 x + 32 (e + 1)). Every replica of e computes the same. */
static void expert_apply(int e, float w, const float *x, float *out, int H)
{
    for (int h = 0; h < H; h++)
        out[h] = w * (2.0f * x[h] + 32.0f * (float)(e + 1));
}

/* One token's output: the sum of its k slots' rows, from slot 0 on. */
static void combine(const float *slot_rows, int K, int H, float *out)
{
    for (int h = 0; h < H; h++) {
        float acc = 0.0f;
        for (int j = 0; j < K; j++)
            acc += slot_rows[(size_t)j * (size_t)H + h];
        out[h] = acc;
    }
}

/* ---- the receiving side: group by local expert, apply the experts ---- */

/* Applies the local experts to the n received rows (in recv_rows, with
 * their local expert in recv_local and weight in recv_weights) into
 * out_rows, grouped by expert through moe_align as a grouped GEMM would
 * take them. locals[i] is the physical id of local expert i. false (with a
 * message) if moe_align failed or a row names no local expert. */
static bool run_local_experts(moecl_context *ctx, const options *o, const placement *pl, const int32_t *locals,
                              int num_local, int n, const float *recv_rows, const int32_t *recv_local,
                              const float *recv_weights, float *out_rows, int rank)
{
    const int H = o->hidden;
    if (num_local == 0) {
        if (n)
            fprintf(stderr, "ep_dispatch: rank %d holds no expert but received %d rows\n", rank, n);
        return n == 0;
    }
    moecl_moe_align_desc ad = moecl_moe_align_desc_init((uint32_t)n, 1, (uint32_t)num_local,
                                                        (uint32_t)o->block_size);
    const size_t max_padded = (size_t)moecl_moe_align_max_padded(&ad);
    int32_t *counts = malloc(sizeof(int32_t) * (size_t)num_local);
    int32_t *sorted = malloc(sizeof(int32_t) * max_padded);
    int32_t *block_expert = malloc(sizeof(int32_t) * (max_padded / (size_t)o->block_size + 1));
    int32_t post_padded = 0, invalid = 0;
    bool ok = counts && sorted && block_expert;
    if (ok && moecl_moe_align_host(ctx, &ad, recv_local, counts, sorted, block_expert, &post_padded, NULL,
                                   &invalid) != MOECL_SUCCESS) {
        fprintf(stderr, "ep_dispatch: rank %d: %s\n", rank, moecl_context_error(ctx));
        ok = false;
    }
    if (ok && invalid) {
        fprintf(stderr, "ep_dispatch: rank %d received %d rows for experts it does not hold\n", rank, invalid);
        ok = false;
    }
    /* Every block holds rows of one expert; padding entries are the
     * sentinel n. A row never reached stays at 0, which the check sees. */
    memset(out_rows, 0, sizeof(float) * (size_t)n * (size_t)H);
    for (int b = 0; ok && b < post_padded / o->block_size; b++) {
        const int32_t p = locals[block_expert[b]];
        if (strcmp(o->fault, "replica") == 0 && p >= o->experts)
            continue; /* the deliberate bug: the replicas' rows are dropped */
        for (int i = 0; i < o->block_size; i++) {
            const int32_t r = sorted[(size_t)b * (size_t)o->block_size + (size_t)i];
            if (r == n)
                continue;
            expert_apply(pl->physical_to_logical[p], recv_weights[r], recv_rows + (size_t)r * (size_t)H,
                         out_rows + (size_t)r * (size_t)H, H);
        }
    }
    free(counts);
    free(sorted);
    free(block_expert);
    return ok;
}

/* ---- the check: a single-process computation of the same layer ---- */

/* softmax over all E logits, the top k (distinct logits: no ties), then
 * renormalised over those k; in float64. */
static void reference_route(const float *logits, int E, int K, double *w, int32_t *ids)
{
    double m = -INFINITY;
    for (int e = 0; e < E; e++)
        m = fmax(m, logits[e]);
    double sum = 0.0;
    for (int j = 0; j < K; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int i = 0; i < j; i++)
                taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best]))
                best = e;
        }
        ids[j] = best;
        w[j] = exp((double)logits[best] - m);
        sum += w[j];
    }
    for (int j = 0; j < K; j++)
        w[j] /= sum;
}

/* Checks this rank's T outputs; returns the number of mismatches and
 * prints the first few. */
static long check_outputs(const options *o, int rank, int T, const float *logits, const float *hidden,
                          const float *weights, const int32_t *ids, const float *out)
{
    const int E = o->experts, K = o->top_k, H = o->hidden;
    float *rows = malloc(sizeof(float) * (size_t)K * (size_t)H);
    float *ref = malloc(sizeof(float) * (size_t)H);
    double *w64 = malloc(sizeof(double) * (size_t)K);
    int32_t *ids64 = malloc(sizeof(int32_t) * (size_t)K);
    long bad = 0;
    for (int t = 0; t < T; t++) {
        const float *x = hidden + (size_t)t * (size_t)H;
        const float *w = weights + (size_t)t * (size_t)K;
        const int32_t *id = ids + (size_t)t * (size_t)K;
        const float *got = out + (size_t)t * (size_t)H;
        /* Exact: the same routing, each slot's logical expert applied
         * directly, combined in the same order. */
        for (int j = 0; j < K; j++)
            expert_apply(id[j], w[j], x, rows + (size_t)j * (size_t)H, H);
        combine(rows, K, H, ref);
        /* Approximate: the routing against float64, and the output
         * against float64's combination within what the weights allow
         * (WEIGHT_TOL per weight, plus float's rounding of k products and
         * k - 1 additions). */
        reference_route(logits + (size_t)t * (size_t)E, E, K, w64, ids64);
        bool ok = true;
        for (int j = 0; j < K; j++)
            ok &= ids64[j] == id[j] && fabs(w64[j] - w[j]) <= WEIGHT_TOL;
        double first64 = 0.0;
        for (int h = 0; h < H; h++) {
            double r64 = 0.0, mag = 0.0;
            for (int j = 0; j < K; j++) {
                const double y = 2.0 * x[h] + 32.0 * (ids64[j] + 1);
                r64 += w64[j] * y;
                mag += fabs(y);
            }
            const double bound = mag * (WEIGHT_TOL + 2.0 * K * FLT_EPSILON);
            ok &= memcmp(&got[h], &ref[h], sizeof(float)) == 0 && fabs(got[h] - r64) <= bound;
            if (h == 0)
                first64 = r64;
        }
        if (!ok && bad++ < 3)
            fprintf(stderr, "ep_dispatch: rank %d token %d: output[0] %.9g, single-process %.9g, float64 %.9g\n",
                    rank, t, got[0], ref[0], first64);
    }
    free(rows);
    free(ref);
    free(w64);
    free(ids64);
    return bad;
}

/* ---- the kernels ---- */

/* The first rank of each machine builds the kernels (or loads them from
 * moecl's disk cache), then the others load what it stored: ranks of one
 * machine compiling the same kernels at once would only share its cores.
 * moe_align's descriptor is a guess at what arrives (its kernels do not
 * depend on the count below several thousand slots; a miss costs a
 * build). */
static bool prepare_kernels(moecl_context *ctx, MPI_Comm node, int local_rank, const moecl_topk_gating_desc *gd,
                            const moecl_ep_layout_desc *ld, const moecl_moe_align_desc *ad, int rank)
{
    bool ok = ctx != NULL;
    for (int turn = 0; turn < 2; turn++) {
        if (ok && (local_rank == 0) == (turn == 0) &&
            (moecl_topk_gating_prepare(ctx, gd) != MOECL_SUCCESS || moecl_ep_layout_prepare(ctx, ld) != MOECL_SUCCESS ||
             (ad->num_experts > 0 && moecl_moe_align_prepare(ctx, ad) != MOECL_SUCCESS))) {
            fprintf(stderr, "ep_dispatch: rank %d: %s\n", rank, moecl_context_error(ctx));
            ok = false;
        }
        MPI_Barrier(node);
    }
    return ok;
}

/* ---- the dispatch ---- */

/* Counts and byte displacements of an MPI_Alltoallv whose element is a
 * row of `width` items, from per-rank row counts. */
static void row_layout(const int32_t *counts, int ranks, int width, int *n, int *displ)
{
    int at = 0;
    for (int r = 0; r < ranks; r++) {
        n[r] = counts[r] * width;
        displ[r] = at;
        at += n[r];
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, ranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    options o;
    int rc = parse_options(argc, argv, &o, rank);
    if (rc || !options_fit(&o, ranks, rank)) {
        MPI_Finalize();
        return rc < 0 ? 0 : 2;
    }
    const int E = o.experts, K = o.top_k, H = o.hidden;
    const int T = rank == o.empty_rank ? 0 : o.tokens;
    const size_t slots = (size_t)T * (size_t)K;
    bool ok;

    /* 1. One context per rank. With --platform P, the rank's index among
     * the ranks on its machine picks the device: P:0, P:1, ... */
    MPI_Comm node;
    int local_rank = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local_rank);
    char device[32];
    snprintf(device, sizeof(device), "%d:%d", o.platform, local_rank);
    moecl_context *ctx = NULL;
    if (moecl_context_create(o.platform >= 0 ? device : NULL, &ctx) != MOECL_SUCCESS)
        fprintf(stderr, "ep_dispatch: rank %d: %s\n", rank, moecl_context_error(NULL));

    placement pl;
    placement_make(&o, ranks, &pl);
    const int P = pl.num_physical;
    /* This rank's experts, in increasing physical id: local index -> physical
     * id, and physical id -> local index on its rank. */
    int32_t *locals = malloc(sizeof(int32_t) * (size_t)P), *local_index = malloc(sizeof(int32_t) * (size_t)P);
    int num_local = 0;
    {
        int *next = calloc((size_t)ranks, sizeof(int));
        for (int p = 0; p < P; p++) {
            local_index[p] = next[pl.physical_to_rank[p]]++;
            if (pl.physical_to_rank[p] == rank)
                locals[num_local++] = p;
        }
        free(next);
    }

    float *logits = malloc(sizeof(float) * ((size_t)T * (size_t)E + 1));
    float *hidden = malloc(sizeof(float) * ((size_t)T * (size_t)H + 1));
    float *weights = malloc(sizeof(float) * (slots + 1));
    int32_t *ids = malloc(sizeof(int32_t) * (slots + 1));
    make_tokens(&o, rank, T, logits, hidden);

    /* What the three ops compute; their kernels, once per machine first. */
    moecl_topk_gating_desc gd = moecl_topk_gating_desc_init((uint32_t)T, (uint32_t)E, (uint32_t)K);
    gd.renormalize = true;
    moecl_ep_layout_desc ld = moecl_ep_layout_desc_init((uint32_t)T, (uint32_t)K, (uint32_t)E, (uint32_t)ranks);
    ld.num_physical = (uint32_t)P;
    ld.max_replicas = (uint32_t)pl.max_replicas;
    const moecl_moe_align_desc ad = moecl_moe_align_desc_init((uint32_t)slots, 1, (uint32_t)num_local,
                                                              (uint32_t)o.block_size);
    ok = prepare_kernels(ctx, node, local_rank, &gd, &ld, &ad, rank);
    MPI_Comm_free(&node);

    /* 2. Routing. */
    if (ok && moecl_topk_gating_host(ctx, &gd, logits, NULL, weights, ids) != MOECL_SUCCESS) {
        fprintf(stderr, "ep_dispatch: rank %d: %s\n", rank, moecl_context_error(ctx));
        ok = false;
    }

    /* 3. The layout. */
    int32_t *physical_ids = malloc(sizeof(int32_t) * (slots + 1));
    int32_t *send_slots = malloc(sizeof(int32_t) * (slots + 1));
    int32_t *rank_counts = calloc((size_t)ranks, sizeof(int32_t));
    int32_t *rank_offsets = calloc((size_t)ranks + 1, sizeof(int32_t));
    int32_t *tokens_per_rank = calloc((size_t)ranks, sizeof(int32_t));
    int32_t *expert_counts = calloc((size_t)P, sizeof(int32_t));
    if (ok && moecl_ep_layout_host(ctx, &ld, ids, pl.logical_to_physical, pl.replica_counts,
                                   pl.pass_rank_table ? pl.physical_to_rank : NULL, physical_ids, rank_counts,
                                   rank_offsets, send_slots, NULL, tokens_per_rank,
                                   expert_counts) != MOECL_SUCCESS) {
        fprintf(stderr, "ep_dispatch: rank %d: %s\n", rank, moecl_context_error(ctx));
        ok = false;
    }
    /* Where a rank could not route or lay out its tokens, every rank
     * exchanges nothing (the collectives below still run in step) and the
     * verdict fails everywhere. */
    int ready = ok, all_ready = 0;
    MPI_Allreduce(&ready, &all_ready, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    if (!all_ready) {
        ok = false;
        memset(rank_counts, 0, sizeof(int32_t) * (size_t)ranks);
        memset(expert_counts, 0, sizeof(int32_t) * (size_t)P);
    }
    const int sent = all_ready ? rank_offsets[ranks] : 0;

    /* 4. The dispatch: the counts first, so every rank knows what it
     * receives from each, then one row per slot, in the layout's order. */
    int32_t *recv_counts = malloc(sizeof(int32_t) * (size_t)ranks);
    MPI_Alltoall(rank_counts, 1, MPI_INT32_T, recv_counts, 1, MPI_INT32_T, MPI_COMM_WORLD);
    int received = 0;
    for (int r = 0; r < ranks; r++)
        received += recv_counts[r];

    float *send_rows = malloc(sizeof(float) * ((size_t)sent * (size_t)H + 1));
    float *send_weights = malloc(sizeof(float) * ((size_t)sent + 1));
    int32_t *send_local = malloc(sizeof(int32_t) * ((size_t)sent + 1));
    for (int i = 0; i < sent; i++) {
        const int32_t s = send_slots[i], t = s / K;
        memcpy(send_rows + (size_t)i * (size_t)H, hidden + (size_t)t * (size_t)H, sizeof(float) * (size_t)H);
        send_weights[i] = weights[s];
        /* The receiver needs only its own index of the expert. */
        send_local[i] = local_index[physical_ids[s]];
    }
    int *sn = malloc(sizeof(int) * (size_t)ranks), *sd = malloc(sizeof(int) * (size_t)ranks);
    int *rn = malloc(sizeof(int) * (size_t)ranks), *rd = malloc(sizeof(int) * (size_t)ranks);
    float *recv_rows = malloc(sizeof(float) * ((size_t)received * (size_t)H + 1));
    float *recv_weights = malloc(sizeof(float) * ((size_t)received + 1));
    int32_t *recv_local = malloc(sizeof(int32_t) * ((size_t)received + 1));
    row_layout(rank_counts, ranks, H, sn, sd);
    row_layout(recv_counts, ranks, H, rn, rd);
    MPI_Alltoallv(send_rows, sn, sd, MPI_FLOAT, recv_rows, rn, rd, MPI_FLOAT, MPI_COMM_WORLD);
    row_layout(rank_counts, ranks, 1, sn, sd);
    row_layout(recv_counts, ranks, 1, rn, rd);
    MPI_Alltoallv(send_weights, sn, sd, MPI_FLOAT, recv_weights, rn, rd, MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Alltoallv(send_local, sn, sd, MPI_INT32_T, recv_local, rn, rd, MPI_INT32_T, MPI_COMM_WORLD);

    /* 5. The local experts, on rows grouped by expert. */
    float *expert_rows = malloc(sizeof(float) * ((size_t)received * (size_t)H + 1));
    if (all_ready)
        ok &= run_local_experts(ctx, &o, &pl, locals, num_local, received, recv_rows, recv_local, recv_weights,
                                expert_rows, rank);

    /* 6. The combine: the rows go back the way they came (each rank's
     * block in the order it arrived), then into their slots. */
    float *back_rows = malloc(sizeof(float) * ((size_t)sent * (size_t)H + 1));
    row_layout(recv_counts, ranks, H, rn, rd);
    row_layout(rank_counts, ranks, H, sn, sd);
    MPI_Alltoallv(expert_rows, rn, rd, MPI_FLOAT, back_rows, sn, sd, MPI_FLOAT, MPI_COMM_WORLD);
    float *slot_rows = calloc(slots + 1, sizeof(float) * (size_t)H);
    for (int i = 0; i < sent; i++) {
        /* The deliberate bug "offset": each returned row put one slot off. */
        const int from = strcmp(o.fault, "offset") == 0 ? (i + 1) % sent : i;
        memcpy(slot_rows + (size_t)send_slots[i] * (size_t)H, back_rows + (size_t)from * (size_t)H,
               sizeof(float) * (size_t)H);
    }
    float *out = malloc(sizeof(float) * ((size_t)T * (size_t)H + 1));
    for (int t = 0; t < T; t++)
        combine(slot_rows + (size_t)t * (size_t)K * (size_t)H, K, H, out + (size_t)t * (size_t)H);

    /* 7. The check, here and across ranks: every token's output; what each
     * rank's experts received against what the senders' layouts counted. */
    long bad = all_ready ? check_outputs(&o, rank, T, logits, hidden, weights, ids, out) : 0;
    int32_t *all_counts = malloc(sizeof(int32_t) * (size_t)P);
    MPI_Allreduce(expert_counts, all_counts, P, MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
    int32_t *arrived = calloc((size_t)num_local + 1, sizeof(int32_t));
    for (int i = 0; i < received; i++)
        if (recv_local[i] >= 0 && recv_local[i] < num_local)
            arrived[recv_local[i]]++;
    for (int i = 0; i < num_local; i++)
        if (arrived[i] != all_counts[locals[i]]) {
            fprintf(stderr, "ep_dispatch: rank %d expert %d: %d rows arrived, the layouts counted %d\n", rank,
                    locals[i], arrived[i], all_counts[locals[i]]);
            ok = false;
        }
    int verdict = ok && bad == 0, all_ok = 0;
    MPI_Allreduce(&verdict, &all_ok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    long replica_slots = 0;
    for (int p = E; p < P; p++)
        replica_slots += all_counts[p];
    long totals[5] = {bad, T, sent, sent - rank_counts[rank], received == 0}, sums[5];
    int32_t rows_per_token_rank = 0;
    for (int r = 0; r < ranks; r++)
        rows_per_token_rank += tokens_per_rank[r];
    long tr = rows_per_token_rank, tr_sum = 0;
    MPI_Reduce(totals, sums, 5, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    MPI_Reduce(&tr, &tr_sum, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        /* Rank 0's device, so that a log says where the ranks ran. */
        moecl_context_info *info = calloc(1, sizeof(*info));
        if (info) {
            info->struct_size = sizeof(*info);
            if (!ctx || moecl_context_query_info(ctx, info) != MOECL_SUCCESS)
                snprintf(info->device, sizeof(info->device), "none");
        }
        printf("ep_dispatch: %d ranks, %d experts (%d physical), top %d, hidden %d: %ld tokens, %ld slot rows "
               "sent (%ld to other ranks, %ld to replicas, %ld ranks received none; one row per (token, rank) "
               "would be %ld): %s (%ld tokens differ); rank 0's device: %s\n",
               ranks, E, P, K, H, sums[1], sums[2], sums[3], replica_slots, sums[4], tr_sum,
               all_ok ? "ok" : all_ready ? "FAILED" : "FAILED: a rank could not route or lay out its tokens",
               sums[0], info ? info->device : "?");
        free(info);
    }

    free(all_counts);
    free(arrived);
    free(out);
    free(slot_rows);
    free(back_rows);
    free(expert_rows);
    free(recv_local);
    free(recv_weights);
    free(recv_rows);
    free(rd);
    free(rn);
    free(sd);
    free(sn);
    free(send_local);
    free(send_weights);
    free(send_rows);
    free(recv_counts);
    free(expert_counts);
    free(tokens_per_rank);
    free(rank_offsets);
    free(rank_counts);
    free(send_slots);
    free(physical_ids);
    free(ids);
    free(weights);
    free(hidden);
    free(logits);
    free(local_index);
    free(locals);
    placement_free(&pl);
    moecl_context_destroy(ctx);
    MPI_Finalize();
    return all_ok ? 0 : 1;
}
