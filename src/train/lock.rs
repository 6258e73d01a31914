//! The run directory's lock: one process at a time may write into a run
//! directory. Two processes writing one directory (a second `--resume`, a
//! `--force` beside a live run) remove each other's files mid-write, so the
//! second is refused, told who holds the directory.
//!
//! `DIR/.pipewright.lock` is locked with flock(2) for as long as the run's
//! process lives; the kernel drops the lock when the process ends however it
//! ends (SIGKILL included), so no stale lock ever needs clearing by hand. The
//! file holds the holder's pid, host and start time, for the refusal message;
//! it is never deleted (deleting a flock'd file lets a third process lock a
//! new file of the same name while the second still holds the old one).

use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

pub const LOCK_FILE: &str = ".pipewright.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{path}: cannot lock the run directory: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error(
        "{dir}: another pipewright process is using this run directory ({holder}); wait for it to end, or \
         choose another --out"
    )]
    Held { dir: PathBuf, holder: String },
}

/// The exclusive lock on one run directory, held until dropped.
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
    pub path: PathBuf,
}

/// Locks `dir` (created if missing) for this process, or says who holds it.
pub fn lock(dir: &Path) -> Result<RunLock, LockError> {
    let path = dir.join(LOCK_FILE);
    let io = |error| LockError::Io { path: path.clone(), error };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io(error));
        }
        let mut holder = String::new();
        let _ = (&file).take(4096).read_to_string(&mut holder);
        let holder = match holder.trim() {
            "" => "its pid is not yet written".to_string(),
            h => h.to_string(),
        };
        return Err(LockError::Held { dir: dir.to_path_buf(), holder });
    }
    let since =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let text = format!("pid {} on host {}, since unix time {since}\n", std::process::id(), hostname());
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(text.as_bytes()))
        .and_then(|_| file.flush())
        .map_err(io)?;
    Ok(RunLock { _file: file, path })
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer's length is passed; gethostname NUL-terminates within it or truncates.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) } != 0 {
        return "(unknown)".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_run_directory_is_refused_naming_the_holder_and_free_once_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let held = lock(&run).unwrap();
        let err = lock(&run).unwrap_err().to_string();
        assert!(err.contains(&format!("pid {}", std::process::id())) && err.contains("on host"), "{err}");
        assert!(err.contains(run.to_str().unwrap()) && err.contains("another pipewright process"), "{err}");
        drop(held);
        lock(&run).unwrap();
    }
}
