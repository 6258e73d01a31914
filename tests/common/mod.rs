//! Helpers that several test binaries share: child processes run to an end
//! or killed at a random moment, checkpoint writes in flight, loopback ports
//! and `worker` commands. Each test binary uses only some of them.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A model and run small enough for tests that start many processes.
pub const TINY: [&str; 9] = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "train.micro_batch_size=2",
    "parallel.microbatches=2",
    "train.eval_every=0",
    "train.eval_batches=2",
    "checkpoint.every=2",
];

/// Runs `cmd` with stderr kept, killing it (and failing the test with its
/// stderr) if it runs past `limit`: a hang is a failure, not a stuck suite.
pub fn run_to_end(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let until = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("still running after {limit:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

/// The checkpoints being written (or cut short) in `root`, by name and inode:
/// a write that starts over under the same name is another directory.
pub fn tmps(root: &Path) -> Vec<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(d) = std::fs::read_dir(root) else { return vec![] };
    d.flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .filter_map(|e| Some((e.file_name().to_string_lossy().into(), e.metadata().ok()?.ino())))
        .collect()
}

/// What one kill attempt of a storm did.
pub struct Kill {
    /// The run ended by itself before the kill came (its exit status).
    pub finished: Option<ExitStatus>,
    /// The kill landed while a checkpoint of this process was being written.
    pub mid_write: bool,
}

/// Kills `child` at a random moment. Even attempts wait for a checkpoint
/// write of this process to begin under `root` (a `.tmp` not among `stale`)
/// and kill within `jitter_ms` of it; odd ones kill anywhere in the middle
/// 80% of `whole_ms`, the length of an uninterrupted run on this machine.
pub fn kill_at_random_moment(
    child: &mut Child,
    attempt: usize,
    rng: &mut u64,
    whole_ms: u64,
    jitter_ms: u64,
    root: &Path,
    stale: &[(String, u64)],
) -> Kill {
    let writing = || tmps(root).iter().any(|t| !stale.contains(t));
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    let t = Instant::now();
    if attempt.is_multiple_of(2) {
        while !writing() && child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(*rng % jitter_ms));
    } else {
        std::thread::sleep(Duration::from_millis(whole_ms / 10 + *rng % (whole_ms * 8 / 10)));
    }
    let finished = child.try_wait().unwrap();
    let mut mid_write = false;
    if finished.is_none() {
        child.kill().unwrap();
        child.wait().unwrap();
        mid_write = writing();
    }
    Kill { finished, mid_write }
}

/// Waits until training is under way (`n` metrics lines), two minutes at most.
/// If one of `procs` ends first, or the time runs out, every one of them is
/// ended and the panic shows what each wrote to stderr: a run that never
/// started says why.
pub fn wait_for_steps(out: &Path, n: usize, procs: &mut [&mut Child]) {
    let until = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(true, |t| t.lines().count() < n) {
        let ended = procs.iter_mut().any(|c| c.try_wait().ok().flatten().is_some());
        if ended || Instant::now() >= until {
            let why = if ended { "a process ended" } else { "two minutes passed" };
            let said: Vec<String> = procs.iter_mut().map(|c| stderr_of_ended(c)).collect();
            panic!(
                "{}: training never got under way ({why}); stderr:\n{}",
                out.display(),
                said.join("\n---\n")
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Ends `c` if it still runs and returns its exit status and what it wrote to
/// stderr (when that was piped).
fn stderr_of_ended(c: &mut Child) -> String {
    let _ = c.kill();
    let status = c.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
    let mut err = String::new();
    if let Some(mut e) = c.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    format!("pid {} ({status}):\n{err}", c.id())
}

/// A port P on 127.0.0.1 with P + 1 free too (cluster node and data link).
pub fn free_ports() -> u16 {
    loop {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

/// The command `worker` runs as rank `rank` of `world`: torchrun's
/// variables, the cookie, stderr kept.
pub fn worker_command(port: u16, rank: usize, world: usize, cookie: &str, args: &[String]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.arg("worker")
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("PIPEWRIGHT_COOKIE", cookie)
        .env_remove("PIPEWRIGHT_COOKIE_FILE")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}
