// One pass of AdamW over a compact host state: 8 bytes per parameter instead of 16.
//
//   weight     bf16   the weight the GPU sees (updated in place, copied to the GPU from here)
//   remainder  int16  master - weight, exactly: fp32 master = weight + remainder (see below)
//   exp_avg    uint8  codes of the signed dynamic map, one fp32 absmax per 256 elements
//   exp_avg_sq uint8  codes of the unsigned dynamic map, one fp32 absmax per 256 elements
//   grad       bf16   read only
//
// Per element this reads 8 bytes and writes 6 (the fp32-master update moves 28-30), so
// where memory bandwidth bounds both it could run at up to twice that update's rate. On
// the 16-core Xeon host measured it runs about 1.5x, bound not by memory but by the table
// lookups of decoding and quantizing, four gathers per 16 elements
// (bench/formats/compact_update_rate.py; docs/formats.md#compact says where the time goes).
//
// Block-wise 8-bit moments follow Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization" (2022): each block of 256 values is divided by its absolute maximum and
// every value is stored as the index of the nearest entry of a sorted 256-entry map.
// offload_plugin/formats/compact/native.py builds the maps and the lookup tables this file uses, and
// holds a pure-torch reference of exactly this arithmetic that the tests compare against
// bit for bit. So every fp32 operation here is one IEEE operation in the order the
// reference does it (compiled with -ffp-contract=off: nothing is fused).
//
// The master: w = round-to-nearest(master) in bf16 with ties away from zero, and
// remainder = bits(master) - bits(w) << 16 as integers, which lies in [-0x8000, 0x7fff]
// exactly when ties go away from zero (with ties to even it would need 17 bits: an even
// bf16 value is the nearest of 0x10001 fp32 values). Integer arithmetic on bit patterns
// is exact across exponent boundaries, subnormals and up to +-inf, with no special cases
// but NaN (stored as a quiet NaN weight with remainder 0). Note that the remainder's bits
// are simply the master's low 16 bits.
//
// Whole blocks take an AVX-512 path where the compiler targets it (intrinsics: both table
// lookups, decoding and quantizing, as gathers from L1); partial blocks and other CPUs take
// the portable loop. Both give the same bits (the tests run both).

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define COMPACT_AVX512 1
#else
#define COMPACT_AVX512 0
#endif

namespace {

constexpr int64_t kBlock = 256;  // elements per absmax (as bitsandbytes' blockwise optimizers)

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// Round to nearest even (no master: the weight alone); NaN stays NaN.
inline uint16_t float_to_bf16_rne(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float master_of(uint16_t w, int16_t r) {
  return float_of((static_cast<uint32_t>(w) << 16) + static_cast<uint32_t>(static_cast<int32_t>(r)));
}

// The inverse of master_of: nearest bf16 (ties away from zero) and the exact rest. No
// carry leaves the 32 bits for finite values or inf. A NaN that arithmetic produces here
// is quiet with its low 16 bits zero (its payload comes from bf16 operands or is the
// default NaN), so it too is kept exactly (remainder 0): compact_adam.split_master gives
// the same bits for those, and canonicalizes other NaNs, which never reach this code.
inline void split_master(float p, uint16_t* w, int16_t* r) {
  const uint32_t u = bits_of(p);
  const uint32_t hi = (u + 0x8000u) >> 16;
  *w = static_cast<uint16_t>(hi);
  *r = static_cast<int16_t>(static_cast<int32_t>(u - (hi << 16)));
}

// A sorted 256-entry map and its lookup table. The nearest code of y (ties to the lower
// code: the number of midpoints below y) is found without a search: the table is indexed
// by the top 16 bits of |y| (sign, 8 exponent bits, 7 mantissa bits: one bf16 "bucket"),
// clamped to [k0, k0 + nb), with a second half for negative y (signed maps). compact_adam
// builds it so that every bucket holds at most one midpoint; an entry is
//   (code of the bucket's end nearest zero) << 16 | low 16 bits of that midpoint
// (0xffff for positive, 0 for negative buckets without one), and the midpoint is passed
// when |y|'s low 16 bits are above (positive) or below (negative) it. One gather, two
// integer compares, no branch.
struct Map {
  const float* values;     // 256 sorted values
  const uint32_t* table;   // nb entries (unsigned maps), 2 * nb (signed: negatives second)
  int32_t k0, nb;
  const uint32_t* carry_table;  // the same buckets for the AVX-512 quantizer (see quantize16)
};

template <bool kSigned>
inline uint8_t quantize(float y, const uint32_t* __restrict table, int32_t k0, int32_t nb) {
  const uint32_t u = bits_of(y);
  const uint32_t mag = u & 0x7fffffffu;
  int32_t key = static_cast<int32_t>(mag >> 16) - k0;
  key = key < 0 ? 0 : key;
  key = key > nb - 1 ? nb - 1 : key;
  const uint32_t low = mag & 0xffffu;
  if (kSigned) {
    const uint32_t neg = u >> 31;
    const uint32_t e = table[key + static_cast<int32_t>((0u - neg) & static_cast<uint32_t>(nb))];
    const uint32_t mid = e & 0xffffu;
    const uint32_t up = neg ? (low < mid) : (low > mid);
    return static_cast<uint8_t>((e >> 16) + up);
  }
  // Unsigned (second moments): a positive y takes at least code 1, never 0.0, which would
  // leave the update dividing by eps alone (compact_adam.quantize). 0 keeps code 0.
  const uint32_t e = table[key];
  const uint32_t code = (e >> 16) + (low > (e & 0xffffu));
  const uint32_t positive = static_cast<int32_t>(u) > 0;
  return static_cast<uint8_t>(code > positive ? code : positive);
}

// codes[j] = quantize(x[j] * inv) for j in [0, len): the second half of a block's update.
template <bool kSigned>
inline void quantize_block(const float* __restrict x, float inv, uint8_t* __restrict codes,
                           int len, const Map& map) {
  const uint32_t* __restrict table = map.table;
  const int32_t k0 = map.k0, nb = map.nb;
#pragma omp simd
  for (int j = 0; j < len; ++j) codes[j] = quantize<kSigned>(x[j] * inv, table, k0, nb);
}

// fp32 scalars, derived by compact_adam._coefficients (the reference uses the same).
struct Coefficients {
  float grad_factor;  // grad scale x clip coefficient (x -1 to maximize)
  float l2;           // Adam (not AdamW): grad += weight * l2
  float decay;        // AdamW: weight *= decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float inv_bias_correction2_sqrt, eps, neg_step_size;  // 1 / sqrt(1 - beta2^step)
  // Applied first and rounded to bf16 (nearest even), as torch's `grad * pre_scale` on a
  // bf16 gradient rounds (torchtune's scale_grads); 1 leaves the gradient as it is.
  float pre_scale;
};

// bf16(g * s) back in fp32, as torch rounds a bf16 tensor times a scalar (finite g).
inline float scaled_bf16(float g, float s) {
  return bf16_to_float(float_to_bf16_rne(g * s));
}

// Updates one block of len <= kBlock elements; every pointer starts at the block, but the
// absmax pointers, which point at the block's own absmax. The new moments stay in two
// 1 KiB buffers (L1) between the update and their quantization, which needs the block's
// new absmax first.
template <bool kMaster, bool kL2, bool kPreScale>
inline void update_block(uint16_t* __restrict weight, int16_t* __restrict remainder,
                         const uint16_t* __restrict grad, uint8_t* __restrict m_code,
                         float* __restrict m_absmax, uint8_t* __restrict v_code,
                         float* __restrict v_absmax, int len, const Map& mq, const Map& vq,
                         const Coefficients& c) {
  alignas(64) float m_new[kBlock];
  alignas(64) float v_new[kBlock];
  const float am = *m_absmax, av = *v_absmax;
  const float* __restrict mvals = mq.values;
  const float* __restrict vvals = vq.values;
  float m_max = 0.0f, v_max = 0.0f;
#pragma omp simd reduction(max : m_max, v_max)
  for (int j = 0; j < len; ++j) {
    float p = kMaster ? master_of(weight[j], remainder[j]) : bf16_to_float(weight[j]);
    float g = bf16_to_float(grad[j]);
    if (kPreScale) g = scaled_bf16(g, c.pre_scale);
    g = g * c.grad_factor;
    if (kL2) g = g + p * c.l2;
    float m = mvals[m_code[j]] * am;
    float v = vvals[v_code[j]] * av;
    m = m * c.beta1 + g * c.one_minus_beta1;
    v = v * c.beta2 + (g * g) * c.one_minus_beta2;
    p = p * c.decay;
    const float denom = std::sqrt(v) * c.inv_bias_correction2_sqrt + c.eps;
    p = p + (m * c.neg_step_size) / denom;
    if (kMaster) {
      split_master(p, &weight[j], &remainder[j]);
    } else {
      weight[j] = float_to_bf16_rne(p);
    }
    m_new[j] = m;
    v_new[j] = v;
    const float am_j = std::fabs(m);
    m_max = am_j > m_max ? am_j : m_max;
    v_max = v > v_max ? v : v_max;
  }
  // A block whose largest moment is 0 or subnormal is stored as zeros: 1 / absmax would
  // overflow, and such moments move no weight (they are divided by at least eps).
  const float kMinNormal = 1.17549435e-38f;
  const bool m_zero = !(m_max >= kMinNormal), v_zero = !(v_max >= kMinNormal);
  *m_absmax = m_zero ? 0.0f : m_max;
  *v_absmax = v_zero ? 0.0f : v_max;
  const float m_inv = m_zero ? 0.0f : 1.0f / m_max;
  const float v_inv = v_zero ? 0.0f : 1.0f / v_max;
  quantize_block<true>(m_new, m_inv, m_code, len, mq);
  quantize_block<false>(v_new, v_inv, v_code, len, vq);
}

#if COMPACT_AVX512
// The same block update written with AVX-512 intrinsics, for whole blocks: compilers do
// not always turn the portable loop's table lookups into gathers (gcc's tuning for AMD
// cores emulates them with scalar loads, 4x slower here). Every lane does exactly the
// portable code's IEEE operations in the same order, so the results are the same bits.
//
// The update is bound by the two vector ports that 512-bit instructions share, so it
// saves instructions where the bits allow:
// - 32 elements at a time, in the lane order of unpacklo/unpackhi_epi16: vector "a" holds
//   elements {0-3, 8-11, 16-19, 24-27} and "b" {4-7, 12-15, 20-23, 28-31}. 16-bit inputs
//   widen with one unpack each, and outputs narrow back to the natural order with one
//   packus (both work within 128-bit lanes). The arithmetic is lane-wise, so the order
//   changes no bit.
// - The quantizer reads Map::carry_table, whose entries turn "code + (low > mid)" into one
//   add: the midpoint's test carries into the code's bits (see quantize16).
namespace avx512 {

// Dword i of a (b) holds element order_a()[i] (order_b()[i]) of the 32; _mm512_set_epi32
// lists the last dword first.
inline __m512i order_a() { return _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0); }
inline __m512i order_b() { return _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4); }

// The 8-bit codes of 32 elements, widened to dwords in the order of a and b.
inline void codes32(const uint8_t* codes, __m512i* a, __m512i* b) {
#if defined(__AVX512VBMI__)
  // One byte permute each; the mask zeroes the three upper bytes of every dword.
  const __m512i c = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  *a = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, order_a(), c);
  *b = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, order_b(), c);
#else
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
  *a = _mm512_permutex2var_epi32(lo, order_a(), hi);
  *b = _mm512_permutex2var_epi32(lo, order_b(), hi);
#endif
}

// quantize() on 16 lanes, as dwords. carry_table entries are table's with the low half of
// every positive bucket replaced by 0xffff - mid, so for y >= 0
//   (entry + low) >> 16 = code + (low > mid)    (low, mid < 2^16: at most one carry)
// and, negative buckets keeping mid, with low' = 0xffff - low for y < 0
//   (entry + low') >> 16 = code + (mid > low).
// base is carry_table - k0 (keys are clamped to [k0, top]).
template <bool kSigned>
inline __m512i quantize16(__m512 y, const uint32_t* base, __m512i k0, __m512i top, __m512i nb) {
  const __m512i u = _mm512_castps_si512(y);
  __m512i key = _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), 16);
  key = _mm512_min_epi32(_mm512_max_epi32(key, k0), top);
  __m512i low;
  if (kSigned) {
    const __m512i sign = _mm512_srai_epi32(u, 31);  // all ones where y < 0
    key = _mm512_add_epi32(key, _mm512_and_si512(sign, nb));
    low = _mm512_ternarylogic_epi32(u, sign, _mm512_set1_epi32(0xffff), 0x28);  // (u ^ sign) & 0xffff
  } else {
    low = _mm512_and_si512(u, _mm512_set1_epi32(0xffff));
  }
  const __m512i e = _mm512_i32gather_epi32(key, base, 4);
  const __m512i code = _mm512_srli_epi32(_mm512_add_epi32(e, low), 16);
  if (kSigned) return code;
  // quantize()'s floor: where y > 0 (as a signed integer, its bits are), at least code 1.
  const __mmask16 positive = _mm512_cmpgt_epi32_mask(u, _mm512_setzero_si512());
  return _mm512_mask_max_epu32(code, positive, code, _mm512_set1_epi32(1));
}

inline const uint32_t* carry_base(const Map& map) {  // carry_table - k0, as an address
  return reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(map.carry_table) -
                                           static_cast<uintptr_t>(map.k0) * sizeof(uint32_t));
}

// 64 codes, as quantize16 returned them for the chunks a0, b0, a1, b1 of 64 elements, in
// the natural order: the two packs leave 8-element groups that one qword permute sorts.
inline void store_codes64(__m512i a0, __m512i b0, __m512i a1, __m512i b1, uint8_t* out) {
  const __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(a0, b0), _mm512_packus_epi32(a1, b1));
  _mm512_storeu_si512(out, _mm512_permutexvar_epi64(_mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0), bytes));
}

// Map::values[codes] for 16 codes: one gather from the 1 KiB table, in L1. (Decoding by
// the map's arithmetic, about 14 vector operations, took 15% longer per update on a
// Sapphire Rapids core; byte permutes (VBMI vpermi2b over four byte planes) 8%.)
inline __m512 decode16(__m512i codes, const float* values) {
  return _mm512_i32gather_ps(codes, values, 4);
}

// scaled_bf16 on 16 lanes (finite lanes: the rounding of float_to_bf16_rne without its
// NaN case).
inline __m512 scaled_bf16x16(__m512 g, __m512 s) {
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(g, s));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(r, 16), 16));
}

template <bool kMaster, bool kL2, bool kPreScale>
inline void update_block(uint16_t* __restrict weight, int16_t* __restrict remainder,
                         const uint16_t* __restrict grad, uint8_t* __restrict m_code,
                         float* __restrict m_absmax, uint8_t* __restrict v_code,
                         float* __restrict v_absmax, const Map& mq, const Map& vq,
                         const Coefficients& c) {
  alignas(64) float m_new[kBlock];  // in the a/b order of each 32 elements
  alignas(64) float v_new[kBlock];
  const __m512 am = _mm512_set1_ps(*m_absmax), av = _mm512_set1_ps(*v_absmax);
  const __m512 factor = _mm512_set1_ps(c.grad_factor), l2 = _mm512_set1_ps(c.l2),
               decay = _mm512_set1_ps(c.decay), b1 = _mm512_set1_ps(c.beta1),
               omb1 = _mm512_set1_ps(c.one_minus_beta1), b2 = _mm512_set1_ps(c.beta2),
               omb2 = _mm512_set1_ps(c.one_minus_beta2),
               bc2 = _mm512_set1_ps(c.inv_bias_correction2_sqrt), eps = _mm512_set1_ps(c.eps),
               nss = _mm512_set1_ps(c.neg_step_size), pre = _mm512_set1_ps(c.pre_scale);
  const __m512i zero = _mm512_setzero_si512(), low16 = _mm512_set1_epi32(0xffff);
  __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps();
  for (int j = 0; j < kBlock; j += 32) {
    const __m512i w32 = _mm512_loadu_si512(weight + j), g32 = _mm512_loadu_si512(grad + j);
    __m512i p_bits[2];
    if (kMaster) {
      // master_of: (w << 16) + r sign-extended, which is (w - 1) << 16 | r where r < 0.
      const __m512i r32 = _mm512_loadu_si512(remainder + j);
      const __m512i hi = _mm512_add_epi16(w32, _mm512_srai_epi16(r32, 15));
      p_bits[0] = _mm512_unpacklo_epi16(r32, hi);
      p_bits[1] = _mm512_unpackhi_epi16(r32, hi);
    } else {
      p_bits[0] = _mm512_unpacklo_epi16(zero, w32);
      p_bits[1] = _mm512_unpackhi_epi16(zero, w32);
    }
    const __m512i g_bits[2] = {_mm512_unpacklo_epi16(zero, g32), _mm512_unpackhi_epi16(zero, g32)};
    __m512i m_codes[2], v_codes[2], out[2];
    codes32(m_code + j, &m_codes[0], &m_codes[1]);
    codes32(v_code + j, &v_codes[0], &v_codes[1]);
    for (int h = 0; h < 2; ++h) {
      __m512 p = _mm512_castsi512_ps(p_bits[h]);
      __m512 g = _mm512_castsi512_ps(g_bits[h]);
      if (kPreScale) g = scaled_bf16x16(g, pre);
      g = _mm512_mul_ps(g, factor);
      if (kL2) g = _mm512_add_ps(g, _mm512_mul_ps(p, l2));
      __m512 m = _mm512_mul_ps(decode16(m_codes[h], mq.values), am);
      __m512 v = _mm512_mul_ps(decode16(v_codes[h], vq.values), av);
      m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, omb1));
      v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
      p = _mm512_mul_ps(p, decay);
      const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), bc2), eps);
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(m, nss), denom));
      out[h] = _mm512_castps_si512(p);
      _mm512_store_ps(m_new + j + 16 * h, m);
      _mm512_store_ps(v_new + j + 16 * h, v);
      // max(a, b) as the portable loop's `a > b ? a : b` with a the new value (vmaxps
      // returns its second operand when either is NaN; finite inputs are equal either way).
      m_max = _mm512_max_ps(_mm512_abs_ps(m), m_max);
      v_max = _mm512_max_ps(v, v_max);
    }
    if (kMaster) {  // split_master: the weight is the top half of u + 0x8000, the remainder u's low half
      const __m512i half = _mm512_set1_epi32(0x8000);
      _mm512_storeu_si512(weight + j, _mm512_packus_epi32(_mm512_srli_epi32(_mm512_add_epi32(out[0], half), 16),
                                                          _mm512_srli_epi32(_mm512_add_epi32(out[1], half), 16)));
      _mm512_storeu_si512(remainder + j, _mm512_packus_epi32(_mm512_and_si512(out[0], low16),
                                                             _mm512_and_si512(out[1], low16)));
    } else {  // float_to_bf16_rne
      __m512i w[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i u = out[h];
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        w[h] = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                      _mm512_set1_epi32(0x7f800000));
        w[h] = _mm512_mask_mov_epi32(w[h], nan, low16);
      }
      _mm512_storeu_si512(weight + j, _mm512_packus_epi32(w[0], w[1]));
    }
  }
  const float mm = _mm512_reduce_max_ps(m_max), vm = _mm512_reduce_max_ps(v_max);
  const float kMinNormal = 1.17549435e-38f;
  const bool m_zero = !(mm >= kMinNormal), v_zero = !(vm >= kMinNormal);
  *m_absmax = m_zero ? 0.0f : mm;
  *v_absmax = v_zero ? 0.0f : vm;
  const __m512 m_inv = _mm512_set1_ps(m_zero ? 0.0f : 1.0f / mm);
  const __m512 v_inv = _mm512_set1_ps(v_zero ? 0.0f : 1.0f / vm);
  const uint32_t *m_base = carry_base(mq), *v_base = carry_base(vq);
  const __m512i mk0 = _mm512_set1_epi32(mq.k0), mtop = _mm512_set1_epi32(mq.k0 + mq.nb - 1),
                mnb = _mm512_set1_epi32(mq.nb), vk0 = _mm512_set1_epi32(vq.k0),
                vtop = _mm512_set1_epi32(vq.k0 + vq.nb - 1);
  for (int j = 0; j < kBlock; j += 64) {
    __m512i mc[4], vc[4];
    for (int k = 0; k < 4; ++k) {
      mc[k] = quantize16<true>(_mm512_mul_ps(_mm512_load_ps(m_new + j + 16 * k), m_inv), m_base, mk0, mtop, mnb);
      vc[k] = quantize16<false>(_mm512_mul_ps(_mm512_load_ps(v_new + j + 16 * k), v_inv), v_base, vk0, vtop, mnb);
    }
    store_codes64(mc[0], mc[1], mc[2], mc[3], m_code + j);
    store_codes64(vc[0], vc[1], vc[2], vc[3], v_code + j);
  }
}

}  // namespace avx512
#endif

// Blocks [0, n_blocks) handed out to num_threads OpenMP threads in pieces as they ask
// (as adam_master_bf16.cpp does: the host shares its cores with the training thread, and
// a fixed split waits for whichever thread lost its core). Each block is computed the same
// way whichever thread takes it, so results do not depend on the thread count.
template <typename F>
void parallel_blocks(int64_t n_blocks, int num_threads, const F& fn) {
  constexpr int64_t kMinBlocksPerThread = 16;  // 4096 elements: worth waking a thread for
  int64_t threads = num_threads > 0 ? num_threads : 1;
  if (n_blocks < threads * kMinBlocksPerThread)
    threads = n_blocks / kMinBlocksPerThread > 0 ? n_blocks / kMinBlocksPerThread : 1;
  if (threads == 1) {
    for (int64_t b = 0; b < n_blocks; ++b) fn(b);
    return;
  }
  int64_t piece = n_blocks / (threads * 16);
  if (piece < kMinBlocksPerThread) piece = kMinBlocksPerThread;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    for (;;) {
      const int64_t b0 = next.fetch_add(piece, std::memory_order_relaxed);
      if (b0 >= n_blocks) break;
      const int64_t b1 = b0 + piece < n_blocks ? b0 + piece : n_blocks;
      for (int64_t b = b0; b < b1; ++b) fn(b);
    }
  }
}

template <bool kMaster, bool kL2, bool kPreScale>
void run(uint16_t* weight, int16_t* remainder, const uint16_t* grad, uint8_t* m_code,
         float* m_absmax, uint8_t* v_code, float* v_absmax, int64_t n, const Map& mq,
         const Map& vq, const Coefficients& c, int num_threads) {
  const int64_t n_blocks = (n + kBlock - 1) / kBlock;
  parallel_blocks(n_blocks, num_threads, [&](int64_t b) {
    const int64_t i = b * kBlock;
    int16_t* r = kMaster ? remainder + i : nullptr;
    if (i + kBlock <= n) {  // a whole block
#if COMPACT_AVX512
      avx512::update_block<kMaster, kL2, kPreScale>(weight + i, r, grad + i, m_code + i, m_absmax + b,
                                         v_code + i, v_absmax + b, mq, vq, c);
#else
      update_block<kMaster, kL2, kPreScale>(weight + i, r, grad + i, m_code + i, m_absmax + b,
                                            v_code + i, v_absmax + b, static_cast<int>(kBlock), mq, vq, c);
#endif
    } else {
      update_block<kMaster, kL2, kPreScale>(weight + i, r, grad + i, m_code + i, m_absmax + b,
                                            v_code + i, v_absmax + b, static_cast<int>(n - i), mq, vq, c);
    }
  });
}

}  // namespace

extern "C" {

// One AdamW (adamw=1) or Adam (L2 weight decay, adamw=0) step over n elements in place.
// remainder may be null: then there is no master and the weight is rounded to nearest
// even. coeffs: the 11 floats of Coefficients, in order. m_/v_table: see Map. Returns 0.
int adam_compact_step(uint16_t* weight, int16_t* remainder, const uint16_t* grad,
                      uint8_t* m_code, float* m_absmax, uint8_t* v_code, float* v_absmax,
                      int64_t n, const Map* m_map, const Map* v_map, const float* coeffs,
                      int adamw, int num_threads) {
  if (n <= 0) return 0;
  const Map& mq = *m_map;
  const Map& vq = *v_map;
  Coefficients c;
  std::memcpy(&c, coeffs, sizeof c);
  const bool master = remainder != nullptr, l2 = !adamw && c.l2 != 0.0f;
  const bool pre = c.pre_scale != 1.0f;
#define COMPACT_RUN(M, L, P) run<M, L, P>(weight, remainder, grad, m_code, m_absmax, v_code, v_absmax, n, mq, vq, c, num_threads)
  if (pre) {
    if (master && l2) COMPACT_RUN(true, true, true);
    else if (master) COMPACT_RUN(true, false, true);
    else if (l2) COMPACT_RUN(false, true, true);
    else COMPACT_RUN(false, false, true);
  } else {
    if (master && l2) COMPACT_RUN(true, true, false);
    else if (master) COMPACT_RUN(true, false, false);
    else if (l2) COMPACT_RUN(false, true, false);
    else COMPACT_RUN(false, false, false);
  }
#undef COMPACT_RUN
  return 0;
}

// The quantizer alone, for the tests: codes of y[0, n) (already divided by the absmax),
// by the portable code (vector = 0) or the AVX-512 one where built (else portable).
int compact_quantize(const float* y, uint8_t* code, int64_t n, const Map* map, int is_signed,
                     int vector) {
  int64_t i = 0;
#if COMPACT_AVX512
  if (vector) {
    const uint32_t* base = avx512::carry_base(*map);
    const __m512i k0 = _mm512_set1_epi32(map->k0), top = _mm512_set1_epi32(map->k0 + map->nb - 1),
                  nb = _mm512_set1_epi32(map->nb);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(y + i);
      const __m512i c = is_signed ? avx512::quantize16<true>(v, base, k0, top, nb)
                                  : avx512::quantize16<false>(v, base, k0, top, nb);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(code + i), _mm512_cvtepi32_epi8(c));
    }
  }
#endif
  for (; i < n; i += kBlock) {
    const int len = static_cast<int>(n - i < kBlock ? n - i : kBlock);
    if (is_signed) quantize_block<true>(y + i, 1.0f, code + i, len, *map);
    else quantize_block<false>(y + i, 1.0f, code + i, len, *map);
  }
  return 0;
}

// 1 if the AVX-512 path was compiled in (the tests check both paths where it was).
int compact_has_avx512() { return COMPACT_AVX512 + 0; }

}  // extern "C"
