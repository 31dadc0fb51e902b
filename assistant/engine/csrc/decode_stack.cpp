// The decoder layers of a step whose sequences all attend natively (decode steps, small chunks), in one
// call: the same kernels, in the same order, as model.py's layer loop, without its hundreds of Python-level
// calls and small PyTorch ops per step (see assistant/engine/native.py for the measurements).
#include <torch/extension.h>
#include <ATen/ATen.h>

#include <vector>

#include "int8_common.h"
#include "native.h"

namespace {

struct Refine {  // a step's generated rows (int8.py RowSplit): their residual-pass mask and count, and no rows
  torch::Tensor mask, none;
  int64_t count;
};

struct Int8Linear {  // int8.py Linear with the native kernel: VNNI layout, correction, scales, int8 rows, bias
  torch::Tensor packed, ws, weight;
  c10::optional<torch::Tensor> bias;
  bool residual;     // Linear.residual: generated rows are refined here
  int64_t outliers;  // Linear.outliers: refined by keeping this many channels exact (0: by a residual row)

  // Linear._native: the fused kernel up to MAX_ROWS GEMM rows, else quantize + torch._int_mm + finish
  torch::Tensor operator()(const torch::Tensor& x, const Refine& rows) const {
    const torch::Tensor& refine = residual ? rows.mask : rows.none;
    const int64_t extra = residual && !outliers ? rows.count : 0;  // residual rows
    if (x.size(0) + extra <= int8k::MAX_ROWS) return linear(x, packed, ws, bias, refine, outliers);
    auto q = quantize(x, refine, outliers);  // with outliers: their channels and values as q[2], q[3]
    auto part = [&](size_t i) { return outliers ? c10::optional<torch::Tensor>(q[i]) : c10::nullopt; };
    return finish(at::_int_mm(q[0], weight.t()), ws, q[1], refine, bias,
                  outliers ? c10::optional<torch::Tensor>(packed) : c10::nullopt, part(2), part(3));
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  Int8Linear qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  // per layer: attn_norm, mlp_norm, then (packed, scale, weight, bias or an empty tensor) for qkv, o, gate_up,
  // down; residual: which of the four refine generated rows (Linear.residual), outliers: how (Linear.outliers)
  DecodeStack(const std::vector<std::vector<torch::Tensor>>& layers, const std::vector<bool>& residual, int64_t outliers) {
    TORCH_CHECK(residual.size() == 4, "DecodeStack: a residual flag per linear (qkv, o, gate_up, down)");
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 18, "DecodeStack: 18 tensors per layer");
      auto lin = [&](size_t i) {
        return Int8Linear{t[i], t[i + 1], t[i + 2], t[i + 3].numel() ? c10::optional<torch::Tensor>(t[i + 3]) : c10::nullopt,
                          residual[(i - 2) / 4], outliers};
      };
      layers_.push_back(Layer{t[0], t[1], lin(2), lin(6), lin(10), lin(14)});
    }
  }

  // h (T, D) -> h after every layer; the step's keys and values are written into kc/vc (one per layer).
  torch::Tensor run(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor new_slots,
                    std::vector<torch::Tensor> kc, std::vector<torch::Tensor> vc, torch::Tensor slots,
                    torch::Tensor kv_off, torch::Tensor q_off, torch::Tensor refine, int64_t refined, double eps,
                    int64_t H, int64_t KVH, double q_scale) const {
    TORCH_CHECK(kc.size() == layers_.size() && vc.size() == layers_.size(), "DecodeStack: one KV cache per layer");
    const int64_t T = h.size(0);
    const Refine rows{refine, torch::zeros_like(refine), refined};
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      auto qkv = l.qkv(rms_norm(h, l.attn_norm, eps), rows);
      auto q = rope_store(qkv, cos, sin, H, KVH, q_scale, kc[i], vc[i], new_slots);
      auto out = attend(q, kc[i], vc[i], slots, kv_off, q_off);
      h = h + l.o(out.reshape({T, -1}), rows);
      h = h + l.down(swiglu(l.gate_up(rms_norm(h, l.mlp_norm, eps), rows)), rows);
    }
    return h;
  }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const std::vector<std::vector<torch::Tensor>>&, const std::vector<bool>&, int64_t>())
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "every decoder layer of a natively attending step (model.py Transformer.forward's loop)");
}
