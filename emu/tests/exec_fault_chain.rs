//! The fault handler that turns a kernel's SIGSEGV into an error leaves
//! every other fault alone: outside a kernel the process still crashes.

mod exec_support;

use exec_support::*;
use pipewright_emu::error::cu;
use std::ffi::c_void;
use std::os::unix::process::ExitStatusExt;

extern "C" fn nop_k(_args: *mut *mut c_void) {}

const CHILD: &str = "PW_EMU_TEST_CRASH_CHILD";

#[test]
fn a_fault_outside_any_kernel_still_kills_the_process_with_sigsegv() {
    if std::env::var_os(CHILD).is_some() {
        // The child: install the handler by running a kernel, then fault on the host.
        let gpu = Gpu::new(0);
        let f = function("nop.cu", kernel("nop", nop_k, 0, &[]));
        assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
        assert_eq!(gpu.sync(), cu::SUCCESS);
        // SAFETY: deliberately not: the fault is the point.
        unsafe { std::ptr::write_volatile(16 as *mut u64, 1) };
        unreachable!("the write above faults");
    }
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_fault_outside_any_kernel_still_kills_the_process_with_sigsegv", "--nocapture"])
        .env(CHILD, "1")
        .status()
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "the child ended with {status:?}");
}
