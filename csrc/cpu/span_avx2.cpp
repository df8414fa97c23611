// The AVX2 build of the vector scan (vec_scan.h), for x86-64 CPUs with AVX2,
// FMA and F16C: 32-byte vectors.
#if defined(__x86_64__) && defined(__GNUC__)
#define ZS_TARGET avx2
#define ZS_TARGET_BYTES 32
#define ZS_TARGET_ATTR __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define ZS_TARGET_MASKS 0
#define ZS_TARGET_F16C 1
#define ZS_TARGET_REGISTERS 16
#include "vec_scan.h"
#include "vec_fields.h"
#endif
