//! Device memory: the emulated GPUs, their address ranges and allocations
//! (this interface is what cublaslt and nccl use and must keep its
//! signatures).
//!
//! A device pointer is the host address of its bytes, so the stand-ins read
//! device memory directly. Each emulated GPU owns a 1 TiB address range
//! (`DEVICE_BASE + ordinal * DEVICE_SPAN`), so a pointer's value says which
//! device it belongs to. Addresses are never reused: an allocation gets fresh
//! pages from its device's range, its end placed as close to a PROT_NONE
//! guard page as 256-byte alignment allows, the slack around it filled with a
//! canary; a freed allocation's pages become PROT_NONE (and later unmapped),
//! so a use after free faults instead of reading someone else's data.

use crate::error::{cu, EmuError, Result};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A live device allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub base: u64,
    pub size: u64,
    pub device: usize,
}

const PAGE: u64 = 4096;
/// cudaMalloc's documented alignment (at least 256 bytes).
pub const ALIGN: u64 = 256;
const DEVICE_BASE: u64 = 0x2000_0000_0000;
const DEVICE_SPAN: u64 = 1 << 40;
/// The byte written around every allocation; a different value there after a
/// kernel means the kernel wrote past its buffer (inside the alignment slack
/// that no guard page can cover).
pub const CANARY: u8 = 0xA5;
/// How many bytes of freed allocations stay mapped PROT_NONE before the
/// oldest are unmapped (either way their addresses are never handed out again).
const QUARANTINE_BYTES: u64 = 256 << 20;
/// How many freed ranges are remembered to name them in errors.
const FREED_REMEMBERED: usize = 1 << 16;

/// The emulator's view of the machine: how many GPUs are visible and what
/// each is called (from PW_EMU_GPUS, CUDA_VISIBLE_DEVICES, PW_EMU_MEM_GIB, PW_EMU_SESSION).
#[derive(Clone, Debug)]
pub struct Machine {
    /// Visible ordinal → emulated ordinal (the index into the emulated GPUs).
    pub visible: Vec<usize>,
    pub emulated: usize,
    pub bytes_per_device: u64,
    pub session: String,
}

static MACHINE: OnceLock<std::result::Result<Machine, EmuError>> = OnceLock::new();

fn read_machine() -> std::result::Result<Machine, EmuError> {
    let emulated = match std::env::var("PW_EMU_GPUS") {
        Ok(v) => v.trim().parse::<usize>().ok().filter(|n| (1..=64).contains(n)).ok_or_else(|| {
            EmuError::new(cu::INVALID_VALUE, format!("PW_EMU_GPUS={v:?}: expected a GPU count from 1 to 64"))
        })?,
        Err(_) => 1,
    };
    let gib = match std::env::var("PW_EMU_MEM_GIB") {
        Ok(v) => v.trim().parse::<u64>().ok().filter(|g| (1..=1024).contains(g)).ok_or_else(|| {
            EmuError::new(cu::INVALID_VALUE, format!("PW_EMU_MEM_GIB={v:?}: expected GiB per GPU, 1 to 1024"))
        })?,
        Err(_) => 80,
    };
    let visible = match std::env::var("CUDA_VISIBLE_DEVICES") {
        // As the real driver: an empty list hides every GPU.
        Ok(list) => {
            let mut visible = Vec::new();
            for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let ordinal = item.parse::<usize>().ok().filter(|&o| o < emulated).ok_or_else(|| {
                    EmuError::new(
                        cu::INVALID_DEVICE,
                        format!(
                            "CUDA_VISIBLE_DEVICES={list:?}: {item:?} is not an emulated GPU ordinal \
                             (PW_EMU_GPUS={emulated} gives 0..{emulated})"
                        ),
                    )
                })?;
                if visible.contains(&ordinal) {
                    return Err(EmuError::new(
                        cu::INVALID_DEVICE,
                        format!("CUDA_VISIBLE_DEVICES={list:?}: GPU {ordinal} is listed twice"),
                    ));
                }
                visible.push(ordinal);
            }
            visible
        }
        Err(_) => (0..emulated).collect(),
    };
    let session = std::env::var("PW_EMU_SESSION").unwrap_or_else(|_| format!("pid{}", std::process::id()));
    Ok(Machine { visible, emulated, bytes_per_device: gib << 30, session })
}

/// The machine as the environment describes it (read once per process).
pub fn machine() -> Result<&'static Machine> {
    MACHINE.get_or_init(read_machine).as_ref().map_err(Clone::clone)
}

/// How many GPUs the driver shows (after CUDA_VISIBLE_DEVICES).
pub fn device_count() -> Result<usize> {
    Ok(machine()?.visible.len())
}

/// Checks a device ordinal as cuDeviceGet and friends take it.
pub fn check_device(device: usize, what: &str) -> Result<()> {
    let count = device_count()?;
    if device >= count {
        return Err(EmuError::new(
            cu::INVALID_DEVICE,
            format!("{what}: device {device} does not exist ({count} visible emulated GPUs)"),
        ));
    }
    Ok(())
}

/// Who `device` (a visible ordinal) is across processes: the emulator
/// session (PW_EMU_SESSION) and the emulated GPU's ordinal, so that two
/// processes of one session that open the same GPU can be told apart.
pub fn device_identity(device: usize) -> (String, usize) {
    match machine() {
        Ok(m) => (m.session.clone(), m.visible.get(device).copied().unwrap_or(device)),
        Err(_) => (String::new(), device),
    }
}

struct Live {
    alloc: Allocation,
    /// The mapping holding it: [map, map + map_len), the last page a guard.
    map: u64,
    map_len: u64,
}

#[derive(Clone, Copy)]
struct Freed {
    base: u64,
    size: u64,
    map_len: u64,
    map: u64,
}

struct Heap {
    /// Per device (visible ordinal): next free address of its range and bytes in use.
    next: Vec<u64>,
    used: Vec<u64>,
    live: BTreeMap<u64, Live>,
    freed: BTreeMap<u64, Freed>,
    quarantine: VecDeque<Freed>,
    quarantined: u64,
}

static HEAP: Mutex<Option<Heap>> = Mutex::new(None);

fn heap() -> Result<MutexGuard<'static, Option<Heap>>> {
    let m = machine()?;
    let mut guard = HEAP.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        *guard = Some(Heap {
            next: (0..m.visible.len()).map(|d| device_range(d).0).collect(),
            used: vec![0; m.visible.len()],
            live: BTreeMap::new(),
            freed: BTreeMap::new(),
            quarantine: VecDeque::new(),
            quarantined: 0,
        });
    }
    Ok(guard)
}

/// [start, end) of visible device `device`'s address range.
fn device_range(device: usize) -> (u64, u64) {
    let start = DEVICE_BASE + device as u64 * DEVICE_SPAN;
    (start, start + DEVICE_SPAN)
}

/// The device whose address range holds `ptr`, if any.
pub fn device_of_address(ptr: u64) -> Option<usize> {
    let count = device_count().ok()?;
    (ptr >= DEVICE_BASE).then(|| ((ptr - DEVICE_BASE) / DEVICE_SPAN) as usize).filter(|&d| d < count)
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// Allocates `bytes` on `device` (cuMemAlloc).
pub fn alloc(device: usize, bytes: u64) -> Result<u64> {
    let m = machine()?;
    check_device(device, "cuMemAlloc")?;
    // A zero-byte request still gets a distinct address (one aligned unit).
    let size = bytes.max(1);
    let aligned = round_up(size, ALIGN);
    let data_pages = round_up(aligned, PAGE);
    let map_len = data_pages + PAGE;
    let mut guard = heap()?;
    let heap = guard.as_mut().expect("initialized by heap()");
    if heap.used[device] + aligned > m.bytes_per_device {
        return Err(EmuError::new(
            cu::OUT_OF_MEMORY,
            format!(
                "cuMemAlloc: {bytes} bytes on GPU {device}: {} of {} bytes are in use (PW_EMU_MEM_GIB={})",
                heap.used[device],
                m.bytes_per_device,
                m.bytes_per_device >> 30
            ),
        ));
    }
    let (_, end) = device_range(device);
    let mut at = heap.next[device];
    let map = loop {
        if at + map_len > end {
            return Err(EmuError::new(
                cu::OUT_OF_MEMORY,
                format!(
                    "cuMemAlloc: GPU {device}'s 1 TiB address range is used up (addresses are never reused)"
                ),
            ));
        }
        // SAFETY: a fresh private mapping at an address nobody else holds
        // (MAP_FIXED_NOREPLACE refuses to clobber an existing mapping).
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                map_len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED || p as u64 != at {
            if p != libc::MAP_FAILED {
                // An old kernel that ignores the flag placed it elsewhere.
                // SAFETY: the mapping just made, unused.
                unsafe { libc::munmap(p, map_len as usize) };
            }
            // Someone else's mapping is in the way: step over it.
            at += map_len.max(1 << 30);
            continue;
        }
        break at;
    };
    heap.next[device] = map + map_len;
    // SAFETY: the last page of the mapping made above.
    unsafe { libc::mprotect((map + data_pages) as *mut libc::c_void, PAGE as usize, libc::PROT_NONE) };
    let base = map + data_pages - aligned;
    // SAFETY: [map, base) and [base + size, map + data_pages) are in the mapping, readable and writable.
    unsafe {
        std::ptr::write_bytes(map as *mut u8, CANARY, (base - map) as usize);
        std::ptr::write_bytes((base + size) as *mut u8, CANARY, (aligned - size) as usize);
    }
    heap.used[device] += aligned;
    heap.live.insert(base, Live { alloc: Allocation { base, size, device }, map, map_len });
    Ok(base)
}

/// Frees a live allocation (cuMemFree): checks its canaries, then makes its
/// pages inaccessible for good.
pub fn free(ptr: u64) -> Result<Allocation> {
    let mut guard = heap()?;
    let heap = guard.as_mut().expect("initialized by heap()");
    let Some(live) = heap.live.get(&ptr) else {
        drop(guard);
        return Err(EmuError::new(cu::INVALID_VALUE, format!("cuMemFree: {}", describe(ptr))));
    };
    let canary = check_canary_of(live);
    let live = heap.live.remove(&ptr).expect("found above");
    let a = live.alloc;
    heap.used[a.device] -= round_up(a.size, ALIGN);
    // SAFETY: the allocation's own mapping, no longer handed out.
    unsafe { libc::mprotect(live.map as *mut libc::c_void, live.map_len as usize, libc::PROT_NONE) };
    let freed = Freed { base: a.base, size: a.size, map: live.map, map_len: live.map_len };
    heap.freed.insert(a.base, freed);
    if heap.freed.len() > FREED_REMEMBERED {
        heap.freed.pop_first();
    }
    heap.quarantine.push_back(freed);
    heap.quarantined += live.map_len;
    while heap.quarantined > QUARANTINE_BYTES {
        let old = heap.quarantine.pop_front().expect("non-empty while bytes are counted");
        heap.quarantined -= old.map_len;
        // Unmapped, its addresses still fault (and are never mapped again):
        // the device's next-address only grows.
        // SAFETY: a freed allocation's mapping that nothing references.
        unsafe { libc::munmap(old.map as *mut libc::c_void, old.map_len as usize) };
    }
    match canary {
        Some(culprit) => {
            Err(EmuError::new(cu::ILLEGAL_ADDRESS, format!("cuMemFree({ptr:#x}): {culprit} (found at free)")))
        }
        None => Ok(a),
    }
}

fn check_canary_of(live: &Live) -> Option<String> {
    let a = live.alloc;
    let aligned = round_up(a.size, ALIGN);
    let data_end = live.map + live.map_len - PAGE;
    // SAFETY: both ranges are in the live allocation's readable mapping.
    let (head, tail) = unsafe {
        (
            std::slice::from_raw_parts(live.map as *const u8, (a.base - live.map) as usize),
            std::slice::from_raw_parts((a.base + a.size) as *const u8, (data_end - a.base - a.size) as usize),
        )
    };
    debug_assert_eq!(tail.len() as u64, aligned - a.size);
    if let Some(i) = tail.iter().position(|&b| b != CANARY) {
        return Some(format!(
            "the {}-byte allocation at {:#x} (GPU {}) was written past its end: byte {} after its end ({:#x}) changed",
            a.size,
            a.base,
            a.device,
            i,
            a.base + a.size + i as u64
        ));
    }
    if let Some(i) = head.iter().rposition(|&b| b != CANARY) {
        return Some(format!(
            "the {}-byte allocation at {:#x} (GPU {}) was written before its start: byte {} before its start ({:#x}) changed",
            a.size,
            a.base,
            a.device,
            head.len() - i,
            live.map + i as u64
        ));
    }
    None
}

/// Checks the canaries around the live allocation at `base` (after a kernel
/// that could reach it); the error names the allocation and the first bad byte.
pub fn check_canary(base: u64) -> Result<()> {
    let guard = heap()?;
    let heap = guard.as_ref().expect("initialized by heap()");
    match heap.live.get(&base).and_then(check_canary_of) {
        Some(culprit) => Err(EmuError::new(cu::ILLEGAL_ADDRESS, culprit)),
        None => Ok(()),
    }
}

/// [start, end) of every device's address range together: an address
/// outside it is not device memory (a cheap first test for every access a
/// check mode watches).
pub fn device_area() -> (u64, u64) {
    let count = device_count().unwrap_or(0) as u64;
    (DEVICE_BASE, DEVICE_BASE + count * DEVICE_SPAN)
}

/// The live allocation whose mapping holds `ptr`: inside it, or in the
/// slack before its start or after its end (which no guard page covers).
pub fn nearest(ptr: u64) -> Option<Allocation> {
    let guard = heap().ok()?;
    let heap = guard.as_ref()?;
    if let Some((_, live)) = heap.live.range(..=ptr).next_back() {
        if ptr < live.map + live.map_len {
            return Some(live.alloc);
        }
    }
    let (_, live) = heap.live.range(ptr..).next()?;
    (live.map <= ptr).then_some(live.alloc)
}

/// The live allocation holding `ptr`, if any.
pub fn find(ptr: u64) -> Option<Allocation> {
    let guard = heap().ok()?;
    let heap = guard.as_ref()?;
    let (_, live) = heap.live.range(..=ptr).next_back()?;
    (ptr < live.alloc.base + live.alloc.size).then_some(live.alloc)
}

/// Checks that `[ptr, ptr + bytes)` lies in one live allocation of `device`;
/// the error names `what` (e.g. "cublasLtMatmul: A").
pub fn check_range(ptr: u64, bytes: u64, device: usize, what: &str) -> Result<Allocation> {
    match find(ptr) {
        Some(a) if a.device != device => Err(EmuError::new(
            cu::ILLEGAL_ADDRESS,
            format!("{what}: {ptr:#x} is GPU {}'s memory, used on GPU {device}", a.device),
        )),
        Some(a) if ptr + bytes > a.base + a.size => Err(EmuError::new(
            cu::ILLEGAL_ADDRESS,
            format!(
                "{what}: [{ptr:#x}, +{bytes}) runs {} byte(s) past the end of the {}-byte allocation at {:#x}",
                ptr + bytes - (a.base + a.size),
                a.size,
                a.base
            ),
        )),
        Some(a) => Ok(a),
        None => Err(EmuError::new(cu::ILLEGAL_ADDRESS, format!("{what}: {}", describe(ptr)))),
    }
}

/// Says what `ptr` is, for an error: inside a live allocation, past one's
/// end (by how much), in a freed allocation, in a device's range but no
/// allocation, or a host address.
pub fn describe(ptr: u64) -> String {
    if ptr == 0 {
        return "the null pointer".into();
    }
    // The first 64 KiB are never mapped (vm.mmap_min_addr): an index off null.
    if ptr < 1 << 16 {
        return format!("{ptr:#x}, the null pointer plus {ptr} bytes");
    }
    let Ok(guard) = heap() else { return format!("{ptr:#x}") };
    let Some(heap) = guard.as_ref() else { return format!("{ptr:#x}") };
    if let Some((_, live)) = heap.live.range(..=ptr).next_back() {
        let a = live.alloc;
        if ptr < a.base + a.size {
            return format!(
                "{ptr:#x} (byte {} of GPU {}'s {}-byte allocation at {:#x})",
                ptr - a.base,
                a.device,
                a.size,
                a.base
            );
        }
        if ptr < live.map + live.map_len {
            return format!(
                "{ptr:#x}, {} byte(s) past the end of GPU {}'s {}-byte allocation at {:#x}",
                ptr - (a.base + a.size) + 1,
                a.device,
                a.size,
                a.base
            );
        }
    }
    if let Some((_, f)) = heap.freed.range(..=ptr).next_back() {
        if ptr < f.map + f.map_len {
            return format!(
                "{ptr:#x}, in the freed {}-byte allocation at {:#x} (offset {})",
                f.size,
                f.base,
                ptr as i64 - f.base as i64
            );
        }
    }
    if let Some((_, live)) = heap.live.range(ptr..).next() {
        if live.map <= ptr {
            return format!(
                "{ptr:#x}, {} byte(s) before the start of GPU {}'s {}-byte allocation at {:#x}",
                live.alloc.base - ptr,
                live.alloc.device,
                live.alloc.size,
                live.alloc.base
            );
        }
    }
    drop(guard);
    match device_of_address(ptr) {
        Some(d) => format!(
            "{ptr:#x}, in GPU {d}'s address range but in no allocation (never allocated or long freed)"
        ),
        None => format!("{ptr:#x}, a host address (in no device's address range)"),
    }
}

/// Bytes (free, total) of `device` (cuMemGetInfo).
pub fn info(device: usize) -> Result<(u64, u64)> {
    let total = machine()?.bytes_per_device;
    let guard = heap()?;
    let used = guard.as_ref().expect("initialized by heap()").used.get(device).copied().unwrap_or(0);
    Ok((total.saturating_sub(used), total))
}

/// Total bytes of each device.
pub fn total(device: usize) -> Result<u64> {
    check_device(device, "cuDeviceTotalMem")?;
    Ok(machine()?.bytes_per_device)
}
