//! The plan of a GPU run's NCCL communicators: which ranks share a process
//! (their tensors move device to device through `kernels::cuda::transfer`),
//! a two-member communicator per directed link that crosses processes, and
//! the order each link carries its tensors in. Replicas need none: their
//! gradients are summed by the fixed microbatch tree (optim::grad_tree),
//! whose nodes the reducer actor moves in host memory; an NCCL all-reduce
//! adds in its own, size-dependent order and would break dp-invariance. The GPU compute (`compute::gpu`) opens them; the cluster's
//! roster carries their ids.

/// One NCCL communicator a GPU run needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum NcclKey {
    /// Replica `replica`'s activations (or gradients) from pipeline rank
    /// `from` to rank `to`, where the two live in different processes.
    Link { replica: usize, from: usize, to: usize, gradient: bool },
}

/// What the GPU stages of a run share: which ranks live in this process
/// (their tensors move device to device), the NCCL ids for the rest, and
/// this process's device exchange.
pub struct GpuPlan {
    /// Whether (replica, rank) lives here, at replica · pp + rank.
    pub local: Vec<bool>,
    pub nccl: std::collections::BTreeMap<NcclKey, Vec<u8>>,
    #[cfg(feature = "cuda")]
    pub exchange: std::sync::Arc<crate::kernels::cuda::transfer::Exchange>,
}

impl GpuPlan {
    /// `owner(replica, rank)` is the process a rank lives in; `me` this one.
    /// The NCCL ids are made here: call it once, on rank 0's process, and
    /// send the ids to the others (`from_ids`).
    pub fn make(
        layout: &crate::actors::Layout,
        owner: impl Fn(usize, usize) -> usize,
        me: usize,
    ) -> Result<GpuPlan, String> {
        let keys = GpuPlan::needed(layout, &owner);
        let mut nccl = std::collections::BTreeMap::new();
        for k in keys {
            nccl.insert(k, new_nccl_id()?);
        }
        Ok(GpuPlan::from_ids(layout, owner, me, nccl))
    }

    /// The plan of process `me`, with ids made elsewhere.
    pub fn from_ids(
        layout: &crate::actors::Layout,
        owner: impl Fn(usize, usize) -> usize,
        me: usize,
        nccl: std::collections::BTreeMap<NcclKey, Vec<u8>>,
    ) -> GpuPlan {
        let (pp, dp) = (layout.pp, layout.dp);
        let local = (0..dp * pp).map(|k| owner(k / pp, k % pp) == me).collect();
        GpuPlan {
            local,
            nccl,
            #[cfg(feature = "cuda")]
            exchange: crate::kernels::cuda::transfer::Exchange::new(),
        }
    }

    /// The communicators a layout needs: a link per (replica, from, to, kind)
    /// that crosses processes.
    pub fn needed(layout: &crate::actors::Layout, owner: impl Fn(usize, usize) -> usize) -> Vec<NcclKey> {
        let mut keys = std::collections::BTreeSet::new();
        let last = layout.last_stage();
        for replica in 0..layout.dp {
            for s in 0..last {
                let (a, b) = (layout.rank_of(s), layout.rank_of(s + 1));
                if owner(replica, a) != owner(replica, b) {
                    keys.insert(NcclKey::Link { replica, from: a, to: b, gradient: false });
                    keys.insert(NcclKey::Link { replica, from: b, to: a, gradient: true });
                }
            }
        }
        keys.into_iter().collect()
    }
}

#[cfg(feature = "cuda")]
fn new_nccl_id() -> Result<Vec<u8>, String> {
    crate::kernels::cuda::nccl::NcclId::new().map(|i| i.0).map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn new_nccl_id() -> Result<Vec<u8>, String> {
    Err(crate::kernels::BackendError::NotBuilt.to_string())
}

/// A link's tensors as (consuming stage, microbatch), in order.
pub type LinkOrder = Vec<(usize, usize)>;

/// The order in which a link's tensors are sent and the order in which its
/// receiver takes them under `schedule` (the layout's, or one of a batch
/// ramp's), as (consuming stage, microbatch): NCCL matches a link's sends
/// and receives by order alone, so the two must agree.
pub fn link_orders(
    layout: &crate::actors::Layout,
    schedule: &crate::schedule::Schedule,
    from: usize,
    to: usize,
    gradient: bool,
) -> (LinkOrder, LinkOrder) {
    use crate::schedule::ActionKind::{B, F, I};
    let last = layout.last_stage();
    let acts = &schedule.actions;
    let sent = acts[from]
        .iter()
        .filter_map(|a| match (a.kind, gradient) {
            (F, false) if a.stage < last && layout.rank_of(a.stage + 1) == to => Some((a.stage + 1, a.mb)),
            (B | I, true) if a.stage > 0 && layout.rank_of(a.stage - 1) == to => Some((a.stage - 1, a.mb)),
            _ => None,
        })
        .collect();
    let taken = acts[to]
        .iter()
        .filter_map(|a| match (a.kind, gradient) {
            (F, false) if a.stage > 0 && layout.rank_of(a.stage - 1) == from => Some((a.stage, a.mb)),
            (B | I, true) if a.stage < last && layout.rank_of(a.stage + 1) == from => Some((a.stage, a.mb)),
            _ => None,
        })
        .collect();
    (sent, taken)
}
