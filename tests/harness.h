/* Helpers shared by the Check suites: contexts, fresh random inputs with a
 * printed seed (MOECL_TEST_SEED reproduces a run), poisoned outputs, and
 * device buffers with offsets. */
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

/* Store value into element index of a tensor of dtype (rounding to it). */
void harness_store(moecl_dtype dtype, void *data, size_t index, float value);
/* n standard-normal values times scale, in dtype; malloc'ed. */
void *harness_random_tensor(harness_rng *rng, moecl_dtype dtype, size_t n, float scale);

/* A context on $MOECL_DEVICE or the default device; fails the test if
 * none. */
moecl_context *harness_context(void);

/* 0xFF bytes: NaN weights and id -1, so unwritten elements show. */
#define HARNESS_POISON 0xFF

/* A device buffer of size bytes plus room before it: returns the buffer
 * with its offset, filled with poison, and data copied in at the offset if
 * data != NULL. */
moecl_buffer harness_buffer(moecl_context *ctx, size_t size, size_t offset, const void *data);
/* Read size bytes at the buffer's offset (blocking). */
void harness_read(moecl_context *ctx, moecl_buffer buf, size_t size, void *out);
void harness_release(moecl_buffer buf);

/* MOECL_TEST_QUICK set (and not "0"): the op suites leave out their
 * largest grids, for slow runs such as the valgrind setup. */
bool harness_quick(void);

/* Run a suite with CK_FORK as set by the environment (meson sets no). */
int harness_run(Suite *suite);

#endif
