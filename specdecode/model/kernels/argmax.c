/* Greedy decoding's argmax over bf16 logits, in every build (AVX512BW or AVX2, by the build's flags).

   out[m] = the first index of row m's largest value, NaN counting as the largest and -0 equal to
   +0: what torch's x.float().max(dim=-1).indices returns on the same rows. Each bf16 is mapped to
   an unsigned 16-bit key in the same order, so two passes of integer compares find it: the
   largest key, then the first lane that holds it, reading the bf16 row as it is, where torch
   first converts the whole row to fp32 and then reduces it. */
#include <immintrin.h>
#include <stdint.h>

static inline uint16_t order_key(uint16_t h) {
  const uint16_t a = h & 0x7fffu;
  const uint16_t k = h ^ (uint16_t)((uint16_t)((int16_t)h >> 15) | 0x8000u); /* negatives reversed */
  return a > 0x7f80u ? 0xffffu : a == 0 ? 0x8000u : k;
}

#ifdef __AVX512BW__
enum { LANES = 32 };
typedef __m512i vec;
static inline vec keys(const uint16_t* p) {
  const vec h = _mm512_loadu_si512(p), a = _mm512_and_si512(h, _mm512_set1_epi16(0x7fff));
  vec k = _mm512_xor_si512(h, _mm512_or_si512(_mm512_srai_epi16(h, 15), _mm512_set1_epi16((short)0x8000)));
  k = _mm512_mask_mov_epi16(k, _mm512_cmpeq_epi16_mask(a, _mm512_setzero_si512()), _mm512_set1_epi16((short)0x8000));
  return _mm512_mask_mov_epi16(k, _mm512_cmpgt_epi16_mask(a, _mm512_set1_epi16(0x7f80)), _mm512_set1_epi16(-1));
}
static inline vec vmax(vec a, vec b) { return _mm512_max_epu16(a, b); }
static inline vec vzero(void) { return _mm512_setzero_si512(); }
static inline vec splat(uint16_t v) { return _mm512_set1_epi16((short)v); }
static inline void vstore(uint16_t* p, vec v) { _mm512_storeu_si512(p, v); }
static inline int first_equal(vec a, vec b) { /* the first lane where a == b, or -1 */
  const __mmask32 hit = _mm512_cmpeq_epi16_mask(a, b);
  return hit ? __builtin_ctz(hit) : -1;
}
#else
enum { LANES = 16 };
typedef __m256i vec;
static inline vec keys(const uint16_t* p) {
  const vec h = _mm256_loadu_si256((const __m256i*)p), a = _mm256_and_si256(h, _mm256_set1_epi16(0x7fff));
  vec k = _mm256_xor_si256(h, _mm256_or_si256(_mm256_srai_epi16(h, 15), _mm256_set1_epi16((short)0x8000)));
  k = _mm256_blendv_epi8(k, _mm256_set1_epi16((short)0x8000), _mm256_cmpeq_epi16(a, _mm256_setzero_si256()));
  return _mm256_blendv_epi8(k, _mm256_set1_epi16(-1), _mm256_cmpgt_epi16(a, _mm256_set1_epi16(0x7f80)));
}
static inline vec vmax(vec a, vec b) { return _mm256_max_epu16(a, b); }
static inline vec vzero(void) { return _mm256_setzero_si256(); }
static inline vec splat(uint16_t v) { return _mm256_set1_epi16((short)v); }
static inline void vstore(uint16_t* p, vec v) { _mm256_storeu_si256((__m256i*)p, v); }
static inline int first_equal(vec a, vec b) {
  const unsigned hit = (unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b)); /* two bits a lane */
  return hit ? __builtin_ctz(hit) / 2 : -1;
}
#endif

void argmax_bf16(const uint16_t* x, int M, int V, int64_t* out) {
  const int body = V - V % LANES;
  for (int m = 0; m < M; m++) {
    const uint16_t* r = x + (int64_t)m * V;
    vec most = vzero();
    for (int i = 0; i < body; i += LANES) most = vmax(most, keys(r + i));
    uint16_t lanes[LANES], best = 0;
    vstore(lanes, most);
    for (int j = 0; j < LANES; j++) best = lanes[j] > best ? lanes[j] : best;
    for (int i = body; i < V; i++) best = order_key(r[i]) > best ? order_key(r[i]) : best;
    int64_t at = -1;
    const vec b = splat(best);
    for (int i = 0; i < body && at < 0; i += LANES) {
      const int j = first_equal(keys(r + i), b);
      if (j >= 0) at = i + j;
    }
    for (int i = body; i < V && at < 0; i++)
      if (order_key(r[i]) == best) at = i;
    out[m] = at;
  }
}
