//! What the process runs on, as the OS reports it: the machine's memory,
//! cores and thread ceiling, the compute threads a run takes from them, and
//! the stop signals it answers ([`signals`]).
//!
//! Sits at the bottom of the crate (it imports nothing of it), so the file
//! readers, the config checks and the runtime can all ask the machine without
//! reaching up into `train/` or `limits`.

pub mod signals;

/// What this machine offers, as read from the OS.
#[derive(Clone, Copy, Debug)]
pub struct Machine {
    pub memory_bytes: f64,
    pub cores: usize,
    /// The most threads this process may start (kernel and rlimit ceilings).
    pub thread_ceiling: usize,
}

impl Machine {
    pub fn this() -> Machine {
        Machine { memory_bytes: mem_total_bytes(), cores: cores(), thread_ceiling: kernel_thread_ceiling() }
    }

    /// Threads a run may start: far more than cores time-share fine (the sim
    /// backend runs pp = 32 on 2 cores), but tens of thousands only wait for a
    /// thread-pool builder to fail.
    pub fn max_threads(&self) -> usize {
        (64 * self.cores).max(1024).min(self.thread_ceiling)
    }
}

/// Compute threads: the configured count, or one per available core.
pub fn thread_count(configured: usize) -> usize {
    if configured > 0 {
        configured
    } else {
        cores()
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `MemTotal` from /proc/meminfo; unknown (infinite) where there is none.
fn mem_total_bytes() -> f64 {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else { return f64::INFINITY };
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::INFINITY, |kb| kb * 1024.0)
}

fn kernel_thread_ceiling() -> usize {
    let max = std::fs::read_to_string("/proc/sys/kernel/threads-max")
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
        .unwrap_or(usize::MAX);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct passed.
    let nproc = if unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) } == 0
        && lim.rlim_cur != libc::RLIM_INFINITY
    {
        lim.rlim_cur as usize
    } else {
        usize::MAX
    };
    max.min(nproc)
}
