//! How a GPU stage's activations and gradients reach the next GPU stage
//! without a trip through host memory:
//!
//! - In one process, through an `Exchange`: the sender copies the tensor
//!   into one of its `Outbox` buffers and files it under the receiving
//!   (replica, phase, direction, stage, microbatch); the receiver copies it
//!   out — device to device on one GPU, peer to peer between two — and hands
//!   the buffer back. A sender with no free outbox buffer sends through host
//!   memory instead, so the exchange never makes anyone wait.
//! - Across processes, over NCCL: one two-member communicator per directed
//!   link between pipeline ranks, so each carries one direction in the
//!   sender's order; the sender sends from a ring of buffers on its comm
//!   stream, the receiver receives straight into its input on its compute
//!   stream.
//!
//! Either way the stage message still travels as before, carrying an empty
//! tensor: it says what arrived and when, and keeps the receiving stage's
//! schedule, replay log and trace unchanged. The bytes go here.

use super::device::{Context, Event};
use super::nccl::{Comm, NcclType};
use super::{ensure, CudaError, DeviceBuffer, Elem, Gpu, Result};
use crossbeam_channel::{Receiver, Sender};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// What a parcel is: the tensor for `stage`'s F (an activation) or for its
/// B (the gradient of its output), of one microbatch of one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ParcelKey {
    pub replica: usize,
    pub eval: bool,
    pub gradient: bool,
    /// The stage that consumes the tensor.
    pub stage: usize,
    pub mb: usize,
}

/// One tensor in flight: where its bytes are and whose outbox buffer to return.
pub struct Parcel {
    ptr: u64,
    ctx: Context,
    bytes: usize,
    home: Sender<usize>,
    slot: usize,
}

impl Parcel {
    /// Copies the tensor into `dst` on `gpu` (finished on return) and hands
    /// the sender's buffer back.
    pub fn deliver<X: Elem>(self, gpu: &Gpu, dst: &DeviceBuffer<X>) -> Result<()> {
        ensure(dst.bytes() >= self.bytes, || {
            format!("a parcel of {} bytes for a buffer of {}", self.bytes, dst.bytes())
        })?;
        gpu.copy_from_context(dst.ptr(), self.ptr, self.ctx, self.bytes)
    }
}

impl Drop for Parcel {
    fn drop(&mut self) {
        // Delivered or abandoned (a run stopping): the buffer is free again.
        let _ = self.home.send(self.slot);
    }
}

/// The parcels of one process, shared by its GPU stages.
#[derive(Default)]
pub struct Exchange {
    parcels: Mutex<BTreeMap<ParcelKey, Parcel>>,
}

impl Exchange {
    pub fn new() -> Arc<Exchange> {
        Arc::new(Exchange::default())
    }

    /// The parcel filed under `key`. Senders file before they send the
    /// message that announces it, so a receiver holding the message finds it.
    pub fn take(&self, key: ParcelKey) -> Result<Parcel> {
        self.parcels
            .lock()
            .expect("exchange")
            .remove(&key)
            .ok_or_else(|| CudaError::Shape(format!("no parcel for {key:?} in the device exchange")))
    }

    fn put(&self, key: ParcelKey, parcel: Parcel) -> Result<()> {
        let prev = self.parcels.lock().expect("exchange").insert(key, parcel);
        ensure(prev.is_none(), || format!("{key:?} was filed twice in the device exchange"))
    }
}

/// A sender's buffers for parcels in flight in one process.
pub struct Outbox<X: Elem> {
    bufs: Vec<DeviceBuffer<X>>,
    free: Receiver<usize>,
    home: Sender<usize>,
}

impl<X: Elem> Outbox<X> {
    /// `count` buffers of `len` elements on `gpu`.
    pub fn new(gpu: &Gpu, count: usize, len: usize) -> Result<Outbox<X>> {
        let (home, free) = crossbeam_channel::unbounded();
        let bufs = (0..count).map(|_| gpu.alloc(len)).collect::<Result<Vec<_>>>()?;
        for k in 0..count {
            let _ = home.send(k);
        }
        Ok(Outbox { bufs, free, home })
    }

    /// Copies `src` into a free buffer and files it under `key`. False when
    /// every buffer is in flight: the caller then sends through host memory.
    pub fn post(
        &self,
        gpu: &Gpu,
        src: &DeviceBuffer<X>,
        exchange: &Exchange,
        key: ParcelKey,
    ) -> Result<bool> {
        let Ok(slot) = self.free.try_recv() else { return Ok(false) };
        let buf = &self.bufs[slot];
        ensure(buf.len() >= src.len(), || format!("an outbox buffer of {} for {}", buf.len(), src.len()))?;
        // Finished before filing: the receiver reads it on another stream.
        gpu.copy_from_context(buf.ptr(), src.ptr(), gpu.context(), src.bytes())?;
        let parcel =
            Parcel { ptr: buf.ptr(), ctx: gpu.context(), bytes: src.bytes(), home: self.home.clone(), slot };
        exchange.put(key, parcel)?;
        Ok(true)
    }
}

/// One end of a directed NCCL link between two pipeline ranks.
pub struct NcclLink<X: Elem> {
    comm: Comm,
    /// The other member's index in the two-member communicator.
    peer: usize,
    /// Send side: a ring of buffers, each with the mark of its last send.
    ring: Vec<(DeviceBuffer<X>, Option<Event>)>,
    next: usize,
}

impl<X: Elem + NcclType> NcclLink<X> {
    /// The sending end, with `depth` buffers of `len` elements for sends in flight.
    pub fn sender(gpu: &Gpu, comm: Comm, depth: usize, len: usize) -> Result<NcclLink<X>> {
        let ring = (0..depth.max(1)).map(|_| Ok((gpu.alloc(len)?, None))).collect::<Result<Vec<_>>>()?;
        let peer = 1 - comm.rank;
        Ok(NcclLink { comm, peer, ring, next: 0 })
    }

    /// The receiving end.
    pub fn receiver(comm: Comm) -> NcclLink<X> {
        let peer = 1 - comm.rank;
        NcclLink { comm, peer, ring: vec![], next: 0 }
    }

    /// Sends `src` as queued on the compute stream so far: copied into the
    /// next ring buffer (waiting first for that buffer's previous send), then
    /// sent on the comm stream.
    pub fn send(&mut self, gpu: &Gpu, src: &DeviceBuffer<X>) -> Result<()> {
        ensure(!self.ring.is_empty(), || "send on the receiving end of an NCCL link".into())?;
        let k = self.next;
        self.next = (self.next + 1) % self.ring.len();
        let (buf, mark) = &mut self.ring[k];
        if let Some(m) = mark.take() {
            // The receiver has taken that buffer's last tensor: NCCL says so.
            m.wait()?;
        }
        ensure(buf.len() >= src.len(), || format!("an NCCL ring buffer of {} for {}", buf.len(), src.len()))?;
        gpu.copy_from_context(buf.ptr(), src.ptr(), gpu.context(), src.bytes())?;
        gpu.comm_after_compute()?;
        self.comm.send(gpu, buf, 0, src.len(), self.peer)?;
        *mark = Some(gpu.comm_mark()?);
        Ok(())
    }

    /// Receives the next tensor on this link into `dst`, queued on the compute stream.
    pub fn recv(&self, gpu: &Gpu, dst: &DeviceBuffer<X>, len: usize) -> Result<()> {
        self.comm.recv(gpu, dst, 0, len, self.peer)
    }
}
