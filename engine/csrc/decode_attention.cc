// Decode attention over a KV cache page (float32 or bfloat16) on the CPU, as an XLA FFI custom call
// (engine/cpu_attention.py builds, loads and calls it; `engine.decode_attention: cpu`). Three
// targets: `PipelineDecodeAttention`, the attention over a page, with many queries per KV head,
// causally, for a prefill chunk over its prompts' cache rows once the chunk is written;
// `PipelinePrefillAttention`, the same for a packed prefill call, whose one row of tokens holds
// segments of several prompts (a float32 call's queries and keys rotated here, given the rotary
// tables); and `PipelineDecodeStep`, a decode step's whole attention in one call: the step's key
// and value written into the page (aliased to the call's result: in place), then the attention
// over it, normalized. Each saves XLA kernels a layer that cost a decode step more than their
// work.
//
// For each (row, KV head) of a page, the row's first `lengths[row]` positions only (none where
// its cache row is out of range); with `causal` = c > 0, query g reads `lengths[row] + g / c + 1`
// of them instead (a prefill chunk: its queries are (position, query head of the KV head), c of
// them a position, and lengths[row] is where the chunk starts):
//   scores = scale * q . keys, m = max(scores),
//   e = exp(scores - m), l = sum(e), o = sum(e * values)
// With a sliding window (a decode step's and a prefill call's `window` attribute, 0 for none),
// each query reads only the last `window` of its positions, itself included.
// Returned unnormalized with the softmax residuals (o, l, m), the same contract as the Pallas
// path's `engine.kernels.page_residuals`, so pages and the decode chunk's buffer combine the
// same way; or, with `normalize` (and always in a decode step), o / l. A row with nothing
// written gives o = l = 0 and m = the float32 minimum.
//
// Why a kernel of our own: XLA's CPU runtime runs a decode step's operations one at a time and
// its batched dots over the cache on one thread, reading every position of the pages that hold
// the longest live row. Here the (row, head) pairs are split over XLA's own intra-op thread
// pool, and each row reads only what it wrote. Each pair is computed alone, in one order, so a
// row's result does not depend on the batch, the other rows or the thread that ran it.
//
// Shapes: q [batch, kv_heads, group, head_dim], keys/values [cache_rows, kv_heads, positions,
// head_dim], rows and lengths [batch] int32 (row b reads cache row rows[b]: decode passes
// 0..batch-1, a prefill chunk its prompts' rows, read in place), causal and normalize int64
// attributes; o [batch, kv_heads, group, head_dim], l and m [batch, kv_heads, group], all
// row-major. A decode step: rows are the page's, none passed; new keys and values [batch,
// kv_heads, head_dim], stored as the page is, and write_at [batch]; o alone is returned.
// Everything is float32 but the keys and values, which are float32 or both bfloat16 (a bfloat16
// model's cache: half the bytes to read), given as bfloat16 or as its bits in uint16 (how the
// engine stores it on the CPU). A bfloat16 key is widened to the float32 of the same value,
// exactly, so the results are the bits of the same keys in a float32 cache.

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

// glibc's vector expf (libmvec: 16 floats a call with AVX-512, 8 with AVX2), which the compiler
// calls in the loops below. <cmath> declares it only when __FAST_MATH__ is defined, and
// -fno-finite-math-only (see FLAGS in engine/cpu_attention.py) leaves that undefined; without
// this every exponential was a scalar call: a third to a half of a decode call's time over
// bfloat16 pages.
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));

namespace ffi = xla::ffi;

namespace {

// A bfloat16 is the top half of the float32 of the same value: widening it is exact.
typedef uint16_t BFloat16;
inline float widen(float x) { return x; }
inline float widen(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct Job {
  const float* q;
  void* keys;  // float or BFloat16, as `bfloat16` says; written only by a decode step or a packed prefill
               // call (the page, aliased)
  void* values;
  bool bfloat16;
  const int32_t* rows = nullptr;  // row b reads cache row rows[b]; none: row b
  const int32_t* lengths;
  // A packed prefill call (PrefillAttention): its rows are segments of one row of `stride`
  // positions, segment s the counts[s] positions from offsets[s], written into the `samples`
  // cache rows rows[s * samples + i] and read from the first; q, o and the new keys and values
  // feature first, a row of the call's positions per (KV head, query head, dimension), `group`
  // query heads a KV head. None: rows of their own, `group` queries each, q and o
  // [row][kv_head][query][dimension].
  const int32_t* offsets = nullptr;
  const int32_t* counts = nullptr;
  int64_t stride = 0;
  int64_t samples = 1;
  float* o;
  float* l;
  float* m;
  // A decode step's write, before any read (DecodeStep): row b's new key/value [batch, kv_heads,
  // head_dim], stored as the cache is, go to position write_at[b] of cache row b (none out of
  // range). A packed prefill call's: [kv_heads, head_dim, positions], each segment's into its rows.
  const void* new_keys = nullptr;
  const void* new_values = nullptr;
  const int32_t* write_at = nullptr;
  // A float32 packed prefill call's rotary tables, feature first [head_dim][positions]: its queries
  // and new keys come unrotated and are rotated here (`rotate_row`). None: they come rotated.
  const float* cos = nullptr;
  const float* sin = nullptr;
  bool normalize = false;  // o / l instead of o, as the softmax's result (0 where l is 0)
  int64_t kv_heads, group, positions, head_dim, cache_rows;
  int64_t causal;  // queries per position of a causal prefill chunk; 0: every query reads lengths[row]
  int64_t window = 0;  // a sliding window: each query reads only its last `window` positions; 0: none
  float scale;
  int64_t pairs;  // rows (or segments) x kv_heads
  int64_t parts;  // contiguous runs of pairs, one per thread at most
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

// Positions query g reads: all n, or causally `first + g / causal + 1` of them (at most n); with a
// sliding window, only the last `window` of those, from begin(g) on.
struct Reach {
  int64_t n, first, causal, window = 0;
  int64_t operator()(int64_t g) const { return causal > 0 ? std::min(n, first + g / causal + 1) : n; }
  int64_t begin(int64_t g) const { return window > 0 ? std::max<int64_t>(0, (*this)(g) - window) : 0; }
};

// One KV head of one row: `group` queries over their first reach(g) positions. D fixed at compile
// time (0: d_runtime) lets the compiler keep a query and the weighted sum in vector registers.
template <int64_t D, typename T>
void attend(const float* q, const T* k, const T* v, Reach reach, int64_t group, int64_t d_runtime, float scale,
            float* o, float* l, float* m, float* scores) {
  const int64_t dim = D > 0 ? D : d_runtime;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t n = reach(g), from = reach.begin(g);
    const float* qg = q + g * dim;
    float* s = scores + g * reach.n;
    for (int64_t t = from; t < n; ++t) {
      const T* kt = k + t * dim;
      float dot = 0.0f;
#pragma GCC unroll 16
      for (int64_t d = 0; d < dim; ++d) dot += qg[d] * widen(kt[d]);
      s[t] = dot * scale;
    }
    float top = -FLT_MAX;
    for (int64_t t = from; t < n; ++t) top = s[t] > top ? s[t] : top;
    float sum = 0.0f;
    for (int64_t t = from; t < n; ++t) {
      s[t] = expf(s[t] - top);
      sum += s[t];
    }
    l[g] = sum;
    m[g] = top;
    float* og = o + g * dim;
    if constexpr (D > 0) {
      float acc[D] = {};
      for (int64_t t = from; t < n; ++t) {
        const float e = s[t];
        const T* vt = v + t * D;
#pragma GCC unroll 16
        for (int64_t d = 0; d < D; ++d) acc[d] += e * widen(vt[d]);
      }
      for (int64_t d = 0; d < D; ++d) og[d] = acc[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) og[d] = 0.0f;
      for (int64_t t = from; t < n; ++t)
        for (int64_t d = 0; d < dim; ++d) og[d] += s[t] * widen(v[t * dim + d]);
    }
  }
}

// Many queries of one KV head (a prefill chunk's tokens: MANY or more). Here the work is compute,
// not reading the cache, so it is laid out for the vector units: the queries are transposed, in
// blocks of MANY, and every inner loop runs across a block's MANY, one vector. Scores take KEYS
// keys at a time, each its own chain of fused multiply-adds over head_dim, and the weighted
// values accumulate transposed, VALUE_DIMS dimensions at a time: independent chains, no sum
// across vector lanes.
// Each block of MANY queries reads only the keys its last (furthest-reaching) query reaches:
// causally, the first block of a chunk of 32 positions at its prompt's start needs 16 keys, not
// 32. Each query's result is the same chain of operations whatever the batch or the other rows,
// and a key's score the same whether it was taken among KEYS or alone. Causally, a query's scores
// past its reach are -inf before the softmax: exact zeros in its sum and weighted values, so
// stopping at its block's reach or at the row's gives the same bits.
constexpr int64_t MANY = 16;
constexpr int64_t KEYS = 4;
constexpr int64_t VALUE_DIMS = 8;
typedef float Queries __attribute__((vector_size(MANY * sizeof(float))));  // one value per query

inline Queries load(const float* p) {
  Queries x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void store(float* p, const Queries& x) { std::memcpy(p, &x, sizeof(x)); }

// The blocks of MANY queries of one KV head over its keys (float32: a bfloat16 page's `widened`
// first), the queries transposed and zero-padded (qt [width / MANY][dim][MANY], `blocked_at`): the
// weighted values, transposed and unnormalized (ot, as qt), their sums and the scores' maxima (sum,
// top [width]); s [n][MANY] is scratch. A block's queries, scores and results are each contiguous:
// laid out [dim][width], a long prompt's (width 512: rows 2 KB apart) fell into the same few sets
// of the first-level cache and evicted each other, and a piece of 512 positions took 1.4x as long.
// Never inlined: -ffast-math lets the compiler order a sum's terms differently where it inlines,
// and both callers (attend_many, prefill_pair) must give a query the same bits.
__attribute__((noinline)) void attend_blocks(const float* qt, const float* k, const float* v, Reach reach,
                                             int64_t group, int64_t dim, int64_t width, float scale, float* ot,
                                             float* s, float* top, float* sum) {
  for (int64_t b = 0; b < width; b += MANY) {
    const int64_t keys = reach(std::min(b + MANY, group) - 1);  // reach grows with the query
    const int64_t from = reach.begin(b);  // and so does a window's first key
    const float* qb = qt + b * dim;
    int64_t t = from;
    for (; t + KEYS <= keys; t += KEYS) {
      Queries acc[KEYS] = {};
      for (int64_t d = 0; d < dim; ++d) {
        const Queries qd = load(qb + d * MANY);
        for (int64_t i = 0; i < KEYS; ++i) acc[i] += qd * k[(t + i) * dim + d];
      }
      for (int64_t i = 0; i < KEYS; ++i) store(s + (t + i) * MANY, acc[i] * scale);
    }
    for (; t < keys; ++t) {
      Queries acc = {};
      for (int64_t d = 0; d < dim; ++d) acc += load(qb + d * MANY) * k[t * dim + d];
      store(s + t * MANY, acc * scale);
    }
    for (int64_t g = b; g < std::min(b + MANY, group); ++g) {
      for (t = reach(g); t < keys; ++t) s[t * MANY + g - b] = -INFINITY;
      for (t = from; t < reach.begin(g); ++t) s[t * MANY + g - b] = -INFINITY;
    }
    Queries best = load(s + from * MANY);
    for (t = from + 1; t < keys; ++t) {
      const Queries st = load(s + t * MANY);
      best = st > best ? st : best;
    }
    store(top + b, best);
    // A plain loop: the compiler calls glibc's vector expf. Its end is not a constant, so it is
    // compiled as when this loop ran over every query at once: the same exponentials, bit for bit.
    const int64_t end = std::min(b + MANY, width);
    for (int64_t g = b; g < end; ++g) sum[g] = 0.0f;
    for (t = from; t < keys; ++t)
      for (int64_t g = b; g < end; ++g) {
        s[t * MANY + g - b] = expf(s[t * MANY + g - b] - top[g]);
        sum[g] += s[t * MANY + g - b];
      }
    float* ob = ot + b * dim;
    for (int64_t d0 = 0; d0 < dim; d0 += VALUE_DIMS) {
      const int64_t dims = std::min(VALUE_DIMS, dim - d0);
      Queries acc[VALUE_DIMS] = {};
      for (t = from; t < keys; ++t) {
        const Queries e = load(s + t * MANY);
        const float* vt = v + t * dim + d0;
        for (int64_t i = 0; i < VALUE_DIMS; ++i)
          if (i < dims) acc[i] += e * vt[i];
      }
      for (int64_t i = 0; i < dims; ++i) store(ob + (d0 + i) * MANY, acc[i]);
    }
  }
}

// Where query g's dimension d is in attend_blocks' queries and results: blocks of MANY queries,
// each [dim][MANY].
inline int64_t blocked_at(int64_t g, int64_t d, int64_t dim) { return (g - g % MANY) * dim + d * MANY + g % MANY; }

// attend_blocks' buffers in `work`, for `group` queries over up to n keys; with `widened`, room
// for a bfloat16 page's n keys and values in float32 too (kf, vf).
struct Blocks {
  int64_t width;
  float *qt, *ot, *s, *top, *sum, *kf = nullptr, *vf = nullptr;
  Blocks(std::vector<float>& work, int64_t group, int64_t dim, int64_t n, bool widened = false)
      : width((group + MANY - 1) / MANY * MANY) {
    // Not zero-filled: every entry is written before it is read, but the padding queries'.
    work.resize((2 * dim + 2) * width + n * MANY + (widened ? 2 * n * dim : 0));
    qt = work.data();
    ot = qt + dim * width;
    s = ot + dim * width;
    top = s + n * MANY;
    sum = top + width;
    if (widened) {
      kf = sum + width;
      vf = kf + n * dim;
    }
  }
};

// A pair's first `count` keys (or values) as attend_blocks reads them, in float32: a float32
// page's where they are, a bfloat16 page's widened once into `into` (exact: the same bits as a
// float32 page of the same values). Every block of queries reading a key reads it again: widening
// it at each read cost a bfloat16 prefill call's attention 1.6x a float32 one's.
inline const float* widened(const float* x, int64_t, float*) { return x; }
inline const float* widened(const BFloat16* x, int64_t count, float* into) {
  for (int64_t i = 0; i < count; ++i) into[i] = widen(x[i]);
  return into;
}

template <typename T>
void attend_many(const float* q, const T* k, const T* v, Reach reach, int64_t group, int64_t dim, float scale,
                 float* o, float* l, float* m, std::vector<float>& work) {
  const Blocks w(work, group, dim, reach.n, sizeof(T) < sizeof(float));
  for (int64_t g = 0; g < w.width; ++g)
    for (int64_t d = 0; d < dim; ++d) w.qt[blocked_at(g, d, dim)] = g < group ? q[g * dim + d] : 0.0f;
  attend_blocks(w.qt, widened(k, reach.n * dim, w.kf), widened(v, reach.n * dim, w.vf), reach, group, dim, w.width,
                scale, w.ot, w.s, w.top, w.sum);
  for (int64_t g = 0; g < group; ++g) {
    l[g] = w.sum[g];
    m[g] = w.top[g];
    for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = w.ot[blocked_at(g, d, dim)];
  }
}

// Where a (row, KV head) pair's queries are in q, o, l and m (counted in queries), and how many.
struct Span {
  int64_t first, count;
};

Span span(const Job& job, int64_t pair) {
  return {pair * job.group, job.group};
}

// (o, l, m) of one (row, KV head), whose queries are `queries`.
template <typename T>
void residuals(const Job& job, int64_t pair, Span queries, std::vector<float>& scores) {
  const int64_t G = queries.count, D = job.head_dim, P = job.positions;
  if (G == 0) return;
  const int64_t row = pair / job.kv_heads, head = pair % job.kv_heads;
  const int64_t cache_row = job.rows ? job.rows[row] : row;
  const int64_t first = std::max<int64_t>(0, job.lengths[row]);
  int64_t n = job.causal > 0 ? first + (G - 1) / job.causal + 1 : first;
  n = cache_row < 0 || cache_row >= job.cache_rows ? 0 : std::min(n, P);
  const Reach reach{n, first, job.causal, job.window};
  const float* q = job.q + queries.first * D;
  const int64_t at = n > 0 ? (cache_row * job.kv_heads + head) * P * D : 0;
  const T* k = static_cast<const T*>(job.keys) + at;
  const T* v = static_cast<const T*>(job.values) + at;
  float* o = job.o + queries.first * D;
  float* l = job.l + queries.first;
  float* m = job.m + queries.first;
  if (n == 0) {
    for (int64_t i = 0; i < G * D; ++i) o[i] = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      l[g] = 0.0f;
      m[g] = -FLT_MAX;
    }
    return;
  }
  // A causal call's queries all go this way, however few a segment has: a query's bits are then
  // the same whichever segment or chunk it came in.
  if (G >= MANY || job.causal > 0) return attend_many(q, k, v, reach, G, D, job.scale, o, l, m, scores);
  scores.resize(G * n);
  switch (D) {
    case 64: return attend<64>(q, k, v, reach, G, D, job.scale, o, l, m, scores.data());
    case 128: return attend<128>(q, k, v, reach, G, D, job.scale, o, l, m, scores.data());
    default: return attend<0>(q, k, v, reach, G, D, job.scale, o, l, m, scores.data());
  }
}

// The softmax's result from its residuals, o / l (0 where l is 0), divided as XLA divides: not
// multiplied by 1 / l, which -ffast-math allows and which can differ in the last bit.
#if defined(__clang__)
void normalize(float* o, const float* l, int64_t group, int64_t dim) {
#pragma float_control(precise, on)
#else
__attribute__((optimize("no-reciprocal-math"))) void normalize(float* o, const float* l, int64_t group, int64_t dim) {
#endif
  for (int64_t g = 0; g < group; ++g) {
    const float sum = l[g] > 0.0f ? l[g] : 1.0f;
    for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = o[g * dim + d] / sum;
  }
}

// The same, for attend_blocks' transposed results (ot, blocked as its queries; l [width]) into o's
// rows of `stride` positions, one a dimension (a packed prefill call's columns): the queries of a
// block of MANY divided at once (vdivps: the same bits as one at a time), a partial block's in ot
// first.
#if defined(__clang__)
void normalize_columns(float* o, int64_t stride, float* ot, const float* l, int64_t group, int64_t dim, int64_t width) {
#pragma float_control(precise, on)
#else
__attribute__((optimize("no-reciprocal-math"))) void normalize_columns(float* o, int64_t stride, float* ot,
                                                                        const float* l, int64_t group, int64_t dim,
                                                                        int64_t width) {
#endif
  const Queries one = Queries{} + 1.0f;
  for (int64_t b = 0; b < width; b += MANY) {
    const Queries sum = load(l + b), by = sum > 0.0f ? sum : one;
    const int64_t count = std::min(MANY, group - b);
    for (int64_t d = 0; d < dim; ++d) {
      float* x = ot + b * dim + d * MANY;
      if (count == MANY) {
        store(o + d * stride + b, load(x) / by);
      } else {
        store(x, load(x) / by);
        std::memcpy(o + d * stride + b, x, count * sizeof(float));
      }
    }
  }
}

// A decode step's new key and value of one (row, KV head), into the page before it is read.
template <typename T>
void write_step(const Job& job, int64_t pair) {
  const int64_t row = pair / job.kv_heads, head = pair % job.kv_heads, at = job.write_at[row];
  if (at < 0 || at >= job.positions) return;
  const int64_t to = ((row * job.kv_heads + head) * job.positions + at) * job.head_dim, from = pair * job.head_dim;
  const size_t bytes = job.head_dim * sizeof(T);
  std::memcpy(static_cast<T*>(job.keys) + to, static_cast<const T*>(job.new_keys) + from, bytes);
  std::memcpy(static_cast<T*>(job.values) + to, static_cast<const T*>(job.new_values) + from, bytes);
}

template <typename T>
void attend_pair(const Job& job, int64_t pair, std::vector<float>& scores) {
  if (job.write_at) write_step<T>(job, pair);
  const Span queries = span(job, pair);
  residuals<T>(job, pair, queries, scores);
  if (job.normalize)
    normalize(job.o + queries.first * job.head_dim, job.l + queries.first, queries.count, job.head_dim);
}

// Rotary embedding, rotate-half, of `count` positions of dimension d: x * cos + rotate_half(x) *
// sin, x the rows of a feature-first block (`stride` apart; its partner row d + half, negated, or
// d - half), the tables' positions from `at`, into `to`. Rounded as XLA's CPU code rounds
// `llama.apply_rotary` in float32: the second product rounded, the first fused with the sum (an
// FMA); so the same bits. Done here, the float32 program needs no rotation passes over q and k of
// its own: 1.3-2.3 ms of a 22-27 ms prefill call, where this takes about 0.5.
void rotate_row(const Job& job, int64_t d, float* to, const float* rows, int64_t at, int64_t count) {
  const int64_t half = job.head_dim / 2, stride = job.stride;
  const float* x = rows + d * stride;
  const float* other = rows + (d < half ? d + half : d - half) * stride;
  const float sign = d < half ? -1.0f : 1.0f;
  const float* c = job.cos + d * stride + at;
  const float* s = job.sin + d * stride + at;
  for (int64_t i = 0; i < count; ++i) {
    const float partner = sign * other[i], second = partner * s[i];
    to[i] = std::fma(x[i], c[i], second);
  }
}

// A packed prefill call's new keys and values of one KV head, the count positions from `offset`
// (feature first), into cache row `row` from position `first` on (none out of range); the keys
// from `keys`, rows of the head's dimensions `keys_stride` apart (the call's own, or rotated).
template <typename T>
void write_columns(const Job& job, int64_t row, int64_t head, int64_t first, const T* keys, int64_t keys_stride,
                   int64_t offset, int64_t count) {
  if (row < 0 || row >= job.cache_rows) return;
  const int64_t D = job.head_dim, P = job.positions, stride = job.stride, end = std::min(count, P - first);
  const int64_t at = (row * job.kv_heads + head) * P * D + first * D;
  const T* values = static_cast<const T*>(job.new_values) + head * D * stride + offset;
  for (const auto& [cache, column, apart] :
       {std::tuple{job.keys, keys, keys_stride}, std::tuple{job.values, values, stride}}) {
    T* to = static_cast<T*>(cache) + at;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < end; ++i) to[i * D + d] = column[d * apart + i];
  }
}

// One (segment, KV head) pair of a packed prefill call: the segment's keys and values written
// into its cache rows, then each query head's queries of the segment over the first of those
// rows, causally, in place, normalized. The queries and results are read from and written to
// their columns of q and o (feature first, as the engine's activations: no transpose outside),
// in blocks of MANY positions of one query head, each query the same chain of operations as in
// attend_many's blocks: the same bits as DecodeAttention's causal rows.
template <typename T>
void prefill_pair(const Job& job, int64_t pair, std::vector<float>& work) {
  const int64_t segment = pair / job.kv_heads, head = pair % job.kv_heads;
  const int64_t count = job.counts[segment], D = job.head_dim, stride = job.stride;
  const int32_t* rows = job.rows + segment * job.samples;
  const int64_t cache_row = job.samples > 0 ? rows[0] : -1, first = std::max<int64_t>(0, job.lengths[segment]);
  // The piece's keys as its rows get them: rotated here once (float32 calls with tables), however
  // many samples' rows they go to.
  const T* keys = static_cast<const T*>(job.new_keys) + head * D * stride + job.offsets[segment];
  int64_t keys_stride = stride;
  std::vector<T> rotated;
  if constexpr (std::is_same_v<T, float>) {
    if (job.cos && count > 0) {
      rotated.resize(D * count);
      for (int64_t d = 0; d < D; ++d) rotate_row(job, d, rotated.data() + d * count, keys, job.offsets[segment], count);
      keys = rotated.data();
      keys_stride = count;
    }
  }
  for (int64_t i = 0; i < job.samples; ++i)
    write_columns<T>(job, rows[i], head, first, keys, keys_stride, job.offsets[segment], count);
  const int64_t n = cache_row < 0 || cache_row >= job.cache_rows ? 0 : std::min(first + count, job.positions);
  const Reach reach{n, first, 1, job.window};
  const int64_t at = n > 0 ? (cache_row * job.kv_heads + head) * job.positions * D : 0;
  const T* k = static_cast<const T*>(job.keys) + at;
  const T* v = static_cast<const T*>(job.values) + at;
  if (count == 0) return;
  if (n == 0) {
    for (int64_t j = 0; j < job.group; ++j) {
      float* o = job.o + (head * job.group + j) * D * stride + job.offsets[segment];
      for (int64_t d = 0; d < D; ++d) std::fill(o + d * stride, o + d * stride + count, 0.0f);
    }
    return;
  }
  const Blocks w(work, count, D, n, sizeof(T) < sizeof(float));
  const float* kf = widened(k, n * D, w.kf);
  const float* vf = widened(v, n * D, w.vf);
  for (int64_t j = 0; j < job.group; ++j) {
    const int64_t column = (head * job.group + j) * D * stride + job.offsets[segment];
    for (int64_t b = 0; b < w.width; b += MANY)
      for (int64_t d = 0; d < D; ++d) {
        float* x = w.qt + b * D + d * MANY;
        const int64_t given = std::min(MANY, count - b);  // the block's queries; the rest zero
        if (job.cos)
          rotate_row(job, d, x, job.q + column + b, job.offsets[segment] + b, given);
        else
          std::memcpy(x, job.q + column + d * stride + b, given * sizeof(float));
        std::fill(x + given, x + MANY, 0.0f);
      }
    attend_blocks(w.qt, kf, vf, reach, count, D, w.width, job.scale, w.ot, w.s, w.top, w.sum);
    normalize_columns(job.o + column, stride, w.ot, w.sum, count, D, w.width);
  }
}

// Takes parts until none is left. The calling thread runs this too and then waits only for
// parts other threads have taken, never for a task the pool has not started: a pool whose
// threads are all busy (another program's call, a second lane) cannot stall the call.
void work(Job& job) {
  std::vector<float> scores;
  for (;;) {
    const int64_t part = job.next.fetch_add(1);
    if (part >= job.parts) return;
    const int64_t begin = part * job.pairs / job.parts, end = (part + 1) * job.pairs / job.parts;
    for (int64_t pair = begin; pair < end; ++pair) {
      if (job.counts)
        job.bfloat16 ? prefill_pair<BFloat16>(job, pair, scores) : prefill_pair<float>(job, pair, scores);
      else
        job.bfloat16 ? attend_pair<BFloat16>(job, pair, scores) : attend_pair<float>(job, pair, scores);
    }
    job.finished.fetch_add(1, std::memory_order_release);
  }
}

bool bfloat16_bits(ffi::DataType type) { return type == ffi::DataType::BF16 || type == ffi::DataType::U16; }

// Checks the shapes and dtypes the calls share and fills in the job but for its outputs: q's
// kv_heads, group (query heads a KV head, or queries) and head_dim, as its caller read them from
// q's shape (`expected` says how, for the message). rows: how many rows (or segments) the call
// has, each a length in lengths.
ffi::Error describe(Job& job, ffi::Buffer<ffi::F32> q, int64_t kv_heads, int64_t group, int64_t head_dim,
                    const char* expected, ffi::AnyBuffer keys, ffi::AnyBuffer values, ffi::Buffer<ffi::S32> lengths,
                    float scale, int64_t causal, int64_t normalize, int64_t rows) {
  auto kd = keys.dimensions(), vd = values.dimensions();
  if (q.dimensions().size() != 4 || kd.size() != 4 || vd.size() != 4 || kd[1] != kv_heads || kd[3] != head_dim ||
      vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3] ||
      lengths.element_count() != static_cast<size_t>(rows))
    return ffi::Error::InvalidArgument(expected);
  const ffi::DataType type = keys.element_type();
  if ((type != ffi::DataType::F32 && !bfloat16_bits(type)) || values.element_type() != type)
    return ffi::Error::InvalidArgument(
        "decode attention: keys and values must both be float32, bfloat16, or uint16 (bfloat16's bits)");
  job.q = q.typed_data();
  job.keys = keys.untyped_data();
  job.values = values.untyped_data();
  job.bfloat16 = type != ffi::DataType::F32;
  job.lengths = lengths.typed_data();
  job.kv_heads = kv_heads;
  job.group = group;
  job.head_dim = head_dim;
  job.positions = kd[2];
  job.cache_rows = kd[0];
  job.causal = causal;
  job.normalize = normalize != 0;
  job.scale = scale;
  job.pairs = rows * kv_heads;
  return ffi::Error::Success();
}

// Runs the job's (row, KV head) pairs over the pool and this thread, and returns when all are done.
void run(ffi::ThreadPool& pool, const std::shared_ptr<Job>& job) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A packed prefill call's segments differ in size: each pair a part, taken as threads free up.
  job->parts = job->counts ? job->pairs : std::min(job->pairs, threads);
  for (int64_t i = 1; i < std::min(job->parts, threads); ++i) pool.Schedule([job] { work(*job); });
  work(*job);
  while (job->finished.load(std::memory_order_acquire) < job->parts) std::this_thread::yield();
}

// For the targets that write into the page before reading it (DecodeStep, PrefillAttention): the
// new keys and values, which must be stored as the page is (`mismatch` otherwise), and the page
// the job writes, the call's results, aliased to its arguments.
ffi::Error describe_writes(Job& job, ffi::AnyBuffer keys, ffi::AnyBuffer new_keys, ffi::AnyBuffer new_values,
                           ffi::Result<ffi::AnyBuffer>& keys_out, ffi::Result<ffi::AnyBuffer>& values_out,
                           const char* mismatch) {
  const ffi::DataType type = keys.element_type(), given = new_keys.element_type();
  if (new_values.element_type() != given || (type == ffi::DataType::F32 ? given != type : !bfloat16_bits(given)))
    return ffi::Error::InvalidArgument(mismatch);
  job.keys = keys_out->untyped_data();  // the same buffer as keys, unless XLA copied it first
  job.values = values_out->untyped_data();
  job.new_keys = new_keys.untyped_data();
  job.new_values = new_values.untyped_data();
  return ffi::Error::Success();
}

// describe() for the calls whose q is [batch, kv_heads, group, head_dim]: a row a batch entry.
ffi::Error describe_rows(Job& job, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                         ffi::Buffer<ffi::S32> lengths, float scale, int64_t causal, int64_t normalize) {
  static constexpr char expected[] =
      "decode attention: expected q [batch, kv_heads, group, head_dim], keys and values [cache_rows, kv_heads, "
      "positions, head_dim], lengths [batch]";
  auto qd = q.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument(expected);
  return describe(job, q, qd[1], qd[2], qd[3], expected, keys, values, lengths, scale, causal, normalize, qd[0]);
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                           ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> lengths, float scale, int64_t causal,
                           int64_t normalize, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> l,
                           ffi::ResultBuffer<ffi::F32> m) {
  auto job = std::make_shared<Job>();
  if (auto error = describe_rows(*job, q, keys, values, lengths, scale, causal, normalize); error.failure()) return error;
  if (rows.element_count() != static_cast<size_t>(q.dimensions()[0]))
    return ffi::Error::InvalidArgument("decode attention: expected rows [batch]");
  job->rows = rows.typed_data();
  job->o = o->typed_data();
  job->l = l->typed_data();
  job->m = m->typed_data();
  run(pool, job);
  return ffi::Error::Success();
}

// A decode step over a page whose rows are the batch's: each row's new key and value written at
// write_at[row] (none out of range), then its attention over its first lengths[row] positions,
// normalized. The page's keys and values are returned, aliased to the arguments: written in place.
ffi::Error DecodeStep(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                      ffi::AnyBuffer new_keys, ffi::AnyBuffer new_values, ffi::Buffer<ffi::S32> write_at,
                      ffi::Buffer<ffi::S32> lengths, float scale, int64_t window, ffi::ResultBuffer<ffi::F32> o,
                      ffi::Result<ffi::AnyBuffer> keys_out, ffi::Result<ffi::AnyBuffer> values_out) {
  auto job = std::make_shared<Job>();
  if (auto error = describe_rows(*job, q, keys, values, lengths, scale, 0, 1); error.failure()) return error;
  job->window = window;
  auto qd = q.dimensions(), nd = new_keys.dimensions();
  auto vd = new_values.dimensions();
  if (keys.dimensions()[0] != qd[0] || nd.size() != 3 || nd[0] != qd[0] || nd[1] != qd[1] || nd[2] != qd[3] ||
      !std::equal(nd.begin(), nd.end(), vd.begin(), vd.end()) || write_at.element_count() != static_cast<size_t>(qd[0]))
    return ffi::Error::InvalidArgument(
        "decode step: expected keys and values [batch, kv_heads, positions, head_dim], new keys and values [batch, "
        "kv_heads, head_dim], write_at [batch]");
  if (auto error = describe_writes(*job, keys, new_keys, new_values, keys_out, values_out,
                                   "decode step: the new keys and values must be stored as the page is");
      error.failure())
    return error;
  job->write_at = write_at.typed_data();
  job->o = o->typed_data();
  std::vector<float> sums_and_maxima(2 * job->pairs * job->group);  // l and m: used here, not returned
  job->l = sums_and_maxima.data();
  job->m = sums_and_maxima.data() + job->pairs * job->group;
  run(pool, job);
  return ffi::Error::Success();
}

// A packed prefill call's keys and values written and its attention, normalized: q [kv_heads,
// group, head_dim, positions] (group query heads a KV head; feature first, as the engine's
// activations) is one row of tokens holding segments of several prompts, segment s the counts[s]
// positions from offsets[s]. Their new keys and values [kv_heads, head_dim, positions], stored as
// the page is, go to each of the cache rows rows[s, :] (a prompt's samples) from position starts[s]
// on (none out of range, nor past the page); then each query reads the first of those rows
// causally, as DecodeAttention's causal rows do, and gets the same bits. A segment whose first
// row is out of range, and a position in no segment, give zeros. o is q's shape; the page's keys
// and values are returned, aliased to the arguments: written in place. The segments' rows must
// differ (the engine's are distinct prompts'): each (segment, KV head) writes and then reads its
// own, beside the others in other threads.
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                            ffi::AnyBuffer new_keys, ffi::AnyBuffer new_values, ffi::Buffer<ffi::S32> rows,
                            ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> counts,
                            ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, float scale, int64_t window,
                            ffi::ResultBuffer<ffi::F32> o, ffi::Result<ffi::AnyBuffer> keys_out,
                            ffi::Result<ffi::AnyBuffer> values_out) {
  static constexpr char expected[] =
      "prefill attention: expected q [kv_heads, query heads a KV head, head_dim, positions], keys and values "
      "[cache_rows, kv_heads, cache positions, head_dim], new keys and values [kv_heads, head_dim, positions], rows "
      "[segments, samples], starts, offsets and counts [segments]";
  auto qd = q.dimensions(), rd = rows.dimensions(), nd = new_keys.dimensions(), vd = new_values.dimensions();
  const size_t segments = starts.element_count();
  if (qd.size() != 4 || rd.size() != 2 || static_cast<size_t>(rd[0]) != segments || nd.size() != 3 ||
      nd[0] != qd[0] || nd[1] != qd[2] || nd[2] != qd[3] || !std::equal(nd.begin(), nd.end(), vd.begin(), vd.end()) ||
      offsets.element_count() != segments || counts.element_count() != segments)
    return ffi::Error::InvalidArgument(expected);
  auto job = std::make_shared<Job>();
  if (auto error = describe(*job, q, qd[0], qd[1], qd[2], expected, keys, values, starts, scale, 0, 1, segments);
      error.failure())
    return error;
  job->window = window;
  if (auto error = describe_writes(*job, keys, new_keys, new_values, keys_out, values_out,
                                   "prefill attention: the new keys and values must be stored as the page is");
      error.failure())
    return error;
  const int64_t positions = qd[3];
  std::vector<bool> covered(positions, false);
  for (size_t s = 0; s < segments; ++s) {
    const int64_t offset = offsets.typed_data()[s], count = counts.typed_data()[s];
    if (offset < 0 || count < 0 || offset + count > positions)
      return ffi::Error::InvalidArgument("prefill attention: a segment reaches past the call's positions");
    std::fill(covered.begin() + offset, covered.begin() + offset + count, true);
  }
  if (cos.element_count() > 0 || sin.element_count() > 0) {
    const size_t table = static_cast<size_t>(qd[2] * qd[3]);
    if (job->bfloat16 || qd[2] % 2 != 0 || cos.element_count() != table || sin.element_count() != table)
      return ffi::Error::InvalidArgument(
          "prefill attention: rotary tables are cos and sin [head_dim, positions], for a float32 page and an even "
          "head_dim");
    job->cos = cos.typed_data();
    job->sin = sin.typed_data();
  }
  job->rows = rows.typed_data();
  job->samples = rd[1];
  job->offsets = offsets.typed_data();
  job->counts = counts.typed_data();
  job->stride = positions;
  job->o = o->typed_data();
  for (int64_t t = 0, end; t < positions; t = end) {  // the positions in no segment: zero
    for (end = t + 1; end < positions && covered[end] == covered[t];) ++end;
    if (covered[t]) continue;
    for (int64_t line = 0; line < job->kv_heads * job->group * job->head_dim; ++line)
      std::fill(job->o + line * positions + t, job->o + line * positions + end, 0.0f);
  }
  run(pool, job);
  return ffi::Error::Success();
}

// The arguments every target starts with: XLA's thread pool, q, and the page's keys and values.
auto bind_page() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // q
      .Arg<ffi::AnyBuffer>()         // keys: float32, bfloat16 or its bits
      .Arg<ffi::AnyBuffer>();        // values: the same
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PipelineDecodeAttention, DecodeAttention,
                              bind_page()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("normalize")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Ret<ffi::Buffer<ffi::F32>>());  // m

XLA_FFI_DEFINE_HANDLER_SYMBOL(PipelineDecodeStep, DecodeStep,
                              bind_page()
                                  .Arg<ffi::AnyBuffer>()  // new keys, stored as the page is
                                  .Arg<ffi::AnyBuffer>()  // new values
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_at
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")  // 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o, normalized
                                  .Ret<ffi::AnyBuffer>()  // keys, aliased to the argument
                                  .Ret<ffi::AnyBuffer>());  // values

XLA_FFI_DEFINE_HANDLER_SYMBOL(PipelinePrefillAttention, PrefillAttention,
                              bind_page()
                                  .Arg<ffi::AnyBuffer>()  // new keys, stored as the page is
                                  .Arg<ffi::AnyBuffer>()  // new values
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [segments, samples]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offsets
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [head_dim, positions], or empty: no rotation
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")  // 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o, normalized
                                  .Ret<ffi::AnyBuffer>()  // keys, aliased to the argument
                                  .Ret<ffi::AnyBuffer>());  // values
