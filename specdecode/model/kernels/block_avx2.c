/* One Llama-style decoder block in bf16 with int4 linears, for AVX2 + FMA + F16C CPUs: the
   same entry points and arguments as block_bf16.c (its header says why the block is one
   call), in 8-lane fp32 arithmetic. As there, every token of a pass is computed alone (its
   norm, its row of each GEMM, its RoPE, its attention over exactly the keys it sees, in slot
   order), so a token's result is bitwise the same in a pass of any size or shape. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h"
#include "block.h"

/* e^x in 8 fp32 lanes: 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (two-part ln 2) and
   p the degree-6 Taylor polynomial, ~2 ulp. x is clamped to [-87, 88] so that 2^n stays a
   normal number built from its exponent bits (e^-87 ~ 1.6e-38: nothing a bf16 result keeps). */
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Rotate-half RoPE of one head in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), in fp32, rounded once. */
static void rope_head(uint16_t* x, const float* c, const float* s, int D) {
  const int h = D / 2;
  int d = 0;
  for (; d + 8 <= h; d += 8) {
    __m256 x1 = load8(x + d), x2 = load8(x + d + h), cv = _mm256_loadu_ps(c + d), sv = _mm256_loadu_ps(s + d);
    store8(x + d, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
    store8(x + d + h, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
  }
  for (; d < h; d++) {
    float x1 = from_bf16(x[d]), x2 = from_bf16(x[d + h]);
    x[d] = to_bf16(fmaf(x1, c[d], -(x2 * s[d])));
    x[d + h] = to_bf16(fmaf(x2, c[d], x1 * s[d]));
  }
}

/* x <- bf16(x + y) over n values (n % 8 == 0): the residual add, as torch's bf16 add. */
static void add_into(uint16_t* x, const uint16_t* y, int64_t n) {
  for (int64_t e = 0; e < n; e += 8) store8(x + e, _mm256_add_ps(load8(x + e), load8(y + e)));
}

/* Attention of token i's G query heads that share kv head `kh`: softmax(q k^T * scale) v over
   the token's visible keys, in slot order, fp32 throughout; out rounded to bf16. ``sc`` holds
   G rows of n scores, each row padded to a multiple of 8. */
static void attend(const BlockWeights* w, const Pass* p, int i, int kh, const uint16_t* q, const uint16_t* kc,
                   const uint16_t* vc, uint16_t* out, int64_t* keys, float* sc) {
  const int D = w->head_dim, G = w->heads / w->kv_heads;
  const int n = visible_keys(p, i, keys);
  const int n8 = (n + 7) / 8 * 8;
  const int64_t hoff = (int64_t)kh * p->head_stride;
  __m256 qv[8][32]; /* G <= 8, D <= 256 */
  for (int g = 0; g < G; g++)
    for (int d = 0; d < D; d += 8) qv[g][d / 8] = load8(q + (int64_t)g * D + d);
  for (int j = 0; j < n; j++) {
    const uint16_t* k = kc + keys[j] * p->slot_stride + hoff;
    __m256 acc[8];
    for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      __m256 kv = load8(k + d);
      for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(qv[g][d / 8], kv, acc[g]);
    }
    for (int g = 0; g < G; g++) sc[(int64_t)g * n8 + j] = hsum8(acc[g]) * w->scale;
  }
  for (int g = 0; g < G; g++) { /* softmax over 8-lane chunks; lanes past n are -inf, then 0 */
    float* s = sc + (int64_t)g * n8;
    for (int j = n; j < n8; j++) s[j] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
    for (int j = 0; j < n8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    const __m256 top = _mm256_set1_ps(hmax8(mx));
    for (int j = 0; j < n8; j += 8) {
      __m256 v = _mm256_loadu_ps(s + j);
      __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(v, top)), _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float inv = 1.0f / hsum8(sum);
    for (int j = 0; j < n; j++) s[j] *= inv;
  }
  for (int d = 0; d < D; d += 8) { /* each output lane sums over the keys in slot order */
    __m256 o[8];
    for (int g = 0; g < G; g++) o[g] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
      __m256 vv = load8(vc + keys[j] * p->slot_stride + hoff + d);
      for (int g = 0; g < G; g++) o[g] = _mm256_fmadd_ps(_mm256_set1_ps(sc[(int64_t)g * n8 + j]), vv, o[g]);
    }
    for (int g = 0; g < G; g++) store8(out + (int64_t)g * D + d, o[g]);
  }
}

/* 8 outputs of one row of y = x @ w^T: one fp32 accumulator per output over K in 8-lane
   chunks, reduced at the end. */
static void bf16_tile(const uint16_t* x, int K, const uint16_t* w, uint16_t* y) {
  __m256 acc[8];
  for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    __m256 xv = load8(x + k);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(xv, load8(w + (int64_t)c * K + k), acc[c]);
  }
  for (int c = 0; c < 8; c++) y[c] = to_bf16(hsum8(acc[c]));
}

/* y [M, N] bf16 = x [M, K] bf16 @ w [N, K]^T with fp32 accumulation; K % 8 == 0, N % 8 == 0.
   Reads w in its own row-major layout (an nn.Linear's weight, no copy). A job owns 8 outputs
   and runs every row of x against them, so the weights are read from memory once whatever M
   is; each output is one row's dot product in a fixed order, whatever the batch. */
void bf16_gemm(const uint16_t* x, int M, int K, const uint16_t* w, int N, uint16_t* y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)N * K > 32768)
  for (int n0 = 0; n0 < N; n0 += 8)
    for (int m = 0; m < M; m++) bf16_tile(x + (int64_t)m * K, K, w + (int64_t)n0 * K, y + (int64_t)m * N + n0);
}

/* a[j] = bf16(bf16(silu(g[j])) * u[j]) for one token's gate | up row gu [2I] (I % 8 == 0):
   torch's two bf16 ops. */
static void silu_mul(const uint16_t* gu, uint16_t* a, int I) {
  for (int j = 0; j < I; j += 8) {
    __m256 g = load8(gu + j);
    __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    store8(a + j, _mm256_mul_ps(round8(silu), load8(gu + I + j)));
  }
}

#define SCORE_PAD 8 /* attend pads each score row to a multiple of 8 lanes */
#include "block_body.h"
