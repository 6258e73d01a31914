//! The NCCL stand-in's C entry points, called as libnccl's would be: the
//! checks that need no GPU work (communicators, queries, argument checks,
//! groups, error strings). The calls that queue work need the driver's
//! streams and memory, and are covered by the backend's runs.

use pipewright_emu::nccl::types::code;
use pipewright_emu::nccl::{self as nccl, NcclUniqueId};
use std::ffi::{c_int, c_void, CStr};

const F32: c_int = 7;
const SUM: c_int = 0;

/// The error strings are the latest message per code, process-wide: the
/// tests here take turns so each reads its own.
/// They also see four emulated GPUs: ncclCommInitAll refuses a GPU the
/// driver does not have, as NCCL does.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    std::env::set_var("PW_EMU_GPUS", "4");
    turn
}

fn error_string(result: c_int) -> String {
    // SAFETY: ncclGetErrorString returns a NUL-terminated string that lives on.
    unsafe { CStr::from_ptr(nccl::ncclGetErrorString(result)) }.to_string_lossy().into_owned()
}

fn init_all(devices: &[c_int]) -> (c_int, Vec<*mut c_void>) {
    let mut comms = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: room for one handle per device.
    let rc = unsafe { nccl::ncclCommInitAll(comms.as_mut_ptr(), devices.len() as c_int, devices.as_ptr()) };
    (rc, comms)
}

#[test]
fn the_version_and_fresh_unique_ids_are_reported() {
    let _turn = serial();
    let mut version = 0;
    assert_eq!(nccl::ncclGetVersion(&mut version), 0);
    assert_eq!(version, 22304);
    let mut a = NcclUniqueId { internal: [0; 128] };
    let mut b = NcclUniqueId { internal: [0; 128] };
    assert_eq!(nccl::ncclGetUniqueId(&mut a), 0);
    assert_eq!(nccl::ncclGetUniqueId(&mut b), 0);
    assert_ne!(a.internal, b.internal);
    assert_eq!(nccl::ncclGetUniqueId(std::ptr::null_mut()), code::INVALID_ARGUMENT as c_int);
}

#[test]
fn comm_init_all_makes_one_rank_per_gpu_and_the_queries_answer_for_it() {
    let _turn = serial();
    let (rc, comms) = init_all(&[2, 0, 1]);
    assert_eq!(rc, 0);
    for (r, &c) in comms.iter().enumerate() {
        let (mut count, mut rank, mut device) = (0, 0, 0);
        assert_eq!(nccl::ncclCommCount(c, &mut count), 0);
        assert_eq!(nccl::ncclCommUserRank(c, &mut rank), 0);
        assert_eq!(nccl::ncclCommCuDevice(c, &mut device), 0);
        assert_eq!((count, rank, device), (3, r as c_int, [2, 0, 1][r]));
    }
    for c in comms {
        assert_eq!(nccl::ncclCommDestroy(c), 0);
    }
}

#[test]
fn comm_init_all_refuses_a_gpu_the_driver_does_not_have() {
    let _turn = serial();
    let (rc, _) = init_all(&[0, 9]);
    assert_eq!(rc, code::INVALID_ARGUMENT as c_int);
    let msg = error_string(rc);
    assert!(msg.contains("ncclCommInitAll") && msg.contains('9'), "{msg}");
}

#[test]
fn comm_init_all_refuses_a_gpu_listed_twice() {
    let _turn = serial();
    let (rc, _) = init_all(&[0, 1, 1]);
    assert_eq!(rc, code::INVALID_USAGE as c_int);
    let msg = error_string(rc);
    assert!(msg.contains("ncclCommInitAll over GPUs [0, 1, 1]") && msg.contains("and 2 (pid"), "{msg}");
    assert!(msg.contains("both on GPU 1"), "{msg}");
}

#[test]
fn a_root_outside_the_communicator_is_refused_naming_it() {
    let _turn = serial();
    let (_, comms) = init_all(&[0, 1]);
    let buf = 0x1000 as *mut c_void;
    let rc = nccl::ncclBroadcast(buf, buf, 4, F32, 2, comms[1], std::ptr::null_mut());
    assert_eq!(rc, code::INVALID_ARGUMENT as c_int);
    let msg = error_string(rc);
    assert!(msg.contains("ncclBroadcast (rank 1 of 2 on GPU 1): root 2 is not a rank"), "{msg}");
    let rc = nccl::ncclSend(buf, 4, F32, -1, comms[0], std::ptr::null_mut());
    assert!(error_string(rc).contains("ncclSend (rank 0 of 2 on GPU 0): peer -1 is not a rank"));
    for c in comms {
        nccl::ncclCommDestroy(c);
    }
}

#[test]
fn an_unemulated_datatype_or_op_is_refused() {
    let _turn = serial();
    let (_, comms) = init_all(&[0]);
    let buf = 0x1000 as *mut c_void;
    let rc = nccl::ncclAllReduce(buf, buf, 4, 10, SUM, comms[0], std::ptr::null_mut());
    assert_eq!(rc, code::INVALID_ARGUMENT as c_int);
    assert!(error_string(rc).contains("datatype 10: the fp8 types"));
    let rc = nccl::ncclAllReduce(buf, buf, 4, F32, 5, comms[0], std::ptr::null_mut());
    assert!(error_string(rc).contains("reduction op 5"), "{}", error_string(rc));
    nccl::ncclCommDestroy(comms[0]);
}

#[test]
fn a_communicator_used_after_destroy_is_refused() {
    let _turn = serial();
    let (_, comms) = init_all(&[0, 1]);
    for &c in &comms {
        assert_eq!(nccl::ncclCommDestroy(c), 0);
    }
    let buf = 0x1000 as *mut c_void;
    let rc = nccl::ncclAllReduce(buf, buf, 4, F32, SUM, comms[1], std::ptr::null_mut());
    assert_eq!(rc, code::INVALID_USAGE as c_int);
    let msg = error_string(rc);
    assert!(msg.contains("(rank 1 of 2 on GPU 1) was used after ncclCommDestroy"), "{msg}");
    let mut n = 0;
    assert_eq!(nccl::ncclCommCount(comms[0], &mut n), code::INVALID_USAGE as c_int);
    assert_eq!(nccl::ncclCommDestroy(comms[0]), code::INVALID_USAGE as c_int, "destroyed twice");
    assert_eq!(nccl::ncclCommDestroy(std::ptr::null_mut()), 0, "NULL is a no-op, as in NCCL");
}

#[test]
fn a_pointer_that_is_no_communicator_is_refused() {
    let _turn = serial();
    let mut n = 0;
    let rc = nccl::ncclCommCount(0x1234 as *const c_void, &mut n);
    assert_eq!(rc, code::INVALID_ARGUMENT as c_int);
    assert!(error_string(rc).contains("0x1234 is not a communicator"));
}

#[test]
fn group_end_without_group_start_is_refused_and_groups_nest() {
    let _turn = serial();
    let rc = nccl::ncclGroupEnd();
    assert_eq!(rc, code::INVALID_USAGE as c_int);
    assert!(error_string(rc).contains("ncclGroupEnd without a matching ncclGroupStart"));
    assert_eq!(nccl::ncclGroupStart(), 0);
    assert_eq!(nccl::ncclGroupStart(), 0);
    assert_eq!(nccl::ncclGroupEnd(), 0);
    assert_eq!(nccl::ncclGroupEnd(), 0);
    assert_eq!(nccl::ncclGroupEnd(), code::INVALID_USAGE as c_int);
}

#[test]
fn comm_init_rank_without_a_current_gpu_is_refused() {
    let _turn = serial();
    let mut id = NcclUniqueId { internal: [0; 128] };
    nccl::ncclGetUniqueId(&mut id);
    let mut comm = std::ptr::null_mut();
    let rc = nccl::ncclCommInitRank(&mut comm, 2, id, 0);
    assert_eq!(rc, code::INVALID_USAGE as c_int);
    assert!(
        error_string(rc).contains("ncclCommInitRank (rank 0 of 2): NCCL puts the rank on the current GPU")
    );
    assert!(comm.is_null());
}
