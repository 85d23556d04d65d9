// The NVFP4 A-fragment decoder and the 16-row tile epilogue that the expert GEMMs share (csrc/moe_mma.cu, the
// launch-per-GEMM kernels; csrc/moe_decode.cu, the one-launch decode MoE): the weight layout they read is
// described in moe_mma.cu (shuffle_mma_weights in kernels/moe/mma_cuda.py makes it). Inlined by
// kernels/cuda_build.py where a source includes it; everything in an anonymous namespace.

#pragma once

#include "mma_common.cuh"

namespace {

// A bf16x2 word whose bits 15, 8:6 (and 31, 24:22) hold an E2M1 code's sign and magnitude (the rest zero) reads
// as e2m1 * 2^-126 (the magnitude bits are the exponent's two LSBs and the first mantissa bit; exact for all 8
// magnitudes, the subnormal 0.5 included).
constexpr uint32_t kCodeMask = 0x81C081C0u;
// The code bits that no rotation of the word places (see dequant8), and the multiplier that does: three shifted
// copies of them (by 2, 7 and 12) that never overlap, so the product is their OR.
constexpr uint32_t kCodeRest = 0x001B001Bu;
constexpr uint32_t kCodeRestMul = (1u << 2) | (1u << 7) | (1u << 12);

// One step's code word w (8 codes, laid out by shuffle_mma_weights) + its scale word (bf16x2: row g's scale *
// 2^117 low, row g + 8's high) -> the 4 A registers of one m16n8k16 step, each e2m1 * scale * 2^-9 (exact).
// The codes sit where a mask (a[0]), a rotation by 3 or 6 and a mask (a[1], a[2]) or a mask, a multiply and a
// mask (a[3]) put them: 8 integer operations for 8 codes (two bytes of nibbles took 15: byte permutes, shifts,
// masks and merges). The scale halves are broadcast by the multiply's operand selectors (__low2bfloat162 /
// __high2bfloat162 fold into .H0_H0 / .H1_H1: checked in the sm_90 SASS).
__device__ __forceinline__ void dequant8(uint32_t w, uint32_t sword, uint32_t (&a)[4]) {
  const __nv_bfloat162 sv = as_bf162(sword);
  const __nv_bfloat162 s01 = __low2bfloat162(sv), s23 = __high2bfloat162(sv);
  a[0] = as_u32(__hmul2(as_bf162(w & kCodeMask), s01));
  a[1] = as_u32(__hmul2(as_bf162(__funnelshift_r(w, w, 3) & kCodeMask), s23));
  a[2] = as_u32(__hmul2(as_bf162(__funnelshift_r(w, w, 6) & kCodeMask), s01));
  a[3] = as_u32(__hmul2(as_bf162(((w & kCodeRest) * kCodeRestMul) & kCodeMask), s23));
}


// One 64-k chunk (cc: its index in the split; sw = cc & 3, its staging swizzle, passed where the caller knows it
// at compile time) into the accumulators. x0 / x1: the staged x columns of the two n8 halves (x1 only read when
// kTwo).
template <bool kTwo>
__device__ __forceinline__ void chunk_mma(const uint4& wv, const uint4& sv, const uint2* x0, const uint2* x1, int t,
                                          int cc, int sw, float (&acc0)[4], float (&acc1)[4]) {
  const uint32_t wq[4] = {wv.x, wv.y, wv.z, wv.w};
  const uint32_t sq[4] = {sv.x, sv.y, sv.z, sv.w};
  // quad t ^ sw of step 4 cc + j (the staging swizzle)
  const uint2* q0 = x0 + (t ^ sw) + cc * 16;
  const uint2* q1 = x1 + (t ^ sw) + cc * 16;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a[4];
    dequant8(wq[j], sq[j], a);
    const uint2 b0 = q0[j * 4];  // uint2 units: 4 quads per k16 step
    mma16816(acc0, a, b0.x, b0.y);
    if (kTwo) {
      const uint2 b1 = q1[j * 4];
      mma16816(acc1, a, b1.x, b1.y);
    }
  }
}


// Epilogue modes (the `epi` argument, bits): weights whose two N halves are interleaved per 16-row tile (tile t
// = rows 8t..8t+7 of the first half, then the same of the second: shuffle_mma_weights(interleave_halves=True),
// the gate|up matrix), and SiLU-and-mul (needs the interleaving: a tile's rows g and g + 8 are gate and up row
// j = 8t + g, both in one thread's accumulators).
constexpr int kEpiInterleaved = 1, kEpiSilu = 2;

// Where one warp's 16-row tile goes: output rows lo (accumulators c0, c1) and hi (c2, c3), their scales.
struct TileOut {
  float* o;
  float2 alpha;
  int out_stride_p, n_pairs, lo, hi, silu;
};

// The output rows (lo, hi) of lane group g of a 16-row tile under epilogue mode epi (see TileOut).
__device__ __forceinline__ int2 tile_rows(int epi, int N, int tile, int g) {
  const bool halves = epi & (kEpiInterleaved | kEpiSilu);
  return halves ? make_int2(8 * tile + g, N / 2 + 8 * tile + g) : make_int2(16 * tile + g, 16 * tile + g + 8);
}

// The global scales of lane group g's output rows (tile_rows) of a 16-row tile of expert e, where the epilogue applies
// them (apply_alpha or kEpiSilu), else zeros (unused). A caller requests them before the tile's K loop and passes
// them to tile_out: read there, after the loop, the warp (and the weight loads it would issue next) waits out their
// L2 round trip (Nsight Compute's stall samples, thirty-third session).
__device__ __forceinline__ float2 tile_scales(const float* gs, int gs_stride_e, int apply_alpha, int epi, int N, int e,
                                              int tile, int g) {
  if (!(apply_alpha || (epi & kEpiSilu))) return make_float2(0.f, 0.f);
  const int2 rows = tile_rows(epi, N, tile, g);
  const float* p = gs + (size_t)e * gs_stride_e;
  return make_float2(p[rows.x], p[rows.y]);
}

// fp32 sums (times the global scale * 2^9 with apply_alpha; rows back in the original order for interleaved
// weights), or bf16 h = silu(gate) * up (kEpiSilu: gs holds both halves' global scales; o is h [pairs, N / 2]).
// z: the K split the sums belong to (-1: blockIdx.z, the launches with one CTA per split). gs_lo_hi: the rows' global
// scales when the caller read them ahead (tile_rows' rows of expert e), else null: read here.
__device__ __forceinline__ TileOut tile_out(float* out, long long out_stride_s, int out_stride_p, int n_pairs,
                                            const float* gs, int gs_stride_e, int apply_alpha, int epi, int N, int e,
                                            int tile, int g, int z = -1, const float2* gs_lo_hi = nullptr) {
  TileOut d;
  // in floats: the bf16 output (h) comes with split 1 only
  d.o = out + (long long)(z < 0 ? (int)blockIdx.z : z) * out_stride_s;
  d.out_stride_p = out_stride_p;
  d.n_pairs = n_pairs;
  d.silu = epi & kEpiSilu;
  const int2 rows = tile_rows(epi, N, tile, g);
  d.lo = rows.x;
  d.hi = rows.y;
  if (!(apply_alpha || d.silu))
    d.alpha = make_float2(1.f, 1.f);
  else if (gs_lo_hi != nullptr)
    d.alpha = make_float2(gs_lo_hi->x * 512.f, gs_lo_hi->y * 512.f);
  else
    d.alpha = make_float2(gs[(size_t)e * gs_stride_e + d.lo] * 512.f, gs[(size_t)e * gs_stride_e + d.hi] * 512.f);
  return d;
}

// One n8 accumulator tile to the real pairs among its 8 columns (pairs: their sorted ids): c0, c1 are row lo,
// columns 2t, 2t+1; c2, c3 row hi; with silu, h at column lo in bf16.
__device__ __forceinline__ void store_n8(const TileOut& d, const float (&acc)[4], const int* pairs, int t) {
#pragma unroll
  for (int cc = 0; cc < 2; ++cc) {
    const int pair = pairs[2 * t + cc];
    if (pair >= d.n_pairs) continue;
    const size_t row = (size_t)pair * d.out_stride_p;
    if (d.silu) {
      const float gv = acc[cc] * d.alpha.x, uv = acc[2 + cc] * d.alpha.y;
      reinterpret_cast<__nv_bfloat16*>(d.o)[row + d.lo] = __float2bfloat16_rn(gv / (1.f + __expf(-gv)) * uv);
    } else {
      d.o[row + d.lo] = acc[cc] * d.alpha.x;
      d.o[row + d.hi] = acc[2 + cc] * d.alpha.y;
    }
  }
}


}  // namespace
