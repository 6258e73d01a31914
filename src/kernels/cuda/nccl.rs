//! NCCL, the GPU data plane between processes: communicators made from a
//! unique id that travels over the cluster, point-to-point send and receive
//! for activations and gradients, and the all-reduce across data-parallel
//! replicas. libnccl is loaded at run time by `nccl_lib` (cudarc's loader
//! misses the name PyPI's wheels ship), so a build needs no NCCL and a
//! machine without it gets an error that says what was tried, not a panic.
//!
//! Every communicator here is used by exactly one thread on each member (a
//! stage's compute thread, or its receive side), and point-to-point traffic
//! on one communicator flows one way, so the order of operations on it is
//! the sender's order on both ends — what NCCL needs to match them. See
//! `transfer.rs` for how stages use them.
//!
//! A tensor-parallel stage is the exception: its ranks are several GPUs of
//! one process driven by one thread, so their communicators come from
//! [`Comm::init_all`] and each collective is issued once per rank inside one
//! [`group`].

use super::nccl_lib::nccl;
use super::{CudaError, DeviceBuffer, Gpu, Result};
use cudarc::nccl::sys;
use std::ffi::c_void;

/// Whether libnccl can be loaded (see `nccl_lib` for the names and folders tried).
pub fn nccl_present() -> bool {
    nccl().is_ok()
}

/// An NCCL unique id: made once (by rank 0's process), sent to every member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclId(pub Vec<u8>);

impl NcclId {
    /// A fresh id (needs libnccl, not a GPU).
    pub fn new() -> Result<NcclId> {
        let lib = nccl()?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: one out-parameter of the right type.
        lib.check("ncclGetUniqueId", unsafe { (lib.get_unique_id)(&mut id) })?;
        Ok(NcclId(id.internal.iter().map(|&c| c as u8).collect()))
    }

    fn raw(&self) -> Result<sys::ncclUniqueId> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if self.0.len() != id.internal.len() {
            return Err(CudaError::Shape(format!("an NCCL id has 128 bytes, not {}", self.0.len())));
        }
        for (d, &s) in id.internal.iter_mut().zip(&self.0) {
            *d = s as _;
        }
        Ok(id)
    }
}

/// One member's handle of a communicator, bound to the GPU it was made on.
pub struct Comm {
    comm: sys::ncclComm_t,
    pub rank: usize,
    pub size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time;
// `Comm` is moved to the thread that uses it and never shared.
unsafe impl Send for Comm {}

impl Comm {
    /// Joins the communicator `id` of `size` members as `rank`, on `gpu`
    /// (whose context is bound to this thread). Blocks until every member
    /// has joined: all members must call this at the same time.
    pub fn init(gpu: &Gpu, id: &NcclId, size: usize, rank: usize) -> Result<Comm> {
        let lib = nccl()?;
        gpu.bind()?;
        let raw = id.raw()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new handle; the id is 128 valid bytes.
        let code = unsafe { (lib.comm_init_rank)(&mut comm, size as i32, raw, rank as i32) };
        lib.check(&format!("ncclCommInitRank (rank {rank} of {size})"), code)?;
        Ok(Comm { comm, rank, size })
    }

    fn stream(gpu: &Gpu) -> sys::cudaStream_t {
        gpu.stream() as sys::cudaStream_t
    }

    /// Sends `count` elements of `buf` from element `offset` to member
    /// `peer`, queued on `gpu`'s comm stream, so a send waiting for its
    /// receiver never stalls compute (the buffer must stay untouched until
    /// the comm stream passes this point: see `Gpu::comm_mark`).
    pub fn send<T: NcclType>(
        &self,
        gpu: &Gpu,
        buf: &DeviceBuffer<T>,
        offset: usize,
        count: usize,
        peer: usize,
    ) -> Result<()> {
        super::ensure(offset + count <= buf.len(), || "NCCL send past the buffer's end".into())?;
        let p = buf.ptr_at(offset) as *const c_void;
        // SAFETY: bounds checked; the buffer lives on this communicator's GPU.
        let stream = gpu.comm_stream() as sys::cudaStream_t;
        let lib = nccl()?;
        super::counts::nccl();
        let code = unsafe { (lib.send)(p, count, T::KIND, peer as i32, self.comm, stream) };
        lib.check(&format!("ncclSend of {count} elements to rank {peer}"), code)
    }

    /// Receives `count` elements from member `peer` into `buf` at element
    /// `offset`, queued on `gpu`'s compute stream (what reads the buffer next
    /// runs there, after it).
    pub fn recv<T: NcclType>(
        &self,
        gpu: &Gpu,
        buf: &DeviceBuffer<T>,
        offset: usize,
        count: usize,
        peer: usize,
    ) -> Result<()> {
        super::ensure(offset + count <= buf.len(), || "NCCL receive past the buffer's end".into())?;
        let p = buf.ptr_at(offset) as *mut c_void;
        // SAFETY: bounds checked; the buffer lives on this communicator's GPU.
        let lib = nccl()?;
        super::counts::nccl();
        let code = unsafe { (lib.recv)(p, count, T::KIND, peer as i32, self.comm, Self::stream(gpu)) };
        lib.check(&format!("ncclRecv of {count} elements from rank {peer}"), code)
    }

    /// Sums `count` f32s at `ptr` over every member, in place, on `gpu`'s
    /// stream. NCCL's ring reduces each chunk in one order and hands the same
    /// bits to every member, run after run for a fixed topology and
    /// NCCL_ALGO; it is not the microbatch tree's order (optim::grad_tree),
    /// so no gradient sum goes through it: data-parallel replicas are joined
    /// by that tree in the reducer actor.
    pub fn all_reduce_sum(&self, gpu: &Gpu, ptr: u64, count: usize) -> Result<()> {
        let p = ptr as *mut c_void;
        let lib = nccl()?;
        // SAFETY: the caller passes a live f32 range of `count` elements on this GPU.
        super::counts::nccl();
        let code = unsafe {
            (lib.all_reduce)(
                p as *const c_void,
                p,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                Self::stream(gpu),
            )
        };
        lib.check(&format!("ncclAllReduce of {count} f32s"), code)
    }

    /// One communicator per GPU of this process, rank i on `gpus[i]`, made
    /// at once (no id to share: ncclCommInitAll stands in for every
    /// member's `init`). NCCL cannot put two ranks on one GPU (it hangs), so
    /// a repeated ordinal is refused. NCCL may leave any of these GPUs
    /// current: bind one before using the thread's context.
    pub fn init_all(gpus: &[&Gpu]) -> Result<Vec<Comm>> {
        let ordinals: Vec<usize> = gpus.iter().map(|g| g.ordinal).collect();
        distinct_ordinals(&ordinals)?;
        let lib = nccl()?;
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `comms` has room for one handle per entry of `devs`.
        let code = unsafe { (lib.comm_init_all)(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) };
        lib.check(&format!("ncclCommInitAll over GPUs {ordinals:?}"), code)?;
        let size = comms.len();
        Ok(comms.into_iter().enumerate().map(|(rank, comm)| Comm { comm, rank, size }).collect())
    }

    /// recv (size × count elements) = every member's `count` elements of
    /// `send`, in rank order, on `gpu`'s compute stream. In place when send
    /// is this member's slot: recv + rank × count elements.
    pub fn all_gather<T: NcclType>(&self, gpu: &Gpu, send: u64, recv: u64, count: usize) -> Result<()> {
        let lib = nccl()?;
        // SAFETY: the caller passes live ranges on this communicator's GPU:
        // `count` elements at send, size × count at recv.
        super::counts::nccl();
        let code = unsafe {
            (lib.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                T::KIND,
                self.comm,
                Self::stream(gpu),
            )
        };
        let what = format!(
            "ncclAllGather of {count} elements from each of {} ranks (rank {})",
            self.size, self.rank
        );
        lib.check(&what, code)
    }

    /// Every member's `count` elements at `buf` = root's, in place, on `gpu`'s compute stream.
    pub fn broadcast<T: NcclType>(&self, gpu: &Gpu, buf: u64, count: usize, root: usize) -> Result<()> {
        self.check_root("ncclBroadcast", root)?;
        let lib = nccl()?;
        let p = buf as *mut c_void;
        // SAFETY: the caller passes `count` live elements at buf on this GPU.
        super::counts::nccl();
        let code =
            unsafe { (lib.broadcast)(p, p, count, T::KIND, root as i32, self.comm, Self::stream(gpu)) };
        lib.check(&format!("ncclBroadcast of {count} elements from rank {root} of {}", self.size), code)
    }

    /// Root's `count` f32s at `buf` = their sum over every member, in place,
    /// on `gpu`'s compute stream; the other members' buffers are left as
    /// they were. NCCL's order of the adds is its own (see `all_reduce_sum`):
    /// a sum that must match the CPU bit for bit gathers and uses
    /// `tree::tree_sum_f32` instead.
    pub fn reduce_sum_f32(&self, gpu: &Gpu, buf: u64, count: usize, root: usize) -> Result<()> {
        self.check_root("ncclReduce", root)?;
        let lib = nccl()?;
        let p = buf as *mut c_void;
        // SAFETY: the caller passes `count` live f32s at buf on this GPU.
        super::counts::nccl();
        let code = unsafe {
            (lib.reduce)(
                p,
                p,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                root as i32,
                self.comm,
                Self::stream(gpu),
            )
        };
        lib.check(&format!("ncclReduce (sum) of {count} f32s to rank {root} of {}", self.size), code)
    }

    fn check_root(&self, call: &str, root: usize) -> Result<()> {
        super::ensure(root < self.size, || format!("{call}: root {root} is not a rank of {}", self.size))
    }
}

/// Refuses a GPU listed twice (and an empty list): NCCL would hang.
fn distinct_ordinals(ordinals: &[usize]) -> Result<()> {
    super::ensure(!ordinals.is_empty(), || "ncclCommInitAll over no GPU".into())?;
    for (i, o) in ordinals.iter().enumerate() {
        super::ensure(!ordinals[..i].contains(o), || {
            format!(
                "ncclCommInitAll over GPUs {ordinals:?}: GPU {o} is listed twice, and NCCL cannot put two ranks \
                 on one GPU (ranks sharing a GPU must join their sums with tree::tree_join instead)"
            )
        })?;
    }
    Ok(())
}

/// Runs `f` between ncclGroupStart and ncclGroupEnd. One thread driving
/// several GPUs' communicators must group its calls: an ungrouped
/// collective on rank 0 waits for ranks the same thread has not reached
/// yet, and deadlocks. Inside a group NCCL only queues; ncclGroupEnd
/// launches them all. End is called even when `f` fails (else the thread
/// stays inside a group); `f`'s error is the one reported.
pub fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let lib = nccl()?;
    // SAFETY: no arguments; paired with the GroupEnd below.
    lib.check("ncclGroupStart", unsafe { (lib.group_start)() })?;
    let ran = f();
    // SAFETY: closes the group opened above.
    let ended = lib.check("ncclGroupEnd", unsafe { (lib.group_end)() });
    let r = ran?;
    ended?;
    Ok(r)
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: made by comm_init_rank (so the library is open), destroyed once.
        if let Ok(lib) = nccl() {
            unsafe {
                let _ = (lib.comm_destroy)(self.comm);
            }
        }
    }
}

/// Element types NCCL moves.
pub trait NcclType {
    const KIND: sys::ncclDataType_t;
}

impl NcclType for f32 {
    const KIND: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
}

impl NcclType for super::Bf16 {
    const KIND: sys::ncclDataType_t = sys::ncclDataType_t::ncclBfloat16;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_gpus_are_accepted() {
        assert!(distinct_ordinals(&[0]).is_ok());
        assert!(distinct_ordinals(&[3, 0, 1, 2]).is_ok());
    }

    #[test]
    fn a_gpu_listed_twice_is_refused_naming_it() {
        let err = distinct_ordinals(&[0, 2, 1, 2]).unwrap_err().to_string();
        assert!(err.contains("GPU 2 is listed twice"), "{err}");
    }

    #[test]
    fn no_gpu_is_refused() {
        assert!(distinct_ordinals(&[]).is_err());
    }
}
