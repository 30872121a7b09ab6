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
 *   fp8    e4m3 (NVIDIA Model Optimizer's per-tensor FP8): for one row of x its fields moved into a float32
 *          by integer operations (dot_fp8), for more rows shifted into an fp16 and converted
 *   nvfp4  e2m1 codes, two per byte (low nibble first), one e4m3 scale per 16 inputs and one float
 *          scale per tensor (Model Optimizer's NVFP4): two byte shuffles give each code's bf16 (e2m1x64)
 * Every decode is exact; products are summed in float32 (in another order than torch's matmul).
 * NVFP4 with its inputs rounded to NVFP4 too (W4A4, section "NVFP4 inputs rounded to NVFP4 too") multiplies
 * small integers instead: up to 7 rows of x on `vpmaddubsw`, more rows rounded and run as above.
 *
 * Float32 weights on the CPU are kept in column panels (model/linear.Panels): W^T cut into panels of 24
 * outputs, each [K, 24] contiguous, panel q + 1's rows `ps` floats after panel q's. A budget's view (its
 * first K inputs, outputs [r0, r1)) is then every panel's first K rows: one contiguous run per panel,
 * whatever the budget cuts, where a plain transpose [K, N] gave short row pieces a stride apart that
 * streamed 1.2-1.4x slower than the same bytes contiguous (docs/decode-speed.md, "Budgets in column panels"). A view
 * starts `skip` columns into its first panel. One row of x runs over four panels at a time (twelve
 * accumulators, four streams); more rows run the blocked product's register tiles straight on the panels
 * (section "Many rows of x"). A BF16 file's weights are kept in bf16 panels of the same shape, widened
 * exactly as they are read (half the bytes; the same sums as their float32 panels), each row's 24 columns
 * stored in the order bf16_panel_row reads (linear.BF16_COLUMNS). A CPU load keeps an FP8 file's codes in
 * e4m3 panels of the same shape (quant/fp8.py FP8Panels; gemv_p_fp8, gemm_p8_bf16x): one row of x decodes them in
 * registers (e4m3x8_low), a few rows' tiles widen it as they read it, more rows widen a panel's block once.
 * As rows, a budget's view streamed 1.4-1.5x slower per weight than in panels at 448 of 768 inputs, and
 * gen16's small budget decoded 1.07-1.21x slower (docs/decode-speed.md, "FP8 codes in column panels").
 * NVFP4 keeps W's rows (so do FP8 weights made outside a CPU load): with up to three rows of x the decode
 * feeds each row's products directly (each weight row decoded once into a float32 row that every row of x
 * then read ran 1.1-1.34x slower at two and three rows, scratch); from four, 24 weight rows at a time are
 * decoded into a panel of the same shape that the tiles run over.
 * A bfloat16 prompt (x in bf16) runs on the CPU's bf16 dot products where it has them (AVX512-BF16, chosen
 * at run time: section "A bfloat16 prompt on bf16 dot products"), with bf16 or packed weights alike.
 */
#include <cpuid.h>
#include <float.h>
#include <immintrin.h>
#include <math.h>
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

/* e4m3 bytes -> fp16s holding value / 2^8, 8 or 16 at a time (a prompt's rows, a row's last K % 32):
   e4m3 is fp16 with 4 exponent bits and 3 mantissa bits, so the magnitude bits move up by 7 and the sign
   by 8; subnormals stay subnormal, exactly. Each byte is sign-extended to 16 bits, so after the shift by
   7 its sign fills bits 14 and 15, and clearing bit 14 leaves it in 15. */
static inline __m128i e4m3x8_as_f16(__m128i bytes) { /* the low 8 bytes */
    return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), _mm_set1_epi16((short)0xBFFF));
}

static inline __m256i e4m3_as_f16(__m128i bytes) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16((short)0xBFFF));
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

/* One row of a bf16 panel -> its 24 columns as float32, in three vectors (columns 0-7, 8-15, 16-23). A bf16
   is the top half of a float32, so a 32-bit pair of bf16s gives two floats, its low half by a shift and its
   high half by a mask; the panel stores its first 16 columns as such pairs, (0, 8), (1, 9) .. (7, 15), and
   the last 8 in order (linear.BF16_COLUMNS), which a zero-extending load and a shift widen. Zero-extending
   every column instead took two operations per eight columns where the pairs take one: 1.45-1.62x for a
   decode product whose panels sit in the caches, 1.13x streamed from memory (scratch, 2 threads). The last
   8 stored as pairs too, (16, 20) .. (19, 23), took a mask, a shift and a 128-bit insert to join their
   halves: without the insert a decode product ran 1.40-1.57x faster on one thread, 1.17-1.54x on two
   (512x512 to 3000x1024; 256x80: 1.07-1.09x; scratch, in one process, the same bits). */
static inline void bf16_panel_row(const uint16_t *r, __m256 v[3]) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)r);
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(a, _mm256_set1_epi32((int)0xFFFF0000)));
    v[2] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + 16))), 16));
}

/* Each half of 16 weights by its own zero-extending load: one 256-bit load split by an extract ran a bf16
   row product (a tied LM head, the rows layout) 1.08-1.26x slower on one thread, 1.06-1.09x on two
   (scratch A/B in one process, 256-1024 inputs, the same bits). */
static inline float dot_bf16(const float *x, const uint16_t *w, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), bf16_as_f32(_mm_loadu_si128((const __m128i *)(w + k))), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), bf16_as_f32(_mm_loadu_si128((const __m128i *)(w + k + 8))), a1);
    }
    float t = hsum(_mm256_add_ps(a0, a1));
    for (; k < K; k++) {
        union { uint32_t u; float f; } v = {(uint32_t)w[k] << 16};
        t += x[k] * v.f;
    }
    return t;
}

/* Every e4m3 byte's value / 2^8, filled when the library loads: NVFP4 reads its block scales from here, one
   broadcast load each (eight scales decoded at once, stored and loaded back one by one, ran 1.13-1.19x
   slower, scratch, one thread: each load waited on the store), and FP8's dot product its last K % 32. */
static float e4m3_values[256];

__attribute__((constructor)) static void fill_e4m3_values(void) {
    for (int b = 0; b < 256; b++) e4m3_values[b] = e4m3_scalar((uint8_t)b);
}

/* FP8's decode product reads each e4m3 weight as the float32 that holds value * 2^-120, made by integer
   operations alone, 32 at a time: each byte moves to the top of a 16-bit lane, an arithmetic shift by 4
   leaves its exponent and mantissa where a bf16's low exponent bits and mantissa lie, a mask clears the
   sign's copies (a bf16 of value * 2^-120; e4m3's subnormals become float32 subnormals, exactly), and each
   32-bit pair of bf16s gives two floats, by a shift and by a mask. The fp16 conversion it replaced is slow
   on this project's CPU (AMD Zen 1; docs/decode-speed.md, "FP8 and NVFP4 decode without the fp16 conversion").
   The floats of each block of 32 come out as its inputs 0, 2, 4, 6, 16, 18, 20, 22, then the odd ones
   of the same, then 8, 10 .. 30 and the odd ones of those, so x is permuted to match, and scaled by 2^a
   (fp8_inputs) so that the products x 2^a * value 2^-120 are those of x * value times 2^(a - 120): the
   same ones where a = 120 (every |x| < 128), else scaled down by a power of two that keeps x 2^a finite. */
#define FP8_BLOCK 32

/* The a of x's scaling: 2^a x stays finite, its products with value 2^-120 normal. */
static int fp8_shift(const float *x, int64_t K) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 most = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) most = _mm256_max_ps(most, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float big = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; k < K; k++) big = fmaxf(big, fabsf(x[k]));
    int e = 0;
    frexpf(big, &e); /* big < 2^e */
    return e > 7 ? 127 - e : 120;
}

/* xq = x for dot_fp8: each whole block of 32 permuted as above and times 2^a, the last K % 32 as they are;
   returns 2^(120 - a), what undoes the scaling. */
static float fp8_inputs(const float *x, int64_t K, float *xq) {
    const int a = fp8_shift(x, K);
    const __m256 up = _mm256_set1_ps(ldexpf(1.f, a));
    int64_t k = 0;
    for (; k + FP8_BLOCK <= K; k += FP8_BLOCK) { /* [0..7 | 16..23] and [8..15 | 24..31], even then odd */
        const __m256 a0 = _mm256_loadu_ps(x + k), a1 = _mm256_loadu_ps(x + k + 8), a2 = _mm256_loadu_ps(x + k + 16),
                     a3 = _mm256_loadu_ps(x + k + 24);
        const __m256 p = _mm256_permute2f128_ps(a0, a2, 0x20), q = _mm256_permute2f128_ps(a0, a2, 0x31),
                     r = _mm256_permute2f128_ps(a1, a3, 0x20), t = _mm256_permute2f128_ps(a1, a3, 0x31);
        _mm256_storeu_ps(xq + k, _mm256_mul_ps(_mm256_shuffle_ps(p, q, 0x88), up));
        _mm256_storeu_ps(xq + k + 8, _mm256_mul_ps(_mm256_shuffle_ps(p, q, 0xDD), up));
        _mm256_storeu_ps(xq + k + 16, _mm256_mul_ps(_mm256_shuffle_ps(r, t, 0x88), up));
        _mm256_storeu_ps(xq + k + 24, _mm256_mul_ps(_mm256_shuffle_ps(r, t, 0xDD), up));
    }
    for (; k < K; k++) xq[k] = x[k];
    return ldexpf(1.f, 120 - a);
}

/* Four sums, one multiply-add each per block of 32: with two, each took two a block, a chain of 8 cycles
   (the FMA's latency is 4) per 32 weights, and gen16's FP8 decode ran 1.21x slower at its full budget,
   1.07-1.11x at its small one (one process, both builds; docs/decode-speed.md, "FP8 rows in four sums"). */
static inline float dot_fp8(const float *xq, const uint8_t *w, int64_t K, float unscale) { /* times 2^-8 */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256(), keep = _mm256_set1_epi16((short)0x87FF),
                  high = _mm256_set1_epi32((int)0xFFFF0000);
    int64_t k = 0;
    for (; k + FP8_BLOCK <= K; k += FP8_BLOCK) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(w + k));
        const __m256i lo = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, b), 4), keep);
        const __m256i hi = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, b), 4), keep);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xq + k), _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xq + k + 8), _mm256_castsi256_ps(_mm256_and_si256(lo, high)), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xq + k + 16), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xq + k + 24), _mm256_castsi256_ps(_mm256_and_si256(hi, high)), a3);
    }
    __m256 tail = _mm256_setzero_ps(); /* the last K % 32 (x as it is): 8 at a time through fp16s, then 1 */
    for (; k + 8 <= K; k += 8)
        tail = _mm256_fmadd_ps(_mm256_loadu_ps(xq + k),
                               _mm256_cvtph_ps(e4m3x8_as_f16(_mm_loadl_epi64((const __m128i *)(w + k)))), tail);
    float t = hsum(tail);
    for (; k < K; k++) t += xq[k] * e4m3_values[w[k]];
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3))) * (unscale / 256.f) + t;
}

/* dot_fp8 reads e4m3's subnormals as float32 subnormals: a thread that takes subnormal inputs as zero
   (MXCSR's DAZ bit, torch.set_flush_denormal) would drop them, so its products run with the bit clear. */
static inline unsigned subnormals_on(void) {
    const unsigned csr = _mm_getcsr();
    if (csr & 0x40) _mm_setcsr(csr & ~0x40u);
    return csr;
}

/* 64 e2m1 codes (32 bytes: four blocks of 16, each 8 bytes) -> their values / 2^14 as float32, in eight
   vectors: v[0..3] hold block 0 in their low lanes and block 2 in their high ones, v[4..7] blocks 1 and 3,
   the inputs in the order permute64 gives x. Within a block, input 4 i + 2 odd + nib lands in vector
   2 nib + odd, element i of the block's four; the four blocks may come from four rows (rows_nvfp4's last
   K % 64). Two byte shuffles give each code's bf16 (its high and its low byte), which
   interleave into 16-bit lanes, and each 32-bit pair of bf16s gives two floats by a shift and a mask (as
   in bf16_panel_row): no fp16 conversion, which ran slower on the Zen 1 and again on the Zen 3 (docs/decode-speed.md,
   "FP8 and NVFP4 decode without the fp16 conversion", "The goals rerun at 7ce1ae2"). */
static inline void e2m1x64(__m256i bytes, __m256 v[8]) {
    const __m256i high_bytes = _mm256_setr_epi8(
        0x00, 0x38, 0x38, 0x38, 0x39, 0x39, 0x39, 0x39, (char)0x80, (char)0xB8, (char)0xB8, (char)0xB8, (char)0xB9,
        (char)0xB9, (char)0xB9, (char)0xB9, 0x00, 0x38, 0x38, 0x38, 0x39, 0x39, 0x39, 0x39, (char)0x80, (char)0xB8,
        (char)0xB8, (char)0xB8, (char)0xB9, (char)0xB9, (char)0xB9, (char)0xB9);
    const __m256i low_bytes = _mm256_setr_epi8(
        0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0, 0x00, 0x00, (char)0x80, (char)0xC0, 0x00,
        0x40, (char)0x80, (char)0xC0, 0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0, 0x00, 0x00,
        (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0);
    const __m256i low4 = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi32((int)0xFFFF0000);
    const __m256i codes[2] = {_mm256_and_si256(bytes, low4), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4)};
    for (int nib = 0; nib < 2; nib++) { /* low nibbles (even inputs), then high */
        const __m256i h = _mm256_shuffle_epi8(high_bytes, codes[nib]), l = _mm256_shuffle_epi8(low_bytes, codes[nib]);
        const __m256i words[2] = {_mm256_unpacklo_epi8(l, h), _mm256_unpackhi_epi8(l, h)};
        for (int half = 0; half < 2; half++) { /* bytes 0-7 of each lane, then 8-15 */
            v[4 * half + 2 * nib] = _mm256_castsi256_ps(_mm256_slli_epi32(words[half], 16));
            v[4 * half + 2 * nib + 1] = _mm256_castsi256_ps(_mm256_and_si256(words[half], high));
        }
    }
}

/* The order e2m1x64 leaves a block of 64 codes in: input 32 lane + 16 half + 4 i + 2 odd + nib
   (the byte's lane, the lane's half, the byte 4 i + 2 odd + nib / 2 within it; `nib` its low or high code)
   lands at 32 half + 16 nib + 8 odd + 4 lane + i (vector 4 half + 2 nib + odd: the shift takes each pair's
   first byte, the mask its second; element 4 lane + i). permute64 moves 64 inputs of x there: in each
   half, the four vectors that hold it swap 128-bit lanes (lane 0's i_hi 0 / 1 to the low lanes, lane 1's
   to the high ones) and take a 4 x 4 transpose within each lane. Element by element, as a table lookup
   per float, it cost 0.6 ns a float, on one thread before each prompt product (scratch, 100m): 3-4% of
   an NVFP4 prompt. */
static inline void permute64(const float *r, float *o) {
    for (int half = 0; half < 2; half++) {
        const __m256 r00 = _mm256_loadu_ps(r + 16 * half), r01 = _mm256_loadu_ps(r + 16 * half + 8),
                     r10 = _mm256_loadu_ps(r + 32 + 16 * half), r11 = _mm256_loadu_ps(r + 40 + 16 * half);
        const __m256 t0 = _mm256_permute2f128_ps(r00, r10, 0x20), t1 = _mm256_permute2f128_ps(r00, r10, 0x31),
                     t2 = _mm256_permute2f128_ps(r01, r11, 0x20), t3 = _mm256_permute2f128_ps(r01, r11, 0x31);
        const __m256 a = _mm256_unpacklo_ps(t0, t1), b = _mm256_unpackhi_ps(t0, t1), c = _mm256_unpacklo_ps(t2, t3),
                     d = _mm256_unpackhi_ps(t2, t3);
        float *u = o + 32 * half; /* element q of each 4 is 2 odd + nib: vector 4 half + 2 nib + odd */
        _mm256_storeu_ps(u, _mm256_shuffle_ps(a, c, 0x44));
        _mm256_storeu_ps(u + 16, _mm256_shuffle_ps(a, c, 0xEE));
        _mm256_storeu_ps(u + 8, _mm256_shuffle_ps(b, d, 0x44));
        _mm256_storeu_ps(u + 24, _mm256_shuffle_ps(b, d, 0xEE));
    }
}

/* Two blocks' scales, one per lane (e2m1x64's vectors hold two blocks each). */
static inline __m256 lane_scales(uint8_t low, uint8_t high) {
    return _mm256_set_m128(_mm_broadcast_ss(e4m3_values + high), _mm_broadcast_ss(e4m3_values + low));
}

/* 64 weights of one row (32 bytes, their four scales) times x's 64 inputs, added to acc * 2^22. */
static inline __m256 chunk_nvfp4(const float *x, const uint8_t *w, const uint8_t *s, __m256 acc) {
    __m256 v[8];
    e2m1x64(_mm256_loadu_si256((const __m256i *)w), v);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x), v[0]), q = _mm256_mul_ps(_mm256_loadu_ps(x + 32), v[4]);
    for (int j = 1; j < 4; j++) { /* blocks 0 and 2 summed before their scales, then 1 and 3 */
        p = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * j), v[j], p);
        q = _mm256_fmadd_ps(_mm256_loadu_ps(x + 32 + 8 * j), v[4 + j], q);
    }
    return _mm256_fmadd_ps(q, lane_scales(s[1], s[3]), _mm256_fmadd_ps(p, lane_scales(s[0], s[2]), acc));
}

/* A group of G weight rows (four or eight) and their scales, ldw and lds bytes apart: the rows past R stand
   in as row 0 again (read, summed, not stored), so every group runs the same code. */
static inline void group_rows(int G, const uint8_t *w, const uint8_t *scales, int64_t ldw, int64_t lds, int R,
                              const uint8_t *c[], const uint8_t *sc[]) {
    for (int r = 0; r < G; r++) c[r] = w + (r < R ? r : 0) * ldw, sc[r] = scales + (r < R ? r : 0) * lds;
}

/* A block of 16 inputs of four rows (codes at c[0..3] + k / 2, scales at s[0..3] + k / 16) times x's block:
   rows 0 and 2 added into *t02's low and high lanes (four partial sums each), rows 1 and 3 into *t13's. */
static inline __attribute__((always_inline)) void four_blocks(const float *x, const uint8_t *const c[4],
                                                              const uint8_t *const s[4], int64_t k, __m256 *t02,
                                                              __m256 *t13) {
    __m256 v[8], p = _mm256_setzero_ps(), o = _mm256_setzero_ps();
    e2m1x64(_mm256_set_m128i(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(c[2] + k / 2)),
                                                _mm_loadl_epi64((const __m128i *)(c[3] + k / 2))),
                             _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(c[0] + k / 2)),
                                                _mm_loadl_epi64((const __m128i *)(c[1] + k / 2)))), v);
    for (int j = 0; j < 4; j++) {
        const __m256 xj = _mm256_broadcast_ps((const __m128 *)(x + k + 4 * j));
        p = _mm256_fmadd_ps(xj, v[j], p);
        o = _mm256_fmadd_ps(xj, v[4 + j], o);
    }
    *t02 = _mm256_fmadd_ps(p, lane_scales(s[0][k / 16], s[2][k / 16]), *t02);
    *t13 = _mm256_fmadd_ps(o, lane_scales(s[1][k / 16], s[3][k / 16]), *t13);
}

/* Four weight rows (codes at c[r], scales at sc[r]) times one row of x: out[r] = the row's dot product *
   2^-22. x comes permuted (permute_nvfp4): each whole block of 64 inputs in e2m1x64's order, then the last
   K % 64 a block of 16 at a time, each in the order e2m1x64 leaves one block in (four floats per vector).
   The four rows' sums leave the registers together, and their last K % 64 decode together, a block of each
   row in one e2m1x64 (four_blocks): a budget's rows are often short (16-448 inputs on the demo), where a
   sum per row and a block decoded alone through fp16 weighed (docs/decode-speed.md, "NVFP4 rows four at a
   time"). */
static void rows_nvfp4(const float *x, const uint8_t *const c[4], const uint8_t *const sc[4], int64_t K,
                       float out[4]) {
    const int64_t K64 = K / 64 * 64;
    __m256 a[4];
    for (int r = 0; r < 4; r++) { /* a row at a time: four sums live through the loop would not fit the registers */
        a[r] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K64; k += 64) a[r] = chunk_nvfp4(x + k, c[r] + k / 2, sc[r] + k / 16, a[r]);
    }
    if (K64 < K) { /* rows 0 and 2 in t02's low and high lanes, 1 and 3 in t13's */
        __m256 t02 = _mm256_setzero_ps(), t13 = _mm256_setzero_ps();
        for (int64_t k = K64; k < K; k += 16) four_blocks(x, c, sc, k, &t02, &t13);
        a[0] = _mm256_add_ps(a[0], _mm256_zextps128_ps256(_mm256_castps256_ps128(t02)));
        a[1] = _mm256_add_ps(a[1], _mm256_zextps128_ps256(_mm256_castps256_ps128(t13)));
        a[2] = _mm256_add_ps(a[2], _mm256_zextps128_ps256(_mm256_extractf128_ps(t02, 1)));
        a[3] = _mm256_add_ps(a[3], _mm256_zextps128_ps256(_mm256_extractf128_ps(t13, 1)));
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
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
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m256 v[8];
        e2m1x64(_mm256_loadu_si256((const __m256i *)(w + k / 2)), v);
        const uint8_t *s = scales + k / 16;
        const __m256 s02 = lane_scales(s[0], s[2]), s13 = lane_scales(s[1], s[3]);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + k + 8 * j, _mm256_mul_ps(j < 4 ? s02 : s13, v[j]));
    }
    if (k < K) { /* the last 1-3 blocks in one e2m1x64: block i in its quarter i (v[4 (i & 1) ..]'s lane i / 2) */
        uint8_t last[32] = {0};
        memcpy(last, w + k / 2, (K - k) / 2);
        __m256 v[8];
        e2m1x64(_mm256_loadu_si256((const __m256i *)last), v);
        for (int64_t i = 0; k < K; k += 16, i++) {
            const __m128 s = _mm_broadcast_ss(e4m3_values + scales[k / 16]);
            for (int j = 0; j < 4; j++) {
                const __m256 b = v[4 * (i & 1) + j];
                _mm_storeu_ps(out + k + 4 * j, _mm_mul_ps(s, i < 2 ? _mm256_castps256_ps128(b) : _mm256_extractf128_ps(b, 1)));
            }
        }
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
 * 24 outputs' weights, KC inputs at a time, lie in a panel [KC, 24] that stays in L1, and 4 x 24 register
 * tiles run over every row of x against it, adding the next KC inputs' panel into the same outputs.
 * Float32 weights are stored in such panels already (the tiles read them where they lie); the other
 * formats are decoded into one, their scale folded in. On this project's 2-core AMD EPYC (Zen 1), at a
 * prompt's 128 rows, packed panels reached 80-100% of a bare FMA loop's rate and ran 1.24-1.29x MKL's
 * sgemm; from 512 rows 1.0-1.2x (docs/decode-speed.md, "Prefill products on packed panels"). */

#define PW 24  /* outputs per panel: three vectors */
#define KC 256 /* panel rows a tile runs over: 24 x 256 floats = 24 KiB, within a 32 KiB L1 beside x's rows */

/* What a panel holds: float32, bf16 (a BF16 file's weights) or e4m3 codes (an FP8 file's, quant/fp8.py
   FP8Panels) of one per-tensor scale. */
enum { P_F32, P_BF16, P_FP8 };

/* Eight e4m3 bytes -> the float32s that hold value * 2^-120, by integer operations alone: each byte
   sign-extended to 32 bits and shifted up by 20 leaves its exponent and mantissa in a float32's low
   exponent bits and its mantissa, and its sign in bit 27 and above; the mask keeps the sign bit and those
   7 bits (e4m3's subnormals become float32 subnormals, exactly). Three operations per eight weights: the
   rows product's bf16 pairs (dot_fp8) take 2.5, but need x permuted to their order and a horizontal sum per
   output, which a panel's columns do not. */
static inline __m256 e4m3x8_low(const uint8_t *p) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32((int)0x87F00000)));
}

/* One row of an e4m3 panel (24 bytes) -> value / 2^8 as float32, in three vectors, exactly (through fp16). */
static inline void fp8_panel_row(const uint8_t *r, __m256 v[3]) {
    const __m256i h = e4m3_as_f16(_mm_loadu_si128((const __m128i *)r));
    v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    v[2] = _mm256_cvtph_ps(e4m3x8_as_f16(_mm_loadl_epi64((const __m128i *)(r + 16))));
}

/* kc rows of an e4m3 panel [kc, 24] -> float32 value * scale, rounded once (value / 2^8 times 256 scale), as
   `panels` decodes an FP8 row for the tiles. */
static void widen_fp8_panel(const uint8_t *p, int64_t kc, float scale, float *out) {
    const __m256 s = _mm256_set1_ps(256.f * scale);
    for (int64_t k = 0; k < kc; k++) {
        __m256 v[3];
        fp8_panel_row(p + PW * k, v);
        for (int i = 0; i < 3; i++) _mm256_storeu_ps(out + PW * k + 8 * i, _mm256_mul_ps(v[i], s));
    }
}

/* c[r, 0:24] (+)= sum_k a[r, k] p[k, 0:24], r < R (a's rows lda apart), p [kc, 24] contiguous: twelve
   accumulators, 12 FMAs per k against 3 loads of p and 4 broadcasts of a (6 x 16 tiles: slower on five of
   six prompt shapes, docs/decode-speed.md). A bf16 panel (`kind` P_BF16) is widened as it is read
   (bf16_panel_row): the same floats, the same sums; an e4m3 one (P_FP8) to value / 2^8 through fp16
   (fp8_panel_row), which the caller scales. */
static inline __attribute__((always_inline)) void tile_packed(int R, int kind, const float *a, int64_t lda,
                                                              const void *p, int64_t kc, float *c, int64_t ldc,
                                                              int add) {
    __m256 acc[4][3];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 3; v++) acc[r][v] = add ? _mm256_loadu_ps(c + r * ldc + 8 * v) : _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m256 b0, b1, b2;
        if (kind != P_F32) {
            __m256 v[3];
            if (kind == P_BF16)
                bf16_panel_row((const uint16_t *)p + PW * k, v);
            else
                fp8_panel_row((const uint8_t *)p + PW * k, v);
            b0 = v[0], b1 = v[1], b2 = v[2];
        } else {
            const float *q = (const float *)p + PW * k;
            b0 = _mm256_loadu_ps(q), b1 = _mm256_loadu_ps(q + 8), b2 = _mm256_loadu_ps(q + 16);
        }
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
static inline __attribute__((always_inline)) void rows_over(int kind, int64_t m, const float *a, int64_t lda,
                                                            const void *p, int64_t kc, float *c, int64_t ldc, int add) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) tile_packed(4, kind, a + i * lda, lda, p, kc, c + i * ldc, ldc, add);
    a += i * lda, c += i * ldc;
    switch (m - i) {
    case 1: tile_packed(1, kind, a, lda, p, kc, c, ldc, add); break;
    case 2: tile_packed(2, kind, a, lda, p, kc, c, ldc, add); break;
    case 3: tile_packed(3, kind, a, lda, p, kc, c, ldc, add); break;
    }
}

/* rows_over for each kind of panel, a function each (one holding both float32 and bf16 tiles ran float32
   products of 4 rows 2-4% slower, scratch). */
static void over_rows(int64_t m, const float *a, int64_t lda, const float *p, int64_t kc, float *c, int64_t ldc,
                      int add) {
    rows_over(P_F32, m, a, lda, p, kc, c, ldc, add);
}

static void over_rows_bf16(int64_t m, const float *a, int64_t lda, const uint16_t *p, int64_t kc, float *c,
                           int64_t ldc, int add) {
    rows_over(P_BF16, m, a, lda, p, kc, c, ldc, add);
}

static void over_rows_fp8(int64_t m, const float *a, int64_t lda, const uint8_t *p, int64_t kc, float *c,
                          int64_t ldc, int add) {
    rows_over(P_FP8, m, a, lda, p, kc, c, ldc, add);
}

static void over_rows_of(int kind, int64_t m, const float *a, int64_t lda, const void *p, int64_t kc, float *c,
                         int64_t ldc, int add) {
    if (kind == P_BF16) over_rows_bf16(m, a, lda, p, kc, c, ldc, add);
    else if (kind == P_FP8) over_rows_fp8(m, a, lda, p, kc, c, ldc, add);
    else over_rows(m, a, lda, p, kc, c, ldc, add);
}

/* y[:m, :cols] (+)= x[:m, :kc] p[:, first:first + cols] (x's rows ldx apart, y's ldy) for one panel
   p [kc, 24] of `kind`: a panel the view uses only in part runs through c (4 x 24 floats), four rows at a
   time. */
static void panel_product(const float *x, int64_t ldx, int64_t m, const void *p, int64_t kc, float *y,
                          int64_t ldy, int64_t first, int64_t cols, int add, float *c, int kind) {
    if (first == 0 && cols == PW) {
        over_rows_of(kind, m, x, ldx, p, kc, y, ldy, add);
        return;
    }
    for (int64_t i = 0; i < m; i += 4) {
        const int64_t r = m - i < 4 ? m - i : 4;
        for (int64_t q = 0; q < r; q++)
            for (int64_t j = 0; j < PW; j++)
                c[q * PW + j] = add && j >= first && j < first + cols ? y[(i + q) * ldy + j - first] : 0.f;
        over_rows_of(kind, r, x + i * ldx, ldx, p, kc, c, PW, add);
        for (int64_t q = 0; q < r; q++) memcpy(y + (i + q) * ldy, c + q * PW + first, sizeof(float) * cols);
    }
}

/* The panels a view's outputs [n0, n1) lie in: [*q0, *q1). */
static inline void panel_range(int64_t skip, int64_t n0, int64_t n1, int64_t *q0, int64_t *q1) {
    *q0 = (skip + n0) / PW;
    *q1 = (skip + n1 + PW - 1) / PW;
}

/* y[:, n0:n1] = x [M, K] times a panel view's outputs [n0, n1) (y's rows N apart), NB panels at a time:
   MC rows of x at a time (they stay in L2 beside the NB panels' KC rows) run over each panel, so every
   block of a panel is read from memory once per MC rows. `c`: PANEL_SCRATCH floats. bf16 panels (`bf16`:
   p holds bf16) are widened to float32 KC rows of a panel at a time, into c, and the tiles run on that. */
#define NB 8
#define MC 128
#define PANEL_SCRATCH (4 * PW + KC * PW)
/* Up to WIDEN_ROWS rows of x, a bf16 or e4m3 panel's tiles widen it as they read it (tile_packed); more, its
   block is widened into scratch once for all the rows (an e4m3 block times its scale). Widening in the
   tiles against into scratch (same bits; scratch A/B, gemm_p_bf16, 768x256 to 3072x1024, one thread and
   two): 2 rows 1.76-2.11x, 4 1.51-1.66x,
   8 1.25-1.30x, 16 1.10-1.15x, 32 1.00-1.06x, 128 0.97-1.04x. A batch's decode rows (step.c's decode_rows)
   and a prompt's experts take few rows a weight. */
#define WIDEN_ROWS 64
#define FP8_WIDEN_ROWS 8 /* an e4m3 row costs the tiles about twice a bf16 one's widening */
const int64_t gemm_p_scratch = PANEL_SCRATCH; /* for step.c's experts */
void gemm_p_part(const float *x, const void *p, int64_t ps, int64_t skip, float *y, int64_t M, int64_t N,
                 int64_t K, int64_t n0, int64_t n1, float *c, int kind, float scale) {
    int64_t q0, q1;
    panel_range(skip, n0, n1, &q0, &q1);
    float *wide = c + 4 * PW;
    const int64_t size = kind == P_F32 ? 4 : kind == P_BF16 ? 2 : 1;
    for (int64_t b = q0; b < q1; b += NB) {
        const int64_t e = b + NB < q1 ? b + NB : q1;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            for (int64_t m0 = 0; m0 < M; m0 += MC)
                for (int64_t q = b; q < e; q++) {
                    const int64_t lo = q * PW - skip > n0 ? q * PW - skip : n0;
                    const int64_t hi = q * PW + PW - skip < n1 ? q * PW + PW - skip : n1;
                    const int64_t m = M - m0 < MC ? M - m0 : MC;
                    const void *slab = (const char *)p + (q * ps + k0 * PW) * size;
                    const int narrow = m <= (kind == P_FP8 ? FP8_WIDEN_ROWS : WIDEN_ROWS) ? kind : P_F32;
                    if (kind == P_FP8 && narrow == P_F32) { /* e4m3: widened once to value * scale */
                        widen_fp8_panel(slab, kc, scale, wide);
                        slab = wide;
                    } else if (kind == P_BF16 && narrow == P_F32) { /* widened once for all the rows */
                        for (int64_t k = 0; k < kc; k++) {
                            __m256 v[3];
                            bf16_panel_row((const uint16_t *)slab + PW * k, v);
                            for (int i = 0; i < 3; i++) _mm256_storeu_ps(wide + PW * k + 8 * i, v[i]);
                        }
                        slab = wide;
                    }
                    panel_product(x + m0 * K + k0, K, m, slab, kc, y + m0 * N + lo, N, lo - (q * PW - skip),
                                  hi - lo, k0 > 0, c, narrow);
                    if (narrow == P_FP8 && k0 + kc >= K) /* sums of x value / 2^8: times 256 scale, once */
                        for (int64_t i = 0; i < m; i++)
                            for (int64_t j = lo; j < hi; j++) y[(m0 + i) * N + j] *= 256.f * scale;
                }
        }
    }
}

/* This thread's outputs [*n0, *n1) of a panel view's N (`skip` columns into its first panel): an equal
   share of the panels. */
static void panel_share(int64_t skip, int64_t N, int64_t *n0, int64_t *n1) {
    int64_t parts = 1, part = 0, q0, q1;
#ifdef _OPENMP
    parts = omp_get_num_threads(), part = omp_get_thread_num();
#endif
    panel_range(skip, 0, N, &q0, &q1);
    const int64_t per = (q1 - q0 + parts - 1) / parts, a = q0 + part * per, b = a + per;
    *n0 = a * PW - skip < 0 ? 0 : (a * PW - skip < N ? a * PW - skip : N);
    *n1 = b * PW - skip < N ? (b * PW - skip > *n0 ? b * PW - skip : *n0) : N;
}

/* y [M, N] = x [M, K] times a panel view: each thread takes a share of its panels. */
static void gemm_p(const float *x, const void *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                   int64_t skip, int threads, int kind) {
    #pragma omp parallel num_threads(threads) if (M * N * K >= 1 << 20)
    {
        int64_t n0, n1;
        panel_share(skip, N, &n0, &n1);
        float c[PANEL_SCRATCH];
        if (n0 < n1) gemm_p_part(x, p, ps, skip, y, M, N, K, n0, n1, c, kind, 1.f);
    }
}

int gemm_p_f32(const float *x, const float *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
               int64_t skip, int threads) {
    gemm_p(x, p, y, M, N, K, ps, skip, threads, P_F32);
    return 0;
}

int gemm_p_bf16(const float *x, const uint16_t *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                int64_t skip, int threads) {
    gemm_p(x, p, y, M, N, K, ps, skip, threads, P_BF16);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------
 * A bfloat16 prompt on bf16 dot products: bf16 panels here, packed weights after `panels` (packed_bf16x),
 * on AVX512-BF16 where the CPU has it (Zen 4, Intel from Cooper Lake). A bfloat16 model's prompt rows
 * are bf16 already, as are a BF16 file's weights: vdpbf16ps multiplies two pairs of them exactly and adds
 * both products to a float32 sum, twice the multiply-adds of an FMA per instruction (on this project's
 * Zen 4, two threads: 438 against 235 GFLOP/s, scratch). The sums are float32 sums of the same exact
 * products the widening path (gemm_p_bf16) adds, but two inputs at a time (k + 1, then k), and bf16
 * inputs below 2^-126 count as zero (the instruction's DAZ; its sums flush to zero likewise): no rounding
 * a bfloat16 model does not already make, but not the widening path's bits. The panel's rows are
 * re-paired for it (each 32-bit lane: one column's weights at k and k + 1) KC rows at a time, once for
 * every row of x. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define BF16_DOT __attribute__((target("avx512f,avx512vl,avx512bf16")))
#define MR 8 /* rows a tile runs: 24 accumulators, 3 panel vectors and a broadcast within 32 registers */

/* Whether this CPU and OS run AVX512-BF16 (with AVX512F and VL), from CPUID and XGETBV themselves: clang's
   __builtin_cpu_supports("avx512bf16") said no on this project's Zen 4 (zig cc, clang 22), gcc's yes. */
int bf16_dot(void) {
    static int known = -1;
    if (known >= 0) return known;
    unsigned a, b, c, d, lo, hi;
    int yes = __get_cpuid_count(1, 0, &a, &b, &c, &d) && (c >> 27 & 1); /* OSXSAVE */
    if (yes) {
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        yes = (lo & 0xE6) == 0xE6; /* the OS saves the SSE, AVX and AVX-512 (opmask, upper ZMM) state */
    }
    yes = yes && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 16 & 1) && (b >> 31 & 1) && a >= 1;
    yes = yes && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1); /* AVX512F, VL; AVX512_BF16 */
    return known = yes;
}

/* Rows k (r0) and k + 1 (r1) of a bf16 panel (linear.BF16_COLUMNS' order) -> 24 lanes, columns in order,
   each (w[k][c] low, w[k + 1][c] high). */
static inline void pair_rows(const uint16_t *r0, const uint16_t *r1, uint32_t *out) {
    const __m256i low = _mm256_set1_epi32(0xFFFF), a0 = _mm256_loadu_si256((const __m256i *)r0),
                  a1 = _mm256_loadu_si256((const __m256i *)r1);
    _mm256_storeu_si256((__m256i *)out, _mm256_or_si256(_mm256_and_si256(a0, low), _mm256_slli_epi32(a1, 16)));
    _mm256_storeu_si256((__m256i *)(out + 8), _mm256_or_si256(_mm256_srli_epi32(a0, 16), _mm256_andnot_si256(low, a1)));
    const __m256i b0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r0 + 16))),
                  b1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r1 + 16)));
    _mm256_storeu_si256((__m256i *)(out + 16), _mm256_or_si256(b0, _mm256_slli_epi32(b1, 16)));
}

/* pair_rows for two rows of an e4m3 panel: each value / 2^8 (exact in bf16: 4 significant bits). */
static inline void pair_rows_fp8(const uint8_t *r0, const uint8_t *r1, uint32_t *out) {
    __m256 a0[3], a1[3];
    fp8_panel_row(r0, a0), fp8_panel_row(r1, a1);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    for (int v = 0; v < 3; v++)
        _mm256_storeu_si256((__m256i *)(out + 8 * v),
                            _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(a0[v]), 16),
                                            _mm256_and_si256(_mm256_castps_si256(a1[v]), high)));
}

/* c[r, 0:24] (+)= sum_k x[r, k] w[k, 0:24], r < R (x's rows ldx apart, bf16), over `pairs` re-paired panel
   rows pp [pairs, 24] */
BF16_DOT static inline __attribute__((always_inline)) void tile_bf16(int R, const uint16_t *x, int64_t ldx,
                                                                      const uint32_t *pp, int64_t pairs, float *c,
                                                                      int64_t ldc, int add, float scale) {
    __m256 acc[MR][3];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 3; v++) acc[r][v] = add ? _mm256_loadu_ps(c + r * ldc + 8 * v) : _mm256_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        const __m256bh b0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(pp + PW * j)),
                       b1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(pp + PW * j + 8)),
                       b2 = (__m256bh)_mm256_loadu_si256((const __m256i *)(pp + PW * j + 16));
        for (int r = 0; r < R; r++) {
            int32_t two;
            memcpy(&two, x + r * ldx + 2 * j, sizeof two);
            const __m256bh a = (__m256bh)_mm256_set1_epi32(two);
            acc[r][0] = _mm256_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm256_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm256_dpbf16_ps(acc[r][2], a, b2);
        }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 3; v++)
            _mm256_storeu_ps(c + r * ldc + 8 * v, scale == 1.f ? acc[r][v] : _mm256_mul_ps(acc[r][v], s));
}

/* Every row of x over one re-paired panel, MR at a time, the last ones on a tile of their own count; the
   sums (with `add`, continuing c's) times `scale`. */
BF16_DOT static void rows_bf16(int64_t m, const uint16_t *x, int64_t ldx, const uint32_t *pp, int64_t pairs,
                               float *c, int64_t ldc, int add, float scale) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR) tile_bf16(MR, x + i * ldx, ldx, pp, pairs, c + i * ldc, ldc, add, scale);
    x += i * ldx, c += i * ldc;
    switch (m - i) {
    case 1: tile_bf16(1, x, ldx, pp, pairs, c, ldc, add, scale); break;
    case 2: tile_bf16(2, x, ldx, pp, pairs, c, ldc, add, scale); break;
    case 3: tile_bf16(3, x, ldx, pp, pairs, c, ldc, add, scale); break;
    case 4: tile_bf16(4, x, ldx, pp, pairs, c, ldc, add, scale); break;
    case 5: tile_bf16(5, x, ldx, pp, pairs, c, ldc, add, scale); break;
    case 6: tile_bf16(6, x, ldx, pp, pairs, c, ldc, add, scale); break;
    case 7: tile_bf16(7, x, ldx, pp, pairs, c, ldc, add, scale); break;
    }
}

/* gemm_p_part's loops for bf16 x on bf16 panels (or e4m3 ones, `fp8`, the sums times 256 `scale` after the
   last block): NB panels' KC rows re-paired into pp (NB * KC / 2 * 24 lanes), then MC rows of x at a time
   over each; a panel the view uses only in part runs through c (MR x 24 floats). */
BF16_DOT static void gemm_bf16_part(const uint16_t *x, const void *p, int64_t ps, int64_t skip, float *y,
                                    int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, uint32_t *pp, float *c,
                                    int fp8, float scale) {
    int64_t q0, q1;
    panel_range(skip, n0, n1, &q0, &q1);
    for (int64_t b = q0; b < q1; b += NB) {
        const int64_t e = b + NB < q1 ? b + NB : q1;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t pairs = (K - k0 < KC ? K - k0 : KC) / 2;
            const float s = fp8 && k0 + 2 * pairs >= K ? 256.f * scale : 1.f;
            for (int64_t q = b; q < e; q++)
                for (int64_t j = 0; j < pairs; j++) {
                    uint32_t *out = pp + ((q - b) * (KC / 2) + j) * PW;
                    if (fp8) {
                        const uint8_t *r = (const uint8_t *)p + q * ps + (k0 + 2 * j) * PW;
                        pair_rows_fp8(r, r + PW, out);
                    } else {
                        const uint16_t *r = (const uint16_t *)p + q * ps + (k0 + 2 * j) * PW;
                        pair_rows(r, r + PW, out);
                    }
                }
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                const int64_t m = M - m0 < MC ? M - m0 : MC;
                for (int64_t q = b; q < e; q++) {
                    const uint32_t *pq = pp + (q - b) * (KC / 2) * PW;
                    const int64_t lo = q * PW - skip > n0 ? q * PW - skip : n0;
                    const int64_t hi = q * PW + PW - skip < n1 ? q * PW + PW - skip : n1;
                    const int64_t first = lo - (q * PW - skip), cols = hi - lo;
                    const uint16_t *xs = x + m0 * K + k0;
                    float *ys = y + m0 * N + lo;
                    if (first == 0 && cols == PW) {
                        rows_bf16(m, xs, K, pq, pairs, ys, N, k0 > 0, s);
                        continue;
                    }
                    for (int64_t i = 0; i < m; i += MR) {
                        const int64_t r = m - i < MR ? m - i : MR;
                        for (int64_t t = 0; t < r; t++)
                            for (int64_t u = 0; u < PW; u++)
                                c[t * PW + u] =
                                    k0 > 0 && u >= first && u < first + cols ? ys[(i + t) * N + u - first] : 0.f;
                        rows_bf16(r, xs + i * K, K, pq, pairs, c, PW, k0 > 0, s);
                        for (int64_t t = 0; t < r; t++)
                            memcpy(ys + (i + t) * N, c + t * PW + first, sizeof(float) * cols);
                    }
                }
            }
        }
    }
}

static int panels_bf16x(const uint16_t *x, const void *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                        int64_t skip, int fp8, float scale, int threads) {
    if (!bf16_dot() || K % 2) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (M * N * K >= 1 << 20)
    {
        int64_t n0, n1;
        panel_share(skip, N, &n0, &n1);
        uint32_t *pp = n0 < n1 ? malloc(sizeof(uint32_t) * NB * (KC / 2) * PW) : NULL;
        float c[MR * PW];
        if (pp) gemm_bf16_part(x, p, ps, skip, y, M, N, K, n0, n1, pp, c, fp8, scale);
        else if (n0 < n1) {
            #pragma omp atomic write
            failed = 1;
        }
        free(pp);
    }
    return failed ? -1 : 0;
}

/* y [M, N] (float32) = x [M, K] (bf16) times a bf16 panel view, K even. 0; -1: no memory for the re-paired
   panels; -2: this CPU (or this build's compiler) has no bf16 dot products, or K is odd: take gemm_p_bf16. */
int gemm_p_bf16x(const uint16_t *x, const uint16_t *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                 int64_t skip, int threads) {
    return panels_bf16x(x, p, y, M, N, K, ps, skip, 0, 1.f, threads);
}

/* gemm_p_bf16x on e4m3 panels (bytes), times the tensor's `scale`; -2: take gemv_p_fp8. */
int gemm_p8_bf16x(const uint16_t *x, const uint8_t *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                  int64_t skip, float scale, int threads) {
    return panels_bf16x(x, p, y, M, N, K, ps, skip, 1, scale, threads);
}
#else
int bf16_dot(void) { return 0; }
int gemm_p8_bf16x(const uint16_t *x, const uint8_t *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                  int64_t skip, float scale, int threads) {
    (void)x, (void)p, (void)y, (void)M, (void)N, (void)K, (void)ps, (void)skip, (void)scale, (void)threads;
    return -2;
}
int gemm_p_bf16x(const uint16_t *x, const uint16_t *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                 int64_t skip, int threads) {
    (void)x, (void)p, (void)y, (void)M, (void)N, (void)K, (void)ps, (void)skip, (void)threads;
    return -2;
}
#endif

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
            _mm256_store_ps(P + (k + q) * PW, _mm256_permute2f128_ps(a[order[q]], a[4 + order[q]], 0x20));
            _mm256_store_ps(P + (k + q + 4) * PW, _mm256_permute2f128_ps(a[order[q]], a[4 + order[q]], 0x31));
        }
    }
    for (; k < K; k++)
        for (int i = 0; i < 8; i++) P[k * PW + i] = r[i * K + k] * scale;
}

/* Inputs [k0, k0 + kc) of 24 weight rows from row n (`cols` of them; zeros past) decoded, eight rows at a time,
   then transposed in registers with `scale` folded in, into P [kc, 24]. k0 a multiple of 64 (NVFP4's
   64-input groups, which x is permuted by). The transpose replaced a scalar store per value: 0.98-1.15x,
   1.05x geometric mean, on 128-token FP8 / NVFP4 prompts (six A/B runs, docs/decode-speed.md). */
static void decode_panel(int format, const void *w, const uint8_t *scales, int64_t k0, int64_t kc, int64_t ldw,
                         int64_t lds, float scale, int64_t n, int64_t cols, float *rows, float *P) {
    const int64_t at = format == PANEL_F32 ? 4 * k0 : format == PANEL_BF16 ? 2 * k0 : format == PANEL_FP8 ? k0
                       : k0 / 2; /* the bytes of a row before input k0 */
    for (int64_t g = 0; g < PW; g += 8) {
        for (int64_t j = g; j < g + 8; j++) {
            if (j < cols)
                decode_row(format, (const uint8_t *)w + (n + j) * ldw + at,
                           scales ? scales + (n + j) * lds + k0 / 16 : NULL, kc, rows + (j - g) * kc);
            else
                memset(rows + (j - g) * kc, 0, sizeof(float) * kc);
        }
        rows_to_columns(rows, kc, scale, P + g);
    }
}

/* y[:, n0:n1] = x W[n0:n1]^T * scale, W's rows ldw bytes apart (NVFP4's scales lds bytes): each panel of 24
   weight rows decoded KC inputs at a time (decode_panel) into P [KC, 24], which the blocked product's tiles
   run over at once, every row of x (MC at a time, four to a tile), so each decode serves all of them. A
   block is 24 KiB, in L1 while the tiles read it: the whole panel decoded first, [K, 24] (72 KiB at K 768),
   was written to L2 and read back from there, which made a 16-row NVFP4 expert product of K 768 take
   1.4-1.75x the float32 one's time (gemv.c alone, one thread, three runs; 1.3x at K 128). Returns 0 where
   the panel could not be allocated, and the caller takes the dot products. */
static int panels(int format, const float *x, const void *w, const uint8_t *scales, float *y, int64_t M,
                  int64_t N, int64_t K, int64_t ldw, int64_t lds, float scale, int64_t n0, int64_t n1) {
    float *P = aligned_alloc(32, sizeof(float) * (PW * KC + 8 * KC + 4 * PW));
    if (!P) return 0;
    float *rows = P + PW * KC, *c = rows + 8 * KC;
    for (int64_t n = n0; n < n1; n += PW) {
        const int64_t cols = n1 - n < PW ? n1 - n : PW;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            decode_panel(format, w, scales, k0, kc, ldw, lds, scale, n, cols, rows, P);
            for (int64_t m0 = 0; m0 < M; m0 += MC)
                panel_product(x + m0 * K + k0, K, M - m0 < MC ? M - m0 : MC, P, kc, y + m0 * N + n, N, 0, cols,
                              k0 > 0, c, 0);
        }
    }
    free(P);
    return 1;
}

#ifdef BF16_DOT
/* y[:, n0:n1] = x W[n0:n1]^T * scale for bf16 x (NVFP4's permuted) and packed FP8 / NVFP4 rows (or bf16
   ones, `format` PANEL_BF16): each panel decoded as `panels` decodes it, KC inputs at a time and unscaled (a
   packed value has at most 6 significant bits: exact in bf16), re-paired and run on the bf16 dots while the
   block is in L1. The sums carry over from block to block through y (float32 stores: each output's sum
   runs in the order one block would sum it), and the last block's tiles multiply them by the scale. 0
   where the blocks could not be allocated. */
BF16_DOT static int packed_bf16x(int format, const uint16_t *x, const void *w, const uint8_t *scales, float *y,
                                 int64_t M, int64_t N, int64_t K, int64_t ldw, int64_t lds, float scale, int64_t n0,
                                 int64_t n1) {
    float *P = aligned_alloc(32, sizeof(float) * (PW * KC + 8 * KC));
    uint32_t *pp = malloc(sizeof(uint32_t) * (KC / 2) * PW);
    if (!P || !pp) {
        free(P), free(pp);
        return 0;
    }
    float *rows = P + PW * KC, c[MR * PW];
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    scale *= format == PANEL_NVFP4 ? 16384.f * 256.f : format == PANEL_FP8 ? 256.f : 1.f; /* decode_*'s 2^-22, 2^-8 */
    for (int64_t n = n0; n < n1; n += PW) {
        const int64_t cols = n1 - n < PW ? n1 - n : PW;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC, add = k0 > 0;
            const float s = k0 + kc == K ? scale : 1.f;
            decode_panel(format, w, scales, k0, kc, ldw, lds, 1.f, n, cols, rows, P);
            for (int64_t j = 0; j < kc / 2; j++) /* rows 2j, 2j + 1 of P -> lanes (w[2j][c], w[2j + 1][c]) */
                for (int v = 0; v < 3; v++) {
                    const __m256i a0 = _mm256_load_si256((const __m256i *)(P + 2 * j * PW + 8 * v)),
                                  a1 = _mm256_load_si256((const __m256i *)(P + (2 * j + 1) * PW + 8 * v));
                    _mm256_storeu_si256((__m256i *)(pp + j * PW + 8 * v),
                                        _mm256_or_si256(_mm256_srli_epi32(a0, 16), _mm256_and_si256(a1, high)));
                }
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                const int64_t m = M - m0 < MC ? M - m0 : MC;
                const uint16_t *xs = x + m0 * K + k0;
                if (cols == PW) {
                    rows_bf16(m, xs, K, pp, kc / 2, y + m0 * N + n, N, add, s);
                    continue;
                }
                for (int64_t i = 0; i < m; i += MR) {
                    const int64_t r = m - i < MR ? m - i : MR;
                    float *ys = y + (m0 + i) * N + n;
                    for (int64_t t = 0; t < r && add; t++)
                        for (int64_t u = 0; u < PW; u++) c[t * PW + u] = u < cols ? ys[t * N + u] : 0.f;
                    rows_bf16(r, xs + i * K, K, pp, kc / 2, c, PW, add, s);
                    for (int64_t t = 0; t < r; t++) memcpy(ys + t * N, c + t * PW, sizeof(float) * cols);
                }
            }
        }
    }
    free(P), free(pp);
    return 1;
}
#endif

/* ------------------------------------------------------------------------------------------------------
 * The kernels over one thread's share of the outputs, [n0, n1); `share` says which. Called by the gemv_*
 * entry points below, each in its own parallel region, and by step.c inside a block's one region. */

/* This thread's share of N outputs within the current parallel region (all of them outside one), in
   multiples of 16: whole cache lines of y. */
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

/* o[0:24G] = sums of G panels over K rows of one x: 3G accumulators, G streams; bf16 panels widened as
   they are read (exactly: the sums are those of the same panels in float32), e4m3 ones (`kind` P_FP8) read
   as value * 2^-120 (e4m3x8_low), x scaled to match (panels_vec). */
static inline __attribute__((always_inline)) void panels_dot(int G, int kind, const float *x, const void *p,
                                                             int64_t ps, int64_t K, float *o) {
    __m256 acc[4][3];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < 3; v++) acc[g][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 xk = _mm256_broadcast_ss(x + k);
        for (int g = 0; g < G; g++) {
            __m256 w[3];
            if (kind == P_BF16)
                bf16_panel_row((const uint16_t *)p + g * ps + PW * k, w);
            else if (kind == P_FP8)
                for (int v = 0; v < 3; v++) w[v] = e4m3x8_low((const uint8_t *)p + g * ps + PW * k + 8 * v);
            else
                for (int v = 0; v < 3; v++) w[v] = _mm256_loadu_ps((const float *)p + g * ps + PW * k + 8 * v);
            for (int v = 0; v < 3; v++) acc[g][v] = _mm256_fmadd_ps(xk, w[v], acc[g][v]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < 3; v++) _mm256_storeu_ps(o + PW * g + 8 * v, acc[g][v]);
}

/* y[n0:n1] = x [K] times a panel view's outputs [n0, n1): four panels at a time (measured against the
   plain transpose on 2 threads, scratch: budget views that cut the outputs 1.4-1.65x, whole rows
   0.96-0.98x; one panel at a time, one stream, lost 0.65-0.84x on wide weights). */
void panels_vec(const float *x, const void *p, int64_t ps, int64_t skip, int64_t K, float *y, int64_t n0,
                int64_t n1, int kind, float scale) {
    int64_t q, q1;
    panel_range(skip, n0, n1, &q, &q1);
    float o[4 * PW], xq[kind == P_FP8 ? K : 1], post = 1.f;
    unsigned csr = 0;
    if (kind == P_FP8) { /* x 2^a times value 2^-120: the outputs times 2^(120 - a) and the tensor's scale */
        const int a = fp8_shift(x, K);
        const float up = ldexpf(1.f, a);
        for (int64_t k = 0; k < K; k++) xq[k] = x[k] * up;
        x = xq, post = ldexpf(1.f, 120 - a) * scale, csr = subnormals_on();
    }
    const int64_t size = kind == P_F32 ? 4 : kind == P_BF16 ? 2 : 1;
    while (q < q1) {
        const int G = q1 - q < 4 ? (int)(q1 - q) : 4;
        const void *pq = (const char *)p + q * ps * size;
        switch (G * 3 + kind) {
        case 3: panels_dot(1, P_F32, x, pq, ps, K, o); break;
        case 4: panels_dot(1, P_BF16, x, pq, ps, K, o); break;
        case 5: panels_dot(1, P_FP8, x, pq, ps, K, o); break;
        case 6: panels_dot(2, P_F32, x, pq, ps, K, o); break;
        case 7: panels_dot(2, P_BF16, x, pq, ps, K, o); break;
        case 8: panels_dot(2, P_FP8, x, pq, ps, K, o); break;
        case 9: panels_dot(3, P_F32, x, pq, ps, K, o); break;
        case 10: panels_dot(3, P_BF16, x, pq, ps, K, o); break;
        case 11: panels_dot(3, P_FP8, x, pq, ps, K, o); break;
        case 12: panels_dot(4, P_F32, x, pq, ps, K, o); break;
        case 13: panels_dot(4, P_BF16, x, pq, ps, K, o); break;
        default: panels_dot(4, P_FP8, x, pq, ps, K, o);
        }
        const int64_t base = q * PW - skip, lo = base > n0 ? base : n0, hi = base + G * PW < n1 ? base + G * PW : n1;
        if (kind == P_FP8)
            for (int64_t i = lo; i < hi; i++) y[i] = o[i - base] * post;
        else
            memcpy(y + lo, o + (lo - base), sizeof(float) * (hi - lo));
        q += G;
    }
    if (kind == P_FP8) _mm_setcsr(csr);
}

/* y[:, n0:n1] for M rows of x (y's rows N apart): one row on panels_vec, more on the tiles. */
static void part_p(const float *x, const void *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                   int64_t skip, int64_t n0, int64_t n1, int kind, float scale) {
    if (M == 1) {
        panels_vec(x, p, ps, skip, K, y, n0, n1, kind, scale);
        return;
    }
    float c[PANEL_SCRATCH];
    gemm_p_part(x, p, ps, skip, y, M, N, K, n0, n1, c, kind, scale);
}

/* The packed formats' and bf16 rows' one-row products read each weight row's first K inputs, a budget's
   prefix, rows ldw apart: the hardware prefetchers lose such a stream at every row (a small budget's FP8
   products stalled on their loads, perf), so each row fetches the one AHEAD rows on, a line at a time (16
   against 8 and 32: about the same, 16 a little ahead; scratch, gen16 small budget). bf16 rows (a tied LM
   head, the `rows` layout): gen16's small budget 4.5 against 3.6 ms a token with the C step on them. */
#define AHEAD 16
static inline void prefetch(const uint8_t *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T0);
}

/* The NVFP4 rows n + AHEAD .. n + AHEAD + 3 (those before n1), codes and scales: out of line, since inlined
   beside rows_nvfp4 its loops cost short rows' products 1.1-1.3x in the caches (scratch, one thread: 16-80
   inputs), and out of line nearly nothing. */
__attribute__((noinline)) static void prefetch_nvfp4(const uint8_t *w, const uint8_t *scales, int64_t ldw,
                                                     int64_t lds, int64_t K, int64_t n, int64_t n1) {
    for (int64_t r = n + AHEAD; r < n + AHEAD + 4 && r < n1; r++) prefetch(w + r * ldw, K / 2), prefetch(scales + r * lds, K / 16);
}

void part_bf16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
               int64_t n0, int64_t n1) {
    if (M >= PANEL_MIN_ROWS && panels(PANEL_BF16, x, w, NULL, y, M, N, K, ldw * 2, 0, 1.f, n0, n1)) return;
    for (int64_t n = n0; n < n1; n++) {
        if (n + AHEAD < n1 && K < ldw) prefetch((const uint8_t *)(w + (n + AHEAD) * ldw), 2 * K);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_bf16(x + m * K, w + n * ldw, K);
    }
}

void part_fp8(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t ldw,
              float scale, int64_t n0, int64_t n1) {
    scale *= 256.f;
    if (M >= PANEL_MIN_ROWS && panels(PANEL_FP8, x, w, NULL, y, M, N, K, ldw, 0, scale, n0, n1)) return;
    if (M == 1) {
        float xq[K];
        const float unscale = fp8_inputs(x, K, xq);
        const unsigned csr = subnormals_on();
        for (int64_t n = n0; n < n1; n++) {
            if (n + AHEAD < n1) prefetch(w + (n + AHEAD) * ldw, K);
            y[n] = dot_fp8(xq, w + n * ldw, K, unscale) * scale;
        }
        _mm_setcsr(csr);
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        float row[K];
        decode_fp8(w + n * ldw, K, row);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_f32(x + m * K, row, K) * scale;
    }
}

/* x [M, K] permuted for part_nvfp4, row by row: each whole block of 64 inputs in e2m1x64's order (permute64),
   the last K % 64 in blocks of 16, each in the order e2m1x64 leaves one block in. */
void permute_nvfp4(const float *x, float *xp, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * K;
        float *o = xp + m * K;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) permute64(r + k, o + k);
        for (; k < K; k += 16) /* a block: vector 2 nib + odd, element i holds input 4 i + 2 odd + nib */
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++) o[k + 4 * u + i] = r[k + 4 * i + 2 * (u & 1) + (u >> 1)];
    }
}

/* permute_nvfp4 for bf16 rows x [M, K] into xp (x itself allowed), exactly: each row widened into f [2K],
   permuted, and its top halves kept (a reordering of bf16 values). A bfloat16 prompt's NVFP4 products
   (gemm_packed_bf16x, step.c's experts). */
void permute_nvfp4_bf16(const uint16_t *x, uint16_t *xp, int64_t M, int64_t K, float *f) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) {
            const uint32_t bits = (uint32_t)x[m * K + k] << 16;
            memcpy(f + k, &bits, sizeof bits);
        }
        permute_nvfp4(f, f + K, 1, K);
        for (int64_t k = 0; k < K; k++) {
            uint32_t bits;
            memcpy(&bits, f + K + k, sizeof bits);
            xp[m * K + k] = (uint16_t)(bits >> 16);
        }
    }
}

/* Short rows eight at a time (short_rows_nvfp4, short_rows_a4): the group's eight sums, paired as two rows a
   lane in the order 0 1 4 5 | 2 3 6 7, times scale into y[0..R). */
static inline void eight_sums(__m256 paired, float scale, int R, float *y) {
    const __m256 sums = _mm256_mul_ps(_mm256_permutevar8x32_ps(paired, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7)),
                                      _mm256_set1_ps(scale));
    if (R == 8) {
        _mm256_storeu_ps(y, sums);
    } else {
        float out[8];
        _mm256_storeu_ps(out, sums);
        memcpy(y, out, sizeof(float) * R);
    }
}

/* Rows of fewer than 64 inputs (K 16, 32 or 48: a small budget's down projections), eight at a time, their
   eight sums leaving the registers as one vector. y[0..R) = the dot products * scale (rows past R: row 0
   again, not stored). */
static void short_rows_nvfp4(const float *x, const uint8_t *w, const uint8_t *scales, int64_t ldw, int64_t lds,
                             int64_t K, int R, float scale, float *y) {
    const uint8_t *c[8], *sc[8];
    group_rows(8, w, scales, ldw, lds, R, c, sc);
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps(), t2 = _mm256_setzero_ps(), t3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) four_blocks(x, c, sc, k, &t0, &t1); /* rows 0-3, then 4-7: four sums */
    for (int64_t k = 0; k < K; k += 16) four_blocks(x, c + 4, sc + 4, k, &t2, &t3); /* live would spill */
    /* rows 0 1 | 2 3 in pairs of partial sums, then with rows 4-7's */
    eight_sums(_mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3)), scale, R, y);
}

/* K % 16 == 0; w [N, ldw bytes], scales [N, lds bytes]; xp from permute_nvfp4. */
void part_nvfp4(const float *xp, const uint8_t *w, const uint8_t *scales, float *y, int64_t M, int64_t N,
                int64_t K, int64_t ldw, int64_t lds, float scale, int64_t n0, int64_t n1) {
    scale *= 16384.f * 256.f;
    if (M >= PANEL_MIN_ROWS && panels(PANEL_NVFP4, xp, w, scales, y, M, N, K, ldw, lds, scale, n0, n1)) return;
    if (K < 64) {
        for (int64_t n = n0; n < n1; n += 8) {
            prefetch_nvfp4(w, scales, ldw, lds, K, n, n1), prefetch_nvfp4(w, scales, ldw, lds, K, n + 4, n1);
            for (int64_t m = 0; m < M; m++)
                short_rows_nvfp4(xp + m * K, w + n * ldw, scales + n * lds, ldw, lds, K,
                                 n1 - n < 8 ? (int)(n1 - n) : 8, scale, y + m * N + n);
        }
        return;
    }
    for (int64_t n = n0; n < n1; n += 4) { /* four rows at a time (the last group's missing ones repeat its first) */
        const int R = n1 - n < 4 ? (int)(n1 - n) : 4;
        const uint8_t *c[4], *sc[4];
        group_rows(4, w + n * ldw, scales + n * lds, ldw, lds, R, c, sc);
        prefetch_nvfp4(w, scales, ldw, lds, K, n, n1);
        for (int64_t m = 0; m < M; m++) {
            float out[4];
            rows_nvfp4(xp + m * K, c, sc, K, out);
            for (int r = 0; r < R; r++) y[m * N + n + r] = out[r] * scale;
        }
    }
}

/* ------------------------------------------------------------------------------------------------------
 * NVFP4 inputs rounded to NVFP4 too (W4A4: activations=nvfp4, quant/nvfp4.py), the arithmetic NVFP4 was
 * made for: Blackwell's tensor cores quantize a product's inputs the same way. Each row of x gets e4m3
 * scales per 16 inputs under one float scale: the file's calibrated input_scale, else the row's own
 * amax / (6 * 448) (a row's numbers never depend on the rows beside it). Then a block's 16 products are
 * small integers: e2m1 values doubled lie in -12..12, so one byte shuffle gives a weight byte's two
 * doubled values and `vpmaddubsw` multiplies and pairs them with x's, exactly. `vpmaddubsw` takes one side
 * unsigned: the weights come shifted up by 12 (0..24), and each lane's 12 * sum of x, made once per x,
 * comes off again. A block's integer sum times its two e4m3 scales goes into float32 sums. Up to
 * nvfp4_a4_rows - 1 rows of x take these products a row at a time; more are rounded (nvfp4_round_rows) and
 * run on the weight-only kernels, which give the same sums in another order. */

/* Four block scales (2^-9 <= s <= 448) -> the nearest e4m3 values, ties to even: torch's float ->
   float8_e4m3fn. From 2^-6 up, the float32 mantissa rounded to e4m3's 3 bits (a carry out of it moves the
   exponent up, as it should); below, e4m3 is subnormal, multiples of 2^-9 (the conversion rounds to
   nearest even). Checked against a nearest-even search of the codes over all 148,897,793 floats in range
   (scratch). With a search per block a 256-input row took 0.99 us to round; four blocks at a time in
   round_chunk, 0.26 us. */
static inline __m128 e4m3_round4(__m128 s) {
    const __m128i bits = _mm_castps_si128(s), lsb = _mm_and_si128(_mm_srli_epi32(bits, 20), _mm_set1_epi32(1));
    const __m128 normal = _mm_castsi128_ps(_mm_and_si128(_mm_add_epi32(bits, _mm_add_epi32(_mm_set1_epi32(0x7FFFF), lsb)),
                                                         _mm_set1_epi32((int)0xFFF00000)));
    const __m128 subnormal = _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtps_epi32(_mm_mul_ps(s, _mm_set1_ps(512.f)))),
                                        _mm_set1_ps(1.f / 512.f));
    return _mm_blendv_ps(normal, subnormal, _mm_cmplt_ps(s, _mm_set1_ps(0x1p-6f)));
}

/* v's largest element. */
static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* The float scale a row's blocks sit under: input_scale > 0, else amax(row) / (6 * 448) (at least FLT_MIN). */
static float row_scale(const float *x, int64_t K, float input_scale) {
    if (input_scale > 0) return input_scale;
    __m256 m = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_loadu_ps(x + k)));
    const float s = hmax(m) / 2688.f;
    return s < FLT_MIN ? FLT_MIN : s;
}

/* Eight inputs over their unit d -> their doubled e2m1 values (-12..12) as int32: the nearest magnitude's
   index is the number of midpoints below |x / d|, ties to the even code (quant/nvfp4.py quantize_blocks). */
static inline __m256i doubled_e2m1(__m256 x, __m256 d) {
    const __m256 q = _mm256_div_ps(x, d), m = _mm256_andnot_ps(_mm256_set1_ps(-0.f), q);
    __m256i index = _mm256_setzero_si256();
    static const float above[4] = {0.25f, 1.25f, 2.5f, 5.f}, from[3] = {0.75f, 1.75f, 3.5f};
    for (int i = 0; i < 4; i++) /* a true compare is -1 */
        index = _mm256_sub_epi32(index, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(above[i]), _CMP_GT_OQ)));
    for (int i = 0; i < 3; i++)
        index = _mm256_sub_epi32(index, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(from[i]), _CMP_GE_OQ)));
    const __m256i v = _mm256_permutevar8x32_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 6, 8, 12), index);
    const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_sub_epi32(_mm256_xor_si256(v, neg), neg);
}

/* 64 inputs (four blocks of 16) -> their doubled e2m1 values (in order) and the four blocks' e4m3 scale
   values: modelopt's dynamic NVFP4 op for op (quant/nvfp4.py quantize_blocks: the same divisions, so the
   same codes). The four blocks go through each step together. */
static inline __m128 round_chunk(const float *x, float scale_2, int8_t twice[64]) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[8], m[4];
    for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
    for (int b = 0; b < 4; b++) m[b] = _mm256_max_ps(_mm256_andnot_ps(sign, v[2 * b]), _mm256_andnot_ps(sign, v[2 * b + 1]));
    /* the blocks' maxima, block b in lane b: pairs of blocks interleaved, halves folded, then the 128-bit lanes */
    const __m256 t01 = _mm256_max_ps(_mm256_unpacklo_ps(m[0], m[1]), _mm256_unpackhi_ps(m[0], m[1]));
    const __m256 t23 = _mm256_max_ps(_mm256_unpacklo_ps(m[2], m[3]), _mm256_unpackhi_ps(m[2], m[3]));
    const __m256 u = _mm256_max_ps(_mm256_shuffle_ps(t01, t23, 0x44), _mm256_shuffle_ps(t01, t23, 0xEE));
    const __m128 amax = _mm_max_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)), s2 = _mm_set1_ps(scale_2);
    __m128 s = _mm_div_ps(amax, _mm_mul_ps(_mm_set1_ps(6.f), s2));
    s = _mm_blendv_ps(s, _mm_set1_ps(1.f), _mm_cmpeq_ps(s, _mm_setzero_ps())); /* modelopt: an all-zero block 1 */
    const __m128 value = e4m3_round4(_mm_min_ps(_mm_max_ps(s, _mm_set1_ps(0x1p-9f)), _mm_set1_ps(448.f)));
    const __m256 d = _mm256_castps128_ps256(_mm_mul_ps(value, s2));
    for (int b = 0; b < 4; b++) {
        const __m256 db = _mm256_permutevar8x32_ps(d, _mm256_set1_epi32(b));
        const __m256i lo = doubled_e2m1(v[2 * b], db), hi = doubled_e2m1(v[2 * b + 1], db);
        const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
        const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        _mm_storeu_si128((__m128i *)(twice + 16 * b), _mm_packs_epi16(w0, w1));
    }
    return value;
}

/* round_chunk for the last K % 64 inputs (n of them), zeros after them (their blocks go unused). */
static inline __m128 round_last(const float *x, int64_t n, float scale_2, int8_t twice[64]) {
    float padded[64] = {0};
    memcpy(padded, x, sizeof(float) * n);
    return round_chunk(padded, scale_2, twice);
}

/* x [M, K] -> out [M, K]: each row rounded to NVFP4 and back, e2m1 * (e4m3 * scale_2) in float32 as
   quant/nvfp4.py dequantizes (x itself allowed). */
void nvfp4_round_rows(const float *x, float *out, int64_t M, int64_t K, float input_scale) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * K;
        const float scale_2 = row_scale(r, K, input_scale);
        for (int64_t k = 0; k < K; k += 64) {
            int8_t twice[64];
            float unit[4];
            const __m128 value = k + 64 <= K ? round_chunk(r + k, scale_2, twice) : round_last(r + k, K - k, scale_2, twice);
            _mm_storeu_ps(unit, _mm_mul_ps(value, _mm_set1_ps(scale_2)));
            for (int64_t j = 0; j < 64 && k + j < K; j += 8) {
                const __m256 e2m1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(twice + j)))),
                                                  _mm256_set1_ps(.5f));
                _mm256_storeu_ps(out + m * K + k + j, _mm256_mul_ps(e2m1, _mm256_set1_ps(unit[j / 16])));
            }
        }
    }
}

/* 32 bytes (inputs 0..31) -> per 128-bit lane its 8 even inputs then its 8 odd ones, lanes in order
   (0 2 .. 14 | 1 3 .. 15 | 16 .. 30 | 17 .. 31), then the 64-bit quarters as (0, 2, 1, 3): 16 even, 16 odd. */
static inline __m256i evens_odds(__m256i v) {
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xD8);
}

/* One row of x (K % 16 == 0) for rows_a4: xq its doubled values, each 64 inputs' 32 even ones then
   32 odd ones (a weight chunk's low and high nibbles), the last K % 64 a block of 16 at a time (8 even,
   8 odd); xs the block scales' values, per 64 inputs as the chunk's 32-bit lanes meet them (blocks 0 0 1 1
   2 2 3 3), then one per last block; xc 12 times each lane's (then each last block's) sum of xq. Returns
   the row's float scale. */
static float nvfp4_inputs(const float *x, int64_t K, float input_scale, int8_t *xq, float *xs, int32_t *xc) {
    const float scale_2 = row_scale(x, K, input_scale);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        int8_t twice[64];
        const __m128 value = round_chunk(x + k, scale_2, twice);
        _mm256_storeu_ps(xs + k / 8, _mm256_permutevar8x32_ps(_mm256_castps128_ps256(value),
                                                              _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
        const __m256i r0 = evens_odds(_mm256_loadu_si256((const __m256i *)twice)),
                      r1 = evens_odds(_mm256_loadu_si256((const __m256i *)(twice + 32)));
        const __m256i even = _mm256_permute2x128_si256(r0, r1, 0x20), odd = _mm256_permute2x128_si256(r0, r1, 0x31);
        _mm256_storeu_si256((__m256i *)(xq + k), even);
        _mm256_storeu_si256((__m256i *)(xq + k + 32), odd);
        /* lane i: weight bytes 4i .. 4i + 3, so xq's even and odd bytes 4i .. 4i + 3 */
        const __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(ones8, even),
                                                                _mm256_maddubs_epi16(ones8, odd)), ones16);
        _mm256_storeu_si256((__m256i *)(xc + k / 8), _mm256_mullo_epi32(sums, _mm256_set1_epi32(12)));
    }
    if (k < K) { /* the last blocks: 8 even, 8 odd each */
        int8_t twice[64];
        float value[4];
        _mm_storeu_ps(value, round_last(x + k, K - k, scale_2, twice));
        for (int64_t b = k / 8, i = 0; k < K; k += 16, b++, i++) {
            const int8_t *t = twice + 16 * i;
            xs[b] = value[i];
            xc[b] = 0;
            for (int j = 0; j < 8; j++) xq[k + j] = t[2 * j], xq[k + 8 + j] = t[2 * j + 1];
            for (int j = 0; j < 16; j++) xc[b] += 12 * t[j];
        }
    }
    return scale_2;
}

/* 64 weights (32 bytes) times their inputs, one integer sum per 32-bit lane (two per block), scaled. */
static inline __m256 chunk_a4(const uint8_t *w, const int8_t *xq, const int32_t *xc, __m256 scales, __m256 acc) {
    const __m256i shifted = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                             12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i low4 = _mm256_set1_epi8(0x0F), bytes = _mm256_loadu_si256((const __m256i *)w);
    const __m256i even = _mm256_shuffle_epi8(shifted, _mm256_and_si256(bytes, low4));
    const __m256i odd = _mm256_shuffle_epi8(shifted, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_loadu_si256((const __m256i *)xq)),
                                           _mm256_maddubs_epi16(odd, _mm256_loadu_si256((const __m256i *)(xq + 32))));
    const __m256i sums = _mm256_sub_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)),
                                          _mm256_loadu_si256((const __m256i *)xc));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scales, acc);
}

/* Eight e4m3 block scales -> 16 fp16s of value / 2^8, each twice (a chunk's lanes 0 0 1 1 ...). */
static inline __m256i scales_twice(__m128i eight) {
    return e4m3_as_f16(_mm_shuffle_epi8(eight, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
}

/* Two chunks' (128 weights') scales: the weight row's eight e4m3 scales times x's block scales. */
static inline void scales_a4(const uint8_t *scales, const float *xs, __m256 *s0, __m256 *s1) {
    const __m256i h = scales_twice(_mm_loadl_epi64((const __m128i *)scales));
    *s0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_loadu_ps(xs));
    *s1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_loadu_ps(xs + 8));
}

/* A block of 16 inputs of four rows (codes at c[0..3] + k / 2, scales at s[0..3] + k / 16; x's block b of
   nvfp4_inputs' last blocks) times x's block, added into acc: each row's two 32-bit lanes (bytes 0-3 and
   4-7 of its block) in order, x's 12 * sum off each row's first lane. A row's last K % 64 (rows_a4) and
   rows of fewer than 64 inputs (short_rows_a4). */
static inline __attribute__((always_inline)) __m256 four_blocks_a4(const int8_t *xq, const float *xs,
                                                                   const int32_t *xc, const uint8_t *const c[4],
                                                                   const uint8_t *const s[4], int64_t k, int64_t b,
                                                                   __m256 acc) {
    const __m256i shifted = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                             12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i bytes = _mm256_set_m128i(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(c[2] + k / 2)),
                                                              _mm_loadl_epi64((const __m128i *)(c[3] + k / 2))),
                                           _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(c[0] + k / 2)),
                                                              _mm_loadl_epi64((const __m128i *)(c[1] + k / 2))));
    int64_t even, odd; /* x's 8 even and 8 odd doubled values, for every row's block */
    memcpy(&even, xq + k, 8), memcpy(&odd, xq + k + 8, 8);
    const __m256i pairs = _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_shuffle_epi8(shifted, _mm256_and_si256(bytes, low4)), _mm256_set1_epi64x(even)),
        _mm256_maddubs_epi16(_mm256_shuffle_epi8(shifted, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4)),
                             _mm256_set1_epi64x(odd)));
    const __m256i sums = _mm256_sub_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)),
                                          _mm256_set1_epi64x((int64_t)(uint32_t)xc[b]));
    const float s0 = e4m3_values[s[0][k / 16]], s1 = e4m3_values[s[1][k / 16]], s2 = e4m3_values[s[2][k / 16]],
                s3 = e4m3_values[s[3][k / 16]];
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                           _mm256_mul_ps(_mm256_setr_ps(s0, s0, s1, s1, s2, s2, s3, s3), _mm256_set1_ps(xs[b])), acc);
}

/* R (1-4) weight rows, ldw bytes apart (their scales lds), times one row of x: out[r] = sum_k (2 w_k)(2 x_k)
   * (weight block scale / 2^8) * (x block scale), 64 times the product before the two float scales. The
   rows share x's loads, and four rows' sums leave the registers together: on the demo's 256 x 256 weights
   a row at a time ran 12.4 G weights/s, four 14-17 (scratch, one thread). */
static inline void rows_a4(int R, const int8_t *xq, const float *xs, const int32_t *xc, const uint8_t *w,
                           const uint8_t *scales, int64_t ldw, int64_t lds, int64_t K, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int64_t K64 = K / 64 * 64;
    int64_t k = 0;
    for (; k + 128 <= K; k += 128)
        for (int r = 0; r < R; r++) {
            __m256 s0, s1;
            scales_a4(scales + r * lds + k / 16, xs + k / 8, &s0, &s1);
            acc[r] = chunk_a4(w + r * ldw + k / 2, xq + k, xc + k / 8, s0, acc[r]);
            acc[r] = chunk_a4(w + r * ldw + k / 2 + 32, xq + k + 64, xc + k / 8 + 8, s1, acc[r]);
        }
    if (k < K64) {
        for (int r = 0; r < R; r++) {
            uint32_t four;
            memcpy(&four, scales + r * lds + k / 16, 4);
            const __m256i h = scales_twice(_mm_cvtsi32_si128((int)four));
            const __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_loadu_ps(xs + k / 8));
            acc[r] = chunk_a4(w + r * ldw + k / 2, xq + k, xc + k / 8, s, acc[r]);
        }
        k += 64;
    }
    __m128 tail = _mm_setzero_ps(); /* the last K % 64 of the four rows (rows past R: row 0 again), together */
    if (k < K) {
        const uint8_t *c[4], *sc[4];
        group_rows(4, w, scales, ldw, lds, R, c, sc);
        __m256 t = _mm256_setzero_ps();
        for (int64_t b = k / 8; k < K; k += 16, b++) t = four_blocks_a4(xq, xs, xc, c, sc, k, b, t);
        const __m256 pairs = _mm256_hadd_ps(t, t); /* rows 0 1 0 1 | 2 3 2 3 */
        tail = _mm_shuffle_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1), 0x44);
    }
    if (R == 4) { /* the four sums at once */
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), tail));
    } else {
        float tails[4];
        _mm_storeu_ps(tails, tail);
        for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + tails[r];
    }
}

/* Rows of fewer than 64 inputs, eight at a time, as short_rows_nvfp4: y[0..R) = the dot products * scale. */
static void short_rows_a4(const int8_t *xq, const float *xs, const int32_t *xc, const uint8_t *w,
                          const uint8_t *scales, int64_t ldw, int64_t lds, int64_t K, int R, float scale, float *y) {
    const uint8_t *c[8], *sc[8];
    group_rows(8, w, scales, ldw, lds, R, c, sc);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        a0 = four_blocks_a4(xq, xs, xc, c, sc, k, k / 16, a0);
        a1 = four_blocks_a4(xq, xs, xc, c + 4, sc + 4, k, k / 16, a1);
    }
    eight_sums(_mm256_hadd_ps(a0, a1), scale, R, y);
}

/* y[n0:n1] = x W[n0:n1]^T for one row of x given as nvfp4_inputs left it; `scale` the two float scales'
   product. */
static void part_nvfp4_a4(const int8_t *xq, const float *xs, const int32_t *xc, const uint8_t *w,
                          const uint8_t *scales, float *y, int64_t K, int64_t ldw, int64_t lds, float scale,
                          int64_t n0, int64_t n1) {
    scale *= 64.f; /* (2 w)(2 x) and the weight scales' 2^-8 */
    if (K < 64) {
        for (int64_t n = n0; n < n1; n += 8) {
            if (K / 2 < ldw) prefetch_nvfp4(w, scales, ldw, lds, K, n, n1), prefetch_nvfp4(w, scales, ldw, lds, K, n + 4, n1);
            short_rows_a4(xq, xs, xc, w + n * ldw, scales + n * lds, ldw, lds, K, n1 - n < 8 ? (int)(n1 - n) : 8, scale,
                          y + n);
        }
        return;
    }
    for (int64_t n = n0; n < n1; n += 4) {
        const int R = n1 - n < 4 ? (int)(n1 - n) : 4;
        if (K / 2 < ldw) /* a budget's cut rows (whole rows stream: prefetching them cost 1.0-1.2x in the caches) */
            prefetch_nvfp4(w, scales, ldw, lds, K, n, n1);
        float out[4];
        switch (R) {
        case 4: rows_a4(4, xq, xs, xc, w + n * ldw, scales + n * lds, ldw, lds, K, out); break;
        case 3: rows_a4(3, xq, xs, xc, w + n * ldw, scales + n * lds, ldw, lds, K, out); break;
        case 2: rows_a4(2, xq, xs, xc, w + n * ldw, scales + n * lds, ldw, lds, K, out); break;
        default: rows_a4(1, xq, xs, xc, w + n * ldw, scales + n * lds, ldw, lds, K, out);
        }
        for (int r = 0; r < R; r++) y[n + r] = out[r] * scale;
    }
}

/* Fewer rows of x than this take the integer products a row at a time: at 2 and 3 rows 2.3-3.1x the rounded
   rows on the weight-only kernels (which decode each weight row into float32 for them), at 4 1.3-1.5x, at 8
   0.7-1.0x (scratch, one thread, 256 x 768 and 768 x 1536). */
const int64_t nvfp4_a4_rows = 8;

/* y[:, n0:n1] = x W[n0:n1]^T for M rows of x (y's rows N apart), each row rounded here (every thread rounds
   its own copy: K values, against its share of K x N weights) and run on the integer products. */
void part_nvfp4_a4_rows(const float *x, int64_t M, const uint8_t *w, const uint8_t *scales, float *y, int64_t N,
                        int64_t K, int64_t ldw, int64_t lds, float scale, float input_scale, int64_t n0, int64_t n1) {
    int8_t xq[K];
    float xs[K / 8];
    int32_t xc[K / 8];
    for (int64_t m = 0; m < M; m++) {
        const float s = scale * nvfp4_inputs(x + m * K, K, input_scale, xq, xs, xc);
        part_nvfp4_a4(xq, xs, xc, w, scales, y + m * N, K, ldw, lds, s, n0, n1);
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

int gemv_p_f32(const float *x, const float *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
               int64_t skip, int threads) {
    SHARED(part_p(x, p, y, M, N, K, ps, skip, n0, n1, P_F32, 1.f));
    return 0;
}

int gemv_p_bf16(const float *x, const uint16_t *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
                int64_t skip, int threads) {
    SHARED(part_p(x, p, y, M, N, K, ps, skip, n0, n1, P_BF16, 1.f));
    return 0;
}

/* x @ W.T * scale for e4m3 panels p (bytes; model/linear.py FP8Panels), any number of rows: each thread a
   share of whole panels, so that no panel's block is widened by two threads. */
int gemv_p_fp8(const float *x, const uint8_t *p, float *y, int64_t M, int64_t N, int64_t K, int64_t ps,
               int64_t skip, float scale, int threads) {
    #pragma omp parallel num_threads(threads) if (M * N * K >= 65536)
    {
        int64_t n0, n1;
        panel_share(skip, N, &n0, &n1);
        if (n0 < n1) part_p(x, p, y, M, N, K, ps, skip, n0, n1, P_FP8, scale);
    }
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
    #pragma omp parallel num_threads(threads) if (N * K >= 65536)
    { /* every thread permutes some rows of x, then takes its share of the outputs */
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) permute_nvfp4(x + m * K, xp + m * K, 1, K);
        int64_t n0, n1;
        share(N, &n0, &n1);
        part_nvfp4(xp, w, scales, y, M, N, K, ldw, lds, scale, n0, n1);
    }
    free(xp);
    return 0;
}

/* gemv_nvfp4 with x's rows rounded to NVFP4 first (W4A4, above): fewer than nvfp4_a4_rows rows on the
   integer products, more rounded and run on the weight-only kernels. input_scale 0: each row's own. */
int gemv_nvfp4_a4(const float *x, const uint8_t *w, const uint8_t *scales, float *y, int64_t M, int64_t N,
                  int64_t K, int64_t ldw, int64_t lds, float scale, float input_scale, int threads) {
    if (M < nvfp4_a4_rows) {
        SHARED(part_nvfp4_a4_rows(x, M, w, scales, y, N, K, ldw, lds, scale, input_scale, n0, n1));
        return 0;
    }
    float *xr = malloc(M * K * sizeof(float));
    if (!xr) return -1;
    #pragma omp parallel for num_threads(threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) nvfp4_round_rows(x + m * K, xr + m * K, 1, K, input_scale);
    const int rc = gemv_nvfp4(xr, w, scales, y, M, N, K, ldw, lds, scale, threads);
    free(xr);
    return rc;
}

/* y [M, N] (float32) = x [M, K] (bf16) times packed FP8 (`format` PANEL_FP8) or NVFP4 (PANEL_NVFP4) rows on
   the bf16 dots, K even (packed_bf16x): 0; -1 where memory ran out; -2 where this CPU or build has no bf16
   dots, or K is odd (then gemv_fp8 / gemv_nvfp4 on x in float32). NVFP4's x is permuted first, exactly
   (permute_nvfp4_bf16). */
int gemm_packed_bf16x(int format, const uint16_t *x, const uint8_t *w, const uint8_t *scales, float *y, int64_t M,
                      int64_t N, int64_t K, int64_t ldw, int64_t lds, float scale, int threads) {
#ifdef BF16_DOT
    if (!bf16_dot() || K % 2) return -2;
    uint16_t *xp = format == PANEL_NVFP4 ? malloc(sizeof(uint16_t) * M * K) : NULL;
    if (format == PANEL_NVFP4 && !xp) return -1;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (N * K >= 65536)
    {
        if (xp) {
            float *wide = malloc(sizeof(float) * 2 * K);
            #pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                if (wide) permute_nvfp4_bf16(x + m * K, xp + m * K, 1, K, wide);
            if (!wide) {
                #pragma omp atomic write
                failed = 1;
            }
            free(wide);
            #pragma omp barrier
        }
        int64_t n0, n1;
        share(N, &n0, &n1);
        if (!failed && n0 < n1 && !packed_bf16x(format, xp ? xp : x, w, scales, y, M, N, K, ldw, lds, scale, n0, n1)) {
            #pragma omp atomic write
            failed = 1;
        }
    }
    free(xp);
    return failed ? -1 : 0;
#else
    (void)format, (void)x, (void)w, (void)scales, (void)y, (void)M, (void)N, (void)K, (void)ldw, (void)lds;
    (void)scale, (void)threads;
    return -2;
#endif
}

/* The calling thread's y [M, N] = x [M, K] (bf16; NVFP4's permuted) W^T on the bf16 dots: W a panel view
   (`panel`: w the panels, ld their stride, `skip`; bf16, or e4m3 for `format` PANEL_FP8) or rows of
   `format` (PANEL_BF16 / FP8 / NVFP4, ld and lds in bytes), `scale` the per-tensor one. For step.c's
   experts of a bfloat16 prompt, an expert to a thread. 0; -1 where memory ran out; -2 where there are no
   bf16 dots, or K is odd. */
int product_bf16x(int format, int panel, const uint16_t *x, const void *w, const uint8_t *scales, float *y,
                  int64_t M, int64_t N, int64_t K, int64_t ld, int64_t lds, int64_t skip, float scale) {
#ifdef BF16_DOT
    if (!bf16_dot() || K % 2) return -2;
    if (!panel) return packed_bf16x(format, x, w, scales, y, M, N, K, ld, lds, scale, 0, N) ? 0 : -1;
    uint32_t *pp = malloc(sizeof(uint32_t) * NB * (KC / 2) * PW);
    if (!pp) return -1;
    float c[MR * PW];
    gemm_bf16_part(x, w, ld, skip, y, M, N, K, 0, N, pp, c, format == PANEL_FP8, scale);
    free(pp);
    return 0;
#else
    (void)format, (void)panel, (void)x, (void)w, (void)scales, (void)y, (void)M, (void)N, (void)K, (void)ld;
    (void)lds, (void)skip, (void)scale;
    return -2;
#endif
}

/* ------------------------------------------------------------------------------------------------------
 * A load's repacking into panels (model/linear.py Panels.of, for float weights and FP8 codes alike): a weight [.., out, K]
 * transposed into [.., Q, K, 24] by in-register transposes of 16 x 16 bytes or 8 x 8 words, where torch's
 * strided copy of a 24-wide inner dimension ran at 0.9-2.1 GB/s (these: 3.1-3.3 GB/s for e4m3 bytes, 2.6-5.8
 * for bf16, one thread; a 12 GB FP8 model's load would spend about 11 s in torch's; docs/decode-speed.md,
 * "FP8 codes in column panels"). */

/* The first two stages of a byte transpose of n rows (n: 8 or 16) a[i]: c[4i + 2h + l] holds rows 4i..4i + 3
   of columns 8h + 4l .. + 3. Each stage interleaves pairs of vectors at twice the width of the one before. */
static inline void transpose_stages(int n, const __m128i *a, __m128i *c) {
    __m128i b[16];
    for (int i = 0; i < n / 2; i++) { /* b[2i], b[2i + 1]: rows 2i and 2i + 1, columns 0-7 and 8-15 */
        b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < n / 4; i++)
        for (int h = 0; h < 2; h++) {
            c[4 * i + 2 * h] = _mm_unpacklo_epi16(b[4 * i + h], b[4 * i + 2 + h]);
            c[4 * i + 2 * h + 1] = _mm_unpackhi_epi16(b[4 * i + h], b[4 * i + 2 + h]);
        }
}

/* 16 x 16 bytes: a[i] = row i's 16 bytes -> a[j] = column j's 16 bytes (rows 0..15). */
static inline void transpose16x16(__m128i a[16]) {
    __m128i b[16];
    transpose_stages(16, a, a);
    for (int i = 0; i < 2; i++) /* b[8i + 2c + l]: rows 8i..8i + 7, columns 4c + 2l, + 1 */
        for (int c = 0; c < 4; c++) {
            b[8 * i + 2 * c] = _mm_unpacklo_epi32(a[8 * i + c], a[8 * i + 4 + c]);
            b[8 * i + 2 * c + 1] = _mm_unpackhi_epi32(a[8 * i + c], a[8 * i + 4 + c]);
        }
    for (int c = 0; c < 8; c++) { /* a[2c + l]: column 2c + l */
        a[2 * c] = _mm_unpacklo_epi64(b[c], b[8 + c]);
        a[2 * c + 1] = _mm_unpackhi_epi64(b[c], b[8 + c]);
    }
}

/* 8 rows of 16 bytes -> 16 columns of 8 bytes, in the low halves of out[j]. */
static inline void transpose8x16(const __m128i a[8], __m128i out[16]) {
    __m128i c[8];
    transpose_stages(8, a, c);
    for (int q = 0; q < 4; q++) { /* columns 4q .. 4q + 3 */
        const __m128i lo = _mm_unpacklo_epi32(c[q], c[4 + q]), hi = _mm_unpackhi_epi32(c[q], c[4 + q]);
        out[4 * q] = lo, out[4 * q + 1] = _mm_unpackhi_epi64(lo, lo);
        out[4 * q + 2] = hi, out[4 * q + 3] = _mm_unpackhi_epi64(hi, hi);
    }
}

/* 8 x 8 words: a[i] = row i's 8 words -> a[j] = column j's 8 words (rows 0..7). */
static inline void transpose8x8w(__m128i a[8]) {
    __m128i b[8], c[8];
    for (int i = 0; i < 4; i++) {
        b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) /* c[4i + 2h + l]: rows 4i..4i + 3, columns 4h + 2l, + 1 */
        for (int h = 0; h < 2; h++) {
            c[4 * i + 2 * h] = _mm_unpacklo_epi32(b[4 * i + h], b[4 * i + 2 + h]);
            c[4 * i + 2 * h + 1] = _mm_unpackhi_epi32(b[4 * i + h], b[4 * i + 2 + h]);
        }
    for (int j = 0; j < 4; j++) {
        a[2 * j] = _mm_unpacklo_epi64(c[j], c[4 + j]);
        a[2 * j + 1] = _mm_unpackhi_epi64(c[j], c[4 + j]);
    }
}

/* Panel pq's 24 source rows of `size`-byte elements (NULL past the last output: zeros). */
static void panel_rows(const char *src, int64_t size, int64_t pq, int64_t out, int64_t K, const char *r[PW]) {
    const int64_t Q = (out + PW - 1) / PW, l = pq / Q, q = pq % Q;
    for (int64_t i = 0; i < PW; i++) r[i] = q * PW + i < out ? src + ((l * out + q * PW + i) * K) * size : NULL;
}

static inline __m128i row16(const char *r, int64_t at) {
    return r ? _mm_loadu_si128((const __m128i *)(r + at)) : _mm_setzero_si128();
}

/* 16 inputs of a panel's 24 rows of bytes r[] from input k -> 16 panel rows at `to`. */
static inline void panel_block_bytes(const char *const r[PW], int64_t k, uint8_t *to) {
    __m128i a[16], e[8], last[16];
    for (int i = 0; i < 16; i++) a[i] = row16(r[i], k);
    for (int i = 0; i < 8; i++) e[i] = row16(r[16 + i], k);
    transpose16x16(a);
    transpose8x16(e, last);
    for (int j = 0; j < 16; j++) {
        _mm_storeu_si128((__m128i *)(to + j * PW), a[j]);
        _mm_storel_epi64((__m128i *)(to + j * PW + 16), last[j]);
    }
}

/* 8 inputs of a panel's 24 rows of bf16 words r[] from input k -> 8 panel rows at `to`, each row's first 16
   columns in linear.BF16_COLUMNS' order (position 2c + h holds column 8h + c, as bf16_panel_row reads
   them): columns 0-7 and 8-15 interleaved, then 16-23. */
static inline void panel_block_words(const char *const r[PW], int64_t k, uint16_t *to) {
    __m128i a[3][8];
    for (int g = 0; g < 3; g++) {
        for (int i = 0; i < 8; i++) a[g][i] = row16(r[8 * g + i], 2 * k);
        transpose8x8w(a[g]);
    }
    for (int j = 0; j < 8; j++) {
        _mm_storeu_si128((__m128i *)(to + j * PW), _mm_unpacklo_epi16(a[0][j], a[1][j]));
        _mm_storeu_si128((__m128i *)(to + j * PW + 8), _mm_unpackhi_epi16(a[0][j], a[1][j]));
        _mm_storeu_si128((__m128i *)(to + j * PW + 16), a[2][j]);
    }
}

/* dst [lead Q, K, 24] = src [lead, out, K] in panels of 24 outputs (the last panel's missing outputs zero), of
   1-byte elements (e4m3 codes) or 2-byte ones (bf16, in BF16_COLUMNS' order). 0; -1 for another size. */
int panel_copy(const void *src, void *dst, int64_t lead, int64_t out, int64_t K, int64_t size) {
    if (size != 1 && size != 2) return -1;
    const int64_t block = size == 1 ? 16 : 8; /* inputs a transpose takes */
    for (int64_t pq = 0; pq < lead * ((out + PW - 1) / PW); pq++) {
        const char *r[PW];
        panel_rows((const char *)src, size, pq, out, K, r);
        char *to = (char *)dst + pq * K * PW * size;
        int64_t k = 0;
        for (; k + block <= K; k += block)
            if (size == 1) panel_block_bytes(r, k, (uint8_t *)to + k * PW);
            else panel_block_words(r, k, (uint16_t *)to + k * PW);
        for (; k < K; k++) /* the last K % block inputs one at a time */
            for (int c = 0; c < PW; c++) {
                const int at = size == 2 && c < 16 ? 2 * (c % 8) + c / 8 : c;
                if (r[c]) memcpy(to + (k * PW + at) * size, r[c] + k * size, (size_t)size);
                else memset(to + (k * PW + at) * size, 0, (size_t)size);
            }
    }
    return 0;
}

/* Gives the calling thread's OpenMP workers back (model/gemv.py, release_threads): OpenMP 5.0's call, in
   libgomp from gcc 9 on. */
int release_threads(void) {
#ifdef _OPENMP
    return omp_pause_resource_all(omp_pause_soft);
#else
    return 0;
#endif
}

/* The calling thread's floating-point mode (MXCSR: flush-to-zero, denormals-are-zero, rounding), and
   setting it: a thread that generates for another takes that one's (model/gemv.py, float_mode). */
int float_mode(void) { return (int)_mm_getcsr(); }

int set_float_mode(int mode) {
    _mm_setcsr((unsigned int)mode);
    return 0;
}
