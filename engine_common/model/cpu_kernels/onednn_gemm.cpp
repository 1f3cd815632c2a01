// A bf16 linear layer through oneDNN's matmul primitive, created once and called directly.
//
// torch's packed linear (torch.ops.mkldnn._linear_pointwise) runs the same oneDNN kernel on
// the same blocked weight layout, but builds a primitive descriptor, looks its primitive up
// and allocates a scratchpad on every call: ~14 us a call on a Zen 4 core, where the kernel
// itself takes 20-90 us for a decode batch of one. Here a weight is reordered once into the
// layout the matmul prefers (chosen for a probe M), and a primitive per (M, N, K, dtype,
// bias) is created on first use and kept in a per-thread LRU cache shared by every weight
// of that shape (a model's 30 q/k/v projections share one), with its source and destination
// memory objects, so a call only sets three pointers and executes.
//
// Owns only the oneDNN objects. The Python side (engine_common/model/onednn_gemm.py) builds
// and loads this file, checks the tensors and passes raw pointers: y[m, n] = x[m, k] W^T
// (+ bias), rows contiguous, W given as [n, k] rows (as torch holds a linear weight).
//
// Errors are codes, never exceptions across the C boundary: 0 ok, 1 bad arguments, 2 a
// oneDNN error (unsupported on this CPU, out of memory).

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <exception>
#include <list>
#include <memory>
#include <unordered_map>
#include <utility>

namespace {

using dnnl::memory;

enum DType : int { kFloat32 = 0, kBFloat16 = 1 };
constexpr size_t kCacheCapacity = 256;  // (shape, M) pairs a thread keeps

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

bool to_data_type(int dtype, memory::data_type* out) {
  if (dtype == kBFloat16) *out = memory::data_type::bf16;
  else if (dtype == kFloat32) *out = memory::data_type::f32;
  else return false;
  return true;
}

struct Gemm {
  int64_t n, k, probe_m;
  int dtype;
  memory::data_type type;
  memory::desc weight_desc;  // the blocked layout the probe primitive chose
  memory weight;             // the weight in that layout, owned here
};

// A matmul for [m, k] x [k, n] with the given weight layout (or `any` to let oneDNN pick),
// writing `dst_type` (the weights' type, or float32: the float32 sums unrounded).
dnnl::matmul::primitive_desc make_desc(int64_t m, const Gemm& g, bool bias,
                                       const memory::desc& weight_desc,
                                       memory::data_type dst_type) {
  memory::desc src({m, g.k}, g.type, {g.k, 1});
  memory::desc dst({m, g.n}, dst_type, {g.n, 1});
  if (bias) {
    memory::desc bias_desc({1, g.n}, g.type, {g.n, 1});
    return dnnl::matmul::primitive_desc(cpu_engine(), src, weight_desc, bias_desc, dst);
  }
  return dnnl::matmul::primitive_desc(cpu_engine(), src, weight_desc, dst);
}

struct Key {
  int64_t m, n, k;
  int dtype;
  memory::data_type dst_type;
  bool bias;
  int64_t probe_m;  // the weight layout is a function of (probe_m, n, k, dtype)
  bool operator==(const Key& o) const {
    return m == o.m && n == o.n && k == o.k && dtype == o.dtype && dst_type == o.dst_type &&
           bias == o.bias && probe_m == o.probe_m;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t v : {static_cast<uint64_t>(key.m), static_cast<uint64_t>(key.n),
                       static_cast<uint64_t>(key.k), static_cast<uint64_t>(key.dtype),
                       static_cast<uint64_t>(key.dst_type),
                       static_cast<uint64_t>(key.bias), static_cast<uint64_t>(key.probe_m)}) {
      h = (h ^ v) * 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// A primitive with its source/destination/bias memory objects, whose pointers each call
// replaces (dnnl::memory::set_data_handle): no object is created on the hot path.
struct Entry {
  dnnl::matmul matmul;
  memory src, dst, bias;
};

class PrimitiveCache {
 public:
  Entry& lookup(const Key& key, const Gemm& g) {
    auto found = index_.find(key);
    if (found != index_.end()) {
      entries_.splice(entries_.begin(), entries_, found->second);
      return found->second->second;
    }
    if (entries_.size() == kCacheCapacity) {
      index_.erase(entries_.back().first);
      entries_.pop_back();
    }
    auto desc = make_desc(key.m, g, key.bias, g.weight_desc, key.dst_type);
    Entry entry{dnnl::matmul(desc), memory(desc.src_desc(), cpu_engine(), nullptr),
                memory(desc.dst_desc(), cpu_engine(), nullptr),
                key.bias ? memory(memory::desc({1, g.n}, g.type, {g.n, 1}), cpu_engine(),
                                  nullptr)
                         : memory()};
    entries_.emplace_front(key, std::move(entry));
    index_.emplace(key, entries_.begin());
    return entries_.front().second;
  }

 private:
  std::list<std::pair<Key, Entry>> entries_;
  std::unordered_map<Key, std::list<std::pair<Key, Entry>>::iterator, KeyHash> index_;
};

PrimitiveCache& thread_cache() {
  thread_local PrimitiveCache cache;
  return cache;
}

}  // namespace

extern "C" {

// Packs `weight` ([n, k], row stride `weight_stride` elements) for a matmul whose layout
// oneDNN chooses for M = `probe_m`; *out receives the handle (free with tandem_gemm_destroy).
int tandem_gemm_create(int dtype, int64_t n, int64_t k, const void* weight,
                       int64_t weight_stride, int64_t probe_m, void** out) {
  *out = nullptr;
  memory::data_type type;
  if (!to_data_type(dtype, &type) || n <= 0 || k <= 0 || weight_stride < k || probe_m <= 0 ||
      weight == nullptr) {
    return 1;
  }
  try {
    auto g = std::make_unique<Gemm>();
    g->n = n;
    g->k = k;
    g->probe_m = probe_m;
    g->dtype = dtype;
    g->type = type;
    memory::desc any({k, n}, type, memory::format_tag::any);
    g->weight_desc = make_desc(probe_m, *g, false, any, type).weights_desc();
    // W^T as the matmul's [k, n] operand: element (i, j) is weight[j * stride + i].
    memory plain(memory::desc({k, n}, type, {1, weight_stride}), cpu_engine(),
                 const_cast<void*>(weight));
    g->weight = memory(g->weight_desc, cpu_engine());
    dnnl::reorder(plain, g->weight).execute(thread_stream(), plain, g->weight);
    thread_stream().wait();
    *out = g.release();
    return 0;
  } catch (const std::exception&) {  // dnnl::error, std::bad_alloc: none may cross the C ABI
    return 2;
  }
}

void tandem_gemm_destroy(void* handle) { delete static_cast<Gemm*>(handle); }

// The packed weight's size in bytes (for the engine's memory accounting).
int64_t tandem_gemm_packed_bytes(void* handle) {
  return static_cast<int64_t>(static_cast<Gemm*>(handle)->weight_desc.get_size());
}

// y[m, n] = x[m, k] W^T (+ bias[n]); x contiguous rows of the handle's dtype, y of
// `y_dtype` (the handle's, or float32).
int tandem_gemm_run(void* handle, const void* x, int64_t m, void* y, const void* bias,
                    int y_dtype) {
  auto* g = static_cast<Gemm*>(handle);
  memory::data_type y_type;
  if (g == nullptr || x == nullptr || y == nullptr || m <= 0 ||
      !to_data_type(y_dtype, &y_type) || (y_dtype != g->dtype && y_dtype != kFloat32)) {
    return 1;
  }
  try {
    Key key{m, g->n, g->k, g->dtype, y_type, bias != nullptr, g->probe_m};
    Entry& entry = thread_cache().lookup(key, *g);
    entry.src.set_data_handle(const_cast<void*>(x));
    entry.dst.set_data_handle(y);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, entry.src},
                                         {DNNL_ARG_WEIGHTS, g->weight},
                                         {DNNL_ARG_DST, entry.dst}};
    if (bias != nullptr) {
      entry.bias.set_data_handle(const_cast<void*>(bias));
      args.emplace(DNNL_ARG_BIAS, entry.bias);
    }
    entry.matmul.execute(thread_stream(), args);
    thread_stream().wait();
    return 0;
  } catch (const std::exception&) {  // dnnl::error, std::bad_alloc: none may cross the C ABI
    return 2;
  }
}

}  // extern "C"
