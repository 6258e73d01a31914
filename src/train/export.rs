//! `pipewright export`: saved weights out as the family's Hugging Face
//! folder (config.json, model.safetensors or shards with their index), in
//! the dtype asked. The model comes from the weights by the rule every
//! command follows (`eval::load_model`); a tokenizer.json beside them travels
//! with them.

use super::eval::load_model;
use crate::model::{hf, io};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A size as transformers' `max_shard_size` takes it: bytes, or a number
/// with KB/MB/GB (powers of 1000) or KiB/MiB/GiB (of 1024).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("--max-shard-size {s:?}: expected bytes or 5GB, 500MB, 2GiB"))?;
    let scale = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024f64.powi(2),
        "GIB" => 1024f64.powi(3),
        u => bail!("--max-shard-size {s:?}: unknown unit {u:?} (B, KB, MB, GB, TB, KiB, MiB, GiB)"),
    };
    let bytes = n * scale;
    if !(bytes.is_finite() && bytes >= 1.0) {
        bail!("--max-shard-size {s:?}: must be at least one byte");
    }
    Ok(bytes as u64)
}

/// Writes the weights at `weights` into `out` as the family's folder;
/// returns the files written. `out` must be new or empty unless `force`:
/// nothing already saved is replaced by accident.
pub fn export(
    weights: &Path,
    out: &Path,
    dtype: &str,
    max_shard_size: &str,
    force: bool,
) -> Result<Vec<PathBuf>> {
    let store =
        io::StoreAs::parse(dtype).with_context(|| format!("--dtype {dtype:?}: expected f32, bf16 or f16"))?;
    let max = parse_size(max_shard_size)?;
    if out.exists() && !force {
        let full = std::fs::read_dir(out)
            .with_context(|| format!("{}: cannot list", out.display()))?
            .next()
            .is_some();
        if full {
            bail!(
                "{}: holds files already; export writes into a new or empty folder (or pass --force)",
                out.display()
            );
        }
    }
    let (cfg, w) = load_model(None, &[], weights)?;
    let arch = cfg.arch();
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let tensors: std::collections::BTreeMap<String, (&[usize], &[f32])> =
        w.tensors.iter().map(|(n, (s, d))| (n.clone(), (s.as_slice(), d.as_slice()))).collect();
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let mut files = io::export_hf(out, &arch, &tensors, meta, store, max)?;
    let mut config: serde_json::Value = serde_json::from_str(&hf::config_json(&arch))?;
    // transformers 4 reads torch_dtype, 5 reads dtype.
    config["torch_dtype"] = store.torch_name().into();
    config["dtype"] = store.torch_name().into();
    let p = out.join(hf::HF_CONFIG_FILE);
    io::write_atomic(&p, (serde_json::to_string_pretty(&config)? + "\n").as_bytes())
        .with_context(|| format!("{}: cannot write", p.display()))?;
    files.push(p);
    let folder = io::weights_file(weights);
    let tokenizer = folder.parent().unwrap_or(Path::new(".")).join("tokenizer.json");
    if tokenizer.is_file() {
        let to = out.join("tokenizer.json");
        std::fs::copy(&tokenizer, &to)
            .with_context(|| format!("{}: cannot copy to {}", tokenizer.display(), to.display()))?;
        files.push(to);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_transformers_writes_them() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert_eq!(parse_size("1.5MB").unwrap(), 1_500_000);
        assert!(parse_size("5XB").unwrap_err().to_string().contains("unknown unit"));
        assert!(parse_size("0").is_err() && parse_size("lots").is_err());
    }
}
