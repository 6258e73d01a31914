//! Training data: token files on disk, the generated default corpus, and the
//! samplers that turn either into (inputs, targets) microbatches.
//!
//! Owns every byte of token data between the disk and the model. Never holds
//! run state beyond a sequence counter supplied by the caller, so resuming or
//! changing the parallel layout cannot change which tokens a sequence sees.

pub mod arithmetic;
pub mod prepare;
pub mod sampler;
pub mod token_file;

pub use arithmetic::{AnswerSpan, ArithmeticCorpus, EvalSet, Problem, TrainText};
pub use prepare::{prepare, prepare_all, PrepareReport, Tokenizer, DEFAULT_VAL_FRACTION};
pub use sampler::{Sampler, SamplerKind};
pub use token_file::{
    write_llmc, DataError, FileFormat, RandomText, TokenFile, TokenFormat, TokenSource, RANDOM_TOKENS,
};
