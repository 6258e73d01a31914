//! `pipewright eval`: the mean loss of saved weights over the first windows of
//! a token file, read sequentially (window i = tokens[i·T .. i·T + T + 1]).

use super::engine::Engine;
use crate::config::Config;
use crate::data::{Sampler, TokenFile, TokenSource};
use crate::model::{io, GptConfig};
use anyhow::{bail, Result};
use std::path::Path;

pub fn eval_file(cfg: &Config, weights: &Path, data: &Path, windows: usize) -> Result<f64> {
    if windows == 0 {
        bail!("--batches: 0: expected at least one window");
    }
    let mut cfg = cfg.clone();
    // One window per microbatch, so --batches counts windows.
    cfg.train.micro_batch_size = 1;
    cfg.parallel.microbatches = 1;
    cfg.validate()?;
    let gpt = GptConfig::from_config(&cfg);
    let weights = if weights.is_dir() { weights.join("model.safetensors") } else { weights.to_path_buf() };
    let w = io::load(&weights)?;
    w.check(&gpt)?;
    let file = TokenFile::open(data, gpt.vocab_size)?;
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
    Ok(engine.evaluate(windows, |mb, inp, tgt| sampler.fill(mb as u64, inp, tgt), None))
}
