//! What every config section's checks share: a broken rule that names the
//! field's path, the value given and what was expected; the list checks add
//! to; and `choice!`, the closed sets of lower-case names a config spells.
//!
//! It sits below both `config` and `model` (the model section's rules live
//! with the model, its families' with each family), so neither imports the
//! other for it. It imports nothing of the crate.

use std::fmt;

/// One broken rule found by a section's checks.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    /// The field's path, e.g. `model.n_head`.
    pub path: String,
    /// The value given, as written in TOML.
    pub value: String,
    /// What was expected instead.
    pub expected: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.path, self.value, self.expected)
    }
}

/// The problems found so far: every check runs, so a config with three
/// mistakes is refused once, naming all three.
#[derive(Default, Debug)]
pub struct Checks {
    pub problems: Vec<Problem>,
}

impl Checks {
    /// Records a problem unless `ok`.
    pub fn check(&mut self, ok: bool, path: &str, value: impl fmt::Display, expected: impl Into<String>) {
        if !ok {
            self.problems.push(Problem {
                path: path.to_string(),
                value: value.to_string(),
                expected: expected.into(),
            });
        }
    }

    pub fn is_empty(&self) -> bool {
        self.problems.is_empty()
    }
}

/// A string as TOML would quote it, for a problem's value.
pub fn quoted(s: &str) -> String {
    format!("{s:?}")
}

/// A closed set of choices a config names in TOML by a fixed lower-case name.
/// serde reads and writes the names (an unknown one is refused with the field
/// and the names accepted); `name()` is the same text for messages.
#[macro_export]
macro_rules! choice {
    ($(#[$m:meta])* pub enum $t:ident { $($(#[$vm:meta])* $v:ident = $n:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        pub enum $t { $($(#[$vm])* #[serde(rename = $n)] $v),+ }

        impl $t {
            pub fn name(self) -> &'static str {
                match self { $($t::$v => $n),+ }
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
