// The NEON build of the vector scan (vec_scan.h), for AArch64, whose
// baseline has NEON: 16-byte vectors.
#if defined(__aarch64__) && defined(__GNUC__)
#define ZS_TARGET neon
#define ZS_TARGET_BYTES 16
#define ZS_TARGET_ATTR
#define ZS_TARGET_MASKS 0
#define ZS_TARGET_F16C 0
#define ZS_TARGET_REGISTERS 32
#include "vec_scan.h"
#include "vec_fields.h"
#endif
