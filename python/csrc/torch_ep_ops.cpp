// The torch ops of expert parallelism (w4a8moe/expert_parallel.hpp), in the namespace `w4a8moe`
// next to the ops of torch_ops.cpp: each process holds a share of a layer's experts, named by an
// expert map (int32 [E]: the local index of each global expert, -1 where another process holds
// it). These ops move no bytes between processes; w4a8moe/distributed.py fits torch.distributed
// around them (docs/pytorch.md, "Expert parallelism with torch.distributed").
//
//   convert_to_w4a8_int8_moe_format_shard  the packing op over a selection of the experts
//   forward_local                 forward() over the local experts: x's dtype or f32 partial sums
//   shard_experts                 an expert map, checked -> the global expert of each local one
//   even_split_expert_map         the map of one process when experts are split in even ranges
//   expert_owners                 every process's map, checked -> the process holding each expert
//   torch.classes.w4a8moe.Dispatch  the dispatch / combine way: pack, compute, combine
//
// Library errors (w4a8moe::Error) are raised as torch errors with the library's sentence, as in
// torch_ops.cpp.
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/version.h>

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "torch_threads.hpp"
#include "torch_util.hpp"
#include "w4a8moe/expert_parallel.hpp"

namespace w4a8moe_torch {
namespace {

using at::Tensor;
using namespace util;

// An int32 CPU tensor of rank `rank` -> its contiguous copy (or itself).
Tensor int32_tensor(const Tensor& t, const char* name, int64_t rank, const char* what) {
  require_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == rank, name, ": expected an int32 tensor ",
              what, ", got dtype ", t.scalar_type(), " of shape ", t.sizes());
  return t.contiguous();
}

std::span<const int32_t> ints_of(const Tensor& t) {
  return {t.data_ptr<int32_t>(), static_cast<size_t>(t.numel())};
}

constexpr const char* kMapShape = "[E] (the local index of each expert, -1 elsewhere)";

w4a8moe::ExpertShard shard_of(const Tensor& expert_map, const char* name = "expert_map") {
  const Tensor map = int32_tensor(expert_map, name, 1, kMapShape);
  return w4a8moe::ExpertShard::from_map(ints_of(map), name);
}

template <class T>
Tensor copy_of(std::span<const T> values, at::ScalarType dtype) {
  Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(dtype));
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size_bytes());
  return t;
}

// ---------------------------------------------------------------------------------------------
// Shards and placements

Tensor shard_experts(const Tensor& expert_map) {
  return translate_errors([&] { return copy_of(shard_of(expert_map).globals(), at::kInt); });
}

Tensor even_split_expert_map(int64_t experts, int64_t rank, int64_t ranks) {
  return translate_errors([&] {
    return copy_of(w4a8moe::ExpertShard::even_split(experts, rank, ranks).map(), at::kInt);
  });
}

w4a8moe::ExpertPlacement placement_of(const Tensor& expert_maps_in) {
  const Tensor maps =
      int32_tensor(expert_maps_in, "expert_maps", 2, "[ranks, E] (each process's expert map)");
  std::vector<w4a8moe::ExpertShard> shards;
  for (int64_t r = 0; r < maps.size(0); ++r) {
    const std::string name = "expert_maps[" + std::to_string(r) + "]";
    shards.push_back(w4a8moe::ExpertShard::from_map(
        {maps.data_ptr<int32_t>() + r * maps.size(1), static_cast<size_t>(maps.size(1))}, name));
  }
  return w4a8moe::ExpertPlacement::from_shards(shards);
}

Tensor expert_owners(const Tensor& expert_maps) {
  return translate_errors([&] { return copy_of(placement_of(expert_maps).owners(), at::kInt); });
}

// ---------------------------------------------------------------------------------------------
// Packing a shard

w4a8moe::PackOptions pack_options(int64_t group_size, const std::string& gate_up_layout,
                                  const std::string& scale_storage, const std::string& kernel_set,
                                  const Tensor& experts_in) {
  w4a8moe::PackOptions o;
  TORCH_CHECK(group_size >= INT32_MIN && group_size <= INT32_MAX,
              "group_size: expected -1 or a multiple of 32, got ", group_size);
  o.group_size = static_cast<int>(group_size);
  TORCH_CHECK(gate_up_layout == "halves" || gate_up_layout == "interleaved",
              "gate_up_layout: expected 'halves' or 'interleaved', got '", gate_up_layout, "'");
  o.gate_up_layout = gate_up_layout == "halves" ? w4a8moe::GateUpLayout::halves
                                                : w4a8moe::GateUpLayout::interleaved;
  TORCH_CHECK(scale_storage == "as_given" || scale_storage == "bf16",
              "scale_storage: expected 'as_given' or 'bf16', got '", scale_storage, "'");
  o.scale_storage =
      scale_storage == "bf16" ? w4a8moe::ScaleStorage::bf16 : w4a8moe::ScaleStorage::as_given;
  o.kernel_set = kernel_set;
  TORCH_CHECK((experts_in.scalar_type() == at::kInt || experts_in.scalar_type() == at::kLong) &&
                  experts_in.dim() == 1 && experts_in.numel() >= 1,
              "experts: expected a non-empty int32 or int64 tensor [n] of expert indices, got "
              "dtype ",
              experts_in.scalar_type(), " of shape ", experts_in.sizes());
  if (!experts_in.device().is_cpu()) {
    // a meta or fake tensor: the count is known, the indices are not (the CPU kernel checks
    // them); packed_size needs only the count
    for (int64_t i = 0; i < experts_in.numel(); ++i) o.experts.push_back(static_cast<int32_t>(i));
    return o;
  }
  const Tensor experts = experts_in.to(at::kLong).contiguous();
  for (int64_t i = 0; i < experts.numel(); ++i) {
    const int64_t e = experts.data_ptr<int64_t>()[i];
    // out of int32: an index no layer has, which the packer refuses with its sentence
    o.experts.push_back(e >= 0 && e <= INT32_MAX ? static_cast<int32_t>(e) : -1);
  }
  return o;
}

// [E, N, K] int8, or nibble-packed uint8 [E, N, K/2] -> K.
int64_t logical_cols(const Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 3, name, ": expected rank 3, got shape ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kChar || w.scalar_type() == at::kByte, name,
              ": expected dtype int8 (int4 values) or uint8 (nibble-packed), got ",
              w.scalar_type());
  return w.size(2) * (w.scalar_type() == at::kByte ? 2 : 1);
}

void check_same_experts(const Tensor& w13, const Tensor& w2) {
  TORCH_CHECK(w13.size(0) == w2.size(0), "w2_weight: expected ", w13.size(0),
              " experts (those of w13_weight), got shape ", w2.sizes());
}

bool has(const c10::optional<Tensor>& t) { return t.has_value() && t->defined(); }

// The packing op's kernels after the same checks: Meta = false (CPU) packs the experts, Meta =
// true gives the packed sizes from shapes and dtypes alone.
template <bool Meta>
std::tuple<Tensor, Tensor> pack_shard(const Tensor& w13_weight, const Tensor& w2_weight,
                                      const Tensor& w13_weight_scale, const Tensor& w2_weight_scale,
                                      int64_t group_size, const Tensor& experts,
                                      const c10::optional<Tensor>& w13_bias,
                                      const c10::optional<Tensor>& w2_bias,
                                      std::string gate_up_layout, std::string scale_storage,
                                      std::string kernel_set,
                                      const c10::optional<Tensor>& w13_weight_zero_point,
                                      const c10::optional<Tensor>& w2_weight_zero_point,
                                      const c10::optional<Tensor>& w13_input_order) {
  return translate_errors([&] {
    const int64_t hidden = logical_cols(w13_weight, "w13_weight");
    const int64_t inter = logical_cols(w2_weight, "w2_weight");
    check_same_experts(w13_weight, w2_weight);
    const auto options =
        pack_options(group_size, gate_up_layout, scale_storage, kernel_set, experts);
    if constexpr (Meta) {
      auto bytes = [&](w4a8moe::WeightRole role, int64_t rows, int64_t cols, const Tensor& scale,
                       const c10::optional<Tensor>& zero_point, bool bias, const char* name) {
        Tensor unused;
        return static_cast<int64_t>(w4a8moe::packed_size(
            role, w13_weight.size(0), rows, cols, to_dtype(scale.scalar_type(), name), bias,
            with_input_order(with_format_of(options, scale, zero_point),
                             role == w4a8moe::WeightRole::w13 ? w13_input_order : c10::nullopt,
                             unused, true),
            name));
      };
      const auto o = w13_weight.options().dtype(at::kByte);
      return std::make_tuple(
          at::empty({bytes(w4a8moe::WeightRole::w13, 2 * inter, hidden, w13_weight_scale,
                           w13_weight_zero_point, has(w13_bias), "w13_weight_scale")},
                    o),
          at::empty({bytes(w4a8moe::WeightRole::w2, hidden, inter, w2_weight_scale,
                           w2_weight_zero_point, has(w2_bias), "w2_weight_scale")},
                    o));
    } else {
      // contiguous copies (none when already contiguous), alive until packing ends
      Tensor t[8] = {w13_weight,
                     w13_weight_scale,
                     has(w13_bias) ? *w13_bias : Tensor(),
                     has(w13_weight_zero_point) ? *w13_weight_zero_point : Tensor(),
                     w2_weight,
                     w2_weight_scale,
                     has(w2_bias) ? *w2_bias : Tensor(),
                     has(w2_weight_zero_point) ? *w2_weight_zero_point : Tensor()};
      const char* names[8] = {"w13_weight", "w13_weight_scale", "w13_bias", "w13_weight_zero_point",
                              "w2_weight",  "w2_weight_scale",  "w2_bias",  "w2_weight_zero_point"};
      w4a8moe::TensorView v[8];
      for (int i = 0; i < 8; ++i)
        if (t[i].defined()) v[i] = view_of(t[i], names[i]);
      Tensor order;
      Tensor p13 = to_tensor(w4a8moe::pack_w13(
          v[0], v[1], v[3], v[2],
          with_input_order(with_format_of(options, w13_weight_scale, w13_weight_zero_point),
                           w13_input_order, order, false)));
      w4a8moe::PackOptions w2_options =
          with_format_of(options, w2_weight_scale, w2_weight_zero_point);
      w2_options.gate_up_layout = w4a8moe::GateUpLayout::halves;
      Tensor p2 = to_tensor(w4a8moe::pack_w2(v[4], v[5], v[7], v[6], w2_options));
      return std::make_tuple(p13, p2);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The local forward

struct Routing {
  Tensor x, ids, weights;  // the viewed tensors, alive as long as the views
  w4a8moe::TensorView xv, idv, wv;
};

Routing routing_of(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights) {
  Routing r{x, topk_ids, topk_weights, {}, {}, {}};
  r.xv = view_of(r.x, "x", true);
  r.idv = view_of(r.ids, "topk_ids");
  r.wv = view_of(r.weights, "topk_weights");
  return r;
}

Tensor forward_local_cpu(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                         const Tensor& w13_packed, const Tensor& w2_packed,
                         const Tensor& expert_map, bool apply_router_weight_on_input,
                         int64_t activation_kind, double alpha, double limit, bool f32_output) {
  return translate_errors([&] {
    const w4a8moe::ExpertShard shard = shard_of(expert_map);
    const auto params = moe_params(apply_router_weight_on_input, activation_kind, alpha, limit);
    const auto w13 = bytes_of(w13_packed, "w13_packed");
    const auto w2 = bytes_of(w2_packed, "w2_packed");
    const Routing r = routing_of(x, topk_ids, topk_weights);
    Tensor out = at::empty({r.x.size(0), r.x.size(1)},
                           r.x.options().dtype(f32_output ? at::kFloat : r.x.scalar_type()));
    threads::with_context([&](w4a8moe::Context& context) {
      w4a8moe::forward_local(context, r.xv, r.idv, r.wv, w13, w2, params, shard,
                             mutable_view_of(out));
    });
    return out;
  });
}

#if TORCH_VERSION_MAJOR < 2  // torch 2: w4a8moe/_fake.py
Tensor forward_local_meta(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                          const Tensor& w13_packed, const Tensor& w2_packed,
                          const Tensor& expert_map, bool apply_router_weight_on_input,
                          int64_t activation_kind, double alpha, double limit, bool f32_output) {
  TORCH_CHECK(w13_packed.scalar_type() == at::kByte && w2_packed.scalar_type() == at::kByte,
              "w13_packed, w2_packed: expected uint8 tensors of packed weights, got ",
              w13_packed.scalar_type(), " and ", w2_packed.scalar_type());
  TORCH_CHECK(expert_map.scalar_type() == at::kInt && expert_map.dim() == 1,
              "expert_map: expected an int32 tensor ", kMapShape, ", got dtype ",
              expert_map.scalar_type(), " of shape ", expert_map.sizes());
  TORCH_CHECK(x.dim() == 2, "x: expected rank 2 [T, H], got shape ", x.sizes());
  return translate_errors([&] {
    w4a8moe::check_moe_params(
        moe_params(apply_router_weight_on_input, activation_kind, alpha, limit));
    w4a8moe::infer_output(x.sizes().vec(), to_dtype(x.scalar_type(), "x"), topk_ids.sizes().vec(),
                          topk_weights.sizes().vec());
    return at::empty({x.size(0), x.size(1)},
                     x.options().dtype(f32_output ? at::kFloat : x.scalar_type()));
  });
}
#endif

// ---------------------------------------------------------------------------------------------
// The dispatch / combine way

w4a8moe::ResultDType result_dtype_of(const std::string& name) {
  TORCH_CHECK(name == "f32" || name == "bf16", "result_dtype: expected 'f32' or 'bf16', got '",
              name, "'");
  return name == "f32" ? w4a8moe::ResultDType::f32 : w4a8moe::ResultDType::bf16;
}

// w4a8moe::Dispatch for one process, with the process's shard. One caller at a time.
class Dispatch : public torch::CustomClassHolder {
 public:
  // expert_maps [ranks, E] int32: every process's expert map, in process order. exact: a result
  // row per (record, local slot), combined in forward()'s order (DispatchConfig::exact).
  Dispatch(Tensor expert_maps, int64_t rank, int64_t hidden_size, int64_t top_k,
           bool apply_router_weight_on_input, int64_t activation_kind, double alpha, double limit,
           std::string result_dtype, bool exact) {
    translate_errors([&] {
      w4a8moe::DispatchConfig c;
      c.hidden = hidden_size;
      c.top_k = top_k;
      c.params = moe_params(apply_router_weight_on_input, activation_kind, alpha, limit);
      w4a8moe::check_moe_params(c.params);
      c.result_dtype = result_dtype_of(result_dtype);
      c.exact = exact;
      w4a8moe::ExpertPlacement placement = placement_of(expert_maps);
      TORCH_CHECK(rank >= 0 && rank < placement.ranks(), "rank: expected a process in [0, ",
                  placement.ranks(), "), got ", rank);
      const Tensor maps = expert_maps.contiguous();
      shard_ = w4a8moe::ExpertShard::from_map(
          {maps.data_ptr<int32_t>() + rank * maps.size(1), static_cast<size_t>(maps.size(1))});
      dispatch_ = std::make_unique<w4a8moe::Dispatch>(std::move(placement), rank, c);
    });
  }

  // Step 1: this process's tokens -> (records per process int64 [ranks], records uint8).
  std::tuple<Tensor, Tensor> pack(Tensor x, Tensor topk_ids, Tensor topk_weights) {
    return translate_errors([&] {
      const Routing r = routing_of(x, topk_ids, topk_weights);
      threads::with_context(
          [&](w4a8moe::Context& context) { dispatch_->pack(context, r.xv, r.idv, r.wv); });
      tokens_ = r.x.size(0);
      x_dtype_ = r.x.scalar_type();
      return std::make_tuple(copy_of(dispatch_->send_counts(), at::kLong),
                             copy_of(dispatch_->send_buffer(), at::kByte));
    });
  }

  // Step 2: the records received (recv_counts int64 [ranks] from each process, in process
  // order) -> the result rows, uint8: result_counts()[s] rows for process s, in process order.
  Tensor compute(Tensor received, Tensor recv_counts, Tensor w13_packed, Tensor w2_packed) {
    return translate_errors([&] {
      require_cpu(recv_counts, "recv_counts");
      TORCH_CHECK(recv_counts.scalar_type() == at::kLong && recv_counts.dim() == 1,
                  "recv_counts: expected an int64 tensor [ranks], got dtype ",
                  recv_counts.scalar_type(), " of shape ", recv_counts.sizes());
      const Tensor counts = recv_counts.contiguous();
      threads::with_context([&](w4a8moe::Context& context) {
        dispatch_->compute(context, bytes_of(received, "received", "records"),
                           {counts.data_ptr<int64_t>(), static_cast<size_t>(counts.numel())},
                           bytes_of(w13_packed, "w13_packed"), bytes_of(w2_packed, "w2_packed"),
                           shard_);
      });
      return copy_of(dispatch_->results(), at::kByte);
    });
  }

  // Step 3: the results of this process's records, returned_counts()[r] rows from process r in
  // process order -> out [T, H] of x's dtype.
  Tensor combine(Tensor returned) {
    return translate_errors([&] {
      Tensor out =
          at::empty({tokens_, dispatch_->config().hidden}, at::TensorOptions().dtype(x_dtype_));
      threads::with_context([&](w4a8moe::Context& context) {
        dispatch_->combine(context, bytes_of(returned, "returned", "results"),
                           mutable_view_of(out));
      });
      return out;
    });
  }

  // Result rows for each process (after compute()) and from each process (after pack()), int64
  // [ranks]: the record counts, or with exact results the slots of those records.
  Tensor result_counts() const { return copy_of(dispatch_->result_counts(), at::kLong); }
  Tensor returned_counts() const { return copy_of(dispatch_->returned_counts(), at::kLong); }
  bool exact() const { return dispatch_->config().exact; }
  int64_t record_bytes() const { return static_cast<int64_t>(dispatch_->record_bytes()); }
  int64_t result_row_bytes() const { return static_cast<int64_t>(dispatch_->result_row_bytes()); }
  int64_t ranks() const { return dispatch_->ranks(); }
  int64_t rank() const { return dispatch_->rank(); }
  Tensor expert_map() const { return copy_of(shard_.map(), at::kInt); }

 private:
  std::unique_ptr<w4a8moe::Dispatch> dispatch_;
  w4a8moe::ExpertShard shard_;
  int64_t tokens_ = 0;
  at::ScalarType x_dtype_ = at::kFloat;
};

}  // namespace
}  // namespace w4a8moe_torch

// ---------------------------------------------------------------------------------------------
// Registration: a fragment of torch_ops.cpp's library `w4a8moe`

TORCH_LIBRARY_FRAGMENT(w4a8moe, m) {
  m.def(
      "convert_to_w4a8_int8_moe_format_shard(Tensor w13_weight, Tensor w2_weight, "
      "Tensor w13_weight_scale, Tensor w2_weight_scale, int group_size, Tensor experts, "
      "Tensor? w13_bias=None, Tensor? w2_bias=None, str gate_up_layout=\"halves\", "
      "str scale_storage=\"as_given\", str kernel_set=\"\", Tensor? w13_weight_zero_point=None, "
      "Tensor? w2_weight_zero_point=None, Tensor? w13_input_order=None) -> (Tensor, Tensor)");
  m.def(
      "forward_local(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, "
      "Tensor w2_packed, Tensor expert_map, bool apply_router_weight_on_input=False, "
      "int activation_kind=2, float alpha=1.702, float limit=7.0, bool f32_output=False) "
      "-> Tensor");
  m.def("shard_experts(Tensor expert_map) -> Tensor", &w4a8moe_torch::shard_experts);
  m.def("even_split_expert_map(int experts, int rank, int ranks) -> Tensor",
        &w4a8moe_torch::even_split_expert_map);
  m.def("expert_owners(Tensor expert_maps) -> Tensor", &w4a8moe_torch::expert_owners);
  using w4a8moe_torch::Dispatch;
  m.class_<Dispatch>("Dispatch")
      .def(torch::init<at::Tensor, int64_t, int64_t, int64_t, bool, int64_t, double, double,
                       std::string, bool>(),
           "",
           {torch::arg("expert_maps"), torch::arg("rank"), torch::arg("hidden_size"),
            torch::arg("top_k"), torch::arg("apply_router_weight_on_input"),
            torch::arg("activation_kind"), torch::arg("alpha"), torch::arg("limit"),
            torch::arg("result_dtype"), torch::arg("exact") = false})
      .def("pack", &Dispatch::pack)
      .def("compute", &Dispatch::compute)
      .def("combine", &Dispatch::combine)
      .def("result_counts", &Dispatch::result_counts)
      .def("returned_counts", &Dispatch::returned_counts)
      .def("exact", &Dispatch::exact)
      .def("record_bytes", &Dispatch::record_bytes)
      .def("result_row_bytes", &Dispatch::result_row_bytes)
      .def("ranks", &Dispatch::ranks)
      .def("rank", &Dispatch::rank)
      .def("expert_map", &Dispatch::expert_map);
}

TORCH_LIBRARY_IMPL(w4a8moe, CPU, m) {
  m.impl("convert_to_w4a8_int8_moe_format_shard", &w4a8moe_torch::pack_shard<false>);
  m.impl("forward_local", &w4a8moe_torch::forward_local_cpu);
}

TORCH_LIBRARY_IMPL(w4a8moe, Meta, m) {
  m.impl("convert_to_w4a8_int8_moe_format_shard", &w4a8moe_torch::pack_shard<true>);
#if TORCH_VERSION_MAJOR < 2
  m.impl("forward_local", &w4a8moe_torch::forward_local_meta);
#endif
}

// Not differentiable: the Autograd fallthrough of every op (torch_util.hpp).
TORCH_LIBRARY_IMPL(w4a8moe, W4A8MOE_TORCH_AUTOGRAD_KEY, m) {
  w4a8moe_torch::util::not_differentiable(
      m, {"convert_to_w4a8_int8_moe_format_shard", "forward_local"});
}
