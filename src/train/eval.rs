//! `pipewright eval`: the mean loss of saved weights over the first windows of
//! a token file, read sequentially (window i = tokens[i·T .. i·T + T + 1]).
//!
//! The model's shape comes from `--config` when given, else from the config a
//! run stored in the weights' metadata, else from the embedded default. Only
//! what evaluation uses is validated: the model's shape and the token format.

use super::engine::Engine;
use crate::config::Config;
use crate::data::{FileFormat, Sampler, TokenFile, TokenSource};
use crate::inspect::CONFIG_METADATA_KEY;
use crate::model::{io, GptConfig};
use anyhow::{bail, Result};
use std::path::Path;

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
    let weights = if weights.is_dir() { weights.join("model.safetensors") } else { weights.to_path_buf() };
    let w = io::load(&weights)?;
    let mut cfg = match (config, w.metadata.get(CONFIG_METADATA_KEY)) {
        (Some(path), _) => Config::load(Some(path), overrides)?,
        (None, Some(stored)) => {
            Config::parse(stored, &format!("{} (its stored config)", weights.display()), overrides)?
        }
        (None, None) => Config::load(None, overrides)?,
    };
    // One window per microbatch, so --batches counts windows.
    cfg.train.micro_batch_size = 1;
    cfg.parallel.microbatches = 1;
    cfg.validate_for_eval()?;
    let gpt = GptConfig::from_config(&cfg);
    w.check(&gpt)?;
    super::finite::check_finite(&w, "--weights")?;
    let format: FileFormat = cfg.data.format.parse().map_err(|e| anyhow::anyhow!("data.format: {e}"))?;
    let file = TokenFile::open_as(data, gpt.vocab_size, format)?;
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
