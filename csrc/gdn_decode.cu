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
// With the norm tail (y given: the NORM instantiations) the launch also applies the layer's gated RMSNorm to o, as
// norm_fused.gated_rms_norm does (n = bf16(o / sqrt(mean(o^2) + eps)), y = bf16(bf16(w n) silu(z)) per head): each
// unit, once its o columns are stored, adds 1 to its head's counter (ncnt[seq * Hv + h], 0 between launches); the CTA
// whose count is the head's last (kColBlocks - 1) zeroes it and norms the head's 128 outputs. Thread 0 reads its
// count one unit later (after that unit's multiply: the atomic's latency off the unit pipeline), or after its last
// unit. The same o; y up to the sum of squares' order and the last bits of sqrt, exp and the divisions.
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
  // the norm tail (NORM; last, so that the other fields keep their offsets): y [T, Hv, 128] bf16, the gate z
  // (strides sz_t, sz_h; last dim contiguous), the weight [128]
  __nv_bfloat16* y;
  const __nv_bfloat16* z;
  long long sz_t, sz_h;
  const __nv_bfloat16* nw;
  float eps;
  unsigned int* ncnt;  // [B * Hv] (0 between launches)
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

// Thread 0's pending count (the norm tail): the unit's head (token, head, counter index) in shared memory, the count
// itself in a register (kNoCount: none), so that the atomic's result is waited for only where it is read.
constexpr unsigned int kNoCount = 0xFFFFFFFFu;

__device__ __forceinline__ int* pending_head() {
  __shared__ int head[3];  // token, head, counter index
  return head;
}

// The gated RMSNorm of head h of token tok (norm_fused.gated_rms_norm's rounding steps), thread i: element i.
__device__ __forceinline__ void head_norm(const Params& p, int tok, int h) {
  __shared__ float part[kWarps];
  const int i = threadIdx.x;
  const size_t off = ((size_t)tok * p.hv + h) * kD + i;
  const float x = __bfloat162float(__ldcg(p.o + off));
  const float g = __bfloat162float(p.z[tok * p.sz_t + h * p.sz_h + i]);
  const float ss = warp_sum(x * x);
  if ((i & 31) == 0) part[i >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tot += part[w];
  const float inv = 1.f / sqrtf(tot / (float)kD + p.eps);
  const float n = round_bf16(x * inv);
  const float yw = round_bf16(__bfloat162float(p.nw[i]) * n);
  p.y[off] = __float2bfloat16_rn(yw * (g / (1.f + __expf(-g))));
  __syncthreads();  // part is read before a later call writes it
}

// Every thread, where a CTA barrier may run: thread 0 reads its pending count; if it was its head's last, the CTA norms
// that head (the counter zeroed first: all of the head's counts are in).
// The decision passes through the barrier itself (__syncthreads_or): a flag in shared memory could be rewritten by
// thread 0's next call (the one after the loop follows the loop's last without a barrier between) before a slow warp
// read it.
__device__ __forceinline__ void settle_norm(const Params& p, unsigned int& seen) {
  int* head = pending_head();
  int last = 0;
  if (threadIdx.x == 0) {
    if (seen == kColBlocks - 1) {
      __threadfence();  // the other units' o stores (their counts came first) before the reads in head_norm
      p.ncnt[head[2]] = 0u;
      last = 1;
    }
    seen = kNoCount;
  }
  if (__syncthreads_or(last)) head_norm(p, head[0], head[1]);
}

template <typename StateT, bool NORM>
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
  unsigned int seen = kNoCount;  // thread 0's pending count (NORM)
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
    if constexpr (NORM) settle_norm(p, seen);  // the previous unit's count, taken one multiply ago
    if (cu.tok >= 0 && w == 0 && ro == 0) {
      float o[4];
      sum_warps(red[1], cgi, o);
      store_row(p.o + ((long long)cu.tok * p.hv + cu.h) * kD + cu.cb * kCols + col, o);
    }
    if constexpr (NORM) {
      if (cu.tok >= 0 && w == 0) {
        __syncwarp();  // the warp's o stores before lane 0's fence (cumulative)
        if (l == 0) {
          __threadfence();
          int* head = pending_head();
          const int cidx = (u / (kColBlocks * p.hv)) * p.hv + cu.h;
          seen = atomicAdd(p.ncnt + cidx, 1u);  // read by settle_norm: the next unit's, or after the loop
          head[0] = cu.tok;
          head[1] = cu.h;
          head[2] = cidx;
        }
      }
    }
    u = un;
  }
  if constexpr (NORM) settle_norm(p, seen);  // the last unit's count
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
// launches sharing them must not run concurrently). y: null, or bf16 [T, Hv, 128] for the norm tail's output (see
// the header), with z: bf16 gate rows (strides sz_t, sz_h, last dim contiguous), nw: bf16 [128], eps, ncnt: B * Hv
// unsigned ints, 0 before the launch (it leaves them 0). group = Hv / Hk; grid: the CTAs (vq_gdn_recurrent_decode_grid); with pdl 2
// and early_state the first state slices and the metadata are read before the PDL wait.
extern "C" int vq_gdn_recurrent_decode_launch(const void* q, long long sq_t, long long sq_h, const void* k,
                                              long long sk_t, long long sk_h, const void* v, long long sv_t,
                                              long long sv_h, const void* a, long long sa_t, const void* b,
                                              long long sb_t, const float* A_log, const float* dt_bias, void* state,
                                              int state_bf16, long long ss_slot, long long ss_h, long long ss_k,
                                              const void* slots, int slots_i64, const int* qsl,
                                              const unsigned char* init, float scale, void* o, unsigned int* counter,
                                              void* y, const void* z, long long sz_t, long long sz_h, const void* nw,
                                              float eps, unsigned int* ncnt, int B, int Hv, int group, int grid,
                                              int early_state, int pdl, void* stream) {
  if (B < 1 || Hv < 1 || group < 1 || Hv % group || grid < 1 || (long long)B * Hv * kColBlocks > (1LL << 30) ||
      (y != nullptr && (z == nullptr || nw == nullptr || ncnt == nullptr)))
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
  p.y = (__nv_bfloat16*)y;
  p.z = (const __nv_bfloat16*)z;
  p.sz_t = sz_t;
  p.sz_h = sz_h;
  p.nw = (const __nv_bfloat16*)nw;
  p.eps = eps;
  p.ncnt = ncnt;
  p.scale = scale;
  p.hv = Hv;
  p.group = group;
  p.nunits = B * Hv * kColBlocks;
  p.slots_i64 = slots_i64;
  p.early_state = early_state;
  p.pdl = pdl;
  static int configured[4][64] = {{0}};
  const dim3 g(grid < p.nunits ? grid : p.nunits);
  const cudaStream_t st = (cudaStream_t)stream;
  if (y != nullptr) {
    if (state_bf16)
      return launch_kernel(gdn_recurrent_decode_kernel<__nv_bfloat16, true>, configured[2], g, kThreads, 0, st, pdl, p);
    return launch_kernel(gdn_recurrent_decode_kernel<float, true>, configured[3], g, kThreads, 0, st, pdl, p);
  }
  if (state_bf16)
    return launch_kernel(gdn_recurrent_decode_kernel<__nv_bfloat16, false>, configured[0], g, kThreads, 0, st, pdl, p);
  return launch_kernel(gdn_recurrent_decode_kernel<float, false>, configured[1], g, kThreads, 0, st, pdl, p);
}
