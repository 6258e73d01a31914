//! The NCCL stand-in's engine between threads of one process: results of
//! every collective and of send/receive against a plain fold in rank
//! order, and each planted bug reported with the ranks and calls it
//! concerns. Chunks of 64 bytes make every call here take several steps.

use pipewright_emu::nccl::engine::{execute, Config, DeviceId, Member, Op, UniqueId};
use pipewright_emu::nccl::types::{code, DataType, RedOp};
use std::time::Duration;

fn gpu(ordinal: usize) -> DeviceId {
    DeviceId { session: "test".into(), ordinal }
}

fn config(timeout_s: f64) -> Config {
    Config { chunk_bytes: 64, timeout: Duration::from_secs_f64(timeout_s) }
}

/// Runs `f` on `n` ranks, one thread each, on GPUs 0..n; its results in rank order.
fn on_ranks<T: Send>(n: usize, cfg: Config, f: impl Fn(&Member) -> T + Sync) -> Vec<T> {
    let id = UniqueId::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (id, f) = (&id, &f);
                s.spawn(move || f(&Member::init(id, n, r, gpu(r), cfg).expect("init")))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Rank r's input: magnitudes far apart, so another order of the adds
/// gives other bits.
fn input(r: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| [1e8, 1.0, -1e8, 3.5e-3][(r + i) % 4] * (1.0 + i as f32 / 7.0)).collect()
}

#[test]
fn all_reduce_sum_is_the_fold_in_rank_order_on_2_3_and_4_ranks() {
    for n in [2, 3, 4] {
        let count = 37;
        let expected: Vec<f32> =
            (0..count).map(|i| (1..n).fold(input(0, count)[i], |acc, r| acc + input(r, count)[i])).collect();
        let results = on_ranks(n, config(20.0), |m| {
            let send = bytes_f32(&input(m.rank, count));
            let mut recv = vec![0u8; send.len()];
            m.run(&[Op::all_reduce(&send, &mut recv, DataType::F32, RedOp::Sum)]).unwrap();
            f32s(&recv)
        });
        for (r, got) in results.iter().enumerate() {
            assert_eq!(bits(got), bits(&expected), "{n} ranks, rank {r}");
        }
    }
}

#[test]
fn prod_max_min_and_avg_follow_nccls_definitions() {
    let n = 3;
    let vals = |r: usize| -> Vec<i32> { vec![r as i32 + 2, -(r as i32) * 5, 7 - r as i32 * 4] };
    let results = on_ranks(n, config(20.0), |m| {
        let mut out = vec![];
        for op in [RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg] {
            let send: Vec<u8> = vals(m.rank).iter().flat_map(|x| x.to_ne_bytes()).collect();
            let mut recv = vec![0u8; send.len()];
            m.run(&[Op::all_reduce(&send, &mut recv, DataType::I32, op)]).unwrap();
            out.push(
                recv.chunks_exact(4).map(|c| i32::from_ne_bytes(c.try_into().unwrap())).collect::<Vec<_>>(),
            );
        }
        let send = bytes_f32(&[1.0, 3.0]);
        let mut recv = vec![0u8; 8];
        m.run(&[Op::all_reduce(&send, &mut recv, DataType::F32, RedOp::Avg)]).unwrap();
        (out, f32s(&recv))
    });
    for (ints, avg) in results {
        // Inputs per element: [2, 3, 4], [0, -5, -10], [7, 3, -1].
        assert_eq!(ints[0], vec![24, 0, -21]);
        assert_eq!(ints[1], vec![4, 0, 7]);
        assert_eq!(ints[2], vec![2, -10, -1]);
        // Integer average: the sum divided after, toward zero (-15 / 3, 9 / 3).
        assert_eq!(ints[3], vec![3, -5, 3]);
        // Float average: each value times 1/3 first, then summed.
        let third = 1.0f32 / 3.0;
        let pre = (1.0 * third + 1.0 * third) + 1.0 * third;
        assert_eq!(bits(&avg), bits(&[pre, (3.0 * third + 3.0 * third) + 3.0 * third]));
    }
}

#[test]
fn one_value_summed_with_negative_zero_fills_keeps_its_exact_bits() {
    // As the backend sums a split tensor: each element is owned by one rank,
    // the others hold -0.0; an all -0.0 element must stay -0.0.
    let n = 4;
    let count = 41;
    let owned = |i: usize| if i % 5 == 4 { -0.0f32 } else { (i as f32 + 0.1).sin() * 1e-3 };
    let results = on_ranks(n, config(20.0), |m| {
        let mut buf =
            bytes_f32(&(0..count).map(|i| if i % n == m.rank { owned(i) } else { -0.0 }).collect::<Vec<_>>());
        m.run(&[Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum)]).unwrap();
        f32s(&buf)
    });
    let expected: Vec<f32> = (0..count).map(owned).collect();
    for got in results {
        assert_eq!(bits(&got), bits(&expected));
        assert!(got[4].is_sign_negative() && got[4] == 0.0);
    }
}

#[test]
fn bf16_sums_round_to_bf16_after_every_addition() {
    // 1 + 2^-8 is a tie in bf16 (8 significant bits) and rounds to even, 1.0;
    // so does the second addition. Rounding once at the end would give 1 + 2^-7.
    let values = [1.0f32, 2f32.powi(-8), 2f32.powi(-8)];
    let results = on_ranks(3, config(20.0), |m| {
        let mut buf = half::bf16::from_f32(values[m.rank]).to_ne_bytes().to_vec();
        m.run(&[Op::all_reduce_in_place(&mut buf, DataType::Bf16, RedOp::Sum)]).unwrap();
        half::bf16::from_ne_bytes([buf[0], buf[1]]).to_f32()
    });
    assert_eq!(results, vec![1.0; 3]);
}

#[test]
fn reduce_writes_the_root_only_and_leaves_the_others_as_they_were() {
    let n = 3;
    let count = 30;
    let results = on_ranks(n, config(20.0), |m| {
        let mut buf = bytes_f32(&input(m.rank, count));
        m.run(&[Op::reduce_in_place(&mut buf, DataType::F32, RedOp::Sum, 1)]).unwrap();
        f32s(&buf)
    });
    let sum: Vec<f32> =
        (0..count).map(|i| (input(0, count)[i] + input(1, count)[i]) + input(2, count)[i]).collect();
    assert_eq!(bits(&results[1]), bits(&sum));
    assert_eq!(bits(&results[0]), bits(&input(0, count)));
    assert_eq!(bits(&results[2]), bits(&input(2, count)));
}

#[test]
fn broadcast_copies_the_roots_elements_to_every_rank() {
    let n = 4;
    let count = 100;
    let results = on_ranks(n, config(20.0), |m| {
        let mut buf = bytes_f32(&input(m.rank, count));
        m.run(&[Op::broadcast_in_place(&mut buf, DataType::F32, 2)]).unwrap();
        let mut separate = vec![0u8; count * 4];
        let mine = bytes_f32(&input(m.rank, count));
        let send = (m.rank == 3).then_some(&mine[..]);
        m.run(&[Op::broadcast(send, &mut separate, DataType::F32, 3)]).unwrap();
        (f32s(&buf), f32s(&separate))
    });
    for (in_place, separate) in results {
        assert_eq!(bits(&in_place), bits(&input(2, count)));
        assert_eq!(bits(&separate), bits(&input(3, count)));
    }
}

#[test]
fn all_gather_puts_every_ranks_elements_in_rank_order_in_place_or_not() {
    let n = 3;
    let count = 21;
    let results = on_ranks(n, config(20.0), |m| {
        let send = bytes_f32(&input(m.rank, count));
        let mut recv = vec![0u8; n * send.len()];
        m.run(&[Op::all_gather(&send, &mut recv, DataType::F32)]).unwrap();
        // In place, as the backend's tensor-parallel gather does: each rank's
        // slot already holds its piece, the rest is garbage.
        let mut buf = vec![0xAAu8; n * send.len()];
        buf[m.rank * send.len()..][..send.len()].copy_from_slice(&send);
        m.run(&[Op::all_gather_in_place(&mut buf, count, DataType::F32)]).unwrap();
        (f32s(&recv), f32s(&buf))
    });
    let expected: Vec<f32> = (0..n).flat_map(|r| input(r, count)).collect();
    for (separate, in_place) in results {
        assert_eq!(bits(&separate), bits(&expected));
        assert_eq!(bits(&in_place), bits(&expected));
    }
}

#[test]
fn sends_and_receives_around_a_ring_in_one_group_arrive_intact() {
    // Each rank sends to the next and receives from the previous in one
    // group: neither call may wait for the other to finish first.
    for n in [2, 3, 4] {
        let count = 50;
        let results = on_ranks(n, config(20.0), |m| {
            let send = bytes_f32(&input(m.rank, count));
            let mut recv = vec![0u8; send.len()];
            let (next, prev) = ((m.rank + 1) % n, (m.rank + n - 1) % n);
            m.run(&[Op::send(&send, DataType::F32, next), Op::recv(&mut recv, DataType::F32, prev)]).unwrap();
            f32s(&recv)
        });
        for (r, got) in results.iter().enumerate() {
            assert_eq!(bits(got), bits(&input((r + n - 1) % n, count)), "{n} ranks, rank {r}");
        }
    }
}

#[test]
fn one_thread_drives_every_rank_of_a_group_without_blocking_on_its_peers() {
    // ncclCommInitAll and a grouped collective from one thread, as a
    // tensor-parallel stage does: join all ranks first, then run the group's
    // calls together.
    let n = 3;
    let count = 33;
    let id = UniqueId::new();
    let members: Vec<Member> =
        (0..n).map(|r| Member::join(&id, n, r, gpu(r), config(20.0)).unwrap()).collect();
    for m in &members {
        m.wait_for_all().unwrap();
    }
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|r| bytes_f32(&input(r, count))).collect();
    let ops: Vec<Op> =
        bufs.iter_mut().map(|b| Op::all_reduce_in_place(b, DataType::F32, RedOp::Max)).collect();
    let items: Vec<_> = members.iter().zip(&ops).map(|(m, o)| (m, m.stamp(o).unwrap())).collect();
    // SAFETY: the buffers live until after execute returns.
    unsafe { execute(&items) }.unwrap();
    drop(ops);
    let expected: Vec<f32> =
        (0..count).map(|i| (0..n).map(|r| input(r, count)[i]).fold(f32::MIN, f32::max)).collect();
    for b in &bufs {
        assert_eq!(bits(&f32s(b)), bits(&expected));
    }
}

#[test]
fn two_ranks_on_one_gpu_are_refused_naming_both() {
    let id = UniqueId::new();
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let id = &id;
                s.spawn(move || {
                    Member::init(id, 2, r, gpu(7), config(20.0)).err().expect("refused").to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("ranks 0 (pid") && e.contains("and 1 (pid") && e.contains("GPU 7"), "{e}");
        assert!(e.contains(&format!("(code {})", code::INVALID_USAGE)), "{e}");
    }
}

#[test]
fn a_rank_joining_twice_is_refused() {
    let id = UniqueId::new();
    let first = Member::join(&id, 2, 1, gpu(0), config(20.0)).unwrap();
    let again = Member::join(&id, 2, 1, gpu(1), config(20.0)).err().expect("refused").to_string();
    assert!(again.contains("rank 1 of 2 joined twice"), "{again}");
    drop(first);
}

#[test]
fn ranks_issuing_different_collectives_are_each_named_with_their_call() {
    let results = on_ranks(2, config(20.0), |m| {
        let mut buf = bytes_f32(&[1.0; 10]);
        let op = if m.rank == 0 {
            Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum)
        } else {
            Op::broadcast_in_place(&mut buf, DataType::F32, 0)
        };
        let err = m.run(&[op]).unwrap_err();
        // The communicator is broken for every later call too.
        let later = m.run(&[Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum)]).unwrap_err();
        (err.to_string(), later.to_string())
    });
    for (err, later) in results {
        assert!(err.contains("rank 0: ncclAllReduce #1 (10 x float32, sum)"), "{err}");
        assert!(err.contains("rank 1: ncclBroadcast #1 (10 x float32, root 0)"), "{err}");
        assert!(later.contains("failed earlier") && later.contains("ncclBroadcast #1"), "{later}");
    }
}

#[test]
fn mismatched_counts_of_one_collective_are_reported() {
    let results = on_ranks(3, config(20.0), |m| {
        // Two good calls first, so the mismatch is collective #3.
        let mut ok = bytes_f32(&[2.0; 4]);
        m.run(&[Op::all_reduce_in_place(&mut ok, DataType::F32, RedOp::Sum)]).unwrap();
        m.run(&[Op::broadcast_in_place(&mut ok, DataType::F32, 0)]).unwrap();
        let mut buf = bytes_f32(&vec![1.0; if m.rank == 2 { 12 } else { 10 }]);
        m.run(&[Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum)]).unwrap_err().to_string()
    });
    for err in results {
        assert!(err.contains("collective #3"), "{err}");
        assert!(err.contains("rank 1: ncclAllReduce #3 (10 x float32, sum)"), "{err}");
        assert!(err.contains("rank 2: ncclAllReduce #3 (12 x float32, sum)"), "{err}");
    }
}

#[test]
fn a_send_and_receive_of_different_counts_are_refused_naming_both() {
    let results = on_ranks(2, config(20.0), |m| {
        if m.rank == 0 {
            let buf = bytes_f32(&[1.0; 10]);
            m.run(&[Op::send(&buf, DataType::F32, 1)]).unwrap_err().to_string()
        } else {
            let mut buf = bytes_f32(&[0.0; 12]);
            m.run(&[Op::recv(&mut buf, DataType::F32, 0)]).unwrap_err().to_string()
        }
    });
    for err in results {
        assert!(
            err.contains("rank 0's ncclSend #1 to rank 1 (10 x float32) meets rank 1's ncclRecv #1 from rank 0 (12 x float32)"),
            "{err}"
        );
    }
}

#[test]
fn a_deadlock_names_what_every_rank_waits_for() {
    // Rank 1 does one all-reduce with the others, then sends to rank 0
    // while ranks 0 and 2 wait in an all-gather: nobody can move.
    let results = on_ranks(3, config(1.5), |m| {
        let mut buf = bytes_f32(&[1.0; 4]);
        m.run(&[Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum)]).unwrap();
        let send = bytes_f32(&[1.0; 4]);
        let mut recv = vec![0u8; 3 * send.len()];
        let started = std::time::Instant::now();
        let err = if m.rank == 1 {
            m.run(&[Op::send(&send, DataType::F32, 0)])
        } else {
            m.run(&[Op::all_gather(&send, &mut recv, DataType::F32)])
        };
        (err.unwrap_err().to_string(), started.elapsed())
    });
    for (err, took) in results {
        assert!(err.contains("deadlock: no progress for 1.5s (PW_EMU_NCCL_TIMEOUT_S)"), "{err}");
        assert!(
            err.contains("rank 0: waiting in ncclAllGather #2 (4 x float32 from each rank) for ranks [1]"),
            "{err}"
        );
        assert!(
            err.contains("rank 1: waiting in ncclSend #1 to rank 0 (4 x float32) for ranks [0]"),
            "{err}"
        );
        assert!(
            err.contains("rank 2: waiting in ncclAllGather #2 (4 x float32 from each rank) for ranks [1]"),
            "{err}"
        );
        assert!(took < Duration::from_secs(10), "took {took:?}");
    }
}

#[test]
fn a_deadlock_report_tells_a_rank_that_finished_from_one_that_never_called() {
    // Rank 0 sends to rank 1 and stops; rank 1 receives, then waits in an
    // all-reduce that rank 0 (finished) and rank 2 (never called) never join.
    let results = on_ranks(3, config(1.0), |m| {
        let mut buf = bytes_f32(&[1.0; 4]);
        match m.rank {
            0 => m.run(&[Op::send(&buf, DataType::F32, 1)]).unwrap(),
            1 => {
                m.run(&[Op::recv(&mut buf, DataType::F32, 0)]).unwrap();
                let all_reduce = Op::all_reduce_in_place(&mut buf, DataType::F32, RedOp::Sum);
                return m.run(&[all_reduce]).unwrap_err().to_string();
            }
            _ => {}
        }
        // Ranks 0 and 2 stay joined until rank 1 gave up.
        std::thread::sleep(Duration::from_millis(2500));
        String::new()
    });
    let err = &results[1];
    assert!(err.contains("rank 0: last call ncclSend #1 to rank 1 (4 x float32), finished"), "{err}");
    assert!(err.contains("rank 1: waiting in ncclAllReduce #1 (4 x float32, sum) for ranks [0, 2]"), "{err}");
    assert!(err.contains("rank 2: no call yet"), "{err}");
}

#[test]
fn a_root_or_peer_outside_the_communicator_is_refused_before_anything_is_numbered() {
    let results = on_ranks(2, config(20.0), |m| {
        let mut buf = bytes_f32(&[1.0; 3]);
        let bad = m.run(&[Op::broadcast_in_place(&mut buf, DataType::F32, 2)]).unwrap_err();
        let bad_peer = m.run(&[Op::send(&[0u8; 4], DataType::F32, 5)]).unwrap_err();
        // The refused calls took no number: the next broadcast is #1 on both ranks and works.
        m.run(&[Op::broadcast_in_place(&mut buf, DataType::F32, 1)]).unwrap();
        (bad, bad_peer)
    });
    for (bad, bad_peer) in results {
        assert_eq!(bad.code, code::INVALID_ARGUMENT);
        assert!(
            bad.message.contains("ncclBroadcast") && bad.message.contains("root 2 is not a rank (0..2)"),
            "{bad}"
        );
        assert!(
            bad_peer.message.contains("ncclSend") && bad_peer.message.contains("peer 5 is not a rank"),
            "{bad_peer}"
        );
    }
}

#[test]
fn a_buffer_of_the_wrong_length_is_refused_naming_it() {
    let results = on_ranks(2, config(20.0), |m| {
        let send = bytes_f32(&[1.0; 3]);
        let mut recv = vec![0u8; 5 * 4];
        m.run(&[Op::all_gather(&send, &mut recv, DataType::F32)]).unwrap_err().to_string()
    });
    for e in results {
        assert!(e.contains("recvbuff holds 20 bytes, the call needs exactly 24"), "{e}");
    }
}

#[test]
fn several_collectives_of_one_communicator_in_one_group_run_in_the_order_issued() {
    let n = 2;
    let count = 24;
    let results = on_ranks(n, config(20.0), |m| {
        let mut summed = bytes_f32(&input(m.rank, count));
        let mut broadcast = bytes_f32(&input(m.rank, count));
        let mine = bytes_f32(&input(m.rank, count));
        let mut gathered = vec![0u8; n * mine.len()];
        m.run(&[
            Op::all_reduce_in_place(&mut summed, DataType::F32, RedOp::Sum),
            Op::broadcast_in_place(&mut broadcast, DataType::F32, 1),
            Op::all_gather(&mine, &mut gathered, DataType::F32),
        ])
        .unwrap();
        (f32s(&summed), f32s(&broadcast), f32s(&gathered))
    });
    let sum: Vec<f32> = (0..count).map(|i| input(0, count)[i] + input(1, count)[i]).collect();
    let all: Vec<f32> = (0..n).flat_map(|r| input(r, count)).collect();
    for (summed, broadcast, gathered) in results {
        assert_eq!(bits(&summed), bits(&sum));
        assert_eq!(bits(&broadcast), bits(&input(1, count)));
        assert_eq!(bits(&gathered), bits(&all));
    }
}

#[test]
fn two_sends_to_one_peer_in_one_group_arrive_in_the_order_issued() {
    let count = 20;
    let results = on_ranks(2, config(20.0), |m| {
        let (first, second) = (bytes_f32(&input(0, count)), bytes_f32(&input(1, count)));
        let (mut a, mut b) = (vec![0u8; first.len()], vec![0u8; second.len()]);
        if m.rank == 0 {
            m.run(&[Op::send(&first, DataType::F32, 1), Op::send(&second, DataType::F32, 1)]).unwrap();
        } else {
            m.run(&[Op::recv(&mut a, DataType::F32, 0), Op::recv(&mut b, DataType::F32, 0)]).unwrap();
        }
        (f32s(&a), f32s(&b))
    });
    assert_eq!(bits(&results[1].0), bits(&input(0, count)));
    assert_eq!(bits(&results[1].1), bits(&input(1, count)));
}

#[test]
fn a_collective_run_before_an_earlier_one_of_its_rank_is_refused() {
    // Collectives #1 and #2 issued on (emulated) unordered streams, and #2's
    // stream gets there first.
    let m = Member::init(&UniqueId::new(), 1, 0, gpu(0), config(20.0)).unwrap();
    let (mut a, mut b) = (bytes_f32(&[1.0; 4]), bytes_f32(&[2.0; 4]));
    let (first, second) = (
        Op::all_reduce_in_place(&mut a, DataType::F32, RedOp::Sum),
        Op::broadcast_in_place(&mut b, DataType::F32, 0),
    );
    let (_one, two) = (m.stamp(&first).unwrap(), m.stamp(&second).unwrap());
    // SAFETY: the buffers outlive the call.
    let err = unsafe { execute(&[(&m, two)]) }.unwrap_err();
    assert_eq!(err.code, code::INVALID_USAGE);
    assert!(
        err.message.contains(
            "rank 0: ncclBroadcast #2 (4 x float32, root 0) started before its collective #1 finished"
        ),
        "{err}"
    );
    assert!(m.failure().is_some_and(|f| f.contains("ncclBroadcast #2")), "the communicator is failed");
}
