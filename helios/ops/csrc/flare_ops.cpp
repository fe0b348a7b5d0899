// Native CPU kernels of the flare:: ops (helios/ops/native.py builds and loads this file).
//
// Same semantics and error messages as the Python reference kernels in
// helios/ops/{kv_cache,attention,slot_state}.py: work follows each row's real
// length, inactive rows (query_lens 0) touch nothing, a page the slot does not
// own is refused. The schemas are defined in Python (helios/ops/schema.py);
// this file only registers CPU implementations, so a program calls the same
// op whichever kernel serves it, and nothing here re-enters Python.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNoPage = -1;

// A small integer tensor (row metadata, page table rows) read as int64 values.
std::vector<int64_t> ints(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  std::vector<int64_t> out(c.numel());
  switch (c.scalar_type()) {
    case at::kInt: {
      const int32_t* p = c.data_ptr<int32_t>();
      std::copy(p, p + c.numel(), out.begin());
      break;
    }
    case at::kLong: {
      const int64_t* p = c.data_ptr<int64_t>();
      std::copy(p, p + c.numel(), out.begin());
      break;
    }
    default:
      TORCH_CHECK_VALUE(false, "flare ops take int32 or int64 row metadata, got ", c.scalar_type());
  }
  return out;
}

std::string list_text(const std::vector<int64_t>& values) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < values.size(); ++i) s << (i ? ", " : "") << values[i];
  s << "]";
  return s.str();
}

struct Row {
  int64_t row, slot, offset, length, start;
  int64_t end() const { return start + length; }
};

std::vector<Row> active_rows(const at::Tensor& row_slots, const at::Tensor& query_lens, const at::Tensor& start_pos) {
  auto slots = ints(row_slots), lens = ints(query_lens), starts = ints(start_pos);
  TORCH_CHECK_VALUE(slots.size() == lens.size() && lens.size() == starts.size(),
                    "row_slots, query_lens and start_pos must have one entry per row");
  std::vector<Row> rows;
  int64_t offset = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0, "query_lens[", b, "] = ", lens[b], ": query lengths must be >= 0");
    if (lens[b]) rows.push_back(Row{static_cast<int64_t>(b), slots[b], offset, lens[b], starts[b]});
    offset += lens[b];
  }
  return rows;
}

// The page table, read once per op call.
struct PageTable {
  std::vector<int64_t> entries;
  int64_t slots, max_pages;
  explicit PageTable(const at::Tensor& t) : entries(ints(t)), slots(t.size(0)), max_pages(t.size(1)) {}
};

// Physical page of every block a row addresses, checked like helios.ops.layout.slot_positions:
// positions first..stop-1 must fit the slot and lie in pages the slot owns.
const int64_t* row_pages(const PageTable& table, int64_t page_size, int64_t num_pages, const Row& row, int64_t first,
                         int64_t stop) {
  TORCH_CHECK_VALUE(0 <= row.slot && row.slot < table.slots, "row ", row.row, ": slot ", row.slot,
                    " outside the page table's ", table.slots, " slots");
  TORCH_CHECK_VALUE(stop <= table.max_pages * page_size, "row ", row.row, ": context ", stop,
                    " exceeds the slot capacity ", table.max_pages, " pages x ", page_size, " tokens");
  const int64_t* pages = table.entries.data() + row.slot * table.max_pages;
  for (int64_t block = first / page_size; block < (stop + page_size - 1) / page_size; ++block) {
    TORCH_CHECK_VALUE(pages[block] >= 0, "row ", row.row, ": slot ", row.slot, " has no page for block ", block,
                      " (positions ", first, "..", stop - 1,
                      "); the host must reserve every page a frame writes or reads before submitting it");
    TORCH_CHECK_INDEX(pages[block] < num_pages, "row ", row.row, ": page ", pages[block], " outside the cache's ",
                      num_pages, " pages");
  }
  return pages;
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK_VALUE(cache.dim() == 5, name, " must be [layers, num_pages, page_size, kv_heads, head_dim]");
  TORCH_CHECK_VALUE(cache.is_contiguous(), name, " must be contiguous");
}

template <typename T>
void write_rows(at::Tensor& cache, int64_t layer, const at::Tensor& src, const PageTable& page_table,
                const std::vector<Row>& rows) {
  const int64_t page_size = cache.size(2), num_pages = cache.size(1);
  const int64_t token = cache.size(3) * cache.size(4);  // values per cached token
  T* base = cache.data_ptr<T>() + layer * num_pages * page_size * token;
  const T* from = src.data_ptr<T>();
  for (const Row& row : rows) {
    const int64_t* pages = row_pages(page_table, page_size, num_pages, row, row.start, row.end());
    for (int64_t i = 0; i < row.length; ++i) {
      const int64_t pos = row.start + i;
      T* to = base + (pages[pos / page_size] * page_size + pos % page_size) * token;
      std::copy(from + (row.offset + i) * token, from + (row.offset + i + 1) * token, to);
    }
  }
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& page_table, const at::Tensor& row_slots, const at::Tensor& query_lens,
              const at::Tensor& start_pos) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK_VALUE(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
                    "write_kv: new keys/values are ", k.scalar_type(), "/", v.scalar_type(), ", the caches ",
                    k_cache.scalar_type(), "/", v_cache.scalar_type());
  TORCH_CHECK_INDEX(0 <= layer && layer < k_cache.size(0), "layer ", layer, " outside the cache's ", k_cache.size(0));
  auto rows = active_rows(row_slots, query_lens, start_pos);
  const PageTable table(page_table);
  at::Tensor kc = k.contiguous(), vc = v.contiguous();
  for (const Row& row : rows)  // validate every row before writing any
    row_pages(table, k_cache.size(2), k_cache.size(1), row, row.start, row.end());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "flare::write_kv", [&] {
    write_rows<scalar_t>(k_cache, layer, kc, table, rows);
    write_rows<scalar_t>(v_cache, layer, vc, table, rows);
  });
}

// ---- flare::paged_attention ----
//
// One pass over a row's cached tokens serves every query head: for each cached position the whole
// K row (all KV heads, contiguous in the cache) is read once and dotted with the query heads of each
// KV head's group, then, after the softmax, the whole V row is read once and added into every query
// head's accumulator. Positions are walked page by page (each page holds page_size contiguous rows),
// and only up to each query's causal end. The queries of a prefill row go through in tiles of
// kQueryTile tokens that share those reads; each query's sums are the same whichever tile it sits in.
//
// Summation order is fixed per query: a score is one dim-long dot product (16 lanes, then the lanes
// added in one fixed order), the softmax normaliser adds the exponentials in the same 16-lane order
// over positions, and the weighted sum of values adds positions in order into 16-lane accumulators.
// So a row's output does not depend on which other rows share the call (nor on the thread that runs it).
constexpr int64_t kQueryTile = 16;

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// sum_d a[d] * b[d]
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  if (d < n) {
    const __mmask16 m = tail_mask(n - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// acc[d] += p * v[d]
inline void axpy(float p, const float* v, float* acc, int64_t n) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
  if (d < n) {
    const __mmask16 m = tail_mask(n - d);
    _mm512_mask_storeu_ps(acc + d, m, _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, v + d), _mm512_maskz_loadu_ps(m, acc + d)));
  }
}
// exp(x) for 16 floats, within a few ulp for the x <= 0 a softmax uses: x = n ln2 + r with |r| <= ln2/2
// (ln2 split in two so n ln2 is exact), e^r by its degree-7 Taylor polynomial (truncation below 1e-8
// relative), then times 2^n by scalef, which rounds into the subnormals and to 0 as exp does (x is
// first clamped at -104, where exp is already 0 in float, so r stays small). The same operations for
// every lane, so a value's exponential does not depend on its neighbours.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// s[j] = exp(s[j] - top) for j < n; returns their sum (16 lanes in position order, then the lanes added).
inline float exp_shifted(float* s, int64_t n, float top) {
  const __m512 t = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), t));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), t)));
    _mm512_mask_storeu_ps(s + j, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#else
inline float exp_shifted(float* s, int64_t n, float top) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - top));
  return sum;
}
#endif

// Portable forms (and the only ones for half and bfloat16 caches): the same 16-lane order, left to
// the compiler to vectorize; arithmetic in float whatever the storage type.
template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  float lanes[16] = {0};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += static_cast<float>(a[d + l]) * static_cast<float>(b[d + l]);
  for (int l = 0; d < n; ++d, ++l) lanes[l] += static_cast<float>(a[d]) * static_cast<float>(b[d]);
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum;
}

template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// Work space of one thread, sized once per call for the longest row: scores [tile, heads, context]
// and accumulators [tile, heads, dim], plus each (query, head)'s running maximum and normaliser.
struct AttentionScratch {
  std::vector<float> scores, acc, top, total;
  AttentionScratch(int64_t tile, int64_t heads, int64_t context, int64_t dim)
      : scores(tile * heads * context), acc(tile * heads * dim), top(tile * heads), total(tile * heads) {}
};

struct AttentionShape {
  int64_t heads, kv_heads, dim, page_size;
  float scale;
  int64_t group() const { return heads / kv_heads; }
  int64_t token() const { return kv_heads * dim; }  // values per cached position
};

// Queries first..first+count-1 of one row (query i sees positions 0..row.start+i) over the paged cache.
template <typename T>
void attend_tile(const T* q, T* out, const T* k_layer, const T* v_layer, const int64_t* pages, const Row& row,
                 int64_t first, int64_t count, const AttentionShape& a, AttentionScratch& w) {
  const int64_t heads = a.heads, group = a.group(), dim = a.dim, token = a.token(), page_size = a.page_size;
  const int64_t context = row.start + first + count;  // the tile's last query sees this many positions
  const int64_t qh = count * heads;                   // (query, head) pairs of the tile
  const T* q0 = q + (row.offset + first) * heads * dim;
  float* scores = w.scores.data();  // [qh, context]
  std::fill(w.top.begin(), w.top.begin() + qh, -std::numeric_limits<float>::infinity());
  // Pass 1: scores, one K row at a time; a position is scored for the tile's queries that see it.
  for (int64_t block = 0, j = 0; j < context; ++block) {
    const T* page = k_layer + pages[block] * page_size * token;
    for (int64_t stop = std::min(context, j + page_size); j < stop; ++j) {
      const T* kj = page + (j % page_size) * token;
      for (int64_t i = std::max<int64_t>(0, j - row.start - first); i < count; ++i) {
        const T* qi = q0 + i * heads * dim;
        for (int64_t g = 0; g < a.kv_heads; ++g)
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const float s = dot(qi + h * dim, kj + g * dim, dim) * a.scale;
            scores[(i * heads + h) * context + j] = s;
            w.top[i * heads + h] = std::max(w.top[i * heads + h], s);
          }
      }
    }
  }
  // Softmax numerators in place, and each normaliser summed in position order.
  for (int64_t i = 0; i < count; ++i) {
    const int64_t seen = row.start + first + i + 1;
    for (int64_t h = 0; h < heads; ++h) {
      w.total[i * heads + h] = exp_shifted(scores + (i * heads + h) * context, seen, w.top[i * heads + h]);
    }
  }
  // Pass 2: the weighted sum of values, one V row at a time.
  float* acc = w.acc.data();  // [qh, dim]
  std::fill(acc, acc + qh * dim, 0.0f);
  for (int64_t block = 0, j = 0; j < context; ++block) {
    const T* page = v_layer + pages[block] * page_size * token;
    for (int64_t stop = std::min(context, j + page_size); j < stop; ++j) {
      const T* vj = page + (j % page_size) * token;
      for (int64_t i = std::max<int64_t>(0, j - row.start - first); i < count; ++i)
        for (int64_t g = 0; g < a.kv_heads; ++g)
          for (int64_t h = g * group; h < (g + 1) * group; ++h)
            axpy(scores[(i * heads + h) * context + j], vj + g * dim, acc + (i * heads + h) * dim, dim);
    }
  }
  T* o = out + (row.offset + first) * heads * dim;
  for (int64_t p = 0; p < qh; ++p) {
    const float inv = 1.0f / w.total[p];
    for (int64_t d = 0; d < dim; ++d) o[p * dim + d] = static_cast<T>(acc[p * dim + d] * inv);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                           const at::Tensor& page_table, const at::Tensor& row_slots, const at::Tensor& query_lens,
                           const at::Tensor& start_pos, double scale) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [tokens, heads, head_dim]");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                    "paged_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK_INDEX(0 <= layer && layer < k_cache.size(0), "layer ", layer, " outside the cache's ", k_cache.size(0));
  const AttentionShape shape{q.size(1), k_cache.size(3), q.size(2), k_cache.size(2), static_cast<float>(scale)};
  TORCH_CHECK_VALUE(shape.kv_heads > 0 && shape.heads % shape.kv_heads == 0 && k_cache.size(4) == shape.dim &&
                        v_cache.sizes() == k_cache.sizes(),
                    "paged_attention: q heads/dim do not fit the cache");
  at::Tensor qc = q.contiguous();
  at::Tensor out = at::zeros_like(qc);
  auto rows = active_rows(row_slots, query_lens, start_pos);
  const PageTable table(page_table);
  std::vector<const int64_t*> pages;
  int64_t longest = 0;
  for (const Row& row : rows) {
    TORCH_CHECK_VALUE(row.offset + row.length <= q.size(0), "row ", row.row, ": packed tokens ", row.offset, "..",
                      row.offset + row.length - 1, " outside q's ", q.size(0));
    pages.push_back(row_pages(table, shape.page_size, k_cache.size(1), row, 0, row.end()));
    longest = std::max(longest, row.end());
  }
  if (rows.empty()) return out;
  const int64_t layer_size = k_cache.size(1) * shape.page_size * shape.token();
  const int64_t tile = std::min<int64_t>(kQueryTile, std::max_element(rows.begin(), rows.end(), [](auto& x, auto& y) {
                                                       return x.length < y.length;
                                                     })->length);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "flare::paged_attention", [&] {
    const scalar_t* kl = k_cache.data_ptr<scalar_t>() + layer * layer_size;
    const scalar_t* vl = v_cache.data_ptr<scalar_t>() + layer * layer_size;
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // Rows are independent: with several intra-op threads each takes a share, with its own work space.
    at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
      AttentionScratch scratch(tile, shape.heads, longest, shape.dim);
      for (int64_t r = begin; r < end; ++r)
        for (int64_t first = 0; first < rows[r].length; first += tile)
          attend_tile<scalar_t>(qp, op, kl, vl, pages[r], rows[r], first, std::min(tile, rows[r].length - first),
                                shape, scratch);
    });
  });
  return out;
}

void write_slot_state(at::Tensor pending, at::Tensor seq_lens, const at::Tensor& row_slots,
                      const at::Tensor& query_lens, const at::Tensor& new_pending, const at::Tensor& new_seq_lens) {
  auto slots = ints(row_slots), lens = ints(query_lens), tokens = ints(new_pending), counts = ints(new_seq_lens);
  std::vector<int64_t> active, values, lengths;
  for (size_t b = 0; b < lens.size(); ++b) {
    if (lens[b] > 0) {
      active.push_back(slots[b]);
      values.push_back(tokens[b]);
      lengths.push_back(counts[b]);
    }
  }
  const int64_t num_slots = pending.size(0);
  for (int64_t s : active)
    TORCH_CHECK_VALUE(0 <= s && s < num_slots, "row_slots ", list_text(active), " outside 0..", num_slots - 1);
  std::vector<int64_t> sorted = active;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "active rows share a slot (",
                    list_text(active), "): each slot appears in at most one active row");
  TORCH_CHECK_VALUE(pending.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt && pending.dim() == 1 &&
                        seq_lens.dim() == 1,
                    "write_slot_state: pending must be int64 [slots] and seq_lens int32 [slots]");
  int64_t* p = pending.data_ptr<int64_t>();
  int32_t* n = seq_lens.data_ptr<int32_t>();
  for (size_t i = 0; i < active.size(); ++i) {
    p[active[i] * pending.stride(0)] = values[i];
    n[active[i] * seq_lens.stride(0)] = static_cast<int32_t>(lengths[i]);
  }
}

// Every active row's slot takes that row's token history (counts and prompt ids seen) whole; a Python
// kernel here would take the GIL inside every compiled program call (it runs once per frame).
void write_token_history(at::Tensor token_counts, at::Tensor prompt_seen, const at::Tensor& row_slots,
                         const at::Tensor& query_lens, const at::Tensor& new_counts, const at::Tensor& new_seen) {
  auto slots = ints(row_slots), lens = ints(query_lens);
  std::vector<int64_t> active, rows;
  for (size_t b = 0; b < lens.size(); ++b) {
    if (lens[b] > 0) {
      active.push_back(slots[b]);
      rows.push_back(static_cast<int64_t>(b));
    }
  }
  const int64_t num_slots = token_counts.size(0);
  for (int64_t s : active)
    TORCH_CHECK_VALUE(0 <= s && s < num_slots, "row_slots ", list_text(active), " outside 0..", num_slots - 1);
  for (size_t i = 0; i < active.size(); ++i) {
    token_counts.select(0, active[i]).copy_(new_counts.select(0, rows[i]));
    prompt_seen.select(0, active[i]).copy_(new_seen.select(0, rows[i]));
  }
}

// ---- flare::linear: x [M, K] times weight [N, K] transposed, for decode steps and prompt chunks ----
//
// ATen's single-thread float32 product at M = 4..16 rows ran at about half of the weights' read bandwidth
// (docs/benchmarks.md, "The 0.6B model"): its packing copies the weight panel that a decode step reads only
// once. Here each block of NB weight rows is streamed from memory once and multiplied against every input
// row while it sits in L1, with MB x NB accumulators in registers. That also beat ATen's GEMM on prompt
// chunks, by 1.3-1.6x at 64-256 rows on flare-tiny's and the 0.6B model's shapes (docs/benchmarks.md);
// above kNativeRows rows ATen's blocked GEMM serves the call. Each output is one K-long sum in a fixed
// order (16 lanes, then the lanes added), so a row's result does not depend on the other rows in the batch.
//
// Which is faster for prompt chunks depends on the CPU: on an AVX-512 Xeon ATen's GEMM ran 64-row chunks of
// flare-tiny's layers 1.75x faster than this kernel, where on an EPYC this one won. So the bound is the
// process's own (native_rows, set by flare_linear_native_rows below; helios.ops.linear measures it on the
// catalog's weights at start). It never goes below kDecodeRows: every decode step stays on this kernel, so a
// stream's tokens do not change with the number of streams beside it.
constexpr int64_t kNativeRows = 256;
constexpr int64_t kDecodeRows = 16;
std::atomic<int64_t> native_rows{kNativeRows};

// Two loop orders over a panel of NB weight rows, with the same FMAs in the same order per output (so the
// same bits; only the order in which blocks visit the panel differs):
// - "panel" (linear_panel): each MB-row block runs the whole K loop, the first one pulling the panel from
//   memory and the others reusing it from L1, while the panel after next is prefetched. Best where the
//   weights sit in the last-level cache (flare-tiny on a 480 MiB L3: 2.8 against 3.1 ms for its 16-row step).
// - "chunked" (linear_panel_chunked): K in chunks of kChunkK, every block visiting each chunk in turn, the
//   accumulators kept in memory between chunks, no software prefetch. Memory is then read at a steady rate
//   through the whole panel instead of in bursts, which is what weights streamed from DRAM need: the 0.6B
//   model's seven products per layer ran 1.25-1.3x faster chunked at 1-32 rows (docs/benchmarks.md,
//   "Chunked weight streaming").
// chunk_rows is the largest row count the chunked order serves in this process (helios.ops.linear measures
// it on the catalog's whole weight set at start; 0: never).
constexpr int64_t kChunkK = 128;
constexpr int64_t kMaxChunkRows = 64;  // its accumulators (rows x NB x 16 floats) live on the stack
constexpr int64_t kChunkRowsDefault = 8;  // won or tied on both models' weights here, resident or streamed
std::atomic<int64_t> chunk_rows{kChunkRowsDefault};
// A third order, "row" (panels of one weight row, linear_panel<1>): each weight row is read once, as one
// sequential stream, against every input row; the same FMAs per output again. Interleaving four rows' streams,
// as both orders above do, left a 2-core AVX-512 EPYC's prefetchers reading flare-tiny's short rows (K = 384)
// at about half the speed of one stream. row_rows is the largest row count it serves in this process
// (helios.ops.linear measures it at start; 0: never, the default).
constexpr int64_t kMaxRowRows = 64;
std::atomic<int64_t> row_rows{0};

#if defined(__AVX512F__)
// One loop over K in steps of 16, the last step masked (its missing lanes load as zeros), and every loop
// over the MB x NB block unrolled: with a separate tail step, or a rolled loop reading the accumulators
// after it, GCC kept the accumulators in memory as well and stored all of them on every step (16 stores
// per 16 FMAs at 4 x 4), which the store port could not keep up with.
template <int MB, int NB>
inline void linear_block(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                         const float* bias) {
  __m512 acc[MB][NB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NB];
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_maskz_loadu_ps(lanes, w + n * K + k);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(lanes, x + m * ldx + k);
#pragma GCC unroll 16
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m][n]) + (bias ? bias[n] : 0.0f);
}

// The chunked order's block: MB x NB accumulators read from acc (16 floats each, row-major over m then n),
// advanced over k0..k1 of the same masked 16-lane steps as linear_block, and written back.
template <int MB, int NB>
inline void linear_chunk_block(const float* x, int64_t ldx, const float* w, int64_t K, int64_t k0, int64_t k1,
                               float* acc_mem) {
  __m512 acc[MB][NB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_load_ps(acc_mem + (m * NB + n) * 16);
  for (int64_t k = k0; k < k1; k += 16) {
    const __mmask16 lanes = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NB];
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_maskz_loadu_ps(lanes, w + n * K + k);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(lanes, x + m * ldx + k);
#pragma GCC unroll 16
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) _mm512_store_ps(acc_mem + (m * NB + n) * 16, acc[m][n]);
}

// Rows 0..M-1 (M <= kMaxChunkRows) against weight rows n0..n0+NB-1 in the chunked order.
template <int NB>
inline void linear_panel_chunked(const float* x, int64_t M, int64_t K, const float* w, int64_t n0, float* out,
                                 int64_t N, const float* bias) {
  alignas(64) float acc[kMaxChunkRows * NB * 16];
  std::fill(acc, acc + M * NB * 16, 0.0f);
  const float* wn = w + n0 * K;
  for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
    const int64_t k1 = K < k0 + kChunkK ? K : k0 + kChunkK;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) linear_chunk_block<4, NB>(x + m * K, K, wn, K, k0, k1, acc + m * NB * 16);
    switch (M - m) {
      case 3: linear_chunk_block<3, NB>(x + m * K, K, wn, K, k0, k1, acc + m * NB * 16); break;
      case 2: linear_chunk_block<2, NB>(x + m * K, K, wn, K, k0, k1, acc + m * NB * 16); break;
      case 1: linear_chunk_block<1, NB>(x + m * K, K, wn, K, k0, k1, acc + m * NB * 16); break;
      default: break;
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int n = 0; n < NB; ++n)
      out[m * N + n0 + n] = _mm512_reduce_add_ps(_mm512_load_ps(acc + (m * NB + n) * 16)) + (bias ? bias[n0 + n] : 0.0f);
}
constexpr bool kChunkedOrder = true;
#else
constexpr bool kChunkedOrder = false;  // the scalar fallback has one order
template <int MB, int NB>
inline void linear_block(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                         const float* bias) {
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      float lanes[16] = {0};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += x[m * ldx + k + l] * w[n * K + k + l];
      for (int l = 0; k < K; ++k, ++l) lanes[l] += x[m * ldx + k] * w[n * K + k];
      float sum = 0;
      for (int l = 0; l < 16; ++l) sum += lanes[l];
      out[m * ldo + n] = sum + (bias ? bias[n] : 0.0f);
    }
}
#endif

// Rows m0..M-1 against weight rows n0..n0+NB-1, MB input rows at a time (fewer for the last ones).
template <int NB>
inline void linear_panel(const float* x, int64_t M, int64_t K, const float* w, int64_t n0, float* out, int64_t N,
                         const float* bias) {
  const float* wn = w + n0 * K;
  const float* bn = bias ? bias + n0 : nullptr;
  // Several input-row blocks reuse this panel from L1 while memory sits idle: ask for the next panel's
  // cache lines now, spread over those blocks, so its read overlaps this panel's arithmetic.
  const char* next = reinterpret_cast<const char*>(w + (N < n0 + 2 * NB ? N : n0 + 2 * NB) * K);
  const char* next_end = reinterpret_cast<const char*>(w + (N < n0 + 3 * NB ? N : n0 + 3 * NB) * K);
  const int64_t blocks = (M + 3) / 4;
  const int64_t lines = next_end > next ? (next_end - next + 63) / 64 : 0;
  const int64_t per_block = blocks ? (lines + blocks - 1) / blocks : 0;
  int64_t issued = 0;
  auto prefetch_share = [&]() {
    for (int64_t i = 0; i < per_block && issued < lines; ++i, ++issued)
      __builtin_prefetch(next + issued * 64, 0, 3);
  };
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    prefetch_share();
    linear_block<4, NB>(x + m * K, K, wn, K, out + m * N + n0, N, bn);
  }
  prefetch_share();
  switch (M - m) {
    case 3: linear_block<3, NB>(x + m * K, K, wn, K, out + m * N + n0, N, bn); break;
    case 2: linear_block<2, NB>(x + m * K, K, wn, K, out + m * N + n0, N, bn); break;
    case 1: linear_block<1, NB>(x + m * K, K, wn, K, out + m * N + n0, N, bn); break;
    default: break;
  }
}

// ---- Packed weights: the broadcast order ----
//
// Both orders above keep the weight's own layout, rows of K, and so end every output with a 16-lane sum
// and a horizontal add. pack_linear_weight lays a weight out once, at catalog load, in panels of
// kPackWidth output rows, each panel K steps of kPackWidth floats: the products then read the panel as one
// sequential stream, broadcast one input value per row and step, and keep MR x 2 vectors of 16 outputs in
// registers. Each output is one chain of fused multiply-adds over k = 0..K-1 in order, started from zero
// and then plus the bias: the same whatever M is and whichever block size serves the row, so a row's result
// depends on nothing else in the batch, and the same kernel serves every row count (ATen never sees a
// packed weight). On a 2-core AVX-512 EPYC it ran the 0.6B model's seven products per layer 1.2x (one
// row) to 1.9x (128 rows) faster than the chunked and panel orders (docs/benchmarks.md, "Packed weights").
//
// A packed tensor keeps the [N, K] shape and contiguous strides its program was exported with, so a
// compiled program takes it as the same input; what marks it is its storage's deleter (free_packed), which
// nothing else uses and which lives and dies with the storage. Only weights that no op other than
// flare::linear reads are packed (the catalog records which; helios.catalog.load).
constexpr int64_t kPackWidth = 32;
constexpr int64_t kPackRows = 8;  // MR: 8 x 2 accumulators, 2 weight vectors and a broadcast in 32 registers

void free_packed(void* data) { std::free(data); }

bool is_packed(const at::Tensor& weight) {
  return weight.has_storage() && weight.storage().data_ptr().get_deleter() == &free_packed;
}

// Every weight of the list laid out in one allocation, in list order (a decode step's reading order, so
// the step streams one region): 2 MiB-aligned and advised as huge pages (transparent huge pages are often
// "madvise" only). With separate 4 KiB-page allocations, processes with the same settings ran flare-tiny's
// decode_b1 2.7 or 3.9 ms, by where their pages landed (docs/benchmarks.md, "Packed weights"). Each result
// is a view of the shared storage, freed with the last of them; a weight already packed is returned as is.
std::vector<at::Tensor> pack_linear_weights(at::TensorList weights) {
  for (const at::Tensor& weight : weights)
    TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                      "flare::pack_linear_weight: a 2-D float32 CPU weight expected, got ", weight.sizes(), " ",
                      weight.scalar_type());
#if !defined(__AVX512F__)
  TORCH_CHECK(weights.empty(), "flare::pack_linear_weight: this build has no AVX-512 (the packed products need it)");
#endif
  std::vector<int64_t> offsets(weights.size(), -1);  // in floats; -1: already packed
  int64_t total = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (is_packed(weights[i])) continue;
    offsets[i] = total;
    const int64_t panels = (weights[i].size(0) + kPackWidth - 1) / kPackWidth;
    total += (panels * kPackWidth * weights[i].size(1) + 15) / 16 * 16;  // each starts on a 64-byte line
  }
  std::vector<at::Tensor> out(weights.begin(), weights.end());
  if (total == 0) return out;
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t used = static_cast<size_t>(total) * sizeof(float);
  const size_t align = used >= kHuge ? kHuge : 64;
  const size_t bytes = (used + align - 1) / align * align;
  void* data = std::aligned_alloc(align, bytes);
  TORCH_CHECK(data != nullptr, "flare::pack_linear_weight: cannot allocate ", bytes, " bytes");
  if (align == kHuge) madvise(data, bytes, MADV_HUGEPAGE);  // advice only: no error if refused
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes,
                       c10::DataPtr(data, data, &free_packed, c10::Device(c10::DeviceType::CPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  for (size_t i = 0; i < weights.size(); ++i) {
    if (offsets[i] < 0) continue;
    const at::Tensor w = weights[i].contiguous();
    const int64_t N = w.size(0), K = w.size(1), panels = (N + kPackWidth - 1) / kPackWidth;
    float* packed = static_cast<float*>(data) + offsets[i];
    const float* src = w.data_ptr<float>();
    for (int64_t p = 0; p < panels; ++p) {
      float* panel = packed + p * kPackWidth * K;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < kPackWidth; ++c) {
          const int64_t n = p * kPackWidth + c;
          panel[k * kPackWidth + c] = n < N ? src[n * K + k] : 0.0f;
        }
    }
    out[i] = at::empty({0}, w.options());
    out[i].set_(storage, offsets[i], {N, K}, {K, 1});
  }
  return out;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) { return pack_linear_weights({weight})[0]; }

void free_gathered(void* data) { std::free(data); }

// The weights of the list copied as they are (same layout, same values) into one 2 MiB-aligned allocation
// advised as huge pages, in list order: what pack_linear_weights does for placement, for the weights it
// does not pack (norms, and a tied embedding that the head's product also reads, at 16% of flare-tiny's
// bytes). Each result is a view of the shared storage; non-float32 or non-CPU tensors are returned as is.
std::vector<at::Tensor> gather_weights(at::TensorList weights) {
  std::vector<int64_t> offsets(weights.size(), -1);  // in bytes
  int64_t total = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!weights[i].device().is_cpu() || weights[i].scalar_type() != at::kFloat || is_packed(weights[i])) continue;
    offsets[i] = total;
    total += (weights[i].numel() * static_cast<int64_t>(sizeof(float)) + 63) / 64 * 64;
  }
  std::vector<at::Tensor> out(weights.begin(), weights.end());
  if (total == 0) return out;
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = static_cast<size_t>(total) >= kHuge ? kHuge : 64;
  const size_t bytes = (static_cast<size_t>(total) + align - 1) / align * align;
  void* data = std::aligned_alloc(align, bytes);
  TORCH_CHECK(data != nullptr, "flare::gather_weights: cannot allocate ", bytes, " bytes");
  if (align == kHuge) madvise(data, bytes, MADV_HUGEPAGE);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes,
                       c10::DataPtr(data, data, &free_gathered, c10::Device(c10::DeviceType::CPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  for (size_t i = 0; i < weights.size(); ++i) {
    if (offsets[i] < 0) continue;
    const at::Tensor w = weights[i].contiguous();
    std::memcpy(static_cast<char*>(data) + offsets[i], w.data_ptr<float>(), w.numel() * sizeof(float));
    out[i] = at::empty({0}, w.options());
    out[i].set_(storage, offsets[i] / static_cast<int64_t>(sizeof(float)), w.sizes(), w.strides());
  }
  return out;
}

bool linear_weight_packed(const at::Tensor& weight) { return is_packed(weight); }

#if defined(__AVX512F__)
// A panel is walked in chunks of kPackChunk steps of K (32 KiB of weights, which stay in L1 while every
// MR-row block of the call visits them); between chunks a block's accumulators wait in `spill`, so each
// output is still the one chain over k = 0..K-1 in order (the same bits as a single pass). While the first
// block streams a chunk from memory it asks, two cache lines per step, for the chunk that follows it in
// memory (the panel's next chunk, or the next panel's first, or the next weight's, which the packing put
// next: one region in reading order) into L2, so the read of the next chunk overlaps this one's arithmetic.
// Without that request the hardware prefetcher alone left the 0.6B model's seven products per layer at
// 13.7 / 10.5 / 7.3 GB/s at 1 / 4 / 16 rows on a 2-core AVX-512 Xeon; with it 15.2 / 13.5 / 9.6
// (docs/benchmarks.md, "Packed weights streamed ahead"). A prefetch never faults, so asking past the last
// weight is harmless.
constexpr int64_t kPackChunk = 256;
// The fewest rows at which the packed products ask ahead, in this process (helios.ops.linear measures it on
// the catalog's packed weights at start: where they sit in the last-level cache, as flare-tiny's 28 MB do,
// the requests only add work at one row, 1.47 against 1.56-1.64 ms for its decode_b1). kMaxAheadFrom: never.
constexpr int64_t kMaxAheadFrom = 1 << 20;
std::atomic<int64_t> ahead_from{1};

// MR rows of x against steps k0..k1-1 of one packed panel; accumulators start at zero (first chunk) or
// from spill, and end in spill, or in out plus the bias (last chunk; valid < 32 only in the last panel).
template <int MR>
inline void packed_block(const float* x, int64_t ldx, int64_t k0, int64_t k1, const float* panel, __m512* spill,
                         bool first, bool last, const char* ahead, float* out, int64_t ldo, int64_t valid,
                         const float* bias) {
  __m512 acc[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : spill[2 * i];
    acc[i][1] = first ? _mm512_setzero_ps() : spill[2 * i + 1];
  }
  for (int64_t k = k0; k < k1; ++k) {
    if (ahead) {
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      ahead += kPackWidth * sizeof(float);
    }
    const __m512 w0 = _mm512_load_ps(panel + k * kPackWidth);
    const __m512 w1 = _mm512_load_ps(panel + k * kPackWidth + 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      spill[2 * i] = acc[i][0];
      spill[2 * i + 1] = acc[i][1];
    }
    return;
  }
  const __mmask16 low = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 high = valid >= 32 ? static_cast<__mmask16>(0xFFFF)
                         : valid <= 16 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(low, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(high, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(out + i * ldo, low, _mm512_add_ps(acc[i][0], b0));
    _mm512_mask_storeu_ps(out + i * ldo + 16, high, _mm512_add_ps(acc[i][1], b1));
  }
}

// Rows m..m+count-1 (count <= kPackRows) of one chunk: packed_block at the block's own size.
inline void packed_rows(int64_t count, const float* x, int64_t K, int64_t k0, int64_t k1, const float* panel,
                        __m512* spill, bool first, bool last, const char* ahead, float* out, int64_t N,
                        int64_t valid, const float* bias) {
  switch (count) {
#define FLARE_PACKED_ROWS(R) \
  case R: packed_block<R>(x, K, k0, k1, panel, spill, first, last, ahead, out, N, valid, bias); break;
    FLARE_PACKED_ROWS(8) FLARE_PACKED_ROWS(7) FLARE_PACKED_ROWS(6) FLARE_PACKED_ROWS(5)
    FLARE_PACKED_ROWS(4) FLARE_PACKED_ROWS(3) FLARE_PACKED_ROWS(2) FLARE_PACKED_ROWS(1)
#undef FLARE_PACKED_ROWS
    default: break;
  }
}
#endif

void linear_packed(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out, const float* bias) {
#if defined(__AVX512F__)
  const int64_t panels = (N + kPackWidth - 1) / kPackWidth;
  const bool ask = M >= ahead_from.load(std::memory_order_relaxed);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512> spill(static_cast<size_t>(2 * M));  // each row's two accumulators between chunks
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = w + p * kPackWidth * K;
      const int64_t n0 = p * kPackWidth, valid = std::min(kPackWidth, N - n0);
      const float* b = bias ? bias + n0 : nullptr;
      int64_t k0 = 0;
      do {  // K >= 1 here (linear() gives a K = 0 product to ATen)
        const int64_t k1 = std::min(K, k0 + kPackChunk);
        const char* ahead = reinterpret_cast<const char*>(panel + k1 * kPackWidth);  // what follows in memory
        for (int64_t m = 0; m < M; m += kPackRows)
          packed_rows(std::min(kPackRows, M - m), x + m * K, K, k0, k1, panel, spill.data() + 2 * m, k0 == 0,
                      k1 == K, ask && m == 0 ? ahead : nullptr, out + m * N + n0, N, valid, b);
        k0 = k1;
      } while (k0 < K);
    }
  });
#else
  TORCH_CHECK(false, "flare::linear: a packed weight needs the AVX-512 build");
#endif
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
                    "flare::linear: x [..., ", x.size(-1), "] does not fit weight ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0), M = K ? x.numel() / K : 0;
  const bool native = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                      (!bias || bias->scalar_type() == at::kFloat) &&
                      M <= native_rows.load(std::memory_order_relaxed);
  if (K == 0) return at::linear(x, weight, bias);  // no products: the bias (or zeros), which ATen writes
  if (is_packed(weight)) {
    // ATen cannot read the packed layout: every row count is served here
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && (!bias || bias->scalar_type() == at::kFloat),
                      "flare::linear: a packed float32 weight takes float32 x and bias, got ", x.scalar_type());
    at::Tensor xc = x.contiguous();
    at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    at::Tensor out = at::empty(shape, x.options());
    if (M == 0 || N == 0) return out;
    linear_packed(xc.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, out.data_ptr<float>(),
                  bias ? bc.data_ptr<float>() : nullptr);
    return out;
  }
  if (!native) return at::linear(x, weight, bias);
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bias ? bc.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  constexpr int64_t NB = 4;
  const int64_t panels = N / NB;
  if (M <= row_rows.load(std::memory_order_relaxed)) {
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) linear_panel<1>(xp, M, K, wp, n, op, N, bp);
    });
    return out;
  }
  const bool chunked = kChunkedOrder && M <= chunk_rows.load(std::memory_order_relaxed);
  // Panels of NB weight rows are independent: with several intra-op threads each takes a share.
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (chunked) {
      for (int64_t p = begin; p < end; ++p) linear_panel_chunked<NB>(xp, M, K, wp, p * NB, op, N, bp);
      return;
    }
#endif
    for (int64_t p = begin; p < end; ++p) linear_panel<NB>(xp, M, K, wp, p * NB, op, N, bp);
  });
  for (int64_t n0 = panels * NB; n0 < N; ++n0) linear_panel<1>(xp, M, K, wp, n0, op, N, bp);
  return out;
}

// ---- flare::sample: a token per position, greedy rows by argmax, sampled rows by the exponential race ----
//
// helios/ops/sampling.py is the reference: the same ATen operations in the same order on the sampled rows
// only, so both kernels give the same bits. The graph used to filter (a full-vocabulary sort) and hash
// noise for every row and then throw greedy rows' draws away; here greedy rows cost one argmax.
constexpr int64_t kMask32 = 0xFFFFFFFFLL;
constexpr int64_t kMix0 = 0x7FEB352DLL, kMix1 = 0x2C1B3C6DLL, kMixIds = 0x297A2D39LL;

at::Tensor mix32(at::Tensor h) {
  h = h.bitwise_xor(h.bitwise_right_shift(16));
  h = h.mul(kMix0).bitwise_and(kMask32);
  h = h.bitwise_xor(h.bitwise_right_shift(15));
  h = h.mul(kMix1).bitwise_and(kMask32);
  return h.bitwise_xor(h.bitwise_right_shift(16));
}

at::Tensor exponential_noise(const at::Tensor& seed, const at::Tensor& positions, int64_t vocab) {
  const at::Tensor low = seed.bitwise_and(kMask32), high = seed.bitwise_right_shift(32).bitwise_and(kMask32);
  const at::Tensor key = mix32(low.unsqueeze(1).bitwise_xor(
      mix32(high.unsqueeze(1).bitwise_xor(mix32(positions.to(at::kLong).bitwise_and(kMask32))))));
  const at::Tensor ids = at::arange(vocab, seed.options().dtype(at::kLong)).mul(kMixIds).bitwise_and(kMask32);
  const at::Tensor h = mix32(key.unsqueeze(-1).bitwise_xor(mix32(ids)));
  const at::Tensor uniform = h.bitwise_right_shift(8).to(at::kFloat).add(0.5).mul(1.0 / (1 << 24));
  return uniform.log().neg();
}

at::Tensor filter_top_k_top_p(const at::Tensor& logits, const at::Tensor& top_k, const at::Tensor& top_p,
                              const std::optional<at::Tensor>& min_p) {
  auto [ordered, order] = logits.sort(-1, /*descending=*/true);
  const at::Tensor rank = at::arange(logits.size(-1), logits.options().dtype(at::kLong));
  const at::Tensor k = top_k.to(at::kLong).view({-1, 1, 1});
  at::Tensor keep = k.le(0).bitwise_or(rank.lt(k));
  const at::Tensor probs = ordered.softmax(-1);
  keep = keep.bitwise_and(probs.cumsum(-1).sub(probs).lt(top_p.view({-1, 1, 1})));
  if (min_p) keep = keep.bitwise_and(probs.ge(min_p->view({-1, 1, 1}).mul(probs.narrow(-1, 0, 1))));
  const at::Tensor keep_unsorted = at::zeros_like(keep).scatter(-1, order, keep);
  return logits.masked_fill(keep_unsorted.bitwise_not(), -std::numeric_limits<float>::infinity());
}

at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& positions,
                  const std::optional<at::Tensor>& min_p) {
  TORCH_CHECK_VALUE(logits.dim() == 3 && positions.dim() == 2 && temperature.dim() == 1 &&
                        temperature.size(0) == logits.size(0) && positions.size(0) == logits.size(0) &&
                        positions.size(1) == logits.size(1),
                    "flare::sample: logits [B, W, V] with temperature [B] and positions [B, W]; got ",
                    logits.sizes(), ", ", temperature.sizes(), ", ", positions.sizes());
  at::Tensor tokens = logits.argmax(-1);
  const at::Tensor rows = temperature.gt(0).nonzero().flatten();
  if (rows.numel() == 0) return tokens;
  auto pick = [&](const at::Tensor& t) { return t.index_select(0, rows); };
  const at::Tensor scaled = pick(logits).div(pick(temperature).clamp_min(1e-5).view({-1, 1, 1}));
  const std::optional<at::Tensor> row_min_p = min_p ? std::optional<at::Tensor>(pick(*min_p)) : std::nullopt;
  const at::Tensor probs = filter_top_k_top_p(scaled, pick(top_k), pick(top_p), row_min_p).softmax(-1);
  const at::Tensor drawn = probs.div(exponential_noise(pick(seed), pick(positions), logits.size(-1))).argmax(-1);
  return tokens.index_copy(0, rows, drawn);
}

}  // namespace

// The row bound of flare::linear's native kernel for this process (helios.ops.linear.native_rows, by ctypes:
// a setting, not an op a program calls). rows < 0 only reads it; others are clamped to
// [kDecodeRows, kNativeRows]. Returns the bound before the call.
extern "C" int64_t flare_linear_native_rows(int64_t rows) {
  const int64_t before = native_rows.load();
  if (rows >= 0) native_rows.store(rows < kDecodeRows ? kDecodeRows : rows > kNativeRows ? kNativeRows : rows);
  return before;
}

// The largest row count flare::linear runs in the chunked order in this process (helios.ops.linear, by
// ctypes). rows < 0 only reads it; others are clamped to [0, kMaxChunkRows]. Always 0 where the build has
// no AVX-512 (one order only). Returns the setting before the call.
extern "C" int64_t flare_linear_chunk_rows(int64_t rows) {
  if (!kChunkedOrder) return 0;
  const int64_t before = chunk_rows.load();
  if (rows >= 0) chunk_rows.store(rows > kMaxChunkRows ? kMaxChunkRows : rows);
  return before;
}

// 1 where this build packs weights for flare::linear (AVX-512), else 0 (helios.ops.kernels, by ctypes).
extern "C" int64_t flare_linear_packs() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// The largest row count flare::linear runs in the row order in this process (helios.ops.linear, by ctypes).
// rows < 0 only reads it; others are clamped to [0, kMaxRowRows]. Returns the setting before the call.
extern "C" int64_t flare_linear_row_rows(int64_t rows) {
  const int64_t before = row_rows.load();
  if (rows >= 0) row_rows.store(rows > kMaxRowRows ? kMaxRowRows : rows);
  return before;
}

// The fewest rows at which flare::linear's packed products ask for the next chunk ahead, in this process
// (helios.ops.linear, by ctypes). rows < 0 only reads it; others are clamped to [1, kMaxAheadFrom] (that:
// never). Returns the setting before the call.
extern "C" int64_t flare_linear_ahead_from(int64_t rows) {
  const int64_t before = ahead_from.load();
  if (rows >= 0) ahead_from.store(rows < 1 ? 1 : rows > kMaxAheadFrom ? kMaxAheadFrom : rows);
  return before;
}

TORCH_LIBRARY_IMPL(flare, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("write_slot_state", &write_slot_state);
  m.impl("write_token_history", &write_token_history);
  m.impl("linear", &linear);
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("pack_linear_weights", &pack_linear_weights);
  m.impl("gather_weights", &gather_weights);
  m.impl("linear_weight_packed", &linear_weight_packed);
  m.impl("sample", &sample);
}
