// Helpers the tensor-core GEMMs of csrc/ share (moe_mma.cu, fp8_mma.cu, bf16_mma.cu): PTX wrappers for the
// instructions they issue, and the host-side launch with programmatic dependent launch. kernels/cuda_build.py
// inlines this file where a source includes it (the build key hashes the result: an edit here rebuilds them all).
// Everything is in an anonymous namespace: each library gets its own copy.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// Programmatic dependent launch: a kernel launched with it (`pdl` in the launchers: 1, or 2 for early launch) may
// start while the kernel ahead of it in the stream still runs; it waits here, before it touches memory that kernel
// writes or reads, until that kernel has finished and its writes are visible (PTX ISA, griddepcontrol). With pdl 2
// it then lets its own dependent launch: once every CTA of this grid has passed here (or exited), the next PDL
// kernel's CTAs may be scheduled on free SM resources and run up to their own wait (the FP8, bf16 and router GEMMs
// launched with pdl 2 request their constant weights first). No-ops in a launch without PDL (pdl 0).
__device__ __forceinline__ void pdl_wait(int pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (pdl == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<const uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 as_bf162(uint32_t v) { return *reinterpret_cast<const __nv_bfloat162*>(&v); }

// c += a (16 x 16, bf16, row) x b (16 x 8, bf16, col), fp32 accumulators (PTX ISA, mma.m16n8k16 fragments).
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Inclusive prefix sum of v over the warp's lanes (lane l gets v_0 + ... + v_l; all 32 lanes take part).
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// 16 bytes of a weight stream read once: no L1 allocation.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 bytes global -> shared (shared address dst), asynchronously; completes with cp.async.wait_group.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8, and receives in r[j] the
// elements (row l / 4, columns 2 (l % 4), 2 (l % 4) + 1) of matrix j.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Launches kernel<<<grid, threads, smem, stream>>>(args...) through cudaLaunchKernelEx, with the programmatic
// stream serialization attribute when pdl != 0. Above 48 KB of dynamic shared memory it first opts the kernel in,
// once per device (configured[device]: the largest size set so far). Returns 0 or the CUDA error code, with the
// error cleared (a later, unrelated launch check must not report it).
template <typename... Params, typename... Args>
int launch_kernel(void (*kernel)(Params...), int (&configured)[64], dim3 grid, int threads, int smem,
                  cudaStream_t stream, int pdl, Args... args) {
  if (smem > 48 * 1024) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess && !(dev < 64 && smem <= configured[dev])) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err == cudaSuccess && dev < 64) configured[dev] = smem;
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return (int)err;
    }
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return (int)err;
  }
  return (int)cudaGetLastError();
}

}  // namespace
