//! The schedule module's specification: every builder validates and matches the
//! theory, the validator and simulator catch what they promise to.

use super::*;

const PS: [usize; 5] = [1, 2, 3, 4, 8];

fn built(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Schedule {
    let s = build(kind, p, m, v).unwrap_or_else(|e| panic!("{kind} p={p} m={m} v={v}: {e}"));
    s.validate().unwrap_or_else(|e| panic!("{kind} p={p} m={m} v={v}: {e}"));
    s
}

fn sim(s: &Schedule) -> SimReport {
    s.simulate(&Costs::unit())
        .unwrap_or_else(|e| panic!("{} p={} m={} v={}: {e}", s.kind, s.ranks, s.microbatches, s.chunks))
}

/// Every shape each builder accepts, as (schedule, report).
fn all_single_chunk(kind: ScheduleKind) -> Vec<(Schedule, SimReport)> {
    let mut out = vec![];
    for p in PS {
        for m in 1..=16 {
            let s = built(kind, p, m, 1);
            let r = sim(&s);
            out.push((s, r));
        }
    }
    out
}

/// Each stage's actions of `kind`, by microbatch, in the order the stage runs them.
fn order_of(s: &Schedule, stage: usize, kind: ActionKind) -> Vec<usize> {
    s.actions[s.rank_of(stage)].iter().filter(|a| a.stage == stage && a.kind == kind).map(|a| a.mb).collect()
}

fn assert_ascending(s: &Schedule) {
    for stage in 0..s.stages() {
        for kind in [ActionKind::F, ActionKind::B, ActionKind::I, ActionKind::W] {
            let o = order_of(s, stage, kind);
            assert!(
                o.windows(2).all(|w| w[0] < w[1]),
                "{} p={} m={}: stage {stage} {kind}s out of microbatch order: {o:?}",
                s.kind,
                s.ranks,
                s.microbatches
            );
        }
    }
}

#[test]
fn gpipe_and_1f1b_bubble_is_the_theory_exactly() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for (s, r) in all_single_chunk(kind) {
            let (p, m) = (s.ranks as f64, s.microbatches as f64);
            let theory = (p - 1.0) / (m + p - 1.0);
            assert_eq!(r.makespan, 3.0 * (m + p - 1.0), "{kind} p={p} m={m}");
            for b in r.bubble_frac.iter().chain([&r.mean_bubble_frac]) {
                assert!((b - theory).abs() < 1e-12, "{kind} p={p} m={m}: bubble {b} vs {theory}");
            }
            assert_eq!(s.theory_bubble(), Some(theory));
            assert_ascending(&s);
        }
    }
}

#[test]
fn peak_live_is_m_for_gpipe_and_p_minus_s_for_1f1b() {
    for (s, r) in all_single_chunk(ScheduleKind::GPipe) {
        assert_eq!(r.peak_live, vec![s.microbatches; s.ranks]);
    }
    for (s, r) in all_single_chunk(ScheduleKind::OneFOneB) {
        let want: Vec<usize> = (0..s.ranks).map(|st| (s.ranks - st).min(s.microbatches)).collect();
        assert_eq!(r.peak_live, want, "p={} m={}", s.ranks, s.microbatches);
    }
}

/// Idle time of each rank (makespan − busy): what the zero-bubble paper calls the
/// bubble. As a fraction of a shorter makespan it would look bigger than a third.
fn bubble_time(r: &SimReport) -> Vec<f64> {
    r.busy.iter().map(|b| r.makespan - b).collect()
}

/// The paper's claim, for the shapes it is made for (m ≥ p): each rank idles at
/// most a third of what it idles under 1F1B (the slack is rounding: it is exactly a
/// third with unit costs), and no stage holds more microbatches alive (F done, W
/// not) than 1F1B's fullest stage, p on stage 0.
#[test]
fn zb_h1_bubble_is_a_third_of_1f1b_at_1f1b_peak_memory() {
    for p in [2, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            let zb = sim(&built(ScheduleKind::ZbH1, p, m, 1));
            let one = sim(&built(ScheduleKind::OneFOneB, p, m, 1));
            for (rank, (z, o)) in bubble_time(&zb).iter().zip(bubble_time(&one)).enumerate() {
                assert!(*z <= o / 3.0 + 1e-9, "p={p} m={m} rank {rank}: idle {z} vs 1f1b {o}");
            }
            let peak_1f1b = *one.peak_live.iter().max().unwrap();
            assert_eq!(peak_1f1b, p);
            for (stage, &z) in zb.peak_live.iter().enumerate() {
                assert!(z <= peak_1f1b, "p={p} m={m} stage {stage}: {z} alive, 1f1b's peak is {peak_1f1b}");
            }
        }
    }
}

/// Every shape: the makespan is the bound in `Schedule::theory_bubble` (so nothing
/// shorter exists at unit costs), memory never exceeds 1F1B's peak, and the
/// backward is always split, in microbatch order.
#[test]
fn zb_h1_meets_its_lower_bound_for_every_shape() {
    for (s, r) in all_single_chunk(ScheduleKind::ZbH1) {
        let (p, m) = (s.ranks, s.microbatches);
        let (pf, mf) = (p as f64, m as f64);
        let bound = (3.0 * mf + pf - 1.0).max(2.0 * mf + 2.0 * pf - 1.0);
        assert_eq!(r.makespan, bound, "p={p} m={m}");
        let theory = s.theory_bubble().unwrap();
        assert!(
            (r.mean_bubble_frac - theory).abs() < 1e-12,
            "p={p} m={m}: {} vs {theory}",
            r.mean_bubble_frac
        );
        assert!(r.peak_live.iter().all(|&z| z <= p.min(m)), "p={p} m={m}: {:?}", r.peak_live);
        let base = sim(&built(ScheduleKind::OneFOneB, p, m, 1));
        assert!(r.mean_bubble_frac <= base.mean_bubble_frac + 1e-12, "p={p} m={m}");
        assert!(s.actions.iter().flatten().all(|a| a.kind != ActionKind::B));
        assert_ascending(&s);
    }
}

#[test]
fn interleaved_follows_megatron_and_beats_1f1b() {
    for p in PS {
        for v in [2, 3, 4] {
            for m in (1..=16).filter(|m| m % p == 0) {
                let s = built(ScheduleKind::Interleaved1F1B, p, m, v);
                let r = sim(&s);
                assert_ascending(&s);
                let (pf, mf, vf) = (p as f64, m as f64, v as f64);
                assert!(
                    r.mean_bubble_frac <= (pf - 1.0) / (vf * mf) + 0.02,
                    "p={p} m={m} v={v}: bubble {} vs theory {}",
                    r.mean_bubble_frac,
                    (pf - 1.0) / (vf * mf)
                );
                let base = sim(&built(ScheduleKind::OneFOneB, p, m, 1));
                if p > 1 {
                    assert!(
                        r.mean_bubble_frac < base.mean_bubble_frac,
                        "p={p} m={m} v={v}: {} vs 1f1b {}",
                        r.mean_bubble_frac,
                        base.mean_bubble_frac
                    );
                }
            }
        }
    }
}

#[test]
fn interleaved_refuses_what_megatron_refuses() {
    let e = build(ScheduleKind::Interleaved1F1B, 4, 6, 2).unwrap_err();
    assert!(
        matches!(&e, ScheduleError::Unsupported { field, .. } if field == "parallel.microbatches"),
        "{e}"
    );
    let e = build(ScheduleKind::Interleaved1F1B, 4, 8, 1).unwrap_err();
    assert!(e.to_string().contains("parallel.chunks"), "{e}");
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        assert!(build(kind, 4, 8, 2).unwrap_err().to_string().contains("parallel.chunks"));
    }
    assert!(build(ScheduleKind::GPipe, 0, 8, 1).unwrap_err().to_string().contains("parallel.pp"));
    assert!(build(ScheduleKind::GPipe, 2, 0, 1).unwrap_err().to_string().contains("parallel.microbatches"));
}

#[test]
fn kinds_parse_from_their_names() {
    for k in ScheduleKind::BUILT {
        assert_eq!(k.name().parse::<ScheduleKind>().unwrap(), k);
    }
    assert!("zbh1".parse::<ScheduleKind>().unwrap_err().to_string().contains("zb-h1"));
}

#[test]
fn json_round_trips_and_recognises_the_kind() {
    for kind in ScheduleKind::BUILT {
        let v = kind.default_chunks();
        let s = built(kind, 4, 8, v);
        let text = s.to_json();
        assert!(text.starts_with("{\"ranks\": [[\"0F0\","), "{text}");
        assert_eq!(Schedule::from_json(&text).unwrap(), s);
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed["ranks"].as_array().unwrap().len(), 4);
    }
    let custom =
        Schedule::from_json(r#"{"ranks": [["0F0","0F1","0B1","0B0"],["1F0","1B0","1F1","1B1"]]}"#).unwrap();
    assert_eq!(
        (custom.kind, custom.ranks, custom.chunks, custom.microbatches),
        (ScheduleKind::Custom, 2, 1, 2)
    );
    custom.validate().unwrap();
    let e = Schedule::from_json(r#"{"ranks": [["0F0","0X1"]]}"#).unwrap_err().to_string();
    assert!(e.contains("0X1") && e.contains("'X'"), "{e}");
    let e = Schedule::from_json(r#"{"ranks": [["0F0","2F0"],["1F0"]]}"#).unwrap_err().to_string();
    assert!(e.contains("3 stages"), "{e}");
}

fn two_ranks(r0: &[&str], r1: &[&str]) -> Schedule {
    let parse = |l: &[&str]| l.iter().map(|t| t.parse().unwrap()).collect();
    Schedule {
        kind: ScheduleKind::Custom,
        ranks: 2,
        chunks: 1,
        microbatches: 2,
        stage_rank: vec![0, 1],
        actions: vec![parse(r0), parse(r1)],
    }
}

#[test]
fn deadlock_names_each_stuck_rank_index_and_input() {
    let s = two_ranks(&["0F0", "0B0", "0F1", "0B1"], &["1F1", "1B1", "1F0", "1B0"]);
    s.validate().unwrap();
    let e = s.simulate(&Costs::unit()).unwrap_err();
    let ScheduleError::Deadlock { waiting } = &e else { panic!("{e}") };
    assert_eq!(
        waiting,
        &vec![
            Stuck { rank: 0, index: 1, action: Action::b(0, 0), waits_for: Action::b(1, 0), sending: false },
            Stuck { rank: 1, index: 0, action: Action::f(1, 1), waits_for: Action::f(0, 1), sending: false },
        ]
    );
    let text = e.to_string();
    assert!(text.contains("rank 0 at index 1 (0B0) waits for 1B0"), "{text}");
    assert!(text.contains("rank 1 at index 0 (1F1) waits for 0F1"), "{text}");
}

fn invalid(s: &Schedule) -> (usize, usize, Action, String) {
    match s.validate() {
        Err(ScheduleError::Invalid { rank, index, action, reason }) => (rank, index, action, reason),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn validator_catches_broken_schedules() {
    let good = ["0F0", "0F1", "0B0", "0B1"];
    two_ranks(&good, &["1F0", "1B0", "1F1", "1B1"]).validate().unwrap();

    let (r, i, a, why) = invalid(&two_ranks(&good, &["1F0", "1B0", "1F1"]));
    assert_eq!((r, i, a), (1, 3, Action::b(1, 1)));
    assert!(why.contains("missing") && why.contains("1F1 at index 2"), "{why}");

    let (r, i, a, why) = invalid(&two_ranks(&good, &["1F0", "1F0", "1B0", "1F1", "1B1"]));
    assert_eq!((r, i, a), (1, 1, Action::f(1, 0)));
    assert!(why.contains("duplicate"), "{why}");

    let (r, i, a, why) = invalid(&two_ranks(&good, &["1B0", "1F0", "1F1", "1B1"]));
    assert_eq!((r, i, a), (1, 0, Action::b(1, 0)));
    assert!(why.contains("before its forward 1F0"), "{why}");

    let (r, i, a, why) = invalid(&two_ranks(&good, &["1F0", "1B0", "0F1", "1F1", "1B1"]));
    assert_eq!((r, i, a), (1, 2, Action::f(0, 1)));
    assert!(why.contains("lives on rank 0"), "{why}");

    let (r, i, a, why) =
        invalid(&two_ranks(&["0F0", "0F1", "0B0", "0W1", "0I1"], &["1F0", "1B0", "1F1", "1B1"]));
    assert_eq!((r, i, a), (0, 3, Action::w(0, 1)));
    assert!(why.contains("before its input backward 0I1"), "{why}");

    let (.., why) = invalid(&two_ranks(&["0F0", "0F1", "0B0", "0B1", "0I1", "0W1"], &good));
    assert!(why.contains("duplicate") || why.contains("both"), "{why}");

    let (r, i, a, why) = invalid(&two_ranks(&["0F0", "0F1", "0B0", "0I1"], &["1F0", "1B0", "1F1", "1B1"]));
    assert_eq!((r, i, a), (0, 4, Action::w(0, 1)));
    assert!(why.contains("no weight backward"), "{why}");

    let (r, i, a, why) = invalid(&two_ranks(&["0F0", "0B0"], &["1F0", "1B0", "1F1", "1B1"]));
    assert_eq!((r, i, a), (0, 2, Action::f(0, 1)));
    assert!(why.contains("no forward"), "{why}");

    let (.., why) = invalid(&two_ranks(&good, &["1F0", "1B0", "1F2", "1B1"]));
    assert!(why.contains("microbatch 2 out of range"), "{why}");
    let (.., why) = invalid(&two_ranks(&good, &["1F0", "1B0", "3F1", "1B1"]));
    assert!(why.contains("stage 3 out of range"), "{why}");
}

#[test]
fn comm_latency_and_stage_factors_stretch_the_makespan() {
    let slow = Costs { comm: 0.5, ..Costs::unit() };
    // GPipe pays the latency once per boundary on the way down and once on the way up.
    let g = built(ScheduleKind::GPipe, 4, 8, 1);
    assert_eq!(g.simulate(&slow).unwrap().makespan, sim(&g).makespan + 6.0 * 0.5);
    // 1F1B's steady state waits for each round trip, so it pays more.
    let s = built(ScheduleKind::OneFOneB, 4, 8, 1);
    let base = sim(&s).makespan;
    assert!(s.simulate(&slow).unwrap().makespan > base + 6.0 * 0.5);
    let uneven = Costs { per_stage_factor: vec![1.0, 1.0, 1.0, 2.0], ..Costs::unit() };
    assert!(s.simulate(&uneven).unwrap().makespan > base);
    let wrong = Costs { per_stage_factor: vec![1.0], ..Costs::unit() };
    assert!(s.simulate(&wrong).unwrap_err().to_string().contains("costs.per_stage_factor"));
}

#[test]
fn timeline_respects_every_dependency() {
    let costs = Costs { comm: 0.25, ..Costs::unit() };
    for kind in ScheduleKind::BUILT {
        let v = kind.default_chunks();
        let s = built(kind, 4, 8, v);
        let r = s.simulate(&costs).unwrap();
        let mut end = std::collections::BTreeMap::new();
        for (a, _, e) in r.timeline.iter().flatten() {
            end.insert(*a, *e);
        }
        for (rank, line) in r.timeline.iter().enumerate() {
            for w in line.windows(2) {
                assert!(w[1].1 >= w[0].2, "{kind}: rank {rank} overlaps");
            }
            for (a, start, _) in line {
                let last = s.stages() - 1;
                let deps: Vec<Action> = match a.kind {
                    ActionKind::F if a.stage > 0 => vec![Action::f(a.stage - 1, a.mb)],
                    // The gradient from above, whichever backward (B, or I) made it:
                    // DualPipeV mixes them across stages.
                    ActionKind::B | ActionKind::I if a.stage < last => {
                        let above = Action::b(a.stage + 1, a.mb);
                        let above =
                            if end.contains_key(&above) { above } else { Action::i(a.stage + 1, a.mb) };
                        vec![Action::f(a.stage, a.mb), above]
                    }
                    ActionKind::B | ActionKind::I => vec![Action::f(a.stage, a.mb)],
                    ActionKind::W => vec![Action::i(a.stage, a.mb)],
                    _ => vec![],
                };
                for d in deps {
                    let lat = if s.rank_of(d.stage) == rank { 0.0 } else { costs.comm };
                    assert!(*start >= end[&d] + lat - 1e-9, "{kind}: {a} starts before {d} arrives");
                }
            }
        }
    }
}

#[test]
fn grid_draws_every_rank_and_the_figures() {
    let s = built(ScheduleKind::OneFOneB, 4, 8, 1);
    let g = s.grid(&sim(&s));
    let rows: Vec<&str> = g.lines().filter(|l| l.starts_with("rank")).collect();
    assert_eq!(rows.len(), 4);
    assert!(rows[0].starts_with("rank 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 -- F4"), "{g}");
    assert!(rows[3].starts_with("rank 3 | .  .  .  F0 B0 --"), "{g}");
    assert!(g.contains("makespan: 33"), "{g}");
    assert!(g.contains("theory with unit costs: 0.2727"), "{g}");
    assert!(g.contains("peak live microbatches per stage: 0: 4, 1: 3, 2: 2, 3: 1"), "{g}");
    let s = built(ScheduleKind::Interleaved1F1B, 2, 4, 2);
    let g = s.grid(&sim(&s));
    assert!(g.contains("rank 1 | .   1F0 1F1 3F0 3B0 --- 3F1"), "{g}");
}

#[test]
fn v_placement_puts_both_ends_on_rank_0_and_the_turn_on_the_last_rank() {
    assert_eq!(v_placement(4), vec![0, 1, 2, 3, 3, 2, 1, 0]);
    let s = built(ScheduleKind::ZbV, 4, 8, 2);
    assert_eq!(s.stage_rank, v_placement(4));
    assert_eq!(s.stages_of(0), vec![0, 7]);
    assert_eq!(s.stages_of(3), vec![3, 4]);
    assert_eq!((s.rank_of(0), s.rank_of(7), s.rank_of(4)), (0, 0, 3));
    // The looped kinds keep stage s on rank s % p.
    let s = built(ScheduleKind::Interleaved1F1B, 4, 8, 2);
    assert_eq!(s.stage_rank, looped_placement(4, 2));
    assert_eq!(s.stages_of(1), vec![1, 5]);
}

/// ZB-V against the zero-bubble paper, at 1F1B's peak memory (2p stage-microbatches
/// per rank, each stage half a 1F1B stage: p microbatches' worth). For the shapes
/// the paper draws (m a multiple of p, p ≤ 8) it reaches the unit-cost lower bound
/// 6m + p − 1: a sixth of 1F1B's bubble time over the same layers and half of
/// ZB-H1's. For other shapes the list scheduler can land a few units above the
/// bound (p = 8, m = 9: 4), never above ZB-H1.
#[test]
fn zb_v_reaches_its_lower_bound_at_1f1b_peak_memory() {
    for p in [1, 2, 3, 4, 8] {
        for m in 1..=4 * p {
            let s = built(ScheduleKind::ZbV, p, m, 2);
            let r = sim(&s);
            assert_ascending(&s);
            assert!(s.actions.iter().flatten().all(|a| a.kind != ActionKind::B));
            assert!(r.peak_live_rank.iter().all(|&n| n <= 2 * p), "p={p} m={m}: {:?}", r.peak_live_rank);
            if m < p {
                continue;
            }
            let (pf, mf) = (p as f64, m as f64);
            let bound = 6.0 * mf + pf - 1.0;
            if m % p == 0 {
                assert_eq!(r.makespan, bound, "p={p} m={m}");
                assert!((r.mean_bubble_frac - s.theory_bubble().unwrap()).abs() < 1e-12);
            }
            // 1F1B and ZB-H1 over the same layers: p stages of twice the work.
            let one = sim(&built(ScheduleKind::OneFOneB, p, m, 1));
            let zb_h1 = sim(&built(ScheduleKind::ZbH1, p, m, 1));
            for rank in 0..p {
                let idle = r.makespan - r.busy[rank];
                let idle_1f1b = 2.0 * (one.makespan - one.busy[rank]);
                let idle_h1 = 2.0 * (zb_h1.makespan - zb_h1.busy[rank]);
                assert!(idle <= idle_h1 + 1e-9, "p={p} m={m} rank {rank}: {idle} vs zb-h1 {idle_h1}");
                if m % p == 0 {
                    assert!(idle <= idle_1f1b / 6.0 + 1e-9, "p={p} m={m} rank {rank}: {idle} vs {idle_1f1b}");
                    assert!(idle <= idle_h1 / 2.0 + 1e-9, "p={p} m={m} rank {rank}: {idle} vs {idle_h1}");
                }
            }
        }
    }
}

#[test]
fn zb_v_needs_two_chunks() {
    for v in [1, 3] {
        let e = build(ScheduleKind::ZbV, 4, 8, v).unwrap_err();
        assert!(e.to_string().contains("parallel.chunks") && e.to_string().contains("exactly 2"), "{e}");
    }
}

#[test]
fn validator_and_simulator_follow_the_placement_not_stage_mod_p() {
    // A hand-built V with full backwards, GPipe-like: F down the V, B back up.
    let lists: Vec<Vec<Action>> = [
        ["0F0", "0F1", "3F0", "3F1", "3B0", "3B1", "0B0", "0B1"],
        ["1F0", "1F1", "2F0", "2F1", "2B0", "2B1", "1B0", "1B1"],
    ]
    .iter()
    .map(|l| l.iter().map(|a| a.parse().unwrap()).collect())
    .collect();
    let s = Schedule::from_lists(lists.clone()).unwrap();
    assert_eq!((s.ranks, s.chunks, s.microbatches), (2, 2, 2));
    assert_eq!(s.stage_rank, v_placement(2));
    s.validate().unwrap();
    let r = sim(&s);
    // Rank 1 turns the V itself: 2F0 takes 1F0's output with no message.
    assert_eq!(r.peak_live_rank, vec![4, 4]);
    assert!(r.timeline[1].iter().any(|(a, ..)| *a == Action::f(2, 0)));
    // Under the looped placement the same lists are invalid: stage 3 lives on rank 1.
    let looped = Schedule { stage_rank: looped_placement(2, 2), ..s.clone() };
    let (r, i, a, why) = invalid(&looped);
    assert_eq!((r, i, a), (0, 2, Action::f(3, 0)));
    assert!(why.contains("lives on rank 1"), "{why}");
    // A placement that gives a rank the wrong share is refused as a shape error.
    let lopsided = Schedule { stage_rank: vec![0, 0, 0, 1], ..s };
    assert!(lopsided.validate().unwrap_err().to_string().contains("every rank must hold v = 2"));
}

#[test]
fn zb_v_json_round_trips_with_its_placement() {
    let s = built(ScheduleKind::ZbV, 3, 6, 2);
    let back = Schedule::from_json(&s.to_json()).unwrap();
    assert_eq!(back, s);
    assert_eq!(back.kind, ScheduleKind::ZbV);
}

/// Rendezvous sends: a send completes only when the receiver posts its receive.
/// GPipe runs (every send meets a rank already waiting for it); 1F1B deadlocks in
/// its first steady step, each neighbour blocked sending to the other — which is why
/// Megatron-LM pairs send_forward with recv_backward.
#[test]
fn rendezvous_sends_deadlock_1f1b_but_not_gpipe() {
    for p in [2, 4] {
        let g = built(ScheduleKind::GPipe, p, 2 * p, 1);
        let buffered = g.simulate(&Costs::unit()).unwrap();
        let rendezvous = g.simulate_with(&Costs::unit(), Transport::Rendezvous).unwrap();
        assert_eq!(rendezvous.makespan, buffered.makespan, "p={p}: nobody waits on a send in GPipe");
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
            let s = built(kind, p, 2 * p, 1);
            s.simulate(&Costs::unit()).unwrap();
            let e = s.simulate_with(&Costs::unit(), Transport::Rendezvous).unwrap_err();
            let ScheduleError::Deadlock { waiting } = &e else { panic!("{e}") };
            assert!(waiting.iter().any(|w| w.sending), "{kind} p={p}: {e}");
        }
    }
    let s = built(ScheduleKind::OneFOneB, 2, 2, 1);
    let e = s.simulate_with(&Costs::unit(), Transport::Rendezvous).unwrap_err();
    let ScheduleError::Deadlock { waiting } = &e else { panic!("{e}") };
    assert_eq!(
        waiting,
        &vec![
            Stuck { rank: 0, index: 1, action: Action::f(0, 1), waits_for: Action::f(1, 1), sending: true },
            Stuck { rank: 1, index: 1, action: Action::b(1, 0), waits_for: Action::b(0, 0), sending: true },
        ]
    );
    assert!(e.to_string().contains("rank 0 at index 1 (0F1) is blocked sending to 1F1"), "{e}");
}

#[test]
fn rendezvous_sends_cost_the_wait_for_the_receiver() {
    // GPipe over a slow stage 1 (F takes 3): buffered, rank 0 runs its forwards back
    // to back; rendezvous, each send waits until rank 1 reaches the matching F.
    let s = built(ScheduleKind::GPipe, 2, 3, 1);
    let costs = Costs { per_stage_factor: vec![1.0, 3.0], ..Costs::unit() };
    let b = s.simulate(&costs).unwrap();
    let r = s.simulate_with(&costs, Transport::Rendezvous).unwrap();
    assert_eq!(b.timeline[0][2], (Action::f(0, 2), 2.0, 3.0));
    // 0F1's send completes at 4 (1F0 runs 1..4), 0F2's at 7 (1F1 runs 4..7).
    assert_eq!(r.timeline[0][2], (Action::f(0, 2), 4.0, 5.0));
    assert_eq!(r.busy, b.busy);
    assert!(r.makespan >= b.makespan);
}

#[test]
fn shapes_too_large_to_build_are_refused_naming_the_field_before_allocating() {
    let big = 1usize << 40;
    for (kind, p, m, v, field) in [
        (ScheduleKind::OneFOneB, big, 4, 1, "parallel.pp"),
        (ScheduleKind::OneFOneB, 100_000, 100_000, 1, "parallel.pp"),
        (ScheduleKind::OneFOneB, 4000, 4000, 1, "parallel.microbatches"),
        (ScheduleKind::GPipe, 1, big, 1, "parallel.microbatches"),
        (ScheduleKind::Interleaved1F1B, 2, 4, 1 << 62, "parallel.chunks"),
    ] {
        let err = build(kind, p, m, v).unwrap_err();
        assert!(matches!(&err, ScheduleError::Unsupported { field: f, .. } if f == field), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(&MAX_ACTIONS.to_string()) || msg.contains(&MAX_RANKS.to_string()), "{msg}");
    }
    // The limit leaves every shape the trainer and the benchmarks use.
    build(ScheduleKind::OneFOneB, 32, 256, 1).unwrap();
    build(ScheduleKind::Interleaved1F1B, 8, 64, 4).unwrap();
}

/// Each stage's weight-gradient halves (B, or W) by microbatch: the order gradients
/// accumulate in, which must be ascending for a pipeline's bits to equal pp = 1's.
fn accumulation_order(s: &Schedule, stage: usize) -> Vec<usize> {
    s.actions[s.rank_of(stage)]
        .iter()
        .filter(|a| a.stage == stage && matches!(a.kind, ActionKind::B | ActionKind::W))
        .map(|a| a.mb)
        .collect()
}

/// PyTorch's own per-rank order, written out once (not computed here, so the test
/// needs no Python): `ScheduleDualPipeV._calculate_single_rank_operations` of torch
/// 2.15.0 run for each rank with only `pp_group_size` and `_n_microbatches` set,
/// each `OVERLAP_F_B` action written as its two sub-actions, forward first (the
/// order its runtime runs them), `FULL_BACKWARD` as B, `BACKWARD_INPUT` as I,
/// `BACKWARD_WEIGHT` as W. The shapes: p = 1; the smallest m = 2p for p = 2, 3, 4;
/// an odd m; rank p − 1's un-overlapped first pair shows in each.
#[test]
fn dualpipev_runs_pytorchs_order() {
    let pytorch: &[(usize, usize, &[&str])] = &[
        (1, 2, &[
            "0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1",
        ]),
        (2, 4, &[
            "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
            "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
        ]),
        (2, 5, &[
            "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 0F4 3B2 3F3 0B1 3B3 3F4 0B2 3B4 0I3 0W3 0I4 0W4",
            "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 1F4 2B2 2F4 1B2 2B3 1B3 2I4 1I4 2W4 1W4",
        ]),
        (3, 6, &[
            "0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 0F5 5B2 5F3 0B0 5B3 5F4 0B1 5B4 5F5 0B2 5B5 0I3 0W3 0I4 0W4 0I5 0W5",
            "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 1F4 4B1 4F3 1B0 1F5 4B2 4F4 1B1 4B3 4F5 1B2 4B4 1B3 4I5 1I4 4W5 1I5 1W4 1W5",
            "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3F3 2B0 2F4 3B1 3F4 2B1 2F5 3B2 3F5 2B2 3B3 2B3 3B4 2I4 3I5 2I5 2W4 3W5 2W5",
        ]),
        (4, 8, &[
            "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7 7B3 7F4 0B0 7B4 7F5 0B1 7B5 7F6 0B2 7B6 7F7 0B3 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
            "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 1F6 6B2 6F4 1B0 1F7 6B3 6F5 1B1 6B4 6F6 1B2 6B5 6F7 1B3 6B6 1B4 6I7 1I5 6W7 1I6 1W5 1I7 1W6 1W7",
            "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2F5 5B1 5F4 2B0 2F6 5B2 5F5 2B1 2F7 5B3 5F6 2B2 5B4 5F7 2B3 5B5 2B4 5B6 2I5 5I7 2I6 2W5 2I7 5W7 2W6 2W7",
            "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4 3B0 3F5 4B1 4F5 3B1 3F6 4B2 4F6 3B2 3F7 4B3 4F7 3B3 4B4 3B4 4B5 3B5 4I6 3I6 4I7 3I7 4W6 3W6 4W7 3W7",
        ]),
    ];
    for &(p, m, ranks) in pytorch {
        let s = built(ScheduleKind::DualPipeV, p, m, 2);
        for (r, want) in ranks.iter().enumerate() {
            let got: Vec<String> = s.actions[r].iter().map(|a| a.to_string()).collect();
            assert_eq!(got.join(" "), *want, "p={p} m={m} rank {r}");
        }
        assert_eq!(s.stage_rank, v_placement(p));
    }
}

/// Every shape DualPipeV takes (m ≥ 2p): valid, each stage's actions and its
/// gradient accumulation in microbatch order, the makespan ZB-V's unit-cost lower
/// bound 6m + p − 1 for every m (ZB-V's list scheduler reaches it only for m a
/// multiple of p), and 2p + 1 stage-microbatches alive per rank — one more than
/// ZB-V and 1F1B, DeepSeek's "PP + 1" with PP = 2p stages.
#[test]
fn dualpipev_meets_zb_vs_bound_for_every_m_at_one_more_live_microbatch() {
    for p in PS {
        for m in 2 * p..=4 * p + 1 {
            let s = built(ScheduleKind::DualPipeV, p, m, 2);
            let r = sim(&s);
            assert_ascending(&s);
            for stage in 0..s.stages() {
                let o = accumulation_order(&s, stage);
                assert_eq!(o, (0..m).collect::<Vec<_>>(), "p={p} m={m} stage {stage}");
            }
            assert_eq!(r.makespan, (6 * m + p - 1) as f64, "p={p} m={m}");
            let theory = s.theory_bubble().unwrap();
            assert!(
                (r.mean_bubble_frac - theory).abs() < 1e-12,
                "p={p} m={m}: {} vs {theory}",
                r.mean_bubble_frac
            );
            assert_eq!(r.peak_live_rank, vec![2 * p + 1; p], "p={p} m={m}");
            // Both backward forms: B where a pair needs it, I and W where W fills a gap.
            let kinds: Vec<ActionKind> = s.actions.iter().flatten().map(|a| a.kind).collect();
            assert!(kinds.contains(&ActionKind::B) && kinds.contains(&ActionKind::W), "p={p} m={m}");
        }
    }
}

/// DualPipe's claim: the bubble does not grow with the microbatches. Checked with
/// costs where F, I and W differ (the V's list-built ZB-V is tuned to unit costs and
/// does grow there): each rank idles the same at m = 2p as at m = 8p.
#[test]
fn dualpipev_idle_time_does_not_grow_with_microbatches() {
    for (forward, input, weight) in [(2.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5)] {
        let costs = Costs {
            forward,
            backward: input + weight,
            backward_input: input,
            backward_weight: weight,
            ..Costs::unit()
        };
        for p in [2, 4, 8] {
            let idle = |m: usize| {
                let r = built(ScheduleKind::DualPipeV, p, m, 2).simulate(&costs).unwrap();
                bubble_time(&r)
            };
            assert_eq!(idle(2 * p), idle(8 * p), "F={forward} I={input} W={weight} p={p}");
        }
    }
}

#[test]
fn dualpipev_refuses_what_pytorch_refuses() {
    // PyTorch: "DualPipeV requires at least as many microbatches as stages".
    let e = build(ScheduleKind::DualPipeV, 4, 7, 2).unwrap_err();
    assert!(
        matches!(&e, ScheduleError::Unsupported { field, .. } if field == "parallel.microbatches"),
        "{e}"
    );
    assert!(e.to_string().contains("2 × 4 = 8 stages") && e.to_string().contains("got 7"), "{e}");
    // PyTorch: "requires exactly 2 stages per rank".
    for v in [1, 3] {
        let e = build(ScheduleKind::DualPipeV, 4, 8, v).unwrap_err();
        assert!(e.to_string().contains("parallel.chunks") && e.to_string().contains("exactly 2"), "{e}");
    }
    assert_eq!(ScheduleKind::DualPipeV.chunks_for(1), Some(2));
    assert_eq!("dualpipev".parse::<ScheduleKind>().unwrap(), ScheduleKind::DualPipeV);
}
