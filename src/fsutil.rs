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

/// `e` with a symlink loop said in words: the OS's "too many levels of
/// symbolic links" reads as a missing file to most users.
pub fn named_loop(e: std::io::Error) -> std::io::Error {
    if e.raw_os_error() == Some(libc::ELOOP) {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a symlink loop (too many levels of symbolic links): expected a regular file",
        )
    } else {
        e
    }
}

fn not_regular(t: &std::fs::FileType) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{}, not a regular file: expected a regular file", kind_of(t)),
    )
}

/// Opens `path` for reading if it is a regular file (symlinks followed).
/// Never blocks: a FIFO is refused, not waited on. A symlink loop is an
/// error saying so, never "not found".
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let t = std::fs::metadata(path).map_err(named_loop)?.file_type();
    if !t.is_file() {
        return Err(not_regular(&t));
    }
    // O_NONBLOCK: if the path was swapped for a FIFO since the check above,
    // the open returns at once and the second check refuses it.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(named_loop)?;
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

/// Whether anything is at `path` (a dangling or looping symlink counts):
/// an optional input is absent only when there is no entry at all, so a
/// broken one is reported rather than silently skipped.
pub fn is_present(path: &Path) -> std::io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// [`read_regular`] for an optional input: None only when nothing is at `path`.
pub fn read_optional(path: &Path, max: u64, what: &str) -> std::io::Result<Option<Vec<u8>>> {
    if !is_present(path)? {
        return Ok(None);
    }
    read_regular(path, max, what).map(Some)
}

/// [`read_optional`] as UTF-8 text.
pub fn read_optional_to_string(path: &Path, max: u64, what: &str) -> std::io::Result<Option<String>> {
    if !is_present(path)? {
        return Ok(None);
    }
    read_regular_to_string(path, max, what).map(Some)
}

/// The most a secret or a certificate file may hold (a cookie is 64 hex
/// digits; a PEM chain a few kilobytes).
pub const MAX_SECRET_BYTES: u64 = 1 << 20;

/// The most a config file may hold: configs are a few kilobytes.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The machine's memory, the cap on a file read whole into it (weights).
pub fn memory_cap() -> u64 {
    let total = crate::host::Machine::this().memory_bytes;
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
    fn a_symlink_loop_is_named_as_such_and_counts_as_present() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::os::unix::fs::symlink(dir.path().join("b"), &a).unwrap();
        std::os::unix::fs::symlink(&a, dir.path().join("b")).unwrap();
        let err = read_regular(&a, u64::MAX, "").unwrap_err().to_string();
        assert!(err.contains("a symlink loop"), "{err}");
        let err = read_optional(&a, u64::MAX, "").unwrap_err().to_string();
        assert!(err.contains("a symlink loop"), "{err}");
        assert!(read_optional(&dir.path().join("absent"), u64::MAX, "").unwrap().is_none());
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
