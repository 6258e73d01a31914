//! The actor runtime: a training run as actors exchanging microbatch messages.
//!
//! - `coordinator`: the step loop, learning rate, the clip/skip decision and
//!   evaluation; parent of every other actor, so it hears of any failure.
//! - `data_loader`: one per data-parallel replica; sends tokens to the first
//!   stage and targets to the last.
//! - `stage`: one per pipeline rank per replica; owns the rank's model chunks
//!   and a compute thread that walks the rank's action list from the schedule.
//!   What the chunks compute with (CPU or GPU) is `compute`'s business.
//! - `reducer`: sums gradients over data-parallel replicas in replica order.
//! - `monitor`: metrics.jsonl and the progress display.
//! - `checkpointer`: writes checkpoints in the background.
//! - `topology`: spawns a run's actors and links them (one process, a cluster
//!   worker's share, or the arguments of one actor replayed alone).
//! - `processes`: the other processes of a run as a trait (`cluster`
//!   implements it), and the stand-in for a stage that lives in one of them.
//! - `protocol`: every message kind, declared once, and its encodings (frame
//!   header + tensors for the wire, named blobs for the replay log).
//!
//! Schedules come from `crate::schedule` as data; nothing here decides an
//! order of work. Every message type is declared with `impl Message` (ractor's
//! `cluster` feature is on, so remote transport can come without touching them).

pub mod checkpointer;
pub mod compute;
pub mod coordinator;
pub mod data_loader;
pub mod layout;
pub mod monitor;
pub mod processes;
pub mod protocol;
pub mod reducer;
pub mod stage;
pub mod topology;

pub use coordinator::{run, RunInputs, RunOutcome};
pub use layout::Layout;
