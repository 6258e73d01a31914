//! The `[model]` section of a run's config: the family by name, the shape,
//! and the settings families vary, each as Hugging Face's config names it
//! (`n_kv_head` aside, pipewright's older name for `num_key_value_heads`).
//! [`ModelSection::arch`] turns it into the [`Arch`] every part of the
//! trainer reads: the generic fields here, the family's preset for the rest.
//!
//! It owns the section's rules (every field's range, and through the preset
//! each family's): the config calls them with its other sections', so a
//! config is refused once, naming every problem.

use super::arch::{Arch, Init, Mlp, Norm, Positions, RopeScaling};
use super::family::Family;
use crate::check::{quoted, Checks, Problem};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// The family whose preset fills the settings not given here: "gpt2",
    /// "llama", … (`Family::names`).
    pub family: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Key/value heads (`num_key_value_heads`), dividing `n_head`; 0 means
    /// one per query head.
    pub n_kv_head: usize,
    /// Width of one attention head; 0 means n_embd / n_head.
    pub head_dim: usize,
    /// Width of the MLP's hidden layer (`intermediate_size`); 0 means the
    /// family's default where it has one (GPT-2's 4·n_embd).
    pub intermediate_size: usize,
    /// The rotary embedding's base (rotary families).
    pub rope_theta: f64,
    /// How the rotary frequencies are scaled (`rope_scaling`); none by default.
    pub rope_scaling: RopeScalingSection,
    /// The norms' epsilon (`rms_norm_eps`; GPT-2's LayerNorm takes 1e-5 only).
    pub rms_norm_eps: f64,
    /// Whether the LM head reads the token embedding; unset, the family's
    /// default (GPT-2: always; Llama: no).
    pub tie_word_embeddings: Option<bool>,
    /// Biases on the attention's projections (`attention_bias`); unset, the
    /// family's default.
    pub attention_bias: Option<bool>,
    /// Biases on the MLP's projections (`mlp_bias`); unset, the family's default.
    pub mlp_bias: Option<bool>,
    /// Sliding-window attention: a query sees at most this many keys, itself
    /// included (`sliding_window`); 0 means full attention.
    pub sliding_window: usize,
    /// Tokens the model can predict; the embedding is padded internally to a
    /// multiple of 64 but padded rows are never predicted nor exported.
    pub vocab_size: usize,
    /// Sequence length T (and rows of a learned position table).
    pub block_size: usize,
}

/// `[model.rope_scaling]`: transformers' `rope_scaling` dictionary. Fields a
/// type does not read must stay unset (0).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RopeScalingSection {
    /// "" or "default" (none), "linear", "llama3" or "yarn".
    pub rope_type: String,
    pub factor: f64,
    /// llama3: wavelengths longer than original/low_freq_factor are scaled.
    pub low_freq_factor: f64,
    /// llama3: wavelengths shorter than original/high_freq_factor are kept.
    pub high_freq_factor: f64,
    /// llama3 and yarn: the context the model was trained at.
    pub original_max_position_embeddings: usize,
    /// yarn: the ramp's ends in rotations (0 means transformers' 32 and 1).
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// yarn: cos and sin scaled by this (0 means 0.1·ln(factor) + 1).
    pub attention_factor: f64,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            family: "gpt2".into(),
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            n_kv_head: 0,
            head_dim: 0,
            intermediate_size: 0,
            rope_theta: 10_000.0,
            rope_scaling: RopeScalingSection::default(),
            rms_norm_eps: 1e-5,
            tie_word_embeddings: None,
            attention_bias: None,
            mlp_bias: None,
            sliding_window: 0,
            vocab_size: 50257,
            block_size: 1024,
        }
    }
}

/// The optional keys of `[model]` with a value of their type: `--set` reads
/// its schema off the serialized defaults, which leave unset options out.
pub const OPTIONAL_KEYS: [(&str, bool); 3] =
    [("tie_word_embeddings", false), ("attention_bias", false), ("mlp_bias", false)];

impl ModelSection {
    /// The family `family` names.
    pub fn family(&self) -> Option<Family> {
        Family::named(&self.family)
    }

    /// Key/value heads: `n_kv_head`, or one per query head.
    pub fn kv_heads(&self) -> usize {
        if self.n_kv_head > 0 {
            self.n_kv_head
        } else {
            self.n_head
        }
    }

    /// Width of one attention head: `head_dim`, or n_embd / n_head.
    pub fn head_dim(&self) -> usize {
        match self.head_dim {
            0 => self.n_embd / self.n_head.max(1),
            d => d,
        }
    }

    /// The model this section describes, or every problem with it.
    pub fn arch(&self) -> Result<Arch, Vec<Problem>> {
        let mut c = Checks::default();
        let arch = self.checked(&mut c);
        match (arch, c.problems.is_empty()) {
            (Some(a), true) => Ok(a),
            _ => Err(c.problems),
        }
    }

    /// The section's rules, problems added to `c`.
    pub fn check(&self, c: &mut Checks) {
        self.checked(c);
    }

    /// Checks the section and, when its family is known and its shape can
    /// be formed, the family's own rules; the model if one could be formed.
    fn checked(&self, c: &mut Checks) -> Option<Arch> {
        let before = c.problems.len();
        self.check_shape(c);
        let family = self.family();
        c.check(
            family.is_some(),
            "model.family",
            quoted(&self.family),
            format!("expected one of {}", Family::names()),
        );
        let family = family?;
        // A preset divides by these; their problems are already named.
        if self.n_head == 0 || self.n_embd == 0 || self.kv_heads() == 0 || c.problems.len() > before {
            return None;
        }
        let arch = (family.spec().preset)(self, c);
        self.check_arch(&arch, c);
        Some(arch)
    }

    /// The rules every family shares.
    fn check_shape(&self, c: &mut Checks) {
        for (path, value) in [
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.n_embd", self.n_embd),
            ("model.vocab_size", self.vocab_size),
        ] {
            c.check(value > 0, path, value, "must be > 0");
        }
        if self.n_head > 0 {
            let kv = self.kv_heads();
            c.check(
                kv > 0 && self.n_head.is_multiple_of(kv),
                "model.n_kv_head",
                self.n_kv_head,
                format!(
                    "must be 0 or divide model.n_head = {} (each key/value head serves a group)",
                    self.n_head
                ),
            );
            if self.head_dim == 0 {
                c.check(
                    self.n_embd.is_multiple_of(self.n_head),
                    "model.n_embd",
                    self.n_embd,
                    format!("must be divisible by model.n_head ({}) when model.head_dim is 0", self.n_head),
                );
            }
        }
        // Token ids travel as i32 (llm.c's format, the kernels' indices).
        c.check(
            self.vocab_size <= 1 << 31,
            "model.vocab_size",
            self.vocab_size,
            "must be <= 2^31 (2147483648)",
        );
        // One position predicts the next: a window of one token has no target.
        c.check(self.block_size >= 2, "model.block_size", self.block_size, "must be >= 2");
        c.check(
            self.rope_theta.is_finite() && self.rope_theta > 1.0 && self.rope_theta <= 1e12,
            "model.rope_theta",
            self.rope_theta,
            "must be a finite base in (1, 1e12]",
        );
        c.check(
            self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0,
            "model.rms_norm_eps",
            self.rms_norm_eps,
            "must be a finite epsilon in (0, 1)",
        );
        self.rope_scaling.check(c);
    }

    /// Rules on the model a preset formed (whatever the family).
    fn check_arch(&self, a: &Arch, c: &mut Checks) {
        if a.positions == Positions::Rotary {
            c.check(
                a.head_dim.is_multiple_of(2),
                if self.head_dim > 0 { "model.head_dim" } else { "model.n_embd" },
                if self.head_dim > 0 { self.head_dim } else { self.n_embd },
                format!("must give an even head width (rotary embeddings turn pairs); it is {}", a.head_dim),
            );
        }
        c.check(
            a.ffn > 0,
            "model.intermediate_size",
            self.intermediate_size,
            "must be > 0 (the MLP's width)",
        );
        if let Some(w) = a.window {
            c.check(w >= 1, "model.sliding_window", w, "must be >= 1 or 0 for full attention");
        }
    }

    /// The settings every family reads the same way; a preset starts from
    /// these and sets the kinds its block has (the defaults here are
    /// Llama's: RMSNorm, rotary positions, SwiGLU, no biases, untied).
    pub fn common(&self, family: Family) -> Arch {
        Arch {
            family,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_kv_head: self.kv_heads(),
            head_dim: self.head_dim(),
            n_embd: self.n_embd,
            ffn: self.intermediate_size,
            vocab_size: self.vocab_size,
            block_size: self.block_size,
            norm: Norm::RmsNorm,
            norm_eps: self.rms_norm_eps as f32,
            positions: Positions::Rotary,
            rope_theta: self.rope_theta as f32,
            rope_scaling: self.rope_scaling.scaling(self.block_size),
            mlp: Mlp::SwiGlu,
            qkv_bias: self.attention_bias.unwrap_or(false),
            o_bias: self.attention_bias.unwrap_or(false),
            mlp_bias: self.mlp_bias.unwrap_or(false),
            qk_norm: false,
            window: (self.sliding_window > 0).then_some(self.sliding_window),
            tied: self.tie_word_embeddings.unwrap_or(false),
            init: Init { std: 0.02, scaled_residual: false },
        }
    }

    /// A problem unless `field` is unset (0 / none) in a family that does not
    /// read it: the family would silently compute without it.
    pub fn refuse_unless_unset(&self, c: &mut Checks, family: &str, field: &str) {
        let set = match field {
            "sliding_window" => (self.sliding_window > 0).then(|| self.sliding_window.to_string()),
            "rope_scaling" => self.rope_scaling.is_set().then(|| quoted(&self.rope_scaling.rope_type)),
            "head_dim" => (self.head_dim > 0 && self.head_dim * self.n_head != self.n_embd)
                .then(|| self.head_dim.to_string()),
            _ => unreachable!("no rule for model.{field}"),
        };
        if let Some(value) = set {
            let path = match field {
                "rope_scaling" => "model.rope_scaling.rope_type".to_string(),
                f => format!("model.{f}"),
            };
            c.check(false, &path, value, format!("is not a setting of model.family = \"{family}\""));
        }
    }
}

impl RopeScalingSection {
    /// Whether a scaling is chosen.
    pub fn is_set(&self) -> bool {
        !matches!(self.rope_type.as_str(), "" | "default")
    }

    fn check(&self, c: &mut Checks) {
        let p = |f: &str| format!("model.rope_scaling.{f}");
        let positive = |c: &mut Checks, f: &str, x: f64| {
            c.check(x.is_finite() && x > 0.0, &p(f), x, "must be a finite number > 0 for this rope_type")
        };
        let unset = |c: &mut Checks, f: &str, x: f64| {
            c.check(x == 0.0, &p(f), x, "is not read by this rope_type: leave it 0")
        };
        match self.rope_type.as_str() {
            "" | "default" => {
                for (f, x) in self.numbers() {
                    unset(c, f, x);
                }
            }
            "linear" => {
                positive(c, "factor", self.factor);
                for (f, x) in self.numbers().into_iter().skip(1) {
                    unset(c, f, x);
                }
            }
            "llama3" => {
                positive(c, "factor", self.factor);
                positive(c, "low_freq_factor", self.low_freq_factor);
                positive(c, "high_freq_factor", self.high_freq_factor);
                positive(c, "original_max_position_embeddings", self.original_max_position_embeddings as f64);
                c.check(
                    self.high_freq_factor > self.low_freq_factor,
                    &p("high_freq_factor"),
                    self.high_freq_factor,
                    format!("must exceed low_freq_factor = {}", self.low_freq_factor),
                );
                for f in ["beta_fast", "beta_slow", "attention_factor"] {
                    let x = self.numbers().into_iter().find(|(n, _)| *n == f).map_or(0.0, |(_, x)| x);
                    unset(c, f, x);
                }
            }
            "yarn" => {
                positive(c, "factor", self.factor);
                for f in ["low_freq_factor", "high_freq_factor"] {
                    let x = self.numbers().into_iter().find(|(n, _)| *n == f).map_or(0.0, |(_, x)| x);
                    unset(c, f, x);
                }
                for (f, x) in [("beta_fast", self.beta_fast), ("beta_slow", self.beta_slow), ("attention_factor", self.attention_factor)] {
                    c.check(x.is_finite() && x >= 0.0, &p(f), x, "must be >= 0 (0: transformers' default)");
                }
            }
            other => c.check(
                false,
                &p("rope_type"),
                quoted(other),
                "expected \"default\", \"linear\", \"llama3\" or \"yarn\" (dynamic and longrope scaling are not computed)",
            ),
        }
    }

    /// The numeric fields, `factor` first.
    fn numbers(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("factor", self.factor),
            ("low_freq_factor", self.low_freq_factor),
            ("high_freq_factor", self.high_freq_factor),
            ("original_max_position_embeddings", self.original_max_position_embeddings as f64),
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
            ("attention_factor", self.attention_factor),
        ]
    }

    /// The scaling, for a checked section; `block_size` stands in for an
    /// unset original context (YaRN's default is `max_position_embeddings`).
    fn scaling(&self, block_size: usize) -> RopeScaling {
        let f = |x: f64| x as f32;
        match self.rope_type.as_str() {
            "linear" => RopeScaling::Linear { factor: f(self.factor) },
            "llama3" => RopeScaling::Llama3 {
                factor: f(self.factor),
                low_freq_factor: f(self.low_freq_factor),
                high_freq_factor: f(self.high_freq_factor),
                original_max_position_embeddings: self.original_max_position_embeddings,
            },
            "yarn" => {
                let factor = self.factor;
                let attention_factor = match self.attention_factor {
                    0.0 if factor > 1.0 => 0.1 * factor.ln() + 1.0,
                    0.0 => 1.0,
                    a => a,
                };
                RopeScaling::Yarn {
                    factor: f(factor),
                    original_max_position_embeddings: match self.original_max_position_embeddings {
                        0 => block_size,
                        o => o,
                    },
                    beta_fast: f(if self.beta_fast == 0.0 { 32.0 } else { self.beta_fast }),
                    beta_slow: f(if self.beta_slow == 0.0 { 1.0 } else { self.beta_slow }),
                    attention_factor: f(attention_factor),
                    truncate: true,
                }
            }
            _ => RopeScaling::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_llama_without_an_mlp_width_is_refused() {
        let m = ModelSection {
            family: "llama".into(),
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            n_embd: 16,
            vocab_size: 10,
            block_size: 8,
            ..Default::default()
        };
        let err = m.arch().unwrap_err();
        assert_eq!(err.len(), 1, "{err:?}");
        assert_eq!(err[0].path, "model.intermediate_size");
    }
}
