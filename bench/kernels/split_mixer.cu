// A batch-1 Gated DeltaNet mixer in three launches without clusters, the first two overlapping: measured by
// bench/kernels/bench_split_mixer.py (a probe, not an engine kernel).
//
// Today a batch-1 GDN layer's mixer is five dependent launches (~25 us on the H100 for ~12.5 us of bytes); one launch
// on thread-block clusters (cluster_layer.cu, sixty-first session) was correct but ran in two waves, as an H100 holds
// only 15 clusters of 8 or 30 of 4. Here the dependencies are split so that no launch needs another CTA's result
// except through a launch boundary, and the biggest weight stream does not wait for the smaller one:
//
//   A  qk_kernel (128 CTAs of 256): after its PDL wait, x = h / rms(h), then q | k = silu((W[0:4096] @ x) * wscale)
//      into global memory (32 rows a CTA; 8.4 MB of codes, streamed through registers), and it releases its
//      dependents right after the wait: B's CTAs start next to A's.
//   B  mixer_kernel (128 CTAs of 256, ~213 KB of shared memory: one an SM, next to one of A's): CTA b takes value head
//      j = b / 4 and its 32 state rows [32s, 32s + 32), s = b % 4. Before its PDL wait (mode 0) it bulk-copies
//      its 32 v rows and 32 z rows (128 KB), the state rows (16 KB) and the output projection's 32 columns of those
//      rows (64 KB) into shared memory and multiplies v and z: all of that needs only h, which A's predecessor wrote
//      before A released B (read with .cg loads); `mode` 1 moves all of it after the wait (3 serial launches), mode 2
//      only the product (A then releases B before its own wait, so B's copies overlap A's predecessor). After the
//      wait: q and k of QK head j / 2 from A, the delta rule on the 32 rows (state stored back), then
//        P_b[n] = oscale * sum over its 32 columns i of Wo[n, 128j + 32s + i] * o_i * silu(z_i)
//        sumsq_b = sum of o_i^2 over its rows
//      The gated RMSNorm's scale is a per value head factor of the partial (u = o / rms_j * silu(z)): the CTA does not
//      need the other slices' o.
//   C  reduce_kernel (64 CTAs of 256): h' = bf16(h + sum_j (sum_s P_{4j+s}) / sqrt(sum_s sumsq_{4j+s} / 128 + 1e-6)),
//      in a fixed order (deterministic).
//
// The weights sit where the engine keeps them: qkv|z rows row-major (the probe's stand-in for the 16-row tiles of
// whole rows), the output projection in the FP8 MMA kernel's fragment layout (kernels/fp8/mma.py shuffle_fp8_mma:
// [N/16][K/64][2 halves][32 lanes][16 bytes], half h of a 64-k chunk holding its k [32h, 32h + 32)), so that B's 32
// columns of a 16-row tile are one contiguous 512-byte half: 128 bulk copies of 512 B. Lane l = 4g + t of such a half
// holds, for byte bb (word bb / 4, byte bb % 4), row g + 8 ((bb / 2) & 1) and k 16 (bb / 8) + 2t + (bb & 1) +
// 8 ((bb / 4) & 1) (the mma.m16n8k16 A fragment, PTX ISA). The layer's arithmetic is bench_cluster_layer.py's
// (conv1d and the b|a rows left out: ~0.3 MB of 36).

#include "probe_common.cuh"

namespace {

using namespace probe;

constexpr int kH = kHidden;
constexpr int kQkRows = 4096;      // q (16 heads x 128) then k
constexpr int kVRow0 = 4096, kZRow0 = 8192;  // value head j's v rows at kVRow0 + 128 j, z rows at kZRow0 + 128 j
constexpr int kVHeads = 32, kDk = 128, kSlices = 4, kSlice = kDk / kSlices;  // 32 rows of a value head a CTA
constexpr int kCtas = kVHeads * kSlices;  // 128 (A: 32 q | k rows each; B: one slice each)
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kRowBytes = kH;             // one row of e4m3 codes
constexpr int kVzBytes = 2 * kSlice * kRowBytes;  // 131072: the slice's v rows then its z rows
constexpr int kOutTiles = kH / 16;        // 128 row tiles of the output projection
constexpr int kHalfBytes = 512;           // 16 rows x 32 k
constexpr int kWoBytes = kOutTiles * kHalfBytes;  // 65536
constexpr int kStBytes = kSlice * kDk * 4;        // 16384
constexpr int kOutChunks = (kVHeads * kDk) / 64;  // 64-k chunks of the output projection's 4096 columns
constexpr int kSmall = kSlice * 3;                // floats: yv, zr, og
constexpr int kSmem = kVzBytes + kWoBytes + kStBytes + kSmall * 4 + 2 * 8;
static_assert((kVzBytes + kWoBytes + kStBytes + kSmall * 4) % 8 == 0, "mbarriers 8-byte aligned");
static_assert(kSmem <= 232448, "one CTA an SM");

// timeline stamps (bench_split_mixer.py --timeline): %globaltimer (ns) of an event, the earliest (atomicMin) or the
// latest (atomicMax) over the launch's CTAs, into stamps[event] (null: not recorded). Events (kEv*): A start, A's wait
// returned, A end; B start, B's v | z copies landed, B's wait returned, B's state + out-projection copies landed, B
// end; C start, C's wait returned, C end. Thread 0 of each CTA records; a start is the CTA's first instruction.
enum { kEvAStart, kEvAWait, kEvAEnd, kEvBStart, kEvBVz, kEvBWait, kEvBWo, kEvBEnd, kEvCStart, kEvCWait, kEvCEnd,
       kEvents };
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// stamps[2 e] the earliest, stamps[2 e + 1] the latest CTA's time of event e
__device__ __forceinline__ void stamp(unsigned long long* stamps, int e) {
  if (stamps == nullptr || threadIdx.x != 0) return;
  const unsigned long long t = now_ns();
  atomicMin(stamps + 2 * e, t);
  atomicMax(stamps + 2 * e + 1, t);
}

// x = h / rms(h): the lane's 64 elements (j * 32 + lane) * 16 .. + 16 for j < 4, the columns of the uint4 it reads
// from every row. Every warp computes the whole sum itself (h is 4 KB, from L2): no shared memory, no block barrier.
__device__ __forceinline__ void lane_x(const __nv_bfloat16* h, float (&xr)[64]) {
  const int lane = threadIdx.x & 31;
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint4 v = ld_cg(reinterpret_cast<const uint4*>(h) + (j * 32 + lane) * 2 + e);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[q]));
        xr[j * 16 + e * 8 + 2 * q] = f.x, xr[j * 16 + e * 8 + 2 * q + 1] = f.y;
        ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
      }
    }
  const float r = rsqrtf(warp_sum(ss) / kH + 1e-6f);
#pragma unroll
  for (int i = 0; i < 64; ++i) xr[i] *= r;
}

// the lane's share of one row's dot product (4 uint4 of codes, columns as lane_x's)
__device__ __forceinline__ float lane_dot(const uint4 (&c)[4], const float (&xr)[64]) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t words[4] = {c[j].x, c[j].y, c[j].z, c[j].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float f[4];
      e4m3x4(words[q], f);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc = fmaf(f[e], xr[j * 16 + q * 4 + e], acc);
    }
  }
  return acc;
}

// A: q | k rows [32 b, 32 b + 32): warp w rows 32 b + 4 w .. + 4, two at a time
__global__ void __launch_bounds__(kThreads) qk_kernel(const uint8_t* __restrict__ w, const __nv_bfloat16* h,
                                                      float* __restrict__ qk, float wscale, int release_first,
                                                      unsigned long long* stamps) {
  stamp(stamps, kEvAStart);
  if (release_first) {  // mode 2: B's CTAs may start (and request their weights) while A's predecessor runs
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    pdl_wait();
  } else {
    pdl_wait_and_release();  // released after the wait: B may read h before its own wait
  }
  stamp(stamps, kEvAWait);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // the CTA's 64 KB into L2 at once (after the wait: not competing with the predecessor's stream): the loads below
  // keep only 2-3 in flight a lane at A's register count
  if (threadIdx.x == 0) prefetch_l2(w + (size_t)blockIdx.x * 32 * kRowBytes, 32 * kRowBytes);
  float xr[64];
  lane_x(h, xr);
  const int row0 = blockIdx.x * 32 + warp * 4;
#pragma unroll
  for (int rr = 0; rr < 4; rr += 2) {
    uint4 c[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        c[r][j] = ld_nc(reinterpret_cast<const uint4*>(w + (size_t)(row0 + rr + r) * kRowBytes) + j * 32 + lane);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float y = warp_sum(lane_dot(c[r], xr)) * wscale;
      if (lane == 0) qk[row0 + rr + r] = silu(y);
    }
  }
  __syncthreads();
  stamp(stamps, kEvAEnd);
}

struct MixerParams {
  const uint8_t* w;       // [12288][2048] e4m3: qkv|z rows, row-major
  const uint8_t* wo;      // [128][64][2][32][16] e4m3: the 2048 x 4096 output projection, shuffle_fp8_mma's layout
  float* state;           // [32 value heads][128 rows][128] fp32, read and written
  const __nv_bfloat16* h; // [2048] the residual (input)
  const float* qk;        // [4096] A's silu(q) | silu(k)
  float* partial;         // [128][2048] out: P_b
  float* sumsq;           // [128] out: sumsq_b
  float wscale, oscale, g, beta;
  unsigned long long* stamps;  // the timeline's (null: none)
  int mode;               // 0: requests and the v | z product before the PDL wait; 1: both after it (the A/B's
                          // baseline); 2: requests before, the product after (A released B before its own wait)
};

__global__ void __launch_bounds__(kThreads, 1) mixer_kernel(const MixerParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint8_t* vz = smem;                             // [64][2048]: v rows then z rows
  uint8_t* wo = smem + kVzBytes;                  // [128 tiles][512]
  float* st = reinterpret_cast<float*>(smem + kVzBytes + kWoBytes);  // [32][128]
  float* yv = st + kSlice * kDk;                  // [32] silu(v)
  float* zr = yv + kSlice;                        // [32] z
  float* og = zr + kSlice;                        // [32] o, then o * silu(z)
  const uint32_t bar = smem_u32(og + kSlice);     // 2 mbarriers: v | z rows; state + output projection
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x, j = b / kSlices, s = b % kSlices, c = j / 2;
  stamp(p.stamps, kEvBStart);
  float* gst = p.state + ((size_t)j * kDk + kSlice * s) * kDk;
  if (tid == 0) {
    mbar_init(bar, 1);
    mbar_init(bar + 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto request = [&]() {  // warp 0: 8 copies of 16 KB (v, z), the state rows, 128 halves of the output projection
    if (warp != 0) return;
    if (lane == 0) {
      mbar_expect_tx(bar, kVzBytes);
      mbar_expect_tx(bar + 8, kStBytes + kWoBytes);
    }
    __syncwarp();
    if (lane < 4) {
      bulk_copy(smem_u32(vz) + lane * 16384u, p.w + (size_t)(kVRow0 + kDk * j + kSlice * s) * kRowBytes + lane * 16384,
                16384u, bar);
    } else if (lane < 8) {
      bulk_copy(smem_u32(vz) + lane * 16384u,
                p.w + (size_t)(kZRow0 + kDk * j + kSlice * s) * kRowBytes + (lane - 4) * 16384, 16384u, bar);
    } else if (lane == 8) {
      bulk_copy(smem_u32(st), gst, kStBytes, bar + 8);
    }
    // the output projection's columns [128 j + 32 s, + 32): chunk 2 j + s / 2, half s % 2 of every row tile
    const int chunk = 2 * j + s / 2, half = s % 2;
    for (int t = lane; t < kOutTiles; t += 32)
      bulk_copy(smem_u32(wo) + t * kHalfBytes, p.wo + (((size_t)t * kOutChunks + chunk) * 2 + half) * kHalfBytes,
                kHalfBytes, bar + 8);
  };
  // v | z rows against x: warp w rows [8 w, 8 w + 8) of the 64 (warps 0-3 v, 4-7 z)
  auto vz_rows = [&]() {
    float xr[64];
    lane_x(p.h, xr);
    mbar_wait0(bar);
    stamp(p.stamps, kEvBVz);
#pragma unroll 2
    for (int r = 8 * warp; r < 8 * warp + 8; ++r) {
      uint4 cw[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) cw[q] = reinterpret_cast<const uint4*>(vz + (size_t)r * kRowBytes)[q * 32 + lane];
      const float y = warp_sum(lane_dot(cw, xr)) * p.wscale;
      if (lane == 0) {
        if (r < kSlice) yv[r] = silu(y);
        else zr[r - kSlice] = y;
      }
    }
  };
  if (p.mode != 1) request();
  if (p.mode == 0) vz_rows();
  pdl_wait_and_release();
  stamp(p.stamps, kEvBWait);
  if (p.mode == 1) request();
  if (p.mode != 0) vz_rows();
  // q and k of QK head c (A's, after the wait): the lane's 4 of each, normalised
  float qn[4], kn[4];
  {
    const float4 q4 = __ldcg(reinterpret_cast<const float4*>(p.qk + kDk * c) + lane);
    const float4 k4 = __ldcg(reinterpret_cast<const float4*>(p.qk + kQkRows / 2 + kDk * c) + lane);
    const float qs = rsqrtf(warp_sum(q4.x * q4.x + q4.y * q4.y + q4.z * q4.z + q4.w * q4.w)) * rsqrtf((float)kDk);
    const float ks = rsqrtf(warp_sum(k4.x * k4.x + k4.y * k4.y + k4.z * k4.z + k4.w * k4.w));
    qn[0] = q4.x * qs, qn[1] = q4.y * qs, qn[2] = q4.z * qs, qn[3] = q4.w * qs;
    kn[0] = k4.x * ks, kn[1] = k4.y * ks, kn[2] = k4.z * ks, kn[3] = k4.w * ks;
  }
  mbar_wait0(bar + 8);
  stamp(p.stamps, kEvBWo);
  __syncthreads();  // yv, zr
  // the delta rule: warp w rows [4 w, 4 w + 4) of the slice; the new rows stored back to global memory
#pragma unroll
  for (int r = 4 * warp; r < 4 * warp + 4; ++r) {
    float sn[4];
    const float o = delta_row(st + r * kDk, yv[r], qn, kn, p.g, p.beta, sn);
    reinterpret_cast<float4*>(gst + (size_t)r * kDk)[lane] = make_float4(sn[0], sn[1], sn[2], sn[3]);
    if (lane == 0) og[r] = o;
  }
  __syncthreads();
  if (warp == 0) {  // sumsq, then u = o * silu(z) in place (the 1 / rms factor is C's)
    const float o = og[lane];
    const float ss = warp_sum(o * o);
    if (lane == 0) p.sumsq[b] = ss;
    og[lane] = o * silu(zr[lane]);
  }
  __syncthreads();
  // the output projection: warp w row tiles [16 w, 16 w + 16); lane l = 4 g + t: rows g, g + 8 of a tile; its 8 k
  // values (header's map) fixed for every tile
  const int g = lane >> 2, t = lane & 3;
  float ul[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) ul[i] = og[16 * (i >> 2) + 8 * ((i >> 1) & 1) + 2 * t + (i & 1)];
  for (int tile = 16 * warp; tile < 16 * warp + 16; ++tile) {
    const uint4 v = reinterpret_cast<const uint4*>(wo + tile * kHalfBytes)[lane];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    float a0 = 0.f, a1 = 0.f;  // rows g, g + 8
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // word q: bytes 4q .. 4q + 3 -> (g, k0), (g, k0 + 1), (g + 8, k0), (g + 8, k0 + 1)
      float f[4];
      e4m3x4(words[q], f);
      a0 = fmaf(f[0], ul[2 * q], fmaf(f[1], ul[2 * q + 1], a0));
      a1 = fmaf(f[2], ul[2 * q], fmaf(f[3], ul[2 * q + 1], a1));
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      a0 += __shfl_xor_sync(0xffffffffu, a0, o);
      a1 += __shfl_xor_sync(0xffffffffu, a1, o);
    }
    if (t == 0) {
      p.partial[(size_t)b * kH + 16 * tile + g] = a0 * p.oscale;
      p.partial[(size_t)b * kH + 16 * tile + g + 8] = a1 * p.oscale;
    }
  }
  __syncthreads();
  stamp(p.stamps, kEvBEnd);
}

// C: h_out[n] = bf16(h[n] + sum over value heads j (in order) of inv_j * sum_s P_{4j+s}[n]); CTA: 32 outputs, warp w
// the value heads [4 w, 4 w + 4)
__global__ void __launch_bounds__(kThreads) reduce_kernel(const float* partial, const float* sumsq,
                                                          const __nv_bfloat16* h, __nv_bfloat16* h_out,
                                                          unsigned long long* stamps) {
  stamp(stamps, kEvCStart);
  pdl_wait_and_release();
  stamp(stamps, kEvCWait);
  __shared__ float inv[kVHeads];
  __shared__ float acc[kWarps][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < kVHeads) {
    const float* ss = sumsq + kSlices * tid;
    inv[tid] = rsqrtf((__ldcg(ss) + __ldcg(ss + 1) + __ldcg(ss + 2) + __ldcg(ss + 3)) / kDk + 1e-6f);
  }
  __syncthreads();
  const int n = blockIdx.x * 32 + lane;
  float v[4][kSlices];
#pragma unroll
  for (int jj = 0; jj < 4; ++jj)
#pragma unroll
    for (int s = 0; s < kSlices; ++s) v[jj][s] = __ldcg(partial + (size_t)((4 * warp + jj) * kSlices + s) * kH + n);
  float a = 0.f;
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) a += ((v[jj][0] + v[jj][1]) + (v[jj][2] + v[jj][3])) * inv[4 * warp + jj];
  acc[warp][lane] = a;
  __syncthreads();
  if (warp == 0) {
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) tot += acc[w][lane];
    h_out[n] = __float2bfloat16(__bfloat162float(h[n]) + tot);
  }
  __syncthreads();
  stamp(stamps, kEvCEnd);
}

int configure() {
  static bool done = false;
  if (done) return 0;
  cudaError_t err = cudaFuncSetAttribute(mixer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  // the other kernels' CTAs leave room for a mixer CTA next to theirs
  err = prefer_max_shared(err, {(const void*)qk_kernel, (const void*)reduce_kernel, (const void*)stream_kernel});
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return (int)err;
  }
  done = true;
  return 0;
}

}  // namespace

extern "C" int vq_sm_smem() { return kSmem; }

// registers a thread of kernel `which` (0: qk_kernel, 1: mixer_kernel, 2: reduce_kernel); -1 on a CUDA error
extern "C" int vq_sm_registers(int which) {
  const void* k = which == 0   ? (const void*)qk_kernel
                  : which == 1 ? (const void*)mixer_kernel
                               : (const void*)reduce_kernel;
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, k) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return a.numRegs;
}

// A: qk [4096] fp32 = silu(W[0:4096] @ (h / rms(h)) * wscale); w [12288][2048] e4m3, h [2048] bf16; release_first
// 1 for B's mode 2 (B launched before A's predecessor ends), else 0
extern "C" int vq_sm_qk_launch(const void* w, const void* h, float* qk, float wscale, int release_first,
                               unsigned long long* stamps, int pdl, void* stream) {
  if (int err = configure()) return err;
  void* args[] = {&w, &h, &qk, &wscale, &release_first, &stamps};
  return launch((const void*)qk_kernel, args, dim3(kCtas), kThreads, 0, 1, pdl, (cudaStream_t)stream);
}

// B: pointers and mode as MixerParams says (mode 2 needs A launched with release_first 1); stamps: the layer's
// [kEvents][2] timeline words or null, as for A and C
extern "C" int vq_sm_mixer_launch(const void* w, const void* wo, float* state, const void* h, const float* qk,
                                  float* partial, float* sumsq, float wscale, float oscale, float g, float beta,
                                  int mode, unsigned long long* stamps, int pdl, void* stream) {
  if (mode < 0 || mode > 2) return (int)cudaErrorInvalidValue;
  if (int err = configure()) return err;
  MixerParams p = {reinterpret_cast<const uint8_t*>(w), reinterpret_cast<const uint8_t*>(wo), state,
                   reinterpret_cast<const __nv_bfloat16*>(h), qk, partial, sumsq, wscale, oscale, g, beta, stamps,
                   mode};
  void* args[] = {&p};
  return launch((const void*)mixer_kernel, args, dim3(kCtas), kThreads, kSmem, 1, pdl, (cudaStream_t)stream);
}

// C: h_out [2048] bf16 from h, partial [128][2048] and sumsq [128]
extern "C" int vq_sm_reduce_launch(const float* partial, const float* sumsq, const void* h, void* h_out,
                                   unsigned long long* stamps, int pdl, void* stream) {
  if (int err = configure()) return err;
  void* args[] = {&partial, &sumsq, &h, &h_out, &stamps};
  return launch((const void*)reduce_kernel, args, dim3(kH / 32), kThreads, 0, 1, pdl, (cudaStream_t)stream);
}

// The MoE's stand-in (probe_common.cuh's stream_kernel) on `ctas` CTAs
extern "C" int vq_sm_stream_launch(const void* w, long long n16, const void* h, void* h_out, unsigned* sink, int ctas,
                                   int pdl, void* stream) {
  if (int err = configure()) return err;
  return stream_launch(w, n16, h, h_out, sink, ctas, pdl, (cudaStream_t)stream);
}
