//! `pipewright generate`: text from saved weights, one token at a time.
//!
//! Owns the sampling rule (greedy at temperature 0, else softmax of
//! logits / temperature over the top k) and the loop that feeds each new
//! token back. The model runs whole windows of block_size tokens without a
//! key-value cache: causal attention makes the logits at position i depend
//! only on tokens 0..=i, so the padding after the context changes nothing.
//! Never trains and never writes files.

use crate::data::Tokenizer;
use crate::kernels::cpu::crossentropy::first_argmax;
use crate::model::part::{Mode, PartInput};
use crate::model::{Arch, ModelPart, PartSpec};
use crate::rng::{Purpose, Rng};

/// How each next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 picks the most likely token (the first on a tie); above 0 samples
    /// from softmax(logits / temperature).
    pub temperature: f64,
    /// Sample only among the k most likely tokens (None: all).
    pub top_k: Option<usize>,
    /// Draw n of the stream keyed by this seed picks token n, so a seed
    /// gives the same text on any machine.
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("--temperature: {0}: expected a finite number >= 0")]
    Temperature(f64),
    #[error("--top-k: 0: expected at least 1")]
    TopK,
    #[error(
        "--prompt: token {token} (byte offset {offset}) is outside the model's vocabulary of {vocab} \
         (model.vocab_size); is --tokenizer the one the model was trained with?"
    )]
    OutOfVocabulary { token: u32, offset: usize, vocab: usize },
    #[error(
        "--temperature: {0}: backend.kind = \"cuda\" generates greedily only (the GPU forward hands back \
         each position's most likely token, not its logits); pass --temperature 0, or --set \
         backend.kind=\"cpu\" to sample"
    )]
    GpuSampling(f64),
    #[error(
        "model.vocab_size = {0}: the weights' folder holds no tokenizer.json, and no built-in tokenizer \
         has that size (bytes: up to 256, gpt2: 50257 to 50304); pass --tokenizer with the model's own \
         tokenizer.json or its folder"
    )]
    NoTokenizer(usize),
    /// Whatever read the text stopped reading (`generate | head`): not a
    /// failure of generation, and the command ends quietly.
    #[error("the output was closed before the text was done")]
    OutputClosed,
}

/// A write error, with a reader that went away told apart.
fn output_error(e: std::io::Error) -> anyhow::Error {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe => GenerateError::OutputClosed.into(),
        _ => anyhow::Error::new(e).context("cannot write the generated text"),
    }
}

impl Sampling {
    pub fn check(&self) -> Result<(), GenerateError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(GenerateError::Temperature(self.temperature));
        }
        if self.top_k == Some(0) {
            return Err(GenerateError::TopK);
        }
        Ok(())
    }

    /// The probability of each token under this rule (greedy: 1 on the argmax).
    pub fn probabilities(&self, logits: &[f32]) -> Vec<f64> {
        let mut p = vec![0.0; logits.len()];
        if self.temperature == 0.0 {
            p[first_argmax(logits)] = 1.0;
            return p;
        }
        let kept = top_k_indices(logits, self.top_k.unwrap_or(logits.len()));
        let max = logits[kept[0]] as f64;
        // Summed in index order over the kept set, so the bits are fixed.
        let mut in_order = kept.clone();
        in_order.sort_unstable();
        let mut z = 0.0;
        for &i in &in_order {
            let e = ((logits[i] as f64 - max) / self.temperature).exp();
            p[i] = e;
            z += e;
        }
        for &i in &in_order {
            p[i] /= z;
        }
        p
    }

    /// The token for position `n` of the generated text.
    pub fn pick(&self, logits: &[f32], n: u64) -> u32 {
        if self.temperature == 0.0 {
            return first_argmax(logits) as u32;
        }
        let p = self.probabilities(logits);
        let u = Rng::new(self.seed, Purpose::Sample, &[]).at(n).next_f64();
        // Inverse CDF in index order; the last token with mass takes what rounding leaves.
        let mut acc = 0.0;
        let mut last = 0;
        for (i, &pi) in p.iter().enumerate() {
            if pi > 0.0 {
                acc += pi;
                last = i;
                if u < acc {
                    return i as u32;
                }
            }
        }
        last as u32
    }
}

/// The k largest logits' indices, largest first; equal values keep index order.
fn top_k_indices(logits: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.truncate(k.clamp(1, logits.len()));
    idx
}

/// The built-in tokenizer a model of this vocabulary was trained with
/// (when its folder holds no tokenizer.json).
pub fn tokenizer_for(vocab_size: usize) -> Result<Tokenizer, GenerateError> {
    Tokenizer::for_vocab(vocab_size).ok_or(GenerateError::NoTokenizer(vocab_size))
}

/// The tokenizer `generate` and `eval` use for the weights at `weights`:
/// the one asked for, else the weights' folder's own tokenizer.json, else
/// the built-in one of the model's vocabulary size. Refused, naming both
/// sizes, when its ids reach past the model's vocabulary.
pub fn tokenizer_of(
    asked: Option<Tokenizer>,
    weights: &std::path::Path,
    vocab_size: usize,
) -> anyhow::Result<Tokenizer> {
    let file = crate::model::io::weights_file(weights);
    let folder = file.parent().unwrap_or(std::path::Path::new("."));
    let tok = match asked {
        Some(t) => t,
        None => match Tokenizer::beside_weights(folder)? {
            Some(t) => t,
            None => tokenizer_for(vocab_size)?,
        },
    };
    tok.check_covers(vocab_size)?;
    Ok(tok)
}

/// A whole model on the CPU, one sequence at a time.
pub struct Generator {
    part: ModelPart,
    pool: rayon::ThreadPool,
    window: Vec<u32>,
    targets: Vec<u32>,
}

impl Generator {
    /// `part` must be a whole model (embedding and head) built for one sequence.
    pub fn new(part: ModelPart, threads: usize) -> Self {
        assert!(
            part.spec.embedding && part.spec.head && part.b == 1,
            "generation needs the whole model, b = 1"
        );
        let t = part.cfg.block_size;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("generate-{i}"))
            .build()
            .expect("thread pool");
        Generator { part, pool, window: vec![0; t], targets: vec![0; t] }
    }

    /// A model with `cfg`'s shape and its seeded initial weights.
    pub fn with_init(cfg: Arch, seed: u64, threads: usize) -> Self {
        Generator::new(ModelPart::new(cfg, PartSpec::whole(&cfg), 1, seed, false), threads)
    }

    pub fn part_mut(&mut self) -> &mut ModelPart {
        &mut self.part
    }

    /// The logits (V) that follow `context`, of which the last block_size
    /// tokens are seen (nanoGPT's crop).
    pub fn next_logits(&mut self, context: &[u32]) -> &[f32] {
        assert!(!context.is_empty(), "generation needs at least one token of context");
        let seen = crop_into(&mut self.window, context);
        let Generator { part, pool, window, targets } = self;
        pool.install(|| part.forward(PartInput::Tokens(window), Some(targets), Mode::Eval));
        let v = self.part.cfg.vocab_size;
        &self.part.logits()[(seen - 1) * v..seen * v]
    }

    /// Appends `max_new` tokens to `prompt`, calling `on_token` with each as it comes.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        mut on_token: impl FnMut(u32),
    ) -> Vec<u32> {
        let mut tokens = prompt.to_vec();
        for n in 0..max_new {
            let next = sampling.pick(self.next_logits(&tokens), n as u64);
            tokens.push(next);
            on_token(next);
        }
        tokens.split_off(prompt.len())
    }
}

/// The prompt's tokens, each checked against the vocabulary. An empty prompt
/// starts from GPT-2's end-of-text token, or a newline for bytes.
pub fn encode_prompt(tok: &Tokenizer, prompt: &str, vocab: usize) -> anyhow::Result<Vec<u32>> {
    if prompt.is_empty() {
        return Ok(vec![tok.end_of_text().unwrap_or(b'\n' as u32)]);
    }
    let tokens = tok.encode(prompt)?;
    let mut stream = tok.stream();
    let mut offset = 0;
    for &t in &tokens {
        if t as usize >= vocab {
            return Err(GenerateError::OutOfVocabulary { token: t, offset, vocab }.into());
        }
        offset += stream.step(t).len();
    }
    Ok(tokens)
}

/// What `pipewright generate` was asked for.
pub struct GenerateRequest<'a> {
    pub config: Option<&'a std::path::Path>,
    pub overrides: &'a [String],
    pub weights: &'a std::path::Path,
    /// None: the weights folder's tokenizer.json, else chosen from model.vocab_size.
    pub tokenizer: Option<Tokenizer>,
    pub prompt: &'a str,
    pub max_new_tokens: usize,
    pub sampling: Sampling,
}

/// Loads the weights, writes the prompt and then each new token's bytes to
/// `out` as it comes (flushed), and returns the new tokens.
pub fn run(req: &GenerateRequest, out: &mut dyn std::io::Write) -> anyhow::Result<Vec<u32>> {
    req.sampling.check()?;
    let (cfg, weights) = crate::train::eval::load_model(req.config, req.overrides, req.weights)?;
    let gpt = cfg.arch();
    let tok = tokenizer_of(req.tokenizer.clone(), req.weights, gpt.vocab_size)?;
    let prompt = encode_prompt(&tok, req.prompt, gpt.vocab_size)?;
    // The sums are taken over the slices the model was trained with (one
    // rank: generation gains nothing from splitting).
    let slices = crate::model::tp::TpShape::of(1, cfg.parallel.tp_slices);
    let threads = crate::host::thread_count(cfg.backend.threads);
    let mut part =
        ModelPart::new(gpt, PartSpec::whole(&gpt), 1, cfg.train.seed, false).with_tp(slices, threads);
    weights.assign(&mut part)?;
    // The GPUs of a cuda config (none otherwise); a build without the
    // feature says so here, before anything is printed.
    let on_gpu = !crate::model::gpu::check_backend(cfg.backend.kind, &cfg.backend.devices)?.is_empty();
    let greedy = req.sampling.temperature == 0.0 || req.sampling.top_k == Some(1);
    if on_gpu && !greedy {
        return Err(GenerateError::GpuSampling(req.sampling.temperature).into());
    }
    out.write_all(req.prompt.as_bytes()).and_then(|_| out.flush()).map_err(output_error)?;
    let mut failed = None;
    let mut text = tok.stream();
    let mut print = |t: u32| {
        if failed.is_none() {
            failed = out.write_all(&text.step(t)).and_then(|_| out.flush()).err();
        }
    };
    let new = if on_gpu {
        gpu_greedy(&cfg, &part, &prompt, req.max_new_tokens, &mut print)?
    } else {
        let threads = crate::host::thread_count(cfg.backend.threads);
        Generator::new(part, threads).generate(&prompt, req.max_new_tokens, &req.sampling, print)
    };
    if let Some(e) = failed {
        return Err(output_error(e));
    }
    out.write_all(&text.finish()).map_err(output_error)?;
    writeln!(out).map_err(output_error)?;
    Ok(new)
}

/// Puts the last `window.len()` (block_size) tokens of `context` at the start
/// of `window`, zeros after them (nanoGPT's crop; causal attention never reads
/// the padding); returns how many were put.
fn crop_into(window: &mut [u32], context: &[u32]) -> usize {
    let seen = &context[context.len().saturating_sub(window.len())..];
    window.fill(0);
    window[..seen.len()].copy_from_slice(seen);
    seen.len()
}

/// Greedy generation on the config's first GPU: the whole model in one GPU
/// part, each new token the argmax of a forward over the window (the same
/// window and crop as the CPU's `Generator`). Not run on a GPU yet.
#[cfg(feature = "cuda")]
fn gpu_greedy(
    cfg: &crate::config::Config,
    part: &ModelPart,
    prompt: &[u32],
    max_new: usize,
    on_token: &mut dyn FnMut(u32),
) -> anyhow::Result<Vec<u32>> {
    use crate::kernels::cuda::{Bf16, Gpu};
    use crate::model::gpu::model::GpuModel;
    let ordinal = cfg.backend.devices.first().copied().unwrap_or(0);
    let gpu = Gpu::new(ordinal).map_err(|e| anyhow::anyhow!("backend.devices: GPU {ordinal}: {e}"))?;
    let weights: Vec<&[f32]> = part.params.iter().map(|p| p.data.as_slice()).collect();
    // The storage type the trainer would use (actors/stage/backend.rs chooses the same way).
    if cfg.backend.dtype == crate::config::Dtype::F32 {
        greedy_on(GpuModel::<f32>::new(&gpu, part.cfg, 1, &weights)?, prompt, max_new, on_token)
    } else {
        greedy_on(GpuModel::<Bf16>::new(&gpu, part.cfg, 1, &weights)?, prompt, max_new, on_token)
    }
}

#[cfg(feature = "cuda")]
fn greedy_on<X: crate::kernels::cuda::Elem>(
    mut model: crate::model::gpu::model::GpuModel<X>,
    prompt: &[u32],
    max_new: usize,
    on_token: &mut dyn FnMut(u32),
) -> anyhow::Result<Vec<u32>> {
    let t = model.cfg.block_size;
    let (mut window, mut argmax) = (vec![0u32; t], vec![0u32; t]);
    let mut tokens = prompt.to_vec();
    for _ in 0..max_new {
        let seen = crop_into(&mut window, &tokens);
        model.predict(&window, &mut argmax)?;
        let next = argmax[seen - 1];
        tokens.push(next);
        on_token(next);
    }
    Ok(tokens.split_off(prompt.len()))
}

#[cfg(not(feature = "cuda"))]
fn gpu_greedy(
    _: &crate::config::Config,
    _: &ModelPart,
    _: &[u32],
    _: usize,
    _: &mut dyn FnMut(u32),
) -> anyhow::Result<Vec<u32>> {
    // check_backend refuses a cuda config in a build without the feature first.
    Err(crate::kernels::BackendError::NotBuilt.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Arch {
        Arch::gpt2(2, 2, 16, 40, 12)
    }

    const GREEDY: Sampling = Sampling { temperature: 0.0, top_k: None, seed: 0 };

    /// Teacher forcing checks greedy decoding: feeding prompt + generated text
    /// through the evaluation path, whose argmax comes from the loss kernel,
    /// must predict each generated token at the position before it.
    /// GPT-2's initial weights (std 0.02) are too small to tell tokens apart:
    /// scaled up, the model's choices depend on the context.
    fn lively(cfg: Arch, seed: u64) -> ModelPart {
        let mut part = ModelPart::new(cfg, PartSpec::whole(&cfg), 1, seed, false);
        for p in &mut part.params {
            p.data.iter_mut().for_each(|x| *x *= 40.0);
        }
        part
    }

    #[test]
    fn greedy_tokens_are_the_argmax_of_the_models_own_forward() {
        let cfg = tiny();
        let mut g = Generator::new(lively(cfg, 5), 1);
        let prompt = [3, 17, 8];
        let out = g.generate(&prompt, 9, &GREEDY, |_| {});
        assert_eq!(out.len(), 9);
        let all: Vec<u32> = prompt.iter().chain(&out).copied().collect();
        assert_eq!(all.len(), cfg.block_size);

        let mut part = lively(cfg, 5);
        let mut argmax = vec![0u32; cfg.block_size];
        part.forward_with(PartInput::Tokens(&all), Some(&all), Mode::Eval, Some(&mut argmax));
        assert_eq!(&argmax[prompt.len() - 1..all.len() - 1], &out[..]);
        // A random model does not repeat one token: the check compares something.
        assert!(out.iter().any(|&t| t != out[0]), "{out:?}");
    }

    #[test]
    fn context_longer_than_block_size_keeps_its_last_block_size_tokens() {
        let cfg = tiny();
        let mut g = Generator::with_init(cfg, 5, 1);
        let long: Vec<u32> = (0..30).map(|i| (i * 7 % 40) as u32).collect();
        let a = g.next_logits(&long).to_vec();
        let b = g.next_logits(&long[30 - cfg.block_size..]).to_vec();
        assert_eq!(a, b);
        let c = g.next_logits(&long[29 - cfg.block_size..29]).to_vec();
        assert_ne!(a, c);
    }

    #[test]
    fn a_seed_gives_the_same_text_and_another_seed_other_text() {
        let cfg = tiny();
        let mut g = Generator::with_init(cfg, 9, 2);
        let s = |seed| Sampling { temperature: 1.5, top_k: None, seed };
        let a = g.generate(&[1], 10, &s(7), |_| {});
        let b = g.generate(&[1], 10, &s(7), |_| {});
        let c = g.generate(&[1], 10, &s(8), |_| {});
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn top_one_sampling_is_greedy() {
        let cfg = tiny();
        let mut g = Generator::with_init(cfg, 11, 1);
        let top1 = Sampling { temperature: 2.0, top_k: Some(1), seed: 3 };
        let mut streamed = vec![];
        let a = g.generate(&[4, 4], 8, &top1, |t| streamed.push(t));
        assert_eq!(a, g.generate(&[4, 4], 8, &GREEDY, |_| {}));
        assert_eq!(a, streamed);
    }

    #[test]
    fn probabilities_are_the_softmax_of_logits_over_temperature_within_the_top_k() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let s = Sampling { temperature: 0.5, top_k: Some(3), seed: 0 };
        let p = s.probabilities(&logits);
        // Kept: 3.0 (index 1), 3.0 (index 3), 2.0 (index 2).
        let e = |x: f64| (x / 0.5).exp();
        let z = e(3.0) * 2.0 + e(2.0);
        let want = [0.0, e(3.0) / z, e(2.0) / z, e(3.0) / z, 0.0];
        for (g, w) in p.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{p:?} against {want:?}");
        }
        let all = Sampling { top_k: None, ..s }.probabilities(&logits);
        assert!(all.iter().all(|&x| x > 0.0));
        assert_eq!(GREEDY.probabilities(&logits), [0.0, 1.0, 0.0, 0.0, 0.0]);
    }

    /// Over many draws each token's share approaches its probability.
    #[test]
    fn sampled_tokens_follow_the_probabilities() {
        let logits = [0.0f32, 1.0, 2.0];
        let s = Sampling { temperature: 1.0, top_k: None, seed: 42 };
        let p = s.probabilities(&logits);
        let draws = 20_000;
        let mut count = [0usize; 3];
        for n in 0..draws {
            count[s.pick(&logits, n) as usize] += 1;
        }
        for i in 0..3 {
            let share = count[i] as f64 / draws as f64;
            assert!((share - p[i]).abs() < 0.02, "token {i}: {share} against {}", p[i]);
        }
    }

    #[test]
    fn bad_sampling_options_are_refused_naming_the_flag() {
        let t = Sampling { temperature: -1.0, ..GREEDY }.check().unwrap_err();
        assert!(t.to_string().contains("--temperature"), "{t}");
        let k = Sampling { top_k: Some(0), ..GREEDY }.check().unwrap_err();
        assert!(k.to_string().contains("--top-k"), "{k}");
    }

    #[test]
    fn the_tokenizer_follows_the_vocabulary_size() {
        assert_eq!(tokenizer_for(256).unwrap(), Tokenizer::Bytes);
        assert_eq!(tokenizer_for(50_304).unwrap(), Tokenizer::Gpt2);
        assert!(tokenizer_for(1000).unwrap_err().to_string().contains("--tokenizer"));
        // Llama 3's vocabulary is not GPT-2's: never decoded through it.
        assert!(tokenizer_for(128_256).unwrap_err().to_string().contains("tokenizer.json"));
        let err = encode_prompt(&Tokenizer::Bytes, "ab", 98).unwrap_err();
        assert!(err.to_string().contains("token 98 (byte offset 1)"), "{err}");
        assert_eq!(encode_prompt(&Tokenizer::Gpt2, "", 50_257).unwrap(), [50_256]);
    }
}
