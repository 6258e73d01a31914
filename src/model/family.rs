//! The families pipewright knows, each a folder beside this file (`gpt2/`,
//! `llama/`, …) that gives a [`Spec`]: its preset of [`Arch`] settings, its
//! Hugging Face tensor names and layouts, and its `config.json` in and out.
//! Adding a family that differs by settings is a new folder and a line in
//! [`ALL`]; nothing outside `model/` learns its name.
//!
//! The compute never reads a family: it reads the settings the preset chose.
//! The family travels in [`Arch::family`] only so the file boundary
//! (`io.rs`, `hf.rs`) can find its adapter.

use super::arch::Arch;
use super::hf::{Fields, HfError};
use super::section::ModelSection;
use crate::check::Checks;
use std::borrow::Cow;
use std::fmt;

/// A tensor as a Hugging Face file holds it, by its name there.
pub type HfTensor<'a> = (String, Vec<usize>, Cow<'a, [f32]>);

/// A tensor of ours: name, shape, values.
pub type Tensor = (String, Vec<usize>, Vec<f32>);

/// Our tensors (a whole model's, by our names) as a family's files hold them.
pub type ToHf = for<'a> fn(&Arch, Vec<(&'a str, &'a [usize], &'a [f32])>) -> Vec<HfTensor<'a>>;

/// One tensor of a family's file (name, shape, values) as ours.
pub type FromHf = fn(&Arch, &str, Vec<usize>, Vec<f32>) -> Result<Vec<Tensor>, FromHfError>;

/// What a family is.
pub struct Spec {
    /// The name `model.family` takes.
    pub name: &'static str,
    /// As people write it ("GPT-2").
    pub title: &'static str,
    /// The `model_type` its `config.json` carries, and any others it reads.
    pub model_types: &'static [&'static str],
    /// The `transformers` class its run folders open as.
    pub hf_class: &'static str,
    /// The settings a `[model]` section gives, problems added under `model.*`
    /// (the generic fields are checked by the section itself).
    pub preset: fn(&ModelSection, &mut Checks) -> Arch,
    /// A `config.json` as `--set` overrides of the `[model]` section.
    pub read_config: fn(&Fields) -> Result<Vec<String>, HfError>,
    /// The `config.json` that `hf_class.from_pretrained` reads as this model.
    pub write_config: fn(&Arch) -> serde_json::Value,
    /// Our tensors (a whole model's, by our names) as the family's files
    /// hold them.
    pub to_hf: ToHf,
    /// One tensor of a family's file as ours (none for buffers the file
    /// carries beside the weights); `Err` names what was expected when the
    /// tensor is not one of the family's, or has another shape.
    pub from_hf: FromHf,
    /// The name in the family's files of our tensor `name` (for messages).
    pub hf_name: fn(&Arch, &str) -> String,
}

/// Why a file's tensor has no place in the model.
#[derive(Debug, PartialEq)]
pub enum FromHfError {
    /// Not a tensor of this family's files.
    Unknown,
    /// The family's tensor, with another shape than the model's.
    Shape { expected: Vec<usize> },
}

/// A handle on a family's [`Spec`]: copied with the settings, compared and
/// printed by name.
#[derive(Clone, Copy)]
pub struct Family(&'static Spec);

/// Every family, in the order messages list them.
pub const ALL: &[&Spec] = &[
    &super::gpt2::SPEC,
    &super::llama::SPEC,
    &super::qwen2::SPEC,
    &super::qwen3::SPEC,
    &super::mistral::SPEC,
];

impl Family {
    /// The family `model.family` names.
    pub fn named(name: &str) -> Option<Family> {
        ALL.iter().find(|s| s.name == name).map(|s| Family(s))
    }

    /// The family whose `config.json` carries this `model_type`.
    pub fn of_model_type(model_type: &str) -> Option<Family> {
        ALL.iter().find(|s| s.model_types.contains(&model_type)).map(|s| Family(s))
    }

    /// Every `model.family` name, quoted, for messages.
    pub fn names() -> String {
        let v: Vec<String> = ALL.iter().map(|s| format!("\"{}\"", s.name)).collect();
        v.join(", ")
    }

    /// Every `model_type` a `config.json` may carry, quoted, for messages.
    pub fn model_types() -> String {
        let v: Vec<String> = ALL.iter().flat_map(|s| s.model_types).map(|t| format!("\"{t}\"")).collect();
        v.join(", ")
    }

    pub fn spec(self) -> &'static Spec {
        self.0
    }

    pub fn name(self) -> &'static str {
        self.0.name
    }

    pub fn title(self) -> &'static str {
        self.0.title
    }
}

impl PartialEq for Family {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Family {}

impl fmt::Debug for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}
