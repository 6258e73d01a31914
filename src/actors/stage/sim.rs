//! `SimCompute`: the simulated backend. Each action takes its set time
//! (`[sim]` costs, per-stage factors, jitter) instead of computing, and hands
//! a token-sized payload on, so the runtime's own overhead and bubbles can be
//! measured at pp = 32 on a 2-core box. It waits for its inputs exactly as a
//! real stage does, because it is driven by the same executor.

use super::super::compute::{BackwardPart, ChunkInput, ChunkOutput, StageCompute};
use crate::checkpoint::{Loaded, TensorState};
use crate::model::part::Mode;
use crate::model::Param;
use crate::optim::Hyper;
use crate::rng::{Purpose, Rng};
use crate::schedule::ActionKind;
use std::time::{Duration, Instant};

/// Bytes of the stand-in payload the sim passes per microbatch (4 f32s): the
/// "bytes held" its counters report, so a sim trace reads like a real one.
const SIM_PAYLOAD_BYTES: usize = 16;

pub struct SimCompute {
    /// Action times, ms.
    forward: f64,
    backward: f64,
    weight: f64,
    factors: Vec<f64>,
    jitter: f64,
    rng: Rng,
    /// Global stage ids of the chunks, ascending.
    stages: Vec<usize>,
    last: usize,
    /// Microbatches between F and the end of their backward, per chunk: the
    /// sim holds no activations, but the schedule's memory shape is still
    /// what the trace's counters should show.
    live: Vec<usize>,
    micro_batch: usize,
}

impl SimCompute {
    pub fn new(
        cfg: &crate::config::Config,
        stages: Vec<usize>,
        last: usize,
        rank: usize,
        replica: usize,
    ) -> Self {
        SimCompute {
            forward: cfg.sim.forward_ms,
            backward: cfg.sim.backward_ms,
            weight: cfg.sim.weight_ms,
            factors: cfg.sim.stage_factors.clone(),
            jitter: cfg.sim.jitter,
            rng: Rng::new(cfg.train.seed, Purpose::Test, &[rank as u64, replica as u64, 0x51]),
            live: vec![0; stages.len()],
            stages,
            last,
            micro_batch: cfg.train.micro_batch_size,
        }
    }

    fn duration(&mut self, kind: ActionKind, stage: usize) -> Duration {
        let base = match kind {
            ActionKind::F => self.forward,
            ActionKind::B => self.backward,
            ActionKind::I => self.backward - self.weight,
            ActionKind::W => self.weight,
        };
        let factor = self.factors.get(stage).copied().unwrap_or(1.0);
        let u = 2.0 * self.rng.next_f64() - 1.0;
        Duration::from_secs_f64((base * factor * (1.0 + self.jitter * u)).max(0.0) / 1e3)
    }

    fn take_time(&mut self, kind: ActionKind, i: usize) {
        let start = Instant::now();
        let d = self.duration(kind, self.stages[i]);
        sleep_until(start + d);
    }
}

/// Holds the thread until `deadline`, yielding its core to any thread that is
/// ready; only an action longer than `YIELD_FOR` sleeps, for all but that
/// last stretch. At the bench's costs (2 ms / 4 ms) a stage never sleeps.
///
/// A stage busy in its action is what a real stage is, and waking from a
/// sleep is what made the sim late: on a shared 2-vCPU VM a woken thread can
/// wait hundreds of µs for a core, and a stage that ends late delays every
/// stage after it. Longer yield stretches measured better at every step up to
/// 5 ms; OS timers (1 ns slack, absolute `clock_nanosleep`) and busy spins
/// measured worse (docs/benchmarks.md, "Issue 27's overhead: closing the
/// gap"). Yielding spends idle cycles, not other threads' time:
/// `sched_yield` hands the core to whichever thread is ready.
fn sleep_until(deadline: Instant) {
    const YIELD_FOR: Duration = Duration::from_millis(5);
    let now = Instant::now();
    if deadline > now + YIELD_FOR {
        std::thread::sleep(deadline - now - YIELD_FOR);
    }
    while Instant::now() < deadline {
        std::thread::yield_now();
    }
}

impl StageCompute for SimCompute {
    fn micro_batch(&self) -> usize {
        self.micro_batch
    }
    /// No weights: nothing to combine, reduce, clip or update.
    fn has_gradients(&self) -> bool {
        false
    }
    fn zero_grads(&mut self) {}
    fn forward(
        &mut self,
        i: usize,
        _mb: usize,
        _input: ChunkInput,
        _targets: Option<&[u32]>,
        _mode: Mode,
        _argmax: Option<&mut [u32]>,
    ) -> ChunkOutput {
        self.take_time(ActionKind::F, i);
        self.live[i] += 1;
        let output = (self.stages[i] < self.last).then(|| vec![0.0; 4]);
        ChunkOutput { output, loss_sum: None }
    }
    fn backward(
        &mut self,
        i: usize,
        _mb: usize,
        which: BackwardPart,
        _dout: Option<Vec<f32>>,
    ) -> Option<Vec<f32>> {
        let kind = match which {
            BackwardPart::Full => ActionKind::B,
            BackwardPart::Input => ActionKind::I,
            BackwardPart::Weight => ActionKind::W,
        };
        self.take_time(kind, i);
        if which != BackwardPart::Input {
            self.live[i] -= 1;
        }
        (which != BackwardPart::Weight && self.stages[i] > 0).then(|| vec![0.0; 4])
    }
    fn live(&self, i: usize) -> (usize, usize) {
        (self.live[i], self.live[i] * SIM_PAYLOAD_BYTES)
    }
    fn peak_live_bytes(&self) -> usize {
        0
    }
    fn tied_share(&self, _i: usize) -> Vec<f32> {
        vec![]
    }
    fn combine_tied(&mut self, _i: usize, _other: Option<&[f32]>) {}
    fn take_grads(&mut self, _i: usize) -> Vec<Vec<f32>> {
        vec![]
    }
    fn set_grads(&mut self, _i: usize, _grads: Vec<Vec<f32>>) {}
    fn grad_sum_squares(&mut self, _i: usize, out: &mut Vec<(usize, f64)>) {
        out.clear();
    }
    fn poison_grad(&mut self, _i: usize, _value: f32) {}
    fn adamw(&mut self, _hyper: Hyper, _lr: f64, _clip: f32) {}
    fn visit_params(&self, _f: &mut dyn FnMut(usize, &str, &[f32])) {}
    fn param_name(&self, _i: usize, _k: usize) -> Option<String> {
        None
    }
    fn params(&self) -> Vec<Param> {
        vec![]
    }
    fn snapshot(&self) -> (Vec<TensorState>, u64) {
        (vec![], 0)
    }
    fn restore(&mut self, _c: &Loaded) -> Result<(), String> {
        Ok(())
    }
}
