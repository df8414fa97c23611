// The AVX-512 build of the vector scan (vec_scan.h), for x86-64 CPUs with
// AVX-512 F, BW, DQ and VL: 64-byte vectors, whose compares give mask
// registers that count with one masked add.
#if defined(__x86_64__) && defined(__GNUC__)
#define ZS_TARGET avx512
#define ZS_TARGET_BYTES 64
#define ZS_TARGET_ATTR \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2")))
#define ZS_TARGET_MASKS 1
#define ZS_TARGET_F16C 1
#define ZS_TARGET_REGISTERS 32
#include "vec_scan.h"
#include "vec_fields.h"
#endif
