// The model families the checkpoint suites run, one row each: how the suite's writers store a
// small layer of the family as a GGUF file and as a Hugging Face folder, how the family routes
// (checked against the independent routing reference) and what else its loaded layer must show.
// test_gguf_layers.cpp and test_compressed_tensors.cpp run every row (value-parameterised); adding
// a family is adding a row.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "checkpoint_writers.hpp"
#include "io/checkpoint.hpp"

namespace ckpt_test {

struct FamilyRow {
  std::string name;  // the test's name
  RouteSpec route;   // the family's routing (the loaded layer's gating and renormalisation too)
  w4a8moe::Activation activation = w4a8moe::Activation::silu;
  bool on_input = false;  // the router weight applied on the input
  // GGUF (absent: no GGUF case): the spec (arch, sizes, types) and the routing metadata.
  std::optional<GgufSpec> gguf;
  std::function<void(GgufWriter&)> gguf_meta;
  // Hugging Face (absent: no folder case): the spec and config.json's routing keys.
  std::optional<CtSpec> ct;
  std::function<void(nlohmann::json&)> config;
  // Further checks of the loaded layer (the source, and the writer's truth per layer).
  std::function<void(const w4a8moe::io::LayerSource&, const std::vector<Moe>&)> gguf_check,
      ct_check;
};

const std::vector<FamilyRow>& family_rows();
// gtest prints a row as its name.
inline void PrintTo(const FamilyRow& row, std::ostream* out) { *out << row.name; }
// The row's name as the parameterised test's name.
inline std::string family_test_name(const ::testing::TestParamInfo<FamilyRow>& info) {
  return info.param.name;
}
const FamilyRow& family(const std::string& name);  // by name; throws when absent
std::vector<FamilyRow> gguf_families();            // the rows with a GGUF case
std::vector<FamilyRow> hf_families();              // the rows with a Hugging Face case

// The row's GGUF model and Hugging Face checkpoint (the spec and metadata or config applied).
GgufModel family_gguf(const FamilyRow& row);
CtModel family_ct(const FamilyRow& row);

// Runs a row's layer `layer` of `path`: the loaded layer routes as the row says and passes
// `check` (given the writer's truth), check_layer runs it against the references, and a range of
// its experts packs to the whole layer's expert blocks (check_expert_range).
void check_family(
    const std::string& path, int layer, const FamilyRow& row,
    const std::function<void(const w4a8moe::io::LayerSource&, const std::vector<Moe>&)>& check,
    const std::vector<Moe>& truth);

// Writes a row's model (family_gguf or family_ct) to `path` and runs check_family on its last
// layer, with the model's layers as the truth.
template <class Model>
void write_and_check_family(
    const Model& model, const std::string& path, const FamilyRow& row,
    const std::function<void(const w4a8moe::io::LayerSource&, const std::vector<Moe>&)>& check) {
  model.writer.write(path);
  check_family(path, static_cast<int>(model.layers.size()) - 1, row, check, model.layers);
}

}  // namespace ckpt_test
