// The contract between the emulator (libpipewright_emu.so, Rust: src/abi.rs
// mirrors this file field for field) and a kernel module: the shared object
// the NVRTC stand-in builds from a .cu file with include/cuda_emu.h.
//
// A module exports one C function, pw_emu_module_init, which the driver's
// cuModuleLoadData calls once after loading the image. The module calls back
// into the emulator only through the EmuRuntime table it is handed there, so
// it links against nothing of ours and needs no symbol from the process.
//
// Lanes (CUDA threads) run as fibers; a block's fibers share one OS thread,
// so a module's thread_local storage is the block's shared memory
// (cuda_emu.h defines __shared__ as static thread_local), and each worker
// thread runs one block at a time.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define PW_EMU_ABI_VERSION 2u

#ifdef __cplusplus
extern "C" {
#endif

typedef struct PwEmuDim3 {
    unsigned int x, y, z;
} PwEmuDim3;

// The coordinates of the lane that is running now.
typedef struct PwEmuLane {
    PwEmuDim3 thread_idx;
    PwEmuDim3 block_idx;
    PwEmuDim3 block_dim;
    PwEmuDim3 grid_dim;
} PwEmuLane;

// shfl.sync's modes (PTX ISA, shfl.sync: .idx, .up, .down, .bfly).
enum PwEmuShflMode { PW_EMU_SHFL_IDX = 0, PW_EMU_SHFL_UP = 1, PW_EMU_SHFL_DOWN = 2, PW_EMU_SHFL_BFLY = 3 };

// vote.sync's modes.
enum PwEmuVoteMode { PW_EMU_VOTE_ALL = 0, PW_EMU_VOTE_ANY = 1, PW_EMU_VOTE_BALLOT = 2 };

typedef struct PwEmuRuntime {
    unsigned int abi_version;
    // The running lane's coordinates (valid until the kernel returns).
    const PwEmuLane* (*lane)(void);
    // __syncthreads(): bar.sync 0 over every thread of the block.
    void (*syncthreads)(void);
    // __syncwarp(mask).
    void (*syncwarp)(unsigned int mask);
    // shfl.sync.{mode}.b32 with PTX's c operand split into width (a power of
    // two, 1..32) as CUDA's __shfl_*_sync take it. Returns the value read.
    unsigned int (*shfl_sync)(unsigned int mask, unsigned int value, int lane_or_delta, int width, int mode);
    // vote.sync.{all,any,ballot}.
    unsigned int (*vote_sync)(unsigned int mask, int predicate, int mode);
    // mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, b, c for the
    // running lane's fragments (PTX ISA's layout): a warp-wide exchange.
    void (*mma_m16n8k16_f32_bf16)(float d[4], const unsigned int a[4], const unsigned int b[2], const float c[4]);
    // The block's dynamic shared memory (extern __shared__), or null when the
    // launch asked for none.
    void* (*dynamic_shared)(void);
    // __trap() and a failed device-side assert: ends the launch with an error
    // naming the lane; never returns.
    void (*trap)(const char* what);
    // A load or store the compiler's alignment check (-fsanitize=alignment)
    // found misaligned for its type: ends the launch with
    // CUDA_ERROR_MISALIGNED_ADDRESS naming the lane, the address, the access
    // (its size, 0 when the type does not say, and its type) and the source
    // line; never returns. `kind` is UBSan's type-check kind (0 load, 1 store, ...).
    void (*misaligned)(const void* addr, unsigned long align, unsigned long size, const char* type, int kind,
                       const char* file, unsigned int line);
    // An instrumented load (is_store 0) or store (1) of `size` bytes at
    // `addr`, in a module built with PW_EMU_INSTRUMENT (a PW_EMU_CHECK mode
    // that watches every access: bounds, blocks, warp).
    void (*access)(const void* addr, unsigned long size, int is_store);
} PwEmuRuntime;

// One kernel parameter, from the kernel's declaration.
typedef struct PwEmuParam {
    const char* name;       // as declared
    const char* type;       // as declared, e.g. "const floatX*"
    size_t size;            // sizeof the parameter's type
    size_t align;           // alignof
    int is_pointer;         // a pointer: checked against live device allocations at launch
    int pointee_is_const;   // const T*: the kernel only reads through it
} PwEmuParam;

typedef struct PwEmuKernel {
    const char* name;                 // the extern "C" name cuModuleGetFunction looks up
    void (*entry)(void** args);       // runs the kernel body for the running lane; args as cuLaunchKernel's kernelParams
    unsigned int launch_bounds;       // __launch_bounds__'s max threads per block, 0 when not declared
    unsigned int num_params;
    const PwEmuParam* params;
} PwEmuKernel;

typedef struct PwEmuModuleInfo {
    unsigned int abi_version;
    const char* source_name;          // the program name given to nvrtcCreateProgram, e.g. "layernorm.cu"
    const char* arch;                 // e.g. "sm_90"
    unsigned int num_kernels;
    const PwEmuKernel* kernels;
    // Touches the module's thread_local storage on the calling thread (so
    // the loader has allocated this thread's block of it) and returns its
    // anchor's address; the driver then finds the block and its size through
    // __tls_get_addr (offset 0 of the module's TLS id) to poison the block's shared memory at each block start.
    void* (*touch_shared)(void);
    // 1 when every load and store of the module's kernels calls the
    // runtime's `access` (built with PW_EMU_INSTRUMENT), else 0.
    unsigned int instrumented;
} PwEmuModuleInfo;

// The one symbol a module exports.
typedef const PwEmuModuleInfo* (*PwEmuModuleInitFn)(const PwEmuRuntime* rt);
#define PW_EMU_MODULE_INIT "pw_emu_module_init"

#ifdef __cplusplus
}
#endif
