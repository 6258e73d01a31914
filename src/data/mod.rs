//! Training data: corpora read, cleaned, deduplicated and tokenized into
//! token files (`prepare`), tokenizers, the generated default corpus, and
//! the samplers that turn token data into (inputs, targets) microbatches.
//!
//! Owns every byte of data between the corpus on disk and the model. Never
//! holds run state beyond a sequence counter supplied by the caller, so
//! resuming or changing the parallel layout cannot change which tokens a
//! sequence sees.

pub mod arithmetic;
pub mod bench;
pub mod clean;
pub mod dedup;
pub mod hash;
pub mod mixture;
pub mod prepare;
pub mod read;
pub mod report;
pub mod sampler;
pub mod shards;
pub mod token_file;
pub mod tokenizer;

pub use arithmetic::{AnswerSpan, ArithmeticCorpus, EvalSet, Problem, TrainText};
pub use prepare::{prepare, prepare_all, PrepareConfig, PrepareOptions, PrepareReport, DEFAULT_VAL_FRACTION};
pub use sampler::{Sampler, SamplerKind};
pub use token_file::{
    write_llmc, DataError, FileFormat, RandomText, TokenFile, TokenFormat, TokenSource, RANDOM_TOKENS,
};
pub use tokenizer::Tokenizer;
