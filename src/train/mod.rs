//! A training run: the step engine, the run loop with its outputs (metrics,
//! summary, weights, loss curve), and progress reporting.

pub mod engine;
pub mod eval;
pub mod finite;
pub mod lock;
pub mod plot;
pub mod resume;
pub mod run;
pub mod signals;
