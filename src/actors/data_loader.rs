//! One data loader per data-parallel replica. For a training step it sends
//! every microbatch's tokens to the first stage and its targets to the last;
//! replica r of step s, microbatch j reads the sequences of global microbatch
//! r·m + j of the step, which starts after every sequence of the steps
//! before it ((s·dp)·m microbatches at a constant batch; a batch ramp's
//! prefix sum otherwise), so dp = 2 with m microbatches sees exactly the data
//! of dp = 1 with 2m. For evaluations it sends validation windows or the
//! held-out problems.

use super::protocol::{EvalKind, LoaderMsg, Phase, StageMsg};
use crate::data::{EvalSet, Sampler};
use crate::optim::batch_ramp::BatchSizes;
use crate::replay::{self, ActorLog};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::{Arc, OnceLock};

pub struct LoaderArgs {
    pub replica: usize,
    pub dp: usize,
    /// Each step's global batch.
    pub batches: Arc<BatchSizes>,
    pub micro_batch_size: usize,
    pub block_size: usize,
    pub train: Sampler,
    pub val: Option<Sampler>,
    pub eval_set: Option<Arc<EvalSet>>,
    /// This replica's stage actors, by rank.
    pub stages: Arc<OnceLock<Vec<Vec<ActorRef<StageMsg>>>>>,
    pub first_rank: usize,
    pub last_rank: usize,
    pub log: Option<ActorLog>,
}

pub struct DataLoader;

impl Actor for DataLoader {
    type Msg = LoaderMsg;
    type State = LoaderArgs;
    type Arguments = LoaderArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<LoaderMsg>,
        args: LoaderArgs,
    ) -> Result<LoaderArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<LoaderMsg>,
        msg: LoaderMsg,
        st: &mut LoaderArgs,
    ) -> Result<(), ActorProcessingErr> {
        Ok(st.on_message(msg)?)
    }

    async fn post_stop(
        &self,
        _me: ActorRef<LoaderMsg>,
        st: &mut LoaderArgs,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(log) = &mut st.log {
            log.finish()?;
        }
        Ok(())
    }
}

impl LoaderArgs {
    /// Handles one message. With no stage actors (replaying the loader alone)
    /// what it would send is only logged.
    pub fn on_message(&mut self, msg: LoaderMsg) -> Result<(), String> {
        let n = self.micro_batch_size * self.block_size;
        if let Some(log) = &mut self.log {
            let (kind, blobs) = msg.logged();
            let step = match msg {
                LoaderMsg::Train { step } | LoaderMsg::Eval { step, .. } => step,
            };
            let eval = matches!(msg, LoaderMsg::Eval { .. });
            log.begin(
                replay::entry("coordinator", kind, step, self.replica).with_eval(eval).with_inputs(blobs),
            );
        }
        match msg {
            LoaderMsg::Train { step } => {
                let m = self.batches.per_replica(step, self.dp);
                let before = self.batches.sequences_before(step);
                for mb in 0..m {
                    let (mut inp, mut tgt) = (vec![0u32; n], vec![0u32; n]);
                    // The microbatch's index over all steps: its poison key.
                    let global_mb = (before / self.micro_batch_size as u64) as usize + self.replica * m + mb;
                    self.train.fill((global_mb * self.micro_batch_size) as u64, &mut inp, &mut tgt);
                    if spike_fault(step) {
                        poison(&inp, &mut tgt, global_mb as u64);
                    }
                    self.send(Phase::Train, step, mb, inp, tgt)?;
                }
            }
            LoaderMsg::Eval { step, kind, batches } => {
                for mb in 0..batches {
                    let (mut inp, mut tgt) = (vec![0u32; n], vec![0u32; n]);
                    match kind {
                        EvalKind::Val => {
                            let val = self.val.as_mut().ok_or("loader: no validation data")?;
                            val.fill((mb * self.micro_batch_size) as u64, &mut inp, &mut tgt);
                        }
                        EvalKind::ExactMatch => {
                            let set = self.eval_set.as_ref().ok_or("loader: no held-out problems")?;
                            inp.copy_from_slice(&set.inputs()[mb * n..(mb + 1) * n]);
                            tgt.copy_from_slice(&set.targets()[mb * n..(mb + 1) * n]);
                        }
                    }
                    self.send(Phase::Eval, step, mb, inp, tgt)?;
                }
            }
        }
        if let Some(log) = &mut self.log {
            log.end();
        }
        Ok(())
    }

    fn send(
        &mut self,
        phase: Phase,
        step: u64,
        mb: usize,
        tokens: Vec<u32>,
        targets: Vec<u32>,
    ) -> Result<(), String> {
        let tokens = StageMsg::Tokens { phase, step, mb, tokens };
        let targets = StageMsg::Targets { phase, step, mb, targets };
        if let Some(log) = &mut self.log {
            let keep = log.payloads();
            let first = super::protocol::stage_name(self.first_rank, self.replica);
            let last = super::protocol::stage_name(self.last_rank, self.replica);
            tokens.logged(keep, &super::protocol::no_grad_names).record_sent(log, &first);
            targets.logged(keep, &super::protocol::no_grad_names).record_sent(log, &last);
        }
        let Some(stages) = self.stages.get() else { return Ok(()) };
        let ranks = &stages[self.replica];
        let failed = |e| format!("loader-{}: {e}", self.replica);
        ranks[self.first_rank].send_message(tokens).map_err(failed)?;
        ranks[self.last_rank].send_message(targets).map_err(failed)
    }
}

/// `PIPEWRIGHT_FAULT_SPIKE=30,31`: the batches of those (0-based) steps are
/// poisoned — every target replaced by one random token — so once the model has
/// learned something their loss jumps, and, the targets all pulling one way,
/// so does the gradient norm; for the spike-detector tests.
fn spike_fault(step: u64) -> bool {
    std::env::var("PIPEWRIGHT_FAULT_SPIKE")
        .is_ok_and(|v| v.split(',').any(|s| s.trim().parse::<u64>().ok() == Some(step)))
}

/// A random id up to the largest in the batch: within the vocabulary, and
/// most likely one the data never shows.
fn poison(inputs: &[u32], targets: &mut [u32], key: u64) {
    let top = inputs.iter().chain(targets.iter()).copied().max().unwrap_or(0) as u64 + 1;
    let mut r = crate::rng::Rng::new(0, crate::rng::Purpose::Test, &[0x5b1e, key]);
    targets.fill(r.below(top) as u32);
}
