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
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kAcc = 24;  // vector registers for partial sums (of 32; the rest hold weights)
#else
constexpr int kLanes = 8;
constexpr int kAcc = 12;  // of 16 (AVX2)
#endif
constexpr int kBlock = 64;  // columns per packed block (the packed layout's width)
typedef float vec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }

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

// Column blocks [b0, b1) of y.
template <int R, int V>
void packed_matmul(const float* x, const float* w, float* y, int64_t M, int64_t K,
                   int64_t blocks, int64_t b0, int64_t b1) {
  constexpr int kSub = V * kLanes;
  const int64_t N = blocks * kBlock;
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

void run_parts(ffi::ThreadPool& pool, int64_t parts, std::function<void(int64_t)> part) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), parts - 1);
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

// x [M, K] times a weight packed as [N / kBlock, K, kBlock] (pack in cpu.py): y [M, N].
ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kBlock || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("packed_matmul: x must be [M, K], w [N/64, K, 64]");
  const int64_t M = xd[0], K = xd[1], blocks = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Rows past the first group take more passes over the weights (a block's K x 64 floats
  // come from cache after the first): narrower sub-blocks over more rows per pass measured
  // slower ([8,1536] x [1536,8960]: 4.2 ms against 2.8).
  constexpr int kV = kBlock / kLanes;  // vectors across a whole block
  // Column blocks split over the threads XLA gives this process (one when pinned to a core).
  const int64_t parts = std::min<int64_t>(blocks, 4 * std::max<int64_t>(pool.num_threads(), 1));
  run_parts(pool, parts, [=](int64_t p) {
    packed_matmul<kAcc / kV, kV>(xp, wp, yp, M, K, blocks, blocks * p / parts,
                                 blocks * (p + 1) / parts);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
