//! The simulated backend runs the real actors, messages and schedules with
//! sleeping stages; what it measures must match what the schedule simulator
//! (and so the planner, which uses it) predicts. One test in its own binary, so
//! no other test competes for the cores while it measures.

use pipewright::bench::sim_rows;

#[test]
fn measured_bubbles_match_the_simulator_and_the_runtime_costs_little() {
    for schedule in ["1f1b", "gpipe"] {
        // 10 ms / 20 ms actions: long enough that a busy CI box's scheduling
        // jitter stays small beside them (the bench uses 2 ms / 4 ms).
        let rows = sim_rows(schedule, &[(2, 4), (4, 8), (4, 16)], 10.0, 20.0, 3).unwrap();
        for r in rows {
            let what = format!("{schedule} pp={} m={}", r.pp, r.microbatches);
            assert!(
                (r.measured_bubble - r.theory_bubble).abs() < 0.02,
                "{what}: measured bubble {:.4}, theory {:.4}",
                r.measured_bubble,
                r.theory_bubble
            );
            // On a shared 2-core CI box sleeps overshoot; the target (≤ 3%) is
            // checked by `pipewright bench --sim` on a quiet machine.
            assert!(r.overhead < 0.10, "{what}: runtime overhead {:.2}%", 100.0 * r.overhead);
        }
    }
}
