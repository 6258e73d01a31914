//! Checkpoints: a directory per step that does not depend on the parallel
//! layout, written so that a crash at any moment leaves every earlier
//! checkpoint intact and never a half-written one under a final name.
//!
//! `DIR/checkpoints/step_00000100/` holds `model.safetensors` (Hugging Face
//! GPT-2 names), `optimizer.safetensors` (each tensor's AdamW moments as
//! `NAME.exp_avg` and `NAME.exp_avg_sq`, PyTorch's names) and `state.json`
//! (step, tokens, AdamW step count, the resolved config and its hash, and a
//! blake3 digest of each file). It is written as `step_….tmp/`, every file
//! fsync'd, then renamed and the parent fsync'd. The data position and every
//! random stream are functions of (seed, step), so the step is the whole cursor.

use crate::model::io::{self, LoadedWeights, WeightsError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub const FORMAT_VERSION: u32 = 1;

/// One tensor as a checkpoint holds it.
#[derive(Clone, Debug)]
pub struct TensorState {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StateFile {
    pub format_version: u32,
    /// Optimizer steps completed; a resumed run continues with this step.
    pub step: u64,
    /// AdamW's bias-correction count (steps whose update was not skipped).
    pub adam_step: u64,
    pub tokens: u64,
    pub skipped_steps: usize,
    /// Next global sequence number each replica's sampler reads, for inspection
    /// (it is a function of step and the layout's batch size).
    pub data_cursor: u64,
    pub seed: u64,
    /// Learning rate of the next step.
    pub next_lr: f64,
    pub config: String,
    pub config_hash: String,
    /// blake3 of each file in the directory, by file name.
    pub digests: BTreeMap<String, String>,
    /// Dynamic loss scaling's state, when it is on.
    #[serde(default)]
    pub loss_scaler: Option<crate::optim::scaler::LossScaler>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    Weights(#[from] WeightsError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

fn digest_file(path: &Path) -> Result<String, CheckpointError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    Ok(blake3::hash(&bytes).to_hex().to_string())
}

fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// Writes a checkpoint atomically and applies the retention rule. Returns its directory.
pub fn save(
    run_dir: &Path,
    tensors: &[TensorState],
    mut state: StateFile,
    keep: usize,
    keep_every: u64,
) -> Result<PathBuf, CheckpointError> {
    let root = checkpoints_dir(run_dir);
    std::fs::create_dir_all(&root).map_err(io_err(&root))?;
    let final_dir = root.join(step_dir_name(state.step));
    let tmp = root.join(format!("{}.tmp", step_dir_name(state.step)));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;

    let model: BTreeMap<String, (&[usize], &[f32])> =
        tensors.iter().map(|t| (t.name.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect();
    let mut optim: BTreeMap<String, (&[usize], &[f32])> = BTreeMap::new();
    for t in tensors {
        optim.insert(format!("{}.exp_avg", t.name), (t.shape.as_slice(), t.exp_avg.as_slice()));
        optim.insert(format!("{}.exp_avg_sq", t.name), (t.shape.as_slice(), t.exp_avg_sq.as_slice()));
    }
    if fault_disk_full(state.step) {
        let p = tmp.join("model.safetensors");
        return Err(CheckpointError::Io { path: p, source: std::io::Error::from_raw_os_error(28) });
    }
    let mut meta = HashMap::new();
    meta.insert(crate::inspect::CONFIG_METADATA_KEY.to_string(), state.config.clone());
    meta.insert("format".to_string(), "pt".to_string());
    for (file, map) in [("model.safetensors", &model), ("optimizer.safetensors", &optim)] {
        let p = tmp.join(file);
        io::save(&p, map, meta.clone())?;
        state.digests.insert(file.to_string(), digest_file(&p)?);
    }
    let p = tmp.join("state.json");
    let json = serde_json::to_string_pretty(&state).expect("state serializes");
    io::write_atomic(&p, json.as_bytes()).map_err(io_err(&p))?;
    fsync_dir(&tmp)?;
    if final_dir.exists() {
        // A checkpoint of this step exists (a resumed run reached it again):
        // the new one is the same state; replace it only once the new one is whole.
        let old = root.join(format!("{}.old", step_dir_name(state.step)));
        std::fs::rename(&final_dir, &old).map_err(io_err(&final_dir))?;
        std::fs::rename(&tmp, &final_dir).map_err(io_err(&tmp))?;
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    } else {
        std::fs::rename(&tmp, &final_dir).map_err(io_err(&tmp))?;
    }
    fsync_dir(&root)?;
    retain(&root, keep, keep_every)?;
    Ok(final_dir)
}

/// `PIPEWRIGHT_FAULT_DISK_FULL=N`: the checkpoint of step N fails as if the
/// disk were full (ENOSPC) — how tests check that nothing saved before is lost.
fn fault_disk_full(step: u64) -> bool {
    std::env::var("PIPEWRIGHT_FAULT_DISK_FULL").ok().and_then(|v| v.trim().parse::<u64>().ok()) == Some(step)
}

/// Complete checkpoints by step (ascending), and incomplete directories.
pub type Listing = (Vec<(u64, PathBuf)>, Vec<PathBuf>);

/// Complete checkpoints under `root`, by step, ascending.
pub fn list(root: &Path) -> Result<Listing, CheckpointError> {
    let mut done = Vec::new();
    let mut incomplete = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else { return Ok((done, incomplete)) };
    for e in entries {
        let e = e.map_err(io_err(root))?;
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("step_") else { continue };
        match rest.parse::<u64>() {
            Ok(step) if e.path().join("state.json").exists() => done.push((step, e.path())),
            Ok(_) => incomplete.push(e.path()),
            Err(_) => incomplete.push(e.path()),
        }
    }
    done.sort();
    incomplete.sort();
    Ok((done, incomplete))
}

/// Keeps the newest `keep` checkpoints, every one whose step is a multiple
/// of `keep_every` (0: none kept for good), and the pinned ones (`crate::replay::pin`).
fn retain(root: &Path, keep: usize, keep_every: u64) -> Result<(), CheckpointError> {
    let (done, _) = list(root)?;
    let pinned = crate::replay::pinned_steps(root).map_err(io_err(&crate::replay::pin::pinned_path(root)))?;
    let n = done.len();
    for (i, (step, path)) in done.into_iter().enumerate() {
        let newest = i + keep >= n;
        let forever = keep_every > 0 && step % keep_every == 0;
        if !newest && !forever && !pinned.contains(&step) {
            std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
        }
    }
    Ok(())
}

/// A checkpoint read back and verified.
pub struct Loaded {
    pub dir: PathBuf,
    pub state: StateFile,
    pub weights: LoadedWeights,
    /// Moments by tensor name: (exp_avg, exp_avg_sq).
    pub moments: HashMap<String, (Vec<f32>, Vec<f32>)>,
}

/// Reads and verifies one checkpoint directory: every file present, digests
/// as recorded, tensors complete. Never modifies anything.
pub fn load(dir: &Path) -> Result<Loaded, CheckpointError> {
    load_with(dir, |path| std::fs::read(path))
}

/// [`load`] with the caller reading the files (`read` gets each file's full
/// path), so every check can run on bytes held in memory: the fuzz target's way
/// in. Each file is read once, and digested and parsed from the same bytes.
pub fn load_with(
    dir: &Path,
    mut read: impl FnMut(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Loaded, CheckpointError> {
    let sp = dir.join("state.json");
    let text = read(&sp).map_err(io_err(&sp))?;
    let state: StateFile = serde_json::from_slice(&text).map_err(|e| CheckpointError::Invalid {
        path: sp.clone(),
        reason: format!("not a checkpoint state: {e}"),
    })?;
    if state.format_version != FORMAT_VERSION {
        return Err(CheckpointError::Invalid {
            path: sp,
            reason: format!("format_version {} (this build reads {FORMAT_VERSION})", state.format_version),
        });
    }
    let mut verified = |file: &str| -> Result<LoadedWeights, CheckpointError> {
        let p = dir.join(file);
        let want = state.digests.get(file).ok_or_else(|| CheckpointError::Invalid {
            path: sp.clone(),
            reason: format!("no digest recorded for {file}"),
        })?;
        let bytes = read(&p).map_err(io_err(&p))?;
        let got = blake3::hash(&bytes).to_hex().to_string();
        if &got != want {
            return Err(CheckpointError::Invalid {
                path: p,
                reason: format!(
                    "blake3 digest {got} differs from the {want} recorded in state.json: the file is damaged"
                ),
            });
        }
        Ok(io::parse(&p, &bytes)?)
    };
    let weights = verified("model.safetensors")?;
    let optim = verified("optimizer.safetensors")?;
    let mut moments = HashMap::new();
    for (name, (shape, _)) in &weights.tensors {
        let get = |suffix: &str| -> Result<Vec<f32>, CheckpointError> {
            let key = format!("{name}.{suffix}");
            match optim.tensors.get(&key) {
                Some((s, d)) if s == shape => Ok(d.clone()),
                Some((s, _)) => Err(CheckpointError::Invalid {
                    path: optim.path.clone(),
                    reason: format!("tensor `{key}` has shape {s:?}, expected {shape:?}"),
                }),
                None => Err(CheckpointError::Invalid {
                    path: optim.path.clone(),
                    reason: format!("tensor `{key}` is missing"),
                }),
            }
        };
        moments.insert(name.clone(), (get("exp_avg")?, get("exp_avg_sq")?));
    }
    Ok(Loaded { dir: dir.to_path_buf(), state, weights, moments })
}
