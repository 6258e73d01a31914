//! cuLaunchKernel refuses a bad launch at the call, naming the kernel and
//! the bad value, before anything runs.

mod exec_support;

use exec_support::*;
use pipewright_emu::driver::{cuFuncGetAttribute, cuFuncSetAttribute, cuMemFree_v2, cuModuleGetFunction};
use pipewright_emu::error::cu;
use std::ffi::c_void;

extern "C" fn fill_k(args: *mut *mut c_void) {
    let out: *mut f32 = unsafe { arg(args, 0) };
    unsafe { *out.add(gid()) = 1.0 };
}

const OUT: P = ("out", "float*", true);

fn fill(bounds: u32) -> Handle {
    function("fill.cu", kernel("fill", fill_k, bounds, &[OUT]))
}

#[test]
fn a_zero_grid_dimension_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut o = gpu.alloc(1024);
    let code = launch(fill(0), (4, 0, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(
        code,
        cu::INVALID_VALUE,
        &["kernel `fill` (fill.cu)", "grid dimension (4, 0, 1) has a zero"],
    );
}

#[test]
fn a_block_of_more_than_1024_threads_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut o = gpu.alloc(1 << 16);
    let code = launch(fill(0), (1, 1, 1), (32, 33, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "1056 threads", "1024"]);
}

#[test]
fn a_block_past_the_kernels_launch_bounds_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut o = gpu.alloc(1 << 16);
    let code = launch(fill(128), (1, 1, 1), (256, 1, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "256 threads", "__launch_bounds__ of 128"]);
}

#[test]
fn a_grid_past_the_devices_maximum_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut o = gpu.alloc(1024);
    let code = launch(fill(0), (1, 65536, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "max grid y of 65535"]);
}

#[test]
fn dynamic_shared_memory_past_48_kib_needs_the_attribute_raised() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut o = gpu.alloc(1024);
    let f = fill(0);
    let code = launch(f, (1, 1, 1), (32, 1, 1), 64 << 10, gpu.stream, &mut [p(&mut o)]);
    assert_error(
        code,
        cu::INVALID_VALUE,
        &["`fill`", "65536 bytes of dynamic shared memory", "allows 49152"],
    );
    // SAFETY: a live function handle.
    unsafe {
        assert_error(cuFuncSetAttribute(f, 8, 300 << 10), cu::INVALID_VALUE, &["opt-in maximum of 232448"]);
        assert_eq!(cuFuncSetAttribute(f, 8, 64 << 10), cu::SUCCESS);
        let mut v = 0;
        assert_eq!(cuFuncGetAttribute(&mut v, 8, f), cu::SUCCESS);
        assert_eq!(v, 64 << 10);
    }
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 64 << 10, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
}

#[test]
fn a_host_pointer_argument_is_refused_by_name() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let host = [0f32; 32];
    let mut o = host.as_ptr() as u64;
    let code = launch(fill(0), (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "argument `out` (float*)", "a host address"]);
}

#[test]
fn another_gpus_pointer_is_refused_naming_that_gpu() {
    let _s = serial();
    let other = Gpu::new(1);
    let remote = other.alloc(1024);
    let gpu = Gpu::new(0);
    let mut o = remote;
    let code = launch(fill(0), (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "argument `out`", "GPU 1's memory, launched on GPU 0"]);
}

#[test]
fn a_freed_pointer_argument_is_refused_as_freed() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let buf = gpu.alloc(1024);
    // SAFETY: our own live allocation.
    assert_eq!(unsafe { cuMemFree_v2(buf) }, cu::SUCCESS);
    let mut o = buf;
    let code = launch(fill(0), (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]);
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "argument `out`", "in the freed 1024-byte allocation"]);
}

#[test]
fn a_launch_with_no_context_bound_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let buf = gpu.alloc(1024);
    let f = fill(0) as usize;
    let code = std::thread::spawn(move || {
        let mut o = buf;
        launch(f as Handle, (1, 1, 1), (32, 1, 1), 0, std::ptr::null_mut(), &mut [p(&mut o)])
    })
    .join()
    .unwrap();
    assert_error(code, cu::INVALID_CONTEXT, &["cuLaunchKernel", "no context is bound to this thread"]);
}

#[test]
fn null_kernel_params_for_a_kernel_with_parameters_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let code = launch(fill(0), (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []);
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "kernelParams is null", "1 parameters"]);
}

#[test]
fn the_extra_argument_list_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let mut o = gpu.alloc(1024);
    let mut args = [p(&mut o)];
    let mut extra = [std::ptr::null_mut::<c_void>()];
    // SAFETY: valid handles and arrays.
    let code = unsafe {
        pipewright_emu::driver::cuLaunchKernel(
            fill(0),
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            gpu.stream,
            args.as_mut_ptr(),
            extra.as_mut_ptr(),
        )
    };
    assert_error(code, cu::INVALID_VALUE, &["`fill`", "`extra` is not null"]);
}

#[test]
fn a_kernel_name_missing_from_its_module_lists_the_modules_kernels() {
    let _s = serial();
    init();
    let m = pipewright_emu::module::from_kernels(
        "two.cu",
        vec![kernel("alpha", fill_k, 0, &[OUT]), kernel("beta", fill_k, 0, &[OUT])],
    );
    let mut f: Handle = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    let code = unsafe { cuModuleGetFunction(&mut f, m as Handle, c"gamma".as_ptr()) };
    assert_error(code, cu::NOT_FOUND, &["two.cu", "no kernel `gamma`", "alpha, beta"]);
}
