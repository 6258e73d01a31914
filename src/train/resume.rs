//! Where a resumed run starts: the config it takes when none is named (the
//! run's own), the newest complete checkpoint that verifies (a damaged newer
//! one is named, set aside and never deleted), and what the resumed settings
//! change compared with the checkpoint's.
//!
//! Settings that only decide how the work is laid out (pipeline split,
//! backend threads, tracing, checkpoint policy, …) keep the bits of an
//! uninterrupted run; any other change is listed key by key with a warning
//! that they will not match.

use crate::checkpoint::{self, Loaded};
use crate::config::Config;
use crate::optim::LrSchedule;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The config a resume of the run in `dir` takes when no `--config` names
/// one: the run's own config.toml, so a resume needs no flags it already
/// had. Anything at that path counts as the run's own (a FIFO or a symlink
/// loop is then refused by the config reader, naming it): skipped as
/// absent, the resume would run on the embedded default. None: the run left
/// no config.toml.
pub fn own_config(dir: &Path) -> Result<Option<PathBuf>> {
    let own = dir.join("config.toml");
    let present = crate::fsutil::is_present(&own)
        .with_context(|| format!("{}: cannot look at the run's own config", own.display()))?;
    if !present {
        return Ok(None);
    }
    tracing::info!("config: {} (the run's own; --config to use another)", own.display());
    Ok(Some(own))
}

/// The checkpoint a resume of the run in `dir` starts from; None (said aloud)
/// when there is none.
pub fn find_resume_point(dir: &Path, cfg: &Config) -> Result<Option<Loaded>> {
    let root = checkpoint::checkpoints_dir(dir);
    let (done, incomplete) = checkpoint::list(&root)?;
    for p in &incomplete {
        tracing::warn!("ignoring {} (not a complete checkpoint)", p.display());
    }
    if done.is_empty() {
        tracing::info!("no complete checkpoint in {}: starting from step 0", root.display());
        return Ok(None);
    }
    let t = std::time::Instant::now();
    let (loaded, damaged) = checkpoint::newest_verified(&root)?;
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let Some(loaded) = loaded else {
        let why: Vec<String> = damaged.iter().map(|(_, e)| format!("  {e}")).collect();
        bail!("no checkpoint in {} verifies (all are left as they are):\n{}", root.display(), why.join("\n"));
    };
    let path = &loaded.dir;
    let step = loaded.state.step;
    let state_json = path.join("state.json");
    let theirs = Config::parse(&loaded.state.config, &state_json.display().to_string(), &[])?;
    if theirs.model != cfg.model {
        bail!(
            "{}: the checkpoint's [model] differs from this config's (a resume keeps the model):\n{}",
            state_json.display(),
            changed_keys(&theirs, cfg, |k| k.starts_with("model.")).join("\n")
        );
    }
    loaded.weights.check(&cfg.arch())?;
    if (step as usize) > cfg.train.steps {
        bail!("{}: step {step} is past train.steps ({})", path.display(), cfg.train.steps);
    }
    // An EMA begun now would average only the steps from here: not the run's EMA.
    if cfg.optim.ema_decay > 0.0 && loaded.ema.is_none() {
        bail!(
            "{}: the checkpoint holds no EMA of the weights (its run kept none), but optim.ema_decay = {} \
             keeps one: resume with optim.ema_decay = 0, or start a new run",
            path.display(),
            cfg.optim.ema_decay
        );
    }
    for (dir, e) in &damaged {
        let kept = checkpoint::set_aside(dir)?;
        tracing::warn!(
            "warning: checkpoint {} is damaged ({e}); falling back to the older {} — the damaged one is \
             kept as {} (never deleted)",
            dir.display(),
            path.display(),
            kept.display()
        );
    }
    if loaded.state.config_hash != cfg.hash() {
        warn_changes(&theirs, cfg, &loaded.state);
    }
    tracing::info!("resuming from {} (step {step}; read and verified in {load_ms:.1} ms)", path.display());
    Ok(Some(loaded))
}

/// For a resume that took the run's own config.toml: the layer split it
/// recorded has one entry per stage of the run that wrote it, so at another
/// pp or chunks count it no longer fits; it is dropped for the even default,
/// and the returned note says so. (A split given on the command line is the
/// user's and is checked like any other, so a misfit stays an error there.)
/// A split that no longer sums to model.n_layer goes too, so that a changed
/// model is refused for what it is, against the checkpoint's [model].
pub fn refit_stored_split(cfg: &mut Config) -> Option<String> {
    let stored = &cfg.parallel.layers_per_stage;
    if stored.is_empty() {
        return None;
    }
    let mut even = cfg.clone();
    even.parallel.layers_per_stage.clear();
    // A layout that fails even so is refused later, with its own message.
    let stages = crate::actors::Layout::from_config(&even).ok()?.n_stages();
    let layers = stored.iter().sum::<usize>();
    if stored.len() == stages && layers == cfg.model.n_layer {
        return None;
    }
    let note = format!(
        "parallel.layers_per_stage: the run's config.toml recorded {stored:?} ({layers} layers over {} \
         stages); this resume has {} layers over {stages} (pp × chunks = {} × {}), so the even split is \
         used (--set parallel.layers_per_stage to choose another)",
        stored.len(),
        cfg.model.n_layer,
        even.parallel.pp,
        stages / even.parallel.pp.max(1)
    );
    cfg.parallel.layers_per_stage.clear();
    Some(note)
}

/// Every leaf of the config as `section.key` → its TOML text.
fn flatten(cfg: &Config) -> BTreeMap<String, String> {
    let table: toml::Table = toml::from_str(&cfg.to_toml_string()).expect("a config's own TOML parses");
    let mut out = BTreeMap::new();
    for (section, v) in table {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    out.insert(format!("{section}.{k}"), v.to_string());
                }
            }
            v => {
                out.insert(section, v.to_string());
            }
        }
    }
    out
}

/// `  section.key: old → new` for each leaf that differs and `select` keeps,
/// values in TOML (strings quoted), in key order; keys on one side only show
/// `(absent)` on the other.
fn changed_keys(old: &Config, new: &Config, select: impl Fn(&str) -> bool) -> Vec<String> {
    let (a, b) = (flatten(old), flatten(new));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let absent = "(absent)".to_string();
    keys.into_iter()
        .filter(|k| select(k))
        .filter_map(|k| {
            let (was, is) = (a.get(k).unwrap_or(&absent), b.get(k).unwrap_or(&absent));
            (was != is).then(|| format!("  {k}: {was} → {is}"))
        })
        .collect()
}

/// Keys that decide only how the same computation is laid out or observed.
fn layout_only(key: &str) -> bool {
    let section = key.split('.').next().unwrap_or(key);
    matches!(section, "parallel" | "backend" | "trace" | "replay" | "checkpoint" | "recovery" | "sim")
        || matches!(key, "train.steps" | "train.eval_every" | "train.eval_batches" | "train.recompute")
}

fn global_batch(c: &Config) -> usize {
    c.parallel.dp * c.parallel.microbatches * c.train.micro_batch_size
}

/// Prints what changed since the checkpoint and whether bits can still match.
fn warn_changes(old: &Config, new: &Config, state: &checkpoint::StateFile) {
    let old_hash = &state.config_hash;
    let mut differ = changed_keys(old, new, |k| !layout_only(k));
    let layout = changed_keys(old, new, layout_only);
    let (old_batch, new_batch) = (global_batch(old), global_batch(new));
    let same_batch = old_batch == new_batch;
    let old_decay = LrSchedule::from_config(old).decay_bounds();
    let new_decay = LrSchedule::from_config(new).decay_bounds();
    let mut notes = Vec::new();
    if !same_batch {
        let next = crate::optim::batch_ramp::BatchSizes::from_config(new).sequences_before(state.step);
        let (lo, hi) = (next.min(state.data_cursor), next.max(state.data_cursor));
        let gap = if next > state.data_cursor { "skipped" } else { "read again" };
        notes.push(format!(
            "  the global batch changes: {} → {} sequences per step (dp·microbatches·micro_batch_size = \
             {}·{}·{} → {}·{}·{}); a step's data position is the sequences of the steps before it, so the resumed run \
             reads from sequence {next} while the checkpoint's cursor is {}: sequences {lo}..{hi} are {gap}",
            old_batch,
            new_batch,
            old.parallel.dp,
            old.parallel.microbatches,
            old.train.micro_batch_size,
            new.parallel.dp,
            new.parallel.microbatches,
            new.train.micro_batch_size,
            state.data_cursor
        ));
    }
    if old_decay != new_decay && old.optim == new.optim {
        notes.push(format!(
            "  train.steps {} → {} moves the learning-rate schedule's decay ({:?} → {:?})",
            old.train.steps, new.train.steps, old_decay, new_decay
        ));
    }
    // The CPU backend sums gradients by one tree over the global microbatch
    // index whatever dp is; the GPU backend sums each replica's share and then
    // the replicas, so another dp changes its rounding.
    let dp_only = same_batch
        && old.parallel.dp != new.parallel.dp
        && new.backend.kind == crate::config::BackendKind::Cuda;
    if dp_only {
        notes.push(
            "  parallel.dp changes with the same global batch on backend.kind = \"cuda\": the same data, \
             but gradients are summed per replica and then across replicas, so results agree with an \
             uninterrupted run only to rounding"
                .into(),
        );
    }
    if old.parallel.tp_slices != new.parallel.tp_slices {
        notes.push(format!(
            "  parallel.tp_slices {} → {}: the tensor-parallel sums are taken over other slices, so bits differ \
             (parallel.tp alone changes none)",
            old.parallel.tp_slices, new.parallel.tp_slices
        ));
    }
    if old.backend.kind != new.backend.kind {
        notes.push("  backend.kind changes: another backend's arithmetic, so bits differ".into());
    }
    let hash = &new.hash()[..12];
    if differ.is_empty() && notes.is_empty() {
        tracing::info!(
            "resuming with layout changes only (config hash {} → {hash}); bits still match an \
             uninterrupted run:\n{}",
            &old_hash[..old_hash.len().min(12)],
            layout.join("\n")
        );
        return;
    }
    differ.extend(notes);
    tracing::warn!(
        "warning: resuming with settings that differ from the checkpoint's (config hash {} → {hash}):\n{}\n\
         warning: the resumed run's losses and weights will not match the bits of an uninterrupted run{}",
        &old_hash[..old_hash.len().min(12)],
        differ.join("\n"),
        if layout.is_empty() { String::new() } else { format!("\nlayout changes:\n{}", layout.join("\n")) }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_listed_as_toml_key_paths_and_values() {
        let old = Config::default();
        let mut new = old.clone();
        new.model.n_layer += 1;
        new.optim.lr = 0.5;
        new.parallel.pp = 4;
        let model = changed_keys(&old, &new, |k| k.starts_with("model."));
        assert_eq!(model, [format!("  model.n_layer: {} → {}", old.model.n_layer, new.model.n_layer)]);
        let all = changed_keys(&old, &new, |_| true).join("\n");
        assert!(all.contains(&format!("  optim.lr: {} → 0.5", toml::Value::from(old.optim.lr))), "{all}");
        assert!(all.contains("  parallel.pp: "), "{all}");
        assert!(!all.contains("ModelSection") && !all.contains('{'), "{all}");
    }
}
