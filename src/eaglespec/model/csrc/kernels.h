// The engine's kernels called from C++ (csrc/layer.cpp's fused forward): rows by pointer,
// outputs into the caller's buffers, no op, no tensor and no check of their own. The functions
// behind the ops (w4a8.cpp's linear, rowops.cpp's rms_norm, silu_mul and rope_write,
// attention.cpp's attend), so the same bits as the ops; each is defined beside its op, for T
// float and at::BFloat16. Built into one library with the kernels (model/extension.py).
//
// What the ops add, and a forward called through them pays at every call (about 1.5 ms of a
// 7.5 ms SmolLM2 decode step on a 2-core VM, session 57: 600-odd dispatcher calls, output
// allocations, views and checks): the arguments' checks, which the caller makes once
// (w4a8_check), and an output tensor each.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace kernels {

// y (M, N) = x (M, K) W^T through the w4a8 kernel (bits 4: linear) or the w8a8 one (bits 8:
// linear8), W packed as they pack it; plus residual (M, N) where not null (linear_add's bits).
// Rows contiguous.
template <typename T>
void w4a8_rows(int bits, const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y,
               const T* residual);

// The checks linear makes of a packed weight for K inputs and N outputs (a clear error).
void w4a8_check(const at::Tensor& w, int64_t K, int64_t N, int bits);

// The bits a packed weight for K inputs and N outputs is stored at, told by its size (4: as
// linear packs it, 8: as linear8 does; the two differ for every K and N); 0 for neither.
int packed_bits(const at::Tensor& w, int64_t K, int64_t N);

// y (M, C) = rms_norm(x (M, C)) * w (C) in W = float or T, as rowops' rms_norm.
template <typename T, typename W>
void rms_norm_rows(const T* x, const W* w, T* y, int64_t M, int64_t C, float eps);

// y (M, I) = silu(x[:, :I]) * x[:, I:] for rows of 2I at stride `stride`, as rowops' silu_mul.
template <typename T>
void silu_mul_rows(const T* x, int64_t stride, int64_t M, int64_t I, T* y);

// rowops' rope_write on checked arguments: qkv, cos, sin, the caches, slots and q as it takes
// them (q (B, T, H, D) its output).
template <typename T>
void rope_write_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                     at::Tensor& q);

// attention's attend on checked arguments (q (B, H, T, D); k, v (B, Hkv, K, D), unit stride
// over D) into out (B, T, H, D) contiguous.
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& mask, double scale, at::Tensor& out);

// x (..., V) fp32 -> (...) int64: each row's index of its first maximum, as rowops' argmax.
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace kernels
