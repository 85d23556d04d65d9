// NVFP4 expert GEMMs on the tensor cores (sm_90: the dequantizer's mul.bf16x2 needs it; written for the H200):
// decode-sized batches (blocks of 16 pairs) and prefill-sized ones (blocks of 32 or 64 pairs).
//
// out[s, pair, n] = sum over k in split s of W[e, n, k] * x[pair / x_row_div, k]   (fp32 partials)
// for the pairs of the expert blocks that moe_align made (block_pairs = its block_m pairs per block, sentinel
// n_pairs for padding), expert e = block_expert[block]. With apply_alpha the per-row global scale times 2^9 is
// applied (down projection); without it the raw sums carry the 2^-9 of the dequantization (split-K gate/up,
// whose finishing kernel applies the scales). The other epilogue (see tile_out): h = silu(gate) * up in bf16
// for the unsplit gate/up GEMM. Host side: vibeqwen_kernels/moe/mma_cuda.py.
//
// Why not Triton: Triton's Hopper path gives the register-A wgmma a 64x16x16 tile and waits for each one
// to finish before dequantizing the next, and reads the codes two bytes at a time from shared memory; on
// the H200 the MoE kernels moved ~1 TB/s. Here the codes are shuffled at load time so that one 16-byte
// load per lane holds, for 4 consecutive k16 steps, exactly the 8 codes of the lane's mma.m16n8k16 A
// fragment per step; they go from registers to the tensor cores without touching shared memory.
//
// Four GEMM kernels, one dequantizer and one weight layout (a warp = one 16-row tile at a time); all but the async
// one stream the codes through register groups of 4 64-k chunks prefetched one group ahead; the fourth,
// moe_wgmma_kernel, is described at its definition (and a fifth, moe_mlp_kernel, runs both expert GEMMs of the
// 16-pair blocks with the SiLU between them in one launch: see its section):
// * moe_mma_kernel<1 | 2> (16 pairs, decode): 4 warps of 1 or 2 row tiles each; the split's whole K range of x
//   staged once per CTA in B-fragment order (one 64-bit shared read per n8 half and k16 step), two n8 halves.
// * moe_mma_async_kernel<PER, RT> (16 pairs, decode): the same blocks and x layout (all 16 columns staged:
//   stage_columns_all) with 8 warps of RT row tiles each whose codes come through per-warp cp.async rings in shared
//   memory instead of register groups (mma_cuda.decode_kernel picks the kernel per GEMM).
// * moe_mma_large_kernel<32 | 64> (prefill): 8 warps (128 rows per CTA: half the x re-reads from L2 per weight
//   byte of 4 warps); each dequantized A fragment goes into every n8 tile of the block that holds a real pair
//   (up to 8 accumulators of 4 fp32). x is staged per 256-k piece (one register group) with cp.async into
//   two buffers [pairs][256 + 8] bf16 (the next piece lands while this one is multiplied; one barrier per
//   piece), read with ldmatrix.x4 (one n8 tile, two k16 steps). Staging the whole K range would take 64 x 2048
//   x 2 = 256 KB at 64 pairs; bounding it by split-K instead would multiply the fp32 partials written and
//   read back (37.7 MB per split for gate/up at T = 1024).
//
// Layouts (made by shuffle_mma_weights in mma_cuda.py), per expert e, 16-row tile T, 64-k chunk C:
//   codes  uint8 [E, N/16, K/64, 32 lanes, 4 steps, 4 bytes]: lane (g = lane/4, t = lane%4), step j: one
//          32-bit word with the 8 E2M1 codes of the lane's A fragment, A register r (row 16T + g + 8 (r & 1),
//          k = 64C + 16j + 8 (r >> 1) + 2t + q for its halves q = 0, 1), each code's 4 bits where dequant8
//          takes them from (mma_cuda.code_bit_positions lists them).
//   scales bf16 [E, N/16, K/64, 8 (g), 4 steps, 2 (h)]: the block scale of row 16T + g + 8h for the 16 k of
//          step j, times 2^117 (exact: e4m3 values fit bf16); 4 lanes of a quad read the same 16 bytes (one
//          transaction), and step j's word [row g | row g + 8] goes straight into mul.bf16x2 through the .H0_H0 /
//          .H1_H1 operand selectors (no table, no byte extraction; twice the e4m3 bytes: +11% of the weights').
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (bf16).

#include "mma_common.cuh"
#include "nvfp4_mma.cuh"

namespace {

constexpr int kWarps = 4;          // one 16-row tile per warp: 64 output rows per CTA
constexpr int kBlockPairs = 16;    // pairs per expert block (moe_align's block_m), two n8 halves
constexpr int kGroup = 4;          // 64-k chunks per register group (prefetched one group ahead)

// The codes and scales of one register group: kGroup 64-k chunks from chunk c of the split (wp / sp: the
// lane's first chunk; 32 code vectors and 8 scale vectors per chunk).
__device__ __forceinline__ void load_group(const uint4* wp, const uint4* sp, int c, uint4 (&wv)[kGroup],
                                           uint4 (&sv)[kGroup]) {
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    wv[i] = load_stream(wp + (c + i) * 32);
    sv[i] = __ldg(sp + (c + i) * 8);
  }
}

// One register group (kGroup 64-k chunks starting at chunk c of the split, c % kGroup == 0) into the accumulators.
template <bool kTwo>
__device__ __forceinline__ void group_mma(const uint4 (&wv)[kGroup], const uint4 (&sv)[kGroup], const uint2* x0,
                                          const uint2* x1, int t, int c, float (&acc0)[4], float (&acc1)[4]) {
#pragma unroll
  for (int i = 0; i < kGroup; ++i) chunk_mma<kTwo>(wv[i], sv[i], x0, x1, t, c + i, i, acc0, acc1);
}

// The K loop of one warp: the next register group's loads are in flight while this one is dequantized and
// multiplied; during the last group, the first group of the warp's next row tile (next_wp / next_sp), if any.
template <bool kTwo>
__device__ __forceinline__ void main_loop(const uint4* wp, const uint4* sp, uint4 (&wv)[kGroup], uint4 (&sv)[kGroup],
                                          const uint2* x0, const uint2* x1, int t, int per, float (&acc0)[4],
                                          float (&acc1)[4], const uint4* next_wp, const uint4* next_sp) {
  int c = 0;
  for (;; c += kGroup) {
    const bool last = c + kGroup >= per;
    if (last && next_wp == nullptr) break;
    uint4 nv[kGroup];
    uint4 ns[kGroup];
    if (last)
      load_group(next_wp, next_sp, 0, nv, ns);
    else
      load_group(wp, sp, c + kGroup, nv, ns);
    group_mma<kTwo>(wv, sv, x0, x1, t, c, acc0, acc1);
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      wv[i] = nv[i];
      sv[i] = ns[i];
    }
    if (last) return;
  }
  group_mma<kTwo>(wv, sv, x0, x1, t, c, acc0, acc1);
}

// A 16-pair block's two n8 accumulator halves to their pairs (block_ids: the block's 16 sorted pair ids); the
// second half only when the block has pairs there.
__device__ __forceinline__ void store_halves(const TileOut& d, const float (&acc0)[4], const float (&acc1)[4],
                                             bool second_half, const int* block_ids, int t) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (half == 1 && !second_half) break;
    store_n8(d, half ? acc1 : acc0, block_ids + half * 8, t);
  }
}

// One staged 16-byte vector: x elements k .. k + 7 (kk = k - k0 = 16 s + 8 h) of column col in B-fragment order:
// elements 2t, 2t+1 of the 8 go to word 2 q + h of step s, quad q = t ^ ((s >> 2) & 3) (the swizzle spreads these
// stores over all banks; chunk_mma reads quad t ^ (cc & 3)).
__device__ __forceinline__ void store_staged(__nv_bfloat16* xs, int xs_stride, int col, int kk, const uint4& v) {
  const int st = kk >> 4, sw = (st >> 2) & 3;
  uint32_t* dst = reinterpret_cast<uint32_t*>(xs) + col * (xs_stride / 2) + st * 8 + ((kk >> 3) & 1);
  dst[2 * (0 ^ sw)] = v.x;
  dst[2 * (1 ^ sw)] = v.y;
  dst[2 * (2 ^ sw)] = v.z;
  dst[2 * (3 ^ sw)] = v.w;
}

// Block blk's x columns (its 16 pairs: sorted_ids[16 blk ...]) for the split's K range [k0, k0 + krange) into xs
// (bf16, column stride xs_stride) in B-fragment order, by the CTA's THREADS threads; both barriers inside (on
// return xs is complete). Only the n8 halves that hold real pairs are staged (moe_align fills a block from its
// start: 8 columns when the block has up to 8 pairs, the 16 used to be staged always), padding columns in them as
// zeros; the other half's shared memory keeps whatever it held (its sums are neither computed nor stored: kTwo).
// pair: sorted_ids[16 blk + tid], read by the caller for tid < 16 (early: it does not depend on the block's
// expert). xrow, ncols: shared memory for each column's x row offset (elements, k0 included, -1 for padding;
// computed once per column, not once per staged vector) and the staged columns' count. The ncols x krange / 8
// 16-byte vectors are spread over all threads, up to BATCH loads each in flight before their stores (2: the caller
// holds a register group meanwhile; moe_mma_kernel<1> spills 64 bytes at its 80 registers, 32 before this staging,
// BATCH 1 the same; not timed at the token counts that run it, 8-28).
template <int THREADS, int BATCH>
__device__ __forceinline__ void stage_columns(__nv_bfloat16* xs, long long* xrow, int* ncols_s,
                                              const __nv_bfloat16* x, int x_row_div, int x_stride, int pair,
                                              int n_pairs, int k0, int krange, int xs_stride, int tid) {
  if (tid < 32) {
    const bool real = tid < kBlockPairs && pair < n_pairs;
    if (tid < kBlockPairs) xrow[tid] = real ? (long long)(pair / x_row_div) * x_stride + k0 : -1;
    const uint32_t m = __ballot_sync(0xffffffffu, real);
    if (tid == 0) *ncols_s = ((32 - __clz(m)) + 7) & ~7;  // the last real column + 1 (a prefix), to whole n8 halves
  }
  __syncthreads();
  const int nv = krange >> 3, total = *ncols_s * nv;  // 16-byte vectors per column, in all
  constexpr int kBatch = BATCH;
  for (int v0 = tid; v0 < total; v0 += kBatch * THREADS) {
    uint4 val[kBatch];
    int col[kBatch], kk[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = v0 + i * THREADS;
      col[i] = v / nv;
      kk[i] = (v - col[i] * nv) * 8;
      const long long row = v < total ? xrow[col[i]] : -1;  // -1: past the end, or padding (zeros)
      val[i] = row >= 0 ? __ldg(reinterpret_cast<const uint4*>(x + row + kk[i])) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (v0 + i * THREADS >= total) break;
      store_staged(xs, xs_stride, col[i], kk[i], val[i]);
    }
  }
  __syncthreads();
}

// The same staging as stage_columns, all NCOL columns whatever the block's pairs (padding columns zeroed; pair: the
// caller's column tid's sorted id for tid < NCOL), by threads
// tid < krange / 8: thread tid stages the 16-byte vectors at k = 8 tid, 8 (tid + THREADS), ... of all NCOL columns
// (their loads unrolled: 8 in flight). The cp.async kernel stages this way: with stage_columns (fewer columns, every
// thread) it measured slower on the H200 (gate|up at T = 32 in 2 splits, async2: 63.7 -> 66.1 / 66.3 us, two
// machines), while the register kernels gained (down at T = 32, regs2: 42.3 -> 38.5 / 39.0 us).
template <int THREADS, int NCOL = kBlockPairs>
__device__ __forceinline__ void stage_columns_all(__nv_bfloat16* xs, long long* xrow, const __nv_bfloat16* x,
                                                  int x_row_div, int x_stride, int pair, int n_pairs, int k0,
                                                  int krange, int xs_stride, int tid) {
  if (tid < NCOL) xrow[tid] = pair < n_pairs ? (long long)(pair / x_row_div) * x_stride + k0 : -1;
  __syncthreads();
  for (int kk = tid * 8; kk < krange; kk += THREADS * 8) {
#pragma unroll 8
    for (int col = 0; col < NCOL; ++col) {
      const long long row = xrow[col];
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row >= 0) v = __ldg(reinterpret_cast<const uint4*>(x + row + kk));
      store_staged(xs, xs_stride, col, kk, v);
    }
  }
  __syncthreads();
}

// This lane's codes and scales of the split's first chunk of row tile `tile` of expert e (tile 0 for a tile past
// the matrix: such a warp multiplies valid memory and stores nothing).
__device__ __forceinline__ void tile_ptrs(const uint8_t* w, const uint8_t* s, int e, int tile, int ntiles, int kchunks,
                                          int c0, const uint4*& wp, const uint4*& sp) {
  const int lane = threadIdx.x & 31;
  const size_t base = ((size_t)e * ntiles + (tile < ntiles ? tile : 0)) * kchunks + c0;
  wp = reinterpret_cast<const uint4*>(w + base * 512) + lane;
  sp = reinterpret_cast<const uint4*>(s + base * 128) + (lane >> 2);
}

// RT: row tiles per warp (the CTA's 4 warps take tiles y * 4 RT + warp, + 4, ...: 64 RT rows): the block's x is
// staged once for all of them, and a tile's first register group loads during the previous tile's last.
template <int RT>
__global__ void __launch_bounds__(kWarps * 32, RT == 1 ? 6 : 5) moe_mma_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w,
    const uint8_t* __restrict__ s, const float* __restrict__ gs, int gs_stride_e, float* __restrict__ out,
    long long out_stride_s, int out_stride_p, const int* __restrict__ sorted_ids,
    const int* __restrict__ block_expert, int n_pairs, int N, int K, int split, int apply_alpha, int epi, int pdl) {
  pdl_wait(pdl);
  __shared__ long long xrow[kBlockPairs];  // element offset of each column's x row, -1 for padding
  __shared__ int ncols;                    // staged columns: the real pairs rounded up to whole n8 halves
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);

  const int blk = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int pair = tid < kBlockPairs ? sorted_ids[blk * kBlockPairs + tid] : 0;  // requested with the expert id
  const int e = block_expert[blk];
  if (e < 0) return;
  const int kchunks = K / 64, per = kchunks / split, c0 = blockIdx.z * per;
  const int krange = per * 64, k0 = c0 * 64;
  // x staged in B-fragment order: per column and k16 step s, lane quad t holds (2t, 2t+1, 2t+8, 2t+9) in 8
  // bytes (one 64-bit read per step, quads swizzled, see below); +16 elements per column keep the reads of
  // the 8 columns free of bank conflicts
  const int xs_stride = krange + 16;
  int tile = blockIdx.y * kWarps * RT + warp;
  const int ntiles = N / 16;

  const uint4 *wp, *sp;
  tile_ptrs(w, s, e, tile, ntiles, kchunks, c0, wp, sp);

  // first register group in flight before the x tile is staged
  uint4 wv[kGroup];
  uint4 sv[kGroup];
  load_group(wp, sp, 0, wv, sv);

  stage_columns<kWarps * 32, 2>(xs, xrow, &ncols, x, x_row_div, x_stride, pair, n_pairs, k0, krange, xs_stride, tid);
  const bool second_half = sorted_ids[blk * kBlockPairs + 8] < n_pairs;  // warp-uniform
  const uint2* x0 = reinterpret_cast<const uint2*>(xs + g * xs_stride);
  const uint2* x1 = reinterpret_cast<const uint2*>(xs + (g + 8) * xs_stride);

#pragma unroll 1
  for (int r = 0; r < RT; ++r, tile += kWarps) {
    if (tile >= ntiles) return;  // later tiles are further out
    const uint4 *next_wp = nullptr, *next_sp = nullptr;
    if (r + 1 < RT && tile + kWarps < ntiles) tile_ptrs(w, s, e, tile + kWarps, ntiles, kchunks, c0, next_wp, next_sp);
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    // two copies of the main loop: blocks with pairs in both n8 halves (rare in decode) and the rest, so the
    // common case issues no predicated-off instructions for the second half
    if (second_half)
      main_loop<true>(wp, sp, wv, sv, x0, x1, t, per, acc0, acc1, next_wp, next_sp);
    else
      main_loop<false>(wp, sp, wv, sv, x0, x1, t, per, acc0, acc1, next_wp, next_sp);

    // the scales read here, not ahead as in the cp.async kernels: RT = 1 is at its 80-register bound (6 CTAs an
    // SM) and already spills; reading them ahead added 16 bytes of spill stores there (ptxas -v)
    const TileOut d =
        tile_out(out, out_stride_s, out_stride_p, n_pairs, gs, gs_stride_e, apply_alpha, epi, N, e, tile, g);
    store_halves(d, acc0, acc1, second_half, sorted_ids + blk * kBlockPairs, t);
    wp = next_wp;
    sp = next_sp;
  }
}


// moe_mma_persist_kernel<RT>: moe_mma_kernel<RT>'s sums (the same products in the same order: the same bits) from a
// grid of resident CTAs (the launcher's: SMs x CTAs per SM) instead of one CTA per (block, 64 RT rows, split). The
// items (block, split z, row group y) of the real blocks (block_expert >= 0, a prefix: counted by every CTA) are
// dealt to the CTAs in contiguous ranges of equal length, ordered block, z, y, so a CTA stages a block's x once for
// its consecutive items of that block (a barrier and a new staging only where the block or split changes), and
// each warp's weight stream runs on across items: the first register group of its next tile, the next item's
// included, is loaded during the last group of the current one. Aims at what one CTA per item leaves on the table
// at 8-64 tokens: every CTA's prologue (its expert id, pair ids, x staging and two barriers, during which its warps
// have one register group in flight and no other work) and the gap between a CTA's last loads and its successor's
// first, on ~4 waves of short CTAs (the down GEMM at 32 tokens: 2592 CTAs of 36 KB). Measured slower on the H200
// (twenty-fourth session: down at 32 tokens 40.9 us against regs2's 39.5; decode b32 8.447 ms with it for the down
// GEMM against 8.152-8.169), so the rule (mma_cuda.decode_kernel) does not pick it: VIBEQWEN_MOE_DECODE_KERNEL=regs2p
// or VIBEQWEN_MOE_PERSIST=1 for comparison.
template <int RT>
__global__ void __launch_bounds__(kWarps * 32, RT == 1 ? 6 : 5) moe_mma_persist_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w,
    const uint8_t* __restrict__ s, const float* __restrict__ gs, int gs_stride_e, float* __restrict__ out,
    long long out_stride_s, int out_stride_p, const int* __restrict__ sorted_ids,
    const int* __restrict__ block_expert, int n_blocks, int n_pairs, int N, int K, int split, int apply_alpha,
    int epi, int pdl) {
  pdl_wait(pdl);
  __shared__ long long xrow[kBlockPairs];
  __shared__ int ncols;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // the real blocks: moe_align fills them from the start, -1 after
  int nb = 0;
  for (int b0 = 0; b0 < n_blocks; b0 += kWarps * 32) {
    const int b = b0 + tid;
    nb += __syncthreads_count(b < n_blocks && block_expert[b] >= 0);
  }
  const int ntiles = N / 16, kchunks = K / 64, per = kchunks / split;
  const int krange = per * 64, xs_stride = krange + 16;
  const int ny = (ntiles + kWarps * RT - 1) / (kWarps * RT), per_blk = ny * split;
  const long long total = (long long)nb * per_blk;
  const int i0 = (int)(total * blockIdx.x / gridDim.x), i1 = (int)(total * (blockIdx.x + 1) / gridDim.x);
  if (i0 >= i1) return;  // CTA-uniform

  int blk = i0 / per_blk, z = (i0 - blk * per_blk) / ny, y = i0 - blk * per_blk - z * ny;
  int e = block_expert[blk];
  const uint4 *wp, *sp;
  tile_ptrs(w, s, e, y * kWarps * RT + warp, ntiles, kchunks, z * per, wp, sp);
  uint4 wv[kGroup], sv[kGroup];
  load_group(wp, sp, 0, wv, sv);  // in flight during the counting's loads and the first staging
  int staged_blk = -1, staged_z = -1;

#pragma unroll 1
  for (int it = i0; it < i1; ++it) {
    // the next item, and its expert (read now: needed by the last tile's prefetch)
    int nblk = blk, nz = z, nyy = y + 1, ne = e;
    if (nyy == ny) {
      nyy = 0;
      if (++nz == split) {
        nz = 0;
        ++nblk;
        if (it + 1 < i1) ne = block_expert[nblk];
      }
    }
    if (blk != staged_blk || z != staged_z) {  // CTA-uniform
      if (staged_blk >= 0) __syncthreads();  // every warp is done with the old x
      const int pair = tid < kBlockPairs ? sorted_ids[blk * kBlockPairs + tid] : 0;
      stage_columns<kWarps * 32, 2>(xs, xrow, &ncols, x, x_row_div, x_stride, pair, n_pairs, z * krange, krange,
                                    xs_stride, tid);
      staged_blk = blk;
      staged_z = z;
    }
    const bool second_half = sorted_ids[blk * kBlockPairs + 8] < n_pairs;  // warp-uniform
    const uint2* x0 = reinterpret_cast<const uint2*>(xs + g * xs_stride);
    const uint2* x1 = reinterpret_cast<const uint2*>(xs + (g + 8) * xs_stride);
#pragma unroll 1
    for (int r = 0; r < RT; ++r) {
      const int tile = y * kWarps * RT + warp + kWarps * r;
      // the tile after this one: the item's next, or the next item's first for this warp
      const uint4 *next_wp = nullptr, *next_sp = nullptr;
      const bool more_here = r + 1 < RT && tile + kWarps < ntiles;
      if (more_here)
        tile_ptrs(w, s, e, tile + kWarps, ntiles, kchunks, z * per, next_wp, next_sp);
      else if (it + 1 < i1)
        tile_ptrs(w, s, ne, nyy * kWarps * RT + warp, ntiles, kchunks, nz * per, next_wp, next_sp);
      if (tile < ntiles) {
        float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
        if (second_half)
          main_loop<true>(wp, sp, wv, sv, x0, x1, t, per, acc0, acc1, next_wp, next_sp);
        else
          main_loop<false>(wp, sp, wv, sv, x0, x1, t, per, acc0, acc1, next_wp, next_sp);
        const TileOut d = tile_out(out, out_stride_s, out_stride_p, n_pairs, gs, gs_stride_e, apply_alpha, epi, N, e,
                                   tile, g, z);
        store_halves(d, acc0, acc1, second_half, sorted_ids + blk * kBlockPairs, t);
      } else if (next_wp != nullptr) {
        load_group(next_wp, next_sp, 0, wv, sv);  // no tile here: straight to the next one's first group
      }
      wp = next_wp;
      sp = next_sp;
      if (!more_here) break;
    }
    blk = nblk;
    z = nz;
    y = nyy;
    e = ne;
  }
}

// ------------------------------------------------------------------ 16 pairs per block, weights via cp.async
//
// moe_mma_async_kernel<PER, RT>: the 16-pair blocks, x layout, dequantizer and epilogue of moe_mma_kernel, with 8
// warps (RT row tiles each: tiles y * 8 RT + warp, + 8, ...; 128 RT rows per CTA sharing the staged x) whose weight
// streams (RT tiles x PER 64-k chunks: the split's K range per tile) go through a per-warp shared-memory ring of
// R = min(PER, kAsyncRing) chunks filled by cp.async, 4 chunks a ring step (STEP; 1 with VIBEQWEN_MOE_RING_STEP=1).
// The first R chunks are requested before the block's x is staged and a step's slots are refilled as soon as they are
// read, across the warp's tiles (the next tile's first chunks land while this one's last are multiplied): 5 KB per
// warp in flight from the CTA's start to its last R chunks, and no registers held for prefetching beyond the step
// being multiplied (70-80 registers, no spill). Same products in the same order as moe_mma_kernel: the same sums bit
// for bit.
// H200, model shapes, per GEMM (us; moe_mma_kernel / this with RT 1): gate|up unsplit (PER 32) at T = 8 36.4 /
// 25.9, T = 32 90.4 / 63.6, T = 64 124.1 / 84.9 (3.4 TB/s); the down projection (PER 8) with RT 1 is slower here
// (T = 32 41.2 with two row tiles per warp of moe_mma_kernel, 47.5 here): a CTA of one short tile per warp
// requests its whole stream at once and then has nothing in flight. RT 2 and 4 keep the ring full across tiles
// and halve / quarter the CTAs (and their x staging); the host picks per GEMM (mma_cuda.decode_kernel).
// Ring slot (640 bytes): the chunk's 32 lanes' 16-byte code vectors, then its 8 scale vectors (a ring step copies 4
// chunks, the 32 scale vectors one per lane; read by the 4 lanes of quad g: hence __syncwarp between a copy's
// completion and the reads). Requesting 4 chunks a step (one wait, one commit and no lane branch per 4 chunks) took
// the PER 16 RT 2 kernel from 3704 to 3128 instructions (sm_90a SASS). H200 (twenty-sixth session), us, step 4 / 1:
// gate|up in 2 splits at T = 32 61.5 / 64.9 (async2), unsplit at T = 8 24.2 / 24.8; decode b16 5.80 / 6.00 ms.
constexpr int kAsyncWarps = 8;   // warps per CTA (one row tile each at a time)
constexpr int kAsyncRing = 8;    // chunks per warp in flight
constexpr int kAsyncSlot = 640;  // bytes per ring slot: 32 x 16 code bytes + 8 x 16 scale bytes

// Wait until at most n of this thread's cp.async groups are pending (n < kAsyncRing; a constant once unrolled).
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::: "memory"); break;
  }
}

// A warp's weight stream: chunk i is chunk i % PER of its row tile i / PER (tile r sits r * tile_step chunks after
// tile 0's first chunk); nt tiles in all. The stream is requested STEP chunks at a time (one ring step; 4, or 1 with
// the measuring switch: PER and R are multiples of it, so a step never straddles two tiles), and every ring step
// commits one cp.async group (empty past the stream's end), so ring step q is always group q and waiting for it is
// waiting until R / STEP - 1 groups are pending.
struct AsyncStream {
  const uint8_t* wsrc;  // this lane's 16 code bytes of tile 0's first chunk
  const uint8_t* ssrc;  // 16 scale bytes of tile 0's first chunks: lane l's are scale vector l % 8 of chunk l / 8
  size_t tile_step;     // chunks from one of the warp's row tiles to its next
  uint32_t ring_s;      // shared address of the warp's ring
  int nt, lane;
};

// Chunks off .. off + STEP - 1 of a lane's weight stream (w / s: its code bytes / the scale bytes of chunk 0) into
// ring slots slot .. slot + STEP - 1 of the warp's ring at shared address ring_s. STEP 4: each lane copies its 16
// code bytes of the 4 chunks and one of their 32 scale vectors (5 cp.async, no branch on the lane: the codes of
// consecutive chunks are 512 bytes apart, their scales 128, so 16 l bytes past the first chunk's scales is scale
// vector l % 8 of chunk l / 8). STEP 1 (the measuring switch): the lane's code vector, and lanes 0-7 the 8 scale
// vectors.
template <int STEP>
__device__ __forceinline__ void ring_copy(uint32_t ring_s, int slot, int lane, const uint8_t* w, const uint8_t* s,
                                          size_t off) {
  const uint32_t dst = ring_s + slot * kAsyncSlot;
#pragma unroll
  for (int j = 0; j < STEP; ++j) cp_async16(dst + j * kAsyncSlot + lane * 16, w + (off + j) * 512);
  if (STEP == 4)
    cp_async16(dst + (lane >> 3) * kAsyncSlot + 512 + (lane & 7) * 16, s + off * 128);
  else if (lane < 8)
    cp_async16(dst + 512 + lane * 16, s + off * 128);
}

// The STEP chunks at stream positions pos .. pos + STEP - 1 from their ring slots ((pos + j) % R) into registers: the
// lane's code vector and its quad's scale vector of each (__syncwarp before and after: the copies a lane waited for
// are other lanes' too, and the slots are refilled next).
template <int STEP, int R>
__device__ __forceinline__ void ring_read(const unsigned char* ring, int pos, int lane, uint4 (&wv)[STEP],
                                          uint4 (&sv)[STEP]) {
  __syncwarp();
#pragma unroll
  for (int j = 0; j < STEP; ++j) {
    const unsigned char* slot = ring + (pos % R + j) * kAsyncSlot;  // pos % STEP == 0 and STEP | R: no wrap
    wv[j] = *reinterpret_cast<const uint4*>(slot + lane * 16);
    sv[j] = *reinterpret_cast<const uint4*>(slot + 512 + (lane >> 2) * 16);
  }
  __syncwarp();
}

// Stream chunks cc .. cc + STEP - 1 of tile r into ring slots slot .. slot + STEP - 1, then commit a group (empty when
// r >= nt).
template <int STEP>
__device__ __forceinline__ void async_request(const AsyncStream& st, int r, int cc, int slot) {
  if (r < st.nt) ring_copy<STEP>(st.ring_s, slot, st.lane, st.wsrc, st.ssrc, (size_t)r * st.tile_step + cc);
  cp_async_commit();
}

// Row tile r of the warp's stream into the accumulators, STEP chunks (one ring step) at a time: once the step's
// group has landed its chunks are read from their slots (chunk cc: slot cc % R, R divides PER), the slots are
// refilled with the stream's chunks R further on (this tile's or the next's), then the chunks are multiplied.
template <int PER, bool kTwo, int STEP>
__device__ __forceinline__ void async_tile(const AsyncStream& st, int r, const unsigned char* ring, const uint2* x0,
                                           const uint2* x1, int t, float (&acc0)[4], float (&acc1)[4]) {
  constexpr int R = PER < kAsyncRing ? PER : kAsyncRing;
  static_assert(PER % STEP == 0 && R % STEP == 0, "whole ring steps");
#pragma unroll
  for (int cs = 0; cs < PER; cs += STEP) {
    cp_async_wait_pending(R / STEP - 1);
    uint4 wv[STEP], sv[STEP];
    ring_read<STEP, R>(ring, cs, st.lane, wv, sv);
    async_request<STEP>(st, r + (cs + R) / PER, (cs + R) % PER, cs % R);
#pragma unroll
    for (int j = 0; j < STEP; ++j) chunk_mma<kTwo>(wv[j], sv[j], x0, x1, t, cs + j, (cs + j) & 3, acc0, acc1);
  }
}

template <int PER, int RT, int STEP>
__global__ void __launch_bounds__(kAsyncWarps * 32, 3) moe_mma_async_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w,
    const uint8_t* __restrict__ s, const float* __restrict__ gs, int gs_stride_e, float* __restrict__ out,
    long long out_stride_s, int out_stride_p, const int* __restrict__ sorted_ids,
    const int* __restrict__ block_expert, int n_pairs, int N, int K, int split, int apply_alpha, int epi, int pdl) {
  pdl_wait(pdl);
  constexpr int R = PER < kAsyncRing ? PER : kAsyncRing;
  __shared__ long long xrow[kBlockPairs];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int blk = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int pair = tid < kBlockPairs ? sorted_ids[blk * kBlockPairs + tid] : 0;  // requested with the expert id
  const int e = block_expert[blk];
  if (e < 0) return;
  const int kchunks = K / 64, c0 = blockIdx.z * PER;
  constexpr int krange = PER * 64;
  const int k0 = c0 * 64;
  constexpr int xs_stride = krange + 16;
  const int tile0 = blockIdx.y * kAsyncWarps * RT + warp;
  const int ntiles = N / 16;
  AsyncStream st;
  // this warp's tiles: tile0 + 8 r for r < nt (none when tile0 is past the matrix)
  st.nt = tile0 < ntiles ? min(RT, (ntiles - tile0 + kAsyncWarps - 1) / kAsyncWarps) : 0;
  const size_t base = ((size_t)e * ntiles + (st.nt ? tile0 : 0)) * kchunks + c0;
  st.wsrc = w + base * 512 + lane * 16;
  st.ssrc = s + base * 128 + lane * 16;
  st.tile_step = (size_t)kAsyncWarps * kchunks;
  st.lane = lane;
  unsigned char* ring = smem_raw + kBlockPairs * xs_stride * 2 + warp * R * kAsyncSlot;
  st.ring_s = (uint32_t)__cvta_generic_to_shared(ring);
#pragma unroll
  for (int c = 0; c < R; c += STEP) async_request<STEP>(st, 0, c, c);
  stage_columns_all<kAsyncWarps * 32>(xs, xrow, x, x_row_div, x_stride, pair, n_pairs, k0, krange, xs_stride, tid);
  if (st.nt == 0) return;
  const bool second_half = sorted_ids[blk * kBlockPairs + 8] < n_pairs;
  const uint2* x0 = reinterpret_cast<const uint2*>(xs + g * xs_stride);
  const uint2* x1 = reinterpret_cast<const uint2*>(xs + (g + 8) * xs_stride);
#pragma unroll 1
  for (int r = 0; r < st.nt; ++r) {
    const int tile = tile0 + r * kAsyncWarps;
    const float2 gs_tile = tile_scales(gs, gs_stride_e, apply_alpha, epi, N, e, tile, g);  // in flight during the loop
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    if (second_half)
      async_tile<PER, true, STEP>(st, r, ring, x0, x1, t, acc0, acc1);
    else
      async_tile<PER, false, STEP>(st, r, ring, x0, x1, t, acc0, acc1);
    const TileOut d = tile_out(out, out_stride_s, out_stride_p, n_pairs, gs, gs_stride_e, apply_alpha, epi, N, e,
                               tile, g, -1, &gs_tile);
    store_halves(d, acc0, acc1, second_half, sorted_ids + blk * kBlockPairs, t);
  }
}

// ------------------------------------------------------------- 16 pairs per block: gate|up, SiLU and down in one
//
// moe_mlp_kernel<S, COLS>: a decode step's expert MLP for the 16-pair blocks in one launch. A CTA takes COLS pairs of
// one block (16: the whole block, both n8 halves; 8: one n8 half, the grid's z, a CTA whose half holds no pair exits
// at once) and slice j of the I = 512 intermediate rows (S slices, the grid's y): it computes h = silu(gate) * up of
// those pairs over the slice, keeps it in shared memory, and multiplies the down weight's K range of that slice into
// fp32 partials out[j, pair, n] (the per-row global scale * 2^9 applied), which the slot sum adds in slice order. It
// replaces the gate|up launch (with a K split at 32 tokens, plus the SiLU-mul launch that finishes it) and the down
// launch: h never leaves the SM, the down weights stream in behind the gate|up weights of the same warp (requested
// while its last gate|up chunks are multiplied, before h exists), and the down GEMM has no launch, prologue or x
// staging of its own. The sums are the same as those launches' with gate|up unsplit and the down GEMM in S splits
// (SPLIT_K1 = 1, SPLIT_K2 = S): the same products in the same order, so the same bits.
//
// 8 warps (kMlpWarps). Each warp's weight stream runs through a per-warp cp.async ring of kAsyncRing 640-byte slots
// (576-byte slots and a 512-byte conversion buffer with E4, the e4m3 block scales), 4 chunks a step
// (moe_mma_async_kernel's ring): first its gate|up row tiles (j * 64 / S + warp + 8 r: each the 32
// chunks of K = 2048), then its down row tiles (warp + 8 r of 128, each the slice's 8 / S chunks). The CTA's x columns
// are staged for the whole K once (stage_columns_all), h replaces them after a CTA barrier (rows of I / S + 16 bf16
// per pair, in the B-fragment order chunk_mma reads). Shared memory: 66 KB of x at 16 columns (2 CTAs per SM with the
// 40 KB of rings), 33 KB at 8 (3 CTAs per SM where the registers allow: 80 at S = 2, 90 at S = 1). The half is the
// grid's slowest dimension, so the 8-column grid's second halves, mostly empty, are scheduled last. The host picks
// the shape by the waves of a 16-column grid (mma_cuda.mlp_cta).
constexpr int kMlpWarps = 8;
constexpr int kMlpH = 2048, kMlpI = 512;            // the model's hidden and expert intermediate sizes
constexpr int kMlpGuTiles = 2 * kMlpI / 16;         // interleaved gate|up row tiles (64)
constexpr int kMlpDnTiles = kMlpH / 16;             // down row tiles (128)
constexpr int kMlpGuChunks = kMlpH / 64;            // 64-k chunks of a gate|up row (32)
constexpr int kMlpDnChunks = kMlpI / 64;            // 64-k chunks of a down row (8)

// A warp's weight stream, one ring step of 4 chunks at a time: CPT = 4 / G consecutive 64-k chunks of each of a group
// of G of its row tiles (tiles of a warp: warp + 8 r; G = 1, 2 or 4, mma_cuda.mlp_group), whose x or h fragments the
// step then reads once for the G. Gate|up first: group q's GSG = 32 / CPT steps cover tiles G q .. G q + G - 1;
// then the down tiles, GSD = PD / CPT steps a group (PD: the slice's 4 or 8 chunks of a tile). Each tile's chunks
// still go into its accumulators in k order, so the sums are those of a tile at a time. Slot i CPT + d of a step
// holds chunk d of the group's tile i. A lane copies 4 x 16 code bytes of slot l / 8's chunk (bytes 16 (l % 8) +
// 128 m: each copy instruction reads 4 whole 128-byte runs) and one 16-byte scale vector (bf16: vector l % 8 of slot
// l / 8's; e4m3: lanes 0-15, bytes 16 (l % 4) of slot l / 4's 64), so the lane's own offsets to its chunk sit in
// w / s: a step within a group is an add of CPT chunks, a group to the next an add of G tiles less the group's
// chunks, and the switch to the down tiles loads dw / ds (a request computes no address). H100 (forty-fifth
// session), decode ms a step with G 4 for the 16-column CTA against 1: b16 5.816 / 5.795 against 5.886 / 5.891, b48
// 11.390 / 11.388 against 11.485 / 11.486; the 8-column CTA (3 an SM, 80 registers) ran its T = 24 / 32 launches
// 3-4% slower with G 2 or 4, so it keeps 1.
struct MlpStream {
  const uint8_t *w, *s;    // this lane's code / scale bytes of the next request (step next)
  const uint8_t *dw, *ds;  // the same of the first down step (NG)
  uint32_t ring_w, ring_sc;  // shared addresses of this lane's code / scale bytes in the warp's ring slot 0
  int next;
};

// E4 (e4m3 block scales, mma_cuda.mlp_e4m3): a chunk's 64 scale bytes follow its codes in a 576-byte slot
// (kSlotE4).
constexpr int kSlotE4 = 512 + 64;

// A warp's stream at S slices of I with G tiles a ring step (4 / G = CPT consecutive chunks of each): steps of a
// gate|up group (GSG) and of a down group (GSD), of all gate|up (NG) and in all (N).
template <int S, int G>
struct MlpSteps {
  static_assert(G == 1 || G == 2 || G == 4, "1, 2 or 4 tiles a step");
  static constexpr int GT = kMlpGuTiles / S / kMlpWarps;  // gate|up tiles per warp (4 or 8)
  static constexpr int DT = kMlpDnTiles / kMlpWarps;      // down tiles per warp (16)
  static constexpr int PD = kMlpDnChunks / S;             // down chunks per tile and slice (4 or 8)
  static constexpr int CPT = 4 / G;                       // chunks of a tile per step
  static constexpr int GSG = kMlpGuChunks / CPT, GSD = PD / CPT;
  static constexpr int NG = GT / G * GSG, N = NG + DT / G * GSD;
};

// Step st.next -> ring slots slot .. slot + 3, then commit a group (empty past the stream's end), and st moves on to
// the next step. PF (mma_cuda.mlp_prefetch: the 16-column CTA's by default): then the 128-byte lines of that next
// step are prefetched into L2 (prefetch.global.L2: the chunks' codes by lanes 0, 8, 16, 24, four lines each; their
// scales by the lanes whose scale offset is 0), so that each warp has three ring steps of DRAM reads in flight
// instead of two without more shared memory (a 12-slot ring costs the 8-column CTA its third CTA an SM). Written for
// the H200, where the expert MLP streams at ~75% of the copy rate against ~88% on the H100 (forty-third and
// thirty-ninth sessions); on an H100 the 16-column CTA's decode steps ran 0.4-0.8% faster with it and the 8-column
// CTA's 1.1% slower (fifty-fourth session). The same data either way (a prefetch changes no value).
template <int S, int G, bool E4 = false, bool PF = false>
__device__ __forceinline__ void mlp_request(MlpStream& st, int slot) {
  using K = MlpSteps<S, G>;
  constexpr int SLOT = E4 ? kSlotE4 : kAsyncSlot, SB = E4 ? 64 : 128;  // slot bytes, scale bytes a chunk
  const int i = st.next;
  if (i < K::N) {
    const uint32_t dw = st.ring_w + slot * SLOT;
#pragma unroll
    for (int m = 0; m < 4; ++m) cp_async16(dw + 128 * m, st.w + 128 * m);
    if (!E4 || (threadIdx.x & 31) < 16) cp_async16(st.ring_sc + slot * SLOT, st.s);
  }
  cp_async_commit();
  const int nx = i + 1;
  int step;  // chunks from step i's chunks to nx's
  if (nx < K::NG) {
    // within a group, or on to the next: G tiles on (tiles 8 apart, 32 chunks each) from the group's last step
    step = nx % K::GSG ? K::CPT : G * kMlpWarps * kMlpGuChunks - (kMlpGuChunks - K::CPT);
  } else if (nx == K::NG) {
    st.w = st.dw;
    st.s = st.ds;
    step = 0;
  } else {
    step = (nx - K::NG) % K::GSD ? K::CPT : G * kMlpWarps * kMlpDnChunks - (K::PD - K::CPT);
  }
  st.w += step * 512;
  st.s += step * SB;
  st.next = nx;
  if (PF && nx < K::N) {
    const int lane = threadIdx.x & 31;
    if ((lane & 7) == 0) {  // code offset 0 of slot lane / 8's chunk: its 4 lines
#pragma unroll
      for (int m = 0; m < 4; ++m) asm volatile("prefetch.global.L2 [%0];" ::"l"(st.w + 128 * m));
    }
    if (E4 ? lane < 16 && (lane & 3) == 0 : (lane & 7) == 0)  // scale offset 0 of the lane's slot
      asm volatile("prefetch.global.L2 [%0];" ::"l"(st.s));
  }
}

// Two e4m3 block scales (the low byte of `pair`: row g's, the next: row g + 8's; nonnegative and finite: the loader
// keeps no e4m3 copy otherwise) -> the bf16x2 word the dequantizer multiplies by (each scale * 2^117, as
// shuffle_mma_weights stores them; exact): cvt to f16x2 (exact: e4m3's smallest subnormal, 2^-9, is a normal f16),
// the word shifted right by 3, which moves each half's f16 exponent and mantissa into bf16's fields (a value
// f * 2^-112: e4m3 leaves the f16 mantissa's low 7 bits zero, so nothing is dropped and the high half's bits that
// shift into the low half's top 3 are zeros; each zero sign bit lands in bit 12 of its own half), then * 2^115 *
// 2^114 in bf16
// (powers of two in range: exact; zero stays zero). kernels/moe/mma_cuda.py's e4m3_scale_words mirrors it for the
// CPU tests.
__device__ __forceinline__ uint32_t e4m3_scale_word(uint32_t pair) {
  uint32_t h;
  asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(h) : "r"(pair));
  const uint32_t t = h >> 3;
  const __nv_bfloat162 p115 = as_bf162(0x79007900u), p114 = as_bf162(0x78807880u);  // 2^115, 2^114
  return as_u32(__hmul2(__hmul2(as_bf162(t), p115), p114));
}

// ring_read for E4 slots: the step's 4 chunks' 128 scale pairs first become bf16x2 words in the warp's conversion
// buffer `conv` (lane l: chunk l / 8, row group g = l % 8, its 4 k16 steps: 8 bytes in, 16 out), laid out as a bf16
// slot's scale vectors, which the lanes then read as ring_read does.
template <int R>
__device__ __forceinline__ void ring_read_e4(const unsigned char* ring, unsigned char* conv, int pos, int lane,
                                             uint4 (&wv)[4], uint4 (&sv)[4]) {
  __syncwarp();
  {
    const int j = lane >> 3, g = lane & 7;
    const uint2 b = *reinterpret_cast<const uint2*>(ring + (pos % R + j) * kSlotE4 + 512 + g * 8);  // pos % 4 == 0
    *reinterpret_cast<uint4*>(conv + j * 128 + g * 16) =
        make_uint4(e4m3_scale_word(b.x), e4m3_scale_word(b.x >> 16), e4m3_scale_word(b.y), e4m3_scale_word(b.y >> 16));
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    wv[j] = *reinterpret_cast<const uint4*>(ring + (pos % R + j) * kSlotE4 + lane * 16);
    sv[j] = *reinterpret_cast<const uint4*>(conv + j * 128 + (lane >> 2) * 16);
  }
  __syncwarp();
}

// Word k (0-3; a constant once unrolled) of a 16-byte vector.
__device__ __forceinline__ uint32_t u4_word(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// A ring step's 4 chunks (wv / sv: the lane's code and scale vectors; slot i CPT + d holds chunk c + d of the group's
// tile i) into the G tiles' accumulators; c: the first chunk's index within the staged x or h range (chunk c + d's
// staging swizzle (c + d) % 4). Each k16 step's x fragments are read once for the G tiles.
template <bool kTwo, int G>
__device__ __forceinline__ void group_mma(const uint4 (&wv)[4], const uint4 (&sv)[4], const uint2* x0, const uint2* x1,
                                          int t, int c, float (&acc0)[G][4], float (&acc1)[G][4]) {
  constexpr int CPT = 4 / G;
#pragma unroll
  for (int d = 0; d < CPT; ++d) {
    const int off = (t ^ ((c + d) & 3)) + (c + d) * 16;  // uint2 units: 4 quads per k16 step, 16 a chunk
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint2 b0 = x0[off + kk * 4];
      const uint2 b1 = kTwo ? x1[off + kk * 4] : b0;
#pragma unroll
      for (int i = 0; i < G; ++i) {
        uint32_t a[4];
        dequant8(u4_word(wv[i * CPT + d], kk), u4_word(sv[i * CPT + d], kk), a);
        mma16816(acc0[i], a, b0.x, b0.y);
        if (kTwo) mma16816(acc1[i], a, b1.x, b1.y);
      }
    }
  }
}

// Step p of the warp's stream (chunks c .. c + 4 / G - 1 of its group's G tiles) from the ring into the
// accumulators, refilling its slots with step p + kAsyncRing / 4.
template <int S, int G, bool kTwo, bool E4, bool PF>
__device__ __forceinline__ void mlp_step(MlpStream& st, int p, int c, const unsigned char* ring, const uint2* x0,
                                         const uint2* x1, int t, float (&acc0)[G][4], float (&acc1)[G][4]) {
  cp_async_wait_pending(kAsyncRing / 4 - 1);
  const int slot = (p % (kAsyncRing / 4)) * 4, lane = threadIdx.x & 31;
  uint4 wv[4], sv[4];
  if (E4)  // the conversion buffer follows the warp's 8 slots (8 x 576 + 512 = 8 x 640 bytes)
    ring_read_e4<kAsyncRing>(ring, const_cast<unsigned char*>(ring) + kAsyncRing * kSlotE4, slot, lane, wv, sv);
  else
    ring_read<4, kAsyncRing>(ring, slot, lane, wv, sv);
  mlp_request<S, G, E4, PF>(st, slot);  // step p + kAsyncRing / 4: st.next
  group_mma<kTwo, G>(wv, sv, x0, x1, t, c, acc0, acc1);
}

// Index (bf16 elements) of h element (column col, k index kk within the staged range) in a B-fragment-order buffer of
// row stride xs_stride (store_staged's layout).
__device__ __forceinline__ int staged_half(int xs_stride, int col, int kk) {
  const int st = kk >> 4, sw = (st >> 2) & 3;
  const int word = col * (xs_stride / 2) + st * 8 + ((kk >> 3) & 1) + 2 * (((kk & 7) >> 1) ^ sw);
  return 2 * word + (kk & 1);
}

// bf16 h = silu(gate) * up of accumulator column cc of a gate|up tile (moe_mma_kernel's kEpiSilu epilogue: the same
// operations).
__device__ __forceinline__ __nv_bfloat16 silu_mul(const float (&acc)[4], int cc, float2 alpha) {
  const float gv = acc[cc] * alpha.x, uv = acc[2 + cc] * alpha.y;
  return __float2bfloat16_rn(gv / (1.f + __expf(-gv)) * uv);
}

// A CTA's work once its x columns are staged (xs: [COLS][H + 16] in B-fragment order; ids: its pairs' sorted ids):
// gate|up + SiLU into h (registers, then shared memory in x's place), down into split j's partials. kTwo: both n8
// halves (COLS 16 with pairs in the second half). EARLY: each gate|up row tile's global scales are requested before
// its K loop, and a warp's 16 down tiles' scales all at once while h is stored (kept in shared memory past h: 8 KB a
// CTA, in x's space); without it (the default: mma_cuda.mlp_early_scales) they are read where they are used,
// after each K loop, whose warp (and its weight stream) then waits out their L2 round trip: at T = 32 on the H200
// Nsight Compute put ~9% of the warps' stall samples on those reads, yet the decode step at batch 32 was faster
// without EARLY, 0.6% on an H100 and 0.7% on the H200 (the extra registers and shared-memory traffic; the same
// values either way).
template <int S, int COLS, int G, bool kTwo, bool EARLY, bool E4, bool PF>
__device__ __forceinline__ void mlp_body(MlpStream& st, const unsigned char* ring, __nv_bfloat16* xs,
                                         const float* __restrict__ gs13, int gs13_stride, const float* __restrict__ gs2,
                                         int gs2_stride, float* __restrict__ out, long long out_stride_s,
                                         int out_stride_p, const int* ids, int n_pairs, int e) {
  using K = MlpSteps<S, G>;
  constexpr int GT = K::GT, DT = K::DT;
  constexpr int HS = kMlpI / S + 16;  // staged h row (bf16)
  static_assert(COLS == 16 || !kTwo, "two n8 halves need 16 columns");
  static_assert(16 * HS * 2 + kMlpWarps * DT * 16 * 4 <= COLS * (kMlpH + 16) * 2, "h and the down scales fit x's space");
  static_assert(DT == 16 && GT % G == 0, "a warp's down scales: two lanes a tile; whole groups of G tiles");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int j = blockIdx.y;
  uint32_t hq[GT][2];  // h of this lane's row and column pair per gate|up tile: [n8 half] bf16x2
  {
    const uint2* x0 = reinterpret_cast<const uint2*>(xs + g * (kMlpH + 16));
    const uint2* x1 = reinterpret_cast<const uint2*>(xs + (kTwo ? g + 8 : g) * (kMlpH + 16));
#pragma unroll  // hq's index must be a constant
    for (int q = 0; q < GT / G; ++q) {
      // the group's tiles G q + i: gate rows 8 tile + g, up rows I + 8 tile + g
      const float* gs_tile = gs13 + (size_t)e * gs13_stride + 8 * (j * (kMlpGuTiles / S) + warp) + g;
      float2 gs[G];
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const float* p = gs_tile + 8 * kMlpWarps * (G * q + i);
        gs[i] = EARLY ? make_float2(p[0], p[kMlpI]) : make_float2(0.f, 0.f);
      }
      float acc0[G][4] = {}, acc1[G][4] = {};
#pragma unroll 1
      for (int s = 0; s < K::GSG; ++s)
        mlp_step<S, G, kTwo, E4, PF>(st, q * K::GSG + s, s * K::CPT, ring, x0, x1, t, acc0, acc1);
      if (!EARLY) {
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const float* p = gs_tile + 8 * kMlpWarps * (G * q + i);
          gs[i] = make_float2(p[0], p[kMlpI]);
        }
      }
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const float2 alpha = make_float2(gs[i].x * 512.f, gs[i].y * 512.f);
        hq[G * q + i][0] = as_u32(__halves2bfloat162(silu_mul(acc0[i], 0, alpha), silu_mul(acc0[i], 1, alpha)));
        hq[G * q + i][1] =
            kTwo ? as_u32(__halves2bfloat162(silu_mul(acc1[i], 0, alpha), silu_mul(acc1[i], 1, alpha))) : 0u;
      }
    }
  }
  __syncthreads();  // every warp is done with x: h (and the down scales) take its place
  // with EARLY, this warp's down scales (tile r = lane / 2, rows 8 (lane % 2) .. + 7 of it) are requested here, once
  // (their round trip overlaps the h stores), and kept in shared memory past h for the down loop
  float dsc[8];
  float* dscale = reinterpret_cast<float*>(xs + 16 * HS) + warp * DT * 16;  // [DT][16] of this warp, past h
  if (EARLY) {
    const float* p = gs2 + (size_t)e * gs2_stride + 16 * (warp + kMlpWarps * (lane >> 1)) + 8 * (lane & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) dsc[i] = p[i];
  }
#pragma unroll
  for (int r = 0; r < GT; ++r) {
    const int kk = 8 * (warp + kMlpWarps * r) + g;  // h row within the slice
#pragma unroll
    for (int half = 0; half < (kTwo ? 2 : 1); ++half) {
      const __nv_bfloat162 v = as_bf162(hq[r][half]);
      xs[staged_half(HS, 8 * half + 2 * t, kk)] = __low2bfloat16(v);
      xs[staged_half(HS, 8 * half + 2 * t + 1, kk)] = __high2bfloat16(v);
    }
  }
  if (EARLY) {
#pragma unroll
    for (int i = 0; i < 8; ++i) dscale[(lane >> 1) * 16 + 8 * (lane & 1) + i] = dsc[i];
  }
  __syncthreads();
  // down: the slice's K range of every output row tile, G tiles at a time, into split j's partials
  const uint2* h0 = reinterpret_cast<const uint2*>(xs + g * HS);
  const uint2* h1 = reinterpret_cast<const uint2*>(xs + (kTwo ? g + 8 : g) * HS);
#pragma unroll 1
  for (int q = 0; q < DT / G; ++q) {
    float acc0[G][4] = {}, acc1[G][4] = {};
#pragma unroll 1
    for (int s = 0; s < K::GSD; ++s)
      mlp_step<S, G, kTwo, E4, PF>(st, K::NG + q * K::GSD + s, s * K::CPT, ring, h0, h1, t, acc0, acc1);
    // the G tiles' global scales (rows 16 tile + g, + 8), one round trip for the G (with EARLY from shared memory)
    float2 gsd[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int r = G * q + i;
      const float* p = gs2 + (size_t)e * gs2_stride + 16 * (warp + kMlpWarps * r) + g;
      gsd[i] = EARLY ? make_float2(dscale[r * 16 + g], dscale[r * 16 + g + 8]) : make_float2(p[0], p[8]);
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const TileOut d = tile_out(out, out_stride_s, out_stride_p, n_pairs, gs2, gs2_stride, 1, 0, kMlpH, e,
                                 warp + kMlpWarps * (G * q + i), g, j, &gsd[i]);
      store_halves(d, acc0[i], acc1[i], kTwo, ids, t);
    }
  }
}

// COLS 16: a CTA per (block, slice), both n8 halves (grid z 1); COLS 8: a CTA per (block, slice, half) (grid z 2).
// EARLY: see mlp_body. E4: s13 / s2 hold the e4m3 block scales ([E', N/16, K/64, 64] bytes in the bf16 scales'
// order) instead of the bf16 ones: 10% fewer bytes a chunk (576 against 640), converted a ring step at a time
// (ring_read_e4; the same words, so the same bits). G: row tiles a ring step (MlpStream).
template <int S, int COLS, bool EARLY, bool E4, int G, bool PF>
__global__ void __launch_bounds__(kMlpWarps * 32, COLS == 8 ? 3 : 2) moe_mlp_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w13,
    const uint8_t* __restrict__ s13, const float* __restrict__ gs13, int gs13_stride, const uint8_t* __restrict__ w2,
    const uint8_t* __restrict__ s2, const float* __restrict__ gs2, int gs2_stride, float* __restrict__ out,
    long long out_stride_s, int out_stride_p, const int* __restrict__ sorted_ids,
    const int* __restrict__ block_expert, int n_pairs, int pdl) {
  pdl_wait(pdl);
  using K = MlpSteps<S, G>;
  __shared__ long long xrow[COLS];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int blk = blockIdx.x, j = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int* ids = sorted_ids + blk * kBlockPairs + (COLS == 8 ? 8 * blockIdx.z : 0);  // this CTA's pairs
  const int pair = tid < COLS ? ids[tid] : 0;  // requested with the expert id
  const int e = block_expert[blk];
  if (e < 0) return;
  if (COLS == 8 && __syncthreads_or(tid == 0 && ids[0] >= n_pairs)) return;  // an empty second half
  // the lane's chunk of a step, for its codes (slot lane / 8) and its scales (bf16: slot lane / 8, e4m3: lane / 4,
  // lanes 0-15): slot i CPT + d is chunk d of the group's tile i
  constexpr int SLOT = E4 ? kSlotE4 : kAsyncSlot, SB = E4 ? 64 : 128, CPT = K::CPT;
  const int jc = lane >> 3, js = E4 ? (lane >> 2) & 3 : lane >> 3;
  const int co = (lane & 7) * 16, so = E4 ? (lane & 3) * 16 : (lane & 7) * 16;
  const size_t gt = (size_t)e * kMlpGuTiles + j * (kMlpGuTiles / S) + warp;  // the warp's first gate|up tile
  const size_t dt = (size_t)e * kMlpDnTiles + warp;                          // its first down tile
  MlpStream st;
  st.w = w13 + ((gt + kMlpWarps * (jc / CPT)) * kMlpGuChunks + jc % CPT) * 512 + co;
  st.s = s13 + ((gt + kMlpWarps * (js / CPT)) * kMlpGuChunks + js % CPT) * SB + so;
  st.dw = w2 + ((dt + kMlpWarps * (jc / CPT)) * kMlpDnChunks + j * K::PD + jc % CPT) * 512 + co;
  st.ds = s2 + ((dt + kMlpWarps * (js / CPT)) * kMlpDnChunks + j * K::PD + js % CPT) * SB + so;
  st.next = 0;
  const unsigned char* ring = smem_raw + COLS * (kMlpH + 16) * 2 + warp * kAsyncRing * kAsyncSlot;
  const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
  st.ring_w = ring_s + jc * SLOT + co;
  st.ring_sc = ring_s + js * SLOT + 512 + so;
#pragma unroll
  for (int c = 0; c < kAsyncRing / 4; ++c) mlp_request<S, G, E4, PF>(st, 4 * c);
  stage_columns_all<kMlpWarps * 32, COLS>(xs, xrow, x, x_row_div, x_stride, pair, n_pairs, 0, kMlpH, kMlpH + 16, tid);
  if (COLS == 16 && ids[8] < n_pairs)  // CTA-uniform
    mlp_body<S, COLS, G, COLS == 16, EARLY, E4, PF>(st, ring, xs, gs13, gs13_stride, gs2, gs2_stride, out, out_stride_s, out_stride_p,
                                  ids, n_pairs, e);
  else
    mlp_body<S, COLS, G, false, EARLY, E4, PF>(st, ring, xs, gs13, gs13_stride, gs2, gs2_stride, out, out_stride_s, out_stride_p, ids,
                             n_pairs, e);
}

// ------------------------------------------------------------------------------------ 32 / 64 pairs per block

constexpr int kLargeWarps = 8;            // one 16-row tile per warp: 128 output rows per CTA
constexpr int kPiece = 64 * kGroup;       // k per staged x piece: one register group
constexpr int kPieceStride = kPiece + 8;  // bf16 per staged pair: the 16-byte pad (528-byte rows) puts the 8 rows
                                          // an ldmatrix phase reads into 8 different 16-byte bank groups

// x piece [k, k + kPiece) of the block's first ncols pairs into the buffer at shared address dst ([pair][k],
// row stride kPieceStride): warp w copies pairs w, w + kLargeWarps, ..., lane l their 16 bytes at k + 8 l (one
// coalesced 512-byte row per warp instruction). xrow: each pair's x row offset (elements, the split's k0
// included; -1 for padding pairs, which are not copied: their rows were zeroed).
__device__ __forceinline__ void stage_piece(uint32_t dst, const __nv_bfloat16* x, const long long* xrow, int ncols,
                                            int k, int warp, int lane) {
#pragma unroll 1  // rolled: unrolled, the loop-invariant row addresses of up to 8 pairs would stay in registers
  for (int col = warp; col < ncols; col += kLargeWarps) {
    const long long row = xrow[col];
    if (row >= 0) cp_async16(dst + (col * kPieceStride + lane * 8) * 2, x + row + k + lane * 8);
  }
  cp_async_commit();
}

// One register group (one staged x piece; xb: this lane's ldmatrix address in the piece's buffer) into the
// accumulators of the block's first P n8 tiles: each pair of k16 steps is dequantized once (8 A registers) and
// multiplied into every tile, whose B fragments for both steps come from one ldmatrix.x4 (matrices: k 16s..16s+7,
// 16s+8.., 16s+16.., 16s+24.. of the tile's 8 pairs = b0/b1 of step s, then of step s + 1).
// With `more`, chunk i's registers are refilled with the next group's chunk i (wp / sp: the next group's first
// chunk) as soon as it is dequantized: the same one-group prefetch distance as the decode kernel's, without a
// second set of 24 registers.
template <int P>
__device__ __forceinline__ void group_mma_tiles(uint4 (&wv)[kGroup], uint4 (&sv)[kGroup], uint32_t xb,
                                                float (&acc)[P][4], bool more, const uint4* wp, const uint4* sp) {
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    const uint32_t wq[4] = {wv[i].x, wv[i].y, wv[i].z, wv[i].w};
    const uint32_t sq[4] = {sv[i].x, sv[i].y, sv[i].z, sv[i].w};
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      uint32_t a0[4], a1[4];
      dequant8(wq[j], sq[j], a0);
      dequant8(wq[j + 1], sq[j + 1], a1);
#pragma unroll
      for (int p = 0; p < P; ++p) {
        uint32_t b[4];
        ldmatrix_x4(b, xb + (p * 8 * kPieceStride + (4 * i + j) * 16) * 2);
        mma16816(acc[p], a0, b[0], b[1]);
        mma16816(acc[p], a1, b[2], b[3]);
      }
    }
    if (more) {
      wv[i] = load_stream(wp + i * 32);
      sv[i] = __ldg(sp + i * 8);
    }
  }
}

// What the large kernel's K loop and epilogue need (set up by its prologue).
struct LargeCtx {
  const __nv_bfloat16* x;
  const uint4* wp;         // this lane's codes of the split's first chunk
  const uint4* sp;         // this lane's scales of the split's first chunk
  const long long* xrow;   // the block's pairs' x row offsets (shared memory; -1: padding)
  uint32_t xs0;            // shared address of the x buffers
  uint32_t buf_bytes;      // bytes per x buffer
  int npieces, warp, lane;
};

// The K loop of one warp over the block's first P n8 tiles (P = active tiles, a template argument so that no
// instruction of an empty tile is issued), sums into out_acc[0, P). Per piece: wait for its x, barrier, start the
// next piece's x copies, multiply this one (which loads the next register group as it goes). With `stage` false
// (a later row tile of a K range of at most two pieces) the pieces are already in their buffers and the loop
// stages nothing. next_wp / next_sp: the next row tile's first chunk (its first register group is loaded during the
// last piece), or null.
template <int P, int NT>
__device__ __forceinline__ void large_tiles(const LargeCtx& c, uint4 (&wv)[kGroup], uint4 (&sv)[kGroup],
                                            float (&out_acc)[NT][4], bool stage, const uint4* next_wp,
                                            const uint4* next_sp) {
  float acc[P][4];
#pragma unroll
  for (int p = 0; p < P; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.f;
  const uint32_t lane_off = ((c.lane & 7) * kPieceStride + (c.lane >> 3) * 8) * 2;
  for (int pc = 0; pc < c.npieces; ++pc) {
    const bool last = pc + 1 == c.npieces;
    if (stage) {
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      __syncthreads();  // piece pc is in for every warp, and every warp is done with piece pc - 1's buffer
      if (!last)
        stage_piece(c.xs0 + ((pc + 1) & 1) * c.buf_bytes, c.x, c.xrow, P * 8, (pc + 1) * kPiece, c.warp, c.lane);
    }
    group_mma_tiles<P>(wv, sv, c.xs0 + (pc & 1) * c.buf_bytes + lane_off, acc, !last || next_wp != nullptr,
                       last ? next_wp : c.wp + (pc + 1) * kGroup * 32, last ? next_sp : c.sp + (pc + 1) * kGroup * 8);
  }
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int r = 0; r < 4; ++r) out_acc[p][r] = acc[p][r];
}

// Row tiles per warp of moe_mma_large_kernel: 2 when the split's K range is at most two pieces (the down
// projection, K 512): the x pieces stay in their buffers for the second tile, whose first register group loads
// while the first tile finishes, so a CTA pays its prologue (the first weight and x loads, exposed at every wave
// of short CTAs) once for 256 rows; else 1. The host sizes the grid with the same rule.
__host__ __device__ constexpr int large_row_tiles(int K, int split) { return K / split <= 2 * kPiece ? 2 : 1; }

// The prologue both 32/64-pair kernels share (their block's expert e >= 0): this warp's row tile (a warp without
// one multiplies tile 0 and stores nothing), its first register group in flight, the block's pair ids and x row
// offsets (elements, the split's k0 included; -1 for padding) in shared memory, and c's common fields. Returns
// the active n8 tiles: up to the last one holding a real pair (moe_align fills a block's pairs from its start);
// 0 (CTA-uniform) leaves nothing to do.
template <int BP>
__device__ __forceinline__ int large_block_setup(const __nv_bfloat16* x, int x_row_div, int x_stride, const uint8_t* w,
                                                 const uint8_t* s, const int* block_ids, int e, int n_pairs, int N,
                                                 int K, int split, int row_tiles, int* ids, long long* xrow,
                                                 uint32_t* real, LargeCtx& c, uint4 (&wv)[kGroup], uint4 (&sv)[kGroup],
                                                 int& tile) {
  static_assert(BP == 32 || BP == 64, "one ballot word per 32 pairs, at most 8 n8 tiles");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kchunks = K / 64, per = kchunks / split, c0 = blockIdx.z * per;
  const int ntiles = N / 16;
  tile = blockIdx.y * kLargeWarps * row_tiles + warp;  // this warp's first row tile (then + kLargeWarps each)
  tile_ptrs(w, s, e, tile, ntiles, kchunks, c0, c.wp, c.sp);
  load_group(c.wp, c.sp, 0, wv, sv);  // in flight during the prologue
  if (warp < BP / 32) {
    const int pair = block_ids[tid];
    ids[tid] = pair;
    xrow[tid] = pair < n_pairs ? (long long)(pair / x_row_div) * x_stride + c0 * 64 : -1;
    const uint32_t m = __ballot_sync(0xffffffffu, pair < n_pairs);
    if (lane == 0) real[warp] = m;
  }
  __syncthreads();
  int top = 0;
#pragma unroll
  for (int i = 0; i < BP / 32; ++i)
    if (real[i]) top = 32 * i + 32 - __clz(real[i]);
  c.x = x;
  c.xrow = xrow;
  c.npieces = per / kGroup;
  c.warp = warp;
  c.lane = lane;
  return (top + 7) >> 3;
}

// The epilogue both 32/64-pair kernels share: the block's active n8 tiles to their pairs.
template <int BP>
__device__ __forceinline__ void large_block_store(const TileOut& d, const float (&acc)[BP / 8][4], const int* ids,
                                                  int nact, int t) {
#pragma unroll
  for (int p = 0; p < BP / 8; ++p)
    if (p < nact) store_n8(d, acc[p], ids + 8 * p, t);
}

template <int BP>
__global__ void __launch_bounds__(kLargeWarps * 32, 2) moe_mma_large_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w,
    const uint8_t* __restrict__ s, const float* __restrict__ gs, int gs_stride_e, float* __restrict__ out,
    long long out_stride_s, int out_stride_p, const int* __restrict__ sorted_ids,
    const int* __restrict__ block_expert, int n_pairs, int N, int K, int split, int apply_alpha, int epi, int pdl) {
  pdl_wait(pdl);
  __shared__ int ids[BP];
  __shared__ long long xrow[BP];
  __shared__ uint32_t real[BP / 32];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [2 buffers][BP][kPieceStride]

  const int blk = blockIdx.x;
  const int e = block_expert[blk];
  if (e < 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  LargeCtx c;
  uint4 wv[kGroup], sv[kGroup];
  int tile;
  const int row_tiles = large_row_tiles(K, split);
  const int nact = large_block_setup<BP>(x, x_row_div, x_stride, w, s, sorted_ids + blk * BP, e, n_pairs, N, K, split,
                                         row_tiles, ids, xrow, real, c, wv, sv, tile);
  if (nact == 0) return;  // CTA-uniform
  c.xs0 = (uint32_t)__cvta_generic_to_shared(xs);
  c.buf_bytes = BP * kPieceStride * 2;
  for (int col = warp; col < nact * 8; col += kLargeWarps) {
    if (xrow[col] < 0) {  // padding inside an active tile: zero in both buffers (never copied)
      *reinterpret_cast<uint4*>(xs + col * kPieceStride + lane * 8) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(xs + (BP + col) * kPieceStride + lane * 8) = make_uint4(0, 0, 0, 0);
    }
  }
  stage_piece(c.xs0, x, xrow, nact * 8, 0, warp, lane);

  const int ntiles = N / 16, kchunks = K / 64, c0 = blockIdx.z * (kchunks / split);
  for (int r = 0; r < row_tiles; ++r, tile += kLargeWarps) {
    const uint4 *next_wp = nullptr, *next_sp = nullptr;
    if (r + 1 < row_tiles) tile_ptrs(w, s, e, tile + kLargeWarps, ntiles, kchunks, c0, next_wp, next_sp);
    float acc[BP / 8][4];
    switch (nact) {  // CTA-uniform
#define VQ_TILES(P)                                                                                    \
  case P:                                                                                              \
    if (P <= BP / 8) large_tiles<(P <= BP / 8 ? P : 1)>(c, wv, sv, acc, r == 0, next_wp, next_sp); \
    break;
      VQ_TILES(1) VQ_TILES(2) VQ_TILES(3) VQ_TILES(4) VQ_TILES(5) VQ_TILES(6) VQ_TILES(7) VQ_TILES(8)
#undef VQ_TILES
    }
    if (tile < ntiles)
      large_block_store<BP>(
          tile_out(out, out_stride_s, out_stride_p, n_pairs, gs, gs_stride_e, apply_alpha, epi, N, e, tile, g),
          acc, ids, nact, t);
    c.wp = next_wp;
    c.sp = next_sp;
  }
}


// ------------------------------------------------------------------- 32 / 64 pairs per block on wgmma (sm_90a)
//
// moe_wgmma_kernel<32 | 64>: the prefill kernel's blocks, weights and prologue, with each warpgroup (4 warps = 64
// weight rows) multiplying on the asynchronous warpgroup MMA: per k16 step one wgmma.m64nNk16 (N = 8 x active n8
// tiles) takes the dequantized A fragments from registers (the layout of mma.m16n8k16's A, warp w of the group
// holding rows 16w..16w+15) and x from shared memory through a descriptor, instead of one mma.sync per n8 tile
// and warp fed by ldmatrix. The dequantizer of the next steps runs while earlier steps' wgmmas are in flight
// (kWgInFlight = 2 groups, A registers triple-buffered: wait_group 2 after each commit). The accumulators have
// mma.m16n8's C layout per n8 tile, so the epilogue is the other kernel's.
// x pieces are staged for wgmma's B operand in the canonical K-major layout without swizzle: core matrices of
// 8 pairs x 8 k (128 contiguous bytes, pair r of the group at 16 r), the piece's 32 core matrices along k
// contiguous (leading byte offset 128), pair groups kPiece / 8 * 128 = 4096 bytes apart (stride byte offset).
// PTX ISA: "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" (register fragments, matrix descriptors).

constexpr uint32_t kWgLbo = 128;                // bytes between core matrices adjacent in k
constexpr uint32_t kWgSbo = (kPiece / 8) * 128; // bytes between core matrices adjacent in n (pair groups)

// Shared-memory matrix descriptor (no swizzle, base offset 0): start address, LBO, SBO, each in 16-byte units.
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  return (uint64_t)((saddr >> 4) & 0x3FFF) | ((uint64_t)(kWgLbo >> 4) << 16) | ((uint64_t)(kWgSbo >> 4) << 32);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// d[p][0..3] += A (4 registers, this warp's 16 rows) x B (descriptor: 8P pairs x 16 k), f32 accumulation.
template <int P>
__device__ __forceinline__ void wgmma_rs(float (&d)[P][4], const uint32_t (&a)[4], uint64_t desc);

template <>
__device__ __forceinline__ void wgmma_rs<1>(float (&d)[1][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<2>(float (&d)[2][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<3>(float (&d)[3][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, %16, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<4>(float (&d)[4][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<5>(float (&d)[5][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %25, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19}, {%20,%21,%22,%23}, %24, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<6>(float (&d)[6][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}, {%24,%25,%26,%27}, %28, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<7>(float (&d)[7][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %33, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27}, {%28,%29,%30,%31}, %32, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<8>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}


// x piece [k, k + kPiece) of the block's first nact n8 tiles into the wgmma buffer at shared address dst: item it =
// (pair group it / 8, granule block it % 8); lane l copies pair 8 (it / 8) + l % 8, k granule 4 (it % 8) + l / 8 (16
// bytes; a warp instruction fills 4 whole core matrices: 512 contiguous bytes, no bank conflicts). Padding pairs
// (xrow -1) are not copied: their rows were zeroed.
__device__ __forceinline__ void stage_piece_wg(uint32_t dst, const __nv_bfloat16* x, const long long* xrow, int nact,
                                               int k, int warp, int lane) {
  const int r = lane & 7, gq = lane >> 3;
#pragma unroll 1
  for (int it = warp; it < nact * 8; it += kLargeWarps) {
    const int pg = it >> 3, gran = 4 * (it & 7) + gq;
    const long long row = xrow[8 * pg + r];
    if (row >= 0) cp_async16(dst + pg * kWgSbo + gran * 128 + r * 16, x + row + k + gran * 8);
  }
  cp_async_commit();
}

// wgmma groups in flight while the next step is dequantized (A buffers: one more)
constexpr int kWgInFlight = 2;

// One register group (one staged x piece at shared address buf) into the accumulators: 16 k16 steps, one wgmma
// each; step s dequantizes into A buffer s % (kWgInFlight + 1), whose last reader (step s - kWgInFlight - 1) the
// previous step's wait_group retired. With `more`, chunk i's registers are refilled with the next group's chunk
// i (as the mma.sync kernel does).
template <int P>
__device__ __forceinline__ void wg_group(uint4 (&wv)[kGroup], uint4 (&sv)[kGroup], uint32_t buf, float (&acc)[P][4],
                                         bool more, const uint4* wp, const uint4* sp) {
  uint32_t a[kWgInFlight + 1][4];
  const uint64_t desc0 = wg_desc(buf);  // step s: start address + s * 2 core matrices (no carry out of 14 bits)
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    const uint32_t wq[4] = {wv[i].x, wv[i].y, wv[i].z, wv[i].w};
    const uint32_t sq[4] = {sv[i].x, sv[i].y, sv[i].z, sv[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t (&ab)[4] = a[(4 * i + j) % (kWgInFlight + 1)];
      dequant8(wq[j], sq[j], ab);
      wg_fence();
      wgmma_rs<P>(acc, ab, desc0 + (uint64_t)(((4 * i + j) * 2 * kWgLbo) >> 4));
      wg_commit();
      wg_wait<kWgInFlight>();
    }
    if (more) {
      wv[i] = load_stream(wp + i * 32);
      sv[i] = __ldg(sp + i * 8);
    }
  }
}

// The K loop over the block's first P n8 tiles: per piece, wait for its x (then make the copies visible to the
// async proxy), barrier, start the next piece's copies, multiply this one, drain the wgmma pipeline (the buffer is
// overwritten after the next barrier).
template <int P, int NT>
__device__ __forceinline__ void wg_tiles(const LargeCtx& c, uint4 (&wv)[kGroup], uint4 (&sv)[kGroup],
                                         float (&out_acc)[NT][4]) {
  float acc[P][4];
#pragma unroll
  for (int p = 0; p < P; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.f;
  for (int pc = 0; pc < c.npieces; ++pc) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const bool more = pc + 1 < c.npieces;
    if (more) stage_piece_wg(c.xs0 + ((pc + 1) & 1) * c.buf_bytes, c.x, c.xrow, P, (pc + 1) * kPiece, c.warp, c.lane);
    wg_group<P>(wv, sv, c.xs0 + (pc & 1) * c.buf_bytes, acc, more, c.wp + (pc + 1) * kGroup * 32,
                c.sp + (pc + 1) * kGroup * 8);
    wg_wait<0>();
  }
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int r = 0; r < 4; ++r) out_acc[p][r] = acc[p][r];
}

template <int BP>
__global__ void __launch_bounds__(kLargeWarps * 32, BP == 32 ? 3 : 2) moe_wgmma_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w,
    const uint8_t* __restrict__ s, const float* __restrict__ gs, int gs_stride_e, float* __restrict__ out,
    long long out_stride_s, int out_stride_p, const int* __restrict__ sorted_ids,
    const int* __restrict__ block_expert, int n_pairs, int N, int K, int split, int apply_alpha, int epi, int pdl) {
  pdl_wait(pdl);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ int ids[BP];
  __shared__ long long xrow[BP];
  __shared__ uint32_t real[BP / 32];
  extern __shared__ __align__(16) unsigned char smem_raw[];  // [2 buffers][BP / 8 groups][kWgSbo bytes]

  const int blk = blockIdx.x;
  const int e = block_expert[blk];
  if (e < 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  LargeCtx c;
  uint4 wv[kGroup], sv[kGroup];
  int tile;  // a warp without a tile multiplies tile 0 (its warpgroup's wgmma needs all 4 warps)
  const int nact = large_block_setup<BP>(x, x_row_div, x_stride, w, s, sorted_ids + blk * BP, e, n_pairs, N, K, split,
                                         1, ids, xrow, real, c, wv, sv, tile);
  if (nact == 0) return;  // CTA-uniform
  c.xs0 = (uint32_t)__cvta_generic_to_shared(smem_raw);
  c.buf_bytes = (BP / 8) * kWgSbo;
  // padding pairs inside active tiles: their 16-byte rows of every core matrix zeroed in both buffers
  for (int i = tid; i < nact * 8 * (kPiece / 8); i += kLargeWarps * 32) {
    const int pair = i / (kPiece / 8), gran = i % (kPiece / 8);
    if (xrow[pair] < 0) {
      const uint32_t off = (pair >> 3) * kWgSbo + gran * 128 + (pair & 7) * 16;
      *reinterpret_cast<uint4*>(smem_raw + off) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(smem_raw + c.buf_bytes + off) = make_uint4(0, 0, 0, 0);
    }
  }
  stage_piece_wg(c.xs0, x, xrow, nact, 0, warp, lane);

  float acc[BP / 8][4];
  switch (nact) {  // CTA-uniform
#define VQ_WG_TILES(P)                                                   \
  case P:                                                                \
    if (P <= BP / 8) wg_tiles<(P <= BP / 8 ? P : 1)>(c, wv, sv, acc); \
    break;
    VQ_WG_TILES(1) VQ_WG_TILES(2) VQ_WG_TILES(3) VQ_WG_TILES(4) VQ_WG_TILES(5) VQ_WG_TILES(6) VQ_WG_TILES(7)
    VQ_WG_TILES(8)
#undef VQ_WG_TILES
  }
  if (tile >= N / 16) return;
  large_block_store<BP>(
      tile_out(out, out_stride_s, out_stride_p, n_pairs, gs, gs_stride_e, apply_alpha, epi, N, e, tile, g),
      acc, ids, nact, t);
#endif
}

}  // namespace

extern "C" int vq_moe_mma_smem_bytes(int K, int split, int block_pairs) {
  if (block_pairs == kBlockPairs) return kBlockPairs * (K / split + 16) * 2;  // the split's x columns
  return 2 * block_pairs * kPieceStride * 2;                                  // two x pieces
}

// Dynamic shared memory of moe_mma_async_kernel: the split's x columns and every warp's weight ring; 0 where the
// split's chunk count is not one it is built for (4, 8, 16, 32).
extern "C" int vq_moe_mma_async_smem_bytes(int K, int split) {
  if (split < 1 || K % (64 * split)) return 0;
  const int per = K / 64 / split;
  if (per != 4 && per != 8 && per != 16 && per != 32) return 0;
  return kBlockPairs * (K / split + 16) * 2 + kAsyncWarps * (per < kAsyncRing ? per : kAsyncRing) * kAsyncSlot;
}

// Dynamic shared memory of the wgmma kernel: two x pieces in core-matrix layout (no padding).
extern "C" int vq_moe_wgmma_smem_bytes(int block_pairs) { return 2 * (block_pairs / 8) * (int)kWgSbo; }

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// block_pairs: moe_align's block_m, 16 (decode kernel), 32 or 64 (prefill kernel); else cudaErrorInvalidValue.
// epi: kEpiInterleaved / kEpiSilu bits (see tile_out).
// wgmma: 1 runs 32/64-pair blocks on moe_wgmma_kernel (the library must be built for sm_90a: elsewhere that
// kernel is empty), 0 on moe_mma_large_kernel; ignored for 16-pair blocks.
// decode_kernel: the 16-pair blocks' kernel: 0 moe_mma_kernel<1>, 1 moe_mma_kernel<2> (two row tiles per warp),
// 2 / 3 / 4 moe_mma_async_kernel with 1 / 2 / 4 row tiles per warp (K / split of 4, 8, 16 or 32 64-k chunks; 6 / 7 /
// 8 the same with one-chunk ring steps, for measuring), 5
// moe_mma_persist_kernel<2> (a grid of resident CTAs: SMs x its occupancy at this shared-memory size, or
// persist_grid CTAs where that is > 0, for tests); else cudaErrorInvalidValue. Ignored for 32/64-pair blocks.
// pdl: 1 launches with programmatic dependent launch (sm_90+; the kernels wait for the previous kernel first), 2 also
// lets the next kernel launch early (mma_common.cuh: pdl_wait).
extern "C" int vq_moe_mma_launch(const void* x, int x_row_div, int x_stride, const void* w, const void* s,
                                 const float* gs, int gs_stride_e, float* out, long long out_stride_s,
                                 int out_stride_p, const int* sorted_ids, const int* block_expert,
                                 int n_blocks, int n_pairs, int N, int K, int split, int block_pairs,
                                 int apply_alpha, int epi, int wgmma, int decode_kernel, int persist_grid, int pdl,
                                 void* stream) {
  static int configured16[64] = {0}, configured16x2[64] = {0}, configured32[64] = {0}, configured64[64] = {0};
  static int configured_persist[64] = {0};
  static int configured_async[24][64] = {{0}};
  static int configured_wg32[64] = {0}, configured_wg64[64] = {0};
  const int smem = vq_moe_mma_smem_bytes(K, split, block_pairs);
  const int wg_smem = vq_moe_wgmma_smem_bytes(block_pairs);
  const cudaStream_t st = (cudaStream_t)stream;
#define VQ_MOE_MMA_ARGS \
  pdl, x, x_row_div, x_stride, w, s, gs, gs_stride_e, out, out_stride_s, out_stride_p, sorted_ids, block_expert, \
      n_pairs, N, K, split, apply_alpha, epi, pdl
  const int tiles_per_cta = kLargeWarps * large_row_tiles(K, split);  // 16-row tiles
  const dim3 large_grid(n_blocks, (N / 16 + tiles_per_cta - 1) / tiles_per_cta, split);
  const dim3 wg_grid(n_blocks, (N / 16 + kLargeWarps - 1) / kLargeWarps, split);
  switch (block_pairs) {
    case kBlockPairs:
      if (decode_kernel == 1)
        return launch_kernel(moe_mma_kernel<2>, configured16x2,
                             dim3(n_blocks, (N / 16 + 2 * kWarps - 1) / (2 * kWarps), split), kWarps * 32, smem, st,
                             VQ_MOE_MMA_ARGS);
      if ((decode_kernel >= 2 && decode_kernel <= 4) || (decode_kernel >= 6 && decode_kernel <= 8)) {
        const int per = K / 64 / split;
        const int asmem = vq_moe_mma_async_smem_bytes(K, split);
        const int rt = 1 << ((decode_kernel - 2) & 3);  // row tiles per warp: 1, 2, 4
        const bool step4 = decode_kernel <= 4;          // 6-8: the one-chunk ring steps (measuring)
        const dim3 agrid(n_blocks, (N / 16 + kAsyncWarps * rt - 1) / (kAsyncWarps * rt), split);
        if (asmem == 0) return (int)cudaErrorInvalidValue;
#define VQ_ASYNC(P, RT, I)                                                                                         \
  if (per == P && rt == RT)                                                                                        \
    return step4 ? launch_kernel(moe_mma_async_kernel<P, RT, 4>, configured_async[I], agrid, kAsyncWarps * 32,    \
                                 asmem, st, VQ_MOE_MMA_ARGS)                                                       \
                 : launch_kernel(moe_mma_async_kernel<P, RT, 1>, configured_async[12 + I], agrid, kAsyncWarps * 32, \
                                 asmem, st, VQ_MOE_MMA_ARGS);
        VQ_ASYNC(4, 1, 0) VQ_ASYNC(8, 1, 1) VQ_ASYNC(16, 1, 2) VQ_ASYNC(32, 1, 3)
        VQ_ASYNC(4, 2, 4) VQ_ASYNC(8, 2, 5) VQ_ASYNC(16, 2, 6) VQ_ASYNC(32, 2, 7)
        VQ_ASYNC(4, 4, 8) VQ_ASYNC(8, 4, 9) VQ_ASYNC(16, 4, 10) VQ_ASYNC(32, 4, 11)
#undef VQ_ASYNC
        return (int)cudaErrorInvalidValue;
      }
      if (decode_kernel == 5) {  // persistent: SMs x resident CTAs at this shared-memory size, or persist_grid
        static int grid_of[64] = {0}, grid_smem[64] = {0};
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess) return (int)cudaGetLastError();
        if (dev >= 64) return (int)cudaErrorInvalidValue;
        if (grid_of[dev] == 0 || grid_smem[dev] != smem) {
          int sms = 0, occ = 0;
          // opt in first (launch_kernel does it too): the occupancy query needs the kernel's smem limit
          if (smem > configured_persist[dev]) {
            if (smem > 48 * 1024 &&
                cudaFuncSetAttribute(moe_mma_persist_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
                    cudaSuccess)
              return (int)cudaGetLastError();
            configured_persist[dev] = smem;
          }
          if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
              cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, moe_mma_persist_kernel<2>, kWarps * 32, smem) !=
                  cudaSuccess)
            return (int)cudaGetLastError();
          if (occ < 1) return (int)cudaErrorInvalidConfiguration;
          grid_of[dev] = sms * occ;
          grid_smem[dev] = smem;
        }
        const int grid = persist_grid > 0 ? persist_grid : grid_of[dev];
        return launch_kernel(moe_mma_persist_kernel<2>, configured_persist, dim3(grid), kWarps * 32, smem, st, pdl, x,
                             x_row_div, x_stride, w, s, gs, gs_stride_e, out, out_stride_s, out_stride_p, sorted_ids,
                             block_expert, n_blocks, n_pairs, N, K, split, apply_alpha, epi, pdl);
      }
      if (decode_kernel != 0) return (int)cudaErrorInvalidValue;
      return launch_kernel(moe_mma_kernel<1>, configured16, dim3(n_blocks, (N / 16 + kWarps - 1) / kWarps, split),
                           kWarps * 32, smem, st, VQ_MOE_MMA_ARGS);
    case 32:
      if (wgmma)
        return launch_kernel(moe_wgmma_kernel<32>, configured_wg32, wg_grid, kLargeWarps * 32, wg_smem, st,
                      VQ_MOE_MMA_ARGS);
      return launch_kernel(moe_mma_large_kernel<32>, configured32, large_grid, kLargeWarps * 32, smem, st, VQ_MOE_MMA_ARGS);
    case 64:
      if (wgmma)
        return launch_kernel(moe_wgmma_kernel<64>, configured_wg64, wg_grid, kLargeWarps * 32, wg_smem, st,
                      VQ_MOE_MMA_ARGS);
      return launch_kernel(moe_mma_large_kernel<64>, configured64, large_grid, kLargeWarps * 32, smem, st, VQ_MOE_MMA_ARGS);
    default:
      return (int)cudaErrorInvalidValue;
  }
#undef VQ_MOE_MMA_ARGS
}

// Dynamic shared memory of moe_mlp_kernel with `cols` x columns a CTA (8 or 16; h takes their place later), then the
// warps' rings.
extern "C" int vq_moe_mlp_smem_bytes(int cols) { return cols * (kMlpH + 16) * 2 + kMlpWarps * kAsyncRing * kAsyncSlot; }

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// x: bf16 [rows, H] (row of pair p: p / x_row_div; row stride x_stride elements, 16-byte aligned rows); w13 / s13:
// the gate|up weight shuffled with its halves interleaved (shuffle_mma_weights: codes [E', 2I/16, H/64, 32, 16],
// scales [E', 2I/16, H/64, 64] bf16), gs13 fp32 [E', 2I] (row stride gs13_stride); w2 / s2 / gs2: the down weight
// ([E', H/16, I/64, ...], gs2 [E', H]); out: fp32 [split, n_pairs, H] partials (strides out_stride_s / _p, unit
// last); sorted_ids / block_expert: moe_align's with block_m 16 (n_blocks blocks). H = 2048, I = 512, split 1 or 2;
// cta: 0 = a CTA per block (16 columns), 1 = a CTA per n8 half (8 columns); early_scales: 1 to request each row
// tile's global scales ahead of their use (see mlp_body), 0 where they are used (for measuring; the same results);
// e4m3: 1 when s13 / s2 are the e4m3 scales (uint8 [E', N/16, K/64, 64] in the bf16 scales' order; early_scales 0
// only); group: row tiles a ring step, 1, or 2 or 4 (e4m3 only); prefetch: 1 to prefetch each warp's next ring step
// into L2 (mlp_request's PF; e4m3 with group 1 for cta 1 or group 4 for cta 0 only); else cudaErrorInvalidValue.
extern "C" int vq_moe_mlp_launch(const void* x, int x_row_div, int x_stride, const void* w13, const void* s13,
                                 const float* gs13, int gs13_stride, const void* w2, const void* s2, const float* gs2,
                                 int gs2_stride, float* out, long long out_stride_s, int out_stride_p,
                                 const int* sorted_ids, const int* block_expert, int n_blocks, int n_pairs, int H,
                                 int I, int split, int cta, int early_scales, int e4m3, int group, int prefetch,
                                 int pdl, void* stream) {
  static int configured[24][64] = {{0}};
  if (H != kMlpH || I != kMlpI || (split != 1 && split != 2) || (cta != 0 && cta != 1) ||
      (early_scales != 0 && early_scales != 1) || (e4m3 != 0 && (e4m3 != 1 || early_scales)) ||
      (group != 1 && ((group != 2 && group != 4) || !e4m3)) ||
      (prefetch != 0 && (prefetch != 1 || !e4m3 || group != (cta == 0 ? 4 : 1))) || n_blocks < 1 ||
      n_pairs < 1 || x_row_div < 1 || x_stride < H || x_stride % 8 || out_stride_p < H ||
      out_stride_s < (long long)n_pairs * out_stride_p)
    return (int)cudaErrorInvalidValue;
  const cudaStream_t st = (cudaStream_t)stream;
  const int cols = cta == 0 ? 16 : 8;
  const dim3 grid(n_blocks, split, cta == 0 ? 1 : 2);  // (block, slice, n8 half)
  const int smem = vq_moe_mlp_smem_bytes(cols);
#define VQ_MLP_ARGS                                                                                                   \
  pdl, (const __nv_bfloat16*)x, x_row_div, x_stride, (const uint8_t*)w13, (const uint8_t*)s13, gs13, gs13_stride, \
      (const uint8_t*)w2, (const uint8_t*)s2, gs2, gs2_stride, out, out_stride_s, out_stride_p, sorted_ids,         \
      block_expert, n_pairs, pdl
#define VQ_MLP(S, C, E, F, G, P, IDX)                                                                            \
  if (split == S && cols == C && early_scales == E && e4m3 == F && group == G && prefetch == P)                   \
    return launch_kernel(moe_mlp_kernel<S, C, (E) == 1, (F) == 1, G, (P) == 1>, configured[IDX], grid,            \
                         kMlpWarps * 32, smem, st, VQ_MLP_ARGS);
  VQ_MLP(1, 16, 1, 0, 1, 0, 0) VQ_MLP(2, 16, 1, 0, 1, 0, 1) VQ_MLP(1, 8, 1, 0, 1, 0, 2) VQ_MLP(2, 8, 1, 0, 1, 0, 3)
  VQ_MLP(1, 16, 0, 0, 1, 0, 4) VQ_MLP(2, 16, 0, 0, 1, 0, 5) VQ_MLP(1, 8, 0, 0, 1, 0, 6) VQ_MLP(2, 8, 0, 0, 1, 0, 7)
  VQ_MLP(1, 16, 0, 1, 1, 0, 8) VQ_MLP(2, 16, 0, 1, 1, 0, 9) VQ_MLP(1, 8, 0, 1, 1, 0, 10) VQ_MLP(2, 8, 0, 1, 1, 0, 11)
  VQ_MLP(1, 16, 0, 1, 2, 0, 12) VQ_MLP(2, 16, 0, 1, 2, 0, 13) VQ_MLP(1, 8, 0, 1, 2, 0, 14) VQ_MLP(2, 8, 0, 1, 2, 0, 15)
  VQ_MLP(1, 16, 0, 1, 4, 0, 16) VQ_MLP(2, 16, 0, 1, 4, 0, 17) VQ_MLP(1, 8, 0, 1, 4, 0, 18) VQ_MLP(2, 8, 0, 1, 4, 0, 19)
  VQ_MLP(1, 16, 0, 1, 4, 1, 20) VQ_MLP(2, 16, 0, 1, 4, 1, 21) VQ_MLP(1, 8, 0, 1, 1, 1, 22) VQ_MLP(2, 8, 0, 1, 1, 1, 23)
#undef VQ_MLP
#undef VQ_MLP_ARGS
  return (int)cudaErrorInvalidValue;
}
