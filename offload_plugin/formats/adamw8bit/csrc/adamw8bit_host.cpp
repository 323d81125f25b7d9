// bitsandbytes' 8-bit blockwise AdamW step (offload_plugin.formats.adamw8bit.update) in one
// pass: each 256-element block's codes are dequantized, the moments and the bf16 weight
// updated, and the block quantized again while it is in cache, where the torch reference
// makes about twenty passes over temporaries.
//
// Bit-exactness with the reference comes from the same IEEE fp32 operations in the same
// order: every +, *, / rounds once, except the two moment updates, which torch's CPU
// kernels compute as fused multiply-adds in vector code and in scalar tails alike
// (m.add_(g, alpha=) is fma(g, alpha, m); v.addcmul_(g, g, value=) is fma(value * g, g, v)),
// and sqrt is taken from where torch takes it (see sqrt_block).
// This file is compiled with -ffp-contract=off so that the compiler fuses nothing else.
// offload_plugin.formats.adamw8bit.native checks the result against the reference on this machine
// before it is used.
//
// Only what the reference computes from finite values is done here. The reference's
// treatment of inf and NaN (its quantizer's NaN rules, torch's NaN bits when a NaN weight
// is rounded to bf16) is left to it: the update goes chunk by chunk (the reference's
// chunks), each staged in per-thread buffers, and a chunk where any gradient, moment or
// new weight is not finite is not written at all but reported, for the reference to redo
// from its untouched inputs.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;  // elements per absmax
constexpr float kLutLast = 65535.0f;  // the quantizer table has 65,536 points

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does for finite values
// (overflow gives inf there too). NaNs never get here.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 1 for an inf or a NaN (all exponent bits set), else 0.
inline uint32_t nonfinite(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}

// The scalars of adamw8bit.coefficients(), in its order (fp32 already).
struct Coefficients {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, correction2, eps, decay, step_size,
      step_size_32bit, eps_32bit, scale, seed;
};

struct Quantizer {
  const float* map;    // 256 values of the dynamic map, by code
  const uint8_t* lut;  // 65,536 codes over [-1, 1]
};

// The block's largest magnitude and its codes, as adamw8bit.quantize_ computes them for
// finite values: each value times the reciprocal of the largest, clamped to [-1, 1], to
// the nearest table point ((x + 1) / 2 * 65535 + 1/2, truncated), that point's code.
inline float quantize_block(const float* __restrict x, int64_t len, const Quantizer& q,
                            uint8_t* __restrict codes) {
  float top = 0.0f;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    top = a > top ? a : top;
  }
  if (top == 0.0f) {
    std::memset(codes, 0, len);
    return top;
  }
  const float inverse = 1.0f / top;
  int32_t index[kBlock];
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    // (a subnormal largest magnitude has an inf reciprocal: its block's zeros give NaN,
    // which the reference sends to the first point, as it does any NaN)
    float s = x[i] * inverse;
    s = std::isnan(s) ? -1.0f : (s < -1.0f ? -1.0f : (s > 1.0f ? 1.0f : s));
    const int32_t k = static_cast<int32_t>(((s + 1.0f) * 0.5f) * kLutLast + 0.5f);
    index[i] = k < 0 ? 0 : (k > 65535 ? 65535 : k);  // (as the reference clamps: never past the table)
  }
  for (int64_t i = 0; i < len; ++i) codes[i] = q.lut[index[i]];
  return top;
}

// MKL's vmsSqrt, as torch calls it for Tensor.sqrt where it is built with MKL (x86 wheels):
// its results are not always the correctly rounded square root, so they are taken from it.
using VectorSqrt = void (*)(int64_t n, const float* in, float* out, int64_t mode);
constexpr int64_t kTorchVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE

// sqrt of `len` values as torch computes it: through `vsqrt` if given, else IEEE sqrt.
inline void sqrt_block(const float* x, float* out, int64_t len, VectorSqrt vsqrt) {
  if (vsqrt != nullptr) {
    vsqrt(len, x, out, kTorchVmlMode);
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) out[i] = std::sqrt(x[i]);
}

// One block of `len` elements at `base`: reads the inputs, writes the new weight, codes
// and scales to the staging pointers. Returns false if anything is not finite.
inline bool update_block(const uint16_t* __restrict weight, const uint16_t* __restrict grad,
                         const uint8_t* __restrict state1, float absmax1,
                         const uint8_t* __restrict state2, float absmax2, int64_t len,
                         const Coefficients& c, const Quantizer& q1, const Quantizer& q2, VectorSqrt vsqrt,
                         uint16_t* __restrict weight_out, uint8_t* __restrict codes1,
                         float* __restrict top1, uint8_t* __restrict codes2,
                         float* __restrict top2) {
  // (as locals: loads through `c` would be re-read each iteration, for all the compiler
  // knows, and keep the loop from vectorizing)
  const float b1 = c.beta1, omb1 = c.one_minus_beta1, b2 = c.beta2, omb2 = c.one_minus_beta2,
              c2 = c.correction2, eps = c.eps, decay = c.decay, step_size = c.step_size,
              scale = c.scale;
  const float *map1 = q1.map, *map2 = q2.map;
  float m[kBlock], v[kBlock], root[kBlock];
  uint32_t bad = 0;
  // A scale or decay of 1 changes no bit (times 1, a bf16 value stays that bf16 value):
  // no branch in the loops.
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < len; ++i) {
    const float g = bf16_to_float(float_to_bf16(bf16_to_float(grad[i]) * scale));  // grad.mul_(scale)
    m[i] = std::fma(g, omb1, map1[state1[i]] * absmax1 * b1);
    v[i] = std::fma(omb2 * g, g, map2[state2[i]] * absmax2 * b2);
    bad |= nonfinite(g) | nonfinite(m[i]) | nonfinite(v[i]);
  }
  sqrt_block(v, root, len, vsqrt);
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < len; ++i) {
    const float denom = root[i] / c2 + eps;
    const float p = bf16_to_float(weight[i]) * decay + (step_size * m[i]) / denom;
    weight_out[i] = float_to_bf16(p);
    bad |= nonfinite(p);
  }
  const bool ok = bad == 0;
  if (!ok) return false;
  *top1 = quantize_block(m, len, q1, codes1);
  *top2 = quantize_block(v, len, q2, codes2);
  return true;
}

}  // namespace

extern "C" {

// Updates elements [0, n) in place, chunk by chunk (`chunk` elements, whole blocks),
// chunks spread over `num_threads` OpenMP threads. `vsqrt`: MKL's vmsSqrt where torch's
// sqrt is MKL's, else null. A chunk with a non-finite value is left
// as it was and marked in `skipped` (one byte per chunk). Returns the number skipped.
int64_t adamw8bit_step(uint16_t* weight, const uint16_t* grad, uint8_t* state1, float* absmax1,
                       uint8_t* state2, float* absmax2, int64_t n, const float* coeffs,
                       const float* map1, const uint8_t* lut1, const float* map2,
                       const uint8_t* lut2, VectorSqrt vsqrt, int64_t chunk, uint8_t* skipped,
                       int num_threads) {
  Coefficients c;
  std::memcpy(&c, coeffs, sizeof c);
  const Quantizer q1{map1, lut1}, q2{map2, lut2};
  const int64_t chunks = (n + chunk - 1) / chunk;
  int64_t count = 0;
  const int threads = static_cast<int>(chunks < num_threads ? (chunks > 0 ? chunks : 1) : num_threads);
#pragma omp parallel num_threads(threads) reduction(+ : count)
  {
    // The chunk's results, copied out once the whole chunk is known to be finite.
    std::vector<uint16_t> w(chunk);
    std::vector<uint8_t> codes1(chunk), codes2(chunk);
    std::vector<float> top1(chunk / kBlock), top2(chunk / kBlock);
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t a = k * chunk, len = (a + chunk < n ? a + chunk : n) - a;
      bool ok = true;
      for (int64_t b = 0; b < len && ok; b += kBlock) {
        const int64_t blen = len - b < kBlock ? len - b : kBlock, j = (a + b) / kBlock;
        ok = update_block(weight + a + b, grad + a + b, state1 + a + b, absmax1[j], state2 + a + b,
                          absmax2[j], blen, c, q1, q2, vsqrt, w.data() + b, codes1.data() + b,
                          &top1[b / kBlock], codes2.data() + b, &top2[b / kBlock]);
      }
      skipped[k] = !ok;
      if (!ok) {
        ++count;
        continue;
      }
      const int64_t blocks = (len + kBlock - 1) / kBlock;
      std::memcpy(weight + a, w.data(), len * sizeof(uint16_t));
      std::memcpy(state1 + a, codes1.data(), len);
      std::memcpy(state2 + a, codes2.data(), len);
      std::memcpy(absmax1 + a / kBlock, top1.data(), blocks * sizeof(float));
      std::memcpy(absmax2 + a / kBlock, top2.data(), blocks * sizeof(float));
    }
  }
  return count;
}

}  // extern "C"
