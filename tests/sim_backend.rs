//! The simulated backend runs the real actors, messages and schedules with
//! sleeping stages; what it measures must match what the schedule simulator
//! (and so the planner, which uses it) predicts. One test in its own binary, so
//! no other test competes for the cores while it measures.

use pipewright::bench::sim_rows;

/// How many times a cell is measured before a miss counts. A CI box shared
/// with other jobs can stall a thread for milliseconds; such a stall lands in
/// the measured bubble as idle time that the schedule did not cause. A
/// runtime that really adds waits misses on every attempt.
const ATTEMPTS: usize = 3;

#[test]
fn measured_bubbles_match_the_schedule_simulator() {
    for schedule in ["1f1b", "gpipe"] {
        for cell in [(2, 4), (4, 8), (4, 16)] {
            let mut seen = Vec::new();
            let matched = (0..ATTEMPTS).any(|_| {
                // 10 ms / 20 ms actions: long enough that scheduling jitter
                // stays small beside them (the bench uses 2 ms / 4 ms).
                let r = sim_rows(schedule, &[cell], 10.0, 20.0, 3).unwrap().remove(0);
                seen.push(format!(
                    "bubble {:.4} vs theory {:.4} (overhead {:.2}%)",
                    r.measured_bubble,
                    r.theory_bubble,
                    100.0 * r.overhead
                ));
                (r.measured_bubble - r.theory_bubble).abs() < 0.02
            });
            assert!(matched, "{schedule} pp={} m={}: {}", cell.0, cell.1, seen.join("; "));
        }
    }
}
