// The expert alignment of mid-sized batches (129-4608 pairs: 15-512 tokens at k' = 9) in one launch (one CTA of 32
// warps): the (token, slot) pairs p = 0 .. n_pairs - 1 grouped by expert, exactly as kernels/moe/fused.py
// moe_align's Triton kernels group them:
//
//   expert e's pairs, in pair order, at sorted_ids[start_e, start_e + count_e),
//   start_0 = 0, start_{e+1} = start_e + roundup(count_e, block_m)   (groups in expert order, each padded),
//   every other entry of sorted_ids[0, p_max) the sentinel n_pairs,
//   block_expert[b] = the expert of positions [b block_m, (b + 1) block_m), -1 from num_padded / block_m on,
//   num_padded[0] = start_{E'} (the padded total).
//
// Host side: vibeqwen_kernels/moe/align_cuda.py (ALIGN_CUDA_MAX_PAIRS: where it is used).
//
// Why: the Triton path is three launches (per-chunk histograms, a scan of the [chunks, E'] count matrix, a scatter):
// 15.3 us at 256 tokens on the H200, 8.8 here. From ~800 tokens on the Triton kernels win (they spread the pairs
// over the GPU; here a warp's rounds of 32 pairs are serial): 1024 tokens 17.5 against 19.2 us, 8192 41.4 / 121.
//
// How: warp w owns the pairs [w C, (w + 1) C) (C = ceil(n_pairs / 32 warps), rounds of 32 consecutive pairs), so
// the pair order is (warp, round, lane). Pass 1: per round, one ballot per id bit groups the lanes of one expert and
// the group's first lane adds its size to the warp's histogram row hist[w][e] in shared memory (one writer per entry
// and round: no atomics). Then thread e sums column e over the warps (count_e), a block-wide scan of the padded
// counts gives start_e, and column e becomes each warp's first position for expert e (start_e + the earlier warps'
// counts). Pass 2 repeats the rounds: a lane's position is its warp's running position for its expert plus the
// earlier lanes of its group in this round (popc of the match mask below the lane), and the group's first lane then
// advances the running position. Deterministic, no global atomics, no workspace. Ids are read in batches of 8 rounds
// (8 loads in flight per lane).

#include "mma_common.cuh"

namespace {

constexpr int kAlignWarps = 32;
constexpr int kAlignThreads = kAlignWarps * 32;
constexpr int kBatch = 8;           // rounds whose ids a lane loads before using them
constexpr int kMaxExperts = 1024;   // E' (routed + shared): one scanning thread per expert

// Inclusive sum over the CTA's threads of v (thread order); wsum: kAlignWarps ints of shared memory. Contains
// barriers: every thread must call it.
__device__ __forceinline__ int block_inclusive_scan(int v, int* wsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) wsum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int s = wsum[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    wsum[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  return v + (warp ? wsum[warp - 1] : 0);
}

// One batch of up to kBatch rounds of this warp's pairs [p0, p1): ids[r] = the expert of pair p0 + 32 r + lane, or,
// past p1, pad + lane (pad = 2^nb > every id: matches no other lane; such lanes are skipped).
__device__ __forceinline__ void load_batch(const int* __restrict__ topk_ids, int p0, int p1, int lane, int pad,
                                           int (&ids)[kBatch]) {
#pragma unroll
  for (int r = 0; r < kBatch; ++r) {
    const int p = p0 + 32 * r + lane;
    ids[r] = p < p1 ? __ldg(topk_ids + p) : pad + lane;
  }
}

// The lanes whose v equals this lane's (v < 2^(nb + 1)): one ballot per bit. __match_any_sync gives the same mask,
// but on the H200 it took ~60 cycles of the SM per call (a one-CTA version built on it ran 38.8 us at 1k tokens).
__device__ __forceinline__ unsigned match_lanes(int v, int nb) {
  unsigned eq = 0xffffffffu;
  for (int b = 0; b <= nb; ++b) {
    const bool bit = (v >> b) & 1;
    const unsigned bal = __ballot_sync(0xffffffffu, bit);
    eq &= bit ? bal : ~bal;
  }
  return eq;
}

__global__ void __launch_bounds__(kAlignThreads, 1) moe_align_kernel(
    const int* __restrict__ topk_ids, int n_pairs, int n_experts, int block_m, int p_max, int b_max,
    int* __restrict__ sorted_ids, int* __restrict__ block_expert, int* __restrict__ num_padded, int pdl) {
  pdl_wait(pdl);
  extern __shared__ int smem[];
  int* hist = smem;                                   // [kAlignWarps][n_experts]
  int* start = smem + kAlignWarps * n_experts;        // [n_experts + 1]
  __shared__ int wsum[kAlignWarps];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const unsigned below = (1u << lane) - 1u;
  const int bm_mask = block_m - 1;
  const int per_warp = (n_pairs + kAlignWarps - 1) / kAlignWarps;
  const int w0 = min(n_pairs, warp * per_warp), w1 = min(n_pairs, w0 + per_warp);
  int* my_hist = hist + warp * n_experts;
  // ids < 2^nb; a lane past the warp's range holds pad + lane (nb >= 5: distinct from every id and other such lane)
  const int nb = max(5, 32 - __clz(n_experts - 1)), pad = 1 << nb;

  for (int i = tid; i < kAlignWarps * n_experts; i += kAlignThreads) hist[i] = 0;
  __syncthreads();

  // ---- pass 1: the warp's histogram
  for (int b0 = w0; b0 < w1; b0 += 32 * kBatch) {
    int ids[kBatch];
    load_batch(topk_ids, b0, w1, lane, pad, ids);
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      if (b0 + 32 * r >= w1) break;  // warp-uniform
      const unsigned m = match_lanes(ids[r], nb);
      if (ids[r] < pad && (m & below) == 0) my_hist[ids[r]] += __popc(m);
      __syncwarp();
    }
  }
  __syncthreads();

  // ---- counts, padded starts (thread e: expert e), then each warp's first position per expert
  const int e = tid;
  int count = 0;
  if (e < n_experts)
    for (int w = 0; w < kAlignWarps; ++w) count += hist[w * n_experts + e];
  const int padded = (count + bm_mask) & ~bm_mask;
  const int incl = block_inclusive_scan(e < n_experts ? padded : 0, wsum);
  const int total = wsum[kAlignWarps - 1];
  if (e < n_experts) {
    start[e] = incl - padded;
    int run = incl - padded;
    for (int w = 0; w < kAlignWarps; ++w) {
      const int c = hist[w * n_experts + e];
      hist[w * n_experts + e] = run;
      run += c;
    }
  }
  if (e == 0) {
    start[n_experts] = total;
    num_padded[0] = total;
  }
  // sentinels everywhere first (the real pairs overwrite theirs after the barrier: a CTA barrier orders global
  // stores of its threads), block experts by a binary search of the starts
  for (int i = tid; i < p_max; i += kAlignThreads) sorted_ids[i] = n_pairs;
  __syncthreads();
  const int bm_shift = __ffs(block_m) - 1;
  for (int b = tid; b < b_max; b += kAlignThreads) {
    const int pos = b << bm_shift;
    int ex = -1;
    if (pos < total) {  // the last expert whose group starts at or before pos (an empty group has no block)
      int lo = 0, hi = n_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= pos) lo = mid; else hi = mid - 1;
      }
      ex = lo;
    }
    block_expert[b] = ex;
  }

  // ---- pass 2: every pair to its position
  for (int b0 = w0; b0 < w1; b0 += 32 * kBatch) {
    int ids[kBatch];
    load_batch(topk_ids, b0, w1, lane, pad, ids);
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      if (b0 + 32 * r >= w1) break;  // warp-uniform
      const unsigned m = match_lanes(ids[r], nb);
      const bool real = ids[r] < pad;
      if (real) sorted_ids[my_hist[ids[r]] + __popc(m & below)] = b0 + 32 * r + lane;
      __syncwarp();
      if (real && (m & below) == 0) my_hist[ids[r]] += __popc(m);
      __syncwarp();
    }
  }
}

}  // namespace

// Dynamic shared memory of the launch: the warps' histogram rows and the starts.
extern "C" int vq_moe_align_smem_bytes(int n_experts) { return (kAlignWarps * n_experts + n_experts + 1) * 4; }

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// topk_ids: int32 [n_pairs] (contiguous), every id in [0, n_experts) (not checked); 1 <= n_experts <= 1024; block_m
// a power of two; outputs sorted_ids int32 [p_max], block_expert int32 [b_max], num_padded int32 [1] with
// (p_max, b_max) = fused.align_bounds(n_pairs, n_experts, block_m). Else cudaErrorInvalidValue.
// pdl: 1 launches with programmatic dependent launch (the kernel waits for the previous one first), 2 also lets the
// next kernel launch early (mma_common.cuh: pdl_wait).
extern "C" int vq_moe_align_launch(const int* topk_ids, int n_pairs, int n_experts, int block_m, int p_max, int b_max,
                                   int* sorted_ids, int* block_expert, int* num_padded, int pdl, void* stream) {
  if (n_pairs < 1 || n_experts < 1 || n_experts > kMaxExperts || block_m < 1 || (block_m & (block_m - 1)) ||
      p_max < 1 || b_max < 1)
    return (int)cudaErrorInvalidValue;
  static int configured[64] = {0};
  return launch_kernel(moe_align_kernel, configured, dim3(1), kAlignThreads, vq_moe_align_smem_bytes(n_experts),
                       (cudaStream_t)stream, pdl, topk_ids, n_pairs, n_experts, block_m, p_max, b_max, sorted_ids,
                       block_expert, num_padded, pdl);
}
