// What both checkpoint loaders share: the source's conversion statistics and expert range,
// opening a layer (GGUF file or Hugging Face folder), routing tokens with its router.
#include "io/checkpoint.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/format.hpp"

namespace w4a8moe::io {

using detail::cat;

std::vector<Conversion> LayerSource::conversions() const {
  std::lock_guard lock(mutex_);
  return conversions_;
}

void LayerSource::add_conversion(int index, const Conversion& delta) const {
  std::lock_guard lock(mutex_);
  Conversion& c = conversions_.at(static_cast<size_t>(index));
  c.err_sq += delta.err_sq;
  c.ref_sq += delta.ref_sq;
  c.max_abs_err = std::max(c.max_abs_err, delta.max_abs_err);
  c.elements += delta.elements;
}

namespace {

std::unique_ptr<LayerSource> open_source(const std::string& path, int layer,
                                         const LoadOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) throw Error(cat("model '", path, "': no such file or folder"));
  if (layer < 0) throw Error(cat("--layer: expected a layer index >= 0, got ", layer));
  if (fs::is_directory(status)) return open_hf_layer(path, layer, options);
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(magic, 4);
  if (in.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0)
    return open_gguf_layer(path, layer, options);
  if (path.size() >= 5 && path.substr(path.size() - 5) == ".gguf")
    return open_gguf_layer(path, layer, options);  // reports the bad magic
  throw Error(cat("model '", path,
                  "': expected a .gguf file or a folder with config.json and safetensors files"));
}

// The range `wanted` of a layer of E experts, count resolved; Error unless it lies within.
ExpertRange check_expert_range(const ExpertRange& wanted, int64_t E) {
  ExpertRange r = wanted;
  if (r.count == -1 && r.first >= 0 && r.first < E) r.count = E - r.first;
  if (r.first < 0 || r.count < 1 || r.count > E - r.first)
    throw Error(
        cat("LoadOptions::experts: expected a range [first, first + count) within the "
            "layer's experts [0, ",
            E, ") with count >= 1 (or -1: to the last), got first ", wanted.first, ", count ",
            wanted.count));
  return r;
}

}  // namespace

std::unique_ptr<LayerSource> open_layer(const std::string& path, int layer,
                                        const LoadOptions& options) {
  std::unique_ptr<LayerSource> source = open_source(path, layer, options);
  source->experts_ = check_expert_range(options.experts, source->info().experts);
  return source;
}

int loader_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void route_tokens(const LayerSource& source, const Router& router, const TensorView& x,
                  std::vector<int32_t>& ids, std::vector<float>& weights) {
  const LayerInfo& info = source.info();
  const int64_t T = x.shape[0], E = info.experts, K = info.top_k, H = info.hidden;
  ids.assign(static_cast<size_t>(T * K), 0);
  weights.assign(static_cast<size_t>(T * K), 1.0f);
  if (router.weight.empty()) {
    if (E != 1 || K != 1) throw Error(cat("layer ", info.layer, ": the router is missing"));
    return;  // a shared expert without a gate: every token, weight 1
  }
  std::vector<float> logits(static_cast<size_t>(T * E));
  router_logits(
      x, TensorView::of(router.weight.data(), DType::f32, {E, H}),
      router.bias.empty() ? TensorView{} : TensorView::of(router.bias.data(), DType::f32, {E}),
      MutableTensorView::of(logits.data(), DType::f32, {T, E}));
  route(TensorView::of(logits.data(), DType::f32, {T, E}),
        router.selection_bias.empty()
            ? TensorView{}
            : TensorView::of(router.selection_bias.data(), DType::f32, {E}),
        info.routing, MutableTensorView::of(ids.data(), DType::i32, {T, K}),
        MutableTensorView::of(weights.data(), DType::f32, {T, K}));
}

}  // namespace w4a8moe::io
