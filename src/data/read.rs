//! Readers: input files → documents, in a fixed order.
//!
//! Owns the formats corpora ship in — plain text (a file is a document),
//! JSON lines (a line is a document; its text is one field), parquet (a row
//! is a document; its text is one column), each of the first two also
//! gzip- or zstd-compressed — and the order they are read in: files as
//! given, folders' files in name order. Hands out raw records (a JSON line
//! is parsed later, in parallel, by [`RawDoc::text`]), so the one thread that
//! reads only decompresses and splits lines. Never holds more than one
//! record (a text file: one file) beyond what its caller keeps.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use super::token_file::DataError;

/// How documents are found in records (`prepare --text-field`, `--skip-bad-lines`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ReadSettings {
    /// The JSON field, or parquet column, that holds a document's text.
    pub text_field: String,
    /// A JSON line that does not parse, or lacks the field, is skipped and
    /// counted instead of stopping the run.
    pub skip_bad_lines: bool,
}

impl Default for ReadSettings {
    fn default() -> Self {
        ReadSettings { text_field: "text".into(), skip_bad_lines: false }
    }
}

/// A file's record layout, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// The whole file is one document.
    Text,
    /// `.jsonl`, `.ndjson`, `.json`: one JSON object a line.
    Jsonl,
    /// `.parquet`: one row a document.
    Parquet,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// The format and compression a file's name announces: `.gz` / `.zst`
/// (`.zstd`) outside, then `.jsonl` / `.ndjson` / `.json` or `.parquet`;
/// anything else is text.
pub fn format_of(path: &Path) -> (Format, Compression) {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    let (inner, compression) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = name.strip_suffix(".zst").or_else(|| name.strip_suffix(".zstd")) {
        (s, Compression::Zstd)
    } else {
        (name.as_str(), Compression::None)
    };
    let format = if [".jsonl", ".ndjson", ".json"].iter().any(|e| inner.ends_with(e)) {
        Format::Jsonl
    } else if inner.ends_with(".parquet") {
        Format::Parquet
    } else {
        Format::Text
    };
    (format, compression)
}

/// One record as read: a text file's contents, a JSON line not yet parsed,
/// or a parquet row's text.
#[derive(Clone, Debug)]
pub struct RawDoc {
    /// Index of the file in the input list.
    pub file: u32,
    /// 1-based line (JSON lines) or row (parquet); 0 for a text file.
    pub line: u64,
    /// The record's bytes: UTF-8 checked for JSON lines and parquet values;
    /// a text file's bytes as they are (the byte tokenizer takes any).
    pub body: Vec<u8>,
    /// `body` is a JSON line whose text is in a field.
    pub json: bool,
}

/// Why a record gave no document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadRecord {
    NotJson(String),
    NoField,
    NotText,
    /// A text file that is not UTF-8, at this byte offset.
    NotUtf8(usize),
}

impl BadRecord {
    /// The counter a skipped record is counted under.
    pub fn counter(&self) -> &'static str {
        match self {
            BadRecord::NotJson(_) => "not_json",
            BadRecord::NoField => "missing_field",
            BadRecord::NotText => "field_not_text",
            BadRecord::NotUtf8(_) => "not_utf8",
        }
    }

    pub fn describe(&self, field: &str) -> String {
        match self {
            BadRecord::NotJson(e) => format!("not a JSON object ({e})"),
            BadRecord::NoField => format!("has no field {field:?}"),
            BadRecord::NotText => format!("field {field:?} is not a string"),
            BadRecord::NotUtf8(at) => format!("not valid UTF-8 at byte offset {at} (expected UTF-8 text)"),
        }
    }
}

impl RawDoc {
    /// The document's text: the body, or the JSON line's `field`.
    pub fn text(self, field: &str) -> Result<String, BadRecord> {
        if !self.json {
            return String::from_utf8(self.body)
                .map_err(|e| BadRecord::NotUtf8(e.utf8_error().valid_up_to()));
        }
        let value: serde_json::Value =
            serde_json::from_slice(&self.body).map_err(|e| BadRecord::NotJson(e.to_string()))?;
        let serde_json::Value::Object(mut map) = value else {
            return Err(BadRecord::NotJson("a JSON value that is not an object".into()));
        };
        match map.remove(field) {
            None => Err(BadRecord::NoField),
            Some(serde_json::Value::String(s)) => Ok(s),
            Some(_) => Err(BadRecord::NotText),
        }
    }

    /// `file:line` for messages.
    pub fn place(&self, files: &[PathBuf]) -> String {
        let path = files.get(self.file as usize).map(|p| p.display().to_string()).unwrap_or_default();
        match self.line {
            0 => path,
            n => format!("{path}: line {n}"),
        }
    }
}

fn io_error<'a>(path: &'a Path, action: &'static str) -> impl Fn(std::io::Error) -> DataError + 'a {
    move |error| {
        if error.kind() == std::io::ErrorKind::NotFound {
            DataError::Invalid { what: format!("input {}: no such file", path.display()) }
        } else {
            DataError::Io { path: path.to_path_buf(), action, error }
        }
    }
}

/// The file's bytes as they decompress.
fn open_stream(path: &Path, compression: Compression) -> Result<Box<dyn Read + Send>, DataError> {
    // A FIFO, directory or device is refused here, never waited on.
    let file: File = crate::fsutil::open_regular(path).map_err(io_error(path, "open"))?;
    Ok(match compression {
        Compression::None => Box::new(file),
        // Multi-member: `cat a.gz b.gz` and pigz output are one stream.
        Compression::Gzip => {
            Box::new(flate2::read::MultiGzDecoder::new(BufReader::with_capacity(1 << 20, file)))
        }
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(file).map_err(|error| {
            DataError::Io { path: path.to_path_buf(), action: "open zstd stream", error }
        })?),
    })
}

/// Reads `files[index]`, handing each record to `sink` in order.
pub fn read_file(
    files: &[PathBuf],
    index: usize,
    settings: &ReadSettings,
    sink: &mut dyn FnMut(RawDoc) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let path = &files[index];
    let (format, compression) = format_of(path);
    let file = index as u32;
    match format {
        Format::Text => {
            let mut body = Vec::new();
            open_stream(path, compression)?.read_to_end(&mut body).map_err(|error| DataError::Io {
                path: path.clone(),
                action: "read",
                error,
            })?;
            sink(RawDoc { file, line: 0, body, json: false })
        }
        Format::Jsonl => {
            let mut r = BufReader::with_capacity(1 << 20, open_stream(path, compression)?);
            let mut buf = Vec::new();
            let mut line = 0u64;
            loop {
                buf.clear();
                let n = r.read_until(b'\n', &mut buf).map_err(|error| DataError::Io {
                    path: path.clone(),
                    action: "read",
                    error,
                })?;
                if n == 0 {
                    return Ok(());
                }
                line += 1;
                while buf.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
                    buf.pop();
                }
                if buf.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let body = match std::str::from_utf8(&buf) {
                    Ok(_) => std::mem::take(&mut buf),
                    Err(e) => {
                        let at = e.valid_up_to();
                        if settings.skip_bad_lines {
                            // Parsed later as JSON, it fails and is counted.
                            b"\xff".to_vec()
                        } else {
                            return Err(DataError::Invalid {
                                what: format!(
                                    "{}: line {line}: not valid UTF-8 at byte {at} of the line (expected \
                                     UTF-8 JSON; --skip-bad-lines skips and counts such lines)",
                                    path.display()
                                ),
                            });
                        }
                    }
                };
                sink(RawDoc { file, line, body, json: true })?;
            }
        }
        Format::Parquet => read_parquet(path, file, &settings.text_field, sink),
    }
}

/// A parquet file's `column`, one document a row, row groups in order.
/// Null values are skipped (they hold no text).
fn read_parquet(
    path: &Path,
    file: u32,
    column: &str,
    sink: &mut dyn FnMut(RawDoc) -> Result<(), DataError>,
) -> Result<(), DataError> {
    use parquet::basic::Type as Physical;
    use parquet::column::reader::ColumnReader;
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let f = crate::fsutil::open_regular(path).map_err(io_error(path, "open"))?;
    let bad = |e: parquet::errors::ParquetError| DataError::Invalid {
        what: format!("{}: not a readable parquet file: {e}", path.display()),
    };
    let reader = SerializedFileReader::new(f).map_err(bad)?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let found = schema.columns().iter().position(|c| c.path().string() == column);
    let Some(col) = found else {
        let names: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
        return Err(DataError::Invalid {
            what: format!(
                "{}: has no column {column:?} (its columns: {}; --text-field names the text column)",
                path.display(),
                names.join(", ")
            ),
        });
    };
    let descr = schema.column(col);
    if descr.physical_type() != Physical::BYTE_ARRAY || descr.max_rep_level() > 0 {
        return Err(DataError::Invalid {
            what: format!(
                "{}: column {column:?} is {:?}{}; expected a string (BYTE_ARRAY) column",
                path.display(),
                descr.physical_type(),
                if descr.max_rep_level() > 0 { " in a list" } else { "" }
            ),
        });
    }
    let max_def = descr.max_def_level();
    let mut row = 0u64;
    const BATCH: usize = 1024;
    for g in 0..reader.num_row_groups() {
        let group = reader.get_row_group(g).map_err(bad)?;
        let ColumnReader::ByteArrayColumnReader(mut cr) = group.get_column_reader(col).map_err(bad)? else {
            unreachable!("a BYTE_ARRAY column reads as byte arrays")
        };
        let (mut defs, mut values) = (Vec::with_capacity(BATCH), Vec::with_capacity(BATCH));
        loop {
            defs.clear();
            values.clear();
            let (records, _, _) = cr.read_records(BATCH, Some(&mut defs), None, &mut values).map_err(bad)?;
            if records == 0 {
                break;
            }
            // A REQUIRED column has no definition levels: every record is set.
            let set: Vec<bool> = if max_def > 0 {
                defs.iter().take(records).map(|&d| d >= max_def).collect()
            } else {
                vec![true; records]
            };
            let mut next = values.drain(..);
            for is_set in set {
                row += 1;
                if !is_set {
                    continue;
                }
                let v = next.next().expect("a value for each defined record");
                let body = v.data().to_vec();
                if let Err(e) = std::str::from_utf8(&body) {
                    return Err(DataError::Invalid {
                        what: format!(
                            "{}: row {row}: column {column:?} is not valid UTF-8 at byte {}",
                            path.display(),
                            e.valid_up_to()
                        ),
                    });
                }
                sink(RawDoc { file, line: row, body, json: false })?;
            }
        }
    }
    Ok(())
}

/// Writes `texts` as a parquet file with one string column (zstd-compressed,
/// row groups of `rows_per_group`): what tests and the benchmark read.
pub fn write_parquet(
    path: &Path,
    column: &str,
    texts: &[String],
    rows_per_group: usize,
) -> Result<(), DataError> {
    use parquet::basic::{Compression as Pc, ZstdLevel};
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let bad = |e: parquet::errors::ParquetError| DataError::Invalid {
        what: format!("{}: cannot write parquet: {e}", path.display()),
    };
    let schema = parquet::schema::parser::parse_message_type(&format!(
        "message document {{ REQUIRED BYTE_ARRAY {column} (UTF8); REQUIRED INT64 id; }}"
    ))
    .map_err(bad)?;
    let props = WriterProperties::builder().set_compression(Pc::ZSTD(ZstdLevel::default())).build();
    let file =
        File::create(path).map_err(|error| DataError::Io { path: path.into(), action: "create", error })?;
    let mut w = SerializedFileWriter::new(file, std::sync::Arc::new(schema), std::sync::Arc::new(props))
        .map_err(bad)?;
    for (g, chunk) in texts.chunks(rows_per_group.max(1)).enumerate() {
        let mut rg = w.next_row_group().map_err(bad)?;
        let mut c = rg.next_column().map_err(bad)?.expect("the text column");
        let values: Vec<ByteArray> = chunk.iter().map(|t| ByteArray::from(t.as_str())).collect();
        c.typed::<ByteArrayType>().write_batch(&values, None, None).map_err(bad)?;
        c.close().map_err(bad)?;
        let mut c = rg.next_column().map_err(bad)?.expect("the id column");
        let first = (g * rows_per_group.max(1)) as i64;
        let ids: Vec<i64> = (first..first + chunk.len() as i64).collect();
        c.typed::<parquet::data_type::Int64Type>().write_batch(&ids, None, None).map_err(bad)?;
        c.close().map_err(bad)?;
        rg.close().map_err(bad)?;
    }
    w.close().map_err(bad)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// (line, the record's text or why it has none), in order.
    type Records = Vec<(u64, Result<String, BadRecord>)>;

    fn read(files: &[PathBuf], settings: &ReadSettings) -> Result<Records, DataError> {
        let mut out = Vec::new();
        for i in 0..files.len() {
            read_file(files, i, settings, &mut |d| {
                out.push((d.line, d.text(&settings.text_field)));
                Ok(())
            })?;
        }
        Ok(out)
    }

    const JSONL: &str = "{\"text\": \"first doc\", \"id\": 1}\n\n{\"id\": 2, \"text\": \"second\\ndoc\"}\n";

    #[test]
    fn names_announce_format_and_compression() {
        let f = |n: &str| format_of(Path::new(n));
        assert_eq!(f("a.txt"), (Format::Text, Compression::None));
        assert_eq!(f("a.jsonl.zst"), (Format::Jsonl, Compression::Zstd));
        assert_eq!(f("A.JSON.GZ"), (Format::Jsonl, Compression::Gzip));
        assert_eq!(f("x/000_00000.parquet"), (Format::Parquet, Compression::None));
        assert_eq!(f("notes.md.gz"), (Format::Text, Compression::Gzip));
    }

    #[test]
    fn jsonl_plain_gzip_and_zstd_give_the_same_documents_with_their_lines() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("a.jsonl");
        std::fs::write(&plain, JSONL).unwrap();
        let gz = dir.path().join("a.jsonl.gz");
        let mut e = flate2::write::GzEncoder::new(File::create(&gz).unwrap(), flate2::Compression::default());
        e.write_all(JSONL.as_bytes()).unwrap();
        e.finish().unwrap();
        let zst = dir.path().join("a.jsonl.zst");
        std::fs::write(&zst, zstd::encode_all(JSONL.as_bytes(), 3).unwrap()).unwrap();
        let s = ReadSettings::default();
        let want = vec![(1, Ok("first doc".to_string())), (3, Ok("second\ndoc".to_string()))];
        for f in [plain, gz, zst] {
            assert_eq!(read(std::slice::from_ref(&f), &s).unwrap(), want, "{}", f.display());
        }
    }

    #[test]
    fn a_bad_json_line_is_named_by_its_kind_and_a_text_file_is_one_document() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("b.jsonl");
        std::fs::write(&f, "{\"text\": \"ok\"}\nnot json\n{\"body\": \"x\"}\n{\"text\": 5}\n[1]\n").unwrap();
        let got = read(&[f], &ReadSettings::default()).unwrap();
        let kinds: Vec<_> =
            got.iter().map(|(l, r)| (*l, r.as_ref().map_err(|e| e.counter()).cloned())).collect();
        assert_eq!(
            kinds,
            vec![
                (1, Ok("ok".into())),
                (2, Err("not_json")),
                (3, Err("missing_field")),
                (4, Err("field_not_text")),
                (5, Err("not_json")),
            ]
        );
        let t = dir.path().join("c.txt.zst");
        std::fs::write(&t, zstd::encode_all("one\n\ndocument".as_bytes(), 1).unwrap()).unwrap();
        assert_eq!(read(&[t], &ReadSettings::default()).unwrap(), vec![(0, Ok("one\n\ndocument".into()))]);
    }

    #[test]
    fn invalid_utf8_in_a_json_line_is_an_error_naming_file_and_line_unless_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.jsonl");
        std::fs::write(&f, b"{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n").unwrap();
        let err = read(std::slice::from_ref(&f), &ReadSettings::default()).unwrap_err().to_string();
        assert!(err.contains("bad.jsonl: line 2") && err.contains("UTF-8"), "{err}");
        let skip = ReadSettings { skip_bad_lines: true, ..Default::default() };
        let got = read(&[f], &skip).unwrap();
        assert_eq!(got[1].1.as_ref().unwrap_err().counter(), "not_json");
    }

    #[test]
    fn parquet_rows_are_documents_in_order_across_row_groups() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.parquet");
        let texts: Vec<String> = (0..2500).map(|i| format!("document number {i}")).collect();
        write_parquet(&f, "text", &texts, 1000).unwrap();
        let got = read(std::slice::from_ref(&f), &ReadSettings::default()).unwrap();
        assert_eq!(got.len(), 2500);
        assert_eq!(got[1234], (1235, Ok("document number 1234".into())));
        let other = ReadSettings { text_field: "content".into(), ..Default::default() };
        let err = read(std::slice::from_ref(&f), &other).unwrap_err().to_string();
        assert!(err.contains("no column \"content\"") && err.contains("text, id"), "{err}");
        let ints = ReadSettings { text_field: "id".into(), ..Default::default() };
        let err = read(&[f], &ints).unwrap_err().to_string();
        assert!(err.contains("expected a string"), "{err}");
        let junk = dir.path().join("junk.parquet");
        std::fs::write(&junk, "not parquet at all").unwrap();
        let err = read(&[junk], &ReadSettings::default()).unwrap_err().to_string();
        assert!(err.contains("junk.parquet: not a readable parquet file"), "{err}");
    }
}
