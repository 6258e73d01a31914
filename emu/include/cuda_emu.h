// CUDA on the CPU: what a kernel file (kernels/*.cu, kernels/common.cuh)
// takes from the CUDA toolkit and NVRTC, for the system C++ compiler.
//
// The NVRTC stand-in (src/nvrtc/) force-includes this header (-include
// cuda_emu.h) into every program it compiles, so the kernel sources build
// unmodified. What a header cannot supply the stand-in's source pre-pass
// does: it registers every extern "C" __global__ function (pw_emu_module_init
// and its kernel table), rewrites inline PTX mma.sync statements into calls
// of the runtime's mma, and turns `extern __shared__ T name[];` into a
// pointer to the block's dynamic shared memory.
//
// Lanes (CUDA threads) run as fibers and a block's fibers share one OS
// thread (include/pw_emu_abi.h), so:
// - __shared__ is `static thread_local`: the thread's copy IS the block's
//   shared memory; the driver poisons it at each block start.
// - Everything lane-cooperative (the lane's coordinates, barriers, shuffles,
//   votes, mma) goes through the runtime table the driver hands to
//   pw_emu_module_init; nothing here keeps per-lane state of its own.
//
// Numerics: the stand-in compiles with -ffp-contract=off -fno-fast-math, so
// every float operation is one IEEE-754 round-to-nearest operation, as CUDA's
// __f*_rn intrinsics promise (nvcc may fuse a*b+c into an FMA unless told
// not to; the emulator never does, so a kernel whose result depends on
// fusion shows it). The math functions come from the host's libm: for the
// ones the kernels use (expf, logf, log, sqrtf, tanhf, fmaxf, fminf, fabsf)
// glibc is correctly rounded or within 1-2 ulp, inside the bounds the CUDA
// Programming Guide documents for them (expf 2 ulp, logf 1 ulp, tanhf 2 ulp,
// sqrtf and fmaxf exact); rsqrtf (CUDA: 2 ulp) is 1/sqrtf, within 1 ulp.
// __expf and __logf are CUDA's fast approximations; here they are expf and
// logf, which are more accurate than the bounds they document.
//
// Deliberately absent, so that a kernel using them fails to compile instead
// of running with made-up semantics: atomics (no kernel uses one) and
// __activemask (the runtime table has no way to tell which lanes are
// converged; declared deleted below so the error names it).
#pragma once

#include "pw_emu_abi.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>

// The runtime table of the driver that loaded this module (set once by
// pw_emu_module_init, which the stand-in generates). A module is one
// translation unit, so `static` is the module's one copy.
static const PwEmuRuntime* pw_emu_runtime = nullptr;

// ---- Declaration specifiers -------------------------------------------------
// (Defined after the system headers above so none of them sees these names.)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
// Recorded by the pre-pass (the kernel table's launch_bounds); the driver
// refuses a launch over it, as the hardware does.
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local

// The address of a thread_local of this module: touching it makes the loader
// allocate this thread's block of the module's thread_local storage (the
// block's shared memory); the driver checks that it lies in the block the
// loader's __tls_get_addr gives for the module.
inline void* pw_emu_touch_shared() {
    static thread_local char anchor;
    return &anchor;
}

// ---- Built-in variables -----------------------------------------------------

typedef PwEmuDim3 uint3;

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(const PwEmuDim3& v) : x(v.x), y(v.y), z(v.z) {}
};

inline const PwEmuLane& pw_emu_lane() {
    return *pw_emu_runtime->lane();
}

// Read-only, as in CUDA (an assignment to threadIdx.x does not compile).
#define threadIdx (pw_emu_lane().thread_idx)
#define blockIdx (pw_emu_lane().block_idx)
#define blockDim (pw_emu_lane().block_dim)
#define gridDim (pw_emu_lane().grid_dim)

constexpr int warpSize = 32;

// ---- Barriers, shuffles, votes ----------------------------------------------

inline void __syncthreads() {
    pw_emu_runtime->syncthreads();
}

inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    pw_emu_runtime->syncwarp(mask);
}

inline unsigned int pw_emu_shfl32(unsigned int mask, unsigned int v, int lane_or_delta, int width, int mode) {
    return pw_emu_runtime->shfl_sync(mask, v, lane_or_delta, width, mode);
}

// A 4- or 8-byte value through 32-bit shuffles: CUDA's 64-bit overloads are
// two shfl.sync.b32 of the low and high words, with the same lane selection.
template <typename T>
inline T pw_emu_shfl(unsigned int mask, T var, int lane_or_delta, int width, int mode) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 32- or 64-bit values");
    unsigned int words[sizeof(T) / 4];
    memcpy(words, &var, sizeof(T));
    for (unsigned int i = 0; i < sizeof(T) / 4; i++) {
        words[i] = pw_emu_shfl32(mask, words[i], lane_or_delta, width, mode);
    }
    T out;
    memcpy(&out, words, sizeof(T));
    return out;
}

#define PW_EMU_SHFL_OVERLOADS(T)                                                                \
    inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = warpSize) {        \
        return pw_emu_shfl<T>(mask, var, src_lane, width, PW_EMU_SHFL_IDX);                     \
    }                                                                                           \
    inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) { \
        return pw_emu_shfl<T>(mask, var, (int)delta, width, PW_EMU_SHFL_UP);                    \
    }                                                                                           \
    inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) { \
        return pw_emu_shfl<T>(mask, var, (int)delta, width, PW_EMU_SHFL_DOWN);                  \
    }                                                                                           \
    inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = warpSize) {   \
        return pw_emu_shfl<T>(mask, var, lane_mask, width, PW_EMU_SHFL_BFLY);                   \
    }

PW_EMU_SHFL_OVERLOADS(int)
PW_EMU_SHFL_OVERLOADS(unsigned int)
PW_EMU_SHFL_OVERLOADS(long)
PW_EMU_SHFL_OVERLOADS(unsigned long)
PW_EMU_SHFL_OVERLOADS(long long)
PW_EMU_SHFL_OVERLOADS(unsigned long long)
PW_EMU_SHFL_OVERLOADS(float)
PW_EMU_SHFL_OVERLOADS(double)
#undef PW_EMU_SHFL_OVERLOADS

inline int __all_sync(unsigned int mask, int predicate) {
    return (int)pw_emu_runtime->vote_sync(mask, predicate, PW_EMU_VOTE_ALL);
}

inline int __any_sync(unsigned int mask, int predicate) {
    return (int)pw_emu_runtime->vote_sync(mask, predicate, PW_EMU_VOTE_ANY);
}

inline unsigned int __ballot_sync(unsigned int mask, int predicate) {
    return pw_emu_runtime->vote_sync(mask, predicate, PW_EMU_VOTE_BALLOT);
}

// Which lanes are converged is a property of the hardware's scheduler that
// the emulator does not model; a kernel must name its lanes in a mask.
unsigned int __activemask() = delete;

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: the pre-pass rewrites
// the inline PTX statement into this call, operands bound as its template says.
inline void pw_emu_mma_m16n8k16_f32_bf16(float d[4], const unsigned int a[4], const unsigned int b[2],
                                         const float c[4]) {
    pw_emu_runtime->mma_m16n8k16_f32_bf16(d, a, b, c);
}

// extern __shared__ T name[]: the pre-pass declares name as this pointer.
inline void* pw_emu_dynamic_shared() {
    return pw_emu_runtime->dynamic_shared();
}

// ---- Traps and device-side assert -------------------------------------------

[[noreturn]] inline void __trap() {
    pw_emu_runtime->trap("__trap()");
    __builtin_unreachable();
}

[[noreturn]] inline void pw_emu_assert_fail(const char* expr, const char* file, int line) {
    char what[512];
    snprintf(what, sizeof what, "%s:%d: assertion `%s' failed", file, line, expr);
    pw_emu_runtime->trap(what);
    __builtin_unreachable();
}

#undef assert
#define assert(e) ((e) ? (void)0 : pw_emu_assert_fail(#e, __FILE__, __LINE__))

// ---- Checks the compiler instruments -----------------------------------------
// The stand-in compiles with -fsanitize=alignment: before each load and store
// through a typed pointer (and each member access, reference binding) the
// compiler checks the address against the type's alignment and calls UBSan's
// handler when it is off. A GPU faults there (a 4-byte load needs a 4-byte
// aligned address: CUDA_ERROR_MISALIGNED_ADDRESS) where x86 would read the
// right bytes, so the handler, here instead of UBSan's runtime, ends the
// launch through the runtime naming the access. The structs are the handler
// ABI GCC and Clang share (ubsan_handlers.h: TypeMismatchData v1).
struct PwEmuUbsanLocation {
    const char* file;
    unsigned int line, column;
};
struct PwEmuUbsanType {
    unsigned short kind;  // 0 integer, 1 float, 0xffff anything else
    unsigned short info;  // integer: log2(bits) << 1 | signed; float: bits
    char name[1];
};
struct PwEmuUbsanMismatch {
    PwEmuUbsanLocation loc;
    const PwEmuUbsanType* type;
    unsigned char log_alignment;
    unsigned char check_kind;
};

// (Not inline: the compiler's calls do not count as uses that make an inline
// definition be emitted.)
extern "C" __attribute__((visibility("hidden"), noreturn, no_sanitize("alignment"))) void
__ubsan_handle_type_mismatch_v1_abort(void* data, void* ptr) {
    const PwEmuUbsanMismatch* d = static_cast<const PwEmuUbsanMismatch*>(data);
    // GCC describes the pointee as "any other type" (0xffff), Clang an
    // integer or float by its width: the size when the descriptor says it.
    unsigned long size = 0;
    if (d->type->kind == 0) size = (1ul << (d->type->info >> 1)) / 8;
    if (d->type->kind == 1) size = d->type->info / 8;
    pw_emu_runtime->misaligned(ptr, 1ul << d->log_alignment, size, d->type->name, d->check_kind, d->loc.file,
                               d->loc.line);
    __builtin_unreachable();
}

extern "C" __attribute__((visibility("hidden"), noreturn, no_sanitize("alignment"))) void
__ubsan_handle_type_mismatch_v1(void* data, void* ptr) {
    __ubsan_handle_type_mismatch_v1_abort(data, ptr);
}

// PW_EMU_INSTRUMENT (a PW_EMU_CHECK mode that watches memory: bounds,
// blocks): the stand-in also compiles with ThreadSanitizer's
// instrumentation, a call before every load and store (none for locals kept
// in registers), and links without TSan's runtime: these hooks take its
// place, and every access of a kernel reports itself to the runtime.
// (pw_emu_module_init's own store of the table runs before there is a table
// to call; the module constructor's __tsan_init has nothing to do.)
#ifdef PW_EMU_INSTRUMENT
#define PW_EMU_INSTRUMENTED 1u
#define PW_EMU_HOOK extern "C" __attribute__((visibility("hidden"), no_sanitize_thread)) void
#define PW_EMU_ACCESS(name, size, store)                                                 \
    PW_EMU_HOOK name(void* addr) {                                                       \
        if (pw_emu_runtime) pw_emu_runtime->access(addr, size, store);                  \
    }
PW_EMU_ACCESS(__tsan_read1, 1, 0)
PW_EMU_ACCESS(__tsan_read2, 2, 0)
PW_EMU_ACCESS(__tsan_read4, 4, 0)
PW_EMU_ACCESS(__tsan_read8, 8, 0)
PW_EMU_ACCESS(__tsan_read16, 16, 0)
PW_EMU_ACCESS(__tsan_write1, 1, 1)
PW_EMU_ACCESS(__tsan_write2, 2, 1)
PW_EMU_ACCESS(__tsan_write4, 4, 1)
PW_EMU_ACCESS(__tsan_write8, 8, 1)
PW_EMU_ACCESS(__tsan_write16, 16, 1)
PW_EMU_ACCESS(__tsan_unaligned_read2, 2, 0)
PW_EMU_ACCESS(__tsan_unaligned_read4, 4, 0)
PW_EMU_ACCESS(__tsan_unaligned_read8, 8, 0)
PW_EMU_ACCESS(__tsan_unaligned_read16, 16, 0)
PW_EMU_ACCESS(__tsan_unaligned_write2, 2, 1)
PW_EMU_ACCESS(__tsan_unaligned_write4, 4, 1)
PW_EMU_ACCESS(__tsan_unaligned_write8, 8, 1)
PW_EMU_ACCESS(__tsan_unaligned_write16, 16, 1)
#undef PW_EMU_ACCESS
PW_EMU_HOOK __tsan_read_range(void* addr, unsigned long size) {
    if (pw_emu_runtime) pw_emu_runtime->access(addr, size, 0);
}
PW_EMU_HOOK __tsan_write_range(void* addr, unsigned long size) {
    if (pw_emu_runtime) pw_emu_runtime->access(addr, size, 1);
}
PW_EMU_HOOK __tsan_init() {}
#undef PW_EMU_HOOK
#else
#define PW_EMU_INSTRUMENTED 0u
#endif

// ---- Bit casts --------------------------------------------------------------

inline float __uint_as_float(unsigned int x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}

inline unsigned int __float_as_uint(float x) {
    unsigned int u;
    memcpy(&u, &x, 4);
    return u;
}

inline float __int_as_float(int x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}

inline int __float_as_int(float x) {
    int i;
    memcpy(&i, &x, 4);
    return i;
}

inline double __longlong_as_double(long long x) {
    double d;
    memcpy(&d, &x, 8);
    return d;
}

inline long long __double_as_longlong(double x) {
    long long i;
    memcpy(&i, &x, 8);
    return i;
}

// ---- Arithmetic intrinsics: one IEEE round-to-nearest operation each ---------

inline float __fadd_rn(float a, float b) {
    return a + b;
}

inline float __fsub_rn(float a, float b) {
    return a - b;
}

inline float __fmul_rn(float a, float b) {
    return a * b;
}

inline float __fdiv_rn(float a, float b) {
    return a / b;
}

inline float __fmaf_rn(float a, float b, float c) {
    return fmaf(a, b, c);
}

inline float __fsqrt_rn(float a) {
    return sqrtf(a);
}

inline float __frcp_rn(float a) {
    return 1.0f / a;
}

inline double __dadd_rn(double a, double b) {
    return a + b;
}

inline double __dmul_rn(double a, double b) {
    return a * b;
}

inline double __fma_rn(double a, double b, double c) {
    return fma(a, b, c);
}

inline float __expf(float x) {
    return expf(x);
}

inline float __logf(float x) {
    return logf(x);
}

inline float rsqrtf(float x) {
    return 1.0f / sqrtf(x);
}

inline double rsqrt(double x) {
    return 1.0 / sqrt(x);
}

inline float __saturatef(float x) {
    return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f);
}

template <typename T>
inline T __ldg(const T* p) {
    return *p;
}

// ---- min / max: CUDA's overloads for the integer and floating types ---------

#define PW_EMU_MIN_MAX(T)                 \
    inline T min(T a, T b) {              \
        return a < b ? a : b;             \
    }                                     \
    inline T max(T a, T b) {              \
        return a > b ? a : b;             \
    }

PW_EMU_MIN_MAX(int)
PW_EMU_MIN_MAX(unsigned int)
PW_EMU_MIN_MAX(long)
PW_EMU_MIN_MAX(unsigned long)
PW_EMU_MIN_MAX(long long)
PW_EMU_MIN_MAX(unsigned long long)
#undef PW_EMU_MIN_MAX

// Floating min/max follow fminf/fmaxf (a NaN operand yields the other one).
inline float min(float a, float b) {
    return fminf(a, b);
}

inline float max(float a, float b) {
    return fmaxf(a, b);
}

inline double min(double a, double b) {
    return fmin(a, b);
}

inline double max(double a, double b) {
    return fmax(a, b);
}
