//! The driver's entry points behave as NVIDIA's Driver API documents them
//! (devices, contexts, memory, streams and events, module images), and
//! refuse what the emulator does not do with a named error.

mod exec_support;

use exec_support::*;
use pipewright_emu::driver::*;
use pipewright_emu::error::cu;
use pipewright_emu::memory;
use std::ffi::{c_void, CStr};

#[test]
fn two_emulated_gpus_report_sm_90_and_their_names() {
    let _s = serial();
    init();
    // SAFETY: valid out-pointers and buffers throughout.
    unsafe {
        let mut n = 0;
        assert_eq!(cuDeviceGetCount(&mut n), cu::SUCCESS);
        assert_eq!(n, 2);
        let mut v = 0;
        assert_eq!(cuDriverGetVersion(&mut v), cu::SUCCESS);
        assert_eq!(v, 13000);
        let mut name = [0 as std::ffi::c_char; 64];
        assert_eq!(cuDeviceGetName(name.as_mut_ptr(), 64, 1), cu::SUCCESS);
        assert_eq!(CStr::from_ptr(name.as_ptr()).to_str().unwrap(), "pipewright emulated GPU 1 (sm_90)");
        for (attr, want) in [(75, 9), (76, 0), (10, 32), (1, 1024), (8, 48 << 10), (97, 227 << 10), (115, 0)]
        {
            let mut got = -1;
            assert_eq!(cuDeviceGetAttribute(&mut got, attr, 0), cu::SUCCESS, "attribute {attr}");
            assert_eq!(got, want, "attribute {attr}");
        }
        let mut got = 0;
        assert_error(cuDeviceGetAttribute(&mut got, 9999, 0), cu::INVALID_VALUE, &["attribute 9999"]);
        let mut dev = 0;
        assert_error(cuDeviceGet(&mut dev, 2), cu::INVALID_DEVICE, &["device 2 does not exist", "2 visible"]);
        let mut total = 0usize;
        assert_eq!(cuDeviceTotalMem_v2(&mut total, 0), cu::SUCCESS);
        assert_eq!(total, 80 << 30);
    }
}

#[test]
fn device_identity_names_the_session_and_the_emulated_ordinal() {
    init();
    let (session, ordinal) = memory::device_identity(1);
    assert_eq!(ordinal, 1);
    assert!(!session.is_empty());
}

#[test]
fn calls_that_need_a_context_name_themselves_when_none_is_bound() {
    let _s = serial();
    init();
    let code = std::thread::spawn(|| {
        let mut p = 0u64;
        // SAFETY: a valid out-pointer.
        unsafe { cuMemAlloc_v2(&mut p, 64) }
    })
    .join()
    .unwrap();
    assert_error(code, cu::INVALID_CONTEXT, &["cuMemAlloc", "no context is bound"]);
}

#[test]
fn allocations_are_256_byte_aligned_end_at_a_guard_page_and_live_on_their_gpu() {
    let _s = serial();
    let (g0, g1) = (Gpu::new(0), Gpu::new(1));
    let a = g0.alloc(1000);
    let b = g1.alloc(4096);
    assert_eq!(a % 256, 0);
    assert_eq!((a + 1024) % 4096, 0, "the aligned end of the allocation is the guard page");
    assert_eq!(memory::find(a + 999).map(|x| (x.base, x.device)), Some((a, 0)));
    assert_eq!(memory::find(a + 1000), None);
    assert_eq!(memory::find(b).map(|x| x.device), Some(1));
    assert_eq!(memory::device_of_address(b), Some(1));
    let e = memory::check_range(a, 1001, 0, "test: A").unwrap_err();
    assert!(e.message.contains("test: A") && e.message.contains("1 byte(s) past the end"), "{}", e.message);
    let e = memory::check_range(b, 16, 0, "test: B").unwrap_err();
    assert!(e.message.contains("GPU 1's memory, used on GPU 0"), "{}", e.message);
}

#[test]
fn allocations_past_the_devices_memory_are_out_of_memory() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut p = 0u64;
    gpu.bind();
    // SAFETY: a valid out-pointer.
    let code = unsafe { cuMemAlloc_v2(&mut p, 81 << 30) };
    assert_error(code, cu::OUT_OF_MEMORY, &["cuMemAlloc", "GPU 0", "PW_EMU_MEM_GIB=80"]);
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { cuMemGetInfo_v2(&mut free, &mut total) }, cu::SUCCESS);
    assert_eq!(total, 80 << 30);
    assert!(free < total);
}

#[test]
fn freeing_twice_names_the_freed_allocation() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let a = gpu.alloc(512);
    // SAFETY: our own allocation.
    unsafe {
        assert_eq!(cuMemFree_v2(a), cu::SUCCESS);
        assert_error(cuMemFree_v2(a), cu::INVALID_VALUE, &["cuMemFree", "freed 512-byte allocation"]);
    }
}

#[test]
fn copies_and_memsets_round_trip_through_the_stream() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let (a, b) = (gpu.alloc(64 * 4), gpu.alloc(64 * 4));
    let host: Vec<u32> = (0..64).collect();
    gpu.upload(a, &host);
    // SAFETY: live ranges of the sizes given.
    unsafe {
        assert_eq!(cuMemcpyDtoDAsync_v2(b, a, 64 * 4, gpu.stream), cu::SUCCESS);
        assert_eq!(cuMemsetD32Async(b, 7, 8, gpu.stream), cu::SUCCESS);
        assert_eq!(cuMemsetD8Async(b + 60 * 4, 0xFF, 16, gpu.stream), cu::SUCCESS);
    }
    let back: Vec<u32> = gpu.download(b, 64);
    let want: Vec<u32> = (0..64)
        .map(|i| {
            if i < 8 {
                7
            } else if i >= 60 {
                u32::MAX
            } else {
                i
            }
        })
        .collect();
    assert_eq!(back, want);
    // A copy that runs past an allocation is refused at the call.
    // SAFETY: the driver checks the range before touching it.
    let code = unsafe { cuMemcpyDtoDAsync_v2(b, a, 65 * 4, gpu.stream) };
    assert_error(code, cu::INVALID_VALUE, &["cuMemcpyDtoDAsync", "past the end"]);
}

#[test]
fn peer_copies_move_bytes_between_gpus() {
    let _s = serial();
    let (g1, g0) = (Gpu::new(1), Gpu::new(0));
    let src = g1.alloc(256);
    g1.upload(src, &[5u8; 256]);
    assert_eq!(g1.sync(), cu::SUCCESS);
    let dst = g0.alloc(256);
    g0.bind();
    // SAFETY: live ranges in their contexts.
    let code = unsafe { cuMemcpyPeerAsync(dst, g0.ctx, src, g1.ctx, 256, g0.stream) };
    assert_eq!(code, cu::SUCCESS);
    assert_eq!(g0.download::<u8>(dst, 256), vec![5u8; 256]);
    // The source named with the wrong context is refused.
    // SAFETY: as above.
    let code = unsafe { cuMemcpyPeerAsync(dst, g0.ctx, src, g0.ctx, 256, g0.stream) };
    assert_error(code, cu::INVALID_VALUE, &["cuMemcpyPeerAsync: source", "GPU 1's memory, used on GPU 0"]);
}

extern "C" fn slow_write_k(args: *mut *mut c_void) {
    let (out, v): (*mut u32, u32) = unsafe { (arg(args, 0), arg(args, 1)) };
    if tid() == 0 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    unsafe { std::ptr::write_volatile(out.add(tid()), v) };
}

extern "C" fn copy_k(args: *mut *mut c_void) {
    let (out, inp): (*mut u32, *const u32) = unsafe { (arg(args, 0), arg(args, 1)) };
    unsafe { *out.add(tid()) = std::ptr::read_volatile(inp.add(tid())) };
}

/// Stream B reads what stream A wrote. With an event recorded on A and
/// waited on by B it reads the new values. Without the wait the streams run
/// side by side and B may read the old ones; by default only the result
/// shows it, PW_EMU_CHECK=race names it (tests/exec_race.rs).
#[test]
fn a_stream_waiting_on_an_event_sees_what_the_other_stream_wrote() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut b_stream: Handle = std::ptr::null_mut();
    let mut event: Handle = std::ptr::null_mut();
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(cuStreamCreate(&mut b_stream, 1), cu::SUCCESS);
        assert_eq!(cuEventCreate(&mut event, 0), cu::SUCCESS);
    }
    let (data, copy) = (gpu.alloc(32 * 4), gpu.alloc(32 * 4));
    // SAFETY: a live range.
    assert_eq!(unsafe { cuMemsetD32Async(data, 1, 32, gpu.stream) }, cu::SUCCESS);
    let writer = function(
        "w.cu",
        kernel("slow_write", slow_write_k, 0, &[("out", "unsigned*", true), ("v", "unsigned", false)]),
    );
    let reader = function(
        "r.cu",
        kernel("copy", copy_k, 0, &[("out", "unsigned*", true), ("inp", "const unsigned*", true)]),
    );
    let (mut d, mut v, mut c) = (data, 2u32, copy);
    assert_eq!(
        launch(writer, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut d), p(&mut v)]),
        cu::SUCCESS
    );
    // SAFETY: live handles.
    unsafe {
        assert_eq!(cuEventRecord(event, gpu.stream), cu::SUCCESS);
        assert_eq!(cuStreamWaitEvent(b_stream, event, 0), cu::SUCCESS);
    }
    assert_eq!(launch(reader, (1, 1, 1), (32, 1, 1), 0, b_stream, &mut [p(&mut c), p(&mut d)]), cu::SUCCESS);
    // SAFETY: live handles.
    unsafe {
        assert_eq!(cuStreamSynchronize(b_stream), cu::SUCCESS);
        assert_eq!(cuEventQuery(event), cu::SUCCESS);
    }
    assert_eq!(gpu.download::<u32>(copy, 32), vec![2u32; 32]);
}

#[test]
fn events_time_the_work_between_them_and_report_not_ready_before_it_runs() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let (mut start, mut end): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
    let buf = gpu.alloc(32 * 4);
    let writer = function(
        "w2.cu",
        kernel("slow_write", slow_write_k, 0, &[("out", "unsigned*", true), ("v", "unsigned", false)]),
    );
    let (mut d, mut v) = (buf, 3u32);
    // SAFETY: valid out-pointers and live handles.
    unsafe {
        assert_eq!(cuEventCreate(&mut start, 0), cu::SUCCESS);
        assert_eq!(cuEventCreate(&mut end, 0), cu::SUCCESS);
        assert_eq!(cuEventRecord(start, gpu.stream), cu::SUCCESS);
        assert_eq!(
            launch(writer, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut d), p(&mut v)]),
            cu::SUCCESS
        );
        assert_eq!(cuEventRecord(end, gpu.stream), cu::SUCCESS);
        assert_eq!(cuEventQuery(end), cu::NOT_READY);
        assert_eq!(cuEventSynchronize(end), cu::SUCCESS);
        let mut ms = 0f32;
        assert_eq!(cuEventElapsedTime_v2(&mut ms, start, end), cu::SUCCESS);
        assert!(ms >= 40.0, "{ms} ms for a 50 ms kernel");
        assert_eq!(cuStreamQuery(gpu.stream), cu::SUCCESS);
        assert_eq!(cuEventDestroy_v2(start), cu::SUCCESS);
        assert_error(
            cuEventRecord(start, gpu.stream),
            cu::INVALID_HANDLE,
            &["cuEventRecord", "not a live event"],
        );
    }
}

#[test]
fn the_legacy_default_stream_waits_for_blocking_streams() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut blocking: Handle = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuStreamCreate(&mut blocking, 0) }, cu::SUCCESS);
    let (data, copy) = (gpu.alloc(32 * 4), gpu.alloc(32 * 4));
    let writer = function(
        "w3.cu",
        kernel("slow_write", slow_write_k, 0, &[("out", "unsigned*", true), ("v", "unsigned", false)]),
    );
    let reader = function(
        "r3.cu",
        kernel("copy", copy_k, 0, &[("out", "unsigned*", true), ("inp", "const unsigned*", true)]),
    );
    let (mut d, mut v, mut c) = (data, 9u32, copy);
    assert_eq!(launch(writer, (1, 1, 1), (32, 1, 1), 0, blocking, &mut [p(&mut d), p(&mut v)]), cu::SUCCESS);
    // Stream 0: the legacy default stream, ordered after the blocking stream's work.
    assert_eq!(
        launch(reader, (1, 1, 1), (32, 1, 1), 0, std::ptr::null_mut(), &mut [p(&mut c), p(&mut d)]),
        cu::SUCCESS
    );
    // SAFETY: the legacy stream of the bound context.
    assert_eq!(unsafe { cuStreamSynchronize(std::ptr::null_mut()) }, cu::SUCCESS);
    assert_eq!(gpu.download::<u32>(copy, 32), vec![9u32; 32]);
}

#[test]
fn module_images_other_than_an_x86_64_shared_object_are_refused_saying_what_they_are() {
    let _s = serial();
    let _gpu = Gpu::new(0);
    let mut m: Handle = std::ptr::null_mut();
    let ptx = c"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.5\n.target sm_90\n";
    // SAFETY: NUL-terminated images, as cuModuleLoadData reads text.
    unsafe {
        assert_error(
            cuModuleLoadData(&mut m, ptx.as_ptr() as *const c_void),
            cu::INVALID_IMAGE,
            &["PTX text"],
        );
        let mut cubin = [0u8; 64];
        cubin[..4].copy_from_slice(b"\x7fELF");
        cubin[4] = 2;
        cubin[5] = 1;
        cubin[16] = 2;
        cubin[18] = 190;
        assert_error(
            cuModuleLoadData(&mut m, cubin.as_ptr() as *const c_void),
            cu::NO_BINARY_FOR_GPU,
            &["real CUBIN", "EM_CUDA"],
        );
    }
}

#[test]
fn error_names_and_strings_follow_cuda_h() {
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: valid out-pointers; the strings live for the process.
    unsafe {
        assert_eq!(cuGetErrorName(700, &mut s), cu::SUCCESS);
        assert_eq!(CStr::from_ptr(s).to_str().unwrap(), "CUDA_ERROR_ILLEGAL_ADDRESS");
        assert_eq!(cuGetErrorString(12345, &mut s), cu::INVALID_VALUE);
    }
}

#[test]
fn unsupported_entry_points_refuse_instead_of_pretending() {
    let _s = serial();
    let mut p = 0u64;
    // SAFETY: the call refuses before touching anything.
    let code = unsafe { cuMemAllocAsync(&mut p, 64, std::ptr::null_mut()) };
    assert_error(code, cu::NOT_SUPPORTED, &["cuMemAllocAsync", "memory pools"]);
}

#[test]
fn a_destroyed_stream_finishes_its_queued_work_and_its_handle_is_then_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let buf = gpu.alloc(32 * 4);
    let writer = function(
        "w4.cu",
        kernel("slow_write", slow_write_k, 0, &[("out", "unsigned*", true), ("v", "unsigned", false)]),
    );
    let mut s: Handle = std::ptr::null_mut();
    let (mut d, mut v) = (buf, 4u32);
    // SAFETY: valid out-pointers and live handles.
    unsafe {
        assert_eq!(cuStreamCreate(&mut s, 1), cu::SUCCESS);
        assert_eq!(launch(writer, (1, 1, 1), (32, 1, 1), 0, s, &mut [p(&mut d), p(&mut v)]), cu::SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s), cu::SUCCESS);
        assert_error(
            cuStreamSynchronize(s),
            cu::INVALID_HANDLE,
            &["cuStreamSynchronize", "not a live stream"],
        );
        assert_eq!(cuCtxSynchronize(), cu::SUCCESS);
    }
    assert_eq!(gpu.download::<u32>(buf, 32), vec![4u32; 32]);
}

#[test]
fn a_destroyed_context_is_unbound_and_its_handle_refused() {
    let _s = serial();
    let gpu = Gpu::new(1);
    // SAFETY: our own context, then calls that must refuse it.
    unsafe {
        assert_eq!(cuCtxDestroy_v2(gpu.ctx), cu::SUCCESS);
        let mut cur: Handle = std::ptr::null_mut();
        assert_eq!(cuCtxGetCurrent(&mut cur), cu::SUCCESS);
        assert_ne!(cur, gpu.ctx);
        assert_error(
            cuCtxSetCurrent(gpu.ctx),
            cu::INVALID_CONTEXT,
            &["cuCtxSetCurrent", "not a context handle"],
        );
    }
}

extern "C" fn trap_k(_args: *mut *mut c_void) {
    (exec_support::rt().trap)(c"planted".as_ptr());
}

#[test]
fn a_failed_context_can_be_destroyed_and_a_new_one_works() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("trap.cu", kernel("trap", trap_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (1, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::LAUNCH_FAILED);
    // SAFETY: our own context.
    assert_eq!(unsafe { cuCtxDestroy_v2(gpu.ctx) }, cu::SUCCESS);
    let fresh = Gpu::new(0);
    let buf = fresh.alloc(16);
    fresh.upload(buf, &[1u32, 2, 3, 4]);
    assert_eq!(fresh.download::<u32>(buf, 4), vec![1, 2, 3, 4]);
}

extern "C" fn one_k(args: *mut *mut c_void) {
    let out: *mut u32 = unsafe { arg(args, 0) };
    unsafe { *out = 1 };
}

#[test]
fn a_function_launches_only_in_the_context_that_loaded_its_module_and_only_while_loaded() {
    let _s = serial();
    let (a, b) = (Gpu::new(0), Gpu::new(0));
    a.bind();
    let out_a = a.alloc(4);
    let m = pipewright_emu::module::from_kernels(
        "one.cu",
        vec![kernel("one", one_k, 0, &[("out", "unsigned*", true)])],
    );
    let mut f: Handle = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name; then launches with
    // the kernel's one argument and module calls the driver must refuse.
    unsafe {
        assert_eq!(cuModuleGetFunction(&mut f, m as Handle, c"one".as_ptr()), cu::SUCCESS);
        // Another context on the same GPU: its memory, its stream, a function of a's module.
        b.bind();
        let mut o = b.alloc(4);
        let code = launch(f, (1, 1, 1), (1, 1, 1), 0, b.stream, &mut [p(&mut o)]);
        let (ca, cb) = (format!("context {:#x}", a.ctx as usize), format!("context {:#x}", b.ctx as usize));
        assert_error(
            code,
            cu::INVALID_HANDLE,
            &["cuLaunchKernel", "kernel `one` (one.cu)", "loaded in", &ca, &cb],
        );
        // In its own context it runs.
        a.bind();
        let mut o = out_a;
        assert_eq!(launch(f, (1, 1, 1), (1, 1, 1), 0, a.stream, &mut [p(&mut o)]), cu::SUCCESS);
        assert_eq!(a.download::<u32>(out_a, 1), vec![1]);
        // Unloaded, neither the module nor its function is a handle any more.
        assert_eq!(cuModuleUnload(m as Handle), cu::SUCCESS);
        let code = launch(f, (1, 1, 1), (1, 1, 1), 0, a.stream, &mut [p(&mut o)]);
        assert_error(
            code,
            cu::INVALID_HANDLE,
            &["cuLaunchKernel", "kernel `one` (one.cu)", "unloaded by cuModuleUnload"],
        );
        let mut g: Handle = std::ptr::null_mut();
        let code = cuModuleGetFunction(&mut g, m as Handle, c"one".as_ptr());
        assert_error(
            code,
            cu::INVALID_HANDLE,
            &["cuModuleGetFunction(one)", "(one.cu) was unloaded by cuModuleUnload"],
        );

        // A destroyed context takes its modules with it.
        let c = Gpu::new(1);
        let m = pipewright_emu::module::from_kernels(
            "one.cu",
            vec![kernel("one", one_k, 0, &[("out", "unsigned*", true)])],
        );
        assert_eq!(cuModuleGetFunction(&mut f, m as Handle, c"one".as_ptr()), cu::SUCCESS);
        assert_eq!(cuCtxDestroy_v2(c.ctx), cu::SUCCESS);
        a.bind();
        let code = launch(f, (1, 1, 1), (1, 1, 1), 0, a.stream, &mut [p(&mut o)]);
        let cc = format!("its context {:#x} (GPU 1), destroyed by cuCtxDestroy", c.ctx as usize);
        assert_error(code, cu::INVALID_HANDLE, &["kernel `one` (one.cu)", &cc]);
        let code = cuModuleGetFunction(&mut g, m as Handle, c"one".as_ptr());
        assert_error(code, cu::INVALID_HANDLE, &["cuModuleGetFunction(one)", &cc]);
    }
}
