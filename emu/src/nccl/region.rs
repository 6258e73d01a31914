//! The shared-memory region one communicator's ranks meet in: a POSIX
//! shared memory object named by the unique id, mapped by every rank
//! (threads of one process map it once each, like separate processes).
//! Its name is removed as soon as every rank has it mapped (see
//! `Member::wait_for_all`), so a crashed run leaves nothing in /dev/shm.
//!
//! Layout (all offsets page-aligned so every data area starts aligned):
//! the header page; then one member area per rank (its control page and a
//! chunk of collective data); then one channel per ordered pair of ranks
//! (sender → receiver, self included) for send/receive, each a control page
//! and a chunk of data. Control words are atomics; data areas are plain
//! bytes handed over by the Release/Acquire of the step counters that
//! guard them. Waiting is a futex on the header's generation word (bumped
//! and woken at every state change), with a capped timeout, never a spin.

use super::types::code;
use crate::error::{EmuError, Result};
use std::cell::UnsafeCell;
use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const PAGE: usize = 4096;
const MAGIC: u64 = 0x7077_6e63_636c_0001; // "pwnccl" + layout version 1
const FAILURE_BYTES: usize = 3072;
pub const SESSION_BYTES: usize = 256;
/// Words describing one call (see `engine::Call::encode`).
pub const DESC_WORDS: usize = 6;

#[repr(C)]
pub struct Header {
    magic: AtomicU64,
    pub nranks: AtomicU64,
    pub chunk_bytes: AtomicU64,
    /// The futex word: bumped at every state change.
    gen: AtomicU32,
    pub joined: AtomicU32,
    pub left: AtomicU32,
    /// 0: healthy; 1: a failure message is being written; 2: failed, message readable.
    failed: AtomicU32,
    failure_len: AtomicU32,
    failure: UnsafeCell<[u8; FAILURE_BYTES]>,
}

#[repr(C)]
pub struct MemberCtl {
    /// 0: free; 1: being claimed; 2: claimed, fields below readable.
    pub claimed: AtomicU32,
    pub pid: AtomicU32,
    pub ordinal: AtomicU64,
    pub session_len: AtomicU32,
    session: UnsafeCell<[u8; SESSION_BYTES]>,
    /// Collective steps: the last one whose data this rank posted, and the
    /// last one whose inputs it has read.
    pub posted: AtomicU64,
    pub consumed: AtomicU64,
    /// The call (and chunk) of the step posted.
    pub desc: [AtomicU64; DESC_WORDS],
    /// What the rank is doing, for the deadlock report: 0 no call yet,
    /// 1 waiting in `activity`, 2 finished `activity`.
    pub activity_state: AtomicU32,
    pub activity: [AtomicU64; DESC_WORDS],
    /// Ranks it waits for (bit r = rank r).
    pub waiting_for: AtomicU64,
}

#[repr(C)]
pub struct ChannelCtl {
    /// Chunks the sender has posted and the receiver has taken.
    pub posted: AtomicU64,
    pub consumed: AtomicU64,
    /// The sender's call (and chunk) for the chunk posted.
    pub send_desc: [AtomicU64; DESC_WORDS],
}

const _: () = assert!(std::mem::size_of::<Header>() <= PAGE);
const _: () = assert!(std::mem::size_of::<MemberCtl>() <= PAGE);
const _: () = assert!(std::mem::size_of::<ChannelCtl>() <= PAGE);

fn round_up(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

/// Bytes of a region for `nranks` ranks and `chunk_bytes` per data area.
pub fn region_bytes(nranks: usize, chunk_bytes: usize) -> usize {
    let area = PAGE + round_up(chunk_bytes);
    PAGE + nranks * area + nranks * nranks * area
}

fn sys_error(what: &str) -> EmuError {
    EmuError::new(code::SYSTEM_ERROR, format!("{what}: {}", std::io::Error::last_os_error()))
}

pub struct Region {
    base: *mut u8,
    len: usize,
    name: String,
    pub nranks: usize,
    pub chunk_bytes: usize,
}

// SAFETY: the mapping is shared memory used only through atomics and through
// data areas whose hand-over the atomics order.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Opens the region `name` for `nranks` ranks, creating it if no rank
    /// has yet (the creator's `chunk_bytes` is the region's). A rank that
    /// finds it created waits up to `timeout` for the creator to set it up.
    pub fn open(name: &str, nranks: usize, chunk_bytes: usize, timeout: Duration) -> Result<Region> {
        let cname = CString::new(name).expect("region names have no NUL");
        // SAFETY: a valid C string; the flags and mode are shm_open's.
        let fd =
            unsafe { libc::shm_open(cname.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600) };
        if fd >= 0 {
            return Region::create(fd, name, nranks, chunk_bytes);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
            return Err(sys_error(&format!("shm_open({name})")));
        }
        // SAFETY: as above.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(sys_error(&format!("shm_open({name}) of a region another rank created")));
        }
        let opened = Region::join(fd, name, nranks, timeout);
        // SAFETY: our descriptor; the mapping (if any) outlives it.
        unsafe { libc::close(fd) };
        opened
    }

    fn create(fd: i32, name: &str, nranks: usize, chunk_bytes: usize) -> Result<Region> {
        let len = region_bytes(nranks, chunk_bytes);
        // Reserving the pages now turns a full /dev/shm into this error
        // instead of a SIGBUS at the first touch of a page it lacks.
        // SAFETY: our descriptor.
        let made = unsafe {
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                Err(sys_error(&format!("ftruncate of {name} to {len} bytes")))
            } else {
                match libc::posix_fallocate(fd, 0, len as libc::off_t) {
                    0 => Region::map(fd, name, len, nranks, chunk_bytes),
                    e => Err(EmuError::new(
                        code::SYSTEM_ERROR,
                        format!(
                            "reserving {len} bytes of shared memory for {name} ({nranks} ranks, {chunk_bytes}-byte \
                             chunks): {} (is /dev/shm full?)",
                            std::io::Error::from_raw_os_error(e)
                        ),
                    )),
                }
            }
        };
        // SAFETY: our descriptor.
        unsafe { libc::close(fd) };
        let region = match made {
            Ok(r) => r,
            Err(e) => {
                unlink(name);
                return Err(e);
            }
        };
        let h = region.header();
        h.nranks.store(nranks as u64, Ordering::Relaxed);
        h.chunk_bytes.store(chunk_bytes as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(region)
    }

    fn join(fd: i32, name: &str, nranks: usize, timeout: Duration) -> Result<Region> {
        let deadline = Instant::now() + timeout;
        // The creator sizes the object, then writes the header; wait for both.
        let len = loop {
            // SAFETY: a zeroed stat filled by fstat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(sys_error(&format!("fstat of {name}")));
            }
            if st.st_size > 0 {
                break st.st_size as usize;
            }
            if Instant::now() > deadline {
                return Err(EmuError::new(
                    code::SYSTEM_ERROR,
                    format!("{name}: the rank that created it never sized it (waited {timeout:?})"),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        if len < PAGE {
            return Err(EmuError::new(code::INTERNAL_ERROR, format!("{name}: {len} bytes, not a region")));
        }
        // SAFETY: fd is open, len is its size.
        let mut region = unsafe { Region::map(fd, name, len, 0, 0)? };
        while region.header().magic.load(Ordering::Acquire) != MAGIC {
            if Instant::now() > deadline {
                return Err(EmuError::new(
                    code::SYSTEM_ERROR,
                    format!("{name}: the rank that created it never initialised it (waited {timeout:?})"),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let created_for = region.header().nranks.load(Ordering::Relaxed) as usize;
        let chunk_bytes = region.header().chunk_bytes.load(Ordering::Relaxed) as usize;
        if created_for != nranks {
            return Err(EmuError::new(
                code::INVALID_USAGE,
                format!(
                    "ncclCommInitRank: this rank says the communicator has {nranks} ranks, but the rank that \
                     created it said {created_for}"
                ),
            ));
        }
        if region_bytes(nranks, chunk_bytes) != len {
            return Err(EmuError::new(
                code::INTERNAL_ERROR,
                format!("{name}: {len} bytes, not its layout's"),
            ));
        }
        region.nranks = nranks;
        region.chunk_bytes = chunk_bytes;
        Ok(region)
    }

    /// # Safety
    /// `fd` is an open shared memory object of at least `len` bytes.
    unsafe fn map(fd: i32, name: &str, len: usize, nranks: usize, chunk_bytes: usize) -> Result<Region> {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(sys_error(&format!("mmap of {name} ({len} bytes)")));
        }
        Ok(Region { base: p as *mut u8, len, name: name.to_string(), nranks, chunk_bytes })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn header(&self) -> &Header {
        // SAFETY: the first page of the mapping is the header.
        unsafe { &*(self.base as *const Header) }
    }

    fn area(&self) -> usize {
        PAGE + round_up(self.chunk_bytes)
    }

    fn member_offset(&self, rank: usize) -> usize {
        assert!(rank < self.nranks);
        PAGE + rank * self.area()
    }

    fn channel_offset(&self, from: usize, to: usize) -> usize {
        assert!(from < self.nranks && to < self.nranks);
        PAGE + self.nranks * self.area() + (from * self.nranks + to) * self.area()
    }

    pub fn member(&self, rank: usize) -> &MemberCtl {
        // SAFETY: in the mapping, page-aligned, all-atomic (zero is valid).
        unsafe { &*(self.base.add(self.member_offset(rank)) as *const MemberCtl) }
    }

    /// Rank `rank`'s collective data area (chunk_bytes long).
    pub fn member_data(&self, rank: usize) -> *mut u8 {
        // SAFETY: within the mapping (see region_bytes).
        unsafe { self.base.add(self.member_offset(rank) + PAGE) }
    }

    pub fn channel(&self, from: usize, to: usize) -> &ChannelCtl {
        // SAFETY: as for member.
        unsafe { &*(self.base.add(self.channel_offset(from, to)) as *const ChannelCtl) }
    }

    pub fn channel_data(&self, from: usize, to: usize) -> *mut u8 {
        // SAFETY: within the mapping.
        unsafe { self.base.add(self.channel_offset(from, to) + PAGE) }
    }

    /// The generation word's value; read it before checking a condition,
    /// then `wait(seen, ..)`, so a change in between is never missed.
    pub fn generation(&self) -> u32 {
        self.header().gen.load(Ordering::Acquire)
    }

    /// Announces a state change to every waiting rank.
    pub fn bump(&self) {
        let gen = &self.header().gen;
        gen.fetch_add(1, Ordering::AcqRel);
        // SAFETY: FUTEX_WAKE on a word of a shared mapping (not the private
        // variant: waiters may be other processes).
        unsafe {
            libc::syscall(libc::SYS_futex, gen.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32)
        };
    }

    /// Sleeps until the generation moves past `seen` or `timeout` passes.
    pub fn wait(&self, seen: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        let gen = &self.header().gen;
        // SAFETY: FUTEX_WAIT on a live word with a relative timeout; it
        // returns at once if the word no longer holds `seen`.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                gen.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                0usize,
                0u32,
            )
        };
    }

    /// Marks the communicator failed with `message` (the first failure
    /// wins; every rank then reports that one) and wakes everyone.
    pub fn fail(&self, message: &str) {
        let h = self.header();
        if h.failed.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            let bytes = message.as_bytes();
            let n = bytes.len().min(FAILURE_BYTES);
            // SAFETY: only the rank that won the exchange writes the message,
            // before publishing it with failed = 2.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), h.failure.get() as *mut u8, n) };
            h.failure_len.store(n as u32, Ordering::Relaxed);
            h.failed.store(2, Ordering::Release);
        }
        self.bump();
    }

    /// The failure message, once a failure is published.
    pub fn failure(&self) -> Option<String> {
        let h = self.header();
        if h.failed.load(Ordering::Acquire) != 2 {
            return None;
        }
        let n = h.failure_len.load(Ordering::Relaxed) as usize;
        // SAFETY: written once, before failed = 2 (acquired above) published it.
        let text = unsafe { std::slice::from_raw_parts(h.failure.get() as *const u8, n.min(FAILURE_BYTES)) };
        Some(String::from_utf8_lossy(text).into_owned())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Removes the region's name (mappings stay valid until unmapped).
pub fn unlink(name: &str) {
    let cname = CString::new(name).expect("region names have no NUL");
    // SAFETY: a valid C string.
    unsafe { libc::shm_unlink(cname.as_ptr()) };
}

/// Copies (up to SESSION_BYTES of) `session` into a member's fixed field.
pub fn write_session(m: &MemberCtl, session: &str) {
    let b = session.as_bytes();
    let n = b.len().min(SESSION_BYTES);
    // SAFETY: written by the claiming rank only, before claimed = 2 publishes it.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), m.session.get() as *mut u8, n) };
    m.session_len.store(n as u32, Ordering::Relaxed);
}

pub fn read_session(m: &MemberCtl) -> String {
    let n = (m.session_len.load(Ordering::Relaxed) as usize).min(SESSION_BYTES);
    // SAFETY: read after claimed = 2 published it (the caller acquired that).
    String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(m.session.get() as *const u8, n) })
        .into_owned()
}
