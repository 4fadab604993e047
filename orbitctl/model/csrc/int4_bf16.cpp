// y = x W^T for bf16 activations x [M, K] and a symmetric group-INT4 weight W [N, K] whose every value is exactly a
// bf16 number (scales of at most 5 significant bits): the products are exact in float32, accumulated in float32
// (AVX512-BF16 dot products, vdpbf16ps), the result rounded once to bf16.
//
// Layout (orbitctl.model.bf16_int4.pack): codes unsigned (code + 8), per output row n, K/32 chunks of 16 bytes;
// byte j of chunk c holds the code of k = 32c + j in its low nibble and of k = 32c + 16 + j in its high nibble.
// scales: float32 [N, K/G]; G a multiple of 32.
//
// Per block of NR output rows, the weight is dequantized once into a bf16 buffer (a 16-entry table per group,
// looked up with vpermw), then every row of x is run against it, MR rows at a time. Each output is a lane-wise
// float32 sum over K in chunk order followed by one horizontal sum: it depends only on its own row of x, whatever
// M is (a decode step and a batch compute the same numbers).
//
// Built at first use by orbitctl.model.bf16_int4 (g++ -O3 -fopenmp); the functions carry their own target
// attributes, so the library loads on any x86-64 CPU and is only called where the CPU has AVX512-BF16.

#include <immintrin.h>
#include <cstdint>
#include <cstdlib>
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

ORBITCTL_TARGET inline __m512i dequantize_chunk(const uint8_t* bytes, __m512i table, __m512i shifts, __m512i mask) {
  // 16 bytes -> 32 words (the bytes twice), the low nibbles in words 0..15 and the high ones in 16..31, looked up
  __m256i twice = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(twice), shifts), mask);
  return _mm512_permutexvar_epi16(codes, table);
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
  const __m512i shifts = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i mask = _mm512_set1_epi16(0xF);
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
          w[j * chunks + c] = dequantize_chunk(row + c * 16, table, shifts, mask);
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
  const __m512i shifts = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i mask = _mm512_set1_epi16(0xF);
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* row = packed + n * (K / 2);
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i table = group_table(scales[n * groups + g]);
      for (int64_t q = 0; q < per_group; ++q) {
        const int64_t c = g * per_group + q;
        _mm512_storeu_si512(out + n * K + c * 32, dequantize_chunk(row + c * 16, table, shifts, mask));
      }
    }
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

}
