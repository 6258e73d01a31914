//! Training: the loop and what it reports.

pub mod plot;
