//! What `prepare` did, for a person: a table on the terminal and an SVG
//! with removals per filter and document lengths before and after.
//!
//! Owns presentation only: every number comes from the manifest (or the
//! report that carries it), so the picture of a dataset can be drawn again
//! from its folder.

use std::fmt::Write as _;
use std::path::Path;

use super::prepare::{LengthHistogram, PrepareReport};
use super::shards::Manifest;
use super::token_file::DataError;

fn count(m: &Manifest, key: &str) -> u64 {
    m.counts.get(key).and_then(serde_json::Value::as_u64).unwrap_or(0)
}

fn counts_of(m: &Manifest, key: &str) -> Vec<(String, u64)> {
    let map: std::collections::BTreeMap<String, u64> =
        m.counts.get(key).and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default();
    super::clean::ordered_counts(&map)
}

/// The summary `prepare` prints.
pub fn table(r: &PrepareReport) -> String {
    let m = &r.manifest;
    let mut t = String::new();
    let records = count(m, "records");
    let line = |t: &mut String, what: &str, n: u64| {
        let share =
            if records > 0 { format!("{:6.2}%", 100.0 * n as f64 / records as f64) } else { String::new() };
        let _ = writeln!(t, "  {what:<28}{n:>12} {share}");
    };
    let _ = writeln!(t, "{} documents", records);
    for (k, n) in counts_of(m, "bad_records") {
        line(&mut t, &format!("skipped: {k}"), n);
    }
    for (k, n) in counts_of(m, "removed_by_filter") {
        line(&mut t, &format!("removed by {k}"), n);
    }
    for (key, what) in [
        ("trimmed_by_c4", "trimmed by C4 line rules"),
        ("empty", "empty after cleaning"),
        ("exact_duplicates", "exact duplicates"),
        ("near_duplicates", "near duplicates"),
        ("documents_kept", "kept"),
    ] {
        let n = count(m, key);
        if n > 0 || key == "documents_kept" {
            line(&mut t, what, n);
        }
    }
    let shards = |n: usize| if n > 1 { format!(" ({n} shards)") } else { String::new() };
    let _ =
        writeln!(t, "train: {} tokens → {}{}", r.train_tokens, r.train_path.display(), shards(m.train.len()));
    if let Some(v) = &r.val_path {
        let _ = writeln!(t, "val:   {} tokens → {}{}", r.val_tokens, v.display(), shards(m.val.len()));
    }
    let _ = writeln!(t, "set model.vocab_size = {} in your config", r.vocab_size);
    t
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Draws removals per filter (bars) and the document-length histogram
/// before and after (bars side by side, lengths in powers of two).
pub fn svg(m: &Manifest) -> String {
    let mut removals: Vec<(String, u64)> = counts_of(m, "removed_by_filter");
    removals.extend(counts_of(m, "bad_records").into_iter().map(|(k, n)| (format!("skipped: {k}"), n)));
    for (key, what) in [("exact_duplicates", "exact duplicates"), ("near_duplicates", "near duplicates")] {
        removals.push((what.into(), count(m, key)));
    }
    let hist: LengthHistogram = m
        .counts
        .get("length_histogram")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default();
    let (w, row) = (820.0, 18.0);
    let top_h = 40.0 + row * removals.len() as f64;
    let hist_h = 260.0;
    let h = top_h + hist_h + 60.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">Documents removed, by the first rule that removed them ({} read, {} kept)</text>"#,
        count(m, "records"),
        count(m, "documents_kept")
    );
    let max = removals.iter().map(|(_, n)| *n).max().unwrap_or(0).max(1) as f64;
    for (i, (name, n)) in removals.iter().enumerate() {
        let y = 32.0 + row * i as f64;
        let bw = 480.0 * *n as f64 / max;
        let _ = writeln!(s, r#"<text x="190" y="{:.1}" text-anchor="end">{}</text>"#, y + 12.0, esc(name));
        let _ = writeln!(
            s,
            r##"<rect x="200" y="{y:.1}" width="{bw:.1}" height="{:.1}" fill="#c0504d"/>"##,
            row - 4.0
        );
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}">{n}</text>"#, 205.0 + bw, y + 12.0);
    }
    let y0 = top_h + 20.0;
    let _ = writeln!(
        s,
        r#"<text x="10" y="{y0:.1}" font-size="14" font-weight="bold">Document length in characters (log₂ buckets): read vs written</text>"#
    );
    let buckets = hist.before.len().max(hist.after.len()).max(1);
    let hmax = hist.before.iter().chain(&hist.after).copied().max().unwrap_or(0).max(1) as f64;
    let (x0, base, plot_h) = (60.0, y0 + 20.0 + 200.0, 200.0);
    let bw = (w - x0 - 20.0) / buckets as f64;
    for b in 0..buckets {
        for (k, (v, color)) in [(&hist.before, "#7f7f7f"), (&hist.after, "#4f81bd")].into_iter().enumerate() {
            let n = v.get(b).copied().unwrap_or(0) as f64;
            let bh = plot_h * n / hmax;
            let x = x0 + bw * b as f64 + k as f64 * bw * 0.45;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{bh:.1}" fill="{color}"/>"#,
                base - bh,
                bw * 0.42
            );
        }
        if b % 2 == 0 {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">2^{b}</text>"#,
                x0 + bw * (b as f64 + 0.45),
                base + 14.0
            );
        }
    }
    let _ =
        writeln!(s, r#"<line x1="{x0}" y1="{base:.1}" x2="{:.1}" y2="{base:.1}" stroke="black"/>"#, w - 20.0);
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="{:.1}" font-size="10">{hmax} documents</text>"#,
        base - plot_h - 4.0
    );
    let ly = base + 34.0;
    let _ = writeln!(s, r##"<rect x="{x0}" y="{:.1}" width="10" height="10" fill="#7f7f7f"/>"##, ly - 9.0);
    let _ = writeln!(s, r#"<text x="{:.1}" y="{ly:.1}">read</text>"#, x0 + 14.0);
    let _ = writeln!(
        s,
        r##"<rect x="{:.1}" y="{:.1}" width="10" height="10" fill="#4f81bd"/>"##,
        x0 + 60.0,
        ly - 9.0
    );
    let _ = writeln!(s, r#"<text x="{:.1}" y="{ly:.1}">written (after filters and dedup)</text>"#, x0 + 74.0);
    s.push_str("</svg>\n");
    s
}

pub fn write_svg(m: &Manifest, path: &Path) -> Result<(), DataError> {
    super::shards::write_atomic(path, svg(m).as_bytes())
}
