// w4a8moe routing: router logits -> topk_ids and topk_weights, the way real MoE models choose
// their experts. The result feeds forward() directly.
//
//   logits = x @ W^T (+ router bias)                        router_logits(): f32 math
//   scores = softmax(logits) | sigmoid(logits) | logits     Gating
//   choose K experts by  scores (+ selection bias)          optionally within the best groups
//   weights = scores of the chosen experts                  (softmax over the K for softmax_topk)
//   weights /= sum(weights)                                 if renormalize
//   weights *= scaling
//
// | model                          | gating       | renormalize | other                          |
// |--------------------------------|--------------|-------------|--------------------------------|
// | Mixtral, Qwen3-MoE             | softmax      | yes         |                                |
// | Qwen2-MoE, OLMoE, DeepSeek-V2  | softmax      | no          | V2: groups (max), scaling      |
// | DeepSeek-V3                    | sigmoid      | yes         | selection bias, groups (top-2  |
// |                                |              |             | sum), scaling 2.5              |
// | gpt-oss                        | softmax_topk | (implied)   | router bias                    |
// | Llama-4                        | sigmoid      | no          | K = 1, weight applied on the   |
// |                                |              |             | input (MoeParams)              |
//
// Ties: among equal selection values the lowest expert index wins (a stable descending sort).
// torch.topk promises no order among equal values, and on CPU does not return the lowest index
// (the top 2 of [0.5, 1, 1, 0.2, 1, 1, 0.3, 1] come out as indices 4 and 7): a reference written
// with it agrees only on data without ties. The chosen experts of a token are listed best
// first. A NaN score ranks below every number, so every id is always in [0, E) and a token whose
// logits hold NaN gets NaN weights (and a NaN output row) only.
#pragma once

#include <cstdint>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

enum class Gating : uint8_t {
  softmax = 0,       // scores = softmax over all E logits (in f32, max subtracted first)
  sigmoid = 1,       // scores = 1 / (1 + exp(-logit)) (chosen on the logits, the same order,
                     // when there is neither a selection bias nor grouping)
  softmax_topk = 2,  // choose on the logits; weights = softmax over the K chosen logits
};

// How a group of experts is scored when only the best `groups_used` groups may be chosen from.
enum class GroupScore : uint8_t {
  top2_sum = 0,  // sum of the group's two best selection values (DeepSeek-V3 "noaux_tc")
  max = 1,       // the group's best selection value (DeepSeek-V2 "group_limited_greedy")
};

struct RoutingConfig {
  int64_t experts = 0;  // E
  int64_t top_k = 0;    // K, 1 <= K <= E
  Gating gating = Gating::softmax;
  bool renormalize = false;  // divide the K weights by their sum (norm_topk_prob)
  float scaling = 1.0f;      // routed scaling factor, applied last
  int64_t groups = 1;        // expert groups (E % groups == 0); 1: no grouping
  int64_t groups_used = 1;   // groups a token may choose from (groups_used * E / groups >= K)
  GroupScore group_score = GroupScore::top2_sum;
};

// Checks the configuration; throws Error naming the field (expected vs got).
void check_routing_config(const RoutingConfig& config);

// logits [T, E] f32 = x [T, H] (f32/bf16/f16, row stride may exceed H) times weight [E, H]
// (f32/bf16/f16) transposed, plus bias [E] (f32/bf16/f16, or empty). Products and sums in f32 in
// a fixed order (the same bits on every machine); one thread (the router is small: T * E * H).
void router_logits(const TensorView& x, const TensorView& weight, const TensorView& bias,
                   const MutableTensorView& logits);

// logits [T, E] f32/bf16/f16; selection_bias empty or [E] (added to the scores for choosing only,
// DeepSeek-V3's e_score_correction_bias); topk_ids [T, K] i32/i64; topk_weights [T, K] f32.
void route(const TensorView& logits, const TensorView& selection_bias, const RoutingConfig& config,
           const MutableTensorView& topk_ids, const MutableTensorView& topk_weights);

const char* gating_name(Gating gating) noexcept;

}  // namespace w4a8moe
