/* Row-invariant attention and fp32 GEMM for the torch blocks (model/invariant.py says when they run).

   Why: torch's SDPA and its fp32 GEMM pick their reduction order by the shape of the whole pass
   (how many queries, rows or keys share it), so a position verified among γ others rounds
   differently from the same position decoded alone, and greedy speculative output can leave
   plain greedy's path at a near-tie. Here every query (attention) and every output (GEMM) is
   computed by the same sequence of operations whatever else is in the pass:
   - attention: a query's visible keys in slot order, one fp32 dot product per key (lanes of
     its head dimension, then one fixed reduction), softmax over exactly those keys, and the
     values summed in slot order;
   - GEMM: each output is one dot product over K in lanes of VL, reduced in a fixed order, the
     tail (K % VL) added after; tiles only decide which outputs share a weight load.
   Built into every instruction set's library (AVX512 or AVX2 lanes); a process uses one. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block.h"
#if defined(__AVX512F__)
#include "sum16.h"
#endif

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2i(vf n) { /* 2^n for integral n in [-126, 127] */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline float vsum(vf a) { /* a fixed tree: halves, quarters, pairs */
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
static inline float vhmax(vf a) {
  float t[8];
  _mm256_storeu_ps(t, a);
  float m = t[0];
  for (int i = 1; i < 8; i++) m = t[i] > m ? t[i] : m;
  return m;
}
static inline vf vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

#if VL == 16
static inline vf vsum_each(const vf* v) { return sum16x16(v); }
#else
/* The same for 8 vectors of 8 lanes: pairs, quads within each 128-bit half, then the halves. */
static inline vf vsum_each(const vf* v) {
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

/* e^x in VL lanes: 2^n p(r), n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), p degree 6 (~2 ulp). */
static inline vf vexp(vf x) {
  x = vmax(vmin(x, vset(88.0f)), vset(-87.0f));
  vf n = vround(vmul(x, vset(1.44269504f)));
  vf r = vsub(x, vmul(n, vset(0.693145752f)));
  r = vsub(r, vmul(n, vset(1.42860677e-6f)));
  vf p = vset(1.0f / 720);
  p = vfma(p, r, vset(1.0f / 120));
  p = vfma(p, r, vset(1.0f / 24));
  p = vfma(p, r, vset(1.0f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  return vmul(p, vpow2i(n));
}

/* One row of D values (fp32 or bf16) as fp32 in dst, zero-padded to Dp (a multiple of VL). */
static inline const float* as_f32(const void* src, int bf16, int D, int Dp, float* dst) {
  if (!bf16 && D == Dp) return (const float*)src;
  if (bf16) {
    const uint16_t* s = (const uint16_t*)src;
    int d = 0;
    for (; d + VL <= D; d += VL) vstore(dst + d, vload_bf16(s + d));
    for (; d < D; d++) dst[d] = from_bf16(s[d]);
  } else {
    memcpy(dst, src, sizeof(float) * D);
  }
  for (int d = D; d < Dp; d++) dst[d] = 0.0f;
  return dst;
}

/* Softmax in place over each of G score rows (n values at a stride of S + VL, the row's
   padding to a multiple of VL written here), VL at a time. */
static void softmax_rows(float* sc, int G, int n, int S) {
  for (int g = 0; g < G; g++) {
    float* s = sc + (int64_t)g * (S + VL);
    const int np = (n + VL - 1) / VL * VL;
    for (int j = n; j < np; j++) s[j] = -INFINITY;
    vf mx = vset(-INFINITY);
    for (int j = 0; j < np; j += VL) mx = vmax(mx, vload(s + j));
    const vf top = vset(vhmax(mx));
    vf sum = vzero();
    for (int j = 0; j < np; j += VL) {
      vf e = vexp(vsub(vload(s + j), top));
      vstore(s + j, e);
      if (j + VL > n) { /* padding lanes: exp(-inf) clamps to a tiny value; make them 0 */
        for (int t = n; t < j + VL; t++) s[t] = 0.0f;
        e = vload(s + j);
      }
      sum = vadd(sum, e);
    }
    const vf inv = vset(1.0f / vsum(sum));
    for (int j = 0; j < np; j += VL) vstore(s + j, vmul(vload(s + j), inv));
  }
}

static inline vf vload_any(const void* p, int bf16) {
  return bf16 ? vload_bf16((const uint16_t*)p) : vload((const float*)p);
}

/* One query's G heads over its n keys, G and C (= D / VL) constants in the common instances,
   so q and the outputs stay in registers; scores VL keys at a time through vsum_each. The
   same arithmetic for a query whatever its neighbours, as the generic loop below. */
static inline __attribute__((always_inline)) void attend_job(
    const int BF, const int G, const int C, float scale, const char* qi, const char* kbase, const char* vbase,
    int64_t ss, const int32_t* keys, int n, float* sc, int S, char* oi) {
  const int D = C * VL, E = BF ? 2 : 4;
  vf qv[8][C];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) qv[g][c] = vload_any(qi + ((int64_t)g * D + c * VL) * E, BF);
  const vf vscale = vset(scale);
  for (int j0 = 0; j0 < n; j0 += VL) {
    const int nj = n - j0 < VL ? n - j0 : VL;
    vf acc[8][VL];
    for (int jj = 0; jj < VL; jj++) {
      vf a[8];
      for (int g = 0; g < G; g++) a[g] = vzero();
      if (jj < nj) {
        const char* k = kbase + (int64_t)keys[j0 + jj] * ss * E;
        for (int c = 0; c < C; c++) {
          vf kv = vload_any(k + (int64_t)c * VL * E, BF);
          for (int g = 0; g < G; g++) a[g] = vfma(qv[g][c], kv, a[g]);
        }
      }
      for (int g = 0; g < G; g++) acc[g][jj] = a[g];
    }
    for (int g = 0; g < G; g++) vstore(sc + (int64_t)g * (S + VL) + j0, vmul(vsum_each(acc[g]), vscale));
  }
  softmax_rows(sc, G, n, S);
  vf o[8][C];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) o[g][c] = vzero();
  for (int j = 0; j < n; j++) {
    const char* v = vbase + (int64_t)keys[j] * ss * E;
    vf p[8];
    for (int g = 0; g < G; g++) p[g] = vset(sc[(int64_t)g * (S + VL) + j]);
    for (int c = 0; c < C; c++) {
      vf vv = vload_any(v + (int64_t)c * VL * E, BF);
      for (int g = 0; g < G; g++) o[g][c] = vfma(p[g], vv, o[g][c]);
    }
  }
  float ob[VL];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) {
      if (BF) {
        vstore(ob, o[g][c]);
        for (int l = 0; l < VL; l++) ((uint16_t*)oi)[(int64_t)g * D + c * VL + l] = to_bf16(ob[l]);
      } else {
        vstore((float*)oi + (int64_t)g * D + c * VL, o[g][c]);
      }
    }
}

typedef void (*job_fn)(float, const char*, const char*, const char*, int64_t, const int32_t*, int, float*, int, char*);
#define JOB(BF, G, C) static void job_##BF##_##G##_##C(float scale, const char* qi, const char* kb, const char* vb, \
    int64_t ss, const int32_t* keys, int n, float* sc, int S, char* oi) \
  { attend_job(BF, G, C, scale, qi, kb, vb, ss, keys, n, sc, S, oi); }
#define JOBS(BF, C) JOB(BF, 1, C) JOB(BF, 2, C) JOB(BF, 3, C) JOB(BF, 4, C) JOB(BF, 5, C) JOB(BF, 6, C) \
  JOB(BF, 7, C) JOB(BF, 8, C)
#define TABLE(BF, C) {0, job_##BF##_1_##C, job_##BF##_2_##C, job_##BF##_3_##C, job_##BF##_4_##C, job_##BF##_5_##C, \
  job_##BF##_6_##C, job_##BF##_7_##C, job_##BF##_8_##C}
#if VL == 16 /* head_dim 64 and 128 */
JOBS(0, 4) JOBS(0, 8) JOBS(1, 4) JOBS(1, 8)
static const job_fn JOBS_64[2][9] = {TABLE(0, 4), TABLE(1, 4)}, JOBS_128[2][9] = {TABLE(0, 8), TABLE(1, 8)};
#else
JOBS(0, 8) JOBS(0, 16) JOBS(1, 8) JOBS(1, 16)
static const job_fn JOBS_64[2][9] = {TABLE(0, 8), TABLE(1, 8)}, JOBS_128[2][9] = {TABLE(0, 16), TABLE(1, 16)};
#endif

/* Attention of N queries: q and out [N, H, D] (fp32, or bf16 when `bf16`), contiguous; query
   i belongs to batch row row[i] and sees the slots s with vis[i, s] (vis [N, S]); K / V of
   (row b, kv head h, slot s) start at element b * sb + h * sh + s * ss of k / v (D contiguous).
   Each query's G heads that share a kv head are one job. */
void attend_rows(int bf16, int N, int S, int H, int Hkv, int D, float scale, const void* q, const int32_t* row,
                 const uint8_t* vis, const void* k, const void* v, int64_t sb, int64_t sh, int64_t ss, void* out,
                 int threads) {
  const int G = H / Hkv, Dp = (D + VL - 1) / VL * VL, C = Dp / VL, E = bf16 ? 2 : 4;
  const int jobs = N * Hkv;
  /* head_dim 64 and 128 (most models) through their instances; any other D or G > 8 through
     the generic loop (its own arithmetic: one model always takes the same one) */
  const job_fn fast = G > 8 ? NULL : D == 64 ? JOBS_64[bf16 != 0][G] : D == 128 ? JOBS_128[bf16 != 0][G] : NULL;
  const int parallel = (int64_t)jobs * S * G * D > 200000;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    int32_t* keys = malloc(sizeof(int32_t) * (S + 1));
    float* sc = malloc(sizeof(float) * ((size_t)G * (S + VL)));
    float* qb = malloc(sizeof(float) * (size_t)G * Dp);
    float* kb = malloc(sizeof(float) * Dp);
    float* ob = malloc(sizeof(float) * (size_t)G * Dp);
#pragma omp for schedule(static)
    for (int job = 0; job < jobs; job++) {
      const int i = job / Hkv, kh = job % Hkv;
      const uint8_t* seen = vis + (int64_t)i * S;
      int n = 0;
      for (int s = 0; s < S; s++)
        if (seen[s]) keys[n++] = s;
      const char* qi = (const char*)q + ((int64_t)i * H + (int64_t)kh * G) * D * E;
      const char* kbase = (const char*)k + ((int64_t)row[i] * sb + (int64_t)kh * sh) * E;
      const char* vbase = (const char*)v + ((int64_t)row[i] * sb + (int64_t)kh * sh) * E;
      char* oi = (char*)out + ((int64_t)i * H + (int64_t)kh * G) * D * E;
      if (fast != NULL) {
        fast(scale, qi, kbase, vbase, ss, keys, n, sc, S, oi);
        continue;
      }
      for (int g = 0; g < G; g++) {
        const float* src = as_f32(qi + (int64_t)g * D * E, bf16, D, Dp, qb + (int64_t)g * Dp);
        if (src != qb + (int64_t)g * Dp) memcpy(qb + (int64_t)g * Dp, src, sizeof(float) * Dp);
      }
      for (int j = 0; j < n; j++) { /* scores: one dot product per (head, key) */
        const float* kr = as_f32(kbase + (int64_t)keys[j] * ss * E, bf16, D, Dp, kb);
        for (int g = 0; g < G; g++) {
          vf a = vzero();
          for (int c = 0; c < C; c++) a = vfma(vload(qb + (int64_t)g * Dp + c * VL), vload(kr + c * VL), a);
          sc[(int64_t)g * (S + VL) + j] = vsum(a) * scale;
        }
      }
      softmax_rows(sc, G, n, S);
      for (int x = 0; x < G * Dp; x++) ob[x] = 0.0f;
      for (int j = 0; j < n; j++) { /* outputs: the values summed in slot order */
        const float* vr = as_f32(vbase + (int64_t)keys[j] * ss * E, bf16, D, Dp, kb);
        for (int g = 0; g < G; g++) {
          const vf p = vset(sc[(int64_t)g * (S + VL) + j]);
          float* o = ob + (int64_t)g * Dp;
          for (int c = 0; c < C; c++) vstore(o + c * VL, vfma(p, vload(vr + c * VL), vload(o + c * VL)));
        }
      }
      for (int g = 0; g < G; g++) {
        if (bf16)
          for (int d = 0; d < D; d++) ((uint16_t*)oi)[(int64_t)g * D + d] = to_bf16(ob[(int64_t)g * Dp + d]);
        else
          memcpy(oi + (int64_t)g * D * E, ob + (int64_t)g * Dp, sizeof(float) * D);
      }
    }
    free(keys);
    free(sc);
    free(qb);
    free(kb);
    free(ob);
  }
}

/* MB rows x NB outputs of y = x @ w^T (fp32): every output is its own lane sum over K. */
#if VL == 16
#define GEMM_MB 3
#define GEMM_NB 8
#else
#define GEMM_MB 2
#define GEMM_NB 4
#endif
static inline __attribute__((always_inline)) void f32_tile(const int MB, const int NB, const float* x, int K,
                                                           const float* w, float* y, int N) {
  vf acc[GEMM_MB][GEMM_NB];
  for (int r = 0; r < MB; r++)
    for (int c = 0; c < NB; c++) acc[r][c] = vzero();
  const int K0 = K / VL * VL;
  for (int kk = 0; kk < K0; kk += VL) {
    vf xv[GEMM_MB];
    for (int r = 0; r < MB; r++) xv[r] = vload(x + (int64_t)r * K + kk);
    for (int c = 0; c < NB; c++) {
      vf wv = vload(w + (int64_t)c * K + kk);
      for (int r = 0; r < MB; r++) acc[r][c] = vfma(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < MB; r++)
    for (int c = 0; c < NB; c++) {
      float s = vsum(acc[r][c]);
      for (int kk = K0; kk < K; kk++) s = fmaf(x[(int64_t)r * K + kk], w[(int64_t)c * K + kk], s);
      y[(int64_t)r * N + c] = s;
    }
}

#define F32_TILE(MB, NB) static void f32_tile_##MB##_##NB(const float* x, int K, const float* w, float* y, int N) \
  { f32_tile(MB, NB, x, K, w, y, N); }
F32_TILE(1, 1) F32_TILE(2, 1)
typedef void (*f32_tile_fn)(const float*, int, const float*, float*, int);
#if GEMM_MB == 3
F32_TILE(3, 1) F32_TILE(1, 8) F32_TILE(2, 8) F32_TILE(3, 8)
static const f32_tile_fn F32_WIDE[4] = {0, f32_tile_1_8, f32_tile_2_8, f32_tile_3_8};
static const f32_tile_fn F32_ONE[4] = {0, f32_tile_1_1, f32_tile_2_1, f32_tile_3_1};
#else
F32_TILE(1, 4) F32_TILE(2, 4)
static const f32_tile_fn F32_WIDE[3] = {0, f32_tile_1_4, f32_tile_2_4};
static const f32_tile_fn F32_ONE[3] = {0, f32_tile_1_1, f32_tile_2_1};
#endif

/* y [M, N] = x [M, K] @ w [N, K]^T in fp32 (an nn.Linear's weight, read in place). A job owns
   GEMM_NB outputs and runs every row of x against them, so the weights are read once. */
void f32_gemm(const float* x, int M, int K, const float* w, int N, float* y, int threads) {
  const int blocks = (N + GEMM_NB - 1) / GEMM_NB;
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)N * K > 32768)
  for (int b = 0; b < blocks; b++) {
    const int n0 = b * GEMM_NB, nb = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
    for (int m0 = 0; m0 < M; m0 += GEMM_MB) {
      const int mb = M - m0 < GEMM_MB ? M - m0 : GEMM_MB;
      if (nb == GEMM_NB)
        F32_WIDE[mb](x + (int64_t)m0 * K, K, w + (int64_t)n0 * K, y + (int64_t)m0 * N + n0, N);
      else
        for (int c = 0; c < nb; c++)
          F32_ONE[mb](x + (int64_t)m0 * K, K, w + (int64_t)(n0 + c) * K, y + (int64_t)m0 * N + n0 + c, N);
    }
  }
}
