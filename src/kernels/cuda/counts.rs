//! What the CUDA backend asks of the driver, counted: kernel launches,
//! cuBLASLt products, NCCL calls, waits that block the host (stream and event
//! synchronizes), copies by direction with their bytes, memsets and
//! allocations. Every call goes through `Gpu` (device.rs), `matmul.rs` or
//! `nccl.rs`, which add to these process-wide counters (all GPUs of the
//! process together); `gpu-bench --counts` reads them around steps of one
//! and of two microbatches, so what a step costs splits into a per-step part
//! and a per-microbatch part. They count calls, not time: the same on the
//! emulated GPU as on hardware, so CI can hold them to bounds.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! counters {
    ($($field:ident: $what:literal),* $(,)?) => {
        /// A snapshot of the counters, or the difference of two.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
        pub struct Counts {
            $(#[doc = $what] pub $field: u64,)*
        }

        struct Live {
            $($field: AtomicU64,)*
        }

        static LIVE: Live = Live { $($field: AtomicU64::new(0),)* };

        impl Counts {
            /// The counters now.
            pub fn now() -> Counts {
                Counts { $($field: LIVE.$field.load(Relaxed),)* }
            }

            /// What happened between `earlier` and `self`.
            pub fn since(&self, earlier: &Counts) -> Counts {
                Counts { $($field: self.$field.wrapping_sub(earlier.$field),)* }
            }

            /// `self` − `other`, counter by counter; None when any would go below zero.
            pub fn minus(&self, other: &Counts) -> Option<Counts> {
                Some(Counts { $($field: self.$field.checked_sub(other.$field)?,)* })
            }

            /// (name, what it counts, value) of each counter, in order.
            pub fn rows(&self) -> Vec<(&'static str, &'static str, u64)> {
                vec![$((stringify!($field), $what, self.$field),)*]
            }
        }
    };
}

counters! {
    launches: "kernel launches",
    matmuls: "cuBLASLt matmuls",
    nccl_calls: "NCCL calls (collectives, sends, receives)",
    host_syncs: "stream or event synchronizes (the host waits for the GPU)",
    h2d_copies: "host-to-device copies",
    h2d_bytes: "host-to-device bytes",
    d2h_copies: "device-to-host copies",
    d2h_bytes: "device-to-host bytes",
    d2d_copies: "device-to-device copies (within a GPU or between GPUs)",
    memsets: "memsets (zeroing and fills)",
    allocs: "device allocations",
    alloc_bytes: "device bytes allocated",
}

pub(crate) fn launch() {
    LIVE.launches.fetch_add(1, Relaxed);
}
pub(crate) fn matmul() {
    LIVE.matmuls.fetch_add(1, Relaxed);
}
pub(crate) fn nccl() {
    LIVE.nccl_calls.fetch_add(1, Relaxed);
}
pub(crate) fn host_sync() {
    LIVE.host_syncs.fetch_add(1, Relaxed);
}
pub(crate) fn h2d(bytes: usize) {
    LIVE.h2d_copies.fetch_add(1, Relaxed);
    LIVE.h2d_bytes.fetch_add(bytes as u64, Relaxed);
}
pub(crate) fn d2h(bytes: usize) {
    LIVE.d2h_copies.fetch_add(1, Relaxed);
    LIVE.d2h_bytes.fetch_add(bytes as u64, Relaxed);
}
pub(crate) fn d2d() {
    LIVE.d2d_copies.fetch_add(1, Relaxed);
}
pub(crate) fn memset() {
    LIVE.memsets.fetch_add(1, Relaxed);
}
pub(crate) fn alloc(bytes: usize) {
    LIVE.allocs.fetch_add(1, Relaxed);
    LIVE.alloc_bytes.fetch_add(bytes as u64, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_counts_only_what_happened_between_two_snapshots() {
        // Other tests of this process may count too: compare against a lower bound.
        let before = Counts::now();
        launch();
        launch();
        h2d(12);
        d2h(4);
        alloc(256);
        memset();
        host_sync();
        let d = Counts::now().since(&before);
        assert!(d.launches >= 2 && d.h2d_copies >= 1 && d.h2d_bytes >= 12 && d.d2h_bytes >= 4);
        assert!(d.allocs >= 1 && d.alloc_bytes >= 256 && d.memsets >= 1 && d.host_syncs >= 1);
        let names: Vec<_> = d.rows().iter().map(|r| r.0).collect();
        assert_eq!(names[0], "launches");
        assert_eq!(names.len(), 12);
        assert_eq!(Counts::default().since(&Counts::default()), Counts::default());
        assert_eq!(d.minus(&d), Some(Counts::default()));
        assert_eq!(Counts::default().minus(&d), None);
    }
}
