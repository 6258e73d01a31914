//! The EMA of the weights (`optim.ema_decay`) for the parameters of one model
//! part: PyTorch's `AveragedModel` with `get_ema_multi_avg_fn(decay)`. Its
//! first update copies the weights; every later one is the lerp of
//! `kernels::cpu::ema`. It is updated once per applied optimizer step, after
//! AdamW, and like AdamW's moments it is kept for the elements a replica's
//! ZeRO shard owns (all of them at zero = 0). Elementwise, so its bits do not
//! depend on the layout.

use super::zero::Shard;
use crate::kernels::cpu::ema::{ema_update, weight_of};
use crate::kernels::profile::{timed, Kernel};
use crate::model::Param;

pub struct EmaState {
    pub decay: f64,
    /// Per tensor, the elements `shard` owns.
    pub shadow: Vec<Vec<f32>>,
    /// Updates so far: AveragedModel's `n_averaged` (0 → the next one copies).
    pub updates: u64,
    pub shard: Shard,
}

impl EmaState {
    /// An EMA not yet updated, for the elements `shard` owns of each of `params`.
    pub fn sharded(params: &[Param], shard: Shard, decay: f64) -> Self {
        let shadow = params.iter().map(|p| vec![0.0; shard.range(p.numel()).len()]).collect();
        EmaState { decay, shadow, updates: 0, shard }
    }

    /// One update from the owned elements of `params` (the ones the state
    /// was made for, in the same order).
    pub fn update(&mut self, params: &[Param]) {
        let shard = self.shard;
        self.update_owned(params.iter().map(|p| &p.data[shard.range(p.numel())]));
    }

    /// [`Self::update`] from each tensor's owned elements alone (a ZeRO-3
    /// replica holds no others between actions), in the state's order.
    pub fn update_owned<'a>(&mut self, owned: impl ExactSizeIterator<Item = &'a [f32]>) {
        assert_eq!(owned.len(), self.shadow.len(), "EMA for {} tensors", self.shadow.len());
        let w = weight_of(self.decay);
        for (e, owned) in self.shadow.iter_mut().zip(owned) {
            // Optimizer time: the profile counts it with AdamW's.
            timed(Kernel::AdamW, || match self.updates {
                0 => e.copy_from_slice(owned),
                _ => ema_update(e, owned, w),
            });
        }
        self.updates += 1;
    }

    /// The EMA a checkpoint holds (whole tensors by name, and its update
    /// count), cut to the elements this state's shard owns.
    pub fn load(
        &mut self,
        params: &[Param],
        whole: &std::collections::HashMap<String, Vec<f32>>,
        updates: u64,
    ) -> Result<(), String> {
        for (e, p) in self.shadow.iter_mut().zip(params) {
            let t = whole.get(&p.name).ok_or_else(|| format!("checkpoint lacks the EMA of {}", p.name))?;
            if t.len() != p.numel() {
                return Err(format!(
                    "the EMA of {} has {} elements, expected {}",
                    p.name,
                    t.len(),
                    p.numel()
                ));
            }
            e.copy_from_slice(&t[self.shard.range(p.numel())]);
        }
        self.updates = updates;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::ema::lerp;

    fn param(data: Vec<f32>) -> Param {
        Param { name: "w".into(), shape: vec![data.len()], grad: vec![0.0; data.len()], data, canonical: 0 }
    }

    /// AveragedModel: n_averaged = 0 copies, later updates lerp by 1 − decay.
    #[test]
    fn the_first_update_copies_and_later_ones_lerp_toward_the_weights() {
        let mut p = vec![param(vec![1.0, -2.0, 0.5])];
        let mut ema = EmaState::sharded(&p, Shard::WHOLE, 0.9);
        ema.update(&p);
        assert_eq!((ema.shadow[0].clone(), ema.updates), (vec![1.0, -2.0, 0.5], 1));
        p[0].data = vec![2.0, 0.0, 0.25];
        ema.update(&p);
        let w = weight_of(0.9);
        let want: Vec<f32> =
            [(1.0, 2.0), (-2.0, 0.0), (0.5, 0.25)].iter().map(|&(e, x)| lerp(e, x, w)).collect();
        assert_eq!(ema.shadow[0], want);
        assert_eq!(ema.updates, 2);
    }

    /// Each replica's shard, updated alone and laid end to end, is the whole EMA.
    #[test]
    fn sharded_updates_tile_the_whole_update() {
        let n = 3 * super::super::zero::BLOCK + 7;
        let steps: Vec<Vec<Param>> = (0..3)
            .map(|s| vec![param((0..n).map(|i| ((i * 7 + s * 13) % 101) as f32 / 50.0).collect())])
            .collect();
        let run = |shard: Shard| {
            let mut ema = EmaState::sharded(&steps[0], shard, 0.7);
            steps.iter().for_each(|p| ema.update(p));
            ema.shadow.remove(0)
        };
        let whole = run(Shard::WHOLE);
        let tiled: Vec<f32> = (0..2).flat_map(|replica| run(Shard { replica, dp: 2 })).collect();
        assert_eq!(tiled, whole);
    }
}
