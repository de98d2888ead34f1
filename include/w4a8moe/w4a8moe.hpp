// w4a8moe: the Mixture-of-Experts layer of an LLM on CPUs, with 4-bit integer weights and
// dynamic 8-bit integer activations (W4A8).
//
// The flow: pack each expert tensor once (pack_w13 / pack_w2), then call forward() many times
// with a Context that owns the threads and the scratch memory. reference_forward() computes the
// same contract with plain code over the unpacked weights, for checking results.
//
// Every entry point validates its arguments and throws w4a8moe::Error with one sentence that
// names the argument, what was expected and what came. is_supported_config() never throws.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace w4a8moe {

namespace detail {
struct ContextAccess;
}  // namespace detail

// Version of the packed-weights format this build writes and reads.
inline constexpr uint32_t kPackedFormatVersion = 2;

// ---------------------------------------------------------------------------------------------
// Errors and element types

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class DType : uint8_t { f32 = 0, bf16 = 1, f16 = 2, i8 = 3, u8 = 4, i32 = 5, i64 = 6 };

const char* dtype_name(DType dtype) noexcept;
size_t dtype_bytes(DType dtype) noexcept;

// Activation kinds, with the integer codes of vLLM's CPU operator (dynamic_4bit_int_moe).
enum class Activation : int {
  swiglustep = 0,
  swigluoai = 1,
  silu = 2,
  gelu = 3,       // exact erf form
  gelu_tanh = 4,  // tanh approximation
};

const char* activation_name(Activation kind) noexcept;
// "silu", "swigluoai", "swiglustep", "gelu", "gelu_tanh" -> kind; anything else throws Error.
Activation parse_activation(std::string_view name);
// The rule of the integer codes: 0 .. kActivationCount - 1. activation_from_code() and
// is_supported_config() apply it; anything else is an error, never a silent fallback to SILU.
inline constexpr int64_t kActivationCount = 5;
constexpr bool is_valid_activation_code(int64_t code) noexcept {
  return code >= 0 && code < kActivationCount;
}
// A valid code -> kind; anything else throws Error.
Activation activation_from_code(int64_t code);

// How the gate and up projections are stacked in w13 [E, 2I, H] as given to the packer.
enum class GateUpLayout : uint8_t {
  halves = 0,       // rows [0, I) gate, rows [I, 2I) up
  interleaved = 1,  // row 2j gate j, row 2j+1 up j (gpt-oss); de-interleaved at pack time
};

// ---------------------------------------------------------------------------------------------
// Tensor views (no ownership). Rank 1 to 3. The last dimension is contiguous; for rank-2 tensors
// `row_stride` (in elements) may exceed shape[1]; 0 means contiguous.

struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<int64_t, 3> shape{};
  int64_t row_stride = 0;

  static TensorView of(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                       int64_t row_stride = 0);
  bool empty() const noexcept { return data == nullptr; }
  int64_t numel() const noexcept;
  int64_t stride() const noexcept {  // elements between consecutive rows
    return row_stride != 0 ? row_stride : (rank > 0 ? shape[rank - 1] : 0);
  }
};

struct MutableTensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<int64_t, 3> shape{};
  int64_t row_stride = 0;

  static MutableTensorView of(void* data, DType dtype, std::initializer_list<int64_t> shape,
                              int64_t row_stride = 0);
  int64_t stride() const noexcept {
    return row_stride != 0 ? row_stride : (rank > 0 ? shape[rank - 1] : 0);
  }
};

// ---------------------------------------------------------------------------------------------
// Packing

// What the packer stores for the scales.
enum class ScaleStorage : uint8_t {
  as_given = 0,  // keep the caller's dtype (f32, bf16 or f16): lossless
  bf16 = 1,      // round f32/f16 scales to bf16 (nearest even): halves scale bytes, lossy
};

enum class WeightRole : uint8_t { w13 = 0, w2 = 1 };

// How the given weights read (docs/operator.md, "Weight formats"); recorded in the packed
// header, so w13 and w2 may differ.
enum class WeightFormat : uint32_t {
  // int4 values w in [-8, 7], as int8 or nibble-packed uint8 (value + 8); scales f32, bf16 or
  // f16, any valid group size. The value of element k is w * s.
  int4_symmetric = 0,
  // int4 with zero points (AWQ, GPTQ, compressed-tensors with `symmetric: false`): values w and
  // zero points z both in [-8, 7], the weights given as for int4_symmetric, the zero points as
  // int8 shaped like the scales ([E, N, K/g] or [E, N]). The value of element k of group b is
  // (w - z[b]) * s[b]; w - z, an integer in [-15, 15], is what the sums multiply. Formats that
  // hold unsigned values u and zeros zu in [0, 15] (AWQ, GPTQ) give w = u - 8 and z = zu - 8.
  int4_zero_point = 1,
  // OCP MX FP4: e2m1 codes nibble-packed in uint8 [E, N, K/2] (byte j: element 2j in the low
  // nibble, 2j + 1 in the high one, as gpt-oss's `_blocks`), one e8m0 scale exponent per 32
  // elements in uint8 [E, N, K/32] (group_size 32). The value of element k is
  // e2m1(code) * 2^(e - 127); it computes as the integer 2 * e2m1(code) in [-12, 12] times the
  // scale 2^(e - 128), both exact, the scale stored in bf16. e = 255 (NaN) is refused.
  mxfp4 = 2,
  // int8 weights per output channel, for dense linear layers only (pack_linear; pack_w13,
  // pack_w2 and forward() refuse them): values w as int8 [N, K] in [-128, 127] (symmetric
  // quantizers give [-127, 127]: quantize_linear_int8()), one scale per output row [N] (f32,
  // bf16 or f16), optional bias [N]. The value of element k of row n is w * s[n]. K must be a
  // multiple of 32 (at most 32768); the group size -1 or K. The packer stores the row in the
  // kernel set's int8 layout: as bytes w + 128 (avx512vnni), or as an int4 layer with zero
  // points of 2K inputs, the high nibbles w >> 4 then the low nibbles w & 15 (scales 16 s and
  // s; an s whose 16 s the scale dtype cannot hold is refused), which the other sets compute
  // exactly (docs/operator.md, "Dense linear layers").
  int8 = 3,
};
const char* weight_format_name(WeightFormat format) noexcept;

// The shape rules of the packed weights, one function each. The packer, the capability check,
// the program, the checkpoint loaders and the PyTorch binding all ask these, each wording its own
// message.
//
// Every packed layout stores the input dimension in blocks of kGroupBlock elements, so a scale
// group is a whole number of blocks.
inline constexpr int64_t kGroupBlock = 32;
// -1 (one scale per output row, "channelwise"), or a positive multiple of kGroupBlock.
constexpr bool is_valid_group_size(int64_t group_size) noexcept {
  return group_size == -1 || (group_size > 0 && group_size % kGroupBlock == 0);
}
// A valid group size that, unless -1, divides `cols`, the input dimension of one weight tensor
// (H for w13, I for w2; a layer needs it for both).
constexpr bool group_size_fits(int64_t group_size, int64_t cols) noexcept {
  return is_valid_group_size(group_size) && (group_size == -1 || cols % group_size == 0);
}
// w13 stacks the gate and the up projection, I rows each: its row count is even.
constexpr bool is_valid_w13_rows(int64_t rows) noexcept { return rows % 2 == 0; }

struct PackOptions {
  // -1 (one scale per output row), or a multiple of 32 dividing the input dimension
  // (group_size_fits()).
  int group_size = -1;
  WeightFormat weight_format = WeightFormat::int4_symmetric;  // of the given tensors
  GateUpLayout gate_up_layout = GateUpLayout::halves;         // w13 only
  ScaleStorage scale_storage = ScaleStorage::as_given;        // int4_symmetric only
  // Kernel set whose layout to pack for; empty = the set forward() will pick on this CPU.
  std::string kernel_set;
  // Resource limit: the packer refuses (Error) to allocate a packed buffer larger than this many
  // bytes (the buffer is about the size of the int4 weights given, plus scales).
  size_t memory_limit = SIZE_MAX;
  // The experts to pack, by index into the given tensors, in this order: the local experts of a
  // process (ExpertShard::globals(), w4a8moe/expert_parallel.hpp). Empty: all of them.
  std::vector<int32_t> experts;
  // w13 only, optional: int32 [E, H], row e a permutation of [0, H): column c of expert e's
  // given weights multiplies input input_order[e, c] (act-order checkpoints, GPTQ's g_idx: their
  // scale groups are contiguous in this order, not in the inputs'). Recorded in the packed
  // buffer; forward() gathers each token's row by it, per expert (docs/operator.md,
  // "Input order"). Indexed like the tensors (PackOptions::experts selects from it too).
  TensorView input_order;
};

// What a packed buffer says about itself (decoded and checked header).
struct PackedInfo {
  uint32_t version = 0;
  std::string layout;  // layout name, e.g. "qs4_b32_rowmajor"
  WeightRole role = WeightRole::w13;
  int64_t experts = 0;
  int64_t rows = 0;  // output rows N (2I for w13, H for w2)
  int64_t cols = 0;  // input columns K (H for w13, I for w2)
  int group_size = -1;
  WeightFormat weight_format = WeightFormat::int4_symmetric;
  DType scale_dtype = DType::f32;  // as stored (mxfp4: bf16)
  bool has_bias = false;
  size_t expert_bytes = 0;  // bytes one expert occupies (weights, scales, sums, bias)
  size_t total_bytes = 0;
  bool has_input_order = false;  // w13 packed with PackOptions::input_order
};

// A packed, self-describing, versioned weight buffer (64-byte aligned). Its bytes may be copied
// anywhere (a file, a torch tensor) and handed back to forward() as a span.
class PackedWeights {
 public:
  PackedWeights() = default;
  // A zero-filled, 64-byte aligned buffer of `bytes` bytes (used by the packer and by loaders
  // that read a packed buffer back from storage).
  static PackedWeights allocate(size_t bytes);

  std::span<const uint8_t> bytes() const noexcept { return {data_.get(), size_}; }
  uint8_t* data() noexcept { return data_.get(); }
  size_t size() const noexcept { return size_; }
  PackedInfo info() const;  // inspect_packed(bytes())

 private:
  struct Free {
    void operator()(uint8_t* p) const noexcept;
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t size_ = 0;
};

// w13: int4 values as int8 [E, 2I, H] in [-8, 7], or nibble-packed uint8 [E, 2I, H/2] (byte j:
// element 2j in the low nibble, 2j+1 in the high nibble, each stored as value + 8).
// scale: [E, 2I, H/g] or [E, 2I] (channelwise), f32/bf16/f16. bias: empty or [E, 2I].
PackedWeights pack_w13(const TensorView& w13, const TensorView& scale, const TensorView& bias,
                       const PackOptions& options);
// w2: [E, H, I] (or [E, H, I/2] nibble-packed); scale [E, H, I/g] or [E, H]; bias empty or [E, H].
PackedWeights pack_w2(const TensorView& w2, const TensorView& scale, const TensorView& bias,
                      const PackOptions& options);
// The same with zero points, for PackOptions::weight_format int4_zero_point (and only then):
// zero_point int8 in [-8, 7], shaped like the scale.
PackedWeights pack_w13(const TensorView& w13, const TensorView& scale, const TensorView& zero_point,
                       const TensorView& bias, const PackOptions& options);
PackedWeights pack_w2(const TensorView& w2, const TensorView& scale, const TensorView& zero_point,
                      const TensorView& bias, const PackOptions& options);

// Checks a packed buffer's header against its size and decodes it; throws Error on any mismatch.
PackedInfo inspect_packed(std::span<const uint8_t> packed, std::string_view argument = "packed");

// The size in bytes of the buffer pack_w13 (role w13: rows 2I, cols H) or pack_w2 (role w2: rows
// H, cols I) returns for these shapes and options, from the shapes alone (for the meta kernels of
// graph compilers). `scale_dtype` is the dtype of the scales as given (options.scale_storage
// applies). Throws Error naming `argument` where the packer would refuse these sizes.
// WeightFormat::int8 (pack_linear's): role w2, one expert, cols the layer's K.
size_t packed_size(WeightRole role, int64_t experts, int64_t rows, int64_t cols, DType scale_dtype,
                   bool has_bias, const PackOptions& options, std::string_view argument);

// The kernel set forward() runs on a buffer of this layout (PackedInfo::layout): the best one
// this CPU can use within the ISA cap. Throws Error when none reads it.
std::string kernel_set_for_layout(std::string_view layout);

// ---------------------------------------------------------------------------------------------
// Forward

struct MoeParams {
  Activation activation = Activation::silu;
  float alpha = 1.702f;  // SWIGLUOAI only
  float limit = 7.0f;    // SWIGLUOAI and SWIGLUSTEP
  bool apply_router_weight_on_input = false;
};

// Owns the worker threads and the scratch memory of forward(). A steady-state call (same or
// smaller sizes as before) makes no heap allocation. Not safe to use from two threads at once.
// A caller's thread pool, for a Context that runs on it instead of on threads of its own (the
// PyTorch binding hands in PyTorch's intra-op pool: threads already awake from the previous op,
// and no second pool competing for the same cores). parallel_for(n, task) must call task(i)
// once for each i in [0, n), on any threads, concurrently or one after another, and return
// when every call has returned; n is at most `threads`. The driver's tasks never wait on a task
// that has not started, so an executor with fewer threads than tasks is slower, never stuck.
// An exception from parallel_for becomes an Error of the call; tasks run twice or not at all
// are an Error too.
struct Executor {
  int threads = 0;  // tasks per run: the work is split into this many, [1, Context::kMaxThreads]
  std::function<void(int n, const std::function<void(int)>& task)> parallel_for;
};

class Context {
 public:
  // The most worker threads a Context takes.
  static constexpr int kMaxThreads = 4096;
  explicit Context(int threads = 0);  // 0: the hardware's thread count, at most kMaxThreads
  // A Context without threads of its own, on the caller's executor.
  explicit Context(Executor executor);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  int threads() const noexcept;
  // Bytes of scratch memory currently held.
  size_t scratch_bytes() const noexcept;
  // ---- resource limits ----------------------------------------------------------------------
  // The most scratch memory forward() may hold (default kDefaultMemoryLimit). Tokens are processed
  // in chunks that fit; a call whose need for a single token exceeds the limit throws Error
  // naming the limit and the need, before allocating. Lowering the limit releases a larger
  // scratch at the next call. docs/robustness.md, "Resource limits", gives the scratch as a
  // function of T, K, H, I and the thread count.
  static constexpr size_t kDefaultMemoryLimit = size_t{1} << 30;
  void set_memory_limit(size_t bytes) noexcept;
  size_t memory_limit() const noexcept;
  // ---- wait policy ---------------------------------------------------------------------------
  // How long idle worker threads poll for the next call before they sleep (default
  // kDefaultSpinWait; like OpenMP's OMP_WAIT_POLICY). A call that finds them polling starts them
  // without a system call; a longer wait keeps them hot across the gap between two layers at
  // the price of their cores during it. 0: sleep at once. Error outside [0, kMaxSpinWait].
  // No effect on a Context on an executor. docs/performance.md, "Threads", has the measures.
  static constexpr std::chrono::microseconds kDefaultSpinWait{200};
  static constexpr std::chrono::microseconds kMaxSpinWait{100'000};
  void set_spin_wait(std::chrono::microseconds wait);
  std::chrono::microseconds spin_wait() const noexcept;
  bool on_executor() const noexcept;

  struct Impl;

 private:
  friend struct detail::ContextAccess;
  std::unique_ptr<Impl> impl_;
};

// Contexts for an embedder that calls forward() from several threads (a serving process, the
// PyTorch binding): lease() hands out an idle Context with the wanted thread count, or makes
// one, so that concurrent callers each get their own (a Context is not safe to share) and a
// steady stream of calls reuses the same one; the lease gives it back when destroyed. At most
// kMaxIdle contexts stay idle, each with its sleeping workers and scratch; the least recently
// used goes first. Thread-safe.
class ContextPool {
 public:
  static constexpr size_t kMaxIdle = 4;

  // The process's pool. Never destroyed (worker threads are not joined at exit); after fork()
  // the child's pool starts empty, since the child has none of the parent's worker threads.
  static ContextPool& instance();

  class Lease {
   public:
    Lease(ContextPool& pool, std::unique_ptr<Context> context) noexcept
        : pool_(&pool), context_(std::move(context)) {}
    ~Lease();
    Lease(Lease&& other) noexcept = default;
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Context& context() noexcept { return *context_; }

   private:
    ContextPool* pool_;
    std::unique_ptr<Context> context_;
  };

  ContextPool() = default;
  ContextPool(const ContextPool&) = delete;
  ContextPool& operator=(const ContextPool&) = delete;

  // threads > 0: a Context with exactly that many threads; 0: any idle one, else a new one with
  // all hardware threads. Throws Error as Context's constructor does.
  Lease lease(int threads);
  // Contexts waiting for a lease.
  size_t idle() const;

 private:
  void give_back(std::unique_ptr<Context> context) noexcept;
  void forget_after_fork() noexcept;

  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Context>> idle_;  // least recently used first
};

// x [T, H] f32/bf16/f16 (row stride may exceed H); topk_ids [T, K] int32/int64 in [0, E);
// topk_weights [T, K] f32/bf16/f16; w13 and w2 packed buffers; out [T, H] of x's dtype.
void forward(Context& context, const TensorView& x, const TensorView& topk_ids,
             const TensorView& topk_weights, std::span<const uint8_t> w13_packed,
             std::span<const uint8_t> w2_packed, const MoeParams& params,
             const MutableTensorView& out);

// Checks the activation and its parameters as forward() does (a known activation, finite alpha,
// positive limit); throws Error naming the first bad one. For callers that check before they
// have data (shape inference).
void check_moe_params(const MoeParams& params);

// ---------------------------------------------------------------------------------------------
// Dense linear layers

// The dense int4 layers of the same checkpoints (attention projections, shared experts), for
// engines that have no int4 kernel of their own on a CPU: out[t, n] = SUM_k x[t, k] * W[n, k]
// + bias[n], each row of x quantized per row to int8 exactly as forward() quantizes a token, the
// weights' group sums as in forward() (docs/operator.md, "Dense linear layers").
// w: int4 values as int8 [N, K] in [-8, 7], or nibble-packed uint8 [N, K/2] (as pack_w2's);
// mxfp4 codes as uint8 [N, K/2]. scale: [N, K/g], or [N] channel-wise. zero_point: empty, or
// (PackOptions::weight_format int4_zero_point) int8 in [-8, 7] shaped like the scale. bias:
// empty or [N]. PackOptions::experts, input_order and gate_up_layout do not apply (Error when
// set). The buffer is a w2-role buffer of one expert (inspect_packed says so).
// PackOptions::weight_format int8: w int8 [N, K] (K a multiple of 32), scale [N] (or [N, 1]),
// no zero points, group_size -1 or K; inspect_packed reports K, group size -1 and format int8.
PackedWeights pack_linear(const TensorView& w, const TensorView& scale,
                          const TensorView& zero_point, const TensorView& bias,
                          const PackOptions& options);
// x [T, K] f32/bf16/f16 (row stride may exceed K); w_packed from pack_linear; out [T, N] of x's
// dtype or f32, not overlapping x. Bit-identical for any thread count.
void linear(Context& context, const TensorView& x, std::span<const uint8_t> w_packed,
            const MutableTensorView& out);

// Float weights [N, K] -> int8 weights per output channel, for pack_linear's int8 format:
// symmetric, scale[n] = max_k |w[n, k]| / 127 (f32), values[n, k] = w[n, k] / scale[n] rounded
// half to even (as torch.round) and clamped to [-127, 127]; a row of zeros gets scale 0 and
// values 0. w: f32, bf16 or f16 [N, K], contiguous rows; values: int8 [N, K]; scales: f32 [N].
// NaN or Inf in w is an Error naming the first such row. Runs on all hardware threads.
void quantize_linear_int8(const TensorView& w, const MutableTensorView& values,
                          const MutableTensorView& scales);

struct LinearInt8Weights {
  std::vector<int8_t> values;  // [N, K]
  std::vector<float> scales;   // [N]
  int64_t rows = 0, cols = 0;
};
// The same into vectors it allocates.
LinearInt8Weights quantize_linear_int8(const TensorView& w);

// ---------------------------------------------------------------------------------------------
// Companions

// The logical (unpacked) weights, as given to the packer.
struct LogicalWeights {
  TensorView w13, w13_scale, w13_bias;
  TensorView w2, w2_scale, w2_bias;
  TensorView w13_zero_point, w2_zero_point;  // int4_zero_point only: int8 shaped like the scales
  TensorView w13_input_order;                // optional, as PackOptions::input_order
  int group_size = -1;
  GateUpLayout gate_up_layout = GateUpLayout::halves;
  WeightFormat weight_format = WeightFormat::int4_symmetric;  // of both w13 and w2
};

// Plain code of the contract over the logical weights (accumulation in double). Slow; shares no
// code with the packer or the kernels. out as for forward().
void reference_forward(const TensorView& x, const TensorView& topk_ids,
                       const TensorView& topk_weights, const LogicalWeights& weights,
                       const MoeParams& params, const MutableTensorView& out);

struct MoeConfig {
  DType x_dtype = DType::f32;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t group_size = -1;
  int64_t activation = static_cast<int64_t>(Activation::silu);  // integer code
  WeightFormat weight_format = WeightFormat::int4_symmetric;    // mxfp4: group_size 32
  // Expert parallelism (w4a8moe/expert_parallel.hpp): the experts this process holds of the
  // `experts` of the layer; 0: all of them.
  int64_t local_experts = 0;
};

struct Support {
  bool supported = false;
  std::string reason;  // empty when supported
};

// Yes, or no with a sentence a user can act on. Never throws, never computes.
Support is_supported_config(const MoeConfig& config) noexcept;

struct OutputSpec {
  std::array<int64_t, 2> shape{};
  DType dtype = DType::f32;
};

// Output shape and dtype from shapes and dtypes alone (no data). Throws Error on mismatches.
OutputSpec infer_output(std::span<const int64_t> x_shape, DType x_dtype,
                        std::span<const int64_t> topk_ids_shape,
                        std::span<const int64_t> topk_weights_shape);

// Float weights -> int4 values and scales, for users who start from float checkpoints.
enum class QuantRule : uint8_t {
  absmax7 = 0,  // scale = max|w| / 7, values in [-7, 7]
  q4_0 = 1,     // scale = m / -8 where m is the element of largest magnitude: uses -8 (GGUF Q4_0)
};

struct QuantizedWeights {
  std::vector<int8_t> values;  // [E, N, K] in [-8, 7]
  std::vector<float> scales;   // [E, N, K/g] or [E, N]
  std::array<int64_t, 3> shape{};
  int group_size = -1;
};

// w: [E, N, K] f32/bf16/f16. group_size -1 or a positive divisor of K.
QuantizedWeights quantize_weights(const TensorView& w, int group_size,
                                  QuantRule rule = QuantRule::absmax7);

// ---------------------------------------------------------------------------------------------
// Packed weight files
//
// A file holding one layer's two packed buffers, so later runs map it instead of repacking:
// a 4096-byte header (magic, file version, packed format version, layout, shapes, group size,
// the payload's size and XXH64 checksum, optional model settings, the header's own checksum),
// then the w13 and w2 buffers at 4096-byte aligned offsets. Little-endian.

inline constexpr uint32_t kPackedFileVersion = 1;

// Settings of the model the weights came from, recorded for tools (`w4a8moe bench --packed`);
// forward() never reads them.
struct PackedFileMeta {
  bool has_params = false;
  MoeParams params;   // when has_params
  int64_t top_k = 0;  // 0: unknown
};

struct PackedFileInfo {
  uint32_t file_version = 0;
  PackedInfo w13, w2;  // the two buffers' headers (layout, format version, shapes, ...)
  int64_t experts = 0, hidden = 0, inter = 0;
  int group_size = -1;
  size_t file_bytes = 0;
  uint64_t checksum = 0;           // XXH64 (seed 0) of the bytes after the header
  bool checksum_verified = false;  // false when opened with verify_checksum = false
  bool mapped = false;             // memory-mapped (else copied into memory)
  PackedFileMeta meta;
};

struct PackedFileOptions {
  // Hash the whole payload before use: one sequential pass over the file (several GB/s; also
  // brings the pages into memory). Headers and shapes are checked either way.
  bool verify_checksum = true;
  // Read the file into memory instead of mapping it: costs its size in memory, but later changes
  // to the file (writes, truncation) cannot reach the loaded weights.
  bool copy = false;
  // copy only: refuse (Error) a file larger than this many bytes before allocating.
  size_t memory_limit = SIZE_MAX;
};

// Writes w13 and w2 (checked as forward() checks them: roles, shapes, group size, layout) to
// `path` so that a crash never leaves a partial file under that name: the bytes go to an unnamed
// (or temporary) file in the same directory, which is fsynced, then renamed over `path`, and the
// directory is fsynced. Throws Error naming the path and the failing step.
void save_packed(const std::string& path, std::span<const uint8_t> w13_packed,
                 std::span<const uint8_t> w2_packed, const PackedFileMeta& meta = {});

// A packed weight file, opened and verified: magic, versions, header checksum, offsets and sizes
// against the file, the payload checksum, both buffers' headers, that w13 and w2 belong together,
// and that a kernel set usable on this CPU (within the ISA cap) reads their layout. Every
// failure throws Error naming the file and the problem, before any weight is used.
//
// Mapped files (the default): the mapping is private and read-only, and the checks run on the
// mapped bytes themselves. The file must not be modified in place or truncated while it is open:
// on Linux later writes show through the mapping, and reading a page past a truncated end raises
// SIGBUS, which no library can prevent for a regular file. Replacing the file is safe
// (save_packed renames a new file over the old one; the mapping keeps the old contents).
// Use PackedFileOptions::copy to be immune to any change.
class PackedFile {
 public:
  PackedFile();
  static PackedFile open(const std::string& path, const PackedFileOptions& options = {});
  ~PackedFile();
  PackedFile(PackedFile&&) noexcept;
  PackedFile& operator=(PackedFile&&) noexcept;
  PackedFile(const PackedFile&) = delete;
  PackedFile& operator=(const PackedFile&) = delete;

  // The packed buffers, valid while this object lives (64-byte aligned).
  std::span<const uint8_t> w13() const noexcept;
  std::span<const uint8_t> w2() const noexcept;
  const PackedFileInfo& info() const noexcept;
  const std::string& path() const noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
// CPU and kernel sets

struct CpuFeatures {
  std::string arch;  // "x86_64", "aarch64", or "other"
  // x86 (usable: CPUID and OS state via XGETBV)
  bool sse41 = false, avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false;
  bool avx512bf16 = false, avxvnni = false, avx512vbmi = false, avx512dq = false;
  // Intel AMX: usable when the CPU has AMX-TILE and AMX-INT8, the OS enables the tile state in
  // XCR0 and (Linux) grants this process the tile data permission. `amx_status` says which of
  // the three is missing ("usable" when none is).
  bool amx_int8 = false;
  std::string amx_status = "not an x86 CPU";
  // AArch64
  bool neon = false, dotprod = false, i8mm = false, sve = false, bf16 = false;
  std::string summary() const;
};

const CpuFeatures& cpu_features();

// Kernel sets in this build usable on this CPU, best first, before any cap.
std::vector<std::string> available_kernel_sets();
// The set forward() and the packer use now: the best available at or below the cap.
std::string active_kernel_set();
// Caps the ISA ("scalar", ...); empty string removes the cap. The environment variable
// W4A8MOE_ISA sets the initial cap. Throws Error on an unknown name.
void set_isa_cap(std::string_view name);

}  // namespace w4a8moe
