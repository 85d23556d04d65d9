// A batch-1 Gated DeltaNet mixer as ONE launch on thread-block clusters: the premise of a 3-launch decode layer,
// measured by bench/kernels/bench_cluster_layer.py (a probe, not an engine kernel).
//
// Today a batch-1 GDN layer's mixer is five dependent launches (input RMSNorm, qkv|z GEMM + conv, delta rule + gated
// norm, output projection, split-K reduce + residual + RMSNorm: ~25 us on the H100 for ~11 us of bytes), and the
// sixtieth session measured that no in-kernel hand-off across the whole grid beats a launch boundary. Here the only
// hand-offs inside the launch are between the CTAs of one cluster (barrier.cluster, distributed shared memory), and
// every weight byte is requested before the PDL wait (bulk copies into shared memory, or L2 prefetches of what is
// loaded later). The weights sit where the engine's FP8 layout (kernels/fp8/mma.py) keeps them: 16-row tiles of whole
// rows (32 KB), and of the output projection 2 KB pieces of 16 rows x 128 k (one value head's columns; the probe
// orders bytes row-major within them, the engine's fragment order moves the same bytes), so the fused layer would
// need no second copy of any weight.
//
// The layer (shapes of Qwen3.6's GDN: 16 QK heads of 128, 32 value heads of 128, value head j on QK head j / 2,
// hidden 2048; the probe's arithmetic; conv1d and the b|a rows are left out: ~0.3 MB of 36):
//   x      = h * rsqrt(mean(h^2) + 1e-6)                                  (every CTA norms h itself: no norm launch)
//   y      = (W @ x) * wscale over the 12288 x 2048 qkv|z rows: q, k of QK head c at rows 128c, 2048 + 128c; v, z of
//            value head j at 4096 + 128j, 8192 + 128j
//   q, k   = silu(y) of the head, gathered over the cluster: barrier 1; qn = q / |q| / sqrt(128), kn = k / |k|
//   S row  = g S; S += beta (silu(v_i) - S.kn) kn; o_i = S.qn       (the delta rule on the CTA's rows of each
//            value head; the state rows are bulk-copied in before the PDL wait, stored back after barrier 2's arrive)
//   o, z   gathered over the cluster: barrier 2; u = o / sqrt(mean over the value head's 128 of o^2 + 1e-6) * silu(z)
//   part[n] = (Wo[n, the cluster's columns] @ u) * oscale for the CTA's share of the 2048 rows n
// and a second launch (reduce_kernel) adds the partials (in order) to the residual: h' = bf16(h + sum). The MoE launch
// would norm h' itself, as this kernel norms h. stream_kernel stands in for the MoE between layers: it reads 16 MB of
// weights after its PDL wait and copies h. Two shapes of 128 CTAs (512 threads, ~220 KB of shared memory each):
//
//   cluster 8 (gdn_layer8_kernel): cluster c = QK head c and its value heads 2c, 2c + 1; rank r's tiles: q and k dims
//     [16r, 16r + 16) (tiles 8c + r, 128 + 8c + r), those of both value heads' v and z (256 + 16c + r, 256 + 16c + 8 +
//     r, 512 + ...): 192 KB in shared memory; the 16 partials (one a cluster) of 256 columns, rank r's rows
//     [256r, 256r + 256). Needs 16 clusters of 8 resident at once, which an H100's uneven GPCs may not give.
//   cluster 4 (gdn_layer4_kernel): cluster j = value head j (two clusters a QK head, each computing the head's q and
//     k: their second read is hoped to hit L2); rank r's tiles: q, k, v dims [32r, 32r + 32) (8c + 2r, +1; 128 + 8c +
//     2r, +1; 256 + 8j + 2r, +1: 192 KB in shared memory) and z's (512 + 8j + 2r, +1), copied over q's and k's once
//     those are multiplied (prefetched into L2 before the wait); the 32 partials (one a value head) of 128 columns,
//     rank r's rows [512r, 512r + 512).

#include "probe_common.cuh"

namespace {

using namespace probe;

constexpr int kH = kHidden;       // hidden size
constexpr int kVHeads = 32;
constexpr int kDk = 128;          // key / value head dim
constexpr int kCtas = 128;
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kTile = 16 * kH;    // 32768: one 16-row tile of qkv|z
constexpr int kOutGroups = kVHeads;  // 128-k groups of the output projection (one a value head)
constexpr int kPieceVec = 16 * kDk / 16;  // uint4 of a 2 KB piece (16 rows x 128 k)
constexpr int kOutVec = 8;        // uint4 of output-projection codes a thread (64 KB a CTA)
constexpr int kWBytes = 6 * kTile;        // 196608: six tiles in shared memory
constexpr int kStateBytes = 32 * kDk * 4; // 16384: 32 state rows of 128 fp32
// shared memory: tiles, state rows, x (fp32), then the small arrays and 4 mbarriers
constexpr int kSmall = 256 + 256 + 256 + 32 + 32;  // floats: qk, o (gathered), z (gathered), yv, red
constexpr int kSmem = kWBytes + kStateBytes + kH * 4 + kSmall * 4 + 4 * 8;
static_assert(kSmem <= 232448, "one CTA an SM");
static_assert((kWBytes + kStateBytes + kH * 4 + kSmall * 4) % 8 == 0, "mbarriers 8-byte aligned");

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
  __syncwarp();  // .aligned: converged after a lane-divergent branch (to_all_ranks) the compiler need not rejoin
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

struct LayerParams {
  const uint8_t* w;      // [12288][2048] e4m3: qkv|z rows (16-row tiles of 32 KB, row-major within)
  const uint4* wo;       // [128 row tiles][32 k groups][16 rows][128 k] e4m3: the 2048 x 4096 output projection
  float* state;          // [32 value heads][kDk rows][kDk] fp32, read and written
  const __nv_bfloat16* h;  // [kH] the residual (input)
  float* partial;        // [16 or 32][kH] out: each cluster's out-projection partial
  float wscale, oscale, g, beta;
  int late;              // 1: every weight / state request after the PDL wait (the A/B's baseline)
};

struct Smem {  // the carve-up of the dynamic shared memory
  uint8_t* ws;   // six tiles
  float* st;     // 32 state rows
  float* xs;     // x
  float* qk;     // [256] q then k of the whole QK head (gathered)
  float* og;     // [256] o (gathered), then u
  float* zg;     // [256] z (gathered)
  float* yv;     // [32] silu(v) of the CTA's rows
  float* red;    // [32] block reductions
  uint32_t bar;  // 4 mbarriers
};
__device__ __forceinline__ Smem carve(unsigned char* smem) {
  Smem m;
  m.ws = smem;
  m.st = reinterpret_cast<float*>(smem + kWBytes);
  m.xs = reinterpret_cast<float*>(smem + kWBytes + kStateBytes);
  m.qk = m.xs + kH;
  m.og = m.qk + 256;
  m.zg = m.og + 256;
  m.yv = m.zg + 256;
  m.red = m.yv + 32;
  m.bar = smem_u32(m.red + 32);
  return m;
}

// the four mbarriers initialised (one arrival each), then barrier 0 arrived at: every CTA of the cluster runs before
// any writes another's shared memory (its wait comes before the first such write)
__device__ __forceinline__ void init_barriers(const Smem& m) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < 4; ++i) mbar_init(m.bar + 8u * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  cluster_arrive();
}

// qkv|z tile `tile` (32 KB) into shared memory at dst in 16 KB bulk copies completing on mbarrier bar
__device__ __forceinline__ void copy_tile(uint32_t dst, const uint8_t* w, int tile, uint32_t bar) {
  for (int k = 0; k < kTile / 16384; ++k)
    bulk_copy(dst + k * 16384u, w + (size_t)tile * kTile + k * 16384, 16384u, bar);
}

// tiles[0 .. 6) into the six tile slots: the first `first` on mbarrier bar, the rest on bar + 8 (each told its bytes)
__device__ __forceinline__ void copy_six_tiles(uint32_t ws0, const uint8_t* w, const int* tiles, int first,
                                               uint32_t bar) {
  mbar_expect_tx(bar, first * kTile);
  mbar_expect_tx(bar + 8, (6 - first) * kTile);
#pragma unroll
  for (int i = 0; i < 6; ++i) copy_tile(ws0 + i * kTile, w, tiles[i], bar + (i < first ? 0 : 8));
}

// x = h / rms(h) into xs (every thread 4 elements), then the lane's x: elements (j * 32 + lane) * 16 .. + 16 for
// j < 4 (the columns of the uint4s it reads from every row) into xr
__device__ __forceinline__ void stage_x(const __nv_bfloat16* h, const Smem& m, float (&xr)[64]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint2 hv = reinterpret_cast<const uint2*>(h)[tid];
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hv.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hv.y));
  const float ss = warp_sum(a.x * a.x + a.y * a.y + b.x * b.x + b.y * b.y);
  if (lane == 0) m.red[warp] = ss;
  __syncthreads();
  float tot = 0.f;
  for (int i = 0; i < kWarps; ++i) tot += m.red[i];
  const float r = rsqrtf(tot / kH + 1e-6f);
  reinterpret_cast<float4*>(m.xs)[tid] = make_float4(a.x * r, a.y * r, b.x * r, b.y * r);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 16; e += 4) {
      const float4 v = reinterpret_cast<const float4*>(m.xs)[((j * 32 + lane) * 16 + e) / 4];
      xr[j * 16 + e] = v.x, xr[j * 16 + e + 1] = v.y, xr[j * 16 + e + 2] = v.z, xr[j * 16 + e + 3] = v.w;
    }
}

// row r (of 2048 e4m3) at `row` in shared memory against the lane's x: the warp's sum times wscale, in every lane
__device__ __forceinline__ float row_dot(const uint8_t* row_bytes, const float (&xr)[64], float wscale) {
  const int lane = threadIdx.x & 31;
  const uint4* row = reinterpret_cast<const uint4*>(row_bytes);
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
  return warp_sum(acc) * wscale;
}

// v (warp-uniform) into the same shared-memory float `at` of every CTA of the cluster (lane r writes rank r's)
template <int CLUSTER>
__device__ __forceinline__ void to_all_ranks(const float* at, float v) {
  if ((int)(threadIdx.x & 31) < CLUSTER) st_cluster(map_rank(smem_u32(at), threadIdx.x & 31), v);
}

// qn, kn (the lane's 4 of each) from the gathered q and k
__device__ __forceinline__ void norm_qk(const float* qk, float (&qn)[4], float (&kn)[4]) {
  const int lane = threadIdx.x & 31;
  const float4 q4 = reinterpret_cast<const float4*>(qk)[lane];
  const float4 k4 = reinterpret_cast<const float4*>(qk + kDk)[lane];
  const float qs = rsqrtf(warp_sum(q4.x * q4.x + q4.y * q4.y + q4.z * q4.z + q4.w * q4.w)) * rsqrtf((float)kDk);
  const float ks = rsqrtf(warp_sum(k4.x * k4.x + k4.y * k4.y + k4.z * k4.z + k4.w * k4.w));
  qn[0] = q4.x * qs, qn[1] = q4.y * qs, qn[2] = q4.z * qs, qn[3] = q4.w * qs;
  kn[0] = k4.x * ks, kn[1] = k4.y * ks, kn[2] = k4.z * ks, kn[3] = k4.w * ks;
}

// u = o / rms(o over its value head's 128) * silu(z) in place in og, for `heads` value heads (warps 0 .. 4 heads - 1:
// 32 values each; named barrier 1 over those warps)
__device__ __forceinline__ void gate_u(const Smem& m, int heads) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (warp >= 4 * heads) return;
  const float o = m.og[tid];
  const float s = warp_sum(o * o);
  if (lane == 0) m.red[warp] = s;
  __syncwarp();
  asm volatile("bar.sync 1, %0;" ::"r"(128 * heads) : "memory");
  const int head = warp / 4;
  const float tot = m.red[4 * head] + m.red[4 * head + 1] + m.red[4 * head + 2] + m.red[4 * head + 3];
  m.og[tid] = o * rsqrtf(tot / kDk + 1e-6f) * silu(m.zg[tid]);
}

// the output projection's codes: 8 uint4 against u (og) at k offsets kofs(j) .. + 16, reduced over `lanes` lanes
// (consecutive, a power of two): the row sums in the group's first lane
template <int LANES>
__device__ __forceinline__ float out_dot(uint4 w, const float* u) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float acc = 0.f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float f[4];
    e4m3x4(words[q], f);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc = fmaf(f[e], u[q * 4 + e], acc);
  }
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

__global__ void __launch_bounds__(kThreads, 1) gdn_layer8_kernel(const LayerParams p) {
  constexpr int kCluster = 8, kSlice = 16;
  extern __shared__ __align__(128) unsigned char smem[];
  const Smem m = carve(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t rank = cluster_rank();
  const int c = blockIdx.x / kCluster;  // QK head; value heads 2c, 2c + 1
  const uint32_t ws0 = smem_u32(m.ws), st0 = smem_u32(m.st);
  const int tiles[6] = {8 * c + (int)rank, 128 + 8 * c + (int)rank, 256 + 16 * c + (int)rank,
                        256 + 16 * c + 8 + (int)rank, 512 + 16 * c + (int)rank, 512 + 16 * c + 8 + (int)rank};
  float* gst0 = p.state + ((size_t)(2 * c) * kDk + kSlice * rank) * kDk;
  float* gst1 = p.state + ((size_t)(2 * c + 1) * kDk + kSlice * rank) * kDk;
  // output projection: row tiles 16 rank + i (i < 16), k groups 2c and 2c + 1 (4 KB contiguous a row tile)
  const uint4* wo_tile0 = p.wo + ((size_t)(16 * rank) * kOutGroups + 2 * c) * kPieceVec;
  constexpr size_t kTileStride = (size_t)kOutGroups * kPieceVec;  // uint4 from a row tile's pieces to the next
  init_barriers(m);  // barrier 0 arrived
  auto request = [&]() {
    if (tid != 0) return;
    copy_six_tiles(ws0, p.w, tiles, 2, m.bar);  // q | k tiles on their own barrier: they gate barrier 1
    mbar_expect_tx(m.bar + 16, kStateBytes);
    bulk_copy(st0, gst0, kStateBytes / 2, m.bar + 16);
    bulk_copy(st0 + kStateBytes / 2, gst1, kStateBytes / 2, m.bar + 16);
    for (int i = 0; i < 16; ++i) prefetch_l2(wo_tile0 + i * kTileStride, 2 * kPieceVec * 16);
  };
  if (!p.late) request();
  pdl_wait_and_release();
  if (p.late) request();
  float xr[64];
  stage_x(p.h, m, xr);
  // q | k rows: silu, then into every rank's qk (q dim 16 rank + i at qk[16 rank + i], k's at 128 + ...)
  mbar_wait0(m.bar);
  __syncwarp();    // .aligned: the warp converged after the spin
  cluster_wait();  // barrier 0 (arrived at the start)
  for (int r = warp; r < 2 * kSlice; r += kWarps) {
    const float y = silu(row_dot(m.ws + (size_t)r * kH, xr, p.wscale));
    to_all_ranks<kCluster>(m.qk + (r / kSlice) * kDk + kSlice * rank + r % kSlice, y);
  }
  cluster_arrive();  // barrier 1: this CTA's q and k slices are in every rank
  mbar_wait0(m.bar + 8);
  for (int r = 2 * kSlice + warp; r < 6 * kSlice; r += kWarps) {
    const float y = row_dot(m.ws + (size_t)r * kH, xr, p.wscale);
    if (r < 4 * kSlice) {
      if (lane == 0) m.yv[r - 2 * kSlice] = silu(y);
    } else {  // z row i of value head i / 16: into every rank's zg[128 (i / 16) + 16 rank + i % 16]
      const int i = r - 4 * kSlice;
      to_all_ranks<kCluster>(m.zg + kDk * (i / kSlice) + kSlice * rank + i % kSlice, y);
    }
  }
  // output-projection codes from L2 (prefetched), in flight through the delta rule. Thread t, j: row tile 2j + t / 256
  // of the CTA's 16, within its 4 KB ([2 groups][16 rows][8 uint4]) row rr = (t % 256) / 16, group (t % 16) / 8, uint4
  // t % 8: a row's 16 uint4 in 16 consecutive lanes
  uint4 wo[kOutVec];
  {
    const int o = tid % 256, rr = o / 16, grp = (o % 16) / 8, q = o % 8;
#pragma unroll
    for (int j = 0; j < kOutVec; ++j)
      wo[j] = ld_nc(wo_tile0 + (2 * j + tid / 256) * kTileStride + grp * kPieceVec + rr * 8 + q);
  }
  mbar_wait0(m.bar + 16);
  __syncthreads();  // yv
  cluster_wait();   // barrier 1: the whole q and k
  // the delta rule: warp w takes rows w and w + 16 of the CTA's 32 (value head i / 16, row 16 rank + i % 16)
  float snew[2][4];
  {
    float qn[4], kn[4];
    norm_qk(m.qk, qn, kn);
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      const int i = warp + kWarps * ii;
      const float o = delta_row(m.st + i * kDk, m.yv[i], qn, kn, p.g, p.beta, snew[ii]);
      to_all_ranks<kCluster>(m.og + kDk * (i / kSlice) + kSlice * rank + i % kSlice, o);
    }
  }
  cluster_arrive();  // barrier 2: this CTA's o and z are in every rank (no shared memory is touched remotely after)
#pragma unroll
  for (int ii = 0; ii < 2; ++ii) {  // the state rows, after the arrive (its release would wait for these stores)
    float* g = (ii == 0 ? gst0 : gst1) + (size_t)warp * kDk;  // row warp + 16 ii: value head ii, row warp
    reinterpret_cast<float4*>(g)[lane] = make_float4(snew[ii][0], snew[ii][1], snew[ii][2], snew[ii][3]);
  }
  cluster_wait();
  gate_u(m, 2);
  __syncthreads();
  {
    const int o = tid % 256, rr = o / 16, kofs = ((o % 16) / 8) * kDk + (o % 8) * 16;
#pragma unroll
    for (int j = 0; j < kOutVec; ++j) {
      const float acc = out_dot<16>(wo[j], m.og + kofs);
      if (tid % 16 == 0) p.partial[(size_t)c * kH + 256 * rank + 16 * (2 * j + tid / 256) + rr] = acc * p.oscale;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) gdn_layer4_kernel(const LayerParams p) {
  constexpr int kCluster = 4, kSlice = 32;
  extern __shared__ __align__(128) unsigned char smem[];
  const Smem m = carve(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t rank = cluster_rank();
  const int j = blockIdx.x / kCluster, c = j / 2;  // value head, its QK head
  const uint32_t ws0 = smem_u32(m.ws), st0 = smem_u32(m.st);
  // q (2 tiles), k (2), v (2) in shared memory; z (2) later over q's
  const int tiles[8] = {8 * c + 2 * (int)rank, 8 * c + 2 * (int)rank + 1, 128 + 8 * c + 2 * (int)rank,
                        128 + 8 * c + 2 * (int)rank + 1, 256 + 8 * j + 2 * (int)rank, 256 + 8 * j + 2 * (int)rank + 1,
                        512 + 8 * j + 2 * (int)rank, 512 + 8 * j + 2 * (int)rank + 1};
  float* gst = p.state + ((size_t)j * kDk + kSlice * rank) * kDk;
  // output projection: row tiles 32 rank + i (i < 32), k group j (2 KB a row tile)
  const uint4* wo_tile0 = p.wo + ((size_t)(32 * rank) * kOutGroups + j) * kPieceVec;
  constexpr size_t kTileStride = (size_t)kOutGroups * kPieceVec;
  init_barriers(m);  // barrier 0 arrived
  auto request = [&]() {
    if (tid != 0) return;
    copy_six_tiles(ws0, p.w, tiles, 4, m.bar);  // q | k tiles on their own barrier
    mbar_expect_tx(m.bar + 16, kStateBytes);
    bulk_copy(st0, gst, kStateBytes, m.bar + 16);
    for (int i = 6; i < 8; ++i) prefetch_l2(p.w + (size_t)tiles[i] * kTile, kTile);
    for (int i = 0; i < 32; ++i) prefetch_l2(wo_tile0 + i * kTileStride, kPieceVec * 16);
  };
  if (!p.late) request();
  pdl_wait_and_release();
  if (p.late) request();
  float xr[64];
  stage_x(p.h, m, xr);
  mbar_wait0(m.bar);
  __syncwarp();
  cluster_wait();  // barrier 0
  // q | k rows (64): into every rank's qk (q dim 32 rank + i at qk[32 rank + i], k's at 128 + ...)
  for (int r = warp; r < 2 * kSlice; r += kWarps) {
    const float y = silu(row_dot(m.ws + (size_t)r * kH, xr, p.wscale));
    to_all_ranks<kCluster>(m.qk + (r / kSlice) * kDk + kSlice * rank + r % kSlice, y);
  }
  cluster_arrive();  // barrier 1
  __syncthreads();   // every warp is done with the q | k tiles: z's go over q's
  if (tid == 0) {
    // the async proxy writes where the generic proxy read (the PTX ISA's rule for both proxies on the same bytes)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    mbar_expect_tx(m.bar + 24, 2 * kTile);
    for (int i = 0; i < 2; ++i) copy_tile(ws0 + i * kTile, p.w, tiles[6 + i], m.bar + 24);
  }
  mbar_wait0(m.bar + 8);
  for (int r = warp; r < kSlice; r += kWarps) {  // v rows (tiles 4, 5)
    const float y = row_dot(m.ws + (size_t)(4 * 16 + r) * kH, xr, p.wscale);
    if (lane == 0) m.yv[r] = silu(y);
  }
  mbar_wait0(m.bar + 24);
  __syncwarp();
  for (int r = warp; r < kSlice; r += kWarps) {  // z rows (over q's tiles), before the delta rule: x dies here
    const float y = row_dot(m.ws + (size_t)r * kH, xr, p.wscale);
    to_all_ranks<kCluster>(m.zg + kSlice * rank + r, y);
  }
  // output-projection codes: thread t, j: row tile 4j + t / 128 of the CTA's 32, within its 2 KB ([16 rows][8 uint4])
  // row (t % 128) / 8, uint4 t % 8: a row's 8 uint4 in 8 consecutive lanes
  uint4 wo[kOutVec];
  {
    const int o = tid % 128;
#pragma unroll
    for (int jj = 0; jj < kOutVec; ++jj) wo[jj] = ld_nc(wo_tile0 + (4 * jj + tid / 128) * kTileStride + o);
  }
  mbar_wait0(m.bar + 16);
  __syncthreads();  // yv
  cluster_wait();   // barrier 1
  float snew[2][4];
  {
    float qn[4], kn[4];
    norm_qk(m.qk, qn, kn);
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {  // rows w and w + 16 of the CTA's 32
      const int i = warp + kWarps * ii;
      const float o = delta_row(m.st + i * kDk, m.yv[i], qn, kn, p.g, p.beta, snew[ii]);
      to_all_ranks<kCluster>(m.og + kSlice * rank + i, o);
    }
  }
  cluster_arrive();  // barrier 2
#pragma unroll
  for (int ii = 0; ii < 2; ++ii)
    reinterpret_cast<float4*>(gst + (size_t)(warp + kWarps * ii) * kDk)[lane] =
        make_float4(snew[ii][0], snew[ii][1], snew[ii][2], snew[ii][3]);
  cluster_wait();
  gate_u(m, 1);
  __syncthreads();
  {
    const int kofs = (tid % 8) * 16;
#pragma unroll
    for (int jj = 0; jj < kOutVec; ++jj) {
      const float acc = out_dot<8>(wo[jj], m.og + kofs);
      const int n = 512 * rank + 16 * (4 * jj + tid / 128) + (tid % 128) / 8;
      if (tid % 8 == 0) p.partial[(size_t)j * kH + n] = acc * p.oscale;
    }
  }
}

// h_out = bf16(h + sum over the `parts` partials, in order); 8 CTAs of 256
__global__ void __launch_bounds__(256) reduce_kernel(const float* __restrict__ partial, int parts,
                                                     const __nv_bfloat16* h, __nv_bfloat16* h_out) {
  pdl_wait_and_release();
  const int n = blockIdx.x * 256 + threadIdx.x;
  float s = 0.f;
  for (int c = 0; c < parts; ++c) s += partial[(size_t)c * kH + n];
  h_out[n] = __float2bfloat16(__bfloat162float(h[n]) + s);
}

int configure() {
  static bool done = false;
  if (done) return 0;
  cudaError_t err = cudaSuccess;
  for (auto k : {gdn_layer8_kernel, gdn_layer4_kernel}) {
    if (err == cudaSuccess) err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  }
  // the small kernels' CTAs leave room for a mixer CTA of the next layer (its early requests overlapping them)
  err = prefer_max_shared(err, {(const void*)stream_kernel, (const void*)reduce_kernel});
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return (int)err;
  }
  done = true;
  return 0;
}

}  // namespace

extern "C" int vq_cl_smem() { return kSmem; }

// Clusters of `cluster` CTAs (1-16) of the mixer's shape (512 threads, kSmem bytes) that can run at once
// (cudaOccupancyMaxActiveClusters; the launches need 16 of 8 or 32 of 4). -1 on a CUDA error.
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
  if (cudaOccupancyMaxActiveClusters(&n, cluster == 4 ? gdn_layer4_kernel : gdn_layer8_kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return n;
}

// One layer's mixer on clusters of `cluster` CTAs (8: gdn_layer8_kernel, 16 partials; 4: gdn_layer4_kernel, 32
// partials). Pointers as LayerParams says; pdl 0 or 1. ctas: the grid (0: all 128; fewer, a multiple of cluster, runs
// only the first ctas / cluster clusters' share: a timing of one wave of resident clusters, not the layer). Returns
// 0 or a CUDA error code.
extern "C" int vq_cl_layer_launch(const void* w, const void* wo, float* state, const void* h, float* partial,
                                  float wscale, float oscale, float g, float beta, int late, int cluster, int ctas,
                                  int pdl, void* stream) {
  if (int err = configure()) return err;
  if (cluster != 4 && cluster != 8) return (int)cudaErrorInvalidValue;
  if (ctas == 0) ctas = kCtas;
  if (ctas < cluster || ctas > kCtas || ctas % cluster) return (int)cudaErrorInvalidValue;
  LayerParams p = {reinterpret_cast<const uint8_t*>(w), reinterpret_cast<const uint4*>(wo), state,
                   reinterpret_cast<const __nv_bfloat16*>(h), partial, wscale, oscale, g, beta, late};
  void* args[] = {&p};
  return launch(cluster == 4 ? (const void*)gdn_layer4_kernel : (const void*)gdn_layer8_kernel, args, dim3(ctas),
                kThreads, kSmem, cluster, pdl, (cudaStream_t)stream);
}

// h_out [2048] bf16 = h + the sum of `parts` partials [parts][2048] (reduce_kernel).
extern "C" int vq_cl_reduce_launch(const float* partial, int parts, const void* h, void* h_out, int pdl, void* stream) {
  if (int err = configure()) return err;
  void* args[] = {&partial, &parts, &h, &h_out};
  return launch((const void*)reduce_kernel, args, dim3(kH / 256), 256, 0, 1, pdl, (cudaStream_t)stream);
}

// The MoE's stand-in (stream_kernel) on `ctas` CTAs: reads n16 uint4 at w, copies h [2048] bf16 to h_out.
extern "C" int vq_cl_stream_launch(const void* w, long long n16, const void* h, void* h_out, unsigned* sink, int ctas,
                                   int pdl, void* stream) {
  if (int err = configure()) return err;
  return stream_launch(w, n16, h, h_out, sink, ctas, pdl, (cudaStream_t)stream);
}
