//! Embedding launchers (kernels/embedding.cu), twin of kernels/cpu/embedding.rs.
//! The weight gradient of wte needs no atomics: `TokenOwners` lists, on the
//! host, each distinct token id with its positions in order, and one block
//! owns one id.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

/// Distinct token ids (ascending) and, per id, its positions in ascending order (CSR).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TokenOwners {
    pub ids: Vec<u32>,
    pub offsets: Vec<u32>,
    pub positions: Vec<u32>,
}

impl TokenOwners {
    pub fn new(tokens: &[u32]) -> TokenOwners {
        let mut order: Vec<u32> = (0..tokens.len() as u32).collect();
        // Stable: positions of one id stay ascending.
        order.sort_by_key(|&p| tokens[p as usize]);
        let mut owners = TokenOwners { ids: vec![], offsets: vec![0], positions: order };
        for (k, &p) in owners.positions.iter().enumerate() {
            let tok = tokens[p as usize];
            if owners.ids.last() != Some(&tok) {
                if k > 0 {
                    owners.offsets.push(k as u32);
                }
                owners.ids.push(tok);
            }
        }
        if !tokens.is_empty() {
            owners.offsets.push(tokens.len() as u32);
        }
        owners
    }
}

/// The owner lists on the device.
pub struct DeviceOwners {
    pub ids: DeviceBuffer<u32>,
    pub offsets: DeviceBuffer<u32>,
    pub positions: DeviceBuffer<u32>,
    pub count: usize,
}

impl DeviceOwners {
    pub fn upload(gpu: &Gpu, o: &TokenOwners) -> Result<DeviceOwners> {
        Ok(DeviceOwners {
            ids: gpu.upload(&o.ids)?,
            offsets: gpu.upload(&o.offsets)?,
            positions: gpu.upload(&o.positions)?,
            count: o.ids.len(),
        })
    }
}

/// out (N, C) = wte[tokens] + wpe[t]. Token ids must be < the rows of wte.
#[allow(clippy::too_many_arguments)]
pub fn embedding_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    tokens: &DeviceBuffer<u32>,
    wte: u64,
    wpe: u64,
    n: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    ensure(out.len() >= n * c && tokens.len() >= n && t > 0 && n.is_multiple_of(t), || {
        format!("embedding_forward: buffers for N={n} T={t} C={c}")
    })?;
    let f = gpu.function::<X>("embedding", "embedding_forward")?;
    let (o, tk, ni, ti, ci) = (out.ptr(), tokens.ptr(), n as i32, t as i32, c as i32);
    gpu.launch(f, (blocks(n * c, 256), 1, 1), (256, 1, 1), &mut args![o, tk, wte, wpe, ni, ti, ci])
}

/// out (N, C) = wte[tokens]: the token embedding alone (no position table).
pub fn token_embedding_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    tokens: &DeviceBuffer<u32>,
    wte: u64,
    n: usize,
    c: usize,
) -> Result<()> {
    ensure(out.len() >= n * c && tokens.len() >= n, || {
        format!("token_embedding_forward: buffers for N={n} C={c}")
    })?;
    let f = gpu.function::<X>("embedding", "embedding_forward_tokens")?;
    let (o, tk, ni, ci) = (out.ptr(), tokens.ptr(), n as i32, c as i32);
    gpu.launch(f, (blocks(n * c, 256), 1, 1), (256, 1, 1), &mut args![o, tk, wte, ni, ci])
}

/// dwte[token] += dout rows, and with a position table dwpe[t] += Σ_b
/// dout[b, t]; both f32. Without one (`dwpe` None) it is the token
/// embedding's backward alone.
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward<X: Elem>(
    gpu: &Gpu,
    dwte: u64,
    dwpe: Option<u64>,
    dout: &DeviceBuffer<X>,
    owners: &DeviceOwners,
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    ensure(dout.len() >= b * t * c && owners.positions.len() == b * t, || {
        format!("embedding_backward: buffers for B={b} T={t} C={c}")
    })?;
    let d = dout.ptr();
    let (bi, ti, ci) = (b as i32, t as i32, c as i32);
    if let Some(dwpe) = dwpe {
        let f = gpu.function::<X>("embedding", "embedding_backward_wpe")?;
        gpu.launch(f, (blocks(t * c, 256), 1, 1), (256, 1, 1), &mut args![dwpe, d, bi, ti, ci])?;
    }
    if owners.count == 0 {
        return Ok(());
    }
    let f = gpu.function::<X>("embedding", "embedding_backward_wte")?;
    let (ids, offs, pos) = (owners.ids.ptr(), owners.offsets.ptr(), owners.positions.ptr());
    gpu.launch(f, (owners.count as u32, 1, 1), (256, 1, 1), &mut args![dwte, d, ids, offs, pos, ci])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_owners_list_each_id_with_its_positions_in_order() {
        let o = TokenOwners::new(&[5, 2, 5, 7, 2, 5]);
        assert_eq!(o.ids, vec![2, 5, 7]);
        assert_eq!(o.offsets, vec![0, 2, 5, 6]);
        assert_eq!(o.positions, vec![1, 4, 0, 2, 5, 3]);
        assert_eq!(TokenOwners::new(&[]), TokenOwners { ids: vec![], offsets: vec![0], positions: vec![] });
    }
}
