//! One unit of pipeline work: run `kind` for microbatch `mb` on `stage`.
//!
//! The text form is PyTorch pipelining's, `{stage}{F|B|I|W}{mb}` (`2F0`, `3B5`), so
//! schedules from both can be compared by eye. `Display` writes it, `FromStr` reads it
//! back, and serde uses the same strings.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// What an action computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// Forward: activation in from stage − 1 (or tokens), activation out to stage + 1.
    F,
    /// Full backward: output gradient in from stage + 1 (or the loss), input gradient
    /// out to stage − 1, weight gradients accumulated. Equal to `I` then `W`.
    B,
    /// Backward for the input only: produces the gradient stage − 1 waits for.
    I,
    /// Backward for the weights only: accumulates weight gradients; nobody waits for it.
    W,
}

impl ActionKind {
    pub fn letter(self) -> char {
        match self {
            ActionKind::F => 'F',
            ActionKind::B => 'B',
            ActionKind::I => 'I',
            ActionKind::W => 'W',
        }
    }

    pub fn from_letter(c: char) -> Option<ActionKind> {
        match c {
            'F' => Some(ActionKind::F),
            'B' => Some(ActionKind::B),
            'I' => Some(ActionKind::I),
            'W' => Some(ActionKind::W),
            _ => None,
        }
    }
}

impl fmt::Display for ActionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.letter())
    }
}

/// `kind` of microbatch `mb` on pipeline stage `stage` (not rank: with v model chunks
/// per rank, rank r owns stages r, r + p, r + 2p, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    pub stage: usize,
    pub kind: ActionKind,
    pub mb: usize,
}

impl Action {
    pub fn new(stage: usize, kind: ActionKind, mb: usize) -> Action {
        Action { stage, kind, mb }
    }
    pub fn f(stage: usize, mb: usize) -> Action {
        Action::new(stage, ActionKind::F, mb)
    }
    pub fn b(stage: usize, mb: usize) -> Action {
        Action::new(stage, ActionKind::B, mb)
    }
    pub fn i(stage: usize, mb: usize) -> Action {
        Action::new(stage, ActionKind::I, mb)
    }
    pub fn w(stage: usize, mb: usize) -> Action {
        Action::new(stage, ActionKind::W, mb)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.kind.letter(), self.mb)
    }
}

/// Why a string is not an action.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid action {text:?}: {reason} (expected {{stage}}{{F|B|I|W}}{{microbatch}}, e.g. 2F0)")]
pub struct ParseActionError {
    pub text: String,
    pub reason: String,
}

impl FromStr for Action {
    type Err = ParseActionError;

    fn from_str(s: &str) -> Result<Action, ParseActionError> {
        let err = |reason: &str| ParseActionError { text: s.to_string(), reason: reason.to_string() };
        let Some(pos) = s.find(|c: char| !c.is_ascii_digit()) else {
            return Err(err(if s.is_empty() { "empty" } else { "no kind letter" }));
        };
        let (stage, rest) = s.split_at(pos);
        if stage.is_empty() {
            return Err(err("must start with the stage number"));
        }
        let mut chars = rest.chars();
        let letter = chars.next().expect("rest is non-empty");
        let kind = ActionKind::from_letter(letter)
            .ok_or_else(|| err(&format!("kind {letter:?} is not one of F, B, I, W")))?;
        let mb = chars.as_str();
        if mb.is_empty() {
            return Err(err("no microbatch number after the kind"));
        }
        if !mb.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err(&format!("microbatch {mb:?} is not a number")));
        }
        let stage = stage.parse().map_err(|_| err("stage number too large"))?;
        let mb = mb.parse().map_err(|_| err("microbatch number too large"))?;
        Ok(Action { stage, kind, mb })
    }
}

impl Serialize for Action {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Action, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_form_round_trips() {
        for stage in [0, 3, 17] {
            for kind in [ActionKind::F, ActionKind::B, ActionKind::I, ActionKind::W] {
                for mb in [0, 5, 123] {
                    let a = Action::new(stage, kind, mb);
                    assert_eq!(a.to_string().parse::<Action>().unwrap(), a);
                }
            }
        }
        assert_eq!("2F0".parse::<Action>().unwrap(), Action::f(2, 0));
        assert_eq!("3B5".parse::<Action>().unwrap(), Action::b(3, 5));
    }

    #[test]
    fn bad_text_says_what_is_wrong() {
        for (text, says) in [
            ("", "empty"),
            ("12", "no kind letter"),
            ("F0", "stage number"),
            ("2X0", "'X' is not one of"),
            ("2F", "no microbatch"),
            ("2F1a", "not a number"),
            ("2f1", "'f' is not one of"),
            ("99999999999999999999F1", "too large"),
        ] {
            let e = text.parse::<Action>().unwrap_err().to_string();
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }
}
