// orbitctl's CPU kernels for AVX512-BF16: the INT4 matmul, its dequantizer, and the one-position decode attention.
//
// y = x W^T for bf16 activations x [M, K] and a symmetric group-INT4 weight W [N, K] whose every value is exactly a
// bf16 number (scales of at most 5 significant bits): the products are exact in float32, accumulated in float32
// (AVX512-BF16 dot products, vdpbf16ps), the result rounded once to bf16.
//
// Layout (orbitctl.kernels.bf16_cpu.pack): codes unsigned (code + 8), per output row n, K/32 chunks of 16 bytes;
// byte j of chunk c holds the code of k = 32c + j in its low nibble and of k = 32c + 16 + j in its high nibble.
// scales: float32 [N, K/G]; G a multiple of 32.
//
// Per block of NR output rows, the weight is dequantized once into a bf16 buffer (a 16-entry table per group,
// looked up with vpermw), then every row of x is run against it, MR rows at a time. Each output is a lane-wise
// float32 sum over K in chunk order followed by one horizontal sum: it depends only on its own row of x, whatever
// M is (a decode step and a batch compute the same numbers).
//
// Built at first use by orbitctl.kernels.bf16_cpu (g++ -O3 -fopenmp); the functions carry their own target
// attributes, so the library loads on any x86-64 CPU and is only called where the CPU has AVX512-BF16.

#include <immintrin.h>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>

#define ORBITCTL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

namespace {

constexpr int NR = 4;  // output rows of W per block
constexpr int MR = 4;  // rows of x per register tile

ORBITCTL_TARGET inline __m512i group_table(float scale) {
  // (code - 8) * scale for code 0..15 as bf16 in words 0..15; exact, so rounding does not change it
  const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m256bh table = _mm512_cvtneps_pbh(_mm512_mul_ps(codes, _mm512_set1_ps(scale)));
  return _mm512_castsi256_si512((__m256i)table);
}

ORBITCTL_TARGET inline __m512i dequantize_chunk(const uint8_t* bytes, __m512i table) {
  // 16 bytes -> their low nibbles (k = 32c..32c+15) then their high ones (32c+16..32c+31), widened to words, looked up
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo)), table);
}

template <int R>
ORBITCTL_TARGET inline void tile(const uint16_t* x, int64_t K, const __m512i* w, int64_t chunks, float* sums) {
  // sums[i * NR + j] = x[i, :] . w[j, :] for R rows of x against the block's NR dequantized rows
  __m512 acc[R][NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_si512(x + i * K + c * 32);
    for (int j = 0; j < NR; ++j) {
      __m512i wv = _mm512_load_si512(w + j * chunks + c);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv[i], (__m512bh)wv);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) sums[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}

inline uint16_t round_to_bf16(float f) {  // to nearest, ties to even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

ORBITCTL_TARGET void blocks(const uint16_t* x, const uint8_t* packed, const float* scales, uint16_t* out, int64_t M,
                            int64_t N, int64_t K, int64_t G, int64_t first, int64_t last, __m512i* w) {
  const int64_t chunks = K / 32, groups = K / G, per_group = G / 32;
  float sums[MR * NR];
  for (int64_t b = first; b < last; ++b) {
    const int64_t n0 = b * NR;
    for (int j = 0; j < NR; ++j) {
      const uint8_t* row = packed + (n0 + j) * (K / 2);
      const float* scale = scales + (n0 + j) * groups;
      for (int64_t g = 0; g < groups; ++g) {
        const __m512i table = group_table(scale[g]);
        for (int64_t q = 0; q < per_group; ++q) {
          const int64_t c = g * per_group + q;
          w[j * chunks + c] = dequantize_chunk(row + c * 16, table);
        }
      }
    }
    for (int64_t m0 = 0; m0 < M;) {
      const int rows = M - m0 >= MR ? MR : 1;
      if (rows == MR) tile<MR>(x + m0 * K, K, w, chunks, sums);
      else tile<1>(x + m0 * K, K, w, chunks, sums);
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < NR; ++j) out[(m0 + i) * N + n0 + j] = round_to_bf16(sums[i * NR + j]);
      m0 += rows;
    }
  }
}

ORBITCTL_TARGET void dequantize_rows(const uint8_t* packed, const float* scales, uint16_t* out, int64_t K,
                                     int64_t G, int64_t first, int64_t last) {
  // the chunk's words come out in k order (low nibbles: k = 32c..32c+15, high: 32c+16..32c+31)
  const int64_t groups = K / G, per_group = G / 32;
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* row = packed + n * (K / 2);
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i table = group_table(scales[n * groups + g]);
      for (int64_t q = 0; q < per_group; ++q) {
        const int64_t c = g * per_group + q;
        _mm512_storeu_si512(out + n * K + c * 32, dequantize_chunk(row + c * 16, table));
      }
    }
  }
}


ORBITCTL_TARGET inline __m512 exp_ps(__m512 x) {
  // e^x for x <= 0 (scores less their maximum): 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2, Cephes' expf polynomial;
  // below -87.3 (and -inf, a masked position) exactly 0
  const __m512 tiny = _mm512_set1_ps(-87.3f);
  __mmask16 zero = _mm512_cmp_ps_mask(x, tiny, _CMP_LT_OQ);
  x = _mm512_max_ps(x, tiny);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(~zero, _mm512_scalef_ps(p, n));
}

ORBITCTL_TARGET inline __m512 bf16_to_ps(const uint16_t* p) {  // 16 bf16 -> 16 float32 (exact)
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

ORBITCTL_TARGET inline float round_bf16_value(float f) {  // f rounded to bf16, as a float
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// one query row (b, h): float32 scores q.k x scaling + mask, softmax in float32 with the exponentials rounded to bf16
// for the product with V, float32 accumulation, divided by the float32 total, rounded once to bf16
ORBITCTL_TARGET void attend_row(const uint16_t* q, const uint16_t* k, int64_t k_st, const uint16_t* v, int64_t v_st,
                                const float* mask, uint16_t* out, int64_t T, int64_t D, int64_t Dv, float scaling,
                                float* scores) {
  float top = -INFINITY;
  for (int64_t t = 0; t < T; ++t) {
    __m512 acc = _mm512_setzero_ps();
    const uint16_t* kt = k + t * k_st;
    for (int64_t d = 0; d < D; d += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(kt + d));
    float s = _mm512_reduce_add_ps(acc) * scaling;
    if (mask) s += mask[t];
    scores[t] = s;
    top = s > top ? s : top;
  }
  if (!(top > -INFINITY)) top = 0.0f;  // every position masked: zeros out
  const __m512 topv = _mm512_set1_ps(top);
  float total = 0.0f;
  int64_t t = 0;
  for (; t + 16 <= T; t += 16) {
    __m512 w = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + t), topv));
    _mm512_storeu_ps(scores + t, w);
  }
  if (t < T) {
    __mmask16 m = (__mmask16)((1u << (T - t)) - 1);
    __m512 w = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), topv));
    _mm512_mask_storeu_ps(scores + t, m, w);
  }
  for (t = 0; t < T; ++t) total += scores[t];
  if (total < 1.17549435e-38f) total = 1.17549435e-38f;
  __m512 o[8];  // Dv <= 128, 16 lanes each
  const int64_t lanes = Dv / 16;
  for (int64_t j = 0; j < lanes; ++j) o[j] = _mm512_setzero_ps();
  for (t = 0; t < T; ++t) {
    const __m512 w = _mm512_set1_ps(round_bf16_value(scores[t]));
    const uint16_t* vt = v + t * v_st;
    for (int64_t j = 0; j < lanes; ++j) o[j] = _mm512_fmadd_ps(w, bf16_to_ps(vt + 16 * j), o[j]);
  }
  const __m512 inv = _mm512_set1_ps(total);
  for (int64_t j = 0; j < lanes; ++j) {
    __m512 r = _mm512_div_ps(o[j], inv);
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, r);
    for (int i = 0; i < 16; ++i) out[16 * j + i] = round_to_bf16(tmp[i]);
  }
}

}  // namespace

extern "C" {

// W as dense bf16 [N, K] (every value exact); 1 for a shape the layout does not take
int orbitctl_int4_bf16_dequantize(const uint8_t* packed, const float* scales, uint16_t* out, int64_t N, int64_t K,
                                  int64_t G) {
  if (K % 32 || G % 32 || K % G) return 1;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) dequantize_rows(packed, scales, out, K, G, n, n + 1);
  return 0;
}

// 0 on success; 1 for a shape the layout does not take (N % 4, K % 32, G % 32 or K % G nonzero)
int orbitctl_int4_bf16_mm(const uint16_t* x, const uint8_t* packed, const float* scales, uint16_t* out, int64_t M,
                          int64_t N, int64_t K, int64_t G) {
  if (N % NR || K % 32 || G % 32 || K % G) return 1;
  const int64_t n_blocks = N / NR;
#pragma omp parallel
  {
    __m512i* w = static_cast<__m512i*>(std::aligned_alloc(64, NR * (K / 32) * sizeof(__m512i)));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) blocks(x, packed, scales, out, M, N, K, G, b, b + 1, w);
    std::free(w);
  }
  return 0;
}

// Attention of one query position per (batch row, head): q [B, H, D] (strides q_sb, q_sh), k [B, Hkv, T, D] and
// v [B, Hkv, T, Dv] (strides *_sb, *_sh, *_st; the last dimension contiguous), mask float32 additive [B, T] (stride
// mask_sb) or null, out [B, H, Dv] contiguous. 1 for a shape it does not take (D % 32, Dv % 16, Dv > 128, H % Hkv).
int orbitctl_decode_attention(const uint16_t* q, int64_t q_sb, int64_t q_sh, const uint16_t* k, int64_t k_sb,
                              int64_t k_sh, int64_t k_st, const uint16_t* v, int64_t v_sb, int64_t v_sh, int64_t v_st,
                              const float* mask, int64_t mask_sb, uint16_t* out, int64_t B, int64_t H, int64_t Hkv,
                              int64_t T, int64_t D, int64_t Dv, float scaling) {
  if (D % 32 || Dv % 16 || Dv > 128 || H % Hkv) return 1;
  const int64_t groups = H / Hkv;
#pragma omp parallel
  {
    float* scores = static_cast<float*>(std::malloc(sizeof(float) * (T + 16)));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < B * H; ++row) {
      const int64_t b = row / H, h = row % H, g = h / groups;
      attend_row(q + b * q_sb + h * q_sh, k + b * k_sb + g * k_sh, k_st, v + b * v_sb + g * v_sh, v_st,
                 mask ? mask + b * mask_sb : nullptr, out + row * Dv, T, D, Dv, scaling, scores);
    }
    std::free(scores);
  }
  return 0;
}

}
