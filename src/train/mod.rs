//! A training run: the step engine, the run loop with its outputs (metrics,
//! summary, weights, loss curve), resuming, evaluation, and replaying a
//! recorded run. What a step reports and the progress display live below it,
//! in `metrics`; the replay log the actors write, in `replay`.

pub mod engine;
pub mod eval;
pub mod export;
pub mod finite;
pub mod lock;
pub mod plot;
pub mod replay;
pub mod resume;
pub mod run;
