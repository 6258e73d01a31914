//! A module image as the NVRTC stand-in makes it (an x86-64 shared object
//! exporting pw_emu_module_init, built here with the system C compiler from
//! a small C file) loads through cuModuleLoadData and runs; its thread_local
//! block is the block's static shared memory, poisoned at every block start.

mod exec_support;

use exec_support::*;
use pipewright_emu::driver::{cuModuleGetFunction, cuModuleLoadData};
use pipewright_emu::error::cu;
use std::ffi::{c_void, CString};
use std::path::Path;
use std::process::Command;

const TILE_CU: &str = r#"
#include "pw_emu_abi.h"
static const PwEmuRuntime* rt;
// __shared__ float tile[64], as cuda_emu.h declares shared memory.
static __thread float tile[64];
static void* touch_shared(void) { return &tile[0]; }

static void rotate(void** args) {
    float* out = *(float**)args[0];
    const PwEmuLane* l = rt->lane();
    unsigned t = l->thread_idx.x, n = l->block_dim.x;
    tile[t] = (float)(t + 100 * l->block_idx.x);
    rt->syncthreads();
    out[l->block_idx.x * n + t] = tile[(t + 1) % n];
}

static void unwritten(void** args) {
    unsigned* out = *(unsigned**)args[0];
    const PwEmuLane* l = rt->lane();
    out[l->thread_idx.x] = *(unsigned*)&tile[l->thread_idx.x];
}

static const PwEmuParam out_f[] = {{"out", "float*", 8, 8, 1, 0}};
static const PwEmuParam out_u[] = {{"out", "unsigned*", 8, 8, 1, 0}};
static const PwEmuKernel kernels[] = {
    {"rotate", rotate, 64, 1, out_f},
    {"unwritten", unwritten, 0, 1, out_u},
};
static const PwEmuModuleInfo info = {PW_EMU_ABI_VERSION, "tile.cu", "sm_90", 2, kernels, touch_shared};
const PwEmuModuleInfo* pw_emu_module_init(const PwEmuRuntime* r) { rt = r; return &info; }
"#;

/// Builds `source` into a shared object and returns its bytes.
fn build(source: &str, dir: &Path) -> Vec<u8> {
    let (c, so) = (dir.join("m.c"), dir.join("m.so"));
    std::fs::write(&c, source).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&so)
        .arg(&c)
        .arg("-I")
        .arg(&include)
        .status()
        .expect("the system C compiler (cc) builds the test module");
    assert!(status.success(), "cc failed on the test module");
    std::fs::read(so).unwrap()
}

/// cuModuleLoadData's result code and module for a built image.
fn try_load(image: &[u8]) -> (u32, Handle) {
    let mut m: Handle = std::ptr::null_mut();
    // SAFETY: a complete image, as `build` returns it.
    let code = unsafe { cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) };
    (code, m)
}

fn load(image: &[u8]) -> Handle {
    let (code, m) = try_load(image);
    assert_eq!(code, cu::SUCCESS, "{}", error_text(code));
    m
}

fn get(m: Handle, name: &str) -> Handle {
    let name = CString::new(name).unwrap();
    let mut f: Handle = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, name.as_ptr()) }, cu::SUCCESS);
    f
}

#[test]
fn a_shared_object_module_runs_with_its_thread_locals_as_poisoned_shared_memory() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let dir = tempfile::tempdir().unwrap();
    let image = build(TILE_CU, dir.path());
    let m = load(&image);
    let (rotate, unwritten) = (get(m, "rotate"), get(m, "unwritten"));

    let out = gpu.alloc(4 * 64 * 4);
    let mut o = out;
    assert_eq!(launch(rotate, (4, 1, 1), (64, 1, 1), 0, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS, "{}", error_text(cu::LAUNCH_FAILED));
    let host: Vec<f32> = gpu.download(out, 4 * 64);
    for b in 0..4 {
        for t in 0..64 {
            assert_eq!(host[b * 64 + t], ((t + 1) % 64 + 100 * b) as f32, "block {b} thread {t}");
        }
    }
    // The launch bounds the module declares are enforced.
    let code = launch(rotate, (1, 1, 1), (128, 1, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(code, cu::INVALID_VALUE, &["kernel `rotate` (tile.cu)", "__launch_bounds__ of 64"]);

    // The tile the previous blocks wrote is poison again for a new block.
    let flags = gpu.alloc(64 * 4);
    let mut fl = flags;
    assert_eq!(launch(unwritten, (1, 1, 1), (64, 1, 1), 0, gpu.stream, &mut [p(&mut fl)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    let bits: Vec<u32> = gpu.download(flags, 64);
    assert!(bits.iter().all(|&b| b == u32::MAX), "{bits:x?}");
}

#[test]
fn a_shared_object_without_the_module_entry_point_is_refused() {
    let _s = serial();
    let _gpu = Gpu::new(0);
    let dir = tempfile::tempdir().unwrap();
    let image = build("int not_a_module(void) { return 1; }\n", dir.path());
    let (code, _) = try_load(&image);
    assert_error(code, cu::INVALID_IMAGE, &["cuModuleLoadData", "pw_emu_module_init"]);
}

#[test]
fn blocks_find_their_shared_memory_while_another_thread_loads_and_unloads_modules() {
    // Each load and unload of a module with thread_locals changes the
    // loader's TLS generation; the driver must still find every worker
    // thread's block of a module (CI once saw the old lookup through
    // dl_iterate_phdr come back empty while two pipeline stages loaded
    // their kernels at once).
    let _s = serial();
    let gpu = Gpu::new(0);
    let dir = tempfile::tempdir().unwrap();
    let image = build(TILE_CU, dir.path());
    let m = load(&image);
    let unwritten = get(m, "unwritten");
    let flags = gpu.alloc(64 * 4);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loader = {
        let (stop, image, ctx) = (stop.clone(), image.clone(), gpu.ctx as usize);
        std::thread::spawn(move || {
            // SAFETY: the test's live context (it outlives this thread, joined below).
            assert_eq!(unsafe { pipewright_emu::driver::cuCtxSetCurrent(ctx as Handle) }, cu::SUCCESS);
            let mut loads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || loads < 20 {
                let other = load(&image);
                // SAFETY: the module just loaded, unloaded once.
                assert_eq!(unsafe { pipewright_emu::driver::cuModuleUnload(other) }, cu::SUCCESS);
                loads += 1;
            }
            loads
        })
    };
    for round in 0..60 {
        let mut fl = flags;
        assert_eq!(launch(unwritten, (8, 1, 1), (64, 1, 1), 0, gpu.stream, &mut [p(&mut fl)]), cu::SUCCESS);
        let code = gpu.sync();
        assert_eq!(code, cu::SUCCESS, "round {round}: {}", error_text(code));
        let bits: Vec<u32> = gpu.download(flags, 64);
        assert!(bits.iter().all(|&b| b == u32::MAX), "round {round}: {bits:x?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(loader.join().unwrap() >= 20);
}

#[test]
fn a_module_without_thread_locals_is_refused_at_load() {
    // Its shared-memory anchor is an ordinary static: the driver could not
    // give each block its own static shared memory.
    let _s = serial();
    let _gpu = Gpu::new(0);
    let dir = tempfile::tempdir().unwrap();
    let source = TILE_CU.replace("static __thread float tile[64];", "static float tile[64];");
    let image = build(&source, dir.path());
    let (code, _) = try_load(&image);
    assert_error(code, cu::INVALID_IMAGE, &["cuModuleLoadData", "no thread_local segment (PT_TLS)"]);
}
