//! Weights that hold NaN or infinity are refused where they come in (`--init`,
//! `eval`): training from them skips every step until recovery gives up, and
//! a loss computed from them means nothing. The error names the file, the
//! tensor and the first bad element.

use crate::model::io::LoadedWeights;
use anyhow::{bail, Result};

/// Refuses `w` (read from its `path`, called `what` in the error) if any
/// tensor holds a non-finite value.
pub fn check_finite(w: &LoadedWeights, what: &str) -> Result<()> {
    // By name, so the tensor named is the same on every run.
    let mut names: Vec<&String> = w.tensors.keys().collect();
    names.sort();
    for name in names {
        let (shape, data) = &w.tensors[name];
        let bad: Vec<usize> =
            data.iter().enumerate().filter(|(_, x)| !x.is_finite()).map(|(i, _)| i).collect();
        if let Some(&first) = bad.first() {
            bail!(
                "{what} {}: tensor `{name}` (shape {shape:?}) holds {} non-finite value{} (the first, element \
                 {first}, is {}): training or evaluating from it gives only NaN",
                w.path.display(),
                bad.len(),
                if bad.len() == 1 { "" } else { "s" },
                data[first]
            );
        }
    }
    Ok(())
}
