//! `RUN/checkpoints/pinned.json`: checkpoint steps that retention must keep
//! whatever `checkpoint.keep` says, as a JSON list of steps.
//!
//! A recorded run that resumed from step N pins N: its logs start there, so
//! replaying it (one actor, or `--all`) needs that checkpoint long after newer
//! ones would have pushed it out. Pins are only ever added.

use std::path::{Path, PathBuf};

pub fn pinned_path(checkpoints_dir: &Path) -> PathBuf {
    checkpoints_dir.join("pinned.json")
}

/// The pinned steps under `checkpoints_dir` (none when there is no file).
pub fn pinned_steps(checkpoints_dir: &Path) -> std::io::Result<Vec<u64>> {
    let p = pinned_path(checkpoints_dir);
    let Some(text) =
        crate::fsutil::read_optional(&p, crate::fsutil::MAX_CONFIG_BYTES, "a pin list may hold")?
    else {
        return Ok(Vec::new());
    };
    serde_json::from_slice(&text).map_err(|e| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not a JSON list of steps: {e}"))
    })
}

/// Adds `step` to the pinned steps of the run in `run_dir`.
pub fn pin(run_dir: &Path, step: u64) -> Result<(), super::CheckpointError> {
    let root = super::checkpoints_dir(run_dir);
    let p = pinned_path(&root);
    let io = |error| super::CheckpointError::Io { path: p.clone(), error };
    let mut steps = pinned_steps(&root).map_err(io)?;
    if steps.contains(&step) {
        return Ok(());
    }
    steps.push(step);
    steps.sort_unstable();
    std::fs::create_dir_all(&root).map_err(io)?;
    let json = serde_json::to_string(&steps).expect("a list of steps serializes");
    crate::model::io::write_atomic(&p, json.as_bytes()).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_accumulate_and_a_bad_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let root = crate::checkpoint::checkpoints_dir(dir.path());
        assert_eq!(pinned_steps(&root).unwrap(), Vec::<u64>::new());
        pin(dir.path(), 7).unwrap();
        pin(dir.path(), 3).unwrap();
        pin(dir.path(), 7).unwrap();
        assert_eq!(pinned_steps(&root).unwrap(), vec![3, 7]);
        assert_eq!(std::fs::read_to_string(pinned_path(&root)).unwrap(), "[3,7]");
        std::fs::write(pinned_path(&root), "{").unwrap();
        assert!(pinned_steps(&root).is_err());
    }
}
