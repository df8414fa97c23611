// Issue rate of single SASS instructions on the GPU: warp instructions per
// SM clock, for the weights of benchmarks/sass_cost.py.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdint>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

constexpr int kIter = 4096;
constexpr int kChains = 8;

template <int Op>
__device__ __forceinline__ void step(uint32_t (&r)[kChains], uint32_t k) {
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
    uint32_t& v = r[c];
    if constexpr (Op == 0) asm volatile("add.f32 %0, %0, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 1) asm volatile("fma.rn.sat.f32 %0, %0, %1, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 2) asm volatile("min.f32 %0, %0, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 3) asm volatile("{.reg .pred p; setp.lt.f32 p, %0, %1; selp.b32 %0, %1, %0, p;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 4) asm volatile("fma.rn.sat.f16x2 %0, %0, %1, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 5) asm volatile("add.f16x2 %0, %0, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 6) asm volatile("min.f16x2 %0, %0, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 7) asm volatile("lop3.b32 %0, %0, %1, %1, 0x96;" : "+r"(v) : "r"(k));
    if constexpr (Op == 8) asm volatile("add.u32 %0, %0, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 9) v = __viaddmin_u16x2(v, k, k ^ v);
    if constexpr (Op == 10) asm volatile("min.u32 %0, %0, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 11) asm volatile("prmt.b32 %0, %0, %1, 0x3210;" : "+r"(v) : "r"(k));
    if constexpr (Op == 12) asm volatile("shf.l.wrap.b32 %0, %0, %1, 3;" : "+r"(v) : "r"(k));
    if constexpr (Op == 13) asm volatile("mad.lo.u32 %0, %0, %1, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 14) asm volatile("{.reg .f64 d; cvt.f64.f32 d, %0; cvt.rn.f32.f64 %0, d;}" : "+r"(v));
    if constexpr (Op == 15) asm volatile("{.reg .f64 d; mov.b64 d, {%0, %1}; add.f64 d, d, d; mov.b64 {%0, %1}, d;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 16) asm volatile("popc.b32 %0, %0;" : "+r"(v));
    if constexpr (Op == 17) asm volatile("{.reg .pred p; setp.lt.u32 p, %0, %1; @p add.f32 %0, %0, %1;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 18) asm volatile("{.reg .pred p, q; setp.lt.f16x2 p|q, %0, %1; @p add.f32 %0, %0, %1;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 19) asm volatile("mul.sat.f32 %0, %0, %1;" : "+r"(v) : "r"(k));
    if constexpr (Op == 20) asm volatile("cvt.f32.f16 %0, %0;" : "+r"(v));
    if constexpr (Op == 22) asm volatile("{add.f32 %0, %0, %1; lop3.b32 %0, %0, %1, %1, 0x96;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 23) asm volatile("{add.f32 %0, %0, %1; add.f32 %0, %0, %1; lop3.b32 %0, %0, %1, %1, 0x96;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 24) asm volatile("{add.f32 %0, %0, %1; {.reg .f64 d; mov.b64 d, {%0, %1}; add.f64 d, d, d; mov.b64 {%0, %1}, d;}}" : "+r"(v) : "r"(k));
    if constexpr (Op == 25) asm volatile("{lop3.b32 %0, %0, %1, %1, 0x96; mad.lo.u32 %0, %0, %1, %1;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 26) asm volatile("{fma.rn.sat.f16x2 %0, %0, %1, %1; lop3.b32 %0, %0, %1, %1, 0x96;}" : "+r"(v) : "r"(k));
    if constexpr (Op == 21) asm volatile("{.reg .f64 d; cvt.f64.f32 d, %0; mov.b64 {%0, %1}, d;}" : "+r"(v) : "r"(k));
  }
}

template <int Op>
__global__ void __launch_bounds__(512) rate(uint32_t* out, long long* cycles, uint32_t seed) {
  uint32_t r[kChains];
  for (int c = 0; c < kChains; ++c) r[c] = seed * (threadIdx.x + c);
  __syncthreads();
  long long t0 = clock64();
#pragma unroll 1
  for (int i = 0; i < kIter; i += 4) {
    step<Op>(r, seed + i);
    step<Op>(r, seed + i + 1);
    step<Op>(r, seed + i + 2);
    step<Op>(r, seed + i + 3);
  }
  __syncthreads();
  long long t1 = clock64();
  uint32_t acc = 0;
  for (int c = 0; c < kChains; ++c) acc ^= r[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int Op>
int run(const char* name, int sms, uint32_t* out, long long* cyc, int instr_per_step) {
  const int blocks = sms * 4, threads = 512;
  rate<Op><<<blocks, threads>>>(out, cyc, 3u);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  static long long h[4096];
  CHECK(cudaMemcpy(h, cyc, blocks * sizeof(long long), cudaMemcpyDeviceToHost));
  long long mx = 0;
  for (int b = 0; b < blocks; ++b) mx = h[b] > mx ? h[b] : mx;
  // Four 512-thread blocks per SM, all resident: the SM issued this many warp instructions.
  const double warp_instr = 4.0 * threads / 32 * double(kIter) * kChains * instr_per_step;
  const double per_clk = warp_instr / double(mx);
  printf("%-28s %6.2f warp instr/clk/SM  -> weight %.2f\n", name, per_clk, 4.0 / per_clk);
  return 0;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint32_t* out; long long* cyc;
  CHECK(cudaMalloc(&out, sms * 4 * 512 * 4));
  CHECK(cudaMalloc(&cyc, sms * 4 * 8));
  run<0>("FADD", sms, out, cyc, 1);
  run<1>("FFMA.SAT", sms, out, cyc, 1);
  run<19>("FMUL.SAT", sms, out, cyc, 1);
  run<2>("FMNMX", sms, out, cyc, 1);
  run<3>("FSETP+FSEL (2)", sms, out, cyc, 2);
  run<17>("ISETP+@P FADD (2)", sms, out, cyc, 2);
  run<18>("HSETP2+@P FADD (2)", sms, out, cyc, 2);
  run<4>("HFMA2.SAT", sms, out, cyc, 1);
  run<5>("HADD2", sms, out, cyc, 1);
  run<6>("HMNMX2", sms, out, cyc, 1);
  run<20>("HADD2.F32 (cvt f16->f32)", sms, out, cyc, 1);
  run<7>("LOP3", sms, out, cyc, 1);
  run<8>("IADD3", sms, out, cyc, 1);
  run<9>("VIADDMNMX.U16x2", sms, out, cyc, 1);
  run<10>("IMNMX", sms, out, cyc, 1);
  run<11>("PRMT", sms, out, cyc, 1);
  run<12>("SHF", sms, out, cyc, 1);
  run<13>("IMAD", sms, out, cyc, 1);
  run<14>("F2F.F64.F32+F2F.F32.F64 (2)", sms, out, cyc, 2);
  run<21>("F2F.F64.F32", sms, out, cyc, 1);
  run<15>("DADD", sms, out, cyc, 1);
  run<16>("POPC", sms, out, cyc, 1);
  run<22>("FADD+LOP3 (2)", sms, out, cyc, 2);
  run<23>("2 FADD+LOP3 (3)", sms, out, cyc, 3);
  run<24>("FADD+DADD (2)", sms, out, cyc, 2);
  run<25>("LOP3+IMAD (2)", sms, out, cyc, 2);
  run<26>("HFMA2.SAT+LOP3 (2)", sms, out, cyc, 2);
  return 0;
}
