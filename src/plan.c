/* Launch plans: what a distinct request launches, resolved once per
 * context; and running a call: checking the caller's buffers, binding a
 * plan's kernel arguments and enqueueing.
 *
 * A call of an op is: validate the request (the op's file), then here:
 * look its plan up, bind the arguments, enqueue. The plan is built on a
 * context's first call of a request (the op's rule and check through
 * src/launch.c, the variant's build in src/program.c) and lives until the
 * context is destroyed. The table is open-addressed with atomically
 * published pointers, so a lookup takes no lock; building and inserting
 * take one mutex, so concurrent first calls of a request build one plan.
 * moecl_launch_force bumps its op's generation, which is part of the key:
 * the next call builds (or finds) the plan of the new configuration.
 *
 * Binding sets only the arguments a pooled kernel does not hold already.
 * A caller's buffer is validated (CL_MEM_SIZE, CL_MEM_CONTEXT), set and
 * retained when it differs from the kernel's last one; the same handle
 * again is the same buffer, because the reference keeps it alive (a
 * released buffer's handle comes back for the next one, and NVIDIA's
 * destructor callbacks run too late to tell), so it is checked against
 * the size kept and not set again. The reference is dropped when the
 * kernel gets another buffer, by moecl_context_forget_buffers and when
 * the context is destroyed. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define PLAN_SLOTS 1024u /* a power of two */

/* Plans that found no slot (a table full of moecl-tune's sweep) go on a
 * list read under the lock. */
typedef struct plan_node {
    moecl_plan plan;
    struct plan_node *next;
} plan_node;

struct moecl_plans {
    _Atomic(moecl_plan *) slots[PLAN_SLOTS];
    pthread_mutex_t lock;
    plan_node *overflow;
    atomic_size_t count;
};

moecl_status moecl_plans_create(moecl_plans **out)
{
    moecl_plans *t = calloc(1, sizeof(*t));
    if (!t || pthread_mutex_init(&t->lock, NULL) != 0) {
        free(t);
        return MOECL_ERROR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < PLAN_SLOTS; i++)
        atomic_init(&t->slots[i], NULL);
    atomic_init(&t->count, 0);
    *out = t;
    return MOECL_SUCCESS;
}

void moecl_plans_destroy(moecl_plans *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < PLAN_SLOTS; i++)
        free(atomic_load(&t->slots[i]));
    for (plan_node *n = t->overflow; n;) {
        plan_node *next = n->next;
        free(n);
        n = next;
    }
    pthread_mutex_destroy(&t->lock);
    free(t);
}

size_t moecl_plan_count(const moecl_context *ctx)
{
    return atomic_load(&ctx->plans->count);
}

static bool key_equal(const moecl_plan_key *a, const moecl_plan_key *b)
{
    return a->a == b->a && a->b == b->b && a->c == b->c && a->d == b->d && a->gen == b->gen;
}

static size_t key_hash(const moecl_plan_key *k)
{
    uint64_t h = (k->a ^ (k->b * 0x9e3779b97f4a7c15ull) ^ (k->c * 0xc2b2ae3d27d4eb4full) ^
                  (k->d * 0x165667b19e3779f9ull) ^ ((uint64_t)k->gen << 40)) *
                 0xff51afd7ed558ccdull;
    return (size_t)(h ^ (h >> 29));
}

/* The plan of key in the table, or NULL; *full: no empty slot was met. */
static const moecl_plan *find_slot(moecl_plans *t, const moecl_plan_key *key, bool *full)
{
    const size_t h = key_hash(key);
    for (size_t i = 0; i < PLAN_SLOTS; i++) {
        const moecl_plan *p = atomic_load_explicit(&t->slots[(h + i) & (PLAN_SLOTS - 1)], memory_order_acquire);
        if (!p) {
            *full = false;
            return NULL;
        }
        if (key_equal(&p->key, key))
            return p;
    }
    *full = true;
    return NULL;
}

static const moecl_plan *find_overflow(const moecl_plans *t, const moecl_plan_key *key)
{
    for (const plan_node *n = t->overflow; n; n = n->next)
        if (key_equal(&n->plan.key, key))
            return &n->plan;
    return NULL;
}

/* Under the lock: a copy of plan in the first empty slot of its probe
 * sequence, else on the overflow list; NULL when out of memory. */
static const moecl_plan *insert(moecl_plans *t, const moecl_plan *plan)
{
    const size_t h = key_hash(&plan->key);
    for (size_t i = 0; i < PLAN_SLOTS; i++) {
        _Atomic(moecl_plan *) *slot = &t->slots[(h + i) & (PLAN_SLOTS - 1)];
        if (atomic_load_explicit(slot, memory_order_relaxed))
            continue;
        moecl_plan *p = malloc(sizeof(*p));
        if (!p)
            return NULL;
        *p = *plan;
        atomic_store_explicit(slot, p, memory_order_release);
        return p;
    }
    plan_node *n = malloc(sizeof(*n));
    if (!n)
        return NULL;
    n->plan = *plan;
    n->next = t->overflow;
    t->overflow = n;
    return &n->plan;
}

moecl_plan_key moecl_plan_key_of(const moecl_context *ctx, moecl_op op, uint64_t a, uint64_t b, uint64_t c,
                                 uint64_t d)
{
    const unsigned gen = (unsigned)op < MOECL_NUM_OPS ? atomic_load_explicit(&ctx->force_gen[op], memory_order_relaxed)
                                                      : 0;
    return (moecl_plan_key){(a << 2) | (uint64_t)op, b, c, d, gen};
}

const moecl_plan *moecl_plan_find(moecl_context *ctx, const moecl_plan_key *key)
{
    moecl_plans *t = ctx->plans;
    bool full = false;
    const moecl_plan *p = find_slot(t, key, &full);
    if (!p && full) {
        pthread_mutex_lock(&t->lock);
        p = find_overflow(t, key);
        pthread_mutex_unlock(&t->lock);
    }
    return p;
}

moecl_status moecl_plan_get(moecl_context *ctx, const moecl_plan_key *key, moecl_plan_build build,
                            const void *request, const moecl_plan **plan)
{
    moecl_plans *t = ctx->plans;
    bool full = false;
    const moecl_plan *p = find_slot(t, key, &full);
    if (p) {
        *plan = p;
        return MOECL_SUCCESS;
    }
    pthread_mutex_lock(&t->lock);
    p = find_slot(t, key, &full);
    if (!p && full)
        p = find_overflow(t, key);
    moecl_status st = MOECL_SUCCESS;
    if (!p) {
        moecl_plan fresh;
        memset(&fresh, 0, sizeof(fresh));
        fresh.key = *key;
        st = build(ctx, request, &fresh);
        if (st == MOECL_SUCCESS) {
            p = insert(t, &fresh);
            if (p)
                atomic_fetch_add(&t->count, 1);
            else
                st = moecl_fail(ctx, MOECL_ERROR_OUT_OF_MEMORY, "out of host memory keeping a launch plan");
        }
    }
    pthread_mutex_unlock(&t->lock);
    *plan = p;
    return st;
}

/* ---- binding ---- */

static cl_mem mem_of(const moecl_kernel_arg *arg)
{
    return arg->value ? *(const cl_mem *)arg->value : NULL;
}

/* The caller's buffers among args, as moecl_check_buffer checks them;
 * sizes[i] gets each one's CL_MEM_SIZE. A buffer that kernel k (NULL: no
 * kernel) holds already is checked against the size kept, with no query. */
static moecl_status check_buffers(moecl_context *ctx, const moecl_pooled_kernel *k, const moecl_kernel_arg *args,
                                  cl_uint count, size_t *sizes)
{
    /* A kernel remembers at most MOECL_MAX_KERNEL_ARGS arguments: a longer
     * list is a bug in moecl, refused rather than written past the end. */
    if (count > MOECL_MAX_KERNEL_ARGS)
        return moecl_fail(ctx, MOECL_ERROR_UNSUPPORTED,
                          "internal error: a kernel of %u arguments, more than the %d moecl binds", count,
                          MOECL_MAX_KERNEL_ARGS);
    for (cl_uint i = 0; i < count; i++) {
        const moecl_buffer_check *c = args[i].check;
        sizes[i] = 0;
        if (!c)
            continue;
        const moecl_buffer buf = {mem_of(&args[i]), c->offset};
        moecl_status st;
        if (k && buf.mem && k->args[i].held == buf.mem) {
            sizes[i] = k->args[i].held_size;
            st = moecl_check_buffer_fits(ctx, c->name, c->offset, c->bytes, c->elem_size, sizes[i]);
        } else {
            st = moecl_check_buffer_size(ctx, c->name, buf, c->bytes, c->elem_size, c->required, &sizes[i]);
        }
        if (st != MOECL_SUCCESS)
            return st;
    }
    return MOECL_SUCCESS;
}

/* What the argument would be remembered as: a value, local memory (or an
 * absent buffer: the size alone), or a caller's buffer to hold (size: its
 * CL_MEM_SIZE). The library's own buffers are not remembered. */
static moecl_arg_state state_of(const moecl_kernel_arg *arg, size_t size)
{
    moecl_arg_state s;
    memset(&s, 0, sizeof(s));
    s.valid = true;
    s.size = arg->size;
    if (!arg->value) {
        s.local = true;
    } else if (arg->mem) {
        s.valid = arg->check != NULL;
        s.held = arg->check ? mem_of(arg) : NULL;
        s.held_size = size;
    } else if (arg->size <= MOECL_ARG_BYTES) {
        memcpy(s.bits, arg->value, arg->size);
    } else {
        s.valid = false;
    }
    return s;
}

static bool same(const moecl_arg_state *a, const moecl_arg_state *b)
{
    return a->valid && b->valid && a->local == b->local && a->size == b->size && a->held == b->held &&
           memcmp(a->bits, b->bits, a->size <= MOECL_ARG_BYTES ? a->size : 0) == 0;
}

moecl_status moecl_bind_args(moecl_context *ctx, moecl_pooled_kernel *k, const char *name,
                             const moecl_kernel_arg *args, cl_uint count)
{
    /* Every buffer first, so that a bad one leaves the kernel as it was. */
    size_t sizes[MOECL_MAX_KERNEL_ARGS];
    const moecl_status st = check_buffers(ctx, k, args, count, sizes);
    if (st != MOECL_SUCCESS)
        return st;
    for (cl_uint i = 0; i < count; i++) {
        moecl_arg_state next = state_of(&args[i], sizes[i]);
        moecl_arg_state *last = &k->args[i];
        if (same(last, &next))
            continue; /* the kernel still has this value */
        const cl_int err = clSetKernelArg(k->kernel, i, args[i].size, args[i].value);
        if (err != CL_SUCCESS) {
            moecl_arg_state_release(last);
            return moecl_fail(ctx, err, "clSetKernelArg(%s, arg %u) failed: %s", name, i, moecl_status_string(err));
        }
        /* Without the reference the handle may come back for another
         * buffer: then the argument is set again next time. */
        if (next.held && clRetainMemObject(next.held) != CL_SUCCESS)
            next = (moecl_arg_state){0};
        moecl_arg_state_release(last);
        *last = next;
    }
    return MOECL_SUCCESS;
}

/* ---- running a call ---- */

static void give_back(const moecl_plan *p, moecl_step *steps, int n)
{
    for (int i = 0; i < n; i++)
        if (steps[i].borrowed) {
            moecl_variant_release(p->variants[steps[i].kernel], steps[i].borrowed);
            steps[i].borrowed = NULL;
        }
}

/* Everything that can be checked before a command is enqueued, for every
 * kernel of the call: the work-group limits, borrowing the kernels, and
 * every argument. So an argument error leaves nothing enqueued and no
 * output written; only an enqueue can still fail after the first. */
static moecl_status bind_steps(moecl_context *ctx, const moecl_plan *p, moecl_step *steps, int n)
{
    moecl_status st = MOECL_SUCCESS;
    for (int i = 0; i < n && st == MOECL_SUCCESS; i++)
        if (steps[i].args)
            st = moecl_check_work_group(ctx, p->kernel_names[steps[i].kernel], steps[i].local,
                                        p->limits[steps[i].kernel]);
    for (int i = 0; i < n && st == MOECL_SUCCESS; i++) {
        moecl_step *s = &steps[i];
        s->borrowed = NULL;
        if (s->args && (st = moecl_variant_acquire(ctx, p->variants[s->kernel], &s->borrowed)) == MOECL_SUCCESS)
            st = moecl_bind_args(ctx, s->borrowed, p->kernel_names[s->kernel], s->args, s->num_args);
    }
    if (st != MOECL_SUCCESS)
        give_back(p, steps, n);
    return st;
}

/* The chained commands of one call. The first waits on the caller's wait
 * list; on an in-order queue the later ones need no events (the queue
 * orders them, and each event costs the host time on NVIDIA), on an
 * out-of-order queue each waits on its predecessor's. The last one's event
 * is the call's, taken only where the caller asks for it. */
typedef struct chain {
    moecl_context *ctx;
    cl_uint num_wait;
    const cl_event *wait;
    cl_event prev; /* the last command's event, where one was taken */
    bool started;  /* something was enqueued */
} chain;

static moecl_status chain_launch(chain *c, const moecl_plan *p, const moecl_step *s, cl_event *done)
{
    const bool in_order = c->ctx->in_order;
    const cl_uint num_wait = !c->started ? c->num_wait : in_order ? 0 : 1;
    const cl_event *wait = !c->started ? c->wait : in_order ? NULL : &c->prev;
    cl_event ev = NULL, *want = done ? done : in_order ? NULL : &ev;
    cl_int err;
    if (s->args) {
        err = clEnqueueNDRangeKernel(c->ctx->queue, s->borrowed->kernel, 1, NULL, &s->global, &s->local, num_wait,
                                     wait, want);
        if (err != CL_SUCCESS)
            return moecl_fail(c->ctx, err, "clEnqueueNDRangeKernel(%s) failed: %s", p->kernel_names[s->kernel],
                              moecl_status_string(err));
    } else {
        const cl_int zero = 0;
        err = clEnqueueFillBuffer(c->ctx->queue, s->fill, &zero, sizeof(zero), s->fill_offset, s->fill_bytes,
                                  num_wait, wait, want);
        if (err != CL_SUCCESS)
            return moecl_fail(c->ctx, err, "clEnqueueFillBuffer(%s) failed: %s", s->fill_name,
                              moecl_status_string(err));
    }
    c->started = true;
    if (ev) {
        if (c->prev)
            clReleaseEvent(c->prev);
        c->prev = ev;
    }
    return MOECL_SUCCESS;
}

/* A command of the chain failed after earlier ones were queued: wait for
 * those, so that nothing writes the outputs after the call returns. The
 * last event taken is the last command queued on an out-of-order queue
 * (each waits on the one before); on an in-order queue none was taken. */
static void chain_abandon(chain *c)
{
    if (c->prev) {
        clWaitForEvents(1, &c->prev);
        clReleaseEvent(c->prev);
    } else if (c->started) {
        clFinish(c->ctx->queue);
    }
}

moecl_status moecl_plan_run(moecl_context *ctx, const moecl_plan *p, moecl_step *steps, int n, cl_uint num_wait,
                            const cl_event *wait, cl_event *done)
{
    moecl_status st = bind_steps(ctx, p, steps, n);
    if (st != MOECL_SUCCESS)
        return st;
    chain c = {ctx, num_wait, wait, NULL, false};
    for (int i = 0; i < n && st == MOECL_SUCCESS; i++)
        st = chain_launch(&c, p, &steps[i], i == n - 1 ? done : NULL);
    give_back(p, steps, n);
    if (st != MOECL_SUCCESS) {
        chain_abandon(&c);
        return st;
    }
    if (c.prev)
        clReleaseEvent(c.prev);
    return MOECL_SUCCESS;
}

moecl_status moecl_check_args(moecl_context *ctx, const moecl_kernel_arg *args, cl_uint count)
{
    size_t sizes[MOECL_MAX_KERNEL_ARGS];
    return check_buffers(ctx, NULL, args, count, sizes);
}

moecl_status moecl_plan_launch(moecl_context *ctx, const moecl_launch_call *c, cl_uint num_wait, const cl_event *wait,
                               cl_event *done)
{
    moecl_status st = MOECL_SUCCESS;
    const moecl_plan *p = moecl_plan_find(ctx, &c->key);
    if (!p || c->tokens == 0) {
        /* Before a build: a bad buffer costs no compile. */
        size_t sizes[MOECL_MAX_KERNEL_ARGS];
        st = check_buffers(ctx, NULL, c->args, c->num_args, sizes);
        if (st == MOECL_SUCCESS && !p)
            st = moecl_plan_get(ctx, &c->key, c->build, c->request, &p);
        if (st != MOECL_SUCCESS)
            return st;
    }
    const size_t global = moecl_round_up(c->tokens, p->rows_per_group) / p->rows_per_group * p->local;
    moecl_step steps[2] = {{0, NULL, 0, 0, 0, c->zero, c->zero_offset, c->zero_bytes, c->zero_name, NULL},
                           {0, c->args, c->num_args, global, p->local, NULL, 0, 0, NULL, NULL}};
    /* No tokens: only the zeroing, or a marker that keeps the wait list. */
    if (c->tokens == 0)
        return c->zero ? moecl_plan_run(ctx, p, steps, 1, num_wait, wait, done)
                       : moecl_enqueue_nothing(ctx, num_wait, wait, done);
    return c->zero ? moecl_plan_run(ctx, p, steps, 2, num_wait, wait, done)
                   : moecl_plan_run(ctx, p, steps + 1, 1, num_wait, wait, done);
}

moecl_status moecl_check_work_group(moecl_context *ctx, const char *name, size_t local, size_t limit)
{
    if (limit && local > limit)
        return moecl_fail(ctx, CL_INVALID_WORK_GROUP_SIZE,
                          "%s needs work-groups of %zu work-items but allows at most %zu on this device "
                          "(CL_KERNEL_WORK_GROUP_SIZE); nothing was enqueued",
                          name, local, limit);
    return MOECL_SUCCESS;
}
