//! `pipewright inspect`: a readable listing of a `.safetensors` file (or a
//! checkpoint directory's `model.safetensors`): tensors, parameter count and
//! the metadata, including the resolved config a run stored there.
//! Reads only the header, never the tensor data, so it is instant on large
//! checkpoints; never writes, and never panics on a bad file: every failure is
//! an error naming the file.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata;

// The config key is shown whole and readers outside the crate look it up by this path.
pub use crate::model::io::CONFIG_METADATA_KEY;

/// safetensors' own limit: a header past this is refused by every reader.
const MAX_HEADER_BYTES: u64 = 100_000_000;

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Format { path: PathBuf, reason: String },
}

/// Lists every tensor (name, dtype, shape, elements; in name order, numbers
/// in names compared as numbers so `h.2` comes before `h.10`), the total
/// parameter count and the `__metadata__` entries.
pub fn inspect(path: &Path) -> Result<String, InspectError> {
    let file_path = crate::model::io::weights_file(path);
    let (header, file_len) = read_header(&file_path)?;
    let bad = |reason: String| InspectError::Format { path: file_path.clone(), reason };
    // safetensors' Metadata checks that offsets tile the data without gaps and
    // agree with dtype and shape; what it cannot see is the file's length.
    let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let expected_len = 8 + header.len() as u64 + metadata.data_len() as u64;
    if expected_len != file_len {
        return Err(bad(format!(
            "the header describes {expected_len} bytes but the file has {file_len} (truncated?)"
        )));
    }
    let mut out = render(&file_path, &metadata, file_len);
    out.push_str(&hf_config_lines(&file_path));
    Ok(out)
}

/// The model a `config.json` beside the file gives (what `eval` and
/// `train --init` would take from it, by `hf::weights_model`'s rule), or why
/// it cannot be used.
fn hf_config_lines(file: &Path) -> String {
    let folder = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match crate::model::hf::read_config(folder) {
        Ok(None) => String::new(),
        Ok(Some(c)) => format!("{}\n", c.summary()),
        Err(e) => format!("{e} (eval and train --init cannot use it)\n"),
    }
}

/// The JSON header and the file's length, read without touching tensor data.
fn read_header(path: &Path) -> Result<(Vec<u8>, u64), InspectError> {
    let io = |error| InspectError::Io { path: path.to_path_buf(), error };
    let mut file = crate::fsutil::open_regular(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let bad = |reason: String| InspectError::Format { path: path.to_path_buf(), reason };
    let mut len_bytes = [0u8; 8];
    if file_len < 8 {
        return Err(bad(format!("{file_len} bytes is too short for the 8-byte header length")));
    }
    file.read_exact(&mut len_bytes).map_err(io)?;
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES || n > file_len - 8 {
        return Err(bad(format!("header length {n} does not fit in a file of {file_len} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(io)?;
    Ok((header, file_len))
}

fn render(path: &Path, metadata: &Metadata, file_len: u64) -> String {
    let mut tensors: Vec<(String, &safetensors::tensor::TensorInfo)> =
        metadata.tensors().into_iter().collect();
    tensors.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    let rows: Vec<[String; 4]> = tensors
        .iter()
        .map(|(name, info)| {
            let shape: Vec<String> = info.shape.iter().map(usize::to_string).collect();
            [
                name.clone(),
                info.dtype.to_string(),
                format!("[{}]", shape.join(", ")),
                // Metadata validation already proved this product does not overflow.
                grouped(info.shape.iter().product::<usize>() as u128),
            ]
        })
        .collect();
    let total: u128 = tensors.iter().map(|(_, info)| info.shape.iter().product::<usize>() as u128).sum();

    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} tensors, {} parameters, {} bytes",
        path.display(),
        rows.len(),
        grouped(total),
        grouped(file_len as u128)
    );
    let header = ["name", "dtype", "shape", "elements"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let _ = writeln!(
            out,
            "  {:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}",
            row[0],
            row[1],
            row[2],
            row[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3]
        );
    }
    let _ = writeln!(out, "total parameters: {}", grouped(total));

    // Sorted: the file's map has no order, and output should not vary by run.
    let entries: BTreeMap<&String, &String> = metadata.metadata().iter().flatten().collect();
    if entries.is_empty() {
        let _ = writeln!(out, "metadata: (none)");
    } else {
        let _ = writeln!(out, "metadata:");
        for (key, value) in entries {
            if value.contains('\n') || key == CONFIG_METADATA_KEY {
                let _ = writeln!(out, "  {key}:");
                for line in value.lines() {
                    let _ = writeln!(out, "    {line}");
                }
            } else {
                let _ = writeln!(out, "  {key} = {value}");
            }
        }
    }
    out
}

/// Orders names with digit runs compared as numbers (`h.2` < `h.10`).
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let (mut a, mut b) = (a, b);
    loop {
        let (Some(ca), Some(cb)) = (a.chars().next(), b.chars().next()) else {
            return a.len().cmp(&b.len());
        };
        if ca.is_ascii_digit() && cb.is_ascii_digit() {
            let da = a.len() - a.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let db = b.len() - b.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let (na, nb) = (a[..da].trim_start_matches('0'), b[..db].trim_start_matches('0'));
            let ord = na.len().cmp(&nb.len()).then(na.cmp(nb)).then(da.cmp(&db));
            if ord.is_ne() {
                return ord;
            }
            (a, b) = (&a[da..], &b[db..]);
        } else {
            if ca != cb {
                return ca.cmp(&cb);
            }
            (a, b) = (&a[ca.len_utf8()..], &b[cb.len_utf8()..]);
        }
    }
}

/// 124439808 → "124,439,808".
fn grouped(n: u128) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::io::MODEL_FILE;
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    use std::collections::HashMap;

    /// Writes tensors of the given shapes (all f32 zeros) plus metadata.
    fn write(path: &Path, tensors: &[(&str, Vec<usize>)], meta: Option<&[(&str, &str)]>) {
        let data: Vec<Vec<u8>> =
            tensors.iter().map(|(_, shape)| vec![0u8; 4 * shape.iter().product::<usize>()]).collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&data)
            .map(|((name, shape), bytes)| {
                let view = TensorView::new(Dtype::F32, shape.clone(), bytes).unwrap();
                (name.to_string(), view)
            })
            .collect();
        let meta: Option<HashMap<String, String>> =
            meta.map(|m| m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        safetensors::serialize_to_file(views, meta, path).unwrap();
    }

    fn tiny_model(dir: &Path) -> PathBuf {
        let path = dir.join(MODEL_FILE);
        let config = "[model]\nn_layer = 2\nn_embd = 4\n";
        write(
            &path,
            &[
                ("transformer.wte.weight", vec![10, 4]),
                ("transformer.h.10.ln_1.weight", vec![4]),
                ("transformer.h.2.ln_1.weight", vec![4]),
                ("transformer.wpe.weight", vec![8, 4]),
            ],
            Some(&[(CONFIG_METADATA_KEY, config), ("format", "pt")]),
        );
        path
    }

    #[test]
    fn lists_tensors_in_name_order_with_counts() {
        let dir = tempfile::tempdir().unwrap();
        let out = inspect(&tiny_model(dir.path())).unwrap();
        let names: Vec<&str> = out
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|w| w.starts_with("transformer."))
            .collect();
        assert_eq!(
            names,
            [
                "transformer.h.2.ln_1.weight",
                "transformer.h.10.ln_1.weight",
                "transformer.wpe.weight",
                "transformer.wte.weight"
            ]
        );
        let wte = out.lines().find(|l| l.contains("transformer.wte.weight")).unwrap();
        assert!(wte.contains("F32") && wte.contains("[10, 4]") && wte.ends_with("40"), "{wte}");
        assert!(out.contains("total parameters: 80\n"), "{out}");
        assert!(out.contains("4 tensors, 80 parameters"), "{out}");
    }

    #[test]
    fn prints_metadata_and_the_stored_config() {
        let dir = tempfile::tempdir().unwrap();
        let out = inspect(&tiny_model(dir.path())).unwrap();
        assert!(out.contains("  format = pt\n"), "{out}");
        assert!(
            out.contains("  pipewright.config:\n    [model]\n    n_layer = 2\n    n_embd = 4\n"),
            "{out}"
        );
    }

    #[test]
    fn a_directory_means_its_model_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = tiny_model(dir.path());
        assert_eq!(inspect(dir.path()).unwrap(), inspect(&path).unwrap());
    }

    #[test]
    fn a_hugging_face_config_json_beside_the_weights_is_summarized() {
        let dir = tempfile::tempdir().unwrap();
        tiny_model(dir.path());
        let cfg = crate::model::Arch::gpt2(2, 1, 4, 10, 8);
        std::fs::write(dir.path().join("config.json"), crate::model::hf::config_json(&cfg)).unwrap();
        let out = inspect(dir.path()).unwrap();
        assert!(
            out.ends_with("GPT-2, n_layer = 2, n_head = 1, n_embd = 4, vocab_size = 10, block_size = 8\n"),
            "{out}"
        );
    }

    #[test]
    fn no_metadata_and_no_tensors_are_fine() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.safetensors");
        write(&path, &[], None);
        let out = inspect(&path).unwrap();
        assert!(out.contains("0 tensors, 0 parameters"), "{out}");
        assert!(out.contains("metadata: (none)"), "{out}");
    }

    #[test]
    fn truncated_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = tiny_model(dir.path());
        let bytes = std::fs::read(&path).unwrap();
        // Every cut: inside the length, inside the header, inside the data.
        for cut in 0..bytes.len() {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            let err = inspect(&path).expect_err("truncated file accepted");
            assert!(err.to_string().starts_with(&path.display().to_string()), "{err}");
        }
    }

    #[test]
    fn corrupt_header_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = tiny_model(dir.path());
        let good = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        for i in 0..8 + n {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bytes = good.clone();
                bytes[i] ^= flip;
                std::fs::write(&path, &bytes).unwrap();
                // Some flips still give a valid file (a changed name); none may panic.
                if let Err(err) = inspect(&path) {
                    assert!(err.to_string().starts_with(&path.display().to_string()), "{err}");
                }
            }
        }
        std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        assert!(inspect(&path).unwrap_err().to_string().contains("header length"));
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = inspect(dir.path()).unwrap_err();
        assert!(matches!(err, InspectError::Io { .. }));
        assert!(err.to_string().contains(MODEL_FILE), "{err}");
    }

    #[test]
    fn natural_order_compares_numbers_as_numbers() {
        let mut names = ["h.10.w", "h.2.w", "h.1.w", "h.02.w", "a", "h.10"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(names, ["a", "h.1.w", "h.2.w", "h.02.w", "h.10", "h.10.w"]);
        assert_eq!(grouped(1234567), "1,234,567");
        assert_eq!(grouped(999), "999");
    }
}
