/* Shared by block_bf16.c and invariant.c (AVX512 builds). */
#ifndef SPECDECODE_SUM16_H
#define SPECDECODE_SUM16_H
#include <immintrin.h>

/* r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: one shuffle-add tree instead of
   16 horizontal reductions (~8 dependent ops each). Each vector's lanes are added in the same
   order wherever it sits among the 16, so a key's score does not depend on its neighbours. */
static inline __m512 sum16x16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) /* per 128-bit lane: that lane's sums of v[4i .. 4i+3] */
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif
