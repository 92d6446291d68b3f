"""C++ source of the out-of-place CPU kernels: torch's fused Adam, AdamW and SGD steps for
fp32 params, reading the old buffers and writing new ones in one pass.

Each rounding is written out (``-ffp-contract=off``): where torch's compiled kernel fuses a
multiply and an add, this code calls ``fmadd`` / ``std::fma`` at the same place, in its
8-wide vector loop (torch dispatches these kernels at its AVX2 level on x86, AVX512 machines
included) and in its scalar tail. :mod:`.cpu_extension` checks the result against torch's kernels
once per process before it is used.
"""

from __future__ import annotations

__all__ = ["FUNCTIONS", "SOURCE"]

#: the functions the extension exports
FUNCTIONS = ["fitting_numel", "adam_out", "sgd_out"]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
using Lists = std::vector<std::vector<at::Tensor>>;

// torch's fused kernels split a tensor between threads in 64-byte units; only the last
// piece of a tensor has a scalar tail
constexpr int64_t kUnit = 16;

bool plain(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
         t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_neg() && !t.is_conj();
}

// Each thread's piece ends with a store fence: its streaming stores are visible after it.
template <typename Fn>
void for_pieces(int64_t n, const Fn& fn) {
  at::parallel_for(0, (n + kUnit - 1) / kUnit, 0, [&](int64_t begin, int64_t end) {
    fn(begin * kUnit, std::min(end * kUnit, n));
#if defined(__AVX__)
    _mm_sfence();
#endif
  });
}

// Stores to new memory: where the step's buffers do not fit in the cache (``stream``), a
// streaming store skips reading the line first (a third of the traffic of a write to memory
// not in cache), where the address allows one; where they fit, a plain store keeps the line
// in cache for the next step.
inline void put(const Vec& value, float* at, bool stream) {
#if defined(__AVX__)
  if (stream && (reinterpret_cast<uintptr_t>(at) & 31) == 0) {
    _mm256_stream_ps(at, value);
    return;
  }
#endif
  value.store(at);
}

float advance(const at::Tensor& step) {
  float* count = step.data_ptr<float>();
  *count = *count + 1.0f;
  return *count;
}

}  // namespace

// The number of elements of the params when every list holds one contiguous fp32 CPU tensor
// per param, of the param's size, and (``with_counts``) ``counts`` one fp32 CPU counter per
// param; else -1.
int64_t fitting_numel(const Lists& lists, const std::vector<at::Tensor>& counts,
                      bool with_counts) {
  if (lists.empty()) return -1;
  const size_t count = lists[0].size();
  for (const auto& list : lists) {
    if (list.size() != count) return -1;
  }
  if (with_counts && counts.size() != count) return -1;
  int64_t total = 0;
  for (size_t j = 0; j < count; ++j) {
    const int64_t n = lists[0][j].numel();
    for (const auto& list : lists) {
      if (!plain(list[j]) || list[j].numel() != n) return -1;
    }
    if (with_counts && (!plain(counts[j]) || counts[j].numel() != 1)) return -1;
    total += n;
  }
  return total;
}

// torch._fused_adam_ / _fused_adamw_ (no grad scaling): ``old`` = params, exp_avgs,
// exp_avg_sqs[, max_exp_avg_sqs] before the step, ``out`` the same lists to write; ``grads``;
// ``steps`` are advanced first, as torch's optimizer does before calling its kernel.
void adam_out(const Lists& old, const std::vector<at::Tensor>& grads, const Lists& out,
              const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
              double weight_decay, double eps, bool amsgrad, bool maximize, bool decoupled,
              bool stream) {
  for (size_t j = 0; j < grads.size(); ++j) {
    const double step = advance(steps[j]);
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const float c1 = float(1 - beta1), c2 = float(1 - beta2), b2 = float(beta2);
    const float bc2_sqrt = float(std::sqrt(bias_correction2));
    const float step_size = float(lr / bias_correction1), e = float(eps);
    const float wd = float(weight_decay), shrink = float(1 - lr * weight_decay);
    const bool l2 = weight_decay != 0.0 && !decoupled;
    const bool decay = weight_decay != 0.0 && decoupled;
    // exp_avg.lerp_(grad, c1): from exp_avg for a small weight, else from grad
    const bool small = std::abs(c1) < 0.5f;
    const float* P = old[0][j].data_ptr<float>();
    const float* M = old[1][j].data_ptr<float>();
    const float* V = old[2][j].data_ptr<float>();
    const float* X = amsgrad ? old[3][j].data_ptr<float>() : nullptr;
    const float* G = grads[j].data_ptr<float>();
    float* NP = out[0][j].data_ptr<float>();
    float* NM = out[1][j].data_ptr<float>();
    float* NV = out[2][j].data_ptr<float>();
    float* NX = amsgrad ? out[3][j].data_ptr<float>() : nullptr;
    for_pieces(grads[j].numel(), [&](int64_t begin, int64_t end) {
      const int64_t size = end - begin;
      const Vec coeff(small ? c1 : c1 - 1.0f);
      int64_t d = begin;
      for (; d < begin + size - (size % Vec::size()); d += Vec::size()) {
        Vec p = Vec::loadu(P + d);
        Vec g = Vec::loadu(G + d);
        if (maximize) g = g * Vec(-1.0f);
        if (l2) g = at::vec::fmadd(p, Vec(wd), g);
        if (decay) p = p * Vec(shrink);
        Vec m = Vec::loadu(M + d);
        m = at::vec::fmadd(coeff, g - m, small ? m : g);
        Vec v = at::vec::fmadd(Vec(c2) * g, g, Vec::loadu(V + d) * Vec(b2));
        put(m, NM + d, stream);
        put(v, NV + d, stream);
        if (amsgrad) {
          v = at::vec::maximum(Vec::loadu(X + d), v);
          put(v, NX + d, stream);
        }
        const Vec denom = (v.sqrt() / Vec(bc2_sqrt)) + Vec(e);
        p = p + Vec(-step_size) * m / denom;
        put(p, NP + d, stream);
      }
      for (; d < end; ++d) {
        float g = maximize ? -G[d] : G[d];
        float p = P[d];
        if (l2) g = std::fma(p, wd, g);
        if (decay) p = p * shrink;
        const float m = small ? std::fma(c1, g - M[d], M[d]) : std::fma(-(g - M[d]), 1.0f - c1, g);
        float v = std::fma(V[d], b2, (c2 * g) * g);
        NM[d] = m;
        NV[d] = v;
        if (amsgrad) {
          v = std::max(X[d], v);
          NX[d] = v;
        }
        const float denom = std::sqrt(v) / bc2_sqrt + e;
        NP[d] = p - step_size * m / denom;
      }
    });
  }
}

// torch._fused_sgd_ after the first step (every momentum buffer exists): ``old`` = params[,
// momentum_buffers] before the step, ``out`` the same lists to write.
void sgd_out(const Lists& old, const std::vector<at::Tensor>& grads, const Lists& out,
             double lr, double momentum, double dampening, double weight_decay, bool nesterov,
             bool maximize, bool stream) {
  const float wd = float(weight_decay), mu = float(momentum), keep = float(1 - dampening);
  const float neg_lr = float(-lr);
  const bool has_momentum = momentum != 0.0;
  for (size_t j = 0; j < grads.size(); ++j) {
    const float* P = old[0][j].data_ptr<float>();
    const float* B = has_momentum ? old[1][j].data_ptr<float>() : nullptr;
    const float* G = grads[j].data_ptr<float>();
    float* NP = out[0][j].data_ptr<float>();
    float* NB = has_momentum ? out[1][j].data_ptr<float>() : nullptr;
    for_pieces(grads[j].numel(), [&](int64_t begin, int64_t end) {
      const int64_t size = end - begin;
      int64_t d = begin;
      for (; d < begin + size - (size % Vec::size()); d += Vec::size()) {
        const Vec p = Vec::loadu(P + d);
        Vec g = Vec::loadu(G + d);
        if (maximize) g = g * Vec(-1.0f);
        if (weight_decay != 0.0) g = at::vec::fmadd(p, Vec(wd), g);
        if (has_momentum) {
          const Vec b = at::vec::fmadd(g, Vec(keep), Vec::loadu(B + d) * Vec(mu));
          put(b, NB + d, stream);
          g = nesterov ? at::vec::fmadd(b, Vec(mu), g) : b;
        }
        put(at::vec::fmadd(g, Vec(neg_lr), p), NP + d, stream);
      }
      for (; d < end; ++d) {
        float g = maximize ? -G[d] : G[d];
        if (weight_decay != 0.0) g = std::fma(P[d], wd, g);
        if (has_momentum) {
          const float b = std::fma(B[d], mu, g * keep);
          NB[d] = b;
          g = nesterov ? std::fma(b, mu, g) : b;
        }
        NP[d] = std::fma(g, neg_lr, P[d]);
      }
    });
  }
}
"""
