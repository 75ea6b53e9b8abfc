/* One Llama-style decoder block in bf16 with int4 linears, for AVX512-BF16 CPUs; see
   specdecode/model/cpu_block.py for when it runs and how its arguments are built.

   Why: a decode step of a small model is overhead-bound. The torch block dispatches ~25 ops
   per layer (norms, RoPE, cache writes, SDPA, activations), whose dispatch costs more than
   its int4 matmuls. Here the whole block is one call.

   Every token of the pass is computed alone: its norm, its row of each GEMM (int4_gemm is
   row-invariant), its RoPE and its attention over exactly the keys it sees, in slot order.
   So a token's result is bitwise the same whether it is decoded alone, verified among γ
   others, in a tree, or in a batch of any size: batch invariance at no extra cost. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block.h"
#include "sum16.h"

static inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); /* round to nearest even, as torch */
}

/* e^x in 16 fp32 lanes: 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (two-part ln 2) and
   p the degree-6 Taylor polynomial, ~2 ulp, far below the bf16 rounding applied after it. */
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 round512(__m512 v) { /* v rounded to bf16, kept in fp32 lanes */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* Rotate-half RoPE of one head in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), in fp32, rounded once. */
static void rope_head(uint16_t* x, const float* c, const float* s, int D) {
  const int h = D / 2;
  int d = 0;
  for (; d + 16 <= h; d += 16) {
    __m512 x1 = load16(x + d), x2 = load16(x + d + h), cv = _mm512_loadu_ps(c + d), sv = _mm512_loadu_ps(s + d);
    store16(x + d, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)));
    store16(x + d + h, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)));
  }
  for (; d < h; d++) { /* head_dim / 2 not a multiple of 16: the same arithmetic, one lane */
    float x1 = from_bf16(x[d]), x2 = from_bf16(x[d + h]);
    x[d] = to_bf16(fmaf(x1, c[d], -(x2 * s[d])));
    x[d + h] = to_bf16(fmaf(x2, c[d], x1 * s[d]));
  }
}

/* x <- bf16(x + y) over n values (n % 16 == 0): the residual add, as torch's bf16 add. */
static void add_into(uint16_t* x, const uint16_t* y, int64_t n) {
  for (int64_t e = 0; e < n; e += 16) store16(x + e, _mm512_add_ps(load16(x + e), load16(y + e)));
}

/* Attention of token i's G query heads that share kv head `kh`: softmax(q k^T * scale) v over
   the token's visible keys, in slot order, fp32 throughout; out rounded to bf16. G and DC (head_dim
   / 16) are constants in the common instances (attend), so q and the outputs stay in registers;
   scores go 16 keys at a time through one reduction tree; the outputs sum the keys in slot
   order. */
static inline __attribute__((always_inline)) void attend_gd(
    const int G, const int DC, const BlockWeights* w, const Pass* p, int i, int kh, const uint16_t* q,
    const uint16_t* kc, const uint16_t* vc, uint16_t* out, int64_t* keys, float* sc) {
  const int D = DC * 16;
  const int n = visible_keys(p, i, keys);
  const int64_t hoff = (int64_t)kh * p->head_stride;
  const __m512 scale = _mm512_set1_ps(w->scale);
  __m512 qv[8][16]; /* G <= 8, D <= 256 */
  for (int g = 0; g < G; g++)
    for (int c = 0; c < DC; c++) qv[g][c] = load16(q + (int64_t)g * D + 16 * c);
  for (int j0 = 0; j0 < n; j0 += 16) {
    const int nj = n - j0 < 16 ? n - j0 : 16;
    __m512 acc[8][16]; /* [head][key]: 16 lanes of partial sums */
    for (int jj = 0; jj < 16; jj++) {
      __m512 a[8];
      for (int g = 0; g < G; g++) a[g] = _mm512_setzero_ps();
      if (jj < nj) {
        const uint16_t* k = kc + keys[j0 + jj] * p->slot_stride + hoff;
        for (int c = 0; c < DC; c++) {
          __m512 kv = load16(k + 16 * c);
          for (int g = 0; g < G; g++) a[g] = _mm512_fmadd_ps(qv[g][c], kv, a[g]);
        }
      }
      for (int g = 0; g < G; g++) acc[g][jj] = a[g];
    }
    const __mmask16 m = (__mmask16)((1u << nj) - 1);
    for (int g = 0; g < G; g++) _mm512_mask_storeu_ps(sc + (int64_t)g * n + j0, m, _mm512_mul_ps(sum16x16(acc[g]), scale));
  }
  for (int g = 0; g < G; g++) {  /* softmax in 16-lane chunks; the tail masked */
    float* s = sc + (int64_t)g * n;
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
      __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + j));
    }
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int j = 0; j < n; j += 16) {
      __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(sum);
    for (int j = 0; j < n; j++) s[j] *= inv;
  }
  __m512 o[8][16]; /* G x DC independent sums (a chain per chunk would wait on the FMA latency every key) */
  for (int g = 0; g < G; g++)
    for (int c = 0; c < DC; c++) o[g][c] = _mm512_setzero_ps();
  for (int j = 0; j < n; j++) {
    const uint16_t* v = vc + keys[j] * p->slot_stride + hoff;
    __m512 pj[8];
    for (int g = 0; g < G; g++) pj[g] = _mm512_set1_ps(sc[(int64_t)g * n + j]);
    for (int c = 0; c < DC; c++) {
      __m512 vv = load16(v + 16 * c);
      for (int g = 0; g < G; g++) o[g][c] = _mm512_fmadd_ps(pj[g], vv, o[g][c]);
    }
  }
  for (int g = 0; g < G; g++)
    for (int c = 0; c < DC; c++) store16(out + (int64_t)g * D + 16 * c, o[g][c]);
}

#define ATTEND_GD(G, DC) static void attend_##G##_##DC(const BlockWeights* w, const Pass* p, int i, int kh, \
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, uint16_t* out, int64_t* keys, float* sc) \
  { attend_gd(G, DC, w, p, i, kh, q, kc, vc, out, keys, sc); }
ATTEND_GD(1, 4) ATTEND_GD(2, 4) ATTEND_GD(3, 4) ATTEND_GD(4, 4) ATTEND_GD(5, 4) ATTEND_GD(6, 4) ATTEND_GD(7, 4) ATTEND_GD(8, 4)
ATTEND_GD(1, 8) ATTEND_GD(2, 8) ATTEND_GD(3, 8) ATTEND_GD(4, 8) ATTEND_GD(5, 8) ATTEND_GD(6, 8) ATTEND_GD(7, 8) ATTEND_GD(8, 8)
typedef void (*attend_fn)(const BlockWeights*, const Pass*, int, int, const uint16_t*, const uint16_t*,
                          const uint16_t*, uint16_t*, int64_t*, float*);
static const attend_fn ATTEND_64[9] = {0, attend_1_4, attend_2_4, attend_3_4, attend_4_4, attend_5_4, attend_6_4,
                                       attend_7_4, attend_8_4};
static const attend_fn ATTEND_128[9] = {0, attend_1_8, attend_2_8, attend_3_8, attend_4_8, attend_5_8, attend_6_8,
                                        attend_7_8, attend_8_8};

/* head_dim 64 and 128 (most models) through their instances; any other through the same code
   with G and D read at run time (the same arithmetic, so the same results). */
static void attend(const BlockWeights* w, const Pass* p, int i, int kh, const uint16_t* q, const uint16_t* kc,
                   const uint16_t* vc, uint16_t* out, int64_t* keys, float* sc) {
  const int D = w->head_dim, G = w->heads / w->kv_heads;
  if (D == 64 || D == 128)
    (D == 64 ? ATTEND_64 : ATTEND_128)[G](w, p, i, kh, q, kc, vc, out, keys, sc);
  else
    attend_gd(G, D / 16, w, p, i, kh, q, kc, vc, out, keys, sc);
}

/* Up to 3 rows x 8 outputs of y = x @ w^T: 24 fp32 accumulators in registers; each 32-wide
   slice of the 8 weight rows is loaded once and used for every row of x. */
static inline __attribute__((always_inline)) void bf16_tile(const int MB, const uint16_t* x, int K,
                                                            const uint16_t* w, uint16_t* y, int N) {
  __m512 acc[3][8];
#pragma GCC unroll 3
  for (int r = 0; r < MB; r++)
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) acc[r][c] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    __m512bh xv[3];
#pragma GCC unroll 3
    for (int r = 0; r < MB; r++) xv[r] = (__m512bh)_mm512_loadu_si512(x + (int64_t)r * K + k);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (int64_t)c * K + k);
#pragma GCC unroll 3
      for (int r = 0; r < MB; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < MB; r++)
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) y[(int64_t)r * N + c] = to_bf16(_mm512_reduce_add_ps(acc[r][c]));
}
#define BF16_TILE(MB) static void bf16_tile##MB(const uint16_t* x, int K, const uint16_t* w, uint16_t* y, int N) \
  { bf16_tile(MB, x, K, w, y, N); }
BF16_TILE(1) BF16_TILE(2) BF16_TILE(3)
typedef void (*bf16_tile_fn)(const uint16_t*, int, const uint16_t*, uint16_t*, int);
static const bf16_tile_fn BF16_TILES[4] = {0, bf16_tile1, bf16_tile2, bf16_tile3};

/* y [M, N] bf16 = x [M, K] bf16 @ w [N, K]^T with fp32 accumulation; K % 32 == 0, N % 8 == 0.
   Reads w in its own row-major layout (an nn.Linear's weight, no copy). A job owns 8 outputs
   and runs every row of x against them, 3 rows at a time, so the weights are read from memory
   once whatever M is. Each output is one row's dot product in a fixed order, so a row's result
   does not depend on the batch. */
void bf16_gemm(const uint16_t* x, int M, int K, const uint16_t* w, int N, uint16_t* y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)N * K > 32768)
  for (int n0 = 0; n0 < N; n0 += 8)
    for (int m0 = 0; m0 < M; m0 += 3)
      BF16_TILES[M - m0 < 3 ? M - m0 : 3](x + (int64_t)m0 * K, K, w + (int64_t)n0 * K, y + (int64_t)m0 * N + n0, N);
}

/* a[j] = bf16(bf16(silu(g[j])) * u[j]) for one token's gate | up row gu [2I] (I % 16 == 0,
   checked by cpu_block.py): torch's two bf16 ops. */
static void silu_mul(const uint16_t* gu, uint16_t* a, int I) {
  for (int j = 0; j < I; j += 16) {
    __m512 g = load16(gu + j);
    __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store16(a + j, _mm512_mul_ps(round512(silu), load16(gu + I + j)));
  }
}

#define SCORE_PAD 0
#include "block_body.h"
