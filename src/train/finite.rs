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
        // A scan that allocates nothing for the (usual) clean tensor.
        if let Some(first) = data.iter().position(|x| !x.is_finite()) {
            let bad = data[first..].iter().filter(|x| !x.is_finite()).count();
            // The file's name first; ours (whose shape and elements are given) when it differs.
            let spelled = w.file_name(name);
            let tensor = match spelled == *name {
                true => format!("`{name}`"),
                false => format!("`{spelled}` (as pipewright's `{name}`)"),
            };
            bail!(
                "{what} {}: tensor {tensor} (shape {shape:?}) holds {} non-finite value{} (the first, element \
                 {first}, is {}): training or evaluating from it gives only NaN",
                w.path.display(),
                bad,
                if bad == 1 { "" } else { "s" },
                data[first]
            );
        }
    }
    Ok(())
}
