/* Helpers moecl-bench and moecl-tune share: timing, the inputs they make
 * (the same generator, so both tools route the same numbers), and device
 * buffers. Tools may exit on failure; the library never does. */
#ifndef MOECL_TOOL_COMMON_H
#define MOECL_TOOL_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <moecl/moecl.h>

/* Monotonic wall clock, microseconds. */
double tool_now_us(void);
/* qsort comparator for doubles (medians). */
int tool_cmp_double(const void *a, const void *b);
/* A standard-normal float from the 64-bit LCG state *s (Box-Muller). */
float tool_randn(uint64_t *s);
/* n values randn * scale in dtype t (f16/bf16 rounded to nearest even),
 * malloc'ed with 4 spare bytes; NULL when out of memory. */
void *tool_random_tensor(uint64_t *s, moecl_dtype t, size_t n, float scale);
/* How top-k logits are drawn: standard normal; uniform on [0, 10) (top
 * values crowd together: the k-th largest of 128 is about 0.5 below the
 * largest); hot: standard normal with TOOL_HOT_EXPERTS experts (every
 * num_experts/8-th, from 0) raised by TOOL_HOT_BOOST, so the top k
 * concentrate on them; ties: 8 levels 0..7 plus 0..3 times 2^-20 (exact
 * and near ties at the k-th place in most rows). bench/torch_reference.py
 * --logits draws the same kinds (the same distributions, not the same
 * numbers). */
typedef enum tool_logits { TOOL_LOGITS_NORMAL, TOOL_LOGITS_UNIFORM10, TOOL_LOGITS_HOT, TOOL_LOGITS_TIES } tool_logits;
#define TOOL_HOT_EXPERTS 8u
#define TOOL_HOT_BOOST 3.0f
/* tokens x experts logits of the kind dist in dtype t, as
 * tool_random_tensor. */
void *tool_logits_tensor(uint64_t *s, moecl_dtype t, size_t tokens, uint32_t experts, tool_logits dist);
/* "normal", "uniform10", "hot" or "ties" into *out; false for anything
 * else. */
bool tool_parse_logits(const char *text, tool_logits *out);
/* The name tool_parse_logits reads. */
const char *tool_logits_name(tool_logits dist);
/* A read-write buffer of size bytes (at least 4), copied from data if not
 * NULL; on failure prints "<prog>: ..." and exits 1. */
cl_mem tool_make_buffer(const char *prog, cl_context c, size_t size, const void *data);
/* Device time of a finished command from its profiling info, microseconds. */
double tool_event_us(cl_event ev);

#endif
