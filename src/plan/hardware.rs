//! The GPUs the planner knows: peak dense bf16 FLOP/s, memory and link bandwidths.
//!
//! Sources and assumptions (all per GPU, SXM parts in 8-GPU nodes):
//! - Peak bf16 dense (no sparsity): A100 312 TFLOP/s (NVIDIA A100 datasheet),
//!   H100 SXM 989 TFLOP/s (H100 datasheet; the 1979 figure is with sparsity),
//!   H200 989 TFLOP/s (same Hopper die as H100 SXM).
//! - Memory: A100 80 GB, H100 80 GB, H200 141 GB (datasheets; decimal GB).
//! - NVLink: A100 NVLink 3 is 600 GB/s and Hopper NVLink 4 900 GB/s *bidirectional*
//!   per GPU; a ring collective moves data one way at a time, so we use half
//!   (300 and 450 GB/s) as the bus bandwidth. NCCL's measured all-reduce busbw on
//!   DGX H100 is in the 350–480 GB/s range, so 450 is at the optimistic end.
//! - InfiniBand: one NIC per GPU as in DGX/HGX reference designs: HDR 200 Gb/s
//!   (25 GB/s) for A100, NDR 400 Gb/s (50 GB/s) for H100 and H200, one direction.
//! - Usable memory: 90% of capacity (CUDA context, NCCL buffers, allocator
//!   fragmentation and cuBLAS workspaces take the rest).

use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// One GPU model and the links between such GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Gpu {
    pub name: &'static str,
    /// Peak dense bf16 FLOP/s.
    pub peak_flops: f64,
    /// Memory capacity in bytes (decimal).
    pub memory_bytes: f64,
    /// Bus bandwidth of a ring collective inside a node (NVLink), bytes/s.
    pub nvlink_bytes_per_s: f64,
    /// Bandwidth of one GPU's InfiniBand NIC, one direction, bytes/s.
    pub ib_bytes_per_s: f64,
    /// GPUs that share one NVLink domain (a node).
    pub gpus_per_node: usize,
}

/// Fraction of memory the planner lets a configuration use.
pub const USABLE_MEMORY_FRACTION: f64 = 0.9;

pub const A100: Gpu = Gpu {
    name: "a100",
    peak_flops: 312e12,
    memory_bytes: 80e9,
    nvlink_bytes_per_s: 300e9,
    ib_bytes_per_s: 25e9,
    gpus_per_node: 8,
};
pub const H100: Gpu = Gpu {
    name: "h100",
    peak_flops: 989e12,
    memory_bytes: 80e9,
    nvlink_bytes_per_s: 450e9,
    ib_bytes_per_s: 50e9,
    gpus_per_node: 8,
};
pub const H200: Gpu = Gpu {
    name: "h200",
    peak_flops: 989e12,
    memory_bytes: 141e9,
    nvlink_bytes_per_s: 450e9,
    ib_bytes_per_s: 50e9,
    gpus_per_node: 8,
};

/// Every GPU the planner knows, for `--gpu`.
pub const GPUS: [Gpu; 3] = [A100, H100, H200];

impl Gpu {
    /// Bytes a configuration may use on one GPU.
    pub fn usable_bytes(&self) -> f64 {
        self.memory_bytes * USABLE_MEMORY_FRACTION
    }

    /// Bandwidth for a collective or send among `span` consecutive ranks: NVLink when
    /// they fit in one node, else InfiniBand.
    pub fn link(&self, span: usize) -> f64 {
        if span <= self.gpus_per_node {
            self.nvlink_bytes_per_s
        } else {
            self.ib_bytes_per_s
        }
    }
}

impl fmt::Display for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl FromStr for Gpu {
    type Err = String;

    fn from_str(s: &str) -> Result<Gpu, String> {
        GPUS.into_iter()
            .find(|g| g.name.eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown GPU {s:?}; expected one of a100, h100, h200"))
    }
}

/// The dense bf16 peak of the GPUs a run uses (one entry per device), from the
/// table above (`GPUS`) by name, and where the figure comes from; NaN for a GPU
/// the table does not know.
pub fn gpu_peak_flops(names: &[String]) -> (f64, String) {
    let mut total = 0.0;
    for n in names {
        let n_low = n.to_ascii_lowercase();
        match GPUS.iter().find(|g| n_low.contains(g.name)) {
            Some(g) => total += g.peak_flops,
            None => return (f64::NAN, format!("no bf16 peak known for {n}")),
        }
    }
    (total, format!("bf16 dense datasheet peak of {}", names.join(", ")))
}
