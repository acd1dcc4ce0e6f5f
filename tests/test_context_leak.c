/* 1000 moecl_context_create / moecl_context_destroy cycles: the process's
 * resident memory (from /proc/self/statm) must not grow between cycle 100
 * and cycle 1000 by more than the same cycles grow it without moecl.
 *
 * The first cycles are allowed to grow: the ICD loader and the OpenCL
 * implementation set up their platform, device and allocator state once,
 * and glibc's arenas reach their working size. After WARMUP cycles the
 * process is in a steady state, so the growth from there to CYCLES is the
 * leak of CYCLES - WARMUP cycles.
 *
 * The baseline: first, the same number of cycles of what
 * moecl_context_create and moecl_context_destroy do in OpenCL (a context
 * and an in-order queue on the device moecl picks, then their release),
 * with no moecl call in between. A driver that grows by itself (NVIDIA's
 * OpenCL did: 948 KiB over 900 cycles on an H100) grows there too; moecl's
 * cycles may grow by at most the baseline's growth plus the tolerance, and
 * the output says when the driver alone exceeded the tolerance.
 *
 * Tolerance: TOLERANCE_KIB (256 KiB) over the 900 measured cycles, i.e.
 * under 300 bytes a cycle. Runs without a leak grow by 0-4 KiB (one page:
 * glibc reuses the freed chunks, pocl its context objects). Measured on
 * pocl 3.1 with a leak put into moecl_context_destroy by hand: an untouched
 * malloc(64 KiB) per cycle grows RSS by 3600 to 5576 KiB (its chunk
 * header and the heap's top land on fresh pages), over ten times the
 * tolerance; a malloc(512) per cycle by 464 KiB, still above it. Smaller leaks (a few
 * bytes a cycle) are for LeakSanitizer and valgrind memcheck, which the
 * sanitizer build and the valgrind setup run; this test also catches what
 * those tools do not track, such as OpenCL objects a destroy fails to
 * release while the driver still holds them.
 *
 * Skipped (exit 77) under AddressSanitizer: its quarantine holds freed
 * memory back on purpose, so RSS grows without a leak; LeakSanitizer
 * checks the same code in that build. The valgrind setup excludes it
 * (memcheck's own bookkeeping dominates RSS there). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <moecl/moecl.h>

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

#define CYCLES 1000
#define WARMUP 100
#define TOLERANCE_KIB 256L

#ifndef UNDER_ASAN
/* Resident set size in KiB, or -1. */
static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return -1;
    long size = 0, resident = -1;
    if (fscanf(f, "%ld %ld", &size, &resident) != 2)
        resident = -1;
    fclose(f);
    return resident < 0 ? -1 : resident * (sysconf(_SC_PAGESIZE) / 1024);
}
#endif

#ifndef UNDER_ASAN
/* One cycle of what moecl's create and destroy do in OpenCL; false (with a
 * message) on an OpenCL error. */
static bool bare_cycle(cl_device_id dev, int i)
{
    cl_int err = CL_SUCCESS;
    cl_context c = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    if (err != CL_SUCCESS) {
        printf("FAIL: baseline cycle %d: clCreateContext: %d\n", i, err);
        return false;
    }
    cl_command_queue q = clCreateCommandQueue(c, dev, 0, &err);
    if (err != CL_SUCCESS) {
        printf("FAIL: baseline cycle %d: clCreateCommandQueue: %d\n", i, err);
        clReleaseContext(c);
        return false;
    }
    clReleaseCommandQueue(q);
    clReleaseContext(c);
    return true;
}

static bool moecl_cycle(cl_device_id dev, int i)
{
    (void)dev;
    moecl_context *ctx = NULL;
    moecl_status st = moecl_context_create(NULL, &ctx);
    if (st != MOECL_SUCCESS) {
        printf("FAIL: cycle %d: moecl_context_create: %s: %s\n", i, moecl_status_string(st),
               moecl_context_error(NULL));
        return false;
    }
    moecl_context_destroy(ctx);
    return true;
}

/* CYCLES cycles of one kind; *growth the RSS growth from cycle WARMUP on. */
static bool measure(const char *what, bool (*cycle)(cl_device_id, int), cl_device_id dev, long *growth)
{
    long at_warmup = -1, start = rss_kib();
    for (int i = 1; i <= CYCLES; i++) {
        if (!cycle(dev, i))
            return false;
        if (i == 1 || i % 100 == 0)
            printf("%s cycle %4d: RSS %ld KiB\n", what, i, rss_kib());
        if (i == WARMUP)
            at_warmup = rss_kib();
    }
    long end = rss_kib();
    *growth = end - at_warmup;
    printf("%s: RSS before the first cycle %ld KiB, after cycle %d %ld KiB, after cycle %d %ld KiB: "
           "growth %ld KiB over %d cycles\n",
           what, start, WARMUP, at_warmup, CYCLES, end, *growth, CYCLES - WARMUP);
    return true;
}
#endif

int main(void)
{
#ifdef UNDER_ASAN
    printf("SKIP: built with AddressSanitizer (its quarantine grows RSS by design; LeakSanitizer covers leaks)\n");
    return 77;
#else
    if (rss_kib() < 0) {
        printf("SKIP: /proc/self/statm is not readable\n");
        return 77;
    }
    /* The device moecl picks: a root device, valid after its context goes. */
    moecl_context *first = NULL;
    moecl_status st = moecl_context_create(NULL, &first);
    if (st != MOECL_SUCCESS) {
        printf("FAIL: moecl_context_create: %s: %s\n", moecl_status_string(st), moecl_context_error(NULL));
        return 1;
    }
    cl_device_id dev = moecl_context_device(first);
    moecl_context_destroy(first);

    long bare = 0, growth = 0;
    if (!measure("baseline (OpenCL alone)", bare_cycle, dev, &bare) || !measure("moecl", moecl_cycle, dev, &growth))
        return 1;
    long allowed = (bare > 0 ? bare : 0) + TOLERANCE_KIB;
    if (bare > TOLERANCE_KIB)
        printf("note: the OpenCL implementation alone grew by %ld KiB over %d cycles, above the tolerance (%ld "
               "KiB); moecl's cycles are held to that growth plus the tolerance\n",
               bare, CYCLES - WARMUP, TOLERANCE_KIB);
    if (growth > allowed) {
        printf("FAIL: resident memory grew by %ld KiB (%.0f bytes a cycle) under moecl, %ld KiB without it "
               "(allowed: %ld KiB): a context leaks\n",
               growth, growth * 1024.0 / (CYCLES - WARMUP), bare, allowed);
        return 1;
    }
    printf("PASS: moecl %ld KiB, OpenCL alone %ld KiB, allowed %ld KiB\n", growth, bare, allowed);
    return 0;
#endif
}
