//! pipewright: a trainer for GPT-style transformers (every family a preset
//! of one block, `model`) whose pipeline stages are actors.
//!
//! The layout follows one optimizer step: `config` → `schedule` → `actors` →
//! `model` (built from `kernels`) → `optim`; `data` feeds it, `train` runs it
//! and `trace` shows it.

pub mod actors;
pub mod bench;
pub mod check;
pub mod checkpoint;
pub mod cluster;
pub mod config;
pub mod data;
pub mod fsutil;
pub mod fuzz;
pub mod generate;
pub mod host;
pub mod inspect;
pub mod kernels;
pub mod limits;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod plan;
pub mod replay;
pub mod rng;
pub mod schedule;
pub mod trace;
pub mod train;
