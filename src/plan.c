/* Launch plans: what a distinct request launches, resolved once per
 * context, and the binding of a plan's kernel arguments.
 *
 * A call of an op is: validate the request, look its plan up here, bind
 * the arguments, enqueue. The plan is built on a context's first call of a
 * request (the op's rule, the tune file, the table, the variant's build:
 * src/topk_gating.c, grounded_router.c, moe_align.c) and lives until the
 * context is destroyed. The table is open-addressed with atomically
 * published pointers, so a lookup takes no lock; building and inserting
 * take one mutex, so concurrent first calls of a request build one plan.
 * moecl_launch_force bumps its op's generation, which is part of the key:
 * the next call builds (or finds) the plan of the new configuration. */
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
    return a->a == b->a && a->b == b->b && a->gen == b->gen;
}

static size_t key_hash(const moecl_plan_key *k)
{
    uint64_t h = (k->a ^ (k->b * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)k->gen << 40)) * 0xff51afd7ed558ccdull;
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

moecl_plan_key moecl_plan_key_of(const moecl_context *ctx, moecl_op op, uint64_t a, uint64_t b)
{
    const unsigned gen = (unsigned)op < MOECL_NUM_OPS ? atomic_load_explicit(&ctx->force_gen[op], memory_order_relaxed)
                                                      : 0;
    return (moecl_plan_key){(a << 2) | (uint64_t)op, b, gen};
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

static moecl_status check_arg_buffer(moecl_context *ctx, const moecl_kernel_arg *arg, const moecl_arg_state *last,
                                     size_t *size_out)
{
    const moecl_buffer_check *c = arg->check;
    const cl_mem mem = arg->value ? *(const cl_mem *)arg->value : NULL;
    if (!mem) {
        if (c->required)
            return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s: the buffer is absent (mem is NULL)", c->name);
        return MOECL_SUCCESS;
    }
    size_t size;
    if (last->valid && last->mem == mem && last->mem_size != SIZE_MAX) {
        /* The kernel holds a reference to this buffer, validated when it
         * was bound: the same object, of the same size and context. */
        size = last->mem_size;
    } else {
        cl_context owner = NULL;
        cl_int err = clGetMemObjectInfo(mem, CL_MEM_SIZE, sizeof(size), &size, NULL);
        if (err == CL_SUCCESS)
            err = clGetMemObjectInfo(mem, CL_MEM_CONTEXT, sizeof(owner), &owner, NULL);
        if (err != CL_SUCCESS)
            return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s: not a valid cl_mem (%s)", c->name,
                              moecl_status_string(err));
        if (owner != ctx->context)
            return moecl_fail(ctx, MOECL_ERROR_INVALID_ARGUMENT, "%s: the buffer belongs to another cl_context",
                              c->name);
    }
    *size_out = size;
    return moecl_check_buffer_fits(ctx, c->name, c->offset, c->bytes, c->elem_size, size);
}

/* What the argument would be remembered as. */
static moecl_arg_state state_of(const moecl_kernel_arg *arg, size_t mem_size)
{
    moecl_arg_state s;
    memset(&s, 0, sizeof(s));
    s.valid = true;
    s.size = arg->size;
    s.mem_size = SIZE_MAX;
    if (!arg->value)
        s.local = true; /* local memory, or an absent buffer: size alone */
    else if (arg->mem)
        s.mem = *(const cl_mem *)arg->value, s.mem_size = mem_size;
    else
        memcpy(&s.bits, arg->value, arg->size);
    return s;
}

static bool same(const moecl_arg_state *a, const moecl_arg_state *b)
{
    return a->valid && a->local == b->local && a->size == b->size && a->bits == b->bits && a->mem == b->mem;
}

moecl_status moecl_bind_args(moecl_context *ctx, moecl_pooled_kernel *k, const char *name,
                             const moecl_kernel_arg *args, cl_uint count)
{
    size_t sizes[MOECL_MAX_KERNEL_ARGS];
    /* Every buffer first, so that a bad one leaves the kernel as it was. */
    for (cl_uint i = 0; i < count; i++) {
        sizes[i] = SIZE_MAX;
        if (args[i].check) {
            const moecl_status st = check_arg_buffer(ctx, &args[i], &k->args[i], &sizes[i]);
            if (st != MOECL_SUCCESS)
                return st;
        }
    }
    for (cl_uint i = 0; i < count; i++) {
        moecl_arg_state next = state_of(&args[i], sizes[i]);
        moecl_arg_state *last = &k->args[i];
        if (same(last, &next)) {
            if (next.mem && next.mem_size != SIZE_MAX)
                last->mem_size = next.mem_size;
            continue; /* the kernel still has this value */
        }
        const cl_int err = clSetKernelArg(k->kernel, i, args[i].size, args[i].value);
        if (last->mem)
            clReleaseMemObject(last->mem);
        memset(last, 0, sizeof(*last));
        if (err != CL_SUCCESS)
            return moecl_fail(ctx, err, "clSetKernelArg(%s, arg %u) failed: %s", name, i, moecl_status_string(err));
        if (next.mem && clRetainMemObject(next.mem) != CL_SUCCESS)
            continue; /* not remembered: set again next time */
        *last = next;
    }
    return MOECL_SUCCESS;
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
