// Probe kernels for bench/kernels/probe_moe_mlp.py: what holds moe_mlp_kernel<2, 8> (a decode step's expert MLP,
// csrc/moe_mma.cu) at ~65% of the HBM rate when a read-only kernel over the same bytes and grid runs at the copy
// rate. Each probe runs moe_mlp_kernel's grid, prologue (pair ids, expert id, x staging) and per-warp cp.async ring
// over the same 192 chunks a warp (4 gate|up row tiles of 32 chunks, then 16 down tiles of 4), and varies one thing:
//
//   ORDER 0: the kernel's chunk order: warp w streams gate|up tiles w, w + 8, ... of its slice, 16 KB each, so a
//            CTA's 8 warps read 8 streams 16 KB apart, 2 KB a warp a ring step.
//   ORDER 1: at ring step s every warp reads 4 chunks of the same gate|up tile s (warp w: chunks 4w .. 4w + 3), so
//            the CTA reads one 16 KB run of codes (and one 4 KB run of scales) a step. The down phase is the
//            same in both orders (a step already takes 8 adjacent down tiles across the warps).
//   ORDER 2: order 0's chunks from an interleaved copy of the weights: each chunk's 512 code bytes and 128 scale
//            bytes in one 640-byte run, exactly its ring slot's layout (w13 / w2 point at the copies, s13 / s2 are
//            unused), so a ring step is one 2560-byte run instead of 2 KB of codes and 512 bytes of scales elsewhere:
//            whether the separate scale stream costs the DRAM more than its bytes.
//   ORDER 3: order 0, and with each ring step's request the next step's lines prefetched into L2 (prefetch.global.L2),
//            one more step of DRAM reads in flight without shared memory: whether the stream waits on bytes in
//            flight (Little's law at the H200's rate) rather than on the DRAM's efficiency.
//   WORK 0:  the chunks are only read out of the ring (their words XORed into a sink): the memory side alone.
//   WORK 1:  every chunk is dequantized and multiplied into accumulators as the kernel does (chunk_mma on the staged
//            x; no SiLU, h or epilogue stores): the kernel's main loop work.
//   RING:    ring slots a warp (8: the kernel's, 2 ring steps in flight; 16: 4 steps, and 2 CTAs an SM for shared
//            memory).
//
// Built by probe_moe_mlp.py with nvcc -I csrc (this file includes csrc/moe_mma.cu for its ring and MMA helpers);
// not part of the engine.

#include "moe_mma.cu"

namespace {

template <int ORDER, int WORK, int RING>
__global__ void __launch_bounds__(kMlpWarps * 32, RING == 8 ? 3 : 2) mlp_probe_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w13,
    const uint8_t* __restrict__ s13, const uint8_t* __restrict__ w2, const uint8_t* __restrict__ s2,
    const int* __restrict__ sorted_ids, const int* __restrict__ block_expert, int n_pairs,
    unsigned* __restrict__ sink) {
  constexpr int S = 2, COLS = 8, GT = kMlpGuTiles / S / kMlpWarps, DT = kMlpDnTiles / kMlpWarps;
  constexpr int PD = kMlpDnChunks / S, NG = GT * kMlpGuChunks, N = NG + DT * PD;
  __shared__ long long xrow[COLS];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int blk = blockIdx.x, j = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3, g = lane >> 2;
  const int* ids = sorted_ids + blk * kBlockPairs + 8 * blockIdx.z;
  const int pair = tid < COLS ? ids[tid] : 0;
  const int e = block_expert[blk];
  if (e < 0) return;
  if (__syncthreads_or(tid == 0 && ids[0] >= n_pairs)) return;
  const unsigned char* ring = smem_raw + COLS * (kMlpH + 16) * 2 + warp * RING * kAsyncSlot;
  const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
  // ORDER 2: 4 interleaved chunks (one 2560-byte run at src) into ring slots slot .. slot + 3, which have the same
  // layout: lane l copies 16-byte vectors l, l + 32, ..., l + 128
  auto copy_run = [&](int slot, const uint8_t* src) {
#pragma unroll
    for (int i = 0; i < 4 * kAsyncSlot / 512; ++i)
      cp_async16(ring_s + slot * kAsyncSlot + (lane + 32 * i) * 16, src + (lane + 32 * i) * 16);
  };
  // stream position p (a multiple of 4, < N) -> its first chunk's index in w13 / s13 (p < NG) or w2 / s2
  auto chunk_of = [&](int p) -> size_t {
    if (p < NG) {
      const int tile = ORDER != 1 ? j * (kMlpGuTiles / S) + warp + kMlpWarps * (p / kMlpGuChunks)
                                  : j * (kMlpGuTiles / S) + p / 4;
      const int c = ORDER != 1 ? p % kMlpGuChunks : 4 * warp;
      return ((size_t)e * kMlpGuTiles + tile) * kMlpGuChunks + c;
    }
    const int d = p - NG;
    return ((size_t)e * kMlpDnTiles + warp + kMlpWarps * (d / PD)) * kMlpDnChunks + j * PD + d % PD;
  };
  // stream position p -> 4 chunks into ring slots slot .. slot + 3, then a commit; ORDER 3: then the 128-byte lines
  // of step p + 4 (its 2 KB of codes: lanes 0-15, 512 bytes of scales: lanes 16-19) prefetched into L2
  auto request = [&](int p, int slot) {
    if (p < N) {
      const size_t off = chunk_of(p);
      const uint8_t *w = p < NG ? w13 : w2, *sc = p < NG ? s13 : s2;
      if (ORDER == 2)
        copy_run(slot, w + off * kAsyncSlot);
      else
        ring_copy<4>(ring_s, slot, lane, w + lane * 16, sc + lane * 16, off);
      if (ORDER == 3 && p + 4 < N && lane < 20) {
        const size_t nx = chunk_of(p + 4);
        const uint8_t* line = lane < 16 ? (p + 4 < NG ? w13 : w2) + nx * 512 + lane * 128
                                        : (p + 4 < NG ? s13 : s2) + nx * 128 + (lane - 16) * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < RING; c += 4) request(c, c);
  stage_columns_all<kMlpWarps * 32, COLS>(xs, xrow, x, x_row_div, x_stride, pair, n_pairs, 0, kMlpH, kMlpH + 16, tid);
  const uint2* x0 = reinterpret_cast<const uint2*>(xs + g * (kMlpH + 16));
  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  unsigned bits = 0;
#pragma unroll 1
  for (int p = 0; p < N; p += 4) {
    cp_async_wait_pending(RING / 4 - 1);
    uint4 wv[4], sv[4];
    ring_read<4, RING>(ring, p, lane, wv, sv);
    request(p + RING, p % RING);
    if (WORK) {
      const int cc = p < NG ? (ORDER != 1 ? p % kMlpGuChunks : 4 * warp) : (p - NG) % PD;
#pragma unroll
      for (int q = 0; q < 4; ++q) chunk_mma<false>(wv[q], sv[q], x0, x0, t, cc + q, (cc + q) & 3, acc0, acc1);
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) bits ^= wv[q].x ^ wv[q].y ^ wv[q].z ^ wv[q].w ^ sv[q].x ^ sv[q].w;
    }
  }
  bits ^= __float_as_uint(acc0[0] + acc0[1] + acc0[2] + acc0[3]);
  sink[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + tid] = bits;
}

}  // namespace

// The probe (order, work, ring; order 2: w13 / w2 the interleaved copies, s13 / s2 unused) over
// moe_mlp_kernel<2, 8>'s grid (n_blocks x 2 slices x 2 n8 halves); sink: uint32 [n_blocks * 2 * 2 * 256].
// Returns 0 or a CUDA error code.
extern "C" int vq_mlp_probe_launch(int order, int work, int ring, const void* x, int x_row_div, int x_stride,
                                   const void* w13, const void* s13, const void* w2, const void* s2,
                                   const int* sorted_ids, const int* block_expert, int n_blocks, int n_pairs,
                                   unsigned* sink, void* stream) {
  static int configured[12][64] = {{0}};
  const dim3 grid(n_blocks, 2, 2);
  const int smem = 8 * (kMlpH + 16) * 2 + kMlpWarps * ring * kAsyncSlot;
#define VQ_PROBE(O, W, R, IDX)                                                                                      \
  if (order == O && work == W && ring == R)                                                                         \
    return launch_kernel(mlp_probe_kernel<O, W, R>, configured[IDX], grid, kMlpWarps * 32, smem,                    \
                         (cudaStream_t)stream, 0, (const __nv_bfloat16*)x, x_row_div, x_stride, (const uint8_t*)w13, \
                         (const uint8_t*)s13, (const uint8_t*)w2, (const uint8_t*)s2, sorted_ids, block_expert,      \
                         n_pairs, sink);
  VQ_PROBE(0, 0, 8, 0) VQ_PROBE(1, 0, 8, 1) VQ_PROBE(0, 1, 8, 2) VQ_PROBE(1, 1, 8, 3)
  VQ_PROBE(0, 0, 16, 4) VQ_PROBE(1, 0, 16, 5) VQ_PROBE(0, 1, 16, 6) VQ_PROBE(1, 1, 16, 7)
  VQ_PROBE(2, 0, 8, 8) VQ_PROBE(2, 1, 8, 9) VQ_PROBE(3, 0, 8, 10) VQ_PROBE(3, 1, 8, 11)
#undef VQ_PROBE
  return (int)cudaErrorInvalidValue;
}
