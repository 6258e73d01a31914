//! A whole run on actors: what goes in, what comes out, and waiting for the
//! coordinator's result (signals, the shutdown deadline after a failure).

use super::{Coordinator, CoordinatorMsg};
use crate::actors::layout::Layout;
use crate::actors::topology::{plain_name, registered};
use crate::config::Config;
use crate::data::{EvalSet, Sampler};
use crate::model::{io::LoadedWeights, Param};
use ractor::Actor;
use std::sync::Arc;
use tokio::sync::oneshot;

pub struct RunData {
    pub train: Sampler,
    pub val: Option<Sampler>,
    pub eval_set: Option<Arc<EvalSet>>,
}

pub struct RunInputs {
    /// Where checkpoints go (`run_dir/checkpoints/`).
    pub run_dir: std::path::PathBuf,
    /// Resume from this checkpoint (its step is the first step run).
    pub resume: Option<Arc<crate::checkpoint::Loaded>>,
    pub cfg: Config,
    pub layout: Layout,
    pub data: Vec<RunData>,
    pub init: Option<Arc<LoadedWeights>>,
    pub metrics: Option<std::io::BufWriter<std::fs::File>>,
    pub progress: bool,
    pub chaos_seed: Option<u64>,
    /// Set when the run spans processes: stages owned elsewhere are reached
    /// through it, and the trace clock is the fabric's.
    pub cluster: Option<Arc<dyn crate::actors::processes::Processes>>,
}

#[derive(Debug, Default)]
pub struct RunOutcome {
    /// Parameters of replica 0, every stage (a tied copy may appear twice).
    pub params: Vec<Param>,
    /// Replica 0's EMA of the weights, as parameters (empty when none is kept).
    pub ema_params: Vec<Param>,
    pub losses: Vec<f64>,
    pub train_curve: Vec<(usize, f64)>,
    pub val_curve: Vec<(usize, f64)>,
    pub last_val: Option<f64>,
    pub last_exact_match: Option<f64>,
    pub skipped: usize,
    pub train_seconds: f64,
    /// Tokens trained on, summed over every segment of a resumed run.
    pub tokens: u64,
    /// Tokens processed by this process (rolled-back steps count twice).
    pub tokens_this_run: u64,
    /// Send → actor handle time of every activation and gradient message, µs.
    pub message_latency_us: Vec<f64>,
    /// Peak activation bytes held per rank (replica 0).
    pub peak_live_bytes: Vec<usize>,
    /// Per pipeline rank, the most bytes of weights, gradients and optimizer
    /// state any replica's compute held (0 where the backend does not count).
    pub peak_state_bytes: Vec<usize>,
    /// Trace records of every replica's stages and of the checkpointer (empty unless tracing).
    pub trace: Vec<crate::trace::Record>,
    /// Training paused while stages copied their state, per checkpoint, ms.
    pub checkpoint_pause_ms: Vec<f64>,
    /// Background write time per checkpoint, ms.
    pub checkpoint_write_ms: Vec<f64>,
    pub checkpoints: Vec<std::path::PathBuf>,
    /// The run stopped at a signal before its last step.
    pub stopped_early: bool,
    /// Steps completed when the run ended (counting those before a resume).
    pub steps_done: u64,
    /// Rollbacks to a checkpoint after repeated skipped steps.
    pub rollbacks: usize,
}

/// Runs a whole training run on actors and returns what it produced.
pub async fn run(inputs: RunInputs) -> anyhow::Result<RunOutcome> {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    let shutdown = std::time::Duration::from_secs_f64(inputs.cfg.recovery.shutdown_timeout_s);
    let (coord, handle) = Actor::spawn(Some(registered("coordinator", id)), Coordinator, (inputs, tx, id))
        .await
        .map_err(|e| anyhow::anyhow!("cannot start the coordinator: {e}"))?;
    let actors = coord.get_children();
    // SIGINT / SIGTERM (crate::host::signals): a checkpoint at the next step
    // boundary, then a clean exit.
    let signals = {
        let coord = coord.clone();
        tokio::spawn(async move {
            while !crate::host::signals::requested() {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            tracing::warn!(
                "signal: saving a checkpoint at the next step boundary, then stopping (again: exit at once)"
            );
            let _ = coord.send_message(CoordinatorMsg::StopRequested);
        })
    };
    let result = rx.await.map_err(|_| anyhow::anyhow!("the coordinator stopped without a result"))?;
    signals.abort();
    let Err(failure) = result else {
        let _ = handle.await;
        return result.map_err(|f| anyhow::anyhow!("{f}"));
    };
    // The coordinator's stop kills its children; a checkpoint write already
    // under way finishes on its own thread, and is waited for: a whole
    // checkpoint is worth it, a hung disk is not.
    let stopped = |a: &ractor::ActorCell| a.get_status() == ractor::ActorStatus::Stopped;
    let all_stopped = async {
        let _ = handle.await;
        while !actors.iter().all(stopped) || !crate::checkpoint::writes_in_flight().is_empty() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(shutdown, all_stopped).await.is_err() {
        let mut stuck: Vec<String> = actors
            .iter()
            .chain(std::iter::once(&coord.get_cell()))
            .filter(|a| !stopped(a))
            .map(|a| {
                a.get_name().map_or_else(|| format!("actor {}", a.get_id()), |n| plain_name(&n).to_string())
            })
            .collect();
        stuck.sort();
        for step in crate::checkpoint::writes_in_flight() {
            stuck.push(format!("checkpointer (writing the checkpoint of step {step})"));
        }
        anyhow::bail!(
            "{failure}\n{} did not stop within {} s of the failure (recovery.shutdown_timeout_s); exiting anyway",
            stuck.join(", "),
            shutdown.as_secs_f64()
        );
    }
    anyhow::bail!("{failure}")
}
