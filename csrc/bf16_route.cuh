// The decode router's pieces that csrc/bf16_mma.cu (moe_route_kernel) and csrc/moe_decode.cu (the one-launch decode
// MoE) share: the bf16 tile GEMM on shuffled weights (bf16_mma.shuffle_bf16_mma's layout) and the per-token
// routing (fp32 softmax, top-k with ties to the lower id, renormalisation, the shared expert's sigmoid gate), so
// that both compute the same logits and weights bit for bit. Inlined by kernels/cuda_build.py where a source
// includes it; everything in an anonymous namespace.

#pragma once

#include "mma_common.cuh"

namespace {

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// atomicInc with acq_rel semantics at GPU scope (PTX ISA, memory consistency model: a release cumulative over what
// the thread observed, an acquire of what the other CTAs released).
__device__ __forceinline__ unsigned int atomic_inc_acq_rel(unsigned int* p, unsigned int wrap) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(wrap) : "memory");
  return old;
}

// dbg[i] = clock64, read after v is stored to dbg[13] (the store waits for v: a phase's end, for profiling).
__device__ __forceinline__ void stamp_after(long long* dbg, int i, uint32_t v) {
  *reinterpret_cast<volatile long long*>(dbg + 13) = v;
  long long c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
  dbg[i] = c;
}

// Sorts v descending (bubble network: EPL is 8 or 16, once per token).
template <int N>
__device__ __forceinline__ void sort_desc(uint32_t (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = (i & 1); j + 1 < N; j += 2) {
      const uint32_t a = v[j], b = v[j + 1];
      v[j] = max(a, b);
      v[j + 1] = min(a, b);
    }
}

// 16 bytes of x (read-only for the kernel's lifetime).
__device__ __forceinline__ uint4 load_x16(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// The bf16 logit of a routing key (see moe_route_kernel): undo the order-preserving map of its top 16 bits.
__device__ __forceinline__ float key_value(uint32_t key) {
  const uint32_t o = key >> 16;
  return __uint_as_float(((o & 0x8000u) ? (o & 0x7FFFu) : (~o & 0xFFFFu)) << 16);
}

// The start of a tile's sums: acc zeroed, and the token rows g, g + 8, ... of x for lane (g, t)'s B fragments (8 t:
// its 8 consecutive elements of a step pair); rows >= T read row 0 (their sums are never stored).
template <int NT>
__device__ __forceinline__ void tile_start(const __nv_bfloat16* __restrict__ x, int x_stride, int T, int lane,
                                           float (&acc)[NT][4], const __nv_bfloat16* (&xr)[NT]) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int row = n * 8 + g;
    xr[n] = x + (size_t)(row < T ? row : 0) * x_stride + 8 * t;
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[n][c] = 0.f;
  }
}

// k16 steps (step, step + 1) of a 16-row tile, their A fragments a0 and a1, against the token rows xr into acc.
template <int NT>
__device__ __forceinline__ void step_pair_mma(float (&acc)[NT][4], const __nv_bfloat16* const (&xr)[NT], int step,
                                              const uint4& a0, const uint4& a1) {
  const uint32_t r0[4] = {a0.x, a0.y, a0.z, a0.w}, r1[4] = {a1.x, a1.y, a1.z, a1.w};
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const uint4 b = load_x16(xr[n] + step * 16);
    mma16816(acc[n], r0, b.x, b.y);
    mma16816(acc[n], r1, b.z, b.w);
  }
}

// Warp partial sums over k16 steps [step0, step0 + steps) (steps even) of this CTA's 16-row tile (wq: the tile's
// shuffled steps) against token rows 0..8 NT - 1 of x. The weight's k order within each 32-k pair of steps is
// permuted at load time (bf16_mma.fragment_sources) so that lane (g, t)'s B fragments of both steps are the 8
// consecutive x elements [32 d + 8 t, 32 d + 8 t + 8) of token row g: one 16-byte load per n8 tile and step pair.
// f0, f1: this lane's vectors of the first two steps (step0, step0 + 1), loaded by the caller (before its PDL wait).
template <int NT, int U>
__device__ __forceinline__ void gemm_tile(const __nv_bfloat16* __restrict__ x, int x_stride, int T,
                                          const uint4* __restrict__ wq, int steps, int step0, int lane,
                                          const uint4& f0, const uint4& f1, float (&acc)[NT][4]) {
  const __nv_bfloat16* xr[NT];
  tile_start<NT>(x, x_stride, T, lane, acc, xr);
#pragma unroll U
  for (int s = 0; s < steps; s += 2) {
    const int step = step0 + s;
    const uint4 a0 = s == 0 ? f0 : load_stream(wq + (size_t)step * 32 + lane);
    const uint4 a1 = s == 0 ? f1 : load_stream(wq + (size_t)(step + 1) * 32 + lane);
    step_pair_mma<NT>(acc, xr, step, a0, a1);
  }
}

// The same sums as gemm_tile with every A fragment of the K range already in this lane's registers (frag[s]: step
// step0 + s, loaded by the caller before its PDL wait, so that no weight load is left after it).
template <int NT, int STEPS>
__device__ __forceinline__ void gemm_tile_held(const __nv_bfloat16* __restrict__ x, int x_stride, int T, int step0,
                                               int lane, const uint4 (&frag)[STEPS], float (&acc)[NT][4]) {
  const __nv_bfloat16* xr[NT];
  tile_start<NT>(x, x_stride, T, lane, acc, xr);
#pragma unroll
  for (int s = 0; s < STEPS; s += 2) step_pair_mma<NT>(acc, xr, step0 + s, frag[s], frag[s + 1]);
}

// A logit written with its launch's tag (moe_decode.cu's tagged logits): the fp32 bits in the low word, the tag in
// the high one, one 64-bit store (single-copy atomic: a reader that sees the tag sees the value stored with it).
__device__ __forceinline__ void st_tagged(unsigned long long* p, float v, uint32_t tag) {
  const unsigned long long w = (unsigned long long)tag << 32 | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

// w = *p where pred is non-zero (else w is left as it was): one predicated load, no branch, so that a lane's loads
// issue back to back (a branch around each load put its use before the next load: one L2 round trip each).
__device__ __forceinline__ void ld_tagged_if(unsigned long long& w, const unsigned long long* p, uint32_t pred) {
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %2, 0;\n\t@q ld.relaxed.gpu.global.b64 %0, [%1];\n\t}"
      : "+l"(w)
      : "l"(p), "r"(pred)
      : "memory");
}

// Where route_tokens reads its logits: fp32 rows (plain, row stride ld: read with ld.global.cg, they may come from
// other CTAs of this grid), or tagged 64-bit words (see st_tagged) of the same layout: with spin, each word is
// re-read until it carries tag, and then holds the value stored with that tag (the store is relaxed, not a release:
// what makes this safe is only that value and tag are one single-copy-atomic word, so nothing else may be published
// under the tag); a wait of more than 2 s traps. Without spin its value is taken as read (a grid barrier came
// first).
struct LogitRows {
  const float* plain;
  const unsigned long long* tagged;
  int ld;
  uint32_t tag;
  bool spin;
};

// v = *p (ld.global.cg) where pred is non-zero, else v is left as it was (see ld_tagged_if).
__device__ __forceinline__ void ld_cg_if(float& v, const float* p, uint32_t pred) {
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %2, 0;\n\t@q ld.global.cg.f32 %0, [%1];\n\t}"
      : "+f"(v)
      : "l"(p), "r"(pred)
      : "memory");
}

// Lane `lane`'s tagged logits of row tok (src.tagged): f[j] = column lane + 32 j (j < EPL, the columns < E; others
// 0) and, for lane top_k, the shared gate's logit at column E (else 0).
template <int EPL>
__device__ __forceinline__ void load_tagged(const LogitRows src, int tok, bool valid, int E, int top_k, int lane,
                                            float (&f)[EPL], float& gate) {
  const bool want_gate = valid && lane == top_k;
  const unsigned long long* row = src.tagged + (size_t)(valid ? tok : 0) * src.ld;
  uint32_t pending = 0;  // bit j: word j not yet read with the tag (bit EPL: the gate)
  unsigned long long w[EPL + 1];
#pragma unroll
  for (int j = 0; j <= EPL; ++j) {
    w[j] = 0ull;
    if (j < EPL ? valid && lane + 32 * j < E : want_gate) pending |= 1u << j;
  }
  const long long t0 = src.spin ? globaltimer() : 0;
  while (true) {
    // all of this lane's pending words requested before any is looked at: one L2 round trip a pass
#pragma unroll
    for (int j = 0; j <= EPL; ++j) ld_tagged_if(w[j], row + (j < EPL ? lane + 32 * j : E), pending >> j & 1u);
    if (!src.spin) break;
#pragma unroll
    for (int j = 0; j <= EPL; ++j)
      if ((uint32_t)(w[j] >> 32) == src.tag) pending &= ~(1u << j);
    if (!__any_sync(0xffffffffu, pending != 0u)) break;
    if (globaltimer() - t0 > 2000000000ll) __trap();  // the writers never came: fail loudly
  }
#pragma unroll
  for (int j = 0; j < EPL; ++j) f[j] = __uint_as_float((uint32_t)w[j]);  // 0 where not read
  gate = __uint_as_float((uint32_t)w[EPL]);
}

// Routes tokens warp, warp + W, ... (TPW of them; tokens >= T skipped) from their logits rows (src: bf16 values in
// fp32; E routed columns, then the shared gate's at column E). Writes topk_w / topk_ids [tok * (top_k + 1) + s] (slot
// top_k: id E, sigmoid of the shared-gate logit) and, unless tokens is null, sets bit tok of tokens[id] (atomicOr:
// shared memory of the caller's CTA) for every chosen id (E included). Routing: a logit becomes the key
// (order-preserving bits of the bf16 value) << 16 | (0xFFFF - e): the largest key is the largest logit, ties to the
// lower id. Lane l holds experts l + 32 j (EPL of them, E <= 32 EPL), its keys sorted descending (key 0: no expert);
// each round one redux.sync finds the largest head, and the lane holding it (heads are distinct) pops it. top_k <= 31.
// NaN logits rank as -inf (ids stay in range).
// BATCH (plain rows only): each lane's logit loads issued as predicated loads before any is looked at (one L2 round
// trip), where otherwise the compiler places each load next to its key (SASS of moe_route_kernel<4, 8, 32, 1>:
// batches of 2-3 loads with their uses between, ~4 round trips). A template argument, so that the kernels without it
// compile as before.
// dbg (profiling, may be null): warp 0's clock64 once its keys are built, sorted, chosen and summed ([2] .. [5]), each
// read after a store of a value that phase made ([13]: so that the clock is not read before that value exists).
template <int TPW, int EPL, bool BATCH = false>
__device__ __forceinline__ void route_tokens(const LogitRows src, int T, int E, int top_k, int warp, int W,
                                             int lane, float* topk_w, int* topk_ids, unsigned long long* tokens,
                                             long long* dbg = nullptr) {
  const bool stamp = dbg != nullptr && warp == 0 && lane == 0;
  const int kp = top_k + 1;
  // TPW tokens per warp, interleaved for latency
  uint32_t key[TPW][EPL];
  uint32_t mine[TPW];  // lane s < top_k: the key chosen in round s
  float m[TPW];
  float gate[TPW];     // lane top_k: the shared gate's logit (loaded with the keys: no round trip at the end)
#pragma unroll
  for (int u = 0; u < TPW; ++u) {
    const int tok = warp + W * u;
    float f[EPL];
    if (BATCH) {  // plain rows, every load issued before any is used
      const float* row = src.plain + (size_t)(tok < T ? tok : 0) * src.ld;
      gate[u] = 0.f;
      ld_cg_if(gate[u], row + E, tok < T && lane == top_k);
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        f[j] = 0.f;
        ld_cg_if(f[j], row + lane + 32 * j, tok < T && lane + 32 * j < E);
      }
    }
    if (src.tagged != nullptr) load_tagged<EPL>(src, tok, tok < T, E, top_k, lane, f, gate[u]);
    const float* row = src.plain + (size_t)(tok < T ? tok : 0) * src.ld;
    if (src.tagged == nullptr && !BATCH) gate[u] = tok < T && lane == top_k ? __ldcg(row + E) : 0.f;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      uint32_t k = 0;
      if (tok < T && e < E) {
        const float v = src.tagged != nullptr || BATCH ? f[j] : __ldcg(row + e);  // plain: each load next to its key
        const uint32_t b = v != v ? 0xFF80u : __float_as_uint(v) >> 16;  // NaN ranks as -inf: ids stay in range
        k = ((b & 0x8000u) ? (~b & 0xFFFFu) : (b | 0x8000u)) << 16 | (0xFFFFu - e);
      }
      key[u][j] = k;
    }
    if (stamp && u == 0) stamp_after(dbg, 2, key[u][0]);
    sort_desc<EPL>(key[u]);
    mine[u] = 0;
  }
  if (stamp) stamp_after(dbg, 3, key[0][0]);
  for (int s = 0; s < top_k; ++s) {
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      const uint32_t best = __reduce_max_sync(0xffffffffu, key[u][0]);
      if (lane == s) mine[u] = best;
      if (s == 0) m[u] = key_value(best);
      const bool pop = key[u][0] == best;
#pragma unroll
      for (int j = 0; j < EPL - 1; ++j) key[u][j] = pop ? key[u][j + 1] : key[u][j];
      key[u][EPL - 1] = pop ? 0u : key[u][EPL - 1];
    }
  }
  if (stamp) stamp_after(dbg, 4, mine[0]);
#pragma unroll
  for (int u = 0; u < TPW; ++u) {
    const int tok = warp + W * u;
    // softmax over the routed logits: the sum of exp(l - max) over all E (every key still held, plus the chosen)
    float mu = m[u];
    if (mu == -__int_as_float(0x7f800000)) mu = 0.f;  // no finite logit: NaN weights, in-range ids
    float acc = mine[u] != 0u && lane < top_k ? __expf(key_value(mine[u]) - mu) : 0.f;
    const float chosen = acc;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      if (EPL <= 8) {  // no branch: the exponentials issue back to back (acc + 0 is acc: acc >= 0)
        const float e = __expf(key_value(key[u][j]) - mu);
        acc += key[u][j] ? e : 0.f;
      } else if (key[u][j]) {  // (16 live exponentials a token spilled the 16-key kernels' registers)
        acc += __expf(key_value(key[u][j]) - mu);
      }
    }
    float psum = chosen;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      acc += __shfl_xor_sync(0xffffffffu, acc, o);
      psum += __shfl_xor_sync(0xffffffffu, psum, o);
    }
    if (stamp && u == 0) stamp_after(dbg, 5, __float_as_uint(acc + psum));
    if (tok >= T) continue;
    // renormalised top-k weight: (e_s / sum) / (sum_k e_k / sum), the reference's two divisions
    const float inv = 1.f / acc;
    if (lane < top_k) {
      const int id = 0xFFFF - (int)(mine[u] & 0xFFFFu);
      topk_w[tok * kp + lane] = (chosen * inv) / (psum * inv);
      topk_ids[tok * kp + lane] = id;
      if (tokens != nullptr) atomicOr(&tokens[id], 1ull << tok);
    } else if (lane == top_k) {
      topk_w[tok * kp + lane] = 1.f / (1.f + __expf(-gate[u]));
      topk_ids[tok * kp + lane] = E;
      if (tokens != nullptr) atomicOr(&tokens[E], 1ull << tok);
    }
  }
}

}  // namespace
