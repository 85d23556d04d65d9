// Kernels for bench/kernels/bench_persistent_chain.py: what does a chain of dependent weight streams cost when each
// link is its own launch (programmatic dependent launch, as the decode graphs run today) against one persistent
// launch whose links meet at a grid barrier? The premise of a whole-step persistent decode kernel (batch 1 needs
// ~half of a layer's time gone: bench/results/h200_notes.md, thirty-seventh and fiftieth sessions), measured on
// streams without the model's arithmetic.
//
// A chain is P phases. Phase p reads a weight W_p ([rows_p, K_p] bytes, 16-byte vectors, K_p a multiple of 512) and
// all of the previous phase's output y_{p-1} (fp32, R = rows_{p-1} values), staged into shared memory through L2
// (ld.global.cg) as n = K_p / 4 values x_p (one x value a 4-byte word):
//
//   x_p[i] = (y_{p-1}[i] + y_{p-1}[i + n] + ... (every index below R, in that order)) * (1 / terms)   where R > n
//   x_p[i] = y_{p-1}[i % R]                                                                           where R <= n
//   y_p[r] = (sum over the row's words w (lane order, then a warp's butterfly sum) of f(w) * x_p[word index])
//            * (1 / (1.5 n))
//   f(w)   = the float with w's 23 mantissa bits and exponent 0: a value in [1, 2) (never NaN or inf)
//
// so every phase depends on every value of the previous one, as a decode step's GEMVs do, and the values stay near 1
// over hundreds of phases (no overflow: the same-bits check compares finite values). Staging reads R values a CTA
// (4-48 KB for decode_b1's phases; a decode step's GEMVs stage 4-24 KB of bf16 input). A warp takes DEPTH rows at a
// time (all their vectors requested before any is used: DEPTH * K / 512 vectors a lane in flight).
//
//   launch:     one kernel a phase, 8 warps a CTA, one DEPTH-row group a warp (grid: rows / (8 DEPTH)); with early
//               (pdl 2) its weights are requested before its PDL wait, as the FP8 GEMMs do under early launch.
//   persistent: one kernel for the whole chain, grid = the CTAs that fit at once (8 warps each), the phases' row
//               groups dealt to the warps in turn; a grid barrier between phases: barrier 0 an acq_rel arrival
//               counter whose last CTA bumps a generation word the others spin on (after a __threadfence), barrier
//               1 a counter that only grows (a release reduction each CTA, every CTA polling it). With prefetch,
//               each warp requests its first row group of phase p + 1 before it arrives at the barrier that ends
//               phase p (the weights do not depend on the barrier; only x does).
//   tagged:     the persistent grid with no barrier: each output word carries its phase's tag, and a CTA stages
//               x by re-reading its words until they carry the tag it waits for (csrc/moe_decode.cu's tagged logits).
//   ring:       tagged, with each CTA's weights for its rows of every phase streamed ahead by one producer thread
//               into a shared-memory ring of bulk copies (16 KB slots): the weights never wait for the chain's data.
//
// The sums are the same bits in every mode (each row's words in the same lane and order), so y of the last phase
// checks the barrier. Built by the bench script with nvcc -I csrc; not part of the engine.

#include "mma_common.cuh"

namespace {

constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kMaxKVec = 4096 / 16;  // widest row: 4096 bytes
constexpr int kMaxVpl = kMaxKVec / 32;  // vectors a lane a row

struct PhaseTable {
  const long long* w;  // [P] weight addresses
  const int* rows;     // [P]
  const int* kvec;     // [P] 16-byte vectors a row (K / 16, a multiple of 32)
};

__device__ __forceinline__ float word_value(uint32_t w) { return __uint_as_float((w & 0x007FFFFFu) | 0x3F800000u); }

// y_p's scale (see the header): 1 / (1.5 n), the same operations in every mode.
__device__ __forceinline__ float out_value(float acc, int kvec) {
  return __fmul_rn(acc, __frcp_rn(1.5f * (float)(kvec * 4)));
}

constexpr int kPer = kMaxKVec * 4 / kThreads;  // x values a staging thread (n <= 1024)
constexpr int kTermBatch = 4;                  // terms of every x value a thread requests at once

// Terms of the widest x value: ceil(R / n) where the previous phase has more rows than x values, else 1.
__device__ __forceinline__ int max_terms(int rows_prev, int n) { return rows_prev > n ? (rows_prev + n - 1) / n : 1; }

// x_p into shared memory from y_prev (see the header). Thread t owns x values t + kThreads q (q < kPer); it requests
// their terms kTermBatch at a time (kPer * kTermBatch loads in flight) through `load(v, m0, n)`, adds them in order.
template <typename Load>
__device__ __forceinline__ void stage_terms(float* xs, int rows_prev, int kvec, Load load) {
  const int n = kvec * 4;
  const int terms = max_terms(rows_prev, n);  // at most: x value i has those below R
  float sum[kPer];
#pragma unroll
  for (int q = 0; q < kPer; ++q) sum[q] = 0.f;
  for (int m0 = 0; m0 < terms; m0 += kTermBatch) {
    float v[kPer][kTermBatch];
    load(v, m0, n);
#pragma unroll
    for (int q = 0; q < kPer; ++q)
#pragma unroll
      for (int m = 0; m < kTermBatch; ++m) {
        const int i = threadIdx.x + q * kThreads, j = i + (m0 + m) * n;
        if (i < n && m0 + m < terms && (rows_prev <= n || j < rows_prev)) sum[q] = __fadd_rn(sum[q], v[q][m]);
      }
  }
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int i = threadIdx.x + q * kThreads;
    if (i >= n) continue;
    if (rows_prev <= n) {
      xs[i] = sum[q];
    } else {
      const int mine = (rows_prev - i + n - 1) / n;  // terms of value i
      xs[i] = __fmul_rn(sum[q], __frcp_rn((float)mine));
    }
  }
}

// The index of term m of x value i: i + m n, or i % R where R <= n (one term).
__device__ __forceinline__ int term_index(int i, int m, int n, int rows_prev) {
  return rows_prev <= n ? i % rows_prev : i + m * n;
}
__device__ __forceinline__ bool term_exists(int i, int m, int n, int rows_prev, int terms) {
  return i < n && m < terms && (rows_prev <= n ? m == 0 : i + m * n < rows_prev);
}

// x_p from plain fp32 y_prev (ld.global.cg: it may come from other CTAs of this grid).
__device__ __forceinline__ void stage_x(float* xs, const float* y_prev, int rows_prev, int kvec) {
  const int terms = max_terms(rows_prev, kvec * 4);
  stage_terms(xs, rows_prev, kvec, [&](float (&v)[kPer][kTermBatch], int m0, int n) {
#pragma unroll
    for (int q = 0; q < kPer; ++q)
#pragma unroll
      for (int m = 0; m < kTermBatch; ++m) {
        const int i = threadIdx.x + q * kThreads;
        v[q][m] = term_exists(i, m0 + m, n, rows_prev, terms) ? __ldcg(y_prev + term_index(i, m0 + m, n, rows_prev))
                                                              : 0.f;
      }
  });
}

// The DEPTH rows [row0, row0 + DEPTH) of W (rows past `rows` skipped): lane `lane`'s vectors, all requested.
template <int DEPTH>
struct RowGroup {
  uint4 v[DEPTH][kMaxVpl];
};

template <int DEPTH, int VPL>
__device__ __forceinline__ void request(const uint4* w, int rows, int row0, int lane, RowGroup<DEPTH>& g) {
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      g.v[d][j] = row0 + d < rows ? load_stream(w + (size_t)(row0 + d) * (VPL * 32) + j * 32 + lane)
                                  : make_uint4(0, 0, 0, 0);
}

// request<DEPTH, VPL> with the row's vectors a lane (vpl: 1, 2, 4, 5 or 8; anything else reads as 8) known only at
// run time: a phase's first row group requested ahead of the phase.
template <int DEPTH>
__device__ __forceinline__ void request_vpl(int vpl, const uint4* w, int rows, int row0, int lane,
                                            RowGroup<DEPTH>& g) {
  switch (vpl) {
    case 1: request<DEPTH, 1>(w, rows, row0, lane, g); break;
    case 2: request<DEPTH, 2>(w, rows, row0, lane, g); break;
    case 4: request<DEPTH, 4>(w, rows, row0, lane, g); break;
    case 5: request<DEPTH, 5>(w, rows, row0, lane, g); break;
    default: request<DEPTH, 8>(w, rows, row0, lane, g); break;
  }
}

// y: fp32 values, or (TAGGED) 64-bit words of the value's bits and `tag` (high half), one relaxed store each.
template <int DEPTH, int VPL, bool TAGGED = false>
__device__ __forceinline__ void consume(const RowGroup<DEPTH>& g, const float* xs, int rows, int row0, int lane,
                                        void* y, uint32_t tag = 0) {
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int i = (j * 32 + lane) * 4;  // the vector's first word
      acc = fmaf(word_value(g.v[d][j].x), xs[i], acc);
      acc = fmaf(word_value(g.v[d][j].y), xs[i + 1], acc);
      acc = fmaf(word_value(g.v[d][j].z), xs[i + 2], acc);
      acc = fmaf(word_value(g.v[d][j].w), xs[i + 3], acc);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    acc = out_value(acc, VPL * 32);
    if (lane == 0 && row0 + d < rows) {
      if (TAGGED) {
        const unsigned long long w = (unsigned long long)tag << 32 | __float_as_uint(acc);
        asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(static_cast<unsigned long long*>(y) + row0 + d),
                     "l"(w) : "memory");
      } else {
        static_cast<float*>(y)[row0 + d] = acc;
      }
    }
  }
}

// One phase as its own launch: warp (CTA b, warp w) takes rows [(8 b + w) DEPTH, + DEPTH).
template <int DEPTH, int VPL>
__global__ void __launch_bounds__(kThreads) phase_kernel(const uint4* __restrict__ w, int rows,
                                                         const float* __restrict__ y_prev, int rows_prev,
                                                         float* __restrict__ y, int pdl) {
  __shared__ float xs[kMaxKVec * 4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kWarps + warp) * DEPTH;
  RowGroup<DEPTH> g;
  if (pdl != 2) pdl_wait(pdl);
  request<DEPTH, VPL>(w, rows, row0, lane, g);
  if (pdl == 2) pdl_wait(pdl);
  stage_x(xs, y_prev, rows_prev, VPL * 32);
  __syncthreads();
  consume<DEPTH, VPL>(g, xs, rows, row0, lane, y);
}

// All CTAs of the grid meet here (every thread of the CTA calls it). count: arrivals of this barrier (the last
// resets it), gen: the barrier's generation (read by each CTA at its start: `phase` barriers later it is start +
// phase).
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* gen, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
    if (old == gridDim.x - 1) {
      *reinterpret_cast<volatile unsigned*>(count) = 0;
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(gen), "r"(target) : "memory");
    } else {
      unsigned g;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");
      } while ((int)(g - target) < 0);
    }
  }
  __syncthreads();
}

// The same meeting on a counter that only grows (zeroed before the launch): each CTA adds 1 with a release reduction
// (no returned value, no fence: the release orders the CTA's earlier writes, which bar.sync made this thread's
// to order) and every CTA polls the counter until it reaches `target` = CTAs x barriers so far; no CTA resets anything
// and none waits for an atomic's round trip before it starts polling.
__device__ __forceinline__ void counter_barrier(unsigned* count, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
    unsigned c;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(count) : "memory");
    } while ((int)(c - target) < 0);
  }
  __syncthreads();
}

template <int DEPTH, int VPL>
__device__ __forceinline__ void persistent_phase(const uint4* w, int rows, const float* y_prev, int rows_prev,
                                                 float* y, float* xs, RowGroup<DEPTH>& g, bool have_first,
                                                 int gwarp, int nwarps, int lane) {
  stage_x(xs, y_prev, rows_prev, VPL * 32);
  __syncthreads();
  for (int row0 = gwarp * DEPTH; row0 < rows; row0 += nwarps * DEPTH) {
    if (!(have_first && row0 == gwarp * DEPTH)) request<DEPTH, VPL>(w, rows, row0, lane, g);
    consume<DEPTH, VPL>(g, xs, rows, row0, lane, y);
  }
}

// The whole chain in one launch (see the header). y0: the input of phase 0 (rows0 values); ys: two ping-pong
// outputs (phase p writes ys[p % 2]); prefetch: request the next phase's first row group before each barrier;
// barrier 0: grid_barrier (sync[0] arrivals, sync[1] generation), 1: counter_barrier on sync[2] (zeroed before).
template <int DEPTH>
__global__ void __launch_bounds__(kThreads) chain_kernel(PhaseTable t, int n_phases, const float* __restrict__ y0,
                                                         int rows0, float* y_a, float* y_b, unsigned* sync,
                                                         int prefetch, int barrier) {
  __shared__ float xs[kMaxKVec * 4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
  unsigned target = *reinterpret_cast<volatile unsigned*>(sync + 1);
  RowGroup<DEPTH> g;
  bool have = false;
  const float* y_prev = y0;
  int rows_prev = rows0;
  for (int p = 0; p < n_phases; ++p) {
    const uint4* w = reinterpret_cast<const uint4*>(t.w[p]);
    const int rows = t.rows[p], kvec = t.kvec[p];
    float* y = (p & 1) ? y_b : y_a;
    switch (kvec / 32) {  // K of 512, 1024, 2048, 2560 or 4096 bytes
      case 1: persistent_phase<DEPTH, 1>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane); break;
      case 2: persistent_phase<DEPTH, 2>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane); break;
      case 4: persistent_phase<DEPTH, 4>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane); break;
      case 5: persistent_phase<DEPTH, 5>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane); break;
      default: persistent_phase<DEPTH, 8>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane); break;
    }
    have = false;
    if (p + 1 < n_phases) {
      const int nrows = t.rows[p + 1], nk = t.kvec[p + 1] / 32;
      const uint4* nw = reinterpret_cast<const uint4*>(t.w[p + 1]);
      if (prefetch && gwarp * DEPTH < nrows) {
        request_vpl<DEPTH>(nk, nw, nrows, gwarp * DEPTH, lane, g);
        have = true;
      }
      if (barrier == 0)
        grid_barrier(sync, sync + 1, ++target);
      else
        counter_barrier(sync + 2, gridDim.x * (unsigned)(p + 1));
    }
    y_prev = y;
    rows_prev = rows;
  }
}

// x_p from tagged words (see consume; stage_x's sums): every batch of terms is requested at once, then the words
// whose tag is not `tag` are re-read until all are; a wait of more than 2 s traps (a producer that never came).
__device__ __forceinline__ void stage_x_tagged(float* xs, const unsigned long long* y_prev, int rows_prev, int kvec,
                                               uint32_t tag) {
  const int terms = max_terms(rows_prev, kvec * 4);
  stage_terms(xs, rows_prev, kvec, [&](float (&v)[kPer][kTermBatch], int m0, int n) {
    unsigned long long w[kPer][kTermBatch];
    uint32_t pending = 0;
#pragma unroll
    for (int q = 0; q < kPer; ++q)
#pragma unroll
      for (int m = 0; m < kTermBatch; ++m) {
        w[q][m] = 0ull;
        if (term_exists(threadIdx.x + q * kThreads, m0 + m, n, rows_prev, terms)) pending |= 1u << (q * kTermBatch + m);
      }
    long long t0 = 0;
    while (pending) {
#pragma unroll
      for (int q = 0; q < kPer; ++q)
#pragma unroll
        for (int m = 0; m < kTermBatch; ++m)
          if (pending >> (q * kTermBatch + m) & 1u)
            asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];"
                         : "=l"(w[q][m])
                         : "l"(y_prev + term_index(threadIdx.x + q * kThreads, m0 + m, n, rows_prev))
                         : "memory");
#pragma unroll
      for (int q = 0; q < kPer; ++q)
#pragma unroll
        for (int m = 0; m < kTermBatch; ++m)
          if ((pending >> (q * kTermBatch + m) & 1u) && (uint32_t)(w[q][m] >> 32) == tag)
            pending &= ~(1u << (q * kTermBatch + m));
      if (pending) {
        long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (t0 == 0) t0 = now;
        else if (now - t0 > 2000000000ll) __trap();
      }
    }
#pragma unroll
    for (int q = 0; q < kPer; ++q)
#pragma unroll
      for (int m = 0; m < kTermBatch; ++m) v[q][m] = __uint_as_float((uint32_t)w[q][m]);
  });
}

template <int DEPTH, int VPL>
__device__ __forceinline__ void tagged_phase(const uint4* w, int rows, const unsigned long long* y_prev, int rows_prev,
                                             unsigned long long* y, float* xs, RowGroup<DEPTH>& g, bool have_first,
                                             int gwarp, int nwarps, int lane, uint32_t tag) {
  // a CTA without rows here stages nothing: nobody waits for it, so it could lag until phase p + 2 has overwritten
  // the words it would wait for (the one hazard of reusing two buffers)
  if (blockIdx.x * kWarps * DEPTH >= rows) return;
  stage_x_tagged(xs, y_prev, rows_prev, VPL * 32, tag);
  __syncthreads();
  for (int row0 = gwarp * DEPTH; row0 < rows; row0 += nwarps * DEPTH) {
    if (!(have_first && row0 == gwarp * DEPTH)) request<DEPTH, VPL>(w, rows, row0, lane, g);
    consume<DEPTH, VPL, true>(g, xs, rows, row0, lane, y, tag + 1);
  }
  __syncthreads();  // xs is restaged by the next phase
}

// The chain with no barrier at all: phase p's outputs carry tag p + 1 and its CTAs wait for their input words to
// carry tag p (tagged logits, as csrc/moe_decode.cu's routing waits for the router's). y0 holds tag 0; y_a and y_b
// are zeroed before every launch (tag 0 never awaited after phase 0). Phase p + 2 overwrites phase p's buffer only
// after every CTA with rows in phase p + 1 has staged it: its producers need all of phase p + 1, whose CTAs staged
// phase p first (CTAs without rows in a phase stage nothing).
template <int DEPTH>
__global__ void __launch_bounds__(kThreads) tagged_chain_kernel(PhaseTable t, int n_phases,
                                                                const unsigned long long* __restrict__ y0, int rows0,
                                                                unsigned long long* y_a, unsigned long long* y_b,
                                                                int prefetch) {
  __shared__ float xs[kMaxKVec * 4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
  RowGroup<DEPTH> g;
  bool have = false;
  const unsigned long long* y_prev = y0;
  int rows_prev = rows0;
  for (int p = 0; p < n_phases; ++p) {
    const uint4* w = reinterpret_cast<const uint4*>(t.w[p]);
    const int rows = t.rows[p], kvec = t.kvec[p];
    unsigned long long* y = (p & 1) ? y_b : y_a;
    switch (kvec / 32) {
      case 1: tagged_phase<DEPTH, 1>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane, p); break;
      case 2: tagged_phase<DEPTH, 2>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane, p); break;
      case 4: tagged_phase<DEPTH, 4>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane, p); break;
      case 5: tagged_phase<DEPTH, 5>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane, p); break;
      default: tagged_phase<DEPTH, 8>(w, rows, y_prev, rows_prev, y, xs, g, have, gwarp, nwarps, lane, p); break;
    }
    have = false;
    if (prefetch && p + 1 < n_phases && gwarp * DEPTH < t.rows[p + 1]) {
      const int nrows = t.rows[p + 1];
      const uint4* nw = reinterpret_cast<const uint4*>(t.w[p + 1]);
      request_vpl<DEPTH>(t.kvec[p + 1] / 32, nw, nrows, gwarp * DEPTH, lane, g);
      have = true;
    }
    y_prev = y;
    rows_prev = rows;
  }
}

// ---- ring: the tagged chain with each CTA's weights streamed ahead into a shared-memory ring ----
//
// One producer thread a CTA (warp kWarps, lane 0) walks the CTA's chunks of every phase in order (phase p: the
// CTA's contiguous rows [lo, hi) of W_p, lo = b * ceil(rows / CTAs), cut into chunks of the whole rows that fit a
// kSlotBytes slot) and copies each into the next free slot with one bulk copy (cp.async.bulk, completing on the
// slot's `full` mbarrier); it blocks only when the ring is full, so it runs up to `slots` chunks ahead of the
// consumers, across phase boundaries: the weights never wait for the chain's data. The 8 consumer warps stage x_p
// from tagged words (stage_x_tagged), then take each chunk's rows (row i of a chunk: warp i % 8) with consume's exact
// lane and word order (the same bits), store the tagged outputs, and free the slot (`empty` mbarrier, one arrival a
// warp). CTAs without rows in a phase skip it (producer and consumers alike), as tagged_chain_kernel's do.
constexpr int kSlotBytes = 16384;
constexpr int kRingThreads = kThreads + 32;

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// waits for the phase of parity `parity` to complete; a wait of more than 2 s traps (a copy that never landed)
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  long long t0 = 0;
  while (true) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    if (done) return;
    long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (t0 == 0) t0 = now;
    else if (now - t0 > 2000000000ll) __trap();
  }
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(bar),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// the 8 consumer warps only (named barrier 1; the producer warp never joins)
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

struct CtaRows {
  int lo, hi, crows;  // the CTA's rows of the phase and the rows a chunk
};
__device__ __forceinline__ CtaRows cta_rows(int rows, int row_bytes) {
  const int per = (rows + gridDim.x - 1) / gridDim.x;
  const int lo = min(rows, (int)blockIdx.x * per);
  return {lo, min(rows, lo + per), kSlotBytes / row_bytes};
}

__global__ void __launch_bounds__(kRingThreads) ring_chain_kernel(PhaseTable t, int n_phases,
                                                                  const unsigned long long* __restrict__ y0,
                                                                  int rows0, unsigned long long* y_a,
                                                                  unsigned long long* y_b, int slots) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);                                   // [slots][kSlotBytes]
  float* xs = reinterpret_cast<float*>(smem + (size_t)slots * kSlotBytes);        // [kMaxKVec * 4]
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(xs + kMaxKVec * 4);  // full[slots], empty[slots]
  const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(bars);
  const uint32_t empty0 = full0 + 8u * slots;
  const uint32_t ring0 = (uint32_t)__cvta_generic_to_shared(ring);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(full0 + 8u * i, 1);
      mbar_init(empty0 + 8u * i, kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kWarps) {  // the producer
    if (lane != 0) return;
    unsigned it = 0;
    for (int p = 0; p < n_phases; ++p) {
      const int row_bytes = t.kvec[p] * 16;
      const CtaRows c = cta_rows(t.rows[p], row_bytes);
      const unsigned char* w = reinterpret_cast<const unsigned char*>(t.w[p]);
      for (int r = c.lo; r < c.hi; r += c.crows, ++it) {
        const int slot = it % slots;
        if (it >= (unsigned)slots) mbar_wait(empty0 + 8u * slot, (it / slots - 1) & 1);
        const uint32_t bytes = (uint32_t)(min(c.crows, c.hi - r) * row_bytes);
        mbar_expect_tx(full0 + 8u * slot, bytes);
        bulk_copy(ring0 + (uint32_t)slot * kSlotBytes, w + (size_t)r * row_bytes, bytes, full0 + 8u * slot);
      }
    }
    return;
  }
  unsigned it = 0;
  const unsigned long long* y_prev = y0;
  int rows_prev = rows0;
  for (int p = 0; p < n_phases; ++p) {
    const int rows = t.rows[p], kvec = t.kvec[p], vpl = kvec / 32;
    const CtaRows c = cta_rows(rows, kvec * 16);
    unsigned long long* y = (p & 1) ? y_b : y_a;
    if (c.lo < c.hi) {
      stage_x_tagged(xs, y_prev, rows_prev, kvec, (uint32_t)p);
      consumers_sync();
      for (int r = c.lo; r < c.hi; r += c.crows, ++it) {
        const int slot = it % slots, n = min(c.crows, c.hi - r);
        mbar_wait(full0 + 8u * slot, (it / slots) & 1);
        const uint4* chunk = ring + (size_t)slot * (kSlotBytes / 16);
        for (int i = warp; i < n; i += kWarps) {
          const uint4* row = chunk + (size_t)i * kvec;
          float acc = 0.f;
          for (int j = 0; j < vpl; ++j) {  // consume's order: vector j * 32 + lane, its 4 words in order
            const uint4 v = row[j * 32 + lane];
            const int x = (j * 32 + lane) * 4;
            acc = fmaf(word_value(v.x), xs[x], acc);
            acc = fmaf(word_value(v.y), xs[x + 1], acc);
            acc = fmaf(word_value(v.z), xs[x + 2], acc);
            acc = fmaf(word_value(v.w), xs[x + 3], acc);
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
          acc = out_value(acc, kvec);
          if (lane == 0) {
            const unsigned long long word = (unsigned long long)(p + 1) << 32 | __float_as_uint(acc);
            asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(y + r + i), "l"(word) : "memory");
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8u * slot);
      }
      consumers_sync();  // xs is restaged by the next phase
    }
    y_prev = y;
    rows_prev = rows;
  }
}

__host__ __device__ constexpr int ring_smem(int slots) { return slots * kSlotBytes + kMaxKVec * 4 * 4 + 16 * slots; }

template <int DEPTH, int VPL>
int launch_phase(const void* w, int rows, const float* y_prev, int rows_prev, float* y, int pdl, cudaStream_t st) {
  static int configured[64] = {0};
  const int groups = (rows + DEPTH - 1) / DEPTH;
  const dim3 grid((groups + kWarps - 1) / kWarps);
  return launch_kernel(phase_kernel<DEPTH, VPL>, configured, grid, kThreads, 0, st, pdl,
                       reinterpret_cast<const uint4*>(w), rows, y_prev, rows_prev, y, pdl);
}

}  // namespace

// One phase as its own kernel: w [rows, kvec * 16] bytes (16-byte aligned), kvec / 32 in {1, 2, 4, 5, 8}; depth 1, 2
// or 4 rows a warp; pdl 0 (plain), 1 or 2 (early: weights before the wait). Returns 0 or a CUDA error code.
extern "C" int vq_chain_phase_launch(const void* w, int rows, int kvec, const float* y_prev, int rows_prev, float* y,
                                     int depth, int pdl, void* stream) {
  const cudaStream_t st = (cudaStream_t)stream;
  const int vpl = kvec / 32;
  if (rows < 1 || kvec % 32 || rows_prev < 1) return (int)cudaErrorInvalidValue;
#define VQ_CHAIN_V(D)                                                                  \
  switch (vpl) {                                                                      \
    case 1: return launch_phase<D, 1>(w, rows, y_prev, rows_prev, y, pdl, st);        \
    case 2: return launch_phase<D, 2>(w, rows, y_prev, rows_prev, y, pdl, st);        \
    case 4: return launch_phase<D, 4>(w, rows, y_prev, rows_prev, y, pdl, st);        \
    case 5: return launch_phase<D, 5>(w, rows, y_prev, rows_prev, y, pdl, st);        \
    case 8: return launch_phase<D, 8>(w, rows, y_prev, rows_prev, y, pdl, st);        \
    default: return (int)cudaErrorInvalidValue;                                        \
  }
  switch (depth) {
    case 1: VQ_CHAIN_V(1)
    case 2: VQ_CHAIN_V(2)
    case 4: VQ_CHAIN_V(4)
    default: return (int)cudaErrorInvalidValue;
  }
#undef VQ_CHAIN_V
}

// The tagged chain (tagged_chain_kernel) on ctas CTAs (at most vq_chain_grid(depth, 1)); y0 / y_a / y_b: uint64 words
// (y0 tag 0, y_a and y_b zeroed before every launch). Returns 0 or a CUDA error code.
extern "C" int vq_chain_tagged_launch(const long long* w, const int* rows, const int* kvec, int n_phases,
                                      const unsigned long long* y0, int rows0, unsigned long long* y_a,
                                      unsigned long long* y_b, int depth, int ctas, int prefetch, void* stream) {
  static int configured[3][64] = {{0}};
  const cudaStream_t st = (cudaStream_t)stream;
  const PhaseTable t = {w, rows, kvec};
  if (n_phases < 1 || ctas < 1) return (int)cudaErrorInvalidValue;
  switch (depth) {
    case 1: return launch_kernel(tagged_chain_kernel<1>, configured[0], dim3(ctas), kThreads, 0, st, 0, t, n_phases,
                                 y0, rows0, y_a, y_b, prefetch);
    case 2: return launch_kernel(tagged_chain_kernel<2>, configured[1], dim3(ctas), kThreads, 0, st, 0, t, n_phases,
                                 y0, rows0, y_a, y_b, prefetch);
    case 4: return launch_kernel(tagged_chain_kernel<4>, configured[2], dim3(ctas), kThreads, 0, st, 0, t, n_phases,
                                 y0, rows0, y_a, y_b, prefetch);
    default: return (int)cudaErrorInvalidValue;
  }
}

// CTAs a persistent chain launch may use (all resident at once) for depth: SMs x the occupancy of chain_kernel
// (tagged 0) or tagged_chain_kernel (1); -1 on a CUDA error.
extern "C" int vq_chain_grid(int depth, int tagged) {
  int dev = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev))
    return -1;
  cudaError_t err;
  if (tagged)
    err = depth == 1   ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tagged_chain_kernel<1>, kThreads, 0)
          : depth == 2 ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tagged_chain_kernel<2>, kThreads, 0)
                       : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tagged_chain_kernel<4>, kThreads, 0);
  else
    err = depth == 1   ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_kernel<1>, kThreads, 0)
          : depth == 2 ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_kernel<2>, kThreads, 0)
                       : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_kernel<4>, kThreads, 0);
  return err == cudaSuccess ? sms * per_sm : -1;
}

// The whole chain in one launch on ctas CTAs (at most vq_chain_grid(depth, 0): they must all be resident). w / rows /
// kvec: device arrays [n_phases] (int64 addresses, int32, int32); sync: three uint32 words, the first two zero before
// the first launch (barrier 0 leaves them so), the third zero before every launch with barrier 1. Returns 0 or a
// CUDA error code.
extern "C" int vq_chain_persistent_launch(const long long* w, const int* rows, const int* kvec, int n_phases,
                                          const float* y0, int rows0, float* y_a, float* y_b, unsigned* sync,
                                          int depth, int ctas, int prefetch, int barrier, void* stream) {
  static int configured[3][64] = {{0}};
  const cudaStream_t st = (cudaStream_t)stream;
  const PhaseTable t = {w, rows, kvec};
  if (n_phases < 1 || ctas < 1) return (int)cudaErrorInvalidValue;
  switch (depth) {
    case 1: return launch_kernel(chain_kernel<1>, configured[0], dim3(ctas), kThreads, 0, st, 0, t, n_phases, y0,
                                 rows0, y_a, y_b, sync, prefetch, barrier);
    case 2: return launch_kernel(chain_kernel<2>, configured[1], dim3(ctas), kThreads, 0, st, 0, t, n_phases, y0,
                                 rows0, y_a, y_b, sync, prefetch, barrier);
    case 4: return launch_kernel(chain_kernel<4>, configured[2], dim3(ctas), kThreads, 0, st, 0, t, n_phases, y0,
                                 rows0, y_a, y_b, sync, prefetch, barrier);
    default: return (int)cudaErrorInvalidValue;
  }
}

// The ring chain (ring_chain_kernel) on ctas CTAs of kRingThreads threads and `slots` (1-13) ring slots of 16 KB;
// words as vq_chain_tagged_launch's. Every row of the table must be 512-4096 bytes (a multiple of 512: the table is
// on the device, so this is the caller's to keep). cudaErrorInvalidValue where ctas exceeds the CTAs that can be
// resident at once (they wait on each other), else 0 or a CUDA error code.
extern "C" int vq_chain_ring_launch(const long long* w, const int* rows, const int* kvec, int n_phases,
                                    const unsigned long long* y0, int rows0, unsigned long long* y_a,
                                    unsigned long long* y_b, int slots, int ctas, void* stream) {
  static int configured[64] = {0};
  const PhaseTable t = {w, rows, kvec};
  if (n_phases < 1 || ctas < 1 || slots < 1 || slots > 13) return (int)cudaErrorInvalidValue;
  int dev = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) ||
      cudaFuncSetAttribute(ring_chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_smem(13)) ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ring_chain_kernel, kRingThreads, ring_smem(slots))) {
    (void)cudaGetLastError();
    return (int)cudaErrorInvalidValue;
  }
  if (ctas > sms * per_sm) return (int)cudaErrorInvalidValue;
  return launch_kernel(ring_chain_kernel, configured, dim3(ctas), kRingThreads, ring_smem(slots),
                       (cudaStream_t)stream, 0, t, n_phases, y0, rows0, y_a, y_b, slots);
}
