/* One row of x times a budget-shaped weight, by gemv.c's decode products alone: no Python, no ctypes, no
 * threads (benchmarks/bench_rows.py builds this and runs it; its docstring says why).
 *
 *   rows_harness REPS LIB [LIB ...] -- N K [N K ...]
 *
 * Each LIB is a gemv.c built as a shared library (a tree's own, and another's to compare). For every shape
 * [N out, K in] it times, per LIB: exact NVFP4 rows (part_nvfp4, x permuted as the kernels take it),
 * W4A4 rows (part_nvfp4_a4_rows, rounding x included) and bf16 column panels (panels_vec). Weights under
 * 200k are cycled over 8 copies (L2), the others read whole (L3 / memory). The kinds and libraries
 * alternate call group by call group, REPS times; the minimum per call is printed, one line each:
 *   N K LIB_INDEX KIND NS */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*nvfp4_fn)(const float *, const uint8_t *, const uint8_t *, float *, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float, int64_t, int64_t);
typedef void (*a4_fn)(const float *, int64_t, const uint8_t *, const uint8_t *, float *, int64_t, int64_t, int64_t,
                      int64_t, float, float, int64_t, int64_t);
typedef void (*permute_fn)(const float *, float *, int64_t, int64_t);
typedef void (*panels_fn)(const float *, const void *, int64_t, int64_t, int64_t, float *, int64_t, int64_t, int,
                          float);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 5) return fprintf(stderr, "usage: rows_harness REPS LIB [LIB ...] -- N K [N K ...]\n"), 2;
    const int reps = atoi(argv[1]);
    int libs = 0, at = 2;
    nvfp4_fn nvfp4[8];
    a4_fn a4[8];
    permute_fn permute[8];
    panels_fn panels[8];
    for (; at < argc && strcmp(argv[at], "--") && libs < 8; at++, libs++) {
        void *h = dlopen(argv[at], RTLD_NOW | RTLD_LOCAL);
        if (!h) return fprintf(stderr, "%s\n", dlerror()), 1;
        nvfp4[libs] = (nvfp4_fn)dlsym(h, "part_nvfp4");
        a4[libs] = (a4_fn)dlsym(h, "part_nvfp4_a4_rows");
        permute[libs] = (permute_fn)dlsym(h, "permute_nvfp4");
        panels[libs] = (panels_fn)dlsym(h, "panels_vec");
        if (!nvfp4[libs] || !a4[libs] || !permute[libs] || !panels[libs])
            return fprintf(stderr, "%s lacks a kernel this harness times\n", argv[at]), 1;
    }
    srand(1);
    for (at++; at + 1 < argc; at += 2) {
        const int64_t N = atoll(argv[at]), K = atoll(argv[at + 1]), copies = N * K < 200000 ? 8 : 1;
        const int64_t panels_n = (N + 23) / 24 * 24;
        uint8_t *w = malloc(copies * N * K / 2), *sc = malloc(copies * N * K / 16);
        uint16_t *p = malloc(sizeof(uint16_t) * copies * panels_n * K);
        float *x = malloc(sizeof(float) * K), *xp = malloc(sizeof(float) * K), *y = malloc(sizeof(float) * N);
        for (int64_t i = 0; i < copies * N * K / 2; i++) w[i] = (uint8_t)rand();
        for (int64_t i = 0; i < copies * N * K / 16; i++) sc[i] = (uint8_t)(0x30 + rand() % 16); /* 0.75-1.9 */
        for (int64_t i = 0; i < copies * panels_n * K; i++) p[i] = (uint16_t)(0x3F80 + (rand() & 0x7F));
        for (int64_t i = 0; i < K; i++) x[i] = 1.f / (float)(1 + i % 5);
        const int64_t calls = (int64_t)(2e7 / (double)(N * K)) + 1;
        double best[8][3];
        for (int l = 0; l < libs; l++) best[l][0] = best[l][1] = best[l][2] = 1e30;
        for (int rep = 0; rep < reps; rep++)
            for (int l = 0; l < libs; l++)
                for (int kind = 0; kind < 3; kind++) {
                    const double t = now();
                    for (int64_t c = 0; c < calls; c++) {
                        const int64_t j = c % copies;
                        if (kind == 0) {
                            permute[l](x, xp, 1, K);
                            nvfp4[l](xp, w + j * N * K / 2, sc + j * N * K / 16, y, 1, N, K, K / 2, K / 16, 1.f, 0, N);
                        } else if (kind == 1) {
                            a4[l](x, 1, w + j * N * K / 2, sc + j * N * K / 16, y, N, K, K / 2, K / 16, 1.f, 0.f, 0, N);
                        } else {
                            panels[l](x, p + j * panels_n * K, 24 * K, 0, K, y, 0, N, 1, 1.f);
                        }
                    }
                    const double ns = (now() - t) / (double)calls * 1e9;
                    if (ns < best[l][kind]) best[l][kind] = ns;
                }
        static const char *kinds[3] = {"nvfp4", "w4a4", "bf16"};
        for (int l = 0; l < libs; l++)
            for (int kind = 0; kind < 3; kind++)
                printf("%lld %lld %d %s %.1f\n", (long long)N, (long long)K, l, kinds[kind], best[l][kind]);
        fflush(stdout);
        free(w), free(sc), free(p), free(x), free(xp), free(y);
    }
    return 0;
}
