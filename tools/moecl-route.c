/* moecl-route: route the tokens of NumPy .npy files with moecl, from the
 * shell. Top-k gating reads a [tokens][experts] logits file; the grounded
 * router reads hidden states, router logits and the experts' ground rows.
 * The rows stream through in chunks (fread, one chunk in memory at a time);
 * the outputs are .npy files written through temporary files that are
 * renamed into place only when everything succeeded. With a dispatch
 * output or --block-size, the routed ids of all tokens are kept in host
 * memory and moecl_moe_align sorts them by expert at the end; --op align
 * does only that, on an ids file. A summary follows: the load of each
 * expert as a text histogram, tokens routed, time. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include <moecl/moecl.h>

#include "npy.h"
#include "tool_args.h"
#include "tool_json.h"

typedef enum op_kind { OP_TOPK, OP_GROUNDED, OP_ALIGN } op_kind;

/* The outputs: the routing's, then moe_align's (the dispatch outputs). */
enum { OUT_WEIGHTS, OUT_IDS, OUT_PAIRS, OUT_COUNTS, OUT_SORTED, OUT_BLOCKS, OUT_SLOTS, OUT_POST, NUM_OUT };
#define FIRST_DISPATCH_OUT OUT_COUNTS
static const char *const out_flag[NUM_OUT] = {"--weights",          "--ids",          "--pairs",
                                              "--expert-counts",    "--sorted-token-ids",
                                              "--block-expert-ids", "--slot-positions", "--post-padded"};

#define DEFAULT_BLOCK_SIZE 64

typedef struct options {
    op_kind op;
    const char *logits, *hidden, *ground, *bias, *ids_in;
    const char *expert_map; /* --expert-map FILE.npy */
    const char *out[NUM_OUT];
    const char *device;
    const char *demo; /* --demo DIR */
    const char *preset; /* --preset NAME */
    long top_k; /* 0: the default */
    long groups, topk_group;
    long experts;    /* --op align */
    long block_size; /* 0: none given */
    moecl_group_score group_score;
    moecl_group_fill group_fill;
    moecl_scoring scoring;
    bool renormalize, bf16, json, progress, no_progress, all_experts;
    float scale, alpha, renormalize_floor, renormalize_eps;
    bool scale_set, alpha_set, scoring_set, group_score_set, group_fill_set, floor_set, eps_set;
    long long chunk_rows; /* 0: about 64 MiB of input per chunk */
    long shared_experts;  /* --shared-experts (topk, grounded) */
    float shared_weight;
    bool shared_weight_set;
} options;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moecl-route [--op topk] [--logits] LOGITS.npy [options] [outputs]\n"
            "       moecl-route --op grounded --hidden H.npy --logits L.npy --ground G.npy [--alpha F]\n"
            "                   [--shared-experts S [--shared-weight F]] [outputs]\n"
            "       moecl-route --op align --ids-in IDS.npy --experts E [--block-size N] [dispatch outputs]\n"
            "       moecl-route --demo DIR\n"
            "Routes the tokens (rows) of .npy files with moecl and prints each expert's load; with\n"
            "dispatch outputs, also sorts the routed slots by expert (moe_align) for a grouped GEMM.\n"
            "\n"
            "Inputs (NumPy .npy, format 1.0/2.0/3.0, C order, little-endian):\n"
            "  topk      LOGITS [tokens][experts]: '<f4' float32, '<f2' float16, or bfloat16 stored\n"
            "            as '<u2' or '|V2' (with --bf16)\n"
            "  grounded  --hidden [tokens][hidden] and --ground [experts][hidden], one dtype of the\n"
            "            three; --logits [tokens][experts] float32\n"
            "  align     --ids-in [tokens][top_k] expert ids (no routing), '<i4' int32 or '<i8' int64\n"
            "            (torch.topk's; converted to int32, a value outside the int32 range stops the run);\n"
            "            ids outside [0, E) are skipped and counted (num_invalid)\n"
            "Options:\n"
            "  --op topk|grounded|align          the op (default topk)\n"
            "  --preset NAME           a model family's routing, as moecl_topk_gating_desc_preset() gives it\n"
            "                          (topk): its top_k, scoring, weighting, groups, renormalisation and\n"
            "                          scale; the logits must have its expert count. It takes no routing\n"
            "                          option beside it (--top-k, --scoring, --groups, --topk-group,\n"
            "                          --group-score, --group-fill, --renormalize, --renormalize-floor,\n"
            "                          --scale: a bad usage, whatever their order); a family with a\n"
            "                          correction bias takes it as --bias. The names: mixtral, qwen3-moe,\n"
            "                          qwen3-next, deepseek-v2, deepseek-v3, deepseek-v4, llama4, gpt-oss,\n"
            "                          glm-4.5, kimi-k2, minimax-m2, gemma4, olmoe\n"
            "  --top-k N, --topk N     experts per token (default 8 for topk, at most the experts;\n"
            "                          2 for grounded, as the grounded-router task moecl started from)\n"
            "  --scoring softmax|sigmoid         (topk; default softmax)\n"
            "  --bias FILE.npy         correction bias, float32 [experts], steers selection only (topk)\n"
            "  --groups G --topk-group K         group-limited selection: G groups, K kept (topk)\n"
            "  --group-score max|top2sum         group score (topk; default max)\n"
            "  --group-fill neg-inf|zero         the experts of dropped groups: never selected (default,\n"
            "                          vLLM), or selecting with 0.0 (the PyTorch reference of the\n"
            "                          top-k task moecl started from, SGLang's DeepSeek-V2\n"
            "                          grouped_topk) (topk, with --groups)\n"
            "  --renormalize           divide each token's weights by their sum (topk)\n"
            "  --renormalize-floor F   divide by max(sum, F) instead: 0 or at least 2^-126 (llama.cpp:\n"
            "                          6.103515625e-5; default 0, moecl's rule: a sum of 0 divides by 1)\n"
            "                          (topk, with --renormalize)\n"
            "  --renormalize-eps F     divide by sum + F instead: 0 or at least 2^-126 (DeepSeek-V3: 1e-20;\n"
            "                          not with --renormalize-floor) (topk, with --renormalize)\n"
            "  --scale F               routed scaling factor, applied last (topk; default 1)\n"
            "  --shared-experts S      S shared experts after the routed slots of every token: ids\n"
            "                          experts + j, weight --shared-weight times the scale (SGLang's fused\n"
            "                          shared experts); the outputs are then top_k + S wide and the\n"
            "                          counts experts + S long; top_k + S is at most 64 (topk, also\n"
            "                          with --preset; grounded, whose scale is 1)\n"
            "  --shared-weight F       a shared slot's weight before the scale (default 1; SGLang's:\n"
            "                          1 / scale) (topk, grounded; with --shared-experts)\n"
            "  --alpha F               router_logits + alpha * hidden @ ground^T (grounded; default 1)\n"
            "  --experts E             the expert count, 1..4096 (align; required)\n"
            "  --block-size N          moe_align's block size, 1..1024 (default 64); given without a\n"
            "                          dispatch output, the summary still reports the padding\n"
            "  --expert-map FILE.npy   int32 [G]: expert parallelism in moe_align (vLLM's expert_map):\n"
            "                          global expert g is this rank's local expert map[g], or -1 (on\n"
            "                          another rank); only local slots are aligned, by local expert.\n"
            "                          topk, grounded: G is the experts, the local ones 0..max(map);\n"
            "                          align: --experts is the local ones, the ids global in [0, G).\n"
            "                          Needs a dispatch output, --block-size or --op align\n"
            "  --bf16                  '<u2' and '|V2' arrays hold bfloat16 bit patterns (without it\n"
            "                          they are refused: a uint16 array is not a float)\n"
            "  --device SEL            gpu, cpu, P:D or a name substring (default $MOECL_DEVICE, else\n"
            "                          the first GPU, else the first CPU)\n"
            "  --chunk-rows N          rows per chunk (default: about 64 MiB of input)\n"
            "  --progress              a progress line on stderr even when it is not a terminal\n"
            "  --no-progress           no progress line\n"
            "  --all-experts           a histogram line for every expert, however many\n"
            "  --json                  print the summary as JSON on stdout instead of text\n"
            "  --demo DIR              write example inputs and exit: DIR/logits.npy (float32, 4096 tokens\n"
            "                          x 256 experts, some experts favoured) and DIR/bias.npy (float32\n"
            "                          [256]); an existing file of those names is kept and refused\n"
            "Long options are spelled out in full: an abbreviation is a bad usage.\n"
            "Outputs (each optional; each written to a temporary file next to it, all renamed into\n"
            "place once the whole run succeeded; an output path that is a folder or another non-file\n"
            "is refused before anything is written):\n"
            "  --weights OUT.npy       float32 [tokens][top_k]\n"
            "  --ids OUT.npy           int32 [tokens][top_k]\n"
            "  --pairs OUT.npy         float32 [tokens][top_k][2]: stacked (index, weight) pairs, the\n"
            "                          layout of the grounded-router task moecl started from\n"
            "Dispatch outputs (moe_align of the routed ids, or of --ids-in; the ids of all tokens are\n"
            "kept in host memory, 4 bytes a slot; max_padded = tokens * top_k + experts * (N - 1)):\n"
            "  --expert-counts OUT.npy     int32 [experts]: valid slots routed to each expert\n"
            "  --sorted-token-ids OUT.npy  int32 [max_padded]: slots (token * top_k + j) by expert,\n"
            "                              each expert's run padded to a multiple of N with the\n"
            "                              sentinel tokens * top_k\n"
            "  --block-expert-ids OUT.npy  int32 [max_padded / N]: each block's expert, -1 past the end\n"
            "  --slot-positions OUT.npy    int32 [tokens][top_k]: where each slot landed (-1: skipped)\n"
            "  --post-padded OUT.npy       int32 [1]: num_tokens_post_padded (also in the summary)\n"
            "Exit status: 0 ok; 1 a bad or unreadable file, a device or write failure (no output file\n"
            "is left behind, and files at the output paths are as they were; only if a rename fails\n"
            "after the others succeeded (the folder changed meanwhile) are the outputs already\n"
            "renamed removed again, named on stderr, and the files they replaced lost); 2 bad usage,\n"
            "or options the op rejects for these shapes (also max_padded above 2^31-1).\n");
}

/* ---- temporary outputs: removed on failure, and on SIGINT/SIGTERM ---- */

static npy_writer writers[NUM_OUT];
static char *volatile pending_tmp[NUM_OUT];

static void on_signal(int sig)
{
    for (int i = 0; i < NUM_OUT; i++)
        if (pending_tmp[i])
            unlink(pending_tmp[i]);
    signal(sig, SIG_DFL);
    raise(sig);
}

static void abort_outputs(void)
{
    for (int i = 0; i < NUM_OUT; i++) {
        pending_tmp[i] = NULL;
        npy_writer_abort(&writers[i]);
    }
}

static int fail_run(const char *msg)
{
    abort_outputs();
    fprintf(stderr, "moecl-route: %s\n", msg);
    return 1;
}

static int bad_usage(const char *fmt, const char *arg)
{
    fprintf(stderr, "moecl-route: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nTry 'moecl-route --help'.\n");
    return 2;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static bool parse_long(const char *s, long lo, long hi, long *v)
{
    char *end;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (errno || end == s || *end || x < lo || x > hi)
        return false;
    *v = x;
    return true;
}

/* A float option's value: -1 to go on, else 2 with the reason named. */
static int parse_float(const char *flag, const char *s, float *v)
{
    const char *why = tool_parse_float(s, v);
    if (!why)
        return -1;
    fprintf(stderr, "moecl-route: %s %s: the value %s\nTry 'moecl-route --help'.\n", flag, s, why);
    return 2;
}

/* The index in out_flag of an output option, else -1. */
static int out_option(const char *a)
{
    for (int i = 0; i < NUM_OUT; i++)
        if (!strcmp(a, out_flag[i]))
            return i;
    return -1;
}

/* Whether the run ends with moe_align: --op align, a dispatch output, or
 * --block-size. */
static bool wants_dispatch(const options *o)
{
    for (int i = FIRST_DISPATCH_OUT; i < NUM_OUT; i++)
        if (o->out[i])
            return true;
    return o->op == OP_ALIGN || o->block_size;
}

static void try_help(FILE *f) { fprintf(f, "Try 'moecl-route --help'.\n"); }

/* The options: each long option's value is 256 + its index here, so the
 * name it matched is longopts[c - 256].name. */
#define FLAG(name) {name, no_argument, NULL, 0}
#define VALUE(name) {name, required_argument, NULL, 0}
static struct option longopts[] = {
    FLAG("renormalize"), FLAG("bf16"), FLAG("json"), FLAG("progress"), FLAG("no-progress"), FLAG("all-experts"),
    VALUE("op"), VALUE("topk"), VALUE("demo"), VALUE("logits"), VALUE("hidden"), VALUE("ground"), VALUE("bias"), VALUE("ids-in"),
    VALUE("expert-map"),
    VALUE("weights"), VALUE("ids"), VALUE("pairs"), VALUE("expert-counts"), VALUE("sorted-token-ids"),
    VALUE("block-expert-ids"), VALUE("slot-positions"), VALUE("post-padded"), VALUE("device"), VALUE("top-k"),
    VALUE("experts"), VALUE("block-size"), VALUE("groups"), VALUE("topk-group"), VALUE("group-score"),
    VALUE("group-fill"), VALUE("renormalize-floor"), VALUE("renormalize-eps"), VALUE("scoring"), VALUE("scale"),
    VALUE("alpha"), VALUE("chunk-rows"), VALUE("preset"), VALUE("shared-experts"), VALUE("shared-weight"),
    {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0},
};
#undef FLAG
#undef VALUE

/* Returns -1 to go on, else the exit status. */
static int parse_args(int argc, char **argv, options *o)
{
    memset(o, 0, sizeof(*o));
    for (int i = 0; longopts[i].name; i++)
        if (longopts[i].val != 'h')
            longopts[i].val = 256 + i;
    int c;
    while ((c = tool_getopt("moecl-route", try_help, argc, argv, "h", longopts)) != -1) {
        if (c == 'h') {
            usage(stdout);
            return 0;
        }
        if (c < 256)
            return 2; /* tool_getopt named it */
        char a[40];
        snprintf(a, sizeof(a), "--%s", longopts[c - 256].name);
        /* vLLM's spelling of --top-k, as an option of its own (never a
         * prefix of --topk-group: tool_getopt takes full names only). */
        if (!strcmp(a, "--topk"))
            snprintf(a, sizeof(a), "--top-k");
        const char *v = optarg;
        long n;
        if (!strcmp(a, "--renormalize")) {
            o->renormalize = true;
        } else if (!strcmp(a, "--bf16")) {
            o->bf16 = true;
        } else if (!strcmp(a, "--json")) {
            o->json = true;
        } else if (!strcmp(a, "--progress")) {
            o->progress = true;
        } else if (!strcmp(a, "--no-progress")) {
            o->no_progress = true;
        } else if (!strcmp(a, "--all-experts")) {
            o->all_experts = true;
        } else if (!strcmp(a, "--op")) {
            if (!strcmp(v, "topk"))
                o->op = OP_TOPK;
            else if (!strcmp(v, "grounded"))
                o->op = OP_GROUNDED;
            else if (!strcmp(v, "align"))
                o->op = OP_ALIGN;
            else
                return bad_usage("--op is topk, grounded or align, not '%s'", v);
        } else if (!strcmp(a, "--logits")) {
            if (o->logits)
                return bad_usage("one logits file only (got a second: %s)", v);
            o->logits = v;
        } else if (!strcmp(a, "--hidden")) {
            o->hidden = v;
        } else if (!strcmp(a, "--ground")) {
            o->ground = v;
        } else if (!strcmp(a, "--bias")) {
            o->bias = v;
        } else if (!strcmp(a, "--ids-in")) {
            o->ids_in = v;
        } else if (!strcmp(a, "--expert-map")) {
            o->expert_map = v;
        } else if (out_option(a) >= 0) {
            o->out[out_option(a)] = v;
        } else if (!strcmp(a, "--device")) {
            o->device = v;
        } else if (!strcmp(a, "--demo")) {
            o->demo = v;
        } else if (!strcmp(a, "--preset")) {
            moecl_topk_gating_desc d;
            if (moecl_topk_gating_desc_preset(v, 0, &d) != MOECL_SUCCESS)
                return bad_usage("--preset: %s", moecl_context_error(NULL));
            o->preset = v;
        } else if (!strcmp(a, "--top-k")) {
            if (!parse_long(v, 1, 64, &o->top_k))
                return bad_usage("--top-k is 1..64, not '%s'", v);
        } else if (!strcmp(a, "--shared-experts")) {
            if (!parse_long(v, 1, 63, &o->shared_experts))
                return bad_usage("--shared-experts is 1..63, not '%s'", v);
        } else if (!strcmp(a, "--shared-weight")) {
            if (parse_float(a, v, &o->shared_weight) >= 0)
                return 2;
            o->shared_weight_set = true;
        } else if (!strcmp(a, "--experts")) {
            if (!parse_long(v, 1, 4096, &o->experts))
                return bad_usage("--experts is 1..4096, not '%s'", v);
        } else if (!strcmp(a, "--block-size")) {
            if (!parse_long(v, 1, 1024, &o->block_size))
                return bad_usage("--block-size is 1..1024, not '%s'", v);
        } else if (!strcmp(a, "--groups")) {
            if (!parse_long(v, 1, 4096, &o->groups))
                return bad_usage("--groups is 1..4096, not '%s'", v);
        } else if (!strcmp(a, "--topk-group")) {
            if (!parse_long(v, 1, 4096, &o->topk_group))
                return bad_usage("--topk-group is 1..4096, not '%s'", v);
        } else if (!strcmp(a, "--group-score")) {
            o->group_score_set = true;
            if (!strcmp(v, "max"))
                o->group_score = MOECL_GROUP_SCORE_MAX;
            else if (!strcmp(v, "top2sum"))
                o->group_score = MOECL_GROUP_SCORE_TOP2_SUM;
            else
                return bad_usage("--group-score is max or top2sum, not '%s'", v);
        } else if (!strcmp(a, "--group-fill")) {
            o->group_fill_set = true;
            if (!strcmp(v, "neg-inf"))
                o->group_fill = MOECL_GROUP_FILL_NEG_INF;
            else if (!strcmp(v, "zero"))
                o->group_fill = MOECL_GROUP_FILL_ZERO;
            else
                return bad_usage("--group-fill is neg-inf or zero, not '%s'", v);
        } else if (!strcmp(a, "--renormalize-floor") || !strcmp(a, "--renormalize-eps")) {
            const bool eps = !strcmp(a, "--renormalize-eps");
            float *f = eps ? &o->renormalize_eps : &o->renormalize_floor;
            if (parse_float(a, v, f) >= 0)
                return 2;
            /* The library's rule, said here with the value's own words. */
            if (*f < 0.0f || (*f > 0.0f && *f < FLT_MIN)) {
                char rule[160];
                snprintf(rule, sizeof(rule),
                         "%s is 0 or at least 2^-126 (1.17549435e-38, the smallest normal float), not '%%s'%s", a,
                         *f < 0.0f ? "" : ", a subnormal float");
                return bad_usage(rule, v);
            }
            *(eps ? &o->eps_set : &o->floor_set) = true;
        } else if (!strcmp(a, "--scoring")) {
            o->scoring_set = true;
            if (!strcmp(v, "softmax"))
                o->scoring = MOECL_SCORING_SOFTMAX;
            else if (!strcmp(v, "sigmoid"))
                o->scoring = MOECL_SCORING_SIGMOID;
            else
                return bad_usage("--scoring is softmax or sigmoid, not '%s'", v);
        } else if (!strcmp(a, "--scale")) {
            if (parse_float(a, v, &o->scale) >= 0)
                return 2;
            o->scale_set = true;
        } else if (!strcmp(a, "--alpha")) {
            if (parse_float(a, v, &o->alpha) >= 0)
                return 2;
            o->alpha_set = true;
        } else if (!strcmp(a, "--chunk-rows")) {
            if (!parse_long(v, 1, 1L << 30, &n))
                return bad_usage("--chunk-rows is 1..2^30, not '%s'", v);
            o->chunk_rows = n;
        }
    }
    if (o->demo) {
        if (optind < argc || o->logits || o->hidden || o->ground || o->bias || o->ids_in || o->op || o->top_k ||
            o->groups || o->topk_group || o->experts || o->block_size || o->group_score_set || o->group_fill_set ||
            o->scoring_set || o->renormalize || o->floor_set || o->eps_set || o->scale_set || o->alpha_set || o->bf16 ||
            o->json || o->device || o->chunk_rows || o->progress || o->no_progress || o->all_experts || o->preset ||
            o->shared_experts || o->shared_weight_set || o->expert_map)
            return bad_usage("%s", "--demo DIR writes example inputs and takes no other option");
        for (int i = 0; i < NUM_OUT; i++)
            if (o->out[i])
                return bad_usage("%s", "--demo DIR writes example inputs and takes no other option");
        return -1;
    }
    for (; optind < argc; optind++) {
        if (o->logits)
            return bad_usage("one logits file only (got a second: %s)", argv[optind]);
        o->logits = argv[optind];
    }
    if (o->op == OP_ALIGN) {
        if (!o->ids_in || !o->experts)
            return bad_usage("%s", "--op align needs --ids-in and --experts");
        if (o->logits || o->hidden || o->ground || o->bias || o->top_k || o->groups || o->topk_group ||
            o->group_score_set || o->group_fill_set || o->scoring_set || o->renormalize || o->floor_set ||
            o->eps_set || o->scale_set || o->alpha_set || o->bf16 || o->preset)
            return bad_usage("%s", "--op align reads --ids-in only: no logits, hidden states, ground rows, bias, "
                                   "--top-k (the ids file's width) or routing options");
        for (int i = 0; i < FIRST_DISPATCH_OUT; i++)
            if (o->out[i])
                return bad_usage("%s routes nothing to write with --op align; its outputs are the dispatch ones",
                                 out_flag[i]);
    } else if (o->ids_in || o->experts) {
        return bad_usage("%s", "--ids-in and --experts belong to --op align");
    }
    if (!o->logits && o->op != OP_ALIGN)
        return bad_usage("%s", o->op == OP_TOPK ? "no logits file (moecl-route LOGITS.npy ...)"
                                                : "--op grounded needs --hidden, --logits and --ground");
    if (o->op == OP_ALIGN && (o->shared_experts || o->shared_weight_set))
        return bad_usage("%s", "--shared-experts and --shared-weight belong to --op topk and --op grounded");
    if (o->shared_weight_set && !o->shared_experts)
        return bad_usage("%s", "--shared-weight needs --shared-experts");
    if (o->shared_experts && o->expert_map)
        return bad_usage("%s", "--shared-experts and --expert-map do not go together: the map covers the "
                               "routed experts only");
    if (o->op == OP_TOPK) {
        if (o->hidden || o->ground || o->alpha_set)
            return bad_usage("%s", "--hidden, --ground and --alpha belong to --op grounded");
        if (!o->groups != !o->topk_group)
            return bad_usage("%s", "--groups and --topk-group come together");
        if (o->group_score_set && !o->groups)
            return bad_usage("%s", "--group-score needs --groups and --topk-group");
        if (o->group_fill_set && !o->groups)
            return bad_usage("%s", "--group-fill needs --groups and --topk-group");
        if (o->floor_set && !o->renormalize)
            return bad_usage("%s", "--renormalize-floor needs --renormalize");
        if (o->eps_set && !o->renormalize)
            return bad_usage("%s", "--renormalize-eps needs --renormalize");
        if (o->eps_set && o->floor_set && o->renormalize_eps > 0.0f && o->renormalize_floor > 0.0f)
            return bad_usage("%s", "--renormalize-floor and --renormalize-eps are two rules; give one");
        /* A preset is the whole routing: an option beside it would leave
         * which of the two was meant to the order of the words. */
        const char *conflict = !o->preset           ? NULL
                               : o->top_k           ? "--top-k"
                               : o->scoring_set     ? "--scoring"
                               : o->groups          ? "--groups"
                               : o->topk_group      ? "--topk-group"
                               : o->group_score_set ? "--group-score"
                               : o->group_fill_set  ? "--group-fill"
                               : o->renormalize     ? "--renormalize"
                               : o->floor_set       ? "--renormalize-floor"
                               : o->eps_set         ? "--renormalize-eps"
                               : o->scale_set       ? "--scale"
                                                    : NULL;
        if (conflict) {
            fprintf(stderr, "moecl-route: --preset %s sets the routing; %s beside it is refused\n", o->preset,
                    conflict);
            try_help(stderr);
            return 2;
        }
    } else if (o->op == OP_GROUNDED) {
        if (!o->hidden || !o->ground)
            return bad_usage("%s", "--op grounded needs --hidden, --logits and --ground");
        if (o->bias || o->groups || o->topk_group || o->group_score_set || o->group_fill_set || o->scoring_set ||
            o->renormalize || o->floor_set || o->eps_set || o->scale_set || o->preset)
            return bad_usage("%s", "--bias, --groups, --topk-group, --group-score, --group-fill, --scoring, "
                                   "--renormalize, --renormalize-floor, --renormalize-eps, --scale and --preset "
                                   "belong to --op topk");
    }
    if (o->expert_map && !wants_dispatch(o))
        return bad_usage("%s", "--expert-map is moe_align's: it needs a dispatch output, --block-size or --op align");
    for (int a = 0; a < NUM_OUT; a++)
        for (int b = a + 1; b < NUM_OUT; b++)
            if (o->out[a] && o->out[b] && !strcmp(o->out[a], o->out[b]))
                return bad_usage("two outputs to one file: %s", o->out[a]);
    return -1;
}

/* ---- inputs ---- */

/* The moecl dtype of a floating-point input, or -1 with a message. */
static int input_dtype(const npy_file *n, const options *o, bool f32_only, moecl_dtype *t, char *err, size_t size)
{
    if (n->kind == NPY_F32) {
        *t = MOECL_F32;
        return 0;
    }
    if (f32_only) {
        snprintf(err, size, "%s: unsupported dtype %s: this input is float32 ('<f4') only", n->path,
                 npy_kind_name(n->kind));
        return -1;
    }
    if (n->kind == NPY_F16) {
        *t = MOECL_F16;
        return 0;
    }
    if (n->kind == NPY_U2 || n->kind == NPY_V2) {
        if (o->bf16) {
            *t = MOECL_BF16;
            return 0;
        }
        snprintf(err, size, "%s: dtype %s is not a float: pass --bf16 if it holds bfloat16 bit patterns", n->path,
                 npy_kind_name(n->kind));
        return -1;
    }
    snprintf(err, size, "%s: unsupported dtype %s; moecl-route reads '<f4', '<f2', and bfloat16 as '<u2' or '|V2'",
             n->path, npy_kind_name(n->kind));
    return -1;
}

/* dims names the two axes: "tokens][experts" and the like. */
static int need_2d(const npy_file *n, const char *what, const char *dims, char *err, size_t size)
{
    if (n->ndim == 2)
        return 0;
    snprintf(err, size, "%s: %s must be 2-D [%s], the file is %d-D", n->path, what, dims, n->ndim);
    return -1;
}

static const char *dtype_name(moecl_dtype t)
{
    return t == MOECL_F32 ? "f32" : t == MOECL_F16 ? "f16" : "bf16";
}

/* ---- the summary ---- */

typedef struct summary {
    uint64_t tokens, chunks, chunk_rows;
    uint32_t experts, top_k;
    uint64_t *load;
    uint64_t invalid; /* slots whose id is outside [0, experts) (--op align) */
    double wall_s, read_s, write_s, prepare_s, kernel_s, transfer_s;
    bool device_time;
    bool ids_i64; /* --op align read int64 ids */
    char device[512];
    /* moe_align, when the run asked for it */
    bool dispatch;
    uint32_t block_size;
    uint64_t max_padded;
    int32_t post_padded, num_invalid;
    double align_s;
} summary;

static int cmp_load_desc(const void *pa, const void *pb, const uint64_t *load)
{
    const uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
    if (load[a] != load[b])
        return load[a] < load[b] ? 1 : -1;
    return (a > b) - (a < b);
}

static const uint64_t *sort_load; /* qsort has no context argument in C11 */

static int cmp_by_load(const void *pa, const void *pb)
{
    return cmp_load_desc(pa, pb, sort_load);
}

static void bar_line(uint32_t e, uint64_t v, uint64_t max, uint64_t slots)
{
    const int width = 40;
    int n = max ? (int)((v * (uint64_t)width + max / 2) / max) : 0;
    if (v && !n)
        n = 1;
    char bar[64];
    memset(bar, '#', (size_t)n);
    memset(bar + n, ' ', (size_t)(width - n));
    bar[width] = '\0';
    printf("  expert %4u |%s| %10llu  %5.2f%%\n", e, bar, (unsigned long long)v,
           slots ? 100.0 * (double)v / (double)slots : 0.0);
}

static void print_text(const summary *s, const options *o, const char *what)
{
    const uint64_t slots = s->tokens * s->top_k - s->invalid;
    printf("moecl-route: %s\n", what);
    printf("device: %s\n", s->device);
    printf("tokens routed: %llu (%llu expert slots) in %llu chunk%s of up to %llu rows\n",
           (unsigned long long)s->tokens, (unsigned long long)(s->tokens * s->top_k), (unsigned long long)s->chunks,
           s->chunks == 1 ? "" : "s", (unsigned long long)s->chunk_rows);
    printf("time: wall %.3f s (read %.3f s, write %.3f s, kernel build/load %.3f s", s->wall_s, s->read_s, s->write_s,
           s->prepare_s);
    if (s->dispatch)
        printf(", moe_align %.3f s", s->align_s);
    if (s->device_time)
        printf("; device: kernels %.3f s, transfers %.3f s", s->kernel_s, s->transfer_s);
    printf(")");
    if (s->device_time && s->kernel_s > 0)
        printf("; %.2f Mtokens/s in the kernels", (double)s->tokens / s->kernel_s / 1e6);
    printf("\n");
    if (s->dispatch)
        printf("dispatch (moe_align, block size %u): num_tokens_post_padded %d of max_padded %llu (%d of %llu "
               "blocks used), num_invalid %d\n",
               s->block_size, s->post_padded, (unsigned long long)s->max_padded, s->post_padded / (int)s->block_size,
               (unsigned long long)(s->max_padded / s->block_size), s->num_invalid);

    const uint32_t e = s->experts;
    uint64_t max = 0, min = UINT64_MAX, idle = 0;
    uint32_t emax = 0, emin = 0;
    for (uint32_t i = 0; i < e; i++) {
        if (s->load[i] > max)
            max = s->load[i], emax = i;
        if (s->load[i] < min)
            min = s->load[i], emin = i;
        idle += s->load[i] == 0;
    }
    const double mean = (double)slots / e;
    double var = 0;
    for (uint32_t i = 0; i < e; i++)
        var += ((double)s->load[i] - mean) * ((double)s->load[i] - mean);
    printf("expert load (tokens routed to each expert): mean %.1f, min %llu (expert %u), max %llu (expert %u), "
           "max/mean %.2f, stddev/mean %.2f, %llu idle\n",
           mean, (unsigned long long)min, emin, (unsigned long long)max, emax, mean > 0 ? max / mean : 0.0,
           mean > 0 ? sqrt(var / e) / mean : 0.0, (unsigned long long)idle);
    if (e <= 32 || o->all_experts) {
        for (uint32_t i = 0; i < e; i++)
            bar_line(i, s->load[i], max, slots);
        return;
    }
    /* Many experts: the busiest and the idlest eight, and how many experts
     * fall in each band of load relative to the mean. */
    uint32_t *order = malloc(sizeof(uint32_t) * e);
    if (!order)
        return;
    for (uint32_t i = 0; i < e; i++)
        order[i] = i;
    sort_load = s->load;
    qsort(order, e, sizeof(uint32_t), cmp_by_load);
    printf(" busiest 8:\n");
    for (uint32_t i = 0; i < 8; i++)
        bar_line(order[i], s->load[order[i]], max, slots);
    printf(" idlest 8:\n");
    for (uint32_t i = e - 8; i < e; i++)
        bar_line(order[i], s->load[order[i]], max, slots);
    free(order);
    static const char *const band[8] = {"0 (idle)",           "(0, 0.5) x mean",     "[0.5, 0.8) x mean",
                                        "[0.8, 0.95) x mean", "[0.95, 1.05] x mean", "(1.05, 1.25) x mean",
                                        "[1.25, 2) x mean",   ">= 2 x mean"};
    uint64_t count[8] = {0};
    for (uint32_t i = 0; i < e; i++) {
        const double r = mean > 0 ? (double)s->load[i] / mean : 0;
        int b;
        if (s->load[i] == 0)
            b = 0;
        else if (r < 0.5)
            b = 1;
        else if (r < 0.8)
            b = 2;
        else if (r < 0.95)
            b = 3;
        else if (r <= 1.05)
            b = 4;
        else if (r < 1.25)
            b = 5;
        else if (r < 2)
            b = 6;
        else
            b = 7;
        count[b]++;
    }
    uint64_t cmax = 0;
    for (int b = 0; b < 8; b++)
        cmax = count[b] > cmax ? count[b] : cmax;
    printf(" experts by load (%u experts; --all-experts lists each):\n", e);
    for (int b = 0; b < 8; b++) {
        const int width = 40;
        int n = cmax ? (int)((count[b] * (uint64_t)width + cmax / 2) / cmax) : 0;
        if (count[b] && !n)
            n = 1;
        char bar[64];
        memset(bar, '#', (size_t)n);
        memset(bar + n, ' ', (size_t)(width - n));
        bar[width] = '\0';
        printf("  %-20s |%s| %6llu\n", band[b], bar, (unsigned long long)count[b]);
    }
}

/* f as the shortest decimal that reads back as f, so that 1e-20f is
 * written 1e-20 and not 9.9999996826552254e-21. */
static double float_value(float f)
{
    char text[32];
    for (int digits = 1; digits < 9; digits++) {
        snprintf(text, sizeof(text), "%.*g", digits, (double)f);
        if (strtof(text, NULL) == f)
            return strtod(text, NULL);
    }
    return f;
}

static const char *scoring_name(moecl_scoring s)
{
    return s == MOECL_SCORING_SIGMOID        ? "sigmoid"
           : s == MOECL_SCORING_SQRTSOFTPLUS ? "sqrtsoftplus"
           : s == MOECL_SCORING_RAW          ? "raw"
                                             : "softmax";
}

static const char *weighting_name(moecl_weighting w)
{
    return w == MOECL_WEIGHTS_SOFTMAX_CHOSEN   ? "softmax-chosen"
           : w == MOECL_WEIGHTS_SIGMOID_CHOSEN ? "sigmoid-chosen"
                                               : "score";
}

/* One JSON object: what ran, where and how long, and the load. */
static bool print_json(const summary *s, const options *o, const moecl_topk_gating_desc *t,
                       const moecl_grounded_router_desc *g, moecl_dtype dtype)
{
    cJSON *j = cJSON_CreateObject();
    tool_json_add_string(j, "op", o->op == OP_TOPK ? "topk" : o->op == OP_GROUNDED ? "grounded" : "align");
    tool_json_add_string(j, "dtype", o->op == OP_ALIGN ? (s->ids_i64 ? "i64" : "i32") : dtype_name(dtype));
    tool_json_add_number(j, "tokens", (double)s->tokens);
    tool_json_add_number(j, "experts", s->experts);
    tool_json_add_number(j, "top_k", s->top_k);
    if (o->op == OP_TOPK) {
        cJSON_AddItemToObject(j, "preset", o->preset ? cJSON_CreateString(o->preset) : cJSON_CreateNull());
        tool_json_add_string(j, "scoring", scoring_name(t->scoring));
        tool_json_add_string(j, "weighting", weighting_name(t->weighting));
        tool_json_add_bool(j, "bias", o->bias);
        tool_json_add_number(j, "groups", t->num_expert_groups);
        tool_json_add_number(j, "topk_group", t->topk_group);
        tool_json_add_string(j, "group_score", t->group_score == MOECL_GROUP_SCORE_TOP2_SUM ? "top2sum" : "max");
        tool_json_add_string(j, "group_fill", t->group_fill == MOECL_GROUP_FILL_ZERO ? "zero" : "neg-inf");
        tool_json_add_bool(j, "renormalize", t->renormalize);
        tool_json_add_number(j, "renormalize_floor", float_value(t->renormalize_floor));
        tool_json_add_number(j, "renormalize_eps", float_value(t->renormalize_eps));
        tool_json_add_number(j, "scale", float_value(t->routed_scaling_factor));
    } else if (o->op == OP_GROUNDED) {
        tool_json_add_number(j, "hidden", g->hidden_dim);
        tool_json_add_number(j, "alpha", float_value(g->alpha));
    }
    const char *dispatch[] = {"block_size", "max_padded", "num_tokens_post_padded", "num_invalid", "align_s"};
    const double values[] = {s->block_size, (double)s->max_padded, s->post_padded, s->num_invalid, s->align_s};
    for (int i = 0; i < 5; i++)
        cJSON_AddItemToObject(j, dispatch[i], s->dispatch ? cJSON_CreateNumber(values[i]) : cJSON_CreateNull());
    tool_json_add_string(j, "device", s->device);
    tool_json_add_number(j, "chunks", (double)s->chunks);
    tool_json_add_number(j, "chunk_rows", (double)s->chunk_rows);
    tool_json_add_number(j, "wall_s", s->wall_s);
    tool_json_add_number(j, "read_s", s->read_s);
    tool_json_add_number(j, "write_s", s->write_s);
    tool_json_add_number(j, "prepare_s", s->prepare_s);
    cJSON_AddItemToObject(j, "kernel_s", s->device_time ? cJSON_CreateNumber(s->kernel_s) : cJSON_CreateNull());
    cJSON_AddItemToObject(j, "transfer_s", s->device_time ? cJSON_CreateNumber(s->transfer_s) : cJSON_CreateNull());
    cJSON *load = cJSON_CreateArray();
    for (uint32_t i = 0; i < s->experts; i++)
        cJSON_AddItemToArray(load, cJSON_CreateNumber((double)s->load[i]));
    cJSON_AddItemToObject(j, "load", load);
    const bool ok = tool_json_write(stdout, j);
    cJSON_Delete(j);
    return ok;
}

/* Each valid id's expert gains a slot; the others are counted invalid. */
static void count_load(summary *s, const int32_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= 0 && (uint32_t)ids[i] < s->experts)
            s->load[ids[i]]++;
        else
            s->invalid++;
    }
}

/* A chunk of rows is done: count it, and show the progress line. */
static void end_chunk(summary *s, uint64_t rows, uint64_t tokens, bool progress, double t0)
{
    s->tokens += rows;
    s->chunks++;
    if (progress)
        fprintf(stderr, "\rmoecl-route: %llu / %llu rows (%.0f%%), %.1f s ", (unsigned long long)s->tokens,
                (unsigned long long)tokens, 100.0 * (double)s->tokens / (double)tokens, now_s() - t0);
}

/* ---- device ---- */

static double event_s(cl_event ev)
{
    cl_ulong start = 0, end = 0;
    if (clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_START, sizeof(start), &start, NULL) != CL_SUCCESS ||
        clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_END, sizeof(end), &end, NULL) != CL_SUCCESS)
        return 0;
    return end > start ? (double)(end - start) / 1e9 : 0;
}

/* A context on a profiling queue when the device allows one (device time
 * is then read from events, which costs nothing), else a plain one. */
static moecl_status make_context(const char *device, moecl_context **out, bool *profiling, char *name, size_t size)
{
    moecl_context *plain;
    moecl_status st = moecl_context_create(device, &plain);
    if (st != MOECL_SUCCESS)
        return st;
    cl_context cl = moecl_context_cl_context(plain);
    cl_device_id dev = moecl_context_device(plain);
    char pname[256] = "", dname[256] = "";
    cl_platform_id platform;
    if (clGetDeviceInfo(dev, CL_DEVICE_PLATFORM, sizeof(platform), &platform, NULL) == CL_SUCCESS)
        clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof(pname), pname, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof(dname), dname, NULL);
    snprintf(name, size, "%s / %s", pname, dname);
    cl_int err;
    cl_command_queue q = clCreateCommandQueue(cl, dev, CL_QUEUE_PROFILING_ENABLE, &err);
    moecl_context *prof = NULL;
    if (q && moecl_context_create_from_cl(cl, dev, q, &prof) == MOECL_SUCCESS) {
        moecl_context_destroy(plain);
        *out = prof;
        *profiling = true;
    } else {
        *out = plain;
        *profiling = false;
    }
    if (q)
        clReleaseCommandQueue(q);
    return MOECL_SUCCESS;
}

static cl_mem device_buffer(moecl_context *ctx, size_t size, const void *data, char *err, size_t err_size)
{
    cl_int e;
    cl_mem m = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE | (data ? CL_MEM_COPY_HOST_PTR : 0),
                              size ? size : 4, (void *)data, &e);
    if (!m)
        snprintf(err, err_size, "cannot allocate %zu bytes on the device (OpenCL error %d; a smaller --chunk-rows "
                                "may help)", size, e);
    return m;
}

/* ---- outputs ---- */

/* Every output path must be a file or not yet exist: a folder (or a
 * device, a pipe) at one would fail its rename after the others had
 * succeeded. 0, or -1 with a message. */
static int check_targets(const char *const *paths, int count, char *err, size_t size)
{
    for (int i = 0; i < count; i++) {
        struct stat st;
        if (!paths[i] || stat(paths[i], &st))
            continue;
        if (!S_ISREG(st.st_mode)) {
            snprintf(err, size, "%s %s; an output is written as a file (nothing was written)", paths[i],
                     S_ISDIR(st.st_mode) ? "is a folder" : "exists and is not a file");
            return -1;
        }
    }
    return 0;
}

/* Renames every finished output into place. If one fails (its folder
 * changed since the checks), the ones renamed before it are removed again
 * and named, so that no output of the run remains. */
static int commit_outputs(const char *const *paths, char *err, size_t size)
{
    for (int i = 0; i < NUM_OUT; i++)
        if (paths[i] && npy_writer_finish(&writers[i], err, size))
            return -1;
    for (int i = 0; i < NUM_OUT; i++) {
        if (!paths[i])
            continue;
        if (npy_writer_commit(&writers[i], err, size)) {
            for (int j = 0; j < i; j++)
                if (paths[j] && !unlink(paths[j]))
                    fprintf(stderr, "moecl-route: note: removed %s, renamed into place before the failure (the file "
                                    "it replaced is lost)\n", paths[j]);
            pending_tmp[i] = NULL;
            return -1;
        }
        pending_tmp[i] = NULL;
    }
    return 0;
}

/* ---- --demo: example inputs ---- */

/* splitmix64: a fixed seed, so that every machine writes the same files. */
static uint64_t demo_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float demo_normal(uint64_t *s)
{
    const double u1 = ((double)(demo_next(s) >> 11) + 1.0) / 9007199254740993.0,
                 u2 = (double)(demo_next(s) >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* DIR/logits.npy: standard normal logits plus a popularity per expert
 * (standard deviation 0.3), so that the load is uneven as a real router's
 * is; DIR/bias.npy: a correction bias against that popularity, as a
 * DeepSeek-V3 router's e_score_correction_bias. */
static int write_demo(const char *dir)
{
    enum { TOKENS = 4096, EXPERTS = 256 };
    char paths[2][4096], err[1024];
    const char *names[2] = {"logits.npy", "bias.npy"};
    for (int i = 0; i < 2; i++) {
        if (snprintf(paths[i], sizeof(paths[i]), "%s/%s", dir, names[i]) >= (int)sizeof(paths[i])) {
            fprintf(stderr, "moecl-route: --demo %s: the path is too long\n", dir);
            return 1;
        }
        struct stat st;
        if (!stat(paths[i], &st)) {
            fprintf(stderr, "moecl-route: %s exists; --demo writes no file over another (remove it, or name "
                            "another folder)\n", paths[i]);
            return 1;
        }
    }
    float pop[EXPERTS], bias[EXPERTS], *logits = malloc(sizeof(float) * TOKENS * EXPERTS);
    if (!logits) {
        fprintf(stderr, "moecl-route: out of host memory\n");
        return 1;
    }
    uint64_t seed = 20261205;
    for (int e = 0; e < EXPERTS; e++) {
        pop[e] = 0.3f * demo_normal(&seed);
        bias[e] = -0.05f * pop[e];
    }
    for (size_t i = 0; i < (size_t)TOKENS * EXPERTS; i++)
        logits[i] = demo_normal(&seed) + pop[i % EXPERTS];
    const uint64_t shape_l[2] = {TOKENS, EXPERTS}, shape_b[1] = {EXPERTS};
    const void *data[2] = {logits, bias};
    const size_t bytes[2] = {sizeof(float) * TOKENS * EXPERTS, sizeof(bias)};
    int rc = 0;
    for (int i = 0; i < 2 && !rc; i++)
        rc = npy_writer_open(&writers[i], paths[i], "<f4", 2 - i, i ? shape_b : shape_l, err, sizeof(err)) ||
             npy_writer_write(&writers[i], data[i], bytes[i], err, sizeof(err));
    const char *const out[NUM_OUT] = {paths[0], paths[1]};
    if (!rc)
        rc = commit_outputs(out, err, sizeof(err));
    free(logits);
    if (rc)
        return fail_run(err);
    printf("wrote %s (float32 [%d][%d]: standard normal logits, some experts favoured) and %s (float32 [%d]: a "
           "correction bias against that)\n",
           paths[0], TOKENS, EXPERTS, paths[1], EXPERTS);
    return 0;
}

/* ---- main ---- */

enum { IN_LOGITS, IN_HIDDEN, IN_GROUND, IN_BIAS, IN_IDS, IN_MAP, NUM_IN };

/* --expert-map: int32 [G], read whole into *map. With --op align, G is
 * the ids' range and `experts` (--experts) the local ones; otherwise G
 * must be the routed experts and the local ones are 0..max(map). 0, or -1
 * with a message. */
static int read_expert_map(npy_file *n, op_kind op, uint32_t experts, int32_t **map, uint32_t *num_global,
                           uint32_t *num_local, char *err, size_t size)
{
    if (n->ndim != 1 || n->kind != NPY_I32 || n->shape[0] < 1 || n->shape[0] > 4096) {
        snprintf(err, size, "%s: the expert map must be int32 ('<i4') of shape [G], 1 <= G <= 4096", n->path);
        return -1;
    }
    const uint32_t g = (uint32_t)n->shape[0];
    if (op != OP_ALIGN && g != experts) {
        snprintf(err, size, "%s: the expert map has %u entries; it must have one per routed expert (%u)", n->path, g,
                 experts);
        return -1;
    }
    if (!(*map = malloc((size_t)g * 4))) {
        snprintf(err, size, "%s: out of host memory", n->path);
        return -1;
    }
    if (npy_read_rows(n, *map, g, err, size))
        return -1;
    int32_t top = -1;
    for (uint32_t i = 0; i < g; i++)
        top = (*map)[i] > top ? (*map)[i] : top;
    if (op != OP_ALIGN && top < 0) {
        snprintf(err, size, "%s: the expert map has no local expert (every entry is negative)", n->path);
        return -1;
    }
    *num_global = g;
    *num_local = op == OP_ALIGN ? experts : (uint32_t)top + 1;
    return 0;
}

int main(int argc, char **argv)
{
    options o;
    int32_t *emap = NULL; /* --expert-map's entries */
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;
    if (o.demo)
        return write_demo(o.demo);
    const double t0 = now_s();
    char err[1024];
    if (check_targets(o.out, NUM_OUT, err, sizeof(err)))
        return fail_run(err);
    npy_file in[NUM_IN];
    memset(in, 0, sizeof(in));
    const char *paths[NUM_IN] = {o.logits, o.hidden, o.ground, o.bias, o.ids_in, o.expert_map};
    for (int i = 0; i < NUM_IN; i++)
        if (paths[i] && npy_open(&in[i], paths[i], err, sizeof(err)))
            goto file_error;

    /* Shapes and dtypes. */
    moecl_topk_gating_desc td;
    moecl_grounded_router_desc gd;
    moecl_dtype dtype = MOECL_F32;
    bool ids_i64 = false;
    uint64_t tokens;
    uint32_t experts, top_k;
    memset(&td, 0, sizeof(td));
    memset(&gd, 0, sizeof(gd));
    if (o.op == OP_TOPK) {
        const npy_file *l = &in[IN_LOGITS];
        if (need_2d(l, "the logits", "tokens][experts", err, sizeof(err)) ||
            input_dtype(l, &o, false, &dtype, err, sizeof(err)))
            goto file_error;
        if (l->shape[1] < 1 || l->shape[1] > 4096 || l->shape[0] > UINT32_MAX) {
            snprintf(err, sizeof(err), "%s: %llu tokens x %llu experts: moecl routes 1..4096 experts and at most "
                                       "2^32-1 tokens", l->path, (unsigned long long)l->shape[0],
                     (unsigned long long)l->shape[1]);
            goto file_error;
        }
        tokens = l->shape[0];
        experts = (uint32_t)l->shape[1];
        if (o.bias) {
            const npy_file *b = &in[IN_BIAS];
            moecl_dtype bt;
            if (input_dtype(b, &o, true, &bt, err, sizeof(err)))
                goto file_error;
            if (b->ndim != 1 || b->shape[0] != experts) {
                char shape[64] = "";
                for (int d = 0, n = 0; d < b->ndim && n < (int)sizeof(shape) - 24; d++)
                    n += snprintf(shape + n, sizeof(shape) - (size_t)n, "%s%llu", d ? ", " : "",
                                  (unsigned long long)b->shape[d]);
                snprintf(err, sizeof(err), "%s: the bias has shape (%s); it must be [%u], one per expert of %s",
                         b->path, shape, experts, l->path);
                goto file_error;
            }
        }
        if (o.preset) {
            moecl_topk_gating_desc_preset(o.preset, (uint32_t)tokens, &td); /* the name was checked */
            if (td.num_experts != experts) {
                fprintf(stderr, "moecl-route: --preset %s routes %u experts; %s has %u\nTry "
                                "'moecl-route --help'.\n", o.preset, td.num_experts, l->path, experts);
                for (int i = 0; i < NUM_IN; i++)
                    npy_close(&in[i]);
                return 2;
            }
            top_k = td.top_k;
        } else {
            top_k = o.top_k ? (uint32_t)o.top_k : experts < 8 ? experts : 8;
            td = moecl_topk_gating_desc_init((uint32_t)tokens, experts, top_k);
            td.scoring = o.scoring;
            td.num_expert_groups = (uint32_t)o.groups;
            td.topk_group = (uint32_t)o.topk_group;
            td.group_score = o.group_score;
            td.renormalize = o.renormalize;
            td.routed_scaling_factor = o.scale_set ? o.scale : 1.0f;
            td.group_fill = o.group_fill;
            td.renormalize_floor = o.renormalize_floor;
            td.renormalize_eps = o.renormalize_eps;
        }
        td.gating_dtype = dtype;
        td.num_shared_experts = (uint32_t)o.shared_experts;
        td.shared_expert_weight = o.shared_weight_set ? o.shared_weight : 1.0f;
    } else if (o.op == OP_GROUNDED) {
        const npy_file *h = &in[IN_HIDDEN], *l = &in[IN_LOGITS], *g = &in[IN_GROUND];
        moecl_dtype lt, gt;
        if (need_2d(h, "the hidden states", "tokens][hidden", err, sizeof(err)) ||
            need_2d(l, "the router logits", "tokens][experts", err, sizeof(err)) ||
            need_2d(g, "the ground rows", "experts][hidden", err, sizeof(err)) ||
            input_dtype(h, &o, false, &dtype, err, sizeof(err)) || input_dtype(l, &o, true, &lt, err, sizeof(err)) ||
            input_dtype(g, &o, false, &gt, err, sizeof(err)))
            goto file_error;
        if (gt != dtype) {
            snprintf(err, sizeof(err), "%s: the ground rows are %s but the hidden states (%s) are %s; both must have "
                                       "one dtype", g->path, dtype_name(gt), h->path, dtype_name(dtype));
            goto file_error;
        }
        if (h->shape[0] != l->shape[0]) {
            snprintf(err, sizeof(err), "%s: %llu rows of router logits, but %s has %llu rows of hidden states; one "
                                       "row per token in both", l->path, (unsigned long long)l->shape[0], h->path,
                     (unsigned long long)h->shape[0]);
            goto file_error;
        }
        if (g->shape[0] != l->shape[1]) {
            snprintf(err, sizeof(err), "%s: %llu ground rows (experts), but %s has %llu logits per token (experts)",
                     g->path, (unsigned long long)g->shape[0], l->path, (unsigned long long)l->shape[1]);
            goto file_error;
        }
        if (g->shape[1] != h->shape[1]) {
            snprintf(err, sizeof(err), "%s: ground rows of %llu values, but %s has hidden states of %llu; they must "
                                       "match", g->path, (unsigned long long)g->shape[1], h->path,
                     (unsigned long long)h->shape[1]);
            goto file_error;
        }
        if (l->shape[1] < 1 || l->shape[1] > 4096 || h->shape[1] < 1 || h->shape[1] > 65536 ||
            l->shape[0] > UINT32_MAX) {
            snprintf(err, sizeof(err), "%s: %llu tokens x hidden %llu x %llu experts: moecl routes 1..4096 experts, "
                                       "hidden 1..65536, at most 2^32-1 tokens", h->path,
                     (unsigned long long)h->shape[0], (unsigned long long)h->shape[1], (unsigned long long)l->shape[1]);
            goto file_error;
        }
        tokens = l->shape[0];
        experts = (uint32_t)l->shape[1];
        top_k = o.top_k ? (uint32_t)o.top_k : experts < 2 ? experts : 2;
        gd = moecl_grounded_router_desc_init((uint32_t)tokens, (uint32_t)h->shape[1], experts,
                                             o.alpha_set ? o.alpha : 1.0f);
        gd.top_k = top_k;
        gd.hidden_dtype = dtype;
        gd.num_shared_experts = (uint32_t)o.shared_experts;
        gd.shared_expert_weight = o.shared_weight_set ? o.shared_weight : 1.0f;
    } else {
        const npy_file *n = &in[IN_IDS];
        if (need_2d(n, "the expert ids", "tokens][top_k", err, sizeof(err)))
            goto file_error;
        if (n->kind != NPY_I32 && n->kind != NPY_I64) {
            snprintf(err, sizeof(err), "%s: unsupported dtype %s: the expert ids are int32 ('<i4') or int64 ('<i8', "
                                       "converted to int32)", n->path, npy_kind_name(n->kind));
            goto file_error;
        }
        if (n->shape[1] < 1 || n->shape[1] > 64 || n->shape[0] > UINT32_MAX) {
            snprintf(err, sizeof(err), "%s: %llu tokens x %llu ids: moe_align takes 1..64 ids per token and at most "
                                       "2^32-1 tokens", n->path, (unsigned long long)n->shape[0],
                     (unsigned long long)n->shape[1]);
            goto file_error;
        }
        tokens = n->shape[0];
        experts = (uint32_t)o.experts;
        ids_i64 = n->kind == NPY_I64;
        top_k = (uint32_t)n->shape[1];
    }

    /* From here top_k is a row's slots and id_experts the ids' range: with
     * shared experts, top_k + S and experts + S (the logits' columns and
     * the bias stay experts). */
    const uint32_t shared = o.op == OP_GROUNDED ? gd.num_shared_experts : td.num_shared_experts;
    /* Refused here, before a device is opened: top_k's default (and a
     * preset's) depends on the file, so parse_args cannot tell. */
    if (top_k + shared > 64) {
        fprintf(stderr, "moecl-route: top_k %u and --shared-experts %u: a row holds top_k + num_shared_experts "
                        "slots, at most 64\nTry 'moecl-route --help'.\n", top_k, shared);
        for (int i = 0; i < NUM_IN; i++)
            npy_close(&in[i]);
        return 2;
    }
    const uint32_t id_experts = experts + shared;
    top_k += shared;
    /* With --expert-map, moe_align runs over the local experts; the load
     * summary stays over the ids' range. */
    uint32_t num_global = 0, align_experts = id_experts, routed_experts = id_experts;
    if (o.expert_map && read_expert_map(&in[IN_MAP], o.op, experts, &emap, &num_global, &align_experts, err,
                                        sizeof(err)))
        goto file_error;
    if (o.op == OP_ALIGN && emap)
        routed_experts = num_global;

    /* moe_align at the end: every position must fit in int32. */
    const bool dispatch = wants_dispatch(&o);
    moecl_moe_align_desc ad = moecl_moe_align_desc_init(
        (uint32_t)tokens, top_k, align_experts, o.block_size ? (uint32_t)o.block_size : DEFAULT_BLOCK_SIZE);
    ad.num_global_experts = num_global;
    const uint64_t max_padded = moecl_moe_align_max_padded(&ad);
    if (dispatch && max_padded > INT32_MAX) {
        fprintf(stderr, "moecl-route: %s: moe_align with block size %u needs %llu entries of sorted_token_ids "
                        "(%llu tokens x top_k %u + %u experts x %u padding), above its limit of 2^31-1 (every "
                        "position is an int32); use a smaller --block-size or fewer tokens a file\nTry 'moecl-route "
                        "--help'.\n",
                o.op == OP_ALIGN ? o.ids_in : o.op == OP_TOPK ? o.logits : o.hidden, ad.block_size,
                (unsigned long long)max_padded, (unsigned long long)tokens, top_k, align_experts, ad.block_size - 1);
        for (int i = 0; i < NUM_IN; i++)
            npy_close(&in[i]);
        return 2;
    }

    /* Chunks: about 64 MiB of input rows each. */
    size_t row_in = o.op == OP_ALIGN ? npy_row_bytes(&in[IN_IDS])
                                     : npy_row_bytes(&in[IN_LOGITS]) +
                                           (o.op == OP_GROUNDED ? npy_row_bytes(&in[IN_HIDDEN]) : 0);
    uint64_t chunk = o.chunk_rows ? (uint64_t)o.chunk_rows : ((uint64_t)64 << 20) / row_in;
    if (chunk < 1)
        chunk = 1;
    if (chunk > tokens)
        chunk = tokens ? tokens : 1;

    /* The device, and the options checked against the shapes. */
    summary s;
    memset(&s, 0, sizeof(s));
    s.experts = routed_experts;
    s.top_k = top_k;
    s.chunk_rows = chunk;
    s.dispatch = dispatch;
    s.block_size = ad.block_size;
    s.max_padded = max_padded;
    s.ids_i64 = ids_i64;
    moecl_context *ctx = NULL;
    moecl_status st = make_context(o.device, &ctx, &s.device_time, s.device, sizeof(s.device));
    if (st != MOECL_SUCCESS) {
        snprintf(err, sizeof(err), "no device: %s: %s", moecl_status_string(st), moecl_context_error(NULL));
        goto file_error;
    }
    if (o.op == OP_ALIGN)
        s.device_time = false; /* moe_align runs through its blocking host call: its wall time is the measure */
    const double p0 = now_s();
    st = o.op == OP_TOPK       ? moecl_topk_gating_prepare(ctx, &td)
         : o.op == OP_GROUNDED ? moecl_grounded_router_prepare(ctx, &gd)
                               : MOECL_SUCCESS;
    if (st == MOECL_SUCCESS && dispatch)
        st = moecl_moe_align_prepare(ctx, &ad);
    s.prepare_s = now_s() - p0;
    if (st == MOECL_ERROR_INVALID_ARGUMENT) {
        fprintf(stderr, "moecl-route: these options do not fit %s: %s\nTry 'moecl-route --help'.\n",
                o.op == OP_ALIGN ? o.ids_in : o.logits, moecl_context_error(ctx));
        moecl_context_destroy(ctx);
        for (int i = 0; i < NUM_IN; i++)
            npy_close(&in[i]);
        return 2;
    }
    if (st != MOECL_SUCCESS) {
        snprintf(err, sizeof(err), "cannot build the kernel: %s: %s", moecl_status_string(st),
                 moecl_context_error(ctx));
        goto ctx_error;
    }

    /* Outputs, as temporary files. */
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGHUP, on_signal);
    const char *const *out_paths = o.out;
    for (int i = 0; i < NUM_OUT; i++) {
        if (!out_paths[i])
            continue;
        const uint64_t pairs_shape[3] = {tokens, top_k, 2}, counts_shape[1] = {align_experts},
                       sorted_shape[1] = {max_padded}, blocks_shape[1] = {max_padded / ad.block_size},
                       post_shape[1] = {1};
        const uint64_t *shape = i == OUT_COUNTS   ? counts_shape
                                : i == OUT_SORTED ? sorted_shape
                                : i == OUT_BLOCKS ? blocks_shape
                                : i == OUT_POST   ? post_shape
                                                  : pairs_shape;
        const int ndim = i == OUT_PAIRS ? 3 : shape == pairs_shape ? 2 : 1;
        if (npy_writer_open(&writers[i], out_paths[i], i == OUT_WEIGHTS || i == OUT_PAIRS ? "<f4" : "<i4", ndim,
                            shape, err, sizeof(err)))
            goto ctx_error;
        pending_tmp[i] = writers[i].tmp;
    }

    /* Buffers for one chunk. */
    const size_t nk = (size_t)chunk * top_k;
    const size_t in_bytes[NUM_IN] = {
        o.op != OP_ALIGN ? (size_t)chunk * npy_row_bytes(&in[IN_LOGITS]) : 0,
        o.op == OP_GROUNDED ? (size_t)chunk * npy_row_bytes(&in[IN_HIDDEN]) : 0,
        o.op == OP_GROUNDED ? (size_t)in[IN_GROUND].count * in[IN_GROUND].elem_size : 0,
        o.bias ? (size_t)experts * 4 : 0,
    };
    void *host[NUM_IN] = {NULL};
    cl_mem dev[NUM_IN] = {NULL};
    float *h_w = malloc(nk * 4 + 4), *h_pairs = malloc(nk * 8 + 4);
    int32_t *h_ids = malloc(nk * 4 + 4);
    cl_mem d_w = NULL, d_ids = NULL, d_pairs = NULL;
    s.load = calloc(s.experts, sizeof(uint64_t));
    /* moe_align's input (the ids of every token) and outputs, whole. */
    const size_t slots = (size_t)tokens * top_k;
    int32_t *all_ids = NULL, *counts = NULL, *sorted = NULL, *blocks = NULL, *positions = NULL;
    if (!h_w || !h_pairs || !h_ids || !s.load) {
        snprintf(err, sizeof(err), "out of host memory for chunks of %llu rows (try --chunk-rows)",
                 (unsigned long long)chunk);
        goto run_error;
    }
    if (dispatch && (!(all_ids = malloc(slots * 4 + 4)) || !(counts = malloc((size_t)align_experts * 4)) ||
                     !(sorted = malloc((size_t)max_padded * 4 + 4)) ||
                     !(blocks = malloc((size_t)(max_padded / ad.block_size) * 4 + 4)) ||
                     (o.out[OUT_SLOTS] && !(positions = malloc(slots * 4 + 4))))) {
        snprintf(err, sizeof(err), "out of host memory for moe_align of %llu slots (%llu bytes of ids and as many "
                                   "of positions, %llu of sorted_token_ids)", (unsigned long long)slots,
                 (unsigned long long)slots * 4, (unsigned long long)max_padded * 4);
        goto run_error;
    }
    for (int i = 0; i < NUM_IN; i++) {
        if (!in_bytes[i])
            continue;
        if (!(host[i] = malloc(in_bytes[i]))) {
            snprintf(err, sizeof(err), "out of host memory for %s (try --chunk-rows)", paths[i]);
            goto run_error;
        }
        /* The ground rows and the bias are read once, whole. */
        if ((i == IN_GROUND || i == IN_BIAS) && npy_read_rows(&in[i], host[i], in[i].shape[0], err, sizeof(err)))
            goto run_error;
        if (!(dev[i] = device_buffer(ctx, in_bytes[i], i == IN_GROUND || i == IN_BIAS ? host[i] : NULL, err,
                                     sizeof(err))))
            goto run_error;
    }
    if (o.op != OP_ALIGN && (!(d_w = device_buffer(ctx, nk * 4, NULL, err, sizeof(err))) ||
                             !(d_ids = device_buffer(ctx, nk * 4, NULL, err, sizeof(err))) ||
                             (o.op == OP_GROUNDED && o.out[OUT_PAIRS] &&
                              !(d_pairs = device_buffer(ctx, nk * 8, NULL, err, sizeof(err))))))
        goto run_error;

    const bool progress = !o.no_progress && (o.progress || isatty(2));
    cl_command_queue q = moecl_context_queue(ctx);
    const moecl_buffer none = {NULL, 0};
    /* --op align: read the ids into all_ids, a chunk at a time. */
    for (uint64_t done = 0; o.op == OP_ALIGN && done < tokens; done += chunk) {
        const uint64_t rows = tokens - done < chunk ? tokens - done : chunk;
        const double r0 = now_s();
        if (npy_read_ids(&in[IN_IDS], all_ids + done * top_k, rows, err, sizeof(err)))
            goto run_error;
        s.read_s += now_s() - r0;
        count_load(&s, all_ids + done * top_k, rows * top_k);
        end_chunk(&s, rows, tokens, progress, t0);
    }
    for (uint64_t done = 0; o.op != OP_ALIGN && done < tokens; done += chunk) {
        const uint64_t rows = tokens - done < chunk ? tokens - done : chunk;
        double r0 = now_s();
        if (npy_read_rows(&in[IN_LOGITS], host[IN_LOGITS], rows, err, sizeof(err)) ||
            (o.op == OP_GROUNDED && npy_read_rows(&in[IN_HIDDEN], host[IN_HIDDEN], rows, err, sizeof(err))))
            goto run_error;
        s.read_s += now_s() - r0;
        cl_event ev[6] = {NULL};
        int nev = 0;
        cl_int ce = clEnqueueWriteBuffer(q, dev[IN_LOGITS], CL_FALSE, 0, rows * npy_row_bytes(&in[IN_LOGITS]),
                                         host[IN_LOGITS], 0, NULL, &ev[nev++]);
        if (ce == CL_SUCCESS && o.op == OP_GROUNDED)
            ce = clEnqueueWriteBuffer(q, dev[IN_HIDDEN], CL_FALSE, 0, rows * npy_row_bytes(&in[IN_HIDDEN]),
                                      host[IN_HIDDEN], 0, NULL, &ev[nev++]);
        if (ce != CL_SUCCESS) {
            snprintf(err, sizeof(err), "cannot copy a chunk to the device (OpenCL error %d)", ce);
            goto run_error;
        }
        cl_event ran = NULL;
        if (o.op == OP_TOPK) {
            td.num_tokens = (uint32_t)rows;
            st = moecl_topk_gating(ctx, &td, (moecl_buffer){dev[IN_LOGITS], 0},
                                   o.bias ? (moecl_buffer){dev[IN_BIAS], 0} : none, (moecl_buffer){d_w, 0},
                                   (moecl_buffer){d_ids, 0}, 0, NULL, &ran);
        } else {
            gd.num_tokens = (uint32_t)rows;
            st = moecl_grounded_router(ctx, &gd, (moecl_buffer){dev[IN_HIDDEN], 0},
                                       (moecl_buffer){dev[IN_LOGITS], 0}, (moecl_buffer){dev[IN_GROUND], 0},
                                       d_pairs ? (moecl_buffer){d_pairs, 0} : none, (moecl_buffer){d_w, 0},
                                       (moecl_buffer){d_ids, 0}, 0, NULL, &ran);
        }
        if (st != MOECL_SUCCESS) {
            for (int i = 0; i < nev; i++)
                clReleaseEvent(ev[i]);
            snprintf(err, sizeof(err), "routing failed: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
            goto run_error;
        }
        ce = clEnqueueReadBuffer(q, d_w, CL_FALSE, 0, rows * top_k * 4, h_w, 0, NULL, &ev[nev++]);
        if (ce == CL_SUCCESS)
            ce = clEnqueueReadBuffer(q, d_ids, CL_FALSE, 0, rows * top_k * 4, h_ids, 0, NULL, &ev[nev++]);
        if (ce == CL_SUCCESS && d_pairs)
            ce = clEnqueueReadBuffer(q, d_pairs, CL_FALSE, 0, rows * top_k * 8, h_pairs, 0, NULL, &ev[nev++]);
        if (ce == CL_SUCCESS)
            ce = clFinish(q);
        if (ce == CL_SUCCESS) {
            cl_int status = CL_COMPLETE;
            clGetEventInfo(ran, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(status), &status, NULL);
            if (status < 0)
                ce = status;
        }
        if (s.device_time && ce == CL_SUCCESS) {
            s.kernel_s += event_s(ran);
            for (int i = 0; i < nev; i++)
                s.transfer_s += event_s(ev[i]);
        }
        clReleaseEvent(ran);
        for (int i = 0; i < nev; i++)
            clReleaseEvent(ev[i]);
        if (ce != CL_SUCCESS) {
            snprintf(err, sizeof(err), "the device failed on rows %llu..%llu (OpenCL error %d)",
                     (unsigned long long)done, (unsigned long long)(done + rows - 1), ce);
            goto run_error;
        }
        count_load(&s, h_ids, rows * top_k);
        if (all_ids)
            memcpy(all_ids + done * top_k, h_ids, rows * top_k * 4);
        if (o.op == OP_TOPK && o.out[OUT_PAIRS])
            for (size_t i = 0; i < rows * top_k; i++) {
                h_pairs[2 * i] = (float)h_ids[i];
                h_pairs[2 * i + 1] = h_w[i];
            }
        const double w0 = now_s();
        const void *out_data[3] = {h_w, h_ids, h_pairs};
        const size_t out_bytes[3] = {rows * top_k * 4, rows * top_k * 4, rows * top_k * 8};
        for (int i = 0; i < 3; i++)
            if (out_paths[i] && npy_writer_write(&writers[i], out_data[i], out_bytes[i], err, sizeof(err)))
                goto run_error;
        s.write_s += now_s() - w0;
        end_chunk(&s, rows, tokens, progress, t0);
    }
    if (progress)
        fprintf(stderr, "\r%70s\r", "");
    if (dispatch) {
        const double a0 = now_s();
        const moecl_moe_align_host_tensors at = {sizeof(at), all_ids,   counts,         sorted, blocks,
                                                 &s.post_padded, positions, &s.num_invalid, emap};
        st = moecl_moe_align_ex_host(ctx, &ad, &at);
        s.align_s = now_s() - a0;
        if (st != MOECL_SUCCESS) {
            snprintf(err, sizeof(err), "moe_align failed: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
            goto run_error;
        }
        const double w1 = now_s();
        const void *out_data[NUM_OUT] = {[OUT_COUNTS] = counts, [OUT_SORTED] = sorted, [OUT_BLOCKS] = blocks,
                                         [OUT_SLOTS] = positions, [OUT_POST] = &s.post_padded};
        const size_t out_bytes[NUM_OUT] = {[OUT_COUNTS] = (size_t)align_experts * 4, [OUT_SORTED] = (size_t)max_padded * 4,
                                           [OUT_BLOCKS] = (size_t)(max_padded / ad.block_size) * 4,
                                           [OUT_SLOTS] = slots * 4, [OUT_POST] = 4};
        for (int i = FIRST_DISPATCH_OUT; i < NUM_OUT; i++)
            if (out_paths[i] && npy_writer_write(&writers[i], out_data[i], out_bytes[i], err, sizeof(err)))
                goto run_error;
        s.write_s += now_s() - w1;
    }
    const double w0 = now_s();
    if (commit_outputs(out_paths, err, sizeof(err)))
        goto run_error;
    s.write_s += now_s() - w0;
    s.wall_s = now_s() - t0;

    char what[512];
    if (o.op == OP_ALIGN)
        snprintf(what, sizeof(what), "moe_align of %s: %llu tokens x top_k %u, %u experts%s", o.ids_in,
                 (unsigned long long)tokens, top_k, experts, ids_i64 ? ", int64 ids read as int32" : "");
    else if (o.op == OP_TOPK)
        snprintf(what, sizeof(what),
                 "topk gating of %s: %llu tokens x %u experts, %s, top_k %u, %s%s%s%s%s%s%s%s%s%s%s%s%s",
                 o.logits, (unsigned long long)tokens, experts, dtype_name(dtype), top_k,
                 o.preset ? "preset " : "", o.preset ? o.preset : "", o.preset ? ": " : "", scoring_name(td.scoring),
                 td.weighting != MOECL_WEIGHTS_SCORE ? ", weights " : "",
                 td.weighting != MOECL_WEIGHTS_SCORE ? weighting_name(td.weighting) : "", o.bias ? ", bias" : "",
                 td.num_expert_groups ? (td.group_score == MOECL_GROUP_SCORE_TOP2_SUM ? ", groups (top2sum)"
                                                                                      : ", groups (max)")
                                      : "",
                 td.num_expert_groups && td.group_fill == MOECL_GROUP_FILL_ZERO ? ", zero fill" : "",
                 td.renormalize ? ", renormalize" : "",
                 !td.renormalize                  ? ""
                 : td.renormalize_floor > 0.0f    ? " (floored)"
                 : td.renormalize_eps > 0.0f      ? " (sum + eps)"
                                                  : "",
                 td.routed_scaling_factor != 1.0f ? ", scaled" : "",
                 td.num_shared_experts ? ", shared experts after the routed slots" : "");
    else
        snprintf(what, sizeof(what), "grounded router of %s: %llu tokens x hidden %u x %u experts, %s, top_k %u, "
                                     "alpha %g%s", o.hidden, (unsigned long long)tokens, gd.hidden_dim, experts,
                 dtype_name(dtype), top_k, (double)gd.alpha,
                 gd.num_shared_experts ? ", shared experts after the routed slots" : "");
    rc = 0;
    if (!o.json)
        print_text(&s, &o, what);
    else if (!print_json(&s, &o, &td, &gd, dtype))
        rc = fail_run("writing the JSON summary failed");
    goto cleanup;

run_error:
    rc = 1;
cleanup:
    if (rc)
        fail_run(err);
    for (int i = 0; i < NUM_IN; i++) {
        free(host[i]);
        if (dev[i])
            clReleaseMemObject(dev[i]);
    }
    if (d_w)
        clReleaseMemObject(d_w);
    if (d_ids)
        clReleaseMemObject(d_ids);
    if (d_pairs)
        clReleaseMemObject(d_pairs);
    free(h_w);
    free(h_ids);
    free(h_pairs);
    free(all_ids);
    free(counts);
    free(sorted);
    free(blocks);
    free(positions);
    free(s.load);
    free(emap);
    moecl_context_destroy(ctx);
    for (int i = 0; i < NUM_IN; i++)
        npy_close(&in[i]);
    return rc;

ctx_error:
    moecl_context_destroy(ctx);
file_error:
    free(emap);
    for (int i = 0; i < NUM_IN; i++)
        npy_close(&in[i]);
    return fail_run(err);
}
