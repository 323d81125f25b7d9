// One pass of Adam/AdamW over fp32 master weights with bf16 gradients, writing the
// updated weight back in bf16: the work torch does in three passes (upcast the gradient,
// torch._fused_adamw_, downcast the master), done while each element is in registers.
// A second entry point updates bf16 weights and moments in place (no master weights).
// Both can scale the gradient first, rounding it to bf16 as `g * scale` on a bf16 tensor
// (torchtune's scale_grads) does.
// A third adds one bf16 tensor into another (gradient accumulation), as torch's add_ does.
// A fourth tells whether a bf16 or fp32 tensor holds an inf or a NaN. The update also
// comes in a form that takes many tensors in one call.
//
// Bit-exactness with torch's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// vectorized body) comes from doing the same IEEE fp32 operations in the same order:
// every +, *, / and sqrt rounds once, the lerp of the first moment is one fused
// multiply-add as in torch's `vec::fmadd`, so is the second-moment product that torch's
// build contracts, and nothing else may be (this file is compiled with -ffp-contract=off). Scalars are derived in double, then cast to float,
// as torch does. offload_plugin.formats.adamw.native checks the result against torch's kernel on
// this machine before using it, and falls back to torch if a single bit differs.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Coefficients {
  float decay;        // AdamW: weight *= decay (1 - lr * weight_decay)
  float l2;           // Adam: grad += weight * l2 (weight_decay)
  float lerp_coeff;   // exp_avg.lerp_(grad, 1 - beta1), as torch's fmadd form
  bool lerp_from_avg; // |1 - beta1| < 0.5: base is exp_avg, else the gradient
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;
  float grad_scale;
  bool has_scale;
  bool maximize;
  bool adamw;
  bool has_decay;
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }

// S: the storage type of the weight being updated and of both moments (float, or
// uint16_t for bf16). Arithmetic is fp32 throughout; values are rounded only when stored.
// Element i's new bf16 weight goes to weight_out[i - out_base].
template <typename S, bool kLerpFromAvg, bool kAdamW, bool kDecay, bool kScale, bool kMaximize>
void update_elements(S* __restrict master, const uint16_t* __restrict grad,
                     S* __restrict exp_avg, S* __restrict exp_avg_sq,
                     uint16_t* __restrict weight_out, int64_t begin, int64_t end,
                     int64_t out_base, const Coefficients& c) {
  constexpr bool kBf16State = sizeof(S) == 2;
  const float decay = c.decay, l2 = c.l2, coeff = c.lerp_coeff, beta2 = c.beta2,
              b2c = c.one_minus_beta2, bc2 = c.bias_correction2_sqrt, eps = c.eps,
              nss = c.neg_step_size, scale = c.grad_scale;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float p = load(master, i);
    float g = bf16_to_float(grad[i]);
    if (kScale) {
      // The scaled bf16 gradient, as `g * scale` on a bf16 tensor (scale_grads) rounds it.
      g = bf16_to_float(float_to_bf16(g * scale));
    }
    if (kMaximize) g = g * -1.0f;
    if (kDecay) {
      if (kAdamW) p = p * decay;
      else g = std::fma(p, l2, g);  // contracted in torch's build too
    }
    float m = load(exp_avg, i);
    m = kLerpFromAvg ? std::fma(coeff, g - m, m) : std::fma(coeff, g - m, g);
    // torch's binary computes `v * beta2 + c * g * g` with the last product fused into
    // the addition (its build contracts it); the self-check pins this down.
    float v = std::fma(b2c * g, g, load(exp_avg_sq, i) * beta2);
    store(exp_avg, i, m);
    store(exp_avg_sq, i, v);
    float denom = std::sqrt(v) / bc2 + eps;
    p = p + nss * m / denom;
    store(master, i, p);
    if (!kBf16State && weight_out) weight_out[i - out_base] = float_to_bf16(p);
  }
}

// Copies n bf16 values with streaming stores wherever dst is 16-byte aligned.
inline void stream_out(uint16_t* __restrict dst, const uint16_t* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__SSE2__)
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 15u) != 0; ++i) dst[i] = src[i];
  for (; i + 8 <= n; i += 8)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

// update_elements over [begin, end). The bf16 weights (fp32 masters) go to a buffer that
// nothing on the host reads again, only the GPU's copy engine: they are staged in a block
// that stays in L1 and then written with streaming stores, which skip the read an
// ordinary store makes of each destination line first (2 of the 30 bytes of memory
// traffic per element) and leave the cache to the master and the moments.
template <typename S, bool kLerpFromAvg, bool kAdamW, bool kDecay, bool kScale, bool kMaximize>
void update_range(S* master, const uint16_t* grad, S* exp_avg, S* exp_avg_sq,
                  uint16_t* weight_out, int64_t begin, int64_t end, const Coefficients& c) {
  constexpr bool kBf16State = sizeof(S) == 2;
  if (kBf16State || weight_out == nullptr) {
    update_elements<S, kLerpFromAvg, kAdamW, kDecay, kScale, kMaximize>(
        master, grad, exp_avg, exp_avg_sq, nullptr, begin, end, 0, c);
    return;
  }
  constexpr int64_t kStage = 2048;
  alignas(64) uint16_t staged[kStage];
  for (int64_t b = begin; b < end; b += kStage) {
    const int64_t e = b + kStage < end ? b + kStage : end;
    update_elements<S, kLerpFromAvg, kAdamW, kDecay, kScale, kMaximize>(
        master, grad, exp_avg, exp_avg_sq, staged, b, e, b, c);
    stream_out(weight_out + b, staged, e - b);
  }
#if defined(__SSE2__)
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
#endif
}

template <typename S>
using RangeFn = void (*)(S*, const uint16_t*, S*, S*, uint16_t*, int64_t, int64_t,
                         const Coefficients&);

template <typename S, bool A, bool B, bool C, bool D>
RangeFn<S> pick5(bool e) { return e ? update_range<S, A, B, C, D, true> : update_range<S, A, B, C, D, false>; }
template <typename S, bool A, bool B, bool C>
RangeFn<S> pick4(bool d, bool e) { return d ? pick5<S, A, B, C, true>(e) : pick5<S, A, B, C, false>(e); }
template <typename S, bool A, bool B>
RangeFn<S> pick3(bool c, bool d, bool e) { return c ? pick4<S, A, B, true>(d, e) : pick4<S, A, B, false>(d, e); }
template <typename S, bool A>
RangeFn<S> pick2(bool b, bool c, bool d, bool e) { return b ? pick3<S, A, true>(c, d, e) : pick3<S, A, false>(c, d, e); }

// Scalars exactly as torch derives them (double, then cast to float where used).
Coefficients coefficients(double lr, double beta1, double beta2, double weight_decay,
                          double eps, double step, int adamw, int maximize, int has_scale,
                          float grad_scale) {
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  const double exp_avg_grad_coefficient = 1 - beta1;
  Coefficients c;
  c.decay = static_cast<float>(1 - lr * weight_decay);
  c.l2 = static_cast<float>(weight_decay);
  const float lerp_weight = static_cast<float>(exp_avg_grad_coefficient);
  c.lerp_from_avg = std::fabs(lerp_weight) < 0.5f;
  c.lerp_coeff = c.lerp_from_avg ? lerp_weight : lerp_weight - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1 - beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-step_size);
  c.grad_scale = grad_scale;
  c.has_scale = has_scale != 0;
  c.maximize = maximize != 0;
  c.adamw = adamw != 0;
  c.has_decay = weight_decay != 0;
  return c;
}

// Calls fn(begin, end) on up to num_threads OpenMP threads over pieces of [0, n) that
// start at multiples of `unit` elements (whole cache lines: no two threads write one line),
// using a thread only for at least `min_units` units (a smaller share is not worth waking
// a thread for). The pieces are handed out as threads ask for them (about 16 per thread),
// not split up front: the host worker shares its cores with the training thread and the
// CUDA driver, and with a fixed split the whole call waits for whichever thread lost its
// core for a while. Every element is computed the same way whichever thread takes it.
template <typename F>
void parallel_ranges(int64_t n, int64_t unit, int64_t min_units, int num_threads, const F& fn) {
  const int64_t units = (n + unit - 1) / unit;
  int64_t threads = num_threads > 0 ? num_threads : 1;
  if (units < threads * min_units) threads = units / min_units > 0 ? units / min_units : 1;
  if (threads == 1) {
    if (n > 0) fn(0, n);
    return;
  }
  int64_t piece = units / (threads * 16);
  if (piece < min_units) piece = min_units;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    for (;;) {
      const int64_t u0 = next.fetch_add(piece, std::memory_order_relaxed);
      if (u0 >= units) break;
      const int64_t u1 = u0 + piece < units ? u0 + piece : units;
      fn(u0 * unit, u1 * unit < n ? u1 * unit : n);
    }
  }
}

template <typename S>
void run(S* master, const uint16_t* grad, S* exp_avg, S* exp_avg_sq, uint16_t* weight_out,
         int64_t n, const Coefficients& c, int num_threads) {
  RangeFn<S> fn = c.lerp_from_avg ? pick2<S, true>(c.adamw, c.has_decay, c.has_scale, c.maximize)
                                  : pick2<S, false>(c.adamw, c.has_decay, c.has_scale, c.maximize);
  // Pieces of whole cache lines (16 floats), like torch's kernel.
  parallel_ranges(n, 16, 64, num_threads, [&](int64_t b, int64_t e) {
    fn(master, grad, exp_avg, exp_avg_sq, weight_out, b, e, c);
  });
}

// The update of `count` tensors of one parameter group in one call: one step count per
// tensor (its own bias corrections), everything else shared. The tensors are cut into
// pieces of at most 64 Ki elements (whole cache lines) that threads take as they come, so
// hundreds of small tensors (LoRA adapters) cost one call and one thread team, and each
// element is computed exactly as `run` computes it.
template <typename S>
void run_many(int64_t count, S* const* master, const uint16_t* const* grad, S* const* exp_avg,
              S* const* exp_avg_sq, uint16_t* const* weight_out, const int64_t* numel,
              const double* step, double lr, double beta1, double beta2, double weight_decay,
              double eps, int adamw, int maximize, int has_scale, float grad_scale,
              int num_threads) {
  if (count <= 0) return;
  std::vector<Coefficients> c;
  c.reserve(count);
  for (int64_t t = 0; t < count; ++t)
    c.push_back(coefficients(lr, beta1, beta2, weight_decay, eps, step[t], adamw, maximize,
                             has_scale, grad_scale));
  // The variant depends on beta1 and the shared flags only: the same for every tensor.
  const Coefficients& c0 = c[0];
  RangeFn<S> fn = c0.lerp_from_avg ? pick2<S, true>(c0.adamw, c0.has_decay, c0.has_scale, c0.maximize)
                                   : pick2<S, false>(c0.adamw, c0.has_decay, c0.has_scale, c0.maximize);
  constexpr int64_t kPiece = 1 << 16;
  struct Piece { int64_t tensor, begin, end; };
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t b = 0; b < numel[t]; b += kPiece)
      pieces.push_back({t, b, b + kPiece < numel[t] ? b + kPiece : numel[t]});
    total += numel[t];
  }
  // At least 1024 elements per thread, as `run` asks.
  int64_t threads = num_threads > 0 ? num_threads : 1;
  if (total < threads * 1024) threads = total / 1024 > 0 ? total / 1024 : 1;
  const int64_t n_pieces = static_cast<int64_t>(pieces.size());
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    for (;;) {
      const int64_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= n_pieces) break;
      const Piece& p = pieces[k];
      const int64_t t = p.tensor;
      fn(master[t], grad[t], exp_avg[t], exp_avg_sq[t], weight_out ? weight_out[t] : nullptr,
         p.begin, p.end, c[t]);
    }
  }
}

// dst += src in bf16: both widened to fp32 (exact), one fp32 addition, rounded to nearest
// even, which is what torch's bf16 add_ computes (its vector path as fmadd(src, 1, dst)
// in fp32, its scalar path as dst + 1 * src, both one rounding of the same exact sum).
// A NaN comes out as 0xffff, as in torch's x86 vector path; torch's scalar tails give
// 0x7fc0 instead, at places that depend on its thread count, so NaN bits are not
// something torch itself keeps fixed (the self-check compares NaNs as NaN).
void add_range(uint16_t* __restrict dst, const uint16_t* __restrict src, int64_t begin,
               int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i)
    dst[i] = float_to_bf16(bf16_to_float(dst[i]) + bf16_to_float(src[i]));
}

}  // namespace

extern "C" {

// Updates elements [0, n) in place. `weight_out` may be null. `step` is the step count
// after this update (torch increments it first). Returns 0.
int adam_master_bf16_step(float* master, const uint16_t* grad, float* exp_avg,
                          float* exp_avg_sq, uint16_t* weight_out, int64_t n, double lr,
                          double beta1, double beta2, double weight_decay, double eps,
                          double step, int adamw, int maximize, int has_scale,
                          float grad_scale, int num_threads) {
  run<float>(master, grad, exp_avg, exp_avg_sq, weight_out, n,
             coefficients(lr, beta1, beta2, weight_decay, eps, step, adamw, maximize,
                          has_scale, grad_scale),
             num_threads);
  return 0;
}

// The same for bf16 weights and bf16 moments, updated in place (no master weights).
int adam_bf16_step(uint16_t* weight, const uint16_t* grad, uint16_t* exp_avg,
                   uint16_t* exp_avg_sq, int64_t n, double lr, double beta1, double beta2,
                   double weight_decay, double eps, double step, int adamw, int maximize,
                   int has_scale, float grad_scale, int num_threads) {
  run<uint16_t>(weight, grad, exp_avg, exp_avg_sq, nullptr, n,
                coefficients(lr, beta1, beta2, weight_decay, eps, step, adamw, maximize,
                             has_scale, grad_scale),
                num_threads);
  return 0;
}

// 1 if any of the n elements (bf16 when elem_bytes is 2, fp32 when 4) is an inf or a NaN,
// else 0: the exponent bits are all ones exactly then (torch.isfinite's answer). One
// read pass, no temporaries; it is the finiteness check of each update job.
int any_nonfinite(const void* data, int64_t n, int elem_bytes, int num_threads) {
  int found = 0;
  // 16 fp32 or 32 bf16 elements are one cache line; at least 512 lines per thread.
  const int64_t unit = 64 / elem_bytes;
  parallel_ranges(n, unit, 512, num_threads, [&](int64_t b, int64_t e) {
    int bad = 0;
    if (elem_bytes == 2) {
      const uint16_t* x = static_cast<const uint16_t*>(data);
#pragma omp simd reduction(| : bad)
      for (int64_t i = b; i < e; ++i) bad |= (x[i] & 0x7f80u) == 0x7f80u;
    } else {
      const uint32_t* x = static_cast<const uint32_t*>(data);
#pragma omp simd reduction(| : bad)
      for (int64_t i = b; i < e; ++i) bad |= (x[i] & 0x7f800000u) == 0x7f800000u;
    }
    if (bad) {
#pragma omp atomic write
      found = 1;
    }
  });
  return found;
}

// adam_master_bf16_step for `count` tensors (see run_many); `weight_out` may be null, or
// hold null entries. Returns 0.
int adam_master_bf16_many(int64_t count, float* const* master, const uint16_t* const* grad,
                          float* const* exp_avg, float* const* exp_avg_sq,
                          uint16_t* const* weight_out, const int64_t* numel, const double* step,
                          double lr, double beta1, double beta2, double weight_decay, double eps,
                          int adamw, int maximize, int has_scale, float grad_scale,
                          int num_threads) {
  run_many<float>(count, master, grad, exp_avg, exp_avg_sq, weight_out, numel, step, lr, beta1,
                  beta2, weight_decay, eps, adamw, maximize, has_scale, grad_scale, num_threads);
  return 0;
}

// adam_bf16_step for `count` tensors (see run_many). Returns 0.
int adam_bf16_many(int64_t count, uint16_t* const* weight, const uint16_t* const* grad,
                   uint16_t* const* exp_avg, uint16_t* const* exp_avg_sq, const int64_t* numel,
                   const double* step, double lr, double beta1, double beta2,
                   double weight_decay, double eps, int adamw, int maximize, int has_scale,
                   float grad_scale, int num_threads) {
  run_many<uint16_t>(count, weight, grad, exp_avg, exp_avg_sq, nullptr, numel, step, lr, beta1,
                     beta2, weight_decay, eps, adamw, maximize, has_scale, grad_scale,
                     num_threads);
  return 0;
}

// dst[i] += src[i] for i in [0, n), bf16 (see add_range). dst and src must not overlap.
// Returns 0.
int add_bf16_inplace(uint16_t* dst, const uint16_t* src, int64_t n, int num_threads) {
  // 32 bf16 elements are one 64-byte cache line; 512 lines (16K elements) per thread at least.
  parallel_ranges(n, 32, 512, num_threads,
                  [&](int64_t b, int64_t e) { add_range(dst, src, b, e); });
  return 0;
}

}  // extern "C"
