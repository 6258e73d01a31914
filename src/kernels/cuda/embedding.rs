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

/// A microbatch's token ids and their owner lists on the device, in one
/// buffer so that one upload (one host synchronize) carries all four, each
/// at a fixed place: the tokens (n), the positions (n), the offsets (room
/// for n + 1) and the distinct ids (at most n) last, so an upload copies
/// only up to the last id.
pub struct DeviceTokens {
    buf: DeviceBuffer<u32>,
    /// The staging copy of `buf`, kept so an upload allocates nothing.
    host: Vec<u32>,
    n: usize,
    /// Distinct ids in the last upload.
    count: usize,
}

impl DeviceTokens {
    /// Room for microbatches of `n` tokens.
    pub fn new(gpu: &Gpu, n: usize) -> Result<Self> {
        Ok(DeviceTokens { buf: gpu.alloc(4 * n + 1)?, host: vec![0; 4 * n + 1], n, count: 0 })
    }

    /// `tokens` (exactly n) and their owner lists, in one copy.
    pub fn upload(&mut self, gpu: &Gpu, tokens: &[u32]) -> Result<()> {
        let n = self.n;
        ensure(tokens.len() == n, || format!("{} tokens for a buffer of {n}", tokens.len()))?;
        let o = TokenOwners::new(tokens);
        let h = &mut self.host;
        let used = 3 * n + 1 + o.ids.len();
        h[..n].copy_from_slice(tokens);
        h[n..2 * n].copy_from_slice(&o.positions);
        h[2 * n..2 * n + o.offsets.len()].copy_from_slice(&o.offsets);
        h[3 * n + 1..used].copy_from_slice(&o.ids);
        self.count = o.ids.len();
        gpu.copy_to(&self.buf, 0, &h[..used])
    }

    pub fn bytes(&self) -> usize {
        self.buf.bytes()
    }

    fn tokens(&self) -> u64 {
        self.buf.ptr()
    }

    /// The owner lists' ids, offsets and positions.
    fn owners(&self) -> (u64, u64, u64) {
        (self.buf.ptr_at(3 * self.n + 1), self.buf.ptr_at(2 * self.n), self.buf.ptr_at(self.n))
    }
}

/// out (N, C) = wte[tokens] + wpe[t]. Token ids must be < the rows of wte.
#[allow(clippy::too_many_arguments)]
pub fn embedding_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    tokens: &DeviceTokens,
    wte: u64,
    wpe: u64,
    n: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    ensure(out.len() >= n * c && tokens.n == n && t > 0 && n.is_multiple_of(t), || {
        format!("embedding_forward: buffers for N={n} T={t} C={c}")
    })?;
    let f = gpu.function::<X>("embedding", "embedding_forward")?;
    let (o, tk, ni, ti, ci) = (out.ptr(), tokens.tokens(), n as i32, t as i32, c as i32);
    gpu.launch(f, (blocks(n * c, 256), 1, 1), (256, 1, 1), &mut args![o, tk, wte, wpe, ni, ti, ci])
}

/// out (N, C) = wte[tokens]: the token embedding alone (no position table).
pub fn token_embedding_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    tokens: &DeviceTokens,
    wte: u64,
    n: usize,
    c: usize,
) -> Result<()> {
    ensure(out.len() >= n * c && tokens.n == n, || {
        format!("token_embedding_forward: buffers for N={n} C={c}")
    })?;
    let f = gpu.function::<X>("embedding", "embedding_forward_tokens")?;
    let (o, tk, ni, ci) = (out.ptr(), tokens.tokens(), n as i32, c as i32);
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
    owners: &DeviceTokens,
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    ensure(dout.len() >= b * t * c && owners.n == b * t, || {
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
    let (ids, offs, pos) = owners.owners();
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
