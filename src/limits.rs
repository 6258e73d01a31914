//! Sizes the machine cannot hold, refused before anything runs.
//!
//! A config can be valid and still impossible here: a million layers, a
//! billion-token block, a hundred thousand threads. Left to run, such a config
//! ends in the allocator's abort or a panic in a thread-pool builder, after
//! `--force` has already removed the earlier run's outputs. So the memory and
//! the threads a run needs are estimated from the config first (in f64: the
//! products overflow usize) and compared with what the machine has.
//!
//! The estimates are lower bounds (what the run holds at the very least), so
//! a refusal is always right and a run that passes may still be too big for
//! memory someone else holds.

use crate::config::{BackendKind, Builtin, Config, ConfigError, Problem};

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

/// Bytes the run holds at least, by what holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemoryNeed {
    pub model_states: f64,
    pub activations: f64,
    pub data: f64,
}

impl MemoryNeed {
    pub fn total(&self) -> f64 {
        self.model_states + self.activations + self.data
    }
}

/// GPT-2's parameter count for the config's shape, in f64.
pub fn param_count(cfg: &Config) -> f64 {
    let m = &cfg.model;
    let (l, c, v, t) = (m.n_layer as f64, m.n_embd as f64, m.vocab_size as f64, m.block_size as f64);
    v * c + t * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c
}

/// The least memory a run of `cfg` holds in this process.
pub fn memory_need(cfg: &Config) -> MemoryNeed {
    let m = &cfg.model;
    let p = param_count(cfg);
    let dp = cfg.parallel.dp as f64;
    let (b, t, c, v) =
        (cfg.train.micro_batch_size as f64, m.block_size as f64, m.n_embd as f64, m.vocab_size as f64);
    let (l, nh) = (m.n_layer as f64, m.n_head as f64);
    // f32 weights and gradients per replica, and at least one replica's
    // worth of AdamW moments (however they are sharded). The sim backend
    // computes nothing and holds no tensors; a GPU run keeps one f32 copy here.
    let model_states = match cfg.backend.kind {
        BackendKind::Sim => 0.0,
        BackendKind::Cpu => 8.0 * p * dp + 8.0 * p,
        BackendKind::Cuda => 4.0 * p,
    };
    // One microbatch in flight per replica: each layer's f32 input (all that
    // full recompute keeps), one layer's attention scores while it computes,
    // and the logits with their gradient.
    let activations = if cfg.backend.kind == BackendKind::Cpu {
        dp * 4.0 * (l * b * t * c + b * nh * t * t + 2.0 * b * t * v)
    } else {
        0.0
    };
    MemoryNeed { model_states, activations, data: data_bytes(cfg) }
}

/// Token data the run generates in memory (the built-in corpora), in bytes.
fn data_bytes(cfg: &Config) -> f64 {
    let p = &cfg.parallel;
    let tokens = cfg.train.steps as f64
        * p.dp as f64
        * p.microbatches as f64
        * cfg.train.micro_batch_size as f64
        * cfg.model.block_size as f64;
    match cfg.data.builtin {
        // u32 tokens, generated from text at least as long.
        Builtin::Arithmetic => 5.0 * tokens,
        Builtin::Random => 4.0 * tokens.min((1u64 << 26) as f64),
        Builtin::Files => 0.0,
    }
}

/// The threads a run of `cfg` starts: one per stage and its compute pool.
pub fn thread_need(cfg: &Config) -> f64 {
    let p = &cfg.parallel;
    let ranks = p.pp as f64 * p.dp as f64;
    let stages = ranks * p.chunks.max(1) as f64;
    let compute = if cfg.backend.threads > 0 { (cfg.backend.threads as f64).max(ranks) } else { ranks };
    stages + compute
}

fn gib(b: f64) -> String {
    format!("{:.1} GiB", b / (1u64 << 30) as f64)
}

/// The field most responsible for `need`, among the model's and the batch's sizes.
fn biggest_memory_field(cfg: &Config) -> (&'static str, String) {
    let m = &cfg.model;
    // Each candidate's share, holding the others at 1: the field that scales the estimate most.
    let (c, l, t, v, b) = (
        m.n_embd as f64,
        m.n_layer as f64,
        m.block_size as f64,
        m.vocab_size as f64,
        cfg.train.micro_batch_size as f64,
    );
    let shares = [
        ("model.n_embd", c * c),
        ("model.n_layer", l),
        ("model.block_size", t * t),
        ("model.vocab_size", v),
        ("train.micro_batch_size", b),
        ("parallel.dp", cfg.parallel.dp as f64),
        ("train.steps", if cfg.data.builtin == Builtin::Files { 0.0 } else { cfg.train.steps as f64 }),
    ];
    let (field, _) =
        shares.iter().copied().fold(("model.n_embd", f64::MIN), |a, x| if x.1 > a.1 { x } else { a });
    let value = match field {
        "model.n_embd" => m.n_embd.to_string(),
        "model.n_layer" => m.n_layer.to_string(),
        "model.block_size" => m.block_size.to_string(),
        "model.vocab_size" => m.vocab_size.to_string(),
        "train.micro_batch_size" => cfg.train.micro_batch_size.to_string(),
        "parallel.dp" => cfg.parallel.dp.to_string(),
        _ => cfg.train.steps.to_string(),
    };
    (field, value)
}

/// Problems with the memory `cfg` needs on `machine`.
fn check_memory(cfg: &Config, machine: &Machine, out: &mut Vec<Problem>) {
    let need = memory_need(cfg);
    if need.total() <= machine.memory_bytes {
        return;
    }
    let (path, value) = biggest_memory_field(cfg);
    out.push(Problem {
        path: path.into(),
        value,
        expected: format!(
            "the run would hold at least {} (model states {}, activations {}, generated data {}), more than \
             this machine's {} of memory",
            gib(need.total()),
            gib(need.model_states),
            gib(need.activations),
            gib(need.data),
            gib(machine.memory_bytes)
        ),
    });
}

/// Problems with the threads `cfg` starts on `machine`.
fn check_threads(cfg: &Config, machine: &Machine, out: &mut Vec<Problem>) {
    let need = thread_need(cfg);
    let max = machine.max_threads();
    if need <= max as f64 {
        return;
    }
    let p = &cfg.parallel;
    let (path, value) = if cfg.backend.threads as f64 >= (p.pp * p.dp) as f64 {
        ("backend.threads", cfg.backend.threads)
    } else if p.dp >= p.pp {
        ("parallel.dp", p.dp)
    } else {
        ("parallel.pp", p.pp)
    };
    out.push(Problem {
        path: path.into(),
        value: value.to_string(),
        expected: format!(
            "the run would start about {need:.0} threads (a thread per stage and per compute thread); this \
             machine ({} cores) allows at most {max}",
            machine.cores
        ),
    });
}

/// Refuses a config the machine cannot run, naming the field, before anything
/// is allocated, spawned or removed.
pub fn check(cfg: &Config) -> Result<(), ConfigError> {
    check_on(cfg, &Machine::this())
}

pub fn check_on(cfg: &Config, machine: &Machine) -> Result<(), ConfigError> {
    let mut problems = Vec::new();
    check_threads(cfg, machine, &mut problems);
    check_memory(cfg, machine, &mut problems);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid(problems))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOX: Machine =
        Machine { memory_bytes: 24.0 * (1u64 << 30) as f64, cores: 2, thread_ceiling: 100_000 };

    fn with(sets: &[&str]) -> Config {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::load(None, &sets).unwrap()
    }

    fn refused(sets: &[&str]) -> String {
        check_on(&with(sets), &BOX).unwrap_err().to_string()
    }

    #[test]
    fn the_shipped_configs_fit_a_2_core_24_gib_box() {
        check_on(&with(&[]), &BOX).unwrap();
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/gpt2-124m.toml")).unwrap();
        check_on(&Config::parse(&text, "gpt2-124m.toml", &[]).unwrap(), &BOX).unwrap();
        check_on(&with(&["parallel.pp=32", "backend.kind=\"sim\"", "model.n_layer=32"]), &BOX).unwrap();
    }

    #[test]
    fn impossible_model_and_batch_sizes_are_refused_naming_the_field() {
        for (set, field) in [
            ("model.n_embd=1000000", "model.n_embd: 1000000"),
            ("model.n_layer=1000000", "model.n_layer: 1000000"),
            ("model.block_size=1000000000", "model.block_size: 1000000000"),
            ("train.micro_batch_size=100000000", "train.micro_batch_size: 100000000"),
            ("model.vocab_size=2147483648", "model.vocab_size: 2147483648"),
        ] {
            let err = refused(&[set]);
            assert!(err.contains(field) && err.contains("GiB"), "{set}: {err}");
        }
    }

    #[test]
    fn tens_of_thousands_of_threads_are_refused_naming_the_field() {
        assert!(refused(&["backend.threads=100000"]).contains("backend.threads: 100000"));
        assert!(refused(&["parallel.dp=100000"]).contains("parallel.dp: 100000"));
        assert!(refused(&["parallel.pp=100000", "model.n_layer=100000"]).contains("parallel.pp: 100000"));
    }
}
