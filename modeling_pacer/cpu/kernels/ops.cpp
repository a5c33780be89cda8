// pacer's CPU kernels as torch operators (namespace `pacer`, `torch.ops.pacer.*`): the raw-pointer kernels of
// vnni_matmul.cpp (the same translation unit, built with the same flags) behind TORCH_LIBRARY schemas, so that
// torch's dispatcher sees them: FakeTensor/meta kernels (registered from Python, modeling_pacer/cpu/kernels/__init__.py)
// let torch.compile trace through them without a graph break. Each wrapper allocates its outputs and hands the
// kernels the tensors' addresses; the Python side checks shapes, dtypes and that every tensor is in host memory.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <vector>

#include "vnni_matmul.cpp"

namespace {

int64_t kernel_abi() { return pacer_kernel_abi(); }
bool vnni_available() { return pacer_vnni_available() != 0; }
bool amx_available() { return pacer_amx_available() != 0; }
bool bf16_tiles_available() { return pacer_bf16_tiles_available() != 0; }
int64_t set_amx_rows(int64_t rows) { return pacer_set_amx_rows(rows); }
// the multiply-adds a ns of `threads` threads each running pacer_vnni_peak(iterations) at once (their slowest time)
double vnni_peak(int64_t iterations, int64_t threads) {
    double slowest = 0;
    int64_t done = 0;
#pragma omp parallel num_threads(threads) reduction(max : slowest) reduction(+ : done)
    {
        const auto start = std::chrono::steady_clock::now();
        done += pacer_vnni_peak(iterations);
        slowest = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    return slowest > 0 ? done / slowest / 1e9 : 0.0;
}

#ifdef PACER_VNNI
template <typename T>
const T* in(const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }
const float* maybe(const std::optional<at::Tensor>& t) { return t ? static_cast<const float*>(t->const_data_ptr()) : nullptr; }

at::Tensor output(int64_t m, int64_t n, bool bf16) {
    return at::empty({m, n}, at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t block) {
    const int64_t m = x.size(0), k = x.size(1);
    auto q = at::empty({m, k}, at::TensorOptions().dtype(at::kChar));
    auto scale = at::empty({m, k / block}, at::TensorOptions().dtype(at::kFloat));
    auto sums = at::empty({m, k / 32}, at::TensorOptions().dtype(at::kShort));
    pacer_quantize_rows(in<uint16_t>(x), m, k, block, q.mutable_data_ptr<int8_t>(), scale.mutable_data_ptr<float>(),
                        sums.mutable_data_ptr<int16_t>());
    return {q, scale, sums};
}

at::Tensor q4k_matmul(const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& dd,
                      int64_t n, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& sums,
                      const std::optional<at::Tensor>& bias, bool bf16) {
    auto out = output(q.size(0), n, bf16);
    pacer_q4k_matmul(in<uint8_t>(packed), in<uint8_t>(sc), in<uint8_t>(mn), in<uint16_t>(dd), n, q.size(1),
                     in<int8_t>(q), in<float>(scale), in<int16_t>(sums), q.size(0), maybe(bias), bf16,
                     out.mutable_data_ptr());
    return out;
}

at::Tensor q8_matmul(const at::Tensor& packed, const at::Tensor& wscale, int64_t n, const at::Tensor& q,
                     const at::Tensor& scale, const at::Tensor& sums, const std::optional<at::Tensor>& bias, bool bf16) {
    auto out = output(q.size(0), n, bf16);
    pacer_q8_matmul(in<uint8_t>(packed), in<float>(wscale), n, q.size(1), in<int8_t>(q), in<float>(scale),
                    in<int16_t>(sums), q.size(0), maybe(bias), bf16, out.mutable_data_ptr());
    return out;
}

at::Tensor int4_matmul(const at::Tensor& packed, const at::Tensor& sz, int64_t n, const at::Tensor& q,
                       const at::Tensor& scale, const at::Tensor& sums, const std::optional<at::Tensor>& bias,
                       bool bf16) {
    auto out = output(q.size(0), n, bf16);
    pacer_i4_matmul(in<uint8_t>(packed), in<uint16_t>(sz), n, q.size(1), in<int8_t>(q), in<float>(scale),
                    in<int16_t>(sums), q.size(0), maybe(bias), bf16, out.mutable_data_ptr());
    return out;
}

at::Tensor int4_matmul_bf16(const at::Tensor& packed, const at::Tensor& sz, int64_t n, const at::Tensor& x,
                            const std::optional<at::Tensor>& bias, bool bf16) {
    TORCH_CHECK(pacer_bf16_tiles_available(), "pacer: int4_matmul_bf16 needs AMX-BF16 tiles (bf16_tiles_available)");
    auto out = output(x.size(0), n, bf16);
    pacer_i4_matmul_bf16(in<uint8_t>(packed), in<uint16_t>(sz), n, x.size(1), in<uint16_t>(x), x.size(0), maybe(bias),
                         bf16, out.mutable_data_ptr());
    return out;
}

at::Tensor exact_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& lo, const at::Tensor& hi, double scaling) {
    const int64_t B = query.size(0), H = query.size(1), M = query.size(2), D = query.size(3);
    auto out = at::empty({B, M, H, D}, at::TensorOptions().dtype(at::kFloat));
    pacer_exact_attention(in<uint16_t>(query), in<uint16_t>(key), in<uint16_t>(value), B, H, key.size(1), M,
                          key.size(2), D, key.size(2) * D, in<int64_t>(lo), in<int64_t>(hi), static_cast<float>(scaling),
                          out.mutable_data_ptr<float>());
    return out;
}

// linear layers' buffers as the fused layers read them (vnni_matmul.cpp's Weight): per layer its kind (0 an
// Int4Linear(kernel="pacer"), 1 a W4A8Linear, 2 a W8A8Linear), packed weight, first scales (int4: scales and zeros;
// Q4_K: sc; int8: the per-output scales), Q4_K's minima and super-block scales, float bias, outputs
std::vector<Weight> weights(const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& packed,
                            const std::vector<at::Tensor>& a, const std::vector<std::optional<at::Tensor>>& mn,
                            const std::vector<std::optional<at::Tensor>>& dd,
                            const std::vector<std::optional<at::Tensor>>& bias, const std::vector<int64_t>& n) {
    const size_t count = kinds.size();
    TORCH_CHECK(packed.size() == count && a.size() == count && mn.size() == count && dd.size() == count &&
                    bias.size() == count && n.size() == count,
                "pacer: one kind, packed weight, scales, minima, super-scales, bias and size per layer");
    std::vector<Weight> ws;
    for (size_t i = 0; i < count; ++i) {
        const int64_t kind = kinds[i];
        TORCH_CHECK(kind >= KIND_INT4 && kind <= KIND_Q8, "pacer: unknown linear kind ", kind);
        TORCH_CHECK(kind != KIND_Q4K || (mn[i] && dd[i]), "pacer: a Q4_K layer needs its minima and super-scales");
        ws.push_back(Weight{kind, in<uint8_t>(packed[i]), a[i].const_data_ptr(),
                            mn[i] ? in<uint8_t>(*mn[i]) : nullptr, dd[i] ? in<uint16_t>(*dd[i]) : nullptr,
                            maybe(bias[i]), n[i]});
    }
    return ws;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_qkv(
        const at::Tensor& hidden, const at::Tensor& norm, double eps, const std::vector<int64_t>& kinds,
        const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& a,
        const std::vector<std::optional<at::Tensor>>& mn, const std::vector<std::optional<at::Tensor>>& dd,
        const std::vector<std::optional<at::Tensor>>& bias, const std::vector<int64_t>& n, const at::Tensor& cos,
        const at::Tensor& sin, int64_t head_dim) {
    const auto ws = weights(kinds, packed, a, mn, dd, bias, n);
    TORCH_CHECK(ws.size() == 3, "pacer::layer_qkv reads the q, k and v projections");
    const int64_t m = hidden.size(0);
    auto options = at::TensorOptions().dtype(at::kBFloat16);
    auto q = at::empty({1, ws[0].n / head_dim, m, head_dim}, options);
    auto k = at::empty({1, ws[1].n / head_dim, m, head_dim}, options);
    auto v = at::empty({1, ws[2].n / head_dim, m, head_dim}, options);
    pacer_layer_qkv(in<uint16_t>(hidden), m, hidden.size(1), in<uint16_t>(norm), static_cast<float>(eps), ws.data(),
                    in<uint16_t>(cos), in<uint16_t>(sin), head_dim, static_cast<uint16_t*>(q.mutable_data_ptr()),
                    static_cast<uint16_t*>(k.mutable_data_ptr()), static_cast<uint16_t*>(v.mutable_data_ptr()),
                    m * head_dim, 0, nullptr);
    return {q, k, v};
}

// a cache layer's buffers as the kernels write them: (1, kv_heads, capacity, head_dim), contiguous, k and v alike,
// kv_heads * head_dim the k and v projections' outputs, room at positions at .. at + m - 1
void check_cache_buffers(const at::Tensor& keys, const at::Tensor& values, const Weight* qkv, int64_t head_dim,
                         int64_t at, int64_t m, const char* what) {
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 4 && keys.sizes() == values.sizes() &&
                    keys.size(0) == 1 && keys.size(1) * head_dim == qkv[1].n && qkv[1].n == qkv[2].n &&
                    keys.size(3) == head_dim && at >= 0 && at + m <= keys.size(2),
                what, ": the cache buffers must be (1, kv_heads, capacity, head_dim), contiguous, with room for the new "
                "rows");
}

// m int64 positions, each in [low, high): the rows' cache slots or key bounds of a packed call (several sequences'
// rows in one call); null where not given
const int64_t* positions(const std::optional<at::Tensor>& t, int64_t m, int64_t low, int64_t high, const char* what) {
    if (!t) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == m, what,
                ": one int64 position per row");
    const int64_t* p = in<int64_t>(*t);
    for (int64_t r = 0; r < m; ++r) TORCH_CHECK(p[r] >= low && p[r] < high, what, ": position ", p[r], " outside [", low,
                                                ", ", high, ")");
    return p;
}

// a packed call's key bounds: row r sees keys lo[r] .. hi[r] - 1 of `length`, at least one; both given or neither
std::pair<const int64_t*, const int64_t*> key_bounds(const std::optional<at::Tensor>& lo,
                                                     const std::optional<at::Tensor>& hi, int64_t m, int64_t length,
                                                     const char* what) {
    TORCH_CHECK(lo.has_value() == hi.has_value(), what, ": the rows' key bounds come as lo and hi together");
    const int64_t* l = positions(lo, m, 0, length, what);
    const int64_t* h = positions(hi, m, 1, length + 1, what);
    for (int64_t r = 0; l && r < m; ++r) TORCH_CHECK(l[r] < h[r], what, ": row ", r, " sees no key");
    return {l, h};
}

// layer_qkv writing the new keys and values into a cache's buffers at positions at .. at + m - 1; returns q
at::Tensor layer_qkv_cached(
        const at::Tensor& hidden, const at::Tensor& norm, double eps, const std::vector<int64_t>& kinds,
        const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& a,
        const std::vector<std::optional<at::Tensor>>& mn, const std::vector<std::optional<at::Tensor>>& dd,
        const std::vector<std::optional<at::Tensor>>& bias, const std::vector<int64_t>& n, const at::Tensor& cos,
        const at::Tensor& sin, int64_t head_dim, at::Tensor& keys, at::Tensor& values, int64_t at,
        const std::optional<at::Tensor>& slots) {
    const auto ws = weights(kinds, packed, a, mn, dd, bias, n);
    TORCH_CHECK(ws.size() == 3, "pacer::layer_qkv_cached reads the q, k and v projections");
    const int64_t m = hidden.size(0), capacity = keys.size(2);
    check_cache_buffers(keys, values, ws.data(), head_dim, slots ? 0 : at, slots ? 0 : m, "pacer::layer_qkv_cached");
    const int64_t* rows = positions(slots, m, 0, capacity, "pacer::layer_qkv_cached slots");
    auto q = at::empty({1, ws[0].n / head_dim, m, head_dim}, at::TensorOptions().dtype(at::kBFloat16));
    pacer_layer_qkv(in<uint16_t>(hidden), m, hidden.size(1), in<uint16_t>(norm), static_cast<float>(eps), ws.data(),
                    in<uint16_t>(cos), in<uint16_t>(sin), head_dim, static_cast<uint16_t*>(q.mutable_data_ptr()),
                    static_cast<uint16_t*>(keys.mutable_data_ptr()), static_cast<uint16_t*>(values.mutable_data_ptr()),
                    capacity * head_dim, at, rows);
    return q;
}

at::Tensor layer_rest(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scaling,
                      const at::Tensor& hidden, const at::Tensor& norm, double eps, const std::vector<int64_t>& kinds,
                      const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& a,
                      const std::vector<std::optional<at::Tensor>>& mn,
                      const std::vector<std::optional<at::Tensor>>& dd,
                      const std::vector<std::optional<at::Tensor>>& bias, const std::vector<int64_t>& n,
                      const std::optional<at::Tensor>& lo, const std::optional<at::Tensor>& hi) {
    const auto ws = weights(kinds, packed, a, mn, dd, bias, n);
    TORCH_CHECK(ws.size() == 4, "pacer::layer_rest reads the o, gate, up and down projections");
    // keys and values: each head's rows contiguous (a tensor of their own, or the first positions of a cache's buffer)
    const int64_t d = q.size(3);
    TORCH_CHECK(keys.sizes() == values.sizes() && keys.strides() == values.strides() && keys.size(0) == 1 &&
                    keys.size(3) == d && keys.stride(3) == 1 && keys.stride(2) == d &&
                    (keys.size(1) == 1 || keys.stride(1) >= keys.size(2) * d),
                "pacer::layer_rest: keys and values must be (1, kv_heads, length, head_dim) with each head's rows "
                "contiguous");
    const auto bounds = key_bounds(lo, hi, q.size(2), keys.size(2), "pacer::layer_rest");
    auto out = at::empty(hidden.sizes(), hidden.options());
    pacer_layer_rest(in<uint16_t>(q), in<uint16_t>(keys), in<uint16_t>(values), q.size(2), q.size(1), keys.size(1),
                     keys.size(2), d, keys.size(1) == 1 ? keys.size(2) * d : keys.stride(1), static_cast<float>(scaling), in<uint16_t>(hidden), hidden.size(-1),
                     in<uint16_t>(norm), static_cast<float>(eps), ws.data(), ws[1].n, bounds.first, bounds.second,
                     static_cast<uint16_t*>(out.mutable_data_ptr()));
    return out;
}

// every decoder layer of a model in one call (pacer_decoder_layers): the counts per layer, and each layer's cache
// buffers as layer_qkv_cached checks them
at::Tensor decoder_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim,
                          double scaling, const std::vector<at::Tensor>& norms, const std::vector<double>& eps,
                          const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& packed,
                          const std::vector<at::Tensor>& a, const std::vector<std::optional<at::Tensor>>& mn,
                          const std::vector<std::optional<at::Tensor>>& dd,
                          const std::vector<std::optional<at::Tensor>>& bias, const std::vector<int64_t>& n,
                          const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                          const std::vector<int64_t>& held, const std::optional<at::Tensor>& slots,
                          const std::optional<at::Tensor>& lo, const std::optional<at::Tensor>& hi) {
    const auto ws = weights(kinds, packed, a, mn, dd, bias, n);
    const int64_t layers = static_cast<int64_t>(keys.size()), m = hidden.size(0);
    TORCH_CHECK(layers > 0 && ws.size() == size_t(7 * layers) && norms.size() == size_t(2 * layers) &&
                    eps.size() == size_t(2 * layers) && values.size() == size_t(layers) && held.size() == size_t(layers),
                "pacer::decoder_layers: per layer two norms and epsilons, seven projections, a key and a value buffer "
                "and the positions held");
    std::vector<const uint16_t*> norm_ptrs;
    std::vector<float> eps_f;
    std::vector<uint16_t*> key_ptrs, value_ptrs;
    std::vector<int64_t> capacity;
    for (int64_t l = 0; l < layers; ++l) {
        const at::Tensor& k = keys[l];
        const at::Tensor& v = values[l];
        check_cache_buffers(k, v, ws.data() + 7 * l, head_dim, slots ? 0 : held[l], slots ? 0 : m,
                            ("pacer::decoder_layers, layer " + std::to_string(l)).c_str());
        TORCH_CHECK(!slots || k.size(2) == keys[0].size(2),
                    "pacer::decoder_layers: a packed call's layers share one capacity (its slots are every layer's)");
        norm_ptrs.push_back(in<uint16_t>(norms[2 * l]));
        norm_ptrs.push_back(in<uint16_t>(norms[2 * l + 1]));
        eps_f.push_back(static_cast<float>(eps[2 * l]));
        eps_f.push_back(static_cast<float>(eps[2 * l + 1]));
        key_ptrs.push_back(static_cast<uint16_t*>(k.mutable_data_ptr()));
        value_ptrs.push_back(static_cast<uint16_t*>(v.mutable_data_ptr()));
        capacity.push_back(k.size(2));
    }
    TORCH_CHECK(slots.has_value() == lo.has_value(), "pacer::decoder_layers: a packed call gives its rows' slots and "
                "key bounds together");
    const int64_t* rows = positions(slots, m, 0, capacity[0], "pacer::decoder_layers slots");
    const auto bounds = key_bounds(lo, hi, m, capacity[0], "pacer::decoder_layers");
    auto out = at::empty(hidden.sizes(), hidden.options());
    pacer_decoder_layers(in<uint16_t>(hidden), m, hidden.size(1), layers, norm_ptrs.data(), eps_f.data(), ws.data(),
                         in<uint16_t>(cos), in<uint16_t>(sin), head_dim, static_cast<float>(scaling), key_ptrs.data(),
                         value_ptrs.data(), capacity.data(), held.data(), rows, bounds.first, bounds.second,
                         static_cast<uint16_t*>(out.mutable_data_ptr()));
    return out;
}
#endif

}  // namespace

TORCH_LIBRARY(pacer, m) {
    m.def("kernel_abi() -> int", &kernel_abi);
    m.def("vnni_available() -> bool", &vnni_available);
    m.def("amx_available() -> bool", &amx_available);
    m.def("bf16_tiles_available() -> bool", &bf16_tiles_available);
    m.def("set_amx_rows(int rows) -> int", &set_amx_rows);
    m.def("vnni_peak(int iterations, int threads) -> float", &vnni_peak);
#ifdef PACER_VNNI
    m.def("quantize_rows(Tensor x, int block) -> (Tensor, Tensor, Tensor)");
    m.def("q4k_matmul(Tensor packed, Tensor sc, Tensor mn, Tensor dd, int n, Tensor q, Tensor scale, Tensor sums, "
          "Tensor? bias, bool bf16) -> Tensor");
    m.def("q8_matmul(Tensor packed, Tensor wscale, int n, Tensor q, Tensor scale, Tensor sums, Tensor? bias, "
          "bool bf16) -> Tensor");
    m.def("int4_matmul(Tensor packed, Tensor sz, int n, Tensor q, Tensor scale, Tensor sums, Tensor? bias, "
          "bool bf16) -> Tensor");
    m.def("int4_matmul_bf16(Tensor packed, Tensor sz, int n, Tensor x, Tensor? bias, bool bf16) -> Tensor");
    m.def("exact_attention(Tensor query, Tensor key, Tensor value, Tensor lo, Tensor hi, float scaling) -> Tensor");
    m.def("layer_qkv(Tensor hidden, Tensor norm, float eps, int[] kinds, Tensor[] packed, Tensor[] a, Tensor?[] mn, "
          "Tensor?[] dd, Tensor?[] bias, int[] n, Tensor cos, Tensor sin, int head_dim) -> (Tensor, Tensor, Tensor)");
    m.def("layer_qkv_cached(Tensor hidden, Tensor norm, float eps, int[] kinds, Tensor[] packed, Tensor[] a, "
          "Tensor?[] mn, Tensor?[] dd, Tensor?[] bias, int[] n, Tensor cos, Tensor sin, int head_dim, "
          "Tensor(a!) keys, Tensor(b!) values, int at, Tensor? slots=None) -> Tensor");
    m.def("decoder_layers(Tensor hidden, Tensor cos, Tensor sin, int head_dim, float scaling, Tensor[] norms, "
          "float[] eps, int[] kinds, Tensor[] packed, Tensor[] a, Tensor?[] mn, Tensor?[] dd, Tensor?[] bias, int[] n, "
          "Tensor(a!)[] keys, Tensor(b!)[] values, int[] held, Tensor? slots=None, Tensor? lo=None, Tensor? hi=None) -> Tensor");
    m.def("layer_rest(Tensor q, Tensor keys, Tensor values, float scaling, Tensor hidden, Tensor norm, float eps, "
          "int[] kinds, Tensor[] packed, Tensor[] a, Tensor?[] mn, Tensor?[] dd, Tensor?[] bias, int[] n, Tensor? lo=None, "
          "Tensor? hi=None) -> Tensor");
#endif
}

#ifdef PACER_VNNI
TORCH_LIBRARY_IMPL(pacer, CPU, m) {
    m.impl("quantize_rows", &quantize_rows);
    m.impl("q4k_matmul", &q4k_matmul);
    m.impl("q8_matmul", &q8_matmul);
    m.impl("int4_matmul", &int4_matmul);
    m.impl("int4_matmul_bf16", &int4_matmul_bf16);
    m.impl("exact_attention", &exact_attention);
    m.impl("layer_qkv", &layer_qkv);
    m.impl("layer_qkv_cached", &layer_qkv_cached);
    m.impl("decoder_layers", &decoder_layers);
    m.impl("layer_rest", &layer_rest);
}
#endif
