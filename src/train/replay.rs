//! `pipewright replay`: rebuild one actor alone from a recorded run and feed it
//! its recorded inputs in recorded order (`--actor`), or re-run the whole
//! system and compare every actor's log (`--all`).
//!
//! A command over a whole run, so it lives beside the run loop: `--all` trains
//! again, and an actor replayed alone reads the run's data as training does.
//! The recorder the actors write and check through stays below them, in
//! `crate::replay`.

use super::run::{load_sources, train_with, TrainOptions};
use crate::actors::coordinator::{CoordinatorState, Links};
use crate::actors::protocol::{CoordinatorMsg, LoaderMsg, ReducerMsg, StageMsg};
use crate::actors::reducer::ReducerState;
use crate::actors::stage::replay_stage;
use crate::actors::topology::Topology;
use crate::actors::Layout;
use crate::config::Config;
use crate::replay::{
    compare, log_path, replay_dir, ActorLog, Anchor, Checker, Divergence, Entry, FileRef, Header, LogError,
    LogReader, ReadLog,
};
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// How to replay a recorded run.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Start at this step's checkpoint instead of where the log starts.
    pub from_step: Option<u64>,
    /// The directory of logs, relative to the run directory (or absolute):
    /// `replay` by default; `replay.before-step-N` for the part of a run
    /// before it resumed from step N.
    pub log_dir: Option<PathBuf>,
    /// Accept logs without an end marker (a run that crashed or was killed):
    /// replay the entries they hold, and say so.
    pub allow_truncated: bool,
}

impl ReplayOptions {
    pub fn logs_dir(&self, run_dir: &Path) -> PathBuf {
        match &self.log_dir {
            Some(d) => run_dir.join(d),
            None => replay_dir(run_dir),
        }
    }
}

/// The outcome of replaying one actor.
#[derive(Debug)]
pub enum Verdict {
    Identical {
        actor: String,
        entries: usize,
        first_step: u64,
        last_step: u64,
        /// What the verdict does not cover: a recording that stops early.
        note: Option<String>,
    },
    Diverged(Divergence),
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Identical { actor, entries, first_step, last_step, note } => {
                match entries {
                    0 => write!(f, "{actor}: identical: no messages recorded")?,
                    _ => write!(
                        f,
                        "{actor}: identical: {entries} messages (steps {first_step}–{last_step}), every output and state digest matches"
                    )?,
                }
                note.as_ref().map_or(Ok(()), |n| write!(f, "; {n}"))
            }
            Verdict::Diverged(d) => write!(f, "{d}"),
        }
    }
}

/// Which actors a run recorded: the `*.log` names under `RUN/replay/`.
pub fn recorded_actors(run_dir: &Path) -> Result<Vec<String>> {
    actors_in(run_dir, &replay_dir(run_dir))
}

/// The `*.log` names under `logs`, a log directory of the run in `run_dir`.
pub fn actors_in(run_dir: &Path, logs: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    let rd = std::fs::read_dir(logs).with_context(|| {
        let others = log_dirs(run_dir);
        if others.is_empty() {
            format!("{}: no replay logs (record a run with `train --record`)", logs.display())
        } else {
            format!("{}: no replay logs; this run has: {}", logs.display(), others.join(", "))
        }
    })?;
    for e in rd {
        let p = e.with_context(|| format!("{}: cannot list", logs.display()))?.path();
        if p.extension().is_some_and(|x| x == "log") {
            if let Some(stem) = p.file_stem().and_then(|s| s.to_str()) {
                names.push(stem.to_string());
            }
        }
    }
    names.sort();
    if names.is_empty() {
        bail!("{}: no replay logs (record a run with `train --record`)", logs.display());
    }
    Ok(names)
}

/// The log directories of a run: `replay`, and `replay.before-step-N` for
/// each time it resumed while recording.
pub fn log_dirs(run_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(run_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n == "replay" || n.starts_with("replay.before-step-"))
        .collect();
    v.sort();
    v
}

/// What to add to a cut-off log's error when it was refused.
const ALLOW_HINT: &str = "`replay --allow-truncated` replays the entries it holds";

fn read_log(logs: &Path, run_dir: &Path, actor: &str, allow_cut: bool) -> Result<(ReadLog, PathBuf)> {
    let path = logs.join(format!("{actor}.log"));
    // A log that is there but unreadable (a symlink loop) is named by the reader, not called absent.
    if !crate::fsutil::is_present(&path).with_context(|| format!("{}: cannot look for it", path.display()))? {
        let have = actors_in(run_dir, logs).unwrap_or_default();
        bail!("{}: no such replay log; this run recorded: {}", path.display(), have.join(", "));
    }
    let log = match LogReader::read(&path, allow_cut) {
        Err(e) if e.is_cut() => bail!("{e}; {ALLOW_HINT}"),
        r => r?,
    };
    if log.header.actor != actor {
        bail!("{}: the header names actor `{}`, not `{actor}`", path.display(), log.header.actor);
    }
    Ok((log, path))
}

/// How a cut-off log limits a verdict, in words.
fn cut_note(cut: &LogError, path: &Path) -> String {
    let file = path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into());
    match cut {
        LogError::NoTrailer { entries, .. } => format!(
            "as far as recorded: {file} has no end marker after its {entries} entries (the run was cut off)"
        ),
        LogError::Truncated { index, .. } => {
            format!("as far as recorded: {file} is cut inside entry {index} (the run was cut off)")
        }
        other => other.to_string(),
    }
}

fn config_of(h: &Header, path: &Path) -> Result<Config> {
    let origin = format!("{} (header)", path.display());
    let cfg = Config::parse(&h.config, &origin, &[])?;
    // The recorded text itself, too: a log from a build with fewer config
    // fields re-serializes with this build's defaults added, and another hash.
    if cfg.hash() != h.config_hash && crate::replay::blake3_hex(h.config.as_bytes()) != h.config_hash {
        bail!("{origin}: the config's hash does not match the one recorded beside it");
    }
    Ok(cfg)
}

/// The checkpoint of `step` in the run, checked to be the one the log
/// `path` can start from: the very checkpoint a resumed run started from
/// (its state.json's digest is in the header), or one this run wrote (its
/// config hash is the log's).
fn start_checkpoint(
    run_dir: &Path,
    header: &Header,
    path: &Path,
    step: u64,
) -> Result<Option<Arc<crate::checkpoint::Loaded>>> {
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
    let loaded = crate::checkpoint::load(dir)?;
    let state = dir.join("state.json");
    match header.anchor.as_ref().filter(|a| a.step == step) {
        Some(a) => {
            let now = &loaded.state_blake3;
            if *now != a.state_blake3 {
                bail!(
                    "{}: not the checkpoint this run resumed from: its blake3 is {now}, {} recorded {}",
                    state.display(),
                    path.display(),
                    a.state_blake3
                );
            }
        }
        None if loaded.state.config_hash != header.config_hash => bail!(
            "{}: the checkpoint of step {step} belongs to another run: its config hash is {}, {} was recorded with config hash {}",
            state.display(),
            loaded.state.config_hash,
            path.display(),
            header.config_hash
        ),
        None => {}
    }
    Ok(Some(Arc::new(loaded)))
}

/// The `--init` weights a run started from, checked against the digest its
/// log recorded.
fn init_weights(header: &Header, path: &Path) -> Result<Option<Arc<crate::model::io::LoadedWeights>>> {
    let Some(init) = &header.init else { return Ok(None) };
    let p = Path::new(&init.path);
    let bytes = crate::fsutil::read_regular(p, crate::fsutil::memory_cap(), "this machine's memory holds")
        .with_context(|| {
            format!(
                "{}: cannot read the --init weights this run started from (named in {})",
                p.display(),
                path.display()
            )
        })?;
    let now = crate::replay::blake3_hex(&bytes);
    if now != init.blake3 {
        bail!(
            "{}: the --init weights changed since the run: blake3 {now} now, {} recorded {}",
            p.display(),
            path.display(),
            init.blake3
        );
    }
    // Under our names, as the run had them after its own `fit`.
    let mut w = crate::model::io::parse(p, &bytes)?;
    w.fit(&config_of(header, path)?.arch())?;
    Ok(Some(Arc::new(w)))
}

/// Replays `actor` of the run in `run_dir` alone: from where its log starts
/// (fresh or `--init` weights, or the checkpoint a resumed run started from),
/// or from the checkpoint of `--from-step`.
pub fn replay_actor(run_dir: &Path, actor: &str, opts: &ReplayOptions) -> Result<Verdict> {
    if actor == "monitor" {
        bail!(
            "the monitor is not recorded: what it writes (timings, tokens/s) depends on timing; \
             its deterministic inputs are checked as the coordinator's `Step` messages to it"
        );
    }
    let logs = opts.logs_dir(run_dir);
    let (ReadLog { header, entries, cut }, path) = read_log(&logs, run_dir, actor, opts.allow_truncated)?;
    let cfg = config_of(&header, &path)?;
    belongs_to_run(run_dir, &logs, actor, &header, &path, &cfg)?;
    let start = opts.from_step.unwrap_or(header.start_step);
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
    // A cut-off recording ends where it ends: what the actor does after its
    // last recorded message is not a divergence.
    let checker = Checker::new(entries.clone(), skip, slot.clone()).open_ended(cut.is_some());
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
        let resume = start_checkpoint(run_dir, &header, &path, start)?;
        replay_coordinator(run_dir, &cfg, start, mid_run, resume, &entries[skip..], log)?
    } else if actor == "checkpointer" {
        need_payloads(&header, &path, actor)?;
        replay_checkpointer(&cfg, &entries[skip..], log)?
    } else {
        bail!("{}: `{actor}` is not an actor pipewright can replay", path.display());
    };
    if let Some(d) = slot.lock().expect("divergence slot").take() {
        return Ok(Verdict::Diverged(d.name_params(&cfg.arch())));
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
    Ok(Verdict::Identical {
        actor: actor.to_string(),
        entries: entries.len() - skip,
        first_step,
        last_step,
        note: cut.map(|c| cut_note(&c, &path)),
    })
}

/// What ties a log to one run: its settings and where it started.
fn run_identity(h: &Header) -> (&String, u64, &Option<FileRef>, &Option<Anchor>) {
    (&h.config_hash, h.start_step, &h.init, &h.anchor)
}

/// A log replayed alone must be one of this run's: its header agrees with
/// every other log of its directory (what `--all` checks) and, for the
/// run's current logs, with the run's `config.toml`. Without this a log
/// copied in from a run with another seed replays "identical" against
/// itself.
fn belongs_to_run(
    run_dir: &Path,
    logs: &Path,
    actor: &str,
    header: &Header,
    path: &Path,
    cfg: &Config,
) -> Result<()> {
    for other in actors_in(run_dir, logs)?.iter().filter(|a| *a != actor) {
        let other_path = logs.join(format!("{other}.log"));
        // A sibling that cannot be read is its own replay's error, not this one's.
        let Ok(o) = LogReader::open(&other_path) else { continue };
        if run_identity(&o.header) != run_identity(header) {
            bail!(
                "{}: recorded by another run than {} ({}): the logs of one directory must come from one run",
                path.display(),
                other_path.display(),
                identity_difference(header, &o.header)
            );
        }
    }
    if logs != replay_dir(run_dir) {
        return Ok(());
    }
    let own = run_dir.join("config.toml");
    let Ok(text) = std::fs::read_to_string(&own) else { return Ok(()) };
    if crate::replay::blake3_hex(text.as_bytes()) == header.config_hash {
        return Ok(());
    }
    let run_cfg = Config::parse(&text, &own.display().to_string(), &[]).with_context(|| {
        format!("{}: cannot check which run {} belongs to", own.display(), path.display())
    })?;
    if run_cfg.hash() == header.config_hash {
        return Ok(());
    }
    let seeds = match (cfg.train.seed, run_cfg.train.seed) {
        (a, b) if a != b => format!(" (train.seed {a} in the log, {b} in the run)"),
        _ => String::new(),
    };
    bail!(
        "{}: recorded by another run: its config hash is {}, {} hashes to {}{seeds}",
        path.display(),
        header.config_hash,
        own.display(),
        run_cfg.hash()
    )
}

/// How two logs' headers disagree, in words.
fn identity_difference(a: &Header, b: &Header) -> String {
    if a.config_hash != b.config_hash {
        format!("config hash {} vs {}", a.config_hash, b.config_hash)
    } else if a.start_step != b.start_step {
        format!("first step {} vs {}", a.start_step, b.start_step)
    } else {
        "they start from other weights".to_string()
    }
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

/// The message a stage received, rebuilt from its log entry.
fn stage_msg(e: &Entry, path: &Path, run_dir: &Path) -> Result<StageMsg> {
    StageMsg::from_entry(e, run_dir).map_err(|why| anyhow!("{}: {}: {why}", path.display(), e.describe()))
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
    let resume = start_checkpoint(run_dir, header, path, start)?;
    let init = if start == 0 { init_weights(header, path)? } else { None };
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
    // Replaying one stage alone: its tensors come from the log, in host memory.
    let detached = crate::actors::stage::Links::Detached { failure: Default::default() };
    let mut args = alone(cfg, layout, init, resume).stage_args(replica, rank, detached, vec![])?;
    args.log = Some(log);
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

/// The topology of one actor replayed alone: nothing to spawn, no log of its
/// own opened (it checks against the recorded one), no chaos, no trace, and
/// tensors in host memory.
fn alone(
    cfg: &Config,
    layout: Layout,
    init: Option<Arc<crate::model::io::LoadedWeights>>,
    resume: Option<Arc<crate::checkpoint::Loaded>>,
) -> Topology {
    Topology {
        cfg: cfg.clone(),
        layout,
        run_dir: PathBuf::new(),
        origin: None,
        init,
        resume,
        chaos_seed: None,
        trace: None,
        gpu_plan: None,
    }
}

fn replay_loader(cfg: &Config, actor: &str, entries: &[Entry], log: ActorLog) -> Result<usize> {
    let replica: usize = actor
        .strip_prefix("loader-")
        .and_then(|r| r.parse().ok())
        .filter(|_| cfg.actor_exists(actor))
        .ok_or_else(|| anyhow!("--actor {actor}: not a loader of this run (dp = {})", cfg.parallel.dp))?;
    let layout = Layout::from_config(cfg)?;
    let sources = load_sources(cfg)?;
    let d = sources.replica_data(cfg)?;
    let mut st = alone(cfg, layout, None, None).loader_args(replica, d, Arc::new(OnceLock::new()))?;
    st.log = Some(log);
    for e in entries {
        let msg = LoaderMsg::from_entry(e).map_err(|why| anyhow!("{actor}: {}: {why}", e.describe()))?;
        st.on_message(msg).map_err(|e| anyhow!(e))?;
    }
    let mut log = st.log.take().expect("log");
    log.finish().map_err(|e| anyhow!(e))?;
    Ok(log.position())
}

fn replay_reducer(cfg: &Config, entries: &[Entry], log: ActorLog) -> Result<usize> {
    let layout = Layout::from_config(cfg)?;
    let mut args = alone(cfg, layout, None, None).reducer_args(Arc::new(OnceLock::new()))?;
    args.log = Some(log);
    let mut st = ReducerState::new(args);
    for e in entries {
        let msg = ReducerMsg::from_entry(e).map_err(|why| anyhow!("reducer: {}: {why}", e.describe()))?;
        st.on_message(msg).map_err(|e| anyhow!(e))?;
    }
    st.close_log().map_err(|e| anyhow!(e))
}

fn replay_coordinator(
    run_dir: &Path,
    cfg: &Config,
    start: u64,
    mid_run: bool,
    resume: Option<Arc<crate::checkpoint::Loaded>>,
    entries: &[Entry],
    log: ActorLog,
) -> Result<usize> {
    let layout = Layout::from_config(cfg)?;
    let saved = resume.as_ref().and_then(|r| r.state.loss_scaler.clone());
    let scaler = crate::optim::scaler::LossScaler::for_run(&cfg.optim, saved);
    let sources = load_sources(cfg)?;
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
        let msg =
            CoordinatorMsg::from_entry(e).map_err(|why| anyhow!("coordinator: {}: {why}", e.describe()))?;
        st.on_message(msg).map_err(|x| anyhow!("coordinator: {}: {x}", e.describe()))?;
        if st.is_stopped() {
            break;
        }
    }
    let mut log = st.take_log().expect("log");
    log.finish().map_err(|e| anyhow!(e))?;
    Ok(log.position())
}

/// Writes each recorded snapshot again into a scratch directory and checks
/// the digests of the files against those the checkpointer wrote.
fn replay_checkpointer(cfg: &Config, entries: &[Entry], mut log: ActorLog) -> Result<usize> {
    let scratch = scratch_dir("checkpointer")?;
    let result = rewrite_checkpoints(cfg, entries, &mut log, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    result?;
    log.finish().map_err(|e| anyhow!(e))?;
    Ok(log.position())
}

fn rewrite_checkpoints(cfg: &Config, entries: &[Entry], log: &mut ActorLog, scratch: &Path) -> Result<()> {
    use crate::actors::checkpointer::{snapshot_of, write};
    let (keep, keep_every) = (cfg.checkpoint.keep, cfg.checkpoint.keep_every as u64);
    for e in entries {
        let (tensors, state) =
            snapshot_of(e).map_err(|why| anyhow!("checkpointer: {}: {why}", e.describe()))?;
        let (_, entry) = write(scratch, keep, keep_every, tensors, state, Some(true));
        log.begin(entry.expect("a logged write gives its entry"));
        log.end();
    }
    Ok(())
}

/// A fresh directory under the system's temp dir.
pub fn scratch_dir(what: &str) -> Result<PathBuf> {
    let base = std::env::temp_dir();
    for i in 0..1000u32 {
        let p = base.join(format!("pipewright-replay-{what}-{}-{i}", std::process::id()));
        if std::fs::create_dir(&p).is_ok() {
            return Ok(p);
        }
    }
    bail!("{}: cannot create a scratch directory", base.display())
}

/// One actor's log against another run's: the first entry that differs.
pub fn compare_logs(actor: &str, a: &Path, b: &Path) -> Result<Option<Divergence>> {
    let (header, ea) = LogReader::read_all(a)?;
    let (_, eb) = LogReader::read_all(b)?;
    let gpt = config_of(&header, a)?.arch();
    Ok(first_difference(actor, &ea, &eb, false).map(|d| d.name_params(&gpt)))
}

/// The first difference between recorded entries `ea` and re-run entries
/// `eb`; with `prefix`, a recording that stops early only has to match as
/// far as it goes.
fn first_difference(actor: &str, ea: &[Entry], eb: &[Entry], prefix: bool) -> Option<Divergence> {
    for (x, y) in ea.iter().zip(eb) {
        if let Some(d) = compare(actor, x, y) {
            return Some(d);
        }
    }
    if ea.len() == eb.len() || (prefix && ea.len() < eb.len()) {
        return None;
    }
    let n = ea.len().min(eb.len());
    let e = ea.get(n).or(eb.get(n)).expect("the longer log has entry n");
    Some(Divergence {
        actor: actor.to_string(),
        seq: n as u64,
        step: e.step,
        mb: e.mb,
        kind: e.kind.clone(),
        what: "the number of messages handled".into(),
        recorded: format!("{} entries", ea.len()),
        replayed: format!("{} entries", eb.len()),
        diff: None,
    })
}

/// What the run starts from when `replay --all` runs it again.
enum Start {
    Fresh,
    /// `--init` weights, checked against their recorded digest.
    Init(PathBuf),
    /// The checkpoint a resumed run started from, checked likewise.
    Checkpoint(PathBuf),
}

/// A recorded run, checked and ready to run again (`replay --all`):
/// everything that can be refused is refused before anything runs.
pub struct WholeRun {
    logs: PathBuf,
    actors: Vec<String>,
    cfg: Config,
    start: Start,
    start_step: u64,
    /// Logs without an end marker (accepted with `--allow-truncated`).
    cut: Vec<(String, LogError)>,
}

/// Checks the recording of the run in `run_dir` for `replay --all`: every
/// log readable and whole (or, with `allow_truncated`, cut off), all from
/// one run, and its starting weights present and unchanged.
pub fn prepare_all(run_dir: &Path, opts: &ReplayOptions) -> Result<WholeRun> {
    if opts.from_step.is_some() {
        bail!("--from-step: replay --all re-runs from where the recording starts");
    }
    let logs = opts.logs_dir(run_dir);
    let actors = actors_in(run_dir, &logs)?;
    let mut first: Option<(Header, PathBuf)> = None;
    let mut cut = Vec::new();
    for a in &actors {
        let path = logs.join(format!("{a}.log"));
        // Entry by entry: only the chain, the order and the end are checked here.
        let mut r = LogReader::open(&path)?;
        loop {
            match r.next_entry() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) if e.is_cut() && opts.allow_truncated => {
                    cut.push((a.clone(), e));
                    break;
                }
                Err(e) if e.is_cut() => bail!("{e}; {ALLOW_HINT} and compares them with the re-run"),
                Err(e) => return Err(e.into()),
            }
        }
        let h = r.header;
        match &first {
            None => first = Some((h, path)),
            Some((f, fp)) => {
                if run_identity(f) != run_identity(&h) {
                    bail!(
                        "{} and {}: logs of different runs (their config or starting point differ)",
                        fp.display(),
                        path.display()
                    );
                }
            }
        }
    }
    let (header, path) = first.expect("at least one log");
    let cfg = config_of(&header, &path)?;
    cfg.validate()?;
    missing_logs(&logs, &actors, &cfg)?;
    load_sources(&cfg)?;
    let start = if header.start_step > 0 {
        let c = start_checkpoint(run_dir, &header, &path, header.start_step)?.expect("step > 0");
        Start::Checkpoint(c.dir.clone())
    } else if let Some(init) = &header.init {
        init_weights(&header, &path)?;
        Start::Init(PathBuf::from(&init.path))
    } else {
        Start::Fresh
    };
    Ok(WholeRun { logs, actors, cfg, start, start_step: header.start_step, cut })
}

impl WholeRun {
    /// Where the re-run starts, in words.
    pub fn starts_from(&self) -> String {
        match &self.start {
            Start::Fresh => "step 0".into(),
            Start::Init(p) => format!("step 0 with the --init weights {}", p.display()),
            Start::Checkpoint(d) => format!("the checkpoint of step {} ({})", self.start_step, d.display()),
        }
    }

    /// Runs the recorded config again (recording, into `out`) and compares
    /// every actor's log with the recording. One verdict per actor.
    pub fn run(&self, out: &Path, chaos_seed: Option<u64>) -> Result<Vec<Verdict>> {
        let mut opts = TrainOptions {
            out_dir: out.to_path_buf(),
            init: None,
            force: true,
            progress: false,
            resume: false,
        };
        match &self.start {
            Start::Fresh => {}
            Start::Init(p) => opts.init = Some(p.clone()),
            Start::Checkpoint(dir) => {
                link_checkpoint(dir, out, self.start_step)?;
                opts.resume = true;
            }
        }
        train_with(&self.cfg, &opts, chaos_seed)?;
        // A run that was cut off: every actor stopped early, so each log only
        // has to match the re-run as far as it goes.
        let prefix = !self.cut.is_empty();
        // An actor the re-run logged and the recording lacks was never compared.
        let rerun_actors = actors_in(out, &replay_dir(out))?;
        let unrecorded: Vec<String> = rerun_actors
            .iter()
            .filter(|a| !self.actors.contains(a))
            .map(|a| self.logs.join(format!("{a}.log")).display().to_string())
            .collect();
        if !unrecorded.is_empty() {
            bail!("{}: missing, though the re-run of the recorded config logged it", unrecorded.join(", "));
        }
        let mut verdicts = Vec::new();
        for a in &self.actors {
            let mine = self.logs.join(format!("{a}.log"));
            let recorded = LogReader::read(&mine, prefix)?;
            let (_, rerun) = LogReader::read_all(&log_path(out, a))?;
            let es = &recorded.entries;
            let v = match first_difference(a, es, &rerun, prefix) {
                Some(d) => Verdict::Diverged(d.name_params(&self.cfg.arch())),
                None => {
                    let note = match &recorded.cut {
                        Some(c) => Some(format!("{}; the re-run handled {}", cut_note(c, &mine), rerun.len())),
                        None if es.len() < rerun.len() => Some(format!(
                            "as far as recorded: {a} stopped with the cut-off run and closed its log after {} entries; the re-run handled {}",
                            es.len(),
                            rerun.len()
                        )),
                        None => None,
                    };
                    Verdict::Identical {
                        actor: a.clone(),
                        entries: es.len(),
                        first_step: es.first().map_or(self.start_step, |e| e.step),
                        last_step: es.last().map_or(self.start_step, |e| e.step),
                        note,
                    }
                }
            };
            verdicts.push(v);
        }
        Ok(verdicts)
    }
}

/// Places the checkpoint in `dir` as the only one of the run in `out`, as
/// hard links where the file system allows (checkpoint files are replaced,
/// never written in place, so the original cannot change through them).
fn link_checkpoint(dir: &Path, out: &Path, step: u64) -> Result<()> {
    let to = crate::checkpoint::checkpoints_dir(out).join(crate::checkpoint::step_dir_name(step));
    std::fs::create_dir_all(&to).with_context(|| format!("{}: cannot create", to.display()))?;
    for e in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let from = e.with_context(|| format!("{}: cannot list", dir.display()))?.path();
        let dst = to.join(from.file_name().expect("a directory entry has a name"));
        if std::fs::hard_link(&from, &dst).is_err() {
            std::fs::copy(&from, &dst)
                .with_context(|| format!("cannot copy {} to {}", from.display(), dst.display()))?;
        }
    }
    Ok(())
}

/// Refuses a recording without the log of an actor its config runs (the
/// coordinator, every replica's loader and stages): a replay of the whole run
/// compared without it would call a run identical that was never checked.
fn missing_logs(logs: &Path, actors: &[String], cfg: &crate::config::Config) -> Result<()> {
    let layout = crate::actors::Layout::from_config(cfg)?;
    let mut want = vec!["coordinator".to_string()];
    for replica in 0..layout.dp {
        want.push(format!("loader-{replica}"));
        for rank in 0..layout.pp {
            want.push(crate::actors::coordinator::stage_name(rank, replica));
        }
    }
    let missing: Vec<String> = want
        .into_iter()
        .filter(|a| !actors.contains(a))
        .map(|a| logs.join(format!("{a}.log")).display().to_string())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{}: missing, though the recorded config runs {}: every actor's log is needed to replay the whole run \
             (`replay --actor NAME` replays one of those present)",
            missing.join(", "),
            if missing.len() == 1 { "that actor" } else { "those actors" }
        );
    }
    Ok(())
}

/// `replay --all` in one call: [`prepare_all`], then [`WholeRun::run`].
pub fn replay_all(
    run_dir: &Path,
    out: &Path,
    opts: &ReplayOptions,
    chaos_seed: Option<u64>,
) -> Result<Vec<Verdict>> {
    prepare_all(run_dir, opts)?.run(out, chaos_seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(config: String, config_hash: String) -> Header {
        let (actor, payloads, start_step) = ("stage-0".to_string(), false, 0);
        Header { actor, config, config_hash, payloads, start_step, init: None, anchor: None }
    }

    #[test]
    fn a_log_from_a_build_with_fewer_config_fields_still_reads_its_config() {
        let text = Config::default().to_toml_string();
        let older: String =
            text.lines().filter(|l| !l.starts_with("tp_timeout_s")).map(|l| l.to_string() + "\n").collect();
        assert_ne!(older, text, "the example must leave out a field");
        let path = Path::new("replay/stage-0.log");
        let cfg =
            config_of(&header(older.clone(), crate::replay::blake3_hex(older.as_bytes())), path).unwrap();
        assert_eq!(cfg, Config::default());
        let e = config_of(&header(older, "0".repeat(64)), path).unwrap_err().to_string();
        assert!(e.contains("the config's hash does not match"), "{e}");
    }
}
