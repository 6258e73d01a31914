//! PW_EMU_CHECK=order runs every launch twice, threads in ascending then
//! descending order, and a result that depends on the order (a missing
//! barrier) is an error naming the kernel and where the bytes differ.

mod exec_support;

use exec_support::*;
use pipewright_emu::error::cu;
use std::ffi::c_void;

fn order_mode() {
    // Read once per process, at the first launch: set before any.
    std::env::set_var("PW_EMU_CHECK", "order");
    init();
    assert!(pipewright_emu::exec::order_check_enabled());
}

/// Rotates a block's values through shared memory: out[t] = in[(t + 1) % n].
fn rotate(with_barrier: bool) -> extern "C" fn(*mut *mut c_void) {
    extern "C" fn good(args: *mut *mut c_void) {
        body(args, true)
    }
    extern "C" fn bad(args: *mut *mut c_void) {
        body(args, false)
    }
    fn body(args: *mut *mut c_void, barrier: bool) {
        let (out, inp): (*mut f32, *const f32) = unsafe { (arg(args, 0), arg(args, 1)) };
        let sh = (rt().dynamic_shared)() as *mut f32;
        let (t, n) = (tid(), lane().block_dim.x as usize);
        unsafe { *sh.add(t) = *inp.add(t) };
        if barrier {
            (rt().syncthreads)();
        }
        unsafe { *out.add(t) = *sh.add((t + 1) % n) };
    }
    if with_barrier {
        good
    } else {
        bad
    }
}

fn run(with_barrier: bool) -> (u32, Vec<f32>, Gpu) {
    order_mode();
    let gpu = Gpu::new(0);
    let n = 128;
    let (out, inp) = (gpu.alloc(n * 4), gpu.alloc(n * 4));
    gpu.upload(inp, &(0..n).map(|i| i as f32).collect::<Vec<_>>());
    let name = if with_barrier { "rotate_synced" } else { "rotate_unsynced" };
    let f = function(
        "rotate.cu",
        kernel(name, rotate(with_barrier), 0, &[("out", "float*", true), ("inp", "const float*", true)]),
    );
    let (mut o, mut i) = (out, inp);
    assert_eq!(
        launch(f, (1, 1, 1), (n as u32, 1, 1), n as u32 * 4, gpu.stream, &mut [p(&mut o), p(&mut i)]),
        cu::SUCCESS
    );
    let code = gpu.sync();
    let host = if code == cu::SUCCESS { gpu.download(out, n) } else { Vec::new() };
    (code, host, gpu)
}

#[test]
fn a_missing_barrier_is_caught_by_running_threads_in_two_orders() {
    let _s = serial();
    let (code, _, _) = run(false);
    assert_error(
        code,
        cu::LAUNCH_FAILED,
        &["rotate_unsynced", "PW_EMU_CHECK=order", "argument `out`", "differs at byte"],
    );
}

#[test]
fn a_kernel_with_its_barrier_passes_the_order_check() {
    let _s = serial();
    let (code, host, _) = run(true);
    assert_eq!(code, cu::SUCCESS, "{}", error_text(code));
    assert!(host.iter().enumerate().all(|(t, &v)| v == ((t + 1) % 128) as f32), "{host:?}");
}
