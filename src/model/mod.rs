//! The GPT-2 family: parameter names and layouts (Hugging Face GPT-2's),
//! initialisation, and the model cut into parts a pipeline stage can own.
//!
//! A `ModelPart` is a contiguous range of blocks, with the embedding if it is
//! first and the final LayerNorm, tied head and loss if it is last. Its forward
//! and backward are written out by hand from `kernels::cpu`; nothing here
//! knows about schedules, threads or messages.

pub mod block;
pub mod gpu;
pub mod hf;
pub mod io;
pub mod llama;
pub mod params;
pub mod part;
pub mod tp;

pub use params::{Arch, Param};
pub use part::{ModelPart, PartSpec};
