// Ordering a few dozen distinct 64-bit words (a float32's bits made monotonic above a position):
// each word's rank counted against all of them in AVX-512 vectors, no branch on the data (a row
// of a few hundred values spent most of its selection sorting its survivors with std::sort).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define FULLGRAPH_RANKS_IN_VECTORS 1
#elif defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fullgraph_ranking {

// Words ranked in vectors at most (count^2 / 8 comparisons); more are sorted.
constexpr int64_t kRankedMax = 128;

// The word of a float32 value (>= -0 as +0) at a position below 2^32: unsigned order is
// (value, position) order, NaN above +inf.
inline uint64_t word(float value, uint32_t position) {
  uint32_t bits;
  value += 0.0f;  // -0 -> +0
  std::memcpy(&bits, &value, sizeof bits);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | position;
}

inline float value_of(uint64_t word) {
  uint32_t bits = static_cast<uint32_t>(word >> 32);
  bits = (bits & 0x80000000u) ? (bits & 0x7FFFFFFFu) : ~bits;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// emit(rank, word) for each of the ``take`` least of ``count`` distinct words (in no order of
// rank) until one returns true: counted in vectors up to kRankedMax where the build has them,
// else sorted (in place). ``words`` has room for count rounded up to 8 (the padding is written).
template <typename Emit>
void rank_words(uint64_t* words, int64_t count, int64_t take, Emit emit) {
#ifdef FULLGRAPH_RANKS_IN_VECTORS
  if (count <= kRankedMax) {  // eight words' ranks at a time, a masked add a word against them
    const int64_t padded = (count + 7) & ~int64_t{7};
    for (int64_t j = count; j < padded; ++j) words[j] = UINT64_MAX;  // above every word
    const __m512i one = _mm512_set1_epi64(1);
    alignas(64) int64_t ranks[8];
    for (int64_t i = 0; i < count; i += 8) {
      const __m512i mine = _mm512_loadu_si512(words + i);
      __m512i rank = _mm512_setzero_si512();
      for (int64_t j = 0; j < count; ++j) {
        const __mmask8 above = _mm512_cmpgt_epu64_mask(mine, _mm512_set1_epi64(static_cast<long long>(words[j])));
        rank = _mm512_mask_add_epi64(rank, above, rank, one);
      }
      _mm512_store_si512(ranks, rank);
      for (int64_t lane = 0; lane < 8 && i + lane < count; ++lane) {
        if (ranks[lane] < take && emit(static_cast<int>(ranks[lane]), words[i + lane])) return;
      }
    }
    return;
  }
#elif defined(__AVX2__)
  if (count <= kRankedMax) {  // four words a vector, compared as signed after flipping the top bit
    const int64_t padded = (count + 3) & ~int64_t{3};
    for (int64_t j = count; j < padded; ++j) words[j] = UINT64_MAX;
    const __m256i flip = _mm256_set1_epi64x(INT64_MIN);
    for (int64_t i = 0; i < count; ++i) {
      const __m256i each = _mm256_xor_si256(_mm256_set1_epi64x(static_cast<long long>(words[i])), flip);
      int rank = 0;
      for (int64_t j = 0; j < padded; j += 4) {
        const __m256i other = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + j)), flip);
        rank += __builtin_popcount(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(each, other))));
      }
      if (rank < take && emit(rank, words[i])) return;
    }
    return;
  }
#endif
  take = std::min(take, count);
  if (4 * count > 5 * take) {  // many more than take: the take least first
    std::nth_element(words, words + (take - 1), words + count);
    std::sort(words, words + take);
  } else {
    std::sort(words, words + count);
  }
  for (int64_t j = 0; j < take; ++j) {
    if (emit(j, words[j])) return;
  }
}

}  // namespace fullgraph_ranking
