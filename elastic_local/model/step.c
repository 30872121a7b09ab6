/* One batch-1 decode step of a Nemotron-H block on the CPU, one function per block kind, and `decode_token`,
 * which runs a whole token through them (model/step.py builds the arguments once per budget and calls it;
 * gemv.c, built into the same library, does the products); at the end, parts of a prefill: the Mamba2
 * convolution and scan (model/kernels.py calls them) and the routed experts (model/moe.py).
 *
 * Why: a decode step of a small model is a few thousand small torch ops whose dispatch costs more than
 * reading the weights (docs/decode-speed.md, CPU decode kernels). Here a token is one call and one parallel region;
 * a block is norm, projections, the mixer's recurrence and the residual add, run by every thread.
 *
 * Each function follows the torch code it stands for (mamba2.py, attention.py, moe.py, linear.py's
 * rms_norm) in float32; a block reads the residual stream [d] from `in` and writes it, plus its output, to
 * `h` (in is h, but for a token's first block, which reads the token's embedding row where it lies: no
 * thread copies it into h, and no barrier waits for that copy). Weights are budget views
 * described by `weight` (any format gemv.c reads); heads are rank-major (layout.py).
 */
#include <immintrin.h>
#include <x86intrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void share(int64_t N, int64_t *n0, int64_t *n1);
void part_f32(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
void panels_vec(const float *x, const void *p, int64_t ps, int64_t skip, int64_t K, float *y, int64_t n0,
                int64_t n1, int kind, float scale);
void part_bf16(const float *, const uint16_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
void part_fp8(const float *, const uint8_t *, float *, int64_t, int64_t, int64_t, int64_t, float, int64_t, int64_t);
void permute_nvfp4(const float *x, float *xp, int64_t M, int64_t K);
void permute_nvfp4_bf16(const uint16_t *x, uint16_t *xp, int64_t M, int64_t K, float *f);
void gemm_p_part(const float *x, const void *p, int64_t ps, int64_t skip, float *y, int64_t M, int64_t N,
                 int64_t K, int64_t n0, int64_t n1, float *c, int kind, float scale);
enum { P_F32, P_BF16, P_FP8 }; /* gemv.c's panel kinds */
extern const int64_t gemm_p_scratch; /* floats of gemm_p_part's c */
#define PW 24 /* outputs per panel of a PANELS_* weight (gemv.c's) */
/* n floats rounded up to whole 64-byte cache lines: where scratch rows start, so that a line two threads
   write (one head's channels each) does not pass between their cores at every write */
#define LINE(n) (((n) + 15) / 16 * 16)
void part_nvfp4(const float *, const uint8_t *, const uint8_t *, float *, int64_t, int64_t, int64_t, int64_t,
                int64_t, float, int64_t, int64_t);
void nvfp4_round_rows(const float *x, float *out, int64_t M, int64_t K, float input_scale);
extern const int64_t nvfp4_a4_rows; /* fewer rows of x: the integer products, a row at a time */
void part_nvfp4_a4_rows(const float *x, int64_t M, const uint8_t *w, const uint8_t *scales, float *y, int64_t N,
                        int64_t K, int64_t ldw, int64_t lds, float scale, float input_scale, int64_t n0, int64_t n1);
int bf16_dot(void);
int product_bf16x(int format, int panel, const uint16_t *x, const void *w, const uint8_t *scales, float *y,
                  int64_t M, int64_t N, int64_t K, int64_t ld, int64_t lds, int64_t skip, float scale);
enum { DOT_BF16 = 1, DOT_FP8 = 2, DOT_NVFP4 = 3 }; /* gemv.c's PANEL_BF16, PANEL_FP8, PANEL_NVFP4 */
typedef struct { int64_t top_k; float temperature, top_p, min_p; } sampling; /* sample.c's */
int64_t sample_row(const float *logits, int64_t V, const sampling *s, float u, float *p, uint64_t *keys);

/* model/step.py checks the format it writes; NVFP4_A4: NVFP4 whose inputs are rounded to NVFP4 too (W4A4) */
enum { PANELS_F32, ROWS_F32, ROWS_BF16, FP8, NVFP4, PANELS_BF16, PANELS_FP8, NVFP4_A4 };

static inline int panelled(int64_t format) {
    return format == PANELS_F32 || format == PANELS_BF16 || format == PANELS_FP8;
}

/* A panel format's kind for gemv.c's panel kernels. */
static inline int kind_of(int64_t format) {
    return format == PANELS_BF16 ? P_BF16 : format == PANELS_FP8 ? P_FP8 : P_F32;
}

typedef struct {     /* y[n] = sum_k W[n, k] x[k], n < out, k < in */
    int64_t format;  /* one of the enum above */
    int64_t out, in;
    int64_t ld;      /* row stride of the stored weight: elements, bytes for FP8 / NVFP4; panels: panel stride */
    int64_t ld_scales;
    const void *w;
    const void *scales; /* NVFP4's e4m3 block scales */
    float scale;        /* FP8 / NVFP4's per-tensor scale */
    int64_t skip;       /* panels: columns of the first panel before the view's first output (gemv.c) */
    float input_scale;  /* NVFP4_A4: the inputs' per-tensor scale; 0: each row's own */
} weight;

/* x [M, K] permuted for part_nvfp4 into xp (not x), each row rounded to NVFP4 first where w is NVFP4_A4. */
static void nvfp4_x(const weight *w, const float *x, float *xp, int64_t M) {
    const int64_t K = w->in;
    float rounded[w->format == NVFP4_A4 ? K : 1];
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * K;
        if (w->format == NVFP4_A4) nvfp4_round_rows(r, rounded, 1, K, w->input_scale), r = rounded;
        permute_nvfp4(r, xp + m * K, 1, K);
    }
}

/* A token runs in one parallel region (decode_token, at the end): every thread runs every block, taking its
 * share of each product. Threads meet at a barrier only where one reads what another wrote: after the
 * products whose outputs a block's next part reads whole, and at the end of each block, whose residual
 * the next block's norm reads whole. Each thread computes a block's norm (d floats) itself instead of
 * waiting for one thread to. Between the products, work that is one thread's alone (a Mamba group, an
 * attention KV head) runs in rows that thread owns, and only its results go where the others read them:
 * a line two cores write in turn crosses between them at each write (mamba_block). (One region per
 * block, a barrier after each norm and a split-K round for each narrow product cost small budgets most:
 * docs/decode-speed.md, "One parallel region a token".)
 *
 * The barrier is this file's own (`meet`): OpenMP's costs 0.26 us here even on one thread (libgomp makes
 * a futex system call at each), against 0.04 us for two threads counting on a shared line (0.03-0.34 us
 * on the Zen 4 VM, with where the host puts its two vCPUs: bench_budgets prints it), and a token
 * passes two or three a block. It also keeps spinning where libgomp would sleep: libgomp cuts its spin to
 * 100 turns once the threads it has ever led outnumber the cores, which made each barrier a kernel sleep
 * and wake-up (docs/decode-speed.md, "A stream on its own thread"). It yields the core instead of spinning where the
 * region has more threads than the process has cores, or after a long wait (a thread descheduled). */
typedef struct { /* one decode_token call's: rounds arrived at and passed, counted from 0 */
    _Alignas(64) atomic_llong arrived;
    _Alignas(64) atomic_llong passed;
} meeting;

typedef struct { /* one thread's view of its meeting, and of how the products are shared (`own`) */
    meeting *all;
    int64_t round, threads;
    int64_t patience;  /* pause turns before a waiting thread yields its core */
    const double *cut; /* the threads' cumulative shares [threads + 1], 0 to 1 */
    double *tally;     /* this thread's {product cycles, weights read} on a timed token, or NULL */
} member;

/* Wait until every thread of the region has arrived here: what each wrote before is then visible to all
   (the arrivals' acquire-release additions, the last one's release of `passed`). */
static void meet(member *me) {
    meeting *m = me->all;
    const int64_t round = ++me->round;
    if (me->threads == 1) return;
    if (atomic_fetch_add_explicit(&m->arrived, 1, memory_order_acq_rel) + 1 == round * me->threads) {
        atomic_store_explicit(&m->passed, round, memory_order_release);
        return;
    }
    for (int64_t turns = 0; atomic_load_explicit(&m->passed, memory_order_acquire) < round;)
        if (++turns < me->patience) _mm_pause();
        else sched_yield();
}

static inline int64_t threads_here(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static inline int64_t omp_procs(void) { /* the cores this process may run on */
#ifdef _OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}

static inline int64_t thread_here(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* This thread's member of `all` in the current region: it yields its core early where the region has more
   threads than the process has cores. */
static member member_of(meeting *all, const double *cut) {
    const int64_t team = threads_here();
    return (member){all, 0, team, team > omp_procs() ? 64 : 1 << 14, cut, NULL};
}

/* y = W x, of which this thread computes outputs [n0, n1); for a batch's rows (decode_rows) x [m, in] and y
   [m, ldy] (m 0: one row). */
typedef struct {
    const weight *w;
    const float *x;
    float *y;
    int64_t n0, n1;
    int64_t m, ldy;
} product;

/* The output boundary nearest n at which a unit of w starts: a panel (its first one `skip` short), or 16
   rows; 0 and out stay themselves, so the first and the last thread cover the ends. */
static inline int64_t unit_edge(const weight *w, int64_t n) {
    if (n <= 0 || n >= w->out) return n <= 0 ? 0 : w->out;
    if (panelled(w->format)) n = (n + w->skip + PW / 2) / PW * PW - w->skip;
    else n = (n + 8) / 16 * 16;
    return n < 0 ? 0 : n > w->out ? w->out : n;
}

/* An output's share of a product's work (one even with no inputs: its zeros are still written). */
static inline int64_t weights_per_output(const weight *w) { return w->in > 0 ? w->in : 1; }

/* How the products are shared among the threads: each thread's share of their weights, kept per decode step
 * (`step.balance`) and moved after each call toward the threads' speeds, as timed on their products. A
 * thread that runs slower (a core that also takes the machine's interrupts or the chat app's drawing, a
 * VM's vCPU whose neighbour is busy, an efficiency core) then gets less; threads of equal speed keep
 * equal shares, whatever else makes one of them wait (the panels that do not halve, the Mamba groups).
 * Which thread computes an output never changes its bits. */
#define BALANCED 64 /* the most threads a step keeps shares for (more: equal shares) */

/* The cumulative shares for a team of `team` from balance ([0]: the team it was learned on, then each
   thread's share), equal where it holds none for this team. Every thread computes the same numbers. */
static void cuts_of(const double *balance, int64_t team, double *cut) {
    const int kept = balance && team <= BALANCED && balance[0] == (double)team;
    cut[0] = 0.;
    for (int64_t t = 1; t < team; t++) cut[t] = kept ? cut[t - 1] + balance[t] : (double)t / (double)team;
    cut[team] = 1.;
}

/* Where part p of `parts` begins in `total` weights (cut: the cumulative shares). */
static inline int64_t cut_at(int64_t total, int64_t p, int64_t parts, const double *cut) {
    if (p <= 0) return 0;
    if (p >= parts) return total;
    return (int64_t)((double)total * cut[p]);
}

/* Move balance's shares a quarter of the way toward the threads' speeds (weights a cycle, from `cycles` and
   `weights`, one each per thread): one call's few timed tokens are noisy. The speeds' proportions are
   raised to at least 1 / 2T each (the others scaled down to make room), so that a thread stalled in one
   call keeps work to be timed on in the next; the shares, steps between such targets, sum to 1 and stay
   above that floor too. */
void rebalance(double *balance, int64_t team, const double *cycles, const double *weights) {
    if (!balance || team < 2 || team > BALANCED) return;
    const double least = .5 / (double)team;
    double target[team], all = 0.;
    int low[team];
    for (int64_t t = 0; t < team; t++) {
        if (!(cycles[t] > 0.) || !(weights[t] > 0.)) return;
        all += target[t] = weights[t] / cycles[t];
        low[t] = 0;
    }
    for (int64_t t = 0; t < team; t++) target[t] /= all;
    for (int64_t pass = 0; pass < team; pass++) { /* raise the lowest, scale the rest into what is left */
        double rest = 0., fixed = 0.;
        int raised = 0;
        for (int64_t t = 0; t < team; t++)
            if (!low[t] && target[t] < least) low[t] = raised = 1;
        if (!raised) break;
        for (int64_t t = 0; t < team; t++)
            if (low[t]) target[t] = least, fixed += least;
            else rest += target[t];
        for (int64_t t = 0; t < team; t++)
            if (!low[t]) target[t] *= (1. - fixed) / rest;
    }
    const int kept = balance[0] == (double)team;
    for (int64_t t = 0; t < team; t++) {
        const double old = kept ? balance[1 + t] : 1. / (double)team;
        balance[1 + t] = old + .25 * (target[t] - old);
    }
    balance[0] = (double)team;
}

/* This thread's outputs of each of `count` products (their n0, n1): the products' weights laid end to end
   and cut into one run per thread (its share, me->cut), at whole units. Neighbouring threads compute the
   same cut from the same numbers, so the runs tile every product. Products too narrow to share alone (a
   few panels: expert ups, k and v, a budget's in_proj parts) keep every thread busy together. */
static void own_part(const double *cut, int64_t parts, int64_t part, product *p, int count) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += p[i].w->out * weights_per_output(p[i].w);
    const int64_t lo = cut_at(total, part, parts, cut), hi = cut_at(total, part + 1, parts, cut);
    for (int64_t i = 0, start = 0; i < count; i++) {
        const weight *w = p[i].w;
        const int64_t K = weights_per_output(w);
        p[i].n0 = unit_edge(w, (lo - start) / K);
        p[i].n1 = unit_edge(w, (hi - start) / K);
        start += w->out * K;
    }
}

static void own(const member *me, product *p, int count) {
    own_part(me->cut, threads_here(), thread_here(), p, count);
}

/* own, for the tests: the outputs [n0, n1) that thread `part` of `team` computes of weight w under the
   shares in balance (step.balance's layout); 0. */
int owned(const double *balance, int64_t team, int64_t part, const weight *w, int64_t *n0n1) {
    double cut[team + 1];
    cuts_of(balance, team, cut);
    product p = {w, NULL, NULL};
    own_part(cut, team, part, &p, 1);
    n0n1[0] = p.n0, n0n1[1] = p.n1;
    return 0;
}

static void run_rows(const product *p);

/* y[n0:n1] = (W x)[n0:n1], any format gemv.c reads. */
static void run(const product *p) {
    const weight *w = p->w;
    const int64_t n0 = p->n0, n1 = p->n1;
    if (n0 >= n1) return;
    if (p->m > 1) {
        run_rows(p);
        return;
    }
    switch (w->format) {
    case PANELS_F32:
    case PANELS_BF16:
    case PANELS_FP8: panels_vec(p->x, w->w, w->ld, w->skip, w->in, p->y, n0, n1, kind_of(w->format), w->scale); break;
    case ROWS_F32: part_f32(p->x, w->w, p->y, 1, w->out, w->in, w->ld, n0, n1); break;
    case ROWS_BF16: part_bf16(p->x, w->w, p->y, 1, w->out, w->in, w->ld, n0, n1); break;
    case FP8: part_fp8(p->x, w->w, p->y, 1, w->out, w->in, w->ld, w->scale, n0, n1); break;
    case NVFP4: {
        float xp[w->in];
        permute_nvfp4(p->x, xp, 1, w->in);
        part_nvfp4(xp, w->w, w->scales, p->y, 1, w->out, w->in, w->ld, w->ld_scales, w->scale, n0, n1);
        break;
    }
    case NVFP4_A4:
        part_nvfp4_a4_rows(p->x, 1, w->w, w->scales, p->y, w->out, w->in, w->ld, w->ld_scales, w->scale,
                           w->input_scale, n0, n1);
    }
}

/* The weights a thread's part of a product reads: whole panels (the last one's padding too, which the
   speeds would otherwise charge to the thread that owns it), or rows. */
static int64_t weights_read(const product *p) {
    const weight *w = p->w;
    if (p->n1 <= p->n0) return 0;
    if (!panelled(w->format)) return (p->n1 - p->n0) * weights_per_output(w);
    return ((w->skip + p->n1 + PW - 1) / PW - (w->skip + p->n0) / PW) * PW * weights_per_output(w);
}

/* Run this thread's part of `count` products (own's), timed on a timed token (me->tally). */
static void runs(const member *me, const product *p, int count) {
    const unsigned long long t0 = me->tally ? __rdtsc() : 0;
    for (int i = 0; i < count; i++) run(&p[i]);
    if (me->tally) {
        me->tally[0] += (double)(__rdtsc() - t0);
        for (int i = 0; i < count; i++) me->tally[1] += (double)weights_read(&p[i]);
    }
}

/* This thread's share of `count` products (outputs complete after the next barrier). */
static void products(const member *me, product *p, int count) {
    own(me, p, count);
    runs(me, p, count);
}

/* e^v for 8 floats: Cephes' expf (2^n times a degree-6 polynomial on [-ln2/2, ln2/2]), within 2 ulp of
   libm's over the range where silu's result is not 0 or v. */
static inline __m256 exp256(__m256 v) {
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 q = _mm256_set1_ps(1.9875691500e-4f);
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.3981999507e-3f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.3334519073e-3f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.1665795894e-2f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.6666665459e-1f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(5.0000001201e-1f));
    q = _mm256_fmadd_ps(_mm256_mul_ps(q, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(q, _mm256_castsi256_ps(e));
}

/* exp256 for sample.c's softmax */
__m256 exp8(__m256 v) { return exp256(v); }

static inline __m256 silu256(__m256 v) { /* v / (1 + e^-v) */
    return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

/* y[i] *= silu(z[i]), or (z NULL) y[i] = silu(y[i]), for i < n: every value takes the same silu256 whatever
   range it falls in (threads split the convolution's channels by other ranges than the groups do), the
   last n % 8 in masked lanes. Only those: AMD runs masked moves in microcode (a prompt's gated norm, all
   masked, took 1.3 ns a value). */
static void silu_into(float *y, const float *z, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 a = silu256(_mm256_loadu_ps(z ? z + i : y + i));
        _mm256_storeu_ps(y + i, z ? _mm256_mul_ps(_mm256_loadu_ps(y + i), a) : a);
    }
    if (i < n) {
        const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 a = silu256(_mm256_maskload_ps(z ? z + i : y + i, in));
        _mm256_maskstore_ps(y + i, in, z ? _mm256_mul_ps(_mm256_maskload_ps(y + i, in), a) : a);
    }
}

static inline float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); } /* torch's threshold */

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* sum v[i]^2, i < n, in four vector sums: one scalar chain of n additions took 4n cycles (0.3 us for a
   demo norm's 256, and a token runs ten norms a thread). */
static inline float sum_squares(const float *v, int64_t n) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 x = _mm256_loadu_ps(v + i + 8 * j);
            a[j] = _mm256_fmadd_ps(x, x, a[j]);
        }
    for (; i + 8 <= n; i += 8) a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(v + i), _mm256_loadu_ps(v + i), a[0]);
    float t = sum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    for (; i < n; i++) t += v[i] * v[i];
    return t;
}

static void rms_norm(const float *h, const float *w, float *out, int64_t d, float eps) {
    const float r = 1.f / sqrtf(sum_squares(h, d) / (float)d + eps);
    for (int64_t i = 0; i < d; i++) out[i] = w[i] * (h[i] * r);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float t = sum8(acc);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* ------------------------------------------------------------------------------ bf16 states and rows */

/* A bfloat16 model's embedding rows, convolution states and K / V caches stay bf16 (what the planner
   counts; model/step.py): rows are widened to float32 as they are read and rounded back as they are
   written, to nearest even as torch's .to(torch.bfloat16) rounds (a NaN stays a quiet NaN). The
   arithmetic is float32 throughout, as for a float32 model. */
static void widen(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
        _mm256_storeu_ps(f + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
    }
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)h[i] << 16;
        memcpy(f + i, &u, sizeof u);
    }
}

static inline uint16_t narrow1(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return isnan(f) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Eight floats' bf16 (narrow1's), one in the low half of each 32-bit lane. */
static inline __m256i narrow8(__m256 v) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x40);
    const __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
    const __m256i even = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(top, one))), 16);
    return _mm256_blendv_epi8(even, _mm256_or_si256(top, quiet), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* v rounded to bf16 and widened back, in registers. */
static inline __m256 bf16_round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(narrow8(v), 16)); }

static void narrow(const float *f, uint16_t *h, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i r = narrow8(_mm256_loadu_ps(f + i));
        _mm_storeu_si128((__m128i *)(h + i), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    for (; i < n; i++) h[i] = narrow1(f[i]);
}

/* narrow, for the tests: f [n] to bf16 h [n]; 0. */
int to_bf16(const float *f, uint16_t *h, int64_t n) {
    narrow(f, h, n);
    return 0;
}

/* ------------------------------------------------------------------------------------------- Mamba2 */

typedef struct {
    const float *norm;                     /* the block's pre-norm [d] */
    weight z, x, bc, dt, out;              /* in_proj's four row ranges (z | x | B,C | dt), out_proj */
    const float *conv_x, *conv_bc;         /* conv1d weight rows of x [k*p, K] and of B,C [2*G*N, K] */
    const float *conv_bias_x, *conv_bias_bc; /* NULL without conv bias */
    const float *dt_bias, *A, *D;          /* [k]; A = -exp(A_log) */
    const float *gate_norm;                /* [k*p] */
    int64_t d, heads, groups, head_dim, state, conv_k;
    float dt_min, dt_max, eps;
    weight in_proj; /* z | x | B,C | dt as one product when the budget keeps every head (out 0: it does not) */
    int64_t bf16;   /* the convolution state is bf16 (a bfloat16 model's); the SSM state is float32 always */
} mamba;

/* One row of a head's SSM state, s [N] = a s + dx B, and its readout C.s. */
static inline float ssm_row(float *s, float a, float dx, const float *B, const float *C, int64_t N) {
    const __m256 va = _mm256_set1_ps(a), vdx = _mm256_set1_ps(dx);
    __m256 acc = _mm256_setzero_ps();
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
        __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(s + n), va, _mm256_mul_ps(vdx, _mm256_loadu_ps(B + n)));
        _mm256_storeu_ps(s + n, v);
        acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(C + n), acc);
    }
    float t = 0.f, lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int q = 0; q < 8; q++) t += lanes[q];
    for (; n < N; n++) {
        s[n] = s[n] * a + dx * B[n];
        t += s[n] * C[n];
    }
    return t;
}

/* Eight rows of a head's state (N a multiple of 8), s[t] = a s[t] + dx[t] B, and their eight readouts
   C.s[t] as one vector: their lanes summed together as dot8 sums its eight scores, where a row at a time
   paid a whole horizontal sum for each (a demo Mamba block's convolution to gated norm: 5200-5900 TSC
   cycles a thread, from 5900-6600; rdtsc build, scratch). */
static inline __m256 ssm_rows8(float *s, int64_t N, float a, const float *dx, const float *B, const float *C) {
    const __m256 va = _mm256_set1_ps(a);
    __m256 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t n = 0; n < N; n += 8) {
        const __m256 b = _mm256_loadu_ps(B + n), c = _mm256_loadu_ps(C + n);
        for (int t = 0; t < 8; t++) {
            float *row = s + t * N + n;
            const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(row), va, _mm256_mul_ps(_mm256_set1_ps(dx[t]), b));
            _mm256_storeu_ps(row, v);
            acc[t] = _mm256_fmadd_ps(v, c, acc[t]);
        }
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* State update and readout of head j (rank j / G of group j % G): its p inputs xs, its group's B and Cm,
   its p outputs y. */
static void ssm_head(const mamba *L, int64_t j, const float *xs, const float *B, const float *Cm, float dt,
                     float *slab, float *y) {
    const int64_t G = L->groups, p = L->head_dim, N = L->state;
    const float dtj = fminf(fmaxf(softplus(dt + L->dt_bias[j]), L->dt_min), L->dt_max);
    const float a = expf(dtj * L->A[j]);
    float *s = slab + (j / G) * p * N;
    int64_t i = 0;
    if (N % 8 == 0)
        for (; i + 8 <= p; i += 8, s += 8 * N) {
            float dx[8];
            for (int t = 0; t < 8; t++) dx[t] = dtj * xs[i + t];
            const __m256 x = _mm256_loadu_ps(xs + i);
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_set1_ps(L->D[j]), x, ssm_rows8(s, N, a, dx, B, Cm)));
        }
    for (; i < p; i++, s += N) y[i] = ssm_row(s, a, dtj * xs[i], B, Cm, N) + L->D[j] * xs[i];
}

/* 8 channels' 4 taps, channel-major (r[i] holds channels 2i, 2i + 1), as tap-major t[j] (tap j of the
   channels in the order 0 2 4 6 | 1 3 5 7), and back. */
static inline void taps_of(const __m256 r[4], __m256 t[4]) {
    const __m256 u0 = _mm256_unpacklo_ps(r[0], r[1]), u1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 u2 = _mm256_unpacklo_ps(r[2], r[3]), u3 = _mm256_unpackhi_ps(r[2], r[3]);
    t[0] = _mm256_shuffle_ps(u0, u2, 0x44), t[1] = _mm256_shuffle_ps(u0, u2, 0xEE);
    t[2] = _mm256_shuffle_ps(u1, u3, 0x44), t[3] = _mm256_shuffle_ps(u1, u3, 0xEE);
}

static inline void channels_of(const __m256 t[4], __m256 r[4]) {
    const __m256 l01 = _mm256_unpacklo_ps(t[0], t[1]), l23 = _mm256_unpacklo_ps(t[2], t[3]);
    const __m256 h01 = _mm256_unpackhi_ps(t[0], t[1]), h23 = _mm256_unpackhi_ps(t[2], t[3]);
    r[0] = _mm256_shuffle_ps(l01, l23, 0x44), r[1] = _mm256_shuffle_ps(l01, l23, 0xEE);
    r[2] = _mm256_shuffle_ps(h01, h23, 0x44), r[3] = _mm256_shuffle_ps(h01, h23, 0xEE);
}

/* The 4-tap convolution of 8 channels (state s, weights w [8, 4], inputs x [8], bias b or NULL): out[i] is
   the dot of channel i's window with its weights, in the scalar loop's order (out may be x). One channel
   at a time it was a chain of 4 dependent multiply-adds and 8 scalar moves each (1-2 us a Mamba block). */
static inline void conv8(float *s, const float *w, const float *b, const float *x, float *out) {
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), back = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 r[4], t[4], k[4];
    for (int i = 0; i < 4; i++) r[i] = _mm256_loadu_ps(s + 8 * i);
    taps_of(r, t);
    for (int i = 0; i < 4; i++) r[i] = _mm256_loadu_ps(w + 8 * i);
    taps_of(r, k);
    t[0] = t[1], t[1] = t[2], t[2] = t[3], t[3] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x), order);
    __m256 a = _mm256_fmadd_ps(t[0], k[0], _mm256_setzero_ps());
    for (int j = 1; j < 4; j++) a = _mm256_fmadd_ps(t[j], k[j], a);
    a = _mm256_permutevar8x32_ps(a, back);
    _mm256_storeu_ps(out, b ? _mm256_add_ps(a, _mm256_loadu_ps(b)) : a);
    channels_of(t, r);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(s + 8 * i, r[i]);
}

/* The bytes of one channel's convolution state: K values, float32 or (L->bf16) bf16. */
static inline int64_t conv_row_bytes(const mamba *L) { return L->conv_k * (L->bf16 ? 2 : 4); }

/* Channel c's convolution state in a state laid out as the cache's ([channels, K]). */
static inline void *conv_at(const mamba *L, void *conv, int64_t c) { return (char *)conv + c * conv_row_bytes(L); }

/* The causal depthwise convolution of channels [c0, c1) of xbc (shift each one's window, one dot), then
   silu, into out [c1 - c0] (which may be xbc + c0); `state` holds the run's states, channel c0's first.
   A bf16 state (L->bf16) is widened a run of channels at a time and rounded back. */
static void conv_channels(const mamba *L, void *state, const float *xbc, float *out, int64_t c0, int64_t c1) {
    const int64_t kp = L->heads * L->head_dim, K = L->conv_k;
    float wide[8 * K];
    for (int64_t c = c0; c < c1;) {
        const int64_t o = c < kp ? c : c - kp; /* within x's channels or B, C's */
        const float *w = (c < kp ? L->conv_x : L->conv_bc) + o * K;
        const float *bias = c < kp ? L->conv_bias_x : L->conv_bias_bc;
        const int64_t run = K == 4 && c + 8 <= c1 && (c >= kp || c + 8 <= kp) ? 8 : 1;
        uint16_t *stored = L->bf16 ? (uint16_t *)state + (c - c0) * K : NULL;
        float *s = stored ? wide : (float *)state + (c - c0) * K;
        if (stored) widen(stored, s, run * K);
        if (run == 8) {
            conv8(s, w, bias ? bias + o : NULL, xbc + c, out + (c - c0));
        } else {
            float a = 0.f;
            for (int64_t j = 0; j < K - 1; j++) a += (s[j] = s[j + 1]) * w[j];
            a += (s[K - 1] = xbc[c]) * w[K - 1];
            out[c - c0] = bias ? a + bias[o] : a;
        }
        if (stored) narrow(s, stored, run * K);
        c += run;
    }
    silu_into(out, NULL, c1 - c0);
}

/* RMSNorm, in place, of the r runs of p channels y + q ldy, q < r, scaled by w + q ldw (Mamba2's gated
   norm of a group; r 1 makes the plain RMSNorm of p channels). The decode step and norm_rows share it, so
   a prompt's norm and a token's sum in the same order. */
static void norm_runs(float *y, int64_t ldy, const float *w, int64_t ldw, int64_t r, int64_t p, float eps) {
    float ss = 0.f;
    for (int64_t q = 0; q < r; q++) ss += sum_squares(y + q * ldy, p);
    const float rs = 1.f / sqrtf(ss / (float)(r * p) + eps);
    for (int64_t q = 0; q < r; q++)
        for (int64_t i = 0; i < p; i++) y[q * ldy + i] = w[q * ldw + i] * (y[q * ldy + i] * rs);
}

/* norm_runs of group g of a rank-major row y of `groups` groups: its runs at (q groups + g) p, and w's. */
static void norm_group(float *y, const float *w, int64_t groups, int64_t p, int64_t r, int64_t g, float eps) {
    norm_runs(y + g * p, groups * p, w + g * p, groups * p, r, p, eps);
}

/* Gated RMSNorm of group g's r heads (q * G + g, rank-major) in y. */
static void group_norm(const mamba *L, float *y, int64_t g) {
    norm_group(y, L->gate_norm, L->groups, L->head_dim, L->heads / L->groups, g, L->eps);
}

/* The groups [g0, g1) this thread takes where there are at least as many groups as threads (mamba_block):
   G / T each, one more for the first G % T threads. */
static void groups_of(int64_t G, int64_t *g0, int64_t *g1) {
    const int64_t T = threads_here(), t = thread_here(), more = t < G % T ? t : G % T;
    *g0 = t * (G / T) + more, *g1 = *g0 + G / T + (t < G % T);
}

/* A group's convolution channels run by run: run q < r is head q * G + g's x channels, run r its B's, run
   r + 1 its C's. The first channel of run q in the cache's layout (x channels rank-major, then B and C
   group by group), its channels in *n, and where it starts within the group's runs laid end to end. */
static int64_t group_run(const mamba *L, int64_t g, int64_t q, int64_t *n, int64_t *at) {
    const int64_t G = L->groups, p = L->head_dim, N = L->state, r = L->heads / G, kp = L->heads * p;
    *n = q < r ? p : N;
    *at = q < r ? q * p : r * p + (q - r) * N;
    return q < r ? (q * G + g) * p : kp + (q - r) * G * N + g * N;
}

/* The bytes of a group's convolution states, its runs end to end, in whole cache lines. */
static int64_t group_conv_bytes(const mamba *L) {
    const int64_t channels = L->heads / L->groups * L->head_dim + 2 * L->state;
    return (channels * conv_row_bytes(L) + 63) / 64 * 64;
}

/* The bytes of a group's states on a thread's own pages: its convolution states, then its SSM slab. */
static int64_t group_state_bytes(const mamba *L) {
    return group_conv_bytes(L) + L->heads / L->groups * L->head_dim * L->state * 4;
}

/* Copy group g's states between the cache (`conv` in its layout, `ssm` [G, r, p, N]) and `mine`
   (group_state_bytes: the convolution runs end to end, then the SSM slab): into mine where `in`, else
   back. */
static void group_states(const mamba *L, void *conv, void *ssm, void *mine, int64_t g, int in) {
    for (int64_t q = 0, n, at; q < L->heads / L->groups + 2; q++) {
        void *there = conv_at(L, conv, group_run(L, g, q, &n, &at)), *here = conv_at(L, mine, at);
        memcpy(in ? here : there, in ? there : here, (size_t)(n * conv_row_bytes(L)));
    }
    const int64_t slab = L->heads / L->groups * L->head_dim * L->state;
    float *there = (float *)ssm + g * slab, *here = (float *)((char *)mine + group_conv_bytes(L));
    memcpy(in ? here : there, in ? there : here, sizeof(float) * (size_t)slab);
}

/* A thread's own rows for a group (mamba_block): its heads' inputs and outputs, its B and C. */
static int64_t mamba_own(const mamba *L) {
    const int64_t rp = L->heads / L->groups * L->head_dim;
    return 2 * LINE(rp) + LINE(2 * L->state);
}

static int64_t mamba_scratch(const mamba *L) {
    const int64_t kp = L->heads * L->head_dim;
    return LINE(2 * kp + 2 * L->groups * L->state + L->heads) + LINE(kp) + L->d;
}

/* conv [k*p + 2*G*N, K]: the last K inputs of the convolution; ssm [G, r, p, N] group-major. With at least
   as many groups as threads, a group's heads need only its own channels (its heads' x, its B and C), so
   each thread takes whole groups from the convolution to the gated norm with no barrier between. It works
   in rows of its own (`own`: the convolution's outputs, the heads' outputs) and copies only the normed
   outputs into y, for out_proj. In place in xbc and y, its writes went to lines the other thread had just
   written or read: where this VM's two vCPUs sat apart, the convolution and SSM update ran 3-4x slower on
   two threads than on one (docs/decode-speed.md, "Where two threads' time goes when the vCPUs sit
   apart"). In its own rows the demo decodes 1.06-1.08x faster there, 1.01-1.02x where they sit close.
   own_states: this thread's groups' states for the call (own_states_in), or NULL: conv's and ssm's. */
static void mamba_block(const mamba *L, const float *in, float *h, void *conv, void *own_states, float *ssm,
                        float *sh, float *x, float *own, member *me) {
    const int64_t d = L->d, k = L->heads, G = L->groups, p = L->head_dim, N = L->state;
    const int64_t r = k / G, kp = k * p, gn = G * N, C = kp + 2 * gn;
    /* y on a line of its own (LINE): the threads write their groups' heads of it, a head at a time (a line
       shared at each head's ends cost a demo token 1-4% where this VM's two vCPUs sat close, 4-10% where
       they sat apart, in-process A/Bs); z, xbc and dt stay one row, in_proj's */
    float *z = sh, *xbc = z + kp, *dt = xbc + C, *y = sh + LINE(kp + C + k), *out = y + LINE(kp);
    rms_norm(in, L->norm, x, d, L->eps);
    if (L->in_proj.out) { /* z, xbc, dt lie one after another, as in in_proj */
        product ip = {&L->in_proj, x, z};
        products(me, &ip, 1);
    } else {
        product ps[4] = {{&L->z, x, z}, {&L->x, x, xbc}, {&L->bc, x, xbc + kp}, {&L->dt, x, dt}};
        products(me, ps, 4);
    }
    meet(me);
    if (G >= threads_here()) {
        int64_t g0, g1;
        groups_of(G, &g0, &g1);
        for (int64_t g = g0; g < g1; g++) {
            float *xs = own, *bc = xs + LINE(r * p), *ys = bc + LINE(2 * N);
            char *mine = own_states ? (char *)own_states + (g - g0) * group_state_bytes(L) : NULL;
            float *slab = mine ? (float *)(mine + group_conv_bytes(L)) : ssm + g * r * p * N;
            for (int64_t q = 0, n, at; q < r + 2; q++) { /* its heads' x channels, B's, C's */
                const int64_t c0 = group_run(L, g, q, &n, &at);
                void *state = mine ? conv_at(L, mine, at) : conv_at(L, conv, c0);
                conv_channels(L, state, xbc, q < r ? xs + at : bc + at - r * p, c0, c0 + n);
            }
            for (int64_t q = 0; q < r; q++) {
                const int64_t j = q * G + g;
                ssm_head(L, j, xs + q * p, bc, bc + N, dt[j], slab, ys + q * p);
                silu_into(ys + q * p, z + j * p, p);
            }
            norm_runs(ys, p, L->gate_norm + g * p, G * p, r, p, L->eps);
            for (int64_t q = 0; q < r; q++) memcpy(y + (q * G + g) * p, ys + q * p, sizeof(float) * p);
        }
    } else {
        int64_t c0, c1;
        share(C, &c0, &c1);
        conv_channels(L, conv_at(L, conv, c0), xbc, xbc + c0, c0, c1);
        meet(me);
        #pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < k; j++) {
            const int64_t g = j % G;
            ssm_head(L, j, xbc + j * p, xbc + kp + g * N, xbc + kp + gn + g * N, dt[j], ssm + g * r * p * N, y + j * p);
            silu_into(y + j * p, z + j * p, p);
        }
        meet(me);
        #pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < G; g++) group_norm(L, y, g);
    }
    meet(me);
    product o = {&L->out, y, out};
    products(me, &o, 1);
    for (int64_t i = o.n0; i < o.n1; i++) h[i] = in[i] + out[i];
}

/* ---------------------------------------------------------------------------------------- attention */

typedef struct {
    const float *norm;
    weight q, k, v, o;
    int64_t d, heads, kv_heads, head_dim;
    float eps;
    int64_t bf16; /* the K / V caches are bf16 (a bfloat16 model's) */
} attention;

/* How many runs of positions each KV head's cache is read in, (KV head, run) units shared among the
   threads: one per ATT_RUN positions, at most ATT_RUNS. A function of the positions alone, not of the
   thread count, so a token's attention sums in the same order on any number of threads (as the products
   do); 32 runs of two KV heads keep 16 threads busy. */
#define ATT_RUN 256
#define ATT_RUNS 32
static int64_t attention_runs(int64_t T) {
    const int64_t runs = (T + ATT_RUN - 1) / ATT_RUN;
    return runs < ATT_RUNS ? runs : ATT_RUNS;
}

/* Not a float more for a longer context: the scores are never stored whole (`attend`), and a head's runs
   are at most ATT_RUNS. */
static int64_t attention_scratch(const attention *L) {
    const int64_t H = L->heads, hd = L->head_dim;
    return 2 * H * hd + 2 * L->kv_heads * hd + H * ATT_RUNS * (hd + 2) + L->d;
}

/* A thread's own rows for a KV head's one run (attention_block): its query heads' sums. */
static int64_t attention_own(const attention *L) { return L->heads / L->kv_heads * LINE(L->head_dim + 2); }

/* Eight scores q.k for key rows k[0..7] (hd % 8 == 0): one vector. Eight positions' products summed
   across their lanes at once, where one position at a time paid a whole horizontal sum for each. */
static inline __m256 dot8(const float *q, const float *const k[8], int64_t hd) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[t] + c), a[t]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

#define ATT_BLOCK 64 /* positions a block: their key and value rows (16 KB each at head size 64) stay in L1 / L2
                        between the heads (64 against 32: 1.03-1.14x, demo, 2048 positions) */

/* One unit of a token's attention: the r query heads of KV head g (g, g + KV, ..; rank-major) over
   positions [t0, t1), as running softmax sums (flash-decoding): per head, at part + i * stride, its largest
   score m, l = sum e^(score - m) and acc [hd] = sum e^(score - m) v. A block of positions at a time, each
   key and value row read from memory once for all r heads; per head a block's scores, then their
   exponentials, then the weighted values, each a run of independent vector operations. Position pos, this
   token's own, is read from kn / vn, where the products left it. bf16 caches (`bf16`): a block's rows are
   widened once for all r heads. */
static void attend(const float *q, int64_t KV, int64_t g, int64_t r, int64_t hd, const void *K, const void *V,
                   int bf16, const float *kn, const float *vn, int64_t pos, int64_t t0, int64_t t1, float scale,
                   float *part, int64_t stride) {
    float wide[bf16 ? 2 * ATT_BLOCK * hd : 1];
    for (int64_t i = 0; i < r; i++) {
        float *u = part + i * stride;
        u[0] = -INFINITY, u[1] = 0.f;
        memset(u + 2, 0, sizeof(float) * hd);
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 none = _mm256_set1_ps(-INFINITY);
    for (int64_t b = t0; b < t1; b += ATT_BLOCK) {
        const int64_t n = t1 - b < ATT_BLOCK ? t1 - b : ATT_BLOCK, n8 = (n + 7) / 8 * 8;
        const float *k[ATT_BLOCK], *v[ATT_BLOCK]; /* rows past n: row b's, weighted 0 */
        for (int64_t t = 0; t < n8; t++) {
            const int64_t at = b + (t < n ? t : 0);
            if (at == pos) {
                k[t] = kn, v[t] = vn;
            } else if (!bf16) {
                k[t] = (const float *)K + at * hd, v[t] = (const float *)V + at * hd;
            } else if (t < n) {
                float *kw = wide + 2 * t * hd, *vw = kw + hd;
                widen((const uint16_t *)K + at * hd, kw, hd), widen((const uint16_t *)V + at * hd, vw, hd);
                k[t] = kw, v[t] = vw;
            } else {
                k[t] = k[0], v[t] = v[0];
            }
        }
        for (int64_t i = 0; i < r; i++) {
            const float *qi = q + (i * KV + g) * hd;
            float *u = part + i * stride, *acc = u + 2, s[ATT_BLOCK], w[ATT_BLOCK];
            __m256 most = none;
            for (int64_t c = 0; c < n8; c += 8) {
                __m256 sc;
                if (hd % 8 == 0) {
                    sc = dot8(qi, k + c, hd);
                } else {
                    for (int64_t t = 0; t < 8; t++) s[c + t] = dot(qi, k[c + t], hd);
                    sc = _mm256_loadu_ps(s + c);
                }
                const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - c)), lane));
                sc = _mm256_blendv_ps(none, _mm256_mul_ps(sc, _mm256_set1_ps(scale)), valid);
                _mm256_storeu_ps(s + c, sc);
                most = _mm256_max_ps(most, sc);
            }
            const float top = max8(most);
            if (top > u[0]) { /* a new largest score: rescale what is summed so far */
                const float c = expf(u[0] - top);
                u[1] *= c;
                for (int64_t j = 0; j < hd; j++) acc[j] *= c;
                u[0] = top;
            }
            __m256 l = _mm256_setzero_ps();
            for (int64_t c = 0; c < n8; c += 8) { /* exp256 takes a padding lane's e^-inf to 1e-38: masked to 0 */
                const __m256 sc = _mm256_loadu_ps(s + c), e = exp256(_mm256_sub_ps(sc, _mm256_set1_ps(u[0])));
                const __m256 p = _mm256_and_ps(e, _mm256_cmp_ps(sc, none, _CMP_NEQ_OQ));
                _mm256_storeu_ps(w + c, p);
                l = _mm256_add_ps(l, p);
            }
            u[1] += sum8(l);
            int64_t j = 0;
            for (; j + 32 <= hd; j += 32) { /* the loop below for four column vectors at once: eight chains */
                __m256 a[4][2];
                for (int c = 0; c < 4; c++) a[c][0] = _mm256_loadu_ps(acc + j + 8 * c), a[c][1] = _mm256_setzero_ps();
                for (int64_t t = 0; t < n8; t += 2) {
                    const __m256 w0 = _mm256_set1_ps(w[t]), w1 = _mm256_set1_ps(w[t + 1]);
                    for (int c = 0; c < 4; c++) {
                        a[c][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v[t] + j + 8 * c), a[c][0]);
                        a[c][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v[t + 1] + j + 8 * c), a[c][1]);
                    }
                }
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + j + 8 * c, _mm256_add_ps(a[c][0], a[c][1]));
            }
            for (; j + 8 <= hd; j += 8) { /* two sums a column, even and odd positions: half the chain */
                __m256 a0 = _mm256_loadu_ps(acc + j), a1 = _mm256_setzero_ps();
                for (int64_t t = 0; t < n8; t += 2) {
                    a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), _mm256_loadu_ps(v[t] + j), a0);
                    a1 = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 1]), _mm256_loadu_ps(v[t + 1] + j), a1);
                }
                _mm256_storeu_ps(acc + j, _mm256_add_ps(a0, a1));
            }
            for (; j < hd; j++)
                for (int64_t t = 0; t < n8; t++) acc[j] += w[t] * v[t][j];
        }
    }
}

/* A head's output o [hd] from its S runs' sums u [S, hd + 2] (attend's m, l, acc): each run rescaled to the
   largest score of them all. */
static void merge_runs(const float *u, int64_t S, int64_t hd, float *o) {
    if (S == 1) {
        for (int64_t i = 0; i < hd; i++) o[i] = u[2 + i] / u[1];
        return;
    }
    float top = -INFINITY, l = 0.f;
    for (int64_t s = 0; s < S; s++) top = fmaxf(top, u[s * (hd + 2)]);
    for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
    for (int64_t s = 0; s < S; s++) {
        const float *us = u + s * (hd + 2);
        const float c = expf(us[0] - top);
        l += us[1] * c;
        for (int64_t i = 0; i < hd; i++) o[i] += us[2 + i] * c;
    }
    for (int64_t i = 0; i < hd; i++) o[i] /= l;
}

/* kc, vc [KV, capacity, hd]: positions < pos are cached; this token's key and value go to pos. Its own
   position's key and value are read from where the products left them, so the cache is written while
   other threads read it (positions before pos only). The cache is read in (KV head, run of positions)
   units (attention_runs); with more than one run per head, a second pass merges each head's runs. */
static void attention_block(const attention *L, const float *in, float *h, void *kc, void *vc, int64_t capacity,
                            int64_t pos, float *sh, float *x, float *own, member *me) {
    const int64_t d = L->d, H = L->heads, KV = L->kv_heads, hd = L->head_dim, T = pos + 1, r = H / KV;
    const int64_t S = attention_runs(T), run = ((T + S - 1) / S + 7) / 8 * 8;
    float *q = sh, *kn = q + H * hd, *vn = kn + KV * hd, *att = vn + KV * hd, *part = att + H * hd;
    float *out = part + H * S * (hd + 2); /* part [H, S, hd + 2]: head j's run s at (j * S + s) * (hd + 2) */
    const float scale = 1.f / sqrtf((float)hd);
    rms_norm(in, L->norm, x, d, L->eps);
    product qkv[3] = {{&L->q, x, q}, {&L->k, x, kn}, {&L->v, x, vn}};
    products(me, qkv, 3);
    meet(me);
    int64_t c0, c1;
    share(KV * hd, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
        const int64_t at = ((c / hd) * capacity + pos) * hd + c % hd;
        if (L->bf16) {
            ((uint16_t *)kc)[at] = narrow1(kn[c]), ((uint16_t *)vc)[at] = narrow1(vn[c]);
        } else {
            ((float *)kc)[at] = kn[c], ((float *)vc)[at] = vn[c];
        }
    }
    #pragma omp for schedule(static) nowait
    for (int64_t unit = 0; unit < KV * S; unit++) {
        const int64_t g = unit / S, s = unit % S, t0 = s * run < T ? s * run : T, t1 = t0 + run < T ? t0 + run : T;
        /* one run a head: its sums in this thread's own rows (mamba_block says why); more: in part, where the
           merge below reads them */
        float *mine = S == 1 ? own : part + (g * S + s) * (hd + 2);
        const int64_t stride = S == 1 ? LINE(hd + 2) : KV * S * (hd + 2); /* query head g's slot to g + KV's */
        const int64_t at = g * capacity * hd, size = L->bf16 ? 2 : 4;
        attend(q, KV, g, r, hd, (const char *)kc + at * size, (const char *)vc + at * size, (int)L->bf16, kn + g * hd,
               vn + g * hd, pos, t0, t1, scale, mine, stride);
        for (int64_t i = 0; i < r && S == 1; i++) { /* the head's one run: its output */
            const float *u = mine + i * stride;
            for (int64_t j = 0; j < hd; j++) att[(i * KV + g) * hd + j] = u[2 + j] / u[1];
        }
    }
    meet(me);
    if (S > 1) {
        #pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < H; j++) merge_runs(part + j * S * (hd + 2), S, hd, att + j * hd);
        meet(me);
    }
    product o = {&L->o, att, out};
    products(me, &o, 1);
    for (int64_t i = o.n0; i < o.n1; i++) h[i] = in[i] + out[i];
}

/* ------------------------------------------------------------------------------------ MoE and MLP */

typedef struct {
    const float *norm;
    const float *gate;    /* router [E, ld_gate] float32 */
    const float *bias;    /* e_score_correction_bias [E] */
    const weight *up, *down; /* one per expert the budget keeps */
    weight shared_up, shared_down;
    int64_t d, experts, top_k, ld_gate, norm_top_k, hidden; /* hidden: the widest up projection */
    float scaling, eps;
} moe;

/* Router (moe.py's route with n_group 1): the top-k of sigmoid scores plus bias, weighted by the scores.
   Eight experts' logits at a time where d allows (dot8: eight independent sums, where one expert at a time
   was a chain of d / 8 dependent multiply-adds and a horizontal sum: a demo layer 641-710 TSC cycles a
   thread, from 857-1172; rdtsc build, scratch). */
static void route(const moe *L, const float *x, int64_t *ids, float *w) {
    const int64_t E = L->experts, k = L->top_k, d = L->d;
    float score[E], choice[E], total = 0.f;
    int64_t e = 0;
    if (d % 8 == 0)
        for (; e + 8 <= E; e += 8) {
            const float *rows[8];
            for (int t = 0; t < 8; t++) rows[t] = L->gate + (e + t) * L->ld_gate;
            _mm256_storeu_ps(score + e, dot8(x, rows, d));
        }
    for (; e < E; e++) score[e] = dot(L->gate + e * L->ld_gate, x, d);
    for (e = 0; e < E; e++) {
        score[e] = 1.f / (1.f + expf(-score[e]));
        choice[e] = score[e] + L->bias[e];
    }
    for (int64_t i = 0; i < k; i++) { /* best first */
        int64_t best = -1;
        for (e = 0; e < E; e++)
            if (choice[e] != -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
        ids[i] = best;
        choice[best] = -INFINITY;
        total += (w[i] = score[best]);
    }
    for (int64_t i = 0; i < k; i++) w[i] = (L->norm_top_k ? w[i] / (total + 1e-20f) : w[i]) * L->scaling;
}

/* route for each of n tokens x [n, d] (contiguous) into ids [n, k] and w [n, k]: a prompt's routing, by the
   decode step's code. torch ran it as a matmul, a sigmoid, a topk and five more ops: 1.2 ms of a 128-token
   100m prompt's six layers, against 0.6 here (timed in place, scratch; alone, both took 85-88 us a layer).
   gate [E, ld_gate], bias [E]. 0. */
int route_rows(const float *x, int64_t n, int64_t d, const float *gate, int64_t ld_gate, const float *bias,
               int64_t E, int64_t k, int64_t norm_top_k, float scaling, int64_t *ids, float *w, int threads) {
    const moe L = {.gate = gate, .bias = bias, .d = d, .experts = E, .top_k = k, .ld_gate = ld_gate,
                   .norm_top_k = norm_top_k, .scaling = scaling};
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * E * d >= 1 << 16)
    for (int64_t t = 0; t < n; t++) route(&L, x + t * d, ids + t * k, w + t * k);
    return 0;
}

/* max(v, 0)^2 in place, 8 at a time: as `v > 0 ? v * v : 0` the compiler kept a branch and one float at a
   time (about 2 us of a full demo token). vmaxps returns its second operand, 0, for a NaN or a -0, as the
   scalar form does, so the bits are the same. */
static void relu2(float *v, int64_t n0, int64_t n1) {
    int64_t i = n0;
    for (; i + 8 <= n1; i += 8) {
        const __m256 x = _mm256_max_ps(_mm256_loadu_ps(v + i), _mm256_setzero_ps());
        _mm256_storeu_ps(v + i, _mm256_mul_ps(x, x));
    }
    for (; i < n1; i++) v[i] = v[i] > 0.f ? v[i] * v[i] : 0.f;
}

static int64_t moe_scratch(const moe *L) { return (L->top_k + 1) * (L->hidden + L->d); }

/* The k routed experts and the shared one (the last of k + 1 hidden / out rows), their outputs summed in
   the torch path's order: experts best first, then the shared expert. Every thread routes for itself (the
   same numbers from the same code). The down projections share d alike, so each thread sums its own. */
static void moe_block(const moe *L, const float *in, float *h, float *sh, float *x, member *me) {
    const int64_t d = L->d, k = L->top_k, I = L->hidden;
    float *hidden = sh, *outs = hidden + (k + 1) * I, w[k];
    int64_t ids[k];
    rms_norm(in, L->norm, x, d, L->eps);
    route(L, x, ids, w);
    product up[k + 1], down[k + 1];
    for (int64_t i = 0; i <= k; i++) {
        up[i] = (product){i < k ? &L->up[ids[i]] : &L->shared_up, x, hidden + i * I};
        down[i] = (product){i < k ? &L->down[ids[i]] : &L->shared_down, hidden + i * I, outs + i * d};
    }
    products(me, up, (int)k + 1);
    for (int64_t i = 0; i <= k; i++) relu2(up[i].y, up[i].n0, up[i].n1);
    meet(me);
    own(me, down, 1);
    for (int64_t i = 1; i <= k; i++) down[i].n0 = down[0].n0, down[i].n1 = down[0].n1;
    runs(me, down, (int)k + 1);
    /* 8 channels at a time, each lane the scalar tail's arithmetic (a fused multiply-add per expert): one
       channel at a time, with the loop over the experts inside, this was 40% of a demo token's step outside
       its products and attention (perf, one thread) */
    int64_t c = down[0].n0;
    for (; c + 8 <= down[0].n1; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i++)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(outs + i * d + c), _mm256_set1_ps(w[i]), acc);
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(outs + k * d + c));
        _mm256_storeu_ps(h + c, _mm256_add_ps(_mm256_loadu_ps(in + c), acc));
    }
    for (; c < down[0].n1; c++) {
        float acc = 0.f;
        for (int64_t i = 0; i < k; i++) acc = fmaf(outs[i * d + c], w[i], acc);
        h[c] = in[c] + (acc + outs[k * d + c]);
    }
}

typedef struct {
    const float *norm;
    weight up, down;
    int64_t d;
    float eps;
} mlp;

static int64_t mlp_scratch(const mlp *L) { return L->up.out + L->d; }

static void mlp_block(const mlp *L, const float *in, float *h, float *sh, float *x, member *me) {
    float *hidden = sh, *out = hidden + L->up.out;
    rms_norm(in, L->norm, x, L->d, L->eps);
    product up = {&L->up, x, hidden};
    products(me, &up, 1);
    relu2(hidden, up.n0, up.n1);
    meet(me);
    product down = {&L->down, hidden, out};
    products(me, &down, 1);
    for (int64_t i = down.n0; i < down.n1; i++) h[i] = in[i] + out[i];
}

/* -------------------------------------------------------------------------------------- the step */

typedef struct {
    int64_t kind;     /* the block letter: 'M', '*', 'E' or '-' */
    const void *args; /* its mamba / attention / moe / mlp */
} block;

/* What a budget's decode step reads that does not change from token to token (model/step.py's Step,
   built once per budget): one pointer to pass, where a dozen arguments cost Python more than a small
   budget's whole step saves. */
typedef struct {
    const block *blocks;
    int64_t n;
    void *const *state;      /* [2n]: block i's conv and SSM states or its K and V caches, set by step.py
                                (Mamba states once per cache, K / V caches each token) */
    const int64_t *capacity; /* [n]: the K / V caches' */
    float *h;                /* [d]: the residual stream */
    const void *embed;       /* [V, ld_embed], float32 or (embed_bf16) bf16 */
    int64_t ld_embed;
    const float *norm;       /* norm_f */
    const weight *lm_head;
    int64_t d;
    float eps;
    double *balance;         /* [1 + BALANCED]: the threads' shares of the products (`rebalance`), or NULL */
    int64_t embed_bf16;
} step;

/* Token `tok`'s embedding row, where it lies, or widened into `wide` [d] from bf16. */
static const float *embedding(const step *s, int64_t tok, float *wide) {
    if (!s->embed_bf16) return (const float *)s->embed + tok * s->ld_embed;
    widen((const uint16_t *)s->embed + tok * s->ld_embed, wide, s->d);
    return wide;
}

/* The first largest of v[0..n), a NaN counted largest (numpy's argmax, which the engine's greedy sampling
   takes on the torch path): the same token either way. */
static int64_t first_max(const float *v, int64_t n) {
    /* 8 at a time (one at a time it took 0.55 us of a demo token on each thread): the largest value and
       whether any is NaN, then the first position holding it (-0 and +0 compare equal, as with `>`) */
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        top = _mm256_max_ps(top, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int q = 0; q < 8; q++) m = lanes[q] > m ? lanes[q] : m;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < n; j++) {
        any_nan |= isnan(v[j]);
        m = v[j] > m ? v[j] : m;
    }
    if (any_nan) {
        for (i = 0; i < n; i++)
            if (isnan(v[i])) return i;
    }
    const __m256 vm = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), vm, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (v[i] == m) return i;
    return 0; /* n = 0 */
}

/* Where whole Mamba groups go to each of two or more threads, each thread keeps its groups' convolution
   states and SSM slabs on pages of its own for a call of OWN_STATES_TOKENS or more: copied in here, back by
   own_states_out. In the cache's layout a thread's convolution channels alternate with another's a head
   at a time and its SSM slab borders another's; beside the other thread its convolution of B and C ran
   1.5x slower than alone and its SSM update 1.1x, although no line is written by both (likely the
   hardware prefetcher, following one thread's runs, fetching the lines beyond them, which the other
   thread writes at every token); on pages of its own, as fast as alone. The demo's greedy runs of 128
   tokens, with the convolution states alone: 0.98-1.01x (full) and 1.01-1.03x (small) where the VM's
   vCPUs sat close, 1.03-1.05x and 1.04-1.06x apart; the SSM slabs as well, a further 0.99-1.00x and
   1.00x close, 1.01-1.03x and 1.02-1.06x apart. A one-token call paid the copies without the gain
   (0.99-1.00x), so a call of fewer than OWN_STATES_TOKENS keeps the cache's layout: the copies grow with
   the states, the gain with the tokens (docs/decode-speed.md, "Two threads apart").
   mine[i]: block i's, or NULL; returns the memory. */
#define OWN_STATES_TOKENS 16

/* OWN_STATES_TOKENS, for the tests: the calls they make must be as long to take the copies. */
int own_states_tokens(void) { return OWN_STATES_TOKENS; }

static char *own_states_in(const step *s, void **mine, int64_t tokens) {
    const int64_t T = tokens >= OWN_STATES_TOKENS ? threads_here() : 1;
    int64_t at[s->n], bytes = 0, g0, g1; /* each block's place in the memory, -1 for none */
    for (int64_t i = 0; i < s->n; i++) {
        const mamba *L = s->blocks[i].args;
        at[i] = -1;
        if (s->blocks[i].kind != 'M' || T == 1 || L->groups < T) continue;
        groups_of(L->groups, &g0, &g1);
        at[i] = bytes, bytes += (g1 - g0) * group_state_bytes(L);
    }
    char *all = bytes ? aligned_alloc(4096, (size_t)((bytes + 4095) / 4096 * 4096)) : NULL;
    for (int64_t i = 0; i < s->n; i++) { /* without the memory, the cache's layout */
        mine[i] = all && at[i] >= 0 ? all + at[i] : NULL;
        if (!mine[i]) continue;
        const mamba *L = s->blocks[i].args;
        groups_of(L->groups, &g0, &g1);
        for (int64_t g = g0; g < g1; g++) /* group g's states at its place in mine[i] */
            group_states(L, s->state[2 * i], s->state[2 * i + 1], (char *)mine[i] + (g - g0) * group_state_bytes(L),
                         g, 1);
    }
    return all;
}

static void own_states_out(const step *s, void *const *mine, char *all) {
    for (int64_t i = 0; i < s->n; i++) {
        if (!mine[i]) continue;
        const mamba *L = s->blocks[i].args;
        int64_t g0, g1;
        groups_of(L->groups, &g0, &g1);
        for (int64_t g = g0; g < g1; g++)
            group_states(L, s->state[2 * i], s->state[2 * i + 1], (char *)mine[i] + (g - g0) * group_state_bytes(L),
                         g, 0);
    }
    free(all);
}

/* Tokens from `token` at position `pos` in one call and one parallel region (per block a call from Python
   costs more than a small block's work, about 6 us each measured with empty blocks, and waking the threads
   once per block about 1 us). With `out` NULL, one step: the logits [V] of `token`. Otherwise up to `n`
   steps, each next token written to out, the last step's logits left in `logits`: the first_max of the
   logits, or with `draw` the token u[t] draws (sample.c; thread 0 draws, the others wait at a meeting). It
   stops after a token in stops[nstops] (the engine's phase machine decides there) and after the token
   during which *halt became non-zero (a live switch or a cancel from another thread). Returns the tokens
   run; -1 where the scratch buffer could not be allocated; -2 - t where step t's logits were not finite
   numbers to draw from (its token consumed, t tokens in out). */
static int64_t run_tokens(const step *s, int64_t token, int64_t pos, int64_t n, const int64_t *stops,
                          int64_t nstops, const int32_t *halt, const sampling *draw, const float *u,
                          int64_t *out, float *logits, int threads) {
    const int64_t blocks = s->n, d = s->d, V = s->lm_head->out;
    int64_t shared = 0, owns = 0; /* the scratch all threads share; the rows each thread owns */
    for (int64_t i = 0; i < blocks; i++) {
        const void *L = s->blocks[i].args;
        const int64_t kind = s->blocks[i].kind;
        const int64_t need = kind == 'M' ? mamba_scratch(L) : kind == '*' ? attention_scratch(L)
                             : kind == 'E' ? moe_scratch(L) : mlp_scratch(L);
        const int64_t own = kind == 'M' ? mamba_own(L) : kind == '*' ? attention_own(L) : 0;
        shared = need > shared ? need : shared;
        owns = own > owns ? own : owns;
    }
    shared = LINE(shared);
    const int64_t dx = LINE(d); /* each thread's normed input, a cache line apart */
    const int64_t rows = s->embed_bf16 ? 2 * dx : dx; /* and its copy of a bf16 embedding row, widened */
    const int64_t each = rows + owns;
    /* on a line; after the threads' rows, a draw's probabilities [V] and sort keys [V] */
    const int64_t rows_end = LINE(shared + (threads > 1 ? threads : 1) * each);
    float *buf = aligned_alloc(64, sizeof(float) * (rows_end + (draw ? LINE(V) + LINE(2 * V) : 0)));
    if (!buf) return -1;
    float *probs = buf + rows_end;
    uint64_t *keys = (uint64_t *)(probs + LINE(V));
    float *h = s->h;
    const unsigned int csr = _mm_getcsr(); /* the caller's float mode (torch.set_flush_denormal sets its own
                                              thread's only): every thread routes the MoE blocks itself, so
                                              all of them compute in the same mode */
    meeting all = {0, 0};
    /* each thread's {product cycles, weights read}, a cache line each */
    double tally[threads > 1 ? threads : 1][8] __attribute__((aligned(64)));
    memset(tally, 0, sizeof tally);
    int64_t ran = 0, team_size = 1;
    int halted = 0; /* thread 0's reading of *halt, shared through the meet after the head */
    int64_t drawn = 0, bad = -1; /* thread 0's draw, shared through the meet after it; the step it failed */
    #pragma omp parallel num_threads(threads)
    {
        const int64_t team = threads_here(); /* libgomp may give fewer threads than asked */
        double cut[team + 1];
        cuts_of(s->balance, team, cut);
        member me = member_of(&all, cut);
        const unsigned int own_csr = _mm_getcsr();
        _mm_setcsr(csr);
        if (thread_here() == 0) team_size = team;
        float *x = buf + shared + thread_here() * each, *row = x + dx, *own = x + rows;
        const float *in = embedding(s, token, row); /* the residual stream into the next block */
        void *own_states[blocks];
        char *own_memory = own_states_in(s, own_states, n);
        for (int64_t t = 0; t < n; t++) {
            /* a token in four timed, where rebalance keeps shares for the team */
            me.tally = team > 1 && team <= BALANCED && t % 4 == 0 ? tally[thread_here()] : NULL;
            for (int64_t i = 0; i < blocks; i++) {
                void *a = s->state[2 * i];
                float *b = s->state[2 * i + 1];
                const void *L = s->blocks[i].args;
                switch (s->blocks[i].kind) {
                case 'M': mamba_block(L, in, h, a, own_states[i], b, buf, x, own, &me); break;
                case '*': attention_block(L, in, h, a, b, s->capacity[i], pos + t, buf, x, own, &me); break;
                case 'E': moe_block(L, in, h, buf, x, &me); break;
                default: mlp_block(L, in, h, buf, x, &me);
                }
                meet(&me);
                in = h;
            }
            rms_norm(in, s->norm, x, d, s->eps);
            product head = {s->lm_head, x, logits};
            products(&me, &head, 1);
            if (!out) break;
            if (thread_here() == 0) halted = halt && atomic_load_explicit((const _Atomic int32_t *)halt,
                                                                         memory_order_relaxed);
            meet(&me); /* every thread reads the whole of the logits, and `halted` */
            int64_t tok;
            if (draw) {
                if (thread_here() == 0) drawn = sample_row(logits, V, draw, u[t], probs, keys);
                meet(&me);
                if ((tok = drawn) < 0) {
                    if (thread_here() == 0) bad = t;
                    break;
                }
            } else {
                tok = first_max(logits, V);
            }
            int stop = halted;
            for (int64_t j = 0; j < nstops; j++) stop |= tok == stops[j];
            if (thread_here() == 0) out[t] = tok, ran = t + 1;
            if (stop || t + 1 == n) break;
            in = embedding(s, tok, row);
        }
        own_states_out(s, own_states, own_memory);
        _mm_setcsr(own_csr);
    }
    free(buf);
    if (team_size > 1) {
        double cycles[team_size], weights[team_size];
        for (int64_t t = 0; t < team_size; t++) cycles[t] = tally[t][0], weights[t] = tally[t][1];
        rebalance(s->balance, team_size, cycles, weights);
    }
    return bad >= 0 ? -2 - bad : out ? ran : 1;
}

/* logits [V] of `token` at position `pos`; 0, or -1 (no memory for the scratch buffer). */
int decode_token(const step *s, int64_t token, int64_t pos, float *logits, int threads) {
    return run_tokens(s, token, pos, 1, NULL, 0, NULL, NULL, NULL, NULL, logits, threads) < 0 ? -1 : 0;
}

/* Up to n tokens after `token` at `pos` into out, greedy or (`draw`) drawn with u[n] (run_tokens); how
   many, -1 or -2 - t. */
int decode_ahead(const step *s, int64_t token, int64_t pos, int64_t n, const int64_t *stops, int64_t nstops,
                 const int32_t *halt, const sampling *draw, const float *u, int64_t *out, float *logits, int threads) {
    return (int)run_tokens(s, token, pos, n, stops, nstops, halt, draw, u, out, logits, threads);
}

/* ------------------------------------------------------------------------- a batch's rows in one step */

/* run for m rows of x: y[:, n0:n1] (rows ldy apart) = x [m, in] W^T[:, n0:n1], the formats' many-row kernels
   (a panel's tiles serve every row, a packed weight is decoded once for all of them). On panels the tiles
   sum each output in panels_vec's order, so a row's outputs have the bits it gets alone. */
static void run_rows(const product *p) {
    const weight *w = p->w;
    const int64_t M = p->m, N = p->ldy ? p->ldy : w->out, K = w->in, n0 = p->n0, n1 = p->n1;
    switch (w->format) {
    case PANELS_F32:
    case PANELS_BF16:
    case PANELS_FP8: {
        float c[gemm_p_scratch];
        gemm_p_part(p->x, w->w, w->ld, w->skip, p->y, M, N, K, n0, n1, c, kind_of(w->format), w->scale);
        break;
    }
    case ROWS_F32: part_f32(p->x, w->w, p->y, M, N, K, w->ld, n0, n1); break;
    case ROWS_BF16: part_bf16(p->x, w->w, p->y, M, N, K, w->ld, n0, n1); break;
    case FP8: part_fp8(p->x, w->w, p->y, M, N, K, w->ld, w->scale, n0, n1); break;
    case NVFP4_A4:
        if (M < nvfp4_a4_rows) {
            part_nvfp4_a4_rows(p->x, M, w->w, w->scales, p->y, N, K, w->ld, w->ld_scales, w->scale, w->input_scale,
                               n0, n1);
            break;
        }
        __attribute__((fallthrough)); /* more rows are rounded, then take the weight-only products */
    case NVFP4: {
        float *xp = malloc(sizeof(float) * M * K);
        if (xp) {
            nvfp4_x(w, p->x, xp, M);
            part_nvfp4(xp, w->w, w->scales, p->y, M, N, K, w->ld, w->ld_scales, w->scale, n0, n1);
            free(xp);
            break;
        }
        for (int64_t q = 0; q < M; q++) { /* no memory for all the rows' permuted inputs: a row at a time */
            float row[K];
            nvfp4_x(w, p->x + q * K, row, 1);
            part_nvfp4(row, w->w, w->scales, p->y + q * N, 1, N, K, w->ld, w->ld_scales, w->scale, n0, n1);
        }
    }
    }
}

/* What a batch's blocks read beside the step: R rows, row r's token at position pos[r], its states those of
   the cache's row index[r] (r where index is NULL), rows stride[i] bytes apart (state i of the step's table:
   the batched cache's [B, ...] tensors). The rows are S sequences' tokens, in order: rows [start[j],
   start[j + 1]) sequence j's (a prompt, a catch-up: its states carry from row to row; one row where it
   decodes). */
typedef struct {
    int64_t R;
    const int64_t *pos, *stride, *index;
    int64_t S;
    const int64_t *start;
} batch;

static inline void *row_state(const step *s, const batch *b, int64_t i, int64_t r) {
    return (char *)s->state[i] + (b->index ? b->index[r] : r) * b->stride[i];
}

/* Every row of H [R, d] normed into X [R, d] (each thread its own copy: no meeting). */
static void norm_all(const float *H, const float *w, float *X, int64_t R, int64_t d, float eps) {
    for (int64_t r = 0; r < R; r++) rms_norm(H + r * d, w, X + r * d, d, eps);
}

/* H[r, n0:n1] += OUT[r, n0:n1] for every row: this thread's outputs of the block's last product. */
static void add_rows(float *H, const float *OUT, int64_t R, int64_t d, int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = n0; i < n1; i++) H[r * d + i] = H[r * d + i] + OUT[r * d + i];
}

/* mamba_block for R rows: in_proj and out_proj on all rows at once, the convolution to the gated norm a
   (row, group) at a time, in place (the other threads work on other rows or groups). */
static void mamba_rows(const mamba *L, const step *s, const batch *b, int64_t i, float *H, float *sh, float *X,
                       member *me) {
    const int64_t R = b->R, d = L->d, k = L->heads, G = L->groups, p = L->head_dim, N = L->state;
    const int64_t r = k / G, kp = k * p, gn = G * N, C = kp + 2 * gn, row = kp + C + k;
    float *ZXD = sh, *Y = ZXD + R * row, *OUT = Y + R * kp; /* per row: z | xbc | dt, as in_proj's */
    norm_all(H, L->norm, X, R, d, L->eps);
    if (L->in_proj.out) {
        product ip = {&L->in_proj, X, ZXD, .m = R, .ldy = row};
        products(me, &ip, 1);
    } else {
        product ps[4] = {{&L->z, X, ZXD, .m = R, .ldy = row}, {&L->x, X, ZXD + kp, .m = R, .ldy = row},
                         {&L->bc, X, ZXD + 2 * kp, .m = R, .ldy = row}, {&L->dt, X, ZXD + kp + C, .m = R, .ldy = row}};
        products(me, ps, 4);
    }
    meet(me);
    #pragma omp for schedule(static) nowait
    for (int64_t u = 0; u < b->S * G; u++) { /* a (sequence, group): the sequence's rows one after another */
        const int64_t g = u % G, first = b->start[u / G], last = b->start[u / G + 1];
        for (int64_t q0 = first; q0 < last; q0++) {
            float *z = ZXD + q0 * row, *xbc = z + kp, *dt = xbc + C, *y = Y + q0 * kp;
            void *conv = row_state(s, b, 2 * i, q0);
            float *slab = (float *)row_state(s, b, 2 * i + 1, q0) + g * r * p * N;
            for (int64_t q = 0, n, at; q < r + 2; q++) { /* its heads' x channels, B's, C's */
                const int64_t c0 = group_run(L, g, q, &n, &at);
                conv_channels(L, conv_at(L, conv, c0), xbc, xbc + c0, c0, c0 + n);
            }
            for (int64_t q = 0; q < r; q++) {
                const int64_t j = q * G + g;
                ssm_head(L, j, xbc + j * p, xbc + kp + g * N, xbc + kp + gn + g * N, dt[j], slab, y + j * p);
                silu_into(y + j * p, z + j * p, p);
            }
            group_norm(L, y, g);
        }
    }
    meet(me);
    product o = {&L->out, Y, OUT, .m = R, .ldy = d};
    products(me, &o, 1);
    add_rows(H, OUT, R, d, o.n0, o.n1);
}

/* attention_block for R rows: q, k, v and o on all rows at once, a (row, KV head) at a time between (its
   runs of positions and their merge in attention_block's order; `part`: this thread's [r, ATT_RUNS, hd + 2]). */
static void attention_rows(const attention *L, const step *s, const batch *b, int64_t i, float *H, float *sh,
                           float *X, float *part, member *me) {
    const int64_t R = b->R, d = L->d, heads = L->heads, KV = L->kv_heads, hd = L->head_dim, r = heads / KV;
    float *Q = sh, *KN = Q + R * heads * hd, *VN = KN + R * KV * hd, *ATT = VN + R * KV * hd;
    float *OUT = ATT + R * heads * hd;
    const float scale = 1.f / sqrtf((float)hd);
    const int64_t capacity = s->capacity[i], size = L->bf16 ? 2 : 4;
    norm_all(H, L->norm, X, R, d, L->eps);
    product qkv[3] = {{&L->q, X, Q, .m = R}, {&L->k, X, KN, .m = R}, {&L->v, X, VN, .m = R}};
    products(me, qkv, 3);
    meet(me);
    #pragma omp for schedule(static) nowait
    for (int64_t u = 0; u < R * KV; u++) { /* each row's key and value into its cache */
        const int64_t q0 = u / KV, g = u % KV, pos = b->pos[q0];
        char *kc = row_state(s, b, 2 * i, q0), *vc = row_state(s, b, 2 * i + 1, q0);
        const float *kn = KN + q0 * KV * hd + g * hd, *vn = VN + q0 * KV * hd + g * hd;
        for (int64_t c = 0; c < hd; c++) {
            const int64_t at = (g * capacity + pos) * hd + c;
            if (L->bf16) ((uint16_t *)kc)[at] = narrow1(kn[c]), ((uint16_t *)vc)[at] = narrow1(vn[c]);
            else ((float *)kc)[at] = kn[c], ((float *)vc)[at] = vn[c];
        }
    }
    if (b->S < R) meet(me); /* a sequence's later rows read its earlier rows' keys and values */
    #pragma omp for schedule(static) nowait
    for (int64_t u = 0; u < R * KV; u++) {
        const int64_t q0 = u / KV, g = u % KV, pos = b->pos[q0], T = pos + 1;
        const int64_t S = attention_runs(T), run = ((T + S - 1) / S + 7) / 8 * 8;
        char *kc = row_state(s, b, 2 * i, q0), *vc = row_state(s, b, 2 * i + 1, q0);
        const float *q = Q + q0 * heads * hd, *kn = KN + q0 * KV * hd + g * hd, *vn = VN + q0 * KV * hd + g * hd;
        for (int64_t t = 0; t < S; t++) { /* run t of query head i at part + (i S + t) (hd + 2) */
            const int64_t t0 = t * run < T ? t * run : T, t1 = t0 + run < T ? t0 + run : T;
            attend(q, KV, g, r, hd, kc + g * capacity * hd * size, vc + g * capacity * hd * size, (int)L->bf16, kn, vn,
                   pos, t0, t1, scale, part + t * (hd + 2), S * (hd + 2));
        }
        for (int64_t j = 0; j < r; j++)
            merge_runs(part + j * S * (hd + 2), S, hd, ATT + q0 * heads * hd + (j * KV + g) * hd);
    }
    meet(me);
    product o = {&L->o, ATT, OUT, .m = R, .ldy = d};
    products(me, &o, 1);
    add_rows(H, OUT, R, d, o.n0, o.n1);
}

static void sort_pairs(const int64_t *ids, int64_t S, int64_t k, int64_t E, int64_t *start, int64_t *row_of,
                       int64_t *token_of);

/* The floats moe_rows needs beside its bookkeeping: the rows' inputs by expert, their hidden and output
   rows, the shared expert's. */
static int64_t moe_rows_scratch(const moe *L, int64_t R) {
    return R * L->top_k * (2 * L->d + L->up[0].out) + R * (L->shared_up.out + L->d);
}

/* moe_block for R rows: the rows routed (a share of the rows each), their (row, expert) pairs sorted by
   expert (every thread the same order), each expert's rows through its up and down products at once (its
   panels serve them all), the shared expert's every row; each row's outputs summed as moe_block sums them.
   ids, wts: [R, k] shared. */
static void moe_rows(const moe *L, const batch *b, float *H, float *sh, float *X, int64_t *ids, float *wts,
                     member *me) {
    const int64_t R = b->R, d = L->d, k = L->top_k, E = L->experts, S = R * k;
    norm_all(H, L->norm, X, R, d, L->eps);
    #pragma omp for schedule(static) nowait
    for (int64_t q = 0; q < R; q++) route(L, X + q * d, ids + q * k, wts + q * k);
    meet(me);
    int64_t start[2 * (E + 1)], row_of[S], token_of[S];
    sort_pairs(ids, S, k, E, start, row_of, token_of);
    const int64_t c = L->up[0].out, Sh = L->shared_up.out; /* every routed expert of a budget keeps c channels */
    float *XE = sh, *HE = XE + S * d, *YE = HE + S * c, *HS = YE + S * d, *YS = HS + R * Sh;
    #pragma omp for schedule(static) nowait
    for (int64_t q = 0; q < S; q++) memcpy(XE + q * d, X + token_of[q] * d, sizeof(float) * d);
    meet(me);
    product up[E + 1], down[E + 1];
    int count = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t m = start[e + 1] - start[e];
        if (!m) continue;
        up[count] = (product){&L->up[e], XE + start[e] * d, HE + start[e] * c, .m = m, .ldy = c};
        down[count++] = (product){&L->down[e], NULL, YE + start[e] * d, .m = m, .ldy = d};
    }
    up[count] = (product){&L->shared_up, X, HS, .m = R, .ldy = Sh};
    down[count] = (product){&L->shared_down, NULL, YS, .m = R, .ldy = d};
    products(me, up, count + 1);
    for (int i = 0; i <= count; i++)
        for (int64_t q = 0; q < up[i].m; q++) relu2(up[i].y + q * up[i].ldy, up[i].n0, up[i].n1);
    meet(me);
    own(me, &down[count], 1);
    for (int i = 0; i <= count; i++) {
        down[i].n0 = down[count].n0, down[i].n1 = down[count].n1;
        down[i].x = up[i].y; /* [m, its inputs], as the up projection left them */
    }
    runs(me, down, count + 1);
    const int64_t n0 = down[count].n0, n1 = down[count].n1;
    for (int64_t t = 0; t < R; t++) { /* moe_block's sum, row by row */
        const float *w = wts + t * k, *shared = YS + t * d;
        float *h = H + t * d;
        int64_t c = n0;
        for (; c + 8 <= n1; c += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < k; i++)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(YE + row_of[t * k + i] * d + c), _mm256_set1_ps(w[i]), acc);
            acc = _mm256_add_ps(acc, _mm256_loadu_ps(shared + c));
            _mm256_storeu_ps(h + c, _mm256_add_ps(_mm256_loadu_ps(h + c), acc));
        }
        for (; c < n1; c++) {
            float acc = 0.f;
            for (int64_t i = 0; i < k; i++) acc = fmaf(YE[row_of[t * k + i] * d + c], w[i], acc);
            h[c] = h[c] + (acc + shared[c]);
        }
    }
}

static void mlp_rows(const mlp *L, const batch *b, float *H, float *sh, float *X, member *me) {
    const int64_t R = b->R, d = L->d, c = L->up.out;
    float *HID = sh, *OUT = HID + R * c;
    norm_all(H, L->norm, X, R, d, L->eps);
    product up = {&L->up, X, HID, .m = R};
    products(me, &up, 1);
    for (int64_t q = 0; q < R; q++) relu2(HID + q * c, up.n0, up.n1);
    meet(me);
    product down = {&L->down, HID, OUT, .m = R, .ldy = d};
    products(me, &down, 1);
    add_rows(H, OUT, R, d, down.n0, down.n1);
}

static int64_t rows_scratch(const step *s, int64_t i, int64_t R) {
    const void *L = s->blocks[i].args;
    switch (s->blocks[i].kind) {
    case 'M': {
        const mamba *m = L;
        const int64_t kp = m->heads * m->head_dim;
        return R * (2 * kp + (kp + 2 * m->groups * m->state + m->heads) + m->d);
    }
    case '*': {
        const attention *a = L;
        return R * (2 * a->heads * a->head_dim + 2 * a->kv_heads * a->head_dim + a->d);
    }
    case 'E': return moe_rows_scratch(L, R);
    default: return R * (((const mlp *)L)->up.out + ((const mlp *)L)->d);
    }
}

/* R tokens of S sequences in one step (a batch's decode step, a prompt, or both at once): row r's token
   tokens[r] at position pos[r], its states at the step's state table's pointers plus index[r] (or r) *
   stride[i] bytes (row 0's: the batched cache's [B, ...] tensors; index: some of its rows, in place);
   rows [start[j], start[j + 1]) are sequence j's tokens in order.
   Its logits into logits [R, V], or with `last` each sequence's last row's into [S, V]. Each product runs
   once on all the rows (a weight is read once a step, not once a row); the work of a sequence's own
   (convolution, scan, attention, routing) is shared among the threads a (sequence or row, group / KV
   head) at a time. One parallel region, as run_tokens. A row's logits have the bits it gets alone where
   the weights are panels (run_rows); otherwise they agree to rounding. 0, or -1 where the scratch could
   not be allocated. */
int decode_rows(const step *s, int64_t R, const int64_t *tokens, const int64_t *pos, const int64_t *stride,
                const int64_t *index, int64_t S, const int64_t *start, int64_t last, float *logits, int threads) {
    const int64_t d = s->d, V = s->lm_head->out, team = threads > 1 ? threads : 1;
    int64_t shared = 0, part = 0, routes = 0;
    for (int64_t i = 0; i < s->n; i++) {
        const int64_t need = rows_scratch(s, i, R);
        shared = need > shared ? need : shared;
        if (s->blocks[i].kind == '*') {
            const attention *a = s->blocks[i].args;
            const int64_t p = a->heads / a->kv_heads * ATT_RUNS * (a->head_dim + 2);
            part = p > part ? p : part;
        }
        if (s->blocks[i].kind == 'E') {
            const int64_t k = ((const moe *)s->blocks[i].args)->top_k;
            routes = R * k > routes ? R * k : routes;
        }
    }
    const int64_t each = LINE(R * d) + LINE(part); /* a thread's normed rows, its attention sums */
    float *H = aligned_alloc(64, sizeof(float) * (LINE(R * d) + LINE(shared) + team * each + 3 * LINE(routes)));
    if (!H) return -1;
    float *sh = H + LINE(R * d), *mine = sh + LINE(shared), *wts = mine + team * each;
    int64_t *ids = (int64_t *)(wts + LINE(routes)); /* [routes], two floats' room each */
    const batch b = {R, pos, stride, index, S, start};
    const unsigned int csr = _mm_getcsr(); /* as run_tokens: every thread in the caller's float mode */
    meeting all = {0, 0};
    #pragma omp parallel num_threads(threads)
    {
        double cut[threads_here() + 1];
        cuts_of(s->balance, threads_here(), cut);
        member me = member_of(&all, cut);
        const unsigned int own_csr = _mm_getcsr();
        _mm_setcsr(csr);
        float *X = mine + thread_here() * each, *att = X + LINE(R * d);
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < R; r++) {
            if (s->embed_bf16) widen((const uint16_t *)s->embed + tokens[r] * s->ld_embed, H + r * d, d);
            else memcpy(H + r * d, (const float *)s->embed + tokens[r] * s->ld_embed, sizeof(float) * d);
        }
        meet(&me);
        for (int64_t i = 0; i < s->n; i++) {
            const void *L = s->blocks[i].args;
            switch (s->blocks[i].kind) {
            case 'M': mamba_rows(L, s, &b, i, H, sh, X, &me); break;
            case '*': attention_rows(L, s, &b, i, H, sh, X, att, &me); break;
            case 'E': moe_rows(L, &b, H, sh, X, ids, wts, &me); break;
            default: mlp_rows(L, &b, H, sh, X, &me);
            }
            meet(&me);
        }
        const int64_t out = last ? b.S : R; /* `last`: each sequence's last row's logits only */
        for (int64_t j = 0; j < out; j++)
            rms_norm(H + (last ? start[j + 1] - 1 : j) * d, s->norm, X + j * d, d, s->eps);
        product head = {s->lm_head, X, logits, .m = out, .ldy = V};
        products(&me, &head, 1);
        _mm_setcsr(own_csr);
    }
    free(H);
    return 0;
}

/* The wall time of one `meet` among `threads` threads, averaged over `rounds` (into *ns): a token of the demo
   passes two dozen, and what each costs is the machine's, not this file's: two vCPUs of this VM took 30 to
   320 ns, run to run seconds apart (where the host put them), which sets how much a second thread speeds a
   small budget's token (bench_budgets prints it beside the rates). */
int meet_time(int64_t rounds, int threads, double *ns) {
    meeting all = {0, 0};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    #pragma omp parallel num_threads(threads)
    {
        member me = member_of(&all, NULL);
        for (int64_t r = 0; r < rounds; r++) meet(&me);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)rounds;
    return 0;
}

/* `meet`, for the tests: `rounds` meetings of `threads` threads, each marking the round it reached before it
   meets and checking after that every thread had marked it. The (thread, round) pairs that found a thread
   behind: 0 where the barrier holds. */
int meet_check(int64_t rounds, int threads) {
    meeting all = {0, 0};
    atomic_llong reached[threads > 0 ? threads : 1];
    for (int t = 0; t < (threads > 0 ? threads : 1); t++) atomic_init(&reached[t], 0);
    atomic_int behind = 0;
    #pragma omp parallel num_threads(threads)
    {
        member me = member_of(&all, NULL);
        for (int64_t r = 1; r <= rounds; r++) {
            atomic_store_explicit(&reached[thread_here()], r, memory_order_relaxed);
            meet(&me);
            for (int64_t t = 0; t < me.threads; t++)
                if (atomic_load_explicit(&reached[t], memory_order_relaxed) < r)
                    atomic_fetch_add_explicit(&behind, 1, memory_order_relaxed);
        }
    }
    return atomic_load(&behind);
}

/* ------------------------------------------------------------------------------ norms over a prompt */

/* out [rows, width] = RMSNorm of x [rows, width] (contiguous) times w [width], over each of `groups`
   groups of a rank-major row: group g holds the p-channel runs (q groups + g) p, as Mamba2's gated norm
   has them; groups 1, p width is the plain RMSNorm. With z [rows, width] (rows ldz apart; NULL: none),
   x is gated first, x silu(z), as Mamba2 gates before its norm. The decode step's arithmetic (silu_into,
   norm_group), rows shared among the threads. torch runs a norm as six ops over the whole
   prompt (pow, mean, add, rsqrt, two muls) and the gate as two more: about 5% of a 30m / 100m prompt
   (scratch, docs/decode-speed.md). */
void norm_rows(const float *x, const float *z, int64_t ldz, const float *w, float *out, int64_t rows,
               int64_t width, int64_t groups, int64_t p, float eps, int threads) {
    const int64_t r = width / (groups * p);
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * width >= 1 << 15)
    for (int64_t t = 0; t < rows; t++) {
        float *o = out + t * width;
        memcpy(o, x + t * width, sizeof(float) * width);
        if (z) silu_into(o, z + t * ldz, width); /* o = x silu(z) */
        for (int64_t g = 0; g < groups; g++) norm_group(o, w, groups, p, r, g, eps);
    }
}

/* ------------------------------------------------------------------------ Mamba2 over a prompt */

/* The two sequential parts of a Mamba2 mixer's prefill (mamba2.py through model/kernels.py; the products
 * around them stay torch's matmul). torch's chunked scan (ssd.py) is a few dozen ops on [chunk, chunk]
 * tiles per layer, and its depthwise convolution goes through oneDNN: on the CPU they cost more than
 * the layer's projections. Here each is one pass, in the order the decode step takes (the recurrence
 * is the definition the chunked scan computes by blocks). */

/* silu(causal depthwise conv) of x [b, T, C] (x[i, t, c] at x + i * ldb + t * ldt + c) with weight
   [C, K] and bias [C] (or NULL) into out [b, T, C] (contiguous). state [b, C, K] (or NULL: zeros before
   x) holds the last K inputs before x and is left holding the last K inputs after it. With `round`, the
   convolution is rounded to bf16 before the silu (a bf16 prompt's, as torch rounds it). Returns -1 where
   the scratch could not be allocated. Each thread takes a run of channels, 8 at a time, across every
   time step: the taps are the weight's columns, transposed once. */
int conv_prefill(const float *x, int64_t ldb, int64_t ldt, const float *w, const float *bias, float *state,
                 float *out, int64_t b, int64_t T, int64_t C, int64_t K, int round, int threads) {
    const int64_t C8 = (C + 7) / 8 * 8;
    float *taps = calloc((size_t)(2 * K - 1) * C8, sizeof(float)); /* [K, C8] weights, [K - 1, C8] history */
    if (!taps) return -1;
    float *hist = taps + K * C8;
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < K; j++) taps[j * C8 + c] = w[c * K + j];
    for (int64_t i = 0; i < b; i++) {
        float *s = state ? state + i * C * K : NULL;
        const float *xi = x + i * ldb;
        for (int64_t j = 0; j < K - 1; j++) /* the K - 1 inputs before x, time-major like x */
            for (int64_t c = 0; c < C; c++) hist[j * C8 + c] = s ? s[c * K + j + 1] : 0.f;
        #pragma omp parallel num_threads(threads)
        {
            int64_t c0, c1; /* this thread's channels, in whole 8s */
            share(C8 / 8, &c0, &c1);
            for (int64_t t = 0; t < T; t++) /* row by row: each thread reads a run of each input row */
                for (int64_t c = c0 * 8; c < c1 * 8; c += 8) {
                    const int64_t lanes = C - c < 8 ? C - c : 8;
                    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)lanes),
                                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                    /* masked moves only for the last, partial 8: AMD runs them in microcode */
                    __m256 a = !bias ? _mm256_setzero_ps()
                               : lanes == 8 ? _mm256_loadu_ps(bias + c) : _mm256_maskload_ps(bias + c, mask);
                    for (int64_t j = 0; j < K; j++) {
                        const int64_t u = t - (K - 1) + j; /* the input time this tap reads */
                        const float *row = (u >= 0 ? xi + u * ldt : hist + (K - 1 + u) * C8) + c;
                        const __m256 in = lanes == 8 ? _mm256_loadu_ps(row) : _mm256_maskload_ps(row, mask);
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(taps + j * C8 + c), in, a);
                    }
                    a = silu256(round ? bf16_round8(a) : a);
                    if (lanes == 8) _mm256_storeu_ps(out + (i * T + t) * C + c, a);
                    else _mm256_maskstore_ps(out + (i * T + t) * C + c, mask, a);
                }
        }
        if (s) /* the window after x: x's last inputs, the state's latest before them (ascending: reads ahead) */
            for (int64_t c = 0; c < C; c++)
                for (int64_t j = 0; j < K; j++) s[c * K + j] = T + j >= K ? xi[(T + j - K) * ldt + c] : s[c * K + T + j];
    }
    free(taps);
    return 0;
}

/* Rows [e, e + 8q) of one token of a head's recurrence on its state held transposed, sT [N, p]: for each
   state column n, s = a s + (d x) B_n and y += C_n s. q is a constant where it is inlined, which keeps
   the 2q vectors in registers. */
static inline __attribute__((always_inline)) void ssm_rows_t(int q, float *sT, int64_t p, int64_t N, __m256 va,
                                                             __m256 vd, const float *x, const float *B,
                                                             const float *C, float *y) {
    __m256 dx[4], acc[4];
    for (int j = 0; j < q; j++) {
        dx[j] = _mm256_mul_ps(vd, _mm256_loadu_ps(x + 8 * j));
        acc[j] = _mm256_setzero_ps();
    }
    for (int64_t n = 0; n < N; n++) {
        const __m256 bn = _mm256_broadcast_ss(B + n), cn = _mm256_broadcast_ss(C + n);
        float *row = sT + n * p;
        for (int j = 0; j < q; j++) {
            const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(row + 8 * j), va, _mm256_mul_ps(dx[j], bn));
            _mm256_storeu_ps(row + 8 * j, v);
            acc[j] = _mm256_fmadd_ps(v, cn, acc[j]);
        }
    }
    for (int j = 0; j < q; j++) _mm256_storeu_ps(y + 8 * j, acc[j]);
}

/* One token of a head's recurrence with its state transposed (p a multiple of 8), 32 rows at a time: the
   readout needs no horizontal sums, which the row-wise ssm_row spends much of its time on. */
static void ssm_token_t(float *sT, int64_t p, int64_t N, float a, float d, const float *x, const float *B,
                        const float *C, float *y) {
    const __m256 va = _mm256_set1_ps(a), vd = _mm256_set1_ps(d);
    int64_t e = 0;
    for (; e + 32 <= p; e += 32) ssm_rows_t(4, sT + e, p, N, va, vd, x + e, B, C, y + e);
    for (; e < p; e += 8) ssm_rows_t(1, sT + e, p, N, va, vd, x + e, B, C, y + e);
}

/* y_t = C_t.h_t (+ D x_t) of h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t, each head's state starting at
   `final` [b, G, r, p, N] (contiguous; the caller fills it with the initial state or zeros, or passes a
   cache's own state) and ending there. Strides in floats: x and y over (b, t, g, r) with p contiguous (y
   rank-major, [b, T, r, G, p], is the layout out_proj reads: the D skip and that transpose cost a 100m
   prompt's Mamba layer two torch ops and a copy), dt over (b, t, g, r), B and C over (b, t, g) with N
   contiguous; A and D [G, r] contiguous (D NULL: no skip), dt after softplus. One head per thread at a
   time: its p x N state stays in cache for the whole prompt (transposed while it runs, where p is a
   multiple of 8). Returns -1, `final` untouched, where those copies could not be allocated. */
int ssm_scan(const float *x, const int64_t *xs, const float *dt, const int64_t *dts, const float *A,
             const float *D, const float *B, const float *C, const int64_t *bcs, float *y, const int64_t *ys,
             float *final, int64_t b, int64_t T, int64_t G, int64_t r, int64_t p, int64_t N, int threads) {
    const int wide = p % 8 == 0;
    float *copies = wide ? malloc(sizeof(float) * p * N * (threads > 0 ? threads : 1)) : NULL;
    if (wide && !copies) return -1;
    #pragma omp parallel num_threads(threads)
    {
        float *sT = copies ? copies + p * N * thread_here() : NULL;
        #pragma omp for collapse(3) schedule(static)
        for (int64_t i = 0; i < b; i++)
            for (int64_t g = 0; g < G; g++)
                for (int64_t q = 0; q < r; q++) {
                    float *h = final + (((i * G + g) * r + q) * p) * N;
                    const float a = A[g * r + q], skip = D ? D[g * r + q] : 0.f;
                    if (sT)
                        for (int64_t e = 0; e < p; e++)
                            for (int64_t n = 0; n < N; n++) sT[n * p + e] = h[e * N + n];
                    for (int64_t t = 0; t < T; t++) {
                        const float d = dt[i * dts[0] + t * dts[1] + g * dts[2] + q * dts[3]];
                        const float decay = expf(d * a), *xt = x + i * xs[0] + t * xs[1] + g * xs[2] + q * xs[3];
                        const float *Bt = B + i * bcs[0] + t * bcs[1] + g * bcs[2];
                        const float *Ct = C + i * bcs[0] + t * bcs[1] + g * bcs[2];
                        float *yt = y + i * ys[0] + t * ys[1] + g * ys[2] + q * ys[3];
                        if (sT) ssm_token_t(sT, p, N, decay, d, xt, Bt, Ct, yt);
                        else
                            for (int64_t e = 0; e < p; e++) yt[e] = ssm_row(h + e * N, decay, d * xt[e], Bt, Ct, N);
                        if (D) /* as the decode step adds it (ssm_head): one fused multiply-add */
                            for (int64_t e = 0; e < p; e++) yt[e] = fmaf(skip, xt[e], yt[e]);
                    }
                    if (sT)
                        for (int64_t e = 0; e < p; e++)
                            for (int64_t n = 0; n < N; n++) h[e * N + n] = sT[n * p + e];
                }
    }
    free(copies);
    return 0;
}

/* ------------------------------------------------------------------- MoE experts over a prompt */

/* y [m, N] = x [m, K] W^T for any weight format (x as nvfp4_x leaves it for NVFP4), on gemv.c's panels:
   float32 weights are stored in them (`scratch`: gemm_p_scratch floats), the others decoded into them
   (from 4 rows; fewer take the dot products). */
static void rows_product(const weight *w, const float *x, int64_t m, float *y, float *scratch) {
    const int64_t N = w->out, K = w->in;
    switch (w->format) {
    case PANELS_F32:
    case PANELS_BF16:
    case PANELS_FP8:
        gemm_p_part(x, w->w, w->ld, w->skip, y, m, N, K, 0, N, scratch, kind_of(w->format), w->scale);
        break;
    case ROWS_F32: part_f32(x, w->w, y, m, N, K, w->ld, 0, N); break;
    case ROWS_BF16: part_bf16(x, w->w, y, m, N, K, w->ld, 0, N); break;
    case FP8: part_fp8(x, w->w, y, m, N, K, w->ld, w->scale, 0, N); break;
    case NVFP4:
    case NVFP4_A4: part_nvfp4(x, w->w, w->scales, y, m, N, K, w->ld, w->ld_scales, w->scale, 0, N);
    }
}

/* The S = n k (token, expert) pairs ids [S] sorted by expert: expert e's rows are [start[e], start[e + 1]),
   pair s lies at row row_of[s], and row q holds token token_of[q]'s input. start: 2 (E + 1) (the second
   half scratch). */
static void sort_pairs(const int64_t *ids, int64_t S, int64_t k, int64_t E, int64_t *start, int64_t *row_of,
                       int64_t *token_of) {
    int64_t *next = start + E + 1;
    memset(start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t s = 0; s < S; s++) start[ids[s] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(next, start, sizeof(int64_t) * (E + 1));
    for (int64_t s = 0; s < S; s++) {
        row_of[s] = next[ids[s]]++;
        token_of[row_of[s]] = s / k;
    }
}

/* out [n, d] += sum_i wts[t, i] down_e(relu(up_e x_t)^2), e = ids[t, i], over each token t's k routed
 * experts (moe.py's multi-token path), up[e] [I, d] and down[e] [d, I] the budget's views in any format
 * (one format for all up, one for all down). torch runs this as two small matmuls per expert plus a
 * gather and a scatter (on the CPU the experts' matmuls of a few dozen rows reach half the speed of one
 * large one, and a layer's other ops cost as much again); here the (token, expert) pairs are sorted by
 * expert once, every expert's up product runs in one parallel loop and every down product in another,
 * an expert at a time (its weight panels serve all of its rows). x [n, d] contiguous. */
int experts_prefill(const float *x, int64_t n, int64_t d, const int64_t *ids, const float *wts, int64_t k,
                    int64_t E, const weight *up, const weight *down, int64_t I, float *out, int threads) {
    const int64_t S = n * k, each = gemm_p_scratch + (I + 7) / 8 * 8; /* a thread's: tiles, a row of H */
    const int permute_up = up[0].format == NVFP4 || up[0].format == NVFP4_A4,
              permute_down = down[0].format == NVFP4 || down[0].format == NVFP4_A4;
    int64_t *start = malloc(sizeof(int64_t) * (2 * (E + 1) + 2 * S));
    float *X = malloc(sizeof(float) * S * (2 * d + I)); /* NVFP4's inputs permuted where they lie */
    float *scratches = aligned_alloc(32, sizeof(float) * each * (threads > 0 ? threads : 1));
    if (!start || !X || !scratches) {
        free(start);
        free(X);
        free(scratches);
        return -1;
    }
    int64_t *row_of = start + 2 * (E + 1), *token_of = row_of + S;
    float *H = X + S * d, *Y = H + S * I;
    sort_pairs(ids, S, k, E, start, row_of, token_of);
    #pragma omp parallel num_threads(threads)
    {
        float *scratch = scratches + each * thread_here();
        float *row = scratch + gemm_p_scratch;
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < S; q++) {
            if (permute_up) nvfp4_x(&up[0], x + token_of[q] * d, X + q * d, 1);
            else memcpy(X + q * d, x + token_of[q] * d, sizeof(float) * d);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; e++) { /* an expert at a time: its panels serve all of its rows */
            const int64_t m = start[e + 1] - start[e];
            if (!m) continue;
            float *h = H + start[e] * I;
            rows_product(&up[e], X + start[e] * d, m, h, scratch);
            relu2(h, 0, m * I);
        }
        if (permute_down) {
            #pragma omp for schedule(static)
            for (int64_t q = 0; q < S; q++) {
                memcpy(row, H + q * I, sizeof(float) * I);
                nvfp4_x(&down[0], row, H + q * I, 1);
            }
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; e++) {
            const int64_t m = start[e + 1] - start[e];
            if (m) rows_product(&down[e], H + start[e] * I, m, Y + start[e] * d, scratch);
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < k; i++) {
                const float w = wts[t * k + i], *y = Y + row_of[t * k + i] * d;
                float *o = out + t * d;
                for (int64_t j = 0; j < d; j++) o[j] += w * y[j];
            }
    }
    free(start);
    free(X);
    free(scratches);
    return 0;
}

/* y [m, N] = x [m, K] (bf16; NVFP4's permuted) W^T on gemv.c's bf16 dots, on this thread: 0, -1 (memory) or
   -2 (no bf16 dots for this weight, or K odd). */
static int rows_product_bf16(const weight *w, const uint16_t *x, int64_t m, float *y) {
    const int64_t N = w->out, K = w->in;
    switch (w->format) {
    case PANELS_BF16: return product_bf16x(DOT_BF16, 1, x, w->w, NULL, y, m, N, K, w->ld, 0, w->skip, 1.f);
    case ROWS_BF16: return product_bf16x(DOT_BF16, 0, x, w->w, NULL, y, m, N, K, 2 * w->ld, 0, 0, 1.f);
    case FP8: return product_bf16x(DOT_FP8, 0, x, w->w, NULL, y, m, N, K, w->ld, 0, 0, w->scale);
    case PANELS_FP8: return product_bf16x(DOT_FP8, 1, x, w->w, NULL, y, m, N, K, w->ld, 0, w->skip, w->scale);
    case NVFP4: return product_bf16x(DOT_NVFP4, 0, x, w->w, w->scales, y, m, N, K, w->ld, w->ld_scales, 0, w->scale);
    default: return -2;
    }
}

#define EXPERT_ROWS 128 /* rows of an expert a bf16 product takes at a time, into this thread's float32 */

/* A thread's buffers for expert_rows_bf16: `t` the float32 outputs of EXPERT_ROWS rows, `row` 2 wide floats
   (a row being permuted); without the bf16 dots also `xf` (EXPERT_ROWS rows' inputs widened) and `scratch`
   (rows_product's tiles). NULL xf: on the dots. */
typedef struct {
    float *t, *row, *xf, *scratch;
} expert_buffers;

/* Rows [r0, r1) of `in` (bf16, w->in wide) times w into the same rows of `out` (bf16, w->out wide),
   EXPERT_ROWS at a time: each output rounded to bf16, and for the `hidden` units relu(h)^2 after that,
   rounded again, then permuted for an NVFP4 down product where `permute`. The products run on the bf16
   dots, or (b->xf set) on the inputs widened to float32 and the float32 kernels, as a bf16 prompt's dense
   products run on a CPU without the dots. 0, or rows_product_bf16's error. */
static int expert_rows_bf16(const weight *w, const uint16_t *in, int64_t r0, int64_t r1, uint16_t *out,
                            int hidden, int permute, const expert_buffers *b) {
    const int64_t K = w->in, N = w->out;
    float *t = b->t;
    for (int64_t r = r0; r < r1; r += EXPERT_ROWS) {
        const int64_t m = r1 - r < EXPERT_ROWS ? r1 - r : EXPERT_ROWS;
        if (b->xf) {
            widen(in + r * K, b->xf, m * K);
            rows_product(w, b->xf, m, t, b->scratch);
        } else {
            const int rc = rows_product_bf16(w, in + r * K, m, t);
            if (rc) return rc;
        }
        narrow(t, out + r * N, m * N);
        if (!hidden) continue;
        widen(out + r * N, t, m * N);
        relu2(t, 0, m * N);
        narrow(t, out + r * N, m * N);
        if (permute) permute_nvfp4_bf16(out + r * N, out + r * N, m, N, b->row);
    }
    return 0;
}

/* experts_prefill for a bfloat16 prompt (x [n, d] bf16), at the rounding points of moe.py's torch path in
 * bf16 (each product's output rounded to bf16, relu(h)^2 rounded, the weighted sum in float32) and with
 * its activations in bf16, as the plan counts them: the pairs' inputs, hidden units and outputs, S (2 d + I)
 * values, and per thread EXPERT_ROWS rows of float32 outputs (twice that and the tiles without the dots).
 * The products run on gemv.c's bf16 dots (product_bf16x) where `dots` and the CPU has them, else on the
 * inputs widened to float32, as the torch path's products run then: on a CPU without the dots (AVX2 only)
 * that path spent its time in a gather, a scatter and two conversions per expert. 0; -1 where memory ran
 * out; -2 where it cannot (an odd width, float32 weights): then moe.py's torch path runs. */
int experts_prefill_bf16(const uint16_t *x, int64_t n, int64_t d, const int64_t *ids, const float *wts, int64_t k,
                         int64_t E, const weight *up, const weight *down, int64_t I, float *out, int threads,
                         int dots) {
    const int64_t S = n * k, wide = d > I ? d : I;
    const int64_t ok[] = {PANELS_BF16, ROWS_BF16, FP8, NVFP4, PANELS_FP8};
    int formats = 0;
    for (int i = 0; i < 5; i++) formats += (up[0].format == ok[i]) + (down[0].format == ok[i]);
    if (d % 2 || I % 2 || formats != 2) return -2;
    dots = dots && bf16_dot();
    const int permute_up = up[0].format == NVFP4, permute_down = down[0].format == NVFP4;
    const int64_t team = threads > 0 ? threads : 1;
    /* a thread's floats: without the dots the tiles first (aligned as gemm_p_part wants them), then t, row, xf */
    const int64_t tiles = dots ? 0 : (gemm_p_scratch + 15) / 16 * 16;
    const int64_t each = (tiles + (EXPERT_ROWS + 2) * wide + (dots ? 0 : EXPERT_ROWS * wide) + 15) / 16 * 16;
    int64_t *start = malloc(sizeof(int64_t) * (2 * (E + 1) + 2 * S));
    uint16_t *X = malloc(sizeof(uint16_t) * S * (2 * d + I));
    float *temps = aligned_alloc(64, sizeof(float) * team * each);
    if (!start || !X || !temps) {
        free(start), free(X), free(temps);
        return -1;
    }
    int64_t *row_of = start + 2 * (E + 1), *token_of = row_of + S;
    uint16_t *H = X + S * d, *Y = H + S * I;
    sort_pairs(ids, S, k, E, start, row_of, token_of);
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *mine = temps + each * thread_here(); /* libgomp gives at most `threads` */
        float *t = dots ? mine : mine + tiles;
        const expert_buffers b = {t, t + EXPERT_ROWS * wide, dots ? NULL : t + (EXPERT_ROWS + 2) * wide,
                                  dots ? NULL : mine};
        float *row = b.row;
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < S; q++) {
            memcpy(X + q * d, x + token_of[q] * d, sizeof(uint16_t) * d);
            if (permute_up) permute_nvfp4_bf16(X + q * d, X + q * d, 1, d, row);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; e++) {
            const int rc = expert_rows_bf16(&up[e], X, start[e], start[e + 1], H, 1, permute_down, &b);
            if (rc) {
                #pragma omp atomic write
                failed = rc;
            }
        }
        int up_failed; /* read after the up loop's barrier: the same for every thread */
        #pragma omp atomic read
        up_failed = failed;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E * !up_failed; e++) {
            const int rc = expert_rows_bf16(&down[e], H, start[e], start[e + 1], Y, 0, 0, &b);
            if (rc) {
                #pragma omp atomic write
                failed = rc;
            }
        }
        int down_failed;
        #pragma omp atomic read
        down_failed = failed;
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < n * !down_failed; q++) {
            float *o = out + q * d, *y = row;
            for (int64_t i = 0; i < k; i++) {
                const float w = wts[q * k + i];
                widen(Y + row_of[q * k + i] * d, y, d);
                for (int64_t j = 0; j < d; j++) o[j] += w * y[j];
            }
        }
    }
    free(start), free(X), free(temps);
    return failed;
}
