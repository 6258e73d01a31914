//! What a block keeps from its forward for its backward, and what the
//! backward computes again instead (`train.recompute`).
//!
//! - `none`: every intermediate the backward reads ([`super::block::BlockActs`]).
//! - `selective`: the outputs of the matrix products and of attention (q, k,
//!   v after their norms and RoPE, attention's output and log-sum-exp, the
//!   residual after attention, the MLP's first products), the norms'
//!   statistics and the block's input; the norms' outputs and the MLP's
//!   activation are computed again from them when a weight gradient needs
//!   them. Those three are 2·C + F floats a token (6·C of the 16·C GPT-2's block keeps with its input)
//!   and cost a few elementwise passes to remake, where any product or the
//!   attention would cost as much again as its forward. pipewright's
//!   attention never stores the T×T scores (it keeps the log-sum-exp), so
//!   Megatron's selective choice, the attention core, is already had.
//! - `full`: only each block's input; the whole block runs again in backward.
//!
//! Recomputed tensors come from the same kernels on the same inputs, so all
//! three give the same bits.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    #[default]
    None,
    Selective,
    Full,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }

    /// Whether each block's intermediates (all or the selective set) are
    /// kept per microbatch; `full` keeps inputs only.
    pub fn keeps_blocks(self) -> bool {
        self != Recompute::Full
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Configs from before selective recompute said `recompute = true` for full.
impl From<bool> for Recompute {
    fn from(full: bool) -> Recompute {
        if full {
            Recompute::Full
        } else {
            Recompute::None
        }
    }
}

impl Serialize for Recompute {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

const EXPECTED: &str = "\"none\", \"selective\" or \"full\" (or true for \"full\", false for \"none\")";

impl<'de> Deserialize<'de> for Recompute {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Recompute, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Recompute;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }

            fn visit_bool<E: serde::de::Error>(self, full: bool) -> Result<Recompute, E> {
                Ok(full.into())
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Recompute, E> {
                // `--set train.recompute=true` reaches a string field as text.
                match s {
                    "none" | "false" => Ok(Recompute::None),
                    "selective" => Ok(Recompute::Selective),
                    "full" | "true" => Ok(Recompute::Full),
                    other => Err(E::custom(format!("got {other:?}, expected {EXPECTED}"))),
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}
