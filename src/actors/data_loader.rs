//! One data loader per data-parallel replica. For a training step it sends
//! every microbatch's tokens to the first stage and its targets to the last;
//! replica r of step s, microbatch j reads the sequences of global microbatch
//! (s·dp + r)·m + j, so dp = 2 with m microbatches sees exactly the data of
//! dp = 1 with 2m. For evaluations it sends validation windows or the held-out
//! problems.

use super::coordinator::EvalKind;
use super::stage::{Phase, StageMsg};
use crate::data::{EvalSet, Sampler};
use ractor::{Actor, ActorProcessingErr, ActorRef, Message};
use std::sync::{Arc, OnceLock};

pub enum LoaderMsg {
    Train { step: u64 },
    Eval { step: u64, kind: EvalKind, batches: usize },
}

impl Message for LoaderMsg {}

pub struct LoaderArgs {
    pub replica: usize,
    pub dp: usize,
    pub microbatches: usize,
    pub micro_batch_size: usize,
    pub block_size: usize,
    pub train: Sampler,
    pub val: Option<Sampler>,
    pub eval_set: Option<Arc<EvalSet>>,
    /// This replica's stage actors, by rank.
    pub stages: Arc<OnceLock<Vec<Vec<ActorRef<StageMsg>>>>>,
    pub first_rank: usize,
    pub last_rank: usize,
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
        let n = st.micro_batch_size * st.block_size;
        let stages = st.stages.get().ok_or("loader: stage actors not known yet")?;
        let first = stages[st.replica][st.first_rank].clone();
        let last = stages[st.replica][st.last_rank].clone();
        let send = |phase: Phase, step: u64, mb: usize, tokens: Vec<u32>, targets: Vec<u32>| {
            first.send_message(StageMsg::Tokens { phase, step, mb, tokens })?;
            last.send_message(StageMsg::Targets { phase, step, mb, targets })
        };
        match msg {
            LoaderMsg::Train { step } => {
                for mb in 0..st.microbatches {
                    let (mut inp, mut tgt) = (vec![0u32; n], vec![0u32; n]);
                    let global_mb = (step as usize * st.dp + st.replica) * st.microbatches + mb;
                    st.train.fill((global_mb * st.micro_batch_size) as u64, &mut inp, &mut tgt);
                    send(Phase::Train, step, mb, inp, tgt)?;
                }
            }
            LoaderMsg::Eval { step, kind, batches } => {
                for mb in 0..batches {
                    let (mut inp, mut tgt) = (vec![0u32; n], vec![0u32; n]);
                    match kind {
                        EvalKind::Val => {
                            let val = st.val.as_mut().ok_or("loader: no validation data")?;
                            val.fill((mb * st.micro_batch_size) as u64, &mut inp, &mut tgt);
                        }
                        EvalKind::ExactMatch => {
                            let set = st.eval_set.as_ref().ok_or("loader: no held-out problems")?;
                            inp.copy_from_slice(&set.inputs()[mb * n..(mb + 1) * n]);
                            tgt.copy_from_slice(&set.targets()[mb * n..(mb + 1) * n]);
                        }
                    }
                    send(Phase::Eval, step, mb, inp, tgt)?;
                }
            }
        }
        Ok(())
    }
}
