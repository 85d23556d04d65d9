// Gated DeltaNet for a decode step (one token per sequence) in one launch: the gated delta rule on the sequence's
// state slot and the gated RMSNorm that follows it, which the decode path otherwise runs as two launches
// (gdn_recurrent_kernel in kernels/gdn/_recurrent_kernels.py, then _gated_rms_norm_kernel in
// kernels/_norm_kernels.py). Per sequence b (token t = query_start_loc[b], state slot slots[b]) and value head h
// (key head h / group), with Dk = Dv = 128:
//
//   g    = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])      (softplus(x) = x above 20)
//   beta = sigmoid(b[t, h])
//   q    = q * scale / sqrt(|q|^2 + 1e-6),  k = k / sqrt(|k|^2 + 1e-6)
//   S    = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q          (S: [Dk, Dv] fp32)
//   y    = bf16(bf16(w * bf16(o' / sqrt(mean(o'^2) + eps))) * silu(z[t, h])),  o' = bf16(o)
//
// (Yang et al., arXiv 2412.06464; HF torch_recurrent_gated_delta_rule and Qwen3_5MoeRMSNormGated.) The norm takes
// the recurrent kernel's bf16 output and rounds as _gated_rms_norm_kernel does, step by step; the fp32 sums (S^T k,
// S^T q, |o'|^2) are in another order than the Triton kernels', so results can differ from the two launches by fp32
// rounding (the state) and an occasional bf16 flip (y).
//
// Grid (CL, B, Hv) in clusters of CL CTAs (CL = 4 or 8): the CL CTAs of a cluster share one sequence's value head,
// each owning COLS = 128 / CL columns of its state (all 128 rows), 4 warps. Warp w holds rows 32w .. 32w + 31; its
// lanes are COLS / 4 column groups (4 columns each, one 16-byte load) times RG = 128 / COLS row groups, row group
// ro holding rows 32w + R ro .. + R - 1 (R = 32 / RG rows, 4 R state values a thread). A load instruction of a warp
// reads RG rows of COLS contiguous columns. Reductions over rows: a thread's R rows, the row groups by shuffles, the
// 4 warps through shared memory (summed in warp order: every thread gets the same u and o). The norm over the head's
// 128 outputs: each CTA's sum of squares through distributed shared memory, summed in cluster-rank order. Small CTAs
// (128 threads, < 100 registers) so that, under early launch, they fit beside the kernel ahead of them.
//
// Under early launch (pdl 2 with early_state) the state slice and the batch metadata are read before the PDL wait,
// as gdn_recurrent_kernel's EARLY_STATE does (kernels/pdl.py says why that is safe in the decode graphs); the state
// through L2 only (ld.global.cg). A sequence without a token (padding) reads and writes nothing.
//
// Host side: vibeqwen_kernels/gdn/decode_cuda.py.

#include <cooperative_groups.h>

#include "mma_common.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kD = 128;                // Dk = Dv: the kernel is built for these
constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kWarpRows = kD / kWarps; // state rows per warp

struct Params {
  const __nv_bfloat16 *q, *k, *v, *a, *b, *z, *norm_w;
  long long sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sa_t, sb_t, sz_t, sz_h;
  const float *A_log, *dt_bias;
  void* state;
  long long ss_slot, ss_h, ss_k;
  const void* slots;
  const int* qsl;
  const unsigned char* init;
  __nv_bfloat16* y;
  float eps, scale;
  int hv, group, slots_i64, early_state, pdl;
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Four bf16 (8 bytes) -> fp32.
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&f)[4]) {
  const uint2 r = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(as_bf162(r.x)), hi = __bfloat1622float2(as_bf162(r.y));
  f[0] = lo.x;
  f[1] = lo.y;
  f[2] = hi.x;
  f[3] = hi.y;
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

template <typename StateT>
__device__ __forceinline__ void load_row(const StateT* p, float (&s)[4]);

template <>
__device__ __forceinline__ void load_row<float>(const float* p, float (&s)[4]) {
  const float4 r = __ldcg(reinterpret_cast<const float4*>(p));
  s[0] = r.x;
  s[1] = r.y;
  s[2] = r.z;
  s[3] = r.w;
}

template <>
__device__ __forceinline__ void load_row<__nv_bfloat16>(const __nv_bfloat16* p, float (&s)[4]) {
  const uint2 r = __ldcg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __bfloat1622float2(as_bf162(r.x)), hi = __bfloat1622float2(as_bf162(r.y));
  s[0] = lo.x;
  s[1] = lo.y;
  s[2] = hi.x;
  s[3] = hi.y;
}

__device__ __forceinline__ void store_row(float* p, const float (&s)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(s[0], s[1], s[2], s[3]);
}

__device__ __forceinline__ void store_row(__nv_bfloat16* p, const float (&s)[4]) {
  uint2 r;
  r.x = as_u32(__floats2bfloat162_rn(s[0], s[1]));
  r.y = as_u32(__floats2bfloat162_rn(s[2], s[3]));
  *reinterpret_cast<uint2*>(p) = r;
}

// v (per column c) summed over the lanes of the other row groups (lane = ro * CG + cg): xor offsets CG .. 16.
template <int CG>
__device__ __forceinline__ void sum_row_groups(float (&v)[4]) {
#pragma unroll
  for (int o = CG; o < 32; o <<= 1)
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] += __shfl_xor_sync(0xffffffffu, v[c], o);
}

template <int CL, typename StateT>
__global__ void __launch_bounds__(kThreads) gdn_decode_kernel(const Params p) {
  constexpr int COLS = kD / CL, CG = COLS / 4, RG = 32 / CG, R = kWarpRows / RG;
  static_assert(R % 4 == 0, "a thread's rows must start at a multiple of 4 (the q/k shuffles)");
  const int rank = blockIdx.x, seq = blockIdx.y, h = blockIdx.z;
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, cgi = l % CG, ro = l / CG;
  const int col = rank * COLS + 4 * cgi, row0 = w * kWarpRows + ro * R;
  const bool early = p.early_state && p.pdl == 2;
  if (!early) pdl_wait(p.pdl);
  const int tok = p.qsl[seq];
  if (p.qsl[seq + 1] == tok) return;  // padding: no token, nothing read or written (the whole cluster returns)
  const long long slot = p.slots_i64 ? reinterpret_cast<const long long*>(p.slots)[seq]
                                     : (long long)reinterpret_cast<const int*>(p.slots)[seq];
  StateT* sp = reinterpret_cast<StateT*>(p.state) + slot * p.ss_slot + h * p.ss_h + (long long)row0 * p.ss_k + col;
  float s[R][4];
  if (p.init[seq]) {
#pragma unroll
    for (int i = 0; i < R; ++i) load_row<StateT>(sp + i * p.ss_k, s[i]);
  } else {
#pragma unroll
    for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
  }
  if (early) pdl_wait(p.pdl);

  const int hk = h / p.group;
  float qf[4], kf[4], vf[4], zf[4], wf[4];
  load4(p.q + tok * p.sq_t + hk * p.sq_h + 4 * l, qf);  // lane l: elements 4l .. 4l + 3 (the norms)
  load4(p.k + tok * p.sk_t + hk * p.sk_h + 4 * l, kf);
  load4(p.v + tok * p.sv_t + h * p.sv_h + col, vf);
  const bool out_lane = w == 0 && ro == 0;  // the lanes that finish the norm for the CTA's columns
  if (out_lane) {
    load4(p.z + tok * p.sz_t + h * p.sz_h + col, zf);
    load4(p.norm_w + col, wf);
  }
  const float av = __bfloat162float(p.a[tok * p.sa_t + h]) + p.dt_bias[h];
  const float bv = __bfloat162float(p.b[tok * p.sb_t + h]);
  const float neg_a = -expf(p.A_log[h]);

  const float qn = p.scale / sqrtf(warp_sum(qf[0] * qf[0] + qf[1] * qf[1] + qf[2] * qf[2] + qf[3] * qf[3]) + 1e-6f);
  const float kn = 1.f / sqrtf(warp_sum(kf[0] * kf[0] + kf[1] * kf[1] + kf[2] * kf[2] + kf[3] * kf[3]) + 1e-6f);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    qf[c] *= qn;
    kf[c] *= kn;
  }
  const float softplus = av > 20.f ? av : logf(1.f + expf(fminf(av, 20.f)));
  const float decay = expf(neg_a * softplus);
  const float beta = 1.f / (1.f + expf(-bv));

  // row row0 + i's q and k: element i % 4 of lane row0 / 4 + i / 4 (row0 is a multiple of 4)
  float kr[R], qr[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    kr[i] = __shfl_sync(0xffffffffu, kf[i & 3], row0 / 4 + i / 4);
    qr[i] = __shfl_sync(0xffffffffu, qf[i & 3], row0 / 4 + i / 4);
  }

  __shared__ float4 red[2][kWarps][CG];
  __shared__ float sumsq;
  float pk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[i][c] *= decay;
      pk[c] = fmaf(s[i][c], kr[i], pk[c]);
    }
  sum_row_groups<CG>(pk);
  if (ro == 0) red[0][w][cgi] = make_float4(pk[0], pk[1], pk[2], pk[3]);
  __syncthreads();
  float u[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int ww = 0; ww < kWarps; ++ww) {
    const float4 r = red[0][ww][cgi];
    u[0] += r.x;
    u[1] += r.y;
    u[2] += r.z;
    u[3] += r.w;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) u[c] = beta * (vf[c] - u[c]);

  float po[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[i][c] = fmaf(kr[i], u[c], s[i][c]);
      po[c] = fmaf(s[i][c], qr[i], po[c]);
    }
  sum_row_groups<CG>(po);
  if (ro == 0) red[1][w][cgi] = make_float4(po[0], po[1], po[2], po[3]);
#pragma unroll
  for (int i = 0; i < R; ++i) store_row(sp + i * p.ss_k, s[i]);
  __syncthreads();

  // the gated RMSNorm of the head's 128 outputs, rounded as _gated_rms_norm_kernel: o rounded to bf16, the CTAs'
  // sums of squares exchanged through distributed shared memory
  float o[4] = {0.f, 0.f, 0.f, 0.f};
  if (w == 0) {
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) {
      const float4 r = red[1][ww][cgi];
      o[0] += r.x;
      o[1] += r.y;
      o[2] += r.z;
      o[3] += r.w;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) o[c] = round_bf16(o[c]);
    float sq = o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3];
#pragma unroll
    for (int off = 1; off < CG; off <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    if (l == 0) sumsq = sq;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  if (out_lane) {
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < CL; ++r) total += *cluster.map_shared_rank(&sumsq, r);
    const float inv = 1.f / sqrtf(total / (float)kD + p.eps);
    float yv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float n = round_bf16(o[c] * inv);
      const float yw = round_bf16(wf[c] * n);
      yv[c] = yw * (zf[c] / (1.f + expf(-zf[c])));
    }
    uint2 r;
    r.x = as_u32(__floats2bfloat162_rn(yv[0], yv[1]));
    r.y = as_u32(__floats2bfloat162_rn(yv[2], yv[3]));
    *reinterpret_cast<uint2*>(p.y + (long long)tok * p.hv * kD + h * kD + col) = r;
  }
  cluster.sync();  // no CTA leaves while another may still read its sumsq
}

// The delta rule alone (o in bf16, no norm: gdn_recurrent_kernel's outputs) on a persistent grid: unit u = (sequence,
// value head, 32-column block), CTA c taking units c, c + G, ... (G CTAs, up to 4 an SM) in the cluster-4 layout above.
// While a unit is multiplied, the next unit's state slice and inputs are already in flight in a second register set,
// so a CTA keeps loads outstanding from its first unit to its last instead of loading, computing and exiting.
template <typename StateT>
__global__ void __launch_bounds__(kThreads, 4) gdn_recurrent_persist_kernel(const Params p, int nunits) {
  constexpr int CL = 4, COLS = kD / CL, CG = COLS / 4, RG = 32 / CG, R = kWarpRows / RG;
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, cgi = l % CG, ro = l / CG;
  const int row0 = w * kWarpRows + ro * R;
  const bool early = p.early_state && p.pdl == 2;
  if (!early) pdl_wait(p.pdl);

  // the next unit: its state slice (zeros for a new sequence), and once past the PDL wait its inputs
  float ns[R][4], nq[4], nk[4], nv[4], na = 0.f, nb = 0.f;
  int ntok = -1;
  StateT* nsp = nullptr;
  auto fetch_state = [&](int u) {
    ntok = -1;
    if (u >= nunits) return;
    const int cb = u % CL, h = (u / CL) % p.hv, seq = u / (CL * p.hv);
    const int tok = p.qsl[seq];
    if (p.qsl[seq + 1] == tok) return;  // padding
    ntok = tok;
    const long long slot = p.slots_i64 ? reinterpret_cast<const long long*>(p.slots)[seq]
                                       : (long long)reinterpret_cast<const int*>(p.slots)[seq];
    nsp = reinterpret_cast<StateT*>(p.state) + slot * p.ss_slot + h * p.ss_h + (long long)row0 * p.ss_k + cb * COLS +
          4 * cgi;
    if (p.init[seq]) {
#pragma unroll
      for (int i = 0; i < R; ++i) load_row<StateT>(nsp + i * p.ss_k, ns[i]);
    } else {
#pragma unroll
      for (int i = 0; i < R; ++i) ns[i][0] = ns[i][1] = ns[i][2] = ns[i][3] = 0.f;
    }
  };
  auto fetch_inputs = [&](int u) {
    if (ntok < 0) return;
    const int cb = u % CL, h = (u / CL) % p.hv, hk = h / p.group;
    load4(p.q + ntok * p.sq_t + hk * p.sq_h + 4 * l, nq);
    load4(p.k + ntok * p.sk_t + hk * p.sk_h + 4 * l, nk);
    load4(p.v + ntok * p.sv_t + h * p.sv_h + cb * COLS + 4 * cgi, nv);
    na = __bfloat162float(p.a[ntok * p.sa_t + h]);
    nb = __bfloat162float(p.b[ntok * p.sb_t + h]);
  };

  __shared__ float4 red[2][kWarps][CG];
  int u = blockIdx.x;
  fetch_state(u);
  if (early) pdl_wait(p.pdl);
  fetch_inputs(u);
  for (; u < nunits; u += gridDim.x) {
    const int tok = ntok;
    StateT* sp = nsp;
    float s[R][4], qf[4], kf[4], vf[4];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[i][c] = ns[i][c];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      qf[c] = nq[c];
      kf[c] = nk[c];
      vf[c] = nv[c];
    }
    const float a_raw = na, b_raw = nb;
    fetch_state(u + gridDim.x);  // the next unit's loads go out now
    fetch_inputs(u + gridDim.x);
    if (tok < 0) continue;  // padding (uniform over the CTA)
    const int cb = u % CL, h = (u / CL) % p.hv;
    const float av = a_raw + p.dt_bias[h];
    const float neg_a = -expf(p.A_log[h]);
    const float qn = p.scale / sqrtf(warp_sum(qf[0] * qf[0] + qf[1] * qf[1] + qf[2] * qf[2] + qf[3] * qf[3]) + 1e-6f);
    const float kn = 1.f / sqrtf(warp_sum(kf[0] * kf[0] + kf[1] * kf[1] + kf[2] * kf[2] + kf[3] * kf[3]) + 1e-6f);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      qf[c] *= qn;
      kf[c] *= kn;
    }
    const float softplus = av > 20.f ? av : logf(1.f + expf(fminf(av, 20.f)));
    const float decay = expf(neg_a * softplus);
    const float beta = 1.f / (1.f + expf(-b_raw));
    float kr[R], qr[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      kr[i] = __shfl_sync(0xffffffffu, kf[i & 3], row0 / 4 + i / 4);
      qr[i] = __shfl_sync(0xffffffffu, qf[i & 3], row0 / 4 + i / 4);
    }
    float pk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[i][c] *= decay;
        pk[c] = fmaf(s[i][c], kr[i], pk[c]);
      }
    sum_row_groups<CG>(pk);
    if (ro == 0) red[0][w][cgi] = make_float4(pk[0], pk[1], pk[2], pk[3]);
    __syncthreads();
    float uu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) {
      const float4 r = red[0][ww][cgi];
      uu[0] += r.x;
      uu[1] += r.y;
      uu[2] += r.z;
      uu[3] += r.w;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) uu[c] = beta * (vf[c] - uu[c]);
    float po[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[i][c] = fmaf(kr[i], uu[c], s[i][c]);
        po[c] = fmaf(s[i][c], qr[i], po[c]);
      }
    sum_row_groups<CG>(po);
    if (ro == 0) red[1][w][cgi] = make_float4(po[0], po[1], po[2], po[3]);
#pragma unroll
    for (int i = 0; i < R; ++i) store_row(sp + i * p.ss_k, s[i]);
    __syncthreads();
    if (w == 0 && ro == 0) {
      float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) {
        const float4 r = red[1][ww][cgi];
        o[0] += r.x;
        o[1] += r.y;
        o[2] += r.z;
        o[3] += r.w;
      }
      uint2 r;
      r.x = as_u32(__floats2bfloat162_rn(o[0], o[1]));
      r.y = as_u32(__floats2bfloat162_rn(o[2], o[3]));
      *reinterpret_cast<uint2*>(p.y + ((long long)tok * p.hv + h) * kD + cb * COLS + 4 * cgi) = r;
    }
  }
}

// cudaLaunchKernelEx with clusters of CL CTAs along x, and programmatic stream serialization when pdl != 0.
template <int CL, typename StateT>
int launch(const Params& p, int B, int Hv, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(CL, B, Hv);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CL;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 2 : 1;
  cudaError_t err = cudaLaunchKernelEx(&cfg, gdn_decode_kernel<CL, StateT>, p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return (int)err;
  }
  return (int)cudaGetLastError();
}

}  // namespace

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// q, k: bf16 [T, Hk, 128] (strides in elements: sq_t, sq_h, ...; last dim contiguous, 8-byte aligned rows), v, z: bf16
// [T, Hv, 128], a, b: bf16 [T, Hv] (row strides sa_t, sb_t), A_log, dt_bias: fp32 [Hv]; state: fp32 (state_bf16 0) or
// bf16 (1) [slots, Hv, 128, 128] (strides ss_slot, ss_h, ss_k; last dim contiguous, 16-byte aligned rows), updated
// in place; slots: int64 (slots_i64 1) or int32 [B]; qsl int32 [B + 1] with at most one token per sequence; init:
// bool bytes [B] (0: the state starts at zero); norm_w: bf16 [128]; y: bf16 [T, Hv * 128] (rows of sequences without
// a token are not written). group = Hv / Hk. cluster: CTAs per head (4 or 8; the same results). early_state: with pdl
// 2, read the state and metadata before the PDL wait.
extern "C" int vq_gdn_decode_launch(const void* q, long long sq_t, long long sq_h, const void* k, long long sk_t,
                                    long long sk_h, const void* v, long long sv_t, long long sv_h, const void* a,
                                    long long sa_t, const void* b, long long sb_t, const float* A_log,
                                    const float* dt_bias, void* state, int state_bf16, long long ss_slot,
                                    long long ss_h, long long ss_k, const void* slots, int slots_i64, const int* qsl,
                                    const unsigned char* init, const void* z, long long sz_t, long long sz_h,
                                    const void* norm_w, float eps, float scale, void* y, int B, int Hv, int group,
                                    int cluster, int early_state, int pdl, void* stream) {
  if (B < 1 || B > 65535 || Hv < 1 || Hv > 65535 || group < 1 || Hv % group || (cluster != 4 && cluster != 8))
    return (int)cudaErrorInvalidValue;
  Params p;
  p.q = (const __nv_bfloat16*)q;
  p.k = (const __nv_bfloat16*)k;
  p.v = (const __nv_bfloat16*)v;
  p.a = (const __nv_bfloat16*)a;
  p.b = (const __nv_bfloat16*)b;
  p.z = (const __nv_bfloat16*)z;
  p.norm_w = (const __nv_bfloat16*)norm_w;
  p.sq_t = sq_t;
  p.sq_h = sq_h;
  p.sk_t = sk_t;
  p.sk_h = sk_h;
  p.sv_t = sv_t;
  p.sv_h = sv_h;
  p.sa_t = sa_t;
  p.sb_t = sb_t;
  p.sz_t = sz_t;
  p.sz_h = sz_h;
  p.A_log = A_log;
  p.dt_bias = dt_bias;
  p.state = state;
  p.ss_slot = ss_slot;
  p.ss_h = ss_h;
  p.ss_k = ss_k;
  p.slots = slots;
  p.qsl = qsl;
  p.init = init;
  p.y = (__nv_bfloat16*)y;
  p.eps = eps;
  p.scale = scale;
  p.hv = Hv;
  p.group = group;
  p.slots_i64 = slots_i64;
  p.early_state = early_state;
  p.pdl = pdl;
  const cudaStream_t st = (cudaStream_t)stream;
  if (cluster == 8)
    return state_bf16 ? launch<8, __nv_bfloat16>(p, B, Hv, st) : launch<8, float>(p, B, Hv, st);
  return state_bf16 ? launch<4, __nv_bfloat16>(p, B, Hv, st) : launch<4, float>(p, B, Hv, st);
}

// The CTAs a vq_gdn_recurrent_decode_launch uses on the current device (4 an SM), 0 when unknown.
extern "C" int vq_gdn_recurrent_decode_grid() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return 4 * sms;
}

// The delta rule alone on a persistent grid of `grid` CTAs (o: bf16 [T, Hv, 128], written at y): arguments as
// vq_gdn_decode_launch without z and norm_w.
extern "C" int vq_gdn_recurrent_decode_launch(const void* q, long long sq_t, long long sq_h, const void* k,
                                              long long sk_t, long long sk_h, const void* v, long long sv_t,
                                              long long sv_h, const void* a, long long sa_t, const void* b,
                                              long long sb_t, const float* A_log, const float* dt_bias, void* state,
                                              int state_bf16, long long ss_slot, long long ss_h, long long ss_k,
                                              const void* slots, int slots_i64, const int* qsl,
                                              const unsigned char* init, float scale, void* o, int B, int Hv,
                                              int group, int grid, int early_state, int pdl, void* stream) {
  if (B < 1 || Hv < 1 || group < 1 || Hv % group || grid < 1) return (int)cudaErrorInvalidValue;
  Params p = {};
  p.q = (const __nv_bfloat16*)q;
  p.k = (const __nv_bfloat16*)k;
  p.v = (const __nv_bfloat16*)v;
  p.a = (const __nv_bfloat16*)a;
  p.b = (const __nv_bfloat16*)b;
  p.sq_t = sq_t;
  p.sq_h = sq_h;
  p.sk_t = sk_t;
  p.sk_h = sk_h;
  p.sv_t = sv_t;
  p.sv_h = sv_h;
  p.sa_t = sa_t;
  p.sb_t = sb_t;
  p.A_log = A_log;
  p.dt_bias = dt_bias;
  p.state = state;
  p.ss_slot = ss_slot;
  p.ss_h = ss_h;
  p.ss_k = ss_k;
  p.slots = slots;
  p.qsl = qsl;
  p.init = init;
  p.y = (__nv_bfloat16*)o;
  p.scale = scale;
  p.hv = Hv;
  p.group = group;
  p.slots_i64 = slots_i64;
  p.early_state = early_state;
  p.pdl = pdl;
  const int nunits = B * Hv * 4;
  static int configured[64] = {0};
  const dim3 g(grid < nunits ? grid : nunits);
  if (state_bf16)
    return launch_kernel(gdn_recurrent_persist_kernel<__nv_bfloat16>, configured, g, kThreads, 0,
                         (cudaStream_t)stream, pdl, p, nunits);
  return launch_kernel(gdn_recurrent_persist_kernel<float>, configured, g, kThreads, 0, (cudaStream_t)stream, pdl, p,
                       nunits);
}
