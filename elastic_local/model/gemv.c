/* Matrix-vector products for batch-1 decode on x86 CPUs with AVX2, FMA and F16C, and the blocked product
 * a prompt's many rows take (section "Many rows of x"); model/gemv.py builds and loads this file,
 * everything else falls back to torch's matmul.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] for m < M, n < N, k < K. W's rows lie `ldw` elements (bytes for
 * the packed formats) apart, so an elastic budget's prefix view W[r0:r1, :K] of a wider weight streams
 * as it is: every row is K contiguous values. x and y are float32, contiguous; one thread per block of
 * output rows (one thread for small weights, where waking the others costs more than it saves). Each
 * returns 0, or -1 where a scratch buffer could not be allocated.
 *
 * The packed formats are decoded in registers, never written out to memory:
 *   bf16   the top half of a float32
 *   fp8    e4m3 (NVIDIA Model Optimizer's per-tensor FP8): its fields shifted into an fp16, converted
 *   nvfp4  e2m1 codes, two per byte (low nibble first), one e4m3 scale per 16 inputs and one float
 *          scale per tensor (Model Optimizer's NVFP4)
 * Every decode is exact; products are summed in float32 (in another order than torch's matmul).
 *
 * gemv_t_f32 takes a float32 weight kept transposed, T = W^T [K, ldt] (model/linear.Transposed): a
 * budget's view T[:K, r0:r1] is K row segments. Each thread owns a slice of the outputs, keeps them in
 * its cache and adds eight rows of T at a time into them (four with several rows of x): eight streams,
 * no horizontal sums.
 * With one row of x the decode feeds the products directly; with two or three, each weight row is
 * decoded once into a scratch row that every row of x then reads; from four, 24 weight rows at a time are
 * decoded into a panel that register tiles run over (the section "Many rows of x").
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 e4m3 bytes -> 16 fp16 holding value / 2^8: e4m3 is fp16 with 4 exponent bits and 3 mantissa bits,
   so the magnitude bits move up by 7 and the sign by 8; subnormals stay subnormal, exactly. The shift by
   7 leaves the sign at bit 14, and adding that bit to itself carries it into bit 15. */
static inline __m256i e4m3_as_f16(__m128i bytes) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 7);
    return _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));
}

static inline float e4m3_scalar(uint8_t b) { /* value / 2^8, as above */
    return _cvtsh_ss((unsigned short)(((b & 0x7F) << 7) | ((b & 0x80) << 8)));
}

static inline float dot_f32(const float *x, const float *w, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
    }
    float t = hsum(_mm256_add_ps(a0, a1));
    for (; k < K; k++) t += x[k] * w[k];
    return t;
}

static inline __m256 bf16_as_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float dot_bf16(const float *x, const uint16_t *w, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(w + k));
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), bf16_as_f32(_mm256_castsi256_si128(h)), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), bf16_as_f32(_mm256_extracti128_si256(h, 1)), a1);
    }
    float t = hsum(_mm256_add_ps(a0, a1));
    for (; k < K; k++) {
        union { uint32_t u; float f; } v = {(uint32_t)w[k] << 16};
        t += x[k] * v.f;
    }
    return t;
}

static inline float dot_fp8(const float *x, const uint8_t *w, int64_t K) { /* times 2^-8 */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    const __m128i sign = _mm_set1_epi16(0x4000);
    for (; k + 16 <= K; k += 16) { /* e4m3_as_f16 in two 128-bit halves: no lane extract (measured 1.08x) */
        __m128i h0 = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(w + k))), 7);
        __m128i h1 = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(w + k + 8))), 7);
        h0 = _mm_add_epi16(h0, _mm_and_si128(h0, sign));
        h1 = _mm_add_epi16(h1, _mm_and_si128(h1, sign));
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_cvtph_ps(h0), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_cvtph_ps(h1), a1);
    }
    float t = hsum(_mm256_add_ps(a0, a1));
    for (; k < K; k++) t += x[k] * e4m3_scalar(w[k]);
    return t;
}

static inline __m128i e2m1_lut(void) { /* e2m1 code -> the high byte of its fp16 (of value / 2^14) */
    return _mm_setr_epi8(0x00, 0x02, 0x04, 0x06, 0x08, 0x0A, 0x0C, 0x0E, (char)0x80, (char)0x82, (char)0x84,
                         (char)0x86, (char)0x88, (char)0x8A, (char)0x8C, (char)0x8E);
}

/* One block of 16 e2m1 codes (8 bytes) -> the high bytes of their fp16s, the 8 even inputs' codes first,
   then the 8 odd ones'. An e2m1 code's fp16 has bits only in its high byte, so one byte shuffle decodes
   the block; unpacking it under zero bytes gives the fp16s. */
static inline __m128i e2m1_high_bytes(__m128i bytes) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i codes = _mm_unpacklo_epi64(_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    return _mm_shuffle_epi8(e2m1_lut(), codes);
}

static inline __m256 even_f16(__m128i high) { return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), high)); }
static inline __m256 odd_f16(__m128i high) { return _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), high)); }

/* One block times its 16 inputs; x comes with each block of 16 permuted: even inputs, then odd. */
static inline __m256 block_nvfp4(const float *x, __m128i bytes) {
    __m128i high = e2m1_high_bytes(bytes);
    return _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), odd_f16(high), _mm256_mul_ps(_mm256_loadu_ps(x), even_f16(high)));
}

/* 8 e4m3 block scales -> 8 floats of value / 2^8 */
static inline __m256 e4m3x8(const uint8_t *s) {
    return _mm256_cvtph_ps(_mm256_castsi256_si128(e4m3_as_f16(_mm_loadl_epi64((const __m128i *)s))));
}

static inline float dot_nvfp4(const float *x, const uint8_t *w, const uint8_t *scales, int64_t K) { /* * 2^-22 */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    const __m128i lut = e2m1_lut(), low4 = _mm_set1_epi8(0x0F), zero = _mm_setzero_si128();
    float s[8];
    for (; k + 128 <= K; k += 128) { /* 8 blocks, their scales decoded at once */
        _mm256_storeu_ps(s, e4m3x8(scales + k / 16)); /* broadcast from memory: loads, not shuffles */
        for (int b = 0; b < 8; b += 2) { /* two blocks in 16 bytes: one shuffle for all even codes, one odd */
            __m128i bytes = _mm_loadu_si128((const __m128i *)(w + k / 2 + b * 8));
            __m128i even = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4));
            __m128i odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
            const float *xb = x + k + b * 16;
            __m256 p0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, odd)),
                                        _mm256_mul_ps(_mm256_loadu_ps(xb), _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, even))));
            __m256 p1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, odd)),
                                        _mm256_mul_ps(_mm256_loadu_ps(xb + 16), _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, even))));
            a0 = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(s + b), a0);
            a1 = _mm256_fmadd_ps(p1, _mm256_broadcast_ss(s + b + 1), a1);
        }
    }
    for (; k < K; k += 16)
        a0 = _mm256_fmadd_ps(block_nvfp4(x + k, _mm_loadl_epi64((const __m128i *)(w + k / 2))),
                             _mm256_set1_ps(e4m3_scalar(scales[k / 16])), a0);
    return hsum(_mm256_add_ps(a0, a1));
}

/* Several rows of x: a weight row is decoded once into `out` (float32, the x order) and every row of x
   takes a float32 dot product with it, instead of decoding it again per row. */
static inline void decode_fp8(const uint8_t *w, int64_t K, float *out) { /* value / 2^8 */
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256i h = e4m3_as_f16(_mm_loadu_si128((const __m128i *)(w + k)));
        _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
        _mm256_storeu_ps(out + k + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
    for (; k < K; k++) out[k] = e4m3_scalar(w[k]);
}

static inline void decode_nvfp4(const uint8_t *w, const uint8_t *scales, int64_t K, float *out) { /* / 2^22 */
    for (int64_t k = 0; k < K; k += 16) {
        __m128i high = e2m1_high_bytes(_mm_loadl_epi64((const __m128i *)(w + k / 2)));
        __m256 s = _mm256_set1_ps(e4m3_scalar(scales[k / 16]));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(s, even_f16(high)));
        _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(s, odd_f16(high)));
    }
}

static inline void decode_bf16(const uint16_t *w, int64_t K, float *out) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, bf16_as_f32(_mm_loadu_si128((const __m128i *)(w + k))));
    for (; k < K; k++) {
        uint32_t bits = (uint32_t)w[k] << 16;
        memcpy(out + k, &bits, sizeof(float));
    }
}

/* ------------------------------------------------------------------------------------------------------
 * Many rows of x (a prompt's projections, an expert's tokens): the blocked product of BLIS and GotoBLAS.
 * 24 outputs' weights, KC inputs at a time, lie in an aligned panel [KC, 24] that stays in L1, and 4 x 24
 * register tiles run over every row of x against it, adding the next KC inputs' panel into the same
 * outputs. Float32 weights kept transposed (T [K, ldt], a budget's view strided: a power-of-two ldt would
 * map all of a panel's rows onto one cache set) are copied into panels; the other formats are decoded
 * into them, their scale folded in. On this project's 2-core AMD EPYC (Zen 1), at a prompt's 128 rows,
 * these panels reached 80-100% of a bare FMA loop's rate and ran 1.24-1.29x MKL's sgemm; from 512 rows
 * 1.0-1.2x (README, "Prefill products on packed panels"). */

#define KC 256 /* panel rows: 24 x 256 floats = 24 KiB, within a 32 KiB L1 beside four rows of x */

/* c[r, 0:24] (+)= sum_k a[r, k] p[k, 0:24], r < R (a's rows lda apart), p packed [kc, 24]: twelve
   accumulators, 12 FMAs per k against 3 loads of p and 4 broadcasts of a (6 x 16 tiles: slower on five of
   six prompt shapes, README) */
static inline __attribute__((always_inline)) void tile_packed(int R, const float *a, int64_t lda, const float *p,
                                                              int64_t kc, float *c, int64_t ldc, int add) {
    __m256 acc[4][3];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 3; v++) acc[r][v] = add ? _mm256_loadu_ps(c + r * ldc + 8 * v) : _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_load_ps(p + 24 * k), b1 = _mm256_load_ps(p + 24 * k + 8),
                     b2 = _mm256_load_ps(p + 24 * k + 16);
        for (int r = 0; r < R; r++) {
            const __m256 ar = _mm256_broadcast_ss(a + r * lda + k);
            acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(ar, b2, acc[r][2]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 3; v++) _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);
}

/* Every row of a over one panel, four at a time, the last ones on a tile of their own count. */
static void over_rows(int64_t m, const float *a, int64_t lda, const float *p, int64_t kc, float *c, int64_t ldc,
                      int add) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) tile_packed(4, a + i * lda, lda, p, kc, c + i * ldc, ldc, add);
    a += i * lda, c += i * ldc;
    switch (m - i) {
    case 1: tile_packed(1, a, lda, p, kc, c, ldc, add); break;
    case 2: tile_packed(2, a, lda, p, kc, c, ldc, add); break;
    case 3: tile_packed(3, a, lda, p, kc, c, ldc, add); break;
    }
}

/* y[:m, :cols] (+)= x[:m, :kc] p (x's rows ldx apart, y's ldy) for one panel p [kc, 24]: a block of fewer
   than 24 outputs runs through c (4 x 24 floats), four rows at a time. */
static void panel_product(const float *x, int64_t ldx, int64_t m, const float *p, int64_t kc, float *y,
                          int64_t ldy, int64_t cols, int add, float *c) {
    if (cols == 24) {
        over_rows(m, x, ldx, p, kc, y, ldy, add);
        return;
    }
    for (int64_t i = 0; i < m; i += 4) {
        const int64_t r = m - i < 4 ? m - i : 4;
        for (int64_t q = 0; q < r; q++)
            for (int64_t j = 0; j < 24; j++) c[q * 24 + j] = add && j < cols ? y[(i + q) * ldy + j] : 0.f;
        over_rows(r, x + i * ldx, ldx, p, kc, c, 24, add);
        for (int64_t q = 0; q < r; q++) memcpy(y + (i + q) * ldy, c + q * 24, sizeof(float) * cols);
    }
}

/* y[:, c0:c1] = x [M, K] T[:, c0:c1] (y's rows N apart, T's ldt), NB blocks of 24 outputs at a time: their
   KC rows of T are copied into NB panels row by row (NB x 24 contiguous floats a row, a stream the
   prefetcher follows; panel by panel, every row of T is 96 bytes after a jump, a miss each, and those
   misses cost as much as the products of 128 rows of x), then MC rows of x at a time (they stay in L2
   beside the panels) run over each panel. `P`: PACKED_SCRATCH floats, 32-byte aligned. */
#define NB 8
#define MC 128
#define PACKED_SCRATCH (NB * KC * 24 + 4 * 24)
const int64_t gemm_t_scratch = PACKED_SCRATCH; /* for step.c's experts */
void gemm_t_part(const float *x, const float *t, int64_t ldt, float *y, int64_t M, int64_t N, int64_t K,
                 int64_t c0, int64_t c1, float *P) {
    for (int64_t n0 = c0; n0 < c1; n0 += NB * 24) {
        const int64_t n1 = n0 + NB * 24 < c1 ? n0 + NB * 24 : c1;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            for (int64_t k = 0; k < kc; k++) {
                const float *src = t + (k0 + k) * ldt;
                for (int64_t n = n0; n < n1; n += 24) {
                    float *p = P + (n - n0) * kc + 24 * k;
                    if (n1 - n >= 24) {
                        for (int v = 0; v < 3; v++) _mm256_store_ps(p + 8 * v, _mm256_loadu_ps(src + n + 8 * v));
                    } else {
                        for (int64_t j = 0; j < 24; j++) p[j] = n + j < n1 ? src[n + j] : 0.f;
                    }
                }
            }
            for (int64_t m0 = 0; m0 < M; m0 += MC)
                for (int64_t n = n0; n < n1; n += 24)
                    panel_product(x + m0 * K + k0, K, M - m0 < MC ? M - m0 : MC, P + (n - n0) * kc, kc,
                                  y + m0 * N + n, N, n1 - n < 24 ? n1 - n : 24, k0 > 0, P + NB * KC * 24);
        }
    }
}

/* y [M, N] = x [M, K] T[:, :N]: each thread takes a share of the blocks of 24 outputs. */
int gemm_t_f32(const float *x, const float *t, float *y, int64_t M, int64_t N, int64_t K, int64_t ldt,
               int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (M * N * K >= 1 << 20) reduction(|| : failed)
    {
        int64_t parts = 1, part = 0;
#ifdef _OPENMP
        parts = omp_get_num_threads(), part = omp_get_thread_num();
#endif
        const int64_t blocks = (N + 23) / 24, per = (blocks + parts - 1) / parts;
        const int64_t c0 = part * per * 24 < N ? part * per * 24 : N, c1 = c0 + per * 24 < N ? c0 + per * 24 : N;
        float *P = aligned_alloc(32, sizeof(float) * PACKED_SCRATCH);
        failed = !P;
        if (P) gemm_t_part(x, t, ldt, y, M, N, K, c0, c1, P);
        free(P);
    }
    return failed ? -1 : 0;
}

enum { PANEL_F32, PANEL_BF16, PANEL_FP8, PANEL_NVFP4 };
#define PANEL_MIN_ROWS 4 /* fewer rows: the dot products, which need no transposed copy */

static void decode_row(int format, const void *w, const uint8_t *scales, int64_t K, float *row) {
    switch (format) {
    case PANEL_F32: memcpy(row, w, sizeof(float) * K); break;
    case PANEL_BF16: decode_bf16(w, K, row); break;
    case PANEL_FP8: decode_fp8(w, K, row); break;
    default: decode_nvfp4(w, scales, K, row);
    }
}

/* Eight rows r[0..7] of K floats -> columns of P [K, 24] (rows 24 floats apart, 32-byte aligned), times
   `scale`: 8 x 8 blocks transposed in registers, a last K % 8 inputs one at a time. */
static void rows_to_columns(const float *r, int64_t K, float scale, float *P) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 a[8], t[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(r + i * K + k), s);
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
        }
        for (int i = 0; i < 8; i += 4)
            for (int h = 0; h < 2; h++) {
                a[i + h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0x44);
                a[i + h + 2] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0xEE);
            }
        /* a[0], a[2], a[1], a[3]: columns 0, 1, 2, 3 of rows 0-3 in their low lanes, columns 4, 5, 6, 7 in
           their high lanes; a[4..7] the same for rows 4-7 */
        const int order[4] = {0, 2, 1, 3};
        for (int q = 0; q < 4; q++) {
            _mm256_store_ps(P + (k + q) * 24, _mm256_permute2f128_ps(a[order[q]], a[4 + order[q]], 0x20));
            _mm256_store_ps(P + (k + q + 4) * 24, _mm256_permute2f128_ps(a[order[q]], a[4 + order[q]], 0x31));
        }
    }
    for (; k < K; k++)
        for (int i = 0; i < 8; i++) P[k * 24 + i] = r[i * K + k] * scale;
}

/* y[:, n0:n1] = x W[n0:n1]^T * scale, W's rows ldw bytes apart (NVFP4's scales lds bytes): 24 weight rows at
   a time decoded (eight at a time, then transposed in registers, their scale folded in) into a panel
   P [K, 24], which gemm_t_part's tiles then run over, KC rows of it at a time (each decode serves every row
   of x, each load of the panel four of them). The transpose replaced a scalar store per value: 0.98-1.15x,
   1.05x geometric mean, on 128-token FP8 / NVFP4 prompts (six A/B runs, README). Returns 0 where the panel
   could not be allocated, and the caller takes the dot products. */
static int panels(int format, const float *x, const void *w, const uint8_t *scales, float *y, int64_t M,
                  int64_t N, int64_t K, int64_t ldw, int64_t lds, float scale, int64_t n0, int64_t n1) {
    float *P = aligned_alloc(32, sizeof(float) * ((24 * K + 8 * K + 4 * 24 + 7) / 8 * 8));
    if (!P) return 0;
    float *rows = P + 24 * K, *c = rows + 8 * K;
    for (int64_t n = n0; n < n1; n += 24) {
        const int64_t cols = n1 - n < 24 ? n1 - n : 24;
        for (int64_t g = 0; g < 24; g += 8) { /* eight weight rows decoded, then transposed into the panel */
            for (int64_t j = g; j < g + 8; j++) {
                if (j < cols)
                    decode_row(format, (const uint8_t *)w + (n + j) * ldw, scales ? scales + (n + j) * lds : NULL, K,
                               rows + (j - g) * K);
                else
                    memset(rows + (j - g) * K, 0, sizeof(float) * K);
            }
            rows_to_columns(rows, K, scale, P + g);
        }
        for (int64_t m0 = 0; m0 < M; m0 += MC)
            for (int64_t k0 = 0; k0 < K; k0 += KC)
                panel_product(x + m0 * K + k0, K, M - m0 < MC ? M - m0 : MC, P + 24 * k0, K - k0 < KC ? K - k0 : KC,
                              y + m0 * N + n, N, cols, k0 > 0, c);
    }
    free(P);
    return 1;
}

/* ------------------------------------------------------------------------------------------------------
 * The kernels over one thread's share of the outputs, [n0, n1); `share` says which. Called by the gemv_*
 * entry points below, each in its own parallel region, and by step.c inside a block's one region. */

/* This thread's share of N outputs within the current parallel region (all of them outside one), in
   multiples of 16: whole cache lines of y, whole vectors of gemv_t's rows. */
void share(int64_t N, int64_t *n0, int64_t *n1) {
    int64_t parts = 1, part = 0;
#ifdef _OPENMP
    parts = omp_get_num_threads(), part = omp_get_thread_num();
#endif
    int64_t chunk = ((N + parts - 1) / parts + 15) / 16 * 16;
    *n0 = part * chunk < N ? part * chunk : N;
    *n1 = *n0 + chunk < N ? *n0 + chunk : N;
}

void part_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
              int64_t n0, int64_t n1) {
    if (M >= PANEL_MIN_ROWS && panels(PANEL_F32, x, w, NULL, y, M, N, K, ldw * 4, 0, 1.f, n0, n1)) return;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_f32(x + m * K, w + n * ldw, K);
}

void part_t_f32(const float *x, const float *t, float *y, int64_t M, int64_t N, int64_t K, int64_t ldt,
                int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) y[m * N + n] = 0.f;
    int64_t k = 0;
    for (; M == 1 && k + 8 <= K; k += 8) { /* one row of x: eight rows of T per pass over y */
        const float *t0 = t + k * ldt;
        __m256 xs[8];
        for (int j = 0; j < 8; j++) xs[j] = _mm256_set1_ps(x[k + j]);
        int64_t n = n0;
        for (; n + 8 <= n1; n += 8) {
            __m256 a = _mm256_fmadd_ps(xs[0], _mm256_loadu_ps(t0 + n), _mm256_loadu_ps(y + n));
            __m256 b = _mm256_mul_ps(xs[4], _mm256_loadu_ps(t0 + 4 * ldt + n));
            a = _mm256_fmadd_ps(xs[1], _mm256_loadu_ps(t0 + ldt + n), a);
            b = _mm256_fmadd_ps(xs[5], _mm256_loadu_ps(t0 + 5 * ldt + n), b);
            a = _mm256_fmadd_ps(xs[2], _mm256_loadu_ps(t0 + 2 * ldt + n), a);
            b = _mm256_fmadd_ps(xs[6], _mm256_loadu_ps(t0 + 6 * ldt + n), b);
            a = _mm256_fmadd_ps(xs[3], _mm256_loadu_ps(t0 + 3 * ldt + n), a);
            b = _mm256_fmadd_ps(xs[7], _mm256_loadu_ps(t0 + 7 * ldt + n), b);
            _mm256_storeu_ps(y + n, _mm256_add_ps(a, b));
        }
        for (; n < n1; n++)
            for (int j = 0; j < 8; j++) y[n] += x[k + j] * t0[j * ldt + n];
    }
    for (; k + 4 <= K; k += 4) {
        const float *t0 = t + k * ldt, *t1 = t0 + ldt, *t2 = t1 + ldt, *t3 = t2 + ldt;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float *ym = y + m * N;
            __m256 x0 = _mm256_set1_ps(xm[k]), x1 = _mm256_set1_ps(xm[k + 1]);
            __m256 x2 = _mm256_set1_ps(xm[k + 2]), x3 = _mm256_set1_ps(xm[k + 3]);
            int64_t n = n0;
            for (; n + 8 <= n1; n += 8) {
                __m256 acc = _mm256_fmadd_ps(x0, _mm256_loadu_ps(t0 + n), _mm256_loadu_ps(ym + n));
                acc = _mm256_fmadd_ps(x1, _mm256_loadu_ps(t1 + n), acc);
                acc = _mm256_fmadd_ps(x2, _mm256_loadu_ps(t2 + n), acc);
                _mm256_storeu_ps(ym + n, _mm256_fmadd_ps(x3, _mm256_loadu_ps(t3 + n), acc));
            }
            for (; n < n1; n++) ym[n] += xm[k] * t0[n] + xm[k + 1] * t1[n] + xm[k + 2] * t2[n] + xm[k + 3] * t3[n];
        }
    }
    for (; k < K; k++)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * N + n] += x[m * K + k] * t[k * ldt + n];
}

void part_bf16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
               int64_t n0, int64_t n1) {
    if (M >= PANEL_MIN_ROWS && panels(PANEL_BF16, x, w, NULL, y, M, N, K, ldw * 2, 0, 1.f, n0, n1)) return;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_bf16(x + m * K, w + n * ldw, K);
}

void part_fp8(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
              float scale, int64_t n0, int64_t n1) {
    scale *= 256.f;
    if (M >= PANEL_MIN_ROWS && panels(PANEL_FP8, x, w, NULL, y, M, N, K, ldw, 0, scale, n0, n1)) return;
    for (int64_t n = n0; n < n1; n++) {
        if (M == 1) {
            y[n] = dot_fp8(x, w + n * ldw, K) * scale;
            continue;
        }
        float row[K];
        decode_fp8(w + n * ldw, K, row);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_f32(x + m * K, row, K) * scale;
    }
}

/* x permuted for part_nvfp4 (each block of 16: even inputs, then odd); M * K floats */
void permute_nvfp4(const float *x, float *xp, int64_t MK) {
    for (int64_t i = 0; i < MK; i += 16)
        for (int j = 0; j < 8; j++) xp[i + j] = x[i + 2 * j], xp[i + 8 + j] = x[i + 2 * j + 1];
}

/* K % 16 == 0; w [N, ldw bytes], scales [N, lds bytes]; xp from permute_nvfp4. */
void part_nvfp4(const float *xp, const uint8_t *w, const uint8_t *scales, float *y, int64_t M, int64_t N,
                int64_t K, int64_t ldw, int64_t lds, float scale, int64_t n0, int64_t n1) {
    scale *= 16384.f * 256.f;
    if (M >= PANEL_MIN_ROWS && panels(PANEL_NVFP4, xp, w, scales, y, M, N, K, ldw, lds, scale, n0, n1)) return;
    for (int64_t n = n0; n < n1; n++) {
        if (M == 1) {
            y[n] = dot_nvfp4(xp, w + n * ldw, scales + n * lds, K) * scale;
            continue;
        }
        float row[K];
        decode_nvfp4(w + n * ldw, scales + n * lds, K, row);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_f32(xp + m * K, row, K) * scale;
    }
}

/* ------------------------------------------------------------------------------------------------------
 * Entry points (model/gemv.py): one parallel region each, for weights large enough to be worth waking
 * the other threads. */

#define SHARED(call) do {                                                              \
        _Pragma("omp parallel num_threads(threads) if (N * K >= 65536)")              \
        { int64_t n0, n1; share(N, &n0, &n1); call; }                                  \
    } while (0)

int gemv_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
             int threads) {
    SHARED(part_f32(x, w, y, M, N, K, ldw, n0, n1));
    return 0;
}

int gemv_t_f32(const float *x, const float *t, float *y, int64_t M, int64_t N, int64_t K, int64_t ldt,
               int threads) {
    SHARED(part_t_f32(x, t, y, M, N, K, ldt, n0, n1));
    return 0;
}

int gemv_bf16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
              int threads) {
    SHARED(part_bf16(x, w, y, M, N, K, ldw, n0, n1));
    return 0;
}

int gemv_fp8(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
             float scale, int threads) {
    SHARED(part_fp8(x, w, y, M, N, K, ldw, scale, n0, n1));
    return 0;
}

int gemv_nvfp4(const float *x, const uint8_t *w, const uint8_t *scales, float *y, int64_t M, int64_t N,
               int64_t K, int64_t ldw, int64_t lds, float scale, int threads) {
    float *xp = malloc(M * K * sizeof(float));
    if (!xp) return -1;
    permute_nvfp4(x, xp, M * K);
    SHARED(part_nvfp4(xp, w, scales, y, M, N, K, ldw, lds, scale, n0, n1));
    free(xp);
    return 0;
}
