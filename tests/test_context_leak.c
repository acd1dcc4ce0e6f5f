/* 1000 moecl_context_create / moecl_context_destroy cycles: the process's
 * resident memory (from /proc/self/statm) must not grow between cycle 100
 * and cycle 1000.
 *
 * The first cycles are allowed to grow: the ICD loader and pocl set up
 * their platform, device and allocator state once, and glibc's arenas reach
 * their working size. After WARMUP cycles the process is in a steady state,
 * so the growth from there to CYCLES is the leak of CYCLES - WARMUP cycles.
 *
 * Tolerance: TOLERANCE_KIB (256 KiB) over the 900 measured cycles, i.e.
 * under 300 bytes a cycle. Runs without a leak grow by 0-4 KiB (one page:
 * glibc reuses the freed chunks, pocl its context objects). Measured on
 * pocl 3.1 with a leak put into moecl_context_destroy by hand: an untouched
 * malloc(64 KiB) per cycle grows RSS by 5576 KiB (its chunk headers and
 * the heap's top land on fresh pages), twenty times the tolerance; a
 * malloc(512) per cycle by 464 KiB, still above it. Smaller leaks (a few
 * bytes a cycle) are for LeakSanitizer and valgrind memcheck, which the
 * sanitizer build and the valgrind setup run; this test also catches what
 * those tools do not track, such as OpenCL objects a destroy fails to
 * release while the driver still holds them.
 *
 * Skipped (exit 77) under AddressSanitizer: its quarantine holds freed
 * memory back on purpose, so RSS grows without a leak; LeakSanitizer
 * checks the same code in that build. The valgrind setup excludes it
 * (memcheck's own bookkeeping dominates RSS there). */
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
    long at_warmup = -1, start = rss_kib();
    for (int i = 1; i <= CYCLES; i++) {
        moecl_context *ctx = NULL;
        moecl_status st = moecl_context_create(NULL, &ctx);
        if (st != MOECL_SUCCESS) {
            printf("FAIL: cycle %d: moecl_context_create: %s: %s\n", i, moecl_status_string(st),
                   moecl_context_error(NULL));
            return 1;
        }
        moecl_context_destroy(ctx);
        if (i == 1 || i % 100 == 0)
            printf("cycle %4d: RSS %ld KiB\n", i, rss_kib());
        if (i == WARMUP)
            at_warmup = rss_kib();
    }
    long end = rss_kib();
    long growth = end - at_warmup;
    printf("RSS before the first cycle %ld KiB, after cycle %d %ld KiB, after cycle %d %ld KiB: "
           "growth %ld KiB over %d cycles (tolerance %ld KiB)\n",
           start, WARMUP, at_warmup, CYCLES, end, growth, CYCLES - WARMUP, TOLERANCE_KIB);
    if (growth > TOLERANCE_KIB) {
        printf("FAIL: resident memory grew by %ld KiB (%.0f bytes a cycle): a context leaks\n", growth,
               growth * 1024.0 / (CYCLES - WARMUP));
        return 1;
    }
    printf("PASS\n");
    return 0;
#endif
}
