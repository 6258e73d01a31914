//! `pipewright eval`: the mean loss of saved weights over the first windows of
//! a token file, read sequentially (window i = tokens[i·T .. i·T + T + 1]).
//!
//! The model's shape comes from `--config` when given, else from the config a
//! run stored in the weights' metadata, else from the embedded default. Only
//! what evaluation uses is validated: the model's shape and the token format.

use super::engine::Engine;
use crate::config::{Config, DEFAULT_TOML};
use crate::data::{Sampler, TokenFile, TokenSource};
use crate::inspect::CONFIG_METADATA_KEY;
use crate::model::{hf, io, GptConfig};
use anyhow::{bail, Result};
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
    let folder = file.parent().unwrap_or(Path::new("."));
    let cfg = match (config, w.metadata.get(CONFIG_METADATA_KEY), hf::read_shape(folder)?) {
        (Some(path), _, _) => Config::load(Some(path), overrides)?,
        (None, Some(stored), _) => {
            Config::parse(stored, &format!("{} (its stored config)", file.display()), overrides)?
        }
        (None, None, Some(shape)) => {
            let mut all = shape.overrides();
            all.extend_from_slice(overrides);
            let origin = format!("{} on the embedded default", folder.join(hf::HF_CONFIG_FILE).display());
            Config::parse(DEFAULT_TOML, &origin, &all)?
        }
        (None, None, None) => Config::load(None, overrides)?,
    };
    cfg.validate_for_eval()?;
    // Before fit: it enumerates every tensor the shape has, a loop over n_layer.
    crate::limits::check_inference(&cfg)?;
    w.fit(&GptConfig::from_config(&cfg))?;
    Ok((cfg, w))
}

/// Mean loss of `weights` over the first `windows` windows of `data`;
/// `config` and `overrides` as `--config` and `--set` give them.
pub fn eval_file(
    config: Option<&Path>,
    overrides: &[String],
    weights: &Path,
    data: &Path,
    windows: usize,
) -> Result<f64> {
    if windows == 0 {
        bail!("--batches: 0: expected at least one window");
    }
    let (mut cfg, w) = load_model(config, overrides, weights)?;
    // One window per microbatch, so --batches counts windows.
    cfg.train.micro_batch_size = 1;
    cfg.parallel.microbatches = 1;
    let gpt = GptConfig::from_config(&cfg);
    super::finite::check_finite(&w, "--weights")?;
    let file = TokenFile::open_as(data, gpt.vocab_size, cfg.data.format)?;
    let mut sampler = Sampler::eval(TokenSource::from(file), gpt.block_size, 1)?;
    if (windows as u64) > sampler.n_windows() {
        bail!(
            "{}: --batches {windows}: the file holds only {} windows of {} tokens",
            data.display(),
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
    Ok(loss)
}
