//! One optimizer step on one process without a pipeline: microbatches run
//! forward and backward in order, their gradients summed by the microbatch
//! tree (`optim::grad_tree`), the tied embedding's shares are combined, the global norm decides clipping or a skip, and AdamW
//! updates. The actor runtime runs the same arithmetic spread over stages.

use crate::metrics::StepStats;
use crate::model::part::{Mode, PartInput};
use crate::model::tp::TpShape;
use crate::model::{ModelPart, PartSpec};
use crate::optim::grad_tree::{Leaf, PartTree};
use crate::optim::{self, AdamState, Hyper};

pub struct Engine {
    pub part: ModelPart,
    pub adam: AdamState,
    pub hyper: Hyper,
    pub grad_clip: f64,
    /// Microbatches per step: the global batch (dp · parallel.microbatches).
    pub microbatches: usize,
    pub pool: rayon::ThreadPool,
    tree: PartTree,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// Predictions of one microbatch in `evaluate`.
    argmax: Vec<u32>,
    norms: Vec<(usize, f64)>,
    /// Each tensor's first norm slot (`optim::zero::first_slots`).
    first_slots: Vec<usize>,
}

impl Engine {
    pub fn new(cfg: &crate::config::Config) -> Self {
        let gpt = cfg.arch();
        let b = cfg.train.micro_batch_size;
        let threads = crate::host::thread_count(cfg.backend.threads);
        let tp = TpShape::from_config(cfg);
        let part = ModelPart::new(gpt, PartSpec::whole(&gpt), b, cfg.train.seed, cfg.train.recompute)
            .with_tp(tp, threads);
        let adam = AdamState::new(&part.params);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("compute-{i}"))
            .build()
            .expect("thread pool");
        let n = b * gpt.block_size;
        let microbatches = cfg.parallel.dp * cfg.parallel.microbatches;
        let tree = PartTree::new(&part.spec, &part.cfg, part.params.len(), 0..microbatches, microbatches);
        Engine {
            part,
            adam,
            hyper: Hyper::from_config(cfg),
            grad_clip: cfg.optim.grad_clip,
            microbatches,
            pool,
            tree,
            inputs: vec![0; n],
            targets: vec![0; n],
            argmax: vec![0; n],
            norms: Vec::new(),
            first_slots: optim::zero::first_slots(&cfg.arch()),
        }
    }

    /// Tokens per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.microbatches * self.inputs.len()
    }

    /// One optimizer step. `fill(mb, inputs, targets)` supplies microbatch `mb`.
    pub fn step(&mut self, lr: f64, mut fill: impl FnMut(usize, &mut [u32], &mut [u32]) + Send) -> StepStats {
        let dloss = 1.0 / self.tokens_per_step() as f32;
        let Engine {
            part,
            adam,
            hyper,
            grad_clip,
            microbatches,
            pool,
            inputs,
            targets,
            norms,
            tree,
            first_slots,
            ..
        } = self;
        pool.install(|| {
            part.zero_grads();
            let mut loss_sum = 0.0f64;
            for mb in 0..*microbatches {
                fill(mb, inputs, targets);
                let out = part.forward(PartInput::Tokens(inputs), Some(targets), Mode::Train { dloss });
                loss_sum += out.loss_sum.expect("whole model computes the loss");
                tree.push(&mut part.params, &mut part.wte_head_grad, Leaf::Head, mb);
                part.backward(out.acts.expect("training keeps activations"), None);
                tree.push(&mut part.params, &mut part.wte_head_grad, Leaf::Body, mb);
            }
            tree.finish_local(&mut part.params, &mut part.wte_head_grad);
            part.combine_tied_grads(None);
            let loss = loss_sum * dloss as f64;
            let whole = optim::zero::Shard::WHOLE;
            optim::grad_sum_squares(&part.params, part.spec.embedding, whole, first_slots, norms);
            let grad_norm = optim::global_norm(norms);
            let skipped = !loss.is_finite() || !grad_norm.is_finite();
            if !skipped {
                let clip = optim::clip_coefficient(grad_norm, *grad_clip);
                adam.step(&mut part.params, *hyper, lr, clip);
            }
            StepStats { loss, grad_norm, lr, skipped }
        })
    }

    /// Mean loss over `batches` microbatches without updating, with argmax
    /// predictions appended to `predictions` when given.
    pub fn evaluate(
        &mut self,
        batches: usize,
        mut fill: impl FnMut(usize, &mut [u32], &mut [u32]) + Send,
        mut predictions: Option<&mut Vec<u32>>,
    ) -> f64 {
        let Engine { part, pool, inputs, targets, argmax, .. } = self;
        let n = inputs.len();
        pool.install(|| {
            let mut sum = 0.0;
            for mb in 0..batches {
                fill(mb, inputs, targets);
                let want = predictions.is_some();
                let out = part.forward_with(
                    PartInput::Tokens(inputs),
                    Some(targets),
                    Mode::Eval,
                    want.then_some(argmax.as_mut_slice()),
                );
                sum += out.loss_sum.unwrap();
                if let Some(p) = predictions.as_deref_mut() {
                    p.extend_from_slice(argmax);
                }
            }
            sum / (batches * n) as f64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::kernels::cpu::testutil::allocations_on_this_thread;
    use crate::rng::{Purpose, Rng};

    /// Two blocks, T = 70 (two attention tiles), two microbatches, one thread,
    /// so all the work, gemm's included, happens on the pool's one thread.
    fn small(recompute: crate::config::Recompute, llama: bool) -> Config {
        let mut cfg = Config::default();
        if llama {
            cfg.model.family = "llama".into();
            cfg.model.n_kv_head = 1;
            cfg.model.intermediate_size = 48;
        }
        cfg.model.n_layer = 2;
        cfg.model.n_head = 2;
        cfg.model.n_embd = 32;
        cfg.model.vocab_size = 50;
        cfg.model.block_size = 70;
        cfg.train.micro_batch_size = 2;
        cfg.train.recompute = recompute;
        cfg.parallel.microbatches = 2;
        cfg.backend.threads = 1;
        cfg
    }

    fn fill(step: u64) -> impl FnMut(usize, &mut [u32], &mut [u32]) + Send {
        move |mb, inp, tgt| {
            let mut r = Rng::new(7, Purpose::Test, &[step, mb as u64]);
            for (i, t) in inp.iter_mut().zip(tgt.iter_mut()) {
                (*i, *t) = (r.below(50) as u32, r.below(50) as u32);
            }
        }
    }

    /// The claim of `model::part`: once the pools hold what a step needs, a
    /// training step (forward, backward, tied-gradient sum, norms, AdamW) and
    /// an evaluation allocate nothing. gemm's own per-call allocations are
    /// counted apart and allowed: gemm 0.19 cannot be given memory.
    #[test]
    fn steady_state_steps_allocate_nothing_of_ours() {
        for llama in [false, true] {
            for recompute in crate::config::Recompute::ALL {
                let mut engine = Engine::new(&small(recompute, llama));
                for s in 0..2 {
                    engine.step(1e-3, fill(s));
                    engine.evaluate(2, fill(100 + s), None);
                }
                let (ours0, gemm0) = engine.pool.install(allocations_on_this_thread);
                for s in 2..5 {
                    let stats = engine.step(1e-3, fill(s));
                    assert!(stats.loss.is_finite() && !stats.skipped);
                    engine.evaluate(2, fill(100 + s), None);
                }
                let (ours1, gemm1) = engine.pool.install(allocations_on_this_thread);
                assert_eq!(
                    ours1 - ours0,
                    0,
                    "recompute = {recompute}, llama = {llama}: our code allocated in the steady state"
                );
                // If gemm ever stops allocating, this says so and the claim can grow.
                assert!(gemm1 > gemm0, "gemm allocated nothing: update the note in model::part");
            }
        }
    }

    /// The same for two pipeline parts under a split backward (zero-bubble
    /// I then W), as stages run them: activations go forward, gradients come
    /// back, and each received buffer returns to its part's pool once used.
    #[test]
    fn pipeline_parts_with_split_backward_allocate_nothing_of_ours() {
        for llama in [false, true] {
            pipeline_parts_allocate_nothing(llama);
        }
    }

    fn pipeline_parts_allocate_nothing(llama: bool) {
        let cfg = small(crate::config::Recompute::None, llama);
        let gpt = cfg.arch();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        pool.install(|| {
            let first = PartSpec { layers: 0..1, embedding: true, head: false };
            let last = PartSpec { layers: 1..2, embedding: false, head: true };
            let mut p0 = ModelPart::new(gpt, first, 2, 3, false);
            let mut p1 = ModelPart::new(gpt, last, 2, 3, false);
            let n = 2 * gpt.block_size;
            let (mut inp, mut tgt) = (vec![0u32; n], vec![0u32; n]);
            // The test's own buffers, made before counting starts.
            let mut counts = Vec::with_capacity(6);
            let (mut acts0, mut acts1) = (Vec::with_capacity(2), Vec::with_capacity(2));
            for step in 0..5 {
                counts.push(allocations_on_this_thread());
                p0.zero_grads();
                p1.zero_grads();
                for mb in 0..2 {
                    fill(step)(mb, &mut inp, &mut tgt);
                    let o0 = p0.forward(PartInput::Tokens(&inp), None, Mode::Train { dloss: 0.01 });
                    let x = o0.output.expect("the first part passes its output on");
                    let o1 = p1.forward(PartInput::Activation(x), Some(&tgt), Mode::Train { dloss: 0.01 });
                    acts0.push(o0.acts.unwrap());
                    acts1.push(o1.acts.unwrap());
                }
                for (mb, (a0, a1)) in acts0.drain(..).zip(acts1.drain(..)).enumerate().rev() {
                    let dx = p1.backward_input(a1, None, mb);
                    assert!(p0.backward_input(a0, dx, mb).is_none());
                }
                for mb in 0..2 {
                    p1.backward_weight(mb);
                    p0.backward_weight(mb);
                }
                p0.combine_tied_grads(Some(&p1.wte_head_grad));
            }
            counts.push(allocations_on_this_thread());
            let ours: Vec<u64> = counts.windows(2).map(|w| w[1].0 - w[0].0).collect();
            assert_eq!(ours[2..], [0, 0, 0], "llama = {llama}: allocations of ours per step: {ours:?}");
        });
    }
}
