//! CUDA_VISIBLE_DEVICES picks and renumbers the emulated GPUs as it does the
//! real ones, and a GPU's identity across processes is (session, emulated ordinal).

use pipewright_emu::driver::{cuDeviceGetCount, cuDeviceGetName, cuInit};
use pipewright_emu::error::cu;
use pipewright_emu::memory;
use std::ffi::CStr;

#[test]
fn visible_devices_are_renumbered_and_keep_their_emulated_identity() {
    std::env::set_var("PW_EMU_GPUS", "4");
    std::env::set_var("CUDA_VISIBLE_DEVICES", "3,1");
    std::env::set_var("PW_EMU_SESSION", "ci-run-7");
    // SAFETY: the driver's entry points with valid out-pointers.
    unsafe {
        assert_eq!(cuInit(0), cu::SUCCESS);
        let mut n = 0;
        assert_eq!(cuDeviceGetCount(&mut n), cu::SUCCESS);
        assert_eq!(n, 2);
        let mut name = [0 as std::ffi::c_char; 64];
        assert_eq!(cuDeviceGetName(name.as_mut_ptr(), 64, 0), cu::SUCCESS);
        assert_eq!(CStr::from_ptr(name.as_ptr()).to_str().unwrap(), "pipewright emulated GPU 3 (sm_90)");
    }
    assert_eq!(memory::device_identity(0), ("ci-run-7".to_string(), 3));
    assert_eq!(memory::device_identity(1), ("ci-run-7".to_string(), 1));
}
