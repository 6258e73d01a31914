//! The model on both backends: one block whose kinds the settings choose
//! (`arch.rs`), the families as presets of those settings with their
//! Hugging Face names and `config.json` (`gpt2/`, `llama/`, …, listed in
//! `family.rs`), the parameters and their initialisation, the model cut into
//! parts a pipeline stage can own (CPU here, GPU under `gpu/`), and weights
//! in and out of files.
//!
//! A `ModelPart` is a contiguous range of blocks, with the embedding if it is
//! first and the final norm, head and loss if it is last. Its forward and
//! backward are written out by hand from `kernels::cpu`; nothing here knows
//! about schedules, threads or messages, and nothing outside a family's
//! folder asks which family a model is.

pub mod arch;
pub mod block;
pub mod family;
pub mod gpt2;
pub mod gpu;
pub mod hf;
pub mod io;
pub mod llama;
pub mod mistral;
pub mod params;
pub mod part;
pub mod qwen2;
pub mod qwen3;
pub mod recompute;
pub mod rope;
pub mod section;
pub mod tp;

pub use arch::Arch;
pub use family::Family;
pub use params::Param;
pub use part::{ModelPart, PartSpec};
pub use section::ModelSection;
