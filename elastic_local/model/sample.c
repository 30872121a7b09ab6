/* A sampled next token on the CPU: the engine's sampling (engine/sampling.py: temperature, top-k, top-p,
 * min-p, then one uniform number inverting the cumulative distribution) in C, for step.c's run ahead and
 * for the engine's own steps on float32 logits.
 *
 * Why: sampled tokens went through the Python around a step and a dozen small torch ops each, and the
 * demo model decoded them at 0.22-0.35x its greedy rate (the small budget at 4,900-5,300 tok/s against
 * 22,500). In C the run ahead takes sampled tokens as it takes greedy ones, their uniform numbers drawn
 * in Python from the request's generator beforehand, so a seed gives the same tokens either way.
 *
 * On the CPU this is the definition of a draw (engine/sampling.py's `sample` calls it too): torch's ops
 * stay the oracle in the tests, and a token differs from theirs only where the uniform number falls within
 * rounding of a boundary between two tokens' cumulative probabilities.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {        /* engine/sampling.py's Sampling, temperature > 0 */
    int64_t top_k;      /* 0: all tokens */
    float temperature;
    float top_p;        /* 1: all tokens */
    float min_p;        /* 0: off */
} sampling;

__m256 exp8(__m256 v); /* step.c's exp256: Cephes' expf, within 2 ulp */

/* e^x for x <= 0 (a logit less the largest), 8 at a time; 0 below -87.3, where e^x leaves float32's normal
   range: there, and for a masked token's -inf, the probability is 0. libm's expf one at a time made 131k
   logits 0.9 ms. */
static inline __m256 exp_ps(__m256 x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ), exp8(x));
}

/* Sum of v[0..n) in double, 8 at a time. */
static double sum_of(const float *v, int64_t n) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    }
    double lanes[4], sum = 0;
    _mm256_storeu_pd(lanes, _mm256_add_pd(lo, hi));
    for (int q = 0; q < 4; q++) sum += lanes[q];
    for (; i < n; i++) sum += v[i];
    return sum;
}

/* v[0..n) *= f */
static void scale_by(float *v, int64_t n, float f) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, _mm256_mul_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(f)));
    for (; i < n; i++) v[i] *= f;
}

/* v[i] = 0 where v[i] < least */
static void drop_below(float *v, int64_t n, float least) {
    int64_t i = 0;
    const __m256 l = _mm256_set1_ps(least);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        _mm256_storeu_ps(v + i, _mm256_and_ps(x, _mm256_cmp_ps(x, l, _CMP_GE_OQ)));
    }
    for (; i < n; i++)
        if (v[i] < least) v[i] = 0.0f;
}

/* The largest of v[0..n) (n >= 1, no NaN). */
static float largest(const float *v, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(v + i));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int q = 0; q < 8; q++) top = lanes[q] > top ? lanes[q] : top;
    for (; i < n; i++) top = v[i] > top ? v[i] : top;
    return top;
}

/* The k-th largest of v[0..n) for a k small beside n (16 k <= n): a min-heap of the k largest so far, most
   values turned away 8 at a time against its least. A scratch harness, a whole draw at temperature 0.8 on
   random logits: at 131,072 tokens, top_k 40 took 0.40 ms this way against 0.90 by kth_largest's
   selection, top_k 1000 0.76 against 0.88; at 512 tokens, top_k 40, 2.7 us against 2.1, where a fifth of
   the values still reach the heap. */
static float kth_largest_small(const float *v, int64_t n, int64_t k, float *heap) {
    int64_t size = 0;
    for (int64_t i = 0; i < n; i++) {
        if (size == k && i + 8 <= n &&
            !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(heap[0]), _CMP_GT_OQ))) {
            i += 7;
            continue;
        }
        float x = v[i];
        if (size < k) { /* sift up */
            int64_t j = size++;
            while (j > 0 && heap[(j - 1) / 2] > x) heap[j] = heap[(j - 1) / 2], j = (j - 1) / 2;
            heap[j] = x;
        } else if (x > heap[0]) { /* replace the least, sift down */
            int64_t j = 0;
            for (;;) {
                int64_t c = 2 * j + 1;
                if (c >= k) break;
                if (c + 1 < k && heap[c + 1] < heap[c]) c++;
                if (heap[c] >= x) break;
                heap[j] = heap[c], j = c;
            }
            heap[j] = x;
        }
    }
    return heap[0];
}

/* The k-th largest of v[0..n) (k >= 1), reordering v: Hoare's selection, median-of-three pivots. */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float a = v[lo], b = v[mid], c = v[hi];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: the larger values to the left */
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                const float t = v[i];
                v[i++] = v[j], v[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return v[want];
    }
    return v[want];
}

/* keys[0..n) in descending order (insertion sort below 16, else quicksort on the middle key). */
static void sort_descending(uint64_t *keys, int64_t n) {
    while (n > 16) {
        const uint64_t pivot = keys[n / 2];
        int64_t i = 0, j = n - 1;
        while (i <= j) {
            while (keys[i] > pivot) i++;
            while (keys[j] < pivot) j--;
            if (i <= j) {
                const uint64_t t = keys[i];
                keys[i++] = keys[j], keys[j--] = t;
            }
        }
        if (j + 1 < n - i) { /* the smaller side by recursion, the larger by the loop */
            sort_descending(keys, j + 1);
            keys += i, n -= i;
        } else {
            sort_descending(keys + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t i = 1; i < n; i++) {
        const uint64_t k = keys[i];
        int64_t j = i;
        for (; j > 0 && keys[j - 1] < k; j--) keys[j] = keys[j - 1];
        keys[j] = k;
    }
}

/* A token's rank key: its probability's bits above (a non-negative float's bits order as the float does),
   then the lower index first among equal probabilities. */
static inline uint64_t rank_key(float p, int64_t i) {
    uint32_t bits;
    memcpy(&bits, &p, 4);
    return (uint64_t)bits << 32 | (uint32_t)~(uint32_t)i;
}

static inline float prob_of(uint64_t key) {
    const uint32_t bits = (uint32_t)(key >> 32);
    float q;
    memcpy(&q, &bits, 4);
    return q;
}

/* How many of the rank keys[0..n) (in any order) the nucleus keeps, reordered so that those come first,
   most likely first: the fewest of the most likely whose mass reaches top_p (a token is kept where the
   mass ranked before it is under top_p). The cut is found as a selection finds its k-th element: each
   round splits the keys at a pivot, keeps the larger side whole where its mass stays under top_p and
   goes on in the smaller one, or drops the smaller side whole; only the last 16 or fewer are sorted. A
   sort of every candidate took 1.5 ms where the nucleus is most of a 32k vocabulary. */
static int64_t nucleus_cut(uint64_t *keys, int64_t n, double top_p) {
    int64_t lo = 0, hi = n;
    double before = 0; /* the mass of keys[0..lo), each one kept */
    while (hi - lo > 16) {
        if (before >= top_p) return lo;
        const uint64_t a = keys[lo], b = keys[lo + (hi - lo) / 2], c = keys[hi - 1];
        const uint64_t pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t m = lo, at;
        double mass = 0; /* of the keys above the pivot, moved to keys[lo..m) */
        for (int64_t i = lo; i < hi; i++) {
            const uint64_t k = keys[i];
            if (k > pivot) {
                mass += prob_of(k);
                keys[i] = keys[m], keys[m++] = k;
            }
        }
        for (at = m; keys[at] != pivot; at++) /* in keys[m..hi): the keys are unique */
            ;
        keys[at] = keys[m], keys[m] = pivot;
        if (before + mass >= top_p) {
            hi = m; /* the pivot and all below it dropped */
        } else {
            before += mass + prob_of(pivot); /* all above it and the pivot kept */
            lo = m + 1;
        }
    }
    sort_descending(keys + lo, hi - lo);
    for (int64_t r = lo; r < hi; r++) {
        if (before >= top_p) return r;
        before += prob_of(keys[r]);
    }
    return hi;
}

/* The top-p nucleus of p[0..V) kept, every other probability zeroed; ranked by probability, the lower
   index first among equals (nucleus_cut). Only tokens of the binades (powers of two) that first reach top_p
   can be kept, so only they are candidates: a trained model's nucleus is a few tokens of a large
   vocabulary. (Where the candidates' mass falls short of top_p by rounding, all tokens are.) */
static void nucleus(float *p, int64_t V, float top_p, uint64_t *keys) {
    /* binade b: p in [2^-(b+1), 2^-b) (from its exponent bits; 1 in the first), summed in four interleaved
       tables: one table's running sums made each element wait for the last (0.8 us of 512 tokens) */
    double binade[4][160] = {{0}};
    for (int64_t i = 0; i < V; i++) {
        uint32_t bits;
        memcpy(&bits, p + i, 4);
        const int b = 126 - (int)(bits >> 23);
        if (bits) binade[i & 3][b < 0 ? 0 : b] += p[i];
    }
    double mass = 0;
    float floor = 0.0f; /* the candidates' least probability */
    for (int b = 0; b < 159; b++) {
        if ((mass += binade[0][b] + binade[1][b] + binade[2][b] + binade[3][b]) >= top_p) {
            floor = ldexpf(1.0f, -(b + 1));
            break;
        }
    }
    for (int pass = 0; pass < 2; pass++) { /* the candidates: 8 tokens at a time, most of them none */
        int64_t n = 0, i = 0;
        mass = 0;
        const __m256 least = _mm256_set1_ps(floor), zero = _mm256_setzero_ps();
        for (; i + 8 <= V; i += 8) {
            const __m256 x = _mm256_loadu_ps(p + i);
            int hits = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(x, least, _CMP_GE_OQ),
                                                        _mm256_cmp_ps(x, zero, _CMP_GT_OQ)));
            for (; hits; hits &= hits - 1) {
                const int64_t j = i + __builtin_ctz(hits);
                keys[n++] = rank_key(p[j], j), mass += p[j];
            }
        }
        for (; i < V; i++)
            if (p[i] > 0 && p[i] >= floor) keys[n++] = rank_key(p[i], i), mass += p[i];
        if (mass < top_p && floor > 0) { /* short of top_p by rounding: every token a candidate */
            floor = 0.0f;
            continue;
        }
        const int64_t cut = nucleus_cut(keys, n, top_p);
        drop_below(p, V, floor);
        for (int64_t r = cut; r < n; r++) p[~(uint32_t)keys[r]] = 0.0f;
        return;
    }
}

/* The token that u (uniform in [0, 1)) draws from logits[V] under s; p[V] holds its probabilities after
   (temperature, top-k, softmax, top-p, min-p, normalized, as engine/sampling.py's logits_to_probs), keys[V]
   is scratch. -1 where they are not finite numbers (a NaN or an infinite logit). */
int64_t sample_row(const float *logits, int64_t V, const sampling *s, float u, float *p, uint64_t *keys) {
    const float t = s->temperature;
    int64_t i = 0;
    __m256 bad = _mm256_setzero_ps(); /* a NaN or +inf anywhere */
    for (; i + 8 <= V; i += 8) {
        const __m256 x = _mm256_loadu_ps(logits + i);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
        _mm256_storeu_ps(p + i, _mm256_div_ps(x, _mm256_set1_ps(t)));
    }
    if (_mm256_movemask_ps(bad)) return -1;
    for (; i < V; i++) {
        if (!(logits[i] < INFINITY)) return -1;
        p[i] = logits[i] / t;
    }
    if (s->top_k > 0 && s->top_k < V) {
        float *v = (float *)keys;
        float kth;
        if (16 * s->top_k <= V) {
            kth = kth_largest_small(p, V, s->top_k, v);
        } else {
            memcpy(v, p, sizeof(float) * V);
            kth = kth_largest(v, V, s->top_k);
        }
        for (i = 0; i < V; i++)
            if (p[i] < kth) p[i] = -INFINITY;
    }
    const float top = largest(p, V);
    if (!isfinite(top)) return -1; /* every logit -inf */
    for (i = 0; i + 8 <= V; i += 8)
        _mm256_storeu_ps(p + i, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(top))));
    for (; i < V; i++) {
        float e[8] = {p[i] - top};
        _mm256_storeu_ps(e, exp_ps(_mm256_loadu_ps(e)));
        p[i] = e[0];
    }
    scale_by(p, V, (float)(1.0 / sum_of(p, V)));
    if (s->top_p < 1.0f) nucleus(p, V, s->top_p, keys);
    if (s->min_p > 0.0f) drop_below(p, V, s->min_p * largest(p, V));
    scale_by(p, V, (float)(1.0 / sum_of(p, V)));
    /* invert the cumulative distribution at u x its total, below the total by one float32 step (u x the
       total could round up to it, past every token): the first token whose cumulative sum exceeds that */
    const float total = (float)sum_of(p, V), at = u * (total * (1.0f - 0x1p-23f));
    if (!(total > 0 && total < INFINITY)) return -1;
    double sum = 0;
    for (i = 0; i < V; i++) {
        sum += p[i];
        if ((float)sum > at) return i;
    }
    for (i = V - 1; i >= 0; i--) /* not reached: `at` is below the total */
        if (p[i] > 0) return i;
    return -1;
}

/* rows of logits [rows, V] -> out[rows], row r drawn with u[r] (the engine's steps); probs [V] and keys [V]
   scratch. 0, or -1 where a row's probabilities are not finite numbers. */
int sample_rows(const float *logits, int64_t rows, int64_t V, const sampling *s, const float *u, int64_t *out,
                float *probs, uint64_t *keys) {
    for (int64_t r = 0; r < rows; r++)
        if ((out[r] = sample_row(logits + r * V, V, s, u[r], probs, keys)) < 0) return -1;
    return 0;
}
