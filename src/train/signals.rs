//! SIGINT and SIGTERM during `train`: the first asks the run to stop cleanly
//! (a checkpoint at the next step boundary, exit 0; before the first step,
//! nothing to save); a second ends the process at once with exit status 130
//! and a message saying what was not saved.
//!
//! Installed as the command starts, so no moment of start-up falls to the
//! default action (death by signal). The handler only counts and, the second
//! time, writes a message prepared beforehand and `_exit`s: nothing that is
//! not async-signal-safe. The run polls [`requested`].

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static SECOND_MESSAGE: OnceLock<Vec<u8>> = OnceLock::new();

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
