//! The executor: walks the rank's action list from the schedule — forward,
//! backward, evaluation — and, after the last action, combines the tied
//! embedding's shares and reduces gradients over replicas. It computes through
//! `StageCompute` and talks through `Comm`; it holds no schedule logic, no
//! transport, no log formatting and no fault knobs.

use super::super::compute::{BackwardPart, ChunkInput, StageCompute};
use super::super::layout::Layout;
use super::super::protocol::{
    CoordinatorMsg, EvalKind, Failure, Phase, ReducerMsg, Sent, StageMsg, StageReport,
};
use super::comm::{At, Comm, Group, Key, Stopped};
use super::faults::{Faulty, InjectedError};
use super::panic_text;
use crate::model::part::Mode;
use crate::model::Arch;
use crate::optim::grad_tree::Span;
use crate::optim::Hyper;
use crate::replay::Blob;
use crate::schedule::{Action, ActionKind};
use crate::trace::Recorder;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

pub struct Executor {
    pub rank: usize,
    pub replica: usize,
    pub layout: Layout,
    pub gpt: Arch,
    /// Global stage ids held here, ascending; chunk i of `compute` is stages[i].
    pub stages: Vec<usize>,
    pub compute: Faulty<dyn StageCompute>,
    pub comm: Box<dyn Comm>,
    pub hyper: Hyper,
    pub actions: Vec<Action>,
    /// Microbatches per replica in the step `actions` are for (a batch ramp
    /// changes them from step to step).
    pub microbatches: usize,
    pub step: u64,
    /// The action being executed, for failure reports.
    pub current: Option<Action>,
    /// Shared with the actor, which records send → handle times.
    pub latencies_us: Arc<Mutex<Vec<f64>>>,
    pub norms: Vec<(usize, f64)>,
    /// The loss gradient's scale before loss scaling: 1 / (tokens of a step).
    pub dloss: f32,
    pub rec: Rc<Recorder>,
    /// The current action's span, from when its inputs were all in hand.
    pub action_span: tracing::Span,
    /// The ZeRO level: from 1 this replica keeps and updates its shard of
    /// the optimizer state and gradients come reduce-scattered; at 1 and 2
    /// the parameters are gathered whole after the update; at 3 they are
    /// gathered for each action that computes with a chunk (see `use_chunk`).
    pub zero: u8,
    /// ZeRO-3: free a chunk's weights after each action (else at the step's end).
    pub reshard_after_forward: bool,
    /// ZeRO-3: which chunks hold their whole weights now.
    pub gathered: Vec<bool>,
}

impl Executor {
    /// Handles control messages until `Stop` (or a closed channel); a panic is
    /// reported as a failure naming this rank, step and action.
    pub fn run(&mut self) {
        while let Ok(msg) = self.comm.next_control() {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle_control(msg)));
            match result {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) | Ok(Err(Stopped)) => break,
                Err(p) => {
                    let action = self.current.map(|a| a.to_string());
                    if let Some(InjectedError(e)) = p.downcast_ref::<InjectedError>() {
                        // An injected error ends the stage like an error, not a panic.
                        let f = Failure::new(self.rank, self.replica, self.step, action, e.clone());
                        self.comm.fail(f);
                        break;
                    }
                    let f = Failure::new(self.rank, self.replica, self.step, action, panic_text(&p));
                    self.comm.fail(f);
                    return;
                }
            }
        }
        if let Some(log) = self.comm.log() {
            if let Err(e) = log.finish() {
                let f = Failure::new(self.rank, self.replica, self.step, None, e);
                self.comm.fail(f);
            }
        }
    }

    fn local(&self, stage: usize) -> usize {
        self.stages.iter().position(|&s| s == stage).expect("stage held by this rank")
    }

    /// Where a wait now happens, for the trace.
    fn at(&self) -> At {
        match self.current {
            Some(a) => At { step: self.step, stage: a.stage, mb: Some(a.mb) },
            None => At { step: self.step, stage: self.stages[0], mb: None },
        }
    }

    fn recv_f32(&mut self, key: Key) -> Result<Vec<f32>, Stopped> {
        match self.comm.recv(key, self.at())? {
            StageMsg::Activation { data, .. }
            | StageMsg::Gradient { data, .. }
            | StageMsg::TiedShare { data, .. } => Ok(data),
            _ => unreachable!("{key:?} carries f32"),
        }
    }

    fn recv_u32(&mut self, key: Key) -> Result<Vec<u32>, Stopped> {
        match self.comm.recv(key, self.at())? {
            StageMsg::Tokens { tokens: v, .. } | StageMsg::Targets { targets: v, .. } => Ok(v),
            _ => unreachable!("{key:?} carries u32"),
        }
    }

    /// Delivers to the rank holding `stage`.
    fn send_to_stage(&mut self, stage: usize, msg: StageMsg) -> Result<(), Stopped> {
        let rank = self.layout.rank_of(stage);
        self.comm.send(rank, msg)
    }

    /// Opens the span of `kind` on (stage, mb): its inputs are all in hand.
    fn begin_action(&mut self, kind: &'static str, stage: usize, mb: usize) {
        self.action_span = self.rec.span(stage, kind, self.step, Some(mb), None, None);
    }

    /// Closes the action just finished, with the live activations it left.
    fn trace_action(&mut self, a: Action) {
        if self.rec.enabled() {
            let (n, bytes) = self.compute.live(self.local(a.stage));
            self.action_span.record("live_n", n).record("live_bytes", bytes);
        }
        self.action_span = tracing::Span::none();
    }

    /// A span on this rank's first stage (optimizer, reduction, …), open until dropped.
    fn rank_span(&self, kind: &'static str) -> tracing::Span {
        self.rec.span(self.stages[0], kind, self.step, None, None, None)
    }

    /// Returns false when the worker should exit.
    fn handle_control(&mut self, msg: StageMsg) -> Result<bool, Stopped> {
        match msg {
            StageMsg::RunStep { step, loss_scale } => self.run_step(step, loss_scale)?,
            StageMsg::Apply { step, lr, clip, skip } => {
                assert_eq!(step, self.step);
                let span = self.rank_span("optimizer");
                if !skip {
                    self.compute.adamw(self.hyper, lr, clip);
                    self.compute.update_ema();
                }
                drop(span);
                if matches!(self.zero, 1 | 2) && !skip {
                    let _span = self.rank_span("gather");
                    self.gather_params()?;
                }
                self.log_params();
                self.comm.report(CoordinatorMsg::Applied { rank: self.rank, replica: self.replica, step });
            }
            StageMsg::RunEval { step, kind, batches } => self.run_eval(step, kind, batches)?,
            StageMsg::SendWeights => {
                // ZeRO-3: every replica takes part in the gather; replica 0 reports.
                if self.zero == 3 {
                    (0..self.stages.len()).try_for_each(|i| self.use_chunk(i))?;
                }
                self.send_weights()?;
                self.release_chunks();
            }
            StageMsg::Snapshot { step } => {
                let span = self.rank_span("checkpoint");
                let (mut tensors, adam_step) = self.compute.snapshot();
                if self.zero >= 1 {
                    self.gather_state(step, &mut tensors)?;
                }
                drop(span);
                if self.replica == 0 {
                    let ema_updates = self.compute.ema_updates();
                    let msg =
                        CoordinatorMsg::Snapshot { rank: self.rank, step, tensors, adam_step, ema_updates };
                    self.comm.report(msg);
                }
            }
            StageMsg::Restore(c) => {
                // ZeRO-3: restoring keeps the owned shards and frees the rest.
                self.gathered.iter_mut().for_each(|g| *g = false);
                if let Err(e) = self.compute.restore(c.loaded()) {
                    panic!("{e}");
                }
                self.log_params();
                self.comm.report(CoordinatorMsg::Restored { rank: self.rank, replica: self.replica });
            }
            StageMsg::Stop => return Ok(false),
            _ => unreachable!("data messages are filed, not handled"),
        }
        Ok(true)
    }

    /// The end of the run: parameters (replica 0's stand for all), message
    /// latencies and the trace, to the coordinator.
    fn send_weights(&mut self) -> Result<(), Stopped> {
        let ema = self.whole_ema()?;
        let (params, ema) = match self.replica {
            0 => (self.compute.params(), ema),
            _ => (vec![], vec![]),
        };
        let latencies = std::mem::take(&mut *self.latencies_us.lock().expect("latency log"));
        let peak_live_bytes = self.compute.peak_live_bytes();
        let peak_state_bytes = self.compute.peak_state_bytes();
        let trace = self.rec.take();
        self.comm.report(CoordinatorMsg::Weights {
            rank: self.rank,
            replica: self.replica,
            params,
            ema,
            latencies_us: latencies,
            peak_live_bytes,
            peak_state_bytes,
            trace,
        });
        Ok(())
    }

    /// The EMA of every chunk's weights, whole (under ZeRO-1 gathered from
    /// every replica's shards), in the order of `params()`; empty when none is kept.
    fn whole_ema(&mut self) -> Result<Vec<Vec<f32>>, Stopped> {
        // Without ZeRO-1 replica 0's whole copy stands for all, as for the weights.
        if self.compute.ema_updates().is_none() || (self.zero == 0 && self.replica != 0) {
            return Ok(vec![]);
        }
        let mut all = Vec::new();
        for i in 0..self.stages.len() {
            let shards = self.compute.ema_shards(i);
            match self.zero >= 1 {
                true => all.extend(self.gather(self.step, self.stages[i], shards)?.iter().cloned()),
                false => all.extend(shards),
            }
        }
        Ok(all)
    }

    /// Digests of the parameters after an optimizer step (or a rollback).
    fn log_params(&mut self) {
        if let Some(log) = self.comm.log() {
            let keep = log.payloads();
            let mut blobs = Vec::new();
            self.compute.visit_params(&mut |_, name, data| blobs.push(Blob::f32s(name, data, keep)));
            log.state(blobs);
        }
    }

    fn run_step(&mut self, step: u64, loss_scale: f32) -> Result<(), Stopped> {
        self.step = step;
        let m = self.layout.microbatches_at(step);
        if m != self.microbatches {
            self.resize_step(m);
        }
        self.compute.begin_step(step);
        self.compute.zero_grads();
        let last = self.layout.last_stage();
        let mut loss_sum = 0.0f64;
        let actions = std::mem::take(&mut self.actions);
        for &a in &actions {
            self.current = Some(a);
            self.use_chunk(self.local(a.stage))?;
            match a.kind {
                ActionKind::F => {
                    let mode = Mode::Train { dloss: self.dloss * loss_scale };
                    if let Some(l) = self.forward(Phase::Train, a.stage, a.mb, mode, None)? {
                        loss_sum += l;
                    }
                }
                ActionKind::B => self.backward(a.stage, a.mb, BackwardPart::Full)?,
                ActionKind::I => self.backward(a.stage, a.mb, BackwardPart::Input)?,
                ActionKind::W => self.backward(a.stage, a.mb, BackwardPart::Weight)?,
            }
            self.trace_action(a);
            self.scatter_leaves()?;
            if self.reshard_after_forward {
                self.release_chunks();
            }
        }
        self.release_chunks();
        self.actions = actions;
        self.current = None;
        let trains = self.compute.has_gradients();
        if trains {
            self.sum_gradients()?;
        }
        let mut sumsq = Vec::new();
        // Under ZeRO each replica holds the blocks of its shard only.
        if (self.replica == 0 || self.zero >= 1) && trains {
            for i in 0..self.stages.len() {
                self.compute.grad_sum_squares(i, &mut self.norms);
                sumsq.extend_from_slice(&self.norms);
            }
        }
        let holds_last = self.stages.contains(&last);
        self.comm.report(CoordinatorMsg::StageDone(StageReport {
            rank: self.rank,
            replica: self.replica,
            step,
            grad_sumsq: sumsq,
            loss_sum: holds_last.then_some(loss_sum),
        }));
        Ok(())
    }

    /// A step of another size (`train.batch_ramp`): its schedule, its loss
    /// scale (1 / its tokens) and the replica's block of its microbatches.
    fn resize_step(&mut self, m: usize) {
        self.actions = self.layout.schedule_for(m).actions[self.rank].clone();
        self.dloss = 1.0 / self.layout.batches.tokens(self.step) as f32;
        let (r, dp) = (self.replica, self.layout.dp);
        self.compute.set_block(r * m..(r + 1) * m, dp * m);
        self.microbatches = m;
    }

    /// F of (stage, mb). Returns the microbatch's loss sum on the last stage.
    fn forward(
        &mut self,
        phase: Phase,
        stage: usize,
        mb: usize,
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> Result<Option<f64>, Stopped> {
        let last = self.layout.last_stage();
        let tokens = if stage == 0 { Some(self.recv_u32(Key::Tokens(phase, mb))?) } else { None };
        let act = if stage > 0 { Some(self.recv_f32(Key::Act(phase, stage, mb))?) } else { None };
        let targets = if stage == last { Some(self.recv_u32(Key::Targets(phase, mb))?) } else { None };
        self.begin_action(if phase == Phase::Train { "F" } else { "eval" }, stage, mb);
        let i = self.local(stage);
        let input = match (&tokens, act) {
            (Some(t), _) => ChunkInput::Tokens(t),
            (None, Some(a)) => ChunkInput::Activation(a),
            _ => unreachable!("F has tokens or an activation"),
        };
        let out = self.compute.forward(i, mb, input, targets.as_deref(), mode, argmax);
        if let Some(y) = out.output {
            let step = self.step;
            let msg = StageMsg::Activation { phase, step, stage: stage + 1, mb, data: y, sent: Sent::now() };
            self.send_to_stage(stage + 1, msg)?;
        }
        Ok(out.loss_sum)
    }

    fn backward(&mut self, stage: usize, mb: usize, which: BackwardPart) -> Result<(), Stopped> {
        let last = self.layout.last_stage();
        let i = self.local(stage);
        let kind = match which {
            BackwardPart::Full => "B",
            BackwardPart::Input => "I",
            BackwardPart::Weight => "W",
        };
        if which == BackwardPart::Weight {
            self.begin_action(kind, stage, mb);
            self.compute.backward(i, mb, which, None);
            return Ok(());
        }
        let dout = if stage < last { Some(self.recv_f32(Key::Grad(stage, mb))?) } else { None };
        self.begin_action(kind, stage, mb);
        if let Some(g) = self.compute.backward(i, mb, which, dout) {
            let msg =
                StageMsg::Gradient { step: self.step, stage: stage - 1, mb, data: g, sent: Sent::now() };
            self.send_to_stage(stage - 1, msg)?;
        }
        Ok(())
    }

    /// The step's gradients summed over microbatches and replicas. By the
    /// microbatch tree, the tied embedding's shares are each reduced over the
    /// replicas and then added; a backend without the tree adds them first.
    fn sum_gradients(&mut self) -> Result<(), Stopped> {
        let by_tree = self.compute.sums_by_tree();
        if by_tree && self.layout.dp == 1 {
            (0..self.stages.len()).for_each(|i| self.compute.finish_grad_tree(i));
        }
        if !by_tree {
            let span = self.rank_span("tied");
            self.combine_tied()?;
            drop(span);
        }
        if self.scatters() {
            // Every microbatch's shards came in as it was made.
            let span = self.rank_span("reduce");
            (0..self.stages.len()).for_each(|i| self.compute.finish_scattered(i));
            drop(span);
        } else if self.layout.dp > 1 {
            let span = self.rank_span("reduce");
            self.reduce_over_replicas()?;
            drop(span);
        }
        if by_tree {
            let span = self.rank_span("tied");
            self.combine_tied()?;
            drop(span);
        }
        Ok(())
    }

    /// Both shares of the tied embedding's gradient, summed in one order on both
    /// ranks that hold a copy: embedding share + head share.
    fn combine_tied(&mut self) -> Result<(), Stopped> {
        // An untied head's gradient is its own tensor's: there is nothing to
        // exchange, and the embedding's share (V·C floats) must not travel.
        if !self.gpt.tied() {
            return Ok(());
        }
        let last = self.layout.last_stage();
        let (first_here, last_here) = (self.stages.contains(&0), self.stages.contains(&last));
        if last == 0 {
            self.compute.combine_tied(0, None);
            return Ok(());
        }
        if first_here && last_here {
            let (a, b) = (self.local(0), self.local(last));
            let embed = self.compute.tied_share(a);
            let head = self.compute.tied_share(b);
            self.compute.combine_tied(a, Some(&head));
            self.compute.combine_tied(b, Some(&embed));
            return Ok(());
        }
        for (here, mine, other) in [(first_here, 0, last), (last_here, last, 0)] {
            if !here {
                continue;
            }
            let i = self.local(mine);
            let share = self.compute.tied_share(i);
            let peer = [self.layout.rank_of(other)];
            let theirs = self.comm.all_gather(Group::Tied, self.step, &peer, share, self.at())?;
            self.compute.combine_tied(i, Some(&theirs[0]));
        }
        Ok(())
    }

    /// ZeRO-2 and 3 over replicas: gradients are cut to their owners'
    /// shards as each microbatch's is made.
    fn scatters(&self) -> bool {
        self.zero >= 2 && self.layout.dp > 1
    }

    /// Scatters the microbatch gradients the last action made and folds
    /// this replica's shards of every replica's. Every replica runs the
    /// same actions, so each scatter meets its twins.
    fn scatter_leaves(&mut self) -> Result<(), Stopped> {
        for (i, mb, head, grads) in self.compute.take_leaves() {
            let _span = self.rank_span("scatter");
            let (step, stage, replica, at) = (self.step, self.stages[i], self.replica, self.at());
            self.comm.to_reducer(ReducerMsg::Scatter { step, stage, replica, mb, head, grads })?;
            match self.comm.recv(Key::Scattered(stage), at)? {
                StageMsg::Scattered { shards, mb: got, head: h, .. } => {
                    assert_eq!((got, h), (mb, head), "scatters of a stage come back in order");
                    self.compute.fold_scattered(i, mb, head, shards);
                }
                _ => unreachable!("Key::Scattered holds Scattered"),
            }
        }
        Ok(())
    }

    /// Sends each part's gradients to the reducer and takes back their sum over replicas.
    fn reduce_over_replicas(&mut self) -> Result<(), Stopped> {
        let m = self.microbatches;
        let block = self.replica * m..(self.replica + 1) * m;
        let parts = (0..self.stages.len())
            .map(|i| {
                let nodes = self.compute.take_grad_nodes(i, block.clone());
                let spans: Vec<Span> = nodes.iter().map(|n| n.0).collect();
                (self.stages[i], spans, nodes.into_iter().flat_map(|n| n.1).collect())
            })
            .collect();
        let (step, replica, at) = (self.step, self.replica, self.at());
        let sums = match self.zero >= 1 {
            true => self.comm.reduce_scatter(Group::Replicas, step, replica, parts, at)?,
            false => self.comm.reduce_ordered(Group::Replicas, step, replica, parts, at)?,
        };
        for (i, grads) in sums.into_iter().enumerate() {
            self.compute.set_grads(i, grads);
        }
        Ok(())
    }

    /// ZeRO-1 and 2, after the update: every replica's updated shards
    /// gathered, so each holds the whole parameters again.
    fn gather_params(&mut self) -> Result<(), Stopped> {
        for i in 0..self.stages.len() {
            let shards = self.compute.param_shards(i);
            let whole = self.gather(self.step, self.stages[i], shards)?;
            self.compute.set_params(i, &whole);
        }
        Ok(())
    }

    /// ZeRO-3: chunk `i`'s whole weights, gathered from every replica's
    /// shard unless they are held already. Every replica walks the same
    /// actions, so each gather of a stage meets its twins in the same order.
    fn use_chunk(&mut self, i: usize) -> Result<(), Stopped> {
        if self.zero != 3 || self.gathered[i] {
            return Ok(());
        }
        let span = self.rank_span("gather");
        let shards = self.compute.param_shards(i);
        let whole = self.gather(self.step, self.stages[i], shards)?;
        self.compute.set_params(i, &whole);
        drop(span);
        self.gathered[i] = true;
        Ok(())
    }

    /// ZeRO-3: frees every chunk's gathered weights.
    fn release_chunks(&mut self) {
        for i in 0..self.gathered.len() {
            if std::mem::take(&mut self.gathered[i]) {
                self.compute.release_params(i);
            }
        }
    }

    /// ZeRO, for a checkpoint: each tensor's AdamW moments (and under
    /// ZeRO-3 its weights) gathered whole from every replica's shard, so
    /// the checkpoint is layout-independent.
    fn gather_state(
        &mut self,
        step: u64,
        tensors: &mut [crate::checkpoint::TensorState],
    ) -> Result<(), Stopped> {
        let weights = self.zero == 3;
        let mut rest = tensors;
        for i in 0..self.stages.len() {
            let n = (0..).take_while(|&k| self.compute.param_name(i, k).is_some()).count();
            let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            let mut shards: Vec<Vec<f32>> =
                chunk.iter_mut().map(|t| std::mem::take(&mut t.exp_avg)).collect();
            shards.extend(chunk.iter_mut().map(|t| std::mem::take(&mut t.exp_avg_sq)));
            if weights {
                shards.extend(chunk.iter_mut().map(|t| std::mem::take(&mut t.data)));
            }
            // The EMA's shards ride in the same gather, after the moments (and weights).
            let ema = self.compute.ema_updates().is_some();
            if ema {
                shards.extend(chunk.iter_mut().map(|t| std::mem::take(&mut t.ema)));
            }
            let whole = self.gather(step, self.stages[i], shards)?;
            for (k, t) in chunk.iter_mut().enumerate() {
                (t.exp_avg, t.exp_avg_sq) = (whole[k].clone(), whole[n + k].clone());
                if weights {
                    t.data = whole[2 * n + k].clone();
                }
            }
            if ema {
                let at = if weights { 3 * n } else { 2 * n };
                for (t, e) in chunk.iter_mut().zip(&whole[at..]) {
                    t.ema = e.clone();
                }
            }
        }
        Ok(())
    }

    /// `step` keys the gather: a checkpoint's (the next step) follows the
    /// update's of the step before and precedes the next update's.
    fn gather(
        &mut self,
        step: u64,
        stage: usize,
        shards: Vec<Vec<f32>>,
    ) -> Result<Arc<Vec<Vec<f32>>>, Stopped> {
        let at = self.at();
        self.comm.all_gather_shards(Group::Replicas, step, (stage, self.replica), shards, at)
    }

    /// Forward-only microbatches through every stage, in microbatch order.
    fn run_eval(&mut self, step: u64, kind: EvalKind, batches: usize) -> Result<(), Stopped> {
        self.step = step;
        let last = self.layout.last_stage();
        let want_argmax = kind == EvalKind::ExactMatch && self.stages.contains(&last);
        let n = self.compute.micro_batch() * self.gpt.block_size;
        let mut predictions = Vec::with_capacity(if want_argmax { batches * n } else { 0 });
        let mut argmax = vec![0u32; if want_argmax { n } else { 0 }];
        let mut loss_sum = 0.0;
        let stages = self.stages.clone();
        // ZeRO-3: every replica gathers each chunk once for the evaluation
        // (only replica 0 has batches to run).
        (0..stages.len()).try_for_each(|i| self.use_chunk(i))?;
        for mb in 0..batches {
            for &s in &stages {
                let am = (want_argmax && s == last).then_some(argmax.as_mut_slice());
                let result = self.forward(Phase::Eval, s, mb, Mode::Eval, am)?;
                self.action_span = tracing::Span::none();
                if let Some(l) = result {
                    loss_sum += l;
                    if want_argmax {
                        predictions.extend_from_slice(&argmax);
                    }
                }
            }
        }
        self.release_chunks();
        if stages.contains(&last) && self.replica == 0 {
            let msg = CoordinatorMsg::EvalDone { step, kind, loss_sum, tokens: batches * n, predictions };
            self.comm.report(msg);
        }
        Ok(())
    }
}
