//! Fault injection for the failure and recovery tests: `Faults`, read once
//! from the environment when a stage starts, and `Faulty<C>`, which wraps a
//! stage's compute and fails, poisons or spoils it where the faults say.
//!
//! - `PIPEWRIGHT_FAULT=stage=S,step=N,mb=M[,kind=panic|error]`: F of (S, M)
//!   at step N panics, or (`kind=error`) reports an error and ends the stage.
//! - `PIPEWRIGHT_FAULT_ONCE=1`: that fault fires once per process (a
//!   transient failure, for `--max-restarts`).
//! - `PIPEWRIGHT_FAULT_NAN=3,4`: the loss of those steps is NaN (a poisoned batch).
//! - `PIPEWRIGHT_FAULT_INF=2`: a gradient of those steps overflows to +inf
//!   while the loss stays finite (what dynamic loss scaling must absorb).
//! - `PIPEWRIGHT_FAULT_START=stage-1`: that stage fails to start.
//! - `PIPEWRIGHT_NONDET=stage-1`: that stage sums bias gradients in a random
//!   order (the replay tests' divergence).
//!
//! NaN and inf fire once per (variable, step) per process, so a rolled-back
//! step runs clean the second time.

use super::super::compute::{BackwardPart, ChunkInput, ChunkOutput, StageCompute};
use crate::checkpoint::{Loaded, TensorState};
use crate::model::part::Mode;
use crate::model::Param;
use crate::optim::grad_tree::Span;
use crate::optim::Hyper;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Where F fails, and whether as an error or a panic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForwardFault {
    pub stage: usize,
    pub step: u64,
    pub mb: usize,
    pub error: bool,
}

/// Every fault the environment asks for.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    pub forward: Option<ForwardFault>,
    pub forward_once: bool,
    pub nan_steps: Vec<u64>,
    pub inf_steps: Vec<u64>,
    /// Stage actor names that fail to start.
    pub start: Vec<String>,
    /// Stage actor names that sum nondeterministically.
    pub nondet: Vec<String>,
}

fn list<T: std::str::FromStr>(var: &str) -> Vec<T> {
    std::env::var(var).map_or(vec![], |v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
}

fn parse_forward(v: &str) -> Option<ForwardFault> {
    let mut f = ForwardFault { stage: usize::MAX, step: u64::MAX, mb: usize::MAX, error: false };
    for kv in v.split(',') {
        let (k, val) = kv.split_once('=')?;
        match (k.trim(), val.trim()) {
            ("stage", val) => f.stage = val.parse().ok()?,
            ("step", val) => f.step = val.parse().ok()?,
            ("mb", val) => f.mb = val.parse().ok()?,
            ("kind", "panic") => f.error = false,
            ("kind", "error") => f.error = true,
            _ => return None,
        }
    }
    Some(f)
}

impl Faults {
    pub fn from_env() -> Faults {
        Faults {
            forward: std::env::var("PIPEWRIGHT_FAULT").ok().and_then(|v| parse_forward(&v)),
            forward_once: std::env::var_os("PIPEWRIGHT_FAULT_ONCE").is_some(),
            nan_steps: list("PIPEWRIGHT_FAULT_NAN"),
            inf_steps: list("PIPEWRIGHT_FAULT_INF"),
            start: list("PIPEWRIGHT_FAULT_START"),
            nondet: list("PIPEWRIGHT_NONDET"),
        }
    }

    /// Whether stage actor `name` is to fail at start.
    pub fn fails_to_start(&self, name: &str) -> bool {
        self.start.iter().any(|s| s == name)
    }

    pub fn nondeterministic(&self, name: &str) -> bool {
        self.nondet.iter().any(|s| s == name)
    }
}

/// True the first time this process asks about (`var`, `step`) with the step listed.
fn fires_once(var: &str, listed: &[u64], step: u64) -> bool {
    static FIRED: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());
    if !listed.contains(&step) {
        return false;
    }
    let key = (var.to_string(), step);
    let mut fired = FIRED.lock().expect("fault log");
    if fired.contains(&key) {
        return false;
    }
    fired.push(key);
    true
}

fn forward_fault_fires(once: bool) -> bool {
    static FIRED: AtomicBool = AtomicBool::new(false);
    !once || !FIRED.swap(true, Ordering::SeqCst)
}

/// An injected `kind=error` fault, unwound out of the compute without the
/// panic hook: the executor reports it as the stage's error.
pub struct InjectedError(pub String);

/// A stage's compute with the environment's faults injected.
pub struct Faulty<C: StageCompute + ?Sized> {
    inner: Box<C>,
    faults: Faults,
    /// Global stage ids of the chunks, ascending.
    stages: Vec<usize>,
    last: usize,
    step: u64,
    /// The loss of this step's next training F on the last stage is NaN.
    nan_pending: bool,
}

impl<C: StageCompute + ?Sized> Faulty<C> {
    pub fn new(inner: Box<C>, faults: Faults, stages: Vec<usize>, last: usize) -> Self {
        Faulty { inner, faults, stages, last, step: 0, nan_pending: false }
    }

    /// A training step begins.
    pub fn begin_step(&mut self, step: u64) {
        self.step = step;
        let holds_last = self.stages.contains(&self.last);
        self.nan_pending = holds_last && fires_once("PIPEWRIGHT_FAULT_NAN", &self.faults.nan_steps, step);
    }

    fn check_forward(&self, stage: usize, mb: usize) {
        let Some(f) = self.faults.forward else { return };
        if (f.stage, f.step, f.mb) != (stage, self.step, mb) || !forward_fault_fires(self.faults.forward_once)
        {
            return;
        }
        if f.error {
            let e = format!("injected error (PIPEWRIGHT_FAULT) in F of stage {stage}, microbatch {mb}");
            std::panic::resume_unwind(Box::new(InjectedError(e)));
        }
        panic!("injected fault (PIPEWRIGHT_FAULT) in F of stage {stage}, microbatch {mb}");
    }
}

impl<C: StageCompute + ?Sized> StageCompute for Faulty<C> {
    fn micro_batch(&self) -> usize {
        self.inner.micro_batch()
    }
    fn has_gradients(&self) -> bool {
        self.inner.has_gradients()
    }
    fn zero_grads(&mut self) {
        self.inner.zero_grads()
    }
    fn forward(
        &mut self,
        i: usize,
        mb: usize,
        input: ChunkInput,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> ChunkOutput {
        let train = matches!(mode, Mode::Train { .. });
        if train {
            self.check_forward(self.stages[i], mb);
        }
        let mut out = self.inner.forward(i, mb, input, targets, mode, argmax);
        if train && self.stages[i] == self.last && self.nan_pending {
            self.nan_pending = false;
            out.loss_sum = Some(f64::NAN);
        }
        out
    }
    fn backward(
        &mut self,
        i: usize,
        mb: usize,
        which: BackwardPart,
        dout: Option<Vec<f32>>,
    ) -> Option<Vec<f32>> {
        self.inner.backward(i, mb, which, dout)
    }
    fn live(&self, i: usize) -> (usize, usize) {
        self.inner.live(i)
    }
    fn peak_live_bytes(&self) -> usize {
        self.inner.peak_live_bytes()
    }
    fn peak_state_bytes(&self) -> usize {
        self.inner.peak_state_bytes()
    }
    fn tied_share(&self, i: usize) -> Vec<f32> {
        self.inner.tied_share(i)
    }
    fn combine_tied(&mut self, i: usize, other: Option<&[f32]>) {
        self.inner.combine_tied(i, other)
    }
    fn take_grads(&mut self, i: usize) -> Vec<Vec<f32>> {
        self.inner.take_grads(i)
    }
    fn take_grad_nodes(&mut self, i: usize, block: std::ops::Range<usize>) -> Vec<(Span, Vec<Vec<f32>>)> {
        self.inner.take_grad_nodes(i, block)
    }
    fn take_leaves(&mut self) -> Vec<(usize, usize, bool, Vec<Vec<f32>>)> {
        self.inner.take_leaves()
    }
    fn fold_scattered(&mut self, i: usize, mb: usize, head: bool, shards: Vec<Vec<f32>>) {
        self.inner.fold_scattered(i, mb, head, shards)
    }
    fn finish_scattered(&mut self, i: usize) {
        self.inner.finish_scattered(i)
    }
    fn finish_grad_tree(&mut self, i: usize) {
        self.inner.finish_grad_tree(i)
    }
    fn set_block(&mut self, block: std::ops::Range<usize>, total: usize) {
        self.inner.set_block(block, total)
    }
    fn sums_by_tree(&self) -> bool {
        self.inner.sums_by_tree()
    }
    fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>) {
        self.inner.set_grads(i, grads)
    }
    /// The overflow fault lands here, after the replica reduction and before
    /// the norms: the one place every gradient of the step is final.
    fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>) {
        if self.stages[i] == self.last
            && fires_once("PIPEWRIGHT_FAULT_INF", &self.faults.inf_steps, self.step)
        {
            self.inner.poison_grad(i, f32::INFINITY);
        }
        self.inner.grad_sum_squares(i, out)
    }
    fn poison_grad(&mut self, i: usize, value: f32) {
        self.inner.poison_grad(i, value)
    }
    fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32) {
        self.inner.adamw(hyper, lr, clip)
    }
    fn param_shards(&self, i: usize) -> Vec<Vec<f32>> {
        self.inner.param_shards(i)
    }
    fn set_params(&mut self, i: usize, params: &[Vec<f32>]) {
        self.inner.set_params(i, params)
    }
    fn release_params(&mut self, i: usize) {
        self.inner.release_params(i)
    }
    fn visit_params(&self, f: &mut dyn FnMut(usize, &str, &[f32])) {
        self.inner.visit_params(f)
    }
    fn param_name(&self, i: usize, k: usize) -> Option<String> {
        self.inner.param_name(i, k)
    }
    fn params(&self) -> Vec<Param> {
        self.inner.params()
    }
    fn update_ema(&mut self) {
        self.inner.update_ema()
    }
    fn ema_updates(&self) -> Option<u64> {
        self.inner.ema_updates()
    }
    fn ema_shards(&self, i: usize) -> Vec<Vec<f32>> {
        self.inner.ema_shards(i)
    }
    fn snapshot(&self) -> (Vec<TensorState>, u64) {
        self.inner.snapshot()
    }
    fn restore(&mut self, c: &Loaded) -> Result<(), String> {
        self.inner.restore(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forward_fault_names_stage_step_and_microbatch_and_rejects_unknown_keys() {
        let f = parse_forward("stage=1,step=3,mb=2,kind=error").expect("parses");
        assert_eq!(f, ForwardFault { stage: 1, step: 3, mb: 2, error: true });
        assert_eq!(parse_forward("stage=1,color=red"), None);
    }

    #[test]
    fn a_listed_step_fires_once_per_process() {
        assert!(fires_once("TEST_ONLY_FAULT", &[4], 4));
        assert!(!fires_once("TEST_ONLY_FAULT", &[4], 4));
        assert!(!fires_once("TEST_ONLY_FAULT", &[4], 5));
    }
}
