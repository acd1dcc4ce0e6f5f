/* The runtime around the kernels: status strings, descriptor and buffer
 * validation, device selection, adopting a runtime's OpenCL objects, wait
 * lists and events, the compiled-kernel disk cache, MOECL_KERNEL_DIR and
 * sharing one context between threads, also while one of them builds.
 *
 * meson runs this with CK_FORK=no, so every test shares one process: tests
 * that change the environment do so inside the env fixture, which restores
 * it (and removes its temporary directory) even when the test fails. Tests
 * that need fresh OpenCL loader state run this executable again in a child
 * process (`test_runtime --probe-create`).
 *
 * Kernel variants are few on purpose (each costs a build): E=16,k=4 and
 * E=128,k=8, f32 logits, each with and without bias; only the registry
 * test builds more (E=17..32, k=1: small rows kernels, cheap to build). */
#include "harness.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

/* Room for a PATH_MAX directory plus a file name. */
#define PATHBUF (PATH_MAX + 256)

/* The two shapes every test shares. */
#define EA 16u
#define KA 4u
#define EB 128u
#define KB 8u

/* A value no library writes into *done: it must survive a failed call. */
#define DONE_SENTINEL ((cl_event)(uintptr_t)0x5eedu)
/* A value a failed create must overwrite with NULL. */
#define CTX_SENTINEL ((moecl_context *)(uintptr_t)0x5eedu)

/* ---------------------------------------------------------------------- */
/* Small helpers                                                           */
/* ---------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Index of the first byte that is not poison, or n. */
static size_t first_unpoisoned(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != HARNESS_POISON)
            return i;
    return n;
}

static void *poisoned(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p)
        memset(p, HARNESS_POISON, n ? n : 1);
    return p;
}

/* n values of dtype, standard normal times scale; NULL when out of memory.
 * No Check calls, so threads may use it. */
static void *gen_tensor(harness_rng *rng, moecl_dtype dtype, size_t n, float scale)
{
    void *p = malloc(n * ref_dtype_size(dtype) + 1);
    if (!p)
        return NULL;
    for (size_t i = 0; i < n; i++)
        harness_store(dtype, p, i, harness_randn(rng) * scale);
    return p;
}

/* A buffer of total bytes, all poison, with size bytes of data at offset. */
static cl_mem make_mem(cl_context c, size_t total, size_t offset, const void *data, size_t size, cl_int *err)
{
    unsigned char *fill = poisoned(total);
    if (!fill) {
        *err = CL_OUT_OF_HOST_MEMORY;
        return NULL;
    }
    if (data && size)
        memcpy(fill + offset, data, size);
    cl_mem m = clCreateBuffer(c, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, total ? total : 1, fill, err);
    free(fill);
    return m;
}

static cl_mem poison_mem(cl_context c, size_t total)
{
    cl_int err = CL_SUCCESS;
    cl_mem m = make_mem(c, total, 0, NULL, 0, &err);
    ck_assert_msg(m != NULL, "clCreateBuffer(%zu bytes): %d", total, err);
    return m;
}

static size_t mem_size(cl_mem m)
{
    size_t s = 0;
    ck_assert_int_eq(clGetMemObjectInfo(m, CL_MEM_SIZE, sizeof(s), &s, NULL), CL_SUCCESS);
    return s;
}

/* Fails the test unless every byte of m (read through q) is poison. */
static void assert_mem_poison(cl_command_queue q, cl_mem m, const char *what, const char *label)
{
    size_t n = mem_size(m);
    unsigned char *buf = malloc(n);
    ck_assert_ptr_nonnull(buf);
    cl_int err = clEnqueueReadBuffer(q, m, CL_TRUE, 0, n, buf, 0, NULL, NULL);
    size_t at = first_unpoisoned(buf, n);
    free(buf);
    ck_assert_msg(err == CL_SUCCESS, "%s: reading %s back: %d", label, what, err);
    ck_assert_msg(at == n, "%s: %s changed at byte %zu of %zu", label, what, at, n);
}

static cl_int event_status(cl_event ev)
{
    cl_int s = -12345;
    ck_assert_int_eq(clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(s), &s, NULL), CL_SUCCESS);
    return s;
}

static cl_uint context_refs(cl_context c)
{
    cl_uint n = 0;
    ck_assert_int_eq(clGetContextInfo(c, CL_CONTEXT_REFERENCE_COUNT, sizeof(n), &n, NULL), CL_SUCCESS);
    return n;
}

static cl_uint queue_refs(cl_command_queue q)
{
    cl_uint n = 0;
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_REFERENCE_COUNT, sizeof(n), &n, NULL), CL_SUCCESS);
    return n;
}

/* Wait until c's and q's (q may be NULL) reference counts are back to
 * want_c and want_q: a driver may drop the references its finished
 * commands' events hold on a worker thread, after clWaitForEvents has
 * returned (pocl does). A leak or an extra release never settles. */
static void assert_refs_settle(cl_context c, cl_uint want_c, cl_command_queue q, cl_uint want_q, const char *label)
{
    cl_uint rc = 0, rq = 0;
    for (int i = 0; i < 500; i++) {
        rc = context_refs(c);
        rq = q ? queue_refs(q) : want_q;
        if (rc == want_c && rq == want_q)
            return;
        sleep_ms(10);
    }
    ck_abort_msg("%s: reference counts %u (context) and %u (queue), expected %u and %u", label, rc, rq, want_c,
                 want_q);
}

/* Overwrite ctx's error detail with a known one ("desc is NULL"), so that a
 * later check of the message cannot pass on a stale detail. */
static void reset_error(moecl_context *ctx)
{
    moecl_status st = moecl_topk_gating_prepare(ctx, NULL);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(ctx), "desc") != NULL, "prepare(NULL desc) says \"%s\"",
                  moecl_context_error(ctx));
}

/* The same for moecl_context_error(NULL): a failed adopt of NULL objects. */
static void reset_null_error(void)
{
    moecl_context *c = CTX_SENTINEL;
    ck_assert_int_eq(moecl_context_create_from_cl(NULL, NULL, NULL, &c), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_null(c);
    ck_assert_msg(strstr(moecl_context_error(NULL), "context") != NULL, "adopt(NULL) says \"%s\"",
                  moecl_context_error(NULL));
}

/* ctx's error detail contains what, or one of its '|'-separated
 * alternatives. */
static void assert_error_names(moecl_context *ctx, const char *what, const char *label)
{
    const char *msg = moecl_context_error(ctx);
    ck_assert_ptr_nonnull(msg);
    bool found = false;
    for (const char *p = what; *p && !found;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        char alt[128];
        snprintf(alt, sizeof(alt), "%.*s", (int)len, p);
        found = len > 0 && strstr(msg, alt) != NULL;
        p += len + (bar ? 1 : 0);
    }
    ck_assert_msg(found, "%s: the message \"%s\" does not name %s", label, msg, what);
}

/* ---------------------------------------------------------------------- */
/* One routed request, checked against the reference                       */
/* ---------------------------------------------------------------------- */

typedef enum route_path { PATH_HOST = 0, PATH_DEVICE = 1 } route_path;

#define SLACK 64

/* The device path: inputs copied into poisoned buffers at offset, outputs
 * poisoned, one call with a done event, wait, read back; the bytes before
 * the offset and after the tensor must still be poison. Returns 0 or
 * writes why into msg. No Check calls. */
static int route_device(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const float *bias,
                        float *w, int32_t *ids, size_t offset, char *msg, size_t msg_size)
{
    const size_t t = d->num_tokens, e = d->num_experts, k = d->top_k;
    const size_t gbytes = t * e * ref_dtype_size(d->gating_dtype), obytes = t * k * 4;
    cl_context c = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    cl_int err = CL_SUCCESS;
    cl_mem mg = make_mem(c, offset + gbytes + SLACK, offset, gating, gbytes, &err);
    cl_mem mb = bias && mg ? make_mem(c, offset + e * 4 + SLACK, offset, bias, e * 4, &err) : NULL;
    cl_mem mw = mg ? make_mem(c, offset + obytes + SLACK, offset, NULL, 0, &err) : NULL;
    cl_mem mi = mw ? make_mem(c, offset + obytes + SLACK, offset, NULL, 0, &err) : NULL;
    unsigned char *all = malloc(offset + obytes + SLACK);
    cl_event done = NULL;
    int bad = 1;
    if (!mg || (bias && !mb) || !mw || !mi || !all) {
        snprintf(msg, msg_size, "making the buffers failed (%d)", err);
        goto out;
    }
    moecl_buffer bg = {mg, offset}, bb = {mb, offset}, bw = {mw, offset}, bi = {mi, offset};
    moecl_status st = moecl_topk_gating(ctx, d, bg, bb, bw, bi, 0, NULL, &done);
    if (st != MOECL_SUCCESS) {
        snprintf(msg, msg_size, "moecl_topk_gating: %s (%d): %s", moecl_status_string(st), (int)st,
                 moecl_context_error(ctx));
        goto out;
    }
    if (!done) {
        snprintf(msg, msg_size, "moecl_topk_gating succeeded but gave no event");
        goto out;
    }
    if ((err = clWaitForEvents(1, &done)) != CL_SUCCESS) {
        snprintf(msg, msg_size, "clWaitForEvents on the call's event: %d", err);
        goto out;
    }
    cl_mem outs[2] = {mw, mi};
    void *dst[2] = {w, ids};
    for (int i = 0; i < 2; i++) {
        err = clEnqueueReadBuffer(q, outs[i], CL_TRUE, 0, offset + obytes + SLACK, all, 0, NULL, NULL);
        if (err != CL_SUCCESS) {
            snprintf(msg, msg_size, "reading %s back: %d", i ? "topk_ids" : "topk_weights", err);
            goto out;
        }
        size_t before = first_unpoisoned(all, offset), after = first_unpoisoned(all + offset + obytes, SLACK);
        if (before != offset || after != SLACK) {
            snprintf(msg, msg_size, "%s: a byte outside the tensor changed (%s it, offset %zu)",
                     i ? "topk_ids" : "topk_weights", before != offset ? "before" : "after", offset);
            goto out;
        }
        memcpy(dst[i], all + offset, obytes);
    }
    bad = 0;
out:
    if (done)
        clReleaseEvent(done);
    free(all);
    cl_mem mems[4] = {mg, mb, mw, mi};
    for (int i = 0; i < 4; i++)
        if (mems[i])
            clReleaseMemObject(mems[i]);
    return bad;
}

/* Route d on fresh random inputs (bias optional) through path and compare
 * with the reference. Returns 0 when it agrees, else writes why into msg.
 * No Check calls: safe from any thread. */
static int route_once(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng, bool with_bias,
                      route_path path, size_t offset, char *msg, size_t msg_size)
{
    const size_t t = d->num_tokens, e = d->num_experts, k = d->top_k;
    void *gating = gen_tensor(rng, d->gating_dtype, t * e, 2.0f);
    /* Bias of the size of a typical softmax score, so it changes picks. */
    float *bias = with_bias ? gen_tensor(rng, MOECL_F32, e, 2.0f / (float)e) : NULL;
    float *w = poisoned(t * k * 4);
    int32_t *ids = poisoned(t * k * 4);
    int bad = 1;
    char where[96];
    snprintf(where, sizeof(where), "%s path, T=%zu E=%zu k=%zu, %s bias, offset %zu",
             path == PATH_HOST ? "host" : "device", t, e, k, with_bias ? "with" : "no", offset);
    if (!gating || (with_bias && !bias) || !w || !ids) {
        snprintf(msg, msg_size, "%s: out of host memory", where);
        goto out;
    }
    if (path == PATH_HOST) {
        moecl_status st = moecl_topk_gating_host(ctx, d, gating, bias, w, ids);
        if (st != MOECL_SUCCESS) {
            snprintf(msg, msg_size, "%s: moecl_topk_gating_host: %s (%d): %s", where, moecl_status_string(st),
                     (int)st, moecl_context_error(ctx));
            goto out;
        }
    } else {
        char detail[600];
        if (route_device(ctx, d, gating, bias, w, ids, offset, detail, sizeof(detail))) {
            snprintf(msg, msg_size, "%s: %s", where, detail);
            goto out;
        }
    }
    char detail[600] = "";
    int rows = ref_check_topk_gating(d, gating, bias, w, ids, detail, sizeof(detail));
    if (rows) {
        snprintf(msg, msg_size, "%s: %d bad rows: %s", where, rows, detail);
        goto out;
    }
    bad = 0;
out:
    free(gating);
    free(bias);
    free(w);
    free(ids);
    return bad;
}

static void check_route(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng, bool with_bias,
                        route_path path, size_t offset)
{
    char msg[1024] = "";
    ck_assert_msg(route_once(ctx, d, rng, with_bias, path, offset, msg, sizeof(msg)) == 0, "%s", msg);
}

/* Host and device path, with and without bias. */
static void check_all_routes(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng)
{
    check_route(ctx, d, rng, false, PATH_HOST, 0);
    check_route(ctx, d, rng, true, PATH_HOST, 0);
    check_route(ctx, d, rng, false, PATH_DEVICE, 256);
    check_route(ctx, d, rng, true, PATH_DEVICE, 4);
}

/* ---------------------------------------------------------------------- */
/* Environment fixture: saved variables and a temporary directory          */
/* ---------------------------------------------------------------------- */

static const char *const fx_names[] = {"MOECL_DEVICE", "MOECL_CACHE_DIR", "MOECL_KERNEL_DIR", "XDG_CACHE_HOME",
                                       "HOME"};
#define FX_COUNT (sizeof(fx_names) / sizeof(fx_names[0]))
static char *fx_values[FX_COUNT];
static char fx_root[PATH_MAX];

static int make_writable(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)ftw;
    if (type == FTW_D || type == FTW_DNR)
        chmod(path, 0700);
    return 0;
}

static int remove_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    remove(path);
    return 0;
}

static void rm_rf(const char *path)
{
    nftw(path, make_writable, 16, FTW_PHYS);
    nftw(path, remove_entry, 16, FTW_PHYS | FTW_DEPTH);
}

static void env_setup(void)
{
    for (size_t i = 0; i < FX_COUNT; i++) {
        const char *v = getenv(fx_names[i]);
        fx_values[i] = v ? strdup(v) : NULL;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(fx_root, sizeof(fx_root), "%s/moecl-runtime-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    ck_assert_msg(mkdtemp(fx_root) != NULL, "mkdtemp(%s): %s", fx_root, strerror(errno));
}

static void env_teardown(void)
{
    for (size_t i = 0; i < FX_COUNT; i++) {
        if (fx_values[i])
            setenv(fx_names[i], fx_values[i], 1);
        else
            unsetenv(fx_names[i]);
        free(fx_values[i]);
        fx_values[i] = NULL;
    }
    if (fx_root[0])
        rm_rf(fx_root);
    fx_root[0] = '\0';
}

/* fx_root/name, in a static buffer per call site (callers copy it). */
static void fx_path(char *out, size_t size, const char *name)
{
    int n = snprintf(out, size, "%s/%s", fx_root, name);
    ck_assert(n > 0 && (size_t)n < size);
}

static bool read_whole(const char *path, unsigned char **data, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return false;
    unsigned char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 65536;
            unsigned char *grown = realloc(buf, cap);
            if (!grown) {
                free(buf);
                fclose(f);
                return false;
            }
            buf = grown;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    *data = buf;
    *size = n;
    return true;
}

static void write_whole(const char *path, const void *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "fopen(%s): %s", path, strerror(errno));
    ck_assert(fwrite(data, 1, size, f) == size);
    ck_assert(fclose(f) == 0);
}

static void copy_file(const char *from, const char *to)
{
    unsigned char *data;
    size_t size;
    ck_assert_msg(read_whole(from, &data, &size), "reading %s: %s", from, strerror(errno));
    write_whole(to, data, size);
    free(data);
}

/* Number of entries (files, directories, anything) below path. */
static int walk_count;
static char walk_first[PATH_MAX];
static int count_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    if (ftw->level > 0 && walk_count++ == 0)
        snprintf(walk_first, sizeof(walk_first), "%s", path);
    return 0;
}

static int entries_below(const char *path)
{
    walk_count = 0;
    walk_first[0] = '\0';
    nftw(path, count_entry, 16, FTW_PHYS);
    return walk_count;
}

/* ---------------------------------------------------------------------- */
/* 1. Status strings and version                                          */
/* ---------------------------------------------------------------------- */

START_TEST(test_status_strings)
{
    const moecl_status lib[] = {MOECL_SUCCESS,         MOECL_ERROR_INVALID_ARGUMENT, MOECL_ERROR_UNSUPPORTED,
                                MOECL_ERROR_NO_DEVICE, MOECL_ERROR_BUILD,            MOECL_ERROR_OUT_OF_MEMORY};
    const size_t nlib = sizeof(lib) / sizeof(lib[0]);
    for (size_t i = 0; i < nlib; i++) {
        const char *s = moecl_status_string(lib[i]);
        ck_assert_msg(s != NULL && s[0], "status %d has no string", (int)lib[i]);
        ck_assert_msg(strcmp(s, "unknown status") != 0, "status %d is \"unknown status\"", (int)lib[i]);
        for (size_t j = 0; j < i; j++)
            ck_assert_msg(strcmp(s, moecl_status_string(lib[j])) != 0, "statuses %d and %d share \"%s\"",
                          (int)lib[i], (int)lib[j], s);
    }
    /* The two the header quotes. */
    ck_assert_str_eq(moecl_status_string(MOECL_SUCCESS), "success");
    ck_assert_str_eq(moecl_status_string(MOECL_ERROR_INVALID_ARGUMENT), "invalid argument");

    /* OpenCL codes pass through and are named. */
    static const struct {
        cl_int code;
        const char *name;
    } cl[] = {
        {CL_OUT_OF_RESOURCES, "CL_OUT_OF_RESOURCES"},
        {CL_OUT_OF_HOST_MEMORY, "CL_OUT_OF_HOST_MEMORY"},
        {CL_INVALID_VALUE, "CL_INVALID_VALUE"},
        {CL_BUILD_PROGRAM_FAILURE, "CL_BUILD_PROGRAM_FAILURE"},
        {CL_INVALID_EVENT_WAIT_LIST, "CL_INVALID_EVENT_WAIT_LIST"},
        {CL_INVALID_MEM_OBJECT, "CL_INVALID_MEM_OBJECT"},
        {CL_DEVICE_NOT_FOUND, "CL_DEVICE_NOT_FOUND"},
        {CL_INVALID_KERNEL_ARGS, "CL_INVALID_KERNEL_ARGS"},
    };
    for (size_t i = 0; i < sizeof(cl) / sizeof(cl[0]); i++) {
        const char *s = moecl_status_string((moecl_status)cl[i].code);
        ck_assert_msg(s != NULL && s[0], "CL code %d has no string", cl[i].code);
        ck_assert_msg(strstr(s, cl[i].name) != NULL, "CL code %d gives \"%s\", not %s", cl[i].code, s, cl[i].name);
        for (size_t j = 0; j < nlib; j++)
            ck_assert_msg(strcmp(s, moecl_status_string(lib[j])) != 0, "CL code %d shares \"%s\" with status %d",
                          cl[i].code, s, (int)lib[j]);
    }

    /* Codes that are neither: positive, or past the library's range. */
    static const int unknown[] = {1, 7, 12345, INT_MAX, -2005, -2100, -3000, -1000000, INT_MIN};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        const char *s = moecl_status_string((moecl_status)unknown[i]);
        ck_assert_msg(s != NULL && strcmp(s, "unknown status") == 0, "code %d gives \"%s\"", unknown[i],
                      s ? s : "(null)");
    }

    /* "MAJOR.MINOR.PATCH", a static string. */
    const char *v = moecl_version();
    ck_assert_ptr_nonnull(v);
    ck_assert_ptr_eq(v, moecl_version());
    const char *p = v;
    for (int part = 0; part < 3; part++) {
        ck_assert_msg(isdigit((unsigned char)*p), "version \"%s\" is not MAJOR.MINOR.PATCH", v);
        while (isdigit((unsigned char)*p))
            p++;
        if (part < 2) {
            ck_assert_msg(*p == '.', "version \"%s\" is not MAJOR.MINOR.PATCH", v);
            p++;
        }
    }
    ck_assert_msg(*p == '\0', "version \"%s\" has trailing text", v);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 2. desc_init                                                           */
/* ---------------------------------------------------------------------- */

START_TEST(test_desc_init)
{
    static const uint32_t shapes[][3] = {{7, 128, 8}, {0, 1, 1}, {100000, 4096, 64}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(shapes[i][0], shapes[i][1], shapes[i][2]);
        ck_assert_uint_eq(d.num_tokens, shapes[i][0]);
        ck_assert_uint_eq(d.num_experts, shapes[i][1]);
        ck_assert_uint_eq(d.top_k, shapes[i][2]);
        ck_assert_uint_eq(d.num_expert_groups, 0);
        ck_assert_uint_eq(d.topk_group, 0);
        ck_assert_int_eq(d.gating_dtype, MOECL_F32);
        ck_assert_int_eq(d.scoring, MOECL_SCORING_SOFTMAX);
        ck_assert_int_eq(d.group_score, MOECL_GROUP_SCORE_MAX);
        ck_assert(d.renormalize == false);
        ck_assert_msg(d.routed_scaling_factor == 1.0f, "routed_scaling_factor is %g",
                      (double)d.routed_scaling_factor);
        ck_assert_msg(d.renormalize_floor == 0.0f, "renormalize_floor is %g", (double)d.renormalize_floor);
        ck_assert_int_eq(d.group_fill, MOECL_GROUP_FILL_NEG_INF);
    }
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 3. Invalid descriptors                                                 */
/* ---------------------------------------------------------------------- */

#define BAD_T 4u
#define BAD_MAX_E 4200u
#define BAD_MAX_K 70u

/* The i-th invalid descriptor, made from a valid one (T=4, E=16, k=4);
 * false past the last. field is the name the message must contain. */
static bool bad_desc(int i, moecl_topk_gating_desc *d, const char **field, const char **label)
{
    *d = moecl_topk_gating_desc_init(BAD_T, EA, KA);
#define CASE(n, lbl, fld, ...)                                                                                       \
    case n:                                                                                                          \
        __VA_ARGS__;                                                                                                 \
        *field = fld;                                                                                                \
        *label = lbl;                                                                                                \
        return true;
    switch (i) {
        CASE(0, "num_experts 0", "num_experts", d->num_experts = 0)
        CASE(1, "num_experts 4097", "num_experts", d->num_experts = 4097)
        CASE(2, "top_k 0", "top_k", d->top_k = 0)
        CASE(3, "top_k > num_experts", "top_k", d->top_k = EA + 1)
        CASE(4, "top_k 65 with E=128", "top_k", d->num_experts = EB; d->top_k = 65)
        CASE(5, "groups 3 do not divide 16", "num_expert_groups", d->num_expert_groups = 3; d->topk_group = 1)
        CASE(6, "groups 32 > 16 experts", "num_expert_groups", d->num_expert_groups = 32; d->topk_group = 1)
        CASE(7, "topk_group 0 with groups", "topk_group", d->num_expert_groups = 4; d->topk_group = 0)
        CASE(8, "topk_group > groups", "topk_group", d->num_expert_groups = 4; d->topk_group = 5)
        CASE(9, "topk_group without groups", "topk_group", d->topk_group = 1)
        CASE(10, "top_k > topk_group * group size", "top_k|topk_group", d->num_expert_groups = 4; d->topk_group = 1;
             d->top_k = 5)
        CASE(11, "gating_dtype 7", "gating_dtype", d->gating_dtype = (moecl_dtype)7)
        CASE(12, "gating_dtype -1", "gating_dtype", d->gating_dtype = (moecl_dtype)-1)
        CASE(13, "scoring 7", "scoring", d->scoring = (moecl_scoring)7)
        CASE(14, "group_score 7 without groups", "group_score", d->group_score = (moecl_group_score)7)
        CASE(15, "group_score 7 with groups", "group_score", d->num_expert_groups = 4; d->topk_group = 2;
             d->group_score = (moecl_group_score)7)
        CASE(16, "routed_scaling_factor NaN", "routed_scaling_factor", d->routed_scaling_factor = NAN)
        CASE(17, "routed_scaling_factor +inf", "routed_scaling_factor", d->routed_scaling_factor = INFINITY)
        CASE(18, "routed_scaling_factor -inf", "routed_scaling_factor", d->routed_scaling_factor = -INFINITY)
        CASE(19, "renormalize_floor NaN", "renormalize_floor", d->renormalize = true; d->renormalize_floor = NAN)
        CASE(20, "renormalize_floor +inf", "renormalize_floor", d->renormalize = true;
             d->renormalize_floor = INFINITY)
        CASE(21, "renormalize_floor -1", "renormalize_floor", d->renormalize = true; d->renormalize_floor = -1.0f)
        CASE(22, "renormalize_floor -FLT_MIN", "renormalize_floor", d->renormalize_floor = -FLT_MIN)
        CASE(23, "renormalize_floor subnormal", "renormalize_floor", d->renormalize = true;
             d->renormalize_floor = 0x1p-140f)
        CASE(24, "renormalize_floor NaN without renormalize", "renormalize_floor", d->renormalize_floor = NAN)
        CASE(25, "group_fill 7 without groups", "group_fill", d->group_fill = (moecl_group_fill)7)
        CASE(26, "group_fill 2 with groups", "group_fill", d->num_expert_groups = 4; d->topk_group = 2;
             d->group_fill = (moecl_group_fill)2)
        CASE(27, "group_fill -1", "group_fill", d->group_fill = (moecl_group_fill)-1)
    default:
        return false;
    }
#undef CASE
}

START_TEST(test_invalid_desc)
{
    moecl_context *ctx = harness_context();
    cl_command_queue q = moecl_context_queue(ctx);
    harness_rng rng = harness_rng_for(30);

    /* Buffers large enough for every shape below, so the descriptor is the
     * only thing wrong. */
    float *hg = harness_random_tensor(&rng, MOECL_F32, (size_t)BAD_T * BAD_MAX_E, 1.0f);
    float *hb = harness_random_tensor(&rng, MOECL_F32, BAD_MAX_E, 0.1f);
    const size_t obytes = (size_t)BAD_T * BAD_MAX_K * 4;
    moecl_buffer g = harness_buffer(ctx, (size_t)BAD_T * BAD_MAX_E * 4, 256, hg);
    moecl_buffer b = harness_buffer(ctx, BAD_MAX_E * 4, 256, hb);
    moecl_buffer w = harness_buffer(ctx, obytes, 256, NULL);
    moecl_buffer ids = harness_buffer(ctx, obytes, 256, NULL);
    float *hw = malloc(obytes);
    int32_t *hids = malloc(obytes);
    ck_assert(hw && hids);

    moecl_topk_gating_desc d;
    const char *field, *label;
    int cases = 0;
    for (int i = 0; bad_desc(i, &d, &field, &label); i++, cases++) {
        char lbl[128];
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            snprintf(lbl, sizeof(lbl), "%s (device path, %s bias)", label, with_bias ? "with" : "no");
            reset_error(ctx);
            cl_event done = DONE_SENTINEL;
            moecl_buffer bias = {with_bias ? b.mem : NULL, with_bias ? b.offset : 0};
            moecl_status st = moecl_topk_gating(ctx, &d, g, bias, w, ids, 0, NULL, &done);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st,
                          moecl_status_string(st));
            assert_error_names(ctx, field, lbl);
            ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written", lbl);
            assert_mem_poison(q, w.mem, "topk_weights", lbl);
            assert_mem_poison(q, ids.mem, "topk_ids", lbl);

            snprintf(lbl, sizeof(lbl), "%s (host path, %s bias)", label, with_bias ? "with" : "no");
            reset_error(ctx);
            memset(hw, HARNESS_POISON, obytes);
            memset(hids, HARNESS_POISON, obytes);
            st = moecl_topk_gating_host(ctx, &d, hg, with_bias ? hb : NULL, hw, hids);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st,
                          moecl_status_string(st));
            assert_error_names(ctx, field, lbl);
            ck_assert_msg(first_unpoisoned(hw, obytes) == obytes, "%s: topk_weights written", lbl);
            ck_assert_msg(first_unpoisoned(hids, obytes) == obytes, "%s: topk_ids written", lbl);
        }
        snprintf(lbl, sizeof(lbl), "%s (prepare)", label);
        reset_error(ctx);
        moecl_status st = moecl_topk_gating_prepare(ctx, &d);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st, moecl_status_string(st));
        assert_error_names(ctx, field, lbl);
    }
    ck_assert_int_eq(cases, 28);

    /* The base descriptor itself is valid (so the cases above fail for the
     * field they change, not for something they share). */
    d = moecl_topk_gating_desc_init(BAD_T, EA, KA);
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
    /* The edges of the floor that are valid: FLT_MIN, -0 (a zero), and a
     * floor without renormalize. */
    d.renormalize = true;
    d.renormalize_floor = FLT_MIN;
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
    d.renormalize_floor = -0.0f;
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
    d.renormalize = false;
    d.renormalize_floor = 6.103515625e-5f;
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);

    harness_release(g);
    harness_release(b);
    harness_release(w);
    harness_release(ids);
    free(hg);
    free(hb);
    free(hw);
    free(hids);
    moecl_context_destroy(ctx);
}
END_TEST

START_TEST(test_null_arguments)
{
    moecl_context *ctx = harness_context();
    cl_command_queue q = moecl_context_queue(ctx);
    harness_rng rng = harness_rng_for(31);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(6, EA, KA);
    const size_t obytes = 6 * KA * 4;
    float *hg = harness_random_tensor(&rng, MOECL_F32, 6 * EA, 1.0f);
    moecl_buffer g = harness_buffer(ctx, 6 * EA * 4, 0, hg);
    moecl_buffer w = harness_buffer(ctx, obytes, 0, NULL);
    moecl_buffer ids = harness_buffer(ctx, obytes, 0, NULL);
    moecl_buffer none = {NULL, 0};
    float *hw = poisoned(obytes);
    int32_t *hids = poisoned(obytes);
    ck_assert(hw && hids);
    moecl_status st;
    cl_event done;

    /* NULL ctx: the detail goes to moecl_context_error(NULL). */
    reset_null_error();
    done = DONE_SENTINEL;
    st = moecl_topk_gating(NULL, &d, g, none, w, ids, 0, NULL, &done);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(done == DONE_SENTINEL, "NULL ctx: *done was written");
    assert_error_names(NULL, "ctx", "moecl_topk_gating(NULL ctx)");
    reset_null_error();
    ck_assert_int_eq(moecl_topk_gating_host(NULL, &d, hg, NULL, hw, hids), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(NULL, "ctx", "moecl_topk_gating_host(NULL ctx)");
    reset_null_error();
    ck_assert_int_eq(moecl_topk_gating_prepare(NULL, &d), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(NULL, "ctx", "moecl_topk_gating_prepare(NULL ctx)");

    /* NULL desc. */
    reset_error(ctx);
    moecl_topk_gating_host(ctx, &d, NULL, NULL, hw, hids); /* leaves a "gating" detail */
    done = DONE_SENTINEL;
    st = moecl_topk_gating(ctx, NULL, g, none, w, ids, 0, NULL, &done);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(done == DONE_SENTINEL, "NULL desc: *done was written");
    assert_error_names(ctx, "desc", "moecl_topk_gating(NULL desc)");
    moecl_topk_gating_host(ctx, &d, NULL, NULL, hw, hids);
    ck_assert_int_eq(moecl_topk_gating_host(ctx, NULL, hg, NULL, hw, hids), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "desc", "moecl_topk_gating_host(NULL desc)");

    /* Missing required buffers (mem NULL) on the device path. */
    static const char *const names[] = {"gating", "topk_weights", "topk_ids"};
    for (int i = 0; i < 3; i++) {
        moecl_buffer args[3] = {g, w, ids};
        args[i] = none;
        reset_error(ctx);
        done = DONE_SENTINEL;
        st = moecl_topk_gating(ctx, &d, args[0], none, args[1], args[2], 0, NULL, &done);
        char lbl[96];
        snprintf(lbl, sizeof(lbl), "device path without %s", names[i]);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", lbl, (int)st);
        assert_error_names(ctx, names[i], lbl);
        ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written", lbl);
    }
    /* ... and NULL pointers on the host path. */
    for (int i = 0; i < 3; i++) {
        const void *pg = i == 0 ? NULL : hg;
        float *pw = i == 1 ? NULL : hw;
        int32_t *pi = i == 2 ? NULL : hids;
        reset_error(ctx);
        st = moecl_topk_gating_host(ctx, &d, pg, NULL, pw, pi);
        char lbl[96];
        snprintf(lbl, sizeof(lbl), "host path without %s", names[i]);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", lbl, (int)st);
        assert_error_names(ctx, names[i], lbl);
        ck_assert_msg(first_unpoisoned(hw, obytes) == obytes, "%s: topk_weights written", lbl);
        ck_assert_msg(first_unpoisoned(hids, obytes) == obytes, "%s: topk_ids written", lbl);
    }
    assert_mem_poison(q, w.mem, "topk_weights", "missing buffers");
    assert_mem_poison(q, ids.mem, "topk_ids", "missing buffers");

    /* An absent bias is fine, on both paths (and a present one too). */
    moecl_topk_gating_desc d2 = moecl_topk_gating_desc_init(23, EA, KA);
    check_all_routes(ctx, &d2, &rng);

    harness_release(g);
    harness_release(w);
    harness_release(ids);
    free(hg);
    free(hw);
    free(hids);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 4. Buffer validation                                                   */
/* ---------------------------------------------------------------------- */

START_TEST(test_invalid_buffers)
{
    moecl_context *ctx = harness_context();
    moecl_context *other = harness_context();
    cl_context c = moecl_context_cl_context(ctx), oc = moecl_context_cl_context(other);
    cl_command_queue q = moecl_context_queue(ctx), oq = moecl_context_queue(other);
    ck_assert_ptr_ne(c, oc);
    harness_rng rng = harness_rng_for(40);
    const uint32_t T = 8;
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(T, EA, KA);
    static const char *const names[4] = {"gating", "bias", "topk_weights", "topk_ids"};
    const size_t exact[4] = {T * EA * 4, EA * 4, T * KA * 4, T * KA * 4};
    float *hg = harness_random_tensor(&rng, MOECL_F32, T * EA, 2.0f);
    float *hb = harness_random_tensor(&rng, MOECL_F32, EA, 0.1f);

    /* The valid arguments, each exactly as large as the shape needs. */
    cl_mem valid[4];
    for (int i = 0; i < 4; i++)
        valid[i] = poison_mem(c, exact[i]);
    ck_assert_int_eq(clEnqueueWriteBuffer(q, valid[0], CL_TRUE, 0, exact[0], hg, 0, NULL, NULL), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueWriteBuffer(q, valid[1], CL_TRUE, 0, exact[1], hb, 0, NULL, NULL), CL_SUCCESS);

    enum { TOO_SMALL, PAST_END, FAR_PAST_END, OFFSET_OVERFLOWS, UNALIGNED, FOREIGN, NUM_KINDS };
    static const char *const kinds[NUM_KINDS] = {"buffer 4 bytes too small", "offset just past the end",
                                                 "offset far past the end", "offset leaves too little room",
                                                 "offset not a multiple of 4", "buffer of another cl_context"};
    for (int arg = 0; arg < 4; arg++) {
        for (int kind = 0; kind < NUM_KINDS; kind++) {
            moecl_buffer args[4];
            for (int i = 0; i < 4; i++)
                args[i] = (moecl_buffer){valid[i], 0};
            cl_mem made = NULL;
            cl_command_queue made_q = q;
            switch (kind) {
            case TOO_SMALL:
                made = poison_mem(c, exact[arg] - 4);
                args[arg] = (moecl_buffer){made, 0};
                break;
            case PAST_END:
                args[arg].offset = exact[arg] + 4;
                break;
            case FAR_PAST_END:
                args[arg].offset = (size_t)1 << 40;
                break;
            case OFFSET_OVERFLOWS:
                args[arg].offset = 4;
                break;
            case UNALIGNED:
                made = poison_mem(c, exact[arg] + 64);
                args[arg] = (moecl_buffer){made, 2};
                break;
            case FOREIGN:
                made = poison_mem(oc, exact[arg]);
                made_q = oq;
                args[arg] = (moecl_buffer){made, 0};
                break;
            }
            char lbl[128];
            snprintf(lbl, sizeof(lbl), "%s: %s", names[arg], kinds[kind]);
            reset_error(ctx);
            cl_event done = DONE_SENTINEL;
            moecl_status st = moecl_topk_gating(ctx, &d, args[0], args[1], args[2], args[3], 0, NULL, &done);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st,
                          moecl_status_string(st));
            assert_error_names(ctx, names[arg], lbl);
            ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written (something was enqueued)", lbl);
            for (int o = 2; o < 4; o++)
                assert_mem_poison(o == arg ? made_q : q, args[o].mem, names[o], lbl);
            if (made)
                clReleaseMemObject(made);
        }
    }

    /* f16 logits: an offset of 2 bytes is one element, 3 is not. */
    {
        moecl_topk_gating_desc dh = d;
        dh.gating_dtype = MOECL_F16;
        cl_mem gh = poison_mem(c, T * EA * 2 + 64);
        reset_error(ctx);
        cl_event done = DONE_SENTINEL;
        moecl_status st = moecl_topk_gating(ctx, &dh, (moecl_buffer){gh, 3}, (moecl_buffer){NULL, 0},
                                            (moecl_buffer){valid[2], 0}, (moecl_buffer){valid[3], 0}, 0, NULL, &done);
        ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
        assert_error_names(ctx, "gating", "f16 gating at byte offset 3");
        ck_assert(done == DONE_SENTINEL);
        clReleaseMemObject(gh);
    }

    /* Wait lists: num_wait > 0 with wait NULL; a NULL event; an event of
     * another cl_context. The last two are errors in OpenCL too; any error
     * status will do, but nothing may be enqueued. */
    {
        cl_int err;
        cl_event foreign = clCreateUserEvent(oc, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
        cl_event null_event = NULL;
        struct {
            cl_uint n;
            const cl_event *list;
            const char *label;
            bool exact_status;
        } waits[] = {
            {1, NULL, "num_wait 1 with wait NULL", true},
            {3, NULL, "num_wait 3 with wait NULL", true},
            {1, &null_event, "a NULL event in wait", false},
            {1, &foreign, "an event of another cl_context in wait", false},
        };
        moecl_buffer args[4];
        for (int i = 0; i < 4; i++)
            args[i] = (moecl_buffer){valid[i], 0};
        for (size_t i = 0; i < sizeof(waits) / sizeof(waits[0]); i++) {
            reset_error(ctx);
            cl_event done = DONE_SENTINEL;
            moecl_status st =
                moecl_topk_gating(ctx, &d, args[0], args[1], args[2], args[3], waits[i].n, waits[i].list, &done);
            if (waits[i].exact_status) {
                ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", waits[i].label, (int)st);
                assert_error_names(ctx, "wait", waits[i].label);
            } else {
                ck_assert_msg(st != MOECL_SUCCESS, "%s: accepted", waits[i].label);
            }
            ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written", waits[i].label);
            assert_mem_poison(q, valid[2], "topk_weights", waits[i].label);
            assert_mem_poison(q, valid[3], "topk_ids", waits[i].label);
        }
        clSetUserEventStatus(foreign, CL_COMPLETE);
        clReleaseEvent(foreign);
    }

    /* Buffers of exactly the size needed are accepted and give the right
     * answer: the limits above are tight. */
    {
        cl_event done = NULL;
        moecl_status st = moecl_topk_gating(ctx, &d, (moecl_buffer){valid[0], 0}, (moecl_buffer){valid[1], 0},
                                            (moecl_buffer){valid[2], 0}, (moecl_buffer){valid[3], 0}, 0, NULL, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "exact sizes: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
        ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
        clReleaseEvent(done);
        float hw[T * KA];
        int32_t hi[T * KA];
        ck_assert_int_eq(clEnqueueReadBuffer(q, valid[2], CL_TRUE, 0, sizeof(hw), hw, 0, NULL, NULL), CL_SUCCESS);
        ck_assert_int_eq(clEnqueueReadBuffer(q, valid[3], CL_TRUE, 0, sizeof(hi), hi, 0, NULL, NULL), CL_SUCCESS);
        char msg[600];
        ck_assert_msg(ref_check_topk_gating(&d, hg, hb, hw, hi, msg, sizeof(msg)) == 0, "exact sizes: %s", msg);
    }

    for (int i = 0; i < 4; i++)
        clReleaseMemObject(valid[i]);
    free(hg);
    free(hb);
    moecl_context_destroy(other);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 5. num_tokens == 0                                                      */
/* ---------------------------------------------------------------------- */

START_TEST(test_zero_tokens)
{
    moecl_context *ctx = harness_context();
    cl_context c = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(0, EA, KA);
    moecl_buffer g = harness_buffer(ctx, 64, 0, NULL);
    moecl_buffer b = harness_buffer(ctx, EA * 4, 0, NULL);
    moecl_buffer w = harness_buffer(ctx, 64, 0, NULL);
    moecl_buffer ids = harness_buffer(ctx, 64, 0, NULL);
    moecl_buffer none = {NULL, 0};

    /* Without an event. */
    moecl_status st = moecl_topk_gating(ctx, &d, g, none, w, ids, 0, NULL, NULL);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0: %s: %s", moecl_status_string(st), moecl_context_error(ctx));

    /* With one: a valid event of this context that completes. */
    cl_event done = NULL;
    st = moecl_topk_gating(ctx, &d, g, b, w, ids, 0, NULL, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0 with done: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    cl_context ev_ctx = NULL;
    ck_assert_int_eq(clGetEventInfo(done, CL_EVENT_CONTEXT, sizeof(ev_ctx), &ev_ctx, NULL), CL_SUCCESS);
    ck_assert_ptr_eq(ev_ctx, c);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    ck_assert_int_eq(event_status(done), CL_COMPLETE);
    clReleaseEvent(done);

    /* With a wait list: the event completes only after it. */
    cl_int err;
    cl_event user = clCreateUserEvent(c, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    done = NULL;
    st = moecl_topk_gating(ctx, &d, g, none, w, ids, 1, &user, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0 with a wait list: %s: %s", moecl_status_string(st),
                  moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    clFlush(q);
    sleep_ms(20);
    cl_int early = event_status(done);
    clSetUserEventStatus(user, CL_COMPLETE);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    ck_assert_msg(early > CL_COMPLETE, "the T=0 event completed before its wait list (status %d)", early);
    clReleaseEvent(done);
    clReleaseEvent(user);

    assert_mem_poison(q, w.mem, "topk_weights", "T=0");
    assert_mem_poison(q, ids.mem, "topk_ids", "T=0");

    /* The host path: success, nothing written. */
    float hw[16];
    int32_t hi[16];
    float hg[EA];
    memset(hw, HARNESS_POISON, sizeof(hw));
    memset(hi, HARNESS_POISON, sizeof(hi));
    memset(hg, 0, sizeof(hg));
    st = moecl_topk_gating_host(ctx, &d, hg, NULL, hw, hi);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0 host: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert(first_unpoisoned(hw, sizeof(hw)) == sizeof(hw));
    ck_assert(first_unpoisoned(hi, sizeof(hi)) == sizeof(hi));

    harness_release(g);
    harness_release(b);
    harness_release(w);
    harness_release(ids);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 6. Device selection and context accessors                               */
/* ---------------------------------------------------------------------- */

static cl_device_type device_type(cl_device_id dev)
{
    cl_device_type t = 0;
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_TYPE, sizeof(t), &t, NULL), CL_SUCCESS);
    return t;
}

static void expect_no_device(const char *selector, const char *source_hint)
{
    reset_null_error();
    moecl_context *ctx = CTX_SENTINEL;
    moecl_status st = moecl_context_create(selector, &ctx);
    ck_assert_msg(st == MOECL_ERROR_NO_DEVICE, "selector \"%s\": status %d (%s)", selector ? selector : "(NULL)",
                  (int)st, moecl_status_string(st));
    ck_assert_msg(ctx == NULL, "selector \"%s\": *ctx not set to NULL", selector ? selector : "(NULL)");
    const char *msg = moecl_context_error(NULL);
    ck_assert_msg(strstr(msg, "0:0") != NULL, "selector \"%s\": the message does not list the devices: %s",
                  selector ? selector : "(NULL)", msg);
    if (source_hint)
        ck_assert_msg(strstr(msg, source_hint) != NULL, "the message does not mention %s: %s", source_hint, msg);
}

static moecl_context *expect_device(const char *selector, cl_device_id want)
{
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(selector, &ctx);
    ck_assert_msg(st == MOECL_SUCCESS, "selector \"%s\": %s: %s", selector ? selector : "(NULL)",
                  moecl_status_string(st), moecl_context_error(NULL));
    ck_assert_ptr_nonnull(ctx);
    if (want)
        ck_assert_msg(moecl_context_device(ctx) == want, "selector \"%s\" chose another device",
                      selector ? selector : "(NULL)");
    return ctx;
}

START_TEST(test_device_selection)
{
    unsetenv("MOECL_DEVICE");
    cl_platform_id platforms[16];
    cl_uint np = 0;
    ck_assert_int_eq(clGetPlatformIDs(16, platforms, &np), CL_SUCCESS);
    ck_assert_uint_ge(np, 1);
    cl_device_id dev00;
    ck_assert_int_eq(clGetDeviceIDs(platforms[0], CL_DEVICE_TYPE_ALL, 1, &dev00, NULL), CL_SUCCESS);
    cl_device_id first_cpu = NULL, first_gpu = NULL;
    for (cl_uint p = 0; p < np; p++) {
        cl_device_id devs[64];
        cl_uint nd = 0;
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 64, devs, &nd) != CL_SUCCESS)
            continue;
        for (cl_uint i = 0; i < nd && i < 64; i++) {
            cl_device_type t = device_type(devs[i]);
            if (!first_cpu && (t & CL_DEVICE_TYPE_CPU))
                first_cpu = devs[i];
            if (!first_gpu && (t & (CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR)))
                first_gpu = devs[i];
        }
    }

    /* No selector, no MOECL_DEVICE: the first GPU or accelerator, else the
     * first CPU. */
    moecl_context *def = expect_device(NULL, first_gpu ? first_gpu : first_cpu);
    moecl_context_destroy(def);
    if (first_gpu) {
        def = expect_device("gpu", first_gpu);
        moecl_context_destroy(def);
    } else {
        expect_no_device("gpu", "gpu");
    }

    moecl_context *ctx = expect_device("0:0", dev00);
    moecl_context_destroy(ctx);

    if (first_cpu) {
        ctx = expect_device("cpu", first_cpu);
        ck_assert(device_type(moecl_context_device(ctx)) & CL_DEVICE_TYPE_CPU);
        moecl_context_destroy(ctx);
    } else {
        expect_no_device("cpu", NULL);
    }

    expect_no_device("9:9", "9:9");
    expect_no_device("no-such-device-xyz", "no-such-device-xyz");

    /* A substring of the platform name, in another case. */
    char pname[256] = "";
    ck_assert_int_eq(clGetPlatformInfo(platforms[0], CL_PLATFORM_NAME, sizeof(pname), pname, NULL), CL_SUCCESS);
    pname[sizeof(pname) - 1] = '\0';
    char word[16] = "";
    size_t n = 0;
    for (const char *p = pname; *p && *p != ' ' && *p != '/' && n < sizeof(word) - 1; p++)
        word[n++] = islower((unsigned char)*p) ? (char)toupper((unsigned char)*p) : (char)tolower((unsigned char)*p);
    word[n] = '\0';
    ck_assert_msg(n > 0, "platform 0 has no name");
    ctx = expect_device(word, dev00);
    moecl_context_destroy(ctx);
    if (strcasestr(pname, "portable")) {
        ctx = expect_device("portable", dev00);
        moecl_context_destroy(ctx);
    }
    /* The whole "platform / device" label. */
    char dname[256] = "", label[600];
    ck_assert_int_eq(clGetDeviceInfo(dev00, CL_DEVICE_NAME, sizeof(dname), dname, NULL), CL_SUCCESS);
    dname[sizeof(dname) - 1] = '\0';
    snprintf(label, sizeof(label), "%s / %s", pname, dname);
    ctx = expect_device(label, dev00);
    moecl_context_destroy(ctx);

    /* MOECL_DEVICE for a NULL selector; an explicit selector wins over it. */
    if (first_cpu) {
        setenv("MOECL_DEVICE", "cpu", 1);
        ctx = expect_device(NULL, first_cpu);
        moecl_context_destroy(ctx);
    }
    setenv("MOECL_DEVICE", "no-such-device", 1);
    expect_no_device(NULL, "no-such-device");
    ctx = expect_device("0:0", dev00);
    moecl_context_destroy(ctx);
    unsetenv("MOECL_DEVICE");

    /* NULL output pointer. */
    reset_null_error();
    ck_assert_int_eq(moecl_context_create(NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(NULL), "ctx") != NULL, "create(NULL ctx) says \"%s\"",
                  moecl_context_error(NULL));
    ck_assert_int_eq(moecl_context_create("0:0", NULL), MOECL_ERROR_INVALID_ARGUMENT);
}
END_TEST

START_TEST(test_context_accessors)
{
    moecl_context *ctx = harness_context();
    cl_context c = moecl_context_cl_context(ctx);
    cl_device_id dev = moecl_context_device(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(dev);
    ck_assert_ptr_nonnull(q);
    cl_context qc = NULL;
    cl_device_id qd = NULL;
    cl_command_queue_properties props = 0;
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_CONTEXT, sizeof(qc), &qc, NULL), CL_SUCCESS);
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_DEVICE, sizeof(qd), &qd, NULL), CL_SUCCESS);
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_PROPERTIES, sizeof(props), &props, NULL), CL_SUCCESS);
    ck_assert_ptr_eq(qc, c);
    ck_assert_ptr_eq(qd, dev);
    ck_assert_msg(!(props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE), "the context's own queue is out of order");

    ck_assert_ptr_null(moecl_context_cl_context(NULL));
    ck_assert_ptr_null(moecl_context_device(NULL));
    ck_assert_ptr_null(moecl_context_queue(NULL));
    moecl_context_destroy(NULL);

    /* No failure yet on this context: "". */
    ck_assert_str_eq(moecl_context_error(ctx), "");

    size_t need = moecl_context_describe(ctx, NULL, 0);
    ck_assert_uint_gt(need, 0);
    char *text = malloc(need + 1);
    ck_assert_ptr_nonnull(text);
    memset(text, 'x', need + 1);
    ck_assert_uint_eq(moecl_context_describe(ctx, text, need + 1), need);
    ck_assert_uint_eq(strlen(text), need);
    ck_assert_msg(strstr(text, "launch class") != NULL, "describe: %s", text);
    char dname[256] = "";
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof(dname), dname, NULL), CL_SUCCESS);
    dname[sizeof(dname) - 1] = '\0';
    ck_assert_msg(strstr(text, dname) != NULL, "describe does not name the device \"%s\": %s", dname, text);
    /* The length returned is the length written. */
    char *big = malloc(need + 4096);
    ck_assert_ptr_nonnull(big);
    ck_assert_uint_eq(moecl_context_describe(ctx, big, need + 4096), need);
    ck_assert_uint_eq(strlen(big), need);
    ck_assert_str_eq(big, text);
    free(big);
    /* Truncation as snprintf does it. */
    char small[16];
    memset(small, 'x', sizeof(small));
    ck_assert_uint_eq(moecl_context_describe(ctx, small, sizeof(small)), need);
    ck_assert_uint_eq(strlen(small), sizeof(small) - 1);
    ck_assert(memcmp(small, text, sizeof(small) - 1) == 0);
    free(text);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 7. No OpenCL platform: a child process with an empty ICD directory      */
/* ---------------------------------------------------------------------- */

/* The child's side: create a context on the default device, report. */
static int probe_create(void)
{
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(NULL, &ctx);
    printf("status %d\nctx %s\nmessage %s\n", (int)st, ctx ? "set" : "null", moecl_context_error(NULL));
    moecl_context_destroy(ctx);
    fflush(stdout);
    return 0;
}

/* Run this executable with --probe-create in the environment of environ
 * minus the names in drop plus the NAME=VALUE strings in add; its stdout
 * goes into out. Returns the exit status. */
static int spawn_probe(const char *const *drop, const char *const *add, char *out, size_t out_size)
{
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    ck_assert_msg(len > 0, "readlink(/proc/self/exe): %s", strerror(errno));
    self[len] = '\0';

    size_t n = 0;
    while (environ[n])
        n++;
    size_t nadd = 0;
    while (add && add[nadd])
        nadd++;
    char **envp = calloc(n + nadd + 1, sizeof(char *));
    ck_assert_ptr_nonnull(envp);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        bool dropped = false;
        for (size_t j = 0; drop && drop[j]; j++) {
            size_t l = strlen(drop[j]);
            if (strncmp(environ[i], drop[j], l) == 0 && environ[i][l] == '=')
                dropped = true;
        }
        if (!dropped)
            envp[m++] = environ[i];
    }
    for (size_t i = 0; i < nadd; i++)
        envp[m++] = (char *)add[i];
    envp[m] = NULL;

    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    char *argv[] = {self, "--probe-create", NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, self, &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        ck_abort_msg("posix_spawn(%s): %s", self, strerror(rc));
    }
    size_t used = 0;
    for (;;) {
        char chunk[512];
        ssize_t got = read(fds[0], chunk, sizeof(chunk));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        size_t take = (size_t)got < out_size - 1 - used ? (size_t)got : out_size - 1 - used;
        memcpy(out + used, chunk, take);
        used += take;
    }
    out[used] = '\0';
    close(fds[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    ck_assert_msg(WIFEXITED(status), "the probe died (status 0x%x); output: %s", status, out);
    return WEXITSTATUS(status);
}

static int probe_status(const char *out)
{
    const char *s = strstr(out, "status ");
    ck_assert_msg(s != NULL, "the probe printed no status: %s", out);
    return atoi(s + 7);
}

START_TEST(test_no_platform)
{
    char out[8192];
    /* Control: the probe sees a device in this environment. It asks for
     * the CPU device: a GPU held by this process may refuse a second one
     * (exclusive compute mode; seen on the H200 machine), pocl never does. */
    const char *control[] = {"MOECL_DEVICE=cpu", NULL};
    const char *control_drop[] = {"MOECL_DEVICE", NULL};
    ck_assert_int_eq(spawn_probe(control_drop, control, out, sizeof(out)), 0);
    ck_assert_msg(probe_status(out) == MOECL_SUCCESS, "the probe fails with the normal environment: %s", out);
    ck_assert_msg(strstr(out, "ctx set") != NULL, "%s", out);

    char vendors[PATH_MAX], assign[PATH_MAX + 32];
    fx_path(vendors, sizeof(vendors), "vendors");
    ck_assert_int_eq(mkdir(vendors, 0700), 0);
    snprintf(assign, sizeof(assign), "OCL_ICD_VENDORS=%s", vendors);
    const char *drop[] = {"OCL_ICD_VENDORS", "OCL_ICD_FILENAMES", NULL};
    const char *add[] = {assign, NULL};
    ck_assert_int_eq(spawn_probe(drop, add, out, sizeof(out)), 0);
    ck_assert_msg(probe_status(out) == MOECL_ERROR_NO_DEVICE, "no platform: expected %d: %s", MOECL_ERROR_NO_DEVICE,
                  out);
    ck_assert_msg(strstr(out, "ctx null") != NULL, "no platform: *ctx not NULL: %s", out);
    ck_assert_msg(strstr(out, "pocl-opencl-icd") != NULL, "no platform: no install hint: %s", out);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 8. Adopting a runtime's OpenCL objects                                   */
/* ---------------------------------------------------------------------- */

START_TEST(test_create_from_cl)
{
    moecl_context *base = harness_context();
    cl_context c = moecl_context_cl_context(base);
    cl_device_id dev = moecl_context_device(base);
    cl_command_queue q = moecl_context_queue(base);
    harness_rng rng = harness_rng_for(80);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(19, EA, KA);
    /* The base context's own kernels hold references to c too: build them
     * before counting. */
    ck_assert_int_eq(moecl_topk_gating_prepare(base, &d), MOECL_SUCCESS);
    const cl_uint c_refs = context_refs(c), q_refs = queue_refs(q);

    /* Context, device and queue. */
    moecl_context *ad = CTX_SENTINEL;
    moecl_status st = moecl_context_create_from_cl(c, dev, q, &ad);
    ck_assert_msg(st == MOECL_SUCCESS, "adopt: %s: %s", moecl_status_string(st), moecl_context_error(NULL));
    ck_assert_ptr_nonnull(ad);
    ck_assert_ptr_ne(ad, CTX_SENTINEL);
    ck_assert_ptr_eq(moecl_context_cl_context(ad), c);
    ck_assert_ptr_eq(moecl_context_device(ad), dev);
    ck_assert_ptr_eq(moecl_context_queue(ad), q);
    ck_assert_uint_gt(context_refs(c), c_refs);
    ck_assert_uint_gt(queue_refs(q), q_refs);
    check_route(ad, &d, &rng, true, PATH_HOST, 0);
    check_route(ad, &d, &rng, false, PATH_DEVICE, 128);
    moecl_context_destroy(ad);
    /* The runtime's objects are still alive and usable, and hold exactly
     * the references they held before. */
    ck_assert_int_eq(clFinish(q), CL_SUCCESS);
    assert_refs_settle(c, c_refs, q, q_refs, "adopted context and queue, destroyed");
    check_route(base, &d, &rng, false, PATH_DEVICE, 0);

    /* Queue NULL: moecl makes its own. */
    ad = NULL;
    st = moecl_context_create_from_cl(c, dev, NULL, &ad);
    ck_assert_msg(st == MOECL_SUCCESS, "adopt without queue: %s: %s", moecl_status_string(st),
                  moecl_context_error(NULL));
    cl_command_queue own = moecl_context_queue(ad);
    ck_assert_ptr_nonnull(own);
    ck_assert_ptr_ne(own, q);
    cl_context qc = NULL;
    ck_assert_int_eq(clGetCommandQueueInfo(own, CL_QUEUE_CONTEXT, sizeof(qc), &qc, NULL), CL_SUCCESS);
    ck_assert_ptr_eq(qc, c);
    check_route(ad, &d, &rng, true, PATH_DEVICE, 0);
    check_route(ad, &d, &rng, false, PATH_HOST, 0);
    moecl_context_destroy(ad);
    assert_refs_settle(c, c_refs, q, q_refs, "adopted context, own queue, destroyed");

    /* An out-of-order queue, where the device supports one. */
    cl_command_queue_properties qprops = 0;
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_QUEUE_PROPERTIES, sizeof(qprops), &qprops, NULL), CL_SUCCESS);
    if (qprops & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) {
        cl_int err;
        cl_command_queue ooo = clCreateCommandQueue(c, dev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
        ad = NULL;
        st = moecl_context_create_from_cl(c, dev, ooo, &ad);
        ck_assert_msg(st == MOECL_SUCCESS, "adopt an out-of-order queue: %s: %s", moecl_status_string(st),
                      moecl_context_error(NULL));
        for (int i = 0; i < 3; i++)
            check_route(ad, &d, &rng, i == 1, PATH_HOST, 0);
        check_route(ad, &d, &rng, true, PATH_DEVICE, 64);
        moecl_context_destroy(ad);
        ck_assert_int_eq(clFinish(ooo), CL_SUCCESS);
        clReleaseCommandQueue(ooo);
    }

    /* Invalid adoptions: nothing is retained, *ctx is NULL. */
    moecl_context *other = harness_context();
    struct {
        cl_context c;
        cl_device_id d;
        cl_command_queue q;
        const char *names;
        const char *label;
    } bad[] = {
        {NULL, dev, q, "context", "NULL context"},
        {NULL, NULL, NULL, "context", "all NULL"},
        {c, NULL, q, "device", "NULL device"},
        {c, NULL, NULL, "device", "NULL device, no queue"},
        {c, dev, moecl_context_queue(other), "queue", "a queue of another cl_context"},
        {moecl_context_cl_context(other), dev, q, "queue", "our queue with another cl_context"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        reset_null_error();
        if (strcmp(bad[i].names, "context") == 0) /* the reset's detail names "context" already */
            moecl_context_create("9:9", &ad);
        ad = CTX_SENTINEL;
        st = moecl_context_create_from_cl(bad[i].c, bad[i].d, bad[i].q, &ad);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", bad[i].label, (int)st);
        ck_assert_msg(ad == NULL, "%s: *ctx not set to NULL", bad[i].label);
        assert_error_names(NULL, bad[i].names, bad[i].label);
    }
    ck_assert_int_eq(moecl_context_create_from_cl(c, dev, q, NULL), MOECL_ERROR_INVALID_ARGUMENT);

    /* A device that is not the context's: a sub-device, where the device
     * can be partitioned. */
    cl_device_partition_property part[] = {CL_DEVICE_PARTITION_EQUALLY, 1, 0};
    cl_device_id subs[64];
    cl_uint nsub = 0;
    if (clCreateSubDevices(dev, part, 64, subs, &nsub) == CL_SUCCESS && nsub > 0) {
        reset_null_error();
        ad = CTX_SENTINEL;
        st = moecl_context_create_from_cl(c, subs[0], NULL, &ad);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "a sub-device outside the context: status %d", (int)st);
        ck_assert_ptr_null(ad);
        assert_error_names(NULL, "device", "a sub-device outside the context");
        for (cl_uint i = 0; i < nsub && i < 64; i++)
            clReleaseDevice(subs[i]);
    }
    ck_assert_int_eq(clFinish(q), CL_SUCCESS);
    assert_refs_settle(c, c_refs, q, q_refs, "after the failed adoptions");

    moecl_context_destroy(other);
    check_route(base, &d, &rng, true, PATH_DEVICE, 0);
    moecl_context_destroy(base);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 9. Wait lists and events, with byte offsets                              */
/* ---------------------------------------------------------------------- */

START_TEST(test_events_and_offsets)
{
    moecl_context *ctx = harness_context();
    cl_context c = moecl_context_cl_context(ctx);
    cl_device_id dev = moecl_context_device(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    harness_rng rng = harness_rng_for(90);
    const uint32_t T = 37;
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(T, EB, KB);
    /* Build first, so the call below is an enqueue and nothing else. */
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);

    const size_t off = 4096 + 4 * 3, obytes = (size_t)T * KB * 4;
    float *hg = harness_random_tensor(&rng, MOECL_F32, (size_t)T * EB, 2.0f);
    float *hb = harness_random_tensor(&rng, MOECL_F32, EB, 2.0f / EB);
    moecl_buffer g = harness_buffer(ctx, (size_t)T * EB * 4, off, hg);
    moecl_buffer b = harness_buffer(ctx, EB * 4, off, hb);
    moecl_buffer w = harness_buffer(ctx, obytes, off, NULL);
    moecl_buffer ids = harness_buffer(ctx, obytes, off, NULL);

    cl_int err;
    cl_event users[2];
    for (int i = 0; i < 2; i++) {
        users[i] = clCreateUserEvent(c, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
    }
    cl_event done = NULL;
    moecl_status st = moecl_topk_gating(ctx, &d, g, b, w, ids, 2, users, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    cl_command_type type = 0;
    cl_command_queue ev_q = NULL;
    ck_assert_int_eq(clGetEventInfo(done, CL_EVENT_COMMAND_TYPE, sizeof(type), &type, NULL), CL_SUCCESS);
    ck_assert_int_eq(clGetEventInfo(done, CL_EVENT_COMMAND_QUEUE, sizeof(ev_q), &ev_q, NULL), CL_SUCCESS);
    ck_assert_uint_eq(type, CL_COMMAND_NDRANGE_KERNEL);
    ck_assert_ptr_eq(ev_q, q);
    clSetUserEventStatus(users[1], CL_COMPLETE); /* one of two: still waiting */
    ck_assert_int_eq(clFlush(q), CL_SUCCESS);
    sleep_ms(50);
    cl_int early = event_status(done);
    ck_assert_msg(early > CL_RUNNING, "the kernel ran before its wait list completed (status %d)", early);

    /* Peek at the outputs through a second queue. Some drivers order that
     * read after the pending kernel (they track buffer contents across
     * queues); then only the event status above speaks. */
    cl_command_queue q2 = clCreateCommandQueue(c, dev, 0, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    const size_t total = off + obytes + SLACK;
    unsigned char *peek[2] = {malloc(total), malloc(total)};
    ck_assert(peek[0] && peek[1]);
    cl_event reads[2];
    ck_assert_int_eq(clEnqueueReadBuffer(q2, w.mem, CL_FALSE, 0, total, peek[0], 0, NULL, &reads[0]), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueReadBuffer(q2, ids.mem, CL_FALSE, 0, total, peek[1], 0, NULL, &reads[1]), CL_SUCCESS);
    ck_assert_int_eq(clFlush(q2), CL_SUCCESS);
    bool peeked = false;
    for (int i = 0; i < 100 && !peeked; i++) {
        peeked = event_status(reads[0]) == CL_COMPLETE && event_status(reads[1]) == CL_COMPLETE;
        if (!peeked)
            sleep_ms(5);
    }
    if (peeked) {
        ck_assert_msg(first_unpoisoned(peek[0], total) == total, "topk_weights written before the wait list");
        ck_assert_msg(first_unpoisoned(peek[1], total) == total, "topk_ids written before the wait list");
    } else {
        fprintf(stderr, "events: the driver orders a read on a second queue after the pending kernel; "
                        "checked the event status only\n");
    }
    ck_assert_msg(event_status(done) > CL_RUNNING, "the kernel ran before its wait list completed");

    clSetUserEventStatus(users[0], CL_COMPLETE);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    ck_assert_int_eq(event_status(done), CL_COMPLETE);
    ck_assert_int_eq(clWaitForEvents(2, reads), CL_SUCCESS);
    clReleaseEvent(reads[0]);
    clReleaseEvent(reads[1]);
    clReleaseCommandQueue(q2);
    free(peek[0]);
    free(peek[1]);

    /* The results, and nothing written outside the tensors. */
    unsigned char *all = malloc(total);
    float *hw = malloc(obytes);
    int32_t *hi = malloc(obytes);
    ck_assert(all && hw && hi);
    moecl_buffer outs[2] = {w, ids};
    void *dst[2] = {hw, hi};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(clEnqueueReadBuffer(q, outs[i].mem, CL_TRUE, 0, total, all, 0, NULL, NULL), CL_SUCCESS);
        ck_assert_msg(first_unpoisoned(all, off) == off, "a byte before the output at offset %zu changed", off);
        ck_assert_msg(first_unpoisoned(all + off + obytes, SLACK) == SLACK, "a byte after the output changed");
        memcpy(dst[i], all + off, obytes);
    }
    char msg[600];
    ck_assert_msg(ref_check_topk_gating(&d, hg, hb, hw, hi, msg, sizeof(msg)) == 0, "%s", msg);

    /* Chained: a second call that waits on the first call's event. */
    cl_event done2 = NULL;
    memset(hw, HARNESS_POISON, obytes);
    moecl_buffer w2 = harness_buffer(ctx, obytes, 8, NULL), ids2 = harness_buffer(ctx, obytes, 8, NULL);
    st = moecl_topk_gating(ctx, &d, g, b, w2, ids2, 1, &done, &done2);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_int_eq(clWaitForEvents(1, &done2), CL_SUCCESS);
    harness_read(ctx, w2, obytes, hw);
    harness_read(ctx, ids2, obytes, hi);
    ck_assert_msg(ref_check_topk_gating(&d, hg, hb, hw, hi, msg, sizeof(msg)) == 0, "chained: %s", msg);
    clReleaseEvent(done2);
    harness_release(w2);
    harness_release(ids2);

    clReleaseEvent(done);
    clReleaseEvent(users[0]);
    clReleaseEvent(users[1]);
    free(all);
    free(hw);
    free(hi);
    free(hg);
    free(hb);
    harness_release(g);
    harness_release(b);
    harness_release(w);
    harness_release(ids);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 10. The compiled-kernel disk cache                                      */
/* ---------------------------------------------------------------------- */

static const unsigned char entry_magic[8] = {'M', 'O', 'E', 'C', 'L', 'B', 'I', '1'};

typedef struct cache_file {
    char name[64];
    ino_t ino;
    struct timespec mtime;
    off_t size;
} cache_file;

static bool is_entry_name(const char *name)
{
    if (strlen(name) != 36 || strcmp(name + 32, ".bin") != 0)
        return false;
    for (int i = 0; i < 32; i++)
        if (!isxdigit((unsigned char)name[i]))
            return false;
    return true;
}

/* The entries of dir, sorted by name; fails the test on anything else
 * there (a left-over temporary file, say). */
static int list_cache(const char *dir, cache_file *out, int max)
{
    DIR *dp = opendir(dir);
    ck_assert_msg(dp != NULL, "opendir(%s): %s", dir, strerror(errno));
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        ck_assert_msg(is_entry_name(de->d_name), "the cache directory holds \"%s\"", de->d_name);
        ck_assert(n < max);
        char path[PATHBUF];
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        struct stat st;
        ck_assert_int_eq(stat(path, &st), 0);
        ck_assert(S_ISREG(st.st_mode));
        snprintf(out[n].name, sizeof(out[n].name), "%s", de->d_name);
        out[n].ino = st.st_ino;
        out[n].mtime = st.st_mtim;
        out[n].size = st.st_size;
        n++;
    }
    closedir(dp);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(out[j - 1].name, out[j].name) > 0; j--) {
            cache_file t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return n;
}

static uint64_t get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* A well-formed entry: magic | u64 key length | key | u64 binary length |
 * u64 checksum | binary, the lengths adding up to the file size. */
static bool parse_entry(const unsigned char *p, size_t n, size_t *key_len, size_t *bin_len)
{
    if (n <= 32 || memcmp(p, entry_magic, 8) != 0)
        return false;
    uint64_t kl = get_u64(p + 8);
    if (kl == 0 || kl > n - 32)
        return false;
    uint64_t bl = get_u64(p + 16 + kl);
    if (bl == 0 || bl != n - 32 - kl)
        return false;
    *key_len = (size_t)kl;
    *bin_len = (size_t)bl;
    return true;
}

static void assert_valid_entry(const char *path, const unsigned char *want_key, size_t want_key_len,
                               const char *label)
{
    unsigned char *data;
    size_t size, kl, bl;
    ck_assert_msg(read_whole(path, &data, &size), "%s: %s is gone", label, path);
    bool ok = parse_entry(data, size, &kl, &bl);
    bool same_key = ok && kl == want_key_len && memcmp(data + 16, want_key, kl) == 0;
    free(data);
    ck_assert_msg(ok, "%s: %s is not a valid entry (%zu bytes)", label, path, size);
    ck_assert_msg(same_key, "%s: %s holds another key", label, path);
}

static void cache_dir_env(char *dir, size_t size, const char *name)
{
    fx_path(dir, size, name);
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", dir, 1), 0);
}

/* A context, prepare (both bias variants of E=16,k=4), all four routes. */
static double prepare_and_route(harness_rng *rng, const char *label)
{
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(29, EA, KA);
    double t0 = now_s();
    moecl_context *ctx = harness_context();
    moecl_status st = moecl_topk_gating_prepare(ctx, &d);
    double elapsed = now_s() - t0;
    ck_assert_msg(st == MOECL_SUCCESS, "%s: prepare: %s: %s", label, moecl_status_string(st),
                  moecl_context_error(ctx));
    check_all_routes(ctx, &d, rng);
    moecl_context_destroy(ctx);
    return elapsed;
}

START_TEST(test_cache_cold_warm)
{
    harness_rng rng = harness_rng_for(100);
    char dir[PATH_MAX];
    cache_dir_env(dir, sizeof(dir), "cache/nested"); /* created, parents too */

    double cold = prepare_and_route(&rng, "cold");
    cache_file before[32], after[32];
    int n = list_cache(dir, before, 32);
    ck_assert_msg(n >= 1, "no cache entry written");
    for (int i = 0; i < n; i++) {
        char path[PATHBUF];
        snprintf(path, sizeof(path), "%s/%.63s", dir, before[i].name);
        unsigned char *data;
        size_t size, kl, bl;
        ck_assert(read_whole(path, &data, &size));
        bool ok = parse_entry(data, size, &kl, &bl);
        free(data);
        ck_assert_msg(ok, "%s is not a well-formed entry", before[i].name);
    }

    double warm = prepare_and_route(&rng, "warm");
    int m = list_cache(dir, after, 32);
    ck_assert_msg(m == n, "%d entries after the warm run, %d before", m, n);
    for (int i = 0; i < n; i++) {
        ck_assert_str_eq(after[i].name, before[i].name);
        ck_assert_msg(after[i].ino == before[i].ino && after[i].size == before[i].size &&
                          after[i].mtime.tv_sec == before[i].mtime.tv_sec &&
                          after[i].mtime.tv_nsec == before[i].mtime.tv_nsec,
                      "%s was rewritten by the warm run", before[i].name);
    }
    fprintf(stderr, "kernel cache: cold create+prepare %.3f s, warm %.3f s (%d entries)\n", cold, warm, n);
}
END_TEST

START_TEST(test_cache_corrupt)
{
    harness_rng rng = harness_rng_for(101);
    char dir[PATH_MAX];
    cache_dir_env(dir, sizeof(dir), "cache");
    prepare_and_route(&rng, "cold");

    cache_file files[32];
    int n = list_cache(dir, files, 32);
    ck_assert_int_ge(n, 1);
    unsigned char *orig[32];
    size_t orig_size[32], key_len[32], bin_len[32];
    for (int i = 0; i < n; i++) {
        char path[PATHBUF];
        snprintf(path, sizeof(path), "%s/%.63s", dir, files[i].name);
        ck_assert(read_whole(path, &orig[i], &orig_size[i]));
        ck_assert(parse_entry(orig[i], orig_size[i], &key_len[i], &bin_len[i]));
    }

    enum { TRUNCATED, RANDOM, FOREIGN, FOREIGN_SAME_LENGTH, BAD_CHECKSUM, NUM_MODES };
    static const char *const modes[NUM_MODES] = {"truncated to half", "random bytes", "a foreign key",
                                                 "a foreign key of the same length", "a flipped binary byte"};
    for (int mode = 0; mode < NUM_MODES; mode++) {
        for (int i = 0; i < n; i++) {
            char path[PATHBUF], label[160];
            snprintf(path, sizeof(path), "%s/%.63s", dir, files[i].name);
            snprintf(label, sizeof(label), "entry %d of %d %s", i + 1, n, modes[mode]);
            unsigned char *bad = malloc(orig_size[i]);
            ck_assert_ptr_nonnull(bad);
            size_t bad_size = orig_size[i];
            memcpy(bad, orig[i], bad_size);
            switch (mode) {
            case TRUNCATED:
                bad_size /= 2;
                break;
            case RANDOM:
                for (size_t j = 0; j < bad_size; j++)
                    bad[j] = (unsigned char)harness_rand_u32(&rng);
                bad[0] = 'X';
                break;
            case FOREIGN: {
                /* Another device's entry under this name: the same
                 * binary and checksum, another key text. */
                const char *other = "moecl 0.0.0\nplatform Other Platform\ndevice Other Device\n";
                size_t ol = strlen(other);
                free(bad);
                bad_size = 16 + ol + 16 + bin_len[i];
                bad = malloc(bad_size);
                ck_assert_ptr_nonnull(bad);
                memcpy(bad, entry_magic, 8);
                put_u64(bad + 8, ol);
                memcpy(bad + 16, other, ol);
                memcpy(bad + 16 + ol, orig[i] + 16 + key_len[i], 16 + bin_len[i]);
                break;
            }
            case FOREIGN_SAME_LENGTH:
                /* The same, with a key that differs in its letters' case
                 * only: a length check alone does not tell it. */
                for (size_t j = 16; j < 16 + key_len[i]; j++)
                    if (isalpha(bad[j]))
                        bad[j] ^= 0x20;
                break;
            case BAD_CHECKSUM:
                bad[bad_size - 1 - bin_len[i] / 2] ^= 0x5a;
                break;
            }
            write_whole(path, bad, bad_size);
            free(bad);
            cache_file now[32];
            ck_assert_int_eq(list_cache(dir, now, 32), n);

            prepare_and_route(&rng, label);

            /* The entry is valid again, for our key; the others were not
             * touched. */
            assert_valid_entry(path, orig[i] + 16, key_len[i], label);
            cache_file later[32];
            ck_assert_int_eq(list_cache(dir, later, 32), n);
            for (int j = 0; j < n; j++) {
                ck_assert_str_eq(later[j].name, now[j].name);
                if (j != i)
                    ck_assert_msg(later[j].ino == now[j].ino && later[j].size == now[j].size,
                                  "%s: the valid entry %s was rewritten", label, now[j].name);
            }
        }
    }
    for (int i = 0; i < n; i++)
        free(orig[i]);
}
END_TEST

START_TEST(test_cache_unwritable)
{
    harness_rng rng = harness_rng_for(102);
    /* A directory under a regular file can never be created, root or not. */
    char file[PATH_MAX], dir[PATHBUF];
    fx_path(file, sizeof(file), "plain-file");
    write_whole(file, "x", 1);
    snprintf(dir, sizeof(dir), "%s/sub", file);
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", dir, 1), 0);
    prepare_and_route(&rng, "cache dir under a regular file");
    prepare_and_route(&rng, "cache dir under a regular file, again");
    struct stat st;
    ck_assert_int_eq(stat(file, &st), 0);
    ck_assert(S_ISREG(st.st_mode) && st.st_size == 1);

    /* A read-only directory, where permissions stop us (not as root). */
    char ro[PATH_MAX];
    fx_path(ro, sizeof(ro), "read-only");
    ck_assert_int_eq(mkdir(ro, 0700), 0);
    ck_assert_int_eq(chmod(ro, 0500), 0);
    if (geteuid() != 0) {
        ck_assert_int_eq(setenv("MOECL_CACHE_DIR", ro, 1), 0);
        prepare_and_route(&rng, "read-only cache dir");
        ck_assert_msg(entries_below(ro) == 0, "something was written into the read-only dir: %s", walk_first);
    } else {
        fprintf(stderr, "cache: running as root, where chmod 0500 does not stop writes; "
                        "tested the path under a regular file only\n");
    }
}
END_TEST

START_TEST(test_cache_off)
{
    harness_rng rng = harness_rng_for(103);
    /* Start the OpenCL platform before HOME and XDG_CACHE_HOME change: the
     * driver may place its own cache by them when it starts. */
    moecl_context_destroy(harness_context());

    char xdg[PATH_MAX], home[PATH_MAX];
    fx_path(xdg, sizeof(xdg), "xdg");
    fx_path(home, sizeof(home), "home");
    ck_assert_int_eq(setenv("XDG_CACHE_HOME", xdg, 1), 0);
    ck_assert_int_eq(setenv("HOME", home, 1), 0);
    static const char *const off_values[] = {"off", ""};
    struct stat st;
    const bool off_existed = stat("off", &st) == 0;
    for (size_t i = 0; i < 2; i++) {
        char label[64];
        snprintf(label, sizeof(label), "MOECL_CACHE_DIR=\"%s\"", off_values[i]);
        ck_assert_int_eq(setenv("MOECL_CACHE_DIR", off_values[i], 1), 0);
        prepare_and_route(&rng, label);
        ck_assert_msg(entries_below(fx_root) == 0, "%s: %s was written", label, walk_first);
        /* Nor into the working directory ("off" is not a path). */
        if (!off_existed && stat("off", &st) == 0) {
            rm_rf("off");
            ck_abort_msg("%s: ./off was created", label);
        }
    }

    /* The default locations, for contrast: $XDG_CACHE_HOME/moecl, then
     * $HOME/.cache/moecl. */
    unsetenv("MOECL_CACHE_DIR");
    prepare_and_route(&rng, "XDG_CACHE_HOME");
    char where[PATH_MAX + 32];
    cache_file files[32];
    snprintf(where, sizeof(where), "%s/moecl", xdg);
    ck_assert_int_ge(list_cache(where, files, 32), 1);
    unsetenv("XDG_CACHE_HOME");
    prepare_and_route(&rng, "HOME");
    snprintf(where, sizeof(where), "%s/.cache/moecl", home);
    ck_assert_int_ge(list_cache(where, files, 32), 1);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 11. MOECL_KERNEL_DIR                                                    */
/* ---------------------------------------------------------------------- */

static moecl_context *context_with_kernel_dir(const char *dir)
{
    ck_assert_int_eq(setenv("MOECL_KERNEL_DIR", dir, 1), 0);
    moecl_context *ctx = harness_context();
    /* Read at creation: unsetting it now must not matter. */
    unsetenv("MOECL_KERNEL_DIR");
    return ctx;
}

static void expect_build_error(const char *dir, const char *needle, const char *label)
{
    moecl_context *ctx = context_with_kernel_dir(dir);
    cl_command_queue q = moecl_context_queue(ctx);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(3, EA, KA);
    reset_error(ctx);
    moecl_status st = moecl_topk_gating_prepare(ctx, &d);
    ck_assert_msg(st == MOECL_ERROR_BUILD, "%s: prepare: status %d (%s)", label, (int)st, moecl_status_string(st));
    assert_error_names(ctx, needle, label);

    /* The calls fail the same way and write nothing. */
    float hg[3 * EA], hw[3 * KA];
    int32_t hi[3 * KA];
    memset(hg, 0, sizeof(hg));
    memset(hw, HARNESS_POISON, sizeof(hw));
    memset(hi, HARNESS_POISON, sizeof(hi));
    reset_error(ctx);
    st = moecl_topk_gating_host(ctx, &d, hg, NULL, hw, hi);
    ck_assert_msg(st == MOECL_ERROR_BUILD, "%s: host call: status %d", label, (int)st);
    assert_error_names(ctx, needle, label);
    ck_assert(first_unpoisoned(hw, sizeof(hw)) == sizeof(hw));
    ck_assert(first_unpoisoned(hi, sizeof(hi)) == sizeof(hi));

    moecl_buffer g = harness_buffer(ctx, sizeof(hg), 0, hg);
    moecl_buffer w = harness_buffer(ctx, sizeof(hw), 0, NULL), ids = harness_buffer(ctx, sizeof(hi), 0, NULL);
    cl_event done = DONE_SENTINEL;
    reset_error(ctx);
    st = moecl_topk_gating(ctx, &d, g, (moecl_buffer){NULL, 0}, w, ids, 0, NULL, &done);
    ck_assert_msg(st == MOECL_ERROR_BUILD, "%s: device call: status %d", label, (int)st);
    assert_error_names(ctx, needle, label);
    ck_assert(done == DONE_SENTINEL);
    assert_mem_poison(q, w.mem, "topk_weights", label);
    assert_mem_poison(q, ids.mem, "topk_ids", label);
    harness_release(g);
    harness_release(w);
    harness_release(ids);
    moecl_context_destroy(ctx);
}

START_TEST(test_kernel_dir)
{
    const char *cl_dir = getenv("MOECL_TEST_CL_DIR");
    ck_assert_msg(cl_dir && *cl_dir, "MOECL_TEST_CL_DIR (the cl/ folder of the sources) is not set: run the suite "
                                     "through `meson test`");
    /* No disk cache: every build below compiles the files themselves. */
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", "off", 1), 0);
    harness_rng rng = harness_rng_for(110);
    char src[PATHBUF], dst[PATHBUF];

    /* An empty directory: the first file is missing. */
    char empty[PATH_MAX];
    fx_path(empty, sizeof(empty), "empty");
    ck_assert_int_eq(mkdir(empty, 0700), 0);
    expect_build_error(empty, "common.cl", "empty MOECL_KERNEL_DIR");

    /* Only common.cl: the op's file is missing. */
    char partial[PATH_MAX];
    fx_path(partial, sizeof(partial), "partial");
    ck_assert_int_eq(mkdir(partial, 0700), 0);
    snprintf(src, sizeof(src), "%s/common.cl", cl_dir);
    snprintf(dst, sizeof(dst), "%s/common.cl", partial);
    copy_file(src, dst);
    expect_build_error(partial, "topk_gating.cl", "MOECL_KERNEL_DIR without topk_gating.cl");

    /* Sources that do not compile: the build log is in the message. */
    char broken[PATH_MAX];
    fx_path(broken, sizeof(broken), "broken");
    ck_assert_int_eq(mkdir(broken, 0700), 0);
    snprintf(dst, sizeof(dst), "%s/common.cl", broken);
    copy_file(src, dst);
    snprintf(dst, sizeof(dst), "%s/topk_gating.cl", broken);
    write_whole(dst, "#error moecl_rt_broken_source\n", strlen("#error moecl_rt_broken_source\n"));
    expect_build_error(broken, "moecl_rt_broken_source", "MOECL_KERNEL_DIR with a source that does not compile");

    /* The real sources. */
    moecl_context *ctx = context_with_kernel_dir(cl_dir);
    size_t need = moecl_context_describe(ctx, NULL, 0);
    char *text = malloc(need + 1);
    ck_assert_ptr_nonnull(text);
    moecl_context_describe(ctx, text, need + 1);
    ck_assert_msg(strstr(text, cl_dir) != NULL, "describe does not show the kernel dir: %s", text);
    free(text);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(31, EA, KA);
    moecl_status st = moecl_topk_gating_prepare(ctx, &d);
    ck_assert_msg(st == MOECL_SUCCESS, "prepare from %s: %s: %s", cl_dir, moecl_status_string(st),
                  moecl_context_error(ctx));
    check_all_routes(ctx, &d, &rng);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 12. One context, several threads                                        */
/* ---------------------------------------------------------------------- */

#define THREADS 4
#define CALLS 50

typedef struct worker {
    moecl_context *ctx;
    int id;
    int calls, failures;
    char first[1200];
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    harness_rng rng = harness_rng_for(1000 + (uint64_t)w->id);
    for (int i = 0; i < CALLS; i++) {
        /* Paths alternate every call, shapes every two calls, so every
         * thread runs all four combinations. */
        route_path path = (i % 2) ? PATH_DEVICE : PATH_HOST;
        bool big = ((i / 2 + w->id) % 2) != 0;
        uint32_t t = 1 + harness_rand_u32(&rng) % 48;
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(t, big ? EB : EA, big ? KB : KA);
        bool bias = (harness_rand_u32(&rng) & 1) != 0;
        size_t offset = (size_t)(harness_rand_u32(&rng) % 4) * 64;
        char msg[1024];
        if (route_once(w->ctx, &d, &rng, bias, path, offset, msg, sizeof(msg)) != 0 && w->failures++ == 0)
            snprintf(w->first, sizeof(w->first), "thread %d, call %d: %s", w->id, i, msg);
        w->calls++;
    }
    return NULL;
}

START_TEST(test_threads)
{
    (void)harness_seed(); /* before any thread asks for it */
    moecl_context *ctx = harness_context();
    worker workers[THREADS];
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) {
        workers[i] = (worker){ctx, i, 0, 0, ""};
        ck_assert_int_eq(pthread_create(&threads[i], NULL, worker_main, &workers[i]), 0);
    }
    for (int i = 0; i < THREADS; i++)
        ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
    int failures = 0;
    const char *first = NULL;
    for (int i = 0; i < THREADS; i++) {
        ck_assert_int_eq(workers[i].calls, CALLS);
        failures += workers[i].failures;
        if (workers[i].failures && !first)
            first = workers[i].first;
    }
    ck_assert_msg(failures == 0, "%d of %d calls failed; first: %s", failures, THREADS * CALLS, first);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* 13. Routing while another thread builds dozens of variants              */
/* ---------------------------------------------------------------------- */

/* The registry's array of variants is reallocated as it grows past 16 and
 * 32 entries (src/program.c) while other threads look variants up in it.
 * Each round takes a fresh context (a fresh registry): one thread builds
 * BUILD_SHAPES shapes (E = 17, 18, ..., k 1: a distinct NUM_EXPERTS define
 * each; prepare builds the variants with and without bias, so 32 variants,
 * which with the routed shape's two cross both growths; under
 * MOECL_TEST_QUICK half as many, one growth) while ROUTERS threads route
 * on the shape built first, checked against the reference, and between
 * their calls look up the newest variant (prepare of a built shape is a
 * registry lookup and nothing else; the newest is last, so the lookup
 * walks the whole array). A lookup that walks the array as it moves reads
 * freed memory. ASan reports it only when a lookup starts in the instant
 * between the builder's own lookup and the move, so the test runs many
 * rounds; ThreadSanitizer reports the unordered accesses whatever the
 * timing. After the first round the builds come from the disk cache and
 * are cheap; no round starts after BUILD_SECONDS. */
#define ROUTERS 2
#define BUILD_SHAPES 16
#define BUILD_ROUNDS 40
#define BUILD_SECONDS 10.0
#define LOOKUPS_PER_ROUTE 500

typedef struct router {
    moecl_context *ctx;
    int id;
    atomic_int *stop, *built; /* shapes the builder has finished */
    int routes, failures;
    char first[1200];
} router;

static void *router_main(void *arg)
{
    router *r = arg;
    harness_rng rng = harness_rng_for(1100 + (uint64_t)r->id);
    /* At least one checked call, however fast the builder is. */
    for (int i = 0; i == 0 || !atomic_load(r->stop); i++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1 + harness_rand_u32(&rng) % 24, EA, KA);
        char msg[1024];
        if (route_once(r->ctx, &d, &rng, (i & 1) != 0, (i / 2 + r->id) % 2 ? PATH_DEVICE : PATH_HOST, 64, msg,
                       sizeof(msg)) != 0 && r->failures++ == 0)
            snprintf(r->first, sizeof(r->first), "router %d, call %d: %s", r->id, i, msg);
        r->routes++;
        /* The newest variants: the search walks the whole array. */
        const int newest = atomic_load(r->built);
        const moecl_topk_gating_desc lookup = newest ? moecl_topk_gating_desc_init(1, 17 + (uint32_t)newest - 1, 1)
                                                     : moecl_topk_gating_desc_init(1, EA, KA);
        for (int j = 0; j < LOOKUPS_PER_ROUTE && !atomic_load(r->stop); j++) {
            moecl_status st = moecl_topk_gating_prepare(r->ctx, &lookup);
            if (st != MOECL_SUCCESS && r->failures++ == 0)
                snprintf(r->first, sizeof(r->first), "router %d, lookup: %s: %s", r->id, moecl_status_string(st),
                         moecl_context_error(r->ctx));
        }
    }
    return NULL;
}

static void build_while_routing(int round, uint32_t shapes)
{
    harness_rng rng = harness_rng_for(1099 + (uint64_t)round * 7);
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc built = moecl_topk_gating_desc_init(1, EA, KA);
    moecl_status st = moecl_topk_gating_prepare(ctx, &built);
    ck_assert_msg(st == MOECL_SUCCESS, "prepare: %s: %s", moecl_status_string(st), moecl_context_error(ctx));

    atomic_int stop = 0, built_shapes = 0;
    router routers[ROUTERS];
    pthread_t threads[ROUTERS];
    for (int i = 0; i < ROUTERS; i++) {
        routers[i] = (router){.ctx = ctx, .id = round * ROUTERS + i, .stop = &stop, .built = &built_shapes};
        ck_assert_int_eq(pthread_create(&threads[i], NULL, router_main, &routers[i]), 0);
    }
    char first_build[1200] = "";
    for (uint32_t i = 0; i < shapes; i++) {
        const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 17 + i, 1);
        st = moecl_topk_gating_prepare(ctx, &d);
        if (st != MOECL_SUCCESS && !first_build[0])
            snprintf(first_build, sizeof(first_build), "building E=%u: %s: %s", 17 + i, moecl_status_string(st),
                     moecl_context_error(ctx));
        if (st == MOECL_SUCCESS)
            atomic_store(&built_shapes, (int)i + 1);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < ROUTERS; i++)
        ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
    ck_assert_msg(!first_build[0], "round %d: %s", round, first_build);
    for (int i = 0; i < ROUTERS; i++) {
        ck_assert_msg(routers[i].failures == 0, "round %d: %d of %d calls of router %d failed; first: %s", round,
                      routers[i].failures, routers[i].routes, i, routers[i].first);
        ck_assert_int_ge(routers[i].routes, 1);
    }
    /* The variants built meanwhile serve their shapes. */
    for (uint32_t e = 17 + (uint32_t)round % 5; e < 17 + shapes; e += 5) {
        const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(5, e, 1);
        check_route(ctx, &d, &rng, e % 2 != 0, PATH_HOST, 0);
    }
    moecl_context_destroy(ctx);
}

START_TEST(test_threads_while_building)
{
    (void)harness_seed(); /* before any thread asks for it */
    /* MOECL_TEST_QUICK (valgrind, where threads take turns): half the
     * shapes, one growth a round. */
    const uint32_t shapes = harness_quick() ? BUILD_SHAPES / 2 : BUILD_SHAPES;
    const double t0 = now_s();
    for (int round = 0; round < BUILD_ROUNDS && (round == 0 || now_s() - t0 < BUILD_SECONDS); round++)
        build_while_routing(round, shapes);
}
END_TEST

/* ---------------------------------------------------------------------- */

static TCase *tcase(Suite *s, const char *name, bool env_fixture)
{
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, 300);
    if (env_fixture)
        tcase_add_checked_fixture(tc, env_setup, env_teardown);
    suite_add_tcase(s, tc);
    return tc;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--probe-create") == 0)
        return probe_create();

    Suite *s = suite_create("runtime");
    TCase *tc = tcase(s, "status", false);
    tcase_add_test(tc, test_status_strings);
    tcase_add_test(tc, test_desc_init);

    tc = tcase(s, "validation", false);
    tcase_add_test(tc, test_invalid_desc);
    tcase_add_test(tc, test_null_arguments);
    tcase_add_test(tc, test_invalid_buffers);
    tcase_add_test(tc, test_zero_tokens);

    tc = tcase(s, "context", true);
    tcase_add_test(tc, test_device_selection);
    tcase_add_test(tc, test_context_accessors);
    tcase_add_test(tc, test_no_platform);
    tcase_add_test(tc, test_create_from_cl);

    tc = tcase(s, "events", false);
    tcase_add_test(tc, test_events_and_offsets);

    tc = tcase(s, "cache", true);
    tcase_add_test(tc, test_cache_cold_warm);
    tcase_add_test(tc, test_cache_corrupt);
    tcase_add_test(tc, test_cache_unwritable);
    tcase_add_test(tc, test_cache_off);

    tc = tcase(s, "kernel_dir", true);
    tcase_add_test(tc, test_kernel_dir);

    tc = tcase(s, "threads", false);
    tcase_add_test(tc, test_threads);
    tcase_add_test(tc, test_threads_while_building);

    return harness_run(s);
}
