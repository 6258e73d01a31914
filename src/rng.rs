//! Counter-based random numbers.
//!
//! A value depends only on (seed, purpose, ids, counter), never on which thread
//! asked first or how many values were drawn elsewhere. That is what lets two
//! pipeline layouts initialise, shuffle and sample identically.

/// What a stream of random numbers is for; each purpose is an independent stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Parameter initialisation, keyed by the tensor's name.
    Init = 1,
    /// The order in which the shuffled sampler visits windows, keyed by epoch.
    Shuffle = 2,
    /// Synthetic data (the embedded corpus, bench tokens).
    Data = 3,
    /// Test inputs.
    Test = 4,
    /// Sampling the next token in `generate`, keyed by the token's position.
    Sample = 5,
    /// The order of a data mixture's sources within a block, keyed by block.
    Mixture = 6,
}

/// splitmix64's finaliser: a bijective mix with good avalanche.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of a string (FNV-1a), for keying streams by name.
pub fn hash_str(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// A keyed stream: the n-th value is `mix(key, n)`.
#[derive(Clone, Debug)]
pub struct Rng {
    key: u64,
    counter: u64,
}

impl Rng {
    pub fn new(seed: u64, purpose: Purpose, ids: &[u64]) -> Self {
        let mut key = mix64(seed ^ mix64(purpose as u64));
        for &id in ids {
            key = mix64(key ^ mix64(id));
        }
        Rng { key, counter: 0 }
    }

    /// Jump to the n-th value of the stream.
    pub fn at(mut self, counter: u64) -> Self {
        self.counter = counter;
        self
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let x = mix64(self.key ^ mix64(self.counter));
        self.counter = self.counter.wrapping_add(1);
        x
    }

    /// Uniform in [0, 1) with 53 random bits.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n) (n > 0), by rejection so there is no modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Standard normal by Box-Muller; consumes two values per call.
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]: ln is finite
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Fisher-Yates permutation of 0..n.
    pub fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            let j = self.below(i as u64 + 1) as usize;
            p.swap(i, j);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_same_stream_and_streams_differ() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7, Purpose::Init, &[1, 2]);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(7, Purpose::Init, &[1, 2]).at(2);
        assert_eq!(r.next_u64(), a[2]);
        let mut other = Rng::new(7, Purpose::Shuffle, &[1, 2]);
        assert_ne!(other.next_u64(), a[0]);
    }

    #[test]
    fn normal_has_unit_variance() {
        let mut r = Rng::new(1, Purpose::Test, &[]);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
    }

    #[test]
    fn permutation_is_a_permutation() {
        let mut p = Rng::new(3, Purpose::Shuffle, &[0]).permutation(1000);
        p.sort();
        assert!(p.iter().enumerate().all(|(i, &x)| i as u32 == x));
    }
}
