// One decoder layer of an eager CPU decode or verification step in one call: the ops of
// eaglespec/model/llama.py's Block.forward, in its order, for a layer whose four matrices are w4a8
// (eaglespec/model/cpu_layer.py has the why and the measurements).
//
//   h = rms_norm(x); qkv = w4a8(h) (+ bias); q = rope_write(qkv -> cache); a = attend(q, cache)
//   x = x + w4a8(a) (+ bias); h = rms_norm(x); g, u = w4a8(h) (+ bias); x = x + w4a8(silu_mul(g, u))
//
// The same ops as the Python forward (eaglespec's kernels, SwiGLU's included (rowops'
// silu_mul); ATen for the adds and Gemma's GeGLU; a residual add after a matrix without a bias is
// the kernel's own, `linear_add`, with ATen's bits), so the same bits: what this saves is Python,
// about 50 us a layer. A layer without biases, or with Qwen2's q/k/v bias alone, calls the
// kernels directly (native_layer, through kernels.h: the same functions, without an op, output
// tensor and view each; a decoder whose layers all do so runs them in one pass over buffers made
// once a forward, native_stack); others call them through the dispatcher. Gemma 3's sandwich
// layers likewise (sandwich_rows; a whole decoder of them: sandwich_decoder). Every op runs a
// forward of few rows in one team of threads (team.h, Teamed below).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"  // the kernels called directly (native_layer)
#include "team.h"     // each op's forward in one team of threads where it has few rows

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using LinearAdd = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using RopeWrite = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                             at::Tensor, const at::Tensor&);
using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const std::optional<at::Tensor>&, double);

// The other eaglespec ops, looked up once (their libraries are loaded before this one is used).
struct Ops {
  c10::TypedOperatorHandle<Linear> linear;
  c10::TypedOperatorHandle<Linear> linear8;
  c10::TypedOperatorHandle<LinearAdd> linear_add;
  c10::TypedOperatorHandle<Norm> rms_norm;
  c10::TypedOperatorHandle<RopeWrite> rope_write;
  c10::TypedOperatorHandle<Attend> attend;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;
};

const Ops& ops() {
  static const Ops o{
      c10::Dispatcher::singleton().findSchemaOrThrow("eaglespec_w4a8::linear", "").typed<Linear>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("eaglespec_w4a8::linear8", "").typed<Linear>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglespec_w4a8::linear_add", "")
          .typed<LinearAdd>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("eaglespec_rowops::rms_norm", "").typed<Norm>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglespec_rowops::rope_write", "")
          .typed<RopeWrite>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglespec_attention::attend", "")
          .typed<Attend>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglespec_rowops::silu_mul", "")
          .typed<at::Tensor(const at::Tensor&)>(),
  };
  return o;
}

// (M, K) rows through a w4a8 matrix of N outputs stored at `bits` (4: linear, 8: linear8, as
// w4a8-mixed and the output heads store them); `what` names the matrix in the error.
at::Tensor project_bits(const at::Tensor& x2, const at::Tensor& w, int64_t bits, int64_t N,
                        const char* what) {
  TORCH_CHECK(bits == 4 || bits == 8, what, ": a 4- or 8-bit matrix, got ", bits, " bits");
  return bits == 4 ? ops().linear.call(x2, w, N) : ops().linear8.call(x2, w, N);
}

// (M, K) rows through one matrix of N outputs, 4-bit (linear) or 8-bit (linear8, as w4a8-mixed
// stores some of a layer's matrices: the packed size tells which), plus the bias in the model's
// dtype.
at::Tensor project(const at::Tensor& x2, const at::Tensor& w, const std::optional<at::Tensor>& b,
                   int64_t N) {
  const bool eight = kernels::packed_bits(w, x2.size(1), N) == 8;
  at::Tensor y = eight ? ops().linear8.call(x2, w, N) : ops().linear.call(x2, w, N);
  return b.has_value() ? y + *b : y;
}

// residual + project(x2, w, b, N): without a bias through the 4-bit kernel's own add
// (linear_add, the same bits as ATen's add of the two), else as ATen adds.
at::Tensor project_add(const at::Tensor& x2, const at::Tensor& w,
                       const std::optional<at::Tensor>& b, int64_t N, const at::Tensor& residual) {
  if (b.has_value() || kernels::packed_bits(w, x2.size(1), N) == 8)
    return residual + project(x2, w, b, N);
  return ops().linear_add.call(x2, w, N, residual);
}

// Whether layer_from runs its kernels directly (native_layer) where it can, from now on
// (`use_native`, the default); the ops' way otherwise. The same bits either way.
std::atomic<bool> native_wanted{true};

// Layers run with their kernels called directly since the process began (`native_layers`): what
// tests read to know that the direct path, not the ops', gave the bits they compare.
std::atomic<int64_t> native_count{0};

// y (n) = a (n) + b (n) as ATen adds two tensors of T: in fp32, rounded once to T.
template <typename T>
void add_rows(const T* a, const T* b, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// y (M, N) += b (N), each row as add_rows.
template <typename T>
void add_bias(T* y, const T* b, int64_t M, int64_t N) {
  for (int64_t m = 0; m < M; ++m) add_rows<T>(y + m * N, b, y + m * N, N);
}

// Whether a norm's weight w is one the norm kernel takes for rows of C values of dtype dt
// (norm_rows): C values of dt or fp32, contiguous, on the CPU.
bool norm_fits(const at::Tensor& w, at::ScalarType dt, int64_t C) {
  return (w.scalar_type() == dt || w.scalar_type() == at::kFloat) && w.is_contiguous() &&
         w.numel() == C && w.device().is_cpu();
}

// A matrix's bits (4 or 8, as w4a8-mixed stores it: its packed size tells), after linear's checks
// of it (a clear error where it is neither).
int matrix_bits(const at::Tensor& w, int64_t K, int64_t N) {
  const int bits = kernels::packed_bits(w, K, N);
  kernels::w4a8_check(w, K, N, bits == 0 ? 4 : bits);
  return bits;
}

// y (M, C) = rms_norm(x (M, C)) * w (C), w fp32 or T: the rms_norm op's kernel, called directly.
template <typename T>
void norm_rows(const T* x, const at::Tensor& w, T* y, int64_t M, int64_t C, double eps) {
  if (w.scalar_type() == at::kFloat)
    kernels::rms_norm_rows<T, float>(x, w.data_ptr<float>(), y, M, C, static_cast<float>(eps));
  else
    kernels::rms_norm_rows<T, T>(x, w.data_ptr<T>(), y, M, C, static_cast<float>(eps));
}

// Each of R tokens' query heads (H rows of D) and key heads (Hkv rows) in the fused q/k/v rows
// (R, n_qkv) normed in place (each row is read whole before it is written), the queries then
// multiplied by q_ratio where it is not 1, as ATen multiplies a tensor of T by a float (in fp32,
// rounded once): Attention's q_norm, k_norm and query scale (Qwen3, Gemma 3).
template <typename T>
void norm_heads(T* qkv, int64_t R, int64_t n_qkv, int64_t H, int64_t Hkv, int64_t D,
                const at::Tensor& q_norm, const at::Tensor& k_norm, double eps, double q_ratio) {
  const float ratio = static_cast<float>(q_ratio);
  for (int64_t r = 0; r < R; ++r) {
    T* q = qkv + r * n_qkv;
    norm_rows<T>(q, q_norm, q, H, D, eps);
    if (q_ratio != 1.0)
      for (int64_t i = 0; i < H * D; ++i) q[i] = static_cast<T>(static_cast<float>(q[i]) * ratio);
    norm_rows<T>(q + H * D, k_norm, q + H * D, Hkv, D, eps);
  }
}

// Whether a layer's q/k norms (both or neither) can be applied by norm_heads: weights of D in the
// rows' dtype or fp32, contiguous.
bool qk_fits(const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
             at::ScalarType dt, int64_t D) {
  if (q_norm.has_value() != k_norm.has_value()) return false;
  return !q_norm.has_value() || (norm_fits(*q_norm, dt, D) && norm_fits(*k_norm, dt, D));
}

// native_rows' scratch for B x T rows: q/k/v, the rotated queries, attention's output,
// residual + wo(a), its MLP norm, gate and up, silu(gate) * up.
struct LayerBuffers {
  at::Tensor qkv, q, qt, a, x_attn, h2, gu, act;
  LayerBuffers(int64_t B, int64_t T_, int64_t H, int64_t Hkv, int64_t D, int64_t C, int64_t n_13,
               const at::TensorOptions& opts)
      : qkv(at::empty({B, T_, H + 2 * Hkv, D}, opts)),
        q(at::empty({B, T_, H, D}, opts)),
        qt(q.transpose(1, 2)),
        a(at::empty({B, T_, H, D}, opts)),
        x_attn(at::empty({B, T_, C}, opts)),
        h2(at::empty({B * T_, C}, opts)),
        gu(at::empty({B * T_, n_13}, opts)),
        act(at::empty({B * T_, n_13 / 2}, opts)) {}
};

// One layer from its attention input on, its kernels called directly (kernels.h): h (R, Cin)
// the normed input of q/k/v, residual (R, C) what attention's output is added to; the layer's
// output (R, C) into `out`. Each matrix at its `bits` (matrix_bits); q_norm and k_norm (both
// or neither) norm each head's queries and keys before RoPE (Qwen3).
template <typename T>
void native_rows(LayerBuffers& buf, const T* residual, const T* h, int64_t Cin,
                 const at::Tensor& mlp_norm, double eps, const at::Tensor& wqkv, int b_qkv,
                 const std::optional<at::Tensor>& bqkv, int64_t n_qkv, const at::Tensor& wo,
                 int b_o, const at::Tensor& w13, int b_13, int64_t n_13, const at::Tensor& w2,
                 int b_2, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slots, int64_t num_keys,
                 const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& q_norm,
                 const std::optional<at::Tensor>& k_norm, T* out) {
  const int64_t R = buf.x_attn.size(0) * buf.x_attn.size(1), C = buf.x_attn.size(2);
  const int64_t H = buf.q.size(2), D = buf.q.size(3), I = n_13 / 2;
  kernels::w4a8_rows<T>(b_qkv, h, R, Cin, wqkv.data_ptr<uint8_t>(), n_qkv, buf.qkv.data_ptr<T>(),
                        nullptr);
  if (bqkv.has_value()) add_bias<T>(buf.qkv.data_ptr<T>(), bqkv->data_ptr<T>(), R, n_qkv);
  if (q_norm.has_value())  // Qwen3's per-head norms, after the bias as Attention.forward
    norm_heads<T>(buf.qkv.data_ptr<T>(), R, n_qkv, H, k_cache.size(1), D, *q_norm, *k_norm, eps,
                  1.0);
  kernels::rope_write_rows<T>(buf.qkv, cos, sin, k_cache, v_cache, slots, buf.q);
  kernels::attend_into(buf.qt, k_cache.narrow(2, 0, num_keys), v_cache.narrow(2, 0, num_keys),
                       mask, std::pow(double(D), -0.5), buf.a);
  kernels::w4a8_rows<T>(b_o, buf.a.data_ptr<T>(), R, H * D, wo.data_ptr<uint8_t>(), C,
                        buf.x_attn.data_ptr<T>(), residual);
  norm_rows<T>(buf.x_attn.data_ptr<T>(), mlp_norm, buf.h2.data_ptr<T>(), R, C, eps);
  kernels::w4a8_rows<T>(b_13, buf.h2.data_ptr<T>(), R, C, w13.data_ptr<uint8_t>(), n_13,
                        buf.gu.data_ptr<T>(), nullptr);
  kernels::silu_mul_rows<T>(buf.gu.data_ptr<T>(), n_13, R, I, buf.act.data_ptr<T>());
  kernels::w4a8_rows<T>(b_2, buf.act.data_ptr<T>(), R, I, w2.data_ptr<uint8_t>(), C, out,
                        buf.x_attn.data_ptr<T>());
}

// The row type's layer from its attention input on, as layer_from below, its kernels called
// directly (kernels.h): the same functions on the same rows as through the ops, so the same bits,
// without an op call, output tensor, view and check for each (about 1.5 ms of a 7.5 ms SmolLM2
// decode step on a 2-core VM, session 57). For layers without biases but q/k/v's (added as ATen
// adds it), with contiguous rows and the model's dtype throughout; layer_from checks that and
// otherwise goes through the ops.
template <typename T>
at::Tensor native_layer(const at::Tensor& residual, const at::Tensor& h, const at::Tensor& mlp_norm,
                        double eps, const at::Tensor& wqkv, const std::optional<at::Tensor>& bqkv,
                        int64_t n_qkv, const at::Tensor& wo, const at::Tensor& w13,
                        int64_t n_13, const at::Tensor& w2,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slots, int64_t num_keys,
                        const std::optional<at::Tensor>& mask, int64_t num_heads,
                        const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm) {
  const int64_t B = residual.size(0), T_ = residual.size(1), C = residual.size(2);
  const int64_t Cin = h.size(2), Hkv = k_cache.size(1), D = k_cache.size(3), H = num_heads;
  const int b_qkv = matrix_bits(wqkv, Cin, n_qkv), b_o = matrix_bits(wo, H * D, C);
  const int b_13 = matrix_bits(w13, C, n_13), b_2 = matrix_bits(w2, n_13 / 2, C);
  LayerBuffers buf(B, T_, H, Hkv, D, C, n_13, residual.options());
  at::Tensor out = at::empty({B, T_, C}, residual.options());  // x_attn + w2(act)
  native_count.fetch_add(1, std::memory_order_relaxed);
  native_rows<T>(buf, residual.data_ptr<T>(), h.data_ptr<T>(), Cin, mlp_norm, eps, wqkv, b_qkv,
                 bqkv, n_qkv, wo, b_o, w13, b_13, n_13, w2, b_2, cos, sin, k_cache, v_cache, slots,
                 num_keys, mask, q_norm, k_norm, out.data_ptr<T>());
  return out;
}

// Whether native_layer takes this layer: no biases but q/k/v's (Qwen2's); residual, h, the norm's
// weight, the bias, rope and the caches in one dtype (fp32 or bf16; the norm's weight may be
// fp32), residual, h and the bias contiguous; the arguments rope_write and attention check
// (shapes, slots, mask) as they check them, so that a bad one reaches the op that says what.
bool native_fits(const at::Tensor& residual, const at::Tensor& h, const at::Tensor& mlp_norm,
                 const at::Tensor& wqkv, int64_t n_qkv, const at::Tensor& wo,
                 const at::Tensor& w13, const at::Tensor& w2,
                 const std::optional<at::Tensor>& bqkv, const std::optional<at::Tensor>& bo,
                 const std::optional<at::Tensor>& b13, const std::optional<at::Tensor>& b2,
                 const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& slots, int64_t num_keys,
                 const std::optional<at::Tensor>& mask, int64_t num_heads, int64_t n_13) {
  if (!native_wanted.load(std::memory_order_relaxed)) return false;
  if (bo.has_value() || b13.has_value() || b2.has_value()) return false;
  const auto dt = residual.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16) return false;
  if (bqkv.has_value() && (bqkv->scalar_type() != dt || !bqkv->is_contiguous() ||
                           bqkv->dim() != 1 || !bqkv->device().is_cpu()))
    return false;
  for (const at::Tensor* t : {&h, &cos, &sin, &k_cache, &v_cache})
    if (t->scalar_type() != dt || !t->device().is_cpu()) return false;
  if (!norm_fits(mlp_norm, dt, residual.size(2))) return false;
  if (!residual.is_contiguous() || !h.is_contiguous()) return false;
  if (!cos.is_contiguous() || !sin.is_contiguous() || !slots.is_contiguous()) return false;
  if (slots.scalar_type() != at::kLong || k_cache.dim() != 4 || v_cache.dim() != 4) return false;
  if (k_cache.stride(3) != 1 || v_cache.stride(3) != 1 || k_cache.stride(1) != v_cache.stride(1))
    return false;
  const int64_t B = residual.size(0), T_ = residual.size(1), C = residual.size(2);
  const int64_t D = k_cache.size(3), S = k_cache.size(2);
  if (n_13 % 2 != 0 || D % 32 != 0 || num_heads % k_cache.size(1) != 0)
    return false;
  if (bqkv.has_value() && bqkv->numel() != (num_heads + 2 * k_cache.size(1)) * D) return false;
  if (k_cache.sizes() != v_cache.sizes() || k_cache.size(0) != B) return false;
  if (cos.numel() != B * T_ * D || sin.numel() != B * T_ * D || slots.numel() != B * T_)
    return false;
  if (num_keys < 0 || num_keys > S) return false;
  if (kernels::packed_bits(wqkv, h.size(2), n_qkv) == 0 ||
      kernels::packed_bits(wo, num_heads * D, C) == 0 ||
      kernels::packed_bits(w13, C, n_13) == 0 || kernels::packed_bits(w2, n_13 / 2, C) == 0)
    return false;  // the checks say what is wrong
  if (mask.has_value() &&
      (mask->scalar_type() != at::kBool || mask->dim() != 4 || mask->size(0) != B ||
       mask->size(1) != 1 || mask->size(2) != T_ || mask->size(3) != num_keys))
    return false;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T_; ++i)
    if (sp[i] < 0 || sp[i] >= S) return false;  // the op says which slot
  return true;
}

}  // namespace

// The layer from its attention input on: h (B, T, Cin) the normed input of the q/k/v projection,
// residual (B, T, C) what attention's output is added to; then the MLP block. Block.forward has
// h = rms_norm(x) and residual = x; the EAGLE-3 head's first layer h = [norm(embedding),
// norm(g)] (Cin = 2C) and residual = g or norm(g). q_norm and k_norm (both or neither): each
// head's queries and keys normed before RoPE (Qwen3's Attention).
at::Tensor layer_from(const at::Tensor& residual, const at::Tensor& h, const at::Tensor& mlp_norm,
                      double eps, const at::Tensor& wqkv, const std::optional<at::Tensor>& bqkv,
                      int64_t n_qkv, const at::Tensor& wo, const std::optional<at::Tensor>& bo,
                      const at::Tensor& w13, const std::optional<at::Tensor>& b13, int64_t n_13,
                      const at::Tensor& w2, const std::optional<at::Tensor>& b2,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                      at::Tensor v_cache, const at::Tensor& slots, int64_t num_keys,
                      const std::optional<at::Tensor>& mask, int64_t num_heads,
                      const std::optional<at::Tensor>& q_norm,
                      const std::optional<at::Tensor>& k_norm) {
  const Ops& o = ops();
  const int64_t B = residual.size(0), T = residual.size(1), C = residual.size(2);
  const int64_t Hkv = k_cache.size(1), D = k_cache.size(3), H = num_heads;
  TORCH_CHECK(n_qkv == (H + 2 * Hkv) * D, "layer: qkv outputs ", n_qkv, " for ", H, " + 2 x ",
              Hkv, " heads of ", D);
  TORCH_CHECK(h.dim() == 3 && h.size(0) == B && h.size(1) == T, "layer: attention input ",
              h.sizes(), " for a residual of ", residual.sizes());
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "layer: a q norm needs a k norm");
  if (native_fits(residual, h, mlp_norm, wqkv, n_qkv, wo, w13, w2, bqkv, bo, b13, b2, cos, sin,
                  k_cache, v_cache, slots, num_keys, mask, num_heads, n_13) &&
      qk_fits(q_norm, k_norm, residual.scalar_type(), D)) {
    if (residual.scalar_type() == at::kBFloat16)
      return native_layer<at::BFloat16>(residual, h, mlp_norm, eps, wqkv, bqkv, n_qkv, wo, w13,
                                        n_13, w2, cos, sin, k_cache, v_cache, slots, num_keys,
                                        mask, num_heads, q_norm, k_norm);
    return native_layer<float>(residual, h, mlp_norm, eps, wqkv, bqkv, n_qkv, wo, w13, n_13, w2,
                               cos, sin, k_cache, v_cache, slots, num_keys, mask, num_heads,
                               q_norm, k_norm);
  }
  const at::Tensor x2 = residual.reshape({B * T, C});
  at::Tensor qkv = project(h.reshape({B * T, h.size(2)}), wqkv, bqkv, n_qkv)
                       .view({B, T, H + 2 * Hkv, D});
  if (q_norm.has_value())  // Attention.forward's q_norm(q), k_norm(k) and cat
    qkv = at::cat({o.rms_norm.call(qkv.narrow(2, 0, H), *q_norm, eps),
                   o.rms_norm.call(qkv.narrow(2, H, Hkv), *k_norm, eps),
                   qkv.narrow(2, H + Hkv, Hkv)},
                  2);
  const at::Tensor q = o.rope_write.call(qkv, cos, sin, k_cache, v_cache, slots).transpose(1, 2);
  const at::Tensor keys = k_cache.narrow(2, 0, num_keys), values = v_cache.narrow(2, 0, num_keys);
  // attend returns (B, H, T, D) as a view of a contiguous (B, T, H, D): the rows wo reads
  const at::Tensor a = o.attend.call(q, keys, values, mask, std::pow(double(D), -0.5));  // D ** -0.5
  const at::Tensor x_attn = project_add(a.transpose(1, 2).reshape({B * T, H * D}), wo, bo, C, x2);
  const at::Tensor h2 = o.rms_norm.call(x_attn, mlp_norm, eps);
  const at::Tensor gu = project(h2, w13, b13, n_13);
  const at::Tensor act = o.silu_mul.call(gu);  // silu(gate) * up, (B T, n_13 / 2)
  return project_add(act, w2, b2, C, x_attn).view({B, T, C});
}

// x (B, T, C); the layer's norms' weights and eps; its packed w4a8 matrices with their output
// sizes and optional biases; cos, signed sin (B, T, 1, D); this layer's caches (B, Hkv, S, D);
// slots (B, T); the keys to attend (K) and the mask (B, 1, T, K) or None -> x after the layer.
at::Tensor layer_forward(const at::Tensor& x, const at::Tensor& attn_norm, const at::Tensor& mlp_norm,
                         double eps, const at::Tensor& wqkv, const std::optional<at::Tensor>& bqkv,
                         int64_t n_qkv, const at::Tensor& wo, const std::optional<at::Tensor>& bo,
                         const at::Tensor& w13, const std::optional<at::Tensor>& b13,
                         int64_t n_13, const at::Tensor& w2, const std::optional<at::Tensor>& b2,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slots, int64_t num_keys,
                         const std::optional<at::Tensor>& mask, int64_t num_heads,
                         const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const at::Tensor h = ops().rms_norm.call(x.reshape({B * T, C}), attn_norm, eps);
  return layer_from(x, h.view({B, T, C}), mlp_norm, eps, wqkv, bqkv, n_qkv, wo, bo, w13, b13,
                    n_13, w2, b2, cos, sin, k_cache, v_cache, slots, num_keys, mask, num_heads,
                    q_norm, k_norm);
}

// A decoder's layers, held by the model's Python side (cpu_layer.StackArgs) and passed to the
// stack and decoder ops as one object: each layer's norms, matrices (4-bit) and biases (None
// without), q/k norms (None without), and what the layers share (eps, the q/k/v and gate/up
// output sizes, the query heads). Passed as lists at every call, the 360-odd tensors of
// SmolLM2's 30 layers cost about 0.4 ms of each decode step in their conversion to and from the
// dispatcher's values.
struct Stack : torch::CustomClassHolder {
  std::vector<at::Tensor> attn_norms, mlp_norms, wqkv, wo, w13, w2;
  c10::List<std::optional<at::Tensor>> bqkv, bo, b13, b2, q_norms, k_norms;
  double eps;
  int64_t n_qkv, n_13, num_heads;

  Stack(std::vector<at::Tensor> attn_norms, std::vector<at::Tensor> mlp_norms, double eps,
        std::vector<at::Tensor> wqkv, c10::List<std::optional<at::Tensor>> bqkv, int64_t n_qkv,
        std::vector<at::Tensor> wo, c10::List<std::optional<at::Tensor>> bo,
        std::vector<at::Tensor> w13, c10::List<std::optional<at::Tensor>> b13, int64_t n_13,
        std::vector<at::Tensor> w2, c10::List<std::optional<at::Tensor>> b2, int64_t num_heads,
        c10::List<std::optional<at::Tensor>> q_norms, c10::List<std::optional<at::Tensor>> k_norms)
      : attn_norms(std::move(attn_norms)), mlp_norms(std::move(mlp_norms)), wqkv(std::move(wqkv)),
        wo(std::move(wo)), w13(std::move(w13)), w2(std::move(w2)), bqkv(std::move(bqkv)),
        bo(std::move(bo)), b13(std::move(b13)), b2(std::move(b2)), q_norms(std::move(q_norms)),
        k_norms(std::move(k_norms)), eps(eps), n_qkv(n_qkv), n_13(n_13), num_heads(num_heads) {
    const size_t L = this->wqkv.size();
    for (const size_t n : {this->attn_norms.size(), this->mlp_norms.size(), this->bqkv.size(),
                           this->wo.size(), this->bo.size(), this->w13.size(), this->b13.size(),
                           this->w2.size(), this->b2.size(), this->q_norms.size(),
                           this->k_norms.size()})
      TORCH_CHECK(n == L, "stack: ", L, " layers, but a list of ", n);
  }
};

namespace {

// A decoder forward's results: out[0] its output, out[1 + c] the state at boundary capture[c]
// (boundary b: the input of layer b, the output after the last layer at b = L).
struct Captured {
  at::IntArrayRef capture;
  std::vector<at::Tensor> out;
  explicit Captured(at::IntArrayRef capture) : capture(capture), out(1 + capture.size()) {}
  bool wants(int64_t b) const {
    for (const int64_t c : capture)
      if (c == b) return true;
    return false;
  }
  void keep(int64_t b, const at::Tensor& state) {
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == b) out[1 + c] = state;
  }
  // Where the layer ending at boundary b (of L) writes its output: a tensor of its own where it
  // is kept past the forward (captured, or the last), else one of the two spares by turns, so
  // never the layer's input.
  at::Tensor output(int64_t b, int64_t L, const std::array<at::Tensor, 2>& spare, int& flip,
                    at::IntArrayRef sizes, const at::TensorOptions& opts) const {
    if (b == L || wants(b)) return at::empty(sizes, opts);
    const at::Tensor& next = spare[flip];
    flip ^= 1;
    return next;
  }
};

// Whether stack_forward runs a forward's layers through native_stack where it can, from now on
// (`use_native_stack`, the default; it also needs `use_native`); layer by layer otherwise.
std::atomic<bool> stack_wanted{true};

// Whether native_stack takes every layer of `s` for the input x (B, T, C): each layer as
// native_fits takes it (with h = x), and the attention norms' weights too.
bool stack_fits(const at::Tensor& x, const Stack& s, const at::Tensor& cos, const at::Tensor& sin,
                at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                int64_t num_keys, const std::optional<at::Tensor>& mask) {
  const int64_t L = static_cast<int64_t>(s.wqkv.size());
  if (!stack_wanted.load(std::memory_order_relaxed)) return false;
  if (L == 0 || !x.is_contiguous() || !x.device().is_cpu()) return false;
  for (int64_t l = 0; l < L; ++l) {
    if (!norm_fits(s.attn_norms[l], x.scalar_type(), x.size(2))) return false;
    if (!native_fits(x, x, s.mlp_norms[l], s.wqkv[l], s.n_qkv, s.wo[l], s.w13[l], s.w2[l],
                     s.bqkv.get(l), s.bo.get(l), s.b13.get(l), s.b2.get(l), cos, sin, k_caches[l],
                     v_caches[l], slots, num_keys, mask, s.num_heads, s.n_13) ||
        !qk_fits(s.q_norms.get(l), s.k_norms.get(l), x.scalar_type(), k_caches[l].size(3)))
      return false;
  }
  return true;
}

// stack_forward where stack_fits: native_layer's kernels for every layer, each preceded by its
// attention norm (layer_forward's rms_norm op, its kernel called directly), into buffers made
// once a forward and shared by the layers (a layer's output into one of two, by turns, or into a
// tensor of its own where it is captured or the last). The same functions on the same rows as
// layer by layer, so the same bits; what it saves is each layer's dispatcher call for the norm,
// its seven allocations and its checks: a one-token SmolLM2 forward 0.90x the time, four tokens
// 0.96x (session 59, an AVX2 VM, in one process).
template <typename T>
std::vector<at::Tensor> native_stack(const at::Tensor& x, const Stack& s, const at::Tensor& cos,
                                     const at::Tensor& sin, at::TensorList k_caches,
                                     at::TensorList v_caches, const at::Tensor& slots,
                                     int64_t num_keys, const std::optional<at::Tensor>& mask,
                                     at::IntArrayRef capture) {
  const int64_t L = static_cast<int64_t>(s.wqkv.size());
  const int64_t B = x.size(0), T_ = x.size(1), C = x.size(2), R = B * T_;
  const int64_t Hkv = k_caches[0].size(1), D = k_caches[0].size(3), H = s.num_heads;
  const int64_t n_qkv = s.n_qkv, n_13 = s.n_13;
  TORCH_CHECK(n_qkv == (H + 2 * Hkv) * D, "layer: qkv outputs ", n_qkv, " for ", H, " + 2 x ",
              Hkv, " heads of ", D);
  std::vector<std::array<int, 4>> bits(L);  // each matrix 4- or 8-bit (w4a8-mixed)
  for (int64_t l = 0; l < L; ++l)
    bits[l] = {matrix_bits(s.wqkv[l], C, n_qkv), matrix_bits(s.wo[l], H * D, C),
               matrix_bits(s.w13[l], C, n_13), matrix_bits(s.w2[l], n_13 / 2, C)};
  const at::TensorOptions opts = x.options();
  LayerBuffers buf(B, T_, H, Hkv, D, C, n_13, opts);
  const at::Tensor h = at::empty({R, C}, opts);
  const std::array<at::Tensor, 2> spare = {at::empty({B, T_, C}, opts),
                                           at::empty({B, T_, C}, opts)};
  Captured res(capture);
  at::Tensor cur = x;
  res.keep(0, cur);
  int flip = 0;
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    norm_rows<T>(cur.data_ptr<T>(), s.attn_norms[l], h.data_ptr<T>(), R, C, s.eps);
    const at::Tensor next = res.output(l + 1, L, spare, flip, {B, T_, C}, opts);
    const auto& [b_qkv, b_o, b_13, b_2] = bits[l];
    native_count.fetch_add(1, std::memory_order_relaxed);
    native_rows<T>(buf, cur.data_ptr<T>(), h.data_ptr<T>(), C, s.mlp_norms[l], s.eps, s.wqkv[l],
                   b_qkv, s.bqkv.get(l), n_qkv, s.wo[l], b_o, s.w13[l], b_13, n_13, s.w2[l], b_2,
                   cos, sin, k_cache, v_cache, slots, num_keys, mask, s.q_norms.get(l),
                   s.k_norms.get(l), next.data_ptr<T>());
    cur = next;
    res.keep(l + 1, cur);
  }
  res.out[0] = cur;
  return res.out;
}

}  // namespace

// The decoder's layers in one call: layer_forward for each layer l in turn, with layer l's norms,
// matrices (`layers`) and caches (list element l) and the shared rope, slots, key count and
// mask. Returns the output, then the state at each boundary in `capture` (boundary b: the input
// of layer b, the output after the last layer at b = L), in capture's order: the same tensors a
// loop over layer_forward gives, so the same bits; what this saves is one Python call a layer.
std::vector<at::Tensor> stack_forward(const at::Tensor& x, const c10::intrusive_ptr<Stack>& layers,
                                      const at::Tensor& cos, const at::Tensor& sin,
                                      at::TensorList k_caches, at::TensorList v_caches,
                                      const at::Tensor& slots, int64_t num_keys,
                                      const std::optional<at::Tensor>& mask,
                                      at::IntArrayRef capture) {
  const Stack& s = *layers;
  const int64_t L = static_cast<int64_t>(s.wqkv.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "stack: ", L, " layers, but ", k_caches.size(), " and ", v_caches.size(), " caches");
  for (const int64_t b : capture)
    TORCH_CHECK(0 <= b && b <= L, "stack: capture boundary ", b, " outside [0, ", L, "]");
  if (stack_fits(x, s, cos, sin, k_caches, v_caches, slots, num_keys, mask)) {
    if (x.scalar_type() == at::kBFloat16)
      return native_stack<at::BFloat16>(x, s, cos, sin, k_caches, v_caches, slots, num_keys, mask,
                                        capture);
    return native_stack<float>(x, s, cos, sin, k_caches, v_caches, slots, num_keys, mask,
                               capture);
  }
  Captured res(capture);
  at::Tensor h = x;
  res.keep(0, h);
  for (int64_t l = 0; l < L; ++l) {
    h = layer_forward(h, s.attn_norms[l], s.mlp_norms[l], s.eps, s.wqkv[l], s.bqkv.get(l),
                      s.n_qkv, s.wo[l], s.bo.get(l), s.w13[l], s.b13.get(l), s.n_13, s.w2[l],
                      s.b2.get(l), cos, sin, k_caches[l], v_caches[l], slots, num_keys, mask,
                      s.num_heads, s.q_norms.get(l), s.k_norms.get(l));
    res.keep(l + 1, h);
  }
  res.out[0] = h;
  return res.out;
}

// The tables from the angles' sines and cosines (R, D/2): c = [cos, cos], s = [-sin, sin],
// rounded to T as .to(dtype) rounds (to nearest even).
template <typename T>
void rope_tables(const float* sn, const float* cs, int64_t R, int64_t D2, T* c, T* s) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < D2; ++i) {
      const float cv = cs[r * D2 + i], sv = sn[r * D2 + i];
      c[r * 2 * D2 + i] = c[r * 2 * D2 + D2 + i] = static_cast<T>(cv);
      s[r * 2 * D2 + i] = static_cast<T>(-sv);
      s[r * 2 * D2 + D2 + i] = static_cast<T>(sv);
    }
}

// cos and signed sin (B, T, 1, D) in `dtype` from positions (B, T) int64 and inv_freq (D/2,)
// fp32: layers.rope_cos_sin's, bit for bit. The angles (float(position) * inv_freq, one rounded
// product each, as ATen's broadcast multiply) and the tables are filled here; sin and cos are
// ATen's own ops over the angles laid out as layers.rope_cos_sin's (B, T, D/2), so their bits
// (which differ between ATen's vector body and its scalar tail) are the same: two ATen ops where
// the formula takes ten (each a dispatch, an output and its checks, in every forward and draft
// step). Other dtypes or layouts go through the formula's ops.
std::vector<at::Tensor> rope_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq,
                                     at::ScalarType dtype) {
  const bool direct = positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                      positions.device().is_cpu() && positions.dim() == 2 &&
                      inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous() &&
                      inv_freq.dim() == 1 && inv_freq.device().is_cpu() &&
                      (dtype == at::kFloat || dtype == at::kBFloat16);
  if (!direct) {
    const at::Tensor angles = positions.unsqueeze(-1).to(at::kFloat) * inv_freq;  // (B, T, D/2)
    const at::Tensor sin = angles.sin(), cos = angles.cos();
    const at::Tensor c = at::cat({cos, cos}, -1), s = at::cat({-sin, sin}, -1);  // (B, T, D)
    return {c.unsqueeze(2).to(dtype), s.unsqueeze(2).to(dtype)};
  }
  const int64_t B = positions.size(0), T_ = positions.size(1), R = B * T_, D2 = inv_freq.numel();
  at::Tensor angles = at::empty({B, T_, D2}, inv_freq.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* f = inv_freq.data_ptr<float>();
  float* a = angles.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < D2; ++i) a[r * D2 + i] = static_cast<float>(pos[r]) * f[i];
  const at::Tensor sn = angles.sin(), cs = angles.cos();
  const at::TensorOptions opts = inv_freq.options().dtype(dtype);
  at::Tensor c = at::empty({B, T_, 1, 2 * D2}, opts), s = at::empty({B, T_, 1, 2 * D2}, opts);
  if (dtype == at::kBFloat16)
    rope_tables<at::BFloat16>(sn.data_ptr<float>(), cs.data_ptr<float>(), R, D2,
                              c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>());
  else
    rope_tables<float>(sn.data_ptr<float>(), cs.data_ptr<float>(), R, D2, c.data_ptr<float>(),
                       s.data_ptr<float>());
  return {c, s};
}

// fp32 logits (B, T', V) of x (B, T, C): the columns logit_index (B, T') picks (all without),
// through the final norm where one is given, then the 4- or 8-bit output matrix (no bias) as a
// _QuantLinear does it (rows in x's dtype, then fp32): llama.py's Transformer._logits and the
// end of eagle3.py's Eagle3Head.body.
template <typename T>
at::Tensor native_logits(const at::Tensor& x, const std::optional<at::Tensor>& logit_index,
                         const std::optional<at::Tensor>& norm, double eps,
                         const at::Tensor& lm_head, int bits, int64_t vocab) {
  const int64_t B = x.size(0), T_ = x.size(1), C = x.size(2);
  const int64_t Tp = logit_index.has_value() ? logit_index->size(1) : T_, M = B * Tp;
  const T* xp = x.data_ptr<T>();
  at::Tensor rows = at::empty({M, C}, x.options());  // the picked rows, then normed (in place)
  T* yp = rows.data_ptr<T>();
  const T* src = xp;  // the rows the output matrix reads
  if (logit_index.has_value()) {
    const int64_t* idx = logit_index->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tp; ++t) {
        const int64_t j = idx[b * Tp + t];  // in [0, T): logits_of checked
        std::copy(xp + (b * T_ + j) * C, xp + (b * T_ + j + 1) * C, yp + (b * Tp + t) * C);
      }
    src = yp;
  }
  if (norm.has_value()) {
    norm_rows<T>(src, *norm, yp, M, C, eps);
    src = yp;
  }
  at::Tensor z = at::empty({M, vocab}, x.options());
  kernels::w4a8_rows<T>(bits, src, M, C, lm_head.data_ptr<uint8_t>(), vocab, z.data_ptr<T>(),
                        nullptr);
  if constexpr (std::is_same_v<T, float>) return z.view({B, Tp, vocab});
  at::Tensor out = at::empty({B, Tp, vocab}, x.options().dtype(at::kFloat));
  const T* zp = z.data_ptr<T>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < M * vocab; ++i) op[i] = static_cast<float>(zp[i]);  // exact
  return out;
}

at::Tensor logits_of(const at::Tensor& x, const std::optional<at::Tensor>& logit_index,
                     const std::optional<at::Tensor>& norm, double eps, const at::Tensor& lm_head,
                     int64_t lm_bits, int64_t vocab) {
  // The rows picked, normed and projected by the kernels called directly into buffers of our
  // own (the same functions on the same rows: the same bits) where everything is of the kinds
  // they take; else through the ops.
  const auto dt = x.scalar_type();
  const bool direct =
      native_wanted.load(std::memory_order_relaxed) && x.dim() == 3 && x.is_contiguous() &&
      x.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16) &&
      (!norm.has_value() || norm_fits(*norm, dt, x.size(2))) &&
      (!logit_index.has_value() ||
       (logit_index->scalar_type() == at::kLong && logit_index->is_contiguous() &&
        logit_index->dim() == 2 && logit_index->size(0) == x.size(0))) &&
      (lm_bits == 4 || lm_bits == 8) && kernels::packed_bits(lm_head, x.size(2), vocab) == lm_bits;
  bool in_range = true;  // else ATen's index (negative positions, or its error)
  if (direct && logit_index.has_value()) {
    const int64_t* idx = logit_index->data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_index->numel(); ++i)
      in_range = in_range && 0 <= idx[i] && idx[i] < x.size(1);
  }
  if (direct && in_range) {
    kernels::w4a8_check(lm_head, x.size(2), vocab, int(lm_bits));
    if (dt == at::kBFloat16)
      return native_logits<at::BFloat16>(x, logit_index, norm, eps, lm_head, int(lm_bits), vocab);
    return native_logits<float>(x, logit_index, norm, eps, lm_head, int(lm_bits), vocab);
  }
  at::Tensor y = x;
  if (logit_index.has_value()) {
    const at::Tensor rows = at::arange(x.size(0), logit_index->options()).unsqueeze(1);  // (B, 1)
    y = x.index({rows, *logit_index});  // (B, T', C)
  }
  if (norm.has_value()) y = ops().rms_norm.call(y, *norm, eps);
  const at::Tensor z = project_bits(y.reshape({-1, y.size(2)}), lm_head, lm_bits, vocab, "logits");
  return z.to(y.scalar_type()).view({y.size(0), y.size(1), vocab}).to(at::kFloat);
}

namespace {

// Whether head_inputs takes a head step's inputs: ids (B, T) int64 within the embedding's rows,
// g (B, T, C) contiguous bf16 or fp32, the embedding (V, C) of g's dtype and the two norms' weights
// (C) of it or fp32, contiguous, on the CPU; else the ATen ops run (and say what is wrong).
bool head_inputs_fit(const at::Tensor& ids, const at::Tensor& g, const at::Tensor& embed,
                     const at::Tensor& input_norm, const at::Tensor& hidden_norm) {
  const auto dt = g.scalar_type();
  if (!native_wanted.load(std::memory_order_relaxed)) return false;
  if ((dt != at::kFloat && dt != at::kBFloat16) || !g.is_contiguous() || !g.device().is_cpu())
    return false;
  if (embed.scalar_type() != dt || !embed.is_contiguous() || embed.dim() != 2 ||
      embed.size(1) != g.size(2) || !embed.device().is_cpu())
    return false;
  if (!norm_fits(input_norm, dt, g.size(2)) || !norm_fits(hidden_norm, dt, g.size(2)))
    return false;
  if (ids.scalar_type() != at::kLong || !ids.is_contiguous() ||
      ids.numel() != g.size(0) * g.size(1))
    return false;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    if (ip[i] < 0 || ip[i] >= embed.size(0)) return false;
  return true;
}

// h = norm(g) and attn_in = [input_norm(embed[ids]), h] row by row, the norm kernel called
// directly (the embedding's row read in place: the same values at::embedding copies out, so the
// same bits), instead of the embedding, two norm ops and a cat.
template <typename T>
void head_inputs(const at::Tensor& ids, const at::Tensor& g, const at::Tensor& embed,
                 const at::Tensor& input_norm, const at::Tensor& hidden_norm, double eps,
                 at::Tensor& h, at::Tensor& attn_in) {
  const int64_t R = ids.numel(), C = g.size(2);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const T* e = embed.data_ptr<T>();
  T* hp = h.data_ptr<T>();
  T* ap = attn_in.data_ptr<T>();
  norm_rows<T>(g.data_ptr<T>(), hidden_norm, hp, R, C, eps);
  for (int64_t r = 0; r < R; ++r) {
    norm_rows<T>(e + ip[r] * C, input_norm, ap + r * 2 * C, 1, C, eps);
    std::copy(hp + r * C, hp + (r + 1) * C, ap + r * 2 * C + C);
  }
}

}  // namespace

// One step of a one-layer EAGLE-3 head (draft/eagle3.py's Eagle3Head.body, its MidLayer taken
// by the fused layer op) in one call, its ops in body's order:
//   g = fc(cat(states)) with fc (Eagle3Head.combine without its optional norms), else states[0];
//   rope from positions; e = embed[ids]; h = hidden_norm(g); residual = h or g;
//   x = layer_from(residual, [input_norm(e), h]); x = norm(x) where feed_normed;
//   y = x at logit_index (all rows without); y = norm(y) where not feed_normed and a norm;
//   logits = lm_head(y) (4- or 8-bit, no bias) as fp32.
// Returns the logits (B, T', Vd) and x (B, T, C), the state the next step is fed.
std::vector<at::Tensor> head_forward(
    const at::Tensor& ids, at::TensorList states, const std::optional<at::Tensor>& fc,
    int64_t fc_bits, const at::Tensor& positions,
    const at::Tensor& inv_freq, const at::Tensor& embed, const at::Tensor& input_norm,
    const at::Tensor& hidden_norm, const at::Tensor& mlp_norm,
    const std::optional<at::Tensor>& final_norm, double eps, bool norm_before_residual,
    bool feed_normed, const at::Tensor& wqkv, const std::optional<at::Tensor>& bqkv, int64_t n_qkv,
    const at::Tensor& wo, const std::optional<at::Tensor>& bo, const at::Tensor& w13,
    const std::optional<at::Tensor>& b13, int64_t n_13, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slots, int64_t num_keys, const std::optional<at::Tensor>& mask,
    int64_t num_heads, const std::optional<at::Tensor>& logit_index, const at::Tensor& lm_head,
    int64_t lm_bits, int64_t vocab) {
  const Ops& o = ops();
  const int64_t B = ids.size(0), T = ids.size(1), C = hidden_norm.size(0);
  at::Tensor g;
  if (fc.has_value()) {  // eagle3.py's combine: fc over the states concatenated, low -> high
    const at::Tensor cat = at::cat(states, -1);
    const at::Tensor y = project_bits(cat.reshape({-1, cat.size(-1)}), *fc, fc_bits, C, "head fc");
    g = y.to(cat.scalar_type()).view({B, T, C});
  } else {
    TORCH_CHECK(states.size() == 1, "head: one state without fc, got ", states.size());
    g = states[0];
  }
  TORCH_CHECK(g.dim() == 3 && g.size(0) == B && g.size(1) == T && g.size(2) == C, "head: state ",
              g.sizes(), " for ids ", ids.sizes(), " and width ", C);
  const std::vector<at::Tensor> rope = rope_cos_sin(positions, inv_freq, g.scalar_type());
  at::Tensor h, attn_in;  // norm(g) (B, T, C); [norm(embed[ids]), norm(g)] (B, T, 2C)
  if (head_inputs_fit(ids, g, embed, input_norm, hidden_norm)) {
    h = at::empty({B, T, C}, g.options());
    attn_in = at::empty({B, T, 2 * C}, g.options());
    if (g.scalar_type() == at::kBFloat16)
      head_inputs<at::BFloat16>(ids, g, embed, input_norm, hidden_norm, eps, h, attn_in);
    else
      head_inputs<float>(ids, g, embed, input_norm, hidden_norm, eps, h, attn_in);
  } else {
    const at::Tensor e = at::embedding(embed, ids);  // (B, T, C)
    h = o.rms_norm.call(g, hidden_norm, eps);
    attn_in = at::cat({o.rms_norm.call(e, input_norm, eps), h}, -1);
  }
  at::Tensor x = layer_from(norm_before_residual ? h : g, attn_in, mlp_norm, eps, wqkv, bqkv,
                            n_qkv, wo, bo, w13, b13, n_13, w2, b2, rope[0], rope[1], k_cache,
                            v_cache, slots, num_keys, mask, num_heads, std::nullopt, std::nullopt);
  if (feed_normed && final_norm.has_value()) {
    const auto dt = x.scalar_type();
    if (x.is_contiguous() && (dt == at::kFloat || dt == at::kBFloat16) &&
        norm_fits(*final_norm, dt, C) && native_wanted.load(std::memory_order_relaxed)) {
      at::Tensor y = at::empty_like(x);  // the rms_norm op's kernel, called directly
      if (dt == at::kBFloat16)
        norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), *final_norm,
                                y.data_ptr<at::BFloat16>(), B * T, C, eps);
      else
        norm_rows<float>(x.data_ptr<float>(), *final_norm, y.data_ptr<float>(), B * T, C, eps);
      x = y;
    } else {
      x = o.rms_norm.call(x, *final_norm, eps);
    }
  }
  const std::optional<at::Tensor> norm = feed_normed ? std::nullopt : final_norm;
  return {logits_of(x, logit_index, norm, eps, lm_head, lm_bits, vocab), x};
}

// A whole forward of a decoder that `stack` takes from its embedded input x (B, T, C) on
// (llama.py's Transformer.body on that path): RoPE from positions and inv_freq, stack_forward,
// then logits_of with the final norm. Returns the fp32 logits (B, T', V), then the captured
// states in capture's order.
std::vector<at::Tensor> decoder_forward(
    const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq,
    const c10::intrusive_ptr<Stack>& layers, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slots, int64_t num_keys, const std::optional<at::Tensor>& mask,
    at::IntArrayRef capture, const at::Tensor& norm, const std::optional<at::Tensor>& logit_index,
    const at::Tensor& lm_head, int64_t lm_bits, int64_t vocab) {
  const std::vector<at::Tensor> rope = rope_cos_sin(positions, inv_freq, x.scalar_type());
  std::vector<at::Tensor> out = stack_forward(x, layers, rope[0], rope[1], k_caches, v_caches,
                                              slots, num_keys, mask, capture);
  out[0] = logits_of(out[0], logit_index, norm, layers->eps, lm_head, lm_bits, vocab);
  return out;
}

// What KVCache.plan gives a forward over a chain of T new tokens per row after its committed
// length (ids (B, T); lengths each row's committed length; capacity the cache's slots): row b's
// token t at position and slot lengths[b] + t, K = max(lengths) + T keys, and the mask seeing
// the slots up to there: none where every row has one length and T is 1, else (B, 1, T, K)
// (the same values as plan's, which is all attention reads). Raises plan's overflow error.
namespace {

struct ChainPlan {
  at::Tensor positions;  // (B, T) int64, also the slots written
  int64_t num_keys;
  std::optional<at::Tensor> mask;
};

ChainPlan chain_plan(const at::Tensor& ids, at::IntArrayRef lengths, int64_t capacity,
                     const char* op) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous(), op,
              ": ids must be contiguous (B, T) int64, got ", ids.sizes());
  const int64_t B = ids.size(0), T_ = ids.size(1);
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == B, op, ": ", lengths.size(),
              " lengths for ", B, " rows");
  int64_t lo = lengths.empty() ? 0 : lengths[0], hi = lo;
  for (const int64_t n : lengths) lo = std::min(lo, n), hi = std::max(hi, n);
  ChainPlan p{at::empty({B, T_}, ids.options()), hi + T_, std::nullopt};
  TORCH_CHECK(lo >= 0 && p.num_keys <= capacity, "KV cache overflow: ", p.num_keys,
              " entries needed, capacity ", capacity);
  int64_t* pp = p.positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_; ++t) pp[b * T_ + t] = lengths[b] + t;
  if (lo != hi || T_ > 1) {
    at::Tensor m = at::empty({B, 1, T_, p.num_keys}, ids.options().dtype(at::kBool));
    bool* mp = m.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t s = 0; s < p.num_keys; ++s)
          mp[(b * T_ + t) * p.num_keys + s] = s <= lengths[b] + t;
    p.mask = m;
  }
  return p;
}

}  // namespace

// A greedy forward over a chain of T new tokens per row after its committed length (a decode
// step, or a chain's verification), from the token ids to the target's argmax after each:
// Transformer.forward's host work (chain_plan, the embedding) and the argmax kernel in the
// same call as decoder_forward, so a step crosses from Python once (each crossing after a
// step's weight stream runs cold: about 70 us for a one-tensor op, session 62). ids (B, T)
// int64, lengths each row's committed length, k_all and v_all the cache (L, B, Hkv, S, D).
// The same tensors' values as the Python path gives decoder_forward, so the same bits.
// Returns the argmax (B, T) int64, then the captured states in capture's order.
std::vector<at::Tensor> greedy_chain_forward(
    const at::Tensor& ids, at::IntArrayRef lengths, const at::Tensor& embed,
    const at::Tensor& inv_freq, const c10::intrusive_ptr<Stack>& layers, const at::Tensor& k_all,
    const at::Tensor& v_all, at::IntArrayRef capture, const at::Tensor& norm,
    const at::Tensor& lm_head, int64_t lm_bits, int64_t vocab) {
  TORCH_CHECK(k_all.dim() == 5 && k_all.size(1) == ids.size(0) && v_all.sizes() == k_all.sizes(),
              "greedy_chain: the caches must be (L, B, Hkv, S, D) for ", ids.size(0),
              " rows, got ", k_all.sizes(), " and ", v_all.sizes());
  const ChainPlan p = chain_plan(ids, lengths, k_all.size(3), "greedy_chain");
  std::vector<at::Tensor> ks, vs;
  for (int64_t l = 0; l < k_all.size(0); ++l) {
    ks.push_back(k_all.select(0, l));
    vs.push_back(v_all.select(0, l));
  }
  std::vector<at::Tensor> out =
      decoder_forward(at::embedding(embed, ids), p.positions, inv_freq, layers, ks, vs,
                      p.positions, p.num_keys, p.mask, capture, norm, std::nullopt, lm_head,
                      lm_bits, vocab);
  out[0] = kernels::argmax_rows(out[0]);  // (B, T)
  return out;
}

// head_forward over a chain of T new tokens per row after the head cache's committed lengths
// (a catch-up, or a draft step: chain_plan), returning only what the proposer reads: each row's
// logits (B, Vd) and next state (B, C) at its token last[b] (Eagle3Head.feed_last and
// step_last), so the positions, plan, logit index and row pick cost no op of their own from
// Python. The same values as the Python path gives head_forward, so the same bits.
std::vector<at::Tensor> head_chain_forward(
    const at::Tensor& ids, at::TensorList states, const std::optional<at::Tensor>& fc,
    int64_t fc_bits, at::IntArrayRef lengths, at::IntArrayRef last, const at::Tensor& inv_freq,
    const at::Tensor& embed, const at::Tensor& input_norm, const at::Tensor& hidden_norm,
    const at::Tensor& mlp_norm, const std::optional<at::Tensor>& final_norm, double eps,
    bool norm_before_residual, bool feed_normed, const at::Tensor& wqkv,
    const std::optional<at::Tensor>& bqkv, int64_t n_qkv, const at::Tensor& wo,
    const std::optional<at::Tensor>& bo, const at::Tensor& w13,
    const std::optional<at::Tensor>& b13, int64_t n_13, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, at::Tensor k_cache, at::Tensor v_cache,
    int64_t num_heads, const at::Tensor& lm_head, int64_t lm_bits, int64_t vocab) {
  TORCH_CHECK(k_cache.dim() == 4, "head_chain: the cache must be (B, Hkv, S, D), got ",
              k_cache.sizes());
  const ChainPlan p = chain_plan(ids, lengths, k_cache.size(2), "head_chain");  // checks ids
  const int64_t B = ids.size(0), T_ = ids.size(1);
  TORCH_CHECK(k_cache.size(0) == B, "head_chain: a cache of ", k_cache.size(0), " rows for ", B);
  TORCH_CHECK(static_cast<int64_t>(last.size()) == B, "head_chain: ", last.size(),
              " last tokens for ", B, " rows");
  at::Tensor index = at::empty({B, 1}, ids.options());
  int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= last[b] && last[b] < T_, "head_chain: last token ", last[b], " of ", T_);
    ip[b] = last[b];
  }
  const std::vector<at::Tensor> out = head_forward(
      ids, states, fc, fc_bits, p.positions, inv_freq, embed, input_norm, hidden_norm, mlp_norm,
      final_norm, eps, norm_before_residual, feed_normed, wqkv, bqkv, n_qkv, wo, bo, w13, b13,
      n_13, w2, b2, k_cache, v_cache, p.positions, p.num_keys, p.mask, num_heads, index, lm_head,
      lm_bits, vocab);
  const at::Tensor& x = out[1];  // (B, T, C)
  at::Tensor state = at::empty({B, x.size(2)}, x.options());
  for (int64_t b = 0; b < B; ++b) state[b].copy_(x[b][last[b]]);
  return {out[0].select(1, 0), state};
}

namespace {

// sandwich_rows' scratch for B x T rows beyond LayerBuffers': the attention norm's output (and
// later a matrix's, before its norm), and GELU-tanh of the gate.
struct SandwichBuffers {
  LayerBuffers layer;
  at::Tensor h, gelu;
  SandwichBuffers(int64_t B, int64_t T_, int64_t H, int64_t Hkv, int64_t D, int64_t C,
                  int64_t n_13, const at::TensorOptions& opts)
      : layer(B, T_, H, Hkv, D, C, n_13, opts),
        h(at::empty({B * T_, C}, opts)),
        gelu(at::empty({B * T_, n_13 / 2}, opts)) {}
};

// Gemma 3's layer (sandwich_forward's ops, in its order) with its kernels called directly
// (kernels.h) into `buf`: x (R, C) -> out (R, C). The norms normalise in place where the op's
// made a new tensor (each row is read whole before it is written); q_ratio multiplies the
// normed queries as ATen multiplies a tensor of T by a float (in fp32, rounded once); GELU-tanh
// and its product with the up half are ATen's own ops, on the same views as the op's.
template <typename T>
void sandwich_rows(SandwichBuffers& sb, const T* x, at::TensorList norms, double eps,
                   const at::Tensor& wqkv, int b_qkv, int64_t n_qkv, const at::Tensor& wo, int b_o,
                   const at::Tensor& w13, int b_13, int64_t n_13, const at::Tensor& w2, int b_2,
                   const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots, int64_t num_keys,
                   const std::optional<at::Tensor>& mask, double q_ratio, T* out) {
  LayerBuffers& buf = sb.layer;
  const int64_t R = buf.x_attn.size(0) * buf.x_attn.size(1), C = buf.x_attn.size(2);
  const int64_t H = buf.q.size(2), D = buf.q.size(3), Hkv = k_cache.size(1), I = n_13 / 2;
  native_count.fetch_add(1, std::memory_order_relaxed);
  T* h = sb.h.data_ptr<T>();
  T* qkv = buf.qkv.data_ptr<T>();
  T* x1 = buf.x_attn.data_ptr<T>();
  T* h2 = buf.h2.data_ptr<T>();
  norm_rows<T>(x, norms[0], h, R, C, eps);
  kernels::w4a8_rows<T>(b_qkv, h, R, C, wqkv.data_ptr<uint8_t>(), n_qkv, qkv, nullptr);
  norm_heads<T>(qkv, R, n_qkv, H, Hkv, D, norms[1], norms[2], eps, q_ratio);
  kernels::rope_write_rows<T>(buf.qkv, cos, sin, k_cache, v_cache, slots, buf.q);
  kernels::attend_into(buf.qt, k_cache.narrow(2, 0, num_keys), v_cache.narrow(2, 0, num_keys),
                       mask, std::pow(double(D), -0.5), buf.a);
  kernels::w4a8_rows<T>(b_o, buf.a.data_ptr<T>(), R, H * D, wo.data_ptr<uint8_t>(), C, h,
                        nullptr);
  norm_rows<T>(h, norms[3], h, R, C, eps);
  add_rows<T>(x, h, x1, R * C);
  norm_rows<T>(x1, norms[4], h2, R, C, eps);
  kernels::w4a8_rows<T>(b_13, h2, R, C, w13.data_ptr<uint8_t>(), n_13, buf.gu.data_ptr<T>(),
                        nullptr);
  at::gelu_out(sb.gelu, buf.gu.narrow(1, 0, I), "tanh");
  at::mul_out(buf.act, sb.gelu, buf.gu.narrow(1, I, I));
  kernels::w4a8_rows<T>(b_2, buf.act.data_ptr<T>(), R, I, w2.data_ptr<uint8_t>(), C, h, nullptr);
  norm_rows<T>(h, norms[5], h, R, C, eps);
  add_rows<T>(x1, h, out, R * C);
}

// sandwich_rows for x (B, T, C) of bf16 or fp32, contiguous, into out (B, T, C); each matrix at
// the bits it is given as (sandwich_fits checked them).
void sandwich_into(SandwichBuffers& buf, const at::Tensor& x, at::TensorList norms, double eps,
                   const at::Tensor& wqkv, int64_t bits_qkv, int64_t n_qkv, const at::Tensor& wo,
                   int64_t bits_o, const at::Tensor& w13, int64_t bits_13, int64_t n_13,
                   const at::Tensor& w2, int64_t bits_2, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slots, int64_t num_keys,
                   const std::optional<at::Tensor>& mask, double q_ratio, const at::Tensor& out) {
  const int b[4] = {int(bits_qkv), int(bits_o), int(bits_13), int(bits_2)};
  if (x.scalar_type() == at::kBFloat16)
    sandwich_rows<at::BFloat16>(buf, x.data_ptr<at::BFloat16>(), norms, eps, wqkv, b[0], n_qkv,
                                wo, b[1], w13, b[2], n_13, w2, b[3], cos, sin, k_cache, v_cache,
                                slots, num_keys, mask, q_ratio, out.data_ptr<at::BFloat16>());
  else
    sandwich_rows<float>(buf, x.data_ptr<float>(), norms, eps, wqkv, b[0], n_qkv, wo, b[1], w13,
                         b[2], n_13, w2, b[3], cos, sin, k_cache, v_cache, slots, num_keys, mask,
                         q_ratio, out.data_ptr<float>());
}

// Whether sandwich_rows takes this layer: what native_fits asks of a layer without biases (with
// the MLP's norm for its norm), every norm's weight in x's dtype or fp32, contiguous and of its
// size (C, or D for the q and k norms), and each matrix stored at the bits it is given as.
bool sandwich_fits(const at::Tensor& x, at::TensorList norms, const at::Tensor& wqkv,
                   int64_t bits_qkv, int64_t n_qkv, const at::Tensor& wo, int64_t bits_o,
                   const at::Tensor& w13, int64_t bits_13, int64_t n_13, const at::Tensor& w2,
                   int64_t bits_2, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                   int64_t num_keys, const std::optional<at::Tensor>& mask, int64_t num_heads) {
  if (norms.size() != 6) return false;
  const std::optional<at::Tensor> none;
  if (!native_fits(x, x, norms[4], wqkv, n_qkv, wo, w13, w2, none, none, none, none, cos, sin,
                   k_cache, v_cache, slots, num_keys, mask, num_heads, n_13))
    return false;
  const int64_t C = x.size(2), D = k_cache.size(3);
  for (size_t i = 0; i < norms.size(); ++i)
    if (!norm_fits(norms[i], x.scalar_type(), i == 1 || i == 2 ? D : C)) return false;
  return kernels::packed_bits(wqkv, C, n_qkv) == bits_qkv &&
         kernels::packed_bits(wo, num_heads * D, C) == bits_o &&
         kernels::packed_bits(w13, C, n_13) == bits_13 &&
         kernels::packed_bits(w2, n_13 / 2, C) == bits_2;
}

}  // namespace

// Gemma 3's layer (llama.py's SandwichBlock with its Attention and GELU-tanh GatedMLP), each
// matrix 4-bit (bits 4: linear) or 8-bit (bits 8: linear8) as w4a8-mixed stored it, no biases.
// norms: attn, q, k, post-attention, mlp (pre-feedforward), post-mlp weights.
//   h = rms_norm(x); q, k, v = w(h); q = rms_norm(q) [* q_ratio]; k = rms_norm(k)
//   x = x + rms_norm(wo(attend(rope_write(q, k, v))))
//   x = x + rms_norm(w2(gelu_tanh(g) * u)), g, u = w13(rms_norm(x))
at::Tensor sandwich_forward(const at::Tensor& x, at::TensorList norms, double eps,
                            const at::Tensor& wqkv, int64_t bits_qkv, int64_t n_qkv,
                            const at::Tensor& wo, int64_t bits_o, const at::Tensor& w13,
                            int64_t bits_13, int64_t n_13, const at::Tensor& w2, int64_t bits_2,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& slots, int64_t num_keys,
                            const std::optional<at::Tensor>& mask, int64_t num_heads,
                            double q_ratio) {
  const Ops& o = ops();
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const int64_t Hkv = k_cache.size(1), D = k_cache.size(3), H = num_heads;
  TORCH_CHECK(norms.size() == 6, "sandwich layer: 6 norms, got ", norms.size());
  TORCH_CHECK(n_qkv == (H + 2 * Hkv) * D, "sandwich layer: qkv outputs ", n_qkv, " for ", H,
              " + 2 x ", Hkv, " heads of ", D);
  if (sandwich_fits(x, norms, wqkv, bits_qkv, n_qkv, wo, bits_o, w13, bits_13, n_13, w2, bits_2,
                    cos, sin, k_cache, v_cache, slots, num_keys, mask, num_heads)) {
    SandwichBuffers buf(B, T, H, Hkv, D, C, n_13, x.options());
    const at::Tensor out = at::empty({B, T, C}, x.options());
    sandwich_into(buf, x, norms, eps, wqkv, bits_qkv, n_qkv, wo, bits_o, w13, bits_13, n_13, w2,
                  bits_2, cos, sin, k_cache, v_cache, slots, num_keys, mask, q_ratio, out);
    return out;
  }
  auto linear = [](const at::Tensor& x2, const at::Tensor& w, int64_t bits, int64_t N) {
    return project_bits(x2, w, bits, N, "sandwich layer");
  };
  const at::Tensor h = o.rms_norm.call(x, norms[0], eps);
  const at::Tensor qkv =
      linear(h.reshape({B * T, C}), wqkv, bits_qkv, n_qkv).view({B, T, H + 2 * Hkv, D});
  at::Tensor q = o.rms_norm.call(qkv.narrow(2, 0, H), norms[1], eps);
  if (q_ratio != 1.0) q = q * q_ratio;
  const at::Tensor k = o.rms_norm.call(qkv.narrow(2, H, Hkv), norms[2], eps);
  const at::Tensor normed = at::cat({q, k, qkv.narrow(2, H + Hkv, Hkv)}, 2);
  const at::Tensor qr =
      o.rope_write.call(normed, cos, sin, k_cache, v_cache, slots).transpose(1, 2);
  const at::Tensor keys = k_cache.narrow(2, 0, num_keys), values = v_cache.narrow(2, 0, num_keys);
  const at::Tensor a = o.attend.call(qr, keys, values, mask, std::pow(double(D), -0.5));
  const at::Tensor attn = linear(a.transpose(1, 2).reshape({B * T, H * D}), wo, bits_o, C);
  const at::Tensor x1 = x + o.rms_norm.call(attn.view({B, T, C}), norms[3], eps);
  const at::Tensor h2 = o.rms_norm.call(x1, norms[4], eps);
  const at::Tensor gu = linear(h2.reshape({B * T, C}), w13, bits_13, n_13);
  const int64_t I = n_13 / 2;
  const at::Tensor act = at::gelu(gu.narrow(1, 0, I), "tanh") * gu.narrow(1, I, I);
  const at::Tensor d = linear(act, w2, bits_2, C);
  return x1 + o.rms_norm.call(d.view({B, T, C}), norms[5], eps);
}

// Gemma 3's decoder (every layer a SandwichBlock that the `sandwich` op takes), held by the
// model's Python side (cpu_layer.StackArgs) and passed to sandwich_decoder as one object: each
// layer's six norms (sandwich_forward's order), matrices with their bits, whether it slides
// (its own RoPE and mask), and what the layers share.
struct SandwichStack : torch::CustomClassHolder {
  std::vector<std::vector<at::Tensor>> norms;  // per layer: attn, q, k, post-attn, mlp, post-mlp
  std::vector<at::Tensor> wqkv, wo, w13, w2;
  std::vector<int64_t> bits_qkv, bits_o, bits_13, bits_2;
  std::vector<bool> sliding;
  double eps, q_ratio;
  int64_t n_qkv, n_13, num_heads;

  SandwichStack(std::vector<at::Tensor> flat_norms, double eps, std::vector<at::Tensor> wqkv,
                std::vector<int64_t> bits_qkv, int64_t n_qkv, std::vector<at::Tensor> wo,
                std::vector<int64_t> bits_o, std::vector<at::Tensor> w13,
                std::vector<int64_t> bits_13, int64_t n_13, std::vector<at::Tensor> w2,
                std::vector<int64_t> bits_2, int64_t num_heads, double q_ratio,
                const c10::List<bool>& sliding)
      : wqkv(std::move(wqkv)), wo(std::move(wo)), w13(std::move(w13)), w2(std::move(w2)),
        bits_qkv(std::move(bits_qkv)), bits_o(std::move(bits_o)), bits_13(std::move(bits_13)),
        bits_2(std::move(bits_2)), sliding(sliding.begin(), sliding.end()), eps(eps),
        q_ratio(q_ratio),
        n_qkv(n_qkv), n_13(n_13), num_heads(num_heads) {
    const size_t L = this->wqkv.size();
    TORCH_CHECK(flat_norms.size() == 6 * L, "sandwich stack: 6 norms a layer for ", L,
                " layers, got ", flat_norms.size());
    for (const size_t n : {this->wo.size(), this->w13.size(), this->w2.size(),
                           this->bits_qkv.size(), this->bits_o.size(), this->bits_13.size(),
                           this->bits_2.size(), this->sliding.size()})
      TORCH_CHECK(n == L, "sandwich stack: ", L, " layers, but a list of ", n);
    for (size_t l = 0; l < L; ++l)
      norms.emplace_back(flat_norms.begin() + 6 * l, flat_norms.begin() + 6 * (l + 1));
  }
};

namespace {

// A Gemma 3 decoder's layers from x (B, T, C) on: each layer sandwich_forward's, with the
// sliding layers' RoPE and mask (lcos, lsin, local_mask) and the others' (cos, sin, mask).
// A layer that sandwich_fits runs sandwich_rows over buffers made once a forward and shared by
// the layers (its output into one of two spares by turns, or a tensor of its own where it is
// captured or the last), others the op's way; returns the output, then the captured states in
// capture's order (as stack_forward).
std::vector<at::Tensor> sandwich_stack(const at::Tensor& x, const SandwichStack& s,
                                       const at::Tensor& cos, const at::Tensor& sin,
                                       const at::Tensor& lcos, const at::Tensor& lsin,
                                       at::TensorList k_caches, at::TensorList v_caches,
                                       const at::Tensor& slots, int64_t num_keys,
                                       const std::optional<at::Tensor>& mask,
                                       const std::optional<at::Tensor>& local_mask,
                                       at::IntArrayRef capture) {
  const int64_t L = static_cast<int64_t>(s.wqkv.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "sandwich stack: ", L, " layers, but ", k_caches.size(), " and ", v_caches.size(),
              " caches");
  for (const int64_t b : capture)
    TORCH_CHECK(0 <= b && b <= L, "sandwich stack: capture boundary ", b, " outside [0, ", L,
                "]");
  const int64_t B = x.size(0), T_ = x.size(1), C = x.size(2), H = s.num_heads;
  Captured res(capture);
  const bool native = x.is_contiguous() && native_wanted.load(std::memory_order_relaxed) &&
                      L > 0 && stack_wanted.load(std::memory_order_relaxed);
  std::optional<SandwichBuffers> buf;
  std::array<at::Tensor, 2> spare;
  int flip = 0;
  at::Tensor cur = x;
  res.keep(0, cur);
  for (int64_t l = 0; l < L; ++l) {
    const bool slides = s.sliding[l];
    const at::Tensor& c = slides ? lcos : cos;
    const at::Tensor& sn = slides ? lsin : sin;
    const std::optional<at::Tensor>& m = slides ? local_mask : mask;
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    if (!native ||
        !sandwich_fits(cur, s.norms[l], s.wqkv[l], s.bits_qkv[l], s.n_qkv, s.wo[l], s.bits_o[l],
                       s.w13[l], s.bits_13[l], s.n_13, s.w2[l], s.bits_2[l], c, sn, k_cache,
                       v_cache, slots, num_keys, m, H)) {
      cur = sandwich_forward(cur, s.norms[l], s.eps, s.wqkv[l], s.bits_qkv[l], s.n_qkv, s.wo[l],
                             s.bits_o[l], s.w13[l], s.bits_13[l], s.n_13, s.w2[l], s.bits_2[l],
                             c, sn, k_cache, v_cache, slots, num_keys, m, H, s.q_ratio);
      res.keep(l + 1, cur);
      continue;
    }
    if (!buf.has_value()) {
      const int64_t Hkv = k_cache.size(1), D = k_cache.size(3);
      buf.emplace(B, T_, H, Hkv, D, C, s.n_13, x.options());
      spare = {at::empty({B, T_, C}, x.options()), at::empty({B, T_, C}, x.options())};
    }
    // never `cur`: the spares take turns, and the ops' outputs are fresh
    const at::Tensor next = res.output(l + 1, L, spare, flip, {B, T_, C}, x.options());
    sandwich_into(*buf, cur, s.norms[l], s.eps, s.wqkv[l], s.bits_qkv[l], s.n_qkv, s.wo[l],
                  s.bits_o[l], s.w13[l], s.bits_13[l], s.n_13, s.w2[l], s.bits_2[l], c, sn,
                  k_cache, v_cache, slots, num_keys, m, s.q_ratio, next);
    cur = next;
    res.keep(l + 1, cur);
  }
  res.out[0] = cur;
  return res.out;
}

}  // namespace

// A whole forward of a Gemma 3 decoder from its embedded (and scaled) input x (B, T, C) on
// (llama.py's Transformer.body on that path): RoPE from positions with inv_freq, and with
// inv_freq_local for the sliding layers (inv_freq where None); sandwich_stack with the plan's
// mask and the sliding layers' own (local_mask); then logits_of with the final norm. Returns the
// fp32 logits (B, T', V), then the captured states in capture's order.
std::vector<at::Tensor> sandwich_decoder_forward(
    const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq,
    const std::optional<at::Tensor>& inv_freq_local,
    const c10::intrusive_ptr<SandwichStack>& layers,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, int64_t num_keys,
    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& local_mask,
    at::IntArrayRef capture, const at::Tensor& norm, const std::optional<at::Tensor>& logit_index,
    const at::Tensor& lm_head, int64_t lm_bits, int64_t vocab) {
  const std::vector<at::Tensor> rope = rope_cos_sin(positions, inv_freq, x.scalar_type());
  const std::vector<at::Tensor> local =
      inv_freq_local.has_value() ? rope_cos_sin(positions, *inv_freq_local, x.scalar_type())
                                 : rope;
  std::vector<at::Tensor> out =
      sandwich_stack(x, *layers, rope[0], rope[1], local[0], local[1], k_caches, v_caches, slots,
                     num_keys, mask, local_mask, capture);
  out[0] = logits_of(out[0], logit_index, norm, layers->eps, lm_head, lm_bits, vocab);
  return out;
}

// An op run in one team of threads (team.h) where its first argument, the layer's input or ids
// (B, T, ...), has at most team::kTeamRows rows: one parallel region for the whole forward
// instead of one for each matrix, attention and row op it calls. The same ops on the same rows,
// so the same bits (use_team(false) runs them without).
template <auto Fn>
struct Teamed;
template <typename R, typename First, typename... Rest, R (*Fn)(First, Rest...)>
struct Teamed<Fn> {
  static R call(First first, Rest... rest) {
    if (first.size(0) * first.size(1) > team::kTeamRows) return Fn(first, rest...);
    std::optional<R> out;
    team::run([&] { out.emplace(Fn(first, rest...)); });
    return std::move(*out);
  }
};

// Whether the ops run their forwards of few rows in one team from now on (`enable`, the
// default); returns the setting. The bits are the same either way: tests and benchmarks switch it.
bool use_team(bool enable) {
  team::wanted.store(enable, std::memory_order_relaxed);
  return enable;
}

TORCH_LIBRARY(eaglespec_layer, m) {
  m.def(
      "forward(Tensor x, Tensor attn_norm, Tensor mlp_norm, float eps, Tensor wqkv, Tensor? bqkv, "
      "int n_qkv, Tensor wo, Tensor? bo, Tensor w13, Tensor? b13, int n_13, Tensor w2, Tensor? b2, "
      "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int num_keys, "
      "Tensor? mask, int num_heads, Tensor? q_norm=None, Tensor? k_norm=None) -> Tensor");
  m.def(
      "forward_from(Tensor residual, Tensor h, Tensor mlp_norm, float eps, Tensor wqkv, "
      "Tensor? bqkv, int n_qkv, Tensor wo, Tensor? bo, Tensor w13, Tensor? b13, int n_13, "
      "Tensor w2, Tensor? b2, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots, int num_keys, Tensor? mask, int num_heads, Tensor? q_norm=None, "
      "Tensor? k_norm=None) -> Tensor");
  using Tensors = std::vector<at::Tensor>;
  using Optionals = c10::List<std::optional<at::Tensor>>;
  using State = std::tuple<Tensors, Tensors, double, Tensors, Optionals, int64_t, Tensors,
                           Optionals, Tensors, Optionals, int64_t, Tensors, Optionals, int64_t,
                           Optionals, Optionals>;
  m.class_<Stack>("Stack")
      .def(torch::init<Tensors, Tensors, double, Tensors, Optionals, int64_t, Tensors, Optionals,
                       Tensors, Optionals, int64_t, Tensors, Optionals, int64_t, Optionals,
                       Optionals>())
      .def_pickle(  // what a copy of the model it belongs to (copy.deepcopy) copies
          [](const c10::intrusive_ptr<Stack>& s) -> State {
            return {s->attn_norms, s->mlp_norms, s->eps,     s->wqkv,    s->bqkv, s->n_qkv,
                    s->wo,         s->bo,        s->w13,     s->b13,     s->n_13, s->w2,
                    s->b2,         s->num_heads, s->q_norms, s->k_norms};
          },
          [](State t) {
            return std::apply(
                [](auto&&... a) { return c10::make_intrusive<Stack>(std::move(a)...); },
                std::move(t));
          });
  m.def(
      "stack(Tensor x, __torch__.torch.classes.eaglespec_layer.Stack layers, Tensor cos, "
      "Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, int num_keys, "
      "Tensor? mask, int[] capture) -> Tensor[]");
  m.def(
      "sandwich(Tensor x, Tensor[] norms, float eps, Tensor wqkv, int bits_qkv, int n_qkv, "
      "Tensor wo, int bits_o, Tensor w13, int bits_13, int n_13, Tensor w2, int bits_2, "
      "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "int num_keys, Tensor? mask, int num_heads, float q_ratio) -> Tensor");
  m.class_<SandwichStack>("SandwichStack")
      .def(torch::init<std::vector<at::Tensor>, double, std::vector<at::Tensor>,
                       std::vector<int64_t>, int64_t, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>,
                       int64_t, std::vector<at::Tensor>, std::vector<int64_t>, int64_t, double,
                       c10::List<bool>>());
  m.def(
      "sandwich_decoder(Tensor x, Tensor positions, Tensor inv_freq, Tensor? inv_freq_local, "
      "__torch__.torch.classes.eaglespec_layer.SandwichStack layers, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor slots, int num_keys, Tensor? mask, Tensor? local_mask, "
      "int[] capture, Tensor norm, Tensor? logit_index, Tensor lm_head, int lm_bits, "
      "int vocab) -> Tensor[]");
  m.def(
      "head(Tensor ids, Tensor[] states, Tensor? fc, int fc_bits, Tensor positions, Tensor inv_freq, Tensor embed, "
      "Tensor input_norm, Tensor hidden_norm, Tensor mlp_norm, Tensor? final_norm, float eps, "
      "bool norm_before_residual, bool feed_normed, Tensor wqkv, Tensor? bqkv, int n_qkv, "
      "Tensor wo, Tensor? bo, Tensor w13, Tensor? b13, int n_13, Tensor w2, Tensor? b2, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int num_keys, Tensor? mask, "
      "int num_heads, Tensor? logit_index, Tensor lm_head, int lm_bits, int vocab) -> Tensor[]");
  m.def(
      "decoder(Tensor x, Tensor positions, Tensor inv_freq, "
      "__torch__.torch.classes.eaglespec_layer.Stack layers, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor slots, int num_keys, Tensor? mask, int[] capture, "
      "Tensor norm, Tensor? logit_index, Tensor lm_head, int lm_bits, int vocab) -> Tensor[]");
  m.def(
      "greedy_chain(Tensor ids, int[] lengths, Tensor embed, Tensor inv_freq, "
      "__torch__.torch.classes.eaglespec_layer.Stack layers, Tensor(a!) k_all, Tensor(b!) v_all, "
      "int[] capture, Tensor norm, Tensor lm_head, int lm_bits, int vocab) -> Tensor[]");
  m.def(
      "head_chain(Tensor ids, Tensor[] states, Tensor? fc, int fc_bits, int[] lengths, "
      "int[] last, Tensor inv_freq, Tensor embed, Tensor input_norm, Tensor hidden_norm, "
      "Tensor mlp_norm, Tensor? final_norm, float eps, bool norm_before_residual, "
      "bool feed_normed, Tensor wqkv, Tensor? bqkv, int n_qkv, Tensor wo, Tensor? bo, "
      "Tensor w13, Tensor? b13, int n_13, Tensor w2, Tensor? b2, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, int num_heads, Tensor lm_head, int lm_bits, int vocab) -> Tensor[]");
  m.def("supported() -> bool");
  m.def("use_team(bool enable) -> bool");
  m.def("use_native(bool enable) -> bool");
  m.def("use_native_stack(bool enable) -> bool");
  m.def("native_layers() -> int");
}

TORCH_LIBRARY_IMPL(eaglespec_layer, CPU, m) {
  m.impl("forward", &Teamed<&layer_forward>::call);
  m.impl("forward_from", &Teamed<&layer_from>::call);
  m.impl("stack", &Teamed<&stack_forward>::call);
  m.impl("sandwich", &Teamed<&sandwich_forward>::call);
  m.impl("head", &Teamed<&head_forward>::call);
  m.impl("decoder", &Teamed<&decoder_forward>::call);
  m.impl("greedy_chain", &Teamed<&greedy_chain_forward>::call);
  m.impl("head_chain", &Teamed<&head_chain_forward>::call);
  m.impl("sandwich_decoder", &Teamed<&sandwich_decoder_forward>::call);
}

TORCH_LIBRARY_IMPL(eaglespec_layer, CompositeExplicitAutograd, m) {
  m.impl("supported", []() { return true; });
  m.impl("use_team", &use_team);
  m.impl("use_native", [](bool enable) {
    native_wanted.store(enable, std::memory_order_relaxed);
    return enable;
  });
  m.impl("native_layers", []() { return native_count.load(std::memory_order_relaxed); });
  m.impl("use_native_stack", [](bool enable) {
    stack_wanted.store(enable, std::memory_order_relaxed);
    return enable;
  });
}
