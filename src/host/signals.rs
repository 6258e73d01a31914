//! SIGINT and SIGTERM during `train`: the first asks the run to stop cleanly
//! (a checkpoint at the next step boundary, exit 0; before the first step,
//! nothing to save); a second ends the process at once with exit status 130
//! and a message saying what was not saved.
//!
//! Installed as the command starts, so no moment of start-up falls to the
//! default action (death by signal). Until [`end_start_up`] nothing has been
//! written, so a signal then exits at once with status 0, whatever start-up
//! is blocked in (a slow read, a large allocation). The handler only counts
//! and writes messages prepared beforehand before `_exit`: nothing that is
//! not async-signal-safe. The run polls [`requested`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static SECOND_MESSAGE: OnceLock<Vec<u8>> = OnceLock::new();
static START_UP_MESSAGE: OnceLock<Vec<u8>> = OnceLock::new();
/// Start-up is under way: nothing written yet, so a signal may end the process outright.
static STARTING: AtomicBool = AtomicBool::new(false);

/// SIGINT or SIGTERM arrived before the first step: nothing was written.
#[derive(Debug, thiserror::Error)]
#[error(
    "stopped by a signal during start-up, before the first step: nothing to save, and nothing in {} was \
     written or changed",
    .0.display()
)]
pub struct StoppedBeforeStart(pub PathBuf);

/// Exit status after a second signal: 128 + SIGINT, as shells report Ctrl-C.
pub const FORCED_EXIT: i32 = 130;

/// Handles SIGINT and SIGTERM from now on, for the run in `run_dir`.
pub fn install(run_dir: &Path) -> std::io::Result<()> {
    let msg = format!(
        "\nsecond interrupt: exiting at once (status {FORCED_EXIT}). Not saved: the steps since the latest \
         complete checkpoint, and any checkpoint being written (a partial step_….tmp is ignored and \
         removed later). Continue with: pipewright train --resume {}\n",
        run_dir.display()
    );
    let _ = SECOND_MESSAGE.set(msg.into_bytes());
    let early = format!("{}\n", StoppedBeforeStart(run_dir.to_path_buf()));
    let _ = START_UP_MESSAGE.set(early.into_bytes());
    STARTING.store(true, Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe.
        let ok = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut()) == 0
        };
        if !ok {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

extern "C" fn on_signal(_: libc::c_int) {
    if STARTING.load(Ordering::SeqCst) {
        if let Some(m) = START_UP_MESSAGE.get() {
            // SAFETY: as below.
            unsafe {
                libc::write(2, m.as_ptr().cast(), m.len());
            }
        }
        unsafe { libc::_exit(0) }
    }
    if RECEIVED.fetch_add(1, Ordering::SeqCst) == 0 {
        return;
    }
    if let Some(m) = SECOND_MESSAGE.get() {
        // SAFETY: write(2) and _exit(2) are async-signal-safe; `m` is never freed.
        unsafe {
            libc::write(2, m.as_ptr().cast(), m.len());
        }
    }
    unsafe { libc::_exit(FORCED_EXIT) }
}

/// Whether SIGINT or SIGTERM has arrived since [`install`].
pub fn requested() -> bool {
    RECEIVED.load(Ordering::SeqCst) > 0
}

/// Start-up is over: from here a run may write, so a first signal asks for a
/// clean stop instead of ending the process.
pub fn end_start_up() {
    STARTING.store(false, Ordering::SeqCst);
}
