//! `pipewright replay`: rebuild one actor alone from a recorded run and feed it
//! its recorded inputs in recorded order (`--actor`), or re-run the whole
//! system and compare every actor's log (`--all`).

use super::{compare, log_path, ActorLog, Checker, Divergence, Entry, Header, LogReader};
use crate::actors::coordinator::{CoordinatorMsg, CoordinatorState, EvalKind, Links, StageReport};
use crate::actors::data_loader::{LoaderArgs, LoaderMsg};
use crate::actors::reducer::{ReducerArgs, ReducerMsg, ReducerState};
use crate::actors::stage::{replay_stage, Phase, StageArgs, StageMsg};
use crate::actors::Layout;
use crate::config::Config;
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The outcome of replaying one actor.
#[derive(Debug)]
pub enum Verdict {
    Identical { actor: String, entries: usize, first_step: u64, last_step: u64 },
    Diverged(Divergence),
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Identical { actor, entries, first_step, last_step } => write!(
                f,
                "{actor}: identical: {entries} messages (steps {first_step}–{last_step}), every output and state digest matches"
            ),
            Verdict::Diverged(d) => write!(f, "{d}"),
        }
    }
}

/// Which actors a run recorded: the `*.log` names under `RUN/replay/`.
pub fn recorded_actors(run_dir: &Path) -> Result<Vec<String>> {
    let dir = super::replay_dir(run_dir);
    let mut names = Vec::new();
    let rd = std::fs::read_dir(&dir)
        .with_context(|| format!("{}: no replay logs (record a run with `train --record`)", dir.display()))?;
    for e in rd {
        let p = e.with_context(|| format!("{}: cannot list", dir.display()))?.path();
        if p.extension().is_some_and(|x| x == "log") {
            if let Some(stem) = p.file_stem().and_then(|s| s.to_str()) {
                names.push(stem.to_string());
            }
        }
    }
    names.sort();
    Ok(names)
}

fn read_log(run_dir: &Path, actor: &str) -> Result<(Header, Vec<Entry>, PathBuf)> {
    let path = log_path(run_dir, actor);
    if !path.exists() {
        let have = recorded_actors(run_dir).unwrap_or_default();
        bail!("{}: no such replay log; this run recorded: {}", path.display(), have.join(", "));
    }
    let (h, entries) = LogReader::read_all(&path)?;
    if h.actor != actor {
        bail!("{}: the header names actor `{}`, not `{actor}`", path.display(), h.actor);
    }
    Ok((h, entries, path))
}

fn config_of(h: &Header, path: &Path) -> Result<Config> {
    let origin = format!("{} (header)", path.display());
    let cfg = Config::parse(&h.config, &origin, &[])?;
    if cfg.hash() != h.config_hash {
        bail!("{origin}: the config's hash does not match the one recorded beside it");
    }
    Ok(cfg)
}

/// The checkpoint the replay starts from: `--from-step`, or the one the
/// recorded run itself resumed from.
fn start_checkpoint(run_dir: &Path, step: u64) -> Result<Option<Arc<crate::checkpoint::Loaded>>> {
    if step == 0 {
        return Ok(None);
    }
    let root = crate::checkpoint::checkpoints_dir(run_dir);
    let (done, _) = crate::checkpoint::list(&root)?;
    let Some((_, dir)) = done.iter().find(|(s, _)| *s == step) else {
        let have: Vec<String> = done.iter().map(|(s, _)| s.to_string()).collect();
        bail!(
            "{}: no complete checkpoint of step {step} to start from (there are: {})",
            root.display(),
            if have.is_empty() { "none".to_string() } else { have.join(", ") }
        );
    };
    Ok(Some(Arc::new(crate::checkpoint::load(dir)?)))
}

/// Replays `actor` of the run in `run_dir` alone. `from_step` starts at that
/// step's checkpoint (which must exist) instead of the run's start.
pub fn replay_actor(run_dir: &Path, actor: &str, from_step: Option<u64>) -> Result<Verdict> {
    let (header, entries, path) = read_log(run_dir, actor)?;
    let cfg = config_of(&header, &path)?;
    let start = from_step.unwrap_or(header.start_step);
    if start < header.start_step {
        bail!("--from-step {start}: the log of {actor} starts at step {}", header.start_step);
    }
    // The coordinator resumes like a resumed run does, at its first report of
    // step `start`; the others take up their first message of that step.
    let mid_run = start > header.start_step;
    let skip = if actor == "coordinator" && mid_run {
        entries.iter().position(|e| e.step >= start && e.kind == "StageDone")
    } else {
        entries.iter().position(|e| e.step >= start)
    }
    .unwrap_or(entries.len());
    let entries = Arc::new(entries);
    let slot: Arc<Mutex<Option<Divergence>>> = Arc::default();
    let checker = Checker::new(entries.clone(), skip, slot.clone());
    let log = ActorLog::check(actor, checker);
    let done = if actor.starts_with("stage-") {
        replay_one_stage(
            run_dir,
            &cfg,
            &header,
            &path,
            actor,
            start,
            entries.clone(),
            skip,
            slot.clone(),
            log,
        )?
    } else if actor.starts_with("loader-") {
        replay_loader(&cfg, actor, &entries[skip..], log)?
    } else if actor == "reducer" {
        need_payloads(&header, &path, actor)?;
        replay_reducer(&cfg, &entries[skip..], log)?
    } else if actor == "coordinator" {
        replay_coordinator(run_dir, &cfg, start, mid_run, &entries[skip..], log)?
    } else {
        bail!("{}: `{actor}` is not an actor pipewright can replay", path.display());
    };
    if let Some(d) = slot.lock().expect("divergence slot").take() {
        return Ok(Verdict::Diverged(d));
    }
    if done < entries.len() {
        let e = &entries[done];
        return Ok(Verdict::Diverged(Divergence {
            actor: actor.to_string(),
            seq: e.seq,
            step: e.step,
            mb: e.mb,
            kind: e.kind.clone(),
            what: "the number of messages handled".into(),
            recorded: format!("{} entries", entries.len()),
            replayed: format!("the replay stopped after {done}"),
            diff: None,
        }));
    }
    let first_step = entries.get(skip).map_or(start, |e| e.step);
    let last_step = entries.last().map_or(start, |e| e.step);
    Ok(Verdict::Identical { actor: actor.to_string(), entries: entries.len() - skip, first_step, last_step })
}

fn need_payloads(h: &Header, path: &Path, actor: &str) -> Result<()> {
    if !h.payloads {
        bail!(
            "{}: recorded with digests only; replaying {actor} alone needs its inputs' bytes: \
             record with `--record-payloads {actor}` (or `all`)",
            path.display()
        );
    }
    Ok(())
}

fn blob_err<'a>(e: &'a Entry, path: &'a Path) -> impl Fn(String) -> anyhow::Error + 'a {
    move |why| anyhow!("{}: {}: {why}", path.display(), e.describe())
}

/// The message a stage received, rebuilt from its log entry.
fn stage_msg(e: &Entry, path: &Path, run_dir: &Path) -> Result<StageMsg> {
    let err = blob_err(e, path);
    let f64_of = |name: &str| e.input(name).and_then(|b| b.to_f64()).map_err(&err);
    let phase = if e.eval { Phase::Eval } else { Phase::Train };
    let mb = e.mb.unwrap_or(0) as usize;
    let stage = e.stage.unwrap_or(0) as usize;
    let step = e.step;
    let f32_data = || e.input("data").and_then(|b| b.to_f32s()).map_err(&err);
    Ok(match e.kind.as_str() {
        "RunStep" => StageMsg::RunStep { step, loss_scale: f64_of("loss_scale")? as f32 },
        "Apply" => StageMsg::Apply {
            step,
            lr: f64_of("lr")?,
            clip: f64_of("clip")? as f32,
            skip: f64_of("skip")? != 0.0,
        },
        "RunEval" => StageMsg::RunEval {
            step,
            kind: eval_kind(&e.input("kind").and_then(|b| b.to_str()).map_err(&err)?).map_err(&err)?,
            batches: f64_of("batches")? as usize,
        },
        "SendWeights" => StageMsg::SendWeights,
        "Snapshot" => StageMsg::Snapshot { step },
        "Restore" => {
            let dir = e.input("checkpoint").and_then(|b| b.to_str()).map_err(&err)?;
            let dir = if Path::new(&dir).is_absolute() { PathBuf::from(dir) } else { run_dir.join(dir) };
            StageMsg::Restore(Arc::new(crate::checkpoint::load(&dir)?))
        }
        "Tokens" => StageMsg::Tokens {
            phase,
            step,
            mb,
            tokens: e.input("tokens").and_then(|b| b.to_u32s()).map_err(&err)?,
        },
        "Targets" => StageMsg::Targets {
            phase,
            step,
            mb,
            targets: e.input("targets").and_then(|b| b.to_u32s()).map_err(&err)?,
        },
        "Activation" => StageMsg::Activation {
            phase,
            step,
            stage,
            mb,
            data: f32_data()?,
            sent: std::time::Instant::now(),
        },
        "Gradient" => {
            StageMsg::Gradient { step, stage, mb, data: f32_data()?, sent: std::time::Instant::now() }
        }
        "TiedShare" => StageMsg::TiedShare { step, data: f32_data()? },
        "Reduced" => StageMsg::Reduced {
            step,
            stage,
            grads: e.inputs.iter().map(|b| b.to_f32s()).collect::<Result<_, _>>().map_err(&err)?,
        },
        other => bail!("{}: {}: a stage does not handle `{other}`", path.display(), e.describe()),
    })
}

fn eval_kind(s: &str) -> Result<EvalKind, String> {
    match s {
        "val" => Ok(EvalKind::Val),
        "exact_match" => Ok(EvalKind::ExactMatch),
        other => Err(format!("unknown evaluation `{other}`")),
    }
}

fn parse_stage_name(actor: &str, cfg: &Config) -> Result<(usize, usize)> {
    let rest = actor.strip_prefix("stage-").unwrap_or(actor);
    let (r, k) = match rest.split_once('.') {
        Some((r, k)) => (r.parse().ok(), k.parse().ok()),
        None => (rest.parse().ok(), Some(0)),
    };
    match (r, k) {
        (Some(r), Some(k)) if cfg.actor_exists(actor) => Ok((r, k)),
        _ => bail!(
            "--actor {actor}: not a stage of this run (pp = {}, dp = {})",
            cfg.parallel.pp,
            cfg.parallel.dp
        ),
    }
}

#[allow(clippy::too_many_arguments)]
fn replay_one_stage(
    run_dir: &Path,
    cfg: &Config,
    header: &Header,
    path: &Path,
    actor: &str,
    start: u64,
    entries: Arc<Vec<Entry>>,
    skip: usize,
    slot: Arc<Mutex<Option<Divergence>>>,
    log: ActorLog,
) -> Result<usize> {
    need_payloads(header, path, actor)?;
    let (rank, replica) = parse_stage_name(actor, cfg)?;
    let layout = Layout::from_config(cfg)?;
    let resume = start_checkpoint(run_dir, start)?;
    // Rendezvous: the feeder hands over the next recorded input only when the
    // stage asks for one, and stops at the first divergence.
    let (tx, rx) = crossbeam_channel::bounded(0);
    let feeder_err: Arc<Mutex<Option<anyhow::Error>>> = Arc::default();
    let feeder = {
        let (entries, slot, err, path, run_dir, actor) = (
            entries.clone(),
            slot.clone(),
            feeder_err.clone(),
            path.to_path_buf(),
            run_dir.to_path_buf(),
            actor.to_string(),
        );
        std::thread::spawn(move || {
            for e in entries[skip..].iter().filter(|e| e.from != actor) {
                if slot.lock().expect("divergence slot").is_some() {
                    break;
                }
                match stage_msg(e, &path, &run_dir) {
                    Ok(m) => {
                        if tx.send(m).is_err() {
                            break;
                        }
                    }
                    Err(x) => {
                        *err.lock().expect("feeder error") = Some(x);
                        break;
                    }
                }
            }
        })
    };
    let args = StageArgs {
        // Replaying one stage alone: its tensors come from the log, in host memory.
        gpu_plan: None,
        rank,
        replica,
        cfg: cfg.clone(),
        layout,
        init: None,
        resume,
        links: crate::actors::stage::Links::Detached { failure: Default::default() },
        log: Some(log),
        chaos_seed: None,
        cores: vec![],
        latencies_us: Default::default(),
        trace_epoch: None,
    };
    // A thread of its own: the stage's thread pool adopts the thread it starts on.
    let result = std::thread::Builder::new()
        .name(format!("replay-{actor}"))
        .spawn(move || replay_stage(args, rx))
        .context("cannot start the replay thread")?
        .join()
        .map_err(|_| anyhow!("replaying {actor}: the stage panicked"))?;
    let _ = feeder.join();
    if let Some(e) = feeder_err.lock().expect("feeder error").take() {
        return Err(e);
    }
    let log = result.map_err(|e| anyhow!("replaying {actor}: {e}"))?;
    Ok(log.map_or(0, |l| l.position()))
}

fn replay_loader(cfg: &Config, actor: &str, entries: &[Entry], log: ActorLog) -> Result<usize> {
    let replica: usize = actor
        .strip_prefix("loader-")
        .and_then(|r| r.parse().ok())
        .filter(|_| cfg.actor_exists(actor))
        .ok_or_else(|| anyhow!("--actor {actor}: not a loader of this run (dp = {})", cfg.parallel.dp))?;
    let layout = Layout::from_config(cfg)?;
    let sources = crate::train::run::load_sources(cfg)?;
    let d = sources.replica_data(cfg)?;
    let mut st = LoaderArgs {
        replica,
        dp: layout.dp,
        microbatches: layout.microbatches,
        micro_batch_size: cfg.train.micro_batch_size,
        block_size: cfg.model.block_size,
        train: d.train,
        val: d.val,
        eval_set: d.eval_set,
        stages: Arc::new(OnceLock::new()),
        first_rank: layout.rank_of(0),
        last_rank: layout.rank_of(layout.last_stage()),
        log: Some(log),
    };
    for e in entries {
        let msg = match e.kind.as_str() {
            "Train" => LoaderMsg::Train { step: e.step },
            "Eval" => {
                let err = |why: String| anyhow!("{actor}: {}: {why}", e.describe());
                let kind = eval_kind(&e.input("kind").and_then(|b| b.to_str()).map_err(err)?).map_err(err)?;
                let batches = e.input("batches").and_then(|b| b.to_f64()).map_err(err)? as usize;
                LoaderMsg::Eval { step: e.step, kind, batches }
            }
            other => bail!("{actor}: {}: a loader does not handle `{other}`", e.describe()),
        };
        st.on_message(msg).map_err(|e| anyhow!(e))?;
    }
    let mut log = st.log.take().expect("log");
    log.finish().map_err(|e| anyhow!(e))?;
    Ok(log.position())
}

fn replay_reducer(cfg: &Config, entries: &[Entry], log: ActorLog) -> Result<usize> {
    let layout = Layout::from_config(cfg)?;
    let args = ReducerArgs {
        dp: layout.dp,
        stages: Arc::new(OnceLock::new()),
        stage_rank: layout.schedule.stage_rank.clone(),
        log: Some(log),
        chaos_seed: None,
    };
    let mut st = ReducerState::new(args);
    for e in entries {
        let err = |why: String| anyhow!("reducer: {}: {why}", e.describe());
        let grads = e.inputs.iter().map(|b| b.to_f32s()).collect::<Result<_, _>>().map_err(err)?;
        let stage = e.stage.ok_or_else(|| err("names no stage".into()))? as usize;
        let msg = ReducerMsg::Reduce { step: e.step, stage, replica: e.replica as usize, grads };
        st.on_message(msg).map_err(|e| anyhow!(e))?;
    }
    st.close_log().map_err(|e| anyhow!(e))
}

fn replay_coordinator(
    run_dir: &Path,
    cfg: &Config,
    start: u64,
    mid_run: bool,
    entries: &[Entry],
    log: ActorLog,
) -> Result<usize> {
    let layout = Layout::from_config(cfg)?;
    let resume = start_checkpoint(run_dir, start)?;
    let scaler = match resume.as_ref().and_then(|r| r.state.loss_scaler.clone()) {
        Some(s) if cfg.optim.loss_scale == "dynamic" => Some(s),
        _ => crate::optim::scaler::LossScaler::from_config(&cfg.optim),
    };
    let sources = crate::train::run::load_sources(cfg)?;
    let links = Links { stages: vec![], loaders: vec![], reducer: None, monitor: None, checkpointer: None };
    let mut st = CoordinatorState::new(
        run_dir.to_path_buf(),
        cfg.clone(),
        layout,
        start,
        scaler,
        sources.eval_set.clone(),
        sources.val.is_some(),
        links,
        Some(log),
        None,
    );
    if let Some(r) = &resume {
        st.continue_from(&r.state);
    }
    if mid_run {
        st.start_unlogged().map_err(|e| anyhow!("coordinator: starting at step {start}: {e}"))?;
    }
    for e in entries {
        let err = |why: String| anyhow!("coordinator: {}: {why}", e.describe());
        let f64_of = |name: &str| e.input(name).and_then(|b| b.to_f64()).map_err(err);
        let rank = e.stage.unwrap_or(0) as usize;
        let replica = e.replica as usize;
        let msg = match e.kind.as_str() {
            "Start" => CoordinatorMsg::Start,
            "StageDone" => {
                let index = e.input("grad_sumsq.index").and_then(|b| b.to_u32s()).map_err(err)?;
                let sumsq = e.input("grad_sumsq").and_then(|b| b.to_f64s()).map_err(err)?;
                let loss_sum = match e.input("loss_sum") {
                    Ok(b) => Some(b.to_f64().map_err(err)?),
                    Err(_) => None,
                };
                let grad_sumsq = index.into_iter().map(|i| i as usize).zip(sumsq).collect();
                CoordinatorMsg::StageDone(StageReport { rank, replica, step: e.step, grad_sumsq, loss_sum })
            }
            "Applied" => CoordinatorMsg::Applied { rank, replica, step: e.step },
            "Restored" => CoordinatorMsg::Restored { rank, replica },
            "Weights" => CoordinatorMsg::Weights {
                rank,
                replica,
                params: vec![],
                latencies_us: vec![],
                peak_live_bytes: 0,
                trace: vec![],
            },
            "Snapshot" => CoordinatorMsg::Snapshot {
                rank,
                step: e.step,
                tensors: vec![],
                adam_step: f64_of("adam_step")? as u64,
            },
            "EvalDone" => CoordinatorMsg::EvalDone {
                step: e.step,
                kind: eval_kind(&e.input("kind").and_then(|b| b.to_str()).map_err(err)?).map_err(err)?,
                loss_sum: f64_of("loss_sum")?,
                tokens: f64_of("tokens")? as usize,
                predictions: e.input("predictions").and_then(|b| b.to_u32s()).map_err(err)?,
            },
            other => bail!("coordinator: {}: not a message the coordinator logs (`{other}`)", e.describe()),
        };
        st.on_message(msg).map_err(|x| anyhow!("coordinator: {}: {x}", e.describe()))?;
        if st.is_stopped() {
            break;
        }
    }
    let mut log = st.take_log().expect("log");
    log.finish().map_err(|e| anyhow!(e))?;
    Ok(log.position())
}

/// One actor's log against another run's: the first entry that differs.
pub fn compare_logs(actor: &str, a: &Path, b: &Path) -> Result<Option<Divergence>> {
    let (_, ea) = LogReader::read_all(a)?;
    let (_, eb) = LogReader::read_all(b)?;
    for (x, y) in ea.iter().zip(&eb) {
        if let Some(d) = compare(actor, x, y) {
            return Ok(Some(d));
        }
    }
    if ea.len() != eb.len() {
        let n = ea.len().min(eb.len());
        let e = ea.get(n).or(eb.get(n)).expect("the longer log has entry n");
        return Ok(Some(Divergence {
            actor: actor.to_string(),
            seq: n as u64,
            step: e.step,
            mb: e.mb,
            kind: e.kind.clone(),
            what: "the number of messages handled".into(),
            recorded: format!("{} entries", ea.len()),
            replayed: format!("{} entries", eb.len()),
            diff: None,
        }));
    }
    Ok(None)
}

/// `replay --all`: runs the recorded config again (recording, into `out`) and
/// compares every actor's log with the recording. One verdict per actor.
pub fn replay_all(run_dir: &Path, out: &Path, chaos_seed: Option<u64>) -> Result<Vec<Verdict>> {
    let actors = recorded_actors(run_dir)?;
    if actors.is_empty() {
        bail!(
            "{}: no replay logs (record a run with `train --record`)",
            super::replay_dir(run_dir).display()
        );
    }
    let (header, _, path) = read_log(run_dir, &actors[0])?;
    if header.start_step != 0 {
        bail!(
            "{}: the recording starts at step {} (a resumed run); replay --all re-runs from step 0 only",
            path.display(),
            header.start_step
        );
    }
    let cfg = config_of(&header, &path)?;
    let opts = crate::train::run::TrainOptions {
        out_dir: out.to_path_buf(),
        init: None,
        force: true,
        progress: false,
        resume: false,
    };
    crate::train::run::train_with(&cfg, &opts, chaos_seed)?;
    let mut verdicts = Vec::new();
    for a in &actors {
        let (mine, theirs) = (log_path(run_dir, a), log_path(out, a));
        let v = match compare_logs(a, &mine, &theirs)? {
            Some(d) => Verdict::Diverged(d),
            None => {
                let (_, es) = LogReader::read_all(&mine)?;
                Verdict::Identical {
                    actor: a.clone(),
                    entries: es.len(),
                    first_step: es.first().map_or(0, |e| e.step),
                    last_step: es.last().map_or(0, |e| e.step),
                }
            }
        };
        verdicts.push(v);
    }
    Ok(verdicts)
}
