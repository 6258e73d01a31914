//! The CPU data plane on loopback, measured through the real codec and
//! sockets (and TLS sessions, when given): round-trip latency of a small
//! frame and the rate of large ones.

use super::frame::{read_frame, write_frame, Array, Frame};
use super::link::LinkStream;
use super::tls::Tls;
use super::wire::Kind;
use crate::actors::protocol::{Phase, Sent, StageMsg};
use serde::Serialize;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

#[derive(Debug, Serialize)]
pub struct TransportBench {
    /// Measured through mutual TLS sessions, as a run with --tls-* has them.
    pub tls: bool,
    /// Floats in the latency frame.
    pub small_floats: usize,
    pub round_trips: usize,
    pub rtt_median_us: f64,
    pub rtt_p99_us: f64,
    /// (frame MiB, MB/s) one way, decoded into tensors at the receiver.
    pub bandwidth: Vec<(f64, f64)>,
}

fn activation(n: usize) -> Frame {
    Frame::with(
        Kind::Stage {
            replica: 0,
            rank: 1,
            msg: StageMsg::Activation {
                phase: Phase::Train,
                step: 0,
                stage: 1,
                mb: 0,
                data: vec![],
                sent: Sent::now(),
            },
        },
        vec![Array::F32(vec![0.5; n])],
    )
}

fn pair(tls: Option<&Tls>) -> std::io::Result<(LinkStream, LinkStream)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let a = TcpStream::connect(l.local_addr()?)?;
    let (b, _) = l.accept()?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    let Some(tls) = tls else { return Ok((LinkStream::plain(a)?, LinkStream::plain(b)?)) };
    let server = tls.clone();
    let b = std::thread::spawn(move || LinkStream::over_tls(b, &server, false));
    let a = LinkStream::over_tls(a, tls, true).map_err(other)?;
    let b = b.join().map_err(|_| other("handshake thread panicked"))?.map_err(other)?;
    Ok((a, b))
}

fn other(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

pub fn transport(
    round_trips: usize,
    sizes_mib: &[f64],
    tls: Option<&Tls>,
) -> std::io::Result<TransportBench> {
    let small = 64;
    let (a, b) = pair(tls)?;
    // Echo: every frame that arrives goes straight back.
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut r = BufReader::new(b.reader);
        let mut w = BufWriter::new(b.writer);
        let mut scratch = Vec::new();
        while let Some(f) = read_frame(&mut r).map_err(other)? {
            write_frame(&mut w, &f, &mut scratch).map_err(other)?;
            w.flush()?;
        }
        Ok(())
    });
    let mut r = BufReader::new(a.reader);
    let mut w = BufWriter::new(a.writer);
    let mut scratch = Vec::new();
    let f = activation(small);
    let mut rtt = Vec::with_capacity(round_trips);
    for i in 0..round_trips + 100 {
        let t = Instant::now();
        write_frame(&mut w, &f, &mut scratch).map_err(other)?;
        w.flush()?;
        read_frame(&mut r).map_err(other)?.ok_or_else(|| other("echo closed"))?;
        if i >= 100 {
            rtt.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(w);
    a.socket.shutdown(std::net::Shutdown::Write)?;
    echo.join().map_err(|_| other("echo thread panicked"))??;
    rtt.sort_by(f64::total_cmp);
    let q = |p: f64| rtt[((rtt.len() - 1) as f64 * p).round() as usize];
    let mut bandwidth = Vec::new();
    for &mib in sizes_mib {
        let n = ((mib * (1 << 20) as f64) / 4.0) as usize;
        let frames = ((256.0 / mib).ceil() as usize).clamp(2, 64);
        let (a, b) = pair(tls)?;
        let sink = std::thread::spawn(move || -> std::io::Result<usize> {
            let mut r = BufReader::with_capacity(1 << 16, b.reader);
            let mut got = 0;
            while let Some(f) = read_frame(&mut r).map_err(other)? {
                got += f.arrays.len();
            }
            let mut w = b.writer;
            w.write_all(&[1])?;
            w.flush()?;
            Ok(got)
        });
        let f = activation(n);
        let (mut ack_from, out) = (a.reader, a.writer);
        let mut w = BufWriter::with_capacity(1 << 16, out);
        let t = Instant::now();
        for _ in 0..frames {
            write_frame(&mut w, &f, &mut scratch).map_err(other)?;
        }
        w.flush()?;
        a.socket.shutdown(std::net::Shutdown::Write)?;
        let mut ack = [0u8; 1];
        ack_from.read_exact(&mut ack)?;
        let secs = t.elapsed().as_secs_f64();
        let got = sink.join().map_err(|_| other("sink thread panicked"))??;
        if got != frames {
            return Err(other(format!("sent {frames} frames, {got} arrived")));
        }
        bandwidth.push((mib, (frames * n * 4) as f64 / secs / 1e6));
    }
    Ok(TransportBench {
        tls: tls.is_some(),
        small_floats: small,
        round_trips,
        rtt_median_us: q(0.5),
        rtt_p99_us: q(0.99),
        bandwidth,
    })
}
