/* Group-wise int4 x bf16 GEMM for AVX512-BF16 CPUs; see specdecode/model/cpu_int4.py for the layout. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Int4 layout (see cpu_int4.py): a group of 32 inputs x 32 columns is 512 bytes, k pair p's
   32 bytes holding q[k] | q[k+1] << 4; scales_and_zeros [N/32, G, 2, 32] fp16 (w = s q + z).
   GGUF Q8_0 kept as it is (w = d q, q int8): a group is 1024 bytes, k pair p's 64 bytes
   holding 32 columns in the order of two bf16 vectors (column c's k = 2p, 2p + 1 side by
   side, columns 0-15 then 16-31); d [N/32, G, 32] fp16. 1.06 bytes a weight, against 1.25
   for Q8_0 as two int4 planes. Both convert weights to bf16 exactly in registers. */
static inline __attribute__((always_inline)) __m512bh int4_to_bf16(__m512i v) {
  const __m512i mask = _mm512_set1_epi32(0x000F000F);
  const __m512i lut = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
      0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);  /* bf16(15) ... bf16(0) */
  /* (v | v << 12) & 0x000F000F: lo nibble in the low word, hi nibble in the high word */
  v = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), mask, 0xA8);
  return (__m512bh)_mm512_permutexvar_epi16(v, lut);
}

static inline __attribute__((always_inline)) __m512bh q8_to_bf16(const uint8_t* p) {
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  /* elements 0-15 from lo, 16-31 from hi */
}

/* k pair p of a group's weights (at gp) as bf16: columns 0-15 into w[0], 16-31 into w[1]. */
static inline __attribute__((always_inline)) void decode_pair(const int Q8, const uint8_t* gp, int p, __m512bh* w0,
                                                              __m512bh* w1) {
  if (Q8) {
    *w0 = q8_to_bf16(gp + p * 64);
    *w1 = q8_to_bf16(gp + p * 64 + 32);
  } else {
    __m256i b = _mm256_loadu_si256((const __m256i*)(gp + p * 32));
    *w0 = int4_to_bf16(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b)));
    *w1 = int4_to_bf16(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1)));
  }
}

static inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* o[r] += group g's products acc[r] (fp32, 32 columns) times its scales (sp), plus, for int4,
   its zeros times the row's input sum xs[r * G + g]. */
static inline __attribute__((always_inline)) void add_group(const int MB, const int Q8, const uint16_t* sp,
                                                            const float* xs, int G, int g, const __m512 (*acc)[2],
                                                            __m512 (*o)[2]) {
  __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sp));
  __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 16)));
  if (Q8) {
#pragma GCC unroll 16
    for (int r = 0; r < MB; r++) {
      o[r][0] = _mm512_fmadd_ps(s0, acc[r][0], o[r][0]);
      o[r][1] = _mm512_fmadd_ps(s1, acc[r][1], o[r][1]);
    }
  } else {
    __m512 z0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 32)));
    __m512 z1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 48)));
#pragma GCC unroll 16
    for (int r = 0; r < MB; r++) {
      __m512 xv = _mm512_set1_ps(xs[r * G + g]);
      o[r][0] = _mm512_fmadd_ps(s0, acc[r][0], _mm512_fmadd_ps(z0, xv, o[r][0]));
      o[r][1] = _mm512_fmadd_ps(s1, acc[r][1], _mm512_fmadd_ps(z1, xv, o[r][1]));
    }
  }
}

/* Rows [0, MB) of 32 outputs, rounded to bf16. */
static inline __attribute__((always_inline)) void store_rows(const int MB, __m512 (*o)[2], uint16_t* y, int ldy) {
#pragma GCC unroll 16
  for (int r = 0; r < MB; r++) {
    _mm256_storeu_si256((__m256i*)(y + (size_t)r * ldy), (__m256i)_mm512_cvtneps_pbh(o[r][0]));
    _mm256_storeu_si256((__m256i*)(y + (size_t)r * ldy + 16), (__m256i)_mm512_cvtneps_pbh(o[r][1]));
  }
}

#ifndef __AMX_BF16__
/* Rows [0, MB) of x times one 32-column tile; Q8 (a constant in each instance) picks the layout. */
static inline __attribute__((always_inline)) void tile(
    const int MB, const int Q8, const uint16_t* x, int K, const float* xs, const uint8_t* wp,
    const uint16_t* sz, int G, uint16_t* y, int ldy) {
  const int group_bytes = Q8 ? 1024 : 512;
  __m512 o[8][2];
#pragma GCC unroll 8
  for (int r = 0; r < MB; r++) o[r][0] = o[r][1] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < MB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint8_t* gp = wp + (size_t)g * group_bytes;
#pragma GCC unroll 16
    for (int i = 0; i < group_bytes / 64; i++) _mm_prefetch((const char*)(gp + 2048 + 64 * i), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int p = 0; p < 16; p++) {
      __m512bh w0, w1;
      decode_pair(Q8, gp, p, &w0, &w1);
#pragma GCC unroll 8
      for (int r = 0; r < MB; r++) {
        uint32_t pair;
        memcpy(&pair, x + (size_t)r * K + g * 32 + 2 * p, 4);
        __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      }
    }
    add_group(MB, Q8, sz + (size_t)g * (Q8 ? 32 : 64), xs, G, g, (const __m512(*)[2])acc, o);
  }
  store_rows(MB, o, y, ldy);
}
#endif

#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
/* The AMX build ("amx" in cpu_int4.py): the same layouts and arithmetic, but a group's 16 k
   pairs are multiplied by up to 16 rows in two tile instructions (one per 16 columns) instead
   of 2 vdpbf16ps per row and pair, so a verify pass of several positions costs about what one
   does. The weights are decoded to bf16 into a 2 KB buffer per group, two alternating (a
   tile's rows are the k pairs in the vdpbf16ps order); each group's products come back in
   fp32 and get the group's scale and zero as above. Every row count runs here, 1 included: the tile unit adds a group's
   pairs in another order than vdpbf16ps (a last-bit difference in ~0.1% of sums), so a
   build that switched units by row count would make a row's logits depend on its batch. */
#define ROW_BLOCK 16
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

static int amx_granted;
/* Linux lets a process use the tile registers only after asking (ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); without it the first tile instruction is SIGILL. Asked at load. */
__attribute__((constructor)) static void request_amx(void) {
  amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
int amx_available(void) { return amx_granted; }

/* tmm0 / tmm1: the products of MB rows and columns 0-15 / 16-31; tmm2: MB rows of one group
   of x; tmm3 / tmm4: the group's decoded weights for the two column halves. Loaded by each
   thread at the start of every call (another library, oneDNN, may configure this thread's
   tiles between our calls) and again only where a job's row count differs from its last. */
static void tile_config(int MB) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 5; t++) c.colsb[t] = 64;
  c.rows[0] = c.rows[1] = c.rows[2] = MB;
  c.rows[3] = c.rows[4] = 16;
  _tile_loadconfig(&c);
}

static inline __attribute__((always_inline)) void tile(
    const int MB, const int Q8, const uint16_t* x, int K, const float* xs, const uint8_t* wp,
    const uint16_t* sz, int G, uint16_t* y, int ldy) {
  const int group_bytes = Q8 ? 1024 : 512;
  __m512bh wb[2][2][16];  /* [group parity][column half][k pair]: the next group decodes into the other */
  float c[16][32] __attribute__((aligned(64)));
  __m512 o[16][2];
#pragma GCC unroll 16
  for (int r = 0; r < MB; r++) o[r][0] = o[r][1] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* gp = wp + (size_t)g * group_bytes;
    __m512bh(*w)[16] = wb[g & 1];
#pragma GCC unroll 16
    for (int i = 0; i < group_bytes / 64; i++) _mm_prefetch((const char*)(gp + 2048 + 64 * i), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int p = 0; p < 16; p++) {
      decode_pair(Q8, gp, p, &w[0][p], &w[1][p]);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, x + g * 32, K * 2);
    _tile_loadd(3, w[0], 64);
    _tile_loadd(4, w[1], 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
    _tile_stored(0, c, 128);
    _tile_stored(1, &c[0][16], 128);
    add_group(MB, Q8, sz + (size_t)g * (Q8 ? 32 : 64), xs, G, g, (const __m512(*)[2])c, o);  /* c's rows: 2 vectors */
  }
  store_rows(MB, o, y, ldy);
}
#else
#define ROW_BLOCK 8
int amx_available(void) { return 0; }
#endif

typedef void (*tile_fn)(const uint16_t*, int, const float*, const uint8_t*, const uint16_t*, int, uint16_t*, int);
#define TILE(MB, Q8, NAME) static void NAME(const uint16_t* x, int K, const float* xs, const uint8_t* wp, \
    const uint16_t* sz, int G, uint16_t* y, int ldy) { tile(MB, Q8, x, K, xs, wp, sz, G, y, ldy); }
TILE(1, 0, i4t1) TILE(2, 0, i4t2) TILE(3, 0, i4t3) TILE(4, 0, i4t4)
TILE(5, 0, i4t5) TILE(6, 0, i4t6) TILE(7, 0, i4t7) TILE(8, 0, i4t8)
TILE(1, 1, q8t1) TILE(2, 1, q8t2) TILE(3, 1, q8t3) TILE(4, 1, q8t4)
TILE(5, 1, q8t5) TILE(6, 1, q8t6) TILE(7, 1, q8t7) TILE(8, 1, q8t8)
#if ROW_BLOCK == 16
TILE(9, 0, i4t9) TILE(10, 0, i4t10) TILE(11, 0, i4t11) TILE(12, 0, i4t12)
TILE(13, 0, i4t13) TILE(14, 0, i4t14) TILE(15, 0, i4t15) TILE(16, 0, i4t16)
TILE(9, 1, q8t9) TILE(10, 1, q8t10) TILE(11, 1, q8t11) TILE(12, 1, q8t12)
TILE(13, 1, q8t13) TILE(14, 1, q8t14) TILE(15, 1, q8t15) TILE(16, 1, q8t16)
static const tile_fn INT4_TILES[17] = {0, i4t1, i4t2, i4t3, i4t4, i4t5, i4t6, i4t7, i4t8,
                                       i4t9, i4t10, i4t11, i4t12, i4t13, i4t14, i4t15, i4t16};
static const tile_fn Q8_TILES[17] = {0, q8t1, q8t2, q8t3, q8t4, q8t5, q8t6, q8t7, q8t8,
                                     q8t9, q8t10, q8t11, q8t12, q8t13, q8t14, q8t15, q8t16};
#else
static const tile_fn INT4_TILES[9] = {0, i4t1, i4t2, i4t3, i4t4, i4t5, i4t6, i4t7, i4t8};
static const tile_fn Q8_TILES[9] = {0, q8t1, q8t2, q8t3, q8t4, q8t5, q8t6, q8t7, q8t8};
#endif

/* A job is one 32-column tile and one block of ROW_BLOCK rows, the row blocks of a tile consecutive:
   a thread decodes a tile's weights from memory for its first row block and finds them in
   cache for the next, and every thread gets an equal share of the columns. (Row blocks
   outermost would give one thread all of 8 rows and another the rest, each streaming every
   weight, so a ninth position would cost nearly a second pass.) Each row's result is the same
   whatever the order. */
static void run_tiles(const tile_fn* tiles, int Q8, const uint16_t* x, int M, int K, const float* xs,
                      const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y, int threads) {
  const int G = K / 32, NT = N / 32, MBN = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  const size_t tile_bytes = (size_t)G * (Q8 ? 1024 : 512), tile_scales = (size_t)G * (Q8 ? 32 : 64);
#pragma omp parallel num_threads(threads)
  {
    int rows = 0; /* the row count this thread's tiles are configured for (AMX) */
#pragma omp for schedule(static)
    for (int job = 0; job < NT * MBN; job++) {
      int t = job / MBN, r0 = job % MBN * ROW_BLOCK, mbs = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
#ifdef __AMX_BF16__
      if (mbs != rows) tile_config(mbs);
#endif
      rows = mbs;
      tiles[mbs](x + (size_t)r0 * K, K, xs ? xs + r0 * G : 0, wp + t * tile_bytes, sz + t * tile_scales, G,
                 y + (size_t)r0 * N + t * 32, N);
    }
#ifdef __AMX_BF16__
    if (rows) _tile_release();
#endif
    (void)rows;
  }
}

/* y [M, N] bf16 = x [M, K] bf16 @ W.T; K % 32 == 0, N % 32 == 0; xs: M * K / 32 floats of scratch */
void int4_gemm(const uint16_t* x, int M, int K, const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y,
               float* xs, int threads) {
  /* each group's input sum, for the zeros: two 16-lane halves added, then one fixed reduction
     tree (a row's sums do not depend on M; 32 dependent scalar adds a group would be a visible share of a pass) */
  for (int i = 0; i < M * (K / 32); i++)
    xs[i] = _mm512_reduce_add_ps(_mm512_add_ps(load_bf16x16(x + (size_t)i * 32), load_bf16x16(x + (size_t)i * 32 + 16)));
  run_tiles(INT4_TILES, 0, x, M, K, xs, wp, sz, N, y, threads);
}

/* The same for Q8_0 weights (q, d in the layout above). */
void q8_gemm(const uint16_t* x, int M, int K, const uint8_t* wq, const uint16_t* d, int N, uint16_t* y, int threads) {
  run_tiles(Q8_TILES, 1, x, M, K, 0, wq, d, N, y, threads);
}

/* RMSNorm of bf16 rows x [M, D] (D % 16 == 0) into y, each row alone (so a row's result does
   not depend on the batch): h = x / sqrt(mean(x^2) + eps) in fp32; offset == 0 (Llama):
   y = bf16(bf16(h) * w); otherwise (Gemma): y = bf16(h * (offset + w)). Rounding is to nearest
   even, as torch's. One call instead of the ~8 dispatched ops of F.rms_norm on bf16, each a
   dispatch per layer in a decode step; the sum of squares runs in 16 fp32 lanes, so a row can
   differ from F.rms_norm by one bf16 ulp, never between batches. */
void rms_norm_bf16(const uint16_t* x, int M, int D, const uint16_t* w, float eps, float offset, uint16_t* y) {
  for (int m = 0; m < M; m++) {
    const uint16_t* xr = x + (size_t)m * D;
    uint16_t* yr = y + (size_t)m * D;
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
      __m512 f = load_bf16x16(xr + d);
      acc = _mm512_fmadd_ps(f, f, acc);
    }
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)D + eps));
    __m512 off = _mm512_set1_ps(offset);
    for (int d = 0; d < D; d += 16) {
      __m512 h = _mm512_mul_ps(load_bf16x16(xr + d), r), wf = load_bf16x16(w + d), out;
      if (offset == 0.0f) {
        __m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(h)), 16));
        out = _mm512_mul_ps(hb, wf);
      } else {
        out = _mm512_mul_ps(h, _mm512_add_ps(off, wf));
      }
      _mm256_storeu_si256((__m256i*)(yr + d), (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}
