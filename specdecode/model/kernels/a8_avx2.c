/* Group-wise int4 and GGUF Q8_0 weights times int8 activations (W4A8 / W8A8, the arithmetic of
   llama.cpp's Q4 x Q8 and Q8 x Q8 dot products) for AVX2 CPUs; built into both libraries
   (AVX512 CPUs run AVX2 too).

   Why: without vdpbf16ps, widening each weight to fp32 and multiplying with FMAs costs more
   than reading it (int4_avx2.c is compute-bound at one row). Here each group of 32 inputs of a
   row is quantized to int8, q = round(x / d) with d = max|x| / 127, and vpmaddubsw multiplies 32
   nibbles by 32 int8 inputs per instruction, summed exactly in int16 / int32. Per group:
       y[m, n] += s[n, g] d[m, g] (q_w[n, g] . q_x[m, g]) + z[n, g] sum(x[m, g])
   with w = s q_w + z (int4_gemm's s and z, fp16) and the group's sum of x exact in fp32. The
   integer dot products are exact, and each row's quantization and float steps are its own and
   in a fixed order, so a row's result does not depend on the other rows of the pass.

   Layout (cpu_int4.pack_int4_a8): per 8 output columns and group, 4 vectors of 32 bytes;
   vector v's byte 4c + e holds q[c, 8v + e] (low nibble) and q[c, 8v + 4 + e] (high), so each
   nibble plane pairs with 4 consecutive inputs broadcast to every column. Scales and zeros:
   per 8 columns and group, 8 fp16 s then 8 fp16 z.

   Q8_0 (w = d q, q int8; cpu_int4.pack_q8_a8): per 8 columns and group, 8 vectors of 32 bytes,
   vector v's byte 4c + e = q[c, 4v + e], then 8 fp16 d. vpmaddubsw wants one unsigned operand:
   |q| times x with q's sign (vpsignb), as llama.cpp does; a pair of products (at most
   2 * 128 * 127) fills int16, so vpmaddwd widens each vector's to int32 at once. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h"

/* Row-local int8 quantization of x [M, K] bf16 by groups of 32: q [M, K], d and the exact fp32
   sums xs [M, K/32]. An all-zero group gets d = 0 and q = 0. */
static void quantize_rows(const uint16_t* x, int M, int K, int8_t* q, float* d, float* xs) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < (int64_t)M * K / 32; i++) {
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
      v[j] = load8(x + i * 32 + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[j], absmask));
    }
    xs[i] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const float amax = hmax8(mx);
    d[i] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i a[4];
    for (int j = 0; j < 4; j++) a[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)); /* nearest even */
    /* packs work within 128-bit lanes: [a0 lo, a1 lo, a2 lo, a3 lo | a0 hi, ...] in 4-byte units */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
    _mm256_storeu_si256((__m256i*)(q + i * 32), _mm256_permutevar8x32_epi32(b, order));
  }
}

static inline __m256i bcast4(const int8_t* p) { /* 4 int8 inputs, repeated over 32 bytes */
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/* 8 columns (one job) for MB <= 4 rows, everything in registers. Per group and 8 inputs the
   nibbles are split once (low, high), and each row's two vpmaddubsw sum into one int16
   accumulator (8 products of at most 2 * 15 * 127 each over the group: < 2^15); vpmaddwd pairs
   it into each column's int32 dot product. Integer sums are exact and each row's float steps
   are the same whatever MB is, so the rows blocked together do not change a row's result. */
static inline __attribute__((always_inline)) void a8_block(
    const int MB, const int8_t* q, const float* d, const float* xs, int K, const uint8_t* wp, const uint16_t* sz,
    uint16_t* y, int ldy) {
  const int G = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 o[4];
#pragma GCC unroll 4
  for (int r = 0; r < MB; r++) o[r] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wp + (size_t)g * 128;
    __m256i acc[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      const __m256i b = _mm256_loadu_si256((const __m256i*)(gp + 32 * v));
      const __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
#pragma GCC unroll 4
      for (int r = 0; r < MB; r++) {
        const int8_t* qr = q + (size_t)r * K + g * 32 + 8 * v;
        const __m256i t =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(qr)), _mm256_maddubs_epi16(hi, bcast4(qr + 4)));
        acc[r] = v == 0 ? t : _mm256_add_epi16(acc[r], t);
      }
    }
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sz + (size_t)g * 16)));
    const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sz + (size_t)g * 16 + 8)));
#pragma GCC unroll 4
    for (int r = 0; r < MB; r++) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r], ones));
      const int64_t rg = (int64_t)r * G + g;
      const __m256 zx = _mm256_fmadd_ps(z, _mm256_set1_ps(xs[rg]), o[r]);
      o[r] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(d[rg])), dot, zx);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MB; r++) store8(y + (size_t)r * ldy, o[r]);
}

/* The same for 8 columns of Q8_0 (layout above): per group and row an int32 dot product per
   column, then o += d_w d_x dot. */
static inline __attribute__((always_inline)) void q8a8_block(
    const int MB, const int8_t* q, const float* d, const float* xs, int K, const uint8_t* wp, const uint16_t* dw,
    uint16_t* y, int ldy) {
  (void)xs;
  const int G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 o[4];
#pragma GCC unroll 4
  for (int r = 0; r < MB; r++) o[r] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wp + (size_t)g * 256;
    __m256i acc[4];
#pragma GCC unroll 8
    for (int v = 0; v < 8; v++) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(gp + 32 * v)), aw = _mm256_abs_epi8(w);
#pragma GCC unroll 4
      for (int r = 0; r < MB; r++) {
        const __m256i sx = _mm256_sign_epi8(bcast4(q + (size_t)r * K + g * 32 + 4 * v), w);
        const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones);
        acc[r] = v == 0 ? t : _mm256_add_epi32(acc[r], t);
      }
    }
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dw + (size_t)g * 8)));
#pragma GCC unroll 4
    for (int r = 0; r < MB; r++) {
      const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(d[(int64_t)r * G + g]));
      o[r] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(acc[r]), o[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MB; r++) store8(y + (size_t)r * ldy, o[r]);
}

typedef void (*block_fn)(const int8_t*, const float*, const float*, int, const uint8_t*, const uint16_t*, uint16_t*,
                         int);
#define BLOCK(KIND, MB) static void KIND##MB(const int8_t* q, const float* d, const float* xs, int K, \
    const uint8_t* wp, const uint16_t* sz, uint16_t* y, int ldy) { KIND(MB, q, d, xs, K, wp, sz, y, ldy); }
BLOCK(a8_block, 1) BLOCK(a8_block, 2) BLOCK(a8_block, 3) BLOCK(a8_block, 4)
BLOCK(q8a8_block, 1) BLOCK(q8a8_block, 2) BLOCK(q8a8_block, 3) BLOCK(q8a8_block, 4)
static const block_fn INT4_BLOCKS[5] = {0, a8_block1, a8_block2, a8_block3, a8_block4};
static const block_fn Q8_BLOCKS[5] = {0, q8a8_block1, q8a8_block2, q8a8_block3, q8a8_block4};

/* x quantized once, then jobs of 8 columns for every row, in blocks of up to 4 rows (a job's
   weights come from memory for its first block, then from cache); the threads split the columns
   evenly. ``job_bytes`` / ``job_scales``: a job's weight bytes and fp16 scales per group. */
static void run_a8(const block_fn* blocks, int job_bytes, int job_scales, const uint16_t* x, int M, int K,
                   const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y, int threads) {
  const int G = K / 32, nb = (M + 3) / 4;
  int8_t* q = malloc((size_t)M * K);
  float* d = malloc(sizeof(float) * (size_t)M * G);
  float* xs = malloc(sizeof(float) * (size_t)M * G);
  quantize_rows(x, M, K, q, d, xs);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int job = 0; job < N / 8; job++)
    for (int b = 0, r0 = 0; b < nb; b++) {
      const int rows = (M - r0) / (nb - b);
      blocks[rows](q + (size_t)r0 * K, d + (size_t)r0 * G, xs + (size_t)r0 * G, K, wp + (size_t)job * G * job_bytes,
                   sz + (size_t)job * G * job_scales, y + (size_t)r0 * N + job * 8, N);
      r0 += rows;
    }
  free(q);
  free(d);
  free(xs);
}

/* y [M, N] bf16 = x [M, K] bf16 @ W.T, W int4 in the layout above; K % 32 == 0, N % 8 == 0. */
void int4_a8_gemm(const uint16_t* x, int M, int K, const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y,
                  int threads) {
  run_a8(INT4_BLOCKS, 128, 16, x, M, K, wp, sz, N, y, threads);
}

/* The same for Q8_0 weights (q and d in the layout above). */
void q8_a8_gemm(const uint16_t* x, int M, int K, const uint8_t* wq, const uint16_t* d, int N, uint16_t* y,
                int threads) {
  run_a8(Q8_BLOCKS, 256, 8, x, M, K, wq, d, N, y, threads);
}
