/* Group-wise int4 and Q8_0 x bf16 GEMMs and RMSNorm for AVX2 + FMA + F16C CPUs (no AVX512):
   the same entry points and weight layouts as int4_avx512_bf16.c (see cpu_int4.py), so one
   packed model runs on either library. Results agree with that library up to fp32 rounding.

   Without vdpbf16ps each weight is widened to fp32 and multiplied with fp32 FMAs, so on such a
   CPU the FMAs, not the widening, set the cost of each extra row. For 1-2 rows a job is a
   16-column half tile: 4 FMA chains per row (two column octets, k even and k odd) hide the FMA
   latency. For 3-5 rows a job is an 8-column octet, its weights widened once for up to 5 rows:
   2 chains per row, so every accumulator stays in a register (16-column tiles of 4 rows spilled
   them). For 6 and more rows a job is a 16-column panel over every row: each group's weights are
   widened once into an fp32 buffer and reused by all rows, 6 at a time (int4_panel). Each
   group's scale and zero are applied once per row. All shapes do the same arithmetic per output,
   so a row's result does not depend on the batch or the kernel chosen. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h"

/* Rows [0, MB <= 2) of x (fp32) times the 16 columns `half` (0 or 1) of one 32-column int4 tile.
   Per group, acc[r][0..1] (k even) and acc[r][2..3] (k odd) sum q x, each one FMA chain; the
   group's scale and zero are applied once: o += s (q . x) + z sum(x). Nibbles are widened
   from memory (vpmovzxbd) and split in 32-bit lanes (lo = v & 15, hi = v >> 4). */
static inline __attribute__((always_inline)) void int4_tile(
    const int MB, const float* x, int K, const float* xs, const uint8_t* wp, const uint16_t* sz, int G,
    int half, uint16_t* y, int ldy) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  __m256 o[2][2];
#pragma GCC unroll 2
  for (int r = 0; r < MB; r++) o[r][0] = o[r][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wp + (size_t)g * 512 + half * 16;
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int r = 0; r < MB; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < 16; p++) {
      __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gp + p * 32)));  /* columns 0-7 */
      __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gp + p * 32 + 8)));  /* 8-15 */
      __m256 l0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low4)), l1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low4));
      __m256 h0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), h1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
#pragma GCC unroll 4
      for (int r = 0; r < MB; r++) {
        const float* xr = x + (size_t)r * K + g * 32 + 2 * p;
        __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
        acc[r][0] = _mm256_fmadd_ps(l0, x0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(l1, x0, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(h0, x1, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(h1, x1, acc[r][3]);
      }
    }
    const uint16_t* sp = sz + (size_t)g * 64 + half * 16;
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sp));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 8)));
    const __m256 z0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 32)));
    const __m256 z1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 40)));
#pragma GCC unroll 4
    for (int r = 0; r < MB; r++) {
      __m256 xv = _mm256_broadcast_ss(xs + (size_t)r * G + g);
      o[r][0] = _mm256_fmadd_ps(s0, _mm256_add_ps(acc[r][0], acc[r][2]), _mm256_fmadd_ps(z0, xv, o[r][0]));
      o[r][1] = _mm256_fmadd_ps(s1, _mm256_add_ps(acc[r][1], acc[r][3]), _mm256_fmadd_ps(z1, xv, o[r][1]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MB; r++) {
    uint16_t* yr = y + (size_t)r * ldy + half * 16;
    store8(yr, o[r][0]);
    store8(yr + 8, o[r][1]);
  }
}

/* Rows [0, MB) of x times the 8 columns `oct` (0-3) of one 32-column int4 tile, for 3 and more
   rows: 2 FMA chains per row (k even, k odd), so up to 5 rows fit the 16 registers; the group's
   scale and zero go into o, in memory, once per group. Per column the same arithmetic as
   int4_tile: a row's result does not depend on which kernel or which rows ran beside it. */
static inline __attribute__((always_inline)) void int4_octet(
    const int MB, const float* x, int K, const float* xs, const uint8_t* wp, const uint16_t* sz, int G,
    int oct, uint16_t* y, int ldy) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  float o[5][8] __attribute__((aligned(32)));
  memset(o, 0, sizeof(o));
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wp + (size_t)g * 512 + oct * 8;
    __m256 acc[5][2];
#pragma GCC unroll 5
    for (int r = 0; r < MB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < 16; p++) {
      __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gp + p * 32)));
      __m256 l = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), h = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
#pragma GCC unroll 5
      for (int r = 0; r < MB; r++) {
        const float* xr = x + (size_t)r * K + g * 32 + 2 * p;
        acc[r][0] = _mm256_fmadd_ps(l, _mm256_broadcast_ss(xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(h, _mm256_broadcast_ss(xr + 1), acc[r][1]);
      }
    }
    const uint16_t* sp = sz + (size_t)g * 64 + oct * 8;
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sp));
    const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 32)));
#pragma GCC unroll 5
    for (int r = 0; r < MB; r++) {
      __m256 xv = _mm256_broadcast_ss(xs + (size_t)r * G + g);
      _mm256_store_ps(o[r], _mm256_fmadd_ps(s, _mm256_add_ps(acc[r][0], acc[r][1]), _mm256_fmadd_ps(z, xv, _mm256_load_ps(o[r]))));
    }
  }
#pragma GCC unroll 5
  for (int r = 0; r < MB; r++) store8(y + (size_t)r * ldy + oct * 8, _mm256_load_ps(o[r]));
}

/* The same for a Q8_0 tile (MB <= 2): k pair p's 64 bytes hold columns 0-15 then 16-31, each column's
   k = 2p, 2p + 1 side by side, so a half's 32 bytes widen to 4 vectors of (column, k) lanes
   [c 2p, c 2p+1, c+1 2p, ...], multiplied by [x 2p, x 2p+1] repeated. Per group o += d (q . x)
   with d in the same lanes; a column's two k lanes are added at the end. */
static inline __attribute__((always_inline)) void q8_tile(
    const int MB, const float* x, int K, const float* xs, const uint8_t* wq, const uint16_t* d, int G,
    int half, uint16_t* y, int ldy) {
  (void)xs;
  const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  __m256 o[2][4];
#pragma GCC unroll 2
  for (int r = 0; r < MB; r++) o[r][0] = o[r][1] = o[r][2] = o[r][3] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wq + (size_t)g * 1024 + half * 32;
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int r = 0; r < MB; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < 16; p++) {
      __m256 w[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++)
        w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(gp + p * 64 + 8 * j))));
#pragma GCC unroll 4
      for (int r = 0; r < MB; r++) {
        __m256 xv = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(x + (size_t)r * K + g * 32 + 2 * p)));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(w[j], xv, acc[r][j]);
      }
    }
    const uint16_t* dp = d + (size_t)g * 32 + half * 16;
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)dp));
    const __m256 d16 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dp + 8)));
    const __m256 dd[4] = {  /* each column's d twice, in the lanes' order */
        _mm256_permutevar8x32_ps(d8, dup), _mm256_permutevar8x32_ps(_mm256_permute2f128_ps(d8, d8, 0x11), dup),
        _mm256_permutevar8x32_ps(d16, dup), _mm256_permutevar8x32_ps(_mm256_permute2f128_ps(d16, d16, 0x11), dup)};
#pragma GCC unroll 4
    for (int r = 0; r < MB; r++)
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) o[r][j] = _mm256_fmadd_ps(dd[j], acc[r][j], o[r][j]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < MB; r++) {
    /* hadd adds lane pairs within 128-bit halves, [c0 c1 c4 c5 | c2 c3 c6 c7]: reorder */
    uint16_t* yr = y + (size_t)r * ldy + half * 16;
    __m256 c0 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(o[r][0], o[r][1])), 0xD8));
    __m256 c1 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(o[r][2], o[r][3])), 0xD8));
    store8(yr, c0);
    store8(yr + 8, c1);
  }
}

/* The same for 8 columns of a Q8_0 tile, 3-5 rows: octet `oct`'s (column, k) lanes are 16 bytes
   of each k pair's 64, widened to 2 vectors; per column the same arithmetic as q8_tile. */
static inline __attribute__((always_inline)) void q8_octet(
    const int MB, const float* x, int K, const float* xs, const uint8_t* wq, const uint16_t* d, int G,
    int oct, uint16_t* y, int ldy) {
  (void)xs;
  const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  float o[5][16] __attribute__((aligned(32)));
  memset(o, 0, sizeof(o));
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wq + (size_t)g * 1024 + oct * 16;
    __m256 acc[5][2];
#pragma GCC unroll 5
    for (int r = 0; r < MB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < 16; p++) {
      __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(gp + p * 64))));
      __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(gp + p * 64 + 8))));
#pragma GCC unroll 5
      for (int r = 0; r < MB; r++) {
        __m256 xv = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(x + (size_t)r * K + g * 32 + 2 * p)));
        acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
      }
    }
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + (size_t)g * 32 + oct * 8)));
    const __m256 dd0 = _mm256_permutevar8x32_ps(d8, dup);
    const __m256 dd1 = _mm256_permutevar8x32_ps(_mm256_permute2f128_ps(d8, d8, 0x11), dup);
#pragma GCC unroll 5
    for (int r = 0; r < MB; r++) {
      _mm256_store_ps(o[r], _mm256_fmadd_ps(dd0, acc[r][0], _mm256_load_ps(o[r])));
      _mm256_store_ps(o[r] + 8, _mm256_fmadd_ps(dd1, acc[r][1], _mm256_load_ps(o[r] + 8)));
    }
  }
#pragma GCC unroll 5
  for (int r = 0; r < MB; r++) {
    __m256 c = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_hadd_ps(_mm256_load_ps(o[r]), _mm256_load_ps(o[r] + 8))), 0xD8));
    store8(y + (size_t)r * ldy + oct * 8, c);
  }
}

/* Many rows (PANEL_ROWS and more: verify passes of 6 positions and more, busy batches, prefill
   chunks): one job is a 16-column half tile for every row. Per group its weights are widened
   to fp32 once, into w; then each block of up to 6 rows runs the k-even chains, parks them in
   e, and runs the k-odd chains: 12 accumulators and 2 weight vectors fill the registers, and
   each x broadcast feeds 2 FMAs (an octet's fed 1). Per output the same arithmetic as
   int4_tile and int4_octet. */
#define PANEL_ROWS 6
/* acc[r][0..1] = the FMA chains of rows [0, R) over one group's k = 2p + j, p = 0..15 */
static inline __attribute__((always_inline)) void panel_chains(
    const int R, const float* x, int K, int g, const float (*wj)[16], int j, __m256 acc[6][2]) {
#pragma GCC unroll 6
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int p = 0; p < 16; p++) {
    const __m256 w0 = _mm256_load_ps(wj[p]), w1 = _mm256_load_ps(wj[p] + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
      const __m256 xb = _mm256_broadcast_ss(x + (size_t)r * K + g * 32 + 2 * p + j);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
}

static inline __attribute__((always_inline)) void panel_block(
    const int R, const float* x, int K, const float* xs, int G, int g, const float (*w)[16][16],
    __m256 s0, __m256 s1, __m256 z0, __m256 z1, float* o) {
  __m256 even[6][2], odd[6][2];
  float e[6][16] __attribute__((aligned(32)));
  panel_chains(R, x, K, g, w[0], 0, even);  /* k even (low nibbles), parked in e */
#pragma GCC unroll 6
  for (int r = 0; r < R; r++) {
    _mm256_store_ps(e[r], even[r][0]);
    _mm256_store_ps(e[r] + 8, even[r][1]);
  }
  panel_chains(R, x, K, g, w[1], 1, odd);  /* k odd (high nibbles) */
#pragma GCC unroll 6
  for (int r = 0; r < R; r++) {
    const __m256 xv = _mm256_broadcast_ss(xs + (size_t)r * G + g);
    float* orow = o + (size_t)r * 16;
    _mm256_store_ps(orow, _mm256_fmadd_ps(s0, _mm256_add_ps(_mm256_load_ps(e[r]), odd[r][0]),
                                          _mm256_fmadd_ps(z0, xv, _mm256_load_ps(orow))));
    _mm256_store_ps(orow + 8, _mm256_fmadd_ps(s1, _mm256_add_ps(_mm256_load_ps(e[r] + 8), odd[r][1]),
                                              _mm256_fmadd_ps(z1, xv, _mm256_load_ps(orow + 8))));
  }
}

static void int4_panel(const float* x, int M, int K, const float* xs, const uint8_t* wp, const uint16_t* sz, int G,
                       int half, uint16_t* y, int ldy, float* o /* [M][16] scratch */) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  float w[2][16][16] __attribute__((aligned(32)));
  memset(o, 0, sizeof(float) * 16 * (size_t)M);
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wp + (size_t)g * 512 + half * 16;
    for (int p = 0; p < 16; p++)
      for (int c = 0; c < 16; c += 8) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gp + p * 32 + c)));
        _mm256_store_ps(w[0][p] + c, _mm256_cvtepi32_ps(_mm256_and_si256(v, low4)));
        _mm256_store_ps(w[1][p] + c, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
      }
    const uint16_t* sp = sz + (size_t)g * 64 + half * 16;
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sp));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 8)));
    const __m256 z0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 32)));
    const __m256 z1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 40)));
    const float(*wc)[16][16] = (const float(*)[16][16])w;
    int r = 0;
    for (; r + 6 <= M; r += 6)
      panel_block(6, x + (size_t)r * K, K, xs + (size_t)r * G, G, g, wc, s0, s1, z0, z1, o + (size_t)r * 16);
    switch (M - r) {  /* the last rows: the same arithmetic in a smaller block */
#define REST(R) \
  case R: panel_block(R, x + (size_t)r * K, K, xs + (size_t)r * G, G, g, wc, s0, s1, z0, z1, o + (size_t)r * 16); break;
      REST(1) REST(2) REST(3) REST(4) REST(5)
#undef REST
      default: break;
    }
  }
  for (int r = 0; r < M; r++) {
    uint16_t* yr = y + (size_t)r * ldy + half * 16;
    store8(yr, _mm256_load_ps(o + (size_t)r * 16));
    store8(yr + 8, _mm256_load_ps(o + (size_t)r * 16 + 8));
  }
}

typedef void (*tile_fn)(const float*, int, const float*, const uint8_t*, const uint16_t*, int, int, uint16_t*, int);
#define TILE(MB, NAME, BODY) static void NAME(const float* x, int K, const float* xs, const uint8_t* wp, \
    const uint16_t* sz, int G, int half, uint16_t* y, int ldy) { BODY(MB, x, K, xs, wp, sz, G, half, y, ldy); }
TILE(1, i4t1, int4_tile) TILE(2, i4t2, int4_tile) TILE(3, i4o3, int4_octet) TILE(4, i4o4, int4_octet)
TILE(5, i4o5, int4_octet)
TILE(1, q8t1, q8_tile) TILE(2, q8t2, q8_tile) TILE(3, q8o3, q8_octet) TILE(4, q8o4, q8_octet) TILE(5, q8o5, q8_octet)
/* by rows: 1-2 half tiles (the last argument is the half), 3-5 octets (the octet) */
static const tile_fn INT4_TILES[6] = {0, i4t1, i4t2, i4o3, i4o4, i4o5};
static const tile_fn Q8_TILES[6] = {0, q8t1, q8t2, q8o3, q8o4, q8o5};

/* x widened to fp32 once, then jobs of 16 columns (1-2 rows), 8 columns (3 and more rows, in
   blocks of 3-5: a job's weights come from memory for its first block of rows and from cache
   for the rest) or, for int4 from PANEL_ROWS rows, 16-column panels over every row; the threads
   split the columns evenly. xs: each row's group sums (int4's zeros), or NULL. */
static void run_tiles(const tile_fn* tiles, int q8, const uint16_t* x, int M, int K, float* xs, const uint8_t* wp,
                      const uint16_t* sz, int N, uint16_t* y, int threads) {
  if (M <= 0 || N <= 0) return; /* nothing to compute; the tile tables have no 0-row entry */
  const int G = K / 32, per_tile = M <= 2 ? 2 : 4, blocks = M <= 2 ? 1 : (M + 4) / 5;
  const size_t tile_bytes = (size_t)G * (q8 ? 1024 : 512), tile_scales = (size_t)G * (q8 ? 32 : 64);
  float* xf = malloc(sizeof(float) * (size_t)M * K);
  for (size_t i = 0; i < (size_t)M * K; i += 8) _mm256_storeu_ps(xf + i, load8(x + i));
  if (xs) /* a fixed tree per group, as in quantize_rows (a8_avx2.c), not 32 dependent adds */
    for (int i = 0; i < M * G; i++) {
      const float* g = xf + (size_t)i * 32;
      __m256 a = _mm256_add_ps(_mm256_loadu_ps(g), _mm256_loadu_ps(g + 8));
      xs[i] = hsum8(_mm256_add_ps(a, _mm256_add_ps(_mm256_loadu_ps(g + 16), _mm256_loadu_ps(g + 24))));
    }
  if (!q8 && M >= PANEL_ROWS) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int job = 0; job < N / 16; job++) {
      float* o = aligned_alloc(32, sizeof(float) * 16 * (size_t)M);
      int4_panel(xf, M, K, xs, wp + (size_t)(job / 2) * tile_bytes, sz + (size_t)(job / 2) * tile_scales, G, job % 2,
                 y + (job / 2) * 32, N, o);
      free(o);
    }
    free(xf);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int job = 0; job < N / 32 * per_tile; job++) {
    const int t = job / per_tile, part = job % per_tile;
    for (int b = 0, r0 = 0; b < blocks; b++) {
      const int rows = (M - r0) / (blocks - b);
      tiles[rows](xf + (size_t)r0 * K, K, xs ? xs + (size_t)r0 * G : 0, wp + t * tile_bytes, sz + t * tile_scales, G,
                  part, y + (size_t)r0 * N + t * 32, N);
      r0 += rows;
    }
  }
  free(xf);
}

/* y [M, N] bf16 = x [M, K] bf16 @ W.T; K % 32 == 0, N % 32 == 0; xs: M * K / 32 floats of scratch */
void int4_gemm(const uint16_t* x, int M, int K, const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y,
               float* xs, int threads) {
  run_tiles(INT4_TILES, 0, x, M, K, xs, wp, sz, N, y, threads);
}

/* The same for Q8_0 weights (q, d in the layout above). */
void q8_gemm(const uint16_t* x, int M, int K, const uint8_t* wq, const uint16_t* d, int N, uint16_t* y, int threads) {
  run_tiles(Q8_TILES, 1, x, M, K, 0, wq, d, N, y, threads);
}

/* RMSNorm of bf16 rows x [M, D] (D % 16 == 0) into y, each row alone, as rms_norm_bf16 of the
   AVX512 library: offset == 0 (Llama): y = bf16(bf16(h) * w); otherwise (Gemma):
   y = bf16(h * (offset + w)), h = x / sqrt(mean(x^2) + eps) in fp32. */
void rms_norm_bf16(const uint16_t* x, int M, int D, const uint16_t* w, float eps, float offset, uint16_t* y) {
  for (int m = 0; m < M; m++) {
    const uint16_t* xr = x + (size_t)m * D;
    uint16_t* yr = y + (size_t)m * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 16) {
      __m256 f0 = load8(xr + d), f1 = load8(xr + d + 8);
      a0 = _mm256_fmadd_ps(f0, f0, a0);
      a1 = _mm256_fmadd_ps(f1, f1, a1);
    }
    const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(_mm256_add_ps(a0, a1)) / (float)D + eps));
    const __m256 off = _mm256_set1_ps(offset);
    for (int d = 0; d < D; d += 8) {
      __m256 h = _mm256_mul_ps(load8(xr + d), r), wf = load8(w + d), out;
      if (offset == 0.0f) {
        __m256 hb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(h)), 16));
        out = _mm256_mul_ps(hb, wf);
      } else {
        out = _mm256_mul_ps(h, _mm256_add_ps(off, wf));
      }
      store8(yr + d, out);
    }
  }
}
