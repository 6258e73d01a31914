//! The CPU data plane's framing: a fixed prefix, a bincode 2 header that says
//! what the message is and how long each tensor is, then the tensors as raw
//! little-endian bytes.
//!
//! ```text
//! "PWF1" | header_len: u32 LE | payload_len: u64 LE | header (bincode) | payload
//! ```
//!
//! Decoding trusts nothing: lengths are capped before anything is allocated,
//! the payload buffer grows only as bytes actually arrive, the header's array
//! lengths must add up to the payload, and every failure is a `FrameError`,
//! never a panic.

use super::wire::Kind;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};

pub const MAGIC: [u8; 4] = *b"PWF1";
const PREFIX: usize = 16;
/// Headers carry names, shapes and trace records, never tensors.
pub const MAX_HEADER: u32 = 64 << 20;
/// The largest payload one frame may carry (a GPT-2 124M gradient set is ~0.5 GiB).
pub const MAX_PAYLOAD: u64 = 8 << 30;
/// Reads grow the payload buffer by at most this much at a time.
const CHUNK: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    // No #[from]: it would make the io::Error this error's source as well, and
    // `{:#}` would print the OS message twice.
    #[error("i/o: {0}")]
    Io(std::io::Error),
    #[error("bad magic {0:02x?} (not a pipewright data link, or out of step)")]
    Magic([u8; 4]),
    #[error("header of {0} bytes exceeds the cap of {MAX_HEADER}")]
    HeaderTooLong(u32),
    #[error("payload of {0} bytes exceeds the cap of {MAX_PAYLOAD}")]
    PayloadTooLong(u64),
    #[error("undecodable header: {0}")]
    Header(String),
    #[error("header has {0} trailing bytes")]
    Trailing(usize),
    #[error("arrays in the header need {need} payload bytes, the frame has {have}")]
    Lengths { need: u64, have: u64 },
    #[error("the stream ended inside a frame")]
    Truncated,
}

impl From<std::io::Error> for FrameError {
    fn from(e: std::io::Error) -> Self {
        FrameError::Io(e)
    }
}

/// Element type of one array in the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Elem {
    F32,
    U32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub kind: Kind,
    /// (element type, element count) of each array, in payload order.
    pub arrays: Vec<(Elem, u64)>,
}

/// One tensor of a frame's payload.
pub use crate::actors::protocol::Array;

fn info(a: &Array) -> (Elem, u64) {
    match a {
        Array::F32(v) => (Elem::F32, v.len() as u64),
        Array::U32(v) => (Elem::U32, v.len() as u64),
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub kind: Kind,
    pub arrays: Vec<Array>,
}

impl Frame {
    pub fn new(kind: Kind) -> Frame {
        Frame { kind, arrays: Vec::new() }
    }

    pub fn with(kind: Kind, arrays: Vec<Array>) -> Frame {
        Frame { kind, arrays }
    }
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ MAX_HEADER as usize }>()
}

/// Writes one frame; `scratch` is reused between calls to avoid reallocating.
pub fn write_frame(w: &mut impl Write, frame: &Frame, scratch: &mut Vec<u8>) -> Result<(), FrameError> {
    let header = Header { kind: frame.kind.clone(), arrays: frame.arrays.iter().map(info).collect() };
    let head =
        bincode::serde::encode_to_vec(&header, config()).map_err(|e| FrameError::Header(e.to_string()))?;
    let payload: u64 = header.arrays.iter().map(|(_, n)| 4 * n).sum();
    if head.len() as u64 > MAX_HEADER as u64 {
        return Err(FrameError::HeaderTooLong(head.len() as u32));
    }
    if payload > MAX_PAYLOAD {
        return Err(FrameError::PayloadTooLong(payload));
    }
    let mut prefix = [0u8; PREFIX];
    prefix[..4].copy_from_slice(&MAGIC);
    prefix[4..8].copy_from_slice(&(head.len() as u32).to_le_bytes());
    prefix[8..].copy_from_slice(&payload.to_le_bytes());
    w.write_all(&prefix)?;
    w.write_all(&head)?;
    // Converted a block at a time, so the bytes being written stay in cache.
    const BLOCK: usize = 1 << 14;
    for a in &frame.arrays {
        match a {
            Array::F32(v) => {
                for block in v.chunks(BLOCK) {
                    scratch.clear();
                    block.iter().for_each(|x| scratch.extend_from_slice(&x.to_le_bytes()));
                    w.write_all(scratch)?;
                }
            }
            Array::U32(v) => {
                for block in v.chunks(BLOCK) {
                    scratch.clear();
                    block.iter().for_each(|x| scratch.extend_from_slice(&x.to_le_bytes()));
                    w.write_all(scratch)?;
                }
            }
        }
    }
    Ok(())
}

/// Reads `n` bytes, growing the buffer only as they arrive: a lying length
/// costs the liar the bytes, not this process the memory.
fn read_bounded(r: &mut impl Read, n: u64, buf: &mut Vec<u8>) -> Result<(), FrameError> {
    buf.clear();
    let mut left = n;
    while left > 0 {
        let take = left.min(CHUNK as u64) as usize;
        let at = buf.len();
        buf.resize(at + take, 0);
        r.read_exact(&mut buf[at..]).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            _ => FrameError::Io(e),
        })?;
        left -= take as u64;
    }
    Ok(())
}

/// Reads one frame. `Ok(None)`: the peer closed the stream between frames.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, FrameError> {
    let mut prefix = [0u8; PREFIX];
    let mut got = 0;
    while got < PREFIX {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            // A short answer that is not ours (a TLS alert, say) says more by
            // its first bytes than by being short.
            Ok(0) if got >= 4 && prefix[..4] != MAGIC => {
                return Err(FrameError::Magic(prefix[..4].try_into().expect("4 bytes")))
            }
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let magic: [u8; 4] = prefix[..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(FrameError::Magic(magic));
    }
    let head_len = u32::from_le_bytes(prefix[4..8].try_into().expect("4 bytes"));
    let payload_len = u64::from_le_bytes(prefix[8..].try_into().expect("8 bytes"));
    if head_len > MAX_HEADER {
        return Err(FrameError::HeaderTooLong(head_len));
    }
    if payload_len > MAX_PAYLOAD {
        return Err(FrameError::PayloadTooLong(payload_len));
    }
    let mut head = Vec::new();
    read_bounded(r, head_len as u64, &mut head)?;
    let (header, used): (Header, usize) =
        bincode::serde::decode_from_slice(&head, config()).map_err(|e| FrameError::Header(e.to_string()))?;
    if used != head.len() {
        return Err(FrameError::Trailing(head.len() - used));
    }
    let need = header
        .arrays
        .iter()
        .try_fold(0u64, |acc, (_, n)| n.checked_mul(4).and_then(|b| acc.checked_add(b)))
        .unwrap_or(u64::MAX);
    if need != payload_len {
        return Err(FrameError::Lengths { need, have: payload_len });
    }
    // Each array is read a chunk at a time straight into its tensor: memory
    // grows only as bytes arrive, and no second copy of the payload exists.
    let mut arrays = Vec::with_capacity(header.arrays.len().min(1 << 16));
    let mut buf = Vec::new();
    for (elem, n) in header.arrays {
        // Reserve up front only what a modest frame needs; a larger claimed
        // length must be backed by bytes before memory follows it.
        let reserve = (n as usize).min(1 << 24);
        let (mut f, mut u) = match elem {
            Elem::F32 => (Vec::with_capacity(reserve), Vec::new()),
            Elem::U32 => (Vec::new(), Vec::with_capacity(reserve)),
        };
        let mut left = 4 * n;
        while left > 0 {
            let take = left.min(CHUNK as u64);
            read_bounded(r, take, &mut buf)?;
            let words = buf.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
            match elem {
                Elem::F32 => f.extend(words.map(f32::from_le_bytes)),
                Elem::U32 => u.extend(words.map(u32::from_le_bytes)),
            }
            left -= take;
        }
        arrays.push(match elem {
            Elem::F32 => Array::F32(f),
            Elem::U32 => Array::U32(u),
        });
    }
    Ok(Some(Frame { kind: header.kind, arrays }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::protocol::{Phase, Sent, StageMsg};
    use crate::cluster::wire::Kind;
    use crate::rng::{Purpose, Rng};

    fn sample() -> Frame {
        Frame::with(
            Kind::Stage {
                replica: 1,
                rank: 2,
                msg: StageMsg::Activation {
                    phase: Phase::Train,
                    step: 7,
                    stage: 3,
                    mb: 5,
                    data: vec![],
                    sent: Sent::now(),
                },
            },
            vec![
                Array::F32(vec![1.5, -0.0, f32::NAN, f32::MIN_POSITIVE, 3.25e-39]),
                Array::U32(vec![7, 0, u32::MAX]),
            ],
        )
    }

    fn encode(f: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        write_frame(&mut out, f, &mut Vec::new()).unwrap();
        out
    }

    #[test]
    fn round_trip_keeps_every_bit() {
        let f = sample();
        let bytes = encode(&f);
        let back = read_frame(&mut bytes.as_slice()).unwrap().unwrap();
        assert_eq!(back.kind, f.kind);
        let (Array::F32(a), Array::F32(b)) = (&back.arrays[0], &f.arrays[0]) else { panic!("f32 array") };
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(back.arrays[1], f.arrays[1]);
    }

    #[test]
    fn clean_end_between_frames_is_none_and_inside_a_frame_is_an_error() {
        assert!(read_frame(&mut [].as_slice()).unwrap().is_none());
        let bytes = encode(&sample());
        for cut in 1..bytes.len() {
            let r = read_frame(&mut &bytes[..cut]);
            assert!(matches!(r, Err(FrameError::Truncated)), "cut at {cut}: {r:?}");
        }
    }

    #[test]
    fn huge_lengths_are_refused_before_allocating() {
        let mut bytes = encode(&sample());
        bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(read_frame(&mut bytes.as_slice()), Err(FrameError::PayloadTooLong(_))));
        let mut bytes = encode(&sample());
        bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(read_frame(&mut bytes.as_slice()), Err(FrameError::HeaderTooLong(_))));
        // A plausible length with no bytes behind it: the reader fails when
        // the stream ends, having allocated at most one chunk.
        let mut bytes = encode(&Frame::new(Kind::Shutdown));
        bytes[8..16].copy_from_slice(&(1u64 << 32).to_le_bytes());
        assert!(read_frame(&mut bytes.as_slice()).is_err());
    }

    #[test]
    fn array_lengths_must_match_the_payload() {
        let mut bytes = encode(&sample());
        let payload = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
        bytes[8..16].copy_from_slice(&(payload - 4).to_le_bytes());
        assert!(matches!(read_frame(&mut bytes.as_slice()), Err(FrameError::Lengths { .. })));
    }

    #[test]
    fn random_bytes_and_mutations_never_panic() {
        let mut rng = Rng::new(8, Purpose::Test, &[0xf]);
        let good = encode(&sample());
        for i in 0..20_000u64 {
            let mut bytes = if i % 2 == 0 {
                let mut b = good.clone();
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(b.len() as u64) as usize;
                    b[at] = rng.below(256) as u8;
                }
                b
            } else {
                let n = rng.below(64) as usize;
                let mut b: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
                if i % 4 == 1 && b.len() >= 4 {
                    b[..4].copy_from_slice(&MAGIC);
                }
                b
            };
            if i % 3 == 0 {
                let n = rng.below(bytes.len() as u64 + 1) as usize;
                bytes.truncate(n);
            }
            let mut r = bytes.as_slice();
            // Decode until the stream ends or refuses: any result but a panic is fine.
            for _ in 0..4 {
                match read_frame(&mut r) {
                    Ok(Some(_)) => {}
                    _ => break,
                }
            }
        }
    }
}
