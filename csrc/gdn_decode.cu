// Gated DeltaNet's delta rule for a decode step (one token per sequence) on a persistent grid: what
// gdn_recurrent_kernel (kernels/gdn/_recurrent_kernels.py) computes for such a step, with the next work unit's state
// already in flight while the current one is multiplied. Per sequence b (token t = query_start_loc[b], state slot
// slots[b]) and value head h (key head h / group), with Dk = Dv = 128:
//
//   g    = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])      (softplus(x) = x above 20)
//   beta = sigmoid(b[t, h])
//   q    = q * scale / sqrt(|q|^2 + 1e-6),  k = k / sqrt(|k|^2 + 1e-6)
//   S    = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = bf16(S^T q)          (S: [Dk, Dv] fp32)
//
// (Yang et al., arXiv 2412.06464; HF torch_recurrent_gated_delta_rule.) The fp32 sums over the state's rows run in
// another order than the Triton kernel's, so the state and o can differ from the Triton kernel's by fp32 rounding.
//
// Work unit u = (sequence, value head, 32-column block of the state: 128 rows x 32 columns, 16 KB in fp32); 4 warps a
// CTA, up to 4 CTAs an SM. Warp w holds rows 32w .. 32w + 31; its lanes are 8 column groups (4 columns each, one
// 16-byte load) times 4 row groups, row group ro holding rows 32w + 8ro .. + 7 (32 state values a thread; a warp's
// load instruction reads 4 rows of 32 contiguous columns). Reductions over rows: a thread's 8 rows, the row groups by
// shuffles, the 4 warps through shared memory (summed in warp order: every thread gets the same u and o). q and k come
// one 4-element slice a lane (their norms by warp shuffles), each row's element by a shuffle from the lane that
// loaded it.
//
// Why persistent: the launch-per-unit Triton kernel loads a slice, computes and exits, so an SM's loads pause at every
// unit; here a CTA requests unit n + 1's slice and inputs (a second register set) before it multiplies unit n. CTA c
// of G takes units c and c + G, then (with more than 2G units) the next unused one from a counter (atomicAdd, one
// iteration ahead), so the CTAs that start early under early launch (beside the kernel ahead of them) take more units
// than those that start late; the last CTA to finish resets the counter for the next launch.
//
// Under early launch (pdl 2 with early_state) a CTA's first state slice and the batch metadata are read before the
// PDL wait, as gdn_recurrent_kernel's EARLY_STATE does (kernels/pdl.py says why that is safe in the decode graphs;
// tests/kernels/test_pdl.py checks what is read there), the state through L2 only (ld.global.cg). A sequence without
// a token (padding) reads and writes nothing.
//
// Host side: vibeqwen_kernels/gdn/decode_cuda.py.

#include "mma_common.cuh"

namespace {

constexpr int kD = 128;                // Dk = Dv: the kernel is built for these
constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kWarpRows = kD / kWarps; // state rows per warp

struct Params {
  const __nv_bfloat16 *q, *k, *v, *a, *b;
  long long sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sa_t, sb_t;
  const float *A_log, *dt_bias;
  void* state;
  long long ss_slot, ss_h, ss_k;
  const void* slots;
  const int* qsl;
  const unsigned char* init;
  __nv_bfloat16* o;
  unsigned int* counter;  // [2]: units taken past the grid's first ones, CTAs finished (0 between launches)
  float scale;
  int hv, group, nunits, slots_i64, early_state, pdl;
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

constexpr int kCols = 32, kColBlocks = kD / kCols;  // a unit's state columns
constexpr int kColGroups = kCols / 4, kRowGroups = 32 / kColGroups, kRows = kWarpRows / kRowGroups;

// v (per column c) summed over the lanes of the other row groups (lane = ro * kColGroups + cg).
__device__ __forceinline__ void sum_row_groups(float (&v)[4]) {
#pragma unroll
  for (int o = kColGroups; o < 32; o <<= 1)
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] += __shfl_xor_sync(0xffffffffu, v[c], o);
}

// The 4 warps' partial sums of this thread's column group, in warp order (every thread gets the same sums).
__device__ __forceinline__ void sum_warps(const float4 (&part)[kWarps][kColGroups], int cg, float (&v)[4]) {
  v[0] = v[1] = v[2] = v[3] = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float4 r = part[w][cg];
    v[0] += r.x;
    v[1] += r.y;
    v[2] += r.z;
    v[3] += r.w;
  }
}

// One unit's operands in registers: its state slice (zeros for a new sequence) and, once past the PDL wait, its
// inputs. tok < 0: no unit (past the last, or a padding sequence's).
template <typename StateT>
struct Unit {
  float s[kRows][4], q[4], k[4], v[4], a, b;
  int tok, h, cb;
  StateT* sp;

  __device__ __forceinline__ void fetch_state(const Params& p, int u, int row0, int col) {
    tok = -1;
    if (u >= p.nunits) return;
    cb = u % kColBlocks;
    h = (u / kColBlocks) % p.hv;
    const int seq = u / (kColBlocks * p.hv);
    const int t = p.qsl[seq];
    if (p.qsl[seq + 1] == t) return;
    tok = t;
    const long long slot = p.slots_i64 ? reinterpret_cast<const long long*>(p.slots)[seq]
                                       : (long long)reinterpret_cast<const int*>(p.slots)[seq];
    sp = reinterpret_cast<StateT*>(p.state) + slot * p.ss_slot + h * p.ss_h + (long long)row0 * p.ss_k + cb * kCols +
         col;
    if (p.init[seq]) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) load_row<StateT>(sp + i * p.ss_k, s[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    }
  }

  __device__ __forceinline__ void fetch_inputs(const Params& p, int lane, int col) {
    if (tok < 0) return;
    const int hk = h / p.group;
    load4(p.q + tok * p.sq_t + hk * p.sq_h + 4 * lane, q);  // lane l: elements 4l .. 4l + 3 (the norms)
    load4(p.k + tok * p.sk_t + hk * p.sk_h + 4 * lane, k);
    load4(p.v + tok * p.sv_t + h * p.sv_h + cb * kCols + col, v);
    a = __bfloat162float(p.a[tok * p.sa_t + h]);
    b = __bfloat162float(p.b[tok * p.sb_t + h]);
  }
};

template <typename StateT>
__global__ void __launch_bounds__(kThreads, 4) gdn_recurrent_decode_kernel(const Params p) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, cgi = l % kColGroups, ro = l / kColGroups;
  const int row0 = w * kWarpRows + ro * kRows, col = 4 * cgi;
  const bool early = p.early_state && p.pdl == 2;
  __shared__ float4 red[2][kWarps][kColGroups];
  __shared__ int next_unit[2];  // unit k of this CTA in next_unit[k & 1] (k >= 2), taken one iteration ahead
  // units 0 and 1 of a CTA are fixed (c, c + G); with more than 2G units the rest come from the counter, the first
  // taken here and read only after iteration 0's barriers (no wait for the atomic before the first multiply)
  const int G = gridDim.x;
  const bool dynamic = p.nunits > 2 * G;
  if (!early) pdl_wait(p.pdl);
  Unit<StateT> nx;
  int u = blockIdx.x;
  nx.fetch_state(p, u, row0, col);
  if (early) pdl_wait(p.pdl);
  nx.fetch_inputs(p, l, col);
  if (dynamic && threadIdx.x == 0) next_unit[0] = 2 * G + (int)atomicAdd(p.counter, 1u);
  for (int j = 0; u < p.nunits; ++j) {
    const int un = j == 0 ? u + G : dynamic ? next_unit[(j + 1) & 1] : p.nunits;  // this CTA's unit j + 1
    if (dynamic && j >= 1 && threadIdx.x == 0 && un < p.nunits)
      next_unit[j & 1] = 2 * G + (int)atomicAdd(p.counter, 1u);  // unit j + 2
    Unit<StateT> cu = nx;
    nx.fetch_state(p, un, row0, col);  // unit un's loads go out before unit u is multiplied
    nx.fetch_inputs(p, l, col);
    if (cu.tok >= 0) {  // (uniform over the CTA)
      const float av = cu.a + p.dt_bias[cu.h];
      const float neg_a = -expf(p.A_log[cu.h]);
      float qf[4], kf[4];
      const float qn = p.scale / sqrtf(warp_sum(cu.q[0] * cu.q[0] + cu.q[1] * cu.q[1] + cu.q[2] * cu.q[2] +
                                                cu.q[3] * cu.q[3]) + 1e-6f);
      const float kn = 1.f / sqrtf(warp_sum(cu.k[0] * cu.k[0] + cu.k[1] * cu.k[1] + cu.k[2] * cu.k[2] +
                                            cu.k[3] * cu.k[3]) + 1e-6f);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        qf[c] = cu.q[c] * qn;
        kf[c] = cu.k[c] * kn;
      }
      const float softplus = av > 20.f ? av : logf(1.f + expf(fminf(av, 20.f)));
      const float decay = expf(neg_a * softplus);
      const float beta = 1.f / (1.f + expf(-cu.b));
      // row row0 + i's q and k: element i % 4 of lane row0 / 4 + i / 4 (row0 is a multiple of 4)
      float kr[kRows], qr[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        kr[i] = __shfl_sync(0xffffffffu, kf[i & 3], row0 / 4 + i / 4);
        qr[i] = __shfl_sync(0xffffffffu, qf[i & 3], row0 / 4 + i / 4);
      }
      float pk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          cu.s[i][c] *= decay;
          pk[c] = fmaf(cu.s[i][c], kr[i], pk[c]);
        }
      sum_row_groups(pk);
      if (ro == 0) red[0][w][cgi] = make_float4(pk[0], pk[1], pk[2], pk[3]);
      __syncthreads();
      float uu[4];
      sum_warps(red[0], cgi, uu);
#pragma unroll
      for (int c = 0; c < 4; ++c) uu[c] = beta * (cu.v[c] - uu[c]);
      float po[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          cu.s[i][c] = fmaf(kr[i], uu[c], cu.s[i][c]);
          po[c] = fmaf(cu.s[i][c], qr[i], po[c]);
        }
      sum_row_groups(po);
      if (ro == 0) red[1][w][cgi] = make_float4(po[0], po[1], po[2], po[3]);
#pragma unroll
      for (int i = 0; i < kRows; ++i) store_row(cu.sp + i * p.ss_k, cu.s[i]);
    }
    __syncthreads();  // red[1] and next_unit[j & 1] written
    if (cu.tok >= 0 && w == 0 && ro == 0) {
      float o[4];
      sum_warps(red[1], cgi, o);
      store_row(p.o + ((long long)cu.tok * p.hv + cu.h) * kD + cu.cb * kCols + col, o);
    }
    u = un;
  }
  // the last CTA to finish resets the counter: every CTA's tickets were taken before its arrival (the fence orders
  // them), and the next launch touches the counter only after its PDL wait, i.e. after this grid has ended
  if (dynamic && threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.counter + 1, 1u) != gridDim.x - 1) return;
    p.counter[0] = 0;
    p.counter[1] = 0;
  }
}

}  // namespace

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

// Returns 0, or a CUDA error code (launch errors only; the kernel runs asynchronously on `stream`).
// q, k: bf16 [T, Hk, 128] (strides in elements: sq_t, sq_h, ...; last dim contiguous, 8-byte aligned slices of 4), v:
// bf16 [T, Hv, 128], a, b: bf16 [T, Hv] (row strides sa_t, sb_t), A_log, dt_bias: fp32 [Hv]; state: fp32
// (state_bf16 0) or bf16 (1) [slots, Hv, 128, 128] (strides ss_slot, ss_h, ss_k; last dim contiguous, rows 16-byte
// aligned), updated in place; slots: int64 (slots_i64 1) or int32 [B]; qsl: int32 [B + 1] with at most one token per
// sequence; init: bool bytes [B] (0: the state starts at zero); o: bf16 [T, Hv, 128] (rows that belong to no
// sequence are not written). counter: two unsigned ints, 0 before the first launch (every launch leaves them 0;
// launches sharing them must not run concurrently). group = Hv / Hk; grid: the CTAs (vq_gdn_recurrent_decode_grid); with pdl 2
// and early_state the first state slices and the metadata are read before the PDL wait.
extern "C" int vq_gdn_recurrent_decode_launch(const void* q, long long sq_t, long long sq_h, const void* k,
                                              long long sk_t, long long sk_h, const void* v, long long sv_t,
                                              long long sv_h, const void* a, long long sa_t, const void* b,
                                              long long sb_t, const float* A_log, const float* dt_bias, void* state,
                                              int state_bf16, long long ss_slot, long long ss_h, long long ss_k,
                                              const void* slots, int slots_i64, const int* qsl,
                                              const unsigned char* init, float scale, void* o, unsigned int* counter,
                                              int B, int Hv, int group, int grid, int early_state, int pdl,
                                              void* stream) {
  if (B < 1 || Hv < 1 || group < 1 || Hv % group || grid < 1 || (long long)B * Hv * kColBlocks > (1LL << 30))
    return (int)cudaErrorInvalidValue;
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
  p.o = (__nv_bfloat16*)o;
  p.counter = counter;
  p.scale = scale;
  p.hv = Hv;
  p.group = group;
  p.nunits = B * Hv * kColBlocks;
  p.slots_i64 = slots_i64;
  p.early_state = early_state;
  p.pdl = pdl;
  static int configured_f32[64] = {0}, configured_bf16[64] = {0};
  const dim3 g(grid < p.nunits ? grid : p.nunits);
  const cudaStream_t st = (cudaStream_t)stream;
  if (state_bf16)
    return launch_kernel(gdn_recurrent_decode_kernel<__nv_bfloat16>, configured_bf16, g, kThreads, 0, st, pdl, p);
  return launch_kernel(gdn_recurrent_decode_kernel<float>, configured_f32, g, kThreads, 0, st, pdl, p);
}
