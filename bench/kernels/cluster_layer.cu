// A batch-1 Gated DeltaNet mixer as ONE launch on thread-block clusters: the premise of a 3-launch decode layer,
// measured by bench/kernels/bench_cluster_layer.py (a probe, not an engine kernel).
//
// Today a batch-1 GDN layer's mixer is five dependent launches (input RMSNorm, qkv|z GEMM + conv, delta rule + gated
// norm, output projection, split-K reduce + residual + RMSNorm: ~25 us on the H100 for ~11 us of bytes), and the
// sixtieth session measured that no in-kernel hand-off across the whole grid beats a launch boundary. Here the only
// hand-offs inside the launch are between the 8 CTAs of one cluster (barrier.cluster, distributed shared memory), and
// every weight byte is requested before the PDL wait: a CTA's six 16-row tiles of qkv|z (192 KB) land in its shared
// memory by bulk copies; its 16 pieces of the output projection (64 KB) are prefetched into L2, loaded into registers
// once the tiles are multiplied. The weights sit where the engine's FP8 layout (kernels/fp8/mma.py) keeps them: 16-row
// tiles of whole rows, 4 KB pieces of 16 rows x 256 k (the probe orders bytes row-major within them; the engine's
// fragment order moves the same bytes), so the fused layer would need no second copy of any weight.
//
// The layer (shapes of Qwen3.6's GDN: 16 QK heads of 128, 32 value heads of 128, value head j on QK head j / 2,
// hidden 2048), QK head c = cluster c, CTA rank r of 8 (the probe's arithmetic; conv1d and the b|a rows are left
// out: ~0.3 MB of 36):
//   x      = h * rsqrt(mean(h^2) + 1e-6)                                  (every CTA norms h itself: no norm launch)
//   y      = (W @ x) * wscale over the CTA's tiles of the 12288 x 2048 qkv|z rows: q dims [16r, 16r + 16) of head
//            c (tile 8c + r), k's (tile 128 + 8c + r), those of value heads 2c and 2c + 1 (tiles 256 + 16c + r and
//            256 + 16c + 8 + r) and of their z (512 + ...)
//   q, k   = silu(y) gathered over the cluster's 8 CTAs (128 each): barrier 1; qn = q / |q| / sqrt(128), kn = k / |k|
//   S row  = g S; S += beta (silu(v_i) - S.kn) kn; o_i = S.qn       (the delta rule on the CTA's 16 rows of each
//            value head; the state rows are bulk-copied in before the PDL wait and stored back)
//   o, z   gathered over the cluster (256 each): barrier 2; u = o / sqrt(mean over the head's 128 of o^2 + 1e-6) *
//            silu(z), the cluster's 256 columns of the output projection's input
//   part_c[n] = (Wo[n, 256c .. 256c + 256) @ u) * oscale for rank r's rows n in [256 r, 256 r + 256)
// and a second launch (reduce_kernel) adds the 16 clusters' partials (in order) to the residual: h' = bf16(h + sum).
// The MoE launch would norm h' itself, as this kernel norms h. stream_kernel stands in for the MoE between layers:
// it reads 16 MB of weights after its PDL wait and copies h.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kH = 2048;          // hidden size
constexpr int kCluster = 8;       // CTAs a QK head
constexpr int kClusters = 16;     // QK heads
constexpr int kCtas = kClusters * kCluster;
constexpr int kDk = 128;          // key / value head dim
constexpr int kSlice = kDk / kCluster;  // 16 rows of each vector a CTA
constexpr int kRows = 6 * kSlice;       // q, k, v0, v1, z0, z1: 96
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kWBytes = kRows * kH;     // 196608: the CTA's qkv|z rows in shared memory
constexpr int kStateBytes = 2 * kSlice * kDk * 4;  // 16384: 16 rows of each value head, fp32
constexpr int kTile = kSlice * kH;     // 32768: one 16-row tile of qkv|z
constexpr int kOutK = 4096;             // the output projection's input: 32 value heads x 128
constexpr int kPiece = 4096;            // bytes of a 16-row x 256-k piece of the output projection
constexpr int kOutVec = kSlice * kPiece / 16 / kThreads;  // 8 uint4 a thread: 16 pieces a CTA
constexpr int kSmall = 256 + 256 + 256 + 32 + 32;  // floats: qk, o (gathered), z (gathered), yv, red
constexpr int kSmem = kWBytes + kStateBytes + kH * 4 + kSmall * 4 + 3 * 8;
static_assert(kSmem <= 232448, "one CTA an SM");
static_assert((kWBytes + kStateBytes + kH * 4 + kSmall * 4) % 8 == 0, "mbarriers 8-byte aligned");

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void pdl_wait_and_release() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(bar),
               "r"(bytes) : "memory");
}
// waits for phase 0 of the barrier; more than 2 s traps (a copy that never landed)
__device__ __forceinline__ void mbar_wait0(uint32_t bar) {
  long long t0 = 0;
  while (true) {
    uint32_t done;
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done) : "r"(bar) : "memory");
    if (done) return;
    long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (t0 == 0) t0 = now;
    else if (now - t0 > 2000000000ll) __trap();
  }
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// shared address `addr` of this CTA as the same variable's address in CTA `rank` of the cluster
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_cluster(uint32_t addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
// every thread of every CTA of the cluster arrives (release: its earlier writes, remote ones too) / waits (acquire)
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.f + __expf(-v)); }
// four e4m3 codes (byte i = element i) as floats
__device__ __forceinline__ void e4m3x4(uint32_t w, float (&f)[4]) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

struct LayerParams {
  const uint8_t* w;      // [12288][2048] e4m3: qkv|z rows (16-row tiles of 32 KB, row-major within)
  const uint4* wo;       // [128 row tiles][16 k groups][16 rows][256 k] e4m3: the 2048 x 4096 output projection
  float* state;          // [kClusters][2][kDk rows][kDk] fp32, read and written
  const __nv_bfloat16* h;  // [kH] the residual (input)
  float* partial;        // [kClusters][kH] out: each cluster's out-projection partial
  float wscale, oscale, g, beta;
  int late;              // 1: every weight / state request after the PDL wait (the A/B's baseline)
};

__global__ void __launch_bounds__(kThreads, 1) gdn_layer_kernel(const LayerParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint8_t* ws = smem;    // tiles q, k, v0, v1, z0, z1 (16 rows each)
  float* st = reinterpret_cast<float*>(smem + kWBytes);
  float* xs = reinterpret_cast<float*>(smem + kWBytes + kStateBytes);  // x
  float* qk = xs + kH;    // [256] q then k of the whole head (gathered)
  float* og = qk + 256;   // [256] o of both value heads (gathered: head 0's 128, head 1's), then u
  float* zg = og + 256;   // [256] z, gathered the same way
  float* yv = zg + 256;   // [32] silu(v) of the CTA's rows (v0 then v1)
  float* red = yv + 32;   // [32] block reductions
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(red + 32);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t rank = cluster_rank();
  const int cl = blockIdx.x / kCluster;
  const uint32_t bar0 = smem_u32(bars), ws0 = smem_u32(ws), st0 = smem_u32(st);
  float* gst0 = p.state + ((size_t)(cl * 2 + 0) * kDk + kSlice * rank) * kDk;
  float* gst1 = p.state + ((size_t)(cl * 2 + 1) * kDk + kSlice * rank) * kDk;
  // the CTA's tiles (see the file's comment) and its output-projection pieces: row tiles 16 rank + i, k group cl
  const int tiles[6] = {8 * cl + (int)rank, 128 + 8 * cl + (int)rank, 256 + 16 * cl + (int)rank,
                        256 + 16 * cl + 8 + (int)rank, 512 + 16 * cl + (int)rank, 512 + 16 * cl + 8 + (int)rank};
  const uint4* wo_piece0 = p.wo + ((size_t)(kSlice * rank) * (kOutK / 256) + cl) * (kPiece / 16);
  constexpr size_t kPieceStride = (size_t)(kOutK / 256) * (kPiece / 16);  // uint4 from a row tile's piece to the next
  if (tid == 0) {
    for (int i = 0; i < 3; ++i) mbar_init(bar0 + 8u * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  cluster_arrive();  // barrier 0: every CTA of the cluster runs before any writes another's shared memory
  auto request = [&]() {
    if (tid != 0) return;
    mbar_expect_tx(bar0, 2 * kTile);  // q | k tiles first: they gate barrier 1
    for (int i = 0; i < 2; ++i)
      for (int c = 0; c < kTile / 16384; ++c)
        bulk_copy(ws0 + i * kTile + c * 16384u, p.w + (size_t)tiles[i] * kTile + c * 16384, 16384u, bar0);
    mbar_expect_tx(bar0 + 8, 4 * kTile);
    for (int i = 2; i < 6; ++i)
      for (int c = 0; c < kTile / 16384; ++c)
        bulk_copy(ws0 + i * kTile + c * 16384u, p.w + (size_t)tiles[i] * kTile + c * 16384, 16384u, bar0 + 8);
    mbar_expect_tx(bar0 + 16, kStateBytes);
    bulk_copy(st0, gst0, kStateBytes / 2, bar0 + 16);
    bulk_copy(st0 + kStateBytes / 2, gst1, kStateBytes / 2, bar0 + 16);
    for (int i = 0; i < kSlice; ++i) prefetch_l2(wo_piece0 + i * kPieceStride, kPiece);
  };
  if (!p.late) request();
  pdl_wait_and_release();
  if (p.late) request();

  // x = h / rms(h): every thread 4 elements
  {
    const uint2 hv = reinterpret_cast<const uint2*>(p.h)[tid];
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hv.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hv.y));
    const float ss = warp_sum(a.x * a.x + a.y * a.y + b.x * b.x + b.y * b.y);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < kWarps; ++i) tot += red[i];
    const float r = rsqrtf(tot / kH + 1e-6f);
    reinterpret_cast<float4*>(xs)[tid] = make_float4(a.x * r, a.y * r, b.x * r, b.y * r);
    __syncthreads();
  }
  // lane's x: elements (j * 32 + lane) * 16 .. + 16 for j < 4 (the columns of the uint4s it reads from every row)
  float xr[64];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 16; e += 4) {
      const float4 v = reinterpret_cast<const float4*>(xs)[((j * 32 + lane) * 16 + e) / 4];
      xr[j * 16 + e] = v.x, xr[j * 16 + e + 1] = v.y, xr[j * 16 + e + 2] = v.z, xr[j * 16 + e + 3] = v.w;
    }
  auto row_dot = [&](int r) {  // row r of the CTA's 96 (tile r / 16, row r % 16)
    const uint4* row = reinterpret_cast<const uint4*>(ws + (size_t)r * kH);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = row[j * 32 + lane];
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float f[4];
        e4m3x4(words[q], f);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc = fmaf(f[e], xr[j * 16 + q * 4 + e], acc);
      }
    }
    return warp_sum(acc) * p.wscale;
  };
  // q | k rows: silu, then into every rank's qk (q dims 16 rank + i at qk[16 rank + i], k's at 128 + ...)
  mbar_wait0(bar0);
  __syncwarp();    // .aligned: the warp converged after the spin
  cluster_wait();  // barrier 0 (arrived at the start)
  for (int r = warp; r < 2 * kSlice; r += kWarps) {
    const float y = silu(row_dot(r));
    if (lane < kCluster) {
      const int at = (r < kSlice ? 0 : kDk) + kSlice * rank + (r % kSlice);
      st_cluster(map_rank(smem_u32(qk + at), lane), y);
    }
  }
  cluster_arrive();  // barrier 1: this CTA's q and k slices are in every rank
  mbar_wait0(bar0 + 8);
  for (int r = 2 * kSlice + warp; r < kRows; r += kWarps) {
    const float y = row_dot(r);
    if (r < 4 * kSlice) {
      if (lane == 0) yv[r - 2 * kSlice] = silu(y);
    } else if (lane < kCluster) {  // z row i of value head hh: into every rank's zg[128 hh + 16 rank + i]
      const int i = r - 4 * kSlice;
      st_cluster(map_rank(smem_u32(zg + kDk * (i / kSlice) + kSlice * rank + i % kSlice), lane), y);
    }
  }
  uint4 wo[kOutVec];  // from L2 (prefetched): in flight through the delta rule. j: row tile 16 rank + 2j + tid / 256
#pragma unroll
  for (int j = 0; j < kOutVec; ++j) wo[j] = ld_nc(wo_piece0 + (2 * j + tid / 256) * kPieceStride + tid % 256);
  mbar_wait0(bar0 + 16);
  __syncthreads();  // yv
  cluster_wait();   // barrier 1: the whole q and k

  // the delta rule: warp w takes rows w and w + 16 of the CTA's 32 (value head i / 16, row 16 rank + i % 16); o into
  // every rank's og. The new state rows stay in registers until barrier 2 is arrived at (its release would otherwise
  // wait for their global stores).
  float snew[2][4];
  {
    const float4 q4 = reinterpret_cast<const float4*>(qk)[lane];
    const float4 k4 = reinterpret_cast<const float4*>(qk + kDk)[lane];
    const float qs = rsqrtf(warp_sum(q4.x * q4.x + q4.y * q4.y + q4.z * q4.z + q4.w * q4.w)) * rsqrtf((float)kDk);
    const float ks = rsqrtf(warp_sum(k4.x * k4.x + k4.y * k4.y + k4.z * k4.z + k4.w * k4.w));
    const float qn[4] = {q4.x * qs, q4.y * qs, q4.z * qs, q4.w * qs};
    const float kn[4] = {k4.x * ks, k4.y * ks, k4.z * ks, k4.w * ks};
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      const int i = warp + kWarps * ii;
      const float4 s4 = reinterpret_cast<const float4*>(st + i * kDk)[lane];
      float s[4] = {s4.x * p.g, s4.y * p.g, s4.z * p.g, s4.w * p.g};
      const float kv = warp_sum(s[0] * kn[0] + s[1] * kn[1] + s[2] * kn[2] + s[3] * kn[3]);
      const float d = p.beta * (yv[i] - kv);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] = fmaf(d, kn[e], s[e]);
      const float o = warp_sum(s[0] * qn[0] + s[1] * qn[1] + s[2] * qn[2] + s[3] * qn[3]);
#pragma unroll
      for (int e = 0; e < 4; ++e) snew[ii][e] = s[e];
      if (lane < kCluster)
        st_cluster(map_rank(smem_u32(og + kDk * (i / kSlice) + kSlice * rank + i % kSlice), lane), o);
    }
  }
  cluster_arrive();  // barrier 2: this CTA's o and z are in every rank (no shared memory is touched remotely after)
  // the state rows: 2 rows of 128 fp32 a warp (rows w and w + 16 of the CTA's, as above)
#pragma unroll
  for (int ii = 0; ii < 2; ++ii) {
    const int i = warp + kWarps * ii;
    float* g = (i < kSlice ? gst0 : gst1) + (size_t)(i % kSlice) * kDk;
    reinterpret_cast<float4*>(g)[lane] = make_float4(snew[ii][0], snew[ii][1], snew[ii][2], snew[ii][3]);
  }
  cluster_wait();
  // u = o / rms(o of its head) * silu(z), all 256 in place in og: warp w < 8 takes 32 of them (head w / 4)
  if (warp < 8) {
    const int at = warp * 32 + lane;
    const float o = og[at];
    float s = warp_sum(o * o);
    if (lane == 0) red[warp] = s;
    __syncwarp();
    asm volatile("bar.sync 1, 256;" ::: "memory");  // the 8 warps' sums
    const int head = warp / 4;
    s = red[4 * head] + red[4 * head + 1] + red[4 * head + 2] + red[4 * head + 3];
    og[at] = o * rsqrtf(s / kDk + 1e-6f) * silu(zg[at]);
  }
  __syncthreads();
  // part_c rows 256 rank + 16 (2j + tid / 256) + (tid % 256) / 16: 16 lanes a row, lane's k (tid % 16) * 16 .. + 16
  {
    const int kofs = (tid % 16) * 16;
    float uk[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) uk[e] = og[kofs + e];
#pragma unroll
    for (int j = 0; j < kOutVec; ++j) {
      const uint32_t words[4] = {wo[j].x, wo[j].y, wo[j].z, wo[j].w};
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float f[4];
        e4m3x4(words[q], f);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc = fmaf(f[e], uk[q * 4 + e], acc);
      }
#pragma unroll
      for (int m = 8; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
      if (tid % 16 == 0)
        p.partial[(size_t)cl * kH + kH / kCluster * rank + kSlice * (2 * j + tid / 256) + (tid % 256) / 16] =
            acc * p.oscale;
    }
  }
}

// h_out = bf16(h + sum over the 16 clusters of partial, in order); 8 CTAs of 256
__global__ void __launch_bounds__(256) reduce_kernel(const float* __restrict__ partial, const __nv_bfloat16* h,
                                                     __nv_bfloat16* h_out) {
  pdl_wait_and_release();
  const int n = blockIdx.x * 256 + threadIdx.x;
  float tot = __bfloat162float(h[n]);
  float s = 0.f;
  for (int c = 0; c < kClusters; ++c) s += partial[(size_t)c * kH + n];
  h_out[n] = __float2bfloat16(tot + s);
}

// the MoE's stand-in: reads n16 uint4 of weights after its PDL wait (8 loads in flight a thread) and copies h
__global__ void __launch_bounds__(256) stream_kernel(const uint4* __restrict__ w, long long n16,
                                                     const __nv_bfloat16* h, __nv_bfloat16* h_out, unsigned* sink) {
  pdl_wait_and_release();
  const long long stride = (long long)gridDim.x * 256;
  uint32_t acc = 0;
  long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  for (; i + 7 * stride < n16; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = ld_nc(w + i + k * stride);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = ld_nc(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads
  for (int n = blockIdx.x * 256 + threadIdx.x; n < kH; n += (int)stride) h_out[n] = h[n];
}

int launch(const void* kernel, void** args, dim3 grid, int threads, int smem, int cluster, int pdl, cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster, attr[n].val.clusterDim.y = 1, attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  cudaError_t err = cudaLaunchKernelExC(&cfg, kernel, args);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return (int)err;
  }
  return (int)cudaGetLastError();
}

int configure() {
  static bool done = false;
  if (done) return 0;
  cudaError_t err = cudaFuncSetAttribute(gdn_layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(gdn_layer_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  // the small kernels prefer the whole carveout as shared memory, so that a mixer CTA of the next layer can be
  // resident next to theirs (its early requests overlapping them), as it could not on an SM configured for less
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(stream_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               (int)cudaSharedmemCarveoutMaxShared);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(reduce_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               (int)cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return (int)err;
  }
  done = true;
  return 0;
}

}  // namespace

extern "C" int vq_cl_smem() { return kSmem; }

// Clusters of `cluster` CTAs of gdn_layer_kernel's shape (512 threads, kSmem bytes) that can run at once
// (cudaOccupancyMaxActiveClusters); the launch needs 128 / 8 = 16 at cluster 8. -1 on a CUDA error.
extern "C" int vq_cl_max_clusters(int cluster) {
  if (configure()) return -1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kCtas);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, gdn_layer_kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return n;
}

// One layer's mixer (gdn_layer_kernel, 16 clusters of 8). Pointers as LayerParams says; pdl 0 or 1. Returns 0 or a
// CUDA error code.
extern "C" int vq_cl_layer_launch(const void* w, const void* wo, float* state, const void* h, float* partial,
                                  float wscale, float oscale, float g, float beta, int late, int pdl, void* stream) {
  if (int err = configure()) return err;
  LayerParams p = {reinterpret_cast<const uint8_t*>(w), reinterpret_cast<const uint4*>(wo), state,
                   reinterpret_cast<const __nv_bfloat16*>(h), partial, wscale, oscale, g, beta, late};
  void* args[] = {&p};
  return launch((const void*)gdn_layer_kernel, args, dim3(kCtas), kThreads, kSmem, kCluster, pdl,
                (cudaStream_t)stream);
}

// h_out [2048] bf16 = h + the 16 partials' sum (reduce_kernel).
extern "C" int vq_cl_reduce_launch(const float* partial, const void* h, void* h_out, int pdl, void* stream) {
  if (int err = configure()) return err;
  void* args[] = {&partial, &h, &h_out};
  return launch((const void*)reduce_kernel, args, dim3(kH / 256), 256, 0, 1, pdl, (cudaStream_t)stream);
}

// The MoE's stand-in (stream_kernel) on `ctas` CTAs: reads n16 uint4 at w, copies h [2048] bf16 to h_out.
extern "C" int vq_cl_stream_launch(const void* w, long long n16, const void* h, void* h_out, unsigned* sink, int ctas,
                                   int pdl, void* stream) {
  if (int err = configure()) return err;
  void* args[] = {&w, &n16, &h, &h_out, &sink};
  return launch((const void*)stream_kernel, args, dim3(ctas), 256, 0, 1, pdl, (cudaStream_t)stream);
}
