/* The block's layer pass, shared by block_bf16.c and block_avx2.c: each includes it after
   defining its own rms_norm_bf16, bf16_gemm, int4_gemm, rope_head, attend, add_into and
   silu_mul for its instruction set, and SCORE_PAD: the slack attend's score rows need. */
static void gemm(const QLinear* l, const uint16_t* x, int M, uint16_t* y, float* xs, int threads) {
  if (l->kind == LINEAR_BF16)
    bf16_gemm(x, M, l->k, (const uint16_t*)l->wp, l->n, y, threads);
  else if (l->kind == LINEAR_INT4_A8)
    int4_a8_gemm(x, M, l->k, l->wp, l->sz, l->n, y, threads);
  else
    int4_gemm(x, M, l->k, l->wp, l->sz, l->n, y, xs, threads);
}

/* x [M, hidden] bf16, the residual stream, is updated in place. kc / vc: this layer's K and V
   storage; token (row b, slot s) of kv head h lives at slot_map[b, s] * slot_stride + h * head_stride. */
void block_forward(uint16_t* x, const BlockWeights* w, const Pass* p, uint16_t* kc, uint16_t* vc) {
  const int M = p->M, Hd = w->hidden, H = w->heads, Hkv = w->kv_heads, D = w->head_dim, I = w->inter;
  const int Q = (H + 2 * Hkv) * D, widest = Q > 2 * I ? Q : 2 * I;
  uint16_t* h = malloc(sizeof(uint16_t) * (size_t)M * Hd);
  uint16_t* big = malloc(sizeof(uint16_t) * (size_t)M * widest); /* qkv, then gate|up */
  uint16_t* mid = malloc(sizeof(uint16_t) * (size_t)M * (H * D > I ? H * D : I)); /* attention, then act */
  uint16_t* out = malloc(sizeof(uint16_t) * (size_t)M * Hd);
  int kmax = Hd > H * D ? Hd : H * D;
  kmax = kmax > I ? kmax : I;
  float* xs = malloc(sizeof(float) * ((size_t)M * kmax / 32 + 1));

  /* attention: norm, qkv, RoPE, write K/V of every token before any token attends */
  rms_norm_bf16(x, M, Hd, w->attn_norm, w->eps, 0.0f, h);
  gemm(&w->qkv, h, M, big, xs, p->threads);
  for (int i = 0; i < M; i++) {
    uint16_t* r = big + (int64_t)i * Q;
    const float *c = p->cos + (int64_t)i * D / 2, *s = p->sin + (int64_t)i * D / 2;
    for (int hh = 0; hh < H + Hkv; hh++) rope_head(r + (int64_t)hh * D, c, s, D);
    int64_t at = p->slot_map[(int64_t)p->row[i] * p->map_stride + p->prefix[i] + p->t[i]] * p->slot_stride;
    for (int kh = 0; kh < Hkv; kh++) {
      memcpy(kc + at + kh * p->head_stride, r + (int64_t)(H + kh) * D, sizeof(uint16_t) * D);
      memcpy(vc + at + kh * p->head_stride, r + (int64_t)(H + Hkv + kh) * D, sizeof(uint16_t) * D);
    }
  }
  const int jobs = M * Hkv, G = H / Hkv, most = p->map_stride + p->T + SCORE_PAD;
  const int parallel = (int64_t)jobs * most * G * D > 200000;
#pragma omp parallel num_threads(p->threads) if (parallel)
  {
    int64_t* keys = malloc(sizeof(int64_t) * most);
    float* sc = malloc(sizeof(float) * (size_t)G * most);
#pragma omp for schedule(static)
    for (int job = 0; job < jobs; job++) {
      int i = job / Hkv, kh = job % Hkv;
      attend(w, p, i, kh, big + (int64_t)i * Q + (int64_t)kh * G * D, kc, vc, mid + (int64_t)i * H * D + (int64_t)kh * G * D,
             keys, sc);
    }
    free(keys);
    free(sc);
  }
  gemm(&w->o, mid, M, out, xs, p->threads);
  add_into(x, out, (int64_t)M * Hd);

  /* MLP: norm, gate|up, silu(gate) * up (each rounded to bf16, as torch's two ops), down */
  rms_norm_bf16(x, M, Hd, w->mlp_norm, w->eps, 0.0f, h);
  gemm(&w->gate_up, h, M, big, xs, p->threads);
#pragma omp parallel for schedule(static) num_threads(p->threads) if (M >= 4) /* a fork pays only over several rows */
  for (int i = 0; i < M; i++) silu_mul(big + (int64_t)i * 2 * I, mid + (int64_t)i * I, I);
  gemm(&w->down, mid, M, out, xs, p->threads);
  add_into(x, out, (int64_t)M * Hd);
  free(h);
  free(big);
  free(mid);
  free(out);
  free(xs);
}
