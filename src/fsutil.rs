//! Opening and reading input files that may not be files.
//!
//! Every path a user hands in (a config, token data, `--init` weights, the
//! text to prepare) may name a FIFO, a directory or a device. Opened
//! naively, a FIFO blocks until a writer appears, a directory fails deep in
//! mmap with "No such device", and `/dev/zero` is read until memory runs out.
//! So input is opened without blocking, checked to be a regular file, and
//! read no further than its size (and a cap the caller gives).
//!
//! The errors are `std::io::Error`s of kind `InvalidInput`, so each module's
//! own error type wraps them with the path as it already does for I/O.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// What a path that is not a regular file is, in words.
fn kind_of(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

fn not_regular(t: &std::fs::FileType) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{}, not a regular file: expected a regular file", kind_of(t)),
    )
}

/// Opens `path` for reading if it is a regular file (symlinks followed).
/// Never blocks: a FIFO is refused, not waited on.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let t = std::fs::metadata(path)?.file_type();
    if !t.is_file() {
        return Err(not_regular(&t));
    }
    // O_NONBLOCK: if the path was swapped for a FIFO since the check above,
    // the open returns at once and the second check refuses it.
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let t = f.metadata()?.file_type();
    if !t.is_file() {
        return Err(not_regular(&t));
    }
    Ok(f)
}

/// The whole of the regular file at `path`, refused when it is larger than
/// `max` bytes (`what` names the cap in the error). Reads no more than the
/// size the file had when opened.
pub fn read_regular(path: &Path, max: u64, what: &str) -> std::io::Result<Vec<u8>> {
    let f = open_regular(path)?;
    let len = f.metadata()?.len();
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{len} bytes, more than the {max} bytes {what}"),
        ));
    }
    let mut buf = Vec::with_capacity(len as usize);
    f.take(len).read_to_end(&mut buf)?;
    Ok(buf)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_to_string(path: &Path, max: u64, what: &str) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, max, what)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not UTF-8 text: {e}")))
}

/// The most a config file may hold: configs are a few kilobytes.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The machine's memory, the cap on a file read whole into it (weights).
pub fn memory_cap() -> u64 {
    let total = crate::limits::Machine::this().memory_bytes;
    if total.is_finite() {
        total as u64
    } else {
        u64::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn a_fifo_a_directory_and_a_device_are_refused_by_kind_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        mkfifo(&fifo);
        for (p, kind) in [
            (fifo.as_path(), "a FIFO (named pipe)"),
            (dir.path(), "a directory"),
            (Path::new("/dev/zero"), "a character device"),
        ] {
            let err = read_regular(p, u64::MAX, "").unwrap_err().to_string();
            assert!(err.contains(kind) && err.contains("not a regular file"), "{}: {err}", p.display());
        }
    }

    #[test]
    fn a_file_larger_than_the_cap_is_refused_and_a_regular_one_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"hello").unwrap();
        assert_eq!(read_regular(&p, 5, "").unwrap(), b"hello");
        let err = read_regular(&p, 4, "a test allows").unwrap_err().to_string();
        assert!(err.contains("5 bytes, more than the 4 bytes a test allows"), "{err}");
    }
}
