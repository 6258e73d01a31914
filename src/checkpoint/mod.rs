//! Checkpoints: a directory per step that does not depend on the parallel
//! layout, written so that a crash at any moment leaves every earlier
//! checkpoint intact and never a half-written one under a final name.
//!
//! `DIR/checkpoints/step_00000100/` holds `model.safetensors` (Hugging Face
//! GPT-2 names), `optimizer.safetensors` (each tensor's AdamW moments as
//! `NAME.exp_avg` and `NAME.exp_avg_sq`, PyTorch's names), with
//! `optim.ema_decay` the EMA of the weights as `model.ema.safetensors` (whole
//! tensors under the names `model.safetensors` uses), and `state.json`
//! ([`StateFile`]: step, tokens, data cursors, RNG, LR-schedule position, loss
//! scaler, the resolved config and its hash, and a blake3 digest of each file).
//! It is written as `step_….tmp/`, every file fsync'd, then renamed and the
//! parent fsync'd. Replacing a checkpoint of the same step goes through
//! `step_….old/`, so a complete copy exists under one of the two names at
//! every moment; [`list`] knows both.

pub mod pin;

use crate::model::io::{self, LoadedWeights, WeightsError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const FORMAT_VERSION: u32 = 1;

/// One tensor as a checkpoint holds it. Serde writes its name and shape
/// only: messages carry the tensors beside it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorState {
    pub name: String,
    pub shape: Vec<usize>,
    #[serde(skip)]
    pub data: Vec<f32>,
    #[serde(skip)]
    pub exp_avg: Vec<f32>,
    #[serde(skip)]
    pub exp_avg_sq: Vec<f32>,
    /// The EMA of the weights (`optim.ema_decay`); empty when none is kept.
    #[serde(skip)]
    pub ema: Vec<f32>,
}

/// `state.json`. Fields added after format 1 first shipped default when
/// absent, so older checkpoints still load.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StateFile {
    pub format_version: u32,
    /// Optimizer steps completed; a resumed run continues with this step.
    pub step: u64,
    /// AdamW's bias-correction count (steps whose update was not skipped).
    pub adam_step: u64,
    /// Tokens trained on so far, summed over every segment of the run (a
    /// segment resumed with another global batch adds its own per step).
    pub tokens: u64,
    pub skipped_steps: usize,
    /// Training sequences the replicas have consumed together: the global
    /// sampler position the next step starts from.
    pub data_cursor: u64,
    /// The sampler sequence number each replica reads next, by replica.
    #[serde(default)]
    pub data_cursors: Vec<u64>,
    #[serde(default)]
    pub rng: RngState,
    #[serde(default)]
    pub lr_schedule: LrPosition,
    pub config: String,
    pub config_hash: String,
    /// blake3 of each file in the directory, by file name.
    pub digests: BTreeMap<String, String>,
    /// Dynamic loss scaling's state, when it is on.
    #[serde(default)]
    pub loss_scaler: Option<crate::optim::scaler::LossScaler>,
    /// Updates of the EMA of the weights in [`EMA_FILE`] (AveragedModel's
    /// `n_averaged`); absent when the run keeps no EMA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ema_updates: Option<u64>,
}

/// The EMA of the weights in a checkpoint directory (and a run folder).
pub use crate::model::io::EMA_FILE;

/// The random generator's state. Generators are counter-based: every stream is
/// a pure function of (seed, purpose, ids) and a position derived from the step
/// (see `crate::rng`), so the seed and the step are all there is to restore.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RngState {
    pub seed: u64,
    /// The step the next draws are keyed by.
    pub step: u64,
    pub note: String,
}

pub const RNG_NOTE: &str = "counter-based: every stream is a function of (seed, purpose, ids) \
     — init by tensor name, shuffle by epoch, data by window — so (seed, step) is the whole state";

/// Where the learning-rate schedule stands.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LrPosition {
    /// "cosine", "wsd" or "constant".
    pub kind: String,
    /// The 0-based step whose learning rate comes next.
    pub step: u64,
    pub warmup_steps: u64,
    /// The rate decays from `lr` to `min_lr` over steps `decay_start..=decay_end`
    /// (equal for "constant": no decay).
    pub decay_start: u64,
    pub decay_end: u64,
    pub lr: f64,
    pub min_lr: f64,
    /// The learning rate of `step`, cooldown included.
    pub next_lr: f64,
    /// After a rollback the rate is scaled by `cooldown_factor` before this step.
    pub cooldown_until: u64,
    pub cooldown_factor: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    Weights(#[from] WeightsError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |error| CheckpointError::Io { path: path.to_path_buf(), error }
}

pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

/// Steps whose checkpoint this process is writing: a failing run waits for
/// them (a whole checkpoint is worth the wait) and names them if they hang.
static WRITING: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

pub fn writes_in_flight() -> Vec<u64> {
    WRITING.lock().map(|w| w.clone()).unwrap_or_default()
}

/// Marks the write of one step as in flight until dropped.
struct Writing(u64);

impl Writing {
    fn start(step: u64) -> Writing {
        if let Ok(mut w) = WRITING.lock() {
            w.push(step);
        }
        Writing(step)
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        if let Ok(mut w) = WRITING.lock() {
            if let Some(i) = w.iter().position(|&s| s == self.0) {
                w.swap_remove(i);
            }
        }
    }
}

/// `path` with `suffix` appended to its last component (`step_…` → `step_….retired`).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// Writes a checkpoint atomically and applies the retention rule. Returns its
/// directory. On failure the partial `.tmp` is removed and nothing else is
/// touched.
pub fn save(
    run_dir: &Path,
    tensors: &[TensorState],
    mut state: StateFile,
    keep: usize,
    keep_every: u64,
) -> Result<PathBuf, CheckpointError> {
    let _writing = Writing::start(state.step);
    let root = checkpoints_dir(run_dir);
    std::fs::create_dir_all(&root).map_err(io_err(&root))?;
    let name = step_dir_name(state.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!("{name}.tmp"));
    let old = root.join(format!("{name}.old"));
    // Only a whole checkpoint is ever renamed, so a `.tmp` is always a cut-short one.
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    if let Err(e) = write_files(&tmp, tensors, &mut state) {
        // A partial write only holds disk space (maybe the very space that ran out).
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if old.exists() && final_dir.exists() {
        // A crash after the new copy was renamed into place: `.old` is the stale one.
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    }
    // A checkpoint of this step exists (a resumed run reached it again, or a
    // crash mid-replace left it as `.old`): it stays until the new one is in place.
    if final_dir.exists() {
        std::fs::rename(&final_dir, &old).map_err(io_err(&final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io_err(&tmp))?;
    fsync_dir(&root)?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    }
    remove_leftovers(&root)?;
    retain(&root, keep, keep_every)?;
    Ok(final_dir)
}

/// The files of a checkpoint into `tmp`, each fsync'd, `state.json` last.
fn write_files(tmp: &Path, tensors: &[TensorState], state: &mut StateFile) -> Result<(), CheckpointError> {
    std::fs::create_dir(tmp).map_err(io_err(tmp))?;
    let model: BTreeMap<String, (&[usize], &[f32])> =
        tensors.iter().map(|t| (t.name.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect();
    let mut optim: BTreeMap<String, (&[usize], &[f32])> = BTreeMap::new();
    for t in tensors {
        optim.insert(format!("{}.exp_avg", t.name), (t.shape.as_slice(), t.exp_avg.as_slice()));
        optim.insert(format!("{}.exp_avg_sq", t.name), (t.shape.as_slice(), t.exp_avg_sq.as_slice()));
    }
    let ema: BTreeMap<String, (&[usize], &[f32])> =
        tensors.iter().map(|t| (t.name.clone(), (t.shape.as_slice(), t.ema.as_slice()))).collect();
    let mut meta = HashMap::new();
    meta.insert(crate::model::io::CONFIG_METADATA_KEY.to_string(), state.config.clone());
    meta.insert("format".to_string(), "pt".to_string());
    let disk_full = fault_disk_full(state.step);
    let mut files = vec![("model.safetensors", &model), ("optimizer.safetensors", &optim)];
    if state.ema_updates.is_some() {
        files.push((EMA_FILE, &ema));
    }
    for (i, (file, map)) in files.into_iter().enumerate() {
        let p = tmp.join(file);
        let bytes = io::to_safetensors(&p, map, meta.clone())?;
        // The simulated full disk strikes halfway through the second file.
        let fill = (disk_full && i == 1).then_some(bytes.len() / 2);
        write_file(&p, &bytes, fill)?;
        state.digests.insert(file.to_string(), blake3::hash(&bytes).to_hex().to_string());
        if i == 0 {
            write_delay();
        }
    }
    let p = tmp.join("state.json");
    let json = seal(state);
    write_file(&p, json.as_bytes(), None)?;
    fsync_dir(tmp)
}

/// The key under which `state.json` records its own digest.
pub const STATE_FILE: &str = "state.json";

/// What stands in for `state.json`'s own digest while that digest is computed.
const SEAL_PLACEHOLDER: &str = "(blake3 of this file with this text in place of its own digest)";

/// `state` as the text of `state.json`, its `digests` holding the file's own
/// blake3 (computed over the text with [`SEAL_PLACEHOLDER`] in its place): an
/// edited step or any other flipped byte is then damage like a bad tensor file.
pub fn seal(state: &mut StateFile) -> String {
    state.digests.insert(STATE_FILE.to_string(), SEAL_PLACEHOLDER.to_string());
    let text = serde_json::to_string_pretty(state).expect("state serializes");
    let digest = blake3::hash(text.as_bytes()).to_hex().to_string();
    state.digests.insert(STATE_FILE.to_string(), digest.clone());
    text.replacen(&format!("\"{SEAL_PLACEHOLDER}\""), &format!("\"{digest}\""), 1)
}

/// Checks the seal [`seal`] put on `text`, the bytes of `state.json` at `path`.
fn check_seal(path: &Path, text: &[u8], state: &StateFile) -> Result<(), CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid { path: path.to_path_buf(), reason };
    let Some(want) = state.digests.get(STATE_FILE) else {
        return Err(invalid(format!("no digest recorded for {STATE_FILE} itself: the file is damaged")));
    };
    let text = std::str::from_utf8(text).map_err(|e| invalid(format!("not UTF-8: {e}")))?;
    let quoted = format!("\"{want}\"");
    if text.matches(&quoted).count() != 1 {
        return Err(invalid(format!(
            "its own digest {want} does not appear exactly once: the file is damaged"
        )));
    }
    let unsealed = text.replacen(&quoted, &format!("\"{SEAL_PLACEHOLDER}\""), 1);
    let got = blake3::hash(unsealed.as_bytes()).to_hex().to_string();
    if &got != want {
        return Err(invalid(format!(
            "blake3 digest {got} differs from the {want} it records for itself: the file is damaged"
        )));
    }
    Ok(())
}

/// The step a checkpoint directory's name gives (`step_00000022`, `….old`), if it is one.
fn step_of_dir(dir: &Path) -> Option<u64> {
    let name = dir.file_name()?.to_str()?;
    let rest = name.strip_prefix("step_")?;
    rest.split('.').next()?.parse().ok()
}

/// Creates `path` with `bytes`, fsync'd. With `fill`, only that many bytes
/// are written and the write fails as a full disk does.
fn write_file(path: &Path, bytes: &[u8], fill: Option<usize>) -> Result<(), CheckpointError> {
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    let n = fill.unwrap_or(bytes.len());
    f.write_all(&bytes[..n]).and_then(|_| f.sync_all()).map_err(io_err(path))?;
    if fill.is_some() {
        return Err(CheckpointError::Io {
            path: path.to_path_buf(),
            error: std::io::Error::from_raw_os_error(28),
        });
    }
    Ok(())
}

/// `PIPEWRIGHT_FAULT_DISK_FULL=N`: the checkpoint of step N fails as if the
/// disk filled up halfway through writing it — how tests check that a partial
/// write is cleaned up and nothing saved before is lost.
fn fault_disk_full(step: u64) -> bool {
    std::env::var("PIPEWRIGHT_FAULT_DISK_FULL").ok().and_then(|v| v.trim().parse::<u64>().ok()) == Some(step)
}

/// `PIPEWRIGHT_CHECKPOINT_WRITE_DELAY_MS=N`: a pause between the files of a
/// checkpoint, a slow disk stand-in, so a test's kills can land mid-write.
fn write_delay() {
    let ms = std::env::var("PIPEWRIGHT_CHECKPOINT_WRITE_DELAY_MS").ok().and_then(|v| v.trim().parse().ok());
    if let Some(ms) = ms {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Complete checkpoints by step (ascending), and other `step_…` entries.
pub type Listing = (Vec<(u64, PathBuf)>, Vec<PathBuf>);

/// Complete checkpoints under `root`, by step, ascending, and the directories
/// that are not (cut-short `.tmp`s, damaged ones set aside, a `.old` whose
/// replacement is in place). A `.old` with no checkpoint of its step beside it
/// is one that a crash caught mid-replace: it is the step's complete copy.
pub fn list(root: &Path) -> Result<Listing, CheckpointError> {
    let mut done = Vec::new();
    let mut incomplete = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else { return Ok((done, incomplete)) };
    for e in entries {
        let e = e.map_err(io_err(root))?;
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("step_") else { continue };
        let whole = e.path().join("state.json").exists();
        let (digits, suffix) = rest.split_once('.').unwrap_or((rest, ""));
        match (digits.parse::<u64>(), suffix) {
            (Ok(step), "") if whole => done.push((step, e.path())),
            (Ok(step), "old") if whole && !root.join(step_dir_name(step)).exists() => {
                done.push((step, e.path()))
            }
            _ => incomplete.push(e.path()),
        }
    }
    done.sort();
    incomplete.sort();
    Ok((done, incomplete))
}

/// Removes what a killed save leaves behind: `.tmp`s (the checkpointer writes
/// one checkpoint at a time, so none is still being written), `.old`s whose
/// replacement is in place, and retired checkpoints caught mid-delete.
fn remove_leftovers(root: &Path) -> Result<(), CheckpointError> {
    let (_, other) = list(root)?;
    for p in other {
        let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if [".tmp", ".old", ".retired"].iter().any(|s| name.ends_with(s)) {
            std::fs::remove_dir_all(&p).map_err(io_err(&p))?;
        }
    }
    Ok(())
}

/// Keeps the newest `keep` checkpoints, every one whose step is a multiple
/// of `keep_every` (0: none kept for good), and the pinned ones ([`pin`]).
fn retain(root: &Path, keep: usize, keep_every: u64) -> Result<(), CheckpointError> {
    let (done, _) = list(root)?;
    let pinned = pin::pinned_steps(root).map_err(io_err(&pin::pinned_path(root)))?;
    let n = done.len();
    for (i, (step, path)) in done.into_iter().enumerate() {
        let newest = i + keep >= n;
        let forever = keep_every > 0 && step % keep_every == 0;
        if !newest && !forever && !pinned.contains(&step) {
            // Renamed first: a kill mid-delete must not leave a checkpoint name
            // on a directory missing some of its files.
            let retired = with_suffix(&path, ".retired");
            std::fs::rename(&path, &retired).map_err(io_err(&path))?;
            std::fs::remove_dir_all(&retired).map_err(io_err(&retired))?;
        }
    }
    Ok(())
}

/// Checkpoints that failed to verify, each with the reason.
pub type Damaged = Vec<(PathBuf, CheckpointError)>;

/// The newest complete checkpoint under `root` that verifies, and each newer
/// one that did not. Nothing is modified.
pub fn newest_verified(root: &Path) -> Result<(Option<Loaded>, Damaged), CheckpointError> {
    let (done, _) = list(root)?;
    let mut damaged = Vec::new();
    for (_, dir) in done.iter().rev() {
        match load(dir) {
            Ok(l) => return Ok((Some(l), damaged)),
            Err(e) => damaged.push((dir.clone(), e)),
        }
    }
    Ok((None, damaged))
}

/// Renames a damaged checkpoint to `….damaged` so no later save of its step
/// replaces it: it stays for inspection, never deleted. Returns the new name.
pub fn set_aside(dir: &Path) -> Result<PathBuf, CheckpointError> {
    let mut to = with_suffix(dir, ".damaged");
    let mut n = 1;
    while to.exists() {
        n += 1;
        to = with_suffix(dir, &format!(".damaged.{n}"));
    }
    std::fs::rename(dir, &to).map_err(io_err(dir))?;
    Ok(to)
}

/// A checkpoint read back and verified.
pub struct Loaded {
    pub dir: PathBuf,
    pub state: StateFile,
    /// blake3 of `state.json` as read, hex: it names the digests of the other
    /// files, so it stands for the whole checkpoint.
    pub state_blake3: String,
    pub weights: LoadedWeights,
    /// Moments by tensor name: (exp_avg, exp_avg_sq).
    pub moments: HashMap<String, (Vec<f32>, Vec<f32>)>,
    /// The EMA of the weights by tensor name, when the run kept one
    /// (`state.ema_updates` counts its updates).
    pub ema: Option<HashMap<String, Vec<f32>>>,
}

/// Reads and verifies one checkpoint directory: every file present, digests
/// as recorded, tensors complete. Never modifies anything.
pub fn load(dir: &Path) -> Result<Loaded, CheckpointError> {
    let cap = crate::fsutil::memory_cap();
    load_with(dir, |path| crate::fsutil::read_regular(path, cap, "memory holds"))
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
    let state_blake3 = blake3::hash(&text).to_hex().to_string();
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
    check_seal(&sp, &text, &state)?;
    if let Some(named) = step_of_dir(dir).filter(|&s| s != state.step) {
        return Err(CheckpointError::Invalid {
            path: sp,
            reason: format!(
                "step {} differs from the directory's step {named}: the file is damaged",
                state.step
            ),
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
    let ema = match state.ema_updates {
        None => None,
        Some(_) => {
            let mut file = verified(EMA_FILE)?;
            let mut ema = HashMap::new();
            for (name, (shape, _)) in &weights.tensors {
                let invalid = |reason: String| CheckpointError::Invalid { path: file.path.clone(), reason };
                match file.tensors.remove(name) {
                    Some((s, d)) if &s == shape => ema.insert(name.clone(), d),
                    Some((s, _)) => {
                        return Err(invalid(format!("tensor `{name}` has shape {s:?}, expected {shape:?}")))
                    }
                    None => return Err(invalid(format!("tensor `{name}` is missing"))),
                };
            }
            Some(ema)
        }
    };
    Ok(Loaded { dir: dir.to_path_buf(), state, state_blake3, weights, moments, ema })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensors(x: f32) -> Vec<TensorState> {
        vec![TensorState {
            name: "wpe.weight".into(),
            shape: vec![2, 3],
            data: vec![x; 6],
            exp_avg: vec![0.5; 6],
            exp_avg_sq: vec![0.25; 6],
            ema: vec![],
        }]
    }

    fn state(step: u64) -> StateFile {
        StateFile {
            format_version: FORMAT_VERSION,
            step,
            adam_step: step,
            tokens: 64 * step,
            skipped_steps: 0,
            data_cursor: 4 * step,
            data_cursors: vec![4 * step],
            rng: RngState { seed: 1, step, note: RNG_NOTE.into() },
            lr_schedule: LrPosition::default(),
            config: String::new(),
            config_hash: String::new(),
            digests: BTreeMap::new(),
            loss_scaler: None,
            ema_updates: None,
        }
    }

    fn steps(root: &Path) -> Vec<u64> {
        list(root).unwrap().0.into_iter().map(|(s, _)| s).collect()
    }

    fn names(root: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn retention_keeps_the_newest_and_every_multiple_of_keep_every_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        for step in 1..=10 {
            save(dir.path(), &tensors(step as f32), state(step), 2, 4).unwrap();
        }
        let root = checkpoints_dir(dir.path());
        assert_eq!(steps(&root), [4, 8, 9, 10]);
        assert_eq!(names(&root), ["step_00000004", "step_00000008", "step_00000009", "step_00000010"]);
        for step in 11..=13 {
            save(dir.path(), &tensors(step as f32), state(step), 3, 0).unwrap();
        }
        // keep_every = 0 keeps nothing for good: only the newest three remain.
        assert_eq!(steps(&root), [11, 12, 13]);
    }

    #[test]
    fn a_crash_between_the_renames_leaves_a_complete_old_that_is_listed_loaded_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let root = checkpoints_dir(dir.path());
        save(dir.path(), &tensors(1.0), state(2), 2, 0).unwrap();
        save(dir.path(), &tensors(2.0), state(4), 2, 0).unwrap();
        // The first rename of a replace of step 4 happened, the second did not.
        std::fs::rename(root.join("step_00000004"), root.join("step_00000004.old")).unwrap();
        let (done, _) = list(&root).unwrap();
        assert_eq!(done.last().unwrap(), &(4, root.join("step_00000004.old")));
        let loaded = load(&done.last().unwrap().1).unwrap();
        assert_eq!(loaded.weights.tensors["wpe.weight"].1, vec![2.0; 6]);
        // The resumed run reaches step 4 again: the save succeeds and the `.old` goes only then.
        save(dir.path(), &tensors(3.0), state(4), 2, 0).unwrap();
        assert_eq!(names(&root), ["step_00000002", "step_00000004"]);
        assert_eq!(load(&root.join("step_00000004")).unwrap().weights.tensors["wpe.weight"].1, vec![3.0; 6]);
    }

    #[test]
    fn a_stale_old_beside_its_replacement_and_a_stale_tmp_do_not_block_a_save() {
        let dir = tempfile::tempdir().unwrap();
        let root = checkpoints_dir(dir.path());
        save(dir.path(), &tensors(1.0), state(4), 2, 0).unwrap();
        // A crash after the second rename: `.old` and the new copy side by side,
        // and a cut-short `.tmp` of the same step and of another.
        save(dir.path(), &tensors(9.0), state(3), 2, 0).unwrap();
        std::fs::rename(root.join("step_00000003"), root.join("step_00000004.old")).unwrap();
        std::fs::create_dir(root.join("step_00000004.tmp")).unwrap();
        std::fs::write(root.join("step_00000004.tmp/model.safetensors"), b"partial").unwrap();
        std::fs::create_dir(root.join("step_00000006.tmp")).unwrap();
        assert_eq!(
            list(&root).unwrap().0,
            [(4, root.join("step_00000004"))],
            "the .old is not the step's copy"
        );
        save(dir.path(), &tensors(2.0), state(4), 2, 0).unwrap();
        assert_eq!(names(&root), ["step_00000004"]);
        assert_eq!(load(&root.join("step_00000004")).unwrap().weights.tensors["wpe.weight"].1, vec![2.0; 6]);
    }

    #[test]
    fn a_damaged_newest_checkpoint_falls_back_to_the_older_one_and_is_set_aside_not_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let root = checkpoints_dir(dir.path());
        save(dir.path(), &tensors(1.0), state(2), 2, 0).unwrap();
        save(dir.path(), &tensors(2.0), state(4), 2, 0).unwrap();
        std::fs::write(root.join("step_00000004/model.safetensors"), b"junk").unwrap();
        let (loaded, damaged) = newest_verified(&root).unwrap();
        assert_eq!(loaded.unwrap().state.step, 2);
        assert_eq!(damaged.len(), 1);
        assert!(damaged[0].1.to_string().contains("step_00000004/model.safetensors"), "{}", damaged[0].1);
        let kept = set_aside(&damaged[0].0).unwrap();
        assert_eq!(kept, root.join("step_00000004.damaged"));
        // A later save of step 4 leaves the damaged copy alone.
        save(dir.path(), &tensors(3.0), state(4), 2, 0).unwrap();
        assert!(kept.join("model.safetensors").exists());
        assert_eq!(steps(&root), [2, 4]);
    }

    /// Every leaf of a JSON value by its path, `digests.state.json` (the seal itself) left out.
    fn leaves(v: &serde_json::Value, path: String, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    leaves(v, if path.is_empty() { k.clone() } else { format!("{path}/{k}") }, out);
                }
            }
            serde_json::Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    leaves(v, format!("{path}/{i}"), out);
                }
            }
            _ if path == "digests/state.json" => {}
            _ => out.push(path),
        }
    }

    /// `v` changed as a tamperer or a flipped bit would: a number off by one
    /// bit, a string with one character changed, a bool negated.
    fn tampered(v: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::Number(n) if n.is_u64() => (n.as_u64().unwrap() ^ 8).into(),
            Value::Number(n) => (n.as_f64().unwrap() * 1.5 + 1.0).into(),
            Value::String(t) if t.is_empty() => "x".into(),
            Value::String(t) => format!("{}{}", if t.starts_with('0') { '1' } else { '0' }, &t[1..]).into(),
            Value::Bool(b) => (!b).into(),
            Value::Null => 1.into(),
            other => other.clone(),
        }
    }

    #[test]
    fn every_state_json_field_changed_is_damage_and_falls_back_to_the_older_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let root = checkpoints_dir(dir.path());
        let mut s = state(22);
        s.lr_schedule = LrPosition { kind: "wsd".into(), cooldown_until: 30, lr: 1e-3, ..Default::default() };
        s.loss_scaler = None;
        save(dir.path(), &tensors(1.0), state(20), 2, 0).unwrap();
        save(dir.path(), &tensors(2.0), s, 2, 0).unwrap();
        let sp = root.join("step_00000022/state.json");
        let good = std::fs::read_to_string(&sp).unwrap();
        let value: serde_json::Value = serde_json::from_str(&good).unwrap();
        let mut paths = Vec::new();
        leaves(&value, String::new(), &mut paths);
        for want in ["step", "adam_step", "tokens", "lr_schedule/cooldown_until", "digests/model.safetensors"]
        {
            assert!(paths.iter().any(|p| p == want), "{want} not among {paths:?}");
        }
        for path in &paths {
            let mut v = value.clone();
            let leaf = v.pointer_mut(&format!("/{path}")).unwrap();
            *leaf = tampered(leaf);
            std::fs::write(&sp, serde_json::to_string_pretty(&v).unwrap()).unwrap();
            let err =
                load(&root.join("step_00000022")).err().unwrap_or_else(|| panic!("{path} changed: accepted"));
            assert!(err.to_string().contains("step_00000022/"), "{path}: {err}");
            let (loaded, damaged) = newest_verified(&root).unwrap();
            assert_eq!(loaded.unwrap().state.step, 20, "{path}");
            assert_eq!(damaged.len(), 1, "{path}");
        }
        // One flipped bit anywhere in the file, seal included.
        for i in (0..good.len()).step_by(7) {
            let mut bytes = good.clone().into_bytes();
            bytes[i] ^= 1;
            std::fs::write(&sp, &bytes).unwrap();
            assert!(load(&root.join("step_00000022")).is_err(), "bit 0 of byte {i} flipped: accepted");
        }
        std::fs::write(&sp, &good).unwrap();
        assert_eq!(load(&root.join("step_00000022")).unwrap().state.lr_schedule.cooldown_until, 30);
    }

    #[test]
    fn a_state_json_whose_step_differs_from_its_directory_is_damage_even_when_sealed() {
        let dir = tempfile::tempdir().unwrap();
        let root = checkpoints_dir(dir.path());
        save(dir.path(), &tensors(1.0), state(22), 2, 0).unwrap();
        // A whole checkpoint of step 32 copied under step 22's name: every digest holds.
        save(dir.path(), &tensors(2.0), state(32), 2, 0).unwrap();
        std::fs::remove_dir_all(root.join("step_00000022")).unwrap();
        std::fs::rename(root.join("step_00000032"), root.join("step_00000022")).unwrap();
        let err = load(&root.join("step_00000022")).err().unwrap().to_string();
        assert!(err.contains("step_00000022/state.json") && err.contains("step 32 differs"), "{err}");
    }

    #[test]
    fn a_state_json_without_its_own_digest_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let root = checkpoints_dir(dir.path());
        save(dir.path(), &tensors(1.0), state(2), 2, 0).unwrap();
        let sp = root.join("step_00000002/state.json");
        let mut s: StateFile = serde_json::from_str(&std::fs::read_to_string(&sp).unwrap()).unwrap();
        s.digests.remove(STATE_FILE);
        std::fs::write(&sp, serde_json::to_string_pretty(&s).unwrap()).unwrap();
        let err = load(&root.join("step_00000002")).err().unwrap().to_string();
        assert!(err.contains("no digest recorded for state.json"), "{err}");
    }
}
