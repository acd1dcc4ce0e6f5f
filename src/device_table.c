/* Every per-device choice of every op in one table: build options, the
 * inline PTX threshold, the configurations drivers are known to mishandle,
 * the ops' path limits and work-groups, and the launch configurations that
 * override the computed rules. The ops and src/launch.c read it; nothing
 * else names a vendor or a device.
 *
 * Looked up as CLBlast's database is: the defaults, over them the entry of
 * the device's vendor, over that the vendor's entries whose device name is
 * a substring of the device's (case-insensitive). Each value says what it
 * rests on: the device and date of the measurement, with its figures,
 * where one was made. The tune file moecl-tune writes overrides the launch
 * configurations (src/launch.c). */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* One value of an entry, and why. */
typedef struct table_value {
    moecl_device_param param;
    uint32_t value;
    const char *why;
} table_value;

/* One launch configuration of an entry: for op at num_experts (0: any) on
 * devices of type (0: any). */
typedef struct table_launch {
    cl_device_type type;
    moecl_op op;
    uint32_t num_experts;
    moecl_launch_config config;
    const char *why;
} table_launch;

/* A vendor's entry (device NULL) or one of its devices'. */
typedef struct table_entry {
    moecl_vendor vendor;
    const char *device; /* case-insensitive substring of the device name; NULL: the vendor's default */
    const table_value *values;
    size_t num_values;
    const table_launch *launches;
    size_t num_launches;
} table_entry;

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* ---- the defaults: every device unless its entries say otherwise ---- */

/* Indexed by parameter: a value left out would read as 0 with no reason. */
#define DEFAULT(p, v, why) [p] = {p, v, why}
static const table_value defaults[MOECL_NUM_DEVICE_PARAMS] = {
    DEFAULT(MOECL_DP_UNROLL, 0, "unroll pragmas only where the compiler is known to honour them"),
    DEFAULT(MOECL_DP_NATIVE_MATH, 0,
            "exp and division as OpenCL specifies them: native_exp's error is the "
            "implementation's, checked against the tests' bounds on NVIDIA only"),
    DEFAULT(MOECL_DP_PTX_MIN_MAJOR, 0, "inline PTX is NVIDIA's instruction set"),
    DEFAULT(MOECL_DP_REFUSE_TEAM_WG, 0, "no other driver is known to mishandle a team"),
    DEFAULT(MOECL_DP_PRIVATE_MAX, 0, "no other driver is known to run short of private memory"),
    DEFAULT(MOECL_DP_ALIGN_CHUNK_WG_CPU, 1, "CPUs: one work-item a chunk, a plain loop"),
    DEFAULT(MOECL_DP_ALIGN_CHUNK_WG_GPU, 128,
            "GPUs: 128 work-items a chunk; H200, 2026-11-30: the chunked path 67.7 us "
            "at 13526x256 (its last kernel 11-14 us); no other size timed"),
    DEFAULT(MOECL_DP_ALIGN_GROUP_WG, 256,
            "H200, 2026-11-30: NVIDIA's OpenCL reports a limit of 256 for moe_align's "
            "kernels (the device's is 1024), so 1024 work-items never ran"),
    DEFAULT(MOECL_DP_ALIGN_FUSED_WG_CPU, 1,
            "pocl and Intel's CPU runtime, 2026-12-01: one work-item walking the slots; "
            "chunks passed by atomics took 44-46 us at 129x128 against 9-10 chunked"),
    DEFAULT(MOECL_DP_ALIGN_FUSED_WG_GPU, 256,
            "as the one-group kernel's: its last work-group places every slot alone"),
    DEFAULT(MOECL_DP_ALIGN_FUSED_MAX_SLOTS_CPU, 8192,
            "pocl and Intel's CPU runtime, 2026-12-01: fused faster up to 8152 "
            "slots (pocl 14.1 against 18.5-24.5 us at 1019x128), chunked from "
            "65536 on a quiet machine (62.7 against 77.2 us at 8192x128)"),
    DEFAULT(MOECL_DP_ALIGN_FUSED_MAX_SLOTS_GPU, 5120,
            "H200, 2026-12-01: fused fastest up to 4160 slots (38.1 against "
            "41.0 us chunked at 520x128), slower from 8152 (48.6 against 42.6)"),
    DEFAULT(MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_CPU, 0,
            "CPUs: the fused kernel serves small routings; the one-group "
            "kernel's 256-wide tiles are a GPU shape"),
    DEFAULT(MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_GPU, 1024,
            "H200, 2026-11-30: the one-group kernel tied the chunked path at "
            "1032 slots (40.0 against 39.6 us), lost at 2048 (49.9 against "
            "35.9)"),
    DEFAULT(MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_WARP_CPU, 0,
            "CPUs: as without WARP_MATCH"),
    DEFAULT(MOECL_DP_ALIGN_ONE_GROUP_MAX_SLOTS_WARP_GPU, 1536,
            "H200, 2026-11-30: with WARP_MATCH (inline PTX) a slot costs 10 "
            "ns against 14; the one-group kernel won at 1032 slots (33.2 "
            "against 39.6 us), lost at 2048 (41.3 against 35.9)"),
    DEFAULT(MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_CPU, 0,
            "pocl and Intel's CPU runtime, 2026-12-07: slower than the fused kernel's one work-item at "
            "every size from 1x128 to 2044x128 top 8 (kernel 20.2 against 16.6 us on pocl, 23.9 "
            "against 15.8 on Intel at 1019x128; a work-group a compute unit, each counting every slot)"),
    DEFAULT(MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_GPU, 0,
            "GPUs but NVIDIA's: not timed there, so the fused kernel's ticket stays the default"),
    DEFAULT(MOECL_DP_ROUTE_ONE_KERNEL_MAX_SLOTS, 5120,
            "moe_align_fused's GPU limit: the one kernel's last work-group "
            "places every slot alone, as that kernel's does; unmeasured off "
            "NVIDIA"),
    DEFAULT(MOECL_DP_ROUTE_ONE_KERNEL_FORCED_MAX_SLOTS, 8192,
            "the override align=fused or fused-parallel: the one kernel up to "
            "1024 tokens x top 8 on every device (tests, measurements)"),
    DEFAULT(MOECL_DP_EP_FUSED_CPU, 0,
            "CPUs: the three kernels, timed on pocl and Intel's CPU runtime, 2026-12-01 "
            "(1.12-1.78 ms at 13526x256); the fused kernel was not timed there"),
    DEFAULT(MOECL_DP_EP_FUSED_GPU, 1,
            "H200, 2026-12-02: one launch 30.8 us against 72.6 for the three kernels at "
            "13526x256, 8 ranks (device time)"),
    DEFAULT(MOECL_DP_EP_FUSED_WG, 256,
            "H200, 2026-12-02: 16.0 us of kernel at 13526x256, 8 ranks, against 19.8 at 128 "
            "work-items; 512 and 1024 do not fit the kernel on NVIDIA's OpenCL"),
    DEFAULT(MOECL_DP_SCATTER_WG_CPU, 8, "CPUs: eight rows of one work-item each, as permute's gather; not timed"),
    DEFAULT(MOECL_DP_SCATTER_WG_GPU, 256,
            "GPUs: 256 work-items, as permute's gather, a 7168-column bf16 row in 896 uint4 words "
            "(3.5 a work-item); other sizes not timed"),
    DEFAULT(MOECL_DP_SCATTER_ZERO_ROWS, 8,
            "most of out's rows are slots, which the padding check only reads an id of: 8 a launch row "
            "keeps 48896 rows (4096 x top 8 of 256, block 64) to 6112 launch rows; not timed"),
    DEFAULT(MOECL_DP_BINARY_CACHE, 1,
            "a stored binary spares the driver's compile in the next process: Intel's CPU runtime, "
            "2026-12-05, 96 top-k programs in 27.0 s cold, 1.4 s from the cache, 26.8 s with it off"),
    DEFAULT(MOECL_DP_KERNEL_WG_QUERY, 1,
            "CL_KERNEL_WORK_GROUP_SIZE is the kernel's limit: register use can lower it below the device's"),
    DEFAULT(MOECL_DP_LOOP_LIMIT, 0, "no other driver is known to leave long loops early"),
    DEFAULT(MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS_CPU, 0,
            "CPUs: the rows kernel's work-items already split the tokens across cores; split-K not timed there"),
    DEFAULT(MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS_GPU, 0,
            "GPUs but NVIDIA's: not timed there, so the rule's kernels stay the default "
            "(forced: grounded=splitk)"),
    DEFAULT(MOECL_DP_GROUNDED_SPLITK_MIN_CHUNK, 256,
            "H100, 2026-12-07, bf16, device us at 1 and 64 tokens, chunks of 256 against 128: DeepSeek-V3 18.9 "
            "and 94.2 against 19.7 and 104.5, Qwen3-MoE 21.2 and 38.0 against 16.4 and 39.5, GPT-OSS 20.8 and "
            "32.3 against 15.8 and 30.5, Kimi K2 33.8 and 129.9 against 30.7 and 150.9 (a plan serves every "
            "token count); not timed off NVIDIA"),
};

/* ---- NVIDIA ---- */

static const table_value nvidia_values[] = {
    {MOECL_DP_UNROLL, 1,
     "H200, 2026-11-30: the compiler honours the pragma, keeping the team kernels' private arrays in registers "
     "(no timing kept)"},
    {MOECL_DP_NATIVE_MATH, 1,
     "H200, 2026-11-30: native exp and reciprocal within every kernel's tested error bounds (no timing kept)"},
    /* match.any.sync needs sm_70 (PTX ISA, "Target ISA Notes"); below it
     * shfl.sync and bar.warp.sync are defined only for converged lanes,
     * which these kernels were never checked for. NVIDIA's compiler builds
     * for the device's own sm, so an older GPU would fail the build and
     * fall back (src/program.c) on every context. */
    {MOECL_DP_PTX_MIN_MAJOR, 7, "match.any.sync needs sm_70; the PTX paths ran on sm_90 (H200) only"},
    {MOECL_DP_ROUTE_ONE_KERNEL_MAX_SLOTS, 256,
     "H200, 2026-12-01: one launch won in wall time up to 32 tokens at top_k 8 (9.3 against 11.7 us at one "
     "token), lost from 64 (20.5 against 19.7)"},
    {MOECL_DP_ALIGN_PARALLEL_MAX_SLOTS_GPU, 8192,
     "H100, 2026-12-07: the parallel fused kernel against the default path, top 8 of 128, device / wall us: "
     "1 token 21.2 / 12.5 against 23.9 / 11.6, 129 tokens 29.8 / 13.4 against 33.3 / 16.1, 1019 tokens 30.3 / "
     "14.3 against 39.6 / 25.4 (chunked), 4083 tokens 46.8 / 30.6 against 40.6 / 25.3"},
    {MOECL_DP_GROUNDED_SPLITK_MAX_TOKENS_GPU, 64,
     "H100, 2026-12-07: split-K against the default (tensor-core) kernel, bf16 hidden states, device us at 1 "
     "and 64 tokens: DeepSeek-V3 83.9 and 219.8 against 303.4 and 372.1, Qwen3-MoE 30.1 and 60.9 against "
     "105.8 and 139.0, Mixtral 9.3 and 9.6 against 82.2 and 84.9, GPT-OSS 25.1 and 47.2 against 80.5 and "
     "102.0, Kimi K2 65.3 and 191.7 against 426.1 and 421.1; more tokens not timed"},
};

static const table_launch nvidia_launches[] = {
    {0, MOECL_OP_TOPK_GATING, 256, {MOECL_KERNEL_TEAM, 32, 4, 0, {0}},
     "H200, 2026-11-30: teams of 8 to 32 within 16% at 13526x256, a team of 4 38% slower; 32 x 4 rows is also "
     "the rule's"},
    {CL_DEVICE_TYPE_GPU, MOECL_OP_GROUNDED_ROUTER, 128, {MOECL_KERNEL_TILED, 1, 0, 64, {128, 16, 8, 4, 4, 1, 0}},
     "H200, 2026-12-02: 517.4 us at 16384x4096x128 top 8 f32 with the pointer reads, against 545.2 for 16x4 "
     "wc 8 and 572.4 for 8x4 without them"},
};

/* ---- pocl ---- */

static const table_value pocl_values[] = {
    {MOECL_DP_REFUSE_TEAM_WG, 2,
     "pocl 3.1, 2026-11-30: a team kernel in a work-group of two (team 2, one row) trips an assertion in its "
     "kernel compiler (ParallelRegion.cc:346) and aborts the process (moecl-tune's children)"},
    /* A work-group's private arrays live on a worker thread's stack. */
    {MOECL_DP_PRIVATE_MAX, 4u << 20,
     "pocl 3.1, 2026-11-30: work-groups of about 8 MiB of private arrays segfaulted (top-k rows kernel 256 "
     "experts x 4096 rows, 1024 x 1024), 256 x 2048 and 1024 x 512 did not"},
    /* pocl keys its own cache (kcache) by source, options and device. */
    {MOECL_DP_BINARY_CACHE, 0,
     "pocl 3.1 on a 2-core Xeon, 2026-12-05: fetching a program's binary compiles a generic work-group "
     "function per kernel that no launch uses; 96 top-k programs built in 78 s with it, 38 s without; "
     "pocl's own kernel cache then served a second process in 3.6 s either way"},
};

static const table_launch pocl_launches[] = {
    {CL_DEVICE_TYPE_CPU, MOECL_OP_TOPK_GATING, 0, {MOECL_KERNEL_ROWS, 1, 8, 0, {0}},
     "pocl 3.1 on a 2-core Xeon, 2026-11-30: every rows count 1..4096 within -4..+8% at 8192x128 (the noise), "
     "team kernels 3x to 25x slower; 8 rows is also the rule's"},
};

/* ---- Mesa's rusticl ---- */

static const table_value rusticl_llvmpipe_values[] = {
    {MOECL_DP_KERNEL_WG_QUERY, 0,
     "rusticl 22.3.6 on llvmpipe (LLVM 15.0.6), 2026-12-07: CL_KERNEL_WORK_GROUP_SIZE is 32 for every kernel, "
     "one with reqd_work_group_size(128) too, while work-groups of 64 to 1024 with barriers and local memory "
     "run right (tests/test_drivers.c, kernel_work_group_size)"},
    {MOECL_DP_LOOP_LIMIT, 65535,
     "rusticl 22.3.6 on llvmpipe, 2026-12-07: a loop of 70000 iterations runs 65535 "
     "(tests/test_drivers.c, loop_iteration_limit); the grounded rows kernel routed 64 experts at hidden 256 "
     "right with 24 tokens a work-item and wrong from 25, one token at hidden 4096 right at 72 experts and "
     "wrong at 80, and the split-K kernel 4096 experts, top 64, wrong on ascending logits (the gating's "
     "insertions): such shapes go split-K, or fail (tests/test_grounded_router.c, loop_budget); top-k "
     "gating's CPU fast path routed ascending rows of 2048 experts, top 64, wrong, its generic loops right "
     "(tests/test_topk_gating.c, loop_budget); combine at hidden 65536, top 8, one work-item a row, "
     "wrong, more work-items a row right (tests/test_permute.c, loop_budget)"},
    {MOECL_DP_ALIGN_CHUNK_WG_CPU, 128,
     "rusticl 22.3.6 on llvmpipe, 2026-12-07: the limit is one budget for all the loops of a work-item "
     "(tests/test_drivers.c, loop_iteration_limit); one work-item a chunk wrote 1 of 4064 blocks at 4096 "
     "experts (its padding loop spent the budget), 128 spread it (the GPU class's shape)"},
    {MOECL_DP_ALIGN_FUSED_WG_CPU, 256,
     "rusticl 22.3.6 on llvmpipe, 2026-12-07: as the chunk kernels', for the fused kernels' one work-group "
     "(the GPU class's shape)"},
};

static const table_entry entries[] = {
    {MOECL_VENDOR_NVIDIA, NULL, nvidia_values, COUNT(nvidia_values), nvidia_launches, COUNT(nvidia_launches)},
    {MOECL_VENDOR_POCL, NULL, pocl_values, COUNT(pocl_values), pocl_launches, COUNT(pocl_launches)},
    {MOECL_VENDOR_RUSTICL, "llvmpipe", rusticl_llvmpipe_values, COUNT(rusticl_llvmpipe_values), NULL, 0},
};

/* ---- lookup ---- */

static bool contains_nocase(const char *haystack, const char *needle)
{
    const size_t n = strlen(needle);
    for (; *haystack; haystack++)
        if (strncasecmp(haystack, needle, n) == 0)
            return true;
    return n == 0;
}

/* Whether entry e applies to info at this level: the vendor's default
 * (named false) or one of its devices (named true). */
static bool applies(const table_entry *e, const moecl_device_info *info, bool named)
{
    return e->vendor == info->vendor && (e->device != NULL) == named &&
           (!named || contains_nocase(info->device_name, e->device));
}

static void apply_values(const table_entry *e, moecl_device_params *p)
{
    for (size_t v = 0; v < e->num_values; v++)
        p->value[e->values[v].param] = e->values[v].value;
}

moecl_device_params moecl_device_table_params(const moecl_device_info *info)
{
    moecl_device_params p;
    for (int i = 0; i < MOECL_NUM_DEVICE_PARAMS; i++)
        p.value[i] = defaults[i].value;
    for (int named = 0; named <= 1; named++)
        for (size_t i = 0; i < COUNT(entries); i++)
            if (applies(&entries[i], info, named))
                apply_values(&entries[i], &p);
    /* The override's table=: the vendor's own entry last, over the
     * device's values (which keep what the driver needs, e.g. pocl's
     * refusals); inline PTX still needs the device's compute capability. */
    for (size_t i = 0; info->env.table_vendor && i < COUNT(entries); i++)
        if (entries[i].vendor == info->env.table_vendor && !entries[i].device)
            apply_values(&entries[i], &p);
    return p;
}

bool moecl_loops_fit(const moecl_device_info *info, uint64_t loops)
{
    const moecl_device_params params = moecl_device_table_params(info);
    return moecl_params_loops_fit(&params, loops);
}

const moecl_launch_config *moecl_device_table_launch(const moecl_device_info *info, const moecl_launch_key *key)
{
    for (int named = 1; named >= 0; named--) {
        for (size_t i = 0; i < COUNT(entries); i++) {
            if (!applies(&entries[i], info, named))
                continue;
            for (size_t l = 0; l < entries[i].num_launches; l++) {
                const table_launch *e = &entries[i].launches[l];
                if ((!e->type || (info->type & e->type)) && e->op == key->op &&
                    (!e->num_experts || e->num_experts == key->num_experts))
                    return &e->config;
            }
        }
    }
    return NULL;
}

bool moecl_device_ptx(const moecl_device_info *info)
{
    const uint32_t major = moecl_device_table_params(info).value[MOECL_DP_PTX_MIN_MAJOR];
    return major && info->nv_compute_major >= major;
}

void moecl_device_ptx_reason(const moecl_device_info *info, char *buf, size_t size)
{
    const uint32_t major = moecl_device_table_params(info).value[MOECL_DP_PTX_MIN_MAJOR];
    if (!major)
        snprintf(buf, size, "not an NVIDIA device");
    else if (info->nv_compute_major == 0)
        snprintf(buf, size, "no compute capability: cl_nv_device_attribute_query absent");
    else if (info->nv_compute_major >= major)
        snprintf(buf, size, "compute capability %u.%u", info->nv_compute_major, info->nv_compute_minor);
    else
        snprintf(buf, size, "compute capability %u.%u; the warp paths need %u.0", info->nv_compute_major,
                 info->nv_compute_minor, major);
}
