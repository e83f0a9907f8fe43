// Small-row fp32 products for decoding on a CPU, as an XLA FFI handler.
//
// Why: XLA:CPU hands a product over more than one row (verifying K+1 tokens, a tree step over
// a few branches) to Eigen's GEMM, which is built for many rows: one [5,1536] x [1536,8960]
// product took 2.2x one row's on one vCPU, though both need only stream the weights once
// (memory-bound). This loop streams the weights once per group of rows from a layout packed
// at load time, keeping the partial sums in vector registers.
//
// Every output element sums its K products in the same order whatever the row count, so a
// row's result does not depend on the rows beside it (one token scored alone or among five
// gives the same bits).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <cstring>
#include <sched.h>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kAcc = 24;  // vector registers for partial sums (of 32; the rest hold weights)
constexpr int kAhead = 0;  // no software prefetch: not measured on an AVX-512 machine yet
#else
constexpr int kLanes = 8;
constexpr int kAcc = 12;  // of 16 (AVX2)
// Packed rows (k steps) the bf16 form prefetches ahead. On an AVX2-only EPYC (Zen 1, one
// vCPU) its unpacking delays the loads behind it: prefetching 8 rows (2 KB) ahead cut a 1-row
// [896] x [896, 9728] product from 1.63 to 1.29 ms and a 6-row one from 4.88 to 4.52, the bf16
// 0.5B draft's forward from 79 to 72 ms for 1 row. The fp32 form streams at the memory's
// pace already: the same prefetch made the fp32 1.5B target's 1-token forward 15% slower.
constexpr int kAhead = 8;
#endif
constexpr int kBlock = 64;  // columns per packed block (the packed layout's width)

// Asks for the cache lines of the packed row kAhead rows past p (a prefetch never faults, so
// running past the block's end is harmless).
template <typename W>
inline void prefetch_ahead(const W* p) {
  if constexpr (kAhead > 0)
    for (int c = 0; c < kBlock; c += 64 / static_cast<int>(sizeof(W)))
      __builtin_prefetch(p + kAhead * kBlock + c);
}
typedef float vec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint32_t uvec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }
inline vec as_float(uvec u) { return reinterpret_cast<const vec&>(u); }
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// y[m, 0:V*kLanes] for m < rows <= R, from a packed block p (K rows of kBlock floats, this
// sub-block's columns starting at p). The R x V partial sums stay in registers.
template <int R, int V>
inline void packed_rows(const float* x, const float* p, float* y, int rows, int64_t K,
                        int64_t N) {
  vec acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k, p += kBlock) {
    vec w[V];
    for (int v = 0; v < V; ++v) w[v] = load(p + v * kLanes);
    for (int m = 0; m < rows; ++m) {
      const vec xv = vec{} + x[m * K + k];
      for (int v = 0; v < V; ++v) acc[m][v] += xv * w[v];
    }
  }
  for (int m = 0; m < rows; ++m)
    for (int v = 0; v < V; ++v) store(y + m * N + v * kLanes, acc[m][v]);
}

// The bf16 form: x and the weight in bf16, both as pairs (rows k, k+1) in one 32-bit word, low
// half first; a packed block is K/2 words by kBlock columns. Each output adds its pairs' two
// products, odd then even (each exact in fp32), to an fp32 sum: what AVX512-BF16's dpbf16
// does in one instruction, twice the products per instruction of an fp32 FMA (the rows of a
// tree step or a verification make these products compute-bound, not memory-bound).
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

template <int R, int V>
inline void packed_rows(const uint32_t* x, const uint32_t* p, float* y, int rows, int64_t K2,
                        int64_t N) {
  __m512 acc[R][V];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k, p += kBlock) {
    __m512bh w[V];
    for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(p + v * kLanes);
    for (int m = 0; m < rows; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K2 + k]));
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
    }
  }
  for (int m = 0; m < rows; ++m)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + m * N + v * kLanes, acc[m][v]);
}
#else
template <int R, int V>
inline void packed_rows(const uint32_t* x, const uint32_t* p, float* y, int rows, int64_t K2,
                        int64_t N) {
  vec acc[R][V] = {};
  const uvec high = uvec{} + 0xFFFF0000u;
  for (int64_t k = 0; k < K2; ++k, p += kBlock) {
    prefetch_ahead(p);
    vec even[V], odd[V];
    for (int v = 0; v < V; ++v) {
      const uvec u = *reinterpret_cast<const uvec*>(p + v * kLanes);
      even[v] = as_float(u << 16);
      odd[v] = as_float(u & high);
    }
    for (int m = 0; m < rows; ++m) {
      const vec xe = vec{} + bits_float(x[m * K2 + k] << 16);
      const vec xo = vec{} + bits_float(x[m * K2 + k] & 0xFFFF0000u);
      for (int v = 0; v < V; ++v) {
        acc[m][v] += xo * odd[v];
        acc[m][v] += xe * even[v];
      }
    }
  }
  for (int m = 0; m < rows; ++m)
    for (int v = 0; v < V; ++v) store(y + m * N + v * kLanes, acc[m][v]);
}
#endif

// Several rows through the AVX2 fp32 form, which takes one row a pass over a block. Passes
// over a whole block put the later rows' arithmetic after the streaming, not beside it (the
// block, up to 8960 x 64 floats, comes from memory once, then from cache for the other
// rows). So up to kChunkRows rows take turns over chunks of kChunk packed rows (4 KB, kept in
// L1), each pass carrying its partial sums through y and prefetching its share of the next
// chunk: the loads go on while the other rows compute. Each sum still adds its K products in
// order from zero, so the bits are the whole-block pass's. On the AVX2-only EPYC (Zen 1, one
// vCPU; jitted products, median of 15, whole blocks -> chunks): [5,1536] x [1536,8960]
// 8.9-10.0 -> 6.0-6.5 ms, [4,...] 7.2-8.8 -> 5.1; the 1.5B target's forward over 4 tokens
// 757-796 -> 614-688 ms, over 5 849-910 -> 678-716, over 1 the same (~420; the two builds in
// one process, alternated). From 16 rows on, the partial sums' traffic made chunks slower.
constexpr int kChunk = 16;
constexpr int kChunkRows = 8;

// Row pass `pass` of `passes` over packed rows [k0, k0 + n) of one block (p at the block's
// start, x at the row's x, y at its output). The passes share the next chunk's prefetches
// (the packed layout runs on into it; past the end a prefetch never faults) a cache line at a
// time (line c of packed row j where 4j + c = pass mod passes) when there are at most 4, else
// a packed row at a time (j = pass mod passes): each the faster there in a throwaway C++ timing.
inline void chunk_pass(const float* x, const float* p, float* y, int64_t k0, int64_t n,
                       int pass, int passes) {
  constexpr int V = kBlock / kLanes;
  constexpr int kLines = kBlock * 4 / 64;  // cache lines per packed row
  // (unrolled by hand: as loops, GCC made the partial sums' load and store memset/memcpy
  // calls through a stack copy; with them a jitted [5,1536] x [1536,8960] took 7.4-7.6 ms)
  vec acc[V];
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) acc[v] = load(y + v * kLanes);
  const float* q = p + k0 * kBlock;
  const float* next = q + n * kBlock;
  const int step = kLines % passes;
  for (int64_t j = 0, r = pass; j < n; ++j, q += kBlock) {
    const float* ahead = next + j * kBlock;
    if (passes <= kLines) {
      // r = the first line of this row that is this pass's (redundant line 0 when none)
      __builtin_prefetch(ahead + (r < kLines ? r : 0) * 16);
      if (r + passes < kLines) __builtin_prefetch(ahead + (r + passes) * 16);
      r = r >= step ? r - step : r - step + passes;
    } else if (r == 0) {
      for (int c = 0; c < kBlock; c += 16) __builtin_prefetch(ahead + c);
    }
    if (passes > kLines) r = r == 0 ? passes - 1 : r - 1;
    const vec xv = vec{} + x[k0 + j];
    for (int v = 0; v < V; ++v) acc[v] += xv * load(q + v * kLanes);
  }
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) store(y + v * kLanes, acc[v]);
}

// Column blocks [b0, b1) of y.
template <int R, int V, typename X, typename W>
void packed_matmul(const X* x, const W* w, float* y, int64_t M, int64_t K,
                   int64_t blocks, int64_t b0, int64_t b1) {
  constexpr int kSub = V * kLanes;
  const int64_t N = blocks * kBlock;
  if constexpr (R == 1 && std::is_same_v<W, float>) {
    if (M > 1 && M <= kChunkRows) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t m = 0; m < M; ++m)  // the sums start from +0, as in packed_rows
          std::memset(y + m * N + b * kBlock, 0, kBlock * sizeof(float));
        for (int64_t k0 = 0; k0 < K; k0 += kChunk)
          for (int64_t m = 0; m < M; ++m)
            chunk_pass(x + m * K, w + b * K * kBlock, y + m * N + b * kBlock, k0,
                       std::min<int64_t>(kChunk, K - k0), static_cast<int>(m),
                       static_cast<int>(M));
      }
      return;
    }
  }
  for (int64_t b = b0; b < b1; ++b)
    for (int s = 0; s < kBlock; s += kSub)
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const int rows = static_cast<int>(M - m0 < R ? M - m0 : R);
        packed_rows<R, V>(x + m0 * K, w + b * K * kBlock + s, y + m0 * N + b * kBlock + s,
                          rows, K, N);
      }
}

// Runs part(0..parts-1) on the calling thread and XLA's intra-op threads. Parts are claimed
// from a counter, and the caller waits only for parts already running elsewhere: a helper
// that starts late (its thread busy with another op, maybe one waiting the same way) finds
// nothing left and returns, so no op ever waits on a task that has not started.
struct Job {
  std::function<void(int64_t)> part;
  int64_t parts;
  std::atomic<int64_t> next{0}, done{0};
};

void work(const std::shared_ptr<Job>& job) {
  for (int64_t p; (p = job->next.fetch_add(1)) < job->parts;) {
    job->part(p);
    job->done.fetch_add(1, std::memory_order_release);
  }
}

// The cores this thread may run on. XLA sizes its pool by the machine, not by the process's
// affinity: a worker pinned to one core would split each product between two threads on that
// core, one spinning while the other works.
int64_t usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1 << 20;  // unknown: no cap
  return CPU_COUNT(&set);
}

void run_parts(ffi::ThreadPool& pool, int64_t parts, std::function<void(int64_t)> part) {
  const int64_t helpers = std::min<int64_t>({pool.num_threads(), usable_cores() - 1, parts - 1});
  if (helpers <= 0) {
    for (int64_t p = 0; p < parts; ++p) part(p);
    return;
  }
  auto job = std::make_shared<Job>();
  job->part = std::move(part);
  job->parts = parts;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job] { work(job); });
  work(job);
  while (job->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

// x [M, K] times a weight packed as [N / kBlock, K, kBlock] (pack in cpu.py): y [M, N]. fp32
// x and weights, or bf16 pairs of both (K counts pairs there).
template <typename X, typename W>
ffi::Error PackedMatmul(ffi::ThreadPool& pool, const X* xp, const W* wp, float* yp,
                        ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd) {
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kBlock || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("packed_matmul: x must be [M, K], w [N/64, K, 64]");
  const int64_t M = xd[0], K = xd[1], blocks = wd[0];
  // Rows past the first group take more passes over the weights (a block's K x 64 floats
  // come from cache after the first): narrower sub-blocks over more rows per pass measured
  // slower ([8,1536] x [1536,8960]: 4.2 ms against 2.8). So the AVX2 form, 8 vectors across a
  // block, takes one row a pass; built so on an AVX-512 machine, a half or a quarter block
  // over 3 or 6 rows was slower still at 1 and 5 rows (results/cpu_kernel/avx2_subblocks.txt).
  constexpr int kV = kBlock / kLanes;  // vectors across a whole block
  // Column blocks split over the threads XLA gives this process (one when pinned to a core).
  const int64_t parts = std::min<int64_t>(blocks, 4 * std::max<int64_t>(pool.num_threads(), 1));
  run_parts(pool, parts, [=](int64_t p) {
    packed_matmul<kAcc / kV, kV, X, W>(xp, wp, yp, M, K, blocks, blocks * p / parts,
                                    blocks * (p + 1) / parts);
  });
  return ffi::Error::Success();
}

ffi::Error PackedMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  return PackedMatmul(pool, x.typed_data(), w.typed_data(), y->typed_data(), x.dimensions(),
                      w.dimensions());
}

ffi::Error PackedMatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> x,
                            ffi::Buffer<ffi::U32> w, ffi::ResultBuffer<ffi::F32> y) {
  return PackedMatmul(pool, x.typed_data(), w.typed_data(), y->typed_data(), x.dimensions(),
                      w.dimensions());
}

}  // namespace

// The floats per vector this build was compiled for (16: AVX-512, 8: AVX2), for the tests.
extern "C" int SsdKernelLanes() { return kLanes; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdPackedMatmul, PackedMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdPackedMatmulBf16, PackedMatmulBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
