/* The fused block's arguments, shared by block_bf16.c (AVX512-BF16) and block_avx2.c (AVX2);
   mirrored by the ctypes structs in specdecode/model/cpu_block.py. */
#ifndef SPECDECODE_BLOCK_H
#define SPECDECODE_BLOCK_H
#include <stdint.h>
#include <string.h>

typedef struct {
  const uint8_t* wp; /* int4: packed nibbles (see cpu_int4.py); bf16: the weight [n, k], row-major */
  const uint16_t* sz; /* int4: fp16 scales and zeros; bf16: unused */
  int n, k;           /* out and in features (multiples of 32) */
  int kind;           /* LINEAR_INT4 (int4_gemm), LINEAR_BF16 (bf16_gemm) or LINEAR_INT4_A8 (int4_a8_gemm) */
} QLinear;
enum { LINEAR_INT4 = 0, LINEAR_BF16 = 1, LINEAR_INT4_A8 = 2 };

typedef struct {
  int hidden, heads, kv_heads, head_dim, inter;
  float eps, scale;
  const uint16_t* attn_norm; /* [hidden] bf16 */
  const uint16_t* mlp_norm;
  QLinear qkv, o, gate_up, down;
} BlockWeights;

typedef struct {
  int M, T;                    /* tokens computed (a packed pass: the real ones only), pass width */
  const int32_t* row;          /* [M] batch row of each token */
  const int32_t* t;            /* [M] its index in the row's pass, 0..T-1 */
  const int32_t* prefix;       /* [M] the row's cached length: it sees slots 0..prefix-1 */
  const uint8_t* vis;          /* [M, T] which of the row's pass tokens it sees (itself included) */
  const float* cos;            /* [M, D/2] RoPE, scale included */
  const float* sin;
  const int64_t* slot_map;     /* [B, map_stride] storage index of (row, slot) */
  int map_stride;
  int64_t slot_stride, head_stride; /* elements between storage indices / kv heads */
  int threads;
} Pass;

void int4_gemm(const uint16_t* x, int M, int K, const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y,
               float* xs, int threads);
void int4_a8_gemm(const uint16_t* x, int M, int K, const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y,
                  int threads);
void rms_norm_bf16(const uint16_t* x, int M, int D, const uint16_t* w, float eps, float offset, uint16_t* y);

/* The storage indices of the keys token i sees, in slot order: its row's cached prefix,
   then the tokens of its pass it sees (itself included). Returns how many. */
static inline int visible_keys(const Pass* p, int i, int64_t* keys) {
  const int P = p->prefix[i], T = p->T;
  const int64_t* map = p->slot_map + (int64_t)p->row[i] * p->map_stride;
  int n = 0;
  for (int j = 0; j < P; j++) keys[n++] = map[j];
  for (int u = 0; u < T; u++)
    if (p->vis[(int64_t)i * T + u]) keys[n++] = map[P + u];
  return n;
}

/* Scalar bf16 conversions, rounding to nearest even as torch. */
static inline float round_bf16(float f) { /* f rounded to bf16, as a float */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t to_bf16(float f) {
  float r = round_bf16(f);
  uint32_t u;
  memcpy(&u, &r, 4);
  return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#endif
