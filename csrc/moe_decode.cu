// The MoE block of a decode step (1-8 tokens) in one launch: router GEMM, top-k routing, the shared expert, the
// routed experts' gate|up GEMM with SiLU-and-mul, the down GEMM and the weighted sum over each token's k' = top_k + 1
// slots: what the four launches of the decode path compute (moe_route_kernel in bf16_mma.cu, the gate|up and down
// kernels of moe_mma.cu, the slot sum of kernels/moe/_fused_kernels.py), the routing bit for bit, the GEMMs' fp32
// sums in another order:
//
//   logits[t, e] = bf16(sum_k x[t, k] W_router[e, k])          (16 K ranges summed in order, as moe_route_kernel)
//   (ids, w)[t, s]: route_tokens (bf16_route.cuh); slot top_k = (the shared expert E, sigmoid(logits[t, E]))
//   h[p, j]      = bf16(silu(g) * u), g / u = the gate|up rows j / I + j of expert ids[p] against x[t(p)]
//                  (each the sum of four K quarters, in order)
//   y[p, n]      = sum over <= 2 pieces of (sum_j W_down[ids[p], n, j] h[p, j]) * gscale * 2^9   (fp32; the codes
//                  carry 2^-9)
//   out[t, n]    = bf16(sum_s fma(w[t, s], y[t k' + s, n], .))             (slots in order)
//
// Deterministic (no atomics in any sum). Host side: vibeqwen_kernels/moe/decode_cuda.py. Weights: moe_mma.cu's layout
// (gate|up rows interleaved per tile), the router shuffled by bf16_mma.shuffle_bf16_mma.
//
// Why: at batch 1 the four launches took ~28 us a layer on the H200 (route 7.5, gate|up 10, down 6.5, sum 3.9) for
// ~19 MB of weights (4.5 us of bandwidth): each is a short chain of dependent DRAM round trips with most SMs idle, and
// each phase's weights could only be requested once the previous launch had ended. Here every CTA requests its
// weights as soon as their address is known (the router's and the shared expert's before the PDL wait, the routed
// experts' gate|up and down right after routing), and the phases meet at two grid-wide barriers.
//
// Grid: one CTA per SM (all resident: the barriers spin), W = 16 warps in four quads of 4 (twice the warps an SM of
// the first version, for the latency-bound multiplies of one token), or 8 in two (decode_cuda.decode_warps). Phases:
// 0. Before the PDL wait: the shared expert's first chunks requested and, with hold (the default), the whole router
//    tile's weights loaded into registers. Then x staged in shared memory (B-fragment order, as moe_mma.cu stages a
//    block's columns; column t = token t, a zero column for the rest). CTA c < 17 computes router tile c (warp w: K
//    ranges w and w + 8 of the 16; at 16 warps range w), and the shared expert's 64 gate|up row tiles go to quads
//    (tile j: CTA (17 + j) % G). Barrier 1 (a CTA arrives once its logits are written and waits after its
//    shared-expert tiles, which only phase 3 reads; with shared_late, one token on 16 warps, quads 1-3 multiply
//    those tiles after the barrier, while warp 0 routes; the default). Each logit is stored as one 64-bit word with
//    the launch's tag (the barriers' generation at the start, plus one); with tagged (the default), there is no
//    barrier 1: the routing warps re-read each word until it carries the tag (one L2 round trip after the store
//    lands, where the barrier took an atomic, a generation store and its observation before the logits' own read).
//    The router CTAs may store up to 8 copies, CTA c reading copy c % copies: every CTA reads the same 2 KB a token
//    at once (copies spread those reads over more L2 lines; measured even on an H100, so 1 by default).
// 1. Every CTA routes all T tokens itself (warp t: token t) from the logits and lists the distinct routed experts
//    in id order (the shared expert last), with each (expert, token)'s pair index (one token, fast_list: the routing
//    warp ranks its own ids instead of the per-expert token masks).
// 2. The routed gate|up row tiles (64 per listed expert) are dealt to the grid's quads (tile i: CTA i % G, quad
//    (i / G) % (W / 4)). A quad's warp k multiplies K quarter k (8 chunks: a quarter of the dependent MMA chain a
//    whole-K warp runs); warp 0 adds the four quarters and stores h for the tile's pairs. A tile's 8 n8 columns are
//    the T tokens (columns of tokens that did not choose the expert are computed and dropped). Barrier 2 (h stored
//    with its launch's tag and waited for word by word instead measured slower twice on an H100, forty-eighth and
//    forty-ninth sessions: the early CTAs' polling slowed the others' weight streams; removed).
// 3. CTA c owns output row tile c of the down projection (c + G, ... if fewer than 128 CTAs): the tile's (D + 1) x 8
//    chunks (list entry-major) are split evenly over the W warps, each run cut into pieces at entry boundaries; each
//    piece's fp32 rows land in shared memory, and the CTA sums each token's slots (an entry's pieces in order).
// Every warp streams its pieces' codes and scales through one ring of R 640-byte chunk slots filled by cp.async
// (moe_mma_async_kernel's scheme: one commit group per ring step, so the wait is a constant); its down pieces'
// chunks are requested as its gate|up chunks are read (at one token all of them before the second barrier, from 16
// slots up).
//
// The grid barrier (grid_sync) is a self-resetting arrival counter (atom.inc wrapping at G - 1) and a generation
// word (grid_arrive / grid_wait: the same in two halves); a CTA that waits more than 2 s traps (a grid that cannot be
// co-resident must fail, not hang).

#include "mma_common.cuh"
#include "nvfp4_mma.cuh"
#include "bf16_route.cuh"

namespace {

constexpr int kH = 2048, kI = 512;      // hidden and intermediate sizes: the kernel is built for these only
constexpr int kGuChunks = kH / 64;      // 64-k chunks per gate|up row tile (its whole K range)
constexpr int kQuarter = kGuChunks / 4; // a quad warp's share of a gate|up tile
constexpr int kDownChunks = kI / 64;    // per down row tile and expert
constexpr int kGuTiles = 2 * kI / 16;   // gate|up row tiles per expert
constexpr int kDownTiles = kH / 16;     // down row tiles
// W warps a CTA (the kernel's template argument): 16 (decode_cuda.decode_warps' default) or 8; quads of 4 warps
template <int W>
struct Shape {
  static_assert(W == 8 || W == 16, "8 or 16 warps");
  static constexpr int kThreads = W * 32, kQuads = W / 4;
  // pieces of an entry's 8 down chunks in a row tile (the warps its run meets: kMinTopK keeps runs >= 8 / 4 chunks)
  static constexpr int kParts = W == 8 ? 2 : 3;
};
constexpr int kMaxT = 8;                // tokens: one n8 column tile
constexpr int kMaxE = 256;              // routed experts: 8 keys per routing lane
constexpr int kMaxTopK = 8;
constexpr int kMaxCopies = 8;           // copies of the logits (each read by every copies-th CTA)
// Phase 3 splits a down row tile's (D + 1) x 8 chunks over the W warps in runs of ceil((D + 1) 8 / W) and keeps a
// partial sum per piece of an entry (ys[pair][kParts]): an entry's 8 chunks must meet at most two warps (W = 8: runs
// of D + 1) or three (W = 16: runs of ceil((D + 1) / 2)), so D + 1 >= 8 distinct list entries, which top_k >= 7
// guarantees (D >= top_k). Fewer gave wrong sums (H200: top_k 1 and 4 against the separate launches).
constexpr int kMinTopK = 7;
constexpr int kMaxPairs = kMaxT * (kMaxTopK + 1);
constexpr int kMaxList = kMaxT * kMaxTopK + 1;   // distinct routed experts, then the shared one
constexpr int kMaxItems = 48;           // pieces in one warp's stream of a phase
constexpr int kRouteParts = 16;         // router K ranges (moe_route_kernel's 16 warps)
constexpr int kSlot = 640;              // ring slot: a chunk's 32 x 16 code bytes + 8 x 16 scale bytes
constexpr int kXStride = kH + 16;       // staged x column, bf16 (moe_mma.cu's padding: conflict-free reads)
constexpr int kHStride = kI + 16;       // staged h column
constexpr int kMinGrid = 100;           // fewer CTAs could overflow kMaxItems
constexpr int kRedBytes = kRouteParts * 16 * 8 * 4;            // router partials
// gate|up quarter sums: [quad][buffer][warp][lane] float4
template <int W>
constexpr int quad_bytes() { return Shape<W>::kQuads * 2 * 4 * 32 * 4 * 4; }

template <int W>
struct DecodeSmem {
  unsigned long long tokens[kMaxE + 1];   // bit t: token t chose expert e
  float tw[kMaxPairs];                    // routing weights, pair p = t k' + s
  int tid[kMaxPairs];                     // expert ids of the pairs
  int list[kMaxList];                     // expert of list entry d (routed in id order, then the shared one)
  short rank[kMaxE + 1];                  // list entry of expert e (the general listing path only)
  int pair_of[kMaxList][8];               // pair of (entry d, token column g), n_pairs for none
  int shared_pairs[8];                    // the shared expert's pairs per column (phase 0)
  int item_e[W][kMaxItems];               // each warp's stream: piece q = chunks [c0, c0 + n) of (expert, row tile)
  short item_tile[W][kMaxItems];
  uint32_t tag;                           // this launch's logit tag
  unsigned char item_c0[W][kMaxItems], item_n[W][kMaxItems], item_d[W][kMaxItems];
  float ys[kMaxPairs][Shape<W>::kParts][16];  // down outputs of the CTA's row tile per pair: its pieces' sums
  int n_list;
};

__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release(unsigned int* p, unsigned int v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// grid_sync in two halves: grid_arrive after this CTA's writes that other CTAs read past the barrier, grid_wait
// before reading theirs; in between the CTA may work on what nobody reads before the next barrier. The same
// release/acquire pair as grid_sync (the arrival's acq_rel increment after a CTA barrier; the generation's acquire
// load before one). Returns the generation to wait on (thread 0's; the others' is unused).
__device__ __forceinline__ unsigned int grid_arrive(unsigned int* sync) {
  __syncthreads();
  unsigned int gen = 0;
  if (threadIdx.x == 0) {
    gen = ld_acquire(sync + 1);
    if (atomic_inc_acq_rel(sync, gridDim.x - 1) == gridDim.x - 1) st_release(sync + 1, gen + 1);
  }
  return gen;
}

__device__ __forceinline__ void grid_wait(const unsigned int* sync, unsigned int gen) {
  if (threadIdx.x == 0) {
    const long long t0 = globaltimer();
    while (ld_acquire(sync + 1) == gen) {
      __nanosleep(20);
      if (globaltimer() - t0 > 2000000000ll) __trap();  // not co-resident: fail loudly
    }
  }
  __syncthreads();
}

// Every CTA of the grid arrives here before any leaves; memory written before it by any thread of the grid is
// visible after it to every thread (the barrier's release/acquire pair at GPU scope, cumulative through the CTA
// barriers). sync[0]: arrivals (back to 0 after the last), sync[1]: generation.
__device__ __forceinline__ void grid_sync(unsigned int* sync) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int gen = ld_acquire(sync + 1);
    if (atomic_inc_acq_rel(sync, gridDim.x - 1) == gridDim.x - 1) {
      st_release(sync + 1, gen + 1);
    } else {
      const long long t0 = globaltimer();
      while (ld_acquire(sync + 1) == gen) {
        __nanosleep(20);
        if (globaltimer() - t0 > 2000000000ll) __trap();  // not co-resident: fail loudly
      }
    }
  }
  __syncthreads();
}

// The 4 warps of quad q (warps 4q .. 4q + 3) meet here (named barrier 1 + q).
__device__ __forceinline__ void quad_sync(int q) { asm volatile("bar.sync %0, 128;" ::"r"(1 + q) : "memory"); }

// Elements kk .. kk + 7 of column col (kk a multiple of 8; v: their 16 bytes, in order) into xs in moe_mma.cu's
// B-fragment order (column stride STRIDE elements): kk = 16 s + 8 h, elements 2t, 2t+1 go to word 2 q + h of step s,
// quad q = t ^ ((s >> 2) & 3).
template <int STRIDE>
__device__ __forceinline__ void store_bfrag8(__nv_bfloat16* xs, int col, int kk, uint4 v) {
  const int st = kk >> 4, sw = (st >> 2) & 3;
  uint32_t* dst = reinterpret_cast<uint32_t*>(xs) + col * (STRIDE / 2) + st * 8 + ((kk >> 3) & 1);
  dst[2 * (0 ^ sw)] = v.x;
  dst[2 * (1 ^ sw)] = v.y;
  dst[2 * (2 ^ sw)] = v.z;
  dst[2 * (3 ^ sw)] = v.w;
}

// Rows [0, nrows) of src (row r at src + r * src_stride) into xs in moe_mma.cu's B-fragment order (column r, KLEN
// elements, column stride STRIDE), and a zero column nrows. cg: rows written by other CTAs of this grid (read
// through L2), else read-only rows (the non-coherent path). All NT threads; no barrier.
template <int KLEN, int STRIDE, bool CG, int NT>
__device__ __forceinline__ void stage_rows(__nv_bfloat16* xs, const __nv_bfloat16* src, long long src_stride,
                                           int nrows) {
  constexpr int V = KLEN / 8;  // 16-byte vectors per row
  constexpr int U = 4;         // vectors a thread loads before it stores any: U L2 round trips in flight, not one
  const int total = (nrows + 1) * V;
  for (int i0 = threadIdx.x; i0 < total; i0 += U * NT) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * NT, col = i / V, kk = (i % V) * 8;
      v[u] = make_uint4(0, 0, 0, 0);
      if (i < total && col < nrows) {
        const uint4* p = reinterpret_cast<const uint4*>(src + col * src_stride + kk);
        v[u] = CG ? __ldcg(p) : __ldg(p);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * NT, col = i / V, kk = (i % V) * 8;
      if (i >= total) break;
      store_bfrag8<STRIDE>(xs, col, kk, v[u]);
    }
  }
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One warp's stream of pieces (chunks [c0, c0 + n) of a row tile of an expert: the CTA's item_* rows for this warp;
// the first n_gu of the gate|up matrix, the rest of the down projection) through its ring of R slots: request()
// copies the next chunk not yet requested into its slot and commits one group (an empty one past the stream's end),
// so that chunk i is group i and is complete once at most R - 1 groups are pending.
template <int R>
struct Stream {
  const uint8_t *w13, *s13, *w2, *s2;
  const int* item_e;
  const short* item_tile;
  const unsigned char *item_c0, *item_n;
  const unsigned char* ring;  // this warp's ring (generic address)
  uint32_t ring_s;            // its shared address
  int n_items, n_gu, lane;
  int rq, rc, rn, rpos;       // request cursor: piece, chunk in it, its chunk count, ring position
  const uint8_t *rw, *rs;     // the piece's first chunk (this lane's code bytes, scale bytes)
  int pos;                    // consumer position

  __device__ __forceinline__ void request() {
    if (rq < n_items) {
      if (rc == 0) {
        const bool gu = rq < n_gu;
        const size_t chunk = gu ? ((size_t)item_e[rq] * kGuTiles + item_tile[rq]) * kGuChunks + item_c0[rq]
                                : ((size_t)item_e[rq] * kDownTiles + item_tile[rq]) * kDownChunks + item_c0[rq];
        rw = (gu ? w13 : w2) + chunk * 512 + lane * 16;
        rs = (gu ? s13 : s2) + chunk * 128 + lane * 16;
        rn = item_n[rq];
      }
      const uint32_t dst = ring_s + (rpos % R) * kSlot;
      cp_async16(dst + lane * 16, rw + rc * 512);
      if (lane < 8) cp_async16(dst + 512 + lane * 16, rs + rc * 128);
      if (++rc == rn) {
        rc = 0;
        ++rq;
      }
    }
    cp_async_commit();
    ++rpos;
  }

  // Starts a phase's stream of n pieces (the ring empty: every earlier group complete or empty).
  __device__ __forceinline__ void start(int n, int ngu) {
    n_items = n;
    n_gu = ngu;
    rq = rc = rpos = pos = 0;
    rn = 1;
#pragma unroll 1
    for (int i = 0; i < R; ++i) request();
  }

  // The next chunk's codes and scales (its group waited for), its slot refilled with the chunk R further on.
  __device__ __forceinline__ void next(uint4& wv, uint4& sv) {
    cp_async_wait<R - 1>();
    __syncwarp();
    const unsigned char* slot = ring + (pos % R) * kSlot;
    wv = *reinterpret_cast<const uint4*>(slot + lane * 16);
    sv = *reinterpret_cast<const uint4*>(slot + 512 + (lane >> 2) * 16);
    __syncwarp();
    request();
    ++pos;
  }
};

// The stream's next piece, chunks [c0, c0 + n) against the staged columns x0 (this lane's column), into acc (zeroed
// here).
template <int R>
__device__ __forceinline__ void piece_mma(Stream<R>& st, const uint2* x0, int t, int c0, int n, float (&acc)[4]) {
  float unused[4];
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll 4
  for (int i = 0; i < n; ++i) {
    uint4 wv, sv;
    st.next(wv, sv);
    const int cc = c0 + i;
    chunk_mma<false>(wv, sv, x0, x0, t, cc, cc & 3, acc, unused);
  }
}

// Gate|up tiles dealt to quads: this quad's pieces (one per tile, the warp's K quarter) of the tiles j = first,
// first + step, ... < count of expert list entry d(j) into the warp's item rows; returns how many.
template <int W>
__device__ __forceinline__ int gu_items(DecodeSmem<W>& sm, int warp, int lane, int first, int step, int count,
                                        const int* list, int fixed_e, int base_q) {
  const int n = first < count ? (count - 1 - first) / step + 1 : 0;
  for (int q = lane; q < n; q += 32) {
    const int j = first + step * q, d = j / kGuTiles;
    sm.item_d[warp][base_q + q] = (unsigned char)d;
    sm.item_e[warp][base_q + q] = fixed_e >= 0 ? fixed_e : list[d];
    sm.item_tile[warp][base_q + q] = (short)(j % kGuTiles);
    sm.item_c0[warp][base_q + q] = (unsigned char)((warp & 3) * kQuarter);
    sm.item_n[warp][base_q + q] = (unsigned char)kQuarter;
  }
  return n;
}

// The quad's gate|up pieces of the stream, finished: each warp's quarter sums into qred, then warp 0 of the quad adds
// the four in order and stores h = silu(gate) * up for the tile's pairs (pairs_of(q): the 8 columns' pair indices).
// early_scales: warp 0 of the quad requests the tile's two global scales before the piece's multiply (else after
// the quad's partials are added: an L2 round trip between the last piece and the grid barrier after it).
template <int R, int W>
__device__ __forceinline__ void gu_pieces(Stream<R>& st, DecodeSmem<W>& sm, float* qred, int n, const uint2* xcol,
                                          const float* gs13, int gs13_stride, __nv_bfloat16* hbuf, int n_pairs,
                                          int fixed_pairs_shared, int early_scales, int warp, int lane) {
  const int quad = warp >> 2, k = warp & 3, g = lane >> 2, t = lane & 3;
  constexpr int kEpi = kEpiInterleaved | kEpiSilu;
#pragma unroll 1
  for (int q = 0; q < n; ++q) {
    float2 gs_lo_hi = make_float2(0.f, 0.f);
    if (k == 0 && early_scales) {
      const int2 rows = tile_rows(kEpi, 2 * kI, sm.item_tile[warp][q], g);
      const float* gse = gs13 + (size_t)sm.item_e[warp][q] * gs13_stride;
      gs_lo_hi = make_float2(gse[rows.x], gse[rows.y]);
    }
    float acc[4];
    piece_mma<R>(st, xcol, t, sm.item_c0[warp][q], sm.item_n[warp][q], acc);
    float4* buf = reinterpret_cast<float4*>(qred) + ((quad * 2 + (q & 1)) * 4) * 32;
    buf[k * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    quad_sync(quad);
    if (k == 0) {
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float4 v = buf[w * 32 + lane];
        s[0] += v.x;
        s[1] += v.y;
        s[2] += v.z;
        s[3] += v.w;
      }
      const TileOut d = tile_out(reinterpret_cast<float*>(hbuf), 0, kI, n_pairs, gs13, gs13_stride, 0, kEpi, 2 * kI,
                                 sm.item_e[warp][q], sm.item_tile[warp][q], g, -1,
                                 early_scales ? &gs_lo_hi : nullptr);
      const int* pairs = fixed_pairs_shared ? sm.shared_pairs : sm.pair_of[sm.item_d[warp][q]];
      store_n8(d, s, pairs, t);
    }
  }
}

__device__ __forceinline__ void stamp(long long* dbg, int i) {
  if (dbg != nullptr && blockIdx.x == 0 && threadIdx.x == 0) dbg[i] = globaltimer();
}

template <int R, int W>
__global__ void __launch_bounds__(W * 32, 1) moe_decode_kernel(
    const __nv_bfloat16* __restrict__ x, int x_stride, int T, const uint4* __restrict__ router, int rtiles, int E,
    int top_k, const uint8_t* __restrict__ w13, const uint8_t* __restrict__ s13, const float* __restrict__ gs13,
    int gs13_stride, const uint8_t* __restrict__ w2, const uint8_t* __restrict__ s2, const float* __restrict__ gs2,
    int gs2_stride, unsigned long long* __restrict__ logits, __nv_bfloat16* __restrict__ hbuf,
    unsigned int* __restrict__ sync, __nv_bfloat16* __restrict__ out, int out_stride, float* __restrict__ topk_w,
    int* __restrict__ topk_ids, long long* __restrict__ dbg, int hold, int fast_list, int early_scales,
    int shared_late, int tagged, int copies, int pdl) {
  using Sh = Shape<W>;
  constexpr int kThreads = Sh::kThreads, kQuads = Sh::kQuads;
  __shared__ DecodeSmem<W> sm;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int c = blockIdx.x, G = gridDim.x, quad = warp >> 2;
  const int kp = top_k + 1, n_pairs = T * kp, ld = rtiles * 16;
  const unsigned below = (1u << lane) - 1u;
  unsigned char* ring = smem_raw + warp * R * kSlot;
  unsigned char* uni = smem_raw + W * R * kSlot;  // x columns + router and quad partials; later h columns
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(uni);
  float* red = reinterpret_cast<float*>(uni + (T + 1) * kXStride * 2);
  float* qred = reinterpret_cast<float*>(uni + (T + 1) * kXStride * 2 + kRedBytes);
  __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(uni);

  Stream<R> st;
  st.w13 = w13;
  st.s13 = s13;
  st.w2 = w2;
  st.s2 = s2;
  st.item_e = sm.item_e[warp];
  st.item_tile = sm.item_tile[warp];
  st.item_c0 = sm.item_c0[warp];
  st.item_n = sm.item_n[warp];
  st.ring = ring;
  st.ring_s = (uint32_t)__cvta_generic_to_shared(ring);
  st.lane = lane;

  if (pdl != 2) pdl_wait(pdl);  // with early launch (decode graphs: weights constant) the weights stream first
  stamp(dbg, 0);
  // ---- phase 0 requests: this warp's K quarter of the shared expert's gate|up tiles j dealt to its quad (CTA
  // (rtiles + j) % G, quad (j / G) % kQuads), the router tile's weights. late (shared_late, 16 warps, one token
  // with fast_list): the tiles go to quads 1-3 only (quad slot (j / G) % 3), which multiply them after barrier 1
  // (or where it would be) while warp 0 routes, instead of before the barrier (the same tiles and sums: the same h).
  const bool one = T == 1 && fast_list;
  const bool late = W == 16 && one && shared_late;
  const int squads = late ? kQuads - 1 : kQuads, squad = late ? quad - 1 : quad;  // quads taking shared tiles
  const int slot0 = (c - rtiles % G + G) % G + G * squad;                         // this quad's first tile
  const int n_shared = squad < 0 ? 0 : gu_items(sm, warp, lane, slot0, G * squads, kGuTiles, nullptr, E, 0);
  __syncwarp();
  st.start(n_shared, n_shared);
  constexpr int S = kH / (16 * kRouteParts);  // k16 steps per router K range
  // the router tile's weights: with hold, all of this warp's steps (64 KB a CTA; with early launch they stream while
  // the kernel ahead ends, and phase 0 waits only for x), else the first two of each K range (gemm_tile loads the
  // rest after the wait). Warp w takes the RPW K ranges w + W h.
  constexpr int RPW = kRouteParts / W;
  uint4 f[RPW][S];
  const uint4* rtile = router + (size_t)c * (kH / 16) * 32;
  if (c < rtiles) {
#pragma unroll
    for (int h = 0; h < RPW; ++h) {
      const uint4* p = rtile + (size_t)(warp + W * h) * S * 32 + lane;
#pragma unroll
      for (int s = 0; s < S; ++s)
        if (hold || s < 2) f[h][s] = load_stream(p + 32 * s);
    }
  }
  if (pdl == 2) pdl_wait(pdl);
  stamp(dbg, 1);
  // this launch's tag (its logits'): the grid barriers' generation at its start, plus one (it only changes once
  // every CTA has arrived at a barrier of this launch, which each does after this read; every launch passes barrier
  // 2, so no two launches on one workspace share a tag). Never 0, the tag of a zeroed word (the generation wraps
  // after 2^32 arrivals). The workspace's sync and logits are zeroed together or not at all.
  if (tid == 0) {
    const unsigned int tag = ld_acquire(sync + 1) + 1u;
    sm.tag = tag == 0u ? 1u : tag;
  }
  if (tid < 8) sm.shared_pairs[tid] = tid < T ? tid * kp + top_k : n_pairs;
  stage_rows<kH, kXStride, false, kThreads>(xs, x, x_stride, T);
  __syncthreads();
  const uint2* xcol = reinterpret_cast<const uint2*>(xs + (g < T ? g : T) * kXStride);

  // ---- phase 0: router tile c (16 rows, every token), shared-expert gate|up tiles -> h
  if (c < rtiles) {
#pragma unroll
    for (int h = 0; h < RPW; ++h) {
      const int part = warp + W * h;
      float acc[1][4];
      if (hold)
        gemm_tile_held<1, S>(x, x_stride, T, part * S, lane, f[h], acc);
      else
        gemm_tile<1, 2>(x, x_stride, T, rtile, S, part * S, lane, f[h][0], f[h][1], acc);
      float* r0 = red + (part * 16 + g) * 8 + 2 * t;
      r0[0] = acc[0][0];
      r0[1] = acc[0][1];
      r0[64] = acc[0][2];
      r0[65] = acc[0][3];
    }
    __syncthreads();
    if (tid < 16 * T) {
      const int row = tid & 15, tok = tid >> 4;
      float s = 0.f;
#pragma unroll
      for (int p = 0; p < kRouteParts; ++p) s += red[(p * 16 + row) * 8 + tok];
      const float v = __bfloat162float(__float2bfloat16(s));
      for (int k = 0; k < copies; ++k) st_tagged(logits + ((size_t)k * kMaxT + tok) * ld + c * 16 + row, v, sm.tag);
    }
  }
  // the logits are what the other CTAs read past barrier 1 (tagged: what their routing warps wait for, word by word,
  // with no barrier); the shared expert's h only past barrier 2, so its gate|up runs while the barrier completes
  // (late: while warp 0 routes)
  const unsigned int gen1 = tagged ? 0u : grid_arrive(sync);
  // pass 0 before the barrier's wait, pass 1 after it (late: quads 1-3 then, done before the CTA barrier that ends
  // routing); one call site, so the late path adds no registers to the kernel
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      stamp(dbg, 2);
      if (!tagged) grid_wait(sync, gen1);
      stamp(dbg, 3);
    }
    if (late ? pass == 1 && quad > 0 : pass == 0)
      gu_pieces<R, W>(st, sm, qred, n_shared, xcol, gs13, gs13_stride, hbuf, n_pairs, 1, early_scales, warp, lane);
  }

  // ---- phase 1: routing (every CTA, warp t: token t), the list of experts, the pairs of each entry
  const LogitRows src{nullptr, logits + (size_t)(c % copies) * kMaxT * ld, ld, sm.tag, tagged != 0};
  if (one) {
    // one token (fast_list): its top_k ids are distinct, so the list is them in id order (entry d = how many of the
    // ids are below it), then the shared expert; entry d's pair is the slot that chose it (token 0: pair = slot). The
    // same list and pairs as the general path below, without its token masks, ballots and three more CTA barriers.
    if (warp == 0) {
      // profiling: CTA 0's routing warp stamps its clock at dbg[16 + i] (route_tokens' [2] .. [5], then [6] listed)
      long long* rdbg = dbg != nullptr && c == 0 ? dbg + 16 : nullptr;
      if (rdbg != nullptr && lane == 0) rdbg[1] = clock64();
      route_tokens<1, 8>(src, T, E, top_k, 0, W, lane, sm.tw, sm.tid, nullptr, rdbg);
      __syncwarp();
      const int id = lane < top_k ? sm.tid[lane] : 0x7fffffff;
      int d = 0;
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) {  // unrolled: the shuffles issue back to back
        const int other = __shfl_sync(0xffffffffu, id, j);
        d += j < top_k && other < id;
      }
      if (rdbg != nullptr && lane == 0) stamp_after(rdbg, 6, d);
      if (lane < top_k) {
        sm.list[d] = id;
        sm.pair_of[d][0] = lane;
      }
    } else if (warp == 1) {  // what does not depend on the routing, off the routing warp's path
      if (lane == 0) {
        sm.list[top_k] = E;
        sm.pair_of[top_k][0] = top_k;
        sm.n_list = top_k;
      }
      for (int i = lane; i < (top_k + 1) * 7; i += 32) sm.pair_of[i / 7][1 + i % 7] = n_pairs;
    }
  } else {
    for (int e = tid; e <= E; e += kThreads) sm.tokens[e] = 0ull;
    __syncthreads();
    if (warp < T) route_tokens<1, 8>(src, T, E, top_k, warp, W, lane, sm.tw, sm.tid, sm.tokens);
  }
  __syncthreads();
  if (dbg != nullptr && c == 0 && tid == 0) dbg[16 + 7] = clock64();
  stamp(dbg, 8);
  if (c == 0 && topk_w != nullptr && tid < n_pairs) {
    topk_w[tid] = sm.tw[tid];
    topk_ids[tid] = sm.tid[tid];
  }
  if (!one) {  // the general path: the distinct experts from the token masks, then each pair's entry
    if (warp == 0) {
      int n = 0;
#pragma unroll 1
      for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        const bool used = e < E && sm.tokens[e] != 0ull;
        const unsigned m = __ballot_sync(0xffffffffu, used);
        if (used) {
          const int d = n + __popc(m & below);
          sm.list[d] = e;
          sm.rank[e] = (short)d;
        }
        n += __popc(m);
      }
      if (lane == 0) {
        sm.list[n] = E;
        sm.rank[E] = (short)n;
        sm.n_list = n;
      }
    }
    __syncthreads();
    for (int i = tid; i < (sm.n_list + 1) * 8; i += kThreads) sm.pair_of[i >> 3][i & 7] = n_pairs;
    __syncthreads();
    for (int p = tid; p < n_pairs; p += kThreads) sm.pair_of[sm.rank[sm.tid[p]]][p / kp] = p;
  }
  const int D = sm.n_list;
  stamp(dbg, 9);
  // this warp's phase-2 stream: its quarter of the gate|up tiles dealt to its quad (tile i of the D * 64 to quad
  // slot i: CTA i % G, quad (i / G) % kQuads), then its share of the CTA's down row tiles: the row tile's (D + 1) * 8
  // chunks (entry-major) in runs of ceil((D + 1) 8 / W) a warp, cut into pieces at entry boundaries (runs of >= 8
  // chunks at 8 warps, >= 4 at 16: an entry's 8 chunks meet at most kParts warps; the piece on the entry's p-th warp
  // is its part p, which holds the entry's chunks in order)
  const int n_gu = gu_items(sm, warp, lane, c + G * quad, G * kQuads, D * kGuTiles, sm.list, -1, 0);
  int n_items = n_gu;
  const int total = (D + 1) * kDownChunks, run = (total + W - 1) / W;  // D + 1 at 8 warps
  for (int rt = c; rt < kDownTiles; rt += G) {
    for (int f = warp * run, f1 = min(f + run, total); f < f1;) {
      const int d = f / kDownChunks, c0 = f % kDownChunks, n = min(kDownChunks - c0, f1 - f);
      if (n_items < kMaxItems && lane == 0) {
        sm.item_d[warp][n_items] = (unsigned char)d;
        sm.item_tile[warp][n_items] = (short)rt;
        sm.item_c0[warp][n_items] = (unsigned char)c0;
        sm.item_n[warp][n_items] = (unsigned char)n;
      }
      ++n_items;
      f += n;
    }
  }
  if (n_items > kMaxItems) __trap();  // the launcher's grid bound keeps this from happening
  __syncthreads();                    // pair_of complete; every warp done with its phase-0 pieces
  for (int q = n_gu + lane; q < n_items; q += 32) sm.item_e[warp][q] = sm.list[sm.item_d[warp][q]];
  __syncwarp();
  stamp(dbg, 10);
  st.start(n_items, n_gu);
  stamp(dbg, 4);

  // ---- phase 2: routed gate|up tiles -> h
  gu_pieces<R, W>(st, sm, qred, n_gu, xcol, gs13, gs13_stride, hbuf, n_pairs, 0, early_scales, warp, lane);
  stamp(dbg, 5);
  grid_sync(sync);
  stamp(dbg, 6);

  // ---- phase 3: h columns (every pair, then a zero column), the CTA's down row tiles, the slot sums
  stage_rows<kI, kHStride, true, kThreads>(hs, hbuf, kI, n_pairs);
  for (int i = tid; i < n_pairs * 16 * (Sh::kParts - 1); i += kThreads) {
    const int pair = i / (16 * (Sh::kParts - 1)), r = i % (16 * (Sh::kParts - 1));
    sm.ys[pair][1 + r / 16][r % 16] = 0.f;
  }
  __syncthreads();
  int q = n_gu;
#pragma unroll 1
  for (int rt = c; rt < kDownTiles; rt += G) {
#pragma unroll 1
    for (; q < n_items && sm.item_tile[warp][q] == rt; ++q) {
      const int d = sm.item_d[warp][q], e = sm.item_e[warp][q], c0 = sm.item_c0[warp][q];
      const int* pairs = sm.pair_of[d];
      const float a_lo = gs2[(size_t)e * gs2_stride + rt * 16 + g] * 512.f;
      const float a_hi = gs2[(size_t)e * gs2_stride + rt * 16 + g + 8] * 512.f;
      const uint2* hcol = reinterpret_cast<const uint2*>(hs + pairs[g] * kHStride);
      float acc[4];
      piece_mma<R>(st, hcol, t, c0, sm.item_n[warp][q], acc);
      const int part = warp - d * kDownChunks / run;  // 0 or 1 at 8 warps: c0 > 0
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int pair = pairs[2 * t + cc];
        if (pair < n_pairs) {
          sm.ys[pair][part][g] = acc[cc] * a_lo;
          sm.ys[pair][part][g + 8] = acc[2 + cc] * a_hi;
        }
      }
    }
    __syncthreads();
    if (tid < 16 * T) {
      const int row = tid & 15, tok = tid >> 4;
      float s = 0.f;
      for (int slot = 0; slot < kp; ++slot) {
        const int p = tok * kp + slot;
        float y = sm.ys[p][0][row] + sm.ys[p][1][row];
        if (Sh::kParts > 2) y += sm.ys[p][2][row];
        s = __fmaf_rn(sm.tw[p], y, s);
#pragma unroll
        for (int part = 1; part < Sh::kParts; ++part) sm.ys[p][part][row] = 0.f;  // for the next row tile (a part
                                                                                  // not written stays zero)
      }
      out[(size_t)tok * out_stride + rt * 16 + row] = __float2bfloat16_rn(s);
    }
    __syncthreads();
  }
  stamp(dbg, 7);
  if (dbg != nullptr && tid == 0) dbg[32 + c] = globaltimer();
}

// Ring slots per warp: the launch's ring, 8, 16 or 32 (32 up to 4 tokens, where the h columns leave room; 16
// above). H200, T = 1 (twenty-seventh session): 16 slots against 32 took the kernel alone from
// 22.3 to 21.1 us (two machine starts) and the decode step b1 from 2.050 to 2.004 ms (one engine): with 32, every
// warp's first 32 requests (all of its gate|up and down chunks) were issued before its first multiply (2.6 us of
// requests against 1.4).
// 16 warps take 8 slots whatever the ring (the same 80 KB of rings a CTA as 8 warps of 16).
__host__ __device__ constexpr int ring_slots(int T, int ring, int warps = 8) {
  return warps == 16 || ring == 8 ? 8 : ring == 32 && T <= 4 ? 32 : 16;
}

int smem_bytes(int T, int top_k, int R, int W) {
  const int quad = W == 16 ? quad_bytes<16>() : quad_bytes<8>();
  const int xs = (T + 1) * kXStride * 2 + kRedBytes + quad;
  const int hs = (T * (top_k + 1) + 1) * kHStride * 2;
  return W * R * kSlot + (xs > hs ? xs : hs);
}

// CTAs of moe_decode_kernel<R, W> per SM at smem bytes, after raising its shared-memory limit to its largest launch
// (T = 4 for 32 slots, else 8 tokens; top_k 8), never to this launch's: launch_kernel raises the limit only past what
// it set itself, so lowering it here after a larger launch made that launch size fail with cudaErrorInvalidValue (seen
// when a new T was asked for after T = 8 ran). 0 on an error.
template <int R, int W>
int ctas_per_sm(int smem) {
  int occ = 0;
  cudaError_t err = cudaFuncSetAttribute(moe_decode_kernel<R, W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         smem_bytes(R == 32 ? 4 : kMaxT, kMaxTopK, R, W));
  if (err == cudaSuccess)
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, moe_decode_kernel<R, W>, W * 32, smem);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return occ;
}

}  // namespace

extern "C" int vq_moe_decode_smem_bytes(int T, int top_k, int ring, int warps) {
  const bool ok = T >= 1 && T <= kMaxT && top_k >= kMinTopK && top_k <= kMaxTopK &&
                  (ring == 8 || ring == 16 || ring == 32) && (warps == 8 || warps == 16);
  return ok ? smem_bytes(T, top_k, ring_slots(T, ring, warps), warps) : 0;
}

// The grid the launch uses on the current device: one CTA per SM where that many are co-resident with the launch's
// shared memory, else 0 (the kernel cannot run there; also when fewer than 64 SMs).
extern "C" int vq_moe_decode_grid(int T, int top_k, int ring, int warps) {
  const int smem = vq_moe_decode_smem_bytes(T, top_k, ring, warps);
  int dev = 0, sms = 0;
  if (smem == 0 || cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const int R = ring_slots(T, ring, warps);
  const int occ = warps == 16 ? ctas_per_sm<8, 16>(smem)
                  : R == 32   ? ctas_per_sm<32, 8>(smem)
                  : R == 8    ? ctas_per_sm<8, 8>(smem)
                              : ctas_per_sm<16, 8>(smem);
  return occ >= 1 && sms >= kMinGrid ? sms : 0;
}

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`). x: bf16 [T, H] (row
// stride x_stride elements, 16-byte aligned rows), 1 <= T <= 8; router: the router and shared-gate rows shuffled
// (shuffle_bf16_mma; rtiles 16-row tiles, rtiles * 16 >= E + 1, K = H); 1 <= E <= 256 routed experts, 7 <= top_k <=
// min(8, E) (kMinTopK); w13 / s13: the E + 1 experts' gate|up codes and scales (moe_mma.cu's layout, halves
// interleaved), gs13 fp32 [E + 1, 2I] (row stride gs13_stride); w2 / s2 / gs2 the down projection's ([E + 1, H]); H ==
// 2048 and I == 512 (else cudaErrorInvalidValue). Workspaces: logits 64-bit words [copies, 8, 16 rtiles] (a logit's
// fp32 bits and its launch's tag: st_tagged; 0 before the first launch), hbuf bf16 [8 (top_k + 1), I], sync: two
// unsigned ints, 0 before the first launch (every launch leaves sync[0] 0; launches sharing them must not run
// concurrently). out: bf16 [T, H] (row stride out_stride). topk_w fp32 / topk_ids int32 [T, top_k + 1]: the routing,
// written when topk_w is not null; dbg: null, or int64 [32 + grid] timestamps (profiling: decode_cuda.moe_decode's
// debug). hold: 1 to load the router tile's weights whole before the PDL wait (into registers), 0 for its first two k16
// steps of each K range only (the same logits either way). ring: the ring slots per warp (ring_slots: 8, 16 or 32; the
// same results). warps: 8 or 16 a CTA (16: 8 ring slots; the down rows' fp32 sums in up to three pieces instead of two,
// so other roundings than 8 warps'). grid: vq_moe_decode_grid's value for the same T, top_k, ring and warps (> 0).
// fast_list: 1 to list a single token's experts from its own ids (T = 1), 0 for the general path (the same lists).
// early_scales: 1 to request each gate|up tile's global scales before its multiply (gu_pieces), 0 after it (the same
// results). shared_late: 1 for the shared expert's gate|up on quads 1-3 while warp 0 routes (after barrier 1 or where
// it would be), where the launch has 16 warps, one token and fast_list (elsewhere ignored; the same results). tagged: 1
// for no barrier 1 (the routing warps wait for each logit's tag instead), 0 for the barrier (the same results). copies:
// 1 to kMaxCopies copies of the logits, CTA c reading copy c % copies (the same values: fewer CTAs reading each L2
// line). pdl as the other launchers (mma_common.cuh: pdl_wait).
extern "C" int vq_moe_decode_launch(const void* x, int x_stride, int T, const void* router, int rtiles, int E,
                                    int top_k, const void* w13, const void* s13, const float* gs13, int gs13_stride,
                                    const void* w2, const void* s2, const float* gs2, int gs2_stride, int H, int I,
                                    void* logits, void* hbuf, unsigned int* sync, void* out, int out_stride,
                                    float* topk_w, int* topk_ids, long long* dbg, int hold, int ring, int warps,
                                    int grid, int fast_list, int early_scales, int shared_late, int tagged,
                                    int copies, int pdl, void* stream) {
  if (T < 1 || T > kMaxT || E < 1 || E > kMaxE || rtiles * 16 < E + 1 || top_k < kMinTopK || top_k > kMaxTopK ||
      top_k > E || H != kH || I != kI || x_stride < H || x_stride % 8 || out_stride < H || grid < kMinGrid ||
      (topk_w == nullptr) != (topk_ids == nullptr) || copies < 1 || copies > kMaxCopies ||
      vq_moe_decode_smem_bytes(T, top_k, ring, warps) == 0)
    return (int)cudaErrorInvalidValue;
  const int smem = vq_moe_decode_smem_bytes(T, top_k, ring, warps);
  const cudaStream_t st = (cudaStream_t)stream;
#define VQ_DECODE_ARGS                                                                                              \
  pdl, (const __nv_bfloat16*)x, x_stride, T, (const uint4*)router, rtiles, E, top_k, (const uint8_t*)w13,          \
      (const uint8_t*)s13, gs13, gs13_stride, (const uint8_t*)w2, (const uint8_t*)s2, gs2, gs2_stride,             \
      (unsigned long long*)logits, (__nv_bfloat16*)hbuf, sync, (__nv_bfloat16*)out, out_stride, topk_w, topk_ids,  \
      dbg, hold, fast_list, early_scales, shared_late, tagged, copies, pdl
  static int configured32[64] = {0}, configured16[64] = {0}, configured8[64] = {0}, configured_w16[64] = {0};
  const int R = ring_slots(T, ring, warps);
  if (warps == 16)
    return launch_kernel(moe_decode_kernel<8, 16>, configured_w16, dim3(grid), 16 * 32, smem, st, VQ_DECODE_ARGS);
  if (R == 32)
    return launch_kernel(moe_decode_kernel<32, 8>, configured32, dim3(grid), 8 * 32, smem, st, VQ_DECODE_ARGS);
  if (R == 8)
    return launch_kernel(moe_decode_kernel<8, 8>, configured8, dim3(grid), 8 * 32, smem, st, VQ_DECODE_ARGS);
  return launch_kernel(moe_decode_kernel<16, 8>, configured16, dim3(grid), 8 * 32, smem, st, VQ_DECODE_ARGS);
#undef VQ_DECODE_ARGS
}
