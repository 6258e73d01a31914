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
    let is_index = file_path.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".index.json"));
    let (mut out, stored) = if is_index { sharded(&file_path)? } else { one_file(&file_path)? };
    out.push_str(&hf_config_lines(&file_path, stored.as_deref()));
    Ok(out)
}

/// One safetensors file's listing, its parameter count and its stored config.
fn listing(file_path: &Path) -> Result<(String, u128, Option<String>), InspectError> {
    let (header, file_len) = read_header(file_path)?;
    let bad = |reason: String| InspectError::Format { path: file_path.to_path_buf(), reason };
    // safetensors' Metadata checks that offsets tile the data without gaps and
    // agree with dtype and shape; what it cannot see is the file's length.
    let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let expected_len = 8 + header.len() as u64 + metadata.data_len() as u64;
    if expected_len != file_len {
        return Err(bad(format!(
            "the header describes {expected_len} bytes but the file has {file_len} (truncated?)"
        )));
    }
    let total = metadata.tensors().values().map(|i| i.shape.iter().product::<usize>() as u128).sum();
    let stored = metadata.metadata().as_ref().and_then(|m| m.get(CONFIG_METADATA_KEY).cloned());
    Ok((render(file_path, &metadata, file_len), total, stored))
}

fn one_file(file_path: &Path) -> Result<(String, Option<String>), InspectError> {
    let (out, _, stored) = listing(file_path)?;
    Ok((out, stored))
}

/// A sharded checkpoint: each shard the index names, listed in turn (headers
/// only), and the parameters of all of them.
fn sharded(index: &Path) -> Result<(String, Option<String>), InspectError> {
    let io = |error| InspectError::Io { path: index.to_path_buf(), error };
    let bad = |reason: String| InspectError::Format { path: index.to_path_buf(), reason };
    let text =
        crate::fsutil::read_regular_to_string(index, MAX_HEADER_BYTES, "an index may hold").map_err(io)?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
        bad("no \"weight_map\" object (expected a Hugging Face model.safetensors.index.json)".into())
    })?;
    let mut shards = Vec::new();
    for (tensor, file) in map {
        let Some(f) = file.as_str().filter(|f| !f.contains('/') && !f.contains('\\')) else {
            return Err(bad(format!(
                "weight_map[{tensor:?}] = {file}: expected a file name beside the index"
            )));
        };
        shards.push(f.to_string());
    }
    shards.sort_by(|a, b| natural_cmp(a, b));
    shards.dedup();
    let folder = index.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut out = format!("{}: {} shards\n", index.display(), shards.len());
    let (mut total, mut stored) = (0u128, None);
    for shard in &shards {
        let (text, n, s) = listing(&folder.join(shard))?;
        out.push_str(&text);
        total += n;
        stored = stored.or(s);
    }
    let _ = writeln!(out, "all {} shards: {} parameters", shards.len(), grouped(total));
    Ok((out, stored))
}

/// The model `eval` and `train --init` take from the weights by
/// `hf::weights_model`'s rule (a `config.json` beside them, which must agree
/// with the config a run stored in them), or why they refuse it.
fn hf_config_lines(file: &Path, stored: Option<&str>) -> String {
    match crate::model::hf::weights_model(file, stored) {
        Ok(Some(m)) => m.hf.map(|c| format!("{}\n", c.summary())).unwrap_or_default(),
        Ok(None) => String::new(),
        Err(e) => format!("{e} (eval, train --init, generate and export refuse these weights)\n"),
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
        // A Hugging Face folder's weights: no config stored in them.
        write(&dir.path().join(MODEL_FILE), &[("transformer.wte.weight", vec![10, 4])], None);
        let cfg = crate::model::Arch::gpt2(2, 1, 4, 10, 8);
        std::fs::write(dir.path().join("config.json"), crate::model::hf::config_json(&cfg)).unwrap();
        let out = inspect(dir.path()).unwrap();
        assert!(
            out.ends_with("GPT-2, n_layer = 2, n_head = 1, n_embd = 4, vocab_size = 10, block_size = 8\n"),
            "{out}"
        );
    }

    #[test]
    fn a_config_json_that_disagrees_with_the_stored_config_is_named_as_refused() {
        let dir = tempfile::tempdir().unwrap();
        let stored = "[model]\nn_layer = 2\nn_head = 1\nn_embd = 4\nvocab_size = 10\nblock_size = 8\n";
        let tensors = [("transformer.wte.weight", vec![10, 4])];
        write(&dir.path().join(MODEL_FILE), &tensors, Some(&[(CONFIG_METADATA_KEY, stored)]));
        let cfg = crate::model::Arch::gpt2(2, 1, 4, 10, 8);
        std::fs::write(dir.path().join("config.json"), crate::model::hf::config_json(&cfg)).unwrap();
        assert!(inspect(dir.path()).unwrap().ends_with("block_size = 8\n"), "agreeing: summarized");
        // The stored config says 2 layers; this config.json, 3.
        let cfg = crate::model::Arch::gpt2(3, 1, 4, 10, 8);
        std::fs::write(dir.path().join("config.json"), crate::model::hf::config_json(&cfg)).unwrap();
        let out = inspect(dir.path()).unwrap();
        let last = out.lines().last().unwrap();
        assert!(last.contains("model.n_layer") && last.contains("refuse these weights"), "{out}");
    }

    #[test]
    fn a_sharded_folder_lists_every_shard_its_index_names() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write(&d.join("model-00001-of-00002.safetensors"), &[("a.weight", vec![3, 4])], None);
        write(&d.join("model-00002-of-00002.safetensors"), &[("b.weight", vec![5])], None);
        let index = r#"{"metadata": {"total_size": 68}, "weight_map": {
            "b.weight": "model-00002-of-00002.safetensors", "a.weight": "model-00001-of-00002.safetensors"}}"#;
        std::fs::write(d.join("model.safetensors.index.json"), index).unwrap();
        let out = inspect(d).unwrap();
        assert!(out.starts_with(&format!("{}: 2 shards\n", d.join("model.safetensors.index.json").display())));
        let (a, b) = (out.find("a.weight").unwrap(), out.find("b.weight").unwrap());
        assert!(a < b, "shards in order: {out}");
        assert!(out.ends_with("all 2 shards: 17 parameters\n"), "{out}");
        // A shard the index names but the folder lacks is named.
        std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
        let err = inspect(d).unwrap_err().to_string();
        assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
        std::fs::write(d.join("model.safetensors.index.json"), r#"{"weight_map": {"a": "../x"}}"#).unwrap();
        let err = inspect(d).unwrap_err().to_string();
        assert!(err.contains("expected a file name beside the index"), "{err}");
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
