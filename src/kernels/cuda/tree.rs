//! Joins of a tensor-parallel stage's partial sums on one GPU
//! (kernels/tp.cu): the pairwise tree of `tree_sum` in src/kernels/cpu/tree.rs,
//! over `count` f32 nodes laid out contiguously (count × len), so a GPU join
//! has the CPU's bits for every tp size. Never allocates; the nodes are the
//! caller's (gathered there by NCCL or by copies between ranks).

use super::device::{args, blocks, Gpu};
use super::{ensure, Elem, Result};

/// The most nodes one join takes (kernels/tp.cu unrolls a tree per count).
pub const MAX_NODES: usize = 64;

/// out[e] (f32, len) = the tree over nodes[j·len + e], j in 0..count. `count`
/// is a power of two up to [`MAX_NODES`]; out may be node 0.
pub fn tree_sum_f32(gpu: &Gpu, out: u64, nodes: u64, count: usize, len: usize) -> Result<()> {
    tree_join::<f32>(gpu, out, nodes, count, len, None)
}

/// out (X, len) = X(tree) over the nodes as in [`tree_sum_f32`]; with a
/// residual (X, len), X(f32(X(tree)) + residual), the add of
/// `residual_forward` after the sum is stored. out may be the residual, or
/// node 0 when X is f32; it must not overlap the nodes otherwise (a thread
/// would overwrite a node another thread has yet to read).
pub fn tree_join<X: Elem>(
    gpu: &Gpu,
    out: u64,
    nodes: u64,
    count: usize,
    len: usize,
    residual: Option<u64>,
) -> Result<()> {
    check_join(out, std::mem::size_of::<X>(), nodes, count, len)?;
    if len == 0 {
        return Ok(()); // a grid of no blocks is a launch error
    }
    let f = gpu.function::<X>("tp", "tree_join")?;
    let (c, n, r) = (count as i32, len as i64, residual.unwrap_or(0));
    gpu.launch(f, (blocks(len, 256), 1, 1), (256, 1, 1), &mut args![out, nodes, c, n, r])
}

/// The join's arguments: a count the kernel has a tree for, and an out that
/// is either node 0 in the nodes' own type or clear of every node.
fn check_join(out: u64, out_size: usize, nodes: u64, count: usize, len: usize) -> Result<()> {
    ensure(count.is_power_of_two() && count <= MAX_NODES, || {
        format!("tree join: count {count} is not a power of two in 1..={MAX_NODES}")
    })?;
    let out_end = out.saturating_add((len * out_size) as u64);
    let nodes_end = nodes.saturating_add((count * len * 4) as u64);
    let clear = len == 0 || out_end <= nodes || nodes_end <= out;
    ensure(clear || (out == nodes && out_size == 4), || {
        format!(
            "tree join: out {out:#x} ({len} elements of {out_size} bytes) overlaps the {count} nodes at {nodes:#x} \
             without being node 0 in f32"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_that_are_powers_of_two_up_to_64_are_accepted() {
        for count in [1, 2, 4, 8, 16, 32, 64] {
            assert!(check_join(0x10_0000, 4, 0x20_0000, count, 3).is_ok(), "count {count}");
        }
    }

    #[test]
    fn other_counts_are_refused_naming_the_count() {
        for count in [0, 3, 6, 128] {
            let err = check_join(0x10_0000, 4, 0x20_0000, count, 3).unwrap_err().to_string();
            assert!(err.contains(&format!("count {count} ")), "{err}");
        }
    }

    #[test]
    fn out_may_be_node_zero_only_in_f32() {
        assert!(check_join(0x1000, 4, 0x1000, 4, 7).is_ok());
        let err = check_join(0x1000, 2, 0x1000, 4, 7).unwrap_err().to_string();
        assert!(err.contains("overlaps"), "{err}");
    }

    #[test]
    fn out_inside_a_later_node_is_refused() {
        // Nodes of 8 f32s at 0x1000: node 1 starts at 0x1020.
        assert!(check_join(0x1020, 4, 0x1000, 2, 8).is_err());
        assert!(check_join(0x1040, 4, 0x1000, 2, 8).is_ok(), "just past the last node");
        assert!(check_join(0x0fe0, 4, 0x1000, 2, 8).is_ok(), "just before node 0");
    }
}
