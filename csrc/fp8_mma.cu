// FP8 (E4M3) weight-only GEMM for decode-sized batches on the tensor cores (sm_90: mul.bf16x2):
//
//   out[m, n] = scale[n] * sum_k W[n, k] x[m, k]      (M <= 64 rows of bf16 x; fp32 accumulation)
//
// or, with split > 1, the raw fp32 partial sums of split s over its K range into ws[s, m, n] (the caller's
// reduce kernel sums the splits in order and applies the scale). Host side: vibeqwen_kernels/fp8/mma.py.
//
// Why: the Triton W8A16 kernels moved the attention and GDN projections' weights at 30-45% of the copy
// bandwidth at decode batch sizes (H200: 0.64 ms a step at batch 1, 1.06 ms at batch 32 for 1.28 GB).
//
// The weight is shuffled at load time (shuffle_fp8_mma in fp8/mma.py) so that each lane's two 16-byte loads per
// 64-k chunk hold, for the chunk's 4 k16 steps, exactly the E4M3 codes of its mma.m16n8k16 A fragment:
//   codes uint8 [N/16 tiles, K/64 chunks, 2 halves, 32 lanes, 16 bytes]: lane (g = lane/4, t = lane%4), step j: bytes
//   8 (j % 2)..+7 of half j / 2 = A registers a0..a3 of the step, two codes each (the fragment's halves q = 0, 1):
//   a0 = row g, k = 16j + 2t + q; a1 = row g + 8, same k; a2 = row g, k + 8; a3 = row g + 8, k + 8 (rows within the
//   tile, k within the chunk). Each load of a warp reads 512 contiguous bytes (whole 32-byte sectors); with a lane's
//   32 bytes contiguous, each load touched 32 sectors for 16 bytes of each and the next load fetched them again.
// An E4M3 code becomes an exact bf16 in registers (fp8_to_bf16x2: a byte permute, a shift, a mask-merge and a
// multiply by 2^120 for two codes); the per-row scale is applied to the fp32 sums at the end. With early launch (pdl
// 2) the kernel requests its first weights before its PDL wait (nothing the previous kernels write or read is
// touched before it).
//
// A CTA is W warps (4, 8, 12 or 16) in W / KS row tiles of 16 rows: KS warps (k slices: 1, 2 or 4) share a tile, slice
// s taking chunks s, s + KS, ... of every 256-k piece, and their sums are added in slice order through shared memory at
// the end (the sums depend on KS, not on W). Every warp streams its chunks' codes through registers, one group of 4 /
// KS chunks (2 vectors per lane each) prefetched a piece ahead, refilled chunk by chunk as it is used. x is staged per
// 256-k piece with cp.async into two buffers [8P rows][256 + 8] bf16 (rows M..8P-1 zero) and read with ldmatrix.x4 (one
// n8 tile, two k16 steps); each dequantized A fragment goes into the P n8 tiles (8P >= M).
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (bf16).
//
// With the conv epilogue (vq_fp8_mma_conv_launch: GDN's qkv|z projection of a decode step, one token per sequence,
// row m = sequence m) the output rows n < C (the conv channels) go through the depthwise causal conv1d + SiLU of
// kernels/conv1d (width 4) instead of being stored raw, and the sequence's conv state slot is shifted:
//
//   y        = bf16(scale[n] * sum_k W[n, k] x[m, k])                   (what the plain launch stores)
//   out[m,n] = bf16(silu(fma(y, w3, fma(s2, w2, fma(s1, w1, fma(s0, w0, 0))))))   s = state[slot[m], n, 0..2]
//   state[slot[m], n, :] = (s1, s2, y)                                  (s = 0 where has_initial_state[m] is false)
//
// with causal_conv1d_fwd_kernel's exact operations (fp32 fma chain in tap order, then x / (1 + ex2.approx(-x log2e))
// with div.full, as Triton lowers it), so the result equals the GEMM + conv launches bit for bit. One thread owns
// each (m, n): it reads the old state before it writes the new one. At one n8 tile (P = 1) the state, taps and slots
// are requested before the K loop (they do not depend on it), else in the epilogue. Rows n >= C are stored as usual.

#include "mma_common.cuh"

namespace {

constexpr int kChunks = 4;                 // 64-k chunks per register group = per staged x piece
constexpr int kPiece = 64 * kChunks;       // k per x piece
constexpr int kPieceStride = kPiece + 8;   // bf16 per staged row: 528-byte rows spread ldmatrix phases over banks

// 2^120 in both bf16 halves: an E4M3 code's 7 exponent-and-mantissa bits placed at bf16 bits 10..4 read as
// e4m3 * 2^-120 (exact, the subnormals included: bf16 keeps them), so this multiply gives the code's value.
constexpr uint32_t kTwo120 = 0x7B807B80u;

// Codes (bytes) b_lo and b_hi of word w (selector: their byte indices, see fp8_pair) -> bf16x2 (lo half b_lo).
// The permute puts each byte in the high byte of its half (sign at bit 15), the shift moves exponent and
// mantissa down 4 bits, the mask-merge keeps the sign from before the shift.
__device__ __forceinline__ uint32_t fp8_pair(uint32_t w, uint32_t sel) {
  const uint32_t h = __byte_perm(w, 0u, sel);
  const uint32_t v = ((h >> 4) & 0x07F007F0u) | (h & 0x80008000u);
  return as_u32(__hmul2(as_bf162(v), as_bf162(kTwo120)));
}

// One k16 step's two code words (lane's bytes 8j..8j+7) -> the 4 A registers.
__device__ __forceinline__ void dequant_step(uint32_t w0, uint32_t w1, uint32_t (&a)[4]) {
  a[0] = fp8_pair(w0, 0x1404u);  // bytes 0, 1: row g
  a[1] = fp8_pair(w0, 0x3424u);  // bytes 2, 3: row g + 8
  a[2] = fp8_pair(w1, 0x1404u);  // k + 8
  a[3] = fp8_pair(w1, 0x3424u);
}

// x piece [k, k + kPiece) of rows 0..m-1 into the buffer at shared address dst ([row][kPieceStride] bf16): warp w
// copies rows w, w + W, ..., lane l their 16 bytes at k + 8 l (one coalesced 512-byte row per warp instruction).
template <int W>
__device__ __forceinline__ void stage_piece(uint32_t dst, const __nv_bfloat16* x, int x_stride, int m, int k,
                                            int warp, int lane) {
#pragma unroll 1
  for (int row = warp; row < m; row += W)
    cp_async16(dst + (row * kPieceStride + lane * 8) * 2, x + (size_t)row * x_stride + k + lane * 8);
  cp_async_commit();
}

constexpr int kConvTaps = 4;  // the conv epilogue's width (Qwen3.6: linear_conv_kernel_dim)

// The conv epilogue's arguments (c == 0: none).
struct ConvEpi {
  const __nv_bfloat16* w;  // taps [c, kConvTaps], contiguous
  __nv_bfloat16* state;    // [slots, c, kConvTaps - 1], state_stride elements per slot, contiguous within
  long long state_stride;
  const long long* slots;  // [m] each row's (sequence's) state slot
  const bool* init;        // [m] has_initial_state: false reads a zero state
  int c;                   // conv channels: output rows n < c (a multiple of 16)
};

// This lane's conv operands for its accumulator elements: taps of rows n_lo / n_hi, the old state of each (column,
// row). Zeros where inactive, past m, or for a sequence without initial state.
template <int P>
struct ConvRegs {
  float w[2][kConvTaps];
  float s[P][2][2][kConvTaps - 1];  // [n8 tile][column 2t + cc][row lo / hi][state column]
  long long slot[P][2];
};

template <int P>
__device__ __forceinline__ void conv_load(const ConvEpi& cv, bool active, int n_lo, int m, int t, ConvRegs<P>& r) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < kConvTaps; ++j)
      r.w[h][j] = active ? __bfloat162float(cv.w[(size_t)(n_lo + 8 * h) * kConvTaps + j]) : 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int col = 8 * p + 2 * t + cc;
      const bool ok = active && col < m;
      const long long slot = ok ? cv.slots[col] : 0;
      const bool init = ok && cv.init[col];
      r.slot[p][cc] = slot;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __nv_bfloat16* src = cv.state + slot * cv.state_stride + (size_t)(n_lo + 8 * h) * (kConvTaps - 1);
#pragma unroll
        for (int j = 0; j < kConvTaps - 1; ++j) r.s[p][cc][h][j] = init ? __bfloat162float(src[j]) : 0.f;
      }
    }
}

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float div_full(float a, float b) {
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// causal_conv1d_fwd_kernel's value for one token whose window is the old state s and the new input y (its first
// token block: every tap is x + state, one of them 0), then SiLU, in its operation order.
__device__ __forceinline__ float conv_silu(const float (&s)[kConvTaps - 1], const float (&w)[kConvTaps], float y) {
  float a = 0.f;
#pragma unroll
  for (int j = 0; j < kConvTaps - 1; ++j) a = __fmaf_rn(__fadd_rn(0.f, s[j]), w[j], a);
  a = __fmaf_rn(__fadd_rn(y, 0.f), w[kConvTaps - 1], a);
  const float e = ex2_approx(__fmul_rn(__fsub_rn(0.f, a), 1.4426950408889634f));
  return div_full(a, __fadd_rn(e, 1.f));
}

// Output (column col = sequence, row n) through the conv: stores silu(conv) to out and shifts the state slot.
__device__ __forceinline__ void conv_store(const ConvEpi& cv, long long slot, int n, const float (&s)[kConvTaps - 1],
                                           const float (&w)[kConvTaps], __nv_bfloat16 y, __nv_bfloat16* dst) {
  *dst = __float2bfloat16_rn(conv_silu(s, w, __bfloat162float(y)));
  __nv_bfloat16* st = cv.state + slot * cv.state_stride + (size_t)n * (kConvTaps - 1);
#pragma unroll
  for (int j = 0; j + 1 < kConvTaps - 1; ++j) st[j] = __float2bfloat16_rn(s[j + 1]);
  st[kConvTaps - 2] = y;
}

template <int P, int W, int KS, bool CONV = false>
__global__ void __launch_bounds__(W * 32, W >= 12 ? 1 : W == 8 ? 2 : 4) fp8_mma_kernel(
    const __nv_bfloat16* __restrict__ x, int x_stride, int m, const uint8_t* __restrict__ w,
    const float* __restrict__ scale, int scale_stride, void* __restrict__ out, int out_stride, int out_f32,
    float* __restrict__ ws, int N, int K, int split, ConvEpi conv, int pdl) {
  static_assert(kChunks % KS == 0 && W % KS == 0, "k slices: 1, 2 or 4");
  constexpr int CPW = kChunks / KS;  // chunks per warp and piece: slice ks takes chunks ks, ks + KS, ...
  extern __shared__ __align__(16) unsigned char smem_raw[];  // [2 buffers][8P rows][kPieceStride] bf16
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ks = warp % KS;
  const int ntiles = N / 16, kchunks = K / 64;
  const int per = kchunks / split, c0 = blockIdx.y * per, k0 = c0 * 64;
  const int npieces = per / kChunks;
  const int tile = blockIdx.x * (W / KS) + warp / KS;
  const bool tile_ok = tile < ntiles;  // a warp past the matrix multiplies tile 0 and stores nothing

  // this lane's first vector of the split's first chunk (its second: + 32 vectors); chunk c: + 64 vectors
  const uint4* wp = reinterpret_cast<const uint4*>(w + ((size_t)(tile_ok ? tile : 0) * kchunks + c0) * 1024) + lane;
  if (pdl != 2) pdl_wait(pdl);  // outside early launch the previous kernel may have written the weights (load time)
  uint4 wv[2 * CPW];
#pragma unroll
  for (int i = 0; i < CPW; ++i) {
    wv[2 * i] = load_stream(wp + (i * KS + ks) * 64);
    wv[2 * i + 1] = load_stream(wp + (i * KS + ks) * 64 + 32);
  }
  // with early launch (pdl 2: decode graphs, whose kernels never write weights) the first group is requested before
  // the wait, so it streams while the previous kernel still runs
  if (pdl == 2) pdl_wait(pdl);
  // the conv epilogue's operands (its warps: k slice 0 of a tile with conv rows); at one n8 tile requested now, so
  // they arrive during the K loop
  ConvRegs<P> cr;
  const bool conv_rows = CONV && tile_ok && ks == 0 && tile * 16 < conv.c;
  if (CONV && P == 1) conv_load<P>(conv, conv_rows, tile * 16 + g, m, t, cr);

  const uint32_t xs0 = (uint32_t)__cvta_generic_to_shared(smem_raw);
  constexpr uint32_t kBufBytes = 8 * P * kPieceStride * 2;
  // padding rows (m..8P-1) zero in both buffers (never copied)
  for (int i = threadIdx.x; i < (8 * P - m) * (kPiece / 8); i += W * 32) {
    const int row = m + i / (kPiece / 8), col = (i % (kPiece / 8)) * 8;
    *reinterpret_cast<uint4*>(smem_raw + (row * kPieceStride + col) * 2) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(smem_raw + kBufBytes + (row * kPieceStride + col) * 2) = make_uint4(0, 0, 0, 0);
  }
  stage_piece<W>(xs0, x, x_stride, m, k0, warp, lane);

  float acc[P][4];
#pragma unroll
  for (int p = 0; p < P; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.f;
  // ldmatrix.x4: lane l addresses row l % 8 of the n8 tile, k offset 8 (l / 8) of the two steps' 32 k
  const uint32_t lane_off = ((lane & 7) * kPieceStride + (lane >> 3) * 8) * 2;

  for (int pc = 0; pc < npieces; ++pc) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();  // piece pc is in for every warp, and every warp is done with piece pc - 1's buffer
    const bool more = pc + 1 < npieces;
    if (more) stage_piece<W>(xs0 + ((pc + 1) & 1) * kBufBytes, x, x_stride, m, k0 + (pc + 1) * kPiece, warp, lane);
    const uint32_t xb = xs0 + (pc & 1) * kBufBytes + lane_off;
    const uint4* nwp = wp + (pc + 1) * kChunks * 64;
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const int ci = i * KS + ks;  // the chunk within the piece
      const uint32_t q[8] = {wv[2 * i].x, wv[2 * i].y, wv[2 * i].z, wv[2 * i].w,
                             wv[2 * i + 1].x, wv[2 * i + 1].y, wv[2 * i + 1].z, wv[2 * i + 1].w};
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        uint32_t a0[4], a1[4];
        dequant_step(q[2 * j], q[2 * j + 1], a0);
        dequant_step(q[2 * j + 2], q[2 * j + 3], a1);
#pragma unroll
        for (int p = 0; p < P; ++p) {
          uint32_t b[4];
          ldmatrix_x4(b, xb + (p * 8 * kPieceStride + (4 * ci + j) * 16) * 2);
          mma16816(acc[p], a0, b[0], b[1]);
          mma16816(acc[p], a1, b[2], b[3]);
        }
      }
      if (more) {
        wv[2 * i] = load_stream(nwp + ci * 64);
        wv[2 * i + 1] = load_stream(nwp + ci * 64 + 32);
      }
    }
  }

  if (KS > 1) {  // the tile's k slices summed in slice order through shared memory (the x buffers, now free)
    float* red = reinterpret_cast<float*>(smem_raw);  // [W][P * 4][32 lanes]
    __syncthreads();
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int r = 0; r < 4; ++r) red[(warp * P * 4 + p * 4 + r) * 32 + lane] = acc[p][r];
    __syncthreads();
    if (ks != 0) return;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int s2 = 1; s2 < KS; ++s2) acc[p][r] += red[((warp + s2) * P * 4 + p * 4 + r) * 32 + lane];
  }
  if (!tile_ok) return;

  // C fragment: acc[p][0..1] = row g, columns 8p + 2t + {0, 1}; acc[p][2..3] = row g + 8, the same columns
  const int n_lo = tile * 16 + g, n_hi = n_lo + 8;
  if (CONV && conv_rows) {  // split == 1, bf16 out (the launcher checks)
    if (P > 1) conv_load<P>(conv, true, n_lo, m, t, cr);
    const float s_lo = scale[n_lo * scale_stride], s_hi = scale[n_hi * scale_stride];
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(out);
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int col = 8 * p + 2 * t + cc;
        if (col >= m) continue;
        const size_t row = (size_t)col * out_stride;
        conv_store(conv, cr.slot[p][cc], n_lo, cr.s[p][cc][0], cr.w[0], __float2bfloat16_rn(acc[p][cc] * s_lo),
                   o + row + n_lo);
        conv_store(conv, cr.slot[p][cc], n_hi, cr.s[p][cc][1], cr.w[1], __float2bfloat16_rn(acc[p][2 + cc] * s_hi),
                   o + row + n_hi);
      }
  } else if (split == 1) {
    const float s_lo = scale[n_lo * scale_stride], s_hi = scale[n_hi * scale_stride];
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int col = 8 * p + 2 * t + cc;
        if (col >= m) continue;
        const size_t row = (size_t)col * out_stride;
        if (out_f32) {
          reinterpret_cast<float*>(out)[row + n_lo] = acc[p][cc] * s_lo;
          reinterpret_cast<float*>(out)[row + n_hi] = acc[p][2 + cc] * s_hi;
        } else {
          reinterpret_cast<__nv_bfloat16*>(out)[row + n_lo] = __float2bfloat16_rn(acc[p][cc] * s_lo);
          reinterpret_cast<__nv_bfloat16*>(out)[row + n_hi] = __float2bfloat16_rn(acc[p][2 + cc] * s_hi);
        }
      }
  } else {
    float* o = ws + (size_t)blockIdx.y * m * N;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int col = 8 * p + 2 * t + cc;
        if (col >= m) continue;
        o[(size_t)col * N + n_lo] = acc[p][cc];
        o[(size_t)col * N + n_hi] = acc[p][2 + cc];
      }
  }
}

}  // namespace

// Dynamic shared memory of a launch for m rows and W warps: two x pieces of 8P rows (P = n8 tiles: 1, 2, 4 or
// 8), or the k slices' reduction buffer (W x 4P x 32 floats) where that is larger.
extern "C" int vq_fp8_mma_smem_bytes(int m, int warps) {
  const int p = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
  const int xbuf = 2 * 8 * p * kPieceStride * 2, red = warps * 4 * p * 32 * 4;
  return xbuf > red ? xbuf : red;
}

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// x: bf16 [m, K] (row stride x_stride elements, rows 16-byte aligned), 1 <= m <= 64; w: the shuffled codes of a
// [N, K] weight (N % 16 == 0, K % (256 * split) == 0); scale: float32, scale[n * scale_stride] (stride 0: one
// value); split == 1: out [m, N] (row stride out_stride) in bf16 (out_f32 0) or fp32 (1), scaled; split > 1: ws
// fp32 [split, m, N], raw sums. warps: 4, 8, 12 or 16 per CTA; kslices: 1, 2 or 4 warps per 16-row tile (each takes
// every kslices-th chunk of a piece; summed in slice order through shared memory): warps / kslices tiles per CTA.
// Else cudaErrorInvalidValue.
extern "C" int vq_fp8_mma_launch(const void* x, int x_stride, int m, const void* w, const float* scale,
                                 int scale_stride, void* out, int out_stride, int out_f32, float* ws, int N, int K,
                                 int split, int warps, int kslices, int pdl, void* stream) {
  static int configured[4][3][4][64] = {{{{0}}}};
  if (m < 1 || m > 64 || N < 16 || N % 16 || K < kPiece || split < 1 || K % (kPiece * split) ||
      (warps != 4 && warps != 8 && warps != 12 && warps != 16) ||
      (kslices != 1 && kslices != 2 && kslices != 4))
    return (int)cudaErrorInvalidValue;
  const int smem = vq_fp8_mma_smem_bytes(m, warps);
  const cudaStream_t st = (cudaStream_t)stream;
  const int rows_per_cta = warps / kslices;  // 16-row tiles
  const dim3 grid((N / 16 + rows_per_cta - 1) / rows_per_cta, split);
  const int pi = m <= 8 ? 0 : m <= 16 ? 1 : m <= 32 ? 2 : 3;
  const int wi = warps / 4 - 1, ki = kslices == 1 ? 0 : kslices == 2 ? 1 : 2;
  const ConvEpi no_conv = {nullptr, nullptr, 0, nullptr, nullptr, 0};
#define VQ_FP8_ARGS pdl, x, x_stride, m, w, scale, scale_stride, out, out_stride, out_f32, ws, N, K, split, no_conv, pdl
#define VQ_FP8_K(P, W, KS)                                                                                   \
  if (warps == W && kslices == KS)                                                                           \
    return launch_kernel(fp8_mma_kernel<P, W, KS>, configured[wi][ki][pi], grid, W * 32, smem, st, VQ_FP8_ARGS);
#define VQ_FP8_W(P, W) VQ_FP8_K(P, W, 1) VQ_FP8_K(P, W, 2) VQ_FP8_K(P, W, 4)
#define VQ_FP8_CASE(PI, P)                                       \
  case PI:                                                       \
    VQ_FP8_W(P, 4) VQ_FP8_W(P, 8) VQ_FP8_W(P, 12) VQ_FP8_W(P, 16) \
    break;
  switch (pi) {
    VQ_FP8_CASE(0, 1)
    VQ_FP8_CASE(1, 2)
    VQ_FP8_CASE(2, 4)
    VQ_FP8_CASE(3, 8)
  }
#undef VQ_FP8_CASE
#undef VQ_FP8_W
#undef VQ_FP8_K
#undef VQ_FP8_ARGS
  return (int)cudaErrorInvalidValue;
}

// The conv-epilogue launch (see the header): GDN's qkv|z projection of a decode step, m rows = m sequences of one
// token. x, w, scale, out (bf16, row stride out_stride), N, K and warps as vq_fp8_mma_launch (split 1; 8, 12 or 16
// warps); conv_w: bf16 [conv_c, 4] contiguous taps; conv_state: bf16 [slots, conv_c, 3] (state_stride elements per
// slot); slots: int64 [m]; init: bool [m]; 16 <= conv_c <= N, conv_c % 16 == 0. Rows n >= conv_c are stored raw.
// Returns 0, a CUDA launch error code, or cudaErrorInvalidValue for arguments out of range.
extern "C" int vq_fp8_mma_conv_launch(const void* x, int x_stride, int m, const void* w, const float* scale,
                                      int scale_stride, void* out, int out_stride, int N, int K, int warps,
                                      int kslices, const void* conv_w, void* conv_state, long long state_stride,
                                      const long long* slots, const bool* init, int conv_c, int pdl, void* stream) {
  static int configured[4][3][4][64] = {{{{0}}}};
  if (m < 1 || m > 64 || N < 16 || N % 16 || K < kPiece || K % kPiece ||
      (kslices != 1 && kslices != 2 && kslices != 4) || (warps != 8 && warps != 12 && warps != 16) || conv_c < 16 ||
      conv_c % 16 || conv_c > N || conv_w == nullptr || conv_state == nullptr || slots == nullptr || init == nullptr ||
      state_stride < (long long)conv_c * (kConvTaps - 1))
    return (int)cudaErrorInvalidValue;
  const int smem = vq_fp8_mma_smem_bytes(m, warps);
  const cudaStream_t st = (cudaStream_t)stream;
  const dim3 grid((N / 16 + warps / kslices - 1) / (warps / kslices), 1);
  const int pi = m <= 8 ? 0 : m <= 16 ? 1 : m <= 32 ? 2 : 3;
  const int wi = warps / 4 - 1, ki = kslices == 1 ? 0 : kslices == 2 ? 1 : 2;
  const ConvEpi cv = {(const __nv_bfloat16*)conv_w, (__nv_bfloat16*)conv_state, state_stride, slots, init, conv_c};
#define VQ_FP8C_ARGS pdl, x, x_stride, m, w, scale, scale_stride, out, out_stride, 0, (float*)nullptr, N, K, 1, cv, pdl
#define VQ_FP8C_K(P, W, KS)                                                                                 \
  if (warps == W && kslices == KS)                                                                          \
    return launch_kernel(fp8_mma_kernel<P, W, KS, true>, configured[wi][ki][pi], grid, W * 32, smem, st,      \
                         VQ_FP8C_ARGS);
#define VQ_FP8C_W(P, W) VQ_FP8C_K(P, W, 1) VQ_FP8C_K(P, W, 2) VQ_FP8C_K(P, W, 4)
#define VQ_FP8C_CASE(PI, P)                               \
  case PI:                                                \
    VQ_FP8C_W(P, 8) VQ_FP8C_W(P, 12) VQ_FP8C_W(P, 16) break;
  switch (pi) {
    VQ_FP8C_CASE(0, 1)
    VQ_FP8C_CASE(1, 2)
    VQ_FP8C_CASE(2, 4)
    VQ_FP8C_CASE(3, 8)
  }
#undef VQ_FP8C_CASE
#undef VQ_FP8C_W
#undef VQ_FP8C_K
#undef VQ_FP8C_ARGS
  return (int)cudaErrorInvalidValue;
}
