/**
 * @file moecl/moecl.h
 * moecl: portable OpenCL kernels for the routing step of mixture-of-experts
 * models.
 *
 * Every function is declared here and documented where it is declared. The
 * semantics of the two ops are stated fully in docs/routing.md; in brief:
 *
 *  - top-k gating: softmax or sigmoid scores over the experts of each token,
 *    an optional correction bias that steers selection only, optional
 *    group-limited selection (dropped groups never selected, or selecting
 *    with 0.0 as in the seed reference), top-k, optional renormalisation
 *    (with an optional floor, as llama.cpp's) and a scaling factor (the
 *    conventions vLLM, SGLang, TensorRT-LLM and llama.cpp route with);
 *  - grounded router: router_logits + alpha * hidden @ ground^T, top-k and a
 *    softmax over the chosen values.
 * Around them: moe_align (the slots sorted by expert), the expert-parallel
 * layout, and permute and combine (the rows moved into moe_align's order
 * and back, weighted) around a runtime's expert GEMMs.
 *
 * Conventions shared by every call:
 *  - A return value of MOECL_SUCCESS (0) means the work was validated and
 *    enqueued (device-buffer calls) or completed (_host calls). Negative
 *    OpenCL error codes are passed through unchanged: the code of the
 *    OpenCL call that failed first, never a mix of several. Library codes
 *    are <= -2000. On any failure moecl_context_error() holds a message for
 *    the calling thread; an OpenCL failure's names the call and the kernel
 *    (and for clSetKernelArg the argument's index), e.g.
 *    "clSetKernelArg(moe_align_scatter, arg 7) failed: CL_INVALID_MEM_OBJECT".
 *    No event is returned from a failed call.
 *  - What a failed call leaves (the "errors" of every call). A call
 *    validates its arguments, builds its kernels, allocates what it needs,
 *    checks every kernel's work-group limit (CL_INVALID_WORK_GROUP_SIZE)
 *    and sets every argument of every kernel it will enqueue before it
 *    enqueues anything: a failure up to there leaves nothing enqueued and
 *    no output byte changed. After its first enqueue only a later enqueue
 *    can fail (the driver's CL_OUT_OF_RESOURCES, CL_OUT_OF_HOST_MEMORY,
 *    ...). Of the device-buffer calls, four have a later enqueue:
 *    moecl_moe_align() on its three-kernel path,
 *    moecl_topk_gating_with_counts() (a fill, then the kernel; so
 *    do moecl_topk_gating_ex() and moecl_router_ex() with expert_counts),
 *    moecl_route_dispatch() (top-k, then moe_align, where it takes
 *    two calls), moecl_grounded_route_dispatch() (the grounded
 *    router, then moe_align, likewise) and moecl_ep_layout() on its
 *    three-kernel path. Such a
 *    failure leaves unspecified the outputs that the commands already
 *    enqueued write, and every other output unchanged; those
 *    functions say which outputs are which. The call waits for the
 *    commands it enqueued before it returns the error, so nothing of a
 *    failed call runs after it returns (it blocks, then, until the events
 *    of its wait list complete). The other device-buffer calls enqueue one
 *    command, so any failure of theirs leaves nothing enqueued and no
 *    output byte changed. A _host call writes host memory only when it
 *    copies the results back: if that copy fails, any of its host outputs
 *    may have been written (unspecified); after any other failure none
 *    has.
 *  - The library never prints, aborts or exits.
 *  - Thread safety: a context may be used from several threads at once.
 *    Creating and destroying a context is not synchronised with its use:
 *    destroy a context only once no other thread uses it.
 *  - Ordering: ties between equal selection scores go to the lower expert
 *    index; NaN ranks below every number, -inf included. The ids of a row are
 *    always distinct and in [0, num_experts).
 */
#ifndef MOECL_MOECL_H
#define MOECL_MOECL_H

/* The Khronos headers default to OpenCL 3.0 and say so with a #pragma
 * message when no target is set; set the same default quietly so that
 * including this header alone builds without noise. A user's own setting
 * wins. */
#ifndef CL_TARGET_OPENCL_VERSION
/** The OpenCL API version the Khronos headers expose (theirs, unless the
 *  includer set it). */
#define CL_TARGET_OPENCL_VERSION 300
#endif

#if defined(__APPLE__)
#include <OpenCL/opencl.h>
#else
#include <CL/cl.h>
#endif
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <moecl/version.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Marks the exported functions: the library is built with hidden
 *  visibility, and only these are in libmoecl.so's dynamic symbol table. */
#if defined(MOECL_BUILDING_LIBRARY) && defined(__GNUC__)
#define MOECL_API __attribute__((visibility("default")))
#else
#define MOECL_API
#endif

/* ---------------------------------------------------------------------- */
/* Status                                                                  */
/* ---------------------------------------------------------------------- */

/**
 * Result of every call. 0 on success; negative OpenCL error codes
 * (CL_OUT_OF_RESOURCES, CL_INVALID_EVENT_WAIT_LIST, ...) pass through
 * unchanged; library codes are <= -2000 so they never collide with them.
 */
typedef enum moecl_status {
    MOECL_SUCCESS = 0, /**< Validated and enqueued, or completed. */
    /** A field or pointer is out of range; nothing was enqueued or written.
     *  moecl_context_error() names the field. */
    MOECL_ERROR_INVALID_ARGUMENT = -2000,
    /** A valid request this device or build cannot serve. */
    MOECL_ERROR_UNSUPPORTED = -2001,
    /** No OpenCL platform or device, or none matches the selector. */
    MOECL_ERROR_NO_DEVICE = -2002,
    /** Kernel compilation failed; the build log is in moecl_context_error(). */
    MOECL_ERROR_BUILD = -2003,
    /** A host allocation failed. */
    MOECL_ERROR_OUT_OF_MEMORY = -2004,
} moecl_status;

/** A short English description of status ("success", "invalid argument",
 *  "CL_OUT_OF_RESOURCES", ...). Never NULL. Negative codes above -2000 that
 *  OpenCL 1.2 does not name give "OpenCL error (see the CL/cl.h codes)";
 *  any other unknown code gives "unknown status". The string is static.
 *  Thread-safe. */
MOECL_API const char *moecl_status_string(moecl_status status);

/** The library version, "MAJOR.MINOR.PATCH". Static string. The headers'
 *  version is MOECL_VERSION_STRING (moecl/version.h): the two differ when a
 *  program runs with another release of the library than it was built
 *  with. */
MOECL_API const char *moecl_version(void);

/* ---------------------------------------------------------------------- */
/* Context: one OpenCL device, its queue, its compiled kernels             */
/* ---------------------------------------------------------------------- */

/** Opaque. Owns (or retains) a cl_context, a device and a command queue,
 *  and the kernels compiled for them. */
typedef struct moecl_context moecl_context;

/**
 * Create a context on an OpenCL device chosen by the selector `device`:
 *   NULL        -> the environment variable MOECL_DEVICE, and if that is
 *                  unset or empty, the first GPU or accelerator of the first
 *                  platform that has one, else the first CPU device;
 *   "gpu"       -> the first GPU or accelerator device;
 *   "cpu"       -> the first CPU device;
 *   "gpu:N", "cpu:N" -> the GPU or accelerator (CPU) device numbered N
 *                  from 0 in moecl-info's order, every platform's
 *                  together ("gpu:0" is "gpu"): a rank per GPU of a host
 *                  selects "gpu:<local rank>"; a text that starts with
 *                  "gpu:" or "cpu:" and is not followed by digits alone
 *                  is an error, never a substring;
 *   "P:D"       -> device D of platform P (indices from 0, as moecl-info
 *                  lists them);
 *   other text  -> the first device whose "platform name / device name"
 *                  contains the text, ignoring case.
 * The context creates its own in-order command queue. Kernels are built
 * lazily, on first use of each variant or in the _prepare calls, and kept
 * for the context's life; compiled binaries are cached on disk (see
 * MOECL_CACHE_DIR in docs/environment.md), except where the OpenCL
 * implementation keeps a kernel cache of its own (pocl).
 *
 * On success *ctx receives the context, which the caller destroys with
 * moecl_context_destroy(). On failure *ctx is set to NULL and
 * moecl_context_error(NULL) holds the detail for this thread.
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (ctx is NULL),
 * MOECL_ERROR_NO_DEVICE (no OpenCL platform is installed, or nothing
 * matches the selector; the message lists the devices there are, or says
 * which package provides a CPU driver), MOECL_ERROR_OUT_OF_MEMORY, or an
 * OpenCL error from context or queue creation.
 */
MOECL_API moecl_status moecl_context_create(const char *device, moecl_context **ctx);

/**
 * Adopt a runtime's own OpenCL objects. `context` and `device` are
 * required; `device` must belong to `context`. `queue` may be NULL, in which
 * case an in-order queue is created; otherwise it must belong to `context`
 * and `device`, and may be in-order or out-of-order (calls then order
 * themselves only through the wait lists the caller passes). The objects are
 * retained and released again by moecl_context_destroy().
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (NULL context or device, a device
 * not in the context, a queue of another context or device),
 * MOECL_ERROR_OUT_OF_MEMORY, or an OpenCL error.
 */
MOECL_API moecl_status moecl_context_create_from_cl(cl_context context, cl_device_id device,
                                                    cl_command_queue queue, moecl_context **ctx);

/** Release the context, its kernels and the OpenCL objects it created or
 *  retained. Waits for nothing: finish the queue first if commands that
 *  use moecl's kernels may still be pending. NULL is a no-op. */
MOECL_API void moecl_context_destroy(moecl_context *ctx);

/** Release the references ctx keeps to the caller's buffers of earlier
 *  calls (see moecl_buffer), so that buffers the caller has released are
 *  freed now. Not while another thread calls into ctx. Commands already
 *  enqueued keep their buffers alive as OpenCL does. The next call with
 *  a buffer checks and sets it again. NULL is a no-op. */
MOECL_API void moecl_context_forget_buffers(moecl_context *ctx);

/** The detail of the calling thread's last failure on ctx, or "" if there
 *  is none. ctx may be NULL: then it is the detail of the thread's last
 *  failed moecl_context_create / _create_from_cl. The string stays valid
 *  until the thread's next failing call; it is never NULL. A thread keeps
 *  the detail of its last few contexts. */
MOECL_API const char *moecl_context_error(const moecl_context *ctx);

/** The OpenCL objects of ctx (not retained for the caller; valid while ctx
 *  lives). NULL if ctx is NULL. */
MOECL_API cl_context moecl_context_cl_context(const moecl_context *ctx);
/** The device of ctx (not retained; see moecl_context_cl_context()). */
MOECL_API cl_device_id moecl_context_device(const moecl_context *ctx);
/** The command queue of ctx, its own or the adopted one (not retained). */
MOECL_API cl_command_queue moecl_context_queue(const moecl_context *ctx);

/** The most launch entries a moecl_context_info holds. */
#define MOECL_CONTEXT_INFO_MAX_LAUNCHES 8

/** What a representative shape launches with on the context's device. */
typedef struct moecl_launch_info {
    char op[16];            /**< "topk" (top-k gating) or "grounded" (the grounded router) */
    uint32_t num_experts;   /**< the key: experts, */
    uint32_t top_k;         /**< top_k, */
    uint32_t groups;        /**< top-k gating's expert groups (0: none; 0 for the grounded router), */
    uint32_t hidden_bucket; /**< the grounded router's hidden size rounded up to a power of two (0 for top-k) */
    char kernel[16];        /**< the kernel family: "rows", "team" or "tiled" */
    uint32_t team;          /**< work-items per row (1 for rows and tiled) */
    uint32_t rows;          /**< rows (tokens) per work-group (0 for tiled) */
    uint32_t tile;          /**< tokens per work-group of the tiled kernel (0 otherwise) */
    char source[16];        /**< where it came from: "default", "table", "tuned", "override" or "forced" */
    char key_text[64];      /**< the key as a tune file line spells it, "topk e=128 k=8 groups=0" */
    char config_text[64];   /**< the configuration as a tune file line spells it, "kernel=rows rows=8" */
} moecl_launch_info;

/** The description of a context: its device, and what moecl chose for it
 *  and why. One record behind moecl_context_describe() (which formats it)
 *  and `moecl-info --json` (which serialises it). Strings are NUL-terminated
 *  and truncated to their arrays; OpenCL's names are copied as the driver
 *  gives them (not necessarily valid UTF-8). An empty path means "none". */
typedef struct moecl_context_info {
    /** The caller sets this to sizeof(moecl_context_info) before the call:
     *  a later moecl with a longer record fills only the fields this
     *  size covers. */
    size_t struct_size;
    char platform[128];          /**< CL_PLATFORM_NAME */
    char device[128];            /**< CL_DEVICE_NAME */
    char device_version[128];    /**< CL_DEVICE_VERSION */
    char driver[128];            /**< CL_DRIVER_VERSION */
    char type[16];               /**< "CPU", "GPU", "accelerator" or "other" */
    char vendor[16];             /**< "NVIDIA", "AMD", "Intel", "pocl", "rusticl" or "other", as moecl classifies it */
    uint32_t compute_units;      /**< CL_DEVICE_MAX_COMPUTE_UNITS */
    uint64_t local_memory_bytes; /**< CL_DEVICE_LOCAL_MEM_SIZE */
    size_t max_work_group_size;  /**< CL_DEVICE_MAX_WORK_GROUP_SIZE */
    char launch_class[16];       /**< "cpu" or "gpu": how the kernels are shaped */
    char launch_class_reason[128]; /**< why that class */
    char kernel_dir[4096];       /**< $MOECL_KERNEL_DIR the kernels are read from; "": the embedded sources */
    char kernel_cache[4096];     /**< the kernel cache directory; "": caching is off */
    bool inline_ptx;             /**< the NVIDIA inline PTX (warp) paths are built */
    char inline_ptx_reason[128]; /**< why they are or are not, e.g. "compute capability 9.0" */
    char tune_file[4096];        /**< the device's tune file (moecl-tune writes it); "": no cache directory */
    bool tune_file_present;      /**< that file exists */
    uint32_t tune_keys_read;     /**< configurations read from it at context creation */
    uint32_t num_launches;       /**< entries of launches[] filled */
    moecl_launch_info launches[MOECL_CONTEXT_INFO_MAX_LAUNCHES]; /**< representative shapes */
    /* The first version of the record ends here. */
    bool kernel_binaries;        /**< compiled binaries are stored in kernel_cache and loaded from it; false
                                      where caching is off or the OpenCL implementation keeps a kernel
                                      cache of its own (pocl), which serves later processes instead */
} moecl_context_info;

/** Fill *info with the description of ctx. info->struct_size must be set
 *  (see moecl_context_info); bytes past it are not written, and on success
 *  struct_size is set to the size this moecl filled. Errors:
 *  MOECL_ERROR_INVALID_ARGUMENT for a NULL ctx or info or a struct_size
 *  below that of the first version of the record (which ends at
 *  launches[]); then *info is unchanged. Thread-safe. */
MOECL_API moecl_status moecl_context_query_info(const moecl_context *ctx, moecl_context_info *info);

/** Describe the context's device and what moecl chose for it, as lines of
 *  "key: value" text formatted from moecl_context_query_info()'s record
 *  (for people: scripts read the record, or `moecl-info --json`): platform,
 *  device, driver, device type, vendor, compute units, local memory,
 *  maximum work-group size, the launch class and why, whether the NVIDIA
 *  inline PTX paths are built, the kernel cache directory and whether it
 *  holds compiled binaries, the device's
 *  tune file, and for representative shapes the launch configuration and
 *  where it came from. Writes at most size bytes including the terminating
 *  NUL (like snprintf) and returns the length the whole text needs; for a
 *  NULL ctx, or out of host memory, it writes "" (when size > 0) and
 *  returns 0. buf may be NULL
 *  when size is 0. Thread-safe. */
MOECL_API size_t moecl_context_describe(const moecl_context *ctx, char *buf, size_t size);

/* ---------------------------------------------------------------------- */
/* Shared types                                                            */
/* ---------------------------------------------------------------------- */

/** Element type of an input tensor. F16 is IEEE binary16 and BF16 is the
 *  upper 16 bits of an IEEE binary32; both are widened to f32 on load and
 *  need no device extension. */
typedef enum moecl_dtype {
    MOECL_F32 = 0,  /**< IEEE binary32 */
    MOECL_F16 = 1,  /**< IEEE binary16 */
    MOECL_BF16 = 2, /**< bfloat16: the upper 16 bits of a binary32 */
} moecl_dtype;

/** Element type of an expert-id output (docs/routing.md, section 2,
 *  "Output and bias dtypes"). */
typedef enum moecl_index_dtype {
    MOECL_I32 = 0, /**< int32_t: vLLM's and SGLang's default */
    MOECL_I64 = 1, /**< int64_t: PyTorch's topk, DeepEP */
    MOECL_I16 = 2, /**< int16_t: routing capture buffers */
} moecl_index_dtype;

/** Scoring function: what a token is routed by, before any correction
 *  bias (docs/routing.md, section 2, step 1). */
typedef enum moecl_scoring {
    MOECL_SCORING_SOFTMAX = 0, /**< softmax over the experts of a token */
    MOECL_SCORING_SIGMOID = 1, /**< sigmoid of each logit */
    /** sqrt(softplus(x)), softplus(x) = x above 20 and log1p(exp(x))
     *  otherwise (PyTorch's threshold): DeepSeek-V4's "sqrtsoftplus". */
    MOECL_SCORING_SQRTSOFTPLUS = 2,
    MOECL_SCORING_RAW = 3, /**< the logit itself (Llama 4; the grounded router's g) */
} moecl_scoring;

/** What the chosen experts are weighted by (docs/routing.md, section 2,
 *  step 5), independently of what they were selected by. */
typedef enum moecl_weighting {
    /** The chosen experts' unbiased scores: top-k gating's convention
     *  (vLLM, SGLang, DeepSeek-V3) and its default. */
    MOECL_WEIGHTS_SCORE = 0,
    /** A softmax over the chosen logits only, max-subtracted, summed in
     *  slot order: Mixtral/Qwen's "top-k, then softmax" and the grounded
     *  router's default. */
    MOECL_WEIGHTS_SOFTMAX_CHOSEN = 1,
    /** The sigmoid of each chosen logit: Llama 4. */
    MOECL_WEIGHTS_SIGMOID_CHOSEN = 2,
} moecl_weighting;

/** Group score of group-limited selection: the largest selection score in
 *  the group (the seed reference), or the sum of the two largest
 *  (DeepSeek-V3). */
typedef enum moecl_group_score {
    MOECL_GROUP_SCORE_MAX = 0,      /**< the group's largest selection score */
    MOECL_GROUP_SCORE_TOP2_SUM = 1, /**< the sum of its two largest */
} moecl_group_score;

/** What group-limited selection does with the experts of the groups it
 *  drops (docs/routing.md, section 2, step 3). */
typedef enum moecl_group_fill {
    /** Never selected, as if their selection score were -inf (vLLM's
     *  grouped_topk, SGLang's biased_grouped_topk). The default, and what
     *  moecl did before this field existed. */
    MOECL_GROUP_FILL_NEG_INF = 0,
    /** Their selection score becomes 0.0, as in the seed reference,
     *  SGLang's unbiased grouped_topk (DeepSeek-V2) and TensorRT-LLM's
     *  PyTorch DeepSeek-V3 path: they are selected when fewer than top_k
     *  kept experts rank above 0.0 (ties to the lower index, kept or not).
     *  The weight of such an expert is 0.0 without a bias (the fill
     *  replaces the score, which is the selection score) and its unbiased
     *  score with one (the fill replaces only the selection score). */
    MOECL_GROUP_FILL_ZERO = 1,
} moecl_group_fill;

/** A device buffer and a byte offset into it; mem == NULL means "absent".
 *  The offset must be a multiple of the element size of the tensor it
 *  holds, and the tensor must lie inside the buffer (checked through
 *  CL_MEM_SIZE). Tensors are row-major and contiguous. The buffer must
 *  belong to the context's cl_context, and is checked (CL_MEM_SIZE,
 *  CL_MEM_CONTEXT) the first time a call passes it.
 *
 *  The context keeps a reference to the buffers of each kernel's last
 *  call (clRetainMemObject), so that a call with the same buffers as the
 *  last one sets and queries nothing again: a buffer released after a
 *  call is freed once that kernel is called with another buffer, at
 *  moecl_context_forget_buffers() or at moecl_context_destroy(), not
 *  before. The _host calls' buffers are the library's own and are not
 *  kept. */
typedef struct moecl_buffer {
    cl_mem mem;    /**< the buffer, or NULL for an absent tensor */
    size_t offset; /**< byte offset of the tensor in mem */
} moecl_buffer;

/* ---------------------------------------------------------------------- */
/* Top-k gating (docs/routing.md, section 1)                               */
/* ---------------------------------------------------------------------- */

/**
 * What to compute. Valid requests:
 *   num_tokens >= 0 (0 is a successful no-op);
 *   1 <= num_experts <= 4096;
 *   1 <= top_k <= min(num_experts, 64);
 *   num_expert_groups == 0 (no group limit) and topk_group == 0, or
 *   num_experts % num_expert_groups == 0, 1 <= topk_group <=
 *   num_expert_groups and top_k <= topk_group * (num_experts /
 *   num_expert_groups);
 *   gating_dtype, scoring, weighting, group_score and group_fill one of their enum
 *   values (whether or not groups are used);
 *   routed_scaling_factor finite;
 *   renormalize_floor 0, or a normal float (>= FLT_MIN) and finite, whether
 *   or not renormalize is set (a subnormal floor could be flushed to 0 by
 *   one device and not another);
 *   renormalize_eps likewise, and at most one of the two nonzero;
 *   weights_dtype and bias_dtype moecl_dtype values, ids_dtype a
 *   moecl_index_dtype value;
 *   num_shared_experts <= 64 - top_k, and shared_expert_weight finite
 *   where num_shared_experts > 0.
 */
typedef struct moecl_topk_gating_desc {
    uint32_t num_tokens;        /**< rows of the gating logits */
    uint32_t num_experts;       /**< columns of the gating logits */
    uint32_t top_k;             /**< experts chosen per token */
    uint32_t num_expert_groups; /**< 0: no group-limited selection */
    uint32_t topk_group;        /**< groups kept per token */
    moecl_dtype gating_dtype;   /**< dtype of the gating logits */
    moecl_scoring scoring;      /**< softmax or sigmoid */
    moecl_group_score group_score; /**< how a group is scored when num_expert_groups > 0 */
    bool renormalize;            /**< divide the k weights by their sum (see renormalize_floor) */
    float routed_scaling_factor; /**< applied to the weights last */
    /** With renormalize, the smallest divisor. 0 (the default): moecl's
     *  rule, divide by the sum S when S > 0 and leave the weights as they
     *  are when S is 0 or NaN. > 0: divide by max(S, renormalize_floor),
     *  as llama.cpp does with 6.103515625e-5 (2^-14, its clamp of the sum),
     *  and leave the weights as they are when S is NaN. Ignored without
     *  renormalize. */
    float renormalize_floor;
    /** With num_expert_groups > 0, what becomes of the experts of dropped
     *  groups; MOECL_GROUP_FILL_NEG_INF (the default) never selects them,
     *  MOECL_GROUP_FILL_ZERO gives them the selection score 0.0 of the
     *  seed reference. Ignored without groups. */
    moecl_group_fill group_fill;
    /** What the chosen experts weigh: MOECL_WEIGHTS_SCORE (the default)
     *  keeps moecl's results from before this field existed. */
    moecl_weighting weighting;
    /** With renormalize, an epsilon added to the sum. 0 (the default):
     *  the rule of renormalize_floor. > 0: divide by the fp32 sum S + eps
     *  whatever S is, as the models that write `sum + eps` do (DeepSeek-V3,
     *  GLM-4.5, Kimi K2: 1e-20; LFM2: 1e-6); a NaN S makes the weights NaN,
     *  as it does there. renormalize_floor must then be 0. Ignored without
     *  renormalize. */
    float renormalize_eps;
    /** Element type of topk_weights: MOECL_F32 (the default), or MOECL_F16
     *  or MOECL_BF16 (FlashInfer's bf16 weights). The weights are computed
     *  in f32 as always and rounded to nearest even once, as they are
     *  stored: the same bits on every device. NaN stays NaN (a quiet one),
     *  +-inf stays +-inf, and a finite weight beyond the type's range
     *  (f16: >= 65520 in magnitude) becomes +-inf. */
    moecl_dtype weights_dtype;
    /** Element type of topk_ids: MOECL_I32 (the default) or MOECL_I64
     *  (PyTorch's topk, DeepEP). moecl_route_dispatch() takes MOECL_I32
     *  only (its moe_align part reads int32 ids). MOECL_I16 is refused
     *  here: topk_ids feed moecl_moe_align() and the dispatch, which read
     *  int32; a narrow copy is moecl_topk_gating_tensors's captured_ids. */
    moecl_index_dtype ids_dtype;
    /** Element type of the correction bias, when there is one: MOECL_F32
     *  (the default), MOECL_F16 or MOECL_BF16 (FlashInfer's and aiter's
     *  bf16 e_score_correction_bias), widened to f32 exactly on load. */
    moecl_dtype bias_dtype;
    /** Shared experts appended to the routing output (docs/routing.md,
     *  "Shared experts"; SGLang's num_fused_shared_experts). 0 (the
     *  default): none. S > 0: every output row holds top_k + S slots, the
     *  routed top_k as without them, then slot top_k + j (j < S) with id
     *  num_experts + j and the weight shared_expert_weight *
     *  routed_scaling_factor (one fp32 product). They are counted as
     *  ordinary slots: expert_counts and expert_load then have
     *  num_experts + S entries, and moecl_route_dispatch() aligns top_k + S
     *  slots a token over num_experts + S experts. A padding row
     *  (num_valid_tokens) is -1 / 0 in every slot. top_k + S <= 64.
     *  moecl_topk_weights() and moecl_hash_routing() refuse S > 0. */
    uint32_t num_shared_experts;
    /** The weight of each shared slot before routed_scaling_factor:
     *  finite; 1.0 in moecl_topk_gating_desc_init(). SGLang's fused shared
     *  experts weigh 1 / routed_scaling_factor here (with renormalize), so
     *  that they count once where the factor is applied. Ignored without
     *  shared experts. */
    float shared_expert_weight;
} moecl_topk_gating_desc;

/** The seed reference op: softmax, f32 logits, no groups,
 *  MOECL_GROUP_SCORE_MAX, no renormalisation, factor 1; renormalize_floor
 *  0 and MOECL_GROUP_FILL_NEG_INF, moecl's behaviour before those fields
 *  existed; f32 weights, int32 ids and an f32 bias. The seed reference fills dropped groups with 0.0: a caller
 *  that sets its groups reproduces it at every input with
 *  group_fill = MOECL_GROUP_FILL_ZERO. */
MOECL_API moecl_topk_gating_desc moecl_topk_gating_desc_init(uint32_t num_tokens, uint32_t num_experts,
                                                             uint32_t top_k);

/**
 * Top-k gating on device buffers. Asynchronous: validates, then enqueues one
 * kernel on the context's queue after the `num_wait` events of `wait`, and
 * returns. If `done` is non-NULL it receives an event for that kernel, which
 * the caller releases (with num_tokens == 0 it is a marker event).
 * No host allocation and no blocking on the hot path (the first call of a
 * variant builds its kernel unless _prepare did).
 *
 *   gating        [num_tokens][num_experts] of desc->gating_dtype
 *   bias          [num_experts] of desc->bias_dtype, or absent (mem == NULL)
 *   topk_weights  [num_tokens][top_k] of desc->weights_dtype
 *   topk_ids      [num_tokens][top_k] of desc->ids_dtype (int32_t or int64_t)
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (a descriptor field out of range,
 * NULL ctx/desc, a missing buffer, a buffer too small for the shape, an
 * unaligned offset, a buffer of another context, num_wait > 0 with wait
 * NULL), MOECL_ERROR_UNSUPPORTED (a row's loops pass the driver's loop
 * limit, docs/devices.md: Mesa's rusticl at 4096 experts, top 64),
 * MOECL_ERROR_BUILD, the OpenCL error of a clSetKernelArg,
 * CL_INVALID_WORK_GROUP_SIZE (the kernel's limit on this device is below
 * the launch's work-group), or the OpenCL error of the enqueue. On any
 * failure nothing is enqueued and no output byte changes.
 */
MOECL_API moecl_status moecl_topk_gating(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                         moecl_buffer gating, moecl_buffer bias,
                                         moecl_buffer topk_weights, moecl_buffer topk_ids,
                                         cl_uint num_wait, const cl_event *wait, cl_event *done);

/** Blocking convenience on host memory: copies in, runs, copies out. bias
 *  may be NULL. topk_weights and topk_ids are required. The tensors have
 *  the types desc names (a float bias, float weights and int32_t ids by
 *  default). Same validation as moecl_topk_gating. */
MOECL_API moecl_status moecl_topk_gating_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                              const void *gating, const void *bias, void *topk_weights,
                                              void *topk_ids);

/**
 * Top-k gating on device buffers that also counts, in the same launch, the
 * (token, slot) pairs routed to each expert: moecl_topk_gating() plus an
 * expert histogram, for runtimes that need the counts without a separate
 * pass over topk_ids (moecl_topk_gating() itself is unchanged and counts
 * nothing). Asynchronous: validates, then enqueues a fill that zeroes
 * expert_counts after the `num_wait` events of `wait`, and the kernel after
 * the fill, and returns. If `done` is non-NULL it receives the kernel's
 * event (with num_tokens == 0, the fill's), which the caller releases. The
 * counts are integer sums, so they are the same on every device and launch
 * shape: expert_counts[e] is the number of entries of topk_ids equal to e,
 * and they add up to num_tokens * top_k. The counting kernels are separate
 * variants from moecl_topk_gating()'s, built on the first call of each
 * (moecl_topk_gating_prepare() does not build them).
 *
 * @param ctx           the context
 * @param desc          what to compute, as for moecl_topk_gating()
 * @param gating        [num_tokens][num_experts] of desc->gating_dtype
 * @param bias          [num_experts] of desc->bias_dtype, or absent (mem == NULL)
 * @param topk_weights  [num_tokens][top_k] of desc->weights_dtype, output
 * @param topk_ids      [num_tokens][top_k] of desc->ids_dtype, output
 * @param expert_counts int32_t[num_experts], output, required: overwritten
 *                      with the number of (token, slot) pairs routed to
 *                      each expert (all zeros when num_tokens is 0)
 * @param num_wait      the number of events in wait
 * @param wait          events the call waits on, or NULL when num_wait is 0
 * @param done          receives the event of the call's last command, or
 *                      NULL
 * @return MOECL_SUCCESS, or as moecl_topk_gating(): MOECL_ERROR_INVALID_ARGUMENT
 *         (also for an expert_counts buffer that is absent, too small,
 *         misaligned or of another context), MOECL_ERROR_BUILD, the error
 *         of a clSetKernelArg, CL_INVALID_WORK_GROUP_SIZE, or the OpenCL
 *         error of an enqueue. All of these but the kernel's enqueue are
 *         found before the fill is enqueued: nothing is enqueued and no
 *         output byte changes. If the kernel's enqueue fails after the
 *         fill's succeeded, expert_counts is unspecified (the fill has
 *         normally zeroed it) and topk_weights and topk_ids are unchanged;
 *         the call waits for the fill before it returns the error.
 */
MOECL_API moecl_status moecl_topk_gating_with_counts(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                                     moecl_buffer gating, moecl_buffer bias,
                                                     moecl_buffer topk_weights, moecl_buffer topk_ids,
                                                     moecl_buffer expert_counts, cl_uint num_wait,
                                                     const cl_event *wait, cl_event *done);

/**
 * Blocking convenience of moecl_topk_gating_with_counts() on host memory:
 * copies in, runs, copies out. Same validation as
 * moecl_topk_gating_with_counts(). The device buffers are the call's own,
 * so a failed enqueue leaves every host output unchanged; only a failed
 * copy back may have written them (see "What a failed call leaves"
 * above).
 *
 * @param ctx           the context
 * @param desc          what to compute, as for moecl_topk_gating()
 * @param gating        [num_tokens][num_experts] of desc->gating_dtype
 *                      (may be NULL only when num_tokens is 0)
 * @param bias          [num_experts] of desc->bias_dtype, or NULL
 * @param topk_weights  [num_tokens][top_k] of desc->weights_dtype, output
 *                      (may be NULL only when num_tokens is 0)
 * @param topk_ids      [num_tokens][top_k] of desc->ids_dtype, output (may
 *                      be NULL only when num_tokens is 0)
 * @param expert_counts int32_t[num_experts], output, required: the number
 *                      of (token, slot) pairs routed to each expert
 * @return MOECL_SUCCESS or an error as moecl_topk_gating_with_counts().
 */
MOECL_API moecl_status moecl_topk_gating_with_counts_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                                          const void *gating, const void *bias,
                                                          void *topk_weights, void *topk_ids,
                                                          int32_t *expert_counts);

/** Build (or load from the disk cache) the kernel variant that desc needs,
 *  ahead of the first call, so that the call itself does not compile.
 *  Validates desc as the call does (num_tokens is not used). The variants
 *  of moecl_topk_gating_with_counts() are not built here. */
MOECL_API moecl_status moecl_topk_gating_prepare(moecl_context *ctx, const moecl_topk_gating_desc *desc);

/**
 * The tensors of moecl_topk_gating_ex(), by name: moecl_topk_gating()'s
 * four and optional ones that only that call takes. Zero the record, set
 * struct_size to sizeof(moecl_topk_gating_tensors), then the tensors: an
 * absent one has mem NULL. A later moecl may append fields; a caller's
 * struct_size tells it which this record holds.
 */
typedef struct moecl_topk_gating_tensors {
    size_t struct_size;          /**< sizeof(moecl_topk_gating_tensors) */
    moecl_buffer gating;         /**< [num_tokens][num_experts] of gating_dtype, required */
    moecl_buffer bias;           /**< [num_experts] of bias_dtype, or absent */
    moecl_buffer topk_weights;   /**< [num_tokens][top_k] of weights_dtype, output, required */
    moecl_buffer topk_ids;       /**< [num_tokens][top_k] of ids_dtype, output, required */
    /** int32_t[num_experts], output, or absent: overwritten with the
     *  number of (token, slot) pairs routed to each expert, as
     *  moecl_topk_gating_with_counts() does (a fill, then the kernel). */
    moecl_buffer expert_counts;
    /** int32_t[num_experts], or absent: a load counter. The call adds the
     *  number of (token, slot) pairs it routes to each expert to the
     *  buffer's entries, in the same launch, and never zeroes it: a
     *  runtime keeps one per layer across calls for its load balancer
     *  (vLLM's and SGLang's expert-load statistics) and resets it itself.
     *  int32 sums wrap after 2^31 - 1. */
    moecl_buffer expert_load;
    /** int32_t[1], or absent: the number n of rows that are tokens, read
     *  by the kernel when it runs, so that one enqueued call serves any
     *  batch up to num_tokens (a runtime replaying a captured graph or a
     *  command buffer for a padded batch: vLLM's is_padding, SGLang's
     *  num_token_non_padded). Rows t >= n (every row when n <= 0; none
     *  when n >= num_tokens) are padding: ids -1 and weights 0, counted
     *  in neither expert_counts nor expert_load; moecl_moe_align() and
     *  moecl_ep_layout() skip such ids as invalid. */
    moecl_buffer num_valid_tokens;
    /** [num_tokens][top_k] of captured_ids_dtype, output, or absent:
     *  routing capture. The call writes the ids it writes to topk_ids a
     *  second time, here, in the same launch (padding rows -1), so that a
     *  reinforcement-learning trainer can replay the inference engine's
     *  routing (vLLM's and SGLang's RoutedExpertsCapturer, behind
     *  --enable-return-routed-experts; the ids feed Megatron-Core's
     *  routing replay or moecl_topk_weights()). A runtime points it at
     *  its per-layer capture buffer. */
    moecl_buffer captured_ids;
    /** The element type of captured_ids: MOECL_I16 (which needs
     *  num_experts <= 32767), MOECL_I32 or MOECL_I64. Read only where
     *  captured_ids is given. */
    moecl_index_dtype captured_ids_dtype;
    /** float[num_experts], or absent: a per-expert scale of the weights
     *  (Gemma 4's per_expert_scale, transformers' Gemma4TextRouter). The
     *  final weight of a chosen expert e, after the renormalisation and
     *  routed_scaling_factor, is multiplied by expert_scale[e] (in f32,
     *  before the rounding to weights_dtype); padding rows stay 0. The
     *  weights then need not sum to 1. */
    moecl_buffer expert_scale;
} moecl_topk_gating_tensors;

/**
 * Top-k gating with the optional tensors of moecl_topk_gating_tensors:
 * moecl_topk_gating() when only its four are given, and
 * moecl_topk_gating_with_counts() when expert_counts is given too, bit for
 * bit. Asynchronous; the commands, events and errors are those
 * moecl_topk_gating_with_counts() states where expert_counts is given
 * (a fill, then the kernel) and moecl_topk_gating()'s otherwise; also
 * MOECL_ERROR_INVALID_ARGUMENT for a NULL tensors, a struct_size this
 * moecl does not know, expert_load, num_valid_tokens, captured_ids or
 * expert_scale too small, misaligned or of another context, a
 * captured_ids_dtype that is not MOECL_I16, MOECL_I32 or MOECL_I64, and
 * MOECL_I16 with num_experts above 32767. A record of an earlier size
 * (one that ends before captured_ids) is accepted: the fields it lacks
 * are absent. On a failure captured_ids is unchanged, as topk_ids is. A failed call leaves expert_load
 * unchanged, unless the kernel's enqueue fails after the counts' fill
 * (then as moecl_topk_gating_with_counts() says, and expert_load is
 * unchanged too).
 */
MOECL_API moecl_status moecl_topk_gating_ex(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                            const moecl_topk_gating_tensors *tensors, cl_uint num_wait,
                                            const cl_event *wait, cl_event *done);

/** The host-memory tensors of moecl_topk_gating_ex_host(), as
 *  moecl_topk_gating_tensors's; an absent one is NULL. */
typedef struct moecl_topk_gating_host_tensors {
    size_t struct_size;               /**< sizeof(moecl_topk_gating_host_tensors) */
    const void *gating;               /**< of gating_dtype, required (may be NULL when num_tokens is 0) */
    const void *bias;                 /**< of bias_dtype, or NULL */
    void *topk_weights;               /**< of weights_dtype, output, required (as gating) */
    void *topk_ids;                   /**< of ids_dtype, output, required (as gating) */
    int32_t *expert_counts;           /**< output, or NULL */
    int32_t *expert_load;             /**< read, added to and written back, or NULL */
    const int32_t *num_valid_tokens;  /**< one int32, or NULL */
    void *captured_ids;               /**< of captured_ids_dtype, output, or NULL */
    moecl_index_dtype captured_ids_dtype; /**< as moecl_topk_gating_tensors's */
    const float *expert_scale;        /**< [num_experts], or NULL */
} moecl_topk_gating_host_tensors;

/** Blocking convenience of moecl_topk_gating_ex() on host memory: copies
 *  in (expert_load too), runs, copies out (expert_load too). Same
 *  validation. As for the other _host calls, a failed enqueue leaves
 *  every host output unchanged; only a failed copy back may have written
 *  them. With num_tokens 0, expert_counts is zeroed and expert_load
 *  unchanged. */
MOECL_API moecl_status moecl_topk_gating_ex_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                                 const moecl_topk_gating_host_tensors *tensors);

/* ---------------------------------------------------------------------- */
/* Routing replay and hash routing (docs/routing.md, section 11)           */
/* ---------------------------------------------------------------------- */

/**
 * The weights top-k gating's convention gives ids chosen elsewhere: routing
 * replay, for a trainer that must reuse the experts an inference engine
 * chose (Megatron-Core's `precomputed_indices`, FlashInfer's precomputed
 * routing modes). For each token t and slot j, with e = topk_ids[t][j],
 * topk_weights[t][j] is what moecl_topk_gating() writes for expert e had
 * it chosen e in slot j: step 1's score of the row (scoring), the
 * weighting (the score, a softmax over the row's k given logits, or their
 * sigmoid), renormalize with renormalize_floor or renormalize_eps over the
 * k slots in order, and routed_scaling_factor. Given the ids
 * moecl_topk_gating() chose from the same logits, on the same context, the
 * weights are its weights bit for bit, except in two cases:
 *   - group_fill MOECL_GROUP_FILL_ZERO without a bias, where top-k gating
 *     weighs an expert of a dropped group 0: replay selects nothing and
 *     keeps no group, so such an expert weighs its score;
 *   - a softmax scoring with MOECL_WEIGHTS_SCORE and no groups on a CPU
 *     device, where top-k gating with a bias sums the row in another
 *     order than without: replay gives the bits of the call without one
 *     (with one, values within docs/routing.md section 4's bounds).
 * An id outside [0, num_experts) (a runtime's -1 of a padding slot) weighs
 * 0 and is left out of the renormalisation sum and of the softmax over the
 * chosen logits; the ids need not be distinct (a repeated id weighs as
 * often as it comes).
 *
 * desc: num_tokens, num_experts, top_k, gating_dtype, scoring, weighting,
 * renormalize, renormalize_floor, renormalize_eps and
 * routed_scaling_factor are used; num_expert_groups, topk_group,
 * group_score and group_fill steer selection only and are ignored (but
 * validated as for moecl_topk_gating(), and they pick the same launch).
 * The correction bias has no place: it steers selection only.
 * weights_dtype must be MOECL_F32 and ids_dtype MOECL_I32 (bias_dtype is
 * ignored); others give MOECL_ERROR_INVALID_ARGUMENT.
 *
 *   gating        [num_tokens][num_experts] of desc->gating_dtype
 *   topk_ids      int32_t[num_tokens][top_k], input
 *   topk_weights  float[num_tokens][top_k], output
 *
 * Asynchronous, one kernel (cl/replay.cl) after the `num_wait` events of
 * `wait`; `done`, if non-NULL, receives its event (a marker for
 * num_tokens 0). Errors: as moecl_topk_gating() (the same descriptor
 * checks and messages, a missing or short buffer, ...); on any failure
 * nothing is enqueued and no output byte changes.
 */
MOECL_API moecl_status moecl_topk_weights(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                          moecl_buffer gating, moecl_buffer topk_ids, moecl_buffer topk_weights,
                                          cl_uint num_wait, const cl_event *wait, cl_event *done);

/** Blocking convenience of moecl_topk_weights() on host memory: copies in,
 *  runs, copies out. gating, topk_ids and topk_weights may be NULL only
 *  when num_tokens is 0. Same validation as moecl_topk_weights(); a
 *  failure leaves topk_weights as "What a failed call leaves" states. */
MOECL_API moecl_status moecl_topk_weights_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                               const void *gating, const int32_t *topk_ids, float *topk_weights);

/**
 * Hash routing (DeepSeek-V4's first MoE layers, its `DeepseekV4HashRouter`):
 * the experts of token t are tid2eid[input_ids[t]][0 .. top_k), a fixed
 * table of token ids, and their weights are moecl_topk_weights()'s for
 * those ids under desc (DeepSeek-V4: moecl_topk_gating_desc_preset(
 * "deepseek-v4", ...): sqrt(softplus) scores, divided by their sum +
 * 1e-20, times 2.5). One kernel: the ids are gathered, then replayed.
 *
 *   gating        [num_tokens][num_experts] of desc->gating_dtype
 *   input_ids     int32_t[num_tokens], input: the tokens' ids
 *   tid2eid       int32_t[vocab_size][top_k], input: the table
 *   topk_weights  float[num_tokens][top_k], output
 *   topk_ids      int32_t[num_tokens][top_k], output: the table's rows
 *
 * An input id outside [0, vocab_size), which the host cannot see in
 * device memory, is not read from the table: its row's ids are -1 and its
 * weights 0. A table entry outside [0, num_experts) is written as it is,
 * with weight 0, and left out of the sum, as moecl_topk_weights() treats
 * such an id. vocab_size must be 1 ..= INT32_MAX. Asynchronous, one
 * kernel; events and errors as moecl_topk_weights() (also for an input_ids
 * or tid2eid buffer that is missing or too small, and vocab_size 0).
 */
MOECL_API moecl_status moecl_hash_routing(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                          moecl_buffer gating, moecl_buffer input_ids, moecl_buffer tid2eid,
                                          uint32_t vocab_size, moecl_buffer topk_weights, moecl_buffer topk_ids,
                                          cl_uint num_wait, const cl_event *wait, cl_event *done);

/** Blocking convenience of moecl_hash_routing() on host memory: copies in,
 *  runs, copies out. tid2eid is required; gating, input_ids, topk_weights
 *  and topk_ids may be NULL only when num_tokens is 0. Same validation as
 *  moecl_hash_routing(). */
MOECL_API moecl_status moecl_hash_routing_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                               const void *gating, const int32_t *input_ids, const int32_t *tid2eid,
                                               uint32_t vocab_size, float *topk_weights, int32_t *topk_ids);

/* ---------------------------------------------------------------------- */
/* Grounded router (docs/routing.md, section 3)                            */
/* ---------------------------------------------------------------------- */

/** How the products of hidden @ ground^T are formed when the hidden states
 *  are f32 (docs/routing.md, section 3). f16 and bf16 hidden states ignore
 *  it: their products are exact in fp32 on every path (tensor cores where
 *  the device has them), so they always have the fp32 bound. */
typedef enum moecl_precision {
    /** fp32 products and sums, the fp32 error bound. The default. */
    MOECL_PRECISION_FP32 = 0,
    /** Opt-in: each operand rounded to tf32 (10 explicit mantissa bits)
     *  and multiplied on the tensor cores where the device has them; a
     *  looser bound (docs/routing.md, section 4). Devices without them
     *  compute in fp32, which is within that bound. */
    MOECL_PRECISION_TF32 = 1,
    /** Opt-in: each operand split into a tf32 high part and a tf32
     *  residual, three tensor-core products (hi*hi + hi*lo + lo*hi):
     *  about fp32 accuracy from the tensor cores. fp32 elsewhere. */
    MOECL_PRECISION_3XTF32 = 2,
} moecl_precision;

/** The gating conventions after the router's GEMM: the fields of
 *  moecl_topk_gating_desc that say how a row of logits becomes ids and
 *  weights, with the same meaning and validity (docs/routing.md,
 *  section 2). */
typedef struct moecl_gating {
    moecl_scoring scoring;         /**< what selects (before the bias) */
    moecl_weighting weighting;     /**< what the chosen weigh */
    uint32_t num_expert_groups;    /**< 0: no group-limited selection */
    uint32_t topk_group;           /**< groups kept per token */
    moecl_group_score group_score; /**< how a group is scored */
    moecl_group_fill group_fill;   /**< what becomes of dropped groups */
    bool renormalize;              /**< divide the weights by their sum */
    float renormalize_floor;       /**< with renormalize, the smallest divisor (0: moecl's rule) */
    float routed_scaling_factor;   /**< applied to the weights last */
    float renormalize_eps;         /**< with renormalize, divide by sum + eps (0: the floor's rule) */
} moecl_gating;

/**
 * What to compute. Valid requests: num_tokens >= 0, 1 <= hidden_dim <=
 * 65536, 1 <= num_experts <= 4096, 1 <= top_k <= min(num_experts, 64),
 * alpha finite, hidden_dtype, precision and logits_dtype one of their enum
 * values, logit_softcap 0 or a finite float >= FLT_MIN, and gating's
 * fields valid as moecl_topk_gating_desc's (the same rules and messages).
 * The order on g: router_logits + alpha * hidden @ ground^T, the rounding
 * to logits_dtype, the softcap, then the gating.
 */
typedef struct moecl_grounded_router_desc {
    uint32_t num_tokens;  /**< rows of token_hidden and router_logits */
    uint32_t hidden_dim;  /**< columns of token_hidden and expert_ground */
    uint32_t num_experts; /**< rows of expert_ground, columns of router_logits */
    uint32_t top_k;       /**< 2 in the seed reference */
    float alpha;          /**< weight of the hidden @ ground^T term */
    moecl_dtype hidden_dtype; /**< dtype of token_hidden and expert_ground */
    /** f32 hidden states only: fp32 (the default), TF32 or 3xTF32. */
    moecl_precision precision;
    /** How g becomes ids and weights. The default, the seed's: select on
     *  g itself (MOECL_SCORING_RAW), weights a softmax over the chosen g
     *  (MOECL_WEIGHTS_SOFTMAX_CHOSEN), no groups, no renormalisation,
     *  factor 1. */
    moecl_gating gating;
    /** g rounded to this type (to nearest, ties to even) before the
     *  gating, as a bf16 or f16 checkpoint's gate GEMM writes its output:
     *  MOECL_F32 (the default) keeps the fp32 g, MOECL_BF16 or MOECL_F16
     *  round it (f16: beyond 65504 to infinity). */
    moecl_dtype logits_dtype;
    /** > 0: g becomes logit_softcap * tanh(g / logit_softcap) after the
     *  rounding, before the gating (a logit cap). 0 (the default): none. */
    float logit_softcap;
    /** router_logits is one row, float[num_experts], added to every
     *  token's g: the gate's bias of a router GEMM (GPT-OSS). false (the
     *  default): float[num_tokens][num_experts], a row per token. Ignored
     *  where router_logits is absent (moecl_router). */
    bool router_logits_row;
    /** Element type of topk_weights: MOECL_F32 (the default), MOECL_F16
     *  or MOECL_BF16, rounded once as moecl_topk_gating_desc's
     *  weights_dtype is. out_pairs stays float. */
    moecl_dtype weights_dtype;
    /** Element type of topk_ids: MOECL_I32 (the default) or MOECL_I64.
     *  moecl_grounded_route_dispatch() takes MOECL_I32 only. */
    moecl_index_dtype ids_dtype;
    /** Element type of moecl_router()'s bias: MOECL_F32 (the default),
     *  MOECL_F16 or MOECL_BF16, widened to f32 exactly on load. */
    moecl_dtype bias_dtype;
    /** Shared experts appended to the routing output, as
     *  moecl_topk_gating_desc's num_shared_experts (docs/routing.md, §2
     *  "Shared experts" and §3): 0 (the default) none; S > 0: every row of
     *  out_pairs, topk_weights and topk_ids holds top_k + S slots, the
     *  routed top_k as without them, then slot top_k + j (j < S) with id
     *  num_experts + j and the weight shared_expert_weight *
     *  routed_scaling_factor (one fp32 product), or with
     *  moecl_router_tensors' shared_expert_gate sigmoid(dot(hidden,
     *  shared_expert_gate[j])). expert_counts and expert_load then have
     *  num_experts + S entries; captured_ids keeps the routed top_k;
     *  expert_scale does not apply to shared slots; a padding row is -1 / 0
     *  in every slot; moecl_grounded_route_dispatch() aligns top_k + S
     *  slots over num_experts + S experts. top_k + S <= 64. */
    uint32_t num_shared_experts;
    /** The constant weight of each shared slot before
     *  routed_scaling_factor: finite where num_shared_experts > 0 (also
     *  with a shared_expert_gate, which replaces it); 1.0 in
     *  moecl_grounded_router_desc_init(). */
    float shared_expert_weight;
} moecl_grounded_router_desc;

/** The seed reference op: top_k 2, f32 hidden states, fp32 products and
 *  the seed's gating (select on g, softmax over the chosen); f32 weights,
 *  int32 ids and an f32 bias. */
MOECL_API moecl_grounded_router_desc moecl_grounded_router_desc_init(uint32_t num_tokens, uint32_t hidden_dim,
                                                                     uint32_t num_experts, float alpha);

/**
 * Grounded router on device buffers: for each token,
 * g[e] = router_logits[e] + alpha * dot(token_hidden, expert_ground[e])
 * with fp32 accumulation, the top_k largest g (descending), and a softmax
 * over the chosen g values. Asynchronous, like moecl_topk_gating.
 *
 *   token_hidden   [num_tokens][hidden_dim] of hidden_dtype
 *   router_logits  float[num_tokens][num_experts]
 *   expert_ground  [num_experts][hidden_dim] of hidden_dtype
 *   out_pairs      float[num_tokens][top_k][2]: ((float)index, weight), or absent
 *   topk_weights   [num_tokens][top_k] of weights_dtype, or absent
 *   topk_ids       [num_tokens][top_k] of ids_dtype, or absent
 * At least one output must be given. With desc->num_shared_experts S > 0
 * every output row is top_k + S slots (the shared ones last).
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (as for moecl_topk_gating(), a
 * precision outside its enum, and all three outputs absent),
 * MOECL_ERROR_UNSUPPORTED (no kernel keeps a work-item within the driver's
 * loop limit, docs/devices.md: Mesa's rusticl at 4096 experts, top 64),
 * MOECL_ERROR_BUILD, the OpenCL error of a clSetKernelArg, or that of the
 * enqueue. On any failure nothing is
 * enqueued and no output byte changes.
 */
MOECL_API moecl_status moecl_grounded_router(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                             moecl_buffer token_hidden, moecl_buffer router_logits,
                                             moecl_buffer expert_ground, moecl_buffer out_pairs,
                                             moecl_buffer topk_weights, moecl_buffer topk_ids,
                                             cl_uint num_wait, const cl_event *wait, cl_event *done);

/** Blocking convenience on host memory; each output may be NULL, at least
 *  one must be given. topk_weights and topk_ids have the types desc names
 *  (float and int32_t by default). */
MOECL_API moecl_status moecl_grounded_router_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                                  const void *token_hidden, const float *router_logits,
                                                  const void *expert_ground, float *out_pairs,
                                                  void *topk_weights, void *topk_ids);

/** Build (or load from cache) the kernel variant desc needs. */
MOECL_API moecl_status moecl_grounded_router_prepare(moecl_context *ctx, const moecl_grounded_router_desc *desc);

/**
 * A router in one launch, from hidden states to ids and weights: the
 * grounded router's g with desc->gating's conventions and an optional
 * correction bias, which is what a model's router (DeepSeek-V3: hidden
 * 7168, 256 experts, sigmoid, bias, groups, renormalised, scaled) needs.
 * router_logits may be absent: then g = alpha * hidden @ ground^T, a plain
 * router GEMM with expert_ground as the gate's weight matrix.
 *
 *   token_hidden   [num_tokens][hidden_dim] of hidden_dtype
 *   router_logits  float[num_tokens][num_experts], or absent
 *   expert_ground  [num_experts][hidden_dim] of hidden_dtype
 *   bias           [num_experts] of bias_dtype, or absent: steers selection only
 *   topk_weights   [num_tokens][top_k] of weights_dtype, required
 *   topk_ids       [num_tokens][top_k] of ids_dtype, required
 * (top_k + num_shared_experts slots a row with shared experts).
 *
 * Asynchronous, with the errors of moecl_grounded_router(); on any
 * failure nothing is enqueued and no output byte changes. It is
 * moecl_router_ex() with these six tensors.
 */
MOECL_API moecl_status moecl_router(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                    moecl_buffer token_hidden, moecl_buffer router_logits,
                                    moecl_buffer expert_ground, moecl_buffer bias, moecl_buffer topk_weights,
                                    moecl_buffer topk_ids, cl_uint num_wait, const cl_event *wait, cl_event *done);

/** Blocking convenience of moecl_router() on host memory; router_logits
 *  and bias may be NULL. The tensors have the types desc names (a float
 *  bias, float weights and int32_t ids by default). Same validation as
 *  moecl_router(); moecl_router_ex_host() with these six tensors. */
MOECL_API moecl_status moecl_router_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                         const void *token_hidden, const float *router_logits,
                                         const void *expert_ground, const void *bias, void *topk_weights,
                                         void *topk_ids);

/**
 * The tensors of moecl_router_ex(), by name: moecl_router()'s six and
 * optional ones that only that call takes. Zero the record, set
 * struct_size to sizeof(moecl_router_tensors), then the tensors: an absent
 * one has mem NULL. A later moecl may append fields; a caller's
 * struct_size tells it which this record holds.
 */
typedef struct moecl_router_tensors {
    size_t struct_size;          /**< sizeof(moecl_router_tensors) */
    moecl_buffer token_hidden;   /**< [num_tokens][hidden_dim] of hidden_dtype, required */
    moecl_buffer router_logits;  /**< float[num_tokens][num_experts] (or one row), or absent */
    moecl_buffer expert_ground;  /**< [num_experts][hidden_dim] of hidden_dtype, required */
    moecl_buffer bias;           /**< [num_experts] of bias_dtype, or absent: steers selection only */
    moecl_buffer topk_weights;   /**< [num_tokens][top_k] of weights_dtype, output, required */
    moecl_buffer topk_ids;       /**< [num_tokens][top_k] of ids_dtype, output, required */
    /** int32_t[num_experts] (+ num_shared_experts), output, or absent:
     *  overwritten with the number of (token, slot) pairs routed to each
     *  expert (a fill, then the kernel), as moecl_topk_gating_tensors'
     *  expert_counts. */
    moecl_buffer expert_counts;
    /** int32_t[num_experts] (+ num_shared_experts), or absent: a load
     *  counter the call adds its counts to, in the same launch, and never
     *  zeroes (vLLM's and SGLang's expert-load statistics), as
     *  moecl_topk_gating_tensors' expert_load. */
    moecl_buffer expert_load;
    /** int32_t[1], or absent: the number n of rows that are tokens, read
     *  by the kernel when it runs (vLLM's is_padding, SGLang's
     *  num_token_non_padded). Rows t >= n (every row when n <= 0) are
     *  padding: ids -1, weights 0, captured -1, counted in neither
     *  expert_counts nor expert_load. */
    moecl_buffer num_valid_tokens;
    /** [num_tokens][top_k] of captured_ids_dtype, output, or absent: a copy
     *  of the routed ids the call writes to topk_ids (-1 for padding rows;
     *  never the shared slots), for
     *  routing replay (vLLM's and SGLang's routed-experts capture,
     *  Megatron's). */
    moecl_buffer captured_ids;
    /** The element type of captured_ids: MOECL_I32 (a zeroed record's),
     *  MOECL_I16 (the capture buffers' usual type; ids up to 4096 fit) or
     *  MOECL_I64. Checked even where captured_ids is absent. */
    moecl_index_dtype captured_ids_dtype;
    /** float[num_experts], or absent: a weight per expert. The final
     *  weight of a chosen expert e, after the renormalisation and
     *  routed_scaling_factor, is multiplied by expert_scale[e] (in f32,
     *  before the rounding to weights_dtype): Gemma 4's per_expert_scale,
     *  as transformers' Gemma4TextRouter applies it. Padding rows stay 0. */
    moecl_buffer expert_scale;
    /** [num_shared_experts][hidden_dim] of hidden_dtype, or absent: a
     *  per-token gate of the shared experts (Qwen2-MoE's, Qwen3-Next's and
     *  Qwen3.5-MoE's shared_expert_gate weight). Shared slot j of token t
     *  then weighs sigmoid(dot(token_hidden[t], shared_expert_gate[j])),
     *  the dot product in f32 by ascending hidden index, without
     *  routed_scaling_factor or expert_scale (docs/routing.md, §3). Needs
     *  num_shared_experts > 0. Added in the record's second version. */
    moecl_buffer shared_expert_gate;
} moecl_router_tensors;

/**
 * moecl_router() with the optional tensors of moecl_router_tensors, in
 * one launch (with expert_counts, a fill first). Given only moecl_router()'s
 * six, it writes what moecl_router() writes, bit for bit; every kernel
 * (rows, team, tiled, tensor-core) takes every option, and the options
 * absent cost nothing (their kernels are separate variants). Asynchronous;
 * `done`, if non-NULL, receives the kernel's event (with num_tokens 0,
 * the fill's or a marker). Errors: those of moecl_router(), and
 * MOECL_ERROR_INVALID_ARGUMENT for a NULL tensors, a struct_size this
 * moecl does not know (the first version's, through expert_scale, or
 * today's, through shared_expert_gate), captured_ids_dtype not a
 * moecl_index_dtype, a shared_expert_gate without num_shared_experts, and
 * an optional tensor too small, misaligned or of another context. On any failure nothing is
 * enqueued and no output byte changes, unless the kernel's enqueue fails
 * after the counts' fill: then expert_counts is unspecified and every
 * other output unchanged.
 */
MOECL_API moecl_status moecl_router_ex(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                       const moecl_router_tensors *tensors, cl_uint num_wait, const cl_event *wait,
                                       cl_event *done);

/** The host-memory tensors of moecl_router_ex_host(), as
 *  moecl_router_tensors's; an absent one is NULL. */
typedef struct moecl_router_host_tensors {
    size_t struct_size;               /**< sizeof(moecl_router_host_tensors) */
    const void *token_hidden;         /**< required (may be NULL when num_tokens is 0) */
    const float *router_logits;       /**< or NULL */
    const void *expert_ground;        /**< required (as token_hidden) */
    const void *bias;                 /**< of bias_dtype, or NULL */
    void *topk_weights;               /**< of weights_dtype, output, required (as token_hidden) */
    void *topk_ids;                   /**< of ids_dtype, output, required (as token_hidden) */
    int32_t *expert_counts;           /**< output, or NULL */
    int32_t *expert_load;             /**< read, added to and written back, or NULL */
    const int32_t *num_valid_tokens;  /**< one int32, or NULL */
    void *captured_ids;               /**< of captured_ids_dtype, output, or NULL */
    moecl_index_dtype captured_ids_dtype; /**< as moecl_router_tensors' */
    const float *expert_scale;        /**< or NULL */
    const void *shared_expert_gate;   /**< of hidden_dtype, or NULL (second version) */
} moecl_router_host_tensors;

/** Blocking convenience of moecl_router_ex() on host memory: copies in
 *  (expert_load too), runs, copies out (expert_load too). Same validation.
 *  A failed enqueue leaves every host output unchanged; only a failed copy
 *  back may have written them. With num_tokens 0, expert_counts is zeroed
 *  and expert_load unchanged. */
MOECL_API moecl_status moecl_router_ex_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                            const moecl_router_host_tensors *tensors);

/* ---------------------------------------------------------------------- */
/* Named presets (docs/routing.md, section 10)                             */
/* ---------------------------------------------------------------------- */

/**
 * Fill *desc with the routing convention and the shape of a model family's
 * flagship checkpoint: num_experts, top_k and the gating fields, from the
 * checkpoint's config.json and the routing of Hugging Face transformers'
 * modeling file for it (docs/routing.md, section 10, cites each). The other
 * fields are moecl_topk_gating_desc_init()'s: num_tokens as given,
 * gating_dtype MOECL_F32 (set it to the logits' type), renormalize_floor 0.
 * eps is renormalize_eps: those models divide by the sum + 1e-20.
 * Every preset is a valid descriptor. Names are matched exactly
 * (lower case, hyphens); moecl_preset_name() lists them. The presets:
 *
 * | family        | E   | k  | scoring      | weighting      | groups (G, Kg, score, fill) | renormalize | factor | eps   |
 * |---------------|-----|----|--------------|----------------|-----------------------------|-------------|--------|-------|
 * | "mixtral"     | 8   | 2  | SOFTMAX      | SCORE          | none                        | yes         | 1      | 0     |
 * | "qwen3-moe"   | 128 | 8  | SOFTMAX      | SCORE          | none                        | yes         | 1      | 0     |
 * | "qwen3-next"  | 512 | 10 | SOFTMAX      | SCORE          | none                        | yes         | 1      | 0     |
 * | "deepseek-v2" | 160 | 6  | SOFTMAX      | SCORE          | 8, 3, MAX, ZERO             | no          | 16     | 0     |
 * | "deepseek-v3" | 256 | 8  | SIGMOID      | SCORE          | 8, 4, TOP2_SUM, ZERO        | yes         | 2.5    | 1e-20 |
 * | "deepseek-v4" | 384 | 6  | SQRTSOFTPLUS | SCORE          | none                        | yes         | 2.5    | 1e-20 |
 * | "llama4"      | 128 | 1  | RAW          | SIGMOID_CHOSEN | none                        | no          | 1      | 0     |
 * | "gpt-oss"     | 128 | 4  | RAW          | SOFTMAX_CHOSEN | none                        | no          | 1      | 0     |
 * | "glm-4.5"     | 160 | 8  | SIGMOID      | SCORE          | none                        | yes         | 2.5    | 1e-20 |
 * | "kimi-k2"     | 384 | 8  | SIGMOID      | SCORE          | none                        | yes         | 2.827  | 1e-20 |
 * | "minimax-m2"  | 256 | 8  | SIGMOID      | SCORE          | none                        | yes         | 1      | 0     |
 * | "gemma4"      | 128 | 8  | SOFTMAX      | SCORE          | none                        | yes         | 1      | 0     |
 * | "olmoe"       | 64  | 8  | SOFTMAX      | SCORE          | none                        | no          | 1      | 0     |
 *
 * "none": num_expert_groups and topk_group 0, group_score MAX, group_fill
 * NEG_INF (ignored without groups). DeepSeek-V3, DeepSeek-V4, GLM-4.5,
 * Kimi K2 and MiniMax-M2 select with their e_score_correction_bias: pass
 * it as the call's bias. What a preset does not hold (a shared expert, a
 * per-expert scale, hash layers, the gate's rounding to bf16) is listed
 * in docs/routing.md, section 10.
 *
 * @param family     the preset's name, e.g. "deepseek-v3"
 * @param num_tokens the descriptor's num_tokens
 * @param desc       receives the descriptor; unchanged on failure
 * @return MOECL_SUCCESS, or MOECL_ERROR_INVALID_ARGUMENT for a NULL family
 *         or desc or a name that is no preset; then
 *         moecl_context_error(NULL) says which, for an unknown name with
 *         every preset's name. Thread-safe.
 */
MOECL_API moecl_status moecl_topk_gating_desc_preset(const char *family, uint32_t num_tokens,
                                                     moecl_topk_gating_desc *desc);

/**
 * The same preset for the router from hidden states (moecl_router(),
 * moecl_grounded_router()): *desc becomes
 * moecl_grounded_router_desc_init(num_tokens, H, E, 1.0f) with top_k k and
 * gating the preset's fields (the table of
 * moecl_topk_gating_desc_preset(), field for field: moecl_gating holds the
 * same names), where H is the checkpoint's hidden_size: mixtral 4096,
 * qwen3-moe 4096, qwen3-next 2048, deepseek-v2 5120, deepseek-v3 7168,
 * deepseek-v4 7168, llama4 5120, gpt-oss 2880, glm-4.5 5120, kimi-k2 7168,
 * minimax-m2 3072, gemma4 2816, olmoe 2048. alpha 1 makes g the gate's
 * product, expert_ground the gate's weight [E][H]; hidden_dtype is MOECL_F32
 * (set it to the tensors' type) and precision MOECL_PRECISION_FP32.
 *
 * @param family     the preset's name
 * @param num_tokens the descriptor's num_tokens
 * @param desc       receives the descriptor; unchanged on failure
 * @return as moecl_topk_gating_desc_preset(). Thread-safe.
 */
MOECL_API moecl_status moecl_grounded_router_desc_preset(const char *family, uint32_t num_tokens,
                                                         moecl_grounded_router_desc *desc);

/** The name of preset i (from 0), a static string, or NULL for i past the
 *  last: `for (size_t i = 0; moecl_preset_name(i); i++)` lists them, in the
 *  order of moecl_topk_gating_desc_preset()'s table. Thread-safe. */
MOECL_API const char *moecl_preset_name(size_t i);

/* ---------------------------------------------------------------------- */
/* Dispatch: moe_align (docs/routing.md, "Dispatch: moe_align")            */
/* ---------------------------------------------------------------------- */

/**
 * What to align. Valid requests: 1 <= num_experts <= 4096,
 * 1 <= block_size <= 1024, 1 <= top_k <= 64 (top_k may exceed num_experts:
 * ids are not required to be distinct), and num_tokens * top_k +
 * num_experts * (block_size - 1) <= INT32_MAX (so that every position and
 * the sentinel fit in int32). num_tokens == 0 is valid and writes the
 * outputs of an empty routing (see moecl_moe_align()).
 */
typedef struct moecl_moe_align_desc {
    uint32_t num_tokens;  /**< rows of topk_ids */
    uint32_t top_k;       /**< columns of topk_ids (slots per token) */
    uint32_t num_experts; /**< ids in [0, num_experts) are routed; others are skipped */
    uint32_t block_size;  /**< each expert's run is padded to a multiple of this */
    /** Expert parallelism: 0 (the default), ids are experts of this
     *  call; otherwise ids are global expert ids in [0, num_global_experts)
     *  and moecl_moe_align_ex()'s expert_map, of that many entries, maps
     *  each to its local expert in [0, num_experts) or to -1 where the
     *  expert is on another rank (vLLM's expert_map). Needs expert_map. */
    uint32_t num_global_experts;
} moecl_moe_align_desc;

/** A descriptor with the four sizes and every other field at its default
 *  (num_global_experts 0: no expert map); future fields will default to
 *  today's behaviour here. */
MOECL_API moecl_moe_align_desc moecl_moe_align_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t num_experts,
                                                         uint32_t block_size);

/** The length of sorted_token_ids for desc: num_tokens * top_k +
 *  num_experts * (block_size - 1). The length of block_expert_ids is this
 *  divided by block_size (rounded down). 0 when desc is NULL. Computed in
 *  64 bits, so it is exact even for descriptors moecl_moe_align()
 *  rejects. */
MOECL_API uint64_t moecl_moe_align_max_padded(const moecl_moe_align_desc *desc);

/**
 * Sort the slots of a routing by expert, for grouped expert GEMMs
 * (vLLM's moe_align_block_size). Slot s = t * top_k + j is topk_ids[t][j].
 * With max_padded = moecl_moe_align_max_padded(desc), num_blocks =
 * max_padded / block_size and the sentinel num_tokens * top_k:
 *
 *   topk_ids               int32_t[num_tokens][top_k], input
 *   expert_counts          int32_t[num_experts]: valid slots routed to
 *                          each expert
 *   sorted_token_ids       int32_t[max_padded]: the slots grouped by
 *                          expert in increasing expert order, increasing
 *                          slot order within an expert (stable); expert
 *                          e's run starts at a multiple of block_size and
 *                          is padded with the sentinel to
 *                          round_up(expert_counts[e], block_size); every
 *                          entry from num_tokens_post_padded on is the
 *                          sentinel
 *   block_expert_ids       int32_t[num_blocks]: the expert of each block of
 *                          block_size entries of sorted_token_ids; -1 for
 *                          the blocks from num_tokens_post_padded on
 *   num_tokens_post_padded int32_t[1]: the sum of the padded runs
 *   slot_positions         int32_t[num_tokens][top_k], or absent: where
 *                          each slot landed in sorted_token_ids (-1 for a
 *                          skipped slot), so that
 *                          sorted_token_ids[slot_positions[s]] == s
 *   num_invalid            int32_t[1], or absent: slots skipped because
 *                          their id is outside [0, num_experts) (a
 *                          runtime's padding rows often carry -1)
 *
 * With an expert map (desc->num_global_experts > 0, moecl_moe_align_ex()
 * only) the ids are global and every output above is in local ids; see
 * moecl_moe_align_ex() for which slots are skipped and which counted.
 * Experts with no slots have an empty run and no block. The result is
 * unique (the stable order fixes it), so every device returns the same
 * bits. num_tokens == 0 writes that empty result: counts 0,
 * num_tokens_post_padded 0, every sorted_token_ids entry the sentinel 0,
 * every block -1, num_invalid 0.
 *
 * Asynchronous: validates, then enqueues the kernels on the context's
 * queue and returns. One of four paths, which moecl chooses for the size
 * and the device (docs/routing.md §7); all four give the same bits:
 *   - the fused kernel, one launch: every work-group counts and ranks its
 *     chunk of slots, then takes a ticket with atomic_inc on a global
 *     counter; the work-group that takes the last ticket scans the
 *     counts, writes every output and puts the counter back to 0. No
 *     work-group ever waits for another, so it needs no concurrency
 *     between work-groups.
 *     Every word one work-group passes to another is written and read
 *     with OpenCL 1.2 global atomics. It assumes of the device what
 *     OpenCL 1.2 does not promise in words: that a work-item's atomics,
 *     followed by mem_fence(CLK_GLOBAL_MEM_FENCE) and a work-group
 *     barrier, are seen by another work-group of the same kernel once it
 *     has seen the result of the atomic_inc made after them (the order of
 *     atomics on different words). pocl, Intel's CPU runtime and oclgrind
 *     give the exact results with it, and so did NVIDIA's OpenCL on the
 *     H200 (the moe_align suites); cl/moe_align.cl says more;
 *   - the parallel fused kernel, one launch: every work-group counts
 *     every slot, so that it knows each expert's start and how many of
 *     each expert's slots come before its own chunk, then places its own
 *     chunk and a share of the padding and blocks. Nothing passes between
 *     work-groups (no counter, no scratch buffer, no global atomics), so
 *     it assumes nothing of the device beyond OpenCL 1.2; each work-group
 *     reads every id, so it suits decode-sized routings;
 *   - one kernel in one work-group;
 *   - three kernels (count, scan, scatter; the count is skipped when
 *     num_tokens == 0), at any size.
 * A path runs only where the device's work-group limit and local memory
 * allow it; the three kernels run everywhere.
 * The first command waits on the `num_wait` events of `wait`; on an
 * out-of-order queue each later one waits on its predecessor's event. If
 * `done` is non-NULL it receives the event of the last kernel, which
 * completes after all of them; the caller releases it. The three-kernel
 * path needs a device scratch buffer of about 4 * (num_tokens * top_k +
 * 3 * num_experts) bytes, the fused one of at most about 4 * (3 *
 * num_tokens * top_k + 2 * num_experts) (its counter is the first word),
 * the one-group and the parallel fused kernel none:
 * on an in-order queue the context keeps one,
 * grown as needed and reused (calls from several threads take turns while
 * enqueueing, and the queue runs their kernels one call after another);
 * on an out-of-order queue each call creates its own and releases it once
 * the kernels are enqueued (OpenCL keeps it until they finish). The fused
 * path zeroes the counter with clEnqueueFillBuffer before its kernel
 * where the buffer is new or the three-kernel path used it last (every
 * call on an out-of-order queue). The context's buffer is freed by
 * moecl_context_destroy.
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (a descriptor field out of range,
 * num_global_experts not 0 (this call takes no expert map: see
 * moecl_moe_align_ex()),
 * NULL ctx/desc, a missing required buffer, a buffer too small, an
 * unaligned offset, a buffer of another context, num_wait > 0 with wait
 * NULL), MOECL_ERROR_BUILD, or an OpenCL error: of the scratch buffer's
 * allocation, of a clSetKernelArg, CL_INVALID_WORK_GROUP_SIZE (a kernel's
 * limit on this device is below its work-group), or of an enqueue. All of
 * these but an enqueue after the first are found before anything is
 * enqueued: nothing is enqueued and no output byte changes (the one-group
 * and the parallel fused kernel enqueue one command). On the fused
 * path, if the kernel's enqueue fails after the counter's fill, only the
 * scratch buffer changed. On the three-kernel path a later enqueue can
 * fail: if the scan's does, only
 * the count kernel was enqueued, which writes nothing but the scratch
 * buffer, so no output changes; if the scatter's does, the count and the
 * scan were, and expert_counts, num_tokens_post_padded and num_invalid
 * are unspecified while sorted_token_ids, block_expert_ids and
 * slot_positions are unchanged. The call then waits for what it enqueued
 * before it returns the error: for the last enqueued kernel's event on an
 * out-of-order queue (each kernel waits on the one before), and with
 * clFinish() on an in-order queue, which also waits for everything queued
 * there before.
 */
MOECL_API moecl_status moecl_moe_align(moecl_context *ctx, const moecl_moe_align_desc *desc, moecl_buffer topk_ids,
                                       moecl_buffer expert_counts, moecl_buffer sorted_token_ids,
                                       moecl_buffer block_expert_ids, moecl_buffer num_tokens_post_padded,
                                       moecl_buffer slot_positions, moecl_buffer num_invalid, cl_uint num_wait,
                                       const cl_event *wait, cl_event *done);

/** Blocking convenience on host memory: copies in, runs, copies out. The
 *  outputs are as moecl_moe_align() describes; slot_positions and
 *  num_invalid may be NULL, the others are required (topk_ids may be NULL
 *  only when num_tokens is 0). Same validation as moecl_moe_align(). The
 *  device buffers are the call's own, so a failed enqueue leaves every
 *  host output unchanged; only a failed copy back may have written them
 *  (see "What a failed call leaves" above). */
MOECL_API moecl_status moecl_moe_align_host(moecl_context *ctx, const moecl_moe_align_desc *desc,
                                            const int32_t *topk_ids, int32_t *expert_counts,
                                            int32_t *sorted_token_ids, int32_t *block_expert_ids,
                                            int32_t *num_tokens_post_padded, int32_t *slot_positions,
                                            int32_t *num_invalid);

/** The buffers of moecl_moe_align_ex(), by name. Zero the record, set
 *  struct_size to sizeof(moecl_moe_align_tensors), then the buffers: an
 *  absent one has mem NULL. A later moecl may append fields; a caller's
 *  struct_size tells it which this record holds. */
typedef struct moecl_moe_align_tensors {
    size_t struct_size;                  /**< sizeof(moecl_moe_align_tensors) */
    moecl_buffer topk_ids;               /**< int32_t[num_tokens][top_k], input */
    moecl_buffer expert_counts;          /**< int32_t[num_experts], output */
    moecl_buffer sorted_token_ids;       /**< int32_t[max_padded], output */
    moecl_buffer block_expert_ids;       /**< int32_t[max_padded / block_size], output */
    moecl_buffer num_tokens_post_padded; /**< int32_t[1], output */
    moecl_buffer slot_positions;         /**< int32_t[num_tokens][top_k], output, optional */
    moecl_buffer num_invalid;            /**< int32_t[1], output, optional */
    moecl_buffer expert_map;             /**< int32_t[num_global_experts], input; required iff
                                              desc->num_global_experts > 0 */
} moecl_moe_align_tensors;

/**
 * moecl_moe_align() with its buffers in a struct, and with expert
 * parallelism: where desc->num_global_experts is G > 0, each rank aligns
 * only the slots of its own experts (vLLM's moe_align_block_size with
 * expert_map; aiter and vllm-xpu-kernels take the same table). topk_ids
 * then holds global ids, and expert_map (int32_t[G], a device buffer
 * read by the kernels) gives for global expert g its local expert
 * expert_map[g] in [0, num_experts), or -1 where g is on another rank.
 * A slot with global id g is:
 *   - aligned as local expert expert_map[g] where g is in [0, G) and
 *     expert_map[g] in [0, num_experts): expert_counts, sorted_token_ids
 *     and block_expert_ids hold local ids, exactly the result of
 *     moecl_moe_align() on the mapped ids;
 *   - skipped, and not counted, where g is in [0, G) and expert_map[g] is
 *     -1 (a remote expert: most slots of a rank under expert parallelism;
 *     its slot_positions entry is -1);
 *   - skipped and counted in num_invalid where g is outside [0, G)
 *     (padding rows' -1) or expert_map[g] is neither -1 nor in
 *     [0, num_experts) (a bad map entry, so that one shows up there).
 * The sentinel stays num_tokens * top_k (all slots, as vLLM's) and the
 * lengths are those of moecl_moe_align_max_padded(desc), which bound any
 * map. G = 0 is moecl_moe_align() exactly (expert_map must be absent);
 * moecl_moe_align() is this call with the tensors passed by name.
 *
 * The map is read where each id is read, by every path, in the same
 * launches; the map's kernels are built apart from the kernels without
 * one (a define), so calls without a map run exactly the kernels
 * moecl_moe_align() runs. Paths, events, the scratch buffer and what a
 * failed call leaves are moecl_moe_align()'s.
 *
 * Errors: those of moecl_moe_align(), and MOECL_ERROR_INVALID_ARGUMENT
 * for a NULL tensors, a struct_size this moecl does not know (today's
 * record, which ends at expert_map, is its first version), an expert_map
 * without num_global_experts or num_global_experts without an
 * expert_map, an expert_map smaller than num_global_experts entries.
 * Nothing is enqueued and no output byte changes for any of them.
 */
MOECL_API moecl_status moecl_moe_align_ex(moecl_context *ctx, const moecl_moe_align_desc *desc,
                                          const moecl_moe_align_tensors *tensors, cl_uint num_wait,
                                          const cl_event *wait, cl_event *done);

/** The host-memory arrays of moecl_moe_align_ex_host(), by name; struct_size
 *  as in moecl_moe_align_tensors, absent arrays NULL. */
typedef struct moecl_moe_align_host_tensors {
    size_t struct_size;              /**< sizeof(moecl_moe_align_host_tensors) */
    const int32_t *topk_ids;         /**< input; NULL only when num_tokens is 0 */
    int32_t *expert_counts;          /**< output */
    int32_t *sorted_token_ids;       /**< output; NULL only when it has no element */
    int32_t *block_expert_ids;       /**< output; NULL only when it has no element */
    int32_t *num_tokens_post_padded; /**< output */
    int32_t *slot_positions;         /**< output, optional */
    int32_t *num_invalid;            /**< output, optional */
    const int32_t *expert_map;       /**< input; required iff desc->num_global_experts > 0 */
} moecl_moe_align_host_tensors;

/** Blocking convenience of moecl_moe_align_ex() on host memory: copies
 *  in, runs, copies out, as moecl_moe_align_host() does (which is this
 *  call with the arrays passed by name). Same validation as
 *  moecl_moe_align_ex(); what a failed call leaves as
 *  moecl_moe_align_host(). */
MOECL_API moecl_status moecl_moe_align_ex_host(moecl_context *ctx, const moecl_moe_align_desc *desc,
                                               const moecl_moe_align_host_tensors *tensors);

/** Build (or load from the disk cache) the kernels moe_align needs, ahead
 *  of the first call (with desc->num_global_experts > 0, the expert map's
 *  kernels). Validates desc as the call does. */
MOECL_API moecl_status moecl_moe_align_prepare(moecl_context *ctx, const moecl_moe_align_desc *desc);

/* ---------------------------------------------------------------------- */
/* Expert-parallel dispatch layout (docs/routing.md, "Expert-parallel      */
/* dispatch layout")                                                       */
/* ---------------------------------------------------------------------- */

/**
 * What to lay out for an all-to-all. Valid requests: 1 <= top_k <= 64,
 * 1 <= num_experts <= 4096, num_experts <= num_physical <= 16384,
 * 1 <= num_ranks <= 1024, 1 <= max_replicas <= 64 (1 when
 * logical_to_physical is absent), num_tokens * top_k <= INT32_MAX.
 * num_tokens == 0 is valid and writes the outputs of an empty routing.
 */
typedef struct moecl_ep_layout_desc {
    uint32_t num_tokens;   /**< rows of topk_ids */
    uint32_t top_k;        /**< columns of topk_ids */
    uint32_t num_experts;  /**< logical experts: the range of topk_ids */
    uint32_t num_physical; /**< physical experts (replicas included); num_experts without replicas */
    uint32_t num_ranks;    /**< destination ranks */
    uint32_t max_replicas; /**< columns of logical_to_physical; 1 without replicas */
} moecl_ep_layout_desc;

/** A descriptor without replicas: num_physical = num_experts,
 *  max_replicas = 1. Set num_physical and max_replicas for a map. */
MOECL_API moecl_ep_layout_desc moecl_ep_layout_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t num_experts,
                                                         uint32_t num_ranks);

/**
 * The layout of an expert-parallel dispatch (DeepEP's get_dispatch_layout,
 * with vLLM's EPLB replicas): where each (token, slot) goes, in which order
 * it is sent, and what each rank receives. Slot s = t * top_k + j is
 * topk_ids[t][j], a logical expert.
 *
 *   topk_ids            int32_t[num_tokens][top_k], input: logical ids
 *   logical_to_physical int32_t[num_experts][max_replicas], input, or
 *                       absent: the identity (then num_physical must equal
 *                       num_experts and max_replicas be 1)
 *   replica_counts      int32_t[num_experts], input: the replicas of each
 *                       logical expert, 1..max_replicas; absent iff
 *                       logical_to_physical is
 *   physical_to_rank    int32_t[num_physical], input, or absent: contiguous
 *                       blocks, physical expert p on rank
 *                       p / (num_physical / num_ranks) (then num_physical %
 *                       num_ranks must be 0)
 *   physical_ids        int32_t[num_tokens][top_k]: each slot's physical
 *                       expert, -1 for a slot that is not sent
 *   rank_counts         int32_t[num_ranks]: slots sent to each rank
 *   rank_offsets        int32_t[num_ranks + 1]: exclusive prefix sums of
 *                       rank_counts; rank_offsets[num_ranks] is the number
 *                       of slots sent
 *   send_slots          int32_t[num_tokens * top_k]: the flat indices s of
 *                       the sent slots grouped by destination rank in
 *                       increasing rank order, increasing s within a rank
 *                       (stable); rank r's run is
 *                       [rank_offsets[r], rank_offsets[r + 1]); every entry
 *                       from rank_offsets[num_ranks] on is -1
 *   token_in_rank       uint8_t[num_tokens][num_ranks], or absent: 1 where
 *                       the token has at least one sent slot on the rank,
 *                       else 0 (DeepEP's is_token_in_rank: a token is sent
 *                       once per rank, whatever the number of its experts
 *                       there)
 *   tokens_per_rank     int32_t[num_ranks], or absent: the tokens with at
 *                       least one sent slot on each rank (the column sums
 *                       of token_in_rank)
 *   expert_counts       int32_t[num_physical], or absent: sent slots per
 *                       physical expert (on the receiving rank, the counts
 *                       of its local experts)
 *
 * The replica of a slot (docs/routing.md states why this rule): with
 * c = replica_counts[e] for its logical id e, replica
 * i = ((uint32_t)t * 2654435761u) % c, computed in 32-bit unsigned
 * arithmetic, a hash of the token index t (as vLLM's EPLB selects by
 * token position rather than at random); the physical expert is
 * logical_to_physical[e][i]. Without a map the physical expert is e.
 * The tables are device data and are read only where they are in range:
 * a slot is not sent (physical_ids -1, counted nowhere, its token not
 * flagged for it) when its id is outside [0, num_experts) (a runtime's
 * masked slots carry -1), when replica_counts[e] is outside
 * [1, max_replicas], when the chosen logical_to_physical entry is outside
 * [0, num_physical), or when physical_to_rank of its physical expert is
 * outside [0, num_ranks). The tables are kernel arguments, not build
 * options: a changed map needs no new build. The result is unique, so
 * every device returns the same bits. num_tokens == 0 writes rank_counts,
 * rank_offsets, tokens_per_rank and expert_counts 0 and nothing else (the
 * other outputs have no element).
 *
 * Asynchronous: validates, then enqueues its kernels on the context's
 * queue and returns. Two paths, which moecl chooses for the device and
 * the shape (docs/routing.md §9), the same bits:
 *   - the fused kernel, one launch (where the device's work-group limit
 *     and local memory allow it for num_ranks and top_k): preceded, where
 *     the scratch buffer is new or another path wrote its first word
 *     last, by a fill of that word. It
 *     uses a scratch buffer of 4 * (1 + G * (3 * num_ranks + 2 + P') +
 *     num_ranks + 1) bytes, G <= 127 work-groups, P' = num_physical with
 *     expert_counts, else 0;
 *   - three chained kernels (count, scan, place; the count and the place
 *     are skipped when num_tokens is 0), at any shape, with a scratch
 *     buffer of 4 * (chunks * (2 * num_ranks + 1) + num_ranks + 1 +
 *     num_tokens * top_k) bytes, where chunks <= 4096.
 * The first command waits on the `num_wait` events of `wait`; on an
 * out-of-order queue each later one waits on its predecessor's event. If
 * `done` is non-NULL it receives the event of the last kernel, which
 * completes after all of them; the caller releases it. The scratch buffer
 * is the context's on an in-order queue, as moecl_moe_align() describes,
 * and the call's own on an out-of-order queue.
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (a descriptor field out of range,
 * NULL ctx/desc, a missing required buffer, logical_to_physical given
 * without replica_counts or the reverse, a map with num_physical !=
 * num_experts or max_replicas != 1 absent, num_physical % num_ranks != 0
 * without physical_to_rank, a buffer too small, an unaligned offset, a
 * buffer of another context, num_wait > 0 with wait NULL),
 * MOECL_ERROR_BUILD, or an OpenCL error: of the scratch buffer's
 * allocation, of a clSetKernelArg, CL_INVALID_WORK_GROUP_SIZE, or of an
 * enqueue. All of these but an enqueue after the first are found before
 * anything is enqueued: nothing is enqueued and no output byte changes.
 * On the fused path the fill writes only the scratch buffer, so a failed
 * kernel enqueue after it leaves every output unchanged too. On the three
 * kernels, if the scan's enqueue fails, only the count was enqueued, which writes
 * physical_ids and token_in_rank (then unspecified) and the scratch
 * buffer; if the place's does, rank_counts, rank_offsets, tokens_per_rank
 * and expert_counts are unspecified too, and send_slots is unchanged. The
 * call then waits for what it enqueued before it returns the error (the
 * last enqueued kernel's event on an out-of-order queue, clFinish() on an
 * in-order one).
 */
MOECL_API moecl_status moecl_ep_layout(moecl_context *ctx, const moecl_ep_layout_desc *desc, moecl_buffer topk_ids,
                                       moecl_buffer logical_to_physical, moecl_buffer replica_counts,
                                       moecl_buffer physical_to_rank, moecl_buffer physical_ids,
                                       moecl_buffer rank_counts, moecl_buffer rank_offsets, moecl_buffer send_slots,
                                       moecl_buffer token_in_rank, moecl_buffer tokens_per_rank,
                                       moecl_buffer expert_counts, cl_uint num_wait, const cl_event *wait,
                                       cl_event *done);

/** Blocking convenience on host memory: copies in, runs, copies out. The
 *  outputs are as moecl_ep_layout() describes; logical_to_physical,
 *  replica_counts, physical_to_rank, token_in_rank, tokens_per_rank and
 *  expert_counts may be NULL as their buffers may be absent; the others
 *  are required (topk_ids, physical_ids and send_slots may be NULL only
 *  when num_tokens is 0). Same validation as moecl_ep_layout(). The device
 *  buffers are the call's own, so a failed enqueue leaves every host
 *  output unchanged; only a failed copy back may have written them (see
 *  "What a failed call leaves" above). */
MOECL_API moecl_status moecl_ep_layout_host(moecl_context *ctx, const moecl_ep_layout_desc *desc,
                                            const int32_t *topk_ids, const int32_t *logical_to_physical,
                                            const int32_t *replica_counts, const int32_t *physical_to_rank,
                                            int32_t *physical_ids, int32_t *rank_counts, int32_t *rank_offsets,
                                            int32_t *send_slots, uint8_t *token_in_rank, int32_t *tokens_per_rank,
                                            int32_t *expert_counts);

/** Build (or load from the disk cache) the kernels the layout needs, ahead
 *  of the first call. Validates desc as the call does (without buffers). */
MOECL_API moecl_status moecl_ep_layout_prepare(moecl_context *ctx, const moecl_ep_layout_desc *desc);

/* ---------------------------------------------------------------------- */
/* Routing through to dispatch (docs/routing.md, "Routing through to       */
/* dispatch")                                                              */
/* ---------------------------------------------------------------------- */

/**
 * Top-k gating followed by moe_align on its topk_ids, in one call: from
 * logits to the dispatch of a grouped expert GEMM. The outputs are
 * exactly those of moecl_topk_gating(ctx, desc, gating, bias,
 * topk_weights, topk_ids, ...) followed by moecl_moe_align() with
 * moecl_moe_align_desc_init(desc->num_tokens, desc->top_k,
 * desc->num_experts, block_size) on those topk_ids, bit for bit, on the
 * same device (the same kernels run):
 *
 *   gating, bias, topk_weights, topk_ids   as moecl_topk_gating()
 *   expert_counts, sorted_token_ids, block_expert_ids,
 *   num_tokens_post_padded, slot_positions (or absent),
 *   num_invalid (or absent)                as moecl_moe_align(); the ids of
 *                                          a routing are always in range,
 *                                          so num_invalid is 0
 *
 * Every convention of top-k gating is accepted (desc as for
 * moecl_topk_gating(), with any weights_dtype and bias_dtype; ids_dtype
 * must be MOECL_I32, which moe_align reads, else
 * MOECL_ERROR_INVALID_ARGUMENT); block_size as moecl_moe_align_desc's, and
 * num_tokens * top_k + num_experts * (block_size - 1) <= INT32_MAX.
 * num_tokens == 0 writes moe_align's empty result and no top-k output.
 * With shared experts (desc->num_shared_experts S > 0), top_k and
 * num_experts read top_k + S and num_experts + S throughout: the rows of
 * topk_weights and topk_ids, expert_counts, and moe_align's descriptor.
 *
 * Asynchronous. One of two paths, which moecl chooses for the size and the
 * device (docs/routing.md §8); both give the same bits:
 *   - one kernel, where top-k runs its team kernel, num_tokens >= 1, the
 *     slots are few enough and the device's work-group limit and local
 *     memory allow it: each work-group routes its rows, writes them, then
 *     counts and ranks their ids as moecl_moe_align()'s fused kernel
 *     counts a chunk, takes a ticket, and the last work-group writes
 *     every dispatch output. It assumes of the device what that fused
 *     kernel does (see moecl_moe_align()), and also passes each slot's
 *     expert to the last work-group through an atomic (one word with its
 *     rank). Preceded by a fill
 *     of its ticket where moe_align's fused path would need one, under the
 *     same conditions. Its last work-group places every slot with all its
 *     work-items (each slot's rank in its chunk stored by the work-group
 *     that routed it); moe_align's parallel fused kernel does not apply,
 *     since no other work-group can read every id this launch writes;
 *   - otherwise two calls' commands: top-k gating's kernel (none when
 *     num_tokens is 0), then moe_align's path as moecl_moe_align()
 *     chooses it; on an out-of-order queue moe_align's first command
 *     waits on the top-k kernel's event.
 * The first command waits on the `num_wait` events of `wait`. `done`, if
 * non-NULL, receives the event of the last command, which completes after
 * all of them. Both paths use the context's scratch buffer as
 * moecl_moe_align() describes; the one kernel needs about 4 * (1 + 2 *
 * groups * (num_experts + 1) + num_tokens * top_k) bytes of it, where
 * groups is the number of its work-groups.
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (any field of either descriptor, a
 * NULL ctx/desc, a missing required buffer, a buffer too small, an
 * unaligned offset, a buffer of another context, num_wait > 0 with wait
 * NULL), MOECL_ERROR_BUILD, or an OpenCL error. All the descriptor and
 * buffer checks of both steps, and the builds of both steps' kernels,
 * come before the first enqueue: such a failure leaves nothing enqueued
 * and no output byte changed. On the one-kernel path, if the kernel's
 * enqueue fails after the ticket's fill, only the scratch buffer changed.
 * On the two calls' path, after top-k's kernel is enqueued, moe_align's
 * part can still fail (its scratch buffer's allocation, a clSetKernelArg,
 * CL_INVALID_WORK_GROUP_SIZE, an enqueue): then topk_weights and topk_ids
 * are unspecified (normally written), and moe_align's outputs are as
 * moecl_moe_align() states for its own failures; the call waits for
 * every command it enqueued before it returns the error.
 */
MOECL_API moecl_status moecl_route_dispatch(moecl_context *ctx, const moecl_topk_gating_desc *desc, uint32_t block_size,
                                            moecl_buffer gating, moecl_buffer bias, moecl_buffer topk_weights,
                                            moecl_buffer topk_ids, moecl_buffer expert_counts,
                                            moecl_buffer sorted_token_ids, moecl_buffer block_expert_ids,
                                            moecl_buffer num_tokens_post_padded, moecl_buffer slot_positions,
                                            moecl_buffer num_invalid, cl_uint num_wait, const cl_event *wait,
                                            cl_event *done);

/** Blocking convenience of moecl_route_dispatch() on host memory: copies
 *  in, runs, copies out. bias, slot_positions and num_invalid may be NULL;
 *  the others are required (gating, topk_weights and topk_ids may be NULL
 *  only when num_tokens is 0; sorted_token_ids and block_expert_ids only
 *  when they have no element). Same validation as moecl_route_dispatch().
 *  The device buffers are the call's own, so a failed enqueue leaves every
 *  host output unchanged; only a failed copy back may have written them
 *  (see "What a failed call leaves" above). */
MOECL_API moecl_status moecl_route_dispatch_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                                 uint32_t block_size, const void *gating, const void *bias,
                                                 void *topk_weights, int32_t *topk_ids, int32_t *expert_counts,
                                                 int32_t *sorted_token_ids, int32_t *block_expert_ids,
                                                 int32_t *num_tokens_post_padded, int32_t *slot_positions,
                                                 int32_t *num_invalid);

/**
 * The tensors of moecl_route_dispatch_ex(), by name: moecl_route_dispatch()'s
 * ten buffers, then the optional tensors of the padded batches, the load
 * statistics and expert parallelism. Zero the record, set struct_size to
 * sizeof(moecl_route_dispatch_tensors), then the tensors: an absent one
 * has mem NULL. A later moecl may append fields; a caller's struct_size
 * tells it which this record holds (today's, which ends at
 * num_local_experts, is the first version).
 */
typedef struct moecl_route_dispatch_tensors {
    size_t struct_size;                  /**< sizeof(moecl_route_dispatch_tensors) */
    moecl_buffer gating;                 /**< as moecl_route_dispatch()'s, required */
    moecl_buffer bias;                   /**< as moecl_route_dispatch()'s, or absent */
    moecl_buffer topk_weights;           /**< output, required */
    moecl_buffer topk_ids;               /**< int32_t, output, required; global ids with expert_map */
    moecl_buffer expert_counts;          /**< output, required: int32_t[num_experts], or
                                              int32_t[num_local_experts] with expert_map */
    moecl_buffer sorted_token_ids;       /**< output, required */
    moecl_buffer block_expert_ids;       /**< output, required */
    moecl_buffer num_tokens_post_padded; /**< output, required */
    moecl_buffer slot_positions;         /**< output, or absent */
    moecl_buffer num_invalid;            /**< output, or absent */
    /** int32_t[num_experts] (int32_t[num_local_experts] with expert_map),
     *  or absent: a load counter the call adds its routed slots to and
     *  never zeroes, as moecl_topk_gating_ex()'s expert_load (vLLM's and
     *  SGLang's expert-load statistics for their load balancers). Without
     *  expert_map it is indexed by expert id; with expert_map (vLLM's
     *  physical counts after the map) by local expert, counting only the
     *  slots of this rank's experts. Padding rows are counted nowhere. */
    moecl_buffer expert_load;
    /** int32_t[1], or absent: the number n of rows that are tokens, read
     *  by the kernels when they run, as moecl_topk_gating_ex()'s
     *  num_valid_tokens (vLLM's is_padding, SGLang's num_token_non_padded):
     *  rows t >= n get ids -1 and weights 0, and the alignment skips their
     *  slots as moecl_moe_align() skips -1 ids (they count in num_invalid,
     *  as there, and nowhere else). */
    moecl_buffer num_valid_tokens;
    /** int32_t[num_experts], or absent: the global-to-local expert map of
     *  moecl_moe_align_ex() (vLLM's expert_map): desc->num_experts is the
     *  global count G the gating runs over and the map's length, topk_ids
     *  holds global ids, and the alignment runs over num_local_experts
     *  local experts exactly as moecl_moe_align_ex() with
     *  num_global_experts = G does on those ids. */
    moecl_buffer expert_map;
    /** With expert_map: the local experts of this rank, 1..4096 (moe_align's
     *  num_experts). Must be 0 without expert_map. */
    uint32_t num_local_experts;
} moecl_route_dispatch_tensors;

/**
 * moecl_route_dispatch() with its buffers in a struct and the optional
 * tensors of moecl_route_dispatch_tensors: given only moecl_route_dispatch()'s
 * buffers it writes exactly what that call writes, bit for bit
 * (moecl_route_dispatch() is this call with the buffers passed by name).
 * Otherwise its outputs are exactly those of moecl_topk_gating_ex() (with
 * num_valid_tokens, and expert_load where there is no expert_map) followed
 * by moecl_moe_align_ex() (with expert_map and num_global_experts =
 * desc->num_experts, num_experts = num_local_experts where a map is given)
 * on those topk_ids; with both expert_map and expert_load, the load gains
 * for each local expert l the slots whose id g has expert_map[g] == l
 * (the local part of expert_counts, added).
 *
 * Paths: as moecl_route_dispatch()'s. num_valid_tokens and expert_load
 * are read and added by the routing kernel, in the one kernel where that
 * path serves the call (kernel variants of their own, so calls without
 * them run moecl_route_dispatch()'s kernels); a call with expert_map
 * always takes the two calls' path: moe_align reads the map in its own
 * launches, and top-k's kernel reads it for a load counter.
 *
 * Errors: those of moecl_route_dispatch(), and MOECL_ERROR_INVALID_ARGUMENT
 * for a NULL tensors, a struct_size this moecl does not know, an expert_map
 * without num_local_experts or num_local_experts without an expert_map, a
 * num_local_experts moe_align refuses, and expert_load, num_valid_tokens or
 * expert_map too small, misaligned or of another context. Nothing is
 * enqueued and no output byte (expert_load included) changes for any of
 * them. What a later failure leaves is as moecl_route_dispatch() states;
 * expert_load is then unspecified on the two calls' path once top-k's
 * kernel has run.
 */
MOECL_API moecl_status moecl_route_dispatch_ex(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                               uint32_t block_size, const moecl_route_dispatch_tensors *tensors,
                                               cl_uint num_wait, const cl_event *wait, cl_event *done);

/** The host-memory arrays of moecl_route_dispatch_ex_host(), by name, as
 *  moecl_route_dispatch_tensors's; an absent one is NULL. */
typedef struct moecl_route_dispatch_host_tensors {
    size_t struct_size;              /**< sizeof(moecl_route_dispatch_host_tensors) */
    const void *gating;              /**< required (may be NULL when num_tokens is 0) */
    const void *bias;                /**< or NULL */
    void *topk_weights;              /**< output, required (as gating) */
    int32_t *topk_ids;               /**< output, required (as gating) */
    int32_t *expert_counts;          /**< output, required */
    int32_t *sorted_token_ids;       /**< output; NULL only when it has no element */
    int32_t *block_expert_ids;       /**< output; NULL only when it has no element */
    int32_t *num_tokens_post_padded; /**< output, required */
    int32_t *slot_positions;         /**< output, or NULL */
    int32_t *num_invalid;            /**< output, or NULL */
    int32_t *expert_load;            /**< read, added to and written back, or NULL */
    const int32_t *num_valid_tokens; /**< one int32, or NULL */
    const int32_t *expert_map;       /**< int32_t[num_experts], or NULL */
    uint32_t num_local_experts;      /**< as moecl_route_dispatch_tensors's */
} moecl_route_dispatch_host_tensors;

/** Blocking convenience of moecl_route_dispatch_ex() on host memory: copies
 *  in (expert_load too), runs, copies out (expert_load too), as
 *  moecl_route_dispatch_host() does (which is this call with the arrays
 *  passed by name). Same validation as moecl_route_dispatch_ex(); what a
 *  failed call leaves as moecl_route_dispatch_host(). With num_tokens 0,
 *  expert_load is unchanged. */
MOECL_API moecl_status moecl_route_dispatch_ex_host(moecl_context *ctx, const moecl_topk_gating_desc *desc,
                                                    uint32_t block_size,
                                                    const moecl_route_dispatch_host_tensors *tensors);

/**
 * The grounded router (moecl_grounded_router()) through to dispatch
 * (moecl_moe_align()) in one call: for desc's tokens, the top_k experts of
 * g = router_logits + alpha * token_hidden @ expert_ground^T with their
 * softmax weights, then moe_align's outputs for those ids, exactly what
 * moecl_grounded_router() (weights and ids, no pairs) followed by
 * moecl_moe_align() with moecl_moe_align_desc_init(desc->num_tokens,
 * desc->top_k, desc->num_experts, block_size) would write, bit for bit.
 * With desc->num_shared_experts S > 0, top_k + S slots a token aligned
 * over num_experts + S experts.
 *
 *   token_hidden, router_logits,
 *   expert_ground                          as moecl_grounded_router()
 *   topk_weights, topk_ids                 as moecl_grounded_router(), both
 *                                          required here; topk_ids int32
 *                                          (desc->ids_dtype MOECL_I32, else
 *                                          MOECL_ERROR_INVALID_ARGUMENT)
 *   expert_counts, sorted_token_ids, block_expert_ids,
 *   num_tokens_post_padded, slot_positions (or absent),
 *   num_invalid (or absent)                as moecl_moe_align(); the ids of
 *                                          a routing are always in range,
 *                                          so num_invalid is 0
 *
 * desc as for moecl_grounded_router(); block_size as moecl_moe_align_desc's,
 * and num_tokens * top_k + num_experts * (block_size - 1) <= INT32_MAX.
 * num_tokens == 0 writes moe_align's empty result and no routing output.
 *
 * Asynchronous. The paths, their conditions, the events, the scratch
 * buffer and its size, the errors and what a failed call leaves are
 * moecl_route_dispatch()'s, with the grounded router in top-k gating's
 * place: one kernel where the grounded router runs its team kernel (at
 * most 64 experts) and the slots are few enough, its local memory (the
 * team kernel's: the ground table, the tokens' hidden states, the top-k
 * scratch; then moe_align's fused arrays) and work-group limit
 * permitting; otherwise the
 * grounded router's kernel, then moe_align's path for that size. On the
 * two calls' path, a moe_align failure after the router's kernel was
 * enqueued leaves topk_weights and topk_ids unspecified (normally
 * written). The one kernel assumes of the device what moecl_moe_align()'s
 * fused kernel does.
 */
MOECL_API moecl_status moecl_grounded_route_dispatch(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                                     uint32_t block_size, moecl_buffer token_hidden,
                                                     moecl_buffer router_logits, moecl_buffer expert_ground,
                                                     moecl_buffer topk_weights, moecl_buffer topk_ids,
                                                     moecl_buffer expert_counts, moecl_buffer sorted_token_ids,
                                                     moecl_buffer block_expert_ids,
                                                     moecl_buffer num_tokens_post_padded, moecl_buffer slot_positions,
                                                     moecl_buffer num_invalid, cl_uint num_wait, const cl_event *wait,
                                                     cl_event *done);

/** Blocking convenience of moecl_grounded_route_dispatch() on host memory:
 *  copies in, runs, copies out. slot_positions and num_invalid may be
 *  NULL; the others are required (token_hidden, router_logits,
 *  expert_ground, topk_weights and topk_ids may be NULL only when
 *  num_tokens is 0; sorted_token_ids and block_expert_ids only when they
 *  have no element). Same validation as moecl_grounded_route_dispatch().
 *  The device buffers are the call's own, so a failed enqueue leaves every
 *  host output unchanged; only a failed copy back may have written them
 *  (see "What a failed call leaves" above). */
MOECL_API moecl_status moecl_grounded_route_dispatch_host(moecl_context *ctx, const moecl_grounded_router_desc *desc,
                                                          uint32_t block_size, const void *token_hidden,
                                                          const float *router_logits, const void *expert_ground,
                                                          void *topk_weights, int32_t *topk_ids,
                                                          int32_t *expert_counts, int32_t *sorted_token_ids,
                                                          int32_t *block_expert_ids,
                                                          int32_t *num_tokens_post_padded, int32_t *slot_positions,
                                                          int32_t *num_invalid);

/* ---------------------------------------------------------------------- */
/* Permute and combine around the expert GEMMs (docs/routing.md,           */
/* "Permute and combine")                                                  */
/* ---------------------------------------------------------------------- */

/**
 * What moecl_permute() gathers. sorted_token_ids holds num_padded entries
 * (moe_align's max_padded, moecl_moe_align_max_padded(), or any capacity of
 * the caller's); an entry s in [0, num_tokens * top_k) is slot s, whose row
 * is hidden_states[s / top_k]; any other entry (moe_align's sentinel
 * num_tokens * top_k, a negative value) is padding.
 */
typedef struct moecl_permute_desc {
    uint32_t num_tokens;  /**< rows of hidden_states */
    uint32_t top_k;       /**< slots per token: 1..64 */
    uint32_t hidden;      /**< columns of hidden_states and of out: 1..1048576 */
    uint32_t num_padded;  /**< entries of sorted_token_ids, rows of out: 0..INT32_MAX */
    moecl_dtype in_dtype;  /**< hidden_states: f32, f16 or bf16 */
    moecl_dtype out_dtype; /**< out: f32, f16 or bf16 (the expert GEMM's input) */
} moecl_permute_desc;

/** A descriptor with the four sizes, in_dtype and out_dtype MOECL_F32;
 *  future fields will default to today's behaviour here. */
MOECL_API moecl_permute_desc moecl_permute_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t hidden,
                                                     uint32_t num_padded);

/**
 * Gather each slot's hidden row into moe_align's expert order, for the
 * grouped expert GEMM (vLLM's moe_permute, TensorRT-LLM's
 * expandInputRows). With n = min(max(*num_tokens_post_padded, 0),
 * num_padded) read on the device, for every row p < n of
 * out[num_padded][hidden]:
 *   out[p] = hidden_states[sorted_token_ids[p] / top_k]   (a slot)
 *   out[p] = 0                                           (padding)
 * converted from in_dtype to out_dtype: the same dtype is copied bit for
 * bit (NaN payloads included); f16 and bf16 widen to f32 exactly; f32 to
 * f16 or bf16, and f16 to bf16 and back, round to nearest even (through
 * f32), as top-k gating stores its weights. Rows p >= n are not written
 * (vLLM leaves them too): the GEMM reads only the first n.
 *
 * Buffers: hidden_states [num_tokens][hidden] of in_dtype,
 * sorted_token_ids int32 [num_padded], num_tokens_post_padded int32 [1]
 * (moecl_moe_align()'s outputs, or the caller's in its layout), out
 * [num_padded][hidden] of out_dtype; all required (hidden_states may be
 * absent when num_tokens is 0). Offsets in bytes, multiples of the element
 * size.
 *
 * Asynchronous: one kernel (none when num_padded is 0: a marker keeps the
 * wait list). `done`, if non-NULL, receives its event.
 *
 * Errors: MOECL_ERROR_INVALID_ARGUMENT (a NULL ctx/desc, a field out of
 * range, a missing buffer, a buffer too small, an unaligned offset, a
 * buffer of another context, num_wait > 0 with wait NULL),
 * MOECL_ERROR_UNSUPPORTED (a row's vectors pass the driver's loop limit on
 * a work-group of work-items, docs/devices.md: Mesa's rusticl, combine at
 * hidden 2^20, top 64), MOECL_ERROR_BUILD, or an OpenCL error. One
 * command: any failure leaves nothing enqueued and no output byte changed.
 */
MOECL_API moecl_status moecl_permute(moecl_context *ctx, const moecl_permute_desc *desc, moecl_buffer hidden_states,
                                     moecl_buffer sorted_token_ids, moecl_buffer num_tokens_post_padded,
                                     moecl_buffer out, cl_uint num_wait, const cl_event *wait, cl_event *done);

/** Blocking convenience of moecl_permute() on host memory: copies in,
 *  runs, copies back the first n rows of out (n as moecl_permute() reads
 *  it from *num_tokens_post_padded); the others are not written.
 *  hidden_states may be NULL when num_tokens is 0, sorted_token_ids and
 *  out when num_padded is 0; num_tokens_post_padded is required. Same
 *  validation as moecl_permute(). A failed enqueue leaves out unchanged;
 *  only a failed copy back may have written it. */
MOECL_API moecl_status moecl_permute_host(moecl_context *ctx, const moecl_permute_desc *desc,
                                          const void *hidden_states, const int32_t *sorted_token_ids,
                                          const int32_t *num_tokens_post_padded, void *out);

/**
 * moecl_permute()'s result, token-major: each row of hidden_states is read
 * once and written to its top_k rows of out, where moecl_permute() reads a
 * token's row once for each of its slots. Use it where hidden_states
 * exceeds the device's last-level cache (the gather's re-reads then come
 * from DRAM: 4096 tokens x 7168 bf16, top 8, on an H100); the gather
 * needs no slot_positions and touches only rows below n.
 *
 * slot_positions int32 [num_tokens][top_k] is the inverse of
 * sorted_token_ids: moecl_moe_align()'s outputs of the same call
 * (slot_positions[t][j] = p where sorted_token_ids[p] = t * top_k + j,
 * -1 for a slot moe_align did not place). Then, with n as moecl_permute()
 * reads it, out's rows p < n are moecl_permute()'s, bit for bit, and
 * rows p >= n are not written. Token t's row goes to each position
 * slot_positions[t][j] in [0, n); other positions (-1, out of range) are
 * skipped. Row p < n is zeroed where sorted_token_ids[p] is not a slot.
 * Inconsistent inputs never write outside out's rows below n, but those
 * rows are then unspecified: a row named by two positions, or by a
 * position and a padding entry, has two writers; a slot row named by no
 * position is left as it was.
 *
 * Buffers: as moecl_permute()'s, and slot_positions (required unless
 * num_tokens or num_padded is 0). Asynchronous: one kernel (none when
 * num_padded is 0: a marker keeps the wait list). `done`, if non-NULL,
 * receives its event.
 *
 * Errors: as moecl_permute(); one command: any failure leaves nothing
 * enqueued and no output byte changed.
 */
MOECL_API moecl_status moecl_permute_scatter(moecl_context *ctx, const moecl_permute_desc *desc,
                                             moecl_buffer hidden_states, moecl_buffer sorted_token_ids,
                                             moecl_buffer num_tokens_post_padded, moecl_buffer slot_positions,
                                             moecl_buffer out, cl_uint num_wait, const cl_event *wait,
                                             cl_event *done);

/** Blocking convenience of moecl_permute_scatter() on host memory: copies
 *  in, runs, copies back the first n rows of out; the others are not
 *  written. hidden_states and slot_positions may be NULL when num_tokens
 *  is 0, sorted_token_ids, slot_positions and out when num_padded is 0;
 *  num_tokens_post_padded is required. Same validation as
 *  moecl_permute(). A failed enqueue leaves out unchanged; only a failed
 *  copy back may have written it. */
MOECL_API moecl_status moecl_permute_scatter_host(moecl_context *ctx, const moecl_permute_desc *desc,
                                                  const void *hidden_states, const int32_t *sorted_token_ids,
                                                  const int32_t *num_tokens_post_padded,
                                                  const int32_t *slot_positions, void *out);

/**
 * What moecl_combine() reduces: expert_out [num_padded][hidden] in
 * moe_align's order, back into token order.
 */
typedef struct moecl_combine_desc {
    uint32_t num_tokens;  /**< rows of topk_weights, slot_positions and out */
    uint32_t top_k;       /**< slots per token: 1..64 */
    uint32_t hidden;      /**< columns of expert_out and out: 1..1048576 */
    uint32_t num_padded;  /**< rows of expert_out: 0..INT32_MAX */
    moecl_dtype in_dtype;     /**< expert_out: f32, f16 or bf16 */
    moecl_dtype out_dtype;    /**< out: f32, f16 or bf16 */
    moecl_dtype shared_dtype; /**< shared_out, where given: f32, f16 or bf16 */
} moecl_combine_desc;

/** A descriptor with the four sizes, every dtype MOECL_F32; future fields
 *  will default to today's behaviour here. */
MOECL_API moecl_combine_desc moecl_combine_desc_init(uint32_t num_tokens, uint32_t top_k, uint32_t hidden,
                                                     uint32_t num_padded);

/**
 * The weighted sum of each token's expert outputs (vLLM's moe_unpermute
 * and moe_sum, TensorRT-LLM's finalizeMoeRouting). For every token t and
 * column h, in f32, starting from +0:
 *   acc = 0
 *   for j = 0 .. top_k - 1, where p = slot_positions[t][j] is in
 *   [0, num_padded):  acc = acc + topk_weights[t][j] * expert_out[p][h]
 *   with shared_out:  acc = acc + shared_out[t][h]
 *   out[t][h] = acc, rounded to out_dtype to nearest even
 * each product and each sum rounded to f32 (no fused multiply-add), so
 * the bits are the same on every device (denormals kept where the device
 * keeps them: CL_FP_DENORM). A slot whose position is
 * outside [0, num_padded) (moe_align's -1 for an invalid id) contributes
 * nothing, whatever its weight; a row of such slots is 0 (or shared_out).
 *
 * Buffers: expert_out [num_padded][hidden] of in_dtype, topk_weights f32
 * [num_tokens][top_k], slot_positions int32 [num_tokens][top_k]
 * (moecl_moe_align()'s), shared_out [num_tokens][hidden] of shared_dtype
 * or absent, out [num_tokens][hidden] of out_dtype. All but shared_out
 * required (expert_out may be absent when num_padded is 0; none is needed
 * when num_tokens is 0).
 *
 * Asynchronous: one kernel (none when num_tokens is 0: a marker keeps the
 * wait list). `done`, if non-NULL, receives its event.
 *
 * Errors: as moecl_permute(); one command: any failure leaves nothing
 * enqueued and no output byte changed.
 */
MOECL_API moecl_status moecl_combine(moecl_context *ctx, const moecl_combine_desc *desc, moecl_buffer expert_out,
                                     moecl_buffer topk_weights, moecl_buffer slot_positions, moecl_buffer shared_out,
                                     moecl_buffer out, cl_uint num_wait, const cl_event *wait, cl_event *done);

/** Blocking convenience of moecl_combine() on host memory: copies in,
 *  runs, copies out. shared_out may be NULL (absent); expert_out may be
 *  NULL when num_padded is 0, the others when num_tokens is 0. Same
 *  validation as moecl_combine(). A failed enqueue leaves out unchanged;
 *  only a failed copy back may have written it. */
MOECL_API moecl_status moecl_combine_host(moecl_context *ctx, const moecl_combine_desc *desc, const void *expert_out,
                                          const float *topk_weights, const int32_t *slot_positions,
                                          const void *shared_out, void *out);

#ifdef __cplusplus
}
#endif

#endif /* MOECL_MOECL_H */
