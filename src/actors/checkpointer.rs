//! The checkpointer: writes checkpoints on a blocking thread while training
//! goes on, one at a time in step order, and tells the coordinator when each
//! is safely on disk (or why it is not).
//!
//! Its replay log holds, per checkpoint, the snapshot it was handed (every
//! tensor and moment, the state fields) and the blake3 digest of each file it
//! wrote; `replay --actor checkpointer` writes the snapshots again into a
//! scratch directory and compares the files.

use super::protocol::{CheckpointerMsg, CoordinatorMsg};
use crate::checkpoint::{self, CheckpointError, StateFile, TensorState};
use crate::replay::{self, ActorLog, Blob, Entry};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub struct CheckpointerArgs {
    pub run_dir: PathBuf,
    pub keep: usize,
    pub keep_every: u64,
    pub coordinator: ActorRef<CoordinatorMsg>,
    pub log: Option<ActorLog>,
}

pub struct Checkpointer;

impl Actor for Checkpointer {
    type Msg = CheckpointerMsg;
    type State = CheckpointerArgs;
    type Arguments = CheckpointerArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<CheckpointerMsg>,
        args: CheckpointerArgs,
    ) -> Result<CheckpointerArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<CheckpointerMsg>,
        msg: CheckpointerMsg,
        st: &mut CheckpointerArgs,
    ) -> Result<(), ActorProcessingErr> {
        let CheckpointerMsg::Write { tensors, state } = msg;
        let step = state.step;
        let (dir, keep, keep_every) = (st.run_dir.clone(), st.keep, st.keep_every);
        let logged = st.log.as_ref().map(|l| l.payloads());
        let t = Instant::now();
        // Disk work (and digesting for the log) runs on tokio's blocking pool,
        // never on the actor threads.
        let (result, entry) =
            tokio::task::spawn_blocking(move || write(&dir, keep, keep_every, tensors, state, logged))
                .await?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if let (Some(log), Some(e)) = (&mut st.log, entry) {
            log.begin(e);
            log.end();
        }
        let reply = match result {
            Ok(path) => CoordinatorMsg::Saved { step, ms, path },
            Err(e) => CoordinatorMsg::CheckpointFailed(format!("checkpoint of step {step}: {e}")),
        };
        // A failed run's coordinator may be gone while queued writes finish.
        let _ = st.coordinator.send_message(reply);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<CheckpointerMsg>,
        st: &mut CheckpointerArgs,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(log) = &mut st.log {
            log.finish()?;
        }
        Ok(())
    }
}

/// Writes one checkpoint; with `logged` (whether payloads are kept), also the
/// log entry of it: the snapshot handed over and the digests of the files.
pub fn write(
    run_dir: &Path,
    keep: usize,
    keep_every: u64,
    tensors: Vec<TensorState>,
    state: StateFile,
    logged: Option<bool>,
) -> (Result<PathBuf, CheckpointError>, Option<Entry>) {
    let mut entry = logged.map(|keep| {
        replay::entry("coordinator", "Write", state.step, 0)
            .with_inputs(snapshot_blobs(&tensors, &state, keep))
    });
    let step = state.step;
    let result = checkpoint::save(run_dir, &tensors, state, keep, keep_every);
    if let Some(e) = &mut entry {
        // Timings and paths differ between a run and its replay: left out.
        let (kind, blobs) = match &result {
            Ok(_) => ("Saved", vec![Blob::f64("step", step as f64)]),
            Err(_) => ("CheckpointFailed", vec![]),
        };
        e.sent.push(replay::Sent { to: "coordinator".into(), kind: kind.into(), mb: None, blobs });
        if let Ok(dir) = &result {
            match written_blobs(dir) {
                Ok(b) => e.state = b,
                Err(why) => e.state = vec![Blob::str("unreadable", &why)],
            }
        }
    }
    (result, entry)
}

fn snapshot_blobs(tensors: &[TensorState], s: &StateFile, keep: bool) -> Vec<Blob> {
    // The whole state file but its digests (those of files not yet written):
    // every field, so that replay writes the same state.json again.
    let head = StateFile { digests: Default::default(), ..s.clone() };
    let mut b = vec![Blob::str("state", &serde_json::to_string(&head).expect("the state serializes"))];
    for t in tensors {
        let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
        b.push(Blob::u32s(&format!("{}.shape", t.name), &shape, true));
        b.push(Blob::f32s(&t.name, &t.data, keep));
        b.push(Blob::f32s(&format!("{}.exp_avg", t.name), &t.exp_avg, keep));
        b.push(Blob::f32s(&format!("{}.exp_avg_sq", t.name), &t.exp_avg_sq, keep));
        if s.ema_updates.is_some() {
            b.push(Blob::f32s(&format!("{}.ema", t.name), &t.ema, keep));
        }
    }
    b
}

/// The snapshot a logged `Write` carried, rebuilt from its entry (payloads needed).
pub fn snapshot_of(e: &Entry) -> Result<(Vec<TensorState>, StateFile), String> {
    let text = e.input("state")?.to_str()?;
    let state: StateFile = serde_json::from_str(&text).map_err(|x| format!("state: {x}"))?;
    if state.step != e.step {
        return Err(format!("state: step {} in a Write of step {}", state.step, e.step));
    }
    let mut tensors = Vec::new();
    for b in &e.inputs {
        let Some(name) = b.name.strip_suffix(".shape") else { continue };
        tensors.push(TensorState {
            name: name.to_string(),
            shape: b.to_u32s()?.into_iter().map(|d| d as usize).collect(),
            data: e.input(name)?.to_f32s()?,
            exp_avg: e.input(&format!("{name}.exp_avg"))?.to_f32s()?,
            exp_avg_sq: e.input(&format!("{name}.exp_avg_sq"))?.to_f32s()?,
            ema: match state.ema_updates {
                Some(_) => e.input(&format!("{name}.ema"))?.to_f32s()?,
                None => Vec::new(),
            },
        });
    }
    Ok((tensors, state))
}

/// The files of a checkpoint directory by digest: state.json's own, and
/// those it records for the tensor files (which `save` computed from disk).
fn written_blobs(dir: &Path) -> Result<Vec<Blob>, String> {
    let sp = dir.join("state.json");
    let bytes = crate::fsutil::read_regular(&sp, crate::fsutil::MAX_CONFIG_BYTES, "a state.json may hold")
        .map_err(|e| format!("{}: {e}", sp.display()))?;
    let state: StateFile = serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", sp.display()))?;
    let mut b = Vec::new();
    // state.json's own digest is the one computed below, from the bytes read.
    for (file, hex) in state.digests.iter().filter(|(f, _)| *f != checkpoint::STATE_FILE) {
        let p = dir.join(file);
        let size = std::fs::metadata(&p).map_err(|e| format!("{}: {e}", p.display()))?.len();
        let digest = blake3::Hash::from_hex(hex).map_err(|e| format!("{}: {file}: {e}", sp.display()))?;
        b.push(Blob::file(file, *digest.as_bytes(), size));
    }
    b.push(Blob::file("state.json", *blake3::hash(&bytes).as_bytes(), bytes.len() as u64));
    Ok(b)
}
