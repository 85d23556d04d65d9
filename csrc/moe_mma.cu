// NVFP4 expert GEMM for decode-sized batches on the tensor cores (sm_90: the dequantizer's mul.bf16x2 needs
// it; written for the H200).
//
// out[s, pair, n] = sum over k in split s of W[e, n, k] * x[pair / x_row_div, k]   (fp32 partials)
// for the pairs of the expert blocks that moe_align made (16 pairs per block, sentinel n_pairs for
// padding), expert e = block_expert[block]. With apply_alpha the per-row global scale times 2^9 is
// applied (down projection); without it the raw sums carry the 2^-9 of the dequantization (gate/up, whose
// finishing kernel applies the scales). Host side: vibeqwen_kernels/moe/mma_cuda.py.
//
// Why not Triton: Triton's Hopper path gives the register-A wgmma a 64x16x16 tile and waits for each one
// to finish before dequantizing the next, and reads the codes two bytes at a time from shared memory; on
// the H200 the MoE kernels moved ~1 TB/s. Here the codes are shuffled at load time so that one 16-byte
// load per lane holds, for 4 consecutive k16 steps, exactly the 8 codes of the lane's mma.m16n8k16 A
// fragment per step; they go from registers to the tensor cores without touching shared memory.
//
// Layouts (made by shuffle_mma_weights in mma_cuda.py), per expert e, 16-row tile T, 64-k chunk C:
//   codes  uint8 [E, N/16, K/64, 32 lanes, 4 steps, 4 bytes]: lane (g = lane/4, t = lane%4), step j,
//          byte b = 2h + p holds row 16T + g + 8h, k = 64C + 16j + 2t + p in its low nibble and
//          k + 8 in its high nibble (E2M1 codes).
//   scales uint8 [E, N/16, K/64, 8 (g), 4 steps, 2 (h)]: e4m3 bits of the block scale of row 16T + g + 8h
//          for the 16 k of step j (4 lanes of a quad read the same 8 bytes: one transaction).
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (bf16).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kWarps = 4;          // one 16-row tile per warp: 64 output rows per CTA
constexpr int kBlockPairs = 16;    // pairs per expert block (moe_align's block_m), two n8 halves
constexpr int kGroup = 4;          // 64-k chunks per register group (prefetched one group ahead)

// bf16 bits of (e4m3 value * 2^117), both halves: multiplies codes placed as bf16 bits * 2^-126 into
// e2m1 * scale * 2^-9, always a normal bf16 (exact). Same constant as the Triton kernels' _SCALE_BIAS.
__device__ uint32_t scale_lut_entry(uint32_t bits) {
  uint32_t e = (bits >> 3) & 15, m = bits & 7;
  float v = e ? ldexpf(1.0f + m / 8.0f, (int)e - 7) : ldexpf(m / 8.0f, -6);
  v = ldexpf(v, 117);
  if (bits & 128) v = -v;
  uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return h | (h << 16);
}

// Two E2M1 codes in bits 15:12 and 31:28 of w (the rest ignored) -> their values times the scales in s
// (bf16x2). The sign bit is already bf16's; the magnitude bits move to 8:6 (exponent LSBs + first mantissa
// bit), which reads as e2m1 * 2^-126 and the scale's 2^117 makes e2m1 * scale * 2^-9, exactly.
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t w, uint32_t s) {
  uint32_t out;
  asm("{\n"
      ".reg .b32 m, sg;\n"
      "and.b32 m, %1, 0x70007000;\n"
      "shr.b32 m, m, 6;\n"
      "and.b32 sg, %1, 0x80008000;\n"
      "or.b32 m, m, sg;\n"
      "mul.rn.bf16x2 %0, m, %2;\n"
      "}\n"
      : "=r"(out)
      : "r"(w), "r"(s));
  return out;
}

// 4 code bytes b0..b3 (8 codes) + scales -> the 4 A registers of one m16n8k16 step (the Triton kernels'
// _E2M1_ASM, written per nibble pair). prmt puts b0 in bits 15:8 and b1 in 31:24 (w01), b2 and b3 likewise
// (w23): the high nibbles sit in bits 15:12 / 31:28, the low ones after a shift left by 4.
// a0 = low nibbles of b0|b1, a1 = low nibbles of b2|b3, a2 = high of b0|b1, a3 = high of b2|b3.
__device__ __forceinline__ void dequant8(uint32_t w, uint32_t s01, uint32_t s23, uint32_t (&a)[4]) {
  const uint32_t w01 = __byte_perm(w, 0, 0x1404), w23 = __byte_perm(w, 0, 0x3424);
  a[2] = e2m1_pair(w01, s01);
  a[3] = e2m1_pair(w23, s23);
  a[0] = e2m1_pair(w01 << 4, s01);
  a[1] = e2m1_pair(w23 << 4, s23);
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// One register group (kGroup 64-k chunks starting at chunk c of the split) into the accumulators.
// x0 / x1: the staged x columns of the two n8 halves (x1 only read when kTwo).
template <bool kTwo>
__device__ __forceinline__ void group_mma(const uint4 (&wv)[kGroup], const uint2 (&sv)[kGroup], const uint2* x0,
                                          const uint2* x1, const uint32_t* lut, int t, int c, float (&acc0)[4],
                                          float (&acc1)[4]) {
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    const uint32_t wq[4] = {wv[i].x, wv[i].y, wv[i].z, wv[i].w};
    const uint32_t sb[2] = {sv[i].x, sv[i].y};
    // quad t ^ i: step (c + i) * 4 + j has the staging swizzle (c + i) & 3 = i (c % kGroup == 0)
    const uint2* q0 = x0 + (t ^ i) + (c + i) * 16;
    const uint2* q1 = x1 + (t ^ i) + (c + i) * 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = sb[j >> 1] >> ((j & 1) * 16);
      uint32_t a[4];
      dequant8(wq[j], lut[word & 0xff], lut[(word >> 8) & 0xff], a);
      const uint2 b0 = q0[j * 4];  // uint2 units: 4 quads per k16 step
      mma16816(acc0, a, b0.x, b0.y);
      if (kTwo) {
        const uint2 b1 = q1[j * 4];
        mma16816(acc1, a, b1.x, b1.y);
      }
    }
  }
}

// The K loop of one warp: the next register group's loads are in flight while this one is dequantized and
// multiplied; the last group has nothing to prefetch.
template <bool kTwo>
__device__ __forceinline__ void main_loop(const uint4* wp, const uint2* sp, uint4 (&wv)[kGroup], uint2 (&sv)[kGroup],
                                          const uint2* x0, const uint2* x1, const uint32_t* lut, int t, int per,
                                          float (&acc0)[4], float (&acc1)[4]) {
  int c = 0;
  for (; c + kGroup < per; c += kGroup) {
    uint4 nv[kGroup];
    uint2 ns[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      nv[i] = load_stream(wp + (c + kGroup + i) * 32);
      ns[i] = __ldg(sp + (c + kGroup + i) * 8);
    }
    group_mma<kTwo>(wv, sv, x0, x1, lut, t, c, acc0, acc1);
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      wv[i] = nv[i];
      sv[i] = ns[i];
    }
  }
  group_mma<kTwo>(wv, sv, x0, x1, lut, t, c, acc0, acc1);
}

__global__ void __launch_bounds__(kWarps * 32) moe_mma_kernel(
    const __nv_bfloat16* __restrict__ x, int x_row_div, int x_stride, const uint8_t* __restrict__ w,
    const uint8_t* __restrict__ s, const float* __restrict__ gs, int gs_stride_e, float* __restrict__ out,
    long long out_stride_s, int out_stride_p, const int* __restrict__ sorted_ids,
    const int* __restrict__ block_expert, int n_pairs, int N, int K, int split, int apply_alpha) {
  __shared__ uint32_t lut[256];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);

  const int blk = blockIdx.x;
  const int e = block_expert[blk];
  if (e < 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kchunks = K / 64, per = kchunks / split, c0 = blockIdx.z * per;
  const int krange = per * 64, k0 = c0 * 64;
  // x staged in B-fragment order: per column and k16 step s, lane quad t holds (2t, 2t+1, 2t+8, 2t+9) in 8
  // bytes (one 64-bit read per step, quads swizzled, see below); +16 elements per column keep the reads of
  // the 8 columns free of bank conflicts
  const int xs_stride = krange + 16;
  const int tile = blockIdx.y * kWarps + warp;
  const int ntiles = N / 16;
  const bool tile_ok = tile < ntiles;

  const size_t base = ((size_t)e * ntiles + (tile_ok ? tile : 0)) * kchunks + c0;
  const uint4* wp = reinterpret_cast<const uint4*>(w + base * 512) + lane;
  const uint2* sp = reinterpret_cast<const uint2*>(s + base * 64) + g;

  // first register group in flight before the x tile is staged
  uint4 wv[kGroup];
  uint2 sv[kGroup];
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    wv[i] = load_stream(wp + i * 32);
    sv[i] = __ldg(sp + i * 8);
  }

  for (int i = tid; i < 256; i += kWarps * 32) lut[i] = scale_lut_entry(i);
  const int vec_per_col = krange / 8;
  for (int i = tid; i < kBlockPairs * vec_per_col; i += kWarps * 32) {
    const int col = i / vec_per_col, kk = (i - col * vec_per_col) * 8;
    const int pair = sorted_ids[blk * kBlockPairs + col];
    uint4 v = make_uint4(0, 0, 0, 0);
    if (pair < n_pairs)
      v = *reinterpret_cast<const uint4*>(x + (size_t)(pair / x_row_div) * x_stride + k0 + kk);
    // kk = 16 s + 8 h: elements 2t, 2t+1 of the 8 go to word 2 q + h of step s, quad q = t ^ ((s >> 2) & 3)
    // (the swizzle spreads these stores over all banks; the loop reads quad t ^ i in register group slot i)
    const int st = kk >> 4, sw = (st >> 2) & 3;
    uint32_t* dst = reinterpret_cast<uint32_t*>(xs + col * xs_stride) + st * 8 + ((kk >> 3) & 1);
    dst[2 * (0 ^ sw)] = v.x;
    dst[2 * (1 ^ sw)] = v.y;
    dst[2 * (2 ^ sw)] = v.z;
    dst[2 * (3 ^ sw)] = v.w;
  }
  __syncthreads();
  if (!tile_ok) return;
  const bool second_half = sorted_ids[blk * kBlockPairs + 8] < n_pairs;  // warp-uniform

  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  const uint2* x0 = reinterpret_cast<const uint2*>(xs + g * xs_stride);
  const uint2* x1 = reinterpret_cast<const uint2*>(xs + (g + 8) * xs_stride);
  // two copies of the main loop: blocks with pairs in both n8 halves (rare in decode) and the rest, so the
  // common case issues no predicated-off instructions for the second half
  if (second_half)
    main_loop<true>(wp, sp, wv, sv, x0, x1, lut, t, per, acc0, acc1);
  else
    main_loop<false>(wp, sp, wv, sv, x0, x1, lut, t, per, acc0, acc1);

  // c0, c1: row g, columns 2t, 2t+1; c2, c3: row g + 8
  const int row0 = tile * 16 + g;
  float alpha0 = 1.f, alpha1 = 1.f;
  if (apply_alpha) {
    alpha0 = gs[(size_t)e * gs_stride_e + row0] * 512.f;
    alpha1 = gs[(size_t)e * gs_stride_e + row0 + 8] * 512.f;
  }
  float* o = out + (long long)blockIdx.z * out_stride_s;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (half == 1 && !second_half) break;
    const float* acc = half ? acc1 : acc0;
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int pair = sorted_ids[blk * kBlockPairs + half * 8 + 2 * t + cc];
      if (pair < n_pairs) {
        o[(size_t)pair * out_stride_p + row0] = acc[cc] * alpha0;
        o[(size_t)pair * out_stride_p + row0 + 8] = acc[2 + cc] * alpha1;
      }
    }
  }
}

}  // namespace

extern "C" int vq_moe_mma_smem_bytes(int K, int split) {
  return kBlockPairs * (K / split + 16) * 2;
}

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
extern "C" int vq_moe_mma_launch(const void* x, int x_row_div, int x_stride, const void* w, const void* s,
                                 const float* gs, int gs_stride_e, float* out, long long out_stride_s,
                                 int out_stride_p, const int* sorted_ids, const int* block_expert,
                                 int n_blocks, int n_pairs, int N, int K, int split, int apply_alpha,
                                 void* stream) {
  const int smem = vq_moe_mma_smem_bytes(K, split);
  static int configured[64] = {0};  // per device: the opt-in to more than 48 KB of dynamic shared memory
  if (smem > 48 * 1024) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return (int)err;
    if (dev >= 64 || smem > configured[dev]) {
      err = cudaFuncSetAttribute(moe_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) return (int)err;
      if (dev < 64) configured[dev] = smem;
    }
  }
  dim3 grid(n_blocks, (N / 16 + kWarps - 1) / kWarps, split);
  moe_mma_kernel<<<grid, kWarps * 32, smem, (cudaStream_t)stream>>>(
      (const __nv_bfloat16*)x, x_row_div, x_stride, (const uint8_t*)w, (const uint8_t*)s, gs, gs_stride_e, out,
      out_stride_s, out_stride_p, sorted_ids, block_expert, n_pairs, N, K, split, apply_alpha);
  return (int)cudaGetLastError();
}
