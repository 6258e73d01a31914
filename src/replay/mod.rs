//! Actor-level deterministic replay.
//!
//! With `replay.record` on, every actor writes `RUN/replay/<actor>.log`: an
//! [`Entry`] per handled message with the digests of its payload tensors,
//! of what the actor sent while handling it, and of its state changes (a
//! stage's parameters after each optimizer step). `replay.payloads` names the
//! actors whose tensor bytes are kept too, so they can be replayed alone.
//!
//! Handling order is the order in which an actor *uses* its messages, which is
//! what makes a log independent of delivery order: a stage's compute thread
//! takes its inputs in schedule order whatever order they arrived in, and the
//! actors that gather (the coordinator's per-step reports, the reducer's
//! replicas) log a gather's messages in the order they are combined —
//! (replica, rank) — when it completes. Messages whose timing is the point and
//! whose content is not computed (`Saved`, `StopRequested`, `Failed`) and
//! timing fields (ms, tokens/s, latencies) are left out.
//!
//! [`ActorLog`] writes a log, or — during a replay — checks what the actor
//! does now against the recorded log, entry by entry, and keeps the first
//! divergence. The replay command (`crate::train::replay`) rebuilds one actor
//! alone and feeds it its recorded inputs.
//!
//! A log ends with a trailer only when its actor closed it; the coordinator
//! closes its own only when the run completed, so a run that failed or was
//! killed always leaves at least one log without one. Each header says where
//! the run started ([`Origin`]): step 0 from fresh or `--init` weights, or a
//! checkpoint, which `checkpoint::pin` keeps out of `checkpoint.keep`'s reach.

pub mod key;
pub mod log;

pub use log::{
    Anchor, Blob, DType, Digest, Entry, FileRef, Header, LogError, LogReader, LogWriter, ReadLog, Sent,
};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

pub fn replay_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("replay")
}

pub fn log_path(run_dir: &Path, actor: &str) -> PathBuf {
    replay_dir(run_dir).join(format!("{actor}.log"))
}

/// Whether `actor` keeps payloads under `replay.payloads` (names, or "all").
pub fn keeps_payloads(list: &[String], actor: &str) -> bool {
    list.iter().any(|a| a == "all" || a == actor)
}

/// The first place where a replay differs from its recording.
#[derive(Clone, Debug, PartialEq)]
pub struct Divergence {
    pub actor: String,
    pub seq: u64,
    pub step: u64,
    pub mb: Option<u64>,
    pub kind: String,
    /// What differs, in words: "output `data` of Activation mb 2 to stage-2".
    pub what: String,
    pub recorded: String,
    pub replayed: String,
    /// Max abs and rel difference (and where), when both sides' bytes are known.
    pub diff: Option<NumDiff>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct NumDiff {
    pub max_abs: f64,
    pub max_rel: f64,
    pub index: usize,
    pub differing: usize,
    pub len: usize,
    /// The blob the elements are of (a parameter's name for weights, optimizer
    /// state and gradients; `grad_sumsq` for a stage's per-tensor Σg²).
    pub tensor: String,
    /// For `grad_sumsq`: the norm slot (a block of a parameter, `optim::zero`)
    /// whose Σg² is element `index`, and the block named once
    /// [`Divergence::name_params`] knew the model.
    pub param: Option<(usize, Option<String>)>,
}

impl NumDiff {
    /// Where the largest difference is, named: `h.2.attn.c_attn.weight[1234]`,
    /// or `grad_sumsq[3] (the Σg² of h.0.attn.c_attn.weight)`.
    pub fn at(&self) -> String {
        let element = format!("{}[{}]", self.tensor, self.index);
        match &self.param {
            Some((_, Some(name))) => format!("{element} (the Σg² of {name})"),
            Some((slot, None)) => format!("{element} (the Σg² of norm slot {slot})"),
            None => element,
        }
    }
}

impl Divergence {
    /// Names the parameter a `grad_sumsq` difference is of, from the model the
    /// log was recorded with (a stage reports its Σg² by norm slot: one per
    /// block of each tensor, tensors in canonical order).
    pub fn name_params(mut self, cfg: &crate::model::Arch) -> Divergence {
        if let Some(NumDiff { param: Some((slot, name)), .. }) = &mut self.diff {
            *name = slot_name(cfg, *slot);
        }
        self
    }
}

/// `h.0.mlp.c_fc.weight` for a one-block tensor's slot, else
/// `h.0.mlp.c_fc.weight, block 7 (elements 7168..8192)`.
fn slot_name(cfg: &crate::model::Arch, slot: usize) -> Option<String> {
    use crate::optim::zero;
    let first = zero::first_slots(cfg);
    let c = first.partition_point(|&f| f <= slot).checked_sub(1)?;
    let tensors = crate::model::params::all_tensors(cfg);
    let (name, shape) = tensors.get(c)?;
    let numel: usize = shape.iter().product();
    let block = slot - first[c];
    match zero::blocks(numel) {
        1 if block == 0 => Some(name.clone()),
        n if block < n => {
            let end = ((block + 1) * zero::BLOCK).min(numel);
            Some(format!("{name}, block {block} (elements {}..{end})", block * zero::BLOCK))
        }
        _ => None,
    }
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} diverges at seq {}, step {}", self.actor, self.seq, self.step)?;
        if let Some(mb) = self.mb {
            write!(f, ", microbatch {mb}")?;
        }
        write!(
            f,
            ", message {}: {} differs (recorded {}, replayed {})",
            self.kind, self.what, self.recorded, self.replayed
        )?;
        if let Some(d) = &self.diff {
            write!(
                f,
                "; max abs diff {:.3e}, max rel diff {:.3e} (at {}; {} of {} elements differ)",
                d.max_abs,
                d.max_rel,
                d.at(),
                d.differing,
                d.len
            )?;
        }
        Ok(())
    }
}

fn short(d: &Digest) -> String {
    d[..6].iter().map(|b| format!("{b:02x}")).collect::<String>() + "…"
}

fn num_diff(a: &Blob, b: &Blob) -> Option<NumDiff> {
    let (x, y): (Vec<f64>, Vec<f64>) = match (a.dtype, b.dtype) {
        (DType::F32, DType::F32) => (
            a.to_f32s().ok()?.into_iter().map(f64::from).collect(),
            b.to_f32s().ok()?.into_iter().map(f64::from).collect(),
        ),
        (DType::F64, DType::F64) => (a.to_f64s().ok()?, b.to_f64s().ok()?),
        (DType::U32, DType::U32) => (
            a.to_u32s().ok()?.into_iter().map(f64::from).collect(),
            b.to_u32s().ok()?.into_iter().map(f64::from).collect(),
        ),
        _ => return None,
    };
    if x.len() != y.len() {
        return None;
    }
    let mut d = NumDiff {
        max_abs: 0.0,
        max_rel: 0.0,
        index: 0,
        differing: 0,
        len: x.len(),
        tensor: a.name.clone(),
        param: None,
    };
    for (i, (&p, &q)) in x.iter().zip(&y).enumerate() {
        if p.to_bits() == q.to_bits() {
            continue;
        }
        d.differing += 1;
        let abs = (p - q).abs();
        let rel = abs / p.abs().max(q.abs()).max(f64::MIN_POSITIVE);
        if abs > d.max_abs || abs.is_nan() {
            d.max_abs = abs;
            d.index = i;
        }
        d.max_rel = d.max_rel.max(rel);
    }
    Some(d)
}

fn compare_blobs(
    what: &str,
    rec: &[Blob],
    now: &[Blob],
) -> Option<(String, String, String, Option<NumDiff>)> {
    let names = |v: &[Blob]| v.iter().map(|b| b.name.clone()).collect::<Vec<_>>().join(", ");
    if rec.len() != now.len() || rec.iter().zip(now).any(|(a, b)| a.name != b.name) {
        return Some((format!("{what}: the tensors"), names(rec), names(now), None));
    }
    for (a, b) in rec.iter().zip(now) {
        if a.digest != b.digest || a.len != b.len || a.dtype != b.dtype {
            let rs = format!("{} {:?}[{}]", short(&a.digest), a.dtype, a.len);
            let ns = format!("{} {:?}[{}]", short(&b.digest), b.dtype, b.len);
            let mut diff = num_diff(a, b);
            if let Some(d) = diff.as_mut().filter(|_| a.name == key::GRAD_SUMSQ) {
                // Its sibling blob says which parameter each Σg² is of.
                let index = rec.iter().find(|b| b.name == key::GRAD_SUMSQ_INDEX);
                let canonical = index.and_then(|b| b.to_u32s().ok()).and_then(|ix| ix.get(d.index).copied());
                d.param = canonical.map(|c| (c as usize, None));
            }
            return Some((format!("{what} `{}`", a.name), rs, ns, diff));
        }
    }
    None
}

/// The first difference between a recorded entry and its replay.
pub fn compare(actor: &str, rec: &Entry, now: &Entry) -> Option<Divergence> {
    let div = |what: String, recorded: String, replayed: String, diff| Divergence {
        actor: actor.to_string(),
        seq: rec.seq,
        step: rec.step,
        mb: rec.mb,
        kind: rec.kind.clone(),
        what,
        recorded,
        replayed,
        diff,
    };
    let head = |e: &Entry| {
        format!(
            "{} from {} (step {}, stage {:?}, mb {:?}, eval {})",
            e.kind, e.from, e.step, e.stage, e.mb, e.eval
        )
    };
    if (&rec.kind, &rec.from, rec.step, rec.stage, rec.mb, rec.eval, rec.replica)
        != (&now.kind, &now.from, now.step, now.stage, now.mb, now.eval, now.replica)
    {
        return Some(div("the message handled".into(), head(rec), head(now), None));
    }
    if let Some((w, r, n, d)) = compare_blobs("input", &rec.inputs, &now.inputs) {
        return Some(div(w, r, n, d));
    }
    let sends = |e: &Entry| {
        e.sent.iter().map(|s| format!("{} mb {:?} to {}", s.kind, s.mb, s.to)).collect::<Vec<_>>().join("; ")
    };
    if rec.sent.len() != now.sent.len()
        || rec.sent.iter().zip(&now.sent).any(|(a, b)| (&a.to, &a.kind, a.mb) != (&b.to, &b.kind, b.mb))
    {
        return Some(div(
            "the messages sent".into(),
            format!("[{}]", sends(rec)),
            format!("[{}]", sends(now)),
            None,
        ));
    }
    for (a, b) in rec.sent.iter().zip(&now.sent) {
        let what = match a.mb {
            Some(mb) => format!("output of {} mb {mb} to {}:", a.kind, a.to),
            None => format!("output of {} to {}:", a.kind, a.to),
        };
        if let Some((w, r, n, d)) = compare_blobs(&what, &a.blobs, &b.blobs) {
            return Some(div(w, r, n, d));
        }
    }
    if let Some((w, r, n, d)) = compare_blobs("state", &rec.state, &now.state) {
        return Some(div(w, r, n, d));
    }
    None
}

/// Checks a replay against the recorded entries as they are produced.
pub struct Checker {
    expected: Arc<Vec<Entry>>,
    next: usize,
    divergence: Arc<Mutex<Option<Divergence>>>,
    /// The recording was cut off: entries past its end are not compared.
    open_ended: bool,
}

impl Checker {
    pub fn new(
        expected: Arc<Vec<Entry>>,
        skip: usize,
        divergence: Arc<Mutex<Option<Divergence>>>,
    ) -> Checker {
        Checker { expected, next: skip, divergence, open_ended: false }
    }

    pub fn open_ended(mut self, yes: bool) -> Checker {
        self.open_ended = yes;
        self
    }

    fn check(&mut self, actor: &str, mut e: Entry) {
        let mut slot = self.divergence.lock().expect("divergence slot");
        if slot.is_some() {
            return;
        }
        let Some(rec) = self.expected.get(self.next) else {
            if self.open_ended {
                return;
            }
            *slot = Some(Divergence {
                actor: actor.to_string(),
                seq: self.next as u64,
                step: e.step,
                mb: e.mb,
                kind: e.kind.clone(),
                what: "the number of messages handled".into(),
                recorded: format!("{} entries", self.expected.len()),
                replayed: format!("more: {}", e.describe()),
                diff: None,
            });
            return;
        };
        e.seq = rec.seq;
        *slot = compare(actor, rec, &e);
        self.next += 1;
    }

    pub fn position(&self) -> usize {
        self.next
    }
}

enum Sink {
    Write(Option<LogWriter>),
    Check(Checker),
}

/// An actor's recorder: writes its log, or checks a replay against it.
pub struct ActorLog {
    pub actor: String,
    payloads: bool,
    current: Option<Entry>,
    /// Entries of a gather, emitted in combination order when it completes.
    gathered: Vec<Entry>,
    sink: Sink,
    /// The first write error; recording stops there and the run reports it.
    pub error: Option<String>,
    /// Counts this log as open until it is closed or dropped.
    _open: Option<OpenLog>,
}

/// Logs still open, by replay directory: a run is over for its caller only
/// once every actor has closed its log (some close after the run's result is
/// known, from threads nobody joins).
static OPEN_LOGS: Mutex<BTreeMap<PathBuf, usize>> = Mutex::new(BTreeMap::new());
static LOG_CLOSED: Condvar = Condvar::new();

struct OpenLog(PathBuf);

impl OpenLog {
    fn new(dir: PathBuf) -> OpenLog {
        *OPEN_LOGS.lock().expect("open logs").entry(dir.clone()).or_default() += 1;
        OpenLog(dir)
    }
}

impl Drop for OpenLog {
    fn drop(&mut self) {
        let mut open = OPEN_LOGS.lock().expect("open logs");
        if let Some(n) = open.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.0);
            }
        }
        LOG_CLOSED.notify_all();
    }
}

/// Waits until every log under `run_dir/replay` is closed, at most `limit`;
/// false if some are still open then.
pub fn wait_closed(run_dir: &Path, limit: std::time::Duration) -> bool {
    let dir = replay_dir(run_dir);
    let open = OPEN_LOGS.lock().expect("open logs");
    let (_open, timeout) =
        LOG_CLOSED.wait_timeout_while(open, limit, |o| o.contains_key(&dir)).expect("open logs");
    !timeout.timed_out()
}

impl ActorLog {
    pub fn record(run_dir: &Path, actor: &str, header: Header) -> Result<ActorLog, LogError> {
        let dir = replay_dir(run_dir);
        std::fs::create_dir_all(&dir).map_err(LogError::io(&dir))?;
        let payloads = header.payloads;
        let w = LogWriter::create(&log_path(run_dir, actor), &header)?;
        Ok(ActorLog {
            actor: actor.to_string(),
            payloads,
            current: None,
            gathered: Vec::new(),
            sink: Sink::Write(Some(w)),
            error: None,
            _open: Some(OpenLog::new(dir)),
        })
    }

    /// A log that compares against `checker` instead of writing; it keeps every
    /// payload so a divergence can show by how much values differ.
    pub fn check(actor: &str, checker: Checker) -> ActorLog {
        ActorLog {
            actor: actor.to_string(),
            payloads: true,
            current: None,
            gathered: Vec::new(),
            sink: Sink::Check(checker),
            error: None,
            _open: None,
        }
    }

    /// Entries checked so far, counting those skipped at the start (a replay).
    pub fn position(&self) -> usize {
        match &self.sink {
            Sink::Check(c) => c.position(),
            Sink::Write(_) => 0,
        }
    }

    /// Tensors keep their bytes in this log.
    pub fn payloads(&self) -> bool {
        self.payloads
    }

    fn emit(&mut self, e: Entry) {
        match &mut self.sink {
            Sink::Write(Some(w)) => {
                if self.error.is_none() {
                    if let Err(err) = w.append(e) {
                        self.error = Some(err.to_string());
                    }
                }
            }
            Sink::Write(None) => self.error = Some("written after the log was closed".into()),
            Sink::Check(c) => c.check(&self.actor, e),
        }
    }

    /// A message is being handled: the previous entry is complete.
    pub fn begin(&mut self, e: Entry) {
        if let Some(prev) = self.current.take() {
            self.emit(prev);
        }
        self.current = Some(e);
    }

    /// A message that is part of a gather; it is logged when the gather completes.
    pub fn gather(&mut self, e: Entry) {
        if let Some(prev) = self.current.take() {
            self.emit(prev);
        }
        self.gathered.push(e);
    }

    /// The gather is complete: its entries in (replica, stage) order; what is
    /// sent from now on belongs to the last of them.
    pub fn gather_done(&mut self) {
        let mut g = std::mem::take(&mut self.gathered);
        g.sort_by_key(|e| (e.replica, e.stage, e.mb));
        let last = g.pop();
        for e in g {
            self.emit(e);
        }
        self.current = last;
    }

    pub fn sent(&mut self, to: &str, kind: &str, mb: Option<u64>, blobs: Vec<Blob>) {
        if let Some(e) = &mut self.current {
            e.sent.push(Sent { to: to.to_string(), kind: kind.to_string(), mb, blobs });
        }
    }

    pub fn state(&mut self, blobs: Vec<Blob>) {
        if let Some(e) = &mut self.current {
            e.state.extend(blobs);
        }
    }

    /// The current entry is complete: write it and flush the file, so the log
    /// is whole even if the process ends before this actor is stopped.
    pub fn end(&mut self) {
        if let Some(prev) = self.current.take() {
            self.emit(prev);
        }
        if let Sink::Write(Some(w)) = &mut self.sink {
            if let Err(e) = w.flush() {
                self.error.get_or_insert(e.to_string());
            }
        }
    }

    /// Emits what is pending, writes the trailer and closes the file: the
    /// actor's part of the run is complete.
    pub fn finish(&mut self) -> Result<(), String> {
        self.close(true)
    }

    /// Emits what is pending and closes the file without a trailer: the run
    /// did not complete, and a replay must not take this log for a whole one.
    pub fn abandon(&mut self) -> Result<(), String> {
        self.close(false)
    }

    fn close(&mut self, whole: bool) -> Result<(), String> {
        if let Some(prev) = self.current.take() {
            self.emit(prev);
        }
        // A gather cut short is in arrival order, not combination order:
        // a cut-off log leaves it out rather than record an order that a
        // re-run need not repeat.
        let g = std::mem::take(&mut self.gathered);
        if whole {
            for e in g {
                self.emit(e);
            }
        }
        if let Some(e) = &self.error {
            return Err(format!("replay log of {}: {e}", self.actor));
        }
        if let Sink::Write(w) = &mut self.sink {
            if let Some(mut w) = w.take() {
                if whole {
                    w.finish().map_err(|e| e.to_string())?;
                } else {
                    w.flush().map_err(|e| e.to_string())?;
                }
            }
        }
        self._open = None;
        Ok(())
    }
}

/// Where a run starts, as every log's header records it.
#[derive(Clone, Debug, Default)]
pub struct Origin {
    pub start_step: u64,
    /// `--init` weights (a fresh run only: a resumed one starts from `anchor`).
    pub init: Option<FileRef>,
    pub anchor: Option<Anchor>,
}

/// blake3 of `bytes`, hex.
pub fn blake3_hex(bytes: &[u8]) -> String {
    blake3::Hasher::new().update_rayon(bytes).finalize().to_hex().to_string()
}

/// blake3 of a file, hex.
pub fn file_blake3(path: &Path) -> Result<String, LogError> {
    let cap = crate::fsutil::memory_cap();
    let bytes =
        crate::fsutil::read_regular(path, cap, "this machine's memory holds").map_err(LogError::io(path))?;
    Ok(blake3_hex(&bytes))
}

impl Origin {
    /// The origin of a run that starts from `init` weights or resumes from
    /// `resume`. The files are digested only when the run records.
    pub fn new(
        cfg: &crate::config::Config,
        init: Option<&Path>,
        resume: Option<&crate::checkpoint::Loaded>,
    ) -> Result<Origin, LogError> {
        let start_step = resume.map_or(0, |r| r.state.step);
        if !cfg.replay.record {
            return Ok(Origin { start_step, ..Origin::default() });
        }
        let anchor = resume.map(|r| Anchor {
            step: r.state.step,
            config_hash: r.state.config_hash.clone(),
            state_blake3: r.state_blake3.clone(),
        });
        let init = match init.filter(|_| resume.is_none()) {
            Some(p) => Some(FileRef {
                path: std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string(),
                blake3: file_blake3(p)?,
            }),
            None => None,
        };
        Ok(Origin { start_step, init, anchor })
    }
}

/// The recorder of `actor` when `replay.record` is on.
pub fn recorder(
    cfg: &crate::config::Config,
    run_dir: &Path,
    actor: &str,
    origin: &Origin,
) -> Result<Option<ActorLog>, LogError> {
    if !cfg.replay.record {
        return Ok(None);
    }
    let header = Header {
        actor: actor.to_string(),
        config: cfg.to_toml_string(),
        config_hash: cfg.hash(),
        payloads: keeps_payloads(&cfg.replay.payloads, actor),
        start_step: origin.start_step,
        init: origin.init.clone(),
        anchor: origin.anchor.clone(),
    };
    ActorLog::record(run_dir, actor, header).map(Some)
}

/// A fresh entry (seq is assigned when written).
pub fn entry(from: &str, kind: &str, step: u64, replica: usize) -> Entry {
    Entry {
        seq: 0,
        from: from.to_string(),
        kind: kind.to_string(),
        step,
        eval: false,
        stage: None,
        mb: None,
        replica: replica as u64,
        inputs: Vec::new(),
        sent: Vec::new(),
        state: Vec::new(),
    }
}

impl Entry {
    pub fn with_mb(mut self, mb: usize) -> Entry {
        self.mb = Some(mb as u64);
        self
    }

    pub fn with_stage(mut self, stage: usize) -> Entry {
        self.stage = Some(stage as u64);
        self
    }

    pub fn with_eval(mut self, eval: bool) -> Entry {
        self.eval = eval;
        self
    }

    pub fn with_inputs(mut self, inputs: Vec<Blob>) -> Entry {
        self.inputs = inputs;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(state: Vec<Blob>, inputs: Vec<Blob>) -> Entry {
        Entry {
            seq: 3,
            from: "coordinator".into(),
            kind: "Apply".into(),
            step: 1,
            eval: false,
            stage: Some(0),
            mb: None,
            replica: 0,
            inputs,
            sent: vec![],
            state,
        }
    }

    #[test]
    fn a_divergence_names_the_parameter_and_element_it_is_in() {
        let w: Vec<f32> = (0..2000).map(|i| i as f32).collect();
        let mut moved = w.clone();
        moved[1234] += 0.5;
        let rec = entry(vec![Blob::f32s("h.2.attn.c_attn.weight", &w, true)], vec![]);
        let now = entry(vec![Blob::f32s("h.2.attn.c_attn.weight", &moved, true)], vec![]);
        let d = compare("stage-1", &rec, &now).expect("a divergence");
        assert!(
            d.to_string().contains("(at h.2.attn.c_attn.weight[1234]; 1 of 2000 elements differ)"),
            "{d}"
        );

        // A stage's Σg² list: element 1 is the Σg² of norm slot 3 (layers.0.input_layernorm.bias:
        // every tensor of this model is one block).
        let sums = |x: f64| {
            vec![
                Blob::u32s(key::GRAD_SUMSQ_INDEX, &[2, 3], true),
                Blob::f64s(key::GRAD_SUMSQ, &[1.0, x], true),
            ]
        };
        let d =
            compare("stage-0", &entry(vec![], sums(2.0)), &entry(vec![], sums(2.5))).expect("a divergence");
        assert!(d.to_string().contains("grad_sumsq[1] (the Σg² of norm slot 3)"), "{d}");
        let cfg = crate::model::Arch::gpt2(2, 2, 8, 10, 4);
        let named = d.name_params(&cfg).to_string();
        assert!(named.contains("(at grad_sumsq[1] (the Σg² of layers.0.input_layernorm.bias);"), "{named}");
        // A wider model: the token table (64·64 = 4 blocks) takes slots 0..4, the positions (4·64) slot 4.
        let wide = crate::model::Arch::gpt2(1, 2, 64, 64, 4);
        assert_eq!(
            slot_name(&wide, 2).as_deref(),
            Some("embed_tokens.weight, block 2 (elements 2048..3072)")
        );
        assert_eq!(slot_name(&wide, 4).as_deref(), Some("embed_positions.weight"));
        // A Llama's slots name its own tensors: embed_tokens (one block),
        // then block 0's input norm and q_proj, …, the untied head last.
        let llama = crate::model::Arch::llama(1, 2, 1, 8, 12, 10, 4, 1e4);
        assert_eq!(slot_name(&llama, 0).as_deref(), Some("embed_tokens.weight"));
        assert_eq!(slot_name(&llama, 2).as_deref(), Some("layers.0.self_attn.q_proj.weight"));
        let last = crate::optim::zero::first_slots(&llama).last().copied().unwrap();
        assert_eq!(slot_name(&llama, last).as_deref(), Some("lm_head.weight"));
    }
}
