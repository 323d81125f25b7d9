// One pass of AdamW over a compact host state: 8 bytes per parameter instead of 16.
//
//   weight     bf16   the weight the GPU sees (updated in place, copied to the GPU from here)
//   remainder  int16  master - weight, exactly: fp32 master = weight + remainder (see below)
//   exp_avg    uint8  codes of the signed dynamic map, one fp32 absmax per 256 elements
//   exp_avg_sq uint8  codes of the unsigned dynamic map, one fp32 absmax per 256 elements
//   grad       bf16   read only
//
// Per element this reads 8 bytes and writes 6 (the fp32-master update moves 28-30), so
// where memory bandwidth bounds both it could run at up to twice that update's rate. It
// does not on the Xeons measured: decoding and quantizing cost about as much as the memory
// traffic saved (bench/compact_update_rate.py; the .py's notes say where the time goes).
//
// Block-wise 8-bit moments follow Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization" (2022): each block of 256 values is divided by its absolute maximum and
// every value is stored as the index of the nearest entry of a sorted 256-entry map.
// offload_plugin/compact_adam.py builds the maps and the lookup tables this file uses, and
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
  const uint32_t e = table[key];
  return static_cast<uint8_t>((e >> 16) + (low > (e & 0xffffu)));
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
namespace avx512 {

inline __m512 bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// quantize() on 16 lanes; stores 16 codes.
template <bool kSigned>
inline void quantize16(__m512 y, const uint32_t* table, __m512i k0, __m512i top, __m512i nb,
                       uint8_t* out) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  __m512i key = _mm512_sub_epi32(_mm512_srli_epi32(mag, 16), k0);
  key = _mm512_min_epi32(_mm512_max_epi32(key, _mm512_setzero_si512()), top);
  const __m512i low = _mm512_and_si512(mag, _mm512_set1_epi32(0xffff));
  __m512i e;
  __mmask16 up;
  if (kSigned) {
    const __mmask16 neg = _mm512_movepi32_mask(u);  // sign bits
    key = _mm512_mask_add_epi32(key, neg, key, nb);
    e = _mm512_i32gather_epi32(key, table, 4);
    const __m512i mid = _mm512_and_si512(e, _mm512_set1_epi32(0xffff));
    up = (_mm512_cmpgt_epu32_mask(low, mid) & ~neg) | (_mm512_cmplt_epu32_mask(low, mid) & neg);
  } else {
    e = _mm512_i32gather_epi32(key, table, 4);
    up = _mm512_cmpgt_epu32_mask(low, _mm512_and_si512(e, _mm512_set1_epi32(0xffff)));
  }
  __m512i code = _mm512_srli_epi32(e, 16);
  code = _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(code));
}

// Map::values[codes] for 16 codes: one gather from the 1 KiB table, in L1. (Decoding by
// the map's arithmetic, about 14 vector operations, took 15% longer per update on a
// Sapphire Rapids core; byte permutes (VBMI vpermi2b over four byte planes) 8%.)
inline __m512 decode16(const uint8_t* codes, const float* values) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  return _mm512_i32gather_ps(c, values, 4);
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
  alignas(64) float m_new[kBlock];
  alignas(64) float v_new[kBlock];
  const __m512 am = _mm512_set1_ps(*m_absmax), av = _mm512_set1_ps(*v_absmax);
  const __m512 factor = _mm512_set1_ps(c.grad_factor), l2 = _mm512_set1_ps(c.l2),
               decay = _mm512_set1_ps(c.decay), b1 = _mm512_set1_ps(c.beta1),
               omb1 = _mm512_set1_ps(c.one_minus_beta1), b2 = _mm512_set1_ps(c.beta2),
               omb2 = _mm512_set1_ps(c.one_minus_beta2),
               bc2 = _mm512_set1_ps(c.inv_bias_correction2_sqrt), eps = _mm512_set1_ps(c.eps),
               nss = _mm512_set1_ps(c.neg_step_size), pre = _mm512_set1_ps(c.pre_scale);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps();
  for (int j = 0; j < kBlock; j += 16) {
    __m512 p;
    if (kMaster) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight + j)));
      const __m512i r = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(remainder + j)));
      p = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(w, 16), r));
    } else {
      p = bf16x16(weight + j);
    }
    __m512 g = bf16x16(grad + j);
    if (kPreScale) g = scaled_bf16x16(g, pre);
    g = _mm512_mul_ps(g, factor);
    if (kL2) g = _mm512_add_ps(g, _mm512_mul_ps(p, l2));
    __m512 m = _mm512_mul_ps(decode16(m_code + j, mq.values), am);
    __m512 v = _mm512_mul_ps(decode16(v_code + j, vq.values), av);
    m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, omb1));
    v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
    p = _mm512_mul_ps(p, decay);
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), bc2), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(m, nss), denom));
    const __m512i u = _mm512_castps_si512(p);
    if (kMaster) {
      const __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)), 16);
      const __m512i r = _mm512_sub_epi32(u, _mm512_slli_epi32(hi, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weight + j), _mm512_cvtepi32_epi16(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(remainder + j), _mm512_cvtepi32_epi16(r));
    } else {
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i w = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), _mm512_set1_epi32(0x7f800000));
      w = _mm512_mask_mov_epi32(w, nan, _mm512_set1_epi32(0xffff));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weight + j), _mm512_cvtepi32_epi16(w));
    }
    _mm512_store_ps(m_new + j, m);
    _mm512_store_ps(v_new + j, v);
    // max(a, b) as the portable loop's `a > b ? a : b` with a the new value (vmaxps
    // returns its second operand when either is NaN; finite inputs are equal either way).
    m_max = _mm512_max_ps(_mm512_abs_ps(m), m_max);
    v_max = _mm512_max_ps(v, v_max);
  }
  const float mm = _mm512_reduce_max_ps(m_max), vm = _mm512_reduce_max_ps(v_max);
  const float kMinNormal = 1.17549435e-38f;
  const bool m_zero = !(mm >= kMinNormal), v_zero = !(vm >= kMinNormal);
  *m_absmax = m_zero ? 0.0f : mm;
  *v_absmax = v_zero ? 0.0f : vm;
  const __m512 m_inv = _mm512_set1_ps(m_zero ? 0.0f : 1.0f / mm);
  const __m512 v_inv = _mm512_set1_ps(v_zero ? 0.0f : 1.0f / vm);
  const __m512i mk0 = _mm512_set1_epi32(mq.k0), mtop = _mm512_set1_epi32(mq.nb - 1),
                mnb = _mm512_set1_epi32(mq.nb), vk0 = _mm512_set1_epi32(vq.k0),
                vtop = _mm512_set1_epi32(vq.nb - 1);
  for (int j = 0; j < kBlock; j += 16) {
    quantize16<true>(_mm512_mul_ps(_mm512_load_ps(m_new + j), m_inv), mq.table, mk0, mtop, mnb, m_code + j);
    quantize16<false>(_mm512_mul_ps(_mm512_load_ps(v_new + j), v_inv), vq.table, vk0, vtop, mnb, v_code + j);
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

// The quantizer alone, for the tests: codes of y[0, n) (already divided by the absmax).
// The quantizer alone, for the tests: codes of y[0, n) (already divided by the absmax),
// by the portable code (vector = 0) or the AVX-512 one where built (else portable).
int compact_quantize(const float* y, uint8_t* code, int64_t n, const Map* map, int is_signed,
                     int vector) {
  int64_t i = 0;
#if COMPACT_AVX512
  if (vector) {
    const __m512i k0 = _mm512_set1_epi32(map->k0), top = _mm512_set1_epi32(map->nb - 1),
                  nb = _mm512_set1_epi32(map->nb);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(y + i);
      if (is_signed) avx512::quantize16<true>(v, map->table, k0, top, nb, code + i);
      else avx512::quantize16<false>(v, map->table, k0, top, nb, code + i);
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
