/* ep_phase: where ep_layout_fused's time goes on NVIDIA, phase by phase
 * (bench/README.md).
 * instrument.py writes a copy of cl/ep_layout.cl whose work-groups read
 * clock64 and globaltimer (inline PTX: NVIDIA only) after each phase and
 * write them over physical_ids[c * 16 ..] at the end; this program runs
 * moecl_ep_layout 50 times at 13526 tokens x 256 experts, top 8, on the
 * cases given (RANKS:PHYSICAL, PHYSICAL > 256: bench/moecl-bench's
 * replicas), and prints each phase's cycles (median and max over the
 * work-groups) and the globaltimer spread. Its output is not a layout:
 * it checks nothing. Chunks of 128 tokens (106 work-groups at 13526 tokens).
 *
 *   mkdir -p /tmp/cli && cp -r cl/. /tmp/cli/ &&
 *   python3 bench/ep_phase/instrument.py cl/ep_layout.cl /tmp/cli/ep_layout.cl
 *   gcc -O2 -I include bench/ep_phase/ep_phase.c -o /tmp/ep_phase -Lbuild/src -lmoecl -lOpenCL
 *   MOECL_DEVICE=gpu MOECL_KERNEL_DIR=/tmp/cli /tmp/ep_phase 8:256 64:256 64:288 */
#include <moecl/moecl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int cmpu(const void *a, const void *b) { unsigned x = *(const unsigned *)a, y = *(const unsigned *)b; return x < y ? -1 : x > y; }
static unsigned med(unsigned *v, int n) { qsort(v, n, 4, cmpu); return v[n / 2]; }
static cl_mem mk(cl_context cl, size_t bytes, const void *host) {
    cl_int e; cl_mem m = clCreateBuffer(cl, CL_MEM_READ_WRITE | (host ? CL_MEM_COPY_HOST_PTR : 0), bytes, (void *)host, &e);
    if (e) { fprintf(stderr, "buffer %d\n", e); exit(1); } return m; }
int main(int argc, char **argv) {
    const unsigned T = 13526, K = 8, E = 256;
    moecl_context *ctx;
    if (moecl_context_create(NULL, &ctx)) { fprintf(stderr, "ctx\n"); return 1; }
    cl_context cl = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    int *ids = malloc((size_t)T * K * 4);
    unsigned long long x = 88172645463325252ull;
    for (unsigned t = 0; t < T; t++)
        for (unsigned j = 0; j < K; j++) {
            int e, dup;
            do { x ^= x << 13; x ^= x >> 7; x ^= x << 17; e = (int)(x % E); dup = 0;
                 for (unsigned i = 0; i < j; i++) dup |= ids[t * K + i] == e; } while (dup);
            ids[t * K + j] = e;
        }
    cl_mem in = mk(cl, (size_t)T * K * 4, ids);
    for (int a = 1; a < argc; a++) {
        unsigned R, P; sscanf(argv[a], "%u:%u", &R, &P);
        moecl_ep_layout_desc d = moecl_ep_layout_desc_init(T, K, E, R);
        cl_mem tab[3] = {NULL, NULL, NULL};
        if (P > E) {
            d.num_physical = P; d.max_replicas = 2;
            unsigned hot = P - E, per = E / R ? E / R : 1;
            int *l2p = malloc(E * 8), *rep = malloc(E * 4), *p2r = malloc(P * 4);
            for (unsigned e = 0; e < E; e++) { rep[e] = e < hot ? 2 : 1; l2p[2 * e] = e; l2p[2 * e + 1] = e < hot ? (int)(E + e) : -1; p2r[e] = (e / per) % R; }
            for (unsigned e = 0; e < hot; e++) p2r[E + e] = (e / per + R / 2) % R;
            tab[0] = mk(cl, E * 8, l2p); tab[1] = mk(cl, E * 4, rep); tab[2] = mk(cl, P * 4, p2r);
        }
        cl_mem o[7] = {mk(cl, (size_t)T * K * 4, NULL), mk(cl, R * 4, NULL), mk(cl, (R + 1) * 4, NULL), mk(cl, (size_t)T * K * 4, NULL),
                       mk(cl, (size_t)T * R, NULL), mk(cl, R * 4, NULL), mk(cl, d.num_physical * 4, NULL)};
        for (int it = 0; it < 50; it++) {
            moecl_status st = moecl_ep_layout(ctx, &d, (moecl_buffer){in, 0}, (moecl_buffer){tab[0], 0}, (moecl_buffer){tab[1], 0},
                                              (moecl_buffer){tab[2], 0}, (moecl_buffer){o[0], 0}, (moecl_buffer){o[1], 0}, (moecl_buffer){o[2], 0},
                                              (moecl_buffer){o[3], 0}, (moecl_buffer){o[4], 0}, (moecl_buffer){o[5], 0}, (moecl_buffer){o[6], 0}, 0, NULL, NULL);
            if (st) { fprintf(stderr, "%s\n", moecl_context_error(ctx)); return 1; }
        }
        clFinish(q);
        unsigned *ph = malloc((size_t)T * K * 4);
        clEnqueueReadBuffer(q, o[0], CL_TRUE, 0, (size_t)T * K * 4, ph, 0, NULL, NULL);
        const unsigned chunk = 128, G = (T + chunk - 1) / chunk;
        unsigned v[200], n = 0;
        static const char *names[] = {"", "keys", "tiles", "publish+fence", "ticket+wait", "columns", "starts", "place"};
        printf("== r%u p%u, %u work-groups (cycles: median / max over work-groups)\n", R, P, G);
        for (int p = 1; p < 8; p++) {
            n = 0;
            for (unsigned c = 0; c < G; c++) v[n++] = ph[c * 16 + p] - (p > 1 ? ph[c * 16 + p - 1] : 0);
            unsigned mx = 0; for (unsigned i = 0; i < n; i++) if (v[i] > mx) mx = v[i];
            printf("  %-14s %7u %7u\n", names[p], med(v, n), mx);
        }
        n = 0; for (unsigned c = 0; c < G; c++) v[n++] = ph[c * 16 + 7]; { unsigned mx = 0; for (unsigned i = 0; i < n; i++) if (v[i] > mx) mx = v[i]; printf("  %-14s %7u %7u\n", "total", med(v, n), mx); }
        unsigned g0min = ~0u, g0max = 0, g3max = 0, g3min = ~0u, g4min = ~0u, g4max = 0, g7max = 0;
        for (unsigned c = 0; c < G; c++) {
            unsigned *w = ph + c * 16;
            g0min = w[8] < g0min ? w[8] : g0min;
            g0max = w[8] > g0max ? w[8] : g0max;
            g3min = w[9] < g3min ? w[9] : g3min;
            g3max = w[9] > g3max ? w[9] : g3max;
            g4min = w[10] < g4min ? w[10] : g4min;
            g4max = w[10] > g4max ? w[10] : g4max;
            g7max = w[11] > g7max ? w[11] : g7max;
        }
        printf("  globaltimer ns from the first start: starts %u..%u, counted %u..%u, released %u..%u, last end %u\n", 0, g0max - g0min,
               g3min - g0min, g3max - g0min, g4min - g0min, g4max - g0min, g7max - g0min);
        free(ph);
    }
    return 0;
}
