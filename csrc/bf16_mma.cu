// Decode-sized GEMMs of the checkpoint's bf16 weights on the tensor cores (mma.m16n8k16, fp32 sums), 1-64 tokens:
//
//   bf16_mma_kernel:  out[t, n] = bf16(sum_k x[t, k] W[n, k])           (GDN's b|a projection: 64 x 2048)
//   moe_route_kernel: the MoE router of a decode step in one launch: the router GEMM, softmax + top-k +
//                     renormalisation, the shared expert's sigmoid gate, and the expert alignment of the (token,
//                     slot) pairs for the grouped expert GEMMs:
//
//   logits[t, e] = bf16(sum_k x[t, k] W[e, k])          (e < E: routed experts, e = E: shared_expert_gate)
//   p[t, :]      = softmax_fp32(logits[t, :E]);  top_k largest (ties to the lower id), renormalised to sum 1
//   slot top_k   = (id E, sigmoid(logits[t, E]))
//
// (HF Qwen3_5MoeSparseMoeBlock: a bf16 F.linear, softmax in float32, topk, divide by the sum; kernels/moe/naive.py
// route_topk_ref.) The pairs p = t * k' + s are then grouped by expert exactly as kernels/moe/fused.py moe_align
// does: expert e's pairs (in pair order) at [start_e, start_e + count_e), start_{e+1} = start_e + roundup(count_e,
// block_m), the rest of sorted_ids the sentinel T * k'; block_expert[b] the expert of positions [b block_m,
// (b + 1) block_m), -1 past num_padded. Host side: vibeqwen_kernels/bf16_mma.py, vibeqwen_kernels/moe/route_cuda.py.
//
// Why: cuBLAS took ~5 us for each of these 0.25-1 MB GEMMs at batch 1 on the H200 (its kernels do not overlap
// their launch with the previous kernel), and the router was three to five launches a layer (GEMM, the Triton
// top-k, one or three alignment kernels): ~10 us a layer at batch 1, ~20 at batch 32.
//
// Grid: one CTA per 16 weight rows (the router's E + 1 rounded up to 16: 17 CTAs), 8 warps (bf16_mma_kernel) or 16
// (moe_route_kernel: more warps for its last CTA's routing; without the split below, 32 from 17 tokens, one or two
// tokens per routing warp: 11.7k -> 9.3k clocks of routing at 32 tokens, H200, twenty-third session); the router's grid has a second dimension, ceil(T / 8) token
// groups of one n8 tile each (a CTA's GEMM is then the same at 32 tokens as at 8: with all 32 tokens in each of 17
// CTAs, every CTA read all of x and its warps ran twice the token tiles, 5.8 against 1.8 us of GEMM). Warp w takes the
// k16 steps [s S, (s + 1) S), S = K / (16 KS), s = w % KS for KS k slices (8 for bf16_mma_kernel; 16 for the router
// whatever its warps: a second set of 16 takes the upper half of the token tiles, or idles in the GEMM when the CTA
// has one), of its CTA's row tile for its tokens: the A fragments come from a
// weight shuffled at load time (bf16_mma.shuffle_bf16_mma: each lane's 16-byte load per step is exactly its
// mma.m16n8k16 A fragment, with the k order permuted within each 32-k chunk, bf16_mma.fragment_sources), so that a
// lane's B fragments for a pair of steps are 8 consecutive elements of a token's x row: one 16-byte load. The slices'
// fp32 sums are added in slice order through shared memory and rounded to bf16 (the reference's F.linear output). The
// router stores them as fp32 in a logits workspace, then each CTA counts itself done on a counter (an acq_rel
// atomicInc that wraps back to 0 for the next launch); the last one reads every logit row (ld.global.cg: not from its
// L1) and routes, each of its W warps taking tokens w, w + W, ...: a logit becomes a 32-bit key (order-preserving
// bf16 bits, then the inverted id), each lane sorts its keys once, a round is one redux.sync and a pop. The alignment
// comes from per-expert token bitmasks (count = popc, rank = popc of the earlier tokens; deterministic, pair order
// kept within each expert) and a warp scan of the padded counts. With several token groups the routing may be split
// (route_cuda.route_split: from three groups): the last CTA of each group (its own counter, counter[1 + group]) routes the group's <= 8
// tokens on one warp each and writes them out, then counts itself done on counter[0]; the last of those reads every
// token's ids back, builds the bitmasks and aligns. At 32 tokens one CTA routing all of them took 8.4k-9.3k clocks on
// 32 warps (8 to a scheduler), more than half of the launch (H200, twenty-third and twenty-seventh sessions; 9.3k on
// an H100, thirty-eighth).

#include "mma_common.cuh"
#include "bf16_route.cuh"

namespace {

constexpr int kWarps = 8;                 // bf16_mma_kernel
constexpr int kRouteWarps = 16;           // moe_route_kernel: more warps for its last CTA's routing
constexpr int kRouteWarpsWide = 32;       // moe_route_kernel from 17 tokens: one or two tokens a routing warp
constexpr int kMaxT = 64;                 // tokens per launch (8 n8 tiles)
constexpr int kMaxExperts = 512;          // routed experts E (+ 1 shared); up to 16 per lane in a routing warp
constexpr int kMaxTopK = 16;

// ~14.9 KB. The partials take 8 KB per n8 token tile of a CTA: 8 KB with token groups (the default), up to 32 KB at
// 17-32 tokens in one group (VIBEQWEN_ROUTE_GROUPS=0: 47.7 KB in all, under the 48 KB a launch may use without the
// opt-in that launch_kernel makes only past 48 KB of dynamic shared memory; growing this struct past ~1.4 KB more
// needs that opt-in to count it) and 64 KB at 33-64 (opted in).
struct RouteSmem {                             // (the warps' partial sums: dynamic shared memory)
  unsigned long long tokens[kMaxExperts + 1];  // bit t: token t chose expert e
  int start[kMaxExperts + 1];                  // expert e's first position in sorted_ids
  int row_total[(kMaxExperts + 32) / 32];      // padded pairs of each row of 32 experts
  float tw[kMaxT * (kMaxTopK + 1)];            // the routing, pair p = t k' + s
  int tid[kMaxT * (kMaxTopK + 1)];
  int is_last;
};

// This lane's vectors of its warp's first two k16 steps, handed to tile_partials. With early launch (pdl 2: decode
// graphs, whose kernels never write weights) a kernel loads them before its PDL wait, so they stream while the
// previous kernel ends; otherwise after it (the previous kernel may have written the weights: load time).
template <int W>
__device__ __forceinline__ void first_steps(const uint4* __restrict__ wq, int K, int warp, int lane, uint4& f0,
                                            uint4& f1) {
  const uint4* p = wq + ((size_t)blockIdx.x * (K / 16) + (size_t)warp * (K / (16 * W))) * 32 + lane;
  f0 = load_stream(p);
  f1 = load_stream(p + 32);
}

// This CTA's 16-row tile against tokens 0..8 NT - 1 with GW = min(W, KS NT) of its W warps in KS k slices (GW / KS
// warps per slice, each taking NT KS / GW of the n8 token tiles; warps >= GW only meet the barrier): slice s = warp %
// KS sums its K range (K / KS, whole pairs of k16 steps) into red [KS][16 rows][8 NT tokens], then a barrier. Returns
// with red complete. The sums depend on KS only (not on W or NT): the same bits whatever the warps per slice and
// whichever tokens share the launch. f0, f1: from first_steps<KS> of the warp's slice.
template <int NT, int W, int KS>
__device__ __forceinline__ void tile_partials(const __nv_bfloat16* __restrict__ x, int x_stride, int T,
                                              const uint4* __restrict__ wq, int K, float* red, int warp, int lane,
                                              const uint4& f0, const uint4& f1) {
  constexpr int GW = W < KS * NT ? W : KS * NT;
  static_assert(W % KS == 0 && GW % KS == 0 && NT % (GW / KS) == 0, "whole token tiles per warp");
  constexpr int LD = 8 * NT, NTW = NT * KS / GW;  // token tiles per warp
  if (warp < GW) {
    const int g = lane >> 2, t = lane & 3, steps = K / (16 * KS), slice = warp % KS;
    const int tile0 = (warp / KS) * NTW, row0 = tile0 * 8;  // the warp's first token tile and row
    // rows past T read the warp's first row (never stored); a warp whose tiles are all past T reads x's row 0
    const bool any = row0 < T;
    float acc[NTW][4];
    // 8 warps: 4 pairs of steps in flight; 16 (128 registers a thread): 2; 32 (64 registers): 1, 2 for one tile
    gemm_tile<NTW, W <= 8 ? 4 : W <= 16 || NTW == 1 ? 2 : 1>(any ? x + (size_t)row0 * x_stride : x, x_stride,
                                                any ? T - row0 : 1, wq + (size_t)blockIdx.x * (K / 16) * 32, steps,
                                                slice * steps, lane, f0, f1, acc);
#pragma unroll
    for (int n = 0; n < NTW; ++n) {
      const int col = (tile0 + n) * 8 + 2 * t;
      float* r0 = red + (slice * 16 + g) * LD + col;
      float* r1 = r0 + 8 * LD;
      r0[0] = acc[n][0];
      r0[1] = acc[n][1];
      r1[0] = acc[n][2];
      r1[1] = acc[n][3];
    }
  }
  __syncthreads();
}

// Sum of the k slices' partials for (row, token), in slice order, rounded to bf16.
template <int NT, int W>
__device__ __forceinline__ __nv_bfloat16 tile_sum(const float* red, int row, int tok) {
  constexpr int LD = 8 * NT;
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) s += red[(w * 16 + row) * LD + tok];
  return __float2bfloat16(s);
}

template <int NT>
__global__ void __launch_bounds__(kWarps * 32, 1) bf16_mma_kernel(
    const __nv_bfloat16* __restrict__ x, int x_stride, int T, const uint4* __restrict__ wq, int K, int N,
    __nv_bfloat16* __restrict__ out, int out_stride, int pdl) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (pdl != 2) pdl_wait(pdl);  // see first_steps
  uint4 f0, f1;
  first_steps<kWarps>(wq, K, warp, lane, f0, f1);
  if (pdl == 2) pdl_wait(pdl);
  __shared__ float red[kWarps * 16 * 8 * NT];
  tile_partials<NT, kWarps, kWarps>(x, x_stride, T, wq, K, red, warp, lane, f0, f1);
  for (int i = threadIdx.x; i < 16 * T; i += kWarps * 32) {
    const int row = i & 15, tok = i >> 4, n = blockIdx.x * 16 + row;
    if (n < N) out[(size_t)tok * out_stride + n] = tile_sum<NT, kWarps>(red, row, tok);
  }
}

// Grid (tiles, groups): CTA (c, y) computes row tile c for tokens [8 NT y, 8 NT (y + 1)) (the launcher's NT and
// groups: one n8 token tile a CTA, ceil(T / 8) groups, or every token in one group); the last of all CTAs routes the
// T tokens with its W warps, TPW tokens each, or with split (and groups > 1) the last CTA of each group routes that
// group's tokens and the last of those aligns. BATCH: route_tokens' (every logit load of a lane before any use).
template <int NT, int EPL, int W, int TPW, bool BATCH = false>
__global__ void __launch_bounds__(W * 32, 1) moe_route_kernel(
    const __nv_bfloat16* __restrict__ x, int x_stride, int T, const uint4* __restrict__ wq, int K, int E,
    int top_k, float* __restrict__ logits, unsigned int* __restrict__ counter, float* __restrict__ topk_w,
    int* __restrict__ topk_ids, int* __restrict__ sorted_ids, int* __restrict__ block_expert,
    int* __restrict__ num_padded, int block_m, int p_max, int b_max, long long* __restrict__ dbg, int split,
    int pdl) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ncta = gridDim.x * gridDim.y, cta = blockIdx.y * gridDim.x + blockIdx.x;
  if (pdl != 2) pdl_wait(pdl);  // see first_steps
  uint4 f0, f1;
  first_steps<kRouteWarps>(wq, K, warp % kRouteWarps, lane, f0, f1);
  if (pdl == 2) pdl_wait(pdl);
  if (dbg != nullptr && threadIdx.x == 0) dbg[16 + cta] = globaltimer();
  __shared__ RouteSmem sm;
  extern __shared__ __align__(16) float red[];  // [16 k slices][16][8 NT]
  const int n_cols = E + 1, ld = gridDim.x * 16;  // logits row stride: the padded rows
  const int tok0 = blockIdx.y * 8 * NT, tn = min(T - tok0, 8 * NT);  // this CTA's tokens

  // ---- router GEMM: this CTA's 16 rows and tokens, in 16 k slices whatever W and NT (the same logits)
  tile_partials<NT, W, kRouteWarps>(x + (size_t)tok0 * x_stride, x_stride, tn, wq, K, red, warp, lane, f0, f1);
  for (int i = threadIdx.x; i < 16 * tn; i += W * 32) {
    const int row = i & 15, tok = i >> 4;
    logits[(size_t)(tok0 + tok) * ld + blockIdx.x * 16 + row] =
        __bfloat162float(tile_sum<NT, kRouteWarps>(red, row, tok));
  }

  // Work the last CTA's tail would otherwise wait for, done by every CTA before it counts itself done: its share of
  // the sentinels of sorted_ids / block_expert (the last CTA's placements overwrite some of them after the counter
  // orders them), and its own token bitmasks zeroed.
  const int kp = top_k + 1, n_pairs = T * kp;
  {
    const int share_p = (p_max + ncta - 1) / ncta, share_b = (b_max + ncta - 1) / ncta;
    for (int i = threadIdx.x; i < share_p; i += W * 32)
      if (cta * share_p + i < p_max) sorted_ids[cta * share_p + i] = n_pairs;
    for (int i = threadIdx.x; i < share_b; i += W * 32)
      if (cta * share_b + i < b_max) block_expert[cta * share_b + i] = -1;
    for (int e = threadIdx.x; e < n_cols; e += W * 32) sm.tokens[e] = 0ull;
  }

  // ---- the last CTA to finish routes and aligns. Release: the barrier orders every thread's logit (and sentinel)
  // stores before thread 0's acq_rel increment (cumulativity); acquire: the last CTA's increment, then the barrier.
  // With the split (several token groups), the last CTA of each group routes the group's tokens (one warp a token,
  // the routing written to topk_w / topk_ids) and counts itself done on counter[0]; the last of those aligns.
  const bool two_level = split != 0 && gridDim.y > 1;
  __syncthreads();
  if (dbg != nullptr && threadIdx.x == 0) dbg[16 + ncta + cta] = globaltimer();
  if (threadIdx.x == 0)
    sm.is_last = two_level ? atomic_inc_acq_rel(counter + 1 + blockIdx.y, gridDim.x - 1) == gridDim.x - 1
                           : atomic_inc_acq_rel(counter, ncta - 1) == ncta - 1;
  __syncthreads();
  if (!sm.is_last) return;
  long long t_route = 0, c_route = 0;  // the routing's start (stamped by the CTA that aligns)
  if (dbg != nullptr && threadIdx.x == 0) {
    t_route = globaltimer();
    c_route = clock64();
  }

  const int bm_shift = __ffs(block_m) - 1, bm_mask = block_m - 1;  // block_m: a power of two
  if (two_level) {
    // this group's tn tokens, warp w token tok0 + w (the same per-token routing: the same bits), straight to global
    if (warp < tn)
      route_tokens<1, EPL, BATCH>(LogitRows{logits + (size_t)tok0 * ld, nullptr, ld, 0u, false}, tn, E, top_k, warp,
                                  8, lane, topk_w + tok0 * kp, topk_ids + tok0 * kp, nullptr);
    // release this group's routing, as above; the last group's CTA acquires every group's
    __syncthreads();
    if (threadIdx.x == 0) sm.is_last = atomic_inc_acq_rel(counter, gridDim.y - 1) == gridDim.y - 1;
    __syncthreads();
    if (!sm.is_last) return;
    // every token's ids (other CTAs' stores: ld.global.cg) into shared memory and the expert token masks (zeroed by
    // this CTA above)
    for (int p = threadIdx.x; p < n_pairs; p += W * 32) {
      const int id = __ldcg(topk_ids + p);
      sm.tid[p] = id;
      atomicOr(&sm.tokens[id], 1ull << (p / kp));
    }
  } else {
    // routing into shared memory (the placements below read the ids there, not back from global memory)
    route_tokens<TPW, EPL, BATCH>(LogitRows{logits, nullptr, ld, 0u, false}, T, E, top_k, warp, W, lane, sm.tw,
                                  sm.tid, sm.tokens, dbg);
  }
  __syncthreads();
  if (dbg != nullptr && threadIdx.x == 0) {
    dbg[0] = t_route;
    dbg[8] = c_route;
    dbg[9] = clock64();
  }

  // ---- alignment. Expert e's pairs in pair order are its tokens in token order (a token's ids are distinct), so
  // count_e = popc(tokens_e) and pair (t, s) sits at start_e + popc(tokens_e & (2^t - 1)). The padded counts are
  // scanned in rows of 32 experts, a warp a row (a warp scan of the row, then of the row totals); then every pair
  // is placed and the routing copied out.
  const int rows = (n_cols + 31) / 32;
  for (int r = warp; r < rows; r += W) {
    const int e = 32 * r + lane;
    const int c = e < n_cols ? (__popcll(sm.tokens[e]) + bm_mask) & ~bm_mask : 0;
    const int incl = warp_inclusive_sum(c, lane);
    if (e < n_cols) sm.start[e] = incl - c;  // within the row, for now
    if (lane == 31) sm.row_total[r] = incl;
  }
  __syncthreads();
  for (int r = warp; r < rows; r += W) {
    const int v = lane < rows ? sm.row_total[lane] : 0;
    const int incl = warp_inclusive_sum(v, lane);
    const int base = __shfl_sync(0xffffffffu, incl - v, r);
    const int e = 32 * r + lane;
    if (e < n_cols) sm.start[e] += base;
    if (r == 0 && lane == 31) num_padded[0] = incl;
  }
  __syncthreads();
  if (dbg != nullptr && threadIdx.x == 0) dbg[11] = clock64();
  for (int p = threadIdx.x; p < n_pairs; p += W * 32) {
    const int tok = p / kp, id = sm.tid[p];
    sorted_ids[sm.start[id] + __popcll(sm.tokens[id] & ((1ull << tok) - 1ull))] = p;
    if (!two_level) {  // (the split's group routers wrote them)
      topk_w[p] = sm.tw[p];
      topk_ids[p] = id;
    }
  }
  for (int e = threadIdx.x; e < n_cols; e += W * 32) {
    const int b0 = sm.start[e] >> bm_shift, nb = (__popcll(sm.tokens[e]) + bm_mask) >> bm_shift;
    for (int b = 0; b < nb; ++b) block_expert[b0 + b] = e;
  }
  if (dbg != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
      dbg[12] = clock64();
      dbg[1] = globaltimer();
    }
  }
}

}  // namespace

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// x: bf16 [T, K] (row stride x_stride elements, 16-byte aligned rows), 1 <= T <= 64, K % 256 == 0; wq: a [N, K]
// weight shuffled (tiles = ceil(N / 16) row tiles; shuffle_bf16_mma); out: bf16 [T, N], row stride out_stride.
// Else cudaErrorInvalidValue.
extern "C" int vq_bf16_mma_launch(const void* x, int x_stride, int T, const void* wq, int tiles, int K, int N,
                                  void* out, int out_stride, int pdl, void* stream) {
  static int configured[4][64] = {{0}};
  if (T < 1 || T > kMaxT || K < 32 * kWarps || K % (32 * kWarps) || N < 1 || tiles * 16 < N || x_stride < K ||
      x_stride % 8 || out_stride < N)
    return (int)cudaErrorInvalidValue;
  const cudaStream_t st = (cudaStream_t)stream;
  const dim3 grid(tiles);
#define VQ_BF16_ARGS pdl, (const __nv_bfloat16*)x, x_stride, T, (const uint4*)wq, K, N, (__nv_bfloat16*)out, out_stride, pdl
  if (T <= 8) return launch_kernel(bf16_mma_kernel<1>, configured[0], grid, kWarps * 32, 0, st, VQ_BF16_ARGS);
  if (T <= 16) return launch_kernel(bf16_mma_kernel<2>, configured[1], grid, kWarps * 32, 0, st, VQ_BF16_ARGS);
  if (T <= 32) return launch_kernel(bf16_mma_kernel<4>, configured[2], grid, kWarps * 32, 0, st, VQ_BF16_ARGS);
  return launch_kernel(bf16_mma_kernel<8>, configured[3], grid, kWarps * 32, 0, st, VQ_BF16_ARGS);
#undef VQ_BF16_ARGS
}

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// x: bf16 [T, K] (row stride x_stride elements, 16-byte aligned rows), 1 <= T <= 64, K % 512 == 0; wq: the router
// weight [R, K] shuffled (R = 16 * tiles >= E + 1; shuffle_bf16_mma); logits: fp32 [T, R] workspace;
// counter: 1 + 8 unsigned ints, 0 before the first launch (every launch leaves them 0); outputs topk_w fp32 / topk_ids
// int32 [T, top_k + 1], sorted_ids int32 [p_max], block_expert int32 [b_max], num_padded int32 [1] (p_max, b_max:
// moe_align's bounds for T (top_k + 1) pairs, E + 1 experts, block_m); dbg: null, or int64 [16 + 2 * tiles * groups]
// phase timestamps for profiling (route_cuda.fused_route's debug); warps: 32 takes 32 warps from 17 tokens (one or
// two tokens per routing warp), anything else 16 (the same results bit for bit); groups: ceil(T / 8) for one n8
// token tile per CTA (a grid of tiles x groups CTAs), or 1 for every token in each of `tiles` CTAs (the same results
// bit for bit); split (with groups > 1): the last CTA of each token group routes that group's tokens (one warp a
// token) and the last of those aligns, instead of one CTA routing every token (the same results bit for bit);
// batch: 1 for the kernels whose routing lanes issue all of their logit loads before using any (route_tokens'
// BATCH; E <= 256 only, else ignored; the same results bit for bit). Else cudaErrorInvalidValue.
extern "C" int vq_moe_route_launch(const void* x, int x_stride, int T, const void* wq, int tiles, int K, int E,
                                   int top_k, float* logits, unsigned int* counter, float* topk_w, int* topk_ids,
                                   int* sorted_ids, int* block_expert, int* num_padded, int block_m, int p_max,
                                   int b_max, long long* dbg, int warps, int groups, int split, int batch,
                                   int pdl, void* stream) {
  if (T < 1 || T > kMaxT || K < 32 * kRouteWarps || K % (32 * kRouteWarps) || E < 1 || E > kMaxExperts ||
      tiles * 16 < E + 1 || top_k < 1 || top_k > kMaxTopK || top_k > E || block_m < 1 || (block_m & (block_m - 1)) ||
      x_stride < K || x_stride % 8 || (groups != 1 && groups != (T + 7) / 8))
    return (int)cudaErrorInvalidValue;
  const cudaStream_t st = (cudaStream_t)stream;
  const dim3 grid(tiles, groups);
#define VQ_ROUTE_ARGS                                                                                          \
  pdl, (const __nv_bfloat16*)x, x_stride, T, (const uint4*)wq, K, E, top_k, logits, counter, topk_w, topk_ids, \
      sorted_ids, block_expert, num_padded, block_m, p_max, b_max, dbg, split, pdl
  static int configured[2][16][64] = {{{0}}}, configured_batch[16][64] = {{0}};
  const int ei = E <= 256 ? 0 : 1;
  const bool batched = batch != 0 && ei == 0;
  // 17-64 tokens: twice the warps (one or two tokens per routing warp instead of two or four; the GEMM keeps its 16
  // k slices)
  const bool wide = warps == kRouteWarpsWide && T > 16;
  const bool one_tile = groups > 1 || T <= 8;  // one n8 token tile per CTA
#define VQ_ROUTE_K(NT, EPL, W, TPW, I)                                                                   \
  {                                                                                                      \
    if (TPW * W < T) return (int)cudaErrorInvalidValue; /* a routing warp for every token (a guard) */  \
    if (batched) /* (E <= 256: the 8-key kernels; the 16-key ones are not instantiated batched) */       \
      return launch_kernel(moe_route_kernel<NT, EPL, W, TPW, EPL == 8>, configured_batch[I], grid,       \
                           W * 32, kRouteWarps * 16 * 8 * NT * 4, st, VQ_ROUTE_ARGS);                    \
    return launch_kernel(moe_route_kernel<NT, EPL, W, TPW>, configured[ei][I], grid, W * 32,             \
                         kRouteWarps * 16 * 8 * NT * 4, st, VQ_ROUTE_ARGS);                              \
  }
  // (T bound, W, TPW) x NT: one tile, or the T bound's tiles (a block: the caller's `if` governs both)
#define VQ_ROUTE_W(NTB, EPL, W, TPW, I)         \
  {                                             \
    if (one_tile) VQ_ROUTE_K(1, EPL, W, TPW, I) \
    VQ_ROUTE_K(NTB, EPL, W, TPW, I + 1)         \
  }
#define VQ_ROUTE_T(EPL)                                          \
  if (T <= 16) VQ_ROUTE_W(2, EPL, kRouteWarps, 1, 0)             \
  if (T <= 32 && wide) VQ_ROUTE_W(4, EPL, kRouteWarpsWide, 1, 2) \
  if (T <= 32) VQ_ROUTE_W(4, EPL, kRouteWarps, 2, 4)             \
  if (wide) VQ_ROUTE_W(8, EPL, kRouteWarpsWide, 2, 6)            \
  VQ_ROUTE_W(8, EPL, kRouteWarps, 4, 8)
  if (ei == 0) {
    VQ_ROUTE_T(8)
  }
  VQ_ROUTE_T(16)
#undef VQ_ROUTE_T
#undef VQ_ROUTE_W
#undef VQ_ROUTE_K
#undef VQ_ROUTE_ARGS
}
