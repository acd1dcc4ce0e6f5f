/* moecl-tune: sweep the launch configurations a device can run for each
 * seed shape, check every one against the float64 reference, time it with
 * OpenCL profiling events, and store the winners in the device's tune file
 * beside the kernel cache, where every later context reads them.
 *
 * It forces configurations through the library's internal hook, so it
 * links the library's objects and includes src/internal.h, as dav1d's
 * checkasm does. Each configuration runs in a child process (this program
 * again, with --child): a driver that crashes or hangs on one (pocl 3.1
 * does on some work-group sizes) costs that configuration, not the sweep. */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "reference.h"
#include "tool_args.h"
#include "tool_common.h"

/* A winner must beat the untuned choice by more than this to replace it. */
#define MIN_GAIN 0.03
/* A candidate whose first timed calls take this many times the best median
 * so far is timed no further. */
#define PRUNE_FACTOR 3.0
#define PRUNE_CALLS 3
/* A winner is timed again against the untuned choice this many times each,
 * alternating, before it is stored: on a shared machine load comes in
 * bursts that one sweep cannot tell from a gain. */
#define CONFIRM_ROUNDS 3
/* A child that has not answered after this long is killed. */
#define CHILD_TIMEOUT_S 600

extern char **environ;

/* The environment as the user gave it, copied before any OpenCL call: the
 * children get this one, whatever a driver sets in the parent's. */
static char **user_environ;

static void snapshot_environ(void)
{
    size_t n = 0;
    while (environ[n])
        n++;
    user_environ = calloc(n + 1, sizeof(char *));
    for (size_t i = 0; user_environ && i < n; i++)
        if (!(user_environ[i] = strdup(environ[i])))
            user_environ = NULL; /* out of memory: fall back to environ (a small leak) */
}

typedef struct tune_case {
    const char *label;
    moecl_op op;
    moecl_topk_gating_desc topk;
    bool bias;
    moecl_grounded_router_desc grounded;
    bool large; /* skipped by --quick and on CPUs unless --all */
} tune_case;

typedef struct options {
    const char *device, *only;
    const char *variant; /* --variant: the variant override, or NULL */
    int iterations;
    bool quick, dry_run, all, plan;
    char *const *child; /* --child: case, configuration (the tune file's text), best median (us) */
} options;

typedef struct case_buffers {
    cl_mem in, in2, in3, bias, out1, out2;
    void *host_in, *host_in2, *host_in3;
    float *host_bias, *out_w;
    int32_t *out_ids;
} case_buffers;

typedef struct result {
    moecl_launch_config config;
    double median_us, p10_us, p90_us;
    int calls;
    bool ok, pruned, error;
    char msg[300];
} result;

static const char *const kernel_names[] = {"rows", "team", "tiled", "mma", "splitk"};

static void *random_tensor(uint64_t *s, size_t n, float scale)
{
    void *p = tool_random_tensor(s, MOECL_F32, n, scale);
    if (!p) {
        fprintf(stderr, "moecl-tune: out of memory\n");
        exit(1);
    }
    return p;
}

/* ---- the shapes ---- */

static int default_cases(tune_case *out)
{
    int n = 0;
    static const unsigned softmax[][2] = {{8192, 128}, {13526, 256}};
    for (int i = 0; i < 2; i++) {
        tune_case *c = &out[n++];
        memset(c, 0, sizeof(*c));
        c->label = "topk softmax";
        c->op = MOECL_OP_TOPK_GATING;
        c->topk = moecl_topk_gating_desc_init(softmax[i][0], softmax[i][1], 8);
    }
    tune_case *c = &out[n++];
    memset(c, 0, sizeof(*c));
    c->label = "topk dsv3 grouped";
    c->op = MOECL_OP_TOPK_GATING;
    c->topk = moecl_topk_gating_desc_init(13526, 256, 8);
    c->topk.scoring = MOECL_SCORING_SIGMOID;
    c->topk.num_expert_groups = 8;
    c->topk.topk_group = 4;
    c->topk.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
    c->topk.renormalize = true;
    c->topk.routed_scaling_factor = 2.5f;
    c->bias = true;
    c = &out[n++];
    memset(c, 0, sizeof(*c));
    c->label = "grounded seed";
    c->op = MOECL_OP_GROUNDED_ROUTER;
    c->grounded = moecl_grounded_router_desc_init(4096, 128, 16, 0.5f);
    c = &out[n++];
    memset(c, 0, sizeof(*c));
    c->label = "grounded large";
    c->op = MOECL_OP_GROUNDED_ROUTER;
    c->grounded = moecl_grounded_router_desc_init(16384, 4096, 128, 0.5f);
    c->grounded.top_k = 8;
    c->large = true;
    return n;
}

static void shape_text(const tune_case *c, char *buf, size_t size)
{
    if (c->op == MOECL_OP_TOPK_GATING)
        snprintf(buf, size, "%s %ux%u k%u", c->label, c->topk.num_tokens, c->topk.num_experts, c->topk.top_k);
    else
        snprintf(buf, size, "%s %ux%ux%u k%u", c->label, c->grounded.num_tokens, c->grounded.hidden_dim,
                 c->grounded.num_experts, c->grounded.top_k);
}

static uint32_t tokens_of(const tune_case *c)
{
    return c->op == MOECL_OP_TOPK_GATING ? c->topk.num_tokens : c->grounded.num_tokens;
}

static uint32_t top_k_of(const tune_case *c)
{
    return c->op == MOECL_OP_TOPK_GATING ? c->topk.top_k : c->grounded.top_k;
}

/* ---- buffers, calls, checks ---- */

static void setup_buffers(cl_context cl, const tune_case *c, case_buffers *b)
{
    memset(b, 0, sizeof(*b));
    uint64_t seed = 12345;
    if (c->op == MOECL_OP_TOPK_GATING) {
        const moecl_topk_gating_desc *d = &c->topk;
        size_t n = (size_t)d->num_tokens * d->num_experts;
        b->host_in = random_tensor(&seed, n, 1.0f);
        b->in = tool_make_buffer("moecl-tune", cl, n * 4, b->host_in);
        if (c->bias) {
            b->host_bias = random_tensor(&seed, d->num_experts, 0.05f);
            b->bias = tool_make_buffer("moecl-tune", cl, d->num_experts * 4, b->host_bias);
        }
    } else {
        const moecl_grounded_router_desc *d = &c->grounded;
        size_t nh = (size_t)d->num_tokens * d->hidden_dim, nl = (size_t)d->num_tokens * d->num_experts,
               ng = (size_t)d->num_experts * d->hidden_dim;
        b->host_in = random_tensor(&seed, nh, 1.0f / sqrtf((float)d->hidden_dim));
        b->host_in2 = random_tensor(&seed, nl, 1.0f);
        b->host_in3 = random_tensor(&seed, ng, 1.0f);
        b->in = tool_make_buffer("moecl-tune", cl, nh * 4, b->host_in);
        b->in2 = tool_make_buffer("moecl-tune", cl, nl * 4, b->host_in2);
        b->in3 = tool_make_buffer("moecl-tune", cl, ng * 4, b->host_in3);
    }
    size_t nk = (size_t)tokens_of(c) * top_k_of(c);
    b->out1 = tool_make_buffer("moecl-tune", cl, nk * 8, NULL); /* weights, or the grounded router's pairs */
    b->out2 = tool_make_buffer("moecl-tune", cl, nk * 4, NULL); /* ids */
    b->out_w = malloc(nk * 8 + 4);
    b->out_ids = malloc(nk * 4 + 4);
    if (!b->out_w || !b->out_ids) {
        fprintf(stderr, "moecl-tune: out of memory\n");
        exit(1);
    }
}

static void free_buffers(case_buffers *b)
{
    cl_mem all[6] = {b->in, b->in2, b->in3, b->bias, b->out1, b->out2};
    for (int i = 0; i < 6; i++)
        if (all[i])
            clReleaseMemObject(all[i]);
    free(b->host_in);
    free(b->host_in2);
    free(b->host_in3);
    free(b->host_bias);
    free(b->out_w);
    free(b->out_ids);
}

static moecl_status call(moecl_context *ctx, const tune_case *c, const case_buffers *b, cl_event *done)
{
    moecl_buffer none = {NULL, 0};
    if (c->op == MOECL_OP_TOPK_GATING)
        return moecl_topk_gating(ctx, &c->topk, (moecl_buffer){b->in, 0}, b->bias ? (moecl_buffer){b->bias, 0} : none,
                                 (moecl_buffer){b->out1, 0}, (moecl_buffer){b->out2, 0}, 0, NULL, done);
    /* The seed's layout: stacked (index, weight) pairs. */
    return moecl_grounded_router(ctx, &c->grounded, (moecl_buffer){b->in, 0}, (moecl_buffer){b->in2, 0},
                                 (moecl_buffer){b->in3, 0}, (moecl_buffer){b->out1, 0}, none, none, 0, NULL, done);
}

static moecl_launch_source resolve(const moecl_context *ctx, const tune_case *c, moecl_launch_key *key,
                                   moecl_launch_config *config)
{
    return c->op == MOECL_OP_TOPK_GATING ? moecl_topk_gating_launch(ctx, &c->topk, key, config)
                                         : moecl_grounded_router_launch(ctx, &c->grounded, key, config);
}

/* One call, read back, compared with the reference. */
static bool check(moecl_context *ctx, const tune_case *c, case_buffers *b, result *r)
{
    cl_command_queue q = moecl_context_queue(ctx);
    const size_t nk = (size_t)tokens_of(c) * top_k_of(c);
    /* Poison first, so rows a configuration skips show. */
    const unsigned char poison = 0xff;
    clEnqueueFillBuffer(q, b->out1, &poison, 1, 0, nk * 8, 0, NULL, NULL);
    clEnqueueFillBuffer(q, b->out2, &poison, 1, 0, nk * 4, 0, NULL, NULL);
    cl_event ev;
    moecl_status st = call(ctx, c, b, &ev);
    if (st != MOECL_SUCCESS) {
        snprintf(r->msg, sizeof(r->msg), "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
        r->error = true;
        return false;
    }
    cl_int err = clWaitForEvents(1, &ev);
    clReleaseEvent(ev);
    if (err != CL_SUCCESS) {
        snprintf(r->msg, sizeof(r->msg), "the call failed on the device (%d)", err);
        r->error = true;
        return false;
    }
    int bad;
    if (c->op == MOECL_OP_TOPK_GATING) {
        clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, nk * 4, b->out_w, 0, NULL, NULL);
        clEnqueueReadBuffer(q, b->out2, CL_TRUE, 0, nk * 4, b->out_ids, 0, NULL, NULL);
        bad = ref_check_topk_gating(&c->topk, b->host_in, b->host_bias, b->out_w, b->out_ids, r->msg, sizeof(r->msg));
    } else {
        clEnqueueReadBuffer(q, b->out1, CL_TRUE, 0, nk * 8, b->out_w, 0, NULL, NULL);
        bad = ref_check_grounded_router(&c->grounded, b->host_in, b->host_in2, b->host_in3, b->out_w, NULL, NULL,
                                        r->msg, sizeof(r->msg));
    }
    return bad == 0;
}

/* Median, p10 and p90 of up to `iterations` profiled calls after a
 * warm-up; fewer for calls slower than 0.1 s, and PRUNE_CALLS only when
 * those are far behind the best median so far. */
static void time_config(moecl_context *ctx, const tune_case *c, case_buffers *b, int iterations, double best_us,
                        result *r)
{
    double t0 = tool_now_us();
    for (int i = 0; i < 2; i++) {
        cl_event ev;
        if (call(ctx, c, b, &ev) != MOECL_SUCCESS)
            break;
        clWaitForEvents(1, &ev);
        clReleaseEvent(ev);
    }
    double one_call = (tool_now_us() - t0) / 2;
    if (one_call > 1e5) {
        int fit = (int)(1e7 / one_call);
        iterations = fit < 5 ? 5 : fit < iterations ? fit : iterations;
    }
    double *t = malloc(sizeof(double) * (size_t)iterations);
    if (!t) {
        snprintf(r->msg, sizeof(r->msg), "out of memory");
        r->error = true;
        return;
    }
    int n = 0;
    for (; n < iterations; n++) {
        cl_event ev;
        moecl_status st = call(ctx, c, b, &ev);
        if (st != MOECL_SUCCESS) {
            snprintf(r->msg, sizeof(r->msg), "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
            r->error = true;
            break;
        }
        clWaitForEvents(1, &ev);
        t[n] = tool_event_us(ev);
        clReleaseEvent(ev);
        if (n + 1 == PRUNE_CALLS && best_us > 0 && n + 1 < iterations) {
            double first[PRUNE_CALLS];
            memcpy(first, t, sizeof(first));
            qsort(first, PRUNE_CALLS, sizeof(double), tool_cmp_double);
            if (first[PRUNE_CALLS / 2] > PRUNE_FACTOR * best_us) {
                r->pruned = true;
                n++;
                break;
            }
        }
    }
    if (n > 0) {
        qsort(t, (size_t)n, sizeof(double), tool_cmp_double);
        r->median_us = t[n / 2];
        r->p10_us = t[n / 10];
        r->p90_us = t[n * 9 / 10];
    }
    r->calls = n;
    free(t);
}

/* ---- candidates ---- */

static unsigned pow2_at_least(unsigned v)
{
    unsigned p = 1;
    while (p < v)
        p <<= 1;
    return p;
}

/* Every configuration of the op's kernels the sweep tries, before the
 * device check: teams of powers of two up to the expert count (wider teams
 * leave lanes without an expert), rows of powers of two up to 4096 work-items
 * a group. --quick steps both by 4. */
static int candidates(const tune_case *c, bool quick, moecl_launch_config *out, int max)
{
    const unsigned step = quick ? 4 : 2;
    const uint32_t experts = c->op == MOECL_OP_TOPK_GATING ? c->topk.num_experts : c->grounded.num_experts;
    unsigned max_team = pow2_at_least(experts);
    if (max_team > MOECL_LAUNCH_MAX_TEAM)
        max_team = MOECL_LAUNCH_MAX_TEAM;
    int n = 0;
    for (unsigned team = 1; team <= max_team; team *= step)
        for (unsigned rows = 1; team * rows <= MOECL_LAUNCH_MAX_ROWS && n < max; rows *= step)
            out[n++] = team == 1 ? (moecl_launch_config){MOECL_KERNEL_ROWS, 1, rows, 0, {0}}
                                 : (moecl_launch_config){MOECL_KERNEL_TEAM, team, rows, 0, {0}};
    if (c->op == MOECL_OP_GROUNDED_ROUTER) {
        size_t tiles;
        const moecl_launch_config *tile = moecl_grounded_tile_configs(&tiles);
        for (size_t i = 0; i < tiles && n < max; i++)
            out[n++] = tile[i];
    }
    return n;
}

static void config_columns(const moecl_launch_config *c, char *buf, size_t size)
{
    char team[16] = "-", rows[16] = "-", tile[48] = "-";
    const moecl_tile_params *p = &c->tiled;
    if (c->kernel == MOECL_KERNEL_TEAM)
        snprintf(team, sizeof(team), "%u", c->team);
    if (c->kernel == MOECL_KERNEL_SPLITK) /* its hidden chunk */
        snprintf(tile, sizeof(tile), "k%u", c->tile);
    else if (c->kernel != MOECL_KERNEL_TILED)
        snprintf(rows, sizeof(rows), "%u", c->rows);
    else if (p->tk && p->wc) /* ... and the work-items side by side along the experts */
        snprintf(tile, sizeof(tile), "%ux%ux%u/%ux%u/v%u/db%u/wc%u", c->tile, p->tn, p->tk, p->mt, p->nt, p->vec, p->db,
                 p->wc);
    else if (p->tk) /* tokens x experts x hidden step, block, vector, double buffering */
        snprintf(tile, sizeof(tile), "%ux%ux%u/%ux%u/v%u/db%u", c->tile, p->tn, p->tk, p->mt, p->nt, p->vec, p->db);
    else
        snprintf(tile, sizeof(tile), "%u", c->tile);
    snprintf(buf, size, "%-6s %5s %5s %24s", (unsigned)c->kernel <= MOECL_KERNEL_SPLITK ? kernel_names[c->kernel] : "?",
             team, rows, tile);
}

/* A context on a profiling queue, its tune file set aside: the sweep
 * compares with what the library picks without one. */
static moecl_context *profiling_context(const char *device, moecl_context **plain)
{
    moecl_status st = moecl_context_create(device, plain);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "moecl-tune: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        exit(1);
    }
    cl_int err;
    cl_command_queue pq = clCreateCommandQueue(moecl_context_cl_context(*plain), moecl_context_device(*plain),
                                               CL_QUEUE_PROFILING_ENABLE, &err);
    if (!pq) {
        fprintf(stderr, "moecl-tune: cannot create a profiling queue (%d)\n", err);
        exit(1);
    }
    moecl_context *ctx;
    st = moecl_context_create_from_cl(moecl_context_cl_context(*plain), moecl_context_device(*plain), pq, &ctx);
    clReleaseCommandQueue(pq);
    if (st != MOECL_SUCCESS) {
        fprintf(stderr, "moecl-tune: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        exit(1);
    }
    moecl_tune_free(&ctx->tuned);
    return ctx;
}

/* ---- the child: one configuration of one shape ---- */

/* Prints "result STATUS MEDIAN P10 P90 CALLS PRUNED" and "msg TEXT". */
static int run_child(const options *o, const tune_case *cases, int num_cases)
{
    char *const *a = o->child;
    const int index = atoi(a[0]);
    moecl_launch_config config;
    if (index < 0 || index >= num_cases || !moecl_launch_config_parse(a[1], &config))
        return 2;
    const double best_us = atof(a[2]);
    const tune_case *c = &cases[index];
    moecl_context *plain, *ctx = profiling_context(o->device, &plain);
    result r;
    memset(&r, 0, sizeof(r));
    moecl_launch_force(ctx, c->op, &config);
    moecl_launch_key key;
    moecl_launch_config got;
    const char *status;
    if (resolve(ctx, c, &key, &got) != MOECL_SOURCE_FORCED || !moecl_launch_config_equal(&got, &config)) {
        status = "invalid";
        snprintf(r.msg, sizeof(r.msg), "the library does not run this configuration on this device");
    } else {
        case_buffers b;
        setup_buffers(moecl_context_cl_context(ctx), c, &b);
        r.ok = check(ctx, c, &b, &r);
        if (r.ok)
            time_config(ctx, c, &b, o->iterations, best_us, &r);
        free_buffers(&b);
        status = r.error ? "error" : r.ok ? "ok" : "fail";
    }
    for (char *p = r.msg; *p; p++)
        if (*p == '\n')
            *p = ' ';
    printf("result %s %.3f %.3f %.3f %d %d\nmsg %s\n", status, r.median_us, r.p10_us, r.p90_us, r.calls,
           r.pruned ? 1 : 0, r.msg);
    fflush(stdout);
    moecl_context_destroy(ctx);
    moecl_context_destroy(plain);
    return 0;
}

/* ---- the parent: spawn a child per configuration ---- */

/* Run this program again with args, its stdout and stderr into out
 * (NUL-terminated, cut at size - 1), killed after CHILD_TIMEOUT_S; false
 * with why in err when it could not start. */
typedef struct child_exit {
    int wstatus;
    bool timed_out;
} child_exit;

static bool spawn_capture(const char *self, char *const *args, char *out, size_t size, child_exit *ce, char *err,
                          size_t err_size)
{
    int fds[2];
    posix_spawn_file_actions_t fa;
    pid_t pid;
    memset(ce, 0, sizeof(*ce));
    out[0] = '\0';
    if (pipe(fds) != 0) {
        snprintf(err, err_size, "pipe: %s", strerror(errno));
        return false;
    }
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 2); /* a driver's last words come back too */
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    int e = posix_spawnp(&pid, self, &fa, NULL, args, user_environ ? user_environ : environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (e) {
        close(fds[0]);
        snprintf(err, err_size, "starting %.200s: %s", self, strerror(e));
        return false;
    }
    /* Read everything the child says, up to the deadline. */
    size_t used = 0;
    const double deadline = tool_now_us() + CHILD_TIMEOUT_S * 1e6;
    for (;;) {
        double left_ms = (deadline - tool_now_us()) / 1e3;
        struct pollfd p = {fds[0], POLLIN, 0};
        if (left_ms <= 0 || poll(&p, 1, (int)left_ms) == 0) {
            ce->timed_out = true;
            kill(pid, SIGKILL);
            break;
        }
        char buf[4096];
        ssize_t got = read(fds[0], buf, sizeof(buf));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        size_t keep = (size_t)got < size - 1 - used ? (size_t)got : size - 1 - used;
        memcpy(out + used, buf, keep);
        used += keep;
    }
    close(fds[0]);
    out[used] = '\0';
    while (waitpid(pid, &ce->wstatus, 0) < 0 && errno == EINTR) {
    }
    return true;
}

/* Why a child gave no answer: killed, crashed or exited, with its last line. */
static void child_failure(const child_exit *ce, char *out, char *msg, size_t size)
{
    size_t used = strlen(out);
    while (used && (out[used - 1] == '\n' || out[used - 1] == '\r'))
        out[--used] = '\0';
    const char *last = strrchr(out, '\n');
    last = last ? last + 1 : out;
    if (ce->timed_out)
        snprintf(msg, size, "no answer in %d s: killed", CHILD_TIMEOUT_S);
    else if (WIFSIGNALED(ce->wstatus))
        snprintf(msg, size, "crashed (signal %d)%s%.200s", WTERMSIG(ce->wstatus), *last ? ": " : "", last);
    else
        snprintf(msg, size, "exited with status %d%s%.200s", WEXITSTATUS(ce->wstatus), *last ? ": " : "", last);
}

/* The options a child shares with the parent. */
static int common_args(const options *o, char **argv, char *iters, size_t iters_size)
{
    int n = 0;
    snprintf(iters, iters_size, "%d", o->iterations);
    if (o->device) {
        argv[n++] = "--device";
        argv[n++] = (char *)o->device;
    }
    argv[n++] = "--iterations";
    argv[n++] = iters;
    if (o->variant) {
        argv[n++] = "--variant";
        argv[n++] = (char *)o->variant;
    }
    return n;
}

static void run_in_child(const char *self, const options *o, int index, const moecl_launch_config *config,
                         double best_us, result *r)
{
    char idx[16], text[128], best[32], iters[16];
    snprintf(idx, sizeof(idx), "%d", index);
    moecl_launch_config_text(config, text, sizeof(text));
    snprintf(best, sizeof(best), "%.3f", best_us);
    char *argv[16];
    int n = 0;
    argv[n++] = (char *)self;
    n += common_args(o, argv + n, iters, sizeof(iters));
    argv[n++] = "--child";
    argv[n++] = idx;
    argv[n++] = text;
    argv[n++] = best;
    argv[n] = NULL;

    char out[8192];
    child_exit ce;
    if (!spawn_capture(self, argv, out, sizeof(out), &ce, r->msg, sizeof(r->msg))) {
        r->error = true;
        return;
    }
    char status[16] = "";
    int pruned = 0;
    const char *res = strstr(out, "result ");
    if (res && sscanf(res, "result %15s %lf %lf %lf %d %d", status, &r->median_us, &r->p10_us, &r->p90_us, &r->calls,
                      &pruned) == 6) {
        const char *msg = strstr(res, "\nmsg ");
        if (msg)
            snprintf(r->msg, sizeof(r->msg), "%.*s", (int)strcspn(msg + 5, "\n"), msg + 5);
        r->pruned = pruned != 0;
        r->ok = !strcmp(status, "ok");
        r->error = !strcmp(status, "error") || !strcmp(status, "invalid");
        return;
    }
    /* No result: the child died. Its last line says why, if anything. */
    r->error = true;
    child_failure(&ce, out, r->msg, sizeof(r->msg));
}

/* ---- one shape ---- */

/* What a shape's sweep runs. A child works it out (--plan), so the parent
 * never opens the device: on the H200 machine a child did not see the GPU
 * once its parent had used OpenCL. */
typedef struct plan {
    bool selected, skipped;
    moecl_launch_key key;
    moecl_launch_source base_source;
    moecl_launch_config cand[256]; /* cand[0]: the untuned choice */
    int count;
} plan;

typedef struct outcome {
    moecl_launch_key key;
    moecl_launch_config store;
    bool ok, swept;
} outcome;

static void plan_shape(moecl_context *ctx, const tune_case *c, const options *o, plan *p)
{
    /* The untuned choice (the table or the computed default) goes first:
     * it is the yardstick of the pruning and of the 3% rule. */
    moecl_launch_force(ctx, c->op, NULL);
    p->base_source = resolve(ctx, c, &p->key, &p->cand[0]);
    p->count = 1;
    moecl_launch_config all[256];
    const int num_all = candidates(c, o->quick, all, 256);
    for (int i = 0; i < num_all && p->count < 256; i++) {
        moecl_launch_key key;
        moecl_launch_config got;
        moecl_launch_force(ctx, c->op, &all[i]);
        /* Only what the library would run on this device. */
        if (!moecl_launch_config_equal(&all[i], &p->cand[0]) && resolve(ctx, c, &key, &got) == MOECL_SOURCE_FORCED &&
            moecl_launch_config_equal(&got, &all[i]))
            p->cand[p->count++] = all[i];
    }
    moecl_launch_force(ctx, c->op, NULL);
}

/* Printable on one line: control characters become '?'. */
static void print_name(const char *what, const char *name)
{
    printf("%s ", what);
    for (const char *c = name; *c; c++)
        putchar((unsigned char)*c < 0x20 ? '?' : *c);
    putchar('\n');
}

static bool shape_selected(const options *o, const tune_case *c)
{
    char shape[96];
    shape_text(c, shape, sizeof(shape));
    return !o->only || strstr(shape, o->only);
}

/* The planner child: the device's identity, then per selected shape its
 * key, the untuned choice and the configurations the library would run,
 * or that it is skipped. read_plans reads it. */
static int run_planner(const options *o, const tune_case *cases, int num_cases)
{
    moecl_context *ctx;
    moecl_status st = moecl_context_create(o->device, &ctx);
    if (st != MOECL_SUCCESS) {
        printf("moecl-tune: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        return 1;
    }
    moecl_tune_free(&ctx->tuned); /* the untuned choice is the yardstick */
    const moecl_device_info *info = &ctx->info;
    const bool cpu = (info->type & CL_DEVICE_TYPE_CPU) != 0;
    print_name("platform", info->platform_name);
    print_name("device", info->device_name);
    print_name("driver", info->driver_version);
    printf("flags %d %d\n", cpu,
           moecl_launch_env_decides(&info->env, MOECL_OP_TOPK_GATING) ||
               moecl_launch_env_decides(&info->env, MOECL_OP_GROUNDED_ROUTER));
    static plan p;
    for (int i = 0; i < num_cases; i++) {
        if (!shape_selected(o, &cases[i]))
            continue;
        if (cases[i].large && (o->quick || (cpu && !o->all))) {
            printf("skip %d\n", i);
            continue;
        }
        plan_shape(ctx, &cases[i], o, &p);
        printf("shape %d %d %u %u %u %u %d %d\n", i, (int)p.key.op, p.key.num_experts, p.key.top_k, p.key.groups,
               p.key.hidden_bucket, (int)p.base_source, p.count);
        for (int j = 0; j < p.count; j++) {
            char text[128];
            moecl_launch_config_text(&p.cand[j], text, sizeof(text));
            printf("config %s\n", text);
        }
    }
    printf("end\n");
    moecl_context_destroy(ctx);
    return 0;
}

/* The rest of the line after "what ", into buf. */
static bool line_value(const char *text, const char *what, char *buf, size_t size)
{
    char pattern[32];
    snprintf(pattern, sizeof(pattern), "%s ", what);
    for (const char *line = text; line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, pattern, strlen(pattern)) == 0) {
            const char *v = line + strlen(pattern);
            snprintf(buf, size, "%.*s", (int)strcspn(v, "\n"), v);
            return true;
        }
    }
    return false;
}

/* Parse the planner's output; false if it is not whole. */
static bool read_plans(const char *text, moecl_device_info *info, bool *cpu, bool *env, plan *plans, int num_cases)
{
    memset(info, 0, sizeof(*info));
    char flags[32];
    int c = 0, e = 0;
    if (!line_value(text, "platform", info->platform_name, sizeof(info->platform_name)) ||
        !line_value(text, "device", info->device_name, sizeof(info->device_name)) ||
        !line_value(text, "driver", info->driver_version, sizeof(info->driver_version)) ||
        !line_value(text, "flags", flags, sizeof(flags)) || sscanf(flags, "%d %d", &c, &e) != 2 ||
        !strstr(text, "\nend\n"))
        return false;
    *cpu = c != 0;
    *env = e != 0;
    plan *p = NULL;
    for (const char *line = text; line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        int i, op, source, count;
        unsigned ex, k, groups, hidden;
        moecl_launch_config config;
        char text[128];
        if (sscanf(line, "skip %d", &i) == 1 && i >= 0 && i < num_cases) {
            plans[i].skipped = true;
        } else if (sscanf(line, "shape %d %d %u %u %u %u %d %d", &i, &op, &ex, &k, &groups, &hidden, &source,
                          &count) == 8 &&
                   i >= 0 && i < num_cases && count >= 1 && count <= 256) {
            p = &plans[i];
            p->selected = true;
            p->key = (moecl_launch_key){(moecl_op)op, ex, k, groups, hidden};
            p->base_source = (moecl_launch_source)source;
            p->count = 0;
        } else if (strncmp(line, "config ", 7) == 0 && p && p->count < 256) {
            snprintf(text, sizeof(text), "%.*s", (int)strcspn(line + 7, "\n"), line + 7);
            if (moecl_launch_config_parse(text, &config))
                p->cand[p->count++] = config;
        }
    }
    return true;
}

static outcome tune_shape(const char *self, const plan *p, const tune_case *c, const options *o, int index,
                          int count)
{
    outcome out = {.key = p->key, .ok = false, .swept = true};
    char shape[96];
    shape_text(c, shape, sizeof(shape));
    const moecl_launch_config *cand = p->cand, base = p->cand[0];
    const moecl_launch_source base_source = p->base_source;
    const int n = p->count;

    result *res = calloc((size_t)n, sizeof(result));
    if (!res) {
        fprintf(stderr, "moecl-tune: out of memory\n");
        exit(1);
    }
    int failed = 0, best = -1;
    /* The progress line rewrites itself on a terminal; a log gets a line
     * per shape. */
    const bool tty = isatty(2);
    if (!tty)
        fprintf(stderr, "moecl-tune: [%d/%d] %s: %d configurations\n", index, count, shape, n);
    printf("\n%s  (untuned: %s)\n", shape, moecl_launch_source_name(base_source));
    printf("  %-6s %5s %5s %24s %11s %11s %11s %10s %5s  %s\n", "kernel", "team", "rows", "tile", "median_us", "p10_us",
           "p90_us", "vs_untuned", "calls", "check");
    for (int i = 0; i < n; i++) {
        result *r = &res[i];
        r->config = cand[i];
        char cols[64];
        config_columns(&cand[i], cols, sizeof(cols));
        if (tty) {
            fprintf(stderr, "\r[%d/%d %s] %d/%d %s ...     ", index, count, shape, i + 1, n, cols);
            fflush(stderr);
        }
        run_in_child(self, o, index - 1, &cand[i], best >= 0 ? res[best].median_us : 0, r);
        if (tty)
            fprintf(stderr, "\r%110s\r", "");
        if (!r->ok && !r->error)
            failed++;
        if (r->ok && !r->pruned && (best < 0 || r->median_us < res[best].median_us))
            best = i;
        char vs[16] = "";
        if (r->ok && res[0].ok && res[0].median_us > 0)
            snprintf(vs, sizeof(vs), "%+.1f%%", 100.0 * (r->median_us / res[0].median_us - 1.0));
        if (r->ok)
            printf("  %s %11.2f %11.2f %11.2f %10s %5d  ok%s%s\n", cols, r->median_us, r->p10_us, r->p90_us, vs,
                   r->calls, r->pruned ? " (stopped: > 3x the best)" : "", i == 0 ? "  <- untuned" : "");
        else
            printf("  %s %11s %11s %11s %10s %5s  %s%s: %s\n", cols, "-", "-", "-", "", "-",
                   r->error ? "error" : "FAIL", i == 0 ? " (untuned)" : "", r->msg);
        fflush(stdout);
    }
    if (failed || !res[0].ok) {
        printf("  %s: nothing stored for this shape\n",
               failed ? "a configuration gave wrong results" : "the untuned configuration failed");
    } else {
        out.ok = true;
        const result *w = &res[best];
        bool wins = w->median_us < (1.0 - MIN_GAIN) * res[0].median_us;
        char text[96], base_text[96];
        moecl_launch_config_text(&w->config, text, sizeof(text));
        moecl_launch_config_text(&base, base_text, sizeof(base_text));
        if (wins) {
            /* Alternate the two, then compare the medians of their medians. */
            double tw[CONFIRM_ROUNDS], tb[CONFIRM_ROUNDS];
            bool confirmed_ok = true;
            for (int round = 0; round < CONFIRM_ROUNDS && confirmed_ok; round++) {
                fprintf(stderr, "%sconfirming %s against the untuned %s (%d/%d) ...", tty ? "\r" : "", text,
                        base_text, round + 1, CONFIRM_ROUNDS);
                fprintf(stderr, tty ? "     " : "\n");
                fflush(stderr);
                result rb, rw;
                memset(&rb, 0, sizeof(rb));
                memset(&rw, 0, sizeof(rw));
                run_in_child(self, o, index - 1, &base, 0, &rb);
                run_in_child(self, o, index - 1, &w->config, 0, &rw);
                confirmed_ok = rb.ok && rw.ok;
                tb[round] = rb.median_us;
                tw[round] = rw.median_us;
            }
            if (tty)
                fprintf(stderr, "\r%110s\r", "");
            qsort(tb, CONFIRM_ROUNDS, sizeof(double), tool_cmp_double);
            qsort(tw, CONFIRM_ROUNDS, sizeof(double), tool_cmp_double);
            const double mb = tb[CONFIRM_ROUNDS / 2], mw = tw[CONFIRM_ROUNDS / 2];
            wins = confirmed_ok && mw < (1.0 - MIN_GAIN) * mb;
            printf("  confirming, %d alternating runs each: %s %.2f us, untuned %.2f us (%+.1f%%)\n", CONFIRM_ROUNDS,
                   text, mw, mb, mb > 0 ? 100.0 * (mw / mb - 1.0) : 0.0);
        }
        out.store = wins ? w->config : base;
        if (wins)
            printf("  winner: %s\n", text);
        else
            printf("  keeping the untuned %s: no configuration is more than 3%% faster\n", base_text);
    }
    free(res);
    return out;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moecl-tune [--device SEL] [--quick] [--dry-run] [--all] [--only SUBSTRING]\n"
            "                  [--iterations N] [--variant TEXT] [--help]\n"
            "Sweeps the launch configurations the device can run for each tuned shape (top-k gating at\n"
            "8192x128 and 13526x256 k8 and DeepSeek-V3 grouped 13526x256; the grounded router at\n"
            "4096x128x16 k2 and 16384x4096x128 k8), checks each once against the float64 reference,\n"
            "times it (median of N profiled calls, default 50), and stores per shape the fastest if it\n"
            "beats the untuned choice by more than 3%%, else the untuned choice, in the device's tune\n"
            "file in the kernel cache directory. Contexts created afterwards use it.\n"
            "  --quick      N=10, teams and rows stepped by 4, no large grounded shape\n"
            "  --dry-run    sweep and print, write nothing\n"
            "  --all        also the large grounded shape on CPU devices\n"
            "  --only S     only the shapes whose label or size contains S\n"
            "  --variant T  sweep under a forced kernel variant (\"class=gpu ...\", the words of\n"
            "               docs/environment.md, \"Forcing a variant\"): the untuned choice is what it forces\n"
            "Exit status: 0 ok, 1 a check or a call failed or the file could not be written, 2 bad usage.\n");
}

/* The options, checked before any device is touched: -1 to go on, else
 * the exit status (0 after --help, 2 for a bad usage, named). */
static int parse_args(int argc, char **argv, options *o)
{
    enum { OPT_DEVICE = 256, OPT_ONLY, OPT_ITERATIONS, OPT_QUICK, OPT_DRY_RUN, OPT_ALL, OPT_PLAN, OPT_CHILD, OPT_VARIANT };
    static const struct option longopts[] = {
        {"device", required_argument, NULL, OPT_DEVICE}, {"only", required_argument, NULL, OPT_ONLY},
        {"iterations", required_argument, NULL, OPT_ITERATIONS}, {"quick", no_argument, NULL, OPT_QUICK},
        {"dry-run", no_argument, NULL, OPT_DRY_RUN},     {"all", no_argument, NULL, OPT_ALL},
        {"plan", no_argument, NULL, OPT_PLAN},           {"child", no_argument, NULL, OPT_CHILD},
        {"variant", required_argument, NULL, OPT_VARIANT}, {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *prog = "moecl-tune";
    memset(o, 0, sizeof(*o));
    int c;
    long v;
    while ((c = tool_getopt(prog, usage, argc, argv, "h", longopts)) != -1) {
        switch (c) {
        case 'h':
            usage(stdout);
            return 0;
        case OPT_DEVICE:
            o->device = optarg;
            break;
        case OPT_ONLY:
            o->only = optarg;
            break;
        case OPT_ITERATIONS:
            if (!tool_parse_int(optarg, 1, 10000000, &v))
                return tool_bad_usage(prog, usage, "--iterations %s: expected a whole number, at least 1", optarg);
            o->iterations = (int)v;
            break;
        case OPT_QUICK:
            o->quick = true;
            break;
        case OPT_VARIANT:
            /* Set here in the parent and in each child, which get it again. */
            if (moecl_override_set(optarg) != MOECL_SUCCESS)
                return tool_bad_usage(prog, usage, "--variant %s: %s", optarg, moecl_context_error(NULL));
            o->variant = optarg;
            break;
        case OPT_DRY_RUN:
            o->dry_run = true;
            break;
        case OPT_ALL:
            o->all = true;
            break;
        case OPT_PLAN:
            o->plan = true; /* internal: see run_planner */
            break;
        case OPT_CHILD:
            /* internal: one configuration, the three words after it (see run_child) */
            if (optind + 3 > argc)
                return tool_bad_usage(prog, usage, "--child needs three values");
            o->child = argv + optind;
            optind += 3;
            break;
        default:
            return 2; /* tool_getopt named it */
        }
    }
    if (optind < argc)
        return tool_bad_usage(prog, usage, "unexpected argument '%s'", argv[optind]);
    return -1;
}

int main(int argc, char **argv)
{
    options o;
    int status = parse_args(argc, argv, &o);
    if (status >= 0)
        return status;
    if (!o.iterations)
        o.iterations = o.quick ? 10 : 50;
    tune_case cases[8];
    const int n = default_cases(cases);
    int selected = 0;
    for (int i = 0; i < n; i++)
        selected += shape_selected(&o, &cases[i]);
    if (!selected)
        return tool_bad_usage("moecl-tune", usage, "--only %s matches no shape", o.only);
    if (o.child)
        return run_child(&o, cases, n);
    if (o.plan)
        return run_planner(&o, cases, n);

    snapshot_environ();
    /* Children are this program again: its path as Linux names it, else
     * argv[0]. Not "/proc/self/exe" itself: NVIDIA's OpenCL found no GPU in
     * children started through that name. */
    static char self_path[4096];
    ssize_t len = readlink("/proc/self/exe", self_path, sizeof(self_path) - 1);
    if (len > 0)
        self_path[len] = '\0';
    const char *self = len > 0 ? self_path : argv[0];

    /* The plan, from a child. */
    static plan plans[8];
    moecl_device_info device_info;
    const moecl_device_info *info = &device_info;
    bool cpu = false, env = false;
    {
        char *argv[16], iters[16];
        int k = 0;
        argv[k++] = (char *)self;
        k += common_args(&o, argv + k, iters, sizeof(iters));
        argv[k++] = "--plan";
        if (o.quick)
            argv[k++] = "--quick";
        if (o.all)
            argv[k++] = "--all";
        if (o.only) {
            argv[k++] = "--only";
            argv[k++] = (char *)o.only;
        }
        argv[k] = NULL;
        const size_t size = (size_t)1 << 18;
        char *out = malloc(size), msg[300] = "";
        child_exit ce;
        if (!out || !spawn_capture(self, argv, out, size, &ce, msg, sizeof(msg)) ||
            !read_plans(out, &device_info, &cpu, &env, plans, n)) {
            if (out && msg[0] == '\0')
                child_failure(&ce, out, msg, sizeof(msg));
            fprintf(stderr, "moecl-tune: finding the device and the configurations failed: %s\n",
                    out ? msg : "out of memory");
            free(out);
            return 1;
        }
        free(out);
    }
    printf("moecl-tune (moecl %s)\ndevice: %s / %s (driver %s)\n", moecl_version(), info->platform_name,
           info->device_name, info->driver_version);
    if (env)
        fprintf(stderr, "moecl-tune: note: --variant %s decides the untuned choice\n", o.variant);
    printf("median of up to %d profiled calls per configuration; teams and rows stepped by %d\n", o.iterations,
           o.quick ? 4 : 2);

    outcome outcomes[8];
    memset(outcomes, 0, sizeof(outcomes));
    int failures = 0, swept = 0;
    for (int i = 0; i < n; i++) {
        char shape[96];
        shape_text(&cases[i], shape, sizeof(shape));
        if (plans[i].skipped)
            printf("\n%s: skipped (%s)\n", shape, o.quick ? "--quick" : "a CPU device; --all runs it");
        if (!plans[i].selected)
            continue;
        outcomes[i] = tune_shape(self, &plans[i], &cases[i], &o, i + 1, n);
        swept++;
        failures += !outcomes[i].ok;
    }
    status = failures ? 1 : 0;
    char path[4096];
    const bool have_path = moecl_tune_path(info, path, sizeof(path));
    if (!swept) {
        fprintf(stderr, "moecl-tune: no shape to sweep: the ones selected are skipped (above)\n");
        status = 2;
    } else if (failures) {
        printf("\n%d shape(s) failed: the tune file is not written\n", failures);
    } else if (!have_path) {
        printf("\nthe kernel cache is off (MOECL_CACHE_DIR): nowhere to store the tune file\n");
        status = o.dry_run ? 0 : 1;
    } else if (o.dry_run) {
        printf("\ndry run: %s not written\n", path);
    } else {
        /* Merge into what the file holds: other keys stay. */
        moecl_tune_table table;
        moecl_tune_load(info, &table);
        bool ok = true;
        for (int i = 0; i < n; i++)
            if (outcomes[i].swept && outcomes[i].ok)
                ok &= moecl_tune_set(&table, &outcomes[i].key, &outcomes[i].store);
        char comment[256];
        snprintf(comment, sizeof(comment),
                 "written by moecl-tune (moecl %s): per key the fastest configuration if it beat\n"
                 "the untuned choice by more than 3%%, else the untuned choice; median of %d calls",
                 moecl_version(), o.iterations);
        if (ok && moecl_tune_store(info, &table, comment)) {
            printf("\ntune file: %s (%zu entries)\n", path, table.count);
        } else {
            printf("\nwriting the tune file %s failed\n", path);
            status = 1;
        }
        moecl_tune_free(&table);
    }
    return status;
}
