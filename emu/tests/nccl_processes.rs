//! The NCCL stand-in's engine across two real processes: each test starts
//! this binary again, running only itself, as rank 1 (an environment
//! variable naming the id file tells the child its part); the two share the
//! unique id through that temporary file, as pipewright's processes share
//! it over the cluster.

use pipewright_emu::nccl::engine::{Config, DeviceId, Member, Op, UniqueId, ID_BYTES};
use pipewright_emu::nccl::types::{DataType, RedOp};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const ID_FILE_VAR: &str = "PW_NCCL_TEST_ID_FILE";

fn config() -> Config {
    Config { chunk_bytes: 64, timeout: Duration::from_secs(20) }
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn bits(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).collect()
}

fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn input(rank: usize, count: usize) -> Vec<f32> {
    (0..count)
        .map(|i| {
            if (i + rank).is_multiple_of(3) {
                -0.0
            } else {
                (i * 7 + rank) as f32 * 0.37 - 1e6 * rank as f32
            }
        })
        .collect()
}

/// Every collective and a send/receive exchange, checked on both ranks.
fn collectives(rank: usize, id: &UniqueId) -> &'static str {
    let gpu = DeviceId { session: format!("pid{}", std::process::id()), ordinal: 0 };
    let m = Member::init(id, 2, rank, gpu, config()).expect("init across processes");
    let count = 45;

    let mut buf = bytes_f32(&input(rank, count));
    m.run(&[Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum)]).unwrap();
    let sum: Vec<f32> = (0..count).map(|i| input(0, count)[i] + input(1, count)[i]).collect();
    assert_eq!(bits(&buf), bits_f32(&sum), "all-reduce on rank {rank}");

    let mine = bytes_f32(&input(rank, count));
    let mut gathered = vec![0u8; 2 * mine.len()];
    m.run(&[Op::all_gather(&mine, &mut gathered, DataType::F32)]).unwrap();
    let both: Vec<f32> = input(0, count).into_iter().chain(input(1, count)).collect();
    assert_eq!(bits(&gathered), bits_f32(&both), "all-gather on rank {rank}");

    let mut from_root = bytes_f32(&input(rank, count));
    m.run(&[Op::broadcast_in_place(&mut from_root, DataType::F32, 1)]).unwrap();
    assert_eq!(bits(&from_root), bits_f32(&input(1, count)), "broadcast on rank {rank}");

    let mut received = vec![0u8; mine.len()];
    let other = 1 - rank;
    m.run(&[Op::send(&mine, DataType::F32, other), Op::recv(&mut received, DataType::F32, other)]).unwrap();
    assert_eq!(bits(&received), bits_f32(&input(other, count)), "send/recv on rank {rank}");
    "every result as expected"
}

/// Both processes claim GPU 0 of one emulator session: both are refused.
fn same_gpu(rank: usize, id: &UniqueId) -> String {
    let gpu = DeviceId { session: "one-machine".into(), ordinal: 0 };
    Member::init(id, 2, rank, gpu, config()).err().expect("two ranks on one GPU are refused").to_string()
}

/// Rank 0 all-reduces, rank 1 all-gathers: both hear of both calls.
fn mismatch(rank: usize, id: &UniqueId) -> String {
    let gpu = DeviceId { session: format!("pid{}", std::process::id()), ordinal: 0 };
    let m = Member::init(id, 2, rank, gpu, config()).unwrap();
    let mut buf = bytes_f32(&[1.0; 8]);
    let op = match rank {
        0 => Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum),
        _ => Op::all_gather_in_place(&mut buf, 4, DataType::F32),
    };
    m.run(&[op]).unwrap_err().to_string()
}

/// Runs `scenario` as rank 0 here and as rank 1 in a child process (this
/// binary again, running only `test`, which sees the id file's variable and
/// takes rank 1); rank 0's result, the child's pid and its stdout. In the
/// child it prints its result and returns None.
fn two_processes<T: std::fmt::Display>(
    test: &str,
    scenario: impl FnOnce(usize, &UniqueId) -> T,
) -> Option<(T, u32, String)> {
    if let Ok(file) = std::env::var(ID_FILE_VAR) {
        let raw = std::fs::read(file).expect("the id file");
        let id = UniqueId(raw.try_into().expect("128 bytes"));
        println!("RANK 1: {}", scenario(1, &id));
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let id = UniqueId::new();
    let id_file = dir.path().join("nccl-id");
    std::fs::write(&id_file, id.0).unwrap();
    assert_eq!(std::fs::read(Path::new(&id_file)).unwrap().len(), ID_BYTES);
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ID_FILE_VAR, &id_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mine = scenario(0, &id);
    let done = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&done.stdout).into_owned();
    assert!(done.status.success(), "rank 1 failed: {stdout}\n{}", String::from_utf8_lossy(&done.stderr));
    assert!(stdout.contains("RANK 1: "), "the child ran no rank: {stdout}");
    Some((mine, pid, stdout))
}

/// Rank 1 joins and its process exits; rank 0 then waits in an all-reduce.
fn child_exits(rank: usize, id: &UniqueId) -> String {
    let gpu = DeviceId { session: format!("pid{}", std::process::id()), ordinal: 0 };
    let cfg = Config { timeout: Duration::from_secs(1), ..config() };
    let m = Member::init(id, 2, rank, gpu, cfg).unwrap();
    if rank == 1 {
        return "joined, exiting".into();
    }
    let mut buf = bytes_f32(&[1.0; 8]);
    // Long enough for the child to be gone before the report is made.
    std::thread::sleep(Duration::from_millis(300));
    m.run(&[Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum)]).unwrap_err().to_string()
}

#[test]
fn collectives_and_send_recv_work_between_two_processes() {
    two_processes("collectives_and_send_recv_work_between_two_processes", collectives);
}

#[test]
fn two_processes_on_one_gpu_are_both_refused_naming_both_pids() {
    let Some((mine, child, theirs)) =
        two_processes("two_processes_on_one_gpu_are_both_refused_naming_both_pids", same_gpu)
    else {
        return;
    };
    let me = std::process::id();
    for e in [&mine, &theirs] {
        assert!(e.contains(&format!("ranks 0 (pid {me}) and 1 (pid {child})")), "{e}");
        assert!(e.contains("GPU 0 of emulator session \"one-machine\""), "{e}");
    }
}

#[test]
fn different_collectives_in_two_processes_are_reported_in_both() {
    let test = "different_collectives_in_two_processes_are_reported_in_both";
    let Some((mine, _, theirs)) = two_processes(test, mismatch) else { return };
    for e in [&mine, &theirs] {
        assert!(e.contains("rank 0: ncclAllReduce #1 (8 x float32, sum)"), "{e}");
        assert!(e.contains("rank 1: ncclAllGather #1 (4 x float32 from each rank)"), "{e}");
    }
}

#[test]
fn a_rank_whose_process_exited_is_named_so_in_the_deadlock_report() {
    let test = "a_rank_whose_process_exited_is_named_so_in_the_deadlock_report";
    let Some((mine, child, _)) = two_processes(test, child_exits) else { return };
    assert!(mine.contains("rank 0: waiting in ncclAllReduce #1 (8 x float32, sum) for ranks [1]"), "{mine}");
    assert!(mine.contains(&format!("rank 1: no call yet (its process, pid {child}, has exited)")), "{mine}");
}
