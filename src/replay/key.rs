//! Names of the blobs a message's payload is logged under. The runtime's
//! protocol writes them and the log comparison reads some back (a Σg²'s
//! parameter index), so they live with the log, below the actors.

pub const TOKENS: &str = "tokens";
pub const TARGETS: &str = "targets";
pub const DATA: &str = "data";
pub const LOSS_SCALE: &str = "loss_scale";
pub const LR: &str = "lr";
pub const CLIP: &str = "clip";
pub const SKIP: &str = "skip";
pub const EVAL_KIND: &str = "kind";
pub const BATCHES: &str = "batches";
pub const CHECKPOINT: &str = "checkpoint";
pub const GRAD_SUMSQ_INDEX: &str = "grad_sumsq.index";
pub const GRAD_SUMSQ: &str = "grad_sumsq";
pub const LOSS_SUM: &str = "loss_sum";
pub const TOKEN_COUNT: &str = "tokens";
pub const PREDICTIONS: &str = "predictions";
pub const ADAM_STEP: &str = "adam_step";
pub const EMA_UPDATES: &str = "ema_updates";
pub const SPANS: &str = "spans";
pub const LEAF: &str = "leaf";
pub const HEAD: &str = "head";
