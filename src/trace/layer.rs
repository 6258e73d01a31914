//! The trace recorder as a `tracing` layer: spans and events under the
//! `pipewright::trace` target become `Record`s, kept apart by the run they name.
//!
//! A span is one record from its creation to its close (an action, a wait, a
//! send, the optimizer, …); an event is a record whose time was measured
//! elsewhere (a message's arrival at a stage's actor, the checkpointer's
//! write), so it carries `at_us` (and `dur_us`) itself. Every span and event
//! carries a `run` field: tests run several runs in one process, and each run's
//! records go to that run's `RunTrace`, never to another's. The layer must never
//! print or block: it files records, and a stage takes its own out at the end.

use super::Record;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, Weak};
use std::time::Instant;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record as Values};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// The target of every span and event that becomes a record.
pub const TARGET: &str = "pipewright::trace";

/// One run's records in this process, on the run's clock.
struct Sink {
    epoch: Instant,
    records: Mutex<Vec<Record>>,
}

/// Runs that are recording, by id; an entry dies with its run's last handle.
static RUNS: Mutex<BTreeMap<u64, Weak<Sink>>> = Mutex::new(BTreeMap::new());
static NEXT_RUN: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking stage must not cost the other stages their records.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn sink_of(run: u64) -> Option<Arc<Sink>> {
    lock(&RUNS).get(&run).and_then(Weak::upgrade)
}

/// A run's trace in this process: its id (the `run` field of its spans), its
/// clock, and the records filed under it so far.
#[derive(Clone)]
pub struct RunTrace {
    id: u64,
    sink: Arc<Sink>,
}

impl std::fmt::Debug for RunTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RunTrace({})", self.id)
    }
}

impl RunTrace {
    /// A new run whose timestamps are µs from `epoch`. Installs the record layer
    /// as the global subscriber when nothing has installed one (library users
    /// and tests; the CLI installs its own, with this layer in it).
    pub fn start(epoch: Instant) -> RunTrace {
        install_default();
        let id = NEXT_RUN.fetch_add(1, Ordering::Relaxed);
        let sink = Arc::new(Sink { epoch, records: Mutex::new(Vec::new()) });
        let mut runs = lock(&RUNS);
        runs.retain(|_, w| w.strong_count() > 0);
        runs.insert(id, Arc::downgrade(&sink));
        RunTrace { id, sink }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// `t` on this run's clock, µs (negative before the epoch).
    pub fn us_of(&self, t: Instant) -> f64 {
        self.sink.us_of(t)
    }

    /// Takes out the records `keep` selects, leaving the others.
    pub fn take(&self, keep: impl Fn(&Record) -> bool) -> Vec<Record> {
        let mut all = lock(&self.sink.records);
        let (kept, rest) = std::mem::take(&mut *all).into_iter().partition(|r| keep(r));
        *all = rest;
        kept
    }
}

impl Sink {
    fn us_of(&self, t: Instant) -> f64 {
        match t.checked_duration_since(self.epoch) {
            Some(d) => d.as_secs_f64() * 1e6,
            None => -(self.epoch - t).as_secs_f64() * 1e6,
        }
    }
}

/// The layer that turns `pipewright::trace` spans and events into records.
pub struct RecordLayer;

/// The record layer with its own filter: it sees its target only, whatever
/// `RUST_LOG` lets the other layers see.
pub fn layer<S>() -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    RecordLayer.with_filter(Targets::new().with_target(TARGET, Level::TRACE))
}

/// Sets a subscriber holding only the record layer, unless one is set already.
fn install_default() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if !tracing::dispatcher::has_been_set() {
            use tracing_subscriber::layer::SubscriberExt;
            let subscriber = tracing_subscriber::registry().with(layer());
            // Losing a race to another global subscriber leaves that one in place.
            let _ = tracing::subscriber::set_global_default(subscriber);
        }
    });
}

/// A span's record while it is open.
struct Open {
    run: u64,
    start: Instant,
    record: Record,
    live: (Option<usize>, Option<usize>),
}

/// Reads a span's or event's fields into a record.
struct Fields<'a> {
    run: &'a mut u64,
    record: &'a mut Record,
    live: &'a mut (Option<usize>, Option<usize>),
    at_us: Option<f64>,
}

impl Visit for Fields<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        let v = value as usize;
        match field.name() {
            "run" => *self.run = value,
            "replica" => self.record.replica = v,
            "rank" => self.record.rank = v,
            "stage" => self.record.stage = v,
            "step" => self.record.step = value,
            "mb" => self.record.mb = Some(v),
            "peer" => self.record.peer = Some(v),
            "live_n" => self.live.0 = Some(v),
            "live_bytes" => self.live.1 = Some(v),
            _ => {}
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if let Ok(v) = u64::try_from(value) {
            self.record_u64(field, v);
        }
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        match field.name() {
            "at_us" => self.at_us = Some(value),
            "dur_us" => self.record.dur_us = value,
            _ => {}
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "kind" => self.record.name = value.to_string(),
            "detail" => self.record.detail = Some(value.to_string()),
            "actor" => self.record.actor = Some(value.to_string()),
            _ => {}
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

fn with_live(mut record: Record, live: (Option<usize>, Option<usize>)) -> Record {
    if let (Some(n), Some(bytes)) = live {
        record.live = Some((n, bytes));
    }
    record
}

impl<S> Layer<S> for RecordLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut open = Open { run: 0, start: Instant::now(), record: Record::default(), live: (None, None) };
        let mut fields =
            Fields { run: &mut open.run, record: &mut open.record, live: &mut open.live, at_us: None };
        attrs.record(&mut fields);
        span.extensions_mut().insert(open);
    }

    fn on_record(&self, id: &Id, values: &Values<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        let Some(open) = ext.get_mut::<Open>() else { return };
        let mut fields =
            Fields { run: &mut open.run, record: &mut open.record, live: &mut open.live, at_us: None };
        values.record(&mut fields);
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let end = Instant::now();
        let Some(span) = ctx.span(&id) else { return };
        let Some(open) = span.extensions_mut().remove::<Open>() else { return };
        let Some(sink) = sink_of(open.run) else { return };
        let (start_us, end_us) = (sink.us_of(open.start), sink.us_of(end));
        let record =
            Record { start_us, dur_us: (end_us - start_us).max(0.0), ..with_live(open.record, open.live) };
        lock(&sink.records).push(record);
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let (mut run, mut record, mut live) = (0, Record::default(), (None, None));
        let mut fields = Fields { run: &mut run, record: &mut record, live: &mut live, at_us: None };
        event.record(&mut fields);
        let at_us = fields.at_us;
        let Some(sink) = sink_of(run) else { return };
        let start_us = at_us.unwrap_or_else(|| sink.us_of(Instant::now()));
        lock(&sink.records).push(Record { start_us, ..with_live(record, live) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Recorder;

    /// Each thread plays one stage of its own run: replica 0, rank 0 in both.
    fn record_steps(rec: &Recorder, kind: &'static str, steps: u64) {
        for step in 0..steps {
            let span = rec.span(0, kind, step, Some(step as usize), None, None);
            span.record("live_n", 1).record("live_bytes", 64);
            drop(span);
            rec.recv(step, 1, 0, 0, Instant::now(), "activation");
        }
    }

    #[test]
    fn two_runs_in_one_process_keep_separate_records() {
        let (a, b) = (RunTrace::start(Instant::now()), RunTrace::start(Instant::now()));
        assert_ne!(a.id(), b.id());
        let (rec_a, rec_b) = (Recorder::new(Some(a), 0, 0), Recorder::new(Some(b), 0, 0));
        // Both runs hold records before either is taken out.
        std::thread::scope(|s| {
            s.spawn(|| record_steps(&rec_a, "F", 300));
            s.spawn(|| record_steps(&rec_b, "B", 200));
        });
        let (ra, rb) = (rec_a.take(), rec_b.take());
        assert_eq!(ra.len(), 600);
        assert_eq!(rb.len(), 400);
        assert!(ra.iter().all(|r| r.name == "F" || r.name == "recv"));
        assert!(rb.iter().all(|r| r.name == "B" || r.name == "recv"));
        let spans: Vec<&Record> = ra.iter().filter(|r| r.name == "F").collect();
        assert!(spans.iter().enumerate().all(|(i, r)| r.step == i as u64 && r.mb == Some(i)));
        assert!(spans.iter().all(|r| r.live == Some((1, 64)) && r.dur_us >= 0.0));
    }

    #[test]
    fn a_stage_takes_only_its_own_records_of_the_run() {
        let run = RunTrace::start(Instant::now());
        let (r0, r1) = (Recorder::new(Some(run.clone()), 0, 0), Recorder::new(Some(run.clone()), 1, 0));
        drop(r0.span(0, "optimizer", 3, None, Some("d"), None));
        drop(r1.span(0, "send", 3, Some(2), Some("activation to stage 1"), Some(1)));
        let mine = r1.take();
        assert_eq!(mine.len(), 1);
        let send = &mine[0];
        assert_eq!((send.replica, send.name.as_str(), send.mb, send.peer), (1, "send", Some(2), Some(1)));
        assert_eq!(send.detail.as_deref(), Some("activation to stage 1"));
        assert_eq!(r0.take().len(), 1);
        assert!(run.take(|_| true).is_empty());
    }

    #[test]
    fn a_recorder_without_a_run_records_nothing() {
        let rec = Recorder::new(None, 0, 0);
        assert!(rec.span(0, "F", 0, Some(0), None, None).is_none());
        assert!(rec.take().is_empty());
    }
}
