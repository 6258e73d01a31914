//! Data-parallel gradient reduction: for each stage, the gradients of every
//! replica are summed in replica order (0 + 1 + 2 …) and the sum is sent back
//! to every replica, so all replicas apply the same update and stay identical.

use super::stage::StageMsg;
use ractor::{Actor, ActorProcessingErr, ActorRef, Message};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

pub enum ReducerMsg {
    Reduce { step: u64, stage: usize, replica: usize, grads: Vec<Vec<f32>> },
}

impl Message for ReducerMsg {}

pub struct ReducerArgs {
    pub dp: usize,
    /// Stage actors by (replica, rank).
    pub stages: Arc<OnceLock<Vec<Vec<ActorRef<StageMsg>>>>>,
    pub pp: usize,
}

pub struct Reducer;

/// One stage's gradients, a vector per parameter tensor.
type Grads = Vec<Vec<f32>>;

pub struct ReducerState {
    args: ReducerArgs,
    /// (step, stage) → gradients by replica.
    pending: BTreeMap<(u64, usize), Vec<Option<Grads>>>,
}

impl Actor for Reducer {
    type Msg = ReducerMsg;
    type State = ReducerState;
    type Arguments = ReducerArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<ReducerMsg>,
        args: ReducerArgs,
    ) -> Result<ReducerState, ActorProcessingErr> {
        Ok(ReducerState { args, pending: BTreeMap::new() })
    }

    async fn handle(
        &self,
        _me: ActorRef<ReducerMsg>,
        msg: ReducerMsg,
        st: &mut ReducerState,
    ) -> Result<(), ActorProcessingErr> {
        let ReducerMsg::Reduce { step, stage, replica, grads } = msg;
        let dp = st.args.dp;
        let slot = st.pending.entry((step, stage)).or_insert_with(|| (0..dp).map(|_| None).collect());
        if slot[replica].replace(grads).is_some() {
            return Err(format!("reducer: replica {replica} sent stage {stage} of step {step} twice").into());
        }
        if slot.iter().any(Option::is_none) {
            return Ok(());
        }
        let mut parts: Vec<Vec<Vec<f32>>> =
            st.pending.remove(&(step, stage)).unwrap().into_iter().map(|g| g.unwrap()).collect();
        // Sum in replica order into replica 0's buffers. This is heavy arithmetic in
        // a handler, but it is a single streaming add and keeps the order fixed.
        let (first, rest) = parts.split_at_mut(1);
        for other in rest.iter() {
            for (acc, g) in first[0].iter_mut().zip(other) {
                for (a, &b) in acc.iter_mut().zip(g) {
                    *a += b;
                }
            }
        }
        let sum = parts.swap_remove(0);
        let stages = st.args.stages.get().ok_or("reducer: stage actors not known yet")?;
        let rank = stage % st.args.pp;
        for replica in stages.iter().take(dp).skip(1) {
            replica[rank].send_message(StageMsg::Reduced { step, stage, grads: sum.clone() })?;
        }
        stages[0][rank].send_message(StageMsg::Reduced { step, stage, grads: sum })?;
        Ok(())
    }
}
