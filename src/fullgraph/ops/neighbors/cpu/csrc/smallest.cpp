// fullgraph_cpu::smallest(values [..., N] float32/float64, take) -> (values, indices [..., take]):
// the ``take`` smallest values of every row and their positions, ascending, ties to the smaller
// position, NaN after +inf (torch.topk(largest=False, sorted=True)'s lists, with its ties fixed).
// torch.topk on CPUs copies and partially sorts every row.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "ranking.h"
#include "rows.h"

namespace {

constexpr int64_t kGrainValues = 1 << 15;  // values a task reads before rows are split across threads
// ... a value kept counting as kKeptWeight read ones (ranked and written: 2-core CPU, 128 rows of
// 70 distances, 64 kept, ~0.7 us a row, one task before; 300 with 4 kept ~0.3 us).
constexpr int64_t kKeptWeight = 8;

int64_t row_grain(int64_t size, int64_t take) {
  return std::max<int64_t>(1, kGrainValues / std::max<int64_t>(size + kKeptWeight * take, 1));
}
// Lists of at least 1 / kCountedShare of a row of at least kCountedMinSize values are bounded by
// counting (``counted_bound``; 2-core CPU, 4,096 rows of 256 distances, 64 kept: 6.6 -> 2.6 ms,
// 32 kept: 1.5 -> 2.0, so not there), and from kCountedSelectMinTake selected by it
// (``counted_select``; 2,048 rows of 512, 264 kept: 10.9 -> 5.6-6.2 ms; 64 of 256: 2.8 -> 4.4).
constexpr int64_t kCountedShare = 5, kCountedMinSize = 64, kCountedSelectMinTake = 112;
// float64 rows have no ranking in vectors: they are placed by counting (``counted_select_pairs``)
// from 1 / kCountedShareDouble of a row (squared distances, 2 threads, ms group minima / counted:
// 4,096 rows of 256, 12 kept 2.1 / 1.6, 24 kept 3.8 / 1.9; 2,048 of 512, 30 kept 2.6 / 1.6;
// 1,024 of 1,024, 24 kept 1.1 / 1.3, so not there), in rows of up to kCountedDoubleMaxSize: the
// expansions of the products (both signs: coarse ranges) in 2,048-wide tiles, 108 kept, went
// 11.7 -> 20.7 ms so.
constexpr int64_t kCountedShareDouble = 24, kCountedDoubleMaxSize = 512;

// Per-thread scratch of select_row: ``count`` elements of U.
template <typename U>
std::vector<U>& scratch(int64_t count) {
  thread_local std::vector<U> elements;
  elements.resize(count);
  return elements;
}

// (value, position) pairs by value, ties to the smaller position: an object, so that the sorts
// inline it (as a function pointer each comparison was a call).
struct Before {
  template <typename T>
  bool operator()(const std::pair<T, int64_t>& a, const std::pair<T, int64_t>& b) const {
    return a.first < b.first || (a.first == b.first && a.second < b.second);
  }
};

template <typename T>
void write(const std::vector<std::pair<T, int64_t>>& found, int64_t take, T* values, int64_t* indices) {
  for (int64_t j = 0; j < take; ++j) {
    values[j] = found[j].first;
    indices[j] = found[j].second;
  }
}

// The entries of ``row`` that the take least of ``count`` distinct words (room for count + 8;
// positions in their low half) name, each at its rank (fullgraph_ranking::rank_words).
inline void write_ranked(uint64_t* words, int64_t count, int64_t take, const float* row, float* values,
                         int64_t* indices) {
  fullgraph_ranking::rank_words(words, count, take, [&](int64_t rank, uint64_t word) {
    indices[rank] = static_cast<int64_t>(word & 0xFFFFFFFFu);
    values[rank] = row[indices[rank]];
    return false;
  });
}

// The first ``take`` of ``found`` (float32 numbers of ``row``, no NaN, positions < 2^32) in
// (value, position) order, written out, by ranking 64-bit words: the value's bits made
// monotonic (-0 as +0, so that equal values tie by position) above the position. A row of a
// few hundred values spends most of its selection ordering its few dozen survivors, and word
// comparisons beat the pairs'.
inline void write_in_order(const std::vector<std::pair<float, int64_t>>& found, int64_t take, const float* row,
                           float* values, int64_t* indices) {
  const int64_t count = static_cast<int64_t>(found.size());
  std::vector<uint64_t>& words = scratch<uint64_t>(count + 8);  // (rank_words pads)
  for (int64_t j = 0; j < count; ++j) {
    words[j] = fullgraph_ranking::word(found[j].first, static_cast<uint32_t>(found[j].second));
  }
  write_ranked(words.data(), count, take, row, values, indices);
}

#ifdef FULLGRAPH_RANKS_IN_VECTORS
using fullgraph_ranking::kRankedMax;
using fullgraph_ranking::rank_words;

// The 64-bit words (fullgraph_ranking::word) of float32 values v [16] at positions p, in two
// vectors of 8.
inline std::pair<__m512i, __m512i> words_of(__m512 v, __m512i p) {
  const __m512i bits = _mm512_castps_si512(_mm512_add_ps(v, _mm512_setzero_ps()));
  const __m512i keys = _mm512_mask_mov_epi32(_mm512_or_si512(bits, _mm512_set1_epi32(INT32_MIN)),
                                             _mm512_movepi32_mask(bits), _mm512_xor_si512(bits, _mm512_set1_epi32(-1)));
  const auto word = [](__m256i key, __m256i position) {
    return _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(key), 32), _mm512_cvtepu32_epi64(position));
  };
  return {word(_mm512_castsi512_si256(keys), _mm512_castsi512_si256(p)),
          word(_mm512_extracti64x4_epi64(keys, 1), _mm512_extracti64x4_epi64(p, 1))};
}

// The take least of ``row``'s entries at or below ``bound`` (no NaN passes), in (value,
// position) order, written out (``write_ranked``); false (nothing written) where fewer than
// take pass.
inline bool rank_survivors(const float* row, int64_t size, int64_t take, float bound, float* values,
                           int64_t* indices) {
  uint64_t* words = scratch<uint64_t>(size + 32).data();  // room for whole vectors past the last
  const __m512 limit = _mm512_set1_ps(bound);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t count = 0;
  for (int64_t i = 0; i < size; i += 16, at = _mm512_add_epi32(at, step)) {
    const __mmask16 inside = size - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (size - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(inside, row + i);
    const __mmask16 pass = _mm512_mask_cmp_ps_mask(inside, v, limit, _CMP_LE_OQ);
    if (pass == 0) continue;
    const auto [low, high] = words_of(v, at);
    // compressed in registers, stored whole (a compressing store to memory is slow on some CPUs)
    _mm512_storeu_si512(words + count, _mm512_maskz_compress_epi64(__mmask8(pass), low));
    count += __builtin_popcount(pass & 0xFFu);
    _mm512_storeu_si512(words + count, _mm512_maskz_compress_epi64(__mmask8(pass >> 8), high));
    count += __builtin_popcount(pass >> 8);
  }
  if (count < take) return false;
  write_ranked(words, count, take, row, values, indices);
  return true;
}
#endif

// The take-th smallest of ``least`` (no NaN), which it reorders.
template <typename T>
T take_th(std::vector<T>& least, int64_t take) {
#ifdef FULLGRAPH_RANKS_IN_VECTORS
  if constexpr (std::is_same_v<T, float>) {
    const int64_t count = static_cast<int64_t>(least.size());
    if (count <= kRankedMax) {  // the minimum whose (value, group) word ranks take - 1
      alignas(64) uint64_t words[kRankedMax + 16];
      const __m512i step = _mm512_set1_epi32(16);
      __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t i = 0; i < count; i += 16, at = _mm512_add_epi32(at, step)) {
        const __mmask16 inside = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
        const auto [low, high] = words_of(_mm512_maskz_loadu_ps(inside, least.data() + i), at);
        _mm512_storeu_si512(words + i, low);
        _mm512_storeu_si512(words + i + 8, high);
      }
      float found = 0.0f;
      rank_words(words, count, take, [&](int rank, uint64_t word) {
        found = least[word & 0xFFFFFFFFu];
        return rank == take - 1;  // the one sought: no more to rank
      });
      return found;
    }
  }
#endif
  std::nth_element(least.begin(), least.begin() + (take - 1), least.end());
  return least[take - 1];
}

// The monotonic key of a number (fullgraph_ranking::word's upper half for float32, its 64-bit
// like for float64) and back; kNoKey, above every number's, stands for NaN.
template <typename T>
using Key = std::conditional_t<std::is_same_v<T, float>, uint32_t, uint64_t>;

template <typename T>
constexpr Key<T> kNoKey = std::numeric_limits<Key<T>>::max();

template <typename T>
Key<T> key_of(T value) {
  Key<T> bits;
  std::memcpy(&bits, &value, sizeof bits);
  constexpr Key<T> top = Key<T>{1} << (8 * sizeof(Key<T>) - 1);
  return (bits & top) ? ~bits : (bits | top);
}

template <typename T>
T value_of_key(Key<T> key) {
  constexpr Key<T> top = Key<T>{1} << (8 * sizeof(Key<T>) - 1);
  const Key<T> bits = (key & top) ? (key & ~top) : ~key;
  T value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// A row's numbers counted in 256 equal ranges of their keys, from the least to the greatest, or,
// where the row holds numbers of both signs, of their values (``linear``): the keys of both signs
// lie far apart (|r|^2 - 2 q.r at small D), so that one or two key ranges held most of the row
// (2-core CPU, 1,000 rows of 1,000, 264 kept: 13 against 4.6 ms for the same row made positive).
// Either way a greater key never falls in a lower range.
template <typename T>
struct KeyRanges {
  Key<T> least = kNoKey<T>, most = 0;
  int shift = 0;
  bool linear = false;
  T low = 0, scale = 0;  // (linear: range = (value - low) scale, below 256)
  int32_t counts[256] = {};

  bool empty() const { return least > most; }
  uint32_t range(Key<T> key) const {
    if (!linear) return static_cast<uint32_t>((key - least) >> shift);
    const T spot = (value_of_key<T>(key) - low) * scale;
    return spot < T(255) ? static_cast<uint32_t>(spot) : 255u;
  }
};

// The keys of ``row`` (-0 as +0, NaN kNoKey) into ``keys`` [size], counted.
template <typename T>
KeyRanges<T> count_keys(const T* row, int64_t size, Key<T>* keys) {
  KeyRanges<T> ranges;
  for (int64_t i = 0; i < size; ++i) {
    const T value = row[i] + T(0);
    keys[i] = value == value ? key_of(value) : kNoKey<T>;
    if (keys[i] != kNoKey<T>) {
      ranges.least = std::min(ranges.least, keys[i]);
      ranges.most = std::max(ranges.most, keys[i]);
    }
  }
  if (ranges.empty()) return ranges;
  const T low = value_of_key<T>(ranges.least), high = value_of_key<T>(ranges.most);
  if (low < 0 && high > 0 && std::isfinite(low) && std::isfinite(high) && std::isfinite(high - low)) {
    ranges.linear = true;
    ranges.low = low;
    ranges.scale = T(256) / (high - low);
  } else {
    while (((ranges.most - ranges.least) >> ranges.shift) >= 256) ++ranges.shift;
  }
  for (int64_t i = 0; i < size; ++i) {
    if (keys[i] != kNoKey<T>) ++ranges.counts[ranges.range(keys[i])];
  }
  return ranges;
}

// An upper bound of the take-th smallest number of ``row`` (NaN left out; +inf where fewer
// than take): the top of the range (``count_keys``) where the count reaches take. Long lists
// of short rows leave about take survivors, where the groups' minima left most of the row (64
// of 256: ~150).
template <typename T>
T counted_bound(const T* row, int64_t size, int64_t take) {
  Key<T>* keys = scratch<Key<T>>(size).data();
  const KeyRanges<T> ranges = count_keys(row, size, keys);
  if (ranges.empty()) return std::numeric_limits<T>::infinity();
  int64_t total = 0;
  for (int range = 0; range < 256; ++range) {
    total += ranges.counts[range];
    if (total >= take) {
      if (ranges.linear) {  // the greatest key of those ranges (a value range's end is not a key's)
        Key<T> top = 0;
        for (int64_t i = 0; i < size; ++i) {
          if (keys[i] != kNoKey<T> && ranges.range(keys[i]) <= static_cast<uint32_t>(range)) {
            top = std::max(top, keys[i]);
          }
        }
        return value_of_key<T>(top);
      }
      const Key<T> span = ((Key<T>(range) + 1) << ranges.shift) - 1;  // to the range's last key
      return value_of_key<T>(ranges.most - ranges.least <= span ? ranges.most : ranges.least + span);
    }
  }
  return std::numeric_limits<T>::infinity();
}

constexpr int32_t kCountedRunMax = 16;  // (see place_counted)

// Where a counting sort of a row's ranges (``count_keys``) up to the take-th number puts them:
// each range's first slot, the numbers up to the last range (total: >= take unless the row
// holds fewer), that range and the most numbers a range holds.
struct CountedPlacement {
  int32_t starts[256];
  int64_t total = 0;
  int last = -1, widest = 0;
};

template <typename T>
CountedPlacement counted_placement(const KeyRanges<T>& ranges, int64_t take) {
  CountedPlacement placement;
  for (int range = 0; range < 256 && placement.total < take && !ranges.empty(); ++range) {
    placement.starts[range] = static_cast<int32_t>(placement.total);
    placement.total += ranges.counts[range];
    placement.widest = std::max(placement.widest, ranges.counts[range]);
    placement.last = range;
  }
  return placement;
}

// The placement of both: a number's item (its key with its position, ordered as (key, position))
// put at its range's next slot, the ranges' few ordered by insertion (by std::sort where a range
// holds more than kCountedRunMax), the first take written out; false where the ranges up to the
// take-th hold fewer than take numbers or more than ``most``.
template <typename T, typename Item, typename Make, typename Position>
bool place_counted(const T* row, int64_t size, int64_t take, int64_t most, Make item_of, Position position_of,
                   T* values, int64_t* indices) {
  Key<T>* keys = scratch<Key<T>>(size).data();
  const KeyRanges<T> ranges = count_keys(row, size, keys);
  CountedPlacement placement = counted_placement(ranges, take);
  const int64_t total = placement.total;
  if (total < take || total > most) return false;
  Item* items = scratch<Item>(total).data();
  for (int64_t i = 0; i < size; ++i) {
    if (keys[i] != kNoKey<T> && ranges.range(keys[i]) <= static_cast<uint32_t>(placement.last)) {
      items[placement.starts[ranges.range(keys[i])]++] = item_of(keys[i], i);
    }
  }
  if (placement.widest > kCountedRunMax) {
    std::sort(items, items + total);
  } else {  // in order but within a range
    for (int64_t j = 1; j < total; ++j) {
      const Item item = items[j];
      int64_t at = j;
      for (; at > 0 && items[at - 1] > item; --at) items[at] = items[at - 1];
      items[at] = item;
    }
  }
  for (int64_t j = 0; j < take; ++j) {
    indices[j] = position_of(items[j]);
    values[j] = row[indices[j]];
  }
  return true;
}

// Long lists of short float32 rows in one go: the numbers of the ranges up to the take-th
// (``count_keys``) placed by range (a counting sort) as 64-bit words (fullgraph_ranking::word),
// the first take written out. False (nothing written) where fewer than take numbers. (Its keys
// and words are scratch of two types: uint32_t and uint64_t.)
inline bool counted_select(const float* row, int64_t size, int64_t take, float* values, int64_t* indices) {
  return place_counted<float, uint64_t>(
      row, size, take, std::numeric_limits<int64_t>::max(),
      [](uint32_t key, int64_t i) { return (static_cast<uint64_t>(key) << 32) | static_cast<uint64_t>(i); },
      [](uint64_t word) { return static_cast<int64_t>(word & 0xFFFFFFFFu); }, values, indices);
}

// counted_select for float64 (whose key and position do not fit one word): (key, position)
// pairs. Rows of squared distances, 2 threads, ms before / after / torch.topk: 4,096 rows of 256,
// 72 kept 6.6 / 3.4 / 9.9; 2,048 of 512, 264 kept 13.0 / 5.8 / 15.4. False also where the ranges
// are too coarse to place the numbers (more than 2 take + 16 up to the take-th), as in a row of
// both signs, whose keys lie far apart: the caller bounds the row instead.
inline bool counted_select_pairs(const double* row, int64_t size, int64_t take, double* values, int64_t* indices) {
  using Item = std::pair<uint64_t, int64_t>;
  return place_counted<double, Item>(
      row, size, take, 2 * take + 16, [](uint64_t key, int64_t i) { return Item{key, i}; },
      [](const Item& item) { return item.second; }, values, indices);
}

// One row: an upper bound of its take-th smallest value first (the take-th smallest of the
// minima of G >= take groups of the row: those are distinct entries), then the entries at or
// below it (about 0.03 N in a random row of 2,048 for take = 28), partially sorted. NaN sits after
// every number: only a row with fewer than ``take`` numbers returns NaN entries, by position.
template <typename T>
void select_row(const T* row, int64_t size, int64_t take, std::vector<std::pair<T, int64_t>>& found, T* values,
                int64_t* indices) {
  using V = at::vec::Vectorized<T>;
  const T infinity = std::numeric_limits<T>::infinity();
  if (take == 1) {  // the least number, the first of equals (-0 ties +0), else the first NaN: one pass
    // (where the bound and ranking below cost ~0.2 us a row: nearest_small, 1 thread, 4 x 64^2 D=2
    // k=1, 50 -> 39 us)
    int64_t at = -1;
    for (int64_t i = 0; i < size; ++i) {
      if (row[i] == row[i] && (at < 0 || row[i] < row[at])) at = i;
    }
    at = at < 0 ? 0 : at;
    values[0] = row[at];
    indices[0] = at;
    return;
  }
  // The minima of G >= take groups, group g = the entries i with i % G == g (G lanes of
  // ``sets`` vectors, read in one pass), and their take-th smallest: a bound of the row's.
  T bound = infinity;
  // Twice take's groups where the row is long enough (a tighter bound: fewer
  // survivors to sort).
  int64_t sets = (2 * take + V::size() - 1) / V::size();
  if (4 * sets * V::size() > size) sets = (take + V::size() - 1) / V::size();
  const int64_t groups = sets * V::size();
  if constexpr (!std::is_same_v<T, float>) {
    const bool counted =
        kCountedShare * take >= size || (kCountedShareDouble * take >= size && size <= kCountedDoubleMaxSize);
    if (counted && size >= kCountedMinSize && counted_select_pairs(row, size, take, values, indices)) {
      return;
    }
  }
  if (kCountedShare * take >= size && size >= kCountedMinSize) {
    if constexpr (std::is_same_v<T, float>) {
      // (survivors past kRankedMax are sorted: placing them by range first is faster)
      if (take > kCountedSelectMinTake && size <= (int64_t{1} << 32) &&
          counted_select(row, size, take, values, indices)) {
        return;
      }
    }
    bound = counted_bound(row, size, take);
  } else if (4 * groups <= size) {  // else every number is a candidate
    std::vector<V>& lanes = scratch<V>(sets);
    for (int64_t set = 0; set < sets; ++set) lanes[set] = V(infinity);
    int64_t i = 0;
    for (; i + groups <= size; i += groups) {
      for (int64_t set = 0; set < sets; ++set) {
        const V values = V::loadu(row + i + set * V::size());
        lanes[set] = V::blendv(lanes[set], values, values < lanes[set]);
      }
    }
    std::vector<T>& least = scratch<T>(groups);
    for (int64_t set = 0; set < sets; ++set) lanes[set].store(least.data() + set * V::size());
    for (; i < size; ++i) least[i % groups] = row[i] < least[i % groups] ? row[i] : least[i % groups];
    bound = take_th(least, take);
    if (!(bound < infinity)) bound = infinity;  // fewer than take finite minima bound nothing
  }
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if constexpr (std::is_same_v<T, float>) {
    if (size <= (int64_t{1} << 31) && rank_survivors(row, size, take, bound, values, indices)) return;
  }
#endif
  found.clear();
  const V limit(bound);
  const int all = (1 << V::size()) - 1;
  int64_t i = 0;
  for (; i + V::size() <= size; i += V::size()) {
    for (int hits = ~(V::loadu(row + i) <= limit).zero_mask() & all; hits != 0; hits &= hits - 1) {
      const int j = __builtin_ctz(static_cast<unsigned>(hits));
      found.emplace_back(row[i + j], i + j);
    }
  }
  for (; i < size; ++i) {
    if (row[i] <= bound) found.emplace_back(row[i], i);
  }
  const int64_t numbers = static_cast<int64_t>(found.size());
  if constexpr (std::is_same_v<T, float>) {
    if (numbers >= take && size <= (int64_t{1} << 32)) {
      return write_in_order(found, take, row, values, indices);
    }
  }
  if (numbers >= take) {
    // (the take least first, then only those sorted, where a heap's partial sort took longer:
    // float64, 4,096 rows of 256, 24 kept, one thread, 8.2 -> 7.6 ms with the comparator inlined)
    if (numbers > take) std::nth_element(found.begin(), found.begin() + (take - 1), found.end(), Before{});
    std::sort(found.begin(), found.begin() + take, Before{});
  } else {
    std::sort(found.begin(), found.end(), Before{});
    for (int64_t k = 0; k < size && static_cast<int64_t>(found.size()) < take; ++k) {
      if (std::isnan(row[k])) found.emplace_back(row[k], k);
    }
  }
  write(found, take, values, indices);
}

void check_values(const at::Tensor& values) {
  TORCH_CHECK(values.device().is_cpu() && (values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble) &&
                  values.dim() >= 1,
              "values: expected a float32 or float64 CPU tensor of at least one dimension, got ", values.scalar_type(),
              " of shape ", values.sizes(), " on ", values.device());
}

// (values [count, take] of values' dtype, positions [count, take] int64), unfilled.
std::pair<at::Tensor, at::Tensor> lists(const at::Tensor& values, int64_t count, int64_t take) {
  return {at::empty({count, take}, values.options()), at::empty({count, take}, values.options().dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor> smallest(const at::Tensor& values, int64_t take) {
  check_values(values);
  const int64_t size = values.size(-1);
  TORCH_CHECK(take >= 0 && take <= size, "take: expected 0 to ", size, " (the rows' length), got ", take);
  const at::Tensor rows = values.contiguous().reshape({-1, size});
  const int64_t count = rows.size(0);
  std::vector<int64_t> shape(values.sizes().begin(), values.sizes().end());
  shape.back() = take;
  auto [out_values, out_indices] = lists(values, count, take);
  if (count > 0 && take > 0) {
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "smallest", [&] {
      const scalar_t* source = rows.data_ptr<scalar_t>();
      scalar_t* target = out_values.data_ptr<scalar_t>();
      int64_t* positions = out_indices.data_ptr<int64_t>();
      const int64_t grain = row_grain(size, take);
      at::parallel_for(0, count, grain, [&](int64_t first, int64_t last) {
        std::vector<std::pair<scalar_t, int64_t>> kept;
        kept.reserve(size);
        for (int64_t r = first; r < last; ++r) {
          select_row(source + r * size, size, take, kept, target + r * take, positions + r * take);
        }
      });
    });
  }
  return {out_values.reshape(shape), out_indices.reshape(shape)};
}

// smallest_of_products(products [B, M, N], bias [B, N], take) -> (values, positions [B, M, take]):
// ``smallest`` of bias[b, j] - 2 products[b, i, j] (each rounded once, as torch rounds them), a
// row biased at a time in a per-thread buffer: the dense backend's products without
// torch.baddbmm's copy of the bias into every row first.
std::tuple<at::Tensor, at::Tensor> smallest_of_products(const at::Tensor& products, const at::Tensor& bias,
                                                        int64_t take) {
  check_values(products);
  TORCH_CHECK(products.dim() == 3, "products: expected [B, M, N], got shape ", products.sizes());
  const int64_t batch = products.size(0), height = products.size(1), size = products.size(2);
  TORCH_CHECK(bias.scalar_type() == products.scalar_type() && bias.device().is_cpu() &&
                  bias.sizes() == at::IntArrayRef({batch, size}),
              "bias: expected [B, N] = [", batch, ", ", size, "] of products' dtype, got ", bias.scalar_type(),
              " of shape ", bias.sizes());
  TORCH_CHECK(take >= 0 && take <= size, "take: expected 0 to ", size, " (the rows' length), got ", take);
  const at::Tensor rows = products.contiguous(), offsets = bias.contiguous();
  auto [out_values, out_indices] = lists(products, batch * height, take);
  if (batch * height > 0 && take > 0) {
    AT_DISPATCH_FLOATING_TYPES(products.scalar_type(), "smallest_of_products", [&] {
      const scalar_t* source = rows.data_ptr<scalar_t>();
      const scalar_t* shift = offsets.data_ptr<scalar_t>();
      scalar_t* target = out_values.data_ptr<scalar_t>();
      int64_t* positions = out_indices.data_ptr<int64_t>();
      const int64_t grain = row_grain(size, take);
      at::parallel_for(0, batch * height, grain, [&](int64_t first, int64_t last) {
        std::vector<std::pair<scalar_t, int64_t>> kept;
        kept.reserve(size);
        std::vector<scalar_t> biased(size);
        for (int64_t r = first; r < last; ++r) {
          const scalar_t* row = source + r * size;
          const scalar_t* offset = shift + (r / height) * size;
          for (int64_t j = 0; j < size; ++j) biased[j] = offset[j] - scalar_t(2) * row[j];
          select_row(biased.data(), size, take, kept, target + r * take, positions + r * take);
        }
      });
    });
  }
  return {out_values.reshape({batch, height, take}), out_indices.reshape({batch, height, take})};
}

// smallest_after(values [..., W], take, kept_values [..., t], kept_positions [..., t], offset):
// the ``take`` smallest (value, position) of each row's kept list (ascending, NaN last, every
// position below ``offset``) and the row's own entries at positions offset + j, as
// ``smallest`` of the two side by side would give them. Where the kept list holds ``take``
// numbers, only entries below its last can enter (an equal one loses the tie): a tile of a
// long row is read once, and after the first few tiles few of its entries pass.
template <typename T>
void merge_row(const T* row, int64_t size, const T* kept_values, const int64_t* kept_positions, int64_t kept,
               int64_t take, int64_t offset, std::vector<std::pair<T, int64_t>>& found, T* values, int64_t* indices) {
  using V = at::vec::Vectorized<T>;
  found.clear();
  for (int64_t j = 0; j < kept; ++j) {
    if (!std::isnan(kept_values[j])) found.emplace_back(kept_values[j], kept_positions[j]);
  }
  const bool full = static_cast<int64_t>(found.size()) >= take;
  const T bound = full ? kept_values[take - 1] : std::numeric_limits<T>::infinity();
  const V limit(bound);
  const int all = (1 << V::size()) - 1;
  int64_t i = 0;
  for (; i + V::size() <= size; i += V::size()) {
    const V entries = V::loadu(row + i);
    const int passing = ~(full ? (entries < limit) : (entries <= limit)).zero_mask() & all;
    for (int hits = passing; hits != 0; hits &= hits - 1) {
      const int j = __builtin_ctz(static_cast<unsigned>(hits));
      found.emplace_back(row[i + j], offset + i + j);
    }
  }
  for (; i < size; ++i) {
    if (full ? row[i] < bound : row[i] <= bound) found.emplace_back(row[i], offset + i);
  }
  if (static_cast<int64_t>(found.size()) >= take) {
    std::partial_sort(found.begin(), found.begin() + take, found.end(), Before{});
  } else {  // fewer numbers than take: NaN entries by position after them, the kept ones first
    std::sort(found.begin(), found.end(), Before{});
    for (int64_t j = 0; j < kept && static_cast<int64_t>(found.size()) < take; ++j) {
      if (std::isnan(kept_values[j])) found.emplace_back(kept_values[j], kept_positions[j]);
    }
    for (int64_t j = 0; j < size && static_cast<int64_t>(found.size()) < take; ++j) {
      if (std::isnan(row[j])) found.emplace_back(row[j], offset + j);
    }
  }
  write(found, take, values, indices);
}

std::tuple<at::Tensor, at::Tensor> smallest_after(const at::Tensor& values, int64_t take, const at::Tensor& kept_values,
                                                  const at::Tensor& kept_positions, int64_t offset) {
  check_values(values);
  const int64_t size = values.size(-1), kept = kept_values.size(-1);
  TORCH_CHECK(kept_values.scalar_type() == values.scalar_type() && kept_positions.scalar_type() == at::kLong &&
                  kept_values.sizes() == kept_positions.sizes() && kept_values.dim() == values.dim() &&
                  kept_values.sizes().slice(0, values.dim() - 1) == values.sizes().slice(0, values.dim() - 1),
              "kept_values, kept_positions: expected [..., t] of values' dtype and int64 with values' leading shape");
  TORCH_CHECK(take >= 0 && take <= size + kept, "take: expected 0 to ", size + kept, ", got ", take);
  const at::Tensor rows = values.contiguous().reshape({-1, size});
  const at::Tensor old_values = kept_values.contiguous().reshape({-1, kept});
  const at::Tensor old_positions = kept_positions.contiguous().reshape({-1, kept});
  const int64_t count = rows.size(0);
  std::vector<int64_t> shape(values.sizes().begin(), values.sizes().end());
  shape.back() = take;
  auto [out_values, out_indices] = lists(values, count, take);
  if (count > 0 && take > 0) {
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "smallest_after", [&] {
      const scalar_t* source = rows.data_ptr<scalar_t>();
      const scalar_t* previous = old_values.data_ptr<scalar_t>();
      const int64_t* previous_at = old_positions.data_ptr<int64_t>();
      scalar_t* target = out_values.data_ptr<scalar_t>();
      int64_t* positions = out_indices.data_ptr<int64_t>();
      const int64_t grain = row_grain(size, take);
      at::parallel_for(0, count, grain, [&](int64_t first, int64_t last) {
        std::vector<std::pair<scalar_t, int64_t>> found;
        found.reserve(kept + 64);
        for (int64_t r = first; r < last; ++r) {
          merge_row(source + r * size, size, previous + r * kept, previous_at + r * kept, kept, take, offset, found,
                    target + r * take, positions + r * take);
        }
      });
    });
  }
  return {out_values.reshape(shape), out_indices.reshape(shape)};
}

// nearest_within(d [B, M, N], query_ok [B, M] bool, ref_ok [B, N] bool, within [B], take)
//   -> (values [B, M, take], positions [B, M, take] int64, counts [B, M] int64):
// of the distances d (>= 0) of every pair of each item, the valid pairs at or within
// ``within`` counted and the ``take`` nearest selected by (distance, position), NaN-valued
// where fewer (positions there unspecified): reference.nearest's masking, count and
// selection in one pass a row (the CPU backend's brute force of small items).
std::tuple<at::Tensor, at::Tensor, at::Tensor> nearest_within(const at::Tensor& d, const at::Tensor& query_ok,
                                                               const at::Tensor& ref_ok, const at::Tensor& within,
                                                               int64_t take) {
  TORCH_CHECK(d.device().is_cpu() && (d.scalar_type() == at::kFloat || d.scalar_type() == at::kDouble) && d.dim() == 3,
              "d: expected a float32 or float64 CPU tensor [B, M, N], got ", d.scalar_type(), " of shape ", d.sizes());
  const int64_t batch = d.size(0), rows = d.size(1), columns = d.size(2);
  TORCH_CHECK(query_ok.scalar_type() == at::kBool && query_ok.sizes() == at::IntArrayRef({batch, rows}),
              "query_ok: expected bool [B, M] = [", batch, ", ", rows, "], got ", query_ok.sizes());
  TORCH_CHECK(ref_ok.scalar_type() == at::kBool && ref_ok.sizes() == at::IntArrayRef({batch, columns}),
              "ref_ok: expected bool [B, N] = [", batch, ", ", columns, "], got ", ref_ok.sizes());
  TORCH_CHECK(within.scalar_type() == d.scalar_type() && within.sizes() == at::IntArrayRef({batch}),
              "within: expected [B] = [", batch, "] of d's dtype, got ", within.sizes());
  TORCH_CHECK(take >= 0 && take <= columns, "take: expected 0 to ", columns, " (the rows' length), got ", take);
  const at::Tensor distances = d.contiguous(), valid_query = query_ok.contiguous(), valid_ref = ref_ok.contiguous(),
                   limits = within.contiguous();
  at::Tensor values = at::empty({batch, rows, take}, d.options());
  at::Tensor positions = at::empty({batch, rows, take}, d.options().dtype(at::kLong));
  at::Tensor counts = at::empty({batch, rows}, d.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(d.scalar_type(), "nearest_within", [&] {
    fullgraph_cpu_rows::nearest_rows(distances.data_ptr<scalar_t>(), valid_query.data_ptr<bool>(),
                                     valid_ref.data_ptr<bool>(), limits.data_ptr<scalar_t>(), batch, rows, columns,
                                     take, values.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(),
                                     counts.data_ptr<int64_t>());
  });
  return {values, positions, counts};
}

}  // namespace

namespace fullgraph_cpu_rows {

template <typename T>
void nearest_rows(const T* d, const bool* query_ok, const bool* ref_ok, const T* within, int64_t batch, int64_t rows,
                  int64_t columns, int64_t take, T* values, int64_t* positions, int64_t* counts) {
  const T nan = std::numeric_limits<T>::quiet_NaN(), infinity = std::numeric_limits<T>::infinity();
  // Items whose references are all valid and whose limit is +inf (kNN) need no masked copy
  // of a valid query's row: it is selected in place (NaN sorts last either way).
  std::vector<char> unmasked(batch);
  for (int64_t item = 0; item < batch; ++item) {
    unmasked[item] = (within == nullptr || within[item] == infinity) &&
                     std::all_of(ref_ok + item * columns, ref_ok + (item + 1) * columns, [](bool ok) { return ok; });
  }
  const int64_t grain = row_grain(columns, take);
  at::parallel_for(0, batch * rows, grain, [&](int64_t first, int64_t last) {
    std::vector<T> row(columns);
    std::vector<std::pair<T, int64_t>> kept;
    kept.reserve(columns);
    for (int64_t r = first; r < last; ++r) {
      const int64_t item = r / rows;
      if (unmasked[item] && query_ok[r]) {
        const T* distances = d + r * columns;
        int64_t numbers = 0;
        for (int64_t j = 0; j < columns; ++j) numbers += distances[j] == distances[j];
        counts[r] = numbers;
        if (take > 0) select_row(distances, columns, take, kept, values + r * take, positions + r * take);
        continue;
      }
      const bool* cloud_ok = ref_ok + item * columns;
      const T limit = within == nullptr ? infinity : within[item];
      int64_t within_count = 0;
      for (int64_t j = 0; j < columns; ++j) {
        const T distance = d[r * columns + j];
        const bool ok = query_ok[r] && cloud_ok[j] && distance <= limit;
        row[j] = ok ? distance : nan;
        within_count += ok;
      }
      counts[r] = within_count;
      if (take > 0) select_row(row.data(), columns, take, kept, values + r * take, positions + r * take);
    }
  });
}

template void nearest_rows<float>(const float*, const bool*, const bool*, const float*, int64_t, int64_t, int64_t,
                                  int64_t, float*, int64_t*, int64_t*);
template void nearest_rows<double>(const double*, const bool*, const bool*, const double*, int64_t, int64_t, int64_t,
                                   int64_t, double*, int64_t*, int64_t*);

std::tuple<at::Tensor, at::Tensor> smallest_of_products(const at::Tensor& products, const at::Tensor& bias,
                                                        int64_t take) {
  return ::smallest_of_products(products, bias, take);
}

}  // namespace fullgraph_cpu_rows

TORCH_LIBRARY(fullgraph_cpu, m) {
  m.def("smallest(Tensor values, int take) -> (Tensor, Tensor)");
  m.def("smallest_of_products(Tensor products, Tensor bias, int take) -> (Tensor, Tensor)");
  m.def("smallest_after(Tensor values, int take, Tensor kept_values, Tensor kept_positions, int offset) -> (Tensor, Tensor)");
  m.def("nearest_within(Tensor d, Tensor query_ok, Tensor ref_ok, Tensor within, int take) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fullgraph_cpu, CPU, m) {
  m.impl("smallest", &smallest);
  m.impl("smallest_of_products", &smallest_of_products);
  m.impl("smallest_after", &smallest_after);
  m.impl("nearest_within", &nearest_within);
}
