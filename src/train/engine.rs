//! One optimizer step on one process without a pipeline: microbatches run
//! forward and backward in order, gradients accumulate, the tied embedding's
//! shares are combined, the global norm decides clipping or a skip, and AdamW
//! updates. The actor runtime runs the same arithmetic spread over stages.

use crate::model::part::{Mode, PartInput};
use crate::model::{GptConfig, ModelPart, PartSpec};
use crate::optim::{self, AdamState, Hyper};

#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Mean loss over every token of the step.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// True when a non-finite loss or gradient stopped the update.
    pub skipped: bool,
}

pub struct Engine {
    pub part: ModelPart,
    pub adam: AdamState,
    pub hyper: Hyper,
    pub grad_clip: f64,
    pub microbatches: usize,
    pub pool: rayon::ThreadPool,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    norms: Vec<(usize, f64)>,
}

/// Compute threads: the configured count, or one per available core.
pub fn thread_count(configured: usize) -> usize {
    if configured > 0 {
        configured
    } else {
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    }
}

impl Engine {
    pub fn new(cfg: &crate::config::Config) -> Self {
        let gpt = GptConfig::from_config(cfg);
        let b = cfg.train.micro_batch_size;
        let part = ModelPart::new(gpt, PartSpec::whole(&gpt), b, cfg.train.seed, cfg.train.recompute);
        let adam = AdamState::new(&part);
        let threads = thread_count(cfg.backend.threads);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("compute-{i}"))
            .build()
            .expect("thread pool");
        let n = b * gpt.block_size;
        Engine {
            part,
            adam,
            hyper: Hyper::from_config(cfg),
            grad_clip: cfg.optim.grad_clip,
            microbatches: cfg.parallel.microbatches,
            pool,
            inputs: vec![0; n],
            targets: vec![0; n],
            norms: Vec::new(),
        }
    }

    /// Tokens per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.microbatches * self.inputs.len()
    }

    /// One optimizer step. `fill(mb, inputs, targets)` supplies microbatch `mb`.
    pub fn step(&mut self, lr: f64, mut fill: impl FnMut(usize, &mut [u32], &mut [u32]) + Send) -> StepStats {
        let dloss = 1.0 / self.tokens_per_step() as f32;
        let Engine { part, adam, hyper, grad_clip, microbatches, pool, inputs, targets, norms } = self;
        pool.install(|| {
            part.zero_grads();
            let mut loss_sum = 0.0f64;
            for mb in 0..*microbatches {
                fill(mb, inputs, targets);
                let out = part.forward(PartInput::Tokens(inputs), Some(targets), Mode::Train { dloss });
                loss_sum += out.loss_sum.expect("whole model computes the loss");
                part.backward(out.acts.expect("training keeps activations"), None);
            }
            part.combine_tied_grads(None);
            let loss = loss_sum * dloss as f64;
            optim::grad_sum_squares(part, norms);
            let grad_norm = optim::global_norm(norms);
            let skipped = !loss.is_finite() || !grad_norm.is_finite();
            if !skipped {
                let clip = optim::clip_coefficient(grad_norm, *grad_clip);
                adam.step(part, *hyper, lr, clip);
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
        let Engine { part, pool, inputs, targets, .. } = self;
        let n = inputs.len();
        let mut argmax = vec![0u32; n];
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
                    p.extend_from_slice(&argmax);
                }
            }
            sum / (batches * n) as f64
        })
    }
}
