//! One function per schedule kind, each returning the per-rank action lists.
//!
//! A new kind (ZB-V, DualPipeV, …) is a variant of `ScheduleKind`, a function here and
//! an arm in [`build_actions`]. Every builder keeps each stage's backwards (B, or I
//! and W) in ascending microbatch order: gradient accumulation then runs in
//! microbatch order on every stage, which is what makes a pipeline bit-identical to a
//! single stage.

use super::{Action, ScheduleError, ScheduleKind};

type Lists = Vec<Vec<Action>>;

fn unsupported(field: &str, reason: String) -> ScheduleError {
    ScheduleError::Unsupported { field: field.into(), reason }
}

/// Checks the shape, then dispatches to the kind's builder.
pub(super) fn build_actions(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
) -> Result<Lists, ScheduleError> {
    if p == 0 {
        return Err(unsupported("parallel.pp", "a pipeline needs at least 1 rank".into()));
    }
    if m == 0 {
        return Err(unsupported("parallel.microbatches", "a step needs at least 1 microbatch".into()));
    }
    if v == 0 {
        return Err(unsupported("parallel.chunks", "each rank needs at least 1 model chunk".into()));
    }
    let one_chunk = |name: &str| {
        if v == 1 {
            Ok(())
        } else {
            Err(unsupported(
                "parallel.chunks",
                format!("{name} runs one model chunk per rank, not {v}; use interleaved for more"),
            ))
        }
    };
    match kind {
        ScheduleKind::GPipe => one_chunk("gpipe").map(|_| gpipe(p, m)),
        ScheduleKind::OneFOneB => one_chunk("1f1b").map(|_| one_f_one_b(p, m)),
        ScheduleKind::Interleaved1F1B => interleaved(p, m, v),
        ScheduleKind::ZbH1 => one_chunk("zb-h1").map(|_| zb_h1(p, m)),
        ScheduleKind::Custom => {
            Err(unsupported("parallel.schedule", "a custom schedule is loaded from JSON, not built".into()))
        }
    }
}

/// GPipe: rank r runs F of every microbatch on stage r, then B of every microbatch,
/// both in microbatch order.
fn gpipe(p: usize, m: usize) -> Lists {
    (0..p)
        .map(|r| (0..m).map(|mb| Action::f(r, mb)).chain((0..m).map(|mb| Action::b(r, mb))).collect())
        .collect()
}

/// 1F1B: rank r runs min(p − r − 1, m) warmup forwards, then alternates one F and
/// one B, then the remaining Bs. At most p − r microbatches are alive on stage r.
fn one_f_one_b(p: usize, m: usize) -> Lists {
    (0..p)
        .map(|r| {
            let warmup = (p - r - 1).min(m);
            let mut list: Vec<Action> = (0..warmup).map(|mb| Action::f(r, mb)).collect();
            for i in 0..m - warmup {
                list.push(Action::f(r, warmup + i));
                list.push(Action::b(r, i));
            }
            list.extend((m - warmup..m).map(|mb| Action::b(r, mb)));
            list
        })
        .collect()
}

/// Interleaved 1F1B, Megatron-LM's rule. The m·v virtual microbatches k run, on
/// rank r, forward on chunk (k / p) % v and backward on chunk v − 1 − (k / p) % v,
/// both for microbatch (k / (p·v))·p + k % p; chunk c of rank r is stage c·p + r.
/// Warmup is min((p − r − 1)·2 + (v − 1)·p, m·v) forwards, then 1F1B, then cooldown.
/// Needs m % p == 0 so that every group of p microbatches visits every chunk.
fn interleaved(p: usize, m: usize, v: usize) -> Result<Lists, ScheduleError> {
    if v < 2 {
        return Err(unsupported(
            "parallel.chunks",
            format!("interleaved 1F1B needs at least 2 model chunks per rank, got {v}; use 1f1b for 1"),
        ));
    }
    if !m.is_multiple_of(p) {
        return Err(unsupported(
            "parallel.microbatches",
            format!("interleaved 1F1B needs a multiple of the {p} pipeline ranks, got {m}"),
        ));
    }
    let total = m * v;
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let fwd = |r: usize, k: usize| Action::f(((k / p) % v) * p + r, mb_of(k));
    let bwd = |r: usize, k: usize| Action::b((v - 1 - (k / p) % v) * p + r, mb_of(k));
    Ok((0..p)
        .map(|r| {
            let warmup = ((p - r - 1) * 2 + (v - 1) * p).min(total);
            let mut list: Vec<Action> = (0..warmup).map(|k| fwd(r, k)).collect();
            for i in 0..total - warmup {
                list.push(fwd(r, warmup + i));
                list.push(bwd(r, i));
            }
            list.extend((total - warmup..total).map(|k| bwd(r, k)));
            list
        })
        .collect())
}

/// ZB-H1 by greedy list scheduling with unit costs (F = I = W = 1, no comm): at each
/// time step every idle rank r takes, in this order of preference, its next I if its
/// input gradient has arrived; its next F if the activation has arrived and fewer
/// than p − r microbatches are alive on the stage (F done, W not); its oldest pending
/// W; else it waits. The order in which each rank ran its actions is the schedule.
/// I, F and W each run in ascending microbatch order on every stage; peak live
/// microbatches match 1F1B's (p − s on stage s).
fn zb_h1(p: usize, m: usize) -> Lists {
    // Times at which F / I of (stage, mb) finished; None = not yet.
    let mut f_done = vec![vec![None::<usize>; m]; p];
    let mut i_done = vec![vec![None::<usize>; m]; p];
    let (mut next_f, mut next_i, mut next_w) = (vec![0; p], vec![0; p], vec![0; p]);
    let mut lists: Lists = vec![Vec::with_capacity(3 * m); p];
    let arrived = |t: Option<usize>, now: usize| t.is_some_and(|t| t <= now);
    let mut now = 0;
    while next_w.iter().any(|&w| w < m) {
        // Decide for every rank at `now` from what finished by `now`, then commit, so
        // no rank sees a result produced in the same time step.
        let mut chosen = Vec::with_capacity(p);
        for r in 0..p {
            let live = next_f[r] - next_w[r];
            let (f, i) = (next_f[r], next_i[r]);
            let i_ready =
                i < m && arrived(f_done[r][i], now) && (r + 1 == p || arrived(i_done[r + 1][i], now));
            let f_ready = f < m && live < p - r && (r == 0 || arrived(f_done[r - 1][f], now));
            let w_ready = next_w[r] < next_i[r];
            chosen.push(if i_ready {
                Some(Action::i(r, i))
            } else if f_ready {
                Some(Action::f(r, f))
            } else if w_ready {
                Some(Action::w(r, next_w[r]))
            } else {
                None
            });
        }
        for (r, a) in chosen.into_iter().enumerate() {
            let Some(a) = a else { continue };
            match a.kind {
                super::ActionKind::F => {
                    f_done[r][a.mb] = Some(now + 1);
                    next_f[r] += 1;
                }
                super::ActionKind::I => {
                    i_done[r][a.mb] = Some(now + 1);
                    next_i[r] += 1;
                }
                _ => next_w[r] += 1,
            }
            lists[r].push(a);
        }
        now += 1;
        debug_assert!(now <= 3 * m * p + 3 * p, "zb-h1 greedy made no progress");
    }
    lists
}
