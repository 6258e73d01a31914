//! PW_EMU_CHECK=race: work on one stream that touches what another stream
//! wrote (or writes what it read) with nothing ordering the two is an error
//! naming both; an event wait or a host synchronization orders them.

mod exec_support;

use exec_support::*;
use pipewright_emu::driver::{
    cuEventCreate, cuEventRecord, cuStreamCreate, cuStreamSynchronize, cuStreamWaitEvent,
};
use pipewright_emu::error::cu;
use std::ffi::c_void;

fn race_mode() {
    // Read once per process: set before the first launch.
    std::env::set_var("PW_EMU_CHECK", "race");
    init();
    assert!(pipewright_emu::stream::race::enabled());
}

extern "C" fn slow_write_k(args: *mut *mut c_void) {
    let out: *mut u32 = unsafe { arg(args, 0) };
    if tid() == 0 {
        std::thread::sleep(std::time::Duration::from_millis(30));
    }
    unsafe { std::ptr::write_volatile(out.add(tid()), 2) };
}

extern "C" fn copy_k(args: *mut *mut c_void) {
    let (out, inp): (*mut u32, *const u32) = unsafe { (arg(args, 0), arg(args, 1)) };
    unsafe { *out.add(tid()) = std::ptr::read_volatile(inp.add(tid())) };
}

struct Setup {
    gpu: Gpu,
    b: Handle,
    writer: Handle,
    reader: Handle,
    data: u64,
    copy: u64,
}

fn setup() -> Setup {
    race_mode();
    let gpu = Gpu::new(0);
    let mut b: Handle = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuStreamCreate(&mut b, 1) }, cu::SUCCESS);
    let writer = function("w.cu", kernel("slow_write", slow_write_k, 0, &[("data", "unsigned*", true)]));
    let reader = function(
        "r.cu",
        kernel("copy", copy_k, 0, &[("out", "unsigned*", true), ("inp", "const unsigned*", true)]),
    );
    let (data, copy) = (gpu.alloc(32 * 4), gpu.alloc(32 * 4));
    Setup { gpu, b, writer, reader, data, copy }
}

#[test]
fn a_read_on_another_stream_without_a_wait_is_a_race_naming_both_sides() {
    let _s = serial();
    let t = setup();
    let (mut d, mut c) = (t.data, t.copy);
    assert_eq!(launch(t.writer, (1, 1, 1), (32, 1, 1), 0, t.gpu.stream, &mut [p(&mut d)]), cu::SUCCESS);
    assert_eq!(launch(t.reader, (1, 1, 1), (32, 1, 1), 0, t.b, &mut [p(&mut c), p(&mut d)]), cu::SUCCESS);
    // SAFETY: our streams.
    let code = unsafe {
        let first = cuStreamSynchronize(t.b);
        let second = cuStreamSynchronize(t.gpu.stream);
        if first != cu::SUCCESS {
            first
        } else {
            second
        }
    };
    assert_error(
        code,
        cu::LAUNCH_FAILED,
        &["missing wait between streams", "slow_write", "copy", "argument `"],
    );
}

#[test]
fn an_event_wait_orders_the_streams_and_a_host_sync_orders_later_work() {
    let _s = serial();
    let t = setup();
    let (mut d, mut c) = (t.data, t.copy);
    let mut e: Handle = std::ptr::null_mut();
    assert_eq!(launch(t.writer, (1, 1, 1), (32, 1, 1), 0, t.gpu.stream, &mut [p(&mut d)]), cu::SUCCESS);
    // SAFETY: our streams and event.
    unsafe {
        assert_eq!(cuEventCreate(&mut e, 2), cu::SUCCESS);
        assert_eq!(cuEventRecord(e, t.gpu.stream), cu::SUCCESS);
        assert_eq!(cuStreamWaitEvent(t.b, e, 0), cu::SUCCESS);
    }
    assert_eq!(launch(t.reader, (1, 1, 1), (32, 1, 1), 0, t.b, &mut [p(&mut c), p(&mut d)]), cu::SUCCESS);
    // SAFETY: our stream.
    assert_eq!(unsafe { cuStreamSynchronize(t.b) }, cu::SUCCESS, "{}", error_text(cu::LAUNCH_FAILED));
    // The host saw stream B finish: rewriting the data on A is ordered after B's read.
    assert_eq!(launch(t.writer, (1, 1, 1), (32, 1, 1), 0, t.gpu.stream, &mut [p(&mut d)]), cu::SUCCESS);
    assert_eq!(t.gpu.sync(), cu::SUCCESS, "{}", error_text(cu::LAUNCH_FAILED));
    assert_eq!(t.gpu.download::<u32>(t.copy, 32), vec![2u32; 32]);
}
