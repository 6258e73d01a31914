//! `pipewright eval`: the mean loss of saved weights over the first windows of
//! a token file, read sequentially (window i = tokens[i·T .. i·T + T + 1]).
//!
//! The model comes from `--config` when given, else from the weights by
//! `hf::weights_model`'s rule (a `config.json` beside them and the config a
//! run stored in their metadata; both, they must agree), else from the
//! embedded default. Only what evaluation uses is validated: the model and
//! the token format.

use super::engine::Engine;
use crate::config::{Config, DEFAULT_TOML};
use crate::data::{Sampler, TokenFile, TokenSource};
use crate::model::io::CONFIG_METADATA_KEY;
use crate::model::{hf, io};
use anyhow::{anyhow, bail, Result};
use std::path::Path;

/// Saved weights and the config that gives their shape: `config` (with
/// `overrides`) when given, else the config a run stored in the weights,
/// else a Hugging Face `config.json` beside them (on the embedded default),
/// else the embedded default. The model's part of the config is validated,
/// a longer position table cropped to block_size and the tensors checked.
pub fn load_model(
    config: Option<&Path>,
    overrides: &[String],
    weights: &Path,
) -> Result<(Config, io::LoadedWeights)> {
    let file = io::weights_file(weights);
    let mut w = io::load(&file)?;
    let stored = w.metadata.get(CONFIG_METADATA_KEY);
    // The one rule (hf::weights_model): config.json and a stored config must agree when both are there.
    let model = hf::weights_model(&file, stored.map(String::as_str))?;
    let cfg = match (config, stored, model) {
        (Some(path), _, _) => Config::load(Some(path), overrides)?,
        (None, Some(stored), _) => {
            Config::parse(stored, &format!("{} (its stored config)", file.display()), overrides)?
        }
        (None, None, Some(m)) => {
            let mut all = m.section.overrides();
            all.extend_from_slice(overrides);
            Config::parse(DEFAULT_TOML, &format!("{} on the embedded default", m.origin), &all)?
        }
        (None, None, None) => Config::load(None, overrides)?,
    };
    cfg.validate_for_eval()?;
    // Before fit: it enumerates every tensor the shape has, a loop over n_layer.
    crate::limits::check_inference(&cfg)?;
    w.fit(&cfg.arch())?;
    Ok((cfg, w))
}

/// How much of the file `eval` reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Amount {
    /// `--batches N`: N batches of `train.micro_batch_size` windows, the unit
    /// of `train.eval_batches`, so a run's val loss is `eval` of its weights
    /// on its val file with its own config.
    Batches(usize),
    /// The config's `train.eval_batches` batches (`eval` without a count).
    ConfigBatches,
    /// `--windows N`: N windows.
    Windows(usize),
}

impl Amount {
    /// Windows to read under `cfg`, or why the count is refused (naming its flag).
    fn windows(self, cfg: &Config) -> Result<usize> {
        let b = cfg.train.micro_batch_size;
        let (flag, n, per) = match self {
            Amount::Windows(n) => ("--windows", n, 1),
            Amount::Batches(n) => ("--batches", n, b),
            Amount::ConfigBatches => ("train.eval_batches", cfg.train.eval_batches, b),
        };
        if n == 0 {
            bail!("{flag}: 0: expected at least one");
        }
        if per == 0 {
            bail!("train.micro_batch_size: 0: a batch needs at least one window");
        }
        n.checked_mul(per).ok_or_else(|| anyhow!("{flag}: {n} batches of {per} windows is too many to count"))
    }

    fn describe(self, windows: usize) -> String {
        match self {
            Amount::Windows(_) => format!("--windows {windows}"),
            Amount::Batches(n) => format!("--batches {n}: {windows} windows"),
            Amount::ConfigBatches => format!("train.eval_batches: {windows} windows"),
        }
    }
}

/// Mean loss of `weights` over the first windows of `data` (`amount` says how
/// many) and the number of windows read; `config` and `overrides` as
/// `--config` and `--set` give them.
pub fn eval_file(
    config: Option<&Path>,
    overrides: &[String],
    weights: &Path,
    data: &Path,
    amount: Amount,
) -> Result<(f64, usize)> {
    let (cfg, w) = load_model(config, overrides, weights)?;
    let file = TokenFile::open_as(data, cfg.model.vocab_size, cfg.data.format)?;
    eval_source(cfg, w, TokenSource::from(file), weights, data, amount)
}

/// [`eval_file`] over a text file (any format `prepare` reads; its
/// documents joined by the tokenizer's end-of-text token), tokenized with
/// `tokenizer`, else the weights folder's tokenizer.json, else the built-in
/// tokenizer of the model's vocabulary size.
pub fn eval_text(
    config: Option<&Path>,
    overrides: &[String],
    weights: &Path,
    text: &Path,
    tokenizer: Option<crate::data::Tokenizer>,
    amount: Amount,
) -> Result<(f64, usize)> {
    let (cfg, w) = load_model(config, overrides, weights)?;
    let tok = crate::generate::tokenizer_of(tokenizer, weights, cfg.model.vocab_size)?;
    let files = [text.to_path_buf()];
    let read = crate::data::read::ReadSettings::default();
    let mut tokens: Vec<u32> = Vec::new();
    let mut first_error = None;
    crate::data::read::read_file(&files, 0, &read, &mut |d| {
        let place = d.place(&files);
        match d.text(&read.text_field) {
            Ok(t) => {
                if !tokens.is_empty() {
                    tokens.extend(tok.end_of_text());
                }
                tokens.extend(tok.encode(&t)?);
            }
            Err(bad) => {
                first_error.get_or_insert(anyhow!("{place}: {}", bad.describe(&read.text_field)));
            }
        }
        Ok(())
    })?;
    if let Some(e) = first_error {
        return Err(e);
    }
    let name = text.display().to_string();
    let source = TokenSource::from_vec(name, tokens, cfg.model.vocab_size)?;
    eval_source(cfg, w, source, weights, text, amount)
}

/// The EMA of the weights in a run folder (`optim.ema_decay`): its
/// `model.ema.safetensors`, or the index of its shards. `eval --ema` and
/// `generate` take it like any weights file.
pub fn ema_weights(run_dir: &Path) -> Result<std::path::PathBuf> {
    if !run_dir.is_dir() {
        bail!("{}: --ema takes a run folder (it reads the folder's {})", run_dir.display(), io::EMA_FILE);
    }
    let index = run_dir.join(format!("{}.safetensors.index.json", io::EMA_STEM));
    let file = run_dir.join(io::EMA_FILE);
    match (file.is_file(), index.is_file()) {
        (true, _) => Ok(file),
        (false, true) => Ok(index),
        (false, false) => bail!(
            "{}: no {}: the run kept no EMA of its weights (train with optim.ema_decay > 0)",
            run_dir.display(),
            io::EMA_FILE
        ),
    }
}

/// The val loss a run reports (the mean over `train.eval_batches` batches of
/// `val`'s first windows, as `eval` of a run's weights with its own config
/// gives it), for weights held in memory by name: the run's EMA at its end.
pub fn eval_tensors(
    cfg: &Config,
    tensors: &std::collections::BTreeMap<String, (&[usize], &[f32])>,
    val: std::sync::Arc<TokenSource>,
) -> Result<f64> {
    let mut cfg = cfg.clone();
    let windows = cfg.train.eval_batches * cfg.train.micro_batch_size;
    // One window per microbatch: batches of equal size have the windows' mean.
    cfg.train.micro_batch_size = 1;
    cfg.parallel.microbatches = 1;
    let mut engine = Engine::new(&cfg);
    for p in &mut engine.part.params {
        let (_, data) = tensors.get(&p.name).ok_or_else(|| anyhow!("no tensor `{}` to evaluate", p.name))?;
        p.data.copy_from_slice(data);
    }
    let mut sampler = Sampler::eval(val, cfg.model.block_size, 1)?;
    Ok(engine.evaluate(windows, |mb, inp, tgt| sampler.fill(mb as u64, inp, tgt), None))
}

fn eval_source(
    mut cfg: Config,
    w: io::LoadedWeights,
    source: TokenSource,
    weights: &Path,
    data: &Path,
    amount: Amount,
) -> Result<(f64, usize)> {
    let mut windows = amount.windows(&cfg)?;
    let batch = cfg.train.micro_batch_size;
    // One window per microbatch: batches of equal size have the windows' mean.
    cfg.train.micro_batch_size = 1;
    cfg.parallel.microbatches = 1;
    let gpt = cfg.arch();
    super::finite::check_finite(&w, "--weights")?;
    let mut sampler = Sampler::eval(source, gpt.block_size, 1)?;
    let held = usize::try_from(sampler.n_windows()).unwrap_or(usize::MAX);
    if amount == Amount::ConfigBatches && windows > held && held >= batch {
        // As train resolves train.eval_batches: all the whole batches the file holds.
        let fit = held / batch * batch;
        tracing::info!(
            "train.eval_batches: {} → {} (all that {} holds)",
            windows / batch,
            fit / batch,
            data.display()
        );
        windows = fit;
    }
    if windows > held {
        bail!(
            "{}: {}, but the file holds only {} windows of {} tokens",
            data.display(),
            amount.describe(windows),
            sampler.n_windows(),
            gpt.block_size + 1
        );
    }
    let mut engine = Engine::new(&cfg);
    w.assign(&mut engine.part)?;
    let loss = engine.evaluate(windows, |mb, inp, tgt| sampler.fill(mb as u64, inp, tgt), None);
    if !loss.is_finite() {
        bail!(
            "{}: the mean loss over {windows} windows is {loss}: the weights overflow on this data",
            weights.display()
        );
    }
    Ok((loss, windows))
}
