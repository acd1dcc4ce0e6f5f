/* Helpers shared by the Check suites: contexts, fresh random inputs with a
 * printed seed (MOECL_TEST_SEED reproduces a run), poisoned outputs,
 * device buffers with offsets, and one checked top-k gating call.
 *
 * The helpers named harness_try_* make no Check assertion: they return
 * false or NULL and record why in a harness_error, so worker threads may
 * call them (with CK_FORK=no a failed assertion jumps back into the test's
 * own thread, which a worker must never do). The others assert. */
#ifndef MOECL_TESTS_HARNESS_H
#define MOECL_TESTS_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <check.h>
#include <moecl/moecl.h>

#include "reference.h"

typedef struct harness_rng {
    uint64_t state;
} harness_rng;

/* A generator seeded from the process seed and a stream number, so each
 * test draws fresh inputs every run yet a failure is reproducible. */
harness_rng harness_rng_for(uint64_t stream);
uint64_t harness_seed(void);
uint32_t harness_rand_u32(harness_rng *rng);
double harness_rand_uniform(harness_rng *rng); /* [0, 1) */
float harness_randn(harness_rng *rng);

/* The failures of a run of calls, for code that must not assert: how many,
 * and the first one's message. Zero-initialise it. */
typedef struct harness_error {
    int count;
    char msg[1200];
} harness_error;

/* Count a failure, keeping the message if it is the first. Returns false. */
bool harness_fail(harness_error *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Store value into element index of a tensor of dtype (rounding to it). */
void harness_store(moecl_dtype dtype, void *data, size_t index, float value);
/* n standard-normal values times scale, in dtype; malloc'ed. */
void *harness_random_tensor(harness_rng *rng, moecl_dtype dtype, size_t n, float scale);
void *harness_try_random_tensor(harness_rng *rng, moecl_dtype dtype, size_t n, float scale, harness_error *e);

/* A context on $MOECL_DEVICE or the default device; fails the test if
 * none. */
moecl_context *harness_context(void);
/* The same, with the kernels read from dir (MOECL_KERNEL_DIR for the
 * creation only): the suites' mutants. */
moecl_context *harness_context_with_kernel_dir(const char *dir);
/* Replace the one occurrence of old in the malloc'ed *text (false, and
 * *text unchanged, where it is not there exactly once): the mutants. */
bool harness_replace_once(char **text, const char *old, const char *new_text);

/* A copy of cl/name (from MOECL_TEST_CL_DIR, which meson sets) with each
 * edits[i][0] replaced by edits[i][1] (each must occur once), written
 * into the new folder dir (a mkdtemp template) for MOECL_KERNEL_DIR; path
 * receives the copy's path. The suites' mutants. */
void harness_write_mutant(const char *name, const char *const (*edits)[2], size_t n, char *dir, char *path,
                          size_t path_size);

/* 0xFF bytes: NaN weights and id -1, so unwritten elements show. */
#define HARNESS_POISON 0xFF

/* n bytes (at least one) of poison, malloc'ed; NULL when out of memory. */
void *harness_poisoned(size_t n);
/* The index of the first byte of p[0..n) that is not poison, or n. */
size_t harness_first_unpoisoned(const void *p, size_t n);

/* A device buffer of size bytes plus room before it and HARNESS_SLACK bytes
 * after it: returns the buffer with its offset, filled with poison, and
 * data copied in at the offset if data != NULL. */
#define HARNESS_SLACK 64
moecl_buffer harness_buffer(moecl_context *ctx, size_t size, size_t offset, const void *data);
/* The same; {NULL, 0} on failure. */
moecl_buffer harness_try_buffer(moecl_context *ctx, size_t size, size_t offset, const void *data, harness_error *e);
/* Read size bytes at the buffer's offset (blocking). */
void harness_read(moecl_context *ctx, moecl_buffer buf, size_t size, void *out);
bool harness_try_read(moecl_context *ctx, moecl_buffer buf, size_t size, void *out, harness_error *e);
/* Read nk weights and nk ids and one element past each, which must
 * still be poison (what: the case, for the message). */
void harness_read_topk(moecl_context *ctx, moecl_buffer weights, moecl_buffer ids, size_t nk, float *w, int32_t *id,
                       const char *what);
/* Release buf.mem if set. */
void harness_release(moecl_buffer buf);

/* One top-k gating call of d on fresh random inputs (a bias of a softmax
 * score's size if with_bias), checked against the float64 reference. The
 * host path calls moecl_topk_gating_host; the device path copies the
 * inputs into poisoned buffers at offset, waits on the call's event, and
 * also fails if a byte before the offset or after a tensor changed. False,
 * with the shape and the reason in e, if anything is wrong. */
typedef enum harness_path { HARNESS_HOST, HARNESS_DEVICE } harness_path;
bool harness_try_topk(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng, bool with_bias,
                      harness_path path, size_t offset, harness_error *e);
/* The same, failing the test. */
void harness_check_topk(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng, bool with_bias,
                        harness_path path, size_t offset);

/* The arguments of every Check program, which harness_args reads first
 * thing in main, before any context (two runs of a suite differ by their
 * command lines, never by the environment):
 *   --variant TEXT  the variant override for every context the run
 *                   creates ("class=gpu align=fused ...", the words of
 *                   docs/environment.md's "Forcing a variant"); a text the
 *                   library rejects fails the run
 *   --quick         leave out the largest grids (harness_quick)
 *   --case NAME     run only the Check test case NAME (harness_run)
 * set_override is the library's moecl_override_set (src/internal.h) in
 * programs linked with its objects; programs linked with the shared
 * library, which hides it, pass NULL and refuse --variant. A bad argument
 * prints the usage and exits with status 2. */
typedef moecl_status (*harness_override_fn)(const char *text);
void harness_args(int argc, char **argv, harness_override_fn set_override);

/* The run's --variant text; "" without one. */
const char *harness_variant(void);
/* Make the override the run's --variant followed by words (which win
 * where they name the same thing), for the contexts created next; NULL
 * puts the run's own back. Fails the test where the program cannot force
 * a variant or the library rejects the text. */
void harness_override_with(const char *words);

/* --quick given, or MOECL_TEST_QUICK set and not "0" (the valgrind setup
 * and the sanitizer build, which can only set the environment): the op
 * suites leave out their largest grids. */
bool harness_quick(void);
/* Whether a quick run leaves out a combination of a loop over several
 * factors: the one whose `parity` (the sum of its factors' level numbers)
 * is odd. Of two-level factors that keeps every level of each and every
 * pair of levels of any two; with the configuration's number in the sum,
 * successive configurations keep opposite halves. Full runs keep all. */
bool harness_quick_skips(unsigned parity);

/* MOECL_TEST_VALGRIND set and not "0" (the valgrind setup). Under
 * valgrind pocl is another device (valgrind's CPU is a Haswell to it, not
 * the host's CPU), so every kernel a test asks for compiles, with pocl's
 * LLVM running under valgrind: some 20 s a program. */
bool harness_valgrind(void);

/* Run the suite (only the test case --case named, where one was) with
 * CK_FORK as set by the environment (meson sets no). 0 when every test
 * passed. */
int harness_run(Suite *suite);

#endif
