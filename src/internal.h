/* Library-private declarations shared by the files of src/. */
#ifndef MOECL_INTERNAL_H
#define MOECL_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <moecl/moecl.h>

#define MOECL_MAX_EXPERTS 4096u
#define MOECL_MAX_TOPK 64u
#define MOECL_MAX_HIDDEN 65536u

/* ---- status.c: per-thread error detail ---- */

/* Record a formatted message as this thread's last failure on ctx (NULL for
 * context creation) and return status, so error paths read
 * `return moecl_fail(ctx, MOECL_ERROR_..., "...", ...)`. */
moecl_status moecl_fail(const moecl_context *ctx, moecl_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Forget the thread's detail for ctx (called on destroy). */
void moecl_error_forget(const moecl_context *ctx);

/* ---- device.c: device facts and the launch class derived from them ---- */

typedef enum moecl_launch_class {
    MOECL_LAUNCH_CPU = 0, /* one work-item per row, plain loops */
    MOECL_LAUNCH_GPU = 1, /* a team of work-items per row, rows in registers */
} moecl_launch_class;

typedef enum moecl_vendor {
    MOECL_VENDOR_OTHER = 0,
    MOECL_VENDOR_NVIDIA,
    MOECL_VENDOR_AMD,
    MOECL_VENDOR_INTEL,
    MOECL_VENDOR_POCL,
    MOECL_VENDOR_RUSTICL, /* Mesa's rusticl, by its platform name, whatever its device */
} moecl_vendor;

/* moe_align's paths (src/moe_align.c): chosen by size and device, or
 * forced by the variant override (align=) for tests and measurements. */
typedef enum moecl_align_path {
    MOECL_ALIGN_AUTO = 0,
    MOECL_ALIGN_ONE_GROUP,
    MOECL_ALIGN_FUSED,
    MOECL_ALIGN_CHUNKED,
    MOECL_ALIGN_FUSED_PARALLEL
} moecl_align_path;

/* The expert-parallel layout's paths (src/ep_layout.c): by launch class
 * and size, or forced by the variant override (ep=) for tests and
 * measurements (FUSED_LAST: the one launch with its grid-wide wait off). */
typedef enum moecl_ep_path { MOECL_EP_AUTO = 0, MOECL_EP_CHUNKED, MOECL_EP_FUSED, MOECL_EP_FUSED_LAST } moecl_ep_path;

typedef enum moecl_op {
    MOECL_OP_TOPK_GATING = 0,
    MOECL_OP_GROUNDED_ROUTER = 1,
    MOECL_NUM_OPS, /* the ops with launch configurations */
    MOECL_OP_MOE_ALIGN = MOECL_NUM_OPS,
    MOECL_OP_EP_LAYOUT, /* the plan key keeps 2 bits for the op */
} moecl_op;

/* The kernel families; the values are the grounded router's KERNEL define. */
typedef enum moecl_kernel_kind {
    MOECL_KERNEL_ROWS = 0,
    MOECL_KERNEL_TEAM = 1,
    MOECL_KERNEL_TILED = 2,
    MOECL_KERNEL_MMA = 3, /* the grounded router on tensor cores (cl/router_mma.cl) */
    MOECL_KERNEL_SPLITK = 4, /* the grounded router split along the hidden dimension (few tokens) */
} moecl_kernel_kind;

#define MOECL_LAUNCH_MAX_TEAM 256u
#define MOECL_LAUNCH_MAX_ROWS 4096u

/* The GEMM tile of the grounded router's tiled kernel beside its `tile`
 * tokens (cl/grounded_router.cl, KERNEL 2): experts a tile, hidden step,
 * a work-item's register block (rows x columns), the vector width of its
 * loads (1, 2, 4) and double buffering (0, 1). All zero: the tile table's
 * first entry for `tile` tokens (src/grounded_router.c). */
typedef struct moecl_tile_params {
    unsigned tn, tk, mt, nt, vec, db;
    unsigned wc; /* work-items side by side along the experts; 0: tn / nt */
} moecl_tile_params;

/* A launch configuration. rows: one row (token) per work-item, `rows` of
 * them a work-group (team 1, tile 0). team: `team` work-items per row (a
 * power of two >= 2), `rows` rows a work-group. tiled (grounded router
 * only): `tile` tokens a work-group and the GEMM tile in `tiled` (team 1,
 * rows 0). */
typedef struct moecl_launch_config {
    moecl_kernel_kind kernel;
    unsigned team, rows, tile;
    moecl_tile_params tiled;
} moecl_launch_config;

/* What the variant override forces (src/override.c), copied when a context
 * is created: tests run every variant of an op on one device this way,
 * tools (moecl-tune, moecl-bench --variant) force one. Nothing here comes
 * from the environment. */
typedef struct moecl_launch_env {
    bool launch_class_forced;    /* class=cpu|gpu set launch_class */
    moecl_launch_class launch_class;
    unsigned team;               /* team=N: work-items per row of the top-k team kernel, 0 = chosen */
    bool grounded_wide_tile;     /* tile=128: try the 128-token tile first */
    /* tile=64 tn=128 tk=16 mt=8 nt=8 vec=4 db=1 (the tune file's syntax):
     * this tiled configuration where the device runs it; kernel ROWS when
     * unset. */
    moecl_launch_config grounded_tile;
    bool grounded_mma;           /* grounded=mma: the tensor-core kernel (emulated without PTX) */
    bool grounded_splitk;        /* grounded=splitk: the split-K kernel at every token count */
    unsigned splitk_chunk;       /* kchunk=N: its hidden chunk, 0 = chosen */
    moecl_align_path align_path; /* align=one-group|fused|chunked|fused-parallel: moe_align's path, or by size */
    moecl_ep_path ep_path;       /* ep=chunked|fused|fused-last: the layout's path, or chosen */
    unsigned ep_fused_wg;        /* ep_wg=N: the fused layout kernel's work-group, 0 = chosen */
    unsigned ep_fused_groups;    /* ep_groups=N: its work-groups' target count, 0 = chosen */
    int binaries;                /* binaries=on|off: 1 or -1 forces the binary cache, 0 = the table's */
    /* table=VENDOR: that vendor's device-table values over the device's
     * (src/device_table.c), so that a CPU driver runs the kernels as that
     * vendor's devices build and size them; OTHER = none forced. */
    moecl_vendor table_vendor;
} moecl_launch_env;

/* ---- override.c: the process-wide variant override ---- */

/* Parse a space-separated list of name=value words into env (all zero
 * first: nothing forced); NULL or "" forces nothing. Names: class
 * (cpu|gpu), team (power of two 2..256), align (one-group|fused|chunked|
 * fused-parallel),
 * ep (chunked|fused|fused-last), ep_wg (power of two 32..1024), ep_groups
 * (1..127), grounded (mma|splitk), kchunk (power of two 16..8192: the
 * split-K kernel's hidden chunk), tile (128, or a tiled configuration with
 * tn, tk, mt, nt, vec, db, wc as in the tune file), binaries (on|off),
 * table (nvidia|amd|intel|pocl|rusticl).
 * MOECL_ERROR_INVALID_ARGUMENT with a message naming the bad word. */
moecl_status moecl_override_parse(const char *text, moecl_launch_env *env);
/* Parse text and make it the override every context created afterwards
 * copies (a failure keeps the previous one). Not for calls in flight. */
moecl_status moecl_override_set(const char *text);
/* The current override. */
void moecl_override_get(moecl_launch_env *env);

typedef struct moecl_device_info {
    char platform_name[128];
    char device_name[128];
    char driver_version[128];
    char device_version[128];
    cl_device_type type;
    moecl_vendor vendor;
    cl_uint compute_units;
    cl_ulong local_mem_size;
    size_t max_work_group_size;
    moecl_launch_class launch_class;
    const char *launch_reason; /* static text: why this class */
    moecl_launch_env env;      /* what the environment forces */
    /* The compute capability of cl_nv_device_attribute_query, 0.0 where
     * the device does not list that extension. */
    cl_uint nv_compute_major, nv_compute_minor;
    bool ptx; /* the kernels' inline PTX paths may be built: moecl_device_ptx(), set at query */
} moecl_device_info;

/* Fill info for device (queries OpenCL). */
moecl_status moecl_device_query(cl_device_id device, moecl_device_info *info);
/* Whether the space-separated extension list names ext exactly. */
bool moecl_extension_listed(const char *extensions, const char *ext);
/* Resolve a selector (see moecl_context_create) to a device; on failure
 * the message is recorded for ctx NULL. */
moecl_status moecl_device_select(const char *selector, cl_platform_id *platform, cl_device_id *device);
const char *moecl_launch_class_name(moecl_launch_class c);

/* ---- launch.c: launch configurations (per-device table, tune file, forcing) ---- */

/* What a configuration is keyed by. groups: top-k gating's group count
 * after dropping limits that select nothing away (0 for none, and for the
 * grounded router); hidden_bucket: the grounded router's hidden size
 * rounded up to a power of two (0 for top-k gating). */
typedef struct moecl_launch_key {
    moecl_op op;
    uint32_t num_experts, top_k, groups, hidden_bucket;
} moecl_launch_key;


/* Where a configuration came from, in rising precedence after DEFAULT. */
typedef enum moecl_launch_source {
    MOECL_SOURCE_DEFAULT = 0, /* computed from device facts */
    MOECL_SOURCE_TABLE,       /* the device table (src/device_table.c) */
    MOECL_SOURCE_TUNED,       /* the tune file moecl-tune wrote */
    MOECL_SOURCE_OVERRIDE,    /* computed under the variant override (class, team, tile, grounded) */
    MOECL_SOURCE_FORCED,      /* moecl_launch_force (moecl-tune's sweep) */
} moecl_launch_source;

typedef struct moecl_tune_entry {
    moecl_launch_key key;
    moecl_launch_config config;
} moecl_tune_entry;

typedef struct moecl_tune_table {
    moecl_tune_entry *entries;
    size_t count, capacity;
} moecl_tune_table;

moecl_launch_key moecl_launch_key_topk(uint32_t num_experts, uint32_t top_k, uint32_t groups);
moecl_launch_key moecl_launch_key_grounded(uint32_t hidden_dim, uint32_t num_experts, uint32_t top_k);
bool moecl_launch_config_equal(const moecl_launch_config *a, const moecl_launch_config *b);
const char *moecl_launch_source_name(moecl_launch_source s);
/* The tune file's text of a key ("topk e=128 k=8 groups=0") and of a
 * configuration ("kernel=team team=16 rows=8"); snprintf's return. */
int moecl_launch_key_text(const moecl_launch_key *key, char *buf, size_t size);
int moecl_launch_config_text(const moecl_launch_config *config, char *buf, size_t size);

/* The configurations that override the computed default for key, highest
 * precedence first (forced, then tune file, then table; the last two not
 * when an environment variable decides). The op takes the first that is
 * valid on the device, else its computed default, whose source
 * moecl_launch_default_source gives (ENV or DEFAULT). */
#define MOECL_LAUNCH_MAX_OVERRIDES 3
unsigned moecl_launch_overrides(const moecl_context *ctx, const moecl_launch_key *key,
                                moecl_launch_config configs[MOECL_LAUNCH_MAX_OVERRIDES],
                                moecl_launch_source sources[MOECL_LAUNCH_MAX_OVERRIDES]);
moecl_launch_source moecl_launch_default_source(const moecl_device_info *info, moecl_op op);

/* An op's rule (device facts + request -> configuration) and check (can
 * the device run this configuration for the request; if so, the shape it
 * launches, into the op's own record). A rows configuration of one row
 * passes every check. */
typedef struct moecl_launch_rule {
    moecl_launch_config (*rule)(const moecl_device_info *info, const void *request);
    bool (*check)(const moecl_device_info *info, const moecl_launch_config *config, const void *request, void *shape);
} moecl_launch_rule;

/* The configuration of a request, its shape and its source: on ctx the
 * first override that passes the check, else the rule; with ctx NULL, on a
 * device described by info, the rule alone. Called when a plan is built,
 * and by the introspection of moecl-info and moecl-tune. */
moecl_launch_source moecl_launch_resolve(const moecl_context *ctx, const moecl_device_info *info,
                                         const moecl_launch_key *key, const moecl_launch_rule *rule,
                                         const void *request, moecl_launch_config *config, void *shape);
/* Force config for every call of op on ctx (NULL: stop forcing). For
 * moecl-tune and the tests: not synchronised with calls in flight. */
void moecl_launch_force(moecl_context *ctx, moecl_op op, const moecl_launch_config *config);

/* The tune file of the device: path in the cache directory (false when the
 * cache is off); load (an empty table when absent or foreign; bad lines
 * skipped; never fails); store atomically, comment lines first (false on
 * any failure, leaving the old file). */
bool moecl_tune_path(const moecl_device_info *info, char *path, size_t size);
void moecl_tune_load(const moecl_device_info *info, moecl_tune_table *table);
bool moecl_tune_store(const moecl_device_info *info, const moecl_tune_table *table, const char *comment);
const moecl_launch_config *moecl_tune_find(const moecl_tune_table *table, const moecl_launch_key *key);
/* A configuration in the tune file's syntax, moecl_launch_config_text's
 * ("kernel=tiled tile=64 tn=128 tk=16 mt=8 nt=8 vec=4 db=1"; "kernel=tiled
 * tile=64" alone: the table's entry); false for anything malformed or out
 * of range. */
bool moecl_launch_config_parse(const char *text, moecl_launch_config *config);
/* Add or replace; false when out of memory or full. */
bool moecl_tune_set(moecl_tune_table *table, const moecl_launch_key *key, const moecl_launch_config *config);
void moecl_tune_free(moecl_tune_table *table);
/* Whether the variant override decides op's configuration: then the tune
 * file and the device table step aside and the op's rule runs under what
 * it forces (the source is MOECL_SOURCE_OVERRIDE). */
bool moecl_launch_env_decides(const moecl_launch_env *env, moecl_op op);

/* ---- device_table.c: every per-device choice, in one table ---- */

/* The values the table holds for every device. Those that differ by
 * launch class come in pairs, the CPU class's id and then the GPU class's
 * (moecl_device_param_class picks one). */
typedef enum moecl_device_param {
    /* Build options: the kernels' MOECL_VENDOR_NVIDIA (unroll pragmas) and
     * NATIVE_MATH (cl/common.cl), 0 or 1. */
    MOECL_DP_UNROLL,
    MOECL_DP_NATIVE_MATH,
    /* Inline PTX from this compute capability (major) up; 0: never. */
    MOECL_DP_PTX_MIN_MAJOR,
    /* Driver refusals: team kernels in work-groups of at most this many
     * work-items (0: none refused); work-groups whose private arrays pass
     * this many bytes (0: no limit). */
    MOECL_DP_REFUSE_TEAM_WG,
    MOECL_DP_PRIVATE_MAX,
    /* moe_align's work-groups, each the largest power of two within this
     * and the device's limit: the chunk kernels', the scan's and the
     * one-group kernel's, the fused kernel's. */
    MOECL_DP_ALIGN_CHUNK_WG_CPU,
    MOECL_DP_ALIGN_CHUNK_WG_GPU,
    MOECL_DP_ALIGN_GROUP_WG,
    MOECL_DP_ALIGN_FUSED_WG_CPU,
    MOECL_DP_ALIGN_FUSED_WG_GPU,
    /* moe_align's paths by default: the fused kernel up to this many
     * slots, then the one-group kernel up to this many (0: never; the
     * _WARP limit where it ranks with WARP_MATCH), then the chunked path. */
    MOECL_DP_ALIGN_FUSED_MAX_SLOTS_CPU,
    MOECL_DP_ALIGN_FUSED_MAX_SLOTS_GPU,
    MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_CPU,
    MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_GPU,
    MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_WARP_CPU,
    MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_WARP_GPU,
    /* Before those: moe_align_fused_parallel (every work-group counts
     * every slot and places its own chunk) up to this many slots (0:
     * never by default; the override's align=fused-parallel at any size). */
    MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_CPU,
    MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_GPU,
    /* moecl_route_dispatch's one launch: at most this many slots, and
     * under the override's align=fused or fused-parallel this many. */
    MOECL_DP_ROUTE_ONE_KERNEL_MAX_SLOTS,
    MOECL_DP_ROUTE_ONE_KERNEL_FORCED_MAX_SLOTS,
    /* The expert-parallel layout: the fused kernel by default (0 or 1),
     * and its work-group (at most, as moe_align's). */
    MOECL_DP_EP_FUSED_CPU,
    MOECL_DP_EP_FUSED_GPU,
    MOECL_DP_EP_FUSED_WG,
    /* moecl_permute_scatter's work-group (at most): CPUs a work-item a
     * row, GPUs rows of up to this many work-items. */
    MOECL_DP_SCATTER_WG_CPU,
    MOECL_DP_SCATTER_WG_GPU,
    /* Its rows of out checked for padding by one launch row (at least 1). */
    MOECL_DP_SCATTER_ZERO_ROWS,
    /* The compiled-kernel disk cache (src/cache.c) stores and loads the
     * device's program binaries: 1; 0 where the implementation keeps a
     * kernel cache of its own and fetching a binary costs a compile. */
    MOECL_DP_BINARY_CACHE,
    /* A kernel's work-group limit: 1, the driver's CL_KERNEL_WORK_GROUP_SIZE;
     * 0 where that query is known to be wrong, the device's
     * CL_DEVICE_MAX_WORK_GROUP_SIZE (src/program.c). */
    MOECL_DP_KERNEL_WG_QUERY,
    /* The iterations after which the driver leaves a loop and runs on, one
     * budget for every loop a work-item runs (nested ones and ones after
     * another); 0: none. Kernels are chosen so that a work-item's bound
     * stays within it (moecl_loops_fit): the grounded router's rows kernel
     * takes fewer tokens a work-item, or the split-K kernel runs instead
     * (src/grounded_router.c). */
    MOECL_DP_LOOP_LIMIT,
    /* The grounded router's split-K kernel (KERNEL 4) for calls of at most
     * this many tokens, over the tune file's and the table's
     * configurations (0: never by default; the override grounded=splitk at
     * any count). */
    MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS_CPU,
    MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS_GPU,
    /* The split-K kernel's smallest chunk of the hidden dimension (a power
     * of two, 16 to 1024) where its rule halves the chunk to give a token
     * block two work-groups per compute unit (src/grounded_router.c). */
    MOECL_DP_GROUNDED_SPLITK_MIN_CHUNK,
    MOECL_NUM_DEVICE_PARAMS
} moecl_device_param;

/* Every parameter's value for one device. */
typedef struct moecl_device_params {
    uint32_t value[MOECL_NUM_DEVICE_PARAMS];
} moecl_device_params;

/* The values for a device described by info: the table's defaults, over
 * them the entry of info's vendor, over that the entries of the vendor
 * whose device name is a substring of info's (case-insensitive). A
 * context holds its device's (moecl_context.params). */
moecl_device_params moecl_device_table_params(const moecl_device_info *info);
/* Whether a work-item of at most `loops` loop iterations (every loop it
 * runs, one after another or nested) runs whole on the device: within its
 * MOECL_DP_LOOP_LIMIT where it has one. moecl_params_loops_fit reads a
 * table already built (a context's params); moecl_loops_fit builds it. */
static inline bool moecl_params_loops_fit(const moecl_device_params *params, uint64_t loops)
{
    const uint32_t limit = params->value[MOECL_DP_LOOP_LIMIT];
    return !limit || loops <= limit;
}
bool moecl_loops_fit(const moecl_device_info *info, uint64_t loops);
/* An upper bound on the loop iterations of cl/gating.cl's rows pipeline
 * (rows_pipeline) for one row, whatever the row's values: groups 0 where
 * the gating has none. */
uint64_t moecl_rows_gating_loops(uint32_t experts, uint32_t top_k, uint32_t groups, uint32_t topk_group);
/* A pair's value (cpu_id the CPU class's id) for launch class c; other
 * parameters are params->value[p]. */
static inline uint32_t moecl_device_param_class(const moecl_device_params *params, moecl_device_param cpu_id,
                                                moecl_launch_class c)
{
    return params->value[cpu_id + (c == MOECL_LAUNCH_GPU ? 1 : 0)];
}
/* The table's launch configuration for key on a device described by info
 * (the same lookup, entries keyed further by op, expert count and device
 * type); NULL where it has none. The tune file overrides it
 * (moecl_launch_overrides). */
const moecl_launch_config *moecl_device_table_launch(const moecl_device_info *info, const moecl_launch_key *key);
/* Whether the inline PTX of the kernels (TEAM_SHUFFLE in cl/common.cl,
 * WARP_MATCH in cl/moe_align.cl) suits a device described by info: the
 * table's compute capability threshold against the one device.c queried.
 * The ops ask for those paths only where info->ptx is set. */
bool moecl_device_ptx(const moecl_device_info *info);
/* Why moecl_device_ptx decides as it does, in words, into buf. */
void moecl_device_ptx_reason(const moecl_device_info *info, char *buf, size_t size);

/* ---- program.c: kernel variants ---- */

/* Whether programs go through the binary cache: a cache directory, and the
 * device table's MOECL_DP_BINARY_CACHE unless the override forces one
 * (binaries=on|off). */
bool moecl_program_binaries(const moecl_context *ctx);

typedef struct moecl_variant moecl_variant;
typedef struct moecl_registry moecl_registry;
typedef struct moecl_plans moecl_plans; /* src/plan.c */

/* Which .cl file(s) a program is built from. */
typedef enum moecl_program_kind {
    MOECL_PROGRAM_TOPK_GATING = 0,
    MOECL_PROGRAM_GROUNDED_ROUTER = 1,
    MOECL_PROGRAM_MOE_ALIGN = 2,
    MOECL_PROGRAM_ROUTE_DISPATCH = 3, /* top-k gating's and moe_align's sources */
    MOECL_PROGRAM_EP_LAYOUT = 4,      /* moe_align's source and ep_layout.cl */
    MOECL_PROGRAM_GROUNDED_DISPATCH = 5, /* the grounded router's and moe_align's sources */
    MOECL_PROGRAM_REPLAY = 6,            /* gating.cl and replay.cl: moecl_topk_weights, moecl_hash_routing */
    MOECL_PROGRAM_PERMUTE = 7,           /* permute.cl: moecl_permute, moecl_combine */
} moecl_program_kind;

moecl_status moecl_registry_create(moecl_registry **reg);
void moecl_registry_destroy(moecl_registry *reg);

/* The variant for (kind, defines): in memory, else from the disk cache,
 * else built from source. defines is a string of -D options; the kernel
 * named kernel_name is created from it. Where the context's options
 * enable inline PTX and that build fails, the variant is the portable
 * build (ctx->portable_options); the ops' launch shapes serve both.
 * Thread-safe. */
moecl_status moecl_variant_get(moecl_context *ctx, moecl_program_kind kind, const char *defines,
                               const char *kernel_name, moecl_variant **variant);
/* What a pooled kernel's argument was last set to (src/plan.c binds it):
 * a value of at most MOECL_ARG_BYTES bytes (larger ones are set on every
 * call), local memory of a size, or a caller's buffer the kernel holds a
 * reference to (held), with its CL_MEM_SIZE. */
#define MOECL_MAX_KERNEL_ARGS 32
#define MOECL_ARG_BYTES 48
typedef struct moecl_arg_state {
    bool valid, local;
    size_t size;
    unsigned char bits[MOECL_ARG_BYTES];
    cl_mem held;
    size_t held_size;
} moecl_arg_state;

typedef struct moecl_pooled_kernel {
    atomic_bool busy; /* borrowed by a call */
    bool temporary;   /* past the pool's capacity: released after its one call */
    cl_kernel kernel;
    moecl_arg_state args[MOECL_MAX_KERNEL_ARGS];
} moecl_pooled_kernel;

/* Borrow a kernel of the variant that no other thread is using (an atomic
 * flag per pooled kernel; a new one is made when all are busy), and give
 * it back after enqueueing (clSetKernelArg on a shared kernel races). */
moecl_status moecl_variant_acquire(moecl_context *ctx, moecl_variant *variant, moecl_pooled_kernel **kernel);
void moecl_variant_release(moecl_variant *variant, moecl_pooled_kernel *kernel);
/* Release the buffer reference a remembered argument holds, and forget
 * the argument. */
void moecl_arg_state_release(moecl_arg_state *state);
/* Forget every pooled kernel's remembered arguments and release the
 * buffer references they hold (no call may be in flight on the
 * registry's context). */
void moecl_registry_forget_buffers(moecl_registry *reg);
/* The kernel's CL_KERNEL_WORK_GROUP_SIZE on the context's device (queried
 * once, when the variant was created); 0 if the query failed. */
size_t moecl_variant_work_group_limit(const moecl_variant *variant);
/* Whether a build with inline PTX failed on this registry's context and
 * its builds since are portable (see moecl_variant_get). */
bool moecl_registry_ptx_failed(moecl_registry *reg);

/* ---- kernel_source.c: embedded or MOECL_KERNEL_DIR sources ---- */

typedef struct moecl_embedded_source {
    const char *name;
    const char *text;
    size_t size;
} moecl_embedded_source;

/* The full program text for kind (common.cl first), malloc'ed; the caller
 * frees it. */
moecl_status moecl_program_source(const moecl_context *ctx, moecl_program_kind kind, char **text,
                                  size_t *size);

/* ---- cache.c: compiled-kernel disk cache ---- */

/* The cache directory (from MOECL_CACHE_DIR, XDG_CACHE_HOME or HOME) in
 * buf; false when the cache is off or no directory can be named. */
bool moecl_cache_dir(char *buf, size_t size);
/* Load a cached binary for the identity string key; NULL if absent or
 * invalid (the caller rebuilds and stores). The caller frees *binary. */
bool moecl_cache_load(const char *key, unsigned char **binary, size_t *size);
/* Store atomically (temporary file + rename). Failures are silent: the
 * cache is an optimisation. */
void moecl_cache_store(const char *key, const unsigned char *binary, size_t size);
/* mkdir -p dir (restored before returning); true if it exists afterwards. */
bool moecl_cache_make_dir(char *dir);
/* An entry file's parts, pointing into the bytes it was parsed from. */
typedef struct moecl_cache_entry {
    const char *key; /* not NUL-terminated */
    size_t key_len;
    const unsigned char *binary;
    size_t binary_size;
} moecl_cache_entry;
/* The one definition of the entry format: magic | u64 key length | key |
 * u64 binary length | u64 checksum of the binary | binary. parse is true
 * only for a whole entry whose checksum matches; encode returns the
 * malloc'ed entry (NULL when out of memory). The cache test reads and
 * forges entries with these. */
bool moecl_cache_entry_parse(const unsigned char *data, size_t size, moecl_cache_entry *entry);
unsigned char *moecl_cache_entry_encode(const char *key, size_t key_len, const unsigned char *binary, size_t size,
                                        size_t *entry_size);
/* 64-bit FNV-1a, used for file names and checksums. */
uint64_t moecl_hash64(const void *data, size_t size, uint64_t seed);

/* ---- context.c ---- */

/* The options every kernel build on a device described by info gets
 * (MOECL_BUILD_OPTIONS appended), malloc'ed; NULL when out of memory.
 * -DMOECL_PTX=1 where info->ptx: without it the kernels compile no inline
 * PTX, whatever the variant's defines ask for. */
char *moecl_build_options(const moecl_device_info *info);

struct moecl_context {
    cl_platform_id platform;
    cl_context context;
    cl_device_id device;
    cl_command_queue queue;
    moecl_device_info info;
    moecl_device_params params; /* the device table's values for info, looked up at creation */
    moecl_registry *registry;
    char *build_options; /* common options for every build */
    char *portable_options; /* the same with MOECL_PTX=0: what a build falls back to (src/program.c) */
    char *kernel_dir;    /* MOECL_KERNEL_DIR at creation, or NULL */
    moecl_tune_table tuned; /* the device's tune file, read at creation */
    struct {
        bool active;
        moecl_launch_config config;
    } forced[MOECL_NUM_OPS]; /* moecl_launch_force */
    atomic_uint force_gen[MOECL_NUM_OPS]; /* bumped by moecl_launch_force: part of the plan keys */
    moecl_plans *plans;                   /* src/plan.c */
    bool in_order; /* the queue runs commands in order (no CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) */
    /* The device scratch buffer moecl_scratch_acquire reuses on an
     * in-order queue, and the lock its users hold while enqueueing. */
    pthread_mutex_t scratch_lock;
    bool scratch_lock_ready;
    cl_mem scratch;
    size_t scratch_bytes;
    /* The words at the start of scratch known to be 0 (the one-launch
     * kernels' tickets: moe_align's fused kernel's word 0, the split-K
     * router's word per token block): 0 for a new buffer and after a path
     * that writes there. */
    size_t scratch_zero_words;
};

/* ---- topk_gating.c, grounded_router.c: what a request is launched with ---- */

/* The key, configuration and source a valid desc resolves to on ctx (what
 * its calls launch). */
moecl_launch_source moecl_topk_gating_launch(const moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                             moecl_launch_key *key, moecl_launch_config *config);
/* The grounded router's tiled configurations, the rule's first (moecl-tune
 * sweeps them all; tn 0 leaves the experts a tile to the shape). */
const moecl_launch_config *moecl_grounded_tile_configs(size_t *count);
moecl_launch_source moecl_grounded_router_launch(const moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                                 moecl_launch_key *key, moecl_launch_config *config);

/* The plans of a valid desc's calls on ctx (built on first use; the same
 * pointer while the request and moecl_launch_force stay), with the
 * build-time choices of the call: a bias, a histogram (with_counts), the
 * grounded router's outputs. moe_align has one per context's launch class. */
struct moecl_plan;
moecl_status moecl_topk_gating_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, bool has_bias,
                                    bool has_counts, const struct moecl_plan **plan);
/* The plan of moecl_topk_gating_ex without counts, with expert_load and
 * num_valid_tokens or not, and the load by load_map local experts (0: by
 * expert id). */
moecl_status moecl_topk_gating_ex_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, bool has_bias,
                                       bool has_load, bool has_valid, uint32_t load_map,
                                       const struct moecl_plan **plan);
/* moecl_topk_gating_ex with expert_load by local expert: expert_map
 * (int32[num_experts]) takes each id to its local expert, counted where
 * in [0, num_local) (moecl_route_dispatch_ex's load with a map). The
 * caller has validated num_local. */
moecl_status moecl_topk_gating_ex_mapped(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                         const moecl_topk_gating_tensors *tensors, moecl_buffer expert_map,
                                         uint32_t num_local, cl_uint num_wait, const cl_event *wait, cl_event *done);
/* The plan of moecl_route_dispatch's one kernel for desc: the team
 * kernel of moecl_topk_gating_plan's configuration built with
 * ROUTE_DISPATCH (cl/topk_gating.cl), and HAS_LOAD, HAS_VALID where
 * moecl_route_dispatch_ex has expert_load, num_valid_tokens;
 * MOECL_ERROR_UNSUPPORTED where that configuration is the rows kernel. */
moecl_status moecl_topk_gating_route_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, bool has_bias,
                                          bool has_load, bool has_valid, const struct moecl_plan **plan);
moecl_status moecl_grounded_router_plan(moecl_context *ctx, const moecl_grounded_router_desc *desc, bool pairs,
                                        bool weights, bool ids, const struct moecl_plan **plan);
/* The plan of moecl_grounded_route_dispatch's one kernel for desc: the
 * team kernel of moecl_grounded_router_plan's configuration (weights and
 * ids) built with ROUTE_DISPATCH (cl/grounded_router.cl);
 * MOECL_ERROR_UNSUPPORTED where that configuration is another kernel. */
moecl_status moecl_grounded_router_route_plan(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                              const struct moecl_plan **plan);
struct moecl_kernel_arg;
/* The replay variant of a valid desc (src/replay.c; mode 1: given ids, 2:
 * hash routing): top-k gating's variant and launch shape for desc without
 * a bias (cl/replay.cl), built on first use. _launch enqueues it over the
 * tokens with args (moecl_plan_launch). */
moecl_status moecl_topk_gating_replay_plan(moecl_context *ctx, const moecl_topk_gating_desc *desc, unsigned mode,
                                           const struct moecl_plan **plan);
moecl_status moecl_topk_gating_replay_launch(moecl_context *ctx, const moecl_topk_gating_desc *desc, unsigned mode,
                                             const struct moecl_kernel_arg *args, cl_uint num_args, cl_uint num_wait,
                                             const cl_event *wait, cl_event *done);
/* The grounded router's descriptor checks (its messages). */
moecl_status moecl_grounded_router_validate(moecl_context *ctx, const moecl_grounded_router_desc *desc);
/* The descriptor checks of moecl_topk_gating() and moecl_moe_align()
 * (their messages), for moecl_route_dispatch(), which runs both. */
moecl_status moecl_topk_gating_validate(moecl_context *ctx, const moecl_topk_gating_desc *desc);
moecl_status moecl_moe_align_validate(moecl_context *ctx, const moecl_moe_align_desc *desc);
/* moe_align's plan, with the expert map's kernels (HAS_MAP) or without. */
moecl_status moecl_moe_align_plan(moecl_context *ctx, bool has_map, const struct moecl_plan **plan);

/* The -D defines (into buf) and the kernel name of the variant that serves
 * a valid desc on a device described by info, by the rule computed from
 * the device facts (no tune file, forced configuration or table entry:
 * the table has entries for NVIDIA and pocl only), exactly as the ops
 * build it; the program is moecl_program_source's text built with
 * moecl_build_options(info) + " " + defines. For tests that compile the
 * variants for devices that are not present. has_counts: the variant of
 * moecl_topk_gating_with_counts (the plain one's defines plus
 * " -DHAS_COUNTS=1"). */
void moecl_topk_gating_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, bool has_bias,
                               bool has_counts, char *buf, size_t size, const char **kernel_name);
void moecl_grounded_router_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc,
                                   bool pairs, bool weights, bool ids, char *buf, size_t size,
                                   const char **kernel_name);

/* As moecl_topk_gating_defines, for moecl_topk_gating_ex's variant with
 * every optional tensor (counts, load, valid count, expert_scale) and
 * captured ids of capture_dtype. */
void moecl_topk_gating_ex_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, bool has_bias,
                                  moecl_index_dtype capture_dtype, char *buf, size_t size, const char **kernel_name);

/* As moecl_topk_gating_defines, for moecl_route_dispatch's one kernel
 * (MOECL_PROGRAM_ROUTE_DISPATCH); *kernel_name is NULL where the rule's
 * configuration is the rows kernel, which has no such variant. */
void moecl_topk_gating_route_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, bool has_bias,
                                     bool has_load, bool has_valid, char *buf, size_t size, const char **kernel_name);
/* The same for moecl_topk_weights (mode 1) and moecl_hash_routing (mode
 * 2): cl/replay.cl's kernel (MOECL_PROGRAM_REPLAY). */
void moecl_topk_gating_replay_defines(const moecl_device_info *info, const moecl_topk_gating_desc *desc, unsigned mode,
                                      char *buf, size_t size, const char **kernel_name);
/* The same for moecl_router (weights and ids; a bias or not, router
 * logits or not). */
void moecl_router_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc, bool has_bias,
                          bool has_logits, char *buf, size_t size, const char **kernel_name);
/* The same for moecl_grounded_route_dispatch's one kernel
 * (MOECL_PROGRAM_GROUNDED_DISPATCH); *kernel_name is NULL where the rule's
 * configuration is not the team kernel. */
void moecl_grounded_router_route_defines(const moecl_device_info *info, const moecl_grounded_router_desc *desc,
                                         char *buf, size_t size, const char **kernel_name);
/* The -D defines of moe_align's program on a device described by info,
 * and its kernels' names, comma-separated (for the portability suite). */
void moecl_moe_align_defines(const moecl_device_info *info, char *buf, size_t size, const char **kernel_names);
/* The same for the program of the calls with an expert map (HAS_MAP). */
void moecl_moe_align_map_defines(const moecl_device_info *info, char *buf, size_t size, const char **kernel_names);
/* The same for the expert-parallel layout's program (moe_align's defines
 * and the fused kernel's work-group). */
void moecl_ep_layout_defines(const moecl_device_info *info, char *buf, size_t size, const char **kernel_names);

/* ---- permute.c: moecl_permute and moecl_combine ---- */

/* Their plans are keyed as MOECL_OP_MOE_ALIGN's (the key keeps two bits
 * for the op) with the third word one of these, which moe_align's (0)
 * never is. */
enum { MOECL_PLAN_TAG_PERMUTE = 1, MOECL_PLAN_TAG_COMBINE = 2, MOECL_PLAN_TAG_SCATTER = 3 };
/* The -D defines of permute's (combine false) or combine's program for
 * the dtypes (shared: the shared expert's, or -1 for none), and the
 * kernel's name, for the portability suite and checkvariants. */
void moecl_permute_defines(bool combine, moecl_dtype in, moecl_dtype out, int shared, char *buf, size_t size,
                           const char **kernel_name);

/* ---- plan.c: launch plans and binding a kernel's arguments ---- */

/* A request packed into four words (the op's fields, each op packs its
 * own; 62 bits of the first, the op in its low two) and the generation of
 * moecl_launch_force it was resolved under. */
typedef struct moecl_plan_key {
    uint64_t a, b, c, d;
    unsigned gen;
} moecl_plan_key;

#define MOECL_PLAN_MAX_KERNELS 6

/* What a distinct request launches, resolved once per context. */
typedef struct moecl_plan {
    moecl_plan_key key;
    moecl_launch_key launch_key;    /* the tune file's key (top-k gating, grounded router) */
    moecl_launch_config config;     /* the configuration, and where it came from */
    moecl_launch_source source;
    unsigned num_kernels;
    moecl_variant *variants[MOECL_PLAN_MAX_KERNELS]; /* each with its cl_kernel pool */
    const char *kernel_names[MOECL_PLAN_MAX_KERNELS];
    size_t limits[MOECL_PLAN_MAX_KERNELS]; /* CL_KERNEL_WORK_GROUP_SIZE, 0 if unknown */
    /* Top-k gating, grounded router: work-items of a work-group (after the
     * rows kernel's CL_KERNEL_WORK_GROUP_SIZE) and the tokens it routes;
     * the global size is ceil(tokens / rows_per_group) * local. */
    size_t local, rows_per_group;
    /* The grounded router's split-K kernel: the hidden dimension's chunks,
     * and the work-groups of a block of rows_per_group tokens (launched
     * by src/grounded_router.c with its scratch). */
    unsigned split_chunks, split_groups;
    /* moe_align: the work-group sizes of the chunk kernels, the scan,
     * the one-group and the fused kernels (both fused kernels: fused_wg),
     * whether the one-group kernel ranks with WARP_MATCH, and whether the
     * device runs the one-group and each fused kernel at its work-group. */
    unsigned wg, scan_wg, one_wg, fused_wg;
    bool warp_match, one_group_fits, fused_fits, parallel_fits;
} moecl_plan;

/* Fill plan (key already set) for the op's request; called once per
 * distinct key, under the table's lock. */
typedef moecl_status (*moecl_plan_build)(moecl_context *ctx, const void *request, moecl_plan *plan);

moecl_status moecl_plans_create(moecl_plans **plans);
void moecl_plans_destroy(moecl_plans *plans);
/* The key of a request of op packed into a (62 bits), b, c and d, under
 * op's current moecl_launch_force generation. */
moecl_plan_key moecl_plan_key_of(const moecl_context *ctx, moecl_op op, uint64_t a, uint64_t b, uint64_t c,
                                 uint64_t d);
/* The plan of key: found without a lock, else built by build(request) and
 * kept until the context is destroyed. */
moecl_status moecl_plan_get(moecl_context *ctx, const moecl_plan_key *key, moecl_plan_build build,
                            const void *request, const moecl_plan **plan);
/* The plan of key if ctx holds it (no lock unless the table is full). */
const moecl_plan *moecl_plan_find(moecl_context *ctx, const moecl_plan_key *key);
/* How many plans ctx holds (tests). */
size_t moecl_plan_count(const moecl_context *ctx);

/* A caller's buffer that binding validates as moecl_check_buffer does. */
typedef struct moecl_buffer_check {
    const char *name;
    uint64_t bytes;
    size_t offset, elem_size;
    bool required;
} moecl_buffer_check;

/* One argument as clSetKernelArg takes it: value NULL with size > 0 is
 * local memory of that size (and, for a buffer argument, an absent
 * buffer). mem: value points to a cl_mem; check: validate it first. */
/* A caller's buffer and its offset in elements of the buffer's type, as
 * the ops' argument records hold them. */
typedef struct moecl_mem_at {
    cl_mem mem;
    cl_ulong off;
} moecl_mem_at;

typedef struct moecl_kernel_arg {
    size_t size;
    const void *value;
    bool mem;
    const moecl_buffer_check *check;
} moecl_kernel_arg;

#define MOECL_ARG(v) ((moecl_kernel_arg){sizeof(v), &(v), false, NULL})
#define MOECL_ARG_MEM(m) ((moecl_kernel_arg){sizeof(cl_mem), (m) ? (const void *)&(m) : NULL, true, NULL})
#define MOECL_ARG_CHECKED(m, chk) ((moecl_kernel_arg){sizeof(cl_mem), (m) ? (const void *)&(m) : NULL, true, (chk)})
#define MOECL_ARG_LOCAL(bytes) ((moecl_kernel_arg){(bytes), NULL, false, NULL})

/* Validate the checked buffers of args 0..count-1 (a failure leaves the
 * kernel as it was), then set every argument whose value differs from
 * what this pooled kernel was last given, stopping at the first that
 * fails: its own error code is returned, and the message names the kernel
 * (name) and the argument's index. A checked buffer (the caller's) that
 * differs from the kernel's last one is queried (CL_MEM_SIZE,
 * CL_MEM_CONTEXT), set and retained, and the last one released; the same
 * buffer again is checked against the size kept and not set again: the
 * reference keeps its handle from naming another buffer. Unchecked
 * buffers (the library's own) are set on every call and never held. */
moecl_status moecl_bind_args(moecl_context *ctx, moecl_pooled_kernel *kernel, const char *name,
                             const moecl_kernel_arg *args, cl_uint count);

/* One command of a call: kernel `kernel` of the plan with its arguments
 * and sizes, or (args NULL) a fill of fill_bytes zeros at fill_offset of
 * fill (named fill_name in a message). */
typedef struct moecl_step {
    unsigned kernel;
    const moecl_kernel_arg *args;
    cl_uint num_args;
    size_t global, local;
    cl_mem fill;
    size_t fill_offset, fill_bytes;
    const char *fill_name;
    moecl_pooled_kernel *borrowed; /* set while the call runs */
} moecl_step;

/* Run a call's commands in order: first every kernel's work-group limit,
 * pooled kernel and arguments (a failure there leaves nothing enqueued),
 * then the enqueues, the first waiting on the wait list and each after on
 * the one before (by the queue's order where it is in order); *done gets
 * the last one's event where done is not NULL. After a failed enqueue,
 * whatever was queued before it is waited for. */
moecl_status moecl_plan_run(moecl_context *ctx, const moecl_plan *plan, moecl_step *steps, int n, cl_uint num_wait,
                            const cl_event *wait, cl_event *done);
/* The caller's buffers among args checked as moecl_plan_run checks them,
 * with no kernel: before a plan is built, so that a bad buffer costs no
 * compile. */
moecl_status moecl_check_args(moecl_context *ctx, const moecl_kernel_arg *args, cl_uint count);

/* A call of a one-kernel op (top-k gating, the grounded router): the
 * request's key and how to build its plan, the kernel's arguments, the
 * tokens (the global size is ceil(tokens / rows_per_group) * local), and a
 * buffer range to zero first (the kernel waiting on it) or zero NULL. */
typedef struct moecl_launch_call {
    moecl_plan_key key;
    moecl_plan_build build;
    const void *request;
    const moecl_kernel_arg *args;
    cl_uint num_args;
    uint32_t tokens;
    cl_mem zero;
    size_t zero_offset, zero_bytes;
    const char *zero_name;
} moecl_launch_call;

/* The grounded router's kernel arguments for a call, bound in place (the
 * args point into the record): its first seven buffers in the kernel's
 * order (token_hidden, router_logits, expert_ground, bias, out_pairs,
 * topk_weights, topk_ids), each with its offset in elements, then
 * num_tokens, alpha and routed_scaling_factor, then those of the optional
 * six (expert_counts, expert_load, num_valid_tokens, captured_ids of
 * capture_dtype, expert_scale, shared_expert_gate) that are present;
 * num_args in all.
 * check: binding validates the caller's buffers, the inputs required and,
 * where outputs_required, topk_weights and topk_ids too. */
#define MOECL_GROUNDED_BUFFERS 13
#define MOECL_GROUNDED_ARGS (2 * MOECL_GROUNDED_BUFFERS + 3)
typedef struct moecl_grounded_binding {
    cl_mem mem[MOECL_GROUNDED_BUFFERS];
    moecl_buffer_check checks[MOECL_GROUNDED_BUFFERS];
    cl_ulong off[MOECL_GROUNDED_BUFFERS];
    cl_uint num_tokens;
    cl_float alpha, scaling_factor;
    moecl_kernel_arg args[MOECL_GROUNDED_ARGS];
    cl_uint num_args;
} moecl_grounded_binding;
/* logits_required: router_logits must be present (every entry point but
 * moecl_router; absent there, HAS_LOGITS=0 kernels do not read it). The
 * bias (after expert_ground) is optional. */
void moecl_grounded_router_bind(const moecl_grounded_router_desc *d, const moecl_buffer buffers[MOECL_GROUNDED_BUFFERS],
                                moecl_index_dtype capture_dtype, bool check, bool outputs_required,
                                bool logits_required, moecl_grounded_binding *b);
/* The grounded router's team kernel's local memory for desc at (team,
 * rows), its gating's included (a bound for every variant). */
size_t moecl_grounded_router_team_local(const moecl_grounded_router_desc *d, unsigned team, unsigned rows);
/* The gating fields of a grounded router descriptor as a top-k gating
 * descriptor (its validation and messages). */
moecl_topk_gating_desc moecl_grounded_gating_desc(const moecl_grounded_router_desc *d);
/* A validated grounded router request's output row (the routed top_k
 * slots, then the shared ones) and the experts its ids range over, as
 * moecl_topk_row_slots and moecl_topk_id_experts. */
static inline uint32_t moecl_grounded_row_slots(const moecl_grounded_router_desc *d)
{
    return d->top_k + d->num_shared_experts;
}
static inline uint32_t moecl_grounded_id_experts(const moecl_grounded_router_desc *d)
{
    return d->num_experts + d->num_shared_experts;
}
/* The rows of router_logits: 1 where it is one row for every token. */
uint64_t moecl_grounded_logit_rows(const moecl_grounded_router_desc *d);

/* The whole call after the op's own validation: find the plan (on a miss,
 * validate the checked buffers and build it), then with no tokens only the
 * zeroing or a marker (moecl_enqueue_nothing), else moecl_plan_run. */
moecl_status moecl_plan_launch(moecl_context *ctx, const moecl_launch_call *call, cl_uint num_wait,
                               const cl_event *wait, cl_event *done);

/* A kernel's CL_KERNEL_WORK_GROUP_SIZE (limit, 0 if unknown) against the
 * work-group a call will launch it with (local), checked before anything
 * is enqueued: CL_INVALID_WORK_GROUP_SIZE, as the enqueue would have
 * answered. */
moecl_status moecl_check_work_group(moecl_context *ctx, const char *name, size_t local, size_t limit);

/* ---- variant.c: the ops' kernel parameters, each named once ---- */

/* An op's kernel parameters (moecl_variant_topk_gating,
 * moecl_variant_grounded_router): for each, its define, its width in the
 * plan key, the kernel's default, its range and the kernels that read it.
 * The key, the -D defines and the readable line all derive from it. */
typedef struct moecl_variant_op moecl_variant_op;
extern const moecl_variant_op moecl_variant_topk_gating;
extern const moecl_variant_op moecl_variant_grounded_router;

/* Top-k gating's own parameters, in the table's order (the gating block
 * sits before TEAM). */
enum {
    MOECL_TOPK_NUM_EXPERTS,
    MOECL_TOPK_TOPK,
    MOECL_TOPK_IN_DTYPE,
    MOECL_TOPK_HAS_COUNTS,
    MOECL_TOPK_TEAM,
    MOECL_TOPK_ROWS,
    MOECL_TOPK_TEAM_SHUFFLE,
    MOECL_TOPK_EPT,
    MOECL_TOPK_CPU_DEVICE,
    MOECL_TOPK_ROUTE_DISPATCH,
    MOECL_TOPK_FUSED_WG,
    MOECL_TOPK_REPLAY,
    MOECL_TOPK_HAS_LOAD,
    MOECL_TOPK_HAS_VALID,
    MOECL_TOPK_CAPTURE,
    MOECL_TOPK_HAS_SCALE,
    MOECL_TOPK_SHARED,
    MOECL_TOPK_SHARED_WEIGHT,
    MOECL_TOPK_LOAD_MAP,
    MOECL_TOPK_PARAMS
};

/* The grounded router's own parameters, in the table's order (the gating
 * block sits before KERNEL). */
enum {
    MOECL_GROUNDED_HIDDEN_DIM,
    MOECL_GROUNDED_NUM_EXPERTS,
    MOECL_GROUNDED_TOPK,
    MOECL_GROUNDED_IN_DTYPE,
    MOECL_GROUNDED_HAS_PAIRS,
    MOECL_GROUNDED_HAS_WEIGHTS,
    MOECL_GROUNDED_HAS_IDS,
    MOECL_GROUNDED_HAS_LOGITS,
    MOECL_GROUNDED_PRECISION,
    MOECL_GROUNDED_KERNEL,
    MOECL_GROUNDED_TM,
    MOECL_GROUNDED_TN,
    MOECL_GROUNDED_TK,
    MOECL_GROUNDED_MT,
    MOECL_GROUNDED_NT,
    MOECL_GROUNDED_TEAM,
    MOECL_GROUNDED_ROWS,
    MOECL_GROUNDED_EPT,
    MOECL_GROUNDED_TEAM_SHUFFLE,
    MOECL_GROUNDED_VEC,
    MOECL_GROUNDED_DB,
    MOECL_GROUNDED_WC,
    MOECL_GROUNDED_MMA_MI,
    MOECL_GROUNDED_MMA_NT,
    MOECL_GROUNDED_MMA_WM,
    MOECL_GROUNDED_MMA_WN,
    MOECL_GROUNDED_MMA_KW,
    MOECL_GROUNDED_ROUTE_DISPATCH,
    MOECL_GROUNDED_FUSED_WG,
    MOECL_GROUNDED_LOGIT_ROUND,
    MOECL_GROUNDED_SOFTCAP,
    MOECL_GROUNDED_LOGITS_ROW,
    MOECL_GROUNDED_HAS_COUNTS,
    MOECL_GROUNDED_HAS_LOAD,
    MOECL_GROUNDED_HAS_VALID,
    MOECL_GROUNDED_CAPTURE,
    MOECL_GROUNDED_HAS_SCALE,
    MOECL_GROUNDED_SHARED,
    MOECL_GROUNDED_SHARED_WEIGHT,
    MOECL_GROUNDED_SHARED_GATE,
    MOECL_GROUNDED_SPLIT_WG,
    MOECL_GROUNDED_SMALL,
    MOECL_GROUNDED_PARAMS
};

#define MOECL_VARIANT_MAX_PARAMS 48
#define MOECL_GATING_MAX_PARAMS 16

/* A variant: the value of each of the op's own parameters (by the enums
 * above) and of cl/gating.cl's block (moecl_variant_gating). */
typedef struct moecl_variant_values {
    uint32_t param[MOECL_VARIANT_MAX_PARAMS];
    uint32_t gating[MOECL_GATING_MAX_PARAMS];
} moecl_variant_values;

/* What the gating block's values come from: the gating fields (the
 * grounded router's through moecl_grounded_gating_desc), the groups the
 * op keeps, and whether a bias steers the selection. */
typedef struct moecl_gating_source {
    const moecl_topk_gating_desc *desc;
    unsigned groups, topk_group;
    bool has_bias;
} moecl_gating_source;

/* Fills v's gating block from source. */
void moecl_variant_gating(moecl_variant_values *v, const moecl_gating_source *source);
/* The plan key of variant v of op (every parameter with bits in the key). */
moecl_plan_key moecl_variant_key(const moecl_context *ctx, const moecl_variant_op *op, const moecl_variant_values *v);
/* The -D defines of variant v of op built as kernel: those always there,
 * then those set to other than the kernel's default. */
void moecl_variant_defines(const moecl_variant_op *op, const moecl_variant_values *v, moecl_kernel_kind kernel,
                           char *buf, size_t size);
/* The same parameters in words ("topk_gating team: experts=128 top_k=8
 * dtype=f16 ..."), for messages; returns the length written. */
size_t moecl_variant_text(const moecl_variant_op *op, const moecl_variant_values *v, moecl_kernel_kind kernel,
                          char *buf, size_t size);
/* NULL where op's table is consistent (every range fits its key bits, the
 * key fits its words) and v's values that kernel carries are in range (v
 * NULL: the table only); else the name of the first parameter that is
 * not (tests). */
const char *moecl_variant_check(const moecl_variant_op *op, const moecl_variant_values *v, moecl_kernel_kind kernel);

/* ---- buffers.c: validation shared by the ops ---- */

/* Check that buf holds `bytes` bytes at its offset, that the offset is a
 * multiple of elem_size, and that it belongs to ctx's cl_context. `name`
 * names the argument in the message. required == false accepts an absent
 * buffer. */
moecl_status moecl_check_buffer(moecl_context *ctx, const char *name, moecl_buffer buf, uint64_t bytes,
                                size_t elem_size, bool required);
/* moecl_check_buffer, giving the buffer's CL_MEM_SIZE (0 when absent or
 * on a failed query). */
moecl_status moecl_check_buffer_size(moecl_context *ctx, const char *name, moecl_buffer buf, uint64_t bytes,
                                     size_t elem_size, bool required, size_t *size);
/* The offset and size checks of moecl_check_buffer for a buffer of size
 * bytes. */
moecl_status moecl_check_buffer_fits(moecl_context *ctx, const char *name, size_t offset, uint64_t bytes,
                                     size_t elem_size, size_t size);
moecl_status moecl_check_wait_list(moecl_context *ctx, cl_uint num_wait, const cl_event *wait);
/* A tensors record (moecl_*_tensors): present, and its struct_size one
 * this moecl knows, from first (its first version's size) to known. */
moecl_status moecl_check_record(moecl_context *ctx, const void *record, size_t struct_size, size_t first,
                                size_t known);
/* A caller's tensors record (struct_size its first field) of two
 * versions, v1 bytes (ending at the field named v1_end) and v2 (this
 * moecl's sizeof), checked as moecl_check_record and copied into out (v2
 * bytes); the fields an earlier version lacks are absent, zero. */
moecl_status moecl_copy_record(moecl_context *ctx, const void *record, size_t v1, size_t v2, const char *v1_end,
                               void *out);
/* num_tokens == 0: enqueue nothing but honour the wait list and give a
 * marker event if asked. */
moecl_status moecl_enqueue_nothing(moecl_context *ctx, cl_uint num_wait, const cl_event *wait, cl_event *done);
/* A device scratch buffer of at least `bytes` for kernels a call is about
 * to enqueue. On an in-order queue it is the context's own, grown as
 * needed, and the context stays locked until moecl_scratch_release: the
 * caller enqueues every kernel that uses it in between, so calls from
 * several threads take turns and their kernels run one call after
 * another. On an out-of-order queue it is a new buffer that the release
 * frees (OpenCL keeps it until the kernels finish). Allocation on NVIDIA's
 * OpenCL can cost tens of microseconds a call. */
moecl_status moecl_scratch_acquire(moecl_context *ctx, size_t bytes, cl_mem *mem);
void moecl_scratch_release(moecl_context *ctx, cl_mem mem);
/* Create a device buffer from host memory (copy in) or for output. */
moecl_status moecl_host_buffer(moecl_context *ctx, const char *name, cl_mem_flags flags, size_t size,
                               const void *host, cl_mem *mem);

/* Read count outputs of a host-path call back into host memory (entries
 * with hosts[i] NULL are skipped) once the kernel event ran completes, and
 * wait for them. */
#define MOECL_MAX_READ_BACK 9 /* moecl_route_dispatch_ex_host: its eight outputs and expert_load */
moecl_status moecl_read_back(moecl_context *ctx, cl_event ran, cl_uint count, const cl_mem *mems,
                             const size_t *sizes, void *const *hosts);

/* The end of a host-path call that holds its buffers in one array: where
 * st is a success, mems[first..count) are read back into
 * hosts[first..count) (sizes[i - first] bytes; NULL hosts skipped) after
 * ran; then ran and every buffer are released. Returns st, or the read's
 * error. */
moecl_status moecl_host_call_end(moecl_context *ctx, moecl_status st, cl_event ran, cl_mem *mems, cl_uint count,
                                 cl_uint first, const size_t *sizes, void *const *hosts);

/* The range checks both ops share: 1 <= num_experts <= 4096 and
 * 1 <= top_k <= min(num_experts, 64), with messages naming the field. */
moecl_status moecl_check_experts_topk(moecl_context *ctx, uint32_t num_experts, uint32_t top_k);
/* A validated top-k gating request's output row (the routed top_k slots,
 * then the shared ones) and the experts its ids range over, which the
 * counts and moe_align's descriptor hold (moecl_topk_gating_desc). */
static inline uint32_t moecl_topk_row_slots(const moecl_topk_gating_desc *d)
{
    return d->top_k + d->num_shared_experts;
}
static inline uint32_t moecl_topk_id_experts(const moecl_topk_gating_desc *d)
{
    return d->num_experts + d->num_shared_experts;
}

/* Bytes of one element of dtype. */
static inline size_t moecl_dtype_size(moecl_dtype t) { return t == MOECL_F32 ? 4 : 2; }
static inline size_t moecl_index_size(moecl_index_dtype t) { return t == MOECL_I64 ? 8 : t == MOECL_I16 ? 2 : 4; }

/* Rounds v up to a multiple of m. */
static inline size_t moecl_round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

/* Local memory the kernels may take on a device: all but 1 KiB, left to
 * the implementation. */
static inline size_t moecl_local_budget(const moecl_device_info *info)
{
    return info->local_mem_size > 1024 ? (size_t)info->local_mem_size - 1024 : 0;
}

static inline bool moecl_is_pow2(uint32_t v) { return v && (v & (v - 1)) == 0; }

/* The smallest power of two >= v (at most 2^31). */
static inline uint32_t moecl_pow2_at_least(uint32_t v)
{
    uint32_t p = 1;
    while (p < v && p < (1u << 31))
        p <<= 1;
    return p;
}

#endif
