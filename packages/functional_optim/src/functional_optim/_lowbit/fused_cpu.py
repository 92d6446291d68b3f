"""One-pass C++ step of Adam / AdamW with low-bit moments (``"int8"``, ``"fp8"``, ``"int4"``),
for fp32 params on CPU.

Block by block, in one pass over each parameter: decode the two moments (:mod:`.minifloat`;
``float8_e4m3fn`` by bit operations that round as torch's cast does; 4-bit codes through the
code map's value and cell tables), run Adam's maths (:func:`.adam_maths.adam_lists`'
operations, in its order, in fp32 without fused multiply-adds), keep the block's new moments in
a small buffer while taking their largest magnitudes, then encode them. torch has no such
kernel, and the element-wise torch ops that do the same work make about ten passes over memory.

The extension is built with :func:`torch.utils.cpp_extension.load_inline` the first time it is
needed (about 30 s; then cached by torch). Without a C++ compiler or ``ninja`` it is not
built, and the step takes the torch-op path instead: the same bits, several times slower.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from functional_optim._cpp_extension import ISA_FLAGS, load
from functional_optim._kernel_args import adam_args

__all__ = ["KINDS", "extension", "step"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float from_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline float decode_signed(uint8_t c) {
  uint32_t magnitude = c & 127u;
  float v = from_bits(((magnitude + 896u) << 20) | (uint32_t(c >> 7) << 31));
  return magnitude ? v : 0.0f;
}

inline float decode_unsigned(uint8_t c) {
  float v = from_bits((uint32_t(c) + 768u) << 20);
  return c ? v : 0.0f;
}

inline uint8_t encode_signed(float y) {
  uint32_t bits = to_bits(y);
  uint32_t magnitude = bits & 0x7FFFFFFFu;
  int32_t r = int32_t((magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) >> 20) - 896;
  int32_t floor = magnitude >= 0x37800000u ? 1 : 0;
  r = std::min(std::max(r, floor), 120);
  return uint8_t(uint32_t(r) | ((bits >> 24) & 128u));
}

inline uint8_t encode_unsigned(float y) {
  uint32_t bits = to_bits(y);
  int32_t r = int32_t((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - 768;
  r = std::min(std::max(r, 1), 248);
  return bits ? uint8_t(r) : uint8_t(0);
}

// float8_e4m3fn, as torch casts (round to nearest even, subnormals below 2**-6)
inline float decode_fp8(uint8_t c) {
  uint32_t magnitude = c & 127u, sign = uint32_t(c >> 7) << 31;
  uint32_t normal = ((magnitude + 960u) << 20) | sign;
  uint32_t subnormal = to_bits(float(int32_t(magnitude & 7u)) * 0.001953125f) | sign;  // 2**-9
  return from_bits((magnitude & 0x78u) ? normal : subnormal);
}

inline uint8_t encode_fp8(float y) {
  uint32_t bits = to_bits(y);
  uint32_t magnitude = bits & 0x7FFFFFFFu;
  int32_t normal = int32_t((magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) >> 20) - 960;
  // 2**-9 steps below 2**-6, rounded to nearest even by the fp32 addition of 1.5 * 2**23
  float scaled = std::fabs(y) * 512.0f + 12582912.0f;
  int32_t subnormal = int32_t(to_bits(scaled) & 0xFFu);
  int32_t r = magnitude < 0x3C800000u ? subnormal : normal;
  return uint8_t(uint32_t(r) | ((bits >> 24) & 128u));
}

constexpr float kFp8Max = 448.0f;

// The formats: decode(codes, element, block scale), and encode a block through a per-block
// factor, each as the torch-op path computes it (_lowbit/blockwise.py).
struct Int8Format {
  float decode_m(const uint8_t* c, int64_t i, float s) const { return decode_signed(c[i]) * s; }
  float decode_v(const uint8_t* c, int64_t i, float s) const {
    return decode_unsigned(c[i]) * s;
  }
  static float factor(float max) { return max > 0.0f ? 1.0f / max : 0.0f; }
  void encode(uint8_t* __restrict mc, uint8_t* __restrict vc, const float* __restrict m,
              const float* __restrict v, int64_t n, float mf, float vf) const {
    for (int64_t i = 0; i < n; ++i) {
      mc[i] = encode_signed(m[i] * mf);
      vc[i] = encode_unsigned(v[i] * vf);
    }
  }
};

struct Fp8Format {
  float decode_m(const uint8_t* c, int64_t i, float s) const {
    return (decode_fp8(c[i]) / kFp8Max) * s;
  }
  float decode_v(const uint8_t* c, int64_t i, float s) const { return decode_m(c, i, s); }
  static float factor(float max) { return max > 0.0f ? max : 1.0f; }  // the divisor
  void encode(uint8_t* __restrict mc, uint8_t* __restrict vc, const float* __restrict m,
              const float* __restrict v, int64_t n, float mf, float vf) const {
    for (int64_t i = 0; i < n; ++i) {
      mc[i] = encode_fp8((m[i] / mf) * kFp8Max);
      vc[i] = encode_fp8((v[i] / vf) * kFp8Max);
    }
  }
};

// 4-bit codes, two per byte (the even element in the low nibble): a value table, and the
// encoder's 65536-cell tables (the code at a cell's low end, the midpoint inside it).
struct Int4Map {
  const float* table;
  const int32_t* base;
  const float* split;
  uint8_t encode(float x) const {
    const int32_t cell = (int32_t(to_bits(x)) >> 16) + 32768;
    return uint8_t(base[cell] + (x > split[cell] ? 1 : 0));
  }
};

struct Int4Format {
  Int4Map m, v;
  float decode_m(const uint8_t* c, int64_t i, float s) const {
    return m.table[(c[i >> 1] >> ((i & 1) * 4)) & 15] * s;
  }
  float decode_v(const uint8_t* c, int64_t i, float s) const {
    return v.table[(c[i >> 1] >> ((i & 1) * 4)) & 15] * s;
  }
  static float factor(float max) { return max > 0.0f ? max : 1.0f; }  // the divisor
  void encode(uint8_t* mc, uint8_t* vc, const float* mx, const float* vx, int64_t n, float mf,
              float vf) const {
    for (int64_t i = 0; i < n; i += 2) {  // an odd tail pairs with padding: code 0
      const bool pair = i + 1 < n;
      const int high_m = pair ? m.encode(mx[i + 1] / mf) << 4 : 0;
      const int high_v = pair ? v.encode(vx[i + 1] / vf) << 4 : 0;
      mc[i >> 1] = uint8_t(m.encode(mx[i] / mf) | high_m);
      vc[i >> 1] = uint8_t(v.encode(vx[i] / vf) | high_v);
    }
  }
};

template <typename Format, bool kMaximize, bool kL2>
void adam_block(const Format& fmt, float* __restrict p, const float* __restrict g,
                uint8_t* __restrict mc, float* ms, uint8_t* __restrict vc, float* vs, int64_t n,
                float* __restrict mbuf, float* __restrict vbuf, float w1, float b2, float w2,
                float eps, float decay, float l2, float step_size, float bc2_sqrt) {
  const float dm = *ms, dv = *vs;
  uint32_t mmax_bits = 0, vmax_bits = 0;  // non-negative floats order as their bit patterns
  for (int64_t i = 0; i < n; ++i) {
    float grad = kMaximize ? -g[i] : g[i];
    const float param = p[i];
    if (kL2) grad = grad + param * l2;
    float m = fmt.decode_m(mc, i, dm);
    float v = fmt.decode_v(vc, i, dv);
    m = m + (grad - m) * w1;
    v = v * b2 + (grad * grad) * w2;
    float denom = std::sqrt(v) / bc2_sqrt + eps;
    p[i] = param * decay - (m / denom) * step_size;
    mbuf[i] = m;
    vbuf[i] = v;
    mmax_bits = std::max(mmax_bits, to_bits(m) & 0x7FFFFFFFu);
    vmax_bits = std::max(vmax_bits, to_bits(v));
  }
  const float mmax = from_bits(mmax_bits), vmax = from_bits(vmax_bits);
  *ms = mmax;
  *vs = vmax;
  fmt.encode(mc, vc, mbuf, vbuf, n, Format::factor(mmax), Format::factor(vmax));
}

struct Step {
  float w1, b2, w2, eps, decay, l2;
};

// One parameter: its blocks in parallel.
template <typename Format, bool kMaximize, bool kL2>
void adam_param(const Format& fmt, const Step& h, float* p, const float* g, uint8_t* mc,
                float* ms, uint8_t* vc, float* vs, int64_t n, int64_t block_size,
                int64_t per_byte, float step_size, float bc2_sqrt) {
  const int64_t blocks = (n + block_size - 1) / block_size;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 4096 / block_size),
                   [&](int64_t first, int64_t last) {
    std::vector<float> mbuf(block_size), vbuf(block_size);
    for (int64_t b = first; b < last; ++b) {
      const int64_t lo = b * block_size;
      const int64_t len = std::min(block_size, n - lo);
      adam_block<Format, kMaximize, kL2>(fmt, p + lo, g + lo, mc + lo / per_byte, ms + b,
                                         vc + lo / per_byte, vs + b, len, mbuf.data(),
                                         vbuf.data(), h.w1, h.b2, h.w2, h.eps, h.decay, h.l2,
                                         step_size, bc2_sqrt);
    }
  });
}

template <typename Format>
void adam_param_any(const Format& fmt, const Step& h, bool maximize, float* p, const float* g,
                    uint8_t* mc, float* ms, uint8_t* vc, float* vs, int64_t n,
                    int64_t block_size, int64_t per_byte, float step_size, float bc2_sqrt) {
  const bool l2 = h.l2 != 0.0f;
  if (maximize && l2) {
    adam_param<Format, true, true>(fmt, h, p, g, mc, ms, vc, vs, n, block_size, per_byte,
                                   step_size, bc2_sqrt);
  } else if (maximize) {
    adam_param<Format, true, false>(fmt, h, p, g, mc, ms, vc, vs, n, block_size, per_byte,
                                    step_size, bc2_sqrt);
  } else if (l2) {
    adam_param<Format, false, true>(fmt, h, p, g, mc, ms, vc, vs, n, block_size, per_byte,
                                    step_size, bc2_sqrt);
  } else {
    adam_param<Format, false, false>(fmt, h, p, g, mc, ms, vc, vs, n, block_size, per_byte,
                                     step_size, bc2_sqrt);
  }
}

}  // namespace

bool adam_lowbit_fits(const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& m_codes,
                    const std::vector<at::Tensor>& m_scales,
                    const std::vector<at::Tensor>& v_codes,
                    const std::vector<at::Tensor>& v_scales,
                    const std::vector<at::Tensor>& steps, int64_t block_size,
                    int64_t per_byte) {
  const size_t count = params.size();
  if (grads.size() != count || m_codes.size() != count || m_scales.size() != count ||
      v_codes.size() != count || v_scales.size() != count || steps.size() != count) {
    return false;
  }
  auto plain = [](const at::Tensor& t, at::ScalarType dtype) {
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
           t.scalar_type() == dtype && t.is_contiguous() && !t.is_neg() && !t.is_conj();
  };
  for (size_t j = 0; j < count; ++j) {
    const int64_t n = params[j].numel();
    const int64_t blocks = (n + block_size - 1) / block_size;
    if (!plain(params[j], at::kFloat) || !plain(grads[j], at::kFloat) ||
        grads[j].numel() != n || !plain(m_codes[j], at::kByte) ||
        !plain(v_codes[j], at::kByte) || m_codes[j].numel() != blocks * block_size / per_byte ||
        v_codes[j].numel() != blocks * block_size / per_byte || !plain(m_scales[j], at::kFloat) ||
        !plain(v_scales[j], at::kFloat) || m_scales[j].numel() != blocks ||
        v_scales[j].numel() != blocks || steps[j].numel() != 1 ||
        !steps[j].device().is_cpu()) {
      return false;
    }
  }
  return true;
}

void adam_lowbit_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                      std::vector<at::Tensor> m_codes, std::vector<at::Tensor> m_scales,
                      std::vector<at::Tensor> v_codes, std::vector<at::Tensor> v_scales,
                      std::vector<at::Tensor> steps, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool decoupled, bool maximize,
                      int64_t block_size, int64_t kind, std::vector<at::Tensor> int4_maps) {
  Step h;
  h.w1 = float(1.0 - beta1);
  h.b2 = float(beta2);
  h.w2 = float(1.0 - beta2);
  h.eps = float(eps);
  h.decay = decoupled ? float(1.0 - lr * weight_decay) : 1.0f;
  h.l2 = decoupled ? 0.0f : float(weight_decay);
  Int4Format int4{};
  if (kind == 2) {
    auto map = [&](int64_t k) {
      return Int4Map{int4_maps[k].data_ptr<float>(), int4_maps[k + 1].data_ptr<int32_t>(),
                     int4_maps[k + 2].data_ptr<float>()};
    };
    int4 = Int4Format{map(0), map(3)};
  }
  const int64_t per_byte = kind == 2 ? 2 : 1;
  for (size_t j = 0; j < params.size(); ++j) {
    const double t = steps[j].item<double>() + 1.0;
    const float step_size = float(lr / (1.0 - std::pow(beta1, t)));
    const float bc2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, t)));
    float* p = params[j].data_ptr<float>();
    const float* g = grads[j].data_ptr<float>();
    uint8_t* mc = m_codes[j].data_ptr<uint8_t>();
    uint8_t* vc = v_codes[j].data_ptr<uint8_t>();
    float* ms = m_scales[j].data_ptr<float>();
    float* vs = v_scales[j].data_ptr<float>();
    const int64_t n = params[j].numel();
    if (kind == 0) {
      adam_param_any(Int8Format{}, h, maximize, p, g, mc, ms, vc, vs, n, block_size, per_byte,
                     step_size, bc2_sqrt);
    } else if (kind == 1) {
      adam_param_any(Fp8Format{}, h, maximize, p, g, mc, ms, vc, vs, n, block_size, per_byte,
                     step_size, bc2_sqrt);
    } else {
      adam_param_any(int4, h, maximize, p, g, mc, ms, vc, vs, n, block_size, per_byte,
                     step_size, bc2_sqrt);
    }
    steps[j].fill_(t);
  }
}
"""


@functools.cache
def extension() -> Any | None:
    """The built extension module, or None where it cannot be built (logged once)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    on_x86 = platform.machine() in ("x86_64", "AMD64")
    isa = ISA_FLAGS.get(capability, []) if on_x86 else []
    name = f"functional_optim_lowbit_{capability.lower()}"
    return load(name, _SOURCE, ["adam_lowbit_fits", "adam_lowbit_step"], isa, threads=True)


#: the kinds the C++ step takes, and their number there
KINDS = {"int8": 0, "fp8": 1, "int4": 2}


def step(
    module: Any,
    args: Sequence[Any],
    moments: Sequence[Sequence[Tensor]],
    decoupled: bool,
    block_size: int,
    kind: str,
    int4_maps: Sequence[Tensor] = (),
) -> bool:
    """Run the C++ step for an Adam kernel's ``args`` with ``moments`` (``[m_codes, m_scales,
    v_codes, v_scales]`` lists): checks every tensor first and returns False, with nothing
    changed, where one does not fit (not a contiguous fp32 CPU tensor, or the wrong size).

    Args:
        module: the extension.
        args: the replaced kernel's arguments.
        moments: the codes and scales lists.
        decoupled: AdamW's weight decay.
        block_size: elements per block.
        kind: a key of :data:`KINDS`.
        int4_maps: for ``"int4"``, the value table, cell codes and cell midpoints of the first
            moment's map, then of the second's.
    """
    a = adam_args(args)
    lists = [list(a.params), list(a.grads), *map(list, moments), list(a.state_steps)]
    per_byte = 2 if kind == "int4" else 1
    if not module.adam_lowbit_fits(*lists, block_size, per_byte):
        return False
    scalars = (a.lr, a.beta1, a.beta2, a.eps, a.weight_decay)
    hyper = (*map(float, scalars), decoupled, bool(a.maximize))
    module.adam_lowbit_step(*lists, *hyper, block_size, KINDS[kind], list(int4_maps))
    return True
