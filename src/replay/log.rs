//! The replay log of one actor: `RUN/replay/<actor>.log`.
//!
//! Layout: the magic `PWREPLAY`, a little-endian u32 format version, then a
//! length-prefixed [`Header`] and length-prefixed [`Entry`] frames, each frame
//! followed by a 32-byte chain digest, blake3(previous chain digest ‖ frame),
//! seeded by the digest of the magic, version and header. The chain is what
//! tells a log that was altered after recording (any byte of any earlier frame
//! changes every later digest) from one whose run really diverged. Frames are
//! bincode 2 (serde); tensors are raw little-endian bytes.
//!
//! A log that was closed normally ends with a trailer: the length sentinel
//! `u64::MAX`, the entry count and the final chain digest. Without it a file
//! cut exactly at a frame boundary would look whole; with it, a missing
//! trailer means the recording stopped early (a crash or a kill).

use serde::{Deserialize, Serialize};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"PWREPLAY";
pub const VERSION: u32 = 2;
/// No frame is larger: a corrupt length is refused before anything is allocated.
const MAX_FRAME: u64 = 1 << 30;
/// In place of a frame length: the trailer follows (entry count, chain digest).
const TRAILER: u64 = u64::MAX;

pub type Digest = [u8; 32];

pub fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ MAX_FRAME as usize }>()
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    U32,
    F64,
    /// Text (a path, a kind), UTF-8.
    Str,
    /// A file's bytes: its digest and size (never the bytes themselves).
    Bytes,
}

/// One tensor or scalar of a message: its digest, and its bytes when the log
/// keeps payloads (scalars and short values are always kept).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Blob {
    pub name: String,
    pub dtype: DType,
    pub len: u64,
    pub digest: Digest,
    pub data: Option<Vec<u8>>,
}

/// Values up to this many bytes are stored even in digest-only logs: the
/// control messages' scalars, so every actor's inputs can be rebuilt.
const ALWAYS_KEEP: usize = 4096;

fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // f32/u32/f64 have no padding and every bit pattern is valid as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

#[cfg(target_endian = "big")]
compile_error!("replay logs store tensors as raw little-endian bytes");

impl Blob {
    fn new(name: &str, dtype: DType, len: usize, bytes: &[u8], keep: bool) -> Blob {
        let digest = if bytes.len() > 1 << 20 {
            *blake3::Hasher::new().update_rayon(bytes).finalize().as_bytes()
        } else {
            *blake3::hash(bytes).as_bytes()
        };
        let data = (keep || bytes.len() <= ALWAYS_KEEP).then(|| bytes.to_vec());
        Blob { name: name.to_string(), dtype, len: len as u64, digest, data }
    }

    pub fn f32s(name: &str, v: &[f32], keep: bool) -> Blob {
        Blob::new(name, DType::F32, v.len(), bytes_of(v), keep)
    }

    pub fn u32s(name: &str, v: &[u32], keep: bool) -> Blob {
        Blob::new(name, DType::U32, v.len(), bytes_of(v), keep)
    }

    pub fn f64s(name: &str, v: &[f64], keep: bool) -> Blob {
        Blob::new(name, DType::F64, v.len(), bytes_of(v), keep)
    }

    pub fn f64(name: &str, x: f64) -> Blob {
        Blob::f64s(name, &[x], true)
    }

    pub fn str(name: &str, s: &str) -> Blob {
        Blob::new(name, DType::Str, s.len(), s.as_bytes(), true)
    }

    /// A file by its blake3 digest and size, as something written to disk.
    pub fn file(name: &str, digest: Digest, size: u64) -> Blob {
        Blob { name: name.to_string(), dtype: DType::Bytes, len: size, digest, data: None }
    }

    pub fn has_data(&self) -> bool {
        self.data.is_some()
    }

    /// Stored bytes agree with the blob's size and digest. The chain proves
    /// only that a frame is the one written after the frames before it; a
    /// log rebuilt with other bytes under the old digests would replay
    /// those bytes while every comparison (by digest) still matched.
    fn check_data(&self) -> Result<(), String> {
        let Some(d) = &self.data else { return Ok(()) };
        let width = match self.dtype {
            DType::F32 | DType::U32 => 4,
            DType::F64 => 8,
            DType::Str => 1,
            DType::Bytes => return Err("a file's blob stores bytes; only its digest is ever recorded".into()),
        };
        if d.len() as u64 != self.len.saturating_mul(width) {
            return Err(format!("{} bytes stored for {} {:?} values", d.len(), self.len, self.dtype));
        }
        let digest = match d.len() > 1 << 20 {
            true => *blake3::Hasher::new().update_rayon(d).finalize().as_bytes(),
            false => *blake3::hash(d).as_bytes(),
        };
        match digest == self.digest {
            true => Ok(()),
            false => Err(format!(
                "its stored bytes hash to {}, not the recorded digest {}",
                hex8(&digest),
                hex8(&self.digest)
            )),
        }
    }

    fn data_or_err(&self) -> Result<&[u8], String> {
        self.data.as_deref().ok_or_else(|| format!("{}: only its digest was recorded", self.name))
    }

    fn elems<const N: usize>(&self, want: DType) -> Result<impl Iterator<Item = [u8; N]> + '_, String> {
        if self.dtype != want {
            return Err(format!("{}: recorded as {:?}, expected {want:?}", self.name, self.dtype));
        }
        let d = self.data_or_err()?;
        if d.len() as u64 != self.len * N as u64 {
            return Err(format!("{}: {} bytes for {} values", self.name, d.len(), self.len));
        }
        Ok(d.chunks_exact(N).map(|c| c.try_into().expect("chunk of N")))
    }

    pub fn to_f32s(&self) -> Result<Vec<f32>, String> {
        Ok(self.elems::<4>(DType::F32)?.map(f32::from_le_bytes).collect())
    }

    pub fn to_u32s(&self) -> Result<Vec<u32>, String> {
        Ok(self.elems::<4>(DType::U32)?.map(u32::from_le_bytes).collect())
    }

    pub fn to_f64s(&self) -> Result<Vec<f64>, String> {
        Ok(self.elems::<8>(DType::F64)?.map(f64::from_le_bytes).collect())
    }

    pub fn to_f64(&self) -> Result<f64, String> {
        let v = self.to_f64s()?;
        v.first().copied().filter(|_| v.len() == 1).ok_or_else(|| format!("{}: not one value", self.name))
    }

    pub fn to_str(&self) -> Result<String, String> {
        String::from_utf8(self.data_or_err()?.to_vec()).map_err(|_| format!("{}: not UTF-8", self.name))
    }
}

/// A digest's first 8 bytes in hex, enough to tell two apart in a message.
fn hex8(d: &Digest) -> String {
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A message the actor sent while handling an entry's message.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Sent {
    pub to: String,
    pub kind: String,
    pub mb: Option<u64>,
    pub blobs: Vec<Blob>,
}

/// One handled message, what the actor sent in reply, and its state changes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Entry {
    pub seq: u64,
    pub from: String,
    pub kind: String,
    pub step: u64,
    /// Evaluation (forward-only) traffic rather than training.
    pub eval: bool,
    /// The global pipeline stage the message is for, where it names one.
    pub stage: Option<u64>,
    pub mb: Option<u64>,
    pub replica: u64,
    pub inputs: Vec<Blob>,
    pub sent: Vec<Sent>,
    /// State after handling (a stage: its parameters after an optimizer step).
    pub state: Vec<Blob>,
}

impl Entry {
    /// Every stored value of the entry agrees with its digest; Err names the
    /// first that does not: `sent[1] Activation to stage-1: x: …`.
    fn check_blobs(&self) -> Result<(), String> {
        let named = |place: String, blobs: &[Blob]| -> Result<(), String> {
            blobs.iter().try_for_each(|b| b.check_data().map_err(|e| format!("{place}`{}`: {e}", b.name)))
        };
        named("input ".into(), &self.inputs)?;
        for (i, m) in self.sent.iter().enumerate() {
            named(format!("sent[{i}] ({} to {}) ", m.kind, m.to), &m.blobs)?;
        }
        named("state ".into(), &self.state)
    }

    pub fn input(&self, name: &str) -> Result<&Blob, String> {
        self.inputs.iter().find(|b| b.name == name).ok_or_else(|| format!("no input `{name}`"))
    }

    /// What a person would call this entry: `seq 41 (step 3, Activation mb 2)`.
    pub fn describe(&self) -> String {
        let mut s = format!("seq {} (step {}, {}", self.seq, self.step, self.kind);
        if self.eval {
            s += " [eval]";
        }
        if let Some(st) = self.stage {
            s += &format!(" for stage {st}");
        }
        if let Some(mb) = self.mb {
            s += &format!(" mb {mb}");
        }
        s += &format!(" from {})", self.from);
        s
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Header {
    pub actor: String,
    /// The run's resolved config (TOML) and its hash.
    pub config: String,
    pub config_hash: String,
    /// Tensor payloads are stored, not only their digests.
    pub payloads: bool,
    /// The first optimizer step of the run (non-zero after a resume).
    pub start_step: u64,
    /// The `--init` weights the run started from.
    pub init: Option<FileRef>,
    /// The checkpoint a resumed run started from.
    pub anchor: Option<Anchor>,
}

/// A file an actor's starting state was read from, by path and content.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct FileRef {
    /// Absolute where it could be made so, else as given.
    pub path: String,
    /// blake3 of the file, hex.
    pub blake3: String,
}

/// The checkpoint a resumed run started from. Its state.json names the
/// digests of the other files, so its digest stands for the whole checkpoint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Anchor {
    pub step: u64,
    /// The config hash the checkpoint itself records.
    pub config_hash: String,
    /// blake3 of its state.json, hex.
    pub state_blake3: String,
}

/// What can be wrong with a log file; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a pipewright replay log (expected the magic `PWREPLAY`)")]
    NotALog { path: PathBuf },
    #[error("{path}: replay log format {found}, this build reads format {VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: truncated inside entry {index} (byte {offset} of {size}): the recording was cut off")]
    Truncated { path: PathBuf, index: u64, offset: u64, size: u64 },
    #[error(
        "{path}: truncated after {}: no end marker follows, so the recording was cut off (the run crashed or was killed)",
        after(*entries)
    )]
    NoTrailer { path: PathBuf, entries: u64 },
    #[error("header of {path} cannot be decoded: {reason}")]
    BadHeader { path: PathBuf, reason: String },
    #[error("{path}: the end marker says {claimed} entries with another chain digest than the {entries} entries before it: the file is corrupt")]
    BadTrailer { path: PathBuf, entries: u64, claimed: u64 },
    #[error("{path}: entry {index} at byte {offset} claims {len} bytes, more than a frame may hold: the file is corrupt")]
    BadLength { path: PathBuf, index: u64, offset: u64, len: u64 },
    #[error(
        "{path}: entry {index} (byte {offset}) was altered after recording: its chain digest does not match"
    )]
    Tampered { path: PathBuf, index: u64, offset: u64 },
    #[error("{path}: entry {index} (byte {offset}) cannot be decoded: {reason}")]
    Corrupt { path: PathBuf, index: u64, offset: u64, reason: String },
    #[error("{path}: entry {index} (byte {offset}) was altered after recording: {what}")]
    BadBlob { path: PathBuf, index: u64, offset: u64, what: String },
    #[error("{path}: entry {index} has sequence number {seq}: the entries are out of order")]
    Sequence { path: PathBuf, index: u64, seq: u64 },
}

fn after(entries: u64) -> String {
    match entries {
        0 => "the header".into(),
        n => format!("entry {} ({n} complete entries)", n - 1),
    }
}

impl LogError {
    /// Maps an I/O error on `path` (`.map_err(LogError::io(path))`).
    pub fn io(path: &Path) -> impl Fn(std::io::Error) -> LogError + Copy + '_ {
        move |error| LogError::Io { path: path.to_path_buf(), error }
    }

    /// The recording stopped early: what `--allow-truncated` accepts.
    pub fn is_cut(&self) -> bool {
        matches!(self, LogError::Truncated { .. } | LogError::NoTrailer { .. })
    }
}

fn chain_seed(header: &[u8]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(MAGIC).update(&VERSION.to_le_bytes()).update(header);
    *h.finalize().as_bytes()
}

fn chain_next(prev: &Digest, frame: &[u8]) -> Digest {
    *blake3::Hasher::new().update(prev).update(frame).finalize().as_bytes()
}

pub struct LogWriter {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
    chain: Digest,
    next_seq: u64,
}

impl LogWriter {
    pub fn create(path: &Path, header: &Header) -> Result<LogWriter, LogError> {
        let io = LogError::io(path);
        let file = std::fs::File::create(path).map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let hb = bincode::serde::encode_to_vec(header, bincode_config()).expect("a header encodes");
        out.write_all(MAGIC).map_err(io)?;
        out.write_all(&VERSION.to_le_bytes()).map_err(io)?;
        out.write_all(&(hb.len() as u32).to_le_bytes()).map_err(io)?;
        out.write_all(&hb).map_err(io)?;
        Ok(LogWriter { path: path.to_path_buf(), out, chain: chain_seed(&hb), next_seq: 0 })
    }

    /// Appends `e`, whose `seq` this writer assigns.
    pub fn append(&mut self, mut e: Entry) -> Result<(), LogError> {
        e.seq = self.next_seq;
        self.next_seq += 1;
        let io = LogError::io(&self.path);
        let bytes = bincode::serde::encode_to_vec(&e, bincode_config()).map_err(|err| LogError::Corrupt {
            path: self.path.clone(),
            index: e.seq,
            offset: 0,
            reason: format!("cannot encode: {err}"),
        })?;
        self.chain = chain_next(&self.chain, &bytes);
        self.out.write_all(&(bytes.len() as u64).to_le_bytes()).map_err(io)?;
        self.out.write_all(&bytes).map_err(io)?;
        self.out.write_all(&self.chain).map_err(io)?;
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), LogError> {
        self.out.flush().map_err(LogError::io(&self.path))
    }

    /// Writes the trailer and flushes: the log is whole.
    pub fn finish(mut self) -> Result<(), LogError> {
        let io = LogError::io(&self.path);
        self.out.write_all(&TRAILER.to_le_bytes()).map_err(io)?;
        self.out.write_all(&self.next_seq.to_le_bytes()).map_err(io)?;
        self.out.write_all(&self.chain).map_err(io)?;
        self.out.flush().map_err(io)
    }
}

/// Reads a log frame by frame, checking lengths, the chain and the order.
pub struct LogReader {
    path: PathBuf,
    input: std::io::BufReader<std::fs::File>,
    pub header: Header,
    chain: Digest,
    offset: u64,
    size: u64,
    index: u64,
    /// The trailer has been read.
    done: bool,
}

impl LogReader {
    pub fn open(path: &Path) -> Result<LogReader, LogError> {
        let p = path.to_path_buf();
        let io = LogError::io(path);
        let file = crate::fsutil::open_regular(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut input = std::io::BufReader::with_capacity(1 << 20, file);
        let mut head = [0u8; 16];
        let got = read_upto(&mut input, &mut head).map_err(io)?;
        if got < 8 || &head[..8] != MAGIC {
            return Err(LogError::NotALog { path: p });
        }
        if got < 16 {
            return Err(LogError::Truncated { path: p, index: 0, offset: got as u64, size });
        }
        let version = u32::from_le_bytes(head[8..12].try_into().unwrap());
        if version != VERSION {
            return Err(LogError::Version { path: p, found: version });
        }
        let hlen = u32::from_le_bytes(head[12..16].try_into().unwrap()) as u64;
        if hlen > size - 16 {
            return Err(LogError::Truncated { path: p, index: 0, offset: 16, size });
        }
        let mut hb = vec![0u8; hlen as usize];
        input.read_exact(&mut hb).map_err(io)?;
        let header: Header = bincode::serde::decode_from_slice(&hb, bincode_config())
            .map_err(|e| LogError::BadHeader { path: p.clone(), reason: e.to_string() })?
            .0;
        Ok(LogReader {
            path: p,
            input,
            header,
            chain: chain_seed(&hb),
            offset: 16 + hlen,
            size,
            index: 0,
            done: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next entry, or None at the trailer (which must end the file).
    pub fn next_entry(&mut self) -> Result<Option<Entry>, LogError> {
        if self.done {
            return Ok(None);
        }
        let (path, index, offset, size) = (self.path.clone(), self.index, self.offset, self.size);
        if offset == size {
            return Err(LogError::NoTrailer { path, entries: index });
        }
        let truncated = || LogError::Truncated { path: path.clone(), index, offset, size };
        if size - offset < 8 {
            return Err(truncated());
        }
        let mut lb = [0u8; 8];
        self.input.read_exact(&mut lb).map_err(LogError::io(&path))?;
        let len = u64::from_le_bytes(lb);
        if len == TRAILER {
            return self.trailer().map(|_| None);
        }
        if len > MAX_FRAME {
            return Err(LogError::BadLength { path, index, offset, len });
        }
        if size - offset - 8 < len + 32 {
            return Err(truncated());
        }
        let mut bytes = vec![0u8; len as usize];
        let mut digest = [0u8; 32];
        let io = LogError::io(&path);
        self.input.read_exact(&mut bytes).map_err(io)?;
        self.input.read_exact(&mut digest).map_err(io)?;
        let chain = chain_next(&self.chain, &bytes);
        if chain != digest {
            return Err(LogError::Tampered { path, index, offset });
        }
        let (e, used): (Entry, usize) =
            bincode::serde::decode_from_slice(&bytes, bincode_config()).map_err(|err| LogError::Corrupt {
                path: path.clone(),
                index,
                offset,
                reason: err.to_string(),
            })?;
        if used != bytes.len() {
            return Err(LogError::Corrupt {
                path,
                index,
                offset,
                reason: "trailing bytes in the frame".into(),
            });
        }
        if e.seq != index {
            return Err(LogError::Sequence { path, index, seq: e.seq });
        }
        if let Err(what) = e.check_blobs() {
            return Err(LogError::BadBlob { path, index, offset, what });
        }
        self.chain = chain;
        self.offset += 8 + len + 32;
        self.index += 1;
        Ok(Some(e))
    }

    fn trailer(&mut self) -> Result<(), LogError> {
        let (path, entries, offset, size) = (self.path.clone(), self.index, self.offset, self.size);
        if size - offset != 8 + 8 + 32 {
            if size - offset < 8 + 8 + 32 {
                return Err(LogError::Truncated { path, index: entries, offset, size });
            }
            return Err(LogError::Corrupt {
                path,
                index: entries,
                offset,
                reason: "bytes after the end marker".into(),
            });
        }
        let mut b = [0u8; 40];
        self.input.read_exact(&mut b).map_err(LogError::io(&path))?;
        let claimed = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        if claimed != entries || b[8..] != self.chain {
            return Err(LogError::BadTrailer { path, entries, claimed });
        }
        self.offset = size;
        self.done = true;
        Ok(())
    }

    /// Every entry of a whole log (the whole log in memory).
    pub fn read_all(path: &Path) -> Result<(Header, Vec<Entry>), LogError> {
        let r = LogReader::read(path, false)?;
        Ok((r.header, r.entries))
    }

    /// Every entry; with `allow_cut`, a log that stops early (no trailer, or a
    /// last entry cut short) gives the entries before the cut and says why.
    pub fn read(path: &Path, allow_cut: bool) -> Result<ReadLog, LogError> {
        let mut r = LogReader::open(path)?;
        let mut entries = Vec::new();
        loop {
            match r.next_entry() {
                Ok(Some(e)) => entries.push(e),
                Ok(None) => return Ok(ReadLog { header: r.header, entries, cut: None }),
                Err(e) if allow_cut && e.is_cut() => {
                    return Ok(ReadLog { header: r.header, entries, cut: Some(e) })
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// A log read into memory.
pub struct ReadLog {
    pub header: Header,
    pub entries: Vec<Entry>,
    /// Why the log stops early, when it has no end marker.
    pub cut: Option<LogError>,
}

fn read_upto(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            actor: "stage-0".into(),
            config: "x".into(),
            config_hash: "h".into(),
            payloads: true,
            start_step: 0,
            init: None,
            anchor: None,
        }
    }

    fn entry(step: u64) -> Entry {
        Entry {
            seq: 0,
            from: "coordinator".into(),
            kind: "RunStep".into(),
            step,
            eval: false,
            stage: None,
            mb: None,
            replica: 0,
            inputs: vec![Blob::f64("loss_scale", 1.0), Blob::f32s("x", &[1.0, 2.0], true)],
            sent: vec![Sent { to: "stage-1".into(), kind: "Activation".into(), mb: Some(0), blobs: vec![] }],
            state: vec![],
        }
    }

    fn write(path: &Path, n: u64) {
        let mut w = LogWriter::create(path, &header()).unwrap();
        for s in 0..n {
            w.append(entry(s)).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn round_trip_and_values() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.log");
        write(&p, 3);
        let (h, es) = LogReader::read_all(&p).unwrap();
        assert_eq!(h, header());
        assert_eq!(es.len(), 3);
        assert_eq!(es[2].seq, 2);
        assert_eq!(es[1].input("x").unwrap().to_f32s().unwrap(), vec![1.0, 2.0]);
        assert_eq!(es[1].input("loss_scale").unwrap().to_f64().unwrap(), 1.0);
        assert!(es[1].input("x").unwrap().to_u32s().is_err());
    }

    #[test]
    fn truncation_tampering_and_garbage_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.log");
        write(&p, 3);
        let full = std::fs::read(&p).unwrap();
        for cut in [full.len() - 1, full.len() - 40, full.len() - 60, 20] {
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = LogReader::read_all(&p).unwrap_err();
            assert!(matches!(e, LogError::Truncated { .. }), "{cut}: {e}");
            assert!(e.to_string().contains("a.log"), "{e}");
        }
        let mut t = full.clone();
        let n = t.len();
        t[n - 60] ^= 1; // inside the last frame
        std::fs::write(&p, &t).unwrap();
        let e = LogReader::read_all(&p).unwrap_err();
        assert!(matches!(e, LogError::Tampered { index: 2, .. }), "{e}");
        std::fs::write(&p, b"hello world, not a log").unwrap();
        assert!(matches!(LogReader::read_all(&p).unwrap_err(), LogError::NotALog { .. }));
        let mut huge = full[..full.len()].to_vec();
        let first_frame = 16 + u32::from_le_bytes(full[12..16].try_into().unwrap()) as usize;
        huge[first_frame..first_frame + 8].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        std::fs::write(&p, &huge).unwrap();
        assert!(matches!(LogReader::read_all(&p).unwrap_err(), LogError::BadLength { .. }));
    }

    #[test]
    fn a_log_cut_at_an_entry_boundary_is_not_whole() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.log");
        write(&p, 3);
        let full = std::fs::read(&p).unwrap();
        // Without the trailer: three whole entries and nothing to say the log ends.
        std::fs::write(&p, &full[..full.len() - 48]).unwrap();
        let e = LogReader::read_all(&p).unwrap_err();
        assert!(matches!(e, LogError::NoTrailer { entries: 3, .. }), "{e}");
        assert!(e.to_string().contains("a.log: truncated after entry 2 (3 complete entries)"), "{e}");
        let r = LogReader::read(&p, true).unwrap();
        assert_eq!(r.entries.len(), 3);
        assert!(r.cut.is_some_and(|c| c.is_cut()));
        // Only the header: nothing was recorded before the cut.
        let first_frame = 16 + u32::from_le_bytes(full[12..16].try_into().unwrap()) as usize;
        std::fs::write(&p, &full[..first_frame]).unwrap();
        let e = LogReader::read_all(&p).unwrap_err();
        assert!(e.to_string().contains("truncated after the header"), "{e}");
        // Cut inside the second entry: the first is still readable when allowed.
        std::fs::write(&p, &full[..first_frame + 20]).unwrap();
        assert!(matches!(LogReader::read_all(&p).unwrap_err(), LogError::Truncated { index: 0, .. }));
        let second = {
            let len = u64::from_le_bytes(full[first_frame..first_frame + 8].try_into().unwrap()) as usize;
            first_frame + 8 + len + 32
        };
        std::fs::write(&p, &full[..second + 10]).unwrap();
        let r = LogReader::read(&p, true).unwrap();
        assert_eq!(r.entries.len(), 1);
        assert!(matches!(r.cut, Some(LogError::Truncated { index: 1, .. })));
        // A trailer that claims another count, and bytes after the trailer.
        let mut t = full.clone();
        let n = t.len();
        t[n - 40] ^= 1;
        std::fs::write(&p, &t).unwrap();
        assert!(matches!(LogReader::read_all(&p).unwrap_err(), LogError::BadTrailer { claimed: 2, .. }));
        let mut t = full.clone();
        t.push(0);
        std::fs::write(&p, &t).unwrap();
        assert!(matches!(LogReader::read_all(&p).unwrap_err(), LogError::Corrupt { .. }));
    }

    #[test]
    fn stored_bytes_that_do_not_match_their_digest_are_refused_naming_the_blob() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.log");
        // A log written whole, chain and all, by someone who changed an
        // output's bytes and kept its digest.
        let mut e = entry(0);
        let mut sent = Blob::f32s("data", &[1.0, 2.0, 3.0], true);
        sent.data = Some(Blob::f32s("data", &[1.0, 2.0, 4.0], true).data.unwrap());
        e.sent[0].blobs.push(sent);
        let mut w = LogWriter::create(&p, &header()).unwrap();
        w.append(entry(0)).unwrap();
        w.append(e.clone()).unwrap();
        w.finish().unwrap();
        let err = LogReader::read_all(&p).unwrap_err();
        assert!(matches!(err, LogError::BadBlob { index: 1, .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("a.log: entry 1") && msg.contains("sent[0] (Activation to stage-1) `data`"),
            "{msg}"
        );
        // Bytes of another length than the values the blob claims.
        e.sent[0].blobs[0] = Blob { len: 2, ..Blob::f32s("data", &[1.0, 2.0, 3.0], true) };
        let mut w = LogWriter::create(&p, &header()).unwrap();
        w.append(e).unwrap();
        w.finish().unwrap();
        let msg = LogReader::read_all(&p).unwrap_err().to_string();
        assert!(msg.contains("12 bytes stored for 2 F32 values"), "{msg}");
    }

    #[test]
    fn a_header_that_does_not_decode_is_named_as_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.log");
        write(&p, 1);
        let mut t = std::fs::read(&p).unwrap();
        // The actor name's length, as bincode writes it: now far past the header.
        t[16] = 250;
        std::fs::write(&p, &t).unwrap();
        let e = LogReader::read_all(&p).unwrap_err().to_string();
        assert!(e.starts_with(&format!("header of {} cannot be decoded: ", p.display())), "{e}");
    }
}
