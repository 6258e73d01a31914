//! pipewright-emu: a strict emulated CUDA device on the CPU.
//!
//! Test equipment and a user feature ("dry-run a GPU layout on a laptop"):
//! stand-ins for the four libraries pipewright's CUDA backend loads, exported
//! from one shared object that `scripts/emulated-gpu.sh` puts first on the
//! library path under each library's names. Nothing here is loaded by a
//! normal run.
//!
//! - `driver`: libcuda's entry points (contexts, streams, events, memory,
//!   modules, launches), over `context`, `memory`, `stream` and `exec`.
//! - `nvrtc`: NVRTC's entry points; "compiling" builds `kernels/*.cu` with the
//!   system C++ compiler against `include/cuda_emu.h` into a shared object,
//!   whose bytes are the image `cuModuleLoadData` takes (`module`).
//! - `cublaslt`: cuBLASLt's descriptors and matmul, computed on the CPU.
//! - `nccl`: NCCL's communicators and collectives, between threads of one
//!   process and between processes (shared memory named by the unique id).
//!
//! Strict by design: what the real stack would only sometimes punish is an
//! error naming the culprit, and anything not implemented is refused with an
//! error code, never a silent success. It proves semantics, not speed.
//!
//! Settings (environment): PW_EMU_GPUS, PW_EMU_SESSION, CUDA_VISIBLE_DEVICES,
//! PW_EMU_CHECK=order,race,bounds,blocks,warp, PW_EMU_THREADS, PW_EMU_MEM_GIB,
//! PW_EMU_NCCL_TIMEOUT_S, PW_EMU_CXX, PW_EMU_CACHE; docs/emulated-gpu.md says
//! what each does, what the emulator verifies and what only hardware can.

pub mod abi;
pub mod context;
pub mod cublaslt;
pub mod driver;
pub mod error;
pub mod exec;
pub mod memory;
pub mod module;
pub mod nccl;
pub mod nvrtc;
pub mod stream;
